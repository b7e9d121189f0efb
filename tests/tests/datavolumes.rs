//! A VM with `dataVolumeTemplates` — KubeVirt's canonical Fedora example — through the API:
//! virt-controller makes each template a CDI DataVolume the VM controls, shows `Provisioning`
//! while CDI populates it (the test plays CDI), starts the VMI once it is ready with the claim
//! in the launcher Pod, and shows `DataVolumeError` with CDI's message when the import fails.
//! A cluster without CDI gets a Failure naming what to install, and no VMI.

use std::time::Duration;

use api::{VirtualMachine, VirtualMachineInstance};
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::ResourceExt;
use serde_json::json;
use tests::cluster::{eventually, test_config, Cluster, NS};

const T: Duration = Duration::from_secs(30);

fn vm_yaml(name: &str) -> String {
    format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata:
  name: {name}
spec:
  runStrategy: Always
  dataVolumeTemplates:
  - metadata:
      name: {name}-root
    spec:
      source:
        registry:
          url: docker://quay.io/containerdisks/fedora:40
      storage:
        resources:
          requests:
            storage: 5Gi
  template:
    spec:
      domain:
        memory: {{guest: 1Gi}}
        devices:
          disks:
          - name: root
            disk: {{bus: virtio}}
      volumes:
      - name: root
        dataVolume:
          name: {name}-root
"#
    )
}

/// A cluster with CDI installed (its `cdis` kind served), so virt-controller leaves the
/// DataVolumes to CDI — which the test plays.
async fn cdi_cluster() -> Cluster {
    Cluster::start_with(tests::apiserver::ApiServerOptions {
        cdi_installed: true,
        ..Default::default()
    })
    .await
}

fn datavolumes(c: &Cluster) -> Api<DynamicObject> {
    Api::namespaced_with(
        c.client.clone(),
        NS,
        &controller::datavolume::api_resource(),
    )
}

/// CDI reports `phase` (and a condition message) on the DataVolume.
async fn cdi_reports(c: &Cluster, dv: &str, phase: &str, message: &str) {
    datavolumes(c)
        .patch_status(
            dv,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": phase, "conditions": [
                {"type": "Running", "status": "False", "reason": phase, "message": message}]}})),
        )
        .await
        .unwrap();
}

async fn printable(c: &Cluster, vm: &str, want: &str) -> VirtualMachine {
    let vms = c.api::<VirtualMachine>();
    eventually(&format!("VM {vm} {want}"), T, || async {
        let v = vms.get(vm).await.unwrap();
        (v.status.as_ref()?.printable_status.as_deref() == Some(want)).then_some(v)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_starts_once_cdi_has_populated_its_datavolume() {
    let c = cdi_cluster().await;
    let _controller = c.replica(test_config(), None);
    let vm = c.apply_yaml::<VirtualMachine>(&vm_yaml("fedora")).await;

    // The DataVolume, controlled by the VM, with the template's spec.
    let dv = eventually("the DataVolume", T, || async {
        datavolumes(&c).get_opt("fedora-root").await.unwrap()
    })
    .await;
    let owner = &dv.owner_references()[0];
    assert_eq!(owner.uid, vm.uid().unwrap());
    assert_eq!(owner.controller, Some(true));
    assert_eq!(
        dv.data["spec"]["source"]["registry"]["url"],
        "docker://quay.io/containerdisks/fedora:40"
    );

    // While CDI imports, no VMI: the VM says Provisioning, and why.
    cdi_reports(&c, "fedora-root", "ImportInProgress", "Import 42% complete").await;
    let vms = c.api::<VirtualMachine>();
    eventually("the VM Provisioning, naming CDI's phase", T, || async {
        let s = vms.get("fedora").await.unwrap().status?;
        let cond = s
            .conditions
            .iter()
            .find(|c| c.type_ == "DataVolumesReady")?;
        (s.printable_status.as_deref() == Some("Provisioning")
            && cond.status == "False"
            && cond
                .message
                .as_deref()?
                .contains("fedora-root (ImportInProgress)"))
        .then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let vmis = c.api::<VirtualMachineInstance>();
    assert!(vmis.get_opt("fedora").await.unwrap().is_none());

    // Imported: the VMI starts, and its launcher Pod mounts the DataVolume's claim.
    cdi_reports(&c, "fedora-root", "Succeeded", "Import Complete").await;
    let vmi = eventually("the VMI", T, || async {
        vmis.get_opt("fedora").await.unwrap()
    })
    .await;
    let pod = eventually("the launcher Pod", T, || async {
        c.pods_of(&vmi).await.into_iter().next()
    })
    .await;
    let claims: Vec<String> = pod
        .spec
        .unwrap()
        .volumes
        .unwrap_or_default()
        .into_iter()
        .filter_map(|v| v.persistent_volume_claim.map(|p| p.claim_name))
        .collect();
    assert_eq!(claims, ["fedora-root"]);
    let v = printable(&c, "fedora", "Starting").await;
    assert!(v
        .status
        .unwrap()
        .conditions
        .iter()
        .any(|c| c.type_ == "DataVolumesReady" && c.status == "True"));
}

fn failure_of(vm: VirtualMachine) -> api::Condition {
    vm.status
        .unwrap()
        .conditions
        .into_iter()
        .find(|c| c.type_ == "Failure")
        .expect("a Failure condition")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_import_or_a_cluster_without_cdi_is_named_on_the_vm() {
    let c = cdi_cluster().await;
    let _controller = c.replica(test_config(), None);

    c.apply_yaml::<VirtualMachine>(&vm_yaml("broken")).await;
    eventually("the DataVolume", T, || async {
        datavolumes(&c).get_opt("broken-root").await.unwrap()
    })
    .await;
    cdi_reports(
        &c,
        "broken-root",
        "Failed",
        "Unable to connect to http data source: 404 Not Found",
    )
    .await;
    let failure = failure_of(printable(&c, "broken", "DataVolumeError").await);
    assert_eq!(
        failure.message.as_deref(),
        Some("DataVolume broken-root failed: Unable to connect to http data source: 404 Not Found")
    );

    // No CDI: creating DataVolumes answers 404, as it does where the CRD is not installed.
    c.api
        .fail_requests(Some(axum::http::Method::POST), "/datavolumes", 404, 1000);
    c.apply_yaml::<VirtualMachine>(&vm_yaml("nocdi")).await;
    let failure = failure_of(printable(&c, "nocdi", "DataVolumeError").await);
    assert!(
        failure.message.unwrap().contains("install CDI"),
        "the failure says what is missing"
    );
    assert!(c.vmi("nocdi").await.is_none());
}
