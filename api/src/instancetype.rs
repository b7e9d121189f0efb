//! instancetype.kubevirt.io/v1beta1: instance types (the VM's size: vCPUs and memory) and
//! preferences (defaults for what the VM leaves unset), namespaced and cluster-wide, and how a
//! VM's `spec.instancetype` / `spec.preference` expand into the VMI it runs — as KubeVirt does:
//! the instance type wins and a VM that also sets what it sets is refused; a preference only
//! fills what the VM leaves unset.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::types::{Cpu, Extra, Matcher, Memory, VirtualMachineInstanceSpec};

pub const GROUP: &str = "instancetype.kubevirt.io";
pub const VERSION: &str = "v1beta1";

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CpuInstancetype {
    /// vCPUs the guest gets.
    pub guest: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dedicated_cpu_placement: Option<bool>,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MemoryInstancetype {
    pub guest: Quantity,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

/// The body both instance type kinds share.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct InstancetypeSpec {
    pub cpu: CpuInstancetype,
    pub memory: MemoryInstancetype,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CpuPreference {
    /// preferSockets (the default), preferCores, preferThreads, preferSpread or preferAny.
    #[serde(
        rename = "preferredCPUTopology",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub preferred_cpu_topology: Option<String>,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DevicePreference {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>")]
    pub preferred_disk_bus: Option<crate::closed::DiskBus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>")]
    pub preferred_cdrom_bus: Option<crate::closed::DiskBus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>")]
    pub preferred_interface_model: Option<crate::closed::NicModel>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preferred_autoattach_serial_console: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preferred_autoattach_pod_interface: Option<bool>,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

/// The body both preference kinds share.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct PreferenceSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<CpuPreference>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<DevicePreference>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preferred_termination_grace_period_seconds: Option<i64>,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

macro_rules! kinds {
    ($($spec:ident => $kind:literal, $plural:literal, $short:literal, [$($scope:ident)?], $body:ty;)*) => {$(
        #[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
        #[kube(group = "instancetype.kubevirt.io", version = "v1beta1", kind = $kind,
               plural = $plural, shortname = $short $(, $scope)?)]
        #[serde(transparent)]
        pub struct $spec(pub $body);
    )*};
}

kinds! {
    VirtualMachineInstancetypeSpec => "VirtualMachineInstancetype", "virtualmachineinstancetypes", "vminstancetype", [namespaced], InstancetypeSpec;
    VirtualMachineClusterInstancetypeSpec => "VirtualMachineClusterInstancetype", "virtualmachineclusterinstancetypes", "vmclusterinstancetype", [], InstancetypeSpec;
    VirtualMachinePreferenceSpec => "VirtualMachinePreference", "virtualmachinepreferences", "vmpref", [namespaced], PreferenceSpec;
    VirtualMachineClusterPreferenceSpec => "VirtualMachineClusterPreference", "virtualmachineclusterpreferences", "vmcpref", [], PreferenceSpec;
}

/// Which kind a matcher names (`cluster` unless it names `namespaced`), and whether it is the
/// namespaced one.
fn matcher_kind(
    m: &Matcher,
    field: &str,
    namespaced: &'static str,
    cluster: &'static str,
) -> Result<(&'static str, bool), String> {
    match m.kind.as_deref() {
        None => Ok((cluster, false)),
        Some(k) if k.eq_ignore_ascii_case(cluster) => Ok((cluster, false)),
        Some(k) if k.eq_ignore_ascii_case(namespaced) => Ok((namespaced, true)),
        Some(k) => Err(format!(
            "spec.{field}.kind: {k:?} is not {namespaced} or {cluster}"
        )),
    }
}

pub fn instancetype_kind(m: &Matcher) -> Result<(&'static str, bool), String> {
    matcher_kind(
        m,
        "instancetype",
        "VirtualMachineInstancetype",
        "VirtualMachineClusterInstancetype",
    )
}

pub fn preference_kind(m: &Matcher) -> Result<(&'static str, bool), String> {
    matcher_kind(
        m,
        "preference",
        "VirtualMachinePreference",
        "VirtualMachineClusterPreference",
    )
}

/// The VM template fields an instance type sets, when the VM sets them too (KubeVirt refuses
/// such a VM).
pub fn conflicts(spec: &VirtualMachineInstanceSpec, base: &str) -> Vec<String> {
    let mut out = Vec::new();
    let d = &spec.domain;
    if let Some(c) = &d.cpu {
        for (f, v) in c.topology() {
            if v.is_some() {
                out.push(format!("{base}.domain.cpu.{f}"));
            }
        }
        if c.model.is_some() {
            out.push(format!("{base}.domain.cpu.model"));
        }
        if c.dedicated_cpu_placement.is_some() {
            out.push(format!("{base}.domain.cpu.dedicatedCpuPlacement"));
        }
    }
    if d.memory.as_ref().is_some_and(|m| m.guest.is_some()) {
        out.push(format!("{base}.domain.memory.guest"));
    }
    if let Some(r) = &d.resources {
        for k in ["cpu", "memory"] {
            if r.requests.contains_key(k) {
                out.push(format!("{base}.domain.resources.requests.{k}"));
            }
        }
    }
    out
}

/// KubeVirt's message for conflicting fields.
pub fn conflict_message(paths: &[String]) -> String {
    format!(
        "VM field(s) {} conflicts with selected instance type",
        paths.join(", ")
    )
}

/// Expands an instance type and a preference into a VMI spec (before KubeVirt's defaults are
/// applied, so a preference sees what the user left unset). Refuses fields that conflict.
pub fn expand(
    spec: &mut VirtualMachineInstanceSpec,
    instancetype: Option<&InstancetypeSpec>,
    preference: Option<&PreferenceSpec>,
    base: &str,
) -> Result<(), String> {
    if let Some(it) = instancetype {
        let c = conflicts(spec, base);
        if !c.is_empty() {
            return Err(conflict_message(&c));
        }
        let topology = preference
            .and_then(|p| p.cpu.as_ref())
            .and_then(|c| c.preferred_cpu_topology.as_deref())
            .unwrap_or("preferSockets");
        let n = it.cpu.guest.max(1);
        let (sockets, cores, threads) = match topology {
            "preferCores" => (1, n, 1),
            "preferThreads" => (1, 1, n),
            // preferSockets, preferSpread and preferAny all have a single-NUMA guest here.
            _ => (n, 1, 1),
        };
        let cpu = spec.domain.cpu.get_or_insert_with(Cpu::default);
        cpu.sockets = Some(sockets);
        cpu.cores = Some(cores);
        cpu.threads = Some(threads);
        cpu.model = it.cpu.model.clone().or(cpu.model.take());
        cpu.dedicated_cpu_placement = it.cpu.dedicated_cpu_placement;
        spec.domain.memory.get_or_insert_with(Memory::default).guest =
            Some(it.memory.guest.clone());
    }
    if let Some(p) = preference {
        if let Some(dp) = &p.devices {
            let dev = &mut spec.domain.devices;
            for disk in &mut dev.disks {
                if let (Some(bus), Some(t)) = (&dp.preferred_disk_bus, disk.disk.as_mut()) {
                    t.bus.get_or_insert_with(|| bus.clone());
                }
                if let Some(bus) = &dp.preferred_disk_bus {
                    if disk.disk.is_none() && disk.cdrom.is_none() && disk.lun.is_none() {
                        disk.disk = Some(crate::types::DiskTarget {
                            bus: Some(bus.clone()),
                            readonly: None,
                        });
                    }
                }
                if let (Some(bus), Some(t)) = (&dp.preferred_cdrom_bus, disk.cdrom.as_mut()) {
                    t.bus.get_or_insert_with(|| bus.clone());
                }
            }
            if let Some(m) = &dp.preferred_interface_model {
                for i in &mut dev.interfaces {
                    i.model.get_or_insert_with(|| m.clone());
                }
            }
            if let Some(v) = dp.preferred_autoattach_serial_console {
                dev.autoattach_serial_console.get_or_insert(v);
            }
            if let Some(v) = dp.preferred_autoattach_pod_interface {
                dev.autoattach_pod_interface.get_or_insert(v);
            }
        }
        if let Some(g) = p.preferred_termination_grace_period_seconds {
            spec.termination_grace_period_seconds.get_or_insert(g);
        }
        if instancetype.is_none() {
            if let Some(t) = p
                .cpu
                .as_ref()
                .and_then(|c| c.preferred_cpu_topology.as_deref())
            {
                // No instance type: the VM's own vCPU count, laid out as preferred, when it
                // gave only a count (sockets alone, or cores alone).
                if let Some(c) = spec.domain.cpu.as_mut() {
                    let n = c.sockets.unwrap_or(1) * c.cores.unwrap_or(1) * c.threads.unwrap_or(1);
                    let single = [c.sockets, c.cores, c.threads]
                        .iter()
                        .filter(|v| v.is_some())
                        .count()
                        <= 1;
                    if single {
                        (c.sockets, c.cores, c.threads) = match t {
                            "preferCores" => (Some(1), Some(n), Some(1)),
                            "preferThreads" => (Some(1), Some(1), Some(n)),
                            _ => (Some(n), Some(1), Some(1)),
                        };
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::closed::{DiskBus, NicModel};

    fn vmi(yaml: &str) -> VirtualMachineInstanceSpec {
        serde_yaml::from_str(yaml).unwrap()
    }

    fn it(cpus: u32, mem: &str) -> InstancetypeSpec {
        InstancetypeSpec {
            cpu: CpuInstancetype {
                guest: cpus,
                ..Default::default()
            },
            memory: MemoryInstancetype {
                guest: Quantity(mem.into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn the_instance_type_sizes_the_vm_and_preferences_fill_the_gaps() {
        let mut s = vmi("domain:\n  devices:\n    disks: [{name: root}, {name: d2, disk: {bus: sata}}]\n    interfaces: [{name: default, masquerade: {}}]\n");
        let p: PreferenceSpec = serde_yaml::from_str(
            "cpu: {preferredCPUTopology: preferCores}\ndevices: {preferredDiskBus: virtio, preferredInterfaceModel: virtio}\npreferredTerminationGracePeriodSeconds: 5\n",
        )
        .unwrap();
        expand(&mut s, Some(&it(4, "2Gi")), Some(&p), "spec.template.spec").unwrap();
        let c = s.domain.cpu.as_ref().unwrap();
        assert_eq!((c.sockets, c.cores, c.threads), (Some(1), Some(4), Some(1)));
        assert_eq!(s.domain.memory.unwrap().guest.unwrap().0, "2Gi");
        let d = &s.domain.devices.disks;
        assert_eq!(d[0].disk.as_ref().unwrap().bus, Some(DiskBus::Virtio));
        assert_eq!(
            d[1].disk.as_ref().unwrap().bus,
            Some(DiskBus::Sata),
            "the VM's own wins"
        );
        assert_eq!(s.domain.devices.interfaces[0].model, Some(NicModel::Virtio));
        assert_eq!(s.termination_grace_period_seconds, Some(5));
    }

    #[test]
    fn fields_the_instance_type_owns_conflict() {
        let mut s = vmi("domain:\n  cpu: {cores: 2}\n  memory: {guest: 1Gi}\n  devices: {}\n");
        let e = expand(&mut s, Some(&it(4, "2Gi")), None, "spec.template.spec").unwrap_err();
        assert_eq!(
            e,
            "VM field(s) spec.template.spec.domain.cpu.cores, spec.template.spec.domain.memory.guest conflicts with selected instance type"
        );
    }
}
