//! `cargo run --release -p bench --bin virtio-bench`: the virtio devices' own cost, with this
//! process acting as the guest driver (it fills split queues in guest memory, kicks the queue
//! eventfd, and collects completions; no vCPU, so guest speed does not enter), against the raw
//! syscalls on the same file / TAP, in one run. Prints a table with ratios.
//!
//! - virtio-blk on a tmpfs file: 4 KiB random read and write IOPS at queue depth 64, and 1 MiB
//!   sequential read and write MiB/s, against the same sizes and offsets submitted raw at the
//!   same depth (io_uring, 64 per `io_uring_enter`), with one-at-a-time pread/pwrite beside;
//! - virtio-net transmit of 64 KiB TSO frames (virtio-net header with GSO TCPv4) and of
//!   1514-byte frames to a TAP in a private network namespace. The driver keeps the TX ring
//!   full on its own core, as a busy guest's vCPU does, so its work overlaps the device's. The
//!   baseline is writev(2) of the same frames from the same 64 guest buffers in turn to the same
//!   TAP; write(2) of one buffer over and over (always in cache) is printed beside.
//!
//! - the same 4 KiB random I/O on vhost-user-blk: qemu-storage-daemon exporting the same file,
//!   through microvirt's vhost-user frontend, beside the in-process device;
//! - virtio-net transmit of 1514-byte frames through vhost-user-net to DPDK's testpmd
//!   (`rxonly`, `--no-huge`), beside the in-process device writing the same frames to a TAP.
//!
//! Sections: `virtio-bench [blk] [net]` (none named: both).
//! Environment: BENCH_SECONDS per measurement (default 2).

use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};
use vmm::devices::virtio::block::{Block, CacheMode, Disk};
use vmm::devices::virtio::net::{MacAddr, Net, Tap, VNET_HDR_LEN};
use vmm::devices::virtio::{VirtioDevice, VirtioInterrupt};
use vmm::vm::GuestMemory;
use vmm_sys_util::eventfd::EventFd;

const QSIZE: u16 = 256;
const DESC: u64 = 0x1_0000;
const AVAIL: u64 = 0x2_0000;
const USED: u64 = 0x3_0000;
const HDRS: u64 = 0x10_0000; // request headers and status bytes
const DATA: u64 = 0x100_0000; // data buffers
const MEM: usize = 256 << 20;

/// The driver side of one split queue, written by this process into guest memory.
struct Driver {
    mem: GuestMemory,
    next_avail: u16,
    last_used: u16,
    free: u16,
}

impl Driver {
    fn new(mem: GuestMemory) -> Driver {
        Driver {
            mem,
            next_avail: 0,
            last_used: 0,
            free: 0,
        }
    }

    fn queue(&self) -> Queue {
        let mut q = Queue::new(QSIZE).unwrap();
        q.set_size(QSIZE);
        q.set_desc_table_address(Some(DESC as u32), Some(0));
        q.set_avail_ring_address(Some(AVAIL as u32), Some(0));
        q.set_used_ring_address(Some(USED as u32), Some(0));
        q.set_ready(true);
        q
    }

    /// Adds a chain of (addr, len, device-writable) buffers; returns its head. Each
    /// descriptor is one 16-byte write, as a guest driver stores it.
    fn add(&mut self, bufs: &[(u64, u32, bool)]) -> u16 {
        let head = self.free;
        for (i, &(addr, len, w)) in bufs.iter().enumerate() {
            let idx = (self.free + i as u16) % QSIZE;
            let next = (idx + 1) % QSIZE;
            let flags: u16 = if i + 1 < bufs.len() { 1 } else { 0 } | if w { 2 } else { 0 };
            let mut d = [0u8; 16];
            d[0..8].copy_from_slice(&addr.to_le_bytes());
            d[8..12].copy_from_slice(&len.to_le_bytes());
            d[12..14].copy_from_slice(&flags.to_le_bytes());
            d[14..16].copy_from_slice(&next.to_le_bytes());
            self.mem
                .write_slice(&d, GuestAddress(DESC + idx as u64 * 16))
                .unwrap();
        }
        self.free = (self.free + bufs.len() as u16) % QSIZE;
        let slot = AVAIL + 4 + 2 * (self.next_avail % QSIZE) as u64;
        self.mem.write_obj(head, GuestAddress(slot)).unwrap();
        self.next_avail = self.next_avail.wrapping_add(1);
        head
    }

    /// Chains added and not yet used.
    fn in_flight(&self) -> u16 {
        self.next_avail.wrapping_sub(self.last_used)
    }

    /// Takes in the chains the device has used since the last look; returns how many.
    fn reap(&mut self) -> u16 {
        let idx: u16 = self.mem.read_obj(GuestAddress(USED + 2)).unwrap();
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        let n = idx.wrapping_sub(self.last_used);
        self.last_used = idx;
        n
    }

    /// Whether the device wants a kick for what was just published: it sets
    /// VRING_USED_F_NO_NOTIFY while it drains the ring anyway. The full fence orders the
    /// published index before the flag is read, as the virtio spec asks of a driver.
    fn device_wants_kick(&self) -> bool {
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        let flags: u16 = self.mem.read_obj(GuestAddress(USED)).unwrap();
        flags & 1 == 0
    }

    fn publish(&self) {
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
        self.mem
            .write_obj(self.next_avail, GuestAddress(AVAIL + 2))
            .unwrap();
    }

    /// Spins until `n` more chains are used.
    fn wait_used(&mut self, n: u16) {
        let target = self.last_used.wrapping_add(n);
        loop {
            let idx: u16 = self.mem.read_obj(GuestAddress(USED + 2)).unwrap();
            if idx == target {
                break;
            }
            std::hint::spin_loop();
        }
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        self.last_used = target;
    }
}

/// Runs a device's event handler on its own thread, as in the VMM.
fn event_thread(
    sub: Arc<Mutex<dyn MutEventSubscriber + Send>>,
) -> (
    Arc<std::sync::atomic::AtomicBool>,
    std::thread::JoinHandle<()>,
) {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s = stop.clone();
    let h = std::thread::spawn(move || {
        let mut em: EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>> =
            EventManager::new().unwrap();
        em.add_subscriber(sub);
        while !s.load(std::sync::atomic::Ordering::Relaxed) {
            let _ = em.run_with_timeout(50);
        }
    });
    (stop, h)
}

fn seconds() -> Duration {
    Duration::from_secs_f64(
        std::env::var("BENCH_SECONDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2.0),
    )
}

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

#[derive(Clone, Copy)]
enum Op {
    Read,
    Write,
}

/// Drives `depth` requests per kick on the queue at DESC/AVAIL/USED until the time is up;
/// returns (requests per second, bytes per second).
#[allow(clippy::too_many_arguments)]
fn drive_blk(
    mem: &GuestMemory,
    kick: &EventFd,
    sectors: u64,
    op: Op,
    size: u32,
    random: bool,
    depth: u16,
) -> Result<(f64, f64)> {
    let mut drv = Driver::new(mem.clone());
    let per = size as u64 / 512;
    let mut rng = Lcg(7);
    let mut seq = 0u64;
    let (mut done, start, limit) = (0u64, Instant::now(), seconds());
    while start.elapsed() < limit {
        for i in 0..depth as u64 {
            let sector = if random {
                (rng.next() % (sectors / per)) * per
            } else {
                let s = seq;
                seq = (seq + per) % (sectors - per);
                s
            };
            let hdr = HDRS + i * 32;
            let kind: u32 = match op {
                Op::Read => 0,
                Op::Write => 1,
            };
            mem.write_obj(kind, GuestAddress(hdr)).unwrap();
            mem.write_obj(sector, GuestAddress(hdr + 8)).unwrap();
            mem.write_obj(0xffu8, GuestAddress(hdr + 16)).unwrap();
            let data = DATA + i * size as u64;
            drv.add(&[
                (hdr, 16, false),
                (data, size, matches!(op, Op::Read)),
                (hdr + 16, 1, true),
            ]);
        }
        drv.publish();
        kick.write(1)?;
        drv.wait_used(depth);
        for i in 0..depth as u64 {
            let status: u8 = mem.read_obj(GuestAddress(HDRS + i * 32 + 16)).unwrap();
            anyhow::ensure!(status == 0, "request failed with status {status}");
        }
        done += depth as u64;
    }
    let secs = start.elapsed().as_secs_f64();
    Ok((done as f64 / secs, done as f64 * size as f64 / secs))
}

/// The in-process virtio-blk device: (requests per second, bytes per second).
fn blk_device(
    path: &std::path::Path,
    op: Op,
    size: u32,
    random: bool,
    depth: u16,
) -> Result<(f64, f64)> {
    let mem = GuestMemory::from_ranges(&[(GuestAddress(0), MEM)]).unwrap();
    let disk = Disk::open(path, false, CacheMode::Writeback)?;
    let sectors = disk.sectors();
    let block = Arc::new(Mutex::new(Block::new("vda".into(), disk, None)?));
    let kick = block.lock().unwrap().queue_events()[0].try_clone()?;
    let interrupt = VirtioInterrupt::new(EventFd::new(libc::EFD_NONBLOCK)?);
    block
        .lock()
        .unwrap()
        .activate(
            mem.clone(),
            vec![Driver::new(mem.clone()).queue()],
            interrupt,
        )
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let (stop, h) = event_thread(block.clone());
    let r = drive_blk(&mem, &kick, sectors, op, size, random, depth);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    h.join().unwrap();
    r
}

/// The same disk exported by qemu-storage-daemon as vhost-user-blk, driven through microvirt's
/// vhost-user frontend on shared guest memory (the backend does the I/O).
fn blk_vhost_user(
    path: &std::path::Path,
    op: Op,
    size: u32,
    random: bool,
    depth: u16,
) -> Result<(f64, f64)> {
    use vmm::devices::virtio::vhost_user::{blk, Connection, VhostUserDevice};
    let socket = path.with_extension("sock");
    let _ = std::fs::remove_file(&socket);
    let qsd = std::process::Command::new("qemu-storage-daemon")
        .arg("--blockdev")
        .arg(format!(
            "driver=file,node-name=file,filename={},cache.direct=off",
            path.display()
        ))
        .arg("--export")
        .arg(format!(
            "type=vhost-user-blk,id=e,addr.type=unix,addr.path={},node-name=file,writable=on",
            socket.display()
        ))
        .stderr(std::process::Stdio::null())
        .spawn()
        .context("qemu-storage-daemon")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let run = || -> Result<(f64, f64)> {
        let ram = vmm::memory::GuestRam::shared(&[(GuestAddress(0), MEM)], None)?;
        let mem = ram.memory().clone();
        let mut conn = Connection::open(&socket, blk::QUEUES)?;
        let config = conn.config(blk::CONFIG_LEN)?;
        let sectors = blk::capacity(&config).context("capacity")?;
        let dev = VhostUserDevice::new("vda".into(), blk::shape(config), conn)?;
        let kick = dev.queue_events()[0].try_clone()?;
        let dev = Arc::new(Mutex::new(dev));
        let interrupt = VirtioInterrupt::new(EventFd::new(libc::EFD_NONBLOCK)?);
        {
            let mut d = dev.lock().unwrap();
            let f = d.avail_features() & (vmm::devices::virtio::VIRTIO_F_VERSION_1 | 1 << 9);
            d.set_acked_features(f);
            d.activate(
                mem.clone(),
                vec![Driver::new(mem.clone()).queue()],
                interrupt,
            )
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        let r = on_backend(dev, || {
            drive_blk(&mem, &kick, sectors, op, size, random, depth)
        });
        drop(ram);
        r
    };
    let r = run();
    stop_peer(qsd, &socket);
    r
}

/// Runs `work` while `dev`'s event thread serves it, once the thread has handed the rings to
/// the vhost-user backend.
fn on_backend<T>(
    dev: Arc<Mutex<vmm::devices::virtio::vhost_user::VhostUserDevice>>,
    work: impl FnOnce() -> T,
) -> T {
    let (stop, h) = event_thread(dev);
    std::thread::sleep(Duration::from_millis(200));
    let r = work();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    h.join().unwrap();
    r
}

/// Ends a backend process and removes its socket.
fn stop_peer(mut child: std::process::Child, socket: &std::path::Path) {
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_file(socket);
}

/// The same I/O as the device sees it, 64 requests per submission: io_uring with 64 reads
/// or writes queued per `io_uring_enter`, waiting for all 64 (the device is kicked once per 64
/// requests and completes them all before the next kick), so the per-request cost compares
/// like with like.
fn blk_raw_batched(path: &std::path::Path, op: Op, size: u32, random: bool) -> Result<(f64, f64)> {
    use io_uring::{opcode, types, IoUring};
    const DEPTH: usize = 64;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    let sectors = f.metadata()?.len() / 512;
    let per = size as u64 / 512;
    let mut ring = IoUring::new(DEPTH as u32 * 2).context("io_uring_setup")?;
    let fd = types::Fd(f.as_raw_fd());
    let mut bufs = vec![vec![0x5au8; size as usize]; DEPTH];
    let mut rng = Lcg(7);
    let mut seq = 0u64;
    let (mut done, start, limit) = (0u64, Instant::now(), seconds());
    while start.elapsed() < limit {
        for (i, buf) in bufs.iter_mut().enumerate() {
            let sector = if random {
                (rng.next() % (sectors / per)) * per
            } else {
                let s = seq;
                seq = (seq + per) % (sectors - per);
                s
            };
            let entry = match op {
                Op::Read => opcode::Read::new(fd, buf.as_mut_ptr(), size)
                    .offset(sector * 512)
                    .build(),
                Op::Write => opcode::Write::new(fd, buf.as_ptr(), size)
                    .offset(sector * 512)
                    .build(),
            };
            // SAFETY: the buffer and the file outlive the submission: every entry is
            // completed (waited for below) before either is touched again.
            unsafe { ring.submission().push(&entry.user_data(i as u64)) }
                .map_err(|_| anyhow::anyhow!("io_uring submission queue full"))?;
        }
        ring.submit_and_wait(DEPTH).context("io_uring_enter")?;
        let mut completed = 0;
        for cqe in ring.completion() {
            anyhow::ensure!(
                cqe.result() == size as i32,
                "io_uring I/O returned {}",
                cqe.result()
            );
            completed += 1;
        }
        anyhow::ensure!(completed == DEPTH, "{completed} of {DEPTH} completions");
        done += DEPTH as u64;
    }
    let secs = start.elapsed().as_secs_f64();
    Ok((done as f64 / secs, done as f64 * size as f64 / secs))
}

/// The same I/O with pread/pwrite directly, one request per system call.
fn blk_raw(path: &std::path::Path, op: Op, size: u32, random: bool) -> Result<(f64, f64)> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    let sectors = f.metadata()?.len() / 512;
    let per = size as u64 / 512;
    let mut buf = vec![0x5au8; size as usize];
    let mut rng = Lcg(7);
    let mut seq = 0u64;
    let (mut done, start, limit) = (0u64, Instant::now(), seconds());
    while start.elapsed() < limit {
        for _ in 0..64 {
            let sector = if random {
                (rng.next() % (sectors / per)) * per
            } else {
                let s = seq;
                seq = (seq + per) % (sectors - per);
                s
            };
            match op {
                Op::Read => f.read_exact_at(&mut buf, sector * 512)?,
                Op::Write => f.write_all_at(&buf, sector * 512)?,
            }
        }
        done += 64;
    }
    let secs = start.elapsed().as_secs_f64();
    Ok((done as f64 / secs, done as f64 * size as f64 / secs))
}

/// A 64 KiB TCPv4 frame with a virtio-net header asking for segmentation (TSO).
fn tso_frame() -> Vec<u8> {
    let payload = 65_000usize;
    let mut f = vec![0u8; VNET_HDR_LEN + 14 + 20 + 20 + payload];
    let h = &mut f[..VNET_HDR_LEN];
    h[0] = 1; // VIRTIO_NET_HDR_F_NEEDS_CSUM
    h[1] = 1; // VIRTIO_NET_HDR_GSO_TCPV4
    h[2..4].copy_from_slice(&54u16.to_le_bytes()); // hdr_len
    h[4..6].copy_from_slice(&1448u16.to_le_bytes()); // gso_size
    h[6..8].copy_from_slice(&34u16.to_le_bytes()); // csum_start
    h[8..10].copy_from_slice(&16u16.to_le_bytes()); // csum_offset
    let e = &mut f[VNET_HDR_LEN..];
    e[0..6].copy_from_slice(&[0x02, 0, 0, 0, 0, 1]);
    e[6..12].copy_from_slice(&[0x52, 0x54, 0, 0, 0, 2]);
    e[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    let ip = &mut e[14..34];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&((20 + 20 + payload) as u16).to_be_bytes());
    ip[8] = 64;
    ip[9] = 6;
    ip[12..16].copy_from_slice(&[10, 9, 0, 2]);
    ip[16..20].copy_from_slice(&[10, 9, 0, 1]);
    let mut sum = 0u32;
    for c in ip.chunks(2) {
        sum += u16::from_be_bytes([c[0], c[1]]) as u32;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    ip[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    let tcp = &mut e[34..54];
    tcp[0..2].copy_from_slice(&40000u16.to_be_bytes());
    tcp[2..4].copy_from_slice(&5001u16.to_be_bytes());
    tcp[12] = 5 << 4;
    tcp[13] = 0x18;
    tcp[14..16].copy_from_slice(&65535u16.to_be_bytes());
    f
}

/// A 1514-byte Ethernet frame (IPv4/UDP) behind a virtio-net header asking for nothing.
fn mtu_frame() -> Vec<u8> {
    let mut f = vec![0u8; VNET_HDR_LEN + 1514];
    let e = &mut f[VNET_HDR_LEN..];
    e[0..6].copy_from_slice(&[0x02, 0, 0, 0, 0, 1]);
    e[6..12].copy_from_slice(&[0x52, 0x54, 0, 0, 0, 2]);
    e[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    e[14] = 0x45;
    e[16..18].copy_from_slice(&1500u16.to_be_bytes());
    e[22] = 64;
    e[23] = 17;
    f
}

/// Frames in flight on the TX queue at once come from this many buffers in turn.
const TX_BUFFERS: u64 = 64;

/// Writes `frame` into the TX_BUFFERS buffers a transmit bench sends from; their addresses.
fn tx_buffers(mem: &GuestMemory, frame: &[u8]) -> Vec<u64> {
    (0..TX_BUFFERS)
        .map(|i| {
            let at = DATA + i * 0x20000;
            mem.write_slice(frame, GuestAddress(at)).unwrap();
            at
        })
        .collect()
}

/// Transmits `frame` from the TX_BUFFERS buffers in turn, keeping the TX ring full as a busy
/// guest does: whenever there is room for 32 chains (header and data descriptors, as Linux
/// lays them out) the driver fills the ring and kicks, unless the device is draining the
/// ring and said so (VRING_USED_F_NO_NOTIFY). The driver asks for no interrupts
/// (VRING_AVAIL_F_NO_INTERRUPT, as Linux's TX queue does) and polls for used chains, on its
/// own core, so its work overlaps the device's as a vCPU's does. Gbit/s of frame bytes
/// (header excluded), counted once every chain sent is used.
fn drive_tx(mem: &GuestMemory, drv: &mut Driver, kick: &EventFd, frame: &[u8]) -> Result<f64> {
    let buffers = tx_buffers(mem, frame);
    mem.write_obj(1u16, GuestAddress(AVAIL)).unwrap();
    let room = QSIZE / 2;
    let (mut sent, mut next, start, limit) = (0u64, 0usize, Instant::now(), seconds());
    while start.elapsed() < limit {
        drv.reap();
        if room - drv.in_flight() < 32 {
            std::hint::spin_loop();
            continue;
        }
        while drv.in_flight() < room {
            let at = buffers[next];
            next = (next + 1) % buffers.len();
            drv.add(&[
                (at, VNET_HDR_LEN as u32, false),
                (
                    at + VNET_HDR_LEN as u64,
                    (frame.len() - VNET_HDR_LEN) as u32,
                    false,
                ),
            ]);
            sent += 1;
        }
        drv.publish();
        if drv.device_wants_kick() {
            kick.write(1)?;
        }
    }
    let rest = drv.in_flight();
    drv.wait_used(rest);
    Ok(sent as f64 * (frame.len() - VNET_HDR_LEN) as f64 * 8.0
        / start.elapsed().as_secs_f64()
        / 1e9)
}

/// An RX queue with no buffers (these benches only transmit).
fn idle_rx_queue() -> Queue {
    let mut q = Queue::new(QSIZE).unwrap();
    q.set_size(QSIZE);
    q.set_desc_table_address(Some(0x80_0000), Some(0));
    q.set_avail_ring_address(Some(0x81_0000), Some(0));
    q.set_used_ring_address(Some(0x82_0000), Some(0));
    q.set_ready(true);
    q
}

/// Gbit/s of `frame`s transmitted through vhost-user-net to testpmd, which takes them off the
/// ring and drops them (`rxonly`): the frontend's and the backend's cost, no kernel.
fn net_vhost_user(dir: &std::path::Path, frame: &[u8]) -> Result<f64> {
    use vmm::devices::virtio::vhost_user::{net, Connection, VhostUserDevice};
    let socket = dir.join("net.sock");
    let _ = std::fs::remove_file(&socket);
    let mut pmd = std::process::Command::new("dpdk-testpmd")
        .args(["--no-huge", "-m", "256", "--no-pci"])
        .arg(format!("--file-prefix=mv-bench-{}", std::process::id()))
        .arg(format!(
            "--vdev=net_vhost0,iface={},queues=1",
            socket.display()
        ))
        .args([
            "--",
            "--forward-mode=rxonly",
            "--auto-start",
            "--stats-period",
            "60",
            // The default pool does not fit in -m 256 without huge pages.
            "--total-num-mbufs=8192",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .context("dpdk-testpmd (Debian's dpdk)")?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !socket.exists() && Instant::now() < deadline {
        if let Some(status) = pmd.try_wait()? {
            anyhow::bail!(
                "dpdk-testpmd exited ({status}) before making {}",
                socket.display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let run = || -> Result<f64> {
        let ram = vmm::memory::GuestRam::shared(&[(GuestAddress(0), MEM)], None)?;
        let mem = ram.memory().clone();
        let conn = Connection::open(&socket, net::QUEUES)?;
        let dev = VhostUserDevice::new(
            "eth0".into(),
            net::shape(vmm::config::MacAddr([0x52, 0x54, 0, 0, 0, 2])),
            conn,
        )?;
        let kick = dev.queue_events()[1].try_clone()?;
        let dev = Arc::new(Mutex::new(dev));
        let interrupt = VirtioInterrupt::new(EventFd::new(libc::EFD_NONBLOCK)?);
        let mut drv = Driver::new(mem.clone());
        {
            let mut d = dev.lock().unwrap();
            let f = d.avail_features() & vmm::devices::virtio::VIRTIO_F_VERSION_1;
            d.set_acked_features(f);
            d.activate(mem.clone(), vec![idle_rx_queue(), drv.queue()], interrupt)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        let r = on_backend(dev, || drive_tx(&mem, &mut drv, &kick, frame));
        drop(ram);
        r
    };
    let r = run();
    stop_peer(pmd, &socket);
    r
}

/// Transmit rates of `frame` to one TAP, in Gbit/s of frame bytes.
struct NetRates {
    /// Through the virtio-net device.
    device: f64,
    /// write(2) of the same frames from the same TX_BUFFERS guest buffers in turn.
    raw: f64,
    /// write(2) of one buffer over and over: always in cache, so faster than any guest's
    /// stream of distinct buffers; printed beside, not the baseline.
    raw_one_buffer: f64,
}

/// Sends `frame` through the device to a TAP and writes it to the TAP directly, the raw way
/// from the same guest memory the device reads.
fn net_bench(frame: Vec<u8>) -> Result<NetRates> {
    std::thread::spawn(move || -> Result<NetRates> {
        // SAFETY: only this thread's network namespace changes.
        anyhow::ensure!(
            unsafe { libc::unshare(libc::CLONE_NEWNET) } == 0,
            "unshare(CLONE_NEWNET)"
        );
        for args in [
            &["tuntap", "add", "mvb0", "mode", "tap", "vnet_hdr"][..],
            &["link", "set", "mvb0", "up"][..],
        ] {
            anyhow::ensure!(
                std::process::Command::new("ip")
                    .args(args)
                    .status()?
                    .success(),
                "ip {args:?}"
            );
        }
        let limit = seconds();
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), MEM)]).unwrap();
        let frame_bits = (frame.len() - VNET_HDR_LEN) as f64 * 8.0;
        let tap = Tap::open("mvb0").map_err(|e| anyhow::anyhow!("{e}"))?;
        tap.set_offload(0x7).ok();
        // Raw writes of the guest buffers in turn: the bytes the device sends, from where it
        // reads them.
        let iovecs: Vec<libc::iovec> = tx_buffers(&mem, &frame)
            .into_iter()
            .map(|at| {
                let s = mem.get_slice(GuestAddress(at), frame.len()).unwrap();
                libc::iovec {
                    iov_base: s.ptr_guard().as_ptr() as *mut libc::c_void,
                    iov_len: s.len(),
                }
            })
            .collect();
        let (mut frames, start) = (0u64, Instant::now());
        while start.elapsed() < limit {
            for iov in &iovecs {
                // `mem` outlives this loop, so every iovec points at mapped memory.
                tap.writev(std::slice::from_ref(iov)).context("tap write")?;
            }
            frames += iovecs.len() as u64;
        }
        let raw = frames as f64 * frame_bits / start.elapsed().as_secs_f64() / 1e9;
        let (mut frames, start) = (0u64, Instant::now());
        while start.elapsed() < limit {
            for _ in 0..TX_BUFFERS {
                tap.write(&frame).context("tap write")?;
            }
            frames += TX_BUFFERS;
        }
        let raw_one_buffer = frames as f64 * frame_bits / start.elapsed().as_secs_f64() / 1e9;
        drop(tap);

        let tap = Tap::open("mvb0").map_err(|e| anyhow::anyhow!("{e}"))?;
        let net = Arc::new(Mutex::new(Net::new(
            "eth0".into(),
            tap,
            MacAddr([0x52, 0x54, 0, 0, 0, 2]),
        )?));
        let (kick, features) = {
            let n = net.lock().unwrap();
            (n.queue_events()[1].try_clone()?, n.avail_features())
        };
        net.lock().unwrap().set_acked_features(features);
        let mut drv = Driver::new(mem.clone());
        let interrupt = VirtioInterrupt::new(EventFd::new(libc::EFD_NONBLOCK)?);
        net.lock()
            .unwrap()
            .activate(mem.clone(), vec![idle_rx_queue(), drv.queue()], interrupt)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let (stop, h) = event_thread(net.clone());
        let device = drive_tx(&mem, &mut drv, &kick, &frame)?;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        h.join().unwrap();
        let c = net.lock().unwrap().counters;
        anyhow::ensure!(c.tx_errors == 0, "{} transmit errors", c.tx_errors);
        Ok(NetRates {
            device,
            raw,
            raw_one_buffer,
        })
    })
    .join()
    .unwrap()
}

fn main() -> Result<()> {
    let dir =
        std::path::Path::new("/dev/shm").join(format!("mv-virtio-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let img = dir.join("disk.img");
    {
        let f = std::fs::File::create(&img)?;
        f.set_len(256 << 20)?;
        // Allocate it so reads hit real pages, not holes.
        std::io::Write::write_all(&mut &f, &vec![1u8; 256 << 20])?;
    }
    println!("virtio device benchmark: this process is the guest driver (no vCPU); tmpfs image, private netns TAP; {:?} per figure", seconds());
    println!(
        "| workload | virtio device | raw (disk: io_uring, 64 per submission) | device / raw | per-request overhead | target |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | --- |");
    // Sections named on the command line run alone (`virtio-bench net`); none runs all.
    let sections: Vec<String> = std::env::args().skip(1).collect();
    for s in &sections {
        anyhow::ensure!(
            s == "blk" || s == "net",
            "unknown section {s:?}: the sections are blk and net"
        );
    }
    let wants = |s: &str| sections.is_empty() || sections.iter().any(|a| a == s);
    if wants("blk") {
        blk_section(&img)?;
    }
    if wants("net") {
        net_section(&dir)?;
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// The virtio-blk rows: the in-process device, raw I/O at its depth and one at a time, and
/// vhost-user-blk through qemu-storage-daemon.
fn blk_section(img: &std::path::Path) -> Result<()> {
    // vhost-user-blk through qemu-storage-daemon, beside the in-process device and raw.
    let mut vhost_rows = Vec::new();
    let mut pread_rows = Vec::new();
    for (name, op, size, random, unit) in [
        ("blk 4 KiB random read", Op::Read, 4096u32, true, "IOPS"),
        ("blk 4 KiB random write", Op::Write, 4096, true, "IOPS"),
        (
            "blk 1 MiB sequential read",
            Op::Read,
            1 << 20,
            false,
            "MiB/s",
        ),
        (
            "blk 1 MiB sequential write",
            Op::Write,
            1 << 20,
            false,
            "MiB/s",
        ),
    ] {
        let (dr, db) = blk_device(img, op, size, random, 64)?;
        if unit == "IOPS" {
            match blk_vhost_user(img, op, size, random, 64) {
                Ok((vr, _)) => vhost_rows.push((name, vr, dr)),
                Err(e) => eprintln!("vhost-user-blk ({name}): {e:#}"),
            }
        }
        // Raw at the device's depth (64 per submission) where io_uring can do it; the
        // one-at-a-time pread figure is printed beside it.
        let (pr, pb) = blk_raw(img, op, size, random)?;
        let (rr, rb) = match blk_raw_batched(img, op, size, random) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("io_uring baseline ({name}): {e:#}; raw is pread one at a time");
                (pr, pb)
            }
        };
        if unit == "IOPS" {
            pread_rows.push((name, pr, rr));
        }
        let overhead_us = (1e6 / dr - 1e6 / rr).max(0.0);
        let (d, r) = if unit == "IOPS" {
            (dr, rr)
        } else {
            (db / (1 << 20) as f64, rb / (1 << 20) as f64)
        };
        let target = if unit == "IOPS" {
            "≤ 2 µs above raw"
        } else {
            "≥ 1024 MiB/s"
        };
        println!(
            "| {name} | {d:.0} {unit} | {r:.0} {unit} | {:.2} | {overhead_us:.2} µs | {target} |",
            d / r
        );
    }
    for (name, pr, rr) in pread_rows {
        println!(
            "| {name}, raw one at a time (pread/pwrite) | – | {pr:.0} IOPS | {:.2} of raw at depth 64 | – | – |",
            pr / rr
        );
    }
    for (name, vr, dr) in vhost_rows {
        println!(
            "| {name}, vhost-user-blk (qemu-storage-daemon) | {vr:.0} IOPS | in-process device {dr:.0} IOPS | {:.2} of in-process | – | – |",
            vr / dr
        );
    }
    Ok(())
}

/// The virtio-net rows: the device on a TAP against raw TAP writes, and vhost-user-net to
/// testpmd.
fn net_section(dir: &std::path::Path) -> Result<()> {
    let mut one_buffer_rows = Vec::new();
    let mut tap_dev = 0.0;
    for (name, frame, target) in [
        (
            "net transmit, 64 KiB TSO frames",
            tso_frame(),
            "≥ 10 Gbit/s",
        ),
        ("net transmit, 1514-byte frames", mtu_frame(), "–"),
    ] {
        let r = net_bench(frame)?;
        println!(
            "| {name} | {:.2} Gbit/s | {:.2} Gbit/s | {:.2} | – | {target} |",
            r.device,
            r.raw,
            r.device / r.raw
        );
        one_buffer_rows.push((name, r.raw_one_buffer, r.raw));
        tap_dev = r.device;
    }
    for (name, one, raw) in one_buffer_rows {
        println!(
            "| {name}, raw from one buffer (always in cache) | – | {one:.2} Gbit/s | {:.2} of raw from {TX_BUFFERS} buffers | – | – |",
            one / raw
        );
    }
    // vhost-user-net through testpmd, beside the in-process device on the TAP, same frames.
    match net_vhost_user(dir, &mtu_frame()) {
        Ok(vu) => println!(
            "| net transmit, 1514-byte frames, vhost-user-net (testpmd rxonly) | {vu:.2} Gbit/s | in-process device to TAP {tap_dev:.2} Gbit/s | {:.2} of in-process | – | – |",
            vu / tap_dev
        ),
        Err(e) => eprintln!("vhost-user-net (testpmd): {e:#}; row not measured"),
    }
    Ok(())
}
