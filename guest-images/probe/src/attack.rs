//! `probe.test=attack`: the probe as a hostile kernel. On every virtio-blk disk it feeds the
//! VMM descriptors outside RAM and in the MMIO gap, chains that loop, lengths near u32::MAX,
//! indirect tables inside indirect tables, an available index that jumps past the queue size,
//! queue sizes that are not powers of two, random values to every register in every device
//! state, resets in the middle of I/O and interrupts it never acknowledges; on every virtio-net
//! NIC hostile transmit chains and receive buffers it must refuse; then port I/O to every port. After each attack the disk must still work: a reset, a fresh setup and a read of
//! sector 0 that returns the host's marker. The host checks the rest — the VMM alive, the disk
//! images untouched, its memory bounded.

use core::fmt::Write;
use core::ptr::{addr_of_mut, write_bytes, write_volatile};

use crate::blk::{data_ptr, Disk, F_FLUSH, T_IN, T_OUT};
use crate::hw::{inb, outb, Serial};
use crate::result;
use crate::virtio::{Device, Rings, DESC_F_WRITE, QUEUE_SIZE};

const DESC_F_NEXT: u16 = 1;
const DESC_F_INDIRECT: u16 = 4;
/// How long to wait for a completion the device may rightly never give.
const SHORT_SPINS: u32 = 200_000;
const OUTSIDE_RAM: u64 = 0x40_0000_0000;
const LAPIC: u64 = 0xfee0_0000;
/// What the host writes at the start of every disk; the health check reads it back.
const MARK: &[u8] = b"MICROVIRT ATTACK DISK";

static mut RINGS: Rings = Rings::new();

#[repr(C, align(4096))]
struct Page([u8; 4096]);
static mut TABLE: Page = Page([0; 4096]);

fn table() -> *mut u64 {
    unsafe { addr_of_mut!(TABLE.0) as *mut u64 }
}

/// xorshift64: the "random" register values, the same every run.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 as u32
    }
}

/// A reset device, set up as a driver would, on zeroed rings.
fn fresh(base: u64) -> Result<Disk, &'static str> {
    let dev = Device { base };
    dev.write(0x70, 0);
    dev.init(F_FLUSH)?;
    let rings = unsafe { &mut *addr_of_mut!(RINGS) };
    unsafe {
        write_bytes(
            rings as *mut Rings as *mut u8,
            0,
            core::mem::size_of::<Rings>(),
        )
    };
    let q = dev.setup_queue(0, rings)?;
    dev.driver_ok();
    Ok(Disk { dev, q })
}

/// The disk still works after a reset: sector 0 reads back with the host's marker.
fn healthy(base: u64) -> Result<(), &'static str> {
    let mut d = fresh(base)?;
    unsafe { write_bytes(data_ptr(), 0, 512) };
    if d.request(T_IN, 0, &[(data_ptr() as u64, 512, true)])? != 0 {
        return Err("the health-check read failed");
    }
    let got = unsafe { core::slice::from_raw_parts(data_ptr(), MARK.len()) };
    if got != MARK {
        return Err("the health-check read returned the wrong data");
    }
    Ok(())
}

fn set_header(kind: u32, sector: u64) -> u64 {
    let hdr = Disk::header();
    unsafe {
        write_volatile(hdr as *mut u32, kind);
        write_volatile((hdr + 4) as *mut u32, 0);
        write_volatile((hdr + 8) as *mut u64, sector);
        write_volatile((hdr + 64) as *mut u8, 0xff);
    }
    hdr
}

/// Publishes `head` (moving the index by `step`), kicks the device and says what happened.
fn submit(d: &mut Disk, head: u16, step: u16) -> (bool, u8, u32) {
    d.q.publish(head, step);
    d.dev.notify(&d.q);
    let used = d.q.wait_used(SHORT_SPINS).is_some();
    let st = unsafe { core::ptr::read_volatile((Disk::header() + 64) as *const u8) };
    (used, st, d.dev.status())
}

/// A three-descriptor request (header, one data buffer, status) with a hostile data buffer.
fn request_with(d: &mut Disk, kind: u32, addr: u64, len: u32) -> (bool, u8, u32) {
    let hdr = set_header(kind, 0);
    let w = if kind == T_IN { DESC_F_WRITE } else { 0 };
    d.q.set_desc(0, hdr, 16, DESC_F_NEXT, 1);
    d.q.set_desc(1, addr, len, DESC_F_NEXT | w, 2);
    d.q.set_desc(2, hdr + 64, 1, DESC_F_WRITE, 0);
    submit(d, 0, 1)
}

/// One attack on one disk: `f` does it on a fresh device; the disk must then be healthy.
fn attack(
    count: &mut u32,
    disk: usize,
    base: u64,
    name: &str,
    f: impl FnOnce(&mut Disk) -> (bool, u8, u32),
) {
    let outcome = match fresh(base) {
        Ok(mut d) => f(&mut d),
        Err(e) => result(false, format_args!("{name} disk{disk}: setup: {e}")),
    };
    if let Err(e) = healthy(base) {
        result(false, format_args!("{name} disk{disk}: afterwards {e}"));
    }
    *count += 1;
    let _ = writeln!(
        Serial,
        "probe: attack {name} disk{disk}: completed={} status={:#x} device_status={:#x}; disk healthy",
        outcome.0, outcome.1, outcome.2
    );
}

fn on_disk(disk: usize, base: u64, count: &mut u32, rng: &mut Rng) {
    chain_attacks(disk, base, count);
    device_attacks(disk, base, count, rng);
}

/// Requests whose descriptors point where they must not, or chain where they must not.
fn chain_attacks(disk: usize, base: u64, count: &mut u32) {
    let data = data_ptr() as u64;
    for (name, kind, addr, len) in [
        ("write-from-outside-ram", T_OUT, OUTSIDE_RAM, 512),
        ("read-into-outside-ram", T_IN, OUTSIDE_RAM, 512),
        ("read-into-own-mmio", T_IN, base, 4096),
        ("write-from-lapic", T_OUT, LAPIC, 512),
        ("read-across-ram-end", T_IN, data, 0xffff_fe00),
        ("write-len-u32-max", T_OUT, data, u32::MAX),
        ("write-len-zero", T_OUT, data, 0),
    ] {
        attack(count, disk, base, name, |d| {
            request_with(d, kind, addr, len)
        });
    }
    attack(count, disk, base, "lengths-overflowing-u32", |d| {
        let hdr = set_header(T_IN, 0);
        d.q.set_desc(0, hdr, 16, DESC_F_NEXT, 1);
        d.q.set_desc(1, data, 0x8000_0000, DESC_F_NEXT | DESC_F_WRITE, 2);
        d.q.set_desc(2, data, 0x8000_0000, DESC_F_NEXT | DESC_F_WRITE, 3);
        d.q.set_desc(3, hdr + 64, 1, DESC_F_WRITE, 0);
        submit(d, 0, 1)
    });
    attack(count, disk, base, "chain-loop", |d| {
        let hdr = set_header(T_OUT, 0);
        d.q.set_desc(0, hdr, 16, DESC_F_NEXT, 1);
        d.q.set_desc(1, data, 512, DESC_F_NEXT, 0);
        submit(d, 0, 1)
    });
    attack(count, disk, base, "next-out-of-range", |d| {
        let hdr = set_header(T_OUT, 0);
        d.q.set_desc(0, hdr, 16, DESC_F_NEXT, 0xfff0);
        submit(d, 0, 1)
    });
    attack(count, disk, base, "head-out-of-range", |d| {
        submit(d, 0xfff0, 1)
    });
    attack(count, disk, base, "indirect-in-indirect", |d| {
        let t = table();
        // Entry 0 points at the table itself, indirect again; entry 1 at the queue.
        unsafe {
            write_volatile(t, t as u64);
            write_volatile(t.add(1), 32 | (DESC_F_INDIRECT as u64) << 32);
            write_volatile(t.add(2), d.q.desc_addr(0));
            write_volatile(t.add(3), 16 | (DESC_F_INDIRECT as u64) << 32);
        }
        d.q.set_desc(0, t as u64, 32, DESC_F_INDIRECT, 0);
        submit(d, 0, 1)
    });
    attack(count, disk, base, "indirect-table-outside-ram", |d| {
        d.q.set_desc(0, OUTSIDE_RAM, 16 * 4, DESC_F_INDIRECT, 0);
        submit(d, 0, 1)
    });
    attack(count, disk, base, "indirect-table-odd-length", |d| {
        d.q.set_desc(0, table() as u64, 17, DESC_F_INDIRECT, 0);
        submit(d, 0, 1)
    });
    attack(count, disk, base, "avail-index-jumps", |d| {
        let hdr = set_header(T_IN, 0);
        d.q.set_desc(0, hdr, 16, DESC_F_NEXT, 1);
        d.q.set_desc(1, data, 512, DESC_F_NEXT | DESC_F_WRITE, 2);
        d.q.set_desc(2, hdr + 64, 1, DESC_F_WRITE, 0);
        submit(d, 0, QUEUE_SIZE * 50 + 3)
    });
}

/// Queues of forbidden sizes, every register in every state, resets in the middle of I/O,
/// interrupts never acknowledged.
fn device_attacks(disk: usize, base: u64, count: &mut u32, rng: &mut Rng) {
    let data = data_ptr() as u64;
    for size in [15u32, 0, 3, 0xffff, 1 << 15, 32] {
        attack(count, disk, base, "queue-size", |d| {
            // Redo the queue with a size the spec forbids (or above the maximum).
            d.dev.write(0x70, 0);
            let _ = d.dev.init(F_FLUSH);
            let rings = unsafe { &mut *addr_of_mut!(RINGS) };
            d.q = d.dev.setup_queue_sized(0, size, rings);
            d.dev.driver_ok();
            let r = request_with(d, T_IN, data, 512);
            (r.0, size as u8, r.2)
        });
    }
    // Every register, in every state the driver can put the device in.
    for state in 0..5u32 {
        attack(count, disk, base, "random-registers", |d| {
            d.dev.write(0x70, 0);
            match state {
                0 => {}
                1 => d.dev.write(0x70, 1),
                2 => d.dev.write(0x70, 3),
                3 => {
                    let _ = d.dev.init(F_FLUSH);
                }
                _ => {
                    let _ = fresh(base);
                }
            }
            for off in (0..0x200u64).step_by(4) {
                let _ = d.dev.read(off);
                d.dev.write(off, rng.next());
            }
            (false, state as u8, d.dev.status())
        });
    }
    attack(count, disk, base, "resets-during-io", |d| {
        for _ in 0..32 {
            for k in 0..5u16 {
                let hdr = set_header(T_IN, 0);
                d.q.set_desc(3 * k, hdr, 16, DESC_F_NEXT, 3 * k + 1);
                d.q.set_desc(3 * k + 1, data, 512, DESC_F_NEXT | DESC_F_WRITE, 3 * k + 2);
                d.q.set_desc(3 * k + 2, hdr + 64, 1, DESC_F_WRITE, 0);
                d.q.publish(3 * k, 1);
            }
            d.dev.notify(&d.q);
            d.dev.write(0x70, 0);
            match fresh(base) {
                Ok(n) => *d = n,
                Err(e) => result(false, format_args!("resets-during-io: {e}")),
            }
        }
        (false, 0, d.dev.status())
    });
    attack(count, disk, base, "interrupts-never-acknowledged", |d| {
        let mut done = 0u32;
        for _ in 0..200 {
            match d.request(T_IN, 0, &[(data, 512, true)]) {
                Ok(0) => done += 1,
                _ => break,
            }
        }
        if done != 200 {
            result(
                false,
                format_args!("interrupts-never-acknowledged: {done} of 200 completed"),
            );
        }
        (true, 0, d.dev.read(0x60))
    });
}

// ---------------------------------------------------------------------------------------------
// virtio-net: transmit queue 1 fed hostile chains; receive queue 0 given buffers the device must
// not use (outside RAM, in MMIO, too small for the header, not device-writable) while the host
// keeps sending broadcasts. Healthy afterwards: after a reset, a frame goes out and one comes in.

const NET_F_MAC: u64 = 1 << 5;
const NET_HDR: u32 = 12;
const NET_BUF: usize = 2048;

static mut NET_RX_RINGS: Rings = Rings::new();
static mut NET_TX_RINGS: Rings = Rings::new();

#[repr(C, align(4096))]
struct NetBufs([[u8; NET_BUF]; 4]);
static mut NET_BUFS: NetBufs = NetBufs([[0; NET_BUF]; 4]);

fn net_buf(i: usize) -> *mut u8 {
    unsafe { addr_of_mut!(NET_BUFS.0[i]) as *mut u8 }
}

struct NetDev {
    dev: Device,
    rx: crate::virtio::Queue,
    tx: crate::virtio::Queue,
}

fn fresh_net(base: u64) -> Result<NetDev, &'static str> {
    let dev = Device { base };
    dev.write(0x70, 0);
    dev.init(NET_F_MAC)?;
    let (rxr, txr) = unsafe {
        (
            &mut *addr_of_mut!(NET_RX_RINGS),
            &mut *addr_of_mut!(NET_TX_RINGS),
        )
    };
    unsafe {
        write_bytes(
            rxr as *mut Rings as *mut u8,
            0,
            core::mem::size_of::<Rings>(),
        );
        write_bytes(
            txr as *mut Rings as *mut u8,
            0,
            core::mem::size_of::<Rings>(),
        );
    }
    let rx = dev.setup_queue(0, rxr)?;
    let tx = dev.setup_queue(1, txr)?;
    dev.driver_ok();
    Ok(NetDev { dev, rx, tx })
}

/// A broadcast frame of our own (local experimental ethertype) in buffer 3.
fn frame() -> (u64, u32) {
    let b = net_buf(3);
    unsafe {
        write_bytes(b, 0, NET_HDR as usize);
        let eth = b.add(NET_HDR as usize);
        write_bytes(eth, 0xff, 6);
        write_bytes(eth.add(6), 0x02, 6);
        *eth.add(12) = 0x88;
        *eth.add(13) = 0xb5;
        write_bytes(eth.add(14), 0x5a, 46);
    }
    (b as u64, NET_HDR + 60)
}

/// After a reset: a frame sent completes, and a frame from the host arrives.
fn net_healthy(base: u64) -> Result<(), &'static str> {
    let mut n = fresh_net(base)?;
    n.rx.push(&[(net_buf(0) as u64, NET_BUF as u32, DESC_F_WRITE)]);
    n.dev.notify(&n.rx);
    let (addr, len) = frame();
    n.tx.push(&[(addr, len, 0)]);
    n.dev.notify(&n.tx);
    n.tx.wait_used(50_000_000)
        .ok_or("a valid frame was not sent")?;
    n.rx.wait_used(200_000_000)
        .ok_or("no frame from the host arrived")?;
    Ok(())
}

fn net_attack(
    count: &mut u32,
    nic: usize,
    base: u64,
    name: &str,
    f: impl FnOnce(&mut NetDev) -> (bool, u32),
) {
    let outcome = match fresh_net(base) {
        Ok(mut n) => f(&mut n),
        Err(e) => result(false, format_args!("{name} nic{nic}: setup: {e}")),
    };
    if let Err(e) = net_healthy(base) {
        result(false, format_args!("{name} nic{nic}: afterwards {e}"));
    }
    *count += 1;
    let _ = writeln!(
        Serial,
        "probe: attack {name} nic{nic}: completed={} device_status={:#x}; nic healthy",
        outcome.0, outcome.1
    );
}

fn on_nic(nic: usize, base: u64, count: &mut u32) {
    let buf = net_buf(0) as u64;
    for (name, addr, len, flags) in [
        ("tx-from-outside-ram", OUTSIDE_RAM, 1514, 0u16),
        ("tx-from-own-mmio", base, 1514, 0),
        ("tx-len-u32-max", buf, u32::MAX, 0),
        ("tx-shorter-than-header", buf, 4, 0),
        ("tx-len-zero", buf, 0, 0),
        ("tx-device-writable", buf, 1514, DESC_F_WRITE),
        ("tx-indirect-outside-ram", OUTSIDE_RAM, 64, DESC_F_INDIRECT),
    ] {
        net_attack(count, nic, base, name, |n| {
            n.tx.set_desc(0, addr, len, flags, 0);
            n.tx.publish(0, 1);
            n.dev.notify(&n.tx);
            (n.tx.wait_used(SHORT_SPINS).is_some(), n.dev.status())
        });
    }
    net_attack(count, nic, base, "tx-chain-loop", |n| {
        n.tx.set_desc(0, buf, 64, DESC_F_NEXT, 1);
        n.tx.set_desc(1, buf, 64, DESC_F_NEXT, 0);
        n.tx.publish(0, 1);
        n.dev.notify(&n.tx);
        (n.tx.wait_used(SHORT_SPINS).is_some(), n.dev.status())
    });
    net_attack(count, nic, base, "tx-many-segments-overflowing", |n| {
        for i in 0..QUEUE_SIZE {
            n.tx.set_desc(i, buf, 0x2000_0000, DESC_F_NEXT, i + 1);
        }
        n.tx.set_desc(QUEUE_SIZE - 1, buf, 0x2000_0000, 0, 0);
        n.tx.publish(0, 1);
        n.dev.notify(&n.tx);
        (n.tx.wait_used(SHORT_SPINS).is_some(), n.dev.status())
    });
    net_attack(count, nic, base, "tx-avail-index-jumps", |n| {
        let (addr, len) = frame();
        n.tx.set_desc(0, addr, len, 0, 0);
        n.tx.publish(0, QUEUE_SIZE * 40 + 7);
        n.dev.notify(&n.tx);
        (n.tx.wait_used(SHORT_SPINS).is_some(), n.dev.status())
    });
    // Receive buffers the device must refuse, with the host's broadcasts arriving.
    let ro = net_buf(1);
    unsafe { write_bytes(ro, 0xaa, NET_BUF) };
    for (name, addr, len, flags) in [
        (
            "rx-into-outside-ram",
            OUTSIDE_RAM,
            NET_BUF as u32,
            DESC_F_WRITE,
        ),
        ("rx-into-own-mmio", base, NET_BUF as u32, DESC_F_WRITE),
        ("rx-smaller-than-header", buf, 4, DESC_F_WRITE),
        ("rx-len-u32-max", buf, u32::MAX, DESC_F_WRITE),
        ("rx-not-device-writable", ro as u64, NET_BUF as u32, 0),
    ] {
        net_attack(count, nic, base, name, |n| {
            n.rx.set_desc(0, addr, len, flags, 0);
            n.rx.publish(0, 1);
            n.dev.notify(&n.rx);
            let used = n.rx.wait_used(20_000_000).is_some();
            (used, n.dev.status())
        });
    }
    let untouched = unsafe { core::slice::from_raw_parts(ro, NET_BUF) }
        .iter()
        .all(|&b| b == 0xaa);
    if !untouched {
        result(
            false,
            format_args!(
                "nic{nic}: the device wrote into a buffer the driver did not make writable"
            ),
        );
    }
}

/// Ports the probe leaves alone, and why: its console, the i8042 (whose reset command would end
/// the VM — a clean end, but the end of this test) and the shutdown port, which gets every value
/// but the two documented ones.
fn skipped(port: u16) -> bool {
    (0x3f8..=0x3ff).contains(&port) || (0x60..=0x64).contains(&port)
}

fn ports(rng: &mut Rng) -> u32 {
    let mut n = 0;
    for port in 0..=u16::MAX {
        if skipped(port) {
            continue;
        }
        let mut v = rng.next() as u8;
        if port == 0x600 && (v == 0x34 || v == 0x01) {
            v = 0x55;
        }
        unsafe {
            outb(port, v);
            let _ = inb(port);
        }
        n += 1;
    }
    n
}

pub fn run(cmdline: &str) -> ! {
    let mut bases = [0u64; 8];
    let n = crate::virtio::devices(cmdline, &mut bases);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut count = 0;
    let mut disks = 0;
    for (i, &b) in bases[..n].iter().enumerate() {
        if (Device { base: b }).device_id() != 2 {
            continue;
        }
        if let Err(e) = healthy(b) {
            result(false, format_args!("disk{i} before any attack: {e}"));
        }
        on_disk(i, b, &mut count, &mut rng);
        disks += 1;
    }
    let mut nics = 0;
    for (i, &b) in bases[..n].iter().enumerate() {
        if (Device { base: b }).device_id() != 1 {
            continue;
        }
        if let Err(e) = net_healthy(b) {
            result(false, format_args!("nic{i} before any attack: {e}"));
        }
        on_nic(i, b, &mut count);
        nics += 1;
    }
    let ports = ports(&mut rng);
    let _ = writeln!(
        Serial,
        "probe: attack port-io: {ports} ports written and read"
    );
    for (i, &b) in bases[..n].iter().enumerate() {
        if (Device { base: b }).device_id() == 2 {
            if let Err(e) = healthy(b) {
                result(false, format_args!("disk{i} after the port I/O: {e}"));
            }
        }
    }
    result(
        disks > 0,
        format_args!("disks={disks} nics={nics} attacks={count} ports={ports}"),
    )
}
