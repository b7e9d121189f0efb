//! KubeVirt's VM snapshots through the API (`snapshot.kubevirt.io/v1beta1`), end to end against
//! the in-process API server with virt-controller under its deployed RBAC: the storage stand-in
//! binds claims to directories and plays the CSI snapshotter, so what a snapshot captured and
//! what a restore brought back are compared byte for byte on "disk". Bad input ends Failed (or
//! with a Failure condition) naming the field or the volume and why, and changes neither the VM
//! nor its claims.

use std::time::Duration;

use api::snapshot::{
    SnapshotPhase, VirtualMachineRestore, VirtualMachineSnapshot, VirtualMachineSnapshotContent,
    VolumeSnapshot, ANNOTATION_LAST_RESTORE,
};
use api::{VirtualMachine, VirtualMachineInstance};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, DynamicObject, PostParams};
use kube::ResourceExt;
use serde_json::json;
use tests::cluster::{eventually, test_config, Cluster, NS};
use tests::storage::ImportNode;

const T: Duration = Duration::from_secs(30);

/// Storage class `name` of provisioner `driver`, with a VolumeSnapshotClass for it if `csi`.
async fn storage(c: &Cluster, name: &str, driver: &str, csi: bool) {
    let sc: StorageClass = serde_json::from_value(json!({
        "metadata": {"name": name}, "provisioner": driver}))
    .unwrap();
    Api::<StorageClass>::all(c.client.clone())
        .create(&PostParams::default(), &sc)
        .await
        .unwrap();
    if csi {
        let classes = Api::<DynamicObject>::all_with(
            c.client.clone(),
            &controller::snapshot::volume_snapshot_classes(),
        );
        let vsc: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass",
            "metadata": {"name": format!("{name}-snapshots"),
                "annotations": {"snapshot.storage.kubernetes.io/is-default-class": "true"}},
            "driver": driver, "deletionPolicy": "Delete"}))
        .unwrap();
        classes.create(&PostParams::default(), &vsc).await.unwrap();
    }
}

/// A bound claim of class `class` whose disk holds `data`.
async fn claim(c: &Cluster, node: &ImportNode, name: &str, class: &str, data: &[u8]) {
    c.apply_yaml::<PersistentVolumeClaim>(&format!(
        "metadata: {{name: {name}, labels: {{app: db}}}}
spec:
  storageClassName: {class}
  accessModes: [ReadWriteOnce]
  resources: {{requests: {{storage: 64Mi}}}}"
    ))
    .await;
    eventually(&format!("claim {name} bound"), T, || async {
        let pvc = c.api::<PersistentVolumeClaim>().get(name).await.unwrap();
        (pvc.status?.phase.as_deref() == Some("Bound")).then_some(())
    })
    .await;
    write_disk(node, name, data);
}

fn write_disk(node: &ImportNode, claim: &str, data: &[u8]) {
    std::fs::write(node.claim_dir(NS, claim).join("disk.img"), data).unwrap();
}

fn disk(node: &ImportNode, claim: &str) -> Vec<u8> {
    std::fs::read(node.claim_dir(NS, claim).join("disk.img")).unwrap()
}

/// A VM with a root disk on `claim`, a cloud-init disk, and `extra` volumes (YAML list items).
async fn vm(c: &Cluster, name: &str, run: &str, claim: &str, extra: &str) -> VirtualMachine {
    c.apply_yaml::<VirtualMachine>(&format!(
        r##"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: {name}, labels: {{app: db}}}}
spec:
  runStrategy: {run}
  template:
    spec:
      domain:
        memory: {{guest: 128Mi}}
        devices:
          disks:
          - {{name: root, disk: {{bus: virtio}}}}
          - {{name: cloudinit, disk: {{bus: virtio}}}}
      volumes:
      - name: root
        persistentVolumeClaim: {{claimName: {claim}}}
      - name: cloudinit
        cloudInitNoCloud: {{userData: "#cloud-config\n"}}
{extra}"##
    ))
    .await
}

async fn snapshot(c: &Cluster, name: &str, kind: &str, vm: &str) -> VirtualMachineSnapshot {
    c.apply_yaml::<VirtualMachineSnapshot>(&format!(
        "apiVersion: snapshot.kubevirt.io/v1beta1
kind: VirtualMachineSnapshot
metadata: {{name: {name}}}
spec:
  source: {{apiGroup: kubevirt.io, kind: {kind}, name: {vm}}}"
    ))
    .await
}

/// The snapshot once it has ended in `phase`.
async fn snapshot_ends(c: &Cluster, name: &str, phase: SnapshotPhase) -> VirtualMachineSnapshot {
    eventually(&format!("snapshot {name} {phase:?}"), T, || async {
        let s = c.api::<VirtualMachineSnapshot>().get(name).await.unwrap();
        (s.status.as_ref()?.phase? == phase).then_some(s)
    })
    .await
}

async fn restore(c: &Cluster, name: &str, target: &str, snapshot: &str, extra: &str) {
    c.apply_yaml::<VirtualMachineRestore>(&format!(
        "apiVersion: snapshot.kubevirt.io/v1beta1
kind: VirtualMachineRestore
metadata: {{name: {name}}}
spec:
  target: {{apiGroup: kubevirt.io, kind: VirtualMachine, name: {target}}}
  virtualMachineSnapshotName: {snapshot}
{extra}"
    ))
    .await;
}

/// The restore once complete (`Ok`) or failed (`Err` with the Failure message).
async fn restore_ends(c: &Cluster, name: &str) -> Result<VirtualMachineRestore, String> {
    eventually(&format!("restore {name} ended"), T, || async {
        let r = c.api::<VirtualMachineRestore>().get(name).await.unwrap();
        let s = r.status.clone()?;
        if s.complete == Some(true) {
            return Some(Ok(r));
        }
        s.conditions
            .iter()
            .find(|c| c.type_ == "Failure" && c.status == "True")
            .map(|c| Err(c.message.clone().unwrap_or_default()))
    })
    .await
}

fn root_claim(vm: &VirtualMachine) -> String {
    let spec = vm.spec.template.spec.as_ref().unwrap();
    let root = spec.volumes.iter().find(|v| v.name == "root").unwrap();
    root.persistent_volume_claim
        .as_ref()
        .unwrap()
        .claim_name
        .clone()
}

async fn bound_claim(c: &Cluster, name: &str) -> PersistentVolumeClaim {
    eventually(&format!("claim {name} bound"), T, || async {
        let pvc = c
            .api::<PersistentVolumeClaim>()
            .get_opt(name)
            .await
            .unwrap()?;
        (pvc.status.as_ref()?.phase.as_deref() == Some("Bound")).then_some(pvc)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_captures_the_claims_and_restores_bring_them_back() {
    let work = std::env::temp_dir().join(format!("mv-vmsnap-ok-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let c = Cluster::start().await;
    let _controller = c.replica(test_config(), None);
    let node = ImportNode::start(&c, &work);
    storage(&c, "csi", "csi.example.com", true).await;
    claim(&c, &node, "db-root", "csi", b"version 1").await;
    let db = vm(&c, "db", "Halted", "db-root", "").await;

    // The snapshot: one VolumeSnapshot of the claim, the VM as it was, no indications (it
    // was not running).
    snapshot(&c, "snap", "VirtualMachine", "db").await;
    let s = snapshot_ends(&c, "snap", SnapshotPhase::Succeeded).await;
    let st = s.status.clone().unwrap();
    assert_eq!(st.ready_to_use, Some(true));
    assert_eq!(st.source_uid, db.uid());
    assert!(st.creation_time.is_some() && st.error.is_none());
    assert!(st.indications.is_empty(), "{:?}", st.indications);
    let lists = st.snapshot_volumes.clone().unwrap();
    assert_eq!(lists.included_volumes, ["root"]);
    assert_eq!(lists.excluded_volumes, ["cloudinit"]);
    let ready = st.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
    assert_eq!(ready.status, "True");
    let content = c
        .api::<VirtualMachineSnapshotContent>()
        .get(st.virtual_machine_snapshot_content_name.as_deref().unwrap())
        .await
        .unwrap();
    assert_eq!(content.owner_references()[0].uid, s.uid().unwrap());
    assert_eq!(
        content.spec.source.virtual_machine.as_ref().unwrap().spec,
        db.spec
    );
    let backup = &content.spec.volume_backups[0];
    assert_eq!(backup.volume_name, "root");
    let vs_name = backup.volume_snapshot_name.clone().unwrap();
    let vs = c.api::<VolumeSnapshot>().get(&vs_name).await.unwrap();
    assert_eq!(
        vs.spec.source.persistent_volume_claim_name.as_deref(),
        Some("db-root")
    );
    assert_eq!(vs.owner_references()[0].uid, content.uid().unwrap());
    assert_eq!(content.status.unwrap().ready_to_use, Some(true));

    // The disk changes after the snapshot; a restore onto the VM brings the snapshot's data
    // back on a new claim and leaves the changed one as it is.
    write_disk(&node, "db-root", b"version 2");
    restore(&c, "back", "db", "snap", "").await;
    let r = restore_ends(&c, "back").await.expect("restore completes");
    let restored = &r.status.as_ref().unwrap().restores[0];
    assert_eq!(restored.volume_name, "root");
    assert_eq!(restored.volume_snapshot_name, vs_name);
    let new_claim = restored.persistent_volume_claim_name.clone();
    assert_eq!(new_claim, format!("restore-{}-root", r.uid().unwrap()));
    let db_after = c.api::<VirtualMachine>().get("db").await.unwrap();
    assert_eq!(db_after.uid(), db.uid(), "the same VM, restored in place");
    assert_eq!(root_claim(&db_after), new_claim);
    assert_eq!(db_after.spec.run_strategy, db.spec.run_strategy);
    assert!(db_after.annotations()[ANNOTATION_LAST_RESTORE].starts_with("back-"));
    let pvc = bound_claim(&c, &new_claim).await;
    assert_eq!(pvc.owner_references()[0].uid, db.uid().unwrap());
    assert_eq!(pvc.labels()["app"], "db");
    assert_eq!(disk(&node, &new_claim), b"version 1");
    assert_eq!(disk(&node, "db-root"), b"version 2");

    // Into a new VM, patched (a new MAC, a label), with a claim named by an override.
    restore(
        &c,
        "copy",
        "db-copy",
        "snap",
        r#"  volumeRestoreOverrides: [{volumeName: root, restoreName: copy-root, labels: {copy: "yes"}}]
  patches:
  - '{"op": "replace", "path": "/metadata/labels/app", "value": "db-copy"}'
  - '{"op": "add", "path": "/spec/template/spec/domain/devices/interfaces", "value": [{"name": "default", "masquerade": {}, "macAddress": "02:00:00:00:00:09"}]}'"#,
    )
    .await;
    restore_ends(&c, "copy").await.expect("restore completes");
    let copy = c.api::<VirtualMachine>().get("db-copy").await.unwrap();
    assert_ne!(copy.uid(), db.uid());
    assert_eq!(root_claim(&copy), "copy-root");
    assert_eq!(copy.labels()["app"], "db-copy");
    let iface = &copy
        .spec
        .template
        .spec
        .as_ref()
        .unwrap()
        .domain
        .devices
        .interfaces[0];
    assert_eq!(iface.mac_address.as_deref(), Some("02:00:00:00:00:09"));
    let pvc = bound_claim(&c, "copy-root").await;
    assert_eq!(pvc.labels()["copy"], "yes");
    assert_eq!(pvc.owner_references()[0].uid, copy.uid().unwrap());
    assert_eq!(disk(&node, "copy-root"), b"version 1");

    // InPlace: the VM's own claim replaced by the snapshot's data, under its name.
    restore(
        &c,
        "in-place",
        "db",
        "snap",
        "  volumeRestorePolicy: InPlace",
    )
    .await;
    restore_ends(&c, "in-place")
        .await
        .expect("restore completes");
    let db_now = c.api::<VirtualMachine>().get("db").await.unwrap();
    assert_eq!(root_claim(&db_now), "db-root");
    bound_claim(&c, "db-root").await;
    assert_eq!(disk(&node, "db-root"), b"version 1");
    node.stop().await;
    let _ = std::fs::remove_dir_all(&work);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_snapshots_and_restores_are_refused_with_the_reason_and_change_nothing() {
    let work = std::env::temp_dir().join(format!("mv-vmsnap-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let c = Cluster::start().await;
    let _controller = c.replica(test_config(), None);
    let node = ImportNode::start(&c, &work);
    storage(&c, "csi", "csi.example.com", true).await;
    storage(&c, "plain", "nfs.example.com", false).await;

    // A claim whose class has no VolumeSnapshotClass, and a hostDisk: Failed, every volume's
    // reason named, nothing made.
    claim(&c, &node, "a-root", "plain", b"a").await;
    let a = vm(
        &c,
        "a",
        "Halted",
        "a-root",
        "      - name: scratch\n        hostDisk: {path: /var/lib/a.img, type: DiskOrCreate, capacity: 1Gi}",
    )
    .await;
    snapshot(&c, "of-a", "VirtualMachine", "a").await;
    let s = snapshot_ends(&c, "of-a", SnapshotPhase::Failed).await;
    let why = s.status.unwrap().error.unwrap().message.unwrap();
    assert!(
        why.contains(r#"volume "root""#)
            && why.contains(r#""plain""#)
            && why.contains("no VolumeSnapshotClass")
            && why.contains(r#"volume "scratch""#)
            && why.contains("hostDisk"),
        "{why}"
    );
    assert!(c
        .api::<VolumeSnapshot>()
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .is_empty());
    assert!(c
        .api::<VirtualMachineSnapshotContent>()
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .is_empty());

    // A source that is not a VM: the field named.
    snapshot(&c, "of-pod", "Pod", "a").await;
    let s = snapshot_ends(&c, "of-pod", SnapshotPhase::Failed).await;
    let why = s.status.unwrap().error.unwrap().message.unwrap();
    assert!(why.starts_with("spec.source.kind"), "{why}");

    // A source that does not exist (yet): the snapshot waits and says why.
    snapshot(&c, "of-ghost", "VirtualMachine", "ghost").await;
    eventually("snapshot of-ghost waiting for its source", T, || async {
        let s = c
            .api::<VirtualMachineSnapshot>()
            .get("of-ghost")
            .await
            .unwrap();
        let cond = s
            .status?
            .conditions
            .into_iter()
            .find(|c| c.type_ == "Progressing")?;
        (cond.status == "False" && cond.message?.contains(r#""ghost" does not exist"#))
            .then_some(())
    })
    .await;

    // Restores of a missing and of a failed snapshot.
    restore(&c, "from-nothing", "a", "nothing", "").await;
    let why = restore_ends(&c, "from-nothing").await.unwrap_err();
    assert!(
        why.contains(r#"VirtualMachineSnapshot "nothing" does not exist"#),
        "{why}"
    );
    restore(&c, "from-failed", "a", "of-a", "").await;
    let why = restore_ends(&c, "from-failed").await.unwrap_err();
    assert!(why.contains("not ready to use (phase Failed)"), "{why}");

    // A running VM is captured online (crash-consistent, no guest agent).
    claim(&c, &node, "b-root", "csi", b"b").await;
    vm(&c, "b", "Always", "b-root", "").await;
    eventually("VMI b", T, || async { c.vmi("b").await }).await;
    snapshot(&c, "of-b", "VirtualMachine", "b").await;
    let s = snapshot_ends(&c, "of-b", SnapshotPhase::Succeeded).await;
    let ind = format!("{:?}", s.status.unwrap().indications);
    assert_eq!(ind, "[Online, NoGuestAgent]");

    // Onto another VM: refused; that VM and its claims untouched.
    restore(&c, "onto-a", "a", "of-b", "").await;
    let why = restore_ends(&c, "onto-a").await.unwrap_err();
    assert!(
        why.contains(
            r#"spec.target: VirtualMachine "a" exists and is not the VM this snapshot was taken of"#
        ),
        "{why}"
    );
    let a_now = c.api::<VirtualMachine>().get("a").await.unwrap();
    assert_eq!(a_now.spec, a.spec);
    assert!(!a_now.annotations().contains_key(ANNOTATION_LAST_RESTORE));

    // A patch that cannot apply: the patch named, no VM made.
    restore(
        &c,
        "bad-patch",
        "b-copy",
        "of-b",
        "  patches: ['{\"op\": \"remove\", \"path\": \"/spec/nothing\"}']",
    )
    .await;
    let why = restore_ends(&c, "bad-patch").await.unwrap_err();
    assert!(
        why.starts_with("spec.patches[0]: cannot be applied"),
        "{why}"
    );
    assert!(c
        .api::<VirtualMachine>()
        .get_opt("b-copy")
        .await
        .unwrap()
        .is_none());

    // The running target: FailImmediate refuses; StopTarget stops it, then restores.
    restore(
        &c,
        "now",
        "b",
        "of-b",
        "  targetReadinessPolicy: FailImmediate",
    )
    .await;
    let why = restore_ends(&c, "now").await.unwrap_err();
    assert!(why.contains(r#"VirtualMachine "b" is running"#), "{why}");
    let b = c.api::<VirtualMachine>().get("b").await.unwrap();
    assert_eq!(root_claim(&b), "b-root");
    assert_eq!(b.spec.run_strategy, Some(api::RunStrategy::Always));
    restore(
        &c,
        "stop-first",
        "b",
        "of-b",
        "  targetReadinessPolicy: StopTarget",
    )
    .await;
    eventually("VM b stopped by the restore", T, || async {
        let b = c.api::<VirtualMachine>().get("b").await.unwrap();
        c.kubelet_finish_deletions().await;
        (b.spec.run_strategy == Some(api::RunStrategy::Halted)).then_some(())
    })
    .await;
    eventually("VMI b gone", T, || async {
        c.kubelet_finish_deletions().await;
        c.vmi("b").await.is_none().then_some(())
    })
    .await;
    restore_ends(&c, "stop-first")
        .await
        .expect("restore completes");
    let b = c.api::<VirtualMachine>().get("b").await.unwrap();
    assert_ne!(root_claim(&b), "b-root");
    assert_eq!(b.spec.run_strategy, Some(api::RunStrategy::Halted));
    assert!(c
        .api::<VirtualMachineInstance>()
        .get_opt("b")
        .await
        .unwrap()
        .is_none());
    assert_eq!(disk(&node, "b-root"), b"b");
    node.stop().await;
    let _ = std::fs::remove_dir_all(&work);
}
