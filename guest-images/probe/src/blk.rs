//! `probe.test=blk`: on every virtio-blk disk, write a known pattern to sectors spread across
//! the disk, flush, read back and verify; check a read-only disk rejects writes; read the serial.

use core::fmt::Write;

use crate::virtio::{Device, Queue, Rings, DESC_F_WRITE};
use crate::{result, Line};

pub(crate) const T_IN: u32 = 0;
pub(crate) const T_OUT: u32 = 1;
const T_FLUSH: u32 = 4;
const T_GET_ID: u32 = 8;
const F_RO: u64 = 1 << 5;
pub(crate) const F_FLUSH: u64 = 1 << 9;
const SAMPLES: u64 = 16;
const SPINS: u32 = 5_000_000;

static mut RINGS: [Rings; 8] = [const { Rings::new() }; 8];

#[repr(C, align(4096))]
struct Page([u8; 4096]);
static mut HDR: Page = Page([0; 4096]);
static mut DATA: Page = Page([0; 4096]);
static mut DATA2: Page = Page([0; 4096]);

/// The bytes the probe writes to `sector`: a readable tag the host test checks in the image file,
/// then a sector-dependent pattern.
pub fn pattern(sector: u64, buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (sector as u8).wrapping_mul(31).wrapping_add(i as u8);
    }
    let tag = b"MVPROBE sector ";
    buf[..tag.len()].copy_from_slice(tag);
    let mut n = sector;
    let mut digits = [b'0'; 20];
    let mut k = 20;
    loop {
        k -= 1;
        digits[k] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    buf[tag.len()..tag.len() + 20 - k].copy_from_slice(&digits[k..]);
}

pub(crate) struct Disk {
    pub dev: Device,
    pub q: Queue,
}

impl Disk {
    /// The request header's address (status byte at +64).
    pub(crate) fn header() -> u64 {
        unsafe { core::ptr::addr_of_mut!(HDR.0) as u64 }
    }

    /// Submits one request and returns its status byte. The header and status live in HDR.
    pub(crate) fn request(
        &mut self,
        kind: u32,
        sector: u64,
        data: &[(u64, u32, bool)],
    ) -> Result<u8, &'static str> {
        let hdr = unsafe { core::ptr::addr_of_mut!(HDR.0) as *mut u8 };
        unsafe {
            core::ptr::write_volatile(hdr as *mut u32, kind);
            core::ptr::write_volatile(hdr.add(4) as *mut u32, 0);
            core::ptr::write_volatile(hdr.add(8) as *mut u64, sector);
            core::ptr::write_volatile(hdr.add(64), 0xff);
        }
        let mut chain = [(0u64, 0u32, 0u16); 4];
        chain[0] = (hdr as u64, 16, 0);
        for (i, &(a, l, w)) in data.iter().enumerate() {
            chain[1 + i] = (a, l, if w { DESC_F_WRITE } else { 0 });
        }
        chain[1 + data.len()] = (hdr as u64 + 64, 1, DESC_F_WRITE);
        self.q.push(&chain[..2 + data.len()]);
        self.dev.notify(&self.q);
        let mut answered = false;
        for _ in 0..SPINS / 1024 {
            if self.q.wait_used(1024).is_some() {
                answered = true;
                break;
            }
            // A device whose backend died asks for a reset: no answer will come.
            if self.dev.status() & 64 != 0 {
                return Err("device needs reset");
            }
        }
        if !answered {
            return Err("request timed out");
        }
        Ok(unsafe { core::ptr::read_volatile(hdr.add(64)) })
    }
}

pub(crate) fn data_ptr() -> *mut u8 {
    unsafe { core::ptr::addr_of_mut!(DATA.0) as *mut u8 }
}

fn data2_ptr() -> *mut u8 {
    unsafe { core::ptr::addr_of_mut!(DATA2.0) as *mut u8 }
}

fn test_disk(i: usize, base: u64, out: &mut Line) -> Result<(), &'static str> {
    let dev = Device { base };
    let features = dev.init(F_RO | F_FLUSH)?;
    let rings = unsafe { &mut (*core::ptr::addr_of_mut!(RINGS))[i] };
    let q = dev.setup_queue(0, rings)?;
    dev.driver_ok();
    let sectors = dev.config_u64(0);
    let mut d = Disk { dev, q };
    let ro = features & F_RO != 0;

    // Serial through GET_ID.
    let st = d.request(T_GET_ID, 0, &[(data_ptr() as u64, 20, true)])?;
    if st != 0 {
        return Err("GET_ID failed");
    }
    let id = unsafe { core::slice::from_raw_parts(data_ptr(), 20) };
    let id_len = id.iter().position(|&b| b == 0).unwrap_or(20);
    let serial = core::str::from_utf8(&id[..id_len]).unwrap_or("?");
    let _ = write!(
        out,
        " d{i}.serial={serial} d{i}.sectors={sectors} d{i}.mode={}",
        if ro { "ro" } else { "rw" }
    );
    if sectors < 2 {
        return Err("disk too small");
    }

    let sample = |k: u64| k * (sectors - 2) / (SAMPLES - 1);
    if ro {
        let st = d.request(T_OUT, 0, &[(data_ptr() as u64, 512, false)])?;
        if st == 0 {
            return Err("write to a read-only disk succeeded");
        }
        let _ = write!(out, " d{i}.write_rejected=1");
        return Ok(());
    }
    // Writes: one sector each, and the last one as two segments across two sectors.
    for k in 0..SAMPLES {
        let s = sample(k);
        let buf = unsafe { core::slice::from_raw_parts_mut(data_ptr(), 512) };
        pattern(s, buf);
        let st = if k == SAMPLES - 1 {
            let buf2 = unsafe { core::slice::from_raw_parts_mut(data2_ptr(), 512) };
            pattern(s + 1, buf2);
            d.request(
                T_OUT,
                s,
                &[
                    (data_ptr() as u64, 512, false),
                    (data2_ptr() as u64, 512, false),
                ],
            )?
        } else {
            d.request(T_OUT, s, &[(data_ptr() as u64, 512, false)])?
        };
        if st != 0 {
            return Err("write failed");
        }
    }
    if d.request(T_FLUSH, 0, &[])? != 0 {
        return Err("flush failed");
    }
    let mut verified = 0;
    let mut expect = [0u8; 512];
    for k in 0..SAMPLES {
        let s = sample(k);
        unsafe { core::ptr::write_bytes(data_ptr(), 0, 1024) };
        if d.request(T_IN, s, &[(data_ptr() as u64, 1024, true)])? != 0 {
            return Err("read failed");
        }
        let got = unsafe { core::slice::from_raw_parts(data_ptr(), 512) };
        pattern(s, &mut expect);
        if got != expect {
            return Err("read back differs from what was written");
        }
        verified += 1;
    }
    // Reading past the end must fail, not return stale data.
    if d.request(T_IN, sectors, &[(data_ptr() as u64, 512, true)])? == 0 {
        return Err("read beyond the disk succeeded");
    }
    let _ = write!(out, " d{i}.verified={verified}");
    Ok(())
}

pub fn run(cmdline: &str) -> ! {
    let mut bases = [0u64; 8];
    let n = crate::virtio::devices(cmdline, &mut bases);
    let mut disks = 0;
    let mut out = Line::new();
    for (i, &b) in bases[..n].iter().enumerate() {
        if (Device { base: b }).device_id() != 2 {
            continue;
        }
        disks += 1;
        if let Err(e) = test_disk(i, b, &mut out) {
            result(false, format_args!("{e} disks={disks}{}", out.as_str()));
        }
    }
    result(disks > 0, format_args!("disks={disks}{}", out.as_str()))
}

/// `probe.test=blkstream`: writes `probe.writes` 4 KiB requests (default 256) to consecutive
/// sectors of the first read-write disk, flushing every 16, printing progress every 32, then
/// reads everything back and verifies it. A workload that is mid-I/O whenever the host
/// snapshots or migrates the VM; the host then checks the image holds exactly what was written.
pub fn stream(boot: &crate::BootInfo) -> ! {
    let writes: u64 = boot
        .param("probe.writes")
        .and_then(|p| p.parse().ok())
        .unwrap_or(256);
    let mut bases = [0u64; 8];
    let n = crate::virtio::devices(boot.cmdline, &mut bases);
    let Some((i, &base)) = bases[..n]
        .iter()
        .enumerate()
        .find(|(_, &b)| (Device { base: b }).device_id() == 2)
    else {
        result(false, format_args!("no virtio-blk device"))
    };
    match stream_on(i, base, writes) {
        Ok(()) => result(
            true,
            format_args!("written={writes} sectors={}", writes * 8),
        ),
        Err(e) => result(false, format_args!("{e}")),
    }
}

fn stream_on(i: usize, base: u64, writes: u64) -> Result<(), &'static str> {
    use crate::hw::Serial;
    let dev = Device { base };
    dev.init(F_FLUSH)?;
    let rings = unsafe { &mut (*core::ptr::addr_of_mut!(RINGS))[i] };
    let q = dev.setup_queue(0, rings)?;
    dev.driver_ok();
    if dev.config_u64(0) < writes * 8 {
        return Err("disk too small for probe.writes");
    }
    let mut d = Disk { dev, q };
    let page = unsafe { core::slice::from_raw_parts_mut(data_ptr(), 4096) };
    for j in 0..writes {
        for s in 0..8 {
            pattern(
                j * 8 + s,
                &mut page[s as usize * 512..(s as usize + 1) * 512],
            );
        }
        if d.request(T_OUT, j * 8, &[(data_ptr() as u64, 4096, false)])? != 0 {
            return Err("write failed");
        }
        if (j + 1) % 16 == 0 && d.request(T_FLUSH, 0, &[])? != 0 {
            return Err("flush failed");
        }
        if (j + 1) % 32 == 0 {
            crate::genid::report();
            let _ = writeln!(Serial, "PROBE PROGRESS blkstream writes={}", j + 1);
        }
    }
    if d.request(T_FLUSH, 0, &[])? != 0 {
        return Err("flush failed");
    }
    let mut expect = [0u8; 512];
    for j in 0..writes {
        unsafe { core::ptr::write_bytes(data_ptr(), 0, 4096) };
        if d.request(T_IN, j * 8, &[(data_ptr() as u64, 4096, true)])? != 0 {
            return Err("read failed");
        }
        for s in 0..8 {
            pattern(j * 8 + s, &mut expect);
            if page[s as usize * 512..(s as usize + 1) * 512] != expect {
                return Err("read back differs from what was written");
            }
        }
    }
    Ok(())
}

const T_DISCARD: u32 = 11;
const T_WRITE_ZEROES: u32 = 13;
const F_DISCARD: u64 = 1 << 13;
const F_WRITE_ZEROES: u64 = 1 << 14;

/// Writes the pattern of `sector` there.
fn write_pattern(d: &mut Disk, sector: u64) -> Result<(), &'static str> {
    let buf = unsafe { core::slice::from_raw_parts_mut(data_ptr(), 512) };
    pattern(sector, buf);
    match d.request(T_OUT, sector, &[(data_ptr() as u64, 512, false)])? {
        0 => Ok(()),
        _ => Err("write failed"),
    }
}

/// Reads `sector`: Some(true) if it holds its pattern, Some(false) if all zeroes, None else.
fn read_state(d: &mut Disk, sector: u64) -> Result<Option<bool>, &'static str> {
    unsafe { core::ptr::write_bytes(data_ptr(), 0xee, 512) };
    if d.request(T_IN, sector, &[(data_ptr() as u64, 512, true)])? != 0 {
        return Err("read failed");
    }
    let got = unsafe { core::slice::from_raw_parts(data_ptr(), 512) };
    let mut expect = [0u8; 512];
    pattern(sector, &mut expect);
    Ok(if got == expect {
        Some(true)
    } else if got.iter().all(|&b| b == 0) {
        Some(false)
    } else {
        None
    })
}

/// A discard / write-zeroes request whose segments (sector, 1 sector each) are `sectors`,
/// packed in DATA2; returns its status byte.
fn zeroing(
    d: &mut Disk,
    kind: u32,
    sectors: &mut dyn Iterator<Item = u64>,
) -> Result<u8, &'static str> {
    let seg = data2_ptr();
    let mut n = 0usize;
    for s in sectors {
        if (n + 1) * 16 > 4096 {
            return Err("too many segments for one page");
        }
        unsafe {
            core::ptr::write_volatile(seg.add(n * 16) as *mut u64, s);
            core::ptr::write_volatile(seg.add(n * 16 + 8) as *mut u32, 1);
            core::ptr::write_volatile(seg.add(n * 16 + 12) as *mut u32, 0);
        }
        n += 1;
    }
    d.request(kind, 0, &[(seg as u64, (n * 16) as u32, false)])
}

/// `probe.test=discard`: on the first virtio-blk disk, a discard and a write-zeroes of one
/// segment each (what the device advertises) succeed and zero their sector; a discard of two
/// segments and a write-zeroes of 126 are refused whole (their sectors keep their data); and
/// the disk still reads and writes afterwards.
pub fn discard(cmdline: &str) -> ! {
    let mut bases = [0u64; 8];
    let n = crate::virtio::devices(cmdline, &mut bases);
    let Some(i) = (0..n).find(|&i| (Device { base: bases[i] }).device_id() == 2) else {
        result(false, format_args!("no virtio-blk disk"))
    };
    match discard_on(i, bases[i]) {
        Ok(line) => result(true, format_args!("{}", line.as_str())),
        Err(e) => result(false, format_args!("{e}")),
    }
}

fn discard_on(i: usize, base: u64) -> Result<Line, &'static str> {
    let dev = Device { base };
    let features = dev.init(F_DISCARD | F_WRITE_ZEROES)?;
    if features & (F_DISCARD | F_WRITE_ZEROES) != F_DISCARD | F_WRITE_ZEROES {
        return Err("the disk offers no discard / write-zeroes");
    }
    let rings = unsafe { &mut (*core::ptr::addr_of_mut!(RINGS))[i] };
    let q = dev.setup_queue(0, rings)?;
    dev.driver_ok();
    let max_discard_seg = dev.read(0x100 + 40);
    let mut d = Disk { dev, q };
    for s in 8..40 {
        write_pattern(&mut d, s)?;
    }
    let one = zeroing(&mut d, T_DISCARD, &mut core::iter::once(8))?;
    let zero = zeroing(&mut d, T_WRITE_ZEROES, &mut core::iter::once(9))?;
    let two = zeroing(&mut d, T_DISCARD, &mut [20u64, 21].into_iter())?;
    let many = zeroing(
        &mut d,
        T_WRITE_ZEROES,
        &mut (0..126u64).map(|k| 22 + k % 16),
    )?;
    let zeroed = [read_state(&mut d, 8)?, read_state(&mut d, 9)?] == [Some(false); 2];
    let kept = (20..38).try_fold(true, |ok, s| {
        Ok::<_, &'static str>(ok && read_state(&mut d, s)? == Some(true))
    })?;
    write_pattern(&mut d, 40)?;
    let after = read_state(&mut d, 40)? == Some(true);
    let mut out = Line::new();
    let _ = write!(
        out,
        "max_seg={max_discard_seg} one={one} zero={zero} two={two} many={many} zeroed={} kept={} after={}",
        zeroed as u8, kept as u8, after as u8
    );
    Ok(out)
}
