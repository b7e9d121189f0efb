//! Intel MultiProcessor Specification 1.4 tables, which is how a guest without ACPI (Linux with
//! `acpi=off` or no ACPI tables, and the probe guest) discovers its processors and the IOAPIC.
//!
//! Written by hand: no maintained crate builds MP tables (Firecracker and crosvm keep their own
//! in-tree copies), and the format is a few fixed-size records with checksums.

use vm_memory::{Bytes, GuestAddress, GuestMemory};

use crate::layout::{APIC_START, EBDA_START, IOAPIC_START};

const MPF_SIGNATURE: &[u8; 4] = b"_MP_";
const MPC_SIGNATURE: &[u8; 4] = b"PCMP";
const MP_SPEC_REV: u8 = 4;
const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
/// Pins of the IOAPIC KVM emulates.
pub const IOAPIC_PINS: u8 = 24;
const CPU_ENABLED: u8 = 1;
const CPU_BOOTPROCESSOR: u8 = 2;
const ENTRY_PROCESSOR: u8 = 0;
const ENTRY_BUS: u8 = 1;
const ENTRY_IOAPIC: u8 = 2;
const ENTRY_IOINTSRC: u8 = 3;
const ENTRY_LINTSRC: u8 = 4;
const IRQ_TYPE_INT: u8 = 0;
const IRQ_TYPE_NMI: u8 = 1;
const IRQ_TYPE_EXTINT: u8 = 3;
/// CPU signature (family 6) and feature flags (FPU, APIC) as reported in processor entries.
const CPU_SIGNATURE: u32 = 0x600;
const CPU_FEATURES: u32 = 0x201;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MpTableError {
    #[error("MP table: {0} vCPUs do not fit (APIC IDs are 8-bit, at most 254)")]
    TooManyCpus(u8),
    #[error("MP table does not fit in guest memory")]
    NotEnoughMemory,
}

fn checksum(bytes: &[u8]) -> u8 {
    bytes
        .iter()
        .fold(0u8, |a, b| a.wrapping_add(*b))
        .wrapping_neg()
}

/// The IOAPIC's ID comes right after the processors'.
pub fn ioapic_id(num_cpus: u8) -> u8 {
    num_cpus + 1
}

/// Builds the floating pointer and configuration table as they sit at `EBDA_START`.
pub fn build(num_cpus: u8) -> Result<Vec<u8>, MpTableError> {
    if num_cpus == 0 || num_cpus > 254 {
        return Err(MpTableError::TooManyCpus(num_cpus));
    }
    let table_addr = EBDA_START as u32 + 16;
    let mut t: Vec<u8> = Vec::new();
    // Header, length and checksum patched below.
    t.extend_from_slice(MPC_SIGNATURE);
    t.extend_from_slice(&0u16.to_le_bytes());
    t.push(MP_SPEC_REV);
    t.push(0);
    t.extend_from_slice(b"MICROVRT");
    t.extend_from_slice(b"000000000000");
    t.extend_from_slice(&0u32.to_le_bytes()); // OEM table pointer
    t.extend_from_slice(&0u16.to_le_bytes()); // OEM table size
    let count_at = t.len();
    t.extend_from_slice(&0u16.to_le_bytes()); // entry count
    t.extend_from_slice(&(APIC_START as u32).to_le_bytes());
    t.extend_from_slice(&0u32.to_le_bytes()); // extended table length, checksum, reserved
    let mut entries = 0u16;
    for cpu in 0..num_cpus {
        t.push(ENTRY_PROCESSOR);
        t.push(cpu);
        t.push(APIC_VERSION);
        t.push(CPU_ENABLED | if cpu == 0 { CPU_BOOTPROCESSOR } else { 0 });
        t.extend_from_slice(&CPU_SIGNATURE.to_le_bytes());
        t.extend_from_slice(&CPU_FEATURES.to_le_bytes());
        t.extend_from_slice(&[0; 8]);
        entries += 1;
    }
    t.extend_from_slice(&[ENTRY_BUS, 0, b'I', b'S', b'A', b' ', b' ', b' ']);
    entries += 1;
    let ioapic = ioapic_id(num_cpus);
    t.extend_from_slice(&[ENTRY_IOAPIC, ioapic, IOAPIC_VERSION, 1]);
    t.extend_from_slice(&(IOAPIC_START as u32).to_le_bytes());
    entries += 1;
    // ISA IRQ n is IOAPIC pin n; pin 0 is the PIC's ExtINT.
    for irq in 0..IOAPIC_PINS {
        let kind = if irq == 0 {
            IRQ_TYPE_EXTINT
        } else {
            IRQ_TYPE_INT
        };
        t.extend_from_slice(&[ENTRY_IOINTSRC, kind, 0, 0, 0, irq, ioapic, irq]);
        entries += 1;
    }
    // LINT0: ExtINT on every LAPIC, LINT1: NMI on every LAPIC (destination 0xff).
    t.extend_from_slice(&[ENTRY_LINTSRC, IRQ_TYPE_EXTINT, 0, 0, 0, 0, 0xff, 0]);
    t.extend_from_slice(&[ENTRY_LINTSRC, IRQ_TYPE_NMI, 0, 0, 0, 0, 0xff, 1]);
    entries += 2;
    let len = t.len() as u16;
    t[4..6].copy_from_slice(&len.to_le_bytes());
    t[count_at..count_at + 2].copy_from_slice(&entries.to_le_bytes());
    t[7] = checksum(&t);

    let mut out = Vec::with_capacity(16 + t.len());
    out.extend_from_slice(MPF_SIGNATURE);
    out.extend_from_slice(&table_addr.to_le_bytes());
    out.push(1); // length in 16-byte units
    out.push(MP_SPEC_REV);
    out.push(0); // checksum
    out.extend_from_slice(&[0; 5]); // features: 0 = configuration table present
    out[10] = checksum(&out[..16]);
    out.extend_from_slice(&t);
    Ok(out)
}

pub fn write<M: GuestMemory>(mem: &M, num_cpus: u8) -> Result<(), MpTableError> {
    let bytes = build(num_cpus)?;
    mem.write_slice(&bytes, GuestAddress(EBDA_START))
        .map_err(|_| MpTableError::NotEnoughMemory)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |a, x| a.wrapping_add(*x))
    }

    #[test]
    fn checksums_and_counts() {
        for n in [1u8, 2, 8, 254] {
            let b = build(n).unwrap();
            assert_eq!(&b[0..4], b"_MP_");
            assert_eq!(sum(&b[..16]), 0);
            let phys = u32::from_le_bytes(b[4..8].try_into().unwrap());
            assert_eq!(phys as u64, EBDA_START + 16);
            let t = &b[16..];
            assert_eq!(&t[0..4], b"PCMP");
            let len = u16::from_le_bytes([t[4], t[5]]) as usize;
            assert_eq!(len, t.len());
            assert_eq!(sum(t), 0);
            let count = u16::from_le_bytes([t[34], t[35]]) as usize;
            // Walk the entries: processors are 20 bytes, the rest 8.
            let (mut off, mut cpus, mut bsp) = (44usize, 0u8, 0);
            for _ in 0..count {
                if t[off] == ENTRY_PROCESSOR {
                    assert_eq!(t[off + 1], cpus, "APIC IDs are 0..n");
                    if t[off + 3] & CPU_BOOTPROCESSOR != 0 {
                        bsp += 1;
                    }
                    cpus += 1;
                    off += 20;
                } else {
                    off += 8;
                }
            }
            assert_eq!(off, len);
            assert_eq!((cpus, bsp), (n, 1));
        }
    }

    #[test]
    fn rejects_bad_cpu_counts() {
        assert_eq!(build(0), Err(MpTableError::TooManyCpus(0)));
        assert_eq!(build(255), Err(MpTableError::TooManyCpus(255)));
    }
}
