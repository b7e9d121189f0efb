//! VMGenID as a guest finds it: RSDP (scanned for in 0xe0000..0x100000, as the ACPI
//! specification has a guest without firmware tables do) → XSDT → FADT → DSDT, then the
//! VMGenID device's `ADDR` package: the address of the 16-byte generation ID.
//!
//! `report` prints `PROBE GENID <32 hex digits>` the first time and whenever the ID changed
//! since it last looked; every test calls it at start and with its progress lines, so a
//! restore's new generation shows in whatever test runs.

use core::fmt::Write;
use core::sync::atomic::{AtomicU64, Ordering};

use crate::hw::Serial;

/// The generation ID's address; 0 until found, 1 when there is none.
static ADDR: AtomicU64 = AtomicU64::new(0);
static LAST: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];
static REPORTED: AtomicU64 = AtomicU64::new(0);

/// The largest table the probe will read (the VMM's are a few hundred bytes).
const MAX_TABLE: usize = 64 << 10;

fn read<const N: usize>(addr: u64) -> [u8; N] {
    let mut out = [0u8; N];
    for (i, b) in out.iter_mut().enumerate() {
        *b = unsafe { core::ptr::read_volatile((addr + i as u64) as *const u8) };
    }
    out
}

fn u32_at(addr: u64) -> u32 {
    u32::from_le_bytes(read(addr))
}

fn u64_at(addr: u64) -> u64 {
    u64::from_le_bytes(read(addr))
}

fn checksum_ok(addr: u64, len: usize) -> bool {
    (0..len)
        .map(|i| unsafe { core::ptr::read_volatile((addr + i as u64) as *const u8) })
        .fold(0u8, |a, b| a.wrapping_add(b))
        == 0
}

/// A table's length when `addr` holds one with this signature and a good checksum.
fn table(addr: u64, signature: &[u8; 4]) -> Option<usize> {
    if addr == 0 || addr >= 0x1_0000_0000 || &read::<4>(addr) != signature {
        return None;
    }
    let len = u32_at(addr + 4) as usize;
    (36..=MAX_TABLE).contains(&len).then_some(())?;
    checksum_ok(addr, len).then_some(len)
}

fn find_rsdp() -> Option<u64> {
    (0xe_0000u64..0x10_0000)
        .step_by(16)
        .find(|&a| &read::<8>(a) == b"RSD PTR " && checksum_ok(a, 20))
}

/// One AML integer (ZeroOp, OneOp, or a Byte/Word/DWord/QWord constant) at `at`: its value
/// and its encoded length.
fn aml_integer(at: u64) -> Option<(u64, u64)> {
    match read::<1>(at)[0] {
        0x00 => Some((0, 1)),
        0x01 => Some((1, 1)),
        0x0a => Some((read::<1>(at + 1)[0] as u64, 2)),
        0x0b => Some((u16::from_le_bytes(read(at + 1)) as u64, 3)),
        0x0c => Some((u32_at(at + 1) as u64, 5)),
        0x0e => Some((u64_at(at + 1), 9)),
        _ => None,
    }
}

/// `Name (ADDR, Package (2) {low, high})` in the DSDT: the generation ID's address.
fn addr_in_dsdt(dsdt: u64, len: usize) -> Option<u64> {
    const NEEDLE: [u8; 6] = [0x08, b'A', b'D', b'D', b'R', 0x12];
    let at = (dsdt + 36..dsdt + len as u64 - 12).find(|&a| read::<6>(a) == NEEDLE)? + 6;
    // PkgLength: bits 7-6 of the lead byte count the bytes that follow it.
    let pkg_len_bytes = 1 + (read::<1>(at)[0] >> 6) as u64;
    let mut p = at + pkg_len_bytes;
    if read::<1>(p)[0] != 2 {
        return None;
    }
    p += 1;
    let (low, n) = aml_integer(p)?;
    let (high, _) = aml_integer(p + n)?;
    Some(low | high << 32)
}

/// The FADT, through the RSDP and the XSDT.
fn fadt() -> Option<u64> {
    let rsdp = find_rsdp()?;
    if read::<1>(rsdp + 15)[0] < 2 {
        return None; // ACPI 1.0: no XSDT
    }
    let xsdt = u64_at(rsdp + 24);
    let xlen = table(xsdt, b"XSDT")?;
    (xsdt + 36..xsdt + xlen as u64)
        .step_by(8)
        .map(u64_at)
        .find(|&t| table(t, b"FACP").is_some())
}

/// The I/O port of the FADT's SLEEP_CONTROL_REG (a hardware-reduced machine's way to enter
/// a sleep state, S5 being off), when it is one.
pub fn sleep_control_port() -> Option<u16> {
    let gas = fadt()? + 244;
    // Generic Address Structure: space 1 is system I/O; the address is at +4.
    (read::<1>(gas)[0] == 1).then(|| u64_at(gas + 4) as u16)
}

fn find() -> Option<u64> {
    let fadt = fadt()?;
    let dsdt = match u64_at(fadt + 140) {
        0 => u32_at(fadt + 40) as u64,
        x => x,
    };
    let dlen = table(dsdt, b"DSDT")?;
    addr_in_dsdt(dsdt, dlen)
}

/// Prints the generation ID when it is new to the probe (see the module's comment).
pub fn report() {
    let addr = match ADDR.load(Ordering::Relaxed) {
        0 => {
            let a = find().unwrap_or(1);
            ADDR.store(a, Ordering::Relaxed);
            a
        }
        a => a,
    };
    if addr == 1 {
        if REPORTED.swap(1, Ordering::Relaxed) == 0 {
            let _ = writeln!(Serial, "probe: no VMGenID device in the ACPI tables");
        }
        return;
    }
    let id = [u64_at(addr), u64_at(addr + 8)];
    let last = [
        LAST[0].load(Ordering::Relaxed),
        LAST[1].load(Ordering::Relaxed),
    ];
    if REPORTED.swap(1, Ordering::Relaxed) == 1 && id == last {
        return;
    }
    LAST[0].store(id[0], Ordering::Relaxed);
    LAST[1].store(id[1], Ordering::Relaxed);
    let _ = write!(Serial, "PROBE GENID ");
    for b in id[0].to_le_bytes().iter().chain(&id[1].to_le_bytes()) {
        let _ = write!(Serial, "{b:02x}");
    }
    let _ = writeln!(Serial);
}
