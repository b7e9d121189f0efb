//! The target's side of a migration: the machine checked against what this side was
//! prepared for before any memory moves, memory taken in while the source runs the guest,
//! the state restored paused, and the guest run only once the source hands it over (Go) and
//! this side has confirmed (Running).

use std::io::{Read, Write};
use std::time::Duration;

use vm_memory::{Bytes, GuestAddress};

use super::protocol::Conversation;
use super::wire::{self, Hello, Kind, WireError};
use super::{MigrationError, MigrationFailure, Phase, Side};
use crate::builder::RestoreShell;
use crate::config::VmConfig;
use crate::layout::{ram_regions, MIB};
use crate::memory::{file_layout, RegionLayout, PAGE_SIZE};
use crate::persist::{self, FORMAT_VERSION};
use crate::vm::Vm;

impl Vm {
    /// Receives a VM from the source at the other end of `stream` and runs it with `config`'s
    /// host resources (disks, TAPs, console). Refuses, before any memory moves, a machine other
    /// than `config` describes. Whatever goes wrong, the guest never runs here unless the
    /// source handed it over (Go) and this side confirmed (Running).
    pub fn migrate_in<S: Read + Write>(
        stream: &mut S,
        config: &VmConfig,
    ) -> Result<Vm, MigrationFailure> {
        let mut phase = Phase::Handshake;
        receive_machine(stream, config, &mut phase).map_err(|error| {
            // Tell the source why, unless it already knows (a refusal, its own cancel) or the
            // connection itself failed (writing to it could block on a dead TLS session).
            // Written past the conversation: whatever stage it broke in, a Failed ends it.
            if !matches!(
                error,
                MigrationError::Refused(_)
                    | MigrationError::Cancelled(_)
                    | MigrationError::Wire(WireError::Io(_))
            ) {
                let _ = wire::write_frame(stream, Kind::Failed, error.to_string().as_bytes());
                let _ = stream.flush();
            }
            MigrationFailure {
                side: Side::Target,
                phase,
                pass: None,
                error,
            }
        })
    }
}

fn receive_machine<S: Read + Write>(
    stream: &mut S,
    config: &VmConfig,
    phase: &mut Phase,
) -> Result<Vm, MigrationError> {
    let mut conv = Conversation::accept(stream)?;
    let layout = file_layout(&ram_regions(config.memory_mib * MIB));
    let shell = match prepare(&mut conv, config, &layout)? {
        Ok(shell) => shell,
        Err(why) => {
            conv.say(Kind::Refuse, why.as_bytes())?;
            return Err(MigrationError::Refused(why));
        }
    };
    conv.say(Kind::Ready, &[])?;
    *phase = Phase::Precopy;
    let state = receive_memory(&mut conv, &shell, &layout)?;
    *phase = Phase::StopAndCopy;
    let state = persist::decode(&state, std::path::Path::new("<migration stream>"))
        .map_err(|e| MigrationError::TargetFailed(e.to_string()))?;
    let vm = Vm::restore_into(shell, config, state)
        .map_err(|e| MigrationError::TargetFailed(e.to_string()))?;
    conv.say(Kind::Restored, &[])?;
    *phase = Phase::Switchover;
    if let Err(e) = take_over(&mut conv, &vm) {
        vm.stop();
        return Err(e);
    }
    vm.resume();
    vm.announce_network();
    *phase = Phase::Completed;
    Ok(vm)
}

/// The source's Hello, checked against `config`; then KVM's VM, its memory slots, disks and
/// TAPs, made now while the source still runs the guest, not during the downtime. The inner
/// Err is why this target refuses the machine (before any memory moves).
fn prepare<S: Read + Write>(
    conv: &mut Conversation<'_, S>,
    config: &VmConfig,
    layout: &[RegionLayout],
) -> Result<Result<RestoreShell, String>, MigrationError> {
    let (_, hello) = conv.receive()?;
    let hello: Hello = postcard::from_bytes(&hello).map_err(|_| WireError::Malformed("Hello"))?;
    if hello.state_format != FORMAT_VERSION {
        return Ok(Err(format!(
            "state format {} (written by microvirt {}); this target reads format {FORMAT_VERSION}",
            hello.state_format, hello.vmm_version
        )));
    }
    if hello.vcpus != config.vcpus || hello.memory_mib != config.memory_mib {
        return Ok(Err(format!(
            "the source VM has {} vCPU(s) and {} MiB, this target was prepared for {} and {}",
            hello.vcpus, hello.memory_mib, config.vcpus, config.memory_mib
        )));
    }
    if hello.memory != layout {
        return Ok(Err("the memory layouts differ".into()));
    }
    let ram = crate::builder::guest_ram(config)?;
    // A host resource missing here refuses the migration.
    Ok(RestoreShell::prepare(config, ram, false)
        .map_err(|e| format!("cannot prepare the machine: {e}")))
}

/// Pages into guest memory (each run checked to lie inside RAM), Syncs answered, until the
/// machine state arrives; returns it.
fn receive_memory<S: Read + Write>(
    conv: &mut Conversation<'_, S>,
    shell: &RestoreShell,
    layout: &[RegionLayout],
) -> Result<Vec<u8>, MigrationError> {
    loop {
        match conv.receive()? {
            (Kind::Pages, p) => {
                for run in wire::parse_pages(&p, layout)? {
                    shell
                        .memory()
                        .write_slice(run.bytes, GuestAddress(run.gpa))
                        .map_err(|_| WireError::OutOfRange {
                            gpa: run.gpa,
                            pages: (run.bytes.len() as u64 / PAGE_SIZE) as u32,
                        })?;
                }
            }
            (Kind::Sync, _) => conv.say(Kind::Synced, &[])?,
            (_, state) => return Ok(state),
        }
    }
}

/// Go, then the disks locked, then Running written before the guest runs: a source that
/// does not get it knows this side never ran the guest (see the source's switch-over).
fn take_over<S: Read + Write>(
    conv: &mut Conversation<'_, S>,
    vm: &Vm,
) -> Result<(), MigrationError> {
    conv.receive()?;
    vm.lock_disks(Duration::from_secs(10))
        .map_err(|e| MigrationError::TargetFailed(e.to_string()))?;
    conv.say(Kind::Running, &[])
}
