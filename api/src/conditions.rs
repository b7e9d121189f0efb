//! The condition types KubeVirt's objects carry, and reading them back. virt-controller and
//! virt-handler write them; the webhook, `kubectl wait --for condition=…` and users read them,
//! so each is spelled once, here, as KubeVirt spells it.

use crate::types::{Condition, VirtualMachineInstanceStatus};

/// VMI, VM: the guest is running and ready.
pub const READY: &str = "Ready";
/// VMI: the launcher took the spec (False with a reason when it refused it).
pub const SYNCHRONIZED: &str = "Synchronized";
/// VMI: the launcher Pod could not be scheduled (copied from the Pod's condition).
pub const POD_SCHEDULED: &str = "PodScheduled";
/// VMI: whether the VMI can be live-migrated, with the reason when it cannot.
pub const LIVE_MIGRATABLE: &str = "LiveMigratable";
/// VMI, VM: the guest is paused.
pub const PAUSED: &str = "Paused";
/// VMI: the node's KVM emulates instructions in software (a microvirt addition).
pub const SOFTWARE_EMULATION: &str = "SoftwareEmulation";
/// VM: the last VMI start failed.
pub const FAILURE: &str = "Failure";
/// VM: its DataVolumes are (not yet) ready.
pub const DATA_VOLUMES_READY: &str = "DataVolumesReady";
/// ReplicaSet, pool: scaling is paused.
pub const REPLICA_PAUSED: &str = "ReplicaPaused";
/// ReplicaSet, pool: a replica could not be made.
pub const REPLICA_FAILURE: &str = "ReplicaFailure";

/// The condition of this type, if the object has it.
pub fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Whether the condition of this type is there and `True`.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    find(conditions, type_).is_some_and(|c| c.status == "True")
}

/// The published `LiveMigratable` condition: `None` before it is published, `Some(Err)` with
/// `reason: message` when False.
pub fn published_migratability(
    status: &VirtualMachineInstanceStatus,
) -> Option<Result<(), String>> {
    let c = find(&status.conditions, LIVE_MIGRATABLE)?;
    Some(if c.status == "True" {
        Ok(())
    } else {
        Err(format!(
            "{}: {}",
            c.reason.as_deref().unwrap_or("NotMigratable"),
            c.message.as_deref().unwrap_or("")
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cond(type_: &str, status: &str, reason: Option<&str>) -> Condition {
        Condition {
            type_: type_.into(),
            status: status.into(),
            reason: reason.map(Into::into),
            message: Some("why".into()),
            last_transition_time: None,
            last_probe_time: None,
        }
    }

    #[test]
    fn migratability_is_read_from_the_published_condition() {
        let mut s = VirtualMachineInstanceStatus::default();
        assert_eq!(published_migratability(&s), None);
        s.conditions.push(cond(
            LIVE_MIGRATABLE,
            "False",
            Some("DisksNotLiveMigratable"),
        ));
        assert_eq!(
            published_migratability(&s),
            Some(Err("DisksNotLiveMigratable: why".into()))
        );
        s.conditions[0] = cond(LIVE_MIGRATABLE, "True", None);
        assert_eq!(published_migratability(&s), Some(Ok(())));
        assert!(is_true(&s.conditions, LIVE_MIGRATABLE));
        assert!(!is_true(&s.conditions, READY));
    }
}
