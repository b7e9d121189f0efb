//! virt-controller under a misbehaving API server and with two replicas: conflicts retried,
//! 500s backed off without tight loops or duplicate Pods, dropped and compacted watches
//! recovered, and only the Lease holder acting.

use std::time::Duration;

use api::{VirtualMachine, VirtualMachineInstance, VmiPhase};
use axum::http::Method;
use controller::leader::LeaseConfig;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use tests::cluster::{eventually, test_config, Cluster, CONTROLLER_NAMESPACE};

const T: Duration = Duration::from_secs(30);

fn vm_yaml(name: &str) -> String {
    format!(
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachine\nmetadata:\n  name: {name}\nspec:\n  runStrategy: Always\n  template:\n    spec:\n      domain:\n        memory: {{guest: 32Mi}}\n        devices: {{}}\n"
    )
}

async fn scheduling(c: &Cluster, name: &str) -> Option<VirtualMachineInstance> {
    let v = c.vmi(name).await?;
    (v.status.as_ref()?.phase == Some(VmiPhase::Scheduling)).then_some(v)
}

fn launcher_pods(c: &Cluster) -> usize {
    c.api.objects("pods").len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_conflicts_are_retried() {
    let c = Cluster::start().await;
    let r = c.replica(test_config(), None);
    c.api.fail_requests(Some(Method::PUT), "/status", 409, 6);
    c.apply_yaml::<VirtualMachine>(&vm_yaml("c1")).await;
    eventually("the VMI Scheduling despite conflicts", T, || {
        scheduling(&c, "c1")
    })
    .await;
    eventually("the VM status written", T, || async {
        let s = c.api::<VirtualMachine>().get("c1").await.unwrap().status?;
        (s.printable_status.as_deref() == Some("Starting")).then_some(())
    })
    .await;
    let conflicts = c
        .api
        .request_log()
        .iter()
        .filter(|(_, _, code)| *code == 409)
        .count();
    // Every injected conflict was hit; the controllers' own stale writes may add real ones.
    assert_eq!(c.api.pending_faults(), 0, "every injected conflict was hit");
    assert!(conflicts >= 6, "{conflicts} conflicts answered");
    assert!(r.metrics.render().contains("reason=\"conflict\""));
    assert_eq!(launcher_pods(&c), 1);
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_back_off_without_duplicates() {
    let c = Cluster::start().await;
    let r = c.replica(test_config(), None);
    // Wait for the controllers' watches before breaking things.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The VMI's status write fails after its Pod was created: the next round must find the Pod
    // (by the created-by label) instead of creating another.
    c.api.fail_requests(
        Some(Method::PUT),
        "/virtualmachineinstances/s1/status",
        500,
        5,
    );
    // Pod creation fails a few times too.
    c.api.fail_requests(Some(Method::POST), "/pods", 503, 3);
    let before = c.api.request_count();
    c.apply_yaml::<VirtualMachine>(&vm_yaml("s1")).await;
    eventually("the VMI Scheduling after the errors", T, || {
        scheduling(&c, "s1")
    })
    .await;
    assert_eq!(launcher_pods(&c), 1, "exactly one launcher Pod");
    let log = c.api.request_log();
    let errors = log.iter().filter(|(_, _, code)| *code >= 500).count();
    assert_eq!(errors, 8);
    // Backoff: the retries of the failing status write are spaced out (base 100 ms doubling), so
    // the whole recovery takes a bounded number of requests.
    let used = c.api.request_count() - before;
    assert!(used < 200, "{used} requests for one VM: a tight loop");
    assert!(r.metrics.render().contains("reason=\"server_error\""));
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_request_does_not_hold_up_other_objects() {
    let c = Cluster::start().await;
    let r = c.replica(test_config(), None);
    tokio::time::sleep(Duration::from_millis(500)).await;
    c.api
        .delay_requests(Some(Method::POST), "/pods", Duration::from_secs(4), 1);
    c.apply_yaml::<VirtualMachine>(&vm_yaml("slow")).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = std::time::Instant::now();
    c.apply_yaml::<VirtualMachine>(&vm_yaml("fast")).await;
    eventually("the second VM's VMI Scheduling", T, || {
        scheduling(&c, "fast")
    })
    .await;
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "waited behind the hung request: {:?}",
        t.elapsed()
    );
    assert!(
        scheduling(&c, "slow").await.is_none(),
        "the slow Pod creation is still pending"
    );
    eventually("the first VM's VMI once the API answers", T, || {
        scheduling(&c, "slow")
    })
    .await;
    assert_eq!(launcher_pods(&c), 2);
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_and_expired_watches_recover() {
    let c = Cluster::start().await;
    let r = c.replica(test_config(), None);
    c.apply_yaml::<VirtualMachine>(&vm_yaml("w1")).await;
    eventually("the first VMI", T, || scheduling(&c, "w1")).await;
    // The API server forgets history and drops every watch: resuming gets 410 Gone, so the
    // controllers must relist.
    c.api.compact();
    c.api.drop_watches();
    c.apply_yaml::<VirtualMachine>(&vm_yaml("w2")).await;
    eventually("a VMI for a VM created after the watch broke", T, || {
        scheduling(&c, "w2")
    })
    .await;
    let relists = c
        .api
        .request_log()
        .iter()
        .filter(|(m, p, _)| m == Method::GET && p.ends_with("/virtualmachines"))
        .count();
    assert!(
        relists >= 2,
        "the VM watcher listed again ({relists} lists)"
    );
    assert_eq!(launcher_pods(&c), 2);
    r.stop().await;
}

fn lease(identity: &str) -> LeaseConfig {
    let mut l = LeaseConfig::new(CONTROLLER_NAMESPACE, "virt-controller", identity);
    l.lease_duration = Duration::from_secs(2);
    l.renew_deadline = Duration::from_millis(1300);
    l.retry_period = Duration::from_millis(200);
    l
}

async fn holder(c: &Cluster) -> Option<String> {
    Api::<Lease>::namespaced(c.client.clone(), CONTROLLER_NAMESPACE)
        .get_opt("virt-controller")
        .await
        .unwrap()?
        .spec?
        .holder_identity
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_leader_acts_and_a_follower_takes_over() {
    let c = Cluster::start().await;
    let a = c.replica(test_config(), Some(lease("replica-a")));
    eventually("replica-a leads", T, || async {
        (holder(&c).await.as_deref() == Some("replica-a")).then_some(())
    })
    .await;
    let b = c.replica(test_config(), Some(lease("replica-b")));
    c.apply_yaml::<VirtualMachine>(&vm_yaml("l1")).await;
    eventually("l1 reconciled", T, || scheduling(&c, "l1")).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(a.metrics.reconciles("vm") > 0);
    assert_eq!(
        b.metrics.reconciles("vm") + b.metrics.reconciles("vmi"),
        0,
        "the follower reconciled"
    );
    assert!(a
        .metrics
        .render()
        .contains("kubevirt_virt_controller_leading_status 1"));
    assert!(b
        .metrics
        .render()
        .contains("kubevirt_virt_controller_leading_status 0"));

    // The leader dies without releasing the Lease; the follower takes over once it expires.
    a.kill();
    c.apply_yaml::<VirtualMachine>(&vm_yaml("l2")).await;
    eventually("l2 reconciled by the new leader", T, || {
        scheduling(&c, "l2")
    })
    .await;
    assert_eq!(holder(&c).await.as_deref(), Some("replica-b"));
    let transitions = Api::<Lease>::namespaced(c.client.clone(), CONTROLLER_NAMESPACE)
        .get("virt-controller")
        .await
        .unwrap()
        .spec
        .unwrap()
        .lease_transitions;
    assert_eq!(transitions, Some(1));
    assert!(b.metrics.reconciles("vm") > 0);
    assert_eq!(
        launcher_pods(&c),
        2,
        "no duplicate Pods across the hand-over"
    );

    // A clean stop releases the Lease at once.
    b.stop().await;
    assert_eq!(holder(&c).await, None);
}

async fn start_migration(c: &Cluster, name: &str, vmi: &str) -> String {
    let m: api::VirtualMachineInstanceMigration = serde_json::from_value(serde_json::json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstanceMigration",
        "metadata": {"name": name, "namespace": "default"}, "spec": {"vmiName": vmi}
    }))
    .unwrap();
    c.api::<api::VirtualMachineInstanceMigration>()
        .create(&kube::api::PostParams::default(), &m)
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap()
}

/// Migrations reconcile in parallel once admitted: one whose API requests hang does not hold
/// up another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_migration_does_not_hold_up_another() {
    let c = Cluster::start().await;
    let r = c.replica(test_config(), None);
    for name in ["m-slow", "m-fast"] {
        c.apply_yaml::<VirtualMachine>(&vm_yaml(name)).await;
        c.bring_up(name, "node-a").await;
    }
    let slow = start_migration(&c, "slow", "m-slow").await;
    let target = c.target_pod(&slow).await;
    // Every request about the slow migration now hangs for 5 s; binding its target Pod makes
    // the controller write its status (and wait).
    c.api.delay_requests(
        None,
        "/virtualmachineinstancemigrations/slow",
        Duration::from_secs(5),
        100,
    );
    c.kubelet_run(target.metadata.name.as_deref().unwrap(), "node-b")
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t = std::time::Instant::now();
    let fast = start_migration(&c, "fast", "m-fast").await;
    let fast_target = c.target_pod(&fast).await;
    c.kubelet_run(fast_target.metadata.name.as_deref().unwrap(), "node-c")
        .await;
    eventually("the fast migration preparing its target", T, || async {
        let v = c.vmi("m-fast").await.unwrap();
        let ms = v.status?.migration_state?;
        (ms.migration_uid.as_deref() == Some(fast.as_str())).then_some(())
    })
    .await;
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "the fast migration waited behind the hung one: {:?}",
        t.elapsed()
    );
    r.stop().await;
}
