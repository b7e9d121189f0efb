//! The probe guest: a few thousand instructions that check what the VMM gives a guest and print
//! one machine-readable line, `PROBE RESULT <test> OK|FAIL <details>`, then power off.
//!
//! It is entered like Linux through the 64-bit boot protocol: long mode, identity-mapped low
//! memory, RSI pointing at the zero page (boot_params) with the e820 map and command line.
//! It avoids instructions the software-emulated KVM of CI machines cannot run (see
//! ENVIRONMENT.md): no SSE/XSAVE (soft-float target), no POPCNT, no INT3 — except in the
//! tests that exist to hit them.

#![no_std]
#![no_main]

mod attack;
mod blk;
mod dhcp;
mod dirty;
mod fs;
mod genid;
mod hw;
mod net;
mod rng;
mod smp;
mod timer;
mod virtio;

use core::fmt::Write;
use core::panic::PanicInfo;

use hw::{power_off, Serial};

core::arch::global_asm!(
    ".section .text.start, \"ax\"",
    ".global _start",
    "_start:",
    "    cli",
    "    lea rsp, [rip + STACK_TOP]",
    "    mov rdi, rsi",
    "    call probe_main",
    "2:  hlt",
    "    jmp 2b",
);

/// Zero page offsets (Documentation/arch/x86/zero-page.rst).
const BP_E820_ENTRIES: usize = 0x1e8;
const BP_CMD_LINE_PTR: usize = 0x228;
const BP_E820_TABLE: usize = 0x2d0;
const E820_MAX: usize = 128;

#[derive(Clone, Copy, Default)]
pub struct E820 {
    pub addr: u64,
    pub size: u64,
    pub kind: u32,
}

pub struct BootInfo {
    pub e820: [E820; E820_MAX],
    pub e820_len: usize,
    pub cmdline: &'static str,
}

impl BootInfo {
    pub fn ram(&self) -> impl Iterator<Item = &E820> {
        self.e820[..self.e820_len].iter().filter(|e| e.kind == 1)
    }
    pub fn ram_top(&self) -> u64 {
        self.ram().map(|e| e.addr + e.size).max().unwrap_or(0)
    }
    pub fn param(&self, key: &str) -> Option<&'static str> {
        self.cmdline
            .split(' ')
            .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
    }
}

static mut BOOT: BootInfo = BootInfo {
    e820: [E820 {
        addr: 0,
        size: 0,
        kind: 0,
    }; E820_MAX],
    e820_len: 0,
    cmdline: "",
};

unsafe fn read_boot_info(zero_page: *const u8) -> &'static BootInfo {
    let boot = &mut *core::ptr::addr_of_mut!(BOOT);
    let n = (*zero_page.add(BP_E820_ENTRIES) as usize).min(E820_MAX);
    for i in 0..n {
        let p = zero_page.add(BP_E820_TABLE + i * 20);
        boot.e820[i] = E820 {
            addr: core::ptr::read_unaligned(p as *const u64),
            size: core::ptr::read_unaligned(p.add(8) as *const u64),
            kind: core::ptr::read_unaligned(p.add(16) as *const u32),
        };
    }
    boot.e820_len = sanitize_e820(&mut boot.e820[..n]);
    let ptr = core::ptr::read_unaligned(zero_page.add(BP_CMD_LINE_PTR) as *const u32) as *const u8;
    if !ptr.is_null() {
        let mut len = 0;
        while len < 4096 && *ptr.add(len) != 0 {
            len += 1;
        }
        boot.cmdline = core::str::from_utf8(core::slice::from_raw_parts(ptr, len)).unwrap_or("");
    }
    boot
}

/// Sorts the map by address, drops empty entries and merges adjacent or overlapping entries of
/// one kind, as Linux does with the map a boot loader gives it (Firecracker, for one, lists
/// its entries out of order); returns the entries kept, at the front of `map`. Overlapping
/// entries of different kinds are left for `check_e820` to refuse.
fn sanitize_e820(map: &mut [E820]) -> usize {
    // Insertion sort: a handful of entries, and no allocator here.
    for i in 1..map.len() {
        let mut j = i;
        while j > 0 && map[j - 1].addr > map[j].addr {
            map.swap(j - 1, j);
            j -= 1;
        }
    }
    let mut kept = 0;
    for i in 0..map.len() {
        let e = map[i];
        if e.size == 0 {
            continue;
        }
        if kept > 0 {
            let last = &mut map[kept - 1];
            let last_end = last.addr + last.size;
            if last.kind == e.kind && e.addr <= last_end {
                last.size = last_end.max(e.addr + e.size) - last.addr;
                continue;
            }
        }
        map[kept] = e;
        kept += 1;
    }
    kept
}

/// What the e820 map must look like for any guest this VMM builds: RAM from 0, RAM at 1 MiB
/// holding the probe, entries sorted and disjoint, nothing in the 3–4 GiB MMIO gap.
fn check_e820(b: &BootInfo) -> Result<(), &'static str> {
    if b.e820_len == 0 {
        return Err("e820 map is empty");
    }
    if !b.ram().any(|e| e.addr == 0) {
        return Err("no RAM at address 0");
    }
    let me = _start as *const () as u64;
    if !b.ram().any(|e| e.addr <= me && me < e.addr + e.size) {
        return Err("the probe's own load address is not in RAM");
    }
    let mut prev_end = 0;
    for e in &b.e820[..b.e820_len] {
        if e.addr < prev_end || e.size == 0 {
            return Err("e820 entries of different kinds overlap");
        }
        prev_end = e.addr + e.size;
        if e.kind == 1 && e.addr < 0x1_0000_0000 && prev_end > 0xc000_0000 {
            return Err("RAM inside the MMIO gap");
        }
    }
    Ok(())
}

extern "C" {
    fn _start();
    static PROBE_END: u8;
}

pub fn probe_end() -> u64 {
    core::ptr::addr_of!(PROBE_END) as u64
}

static mut TEST_NAME: &str = "unknown";

/// A fixed-size line buffer for building result details without an allocator.
pub struct Line {
    buf: [u8; 1024],
    len: usize,
}

impl Line {
    pub const fn new() -> Self {
        Line {
            buf: [0; 1024],
            len: 0,
        }
    }
    pub fn as_str(&self) -> &str {
        core::str::from_utf8(&self.buf[..self.len]).unwrap_or("?")
    }
}

impl Default for Line {
    fn default() -> Self {
        Self::new()
    }
}

impl Write for Line {
    fn write_str(&mut self, s: &str) -> core::fmt::Result {
        let n = s.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

pub fn result(ok: bool, details: core::fmt::Arguments) -> ! {
    let name = unsafe { TEST_NAME };
    genid::report();
    let _ = writeln!(
        Serial,
        "PROBE RESULT {} {} {}",
        name,
        if ok { "OK" } else { "FAIL" },
        details
    );
    power_off()
}

#[no_mangle]
/// # Safety
/// Called once from `_start` with the zero page the VMM put in RSI.
pub unsafe extern "C" fn probe_main(zero_page: *const u8) -> ! {
    let _ = writeln!(Serial, "microvirt probe guest: hello");
    let boot = unsafe { read_boot_info(zero_page) };
    hw::mask_legacy_pic();
    let test = boot.param("probe.test").unwrap_or("boot");
    unsafe { TEST_NAME = test };
    let ram_kib: u64 = boot.ram().map(|e| e.size).sum::<u64>() >> 10;
    let _ = writeln!(
        Serial,
        "probe: e820 entries={} ram_kib={} cmdline_len={}",
        boot.e820_len,
        ram_kib,
        boot.cmdline.len()
    );
    if let Err(e) = check_e820(boot) {
        result(false, format_args!("e820: {e}"));
    }
    hw::paging::identity_map(boot.ram_top().max(0x1_0000_0000));
    genid::report();
    match test {
        "boot" => result(
            true,
            format_args!(
                "e820={} ram_kib={} cmdline_len={}",
                boot.e820_len,
                ram_kib,
                boot.cmdline.len()
            ),
        ),
        "memory" => memory_test(boot),
        "smp" => smp::run(),
        "dirty" => dirty::run(boot),
        "timer" => timer::run(boot),
        "triplefault" => hw::triple_fault(),
        "popcnt" => {
            let n = hw::popcnt(0xf0f0);
            result(n == 8, format_args!("popcnt executed natively, result={n}"))
        }
        "reset" => hw::i8042_reset(),
        "console" => console_test(boot.param("probe.cad") == Some("reboot")),
        "flood" => flood_test(boot),
        "i8042flood" => i8042_flood_test(boot),
        "keyboard" => keyboard_test(),
        "blk" => blk::run(boot.cmdline),
        "discard" => blk::discard(boot.cmdline),
        "attack" => attack::run(boot.cmdline),
        "blkstream" => blk::stream(boot),
        "net" => net::run(boot.cmdline),
        "netloop" => net::loopback(boot.cmdline),
        "dhcp" => dhcp::run(boot.cmdline),
        "virtiofs" => fs::run(boot),
        "rng" => rng::run(boot.cmdline),
        other => result(false, format_args!("unknown test {other:?}")),
    }
}

/// Writes an address-dependent pattern at pages spread over every RAM region (and the last
/// word of each) above the probe itself, then verifies all of them. Bounded to a few thousand
/// writes per region so it stays cheap even where guest code runs slowly.
fn memory_test(boot: &BootInfo) -> ! {
    const PATTERN: u64 = 0xa5a5_5a5a_f00d_cafe;
    const WRITES_PER_REGION: u64 = 2048;
    let floor = (probe_end() + 0xfff) & !0xfff;
    let mut writes = 0u64;
    let mut above_4g = 0u64;
    let mut top = 0u64;
    let each = |f: &mut dyn FnMut(u64)| {
        for e in boot.ram() {
            let start = e.addr.max(floor);
            let end = e.addr + e.size;
            if start + 8 > end {
                continue;
            }
            let step = (((end - start) / WRITES_PER_REGION) & !0xfff).max(0x1000);
            let mut a = start;
            while a + 8 <= end {
                f(a);
                a += step;
            }
            f(end - 8);
        }
    };
    each(&mut |a| {
        unsafe { core::ptr::write_volatile(a as *mut u64, a ^ PATTERN) };
        writes += 1;
        if a >= 0x1_0000_0000 {
            above_4g += 1;
        }
        top = top.max(a + 8);
    });
    let mut bad = 0u64;
    let mut first_bad = 0u64;
    each(&mut |a| {
        let v = unsafe { core::ptr::read_volatile(a as *const u64) };
        if v != a ^ PATTERN {
            if bad == 0 {
                first_bad = a;
            }
            bad += 1;
        }
    });
    if bad > 0 {
        result(
            false,
            format_args!("mismatches={bad} first={first_bad:#x} writes={writes}"),
        );
    }
    result(
        true,
        format_args!("writes={writes} above_4g={above_4g} top={top:#x}"),
    )
}

/// `probe.bytes=N` (default 1 MiB) of numbered console lines as fast as the UART takes them,
/// then the result: a console client that never reads must not stop the guest.
fn flood_test(boot: &BootInfo) -> ! {
    let bytes: u64 = boot
        .param("probe.bytes")
        .and_then(|p| p.parse().ok())
        .unwrap_or(1 << 20);
    let mut sent = 0u64;
    let mut line = 0u64;
    while sent < bytes {
        // 64 bytes a line: "flood NNNNNNNNNN " and padding.
        let _ = writeln!(
            Serial,
            "flood {line:010} .............................................."
        );
        sent += 64;
        line += 1;
    }
    result(true, format_args!("lines={line} bytes={sent}"))
}

/// `out 0x60, 0xf2` (keyboard identify) `probe.writes=N` times (default 200000) without reading
/// the answers: the keyboard's buffer must stay bounded and the VM still migrate.
fn i8042_flood_test(boot: &BootInfo) -> ! {
    let writes: u64 = boot
        .param("probe.writes")
        .and_then(|p| p.parse().ok())
        .unwrap_or(200_000);
    for i in 0..writes {
        // SAFETY: port I/O to the keyboard controller; the probe owns the machine.
        unsafe { hw::outb(0x60, 0xf2) };
        if i % 50_000 == 0 {
            crate::genid::report();
            let _ = writeln!(Serial, "PROBE PROGRESS i8042flood writes={i}");
        }
    }
    result(true, format_args!("writes={writes}"))
}

/// Initialises the i8042 and keyboard the way Linux does, then waits for Ctrl-Alt-Del (the
/// host's graceful-shutdown request) and powers off when it arrives.
fn keyboard_test() -> ! {
    use hw::{inb, outb};
    let wait_out = || {
        for _ in 0..100_000 {
            if unsafe { inb(0x64) } & 1 != 0 {
                return Some(unsafe { inb(0x60) });
            }
        }
        None
    };
    unsafe { outb(0x64, 0xaa) };
    if wait_out() != Some(0x55) {
        result(false, format_args!("controller self-test failed"));
    }
    unsafe { outb(0x60, 0xff) };
    if (wait_out(), wait_out()) != (Some(0xfa), Some(0xaa)) {
        result(false, format_args!("keyboard reset failed"));
    }
    let _ = writeln!(Serial, "probe: keyboard ready");
    let mut seq = [0u8; 4];
    let mut keys = 0u32;
    loop {
        let Some(b) = wait_out() else { continue };
        keys += 1;
        seq = [seq[1], seq[2], seq[3], b];
        // Ctrl, Alt, Del (extended) make codes in the translated set 1.
        if seq == [0x1d, 0x38, 0xe0, 0x53] {
            result(true, format_args!("ctrl-alt-del after {keys} scancodes"));
        }
    }
}

/// Prints `tick N` lines while waiting for console input, echoes what arrives, and finishes
/// when a line ends: exercises serial input and gives the host a guest that runs until told.
/// With `probe.cad=reboot` it also reads the keyboard once per tick and, on Ctrl-Alt-Del,
/// reboots as Linux's init does (a reset through the keyboard controller).
fn console_test(reboot_on_cad: bool) -> ! {
    let mut line = [0u8; 64];
    let mut len = 0;
    let mut tick = 0u64;
    let mut keys = [0u8; 4];
    loop {
        // SAFETY: port I/O to the keyboard controller; the probe owns the machine.
        while reboot_on_cad && unsafe { hw::inb(0x64) } & 1 != 0 {
            keys = [keys[1], keys[2], keys[3], unsafe { hw::inb(0x60) }];
            // Ctrl, Alt, Del (extended) make codes in the translated set 1.
            if keys == [0x1d, 0x38, 0xe0, 0x53] {
                let _ = writeln!(Serial, "probe: ctrl-alt-del, rebooting");
                hw::i8042_reset();
            }
        }
        for _ in 0..20_000 {
            if let Some(b) = hw::serial_read() {
                if b == b'\n' || b == b'\r' {
                    let s = core::str::from_utf8(&line[..len]).unwrap_or("?");
                    result(true, format_args!("received={s} ticks={tick}"));
                }
                if len < line.len() {
                    line[len] = b;
                    len += 1;
                }
                let _ = writeln!(Serial, "echo {}", b as char);
            }
        }
        tick += 1;
        let _ = writeln!(Serial, "tick {tick}");
    }
}

#[panic_handler]
fn panic(info: &PanicInfo) -> ! {
    result(false, format_args!("panic: {}", info.message()))
}
