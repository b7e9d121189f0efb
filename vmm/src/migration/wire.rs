//! The live-migration stream: a header, then length-prefixed frames in both directions.
//!
//! ```text
//! stream:  magic "MVRTMIGR" | protocol version (u32 LE)          (source → target, once)
//! frame:   kind (u8) | payload length (u32 LE) | CRC-32 of kind, length, payload (u32 LE) | payload
//! source → target: Hello (postcard `Hello`), Pages (runs of `gpa u64 | pages u32 | bytes`),
//!                  Sync, State (a state file's bytes), Go, Cancel (UTF-8 reason)
//! target → source: Ready, Refuse (reason), Synced, Restored, Failed (reason), Running
//! ```
//! The target treats everything it reads as hostile: frame lengths are capped before anything
//! is allocated, every frame's checksum is verified before it is looked at (a flipped bit on a
//! link TLS does not cover must not land in guest memory), every page run must lie inside
//! guest RAM, and the state is checked like a state file.

use std::io::{Read, Write};

use serde::{Deserialize, Serialize};

use crate::memory::{RegionLayout, PAGE_SIZE};

pub const MAGIC: [u8; 8] = *b"MVRTMIGR";
/// 2: every frame checksummed; the target confirms with Running after Go.
pub const PROTOCOL: u32 = 2;
/// No frame is larger: a Pages frame carries at most `MAX_RUN_PAGES` pages plus run headers.
pub const MAX_FRAME: u32 = 16 << 20;
/// Pages per run the sender writes (a run never crosses a region).
pub const MAX_RUN_PAGES: u32 = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq, num_enum::TryFromPrimitive)]
#[repr(u8)]
pub enum Kind {
    Hello = 1,
    Pages = 2,
    State = 3,
    Go = 4,
    Cancel = 5,
    Sync = 6,
    Ready = 10,
    Refuse = 11,
    Restored = 12,
    Failed = 13,
    Running = 14,
    Synced = 15,
}

/// What the source says about the machine before any memory moves, so a target that cannot
/// take it refuses at once.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub vmm_version: String,
    pub state_format: u32,
    pub vcpus: u8,
    pub memory_mib: u64,
    pub memory: Vec<RegionLayout>,
}

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("not a microvirt migration stream (bad magic)")]
    Magic,
    #[error("migration protocol version {0}; this microvirt speaks version {PROTOCOL}")]
    Version(u32),
    #[error("unknown frame kind {0}")]
    Kind(u8),
    #[error("frame of {0} bytes (at most {MAX_FRAME})")]
    TooLarge(u32),
    #[error("expected {expected:?}, got {got:?}")]
    Unexpected { expected: String, got: Kind },

    #[error("page run at {gpa:#x} of {pages} pages is not inside guest RAM")]
    OutOfRange { gpa: u64, pages: u32 },
    #[error("{0:?} frame fails its checksum (corrupted on the way)")]
    Checksum(Kind),
    #[error("malformed {0} frame")]
    Malformed(&'static str),
}

pub fn write_header(w: &mut impl Write) -> std::io::Result<()> {
    w.write_all(&MAGIC)?;
    w.write_all(&PROTOCOL.to_le_bytes())
}

pub fn read_header(r: &mut impl Read) -> Result<(), WireError> {
    let mut b = [0u8; 12];
    r.read_exact(&mut b)?;
    if b[..8] != MAGIC {
        return Err(WireError::Magic);
    }
    let v = u32::from_le_bytes(b[8..].try_into().unwrap());
    if v != PROTOCOL {
        return Err(WireError::Version(v));
    }
    Ok(())
}

/// Bytes before a frame's payload.
pub const FRAME_HEADER: usize = 9;

fn frame_crc(head: &[u8], payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(head);
    h.update(payload);
    h.finalize()
}

pub fn write_frame(w: &mut impl Write, kind: Kind, payload: &[u8]) -> std::io::Result<()> {
    let mut h = [0u8; FRAME_HEADER];
    h[0] = kind as u8;
    h[1..5].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    let crc = frame_crc(&h[..5], payload);
    h[5..].copy_from_slice(&crc.to_le_bytes());
    w.write_all(&h)?;
    w.write_all(payload)
}

/// Reads one frame, refusing unknown kinds and oversized lengths before allocating, and a
/// payload that does not match its checksum.
pub fn read_frame(r: &mut impl Read) -> Result<(Kind, Vec<u8>), WireError> {
    let mut h = [0u8; FRAME_HEADER];
    r.read_exact(&mut h)?;
    let kind = Kind::try_from(h[0]).map_err(|_| WireError::Kind(h[0]))?;
    let len = u32::from_le_bytes(h[1..5].try_into().unwrap());
    if len > MAX_FRAME {
        return Err(WireError::TooLarge(len));
    }
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload)?;
    if frame_crc(&h[..5], &payload) != u32::from_le_bytes(h[5..].try_into().unwrap()) {
        return Err(WireError::Checksum(kind));
    }
    Ok((kind, payload))
}

/// One run of consecutive pages in a Pages frame.
pub struct PageRun<'a> {
    pub gpa: u64,
    pub bytes: &'a [u8],
}

/// Splits a Pages payload into runs, each checked to lie inside one RAM region.
pub fn parse_pages<'a>(
    payload: &'a [u8],
    layout: &[RegionLayout],
) -> Result<Vec<PageRun<'a>>, WireError> {
    let mut runs = Vec::new();
    let mut rest = payload;
    while !rest.is_empty() {
        if rest.len() < 12 {
            return Err(WireError::Malformed("Pages"));
        }
        let gpa = u64::from_le_bytes(rest[..8].try_into().unwrap());
        let pages = u32::from_le_bytes(rest[8..12].try_into().unwrap());
        let len = (pages as u64) * PAGE_SIZE;
        let inside = gpa.is_multiple_of(PAGE_SIZE)
            && pages > 0
            && layout.iter().any(|r| {
                gpa >= r.guest_addr
                    && gpa
                        .checked_add(len)
                        .is_some_and(|end| end <= r.guest_addr + r.size)
            });
        if !inside {
            return Err(WireError::OutOfRange { gpa, pages });
        }
        let body = &rest[12..];
        if (body.len() as u64) < len {
            return Err(WireError::Malformed("Pages"));
        }
        runs.push(PageRun {
            gpa,
            bytes: &body[..len as usize],
        });
        rest = &body[len as usize..];
    }
    Ok(runs)
}

/// Builds Pages frames from runs of guest memory, flushing whenever a frame is full.
pub struct PagesWriter {
    buf: Vec<u8>,
    pub bytes_sent: u64,
}

impl Default for PagesWriter {
    fn default() -> Self {
        PagesWriter {
            buf: Vec::with_capacity(MAX_FRAME as usize),
            bytes_sent: 0,
        }
    }
}

impl PagesWriter {
    /// Appends a run (`bytes` a whole number of pages, at most `MAX_RUN_PAGES`).
    pub fn push(&mut self, w: &mut impl Write, gpa: u64, bytes: &[u8]) -> std::io::Result<()> {
        self.push_with(w, gpa, bytes.len(), |dst| dst.copy_from_slice(bytes))
    }

    /// Appends a run of `len` bytes (a whole number of pages) that `fill` writes straight
    /// into the frame: guest memory is copied once, not into a buffer and then the frame.
    pub fn push_with(
        &mut self,
        w: &mut impl Write,
        gpa: u64,
        len: usize,
        fill: impl FnOnce(&mut [u8]),
    ) -> std::io::Result<()> {
        debug_assert!((len as u64).is_multiple_of(PAGE_SIZE));
        if self.buf.len() + 12 + len > MAX_FRAME as usize {
            self.flush(w)?;
        }
        self.buf.extend_from_slice(&gpa.to_le_bytes());
        self.buf
            .extend_from_slice(&((len as u64 / PAGE_SIZE) as u32).to_le_bytes());
        let start = self.buf.len();
        self.buf.resize(start + len, 0);
        fill(&mut self.buf[start..]);
        Ok(())
    }

    pub fn flush(&mut self, w: &mut impl Write) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        write_frame(w, Kind::Pages, &self.buf)?;
        self.bytes_sent += (self.buf.len() + FRAME_HEADER) as u64;
        self.buf.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn layout() -> Vec<RegionLayout> {
        vec![
            RegionLayout {
                guest_addr: 0,
                size: 16 * PAGE_SIZE,
                file_offset: 0,
            },
            RegionLayout {
                guest_addr: 1 << 32,
                size: 4 * PAGE_SIZE,
                file_offset: 16 * PAGE_SIZE,
            },
        ]
    }

    #[test]
    fn pages_round_trip_and_range_checks() {
        let mut out = Vec::new();
        let mut w = PagesWriter::default();
        w.push(&mut out, 0x2000, &[1u8; 8192]).unwrap();
        w.push(&mut out, (1 << 32) + 0x3000, &[2u8; 4096]).unwrap();
        w.flush(&mut out).unwrap();
        let (kind, payload) = read_frame(&mut &out[..]).unwrap();
        assert_eq!(kind, Kind::Pages);
        let runs = parse_pages(&payload, &layout()).unwrap();
        assert_eq!(runs.len(), 2);
        assert_eq!((runs[0].gpa, runs[0].bytes.len()), (0x2000, 8192));
        assert_eq!(runs[1].bytes[0], 2);
        // A run crossing the end of a region, into the gap, or unaligned: refused.
        for (gpa, pages) in [
            (15 * PAGE_SIZE, 2),
            (0x1_0000, 1),
            (0x1001, 1),
            (1 << 32, 5),
        ] {
            let mut p = gpa.to_le_bytes().to_vec();
            p.extend_from_slice(&(pages as u32).to_le_bytes());
            p.extend(std::iter::repeat_n(0u8, pages * 4096));
            assert!(matches!(
                parse_pages(&p, &layout()),
                Err(WireError::OutOfRange { .. })
            ));
        }
    }

    #[test]
    fn headers_and_frames_are_checked() {
        let mut b = Vec::new();
        write_header(&mut b).unwrap();
        read_header(&mut &b[..]).unwrap();
        b[8] = 9;
        assert!(matches!(
            read_header(&mut &b[..]),
            Err(WireError::Version(9))
        ));
        assert!(matches!(
            read_header(&mut &b"GET / HTTP/1.1\r\n"[..]),
            Err(WireError::Magic)
        ));
        let mut f = vec![Kind::State as u8];
        f.extend_from_slice(&(MAX_FRAME + 1).to_le_bytes());
        f.extend_from_slice(&[0; 4]);
        assert!(matches!(
            read_frame(&mut &f[..]),
            Err(WireError::TooLarge(_))
        ));
        assert!(matches!(
            read_frame(&mut &[99u8, 0, 0, 0, 0, 0, 0, 0, 0][..]),
            Err(WireError::Kind(99))
        ));
        // One flipped bit anywhere in a frame: refused.
        let mut f = Vec::new();
        write_frame(&mut f, Kind::Pages, &[7u8; 64]).unwrap();
        for bit in [9 * 8, 20 * 8 + 3, (f.len() - 1) * 8 + 7, 5 * 8] {
            let mut g = f.clone();
            g[bit / 8] ^= 1 << (bit % 8);
            assert!(matches!(
                read_frame(&mut &g[..]),
                Err(WireError::Checksum(Kind::Pages))
            ));
        }
        assert_eq!(read_frame(&mut &f[..]).unwrap().1, vec![7u8; 64]);
    }

    proptest! {
        /// Whatever a peer sends, parsing a Pages payload ends in runs inside RAM or an error.
        #[test]
        fn hostile_pages_payloads(payload in proptest::collection::vec(any::<u8>(), 0..9000),
                                  gpa in any::<u64>(), pages in any::<u32>()) {
            let l = layout();
            if let Ok(runs) = parse_pages(&payload, &l) {
                for r in runs {
                    prop_assert!(l.iter().any(|x| r.gpa >= x.guest_addr
                        && r.gpa + r.bytes.len() as u64 <= x.guest_addr + x.size));
                }
            }
            let mut p = gpa.to_le_bytes().to_vec();
            p.extend_from_slice(&pages.to_le_bytes());
            p.extend_from_slice(&payload);
            let _ = parse_pages(&p, &l);
            let _ = read_frame(&mut &payload[..]);
        }
    }
}
