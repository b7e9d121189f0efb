//! The VirtualMachineInstance controller: one launcher Pod per VMI and the VMI's phase from it.
//!
//! Phases: Pending (accepted) → Scheduling (Pod created, not yet running on a node) →
//! Scheduled (Pod running on a node: `status.nodeName`, label `kubevirt.io/nodeName`) →
//! Running (set by virt-handler once the guest runs) → Succeeded/Failed from the Pod's outcome.
//! The Pods a VMI runs in are `status.activePods` (Pod uid → node), so a migration target
//! Pod (which carries the same `kubevirt.io/created-by` label) is never mistaken for it.
//! A finalizer makes deleting a VMI delete its Pods with the VMI's grace period first: the
//! launcher turns SIGTERM into an ACPI-style guest shutdown (Ctrl-Alt-Del), so the guest is shut
//! down before the Pod goes.

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
use controller_runtime::{
    delete_if_present, finalizer_patch, has_finalizer, remove_condition, set_condition,
    write_labels, write_status,
};

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
/// server rather than a cache so that a Pod created a moment ago is never created twice.
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
            .publish(vmi, true, "ForeignPodIgnored", "Sync", note, related)
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

async fn reconcile_inner(vmi: &VirtualMachineInstance, ctx: &Context) -> Result<Action> {
    let ns = vmi.namespace().unwrap_or_default();
    let name = vmi.name_any();
    let vmis: Api<VirtualMachineInstance> = Api::namespaced(ctx.client.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);

    if vmi.metadata.deletion_timestamp.is_some() {
        let all = pods_of(&pods, vmi, ctx).await?;
        let grace = vmi
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
            delete_if_present(&pods, &p.name_any(), &dp).await?;
        }
        if all.is_empty() && has_finalizer(vmi, api::labels::VMI_FINALIZER) {
            let p = finalizer_patch(vmi, api::labels::VMI_FINALIZER, false);
            vmis.patch(&name, &PatchParams::default(), &Patch::Merge(&p))
                .await?;
        }
        return Ok(Action::await_change());
    }
    if !has_finalizer(vmi, api::labels::VMI_FINALIZER) {
        let p = finalizer_patch(vmi, api::labels::VMI_FINALIZER, true);
        vmis.patch(&name, &PatchParams::default(), &Patch::Merge(&p))
            .await?;
        return Ok(Action::await_change());
    }

    let mut status = vmi.status.clone().unwrap_or_default();
    let phase = status.phase;
    if matches!(phase, Some(VmiPhase::Succeeded | VmiPhase::Failed)) {
        return Ok(Action::await_change());
    }
    let admitted = api::validation::validate_vmi(vmi).and_then(|()| {
        ctx.config
            .pod
            .host_disks
            .check("VirtualMachineInstance", &vmi.metadata, &vmi.spec, "spec")
    });
    if let Err(e) = admitted {
        let msg = e.to_string();
        let known = status
            .conditions
            .iter()
            .any(|c| c.type_ == "Synchronized" && c.message.as_ref() == Some(&msg));
        if !known {
            ctx.event(vmi, true, "FailedCreate", "Validate", msg.clone())
                .await;
        }
        status.phase = Some(VmiPhase::Pending);
        set_condition(
            &mut status.conditions,
            "Synchronized",
            false,
            Some("FailedCreate"),
            Some(msg),
        );
        write(&vmis, vmi, None, status).await?;
        return Ok(Action::await_change());
    }
    // Only the controller's own verdict goes: virt-handler reports its sync with launchers
    // in the same condition type, with reasons of its own.
    status
        .conditions
        .retain(|c| !(c.type_ == "Synchronized" && c.reason.as_deref() == Some("FailedCreate")));

    let all = pods_of(&pods, vmi, ctx).await?;
    let active_uids: Vec<String> = status
        .active_pods
        .as_ref()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default();
    let mut pod = all
        .iter()
        .find(|p| p.uid().is_some_and(|u| active_uids.contains(&u)))
        .cloned();
    if pod.is_none() && active_uids.is_empty() {
        // A launcher Pod created by an earlier round whose status write was lost is adopted.
        pod = all
            .iter()
            .find(|p| !p.labels().contains_key(api::labels::MIGRATION_JOB))
            .cloned();
    }
    let mut labels = vmi.labels().clone();

    match (&pod, phase) {
        (None, None | Some(VmiPhase::Pending)) => {
            let rendered = crate::pod::render(vmi, &ctx.config.pod)?;
            let created = pods.create(&PostParams::default(), &rendered).await?;
            ctx.event(
                vmi,
                false,
                "SuccessfulCreate",
                "Create",
                format!("Created virtual machine pod {}", created.name_any()),
            )
            .await;
            status.phase = Some(VmiPhase::Scheduling);
            status.active_pods = Some(BTreeMap::from([(
                created.uid().unwrap_or_default(),
                String::new(),
            )]));
        }
        (None, _) => {
            status.phase = Some(VmiPhase::Failed);
            status.reason = Some("PodVanished".into());
            ctx.event(
                vmi,
                true,
                "PodVanished",
                "Sync",
                "the launcher Pod disappeared".into(),
            )
            .await;
        }
        (Some(p), _) => {
            let node = pod_node(p);
            status.active_pods = Some(BTreeMap::from([(
                p.uid().unwrap_or_default(),
                node.clone().unwrap_or_default(),
            )]));
            let unschedulable = pod_condition(p, "PodScheduled")
                .filter(|c| c.status == "False" && c.reason.as_deref() == Some("Unschedulable"));
            match unschedulable {
                Some(c) => set_condition(
                    &mut status.conditions,
                    "PodScheduled",
                    false,
                    Some("Unschedulable"),
                    c.message.clone(),
                ),
                None => remove_condition(&mut status.conditions, "PodScheduled"),
            }
            match pod_phase(p) {
                "Succeeded" => status.phase = Some(VmiPhase::Succeeded),
                "Failed" => {
                    status.phase = Some(VmiPhase::Failed);
                    status.reason = Some(termination_reason(p));
                }
                "Running"
                    if matches!(phase, None | Some(VmiPhase::Pending | VmiPhase::Scheduling)) =>
                {
                    if let Some(n) = &node {
                        status.phase = Some(VmiPhase::Scheduled);
                        status.node_name = Some(n.clone());
                    }
                }
                _ if phase.is_none() || phase == Some(VmiPhase::Pending) => {
                    status.phase = Some(VmiPhase::Scheduling)
                }
                _ => {}
            }
            if let Some(n) = &status.node_name {
                labels.insert(api::labels::NODE_NAME.into(), n.clone());
            }
            let ready = status.phase == Some(VmiPhase::Running)
                && pod_condition(p, "Ready").is_some_and(|c| c.status == "True");
            set_condition(
                &mut status.conditions,
                "Ready",
                ready,
                (!ready).then_some("PodNotReady"),
                None,
            );
        }
    }
    let placed = matches!(status.phase, Some(VmiPhase::Scheduled | VmiPhase::Running));
    if placed {
        match evacuation::migration_blocker(&ctx.client, vmi).await? {
            None => set_condition(
                &mut status.conditions,
                api::conditions::LIVE_MIGRATABLE,
                true,
                None,
                None,
            ),
            Some(b) => set_condition(
                &mut status.conditions,
                api::conditions::LIVE_MIGRATABLE,
                false,
                Some(b.reason),
                Some(b.message),
            ),
        }
    }
    let strategy = EvictionStrategy::of(&vmi.spec, ctx.config.default_eviction_strategy);
    if strategy != EvictionStrategy::None {
        // Strategy None never has a budget, so those VMIs cost no request here.
        let outcome = api::migratability::eviction_outcome(
            &vmi.spec,
            &status,
            ctx.config.default_eviction_strategy,
        );
        let protect = placed && outcome.protects_pod();
        crate::disruption::sync(&ctx.client, vmi, &status, protect).await?;
    }
    let mut action = Action::await_change();
    if status.phase == Some(VmiPhase::Running) {
        if let Some(pause) = evacuation::evacuate(vmi, &status, ctx).await? {
            action = Action::requeue(pause);
        }
    }
    let labels = (&labels != vmi.labels()).then_some(labels);
    write(&vmis, vmi, labels, status).await?;
    Ok(action)
}

/// Writes labels (a guarded merge patch) and then status (PUT /status), each only if changed.
pub async fn write(
    vmis: &Api<VirtualMachineInstance>,
    vmi: &VirtualMachineInstance,
    labels: Option<BTreeMap<String, String>>,
    status: VirtualMachineInstanceStatus,
) -> Result<()> {
    let mut current = match labels {
        Some(l) => write_labels(vmis, vmi, &l).await?,
        None => vmi.clone(),
    };
    // The new status is compared with the one this round read, not with the label write's echo.
    current.status = vmi.status.clone();
    write_status(vmis, &current, status).await?;
    Ok(())
}
