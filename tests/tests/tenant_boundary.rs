//! The hostile-tenant suite, control-plane part: each test is a tenant with an ordinary
//! namespace attacking what virt-controller and its webhook decide (which Pod is a VMI's, which
//! host directories a VMI may mount). The node-agent and launcher parts are in
//! `handler/tests/` and `launcher/tests/`.

use std::time::Duration;

use api::kubevirt::ClusterSettings;
use api::validation::HostDiskPolicy;
use api::{VirtualMachineInstance, VirtualMachineInstanceMigration, VmiPhase};
use controller_runtime::LiveSettings;
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use kube::ResourceExt;
use serde_json::{json, Value};
use tests::admission::{review, serve_webhook};
use tests::cluster::{eventually, test_config, Cluster};

const T: Duration = Duration::from_secs(20);

fn vmi_yaml(name: &str, volume: &str) -> String {
    format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: {name}}}
spec:
  terminationGracePeriodSeconds: 5
  domain:
    memory: {{guest: 64Mi}}
    devices: {{disks: [{{name: root}}]}}
  volumes:
    - {{name: root, {volume}}}
"#
    )
}

/// A Pod the tenant makes itself, carrying whatever labels it likes and its own image.
fn stranger(name: &str, labels: Value) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "thief", "image": "evil.example/listener:1"}]},
    }))
    .unwrap()
}

fn controlled_by(p: &Pod, vmi: &VirtualMachineInstance) -> bool {
    api::ownership::controlled_by_vmi(&p.metadata, vmi.metadata.uid.as_deref().unwrap())
}

async fn foreign_pod_events(c: &Cluster, pod: &str) -> usize {
    c.api
        .objects("events")
        .iter()
        .filter(|e| {
            e["reason"] == "ForeignPodIgnored"
                && e["note"]
                    .as_str()
                    .is_some_and(|n| n.contains(&format!("ignored Pod {pod}:")))
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_labelled_stranger_is_never_a_launcher_or_a_migration_target() {
    let c = Cluster::start().await;
    let pods = c.api::<Pod>();
    // The VMI is created while no controller runs, and the tenant's Pod claims to be its
    // launcher (the label the controller used to adopt by while activePods was empty).
    let vmi: VirtualMachineInstance = c
        .apply_yaml(&vmi_yaml(
            "victim",
            "containerDisk: {image: quay.io/containerdisks/alpine:3.20}",
        ))
        .await;
    let vmi_uid = vmi.metadata.uid.clone().unwrap();
    pods.create(
        &PostParams::default(),
        &stranger("fake-launcher", json!({"kubevirt.io/created-by": vmi_uid})),
    )
    .await
    .unwrap();
    let r = c.replica(test_config(), None);
    let launcher = eventually("the controller's own launcher Pod", T, || async {
        c.pods_of(&vmi)
            .await
            .into_iter()
            .find(|p| controlled_by(p, &vmi))
    })
    .await;
    c.kubelet_run(&launcher.name_any(), "node-a").await;
    let vmis = c.api::<VirtualMachineInstance>();
    eventually("VMI Scheduled", T, || async {
        (vmis.get("victim").await.unwrap().status?.phase == Some(VmiPhase::Scheduled)).then_some(())
    })
    .await;
    c.handler_running("victim").await;
    let vmi = vmis.get("victim").await.unwrap();
    let active = vmi.status.as_ref().unwrap().active_pods.clone().unwrap();
    assert_eq!(
        active.keys().collect::<Vec<_>>(),
        [launcher.metadata.uid.as_ref().unwrap()]
    );
    eventually("an Event naming the fake launcher", T, || async {
        (foreign_pod_events(&c, "fake-launcher").await > 0).then_some(())
    })
    .await;

    // A migration, and before the controller acts on it a Pod of the tenant's labelled with its
    // uid: the node agent would have sent that Pod the migration and the cluster's key.
    r.stop().await;
    let m: VirtualMachineInstanceMigration = c
        .apply_yaml("apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstanceMigration\nmetadata: {name: move}\nspec: {vmiName: victim}\n")
        .await;
    let muid = m.metadata.uid.clone().unwrap();
    pods.create(
        &PostParams::default(),
        &stranger(
            "fake-target",
            json!({"kubevirt.io/migrationJobUID": muid, "kubevirt.io/created-by": vmi_uid}),
        ),
    )
    .await
    .unwrap();
    let r = c.replica(test_config(), None);
    let target = eventually("the controller's own target Pod", T, || async {
        c.pods_of(&vmi).await.into_iter().find(|p| {
            controlled_by(p, &vmi) && p.labels().get("kubevirt.io/migrationJobUID") == Some(&muid)
        })
    })
    .await;
    c.kubelet_run(&target.name_any(), "node-b").await;
    c.handler_complete_migration("victim", &muid).await;
    let done = eventually("the migration to succeed", T, || async {
        let m = c
            .api::<VirtualMachineInstanceMigration>()
            .get("move")
            .await
            .unwrap();
        (m.status?.phase == Some(api::MigrationPhase::Succeeded)).then_some(())
    });
    done.await;
    let vmi = vmis.get("victim").await.unwrap();
    let status = vmi.status.clone().unwrap();
    assert_eq!(status.phase, Some(VmiPhase::Running));
    assert_eq!(
        status.active_pods.unwrap().keys().collect::<Vec<_>>(),
        [target.metadata.uid.as_ref().unwrap()],
        "the VMI runs in the controller's target Pod"
    );
    let ms = status.migration_state.unwrap();
    assert_eq!(ms.target_pod.as_deref(), Some(target.name_any().as_str()));
    assert!(foreign_pod_events(&c, "fake-target").await > 0);
    // The strangers are the tenant's own: ignored, not deleted.
    for name in ["fake-launcher", "fake-target"] {
        assert!(
            pods.get_opt(name).await.unwrap().is_some(),
            "{name} was left alone"
        );
    }
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_disks_need_the_gate_and_stay_in_the_tenants_directory() {
    let c = Cluster::start().await;
    let host = |path: &str| {
        let vmi: Value = serde_yaml::from_str(&vmi_yaml(
            "h",
            &format!("hostDisk: {{path: {path}, type: DiskOrCreate, capacity: 1Gi}}"),
        ))
        .unwrap();
        review(
            "VirtualMachineInstance",
            "virtualmachineinstances",
            "CREATE",
            vmi,
        )
    };
    // A cluster as installed: HostDisk off, refused in KubeVirt's words.
    let off = serve_webhook(controller::webhook::WebhookState {
        client: None,
        settings: LiveSettings::fixed(ClusterSettings::default()),
        host_disk_prefixes: vec![],
    })
    .await;
    let r = off
        .post("/validate", &host("/var/lib/hostdisks/default/a.img"))
        .await;
    assert_eq!(r["response"]["allowed"], false, "{r}");
    let msg = r["response"]["status"]["message"].as_str().unwrap();
    assert!(
        msg.contains("spec.volumes[0].hostDisk: HostDisk feature gate is not enabled"),
        "{msg}"
    );

    // Enabled, with one directory per namespace: the review is in namespace "default".
    let policy = HostDiskPolicy {
        feature_gate: true,
        allowed_prefixes: vec!["/var/lib/hostdisks/{namespace}".into()],
    };
    let gate_on = ClusterSettings {
        feature_gates: ["HostDisk".to_string()].into(),
        ..Default::default()
    };
    let on = serve_webhook(controller::webhook::WebhookState {
        client: None,
        settings: LiveSettings::fixed(gate_on),
        host_disk_prefixes: policy.allowed_prefixes.clone(),
    })
    .await;
    let r = on
        .post("/validate", &host("/var/lib/hostdisks/default/a.img"))
        .await;
    assert_eq!(r["response"]["allowed"], true, "{r}");
    for (path, why) in [
        (
            "/var/lib/hostdisks/other-tenant/db.img",
            "is outside the host directories",
        ),
        ("/etc/shadow", "is outside the host directories"),
        (
            "/var/lib/hostdisks/default/../other-tenant/db.img",
            "has a \\\"..\\\" component",
        ),
    ] {
        let r = on.post("/validate", &host(path)).await;
        assert_eq!(r["response"]["allowed"], false, "{path}: {r}");
        let msg = r["response"]["status"].to_string();
        assert!(
            msg.contains("spec.volumes[0].hostDisk.path") && msg.contains(why),
            "{path}: {msg}"
        );
    }

    // The webhook bypassed: virt-controller refuses the same, makes no Pod and says why.
    let rep = c.replica(test_config(), None);
    let vmi: VirtualMachineInstance = c
        .apply_yaml(&vmi_yaml(
            "h",
            "hostDisk: {path: /etc/kubernetes/admin.img, type: Disk}",
        ))
        .await;
    let msg = eventually("the VMI's refusal", T, || async {
        let s = c.vmi("h").await.unwrap().status?;
        s.conditions
            .iter()
            .find(|c| c.type_ == "Synchronized")
            .and_then(|c| c.message.clone())
    })
    .await;
    assert!(
        msg.contains("spec.volumes[0].hostDisk: HostDisk feature gate is not enabled"),
        "{msg}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        c.pods_of(&vmi).await.is_empty(),
        "no launcher Pod for a refused hostDisk"
    );
    rep.stop().await;
}
