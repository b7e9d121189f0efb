//! KubeVirt's VM snapshots through the API (`snapshot.kubevirt.io/v1beta1`), end to end against
//! the in-process API server with virt-controller under its deployed RBAC: the storage stand-in
//! binds claims to directories and plays the CSI snapshotter, so what a snapshot captured and
//! what a restore brought back are compared byte for byte on "disk". Bad input ends Failed (or
//! with a Failure condition) naming the field or the volume and why, and changes neither the VM
//! nor its claims.

use std::time::Duration;

use api::cdi::{DataVolume, DataVolumePhase};
use api::clone::{ClonePhase, VirtualMachineClone};
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

// Generous: seven tests share two cores, each with its own API server and controller.
const T: Duration = Duration::from_secs(60);

/// An API server with virt-controller and a storage node keeping its claims under a fresh
/// directory named after `tag`.
async fn site(
    tag: &str,
) -> (
    Cluster,
    tests::cluster::Replica,
    ImportNode,
    std::path::PathBuf,
) {
    let work = std::env::temp_dir().join(format!("{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let c = Cluster::start().await;
    let controller = c.replica(test_config(), None);
    let node = ImportNode::start(&c, &work);
    (c, controller, node, work)
}

async fn finish(node: ImportNode, work: &std::path::Path) {
    node.stop().await;
    let _ = std::fs::remove_dir_all(work);
}

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
    let d = std::fs::read(node.claim_dir(NS, claim).join("disk.img")).unwrap();
    // Compared whole; a mismatch shows a short prefix, not megabytes of image.
    if d.len() > 64 {
        let head = String::from_utf8_lossy(&d[..32]).into_owned();
        return format!("<{} bytes starting {head:?}>", d.len()).into_bytes();
    }
    d
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
    let (c, controller, node, work) = site("mv-vmsnap-ok").await;
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

    // A pass that created the new VM and then lost its status write (a conflict, a crash, a
    // cache that had not seen it yet): the next pass finds the VM it wrote, under a new UID,
    // and finishes instead of refusing it as a VM that is not the snapshot's.
    controller.stop().await;
    restore(&c, "again", "db-again", "snap", "").await;
    let again = c.api::<VirtualMachineRestore>().get("again").await.unwrap();
    let again_uid = again.uid().unwrap();
    let mut written: VirtualMachine = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": "db-again", "annotations": {
            ANNOTATION_LAST_RESTORE: format!("again-{again_uid}")}},
        "spec": db.spec,
    }))
    .unwrap();
    let volumes = &mut written.spec.template.spec.as_mut().unwrap().volumes;
    let root = volumes.iter_mut().find(|v| v.name == "root").unwrap();
    root.persistent_volume_claim.as_mut().unwrap().claim_name = format!("restore-{again_uid}-root");
    let written = c
        .api::<VirtualMachine>()
        .create(&PostParams::default(), &written)
        .await
        .unwrap();
    let _controller = c.replica(test_config(), None);
    let r = restore_ends(&c, "again")
        .await
        .expect("the restore finishes");
    let claim_again = &r.status.unwrap().restores[0].persistent_volume_claim_name;
    let vm_again = c.api::<VirtualMachine>().get("db-again").await.unwrap();
    assert_eq!(vm_again.uid(), written.uid(), "the VM it wrote is kept");
    let pvc = bound_claim(&c, claim_again).await;
    assert_eq!(pvc.owner_references()[0].uid, written.uid().unwrap());
    assert_eq!(disk(&node, claim_again), b"version 1");

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
    finish(node, &work).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_snapshots_and_restores_are_refused_with_the_reason_and_change_nothing() {
    let (c, _controller, node, work) = site("mv-vmsnap-bad").await;
    storage(&c, "csi", "csi.example.com", true).await;
    storage(&c, "plain", "nfs.example.com", false).await;

    // A running VM's claim whose class has no VolumeSnapshotClass (a copy would not be
    // point-in-time), and a hostDisk: Failed, every volume's reason named, nothing made.
    claim(&c, &node, "a-root", "plain", b"a").await;
    let a = vm(
        &c,
        "a",
        "Always",
        "a-root",
        "      - name: scratch\n        hostDisk: {path: /var/lib/a.img, type: DiskOrCreate, capacity: 1Gi}",
    )
    .await;
    eventually("VMI a", T, || async { c.vmi("a").await }).await;
    snapshot(&c, "of-a", "VirtualMachine", "a").await;
    let s = snapshot_ends(&c, "of-a", SnapshotPhase::Failed).await;
    let why = s.status.unwrap().error.unwrap().message.unwrap();
    assert!(
        why.contains(r#"volume "root""#)
            && why.contains(r#""plain""#)
            && why.contains("no VolumeSnapshotClass")
            && why.contains("not be point-in-time while the VM runs")
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
    // The kubelet finishes no deletion while this is watched: the VMI stays until then, so the
    // restore stays held here. Finishing them inside this wait let the restore complete and let
    // go between two looks, and the state was never seen.
    eventually("VM b stopped and held by the restore", T, || async {
        let b = c.api::<VirtualMachine>().get("b").await.unwrap();
        let held = b.status.as_ref()?.restore_in_progress.as_deref() == Some("stop-first");
        (b.spec.run_strategy == Some(api::RunStrategy::Halted) && held).then_some(())
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
    assert_eq!(
        b.status.unwrap().restore_in_progress,
        None,
        "let go once restored"
    );
    assert!(c
        .api::<VirtualMachineInstance>()
        .get_opt("b")
        .await
        .unwrap()
        .is_none());
    assert_eq!(disk(&node, "b-root"), b"b");
    finish(node, &work).await;
}

// ---------------------------------------------------------------------------------------------
// Clones (clone.kubevirt.io/v1beta1)

/// A VM with a root disk on `claim`, two NICs (one with its own MAC), firmware identity, and
/// labels a clone may filter.
async fn vm_with_identity(c: &Cluster, name: &str, claim: &str) -> VirtualMachine {
    c.apply_yaml::<VirtualMachine>(&format!(
        r##"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata:
  name: {name}
  labels: {{app: db, team/secret: "x"}}
  annotations: {{owner: ops}}
spec:
  runStrategy: Halted
  template:
    metadata: {{labels: {{kubevirt.io/vm: {name}}}}}
    spec:
      domain:
        memory: {{guest: 128Mi}}
        firmware: {{uuid: 5d307ca9-b3ef-428c-8861-06e72d69f223, serial: source-serial}}
        devices:
          disks:
          - {{name: root, disk: {{bus: virtio}}}}
          interfaces:
          - {{name: default, masquerade: {{}}, macAddress: "02:00:00:00:00:01"}}
          - {{name: storage, bridge: {{}}}}
      networks:
      - {{name: default, pod: {{}}}}
      - {{name: storage, multus: {{networkName: storage-net}}}}
      volumes:
      - name: root
        persistentVolumeClaim: {{claimName: {claim}}}
"##
    ))
    .await
}

async fn clone_of(c: &Cluster, name: &str, spec: &str) -> VirtualMachineClone {
    c.apply_yaml::<VirtualMachineClone>(&format!(
        "apiVersion: clone.kubevirt.io/v1beta1
kind: VirtualMachineClone
metadata: {{name: {name}}}
spec:
{spec}"
    ))
    .await
}

/// The clone once it has ended in `phase`; on timeout, its status and the restores are shown.
async fn clone_ends(c: &Cluster, name: &str, phase: ClonePhase) -> VirtualMachineClone {
    let start = std::time::Instant::now();
    loop {
        let v = c.api::<VirtualMachineClone>().get(name).await.unwrap();
        if v.status.as_ref().and_then(|s| s.phase) == Some(phase) {
            return v;
        }
        if start.elapsed() > T {
            let restores = c.api::<VirtualMachineRestore>();
            let restores: Vec<_> = restores.list(&Default::default()).await.unwrap().items;
            let restores: Vec<_> = restores
                .into_iter()
                .map(|r| (r.name_any(), r.status))
                .collect();
            panic!(
                "timed out after {T:?} waiting for clone {name} {phase:?}; its status: {}; the \
                 restores: {}",
                serde_json::to_string(&v.status).unwrap(),
                serde_json::to_string(&restores).unwrap()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn failure_of(clone: &VirtualMachineClone) -> String {
    let st = clone.status.as_ref().unwrap();
    let ready = st.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
    assert_eq!(ready.status, "False");
    ready.message.clone().unwrap_or_default()
}

fn interfaces(vm: &VirtualMachine) -> Vec<api::Interface> {
    vm.spec
        .template
        .spec
        .as_ref()
        .unwrap()
        .domain
        .devices
        .interfaces
        .clone()
}

/// The MAC the guest's first NIC gets when the VM runs (its VMI has the VM's name).
fn guest_mac(vm: &VirtualMachine) -> String {
    api::mac::display(&api::mac::of_interface(&vm.name_any(), &interfaces(vm)[0]).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clones_get_their_own_identity_and_disks_and_leave_the_source_alone() {
    let (c, _controller, node, work) = site("mv-vmclone-ok").await;
    storage(&c, "csi", "csi.example.com", true).await;
    claim(&c, &node, "db-root", "csi", b"version 1").await;
    let db = vm_with_identity(&c, "db", "db-root").await;

    // From a VM: snapshotted, restored into the target with the filters and new MACs applied,
    // the clone's snapshot and restore gone once it is done.
    clone_of(
        &c,
        "from-vm",
        r#"  source: {apiGroup: kubevirt.io, kind: VirtualMachine, name: db}
  target: {apiGroup: kubevirt.io, kind: VirtualMachine, name: db-clone}
  labelFilters: ["*", "!team/*"]
  newMacAddresses: {storage: "02:00:00:00:00:aa"}
  newSMBiosSerial: clone-serial"#,
    )
    .await;
    let done = clone_ends(&c, "from-vm", ClonePhase::Succeeded).await;
    let st = done.status.clone().unwrap();
    let uid = done.uid().unwrap();
    assert_eq!(st.target_name.as_deref(), Some("db-clone"));
    assert_eq!(st.snapshot_name, Some(format!("tmp-snapshot-{uid}")));
    assert_eq!(st.restore_name, Some(format!("tmp-restore-{uid}")));
    assert!(st.creation_time.is_some());
    let ready = st.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
    assert_eq!(ready.status, "True");
    let copy = c.api::<VirtualMachine>().get("db-clone").await.unwrap();
    assert_ne!(copy.uid(), db.uid());
    assert_eq!(copy.labels().get("app").map(String::as_str), Some("db"));
    assert!(
        !copy.labels().contains_key("team/secret"),
        "{:?}",
        copy.labels()
    );
    assert_eq!(copy.annotations()["owner"], "ops");
    let nics = interfaces(&copy);
    assert_eq!(nics[0].mac_address, None, "the source's MAC is not carried");
    assert_eq!(nics[1].mac_address.as_deref(), Some("02:00:00:00:00:aa"));
    assert_ne!(guest_mac(&copy), guest_mac(&db));
    let fw = copy
        .spec
        .template
        .spec
        .as_ref()
        .unwrap()
        .domain
        .firmware
        .clone()
        .unwrap();
    assert_eq!(fw.uuid, None);
    assert_eq!(fw.serial.as_deref(), Some("clone-serial"));
    let copy_claim = root_claim(&copy);
    assert_ne!(copy_claim, "db-root");
    assert_eq!(disk(&node, &copy_claim), b"version 1");
    eventually("the clone's snapshot and restore deleted", T, || async {
        let snaps = c
            .api::<VirtualMachineSnapshot>()
            .list(&Default::default())
            .await
            .unwrap();
        let restores = c
            .api::<VirtualMachineRestore>()
            .list(&Default::default())
            .await
            .unwrap();
        (snaps.items.is_empty() && restores.items.is_empty()).then_some(())
    })
    .await;
    // The clone's disk is its own.
    write_disk(&node, &copy_claim, b"written by db-clone");
    assert_eq!(disk(&node, "db-root"), b"version 1");
    let db_now = c.api::<VirtualMachine>().get("db").await.unwrap();
    assert_eq!(db_now.spec, db.spec);
    assert_eq!(db_now.labels(), db.labels());

    // Two clones of one snapshot, no target named: two new VMs, different MACs, each with its
    // own disk; the snapshot (not the clones' own) stays, its data unchanged.
    snapshot(&c, "golden", "VirtualMachine", "db").await;
    let golden = snapshot_ends(&c, "golden", SnapshotPhase::Succeeded).await;
    let source =
        "  source: {apiGroup: snapshot.kubevirt.io, kind: VirtualMachineSnapshot, name: golden}";
    clone_of(&c, "one", source).await;
    clone_of(
        &c,
        "two",
        &format!("{source}\n  newMacAddresses: {{default: \"02:00:00:00:00:02\"}}"),
    )
    .await;
    let one = clone_ends(&c, "one", ClonePhase::Succeeded).await;
    let two = clone_ends(&c, "two", ClonePhase::Succeeded).await;
    let name_one = one.status.unwrap().target_name.unwrap();
    let name_two = two.status.unwrap().target_name.unwrap();
    assert!(
        name_one.starts_with("clone-") && name_one != name_two,
        "{name_one} {name_two}"
    );
    let vm_one = c.api::<VirtualMachine>().get(&name_one).await.unwrap();
    let vm_two = c.api::<VirtualMachine>().get(&name_two).await.unwrap();
    assert_eq!(
        interfaces(&vm_two)[0].mac_address.as_deref(),
        Some("02:00:00:00:00:02")
    );
    let macs = [guest_mac(&db), guest_mac(&vm_one), guest_mac(&vm_two)];
    assert!(
        macs[0] != macs[1] && macs[1] != macs[2] && macs[0] != macs[2],
        "{macs:?}"
    );
    let (claim_one, claim_two) = (root_claim(&vm_one), root_claim(&vm_two));
    assert_ne!(claim_one, claim_two);
    write_disk(&node, &claim_one, b"one");
    write_disk(&node, &claim_two, b"two");
    assert_eq!(disk(&node, &claim_one), b"one");
    assert_eq!(disk(&node, &claim_two), b"two");
    assert!(c
        .api::<VirtualMachineSnapshot>()
        .get_opt("golden")
        .await
        .unwrap()
        .is_some());
    let vs = golden
        .status
        .unwrap()
        .virtual_machine_snapshot_content_name
        .unwrap();
    let content = c
        .api::<VirtualMachineSnapshotContent>()
        .get(&vs)
        .await
        .unwrap();
    let vs_name = content.spec.volume_backups[0]
        .volume_snapshot_name
        .clone()
        .unwrap();
    let kept = work
        .join(".snapshots")
        .join(NS)
        .join(&vs_name)
        .join("disk.img");
    assert_eq!(std::fs::read(kept).unwrap(), b"version 1");
    finish(node, &work).await;
}

/// Every step of a clone may run again after its status write is lost (a conflict, a crash):
/// it must find what it made where it left it, and not fail on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clones_finish_when_their_status_writes_are_lost() {
    let (c, _controller, node, work) = site("mv-vmclone-lost").await;
    storage(&c, "csi", "csi.example.com", true).await;
    claim(&c, &node, "db-root", "csi", b"version 1").await;
    vm_with_identity(&c, "db", "db-root").await;
    snapshot(&c, "golden", "VirtualMachine", "db").await;
    snapshot_ends(&c, "golden", SnapshotPhase::Succeeded).await;
    let put = Some(axum::http::Method::PUT);
    let claims_post = "/namespaces/default/persistentvolumeclaims";

    // The pass that makes the restore never gets its phase written: every later pass starts
    // over, and finds the target VM that restore made.
    let status = "/virtualmachineclones/of-snapshot/status";
    c.api.fail_requests(put.clone(), status, 409, u64::MAX);
    let source =
        "  source: {apiGroup: snapshot.kubevirt.io, kind: VirtualMachineSnapshot, name: golden}";
    let one = clone_of(&c, "of-snapshot", source).await;
    clone_succeeds_once(&c, &one, status).await;

    // The pass that ends the clone loses its write: the next one must find the restore it
    // waited on still there. The restore's claim is held back until the clone waits on it.
    c.api
        .fail_requests(Some(axum::http::Method::POST), claims_post, 503, u64::MAX);
    let source = "  source: {apiGroup: kubevirt.io, kind: VirtualMachine, name: db}";
    let two = clone_of(&c, "of-vm", source).await;
    eventually("of-vm restoring", T, || async {
        let v = c.api::<VirtualMachineClone>().get("of-vm").await.unwrap();
        (v.status?.phase? == ClonePhase::RestoreInProgress).then_some(())
    })
    .await;
    let status = "/virtualmachineclones/of-vm/status";
    c.api.fail_requests(put, status, 409, u64::MAX);
    c.api.clear_faults(claims_post);
    clone_succeeds_once(&c, &two, status).await;

    // The source snapshot of the first clone stays.
    assert!(c
        .api::<VirtualMachineSnapshot>()
        .get_opt("golden")
        .await
        .unwrap()
        .is_some());
    finish(node, &work).await;
}

/// Once the clone's restore is complete and the target's claim bound, and its passes (every
/// 2 s, and retried after each refused write) have had time to see that, the clone's status
/// writes (refused at `status_path`) are let through: it must end Succeeded into the VM its
/// restore made, once, with its restore and own snapshot deleted.
async fn clone_succeeds_once(c: &Cluster, clone: &VirtualMachineClone, status_path: &str) {
    let restore = format!("tmp-restore-{}", clone.uid().unwrap());
    let target = eventually(&format!("{restore} complete"), T, || async {
        let r = c
            .api::<VirtualMachineRestore>()
            .get_opt(&restore)
            .await
            .unwrap()?;
        (r.status?.complete == Some(true)).then_some(r.spec.target.name)
    })
    .await;
    let vm = c.api::<VirtualMachine>().get(&target).await.unwrap();
    bound_claim(c, &root_claim(&vm)).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    c.api.clear_faults(status_path);

    let done = clone_ends(c, &clone.name_any(), ClonePhase::Succeeded).await;
    assert_eq!(done.status.unwrap().target_name, Some(target.clone()));
    let vm_now = c.api::<VirtualMachine>().get(&target).await.unwrap();
    assert_eq!(vm_now.uid(), vm.uid(), "the target was made once");
    let temporary = format!("tmp-snapshot-{}", clone.uid().unwrap());
    eventually("the clone's restore and snapshot deleted", T, || async {
        let restores = c.api::<VirtualMachineRestore>();
        let snapshots = c.api::<VirtualMachineSnapshot>();
        let gone = restores.get_opt(&restore).await.unwrap().is_none();
        (gone && snapshots.get_opt(&temporary).await.unwrap().is_none()).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_clones_are_refused_with_the_reason_and_change_nothing() {
    let (c, _controller, node, work) = site("mv-vmclone-bad").await;
    storage(&c, "csi", "csi.example.com", true).await;
    claim(&c, &node, "db-root", "csi", b"db").await;
    let db = vm_with_identity(&c, "db", "db-root").await;
    let vm_source = "  source: {apiGroup: kubevirt.io, kind: VirtualMachine, name: db}";
    let no_vms = |names: &'static [&'static str]| {
        let c = c.clone_handle();
        async move {
            for n in names {
                assert!(
                    c.api::<VirtualMachine>()
                        .get_opt(n)
                        .await
                        .unwrap()
                        .is_none(),
                    "{n}"
                );
            }
        }
    };

    // A snapshot that is not ready (its VM does not exist yet): the clone waits, the reason
    // on its conditions, and makes nothing.
    snapshot(&c, "pending", "VirtualMachine", "ghost").await;
    clone_of(
        &c,
        "of-pending",
        "  source: {apiGroup: snapshot.kubevirt.io, kind: VirtualMachineSnapshot, name: pending}
  target: {apiGroup: kubevirt.io, kind: VirtualMachine, name: never}",
    )
    .await;
    eventually("clone of-pending says why it waits", T, || async {
        let v = c
            .api::<VirtualMachineClone>()
            .get("of-pending")
            .await
            .unwrap();
        let st = v.status?;
        let ready = st.conditions.iter().find(|c| c.type_ == "Ready")?;
        (st.phase == Some(ClonePhase::CreatingTargetVm)
            && ready.reason.as_deref() == Some("SnapshotNotReady")
            && ready
                .message
                .as_deref()?
                .contains(r#""pending" is not ready to use"#))
        .then_some(())
    })
    .await;
    no_vms(&["never"]).await;

    // A failed snapshot: Failed with its reason.
    snapshot(&c, "broken", "Pod", "db").await;
    snapshot_ends(&c, "broken", SnapshotPhase::Failed).await;
    clone_of(
        &c,
        "of-broken",
        "  source: {apiGroup: snapshot.kubevirt.io, kind: VirtualMachineSnapshot, name: broken}",
    )
    .await;
    let v = clone_ends(&c, "of-broken", ClonePhase::Failed).await;
    let why = failure_of(&v);
    assert!(
        why.contains(r#""broken" failed and cannot be cloned: spec.source.kind"#),
        "{why}"
    );

    // A MAC for an interface the VM does not have: refused after the snapshot, which is
    // deleted; no VM made.
    clone_of(
        &c,
        "bad-mac",
        &format!("{vm_source}\n  target: {{apiGroup: kubevirt.io, kind: VirtualMachine, name: bad-mac-vm}}\n  newMacAddresses: {{eth7: \"02:00:00:00:00:07\"}}"),
    )
    .await;
    let v = clone_ends(&c, "bad-mac", ClonePhase::Failed).await;
    let why = failure_of(&v);
    assert!(
        why.starts_with("spec.newMacAddresses[eth7]: the source VM has no interface \"eth7\""),
        "{why}"
    );
    no_vms(&["bad-mac-vm"]).await;
    let tmp = format!("tmp-snapshot-{}", v.uid().unwrap());
    eventually("bad-mac's snapshot deleted", T, || async {
        c.api::<VirtualMachineSnapshot>()
            .get_opt(&tmp)
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;

    // A target that exists, a source that is not a VM or snapshot, a patch that is not one.
    clone_of(
        &c,
        "onto-db",
        &format!(
            "{vm_source}\n  target: {{apiGroup: kubevirt.io, kind: VirtualMachine, name: db}}"
        ),
    )
    .await;
    let why = failure_of(&clone_ends(&c, "onto-db", ClonePhase::Failed).await);
    assert!(
        why.starts_with(r#"spec.target: VirtualMachine "db" exists"#),
        "{why}"
    );
    clone_of(&c, "of-pod", "  source: {kind: Pod, name: db}").await;
    let why = failure_of(&clone_ends(&c, "of-pod", ClonePhase::Failed).await);
    assert!(
        why.starts_with("spec.source:") && why.contains("cannot be cloned"),
        "{why}"
    );
    clone_of(
        &c,
        "bad-patch",
        &format!("{vm_source}\n  patches: ['not a patch']"),
    )
    .await;
    let why = failure_of(&clone_ends(&c, "bad-patch", ClonePhase::Failed).await);
    assert!(
        why.starts_with("spec.patches[0]: not a JSON patch"),
        "{why}"
    );

    // None of it touched the source.
    let db_now = c.api::<VirtualMachine>().get("db").await.unwrap();
    assert_eq!(db_now.spec, db.spec);
    assert_eq!(db_now.metadata.labels, db.metadata.labels);
    assert_eq!(disk(&node, "db-root"), b"db");
    let vms = c
        .api::<VirtualMachine>()
        .list(&Default::default())
        .await
        .unwrap();
    assert_eq!(
        vms.items.len(),
        1,
        "only db: {:?}",
        vms.items.iter().map(|v| v.name_any()).collect::<Vec<_>>()
    );
    finish(node, &work).await;
}

/// KubeVirt's locks: a VM held by a restore is neither captured nor started until the restore
/// lets go; a snapshot holds its VM while it captures it and always lets go (done or failed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_and_restores_hold_the_vm_while_they_work() {
    let (c, _controller, node, work) = site("mv-vmsnap-lock").await;
    storage(&c, "csi", "csi.example.com", true).await;
    claim(&c, &node, "l-root", "csi", b"l").await;
    vm(&c, "l", "Halted", "l-root", "").await;
    let vms = c.api::<VirtualMachine>();
    let lock = |field: &str, holder: Option<&str>| json!({"status": {field: holder}});
    let set = |p: serde_json::Value| {
        let vms = vms.clone();
        async move {
            vms.patch_status("l", &Default::default(), &kube::api::Patch::Merge(&p))
                .await
                .unwrap();
        }
    };

    // Held by a restore (one that does not exist: a stale lock is the user's to clear): the
    // snapshot waits and says why, and the VM asked to run is not started.
    set(lock("restoreInProgress", Some("elsewhere"))).await;
    snapshot(&c, "held", "VirtualMachine", "l").await;
    eventually("snapshot held waits for the restore", T, || async {
        let s = c.api::<VirtualMachineSnapshot>().get("held").await.unwrap();
        let cond = s
            .status?
            .conditions
            .into_iter()
            .find(|c| c.type_ == "Progressing")?;
        (cond.status == "False"
            && cond
                .message?
                .contains(r#"VirtualMachineRestore "elsewhere" is writing it"#))
        .then_some(())
    })
    .await;
    let p = json!({"spec": {"runStrategy": "Always"}});
    vms.patch("l", &Default::default(), &kube::api::Patch::Merge(&p))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        c.vmi("l").await.is_none(),
        "a VMI started while the VM was held"
    );

    // Let go (the VM halted again, and no snapshotter on the node, so the capture lasts):
    // the snapshot holds the VM, which asked to run is still not started.
    node.stop().await;
    let halt = json!({"spec": {"runStrategy": "Halted"}});
    vms.patch("l", &Default::default(), &kube::api::Patch::Merge(&halt))
        .await
        .unwrap();
    set(lock("restoreInProgress", None)).await;
    eventually("the snapshot holds the VM", T, || async {
        let st = vms.get("l").await.unwrap().status?;
        (st.snapshot_in_progress.as_deref() == Some("held")).then_some(())
    })
    .await;
    vms.patch("l", &Default::default(), &kube::api::Patch::Merge(&p))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        c.vmi("l").await.is_none(),
        "a VMI started while the VM was captured"
    );

    // The snapshotter back: the capture completes, the snapshot lets go, the VM starts.
    let node = ImportNode::start(&c, &work);
    let s = snapshot_ends(&c, "held", SnapshotPhase::Succeeded).await;
    assert!(
        s.status.unwrap().indications.is_empty(),
        "captured before the VM started"
    );
    eventually("VMI l started once nothing holds the VM", T, || async {
        c.vmi("l").await
    })
    .await;
    let st = vms.get("l").await.unwrap().status.unwrap();
    assert_eq!(
        (st.snapshot_in_progress, st.restore_in_progress),
        (None, None)
    );

    // A restore deleted while it waits for the running VM to stop lets go of it on its way.
    restore(
        &c,
        "waits",
        "l",
        "held",
        "  targetReadinessPolicy: WaitEventually",
    )
    .await;
    eventually("the restore holds the running VM", T, || async {
        let st = vms.get("l").await.unwrap().status?;
        (st.restore_in_progress.as_deref() == Some("waits")).then_some(())
    })
    .await;
    let restores = c.api::<VirtualMachineRestore>();
    restores.delete("waits", &Default::default()).await.unwrap();
    eventually("the deleted restore let go", T, || async {
        let st = vms.get("l").await.unwrap().status?;
        let gone = restores.get_opt("waits").await.unwrap().is_none();
        (gone && st.restore_in_progress.is_none()).then_some(())
    })
    .await;

    // A failed snapshot lets go too.
    snapshot(&c, "online", "VirtualMachine", "l").await;
    let p = json!({"spec": {"runStrategy": "Halted"}});
    vms.patch("l", &Default::default(), &kube::api::Patch::Merge(&p))
        .await
        .unwrap();
    snapshot_ends(&c, "online", SnapshotPhase::Succeeded).await;
    let mut missing = vms.get("l").await.unwrap();
    missing.metadata.managed_fields = None;
    let spec = missing.spec.template.spec.as_mut().unwrap();
    spec.volumes[0]
        .persistent_volume_claim
        .as_mut()
        .unwrap()
        .claim_name = "nowhere".into();
    vms.replace("l", &Default::default(), &missing)
        .await
        .unwrap();
    snapshot(&c, "fails", "VirtualMachine", "l").await;
    snapshot_ends(&c, "fails", SnapshotPhase::Failed).await;
    let st = vms.get("l").await.unwrap().status.unwrap();
    assert_eq!(st.snapshot_in_progress, None);
    finish(node, &work).await;
}

/// Storage without CSI snapshots: a stopped VM's claim is captured as a full copy (a DataVolume
/// cloning it, held by the content), restored and cloned through DataVolumes the VM makes and
/// waits for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_without_csi_snapshots_are_copied_while_the_vm_is_stopped() {
    let (c, _controller, node, work) = site("mv-vmsnap-copy").await;
    storage(&c, "plain", "nfs.example.com", false).await;
    claim(&c, &node, "p-root", "plain", b"version 1").await;
    vm(&c, "p", "Halted", "p-root", "").await;

    snapshot(&c, "copied", "VirtualMachine", "p").await;
    let s = snapshot_ends(&c, "copied", SnapshotPhase::Succeeded).await;
    let st = s.status.unwrap();
    assert_eq!(st.ready_to_use, Some(true));
    let content = c
        .api::<VirtualMachineSnapshotContent>()
        .get(st.virtual_machine_snapshot_content_name.as_deref().unwrap())
        .await
        .unwrap();
    let backup = &content.spec.volume_backups[0];
    assert_eq!(backup.volume_snapshot_name, None);
    let copy = backup.copy_claim_name.clone().expect("a copy");
    let dv = c.api::<DataVolume>().get(&copy).await.unwrap();
    assert_eq!(dv.owner_references()[0].uid, content.uid().unwrap());
    assert_eq!(disk(&node, &copy), b"version 1");
    assert!(c
        .api::<VolumeSnapshot>()
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .is_empty());

    // Restored onto the VM after its disk changed: a DataVolume template cloning the copy,
    // the VM's volume on it; the copy and the changed claim untouched.
    write_disk(&node, "p-root", b"version 2");
    restore(&c, "back", "p", "copied", "").await;
    let r = restore_ends(&c, "back").await.expect("restore completes");
    let restored = r.status.as_ref().unwrap().restores[0].clone();
    let name = restored.persistent_volume_claim_name.clone();
    assert_eq!(restored.data_volume_name.as_deref(), Some(name.as_str()));
    let p = c.api::<VirtualMachine>().get("p").await.unwrap();
    let root = &p.spec.template.spec.as_ref().unwrap().volumes[0];
    assert_eq!(root.data_volume.as_ref().unwrap().name, name);
    assert!(root.persistent_volume_claim.is_none());
    eventually("the restored DataVolume copied", T, || async {
        let dv = c.api::<DataVolume>().get_opt(&name).await.unwrap()?;
        (dv.status?.phase? == DataVolumePhase::Succeeded).then_some(())
    })
    .await;
    assert_eq!(disk(&node, &name), b"version 1");
    assert_eq!(disk(&node, "p-root"), b"version 2");
    assert_eq!(disk(&node, &copy), b"version 1");

    // Cloned: the clone waits for its DataVolume, then lets its restore go.
    clone_of(
        &c,
        "from-copy",
        "  source: {apiGroup: snapshot.kubevirt.io, kind: VirtualMachineSnapshot, name: copied}",
    )
    .await;
    let done = clone_ends(&c, "from-copy", ClonePhase::Succeeded).await;
    let vm_name = done.status.unwrap().target_name.unwrap();
    let cloned = c.api::<VirtualMachine>().get(&vm_name).await.unwrap();
    let dv_name = cloned.spec.template.spec.as_ref().unwrap().volumes[0]
        .data_volume
        .clone()
        .unwrap()
        .name;
    assert_eq!(disk(&node, &dv_name), b"version 1");

    // InPlace cannot be served for a copy: refused, the VM unchanged.
    restore(
        &c,
        "in-place",
        "p",
        "copied",
        "  volumeRestorePolicy: InPlace",
    )
    .await;
    let why = restore_ends(&c, "in-place").await.unwrap_err();
    assert!(why.contains("InPlace is not served"), "{why}");
    assert_eq!(
        c.api::<VirtualMachine>().get("p").await.unwrap().spec,
        p.spec
    );
    finish(node, &work).await;
}

/// With virt-controller's webhook registered from `deploy/webhook.yaml`, a snapshot, restore or
/// clone that can be judged bad on its own is refused when it is created (422, the field named),
/// and none can have its spec changed once created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_at_admission_and_specs_are_fixed() {
    use api::migratability::EvictionStrategy;
    let c = Cluster::start().await;
    let webhook =
        tests::admission::start_webhook(Some(c.client.clone()), EvictionStrategy::None).await;
    webhook.register(&c.api).await;
    let create = |yaml: String| {
        let client = c.client.clone();
        async move {
            let obj: DynamicObject = serde_yaml::from_str(&yaml).unwrap();
            let gvk = kube::api::GroupVersionKind::try_from(obj.types.as_ref().unwrap()).unwrap();
            let (ar, _) = kube::discovery::pinned_kind(&client, &gvk).await.unwrap();
            let api = Api::<DynamicObject>::namespaced_with(client, NS, &ar);
            match api.create(&PostParams::default(), &obj).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(e)) => Err((e.code, e.message)),
                Err(e) => panic!("{e}"),
            }
        }
    };
    let refused = |r: Result<(), (u16, String)>, field: &str| {
        let (code, message) = r.expect_err("refused");
        assert_eq!(code, 422, "{message}");
        assert!(message.contains(field), "{field}: {message}");
    };
    let snap = |source: &str, extra: &str| {
        format!("apiVersion: snapshot.kubevirt.io/v1beta1\nkind: VirtualMachineSnapshot\nmetadata: {{name: s}}\nspec:\n  source: {source}\n{extra}")
    };
    refused(
        create(snap("{apiGroup: kubevirt.io, kind: Pod, name: x}", "")).await,
        "spec.source.kind: must be VirtualMachine",
    );
    refused(
        create(snap(
            "{apiGroup: kubevirt.io, kind: VirtualMachine, name: x}",
            "  failureDeadline: soon",
        ))
        .await,
        "spec.failureDeadline",
    );
    let restore = |extra: &str| {
        format!("apiVersion: snapshot.kubevirt.io/v1beta1\nkind: VirtualMachineRestore\nmetadata: {{name: r}}\nspec:\n  target: {{apiGroup: kubevirt.io, kind: VirtualMachine, name: x}}\n{extra}")
    };
    refused(
        create(restore(
            "  virtualMachineSnapshotName: s\n  patches: ['nope']",
        ))
        .await,
        "spec.patches[0]",
    );
    refused(
        create(restore("  virtualMachineSnapshotName: ''")).await,
        "spec.virtualMachineSnapshotName",
    );
    let clone = |extra: &str| {
        format!("apiVersion: clone.kubevirt.io/v1beta1\nkind: VirtualMachineClone\nmetadata: {{name: k}}\nspec:\n  source: {{apiGroup: kubevirt.io, kind: VirtualMachine, name: x}}\n{extra}")
    };
    refused(
        create(clone("  newMacAddresses: {default: zz}")).await,
        "spec.newMacAddresses[default]",
    );
    refused(
        create(clone("  labelFilters: ['!']")).await,
        "spec.labelFilters[0]",
    );
    refused(
        create(clone(
            "  target: {apiGroup: kubevirt.io, kind: VirtualMachineInstance, name: y}",
        ))
        .await,
        "spec.target.kind",
    );

    // Good ones are admitted; their spec is then fixed (metadata is not).
    create(snap(
        "{apiGroup: kubevirt.io, kind: VirtualMachine, name: x}",
        "",
    ))
    .await
    .unwrap();
    create(clone("")).await.unwrap();
    let snapshots = c.api::<VirtualMachineSnapshot>();
    let mut s = snapshots.get("s").await.unwrap();
    s.spec.source.name = "other".into();
    let err = snapshots
        .replace("s", &PostParams::default(), &s)
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("cannot be changed after it is created"),
        "{err}"
    );
    let p = json!({"metadata": {"labels": {"kept": "yes"}}});
    snapshots
        .patch("s", &Default::default(), &kube::api::Patch::Merge(&p))
        .await
        .unwrap();
    let clones = c.api::<VirtualMachineClone>();
    let p = json!({"spec": {"newMacAddresses": {"default": "02:00:00:00:00:05"}}});
    let err = clones
        .patch("k", &Default::default(), &kube::api::Patch::Merge(&p))
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("cannot be changed after it is created"),
        "{err}"
    );
}

/// CDI's `source.snapshot`: a DataVolume provisioned from a VolumeSnapshot (no importer), and a
/// VirtualMachinePool whose template's DataVolume comes from one: each member's DataVolume is
/// indexed (`root-<ordinal>`, as KubeVirt's pool names them) and holds its own copy of the
/// snapshot's disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_volumes_and_pools_start_from_a_volume_snapshot() {
    use api::VirtualMachinePool;
    let (c, _controller, node, work) = site("mv-vmsnap-pool").await;
    storage(&c, "csi", "csi.example.com", true).await;
    claim(&c, &node, "golden-root", "csi", b"golden").await;
    vm(&c, "golden", "Halted", "golden-root", "").await;
    snapshot(&c, "golden", "VirtualMachine", "golden").await;
    let s = snapshot_ends(&c, "golden", SnapshotPhase::Succeeded).await;
    let content = c
        .api::<VirtualMachineSnapshotContent>()
        .get(
            s.status
                .unwrap()
                .virtual_machine_snapshot_content_name
                .as_deref()
                .unwrap(),
        )
        .await
        .unwrap();
    let vs = content.spec.volume_backups[0]
        .volume_snapshot_name
        .clone()
        .unwrap();
    let dv_done = |name: String| {
        let c = c.clone_handle();
        async move {
            eventually(&format!("DataVolume {name} Succeeded"), T, || async {
                let dv = c.api::<DataVolume>().get_opt(&name).await.unwrap()?;
                (dv.status?.phase? == DataVolumePhase::Succeeded).then_some(())
            })
            .await
        }
    };

    c.apply_yaml::<DataVolume>(&format!(
        "apiVersion: cdi.kubevirt.io/v1beta1\nkind: DataVolume\nmetadata: {{name: one}}\nspec:\n  source: {{snapshot: {{name: {vs}}}}}\n  storage: {{storageClassName: csi}}"
    ))
    .await;
    dv_done("one".into()).await;
    let pvc = c.api::<PersistentVolumeClaim>().get("one").await.unwrap();
    let source = pvc.spec.unwrap().data_source.unwrap();
    assert_eq!(
        (source.kind.as_str(), source.name.as_str()),
        ("VolumeSnapshot", vs.as_str())
    );
    assert_eq!(disk(&node, "one"), b"golden");
    let pods = c
        .api::<k8s_openapi::api::core::v1::Pod>()
        .list(&Default::default())
        .await
        .unwrap();
    assert!(pods.items.is_empty(), "no importer runs for a snapshot");

    c.apply_yaml::<VirtualMachinePool>(&format!(
        r#"
apiVersion: pool.kubevirt.io/v1beta1
kind: VirtualMachinePool
metadata: {{name: sandbox}}
spec:
  replicas: 3
  selector: {{matchLabels: {{kubevirt.io/vmpool: sandbox}}}}
  virtualMachineTemplate:
    metadata: {{labels: {{kubevirt.io/vmpool: sandbox}}}}
    spec:
      runStrategy: Halted
      dataVolumeTemplates:
      - metadata: {{name: root}}
        spec:
          source: {{snapshot: {{name: {vs}}}}}
          storage: {{storageClassName: csi}}
      template:
        metadata: {{labels: {{kubevirt.io/vmpool: sandbox}}}}
        spec:
          domain:
            memory: {{guest: 64Mi}}
            devices:
              disks: [{{name: root, disk: {{bus: virtio}}}}]
          volumes:
          - {{name: root, dataVolume: {{name: root}}}}
"#
    ))
    .await;
    for n in 0..3 {
        let vm = eventually(&format!("VM sandbox-{n}"), T, || async {
            c.api::<VirtualMachine>()
                .get_opt(&format!("sandbox-{n}"))
                .await
                .unwrap()
        })
        .await;
        let volume = &vm.spec.template.spec.as_ref().unwrap().volumes[0];
        assert_eq!(
            volume.data_volume.as_ref().unwrap().name,
            format!("root-{n}")
        );
        dv_done(format!("root-{n}")).await;
        assert_eq!(disk(&node, &format!("root-{n}")), b"golden");
    }
    write_disk(&node, "root-0", b"written by sandbox-0");
    assert_eq!(disk(&node, "root-1"), b"golden");
    assert_eq!(disk(&node, "golden-root"), b"golden");

    // A snapshot that does not exist: the DataVolume fails naming the field.
    c.apply_yaml::<DataVolume>(
        "apiVersion: cdi.kubevirt.io/v1beta1\nkind: DataVolume\nmetadata: {name: nothing}\nspec:\n  source: {snapshot: {name: ghost}}\n  storage: {storageClassName: csi, resources: {requests: {storage: 64Mi}}}",
    )
    .await;
    let why = eventually("DataVolume nothing Failed", T, || async {
        let dv = c.api::<DataVolume>().get("nothing").await.unwrap();
        let st = dv.status?;
        (st.phase? == DataVolumePhase::Failed).then(|| {
            st.conditions
                .iter()
                .find(|c| c.type_ == "Ready")
                .and_then(|c| c.message.clone())
                .unwrap_or_default()
        })
    })
    .await;
    assert!(
        why.contains("spec.source.snapshot.name") && why.contains("ghost"),
        "{why}"
    );
    finish(node, &work).await;
}
