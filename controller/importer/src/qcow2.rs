//! qcow2 (versions 2 and 3) to raw. Every offset and size comes from the image and is checked
//! against the file before it is used; memory is one L2 table, one cluster and one compressed
//! cluster whatever the header claims. Backing files and external data files are refused: they
//! name a path on the host the importer runs on.

use std::fs::File;
use std::os::unix::fs::FileExt;

use crate::sparse::SparseWriter;
use crate::{ImportError, Result};

/// Incompatible feature bits (version 3).
const INCOMPAT_DIRTY: u64 = 1 << 0;
const INCOMPAT_CORRUPT: u64 = 1 << 1;
const INCOMPAT_DATA_FILE: u64 = 1 << 2;
const INCOMPAT_COMPRESSION: u64 = 1 << 3;
const INCOMPAT_EXTL2: u64 = 1 << 4;

/// Host offsets in L1 and standard L2 entries.
const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
const L2_COMPRESSED: u64 = 1 << 62;
const L2_ZERO: u64 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClusterCompression {
    Deflate,
    Zstd,
}

/// The header fields conversion needs, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    pub cluster_bits: u32,
    pub size: u64,
    pub l1_size: u32,
    pub l1_table_offset: u64,
    pub compression: ClusterCompression,
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn bad<T>(why: impl Into<String>) -> Result<T> {
    Err(ImportError::Qcow2(why.into()))
}

impl Header {
    /// Parses and checks the header in `b` (the file's first bytes) of a file `file_len` long.
    pub fn parse(b: &[u8], file_len: u64) -> Result<Header> {
        if b.len() < 72 || !b.starts_with(crate::format::QCOW2_MAGIC) {
            return bad("not a qcow2 header");
        }
        let version = be32(b, 4);
        if version != 2 && version != 3 {
            return bad(format!("version {version} (2 and 3 are read)"));
        }
        if be64(b, 8) != 0 {
            return bad("the image has a backing file, which would be read from the importer's host; convert it to a standalone image first (`qemu-img convert -O qcow2`)");
        }
        let cluster_bits = be32(b, 20);
        if !(9..=21).contains(&cluster_bits) {
            return bad(format!("cluster_bits {cluster_bits} (9 to 21 are valid)"));
        }
        if be32(b, 32) != 0 {
            return bad("the image is encrypted");
        }
        let mut compression = ClusterCompression::Deflate;
        if version == 3 {
            if b.len() < 104 {
                return bad("version 3 header cut short");
            }
            let incompat = be64(b, 72);
            let header_length = be32(b, 100) as usize;
            if incompat & INCOMPAT_CORRUPT != 0 {
                return bad("the image is marked corrupt (`qemu-img check -r all` repairs it)");
            }
            if incompat & INCOMPAT_DATA_FILE != 0 {
                return bad("the image keeps its data in an external file, which would be read from the importer's host");
            }
            if incompat & INCOMPAT_EXTL2 != 0 {
                return bad("extended L2 entries (subclusters) are not read; convert without `extended_l2=on`");
            }
            let unknown = incompat & !(INCOMPAT_DIRTY | INCOMPAT_COMPRESSION);
            if unknown != 0 {
                return bad(format!("unknown incompatible features {unknown:#x}"));
            }
            if incompat & INCOMPAT_COMPRESSION != 0 {
                if header_length <= 104 || b.len() <= 104 {
                    return bad("compression type feature without its header field");
                }
                compression = match b[104] {
                    0 => ClusterCompression::Deflate,
                    1 => ClusterCompression::Zstd,
                    t => return bad(format!("compression type {t}")),
                };
            }
        }
        let h = Header {
            version,
            cluster_bits,
            size: be64(b, 24),
            l1_size: be32(b, 36),
            l1_table_offset: be64(b, 40),
            compression,
        };
        let needed = h.l1_entries_needed();
        if (h.l1_size as u64) < needed {
            return bad(format!(
                "L1 table of {} entries cannot map {} bytes (needs {needed})",
                h.l1_size, h.size
            ));
        }
        let l1_end = h
            .l1_table_offset
            .checked_add(needed * 8)
            .filter(|end| *end <= file_len);
        if needed > 0 && (l1_end.is_none() || !h.l1_table_offset.is_multiple_of(8)) {
            return bad(format!(
                "L1 table at {:#x} lies outside the {file_len}-byte file",
                h.l1_table_offset
            ));
        }
        Ok(h)
    }

    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    fn l2_entries(&self) -> u64 {
        self.cluster_size() / 8
    }

    /// L1 entries that map the virtual size.
    pub fn l1_entries_needed(&self) -> u64 {
        let per_l1 = self.cluster_size() * self.l2_entries();
        self.size.div_ceil(per_l1)
    }
}

pub struct Qcow2 {
    file: File,
    file_len: u64,
    pub header: Header,
}

impl Qcow2 {
    /// Opens the image in `file`, refusing a virtual size above `available` (CDI's words).
    pub fn open(file: File, available: u64) -> Result<Qcow2> {
        let file_len = file.metadata().map_err(ImportError::Read)?.len();
        let mut b = vec![0u8; 112.min(file_len as usize)];
        file.read_exact_at(&mut b, 0).map_err(ImportError::Read)?;
        let header = Header::parse(&b, file_len)?;
        if header.size > available {
            return Err(ImportError::LargerPvcRequired {
                virtual_size: header.size,
                available,
            });
        }
        Ok(Qcow2 {
            file,
            file_len,
            header,
        })
    }

    /// `len` bytes at `offset` of the file, which must lie inside it.
    fn read(&self, what: &str, offset: u64, buf: &mut [u8]) -> Result<()> {
        match offset.checked_add(buf.len() as u64) {
            Some(end) if end <= self.file_len => self
                .file
                .read_exact_at(buf, offset)
                .map_err(ImportError::Read),
            _ => bad(format!(
                "{what} at {offset:#x} (+{}) lies outside the {}-byte file",
                buf.len(),
                self.file_len
            )),
        }
    }

    /// Writes the whole virtual disk to `target`; returns (virtual size, bytes written).
    pub fn convert(&self, target: &mut SparseWriter) -> Result<(u64, u64)> {
        let h = &self.header;
        let cs = h.cluster_size();
        let mut l2 = vec![0u8; cs as usize];
        let mut cluster = vec![0u8; cs as usize];
        let mut compressed = Vec::new();
        let mut written = 0;
        for i in 0..h.l1_entries_needed() {
            let mut e = [0u8; 8];
            self.read("L1 entry", h.l1_table_offset + i * 8, &mut e)?;
            let l2_offset = u64::from_be_bytes(e) & OFFSET_MASK;
            let base = i * cs * h.l2_entries();
            let span = (cs * h.l2_entries()).min(h.size - base);
            if l2_offset == 0 {
                written += target.zero(base, span)?;
                continue;
            }
            if !l2_offset.is_multiple_of(cs) {
                return bad(format!(
                    "L2 table offset {l2_offset:#x} is not cluster-aligned"
                ));
            }
            self.read("L2 table", l2_offset, &mut l2)?;
            for j in 0..span.div_ceil(cs) {
                let at = base + j * cs;
                let len = cs.min(h.size - at) as usize;
                let entry = be64(&l2, j as usize * 8);
                match self.cluster(entry, &mut cluster, &mut compressed)? {
                    true => written += target.write_at(at, &cluster[..len])?,
                    false => written += target.zero(at, len as u64)?,
                }
            }
        }
        Ok((h.size, written))
    }

    /// Fills `out` with the cluster `entry` maps; false for a cluster that reads as zeros.
    fn cluster(&self, entry: u64, out: &mut [u8], compressed: &mut Vec<u8>) -> Result<bool> {
        let h = &self.header;
        let cs = h.cluster_size();
        if entry & L2_COMPRESSED != 0 {
            let x = 62 - (h.cluster_bits - 8);
            let coffset = entry & ((1u64 << x) - 1);
            let sectors = ((entry >> x) & ((1u64 << (h.cluster_bits - 8)) - 1)) + 1;
            if coffset >= self.file_len {
                return bad(format!(
                    "compressed cluster at {coffset:#x} lies outside the {}-byte file",
                    self.file_len
                ));
            }
            // The descriptor rounds up to whole sectors; the data may end before them at the
            // file's end.
            let csize = (sectors * 512 - (coffset & 511)).min(self.file_len - coffset);
            compressed.resize(csize as usize, 0);
            self.read("compressed cluster", coffset, compressed)?;
            self.inflate(compressed, out)?;
            return Ok(true);
        }
        if h.version >= 3 && entry & L2_ZERO != 0 {
            return Ok(false);
        }
        let offset = entry & OFFSET_MASK;
        if offset == 0 {
            return Ok(false);
        }
        if !offset.is_multiple_of(cs) {
            return bad(format!(
                "data cluster offset {offset:#x} is not cluster-aligned"
            ));
        }
        self.read("data cluster", offset, out)?;
        Ok(true)
    }

    /// Decompresses one cluster: it must fill `out` exactly, as QEMU requires.
    fn inflate(&self, input: &[u8], out: &mut [u8]) -> Result<()> {
        let full = match self.header.compression {
            ClusterCompression::Deflate => {
                let mut d = flate2::Decompress::new(false);
                match d.decompress(input, out, flate2::FlushDecompress::Finish) {
                    Ok(_) => d.total_out() == out.len() as u64,
                    Err(e) => return bad(format!("compressed cluster: {e}")),
                }
            }
            ClusterCompression::Zstd => {
                // One frame, streamed: the descriptor's whole sectors run past its end, as
                // QEMU's own streaming decoder allows.
                use std::io::Read;
                let mut d = zstd::stream::read::Decoder::with_buffer(input)
                    .map_err(ImportError::Read)?
                    .single_frame();
                match d.read_exact(out) {
                    Ok(()) => true,
                    Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => false,
                    Err(e) => return bad(format!("compressed cluster: {e}")),
                }
            }
        };
        if !full {
            return bad("compressed cluster does not fill its cluster");
        }
        Ok(())
    }
}
