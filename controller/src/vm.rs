//! The VirtualMachine controller's decisions, as pure functions of the VM, its VMI and the time:
//! what to do about the VMI for the run strategy (with KubeVirt's crash-loop backoff), and the
//! `status.printableStatus` users see in `kubectl get vm`. The reconcile loop applies them.

use std::sync::Arc;
use std::time::Duration;

use api::validation::run_strategy;
use api::{RunStrategy, VirtualMachine, VirtualMachineInstance, VmiPhase};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::ResourceExt;

use controller_runtime::time::{now_unix, unix_rfc3339};
use controller_runtime::{
    controlled_by, finalizer_patch, has_finalizer, is_conflict, is_not_found, remove_condition,
    set_condition, write_status,
};

use crate::context::{Context, Error, Result};
use crate::datavolume::DataVolumes;

/// KubeVirt's start backoff: 10 s doubling per consecutive failure, at most 5 minutes.
pub fn backoff_seconds(consecutive_failures: u32) -> u64 {
    if consecutive_failures == 0 {
        return 0;
    }
    (10u64 << (consecutive_failures - 1).min(5)).min(300)
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VmAction {
    Nothing,
    /// Create the VMI from the template (its name is the VM's).
    CreateVmi,
    /// Delete the VMI (stop, or clear a finished one before restarting).
    DeleteVmi,
    /// A restart after a failure waits until this Unix time.
    WaitUntil(i64),
}

/// The state of the VMI as the VM controller cares about it.
fn finished(vmi: &VirtualMachineInstance) -> Option<VmiPhase> {
    match vmi.status.as_ref().and_then(|s| s.phase) {
        Some(p @ (VmiPhase::Succeeded | VmiPhase::Failed)) => Some(p),
        _ => None,
    }
}

/// Start/stop requests from `virtctl start|stop|restart` (status.stateChangeRequests).
fn requested(vm: &VirtualMachine, action: &str) -> bool {
    vm.status
        .as_ref()
        .is_some_and(|s| s.state_change_requests.iter().any(|r| r.action == action))
}

/// What to do next. `retry_after` is the Unix time before which a failed VM may not restart
/// (status.startFailure.retryAfterTimestamp, parsed by the caller), `now` the current time.
pub fn decide(
    vm: &VirtualMachine,
    vmi: Option<&VirtualMachineInstance>,
    retry_after: Option<i64>,
    now: i64,
) -> VmAction {
    if vm.metadata.deletion_timestamp.is_some() {
        return if vmi.is_some() {
            VmAction::DeleteVmi
        } else {
            VmAction::Nothing
        };
    }
    let deleting = vmi.is_some_and(|v| v.metadata.deletion_timestamp.is_some());
    if deleting {
        return VmAction::Nothing; // wait for the old VMI to go
    }
    let strategy = run_strategy(vm);
    let start = |after_failure: bool| match retry_after {
        Some(t) if after_failure && t > now => VmAction::WaitUntil(t),
        _ => VmAction::CreateVmi,
    };
    if requested(vm, "Stop") {
        return if vmi.is_some() {
            VmAction::DeleteVmi
        } else {
            VmAction::Nothing
        };
    }
    match (strategy, vmi, vmi.and_then(finished)) {
        (RunStrategy::Halted, Some(_), _) => VmAction::DeleteVmi,
        (RunStrategy::Halted, None, _) => VmAction::Nothing,
        // A finished VMI is cleared first; the next round recreates it where the strategy says so.
        (RunStrategy::Always, Some(_), Some(_)) => VmAction::DeleteVmi,
        (RunStrategy::RerunOnFailure, Some(_), Some(VmiPhase::Failed)) => VmAction::DeleteVmi,
        (_, Some(_), _) => VmAction::Nothing,
        (RunStrategy::Always, None, _) => start(retry_after.is_some()),
        (RunStrategy::RerunOnFailure, None, _) => {
            let succeeded = vm
                .status
                .as_ref()
                .and_then(|s| s.printable_status.as_deref())
                == Some("Succeeded");
            if succeeded && !requested(vm, "Start") {
                VmAction::Nothing
            } else {
                start(retry_after.is_some())
            }
        }
        (RunStrategy::Manual | RunStrategy::Once, None, _) => {
            let created_before = vm.status.as_ref().and_then(|s| s.created).unwrap_or(false);
            if requested(vm, "Start") || (strategy == RunStrategy::Once && !created_before) {
                VmAction::CreateVmi
            } else {
                VmAction::Nothing
            }
        }
    }
}

/// `status.printableStatus`, with KubeVirt's values.
pub fn printable_status(
    vm: &VirtualMachine,
    vmi: Option<&VirtualMachineInstance>,
    retry_after: Option<i64>,
    now: i64,
) -> &'static str {
    if vm.metadata.deletion_timestamp.is_some() {
        return "Terminating";
    }
    let Some(vmi) = vmi else {
        if retry_after.is_some_and(|t| t > now) {
            return "CrashLoopBackOff";
        }
        return match run_strategy(vm) {
            RunStrategy::Halted
            | RunStrategy::Manual
            | RunStrategy::Once
            | RunStrategy::RerunOnFailure => "Stopped",
            RunStrategy::Always => "Starting",
        };
    };
    if vmi.metadata.deletion_timestamp.is_some() {
        return "Stopping";
    }
    let status = vmi.status.clone().unwrap_or_default();
    let unschedulable = status.conditions.iter().any(|c| {
        c.type_ == "PodScheduled"
            && c.status == "False"
            && c.reason.as_deref() == Some("Unschedulable")
    });
    if unschedulable {
        return "ErrorUnschedulable";
    }
    let migrating = status
        .migration_state
        .as_ref()
        .is_some_and(|m| m.completed != Some(true) && m.failed != Some(true));
    match status.phase {
        None | Some(VmiPhase::Pending | VmiPhase::Scheduling | VmiPhase::Scheduled) => "Starting",
        Some(VmiPhase::Running) if migrating => "Migrating",
        Some(VmiPhase::Running) => "Running",
        Some(VmiPhase::Succeeded) => "Succeeded",
        Some(VmiPhase::Failed) => "Failed",
        Some(VmiPhase::Unknown) => "Unknown",
    }
}

// ---------------------------------------------------------------------------------------------
// The reconcile loop

const CONTROLLER: &str = "vm";

fn retry_after(vm: &VirtualMachine) -> Option<i64> {
    vm.status
        .as_ref()
        .and_then(|s| s.start_failure.as_ref())
        .and_then(|f| f.retry_after_timestamp.as_deref())
        .and_then(controller_runtime::time::parse_unix)
}

/// The VMI a VM creates: the template expanded with the VM's instance type and preference,
/// then KubeVirt's defaults, with the VM's name, labels and a controller reference.
pub fn vmi_for(
    vm: &VirtualMachine,
    expansion: &crate::instancetype::Expansion,
    network: &api::validation::NetworkDefaults,
) -> std::result::Result<VirtualMachineInstance, String> {
    let template = vm.spec.template.clone();
    let tmeta = template.metadata.unwrap_or_default();
    let mut spec = template.spec.unwrap_or_default();
    api::instancetype::expand(
        &mut spec,
        expansion.instancetype.as_ref(),
        expansion.preference.as_ref(),
        "spec.template.spec",
    )?;
    api::validation::default_vmi_spec_with(&mut spec, network);
    let mut labels = tmeta.labels.unwrap_or_default();
    labels.insert(
        api::labels::VM_NAME.into(),
        vm.metadata.name.clone().unwrap_or_default(),
    );
    let mut vmi = VirtualMachineInstance::new(&vm.name_any(), spec);
    vmi.metadata.namespace = vm.metadata.namespace.clone();
    vmi.metadata.labels = Some(labels);
    vmi.metadata.annotations = tmeta.annotations;
    // A VM restored from (or made to start from) a running-state snapshot resumes it in this
    // VMI (the VMI controller finds the snapshot's machine state).
    if let Some(name) = api::snapshot::start_from_snapshot(vm.metadata.annotations.as_ref()) {
        vmi.annotations_mut().insert(
            api::snapshot::ANNOTATION_START_FROM_SNAPSHOT.into(),
            name.into(),
        );
    }
    vmi.metadata.owner_references = controller_runtime::controller_ref(vm).map(|r| vec![r]);
    Ok(vmi)
}

/// The VM's `Failure` condition with `reason` and the message, and a warning Event the first
/// time that message is seen.
async fn record_failure(
    ctx: &Context,
    vm: &VirtualMachine,
    status: &mut api::VirtualMachineStatus,
    reason: &str,
    action: &str,
    msg: String,
) {
    let known = status.conditions.iter().any(|c| {
        c.type_ == api::conditions::FAILURE
            && c.reason.as_deref() == Some(reason)
            && c.message.as_ref() == Some(&msg)
    });
    if !known {
        ctx.event(vm, true, reason, action, msg.clone()).await;
    }
    set_condition(
        &mut status.conditions,
        api::conditions::FAILURE,
        true,
        Some(reason),
        Some(msg),
    );
}

/// Reconciles one VirtualMachine: applies [`decide`] and writes `status`.
pub async fn reconcile(vm: Arc<VirtualMachine>, ctx: Arc<Context>) -> Result<Action> {
    let started = std::time::Instant::now();
    let r = reconcile_inner(&vm, &ctx).await;
    ctx.metrics.observe_reconcile(CONTROLLER, started.elapsed());
    if r.is_ok() {
        ctx.succeeded(CONTROLLER, vm.as_ref());
    }
    r
}

pub fn error_policy(vm: Arc<VirtualMachine>, err: &Error, ctx: Arc<Context>) -> Action {
    ctx.retry(CONTROLLER, vm.as_ref(), err)
}

/// One reconcile of one VM: the object, where to write, and the status being built.
struct Pass<'a> {
    vm: &'a VirtualMachine,
    ctx: &'a Context,
    name: String,
    vms: Api<VirtualMachine>,
    vmis: Api<VirtualMachineInstance>,
    status: api::VirtualMachineStatus,
    deleting: bool,
    now: i64,
}

/// What carrying out the decision leaves: the VMI as it now is, or an early answer.
enum Outcome {
    Vmi(Option<Box<VirtualMachineInstance>>, Action),
    Done(Action),
}

async fn reconcile_inner(vm: &VirtualMachine, ctx: &Context) -> Result<Action> {
    if ctx.unseen_writes.predate_own_write(vm) {
        // The echo of the last write is on its way and wakes this VM again.
        return Ok(Action::await_change());
    }
    let ns = vm.namespace().unwrap_or_default();
    let mut pass = Pass {
        vm,
        ctx,
        name: vm.name_any(),
        vms: Api::namespaced(ctx.client.clone(), &ns),
        vmis: Api::namespaced(ctx.client.clone(), &ns),
        status: vm.status.clone().unwrap_or_default(),
        deleting: vm.metadata.deletion_timestamp.is_some(),
        now: now_unix(),
    };
    if !pass.deleting && !has_finalizer(vm, api::labels::VM_FINALIZER) {
        return pass.set_finalizer(true).await;
    }
    if let Err(e) = api::validation::validate_vm(vm) {
        // Never half-reconciled: no VMI, an Event and a Failure condition with the message.
        pass.failure("InvalidSpec", "Validate", e.to_string()).await;
        return pass.write(Action::await_change()).await;
    }
    remove_condition(&mut pass.status.conditions, api::conditions::FAILURE);
    let vmi = match pass.owned_vmi().await? {
        Ok(vmi) => vmi,
        Err(msg) => {
            let c = &mut pass.status.conditions;
            set_condition(
                c,
                api::conditions::FAILURE,
                true,
                Some("FailedCreate"),
                Some(msg),
            );
            return pass.write(Action::await_change()).await;
        }
    };
    if let Some(v) = &vmi {
        if pass.state_taken(v) {
            return pass.take_start_from_snapshot().await;
        }
    }
    pass.count_start_failure(vmi.as_ref()).await;
    // Start/stop requests: a Stop is done once its VMI is gone (or it names another VMI).
    let vmi_uid = vmi.as_ref().and_then(|v| v.uid());
    pass.status.state_change_requests.retain(|r| {
        !(r.action == "Stop" && (vmi.is_none() || (r.uid.is_some() && r.uid != vmi_uid)))
    });
    // runStrategy Once: when its VMI has finished, the VM becomes Halted (as KubeVirt does), so
    // it is never started again, whatever happens to the finished VMI.
    if run_strategy(vm) == RunStrategy::Once
        && !pass.deleting
        && vmi.as_ref().and_then(finished).is_some()
    {
        return pass.halt().await;
    }
    let data_volumes = pass.data_volumes().await?;
    let (current, requeue) = match pass.carry_out(vmi, &data_volumes).await? {
        Outcome::Vmi(current, requeue) => (current, requeue),
        Outcome::Done(action) => return Ok(action),
    };
    if pass.deleting && current.is_none() {
        return pass.set_finalizer(false).await;
    }
    pass.observe(current.as_deref(), &data_volumes);
    pass.write(requeue).await
}

impl Pass<'_> {
    async fn write(&self, then: Action) -> Result<Action> {
        let written = write_status(&self.vms, self.vm, self.status.clone()).await?;
        if written.resource_version() != self.vm.resource_version() {
            self.ctx.unseen_writes.wrote(self.vm, &[]);
        }
        Ok(then)
    }

    async fn patch(&self, p: &serde_json::Value) -> Result<Action> {
        let written = self
            .vms
            .patch(&self.name, &PatchParams::default(), &Patch::Merge(p))
            .await?;
        if written.metadata.deletion_timestamp.is_some() && written.finalizers().is_empty() {
            self.ctx.unseen_writes.forget(self.vm);
        } else {
            self.ctx.unseen_writes.wrote(self.vm, &[]);
        }
        Ok(Action::await_change())
    }

    /// Whether the VM's start-from-snapshot annotation has been taken by its VMI: carried
    /// onto it and run there. It is taken once, since a later start would resume memory older
    /// than the disks by then; a VMI that failed before it ran leaves it for the next one, so
    /// the VM never boots afresh where it was asked to resume.
    fn state_taken(&self, vmi: &VirtualMachineInstance) -> bool {
        use api::snapshot::start_from_snapshot;
        let on_vm = start_from_snapshot(self.vm.metadata.annotations.as_ref());
        let ran = matches!(
            vmi.status.as_ref().and_then(|s| s.phase),
            Some(VmiPhase::Running | VmiPhase::Succeeded)
        );
        ran && on_vm.is_some() && on_vm == start_from_snapshot(vmi.metadata.annotations.as_ref())
    }

    async fn take_start_from_snapshot(&self) -> Result<Action> {
        self.patch(&serde_json::json!({"metadata": {"annotations": {
            api::snapshot::ANNOTATION_START_FROM_SNAPSHOT: null
        }}}))
        .await
    }

    async fn set_finalizer(&self, present: bool) -> Result<Action> {
        self.patch(&finalizer_patch(
            self.vm,
            api::labels::VM_FINALIZER,
            present,
        ))
        .await
    }

    async fn failure(&mut self, reason: &str, action: &str, msg: String) {
        record_failure(self.ctx, self.vm, &mut self.status, reason, action, msg).await
    }

    /// The VMI of the VM's name, if this VM controls it (or nobody does); a foreign one is
    /// the failure's message. From the cache if it has it; "none" only from the API server
    /// (see `caches`), so a VMI is never created twice.
    async fn owned_vmi(
        &self,
    ) -> Result<std::result::Result<Option<VirtualMachineInstance>, String>> {
        let uid = self.vm.uid().unwrap_or_default();
        let ns = self.vm.namespace().unwrap_or_default();
        let vmi = match self.ctx.caches.vmi(&ns, &self.name) {
            Some(cached) => Some(cached.as_ref().clone()),
            None => self.vmis.get_opt(&self.name).await?,
        };
        Ok(match vmi {
            Some(v) if v.owner_references().is_empty() || controlled_by(&v, &uid) => Ok(Some(v)),
            Some(_) => Err(format!(
                "VirtualMachineInstance {} exists and is not controlled by this VirtualMachine",
                self.name
            )),
            None => Ok(None),
        })
    }

    /// Start failures: counted once per failed VMI, cleared when a newer VMI reaches Running.
    async fn count_start_failure(&mut self, vmi: Option<&VirtualMachineInstance>) {
        let Some(v) = vmi else { return };
        let uid = v.uid();
        let phase = v.status.as_ref().and_then(|s| s.phase);
        let last = self
            .status
            .start_failure
            .as_ref()
            .and_then(|f| f.last_failed_vmi_uid.clone());
        if phase == Some(VmiPhase::Failed) && last != uid {
            let count = self
                .status
                .start_failure
                .as_ref()
                .map_or(0, |f| f.consecutive_fail_count)
                + 1;
            let wait = backoff_seconds(count as u32) as i64;
            self.status.start_failure = Some(api::StartFailure {
                consecutive_fail_count: count,
                retry_after_timestamp: Some(unix_rfc3339(self.now + wait)),
                last_failed_vmi_uid: uid.clone(),
            });
            let note = format!(
                "VirtualMachineInstance {} failed; restart in {wait} s (failure {count})",
                self.name
            );
            self.ctx
                .event(self.vm, true, "FailedStart", "Start", note)
                .await;
        } else if phase == Some(VmiPhase::Running) && last.is_some() && last != uid {
            self.status.start_failure = None;
        }
    }

    async fn halt(&self) -> Result<Action> {
        self.patch(&serde_json::json!({
            "metadata": {"resourceVersion": self.vm.resource_version()},
            "spec": {"runStrategy": "Halted", "running": null}
        }))
        .await
    }

    /// DataVolumes are made as soon as the VM exists (CDI takes its time to populate them);
    /// the VMI waits until they are ready, and the VM's condition says how far they are.
    async fn data_volumes(&mut self) -> Result<DataVolumes> {
        let dvs = if self.deleting {
            DataVolumes::Ready
        } else {
            crate::datavolume::ensure(&self.ctx.client, self.vm).await?
        };
        let templates = self.vm.spec.data_volume_templates.as_ref();
        if templates.is_some_and(|t| !t.is_empty()) {
            let (ready, reason, message) = match &dvs {
                DataVolumes::Ready => (true, "AllDataVolumesReady", None),
                DataVolumes::Provisioning(m) => (false, "NotAllDataVolumesReady", Some(m.clone())),
                DataVolumes::Failed(m) => (false, "DataVolumeError", Some(m.clone())),
            };
            let c = &mut self.status.conditions;
            set_condition(
                c,
                api::conditions::DATA_VOLUMES_READY,
                ready,
                Some(reason),
                message,
            );
        }
        Ok(dvs)
    }

    /// Does what [`decide`] asks of the VM as it now is.
    async fn carry_out(
        &mut self,
        vmi: Option<VirtualMachineInstance>,
        data_volumes: &DataVolumes,
    ) -> Result<Outcome> {
        let mut view = self.vm.clone();
        view.status = Some(self.status.clone());
        let mut requeue = Action::await_change();
        match decide(&view, vmi.as_ref(), retry_after(&view), self.now) {
            VmAction::Nothing => {}
            VmAction::CreateVmi if self.locked_by().is_some() => {
                // A snapshot reads or a restore writes the VM's disks: started once done.
                requeue = Action::requeue(Duration::from_secs(2));
            }
            VmAction::CreateVmi if *data_volumes != DataVolumes::Ready => {
                if let DataVolumes::Failed(msg) = data_volumes {
                    self.failure("FailedCreate", "Create", msg.clone()).await;
                }
                // CDI's progress is not watched; look again shortly.
                requeue = Action::requeue(Duration::from_secs(2));
            }
            VmAction::CreateVmi => return self.create_vmi().await,
            VmAction::DeleteVmi => {
                let v = vmi.as_ref().expect("DeleteVmi implies a VMI");
                if v.metadata.deletion_timestamp.is_none() {
                    self.delete_vmi().await?;
                }
            }
            VmAction::WaitUntil(t) => {
                requeue = Action::requeue(Duration::from_secs((t - self.now).max(1) as u64));
            }
        }
        Ok(Outcome::Vmi(vmi.map(Box::new), requeue))
    }

    /// The snapshot or restore holding the VM (KubeVirt's `snapshotInProgress` /
    /// `restoreInProgress`), if any.
    fn locked_by(&self) -> Option<&str> {
        self.status
            .snapshot_in_progress
            .as_deref()
            .or(self.status.restore_in_progress.as_deref())
    }

    async fn create_vmi(&mut self) -> Result<Outcome> {
        let expanded = match crate::instancetype::resolve(&self.ctx.client, self.vm).await {
            Ok(x) => vmi_for(self.vm, &x, &self.ctx.settings().network),
            Err(crate::instancetype::ResolveError::Missing(m)) => Err(m),
            Err(crate::instancetype::ResolveError::Kube(e)) => return Err(e.into()),
        };
        let new_vmi = match expanded {
            Ok(v) => v,
            Err(msg) => {
                // Not started: the VM says why, and tries again (the instance type may
                // appear later).
                self.failure("FailedCreate", "Create", msg).await;
                let again = Action::requeue(Duration::from_secs(5));
                return Ok(Outcome::Done(self.write(again).await?));
            }
        };
        let created = match self.vmis.create(&PostParams::default(), &new_vmi).await {
            Ok(created) => created,
            Err(e) if is_conflict(&e) => {
                return Ok(Outcome::Done(Action::requeue(Duration::from_millis(200))))
            }
            Err(e) => return Err(e.into()),
        };
        let note = format!("Created virtual machine instance {}", self.name);
        self.ctx
            .event(self.vm, false, "SuccessfulCreate", "Create", note)
            .await;
        self.status.created = Some(true);
        self.status
            .state_change_requests
            .retain(|r| r.action != "Start");
        Ok(Outcome::Vmi(
            Some(Box::new(created)),
            Action::await_change(),
        ))
    }

    async fn delete_vmi(&self) -> Result<()> {
        match self.vmis.delete(&self.name, &DeleteParams::default()).await {
            Ok(_) => {
                let note = format!("Stopped virtual machine instance {}", self.name);
                self.ctx
                    .event(self.vm, false, "SuccessfulDelete", "Delete", note)
                    .await
            }
            Err(e) if is_not_found(&e) => {}
            Err(e) => return Err(e.into()),
        }
        Ok(())
    }

    /// What the VM shows: printableStatus, ready, created, runStrategy and `Ready`.
    fn observe(&mut self, current: Option<&VirtualMachineInstance>, data_volumes: &DataVolumes) {
        let mut view = self.vm.clone();
        view.status = Some(self.status.clone());
        let printable = match (current, data_volumes) {
            (None, DataVolumes::Provisioning(_)) if !self.deleting => "Provisioning",
            (None, DataVolumes::Failed(_)) if !self.deleting => "DataVolumeError",
            _ => printable_status(&view, current, retry_after(&view), self.now),
        };
        let s = &mut self.status;
        s.printable_status = Some(printable.to_string());
        let vmi_ready = current
            .and_then(|v| v.status.as_ref())
            .is_some_and(|s| api::conditions::is_true(&s.conditions, api::conditions::READY));
        s.ready = Some(vmi_ready);
        s.created = Some(current.is_some());
        s.run_strategy = Some(run_strategy(self.vm));
        let reason = if vmi_ready {
            None
        } else if current.is_none() {
            Some("VMINotExists")
        } else {
            Some("VMINotReady")
        };
        set_condition(
            &mut s.conditions,
            api::conditions::READY,
            vmi_ready,
            reason,
            None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use api::{
        StateChangeRequest, VirtualMachineInstanceStatus, VirtualMachineSpec, VirtualMachineStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn vm(s: RunStrategy) -> VirtualMachine {
        VirtualMachine::new(
            "vm",
            VirtualMachineSpec {
                run_strategy: Some(s),
                ..Default::default()
            },
        )
    }

    fn vmi(phase: VmiPhase) -> VirtualMachineInstance {
        let mut v = VirtualMachineInstance::new("vm", Default::default());
        v.status = Some(VirtualMachineInstanceStatus {
            phase: Some(phase),
            ..Default::default()
        });
        v
    }

    fn deleted<T: kube::Resource>(mut o: T) -> T {
        o.meta_mut().deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        o
    }

    #[test]
    fn backoff_doubles_to_five_minutes() {
        let b: Vec<u64> = (0..8).map(backoff_seconds).collect();
        assert_eq!(b, [0, 10, 20, 40, 80, 160, 300, 300]);
    }

    #[test]
    fn run_strategies() {
        use RunStrategy::*;
        use VmAction::*;
        let running = vmi(VmiPhase::Running);
        let failed = vmi(VmiPhase::Failed);
        let succeeded = vmi(VmiPhase::Succeeded);
        let cases: &[(RunStrategy, Option<&VirtualMachineInstance>, VmAction)] = &[
            (Always, None, CreateVmi),
            (Always, Some(&running), Nothing),
            (Always, Some(&failed), DeleteVmi),
            (Always, Some(&succeeded), DeleteVmi),
            (RerunOnFailure, None, CreateVmi),
            (RerunOnFailure, Some(&failed), DeleteVmi),
            (RerunOnFailure, Some(&succeeded), Nothing),
            (Halted, Some(&running), DeleteVmi),
            (Halted, None, Nothing),
            (Manual, None, Nothing),
            (Manual, Some(&running), Nothing),
            (Once, None, CreateVmi),
            (Once, Some(&succeeded), Nothing),
        ];
        for (s, v, want) in cases {
            assert_eq!(
                &decide(&vm(*s), *v, None, 0),
                want,
                "{s:?} with {:?}",
                v.and_then(|v| v.status.as_ref()).and_then(|s| s.phase)
            );
        }
    }

    #[test]
    fn running_maps_like_kubevirt() {
        let mut v = VirtualMachine::new(
            "vm",
            VirtualMachineSpec {
                running: Some(true),
                ..Default::default()
            },
        );
        assert_eq!(decide(&v, None, None, 0), VmAction::CreateVmi);
        v.spec.running = Some(false);
        assert_eq!(
            decide(&v, Some(&vmi(VmiPhase::Running)), None, 0),
            VmAction::DeleteVmi
        );
    }

    #[test]
    fn once_does_not_rerun_and_manual_follows_requests() {
        let mut v = vm(RunStrategy::Once);
        v.status = Some(VirtualMachineStatus {
            created: Some(true),
            ..Default::default()
        });
        assert_eq!(decide(&v, None, None, 0), VmAction::Nothing);
        let mut m = vm(RunStrategy::Manual);
        m.status = Some(VirtualMachineStatus {
            state_change_requests: vec![StateChangeRequest {
                action: "Start".into(),
                uid: None,
                data: None,
            }],
            ..Default::default()
        });
        assert_eq!(decide(&m, None, None, 0), VmAction::CreateVmi);
        m.status.as_mut().unwrap().state_change_requests[0].action = "Stop".into();
        assert_eq!(
            decide(&m, Some(&vmi(VmiPhase::Running)), None, 0),
            VmAction::DeleteVmi
        );
    }

    #[test]
    fn crash_loop_waits_out_the_backoff() {
        let v = vm(RunStrategy::Always);
        assert_eq!(decide(&v, None, Some(100), 50), VmAction::WaitUntil(100));
        assert_eq!(
            printable_status(&v, None, Some(100), 50),
            "CrashLoopBackOff"
        );
        assert_eq!(decide(&v, None, Some(100), 150), VmAction::CreateVmi);
    }

    #[test]
    fn deletion_and_printable_status() {
        let v = vm(RunStrategy::Always);
        assert_eq!(
            decide(&deleted(v.clone()), Some(&vmi(VmiPhase::Running)), None, 0),
            VmAction::DeleteVmi
        );
        assert_eq!(
            printable_status(&deleted(v.clone()), None, None, 0),
            "Terminating"
        );
        assert_eq!(
            printable_status(&v, Some(&deleted(vmi(VmiPhase::Running))), None, 0),
            "Stopping"
        );
        assert_eq!(
            decide(&v, Some(&deleted(vmi(VmiPhase::Running))), None, 0),
            VmAction::Nothing
        );
        assert_eq!(
            printable_status(&v, Some(&vmi(VmiPhase::Scheduling)), None, 0),
            "Starting"
        );
        assert_eq!(
            printable_status(&v, Some(&vmi(VmiPhase::Running)), None, 0),
            "Running"
        );
        assert_eq!(
            printable_status(&vm(RunStrategy::Halted), None, None, 0),
            "Stopped"
        );
        let mut mig = vmi(VmiPhase::Running);
        mig.status.as_mut().unwrap().migration_state = Some(api::MigrationState {
            completed: Some(false),
            ..Default::default()
        });
        assert_eq!(printable_status(&v, Some(&mig), None, 0), "Migrating");
        let mut unsched = vmi(VmiPhase::Scheduling);
        unsched
            .status
            .as_mut()
            .unwrap()
            .conditions
            .push(api::Condition {
                type_: "PodScheduled".into(),
                status: "False".into(),
                reason: Some("Unschedulable".into()),
                ..Default::default()
            });
        assert_eq!(
            printable_status(&v, Some(&unsched), None, 0),
            "ErrorUnschedulable"
        );
    }
}
