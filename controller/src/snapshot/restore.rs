//! The VirtualMachineRestore reconciler: a `match` on where the restore stands.
//!
//! 1. `Checking`: everything is read and judged before anything is written — the target
//!    reference, the snapshot (ready to use), its content and VolumeSnapshots, the target VM
//!    (absent: it is created; present: it must be the VM the snapshot was taken of), whether
//!    the target runs (as `targetReadinessPolicy` says: stop it, wait for it, or fail), every
//!    patch (applied to the VM to be written) and every restored claim's name (a claim of that
//!    name that this restore did not make is refused, unless `InPlace` replaces it).
//! 2. `Restoring`: one claim per backup, made from its VolumeSnapshot (`dataSource`), then the
//!    target VM pointed at them (created, or its spec replaced keeping its run strategy), then
//!    the claims owned by the VM (`volumeOwnershipPolicy: Vm`).
//! 3. `Settled`: `complete`, or a `Failure` condition.
//!
//! KubeVirt's restore does the same; like KubeVirt it leaves a VM it stopped stopped. Beyond
//! KubeVirt: a snapshot whose content names a machine-state claim
//! ([`api::snapshot::ANNOTATION_STATE_CLAIM`]) restores a VM annotated to start from that
//! snapshot ([`api::snapshot::ANNOTATION_START_FROM_SNAPSHOT`]), so its next start resumes the
//! guest where it was captured instead of booting.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use api::cdi::{DataVolume, DataVolumePhase};
use api::snapshot::{
    check_vm_reference, parse_json_patch, restored_claim_name, SnapshottedVm,
    TargetReadinessPolicy, VirtualMachineRestore, VirtualMachineRestoreStatus,
    VirtualMachineSnapshot, VirtualMachineSnapshotContent, VolumeBackup, VolumeOwnershipPolicy,
    VolumeRestore, VolumeRestorePolicy, VolumeSnapshot, ANNOTATION_LAST_RESTORE,
    ANNOTATION_RESTORE_NAME, ANNOTATION_START_FROM_SNAPSHOT, DEFAULT_DEADLINE_SECONDS,
    NOT_CARRIED_ANNOTATIONS, RESTORE_FINALIZER,
};
use api::{PvcSource, RunStrategy, VirtualMachine, VirtualMachineInstance};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, TypedLocalObjectReference};
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use serde_json::{json, Value};

use super::{protect, set_done, set_failed, set_progress, Lock};
use crate::context::{Context, Error, Result};
use controller_runtime::{create_if_absent, delete_if_present, has_finalizer, write_status};

pub const CONTROLLER: &str = "vmrestore-controller";

/// How often a restore in progress, or waiting, is looked at again.
const RECHECK: Duration = Duration::from_secs(2);

pub fn error_policy(r: Arc<VirtualMachineRestore>, err: &Error, ctx: Arc<Context>) -> Action {
    ctx.retry(CONTROLLER, r.as_ref(), err)
}

/// Where a restore stands.
enum Stage {
    /// Complete, failed or being deleted: nothing to do.
    Settled,
    /// Not yet judged (judged again each pass until the claims and the VM are written).
    Checking,
}

/// Why a restore cannot go on now.
enum Hold {
    /// It never will: the reason goes on its `Failure` condition.
    Refused(String),
    /// Not yet (the target is running): reason and message for `Progressing`.
    Waiting(&'static str, String),
}

type Judged<T> = std::result::Result<T, Hold>;

/// One claim to make.
struct ClaimPlan {
    backup: VolumeBackup,
    name: String,
    /// A claim of that name exists and is to be replaced (`InPlace`).
    replaces: bool,
}

/// What a ready snapshot holds, as a restore reads it.
struct Captured {
    content: VirtualMachineSnapshotContent,
    source: SnapshottedVm,
    /// The claim holding the guest's memory and machine state, for a snapshot of a running VM.
    state_claim: Option<String>,
}

/// What a restore writes, once judged.
struct Plan {
    claims: Vec<ClaimPlan>,
    /// The target VM as it is to be written (created when `existing` is None).
    vm: VirtualMachine,
    existing: Option<VirtualMachine>,
}

struct Pass {
    restore: Arc<VirtualMachineRestore>,
    ctx: Arc<Context>,
    ns: String,
    status: VirtualMachineRestoreStatus,
}

pub async fn reconcile(restore: Arc<VirtualMachineRestore>, ctx: Arc<Context>) -> Result<Action> {
    let ns = restore.namespace().unwrap_or_default();
    let status = restore.status.clone().unwrap_or_default();
    let mut pass = Pass {
        restore,
        ctx,
        ns,
        status,
    };
    let action = match pass.stage() {
        Stage::Settled => {
            // Done, failed or being deleted: the VM let go, the object free to go. Without the
            // finalizer that was done already (the lock is taken only while it is on).
            if has_finalizer(pass.restore.as_ref(), RESTORE_FINALIZER) {
                pass.release().await?;
                let api = pass.api::<VirtualMachineRestore>();
                protect(&api, pass.restore.as_ref(), RESTORE_FINALIZER, false).await?;
            }
            return Ok(Action::await_change());
        }
        Stage::Checking
            if protect(&pass.api(), pass.restore.as_ref(), RESTORE_FINALIZER, true).await? =>
        {
            return Ok(Action::await_change());
        }
        Stage::Checking => match pass.check().await? {
            Ok(plan) => pass.carry_out(plan).await?,
            Err(Hold::Refused(why)) => pass.fail(why).await?,
            Err(Hold::Waiting(reason, m)) => {
                set_progress(&mut pass.status.conditions, false, reason, &m);
                Action::requeue(RECHECK)
            }
        },
    };
    pass.status.complete.get_or_insert(false);
    let api = pass.api::<VirtualMachineRestore>();
    write_status(&api, pass.restore.as_ref(), pass.status.clone()).await?;
    pass.ctx.succeeded(CONTROLLER, pass.restore.as_ref());
    Ok(action)
}

impl Pass {
    fn api<K>(&self) -> Api<K>
    where
        K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
    {
        Api::namespaced(self.ctx.client.clone(), &self.ns)
    }

    fn stage(&self) -> Stage {
        let failed = self
            .status
            .conditions
            .iter()
            .any(|c| c.type_ == "Failure" && c.status == "True");
        if self.status.complete == Some(true)
            || failed
            || self.restore.meta().deletion_timestamp.is_some()
        {
            Stage::Settled
        } else {
            Stage::Checking
        }
    }

    /// The value of `restore.kubevirt.io/lastRestoreUID` on a VM this restore wrote.
    fn mark(&self) -> String {
        format!(
            "{}-{}",
            self.restore.name_any(),
            self.restore.uid().unwrap_or_default()
        )
    }

    /// Lets go of the target VM (if this restore holds it).
    async fn release(&self) -> Result<()> {
        let target = &self.restore.spec.target.name;
        Lock::Restore
            .release(&self.api(), target, &self.restore.name_any())
            .await
    }

    async fn fail(&mut self, why: String) -> Result<Action> {
        self.release().await?;
        set_failed(&mut self.status.conditions, &why);
        let r = self.restore.clone();
        self.ctx
            .event(
                r.as_ref(),
                true,
                "VirtualMachineRestoreError",
                "Restore",
                why,
            )
            .await;
        Ok(Action::await_change())
    }

    /// Everything judged: what to write, or why not (now or ever).
    async fn check(&mut self) -> Result<Judged<Plan>> {
        let spec = &self.restore.spec;
        if let Err(why) = check_vm_reference(&spec.target, "spec.target") {
            return Ok(Err(Hold::Refused(why)));
        }
        let Captured {
            content,
            source,
            state_claim,
        } = match self.snapshot().await? {
            Ok(found) => found,
            Err(hold) => return Ok(Err(hold)),
        };
        let existing = self
            .api::<VirtualMachine>()
            .get_opt(&spec.target.name)
            .await?;
        if let Err(hold) = self.target_ready(existing.as_ref(), &source).await? {
            return Ok(Err(hold));
        }
        let claims = match self.claim_plans(&content).await? {
            Ok(c) => c,
            Err(hold) => return Ok(Err(hold)),
        };
        let vm = match self.target_vm(&source, existing.as_ref(), &claims, state_claim) {
            Ok(vm) => vm,
            Err(why) => return Ok(Err(Hold::Refused(why))),
        };
        Ok(Ok(Plan {
            claims,
            vm,
            existing,
        }))
    }

    /// The snapshot's content, the VM it holds and its machine-state claim, if the snapshot is
    /// ready to use.
    async fn snapshot(&self) -> Result<Judged<Captured>> {
        let name = &self.restore.spec.virtual_machine_snapshot_name;
        let refuse = |m: String| Ok(Err(Hold::Refused(m)));
        let Some(snapshot) = self.api::<VirtualMachineSnapshot>().get_opt(name).await? else {
            return refuse(format!(
                "spec.virtualMachineSnapshotName: VirtualMachineSnapshot {name:?} does not exist"
            ));
        };
        let status = snapshot.status.clone().unwrap_or_default();
        if status.ready_to_use != Some(true) {
            let phase = status
                .phase
                .map(|p| format!("{p:?}"))
                .unwrap_or_else(|| "not started".into());
            return refuse(format!(
                "VirtualMachineSnapshot {name:?} is not ready to use (phase {phase}); restore a \
                 snapshot once its readyToUse is true"
            ));
        }
        let content_name = status
            .virtual_machine_snapshot_content_name
            .clone()
            .unwrap_or_default();
        let Some(content) = self
            .api::<VirtualMachineSnapshotContent>()
            .get_opt(&content_name)
            .await?
        else {
            return refuse(format!(
                "VirtualMachineSnapshotContent {content_name:?} of snapshot {name:?} does not exist"
            ));
        };
        let Some(mut source) = content.spec.source.virtual_machine.clone() else {
            return refuse(format!(
                "VirtualMachineSnapshotContent {content_name:?} holds no VirtualMachine"
            ));
        };
        // The VM's identity is the snapshot's record of it (the content's copy of the UID
        // may have been written by anyone able to edit contents).
        source.metadata.uid = status.source_uid.clone();
        let snapshots = self.api::<VolumeSnapshot>();
        let copies = self.api::<DataVolume>();
        for b in &content.spec.volume_backups {
            if let Some(copy) = &b.copy_claim_name {
                let phase = copies
                    .get_opt(copy)
                    .await?
                    .and_then(|dv| dv.status)
                    .and_then(|s| s.phase);
                if phase != Some(DataVolumePhase::Succeeded) {
                    return refuse(format!(
                        "the copy {copy:?} of volume {:?} is missing or not complete",
                        b.volume_name
                    ));
                }
                continue;
            }
            let vs_name = b.volume_snapshot_name.clone().unwrap_or_default();
            let ready = snapshots
                .get_opt(&vs_name)
                .await?
                .and_then(|vs| vs.status)
                .and_then(|s| s.ready_to_use);
            if ready != Some(true) {
                return refuse(format!(
                    "VolumeSnapshot {vs_name:?} of volume {:?} is missing or not ready to use",
                    b.volume_name
                ));
            }
        }
        let state_claim = match self.state_claim(&snapshot, &content).await? {
            Ok(c) => c,
            Err(hold) => return Ok(Err(hold)),
        };
        Ok(Ok(Captured {
            content,
            source,
            state_claim,
        }))
    }

    /// The machine-state claim the content names, if any and if a VM may start from it (not
    /// a clone's temporary snapshot, which is gone before the VM starts): bound, and the one
    /// its snapshot's capture made.
    async fn state_claim(
        &self,
        snapshot: &VirtualMachineSnapshot,
        content: &VirtualMachineSnapshotContent,
    ) -> Result<Judged<Option<String>>> {
        if super::is_clone_temporary(snapshot) {
            return Ok(Ok(None));
        }
        let claim = match super::named_state_claim(snapshot, content) {
            Ok(Some(c)) => c,
            Ok(None) => return Ok(Ok(None)),
            Err(why) => return Ok(Err(Hold::Refused(why))),
        };
        if !super::claim_bound(&self.ctx.client, &self.ns, &claim).await? {
            return Ok(Err(Hold::Refused(format!(
                "the machine-state claim {claim:?} of snapshot {:?} is missing or not bound",
                snapshot.name_any()
            ))));
        }
        Ok(Ok(Some(claim)))
    }

    /// Whether the target may be written now: it must be the snapshot's source VM (or not
    /// exist), and not be running (as the readiness policy says).
    async fn target_ready(
        &self,
        existing: Option<&VirtualMachine>,
        source: &SnapshottedVm,
    ) -> Result<Judged<()>> {
        let Some(vm) = existing else {
            return Ok(Ok(()));
        };
        let target = vm.name_any();
        // First: a VM this restore wrote (created under a new name, so its UID is not the
        // source's) whose pass then lost its status write, or was run again from a cache that
        // did not show it yet, is ours to finish, not a stranger in the way.
        if vm.annotations().get(ANNOTATION_LAST_RESTORE) == Some(&self.mark()) {
            return Ok(Ok(()));
        }
        if vm.uid() != source.metadata.uid {
            return Ok(Err(Hold::Refused(format!(
                "spec.target: VirtualMachine {target:?} exists and is not the VM this snapshot \
                 was taken of ({:?}); restore into a new name (the VM is created) or onto {:?}",
                source.metadata.name.as_deref().unwrap_or(""),
                source.metadata.name.as_deref().unwrap_or("")
            ))));
        }
        // Held while it is judged and written, so it cannot start in between; not while a
        // snapshot reads it.
        let me = self.restore.name_any();
        if let Some(s) = Lock::Snapshot.holder(vm) {
            return Ok(Err(Hold::Waiting(
                "Waiting for target to be ready",
                format!("VirtualMachine {target:?} is locked: VirtualMachineSnapshot {s:?} is capturing it"),
            )));
        }
        match Lock::Restore.holder(vm) {
            None => Lock::Restore.take(&self.api(), &target, &me).await?,
            Some(r) if r != me => {
                return Ok(Err(Hold::Waiting(
                    "Waiting for target to be ready",
                    format!("VirtualMachine {target:?} is locked: VirtualMachineRestore {r:?} is writing it"),
                )))
            }
            Some(_) => {}
        }
        let running = self
            .api::<VirtualMachineInstance>()
            .get_opt(&target)
            .await?
            .is_some();
        if !running {
            return Ok(Ok(()));
        }
        let policy = self
            .restore
            .spec
            .target_readiness_policy
            .unwrap_or_default();
        let waiting = |m: &str| {
            Ok(Err(Hold::Waiting(
                "Waiting for target to be ready",
                format!("VirtualMachine {target:?} is running: {m}"),
            )))
        };
        match policy {
            TargetReadinessPolicy::FailImmediate => Ok(Err(Hold::Refused(format!(
                "VirtualMachine {target:?} is running and spec.targetReadinessPolicy is \
                 FailImmediate; stop it first, or use StopTarget"
            )))),
            TargetReadinessPolicy::StopTarget => {
                self.stop(vm).await?;
                waiting("stopping it (StopTarget)")
            }
            TargetReadinessPolicy::WaitEventually => waiting("waiting until it is stopped"),
            TargetReadinessPolicy::WaitGracePeriod => {
                let created = self
                    .restore
                    .meta()
                    .creation_timestamp
                    .as_ref()
                    .map(|t| t.0.as_second())
                    .unwrap_or_else(controller_runtime::time::now_unix);
                if controller_runtime::time::now_unix() - created > DEFAULT_DEADLINE_SECONDS {
                    Ok(Err(Hold::Refused(format!(
                        "VirtualMachine {target:?} was still running after the grace period \
                         (5m) of spec.targetReadinessPolicy WaitGracePeriod"
                    ))))
                } else {
                    waiting("waiting up to 5m for it to stop (WaitGracePeriod)")
                }
            }
        }
    }

    /// Stops `vm` as `virtctl stop` does: `runStrategy: Halted`.
    async fn stop(&self, vm: &VirtualMachine) -> Result<()> {
        if vm.spec.run_strategy == Some(RunStrategy::Halted) {
            return Ok(());
        }
        let patch = json!({"spec": {"runStrategy": "Halted", "running": null}});
        self.api::<VirtualMachine>()
            .patch(
                &vm.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await?;
        Ok(())
    }

    /// One plan per backup; a claim in the way is refused unless `InPlace` replaces it.
    async fn claim_plans(
        &self,
        content: &VirtualMachineSnapshotContent,
    ) -> Result<Judged<Vec<ClaimPlan>>> {
        let spec = &self.restore.spec;
        let policy = spec.volume_restore_policy.unwrap_or_default();
        let uid = self.restore.uid().unwrap_or_default();
        let claims = self.api::<PersistentVolumeClaim>();
        let mut plans = Vec::new();
        for b in &content.spec.volume_backups {
            let original = b
                .persistent_volume_claim
                .metadata
                .name
                .clone()
                .unwrap_or_default();
            let name = restored_claim_name(
                policy,
                &uid,
                &spec.target.name,
                &b.volume_name,
                &original,
                &spec.volume_restore_overrides,
            );
            if b.copy_claim_name.is_some() && policy == VolumeRestorePolicy::InPlace {
                return Ok(Err(Hold::Refused(format!(
                    "volume {:?} was captured as a copy (its storage has no \
                     VolumeSnapshotClass), which is restored as a new DataVolume: \
                     spec.volumeRestorePolicy InPlace is not served for it; use RandomizeNames \
                     or PrefixTargetName",
                    b.volume_name
                ))));
            }
            let mut replaces = false;
            if let Some(c) = claims.get_opt(&name).await? {
                let ours =
                    c.annotations().get(ANNOTATION_RESTORE_NAME) == Some(&self.restore.name_any());
                if !ours && policy != VolumeRestorePolicy::InPlace {
                    return Ok(Err(Hold::Refused(format!(
                        "volume {:?}: PersistentVolumeClaim {name:?} already exists and was not \
                         made by this restore; choose another name in \
                         spec.volumeRestoreOverrides, or spec.volumeRestorePolicy InPlace to \
                         replace it",
                        b.volume_name
                    ))));
                }
                replaces = !ours;
            }
            plans.push(ClaimPlan {
                backup: b.clone(),
                name,
                replaces,
            });
        }
        Ok(Ok(plans))
    }

    /// The target VM as it is to be written: the snapshot's spec with every captured volume
    /// on its restored claim, the existing VM's run strategy kept, the patches applied.
    fn target_vm(
        &self,
        source: &SnapshottedVm,
        existing: Option<&VirtualMachine>,
        claims: &[ClaimPlan],
        state_claim: Option<String>,
    ) -> std::result::Result<VirtualMachine, String> {
        let mut spec = source.spec.clone();
        let mut replaced_dvs = Vec::new();
        if let Some(t) = spec.template.spec.as_mut() {
            for v in t.volumes.iter_mut() {
                let Some(c) = claims.iter().find(|c| c.backup.volume_name == v.name) else {
                    continue;
                };
                if let Some(dv) = v.data_volume.take() {
                    replaced_dvs.push(dv.name);
                }
                let read_only = v.persistent_volume_claim.take().and_then(|p| p.read_only);
                if c.backup.copy_claim_name.is_some() {
                    // A copy is cloned by a DataVolume the VM makes and waits for.
                    v.data_volume = Some(api::DataVolumeSource {
                        name: c.name.clone(),
                        hotpluggable: None,
                    });
                } else {
                    v.persistent_volume_claim = Some(PvcSource {
                        claim_name: c.name.clone(),
                        read_only,
                        hotpluggable: None,
                    });
                }
            }
        }
        // A template would make (or import into) the claim the snapshot replaced.
        if let Some(templates) = spec.data_volume_templates.as_mut() {
            templates.retain(|t| {
                let n = t["metadata"]["name"].as_str().unwrap_or_default();
                !replaced_dvs.iter().any(|d| d == n)
            });
        }
        for c in claims {
            if let Some(copy) = &c.backup.copy_claim_name {
                let template = self.copy_template(c, copy)?;
                spec.data_volume_templates
                    .get_or_insert_with(Vec::new)
                    .push(template);
            }
        }
        let mut vm = match existing {
            Some(e) => {
                spec.running = e.spec.running;
                spec.run_strategy = e.spec.run_strategy;
                let mut vm = e.clone();
                vm.spec = spec;
                vm
            }
            None => {
                let mut vm = VirtualMachine::new(&self.restore.spec.target.name, spec);
                let mut annotations = source.metadata.annotations.clone().unwrap_or_default();
                annotations.retain(|k, _| !NOT_CARRIED_ANNOTATIONS.contains(&k.as_str()));
                vm.metadata = ObjectMeta {
                    name: Some(self.restore.spec.target.name.clone()),
                    namespace: Some(self.ns.clone()),
                    labels: source.metadata.labels.clone(),
                    annotations: Some(annotations),
                    ..Default::default()
                };
                vm
            }
        };
        vm.annotations_mut()
            .insert(ANNOTATION_LAST_RESTORE.into(), self.mark());
        vm.annotations_mut()
            .insert(ANNOTATION_RESTORE_NAME.into(), self.restore.name_any());
        let resumes = state_claim.is_some();
        match state_claim {
            // The disks restored are the ones captured with this memory, so the guest's next
            // start resumes it; the VM controller takes the annotation once.
            Some(_) => vm.annotations_mut().insert(
                ANNOTATION_START_FROM_SNAPSHOT.into(),
                self.restore.spec.virtual_machine_snapshot_name.clone(),
            ),
            None => vm.annotations_mut().remove(ANNOTATION_START_FROM_SNAPSHOT),
        };
        let vm = self.patched(vm)?;
        if resumes {
            same_machine(source, &vm)?;
        }
        Ok(vm)
    }

    /// The DataVolume template that clones copy `copy` into claim plan `c`'s name.
    fn copy_template(&self, c: &ClaimPlan, copy: &str) -> std::result::Result<Value, String> {
        let dv = super::capture::copy_of(&c.name, copy, &c.backup.persistent_volume_claim.spec);
        let (labels, annotations) = self.claim_metadata(c);
        Ok(json!({
            "metadata": {"name": c.name, "labels": labels, "annotations": annotations},
            "spec": serde_json::to_value(&dv.spec).map_err(|e| e.to_string())?,
        }))
    }

    /// `vm` with `spec.patches` applied (each a JSON patch), still a valid VirtualMachine.
    fn patched(&self, vm: VirtualMachine) -> std::result::Result<VirtualMachine, String> {
        if self.restore.spec.patches.is_empty() {
            return Ok(vm);
        }
        let mut doc = serde_json::to_value(&vm).map_err(|e| e.to_string())?;
        for (i, p) in self.restore.spec.patches.iter().enumerate() {
            let field = format!("spec.patches[{i}]");
            let patch = parse_json_patch(p)
                .map_err(|e| format!("{field}: not a JSON patch (RFC 6902): {e}"))?;
            json_patch::patch(&mut doc, &patch)
                .map_err(|e| format!("{field}: cannot be applied to the VirtualMachine: {e}"))?;
        }
        let patched: VirtualMachine = serde_json::from_value(doc)
            .map_err(|e| format!("spec.patches: the patched VirtualMachine is invalid: {e}"))?;
        if patched.metadata.name != vm.metadata.name
            || patched.metadata.namespace != vm.metadata.namespace
        {
            return Err(
                "spec.patches: may not change the VirtualMachine's name or namespace".into(),
            );
        }
        Ok(patched)
    }

    /// Makes the claims, then the VM, then gives the claims to the VM.
    async fn carry_out(&mut self, plan: Plan) -> Result<Action> {
        set_progress(
            &mut self.status.conditions,
            true,
            "Operation in progress",
            "Restoring the snapshot's volumes and VirtualMachine",
        );
        self.status.restores = plan
            .claims
            .iter()
            .map(|c| VolumeRestore {
                volume_name: c.backup.volume_name.clone(),
                persistent_volume_claim_name: c.name.clone(),
                volume_snapshot_name: c.backup.volume_snapshot_name.clone().unwrap_or_default(),
                data_volume_name: c.backup.copy_claim_name.as_ref().map(|_| c.name.clone()),
            })
            .collect();
        let mut waiting = false;
        for c in &plan.claims {
            waiting |= !self.make_claim(c).await?;
        }
        if waiting {
            return Ok(Action::requeue(RECHECK));
        }
        let vm = self.write_vm(plan.vm, plan.existing.is_some()).await?;
        if self
            .restore
            .spec
            .volume_ownership_policy
            .unwrap_or_default()
            == VolumeOwnershipPolicy::Vm
        {
            self.give_claims(&plan.claims, &vm).await?;
        }
        self.release().await?;
        self.status.complete = Some(true);
        self.status.restore_time = Some(controller_runtime::time::now_rfc3339());
        set_done(&mut self.status.conditions);
        Ok(Action::await_change())
    }

    /// Makes claim `c` from its VolumeSnapshot; false while a claim it replaces is going away.
    async fn make_claim(&self, c: &ClaimPlan) -> Result<bool> {
        let claims = self.api::<PersistentVolumeClaim>();
        if c.replaces {
            delete_if_present(&claims, &c.name, &DeleteParams::default()).await?;
            return Ok(false);
        }
        if c.backup.copy_claim_name.is_some() || claims.get_opt(&c.name).await?.is_some() {
            return Ok(true);
        }
        let backup = &c.backup.persistent_volume_claim;
        let mut spec = backup.spec.clone();
        spec.volume_name = None;
        spec.data_source = Some(TypedLocalObjectReference {
            api_group: Some("snapshot.storage.k8s.io".into()),
            kind: "VolumeSnapshot".into(),
            name: c.backup.volume_snapshot_name.clone().unwrap_or_default(),
        });
        spec.data_source_ref = None;
        let (labels, annotations) = self.claim_metadata(c);
        let claim = PersistentVolumeClaim {
            metadata: ObjectMeta {
                name: Some(c.name.clone()),
                namespace: Some(self.ns.clone()),
                labels: Some(labels),
                annotations: Some(annotations),
                ..Default::default()
            },
            spec: Some(spec),
            status: None,
        };
        create_if_absent(&claims, &claim).await?;
        Ok(true)
    }

    /// The labels and annotations of restored claim `c`: the captured claim's, the override's,
    /// and the restore's name.
    fn claim_metadata(
        &self,
        c: &ClaimPlan,
    ) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
        let backup = &c.backup.persistent_volume_claim;
        let o = self
            .restore
            .spec
            .volume_restore_overrides
            .iter()
            .find(|o| o.volume_name == c.backup.volume_name);
        let mut labels = backup.metadata.labels.clone().unwrap_or_default();
        let mut annotations: BTreeMap<String, String> =
            backup.metadata.annotations.clone().unwrap_or_default();
        annotations.retain(|k, _| !k.starts_with("pv.kubernetes.io/"));
        if let Some(o) = o {
            labels.extend(o.labels.clone());
            annotations.extend(o.annotations.clone());
        }
        annotations.insert(ANNOTATION_RESTORE_NAME.into(), self.restore.name_any());
        (labels, annotations)
    }

    /// Creates the target VM, or replaces the existing one's spec (conflicts retry the pass).
    async fn write_vm(&self, mut vm: VirtualMachine, exists: bool) -> Result<VirtualMachine> {
        let vms = self.api::<VirtualMachine>();
        if exists {
            if let Some(current) = vms.get_opt(&vm.name_any()).await? {
                if current.annotations().get(ANNOTATION_LAST_RESTORE) == Some(&self.mark()) {
                    return Ok(current);
                }
                // Its status (the lock) has changed since it was judged; its spec cannot have.
                vm.metadata.resource_version = current.metadata.resource_version;
            }
            return Ok(vms
                .replace(&vm.name_any(), &PostParams::default(), &vm)
                .await?);
        }
        match vms.create(&PostParams::default(), &vm).await {
            Ok(vm) => Ok(vm),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(vms.get(&vm.name_any()).await?),
            Err(e) => Err(e.into()),
        }
    }

    /// Makes `vm` an owner of every restored claim, so they go when it goes.
    async fn give_claims(&self, claims: &[ClaimPlan], vm: &VirtualMachine) -> Result<()> {
        let Some(owner) = vm.controller_owner_ref(&()) else {
            return Ok(());
        };
        let api = self.api::<PersistentVolumeClaim>();
        // A copy's claim belongs to its DataVolume, which the VM's template controls.
        for c in claims.iter().filter(|c| c.backup.copy_claim_name.is_none()) {
            let Some(claim) = api.get_opt(&c.name).await? else {
                continue;
            };
            if claim.owner_references().iter().any(|r| r.uid == owner.uid) {
                continue;
            }
            let mut refs = claim.owner_references().to_vec();
            refs.push(
                k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                    controller: None,
                    block_owner_deletion: None,
                    ..owner.clone()
                },
            );
            let patch = json!({"metadata": {"ownerReferences": refs,
                "resourceVersion": claim.resource_version()}});
            api.patch(&c.name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
        }
        Ok(())
    }
}

/// A VM that resumes a captured machine must be that machine's shape: its vCPUs and memory
/// are in the state, and a guest cannot find itself with others.
fn same_machine(source: &SnapshottedVm, vm: &VirtualMachine) -> std::result::Result<(), String> {
    let shape = |spec: &api::VirtualMachineSpec| {
        let domain = spec.template.spec.as_ref().map(|s| &s.domain);
        let cpu = domain.and_then(|d| d.cpu.as_ref());
        let cpu = cpu.map(|c| (c.sockets, c.cores, c.threads));
        let memory = domain
            .and_then(|d| d.memory.as_ref())
            .and_then(|m| m.guest.clone());
        (cpu, memory)
    };
    if shape(&source.spec) != shape(&vm.spec) {
        return Err(
            "spec.patches: the snapshot holds the running machine's memory and state, which the \
             restored VM resumes; its CPU topology and guest memory cannot be changed (restore \
             without these patches, or from a snapshot of the stopped VM)"
                .into(),
        );
    }
    Ok(())
}
