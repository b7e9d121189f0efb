//! What an image is, from its first bytes: its compression, then (inside it) its format.
//! Formats CDI converts with qemu-img that this importer does not read are refused by name.

use std::io::{Cursor, Read};

use crate::{ImportError, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Xz,
    Zstd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Raw,
    Qcow2,
}

/// How many leading bytes the checks look at (vdi's magic is at 0x40).
const HEAD: usize = 512;

pub const QCOW2_MAGIC: &[u8] = b"QFI\xfb";

/// A stream with its leading bytes, read already, put back in front.
type Rewound<R> = std::io::Chain<Cursor<Vec<u8>>, R>;

/// The leading bytes read off `r`, and `r` again with them in front.
fn head<R: Read>(mut r: R) -> Result<(Vec<u8>, Rewound<R>)> {
    let mut h = vec![0u8; HEAD];
    let n = crate::read_full(&mut r, &mut h).map_err(ImportError::Read)?;
    h.truncate(n);
    Ok((h.clone(), Cursor::new(h).chain(r)))
}

/// The compression `head` starts with.
pub fn compression_of(head: &[u8]) -> Compression {
    if head.starts_with(&[0x1f, 0x8b]) {
        Compression::Gzip
    } else if head.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0]) {
        Compression::Xz
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Compression::Zstd
    } else {
        Compression::None
    }
}

/// `source` decompressed, and the compression it had.
pub fn decompressed<'a>(source: impl Read + 'a) -> Result<(Compression, Box<dyn Read + 'a>)> {
    let (h, r) = head(source)?;
    let c = compression_of(&h);
    let r: Box<dyn Read + 'a> = match c {
        Compression::None => Box::new(r),
        // Multi-member gzip (as pigz and concatenated files make) reads as one stream.
        Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(r)),
        Compression::Xz => Box::new(xz2::read::XzDecoder::new_multi_decoder(r)),
        Compression::Zstd => {
            Box::new(zstd::stream::read::Decoder::new(r).map_err(ImportError::Read)?)
        }
    };
    Ok((c, r))
}

/// The image format `head` (decompressed) starts with: qcow2, raw (anything else not named
/// here: raw disks, ISO images), or an error naming a format this importer does not convert.
pub fn format_of(head: &[u8]) -> Result<Format> {
    let other = |name: &str| {
        Err(ImportError::Format(format!(
            "the image is {name}, which this importer does not convert; accepted: raw (or ISO) and qcow2, optionally compressed with gzip, xz or zstd (`qemu-img convert -O qcow2` makes a qcow2 image)"
        )))
    };
    if head.starts_with(QCOW2_MAGIC) {
        Ok(Format::Qcow2)
    } else if head.starts_with(b"KDMV") {
        other("VMDK")
    } else if head.starts_with(b"conectix") {
        other("VHD")
    } else if head.starts_with(b"vhdxfile") {
        other("VHDX")
    } else if head.get(0x40..0x44) == Some(&[0x7f, 0x10, 0xda, 0xbe]) {
        other("VDI")
    } else if head.starts_with(b"QFI") {
        other("QCOW version 1")
    } else if compression_of(head) != Compression::None {
        other("compressed twice")
    } else {
        Ok(Format::Raw)
    }
}

/// The format of the (decompressed) stream, and the stream again.
pub fn sniff<R: Read>(r: R) -> Result<(Format, impl Read)> {
    let (h, r) = head(r)?;
    Ok((format_of(&h)?, r))
}
