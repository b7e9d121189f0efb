//! vhost-user-net on /dev/kvm against DPDK's testpmd (a real vhost-user switch, no huge pages):
//! the probe's frames go out through the backend and come back, in `io` and `macswap`
//! forwarding; the MAC is the frontend's; a backend killed under the VM leaves the VMM alive.

use std::path::PathBuf;
use std::time::Duration;

use tests::peers::testpmd;
use tests::*;
use vmm::config::{MacAddr, VhostUserNetConfig};
use vmm::{Vm, VmEnd};

const T: Duration = Duration::from_secs(180);

/// testpmd busy-polls a core: one switch at a time, or the emulated guests starve.
static ONE_SWITCH: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn workdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mv-vunet-it-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn run_loop(mode: &str) -> ProbeResult {
    require_kvm();
    let _one = ONE_SWITCH.lock().unwrap_or_else(|p| p.into_inner());
    let dir = workdir(mode);
    let socket = dir.join("net.sock");
    let _switch = testpmd(&socket, mode);
    let console = Console::default();
    let mut cfg = probe_config("netloop", 1, 64, &console);
    cfg.vhost_user_nets = vec![VhostUserNetConfig {
        socket: socket.clone(),
        mac: Some("52:54:00:aa:bb:01".parse::<MacAddr>().unwrap()),
    }];
    let vm = Vm::build(&cfg).expect("building the VM");
    // DPDK's vhost library logs what it writes (VHOST_F_LOG_ALL, LOG_SHMFD): a migration
    // could carry this NIC.
    vm.check_migratable()
        .expect("a NIC on testpmd is migratable");
    let run = run_to_end(vm, &console, T);
    let r = expect_probe_ok(&run, "netloop");
    let _ = std::fs::remove_dir_all(&dir);
    r
}

#[test]
fn frames_come_back_through_testpmd_as_sent_in_io_mode() {
    let r = run_loop("io");
    assert_eq!(r.field("mac"), Some("52:54:00:aa:bb:01"));
    assert_eq!(r.field("link"), Some("1"));
    assert_eq!(r.field("looped"), Some("3"));
    assert_eq!(r.field("swapped"), Some("0"));
}

#[test]
fn frames_come_back_through_testpmd_with_addresses_swapped_in_macswap_mode() {
    let r = run_loop("macswap");
    assert_eq!(r.field("looped"), Some("3"));
    assert_eq!(r.field("swapped"), Some("3"));
}

#[test]
fn a_switch_killed_under_the_vm_leaves_the_vmm_running() {
    require_kvm();
    let _one = ONE_SWITCH.lock().unwrap_or_else(|p| p.into_inner());
    let dir = workdir("kill");
    let socket = dir.join("net.sock");
    let mut switch = testpmd(&socket, "io");
    let console = Console::default();
    // The probe's echo test waits for frames that never come: the VM is up and its NIC
    // handed to the switch when the switch dies.
    let mut cfg = probe_config("net", 1, 64, &console);
    cfg.vhost_user_nets = vec![VhostUserNetConfig {
        socket: socket.clone(),
        mac: None,
    }];
    let vm = Vm::build(&cfg).expect("building the VM");
    assert!(
        console.wait_for("microvirt probe guest: hello", T),
        "{}",
        console.text()
    );
    std::thread::sleep(Duration::from_secs(2));
    switch.kill();
    std::thread::sleep(Duration::from_secs(1));
    assert!(vm.end_signal().get().is_none(), "{}", console.text());
    vm.stop();
    assert_eq!(vm.wait(), VmEnd::Stopped);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The probe's frames looped twice on a NIC of `socket`, the second round once a line is
/// written to the returned console input.
fn two_rounds(socket: &std::path::Path, console: &Console) -> (vmm::VmConfig, std::fs::File) {
    let mut cfg = probe_config("netloop", 1, 64, console);
    cfg.cmdline.push_str(" probe.rounds=2");
    let mut fds = [0i32; 2];
    // SAFETY: pipe fills two descriptors this test owns.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    cfg.serial.input = vmm::SerialInput::Fd(fds[0]);
    cfg.vhost_user_nets = vec![VhostUserNetConfig {
        socket: socket.to_path_buf(),
        mac: Some("52:54:00:aa:bb:03".parse::<MacAddr>().unwrap()),
    }];
    // SAFETY: the write end is ours.
    let input = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fds[1]) };
    (cfg, input)
}

/// A switch restarted on the same socket (OVS-DPDK being upgraded): the NIC waits for it,
/// hands its rings to the new process from where the guest's used indexes stand, and the
/// guest's next frames go through it — no reset, no reboot.
#[test]
fn a_switch_restarted_on_its_socket_gets_the_running_nic_back() {
    require_kvm();
    let _one = ONE_SWITCH.lock().unwrap_or_else(|p| p.into_inner());
    let dir = workdir("restart");
    let socket = dir.join("net.sock");
    let mut switch = testpmd(&socket, "io");
    let console = Console::default();
    let (cfg, mut input) = two_rounds(&socket, &console);
    let vm = Vm::build(&cfg).expect("building the VM");
    let c = console.clone();
    let run = std::thread::spawn(move || run_to_end(vm, &c, T));
    assert!(
        console.wait_for("PROBE NETLOOP ROUND 1 OK", T),
        "{}",
        console.text()
    );
    switch.kill();
    std::thread::sleep(Duration::from_secs(1));
    let _again = testpmd(&socket, "io");
    std::io::Write::write_all(&mut input, b"\n").unwrap();
    let run = run.join().unwrap();
    let r = expect_probe_ok(&run, "netloop");
    assert_eq!(r.field("looped"), Some("3"));
    assert_eq!(r.field("mac"), Some("52:54:00:aa:bb:03"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A VM whose NIC is on one testpmd migrates to a target whose NIC is on another: the source's
/// rings are taken back at stop-and-copy with their positions, handed to the target's switch
/// there, and the guest's second round of frames goes through the target's switch.
#[test]
fn a_nic_on_a_switch_migrates_to_the_targets_switch() {
    require_kvm();
    let _one = ONE_SWITCH.lock().unwrap_or_else(|p| p.into_inner());
    let dir = workdir("migrate");
    let (s1, s2) = (dir.join("source.sock"), dir.join("target.sock"));
    let source_switch = testpmd(&s1, "io");
    let console = Console::default();
    let (cfg, _source_input) = two_rounds(&s1, &console);
    let vm = Vm::build(&cfg).expect("building the VM");
    assert!(
        console.wait_for("PROBE NETLOOP ROUND 1 OK", T),
        "{}",
        console.text()
    );
    vm.check_migratable().expect("a NIC on testpmd migrates");
    let _target_switch = testpmd(&s2, "io");
    let (target_cfg, mut target_input) = two_rounds(&s2, &console);
    let (addr, receiver) = migration_target(target_cfg);
    migrate_to(&vm, addr).expect("migration");
    let (target_vm, target_console) = receiver.join().unwrap().expect("target");
    assert_eq!(vm.end_signal().get(), Some(VmEnd::Migrated));
    drop(vm);
    drop(source_switch);
    std::io::Write::write_all(&mut target_input, b"\n").unwrap();
    let run = run_to_end(target_vm, &target_console, T);
    let r = expect_probe_ok(&run, "netloop");
    assert_eq!(r.field("looped"), Some("3"));
    let _ = std::fs::remove_dir_all(&dir);
}
