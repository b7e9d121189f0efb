//! The handler's side of the launcher control protocol (`api::protocol`), async: one
//! connection per reconcile, greeted with the newest version; an answer that is not the
//! protocol is reported as such, never trusted.

use std::path::{Path, PathBuf};
use std::time::Duration;

use api::protocol::{Request, Response, StatusReport, PROTOCOL_VERSION};
use api::VirtualMachineInstance;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

/// Where a launcher Pod's control socket is on the node: the Pod's `sockets` emptyDir as the
/// kubelet lays it out (the handler mounts the kubelet's pods directory).
pub fn socket_path(pods_dir: &Path, pod_uid: &str) -> PathBuf {
    pods_dir
        .join(pod_uid)
        .join("volumes/kubernetes.io~empty-dir/sockets/launcher.sock")
}

#[derive(Debug, thiserror::Error)]
pub enum LauncherError {
    #[error("launcher socket {path}: {source}")]
    Connect {
        path: String,
        source: std::io::Error,
    },
    #[error("launcher: {0}")]
    Io(#[from] std::io::Error),
    #[error("launcher did not answer within {0:?}")]
    Timeout(Duration),
    #[error("launcher answered something that is not the control protocol: {0}")]
    Garbage(String),
    #[error("launcher refused: {0}")]
    Refused(String),
}

pub struct LauncherClient {
    reader: BufReader<tokio::net::unix::OwnedReadHalf>,
    writer: tokio::net::unix::OwnedWriteHalf,
    pub launcher_version: String,
    /// The launcher's PID (in this process's PID namespace, from the socket's peer
    /// credentials): the way into its Pod's network namespace.
    pub pid: Option<u32>,
    timeout: Duration,
}

impl LauncherClient {
    pub async fn connect(path: &Path, timeout: Duration) -> Result<LauncherClient, LauncherError> {
        let err = |source| LauncherError::Connect {
            path: path.display().to_string(),
            source,
        };
        // A socket path is limited to 107 bytes, and the kubelet's pods directory plus a Pod
        // UID and the volume layout can be longer: connect through the directory's descriptor
        // (/proc/self/fd/N/NAME) instead.
        let dir = std::fs::File::open(path.parent().unwrap_or(Path::new("/"))).map_err(err)?;
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let short = format!(
            "/proc/self/fd/{}/{name}",
            std::os::fd::AsRawFd::as_raw_fd(&dir)
        );
        let stream = tokio::time::timeout(timeout, UnixStream::connect(&short))
            .await
            .map_err(|_| LauncherError::Timeout(timeout))?
            .map_err(err)?;
        drop(dir);
        let pid = stream
            .peer_cred()
            .ok()
            .and_then(|c| c.pid())
            .and_then(|p| u32::try_from(p).ok())
            .filter(|p| *p > 0);
        let (r, w) = stream.into_split();
        let mut c = LauncherClient {
            reader: BufReader::new(r),
            writer: w,
            launcher_version: String::new(),
            pid,
            timeout,
        };
        match c
            .call(&Request::Hello {
                version: PROTOCOL_VERSION,
            })
            .await?
        {
            Response::Hello { launcher, .. } => c.launcher_version = launcher,
            Response::Error { message } => return Err(LauncherError::Refused(message)),
            other => return Err(LauncherError::Garbage(format!("{other:?}"))),
        }
        Ok(c)
    }

    pub async fn call(&mut self, r: &Request) -> Result<Response, LauncherError> {
        let mut line = serde_json::to_string(r).expect("serializable");
        line.push('\n');
        self.writer.write_all(line.as_bytes()).await?;
        self.next_answer().await
    }

    /// The next line the launcher sends (a streamed event, or the answer after them).
    pub async fn next_answer(&mut self) -> Result<Response, LauncherError> {
        let mut answer = String::new();
        let n = tokio::time::timeout(self.timeout, self.reader.read_line(&mut answer))
            .await
            .map_err(|_| LauncherError::Timeout(self.timeout))??;
        if n == 0 {
            return Err(LauncherError::Io(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the launcher closed the connection",
            )));
        }
        serde_json::from_str(&answer)
            .map_err(|_| LauncherError::Garbage(answer.trim_end().chars().take(120).collect()))
    }

    /// Hands the launcher its NICs: the message and, attached to its first bytes, the
    /// descriptors (SCM_RIGHTS). The launcher then owns duplicates; ours close on return.
    pub async fn attach_network(
        &mut self,
        nics: Vec<api::protocol::HandedNic>,
        fds: Vec<std::os::fd::OwnedFd>,
    ) -> Result<(), LauncherError> {
        use sendfd::SendWithFd;
        use std::os::fd::AsRawFd;
        let mut line = serde_json::to_string(&Request::AttachNetwork {
            nics,
            fds: fds.len(),
        })
        .expect("serializable");
        line.push('\n');
        let raw: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let stream: &UnixStream = self.writer.as_ref();
        let sent = loop {
            tokio::time::timeout(self.timeout, stream.writable())
                .await
                .map_err(|_| LauncherError::Timeout(self.timeout))??;
            match stream.send_with_fd(line.as_bytes(), &raw) {
                Ok(n) => break n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e.into()),
            }
        };
        // The descriptors went with the first chunk; the rest of the line is plain bytes.
        self.writer.write_all(&line.as_bytes()[sent..]).await?;
        match self.next_answer().await? {
            Response::Ok => Ok(()),
            Response::Error { message } => Err(LauncherError::Refused(message)),
            other => Err(LauncherError::Garbage(format!("{other:?}"))),
        }
    }

    pub async fn status(&mut self) -> Result<StatusReport, LauncherError> {
        match self.call(&Request::Status).await? {
            Response::Status(s) => Ok(*s),
            Response::Error { message } => Err(LauncherError::Refused(message)),
            other => Err(LauncherError::Garbage(format!("{other:?}"))),
        }
    }

    /// Creates the VM the VMI describes (a no-op when the launcher runs one already).
    pub async fn sync(&mut self, vmi: &VirtualMachineInstance) -> Result<(), LauncherError> {
        match self
            .call(&Request::Sync {
                vmi: Box::new(vmi.clone()),
            })
            .await?
        {
            Response::Ok => Ok(()),
            Response::Error { message } => Err(LauncherError::Refused(message)),
            other => Err(LauncherError::Garbage(format!("{other:?}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    /// A socket that answers like something else entirely is reported, not trusted.
    #[tokio::test]
    async fn garbage_and_wrong_versions_are_reported() {
        let dir = std::env::temp_dir().join(format!("mvh-lc-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for (i, answer) in [
            "HTTP/1.1 400 Bad Request\r\n\r\n".to_string(),
            "{\"response\":\"error\",\"message\":\"protocol version 3 is not supported\"}\n".into(),
            "{\"response\":\"pong\"}\n".into(),
        ]
        .into_iter()
        .enumerate()
        {
            let path = dir.join(format!("s{i}.sock"));
            let l = tokio::net::UnixListener::bind(&path).unwrap();
            let server = tokio::spawn(async move {
                let (mut s, _) = l.accept().await.unwrap();
                let mut b = [0u8; 256];
                let _ = s.read(&mut b).await;
                s.write_all(answer.as_bytes()).await.unwrap();
            });
            let e = LauncherClient::connect(&path, Duration::from_secs(5))
                .await
                .err()
                .expect("refused");
            match i {
                0 => assert!(
                    matches!(e, LauncherError::Garbage(ref g) if g.starts_with("HTTP/1.1")),
                    "{e}"
                ),
                1 => assert!(
                    matches!(e, LauncherError::Refused(ref m) if m.contains("not supported")),
                    "{e}"
                ),
                _ => assert!(matches!(e, LauncherError::Garbage(_)), "{e}"),
            }
            server.await.unwrap();
        }
        // Nobody listening, or silence: errors with the path, or a timeout.
        let e = LauncherClient::connect(&dir.join("none.sock"), Duration::from_secs(1))
            .await
            .err()
            .unwrap();
        assert!(e.to_string().contains("none.sock"), "{e}");
        let path = dir.join("silent.sock");
        let l = tokio::net::UnixListener::bind(&path).unwrap();
        let _keep = tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(5)).await;
            drop(s);
        });
        let e = LauncherClient::connect(&path, Duration::from_millis(300))
            .await
            .err()
            .unwrap();
        assert!(matches!(e, LauncherError::Timeout(_)), "{e}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
