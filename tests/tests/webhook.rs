//! The admission webhook over real HTTPS (self-signed certificate, verified by the client as
//! the API server would with the CA bundle): validation with the launcher's messages,
//! defaulting patches, and eviction of a LiveMigrate VMI's Pod turned into a migration.

use std::time::Duration;

use api::migratability::EvictionStrategy;
use api::{VirtualMachine, VirtualMachineInstanceMigration};
use kube::api::ListParams;
use serde_json::{json, Value};
use tests::admission::{eviction, review, start_webhook};
use tests::cluster::{eventually, test_config, Cluster};

const T: Duration = Duration::from_secs(20);

fn vm(extra_spec: Value, memory: &str) -> Value {
    let mut spec = json!({
        "template": {"spec": {
            "domain": {"memory": {"guest": memory}, "devices": {"disks": [{"name": "root"}]}},
            "volumes": [{"name": "root", "containerDisk": {"image": "quay.io/containerdisks/alpine:3.20"}}]
        }}
    });
    for (k, v) in extra_spec.as_object().unwrap() {
        spec[k] = v.clone();
    }
    json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
           "metadata": {"name": "web", "namespace": "default"}, "spec": spec})
}

#[tokio::test]
async fn validation_gives_the_launchers_message() {
    let w = start_webhook(None, EvictionStrategy::None).await;
    let bad = vm(json!({"runStrategy": "Always"}), "64Zi");
    let resp = w
        .post(
            "/validate",
            &review("VirtualMachine", "virtualmachines", "CREATE", bad.clone()),
        )
        .await;
    let r = &resp["response"];
    assert_eq!(r["uid"], "705ab4f5-6393-11e8-b7cc-42010a800002");
    assert_eq!(r["allowed"], false);
    let typed: VirtualMachine = serde_json::from_value(bad).unwrap();
    let launcher_message = api::validation::validate_vm(&typed)
        .unwrap_err()
        .to_string();
    assert_eq!(r["status"]["message"], launcher_message.as_str());
    assert_eq!(r["status"]["code"], 422);

    let good = vm(json!({"running": true}), "64Mi");
    let resp = w
        .post(
            "/validate",
            &review("VirtualMachine", "virtualmachines", "CREATE", good),
        )
        .await;
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    assert_eq!(
        resp["response"]["warnings"][0],
        controller::webhook::RUNNING_DEPRECATED
    );

    // A field that changes nothing here: admitted, with a warning that says so.
    let mut clocked = vm(json!({"runStrategy": "Always"}), "64Mi");
    clocked["spec"]["template"]["spec"]["domain"]["clock"] = json!({"utc": {}});
    let resp = w
        .post(
            "/validate",
            &review("VirtualMachine", "virtualmachines", "CREATE", clocked),
        )
        .await;
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    assert!(
        resp["response"]["warnings"][0]
            .as_str()
            .unwrap()
            .starts_with("spec.template.spec.domain.clock: accepted, but has no effect"),
        "{resp}"
    );
    // A field microvirt does not know: refused by path.
    let mut typo = vm(json!({"runStrategy": "Always"}), "64Mi");
    typo["spec"]["template"]["spec"]["domain"]["cpuu"] = json!({"cores": 2});
    let resp = w
        .post(
            "/validate",
            &review("VirtualMachine", "virtualmachines", "CREATE", typo),
        )
        .await;
    assert_eq!(resp["response"]["allowed"], false, "{resp}");
    assert!(resp["response"]["status"]["message"]
        .as_str()
        .unwrap()
        .contains("spec.template.spec.domain.cpuu: is not a field microvirt knows"));

    // A VM that sets what its instance type sets: KubeVirt's message, a 422.
    let conflicting = vm(
        json!({"runStrategy": "Always", "instancetype": {"name": "u1.medium"}}),
        "1Gi",
    );
    let resp = w
        .post(
            "/validate",
            &review("VirtualMachine", "virtualmachines", "CREATE", conflicting),
        )
        .await;
    assert_eq!(resp["response"]["allowed"], false, "{resp}");
    assert_eq!(resp["response"]["status"]["code"], 422);
    let m = resp["response"]["status"]["message"].as_str().unwrap();
    assert!(
        m.contains("VM field(s) spec.template.spec.domain.memory.guest conflicts with selected instance type"),
        "{m}"
    );

    let mig = json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstanceMigration",
                     "metadata": {"name": "m"}, "spec": {"vmiName": ""}});
    let resp = w
        .post(
            "/validate",
            &review(
                "VirtualMachineInstanceMigration",
                "virtualmachineinstancemigrations",
                "CREATE",
                mig,
            ),
        )
        .await;
    assert_eq!(resp["response"]["allowed"], false);
    assert!(
        resp["response"]["status"]["message"]
            .as_str()
            .unwrap()
            .contains("spec.vmiName"),
        "{resp}"
    );

    // Not an AdmissionReview request at all.
    let resp = w
        .post(
            "/validate",
            &json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}),
        )
        .await;
    assert_eq!(resp["response"]["allowed"], false);
}

/// The JSON patch of a `/mutate` answer applied to `obj` (`obj` unchanged when there is none).
async fn mutated(w: &tests::admission::Webhook, kind: &str, resource: &str, obj: Value) -> Value {
    let resp = w
        .post("/mutate", &review(kind, resource, "CREATE", obj.clone()))
        .await;
    let r = &resp["response"];
    assert_eq!(r["allowed"], true, "{resp}");
    let mut patched = obj;
    if let Some(bytes) = r["patch"].as_str() {
        assert_eq!(r["patchType"], "JSONPatch");
        use base64::Engine;
        let patch: json_patch::Patch = serde_json::from_slice(
            &base64::engine::general_purpose::STANDARD
                .decode(bytes)
                .unwrap(),
        )
        .unwrap();
        json_patch::patch(&mut patched, &patch).unwrap();
    }
    patched
}

#[tokio::test]
async fn mutation_applies_kubevirt_defaults_as_a_json_patch() {
    let w = start_webhook(None, EvictionStrategy::None).await;
    // A VMI gets KubeVirt's defaults.
    let vm = vm(json!({"runStrategy": "Always"}), "64Mi");
    let vmi = json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                     "metadata": {"name": "web", "namespace": "default"},
                     "spec": vm["spec"]["template"]["spec"]});
    let patched = mutated(&w, "VirtualMachineInstance", "virtualmachineinstances", vmi).await;
    let d = &patched["spec"]["domain"];
    assert_eq!(d["cpu"]["cores"], 1);
    assert_eq!(d["devices"]["disks"][0]["disk"]["bus"], "virtio");
    assert_eq!(
        patched["metadata"]["name"], "web",
        "the patch leaves the rest alone"
    );

    // A VM, as KubeVirt's VM mutator does: its template untouched (defaulted in each VMI made
    // from it, so a second `kubectl apply` of the same file is no change), the kinds of its
    // instance type and preference filled in.
    let patched = mutated(&w, "VirtualMachine", "virtualmachines", vm.clone()).await;
    assert_eq!(patched, vm);
    let typed = self::vm(
        json!({"runStrategy": "Always", "instancetype": {"name": "u1.small"},
               "preference": {"name": "fedora", "kind": "VirtualMachinePreference"}}),
        "64Mi",
    );
    let patched = mutated(&w, "VirtualMachine", "virtualmachines", typed).await;
    assert_eq!(
        patched["spec"]["instancetype"]["kind"],
        "VirtualMachineClusterInstancetype"
    );
    assert_eq!(
        patched["spec"]["preference"]["kind"],
        "VirtualMachinePreference"
    );
    assert_eq!(patched["spec"]["template"], vm["spec"]["template"]);
}

/// The `/validate` answer for creating the VMI `vmi`.
async fn validated_vmi(w: &tests::admission::Webhook, vmi: Value) -> Value {
    let r = review(
        "VirtualMachineInstance",
        "virtualmachineinstances",
        "CREATE",
        vmi,
    );
    w.post("/validate", &r).await
}

/// The KubeVirt CR's network rules reach admission: the interface a VMI without one gets is
/// `defaultNetworkInterface`'s binding, and with `permitBridgeInterfaceOnPodNetwork: false` a
/// bridge on the pod network is refused by path.
#[tokio::test]
async fn the_clusters_network_defaults_apply_at_admission() {
    use api::kubevirt::{ClusterSettings, KubeVirtConfiguration};
    let config: KubeVirtConfiguration = serde_yaml::from_str(
        "network: {defaultNetworkInterface: bridge, permitBridgeInterfaceOnPodNetwork: false}",
    )
    .unwrap();
    let bridge_default = ClusterSettings::default()
        .with(&serde_yaml::from_str("network: {defaultNetworkInterface: bridge}").unwrap())
        .unwrap();
    let w = tests::admission::serve_webhook(controller::webhook::WebhookState {
        client: None,
        settings: controller_runtime::LiveSettings::fixed(bridge_default),
        host_disk_prefixes: vec![],
    })
    .await;
    let vm = vm(json!({"runStrategy": "Always"}), "64Mi");
    let vmi = json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                     "metadata": {"name": "web", "namespace": "default"},
                     "spec": vm["spec"]["template"]["spec"]});
    let patched = mutated(
        &w,
        "VirtualMachineInstance",
        "virtualmachineinstances",
        vmi.clone(),
    )
    .await;
    let iface = &patched["spec"]["domain"]["devices"]["interfaces"][0];
    assert_eq!(iface["bridge"], json!({}), "{iface}");

    let forbidding = tests::admission::serve_webhook(controller::webhook::WebhookState {
        client: None,
        settings: controller_runtime::LiveSettings::fixed(
            ClusterSettings::default().with(&config).unwrap(),
        ),
        host_disk_prefixes: vec![],
    })
    .await;
    let r = validated_vmi(&forbidding, patched).await;
    assert_eq!(r["response"]["allowed"], false, "{r}");
    let msg = r["response"]["status"]["message"].as_str().unwrap();
    assert!(
        msg.contains("spec.domain.devices.interfaces[0].bridge: Bridge on pod network configuration is not enabled"),
        "{msg}"
    );
    // A VMI with no bridge on the pod network stays allowed.
    let r = validated_vmi(&forbidding, vmi).await;
    assert_eq!(r["response"]["allowed"], true, "{r}");
}

fn evictable_vm(name: &str) -> String {
    format!(
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachine\nmetadata:\n  name: {name}\nspec:\n  runStrategy: Always\n  template:\n    spec:\n      evictionStrategy: LiveMigrate\n      domain:\n        memory: {{guest: 32Mi}}\n        devices: {{}}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicting_a_live_migratable_pod_migrates_the_vmi() {
    let c = Cluster::start().await;
    let r = c.replica(test_config(), None);
    let w = start_webhook(Some(c.controller_client()), EvictionStrategy::None).await;
    c.apply_yaml::<VirtualMachine>(&evictable_vm("drain-me"))
        .await;
    c.apply_yaml::<VirtualMachine>(
        &evictable_vm("plain").replace("      evictionStrategy: LiveMigrate\n", ""),
    )
    .await;
    let mut pods = vec![];
    for name in ["drain-me", "plain"] {
        let vmi = c.bring_up(name, "node-a").await;
        let pod = c.pods_of(&vmi).await.remove(0);
        pods.push(pod.metadata.name.unwrap());
    }
    // kubectl drain node-a: the LiveMigrate VMI's Pod is refused with 429 and migrates...
    let resp = w.post("/eviction", &eviction(&pods[0])).await;
    assert_eq!(resp["response"]["allowed"], false, "{resp}");
    assert_eq!(resp["response"]["status"]["code"], 429);
    assert!(resp["response"]["status"]["message"]
        .as_str()
        .unwrap()
        .contains("evacuation"));
    let s = c.vmi("drain-me").await.unwrap().status.unwrap();
    assert_eq!(s.evacuation_node_name.as_deref(), Some("node-a"));
    let m = eventually("an evacuation migration", T, || async {
        c.api::<VirtualMachineInstanceMigration>()
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .find(|m| m.spec.vmi_name == "drain-me")
    })
    .await;
    assert!(m
        .metadata
        .name
        .as_deref()
        .unwrap()
        .starts_with("kubevirt-evacuation-"));
    // ... while the other Pod is simply evicted.
    let resp = w.post("/eviction", &eviction(&pods[1])).await;
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    // A second eviction attempt (drain retries) does not start a second migration.
    let resp = w.post("/eviction", &eviction(&pods[0])).await;
    assert_eq!(resp["response"]["allowed"], false);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let n = c
        .api::<VirtualMachineInstanceMigration>()
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .len();
    assert_eq!(n, 1);

    // The migration runs (the test plays scheduler, kubelet and virt-handler); once the VMI is
    // on node-b the evacuation mark is cleared and the old Pod goes, so the drain can finish.
    let muid = m.metadata.uid.clone().unwrap();
    let target = c.target_pod(&muid).await;
    c.kubelet_run(target.metadata.name.as_deref().unwrap(), "node-b")
        .await;
    c.handler_complete_migration("drain-me", &muid).await;
    eventually("the VMI on node-b, evacuation cleared", T, || async {
        let s = c.vmi("drain-me").await.unwrap().status?;
        (s.node_name.as_deref() == Some("node-b") && s.evacuation_node_name.is_none()).then_some(())
    })
    .await;
    eventually("the drained Pod deleted", T, || async {
        let p = c
            .api::<k8s_openapi::api::core::v1::Pod>()
            .get_opt(&pods[0])
            .await
            .unwrap();
        p.is_none_or(|p| p.metadata.deletion_timestamp.is_some())
            .then_some(())
    })
    .await;
    r.stop().await;
}
