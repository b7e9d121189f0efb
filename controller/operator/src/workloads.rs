//! Running VMs after an upgrade: which VMIs still run in a launcher of an older release, and
//! moving them onto the new one as `spec.workloadUpdateStrategy` says — live migration
//! (the migration's target Pod is made by the new virt-controller, with the new launcher) or
//! eviction — in batches of `batchEvictionSize` at most every `batchEvictionInterval`, as
//! KubeVirt's workload updater does. A VMI that can do neither is left running and counted.

use std::time::Duration;

use api::kubevirt::KubeVirt;
use api::{
    VirtualMachineInstance, VirtualMachineInstanceMigration, VirtualMachineInstanceMigrationSpec,
    VmiPhase,
};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, EvictParams, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde::Deserialize;

use api::duration::parse_duration;

/// The annotation on the migrations the updater creates.
pub const WORKLOAD_UPDATE_ANNOTATION: &str = "kubevirt.io/workloadUpdateMigration";

/// `spec.workloadUpdateStrategy`, with KubeVirt's defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpdateStrategy {
    pub live_migrate: bool,
    pub evict: bool,
    pub batch_size: usize,
    pub batch_interval: Duration,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct StrategyFields {
    #[serde(default)]
    workload_update_methods: Vec<String>,
    batch_eviction_size: Option<i64>,
    batch_eviction_interval: Option<String>,
}

impl UpdateStrategy {
    /// The CR's strategy, or why it cannot be taken (by path).
    pub fn of(kv: &KubeVirt) -> Result<UpdateStrategy, String> {
        const PATH: &str = "spec.workloadUpdateStrategy";
        let fields: StrategyFields = match &kv.spec.workload_update_strategy {
            Some(v) => serde_json::from_value(v.clone()).map_err(|e| format!("{PATH}: {e}"))?,
            None => StrategyFields::default(),
        };
        let mut s = UpdateStrategy {
            live_migrate: false,
            evict: false,
            batch_size: 10,
            batch_interval: Duration::from_secs(60),
        };
        for m in &fields.workload_update_methods {
            match m.as_str() {
                "LiveMigrate" => s.live_migrate = true,
                "Evict" => s.evict = true,
                other => {
                    return Err(format!(
                        "{PATH}.workloadUpdateMethods: {other:?} is not a method; accepted: LiveMigrate, Evict"
                    ))
                }
            }
        }
        if let Some(n) = fields.batch_eviction_size {
            s.batch_size = usize::try_from(n)
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("{PATH}.batchEvictionSize: {n} is not a positive count"))?;
        }
        if let Some(d) = &fields.batch_eviction_interval {
            s.batch_interval = parse_duration(d).ok_or_else(|| {
                format!("{PATH}.batchEvictionInterval: {d:?} is not a duration like 1m or 30s")
            })?;
        }
        Ok(s)
    }
}

/// A running VMI and the launcher image its Pod runs.
pub struct Running {
    pub vmi: VirtualMachineInstance,
    pub image: Option<String>,
}

/// Every running VMI with the image of the launcher Pod it runs in (the Pod on its node).
pub async fn running(client: &Client) -> Result<Vec<Running>, kube::Error> {
    let vmis = Api::<VirtualMachineInstance>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    let pods = Api::<Pod>::all(client.clone())
        .list(&ListParams::default().labels(&format!(
            "{}={}",
            api::labels::APP,
            api::labels::APP_LAUNCHER
        )))
        .await?;
    let mut out = Vec::new();
    for vmi in vmis.items {
        let status = vmi.status.clone().unwrap_or_default();
        if status.phase != Some(VmiPhase::Running) {
            continue;
        }
        let uid = vmi.uid().unwrap_or_default();
        let image = pods
            .items
            .iter()
            .filter(|p| p.labels().get(api::labels::CREATED_BY) == Some(&uid))
            .find(|p| {
                p.spec.as_ref().and_then(|s| s.node_name.as_ref()) == status.node_name.as_ref()
            })
            .and_then(|p| {
                let spec = p.spec.as_ref()?;
                let compute = spec.containers.iter().find(|c| c.name == "compute")?;
                compute.image.clone()
            });
        out.push(Running { vmi, image });
    }
    Ok(out)
}

/// The running VMIs whose launcher is not `launcher_image`.
pub fn outdated<'a>(all: &'a [Running], launcher_image: &str) -> Vec<&'a VirtualMachineInstance> {
    all.iter()
        .filter(|r| r.image.as_deref().is_some_and(|i| i != launcher_image))
        .map(|r| &r.vmi)
        .collect()
}

/// Starts the next batch of updates: live migrations for the migratable (with
/// `LiveMigrate`), evictions of the others (with `Evict`), never more than a batch in flight.
/// Returns how many were started.
pub async fn update(
    client: &Client,
    strategy: &UpdateStrategy,
    outdated: &[&VirtualMachineInstance],
) -> Result<usize, kube::Error> {
    let migrations = Api::<VirtualMachineInstanceMigration>::all(client.clone())
        .list(&ListParams::default())
        .await?
        .items;
    let in_flight = migrations
        .iter()
        .filter(|m| m.annotations().contains_key(WORKLOAD_UPDATE_ANNOTATION) && m.is_unfinished())
        .count();
    let mut budget = strategy.batch_size.saturating_sub(in_flight);
    let mut started = 0;
    for vmi in outdated {
        if budget == 0 {
            break;
        }
        let ns = vmi.namespace().unwrap_or_default();
        let same_ns: Vec<_> = migrations
            .iter()
            .filter(|m| m.namespace().as_deref() == Some(ns.as_str()))
            .cloned()
            .collect();
        if VirtualMachineInstanceMigration::unfinished_of(&same_ns, &vmi.name_any()).is_some() {
            continue;
        }
        let status = vmi.status.clone().unwrap_or_default();
        let migratable = matches!(
            api::conditions::published_migratability(&status),
            Some(Ok(()))
        );
        if migratable && strategy.live_migrate {
            let mut m = VirtualMachineInstanceMigration::new(
                "",
                VirtualMachineInstanceMigrationSpec {
                    vmi_name: vmi.name_any(),
                },
            );
            m.metadata.name = None;
            m.metadata.generate_name =
                Some(format!("kubevirt-workload-update-{}-", vmi.name_any()));
            m.metadata.annotations =
                Some([(WORKLOAD_UPDATE_ANNOTATION.to_string(), String::new())].into());
            Api::<VirtualMachineInstanceMigration>::namespaced(client.clone(), &ns)
                .create(&PostParams::default(), &m)
                .await?;
        } else if strategy.evict {
            let Some(pod) = launcher_pod(client, vmi).await? else {
                continue;
            };
            Api::<Pod>::namespaced(client.clone(), &ns)
                .evict(&pod, &EvictParams::default())
                .await?;
        } else {
            continue;
        }
        tracing::info!(vmi = %vmi.name_any(), migratable, "moving a VMI onto the new launcher");
        budget -= 1;
        started += 1;
    }
    Ok(started)
}

/// The name of the launcher Pod a VMI runs in.
async fn launcher_pod(
    client: &Client,
    vmi: &VirtualMachineInstance,
) -> Result<Option<String>, kube::Error> {
    let ns = vmi.namespace().unwrap_or_default();
    let uid = vmi.uid().unwrap_or_default();
    let node = vmi.status.as_ref().and_then(|s| s.node_name.clone());
    let pods = Api::<Pod>::namespaced(client.clone(), &ns)
        .list(&ListParams::default().labels(&format!("{}={uid}", api::labels::CREATED_BY)))
        .await?;
    Ok(pods
        .items
        .into_iter()
        .find(|p| p.spec.as_ref().and_then(|s| s.node_name.clone()) == node)
        .map(|p| p.name_any()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strategy_with_defaults_and_refusals() {
        let kv = |v: serde_json::Value| {
            let mut kv = KubeVirt::new("kubevirt", Default::default());
            kv.spec.workload_update_strategy = Some(v);
            kv
        };
        let s = UpdateStrategy::of(&kv(serde_json::json!({}))).unwrap();
        assert_eq!((s.live_migrate, s.evict, s.batch_size), (false, false, 10));
        let s = UpdateStrategy::of(&kv(serde_json::json!({
            "workloadUpdateMethods": ["LiveMigrate"], "batchEvictionSize": 3,
            "batchEvictionInterval": "30s"
        })))
        .unwrap();
        assert!(s.live_migrate && !s.evict);
        assert_eq!(
            (s.batch_size, s.batch_interval),
            (3, Duration::from_secs(30))
        );
        for (bad, path) in [
            (
                serde_json::json!({"workloadUpdateMethods": ["Reboot"]}),
                "workloadUpdateMethods",
            ),
            (
                serde_json::json!({"batchEvictionSize": 0}),
                "batchEvictionSize",
            ),
            (
                serde_json::json!({"batchEvictionInterval": "soon"}),
                "batchEvictionInterval",
            ),
        ] {
            let err = UpdateStrategy::of(&kv(bad)).unwrap_err();
            assert!(err.contains(path), "{err}");
        }
    }
}
