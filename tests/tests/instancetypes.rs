//! Instance types and preferences through the API, as KubeVirt users write them: the VM's size
//! comes from its (cluster) instance type, its gaps are filled from its preference, the spec
//! used is captured in a ControllerRevision so a later edit of the instance type does not change
//! the VM, and a VM naming an instance type that is not there says so.

use std::time::Duration;

use api::instancetype::VirtualMachineClusterInstancetype;
use api::{VirtualMachine, VirtualMachineInstance};
use k8s_openapi::api::apps::v1::ControllerRevision;
use kube::api::{DeleteParams, Patch, PatchParams};
use tests::cluster::{eventually, test_config, Cluster};

const T: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_is_sized_by_its_instance_type_and_keeps_the_revision_it_started_with() {
    let cluster = Cluster::start().await;
    let _controller = cluster.replica(test_config(), None);
    let instancetypes: kube::Api<VirtualMachineClusterInstancetype> =
        kube::Api::all(cluster.api.client());
    instancetypes
        .create(
            &Default::default(),
            &serde_yaml::from_str(
                "apiVersion: instancetype.kubevirt.io/v1beta1\nkind: VirtualMachineClusterInstancetype\nmetadata: {name: u1.medium}\nspec: {cpu: {guest: 4}, memory: {guest: 2Gi}}\n",
            )
            .unwrap(),
        )
        .await
        .unwrap();
    cluster
        .apply_yaml::<api::instancetype::VirtualMachinePreference>(
            "apiVersion: instancetype.kubevirt.io/v1beta1\nkind: VirtualMachinePreference\nmetadata: {name: fedora}\nspec:\n  cpu: {preferredCPUTopology: preferCores}\n  devices: {preferredDiskBus: virtio, preferredInterfaceModel: virtio}\n  preferredTerminationGracePeriodSeconds: 7\n",
        )
        .await;
    cluster
        .apply_yaml::<VirtualMachine>(
            r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: sized}
spec:
  runStrategy: Always
  instancetype: {name: u1.medium}
  preference: {kind: VirtualMachinePreference, name: fedora}
  template:
    spec:
      domain:
        devices:
          disks: [{name: root}]
      volumes: [{name: root, containerDisk: {image: "quay.io/containerdisks/fedora:40"}}]
"#,
        )
        .await;
    let vmis = cluster.api::<VirtualMachineInstance>();
    let vmi = eventually("the VMI", T, || async {
        vmis.get_opt("sized").await.unwrap()
    })
    .await;
    let size = |v: &VirtualMachineInstance| {
        let c = v.spec.domain.cpu.clone().unwrap();
        (
            c.sockets,
            c.cores,
            c.threads,
            v.spec
                .domain
                .memory
                .as_ref()
                .unwrap()
                .guest
                .clone()
                .unwrap()
                .0,
        )
    };
    assert_eq!(size(&vmi), (Some(1), Some(4), Some(1), "2Gi".into()));
    assert_eq!(vmi.spec.termination_grace_period_seconds, Some(7));
    assert_eq!(
        vmi.spec.domain.devices.disks[0].disk.as_ref().unwrap().bus,
        Some(api::DiskBus::Virtio)
    );
    // The spec used is captured, and the VM points at it.
    let vm = cluster.api::<VirtualMachine>().get("sized").await.unwrap();
    let rev = vm
        .spec
        .instancetype
        .clone()
        .unwrap()
        .revision_name
        .expect("revisionName");
    let r = cluster.api::<ControllerRevision>().get(&rev).await.unwrap();
    assert_eq!(r.data.unwrap().0["spec"]["cpu"]["guest"], 4);
    assert!(vm.spec.preference.unwrap().revision_name.is_some());

    // The instance type grows; the running VM's next VMI still has the size it started with.
    instancetypes
        .patch(
            "u1.medium",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"cpu": {"guest": 8}}})),
        )
        .await
        .unwrap();
    vmis.delete("sized", &DeleteParams::default())
        .await
        .unwrap();
    let _ = cluster.kubelet_finish_deletions().await;
    let old_uid = vmi.metadata.uid.clone();
    let again = eventually("a new VMI", T, || async {
        let _ = cluster.kubelet_finish_deletions().await;
        let v = vmis.get_opt("sized").await.unwrap()?;
        (v.metadata.uid != old_uid).then_some(v)
    })
    .await;
    assert_eq!(size(&again), (Some(1), Some(4), Some(1), "2Gi".into()));

    // An instance type that does not exist: no VMI, the VM says what was looked for.
    cluster
        .apply_yaml::<VirtualMachine>(
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachine\nmetadata: {name: lost}\nspec:\n  runStrategy: Always\n  instancetype: {name: nope}\n  template: {spec: {domain: {devices: {}}}}\n",
        )
        .await;
    let msg = eventually("the VM's Failure condition", T, || async {
        let vm = cluster.api::<VirtualMachine>().get("lost").await.unwrap();
        vm.status?
            .conditions
            .into_iter()
            .find(|c| c.type_ == "Failure")?
            .message
    })
    .await;
    assert_eq!(
        msg,
        "spec.instancetype: instance type \"nope\" not found (looked for VirtualMachineClusterInstancetype nope)"
    );
    assert!(vmis.get_opt("lost").await.unwrap().is_none());
}
