//! A PodDisruptionBudget per VMI whose Pod must not simply be evicted (KubeVirt's disruption
//! budget controller). The eviction webhook already refuses such evictions; the budget keeps
//! refusing them when the webhook is unreachable (its failurePolicy is Ignore, so that a
//! controller outage never blocks drains of ordinary Pods).
//!
//! The budget selects the VMI's Pods by `kubevirt.io/created-by` and asks for one available
//! Pod, two while a migration target exists (so neither end of a hand-off can be evicted). Its
//! name is derived from the VMI's uid, so a retried creation can never make a second one.

use std::collections::BTreeMap;

use api::{VirtualMachineInstance, VirtualMachineInstanceStatus};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::ResourceExt;

use crate::context::Result;
use controller_runtime::{controller_ref, delete_if_present, is_conflict};

/// The budget of the VMI with this uid.
pub fn budget_name(vmi_uid: &str) -> String {
    format!("kubevirt-disruption-budget-{vmi_uid}")
}

/// How many of the VMI's Pods must stay: two while a migration's target Pod exists.
pub fn min_available(status: &VirtualMachineInstanceStatus) -> i32 {
    let migrating = status.migration_state.as_ref().is_some_and(|m| {
        m.target_pod.is_some() && m.completed != Some(true) && m.failed != Some(true)
    });
    if migrating {
        2
    } else {
        1
    }
}

pub fn render(vmi: &VirtualMachineInstance, min: i32) -> PodDisruptionBudget {
    let uid = vmi.uid().unwrap_or_default();
    let labels = BTreeMap::from([(api::labels::CREATED_BY.to_string(), uid.clone())]);
    PodDisruptionBudget {
        metadata: kube::api::ObjectMeta {
            name: Some(budget_name(&uid)),
            namespace: vmi.namespace(),
            labels: Some(labels.clone()),
            owner_references: controller_ref(vmi).map(|r| vec![r]),
            ..Default::default()
        },
        spec: Some(PodDisruptionBudgetSpec {
            min_available: Some(IntOrString::Int(min)),
            selector: Some(LabelSelector {
                match_labels: Some(labels),
                ..Default::default()
            }),
            ..Default::default()
        }),
        status: None,
    }
}

/// Makes the VMI's budget match `wanted` (protect its Pods, with [`min_available`]) or removes
/// it.
pub async fn sync(
    client: &kube::Client,
    vmi: &VirtualMachineInstance,
    status: &VirtualMachineInstanceStatus,
    wanted: bool,
) -> Result<()> {
    let uid = vmi.uid().unwrap_or_default();
    let name = budget_name(&uid);
    let budgets: Api<PodDisruptionBudget> =
        Api::namespaced(client.clone(), &vmi.namespace().unwrap_or_default());
    if !wanted {
        return Ok(delete_if_present(&budgets, &name, &DeleteParams::default()).await?);
    }
    let min = min_available(status);
    match budgets.get_opt(&name).await? {
        None => match budgets
            .create(&PostParams::default(), &render(vmi, min))
            .await
        {
            Ok(_) => Ok(()),
            // Created by a round whose reply was lost; the next round sees it.
            Err(e) if is_conflict(&e) => Ok(()),
            Err(e) => Err(e.into()),
        },
        Some(b) => {
            let have = b.spec.as_ref().and_then(|s| s.min_available.clone());
            if have == Some(IntOrString::Int(min)) {
                return Ok(());
            }
            let p = serde_json::json!({
                "metadata": {"resourceVersion": b.resource_version()},
                "spec": {"minAvailable": min},
            });
            budgets
                .patch(&name, &PatchParams::default(), &Patch::Merge(&p))
                .await?;
            Ok(())
        }
    }
}
