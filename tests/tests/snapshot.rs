//! Quiesce, snapshot and restore on /dev/kvm, judged by the probe guest: the `dirty` test
//! verifies every page of its working set each pass, so a lost or torn page fails it; the
//! `timer` test shows interrupts keep coming after a restore.

use std::path::PathBuf;
use std::time::Duration;

use tests::*;
use vmm::{SnapshotPaths, Vm, VmConfig};

const T: Duration = Duration::from_secs(120);

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mv-snap-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Snapshots `vm` into `dir`, then ends it (as if the process had been killed).
fn snapshot_and_drop(vm: Vm, dir: &std::path::Path) -> vmm::SnapshotStats {
    let stats = vm
        .snapshot(&SnapshotPaths::in_dir(dir), true)
        .expect("snapshot");
    vm.stop();
    drop(vm);
    stats
}

/// A snapshot in a fresh scratch directory `tag` of the probe's dirty test (12 passes) taken
/// after its third pass: the directory, the VM's configuration, the source's console and what
/// the snapshot reported.
fn dirty_snapshot(
    tag: &str,
    vcpus: u8,
    mib: u64,
) -> (PathBuf, VmConfig, Console, vmm::SnapshotStats) {
    let dir = scratch(tag);
    let console = Console::default();
    let config = dirty_config(vcpus, mib, 12, &console);
    let vm = Vm::build(&config).unwrap();
    wait_progress(&console, "dirty", "pass=3", T);
    let stats = snapshot_and_drop(vm, &dir);
    (dir, config, console, stats)
}

#[test]
fn pause_stops_device_io_and_leaves_memory_bit_identical() {
    require_kvm();
    let console = Console::default();
    let vm = Vm::build(&dirty_config(2, 256, 1000, &console)).unwrap();
    wait_progress(&console, "dirty", "pass=1", T);
    vm.pause().unwrap();
    assert!(vm.is_paused());
    let snap = |vm: &Vm| {
        use vm_memory::{Bytes, GuestAddress};
        let mut buf = vec![0u8; 256 << 20];
        vm.memory().read_slice(&mut buf, GuestAddress(0)).unwrap();
        buf
    };
    let before = snap(&vm);
    let printed = console.len();
    std::thread::sleep(Duration::from_millis(500));
    let after = snap(&vm);
    assert!(before == after, "guest memory changed while paused");
    assert_eq!(console.len(), printed, "the guest printed while paused");
    vm.resume();
    wait_progress(&console, "dirty", "pass=3", T);
    vm.stop();
}

#[test]
fn dirty_probe_survives_snapshot_kill_restore() {
    require_kvm();
    // 4.5 GiB: RAM on both sides of the MMIO gap.
    for (vcpus, mib) in [(1u8, 256u64), (2, 256), (2, 4608)] {
        let (dir, config, _, stats) = dirty_snapshot(&format!("dirty-{vcpus}-{mib}"), vcpus, mib);
        assert!(
            stats.state_bytes > 0 && stats.state_bytes <= 64 << 10,
            "{stats:?}"
        );
        assert_eq!(stats.memory_bytes, mib << 20);
        assert!(
            stats.memory_written_bytes < stats.memory_bytes / 4,
            "{stats:?}"
        );
        let console2 = Console::default();
        let mut config2 = config.clone();
        config2.serial.output = console2.output();
        let vm = Vm::restore(&config2, &SnapshotPaths::in_dir(&dir)).expect("restore");
        let run = run_to_end(vm, &console2, T);
        let r = expect_probe_ok(&run, "dirty");
        assert_eq!(r.field("passes"), Some("12"));
        assert_eq!(r.field("cpus"), Some(vcpus.to_string().as_str()));
        assert!(
            !run.console.contains("PROBE PROGRESS dirty pass=1\n"),
            "restarted from scratch:\n{}",
            run.console
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}

/// Restores `dir` with `config` (its console replaced) and waits for the probe's result.
fn restore_to_end(config: &VmConfig, dir: &std::path::Path) -> ProbeRun {
    let console = Console::default();
    let mut c = config.clone();
    c.serial.output = console.output();
    let vm = Vm::restore(&c, &SnapshotPaths::in_dir(dir)).expect("restore");
    run_to_end(vm, &console, T)
}

#[test]
fn three_snapshot_restore_cycles_in_a_row() {
    require_kvm();
    let dir = scratch("thrice");
    let console = Console::default();
    let config = dirty_config(2, 256, 40, &console);
    let mut vm = Vm::build(&config).unwrap();
    let mut console = console;
    for round in 1..=3 {
        wait_progress(&console, "dirty", &format!("pass={}", round * 8), T);
        snapshot_and_drop(vm, &dir);
        console = Console::default();
        let mut c = config.clone();
        c.serial.output = console.output();
        vm = Vm::restore(&c, &SnapshotPaths::in_dir(&dir)).expect("restore");
    }
    let run = run_to_end(vm, &console, T);
    assert_eq!(expect_probe_ok(&run, "dirty").field("passes"), Some("40"));
    std::fs::remove_dir_all(dir).unwrap();
}

/// The generation IDs a probe console announced (`PROBE GENID`), in order.
fn generations(console: &str) -> Vec<String> {
    console
        .lines()
        .filter_map(|l| l.strip_prefix("PROBE GENID "))
        .map(str::to_owned)
        .collect()
}

/// Sandboxes: one snapshot restored twice at once, each restore a VM of its own. Both finish
/// the dirty test from where the snapshot was, the snapshot's memory file is unchanged by
/// what they write (each maps it privately), and each copy was told it is one: a VMGenID
/// generation of its own, found by the guest through the ACPI tables.
#[test]
fn one_snapshot_restored_twice_at_once_runs_two_vms_with_their_own_generation_ids() {
    require_kvm();
    let (dir, config, console, _) = dirty_snapshot("twice", 2, 256);
    let memory = std::fs::read(dir.join("memory")).unwrap();
    let runs = std::thread::scope(|s| {
        let a = s.spawn(|| restore_to_end(&config, &dir));
        let b = s.spawn(|| restore_to_end(&config, &dir));
        [a.join().unwrap(), b.join().unwrap()]
    });
    let source = generations(&console.text());
    assert_eq!(
        source.len(),
        1,
        "the source's one generation:\n{}",
        console.text()
    );
    assert_eq!(source[0].len(), 32);
    let mut copies = Vec::new();
    for run in &runs {
        let seen = generations(&run.console);
        assert_eq!(
            seen.len(),
            1,
            "one new generation after the restore:\n{}",
            run.console
        );
        assert_ne!(
            seen[0], source[0],
            "a restored copy kept the snapshot's generation"
        );
        copies.push(seen[0].clone());
        assert_eq!(expect_probe_ok(run, "dirty").field("passes"), Some("12"));
        assert!(
            !run.console.contains("PROBE PROGRESS dirty pass=1\n"),
            "restarted from scratch:\n{}",
            run.console
        );
    }
    assert_ne!(copies[0], copies[1], "two copies share a generation");
    assert!(
        std::fs::read(dir.join("memory")).unwrap() == memory,
        "a restored VM wrote into the snapshot's memory file"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn snapshot_without_stop_keeps_the_source_running() {
    require_kvm();
    let dir = scratch("live");
    let console = Console::default();
    let vm = Vm::build(&dirty_config(1, 128, 30, &console)).unwrap();
    wait_progress(&console, "dirty", "pass=2", T);
    let stats = vm.snapshot(&SnapshotPaths::in_dir(&dir), false).unwrap();
    assert!(!vm.is_paused());
    assert!(stats.paused_for < Duration::from_secs(10), "{stats:?}");
    let run = run_to_end(vm, &console, T);
    expect_probe_ok(&run, "dirty");
    // The snapshot taken along the way restores too.
    let run = restore_to_end(&dirty_config(1, 128, 30, &Console::default()), &dir);
    expect_probe_ok(&run, "dirty");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_corrupted_page_in_the_memory_file_fails_the_dirty_probe() {
    // The negative control: the dirty probe does notice a page that came back wrong.
    require_kvm();
    let (dir, config, _, _) = dirty_snapshot("badpage", 1, 256);
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join("memory"))
            .unwrap();
        f.write_all_at(&vec![0x5a; 16 << 20], 64 << 20).unwrap();
    }
    let run = restore_to_end(&config, &dir);
    let r = run.result.clone().expect("a result line");
    assert!(!r.ok, "{}", run.console);
    let bad =
        u64::from_str_radix(r.field("first_bad").unwrap().trim_start_matches("0x"), 16).unwrap();
    assert!((64 << 20..80 << 20).contains(&bad), "{}", r.details);
    std::fs::remove_dir_all(dir).unwrap();
}

/// The timer probe with `args`, snapshotted once it has counted 20 ticks: its snapshot
/// directory, its config and what its console said before.
fn ticking_snapshot(name: &str, args: &str) -> (PathBuf, VmConfig, String) {
    let dir = scratch(name);
    let console = Console::default();
    let mut config = probe_config("timer", 1, 64, &console);
    config.cmdline.push_str(args);
    let vm = Vm::build(&config).unwrap();
    wait_progress(&console, "timer", "ticks=20", T);
    snapshot_and_drop(vm, &dir);
    (dir, config, console.text())
}

#[test]
fn timer_interrupts_keep_coming_after_restore() {
    require_kvm();
    let (dir, config, _) = ticking_snapshot("timer", " probe.ticks=80");
    let run = restore_to_end(&config, &dir);
    let r = expect_probe_ok(&run, "timer");
    assert!(r.field("ticks").unwrap().parse::<u64>().unwrap() >= 80);
    assert!(
        run.console.contains("PROBE PROGRESS timer ticks=70"),
        "{}",
        run.console
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// A guest listening to the GED hears of its new generation the moment it is restored: the
/// interrupt, then the new ID, before its next timer line.
#[test]
fn a_restored_guest_is_told_of_its_new_generation_through_the_ged() {
    require_kvm();
    let (dir, config, before) = ticking_snapshot("ged", " probe.ticks=60 probe.acpi=1");
    let before = generations(&before);
    let run = restore_to_end(&config, &dir);
    expect_probe_ok(&run, "timer");
    let told = run
        .console
        .find("probe: GED says a new generation\nPROBE GENID ")
        .unwrap_or_else(|| panic!("not told through the GED:\n{}", run.console));
    let first_tick = run.console.find("PROBE PROGRESS timer").unwrap();
    assert!(told < first_tick, "told only later:\n{}", run.console);
    let after = generations(&run.console);
    assert_eq!(after.len(), 1, "{}", run.console);
    assert_ne!(after, before);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn disk_being_written_holds_exactly_what_the_guest_wrote() {
    require_kvm();
    let dir = scratch("blk");
    let console = Console::default();
    let (config, image) = blkstream_config(&dir, 512, &console);
    let vm = Vm::build(&config).unwrap();
    wait_progress(&console, "blkstream", "writes=128", T);
    snapshot_and_drop(vm, &dir);
    let run = restore_to_end(&config, &dir);
    let r = expect_probe_ok(&run, "blkstream");
    assert_eq!(r.field("written"), Some("512"));
    assert_blkstream_image(&image, 512);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A network namespace holding an up TAP `tap` (vnet_hdr, no IPv6 chatter).
fn netns_with_tap(tag: &str, tap: &str) -> NetNs {
    let ns = NetNs::new(tag);
    ns.exec(&["ip", "tuntap", "add", tap, "mode", "tap", "vnet_hdr"]);
    ns.exec(&[
        "sysctl",
        "-q",
        "-w",
        &format!("net.ipv6.conf.{tap}.disable_ipv6=1"),
    ]);
    ns.exec(&["ip", "link", "set", tap, "up"]);
    ns
}

/// The probe's `net` test on TAP `tap`, its MAC derived (none given), and its console.
fn net_probe(tap: &str) -> (Console, VmConfig) {
    let console = Console::default();
    let mut config = probe_config("net", 1, 64, &console);
    config.nets = vec![vmm::config::NetConfig {
        tap: vmm::config::TapSource::Name(tap.into()),
        mac: None,
    }];
    (console, config)
}

#[test]
fn nic_keeps_echoing_across_restore() {
    const HOST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 1];
    require_kvm();
    let ns = netns_with_tap("snapnet", "mvsnap0");
    let ns_name = ns.name.clone();
    let dir = scratch("net");
    let d = dir.clone();
    std::thread::spawn(move || {
        let dir = d;
        let ns = NetNs { name: ns_name };
        ns.enter();
        std::mem::forget(ns);
        let wire = PacketSocket::bind("mvsnap0");
        let (_console, config) = net_probe("mvsnap0");
        // No MAC given: the derived one must be the same after the restore.
        let vm = Vm::build(&config).unwrap();
        let mac = vm.nets()[0].lock().unwrap().mac();
        let t = Duration::from_secs(60);
        let peer = ProbeNetPeer {
            wire: &wire,
            guest: mac.0,
            me: HOST_MAC,
        };
        peer.greetings(t);
        for i in 0..3 {
            peer.ping(i, t);
        }
        let counters = vm.nets()[0].lock().unwrap().counters;
        snapshot_and_drop(vm, &dir);
        let console = Console::default();
        let mut c = config.clone();
        c.serial.output = console.output();
        let vm = Vm::restore(&c, &SnapshotPaths::in_dir(&dir)).expect("restore");
        assert_eq!(vm.nets()[0].lock().unwrap().mac(), mac, "the MAC survived");
        assert_eq!(
            vm.nets()[0].lock().unwrap().counters,
            counters,
            "counters survived"
        );
        for i in 3..6 {
            peer.ping(i, t);
        }
        peer.done();
        let run = run_to_end(vm, &console, t);
        let r = expect_probe_ok(&run, "net");
        assert_eq!(r.field("echoed"), Some("6"));
    })
    .join()
    .unwrap();
    drop(ns);
    std::fs::remove_dir_all(dir).unwrap();
}

/// Clones of one running snapshot: restored with a MAC of its own, the NIC's config space holds
/// it and the guest is told through the config change interrupt (it reads the MAC again,
/// announces `PROBE MAC`, and answers from it); restored without one, the copy keeps the
/// snapshot's MAC and is told nothing.
#[test]
fn a_clone_restored_with_its_own_mac_is_told_of_it() {
    use vmm::config::MacAddr;
    const HOST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 1];
    const CLONE_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x77];
    require_kvm();
    let ns = netns_with_tap("snapmac", "mvsnap1");
    let ns_name = ns.name.clone();
    let dir = scratch("mac");
    let d = dir.clone();
    std::thread::spawn(move || {
        let dir = d;
        let ns = NetNs { name: ns_name };
        ns.enter();
        std::mem::forget(ns);
        let wire = PacketSocket::bind("mvsnap1");
        let (_console, config) = net_probe("mvsnap1");
        let vm = Vm::build(&config).unwrap();
        let mac = vm.nets()[0].lock().unwrap().mac();
        let t = Duration::from_secs(60);
        let peer = |guest: [u8; 6]| ProbeNetPeer {
            wire: &wire,
            guest,
            me: HOST_MAC,
        };
        peer(mac.0).greetings(t);
        peer(mac.0).ping(0, t);
        snapshot_and_drop(vm, &dir);

        // The clone with its own MAC.
        let console = Console::default();
        let mut c = config.clone();
        c.serial.output = console.output();
        c.nets[0].mac = Some(MacAddr(CLONE_MAC));
        let vm = Vm::restore(&c, &SnapshotPaths::in_dir(&dir)).expect("restore");
        assert_eq!(vm.nets()[0].lock().unwrap().mac(), MacAddr(CLONE_MAC));
        let pong = peer(CLONE_MAC).ping(1, t);
        assert_eq!(pong[6..12], CLONE_MAC, "the clone answers from its new MAC");
        peer(CLONE_MAC).done();
        let run = run_to_end(vm, &console, t);
        assert!(
            run.console.contains("PROBE MAC 02:00:00:00:00:77\n"),
            "the guest was not told:\n{}",
            run.console
        );
        let r = expect_probe_ok(&run, "net");
        assert_eq!(r.field("mac"), Some("02:00:00:00:00:77"));

        // Another copy of the same snapshot, no MAC given: the snapshot's, nothing announced.
        let console = Console::default();
        let mut c = config.clone();
        c.serial.output = console.output();
        let vm = Vm::restore(&c, &SnapshotPaths::in_dir(&dir)).expect("restore");
        assert_eq!(vm.nets()[0].lock().unwrap().mac(), mac);
        let pong = peer(mac.0).ping(1, t);
        assert_eq!(pong[6..12], mac.0);
        peer(mac.0).done();
        let run = run_to_end(vm, &console, t);
        assert!(!run.console.contains("PROBE MAC"), "{}", run.console);
        expect_probe_ok(&run, "net");
    })
    .join()
    .unwrap();
    drop(ns);
    std::fs::remove_dir_all(dir).unwrap();
}

/// Each bad input is refused with one clear error before anything starts.
#[test]
fn bad_snapshots_are_refused_with_a_clear_error() {
    require_kvm();
    let dir = scratch("bad");
    let image = dir.join("disk.img");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let console = Console::default();
    let mut config = dirty_config(1, 128, 1000, &console);
    config.disks = vec![vmm::config::DiskConfig::new(&image)];
    config.rng = true;
    let vm = Vm::build(&config).unwrap();
    wait_progress(&console, "dirty", "pass=1", T);
    snapshot_and_drop(vm, &dir);
    let paths = SnapshotPaths::in_dir(&dir);
    let good = std::fs::read(&paths.state).unwrap();
    let refuse = |c: &VmConfig, expect: &str| {
        let e = Vm::restore(c, &paths).expect_err("must be refused");
        assert!(e.is_config_error(), "{e}");
        assert!(
            e.to_string().contains(expect),
            "{e:?} does not say {expect:?}"
        );
    };
    let mut two = config.clone();
    two.vcpus = 2;
    refuse(&two, "the snapshot has 1 vCPU(s), 2 were asked for");
    let mut more = config.clone();
    more.memory_mib = 256;
    refuse(
        &more,
        "the snapshot has 128 MiB of memory, 256 MiB were asked for",
    );
    let mut no_rng = config.clone();
    no_rng.rng = false;
    refuse(
        &no_rng,
        "the snapshot has 1 virtio-rng device(s), the configuration 0",
    );

    let mut v = good.clone();
    v[8..12].copy_from_slice(&7u32.to_le_bytes());
    std::fs::write(&paths.state, &v).unwrap();
    refuse(&config, "format version 7");
    std::fs::write(&paths.state, &good[..good.len() / 2]).unwrap();
    refuse(&config, "truncated");
    let mut c = good.clone();
    let mid = c.len() / 2;
    c[mid] ^= 0x40;
    std::fs::write(&paths.state, &c).unwrap();
    refuse(&config, "checksum mismatch");
    std::fs::write(&paths.state, b"not a state file at all").unwrap();
    refuse(&config, "bad magic");
    std::fs::write(&paths.state, &good).unwrap();

    let mem = std::fs::read(&paths.memory).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&paths.memory)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    refuse(&config, "too short for guest RAM");
    std::fs::write(&paths.memory, &mem).unwrap();
    // Both files are private to their owner.
    use std::os::unix::fs::PermissionsExt;
    for p in [&paths.state, &paths.memory] {
        let mode = std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}", p.display());
    }
    // Memory from another snapshot of the same machine (a crash between the two renames, or
    // files copied from two snapshots): refused, never run.
    let other = scratch("bad-other");
    let vm = Vm::restore(&config, &paths).expect("the pair restores");
    snapshot_and_drop(vm, &other);
    std::fs::copy(other.join("memory"), &paths.memory).unwrap();
    refuse(&config, "belongs to another snapshot than the state file");
    std::fs::write(&paths.memory, &mem).unwrap();
    // A link planted where the state's temporary goes is replaced, not followed.
    let victim = other.join("victim");
    std::fs::write(&victim, b"keep").unwrap();
    let vm = Vm::restore(&config, &paths).expect("the pair restores");
    std::os::unix::fs::symlink(&victim, paths.state.with_extension("tmp")).unwrap();
    std::os::unix::fs::symlink(&victim, paths.memory.with_extension("tmp")).unwrap();
    snapshot_and_drop(vm, &dir);
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
    std::fs::remove_dir_all(other).unwrap();

    std::fs::remove_file(&image).unwrap();
    refuse(&config, "no such file");
    let mut no_disk = config.clone();
    no_disk.disks.clear();
    refuse(&no_disk, "the snapshot has 1 disk(s)");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn dirty_log_covers_every_page_the_guest_changed() {
    require_kvm();
    let console = Console::default();
    let vm = Vm::build(&dirty_config(2, 256, 100_000, &console)).unwrap();
    wait_progress(&console, "dirty", "pass=1", T);
    let copy = |vm: &Vm| {
        use vm_memory::{Bytes, GuestAddress};
        let mut buf = vec![0u8; 256 << 20];
        vm.memory().read_slice(&mut buf, GuestAddress(0)).unwrap();
        buf
    };
    vm.start_dirty_log().unwrap();
    vm.pause().unwrap();
    let _ = vm.dirty_log().unwrap();
    let a = copy(&vm);
    vm.resume();
    wait_progress(&console, "dirty", "pass=4", T);
    vm.pause().unwrap();
    let b = copy(&vm);
    let log = vm.dirty_log().unwrap();
    let mut changed = 0;
    for (i, (pa, pb)) in a.chunks(4096).zip(b.chunks(4096)).enumerate() {
        if pa != pb {
            changed += 1;
            assert!(
                log.contains(i as u64 * 4096),
                "page {:#x} changed but is not in the dirty log",
                i * 4096
            );
        }
    }
    assert!(changed >= 2048, "the guest changed {changed} pages");
    assert!(log.page_count() >= changed);
    // Nothing ran since: nothing is dirty.
    assert_eq!(vm.dirty_log().unwrap().page_count(), 0);
    vm.stop_dirty_log().unwrap();
    vm.resume();
    wait_progress(&console, "dirty", "pass=6", T);
    vm.stop();
}

#[test]
fn a_failed_snapshot_leaves_the_vm_running() {
    require_kvm();
    let console = Console::default();
    let vm = Vm::build(&dirty_config(1, 128, 20, &console)).unwrap();
    wait_progress(&console, "dirty", "pass=1", T);
    let nowhere = SnapshotPaths::in_dir(std::path::Path::new("/proc/no-such-dir"));
    let e = vm.snapshot(&nowhere, true).expect_err("cannot write there");
    assert!(e.to_string().contains("/proc/no-such-dir"), "{e}");
    assert!(
        !vm.is_paused(),
        "a failed snapshot must resume the VM even with stay_paused"
    );
    let run = run_to_end(vm, &console, T);
    expect_probe_ok(&run, "dirty");
}
