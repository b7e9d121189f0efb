//! Standalone networking for a `pod` network (`virt-launcher run -f --network nat`): the same
//! masquerade wiring virt-handler does in a VM Pod (`podnet`), in the launcher's own network
//! namespace — a bridge with the gateway 10.0.2.1/24, the guest's TAP on it, NAT out of
//! whatever routes, and a DHCP server offering the guest 10.0.2.2. Names carry a per-process
//! tag, since this may be a host's shared namespace. Dropping the network removes it.

use std::os::fd::IntoRawFd;

use std::path::Path;
use std::time::{Duration, Instant};

use vmm::config::{NetConfig, TapSource, VhostUserNetConfig};

use crate::translate::NicPlan;

pub const GUEST: std::net::Ipv4Addr = podnet::GUEST_V4;

/// The vhostuser NICs of `nics` on the sockets Multus reports for their Pod interfaces in
/// `status_file` (the Pod's network-status annotation as a file). The kubelet refreshes a
/// downwardAPI file some time after Multus annotates the Pod, so a file that does not list an
/// interface yet is read again for up to `wait`; any other fault is reported at once.
pub fn vhost_user_nets(
    nics: &[NicPlan],
    status_file: &Path,
    wait: Duration,
) -> Result<Vec<VhostUserNetConfig>, String> {
    let deadline = Instant::now() + wait;
    let mut out = Vec::new();
    for n in nics {
        let pod_iface = n.pod_interface.as_deref().ok_or_else(|| {
            format!(
                "interface {}: binding vhostuser needs a Multus network",
                n.interface
            )
        })?;
        let socket = loop {
            let status = std::fs::read_to_string(status_file).unwrap_or_default();
            let listed = !status.trim().is_empty()
                && serde_json::from_str::<Vec<serde_json::Value>>(&status)
                    .map(|l| {
                        l.iter()
                            .any(|e| e.get("interface").and_then(|i| i.as_str()) == Some(pod_iface))
                    })
                    .unwrap_or(true);
            if listed || Instant::now() >= deadline {
                break api::launcher_pod::vhost_user_socket(&status, pod_iface).map_err(|e| {
                    format!("interface {} ({}): {e}", n.interface, status_file.display())
                })?;
            }
            std::thread::sleep(Duration::from_millis(250));
        };
        out.push(VhostUserNetConfig { socket, mac: n.mac });
    }
    Ok(out)
}

pub struct PodNetwork {
    net: podnet::PodNetwork,
}

/// A short, stable tag for interface names (IFNAMSIZ is 16).
fn tag(name: &str) -> String {
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    format!(
        "{:06x}",
        ((h ^ std::process::id() as u64) as u32) & 0xff_ffff
    )
}

impl PodNetwork {
    /// Wires the masquerade/bridge NICs of a pod network. Returns the network (torn down on
    /// drop), the NIC configs for the VM, and the kernel parameter that configures a Linux
    /// guest without waiting for DHCP.
    pub fn setup(
        vm: &str,
        nics: &[NicPlan],
    ) -> Result<(PodNetwork, Vec<NetConfig>, String), String> {
        if let Some(n) = nics.iter().find(|n| n.multus.is_some()) {
            return Err(format!(
                "interface {}: Multus networks need a cluster; use --network none",
                n.interface
            ));
        }
        if nics.len() > 1 {
            // Every masquerade NIC's subnet is 10.0.2.0/24: two in one namespace would clash.
            return Err("one pod network interface is supported in standalone mode".into());
        }
        let requests = nics
            .iter()
            .map(|n| {
                Ok(podnet::NicRequest {
                    interface: n.interface.clone(),
                    // On a host's own network there is no Pod interface to give away: both
                    // bindings get the guest a NAT'd address here.
                    binding: podnet::Binding::Masquerade,
                    pod_interface: None,
                    ports: vec![],
                    guest_mac: n
                        .mac
                        .ok_or_else(|| format!("interface {}: no MAC planned", n.interface))?
                        .0,
                })
            })
            .collect::<Result<Vec<podnet::NicRequest>, String>>()?;
        let options = podnet::WireOptions {
            naming: podnet::Naming::Unique(tag(vm)),
            hostname: Some(vm.to_string()),
            ..Default::default()
        };
        let mut net = podnet::wire(None, &requests, &options).map_err(|e| e.to_string())?;
        let mut configs = Vec::new();
        for (plan, wired) in nics.iter().zip(net.nics.iter_mut()) {
            if let (Some(socket), Some(lease), Some(mac)) =
                (wired.dhcp_socket.take(), wired.lease.clone(), plan.mac)
            {
                std::thread::Builder::new()
                    .name(format!("dhcp-{}", plan.interface))
                    .spawn(move || podnet::dhcp::serve(socket, mac.0, lease))
                    .map_err(|e| format!("DHCP server thread: {e}"))?;
            }
            let fd = wired
                .tap
                .try_clone()
                .map_err(|e| format!("TAP {}: {e}", wired.tap_name))?;
            configs.push(NetConfig {
                tap: TapSource::Fd(fd.into_raw_fd()),
                mac: plan.mac,
            });
        }
        let ip = format!(
            "ip={GUEST}::{}:255.255.255.0:{vm}:eth0:off",
            podnet::GATEWAY_V4
        );
        Ok((PodNetwork { net }, configs, ip))
    }

    pub fn bridge(&self) -> &str {
        self.net.nics.first().map_or("", |n| n.bridge.as_str())
    }
}
