//! The files a snapshot writes: created private, and sealed to each other. A leaf, so that
//! `memory` can write its file without depending on the machine state.

use std::path::Path;

/// 16 random bytes that pair a snapshot's state file with its memory file. The two files are
/// renamed into place one after the other, so a crash between the renames, or files copied
/// from two snapshots, could otherwise pair one snapshot's memory with another's vCPU state.
pub type MemorySeal = [u8; 16];

/// A fresh seal.
pub fn new_memory_seal() -> std::io::Result<MemorySeal> {
    random_bytes()
}

/// `N` bytes from the kernel's random number generator.
pub fn random_bytes<const N: usize>() -> std::io::Result<[u8; N]> {
    let mut out = [0u8; N];
    getrandom::fill(&mut out).map_err(std::io::Error::from)?;
    Ok(out)
}

/// Creates `path` for writing with mode 0600 (snapshot files hold guest RAM and device state,
/// readable by nobody else), never through a symbolic link and never an existing file
/// (`O_CREAT | O_EXCL | O_NOFOLLOW`). A stale temporary left by a crash is removed first; a
/// link there is removed, not followed.
pub fn create_private(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}
