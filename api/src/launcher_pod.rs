//! The launcher Pod's layout: what virt-controller mounts where, what the launcher reads there,
//! and where virt-handler finds the Pod's sockets on the node. One place, so that the three
//! cannot disagree about a path.

use std::path::{Path, PathBuf};

/// The user (and group) every container of the launcher Pod runs as: KubeVirt's non-root
/// launcher UID (`qemu`), so disks and sockets keep the ownership KubeVirt users expect.
pub const LAUNCHER_UID: i64 = 107;

/// Extended resources the launcher container asks for (served by virt-handler's device plugins).
pub const RESOURCE_KVM: &str = "devices.kubevirt.io/kvm";
pub const RESOURCE_TUN: &str = "devices.kubevirt.io/tun";

/// Where the launcher finds what the Pod mounts (its `--image-dir`, `--volume-dir`, ...).
pub const CONTAINER_DISKS: &str = "/var/run/kubevirt/container-disks";
pub const VOLUMES: &str = "/var/run/kubevirt-private/vmi-disks";
pub const STATE: &str = "/var/run/kubevirt-private/state";
pub const SOCKETS: &str = "/var/run/kubevirt/sockets";

/// The emptyDir volume that holds the Pod's sockets, mounted at [`SOCKETS`].
pub const SOCKETS_VOLUME: &str = "sockets";
/// The launcher's control socket, in [`SOCKETS`].
pub const CONTROL_SOCKET: &str = "launcher.sock";
/// The vhost-user socket of the virtiofsd serving filesystem `tag`, in [`SOCKETS`]: the
/// Pod's `virtiofs-<tag>` container listens there, the launcher connects.
pub fn virtiofs_socket(tag: &str) -> String {
    format!("virtiofs-{tag}.sock")
}
/// Where a volume a filesystem shares is, relative to [`VOLUMES`] (the Pod mounts it there,
/// the launcher's translation looks there), and whether it is shared read-only: a claim's
/// directory (read-only if the claim is), and ConfigMaps, Secrets, the ServiceAccount's token
/// and downwardAPI files read-only, as KubeVirt shares them. None for any other volume.
pub fn shared_dir(v: &crate::types::Volume) -> Option<(String, bool)> {
    if let Some(c) = &v.config_map {
        Some((format!("configmap/{}", c.name), true))
    } else if let Some(s) = &v.secret {
        Some((format!("secret/{}", s.secret_name), true))
    } else if v.service_account.is_some() {
        // One per VMI (validation), so the account's name need not be in the path.
        Some(("serviceaccount".into(), true))
    } else if v.downward_api.is_some() {
        Some((format!("downwardapi/{}", v.name), true))
    } else if let Some(p) = &v.persistent_volume_claim {
        Some((p.claim_name.clone(), p.read_only == Some(true)))
    } else {
        v.data_volume.as_ref().map(|d| (d.name.clone(), false))
    }
}

/// Multus' annotations on the launcher Pod: the networks asked for, and what it attached.
pub const MULTUS_NETWORKS: &str = "k8s.v1.cni.cncf.io/networks";
pub const MULTUS_NETWORK_STATUS: &str = "k8s.v1.cni.cncf.io/network-status";

/// Where the launcher reads the Pod's own network-status annotation (a downwardAPI volume,
/// present when an interface takes its socket from it): the file [`NETWORK_STATUS_FILE`].
pub const NETWORK_INFO: &str = "/var/run/kubevirt-private/network-info";
pub const NETWORK_STATUS_FILE: &str = "network-status";

/// The Pod interface Multus makes for each Multus network, by network name: `net1`, `net2`, …
/// in the order of `spec.networks` (KubeVirt's ordinal naming). The launcher Pod asks for
/// these names, virt-handler wires them, the launcher finds their sockets by them.
pub fn multus_interfaces(spec: &crate::VirtualMachineInstanceSpec) -> Vec<(String, String)> {
    spec.networks
        .iter()
        .filter(|n| n.multus.is_some())
        .enumerate()
        .map(|(i, n)| (n.name.clone(), format!("net{}", i + 1)))
        .collect()
}

/// The socket of the vhost-user device Multus attached as `pod_interface`, from the Pod's
/// `k8s.v1.cni.cncf.io/network-status` annotation (its `device-info`, in the Network Plumbing
/// WG's device-info format). Only `client` mode is taken — the dataplane made the socket and
/// the VMM connects — since microvirt's vhost-user frontend connects and never listens.
pub fn vhost_user_socket(status: &str, pod_interface: &str) -> Result<PathBuf, String> {
    let entries: Vec<serde_json::Value> = serde_json::from_str(status)
        .map_err(|e| format!("{MULTUS_NETWORK_STATUS} is not a JSON list of networks: {e}"))?;
    let entry = entries
        .iter()
        .find(|n| n.get("interface").and_then(|i| i.as_str()) == Some(pod_interface))
        .ok_or_else(|| {
            format!("{MULTUS_NETWORK_STATUS} lists no interface {pod_interface:?} (yet)")
        })?;
    let info = entry.get("device-info").ok_or_else(|| {
        format!("{MULTUS_NETWORK_STATUS}: interface {pod_interface} has no device-info; its CNI made no vhost-user socket")
    })?;
    let kind = info.get("type").and_then(|t| t.as_str()).unwrap_or("");
    if kind != "vhost-user" {
        return Err(format!(
            "{MULTUS_NETWORK_STATUS}: interface {pod_interface} is a {kind:?} device, not vhost-user"
        ));
    }
    let vu = info.get("vhost-user");
    let field = |k: &str| vu.and_then(|v| v.get(k)).and_then(|v| v.as_str());
    match field("mode") {
        Some("client") => {}
        Some("server") => {
            return Err(format!("{MULTUS_NETWORK_STATUS}: interface {pod_interface}'s socket is in server mode (the VM would create it); microvirt connects to a socket the dataplane made: configure the CNI for client mode"));
        }
        other => {
            return Err(format!(
                "{MULTUS_NETWORK_STATUS}: interface {pod_interface}: vhost-user mode {other:?}; accepted: client"
            ));
        }
    }
    let path = field("path").filter(|p| p.starts_with('/')).ok_or_else(|| {
        format!("{MULTUS_NETWORK_STATUS}: interface {pod_interface}: vhost-user path missing or not absolute")
    })?;
    Ok(PathBuf::from(path))
}

/// The socket a target launcher receives a migration on, in [`SOCKETS`].
pub const MIGRATION_IN_SOCKET: &str = "migration-in.sock";
/// The socket a source launcher offers its migration stream on, in [`SOCKETS`].
pub const MIGRATION_OUT_SOCKET: &str = "migration-out.sock";

/// The control socket's path inside the Pod.
pub fn control_socket_in_pod() -> String {
    format!("{SOCKETS}/{CONTROL_SOCKET}")
}

/// Where a launcher Pod's control socket is on the node: the Pod's sockets emptyDir as the
/// kubelet lays it out below its pods directory (which virt-handler mounts).
pub fn control_socket_on_node(pods_dir: &Path, pod_uid: &str) -> PathBuf {
    pods_dir
        .join(pod_uid)
        .join("volumes/kubernetes.io~empty-dir")
        .join(SOCKETS_VOLUME)
        .join(CONTROL_SOCKET)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_vhost_user_socket_is_read_from_multus_device_info() {
        let status = r#"[
          {"name": "default", "interface": "eth0", "ips": ["10.0.0.5"]},
          {"name": "ns/dpdk", "interface": "net1",
           "device-info": {"type": "vhost-user", "version": "1.1.0",
                           "vhost-user": {"mode": "client", "path": "/var/run/vhostuser/net1/sock"}}},
          {"name": "ns/ovs", "interface": "net2",
           "device-info": {"type": "vhost-user", "version": "1.1.0",
                           "vhost-user": {"mode": "server", "path": "/var/run/vhostuser/net2/sock"}}},
          {"name": "ns/sriov", "interface": "net3",
           "device-info": {"type": "pci", "version": "1.1.0", "pci": {"pci-address": "0000:18:02.5"}}}
        ]"#;
        assert_eq!(
            super::vhost_user_socket(status, "net1").unwrap(),
            std::path::PathBuf::from("/var/run/vhostuser/net1/sock")
        );
        let server = super::vhost_user_socket(status, "net2").unwrap_err();
        assert!(server.contains("server mode"), "{server}");
        let pci = super::vhost_user_socket(status, "net3").unwrap_err();
        assert!(pci.contains("\"pci\" device, not vhost-user"), "{pci}");
        let none = super::vhost_user_socket(status, "eth0").unwrap_err();
        assert!(none.contains("no device-info"), "{none}");
        let missing = super::vhost_user_socket(status, "net9").unwrap_err();
        assert!(missing.contains("no interface \"net9\""), "{missing}");
        assert!(super::vhost_user_socket("{", "net1").is_err());
    }

    use super::*;

    #[test]
    fn the_node_path_is_the_kubelets_empty_dir_layout() {
        assert_eq!(
            control_socket_on_node(Path::new("/var/lib/kubelet/pods"), "u-1"),
            Path::new(
                "/var/lib/kubelet/pods/u-1/volumes/kubernetes.io~empty-dir/sockets/launcher.sock"
            )
        );
        assert_eq!(
            control_socket_in_pod(),
            "/var/run/kubevirt/sockets/launcher.sock"
        );
    }
}
