//! The timer test: the local APIC timer in periodic mode interrupts the probe every 10 ms
//! through a real IDT; the probe halts between interrupts and counts them. It shows that timer
//! interrupts keep arriving across a pause, snapshot/restore or migration.
//!
//! `probe.ticks=N` (default 50): prints `PROBE PROGRESS timer ticks=K` every 10 ticks (every
//! `probe.every=E` ticks when given, down to each tick: a host timing those lines sees how long
//! the guest went without a tick, as across a migration's switch-over) and ends after N.
//!
//! `probe.acpi=1` also takes the ACPI Generic Event Device's interrupt (IOAPIC pin 3, as the
//! DSDT's GED `_CRS` says) and does what its `_EVT` method does: reads the event register and
//! acts on its bits: the power button powers the machine off through the FADT's sleep control
//! register (`PROBE ACPI power button` first), a new VMGenID generation is printed at once.
//!
//! `probe.warm=M` first writes M MiB of RAM (one word a page, so every page is the guest's own
//! and non-zero): the working set of a warmed-up sandbox, which a snapshot carries and clones
//! share until they write it. It prints `probe: warm M MiB` when done.

use core::fmt::Write;
use core::sync::atomic::{AtomicU64, Ordering};

use crate::hw::Serial;
use crate::smp::{lapic_read, lapic_write};
use crate::{probe_end, result, BootInfo};

const VECTOR: usize = 0x40;
const GED_VECTOR: usize = 0x41;
const GED_PIN: u32 = 3;
const GED_PORT: u16 = 0x610;
const GED_POWER_BUTTON: u8 = 1;
const GED_GENERATION: u8 = 2;
const IOAPIC: u64 = 0xfec0_0000;
/// SLP_TYP 5 (S5, the `_S5_` value) with SLP_EN, as the sleep control register takes it.
const SLEEP_S5: u8 = (5 << 2) | (1 << 5);
const SPURIOUS: usize = 0xff;
const LAPIC_SVR: u64 = 0xf0;
const LAPIC_LVT_TIMER: u64 = 0x320;
const LAPIC_TIMER_INITIAL: u64 = 0x380;
const LAPIC_TIMER_DIVIDE: u64 = 0x3e0;
const PERIODIC: u32 = 1 << 17;
/// KVM's APIC bus runs at 1 GHz; divided by 16 this many counts are 10 ms.
const COUNT_10MS: u32 = 625_000;

#[no_mangle]
static TIMER_TICKS: AtomicU64 = AtomicU64::new(0);
#[no_mangle]
static GED_INTERRUPTS: AtomicU64 = AtomicU64::new(0);

/// An interrupt handler that counts into `$counter` and ends the interrupt at the local APIC
/// (both lines are edge-triggered: nothing to tell the IOAPIC).
macro_rules! counting_isr {
    ($isr:ident counts $counter:ident) => {
        core::arch::global_asm!(
            concat!(".global ", stringify!($isr)),
            concat!(stringify!($isr), ":"),
            "    push rax",
            concat!("    lock inc qword ptr [rip + ", stringify!($counter), "]"),
            "    mov rax, 0xfee000b0", // EOI
            "    mov dword ptr [rax], 0",
            "    pop rax",
            "    iretq",
        );
    };
}

counting_isr!(timer_isr counts TIMER_TICKS);
counting_isr!(ged_isr counts GED_INTERRUPTS);
core::arch::global_asm!(".global spurious_isr", "spurious_isr:", "    iretq");

extern "C" {
    fn timer_isr();
    fn ged_isr();
    fn spurious_isr();
}

#[repr(C, align(16))]
struct Idt([u64; 512]);
static mut IDT: Idt = Idt([0; 512]);

/// A 64-bit interrupt gate to `handler` in code segment `cs`.
fn gate(handler: u64, cs: u16) -> (u64, u64) {
    let lo = (handler & 0xffff)
        | ((cs as u64) << 16)
        | (0x8e_u64 << 40) // present, DPL 0, interrupt gate
        | (((handler >> 16) & 0xffff) << 48);
    (lo, handler >> 32)
}

/// Writes one word in each 4 KiB page of the first `mib` MiB of RAM above the probe; returns
/// how many MiB it wrote (less when RAM is smaller).
fn warm(boot: &BootInfo, mib: u64) -> u64 {
    let floor = (probe_end() + 0xfff) & !0xfff;
    let mut pages = mib * 256;
    let mut written = 0u64;
    for e in boot.ram() {
        let mut a = e.addr.max(floor);
        while pages > 0 && a + 0x1000 <= e.addr + e.size {
            unsafe { core::ptr::write_volatile(a as *mut u64, a ^ 0x5a5a_0f0f_a5a5_f0f0) };
            a += 0x1000;
            pages -= 1;
            written += 1;
        }
    }
    written / 256
}

/// Routes IOAPIC pin 3 (the GED's) to `GED_VECTOR` on this CPU: edge-triggered, active
/// high, unmasked.
fn listen_to_ged() {
    let redirection = 0x10 + 2 * GED_PIN;
    unsafe {
        core::ptr::write_volatile(IOAPIC as *mut u32, redirection + 1);
        core::ptr::write_volatile((IOAPIC + 0x10) as *mut u32, 0); // destination: APIC 0
        core::ptr::write_volatile(IOAPIC as *mut u32, redirection);
        core::ptr::write_volatile((IOAPIC + 0x10) as *mut u32, GED_VECTOR as u32);
    }
    let _ = writeln!(Serial, "probe: listening to the GED");
}

/// What the DSDT's `_EVT` does: read (and so clear) the event register, act on each bit.
fn ged_event() {
    let events = unsafe { crate::hw::inb(GED_PORT) };
    if events & GED_GENERATION != 0 {
        let _ = writeln!(Serial, "probe: GED says a new generation");
        crate::genid::report();
    }
    if events & GED_POWER_BUTTON != 0 {
        let _ = writeln!(Serial, "PROBE ACPI power button");
        match crate::genid::sleep_control_port() {
            Some(port) => unsafe { crate::hw::outb(port, SLEEP_S5) },
            None => result(false, format_args!("no sleep control register in the FADT")),
        }
        result(
            false,
            format_args!("S5 through the sleep control register did not end the VM"),
        );
    }
}

pub fn run(boot: &BootInfo) -> ! {
    if let Some(mib) = boot.param("probe.warm").and_then(|p| p.parse().ok()) {
        let done = warm(boot, mib);
        let _ = writeln!(Serial, "probe: warm {done} MiB");
    }
    let target: u64 = boot
        .param("probe.ticks")
        .and_then(|p| p.parse().ok())
        .unwrap_or(50)
        .max(1);
    let every: u64 = boot
        .param("probe.every")
        .and_then(|p| p.parse().ok())
        .unwrap_or(10)
        .max(1);
    let cs: u16;
    unsafe { core::arch::asm!("mov {0:x}, cs", out(reg) cs, options(nomem, nostack)) };
    unsafe {
        let idt = &mut *core::ptr::addr_of_mut!(IDT);
        for (v, h) in [
            (VECTOR, timer_isr as *const () as u64),
            (SPURIOUS, spurious_isr as *const () as u64),
            (GED_VECTOR, ged_isr as *const () as u64),
        ] {
            let (lo, hi) = gate(h, cs);
            idt.0[2 * v] = lo;
            idt.0[2 * v + 1] = hi;
        }
        let mut idtr = [0u16; 5];
        idtr[0] = (core::mem::size_of::<Idt>() - 1) as u16;
        let base = idt as *const Idt as u64;
        idtr[1] = base as u16;
        idtr[2] = (base >> 16) as u16;
        idtr[3] = (base >> 32) as u16;
        idtr[4] = (base >> 48) as u16;
        core::arch::asm!("lidt [{}]", in(reg) idtr.as_ptr(), options(nostack));
    }
    lapic_write(LAPIC_SVR, 0x100 | SPURIOUS as u32);
    lapic_write(LAPIC_TIMER_DIVIDE, 0x3);
    lapic_write(LAPIC_LVT_TIMER, VECTOR as u32 | PERIODIC);
    lapic_write(LAPIC_TIMER_INITIAL, COUNT_10MS);
    let _ = writeln!(
        Serial,
        "probe: timer armed lvt={:#x}",
        lapic_read(LAPIC_LVT_TIMER)
    );
    let acpi = boot.param("probe.acpi") == Some("1");
    if acpi {
        listen_to_ged();
    }
    let mut printed = 0;
    let mut ged_seen = 0;
    loop {
        // Interrupts on only while halted: the handler never runs in the middle of printing.
        unsafe { core::arch::asm!("sti", "hlt", "cli", options(nomem, nostack)) };
        let ged = GED_INTERRUPTS.load(Ordering::SeqCst);
        if acpi && ged != ged_seen {
            ged_seen = ged;
            ged_event();
        }
        let ticks = TIMER_TICKS.load(Ordering::SeqCst);
        while printed + every <= ticks.min(target) {
            printed += every;
            crate::genid::report();
            let _ = writeln!(Serial, "PROBE PROGRESS timer ticks={printed}");
        }
        if ticks >= target {
            lapic_write(LAPIC_TIMER_INITIAL, 0);
            result(true, format_args!("ticks={ticks}"));
        }
    }
}
