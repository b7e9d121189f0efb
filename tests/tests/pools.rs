//! VirtualMachinePool (pool.kubevirt.io/v1beta1) through the API: `replicas` VMs named
//! `<pool>-<ordinal>` from the template, owned by the pool; scaled through the scale
//! subresource (`kubectl scale vmpool`), the highest ordinals go first; status follows.

use std::time::Duration;

use api::{VirtualMachine, VirtualMachinePool};
use kube::api::{Patch, PatchParams};
use kube::ResourceExt;
use tests::cluster::{eventually, test_config, Cluster};

const T: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_keeps_its_replicas_of_vms_and_scales_down_from_the_top() {
    let cluster = Cluster::start().await;
    let _controller = cluster.replica(test_config(), None);
    cluster
        .apply_yaml::<VirtualMachinePool>(
            r#"
apiVersion: pool.kubevirt.io/v1beta1
kind: VirtualMachinePool
metadata: {name: web}
spec:
  replicas: 3
  selector: {matchLabels: {kubevirt.io/vmpool: web}}
  virtualMachineTemplate:
    metadata:
      labels: {kubevirt.io/vmpool: web}
    spec:
      runStrategy: Halted
      template:
        metadata:
          labels: {kubevirt.io/vmpool: web}
        spec:
          domain:
            memory: {guest: 64Mi}
            devices: {autoattachPodInterface: false}
"#,
        )
        .await;
    let vms = cluster.api::<VirtualMachine>();
    let names = || async {
        let mut n: Vec<String> = vms
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .iter()
            .filter(|v| v.metadata.deletion_timestamp.is_none())
            .map(|v| v.name_any())
            .collect();
        n.sort();
        n
    };
    eventually("three VMs", T, || async {
        (names().await == ["web-0", "web-1", "web-2"]).then_some(())
    })
    .await;
    let vm = vms.get("web-1").await.unwrap();
    assert_eq!(vm.owner_references()[0].kind, "VirtualMachinePool");
    assert_eq!(
        vm.labels().get("kubevirt.io/vmpool").map(String::as_str),
        Some("web")
    );
    let pools = cluster.api::<VirtualMachinePool>();
    eventually("status.replicas 3", T, || async {
        let p = pools.get("web").await.unwrap();
        let s = p.status?;
        (s.replicas == 3 && s.label_selector.as_deref() == Some("kubevirt.io/vmpool=web"))
            .then_some(())
    })
    .await;
    // kubectl scale vmpool web --replicas=1
    assert_eq!(
        pools.get_scale("web").await.unwrap().spec.unwrap().replicas,
        Some(3)
    );
    pools
        .patch_scale(
            "web",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"replicas": 1}})),
        )
        .await
        .unwrap();
    eventually("one VM, the lowest ordinal", T, || async {
        let _ = cluster.kubelet_finish_deletions().await;
        (names().await == ["web-0"]).then_some(())
    })
    .await;
    // A lost member is replaced under its free ordinal.
    pools
        .patch_scale(
            "web",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"replicas": 2}})),
        )
        .await
        .unwrap();
    eventually("web-0 and web-1", T, || async {
        (names().await == ["web-0", "web-1"]).then_some(())
    })
    .await;
}
