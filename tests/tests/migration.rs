//! Pre-copy live migration between two VMs over TCP, judged by the probe: the `dirty` test
//! verifies its whole working set every pass, so the guest finishing OK on the target means no
//! page was lost on the way; every failure leaves the guest running on the source.

use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use tests::*;
use vmm::migration::{MigrationConfig, MigrationError};
use vmm::{Vm, VmConfig, VmEnd};

const T: Duration = Duration::from_secs(120);

/// A target listening on loopback; returns its address and the thread that receives the VM
/// (with `config`'s console replaced by its own) and runs it to its end.
fn target(
    config: &VmConfig,
) -> (
    std::net::SocketAddr,
    std::thread::JoinHandle<Result<ProbeRun, MigrationError>>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let config = config.clone();
    let t = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let console = Console::default();
        let mut c = config;
        c.serial.output = console.output();
        let vm = Vm::migrate_in(&mut s, &c)?;
        Ok(run_to_end(vm, &console, T))
    });
    (addr, t)
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
        let mut s = TcpStream::connect(addr).unwrap();
        let mut rounds = Vec::new();
        let stats = vm
            .migrate_out(&mut s, &MigrationConfig::default(), &mut |p| rounds.push(p))
            .expect("migration");
        assert_eq!(vm.end_signal().get(), Some(VmEnd::Migrated));
        assert_eq!(vm.wait(), VmEnd::Migrated);
        let run = receiver.join().unwrap().expect("target");
        let r = expect_probe_ok(&run, "dirty");
        assert_eq!(r.field("passes"), Some("150"));
        assert_eq!(r.field("cpus"), Some(vcpus.to_string().as_str()));
        assert!(
            !run.console.contains("probe guest: hello"),
            "{}",
            run.console
        );
        assert!(!rounds.is_empty() && stats.bytes_sent > 0, "{stats:?}");
        // Only what the guest touched crossed the wire, not all of RAM.
        assert!(stats.bytes_sent < (mib << 20) / 2, "{stats:?}");
    }
}

#[test]
fn a_refused_migration_leaves_the_guest_running_on_the_source() {
    require_kvm();
    let console = Console::default();
    let config = dirty_config(1, 128, 30, &console);
    let vm = Vm::build(&config).unwrap();
    wait_progress(&console, "dirty", "pass=1", T);
    let mut other = config.clone();
    other.memory_mib = 256;
    let (addr, receiver) = target(&other);
    let e = vm
        .migrate_out(
            &mut TcpStream::connect(addr).unwrap(),
            &MigrationConfig::default(),
            &mut |_| {},
        )
        .expect_err("refused");
    assert!(e.to_string().contains("prepared for 1 and 256"), "{e}");
    assert!(matches!(
        receiver.join().unwrap(),
        Err(MigrationError::Refused(_))
    ));
    let run = run_to_end(vm, &console, T);
    expect_probe_ok(&run, "dirty");
}

#[test]
fn a_target_that_dies_or_a_timeout_leaves_the_guest_on_the_source() {
    require_kvm();
    let console = Console::default();
    let config = dirty_config(2, 128, 60, &console);
    let vm = Vm::build(&config).unwrap();
    wait_progress(&console, "dirty", "pass=1", T);
    // A target that says Ready and then goes away.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let dying = std::thread::spawn(move || {
        use std::io::{Read, Write};
        let (mut s, _) = listener.accept().unwrap();
        let mut b = [0u8; 4096];
        let _ = s.read(&mut b);
        s.write_all(&[10, 0, 0, 0, 0]).unwrap(); // Ready
        let _ = s.read(&mut b);
    });
    let e = vm
        .migrate_out(
            &mut TcpStream::connect(addr).unwrap(),
            &MigrationConfig::default(),
            &mut |_| {},
        )
        .expect_err("the target died");
    dying.join().unwrap();
    assert!(matches!(e, MigrationError::Wire(_)), "{e}");
    assert!(vm.end_signal().get().is_none());
    assert!(!vm.is_paused());
    // A migration that cannot converge in time is cancelled.
    let (addr, receiver) = target(&config);
    let cfg = MigrationConfig {
        completion_timeout: Duration::ZERO,
        ..Default::default()
    };
    let e = vm
        .migrate_out(&mut TcpStream::connect(addr).unwrap(), &cfg, &mut |_| {})
        .expect_err("timeout");
    assert!(matches!(e, MigrationError::Timeout(_)), "{e}");
    assert!(matches!(
        receiver.join().unwrap(),
        Err(MigrationError::Cancelled(_))
    ));
    let run = run_to_end(vm, &console, T);
    expect_probe_ok(&run, "dirty");
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
    let (addr, receiver) = target(&config);
    vm.migrate_out(
        &mut TcpStream::connect(addr).unwrap(),
        &MigrationConfig::default(),
        &mut |_| {},
    )
    .expect("migration");
    // The source lets go of the disk; the target takes its lock.
    drop(vm);
    let run = receiver.join().unwrap().expect("target");
    assert_eq!(
        expect_probe_ok(&run, "blkstream").field("written"),
        Some("512")
    );
    assert_blkstream_image(&image, 512);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn garbage_on_the_migration_port_is_refused() {
    require_kvm();
    let console = Console::default();
    let config = dirty_config(1, 64, 1, &console);
    for garbage in [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        b"MVRTMIGR\x01\x00\x00\x00\x01\xff\xff\xff\xff".to_vec(),
        b"MVRTMIGR\x01\x00\x00\x00\x02\x10\x00\x00\x00".to_vec(),
    ] {
        let (addr, receiver) = target(&config);
        use std::io::Write;
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&garbage).unwrap();
        drop(s);
        assert!(receiver.join().unwrap().is_err());
    }
}
