//! Draining nodes of VMs, as KubeVirt's eviction webhook and evacuation controller do.
//!
//! A VMI is *marked* for evacuation by setting `status.evacuationNodeName` to the node it runs
//! on, either by the eviction webhook (`kubectl drain`, descheduler: see [`evict`]) or because
//! its node carries the drain taint ([`reconcile_node`]). A marked VMI whose strategy is to
//! migrate is then moved by a `kubevirt-evacuation-*` migration ([`evacuate`]), one at a time,
//! with an exponential pause after each failed attempt so that a migration that cannot succeed
//! does not loop. What eviction does per strategy and migratability is
//! [`api::migratability::EvictionStrategy::on_eviction`] (KubeVirt's table).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use api::conditions::published_migratability;
use api::migratability::{
    claim_of, eviction_outcome, live_migration_blocker, ClaimAccess, EvictionOutcome,
    EvictionStrategy, NotMigratable,
};
use api::{
    MigrationPhase, VirtualMachineInstance, VirtualMachineInstanceMigration,
    VirtualMachineInstanceStatus, VmiPhase,
};
use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim, Pod};
use kube::api::{Api, ListParams, PostParams};
use kube::runtime::controller::Action;
use kube::{Client, ResourceExt};

use crate::context::{Context, Error, Result};
use controller_runtime::time::{now_unix, parse_unix};
use controller_runtime::write_status;

/// How often a tainted node is looked at again (VMIs may land there through tolerations).
const TAINTED_NODE_RECHECK: Duration = Duration::from_secs(30);

/// Why the VMI cannot be live-migrated, deciding from its spec and the claims its volumes name
/// (read now: a claim's access modes decide whether the target node can open it).
pub async fn migration_blocker(
    client: &Client,
    vmi: &VirtualMachineInstance,
) -> Result<Option<NotMigratable>, kube::Error> {
    let pvcs: Api<PersistentVolumeClaim> =
        Api::namespaced(client.clone(), &vmi.namespace().unwrap_or_default());
    let mut access = BTreeMap::new();
    for claim in vmi.spec.volumes.iter().filter_map(claim_of) {
        if access.contains_key(claim) {
            continue;
        }
        let a = match pvcs.get_opt(claim).await? {
            None => ClaimAccess::Missing,
            Some(p) => {
                let modes = p.spec.and_then(|s| s.access_modes).unwrap_or_default();
                if modes.iter().any(|m| m == "ReadWriteMany") {
                    ClaimAccess::Shared
                } else {
                    ClaimAccess::NotShared
                }
            }
        };
        access.insert(claim.to_string(), a);
    }
    Ok(live_migration_blocker(&vmi.spec, vmi.annotations(), |c| {
        access.get(c).copied().unwrap_or(ClaimAccess::Missing)
    }))
}

/// Whether the VMI can migrate: its published condition, else decided now.
async fn is_migratable(client: &Client, vmi: &VirtualMachineInstance) -> Result<bool, kube::Error> {
    if let Some(published) = vmi.status.as_ref().and_then(published_migratability) {
        return Ok(published.is_ok());
    }
    Ok(migration_blocker(client, vmi).await?.is_none())
}

/// The eviction webhook's decision on evicting Pod `namespace/pod_name`: `None` lets it go,
/// `Some(message)` refuses it (429, so `kubectl drain` retries). A launcher Pod whose VMI
/// should move is refused after marking the VMI for evacuation.
pub async fn evict(
    client: &Client,
    cluster_default: EvictionStrategy,
    namespace: &str,
    pod_name: &str,
) -> Result<Option<String>, kube::Error> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let Some(pod) = pods.get_opt(pod_name).await? else {
        return Ok(None);
    };
    if pod.labels().get(api::labels::APP).map(String::as_str) != Some(api::labels::APP_LAUNCHER) {
        return Ok(None);
    }
    let Some(vmi_uid) = pod.labels().get(api::labels::CREATED_BY).cloned() else {
        return Ok(None);
    };
    let Some(owner) = pod.owner_references().iter().find(|r| r.uid == vmi_uid) else {
        return Ok(None);
    };
    let vmis: Api<VirtualMachineInstance> = Api::namespaced(client.clone(), namespace);
    let Some(mut vmi) = vmis.get_opt(&owner.name).await? else {
        return Ok(None);
    };
    let running = vmi.status.as_ref().and_then(|s| s.phase) == Some(VmiPhase::Running);
    let node = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    let on_node = vmi.status.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node.as_str());
    if !running || !on_node {
        // Not running a guest yet (or any more), or a migration's target Pod: nothing to move.
        return Ok(None);
    }
    let strategy = EvictionStrategy::of(&vmi.spec, cluster_default);
    let name = vmi.name_any();
    let outcome = strategy.on_eviction(is_migratable(client, &vmi).await?);
    let message = match outcome {
        EvictionOutcome::Evict => return Ok(None),
        EvictionOutcome::Refuse => {
            let why = vmi
                .status
                .as_ref()
                .and_then(published_migratability)
                .and_then(|r| r.err())
                .unwrap_or_else(|| "not migratable".into());
            return Ok(Some(format!(
                "VMI \"{namespace}/{name}\" has evictionStrategy LiveMigrate but cannot be \
                 live-migrated ({why}); its Pod is not evicted"
            )));
        }
        EvictionOutcome::Migrate => {
            format!("Eviction triggered evacuation of VMI \"{namespace}/{name}\" from node {node}")
        }
        EvictionOutcome::MarkOnly => format!(
            "VMI \"{namespace}/{name}\" has evictionStrategy External: marked for evacuation \
             from node {node} (status.evacuationNodeName) for its external controller"
        ),
    };
    let status = vmi.status.get_or_insert_with(Default::default);
    if status.evacuation_node_name.as_deref() != Some(node.as_str()) {
        status.evacuation_node_name = Some(node);
        vmis.replace_status(&name, &PostParams::default(), &vmi)
            .await?;
    }
    Ok(Some(message))
}

fn is_evacuation_of(m: &VirtualMachineInstanceMigration, vmi: &str, node: &str) -> bool {
    m.spec.vmi_name == vmi
        && m.annotations()
            .get(api::labels::ANNOTATION_EVACUATION)
            .map(String::as_str)
            == Some(node)
}

/// When the last failed migration ended, in unix seconds.
fn failed_at(m: &VirtualMachineInstanceMigration) -> Option<i64> {
    let s = m.status.as_ref()?;
    if s.phase != Some(MigrationPhase::Failed) {
        return None;
    }
    s.phase_transition_timestamps
        .iter()
        .rev()
        .find(|t| t.phase == "Failed")
        .and_then(|t| parse_unix(&t.phase_transition_timestamp))
}

/// How long to wait before the next evacuation attempt after `failures` failed ones.
pub fn retry_pause(base: Duration, failures: u32) -> Duration {
    if failures == 0 {
        return Duration::ZERO;
    }
    base.saturating_mul(1 << (failures - 1).min(16))
        .min(Duration::from_secs(300))
}

/// Live-migrates a Running VMI marked for evacuation from the node it runs on, when its
/// strategy says to. Returns how long to wait before trying again when a failed attempt is
/// pausing the next one.
pub async fn evacuate(
    vmi: &VirtualMachineInstance,
    status: &VirtualMachineInstanceStatus,
    ctx: &Context,
) -> Result<Option<Duration>> {
    let (Some(evac), Some(node)) = (&status.evacuation_node_name, &status.node_name) else {
        return Ok(None);
    };
    if evac != node {
        return Ok(None);
    }
    if eviction_outcome(&vmi.spec, status, ctx.settings().eviction_strategy)
        != EvictionOutcome::Migrate
    {
        return Ok(None);
    }
    let ns = vmi.namespace().unwrap_or_default();
    let name = vmi.name_any();
    let migrations: Api<VirtualMachineInstanceMigration> = Api::namespaced(ctx.client.clone(), &ns);
    let all = migrations.list(&ListParams::default()).await?.items;
    if VirtualMachineInstanceMigration::unfinished_of(&all, &name).is_some() {
        return Ok(None);
    }
    // The VMI this round started from may be a cached copy from before a migration that has
    // just ended moved it (a migration's VMI is written before the migration is marked
    // final); read it again after the migrations so that a finished evacuation is never
    // started twice.
    let vmis: Api<VirtualMachineInstance> = Api::namespaced(ctx.client.clone(), &ns);
    let fresh = vmis.get_opt(&name).await?.and_then(|v| v.status);
    let still_marked = fresh.is_some_and(|s| {
        s.evacuation_node_name.as_ref() == Some(node) && s.node_name.as_ref() == Some(node)
    });
    if !still_marked {
        return Ok(None);
    }
    let failed: Vec<i64> = all
        .iter()
        .filter(|m| is_evacuation_of(m, &name, node))
        .filter_map(failed_at)
        .collect();
    if let Some(last) = failed.iter().max() {
        let pause = retry_pause(ctx.config.evacuation_retry_base, failed.len() as u32);
        let due = last + pause.as_secs() as i64;
        let now = now_unix();
        if now < due {
            return Ok(Some(Duration::from_secs((due - now) as u64)));
        }
    }
    let mut m = VirtualMachineInstanceMigration::new(
        "",
        api::VirtualMachineInstanceMigrationSpec {
            vmi_name: name.clone(),
        },
    );
    m.metadata.name = None;
    m.metadata.generate_name = Some("kubevirt-evacuation-".into());
    m.metadata.namespace = Some(ns);
    m.metadata.annotations = Some(BTreeMap::from([(
        api::labels::ANNOTATION_EVACUATION.to_string(),
        node.clone(),
    )]));
    let created = migrations.create(&PostParams::default(), &m).await?;
    ctx.event(
        vmi,
        false,
        "EvacuationMigrationCreated",
        "Migrate",
        format!(
            "node {node} is being drained; created migration {}{}",
            created.name_any(),
            match failed.len() {
                0 => String::new(),
                n => format!(" (attempt {})", n + 1),
            }
        ),
    )
    .await;
    Ok(None)
}

/// The drain taint controller: every VMI on a node carrying the drain taint whose strategy
/// moves or marks it is marked for evacuation, as if its Pod had been evicted.
pub async fn reconcile_node(node: Arc<Node>, ctx: Arc<Context>) -> Result<Action> {
    let Some(key) = ctx.config.drain_taint_key.as_deref() else {
        return Ok(Action::await_change());
    };
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == key));
    if !tainted {
        return Ok(Action::await_change());
    }
    let name = node.name_any();
    let all: Api<VirtualMachineInstance> = Api::all(ctx.client.clone());
    let on_node = all
        .list(&ListParams::default().labels(&api::labels::selector(api::labels::NODE_NAME, &name)))
        .await?
        .items;
    for vmi in on_node {
        let status = vmi.status.clone().unwrap_or_default();
        if status.phase != Some(VmiPhase::Running)
            || status.node_name.as_deref() != Some(name.as_str())
            || status.evacuation_node_name.as_deref() == Some(name.as_str())
        {
            continue;
        }
        if !matches!(
            eviction_outcome(&vmi.spec, &status, ctx.settings().eviction_strategy),
            EvictionOutcome::Migrate | EvictionOutcome::MarkOnly
        ) {
            continue;
        }
        let mut marked = status;
        marked.evacuation_node_name = Some(name.clone());
        let vmis: Api<VirtualMachineInstance> =
            Api::namespaced(ctx.client.clone(), &vmi.namespace().unwrap_or_default());
        write_status(&vmis, &vmi, marked).await?;
        tracing::info!(vmi = %vmi.name_any(), node = %name, taint = key, "marked for evacuation");
    }
    Ok(Action::requeue(TAINTED_NODE_RECHECK))
}

pub fn node_error_policy(node: Arc<Node>, err: &Error, ctx: Arc<Context>) -> Action {
    ctx.retry("node", node.as_ref(), err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_pause_doubles_and_caps() {
        let b = Duration::from_secs(10);
        assert_eq!(retry_pause(b, 0), Duration::ZERO);
        assert_eq!(retry_pause(b, 1), b);
        assert_eq!(retry_pause(b, 3), Duration::from_secs(40));
        assert_eq!(retry_pause(b, 40), Duration::from_secs(300));
    }
}
