//! One replica controller for every kind that keeps `spec.replicas` copies of a template (the
//! VMI ReplicaSet, the VM pool): the kinds differ in what a member is, when it counts as ready
//! or finished, how new ones are named and which go first on scale-down; the reconcile —
//! validate, count, honour `paused`, replace finished members, scale up or down, report — is
//! the same and lives here once.

use std::fmt::Debug;
use std::sync::Arc;

use api::{ReplicaTarget, ReplicasStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::NamespaceResourceScope;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::core::object::{HasSpec, HasStatus};
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::context::{Context, Error, Result};
use controller_runtime::{
    controlled_by, delete_if_present, remove_condition, set_condition, write_status,
};

/// What a controller needs of an object's data: to copy, (de)serialize, log and share it.
pub trait ObjectData: Clone + Serialize + DeserializeOwned + Debug + Send + Sync + 'static {}
impl<K: Clone + Serialize + DeserializeOwned + Debug + Send + Sync + 'static> ObjectData for K {}

/// A namespaced object a controller can list, watch and write.
pub trait NamespacedObject:
    Resource<DynamicType = (), Scope = NamespaceResourceScope> + ObjectData
{
}
impl<K: Resource<DynamicType = (), Scope = NamespaceResourceScope> + ObjectData> NamespacedObject
    for K
{
}

/// What the replica controller needs to know about a kind that keeps replicas.
pub trait ReplicaOwner:
    NamespacedObject + HasStatus<Status = ReplicasStatus> + HasSpec<Spec: AsRef<ReplicaTarget>>
{
    type Member: NamespacedObject;
    /// The controller's name in metrics and backoff keys.
    const CONTROLLER: &'static str;
    /// What Events call a member ("virtual machine instance").
    const MEMBER: &'static str;

    /// How many members, which objects are members, and whether to act.
    fn target(&self) -> &ReplicaTarget {
        self.spec().as_ref()
    }
    /// KubeVirt's checks of the spec, as one message.
    fn validate(&self) -> std::result::Result<(), String>;
    fn is_ready(member: &Self::Member) -> bool;
    /// A member that has ended and is to be replaced (a VMI that Succeeded or Failed).
    fn has_finished(member: &Self::Member) -> bool;
    /// `count` new members to create beside `active`, with the cluster's settings as they
    /// are now.
    fn new_members(
        &self,
        active: &[Self::Member],
        count: usize,
        settings: &api::kubevirt::ClusterSettings,
    ) -> Vec<Self::Member>;
    /// Orders `active` so that the members to remove first come first.
    fn removal_order(&self, active: &mut [Self::Member]);
}

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

pub async fn reconcile<K: ReplicaOwner>(obj: Arc<K>, ctx: Arc<Context>) -> Result<Action> {
    let started = std::time::Instant::now();
    let r = reconcile_inner(obj.as_ref(), &ctx).await;
    ctx.metrics
        .observe_reconcile(K::CONTROLLER, started.elapsed());
    if r.is_ok() {
        ctx.succeeded(K::CONTROLLER, obj.as_ref());
    }
    r
}

pub fn error_policy<K: ReplicaOwner>(obj: Arc<K>, err: &Error, ctx: Arc<Context>) -> Action {
    ctx.retry(K::CONTROLLER, obj.as_ref(), err)
}

/// Where a replica owner stands, the first that applies.
#[derive(Debug)]
enum ReplicaPhase {
    /// Being deleted: its members go by garbage collection.
    Deleting,
    InvalidSpec(String),
    Paused,
    Scaling,
}

fn phase<K: ReplicaOwner>(obj: &K) -> ReplicaPhase {
    if obj.meta().deletion_timestamp.is_some() {
        return ReplicaPhase::Deleting;
    }
    if let Err(msg) = obj.validate() {
        return ReplicaPhase::InvalidSpec(msg);
    }
    if obj.target().paused == Some(true) {
        return ReplicaPhase::Paused;
    }
    ReplicaPhase::Scaling
}

async fn reconcile_inner<K: ReplicaOwner>(obj: &K, ctx: &Context) -> Result<Action> {
    let phase = phase(obj);
    let ns = obj.namespace().unwrap_or_default();
    let pass = Pass {
        obj,
        ctx,
        owners: Api::namespaced(ctx.client.clone(), &ns),
        members: Api::namespaced(ctx.client.clone(), &ns),
    };
    let mut status = obj.status().cloned().unwrap_or_default();
    let selector = selector_string(&obj.target().selector);
    status.label_selector = Some(selector.clone());
    match phase {
        ReplicaPhase::Deleting => Ok(Action::await_change()),
        ReplicaPhase::InvalidSpec(msg) => pass.invalid_spec(status, msg).await,
        ReplicaPhase::Paused => {
            let (_, active) = pass.members(&selector).await?;
            count::<K>(&mut status, &active);
            set_condition(
                &mut status.conditions,
                api::conditions::REPLICA_PAUSED,
                true,
                Some("Paused"),
                None,
            );
            write_status(&pass.owners, obj, status).await?;
            Ok(Action::await_change())
        }
        ReplicaPhase::Scaling => {
            let (finished, active) = pass.members(&selector).await?;
            count::<K>(&mut status, &active);
            remove_condition(&mut status.conditions, api::conditions::REPLICA_PAUSED);
            for m in &finished {
                pass.delete(m).await?;
            }
            pass.scale(status, active).await
        }
    }
}

fn count<K: ReplicaOwner>(status: &mut ReplicasStatus, active: &[K::Member]) {
    status.replicas = active.len() as i32;
    status.ready_replicas = active.iter().filter(|m| K::is_ready(m)).count() as i32;
}

/// One reconcile of one replica owner.
struct Pass<'a, K: ReplicaOwner> {
    obj: &'a K,
    ctx: &'a Context,
    owners: Api<K>,
    members: Api<K::Member>,
}

impl<K: ReplicaOwner> Pass<'_, K> {
    /// The members this owner controls, split into finished and active (neither being deleted).
    async fn members(&self, selector: &str) -> Result<(Vec<K::Member>, Vec<K::Member>)> {
        let uid = self.obj.uid().unwrap_or_default();
        Ok(self
            .members
            .list(&ListParams::default().labels(selector))
            .await?
            .items
            .into_iter()
            .filter(|m| controlled_by(m, &uid) && m.meta().deletion_timestamp.is_none())
            .partition(K::has_finished))
    }

    /// `ReplicaFailure` with the message, and an Event the first time.
    async fn invalid_spec(&self, mut status: ReplicasStatus, msg: String) -> Result<Action> {
        let reported = status.conditions.iter().any(|c| {
            c.type_ == api::conditions::REPLICA_FAILURE && c.message.as_ref() == Some(&msg)
        });
        if !reported {
            self.ctx
                .event(self.obj, true, "FailedCreate", "Validate", msg.clone())
                .await;
        }
        set_condition(
            &mut status.conditions,
            api::conditions::REPLICA_FAILURE,
            true,
            Some("InvalidSpec"),
            Some(msg),
        );
        write_status(&self.owners, self.obj, status).await?;
        Ok(Action::await_change())
    }

    /// Creates or removes members until `wanted` are active; a failed create stops the round
    /// and shows as `ReplicaFailure` until a create works again.
    async fn scale(
        &self,
        mut status: ReplicasStatus,
        mut active: Vec<K::Member>,
    ) -> Result<Action> {
        let want = self.obj.target().replicas.unwrap_or(1).max(0) as usize;
        let mut failure = None;
        if active.len() < want {
            let settings = self.ctx.settings();
            for m in self
                .obj
                .new_members(&active, want - active.len(), &settings)
            {
                match self.members.create(&PostParams::default(), &m).await {
                    Ok(m) => {
                        self.event("SuccessfulCreate", "Create", "Created", &m)
                            .await
                    }
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
            }
        } else if active.len() > want {
            self.obj.removal_order(&mut active);
            for m in &active[..active.len() - want] {
                self.delete(m).await?;
                self.event("SuccessfulDelete", "Delete", "Deleted", m).await;
            }
        }
        match &failure {
            Some(e) => set_condition(
                &mut status.conditions,
                api::conditions::REPLICA_FAILURE,
                true,
                Some("FailedCreate"),
                Some(e.to_string()),
            ),
            None => remove_condition(&mut status.conditions, api::conditions::REPLICA_FAILURE),
        }
        write_status(&self.owners, self.obj, status).await?;
        match failure {
            Some(e) => Err(e.into()),
            None => Ok(Action::await_change()),
        }
    }

    async fn delete(&self, m: &K::Member) -> Result<()> {
        Ok(delete_if_present(&self.members, &m.name_any(), &DeleteParams::default()).await?)
    }

    async fn event(&self, reason: &str, action: &str, verb: &str, m: &K::Member) {
        let note = format!("{verb} {} {}", K::MEMBER, m.name_any());
        self.ctx.event(self.obj, false, reason, action, note).await;
    }
}
