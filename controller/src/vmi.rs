//! The VirtualMachineInstance controller: one launcher Pod per VMI and the VMI's phase from it.
//!
//! Phases: Pending (accepted) → Scheduling (Pod created, not yet running on a node) →
//! Scheduled (Pod running on a node: `status.nodeName`, label `kubevirt.io/nodeName`) →
//! Running (set by virt-handler once the guest runs) → Succeeded/Failed from the Pod's outcome.
//! The Pods a VMI runs in are `status.activePods` (Pod uid → node), so a migration target
//! Pod (which carries the same `kubevirt.io/created-by` label) is never mistaken for it.
//! A finalizer makes deleting a VMI delete its Pods with the VMI's grace period first: the
//! launcher turns SIGTERM into a guest shutdown (the ACPI power button, or Ctrl-Alt-Del for a
//! guest without ACPI), so the guest is shut down before the Pod goes.

use std::collections::BTreeMap;
use std::sync::Arc;

use api::{VirtualMachineInstance, VirtualMachineInstanceStatus, VmiPhase};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::ResourceExt;

use crate::context::{Context, Error, Result};
use crate::evacuation;
use api::migratability::EvictionStrategy;
use controller_runtime::events::event;
use controller_runtime::{
    delete_if_present, finalizer_patch, has_finalizer, remove_condition, set_condition,
    write_labels, write_status,
};
use kube::runtime::events::Event;

const CONTROLLER: &str = "vmi";

pub async fn reconcile(vmi: Arc<VirtualMachineInstance>, ctx: Arc<Context>) -> Result<Action> {
    let started = std::time::Instant::now();
    let r = reconcile_inner(&vmi, &ctx).await;
    ctx.metrics.observe_reconcile(CONTROLLER, started.elapsed());
    if r.is_ok() {
        ctx.succeeded(CONTROLLER, vmi.as_ref());
    }
    r
}

pub fn error_policy(vmi: Arc<VirtualMachineInstance>, err: &Error, ctx: Arc<Context>) -> Action {
    ctx.retry(CONTROLLER, vmi.as_ref(), err)
}

/// The Pods made for this VMI (its launcher and any migration target), read from the API
/// server (what a cache miss is asked of, see `caches`) so that a Pod created a moment ago is
/// never created twice.
pub async fn pods_of(
    pods: &Api<Pod>,
    vmi: &VirtualMachineInstance,
    ctx: &Context,
) -> Result<Vec<Pod>> {
    let uid = vmi.uid().unwrap_or_default();
    owned_pods(pods, api::labels::CREATED_BY, &uid, vmi, ctx).await
}

/// The Pods labelled `label=value` that `vmi` controls. A label is anyone's to write, so a
/// Pod that carries it without the VMI's controller reference is a stranger: it is named in
/// an Event on the VMI and otherwise left alone (never adopted, given a guest or deleted).
pub async fn owned_pods(
    pods: &Api<Pod>,
    label: &str,
    value: &str,
    vmi: &VirtualMachineInstance,
    ctx: &Context,
) -> Result<Vec<Pod>> {
    let lp = ListParams::default().labels(&format!("{label}={value}"));
    let uid = vmi.uid().unwrap_or_default();
    let (owned, strangers): (Vec<Pod>, Vec<Pod>) = pods
        .list(&lp)
        .await?
        .items
        .into_iter()
        .partition(|p| api::ownership::controlled_by_vmi(&p.metadata, &uid));
    for p in strangers {
        let note = api::ownership::stranger_note(
            &p.name_any(),
            &vmi.name_any(),
            &format!("{label}={value}"),
        );
        tracing::warn!(vmi = %vmi.name_any(), pod = %p.name_any(), "{note}");
        let related = Some(kube::Resource::object_ref(&p, &()));
        ctx.events
            .publish(
                vmi,
                Event {
                    secondary: related,
                    ..event(true, "ForeignPodIgnored", "Sync", note)
                },
            )
            .await;
    }
    Ok(owned)
}

fn pod_phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending")
}

fn pod_node(pod: &Pod) -> Option<String> {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .filter(|n| !n.is_empty())
}

fn pod_condition<'a>(
    pod: &'a Pod,
    type_: &str,
) -> Option<&'a k8s_openapi::api::core::v1::PodCondition> {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == type_))
}

/// Why the launcher container ended, for a Failed VMI's `reason`.
fn termination_reason(pod: &Pod) -> String {
    let state = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.iter().find(|c| c.name == "compute"))
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.terminated.as_ref());
    match state {
        Some(t) => format!(
            "launcher exited with code {}{}",
            t.exit_code,
            t.reason
                .as_deref()
                .map(|r| format!(" ({r})"))
                .unwrap_or_default()
        ),
        None => pod
            .status
            .as_ref()
            .and_then(|s| s.reason.clone())
            .unwrap_or_else(|| "launcher Pod failed".into()),
    }
}

/// Among a VMI's Pods, the active one (by uid), or when none is recorded the one that is not
/// a migration target.
fn launcher_among<'a>(
    pods: impl Iterator<Item = &'a Pod> + Clone,
    active: &BTreeMap<String, String>,
) -> Option<&'a Pod> {
    let by_uid = pods
        .clone()
        .find(|p| p.uid().is_some_and(|u| active.contains_key(&u)));
    by_uid.or_else(|| {
        pods.filter(|_| active.is_empty())
            .find(|p| !p.labels().contains_key(api::labels::MIGRATION_JOB))
    })
}

/// One reconcile of one VMI: the object, where to write, and the status and labels being built.
struct Pass<'a> {
    vmi: &'a VirtualMachineInstance,
    ctx: &'a Context,
    vmis: Api<VirtualMachineInstance>,
    pods: Api<Pod>,
    status: VirtualMachineInstanceStatus,
    labels: BTreeMap<String, String>,
}

async fn reconcile_inner(vmi: &VirtualMachineInstance, ctx: &Context) -> Result<Action> {
    let ns = vmi.namespace().unwrap_or_default();
    let mut pass = Pass {
        vmi,
        ctx,
        vmis: Api::namespaced(ctx.client.clone(), &ns),
        pods: Api::namespaced(ctx.client.clone(), &ns),
        status: vmi.status.clone().unwrap_or_default(),
        labels: vmi.labels().clone(),
    };
    if ctx.unseen_writes.predate_own_write(vmi) {
        // The echo of the last write is on its way and wakes this VMI again.
        return Ok(Action::await_change());
    }
    if vmi.metadata.deletion_timestamp.is_some() {
        return pass.finalize().await;
    }
    if !has_finalizer(vmi, api::labels::VMI_FINALIZER) {
        return pass.set_finalizer(true).await;
    }
    let phase = pass.status.phase;
    if matches!(phase, Some(VmiPhase::Succeeded | VmiPhase::Failed)) {
        return Ok(Action::await_change());
    }
    let admitted = api::validation::validate_vmi(vmi).and_then(|()| {
        ctx.pod_config()
            .host_disks
            .check("VirtualMachineInstance", &vmi.metadata, &vmi.spec, "spec")
            .and_then(|()| {
                let network = ctx.settings().network;
                network.check("VirtualMachineInstance", &vmi.metadata, &vmi.spec, "spec")
            })
    });
    if let Err(e) = admitted {
        return pass.refuse(e.to_string()).await;
    }
    // Only the controller's own verdict goes: virt-handler reports its sync with launchers
    // in the same condition type, with reasons of its own.
    pass.status.conditions.retain(|c| {
        !(c.type_ == api::conditions::SYNCHRONIZED && c.reason.as_deref() == Some("FailedCreate"))
    });
    let unplaced = matches!(phase, None | Some(VmiPhase::Pending));
    let annotations = vmi.metadata.annotations.as_ref();
    if let (true, Some(snapshot), None) = (
        unplaced,
        api::snapshot::start_from_snapshot(annotations),
        api::snapshot::start_from_state(annotations),
    ) {
        return pass.find_machine_state(snapshot).await;
    }
    match (pass.launcher_pod().await?, phase) {
        (None, None | Some(VmiPhase::Pending)) => pass.create_pod().await?,
        (None, _) => pass.pod_vanished().await,
        (Some(p), _) => pass.follow_pod(&p, phase),
    }
    let placed = matches!(
        pass.status.phase,
        Some(VmiPhase::Scheduled | VmiPhase::Running)
    );
    if placed {
        pass.publish_migratability().await?;
    }
    pass.protect(placed).await?;
    let mut action = Action::await_change();
    if pass.status.phase == Some(VmiPhase::Running) {
        if let Some(pause) = evacuation::evacuate(vmi, &pass.status, ctx).await? {
            action = Action::requeue(pause);
        }
    }
    let labels = (&pass.labels != vmi.labels()).then_some(pass.labels);
    write(&pass.vmis, vmi, labels, pass.status, &ctx.unseen_writes).await?;
    Ok(action)
}

impl Pass<'_> {
    async fn set_finalizer(&self, present: bool) -> Result<Action> {
        let p = finalizer_patch(self.vmi, api::labels::VMI_FINALIZER, present);
        self.vmis
            .patch(
                &self.vmi.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&p),
            )
            .await?;
        if present {
            self.ctx.unseen_writes.wrote(self.vmi, &[]);
        } else {
            self.ctx.unseen_writes.forget(self.vmi);
        }
        Ok(Action::await_change())
    }

    /// Deleted: its Pods are deleted with the VMI's grace period; once they are gone the
    /// finalizer lets the VMI go.
    async fn finalize(&self) -> Result<Action> {
        let all = pods_of(&self.pods, self.vmi, self.ctx).await?;
        let grace = self
            .vmi
            .spec
            .termination_grace_period_seconds
            .unwrap_or(30)
            .max(0) as u32;
        let dp = DeleteParams {
            grace_period_seconds: Some(grace),
            ..Default::default()
        };
        for p in all
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
        {
            delete_if_present(&self.pods, &p.name_any(), &dp).await?;
        }
        if all.is_empty() && has_finalizer(self.vmi, api::labels::VMI_FINALIZER) {
            self.set_finalizer(false).await?;
        }
        Ok(Action::await_change())
    }

    /// A spec the controller refuses: Pending, `Synchronized` False with the reason, an Event
    /// the first time the message is seen, and no Pod.
    async fn refuse(mut self, msg: String) -> Result<Action> {
        let known =
            self.status.conditions.iter().any(|c| {
                c.type_ == api::conditions::SYNCHRONIZED && c.message.as_ref() == Some(&msg)
            });
        if !known {
            self.ctx
                .event(self.vmi, true, "FailedCreate", "Validate", msg.clone())
                .await;
        }
        self.status.phase = Some(VmiPhase::Pending);
        set_condition(
            &mut self.status.conditions,
            api::conditions::SYNCHRONIZED,
            false,
            Some("FailedCreate"),
            Some(msg),
        );
        write(
            &self.vmis,
            self.vmi,
            None,
            self.status,
            &self.ctx.unseen_writes,
        )
        .await?;
        Ok(Action::await_change())
    }

    /// A VMI to start from a snapshot: annotated with the snapshot's machine-state claim (the
    /// launcher Pod is made on the next pass, mounting it), or left Pending with the reason
    /// (and looked at again: the snapshot may become ready).
    async fn find_machine_state(self, snapshot: &str) -> Result<Action> {
        let ns = self.vmi.namespace().unwrap_or_default();
        match crate::snapshot::state_claim_of(&self.ctx.client, &ns, snapshot).await? {
            Ok(claim) => {
                let patch = serde_json::json!({"metadata": {"annotations": {
                    api::snapshot::ANNOTATION_START_FROM_STATE: claim
                }}});
                self.vmis
                    .patch(
                        &self.vmi.name_any(),
                        &PatchParams::default(),
                        &Patch::Merge(&patch),
                    )
                    .await?;
                Ok(Action::await_change())
            }
            Err(why) => {
                self.refuse(why).await?;
                Ok(Action::requeue(std::time::Duration::from_secs(5)))
            }
        }
    }

    /// The VMI's launcher Pod: the active one, or (before any is recorded) one an earlier
    /// round created whose status write was lost, adopted. From the cache if it has it;
    /// "none" only from the API server (see `caches`).
    async fn launcher_pod(&self) -> Result<Option<Pod>> {
        let active = self.status.active_pods.clone().unwrap_or_default();
        let cached = self.ctx.caches.launcher_pods_of(self.vmi);
        if let Some(p) = launcher_among(cached.iter().map(|p| p.as_ref()), &active) {
            return Ok(Some(p.clone()));
        }
        let all = pods_of(&self.pods, self.vmi, self.ctx).await?;
        Ok(launcher_among(all.iter(), &active).cloned())
    }

    async fn create_pod(&mut self) -> Result<()> {
        let rendered = crate::pod::render(self.vmi, &self.ctx.pod_config())?;
        let created = self.pods.create(&PostParams::default(), &rendered).await?;
        let note = format!("Created virtual machine pod {}", created.name_any());
        self.ctx
            .event(self.vmi, false, "SuccessfulCreate", "Create", note)
            .await;
        self.status.phase = Some(VmiPhase::Scheduling);
        self.status.active_pods = Some(BTreeMap::from([(
            created.uid().unwrap_or_default(),
            String::new(),
        )]));
        Ok(())
    }

    async fn pod_vanished(&mut self) {
        self.status.phase = Some(VmiPhase::Failed);
        self.status.reason = Some("PodVanished".into());
        let note = "the launcher Pod disappeared".to_string();
        self.ctx
            .event(self.vmi, true, "PodVanished", "Sync", note)
            .await;
    }

    /// The VMI follows its launcher Pod: node, scheduling trouble, phase, readiness.
    fn follow_pod(&mut self, p: &Pod, phase: Option<VmiPhase>) {
        let s = &mut self.status;
        let node = pod_node(p);
        s.active_pods = Some(BTreeMap::from([(
            p.uid().unwrap_or_default(),
            node.clone().unwrap_or_default(),
        )]));
        let unschedulable = pod_condition(p, "PodScheduled")
            .filter(|c| c.status == "False" && c.reason.as_deref() == Some("Unschedulable"));
        let scheduled = api::conditions::POD_SCHEDULED;
        match unschedulable {
            Some(c) => set_condition(
                &mut s.conditions,
                scheduled,
                false,
                Some("Unschedulable"),
                c.message.clone(),
            ),
            None => remove_condition(&mut s.conditions, scheduled),
        }
        match pod_phase(p) {
            "Succeeded" => s.phase = Some(VmiPhase::Succeeded),
            "Failed" => {
                s.phase = Some(VmiPhase::Failed);
                s.reason = Some(termination_reason(p));
            }
            "Running" if matches!(phase, None | Some(VmiPhase::Pending | VmiPhase::Scheduling)) => {
                if let Some(n) = &node {
                    s.phase = Some(VmiPhase::Scheduled);
                    s.node_name = Some(n.clone());
                }
            }
            _ if phase.is_none() || phase == Some(VmiPhase::Pending) => {
                s.phase = Some(VmiPhase::Scheduling)
            }
            _ => {}
        }
        if let Some(n) = &s.node_name {
            self.labels.insert(api::labels::NODE_NAME.into(), n.clone());
        }
        let ready = s.phase == Some(VmiPhase::Running)
            && pod_condition(p, "Ready").is_some_and(|c| c.status == "True");
        let reason = (!ready).then_some("PodNotReady");
        set_condition(
            &mut s.conditions,
            api::conditions::READY,
            ready,
            reason,
            None,
        );
    }

    /// `LiveMigratable`, decided from the spec and the claims as they are now.
    async fn publish_migratability(&mut self) -> Result<()> {
        let c = &mut self.status.conditions;
        let migratable = api::conditions::LIVE_MIGRATABLE;
        match evacuation::migration_blocker(&self.ctx.client, self.vmi).await? {
            None => set_condition(c, migratable, true, None, None),
            Some(b) => set_condition(c, migratable, false, Some(b.reason), Some(b.message)),
        }
        Ok(())
    }

    /// The launcher Pod's PodDisruptionBudget, present while eviction must not take the Pod.
    async fn protect(&self, placed: bool) -> Result<()> {
        let default = self.ctx.settings().eviction_strategy;
        if EvictionStrategy::of(&self.vmi.spec, default) == EvictionStrategy::None {
            // Strategy None never has a budget, so those VMIs cost no request here.
            return Ok(());
        }
        let outcome = api::migratability::eviction_outcome(&self.vmi.spec, &self.status, default);
        let protect = placed && outcome.protects_pod();
        crate::disruption::sync(&self.ctx.client, self.vmi, &self.status, protect).await
    }
}

/// Writes labels (a guarded merge patch) and then status (PUT /status), each only if changed;
/// each write is noted in `unseen` as soon as it is made.
pub async fn write(
    vmis: &Api<VirtualMachineInstance>,
    vmi: &VirtualMachineInstance,
    labels: Option<BTreeMap<String, String>>,
    status: VirtualMachineInstanceStatus,
    unseen: &controller_runtime::UnseenWrites,
) -> Result<()> {
    let mut current = match labels {
        Some(l) => write_labels(vmis, vmi, &l).await?,
        None => vmi.clone(),
    };
    let labelled = current.resource_version() != vmi.resource_version();
    if labelled {
        unseen.wrote(vmi, &[]);
    }
    // The new status is compared with the one this round read, not with the label write's echo.
    current.status = vmi.status.clone();
    let written = write_status(vmis, &current, status).await?;
    if written.resource_version() != current.resource_version() {
        let between: Vec<String> = current
            .resource_version()
            .filter(|_| labelled)
            .into_iter()
            .collect();
        unseen.wrote(vmi, &between);
    }
    Ok(())
}
