//! The VirtualMachineClone reconciler: a `match` on the clone's phase, as KubeVirt's clone
//! controller walks it.
//!
//! 1. (no phase) The source and target are judged — the source a VM or a VM snapshot in the
//!    clone's namespace, the target a VM that does not exist yet. A VM source is snapshotted
//!    (`tmp-snapshot-<clone UID>`, the clone's own): `SnapshotInProgress`. A snapshot source
//!    goes straight to `CreatingTargetVM`.
//! 2. `SnapshotInProgress`: until the snapshot is ready (or failed: the clone fails with its
//!    reason).
//! 3. `CreatingTargetVM`: the snapshot must be ready to use (one that is not yet is waited for,
//!    the reason on the clone's conditions; a failed or missing one fails the clone); the
//!    identity patches are made from the VM the snapshot holds (`api::clone::identity_patches`,
//!    where bad input is refused) and a VirtualMachineRestore (`tmp-restore-<clone UID>`, the
//!    clone's own) makes the target VM from the snapshot: `RestoreInProgress`.
//! 4. `RestoreInProgress`: once the restore is complete and every claim it made is bound:
//!    `Succeeded`. A failed restore fails the clone.
//! 5. `Succeeded` or `Failed`: the clone's own snapshot and restore are deleted. Only now, after
//!    the ending is written: every step above may run again after a lost status write, and
//!    must find what it made where it left it.
//!
//! Nothing here writes to the source VM or its claims: a failed clone leaves them as they were
//! (a snapshot only reads them; a restore into a new VM makes new claims).

use std::sync::Arc;
use std::time::Duration;

use api::cdi::{DataVolume, DataVolumePhase};
use api::clone::{
    identity_patches, source_of, target_name_of, temporary_restore_name, temporary_snapshot_name,
    validate_clone, ClonePhase, CloneSource, VirtualMachineClone, VirtualMachineCloneStatus,
};
use api::snapshot::{
    SnapshotPhase, SnapshottedVm, VirtualMachineRestore, VirtualMachineRestoreSpec,
    VirtualMachineSnapshot, VirtualMachineSnapshotContent, VirtualMachineSnapshotSpec,
};
use api::VirtualMachine;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, TypedLocalObjectReference};
use kube::api::{Api, DeleteParams};
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};

use super::{set_done, set_progress};
use crate::context::{Context, Error, Result};
use controller_runtime::{controller_ref, create_if_absent, delete_if_present, write_status};

pub const CONTROLLER: &str = "vmclone-controller";

/// How often a clone that waits on its snapshot, its restore or its claims is looked at again.
const RECHECK: Duration = Duration::from_secs(2);

pub fn error_policy(c: Arc<VirtualMachineClone>, err: &Error, ctx: Arc<Context>) -> Action {
    ctx.retry(CONTROLLER, c.as_ref(), err)
}

/// Where a clone stands (its `status.phase`).
enum Stage {
    /// Being deleted: its snapshot and restore go with it (owner references).
    Deleted,
    /// Succeeded or failed: its own snapshot and restore are deleted.
    Ended,
    /// Nothing done yet.
    Starting,
    /// Waiting for the snapshot of the source VM.
    Snapshotting(String),
    /// The snapshot (of the VM, or the source itself) is to be restored into the target.
    CreatingTarget(String),
    /// Waiting for the restore that makes the target.
    Restoring(String),
}

/// Why a clone cannot go on now.
enum Hold {
    /// It never will: the clone fails with this reason.
    Refused(String),
    /// Not yet: reason and message for its conditions.
    Waiting(&'static str, String),
}

struct Pass {
    clone: Arc<VirtualMachineClone>,
    ctx: Arc<Context>,
    ns: String,
    uid: String,
    status: VirtualMachineCloneStatus,
}

pub async fn reconcile(clone: Arc<VirtualMachineClone>, ctx: Arc<Context>) -> Result<Action> {
    let mut pass = Pass {
        ns: clone.namespace().unwrap_or_default(),
        uid: clone.uid().unwrap_or_default(),
        status: clone.status.clone().unwrap_or_default(),
        clone,
        ctx,
    };
    let step = match pass.stage() {
        Stage::Deleted => return Ok(Action::await_change()),
        Stage::Ended => {
            // Cleaned up only once the ending is written: a pass that deleted the restore and
            // then lost its status write would find the restore gone and fail the clone.
            pass.clean_up().await?;
            return Ok(Action::await_change());
        }
        Stage::Starting => pass.start().await?,
        Stage::Snapshotting(name) => pass.snapshotting(&name).await?,
        Stage::CreatingTarget(name) => pass.create_target(&name).await?,
        Stage::Restoring(name) => pass.restoring(&name).await?,
    };
    let action = match step {
        Ok(action) => action,
        Err(Hold::Refused(why)) => pass.fail(why).await?,
        Err(Hold::Waiting(reason, message)) => {
            set_progress(&mut pass.status.conditions, false, reason, &message);
            Action::requeue(RECHECK)
        }
    };
    let api = pass.api::<VirtualMachineClone>();
    write_status(&api, pass.clone.as_ref(), pass.status.clone()).await?;
    pass.ctx.succeeded(CONTROLLER, pass.clone.as_ref());
    Ok(action)
}

type Step = std::result::Result<Action, Hold>;

impl Pass {
    fn api<K>(&self) -> Api<K>
    where
        K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
    {
        Api::namespaced(self.ctx.client.clone(), &self.ns)
    }

    fn stage(&self) -> Stage {
        if self.clone.meta().deletion_timestamp.is_some() {
            return Stage::Deleted;
        }
        let snapshot = self.status.snapshot_name.clone().unwrap_or_default();
        match self.status.phase {
            None => Stage::Starting,
            Some(ClonePhase::SnapshotInProgress) => Stage::Snapshotting(snapshot),
            Some(ClonePhase::CreatingTargetVm) => Stage::CreatingTarget(snapshot),
            Some(ClonePhase::RestoreInProgress) => {
                Stage::Restoring(self.status.restore_name.clone().unwrap_or_default())
            }
            Some(ClonePhase::Succeeded | ClonePhase::Failed | ClonePhase::Unknown) => Stage::Ended,
        }
    }

    fn progress(&mut self, phase: ClonePhase, message: String) {
        self.status.phase = Some(phase);
        let reason = match phase {
            ClonePhase::SnapshotInProgress => "SnapshotInProgress",
            ClonePhase::CreatingTargetVm => "CreatingTargetVM",
            _ => "RestoreInProgress",
        };
        set_progress(&mut self.status.conditions, true, reason, &message);
    }

    /// The source and target judged; the source VM's snapshot started.
    async fn start(&mut self) -> Result<Step> {
        // Everything judged that can be before the snapshot is taken.
        let source = match validate_clone(&self.clone.spec) {
            Ok(s) => s,
            Err(why) => return Ok(Err(Hold::Refused(why))),
        };
        let restore = temporary_restore_name(&self.uid);
        if self
            .api::<VirtualMachineRestore>()
            .get_opt(&restore)
            .await?
            .is_some()
        {
            // A pass that made the restore and lost its status write: the target may exist
            // already, made by that restore, so it is not judged again.
            let snapshot = match source {
                CloneSource::Snapshot(name) => name,
                CloneSource::Vm(_) => temporary_snapshot_name(&self.uid),
            };
            self.status.snapshot_name = Some(snapshot.clone());
            self.status
                .creation_time
                .get_or_insert_with(controller_runtime::time::now_rfc3339);
            return self.create_target(&snapshot).await;
        }
        if let Err(hold) = self.target().await? {
            return Ok(Err(hold));
        }
        self.status.creation_time = Some(controller_runtime::time::now_rfc3339());
        match source {
            CloneSource::Snapshot(name) => {
                self.status.snapshot_name = Some(name.clone());
                self.progress(
                    ClonePhase::CreatingTargetVm,
                    format!("restoring VirtualMachineSnapshot {name:?}"),
                );
                self.create_target(&name).await
            }
            CloneSource::Vm(vm) => {
                if self.api::<VirtualMachine>().get_opt(&vm).await?.is_none() {
                    return Ok(Err(Hold::Waiting(
                        "SourceDoesNotExist",
                        format!("spec.source: VirtualMachine {vm:?} does not exist (yet)"),
                    )));
                }
                let name = temporary_snapshot_name(&self.uid);
                let mut snapshot = VirtualMachineSnapshot::new(
                    &name,
                    VirtualMachineSnapshotSpec {
                        source: self.clone.spec.source.clone(),
                        ..Default::default()
                    },
                );
                snapshot.metadata.namespace = Some(self.ns.clone());
                snapshot.metadata.owner_references =
                    controller_ref(self.clone.as_ref()).map(|r| vec![r]);
                create_if_absent(&self.api(), &snapshot).await?;
                self.status.snapshot_name = Some(name.clone());
                self.progress(
                    ClonePhase::SnapshotInProgress,
                    format!("snapshotting VirtualMachine {vm:?} as {name:?}"),
                );
                Ok(Ok(Action::requeue(RECHECK)))
            }
        }
    }

    /// The target's name, if no VM of that name exists.
    async fn target(&self) -> Result<std::result::Result<String, Hold>> {
        let name = match target_name_of(&self.clone.spec, &self.uid) {
            Ok(n) => n,
            Err(why) => return Ok(Err(Hold::Refused(why))),
        };
        if self.api::<VirtualMachine>().get_opt(&name).await?.is_some() {
            return Ok(Err(Hold::Refused(format!(
                "spec.target: VirtualMachine {name:?} exists; a clone makes a new VM, name one \
                 that does not exist or leave spec.target out"
            ))));
        }
        Ok(Ok(name))
    }

    /// Waiting for the snapshot of the source VM.
    async fn snapshotting(&mut self, name: &str) -> Result<Step> {
        let Some(snapshot) = self.api::<VirtualMachineSnapshot>().get_opt(name).await? else {
            return Ok(Err(Hold::Refused(format!(
                "the clone's VirtualMachineSnapshot {name:?} was deleted before it was ready"
            ))));
        };
        let status = snapshot.status.unwrap_or_default();
        match status.phase {
            Some(SnapshotPhase::Succeeded) if status.ready_to_use == Some(true) => {
                self.progress(
                    ClonePhase::CreatingTargetVm,
                    format!("restoring VirtualMachineSnapshot {name:?}"),
                );
                self.create_target(name).await
            }
            Some(SnapshotPhase::Failed) => {
                let why = status.error.and_then(|e| e.message).unwrap_or_default();
                Ok(Err(Hold::Refused(format!(
                    "the snapshot of the source VM failed: {why}"
                ))))
            }
            _ => Ok(Ok(Action::requeue(RECHECK))),
        }
    }

    /// The snapshot `name` (ready to use) restored into the target VM.
    async fn create_target(&mut self, name: &str) -> Result<Step> {
        let restore_name = temporary_restore_name(&self.uid);
        if let Some(made) = self
            .api::<VirtualMachineRestore>()
            .get_opt(&restore_name)
            .await?
        {
            // Made by a pass whose status write was lost: its target is ours.
            return Ok(Ok(self.restoring_into(
                made.spec.target.name,
                restore_name,
                name,
            )));
        }
        let source = match self.snapshotted_vm(name).await? {
            Ok(s) => s,
            Err(hold) => return Ok(Err(hold)),
        };
        let patches = match identity_patches(&self.clone.spec, &source) {
            Ok(p) => p,
            Err(why) => return Ok(Err(Hold::Refused(why))),
        };
        let target = match self.target().await? {
            Ok(t) => t,
            Err(hold) => return Ok(Err(hold)),
        };
        let mut restore = VirtualMachineRestore::new(
            &restore_name,
            VirtualMachineRestoreSpec {
                target: TypedLocalObjectReference {
                    api_group: Some("kubevirt.io".into()),
                    kind: "VirtualMachine".into(),
                    name: target.clone(),
                },
                virtual_machine_snapshot_name: name.to_string(),
                volume_restore_policy: self.clone.spec.volume_name_policy,
                patches,
                ..Default::default()
            },
        );
        restore.metadata.namespace = Some(self.ns.clone());
        restore.metadata.owner_references = controller_ref(self.clone.as_ref()).map(|r| vec![r]);
        create_if_absent(&self.api(), &restore).await?;
        Ok(Ok(self.restoring_into(target, restore_name, name)))
    }

    fn restoring_into(&mut self, target: String, restore: String, snapshot: &str) -> Action {
        self.progress(
            ClonePhase::RestoreInProgress,
            format!("restoring {snapshot:?} into VirtualMachine {target:?}"),
        );
        self.status.restore_name = Some(restore);
        self.status.target_name = Some(target);
        Action::requeue(RECHECK)
    }

    /// The VM snapshot `name` holds, if it is ready to use.
    async fn snapshotted_vm(&self, name: &str) -> Result<std::result::Result<SnapshottedVm, Hold>> {
        let refuse = |m: String| Ok(Err(Hold::Refused(m)));
        let Some(snapshot) = self.api::<VirtualMachineSnapshot>().get_opt(name).await? else {
            return refuse(format!("VirtualMachineSnapshot {name:?} does not exist"));
        };
        let status = snapshot.status.unwrap_or_default();
        if status.phase == Some(SnapshotPhase::Failed) {
            let why = status.error.and_then(|e| e.message).unwrap_or_default();
            return refuse(format!(
                "VirtualMachineSnapshot {name:?} failed and cannot be cloned: {why}"
            ));
        }
        if status.ready_to_use != Some(true) {
            return Ok(Err(Hold::Waiting(
                "SnapshotNotReady",
                format!(
                    "VirtualMachineSnapshot {name:?} is not ready to use; the clone starts once \
                     its readyToUse is true"
                ),
            )));
        }
        let content_name = status
            .virtual_machine_snapshot_content_name
            .unwrap_or_default();
        let content = self
            .api::<VirtualMachineSnapshotContent>()
            .get_opt(&content_name)
            .await?;
        match content.and_then(|c| c.spec.source.virtual_machine) {
            Some(vm) => Ok(Ok(vm)),
            None => refuse(format!(
                "VirtualMachineSnapshot {name:?}: its content {content_name:?} holds no VM"
            )),
        }
    }

    /// Waiting for the restore, then for the claims it made to be bound.
    async fn restoring(&mut self, name: &str) -> Result<Step> {
        let Some(restore) = self.api::<VirtualMachineRestore>().get_opt(name).await? else {
            return Ok(Err(Hold::Refused(format!(
                "the clone's VirtualMachineRestore {name:?} was deleted before it completed"
            ))));
        };
        let status = restore.status.unwrap_or_default();
        if let Some(failure) = status
            .conditions
            .iter()
            .find(|c| c.type_ == "Failure" && c.status == "True")
        {
            let why = failure.message.clone().unwrap_or_default();
            return Ok(Err(Hold::Refused(format!("the restore failed: {why}"))));
        }
        if status.complete != Some(true) {
            return Ok(Ok(Action::requeue(RECHECK)));
        }
        // The claims are made from the snapshot's VolumeSnapshots or copies: the snapshot
        // stays until the storage (or the DataVolume's clone) has filled them.
        let claims = self.api::<PersistentVolumeClaim>();
        let dvs = self.api::<DataVolume>();
        for r in &status.restores {
            if let Some(dv) = &r.data_volume_name {
                let phase = dvs.get_opt(dv).await?.and_then(|d| d.status?.phase);
                if phase != Some(DataVolumePhase::Succeeded) {
                    return Ok(Err(Hold::Waiting(
                        "RestoreInProgress",
                        format!(
                            "waiting for DataVolume {dv:?} of volume {:?} to copy",
                            r.volume_name
                        ),
                    )));
                }
                continue;
            }
            let bound = claims
                .get_opt(&r.persistent_volume_claim_name)
                .await?
                .and_then(|c| c.status?.phase)
                .is_some_and(|p| p == "Bound");
            if !bound {
                return Ok(Err(Hold::Waiting(
                    "RestoreInProgress",
                    format!(
                        "waiting for claim {:?} of volume {:?} to be bound",
                        r.persistent_volume_claim_name, r.volume_name
                    ),
                )));
            }
        }
        self.status.phase = Some(ClonePhase::Succeeded);
        set_done(&mut self.status.conditions);
        let target = self.status.target_name.clone().unwrap_or_default();
        self.ctx
            .event(
                self.clone.as_ref(),
                false,
                "CloneSucceeded",
                "Clone",
                format!("VirtualMachine {target:?} made"),
            )
            .await;
        Ok(Ok(Action::await_change()))
    }

    /// The clone's own snapshot and restore deleted (a source snapshot stays).
    async fn clean_up(&self) -> Result<()> {
        let dp = DeleteParams::background();
        if let Some(r) = &self.status.restore_name {
            delete_if_present(&self.api::<VirtualMachineRestore>(), r, &dp).await?;
        }
        if let (Ok(CloneSource::Vm(_)), Some(s)) =
            (source_of(&self.clone.spec), &self.status.snapshot_name)
        {
            delete_if_present(&self.api::<VirtualMachineSnapshot>(), s, &dp).await?;
        }
        Ok(())
    }

    async fn fail(&mut self, why: String) -> Result<Action> {
        self.status.phase = Some(ClonePhase::Failed);
        set_progress(&mut self.status.conditions, false, "Failed", &why);
        self.ctx
            .event(self.clone.as_ref(), true, "CloneFailed", "Clone", why)
            .await;
        Ok(Action::await_change())
    }
}
