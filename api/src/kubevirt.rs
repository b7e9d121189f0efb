//! The `KubeVirt` custom resource (kubevirt.io/v1): the one object an installation is made
//! from and configured through. virt-operator turns it into the control plane's objects and
//! reports on it; its phases and conditions are KubeVirt's, so `kubectl wait kv kubevirt
//! --for condition=Available` works as it does there.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::types::{preserved_object, Condition, Extra};

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "kubevirt.io",
    version = "v1",
    kind = "KubeVirt",
    namespaced,
    shortname = "kv",
    shortname = "kvs",
    status = "KubeVirtStatus",
    derive = "PartialEq",
    derive = "Default",
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct KubeVirtSpec {
    /// The release to run; the operator's own when empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_tag: Option<String>,
    /// Where the component images are pulled from; the operator's own when empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_registry: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub configuration: Option<KubeVirtConfiguration>,
    /// `BlockUninstallIfWorkloadsExist` (the default) or `RemoveWorkloads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uninstall_strategy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserved_object")]
    pub certificate_rotate_strategy: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserved_object")]
    pub workload_update_strategy: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserved_object")]
    pub infra: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserved_object")]
    pub workloads: Option<Value>,
    /// KubeVirt's other spec fields (customizeComponents, monitoring, …), kept as written
    /// and reported by the operator as not honoured.
    #[serde(flatten)]
    pub extra: Extra,
}

/// `spec.configuration`: the cluster's settings, which the components read live.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct KubeVirtConfiguration {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub developer_configuration: Option<DeveloperConfiguration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migrations: Option<ClusterMigrationConfiguration>,
    /// The cluster's default for VMIs that set none: None, LiveMigrate,
    /// LiveMigrateIfPossible or External.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eviction_strategy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkConfiguration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm_state_storage_class: Option<String>,
    /// The rest of KubeVirt's configuration, kept as written; the operator reports each
    /// field it does not honour.
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct DeveloperConfiguration {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub feature_gates: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disabled_feature_gates: Vec<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// KubeVirt's cluster-wide migration settings (`spec.configuration.migrations`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct ClusterMigrationConfiguration {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_migrations_per_cluster: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_outbound_migrations_per_node: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth_per_migration: Option<Quantity>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_timeout_per_gi_b: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress_timeout: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_auto_converge: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_post_copy: Option<bool>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct NetworkConfiguration {
    /// The binding of the pod network when a VMI names none: bridge or masquerade.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_network_interface: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permit_bridge_interface_on_pod_network: Option<bool>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// Where an installation stands.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum KubeVirtPhase {
    Deploying,
    Deployed,
    Deleting,
    Deleted,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KubeVirtStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<KubeVirtPhase>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operator_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_kube_virt_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_kube_virt_registry: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_kube_virt_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_kube_virt_registry: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_architecture: Option<String>,
    /// VMIs whose launcher is of an older release than the one deployed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outdated_virtual_machine_instance_workloads: Option<i32>,
}

/// The finalizer the operator keeps on the CR until it has removed what it installed.
pub const FINALIZER: &str = "foregroundDeleteKubeVirt";

/// The signer virt-operator runs for virt-handler's node certificates (migration and
/// console): a CertificateSigningRequest with this `signerName`, made by virt-handler's service
/// account with a node-bound token, for a certificate naming that node and no other.
pub const NODE_CERTIFICATE_SIGNER: &str = "kubevirt.io/virt-handler";
/// Where the API server records the node a node-bound service-account token was issued for,
/// in a CertificateSigningRequest's `spec.extra` (Kubernetes ≥ 1.30).
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";
/// virt-handler's service account in the install namespace.
pub const HANDLER_SERVICE_ACCOUNT: &str = "virt-handler";

/// `spec.uninstallStrategy` values.
pub const BLOCK_UNINSTALL_IF_WORKLOADS_EXIST: &str = "BlockUninstallIfWorkloadsExist";
pub const REMOVE_WORKLOADS: &str = "RemoveWorkloads";

/// The labels the operator puts on every object it installs.
pub mod labels {
    /// `virt-operator` on every object the operator installed (and may remove).
    pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
    pub const MANAGED_BY_OPERATOR: &str = "virt-operator";
    /// The release an object was installed from.
    pub const VERSION: &str = "app.kubernetes.io/version";
}

/// The CR's condition types and reasons, as KubeVirt sets them.
pub mod conditions {
    pub const AVAILABLE: &str = "Available";
    pub const PROGRESSING: &str = "Progressing";
    pub const DEGRADED: &str = "Degraded";
    pub const CREATED: &str = "Created";
    pub const SYNCHRONIZED: &str = "Synchronized";

    pub const ALL_COMPONENTS_READY: &str = "AllComponentsReady";
    pub const ALL_RESOURCES_CREATED: &str = "AllResourcesCreated";
    pub const DEPLOYMENT_IN_PROGRESS: &str = "DeploymentInProgress";
    pub const UPDATE_IN_PROGRESS: &str = "UpdateInProgress";
    pub const DEPLOYMENT_FAILED: &str = "DeploymentFailed";
    pub const DELETION_IN_PROGRESS: &str = "DeletionInProgress";
    pub const DELETION_BLOCKED: &str = "DeletionBlocked";
    pub const FIELDS_NOT_HONOURED: &str = "FieldsNotHonoured";
    pub const MULTIPLE_KUBEVIRTS: &str = "MultipleKubeVirtsExist";
    pub const INVALID_CONFIGURATION: &str = "InvalidConfiguration";
}

/// The feature gates microvirt acts on. KubeVirt's others are accepted and reported as not
/// honoured.
pub const KNOWN_FEATURE_GATES: &[&str] = &["HostDisk"];

/// The cluster-wide settings the components act on: their own defaults (KubeVirt's, or a
/// component's flags when it runs alone), with the KubeVirt CR's `spec.configuration` over
/// them. The components follow the CR as it changes; an invalid edit is refused whole and the
/// last valid settings stay in force, as KubeVirt does.
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterSettings {
    /// The migration settings a MigrationPolicy may override.
    pub migrations: crate::MigrationConfiguration,
    pub parallel_migrations_per_cluster: usize,
    pub parallel_outbound_migrations_per_node: usize,
    /// The eviction strategy of VMIs that set none.
    pub eviction_strategy: crate::migratability::EvictionStrategy,
    pub feature_gates: std::collections::BTreeSet<String>,
    pub network: crate::validation::NetworkDefaults,
    /// The storage class a running VM's machine state is captured into, for snapshots that
    /// keep it (KubeVirt's `vmStateStorageClass`); None: snapshots hold disks only.
    pub vm_state_storage_class: Option<String>,
}

impl Default for ClusterSettings {
    /// KubeVirt's defaults.
    fn default() -> Self {
        ClusterSettings {
            migrations: crate::MigrationConfiguration {
                bandwidth_per_migration: Some(Quantity("0Mi".into())),
                completion_timeout_per_gi_b: Some(150),
                allow_auto_converge: Some(false),
                allow_post_copy: Some(false),
                progress_timeout: Some(150),
                max_downtime_ms: Some(300),
            },
            parallel_migrations_per_cluster: 5,
            parallel_outbound_migrations_per_node: 2,
            eviction_strategy: Default::default(),
            feature_gates: Default::default(),
            network: Default::default(),
            vm_state_storage_class: None,
        }
    }
}

impl ClusterSettings {
    pub fn feature_gate(&self, gate: &str) -> bool {
        self.feature_gates.contains(gate)
    }

    /// These settings with `config` over them, or why `config` cannot be taken (by path).
    pub fn with(&self, config: &KubeVirtConfiguration) -> Result<ClusterSettings, String> {
        let mut s = self.clone();
        if let Some(m) = &config.migrations {
            let c = &mut s.migrations;
            if let Some(q) = &m.bandwidth_per_migration {
                crate::quantity::parse_bytes(&q.0).map_err(|e| {
                    format!("spec.configuration.migrations.bandwidthPerMigration: {e}")
                })?;
                c.bandwidth_per_migration = Some(q.clone());
            }
            let positive = |v: Option<i64>, field: &str| match v {
                Some(n) if n <= 0 => Err(format!(
                    "spec.configuration.migrations.{field}: {n} is not a positive number of seconds"
                )),
                _ => Ok(v),
            };
            if let Some(v) = positive(m.completion_timeout_per_gi_b, "completionTimeoutPerGiB")? {
                c.completion_timeout_per_gi_b = Some(v);
            }
            if let Some(v) = positive(m.progress_timeout, "progressTimeout")? {
                c.progress_timeout = Some(v);
            }
            c.allow_auto_converge = m.allow_auto_converge.or(c.allow_auto_converge);
            c.allow_post_copy = m.allow_post_copy.or(c.allow_post_copy);
            let count = |v: Option<u32>, field: &str, current: usize| match v {
                Some(0) => Err(format!(
                    "spec.configuration.migrations.{field}: must be at least 1"
                )),
                Some(n) => Ok(n as usize),
                None => Ok(current),
            };
            s.parallel_migrations_per_cluster = count(
                m.parallel_migrations_per_cluster,
                "parallelMigrationsPerCluster",
                s.parallel_migrations_per_cluster,
            )?;
            s.parallel_outbound_migrations_per_node = count(
                m.parallel_outbound_migrations_per_node,
                "parallelOutboundMigrationsPerNode",
                s.parallel_outbound_migrations_per_node,
            )?;
        }
        if let Some(e) = config
            .eviction_strategy
            .as_deref()
            .filter(|e| !e.is_empty())
        {
            s.eviction_strategy = e
                .parse()
                .map_err(|why| format!("spec.configuration.evictionStrategy: {why}"))?;
        }
        if let Some(n) = &config.network {
            match n.default_network_interface.as_deref() {
                None | Some("") => {}
                Some("masquerade") => s.network.binding = crate::closed::Binding::Masquerade,
                Some("bridge") => s.network.binding = crate::closed::Binding::Bridge,
                Some(other) => {
                    return Err(format!(
                        "spec.configuration.network.defaultNetworkInterface: {other:?} is not a binding microvirt has; accepted: masquerade, bridge"
                    ))
                }
            }
            if let Some(p) = n.permit_bridge_interface_on_pod_network {
                s.network.permit_bridge_on_pod_network = p;
            }
        }
        if let Some(class) = &config.vm_state_storage_class {
            s.vm_state_storage_class = Some(class.clone()).filter(|c| !c.is_empty());
        }
        if let Some(d) = &config.developer_configuration {
            s.feature_gates.extend(d.feature_gates.iter().cloned());
            for g in &d.disabled_feature_gates {
                s.feature_gates.remove(g);
            }
        }
        Ok(s)
    }

    /// The oldest KubeVirt CR among `all`: the one the cluster is installed and configured
    /// from (KubeVirt honours one).
    pub fn active(all: &[KubeVirt]) -> Option<&KubeVirt> {
        all.iter().min_by_key(|k| {
            (
                k.metadata.creation_timestamp.clone().map(|t| t.0),
                k.metadata.namespace.clone(),
                k.metadata.name.clone(),
            )
        })
    }
}

/// The fields of `config` microvirt acts on, by path (the rest are reported as not honoured).
pub const HONOURED_CONFIGURATION: &[&str] = &[
    "spec.configuration.migrations.parallelMigrationsPerCluster",
    "spec.configuration.migrations.parallelOutboundMigrationsPerNode",
    "spec.configuration.migrations.bandwidthPerMigration",
    "spec.configuration.migrations.completionTimeoutPerGiB",
    "spec.configuration.migrations.progressTimeout",
    "spec.configuration.migrations.allowAutoConverge",
    "spec.configuration.migrations.allowPostCopy",
    "spec.configuration.evictionStrategy",
    "spec.configuration.network.defaultNetworkInterface",
    "spec.configuration.network.permitBridgeInterfaceOnPodNetwork",
    "spec.configuration.developerConfiguration.featureGates",
    "spec.configuration.developerConfiguration.disabledFeatureGates",
    "spec.configuration.vmStateStorageClass",
];

#[cfg(test)]
mod tests {
    use super::*;

    fn config(yaml: &str) -> KubeVirtConfiguration {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn configuration_over_the_defaults() {
        let base = ClusterSettings::default();
        let s = base
            .with(&config(
                "migrations: {bandwidthPerMigration: 64Mi, parallelMigrationsPerCluster: 9}\nevictionStrategy: LiveMigrate\ndeveloperConfiguration: {featureGates: [HostDisk]}\n",
            ))
            .unwrap();
        assert_eq!(
            s.migrations.bandwidth_per_migration,
            Some(Quantity("64Mi".into()))
        );
        assert_eq!(s.migrations.completion_timeout_per_gi_b, Some(150));
        assert_eq!(s.parallel_migrations_per_cluster, 9);
        assert_eq!(s.parallel_outbound_migrations_per_node, 2);
        assert_eq!(
            s.eviction_strategy,
            crate::migratability::EvictionStrategy::LiveMigrate
        );
        assert!(s.feature_gate("HostDisk"));
        let off = s
            .with(&config(
                "developerConfiguration: {disabledFeatureGates: [HostDisk]}\n",
            ))
            .unwrap();
        assert!(!off.feature_gate("HostDisk"));
    }

    #[test]
    fn an_invalid_configuration_is_refused_by_path() {
        let base = ClusterSettings::default();
        for (yaml, path) in [
            (
                "migrations: {bandwidthPerMigration: fast}",
                "bandwidthPerMigration",
            ),
            (
                "migrations: {completionTimeoutPerGiB: 0}",
                "completionTimeoutPerGiB",
            ),
            (
                "migrations: {parallelMigrationsPerCluster: 0}",
                "parallelMigrationsPerCluster",
            ),
            ("evictionStrategy: Sometimes", "evictionStrategy"),
            (
                "network: {defaultNetworkInterface: slirp}",
                "defaultNetworkInterface",
            ),
        ] {
            let err = base.with(&config(yaml)).unwrap_err();
            assert!(err.contains(path), "{yaml}: {err}");
        }
    }
}
