//! Disk images as CDI imports them: the format and compression recognised from the bytes
//! themselves, qcow2 converted to raw, everything written sparsely to the claim's `disk.img`
//! (or block device), sized to the image's virtual size — byte for byte what `qemu-img
//! convert -O raw` writes.
//!
//! Why by hand: no maintained Rust crate reads qcow2 with compressed clusters, refuses backing
//! and external data files, and keeps its memory bounded whatever the tables say (the
//! crates found read v3 only, or uncompressed only); CDI runs `qemu-img`, a C program fed
//! untrusted images, which this importer does not need. Decompression is the maintained
//! crates' (flate2, xz2, zstd).

pub mod format;
pub mod pull;
pub mod qcow2;
pub mod registry;
pub mod s3;
pub mod seccomp;
pub mod sparse;
pub mod verify;

use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;

pub use format::{Compression, Format};
pub use sparse::SparseWriter;

#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("reading the image: {0}")]
    Read(std::io::Error),
    #[error("writing the volume: {0}")]
    Write(std::io::Error),
    #[error("{0}")]
    Format(String),
    /// The source refused or broke off (HTTP status, registry error): another try may pass.
    #[error("{0}")]
    Source(String),
    #[error("qcow2: {0}")]
    Qcow2(String),
    #[error(
        "checksum mismatch: the source's bytes hash to {got}, the DataVolume expects {expected}"
    )]
    Checksum { expected: String, got: String },
    /// CDI's `ErrLargerPVCRequired` wording.
    #[error("Virtual image size {virtual_size} is larger than the reported available storage {available}. A larger PVC is required.")]
    LargerPvcRequired { virtual_size: u64, available: u64 },
}

pub type Result<T> = std::result::Result<T, ImportError>;

impl ImportError {
    /// What the DataVolume's `Running` condition says about it: the reason, and whether
    /// another attempt can help.
    pub fn outcome(&self) -> api::cdi::importer::Outcome {
        let (reason, retryable) = match self {
            ImportError::Read(_) | ImportError::Source(_) => ("SourceError", true),
            // A full volume stays full; any other write error may be the node's passing trouble.
            ImportError::Write(e) => (
                "VolumeError",
                e.raw_os_error() != Some(libc::ENOSPC) && e.raw_os_error() != Some(libc::EDQUOT),
            ),
            ImportError::Format(_) | ImportError::Qcow2(_) => ("ImageFormatError", false),
            ImportError::Checksum { .. } => ("ChecksumError", false),
            ImportError::LargerPvcRequired { .. } => ("LargerPVCRequired", false),
        };
        api::cdi::importer::Outcome {
            reason: reason.into(),
            message: self.to_string(),
            retryable,
        }
    }
}

/// What an import found and wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImportReport {
    pub compression: Compression,
    pub format: Format,
    pub virtual_size: u64,
    /// Bytes actually written (zero ranges are left as holes).
    pub written_bytes: u64,
}

/// Imports the image `source` gives (any supported compression and format) into `target`,
/// at most `available` bytes of virtual size. A qcow2 image needs random access, so its
/// (decompressed) bytes are staged in `scratch` first, as CDI stages them on scratch space.
pub fn import(
    source: impl Read,
    scratch: &Path,
    target: &mut SparseWriter,
    available: u64,
) -> Result<ImportReport> {
    let (compression, reader) = format::decompressed(source)?;
    let (format, mut reader) = format::sniff(reader)?;
    let (virtual_size, written_bytes) = match format {
        Format::Raw => copy_raw(&mut reader, target, available)?,
        Format::Qcow2 => {
            let mut staged = File::options()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(scratch)
                .map_err(ImportError::Write)?;
            let copied = std::io::copy(&mut reader, &mut staged);
            let result = copied
                .map_err(ImportError::Read)
                .and_then(|_| staged.flush().map_err(ImportError::Write))
                .and_then(|_| qcow2::Qcow2::open(staged, available))
                .and_then(|q| q.convert(target));
            let _ = std::fs::remove_file(scratch);
            result?
        }
    };
    target.finish(virtual_size)?;
    Ok(ImportReport {
        compression,
        format,
        virtual_size,
        written_bytes,
    })
}

/// Raw bytes, streamed: the virtual size is the length.
fn copy_raw(
    reader: &mut impl Read,
    target: &mut SparseWriter,
    available: u64,
) -> Result<(u64, u64)> {
    let mut buf = vec![0u8; 1 << 20];
    let mut offset = 0u64;
    let mut written = 0u64;
    loop {
        let n = read_full(reader, &mut buf).map_err(ImportError::Read)?;
        if n == 0 {
            return Ok((offset, written));
        }
        if offset + n as u64 > available {
            return Err(ImportError::LargerPvcRequired {
                virtual_size: offset + n as u64,
                available,
            });
        }
        written += target.write_at(offset, &buf[..n])?;
        offset += n as u64;
    }
}

/// Reads until `buf` is full or the stream ends.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}
