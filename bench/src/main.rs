//! `cargo run --release -p bench`: measures the VMM's own costs, not guest speed (guest code on a
//! software-emulated KVM is ~1000x slow and says nothing), with Firecracker (the anchor in
//! `../shared/anchors/`, or $FIRECRACKER) and QEMU microvm in the same run:
//!
//! - exec → first KVM_RUN for all three, booting the same Linux kernel and initrd (1 vCPU,
//!   256 MiB): a preloaded library (`kvm_run_stamp.c`) notes when each VMM first calls
//!   KVM_RUN, so no tracer slows one VMM more than another;
//! - microvirt's own boot timer (and how long the host takes to register its memory, which
//!   microvirt does on a thread of its own while it builds the rest),
//!   and exec → the probe guest's banner on the serial console;
//! - each VMM's RSS excluding guest RAM, a few seconds into booting.
//!
//! Prints a table with medians and ratios. Environment: BENCH_RUNS (default 15).

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
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

/// exec → the first KVM_RUN of `cmd`, in ms, from the stamp the preloaded library writes.
/// `cmd` runs until killed.
fn first_kvm_run(cmd: &[String]) -> Result<f64> {
    let stamp = std::env::temp_dir().join(format!("mv-bench-stamp-{}", std::process::id()));
    let _ = std::fs::remove_file(&stamp);
    let t0 = SystemTime::now();
    let mut child = Command::new(&cmd[0])
        .args(&cmd[1..])
        .env("LD_PRELOAD", env!("KVM_RUN_STAMP_SO"))
        .env("KVM_RUN_STAMP", &stamp)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(20);
    let result = loop {
        let text = std::fs::read_to_string(&stamp).unwrap_or_default();
        if let Ok(ns) = text.trim().parse::<u128>() {
            break Ok((ns.saturating_sub(unix_ns(t0))) as f64 / 1e6);
        }
        if Instant::now() > deadline {
            break Err(anyhow::anyhow!("no KVM_RUN from {cmd:?}"));
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    kill(&mut child);
    let _ = std::fs::remove_file(&stamp);
    result
}

fn kill(child: &mut Child) {
    // SIGKILL the whole strace/VMM tree: strace forwards nothing once it is gone.
    unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
    let _ = child.kill();
    let _ = child.wait();
}

/// RSS in KiB of all mappings of `pid` except guest RAM. Guest RAM is a run of adjacent
/// mappings, anonymous or of `guest_files` (kernel and initrd), at least as large as the
/// guest's memory: one anonymous mapping for a VMM that copies the kernel in, several for one
/// that maps the kernel's pages into guest RAM instead (microvirt does; those pages are the
/// guest's, not the VMM's).
fn rss_excluding_guest(pid: u32, guest_kib: u64, guest_files: &[PathBuf]) -> Result<u64> {
    struct Mapping {
        start: u64,
        end: u64,
        guest_like: bool,
        rss: u64,
    }
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))?;
    let names: Vec<String> = guest_files
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    let mut maps: Vec<Mapping> = Vec::new();
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        if let Some((start, end)) = first.split_once('-').filter(|_| !first.ends_with(':')) {
            // A mapping's header: "start-end perms offset dev inode [path]".
            let path = line.split_whitespace().nth(5).unwrap_or("");
            maps.push(Mapping {
                start: u64::from_str_radix(start, 16)?,
                end: u64::from_str_radix(end, 16)?,
                guest_like: path.is_empty() || names.iter().any(|n| n == path),
                rss: 0,
            });
        } else if first == "Rss:" {
            if let Some(m) = maps.last_mut() {
                m.rss = words.next().unwrap_or("0").parse()?;
            }
        }
    }
    let (mut total, mut i) = (0u64, 0);
    while i < maps.len() {
        let mut j = i + 1;
        if maps[i].guest_like {
            while j < maps.len() && maps[j].guest_like && maps[j].start == maps[j - 1].end {
                j += 1;
            }
        }
        let run_kib = (maps[j - 1].end - maps[i].start) / 1024;
        if !(maps[i].guest_like && run_kib >= guest_kib) {
            total += maps[i..j].iter().map(|m| m.rss).sum::<u64>();
        }
        i = j;
    }
    Ok(total)
}

/// Starts `cmd`, waits `settle`, samples its RSS excluding guest RAM.
fn rss_after(cmd: &[String], settle: Duration, guest_files: &[PathBuf]) -> Result<u64> {
    let mut child = Command::new(&cmd[0])
        .args(&cmd[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()?;
    std::thread::sleep(settle);
    let r = rss_excluding_guest(child.id(), GUEST_MIB * 1024, guest_files);
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
    let fc = bench::firecracker_path();
    if !fc.exists() {
        anyhow::bail!("no Firecracker at {} (set FIRECRACKER)", fc.display());
    }
    let (guest, profile, kvm_emulated) = bench::linux_guest()?;
    let initrd = tests::build_guest_image(&["linux", profile]).remove(1);
    let dir = tempdir()?;
    let vmms = commands(&launcher, &fc, &guest, &initrd, &dir)?;

    let (mut first_run, mut memslots, mut banner) = (vec![], vec![], vec![]);
    let mut to_run = vec![Vec::new(); vmms.len()];
    for _ in 0..runs {
        let (f, m, b) = microvirt_startup(&launcher, &probe)?;
        first_run.push(f);
        memslots.push(m);
        banner.push(b);
        for (samples, (_, cmd)) in to_run.iter_mut().zip(&vmms) {
            samples.push(first_kvm_run(cmd)?);
        }
    }
    let settle = Duration::from_secs(3);
    let guest_files = [guest.kernel.clone(), initrd.clone()];
    let mut rss = vec![Vec::new(); vmms.len()];
    for _ in 0..3 {
        for (samples, (_, cmd)) in rss.iter_mut().zip(&vmms) {
            samples.push(rss_after(cmd, settle, &guest_files)? as f64 / 1024.0);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let to_run: Vec<f64> = to_run.into_iter().map(median).collect();
    let rss: Vec<f64> = rss.into_iter().map(median).collect();
    let (f, m, b) = (median(first_run), median(memslots), median(banner));

    println!(
        "microvirt benchmark: {runs} runs per start-up figure (medians), 3 RSS samples, guest {GUEST_MIB} MiB, KVM {}",
        if kvm_emulated { "software-emulated" } else { "hardware" }
    );
    println!(
        "| metric | microvirt | Firecracker | QEMU microvm | microvirt / Firecracker | target |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | --- |");
    println!(
        "| exec → first KVM_RUN (Linux guest, preloaded stamp) | {:.2} ms | {:.2} ms | {:.2} ms | {:.2}× | ≤ 0.5× |",
        to_run[0], to_run[1], to_run[2], to_run[0] / to_run[1]
    );
    println!(
        "| own RSS: total minus guest RAM (Linux booting) | {:.2} MiB | {:.2} MiB | {:.2} MiB | {:.2}× | ≤ 3 MiB |",
        rss[0], rss[1], rss[2], rss[0] / rss[1]
    );
    println!("| exec → first KVM_RUN (microvirt's boot timer, probe guest) | {f:.2} ms | – | – | – | – |");
    println!(
        "| KVM memory registration (host time, on a thread of its own beside the rest) | {m:.2} ms | – | – | – | – |"
    );
    println!("| exec → probe banner on serial | {b:.2} ms | – | – | – | – |");
    Ok(())
}

fn tempdir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("mv-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// The three VMMs booting the same kernel, initrd and command line: microvirt, Firecracker
/// (from a config file, no API socket; its anchor build has no seccomp filters to install),
/// QEMU microvm.
fn commands(
    launcher: &Path,
    fc: &Path,
    guest: &bench::Guest,
    initrd: &Path,
    dir: &Path,
) -> Result<Vec<(&'static str, Vec<String>)>> {
    let s = |p: &Path| p.display().to_string();
    let mem = GUEST_MIB.to_string();
    let fc_config = dir.join("fc.json");
    bench::firecracker::write_config(
        &fc_config,
        &guest.kernel,
        Some(initrd),
        &guest.cmdline,
        GUEST_MIB,
    )?;
    let words = |v: &[&str]| v.iter().map(|w| w.to_string()).collect::<Vec<_>>();
    let mut microvirt = vec![s(launcher)];
    microvirt.extend(words(&[
        "run",
        "--no-console-input",
        "--console-log",
        "/dev/null",
        "--memory",
        &mem,
        "--kernel",
        &s(&guest.kernel),
        "--initrd",
        &s(initrd),
        "--cmdline",
        &guest.cmdline,
    ]));
    let mut firecracker = vec![s(fc)];
    firecracker.extend(words(&[
        "--no-api",
        "--no-seccomp",
        "--config-file",
        &s(&fc_config),
        "--log-path",
        "/dev/null",
        "--level",
        "Error",
    ]));
    let qemu = words(&[
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
        &s(&guest.kernel),
        "-initrd",
        &s(initrd),
        "-append",
        &guest.cmdline,
    ]);
    Ok(vec![
        ("microvirt", microvirt),
        ("firecracker", firecracker),
        ("qemu", qemu),
    ])
}
