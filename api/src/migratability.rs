//! Whether a VMI can be live-migrated, decided from its spec and the claims its volumes use,
//! with KubeVirt's `LiveMigratable` condition reasons. The controller publishes the answer as
//! that condition; migrations and the eviction webhook read it.
//!
//! What follows a guest to another node: guest memory and device state (the monitor's
//! migration stream), ephemeral disks (containerDisk, emptyDisk, cloud-init seeds: copied with
//! the migration, as KubeVirt's block migration does), ReadWriteMany claims (the target opens
//! the same volume). What cannot: a hostDisk (a file on one node), a claim only one node may
//! mount, a bridge-bound pod-network interface (its address belongs to the source Pod), and a
//! virtiofs filesystem (virtiofsd's state stays behind).

use crate::types::VirtualMachineInstanceSpec;

/// KubeVirt's reason for a VMI whose disks keep it on its node.
pub const REASON_DISKS: &str = "DisksNotLiveMigratable";
/// KubeVirt's reason for a VMI whose interfaces keep it on its node.
pub const REASON_INTERFACE: &str = "InterfaceNotLiveMigratable";
/// KubeVirt's reason for a VMI that shares a filesystem with virtiofs.
pub const REASON_VIRTIOFS: &str = "VirtIOFSNotLiveMigratable";
/// KubeVirt's opt-in for migrating a VMI with a bridge-bound pod-network interface (the user
/// accepts that the guest's address changes).
pub const ALLOW_POD_BRIDGE_MIGRATION: &str = "kubevirt.io/allow-pod-bridge-network-live-migration";

/// Why a VMI cannot be live-migrated: a `LiveMigratable=False` condition's reason and message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotMigratable {
    pub reason: &'static str,
    pub message: String,
}

/// What evicting a VMI's launcher Pod does (`spec.evictionStrategy`, else the cluster default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EvictionStrategy {
    /// The Pod is evicted; the VM's runStrategy decides what happens next.
    #[default]
    None,
    /// The VMI is live-migrated away; eviction is refused while it cannot be.
    LiveMigrate,
    /// As `LiveMigrate` when the VMI is migratable, otherwise as `None`.
    LiveMigrateIfPossible,
    /// Eviction is refused and the VMI marked (`status.evacuationNodeName`) for an external
    /// controller (e.g. cluster-api-provider-kubevirt) to act on.
    External,
}

impl std::str::FromStr for EvictionStrategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "None" => EvictionStrategy::None,
            "LiveMigrate" => EvictionStrategy::LiveMigrate,
            "LiveMigrateIfPossible" => EvictionStrategy::LiveMigrateIfPossible,
            "External" => EvictionStrategy::External,
            _ => {
                return Err(format!(
                    "{s:?} is not an eviction strategy; accepted: None, LiveMigrate, \
                     LiveMigrateIfPossible, External"
                ))
            }
        })
    }
}

impl EvictionStrategy {
    /// The VMI's own strategy, else `cluster_default`. An unknown value (validation refuses
    /// those) counts as `None`.
    pub fn of(spec: &VirtualMachineInstanceSpec, cluster_default: EvictionStrategy) -> Self {
        match &spec.eviction_strategy {
            Some(s) => s.parse().unwrap_or_default(),
            None => cluster_default,
        }
    }

    /// What evicting the launcher Pod of a VMI that is (or is not) migratable does.
    pub fn on_eviction(self, migratable: bool) -> EvictionOutcome {
        use EvictionOutcome::*;
        match (self, migratable) {
            (EvictionStrategy::None, _) | (EvictionStrategy::LiveMigrateIfPossible, false) => Evict,
            (EvictionStrategy::LiveMigrate | EvictionStrategy::LiveMigrateIfPossible, true) => {
                Migrate
            }
            (EvictionStrategy::LiveMigrate, false) => Refuse,
            (EvictionStrategy::External, _) => MarkOnly,
        }
    }
}

/// What evicting this VMI's Pod does now, judged by its strategy (else `cluster_default`) and
/// its published `LiveMigratable` condition (not yet published counts as not migratable).
pub fn eviction_outcome(
    spec: &VirtualMachineInstanceSpec,
    status: &crate::types::VirtualMachineInstanceStatus,
    cluster_default: EvictionStrategy,
) -> EvictionOutcome {
    let migratable = crate::conditions::published_migratability(status).is_some_and(|r| r.is_ok());
    EvictionStrategy::of(spec, cluster_default).on_eviction(migratable)
}

/// What an eviction of a launcher Pod turns into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvictionOutcome {
    /// The Pod may go.
    Evict,
    /// Refused; the VMI is marked for evacuation and live-migrated away.
    Migrate,
    /// Refused; the VMI is marked for evacuation and left to an external controller.
    MarkOnly,
    /// Refused and nothing else happens: the VMI must stay and cannot move.
    Refuse,
}

impl EvictionOutcome {
    /// Whether the Pod needs protecting from eviction (a PodDisruptionBudget) in this state.
    pub fn protects_pod(self) -> bool {
        self != EvictionOutcome::Evict
    }
}

/// What is known of a PersistentVolumeClaim a volume names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClaimAccess {
    /// `ReadWriteMany`: both nodes can open it during the hand-off.
    Shared,
    /// Only one node may mount it.
    NotShared,
    /// The claim does not exist (yet).
    Missing,
}

/// The claim a volume reads, if it is a PVC or a DataVolume (whose PVC has its name).
pub fn claim_of(volume: &crate::types::Volume) -> Option<&str> {
    volume
        .persistent_volume_claim
        .as_ref()
        .map(|p| p.claim_name.as_str())
        .or(volume.data_volume.as_ref().map(|d| d.name.as_str()))
}

/// The first reason `spec` cannot be live-migrated, or `None` when it can. `claim` answers for
/// every claim a volume names; `annotations` are the VMI's.
pub fn live_migration_blocker(
    spec: &VirtualMachineInstanceSpec,
    annotations: &std::collections::BTreeMap<String, String>,
    claim: impl Fn(&str) -> ClaimAccess,
) -> Option<NotMigratable> {
    if let Some(fs) = spec.domain.devices.filesystems.first() {
        return Some(NotMigratable {
            reason: REASON_VIRTIOFS,
            message: format!(
                "filesystem {:?} is served by virtiofsd, whose open files and ring state this \
                 VMM cannot carry to another node yet",
                fs.name
            ),
        });
    }
    for v in &spec.volumes {
        if let Some(h) = &v.host_disk {
            return Some(NotMigratable {
                reason: REASON_DISKS,
                message: format!(
                    "volume {:?} is a hostDisk ({}): the file exists only on this node",
                    v.name, h.path
                ),
            });
        }
        let Some(name) = claim_of(v) else { continue };
        let why = match claim(name) {
            ClaimAccess::Shared => continue,
            ClaimAccess::NotShared => "is not shared (its accessModes lack ReadWriteMany)",
            ClaimAccess::Missing => "does not exist",
        };
        return Some(NotMigratable {
            reason: REASON_DISKS,
            message: format!(
                "volume {:?}: PersistentVolumeClaim {name:?} {why}; live migration needs every \
                 claim to be ReadWriteMany",
                v.name
            ),
        });
    }
    if annotations.contains_key(ALLOW_POD_BRIDGE_MIGRATION) {
        return None;
    }
    spec.pod_network_bridges()
        .into_iter()
        .next()
        .map(|(_, i)| NotMigratable {
            reason: REASON_INTERFACE,
            message: format!(
                "interface {:?} uses bridge binding on the pod network, whose address stays \
                 with the source Pod; use masquerade, or annotate the VMI \
                 {ALLOW_POD_BRIDGE_MIGRATION} to accept a new address",
                i.name
            ),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::VirtualMachineInstance;
    use kube::ResourceExt;

    #[test]
    fn eviction_follows_kubevirts_table() {
        use EvictionOutcome::*;
        use EvictionStrategy as S;
        for (s, migratable, want) in [
            (S::None, true, Evict),
            (S::None, false, Evict),
            (S::LiveMigrate, true, Migrate),
            (S::LiveMigrate, false, Refuse),
            (S::LiveMigrateIfPossible, true, Migrate),
            (S::LiveMigrateIfPossible, false, Evict),
            (S::External, true, MarkOnly),
            (S::External, false, MarkOnly),
        ] {
            assert_eq!(
                s.on_eviction(migratable),
                want,
                "{s:?} migratable={migratable}"
            );
        }
        let v = vmi(BASE);
        assert_eq!(
            EvictionStrategy::of(&v.spec, S::LiveMigrate),
            S::LiveMigrate
        );
        let mut spec = v.spec.clone();
        spec.eviction_strategy = Some("None".into());
        assert_eq!(EvictionStrategy::of(&spec, S::LiveMigrate), S::None);
        assert!("Drain"
            .parse::<EvictionStrategy>()
            .unwrap_err()
            .contains("accepted: None"));
    }

    fn vmi(yaml: &str) -> VirtualMachineInstance {
        serde_yaml::from_str(yaml).unwrap()
    }

    const BASE: &str = "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {name: a}\nspec:\n  domain:\n    devices:\n      interfaces: [{name: default, bridge: {}}]\n  networks: [{name: default, pod: {}}]\n";

    #[test]
    fn ephemeral_disks_and_masquerade_migrate() {
        let v = vmi("apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {name: a}\nspec:\n  domain:\n    devices:\n      interfaces: [{name: default, masquerade: {}}]\n  networks: [{name: default, pod: {}}]\n  volumes:\n  - {name: root, containerDisk: {image: x}}\n  - {name: scratch, emptyDisk: {capacity: 1Gi}}\n  - {name: rwx, persistentVolumeClaim: {claimName: shared}}\n");
        let got = live_migration_blocker(&v.spec, v.annotations(), |c| {
            assert_eq!(c, "shared");
            ClaimAccess::Shared
        });
        assert_eq!(got, None);
    }

    #[test]
    fn unshared_or_missing_claims_and_host_disks_block() {
        let v = vmi("apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {name: a}\nspec:\n  domain: {}\n  volumes:\n  - {name: data, dataVolume: {name: dv1}}\n");
        let got =
            live_migration_blocker(&v.spec, v.annotations(), |_| ClaimAccess::NotShared).unwrap();
        assert_eq!(got.reason, REASON_DISKS);
        assert!(
            got.message.contains("\"dv1\" is not shared"),
            "{}",
            got.message
        );
        let got =
            live_migration_blocker(&v.spec, v.annotations(), |_| ClaimAccess::Missing).unwrap();
        assert!(got.message.contains("does not exist"), "{}", got.message);

        let v = vmi("apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {name: a}\nspec:\n  domain: {}\n  volumes:\n  - {name: h, hostDisk: {path: /var/h.img, type: Disk}}\n");
        let got =
            live_migration_blocker(&v.spec, v.annotations(), |_| ClaimAccess::Shared).unwrap();
        assert_eq!(got.reason, REASON_DISKS);
        assert!(
            got.message.contains("hostDisk (/var/h.img)"),
            "{}",
            got.message
        );
    }

    #[test]
    fn pod_bridge_blocks_unless_annotated() {
        let v = vmi(BASE);
        let got =
            live_migration_blocker(&v.spec, v.annotations(), |_| ClaimAccess::Shared).unwrap();
        assert_eq!(got.reason, REASON_INTERFACE);
        assert!(got.message.contains("\"default\""), "{}", got.message);
        let mut v = v;
        v.metadata.annotations = Some([(ALLOW_POD_BRIDGE_MIGRATION.to_string(), "".into())].into());
        assert_eq!(
            live_migration_blocker(&v.spec, v.annotations(), |_| ClaimAccess::Shared),
            None
        );
    }
}
