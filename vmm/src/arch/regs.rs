//! Initial vCPU state: GDT, identity page tables, special registers, general registers, FPU,
//! MSRs and the LAPIC's LINT pins.

use kvm_bindings::{kvm_fpu, kvm_lapic_state, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs};
use vm_memory::{Bytes, GuestAddress, GuestMemory};

use crate::layout::*;

/// Selectors in the boot GDT. The Linux 64-bit boot protocol requires `__BOOT_CS` = 0x10 and
/// `__BOOT_DS` = 0x18; PVH enters in 32-bit protected mode through the 32-bit code segment.
pub const GDT_CODE32_SEL: u16 = 0x08;
pub const GDT_CODE64_SEL: u16 = 0x10;
pub const GDT_DATA_SEL: u16 = 0x18;
pub const GDT_TSS_SEL: u16 = 0x20;

/// Flat 4 GiB descriptors: flags (G, D/B, L), access byte.
pub const BOOT_GDT: [u64; 5] = [
    0,                             // null
    gdt_entry(0xc09b, 0, 0xfffff), // 32-bit code
    gdt_entry(0xa09b, 0, 0xfffff), // 64-bit code
    gdt_entry(0xc093, 0, 0xfffff), // data
    gdt_entry(0x808b, 0, 0xfffff), // TSS (busy)
];

const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << (56 - 24))
        | ((flags as u64 & 0x0000_f0ff) << 40)
        | ((limit as u64 & 0x000f_0000) << (48 - 16))
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
}

/// Decodes a GDT entry into the segment KVM wants.
pub fn segment_from_gdt(entry: u64, selector: u16) -> kvm_segment {
    let base = ((entry >> 16) & 0xff_ffff) | ((entry >> 32) & 0xff00_0000);
    let limit_raw = ((entry & 0xffff) | ((entry >> 32) & 0xf_0000)) as u32;
    let g = ((entry >> 55) & 1) as u8;
    kvm_segment {
        base,
        // With granularity set the limit counts 4 KiB pages.
        limit: if g == 1 {
            (limit_raw << 12) | 0xfff
        } else {
            limit_raw
        },
        selector,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g,
        avl: ((entry >> 52) & 1) as u8,
        padding: 0,
        unusable: if ((entry >> 47) & 1) == 0 { 1 } else { 0 },
    }
}

pub const X86_CR0_PE: u64 = 1 << 0;
pub const X86_CR0_ET: u64 = 1 << 4;
pub const X86_CR0_PG: u64 = 1 << 31;
pub const X86_CR4_PAE: u64 = 1 << 5;
pub const EFER_LME: u64 = 1 << 8;
pub const EFER_LMA: u64 = 1 << 10;

/// How the guest is entered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryMode {
    /// Linux 64-bit boot protocol: long mode, paging on, RSI = zero page.
    Linux64,
    /// PVH: 32-bit protected mode, paging off, EBX = hvm_start_info.
    Pvh,
}

/// Writes the GDT, an empty IDT and (for 64-bit entry) identity page tables mapping the first
/// 1 GiB with 2 MiB pages, which covers the kernel, boot data and the initial stack.
pub fn write_boot_tables<M: GuestMemory>(
    mem: &M,
    mode: EntryMode,
) -> Result<(), vm_memory::GuestMemoryError> {
    for (i, e) in BOOT_GDT.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(BOOT_GDT_START + (i * 8) as u64))?;
    }
    mem.write_obj(0u64, GuestAddress(BOOT_IDT_START))?;
    if mode == EntryMode::Linux64 {
        mem.write_obj(PDPTE_START | 0x03, GuestAddress(PML4_START))?;
        mem.write_obj(PDE_START | 0x03, GuestAddress(PDPTE_START))?;
        for i in 0..512u64 {
            // Present, writable, page size (2 MiB).
            mem.write_obj((i << 21) | 0x83, GuestAddress(PDE_START + i * 8))?;
        }
    }
    Ok(())
}

/// Special registers for the given entry mode, on top of what KVM reports.
pub fn boot_sregs(mut sregs: kvm_sregs, mode: EntryMode) -> kvm_sregs {
    let code_sel = match mode {
        EntryMode::Linux64 => GDT_CODE64_SEL,
        EntryMode::Pvh => GDT_CODE32_SEL,
    };
    sregs.cs = segment_from_gdt(BOOT_GDT[(code_sel / 8) as usize], code_sel);
    let data = segment_from_gdt(BOOT_GDT[(GDT_DATA_SEL / 8) as usize], GDT_DATA_SEL);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = segment_from_gdt(BOOT_GDT[(GDT_TSS_SEL / 8) as usize], GDT_TSS_SEL);
    sregs.gdt.base = BOOT_GDT_START;
    sregs.gdt.limit = (std::mem::size_of_val(&BOOT_GDT) - 1) as u16;
    sregs.idt.base = BOOT_IDT_START;
    sregs.idt.limit = 7;
    match mode {
        EntryMode::Linux64 => {
            sregs.cr0 = X86_CR0_PE | X86_CR0_ET | X86_CR0_PG;
            sregs.cr3 = PML4_START;
            sregs.cr4 = X86_CR4_PAE;
            sregs.efer = EFER_LME | EFER_LMA;
        }
        EntryMode::Pvh => {
            sregs.cr0 = X86_CR0_PE | X86_CR0_ET;
            sregs.cr3 = 0;
            sregs.cr4 = 0;
            sregs.efer = 0;
        }
    }
    sregs
}

/// General registers at entry. `boot_info` is the zero page (Linux64) or start_info (PVH).
pub fn boot_regs(entry: u64, boot_info: u64, mode: EntryMode) -> kvm_regs {
    let mut regs = kvm_regs {
        rflags: 0x2,
        rip: entry,
        ..Default::default()
    };
    match mode {
        EntryMode::Linux64 => {
            regs.rsp = BOOT_STACK_POINTER;
            regs.rbp = BOOT_STACK_POINTER;
            regs.rsi = boot_info;
        }
        EntryMode::Pvh => regs.rbx = boot_info,
    }
    regs
}

/// x87 control word and MXCSR as after FNINIT / reset.
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    }
}

pub const MSR_IA32_SYSENTER_CS: u32 = 0x174;
pub const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
pub const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
pub const MSR_STAR: u32 = 0xc000_0081;
pub const MSR_LSTAR: u32 = 0xc000_0082;
pub const MSR_CSTAR: u32 = 0xc000_0083;
pub const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
pub const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
pub const MSR_IA32_TSC: u32 = 0x10;
pub const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
pub const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
const MISC_ENABLE_FAST_STRING: u64 = 1;
/// MTRRs enabled, default memory type write-back.
const MTRR_DEF_TYPE_WB_ENABLED: u64 = (1 << 11) | 6;

pub fn boot_msrs() -> Vec<kvm_msr_entry> {
    let e = |index, data| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    };
    vec![
        e(MSR_IA32_SYSENTER_CS, 0),
        e(MSR_IA32_SYSENTER_ESP, 0),
        e(MSR_IA32_SYSENTER_EIP, 0),
        e(MSR_STAR, 0),
        e(MSR_CSTAR, 0),
        e(MSR_KERNEL_GS_BASE, 0),
        e(MSR_SYSCALL_MASK, 0),
        e(MSR_LSTAR, 0),
        e(MSR_IA32_TSC, 0),
        e(MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
        e(MSR_MTRR_DEF_TYPE, MTRR_DEF_TYPE_WB_ENABLED),
    ]
}

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

fn lapic_reg(lapic: &kvm_lapic_state, off: usize) -> u32 {
    let b = &lapic.regs[off..off + 4];
    u32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8])
}

fn set_lapic_reg(lapic: &mut kvm_lapic_state, off: usize, v: u32) {
    for (i, b) in v.to_le_bytes().iter().enumerate() {
        lapic.regs[off + i] = *b as _;
    }
}

/// LINT0 delivers ExtINT (the legacy PIC), LINT1 delivers NMI, as the MP spec's virtual wire mode.
pub fn set_lint(lapic: &mut kvm_lapic_state) {
    let set_mode = |reg: u32, mode: u32| (reg & !0x700) | (mode << 8);
    let lvt0 = lapic_reg(lapic, APIC_LVT0);
    set_lapic_reg(lapic, APIC_LVT0, set_mode(lvt0, APIC_MODE_EXTINT));
    let lvt1 = lapic_reg(lapic, APIC_LVT1);
    set_lapic_reg(lapic, APIC_LVT1, set_mode(lvt1, APIC_MODE_NMI));
}

/// Translates a guest virtual address through the guest's 4-level page tables, used to read the
/// instruction bytes at RIP when KVM reports an internal error.
pub fn translate_gva<M: GuestMemory>(mem: &M, sregs: &kvm_sregs, gva: u64) -> Option<u64> {
    if sregs.cr0 & X86_CR0_PG == 0 {
        return Some(gva);
    }
    if sregs.efer & EFER_LMA == 0 {
        return None; // 32-bit paging is not used by anything this VMM boots.
    }
    let mut table = sregs.cr3 & 0x000f_ffff_ffff_f000;
    for level in (0..4).rev() {
        let index = (gva >> (12 + 9 * level)) & 0x1ff;
        let entry: u64 = mem.read_obj(GuestAddress(table + index * 8)).ok()?;
        if entry & 1 == 0 {
            return None;
        }
        let addr = entry & 0x000f_ffff_ffff_f000;
        if (level == 1 || level == 2) && entry & 0x80 != 0 {
            let page_mask = (1u64 << (12 + 9 * level)) - 1;
            return Some((addr & !page_mask) | (gva & page_mask));
        }
        if level == 0 {
            return Some(addr | (gva & 0xfff));
        }
        table = addr;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    #[test]
    fn gdt_entries_decode_to_flat_segments() {
        let cs = segment_from_gdt(BOOT_GDT[2], GDT_CODE64_SEL);
        assert_eq!(
            (cs.base, cs.limit, cs.l, cs.db, cs.present, cs.type_, cs.s),
            (0, 0xffff_ffff, 1, 0, 1, 0xb, 1)
        );
        let cs32 = segment_from_gdt(BOOT_GDT[1], GDT_CODE32_SEL);
        assert_eq!((cs32.l, cs32.db, cs32.limit), (0, 1, 0xffff_ffff));
        let ds = segment_from_gdt(BOOT_GDT[3], GDT_DATA_SEL);
        assert_eq!((ds.type_, ds.db, ds.g), (0x3, 1, 1));
        let tss = segment_from_gdt(BOOT_GDT[4], GDT_TSS_SEL);
        assert_eq!((tss.type_, tss.s), (0xb, 0));
        assert_eq!(segment_from_gdt(0, 0).unusable, 1);
    }

    #[test]
    fn linux64_sregs_enable_long_mode() {
        let s = boot_sregs(kvm_sregs::default(), EntryMode::Linux64);
        assert_eq!(s.cs.selector, 0x10);
        assert_eq!(s.ds.selector, 0x18);
        assert_ne!(s.cr0 & X86_CR0_PG, 0);
        assert_eq!(s.efer & (EFER_LME | EFER_LMA), EFER_LME | EFER_LMA);
        assert_eq!(s.cr3, PML4_START);
        let p = boot_sregs(kvm_sregs::default(), EntryMode::Pvh);
        assert_eq!(p.cr0 & X86_CR0_PG, 0);
        assert_eq!(p.cs.db, 1);
        assert_eq!(p.efer, 0);
    }

    #[test]
    fn identity_tables_translate_first_gib() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap();
        write_boot_tables(&mem, EntryMode::Linux64).unwrap();
        let s = boot_sregs(kvm_sregs::default(), EntryMode::Linux64);
        for gva in [0u64, 0x1234, 0x20_0000, 0x3fff_ffff] {
            assert_eq!(translate_gva(&mem, &s, gva), Some(gva));
        }
        // Beyond 1 GiB: the PDPT has no entry.
        assert_eq!(translate_gva(&mem, &s, 0x4000_0000), None);
    }

    #[test]
    fn regs_carry_boot_info_per_protocol() {
        let r = boot_regs(0x100_0000, ZERO_PAGE_START, EntryMode::Linux64);
        assert_eq!(
            (r.rip, r.rsi, r.rsp, r.rflags),
            (0x100_0000, ZERO_PAGE_START, BOOT_STACK_POINTER, 2)
        );
        let r = boot_regs(0x100_0000, PVH_INFO_START, EntryMode::Pvh);
        assert_eq!((r.rbx, r.rsi), (PVH_INFO_START, 0));
    }

    #[test]
    fn lint_pins_are_extint_and_nmi() {
        let mut l = kvm_lapic_state::default();
        set_lapic_reg(&mut l, APIC_LVT0, 0x0001_0000); // masked
        set_lint(&mut l);
        assert_eq!(lapic_reg(&l, APIC_LVT0), 0x0001_0700);
        assert_eq!(lapic_reg(&l, APIC_LVT1) & 0x700, 0x400);
    }
}
