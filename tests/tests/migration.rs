//! Pre-copy live migration between two VMs over TCP, judged by the probe: the `dirty` test
//! verifies its whole working set every pass, so the guest finishing OK on the target means no
//! page was lost on the way; every failure leaves the guest running on the source.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tests::*;
use vmm::migration::{
    MigrationConfig, MigrationError, MigrationFailure, MigrationProgress, Phase, Side,
};
use vmm::{Vm, VmConfig, VmEnd};

const T: Duration = Duration::from_secs(120);
/// How long either end waits on a silent link in these tests (the launcher uses a minute).
const LINK: Duration = Duration::from_secs(10);

type Received = std::thread::JoinHandle<Result<(Vm, Console), MigrationFailure>>;

/// A target listening on loopback; returns its address and the thread that receives the VM
/// (with `config`'s console replaced by its own).
fn target(config: &VmConfig) -> (SocketAddr, Received) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let config = config.clone();
    let t = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_nodelay(true).unwrap();
        s.set_read_timeout(Some(LINK)).unwrap();
        s.set_write_timeout(Some(LINK)).unwrap();
        let console = Console::default();
        let mut c = config;
        c.serial.output = console.output();
        Vm::migrate_in(&mut s, &c).map(|vm| (vm, console))
    });
    (addr, t)
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(LINK)).unwrap();
    s.set_write_timeout(Some(LINK)).unwrap();
    s
}

fn migrate(
    vm: &Vm,
    to: &VmConfig,
    config: &MigrationConfig,
) -> (
    Result<vmm::migration::MigrationStats, MigrationFailure>,
    Received,
) {
    let (addr, receiver) = target(to);
    let r = vm.migrate_out(&mut connect(addr), config, &mut |_| {});
    (r, receiver)
}

fn assert_runs_on_source(vm: &Vm, what: &str) {
    assert!(
        vm.end_signal().get().is_none(),
        "{what}: the source VM ended"
    );
    assert!(!vm.is_paused(), "{what}: the source VM stays paused");
}

#[test]
fn dirty_guest_migrates_and_finishes_on_the_target() {
    require_kvm();
    for (vcpus, mib) in [(1u8, 256u64), (2, 256), (2, 4608)] {
        let console = Console::default();
        let config = dirty_config(vcpus, mib, 150, &console);
        let vm = Vm::build(&config).unwrap();
        wait_progress(&console, "dirty", "pass=3", T);
        let (addr, receiver) = target(&config);
        let mut events: Vec<MigrationProgress> = Vec::new();
        let stats = vm
            .migrate_out(&mut connect(addr), &MigrationConfig::default(), &mut |p| {
                events.push(p)
            })
            .expect("migration");
        assert_eq!(vm.end_signal().get(), Some(VmEnd::Migrated));
        assert_eq!(vm.wait(), VmEnd::Migrated);
        let source = console.text();
        let (vm, console) = receiver.join().unwrap().expect("target");
        let run = run_to_end(vm, &console, T);
        let r = expect_probe_ok(&run, "dirty");
        assert_eq!(r.field("passes"), Some("150"));
        assert_eq!(r.field("cpus"), Some(vcpus.to_string().as_str()));
        assert!(
            !run.console.contains("probe guest: hello"),
            "{}",
            run.console
        );
        // One machine moved, not a copy made: the guest's generation ID stays (the probe
        // prints it again only when it changes).
        assert_eq!(source.matches("PROBE GENID ").count(), 1, "{source}");
        assert!(
            !run.console.contains("PROBE GENID"),
            "the generation changed on migration:\n{}",
            run.console
        );
        // Progress: pre-copy passes, then completed; what was sent only grows.
        assert_eq!(events.first().unwrap().phase, Phase::Precopy);
        let last = events.last().unwrap();
        assert_eq!(
            (last.phase, last.data_remaining_bytes),
            (Phase::Completed, 0)
        );
        assert!(events
            .windows(2)
            .all(|w| w[0].data_processed_bytes <= w[1].data_processed_bytes));
        assert_eq!(last.data_processed_bytes, stats.bytes_sent);
        assert!(
            stats.passes >= 1 && stats.downtime <= stats.total_time,
            "{stats:?}"
        );
        // Only what the guest touched crossed the wire, not all of RAM.
        assert!(stats.bytes_sent < (mib << 20) / 2, "{stats:?}");
    }
}

/// A TCP relay between source and target that misbehaves on cue, standing in for a cut
/// cable, a killed target or a flipped bit on the wire.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// Close both directions once this many bytes went from source to target.
    Close(usize),
    /// Stop forwarding (the connection stays open and silent) after this many bytes.
    Blackhole(usize),
    /// Flip a bit in the byte at this offset of the source's stream.
    Flip(usize),
    /// Close both directions once this many bytes went from target to source.
    CloseReply(usize),
}

struct Relay {
    addr: SocketAddr,
    done: std::thread::JoinHandle<()>,
}

fn relay(target: SocketAddr, fault: Fault) -> Relay {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let done = std::thread::spawn(move || {
        let (from_source, _) = listener.accept().unwrap();
        let to_target = TcpStream::connect(target).unwrap();
        let cut = Arc::new(AtomicBool::new(false));
        let pump = |mut r: TcpStream, mut w: TcpStream, downstream: bool| {
            let cut = cut.clone();
            let (a, b) = (r.try_clone().unwrap(), w.try_clone().unwrap());
            std::thread::spawn(move || {
                let mut n = 0usize;
                let mut buf = vec![0u8; 64 << 10];
                while let Ok(k) = r.read(&mut buf) {
                    if k == 0 || cut.load(Ordering::SeqCst) {
                        break;
                    }
                    let chunk = &mut buf[..k];
                    let limit = match (fault, downstream) {
                        (Fault::Close(at) | Fault::Blackhole(at), true)
                        | (Fault::CloseReply(at), false) => Some(at),
                        _ => None,
                    };
                    if let (Fault::Flip(at), true) = (fault, downstream) {
                        if (n..n + k).contains(&at) {
                            chunk[at - n] ^= 0x10;
                        }
                    }
                    if let Some(at) = limit.filter(|at| n + k > *at) {
                        let _ = w.write_all(&chunk[..at - n]);
                        if matches!(fault, Fault::Blackhole(_)) {
                            // Silent: nothing more is read or answered, as on a cut cable;
                            // the sender's buffers fill and its writes stall.
                            std::thread::sleep(LINK * 2);
                        }
                        cut.store(true, Ordering::SeqCst);
                        break;
                    }
                    if w.write_all(chunk).is_err() {
                        break;
                    }
                    n += k;
                }
                let _ = a.shutdown(Shutdown::Both);
                let _ = b.shutdown(Shutdown::Both);
            })
        };
        let up = pump(
            to_target.try_clone().unwrap(),
            from_source.try_clone().unwrap(),
            false,
        );
        let down = pump(from_source, to_target, true);
        let _ = down.join();
        let _ = up.join();
    });
    Relay { addr, done }
}

/// The fault matrix, on one running guest: the target dying in each phase, a cut link, a
/// corrupted frame, a protocol-version and a machine mismatch, a disk the target lacks, a
/// cancel in each phase, the completion timeout. After every one the guest
/// runs on the source; at the end it migrates for real and finishes OK, so nothing was lost.
#[test]
fn every_failure_leaves_the_guest_running_on_the_source() {
    require_kvm();
    let console = Console::default();
    let config = dirty_config(2, 128, 1000, &console);
    let vm = Vm::build(&config).unwrap();
    wait_progress(&console, "dirty", "pass=1", T);
    // A downtime nothing fits, and a limit that makes every pass last long enough for the
    // guest to dirty pages again, even on a loaded host: pre-copy goes on until stopped.
    let never_converge = || MigrationConfig {
        max_downtime: Duration::from_nanos(1),
        bandwidth_limit: Some(64 << 20),
        ..Default::default()
    };

    let relayed = |fault: Fault, cfg: &MigrationConfig| {
        let (taddr, receiver) = target(&config);
        let relay = relay(taddr, fault);
        let r = vm.migrate_out(&mut connect(relay.addr), cfg, &mut |_| {});
        let target = receiver.join().unwrap();
        relay.done.join().unwrap();
        (
            r.expect_err("the migration must fail"),
            target.expect_err("the target must fail"),
        )
    };

    // The target goes away during the handshake, mid pre-copy, and after restoring the
    // machine (its Restored never arrives).
    for (fault, phase) in [
        (Fault::Close(6), Phase::Handshake),
        (Fault::Close(3 << 20), Phase::Precopy),
        // Ready and Synced pass, Restored does not.
        (Fault::CloseReply(18), Phase::StopAndCopy),
    ] {
        // Pre-copy goes on until the source notices (socket buffers hide a close for a while).
        let cfg = if phase == Phase::Precopy {
            never_converge()
        } else {
            MigrationConfig::default()
        };
        let (e, _) = relayed(fault, &cfg);
        assert_eq!((e.side, e.phase), (Side::Source, phase), "{fault:?}: {e}");
        assert!(matches!(e.error, MigrationError::Wire(_)), "{fault:?}: {e}");
        assert_runs_on_source(&vm, &format!("{fault:?}"));
    }

    // A link that goes silent mid-pass: the source's write times out.
    let t0 = Instant::now();
    let (e, t) = relayed(Fault::Blackhole(2 << 20), &never_converge());
    assert_eq!(e.phase, Phase::Precopy, "{e}");
    assert!(t0.elapsed() < LINK * 4, "{:?}", t0.elapsed());
    assert_eq!(t.side, Side::Target);
    assert_runs_on_source(&vm, "blackhole");

    // One flipped bit in a page frame: the target's checksum catches it, and the target,
    // whose RAM may hold the frame by then, is discarded; the source learns of it on its next
    // write or read.
    let (e, t) = relayed(Fault::Flip(1 << 20), &MigrationConfig::default());
    assert!(
        matches!(
            t.error,
            MigrationError::Wire(vmm::migration::wire::WireError::Checksum(_))
        ),
        "{t}"
    );
    assert!(e.vm_stays_on_source(), "{e}");
    assert_runs_on_source(&vm, "flipped bit");

    // Another protocol version (byte 8 of the header).
    let (e, t) = relayed(Fault::Flip(8), &MigrationConfig::default());
    let flipped = format!("protocol version {}", vmm::migration::wire::PROTOCOL ^ 0x10);
    assert!(t.to_string().contains(&flipped), "{t}");
    assert!(matches!(e.error, MigrationError::TargetFailed(_)), "{e}");
    assert_eq!((e.side, e.phase), (Side::Target, Phase::Handshake), "{e}");
    assert_runs_on_source(&vm, "version");

    // A target prepared for another machine, or without the disk.
    let mut other = config.clone();
    other.memory_mib = 256;
    let (r, receiver) = migrate(&vm, &other, &MigrationConfig::default());
    let e = r.expect_err("refused");
    assert!(e.to_string().contains("prepared for 2 and 256"), "{e}");
    assert!(matches!(e.error, MigrationError::Refused(_)));
    assert!(receiver.join().unwrap().is_err());
    assert_runs_on_source(&vm, "memory size");
    let mut diskless = config.clone();
    diskless.disks = vec![vmm::config::DiskConfig::new("/nonexistent/mv-disk.img")];
    let (r, receiver) = migrate(&vm, &diskless, &MigrationConfig::default());
    let e = r.expect_err("refused");
    assert!(e.to_string().contains("/nonexistent/mv-disk.img"), "{e}");
    assert_eq!(e.phase, Phase::Handshake);
    assert!(receiver.join().unwrap().is_err());
    assert_runs_on_source(&vm, "missing disk");

    // Cancel before the first page, in a later pass, and during stop-and-copy.
    let cancel_at = |when: &dyn Fn(&MigrationProgress) -> bool, cfg: MigrationConfig| {
        let (addr, receiver) = target(&config);
        let abort = cfg.abort.clone();
        let r = vm.migrate_out(&mut connect(addr), &cfg, &mut |p| {
            if when(&p) {
                abort.store(true, Ordering::SeqCst);
            }
        });
        let t = receiver.join().unwrap().expect_err("cancelled");
        assert!(matches!(t.error, MigrationError::Cancelled(_)), "{t}");
        r.expect_err("cancelled")
    };
    let cfg = MigrationConfig::default();
    cfg.abort.store(true, Ordering::SeqCst);
    let e = cancel_at(&|_| false, cfg);
    assert_eq!((e.phase, e.pass), (Phase::Precopy, Some(0)), "{e}");
    assert_runs_on_source(&vm, "cancel at start");
    let e = cancel_at(&|p| p.pass == 2, never_converge());
    assert_eq!((e.phase, e.pass), (Phase::Precopy, Some(3)), "{e}");
    assert!(matches!(e.error, MigrationError::Cancelled(_)), "{e}");
    assert_runs_on_source(&vm, "cancel in pass 3");
    let e = cancel_at(
        &|p| p.phase == Phase::StopAndCopy,
        MigrationConfig::default(),
    );
    assert_eq!(e.phase, Phase::StopAndCopy, "{e}");
    assert_runs_on_source(&vm, "cancel in stop-and-copy");

    // The completion timeout (the progress timeout: see the bandwidth test).
    let (r, receiver) = migrate(
        &vm,
        &config,
        &MigrationConfig {
            completion_timeout: Duration::ZERO,
            ..Default::default()
        },
    );
    assert!(matches!(r.unwrap_err().error, MigrationError::Timeout(_)));
    assert!(receiver.join().unwrap().is_err());
    assert_runs_on_source(&vm, "timeouts");

    // And then it moves, with every page intact.
    let (r, receiver) = migrate(&vm, &config, &MigrationConfig::default());
    r.expect("migration");
    assert_eq!(vm.wait(), VmEnd::Migrated);
    let (vm, console) = receiver.join().unwrap().expect("target");
    let run = run_to_end(vm, &console, Duration::from_secs(600));
    assert_eq!(expect_probe_ok(&run, "dirty").field("passes"), Some("1000"));
}

#[test]
fn there_and_back_three_times() {
    require_kvm();
    let console = Console::default();
    let config = dirty_config(2, 256, 400, &console);
    let mut vm = Vm::build(&config).unwrap();
    wait_progress(&console, "dirty", "pass=2", T);
    let mut last = console;
    for _ in 0..6 {
        let (r, receiver) = migrate(&vm, &config, &MigrationConfig::default());
        r.expect("migration");
        assert_eq!(vm.wait(), VmEnd::Migrated);
        let (next, console) = receiver.join().unwrap().expect("target");
        vm = next;
        last = console;
    }
    let run = run_to_end(vm, &last, Duration::from_secs(600));
    assert_eq!(expect_probe_ok(&run, "dirty").field("passes"), Some("400"));
}

/// A bandwidth limit under the guest's dirty rate: plain pre-copy cannot converge and gives
/// up at the progress timeout; with auto-converge the vCPUs are throttled until it does.
#[test]
fn bandwidth_limit_forces_passes_and_auto_converge_catches_up() {
    require_kvm();
    let console = Console::default();
    let config = dirty_config(1, 128, 100_000, &console);
    let vm = Vm::build(&config).unwrap();
    wait_progress(&console, "dirty", "pass=2", T);
    let limit = 4u64 << 20;
    let limited = MigrationConfig {
        bandwidth_limit: Some(limit),
        max_downtime: Duration::from_millis(100),
        progress_timeout: Duration::from_secs(8),
        ..Default::default()
    };
    let mut events = Vec::new();
    let (addr, receiver) = target(&config);
    let started = Instant::now();
    let e = vm
        .migrate_out(&mut connect(addr), &limited, &mut |p| events.push(p))
        .expect_err("cannot converge");
    assert!(matches!(e.error, MigrationError::Stalled(_)), "{e}");
    assert!(receiver.join().unwrap().is_err());
    assert_runs_on_source(&vm, "stalled");
    assert!(events.len() >= 3, "several passes: {events:?}");
    // The limit holds: what went over the wire took at least as long as the limit allows.
    let sent = events.last().unwrap().data_processed_bytes;
    assert!(
        started.elapsed().as_secs_f64() >= sent as f64 / limit as f64 * 0.9,
        "{sent} bytes in {:?}",
        started.elapsed()
    );
    assert!(events.iter().all(|p| p.throttle_percent == 0));

    let mut events = Vec::new();
    let (addr, receiver) = target(&config);
    let stats = vm
        .migrate_out(
            &mut connect(addr),
            &MigrationConfig {
                auto_converge: true,
                progress_timeout: Duration::from_secs(60),
                ..limited
            },
            &mut |p| events.push(p),
        )
        .unwrap_or_else(|e| {
            let passes: Vec<_> = events
                .iter()
                .map(|p| {
                    (
                        p.pass,
                        p.data_remaining_bytes >> 12,
                        p.dirty_rate_bytes_per_s as u64 >> 12,
                        p.transfer_rate_bytes_per_s as u64 >> 12,
                        p.throttle_percent,
                    )
                })
                .collect();
            panic!("auto-converge lets it finish: {e}; (pass, pages left, pages/s dirtied, pages/s sent, throttle %): {passes:?}")
        });
    assert!(stats.max_throttle_percent >= 20, "{stats:?} {events:?}");
    assert!(stats.passes >= 2, "{stats:?}");
    assert!(
        stats.downtime < Duration::from_secs(2),
        "{stats:?} {events:?}"
    );
    assert_eq!(vm.wait(), VmEnd::Migrated);
    let (vm, console) = receiver.join().unwrap().expect("target");
    // The guest runs at full speed on the target: passes keep coming.
    let pass_now = console.text().matches("PROBE PROGRESS dirty").count();
    let more = Instant::now();
    while console.text().matches("PROBE PROGRESS dirty").count() < pass_now + 3 {
        assert!(more.elapsed() < T, "{}", console.text());
        std::thread::sleep(Duration::from_millis(50));
    }
    vm.stop();
    assert!(
        !console.text().contains("probe: FAIL"),
        "{}",
        console.text()
    );
}

#[test]
fn a_disk_being_written_migrates_with_its_guest() {
    require_kvm();
    let dir = std::env::temp_dir().join(format!("mv-mig-blk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let console = Console::default();
    let (config, image) = blkstream_config(&dir, 512, &console);
    let vm = Vm::build(&config).unwrap();
    wait_progress(&console, "blkstream", "writes=64", T);
    let (r, receiver) = migrate(&vm, &config, &MigrationConfig::default());
    r.expect("migration");
    // The target runs and holds the disk while the source object still exists: the lock
    // was handed over at switch-over, not when the source went away.
    let (target_vm, console) = receiver.join().unwrap().expect("target");
    assert!(
        vmm::devices::virtio::block::Disk::open_with(&image, false, Default::default(), true)
            .is_err(),
        "the target holds the disk's lock"
    );
    drop(vm);
    let run = run_to_end(target_vm, &console, T);
    assert_eq!(
        expect_probe_ok(&run, "blkstream").field("written"),
        Some("512")
    );
    assert_blkstream_image(&image, 512);
    std::fs::remove_dir_all(dir).unwrap();
}

/// The guest keeps answering a peer across the move: the target announces the guest's MAC
/// (RARP) from its own TAP, so the bridge sends the peer's next frames there at once.
#[test]
fn the_network_follows_the_guest() {
    use vmm::config::{NetConfig, TapSource};
    const HOST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 9];
    require_kvm();
    let ns = NetNs::new("mignet");
    ns.exec(&["ip", "link", "add", "mvbr0", "type", "bridge"]);
    for tap in ["mvmig0", "mvmig1"] {
        ns.exec(&["ip", "tuntap", "add", tap, "mode", "tap", "vnet_hdr"]);
        ns.exec(&["ip", "link", "set", tap, "master", "mvbr0", "up"]);
    }
    ns.exec(&["sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1"]);
    // Promiscuous: the peer's MAC is not the bridge's, and frames to it must still reach the
    // packet socket on the bridge device.
    ns.exec(&["ip", "link", "set", "mvbr0", "promisc", "on", "up"]);
    let ns_name = ns.name.clone();
    std::thread::spawn(move || {
        let ns = NetNs { name: ns_name };
        ns.enter();
        std::mem::forget(ns);
        let wire = PacketSocket::bind("mvbr0");
        let console = Console::default();
        let mut config = probe_config("net", 1, 64, &console);
        let nic = |tap: &str| NetConfig {
            tap: TapSource::Name(tap.into()),
            mac: None,
        };
        config.nets = vec![nic("mvmig0")];
        let vm = Vm::build(&config).unwrap();
        let mac = vm.nets()[0].lock().unwrap().mac();
        let peer = ProbeNetPeer {
            wire: &wire,
            guest: mac.0,
            me: HOST_MAC,
        };
        peer.greetings(T);
        for i in 0..3 {
            peer.ping(i, Duration::from_secs(30));
        }
        let mut target_config = config.clone();
        target_config.nets = vec![nic("mvmig1")];
        let (r, receiver) = migrate(&vm, &target_config, &MigrationConfig::default());
        r.expect("migration");
        let (vm2, console2) = receiver.join().unwrap().expect("target");
        assert_eq!(vm2.nets()[0].lock().unwrap().mac(), mac);
        let rarp = wire
            .recv_matching(Duration::from_secs(5), |f| {
                f.len() >= 42
                    && f[12..14] == [0x80, 0x35]
                    && f[6..12] == mac.0
                    && f[22..28] == mac.0
            })
            .expect("a RARP announcing the guest from its new port");
        assert_eq!(&rarp[..6], &[0xff; 6]);
        drop(vm);
        // The bridge moved the MAC to the target's TAP before the guest said anything.
        let fdb = std::process::Command::new("bridge")
            .args(["fdb", "show", "br", "mvbr0"])
            .output()
            .unwrap();
        let fdb = String::from_utf8_lossy(&fdb.stdout).to_string();
        let mac_s = mac.to_string();
        assert!(
            fdb.lines()
                .any(|l| l.starts_with(&mac_s) && l.contains("dev mvmig1")),
            "{mac_s} not on mvmig1:\n{fdb}"
        );
        for i in 3..6 {
            peer.ping(i, Duration::from_secs(30));
        }
        peer.done();
        let run = run_to_end(vm2, &console2, T);
        assert_eq!(expect_probe_ok(&run, "net").field("echoed"), Some("6"));
    })
    .join()
    .unwrap();
    drop(ns);
}

#[test]
fn garbage_on_the_migration_port_is_refused() {
    require_kvm();
    let console = Console::default();
    let config = dirty_config(1, 64, 1, &console);
    for garbage in [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        b"MVRTMIGR\x02\x00\x00\x00\x01\xff\xff\xff\xff\0\0\0\0".to_vec(),
        b"MVRTMIGR\x02\x00\x00\x00\x02\x10\x00\x00\x00\0\0\0\0".to_vec(),
    ] {
        let (addr, receiver) = target(&config);
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&garbage).unwrap();
        drop(s);
        assert!(receiver.join().unwrap().is_err());
    }
}

/// A guest writing keyboard commands without reading the answers (`out 0x60, 0xf2` in a loop):
/// the keyboard's buffer overruns at its size, so the VMM's memory stays flat and the VM still
/// migrates in the middle of the flood (a restore refuses more than the buffer holds).
#[test]
fn a_keyboard_flood_stays_bounded_and_the_vm_still_migrates() {
    require_kvm();
    let console = Console::default();
    let config = probe_config("i8042flood probe.writes=400000", 1, 64, &console);
    let vm = Vm::build(&config).unwrap();
    wait_progress(&console, "i8042flood", "writes=100000", T);
    let (r, receiver) = migrate(&vm, &config, &MigrationConfig::default());
    r.expect("a flooding guest migrates");
    let (vm, console) = receiver.join().unwrap().expect("target");
    let run = run_to_end(vm, &console, T);
    let r = expect_probe_ok(&run, "i8042flood");
    assert_eq!(r.field("writes"), Some("400000"));
}

/// A target taking the conversation and then `page_streams` more connections on one listener
/// (accepted in any order: each page stream's header says which it is).
fn target_with_page_streams(config: &VmConfig, page_streams: usize) -> (SocketAddr, Received) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let config = config.clone();
    let t = std::thread::spawn(move || {
        let accept = || {
            let (s, _) = listener.accept().unwrap();
            s.set_nodelay(true).unwrap();
            s.set_read_timeout(Some(LINK)).unwrap();
            s.set_write_timeout(Some(LINK)).unwrap();
            s
        };
        let mut main = accept();
        let mut pages: Vec<TcpStream> = (0..page_streams).map(|_| accept()).collect();
        let console = Console::default();
        let mut c = config;
        c.serial.output = console.output();
        Vm::migrate_in_streams(&mut main, &mut pages, &c).map(|vm| (vm, console))
    });
    (addr, t)
}

#[test]
fn pages_travel_on_page_streams_beside_the_conversation() {
    require_kvm();
    // The dirty test rewrites its working set on 2 vCPUs while it moves, so later passes
    // resend pages the first sent: on the stream that carries their chunk, never overtaking.
    let console = Console::default();
    let config = dirty_config(2, 256, 150, &console);
    let vm = Vm::build(&config).unwrap();
    wait_progress(&console, "dirty", "pass=3", T);
    let (addr, receiver) = target_with_page_streams(&config, 3);
    let mut main = connect(addr);
    let mut pages: Vec<TcpStream> = (0..3).map(|_| connect(addr)).collect();
    let stats = vm
        .migrate_out_streams(
            &mut main,
            &mut pages,
            &MigrationConfig::default(),
            &mut |_| {},
        )
        .expect("migration on page streams");
    drop(pages);
    assert_eq!(vm.wait(), VmEnd::Migrated);
    let (vm, console) = receiver.join().unwrap().expect("target");
    let run = run_to_end(vm, &console, T);
    let r = expect_probe_ok(&run, "dirty");
    assert_eq!(r.field("passes"), Some("150"));
    assert!(stats.passes >= 1 && stats.bytes_sent > 0, "{stats:?}");

    // A target given another number of page streams refuses before any memory moves, with
    // the reason, and the guest runs on at the source.
    let console = Console::default();
    let config = dirty_config(1, 64, 100_000, &console);
    let vm = Vm::build(&config).unwrap();
    wait_progress(&console, "dirty", "pass=1", T);
    let (addr, receiver) = target_with_page_streams(&config, 1);
    let mut main = connect(addr);
    let mut pages: Vec<TcpStream> = (0..1).map(|_| connect(addr)).collect();
    let mut two = vec![pages.remove(0), connect(addr)];
    let e = vm
        .migrate_out_streams(
            &mut main,
            &mut two,
            &MigrationConfig::default(),
            &mut |_| {},
        )
        .expect_err("a target prepared for one page stream");
    assert!(
        e.to_string()
            .contains("on 2 page stream(s), this target was given 1"),
        "{e}"
    );
    assert!(receiver.join().unwrap().is_err());
    assert_runs_on_source(&vm, "refused page streams");
    vm.stop();
    let _ = vm.wait();
}
