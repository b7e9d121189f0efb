//! virt-controller's real kube-runtime controllers against the in-process API server over HTTP,
//! with the test standing in for the scheduler, the kubelet and virt-handler.

use std::time::Duration;

use api::{
    VirtualMachine, VirtualMachineInstance, VirtualMachineInstanceMigration,
    VirtualMachineInstanceReplicaSet, VmiPhase,
};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tests::cluster::{eventually, test_config, Cluster};

const T: Duration = Duration::from_secs(20);

fn vm_yaml(name: &str, strategy: &str) -> String {
    format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata:
  name: {name}
spec:
  runStrategy: {strategy}
  template:
    metadata:
      labels:
        app: {name}
    spec:
      evictionStrategy: LiveMigrate
      terminationGracePeriodSeconds: 5
      domain:
        cpu: {{cores: 1}}
        memory: {{guest: 64Mi}}
        devices:
          disks:
            - name: root
              disk: {{bus: virtio}}
      volumes:
        - name: root
          containerDisk: {{image: quay.io/containerdisks/alpine:3.20}}
"#
    )
}

async fn vmi_phase(c: &Cluster, name: &str) -> Option<VmiPhase> {
    c.vmi(name)
        .await
        .and_then(|v| v.status.and_then(|s| s.phase))
}

async fn vm_printable(c: &Cluster, name: &str) -> Option<String> {
    c.api::<VirtualMachine>()
        .get(name)
        .await
        .unwrap()
        .status
        .and_then(|s| s.printable_status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_to_vmi_to_pod_then_stop() {
    let c = Cluster::start().await;
    let r = c.replica(test_config(), None);
    c.apply_yaml::<VirtualMachine>(&vm_yaml("web", "Always"))
        .await;

    let vmi = eventually("the VMI", T, || async { c.vmi("web").await }).await;
    let vm = c.api::<VirtualMachine>().get("web").await.unwrap();
    let owner = &vmi.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(owner.uid, vm.metadata.uid.clone().unwrap());
    assert_eq!(owner.controller, Some(true));

    let pod = eventually("the launcher Pod", T, || async {
        c.pods_of(&vmi).await.into_iter().next()
    })
    .await;
    let labels = pod.metadata.labels.clone().unwrap();
    assert_eq!(labels["kubevirt.io"], "virt-launcher");
    assert_eq!(labels["vm.kubevirt.io/name"], "web");
    assert!(pod.metadata.generate_name.as_deref() == Some("virt-launcher-web-"));
    eventually("VMI Scheduling", T, || async {
        (vmi_phase(&c, "web").await == Some(VmiPhase::Scheduling)).then_some(())
    })
    .await;
    assert_eq!(vm_printable(&c, "web").await.as_deref(), Some("Starting"));

    // Unschedulable shows on the VM.
    c.scheduler_unschedulable(pod.metadata.name.as_deref().unwrap())
        .await;
    eventually("ErrorUnschedulable", T, || async {
        (vm_printable(&c, "web").await.as_deref() == Some("ErrorUnschedulable")).then_some(())
    })
    .await;

    c.kubelet_run(pod.metadata.name.as_deref().unwrap(), "node-a")
        .await;
    eventually("VMI Scheduled on node-a", T, || async {
        let v = c.vmi("web").await.unwrap();
        let s = v.status.clone()?;
        (s.phase == Some(VmiPhase::Scheduled)
            && s.node_name.as_deref() == Some("node-a")
            && v.metadata
                .labels
                .as_ref()?
                .get("kubevirt.io/nodeName")
                .map(String::as_str)
                == Some("node-a"))
        .then_some(())
    })
    .await;
    c.handler_running("web").await;
    eventually("VM Running and ready", T, || async {
        let vm = c.api::<VirtualMachine>().get("web").await.unwrap();
        let s = vm.status?;
        (s.printable_status.as_deref() == Some("Running") && s.ready == Some(true)).then_some(())
    })
    .await;
    // Only one launcher Pod was ever made.
    assert_eq!(c.pods_of(&vmi).await.len(), 1);

    // Stop: the VMI is deleted; its Pod is deleted gracefully; the VMI goes once the Pod has.
    c.api::<VirtualMachine>()
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"runStrategy": "Halted"}})),
        )
        .await
        .unwrap();
    eventually(
        "the Pod being deleted with the VMI's grace period",
        T,
        || async {
            let p = c
                .api::<Pod>()
                .get_opt(pod.metadata.name.as_deref().unwrap())
                .await
                .unwrap()?;
            (p.metadata.deletion_timestamp.is_some()
                && p.metadata.deletion_grace_period_seconds == Some(5))
            .then_some(())
        },
    )
    .await;
    eventually("VM Stopping", T, || async {
        (vm_printable(&c, "web").await.as_deref() == Some("Stopping")).then_some(())
    })
    .await;
    assert!(
        c.vmi("web").await.is_some(),
        "the finalizer keeps the VMI until its Pod is gone"
    );
    c.kubelet_finish_deletions().await;
    eventually("VMI gone, VM Stopped", T, || async {
        let gone = c.vmi("web").await.is_none();
        (gone && vm_printable(&c, "web").await.as_deref() == Some("Stopped")).then_some(())
    })
    .await;
    assert!(r.metrics.reconciles("vm") > 0 && r.metrics.reconciles("vmi") > 0);
    let text = r.metrics.render();
    assert!(
        text.contains("kubevirt_virt_controller_leading_status"),
        "{text}"
    );
    r.stop().await;
}

/// What `virtctl start|stop|restart` does: adds state change requests to the VM's status,
/// retrying when the controller wrote the status in between.
async fn virtctl(c: &Cluster, vm: &str, requests: Vec<api::StateChangeRequest>) {
    let vms = c.api::<VirtualMachine>();
    loop {
        let mut v = vms.get(vm).await.unwrap();
        v.status
            .get_or_insert_with(Default::default)
            .state_change_requests = requests.clone();
        match vms.replace_status(vm, &PostParams::default(), &v).await {
            Ok(_) => return,
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => panic!("{e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual_start_restart_and_halted() {
    let c = Cluster::start().await;
    let r = c.replica(test_config(), None);
    c.apply_yaml::<VirtualMachine>(&vm_yaml("m", "Manual"))
        .await;
    c.apply_yaml::<VirtualMachine>(&vm_yaml("h", "Halted"))
        .await;
    eventually("Manual VM Stopped", T, || async {
        (vm_printable(&c, "m").await.as_deref() == Some("Stopped")).then_some(())
    })
    .await;
    assert!(c.vmi("m").await.is_none());

    // virtctl start
    let vms = c.api::<VirtualMachine>();
    virtctl(
        &c,
        "m",
        vec![api::StateChangeRequest {
            action: "Start".into(),
            ..Default::default()
        }],
    )
    .await;
    let first = c.bring_up("m", "node-a").await;

    // virtctl restart: Stop (this VMI) + Start
    virtctl(
        &c,
        "m",
        vec![
            api::StateChangeRequest {
                action: "Stop".into(),
                uid: first.metadata.uid.clone(),
                ..Default::default()
            },
            api::StateChangeRequest {
                action: "Start".into(),
                ..Default::default()
            },
        ],
    )
    .await;
    eventually("the old Pod being deleted", T, || async {
        (c.kubelet_finish_deletions().await > 0).then_some(())
    })
    .await;
    let second = eventually("a new VMI", T, || async {
        let v = c.vmi("m").await?;
        (v.metadata.uid != first.metadata.uid).then_some(v)
    })
    .await;
    assert!(second.metadata.deletion_timestamp.is_none());
    eventually("requests consumed", T, || async {
        let s = vms.get("m").await.unwrap().status?;
        s.state_change_requests.is_empty().then_some(())
    })
    .await;
    // The Halted VM never got a VMI.
    assert!(c.vmi("h").await.is_none());
    assert_eq!(vm_printable(&c, "h").await.as_deref(), Some("Stopped"));
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rerun_on_failure_backs_off_then_restarts() {
    let c = Cluster::start().await;
    let r = c.replica(test_config(), None);
    c.apply_yaml::<VirtualMachine>(&vm_yaml("crashy", "RerunOnFailure"))
        .await;
    let first = c.bring_up("crashy", "node-a").await;
    let pod = c.pods_of(&first).await.remove(0);
    c.kubelet_exit(pod.metadata.name.as_deref().unwrap(), 12)
        .await;
    let failed_at = std::time::Instant::now();
    eventually("CrashLoopBackOff", T, || async {
        let s = c
            .api::<VirtualMachine>()
            .get("crashy")
            .await
            .unwrap()
            .status?;
        let f = s.start_failure.as_ref()?;
        (s.printable_status.as_deref() == Some("CrashLoopBackOff") && f.consecutive_fail_count == 1)
            .then_some(())
    })
    .await;
    // The failed VMI carries the launcher's exit code as its reason before it is cleared.
    let second = eventually(
        "a new VMI after the backoff",
        Duration::from_secs(30),
        || async {
            let v = c.vmi("crashy").await?;
            (v.metadata.uid != first.metadata.uid).then_some(v)
        },
    )
    .await;
    let waited = failed_at.elapsed();
    assert!(
        waited >= Duration::from_secs(9),
        "restarted after {waited:?}, before the 10 s backoff"
    );
    assert!(second.metadata.deletion_timestamp.is_none());
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_vm_is_never_half_reconciled() {
    let c = Cluster::start().await;
    let r = c.replica(test_config(), None);
    let bad = vm_yaml("bad", "Always").replace("guest: 64Mi", "guest: 64Zi");
    c.apply_yaml::<VirtualMachine>(&bad).await;
    let msg = eventually("a Failure condition", T, || async {
        let s = c.api::<VirtualMachine>().get("bad").await.unwrap().status?;
        s.conditions
            .iter()
            .find(|c| c.type_ == "Failure" && c.status == "True")
            .and_then(|c| c.message.clone())
    })
    .await;
    let expected =
        api::validation::validate_vm(&c.api::<VirtualMachine>().get("bad").await.unwrap())
            .unwrap_err()
            .to_string();
    assert_eq!(msg, expected);
    assert!(
        msg.contains("spec.template.spec.domain.memory.guest"),
        "{msg}"
    );
    let events = c.api.objects("events");
    assert!(
        events.iter().any(|e| e["reason"] == "InvalidSpec"),
        "an Event is recorded: {events:?}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(c.vmi("bad").await.is_none());
    assert!(c.api.objects("pods").is_empty());
    r.stop().await;
}

fn rs_yaml(replicas: i32) -> String {
    format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstanceReplicaSet
metadata:
  name: fleet
spec:
  replicas: {replicas}
  selector:
    matchLabels:
      app: fleet
  template:
    metadata:
      labels:
        app: fleet
    spec:
      domain:
        memory: {{guest: 32Mi}}
        devices: {{}}
"#
    )
}

async fn fleet(c: &Cluster) -> Vec<VirtualMachineInstance> {
    c.api::<VirtualMachineInstance>()
        .list(&ListParams::default().labels("app=fleet"))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|v| v.metadata.deletion_timestamp.is_none())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicaset_scales_up_and_down_keeping_running_vmis() {
    let c = Cluster::start().await;
    let r = c.replica(test_config(), None);
    c.apply_yaml::<VirtualMachineInstanceReplicaSet>(&rs_yaml(3))
        .await;
    let vmis = eventually("3 VMIs", T, || async {
        let f = fleet(&c).await;
        (f.len() == 3).then_some(f)
    })
    .await;
    assert!(vmis
        .iter()
        .all(|v| v.metadata.name.as_deref().unwrap().starts_with("fleet")));
    // One runs.
    let keep = vmis[1].metadata.name.clone().unwrap();
    c.bring_up(&keep, "node-a").await;
    eventually("status replicas 3, ready 1", T, || async {
        let s = c
            .api::<VirtualMachineInstanceReplicaSet>()
            .get("fleet")
            .await
            .unwrap()
            .status?;
        (s.replicas == 3
            && s.ready_replicas == 1
            && s.label_selector.as_deref() == Some("app=fleet"))
        .then_some(())
    })
    .await;

    // kubectl scale --replicas=1 (the scale subresource)
    let sets = c.api::<VirtualMachineInstanceReplicaSet>();
    let scale = sets.get_scale("fleet").await.unwrap();
    assert_eq!(scale.spec.as_ref().unwrap().replicas, Some(3));
    sets.patch_scale(
        "fleet",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"replicas": 1}})),
    )
    .await
    .unwrap();
    let left = eventually("1 VMI", T, || async {
        let f = fleet(&c).await;
        (f.len() == 1).then_some(f)
    })
    .await;
    assert_eq!(
        left[0].metadata.name.as_deref(),
        Some(keep.as_str()),
        "the Running VMI is kept"
    );

    // Scale up again; a finished VMI is replaced.
    sets.patch_scale(
        "fleet",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"replicas": 2}})),
    )
    .await
    .unwrap();
    eventually("2 VMIs", T, || async {
        (fleet(&c).await.len() == 2).then_some(())
    })
    .await;
    let pod = c.pods_of(&left[0]).await.remove(0);
    c.kubelet_exit(pod.metadata.name.as_deref().unwrap(), 1)
        .await;
    eventually("the failed VMI replaced", T, || async {
        let f = fleet(&c).await;
        (f.len() == 2
            && f.iter()
                .all(|v| v.metadata.name.as_deref() != Some(keep.as_str())))
        .then_some(())
    })
    .await;
    r.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Migrations

fn migration_yaml(name: &str, vmi: &str) -> String {
    format!("apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstanceMigration\nmetadata:\n  name: {name}\nspec:\n  vmiName: {vmi}\n")
}

async fn migration_phase(c: &Cluster, name: &str) -> Option<api::MigrationPhase> {
    c.api::<VirtualMachineInstanceMigration>()
        .get_opt(name)
        .await
        .unwrap()
        .and_then(|m| m.status.and_then(|s| s.phase))
}

async fn wait_migration(c: &Cluster, name: &str, phase: api::MigrationPhase) {
    eventually(&format!("migration {name} {phase:?}"), T, || async {
        (migration_phase(c, name).await == Some(phase)).then_some(())
    })
    .await;
}

async fn target_pod(c: &Cluster, migration: &str) -> Pod {
    let uid = c
        .api::<VirtualMachineInstanceMigration>()
        .get(migration)
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap();
    c.target_pod(&uid).await
}

/// The migration settings the VMI's next migration is given, once its target Pod runs.
async fn migration_settings(c: &Cluster, vm: &str, migration: &str) -> api::MigrationConfiguration {
    c.apply_yaml::<VirtualMachineInstanceMigration>(&migration_yaml(migration, vm))
        .await;
    let target = target_pod(c, migration).await;
    c.kubelet_run(target.metadata.name.as_deref().unwrap(), "node-b")
        .await;
    wait_migration(c, migration, api::MigrationPhase::PreparingTarget).await;
    let v = c.vmi(vm).await.unwrap();
    let ms = v.status.unwrap().migration_state.unwrap();
    ms.migration_configuration.unwrap()
}

/// The KubeVirt CR's `spec.configuration` is the cluster's configuration, followed live: an
/// edit reaches the next migration with no restart, an invalid one is refused and the last
/// valid settings stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_follow_the_kubevirt_configuration_live() {
    let c = Cluster::start().await;
    let r = c.replica(test_config(), None);
    let kv_yaml = |bandwidth: &str| {
        format!("apiVersion: kubevirt.io/v1\nkind: KubeVirt\nmetadata:\n  name: kubevirt\n  namespace: microvirt\nspec:\n  configuration:\n    migrations:\n      bandwidthPerMigration: {bandwidth}\n      completionTimeoutPerGiB: 40\n")
    };
    let kvs = kube::Api::<api::kubevirt::KubeVirt>::namespaced(c.client.clone(), "microvirt");
    let apply = |yaml: String| {
        let kvs = kvs.clone();
        async move {
            let kv: api::kubevirt::KubeVirt = serde_yaml::from_str(&yaml).unwrap();
            kvs.patch(
                "kubevirt",
                &kube::api::PatchParams::apply("test").force(),
                &kube::api::Patch::Apply(&kv),
            )
            .await
            .unwrap();
        }
    };
    // On two nodes: a node lets two migrations leave at once.
    for (vm, node) in [("a", "node-a"), ("b", "node-a"), ("d", "node-c")] {
        c.apply_yaml::<VirtualMachine>(&vm_yaml(vm, "Always")).await;
        c.bring_up(vm, node).await;
    }
    apply(kv_yaml("64Mi")).await;
    // The settings reach the controller through its watch (milliseconds here).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let first = migration_settings(&c, "a", "mig-a").await;
    assert_eq!(first.bandwidth_per_migration.unwrap().0, "64Mi");
    assert_eq!(first.completion_timeout_per_gi_b, Some(40));

    apply(kv_yaml("128Mi")).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let second = migration_settings(&c, "b", "mig-b").await;
    assert_eq!(second.bandwidth_per_migration.unwrap().0, "128Mi");

    // Not a quantity: refused whole; the last valid settings stay.
    apply(kv_yaml("fast")).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let third = migration_settings(&c, "d", "mig-d").await;
    assert_eq!(third.bandwidth_per_migration.unwrap().0, "128Mi");
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_happy_path() {
    let c = Cluster::start().await;
    let r = c.replica(test_config(), None);
    let policy: api::MigrationPolicy = serde_yaml::from_str(
        "apiVersion: migrations.kubevirt.io/v1alpha1\nkind: MigrationPolicy\nmetadata:\n  name: fast\nspec:\n  bandwidthPerMigration: 1Gi\n  allowAutoConverge: true\n  selectors:\n    virtualMachineInstanceSelector:\n      app: db\n",
    )
    .unwrap();
    kube::Api::<api::MigrationPolicy>::all(c.client.clone())
        .create(&PostParams::default(), &policy)
        .await
        .unwrap();
    c.apply_yaml::<VirtualMachine>(&vm_yaml("db", "Always"))
        .await;
    let vmi = c.bring_up("db", "node-a").await;
    let source = c.pods_of(&vmi).await.remove(0);
    c.apply_yaml::<VirtualMachineInstanceMigration>(&migration_yaml("mig", "db"))
        .await;

    let target = target_pod(&c, "mig").await;
    wait_migration(&c, "mig", api::MigrationPhase::Scheduling).await;
    let anti = target
        .spec
        .as_ref()
        .unwrap()
        .affinity
        .as_ref()
        .unwrap()
        .pod_anti_affinity
        .as_ref()
        .unwrap();
    let term = &anti
        .required_during_scheduling_ignored_during_execution
        .as_ref()
        .unwrap()[0];
    assert_eq!(term.topology_key, "kubernetes.io/hostname");
    assert_eq!(
        term.label_selector
            .as_ref()
            .unwrap()
            .match_labels
            .as_ref()
            .unwrap()["kubevirt.io/created-by"],
        vmi.metadata.uid.clone().unwrap()
    );
    eventually("VM Running", T, || async {
        (vm_printable(&c, "db").await.as_deref() == Some("Running")).then_some(())
    })
    .await;

    c.kubelet_run(target.metadata.name.as_deref().unwrap(), "node-b")
        .await;
    wait_migration(&c, "mig", api::MigrationPhase::PreparingTarget).await;
    let v = c.vmi("db").await.unwrap();
    let ms = v.status.as_ref().unwrap().migration_state.clone().unwrap();
    assert_eq!(ms.source_node.as_deref(), Some("node-a"));
    assert_eq!(ms.target_node.as_deref(), Some("node-b"));
    assert_eq!(ms.target_pod.as_deref(), target.metadata.name.as_deref());
    let cfg = ms.migration_configuration.unwrap();
    assert_eq!(cfg.bandwidth_per_migration.unwrap().0, "1Gi");
    assert_eq!(cfg.allow_auto_converge, Some(true));
    assert_eq!(cfg.completion_timeout_per_gi_b, Some(150));
    assert_eq!(ms.migration_policy_name.as_deref(), Some("fast"));
    assert_eq!(
        v.metadata.labels.as_ref().unwrap()["kubevirt.io/migrationTargetNodeName"],
        "node-b"
    );
    eventually("VM Migrating", T, || async {
        (vm_printable(&c, "db").await.as_deref() == Some("Migrating")).then_some(())
    })
    .await;

    c.handler_migration("db", |m| {
        m.target_node_address = Some("10.0.0.2:4444".into())
    })
    .await;
    wait_migration(&c, "mig", api::MigrationPhase::TargetReady).await;
    c.handler_migration("db", |m| {
        m.start_timestamp = Some("2026-11-30T08:00:00Z".into())
    })
    .await;
    wait_migration(&c, "mig", api::MigrationPhase::Running).await;
    c.handler_migration("db", |m| m.completed = Some(true))
        .await;
    wait_migration(&c, "mig", api::MigrationPhase::Succeeded).await;

    let v = c.vmi("db").await.unwrap();
    let s = v.status.clone().unwrap();
    assert_eq!(s.node_name.as_deref(), Some("node-b"));
    assert_eq!(s.phase, Some(VmiPhase::Running));
    let labels = v.metadata.labels.clone().unwrap();
    assert_eq!(labels["kubevirt.io/nodeName"], "node-b");
    assert!(!labels.contains_key("kubevirt.io/migrationTargetNodeName"));
    eventually("the source Pod deleted", T, || async {
        let p = c
            .api::<Pod>()
            .get_opt(source.metadata.name.as_deref().unwrap())
            .await
            .unwrap()?;
        p.metadata.deletion_timestamp.map(|_| ())
    })
    .await;
    c.kubelet_finish_deletions().await;
    // The VMI lives on in the target Pod: it stays Running.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(vmi_phase(&c, "db").await, Some(VmiPhase::Running));
    assert_eq!(vm_printable(&c, "db").await.as_deref(), Some("Running"));
    let text = r.metrics.render();
    assert!(
        text.contains("kubevirt_vmi_migration_succeeded 1"),
        "{text}"
    );
    r.stop().await;
}

/// Brings a VM up on node-a and starts a migration to a target Pod running on node-b.
async fn migration_in_flight(
    c: &Cluster,
    vm: &str,
    mig: &str,
) -> (VirtualMachineInstance, Pod, Pod) {
    c.apply_yaml::<VirtualMachine>(&vm_yaml(vm, "Always")).await;
    let vmi = c.bring_up(vm, "node-a").await;
    let source = c.pods_of(&vmi).await.remove(0);
    c.apply_yaml::<VirtualMachineInstanceMigration>(&migration_yaml(mig, vm))
        .await;
    let target = target_pod(c, mig).await;
    c.kubelet_run(target.metadata.name.as_deref().unwrap(), "node-b")
        .await;
    wait_migration(c, mig, api::MigrationPhase::PreparingTarget).await;
    (vmi, source, target)
}

/// As [`migration_in_flight`] for a VMI without a VM (nothing restarts it).
async fn migration_in_flight_vmi(
    c: &Cluster,
    name: &str,
    mig: &str,
) -> (VirtualMachineInstance, Pod, Pod) {
    let vm: VirtualMachine = serde_yaml::from_str(&vm_yaml(name, "Always")).unwrap();
    let mut vmi = controller::vm::vmi_for(&vm, &Default::default(), &Default::default()).unwrap();
    vmi.metadata.namespace = Some(tests::cluster::NS.into());
    vmi.metadata.owner_references = None;
    c.api::<VirtualMachineInstance>()
        .create(&PostParams::default(), &vmi)
        .await
        .unwrap();
    let vmi = c.bring_up(name, "node-a").await;
    let source = c.pods_of(&vmi).await.remove(0);
    c.apply_yaml::<VirtualMachineInstanceMigration>(&migration_yaml(mig, name))
        .await;
    let target = target_pod(c, mig).await;
    c.kubelet_run(target.metadata.name.as_deref().unwrap(), "node-b")
        .await;
    wait_migration(c, mig, api::MigrationPhase::PreparingTarget).await;
    (vmi, source, target)
}

async fn assert_left_on_source(c: &Cluster, vm: &str, target: &Pod) {
    eventually("the target Pod removed", T, || async {
        let p = c
            .api::<Pod>()
            .get_opt(target.metadata.name.as_deref().unwrap())
            .await
            .unwrap();
        p.is_none_or(|p| p.metadata.deletion_timestamp.is_some())
            .then_some(())
    })
    .await;
    let v = c.vmi(vm).await.unwrap();
    let s = v.status.unwrap();
    assert_eq!(s.node_name.as_deref(), Some("node-a"));
    assert!(!v
        .metadata
        .labels
        .unwrap()
        .contains_key("kubevirt.io/migrationTargetNodeName"));
    assert_eq!(s.migration_state.unwrap().failed, Some(true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_target_pod_failure_leaves_vmi_on_source() {
    let c = Cluster::start().await;
    let r = c.replica(test_config(), None);
    let (_vmi, _source, target) = migration_in_flight(&c, "t1", "m1").await;
    c.kubelet_exit(target.metadata.name.as_deref().unwrap(), 1)
        .await;
    wait_migration(&c, "m1", api::MigrationPhase::Failed).await;
    assert_left_on_source(&c, "t1", &target).await;
    assert_eq!(vmi_phase(&c, "t1").await, Some(VmiPhase::Running));
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_migration_cancels_it() {
    let c = Cluster::start().await;
    let r = c.replica(test_config(), None);
    let (_vmi, _source, target) = migration_in_flight(&c, "t2", "m2").await;
    c.api::<VirtualMachineInstanceMigration>()
        .delete("m2", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the migration gone", T, || async {
        c.api::<VirtualMachineInstanceMigration>()
            .get_opt("m2")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    assert_left_on_source(&c, "t2", &target).await;
    let s = c.vmi("t2").await.unwrap().status.unwrap();
    assert_eq!(
        s.migration_state.unwrap().abort_status.as_deref(),
        Some("Succeeded")
    );
    assert_eq!(s.phase, Some(VmiPhase::Running));
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_node_loss_fails_the_migration_without_orphans() {
    let c = Cluster::start().await;
    let r = c.replica(test_config(), None);
    let (_vmi, source, target) = migration_in_flight_vmi(&c, "t3", "m3").await;
    // node-a dies: its kubelet's Pods are marked Failed by the node lifecycle controller.
    c.kubelet_exit(source.metadata.name.as_deref().unwrap(), 137)
        .await;
    wait_migration(&c, "m3", api::MigrationPhase::Failed).await;
    let s = c.vmi("t3").await.unwrap().status.unwrap();
    assert_eq!(s.phase, Some(VmiPhase::Failed));
    assert_eq!(
        s.reason.as_deref(),
        Some("launcher exited with code 137 (Error)")
    );
    eventually("the target Pod removed", T, || async {
        let p = c
            .api::<Pod>()
            .get_opt(target.metadata.name.as_deref().unwrap())
            .await
            .unwrap();
        p.is_none_or(|p| p.metadata.deletion_timestamp.is_some())
            .then_some(())
    })
    .await;
    let m = c
        .api::<VirtualMachineInstanceMigration>()
        .get("m3")
        .await
        .unwrap();
    let cond = &m.status.unwrap().conditions[0];
    assert!(
        cond.message.as_deref().unwrap().contains("source was lost"),
        "{cond:?}"
    );
    r.stop().await;
}

/// Starts `vms` (name, node) and one migration for each; returns how many left Pending, per VM.
async fn admitted(
    cfg: controller::context::ControllerConfig,
    vms: &[(&str, &str)],
    expect: usize,
) -> Vec<bool> {
    let c = Cluster::start().await;
    let r = c.replica(cfg, None);
    for (vm, node) in vms {
        c.apply_yaml::<VirtualMachine>(&vm_yaml(vm, "Always")).await;
        c.bring_up(vm, node).await;
    }
    for (vm, _) in vms {
        c.apply_yaml::<VirtualMachineInstanceMigration>(&migration_yaml(&format!("m-{vm}"), vm))
            .await;
    }
    let started = |c: &Cluster| {
        let c = c.clone_handle();
        async move {
            let mut s = vec![];
            for (vm, _) in vms {
                let p = migration_phase(&c, &format!("m-{vm}")).await;
                s.push(matches!(p, Some(p) if p != api::MigrationPhase::Pending));
            }
            s
        }
    };
    eventually(&format!("{expect} migrations admitted"), T, || async {
        (started(&c).await.iter().filter(|s| **s).count() == expect).then_some(())
    })
    .await;
    // Still so after several queue rechecks.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let now = started(&c).await;
    assert_eq!(now.iter().filter(|s| **s).count(), expect, "{now:?}");
    let targets = c
        .api
        .objects("pods")
        .iter()
        .filter(|p| {
            p["metadata"]["labels"]
                .get("kubevirt.io/migrationJobUID")
                .is_some()
        })
        .count();
    assert_eq!(targets, expect, "one target Pod per admitted migration");
    r.stop().await;
    now
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_limits_per_node_and_cluster() {
    // At most 2 outbound per node (default): 3 VMs leave node-a, 2 leave node-c.
    let vms = [
        ("a1", "node-a"),
        ("a2", "node-a"),
        ("a3", "node-a"),
        ("c1", "node-c"),
        ("c2", "node-c"),
    ];
    let s = admitted(test_config(), &vms, 4).await;
    assert_eq!(s[..3].iter().filter(|x| **x).count(), 2, "{s:?}");
    // At most N per cluster (configured 3): 5 VMs on 5 nodes.
    let mut cfg = test_config();
    cfg.parallel_migrations_per_cluster = 3;
    let vms = [
        ("v1", "n1"),
        ("v2", "n2"),
        ("v3", "n3"),
        ("v4", "n4"),
        ("v5", "n5"),
    ];
    admitted(cfg, &vms, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_endpoint_counts_vmis_per_phase() {
    let c = Cluster::start().await;
    let r = c.replica(test_config(), None);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(controller::metrics::serve(listener, r.metrics.clone()));
    c.apply_yaml::<VirtualMachine>(&vm_yaml("m1", "Always"))
        .await;
    c.apply_yaml::<VirtualMachine>(&vm_yaml("m2", "Always"))
        .await;
    c.bring_up("m1", "node-a").await;
    let text = eventually("phase counts", T, || async {
        let t = tests::cluster::http_get(addr, "/metrics").await;
        (t.contains(r#"kubevirt_vmi_phase_count{node="node-a",phase="running"} 1"#)
            && t.contains(r#"kubevirt_vmi_phase_count{node="",phase="scheduling"} 1"#))
        .then_some(t)
    })
    .await;
    assert!(
        text.contains(
            "kubevirt_virt_controller_reconcile_duration_seconds_count{controller=\"vmi\"}"
        ),
        "{text}"
    );
    assert!(
        text.contains("kubevirt_vmi_migrations_in_pending_phase 0"),
        "{text}"
    );
    assert!(
        text.contains("kubevirt_virt_controller_ready_status 1"),
        "{text}"
    );
    assert_eq!(tests::cluster::http_get(addr, "/healthz").await, "ok");
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_runs_a_single_time_then_halts() {
    let c = Cluster::start().await;
    let r = c.replica(test_config(), None);
    c.apply_yaml::<VirtualMachine>(&vm_yaml("job", "Once"))
        .await;
    let first = c.bring_up("job", "node-a").await;
    let pod = c.pods_of(&first).await.remove(0);
    // The guest powers off: the launcher exits 0.
    c.kubelet_exit(pod.metadata.name.as_deref().unwrap(), 0)
        .await;
    eventually("the VM Halted and Stopped", T, || async {
        let vm = c.api::<VirtualMachine>().get("job").await.unwrap();
        (vm.spec.run_strategy == Some(api::RunStrategy::Halted)
            && vm.status?.printable_status.as_deref() == Some("Stopped"))
        .then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(c.vmi("job").await.is_none(), "no second run");
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_vm_stops_its_guest_first() {
    let c = Cluster::start().await;
    let r = c.replica(test_config(), None);
    c.apply_yaml::<VirtualMachine>(&vm_yaml("gone", "Always"))
        .await;
    let vmi = c.bring_up("gone", "node-a").await;
    let pod = c.pods_of(&vmi).await.remove(0);
    c.api::<VirtualMachine>()
        .delete("gone", &DeleteParams::default())
        .await
        .unwrap();
    eventually("VM Terminating, its Pod being deleted", T, || async {
        let p = c
            .api::<Pod>()
            .get_opt(pod.metadata.name.as_deref().unwrap())
            .await
            .unwrap()?;
        let vm = c.api::<VirtualMachine>().get_opt("gone").await.unwrap()?;
        (p.metadata.deletion_timestamp.is_some()
            && vm.status?.printable_status.as_deref() == Some("Terminating"))
        .then_some(())
    })
    .await;
    c.kubelet_finish_deletions().await;
    eventually("VM, VMI and Pod gone", T, || async {
        let vm = c.api::<VirtualMachine>().get_opt("gone").await.unwrap();
        let vmi = c.vmi("gone").await;
        (vm.is_none() && vmi.is_none() && c.api.objects("pods").is_empty()).then_some(())
    })
    .await;
    r.stop().await;
}
