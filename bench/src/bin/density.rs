//! `cargo run --release -p bench --bin density-bench`: many idle VMs on one node, microvirt
//! and Firecracker (`../shared/anchors/firecracker`, or $FIRECRACKER) side by side in one run.
//!
//! Each VM is the probe guest's `timer` test (64 MiB, 1 vCPU): it takes the local APIC timer
//! at 100 Hz and halts between ticks — an idle guest whose VMM still has interrupts to
//! deliver. Per VMM: the time from the first spawn until every VM has printed its first
//! progress line (its timer runs), then, after the VMs settle, each process's own memory (RSS
//! and PSS without the guest-RAM mapping: what the VMM costs beyond the guest) and CPU (user +
//! system time over a measured interval, as a share of one core). `DENSITY_VMS` (100) sets N.
//! Firecracker runs without its seccomp filters (the anchor build has none), so its start-up
//! leaves that cost out.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bench::{env_or, firecracker_path, launcher_path, median, probe_guest};

const GUEST_MIB: u64 = 64;
/// `probe.ticks` is enough that no VM ends during the measurement (100 ticks a second).
const CMDLINE: &str = "console=ttyS0 probe.test=timer probe.ticks=10000000";
const SETTLE: Duration = Duration::from_secs(3);
const CPU_INTERVAL: Duration = Duration::from_secs(5);

struct Vmm {
    children: Vec<Child>,
    all_up: Duration,
}

impl Drop for Vmm {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts `n` VMs with `spawn`, then waits until each has printed a timer progress line.
fn start(name: &'static str, n: usize, spawn: impl Fn(usize) -> Result<Child>) -> Result<Vmm> {
    let t = Instant::now();
    let mut vmm = Vmm {
        children: Vec::new(),
        all_up: Duration::ZERO,
    };
    let (tx, rx) = std::sync::mpsc::channel();
    for i in 0..n {
        let mut child = spawn(i).with_context(|| format!("{name}: starting VM {i}"))?;
        let out = child.stdout.take().context("no stdout")?;
        let tx = tx.clone();
        std::thread::spawn(move || {
            // The first progress line says the timer runs; the rest of the console is read
            // and dropped so the VMM never blocks on a full pipe.
            let mut said = false;
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if !said && line.contains("PROBE PROGRESS timer") {
                    said = true;
                    let _ = tx.send(i);
                }
            }
        });
        vmm.children.push(child);
    }
    drop(tx);
    let deadline = Instant::now() + Duration::from_secs(60 + n as u64);
    for _ in 0..n {
        let left = deadline.saturating_duration_since(Instant::now());
        rx.recv_timeout(left)
            .with_context(|| format!("{name}: not every VM's timer ran within the deadline"))?;
    }
    vmm.all_up = t.elapsed();
    Ok(vmm)
}

/// RSS and PSS (KiB) of `pid`'s mappings other than guest RAM (anonymous or file mappings at
/// least as large as the guest).
fn own_memory(pid: u32) -> Result<(u64, u64)> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))?;
    let (mut rss, mut pss, mut skip) = (0u64, 0u64, false);
    for line in smaps.lines() {
        let mut it = line.split_whitespace();
        match (it.next(), it.next()) {
            (Some("Size:"), Some(v)) => skip = v.parse::<u64>()? >= GUEST_MIB * 1024,
            (Some("Rss:"), Some(v)) if !skip => rss += v.parse::<u64>()?,
            (Some("Pss:"), Some(v)) if !skip => pss += v.parse::<u64>()?,
            _ => {}
        }
    }
    Ok((rss, pss))
}

/// User + system clock ticks of `pid` and all its threads.
fn cpu_ticks(pid: u32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name may hold spaces: the fields start after its closing parenthesis.
    let rest = stat.rsplit_once(')').context("malformed stat")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    Ok(f[11].parse::<u64>()? + f[12].parse::<u64>()?)
}

struct Figures {
    all_up: Duration,
    rss_kib: f64,
    pss_kib: f64,
    cpu_percent: f64,
}

fn measure(vmm: &Vmm) -> Result<Figures> {
    std::thread::sleep(SETTLE);
    let pids: Vec<u32> = vmm.children.iter().map(|c| c.id()).collect();
    let before: Vec<u64> = pids.iter().map(|p| cpu_ticks(*p)).collect::<Result<_>>()?;
    std::thread::sleep(CPU_INTERVAL);
    let after: Vec<u64> = pids.iter().map(|p| cpu_ticks(*p)).collect::<Result<_>>()?;
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let cpu: Vec<f64> = before
        .iter()
        .zip(&after)
        .map(|(b, a)| (a - b) as f64 / hz / CPU_INTERVAL.as_secs_f64() * 100.0)
        .collect();
    let mem: Vec<(u64, u64)> = pids.iter().map(|p| own_memory(*p)).collect::<Result<_>>()?;
    Ok(Figures {
        all_up: vmm.all_up,
        rss_kib: median(mem.iter().map(|m| m.0 as f64).collect()),
        pss_kib: median(mem.iter().map(|m| m.1 as f64).collect()),
        cpu_percent: median(cpu),
    })
}

fn spawn_firecracker(fc: &Path, dir: &Path, probe: &Path, i: usize) -> Result<Child> {
    let config = dir.join(format!("fc-{i}.json"));
    bench::firecracker::write_config(&config, probe, None, CMDLINE, GUEST_MIB)?;
    Ok(Command::new(fc)
        .args([
            "--no-api",
            "--no-seccomp",
            "--log-path",
            "/dev/null",
            "--level",
            "Error",
        ])
        .arg("--config-file")
        .arg(&config)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?)
}

fn spawn_microvirt(launcher: &Path, probe: &Path) -> Result<Child> {
    Ok(Command::new(launcher)
        .arg("run")
        .arg("--kernel")
        .arg(probe)
        .args(["--memory", &GUEST_MIB.to_string(), "--cmdline", CMDLINE])
        .arg("--no-console-input")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?)
}

fn row(name: &str, f: &Figures) {
    println!(
        "| {name:<24} | {:>9.2} s | {:>8.2} MiB | {:>8.2} MiB | {:>8.2} % |",
        f.all_up.as_secs_f64(),
        f.rss_kib / 1024.0,
        f.pss_kib / 1024.0,
        f.cpu_percent
    );
}

fn main() -> Result<()> {
    let n = env_or("DENSITY_VMS", 100) as usize;
    let launcher = launcher_path()?;
    let probe = probe_guest()?;
    let dir = std::env::temp_dir().join(format!("microvirt-density-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    println!("{n} idle probe VMs (timer test, 100 Hz), {GUEST_MIB} MiB and 1 vCPU each, one VMM at a time\n");
    let microvirt = {
        let vmm = start("microvirt", n, |_| spawn_microvirt(&launcher, &probe))?;
        measure(&vmm)?
    };
    let fc = firecracker_path();
    let firecracker = if fc.exists() {
        let vmm = start("Firecracker", n, |i| {
            spawn_firecracker(&fc, &dir, &probe, i)
        })?;
        Some(measure(&vmm)?)
    } else {
        println!(
            "Firecracker not measured: {} does not exist (set $FIRECRACKER)\n",
            fc.display()
        );
        None
    };
    let _ = std::fs::remove_dir_all(&dir);
    println!("| VMM                      |   all running | own RSS / VM | own PSS / VM | CPU / idle VM |");
    println!("| ---                      | ---: | ---: | ---: | ---: |");
    row("microvirt virt-launcher", &microvirt);
    if let Some(f) = &firecracker {
        row("Firecracker 1.16.1", f);
        println!(
            "\nmicrovirt / Firecracker: all running {:.2}x, own RSS {:.2}x, own PSS {:.2}x, CPU {:.2}x",
            microvirt.all_up.as_secs_f64() / f.all_up.as_secs_f64(),
            microvirt.rss_kib / f.rss_kib,
            microvirt.pss_kib / f.pss_kib,
            microvirt.cpu_percent / f.cpu_percent.max(f64::MIN_POSITIVE),
        );
    }
    println!("\n(medians over the VMs; own = without the guest-RAM mapping; CPU over {CPU_INTERVAL:?} after {SETTLE:?} of settling)");
    Ok(())
}
