//! The live-migration stream: a header, then length-prefixed frames in both directions.
//!
//! ```text
//! stream:  magic "MVRTMIGR" | protocol version (u32 LE)          (source → target, once)
//! frame:   kind (u8) | payload length (u32 LE) | CRC-32 of kind, length, payload (u32 LE) | payload
//! source → target: Hello (postcard `Hello`), Plan (runs of `gpa u64 | pages u32`),
//!                  Pages (runs of `gpa u64 | pages u32 | bytes`),
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
/// 2: every frame checksummed; the target confirms with Running after Go. 3: the Hello names
/// the page streams, on which pages travel beside the conversation. 4: Plan frames name the
/// memory the source holds, so the target allocates it ahead of the stream.
pub const PROTOCOL: u32 = 4;
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
    Plan = 7,
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
    /// Streams beside this one that carry the pages (none: pages travel on this one).
    pub page_streams: u8,
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
    #[error("page run at {gpa:#x} on page stream {index}, which does not carry it")]
    WrongStream { gpa: u64, index: usize },
    #[error("malformed {0} frame")]
    Malformed(&'static str),
}

pub fn write_header(w: &mut impl Write) -> std::io::Result<()> {
    w.write_all(&MAGIC)?;
    w.write_all(&PROTOCOL.to_le_bytes())
}

/// Pages per chunk of guest-physical memory: with page streams, every page of one chunk travels
/// on the same stream (`page_stream_of`), so a page sent again in a later pass can never
/// overtake its older copy on another stream, and two streams never write the same page.
pub const CHUNK_BYTES: u64 = MAX_RUN_PAGES as u64 * PAGE_SIZE;

/// Which of `count` page streams carries the page at `gpa`.
pub fn page_stream_of(gpa: u64, count: usize) -> usize {
    ((gpa / CHUNK_BYTES) % count as u64) as usize
}

/// A page stream starts with the stream header and its index among the page streams.
pub fn write_page_stream_header(w: &mut impl Write, index: u8) -> std::io::Result<()> {
    write_header(w)?;
    w.write_all(&[index])
}

/// Reads a page stream's header; returns its index.
pub fn read_page_stream_header(r: &mut impl Read) -> Result<u8, WireError> {
    read_header(r)?;
    let mut i = [0u8];
    r.read_exact(&mut i)?;
    Ok(i[0])
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

/// A frame's header, read and checked (a known kind, a length within `MAX_FRAME`); its payload
/// still to be read, by `read_payload` or, for Pages, `read_pages`.
pub struct FrameHeader {
    pub kind: Kind,
    pub len: usize,
    head: [u8; 5],
    crc: u32,
}

pub fn read_frame_header(r: &mut impl Read) -> Result<FrameHeader, WireError> {
    let mut h = [0u8; FRAME_HEADER];
    r.read_exact(&mut h)?;
    let kind = Kind::try_from(h[0]).map_err(|_| WireError::Kind(h[0]))?;
    let len = u32::from_le_bytes(h[1..5].try_into().unwrap());
    if len > MAX_FRAME {
        return Err(WireError::TooLarge(len));
    }
    Ok(FrameHeader {
        kind,
        len: len as usize,
        head: h[..5].try_into().unwrap(),
        crc: u32::from_le_bytes(h[5..].try_into().unwrap()),
    })
}

impl FrameHeader {
    /// The payload into `buf[..len]`; `buf` only ever grows (to at most `MAX_FRAME`), so a
    /// receiver reuses one buffer instead of allocating and zeroing 16 MiB per frame.
    pub fn read_payload(&self, r: &mut impl Read, buf: &mut Vec<u8>) -> Result<(), WireError> {
        if buf.len() < self.len {
            buf.resize(self.len, 0);
        }
        let payload = &mut buf[..self.len];
        r.read_exact(payload)?;
        if frame_crc(&self.head, payload) != self.crc {
            return Err(WireError::Checksum(self.kind));
        }
        Ok(())
    }

    /// A Pages payload read run by run straight into `memory`, each run checked to lie inside
    /// one region of `layout` before a byte of it is read: the kernel copies the stream into
    /// guest RAM with no buffer between (a copy less per byte on a stream of gigabytes), and
    /// each run's pages are allocated in one call first rather than faulted in one by one.
    ///
    /// The checksum can only be checked once the frame is in, so a corrupted frame may have
    /// landed in RAM when it is refused. That RAM is the target's, which no vCPU runs yet, and
    /// a refused frame fails the migration, which discards the target: corrupted bytes never
    /// run.
    ///
    /// `stream`, for page stream `index` of `count`: every run must lie in one chunk that
    /// stream carries (`page_stream_of`), so no two streams' threads ever write the same bytes.
    pub fn read_pages(
        &self,
        r: &mut impl Read,
        memory: &crate::memory::GuestMemory,
        layout: &[RegionLayout],
        stream: Option<(usize, usize)>,
    ) -> Result<(), WireError> {
        use vm_memory::{GuestAddress, GuestMemoryBackend};
        let mut crc = crc32fast::Hasher::new();
        crc.update(&self.head);
        let mut left = self.len;
        while left > 0 {
            let mut run = [0u8; 12];
            if left < run.len() {
                return Err(WireError::Malformed("Pages"));
            }
            r.read_exact(&mut run)?;
            crc.update(&run);
            left -= run.len();
            let gpa = u64::from_le_bytes(run[..8].try_into().unwrap());
            let pages = u32::from_le_bytes(run[8..].try_into().unwrap());
            let len = run_len(gpa, pages, layout)?;
            if let Some((index, count)) = stream {
                let last = gpa + len as u64 - 1;
                if gpa / CHUNK_BYTES != last / CHUNK_BYTES || page_stream_of(gpa, count) != index {
                    return Err(WireError::WrongStream { gpa, index });
                }
            }
            if len > left {
                return Err(WireError::Malformed("Pages"));
            }
            let slice = memory
                .get_slice(GuestAddress(gpa), len)
                .map_err(|_| WireError::OutOfRange { gpa, pages })?;
            let guard = slice.ptr_guard_mut();
            populate(guard.as_ptr(), len);
            // SAFETY: `get_slice` checked that `len` bytes at `gpa` are mapped guest RAM, which
            // lives as long as `memory`. Nothing else reads or writes these bytes while the
            // target takes in the stream: its vCPUs have not run, its devices are not started,
            // and with page streams each stream's thread writes only the chunks it carries
            // (checked above), the conversation's none; the prefault thread only allocates.
            let dst = unsafe { std::slice::from_raw_parts_mut(guard.as_ptr(), len) };
            r.read_exact(dst)?;
            crc.update(dst);
            left -= len;
        }
        if crc.finalize() != self.crc {
            return Err(WireError::Checksum(self.kind));
        }
        Ok(())
    }
}

/// Allocates the `len` bytes at `at` in one call (MADV_POPULATE_WRITE, Linux 5.14), cheaper
/// than a page fault per 4 KiB while the stream is copied in. Best effort: an older kernel
/// refuses it, and the copy faults the pages in as before.
///
/// Small pages only, for now: advising whole 2 MiB blocks as transparent huge pages (as QEMU
/// does for its RAM) made a single-stream migration of 1 GiB about four times slower on this
/// project's test machine in two runs, though it helped four streams. That machine is itself
/// a VM whose host takes back free 2 MiB blocks (free page reporting), so a huge page likely
/// comes from memory the host must fault in again, where small pages mostly do not; on a
/// node without that, huge pages may well be faster, but that is not measured here.
///
/// Raw bounds rather than a slice: the target's prefault thread allocates pages that a page
/// stream's thread may be writing at the same time (allocating never changes the contents).
pub fn populate(at: *mut u8, len: usize) {
    const MADV_POPULATE_WRITE: libc::c_int = 23;
    // SAFETY: advice on a mapped range this process owns; it changes no contents.
    unsafe { libc::madvise(at.cast(), len, MADV_POPULATE_WRITE) };
}

/// The byte length of a run of `pages` pages at `gpa`, which must lie inside one RAM region.
fn run_len(gpa: u64, pages: u32, layout: &[RegionLayout]) -> Result<usize, WireError> {
    if pages > MAX_RUN_PAGES {
        return Err(WireError::OutOfRange { gpa, pages });
    }
    Ok(run_bytes(gpa, pages, layout)? as usize)
}

/// The byte length of `pages` pages at `gpa`: page-aligned, not empty, inside one RAM region.
fn run_bytes(gpa: u64, pages: u32, layout: &[RegionLayout]) -> Result<u64, WireError> {
    let len = pages as u64 * PAGE_SIZE;
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
    Ok(len)
}

/// Bytes of one run in a Plan frame: `gpa u64 | pages u32`.
pub const PLAN_RUN_BYTES: usize = 12;

/// Plan frames' payloads for `runs` (`(gpa, pages)`), each at most `MAX_FRAME` bytes.
pub fn plan_payloads(runs: impl Iterator<Item = (u64, u32)>) -> Vec<Vec<u8>> {
    let per_frame = MAX_FRAME as usize / PLAN_RUN_BYTES;
    let mut frames: Vec<Vec<u8>> = Vec::new();
    for (gpa, pages) in runs {
        match frames.last_mut() {
            Some(f) if f.len() / PLAN_RUN_BYTES < per_frame => {}
            _ => frames.push(Vec::new()),
        }
        let f = frames.last_mut().expect("pushed above");
        f.extend_from_slice(&gpa.to_le_bytes());
        f.extend_from_slice(&pages.to_le_bytes());
    }
    frames
}

/// The runs of a Plan frame's payload as `(gpa, bytes)`, each checked to lie inside one RAM
/// region of `layout`.
pub fn plan_runs(payload: &[u8], layout: &[RegionLayout]) -> Result<Vec<(u64, u64)>, WireError> {
    if !payload.len().is_multiple_of(PLAN_RUN_BYTES) {
        return Err(WireError::Malformed("Plan"));
    }
    payload
        .chunks_exact(PLAN_RUN_BYTES)
        .map(|run| {
            let gpa = u64::from_le_bytes(run[..8].try_into().unwrap());
            let pages = u32::from_le_bytes(run[8..].try_into().unwrap());
            Ok((gpa, run_bytes(gpa, pages, layout)?))
        })
        .collect()
}

/// Reads one frame, refusing unknown kinds and oversized lengths before allocating, and a
/// payload that does not match its checksum.
pub fn read_frame(r: &mut impl Read) -> Result<(Kind, Vec<u8>), WireError> {
    let header = read_frame_header(r)?;
    let mut payload = Vec::new();
    header.read_payload(r, &mut payload)?;
    payload.truncate(header.len);
    Ok((header.kind, payload))
}

/// Builds Pages frames from runs of guest memory, flushing whenever a frame is full.
pub struct PagesWriter {
    /// One frame's payload, allocated once at its largest; `used` bytes of it are filled.
    buf: Vec<u8>,
    used: usize,
    pub bytes_sent: u64,
}

impl Default for PagesWriter {
    fn default() -> Self {
        PagesWriter {
            buf: vec![0; MAX_FRAME as usize],
            used: 0,
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
    /// into the frame: guest memory is copied once, not into a buffer and then the frame, and
    /// the frame is not cleared first (`fill` overwrites all of it).
    pub fn push_with(
        &mut self,
        w: &mut impl Write,
        gpa: u64,
        len: usize,
        fill: impl FnOnce(&mut [u8]),
    ) -> std::io::Result<()> {
        debug_assert!((len as u64).is_multiple_of(PAGE_SIZE));
        debug_assert!(len <= (MAX_RUN_PAGES as u64 * PAGE_SIZE) as usize);
        if self.used + 12 + len > self.buf.len() {
            self.flush(w)?;
        }
        let run = &mut self.buf[self.used..self.used + 12 + len];
        run[..8].copy_from_slice(&gpa.to_le_bytes());
        run[8..12].copy_from_slice(&((len as u64 / PAGE_SIZE) as u32).to_le_bytes());
        fill(&mut run[12..]);
        self.used += 12 + len;
        Ok(())
    }

    pub fn flush(&mut self, w: &mut impl Write) -> std::io::Result<()> {
        if self.used == 0 {
            return Ok(());
        }
        write_frame(w, Kind::Pages, &self.buf[..self.used])?;
        self.bytes_sent += (self.used + FRAME_HEADER) as u64;
        self.used = 0;
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

    /// Guest RAM laid out as `layout()` says.
    fn memory() -> crate::memory::GuestMemory {
        let ranges: Vec<_> = layout()
            .iter()
            .map(|r| (vm_memory::GuestAddress(r.guest_addr), r.size as usize))
            .collect();
        crate::memory::GuestMemory::from_ranges(&ranges).unwrap()
    }

    /// One frame from `bytes` taken in as the target does: Pages into `mem`.
    fn take_in(bytes: &[u8], mem: &crate::memory::GuestMemory) -> Result<Kind, WireError> {
        let r = &mut &bytes[..];
        let header = read_frame_header(r)?;
        match header.kind {
            Kind::Pages => header.read_pages(r, mem, &layout(), None)?,
            _ => header.read_payload(r, &mut Vec::new())?,
        }
        Ok(header.kind)
    }

    fn pages_frame(gpa: u64, pages: u32, body: usize) -> Vec<u8> {
        let mut p = gpa.to_le_bytes().to_vec();
        p.extend_from_slice(&pages.to_le_bytes());
        p.extend(std::iter::repeat_n(9u8, body));
        let mut f = Vec::new();
        write_frame(&mut f, Kind::Pages, &p).unwrap();
        f
    }

    #[test]
    fn pages_land_in_guest_memory_and_runs_outside_it_are_refused() {
        use vm_memory::{Bytes, GuestAddress};
        let mut out = Vec::new();
        let mut w = PagesWriter::default();
        w.push(&mut out, 0x2000, &[1u8; 8192]).unwrap();
        w.push(&mut out, (1 << 32) + 0x3000, &[2u8; 4096]).unwrap();
        w.flush(&mut out).unwrap();
        let mem = memory();
        assert_eq!(take_in(&out, &mem).unwrap(), Kind::Pages);
        let at = |gpa: u64| mem.read_obj::<u8>(GuestAddress(gpa)).unwrap();
        assert_eq!(
            (at(0x1fff), at(0x2000), at(0x3fff), at(0x4000)),
            (0, 1, 1, 0)
        );
        assert_eq!(at((1 << 32) + 0x3fff), 2);
        // A run crossing the end of a region, into the gap, unaligned, of no pages or longer
        // than a run may be: refused before a byte of it lands.
        for (gpa, pages) in [
            (15 * PAGE_SIZE, 2),
            (0x1_0000, 1),
            (0x1001, 1),
            (1 << 32, 5),
            (0, 0),
            (0, MAX_RUN_PAGES + 1),
        ] {
            let mem = memory();
            let f = pages_frame(gpa, pages, pages.min(16) as usize * 4096);
            assert!(
                matches!(take_in(&f, &mem), Err(WireError::OutOfRange { .. })),
                "{gpa:#x} {pages}"
            );
            assert_eq!(at(0), 0);
        }
        // A run longer than what is left of its frame is malformed, however the frame ends.
        assert!(matches!(
            take_in(&pages_frame(0, 2, 4096), &memory()),
            Err(WireError::Malformed("Pages"))
        ));
        // A corrupted Pages frame is refused once it is in.
        let mut f = pages_frame(0, 1, 4096);
        let last = f.len() - 1;
        f[last] ^= 0x10;
        assert!(matches!(
            take_in(&f, &memory()),
            Err(WireError::Checksum(Kind::Pages))
        ));
    }

    #[test]
    fn a_plan_names_runs_inside_guest_ram_and_nothing_else() {
        let runs = [(0u64, 16u32), (1 << 32, 4), (4 * PAGE_SIZE, 1)];
        let frames = plan_payloads(runs.into_iter());
        assert_eq!(frames.len(), 1);
        assert_eq!(
            plan_runs(&frames[0], &layout()).unwrap(),
            vec![
                (0, 16 * PAGE_SIZE),
                (1 << 32, 4 * PAGE_SIZE),
                (4 * PAGE_SIZE, PAGE_SIZE)
            ]
        );
        for (gpa, pages) in [
            (0u64, 17u32),                 // past the end of the first region
            ((1 << 32) - PAGE_SIZE, 2),    // across the gap
            (1 << 32, 0),                  // empty
            (5, 1),                        // not page-aligned
            (u64::MAX - PAGE_SIZE + 1, 2), // wraps around
        ] {
            let frame = &plan_payloads([(gpa, pages)].into_iter())[0];
            assert!(
                matches!(
                    plan_runs(frame, &layout()),
                    Err(WireError::OutOfRange { .. })
                ),
                "{gpa:#x} + {pages} pages"
            );
        }
        assert!(matches!(
            plan_runs(&frames[0][..13], &layout()),
            Err(WireError::Malformed("Plan"))
        ));
        // A plan longer than a frame holds is split, each part within the frame limit.
        let many = plan_payloads((0..MAX_FRAME as u64 / 12 + 5).map(|i| (i * PAGE_SIZE, 1)));
        assert_eq!(many.len(), 2);
        assert!(many.iter().all(|f| f.len() <= MAX_FRAME as usize));
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
        /// Whatever a peer sends, taking in a Pages frame ends in pages inside RAM or an error,
        /// never a panic (RAM's bounds are vm-memory's to enforce too).
        #[test]
        fn hostile_plan_payloads(payload in proptest::collection::vec(any::<u8>(), 0..600)) {
            // Whatever a plan says, every run it yields lies inside guest RAM.
            if let Ok(runs) = plan_runs(&payload, &layout()) {
                for (gpa, len) in runs {
                    prop_assert!(layout().iter().any(|r| gpa >= r.guest_addr
                        && gpa + len <= r.guest_addr + r.size));
                }
            }
        }

        #[test]
        fn hostile_pages_payloads(payload in proptest::collection::vec(any::<u8>(), 0..9000),
                                  gpa in any::<u64>(), pages in any::<u32>()) {
            let mem = memory();
            let mut p = gpa.to_le_bytes().to_vec();
            p.extend_from_slice(&pages.to_le_bytes());
            p.extend_from_slice(&payload);
            for body in [&payload, &p] {
                let mut f = Vec::new();
                write_frame(&mut f, Kind::Pages, body).unwrap();
                let _ = take_in(&f, &mem);
            }
            let _ = take_in(&payload, &mem);
            let _ = read_frame(&mut &payload[..]);
        }
    }
}
