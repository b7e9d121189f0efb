//! Port I/O, the serial port, power control, paging and the deliberate faults.

use core::arch::asm;

pub const COM1: u16 = 0x3f8;
/// The VMM's shutdown port and its "S5 + SLP_EN" value (vmm/src/layout.rs).
const POWER_PORT: u16 = 0x600;
const POWER_OFF: u8 = (5 << 2) | (1 << 5);

pub unsafe fn outb(port: u16, v: u8) {
    asm!("out dx, al", in("dx") port, in("al") v, options(nomem, nostack, preserves_flags));
}

pub unsafe fn inb(port: u16) -> u8 {
    let v: u8;
    asm!("in al, dx", in("dx") port, out("al") v, options(nomem, nostack, preserves_flags));
    v
}

/// A received byte, if the UART has one (LSR bit 0).
pub fn serial_read() -> Option<u8> {
    unsafe { (inb(COM1 + 5) & 1 != 0).then(|| inb(COM1)) }
}

pub struct Serial;

impl core::fmt::Write for Serial {
    fn write_str(&mut self, s: &str) -> core::fmt::Result {
        for b in s.bytes() {
            unsafe {
                // Wait for the transmit holding register (LSR bit 5); a VMM's UART is
                // always ready, but a real 16550 is not.
                let mut spins = 0;
                while inb(COM1 + 5) & 0x20 == 0 && spins < 1000 {
                    spins += 1;
                }
                outb(COM1, b);
            }
        }
        Ok(())
    }
}

pub fn power_off() -> ! {
    unsafe { outb(POWER_PORT, POWER_OFF) };
    loop {
        unsafe { asm!("cli", "hlt") };
    }
}

/// Pulses the CPU reset line through the i8042 controller, as Linux's `reboot=k`.
/// Programs the legacy PIC pair as every operating system does first (vectors 0x20-0x2f, off
/// the CPU's exceptions) and masks all its lines: the probe takes interrupts through the
/// LAPIC only. Left unprogrammed, a PIC delivers any ISA interrupt a device raises (a
/// VMGenID notification after a restore, say) as a CPU exception.
pub fn mask_legacy_pic() {
    const ICW1_INIT_ICW4: u8 = 0x11;
    for (command, data, base, cascade) in
        [(0x20u16, 0x21u16, 0x20u8, 1u8 << 2), (0xa0, 0xa1, 0x28, 2)]
    {
        unsafe {
            outb(command, ICW1_INIT_ICW4);
            outb(data, base);
            outb(data, cascade);
            outb(data, 0x01); // ICW4: 8086 mode
            outb(data, 0xff); // OCW1: every line masked
        }
    }
}

pub fn i8042_reset() -> ! {
    unsafe { outb(0x64, 0xfe) };
    loop {
        unsafe { asm!("cli", "hlt") };
    }
}

/// Loads an empty IDT and raises #UD: the exception, then #DF, cannot be delivered, so the CPU
/// shuts down (triple fault).
pub fn triple_fault() -> ! {
    let idtr: [u16; 5] = [0; 5];
    unsafe {
        asm!("lidt [{}]", "ud2", in(reg) idtr.as_ptr(), options(noreturn));
    }
}

/// POPCNT, which the software-emulated KVM of CI machines cannot execute.
pub fn popcnt(v: u64) -> u64 {
    let r: u64;
    unsafe { asm!("popcnt {}, {}", out(reg) r, in(reg) v, options(nomem, nostack)) };
    r
}

pub mod paging {
    //! The probe's own identity map with 2 MiB pages (1 GiB pages need pdpe1gb, which a
    //! software-emulated KVM may not offer), up to 64 GiB so the memory test can reach RAM
    //! above the MMIO gap and the LAPIC is mapped for the SMP test.
    const MAX_GIB: usize = 64;

    #[repr(C, align(4096))]
    pub struct Table(pub [u64; 512]);

    static mut PML4: Table = Table([0; 512]);
    static mut PDPT: Table = Table([0; 512]);
    static mut PDS: [Table; MAX_GIB] = [const { Table([0; 512]) }; MAX_GIB];

    pub fn cr3() -> u64 {
        core::ptr::addr_of!(PML4) as u64
    }

    /// Maps [0, top) rounded up to whole GiB and switches CR3 to it.
    pub fn identity_map(top: u64) {
        let gib = (top.div_ceil(1 << 30) as usize).min(MAX_GIB);
        unsafe {
            let pml4 = &mut *core::ptr::addr_of_mut!(PML4);
            let pdpt = &mut *core::ptr::addr_of_mut!(PDPT);
            let pds = &mut *core::ptr::addr_of_mut!(PDS);
            pml4.0[0] = pdpt as *const Table as u64 | 0x3;
            for (g, pd) in pds.iter_mut().enumerate().take(gib) {
                pdpt.0[g] = pd as *const Table as u64 | 0x3;
                for (i, e) in pd.0.iter_mut().enumerate() {
                    *e = ((g as u64) << 30) | ((i as u64) << 21) | 0x83;
                }
            }
            core::arch::asm!("mov cr3, {}", in(reg) cr3(), options(nostack));
        }
    }
}
