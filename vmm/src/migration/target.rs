//! The target's side of a migration: the machine checked against what this side was
//! prepared for before any memory moves, memory taken in while the source runs the guest,
//! the state restored paused, and the guest run only once the source hands it over (Go); this
//! side then confirms (Running).

use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::protocol::Conversation;
use super::wire::{self, Hello, Kind, WireError};
use super::{MigrationError, MigrationFailure, Phase, Side};
use crate::builder::RestoreShell;
use crate::config::VmConfig;
use crate::layout::{ram_regions, MIB};
use crate::memory::{file_layout, RegionLayout};
use crate::persist::{self, FORMAT_VERSION};
use crate::vm::Vm;

impl Vm {
    /// Receives a VM from the source at the other end of `stream` and runs it with `config`'s
    /// host resources (disks, TAPs, console). Refuses, before any memory moves, a machine other
    /// than `config` describes. Whatever goes wrong, the guest never runs here unless the
    /// source handed it over (Go).
    pub fn migrate_in<S: Read + Write>(
        stream: &mut S,
        config: &VmConfig,
    ) -> Result<Vm, MigrationFailure> {
        Self::migrate_in_streams(stream, &mut [] as &mut [std::io::Empty], config)
    }

    /// As `migrate_in`, from a source that sends its pages on `page_streams` (as many as its
    /// Hello says, in the order their headers give; see `Vm::migrate_out_streams`), each read
    /// by a thread of its own straight into guest memory.
    pub fn migrate_in_streams<S: Read + Write, P: Read + Send>(
        stream: &mut S,
        page_streams: &mut [P],
        config: &VmConfig,
    ) -> Result<Vm, MigrationFailure> {
        let mut phase = Phase::Handshake;
        receive_machine(stream, page_streams, config, &mut phase).map_err(|error| {
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

fn receive_machine<S: Read + Write, P: Read + Send>(
    stream: &mut S,
    page_streams: &mut [P],
    config: &VmConfig,
    phase: &mut Phase,
) -> Result<Vm, MigrationError> {
    let mut conv = Conversation::accept(stream)?;
    let layout = file_layout(&ram_regions(config.memory_mib * MIB));
    let shell = match prepare(&mut conv, config, &layout, page_streams.len())? {
        Ok(shell) => shell,
        Err(why) => {
            conv.say(Kind::Refuse, why.as_bytes())?;
            return Err(MigrationError::Refused(why));
        }
    };
    conv.say(Kind::Ready, &[])?;
    *phase = Phase::Precopy;
    put_in_header_order(page_streams)?;
    let state = receive_memory(&mut conv, page_streams, &shell, &layout)?;
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
    page_streams: usize,
) -> Result<Result<RestoreShell, String>, MigrationError> {
    let (_, hello) = conv.receive()?;
    let hello: Hello = postcard::from_bytes(&hello).map_err(|_| WireError::Malformed("Hello"))?;
    if hello.page_streams as usize != page_streams {
        return Ok(Err(format!(
            "the source sends its pages on {} page stream(s), this target was given {page_streams}",
            hello.page_streams
        )));
    }
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
/// machine state arrives; returns it. With `page_streams` the pages arrive there, each read by
/// a thread of its own straight into guest memory; a Sync on a page stream marks that
/// everything before it is in: the conversation's Sync is answered, and its State taken in,
/// only once every page stream has reached its mark, and after the State's marks the page
/// streams' threads end. Without, the pages come on the conversation and no thread is started.
/// Reads every page stream's opening index and reorders the streams by it: links that
/// crossed proxies or finished their handshakes in another order than they were opened
/// still each carry their own chunks. Every index must appear once and be below the
/// Hello's count.
fn put_in_header_order<P: Read>(page_streams: &mut [P]) -> Result<(), MigrationError> {
    let n = page_streams.len();
    let mut index_at = Vec::with_capacity(n);
    let mut seen = vec![false; n];
    for p in page_streams.iter_mut() {
        let index = wire::read_page_stream_header(p)? as usize;
        if index >= n || std::mem::replace(&mut seen[index], true) {
            return Err(WireError::Malformed(
                "page stream header (an index twice, or past the Hello's count)",
            )
            .into());
        }
        index_at.push(index);
    }
    // Each swap puts one stream at its place for good.
    for i in 0..n {
        while index_at[i] != i {
            let j = index_at[i];
            page_streams.swap(i, j);
            index_at.swap(i, j);
        }
    }
    Ok(())
}

fn receive_memory<S: Read + Write, P: Read + Send>(
    conv: &mut Conversation<'_, S>,
    page_streams: &mut [P],
    shell: &RestoreShell,
    layout: &[RegionLayout],
) -> Result<Vec<u8>, MigrationError> {
    use std::sync::mpsc::channel;
    let count = page_streams.len();
    let memory = shell.memory();
    let all_in = AtomicBool::new(false);
    let ram_bytes: u64 = layout.iter().map(|r| r.size).sum();
    let mut planned_bytes = 0u64;
    std::thread::scope(|scope| {
        let (planned, plan) = channel::<Vec<(u64, u64)>>();
        let all_in = &all_in;
        scope.spawn(move || prefault(memory, plan, all_in));
        let (marked, marks) = channel::<Result<(), MigrationError>>();
        let mut go_on = Vec::with_capacity(count);
        for (index, stream) in page_streams.iter_mut().enumerate() {
            let (go, going) = channel::<()>();
            go_on.push(go);
            let marked = marked.clone();
            scope.spawn(move || {
                let mut read = || -> Result<(), MigrationError> {
                    let mut scratch = Vec::new();
                    loop {
                        let header = wire::read_frame_header(stream)?;
                        match header.kind {
                            Kind::Pages => {
                                header.read_pages(stream, memory, layout, Some((index, count)))?
                            }
                            Kind::Sync => {
                                header.read_payload(stream, &mut scratch)?;
                                let _ = marked.send(Ok(()));
                                // Told to go on after a Sync; after the State, dropped.
                                if going.recv().is_err() {
                                    return Ok(());
                                }
                            }
                            got => {
                                return Err(WireError::Unexpected {
                                    expected: "Pages or Sync on a page stream".into(),
                                    got,
                                }
                                .into())
                            }
                        }
                    }
                };
                if let Err(e) = read() {
                    let _ = marked.send(Err(e));
                }
            });
        }
        drop(marked);
        let all_marked = || -> Result<(), MigrationError> {
            for _ in 0..count {
                marks
                    .recv()
                    .map_err(|_| WireError::Malformed("page stream (ended early)"))??;
            }
            Ok(())
        };
        let mut frame = Vec::new();
        let received = loop {
            match conv.receive_into_memory(&mut frame, memory, layout, count) {
                Ok((Kind::Sync, _)) => {
                    let answered = all_marked().and_then(|()| {
                        go_on.iter().for_each(|g| {
                            let _ = g.send(());
                        });
                        conv.say(Kind::Synced, &[])
                    });
                    if let Err(e) = answered {
                        break Err(e);
                    }
                }
                Ok((Kind::State, len)) => {
                    break all_marked().map(|()| {
                        frame.truncate(len);
                        frame
                    })
                }
                Ok((Kind::Plan, len)) => match wire::plan_runs(&frame[..len], layout) {
                    Ok(runs) => {
                        // A plan naming more than guest RAM would only queue up here.
                        planned_bytes += runs.iter().map(|(_, len)| len).sum::<u64>();
                        if planned_bytes > ram_bytes {
                            break Err(WireError::Malformed("Plan (more than guest RAM)").into());
                        }
                        // The prefault thread gone (it only stops once all is in) changes
                        // nothing.
                        drop(planned.send(runs));
                    }
                    Err(e) => break Err(e.into()),
                },
                Ok(_) => {}
                Err(e) => break Err(e),
            }
        };
        all_in.store(true, Ordering::Relaxed);
        drop(planned);
        // Page streams' threads waiting at a mark end now; one still reading ends when the
        // source closes its stream.
        drop(go_on);
        received
    })
}

/// Allocates the memory the source's Plan frames name, 2 MiB at a time in the order the pages
/// come (ascending on every stream), beside the threads taking the pages in, until the plan is
/// done or everything has arrived (`all_in`). Where it is ahead, a run lands in allocated
/// memory; where behind, it finds the pages there and moves on. Allocating never changes
/// what a page holds, so it cannot race with a page being written.
fn prefault(
    memory: &crate::memory::GuestMemory,
    plan: std::sync::mpsc::Receiver<Vec<(u64, u64)>>,
    all_in: &AtomicBool,
) {
    use vm_memory::{GuestAddress, GuestMemoryBackend};
    const STEP: u64 = 2 << 20;
    for runs in plan {
        for (gpa, len) in runs {
            let end = gpa + len;
            let mut at = gpa;
            while at < end {
                if all_in.load(Ordering::Relaxed) {
                    return;
                }
                // 2 MiB steps: short enough to stop soon once everything is in.
                let n = (end - at).min(STEP - at % STEP);
                if let Ok(slice) = memory.get_slice(GuestAddress(at), n as usize) {
                    wire::populate(slice.ptr_guard_mut().as_ptr(), n as usize);
                }
                at += n;
            }
        }
    }
}

/// Go, then the disks locked, then the guest resumed, then Running. The source measures its
/// downtime until Running arrives, so resuming first makes that figure cover the whole gap the
/// guest sees (answering first left the resume outside it). It is just as safe: a source
/// that does not get Running stays paused (see the source's switch-over), and a Running this
/// side cannot write is no different from one lost on the way, so the guest runs on here.
fn take_over<S: Read + Write>(
    conv: &mut Conversation<'_, S>,
    vm: &Vm,
) -> Result<(), MigrationError> {
    conv.receive()?;
    vm.lock_disks(Duration::from_secs(10))
        .map_err(|e| MigrationError::TargetFailed(e.to_string()))?;
    vm.resume();
    if let Err(e) = conv.say(Kind::Running, &[]) {
        tracing::warn!("the guest runs here but the source may not know (it stays paused): {e}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opened(index: u8) -> std::io::Cursor<Vec<u8>> {
        let mut s = Vec::new();
        wire::write_page_stream_header(&mut s, index).unwrap();
        s.push(100 + index);
        std::io::Cursor::new(s)
    }

    fn next_byte(s: &mut std::io::Cursor<Vec<u8>>) -> u8 {
        let mut b = [0u8];
        s.read_exact(&mut b).unwrap();
        b[0]
    }

    #[test]
    fn page_streams_are_put_in_the_order_their_headers_give() {
        for order in [[0u8, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2], [2, 0, 3, 1]] {
            let mut streams: Vec<_> = order.iter().map(|&i| opened(i)).collect();
            put_in_header_order(&mut streams).unwrap();
            let got: Vec<u8> = streams.iter_mut().map(next_byte).collect();
            assert_eq!(got, [100, 101, 102, 103], "opened in the order {order:?}");
        }
    }

    #[test]
    fn a_page_stream_index_twice_or_past_the_count_is_refused() {
        for order in [vec![0u8, 0], vec![0, 2], vec![5]] {
            let mut streams: Vec<_> = order.iter().map(|&i| opened(i)).collect();
            let e = put_in_header_order(&mut streams).unwrap_err().to_string();
            assert!(e.contains("an index twice, or past"), "{order:?}: {e}");
        }
    }
}
