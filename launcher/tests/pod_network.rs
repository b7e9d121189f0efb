//! `run -f` with a pod network: the launcher wires a TAP on a NAT'd bridge in its network
//! namespace; frames cross it both ways; everything it created is gone when the VM stops.

use std::process::{Command, Stdio};
use std::time::Duration;

use tests::{NetNs, PacketSocket};

const GUEST_MAC: [u8; 6] = [0x02, 0x00, 0x00, 0x00, 0x00, 0x42];

/// A frame from the bridge (the guest's gateway, whose MAC it answers to) to the guest.
fn frame(src: [u8; 6], payload: &[u8], len: usize) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&GUEST_MAC);
    f.extend_from_slice(&src);
    f.extend_from_slice(&[0x88, 0xb5]);
    f.extend_from_slice(payload);
    f.resize(len, 0x5a);
    f
}

#[test]
fn pod_network_is_a_tap_on_a_natted_bridge() {
    tests::require_kvm();
    let dir = tests::probe_workdir("mv-podnet");
    let manifest = dir.join("vm.yaml");
    std::fs::write(
        &manifest,
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: netvm}
spec:
  runStrategy: Always
  template:
    spec:
      domain:
        memory: {guest: 64Mi}
        devices:
          interfaces: [{name: default, masquerade: {}, macAddress: "02:00:00:00:00:42"}]
        firmware:
          kernelBoot:
            container: {image: "microvirt/probe:latest", kernelPath: /probe}
            kernelArgs: "console=ttyS0 probe.test=net"
      networks: [{name: default, pod: {}}]
"#,
    )
    .unwrap();
    let ns = NetNs::new("podnet");
    let child = Command::new("ip")
        .args([
            "netns",
            "exec",
            &ns.name,
            env!("CARGO_BIN_EXE_virt-launcher"),
            "run",
            "--no-console-input",
            "-f",
        ])
        .arg(&manifest)
        .arg("--image-dir")
        .arg(dir.join("images"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Kill the launcher if anything below fails, so no VM outlives the test.
    struct KillOnDrop(Option<std::process::Child>);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            if let Some(c) = self.0.as_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
    let mut child = KillOnDrop(Some(child));
    let ns_name = ns.name.clone();
    let (bridge, tables) = std::thread::spawn(move || {
        let ns = NetNs { name: ns_name };
        ns.enter();
        std::mem::forget(ns);
        // Wait for the launcher's bridge.
        let mut bridge = None;
        for _ in 0..200 {
            let out = Command::new("ip")
                .args(["-o", "link", "show", "type", "bridge"])
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            if let Some(name) = text.split(": ").nth(1) {
                bridge = Some(name.split('@').next().unwrap().to_string());
                break;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        let bridge = bridge.expect("no bridge appeared");
        // The NAT table comes right after the bridge: wait for it too (a loaded machine can
        // list the tables in between).
        let mut tables = String::new();
        for _ in 0..200 {
            tables = String::from_utf8_lossy(
                &Command::new("nft")
                    .args(["list", "tables"])
                    .output()
                    .unwrap()
                    .stdout,
            )
            .to_string();
            if tables.contains("table ip microvirt-") {
                break;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        let addrs = String::from_utf8_lossy(
            &Command::new("ip")
                .args(["-o", "addr", "show", "dev", &bridge])
                .output()
                .unwrap()
                .stdout,
        )
        .to_string();
        assert!(addrs.contains("10.0.2.1/24"), "{addrs}");
        let link = String::from_utf8_lossy(
            &Command::new("ip")
                .args(["-o", "link", "show", "dev", &bridge])
                .output()
                .unwrap()
                .stdout,
        )
        .to_string();
        let mac_text = link
            .split("link/ether ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .to_string();
        let mut bridge_mac = [0u8; 6];
        for (i, p) in mac_text.split(':').enumerate() {
            bridge_mac[i] = u8::from_str_radix(p, 16).unwrap();
        }
        let wire = PacketSocket::bind(&bridge);
        // The guest may have sent its three frames before this socket was bound: what is seen
        // must be the tail of the sequence, in order.
        let mut seen = vec![];
        while let Some(f) = wire.recv_matching(Duration::from_secs(2), |f| {
            f.len() > 14 && f[12..14] == [0x88, 0xb5] && f[6..12] == GUEST_MAC
        }) {
            seen.push(f.len());
            if f.len() == 1514 {
                break;
            }
        }
        let all = [60usize, 300, 1514];
        assert!(all.ends_with(&seen), "guest frames {seen:?}");
        // The guest answers PING with PONG once it listens; retry until it does.
        let mut pong = None;
        for _ in 0..60 {
            wire.send(&frame(bridge_mac, b"PING 0", 100));
            pong = wire.recv_matching(Duration::from_secs(1), |f| {
                f.len() > 18 && &f[14..18] == b"PONG"
            });
            if pong.is_some() {
                break;
            }
        }
        assert_eq!(pong.expect("PONG").len(), 100);
        wire.send(&frame(bridge_mac, b"DONE", 60));
        (bridge, tables)
    })
    .join()
    .unwrap();
    let out = child.0.take().unwrap().wait_with_output().unwrap();
    let stdout = tests::expect_success(&out, "");
    assert!(
        stdout.contains("PROBE RESULT net OK mac=02:00:00:00:00:42 link=1 sent=3 echoed=1"),
        "{stdout}"
    );
    assert!(
        tables.contains("table ip microvirt-"),
        "NAT table missing: {tables}"
    );
    // Torn down: no bridge, no NAT table.
    let links = Command::new("ip")
        .args(["netns", "exec", &ns.name, "ip", "-o", "link"])
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&links.stdout).contains(&bridge));
    let t = Command::new("ip")
        .args(["netns", "exec", &ns.name, "nft", "list", "tables"])
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&t.stdout).contains("microvirt-"));
    let _ = std::fs::remove_dir_all(dir);
}

/// The probe's `dhcp` test through `run -f --network nat`, in a "Pod" namespace whose eth0 leads
/// to a peer namespace: the guest gets 10.0.2.2 by DHCP (with the Pod's DNS, MTU and its
/// hostname), and its UDP datagram reaches the peer from the Pod's address and comes back. Then
/// the guest forges datagrams from another address and from another MAC before its honest one:
/// the peer never sees them, and the honest datagram sent after them still comes back.
#[test]
fn the_guest_configures_itself_by_dhcp_and_reaches_a_peer_through_the_nat() {
    tests::require_kvm();
    let dir = tests::probe_workdir("mv-podnet-dhcp");
    let manifest = dir.join("vm.yaml");
    std::fs::write(
        &manifest,
        tests::probe_vmi_yaml(
            "dhcpvm",
            "probe.test=dhcp probe.peer=10.244.0.1:7777 probe.spoof=1",
            r#"[{name: default, masquerade: {}}]"#,
            r#"[{name: default, pod: {}}]"#,
        ),
    )
    .unwrap();
    let (peer, pod) = tests::pod_namespace("dhcp", "10.244.0.5", "10.244.0.1");
    let echo = tests::UdpEcho::start(&peer, 7777);
    let out = Command::new("ip")
        .args(["netns", "exec", &pod.name])
        .arg(env!("CARGO_BIN_EXE_virt-launcher"))
        .args(["run", "--no-console-input", "-f"])
        .arg(&manifest)
        .arg("--image-dir")
        .arg(dir.join("images"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    let stdout = tests::expect_success(&out, "");
    let line = stdout
        .lines()
        .find(|l| l.starts_with("PROBE RESULT dhcp"))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(line.contains(" OK "), "{line}");
    assert!(line.contains("ip=10.0.2.2/24 router=10.0.2.1"), "{line}");
    assert!(line.contains("hostname=dhcpvm"), "{line}");
    assert!(
        line.contains("mtu=1500") && line.contains("echoes=1") && line.contains("forged=2"),
        "{line}"
    );
    let payloads: Vec<String> = echo
        .payloads()
        .iter()
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .collect();
    assert!(
        payloads.iter().any(|p| p == "MVPROBE udp hello 0"),
        "{payloads:?}"
    );
    assert!(
        !payloads.iter().any(|p| p.contains("spoof")),
        "a forged datagram reached the peer: {payloads:?}"
    );
    let from = echo.seen();
    assert_eq!(
        from.first().map(|a| a.ip().to_string()).as_deref(),
        Some("10.244.0.5"),
        "the peer sees the Pod's address, not the guest's"
    );
    let _ = std::fs::remove_dir_all(dir);
}
