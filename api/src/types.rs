//! kubevirt.io/v1 and migrations.kubevirt.io/v1alpha1 types.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Affinity, Toleration};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use crate::closed::{Binding, DiskBus, DiskCache, NicModel};

/// Fields of a user-written object that microvirt does not model, kept verbatim.
pub type Extra = BTreeMap<String, Value>;

/// Schema of a free-form object (e.g. `masquerade: {}`): structural, with unknown fields kept,
/// as CRD schemas require.
pub(crate) fn preserved_object(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({"type": "object", "x-kubernetes-preserve-unknown-fields": true})
}

fn preserved_objects(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "array",
        "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}
    })
}

// ---------------------------------------------------------------------------------------------
// VirtualMachine

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "kubevirt.io",
    version = "v1",
    kind = "VirtualMachine",
    namespaced,
    shortname = "vm",
    shortname = "vms",
    status = "VirtualMachineStatus",
    derive = "PartialEq",
    derive = "Default",
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    printcolumn = r#"{"name":"Status","type":"string","jsonPath":".status.printableStatus"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type=='Ready')].status"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
/// VirtualMachine is a VM that keeps its identity, disks and network across restarts: its
/// runStrategy says when virt-controller makes a VirtualMachineInstance from its template.
pub struct VirtualMachineSpec {
    /// Deprecated in KubeVirt in favour of `runStrategy`; `true` means Always, `false` Halted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// When the VM runs: Always (restarted whenever it stops), RerunOnFailure (restarted
    /// only after a failure), Manual (started and stopped by the user), Halted (never), Once
    /// (until it stops once). Mutually exclusive with `running`.
    pub run_strategy: Option<RunStrategy>,
    /// The VirtualMachineInstance made each time the VM starts.
    pub template: VirtualMachineInstanceTemplateSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserved_objects")]
    /// CDI DataVolumes created with the VM; microvirt accepts them and warns: it does not
    /// run CDI, so a volume must name an existing PersistentVolumeClaim.
    pub data_volume_templates: Option<Vec<Value>>,
    /// The instance type that sizes the VM (instancetype.kubevirt.io).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instancetype: Option<Matcher>,
    /// The preference that fills in what the VM leaves unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preference: Option<Matcher>,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum RunStrategy {
    Always,
    RerunOnFailure,
    Manual,
    Halted,
    Once,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstanceTemplateSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<ObjectMeta>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<VirtualMachineInstanceSpec>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct VirtualMachineStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub printable_status: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created: Option<bool>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub state_change_requests: Vec<StateChangeRequest>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_failure: Option<StartFailure>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_strategy: Option<RunStrategy>,
    /// The VirtualMachineSnapshot capturing this VM (KubeVirt's lock): no VMI is started
    /// until it is done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_in_progress: Option<String>,
    /// The VirtualMachineRestore writing this VM: no VMI is started until it is done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_in_progress: Option<String>,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StateChangeRequest {
    pub action: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<BTreeMap<String, String>>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StartFailure {
    pub consecutive_fail_count: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_timestamp: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failed_vmi_uid: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_probe_time: Option<String>,
}

/// `spec.instancetype` / `spec.preference` of a VirtualMachine.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Matcher {
    pub name: String,
    /// The kind looked in: the cluster-wide one unless the namespaced one is named (KubeVirt's
    /// default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// The ControllerRevision holding the spec the VM was started with (set by the controller).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision_name: Option<String>,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

// ---------------------------------------------------------------------------------------------
// VirtualMachineInstance

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "kubevirt.io",
    version = "v1",
    kind = "VirtualMachineInstance",
    namespaced,
    shortname = "vmi",
    shortname = "vmis",
    status = "VirtualMachineInstanceStatus",
    derive = "PartialEq",
    derive = "Default",
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"IP","type":"string","jsonPath":".status.interfaces[0].ipAddress"}"#,
    printcolumn = r#"{"name":"NodeName","type":"string","jsonPath":".status.nodeName"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type=='Ready')].status"}"#,
    printcolumn = r#"{"name":"Live-Migratable","type":"string","jsonPath":".status.conditions[?(@.type=='LiveMigratable')].status","priority":1}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
/// VirtualMachineInstanceSpec is the guest: its devices and resources (`domain`), the
/// volumes and networks they use, and where and how its launcher Pod runs.
pub struct VirtualMachineInstanceSpec {
    /// The guest's CPU, memory, firmware and devices.
    pub domain: DomainSpec,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    /// Where the guest's disks come from, matched to `domain.devices.disks` by name.
    pub volumes: Vec<Volume>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    /// The networks (the Pod network, Multus) the guest's interfaces attach to, by name.
    pub networks: Vec<Network>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// Seconds the guest gets to shut down (ACPI power button) before it is stopped.
    pub termination_grace_period_seconds: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// What a node drain does to the VMI: LiveMigrate, LiveMigrateIfPossible, None or
    /// External.
    pub eviction_strategy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerations: Option<Vec<Toleration>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subdomain: Option<String>,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

impl VirtualMachineInstanceSpec {
    /// The interfaces (with their index) bound to the pod network as a bridge: what a
    /// cluster may forbid, and what keeps a VMI from live migration.
    pub fn pod_network_bridges(&self) -> Vec<(usize, &Interface)> {
        let pod_networks: Vec<&str> = self
            .networks
            .iter()
            .filter(|n| n.pod.is_some())
            .map(|n| n.name.as_str())
            .collect();
        self.domain
            .devices
            .interfaces
            .iter()
            .enumerate()
            .filter(|(_, i)| i.bridge.is_some() && pod_networks.contains(&i.name.as_str()))
            .collect()
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
/// The virtual hardware: CPU topology, memory, devices, firmware.
pub struct DomainSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<Cpu>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// Guest memory (`guest`), in any Kubernetes quantity; rounded up to whole MiB.
    pub memory: Option<Memory>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    #[serde(default)]
    /// Disks, interfaces and other devices of the guest.
    pub devices: Devices,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub firmware: Option<Firmware>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine: Option<Machine>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserved_object")]
    pub features: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserved_object")]
    pub clock: Option<Value>,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct Cpu {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sockets: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cores: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threads: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub features: Vec<CpuFeature>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dedicated_cpu_placement: Option<bool>,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

impl Cpu {
    /// The topology fields by their manifest names, in KubeVirt's order.
    pub fn topology(&self) -> [(&'static str, Option<u32>); 3] {
        [
            ("sockets", self.sockets),
            ("cores", self.cores),
            ("threads", self.threads),
        ]
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CpuFeature {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct Memory {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest: Option<Quantity>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserved_object")]
    pub hugepages: Option<Value>,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResourceRequirements {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub requests: BTreeMap<String, Quantity>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: BTreeMap<String, Quantity>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overcommit_guest_overhead: Option<bool>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct Devices {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<Disk>,
    /// Volumes the guest mounts as a live filesystem (`mount -t virtiofs NAME /mnt`), served
    /// by virtiofsd beside the VMM as KubeVirt serves them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub filesystems: Vec<Filesystem>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub interfaces: Vec<Interface>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserved_object")]
    pub rng: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoattach_serial_console: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoattach_graphics_device: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoattach_pod_interface: Option<bool>,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

/// `spec.domain.devices.filesystems[]`: a volume shared into the guest; its name is the tag.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Filesystem {
    pub name: String,
    /// `{}`: the only filesystem type (KubeVirt's too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserved_object")]
    pub virtiofs: Option<Value>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct Disk {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<DiskTarget>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cdrom: Option<CdromTarget>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lun: Option<LunTarget>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_order: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    /// none, writethrough, writeback
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>")]
    pub cache: Option<DiskCache>,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DiskTarget {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>")]
    pub bus: Option<DiskBus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readonly: Option<bool>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CdromTarget {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>")]
    pub bus: Option<DiskBus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readonly: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tray: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LunTarget {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>")]
    pub bus: Option<DiskBus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readonly: Option<bool>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct Interface {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserved_object")]
    pub masquerade: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserved_object")]
    pub bridge: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserved_object")]
    pub sriov: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserved_object")]
    pub slirp: Option<Value>,
    /// A network binding by name (KubeVirt's binding plugins): microvirt's own `vhostuser`
    /// attaches the NIC to the vhost-user socket a userspace CNI made for its Multus network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub binding: Option<PluginBinding>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac_address: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>")]
    pub model: Option<NicModel>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserved_objects")]
    pub ports: Option<Vec<Value>>,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

impl Interface {
    /// The binding methods the interface sets (validation accepts exactly one).
    pub fn bindings(&self) -> Vec<Binding> {
        [
            (self.masquerade.is_some(), Binding::Masquerade),
            (self.bridge.is_some(), Binding::Bridge),
            (self.sriov.is_some(), Binding::Sriov),
            (self.slirp.is_some(), Binding::Slirp),
            (self.binding.is_some(), Binding::Plugin),
        ]
        .into_iter()
        .filter_map(|(set, b)| set.then_some(b))
        .collect()
    }
}

/// `interfaces[].binding`: a binding by name.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PluginBinding {
    pub name: String,
}

/// The one named binding microvirt has (`binding: {name: vhostuser}`).
pub const VHOST_USER_BINDING: &str = "vhostuser";

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct Firmware {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_boot: Option<KernelBoot>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootloader: Option<Bootloader>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KernelBoot {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<KernelBootContainer>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_args: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KernelBootContainer {
    pub image: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initrd_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_secret: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Bootloader {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserved_object")]
    pub bios: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserved_object")]
    pub efi: Option<Value>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Machine {
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub type_: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct Volume {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_disk: Option<ContainerDiskSource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim: Option<PvcSource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_volume: Option<DataVolumeSource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub empty_disk: Option<EmptyDiskSource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_disk: Option<HostDiskSource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_init_no_cloud: Option<CloudInitNoCloudSource>,
    /// cloud-init's OpenStack config drive: the same data as NoCloud, in the layout of the
    /// ConfigDrive data source (a disk labelled `config-2`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_init_config_drive: Option<CloudInitNoCloudSource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map: Option<ConfigMapSource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<SecretSource>,
    /// A ServiceAccount's token, with the cluster's CA and the namespace, as the files a Pod
    /// finds in `/var/run/secrets/kubernetes.io/serviceaccount`; shared with virtio-fs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account: Option<ServiceAccountSource>,
    /// Fields of the launcher Pod (the VMI's labels and annotations, its name, namespace, ...)
    /// as files; shared with virtio-fs.
    #[serde(
        default,
        rename = "downwardAPI",
        skip_serializing_if = "Option::is_none"
    )]
    pub downward_api: Option<DownwardApiSource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ephemeral: Option<EphemeralSource>,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContainerDiskSource {
    pub image: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_secret: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PvcSource {
    pub claim_name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_only: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hotpluggable: Option<bool>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DataVolumeSource {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hotpluggable: Option<bool>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EmptyDiskSource {
    pub capacity: Quantity,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HostDiskSource {
    pub path: String,
    /// Disk or DiskOrCreate
    #[serde(rename = "type")]
    pub type_: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<Quantity>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared: Option<bool>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CloudInitNoCloudSource {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data_base64: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_data: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_data_base64: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserved_object")]
    pub user_data_secret_ref: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserved_object")]
    pub network_data_secret_ref: Option<Value>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConfigMapSource {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optional: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_label: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretSource {
    pub secret_name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optional: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_label: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServiceAccountSource {
    pub service_account_name: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DownwardApiSource {
    /// The files, as a Pod's `downwardAPI` volume lists them (`path` and a `fieldRef` or
    /// `resourceFieldRef`).
    #[serde(default)]
    pub fields: Vec<k8s_openapi::api::core::v1::DownwardAPIVolumeFile>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_label: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EphemeralSource {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim: Option<PvcSource>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct Network {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<PodNetwork>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multus: Option<MultusNetwork>,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodNetwork {
    #[serde(
        rename = "vmNetworkCIDR",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub vm_network_cidr: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MultusNetwork {
    pub network_name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<bool>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct VirtualMachineInstanceStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<VmiPhase>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub interfaces: Vec<InterfaceStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration_state: Option<MigrationState>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration_method: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launcher_container_image_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_pods: Option<BTreeMap<String, String>>,
    /// Set when the launcher Pod's eviction was turned into a live migration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evacuation_node_name: Option<String>,
    /// The memory the guest got (a size that is not a whole MiB is rounded up).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryStatus>,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum VmiPhase {
    Pending,
    Scheduling,
    Scheduled,
    Running,
    Succeeded,
    Failed,
    Unknown,
}

/// KubeVirt's `status.memory`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MemoryStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_at_boot: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_current: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_requested: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InterfaceStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip_address: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ip_addresses: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface_name: Option<String>,
    /// The Pod interface the NIC is wired to (`eth0`, or the one Multus made).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_interface_name: Option<String>,
    /// Where the information came from (KubeVirt: `domain`, `guest-agent`, `multus-status`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub info_source: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigrationState {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration_uid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_node: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_node: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_pod: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_node_address: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_timestamp: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_timestamp: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<bool>,
    /// Why the migration failed, as virt-handler saw it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abort_status: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration_configuration: Option<MigrationConfiguration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration_policy_name: Option<String>,
}

/// The effective migration settings, from KubeVirt's defaults and a matching MigrationPolicy.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigrationConfiguration {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth_per_migration: Option<Quantity>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_timeout_per_gi_b: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_auto_converge: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_post_copy: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress_timeout: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_downtime_ms: Option<i64>,
}

// ---------------------------------------------------------------------------------------------
// VirtualMachineInstanceReplicaSet

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "kubevirt.io",
    version = "v1",
    kind = "VirtualMachineInstanceReplicaSet",
    namespaced,
    shortname = "vmirs",
    shortname = "vmirss",
    status = "VirtualMachineInstanceReplicaSetStatus",
    derive = "PartialEq",
    derive = "Default",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.labelSelector"
    ),
    printcolumn = r#"{"name":"Desired","type":"integer","jsonPath":".spec.replicas"}"#,
    printcolumn = r#"{"name":"Current","type":"integer","jsonPath":".status.replicas"}"#,
    printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.readyReplicas"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstanceReplicaSetSpec {
    #[serde(flatten)]
    pub target: ReplicaTarget,
    pub template: VirtualMachineInstanceTemplateSpec,
}

// What every kind that keeps replicas asks for (a VMI ReplicaSet, a VM pool): how many, which
// objects count, and whether to act at all. KubeVirt gives both kinds these fields, which the
// scale subresource reads. (A plain comment: a doc comment would reach the CRDs' schema.)
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaTarget {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    pub selector: LabelSelector,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused: Option<bool>,
}

// The status of an object that keeps replicas (a VMI ReplicaSet, a VM pool): KubeVirt gives
// both the same fields, which the scale subresource reads. (A plain comment: a doc comment
// would become the CRDs' status description.)
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplicasStatus {
    #[serde(default)]
    pub replicas: i32,
    #[serde(default)]
    pub ready_replicas: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label_selector: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

pub type VirtualMachineInstanceReplicaSetStatus = ReplicasStatus;

impl AsRef<ReplicaTarget> for VirtualMachineInstanceReplicaSetSpec {
    fn as_ref(&self) -> &ReplicaTarget {
        &self.target
    }
}

// ---------------------------------------------------------------------------------------------
// VirtualMachinePool (pool.kubevirt.io/v1beta1)

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "pool.kubevirt.io",
    version = "v1beta1",
    kind = "VirtualMachinePool",
    plural = "virtualmachinepools",
    namespaced,
    shortname = "vmpool",
    shortname = "vmpools",
    status = "VirtualMachinePoolStatus",
    derive = "PartialEq",
    derive = "Default",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.labelSelector"
    ),
    printcolumn = r#"{"name":"Desired","type":"integer","jsonPath":".spec.replicas"}"#,
    printcolumn = r#"{"name":"Current","type":"integer","jsonPath":".status.replicas"}"#,
    printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.readyReplicas"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachinePoolSpec {
    #[serde(flatten)]
    pub target: ReplicaTarget,
    pub virtual_machine_template: VirtualMachineTemplateSpec,
}

impl AsRef<ReplicaTarget> for VirtualMachinePoolSpec {
    fn as_ref(&self) -> &ReplicaTarget {
        &self.target
    }
}

/// A pool's template: the VMs' metadata and spec.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineTemplateSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<ObjectMeta>,
    pub spec: VirtualMachineSpec,
}

pub type VirtualMachinePoolStatus = ReplicasStatus;

// ---------------------------------------------------------------------------------------------
// VirtualMachineInstanceMigration

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "kubevirt.io",
    version = "v1",
    kind = "VirtualMachineInstanceMigration",
    namespaced,
    shortname = "vmim",
    shortname = "vmims",
    status = "VirtualMachineInstanceMigrationStatus",
    derive = "PartialEq",
    derive = "Default",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"VMI","type":"string","jsonPath":".spec.vmiName"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstanceMigrationSpec {
    pub vmi_name: String,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum MigrationPhase {
    Pending,
    Scheduling,
    Scheduled,
    PreparingTarget,
    TargetReady,
    Running,
    Succeeded,
    Failed,
}

impl MigrationPhase {
    /// Succeeded or Failed: nothing more happens to the migration.
    pub fn is_final(self) -> bool {
        matches!(self, MigrationPhase::Succeeded | MigrationPhase::Failed)
    }
}

impl VirtualMachineInstanceMigration {
    /// Whether the migration has not reached a final phase (one without a phase has not).
    pub fn is_unfinished(&self) -> bool {
        !self
            .status
            .as_ref()
            .and_then(|s| s.phase)
            .is_some_and(MigrationPhase::is_final)
    }

    /// The unfinished migration of VMI `vmi` among `all` (one namespace's migrations), if any:
    /// KubeVirt allows one at a time per VMI.
    pub fn unfinished_of<'a>(all: &'a [Self], vmi: &str) -> Option<&'a Self> {
        all.iter()
            .find(|m| m.spec.vmi_name == vmi && m.is_unfinished())
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstanceMigrationStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<MigrationPhase>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub phase_transition_timestamps: Vec<PhaseTransition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration_state: Option<MigrationState>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PhaseTransition {
    pub phase: String,
    pub phase_transition_timestamp: String,
}

// ---------------------------------------------------------------------------------------------
// MigrationPolicy

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "migrations.kubevirt.io",
    version = "v1alpha1",
    kind = "MigrationPolicy",
    status = "MigrationPolicyStatus",
    derive = "PartialEq",
    derive = "Default"
)]
#[serde(rename_all = "camelCase")]
pub struct MigrationPolicySpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_auto_converge: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth_per_migration: Option<Quantity>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_timeout_per_gi_b: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_post_copy: Option<bool>,
    #[serde(default)]
    pub selectors: MigrationSelectors,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigrationSelectors {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_machine_instance_selector: Option<BTreeMap<String, String>>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct MigrationPolicyStatus {}
