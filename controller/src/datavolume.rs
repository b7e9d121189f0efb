//! A VM's `dataVolumeTemplates`, as KubeVirt's VM controller handles them: each becomes a CDI
//! DataVolume (`cdi.kubevirt.io/v1beta1`) of the template's name, controlled by the VM, and the
//! VM's VMI is made only once every one is ready — CDI has populated its claim, or is waiting for
//! the claim's first consumer (the launcher Pod). Meanwhile the VM shows `Provisioning`; a failed
//! import shows `DataVolumeError`. CDI itself (importers, populators) is not microvirt's: a
//! cluster without it gets a clear failure on the VM, never a VM started without its disk.

use api::VirtualMachine;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use kube::{Client, ResourceExt};
use serde_json::Value;

/// Where the DataVolumes are.
pub fn api_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("cdi.kubevirt.io", "v1beta1", "DataVolume"),
        "datavolumes",
    )
}

/// The state of a VM's DataVolumes, taken together.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataVolumes {
    /// None declared, or every one ready for the VM to start.
    Ready,
    /// Some are still being populated (their names and phases).
    Provisioning(String),
    /// CDI reported a failure, or the templates cannot be made into DataVolumes.
    Failed(String),
}

/// The DataVolume a template describes: the template's name, labels, annotations and spec, in
/// the VM's namespace, controlled by the VM (so deleting the VM deletes it).
pub fn from_template(
    vm: &VirtualMachine,
    index: usize,
    template: &Value,
) -> Result<DynamicObject, String> {
    let path = format!("spec.dataVolumeTemplates[{index}]");
    let meta = template.get("metadata").cloned().unwrap_or(Value::Null);
    let name = meta
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| {
            format!(
                "{path}.metadata.name: is required (the DataVolume and its claim are named by it)"
            )
        })?;
    let spec = template
        .get("spec")
        .filter(|s| s.is_object())
        .ok_or_else(|| format!("{path}.spec: is required (the DataVolume's source and storage)"))?;
    let mut dv =
        DynamicObject::new(name, &api_resource()).within(&vm.namespace().unwrap_or_default());
    dv.metadata.labels = meta
        .get("labels")
        .and_then(|l| serde_json::from_value(l.clone()).ok());
    dv.metadata.annotations = meta
        .get("annotations")
        .and_then(|a| serde_json::from_value(a.clone()).ok());
    dv.metadata.owner_references = controller_runtime::controller_ref(vm).map(|r| vec![r]);
    dv.data = serde_json::json!({ "spec": spec });
    Ok(dv)
}

/// Phases in which CDI lets a consumer start: populated, or waiting for the first consumer to
/// bind a WaitForFirstConsumer claim.
fn ready_phase(phase: &str) -> bool {
    matches!(
        phase,
        "Succeeded" | "WaitForFirstConsumer" | "PendingPopulation"
    )
}

/// Makes the DataVolumes the VM's templates describe that do not exist yet, and says whether
/// all of them are ready. A DataVolume of the same name the VM does not control is a failure
/// (KubeVirt adopts nothing either).
pub async fn ensure(client: &Client, vm: &VirtualMachine) -> Result<DataVolumes, kube::Error> {
    let Some(templates) = vm
        .spec
        .data_volume_templates
        .as_ref()
        .filter(|t| !t.is_empty())
    else {
        return Ok(DataVolumes::Ready);
    };
    let ns = vm.namespace().unwrap_or_default();
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &api_resource());
    let uid = vm.uid().unwrap_or_default();
    let mut waiting = vec![];
    for (i, t) in templates.iter().enumerate() {
        let dv = match from_template(vm, i, t) {
            Ok(dv) => dv,
            Err(msg) => return Ok(DataVolumes::Failed(msg)),
        };
        let name = dv.name_any();
        let existing = match api.get_opt(&name).await {
            Ok(e) => e,
            Err(kube::Error::Api(s)) if s.code == 404 => {
                return Ok(DataVolumes::Failed(no_cdi()));
            }
            Err(e) => return Err(e),
        };
        let current = match existing {
            Some(e) if controller_runtime::controlled_by(&e, &uid) => e,
            Some(_) => {
                return Ok(DataVolumes::Failed(format!(
                    "DataVolume {name} exists and is not controlled by this VirtualMachine"
                )))
            }
            None => match api.create(&PostParams::default(), &dv).await {
                Ok(created) => created,
                Err(kube::Error::Api(s)) if s.code == 409 => continue,
                Err(kube::Error::Api(s)) if s.code == 404 => {
                    return Ok(DataVolumes::Failed(no_cdi()));
                }
                Err(e) => return Err(e),
            },
        };
        let phase = current
            .data
            .pointer("/status/phase")
            .and_then(Value::as_str)
            .unwrap_or("Pending")
            .to_string();
        if phase == "Failed" {
            let why = current
                .data
                .pointer("/status/conditions")
                .and_then(Value::as_array)
                .and_then(|cs| {
                    cs.iter().find_map(|c| {
                        c.get("message")
                            .and_then(Value::as_str)
                            .filter(|m| !m.is_empty())
                    })
                })
                .unwrap_or("no message")
                .to_string();
            return Ok(DataVolumes::Failed(format!(
                "DataVolume {name} failed: {why}"
            )));
        }
        if !ready_phase(&phase) {
            waiting.push(format!("{name} ({phase})"));
        }
    }
    Ok(if waiting.is_empty() {
        DataVolumes::Ready
    } else {
        DataVolumes::Provisioning(format!("waiting for DataVolumes: {}", waiting.join(", ")))
    })
}

fn no_cdi() -> String {
    "spec.dataVolumeTemplates: DataVolumes (cdi.kubevirt.io/v1beta1) are not served by this cluster; install CDI, or use persistentVolumeClaim volumes".into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(templates: Value) -> VirtualMachine {
        let mut vm: VirtualMachine = serde_json::from_value(serde_json::json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": "fedora", "namespace": "default", "uid": "u-1"},
            "spec": {"runStrategy": "Always", "template": {"spec": {"domain": {"devices": {}}}}},
        }))
        .unwrap();
        vm.spec.data_volume_templates = serde_json::from_value(templates).unwrap();
        vm
    }

    #[test]
    fn a_template_becomes_a_datavolume_the_vm_controls() {
        let v = vm(serde_json::json!([{
            "metadata": {"name": "fedora-root", "labels": {"a": "b"}},
            "spec": {"source": {"registry": {"url": "docker://quay.io/containerdisks/fedora:40"}},
                     "storage": {"resources": {"requests": {"storage": "5Gi"}}}},
        }]));
        let templates = v.spec.data_volume_templates.clone().unwrap();
        let dv = from_template(&v, 0, &templates[0]).unwrap();
        assert_eq!(dv.name_any(), "fedora-root");
        assert_eq!(dv.namespace().as_deref(), Some("default"));
        assert_eq!(
            dv.types.as_ref().unwrap().api_version,
            "cdi.kubevirt.io/v1beta1"
        );
        assert_eq!(dv.labels()["a"], "b");
        assert_eq!(
            dv.data["spec"]["storage"]["resources"]["requests"]["storage"],
            "5Gi"
        );
        let owner = &dv.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
            ("VirtualMachine", "u-1", Some(true))
        );
    }

    #[test]
    fn templates_without_a_name_or_spec_are_named_in_the_error() {
        let v = vm(serde_json::json!([{"metadata": {}, "spec": {}}, {"metadata": {"name": "x"}}]));
        let t = v.spec.data_volume_templates.clone().unwrap();
        assert!(from_template(&v, 0, &t[0])
            .unwrap_err()
            .starts_with("spec.dataVolumeTemplates[0].metadata.name: is required"));
        assert!(from_template(&v, 1, &t[1])
            .unwrap_err()
            .starts_with("spec.dataVolumeTemplates[1].spec: is required"));
    }

    #[test]
    fn ready_phases_are_cdis() {
        for p in ["Succeeded", "WaitForFirstConsumer", "PendingPopulation"] {
            assert!(ready_phase(p), "{p}");
        }
        for p in [
            "Pending",
            "ImportScheduled",
            "ImportInProgress",
            "CloneInProgress",
            "Unknown",
        ] {
            assert!(!ready_phase(p), "{p}");
        }
    }
}
