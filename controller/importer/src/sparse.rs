//! The volume an image is written to: a claim's `disk.img` (a regular file: zero ranges stay
//! holes, the length set to the virtual size at the end) or a Block volume's device (whose
//! old contents must not show through: zero ranges are written as zeros).

use std::fs::File;
use std::os::unix::fs::{FileExt, FileTypeExt};

use crate::{ImportError, Result};

/// Zero detection granularity: a filesystem's block.
const BLOCK: usize = 4096;

pub struct SparseWriter {
    file: File,
    /// A regular file: holes instead of zeros.
    sparse: bool,
}

impl SparseWriter {
    /// Writes into `file`: a regular file is emptied first (an earlier, failed attempt's
    /// bytes must not show through the holes); a block device is written in full.
    pub fn new(file: File) -> Result<SparseWriter> {
        let ty = file.metadata().map_err(ImportError::Write)?.file_type();
        let sparse = !ty.is_block_device();
        if sparse {
            file.set_len(0).map_err(ImportError::Write)?;
        }
        Ok(SparseWriter { file, sparse })
    }

    /// Writes `data` at `offset`, leaving all-zero blocks as holes in a regular file. Returns
    /// the bytes actually written.
    pub fn write_at(&mut self, offset: u64, data: &[u8]) -> Result<u64> {
        if !self.sparse {
            self.file
                .write_all_at(data, offset)
                .map_err(ImportError::Write)?;
            return Ok(data.len() as u64);
        }
        let mut written = 0;
        let mut start = None;
        let mut at = 0;
        while at < data.len() {
            let end = (at + BLOCK).min(data.len());
            let zero = data[at..end].iter().all(|b| *b == 0);
            match (zero, start) {
                (false, None) => start = Some(at),
                (true, Some(s)) => {
                    written += self.put(offset, data, s, at)?;
                    start = None;
                }
                _ => {}
            }
            at = end;
        }
        if let Some(s) = start {
            written += self.put(offset, data, s, data.len())?;
        }
        Ok(written)
    }

    /// Zeros over `len` bytes at `offset` (an unallocated or zero cluster).
    pub fn zero(&mut self, offset: u64, len: u64) -> Result<u64> {
        if self.sparse {
            return Ok(0);
        }
        let zeros = vec![0u8; BLOCK * 64];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(zeros.len() as u64) as usize;
            self.file
                .write_all_at(&zeros[..n], offset + done)
                .map_err(ImportError::Write)?;
            done += n as u64;
        }
        Ok(len)
    }

    fn put(&self, offset: u64, data: &[u8], from: usize, to: usize) -> Result<u64> {
        self.file
            .write_all_at(&data[from..to], offset + from as u64)
            .map_err(ImportError::Write)?;
        Ok((to - from) as u64)
    }

    /// The image ends at `size`: a regular file gets that length; everything reaches the disk.
    pub fn finish(&mut self, size: u64) -> Result<()> {
        if self.sparse {
            self.file.set_len(size).map_err(ImportError::Write)?;
        }
        self.file.sync_all().map_err(ImportError::Write)
    }
}
