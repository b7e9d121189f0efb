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
}
