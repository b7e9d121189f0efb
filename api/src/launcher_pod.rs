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
