//! `cargo run --release -p bench --bin migration-bench`: live migration of microvirt and QEMU
//! side by side in one run, on the same host, the same Linux kernel and command line and the
//! same guest sizes (256 MiB, 1 GiB, 4 GiB), both over loopback TCP with the same downtime
//! target (300 ms, QEMU's default) and no bandwidth limit.
//!
//! Each VMM boots the guest in a source process and waits in a target process; after
//! BENCH_SETTLE_MS (default 3000) the source migrates:
//! - microvirt: `virt-launcher run --incoming` ← `virt-launcher migrate` (its report: total
//!   time, downtime from source pause to target running, bytes on the wire, passes);
//! - QEMU: `-incoming tcp:` ← QMP `migrate`, polled with `query-migrate` (its total-time,
//!   downtime, ram transferred, dirty-sync count).
//!
//! Then microvirt alone with the probe guest's `dirty` test rewriting 4 MiB per vCPU and pass
//! (QEMU cannot boot the probe: it has no PVH note), and the stream's throughput: 1 and 4 GiB
//! of non-zero guest memory (filled from the host under an idle probe) moved in-process over
//! loopback TCP.
//!
//! On a software-emulated host a Linux guest is still booting when it migrates (guest code runs
//! at ~2 M instructions/s), so it dirties little: these rows are the VMMs' own costs.
//! Medians of BENCH_RUNS (default 3).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bench::{env_or, kill, launcher_path, linux_guest, median, wait_for_path, Guest};
use serde_json::{json, Value};

const DOWNTIME_MS: u64 = 300;

#[derive(Clone, Copy, Debug, Default)]
struct Sample {
    total_ms: f64,
    downtime_ms: f64,
    wire_mib: f64,
    passes: f64,
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The number between `after` and `before` in `text`.
fn number(text: &str, after: &str, before: &str) -> Result<f64> {
    Ok(text
        .split(after)
        .nth(1)
        .and_then(|s| s.split(before).next())
        .with_context(|| format!("no {after:?} in {text:?}"))?
        .trim()
        .parse()?)
}

/// microvirt: two launchers on loopback; `kernel_args` boots either the Linux guest or the probe.
fn microvirt(
    launcher: &Path,
    kernel_args: &[String],
    dir: &Path,
    settle: Duration,
) -> Result<Sample> {
    let sock = dir.join("mv.sock");
    let _ = std::fs::remove_file(&sock);
    let port = free_port()?;
    let common = |c: &mut Command| {
        c.args(kernel_args)
            .args(["--no-console-input", "--console-log", "/dev/null"])
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
    };
    let mut target = Command::new(launcher);
    target.args(["run", "--incoming", &format!("127.0.0.1:{port}")]);
    common(&mut target);
    let target = target.spawn()?;
    let mut source = Command::new(launcher);
    source.arg("run").arg("--socket").arg(&sock);
    common(&mut source);
    let source = source.spawn()?;
    wait_for_path(&sock)?;
    std::thread::sleep(settle);
    let out = Command::new(launcher)
        .args(["migrate", "--socket"])
        .arg(&sock)
        .args(["--to", &format!("127.0.0.1:{port}")])
        .args(["--max-downtime-ms", &DOWNTIME_MS.to_string()])
        .output()?;
    kill(source);
    kill(target);
    let said = String::from_utf8_lossy(&out.stderr).to_string();
    if !out.status.success() {
        bail!("microvirt migration failed: {said}");
    }
    // "migrated to ADDR in T ms: P passes, M MiB on the wire, guest paused D ms"
    let summary = said.lines().last().unwrap_or_default();
    let wire = number(summary, "passes, ", " MiB")?;
    Ok(Sample {
        total_ms: number(summary, " in ", " ms")?,
        downtime_ms: number(summary, "guest paused ", " ms")?,
        wire_mib: wire,
        passes: number(summary, " ms: ", " passes")?,
    })
}

/// A QMP connection (QEMU's JSON machine protocol).
struct Qmp(BufReader<UnixStream>);

impl Qmp {
    fn connect(path: &Path) -> Result<Qmp> {
        wait_for_path(path)?;
        let mut q = Qmp(BufReader::new(UnixStream::connect(path)?));
        q.line()?; // greeting
        q.call("qmp_capabilities", json!({}))?;
        Ok(q)
    }

    fn line(&mut self) -> Result<Value> {
        let mut l = String::new();
        if self.0.read_line(&mut l)? == 0 {
            bail!("QMP closed");
        }
        Ok(serde_json::from_str(&l)?)
    }

    fn call(&mut self, cmd: &str, args: Value) -> Result<Value> {
        let msg = json!({ "execute": cmd, "arguments": args });
        self.0.get_mut().write_all(format!("{msg}\n").as_bytes())?;
        loop {
            let v = self.line()?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                bail!("QMP {cmd}: {e}");
            }
        }
    }
}

fn qemu_cmd(qemu: &str, g: &Guest, mib: u64, qmp: &Path) -> Command {
    let mut c = Command::new(qemu);
    // microvm: no firmware and no PCI, the machine closest to microvirt's; `host` CPU minus
    // arch-capabilities, an MSR a software-emulated KVM refuses.
    c.args(["-accel", "kvm", "-M", "microvm,x-option-roms=off,rtc=off"])
        .args(["-cpu", "host,-arch-capabilities", "-smp", "1"])
        .args(["-m", &format!("{mib}M")])
        .arg("-kernel")
        .arg(&g.kernel)
        .args(["-append", &g.cmdline])
        .args(["-nodefaults", "-no-user-config", "-display", "none"])
        .args(["-serial", "null"])
        .arg("-qmp")
        .arg(format!("unix:{},server=on,wait=off", qmp.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    c
}

fn qemu(qemu: &str, g: &Guest, mib: u64, dir: &Path, settle: Duration) -> Result<Sample> {
    let (sq, tq) = (dir.join("qs.qmp"), dir.join("qt.qmp"));
    let _ = std::fs::remove_file(&sq);
    let _ = std::fs::remove_file(&tq);
    let port = free_port()?;
    let target: Child = qemu_cmd(qemu, g, mib, &tq)
        .args(["-incoming", &format!("tcp:127.0.0.1:{port}")])
        .spawn()?;
    let source: Child = qemu_cmd(qemu, g, mib, &sq).spawn()?;
    let run = || -> Result<Sample> {
        let mut s = Qmp::connect(&sq)?;
        let _t = Qmp::connect(&tq)?;
        std::thread::sleep(settle);
        s.call(
            "migrate-set-parameters",
            json!({ "downtime-limit": DOWNTIME_MS, "max-bandwidth": 1u64 << 40 }),
        )?;
        s.call("migrate", json!({ "uri": format!("tcp:127.0.0.1:{port}") }))?;
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            let st = s.call("query-migrate", json!({}))?;
            match st.get("status").and_then(|v| v.as_str()) {
                Some("completed") => {
                    let f = |k: &str| st.get(k).and_then(|v| v.as_f64()).unwrap_or(0.0);
                    let ram = |k: &str| st["ram"].get(k).and_then(|v| v.as_f64()).unwrap_or(0.0);
                    return Ok(Sample {
                        total_ms: f("total-time"),
                        downtime_ms: f("downtime"),
                        wire_mib: ram("transferred") / (1u64 << 20) as f64,
                        passes: ram("dirty-sync-count"),
                    });
                }
                Some("failed") | Some("cancelled") => bail!("QEMU migration: {st}"),
                _ if Instant::now() > deadline => bail!("QEMU migration did not finish: {st}"),
                _ => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    };
    let r = run();
    kill(source);
    kill(target);
    r
}

/// A `mib` MiB probe guest idling on its console, RAM above 64 MiB filled from the host with
/// bytes that are never zero, migrated in-process over loopback TCP.
fn throughput(mib: u64) -> Result<Sample> {
    use vm_memory::{Bytes, GuestAddress};
    let console = tests::Console::default();
    let config = tests::probe_config("console", 1, mib, &console);
    let vm = vmm::Vm::build(&config)?;
    let mut chunk = vec![0u8; 1 << 20];
    for (i, b) in chunk.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31) | 1;
    }
    let low = 64u64 << 20;
    let top = mib.min(3072) << 20;
    let mut at = low;
    while at < top {
        vm.memory().write_slice(&chunk, GuestAddress(at))?;
        at += chunk.len() as u64;
    }
    if mib > 3072 {
        // RAM beyond the 3 GiB mark sits above the MMIO gap.
        let mut at = 1u64 << 32;
        while at < (1u64 << 32) + ((mib - 3072) << 20) {
            vm.memory().write_slice(&chunk, GuestAddress(at))?;
            at += chunk.len() as u64;
        }
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let target_config = config.clone();
    let receiver = std::thread::spawn(move || -> Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let vm = vmm::Vm::migrate_in(&mut s, &target_config)?;
        vm.stop();
        Ok(())
    });
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let stats = vm.migrate_out(
        &mut s,
        &vmm::migration::MigrationConfig::default(),
        &mut |_| {},
    )?;
    receiver.join().expect("target thread")?;
    Ok(Sample {
        total_ms: stats.total_time.as_secs_f64() * 1000.0,
        downtime_ms: stats.downtime.as_secs_f64() * 1000.0,
        wire_mib: stats.bytes_sent as f64 / (1u64 << 20) as f64,
        passes: stats.passes as f64,
    })
}

fn row(guest: &str, name: &str, s: &[Sample]) {
    println!(
        "| {guest} | {name} | {:.0} ms | {:.1} ms | {:.1} MiB | {:.0} |",
        median(s.iter().map(|x| x.total_ms).collect()),
        median(s.iter().map(|x| x.downtime_ms).collect()),
        median(s.iter().map(|x| x.wire_mib).collect()),
        median(s.iter().map(|x| x.passes).collect()),
    );
}

fn main() -> Result<()> {
    let runs = env_or("BENCH_RUNS", 3).max(1) as usize;
    let settle = Duration::from_millis(env_or("BENCH_SETTLE_MS", 3000));
    let launcher = launcher_path()?;
    let qemu_bin = std::env::var("QEMU").unwrap_or_else(|_| "qemu-system-x86_64".into());
    let version = Command::new(&qemu_bin)
        .arg("--version")
        .output()
        .context("QEMU not found (apt install qemu-system-x86, or set QEMU)")?;
    let qemu_version = String::from_utf8_lossy(&version.stdout)
        .lines()
        .next()
        .unwrap_or("QEMU")
        .replace("QEMU emulator version ", "QEMU ");
    let (guest, profile, emulated) = linux_guest()?;
    let dir = std::env::temp_dir().join(format!("mv-migration-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    println!(
        "live migration over loopback TCP, Linux guest ({profile} kernel), 1 vCPU, downtime target {DOWNTIME_MS} ms, no bandwidth limit, {runs} runs each, medians; KVM {}\n",
        if emulated { "software-emulated" } else { "hardware" }
    );
    println!("| guest | VMM | total | downtime | on the wire | passes |");
    println!("| ---: | --- | ---: | ---: | ---: | ---: |");
    let linux_args = vec![
        "--kernel".to_string(),
        guest.kernel.display().to_string(),
        "--cmdline".into(),
        guest.cmdline.clone(),
    ];
    for mib in [256u64, 1024, 4096] {
        let (mut mv, mut q) = (Vec::new(), Vec::new());
        let mut args = linux_args.clone();
        args.extend(["--memory".into(), mib.to_string()]);
        for _ in 0..runs {
            mv.push(microvirt(&launcher, &args, &dir, settle)?);
            q.push(qemu(&qemu_bin, &guest, mib, &dir, settle)?);
        }
        let g = format!("{mib} MiB");
        row(&g, "microvirt", &mv);
        row(&g, &qemu_version, &q);
        let ratio = |f: fn(&Sample) -> f64| {
            median(mv.iter().map(f).collect()) / median(q.iter().map(f).collect()).max(1e-9)
        };
        println!(
            "| {g} | ratio microvirt/QEMU | {:.2}× | {:.2}× | {:.2}× | |",
            ratio(|s| s.total_ms),
            ratio(|s| s.downtime_ms),
            ratio(|s| s.wire_mib),
        );
    }

    println!("\nmicrovirt, probe guest `dirty` test on 2 vCPUs (8 MiB rewritten per pass while it migrates; the guest's memory is checked on the target by tests/tests/migration.rs, not here)\n");
    println!("| guest | VMM | total | downtime | on the wire | passes |");
    println!("| ---: | --- | ---: | ---: | ---: | ---: |");
    let probe = tests::probe_path();
    for mib in [256u64, 1024, 4096] {
        let args: Vec<String> = vec![
            "--kernel".into(),
            probe.display().to_string(),
            "--cmdline".into(),
            "console=ttyS0 probe.test=dirty probe.passes=100000".into(),
            "--vcpus".into(),
            "2".into(),
            "--memory".into(),
            mib.to_string(),
        ];
        let mut mv = Vec::new();
        for _ in 0..runs {
            mv.push(microvirt(
                &launcher,
                &args,
                &dir,
                Duration::from_millis(500),
            )?);
        }
        row(&format!("{mib} MiB"), "microvirt", &mv);
    }
    println!("\nmicrovirt, stream throughput: guest RAM filled with non-zero bytes from the host (idle probe), in-process over loopback TCP\n");
    println!("| guest | non-zero RAM | total | downtime | on the wire | throughput |");
    println!("| ---: | ---: | ---: | ---: | ---: | ---: |");
    for mib in [1024u64, 4096] {
        let mut s = Vec::new();
        for _ in 0..runs {
            s.push(throughput(mib)?);
        }
        let (total, down, wire) = (
            median(s.iter().map(|x| x.total_ms).collect()),
            median(s.iter().map(|x| x.downtime_ms).collect()),
            median(s.iter().map(|x| x.wire_mib).collect()),
        );
        println!(
            "| {mib} MiB | {} MiB | {total:.0} ms | {down:.1} ms | {wire:.0} MiB | {:.2} GiB/s |",
            mib - 64,
            wire / 1024.0 / (total / 1000.0)
        );
    }
    println!("\nTargets: downtime ≤ 20 ms for an idle 1 GiB guest, an idle 1 GiB guest moved in ≤ 0.5 s.");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
