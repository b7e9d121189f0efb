//! Paths a manifest names inside the launcher's image and volume directories, resolved by the
//! kernel without leaving them. Validation already refuses `..` in every path field, but the
//! directories' contents are not the launcher's: a containerDisk image or a claim can hold a
//! symbolic link to `/etc/shadow` or to another VM's disk. `openat2(RESOLVE_BENEATH)` refuses
//! any resolution that leaves the directory (an absolute link, a link up and out, a /proc magic
//! link) and allows links that stay inside it.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

/// Resolves `path` (below `root`) with every step inside `root` and returns where it leads,
/// links resolved: the launcher then opens that path. `what` names the directory in errors.
pub fn resolve(root: &Path, path: &Path, what: &str) -> Result<PathBuf, String> {
    // `path` may come from an earlier resolution (the root's real path as its prefix).
    let real_root = root.canonicalize().ok();
    let rel = path
        .strip_prefix(root)
        .ok()
        .or_else(|| real_root.as_deref().and_then(|r| path.strip_prefix(r).ok()))
        .ok_or_else(|| {
            format!(
                "{} is not inside the {what} {}",
                path.display(),
                root.display()
            )
        })?;
    let fd = open_beneath(root, rel).map_err(|e| match e.raw_os_error() {
        Some(libc::EXDEV) | Some(libc::ELOOP) => format!(
            "{} leads outside the {what} {} (a symbolic link out of it); refused",
            path.display(),
            root.display()
        ),
        _ => format!("{}: {e}", path.display()),
    })?;
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// `openat2(root, rel, O_PATH, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`.
fn open_beneath(root: &Path, rel: &Path) -> std::io::Result<OwnedFd> {
    use std::os::unix::ffi::OsStrExt;
    let root_fd = std::fs::File::open(root)?;
    let rel = if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
    };
    let rel = std::ffi::CString::new(rel.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: open_how is plain data; zeroed is a valid value.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_PATH | libc::O_CLOEXEC) as u64;
    how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS;
    // SAFETY: openat2 reads `how` (its size given) and the NUL-terminated `rel`.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            root_fd.as_raw_fd(),
            rel.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: openat2 returned a new descriptor that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_out_of_the_directory_are_refused_and_links_inside_followed() {
        let base = std::env::temp_dir().join(format!("mv-beneath-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let root = base.join("images");
        std::fs::create_dir_all(root.join("img/sub")).unwrap();
        std::fs::write(root.join("img/sub/disk.img"), b"x").unwrap();
        std::fs::write(base.join("secret"), b"s").unwrap();
        std::os::unix::fs::symlink("sub/disk.img", root.join("img/inner")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", root.join("img/abs")).unwrap();
        std::os::unix::fs::symlink("../../secret", root.join("img/up")).unwrap();
        std::os::unix::fs::symlink("/proc/self/root/etc/passwd", root.join("img/magic")).unwrap();
        let got = resolve(&root, &root.join("img/inner"), "image directory").unwrap();
        assert_eq!(got, root.join("img/sub/disk.img").canonicalize().unwrap());
        for bad in ["img/abs", "img/up", "img/magic"] {
            let e = resolve(&root, &root.join(bad), "image directory").unwrap_err();
            assert!(
                e.contains("leads outside the image directory"),
                "{bad}: {e}"
            );
        }
        let e = resolve(&root, &base.join("secret"), "image directory").unwrap_err();
        assert!(e.contains("is not inside"), "{e}");
        assert!(resolve(&root, &root.join("img/none"), "image directory")
            .unwrap_err()
            .contains("No such file"));
        std::fs::remove_dir_all(&base).unwrap();
    }
}
