//! What the CR's status says, decided from what the operator observed: pure, so every
//! combination KubeVirt distinguishes (first deploy, deployed, upgrade, failure, deletion) is
//! tested without a cluster.

use api::kubevirt::conditions::*;
use api::kubevirt::{KubeVirt, KubeVirtPhase, KubeVirtStatus};
use api::Condition;
use controller_runtime::set_condition;

use crate::install::{Release, Workload};

/// A workload as the operator found it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkloadState {
    pub workload: Workload,
    /// Rolled out at its current generation with every replica ready (a DaemonSet on at
    /// least one node: one that lands nowhere is never ready, as in KubeVirt).
    pub ready: bool,
}

/// What one reconcile of an active CR observed.
pub struct Observed<'a> {
    pub kv: &'a KubeVirt,
    pub release: &'a Release,
    pub operator_version: &'a str,
    /// The first object that could not be applied, with the API server's reason.
    pub apply_error: Option<String>,
    pub workloads: Vec<WorkloadState>,
    /// Fields of the spec the operator does not act on, by path.
    pub not_honoured: Vec<String>,
    /// Why `spec.configuration` cannot be taken (the components keep the last valid one).
    pub invalid_configuration: Option<String>,
}

impl Observed<'_> {
    fn all_ready(&self) -> bool {
        !self.workloads.is_empty() && self.workloads.iter().all(|w| w.ready)
    }
}

/// The status of an active installation.
pub fn installing(o: &Observed<'_>) -> KubeVirtStatus {
    let mut s = o.kv.status.clone().unwrap_or_default();
    s.operator_version = Some(o.operator_version.to_string());
    s.target_kube_virt_version = Some(o.release.tag.clone());
    s.target_kube_virt_registry = Some(o.release.registry.clone());
    s.observed_generation = o.kv.metadata.generation;
    let ready = o.all_ready() && o.apply_error.is_none();
    let deployed_before = s.observed_kube_virt_version.is_some();
    if ready {
        s.observed_kube_virt_version = Some(o.release.tag.clone());
        s.observed_kube_virt_registry = Some(o.release.registry.clone());
    }
    let waiting: Vec<String> = o
        .workloads
        .iter()
        .filter(|w| !w.ready)
        .map(|w| format!("{:?} {}", w.workload.kind, w.workload.name))
        .collect();
    let c = &mut s.conditions;
    match (&o.apply_error, ready, deployed_before) {
        (Some(e), _, _) => {
            set(c, DEGRADED, true, DEPLOYMENT_FAILED, e);
            set(c, CREATED, false, DEPLOYMENT_FAILED, e);
            set(c, PROGRESSING, true, DEPLOYMENT_IN_PROGRESS, e);
            if !deployed_before {
                set(c, AVAILABLE, false, DEPLOYMENT_IN_PROGRESS, e);
            }
        }
        (None, true, _) => {
            let msg = format!("All components are ready at {}", o.release.tag);
            set(c, AVAILABLE, true, ALL_COMPONENTS_READY, &msg);
            set(c, PROGRESSING, false, ALL_COMPONENTS_READY, &msg);
            set(c, DEGRADED, false, ALL_COMPONENTS_READY, &msg);
            set(
                c,
                CREATED,
                true,
                ALL_RESOURCES_CREATED,
                "All resources were created",
            );
        }
        // An upgrade: the last release keeps serving while the new one rolls out.
        (None, false, true) => {
            let msg = format!(
                "Updating to {}; waiting for {}",
                o.release.tag,
                waiting.join(", ")
            );
            set(c, AVAILABLE, true, UPDATE_IN_PROGRESS, &msg);
            set(c, PROGRESSING, true, UPDATE_IN_PROGRESS, &msg);
            set(c, DEGRADED, true, UPDATE_IN_PROGRESS, &msg);
            set(
                c,
                CREATED,
                true,
                ALL_RESOURCES_CREATED,
                "All resources were created",
            );
        }
        (None, false, false) => {
            let msg = format!("Waiting for {}", waiting.join(", "));
            set(c, AVAILABLE, false, DEPLOYMENT_IN_PROGRESS, &msg);
            set(c, PROGRESSING, true, DEPLOYMENT_IN_PROGRESS, &msg);
            set(c, DEGRADED, false, DEPLOYMENT_IN_PROGRESS, &msg);
            set(
                c,
                CREATED,
                true,
                ALL_RESOURCES_CREATED,
                "All resources were created",
            );
        }
    }
    if o.not_honoured.is_empty() {
        controller_runtime::remove_condition(c, FIELDS_NOT_HONOURED);
    } else {
        let msg = format!(
            "microvirt does not act on {}; they are kept as written",
            o.not_honoured.join(", ")
        );
        set(c, FIELDS_NOT_HONOURED, true, FIELDS_NOT_HONOURED, &msg);
    }
    if let Some(why) = &o.invalid_configuration {
        let msg = format!("{why}; the components keep the last valid configuration");
        set(c, DEGRADED, true, INVALID_CONFIGURATION, &msg);
    }
    s.phase = Some(if ready || deployed_before {
        KubeVirtPhase::Deployed
    } else {
        KubeVirtPhase::Deploying
    });
    s
}

/// The status while the CR is being deleted: `blocked` says which workloads keep it.
pub fn deleting(kv: &KubeVirt, blocked: Option<&str>) -> KubeVirtStatus {
    let mut s = kv.status.clone().unwrap_or_default();
    s.phase = Some(KubeVirtPhase::Deleting);
    let c = &mut s.conditions;
    match blocked {
        Some(why) => set(c, DEGRADED, true, DELETION_BLOCKED, why),
        None => set(
            c,
            PROGRESSING,
            true,
            DELETION_IN_PROGRESS,
            "Removing the installation",
        ),
    }
    s
}

/// The status of a CR that is not the one the cluster is installed from.
pub fn ignored(kv: &KubeVirt, active: &str) -> KubeVirtStatus {
    let mut s = kv.status.clone().unwrap_or_default();
    let msg =
        format!("The cluster is installed from KubeVirt {active}; this one is ignored. Delete it.");
    set(
        &mut s.conditions,
        SYNCHRONIZED,
        false,
        MULTIPLE_KUBEVIRTS,
        &msg,
    );
    set(&mut s.conditions, DEGRADED, true, MULTIPLE_KUBEVIRTS, &msg);
    s
}

fn set(c: &mut Vec<Condition>, type_: &str, status: bool, reason: &str, message: &str) {
    set_condition(c, type_, status, Some(reason), Some(message.to_string()));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::install::{WorkloadKind, DEFAULT_REGISTRY};

    fn kv() -> KubeVirt {
        KubeVirt::new("kubevirt", Default::default())
    }

    fn state(name: &str, ready: bool) -> WorkloadState {
        WorkloadState {
            workload: Workload {
                kind: WorkloadKind::Deployment,
                name: name.into(),
            },
            ready,
        }
    }

    fn cond<'a>(s: &'a KubeVirtStatus, t: &str) -> (&'a str, &'a str) {
        let c = s.conditions.iter().find(|c| c.type_ == t).unwrap();
        (c.status.as_str(), c.reason.as_deref().unwrap())
    }

    fn observe(kv: &KubeVirt, release: &Release, ready: bool) -> KubeVirtStatus {
        installing(&Observed {
            kv,
            release,
            operator_version: "v0.1.0",
            apply_error: None,
            workloads: vec![state("virt-api", ready), state("virt-controller", true)],
            not_honoured: vec![],
            invalid_configuration: None,
        })
    }

    #[test]
    fn first_deploy_then_available_then_upgrade() {
        let mut kv = kv();
        let r1 = Release::of(&kv, DEFAULT_REGISTRY);
        let s = observe(&kv, &r1, false);
        assert_eq!(s.phase, Some(KubeVirtPhase::Deploying));
        assert_eq!(cond(&s, AVAILABLE), ("False", DEPLOYMENT_IN_PROGRESS));
        assert_eq!(cond(&s, PROGRESSING), ("True", DEPLOYMENT_IN_PROGRESS));
        kv.status = Some(s);
        let s = observe(&kv, &r1, true);
        assert_eq!(s.phase, Some(KubeVirtPhase::Deployed));
        assert_eq!(cond(&s, AVAILABLE), ("True", ALL_COMPONENTS_READY));
        assert_eq!(cond(&s, DEGRADED).0, "False");
        assert_eq!(s.observed_kube_virt_version.as_deref(), Some("v0.1.0"));
        kv.status = Some(s);
        let r2 = Release {
            tag: "v0.2.0".into(),
            ..r1
        };
        let s = observe(&kv, &r2, false);
        assert_eq!(cond(&s, AVAILABLE), ("True", UPDATE_IN_PROGRESS));
        assert_eq!(cond(&s, PROGRESSING), ("True", UPDATE_IN_PROGRESS));
        assert_eq!(cond(&s, DEGRADED), ("True", UPDATE_IN_PROGRESS));
        assert_eq!(s.observed_kube_virt_version.as_deref(), Some("v0.1.0"));
        assert_eq!(s.target_kube_virt_version.as_deref(), Some("v0.2.0"));
    }

    #[test]
    fn a_failed_apply_degrades_without_tearing_down() {
        let kv = kv();
        let r = Release::of(&kv, DEFAULT_REGISTRY);
        let s = installing(&Observed {
            kv: &kv,
            release: &r,
            operator_version: "v0.1.0",
            apply_error: Some("Deployment virt-api: forbidden".into()),
            workloads: vec![state("virt-api", true)],
            not_honoured: vec!["spec.infra".into()],
            invalid_configuration: None,
        });
        assert_eq!(cond(&s, DEGRADED), ("True", DEPLOYMENT_FAILED));
        assert_eq!(cond(&s, AVAILABLE).0, "False");
        assert_eq!(cond(&s, FIELDS_NOT_HONOURED).0, "True");
    }
}
