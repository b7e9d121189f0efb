//! `cargo run --release -p bench --bin sandbox-bench`: sandboxes started from one memory
//! snapshot instead of booting, side by side in one run: N restores of one microvirt snapshot,
//! N Firecracker restores of a snapshot of the same guest (`../shared/anchors/firecracker`, or
//! $FIRECRACKER), and N cold boots of that guest under microvirt.
//!
//! The guest is the probe's timer test in 256 MiB with a warmed-up working set
//! (`probe.warm`, SANDBOX_WARM_MIB = 64 MiB written, one word a page) idling on a 100 Hz timer:
//! what a sandbox service snapshots once its runtime is loaded. Each VMM snapshots it once its
//! timer runs. Then N VMs (SANDBOX_VMS, 100) are started back to back, each spawned as soon as
//! the one before it was, as a pool scaling up would, and per VM:
//! - ready: spawn → the guest running in its warmed-up state. A microvirt restore: its first
//!   KVM_RUN (the launcher's boot timer), with the host's memory-slot registration inside it
//!   reported apart; a Firecracker restore: PUT /snapshot/load with `resume_vm` answered (sent
//!   once its vCPU threads acknowledged the resume); a cold boot: the probe's `timer armed`
//!   line read from the console (its working set written, as the snapshot holds it).
//! - liveness: no VM counts until its console shows a timer progress line after the start.
//! - memory: once all run and have settled, the PSS of every VMM process summed — the node's
//!   memory for the fleet, pages shared through one snapshot file counted once.
//!
//! Before each fleet, SANDBOX_SINGLE (5) starts of one VM alone give the uncontended figure.
//! On this 2-core machine a fleet's per-VM times include waiting for a core.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, ChildStdout, Command, Stdio};
use std::sync::mpsc::{channel, Sender};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use bench::{
    boot_timer_line, env_or, firecracker, firecracker_path, kill, launcher_path, median,
    microvirt_snapshot, probe_guest, wait_for_path, BootTimerLine,
};

const GUEST_MIB: u64 = 256;
const SETTLE: Duration = Duration::from_secs(3);

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock before 1970")
        .as_nanos()
}

/// The guest every VM runs: warm, then tick for far longer than the bench lasts.
fn cmdline(warm_mib: u64) -> String {
    format!("console=ttyS0 probe.test=timer probe.ticks=100000000 probe.warm={warm_mib}")
}

/// What a VM's watcher threads report.
enum Event {
    /// The guest runs in its warmed-up state: when (Unix ns), and the host's memory-slot
    /// registration time inside its start where the VMM reports it.
    Ready {
        vm: usize,
        at_ns: u128,
        slots_ns: Option<u128>,
    },
    /// The guest printed a timer progress line after its start.
    Live,
}

/// Forwards the first console line containing `marker` as `Live`, then drains the console so
/// the VMM never blocks on a full pipe.
fn watch_console(
    out: ChildStdout,
    vm: usize,
    tx: Sender<Event>,
    ready_marker: Option<&'static str>,
) {
    std::thread::spawn(move || {
        let (mut ready, mut live) = (ready_marker.is_none(), false);
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if !ready && line.contains(ready_marker.unwrap_or_default()) {
                ready = true;
                let _ = tx.send(Event::Ready {
                    vm,
                    at_ns: now_ns(),
                    slots_ns: None,
                });
            }
            if !live && line.contains("PROBE PROGRESS timer") {
                live = true;
                let _ = tx.send(Event::Live);
            }
        }
    });
}

/// Reads microvirt's boot timer lines: the memory-slot time and the first KVM_RUN.
fn watch_boot_timer(err: ChildStderr, vm: usize, tx: Sender<Event>) {
    std::thread::spawn(move || {
        let mut slots_ns = None;
        let mut said = false;
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            match boot_timer_line(&line) {
                BootTimerLine::MemorySlots(ns) => slots_ns = Some(ns),
                BootTimerLine::FirstRun(at_ns) if !said => {
                    said = true;
                    let _ = tx.send(Event::Ready {
                        vm,
                        at_ns,
                        slots_ns,
                    });
                }
                _ => {}
            }
        }
    });
}

/// N VMs started back to back, and what was measured of them.
struct Fleet {
    children: Vec<Child>,
    /// Spawn → ready per VM, milliseconds.
    ready_ms: Vec<f64>,
    slots_ms: Vec<f64>,
    /// First spawn → last VM ready.
    all_ready: Duration,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for c in self.children.drain(..) {
            kill(c);
        }
    }
}

/// Starts `n` VMs with `spawn` (which wires its watchers to the sender) and waits until every
/// one is ready and live.
fn start_fleet(
    name: &str,
    n: usize,
    spawn: &dyn Fn(usize, Sender<Event>) -> Result<Child>,
) -> Result<Fleet> {
    let (tx, rx) = channel();
    let t0 = now_ns();
    let mut fleet = Fleet {
        children: Vec::with_capacity(n),
        ready_ms: Vec::new(),
        slots_ms: Vec::new(),
        all_ready: Duration::ZERO,
    };
    let mut spawned = Vec::with_capacity(n);
    for vm in 0..n {
        spawned.push(now_ns());
        let child = spawn(vm, tx.clone()).with_context(|| format!("{name}: starting VM {vm}"))?;
        fleet.children.push(child);
    }
    drop(tx);
    let deadline = std::time::Instant::now() + Duration::from_secs(60 + n as u64);
    let (mut ready, mut live, mut last) = (0, 0, t0);
    while ready < n || live < n {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let event = rx.recv_timeout(left).with_context(|| {
            format!("{name}: {ready} of {n} VMs ready and {live} live within the deadline")
        })?;
        match event {
            Event::Ready {
                vm,
                at_ns,
                slots_ns,
            } => {
                ready += 1;
                last = last.max(at_ns);
                fleet
                    .ready_ms
                    .push(at_ns.saturating_sub(spawned[vm]) as f64 / 1e6);
                if let Some(s) = slots_ns {
                    fleet.slots_ms.push(s as f64 / 1e6);
                }
            }
            Event::Live => live += 1,
        }
    }
    fleet.all_ready = Duration::from_nanos((last - t0) as u64);
    Ok(fleet)
}

/// The PSS of every process of the fleet, summed (KiB).
fn pss_kib(fleet: &Fleet) -> Result<u64> {
    let mut sum = 0;
    for c in &fleet.children {
        let rollup = std::fs::read_to_string(format!("/proc/{}/smaps_rollup", c.id()))
            .with_context(|| format!("VMM process {} is gone", c.id()))?;
        let pss = rollup
            .lines()
            .find_map(|l| l.strip_prefix("Pss:"))
            .context("no Pss in smaps_rollup")?;
        sum += pss.trim().trim_end_matches("kB").trim().parse::<u64>()?;
    }
    Ok(sum)
}

fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1]
}

/// Reads a console until the probe's timer runs, then drains it in the background.
fn wait_for_timer(out: ChildStdout, what: &str) -> Result<()> {
    let mut lines = BufReader::new(out).lines();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let line = lines
            .next()
            .with_context(|| format!("{what}: the console ended before the timer ran"))??;
        if line.contains("PROBE RESULT") {
            bail!("{what}: the probe ended: {line}");
        }
        if line.contains("PROBE PROGRESS timer") {
            break;
        }
        if std::time::Instant::now() > deadline {
            bail!("{what}: the timer did not run within 120 s");
        }
    }
    std::thread::spawn(move || lines.for_each(drop));
    Ok(())
}

struct Microvirt {
    launcher: PathBuf,
    probe: PathBuf,
    cmdline: String,
}

impl Microvirt {
    fn run(&self) -> Command {
        let mut c = Command::new(&self.launcher);
        c.arg("run")
            .arg("--kernel")
            .arg(&self.probe)
            .args([
                "--memory",
                &GUEST_MIB.to_string(),
                "--cmdline",
                &self.cmdline,
            ])
            .arg("--no-console-input")
            .env("RUST_LOG", "error")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        c
    }

    fn snapshot(&self, dir: &Path) -> Result<PathBuf> {
        let sock = dir.join("mv.sock");
        let snap = dir.join("mv-snap");
        let mut child = self.run().arg("--socket").arg(&sock).spawn()?;
        let ready = wait_for_path(&sock)
            .and_then(|_| wait_for_timer(child.stdout.take().unwrap(), "microvirt snapshot"));
        let done = ready.and_then(|_| microvirt_snapshot(&self.launcher, &sock, &snap));
        kill(child);
        done?;
        Ok(snap)
    }

    fn restore(&self, snap: &Path, vm: usize, tx: Sender<Event>) -> Result<Child> {
        let mut child = Command::new(&self.launcher)
            .args(["restore", "--boot-timer", "--no-console-input"])
            .arg("--from")
            .arg(snap)
            .env("RUST_LOG", "error")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        watch_boot_timer(child.stderr.take().unwrap(), vm, tx.clone());
        watch_console(child.stdout.take().unwrap(), vm, tx, None);
        Ok(child)
    }

    fn boot(&self, vm: usize, tx: Sender<Event>) -> Result<Child> {
        let mut child = self.run().spawn()?;
        watch_console(
            child.stdout.take().unwrap(),
            vm,
            tx,
            Some("probe: timer armed"),
        );
        Ok(child)
    }
}

struct Firecracker {
    binary: PathBuf,
    dir: PathBuf,
}

impl Firecracker {
    fn spawn(&self, sock: &Path, config: Option<&Path>) -> Result<Child> {
        let _ = std::fs::remove_file(sock);
        let mut c = Command::new(&self.binary);
        c.arg("--api-sock").arg(sock).args(firecracker::QUIET);
        if let Some(config) = config {
            c.arg("--config-file").arg(config);
        }
        Ok(c.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?)
    }

    /// Boots the guest, waits for its timer, and writes a full snapshot: (state, memory).
    fn snapshot(&self, probe: &Path, cmdline: &str) -> Result<(PathBuf, PathBuf)> {
        let config = self.dir.join("fc.json");
        firecracker::write_config(&config, probe, None, cmdline, GUEST_MIB)?;
        let (state, memory) = (self.dir.join("fc-state"), self.dir.join("fc-memory"));
        let sock = self.dir.join("fc-snap.sock");
        let mut child = self.spawn(&sock, Some(&config))?;
        let done = wait_for_timer(child.stdout.take().unwrap(), "Firecracker snapshot")
            .and_then(|_| firecracker::create_snapshot(&sock, &state, &memory));
        kill(child);
        done?;
        Ok((state, memory))
    }

    fn restore(&self, snap: &(PathBuf, PathBuf), vm: usize, tx: Sender<Event>) -> Result<Child> {
        let sock = self.dir.join(format!("fc-{vm}.sock"));
        let mut child = self.spawn(&sock, None)?;
        watch_console(child.stdout.take().unwrap(), vm, tx.clone(), None);
        let (state, memory) = snap.clone();
        std::thread::spawn(move || {
            let loaded = firecracker::wait_accepting(&sock)
                .and_then(|_| firecracker::load_snapshot(&sock, &state, &memory));
            match loaded {
                Ok(()) => {
                    let _ = tx.send(Event::Ready {
                        vm,
                        at_ns: now_ns(),
                        slots_ns: None,
                    });
                }
                Err(e) => eprintln!("Firecracker VM {vm}: {e:#}"),
            }
        });
        Ok(child)
    }
}

/// One table row's figures.
struct Row {
    what: String,
    vms: usize,
    all_ready: Option<Duration>,
    p50: f64,
    p99: f64,
    slots_p50: Option<f64>,
    pss_kib: Option<u64>,
}

impl Row {
    fn print(&self) {
        let opt = |v: Option<String>| v.unwrap_or_else(|| "—".into());
        println!(
            "| {} | {} | {} | {:.2} ms | {:.2} ms | {} | {} | {} |",
            self.what,
            self.vms,
            opt(self.all_ready.map(|d| format!("{:.3} s", d.as_secs_f64()))),
            self.p50,
            self.p99,
            opt(self.slots_p50.map(|s| format!("{s:.2} ms"))),
            opt(self
                .pss_kib
                .map(|k| format!("{:.1} MiB", k as f64 / 1024.0))),
            opt(self
                .pss_kib
                .map(|k| format!("{:.2} MiB", k as f64 / 1024.0 / self.vms as f64))),
        );
    }
}

/// `singles` starts of one VM alone (medians), then one fleet of `n` with its memory.
fn measure(
    what: &str,
    n: usize,
    singles: usize,
    spawn: &dyn Fn(usize, Sender<Event>) -> Result<Child>,
) -> Result<(Row, Row)> {
    let (mut ready, mut slots) = (Vec::new(), Vec::new());
    for _ in 0..singles {
        let f = start_fleet(what, 1, spawn)?;
        ready.extend(&f.ready_ms);
        slots.extend(&f.slots_ms);
    }
    let single = Row {
        what: format!("{what}, one alone"),
        vms: 1,
        all_ready: None,
        p50: median(ready.clone()),
        p99: percentile(ready, 0.99),
        slots_p50: (!slots.is_empty()).then(|| median(slots)),
        pss_kib: None,
    };
    let fleet = start_fleet(what, n, spawn)?;
    std::thread::sleep(SETTLE);
    let many = Row {
        what: format!("{what}, {n} back to back"),
        vms: n,
        all_ready: Some(fleet.all_ready),
        p50: median(fleet.ready_ms.clone()),
        p99: percentile(fleet.ready_ms.clone(), 0.99),
        slots_p50: (!fleet.slots_ms.is_empty()).then(|| median(fleet.slots_ms.clone())),
        pss_kib: Some(pss_kib(&fleet)?),
    };
    Ok((single, many))
}

fn main() -> Result<()> {
    let n = env_or("SANDBOX_VMS", 100) as usize;
    let singles = env_or("SANDBOX_SINGLE", 5).max(1) as usize;
    let warm = env_or("SANDBOX_WARM_MIB", 64);
    let probe = probe_guest()?;
    let dir = std::env::temp_dir().join(format!("microvirt-sandbox-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mv = Microvirt {
        launcher: launcher_path()?,
        probe: probe.clone(),
        cmdline: cmdline(warm),
    };
    println!(
        "sandboxes: the probe's timer test, {GUEST_MIB} MiB, 1 vCPU, {warm} MiB working set written before the snapshot; {n} VMs per fleet, one VMM at a time\n"
    );
    let mut rows = Vec::new();
    let snap = mv.snapshot(&dir)?;
    let (one, many) = measure("microvirt restore", n, singles, &|vm, tx| {
        mv.restore(&snap, vm, tx)
    })?;
    let mv_restore = many.pss_kib;
    rows.extend([one, many]);

    let fc = Firecracker {
        binary: firecracker_path(),
        dir: dir.clone(),
    };
    let mut fc_rows = None;
    if fc.binary.exists() {
        let snap = fc.snapshot(&probe, &mv.cmdline)?;
        let (one, many) = measure("Firecracker 1.16.1 restore", n, singles, &|vm, tx| {
            fc.restore(&snap, vm, tx)
        })?;
        fc_rows = Some((one.p50, many.p50, many.all_ready, many.pss_kib));
        rows.extend([one, many]);
    } else {
        println!(
            "Firecracker not measured: {} does not exist (set $FIRECRACKER)\n",
            fc.binary.display()
        );
    }

    let (one, many) = measure("microvirt cold boot", n, singles, &|vm, tx| mv.boot(vm, tx))?;
    let cold_per_vm = many.pss_kib.map(|k| k as f64 / n as f64);
    rows.extend([one, many]);
    let _ = std::fs::remove_dir_all(&dir);

    println!("| start | VMs | all ready | ready p50 | ready p99 | of which KVM memory slots (p50) | PSS, all VMs | PSS / VM |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in &rows {
        r.print();
    }
    println!();
    if let Some((fc_one, fc_many, fc_all, fc_pss)) = fc_rows {
        let (one, many) = (&rows[0], &rows[1]);
        println!(
            "microvirt / Firecracker restore: one alone {:.2}x, p50 in the fleet {:.2}x, all {n} ready {:.2}x, PSS of the fleet {:.2}x",
            one.p50 / fc_one,
            many.p50 / fc_many,
            many.all_ready.unwrap().as_secs_f64() / fc_all.unwrap().as_secs_f64(),
            mv_restore.unwrap() as f64 / fc_pss.unwrap() as f64,
        );
    }
    if let (Some(cold), Some(restored)) = (cold_per_vm, mv_restore) {
        println!(
            "{n} microvirt restores: {:.1} MiB; 20 cold boots: {:.1} MiB ({:.3}x)",
            restored as f64 / 1024.0,
            cold * 20.0 / 1024.0,
            restored as f64 / (cold * 20.0),
        );
    }
    println!("\n(ready: restore = spawn → first KVM_RUN (microvirt) / snapshot load answered (Firecracker); cold boot = spawn → the probe's `timer armed`; every VM also printed a timer line after its start; PSS after {SETTLE:?} of settling)");
    Ok(())
}
