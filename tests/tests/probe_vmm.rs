//! The VMM on /dev/kvm, driven with the probe guest.

use std::time::Duration;

use tests::*;
use vmm::layout::{EBDA_START, HIMEM_START, MIB, MMIO_GAP_START};
use vmm::{Vm, VmEnd};

const T: Duration = Duration::from_secs(60);

/// RAM the e820 map must report for a guest of `mib`: all of it but the EBDA..1 MiB hole.
fn expected_ram_kib(mib: u64) -> u64 {
    (mib * MIB - (HIMEM_START - EBDA_START)) >> 10
}

#[test]
fn boot_reports_e820_matching_config() {
    for (vcpus, mib) in [(1, 64), (2, 256)] {
        let run = run_probe("boot", vcpus, mib, T);
        assert!(
            run.console.starts_with("microvirt probe guest: hello"),
            "{}",
            run.console
        );
        let r = expect_probe_ok(&run, "boot");
        assert_eq!(
            r.field("ram_kib"),
            Some(expected_ram_kib(mib).to_string().as_str()),
            "{}",
            run.console
        );
        assert_eq!(r.field("e820"), Some("3"));
        // The command line arrived intact.
        assert_eq!(r.field("cmdline_len"), Some("29"));
    }
}

/// The guest finds the VMGenID device the way an ACPI guest does (RSDP, XSDT, FADT, DSDT,
/// the device's ADDR) and reads there the generation ID the VMM wrote, each boot its own.
#[test]
fn the_guest_reads_the_generation_id_through_the_acpi_tables() {
    require_kvm();
    let mut seen = Vec::new();
    for _ in 0..2 {
        let console = Console::default();
        let vm = Vm::build(&probe_config("boot", 1, 64, &console)).unwrap();
        let host: String = vm
            .generation()
            .expect("a generation ID in guest memory")
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let run = run_to_end(vm, &console, T);
        expect_probe_ok(&run, "boot");
        let guest: Vec<&str> = run
            .console
            .lines()
            .filter_map(|l| l.strip_prefix("PROBE GENID "))
            .collect();
        assert_eq!(guest, [host.as_str()], "{}", run.console);
        seen.push(host);
    }
    assert_ne!(seen[0], seen[1], "two boots, one generation ID");
}

#[test]
fn memory_pattern_across_all_ram() {
    for mib in [64u64, 1024, 3072] {
        let r = expect_probe_ok(&run_probe("memory", 1, mib, T), "memory");
        assert_eq!(r.field("above_4g"), Some("0"));
        assert_eq!(r.field("top"), Some(format!("{:#x}", mib * MIB).as_str()));
    }
}

#[test]
fn memory_above_the_mmio_gap() {
    // 5 GiB: 3 GiB below the gap, 2 GiB above 4 GiB.
    let mib = 5 * 1024;
    let run = run_probe("memory", 2, mib, T);
    let r = expect_probe_ok(&run, "memory");
    assert_ne!(r.field("above_4g"), Some("0"));
    let top = 0x1_0000_0000u64 + (mib * MIB - MMIO_GAP_START);
    assert_eq!(r.field("top"), Some(format!("{top:#x}").as_str()));
    let run = run_probe("boot", 1, mib, T);
    let r = expect_probe_ok(&run, "boot");
    assert_eq!(r.field("e820"), Some("4"));
    assert_eq!(
        r.field("ram_kib"),
        Some(expected_ram_kib(mib).to_string().as_str())
    );
}

#[test]
fn smp_every_vcpu_checks_in() {
    for vcpus in [1u8, 2, 4] {
        let run = run_probe("smp", vcpus, 128, T);
        let r = expect_probe_ok(&run, "smp");
        assert_eq!(
            r.field("cpus"),
            Some(vcpus.to_string().as_str()),
            "{}",
            run.console
        );
        assert_eq!(r.field("mptable_cpus"), Some(vcpus.to_string().as_str()));
        assert_eq!(
            r.field("apic_mask"),
            Some(format!("{:#x}", (1u64 << vcpus) - 1).as_str())
        );
    }
}

#[test]
fn triple_fault_is_reported() {
    let start = std::time::Instant::now();
    let run = run_probe("triplefault", 1, 64, T);
    assert_eq!(run.end, VmEnd::TripleFault { vcpu: 0 }, "{}", run.console);
    assert!(run.result.is_none());
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn unemulated_instruction_is_reported_with_its_bytes() {
    let run = run_probe("popcnt", 1, 64, T);
    let kvm = vmm::KvmContext::open().unwrap();
    if kvm.acceleration.is_software_emulated() {
        match &run.end {
            VmEnd::InternalError {
                vcpu: 0,
                suberror: 1,
                rip,
                insn,
            } => {
                // popcnt r64, r/m64 = F3 REX.W 0F B8
                assert_eq!(&insn[..4], &[0xf3, 0x48, 0x0f, 0xb8], "{:?}", run.end);
                assert!(*rip >= 0x20_0000);
                assert!(run.end.to_string().contains("emulation failure"));
            }
            other => panic!("expected an internal error, got {other:?}\n{}", run.console),
        }
    } else {
        // Hardware KVM runs POPCNT natively.
        expect_probe_ok(&run, "popcnt");
    }
}

#[test]
fn i8042_reset_is_reported() {
    let run = run_probe("reset", 1, 64, T);
    assert_eq!(run.end, VmEnd::Reset, "{}", run.console);
}

#[test]
fn pause_stops_the_guest_and_resume_continues_it() {
    require_kvm();
    let console = Console::default();
    let dir = std::env::temp_dir().join(format!("mv-console-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("in.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let mut cfg = probe_config("console", 2, 64, &console);
    cfg.serial.input = vmm::SerialInput::UnixSocket(sock.clone());
    let vm = Vm::build(&cfg).unwrap();
    let (mut input, _) = listener.accept().unwrap();
    assert!(console.wait_for("tick 2", T), "{}", console.text());
    let rips = vm.vcpu_rips();
    assert_eq!(rips.len(), 2, "{rips:x?}");
    assert!(
        rips[0].1 >= 0x20_0000,
        "the BSP runs the probe (loaded at 2 MiB): {rips:x?}"
    );
    vm.pause().unwrap();
    assert_eq!(vm.state(), vmm::vcpu::RunState::Paused);
    let len = console.len();
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        console.len(),
        len,
        "guest ran while paused:\n{}",
        console.text()
    );
    vm.resume();
    let tick = format!("tick {}", console.text().matches("tick ").count() + 1);
    assert!(
        console.wait_for(&tick, T),
        "guest did not continue after resume:\n{}",
        console.text()
    );
    use std::io::Write;
    input.write_all(b"hello\n").unwrap();
    let run = run_to_end(vm, &console, T);
    let r = expect_probe_ok(&run, "console");
    assert_eq!(r.field("received"), Some("hello"));
    std::fs::remove_dir_all(dir).unwrap();
}

/// A graceful shutdown presses the ACPI power button for a guest that listens to the GED:
/// its interrupt arrives, the event register says "power button", and the guest powers off
/// through the FADT's sleep control register. A guest that does not listen gets Ctrl-Alt-Del.
#[test]
fn a_shutdown_request_presses_the_acpi_power_button_for_a_guest_that_listens() {
    require_kvm();
    use vmm::ShutdownRequest::{AcpiPowerButton, CtrlAltDel};
    for (listens, expected) in [(true, AcpiPowerButton), (false, CtrlAltDel)] {
        let console = Console::default();
        let mut config = probe_config("timer", 1, 64, &console);
        config.cmdline.push_str(" probe.ticks=100000");
        if listens {
            config.cmdline.push_str(" probe.acpi=1");
        }
        let vm = Vm::build(&config).unwrap();
        wait_progress(&console, "timer", "ticks=10", T);
        assert_eq!(vm.request_shutdown(), expected);
        if !listens {
            vm.stop();
            continue;
        }
        let run = run_to_end(vm, &console, T);
        assert!(
            run.console.contains("PROBE ACPI power button"),
            "{}",
            run.console
        );
        assert_eq!(run.end, VmEnd::PoweredOff, "{}", run.console);
    }
}

#[test]
fn ctrl_alt_del_reaches_the_guest_keyboard() {
    require_kvm();
    let console = Console::default();
    let vm = Vm::build(&probe_config("keyboard", 1, 64, &console)).unwrap();
    assert!(console.wait_for("keyboard ready", T), "{}", console.text());
    vm.ctrl_alt_del();
    let run = run_to_end(vm, &console, T);
    let r = expect_probe_ok(&run, "keyboard");
    assert!(r.details.starts_with("ctrl-alt-del"), "{}", r.details);
}
