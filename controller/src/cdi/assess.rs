//! A DataVolume's next status from what is observed — its claim and its importer Pod — as CDI
//! maps them, and what to do with the Pod. Pure, so every transition is tested without a
//! cluster.
//!
//! The Pod's phase gives the DataVolume's: Pending → ImportScheduled (CloneScheduled),
//! Running → ImportInProgress (CloneInProgress), Succeeded → Succeeded. A failed attempt is
//! restarted by the kubelet (`restartPolicy: OnFailure`); its termination message says
//! whether another attempt can help. Unlike CDI, which retries forever, attempts are bounded:
//! past `max_restarts`, or at once when retrying cannot help (a checksum that does not match,
//! an image that does not fit), the DataVolume is Failed and the Pod removed. A claim is
//! never Ready before the importer exited successfully, so half an image is never offered.

use api::cdi::importer::Outcome;
use api::cdi::{DataVolumeCondition, DataVolumePhase, DataVolumeStatus};
use k8s_openapi::api::core::v1::{ContainerStatus, PersistentVolumeClaim, Pod};

/// What to do with the importer Pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodAction {
    Keep,
    Create,
    Delete,
}

/// How the claim is filled, which names the phases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Import,
    Clone,
    /// The Pod waits for `virtctl image-upload`: UploadScheduled, then UploadReady while it runs.
    Upload,
    /// No Pod: the storage fills the claim from its `dataSource` (a VolumeSnapshot);
    /// CloneScheduled, then Succeeded once the claim is bound.
    Provision,
}

impl Flow {
    /// The phases while the Pod is pending and while it runs.
    fn phases(self) -> (DataVolumePhase, DataVolumePhase) {
        match self {
            Flow::Import => (
                DataVolumePhase::ImportScheduled,
                DataVolumePhase::ImportInProgress,
            ),
            Flow::Clone => (
                DataVolumePhase::CloneScheduled,
                DataVolumePhase::CloneInProgress,
            ),
            Flow::Upload => (
                DataVolumePhase::UploadScheduled,
                DataVolumePhase::UploadReady,
            ),
            Flow::Provision => (
                DataVolumePhase::CloneScheduled,
                DataVolumePhase::CloneInProgress,
            ),
        }
    }
}

/// What is observed of a DataVolume's world.
pub struct Observed<'a> {
    pub status: Option<&'a DataVolumeStatus>,
    pub claim: Option<&'a PersistentVolumeClaim>,
    pub pod: Option<&'a Pod>,
    pub flow: Flow,
    pub max_restarts: i32,
    pub now: &'a str,
}

/// The status to write and the Pod action.
#[derive(Clone, Debug, PartialEq)]
pub struct Assessment {
    pub status: DataVolumeStatus,
    pub pod: PodAction,
}

/// Sets a condition of `type_`, moving its transition time only when its status changes.
pub fn set_condition(
    conditions: &mut Vec<DataVolumeCondition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
    now: &str,
) {
    let status = if status { "True" } else { "False" };
    let c = match conditions.iter_mut().position(|c| c.type_ == type_) {
        Some(i) => &mut conditions[i],
        None => {
            conditions.push(DataVolumeCondition {
                type_: type_.into(),
                ..Default::default()
            });
            conditions.last_mut().unwrap()
        }
    };
    if c.status != status {
        c.last_transition_time = Some(now.into());
    }
    let reason = (!reason.is_empty()).then(|| reason.to_string());
    let message = (!message.is_empty()).then(|| message.to_string());
    // The heartbeat moves only with a change, so an unchanged status is not written again
    // (each write would wake the controller once more).
    if c.status != status || c.reason != reason || c.message != message {
        c.last_heartbeat_time = Some(now.into());
    }
    c.status = status.into();
    c.reason = reason;
    c.message = message;
}

fn container(pod: &Pod) -> Option<&ContainerStatus> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|c| c.name == "importer")
}

/// The last failed attempt's outcome: from its termination message, or else its reason.
fn last_failure(c: &ContainerStatus) -> Option<Outcome> {
    let terminated = c
        .state
        .as_ref()
        .and_then(|s| s.terminated.as_ref())
        .filter(|t| t.exit_code != 0)
        .or_else(|| c.last_state.as_ref()?.terminated.as_ref())?;
    let message = terminated.message.clone().unwrap_or_default();
    Some(Outcome::parse(&message).unwrap_or(Outcome {
        reason: terminated.reason.clone().unwrap_or_else(|| "Error".into()),
        message: if message.is_empty() {
            format!("the importer exited with code {}", terminated.exit_code)
        } else {
            message
        },
        retryable: true,
    }))
}

/// A Failed status: Ready and Running False with the reason, Bound as it was.
fn failed(
    mut status: DataVolumeStatus,
    reason: &str,
    message: &str,
    now: &str,
) -> DataVolumeStatus {
    status.phase = Some(DataVolumePhase::Failed);
    set_condition(
        &mut status.conditions,
        "Running",
        false,
        reason,
        message,
        now,
    );
    set_condition(&mut status.conditions, "Ready", false, reason, message, now);
    status
}

/// The next status of a DataVolume whose spec can be imported.
pub fn assess(o: &Observed) -> Assessment {
    let mut status = o.status.cloned().unwrap_or_default();
    mirror_claim(&mut status, o.claim, o.now);
    // Terminal phases stay; only the Pod is cleaned up.
    if matches!(
        status.phase,
        Some(DataVolumePhase::Succeeded | DataVolumePhase::Failed)
    ) {
        let pod = if o.pod.is_some() {
            PodAction::Delete
        } else {
            PodAction::Keep
        };
        return Assessment { status, pod };
    }
    let (scheduled, _) = o.flow.phases();
    if o.flow == Flow::Provision {
        return provisioned(status, o);
    }
    let Some(pod) = o.pod else {
        status.phase = Some(if o.claim.is_some() {
            scheduled
        } else {
            DataVolumePhase::Pending
        });
        status.progress.get_or_insert_with(|| "N/A".into());
        set_condition(&mut status.conditions, "Running", false, "", "", o.now);
        set_condition(&mut status.conditions, "Ready", false, "", "", o.now);
        return Assessment {
            status,
            pod: if o.claim.is_some() {
                PodAction::Create
            } else {
                PodAction::Keep
            },
        };
    };
    from_pod(status, o, pod)
}

/// A claim the storage provisions from its data source: done once it is bound.
fn provisioned(mut status: DataVolumeStatus, o: &Observed) -> Assessment {
    let bound = o.claim.and_then(|c| c.status.as_ref()?.phase.as_deref()) == Some("Bound");
    let (scheduled, _) = o.flow.phases();
    let (phase, progress, reason, message) = match (o.claim, bound) {
        (_, true) => (
            DataVolumePhase::Succeeded,
            "100.0%",
            "Completed",
            "Provisioned from the snapshot",
        ),
        (Some(_), false) => (
            scheduled,
            "N/A",
            "Pending",
            "Waiting for the storage to provision the claim from the snapshot",
        ),
        (None, _) => (DataVolumePhase::Pending, "N/A", "", ""),
    };
    status.phase = Some(phase);
    status.progress = Some(progress.into());
    set_condition(
        &mut status.conditions,
        "Running",
        false,
        reason,
        message,
        o.now,
    );
    set_condition(
        &mut status.conditions,
        "Ready",
        bound,
        reason,
        message,
        o.now,
    );
    Assessment {
        status,
        pod: if o.pod.is_some() {
            PodAction::Delete
        } else {
            PodAction::Keep
        },
    }
}

/// `Bound` mirrors the claim.
fn mirror_claim(status: &mut DataVolumeStatus, claim: Option<&PersistentVolumeClaim>, now: &str) {
    let claim_phase = claim
        .and_then(|c| c.status.as_ref()?.phase.as_deref())
        .unwrap_or("Pending");
    let claim_name = claim.and_then(|c| c.metadata.name.clone());
    status.claim_name = claim_name.clone();
    let bound = claim_phase == "Bound";
    let bound_msg = match (&claim_name, bound) {
        (Some(n), true) => format!("PVC {n} Bound"),
        (Some(n), false) => format!("PVC {n} {claim_phase}"),
        (None, _) => "No PVC found".into(),
    };
    set_condition(
        &mut status.conditions,
        "Bound",
        bound,
        if bound { "Bound" } else { claim_phase },
        &bound_msg,
        now,
    );
}

/// The status from the importer Pod: its phase, its container's state, its last failure.
fn from_pod(mut status: DataVolumeStatus, o: &Observed, pod: &Pod) -> Assessment {
    let now = o.now;
    let (scheduled, in_progress) = o.flow.phases();
    let c = container(pod);
    let restarts = c.map(|c| c.restart_count).unwrap_or(0);
    status.restart_count = Some(restarts);
    let failure = c.and_then(last_failure);
    let pod_phase = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending");
    if pod_phase == "Succeeded" {
        status.phase = Some(DataVolumePhase::Succeeded);
        status.progress = Some("100.0%".into());
        let done = match o.flow {
            Flow::Clone => "Clone Complete",
            Flow::Upload => "Upload Complete",
            Flow::Import | Flow::Provision => "Import Complete",
        };
        set_condition(
            &mut status.conditions,
            "Running",
            false,
            "Completed",
            "",
            now,
        );
        set_condition(&mut status.conditions, "Ready", true, "", done, now);
        // The Pod stays until a pass sees the DataVolume Succeeded: deleted now, a pass that
        // read the DataVolume before this status reached its cache would find no Pod and an
        // unfinished import, and import again over the finished claim.
        return Assessment {
            status,
            pod: PodAction::Keep,
        };
    }
    if let Some(f) = &failure {
        let why = if !f.retryable {
            Some(f.message.clone())
        } else if restarts >= o.max_restarts || pod_phase == "Failed" {
            Some(format!("gave up after {restarts} restarts: {}", f.message))
        } else {
            None
        };
        if let Some(why) = why {
            return Assessment {
                status: failed(status, &f.reason, &why, now),
                pod: PodAction::Delete,
            };
        }
    }
    if pod_phase == "Failed" {
        let msg = pod
            .status
            .as_ref()
            .and_then(|s| s.message.clone())
            .unwrap_or_else(|| "the importer Pod failed".into());
        return Assessment {
            status: failed(status, "Error", &msg, now),
            pod: PodAction::Delete,
        };
    }
    let running = c
        .and_then(|c| c.state.as_ref())
        .is_some_and(|s| s.running.is_some());
    let waiting = c
        .and_then(|c| c.state.as_ref()?.waiting.as_ref())
        .and_then(|w| Some((w.reason.clone()?, w.message.clone().unwrap_or_default())));
    if pod_phase == "Running" || restarts > 0 {
        status.phase = Some(in_progress);
    } else {
        status.phase = Some(scheduled);
    }
    if running {
        set_condition(
            &mut status.conditions,
            "Running",
            true,
            "Pod is running",
            "",
            now,
        );
    } else {
        // Between attempts the last failure is what the user needs to see.
        let (reason, message) = match (&failure, &waiting) {
            (Some(f), _) => (f.reason.clone(), f.message.clone()),
            (None, Some((reason, message))) => (reason.clone(), message.clone()),
            (None, None) => ("Pending".into(), String::new()),
        };
        set_condition(
            &mut status.conditions,
            "Running",
            false,
            &reason,
            &message,
            now,
        );
    }
    status.progress.get_or_insert_with(|| "N/A".into());
    set_condition(&mut status.conditions, "Ready", false, "", "", now);
    Assessment {
        status,
        pod: PodAction::Keep,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: &str = "2026-12-03T10:00:00Z";

    fn claim(phase: &str) -> PersistentVolumeClaim {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "d"}, "status": {"phase": phase}}))
        .unwrap()
    }

    fn pod(status: serde_json::Value) -> Pod {
        serde_json::from_value(
            serde_json::json!({"metadata": {"name": "importer-d"}, "status": status}),
        )
        .unwrap()
    }

    fn observe<'a>(
        status: Option<&'a DataVolumeStatus>,
        claim: Option<&'a PersistentVolumeClaim>,
        pod: Option<&'a Pod>,
    ) -> Observed<'a> {
        Observed {
            status,
            claim,
            pod,
            flow: Flow::Import,
            max_restarts: 3,
            now: NOW,
        }
    }

    fn cond<'a>(s: &'a DataVolumeStatus, t: &str) -> (&'a str, Option<&'a str>) {
        let c = s.conditions.iter().find(|c| c.type_ == t).unwrap();
        (c.status.as_str(), c.reason.as_deref())
    }

    #[test]
    fn a_claim_without_a_pod_gets_one_and_is_scheduled() {
        let c = claim("Pending");
        let a = assess(&observe(None, Some(&c), None));
        assert_eq!(a.pod, PodAction::Create);
        assert_eq!(a.status.phase, Some(DataVolumePhase::ImportScheduled));
        assert_eq!(cond(&a.status, "Bound"), ("False", Some("Pending")));
        assert_eq!(a.status.progress.as_deref(), Some("N/A"));
    }

    #[test]
    fn a_claim_from_a_snapshot_needs_no_pod_and_is_done_once_bound() {
        let provision = |claim: Option<&PersistentVolumeClaim>| {
            assess(&Observed {
                flow: Flow::Provision,
                ..observe(None, claim, None)
            })
        };
        let a = provision(None);
        assert_eq!(
            (a.pod, a.status.phase),
            (PodAction::Keep, Some(DataVolumePhase::Pending))
        );
        let pending = claim("Pending");
        let a = provision(Some(&pending));
        assert_eq!(a.pod, PodAction::Keep);
        assert_eq!(a.status.phase, Some(DataVolumePhase::CloneScheduled));
        assert_eq!(cond(&a.status, "Ready"), ("False", Some("Pending")));
        let bound = claim("Bound");
        let a = provision(Some(&bound));
        assert_eq!(a.status.phase, Some(DataVolumePhase::Succeeded));
        assert_eq!(a.status.progress.as_deref(), Some("100.0%"));
        assert_eq!(cond(&a.status, "Ready"), ("True", Some("Completed")));
    }

    #[test]
    fn the_pods_phase_gives_the_datavolumes() {
        let c = claim("Bound");
        let p = pod(
            serde_json::json!({"phase": "Running", "containerStatuses": [
            {"name": "importer", "ready": true, "restartCount": 0, "image": "i", "imageID": "",
             "state": {"running": {}}}]}),
        );
        let a = assess(&observe(None, Some(&c), Some(&p)));
        assert_eq!(a.status.phase, Some(DataVolumePhase::ImportInProgress));
        assert_eq!(cond(&a.status, "Running"), ("True", Some("Pod is running")));
        assert_eq!(cond(&a.status, "Bound"), ("True", Some("Bound")));
        let done = pod(serde_json::json!({"phase": "Succeeded"}));
        let a = assess(&observe(Some(&a.status), Some(&c), Some(&done)));
        assert_eq!(a.status.phase, Some(DataVolumePhase::Succeeded));
        assert_eq!(cond(&a.status, "Ready"), ("True", None));
        assert_eq!(a.status.progress.as_deref(), Some("100.0%"));
        assert_eq!(
            a.pod,
            PodAction::Keep,
            "deleted only once Succeeded is read back"
        );
        let a = assess(&observe(Some(&a.status), Some(&c), Some(&done)));
        assert_eq!(
            (a.status.phase, a.pod),
            (Some(DataVolumePhase::Succeeded), PodAction::Delete)
        );
        // Once Succeeded, it stays so.
        let a = assess(&observe(Some(&a.status), Some(&c), None));
        assert_eq!(
            (a.status.phase, a.pod),
            (Some(DataVolumePhase::Succeeded), PodAction::Keep)
        );
    }

    fn crashed(restarts: i32, message: &str) -> Pod {
        pod(
            serde_json::json!({"phase": "Running", "containerStatuses": [
            {"name": "importer", "ready": false, "restartCount": restarts, "image": "i", "imageID": "",
             "state": {"waiting": {"reason": "CrashLoopBackOff"}},
             "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": message}}}]}),
        )
    }

    #[test]
    fn a_retryable_failure_is_retried_then_given_up() {
        let c = claim("Bound");
        let msg = r#"{"reason":"SourceError","message":"GET u: HTTP 503","retryable":true}"#;
        let p = crashed(1, msg);
        let a = assess(&observe(None, Some(&c), Some(&p)));
        assert_eq!(a.pod, PodAction::Keep);
        assert_eq!(a.status.phase, Some(DataVolumePhase::ImportInProgress));
        assert_eq!(a.status.restart_count, Some(1));
        assert_eq!(cond(&a.status, "Running"), ("False", Some("SourceError")));
        let p = crashed(3, msg);
        let a = assess(&observe(Some(&a.status), Some(&c), Some(&p)));
        assert_eq!(a.pod, PodAction::Delete);
        assert_eq!(a.status.phase, Some(DataVolumePhase::Failed));
        let r = a
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == "Ready")
            .unwrap();
        assert_eq!(r.status, "False");
        assert!(
            r.message
                .as_deref()
                .unwrap()
                .starts_with("gave up after 3 restarts: GET u: HTTP 503"),
            "{r:?}"
        );
    }

    #[test]
    fn a_failure_retrying_cannot_help_fails_at_once() {
        let c = claim("Bound");
        let p = crashed(
            0,
            r#"{"reason":"ChecksumError","message":"checksum mismatch","retryable":false}"#,
        );
        let a = assess(&observe(None, Some(&c), Some(&p)));
        assert_eq!(a.status.phase, Some(DataVolumePhase::Failed));
        assert_eq!(cond(&a.status, "Running"), ("False", Some("ChecksumError")));
        assert_eq!(a.pod, PodAction::Delete);
        // Failed stays Failed; the Pod is not made again.
        let a = assess(&observe(Some(&a.status), Some(&c), None));
        assert_eq!(
            (a.status.phase, a.pod),
            (Some(DataVolumePhase::Failed), PodAction::Keep)
        );
    }

    #[test]
    fn a_plain_crash_without_a_message_still_says_why() {
        let c = claim("Bound");
        let p = crashed(1, "");
        let a = assess(&observe(None, Some(&c), Some(&p)));
        let r = a
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == "Running")
            .unwrap();
        assert_eq!(r.reason.as_deref(), Some("Error"));
        assert_eq!(
            r.message.as_deref(),
            Some("the importer exited with code 1")
        );
    }

    #[test]
    fn transition_times_move_only_with_the_status() {
        let mut cs = vec![];
        set_condition(&mut cs, "Ready", false, "", "", "t1");
        set_condition(&mut cs, "Ready", false, "x", "", "t2");
        assert_eq!(cs[0].last_transition_time.as_deref(), Some("t1"));
        assert_eq!(cs[0].last_heartbeat_time.as_deref(), Some("t2"));
        set_condition(&mut cs, "Ready", false, "x", "", "t2b");
        assert_eq!(cs[0].last_heartbeat_time.as_deref(), Some("t2"));
        set_condition(&mut cs, "Ready", true, "", "", "t3");
        assert_eq!(cs[0].last_transition_time.as_deref(), Some("t3"));
    }
}
