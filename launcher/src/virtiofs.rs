//! virtio-fs shares for the launcher: `--fs tag=T,socket=PATH` (a backend someone else runs)
//! or `--fs tag=T,dir=DIR[,readonly]`, for which the launcher runs virtiofsd itself — as
//! KubeVirt does beside QEMU — and stops it with the VM.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vmm::config::FsConfig;

/// What `--fs` asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FsSource {
    /// A vhost-user-fs backend already listening on this socket.
    Socket(PathBuf),
    /// A directory the launcher serves with its own virtiofsd.
    Dir { dir: PathBuf, read_only: bool },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FsSpec {
    pub tag: String,
    pub source: FsSource,
}

/// Parses `tag=T,socket=PATH` or `tag=T,dir=DIR[,readonly]`.
pub fn parse_fs(spec: &str) -> Result<FsSpec, String> {
    let (mut tag, mut socket, mut dir, mut read_only) = (None, None, None, false);
    for opt in spec.split(',') {
        match opt.split_once('=') {
            Some(("tag", t)) if !t.is_empty() => tag = Some(t.to_string()),
            Some(("socket", p)) if !p.is_empty() => socket = Some(PathBuf::from(p)),
            Some(("dir", p)) if !p.is_empty() => dir = Some(PathBuf::from(p)),
            None if opt == "readonly" || opt == "ro" => read_only = true,
            _ => {
                return Err(format!(
                    "--fs {spec}: unknown option {opt:?}; accepted: tag=T, then socket=PATH or dir=DIR[,readonly]"
                ))
            }
        }
    }
    let tag =
        tag.ok_or_else(|| format!("--fs {spec}: tag=T is missing (the name the guest mounts)"))?;
    let source = match (socket, dir) {
        (Some(s), None) if !read_only => FsSource::Socket(s),
        (Some(_), None) => {
            return Err(format!(
                "--fs {spec}: readonly applies to dir=DIR; a socket's backend decides for itself"
            ))
        }
        (None, Some(dir)) => FsSource::Dir { dir, read_only },
        _ => {
            return Err(format!(
                "--fs {spec}: give exactly one of socket=PATH (a running vhost-user-fs backend) or dir=DIR"
            ))
        }
    };
    Ok(FsSpec { tag, source })
}

/// Where virtiofsd (the Rust daemon) is: `$MICROVIRT_VIRTIOFSD`, then `PATH`, then where
/// distributions put it. QEMU's old C virtiofsd (`/usr/lib/qemu/virtiofsd`) takes other options.
pub fn virtiofsd_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MICROVIRT_VIRTIOFSD") {
        return Some(PathBuf::from(p));
    }
    let on_path: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("virtiofsd"))
                .collect()
        })
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain(["/usr/libexec/virtiofsd"].into_iter().map(PathBuf::from))
        .find(|p| p.is_file())
}

/// A virtiofsd serving one directory on one socket. It ends when the VMM's connection closes
/// or when the thread that started it ends; dropping the handle removes the socket.
pub struct Virtiofsd {
    /// Kept for its pid; never waited on after start (see Drop).
    child: Child,
    socket: PathBuf,
}

impl Virtiofsd {
    /// Starts virtiofsd for `dir` on `socket` and waits (up to 10 s) until it listens.
    /// Run as root it sandboxes itself in namespaces; otherwise (a Pod's unprivileged user,
    /// as KubeVirt runs it) the container is its sandbox.
    pub fn start(dir: &Path, socket: &Path, read_only: bool) -> Result<Virtiofsd, String> {
        let bin = virtiofsd_path().ok_or(
            "virtiofsd is not installed (install the `virtiofsd` package or `cargo install virtiofsd`, or set MICROVIRT_VIRTIOFSD)",
        )?;
        let meta = std::fs::metadata(dir).map_err(|e| format!("dir={}: {e}", dir.display()))?;
        if !meta.is_dir() {
            return Err(format!("dir={}: not a directory", dir.display()));
        }
        let _ = std::fs::remove_file(socket);
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        let mut cmd = Command::new(&bin);
        cmd.arg("--shared-dir")
            .arg(dir)
            .arg("--socket-path")
            .arg(socket)
            .args(["--sandbox", if root { "namespace" } else { "none" }])
            .args(["--cache", "auto"])
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if read_only {
            cmd.arg("--readonly");
        }
        // virtiofsd ends itself when the VMM disconnects; if the launcher dies first, the
        // kernel ends it (the launcher's threads cannot signal once seccomp is on).
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            use std::os::unix::process::CommandExt;
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(|e| format!("{}: {e}", bin.display()))?;
        let mut d = Virtiofsd {
            child,
            socket: socket.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !socket.exists() {
            if let Ok(Some(status)) = d.child.try_wait() {
                return Err(format!(
                    "{} for {} exited ({status}) before listening",
                    bin.display(),
                    dir.display()
                ));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "{} for {} did not create {} within 10 s",
                    bin.display(),
                    dir.display(),
                    socket.display()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(d)
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }
}

impl Drop for Virtiofsd {
    fn drop(&mut self) {
        // No kill here: by now the launcher's seccomp filter may forbid it, and virtiofsd
        // ends by itself once the VMM hung up (or with this thread, PR_SET_PDEATHSIG).
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// The shares of `specs` as the VMM's config, starting virtiofsd for each `dir=`; the
/// daemons live as long as the returned handles. Sockets for started daemons go in `run_dir`.
pub fn prepare(
    specs: &[FsSpec],
    run_dir: &Path,
) -> Result<(Vec<FsConfig>, Vec<Virtiofsd>), String> {
    let mut configs = Vec::with_capacity(specs.len());
    let mut daemons = Vec::new();
    for s in specs {
        let socket = match &s.source {
            FsSource::Socket(p) => p.clone(),
            FsSource::Dir { dir, read_only } => {
                std::fs::create_dir_all(run_dir)
                    .map_err(|e| format!("{}: {e}", run_dir.display()))?;
                let socket = run_dir.join(format!("virtiofs-{}.sock", s.tag));
                let d = Virtiofsd::start(dir, &socket, *read_only)
                    .map_err(|e| format!("--fs tag={}: {e}", s.tag))?;
                daemons.push(d);
                socket
            }
        };
        configs.push(FsConfig {
            tag: s.tag.clone(),
            socket,
        });
    }
    Ok((configs, daemons))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fs_specs_parse_and_bad_ones_say_why() {
        assert_eq!(
            parse_fs("tag=share,socket=/run/fs.sock").unwrap(),
            FsSpec {
                tag: "share".into(),
                source: FsSource::Socket("/run/fs.sock".into())
            }
        );
        assert_eq!(
            parse_fs("tag=cfg,dir=/srv/cfg,readonly").unwrap().source,
            FsSource::Dir {
                dir: "/srv/cfg".into(),
                read_only: true
            }
        );
        for (spec, says) in [
            ("socket=/s", "tag=T is missing"),
            ("tag=a", "exactly one of"),
            ("tag=a,socket=/s,dir=/d", "exactly one of"),
            ("tag=a,socket=/s,readonly", "readonly applies to dir"),
            ("tag=a,dir=/d,cache=never", "unknown option"),
        ] {
            let e = parse_fs(spec).unwrap_err();
            assert!(e.contains(says), "{spec}: {e}");
        }
    }
}
