//! `cargo run --release -p bench --bin snapshot-bench`: snapshot and restore costs of microvirt
//! and Firecracker (`../shared/anchors/firecracker`, or $FIRECRACKER) side by side in one run,
//! on the same Linux kernel and command line, for 256 MiB, 1 GiB and 4 GiB guests.
//!
//! Each VMM boots the kernel, runs it for a moment (BENCH_SETTLE_MS, default 3000), snapshots it
//! paused, is killed, and a fresh process restores the snapshot:
//! - snapshot: the time the guest is paused for the snapshot, pause included (microvirt's
//!   `snapshot --stop` answer; Firecracker: PATCH /vm Paused sent → PUT /snapshot/create
//!   answered);
//! - restore: process spawn → the guest running again (microvirt: its first KVM_RUN, from the
//!   boot timer; Firecracker: PUT /snapshot/load with resume_vm answered, which it sends once its
//!   vCPU threads have acknowledged the resume);
//! - state file size, and the memory file's apparent and allocated sizes.
//!
//! Live migration is measured by `migration-bench` (against QEMU: Firecracker has none).
//!
//! Medians of BENCH_RUNS (default 3) runs. Guest speed means nothing on a software-emulated
//! host; these are the VMMs' own costs.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use bench::{
    boot_timer_line, env_or, firecracker, kill, launcher_path, linux_guest, median,
    microvirt_snapshot, wait_for_path, BootTimerLine, Guest,
};

#[derive(Default, Clone, Copy)]
struct Sample {
    snapshot_ms: f64,
    restore_ms: f64,
    /// KVM_SET_USER_MEMORY_REGION time inside the restore (microvirt reports it): the host
    /// KVM's cost, milliseconds on a software-emulated host, which every VMM pays alike.
    memslots_ms: f64,
    state_bytes: u64,
    mem_apparent: u64,
    mem_allocated: u64,
}

fn sizes(state: &Path, memory: &Path) -> Result<(u64, u64, u64)> {
    let s = std::fs::metadata(state)?;
    let m = std::fs::metadata(memory)?;
    Ok((s.len(), m.len(), m.blocks() * 512))
}

fn microvirt(launcher: &Path, g: &Guest, mib: u64, dir: &Path, settle: Duration) -> Result<Sample> {
    let sock = dir.join("mv.sock");
    let snap = dir.join("mv-snap");
    let _ = std::fs::remove_dir_all(&snap);
    let child = Command::new(launcher)
        .args(["run", "--no-console-input", "--console-log", "/dev/null"])
        .arg("--kernel")
        .arg(&g.kernel)
        .args(["--cmdline", &g.cmdline, "--memory", &mib.to_string()])
        .arg("--socket")
        .arg(&sock)
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    wait_for_path(&sock)?;
    std::thread::sleep(settle);
    let stderr = microvirt_snapshot(launcher, &sock, &snap);
    kill(child);
    let stderr = stderr?;
    let snapshot_ms: f64 = stderr
        .split("guest paused ")
        .nth(1)
        .and_then(|s| s.split(" ms").next())
        .context("no paused time in the snapshot answer")?
        .parse()?;
    let t0 = SystemTime::now();
    let mut child = Command::new(launcher)
        .args([
            "restore",
            "--boot-timer",
            "--no-console-input",
            "--console-log",
            "/dev/null",
        ])
        .arg("--from")
        .arg(&snap)
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let (mut first_run, mut memslots_ns) = (None, 0u128);
    for line in BufReader::new(child.stderr.take().unwrap()).lines() {
        match boot_timer_line(&line?) {
            BootTimerLine::MemorySlots(ns) => memslots_ns = ns,
            BootTimerLine::FirstRun(ns) => {
                first_run = Some(ns);
                break;
            }
            BootTimerLine::Other => {}
        }
    }
    kill(child);
    let start = t0.duration_since(UNIX_EPOCH)?.as_nanos();
    let restore_ms = (first_run.context("no first KVM_RUN after restore")? - start) as f64 / 1e6;
    let (state_bytes, mem_apparent, mem_allocated) =
        sizes(&snap.join("state"), &snap.join("memory"))?;
    Ok(Sample {
        snapshot_ms,
        restore_ms,
        memslots_ms: memslots_ns as f64 / 1e6,
        state_bytes,
        mem_apparent,
        mem_allocated,
    })
}

fn firecracker(fc: &Path, g: &Guest, mib: u64, dir: &Path, settle: Duration) -> Result<Sample> {
    let state = dir.join("fc-state");
    let memory = dir.join("fc-memory");
    for p in [&state, &memory] {
        let _ = std::fs::remove_file(p);
    }
    let snapshot_ms = fc_snapshot(fc, g, mib, dir, settle, &state, &memory)?;
    let restore_ms = fc_restore(fc, dir, &state, &memory)?;
    let (state_bytes, mem_apparent, mem_allocated) = sizes(&state, &memory)?;
    Ok(Sample {
        snapshot_ms,
        restore_ms,
        memslots_ms: 0.0,
        state_bytes,
        mem_apparent,
        mem_allocated,
    })
}

/// Boots the guest, lets it settle, and snapshots it. Timed on microvirt's boundary: from
/// the pause request (Firecracker's is a call of its own, PATCH /vm Paused) until the snapshot
/// is written (PUT /snapshot/create answered), the guest paused throughout.
fn fc_snapshot(
    fc: &Path,
    g: &Guest,
    mib: u64,
    dir: &Path,
    settle: Duration,
    state: &Path,
    memory: &Path,
) -> Result<f64> {
    let sock = dir.join("fc.sock");
    let _ = std::fs::remove_file(&sock);
    let config = dir.join("fc.json");
    firecracker::write_config(&config, &g.kernel, None, &g.cmdline, mib)?;
    let child = Command::new(fc)
        .arg("--api-sock")
        .arg(&sock)
        .arg("--config-file")
        .arg(&config)
        .args(firecracker::QUIET)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    wait_for_path(&sock)?;
    std::thread::sleep(settle);
    let t = Instant::now();
    firecracker::create_snapshot(&sock, state, memory)?;
    let snapshot_ms = t.elapsed().as_secs_f64() * 1e3;
    kill(child);
    Ok(snapshot_ms)
}

/// Spawn → the guest running again: until PUT /snapshot/load with `resume_vm` is answered.
/// Firecracker answers after its vCPU threads have acknowledged the resume, the point just
/// before their KVM_RUN; microvirt's figure ends at its first KVM_RUN itself, so the two end
/// within one vCPU thread's wake-up of each other, microvirt's the later.
fn fc_restore(fc: &Path, dir: &Path, state: &Path, memory: &Path) -> Result<f64> {
    let sock = dir.join("fc2.sock");
    let _ = std::fs::remove_file(&sock);
    let t = Instant::now();
    let child = Command::new(fc)
        .arg("--api-sock")
        .arg(&sock)
        .args(firecracker::QUIET)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    firecracker::wait_accepting(&sock)?;
    let loaded = firecracker::load_snapshot(&sock, state, memory);
    let restore_ms = t.elapsed().as_secs_f64() * 1e3;
    kill(child);
    loaded?;
    Ok(restore_ms)
}

fn main() -> Result<()> {
    let runs = env_or("BENCH_RUNS", 3).max(1) as usize;
    let settle = Duration::from_millis(env_or("BENCH_SETTLE_MS", 3000));
    let launcher = launcher_path()?;
    let fc = bench::firecracker_path();
    if !fc.exists() {
        bail!("no Firecracker at {} (set FIRECRACKER)", fc.display());
    }
    let (guest, profile, emulated) = linux_guest()?;
    let dir = std::env::temp_dir().join(format!("mv-snapshot-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;

    println!("snapshot/restore, Linux guest ({profile} kernel), 1 vCPU, {runs} runs each, medians; KVM {}\n",
        if emulated { "software-emulated" } else { "hardware" });
    println!("| guest | VMM | snapshot (guest paused) | restore (spawn → guest running) | of which KVM memory slots | state file | memory file (apparent / allocated) |");
    println!("| ---: | --- | ---: | ---: | ---: | ---: | ---: |");
    for mib in [256u64, 1024, 4096] {
        let (mut mv, mut f) = (Vec::new(), Vec::new());
        for _ in 0..runs {
            mv.push(microvirt(&launcher, &guest, mib, &dir, settle)?);
            f.push(firecracker(&fc, &guest, mib, &dir, settle)?);
        }
        let row = |name: &str, s: &[Sample]| {
            let last = s[s.len() - 1];
            let slots = median(s.iter().map(|x| x.memslots_ms).collect());
            println!(
                "| {mib} MiB | {name} | {:.1} ms | {:.2} ms | {} | {:.1} KiB | {} MiB / {:.1} MiB |",
                median(s.iter().map(|x| x.snapshot_ms).collect()),
                median(s.iter().map(|x| x.restore_ms).collect()),
                if slots > 0.0 { format!("{slots:.2} ms") } else { "not reported".into() },
                last.state_bytes as f64 / 1024.0,
                last.mem_apparent >> 20,
                last.mem_allocated as f64 / (1 << 20) as f64,
            );
        };
        row("microvirt", &mv);
        row("Firecracker 1.16.1", &f);
        let ratio = |a: &[Sample], b: &[Sample], g: fn(&Sample) -> f64| {
            median(a.iter().map(g).collect()) / median(b.iter().map(g).collect())
        };
        println!(
            "| {mib} MiB | ratio microvirt/Firecracker | {:.2}× | {:.2}× | | {:.2}× | allocated {:.3}× |",
            ratio(&mv, &f, |s| s.snapshot_ms),
            ratio(&mv, &f, |s| s.restore_ms),
            mv[0].state_bytes as f64 / f[0].state_bytes as f64,
            mv[0].mem_allocated as f64 / f[0].mem_allocated.max(1) as f64,
        );
    }
    println!("\nmicrovirt's restore without the host's memory-slot time is the VMM's own cost (target ≤ 5 ms at 256 MiB, flat in guest size).");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
