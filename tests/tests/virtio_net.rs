//! virtio-net on /dev/kvm with real host objects: a TAP in a network namespace the test creates,
//! and an AF_PACKET socket on it standing in for the rest of the network.

use std::time::Duration;

use tests::*;
use vmm::config::{MacAddr, NetConfig, TapSource};
use vmm::Vm;

const ETHERTYPE: [u8; 2] = [0x88, 0xb5];
const GUEST_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];
const HOST_MAC: [u8; 6] = [0x02, 0x00, 0x00, 0x00, 0x00, 0x01];

fn frame(payload: &[u8], len: usize) -> Vec<u8> {
    let mut f = Vec::with_capacity(len);
    f.extend_from_slice(&GUEST_MAC);
    f.extend_from_slice(&HOST_MAC);
    f.extend_from_slice(&ETHERTYPE);
    f.extend_from_slice(payload);
    while f.len() < len {
        f.push((f.len() * 13) as u8);
    }
    f
}

#[test]
fn probe_sends_receives_and_echoes_frames_over_a_tap() {
    require_kvm();
    let ns = NetNs::new("net");
    ns.exec(&["ip", "tuntap", "add", "mvtap0", "mode", "tap", "vnet_hdr"]);
    ns.exec(&["sysctl", "-q", "-w", "net.ipv6.conf.mvtap0.disable_ipv6=1"]);
    ns.exec(&["ip", "link", "set", "mvtap0", "up"]);
    let ns_name = ns.name.clone();
    // Everything that touches the TAP runs on a thread inside the namespace.
    let worker = std::thread::spawn(move || {
        let ns = NetNs { name: ns_name };
        ns.enter();
        std::mem::forget(ns); // the outer handle deletes it
        let wire = PacketSocket::bind("mvtap0");
        let console = Console::default();
        let mut cfg = probe_config("net", 1, 64, &console);
        cfg.nets = vec![NetConfig {
            tap: TapSource::Name("mvtap0".into()),
            mac: Some(MacAddr(GUEST_MAC)),
        }];
        let vm = Vm::build(&cfg).expect("building the VM");
        let nets = vm.nets().to_vec();
        let t = Duration::from_secs(60);

        // The probe sends three frames of different sizes first.
        for (i, size) in [60usize, 300, 1514].into_iter().enumerate() {
            let f = wire
                .recv_matching(t, |f| {
                    f.len() > 14 && f[12..14] == ETHERTYPE && f[6..12] == GUEST_MAC
                })
                .unwrap_or_else(|| {
                    panic!(
                        "frame {i} not seen on the TAP; console:\n{}",
                        console.text()
                    )
                });
            assert_eq!(f.len(), size, "frame {i}");
            let tag = format!("MVPROBE frame {i} size {size}");
            assert_eq!(&f[14..14 + tag.len()], tag.as_bytes());
            assert_eq!(&f[0..6], &[0xff; 6]);
        }
        // Frames we inject must come back as PONG with the rest unchanged.
        for (i, size) in [64usize, 500, 1400].into_iter().enumerate() {
            let ping = frame(format!("PING {i}").as_bytes(), size);
            wire.send(&ping);
            let pong = wire
                .recv_matching(t, |f| {
                    f.len() > 18 && f[12..14] == ETHERTYPE && &f[14..18] == b"PONG"
                })
                .unwrap_or_else(|| panic!("no PONG {i}; console:\n{}", console.text()));
            assert_eq!(pong.len(), size);
            assert_eq!(&pong[0..6], &HOST_MAC, "sent back to the sender");
            assert_eq!(&pong[6..12], &GUEST_MAC);
            assert_eq!(&pong[18..], &ping[18..]);
        }
        wire.send(&frame(b"DONE", 60));
        let run = run_to_end(vm, &console, t);
        let counters = nets[0].lock().unwrap().counters;
        (run, counters)
    });
    let (run, counters) = worker.join().unwrap();
    let r = run
        .result
        .clone()
        .unwrap_or_else(|| panic!("no result: {:?}\n{}", run.end, run.console));
    assert!(r.ok, "{}", run.console);
    assert_eq!(r.field("mac"), Some("52:54:00:12:34:56"));
    assert_eq!(r.field("link"), Some("1"));
    assert_eq!(r.field("echoed"), Some("3"));
    assert!(
        counters.tx_frames >= 6 && counters.rx_frames >= 4,
        "{counters:?}"
    );
    assert_eq!((counters.tx_errors, counters.rx_errors), (0, 0));
    drop(ns);
}

#[test]
fn missing_and_busy_taps_are_refused() {
    require_kvm();
    let ns = NetNs::new("taperr");
    ns.exec(&["ip", "tuntap", "add", "mvbusy", "mode", "tap", "vnet_hdr"]);
    let ns_name = ns.name.clone();
    std::thread::spawn(move || {
        let ns = NetNs { name: ns_name };
        ns.enter();
        std::mem::forget(ns);
        let console = Console::default();
        let mut cfg = probe_config("boot", 1, 64, &console);
        cfg.nets = vec![NetConfig {
            tap: TapSource::Name("nosuchtap".into()),
            mac: None,
        }];
        let e = Vm::build(&cfg).expect_err("missing TAP must be refused");
        assert!(e.is_config_error());
        assert!(
            e.to_string()
                .starts_with("--net tap=nosuchtap: no TAP device named nosuchtap"),
            "{e}"
        );
        // One VM holds the TAP; a second one must not start.
        let mut first = probe_config("console", 1, 64, &console);
        first.nets = vec![NetConfig {
            tap: TapSource::Name("mvbusy".into()),
            mac: None,
        }];
        let vm = Vm::build(&first).unwrap();
        cfg.nets = vec![NetConfig {
            tap: TapSource::Name("mvbusy".into()),
            mac: None,
        }];
        let e = Vm::build(&cfg).expect_err("busy TAP must be refused");
        assert_eq!(
            e.to_string(),
            "--net tap=mvbusy: busy (another process has it open)"
        );
        vm.stop();
        let _ = vm.wait();
    })
    .join()
    .unwrap();
    drop(ns);
}
