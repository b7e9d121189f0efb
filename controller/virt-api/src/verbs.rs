//! What `start`, `stop` and `restart` do to a VM, decided from the VM and its VMI alone (no
//! I/O, so every case is a unit test): KubeVirt's rules, per run strategy. A strategy the user
//! steers by hand (Manual, and RerunOnFailure's start) takes a state change request that
//! virt-controller carries out; the others change `spec.runStrategy`.

use api::{RunStrategy, StateChangeRequest, VirtualMachine, VirtualMachineInstance, VmiPhase};
use kube::ResourceExt;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::status::SubresourceError;

/// `PUT …/virtualmachines/{name}/start` (KubeVirt's StartOptions).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StartOptions {
    #[serde(default)]
    pub paused: bool,
    #[serde(default)]
    pub dry_run: Vec<String>,
}

/// `PUT …/virtualmachines/{name}/stop` (KubeVirt's StopOptions).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StopOptions {
    #[serde(default)]
    pub grace_period: Option<i64>,
    #[serde(default)]
    pub dry_run: Vec<String>,
}

/// `PUT …/virtualmachines/{name}/restart` (KubeVirt's RestartOptions).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RestartOptions {
    #[serde(default)]
    pub grace_period_seconds: Option<i64>,
    #[serde(default)]
    pub dry_run: Vec<String>,
}

/// What a verb changes on the VM.
#[derive(Clone, Debug, PartialEq)]
pub enum VmChange {
    /// A JSON merge patch of the VM (its `spec`).
    Spec(Value),
    /// `status.stateChangeRequests` as they become.
    Requests(Vec<StateChangeRequest>),
}

/// A verb's effect: the VM change, after shortening the running VMI's grace period when the
/// caller gave one.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub vmi_grace_period: Option<i64>,
    pub change: VmChange,
}

fn strategy(vm: &VirtualMachine) -> RunStrategy {
    api::validation::run_strategy(vm)
}

/// A VMI that exists and has not finished.
fn live(vmi: Option<&VirtualMachineInstance>) -> Option<&VirtualMachineInstance> {
    vmi.filter(|v| {
        !matches!(
            v.status.as_ref().and_then(|s| s.phase),
            Some(VmiPhase::Succeeded | VmiPhase::Failed)
        ) && v.metadata.deletion_timestamp.is_none()
    })
}

fn pending(vm: &VirtualMachine) -> &[StateChangeRequest] {
    vm.status
        .as_ref()
        .map(|s| s.state_change_requests.as_slice())
        .unwrap_or_default()
}

/// KubeVirt refuses a new request while one is still being carried out.
fn no_pending(vm: &VirtualMachine) -> Result<(), SubresourceError> {
    match pending(vm) {
        [] => Ok(()),
        reqs => Err(SubresourceError::conflict(format!(
            "VM has pending state change requests ({}); wait until virt-controller has carried them out",
            reqs.iter().map(|r| r.action.as_str()).collect::<Vec<_>>().join(", ")
        ))),
    }
}

/// The run strategy set to `to`, in the field the VM uses (`running` is the deprecated form).
fn set_strategy(vm: &VirtualMachine, to: RunStrategy) -> VmChange {
    let spec = match (vm.spec.run_strategy, vm.spec.running) {
        (None, Some(_)) => json!({ "running": to != RunStrategy::Halted }),
        _ => json!({ "runStrategy": to }),
    };
    VmChange::Spec(json!({
        "metadata": { "resourceVersion": vm.resource_version() },
        "spec": spec,
    }))
}

fn request(action: &str, uid: Option<String>) -> StateChangeRequest {
    StateChangeRequest {
        action: action.into(),
        uid,
        data: None,
    }
}

fn not_running() -> SubresourceError {
    SubresourceError::conflict("VM is not running")
}

pub fn start(
    vm: &VirtualMachine,
    vmi: Option<&VirtualMachineInstance>,
    opts: &StartOptions,
) -> Result<Plan, SubresourceError> {
    if opts.paused {
        return Err(SubresourceError::bad_request(
            "starting paused is not supported: microvirt has no spec.template.spec.startStrategy Paused; start the VM, then `virtctl pause vmi` it",
        ));
    }
    if live(vmi).is_some() {
        return Err(SubresourceError::conflict("VM is already running"));
    }
    let change = match strategy(vm) {
        RunStrategy::Halted => set_strategy(vm, RunStrategy::Always),
        RunStrategy::Manual | RunStrategy::RerunOnFailure => {
            no_pending(vm)?;
            VmChange::Requests(vec![request("Start", None)])
        }
        s @ (RunStrategy::Always | RunStrategy::Once) => {
            return Err(SubresourceError::conflict(format!(
                "{s:?} does not support manual start requests"
            )))
        }
    };
    Ok(Plan {
        vmi_grace_period: None,
        change,
    })
}

pub fn stop(
    vm: &VirtualMachine,
    vmi: Option<&VirtualMachineInstance>,
    opts: &StopOptions,
) -> Result<Plan, SubresourceError> {
    check_grace(opts.grace_period, "gracePeriod")?;
    let running = live(vmi);
    let change = match strategy(vm) {
        RunStrategy::Halted => {
            if running.is_none() {
                return Err(not_running());
            }
            // Already stopping: only a shorter grace period is left to give.
            if opts.grace_period.is_none() {
                return Err(SubresourceError::conflict(
                    "VM is already stopping (runStrategy Halted); give a grace period to shorten its shutdown",
                ));
            }
            None
        }
        RunStrategy::Manual => {
            let Some(v) = running else {
                return Err(not_running());
            };
            no_pending(vm)?;
            Some(VmChange::Requests(vec![request("Stop", v.uid())]))
        }
        RunStrategy::Always | RunStrategy::RerunOnFailure | RunStrategy::Once => {
            Some(set_strategy(vm, RunStrategy::Halted))
        }
    };
    Ok(Plan {
        vmi_grace_period: running.and(opts.grace_period),
        // Halted already: the grace period is the whole change.
        change: change.unwrap_or(VmChange::Spec(json!({}))),
    })
}

pub fn restart(
    vm: &VirtualMachine,
    vmi: Option<&VirtualMachineInstance>,
    opts: &RestartOptions,
) -> Result<Plan, SubresourceError> {
    check_grace(opts.grace_period_seconds, "gracePeriodSeconds")?;
    if strategy(vm) == RunStrategy::Halted {
        return Err(SubresourceError::conflict(
            "Halted does not support manual restart requests",
        ));
    }
    let Some(v) = live(vmi) else {
        return Err(not_running());
    };
    no_pending(vm)?;
    Ok(Plan {
        vmi_grace_period: opts.grace_period_seconds,
        change: VmChange::Requests(vec![request("Stop", v.uid()), request("Start", None)]),
    })
}

fn check_grace(grace: Option<i64>, field: &str) -> Result<(), SubresourceError> {
    match grace {
        Some(g) if g < 0 => Err(SubresourceError::bad_request(format!(
            "{field}: {g} is negative; give 0 (stop at once) or more seconds"
        ))),
        _ => Ok(()),
    }
}

/// `dryRun` as the API server takes it: absent, or exactly `["All"]`.
pub fn dry_run(values: &[String]) -> Result<bool, SubresourceError> {
    match values {
        [] => Ok(false),
        [v] if v == "All" => Ok(true),
        other => Err(SubresourceError::bad_request(format!(
            "dryRun: {other:?} is not supported; the only accepted value is [\"All\"]"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use api::{VirtualMachineInstanceStatus, VirtualMachineStatus};

    fn vm(strategy: Option<RunStrategy>, running: Option<bool>) -> VirtualMachine {
        let mut vm = VirtualMachine::new("v", Default::default());
        vm.spec.run_strategy = strategy;
        vm.spec.running = running;
        vm.metadata.resource_version = Some("7".into());
        vm
    }

    fn vmi(phase: VmiPhase) -> VirtualMachineInstance {
        let mut v = VirtualMachineInstance::new("v", Default::default());
        v.metadata.uid = Some("u1".into());
        v.status = Some(VirtualMachineInstanceStatus {
            phase: Some(phase),
            ..Default::default()
        });
        v
    }

    #[test]
    fn start_by_strategy() {
        let p = start(
            &vm(Some(RunStrategy::Halted), None),
            None,
            &Default::default(),
        )
        .unwrap();
        assert_eq!(
            p.change,
            VmChange::Spec(
                json!({"metadata": {"resourceVersion": "7"}, "spec": {"runStrategy": "Always"}})
            )
        );
        // The deprecated field is the one changed when the VM uses it.
        let p = start(&vm(None, Some(false)), None, &Default::default()).unwrap();
        assert_eq!(
            p.change,
            VmChange::Spec(
                json!({"metadata": {"resourceVersion": "7"}, "spec": {"running": true}})
            )
        );
        let p = start(
            &vm(Some(RunStrategy::Manual), None),
            None,
            &Default::default(),
        )
        .unwrap();
        assert_eq!(p.change, VmChange::Requests(vec![request("Start", None)]));
        // A finished VMI does not count as running.
        let done = vmi(VmiPhase::Succeeded);
        assert!(start(
            &vm(Some(RunStrategy::RerunOnFailure), None),
            Some(&done),
            &Default::default()
        )
        .is_ok());
        let e = start(
            &vm(Some(RunStrategy::Always), None),
            None,
            &Default::default(),
        )
        .unwrap_err();
        assert_eq!(e.message, "Always does not support manual start requests");
        assert_eq!(e.code, 409);
    }

    #[test]
    fn start_refuses_a_running_vm_pending_requests_and_paused() {
        let running = vmi(VmiPhase::Running);
        let e = start(
            &vm(Some(RunStrategy::Manual), None),
            Some(&running),
            &Default::default(),
        )
        .unwrap_err();
        assert_eq!(e.message, "VM is already running");
        let mut busy = vm(Some(RunStrategy::Manual), None);
        busy.status = Some(VirtualMachineStatus {
            state_change_requests: vec![request("Stop", Some("u0".into()))],
            ..Default::default()
        });
        let e = start(&busy, None, &Default::default()).unwrap_err();
        assert!(
            e.message.contains("pending state change requests (Stop)"),
            "{e}"
        );
        let e = start(
            &vm(Some(RunStrategy::Halted), None),
            None,
            &StartOptions {
                paused: true,
                ..Default::default()
            },
        )
        .unwrap_err();
        assert_eq!((e.code, e.reason), (400, "BadRequest"));
        assert!(e.message.contains("startStrategy"), "{e}");
    }

    #[test]
    fn stop_by_strategy() {
        let running = vmi(VmiPhase::Running);
        for s in [
            RunStrategy::Always,
            RunStrategy::RerunOnFailure,
            RunStrategy::Once,
        ] {
            let p = stop(&vm(Some(s), None), Some(&running), &Default::default()).unwrap();
            assert_eq!(
                p.change,
                VmChange::Spec(
                    json!({"metadata": {"resourceVersion": "7"}, "spec": {"runStrategy": "Halted"}})
                )
            );
            assert_eq!(p.vmi_grace_period, None);
        }
        let p = stop(
            &vm(Some(RunStrategy::Manual), None),
            Some(&running),
            &StopOptions {
                grace_period: Some(0),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(
            p.change,
            VmChange::Requests(vec![request("Stop", Some("u1".into()))])
        );
        assert_eq!(p.vmi_grace_period, Some(0));
        let e = stop(
            &vm(Some(RunStrategy::Manual), None),
            None,
            &Default::default(),
        )
        .unwrap_err();
        assert_eq!(e.message, "VM is not running");
        let e = stop(
            &vm(Some(RunStrategy::Halted), None),
            None,
            &Default::default(),
        )
        .unwrap_err();
        assert_eq!(e.message, "VM is not running");
        // Halted but still shutting down: a grace period may shorten it.
        let p = stop(
            &vm(Some(RunStrategy::Halted), None),
            Some(&running),
            &StopOptions {
                grace_period: Some(1),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(p.vmi_grace_period, Some(1));
        let e = stop(
            &vm(Some(RunStrategy::Always), None),
            Some(&running),
            &StopOptions {
                grace_period: Some(-1),
                ..Default::default()
            },
        )
        .unwrap_err();
        assert!(e.message.starts_with("gracePeriod: -1 is negative"), "{e}");
    }

    #[test]
    fn restart_asks_stop_of_this_vmi_then_start() {
        let running = vmi(VmiPhase::Running);
        let p = restart(
            &vm(Some(RunStrategy::Always), None),
            Some(&running),
            &Default::default(),
        )
        .unwrap();
        assert_eq!(
            p.change,
            VmChange::Requests(vec![
                request("Stop", Some("u1".into())),
                request("Start", None)
            ])
        );
        let e = restart(
            &vm(Some(RunStrategy::Halted), None),
            Some(&running),
            &Default::default(),
        )
        .unwrap_err();
        assert_eq!(e.message, "Halted does not support manual restart requests");
        let e = restart(
            &vm(Some(RunStrategy::Always), None),
            None,
            &Default::default(),
        )
        .unwrap_err();
        assert_eq!(e.message, "VM is not running");
    }

    #[test]
    fn dry_run_values() {
        assert!(!dry_run(&[]).unwrap());
        assert!(dry_run(&["All".into()]).unwrap());
        assert!(dry_run(&["Some".into()]).is_err());
    }
}
