//! `probe.test=net`: send frames of several sizes, then echo every `PING` frame received back
//! to its sender as `PONG`, until a `DONE` frame arrives.

use core::fmt::Write;

use crate::virtio::{Device, Queue, Rings, DESC_F_WRITE, QUEUE_SIZE};
use crate::{result, Line};

const F_MAC: u64 = 1 << 5;
const F_MRG_RXBUF: u64 = 1 << 15;
const HDR: usize = 12;
pub const ETHERTYPE: u16 = 0x88b5; // IEEE local experimental
const RX_BUFS: usize = 8;
const BUF: usize = 2048;
pub const SIZES: [usize; 3] = [60, 300, 1514];
/// Bounded wait for the host (each spin is a few instructions, no VM exit).
const WAIT_SPINS: u32 = 200_000_000;

static mut RX_RINGS: Rings = Rings::new();
static mut TX_RINGS: Rings = Rings::new();

#[repr(C, align(4096))]
struct Bufs([[u8; BUF]; RX_BUFS]);
static mut RX: Bufs = Bufs([[0; BUF]; RX_BUFS]);
static mut TX: [u8; BUF] = [0; BUF];

pub struct Nic {
    dev: Device,
    rx: Queue,
    tx: Queue,
    /// Which RX buffer each descriptor head refers to.
    head_buf: [u8; QUEUE_SIZE as usize],
}

fn rx_buf(i: usize) -> *mut u8 {
    unsafe { core::ptr::addr_of_mut!(RX.0[i]) as *mut u8 }
}

fn tx_buf() -> *mut u8 {
    core::ptr::addr_of_mut!(TX) as *mut u8
}

impl Nic {
    fn post_rx(&mut self, i: usize) {
        let head = self
            .rx
            .push(&[(rx_buf(i) as u64, BUF as u32, DESC_F_WRITE)]);
        self.head_buf[head as usize] = i as u8;
    }

    /// Waits (at most `spins`) for a received frame, copies it (Ethernet, without the virtio
    /// header) into `out`, gives the buffer back to the device and returns the length.
    pub fn recv(&mut self, out: &mut [u8], spins: u32) -> Option<usize> {
        let (head, len) = self.rx.wait_used(spins)?;
        let i = self.head_buf[head as usize % QUEUE_SIZE as usize] as usize;
        let b = unsafe { core::slice::from_raw_parts(rx_buf(i), BUF) };
        let len = (len as usize).clamp(HDR, BUF);
        let n = (len - HDR).min(out.len());
        out[..n].copy_from_slice(&b[HDR..HDR + n]);
        self.post_rx(i);
        self.dev.notify(&self.rx);
        Some(n)
    }

    /// Sends `frame` (Ethernet, without the virtio header).
    pub fn send(&mut self, frame: &[u8]) -> Result<(), &'static str> {
        let b = tx_buf();
        unsafe {
            core::ptr::write_bytes(b, 0, HDR);
            core::ptr::copy_nonoverlapping(frame.as_ptr(), b.add(HDR), frame.len());
        }
        self.tx.push(&[(b as u64, (HDR + frame.len()) as u32, 0)]);
        self.dev.notify(&self.tx);
        self.tx
            .wait_used(WAIT_SPINS)
            .ok_or("transmit not completed")?;
        Ok(())
    }
}

fn build_frame(buf: &mut [u8], dst: [u8; 6], src: [u8; 6], payload: &[u8], len: usize) -> usize {
    buf[0..6].copy_from_slice(&dst);
    buf[6..12].copy_from_slice(&src);
    buf[12..14].copy_from_slice(&ETHERTYPE.to_be_bytes());
    let body = &mut buf[14..len];
    for (i, b) in body.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(7);
    }
    let n = payload.len().min(body.len());
    body[..n].copy_from_slice(&payload[..n]);
    len
}

/// The first virtio-net device of the command line, initialised, with receive buffers
/// posted; and its MAC and link state.
pub fn open(cmdline: &str) -> Result<(Nic, [u8; 6], u8), &'static str> {
    let mut bases = [0u64; 8];
    let n = crate::virtio::devices(cmdline, &mut bases);
    let &base = bases[..n]
        .iter()
        .find(|&&b| (Device { base: b }).device_id() == 1)
        .ok_or("no virtio-net device")?;
    let dev = Device { base };
    let features = dev.init(F_MAC | F_MRG_RXBUF)?;
    if features & F_MAC == 0 {
        return Err("device offers no MAC");
    }
    let rx = dev.setup_queue(0, unsafe { &mut *core::ptr::addr_of_mut!(RX_RINGS) })?;
    let tx = dev.setup_queue(1, unsafe { &mut *core::ptr::addr_of_mut!(TX_RINGS) })?;
    dev.driver_ok();
    let mut mac = [0u8; 6];
    for (i, m) in mac.iter_mut().enumerate() {
        *m = dev.config_u8(i as u64);
    }
    let link = dev.config_u8(6) & 1;
    let mut nic = Nic {
        dev,
        rx,
        tx,
        head_buf: [0; QUEUE_SIZE as usize],
    };
    for i in 0..RX_BUFS {
        nic.post_rx(i);
    }
    nic.dev.notify(&nic.rx);
    Ok((nic, mac, link))
}

pub fn run(cmdline: &str) -> ! {
    match open(cmdline).and_then(|(nic, mac, link)| run_on(nic, mac, link)) {
        Ok(line) => result(true, format_args!("{}", line.as_str())),
        Err(e) => result(false, format_args!("{e}")),
    }
}

/// virtio-mmio's InterruptStatus and InterruptACK registers, its config change bit and its
/// ConfigGeneration register.
const INTERRUPT_STATUS: u64 = 0x060;
const INTERRUPT_ACK: u64 = 0x064;
const INT_CONFIG_CHANGE: u32 = 2;
const CONFIG_GENERATION: u64 = 0x0fc;

/// After a config change interrupt (a restored clone given a MAC of its own), the MAC read
/// again — consistently, as the generation says — and announced as `PROBE MAC <mac>`.
fn follow_config(dev: &Device, mac: &mut [u8; 6]) {
    if dev.read(INTERRUPT_STATUS) & INT_CONFIG_CHANGE == 0 {
        return;
    }
    dev.write(INTERRUPT_ACK, INT_CONFIG_CHANGE);
    loop {
        let generation = dev.read(CONFIG_GENERATION);
        for (i, m) in mac.iter_mut().enumerate() {
            *m = dev.config_u8(i as u64);
        }
        if dev.read(CONFIG_GENERATION) == generation {
            break;
        }
    }
    let _ = writeln!(
        crate::hw::Serial,
        "PROBE MAC {:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
        mac[0],
        mac[1],
        mac[2],
        mac[3],
        mac[4],
        mac[5]
    );
}

fn run_on(mut nic: Nic, mut mac: [u8; 6], link: u8) -> Result<Line, &'static str> {
    let mut frame = [0u8; 1514];
    for (i, &size) in SIZES.iter().enumerate() {
        let mut tag = Line::new();
        let _ = write!(tag, "MVPROBE frame {i} size {size}");
        let len = build_frame(&mut frame, [0xff; 6], mac, tag.as_str().as_bytes(), size);
        nic.send(&frame[..len])?;
    }

    let mut echoed = 0u32;
    loop {
        let (head, len) = nic
            .rx
            .wait_used(WAIT_SPINS)
            .ok_or("no DONE frame from the host")?;
        follow_config(&nic.dev, &mut mac);
        let i = nic.head_buf[head as usize % QUEUE_SIZE as usize] as usize;
        let b = unsafe { core::slice::from_raw_parts(rx_buf(i), BUF) };
        let len = (len as usize).min(BUF);
        let num_buffers = u16::from_le_bytes([b[10], b[11]]);
        if num_buffers != 1 {
            return Err("num_buffers is not 1 for a frame that fits one buffer");
        }
        let eth = &b[HDR..len];
        let mut done = false;
        if eth.len() >= 18 && u16::from_be_bytes([eth[12], eth[13]]) == ETHERTYPE {
            let payload = &eth[14..];
            if payload.starts_with(b"PING") {
                let flen = eth.len();
                frame[..flen].copy_from_slice(eth);
                let src: [u8; 6] = eth[6..12].try_into().unwrap();
                frame[0..6].copy_from_slice(&src);
                frame[6..12].copy_from_slice(&mac);
                frame[14..18].copy_from_slice(b"PONG");
                nic.post_rx(i);
                nic.dev.notify(&nic.rx);
                nic.send(&frame[..flen])?;
                echoed += 1;
                continue;
            }
            done = payload.starts_with(b"DONE");
        }
        nic.post_rx(i);
        nic.dev.notify(&nic.rx);
        if done {
            break;
        }
    }
    let mut out = Line::new();
    let _ = write!(
        out,
        "mac={:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x} link={link} sent={} echoed={echoed}",
        mac[0],
        mac[1],
        mac[2],
        mac[3],
        mac[4],
        mac[5],
        SIZES.len()
    );
    Ok(out)
}

/// `probe.test=netloop`: for a backend that sends every frame back (DPDK testpmd in `io` or
/// `macswap` mode): sends frames of each size to a peer address and checks each comes back
/// with its payload intact, reporting whether the addresses were swapped.
/// `probe.test=netloop [probe.rounds=N]`: the frames go out and must come back, N times
/// (default 1); between rounds the probe prints `PROBE NETLOOP ROUND <k> OK` and waits for a
/// byte on the serial console, so the host can change the path (restart the switch) before
/// the next round.
pub fn loopback(cmdline: &str) -> ! {
    let rounds: u32 = cmdline
        .split(' ')
        .find_map(|w| w.strip_prefix("probe.rounds="))
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let looped = open(cmdline).and_then(|(mut nic, mac, link)| {
        for k in 1..rounds {
            loop_on(&mut nic, mac, link)?;
            let _ = writeln!(crate::hw::Serial, "PROBE NETLOOP ROUND {k} OK");
            while crate::hw::serial_read().is_none() {
                core::hint::spin_loop();
            }
        }
        loop_on(&mut nic, mac, link)
    });
    match looped {
        Ok(line) => result(true, format_args!("{}", line.as_str())),
        Err(e) => result(false, format_args!("{e}")),
    }
}

fn loop_on(nic: &mut Nic, mac: [u8; 6], link: u8) -> Result<Line, &'static str> {
    const PEER: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
    let mut frame = [0u8; 1514];
    let mut back = [0u8; 1514];
    let mut swapped = 0;
    for (i, &size) in SIZES.iter().enumerate() {
        let mut tag = Line::new();
        let _ = write!(tag, "MVPROBE loop {i} size {size}");
        let len = build_frame(&mut frame, PEER, mac, tag.as_str().as_bytes(), size);
        nic.send(&frame[..len])?;
        let n = nic
            .recv(&mut back, WAIT_SPINS)
            .ok_or("the frame did not come back")?;
        if n != len || back[12..len] != frame[12..len] {
            return Err("the frame came back changed");
        }
        if back[0..6] == mac && back[6..12] == PEER {
            swapped += 1;
        } else if back[0..12] != frame[0..12] {
            return Err("the frame came back with other addresses");
        }
    }
    let mut out = Line::new();
    let _ = write!(
        out,
        "mac={:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x} link={link} looped={} swapped={swapped}",
        mac[0],
        mac[1],
        mac[2],
        mac[3],
        mac[4],
        mac[5],
        SIZES.len()
    );
    Ok(out)
}
