//! The dirty test: every vCPU rewrites its share of a working set spread over all of RAM (above
//! the MMIO gap too) with a per-pass pattern, verifying the previous pass first. A snapshot,
//! restore or migration that loses, tears or mixes up a page makes it fail, naming the address.
//!
//! `probe.passes=N` (default 8). Each pass touches `PAGES_PER_CPU` pages per vCPU, eight words
//! each (first and last word included): a few hundred thousand instructions, so a pass takes
//! well under a second even where guest code is emulated.

use core::fmt::Write;
use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::hw::Serial;
use crate::{probe_end, result, BootInfo};

const PAGES_PER_CPU: u64 = 1024;
const WORDS: u64 = 8;
const MAX_REGIONS: usize = 8;

static mut REGIONS: [(u64, u64); MAX_REGIONS] = [(0, 0); MAX_REGIONS];
static mut NREGIONS: usize = 0;
static mut STRIDE: u64 = 0;
static mut PASSES: u32 = 0;
static CPUS: AtomicU32 = AtomicU32::new(1);
/// Passes each vCPU has completed.
static DONE: [AtomicU32; 32] = [const { AtomicU32::new(0) }; 32];
/// First address whose content was wrong (0: none), and what was found there.
static BAD_ADDR: AtomicU64 = AtomicU64::new(0);
static BAD_VALUE: AtomicU64 = AtomicU64::new(0);

fn pattern(addr: u64, pass: u32) -> u64 {
    addr ^ (pass as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// The k-th page of the working set, counting through the RAM regions as one range.
fn page(k: u64) -> u64 {
    let (regions, n, stride) = unsafe { (&*core::ptr::addr_of!(REGIONS), NREGIONS, STRIDE) };
    let mut off = k * stride;
    for &(start, end) in &regions[..n] {
        let len = (end - start) & !0xfff;
        if off < len {
            return start + off;
        }
        off -= len;
    }
    regions[n - 1].0
}

/// One pass of vCPU `cpu` over its pages: verify pass-1's pattern, write pass's.
fn do_pass(cpu: u32, pass: u32) {
    let cpus = CPUS.load(Ordering::SeqCst) as u64;
    let mut k = cpu as u64;
    while k < PAGES_PER_CPU * cpus {
        let base = page(k);
        for w in 0..WORDS {
            // Words at every 512 bytes; the last one is the page's last word.
            let a = base + w * (4096 / WORDS) + if w == WORDS - 1 { 4096 / WORDS - 8 } else { 0 };
            let p = a as *mut u64;
            if pass > 0 {
                let v = unsafe { core::ptr::read_volatile(p) };
                if v != pattern(a, pass - 1)
                    && BAD_ADDR
                        .compare_exchange(0, a, Ordering::SeqCst, Ordering::SeqCst)
                        .is_ok()
                {
                    BAD_VALUE.store(v, Ordering::SeqCst);
                }
            }
            unsafe { core::ptr::write_volatile(p, pattern(a, pass)) };
        }
        k += cpus;
    }
    DONE[cpu as usize].store(pass + 1, Ordering::SeqCst);
}

fn work(cpu: u32) {
    for pass in 0..unsafe { PASSES } {
        do_pass(cpu, pass);
        if BAD_ADDR.load(Ordering::SeqCst) != 0 {
            return;
        }
    }
}

/// Ends the test with FAIL when any vCPU found a wrong word.
fn fail_if_bad(passes_done: u32) {
    let bad = BAD_ADDR.load(Ordering::SeqCst);
    if bad != 0 {
        let v = BAD_VALUE.load(Ordering::SeqCst);
        result(
            false,
            format_args!("first_bad={bad:#x} found={v:#x} passes_done={passes_done}"),
        );
    }
}

extern "C" fn ap_entry() -> ! {
    let cpu = crate::smp::check_in();
    // Wait until the BSP has counted everyone and laid out the working set.
    while unsafe { core::ptr::read_volatile(core::ptr::addr_of!(PASSES)) } == 0 {
        core::hint::spin_loop();
    }
    work(cpu);
    loop {
        unsafe { core::arch::asm!("cli", "hlt") };
    }
}

pub fn run(boot: &BootInfo) -> ! {
    let passes: u32 = boot
        .param("probe.passes")
        .and_then(|p| p.parse().ok())
        .unwrap_or(8)
        .max(1);
    let cpus = crate::smp::start_aps(ap_entry) as u32;
    CPUS.store(cpus, Ordering::SeqCst);
    let floor = (probe_end() + 0x1f_ffff) & !0x1f_ffff;
    let mut total = 0u64;
    unsafe {
        let regions = &mut *core::ptr::addr_of_mut!(REGIONS);
        for e in boot.ram() {
            let start = e.addr.max(floor);
            let end = e.addr + e.size;
            if start + 4096 <= end && NREGIONS < MAX_REGIONS {
                regions[NREGIONS] = (start, end);
                NREGIONS += 1;
                total += (end - start) & !0xfff;
            }
        }
        if NREGIONS == 0 {
            result(false, format_args!("no RAM above the probe"));
        }
        STRIDE = ((total / (PAGES_PER_CPU * cpus as u64)) & !0xfff).max(4096);
    }
    let top = page(PAGES_PER_CPU * cpus as u64 - 1);
    let _ = writeln!(
        Serial,
        "probe: dirty cpus={cpus} passes={passes} pages={} top_page={top:#x}",
        PAGES_PER_CPU * cpus as u64
    );
    unsafe { core::ptr::write_volatile(core::ptr::addr_of_mut!(PASSES), passes) };
    // The BSP works as vCPU 0 and reports each pass once every vCPU has finished it.
    let mut reported = 0;
    let mut own = 0;
    loop {
        fail_if_bad(reported);
        if own < passes {
            do_pass(0, own);
            own += 1;
        }
        let min = (0..cpus as usize)
            .map(|c| DONE[c].load(Ordering::SeqCst))
            .min()
            .unwrap_or(0);
        while reported < min {
            reported += 1;
            crate::genid::report();
            let _ = writeln!(Serial, "PROBE PROGRESS dirty pass={reported}");
        }
        if reported >= passes {
            break;
        }
        core::hint::spin_loop();
    }
    fail_if_bad(reported);
    result(
        true,
        format_args!(
            "passes={passes} cpus={cpus} pages={} top_page={top:#x}",
            PAGES_PER_CPU * cpus as u64
        ),
    )
}
