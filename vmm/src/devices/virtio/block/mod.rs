//! virtio-blk: raw images and block devices, with flush, get-id, discard and write-zeroes.
//! Requests run on the event-manager thread (see `event_handler`), never on a vCPU thread.

pub mod disk;
mod event_handler;
pub mod persist;
pub mod request;

use std::os::fd::AsRawFd;

use vm_memory::bitmap::Bitmap;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

pub use disk::{CacheMode, Disk, DiskError};
use request::*;

use super::{DeviceBase, SingleQueue, TYPE_BLOCK, VIRTIO_F_VERSION_1};
use crate::memory::GuestMemory;

pub const VIRTIO_BLK_F_SIZE_MAX: u64 = 1 << 1;
pub const VIRTIO_BLK_F_SEG_MAX: u64 = 1 << 2;
pub const VIRTIO_BLK_F_RO: u64 = 1 << 5;
pub const VIRTIO_BLK_F_BLK_SIZE: u64 = 1 << 6;
pub const VIRTIO_BLK_F_FLUSH: u64 = 1 << 9;
pub const VIRTIO_BLK_F_DISCARD: u64 = 1 << 13;
pub const VIRTIO_BLK_F_WRITE_ZEROES: u64 = 1 << 14;

pub const QUEUE_SIZE: u16 = 256;
/// Largest single data segment and most segments per request we accept (and advertise).
pub const SIZE_MAX: u32 = 1 << 20;
pub const SEG_MAX: u32 = 126;
/// O_DIRECT alignment for bounce buffers.
const DIRECT_ALIGN: usize = 4096;
const MAX_DISCARD_SECTORS: u32 = u32::MAX >> SECTOR_SHIFT;

/// Per-device counters for status reporting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockCounters {
    pub requests: u64,
    /// Completed read and write requests (what KubeVirt reports as IOPS totals).
    pub reads: u64,
    pub writes: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub flushes: u64,
    pub errors: u64,
}

pub struct Block {
    pub id: String,
    disk: Disk,
    serial: [u8; VIRTIO_BLK_ID_BYTES as usize],
    base: DeviceBase,
    active: Option<SingleQueue>,
    pub counters: BlockCounters,
}

impl Block {
    pub fn new(id: String, disk: Disk, serial: Option<&str>) -> std::io::Result<Block> {
        let mut avail_features = VIRTIO_F_VERSION_1
            | VIRTIO_BLK_F_SIZE_MAX
            | VIRTIO_BLK_F_SEG_MAX
            | VIRTIO_BLK_F_BLK_SIZE
            | VIRTIO_BLK_F_FLUSH;
        if disk.read_only {
            avail_features |= VIRTIO_BLK_F_RO;
        } else {
            avail_features |= VIRTIO_BLK_F_DISCARD | VIRTIO_BLK_F_WRITE_ZEROES;
        }
        let mut s = [0u8; VIRTIO_BLK_ID_BYTES as usize];
        if let Some(serial) = serial {
            let b = serial.as_bytes();
            let n = b.len().min(s.len());
            s[..n].copy_from_slice(&b[..n]);
        }
        let base = DeviceBase::new(
            TYPE_BLOCK,
            &[QUEUE_SIZE],
            avail_features,
            build_config(disk.sectors()),
        )?;
        Ok(Block {
            id,
            disk,
            serial: s,
            base,
            active: None,
            counters: BlockCounters::default(),
        })
    }

    pub fn disk(&self) -> &Disk {
        &self.disk
    }

    /// Executes and completes every available request; interrupts the guest once at the end.
    pub fn process_queue(&mut self) {
        let Some(active) = self.active.as_mut() else {
            return;
        };
        active.serve(&self.id, |mem, descs| {
            execute(&self.disk, &self.serial, mem, descs, &mut self.counters)
        });
    }
}

/// The virtio_blk_config layout (VIRTIO 1.2 §5.2.4).
fn build_config(sectors: u64) -> Vec<u8> {
    let mut c = vec![0u8; 60];
    c[0..8].copy_from_slice(&sectors.to_le_bytes());
    c[8..12].copy_from_slice(&SIZE_MAX.to_le_bytes());
    c[12..16].copy_from_slice(&SEG_MAX.to_le_bytes());
    c[20..24].copy_from_slice(&(SECTOR_SIZE as u32).to_le_bytes()); // blk_size
    c[36..40].copy_from_slice(&MAX_DISCARD_SECTORS.to_le_bytes());
    let segments = request::MAX_ZEROING_SEGMENTS as u32;
    c[40..44].copy_from_slice(&segments.to_le_bytes()); // max_discard_seg
    c[44..48].copy_from_slice(&1u32.to_le_bytes()); // discard_sector_alignment
    c[48..52].copy_from_slice(&MAX_DISCARD_SECTORS.to_le_bytes()); // max_write_zeroes_sectors
    c[52..56].copy_from_slice(&segments.to_le_bytes()); // max_write_zeroes_seg
    c[56] = 1; // write_zeroes_may_unmap
    c
}

/// Runs one request and writes its status; returns the used length (bytes the device wrote).
fn execute(
    disk: &Disk,
    serial: &[u8],
    mem: &GuestMemory,
    descs: &[virtio_queue::desc::split::Descriptor],
    counters: &mut BlockCounters,
) -> u32 {
    counters.requests += 1;
    let limits = Limits {
        seg_max: SEG_MAX,
        size_max: SIZE_MAX,
    };
    let (status, status_addr, written) = match parse(mem, descs, limits) {
        Ok(req) => {
            let (status, written) = match run(disk, serial, mem, &req, counters) {
                Ok(w) => (VIRTIO_BLK_S_OK, w),
                Err(s) => (s, 0),
            };
            (status, Some(req.status), written)
        }
        Err((e, status_addr)) => {
            tracing::debug!("virtio-blk: malformed request: {e}");
            (VIRTIO_BLK_S_IOERR, status_addr, 0)
        }
    };
    if status != VIRTIO_BLK_S_OK {
        counters.errors += 1;
    }
    match status_addr {
        Some(a) if mem.write_obj(status, a).is_ok() => written + 1,
        _ => 0,
    }
}

fn io_err(e: std::io::Error) -> u8 {
    tracing::debug!("virtio-blk: I/O error: {e}");
    VIRTIO_BLK_S_IOERR
}

/// Checks a sector range lies within the disk; returns the byte offset.
fn disk_range(disk: &Disk, sector: u64, len: u64) -> Result<u64, u8> {
    let off = sector.checked_mul(SECTOR_SIZE).ok_or(VIRTIO_BLK_S_IOERR)?;
    match off.checked_add(len) {
        Some(end) if end <= disk.size => Ok(off),
        _ => Err(VIRTIO_BLK_S_IOERR),
    }
}

fn run(
    disk: &Disk,
    serial: &[u8],
    mem: &GuestMemory,
    req: &Request,
    counters: &mut BlockCounters,
) -> Result<u32, u8> {
    match req.kind {
        RequestType::In => {
            let mut off = disk_range(disk, req.sector, req.data_len())?;
            for &(addr, len) in &req.data {
                transfer(disk, mem, addr, len, off, Direction::FromDisk)?;
                off += len as u64;
            }
            counters.read_bytes += req.data_len();
            counters.reads += 1;
            Ok(req.data_len() as u32)
        }
        RequestType::Out => {
            if disk.read_only {
                return Err(VIRTIO_BLK_S_IOERR);
            }
            let mut off = disk_range(disk, req.sector, req.data_len())?;
            for &(addr, len) in &req.data {
                transfer(disk, mem, addr, len, off, Direction::ToDisk)?;
                off += len as u64;
            }
            counters.write_bytes += req.data_len();
            counters.writes += 1;
            Ok(0)
        }
        RequestType::Flush => {
            counters.flushes += 1;
            if disk.read_only {
                return Ok(0);
            }
            disk.file.sync_data().map_err(io_err)?;
            Ok(0)
        }
        RequestType::GetId => {
            let (addr, _) = req.data[0];
            mem.write_slice(serial, addr)
                .map_err(|_| VIRTIO_BLK_S_IOERR)?;
            Ok(serial.len() as u32)
        }
        RequestType::Discard | RequestType::WriteZeroes => {
            if disk.read_only {
                return Err(VIRTIO_BLK_S_IOERR);
            }
            for &(addr, len) in &req.data {
                for i in 0..(len / SEGMENT_SIZE) {
                    let at = GuestAddress(addr.0 + (i * SEGMENT_SIZE) as u64);
                    let sector: u64 = mem.read_obj(at).map_err(|_| VIRTIO_BLK_S_IOERR)?;
                    let n: u32 = mem
                        .read_obj(GuestAddress(at.0 + 8))
                        .map_err(|_| VIRTIO_BLK_S_IOERR)?;
                    let flags: u32 = mem
                        .read_obj(GuestAddress(at.0 + 12))
                        .map_err(|_| VIRTIO_BLK_S_IOERR)?;
                    let bytes = (n as u64) << SECTOR_SHIFT;
                    let off = disk_range(disk, sector, bytes)?;
                    let unmap =
                        req.kind == RequestType::Discard || flags & WRITE_ZEROES_FLAG_UNMAP != 0;
                    zero_range(disk, off, bytes, unmap)?;
                }
            }
            Ok(0)
        }
        RequestType::Unsupported(t) => {
            tracing::debug!("virtio-blk: unsupported request type {t}");
            Err(VIRTIO_BLK_S_UNSUPP)
        }
    }
}

/// Discard punches a hole (reads return zeroes); write-zeroes without unmap keeps the
/// allocation. Both leave zeroes behind, so a guest can rely on either.
fn zero_range(disk: &Disk, off: u64, len: u64, unmap: bool) -> Result<(), u8> {
    if len == 0 {
        return Ok(());
    }
    let mode = if unmap {
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
    } else {
        libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
    };
    // SAFETY: fallocate on our own fd with checked, in-range arguments.
    let r = unsafe { libc::fallocate(disk.file.as_raw_fd(), mode, off as i64, len as i64) };
    if r == 0 {
        return Ok(());
    }
    // File systems without hole punching: write zeroes.
    let zeroes = vec![0u8; 64 * 1024];
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(zeroes.len() as u64) as usize;
        pwrite_all(&disk.file, &zeroes[..n], off + done).map_err(io_err)?;
        done += n as u64;
    }
    Ok(())
}

fn pwrite_all(f: &std::fs::File, buf: &[u8], off: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    f.write_all_at(buf, off)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    FromDisk,
    ToDisk,
}

/// A page-aligned buffer for O_DIRECT, whose buffers, offsets and lengths must be aligned.
struct AlignedBuf {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl AlignedBuf {
    fn new(len: usize) -> AlignedBuf {
        let layout = std::alloc::Layout::from_size_align(len.max(DIRECT_ALIGN), DIRECT_ALIGN)
            .expect("layout");
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "out of memory");
        AlignedBuf { ptr, layout }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

/// Moves `len` bytes between guest memory at `addr` and the disk at `off`. A short read (the
/// image is shorter than it was) is an I/O error, never stale guest data reported as success.
fn transfer(
    disk: &Disk,
    mem: &GuestMemory,
    addr: GuestAddress,
    len: u32,
    off: u64,
    dir: Direction,
) -> Result<(), u8> {
    if len == 0 {
        return Ok(());
    }
    let slice = mem
        .get_slice(addr, len as usize)
        .map_err(|_| VIRTIO_BLK_S_IOERR)?;
    let fd = disk.file.as_raw_fd();
    let len = len as usize;
    let direct = disk.cache == CacheMode::None;
    let bounce = direct.then(|| AlignedBuf::new(len.next_multiple_of(DIRECT_ALIGN)));
    let rw_len = if direct {
        len.next_multiple_of(SECTOR_SIZE as usize)
    } else {
        len
    };
    match dir {
        Direction::FromDisk => {
            let guard = slice.ptr_guard_mut();
            let buf = bounce.as_ref().map_or(guard.as_ptr(), |b| b.ptr);
            let n = full_io(rw_len, |done| {
                // SAFETY: `buf` has `rw_len` writable bytes (guest slice or bounce buffer).
                unsafe {
                    libc::pread(
                        fd,
                        buf.add(done) as *mut libc::c_void,
                        rw_len - done,
                        (off + done as u64) as i64,
                    )
                }
            })?;
            if n < len {
                return Err(VIRTIO_BLK_S_IOERR);
            }
            if let Some(b) = &bounce {
                // SAFETY: both ranges have `len` bytes and do not overlap.
                unsafe { std::ptr::copy_nonoverlapping(b.ptr, guard.as_ptr(), len) };
            }
            // The VMM wrote guest memory behind KVM's back: record it for migration.
            slice.bitmap().mark_dirty(0, len);
        }
        Direction::ToDisk => {
            let guard = slice.ptr_guard();
            let buf = match &bounce {
                Some(b) => {
                    // SAFETY: both ranges have `len` bytes and do not overlap.
                    unsafe { std::ptr::copy_nonoverlapping(guard.as_ptr(), b.ptr, len) };
                    b.ptr as *const u8
                }
                None => guard.as_ptr(),
            };
            let n = full_io(rw_len, |done| {
                // SAFETY: `buf` has `rw_len` readable bytes.
                unsafe {
                    libc::pwrite(
                        fd,
                        buf.add(done) as *const libc::c_void,
                        rw_len - done,
                        (off + done as u64) as i64,
                    )
                }
            })?;
            if n < len {
                return Err(VIRTIO_BLK_S_IOERR);
            }
        }
    }
    Ok(())
}

/// Repeats a positional read or write (`op(done)` transfers from byte `done` on) until `total`
/// bytes moved, EOF, or an error; returns the bytes moved.
fn full_io(total: usize, mut op: impl FnMut(usize) -> isize) -> Result<usize, u8> {
    let mut done = 0usize;
    while done < total {
        match op(done) {
            0 => break,
            r if r > 0 => done += r as usize,
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(io_err(e));
                }
            }
        }
    }
    Ok(done)
}

super::single_queue_device!(Block);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::{VirtioDevice, VirtioInterrupt, INT_USED_RING};
    use std::io::Write;
    use virtio_bindings::bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::Queue;
    use vmm_sys_util::eventfd::EventFd;

    const HDR: u64 = 0x10_0000;
    const DATA: u64 = 0x20_0000;
    const STATUS: u64 = 0x30_0000;

    fn mem() -> GuestMemory {
        GuestMemory::from_ranges(&[(GuestAddress(0), 8 << 20)]).unwrap()
    }

    fn image(name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("mv-blk-{}-{name}", std::process::id()));
        std::fs::File::create(&p).unwrap().write_all(bytes).unwrap();
        p
    }

    fn desc(addr: u64, len: u32, flags: u32) -> RawDescriptor {
        RawDescriptor::from(SplitDescriptor::new(addr, len, flags as u16, 0))
    }

    /// Submits one request through a mock split queue and returns (status, used len).
    fn submit(
        block: &mut Block,
        m: &GuestMemory,
        kind: u32,
        sector: u64,
        data: Option<(u32, bool)>,
    ) -> (u8, u32) {
        m.write_obj(kind, GuestAddress(HDR)).unwrap();
        m.write_obj(sector, GuestAddress(HDR + 8)).unwrap();
        m.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        let mut descs = vec![desc(HDR, 16, VRING_DESC_F_NEXT)];
        if let Some((len, write)) = data {
            descs.push(desc(
                DATA,
                len,
                VRING_DESC_F_NEXT | if write { VRING_DESC_F_WRITE } else { 0 },
            ));
        }
        descs.push(desc(STATUS, 1, VRING_DESC_F_WRITE));
        let vq = MockSplitQueue::new(m, 16);
        vq.build_desc_chain(&descs).unwrap();
        let q: Queue = vq.create_queue().unwrap();
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let interrupt = VirtioInterrupt::new(irq.try_clone().unwrap());
        block
            .activate(m.clone(), vec![q], interrupt.clone())
            .unwrap();
        block.process_queue();
        assert_eq!(irq.read().unwrap(), 1, "the guest is interrupted once");
        assert_eq!(
            interrupt.status.load(std::sync::atomic::Ordering::SeqCst) & INT_USED_RING,
            INT_USED_RING
        );
        let used_idx: u16 = m.read_obj(vq.used_addr().unchecked_add(2)).unwrap();
        assert_eq!(used_idx, 1);
        let used_len: u32 = m.read_obj(vq.used_addr().unchecked_add(8)).unwrap();
        (m.read_obj(GuestAddress(STATUS)).unwrap(), used_len)
    }

    fn block(path: &std::path::Path, ro: bool, cache: CacheMode) -> Block {
        Block::new(
            "vda".into(),
            Disk::open(path, ro, cache).unwrap(),
            Some("serial-1"),
        )
        .unwrap()
    }

    use vm_memory::Address;

    #[test]
    fn read_write_flush_getid_through_the_queue() {
        let m = mem();
        let p = image("rw", &vec![0u8; 64 * 1024]);
        let mut b = block(&p, false, CacheMode::Writeback);
        m.write_slice(&[0xab; 1024], GuestAddress(DATA)).unwrap();
        assert_eq!(
            submit(&mut b, &m, VIRTIO_BLK_T_OUT, 3, Some((1024, false))),
            (VIRTIO_BLK_S_OK, 1)
        );
        let file = std::fs::read(&p).unwrap();
        assert!(file[3 * 512..5 * 512].iter().all(|&x| x == 0xab));
        assert!(file[..3 * 512].iter().all(|&x| x == 0));
        m.write_slice(&[0u8; 1024], GuestAddress(DATA)).unwrap();
        assert_eq!(
            submit(&mut b, &m, VIRTIO_BLK_T_IN, 3, Some((512, true))),
            (VIRTIO_BLK_S_OK, 513)
        );
        let mut got = [0u8; 512];
        m.read_slice(&mut got, GuestAddress(DATA)).unwrap();
        assert!(got.iter().all(|&x| x == 0xab));
        assert_eq!(
            submit(&mut b, &m, VIRTIO_BLK_T_FLUSH, 0, None).0,
            VIRTIO_BLK_S_OK
        );
        assert_eq!(
            submit(&mut b, &m, VIRTIO_BLK_T_GET_ID, 0, Some((20, true))),
            (VIRTIO_BLK_S_OK, 21)
        );
        let mut id = [0u8; 20];
        m.read_slice(&mut id, GuestAddress(DATA)).unwrap();
        assert_eq!(&id[..9], b"serial-1\0");
        assert_eq!(b.counters.flushes, 1);
        assert_eq!((b.counters.read_bytes, b.counters.write_bytes), (512, 1024));
        // Unknown request types are unsupported, not errors of the VMM.
        assert_eq!(submit(&mut b, &m, 99, 0, None).0, VIRTIO_BLK_S_UNSUPP);
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn out_of_range_and_read_only_are_io_errors() {
        let m = mem();
        let p = image("ro", &vec![7u8; 8 * 512]);
        let mut b = block(&p, true, CacheMode::Writeback);
        assert_eq!(b.avail_features() & VIRTIO_BLK_F_RO, VIRTIO_BLK_F_RO);
        assert_eq!(
            submit(&mut b, &m, VIRTIO_BLK_T_OUT, 0, Some((512, false))).0,
            VIRTIO_BLK_S_IOERR
        );
        assert_eq!(
            submit(&mut b, &m, VIRTIO_BLK_T_IN, 7, Some((1024, true))).0,
            VIRTIO_BLK_S_IOERR
        );
        assert_eq!(
            submit(&mut b, &m, VIRTIO_BLK_T_IN, u64::MAX, Some((512, true))).0,
            VIRTIO_BLK_S_IOERR
        );
        assert_eq!(
            submit(&mut b, &m, VIRTIO_BLK_T_IN, 7, Some((512, true))).0,
            VIRTIO_BLK_S_OK
        );
        assert!(
            std::fs::read(&p).unwrap().iter().all(|&x| x == 7),
            "a read-only image is never written"
        );
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn short_read_of_truncated_image_is_an_io_error() {
        let m = mem();
        let p = image("trunc", &vec![1u8; 16 * 512]);
        let mut b = block(&p, false, CacheMode::Writeback);
        // Another process shrinks the image under the running VM.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(4 * 512)
            .unwrap();
        assert_eq!(
            submit(&mut b, &m, VIRTIO_BLK_T_IN, 8, Some((512, true))).0,
            VIRTIO_BLK_S_IOERR
        );
        assert_eq!(
            submit(&mut b, &m, VIRTIO_BLK_T_IN, 3, Some((1024, true))).0,
            VIRTIO_BLK_S_IOERR
        );
        assert_eq!(
            submit(&mut b, &m, VIRTIO_BLK_T_IN, 0, Some((512, true))).0,
            VIRTIO_BLK_S_OK
        );
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn discard_and_write_zeroes_leave_zeroes() {
        let m = mem();
        let p = image("zero", &vec![9u8; 64 * 512]);
        let mut b = block(&p, false, CacheMode::Writeback);
        for (kind, sector) in [
            (VIRTIO_BLK_T_DISCARD, 8u64),
            (VIRTIO_BLK_T_WRITE_ZEROES, 32),
        ] {
            m.write_obj(sector, GuestAddress(DATA)).unwrap();
            m.write_obj(8u32, GuestAddress(DATA + 8)).unwrap();
            m.write_obj(0u32, GuestAddress(DATA + 12)).unwrap();
            assert_eq!(
                submit(&mut b, &m, kind, 0, Some((16, false))).0,
                VIRTIO_BLK_S_OK
            );
        }
        let file = std::fs::read(&p).unwrap();
        assert_eq!(file.len(), 64 * 512, "size is kept");
        for (i, chunk) in file.chunks(512).enumerate() {
            let zero = (8..16).contains(&i) || (32..40).contains(&i);
            assert!(
                chunk.iter().all(|&x| x == if zero { 0 } else { 9 }),
                "sector {i}"
            );
        }
        // A segment past the end fails.
        m.write_obj(60u64, GuestAddress(DATA)).unwrap();
        assert_eq!(
            submit(&mut b, &m, VIRTIO_BLK_T_DISCARD, 0, Some((16, false))).0,
            VIRTIO_BLK_S_IOERR
        );
        // More segments than the device advertises (one): refused whole, nothing zeroed, and
        // the device goes on serving.
        std::fs::write(&p, vec![9u8; 64 * 512]).unwrap();
        for (i, sector) in [0u64, 16].into_iter().enumerate() {
            let at = DATA + 16 * i as u64;
            m.write_obj(sector, GuestAddress(at)).unwrap();
            m.write_obj(8u32, GuestAddress(at + 8)).unwrap();
            m.write_obj(0u32, GuestAddress(at + 12)).unwrap();
        }
        for kind in [VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_WRITE_ZEROES] {
            assert_ne!(
                submit(&mut b, &m, kind, 0, Some((32, false))).0,
                VIRTIO_BLK_S_OK
            );
        }
        assert!(
            std::fs::read(&p).unwrap().iter().all(|&x| x == 9),
            "nothing was zeroed"
        );
        assert_eq!(
            submit(&mut b, &m, VIRTIO_BLK_T_DISCARD, 0, Some((16, false))).0,
            VIRTIO_BLK_S_OK
        );
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn second_writer_is_locked_out() {
        let p = image("lock", &[0u8; 512]);
        let _first = Disk::open(&p, false, CacheMode::Writeback).unwrap();
        assert!(matches!(
            Disk::open(&p, false, CacheMode::Writeback),
            Err(DiskError::Locked { .. })
        ));
        assert!(matches!(
            Disk::open(&p, true, CacheMode::Writeback),
            Err(DiskError::Locked { .. })
        ));
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn garbage_rings_never_panic() {
        // Random descriptor tables and an available index far beyond the queue size.
        let m = mem();
        let p = image("garbage", &[0u8; 4096]);
        let mut b = block(&p, false, CacheMode::Writeback);
        let vq = MockSplitQueue::new(&m, 16);
        let mut seed = 0x1234_5678u64;
        for i in 0..16u16 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let d = SplitDescriptor::new(
                seed % (16 << 20),
                (seed >> 20) as u32 % 70000,
                (seed >> 40) as u16 & 7,
                (seed >> 50) as u16 % 20,
            );
            vq.desc_table().store(i, RawDescriptor::from(d)).unwrap();
            m.write_obj(
                (seed >> 8) as u16 % 20,
                vq.avail_addr().unchecked_add(4 + 2 * i as u64),
            )
            .unwrap();
        }
        m.write_obj(16u16, vq.avail_addr().unchecked_add(2))
            .unwrap();
        let q: Queue = vq.create_queue().unwrap();
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let interrupt = VirtioInterrupt::new(irq);
        b.activate(m.clone(), vec![q], interrupt.clone()).unwrap();
        b.process_queue();
        assert!(b.counters.errors > 0);
        // An available index 1000 ahead of what was consumed breaks the ring protocol.
        m.write_obj(1016u16, vq.avail_addr().unchecked_add(2))
            .unwrap();
        b.process_queue();
        assert!(interrupt
            .needs_reset
            .load(std::sync::atomic::Ordering::SeqCst));
        std::fs::remove_file(p).unwrap();
    }
}
