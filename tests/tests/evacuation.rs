//! Draining nodes of VMs, against the in-process API server with the real controllers and the
//! webhook over HTTPS: the LiveMigratable condition from disks, claims and interfaces; migration
//! admission; KubeVirt's eviction table per strategy (with a cluster default); the disruption
//! budgets that back it; and evacuation through the drain taint, with pauses between failed
//! attempts.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use api::migratability::EvictionStrategy;
use api::{
    MigrationPhase, VirtualMachine, VirtualMachineInstance, VirtualMachineInstanceMigration,
};
use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::{json, Value};
use tests::admission::{eviction, review, start_webhook};
use tests::cluster::{eventually, test_config, Cluster};

const T: Duration = Duration::from_secs(20);

/// A VM with one disk from `volume` (a YAML flow mapping), an optional eviction strategy and a
/// masquerade pod-network interface.
fn vm(name: &str, strategy: Option<&str>, volume: &str) -> String {
    let strategy = strategy
        .map(|s| format!("      evictionStrategy: {s}\n"))
        .unwrap_or_default();
    format!(
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachine\nmetadata:\n  name: {name}\nspec:\n  runStrategy: Always\n  template:\n    spec:\n{strategy}      domain:\n        memory: {{guest: 32Mi}}\n        devices:\n          disks: [{{name: data}}]\n          interfaces: [{{name: default, masquerade: {{}}}}]\n      networks: [{{name: default, pod: {{}}}}]\n      volumes:\n      - {{name: data, {volume}}}\n"
    )
}

async fn claim(c: &Cluster, name: &str, mode: &str) {
    let pvc: PersistentVolumeClaim = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"accessModes": [mode], "resources": {"requests": {"storage": "1Gi"}}}
    }))
    .unwrap();
    c.api::<PersistentVolumeClaim>()
        .create(&PostParams::default(), &pvc)
        .await
        .unwrap();
}

/// The VMI's LiveMigratable condition once published: (status, reason, message).
async fn migratable(c: &Cluster, vmi: &str) -> (String, String, String) {
    eventually("the LiveMigratable condition", T, || async {
        let s = c.vmi(vmi).await.unwrap().status?;
        let cond = s.conditions.iter().find(|c| c.type_ == "LiveMigratable")?;
        Some((
            cond.status.clone(),
            cond.reason.clone().unwrap_or_default(),
            cond.message.clone().unwrap_or_default(),
        ))
    })
    .await
}

async fn migrations_of(c: &Cluster, vmi: &str) -> Vec<VirtualMachineInstanceMigration> {
    let mut all: Vec<_> = c
        .api::<VirtualMachineInstanceMigration>()
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|m| m.spec.vmi_name == vmi)
        .collect();
    all.sort_by_key(|m| {
        m.metadata
            .resource_version
            .clone()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    });
    all
}

fn migration(name: &str, vmi: &str) -> Value {
    json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstanceMigration",
           "metadata": {"name": name, "namespace": "default"}, "spec": {"vmiName": vmi}})
}

fn denial(resp: &Value) -> Option<String> {
    (resp["response"]["allowed"] == false).then(|| {
        resp["response"]["status"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    })
}

async fn budget(c: &Cluster, vmi: &VirtualMachineInstance) -> Option<PodDisruptionBudget> {
    let name = controller::disruption::budget_name(vmi.metadata.uid.as_deref().unwrap());
    c.api::<PodDisruptionBudget>().get_opt(&name).await.unwrap()
}

fn min_available(b: &PodDisruptionBudget) -> Option<i32> {
    match b.spec.as_ref()?.min_available.as_ref()? {
        IntOrString::Int(n) => Some(*n),
        IntOrString::String(_) => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_migratable_follows_claims_and_host_disks_and_gates_migrations() {
    let c = Cluster::start().await;
    let mut config = test_config();
    config.pod.host_disks = api::validation::HostDiskPolicy {
        feature_gate: true,
        allowed_prefixes: vec!["/var/lib/vm".into()],
    };
    let r = c.replica(config, None);
    let w = start_webhook(Some(c.controller_client()), EvictionStrategy::None).await;
    claim(&c, "shared", "ReadWriteMany").await;
    claim(&c, "local", "ReadWriteOnce").await;
    for (name, volume) in [
        ("rwx", "persistentVolumeClaim: {claimName: shared}"),
        ("rwo", "dataVolume: {name: local}"),
        ("host", "hostDisk: {path: /var/lib/vm/h.img, type: Disk}"),
        ("ghost", "persistentVolumeClaim: {claimName: nowhere}"),
    ] {
        c.apply_yaml::<VirtualMachine>(&vm(name, None, volume))
            .await;
        c.bring_up(name, "node-a").await;
    }
    assert_eq!(migratable(&c, "rwx").await.0, "True");
    let (status, reason, message) = migratable(&c, "rwo").await;
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "DisksNotLiveMigratable")
    );
    assert!(message.contains("\"local\" is not shared"), "{message}");
    let (status, _, message) = migratable(&c, "host").await;
    assert_eq!(status, "False");
    assert!(
        message.contains("hostDisk (/var/lib/vm/h.img)"),
        "{message}"
    );
    let (_, _, message) = migratable(&c, "ghost").await;
    assert!(message.contains("\"nowhere\" does not exist"), "{message}");

    // Admission: kubectl create of a migration is refused with the condition's reason...
    let create = |m: Value| {
        review(
            "VirtualMachineInstanceMigration",
            "virtualmachineinstancemigrations",
            "CREATE",
            m,
        )
    };
    let msg = denial(&w.post("/validate", &create(migration("m1", "rwo"))).await).unwrap();
    assert!(
        msg.contains("cannot be live-migrated: DisksNotLiveMigratable"),
        "{msg}"
    );
    let msg = denial(
        &w.post("/validate", &create(migration("m2", "absent")))
            .await,
    )
    .unwrap();
    assert!(msg.contains("\"absent\" does not exist"), "{msg}");
    assert_eq!(
        denial(&w.post("/validate", &create(migration("m3", "rwx"))).await),
        None
    );
    // ... and one that bypasses the webhook fails without ever making a target Pod.
    let m: VirtualMachineInstanceMigration =
        serde_json::from_value(migration("m1", "rwo")).unwrap();
    c.api::<VirtualMachineInstanceMigration>()
        .create(&PostParams::default(), &m)
        .await
        .unwrap();
    let failed = eventually("m1 Failed", T, || async {
        let m = c
            .api::<VirtualMachineInstanceMigration>()
            .get("m1")
            .await
            .unwrap();
        let s = m.status?;
        (s.phase == Some(MigrationPhase::Failed)).then_some(s)
    })
    .await;
    let cond = failed
        .conditions
        .iter()
        .find(|c| c.type_ == "Failed")
        .unwrap();
    assert_eq!(cond.reason.as_deref(), Some("VMINotMigratable"));
    let targets = c
        .api::<Pod>()
        .list(&ListParams::default().labels("kubevirt.io/migrationJobUID"))
        .await
        .unwrap()
        .items;
    assert!(targets.is_empty(), "no target Pod for a refused migration");

    // One migration per VMI at a time.
    let m: VirtualMachineInstanceMigration =
        serde_json::from_value(migration("m3", "rwx")).unwrap();
    c.api::<VirtualMachineInstanceMigration>()
        .create(&PostParams::default(), &m)
        .await
        .unwrap();
    let msg = denial(&w.post("/validate", &create(migration("m4", "rwx"))).await).unwrap();
    assert!(msg.contains("already being migrated by \"m3\""), "{msg}");
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_follows_the_strategy_table_with_budgets_behind_it() {
    let c = Cluster::start().await;
    let cluster_default = EvictionStrategy::LiveMigrateIfPossible;
    let mut config = test_config();
    config.default_eviction_strategy = cluster_default;
    let r = c.replica(config, None);
    let w = start_webhook(Some(c.controller_client()), cluster_default).await;
    claim(&c, "local", "ReadWriteOnce").await;
    let movable = "containerDisk: {image: quay.io/containerdisks/alpine:3.20}";
    let stuck = "persistentVolumeClaim: {claimName: local}";
    // (VM, strategy, volume, evicted?, marked?, migrated?, budget?)
    let cases = [
        ("none", Some("None"), movable, true, false, false, false),
        (
            "lm-stuck",
            Some("LiveMigrate"),
            stuck,
            false,
            false,
            false,
            true,
        ),
        (
            "ifp-stuck",
            Some("LiveMigrateIfPossible"),
            stuck,
            true,
            false,
            false,
            false,
        ),
        (
            "ifp",
            Some("LiveMigrateIfPossible"),
            movable,
            false,
            true,
            true,
            true,
        ),
        (
            "external",
            Some("External"),
            movable,
            false,
            true,
            false,
            true,
        ),
        ("default", None, movable, false, true, true, true),
    ];
    let mut pods = vec![];
    for (name, strategy, volume, ..) in &cases {
        c.apply_yaml::<VirtualMachine>(&vm(name, *strategy, volume))
            .await;
        let vmi = c.bring_up(name, "node-a").await;
        migratable(&c, name).await;
        pods.push(c.pods_of(&vmi).await.remove(0).metadata.name.unwrap());
    }
    for ((name, _, _, evicted, marked, migrated, budgeted), pod) in cases.iter().zip(&pods) {
        let vmi = c.vmi(name).await.unwrap();
        // The budget is there before anyone evicts: it protects the Pod when the webhook
        // cannot be reached.
        let b = if *budgeted {
            eventually(&format!("{name}'s budget"), T, || budget(&c, &vmi)).await
        } else {
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert!(budget(&c, &vmi).await.is_none(), "{name} has no budget");
            continue_eviction(&c, &w, name, pod, *evicted, *marked).await;
            assert!(migrations_of(&c, name).await.is_empty(), "{name}");
            continue;
        };
        assert_eq!(min_available(&b), Some(1), "{name}");
        let sel = b.spec.unwrap().selector.unwrap().match_labels.unwrap();
        assert_eq!(
            sel["kubevirt.io/created-by"],
            vmi.metadata.uid.clone().unwrap()
        );
        assert_eq!(
            b.metadata.owner_references.unwrap()[0].uid,
            vmi.metadata.uid.clone().unwrap()
        );
        continue_eviction(&c, &w, name, pod, *evicted, *marked).await;
        if *migrated {
            eventually(&format!("{name}'s evacuation migration"), T, || async {
                migrations_of(&c, name).await.into_iter().next()
            })
            .await;
        } else {
            tokio::time::sleep(Duration::from_millis(500)).await;
            assert!(
                migrations_of(&c, name).await.is_empty(),
                "{name} is not migrated"
            );
        }
    }
    // The VMI that blocks the drain is the one metric alerting would page about.
    let text = r.metrics.render();
    let stuck: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("kubevirt_vmi_non_evictable{"))
        .collect();
    assert_eq!(
        stuck,
        ["kubevirt_vmi_non_evictable{node=\"node-a\",namespace=\"default\",name=\"lm-stuck\"} 1"],
        "{text}"
    );
    r.stop().await;
}

/// Evicts `pod` through the webhook and checks the answer and the VMI's evacuation mark.
async fn continue_eviction(
    c: &Cluster,
    w: &tests::admission::Webhook,
    name: &str,
    pod: &str,
    evicted: bool,
    marked: bool,
) {
    let resp = w.post("/eviction", &eviction(pod)).await;
    let refused = denial(&resp);
    assert_eq!(refused.is_none(), evicted, "{name}: {resp}");
    if let Some(msg) = &refused {
        assert_eq!(resp["response"]["status"]["code"], 429, "{name}");
        if !marked {
            assert!(msg.contains("cannot be live-migrated"), "{name}: {msg}");
        }
        if name == "external" {
            assert!(msg.contains("evictionStrategy External"), "{msg}");
        }
    }
    let mark = c
        .vmi(name)
        .await
        .unwrap()
        .status
        .unwrap()
        .evacuation_node_name;
    assert_eq!(
        mark.is_some(),
        marked,
        "{name}: evacuationNodeName {mark:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budget_covers_both_pods_during_a_migration_and_goes_with_the_guest() {
    let c = Cluster::start().await;
    let r = c.replica(test_config(), None);
    c.apply_yaml::<VirtualMachine>(&vm(
        "guarded",
        Some("LiveMigrate"),
        "containerDisk: {image: quay.io/containerdisks/alpine:3.20}",
    ))
    .await;
    let vmi = c.bring_up("guarded", "node-a").await;
    let b = eventually("the budget", T, || budget(&c, &vmi)).await;
    assert_eq!(min_available(&b), Some(1));

    let m: VirtualMachineInstanceMigration =
        serde_json::from_value(migration("move", "guarded")).unwrap();
    let m = c
        .api::<VirtualMachineInstanceMigration>()
        .create(&PostParams::default(), &m)
        .await
        .unwrap();
    let muid = m.metadata.uid.unwrap();
    let target = c.target_pod(&muid).await;
    c.kubelet_run(target.metadata.name.as_deref().unwrap(), "node-b")
        .await;
    eventually("minAvailable 2 while both Pods exist", T, || async {
        let b = budget(&c, &vmi).await?;
        (min_available(&b) == Some(2)).then_some(())
    })
    .await;
    c.handler_complete_migration("guarded", &muid).await;
    eventually("minAvailable 1 after the hand-off", T, || async {
        let b = budget(&c, &vmi).await?;
        (min_available(&b) == Some(1)).then_some(())
    })
    .await;

    // Stopping the VM takes the budget away with the guest.
    c.api::<VirtualMachine>()
        .patch(
            "guarded",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"runStrategy": "Halted"}})),
        )
        .await
        .unwrap();
    eventually("the budget gone", T, || async {
        c.kubelet_finish_deletions().await;
        budget(&c, &vmi).await.is_none().then_some(())
    })
    .await;
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_taint_evacuates_and_failed_attempts_pause_before_retrying() {
    let c = Cluster::start().await;
    let mut config = test_config();
    config.evacuation_retry_base = Duration::from_secs(2);
    let r = c.replica(config, None);
    c.apply_yaml::<VirtualMachine>(&vm(
        "tenant",
        Some("LiveMigrate"),
        "containerDisk: {image: quay.io/containerdisks/alpine:3.20}",
    ))
    .await;
    c.apply_yaml::<VirtualMachine>(&vm(
        "bystander",
        None,
        "containerDisk: {image: quay.io/containerdisks/alpine:3.20}",
    ))
    .await;
    c.bring_up("tenant", "node-a").await;
    c.bring_up("bystander", "node-a").await;
    migratable(&c, "tenant").await;

    // An operator taints node-a for maintenance.
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"},
        "spec": {"taints": [{"key": "kubevirt.io/drain", "effect": "NoSchedule"}]}
    }))
    .unwrap();
    Api::<Node>::all(c.client.clone())
        .create(&PostParams::default(), &node)
        .await
        .unwrap();

    // Each evacuation attempt fails (its target Pod dies); the next waits 2 s, then 4 s.
    let mut failed_at: Vec<Instant> = vec![];
    for attempt in 0..3 {
        let m = eventually(
            &format!("evacuation attempt {}", attempt + 1),
            T,
            || async {
                let all = migrations_of(&c, "tenant").await;
                (all.len() == attempt + 1).then(|| all.last().cloned().unwrap())
            },
        )
        .await;
        let created = Instant::now();
        assert!(m
            .metadata
            .name
            .as_deref()
            .unwrap()
            .starts_with("kubevirt-evacuation-"));
        assert_eq!(
            m.metadata.annotations.as_ref().unwrap()["kubevirt.io/evacuationMigration"],
            "node-a"
        );
        if let Some(last) = failed_at.last() {
            // API timestamps have second resolution and this test polls, so the pause seen
            // here is base·2^(n-1) within about a second and a half.
            let pause = created.duration_since(*last);
            let want = Duration::from_secs(2 << (attempt - 1));
            assert!(
                pause + Duration::from_millis(1500) >= want
                    && pause <= want + Duration::from_secs(3),
                "attempt {} came {pause:?} after the failure, want about {want:?}",
                attempt + 1
            );
        }
        let muid = m.metadata.uid.clone().unwrap();
        let target = c.target_pod(&muid).await;
        let tname = target.metadata.name.clone().unwrap();
        if attempt == 2 {
            // The third attempt works.
            c.kubelet_run(&tname, "node-b").await;
            c.handler_complete_migration("tenant", &muid).await;
            break;
        }
        c.kubelet_run(&tname, "node-b").await;
        c.kubelet_exit(&tname, 1).await;
        eventually("the attempt failed", T, || async {
            let m = c
                .api::<VirtualMachineInstanceMigration>()
                .get(m.metadata.name.as_deref().unwrap())
                .await
                .unwrap();
            (m.status?.phase == Some(MigrationPhase::Failed)).then_some(())
        })
        .await;
        failed_at.push(Instant::now());
    }
    eventually("tenant on node-b, mark cleared", T, || async {
        let s = c.vmi("tenant").await.unwrap().status?;
        (s.node_name.as_deref() == Some("node-b") && s.evacuation_node_name.is_none()).then_some(())
    })
    .await;
    // The VMI without an eviction strategy stays (its Pod is evicted by the drain instead).
    let s = c.vmi("bystander").await.unwrap().status.unwrap();
    assert_eq!(s.evacuation_node_name, None);
    assert!(migrations_of(&c, "bystander").await.is_empty());
    assert_eq!(migrations_of(&c, "tenant").await.len(), 3);
    r.stop().await;
}

/// `kubectl drain` as it happens: the Eviction API on the launcher Pods, with the webhook
/// `deploy/webhook.yaml` registers called by the API server first and the disruption budgets
/// after. While the webhook is unreachable (failurePolicy Ignore), the budget alone keeps a
/// LiveMigrate VM's Pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_through_the_eviction_api_with_and_without_the_webhook() {
    let c = Cluster::start().await;
    let r = c.replica(test_config(), None);
    let w = std::sync::Arc::new(
        start_webhook(Some(c.controller_client()), EvictionStrategy::None).await,
    );
    // Registered as deploy/webhook.yaml registers it: the API server calls it.
    w.register(&c.api).await;
    let disk = "containerDisk: {image: quay.io/containerdisks/alpine:3.20}";
    let mut pods = BTreeMap::new();
    for (name, strategy) in [
        ("mover", Some("LiveMigrate")),
        ("plain", None),
        ("guarded", Some("LiveMigrate")),
    ] {
        c.apply_yaml::<VirtualMachine>(&vm(name, strategy, disk))
            .await;
        let vmi = c.bring_up(name, "node-a").await;
        if strategy.is_some() {
            eventually(&format!("{name}'s budget"), T, || budget(&c, &vmi)).await;
        }
        pods.insert(name, c.pods_of(&vmi).await.remove(0).metadata.name.unwrap());
    }
    let api_pods = c.api::<Pod>();
    // `kubectl drain` sees each 429 and retries on its own schedule; kube's client would
    // retry it silently.
    let mut config = kube::Config::new(c.api.url().parse().unwrap());
    config.default_retry = false;
    let drain_pods: Api<Pod> = Api::namespaced(kube::Client::try_from(config).unwrap(), "default");
    let evict = |pod: String| {
        let api_pods = drain_pods.clone();
        let api_pods = api_pods.clone();
        async move { api_pods.evict(&pod, &Default::default()).await }
    };

    // The plain VM's Pod goes (graceful deletion starts).
    evict(pods["plain"].clone())
        .await
        .expect("plain Pod evicted");
    let p = api_pods.get(&pods["plain"]).await.unwrap();
    assert!(p.metadata.deletion_timestamp.is_some());

    // The LiveMigrate VM's Pod: the webhook refuses with 429 and the VM migrates.
    match evict(pods["mover"].clone()).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 429, "{s:?}");
            assert!(s.message.contains("triggered evacuation"), "{}", s.message);
        }
        other => panic!("mover's eviction: {other:?}"),
    }
    eventually("mover's evacuation migration", T, || async {
        migrations_of(&c, "mover").await.into_iter().next()
    })
    .await;

    // With the webhook down (its Service's endpoint refuses connections), failurePolicy
    // Ignore admits and the budget refuses: the Pod stays, nothing is marked.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_addr = dead.local_addr().unwrap();
    drop(dead);
    c.api
        .set_service_endpoint("microvirt", "virt-controller-webhook", dead_addr);
    match evict(pods["guarded"].clone()).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 429, "{s:?}");
            assert!(s.message.contains("disruption budget"), "{}", s.message);
        }
        other => panic!("guarded's eviction: {other:?}"),
    }
    let p = api_pods.get(&pods["guarded"]).await.unwrap();
    assert!(
        p.metadata.deletion_timestamp.is_none(),
        "guarded's Pod kept"
    );
    let s = c.vmi("guarded").await.unwrap().status.unwrap();
    assert_eq!(s.evacuation_node_name, None);
    r.stop().await;
}
