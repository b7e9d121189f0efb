//! The daemon's VM through its life, as one value. The protocol's verbs move it: `Sync` (or a
//! VM adopted from `run --socket`) starts it, `PrepareMigrationTarget` waits for one and its
//! arrival starts it, `Pause`/`Resume` flip it, `Shutdown` marks it stopping, a guest reset
//! that nobody asked to stop reboots it in place (KubeVirt keeps a VMI through a guest reboot),
//! its end (or a `MigrateOut` that handed it over) ends it. `status` reads the protocol's `VmState` off it; nothing else keeps flags
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
    /// The VM runs (or is paused); `stopping` once a graceful shutdown was asked for (the
    /// guest's reset then ends it instead of rebooting it).
    Running { vm: V, paused: bool, stopping: bool },
    /// The guest reset and its VM (stopped, kept for its counters) is being replaced by a new
    /// one built from the same VMI.
    Rebooting { vm: V },
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
            Lifecycle::Rebooting { .. } => Err("the VM is rebooting; try again shortly".into()),
            Lifecycle::Empty | Lifecycle::AwaitingMigration => Err("no VM: send Sync first".into()),
        }
    }

    /// The VM, running or ended (its counters outlive it).
    pub fn any_vm(&self) -> Option<&V> {
        match self {
            Lifecycle::Running { vm, .. }
            | Lifecycle::Rebooting { vm }
            | Lifecycle::Ended { vm, .. } => Some(vm),
            _ => None,
        }
    }

    pub fn state(&self) -> VmState {
        match self {
            Lifecycle::Empty => VmState::NoVm,
            Lifecycle::AwaitingMigration => VmState::WaitingForMigration,
            Lifecycle::Running { paused: true, .. } => VmState::Paused,
            Lifecycle::Running { .. } | Lifecycle::Rebooting { .. } => VmState::Running,
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
                *self = Lifecycle::Running {
                    vm,
                    paused: false,
                    stopping: false,
                };
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

    /// Shutdown: the guest was asked to power off, so its reset ends it.
    pub fn set_stopping(&mut self) {
        if let Lifecycle::Running { stopping, .. } = self {
            *stopping = true;
        }
    }

    /// SoftReboot: the running VM to ask, unless it is paused (KubeVirt's words) or stopping.
    pub fn vm_to_reboot(&self) -> Result<V, String> {
        match self {
            Lifecycle::Running { paused: true, .. } => Err("VMI is paused".into()),
            Lifecycle::Running { stopping: true, .. } => {
                Err("the VM is shutting down; it will not reboot".into())
            }
            _ => self.vm(),
        }
    }

    /// The VM ended as `end`: true when that is a guest reset nobody asked to stop, which
    /// moves it to `Rebooting` (the caller builds the new VM and calls `rebooted`); otherwise
    /// the VM has ended (see `finish`).
    pub fn end_or_reboot(&mut self, end: VmEnd) -> bool {
        match self {
            Lifecycle::Running {
                vm,
                stopping: false,
                ..
            } if end == VmEnd::Reset => {
                *self = Lifecycle::Rebooting { vm: vm.clone() };
                true
            }
            _ => {
                self.finish(end);
                false
            }
        }
    }

    /// The rebooted guest's new VM runs.
    pub fn rebooted(&mut self, vm: V) {
        if let Lifecycle::Rebooting { .. } = self {
            *self = Lifecycle::Running {
                vm,
                paused: false,
                stopping: false,
            };
        }
    }

    /// The VM ended as `end`. A hand-over already recorded (see [`Self::handed_over`]) stays.
    pub fn finish(&mut self, end: VmEnd) {
        if let Lifecycle::Running { vm, .. } | Lifecycle::Rebooting { vm } = self {
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
            stopping: false,
        };
        a.handed_over("tcp:t:1".into());
        a.finish(VmEnd::Migrated);
        let mut b = Lifecycle::Running {
            vm: (),
            paused: false,
            stopping: false,
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

    #[test]
    fn a_guest_reset_reboots_in_place_unless_a_shutdown_was_asked_for() {
        let mut l = Lifecycle::<u8>::Empty;
        l.start(1).unwrap();
        assert!(l.end_or_reboot(VmEnd::Reset));
        assert_eq!(l.state(), VmState::Running, "a reboot is not an end");
        assert!(l.vm().unwrap_err().contains("rebooting"));
        assert_eq!(
            l.any_vm(),
            Some(&1),
            "the old VM's counters until the new one runs"
        );
        l.rebooted(2);
        assert_eq!(l.vm(), Ok(2));
        l.set_paused(true);
        assert_eq!(l.vm_to_reboot().unwrap_err(), "VMI is paused");
        l.set_paused(false);
        assert_eq!(l.vm_to_reboot(), Ok(2));
        l.set_stopping();
        assert!(l.vm_to_reboot().unwrap_err().contains("shutting down"));
        assert!(
            !l.end_or_reboot(VmEnd::Reset),
            "a stopping guest's reset ends it"
        );
        assert_eq!(l.state(), VmState::ShutDown);

        let mut l = Lifecycle::<u8>::Empty;
        l.start(1).unwrap();
        assert!(!l.end_or_reboot(VmEnd::TripleFault { vcpu: 0 }));
        assert_eq!(l.state(), VmState::Crashed);
        // A reboot whose new VM could not be built ends as the reset it was.
        let mut l = Lifecycle::<u8>::Empty;
        l.start(1).unwrap();
        assert!(l.end_or_reboot(VmEnd::Reset));
        l.finish(VmEnd::Reset);
        assert_eq!(l.state(), VmState::ShutDown);
        assert_eq!(l.any_vm(), Some(&1));
    }
}
