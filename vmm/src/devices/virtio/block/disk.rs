//! The host side of a virtio-blk disk: a raw image file or a block device, opened with the
//! configured cache mode and an advisory lock so two VMs never write one image.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

pub use crate::config::CacheMode;

#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("disk {path}: {reason}")]
    Open { path: String, reason: String },
    #[error("disk {path}: locked by another VM (advisory lock held); a disk can be attached read-write to one VM only")]
    Locked { path: String },
}

pub struct Disk {
    pub file: File,
    pub path: PathBuf,
    pub size: u64,
    pub read_only: bool,
    pub cache: CacheMode,
    pub is_block_device: bool,
}

fn reason(e: std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => "no such file".into(),
        std::io::ErrorKind::PermissionDenied => "permission denied".into(),
        _ => match e.raw_os_error() {
            Some(libc::EINVAL) => {
                "the file system does not support O_DIRECT (use cache=writeback)".into()
            }
            _ => e.to_string(),
        },
    }
}

impl Disk {
    pub fn open(path: &Path, read_only: bool, cache: CacheMode) -> Result<Disk, DiskError> {
        Self::open_with(path, read_only, cache, true)
    }

    /// `open`, taking the advisory lock only when `lock`.
    pub fn open_with(
        path: &Path,
        read_only: bool,
        cache: CacheMode,
        lock: bool,
    ) -> Result<Disk, DiskError> {
        let p = path.display().to_string();
        let err = |e: std::io::Error| DiskError::Open {
            path: p.clone(),
            reason: reason(e),
        };
        let mut opts = OpenOptions::new();
        opts.read(true).write(!read_only);
        if cache == CacheMode::None {
            opts.custom_flags(libc::O_DIRECT);
        }
        let file = opts.open(path).map_err(err)?;
        let meta = file.metadata().map_err(err)?;
        let is_block_device = meta.file_type().is_block_device();
        if !meta.is_file() && !is_block_device {
            return Err(DiskError::Open {
                path: p,
                reason: "not a regular file or block device".into(),
            });
        }
        let size = if is_block_device {
            let mut size = 0u64;
            // SAFETY: BLKGETSIZE64 writes one u64.
            let r = unsafe {
                libc::ioctl(
                    file.as_raw_fd(),
                    0x8008_1272, /* BLKGETSIZE64 */
                    &mut size,
                )
            };
            if r != 0 {
                return Err(err(std::io::Error::last_os_error()));
            }
            size
        } else {
            meta.len()
        };
        let disk = Disk {
            file,
            path: path.to_path_buf(),
            size,
            read_only,
            cache,
            is_block_device,
        };
        if lock {
            disk.lock()?;
        }
        Ok(disk)
    }

    /// Shared lock for readers, exclusive for a writer: two read-only users may share an
    /// image, a writer excludes everyone. A migration target opens its disks unlocked (the
    /// source still holds them) and takes the lock once the source has let go.
    pub fn lock(&self) -> Result<(), DiskError> {
        let op = if self.read_only {
            libc::LOCK_SH
        } else {
            libc::LOCK_EX
        } | libc::LOCK_NB;
        // SAFETY: flock on a file descriptor we own.
        if unsafe { libc::flock(self.file.as_raw_fd(), op) } != 0 {
            return Err(DiskError::Locked {
                path: self.path.display().to_string(),
            });
        }
        Ok(())
    }

    /// Flushes what the guest wrote and lets go of the lock: a migration source hands the
    /// disk to its target at switch-over.
    pub fn release(&self) -> Result<(), DiskError> {
        let err = |e: std::io::Error| DiskError::Open {
            path: self.path.display().to_string(),
            reason: e.to_string(),
        };
        if !self.read_only {
            self.file.sync_data().map_err(err)?;
        }
        // SAFETY: flock on a file descriptor we own.
        if unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) } != 0 {
            return Err(err(std::io::Error::last_os_error()));
        }
        Ok(())
    }

    pub fn sectors(&self) -> u64 {
        self.size >> super::request::SECTOR_SHIFT
    }
}
