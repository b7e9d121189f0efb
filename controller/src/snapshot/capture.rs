//! The VirtualMachineSnapshot reconciler: a `match` on where the snapshot stands.
//!
//! 1. `Planning`: the source VM is read and held (`status.snapshotInProgress`: no VMI starts
//!    until the capture is done; a VM a restore holds is waited for), then every volume judged
//!    (`api::snapshot::capture_of`): a claim must be bound; where its storage class has a
//!    VolumeSnapshotClass for its provisioner a CSI snapshot is taken, otherwise a full copy —
//!    refused while the VM runs, as it would not be point-in-time; a volume made from the spec
//!    (container disks, cloud-init, …) is listed as excluded; anything else fails the snapshot
//!    before anything is written. The content is then made: the VM as it is and one backup per
//!    claim.
//! 2. `Capturing`: a VolumeSnapshot (or a copying DataVolume) per backup, controlled by the
//!    content, followed until each is ready — or reports an error, which fails the snapshot.
//!    Done or failed, the VM is let go.
//! 3. `Done`: phase Succeeded, `readyToUse`.
//!
//! A running VM is captured crash-consistently (indications `Online`, `NoGuestAgent`): microvirt
//! has no guest agent to freeze the guest's filesystems with. Beyond KubeVirt, where the cluster
//! names a `vmStateStorageClass`, a running VM's memory and machine state are captured too, into
//! a claim the content names ([`api::snapshot::ANNOTATION_STATE_CLAIM`]), by virt-handler on the
//! VMI's node (the protocol is at [`api::snapshot::ANNOTATION_CAPTURE_STATE`]); the disks'
//! VolumeSnapshots are cut while that guest is still paused, so a restore resumes memory and
//! disks of one instant.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use api::cdi::{ClaimSource, DataVolume, DataVolumePhase, DataVolumeSource, DataVolumeSpec};
use api::snapshot::{
    capture_of, check_vm_reference, content_name, volume_snapshot_name, BackedUpClaim,
    DeletionPolicy, Indication, SnapshotPhase, SnapshotSource, SnapshotVolumesLists, SnapshottedVm,
    SourceIndication, VirtualMachineSnapshot, VirtualMachineSnapshotContent,
    VirtualMachineSnapshotContentSpec, VirtualMachineSnapshotContentStatus,
    VirtualMachineSnapshotStatus, VolumeBackup, VolumeCapture, VolumeSnapshot,
    VolumeSnapshotSource, VolumeSnapshotSpec, VolumeSnapshotStatus, ANNOTATION_CAPTURE_STATE,
    ANNOTATION_STATE_CLAIM, CONDITION_STATE_CAPTURED, LABEL_SNAPSHOT, LABEL_STATE_ATTACHMENT,
    SNAPSHOT_FINALIZER,
};
use api::{VirtualMachine, VirtualMachineInstance};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, PersistentVolumeClaimSpec, Pod};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, DynamicObject, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};

use super::{error, protect, set_done, set_failed, set_progress, volume_snapshot_classes, Lock};
use crate::context::{Context, Error, Result};
use controller_runtime::{
    controller_ref, create_if_absent, delete_if_present, has_finalizer, write_status,
};

pub const CONTROLLER: &str = "vmsnapshot-controller";

/// How often a snapshot in progress is looked at again (besides the watches).
const RECHECK: Duration = Duration::from_secs(2);

pub fn error_policy(s: Arc<VirtualMachineSnapshot>, err: &Error, ctx: Arc<Context>) -> Action {
    ctx.retry(CONTROLLER, s.as_ref(), err)
}

/// Where a snapshot stands.
enum Stage {
    /// Final (Succeeded or Failed), or being deleted: nothing to do.
    Settled,
    /// Not started: no content yet.
    Planning,
    /// The content exists: its VolumeSnapshots are being taken.
    Capturing(Box<VirtualMachineSnapshotContent>),
}

struct Pass {
    snapshot: Arc<VirtualMachineSnapshot>,
    ctx: Arc<Context>,
    ns: String,
    status: VirtualMachineSnapshotStatus,
}

pub async fn reconcile(snapshot: Arc<VirtualMachineSnapshot>, ctx: Arc<Context>) -> Result<Action> {
    let ns = snapshot.namespace().unwrap_or_default();
    let status = snapshot.status.clone().unwrap_or_default();
    let mut pass = Pass {
        snapshot,
        ctx,
        ns,
        status,
    };
    let action = match pass.stage().await? {
        Stage::Settled => {
            // Done, failed or being deleted: the VM let go, the object free to go. Without the
            // finalizer that was done already (the lock is taken only while it is on).
            if has_finalizer(pass.snapshot.as_ref(), SNAPSHOT_FINALIZER) {
                pass.release_guest().await?;
                pass.release().await?;
                let api = pass.api::<VirtualMachineSnapshot>();
                protect(&api, pass.snapshot.as_ref(), SNAPSHOT_FINALIZER, false).await?;
            }
            return Ok(Action::await_change());
        }
        Stage::Planning
            if protect(
                &pass.api(),
                pass.snapshot.as_ref(),
                SNAPSHOT_FINALIZER,
                true,
            )
            .await? =>
        {
            return Ok(Action::await_change());
        }
        Stage::Planning => pass.plan().await?,
        Stage::Capturing(content) => pass.capture(*content).await?,
    };
    pass.write().await?;
    pass.ctx.succeeded(CONTROLLER, pass.snapshot.as_ref());
    Ok(action)
}

impl Pass {
    fn api<K>(&self) -> Api<K>
    where
        K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
    {
        Api::namespaced(self.ctx.client.clone(), &self.ns)
    }

    fn uid(&self) -> String {
        self.snapshot.uid().unwrap_or_default()
    }

    async fn stage(&mut self) -> Result<Stage> {
        let final_ = matches!(
            self.status.phase,
            Some(SnapshotPhase::Succeeded | SnapshotPhase::Failed)
        );
        if final_ || self.snapshot.meta().deletion_timestamp.is_some() {
            return Ok(Stage::Settled);
        }
        let contents = self.api::<VirtualMachineSnapshotContent>();
        Ok(match contents.get_opt(&content_name(&self.uid())).await? {
            Some(c) => Stage::Capturing(Box::new(c)),
            None => Stage::Planning,
        })
    }

    async fn write(&self) -> Result<()> {
        let api = self.api::<VirtualMachineSnapshot>();
        write_status(&api, self.snapshot.as_ref(), self.status.clone()).await?;
        Ok(())
    }

    /// Lets go of the source VM (if this snapshot holds it).
    async fn release(&self) -> Result<()> {
        let source = &self.snapshot.spec.source.name;
        Lock::Snapshot
            .release(&self.api(), source, &self.snapshot.name_any())
            .await
    }

    /// Fails the snapshot for `why`, once; nothing else is touched.
    async fn fail(&mut self, why: String) -> Result<Action> {
        self.release_guest().await?;
        self.release().await?;
        self.status.phase = Some(SnapshotPhase::Failed);
        self.status.ready_to_use = Some(false);
        self.status.error = Some(error(&why));
        set_failed(&mut self.status.conditions, &why);
        let s = self.snapshot.clone();
        self.ctx
            .event(s.as_ref(), true, "SnapshotFailed", "Snapshot", why)
            .await;
        Ok(Action::await_change())
    }

    /// Whether the failure deadline has passed (an unreadable one is the spec's error).
    fn past_deadline(&self) -> std::result::Result<bool, String> {
        let deadline = match &self.snapshot.spec.failure_deadline {
            None => Duration::from_secs(api::snapshot::DEFAULT_DEADLINE_SECONDS as u64),
            Some(d) => api::duration::parse_duration(d).ok_or_else(|| {
                format!("spec.failureDeadline: {d:?} is not a duration (e.g. 5m, 1h30m)")
            })?,
        };
        let created = self
            .snapshot
            .meta()
            .creation_timestamp
            .as_ref()
            .map(|t| t.0.as_second())
            .unwrap_or_else(controller_runtime::time::now_unix);
        Ok(controller_runtime::time::now_unix() - created > deadline.as_secs() as i64)
    }

    async fn plan(&mut self) -> Result<Action> {
        self.status.phase = Some(SnapshotPhase::InProgress);
        self.status.ready_to_use = Some(false);
        if let Err(why) = check_vm_reference(&self.snapshot.spec.source, "spec.source") {
            return self.fail(why).await;
        }
        match self.past_deadline() {
            Err(why) => return self.fail(why).await,
            Ok(true) => {
                return self
                    .fail("the snapshot did not complete within its failureDeadline".into())
                    .await
            }
            Ok(false) => {}
        }
        let source = &self.snapshot.spec.source.name;
        let Some(vm) = self.api::<VirtualMachine>().get_opt(source).await? else {
            let m = format!("Source VirtualMachine {source:?} does not exist");
            set_progress(
                &mut self.status.conditions,
                false,
                "Source does not exist",
                &m,
            );
            return Ok(Action::requeue(RECHECK));
        };
        // One writer at a time: no snapshot while a restore writes the VM, one snapshot at a
        // time; then the VM is held (not started) until the capture is done.
        let me = self.snapshot.name_any();
        let busy = match (Lock::Restore.holder(&vm), Lock::Snapshot.holder(&vm)) {
            (Some(r), _) => Some(format!("VirtualMachineRestore {r:?} is writing it")),
            (None, Some(s)) if s != me => {
                Some(format!("VirtualMachineSnapshot {s:?} is capturing it"))
            }
            _ => None,
        };
        if let Some(why) = busy {
            let m = format!("Source VirtualMachine {source:?} is locked: {why}");
            set_progress(&mut self.status.conditions, false, "Source locked", &m);
            return Ok(Action::requeue(RECHECK));
        }
        if Lock::Snapshot.holder(&vm).is_none() {
            Lock::Snapshot.take(&self.api(), source, &me).await?;
        }
        let vmi = self.api::<VirtualMachineInstance>().get_opt(source).await?;
        let running = vmi.is_some();
        let backups = match self.backups(&vm, running).await? {
            Ok(b) => b,
            Err(why) => return self.fail(why).await,
        };
        self.indicate(running);
        self.status.source_uid = vm.uid();
        let mut content = self.content(&vm, backups);
        let guest_runs = vmi
            .and_then(|v| v.status)
            .and_then(|s| s.phase)
            .is_some_and(|p| p == api::VmiPhase::Running);
        // A clone's temporary snapshot is restored once and deleted: its VM boots.
        let keeps_state = !super::is_clone_temporary(&self.snapshot);
        if guest_runs && keeps_state && self.ctx.settings().vm_state_storage_class.is_some() {
            let claim = api::snapshot::state_claim_name(&self.uid());
            content
                .annotations_mut()
                .insert(ANNOTATION_STATE_CLAIM.into(), claim);
        }
        let name = content.name_any();
        create_if_absent(&self.api(), &content).await?;
        self.status.virtual_machine_snapshot_content_name = Some(name);
        set_progress(
            &mut self.status.conditions,
            true,
            "Operation in progress",
            "Source locked and operation in progress",
        );
        Ok(Action::requeue(RECHECK))
    }

    /// One backup per claim, or why the VM cannot be captured (every volume's reason).
    async fn backups(
        &mut self,
        vm: &VirtualMachine,
        running: bool,
    ) -> Result<std::result::Result<Vec<VolumeBackup>, String>> {
        let volumes = vm
            .spec
            .template
            .spec
            .as_ref()
            .map(|s| s.volumes.clone())
            .unwrap_or_default();
        let (mut backups, mut problems) = (Vec::new(), Vec::new());
        let mut lists = SnapshotVolumesLists::default();
        for v in &volumes {
            match capture_of(v) {
                VolumeCapture::FromSpec => lists.excluded_volumes.push(v.name.clone()),
                VolumeCapture::Uncapturable(why) => {
                    problems.push(format!("volume {:?}: {why}", v.name))
                }
                VolumeCapture::Claim(claim) => {
                    match self.claim_backup(&v.name, &claim, running).await? {
                        Ok(b) => {
                            lists.included_volumes.push(v.name.clone());
                            backups.push(b);
                        }
                        Err(why) => problems.push(format!("volume {:?}: {why}", v.name)),
                    }
                }
            }
        }
        self.status.snapshot_volumes = Some(lists);
        if problems.is_empty() {
            Ok(Ok(backups))
        } else {
            Ok(Err(format!(
                "cannot snapshot VirtualMachine {:?}: {}",
                vm.name_any(),
                problems.join("; ")
            )))
        }
    }

    /// The backup of claim `claim` (volume `volume`): a CSI snapshot where its storage class
    /// has a VolumeSnapshotClass, else a full copy — which is point-in-time only while the VM
    /// is stopped (and held), so a running VM's such claim is refused.
    async fn claim_backup(
        &self,
        volume: &str,
        claim: &str,
        running: bool,
    ) -> Result<std::result::Result<VolumeBackup, String>> {
        let Some(pvc) = self.api::<PersistentVolumeClaim>().get_opt(claim).await? else {
            return Ok(Err(format!("claim {claim:?} does not exist")));
        };
        if pvc.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Bound") {
            return Ok(Err(format!("claim {claim:?} is not bound to a volume yet")));
        }
        let spec = pvc.spec.clone().unwrap_or_default();
        let no_csi_snapshot = match spec.storage_class_name.clone() {
            None => Some("it has no storage class, so no VolumeSnapshotClass applies to it".into()),
            Some(class) => self.snapshot_class_for(&class).await?.err(),
        };
        if let (Some(why), true) = (&no_csi_snapshot, running) {
            return Ok(Err(format!(
                "claim {claim:?}: {why}; the copy made instead would not be point-in-time while \
                 the VM runs: stop the VM first, or give the storage a VolumeSnapshotClass"
            )));
        }
        let name = volume_snapshot_name(&self.uid(), volume);
        let (volume_snapshot_name, copy_claim_name) = match no_csi_snapshot {
            None => (Some(name), None),
            Some(_) => (None, Some(name)),
        };
        let keep = |m: &Option<BTreeMap<String, String>>| m.clone().filter(|m| !m.is_empty());
        Ok(Ok(VolumeBackup {
            volume_name: volume.into(),
            persistent_volume_claim: BackedUpClaim {
                metadata: ObjectMeta {
                    name: Some(claim.into()),
                    namespace: Some(self.ns.clone()),
                    labels: keep(&pvc.metadata.labels),
                    annotations: keep(&pvc.metadata.annotations),
                    ..Default::default()
                },
                spec,
            },
            volume_snapshot_name,
            copy_claim_name,
        }))
    }

    /// The VolumeSnapshotClass serving storage class `class`: the one whose driver is the
    /// class's provisioner (the default-annotated one first).
    async fn snapshot_class_for(&self, class: &str) -> Result<std::result::Result<String, String>> {
        let Some(sc) = Api::<StorageClass>::all(self.ctx.client.clone())
            .get_opt(class)
            .await?
        else {
            return Ok(Err(format!("its storage class {class:?} does not exist")));
        };
        let classes =
            Api::<DynamicObject>::all_with(self.ctx.client.clone(), &volume_snapshot_classes());
        let list = match classes.list(&Default::default()).await {
            Ok(l) => l.items,
            Err(kube::Error::Api(e)) if e.code == 404 => {
                return Ok(Err("the cluster serves no VolumeSnapshotClasses \
                               (snapshot.storage.k8s.io/v1): install the CSI snapshot CRDs and \
                               controller"
                    .into()))
            }
            Err(e) => return Err(e.into()),
        };
        let default = |o: &DynamicObject| {
            o.annotations()
                .get("snapshot.storage.kubernetes.io/is-default-class")
                .map(String::as_str)
                == Some("true")
        };
        let mut matching: Vec<&DynamicObject> = list
            .iter()
            .filter(|o| o.data["driver"].as_str() == Some(sc.provisioner.as_str()))
            .collect();
        matching.sort_by_key(|o| !default(o));
        Ok(match matching.first() {
            Some(o) => Ok(o.name_any()),
            None => Err(format!(
                "its storage class {class:?} (provisioner {:?}) has no VolumeSnapshotClass, so \
                 no CSI snapshot can be taken of it",
                sc.provisioner
            )),
        })
    }

    /// KubeVirt's indications: a running VM is captured online, without a guest agent.
    fn indicate(&mut self, running: bool) {
        let mut ind = Vec::new();
        if running {
            ind.push(SourceIndication {
                indication: Indication::Online,
                message: "Snapshot was taken while the VM was running".into(),
            });
            ind.push(SourceIndication {
                indication: Indication::NoGuestAgent,
                message: "No guest agent: the disks are crash-consistent".into(),
            });
        }
        self.status.indications = ind.iter().map(|i| i.indication).collect();
        self.status.source_indications = ind;
    }

    /// The content: the VM as it is, its backups; controlled by the snapshot unless Retained.
    fn content(
        &self,
        vm: &VirtualMachine,
        backups: Vec<VolumeBackup>,
    ) -> VirtualMachineSnapshotContent {
        let mut meta = vm.metadata.clone();
        meta.managed_fields = None;
        meta.resource_version = None;
        let mut content = VirtualMachineSnapshotContent::new(
            &content_name(&self.uid()),
            VirtualMachineSnapshotContentSpec {
                virtual_machine_snapshot_name: Some(self.snapshot.name_any()),
                source: SnapshotSource {
                    virtual_machine: Some(SnapshottedVm {
                        metadata: meta,
                        spec: vm.spec.clone(),
                        status: vm.status.clone(),
                    }),
                },
                volume_backups: backups,
                extra: Default::default(),
            },
        );
        content.metadata.namespace = Some(self.ns.clone());
        let policy = self.snapshot.spec.deletion_policy.unwrap_or_default();
        if policy == DeletionPolicy::Delete {
            content.metadata.owner_references =
                controller_ref(self.snapshot.as_ref()).map(|r| vec![r]);
        }
        content
    }

    async fn capture(&mut self, content: VirtualMachineSnapshotContent) -> Result<Action> {
        let state_claim = content.annotations().get(ANNOTATION_STATE_CLAIM).cloned();
        let captured = content
            .annotations()
            .contains_key(api::snapshot::ANNOTATION_STATE_CAPTURED);
        if let Some(claim) = state_claim.as_ref().filter(|_| !captured) {
            match self.machine_state(&content, claim).await? {
                StateCapture::Captured => {
                    let patch = serde_json::json!({"metadata": {"annotations": {
                        api::snapshot::ANNOTATION_STATE_CAPTURED: "true"
                    }}});
                    self.api::<VirtualMachineSnapshotContent>()
                        .patch(
                            &content.name_any(),
                            &PatchParams::default(),
                            &Patch::Merge(&patch),
                        )
                        .await?;
                }
                StateCapture::Failed(why) => return self.fail(why).await,
                StateCapture::Waiting(why) => {
                    if let Ok(true) = self.past_deadline() {
                        let m = format!(
                            "the snapshot did not complete within its failureDeadline: {why}"
                        );
                        return self.fail(m).await;
                    }
                    set_progress(
                        &mut self.status.conditions,
                        true,
                        "Operation in progress",
                        &why,
                    );
                    return Ok(Action::requeue(RECHECK));
                }
            }
        }
        let volume_snapshots = self.api::<VolumeSnapshot>();
        let mut statuses = Vec::new();
        for b in &content.spec.volume_backups {
            if let Some(name) = &b.copy_claim_name {
                statuses.push(self.copy(&content, b, name).await?);
                continue;
            }
            let Some(name) = b.volume_snapshot_name.clone() else {
                continue;
            };
            let vs = match volume_snapshots.get_opt(&name).await? {
                Some(vs) => vs,
                None => {
                    let vs = self.volume_snapshot(&content, b, &name);
                    volume_snapshots.create(&PostParams::default(), &vs).await?
                }
            };
            let s = vs.status.unwrap_or_default();
            statuses.push(VolumeSnapshotStatus {
                volume_snapshot_name: name,
                creation_time: s.creation_time,
                ready_to_use: s.ready_to_use,
                error: s.error,
            });
        }
        // Every disk cut (a CSI snapshot's creationTime is when it was taken, before it may be
        // ready to use): the guest paused for its machine state goes on.
        let cut = statuses.iter().all(|s| s.creation_time.is_some());
        if state_claim.is_some() && cut {
            self.release_guest().await?;
        }
        let failed = statuses.iter().find_map(|s| {
            s.error
                .as_ref()
                .and_then(|e| e.message.clone())
                .map(|m| format!("VolumeSnapshot {:?}: {m}", s.volume_snapshot_name))
        });
        let ready = failed.is_none() && statuses.iter().all(|s| s.ready_to_use == Some(true));
        let now = controller_runtime::time::now_rfc3339();
        let content_status = VirtualMachineSnapshotContentStatus {
            creation_time: content
                .status
                .as_ref()
                .and_then(|s| s.creation_time.clone())
                .or_else(|| ready.then(|| now.clone())),
            ready_to_use: Some(ready),
            error: failed.as_deref().map(error),
            volume_snapshot_status: statuses,
        };
        let contents = self.api::<VirtualMachineSnapshotContent>();
        write_status(&contents, &content, content_status.clone()).await?;
        self.status.virtual_machine_snapshot_content_name = Some(content.name_any());
        if let Some(why) = failed {
            return self.fail(why).await;
        }
        if !ready {
            if let Ok(true) = self.past_deadline() {
                let m = "the snapshot did not complete within its failureDeadline";
                return self.fail(m.into()).await;
            }
            return Ok(Action::requeue(RECHECK));
        }
        self.release().await?;
        self.status.phase = Some(SnapshotPhase::Succeeded);
        self.status.ready_to_use = Some(true);
        self.status.creation_time = content_status.creation_time;
        self.status.error = None;
        set_done(&mut self.status.conditions);
        Ok(Action::await_change())
    }

    /// The running guest's machine state into claim `claim`: the claim and its attachment Pod
    /// on the VMI's node made, the VMI asked, virt-handler's report read.
    async fn machine_state(
        &self,
        content: &VirtualMachineSnapshotContent,
        claim: &str,
    ) -> Result<StateCapture> {
        let source = &self.snapshot.spec.source.name;
        let vmi = self.api::<VirtualMachineInstance>().get_opt(source).await?;
        let status = vmi
            .as_ref()
            .and_then(|v| v.status.clone())
            .unwrap_or_default();
        let (Some(vmi), Some(node)) = (
            vmi.filter(|_| status.phase == Some(api::VmiPhase::Running)),
            status.node_name.clone(),
        ) else {
            return Ok(StateCapture::Failed(format!(
                "VirtualMachine {source:?} stopped before its machine state was captured"
            )));
        };
        if let Some(c) = status.conditions.iter().find(|c| {
            c.type_ == CONDITION_STATE_CAPTURED
                && c.message
                    .as_deref()
                    .is_some_and(|m| api::snapshot::reports_on(m, claim))
        }) {
            let message = c.message.clone().unwrap_or_default();
            return Ok(match c.status.as_str() {
                "True" => StateCapture::Captured,
                _ => StateCapture::Failed(format!("capturing the machine state: {message}")),
            });
        }
        let Some(class) = self.ctx.settings().vm_state_storage_class.clone() else {
            return Ok(StateCapture::Failed(
                "spec.configuration.vmStateStorageClass was removed from the KubeVirt CR while \
                 the machine state was being captured"
                    .into(),
            ));
        };
        let memory = match api::validation::guest_memory(&vmi.spec) {
            Some(Ok(bytes)) => bytes,
            _ => {
                return Ok(StateCapture::Failed(format!(
                    "VirtualMachineInstance {source:?} has no guest memory size to size the \
                     machine-state claim by"
                )))
            }
        };
        create_if_absent(&self.api(), &state_claim(claim, &class, memory, content)).await?;
        let pod = self.attachment_pod(claim, &node, content);
        create_if_absent(&self.api(), &pod).await?;
        if api::snapshot::capture_state(vmi.metadata.annotations.as_ref()) != Some(claim) {
            let patch = serde_json::json!({"metadata": {"annotations": {
                ANNOTATION_CAPTURE_STATE: claim
            }}});
            self.api::<VirtualMachineInstance>()
                .patch(source, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
        }
        Ok(StateCapture::Waiting(format!(
            "capturing the machine state of VirtualMachine {source:?} into claim {claim:?} on \
             node {node:?}"
        )))
    }

    /// The Pod that mounts machine-state claim `claim` on `node`, so virt-handler there can
    /// write into it (KubeVirt's hotplug attachment Pods do the same for a memory dump).
    fn attachment_pod(
        &self,
        claim: &str,
        node: &str,
        content: &VirtualMachineSnapshotContent,
    ) -> Pod {
        let image = &self.ctx.config.pod.launcher_image;
        let uid = api::launcher_pod::LAUNCHER_UID;
        let mut pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": api::snapshot::state_attachment_name(claim),
                "namespace": self.ns,
                "labels": {LABEL_STATE_ATTACHMENT: claim, LABEL_SNAPSHOT: self.snapshot.name_any()},
            },
            "spec": {
                "nodeName": node,
                "restartPolicy": "Never",
                "automountServiceAccountToken": false,
                "securityContext": {"runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
                                    "runAsNonRoot": true},
                "containers": [{
                    "name": "hold",
                    "image": image,
                    "command": ["/bin/sleep", "infinity"],
                    "resources": {"requests": {"cpu": "10m", "memory": "16Mi"},
                                  "limits": {"cpu": "100m", "memory": "32Mi"}},
                    "securityContext": {"allowPrivilegeEscalation": false,
                                        "capabilities": {"drop": ["ALL"]}},
                    "volumeMounts": [{"name": "state", "mountPath": "/state"}],
                }],
                "volumes": [{"name": "state", "persistentVolumeClaim": {"claimName": claim}}],
            },
        }))
        .expect("a Pod");
        pod.metadata.owner_references = controller_ref(content).map(|r| vec![r]);
        pod
    }

    /// The guest let go: the VMI's capture request taken off (virt-handler then resumes it)
    /// and the attachment Pod deleted. Does nothing where there is nothing to undo.
    async fn release_guest(&self) -> Result<()> {
        let claim = api::snapshot::state_claim_name(&self.uid());
        let source = &self.snapshot.spec.source.name;
        let vmis = self.api::<VirtualMachineInstance>();
        if let Some(vmi) = vmis.get_opt(source).await? {
            if api::snapshot::capture_state(vmi.metadata.annotations.as_ref()) == Some(&claim) {
                let patch = serde_json::json!({"metadata": {"annotations": {
                    ANNOTATION_CAPTURE_STATE: null
                }}});
                vmis.patch(source, &PatchParams::default(), &Patch::Merge(&patch))
                    .await?;
            }
        }
        delete_if_present(
            &self.api::<Pod>(),
            &api::snapshot::state_attachment_name(&claim),
            &Default::default(),
        )
        .await?;
        Ok(())
    }

    /// The copy of backup `b` (a DataVolume cloning the claim, controlled by the content),
    /// made if it is not yet, and how far it is.
    async fn copy(
        &self,
        content: &VirtualMachineSnapshotContent,
        b: &VolumeBackup,
        name: &str,
    ) -> Result<VolumeSnapshotStatus> {
        let dvs = self.api::<DataVolume>();
        let dv = match dvs.get_opt(name).await? {
            Some(dv) => dv,
            None => {
                let claim = &b.persistent_volume_claim;
                let mut dv = copy_of(
                    name,
                    claim.metadata.name.as_deref().unwrap_or_default(),
                    &claim.spec,
                );
                dv.metadata.namespace = Some(self.ns.clone());
                dv.metadata.labels = Some(BTreeMap::from([(
                    LABEL_SNAPSHOT.to_string(),
                    self.snapshot.name_any(),
                )]));
                dv.metadata.owner_references = controller_ref(content).map(|r| vec![r]);
                match dvs.create(&PostParams::default(), &dv).await {
                    Ok(dv) => dv,
                    Err(kube::Error::Api(e)) if e.code == 409 => dvs.get(name).await?,
                    Err(e) => return Err(e.into()),
                }
            }
        };
        let status = dv.status.unwrap_or_default();
        let error = (status.phase == Some(DataVolumePhase::Failed)).then(|| {
            let why = status
                .conditions
                .iter()
                .find_map(|c| c.message.clone().filter(|m| !m.is_empty()))
                .unwrap_or_else(|| "the copy failed".into());
            error(&format!("copy {name:?} of the claim: {why}"))
        });
        let done = status.phase == Some(DataVolumePhase::Succeeded);
        Ok(VolumeSnapshotStatus {
            volume_snapshot_name: name.to_string(),
            creation_time: done.then(controller_runtime::time::now_rfc3339),
            ready_to_use: Some(done),
            error,
        })
    }

    fn volume_snapshot(
        &self,
        content: &VirtualMachineSnapshotContent,
        b: &VolumeBackup,
        name: &str,
    ) -> VolumeSnapshot {
        let mut vs = VolumeSnapshot::new(
            name,
            VolumeSnapshotSpec {
                source: VolumeSnapshotSource {
                    persistent_volume_claim_name: b.persistent_volume_claim.metadata.name.clone(),
                    volume_snapshot_content_name: None,
                },
                volume_snapshot_class_name: None,
            },
        );
        vs.metadata.namespace = Some(self.ns.clone());
        vs.metadata.labels = Some(BTreeMap::from([(
            LABEL_SNAPSHOT.to_string(),
            self.snapshot.name_any(),
        )]));
        vs.metadata.owner_references = controller_ref(content).map(|r| vec![r]);
        vs
    }
}

/// How far a machine-state capture is.
enum StateCapture {
    Captured,
    Waiting(String),
    Failed(String),
}

/// The claim a machine state of `memory` bytes is captured into: room for the memory and the
/// vCPUs' and devices' state, of the cluster's `vmStateStorageClass`, held by the content.
fn state_claim(
    name: &str,
    class: &str,
    memory: u64,
    content: &VirtualMachineSnapshotContent,
) -> PersistentVolumeClaim {
    let mib = memory.div_ceil(1 << 20) + 16;
    let mut pvc: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": content.namespace()},
        "spec": {
            "storageClassName": class,
            // Every VM restored or cloned from the snapshot maps the memory file read-only.
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": format!("{mib}Mi")}},
        },
    }))
    .expect("a claim");
    pvc.metadata.owner_references = controller_ref(content).map(|r| vec![r]);
    pvc
}

/// A DataVolume `name` that clones claim `claim` (of shape `spec`) through CDI's host-assisted
/// copy: the same size, class, access and volume modes.
pub fn copy_of(name: &str, claim: &str, spec: &PersistentVolumeClaimSpec) -> DataVolume {
    // No size: CDI then takes the source's, so the copy is the image as it is, not grown.
    let storage = PersistentVolumeClaimSpec {
        access_modes: spec.access_modes.clone(),
        storage_class_name: spec.storage_class_name.clone(),
        volume_mode: spec.volume_mode.clone(),
        ..Default::default()
    };
    DataVolume::new(
        name,
        DataVolumeSpec {
            source: Some(DataVolumeSource {
                pvc: Some(ClaimSource {
                    namespace: None,
                    name: claim.to_string(),
                }),
                ..Default::default()
            }),
            storage: Some(storage),
            ..Default::default()
        },
    )
}
