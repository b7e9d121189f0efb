//! The VirtualMachinePool controller (pool.kubevirt.io/v1beta1): keeps `spec.replicas`
//! VirtualMachines made from `virtualMachineTemplate`, named `<pool>-<ordinal>` with the lowest
//! free ordinals, controlled by the pool. On scale-down the VMs that are not ready go first,
//! then the highest ordinals, so ready VMs keep their names and are disturbed last (KubeVirt's
//! pool does the same). `status.replicas`, `readyReplicas` and `labelSelector` feed the scale
//! subresource (`kubectl scale vmpool`).

use std::collections::BTreeSet;
use std::sync::Arc;

use api::{VirtualMachine, VirtualMachinePool};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::runtime::controller::Action;
use kube::ResourceExt;

use crate::context::{Context, Error, Result};
use crate::replicaset::{record_create_failure, record_invalid_spec, selector_string};
use controller_runtime::{
    controlled_by, controller_ref, delete_if_present, remove_condition, set_condition, write_status,
};

const CONTROLLER: &str = "vmpool";

pub async fn reconcile(pool: Arc<VirtualMachinePool>, ctx: Arc<Context>) -> Result<Action> {
    let started = std::time::Instant::now();
    let r = reconcile_inner(&pool, &ctx).await;
    ctx.metrics.observe_reconcile(CONTROLLER, started.elapsed());
    if r.is_ok() {
        ctx.succeeded(CONTROLLER, pool.as_ref());
    }
    r
}

pub fn error_policy(pool: Arc<VirtualMachinePool>, err: &Error, ctx: Arc<Context>) -> Action {
    ctx.retry(CONTROLLER, pool.as_ref(), err)
}

/// The ordinal of a pool member's name (`<pool>-<n>`).
pub fn ordinal(pool: &str, vm: &str) -> Option<u32> {
    vm.strip_prefix(pool)?.strip_prefix('-')?.parse().ok()
}

/// Which surplus VMs go: not ready first, then the highest ordinal.
pub fn scale_down_order(pool: &str, vms: &mut [VirtualMachine]) {
    vms.sort_by_key(|v| {
        let ready = v.status.as_ref().and_then(|s| s.ready) == Some(true);
        (
            ready,
            std::cmp::Reverse(ordinal(pool, &v.name_any()).unwrap_or(u32::MAX)),
        )
    });
}

/// The pool's template as a VM named `<pool>-<n>`.
pub fn vm_for(pool: &VirtualMachinePool, n: u32) -> VirtualMachine {
    let mut vm = api::validation::pool_vm(pool, n);
    vm.metadata.owner_references = controller_ref(pool).map(|r| vec![r]);
    vm
}

/// KubeVirt's checks of a pool (`api::validation::validate_pool`), as one message.
pub fn validate(pool: &VirtualMachinePool) -> std::result::Result<(), String> {
    api::validation::validate_pool(pool).map_err(|e| e.to_string())
}

async fn reconcile_inner(pool: &VirtualMachinePool, ctx: &Context) -> Result<Action> {
    if pool.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change()); // its VMs go by garbage collection
    }
    let ns = pool.namespace().unwrap_or_default();
    let name = pool.name_any();
    let pools: Api<VirtualMachinePool> = Api::namespaced(ctx.client.clone(), &ns);
    let vms: Api<VirtualMachine> = Api::namespaced(ctx.client.clone(), &ns);
    let mut status = pool.status.clone().unwrap_or_default();
    let selector = selector_string(&pool.spec.selector);
    status.label_selector = Some(selector.clone());
    if let Err(msg) = validate(pool) {
        record_invalid_spec(ctx, pool, &mut status.conditions, msg).await;
        write_status(&pools, pool, status).await?;
        return Ok(Action::await_change());
    }
    let uid = pool.uid().unwrap_or_default();
    let mut active: Vec<VirtualMachine> = vms
        .list(&ListParams::default().labels(&selector))
        .await?
        .items
        .into_iter()
        .filter(|v| controlled_by(v, &uid) && v.metadata.deletion_timestamp.is_none())
        .collect();
    status.replicas = active.len() as i32;
    status.ready_replicas = active
        .iter()
        .filter(|v| v.status.as_ref().and_then(|s| s.ready) == Some(true))
        .count() as i32;
    if pool.spec.paused == Some(true) {
        set_condition(
            &mut status.conditions,
            api::conditions::REPLICA_PAUSED,
            true,
            Some("Paused"),
            None,
        );
        write_status(&pools, pool, status).await?;
        return Ok(Action::await_change());
    }
    remove_condition(&mut status.conditions, api::conditions::REPLICA_PAUSED);
    let want = pool.spec.replicas.unwrap_or(1).max(0) as usize;
    let mut failure = None;
    if active.len() < want {
        let used: BTreeSet<u32> = active
            .iter()
            .filter_map(|v| ordinal(&name, &v.name_any()))
            .collect();
        let free = (0..).filter(|n| !used.contains(n));
        for n in free.take(want - active.len()) {
            match vms.create(&PostParams::default(), &vm_for(pool, n)).await {
                Ok(v) => {
                    ctx.event(
                        pool,
                        false,
                        "SuccessfulCreate",
                        "Create",
                        format!("Created virtual machine {}", v.name_any()),
                    )
                    .await
                }
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
    } else if active.len() > want {
        scale_down_order(&name, &mut active);
        for v in &active[..active.len() - want] {
            delete_if_present(&vms, &v.name_any(), &DeleteParams::default()).await?;
            ctx.event(
                pool,
                false,
                "SuccessfulDelete",
                "Delete",
                format!("Deleted virtual machine {}", v.name_any()),
            )
            .await;
        }
    }
    record_create_failure(&mut status.conditions, failure.as_ref());
    write_status(&pools, pool, status).await?;
    match failure {
        Some(e) => Err(e.into()),
        None => Ok(Action::await_change()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_ready_first_then_the_highest_ordinals() {
        let vm = |n: &str, ready: bool| {
            let mut v = VirtualMachine::new(n, Default::default());
            v.status = Some(api::VirtualMachineStatus {
                ready: Some(ready),
                ..Default::default()
            });
            v
        };
        let mut vms = vec![
            vm("p-0", true),
            vm("p-1", false),
            vm("p-2", true),
            vm("p-10", true),
        ];
        scale_down_order("p", &mut vms);
        let names: Vec<String> = vms.iter().map(|v| v.name_any()).collect();
        assert_eq!(names, ["p-1", "p-10", "p-2", "p-0"]);
        assert_eq!(ordinal("p", "p-10"), Some(10));
        assert_eq!(ordinal("p", "px-1"), None);
    }
}
