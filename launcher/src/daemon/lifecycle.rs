//! The daemon's VM through its life, as one value. The protocol's verbs move it: `Sync` (or a
//! VM adopted from `run --socket`) starts it, `PrepareMigrationTarget` waits for one and its
//! arrival starts it, `Pause`/`Resume` flip it, its end (or a `MigrateOut` that handed it
//! over) ends it. `status` reads the protocol's `VmState` off it; nothing else keeps flags
//! that would have to agree.

use api::protocol::VmState;
use vmm::VmEnd;

#[derive(Debug, Default)]
pub enum Lifecycle<V> {
    /// No VM yet.
    #[default]
    Empty,
    /// A migration target's listener waits for the source.
    AwaitingMigration,
    /// The VM runs (or is paused).
    Running { vm: V, paused: bool },
    /// The VM ended: how, and where it went when it left by migration.
    Ended {
        vm: V,
        end: VmEnd,
        migrated_to: Option<String>,
    },
}

impl<V: Clone> Lifecycle<V> {
    /// The running VM, for the verbs that drive it.
    pub fn vm(&self) -> Result<V, String> {
        match self {
            Lifecycle::Running { vm, .. } => Ok(vm.clone()),
            Lifecycle::Ended { end, .. } => Err(format!("the VM has ended ({end})")),
            Lifecycle::Empty | Lifecycle::AwaitingMigration => Err("no VM: send Sync first".into()),
        }
    }

    /// The VM, running or ended (its counters outlive it).
    pub fn any_vm(&self) -> Option<&V> {
        match self {
            Lifecycle::Running { vm, .. } | Lifecycle::Ended { vm, .. } => Some(vm),
            _ => None,
        }
    }

    pub fn state(&self) -> VmState {
        match self {
            Lifecycle::Empty => VmState::NoVm,
            Lifecycle::AwaitingMigration => VmState::WaitingForMigration,
            Lifecycle::Running { paused: true, .. } => VmState::Paused,
            Lifecycle::Running { .. } => VmState::Running,
            Lifecycle::Ended { end, .. } => match end {
                VmEnd::Migrated => VmState::Migrated,
                VmEnd::PoweredOff | VmEnd::Reset | VmEnd::Stopped => VmState::ShutDown,
                _ => VmState::Crashed,
            },
        }
    }

    pub fn end(&self) -> Option<&VmEnd> {
        match self {
            Lifecycle::Ended { end, .. } => Some(end),
            _ => None,
        }
    }

    pub fn migrated_to(&self) -> Option<&str> {
        match self {
            Lifecycle::Ended { migrated_to, .. } => migrated_to.as_deref(),
            _ => None,
        }
    }

    /// Whether nothing is here or on its way (the network may still be attached).
    pub fn is_empty(&self) -> bool {
        matches!(self, Lifecycle::Empty)
    }

    /// PrepareMigrationTarget: only an empty launcher waits for a VM.
    pub fn await_migration(&mut self) -> Result<(), String> {
        if !self.is_empty() {
            return Err("this launcher already has a VM (or awaits one)".into());
        }
        *self = Lifecycle::AwaitingMigration;
        Ok(())
    }

    /// The awaited migration did not arrive: empty again.
    pub fn migration_failed(&mut self) {
        if matches!(self, Lifecycle::AwaitingMigration) {
            *self = Lifecycle::Empty;
        }
    }

    /// Sync, an arrived migration, or an adopted VM: it runs here now.
    pub fn start(&mut self, vm: V) -> Result<(), String> {
        match self {
            Lifecycle::Empty | Lifecycle::AwaitingMigration => {
                *self = Lifecycle::Running { vm, paused: false };
                Ok(())
            }
            _ => Err("this launcher already has a VM".into()),
        }
    }

    /// Pause / Resume (and a snapshot or failed migration that leaves the guest paused).
    pub fn set_paused(&mut self, now: bool) {
        if let Lifecycle::Running { paused, .. } = self {
            *paused = now;
        }
    }

    /// The VM ended as `end`. A hand-over already recorded (see [`Self::handed_over`]) stays.
    pub fn finish(&mut self, end: VmEnd) {
        if let Lifecycle::Running { vm, .. } = self {
            *self = Lifecycle::Ended {
                vm: vm.clone(),
                end,
                migrated_to: None,
            };
        }
    }

    /// MigrateOut succeeded: the VM runs at `address` now (its end is `Migrated`, whether or
    /// not the thread watching it has seen that yet).
    pub fn handed_over(&mut self, address: String) {
        match self {
            Lifecycle::Running { vm, .. } => {
                *self = Lifecycle::Ended {
                    vm: vm.clone(),
                    end: VmEnd::Migrated,
                    migrated_to: Some(address),
                }
            }
            Lifecycle::Ended { migrated_to, .. } => *migrated_to = Some(address),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_verbs_walk_the_protocol_states() {
        let mut l = Lifecycle::<()>::Empty;
        assert_eq!(l.state(), VmState::NoVm);
        assert_eq!(l.vm().unwrap_err(), "no VM: send Sync first");
        l.await_migration().unwrap();
        assert_eq!(l.state(), VmState::WaitingForMigration);
        assert!(l.await_migration().is_err(), "one migration at a time");
        l.migration_failed();
        assert_eq!(l.state(), VmState::NoVm);
        l.start(()).unwrap();
        assert!(l.start(()).is_err(), "a second Sync makes no second VM");
        l.set_paused(true);
        assert_eq!(l.state(), VmState::Paused);
        l.set_paused(false);
        assert_eq!(l.state(), VmState::Running);
        l.finish(VmEnd::PoweredOff);
        assert_eq!(l.state(), VmState::ShutDown);
        assert!(l.vm().unwrap_err().starts_with("the VM has ended"));
        l.set_paused(true);
        assert_eq!(l.state(), VmState::ShutDown, "an ended VM is not paused");
    }

    #[test]
    fn a_hand_over_is_kept_whichever_side_records_the_end_first() {
        let mut a = Lifecycle::Running {
            vm: (),
            paused: true,
        };
        a.handed_over("tcp:t:1".into());
        a.finish(VmEnd::Migrated);
        let mut b = Lifecycle::Running {
            vm: (),
            paused: false,
        };
        b.finish(VmEnd::Migrated);
        b.handed_over("tcp:t:1".into());
        for l in [a, b] {
            assert_eq!(l.state(), VmState::Migrated);
            assert_eq!(l.migrated_to(), Some("tcp:t:1"));
        }
    }

    #[test]
    fn an_awaited_migration_that_arrives_runs_without_passing_through_empty() {
        let mut l = Lifecycle::<()>::Empty;
        l.await_migration().unwrap();
        l.start(()).unwrap();
        assert_eq!(l.state(), VmState::Running);
    }
}
