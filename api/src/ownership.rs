//! Which Pods belong to a VMI. Labels are written by whoever creates a Pod, so a tenant can
//! label a Pod of its own as another VMI's launcher or migration target; the controller
//! reference is set by virt-controller when it creates the Pod and names the VMI by uid.
//! Everything that hands a Pod a VM, a migration or a key asks this first.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// True when `meta`'s controller reference is the `kubevirt.io/v1` VirtualMachineInstance with
/// uid `vmi_uid`.
pub fn controlled_by_vmi(meta: &ObjectMeta, vmi_uid: &str) -> bool {
    !vmi_uid.is_empty()
        && meta.owner_references.iter().flatten().any(|o| {
            o.controller == Some(true)
                && o.kind == "VirtualMachineInstance"
                && o.api_version == "kubevirt.io/v1"
                && o.uid == vmi_uid
        })
}

/// Why a labelled Pod is not taken as the VMI's (for the Event that names it).
pub fn stranger_note(pod: &str, vmi: &str, label: &str) -> String {
    format!(
        "ignored Pod {pod}: it carries {label} but is not controlled by VirtualMachineInstance {vmi} (no controller ownerReference with its uid), so it is not this VMI's"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    fn owned(kind: &str, uid: &str, controller: Option<bool>) -> ObjectMeta {
        ObjectMeta {
            owner_references: Some(vec![OwnerReference {
                api_version: "kubevirt.io/v1".into(),
                kind: kind.into(),
                name: "vm".into(),
                uid: uid.into(),
                controller,
                block_owner_deletion: None,
            }]),
            ..Default::default()
        }
    }

    #[test]
    fn only_the_controller_reference_with_the_uid_counts() {
        assert!(controlled_by_vmi(
            &owned("VirtualMachineInstance", "u1", Some(true)),
            "u1"
        ));
        assert!(!controlled_by_vmi(
            &owned("VirtualMachineInstance", "u2", Some(true)),
            "u1"
        ));
        assert!(!controlled_by_vmi(
            &owned("VirtualMachineInstance", "u1", None),
            "u1"
        ));
        assert!(!controlled_by_vmi(
            &owned("VirtualMachine", "u1", Some(true)),
            "u1"
        ));
        assert!(!controlled_by_vmi(&ObjectMeta::default(), "u1"));
        assert!(!controlled_by_vmi(
            &owned("VirtualMachineInstance", "", Some(true)),
            ""
        ));
    }
}
