//! The VirtualMachineInstanceReplicaSet controller: keeps `spec.replicas` VMIs that match the
//! selector, made from the template and controlled by the set. Finished VMIs are replaced; on
//! scale-down the VMIs that are not Running yet go first (newest first among equals), so running
//! guests are disturbed last. `status.replicas`, `readyReplicas` and `labelSelector` (for the
//! scale subresource and `kubectl scale`) follow what exists.

use std::sync::Arc;

use api::{VirtualMachineInstance, VirtualMachineInstanceReplicaSet, VmiPhase};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::runtime::controller::Action;
use kube::ResourceExt;

use crate::context::{Context, Error, Result};
use controller_runtime::{
    controlled_by, controller_ref, delete_if_present, remove_condition, set_condition, write_status,
};

const CONTROLLER: &str = "vmirs";

/// A LabelSelector in the `labelSelector=` query syntax.
pub fn selector_string(sel: &LabelSelector) -> String {
    let mut terms: Vec<String> = sel
        .match_labels
        .iter()
        .flatten()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    for e in sel.match_expressions.iter().flatten() {
        let values = e.values.clone().unwrap_or_default().join(",");
        terms.push(match e.operator.as_str() {
            "In" => format!("{} in ({values})", e.key),
            "NotIn" => format!("{} notin ({values})", e.key),
            "Exists" => e.key.clone(),
            _ => format!("!{}", e.key),
        });
    }
    terms.join(",")
}

pub async fn reconcile(
    rs: Arc<VirtualMachineInstanceReplicaSet>,
    ctx: Arc<Context>,
) -> Result<Action> {
    let started = std::time::Instant::now();
    let r = reconcile_inner(&rs, &ctx).await;
    ctx.metrics.observe_reconcile(CONTROLLER, started.elapsed());
    if r.is_ok() {
        ctx.succeeded(CONTROLLER, rs.as_ref());
    }
    r
}

pub fn error_policy(
    rs: Arc<VirtualMachineInstanceReplicaSet>,
    err: &Error,
    ctx: Arc<Context>,
) -> Action {
    ctx.retry(CONTROLLER, rs.as_ref(), err)
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

async fn reconcile_inner(rs: &VirtualMachineInstanceReplicaSet, ctx: &Context) -> Result<Action> {
    if rs.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change()); // its VMIs go by garbage collection
    }
    let ns = rs.namespace().unwrap_or_default();
    let sets: Api<VirtualMachineInstanceReplicaSet> = Api::namespaced(ctx.client.clone(), &ns);
    let vmis: Api<VirtualMachineInstance> = Api::namespaced(ctx.client.clone(), &ns);
    let mut status = rs.status.clone().unwrap_or_default();
    let selector = selector_string(&rs.spec.selector);
    status.label_selector = Some(selector.clone());

    if let Err(e) = api::validation::validate_vmirs(rs) {
        record_invalid_spec(ctx, rs, &mut status.conditions, e.to_string()).await;
        write_status(&sets, rs, status).await?;
        return Ok(Action::await_change());
    }

    let uid = rs.uid().unwrap_or_default();
    let owned: Vec<VirtualMachineInstance> = vmis
        .list(&ListParams::default().labels(&selector))
        .await?
        .items
        .into_iter()
        .filter(|v| controlled_by(v, &uid))
        .collect();
    let (finished, mut active): (Vec<_>, Vec<_>) = owned
        .into_iter()
        .filter(|v| v.metadata.deletion_timestamp.is_none())
        .partition(|v| {
            matches!(
                v.status.as_ref().and_then(|s| s.phase),
                Some(VmiPhase::Succeeded | VmiPhase::Failed)
            )
        });
    let ready = active
        .iter()
        .filter(|v| {
            v.status.as_ref().is_some_and(|s| {
                s.phase == Some(VmiPhase::Running)
                    && s.conditions
                        .iter()
                        .any(|c| c.type_ == api::conditions::READY && c.status == "True")
            })
        })
        .count();
    status.replicas = active.len() as i32;
    status.ready_replicas = ready as i32;

    if rs.spec.paused == Some(true) {
        set_condition(
            &mut status.conditions,
            api::conditions::REPLICA_PAUSED,
            true,
            Some("Paused"),
            None,
        );
        write_status(&sets, rs, status).await?;
        return Ok(Action::await_change());
    }
    remove_condition(&mut status.conditions, api::conditions::REPLICA_PAUSED);

    for v in &finished {
        delete_vmi(&vmis, v).await?;
    }
    let want = rs.spec.replicas.unwrap_or(1).max(0) as usize;
    let mut failure = None;
    if active.len() < want {
        for _ in active.len()..want {
            match vmis
                .create(&PostParams::default(), &vmi_from_template(rs))
                .await
            {
                Ok(v) => {
                    ctx.event(
                        rs,
                        false,
                        "SuccessfulCreate",
                        "Create",
                        format!("Created virtual machine instance {}", v.name_any()),
                    )
                    .await;
                }
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
    } else if active.len() > want {
        active.sort_by_key(deletion_rank);
        for v in &active[..active.len() - want] {
            delete_vmi(&vmis, v).await?;
            ctx.event(
                rs,
                false,
                "SuccessfulDelete",
                "Delete",
                format!("Deleted virtual machine instance {}", v.name_any()),
            )
            .await;
        }
    }
    record_create_failure(&mut status.conditions, failure.as_ref());
    write_status(&sets, rs, status).await?;
    match failure {
        Some(e) => Err(e.into()),
        None => Ok(Action::await_change()),
    }
}

/// A replica controller's (set, pool) condition for a spec it cannot act on: an Event the
/// first time, and `ReplicaFailure` with the message.
pub(crate) async fn record_invalid_spec<K>(
    ctx: &Context,
    obj: &K,
    conditions: &mut Vec<api::Condition>,
    msg: String,
) where
    K: kube::Resource<DynamicType = ()>,
{
    if !conditions
        .iter()
        .any(|c| c.type_ == api::conditions::REPLICA_FAILURE && c.message.as_ref() == Some(&msg))
    {
        ctx.event(obj, true, "FailedCreate", "Validate", msg.clone())
            .await;
    }
    set_condition(
        conditions,
        api::conditions::REPLICA_FAILURE,
        true,
        Some("InvalidSpec"),
        Some(msg),
    );
}

/// `ReplicaFailure` while creating replicas fails, cleared when it works again.
pub(crate) fn record_create_failure(
    conditions: &mut Vec<api::Condition>,
    failure: Option<&kube::Error>,
) {
    match failure {
        Some(e) => set_condition(
            conditions,
            api::conditions::REPLICA_FAILURE,
            true,
            Some("FailedCreate"),
            Some(e.to_string()),
        ),
        None => remove_condition(conditions, api::conditions::REPLICA_FAILURE),
    }
}

fn vmi_from_template(rs: &VirtualMachineInstanceReplicaSet) -> VirtualMachineInstance {
    let t = rs.spec.template.clone();
    let meta = t.metadata.unwrap_or_default();
    let mut spec = t.spec.unwrap_or_default();
    api::validation::default_vmi_spec(&mut spec);
    let mut vmi = VirtualMachineInstance::new("", spec);
    vmi.metadata.name = None;
    vmi.metadata.generate_name = Some(rs.name_any());
    vmi.metadata.namespace = rs.namespace();
    vmi.metadata.labels = meta.labels;
    vmi.metadata.annotations = meta.annotations;
    vmi.metadata.owner_references = controller_ref(rs).map(|r| vec![r]);
    vmi
}

async fn delete_vmi(vmis: &Api<VirtualMachineInstance>, v: &VirtualMachineInstance) -> Result<()> {
    Ok(delete_if_present(vmis, &v.name_any(), &DeleteParams::default()).await?)
}
