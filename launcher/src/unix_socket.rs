//! Unix sockets as the launcher uses them: bound and reached through their directory's
//! descriptor (any path length), and the peer's user as the kernel recorded it.

use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

/// A unix socket path is limited to 107 bytes; through its directory's descriptor
/// (/proc/self/fd/N/NAME) any path works (a Pod's sockets volume under the kubelet's pods
/// directory is longer).
fn via_dir<T>(path: &Path, f: impl FnOnce(&str) -> std::io::Result<T>) -> std::io::Result<T> {
    let dir = std::fs::File::open(path.parent().unwrap_or(Path::new(".")))?;
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    f(&format!("/proc/self/fd/{}/{name}", dir.as_raw_fd()))
}

pub fn bind_unix(path: &Path) -> std::io::Result<UnixListener> {
    via_dir(path, |p| UnixListener::bind(p))
}

pub fn connect_unix(path: &Path) -> std::io::Result<UnixStream> {
    via_dir(path, |p| UnixStream::connect(p))
}

/// The user of the process at the other end of `stream` (`SO_PEERCRED`, as the kernel
/// recorded it at connect time: the peer cannot lie about it).
pub fn peer_uid(stream: &UnixStream) -> std::io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: u32::MAX,
        gid: u32::MAX,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, which is that large.
    let r = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred.uid)
}
