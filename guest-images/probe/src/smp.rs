//! The SMP test: find the processors in the MP table, wake each application processor with
//! INIT + SIPI through the local APIC (as Linux does), and count the ones that check in.

use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::result;

const LAPIC: u64 = 0xfee0_0000;
const LAPIC_ID: u64 = 0x20;
const LAPIC_SVR: u64 = 0xf0;
const LAPIC_ICR_LO: u64 = 0x300;
const LAPIC_ICR_HI: u64 = 0x310;
const TRAMPOLINE: u64 = 0x8000;
const MAX_CPUS: usize = 32;
const AP_STACK: usize = 16 * 1024;

static CHECKED_IN: AtomicU32 = AtomicU32::new(0);
/// Bit n set when the CPU with APIC ID n checked in.
static SEEN: AtomicU64 = AtomicU64::new(0);

#[repr(C, align(16))]
struct Stacks([[u8; AP_STACK]; MAX_CPUS]);
static mut AP_STACKS: Stacks = Stacks([[0; AP_STACK]; MAX_CPUS]);

core::arch::global_asm!(
    ".section .rodata.trampoline, \"a\"",
    ".code16",
    ".global ap_trampoline_start",
    "ap_trampoline_start:",
    "    cli",
    "    xorw %ax, %ax",
    "    movw %ax, %ds",
    "    lgdtl (0x8000 + tramp_gdtr - ap_trampoline_start)",
    "    movl %cr4, %eax",
    "    orl $0x20, %eax",
    "    movl %eax, %cr4",
    "    movl (0x8000 + tramp_cr3 - ap_trampoline_start), %eax",
    "    movl %eax, %cr3",
    "    movl $0xc0000080, %ecx",
    "    rdmsr",
    "    orl $0x100, %eax",
    "    wrmsr",
    "    movl %cr0, %eax",
    "    orl $0x80000001, %eax",
    "    movl %eax, %cr0",
    "    ljmpl $0x08, $(0x8000 + tramp64 - ap_trampoline_start)",
    ".code64",
    "tramp64:",
    "    movw $0x10, %ax",
    "    movw %ax, %ds",
    "    movw %ax, %es",
    "    movw %ax, %ss",
    "    movq (0x8000 + tramp_stack - ap_trampoline_start), %rsp",
    "    movq (0x8000 + tramp_entry - ap_trampoline_start), %rax",
    "    callq *%rax",
    "3:  cli",
    "    hlt",
    "    jmp 3b",
    ".balign 8",
    "tramp_gdt:",
    "    .quad 0",
    "    .quad 0x00af9b000000ffff",
    "    .quad 0x00cf93000000ffff",
    "tramp_gdtr:",
    "    .word 23",
    "    .long 0x8000 + tramp_gdt - ap_trampoline_start",
    ".balign 8",
    ".global tramp_cr3",
    "tramp_cr3: .quad 0",
    ".global tramp_stack",
    "tramp_stack: .quad 0",
    ".global tramp_entry",
    "tramp_entry: .quad 0",
    ".global ap_trampoline_end",
    "ap_trampoline_end:",
    ".text",
    options(att_syntax)
);

extern "C" {
    static ap_trampoline_start: u8;
    static ap_trampoline_end: u8;
    static tramp_cr3: u8;
    static tramp_stack: u8;
    static tramp_entry: u8;
}

pub fn lapic_read(reg: u64) -> u32 {
    unsafe { core::ptr::read_volatile((LAPIC + reg) as *const u32) }
}

pub fn lapic_write(reg: u64, v: u32) {
    unsafe { core::ptr::write_volatile((LAPIC + reg) as *mut u32, v) }
}

extern "C" fn ap_main() -> ! {
    check_in();
    loop {
        unsafe { core::arch::asm!("cli", "hlt") };
    }
}

fn checksum_ok(p: *const u8, len: usize) -> bool {
    (0..len).fold(0u8, |a, i| a.wrapping_add(unsafe { *p.add(i) })) == 0
}

/// Returns the APIC IDs of the processors in the MP table, and which is the BSP.
fn mp_processors(ids: &mut [u8; MAX_CPUS]) -> Result<(usize, u8), &'static str> {
    let mut mpf = 0u64;
    for base in [(0x9fc00u64, 0xa0000u64), (0xf0000, 0x100000)] {
        let mut a = base.0;
        while a < base.1 {
            let sig = unsafe { core::ptr::read_volatile(a as *const [u8; 4]) };
            if &sig == b"_MP_" && checksum_ok(a as *const u8, 16) {
                mpf = a;
                break;
            }
            a += 16;
        }
        if mpf != 0 {
            break;
        }
    }
    if mpf == 0 {
        return Err("no MP floating pointer");
    }
    let table = unsafe { core::ptr::read_unaligned((mpf + 4) as *const u32) } as u64;
    let t = table as *const u8;
    if unsafe { core::ptr::read_volatile(t as *const [u8; 4]) } != *b"PCMP" {
        return Err("MP configuration table signature");
    }
    let len = unsafe { core::ptr::read_unaligned(t.add(4) as *const u16) } as usize;
    if !checksum_ok(t, len) {
        return Err("MP configuration table checksum");
    }
    let count = unsafe { core::ptr::read_unaligned(t.add(34) as *const u16) } as usize;
    let (mut off, mut n, mut bsp) = (44usize, 0usize, 0xffu8);
    for _ in 0..count {
        if off >= len {
            return Err("MP entries run past the table");
        }
        let kind = unsafe { *t.add(off) };
        if kind == 0 {
            let (id, flags) = unsafe { (*t.add(off + 1), *t.add(off + 3)) };
            if flags & 1 != 0 {
                if n == MAX_CPUS {
                    return Err("more processors than the probe supports");
                }
                ids[n] = id;
                n += 1;
                if flags & 2 != 0 {
                    bsp = id;
                }
            }
            off += 20;
        } else {
            off += 8;
        }
    }
    if bsp == 0xff {
        return Err("no boot processor in MP table");
    }
    Ok((n, bsp))
}

/// Wakes every application processor in the MP table with INIT + SIPI; each runs `entry` on
/// its own stack and must increment `CHECKED_IN` (through `check_in`) when it arrives.
/// Returns the number of processors (the BSP included).
pub fn start_aps(entry: extern "C" fn() -> !) -> usize {
    let mut ids = [0u8; MAX_CPUS];
    let (n, bsp) = match mp_processors(&mut ids) {
        Ok(v) => v,
        Err(e) => result(false, format_args!("{e}")),
    };
    let my_id = (lapic_read(LAPIC_ID) >> 24) as u8;
    if my_id != bsp {
        result(
            false,
            format_args!("BSP APIC ID {my_id} but MP table says {bsp}"),
        );
    }
    check_in();
    lapic_write(LAPIC_SVR, 0x1ff); // software-enable the LAPIC

    unsafe {
        let start = core::ptr::addr_of!(ap_trampoline_start);
        let size = core::ptr::addr_of!(ap_trampoline_end) as usize - start as usize;
        core::ptr::copy_nonoverlapping(start, TRAMPOLINE as *mut u8, size);
    }
    let var = |sym: *const u8| {
        TRAMPOLINE + (sym as u64 - core::ptr::addr_of!(ap_trampoline_start) as u64)
    };
    let (cr3_at, stack_at, entry_at) = (
        var(core::ptr::addr_of!(tramp_cr3)),
        var(core::ptr::addr_of!(tramp_stack)),
        var(core::ptr::addr_of!(tramp_entry)),
    );
    unsafe {
        core::ptr::write_volatile(cr3_at as *mut u64, crate::hw::paging::cr3());
        core::ptr::write_volatile(entry_at as *mut u64, entry as *const () as u64);
    }

    for (slot, &id) in ids[..n].iter().enumerate() {
        if id == bsp {
            continue;
        }
        let before = CHECKED_IN.load(Ordering::SeqCst);
        let stack_top = unsafe { core::ptr::addr_of!(AP_STACKS.0[slot]) as u64 + AP_STACK as u64 };
        unsafe { core::ptr::write_volatile(stack_at as *mut u64, stack_top) };
        lapic_write(LAPIC_ICR_HI, (id as u32) << 24);
        lapic_write(LAPIC_ICR_LO, 0x0000_4500); // INIT
        let mut arrived = false;
        for _attempt in 0..2 {
            lapic_write(LAPIC_ICR_HI, (id as u32) << 24);
            lapic_write(LAPIC_ICR_LO, 0x0000_4600 | (TRAMPOLINE >> 12) as u32); // SIPI
            for _ in 0..200_000 {
                if CHECKED_IN.load(Ordering::SeqCst) > before {
                    arrived = true;
                    break;
                }
                core::hint::spin_loop();
            }
            if arrived {
                break;
            }
        }
        if !arrived {
            result(
                false,
                format_args!(
                    "APIC ID {id} did not check in; cpus={}",
                    CHECKED_IN.load(Ordering::SeqCst)
                ),
            );
        }
    }
    n
}

/// Records that the calling processor is up; returns its index in check-in order (BSP 0).
pub fn check_in() -> u32 {
    let id = lapic_read(LAPIC_ID) >> 24;
    SEEN.fetch_or(1 << (id & 63), Ordering::SeqCst);
    CHECKED_IN.fetch_add(1, Ordering::SeqCst)
}

pub fn run() -> ! {
    let n = start_aps(ap_main);
    let seen = SEEN.load(Ordering::SeqCst);
    let cpus = CHECKED_IN.load(Ordering::SeqCst);
    result(
        cpus as usize == n,
        format_args!("cpus={cpus} mptable_cpus={n} apic_mask={seen:#x}"),
    )
}
