//! Guest physical memory layout.
//!
//! ```text
//! 0x0000_0000  real-mode IVT/BDA (RAM)
//! 0x0000_0500  boot GDT, then IDT
//! 0x0000_6000  PVH start_info, module list, memory map
//! 0x0000_7000  Linux zero page (boot_params)
//! 0x0000_8ff0  initial boot stack (grows down)
//! 0x0000_9000  identity page tables (PML4, PDPT, PD: first 1 GiB as 2 MiB pages)
//! 0x0002_0000  kernel command line
//! 0x0009_fc00  EBDA: MP floating pointer + MP table (reserved in e820)
//! 0x000a_0000  legacy VGA/ROM hole (reserved)
//! 0x000e_0000  ACPI RSDP, then XSDT, FADT, MADT, DSDT from 0xe_1000 (reserved)
//! 0x000e_f000  VMGenID: the 16-byte generation ID (reserved)
//! 0x0010_0000  kernel (HIMEM_START), then RAM up to the MMIO gap
//! 0xc000_0000  MMIO gap: virtio-mmio devices, IOAPIC, LAPIC, TSS/identity map (no RAM)
//! 0x1_0000_0000 RAM above 4 GiB for guests larger than the low region
//! ```

use vm_memory::GuestAddress;

pub const BOOT_GDT_START: u64 = 0x500;
pub const BOOT_IDT_START: u64 = 0x520;
pub const PVH_INFO_START: u64 = 0x6000;
pub const PVH_MODLIST_START: u64 = 0x6040;
pub const PVH_MEMMAP_START: u64 = 0x6100;
/// Room for PVH memory map entries between PVH_MEMMAP_START and ZERO_PAGE_START.
pub const PVH_MEMMAP_MAX_ENTRIES: usize = (0x7000 - 0x6100) / 24;
pub const ZERO_PAGE_START: u64 = 0x7000;
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
pub const PML4_START: u64 = 0x9000;
pub const PDPTE_START: u64 = 0xa000;
pub const PDE_START: u64 = 0xb000;
pub const CMDLINE_START: u64 = 0x20000;
/// Linux x86 `COMMAND_LINE_SIZE`, including the terminating NUL.
pub const CMDLINE_MAX_SIZE: usize = 2048;
pub const EBDA_START: u64 = 0x9fc00;
pub const HIMEM_START: u64 = 0x10_0000;
/// Where guests look for the RSDP without being told (the BIOS read-only area's scan range
/// starts here); the zero page and the PVH start info also point at it.
pub const ACPI_RSDP_START: u64 = 0xe_0000;
pub const ACPI_TABLES_START: u64 = 0xe_1000;
/// The generation ID sits in reserved memory after the tables, 8-byte aligned as the VMGenID
/// specification asks.
pub const VMGENID_START: u64 = 0xe_f000;
pub const VMGENID_SIZE: u64 = 16;

/// Start of the 32-bit MMIO gap; RAM never overlaps it.
pub const MMIO_GAP_START: u64 = 0xc000_0000;
pub const MMIO_GAP_END: u64 = 0x1_0000_0000;
pub const MMIO_GAP_SIZE: u64 = MMIO_GAP_END - MMIO_GAP_START;
/// Where virtio-mmio devices are placed, one 4 KiB window each.
pub const VIRTIO_MMIO_START: u64 = 0xd000_0000;
pub const VIRTIO_MMIO_SIZE: u64 = 0x1000;
pub const IOAPIC_START: u64 = 0xfec0_0000;
pub const APIC_START: u64 = 0xfee0_0000;
/// KVM needs three pages for the real-mode TSS and one for the EPT identity map (VMX only).
/// Both sit in the gap so they never shadow guest RAM.
pub const KVM_TSS_ADDRESS: u64 = 0xfffb_d000;
pub const KVM_IDENTITY_MAP_ADDRESS: u64 = 0xfffb_c000;

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// Legacy I/O ports.
pub const SERIAL_COM1_PORT: u16 = 0x3f8;
pub const SERIAL_COM1_IRQ: u32 = 4;
pub const I8042_PORT: u16 = 0x60;
pub const KEYBOARD_IRQ: u32 = 1;
/// The shutdown port: writing `POWER_OFF_VALUE` powers the VM off. It mirrors the ACPI
/// PM1a control register encoding (SLP_TYP=5 i.e. S5, SLP_EN) so a guest can use the same value
/// once ACPI tables describe it; without ACPI the probe guest writes it directly.
pub const POWER_PORT: u16 = 0x600;
pub const POWER_OFF_VALUE: u8 = (5 << 2) | (1 << 5);
/// Writing this value to the shutdown port resets the VM.
pub const POWER_RESET_VALUE: u8 = 0x1;
/// The Generic Event Device's event register (one byte, read-to-clear): which events its
/// interrupt announced. See `devices::ged`.
pub const GED_PORT: u16 = 0x610;
/// The GED's interrupt: ISA IRQ 3 (COM2's, unused here); 5 and up are virtio's.
pub const GED_IRQ: u32 = 3;

/// RAM regions for a guest of `mem_size` bytes: everything below the MMIO gap, the rest above 4 GiB.
pub fn ram_regions(mem_size: u64) -> Vec<(GuestAddress, usize)> {
    if mem_size <= MMIO_GAP_START {
        vec![(GuestAddress(0), mem_size as usize)]
    } else {
        vec![
            (GuestAddress(0), MMIO_GAP_START as usize),
            (
                GuestAddress(MMIO_GAP_END),
                (mem_size - MMIO_GAP_START) as usize,
            ),
        ]
    }
}

/// Highest guest-physical address + 1 of RAM below the gap.
pub fn low_ram_end(mem_size: u64) -> u64 {
    mem_size.min(MMIO_GAP_START)
}

/// The kind of an e820 entry (values from the e820 specification).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum E820Kind {
    Ram = 1,
    Reserved = 2,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct E820Entry {
    pub addr: u64,
    pub size: u64,
    pub kind: E820Kind,
}

/// The e820 map the guest gets, for both the Linux zero page and the PVH memory map.
pub fn e820_map(mem_size: u64) -> Vec<E820Entry> {
    let mut map = vec![
        E820Entry {
            addr: 0,
            size: EBDA_START,
            kind: E820Kind::Ram,
        },
        // EBDA with the MP table, the VGA hole and the BIOS area: never RAM.
        E820Entry {
            addr: EBDA_START,
            size: HIMEM_START - EBDA_START,
            kind: E820Kind::Reserved,
        },
    ];
    let low_end = low_ram_end(mem_size);
    if low_end > HIMEM_START {
        map.push(E820Entry {
            addr: HIMEM_START,
            size: low_end - HIMEM_START,
            kind: E820Kind::Ram,
        });
    }
    if mem_size > MMIO_GAP_START {
        map.push(E820Entry {
            addr: MMIO_GAP_END,
            size: mem_size - MMIO_GAP_START,
            kind: E820Kind::Ram,
        });
    }
    map
}

// The fixed boot structures must not overlap each other or the guest RAM regions; checked at
// compile time.
const _: () = {
    assert!(PVH_MEMMAP_START + 24 * PVH_MEMMAP_MAX_ENTRIES as u64 <= ZERO_PAGE_START);
    assert!(ZERO_PAGE_START + 4096 <= BOOT_STACK_POINTER && BOOT_STACK_POINTER <= PML4_START);
    assert!(PDE_START + 4096 <= CMDLINE_START);
    assert!(CMDLINE_START + CMDLINE_MAX_SIZE as u64 <= EBDA_START);
    assert!(
        KVM_IDENTITY_MAP_ADDRESS >= MMIO_GAP_START && KVM_TSS_ADDRESS + 3 * 4096 <= MMIO_GAP_END
    );
    assert!(VIRTIO_MMIO_START >= MMIO_GAP_START && VIRTIO_MMIO_START < IOAPIC_START);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_guest_has_one_region_below_gap() {
        let r = ram_regions(256 * MIB);
        assert_eq!(r, vec![(GuestAddress(0), (256 * MIB) as usize)]);
    }

    #[test]
    fn guest_exactly_gap_sized_stays_below_gap() {
        let r = ram_regions(MMIO_GAP_START);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].1 as u64, MMIO_GAP_START);
    }

    #[test]
    fn large_guest_splits_around_gap() {
        let r = ram_regions(6 * GIB);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0], (GuestAddress(0), MMIO_GAP_START as usize));
        assert_eq!(r[1].0, GuestAddress(MMIO_GAP_END));
        let total: u64 = r.iter().map(|(_, s)| *s as u64).sum();
        assert_eq!(total, 6 * GIB);
        // No RAM inside the gap.
        for (a, s) in r {
            let end = a.0 + s as u64;
            assert!(end <= MMIO_GAP_START || a.0 >= MMIO_GAP_END);
        }
    }

    #[test]
    fn e820_covers_all_ram_and_reserves_ebda() {
        for mem in [64 * MIB, 3 * GIB, 5 * GIB] {
            let map = e820_map(mem);
            let ram: u64 = map
                .iter()
                .filter(|e| e.kind == E820Kind::Ram)
                .map(|e| e.size)
                .sum();
            // Everything except the EBDA..1 MiB hole is reported as RAM.
            assert_eq!(ram, mem - (HIMEM_START - EBDA_START), "mem {mem}");
            assert!(map
                .iter()
                .any(|e| e.kind == E820Kind::Reserved && e.addr == EBDA_START));
            for e in &map {
                let end = e.addr + e.size;
                assert!(
                    end <= MMIO_GAP_START || e.addr >= MMIO_GAP_END,
                    "{e:?} overlaps gap"
                );
            }
        }
    }
}
