//! The VirtualMachineInstanceReplicaSet controller: keeps `spec.replicas` VMIs that match the
//! selector, made from the template and controlled by the set. Finished VMIs are replaced; on
//! scale-down the VMIs that are not Running yet go first (newest first among equals), so running
//! guests are disturbed last. `status.replicas`, `readyReplicas` and `labelSelector` (for the
//! scale subresource and `kubectl scale`) follow what exists.

use api::{VirtualMachineInstance, VirtualMachineInstanceReplicaSet, VmiPhase};
use kube::ResourceExt;

use crate::replicas::ReplicaOwner;
use controller_runtime::controller_ref;

impl ReplicaOwner for VirtualMachineInstanceReplicaSet {
    type Member = VirtualMachineInstance;
    const CONTROLLER: &'static str = "vmirs";
    const MEMBER: &'static str = "virtual machine instance";

    fn validate(&self) -> Result<(), String> {
        api::validation::validate_vmirs(self).map_err(|e| e.to_string())
    }

    /// Running with its Ready condition true.
    fn is_ready(v: &VirtualMachineInstance) -> bool {
        v.status.as_ref().is_some_and(|s| {
            s.phase == Some(VmiPhase::Running)
                && api::conditions::is_true(&s.conditions, api::conditions::READY)
        })
    }

    fn has_finished(v: &VirtualMachineInstance) -> bool {
        matches!(
            v.status.as_ref().and_then(|s| s.phase),
            Some(VmiPhase::Succeeded | VmiPhase::Failed)
        )
    }

    fn new_members(
        &self,
        _active: &[VirtualMachineInstance],
        count: usize,
        settings: &api::kubevirt::ClusterSettings,
    ) -> Vec<VirtualMachineInstance> {
        (0..count)
            .map(|_| vmi_from_template(self, &settings.network))
            .collect()
    }

    fn removal_order(&self, active: &mut [VirtualMachineInstance]) {
        active.sort_by_key(deletion_rank);
    }
}

/// Order in which surplus VMIs are deleted: not yet running first, then the newest.
fn deletion_rank(v: &VirtualMachineInstance) -> (u8, std::cmp::Reverse<String>) {
    let rank = match v.status.as_ref().and_then(|s| s.phase) {
        None | Some(VmiPhase::Pending) => 0,
        Some(VmiPhase::Scheduling) => 1,
        Some(VmiPhase::Scheduled) => 2,
        Some(VmiPhase::Unknown) => 3,
        _ => 4,
    };
    let created = v
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0.to_string())
        .unwrap_or_default();
    (rank, std::cmp::Reverse(created))
}

/// The set's template as a new VMI named after the set by the API server (`generateName`).
fn vmi_from_template(
    rs: &VirtualMachineInstanceReplicaSet,
    network: &api::validation::NetworkDefaults,
) -> VirtualMachineInstance {
    let t = rs.spec.template.clone();
    let meta = t.metadata.unwrap_or_default();
    let mut spec = t.spec.unwrap_or_default();
    api::validation::default_vmi_spec_with(&mut spec, network);
    let mut vmi = VirtualMachineInstance::new("", spec);
    vmi.metadata.name = None;
    vmi.metadata.generate_name = Some(rs.name_any());
    vmi.metadata.namespace = rs.namespace();
    vmi.metadata.labels = meta.labels;
    vmi.metadata.annotations = meta.annotations;
    vmi.metadata.owner_references = controller_ref(rs).map(|r| vec![r]);
    vmi
}
