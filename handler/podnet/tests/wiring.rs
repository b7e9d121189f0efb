//! The bindings wired for real: a "Pod" network namespace with an `eth0` veth whose other end
//! is in a "node" namespace (what a CNI plugin leaves), then masquerade and bridge wiring
//! inspected with iproute2 and nft, and undone.

use std::net::Ipv4Addr;
use std::process::Command;

use podnet::{Binding, NicRequest, WireOptions};
use tests::NetNs;

fn out(ns: &NetNs, cmd: &[&str]) -> String {
    let o = Command::new("ip")
        .args(["netns", "exec", &ns.name])
        .args(cmd)
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
}

/// A Pod namespace with eth0 = 10.244.0.5/24 (default route via the node's 10.244.0.1).
fn pod(tag: &str) -> (NetNs, NetNs) {
    let (node, pod) = tests::pod_namespace(tag, "10.244.0.5", "10.244.0.1");
    pod.exec(&["ip", "link", "set", "eth0", "mtu", "1450"]);
    (node, pod)
}

fn nsfile(ns: &NetNs) -> std::fs::File {
    podnet::netns_path(std::path::Path::new(&format!("/var/run/netns/{}", ns.name))).unwrap()
}

/// The MAC the guest's NIC is planned with (masquerade: the request's).
const GUEST_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x0a, 0x0b, 0x0c];

fn nic(binding: Binding, pod_interface: &str) -> NicRequest {
    NicRequest {
        interface: "default".into(),
        binding,
        pod_interface: Some(pod_interface.into()),
        ports: vec![],
        guest_mac: GUEST_MAC,
    }
}

fn resolv(dir: &std::path::Path) -> std::path::PathBuf {
    let p = dir.join("resolv.conf");
    std::fs::write(
        &p,
        "search ns1.svc.cluster.local cluster.local\nnameserver 10.96.0.10\n",
    )
    .unwrap();
    p
}

#[test]
fn masquerade_puts_the_guest_behind_the_pod_address() {
    let (_node, pod) = pod("wm");
    let dir = std::env::temp_dir().join(format!("podnet-m-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let options = WireOptions {
        hostname: Some("vm1".into()),
        resolv_conf: resolv(&dir),
        excluded_tcp_ports: vec![49152],
        ..Default::default()
    };
    let net = podnet::wire(
        Some(nsfile(&pod)),
        &[nic(Binding::Masquerade, "eth0")],
        &options,
    )
    .unwrap();
    let n = &net.nics[0];
    assert_eq!(
        (n.bridge.as_str(), n.tap_name.as_str()),
        ("k6t-eth0", "tap0")
    );
    assert_eq!(n.ip_addresses, vec!["10.244.0.5".to_string()]);
    assert_eq!(n.mac, GUEST_MAC, "the planned MAC");
    let lease = n.lease.clone().unwrap();
    assert_eq!(lease.address, Ipv4Addr::new(10, 0, 2, 2));
    assert_eq!(lease.router, Some(Ipv4Addr::new(10, 0, 2, 1)));
    assert_eq!(lease.dns, vec![Ipv4Addr::new(10, 96, 0, 10)]);
    assert_eq!(lease.search.len(), 2);
    assert_eq!(lease.mtu, Some(1450), "the Pod interface's MTU");
    assert!(n.dhcp_socket.is_some());
    let addrs = out(&pod, &["ip", "-o", "addr", "show", "k6t-eth0"]);
    assert!(addrs.contains("10.0.2.1/24"), "{addrs}");
    let br = out(&pod, &["cat", "/sys/class/net/k6t-eth0/address"]);
    assert_eq!(
        br.trim(),
        "02:00:00:00:00:00",
        "the same gateway MAC in every Pod"
    );
    let tap = out(&pod, &["ip", "-o", "link", "show", "tap0"]);
    assert!(
        tap.contains("master k6t-eth0") && tap.contains("mtu 1450"),
        "{tap}"
    );
    let rules = out(&pod, &["nft", "list", "table", "ip", "microvirt-eth0"]);
    assert!(rules.contains("masquerade"), "{rules}");
    assert!(rules.contains("dnat to 10.0.2.2"), "{rules}");
    assert!(rules.contains("49152"), "{rules}");
    // Only the guest's MAC and lease leave its TAP.
    let guard = out(
        &pod,
        &["nft", "list", "table", "netdev", "microvirt-src-default"],
    );
    assert!(
        guard.contains("device \"tap0\"")
            && guard.contains("ether saddr != 52:54:00:0a:0b:0c counter name \"spoofed\" drop")
            && guard.contains("ip saddr 10.0.2.2 accept"),
        "{guard}"
    );
    assert_eq!(
        out(&pod, &["cat", "/proc/sys/net/ipv4/ip_forward"]).trim(),
        "1"
    );
    drop(net);
    let after = out(&pod, &["ip", "-o", "link"]);
    assert!(
        !after.contains("k6t-eth0") && !after.contains("tap0"),
        "{after}"
    );
    let rules = out(&pod, &["nft", "list", "tables"]);
    assert!(!rules.contains("microvirt"), "{rules}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bridge_binding_hands_the_pod_address_and_mac_to_the_guest_and_gives_them_back() {
    let (_node, pod) = pod("wb");
    let mac_before = out(&pod, &["cat", "/sys/class/net/eth0/address"])
        .trim()
        .to_string();
    let net = podnet::wire(
        Some(nsfile(&pod)),
        &[nic(Binding::Bridge, "eth0")],
        &WireOptions::default(),
    )
    .unwrap();
    let n = &net.nics[0];
    let mac: Vec<String> = n.mac.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(mac.join(":"), mac_before, "the guest takes the Pod's MAC");
    let lease = n.lease.clone().unwrap();
    assert_eq!(
        (lease.address, lease.prefix_len),
        (Ipv4Addr::new(10, 244, 0, 5), 24)
    );
    assert_eq!(lease.router, Some(Ipv4Addr::new(10, 244, 0, 1)));
    assert_eq!(lease.server, podnet::BRIDGE_DHCP_SERVER);
    let eth0 = out(&pod, &["ip", "-o", "addr", "show", "eth0"]);
    assert!(
        !eth0.contains("10.244.0.5"),
        "the address moved to the guest: {eth0}"
    );
    let link = out(&pod, &["ip", "-o", "link", "show", "eth0"]);
    assert!(link.contains("master k6t-eth0"), "{link}");
    assert!(
        !link.contains(&mac_before),
        "eth0 gave its MAC away: {link}"
    );
    drop(net);
    let eth0 = out(&pod, &["ip", "-o", "addr", "show", "eth0"]);
    assert!(eth0.contains("10.244.0.5/24"), "{eth0}");
    assert_eq!(
        out(&pod, &["cat", "/sys/class/net/eth0/address"]).trim(),
        mac_before
    );
    let routes = out(&pod, &["ip", "route"]);
    assert!(routes.contains("default via 10.244.0.1"), "{routes}");
    assert!(!out(&pod, &["ip", "-o", "link"]).contains("k6t-"));
}

#[test]
fn a_missing_multus_interface_fails_naming_it_and_leaves_nothing_behind() {
    let (_node, pod) = pod("wx");
    let reqs = [
        nic(Binding::Masquerade, "eth0"),
        NicRequest {
            interface: "blue".into(),
            ..nic(Binding::Bridge, "net1")
        },
    ];
    let e = podnet::wire(Some(nsfile(&pod)), &reqs, &WireOptions::default()).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("interface blue") && msg.contains("net1"),
        "{msg}"
    );
    let links = out(&pod, &["ip", "-o", "link"]);
    assert!(
        !links.contains("k6t-") && !links.contains("tap0"),
        "{links}"
    );
    assert!(!out(&pod, &["nft", "list", "tables"]).contains("microvirt"));
}

#[test]
fn a_pod_network_overlapping_the_guest_subnet_is_refused_and_nothing_is_left() {
    let (_node, pod) = tests::pod_namespace("wo", "10.0.2.7", "10.0.2.100");
    let e = podnet::wire(
        Some(nsfile(&pod)),
        &[nic(Binding::Masquerade, "eth0")],
        &WireOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("interface default") && e.contains("10.0.2.7 overlaps"),
        "{e}"
    );
    let links = out(&pod, &["ip", "-o", "link"]);
    assert!(!links.contains("k6t-"), "{links}");
}
