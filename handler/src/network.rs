//! The Pod network of a VMI, wired by the handler in its launcher Pod's network namespace
//! (`podnet`) and handed to the launcher as descriptors, so the launcher needs no NET_ADMIN:
//! what the VMI's interfaces ask for, KubeVirt's way — the pod network on `eth0` (masquerade or
//! bridge), Multus networks as bridge bindings on the interfaces Multus made (`net1`, `net2`, …
//! in the order of `spec.networks`).

use api::protocol::HandedNic;
use api::{InterfaceStatus, VirtualMachineInstance};
use podnet::{Binding, NicRequest, Port, Protocol};

use crate::launcher::{LauncherClient, LauncherError};

/// The TCP ports a masquerade NIC never forwards to the guest: the migration listener's
/// (KubeVirt keeps 49152/49153 for the same reason).
pub const MIGRATION_PORT: u16 = 49152;
pub const RESERVED_TCP_PORTS: [u16; 2] = [49152, 49153];

#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    /// The VMI asks for a network this node cannot wire: the VMI fails, naming it.
    #[error("{0}")]
    Unwirable(String),
    #[error(transparent)]
    Launcher(#[from] LauncherError),
}

fn port(v: &serde_json::Value, at: &str) -> Result<Port, String> {
    let protocol = match v.get("protocol").and_then(|p| p.as_str()).unwrap_or("TCP") {
        "TCP" | "tcp" => Protocol::Tcp,
        "UDP" | "udp" => Protocol::Udp,
        other => return Err(format!("{at}.protocol: {other:?} is not TCP or UDP")),
    };
    let port = v
        .get("port")
        .and_then(|p| p.as_u64())
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p > 0)
        .ok_or_else(|| format!("{at}.port: must be a port number from 1 to 65535"))?;
    Ok(Port { protocol, port })
}

/// What to wire for each of the VMI's interfaces, in order.
pub fn nic_requests(vmi: &VirtualMachineInstance) -> Result<Vec<NicRequest>, String> {
    let spec = &vmi.spec;
    let mut pod_iface_of: std::collections::BTreeMap<String, String> =
        api::launcher_pod::multus_interfaces(spec)
            .into_iter()
            .collect();
    for n in spec.networks.iter().filter(|n| n.pod.is_some()) {
        pod_iface_of.insert(n.name.clone(), "eth0".to_string());
    }
    let mut out = Vec::new();
    for (i, iface) in spec.domain.devices.interfaces.iter().enumerate() {
        let at = format!("spec.domain.devices.interfaces[{i}]");
        if iface.binding.is_some() {
            // vhostuser: the userspace CNI attached it; the launcher connects to its socket.
            continue;
        }
        let (ni, net) = spec
            .networks
            .iter()
            .enumerate()
            .find(|(_, n)| n.name == iface.name)
            .ok_or_else(|| format!("{at}: no network named {:?} in spec.networks", iface.name))?;
        if let Some(cidr) = net.pod.as_ref().and_then(|p| p.vm_network_cidr.as_deref()) {
            if cidr != "10.0.2.0/24" {
                return Err(format!(
                    "spec.networks[{ni}].pod.vmNetworkCIDR: {cidr} is not supported; the guest's masquerade network is 10.0.2.0/24"
                ));
            }
        }
        let binding = if iface.bridge.is_some() {
            Binding::Bridge
        } else if iface.masquerade.is_some() {
            if net.pod.is_none() {
                return Err(format!(
                    "{at}.masquerade: only the pod network can be masqueraded; use bridge for a Multus network"
                ));
            }
            Binding::Masquerade
        } else {
            return Err(format!(
                "{at}: only masquerade, bridge and vhostuser bindings are wired by microvirt"
            ));
        };
        let ports = match (&iface.ports, binding) {
            (Some(ps), Binding::Masquerade) => ps
                .iter()
                .enumerate()
                .map(|(pi, p)| port(p, &format!("{at}.ports[{pi}]")))
                .collect::<Result<Vec<_>, _>>()?,
            _ => Vec::new(),
        };
        let vmi_name = vmi.metadata.name.as_deref().unwrap_or("vm");
        let guest_mac = api::mac::of_interface(vmi_name, iface)
            .map_err(|why| format!("{at}.macAddress: {why}"))?;
        out.push(NicRequest {
            interface: iface.name.clone(),
            binding,
            pod_interface: pod_iface_of.get(&iface.name).cloned(),
            ports,
            guest_mac,
        });
    }
    Ok(out)
}

/// The frames each NIC's source guard dropped in the Pod of launcher `pid`, by VMI interface
/// (`podnet::antispoof`).
pub async fn spoofed(pid: u32) -> Result<Vec<(String, u64)>, String> {
    tokio::task::spawn_blocking(move || {
        let ns = podnet::netns_of(pid).map_err(|e| e.to_string())?;
        podnet::in_netns(Some(&ns), podnet::antispoof::dropped).map_err(|e| e.to_string())?
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Wires the VMI's NICs in the launcher's Pod and hands them over. Everything the wiring made
/// is removed again when any step fails.
pub async fn attach(
    launcher: &mut LauncherClient,
    vmi: &VirtualMachineInstance,
) -> Result<(), NetworkError> {
    let requests = nic_requests(vmi).map_err(NetworkError::Unwirable)?;
    if requests.is_empty() {
        return Ok(());
    }
    let pid = launcher.pid.ok_or_else(|| {
        NetworkError::Unwirable(
            "the launcher's PID is not visible from virt-handler (hostPID is needed)".into(),
        )
    })?;
    let options = podnet::WireOptions {
        naming: podnet::Naming::Pod,
        hostname: Some(
            vmi.spec
                .hostname
                .clone()
                .or_else(|| vmi.metadata.name.clone())
                .unwrap_or_default(),
        ),
        // The launcher container's own resolv.conf: the Pod's DNS, as the kubelet wrote it.
        resolv_conf: format!("/proc/{pid}/root/etc/resolv.conf").into(),
        excluded_tcp_ports: RESERVED_TCP_PORTS.to_vec(),
    };
    let wired = tokio::task::spawn_blocking(move || {
        let ns = podnet::netns_of(pid)?;
        podnet::wire(Some(ns), &requests, &options)
    })
    .await
    .map_err(|e| NetworkError::Unwirable(format!("network wiring: {e}")))?
    .map_err(|e| NetworkError::Unwirable(e.to_string()))?;
    let mut net = wired;
    let mut nics = Vec::new();
    let mut fds = Vec::new();
    for w in &mut net.nics {
        let tap_fd = fds.len();
        fds.push(w.tap.try_clone().map_err(LauncherError::Io)?);
        let dhcp_fd = match w.dhcp_socket.take() {
            Some(s) => {
                fds.push(std::os::fd::OwnedFd::from(s));
                Some(fds.len() - 1)
            }
            None => None,
        };
        nics.push(HandedNic {
            interface: w.interface.clone(),
            tap_fd,
            mac: Some(api::mac::display(&w.mac)),
            dhcp: w.lease.clone(),
            dhcp_fd,
            ip_addresses: w.ip_addresses.clone(),
            pod_interface: w.pod_interface.clone(),
        });
    }
    match launcher.attach_network(nics, fds).await {
        Ok(()) => {
            net.keep();
            Ok(())
        }
        Err(e) => {
            let _ = tokio::task::spawn_blocking(move || drop(net)).await;
            Err(e.into())
        }
    }
}

/// `status.interfaces` from what the launcher reports of its NICs (restart-safe: the launcher
/// keeps what it was handed).
pub fn interface_status(
    vmi: &VirtualMachineInstance,
    report: &api::protocol::StatusReport,
) -> Vec<InterfaceStatus> {
    vmi.spec
        .domain
        .devices
        .interfaces
        .iter()
        .zip(report.nics.iter())
        .map(|(iface, nic)| InterfaceStatus {
            name: Some(iface.name.clone()),
            ip_address: nic.ip_addresses.first().cloned(),
            ip_addresses: nic.ip_addresses.clone(),
            mac: nic.mac.clone(),
            interface_name: None,
            pod_interface_name: nic.pod_interface.clone(),
            info_source: Some("domain".into()),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmi(yaml: &str) -> VirtualMachineInstance {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn a_vhostuser_interface_is_not_wired_and_keeps_the_multus_ordinals() {
        let v = vmi(r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: a}
spec:
  domain:
    devices:
      interfaces:
      - {name: dp, binding: {name: vhostuser}}
      - {name: blue, bridge: {}}
  networks:
  - {name: dp, multus: {networkName: dpdk}}
  - {name: blue, multus: {networkName: blue-net}}
"#);
        let r = nic_requests(&v).unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].interface, "blue");
        assert_eq!(r[0].pod_interface.as_deref(), Some("net2"));
    }

    #[test]
    fn kubevirt_interfaces_become_wiring_requests() {
        let v = vmi(r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: a}
spec:
  domain:
    devices:
      interfaces:
      - {name: default, masquerade: {}, ports: [{port: 80}, {port: 53, protocol: UDP}]}
      - {name: blue, bridge: {}}
      - {name: red, bridge: {}}
  networks:
  - {name: default, pod: {}}
  - {name: blue, multus: {networkName: blue-net}}
  - {name: red, multus: {networkName: red-net}}
"#);
        let r = nic_requests(&v).unwrap();
        assert_eq!(r.len(), 3);
        assert_eq!(r[0].binding, Binding::Masquerade);
        assert_eq!(r[0].pod_interface.as_deref(), Some("eth0"));
        assert_eq!(
            r[0].ports,
            vec![
                Port {
                    protocol: Protocol::Tcp,
                    port: 80
                },
                Port {
                    protocol: Protocol::Udp,
                    port: 53
                }
            ]
        );
        assert_eq!(
            (r[1].pod_interface.as_deref(), r[2].pod_interface.as_deref()),
            (Some("net1"), Some("net2"))
        );
        assert_eq!(r[1].binding, Binding::Bridge);
    }

    #[test]
    fn unwirable_interfaces_are_named() {
        let bad = |i: &str, n: &str| {
            let v = vmi(&format!(
                "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {{name: a}}\nspec:\n  domain:\n    devices:\n      interfaces: [{i}]\n  networks: [{n}]\n"
            ));
            nic_requests(&v).unwrap_err()
        };
        let e = bad(
            "{name: blue, masquerade: {}}",
            "{name: blue, multus: {networkName: b}}",
        );
        assert!(e.contains("interfaces[0].masquerade"), "{e}");
        let e = bad(
            "{name: default, masquerade: {}, ports: [{port: 0}]}",
            "{name: default, pod: {}}",
        );
        assert!(e.contains("ports[0].port"), "{e}");
        let e = bad(
            "{name: default, masquerade: {}}",
            "{name: default, pod: {vmNetworkCIDR: 10.11.0.0/24}}",
        );
        assert!(e.contains("vmNetworkCIDR"), "{e}");
        let e = bad("{name: x, masquerade: {}}", "{name: default, pod: {}}");
        assert!(e.contains("no network named"), "{e}");
    }
}
