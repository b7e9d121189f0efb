//! The VirtualMachineInstanceMigration controller.
//!
//! Phases: Pending (queued until the cluster and source-node limits allow it) → Scheduling
//! (target Pod created: same launcher, label `kubevirt.io/migrationJobUID`, required
//! anti-affinity on `kubevirt.io/created-by` over `kubernetes.io/hostname` so it lands on another
//! node) → Scheduled (target Pod bound) → PreparingTarget (target Pod running; the hand-off is
//! written to `vmi.status.migrationState` and the VMI is labelled
//! `kubevirt.io/migrationTargetNodeName`) → TargetReady (the target virt-handler set
//! `targetNodeAddress`) → Running (the source virt-handler set `startTimestamp`) → Succeeded
//! (`completed`: the VMI now lives in the target Pod and node, the source Pod is deleted) or
//! Failed (`failed`, target Pod lost, source lost, or the migration was deleted): the target Pod
//! is removed and the VMI keeps running on its source.
//!
//! Migrations reconcile in parallel, except admission (Pending → Scheduling), which is
//! serialized and counts admitted migrations from the API server, so the limits hold exactly
//! even when many migrations are created at once, and a slow request for one migration does not
//! hold up the others once they are admitted.

use std::collections::BTreeMap;
use std::sync::Arc;

use api::{
    MigrationConfiguration, MigrationPhase, MigrationPolicy, MigrationState, PhaseTransition,
    VirtualMachineInstance, VirtualMachineInstanceMigration, VirtualMachineInstanceMigrationStatus,
    VmiPhase,
};
use k8s_openapi::api::core::v1::{Affinity, Namespace, Pod, PodAffinityTerm, PodAntiAffinity};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::ResourceExt;

use crate::context::{Context, Error, Result};
use controller_runtime::time::now_rfc3339;
use controller_runtime::{
    delete_if_present, finalizer_patch, has_finalizer, set_condition, write_status,
};

const CONTROLLER: &str = "migration";

/// KubeVirt's defaults for what a MigrationPolicy may override.
pub fn default_configuration() -> MigrationConfiguration {
    MigrationConfiguration {
        bandwidth_per_migration: Some(Quantity("0Mi".into())),
        completion_timeout_per_gi_b: Some(150),
        allow_auto_converge: Some(false),
        allow_post_copy: Some(false),
        progress_timeout: Some(150),
        max_downtime_ms: Some(300),
    }
}

/// The policy that applies to a VMI, as KubeVirt picks it: every selector label must match
/// (VMI labels and namespace labels); the policy matching the most labels wins, ties by name.
pub fn matching_policy<'a>(
    policies: &'a [MigrationPolicy],
    vmi_labels: &BTreeMap<String, String>,
    ns_labels: &BTreeMap<String, String>,
) -> Option<&'a MigrationPolicy> {
    let subset = |want: &Option<BTreeMap<String, String>>, have: &BTreeMap<String, String>| {
        want.iter().flatten().all(|(k, v)| have.get(k) == Some(v))
    };
    let weight = |p: &MigrationPolicy| {
        p.spec
            .selectors
            .virtual_machine_instance_selector
            .as_ref()
            .map_or(0, |m| m.len())
            + p.spec
                .selectors
                .namespace_selector
                .as_ref()
                .map_or(0, |m| m.len())
    };
    let mut matching: Vec<&MigrationPolicy> = policies
        .iter()
        .filter(|p| {
            subset(
                &p.spec.selectors.virtual_machine_instance_selector,
                vmi_labels,
            ) && subset(&p.spec.selectors.namespace_selector, ns_labels)
        })
        .collect();
    matching.sort_by(|a, b| {
        weight(b)
            .cmp(&weight(a))
            .then(a.name_any().cmp(&b.name_any()))
    });
    matching.first().copied()
}

pub fn configuration(policy: Option<&MigrationPolicy>) -> MigrationConfiguration {
    let mut c = default_configuration();
    if let Some(p) = policy {
        let s = &p.spec;
        if s.bandwidth_per_migration.is_some() {
            c.bandwidth_per_migration = s.bandwidth_per_migration.clone();
        }
        if s.completion_timeout_per_gi_b.is_some() {
            c.completion_timeout_per_gi_b = s.completion_timeout_per_gi_b;
        }
        if s.allow_auto_converge.is_some() {
            c.allow_auto_converge = s.allow_auto_converge;
        }
        if s.allow_post_copy.is_some() {
            c.allow_post_copy = s.allow_post_copy;
        }
    }
    c
}

/// The target Pod: the VMI's launcher Pod, marked as this migration's and kept off the nodes
/// where the VMI already has a Pod.
pub fn target_pod(
    vmi: &VirtualMachineInstance,
    migration: &VirtualMachineInstanceMigration,
    cfg: &crate::pod::PodConfig,
) -> Result<Pod> {
    let mut pod = crate::pod::render(vmi, cfg)?;
    let uid = vmi.uid().unwrap_or_default();
    pod.metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert(
            api::labels::MIGRATION_JOB.into(),
            migration.uid().unwrap_or_default(),
        );
    let spec = pod.spec.get_or_insert_with(Default::default);
    let affinity = spec.affinity.get_or_insert_with(Affinity::default);
    let anti = affinity
        .pod_anti_affinity
        .get_or_insert_with(PodAntiAffinity::default);
    anti.required_during_scheduling_ignored_during_execution
        .get_or_insert_with(Vec::new)
        .push(PodAffinityTerm {
            label_selector: Some(LabelSelector {
                match_labels: Some(BTreeMap::from([(api::labels::CREATED_BY.to_string(), uid)])),
                ..Default::default()
            }),
            topology_key: "kubernetes.io/hostname".into(),
            ..Default::default()
        });
    Ok(pod)
}

pub async fn reconcile(
    m: Arc<VirtualMachineInstanceMigration>,
    ctx: Arc<Context>,
) -> Result<Action> {
    let started = std::time::Instant::now();
    let r = reconcile_inner(&m, &ctx).await;
    ctx.metrics.observe_reconcile(CONTROLLER, started.elapsed());
    if r.is_ok() {
        ctx.succeeded(CONTROLLER, m.as_ref());
    }
    r
}

pub fn error_policy(
    m: Arc<VirtualMachineInstanceMigration>,
    err: &Error,
    ctx: Arc<Context>,
) -> Action {
    ctx.retry(CONTROLLER, m.as_ref(), err)
}

struct Apis {
    migrations: Api<VirtualMachineInstanceMigration>,
    vmis: Api<VirtualMachineInstance>,
    pods: Api<Pod>,
}

async fn reconcile_inner(m: &VirtualMachineInstanceMigration, ctx: &Context) -> Result<Action> {
    let ns = m.namespace().unwrap_or_default();
    let apis = Apis {
        migrations: Api::namespaced(ctx.client.clone(), &ns),
        vmis: Api::namespaced(ctx.client.clone(), &ns),
        pods: Api::namespaced(ctx.client.clone(), &ns),
    };
    let name = m.name_any();
    let mut status = m.status.clone().unwrap_or_default();
    let phase = status.phase;
    let vmi = apis.vmis.get_opt(&m.spec.vmi_name).await?;

    if m.metadata.deletion_timestamp.is_some() {
        if !phase.is_some_and(MigrationPhase::is_final) {
            // Deleting an unfinished migration cancels it.
            fail(
                &apis,
                m,
                vmi.as_ref(),
                &mut status,
                "MigrationCanceled",
                "the migration was deleted (canceled)".into(),
                ctx,
            )
            .await?;
        }
        if has_finalizer(m, api::labels::MIGRATION_FINALIZER) {
            let p = finalizer_patch(m, api::labels::MIGRATION_FINALIZER, false);
            apis.migrations
                .patch(&name, &PatchParams::default(), &Patch::Merge(&p))
                .await?;
        }
        return Ok(Action::await_change());
    }
    if !has_finalizer(m, api::labels::MIGRATION_FINALIZER)
        && !phase.is_some_and(MigrationPhase::is_final)
    {
        let p = finalizer_patch(m, api::labels::MIGRATION_FINALIZER, true);
        apis.migrations
            .patch(&name, &PatchParams::default(), &Patch::Merge(&p))
            .await?;
        return Ok(Action::await_change());
    }
    if phase.is_some_and(MigrationPhase::is_final) {
        return Ok(Action::await_change());
    }
    if let Err(e) = api::validation::validate_migration(m) {
        fail(
            &apis,
            m,
            vmi.as_ref(),
            &mut status,
            "InvalidSpec",
            e.to_string(),
            ctx,
        )
        .await?;
        return Ok(Action::await_change());
    }
    let phase = phase.unwrap_or(MigrationPhase::Pending);
    let Some(vmi) = vmi.filter(|v| v.metadata.deletion_timestamp.is_none()) else {
        fail(
            &apis,
            m,
            None,
            &mut status,
            "VMINotFound",
            format!(
                "VirtualMachineInstance {} does not exist or is being deleted",
                m.spec.vmi_name
            ),
            ctx,
        )
        .await?;
        return Ok(Action::await_change());
    };
    let vstatus = vmi.status.clone().unwrap_or_default();
    if vstatus.phase != Some(VmiPhase::Running) {
        let why = format!(
            "VirtualMachineInstance {} is {:?}, not Running{}",
            vmi.name_any(),
            vstatus.phase.unwrap_or(VmiPhase::Pending),
            if phase == MigrationPhase::Pending {
                ""
            } else {
                " (the source was lost)"
            }
        );
        fail(&apis, m, Some(&vmi), &mut status, "VMINotRunning", why, ctx).await?;
        return Ok(Action::await_change());
    }
    if phase == MigrationPhase::Pending {
        if let Some(Err(why)) = api::conditions::published_migratability(&vstatus) {
            let why = format!(
                "VirtualMachineInstance {} cannot be live-migrated: {why}",
                vmi.name_any()
            );
            fail(
                &apis,
                m,
                Some(&vmi),
                &mut status,
                "VMINotMigratable",
                why,
                ctx,
            )
            .await?;
            return Ok(Action::await_change());
        }
    }
    let source_node = vstatus.node_name.clone().unwrap_or_default();
    let muid = m.uid().unwrap_or_default();
    let target = target_pods(&apis.pods, &muid, &vmi, ctx)
        .await?
        .into_iter()
        .next();

    if phase == MigrationPhase::Pending {
        // Admission is serialized (one reconcile at a time decides, and writes its decision
        // before the next looks) so the limits are exact; everything else runs in parallel.
        let _admission = ctx.migration_admission.lock().await;
        if let Some(wait) = queue_position(ctx, m, &vmi, &source_node).await? {
            if status.phase.is_none() {
                enter(&mut status, MigrationPhase::Pending);
                write_status(&apis.migrations, m, status).await?;
            }
            tracing::debug!(migration = %name, reason = %wait, "migration queued");
            return Ok(Action::requeue(ctx.config.migration_queue_recheck));
        }
        let ms = status.migration_state.get_or_insert_with(Default::default);
        ms.migration_uid = Some(muid.clone());
        ms.source_node = Some(source_node.clone());
        enter(&mut status, MigrationPhase::Scheduling);
        write_status(&apis.migrations, m, status).await?;
        return Ok(Action::await_change());
    }
    let recorded_target = status
        .migration_state
        .as_ref()
        .and_then(|s| s.target_pod.clone());
    if phase == MigrationPhase::Scheduling && target.is_none() && recorded_target.is_none() {
        // Admitted: make the target Pod (a retry after a lost write finds it by label above).
        let pod = apis
            .pods
            .create(
                &PostParams::default(),
                &target_pod(&vmi, m, &ctx.config.pod)?,
            )
            .await?;
        ctx.event(
            m,
            false,
            "SuccessfulCreate",
            "Migrate",
            format!("Created migration target pod {}", pod.name_any()),
        )
        .await;
        let ms = status.migration_state.get_or_insert_with(Default::default);
        ms.target_pod = Some(pod.name_any());
        write_status(&apis.migrations, m, status).await?;
        return Ok(Action::await_change());
    }
    if let (Some(t), None) = (&target, &recorded_target) {
        let ms = status.migration_state.get_or_insert_with(Default::default);
        ms.target_pod = Some(t.name_any());
    }

    // From here on the target Pod must exist and be healthy.
    let Some(target) = target.filter(|p| p.metadata.deletion_timestamp.is_none()) else {
        fail(
            &apis,
            m,
            Some(&vmi),
            &mut status,
            "TargetPodLost",
            "the migration target pod is gone".into(),
            ctx,
        )
        .await?;
        return Ok(Action::await_change());
    };
    let tphase = target
        .status
        .as_ref()
        .and_then(|s| s.phase.clone())
        .unwrap_or_default();
    if tphase == "Failed" || tphase == "Succeeded" {
        fail(
            &apis,
            m,
            Some(&vmi),
            &mut status,
            "TargetPodFailed",
            format!(
                "the migration target pod {} ended ({tphase})",
                target.name_any()
            ),
            ctx,
        )
        .await?;
        return Ok(Action::await_change());
    }
    let target_node = target
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .filter(|n| !n.is_empty());
    let vms = vstatus
        .migration_state
        .clone()
        .filter(|s| s.migration_uid.as_deref() == Some(&muid));

    match phase {
        MigrationPhase::Scheduling => {
            if let Some(node) = target_node {
                status
                    .migration_state
                    .get_or_insert_with(Default::default)
                    .target_node = Some(node);
                enter(&mut status, MigrationPhase::Scheduled);
                write_status(&apis.migrations, m, status).await?;
            }
        }
        MigrationPhase::Scheduled if tphase == "Running" => {
            let node = target_node.unwrap_or_default();
            let ns_labels = Api::<Namespace>::all(ctx.client.clone())
                .get_opt(&vmi.namespace().unwrap_or_default())
                .await?
                .map(|n| n.labels().clone())
                .unwrap_or_default();
            let policies = Api::<MigrationPolicy>::all(ctx.client.clone())
                .list(&ListParams::default())
                .await?
                .items;
            let policy = matching_policy(&policies, vmi.labels(), &ns_labels);
            let hand_off = MigrationState {
                migration_uid: Some(muid.clone()),
                source_node: Some(source_node.clone()),
                target_node: Some(node.clone()),
                target_pod: Some(target.name_any()),
                mode: Some(
                    if configuration(policy).allow_post_copy == Some(true) {
                        "PostCopy"
                    } else {
                        "PreCopy"
                    }
                    .into(),
                ),
                migration_configuration: Some(configuration(policy)),
                migration_policy_name: policy.map(|p| p.name_any()),
                ..Default::default()
            };
            let mut labels = vmi.labels().clone();
            labels.insert(api::labels::MIGRATION_TARGET_NODE.into(), node);
            let mut vstatus = vstatus.clone();
            vstatus.migration_state = Some(hand_off.clone());
            crate::vmi::write(&apis.vmis, &vmi, Some(labels), vstatus).await?;
            status.migration_state = Some(hand_off);
            enter(&mut status, MigrationPhase::PreparingTarget);
            write_status(&apis.migrations, m, status).await?;
        }
        MigrationPhase::PreparingTarget | MigrationPhase::TargetReady | MigrationPhase::Running => {
            let Some(vms) = vms else {
                fail(
                    &apis,
                    m,
                    Some(&vmi),
                    &mut status,
                    "HandOffLost",
                    "vmi.status.migrationState no longer describes this migration".into(),
                    ctx,
                )
                .await?;
                return Ok(Action::await_change());
            };
            if vms.failed == Some(true) {
                fail(
                    &apis,
                    m,
                    Some(&vmi),
                    &mut status,
                    "MigrationFailed",
                    "virt-handler reported the migration failed".into(),
                    ctx,
                )
                .await?;
                return Ok(Action::await_change());
            }
            if vms.completed == Some(true) {
                succeed(&apis, m, &vmi, &target, vms, &mut status, ctx).await?;
                return Ok(Action::await_change());
            }
            let next = if vms.start_timestamp.is_some() {
                MigrationPhase::Running
            } else if vms.target_node_address.is_some() {
                MigrationPhase::TargetReady
            } else {
                phase
            };
            if next != phase {
                status.migration_state = Some(vms);
                enter(&mut status, next);
                write_status(&apis.migrations, m, status).await?;
            }
        }
        _ => {}
    }
    Ok(Action::await_change())
}

/// None when the migration may start, or why it waits: at most
/// `parallel_migrations_per_cluster` in flight, `parallel_outbound_migrations_per_node` leaving
/// one node, one per VMI (earliest created first).
async fn queue_position(
    ctx: &Context,
    m: &VirtualMachineInstanceMigration,
    vmi: &VirtualMachineInstance,
    source_node: &str,
) -> Result<Option<String>> {
    let all = Api::<VirtualMachineInstanceMigration>::all(ctx.client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let uid = m.uid();
    let in_flight: Vec<&VirtualMachineInstanceMigration> = all
        .iter()
        .filter(|o| o.uid() != uid)
        .filter(|o| {
            let p = o.status.as_ref().and_then(|s| s.phase);
            !p.is_some_and(MigrationPhase::is_final)
                && p.is_some()
                && p != Some(MigrationPhase::Pending)
        })
        .collect();
    if in_flight
        .iter()
        .any(|o| o.spec.vmi_name == vmi.name_any() && o.namespace() == vmi.namespace())
    {
        return Ok(Some("another migration of this VMI is in progress".into()));
    }
    if in_flight.len() >= ctx.config.parallel_migrations_per_cluster {
        return Ok(Some(format!(
            "{} migrations are running in the cluster",
            in_flight.len()
        )));
    }
    let outbound = in_flight
        .iter()
        .filter(|o| {
            o.status
                .as_ref()
                .and_then(|s| s.migration_state.as_ref())
                .and_then(|s| s.source_node.as_deref())
                == Some(source_node)
        })
        .count();
    if outbound >= ctx.config.parallel_outbound_migrations_per_node {
        return Ok(Some(format!(
            "{outbound} migrations are leaving node {source_node}"
        )));
    }
    Ok(None)
}

fn enter(status: &mut VirtualMachineInstanceMigrationStatus, phase: MigrationPhase) {
    status.phase = Some(phase);
    status.phase_transition_timestamps.push(PhaseTransition {
        phase: format!("{phase:?}"),
        phase_transition_timestamp: now_rfc3339(),
    });
}

/// The VMI moves to the target: its Pod, node and labels; the source Pod is deleted (its
/// launcher has already handed the guest over).
async fn succeed(
    apis: &Apis,
    m: &VirtualMachineInstanceMigration,
    vmi: &VirtualMachineInstance,
    target: &Pod,
    mut vms: MigrationState,
    status: &mut VirtualMachineInstanceMigrationStatus,
    ctx: &Context,
) -> Result<()> {
    let target_node = vms.target_node.clone().unwrap_or_default();
    vms.end_timestamp.get_or_insert_with(now_rfc3339);
    let mut vstatus = vmi.status.clone().unwrap_or_default();
    let old_pods = vstatus.active_pods.clone().unwrap_or_default();
    vstatus.node_name = Some(target_node.clone());
    vstatus.active_pods = Some(BTreeMap::from([(
        target.uid().unwrap_or_default(),
        target_node.clone(),
    )]));
    vstatus.migration_state = Some(vms.clone());
    if vstatus.evacuation_node_name.is_some() {
        vstatus.evacuation_node_name = None;
    }
    let mut labels = vmi.labels().clone();
    labels.remove(api::labels::MIGRATION_TARGET_NODE);
    labels.insert(api::labels::NODE_NAME.into(), target_node.clone());
    crate::vmi::write(&apis.vmis, vmi, Some(labels), vstatus).await?;
    // Source Pods: the ones the VMI ran in before.
    for p in crate::vmi::pods_of(&apis.pods, vmi, ctx).await? {
        if p.uid().is_some_and(|u| old_pods.contains_key(&u)) {
            delete_pod(&apis.pods, &p.name_any()).await?;
        }
    }
    status.migration_state = Some(vms);
    set_condition(
        &mut status.conditions,
        "Succeeded",
        true,
        Some("MigrationSucceeded"),
        None,
    );
    enter(status, MigrationPhase::Succeeded);
    write_status(&apis.migrations, m, status.clone()).await?;
    ctx.event(
        m,
        false,
        "SuccessfulMigration",
        "Migrate",
        format!(
            "VirtualMachineInstance {} migrated to node {target_node}",
            vmi.name_any()
        ),
    )
    .await;
    Ok(())
}

/// Ends a migration as Failed: the target Pod is deleted, the VMI's hand-off is marked failed
/// and its target label removed; the VMI keeps running where it is.
async fn fail(
    apis: &Apis,
    m: &VirtualMachineInstanceMigration,
    vmi: Option<&VirtualMachineInstance>,
    status: &mut VirtualMachineInstanceMigrationStatus,
    reason: &str,
    message: String,
    ctx: &Context,
) -> Result<()> {
    let muid = m.uid().unwrap_or_default();
    // Without the VMI no Pod can be its: the garbage collector removes what it controlled.
    let targets = match vmi {
        Some(vmi) => target_pods(&apis.pods, &muid, vmi, ctx).await?,
        None => Vec::new(),
    };
    for p in targets
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
    {
        delete_pod(&apis.pods, &p.name_any()).await?;
    }
    if let Some(vmi) = vmi {
        let mut vstatus = vmi.status.clone().unwrap_or_default();
        if let Some(vms) = vstatus
            .migration_state
            .as_mut()
            .filter(|s| s.migration_uid.as_deref() == Some(&muid))
        {
            vms.failed = Some(true);
            vms.completed = Some(false);
            vms.end_timestamp.get_or_insert_with(now_rfc3339);
            if reason == "MigrationCanceled" {
                vms.abort_status = Some("Succeeded".into());
            }
        }
        let mut labels = vmi.labels().clone();
        labels.remove(api::labels::MIGRATION_TARGET_NODE);
        crate::vmi::write(&apis.vmis, vmi, Some(labels), vstatus).await?;
    }
    if let Some(ms) = status.migration_state.as_mut() {
        ms.failed = Some(true);
        ms.end_timestamp.get_or_insert_with(now_rfc3339);
    }
    set_condition(
        &mut status.conditions,
        "Failed",
        true,
        Some(reason),
        Some(message.clone()),
    );
    enter(status, MigrationPhase::Failed);
    write_status(&apis.migrations, m, status.clone()).await?;
    ctx.event(m, true, reason, "Migrate", message).await;
    Ok(())
}

async fn delete_pod(pods: &Api<Pod>, name: &str) -> Result<()> {
    Ok(delete_if_present(pods, name, &DeleteParams::default()).await?)
}

/// The target Pods of a migration (by its uid label) that the VMI controls, from the API
/// server: a Pod a tenant labelled with the uid is never taken as the target.
async fn target_pods(
    pods: &Api<Pod>,
    migration_uid: &str,
    vmi: &VirtualMachineInstance,
    ctx: &Context,
) -> Result<Vec<Pod>> {
    crate::vmi::owned_pods(pods, api::labels::MIGRATION_JOB, migration_uid, vmi, ctx).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use api::{MigrationPolicySpec, MigrationSelectors};

    fn policy(name: &str, vmi: &[(&str, &str)], ns: &[(&str, &str)], bw: &str) -> MigrationPolicy {
        let map = |l: &[(&str, &str)]| {
            (!l.is_empty()).then(|| {
                l.iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect()
            })
        };
        MigrationPolicy::new(
            name,
            MigrationPolicySpec {
                bandwidth_per_migration: Some(Quantity(bw.into())),
                selectors: MigrationSelectors {
                    virtual_machine_instance_selector: map(vmi),
                    namespace_selector: map(ns),
                },
                ..Default::default()
            },
        )
    }

    #[test]
    fn the_most_specific_matching_policy_wins() {
        let ps = vec![
            policy("a", &[("tier", "db")], &[], "10Mi"),
            policy("b", &[("tier", "db")], &[("env", "prod")], "20Mi"),
            policy("c", &[("tier", "web")], &[], "30Mi"),
        ];
        let l = |kv: &[(&str, &str)]| {
            kv.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>()
        };
        let pick = |vmi: &[(&str, &str)], ns: &[(&str, &str)]| {
            matching_policy(&ps, &l(vmi), &l(ns)).map(|p| p.name_any())
        };
        assert_eq!(
            pick(&[("tier", "db")], &[("env", "prod")]),
            Some("b".into())
        );
        assert_eq!(pick(&[("tier", "db")], &[]), Some("a".into()));
        assert_eq!(pick(&[("tier", "cache")], &[]), None);
        let c = configuration(matching_policy(&ps, &l(&[("tier", "web")]), &l(&[])));
        assert_eq!(c.bandwidth_per_migration, Some(Quantity("30Mi".into())));
        assert_eq!(c.completion_timeout_per_gi_b, Some(150));
    }
}
