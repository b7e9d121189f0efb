//! `cargo run --release -p bench --bin migration-bench [linux] [probe] [guest-gap] [stream]`:
//! live migration of microvirt and QEMU side by side in one run, on the same host, over loopback
//! TCP with the same downtime target (300 ms, QEMU's default) and no bandwidth limit. Sections
//! (all when none is named):
//!
//! - `linux`: the same Linux kernel and command line in 256 MiB, 1 GiB and 4 GiB under both VMMs.
//!   Each boots the guest in a source process and waits in a target process; after
//!   BENCH_SETTLE_MS (default 3000) the source migrates. microvirt: `virt-launcher run
//!   --incoming` ← `virt-launcher migrate` (its report: total time, downtime from source pause
//!   to the target's Running, which it sends once the guest runs again, bytes on the wire,
//!   passes); QEMU: `-incoming` ← QMP `migrate`, polled with `query-migrate`.
//! - `probe`: microvirt alone with the probe guest's `dirty` test rewriting 4 MiB per vCPU and
//!   pass (QEMU cannot boot the probe: it has no PVH entry).
//! - `guest-gap`: the downtime the guest sees: the probe's timer test prints a line every 10 ms
//!   tick, both consoles' lines are timestamped by this process, and the gap between the
//!   source's last and the target's first is set beside the downtime microvirt reports.
//! - `stream`: throughput of the stream itself. Both VMMs' guest RAM is filled with the same
//!   non-zero bytes before it moves (microvirt's from the host under an idle probe; QEMU's is a
//!   file in /dev/shm written beforehand, mapped shared as its RAM), so every page is sent;
//!   QEMU with one stream and with 4 multifd channels; loopback TCP's own rate in the same run.
//!
//! On a software-emulated host a Linux guest is still booting when it migrates (guest code runs
//! at ~2 M instructions/s), so it dirties little: those rows are the VMMs' own costs.
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

/// How QEMU's guest memory is set up and moved: `ram_file` backs it (filled beforehand with
/// non-zero bytes, so the stream carries them), `channels` > 1 moves it with multifd.
#[derive(Clone, Copy, Default)]
struct QemuMemory<'a> {
    ram_file: Option<&'a Path>,
    channels: u32,
}

fn qemu_cmd(qemu: &str, g: &Guest, mib: u64, qmp: &Path, memory: QemuMemory) -> Command {
    let mut c = Command::new(qemu);
    // The same backend id on both sides: the target's RAM block must carry the source's name.
    let backend = match memory.ram_file {
        Some(f) => format!(
            "memory-backend-file,id=ram,size={mib}M,mem-path={},share=on",
            f.display()
        ),
        None => format!("memory-backend-ram,id=ram,size={mib}M"),
    };
    c.args(["-object", &backend]);
    // microvm: no firmware and no PCI, the machine closest to microvirt's; `host` CPU minus
    // arch-capabilities, an MSR a software-emulated KVM refuses.
    c.args([
        "-accel",
        "kvm",
        "-M",
        "microvm,x-option-roms=off,rtc=off,memory-backend=ram",
    ])
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
    .stderr(
        std::fs::File::create(qmp.with_extension("log"))
            .map(Stdio::from)
            .unwrap_or_else(|_| Stdio::null()),
    );
    c
}

fn qemu(
    qemu: &str,
    g: &Guest,
    mib: u64,
    dir: &Path,
    settle: Duration,
    memory: QemuMemory,
) -> Result<Sample> {
    let (sq, tq) = (dir.join("qs.qmp"), dir.join("qt.qmp"));
    let _ = std::fs::remove_file(&sq);
    let _ = std::fs::remove_file(&tq);
    let port = free_port()?;
    let uri = format!("tcp:127.0.0.1:{port}");
    // The target waits for its capabilities (multifd) before it listens.
    let target: Child = qemu_cmd(
        qemu,
        g,
        mib,
        &tq,
        QemuMemory {
            ram_file: None,
            ..memory
        },
    )
    .args(["-incoming", "defer"])
    .spawn()?;
    let source: Child = qemu_cmd(qemu, g, mib, &sq, memory).spawn()?;
    let run = || -> Result<Sample> {
        let mut s = Qmp::connect(&sq)?;
        let mut t = Qmp::connect(&tq)?;
        for q in [&mut s, &mut t] {
            if memory.channels > 1 {
                q.call(
                    "migrate-set-capabilities",
                    json!({ "capabilities": [{ "capability": "multifd", "state": true }] }),
                )?;
                q.call(
                    "migrate-set-parameters",
                    json!({ "multifd-channels": memory.channels }),
                )?;
            }
        }
        t.call("migrate-incoming", json!({ "uri": uri }))?;
        std::thread::sleep(settle);
        s.call(
            "migrate-set-parameters",
            json!({ "downtime-limit": DOWNTIME_MS, "max-bandwidth": 1u64 << 40 }),
        )?;
        s.call("migrate", json!({ "uri": uri }))?;
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
    // A QEMU that failed says why on its stderr.
    r.with_context(|| {
        let said = |q: &Path| std::fs::read_to_string(q.with_extension("log")).unwrap_or_default();
        format!(
            "QEMU {mib} MiB: source said {:?}, target said {:?}",
            said(&sq),
            said(&tq)
        )
    })
}

/// One MiB of the bytes both VMMs' guest memory is filled with: never zero, so no page of it
/// can be skipped as a zero page.
fn nonzero_chunk() -> Vec<u8> {
    (0..1usize << 20)
        .map(|i| (i as u8).wrapping_mul(31) | 1)
        .collect()
}

/// A `mib` MiB file of `nonzero_chunk`s, to back QEMU's guest memory.
fn nonzero_file(path: &Path, mib: u64) -> Result<()> {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    let chunk = nonzero_chunk();
    for _ in 0..mib {
        f.write_all(&chunk)?;
    }
    f.flush()?;
    Ok(())
}

/// Loopback TCP itself, shaped like a migration stream (16 MiB writes, one reader copying
/// into its buffer): what no VMM's stream can beat on this host. GiB/s.
fn raw_tcp(bytes: u64) -> Result<f64> {
    use std::io::Read;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let reader = std::thread::spawn(move || -> Result<u64> {
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; 16 << 20];
        let mut got = 0;
        loop {
            match s.read(&mut buf)? {
                0 => return Ok(got),
                n => got += n as u64,
            }
        }
    });
    let started = Instant::now();
    let mut s = std::net::TcpStream::connect(addr)?;
    let chunk = nonzero_chunk().repeat(16);
    let mut sent = 0;
    while sent < bytes {
        s.write_all(&chunk)?;
        sent += chunk.len() as u64;
    }
    drop(s);
    let got = reader.join().expect("reader thread")?;
    Ok(got as f64 / (1u64 << 30) as f64 / started.elapsed().as_secs_f64())
}

/// A `mib` MiB probe guest idling (its timer test, halted between 10 ms ticks), RAM above
/// 64 MiB filled from the host with bytes that are never zero, migrated in-process over
/// loopback TCP, its pages on `page_streams` connections beside the conversation (none: on
/// the conversation's).
fn throughput(mib: u64, page_streams: usize) -> Result<Sample> {
    use vm_memory::{Bytes, GuestAddress};
    let console = tests::Console::default();
    let mut config = tests::probe_config("timer", 1, mib, &console);
    config.cmdline.push_str(" probe.ticks=100000000");
    let vm = vmm::Vm::build(&config)?;
    let chunk = nonzero_chunk();
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
        let accept = || -> Result<std::net::TcpStream> {
            let (s, _) = listener.accept()?;
            s.set_nodelay(true)?;
            Ok(s)
        };
        let mut s = accept()?;
        let mut pages = (0..page_streams)
            .map(|_| accept())
            .collect::<Result<Vec<_>>>()?;
        let vm = vmm::Vm::migrate_in_streams(&mut s, &mut pages, &target_config)?;
        vm.stop();
        Ok(())
    });
    let connect = || -> Result<std::net::TcpStream> {
        let s = std::net::TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        Ok(s)
    };
    let mut s = connect()?;
    let mut pages = (0..page_streams)
        .map(|_| connect())
        .collect::<Result<Vec<_>>>()?;
    let stats = vm.migrate_out_streams(
        &mut s,
        &mut pages,
        &vmm::migration::MigrationConfig::default(),
        &mut |_| {},
    )?;
    drop(pages);
    receiver.join().expect("target thread")?;
    Ok(Sample {
        total_ms: stats.total_time.as_secs_f64() * 1000.0,
        downtime_ms: stats.downtime.as_secs_f64() * 1000.0,
        wire_mib: stats.bytes_sent as f64 / (1u64 << 20) as f64,
        passes: stats.passes as f64,
    })
}

/// The probe's timer lines as they reach the host: when each arrived and the tick it counts.
#[derive(Default)]
struct TickLines {
    partial: Vec<u8>,
    ticks: Vec<(Instant, u64)>,
}

impl Write for TickLines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let now = Instant::now();
        for &b in buf {
            if b != b'\n' {
                self.partial.push(b);
                continue;
            }
            let line = String::from_utf8_lossy(&self.partial);
            if let Some(t) = line
                .strip_prefix("PROBE PROGRESS timer ticks=")
                .and_then(|t| t.trim().parse().ok())
            {
                self.ticks.push((now, t));
            }
            self.partial.clear();
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What the guest saw of one migration's switch-over, beside what the host reported.
struct GuestGap {
    host_downtime_ms: f64,
    /// The last timer line from the source to the first from the target.
    guest_gap_ms: f64,
    /// The longest gap between two timer lines on the source while it was still sending (how
    /// much a tick line wanders without a migration's pause), for scale.
    source_jitter_ms: f64,
}

/// The probe's timer test (a line every 10 ms tick) in `mib` MiB migrated in-process over
/// loopback TCP; the host timestamps every timer line from both sides' consoles.
fn guest_gap(mib: u64) -> Result<GuestGap> {
    use std::sync::{Arc, Mutex};
    let probe_on = |lines: &Arc<Mutex<TickLines>>| {
        let mut c = tests::probe_config("timer", 1, mib, &tests::Console::default());
        c.cmdline.push_str(" probe.ticks=100000000 probe.every=1");
        c.serial.output = vmm::config::SerialOutput::Writer(lines.clone());
        c
    };
    let (src_lines, dst_lines) = (
        Arc::new(Mutex::new(TickLines::default())),
        Arc::new(Mutex::new(TickLines::default())),
    );
    let config = probe_on(&src_lines);
    let target_config = probe_on(&dst_lines);
    let vm = vmm::Vm::build(&config)?;
    let deadline = Instant::now() + Duration::from_secs(120);
    let lines_seen = |l: &Arc<Mutex<TickLines>>| l.lock().unwrap().ticks.len();
    while lines_seen(&src_lines) < 50 {
        if Instant::now() > deadline {
            bail!("the probe's timer never ticked 50 times on the source");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let receiver = std::thread::spawn(move || -> Result<vmm::Vm> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        Ok(vmm::Vm::migrate_in(&mut s, &target_config)?)
    });
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let stats = vm.migrate_out(
        &mut s,
        &vmm::migration::MigrationConfig::default(),
        &mut |_| {},
    )?;
    let target = receiver.join().expect("target thread")?;
    while lines_seen(&dst_lines) < 20 {
        if Instant::now() > deadline {
            bail!("the probe's timer did not tick 20 times on the target");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    target.stop();
    let src = src_lines.lock().unwrap();
    let dst = dst_lines.lock().unwrap();
    let (last, first) = (src.ticks.last().unwrap(), dst.ticks[0]);
    if first.1 <= last.1 {
        bail!(
            "the target's first tick line counts {} after the source's last {}: not the migrated guest",
            first.1,
            last.1
        );
    }
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    Ok(GuestGap {
        host_downtime_ms: ms(stats.downtime),
        guest_gap_ms: ms(first.0 - last.0),
        source_jitter_ms: src
            .ticks
            .windows(2)
            .map(|w| ms(w[1].0 - w[0].0))
            .fold(0.0, f64::max),
    })
}

fn guest_gap_section(runs: usize) -> Result<()> {
    println!("\ndowntime as the guest sees it: the probe's timer test printing a line every 10 ms tick, migrated in-process over loopback TCP; the host timestamps the lines from both consoles");
    println!("(QEMU: not measured, it cannot boot the probe, which has no PVH entry; its Linux guest prints nothing periodic to time)\n");
    println!("| guest | host-reported downtime | guest's gap: last tick line on the source → first on the target | longest tick-line gap on the source before |");
    println!("| ---: | ---: | ---: | ---: |");
    for mib in [256u64, 1024] {
        let mut g = Vec::new();
        for _ in 0..runs {
            g.push(guest_gap(mib)?);
        }
        println!(
            "| {mib} MiB | {:.1} ms | {:.1} ms | {:.1} ms |",
            median(g.iter().map(|x| x.host_downtime_ms).collect()),
            median(g.iter().map(|x| x.guest_gap_ms).collect()),
            median(g.iter().map(|x| x.source_jitter_ms).collect()),
        );
    }
    Ok(())
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
    let args: Vec<String> = std::env::args().skip(1).collect();
    let all = ["linux", "probe", "guest-gap", "stream"];
    let sections: Vec<&str> = if args.is_empty() {
        all.to_vec()
    } else {
        for a in &args {
            if !all.contains(&a.as_str()) {
                bail!("unknown section {a:?}: migration-bench [linux] [probe] [guest-gap] [stream] (all when none is named)");
            }
        }
        all.into_iter()
            .filter(|s| args.iter().any(|a| a == s))
            .collect()
    };
    let runs = env_or("BENCH_RUNS", 3).max(1) as usize;
    let settle = Duration::from_millis(env_or("BENCH_SETTLE_MS", 3000));
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
    // Built only for the sections that run it.
    let launcher = if sections.contains(&"linux") || sections.contains(&"probe") {
        launcher_path()?
    } else {
        Default::default()
    };
    if sections.contains(&"linux") {
        linux_section(
            &launcher,
            &qemu_bin,
            &qemu_version,
            &guest,
            &dir,
            runs,
            settle,
        )?;
    }
    if sections.contains(&"probe") {
        probe_section(&launcher, &dir, runs)?;
    }
    if sections.contains(&"guest-gap") {
        guest_gap_section(runs)?;
    }
    if sections.contains(&"stream") {
        stream_section(&qemu_bin, &qemu_version, &guest, &dir, runs)?;
    }
    println!("\nTargets: downtime ≤ 20 ms for an idle 1 GiB guest, an idle 1 GiB guest moved in ≤ 0.5 s; a stream of non-zero memory at ≥ 2 GiB/s.");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// The Linux guest, idle (still booting on a software-emulated host), under both VMMs.
fn linux_section(
    launcher: &Path,
    qemu_bin: &str,
    qemu_version: &str,
    guest: &Guest,
    dir: &Path,
    runs: usize,
    settle: Duration,
) -> Result<()> {
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
            mv.push(microvirt(launcher, &args, dir, settle)?);
            q.push(qemu(
                qemu_bin,
                guest,
                mib,
                dir,
                settle,
                QemuMemory::default(),
            )?);
        }
        let g = format!("{mib} MiB");
        row(&g, "microvirt", &mv);
        row(&g, qemu_version, &q);
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
    Ok(())
}

/// The probe guest rewriting memory while it migrates (microvirt only: QEMU cannot boot it).
fn probe_section(launcher: &Path, dir: &Path, runs: usize) -> Result<()> {
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
            mv.push(microvirt(launcher, &args, dir, Duration::from_millis(500))?);
        }
        row(&format!("{mib} MiB"), "microvirt", &mv);
    }
    Ok(())
}

/// The stream itself: both VMMs' guest memory filled with the same non-zero bytes, moved
/// over loopback TCP, beside loopback TCP's own rate in the same run.
fn stream_section(
    qemu_bin: &str,
    qemu_version: &str,
    guest: &Guest,
    dir: &Path,
    runs: usize,
) -> Result<()> {
    let raw = median(
        (0..runs)
            .map(|_| raw_tcp(4 << 30))
            .collect::<Result<Vec<_>>>()?,
    );
    println!("\nstream throughput: guest RAM filled with non-zero bytes, over loopback TCP (loopback TCP itself: {raw:.2} GiB/s, one 16 MiB-write stream, same run)\n");
    println!(
        "| guest | VMM | streams | total | downtime | on the wire | throughput | of loopback TCP |"
    );
    println!("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    let ram_file = Path::new("/dev/shm").join(format!("mv-migration-bench-{}", std::process::id()));
    let print = |mib: u64, vmm: &str, streams: u32, s: &[Sample]| -> f64 {
        let (total, down, wire) = (
            median(s.iter().map(|x| x.total_ms).collect()),
            median(s.iter().map(|x| x.downtime_ms).collect()),
            median(s.iter().map(|x| x.wire_mib).collect()),
        );
        let rate = wire / 1024.0 / (total / 1000.0);
        println!(
            "| {mib} MiB | {vmm} | {streams} | {total:.0} ms | {down:.1} ms | {wire:.0} MiB | {rate:.2} GiB/s | {:.2}× |",
            rate / raw
        );
        rate
    };
    for mib in [1024u64, 4096] {
        let mut ours = 0.0f64;
        for page_streams in [0usize, 4] {
            let mut mv = Vec::new();
            for _ in 0..runs {
                mv.push(throughput(mib, page_streams)?);
            }
            let streams = page_streams.max(1) as u32;
            let rate = print(mib, "microvirt", streams, &mv);
            ours = ours.max(rate);
        }
        nonzero_file(&ram_file, mib)?;
        for channels in [1u32, 4] {
            let memory = QemuMemory {
                ram_file: Some(&ram_file),
                channels,
            };
            let mut q = Vec::new();
            for _ in 0..runs {
                q.push(qemu(
                    qemu_bin,
                    guest,
                    mib,
                    dir,
                    Duration::from_millis(1000),
                    memory,
                )?);
            }
            let theirs = print(mib, qemu_version, channels, &q);
            println!(
                "| {mib} MiB | ratio microvirt (its faster row) / this | | | | | {:.2}× | |",
                ours / theirs
            );
        }
        let _ = std::fs::remove_file(&ram_file);
    }
    Ok(())
}
