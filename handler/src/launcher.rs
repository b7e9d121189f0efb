//! The handler's side of the launcher control protocol (`api::protocol`), async: one
//! connection per reconcile, greeted with the newest version; an answer that is not the
//! protocol is reported as such, never trusted.

use std::path::{Path, PathBuf};
use std::time::Duration;

use api::protocol::{Request, Response, StatusReport, NETWORK_SINCE, PROTOCOL_VERSION};

/// The oldest protocol version virt-handler still drives: the Pod network's hand-over
/// (`AttachNetwork`) is how every launcher it starts gets its NICs.
pub const OLDEST_SPOKEN: u32 = NETWORK_SINCE;
use api::VirtualMachineInstance;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

/// Where a launcher Pod's control socket is on the node (`api::launcher_pod`).
pub fn socket_path(pods_dir: &Path, pod_uid: &str) -> PathBuf {
    api::launcher_pod::control_socket_on_node(pods_dir, pod_uid)
}

/// A Pod UID as the API server makes them (a UUID): anything else would let a crafted value
/// name another directory below the kubelet's pods directory.
pub fn check_pod_uid(uid: &str) -> Result<(), String> {
    let ok = !uid.is_empty()
        && uid.len() <= 64
        && uid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "Pod UID {uid:?} is not a UID (letters, digits and '-' only)"
        ))
    }
}

/// Opens `path` below `root` with `flags` (and `mode` for a file it creates), refusing every
/// symbolic link on the way and any path that leaves `root` (`openat2` with
/// `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`): what is below a Pod's
/// directory is the tenant's to arrange, and the root node agent must reach only what the
/// path names.
pub fn open_beneath(
    root: &Path,
    path: &Path,
    flags: i32,
    mode: u32,
) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    use std::os::unix::ffi::OsStrExt;
    let rel = path.strip_prefix(root).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} is not below {}", path.display(), root.display()),
        )
    })?;
    let root_fd = std::fs::File::open(root)?;
    let rel = std::ffi::CString::new(rel.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: open_how is plain data; zeroed is a valid value.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (flags | libc::O_CLOEXEC) as u64;
    how.mode = if flags & libc::O_CREAT != 0 {
        mode as u64
    } else {
        0
    };
    how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
    // SAFETY: openat2 reads `how` (its size given) and the NUL-terminated `rel`.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            std::os::fd::AsRawFd::as_raw_fd(&root_fd),
            rel.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ELOOP) | Some(libc::EXDEV) => std::io::Error::new(
                e.kind(),
                format!(
                    "{}: a symbolic link (or a path leaving {}) is on the way to it; refused",
                    path.display(),
                    root.display()
                ),
            ),
            _ => e,
        });
    }
    // SAFETY: openat2 returned a new descriptor that we now own.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

/// Opens the socket file at `path` as an `O_PATH` descriptor without following any symbolic
/// link and without leaving `root`, the kubelet's pods directory (`openat2` with
/// `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`). The directories below a Pod's are writable by the
/// Pod's user: a `launcher.sock` that is a link to the node's container runtime socket, or a
/// directory swapped for a link to another Pod's, must not be what the root node agent talks
/// to. Connecting through `/proc/self/fd/N` of this descriptor reaches exactly that inode.
fn open_socket_beneath(root: &Path, path: &Path) -> std::io::Result<std::os::fd::OwnedFd> {
    // No O_NOFOLLOW: with it O_PATH would open a final link itself; RESOLVE_NO_SYMLINKS
    // refuses it instead (ELOOP), like every link before it.
    let fd = open_beneath(root, path, libc::O_PATH, 0)?;
    let meta = std::fs::metadata(format!(
        "/proc/self/fd/{}",
        std::os::fd::AsRawFd::as_raw_fd(&fd)
    ))?;
    use std::os::unix::fs::FileTypeExt;
    if !meta.file_type().is_socket() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a socket; refused",
        ));
    }
    Ok(fd)
}

/// Connects to the unix socket at `path`, which must lie below `root` with no symbolic link
/// on the way (`open_socket_beneath`). Connecting through /proc/self/fd/N also keeps the path
/// short: a socket path is limited to 107 bytes, and the kubelet's pods directory plus a Pod
/// UID and the volume layout can be longer.
async fn connect_unix_beneath(root: &Path, path: &Path) -> std::io::Result<UnixStream> {
    let sock = open_socket_beneath(root, path)?;
    let short = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&sock));
    let stream = UnixStream::connect(&short).await;
    drop(sock);
    stream
}

/// Connects to a socket in a Pod's directory below the kubelet's `pods_dir`
/// (`pods_dir/<Pod UID>/...`), links refused (`open_socket_beneath`), and makes sure the
/// process listening on it belongs to that Pod (`check_peer_in_pod`) before the caller sends
/// a byte: a tenant can bind any socket in its own directories, but it cannot move a process
/// of another Pod's — or the node's — into its Pod's cgroup, so a socket passed in from
/// elsewhere (SCM_RIGHTS, a bind mount) is refused.
pub async fn connect_pod_socket(pods_dir: &Path, path: &Path) -> std::io::Result<UnixStream> {
    let invalid = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, why);
    let pod_uid = path
        .strip_prefix(pods_dir)
        .ok()
        .and_then(|rel| rel.components().next())
        .and_then(|c| c.as_os_str().to_str())
        .ok_or_else(|| {
            invalid(format!(
                "{} is not in a Pod's directory below {}",
                path.display(),
                pods_dir.display()
            ))
        })?;
    check_pod_uid(pod_uid).map_err(invalid)?;
    let stream = connect_unix_beneath(pods_dir, path).await?;
    let pid = stream.peer_cred()?.pid().unwrap_or(0);
    check_peer_in_pod(pid, pod_uid).map_err(|why| {
        std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("{why}; refused"),
        )
    })?;
    Ok(stream)
}

/// Whether the process `pid` (this process's PID namespace: the handler runs with the host's)
/// is in the cgroup of the Pod with `pod_uid`, read from /proc/PID/cgroup.
pub fn check_peer_in_pod(pid: i32, pod_uid: &str) -> Result<(), String> {
    if pid <= 0 {
        return Err(format!(
            "the socket's peer has no process in this PID namespace, so it cannot be shown to be Pod {pod_uid}'s"
        ));
    }
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .map_err(|e| format!("reading /proc/{pid}/cgroup of the socket's peer: {e}"))?;
    if cgroup_names_pod(&cgroups, pod_uid) {
        Ok(())
    } else {
        let first = cgroups.lines().next().unwrap_or("").trim();
        Err(format!(
            "the socket's peer (pid {pid}, cgroup {first:?}) is not in Pod {pod_uid}'s cgroup"
        ))
    }
}

/// Whether a /proc/PID/cgroup text names the Pod `pod_uid` the way the kubelet lays out Pod
/// cgroups: `pod<UID>` as a path component with the cgroupfs driver
/// (`/kubepods/burstable/pod<UID>/<container>`), `kubepods-…-pod<UID with '_'>.slice` with the
/// systemd driver. Only whole components count, so a container named after a Pod, or a Pod
/// UID that is a prefix of another, is no match. One hierarchy naming the Pod is enough: a
/// Pod's processes cannot move themselves between cgroups (a container's cgroup file system
/// is read-only), and cgroup v1 nodes leave some controllers outside the kubelet's layout.
pub fn cgroup_names_pod(cgroups: &str, pod_uid: &str) -> bool {
    let cgroupfs = format!("pod{pod_uid}");
    let systemd = format!("-pod{}.slice", pod_uid.replace('-', "_"));
    cgroups.lines().any(|line| {
        // hierarchy-ID:controllers:path (the path may hold ':')
        let Some(path) = line.splitn(3, ':').nth(2) else {
            return false;
        };
        path.split('/')
            .any(|c| c == cgroupfs || (c.starts_with("kubepods") && c.ends_with(systemd.as_str())))
    })
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
    /// The protocol version this connection speaks (the newest both sides do).
    pub protocol_version: u32,
    /// The launcher's PID (in this process's PID namespace, from the socket's peer
    /// credentials): the way into its Pod's network namespace.
    pub pid: Option<u32>,
    timeout: Duration,
}

impl LauncherClient {
    /// Connects to the launcher socket of the Pod with `pod_uid` below `pods_dir` (the
    /// kubelet's pods directory), refusing links and paths that leave it.
    pub async fn connect_pod(
        pods_dir: &Path,
        pod_uid: &str,
        timeout: Duration,
    ) -> Result<LauncherClient, LauncherError> {
        let path = socket_path(pods_dir, pod_uid);
        Self::connect_beneath(pods_dir, &path, timeout).await
    }

    /// Connects to the launcher socket `path` in a Pod's directory below `pods_dir`, links
    /// refused and the listener checked to be that Pod's (see `connect_pod_socket`).
    pub async fn connect_beneath(
        pods_dir: &Path,
        path: &Path,
        timeout: Duration,
    ) -> Result<LauncherClient, LauncherError> {
        Self::open(path, timeout, || connect_pod_socket(pods_dir, path)).await
    }

    /// Connects to the socket at `path` as it is (a launcher the caller started itself; no
    /// link is followed).
    pub async fn connect(path: &Path, timeout: Duration) -> Result<LauncherClient, LauncherError> {
        let root = path.parent().unwrap_or(Path::new("/"));
        Self::open(path, timeout, || connect_unix_beneath(root, path)).await
    }

    /// Greets the launcher `connect` reaches, each attempt within `timeout`: in the newest
    /// protocol version, and again in each older one down to `OLDEST_SPOKEN` while the launcher
    /// answers that it does not speak it — so a launcher of an older release, still running its
    /// guest, keeps being served by a newer handler.
    async fn open<F, Fut>(
        path: &Path,
        timeout: Duration,
        connect: F,
    ) -> Result<LauncherClient, LauncherError>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = std::io::Result<UnixStream>>,
    {
        let mut version = PROTOCOL_VERSION;
        loop {
            let stream = tokio::time::timeout(timeout, connect())
                .await
                .map_err(|_| LauncherError::Timeout(timeout))?
                .map_err(|source| LauncherError::Connect {
                    path: path.display().to_string(),
                    source,
                })?;
            match Self::greet(stream, timeout, version).await {
                Err(LauncherError::Refused(m))
                    if version > OLDEST_SPOKEN && m.contains("is not supported") =>
                {
                    tracing::debug!(version, "launcher speaks an older protocol: {m}");
                    version -= 1;
                }
                r => return r,
            }
        }
    }

    async fn greet(
        stream: UnixStream,
        timeout: Duration,
        version: u32,
    ) -> Result<LauncherClient, LauncherError> {
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
            protocol_version: version,
            pid,
            timeout,
        };
        match c.call(&Request::Hello { version }).await? {
            Response::Hello { launcher, .. } => c.launcher_version = launcher,
            Response::Error { message } => return Err(LauncherError::Refused(message)),
            other => return Err(LauncherError::Garbage(format!("{other:?}"))),
        }
        Ok(c)
    }

    /// The connection's two halves, for a stream (`Console`) that is no longer lines: bytes
    /// the reader already holds come first.
    pub fn into_stream(
        self,
    ) -> (
        BufReader<tokio::net::unix::OwnedReadHalf>,
        tokio::net::unix::OwnedWriteHalf,
    ) {
        (self.reader, self.writer)
    }

    pub async fn call(&mut self, r: &Request) -> Result<Response, LauncherError> {
        self.send(r).await?;
        self.next_answer().await
    }

    /// Sends a request without waiting for its answer (`next_answer` reads it).
    pub async fn send(&mut self, r: &Request) -> Result<(), LauncherError> {
        let mut line = serde_json::to_string(r).expect("serializable");
        line.push('\n');
        self.writer.write_all(line.as_bytes()).await?;
        Ok(())
    }

    /// The next line the launcher sends (a streamed event, or the answer after them).
    pub async fn next_answer(&mut self) -> Result<Response, LauncherError> {
        use tokio::io::AsyncReadExt;
        let mut answer = String::new();
        // A launcher is the tenant's process: its answers are capped in size and in time.
        let cap = api::protocol::MAX_LINE_BYTES as u64;
        let mut limited = (&mut self.reader).take(cap);
        let n = tokio::time::timeout(self.timeout, limited.read_line(&mut answer))
            .await
            .map_err(|_| LauncherError::Timeout(self.timeout))??;
        if n == 0 {
            return Err(LauncherError::Io(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the launcher closed the connection",
            )));
        }
        if n as u64 >= cap && !answer.ends_with('\n') {
            return Err(LauncherError::Garbage(format!(
                "an answer longer than {cap} bytes"
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

    /// A launcher of an older release: greeted again in each older version it may speak; one
    /// that speaks none of them is a refusal with its words.
    #[tokio::test]
    async fn older_launchers_are_greeted_in_their_version() {
        let dir = std::env::temp_dir().join(format!("mvh-ver-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for speaks in [Some(OLDEST_SPOKEN), None] {
            let path = dir.join("l.sock");
            let _ = std::fs::remove_file(&path);
            let l = tokio::net::UnixListener::bind(&path).unwrap();
            let server = tokio::spawn(async move {
                let mut asked = Vec::new();
                while let Ok((s, _)) = l.accept().await {
                    let (r, mut w) = s.into_split();
                    let mut line = String::new();
                    BufReader::new(r).read_line(&mut line).await.unwrap();
                    let Ok(Request::Hello { version }) = serde_json::from_str(&line) else {
                        panic!("{line}");
                    };
                    asked.push(version);
                    let answer = if Some(version) == speaks {
                        format!("{{\"response\":\"hello\",\"version\":{version},\"launcher\":\"old\"}}\n")
                    } else {
                        format!("{{\"response\":\"error\",\"message\":\"protocol version {version} is not supported\"}}\n")
                    };
                    w.write_all(answer.as_bytes()).await.unwrap();
                    if Some(version) == speaks || version == OLDEST_SPOKEN {
                        return asked;
                    }
                }
                asked
            });
            let r = LauncherClient::connect(&path, Duration::from_secs(5)).await;
            let asked = server.await.unwrap();
            assert_eq!(
                asked,
                (OLDEST_SPOKEN..=PROTOCOL_VERSION).rev().collect::<Vec<_>>()
            );
            match (speaks, r) {
                (Some(v), Ok(c)) => {
                    assert_eq!(c.protocol_version, v);
                    assert_eq!(c.launcher_version, "old");
                }
                (None, Err(LauncherError::Refused(m))) => assert!(m.contains("not supported")),
                (_, r) => panic!("{:?}", r.map(|c| c.protocol_version)),
            }
        }
        let _ = std::fs::remove_dir_all(dir);
    }

    /// The kubelet's two cgroup layouts name the Pod; other Pods, prefixes, look-alike
    /// containers and unrelated hierarchies do not.
    #[test]
    fn pod_cgroups_as_the_kubelet_lays_them_out() {
        let uid = "0b1c2d3e-0000-4000-8000-000000000001";
        let cgroupfs = "12:pids:/kubepods/burstable/pod0b1c2d3e-0000-4000-8000-000000000001/4f2a\n\
                        1:name=systemd:/\n0::/\n";
        assert!(cgroup_names_pod(cgroupfs, uid));
        let guaranteed = "0::/kubepods/pod0b1c2d3e-0000-4000-8000-000000000001/4f2a\n";
        assert!(cgroup_names_pod(guaranteed, uid));
        let systemd = "0::/kubepods.slice/kubepods-burstable.slice/\
                       kubepods-burstable-pod0b1c2d3e_0000_4000_8000_000000000001.slice/\
                       cri-containerd-4f2a.scope\n";
        assert!(cgroup_names_pod(systemd, uid));
        // Seen from virt-handler's own cgroup namespace (cgroup v2, private namespaces).
        let namespaced =
            "0::/../../kubepods-besteffort-pod0b1c2d3e_0000_4000_8000_000000000001.slice/x.scope\n";
        assert!(cgroup_names_pod(namespaced, uid));
        for other in [
            "0::/kubepods/burstable/pod0b1c2d3e-0000-4000-8000-000000000002/4f2a\n",
            "0::/kubepods/burstable/pod0b1c2d3e-0000-4000-8000-0000000000011/4f2a\n",
            "0::/kubepods/burstable/podX/pod0b1c2d3e-0000-4000-8000-000000000001x\n",
            "0::/system.slice/containerd.service\n",
            "0::/\n",
            "garbage\n",
            "",
        ] {
            assert!(!cgroup_names_pod(other, uid), "{other:?}");
        }
    }

    /// A socket's peer without a process here, or one outside the Pod, is refused by name.
    #[test]
    fn a_peer_outside_the_pod_is_named() {
        let uid = "0b1c2d3e-0000-4000-8000-000000000001";
        let e = check_peer_in_pod(0, uid).unwrap_err();
        assert!(e.contains("no process in this PID namespace"), "{e}");
        let e = check_peer_in_pod(std::process::id() as i32, uid).unwrap_err();
        assert!(e.contains("is not in Pod"), "{e}");
    }

    /// What a tenant can put in its Pod's sockets directory: a link to another socket (the
    /// container runtime's, another Pod's), a link on the way, a file. The handler refuses
    /// each before it sends a byte; the real socket right beside them works.
    #[tokio::test]
    async fn links_and_strangers_in_the_pod_directory_are_refused() {
        // Short, so that the real socket can be bound by its whole path (107 bytes at most).
        let pods = std::path::PathBuf::from(format!("/tmp/mp{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&pods);
        let uid = "0b1c2d3e-0000-4000-8000-000000000001";
        let sockets = socket_path(&pods, uid);
        let sockets = sockets.parent().unwrap();
        std::fs::create_dir_all(sockets).unwrap();
        // The "victim": a socket outside the Pod that answers like a launcher.
        let victim = pods.join("victim.sock");
        let l = tokio::net::UnixListener::bind(&victim).unwrap();
        let contacted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let seen = contacted.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                seen.store(true, std::sync::atomic::Ordering::SeqCst);
                let _ = s
                    .write_all(b"{\"response\":\"hello\",\"version\":4,\"launcher\":\"x\"}\n")
                    .await;
            }
        });
        let t = Duration::from_secs(2);
        let sock = socket_path(&pods, uid);
        std::os::unix::fs::symlink(&victim, &sock).unwrap();
        let e = LauncherClient::connect_pod(&pods, uid, t)
            .await
            .err()
            .expect("a link is refused");
        assert!(e.to_string().contains("symbolic link"), "{e}");
        std::fs::remove_file(&sock).unwrap();
        // A link on the way: the Pod's directory replaced by a link to another Pod's.
        let other = "0b1c2d3e-0000-4000-8000-000000000002";
        std::os::unix::fs::symlink(pods.join(uid), pods.join(other)).unwrap();
        let e = LauncherClient::connect_pod(&pods, other, t)
            .await
            .err()
            .expect("refused");
        assert!(e.to_string().contains("symbolic link"), "{e}");
        // Not a socket at all.
        std::fs::write(&sock, b"").unwrap();
        let e = LauncherClient::connect_pod(&pods, uid, t)
            .await
            .err()
            .expect("refused");
        assert!(e.to_string().contains("not a socket"), "{e}");
        std::fs::remove_file(&sock).unwrap();
        // A crafted UID.
        let e = LauncherClient::connect_pod(&pods, "../../run", t)
            .await
            .err()
            .expect("refused");
        assert!(e.to_string().contains("is not a UID"), "{e}");
        assert!(
            !contacted.load(std::sync::atomic::Ordering::SeqCst),
            "the victim was reached"
        );

        // A socket in the Pod's own directory, but bound by a process outside the Pod (this
        // test's; a socket handed in from another Pod or the node is the same): refused
        // before a byte is sent.
        let l = tokio::net::UnixListener::bind(&sock).unwrap();
        let e = LauncherClient::connect_pod(&pods, uid, t)
            .await
            .err()
            .expect("a listener outside the Pod is refused");
        assert!(e.to_string().contains("is not in Pod"), "{e}");
        let (mut s, _) = l.accept().await.unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).await.unwrap();
        assert!(got.is_empty(), "the handler sent {got:?}");

        // A launcher that answers with 64 MiB and no newline: the handler stops after the cap
        // and reports it.
        let server = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut b = [0u8; 256];
            let _ = s.read(&mut b).await;
            let chunk = vec![b'x'; 1 << 20];
            let mut sent = 0usize;
            for _ in 0..64 {
                if s.write_all(&chunk).await.is_err() {
                    break;
                }
                sent += chunk.len();
            }
            sent
        });
        let e = LauncherClient::connect(&sock, Duration::from_secs(10))
            .await
            .err()
            .expect("refused");
        assert!(e.to_string().contains("an answer longer than"), "{e}");
        // The connection is dropped once the error is returned: the flood stops short of 64 MiB.
        let sent = server.await.unwrap();
        assert!(sent < 64 << 20, "the handler read all {sent} bytes");
        let _ = std::fs::remove_dir_all(pods);
    }
}
