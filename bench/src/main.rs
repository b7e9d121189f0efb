//! `cargo run --release -p bench`: measures the VMM's own costs, not guest speed (guest code on a
//! software-emulated KVM is ~1000x slow and says nothing), and QEMU's in the same run:
//!
//! - exec → first KVM_RUN: microvirt's boot timer; and for both VMMs from `strace -ttt` (strace
//!   slows both, so only that pair is compared);
//! - exec → probe banner on the serial console (microvirt);
//! - VMM RSS excluding guest RAM, a few seconds into booting the same Linux kernel.
//!
//! Prints a table with medians and ratios. Environment: BENCH_RUNS (default 15).

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use bench::{launcher_path, median};

const GUEST_MIB: u64 = 256;

fn unix_ns(t: SystemTime) -> u128 {
    t.duration_since(UNIX_EPOCH).unwrap().as_nanos()
}

/// exec → first KVM_RUN (boot timer), time spent registering memory with KVM, and exec →
/// banner, in ms.
fn microvirt_startup(launcher: &Path, probe: &Path) -> Result<(f64, f64, f64)> {
    let t0 = SystemTime::now();
    let start = Instant::now();
    let mut child = Command::new(launcher)
        .args([
            "run",
            "--boot-timer",
            "--no-console-input",
            "--memory",
            "128",
            "--cmdline",
            "probe.test=boot",
            "--kernel",
        ])
        .arg(probe)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut banner = None;
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        if line?.contains("microvirt probe guest: hello") && banner.is_none() {
            banner = Some(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    let out = child.wait_with_output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    let ns: u128 = stderr
        .lines()
        .find_map(|l| l.split("first KVM_RUN unix_ns=").nth(1))
        .context("no boot-timer line")?
        .trim()
        .parse()?;
    let first_run = (ns - unix_ns(t0)) as f64 / 1e6;
    let memslots: u128 = stderr
        .lines()
        .find_map(|l| l.split("memory slots ns=").nth(1))
        .context("no memory-slots line")?
        .trim()
        .parse()?;
    Ok((
        first_run,
        memslots as f64 / 1e6,
        banner.context("no banner")?,
    ))
}

/// exec → first KVM_RUN ioctl as strace sees it, in ms. `cmd` runs until killed.
fn strace_first_kvm_run(cmd: &[&str]) -> Result<f64> {
    let log = std::env::temp_dir().join(format!("mv-bench-strace-{}.log", std::process::id()));
    let mut child = Command::new("strace")
        .args([
            "-f",
            "-ttt",
            "-e",
            "trace=execve,ioctl",
            "-e",
            "signal=none",
            "-o",
        ])
        .arg(&log)
        .args(cmd)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(20);
    let result = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let ts = |l: &str| -> Option<f64> { l.split_whitespace().nth(1)?.parse().ok() };
        let exec = text.lines().find(|l| l.contains("execve(")).and_then(ts);
        let run = text.lines().find(|l| l.contains("KVM_RUN")).and_then(ts);
        if let (Some(e), Some(r)) = (exec, run) {
            break Ok((r - e) * 1e3);
        }
        if Instant::now() > deadline {
            break Err(anyhow::anyhow!("no KVM_RUN seen for {cmd:?}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    kill(&mut child);
    let _ = std::fs::remove_file(&log);
    result
}

fn kill(child: &mut Child) {
    // SIGKILL the whole strace/VMM tree: strace forwards nothing once it is gone.
    unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
    let _ = child.kill();
    let _ = child.wait();
}

/// RSS in KiB of all mappings of `pid` except guest RAM (anonymous mappings at least as large
/// as the guest's memory).
fn rss_excluding_guest(pid: u32, guest_kib: u64) -> Result<u64> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))?;
    let (mut total, mut skip) = (0u64, false);
    for line in smaps.lines() {
        let mut it = line.split_whitespace();
        match (it.next(), it.next()) {
            (Some("Size:"), Some(v)) => {
                skip = v.parse::<u64>()? >= guest_kib;
            }
            (Some("Rss:"), Some(v)) if !skip => total += v.parse::<u64>()?,
            _ => {}
        }
    }
    Ok(total)
}

/// Starts `cmd`, waits `settle`, samples its RSS excluding guest RAM.
fn rss_after(cmd: &[&str], settle: Duration) -> Result<u64> {
    let mut child = Command::new(cmd[0])
        .args(&cmd[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()?;
    std::thread::sleep(settle);
    let r = rss_excluding_guest(child.id(), GUEST_MIB * 1024);
    kill(&mut child);
    r
}

fn main() -> Result<()> {
    let runs: usize = std::env::var("BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15);
    let launcher = launcher_path()?;
    let probe = tests::probe_path();
    let kvm_emulated = std::fs::read_to_string("/proc/cpuinfo")
        .map(|c| !c.split_whitespace().any(|f| f == "vmx" || f == "svm"))
        .unwrap_or(false);
    let profile = if kvm_emulated {
        "emulated-kvm"
    } else {
        "production"
    };
    let images = tests::build_guest_image(&["linux", profile]);
    let (vmlinux, initrd) = (
        images[0].to_str().unwrap().to_string(),
        images[1].to_str().unwrap().to_string(),
    );
    let mem = GUEST_MIB.to_string();
    let cmdline = "console=ttyS0 reboot=k panic=-1";
    let launcher_s = launcher.to_str().unwrap();
    let mv_linux: Vec<&str> = vec![
        launcher_s,
        "run",
        "--no-console-input",
        "--console-log",
        "/dev/null",
        "--memory",
        &mem,
        "--kernel",
        &vmlinux,
        "--initrd",
        &initrd,
        "--cmdline",
        cmdline,
    ];
    let qemu_linux: Vec<&str> = vec![
        "qemu-system-x86_64",
        "-M",
        "microvm",
        "-enable-kvm",
        "-cpu",
        // Without arch-capabilities, an MSR a software-emulated KVM refuses (QEMU aborts on
        // MSR 0x10a on such a host otherwise), as migration-bench does.
        "host,-arch-capabilities",
        "-m",
        &mem,
        "-smp",
        "1",
        "-nodefaults",
        "-no-user-config",
        "-nographic",
        "-serial",
        "null",
        "-monitor",
        "none",
        "-kernel",
        &vmlinux,
        "-initrd",
        &initrd,
        "-append",
        cmdline,
    ];

    let (mut first_run, mut own, mut banner) = (vec![], vec![], vec![]);
    let (mut mv_strace, mut qemu_strace) = (vec![], vec![]);
    for _ in 0..runs {
        let (f, m, b) = microvirt_startup(&launcher, &probe)?;
        first_run.push(f);
        own.push(f - m);
        banner.push(b);
        mv_strace.push(strace_first_kvm_run(&mv_linux)?);
        qemu_strace.push(strace_first_kvm_run(&qemu_linux)?);
    }
    let settle = Duration::from_secs(3);
    let (mut mv_rss, mut qemu_rss) = (vec![], vec![]);
    for _ in 0..3 {
        mv_rss.push(rss_after(&mv_linux, settle)? as f64);
        qemu_rss.push(rss_after(&qemu_linux, settle)? as f64);
    }
    let (f, o, b, ms, qs) = (
        median(first_run),
        median(own),
        median(banner),
        median(mv_strace),
        median(qemu_strace),
    );
    let (mr, qr) = (median(mv_rss) / 1024.0, median(qemu_rss) / 1024.0);

    println!("microvirt benchmark: {runs} runs per start-up figure (medians), 3 RSS samples, guest {GUEST_MIB} MiB, KVM {}",
        if kvm_emulated { "software-emulated" } else { "hardware" });
    println!("| metric | microvirt | QEMU microvm | QEMU / microvirt | target |");
    println!("| --- | ---: | ---: | ---: | --- |");
    println!("| exec → first KVM_RUN (boot timer) | {f:.2} ms | – | – | – |");
    println!(
        "| … excluding the host's KVM_SET_USER_MEMORY_REGION time | {o:.2} ms | – | – | ≤ 5 ms |"
    );
    println!(
        "| exec → first KVM_RUN (strace, Linux guest) | {ms:.2} ms | {qs:.2} ms | {:.1}× | – |",
        qs / ms
    );
    println!("| exec → probe banner on serial | {b:.2} ms | – | – | – |");
    println!("| VMM RSS excluding guest RAM (Linux booting) | {mr:.2} MiB | {qr:.2} MiB | {:.1}× | ≤ 4 MiB |", qr / mr);
    Ok(())
}
