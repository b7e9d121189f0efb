//! The in-process API server behaves as Kubernetes does where the controllers depend on it,
//! checked through kube-rs as any client would use it.

use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{
    Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use serde_json::json;
use tests::apiserver::ApiServer;

fn pod(name: &str, labels: serde_json::Value) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "c", "image": "x"}]}
    }))
    .unwrap()
}

#[tokio::test]
async fn create_update_conflict_and_status_subresource() {
    let s = ApiServer::start().await;
    let pods: Api<Pod> = Api::namespaced(s.client(), "default");
    let created = pods
        .create(&PostParams::default(), &pod("a", json!({"app": "x"})))
        .await
        .unwrap();
    assert!(created.metadata.uid.is_some() && created.metadata.creation_timestamp.is_some());
    assert_eq!(
        created.status.as_ref().unwrap().phase.as_deref(),
        Some("Pending")
    );
    let err = pods
        .create(&PostParams::default(), &pod("a", json!({})))
        .await
        .unwrap_err();
    assert!(matches!(err, kube::Error::Api(s) if s.code == 409 && s.reason == "AlreadyExists"));

    // A write with the current resourceVersion wins; the stale one conflicts.
    let mut v1 = created.clone();
    v1.metadata
        .labels
        .as_mut()
        .unwrap()
        .insert("v".into(), "1".into());
    let updated = pods
        .replace("a", &PostParams::default(), &v1)
        .await
        .unwrap();
    assert_ne!(
        updated.metadata.resource_version,
        created.metadata.resource_version
    );
    let err = pods
        .replace("a", &PostParams::default(), &v1)
        .await
        .unwrap_err();
    assert!(matches!(err, kube::Error::Api(s) if s.code == 409 && s.reason == "Conflict"));

    // The main resource ignores status; /status ignores everything else.
    let mut sneaky = updated.clone();
    sneaky.status.as_mut().unwrap().phase = Some("Running".into());
    let after = pods
        .replace("a", &PostParams::default(), &sneaky)
        .await
        .unwrap();
    assert_eq!(after.status.unwrap().phase.as_deref(), Some("Pending"));
    let after = pods
        .patch_status(
            "a",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"status": {"phase": "Running"}, "metadata": {"labels": {"x": "y"}}}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(after.status.unwrap().phase.as_deref(), Some("Running"));
    assert!(!after.metadata.labels.unwrap().contains_key("x"));

    // A no-op write does not bump the resourceVersion.
    let again = pods
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"v": "1"}}})),
        )
        .await
        .unwrap();
    let same = pods
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"v": "1"}}})),
        )
        .await
        .unwrap();
    assert_eq!(
        again.metadata.resource_version,
        same.metadata.resource_version
    );

    // generateName
    let mut g = pod("", json!({}));
    g.metadata.name = None;
    g.metadata.generate_name = Some("gen-".into());
    let g = pods.create(&PostParams::default(), &g).await.unwrap();
    assert!(g.metadata.name.unwrap().len() == "gen-".len() + 5);
}

#[tokio::test]
async fn list_paging_and_selectors() {
    let s = ApiServer::start().await;
    let pods: Api<Pod> = Api::namespaced(s.client(), "default");
    for i in 0..7 {
        let tier = if i % 2 == 0 { "a" } else { "b" };
        pods.create(
            &PostParams::default(),
            &pod(&format!("p{i}"), json!({"tier": tier})),
        )
        .await
        .unwrap();
    }
    let page = pods.list(&ListParams::default().limit(3)).await.unwrap();
    assert_eq!(page.items.len(), 3);
    let token = page.metadata.continue_.clone().expect("a continue token");
    let rest = pods
        .list(&ListParams::default().limit(10).continue_token(&token))
        .await
        .unwrap();
    assert_eq!(rest.items.len(), 4);
    assert!(rest.metadata.continue_.is_none());
    let a = pods
        .list(&ListParams::default().labels("tier=a"))
        .await
        .unwrap();
    assert_eq!(a.items.len(), 4);
    let notin = pods
        .list(&ListParams::default().labels("tier notin (a)"))
        .await
        .unwrap();
    assert_eq!(notin.items.len(), 3);
    let by_name = pods
        .list(&ListParams::default().fields("metadata.name=p3"))
        .await
        .unwrap();
    assert_eq!(by_name.items.len(), 1);
    // Only the fields the real server selects Pods on.
    let err = pods
        .list(&ListParams::default().fields("spec.containers=c"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 400
            && s.message == "field label not supported: spec.containers"),
        "{err:?}"
    );
    let other_ns: Api<Pod> = Api::namespaced(s.client(), "other");
    assert!(other_ns
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .is_empty());
    let all: Api<Pod> = Api::all(s.client());
    assert_eq!(
        all.list(&ListParams::default()).await.unwrap().items.len(),
        7
    );
}

#[tokio::test]
async fn watch_replays_bookmarks_selectors_and_gone() {
    let s = ApiServer::start().await;
    let pods: Api<Pod> = Api::namespaced(s.client(), "default");
    let rv = pods
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    pods.create(&PostParams::default(), &pod("w", json!({"app": "web"})))
        .await
        .unwrap();
    // Leaves the selector: DELETED for a watcher of app=web.
    pods.patch(
        "w",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"app": "db"}}})),
    )
    .await
    .unwrap();
    let wp = WatchParams::default().labels("app=web").timeout(3);
    let mut stream = pods.watch(&wp, &rv).await.unwrap().boxed();
    let mut kinds = vec![];
    while let Some(ev) = stream.try_next().await.unwrap() {
        match ev {
            WatchEvent::Added(p) => kinds.push(format!("ADDED {}", p.metadata.name.unwrap())),
            WatchEvent::Modified(_) => kinds.push("MODIFIED".into()),
            WatchEvent::Deleted(p) => kinds.push(format!("DELETED {}", p.metadata.name.unwrap())),
            WatchEvent::Bookmark(b) => {
                kinds.push("BOOKMARK".into());
                assert!(
                    b.metadata.resource_version.parse::<u64>().unwrap()
                        >= rv.parse::<u64>().unwrap()
                );
                break;
            }
            WatchEvent::Error(e) => panic!("{e:?}"),
        }
    }
    assert_eq!(kinds, ["ADDED w", "DELETED w", "BOOKMARK"]);

    // After compaction an old resourceVersion is 410 Gone.
    s.compact();
    let mut stream = pods
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    match stream.try_next().await.unwrap() {
        Some(WatchEvent::Error(e)) => assert_eq!(e.code, 410),
        other => panic!("expected 410 Gone, got {other:?}"),
    }
}

#[tokio::test]
async fn finalizers_graceful_pod_deletion_and_garbage_collection() {
    let s = ApiServer::start().await;
    // Kinds the server does not store are 404, as a resource without its CRD is.
    let err = Api::<Job>::namespaced(s.client(), "default")
        .list(&ListParams::default())
        .await
        .unwrap_err();
    assert!(matches!(err, kube::Error::Api(s) if s.code == 404));

    let pods: Api<Pod> = Api::namespaced(s.client(), "default");
    let owner = pods
        .create(&PostParams::default(), &pod("owner", json!({})))
        .await
        .unwrap();
    let mut child = pod("child", json!({}));
    child.metadata.owner_references = Some(vec![
        k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
            api_version: "v1".into(),
            kind: "Pod".into(),
            name: "owner".into(),
            uid: owner.metadata.uid.clone().unwrap(),
            controller: Some(true),
            ..Default::default()
        },
    ]);
    child.metadata.finalizers = Some(vec!["test/hold".into()]);
    pods.create(&PostParams::default(), &child).await.unwrap();

    // Bound Pods are deleted gracefully: they stay with a deletionTimestamp until gracePeriodSeconds=0.
    pods.patch(
        "owner",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"nodeName": "n1"}})),
    )
    .await
    .unwrap();
    pods.delete("owner", &DeleteParams::default())
        .await
        .unwrap();
    let o = pods.get("owner").await.unwrap();
    assert!(o.metadata.deletion_timestamp.is_some());
    assert_eq!(o.metadata.deletion_grace_period_seconds, Some(30));
    pods.delete(
        "owner",
        &DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert!(pods.get_opt("owner").await.unwrap().is_none());

    // Its dependent is collected (after the delete, by the collector beside the server), but
    // its finalizer holds it until removed.
    let c = until(|| async {
        let c = pods.get("child").await.unwrap();
        c.metadata.deletion_timestamp.is_some().then_some(c)
    })
    .await;
    assert!(c.metadata.deletion_timestamp.is_some());
    pods.patch(
        "child",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(pods.get_opt("child").await.unwrap().is_none());
}

/// Polls `f` until it answers, for at most 5 s.
async fn until<T, F: std::future::Future<Output = Option<T>>>(f: impl Fn() -> F) -> T {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(tokio::time::Instant::now() < deadline, "not within 5 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// An unbound Pod (deleted at once, no kubelet involved), owned by `owner` when given.
fn owned_pod(name: &str, owner: Option<&Pod>) -> Pod {
    let mut p = pod(name, json!({}));
    if let Some(o) = owner {
        p.metadata.owner_references = Some(vec![
            k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                api_version: "v1".into(),
                kind: "Pod".into(),
                name: o.metadata.name.clone().unwrap(),
                uid: o.metadata.uid.clone().unwrap(),
                controller: Some(true),
                block_owner_deletion: Some(true),
            },
        ]);
    }
    p
}

/// Deletes propagate as asked: Foreground holds the owner until its blocking dependents are
/// gone, Orphan lets the owner go and leaves the dependents without it, Background (the
/// default) removes the owner at once and its dependents after.
#[tokio::test]
async fn deletes_propagate_as_their_policy_says() {
    let s = ApiServer::start().await;
    let pods: Api<Pod> = Api::namespaced(s.client(), "default");
    let pp = PostParams::default();
    for (policy, owner) in [
        (Some(kube::api::PropagationPolicy::Foreground), "fg"),
        (Some(kube::api::PropagationPolicy::Orphan), "or"),
        (None, "bg"),
    ] {
        let o = pods.create(&pp, &owned_pod(owner, None)).await.unwrap();
        let dep = format!("{owner}-dep");
        pods.create(&pp, &owned_pod(&dep, Some(&o))).await.unwrap();
        let dp = DeleteParams {
            propagation_policy: policy.clone(),
            ..Default::default()
        };
        pods.delete(owner, &dp).await.unwrap();
        match owner {
            "fg" => {
                let held = pods.get("fg").await.unwrap();
                assert!(held.metadata.deletion_timestamp.is_some());
                assert_eq!(
                    held.metadata.finalizers,
                    Some(vec!["foregroundDeletion".into()])
                );
                until(|| async { pods.get_opt("fg").await.unwrap().is_none().then_some(()) }).await;
                assert!(
                    pods.get_opt("fg-dep").await.unwrap().is_none(),
                    "dependent first"
                );
            }
            "or" => {
                until(|| async { pods.get_opt("or").await.unwrap().is_none().then_some(()) }).await;
                let kept = pods.get("or-dep").await.unwrap();
                assert!(kept
                    .metadata
                    .owner_references
                    .unwrap_or_default()
                    .is_empty());
                assert!(kept.metadata.deletion_timestamp.is_none());
            }
            _ => {
                assert!(
                    pods.get_opt("bg").await.unwrap().is_none(),
                    "the owner at once"
                );
                until(|| async {
                    pods.get_opt("bg-dep")
                        .await
                        .unwrap()
                        .is_none()
                        .then_some(())
                })
                .await;
            }
        }
    }
}

/// Strict where a real API server is: a strategic merge patch of a custom resource is refused
/// with 415 (custom resources carry no patch strategies), a Pod takes one; a Pod deleted
/// gracefully carries the time it is due to be gone, now + its grace period.
#[tokio::test]
async fn strategic_merge_patch_only_for_built_in_kinds_and_deletion_due_after_grace() {
    let s = ApiServer::start().await;
    let pods: Api<Pod> = Api::namespaced(s.client(), "default");
    let mut p = pod("g", json!({}));
    p.spec.as_mut().unwrap().node_name = Some("node-1".into());
    p.spec.as_mut().unwrap().termination_grace_period_seconds = Some(120);
    pods.create(&PostParams::default(), &p).await.unwrap();
    let label = json!({"metadata": {"labels": {"x": "1"}}});
    pods.patch("g", &PatchParams::default(), &Patch::Strategic(&label))
        .await
        .unwrap();
    let vms: Api<api::VirtualMachine> = Api::namespaced(s.client(), "default");
    let vm: api::VirtualMachine = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": "v"}, "spec": {"template": {"spec": {"domain": {"devices": {}}}}}
    }))
    .unwrap();
    vms.create(&PostParams::default(), &vm).await.unwrap();
    let err = vms
        .patch("v", &PatchParams::default(), &Patch::Strategic(&label))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 415 && s.reason == "UnsupportedMediaType"),
        "{err:?}"
    );
    vms.patch("v", &PatchParams::default(), &Patch::Merge(&label))
        .await
        .unwrap();

    let before = jiff::Timestamp::now();
    pods.delete("g", &DeleteParams::default()).await.unwrap();
    let gone_at = pods
        .get("g")
        .await
        .unwrap()
        .metadata
        .deletion_timestamp
        .unwrap()
        .0;
    let due = gone_at.duration_since(before).as_secs();
    assert!(
        (119..=121).contains(&due),
        "deletionTimestamp {due} s after the delete"
    );
}

/// `dryRun=All` answers every write as if it were stored and stores nothing: no object, no
/// new resourceVersion, no watch event.
#[tokio::test]
async fn dry_run_writes_are_answered_and_never_stored() {
    let s = ApiServer::start().await;
    let pods: Api<Pod> = Api::namespaced(s.client(), "default");
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let answered = pods.create(&dry, &pod("d", json!({}))).await.unwrap();
    assert_eq!(answered.metadata.name.as_deref(), Some("d"));
    assert!(
        pods.get_opt("d").await.unwrap().is_none(),
        "a dry-run create stored"
    );
    let real = pods
        .create(&PostParams::default(), &pod("d", json!({})))
        .await
        .unwrap();
    let label = json!({"metadata": {"labels": {"x": "1"}}});
    let patched = pods
        .patch(
            "d",
            &PatchParams::default().dry_run(),
            &Patch::Merge(&label),
        )
        .await
        .unwrap();
    assert_eq!(patched.metadata.labels.unwrap()["x"], "1");
    let dp = DeleteParams {
        dry_run: true,
        ..Default::default()
    };
    pods.delete("d", &dp).await.unwrap();
    let stored = pods.get("d").await.unwrap();
    assert_eq!(
        stored.metadata.resource_version,
        real.metadata.resource_version
    );
    assert!(stored.metadata.labels.is_none_or(|l| !l.contains_key("x")));
    assert!(stored.metadata.deletion_timestamp.is_none());
}

/// Custom resources are stored as their CRD's structural schema has them: a wrong type is
/// refused with 422 naming the path, a field the schema does not know is pruned where the
/// schema does not preserve unknown fields.
#[tokio::test]
async fn custom_resources_are_checked_and_pruned_by_their_schema() {
    use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
    let s = ApiServer::start().await;
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(
        "kubevirt.io",
        "v1",
        "VirtualMachine",
    ));
    let vms: Api<DynamicObject> = Api::namespaced_with(s.client(), "default", &ar);
    let vm = |name: &str, spec: serde_json::Value| -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": name}, "spec": spec
        }))
        .unwrap()
    };
    let template = json!({"spec": {"domain": {"devices": {}}}});
    let err = vms
        .create(
            &PostParams::default(),
            &vm("typed", json!({"running": "yes", "template": template})),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 422
            && s.message.contains("spec.running: Invalid value: \"string\"")),
        "{err:?}"
    );
    let stored = vms
        .create(
            &PostParams::default(),
            &vm(
                "pruned",
                json!({"running": true, "mystery": 1, "template": template,
                       "instancetype": {"name": "small", "mystery": 2}}),
            ),
        )
        .await
        .unwrap();
    // `spec` keeps what microvirt does not model (its schema says so); the matcher does not.
    assert_eq!(stored.data["spec"]["mystery"], json!(1));
    assert_eq!(
        stored.data["spec"]["instancetype"],
        json!({"name": "small"}),
        "{:?}",
        stored.data
    );
    assert_eq!(stored.data["spec"]["running"], json!(true));
}

/// As NamespaceLifecycle has it: nothing is created in a namespace that does not exist or is
/// being deleted; the system namespaces exist from the start.
#[tokio::test]
async fn objects_live_only_in_namespaces_that_exist() {
    use k8s_openapi::api::core::v1::Namespace;
    let s = ApiServer::start().await;
    let nowhere: Api<Pod> = Api::namespaced(s.client(), "nowhere");
    let err = nowhere
        .create(&PostParams::default(), &pod("p", json!({})))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 404
            && s.message == "namespaces \"nowhere\" not found"),
        "{err:?}"
    );
    let namespaces: Api<Namespace> = Api::all(s.client());
    for system in ["default", "kube-system", "kube-public", "kube-node-lease"] {
        assert!(
            namespaces.get_opt(system).await.unwrap().is_some(),
            "{system}"
        );
    }
    let mut ns = Namespace::default();
    ns.metadata.name = Some("nowhere".into());
    ns.metadata.finalizers = Some(vec!["test/hold".into()]);
    namespaces
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    nowhere
        .create(&PostParams::default(), &pod("p", json!({})))
        .await
        .unwrap();
    namespaces
        .delete("nowhere", &DeleteParams::default())
        .await
        .unwrap();
    let err = nowhere
        .create(&PostParams::default(), &pod("q", json!({})))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 403 && s.message.contains("being terminated")),
        "{err:?}"
    );
}
