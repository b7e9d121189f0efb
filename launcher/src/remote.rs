//! The commands that drive a launcher over its control socket from the command line:
//! `snapshot` and `migrate`, with their progress on the terminal.

use std::path::PathBuf;

use crate::failure::{bad_config, host_error, Failure};
use crate::standalone::tls_from;

/// `virt-launcher snapshot`.
#[derive(Clone, Debug)]
pub struct SnapshotRequest {
    /// The control socket of the launcher running the VM.
    pub socket: PathBuf,
    /// Directory for the snapshot (created if missing).
    pub to: PathBuf,
    /// Leave the VM paused after the snapshot.
    pub stop: bool,
}

/// `virt-launcher migrate`.
#[derive(Clone, Debug)]
pub struct MigrateRequest {
    pub socket: PathBuf,
    /// The target's address (tcp:HOST:PORT, HOST:PORT or unix:PATH).
    pub to: String,
    /// A Kubernetes quantity per second.
    pub bandwidth: Option<String>,
    pub max_downtime_ms: Option<u64>,
    pub completion_timeout_per_gib: Option<u64>,
    pub progress_timeout: Option<u64>,
    pub auto_converge: bool,
    pub tls_dir: Option<PathBuf>,
    /// Page streams beside the conversation.
    pub page_streams: u8,
}

/// `snapshot`: asks the launcher on --socket for a snapshot into --to, showing progress on a
/// terminal.
pub fn snapshot(args: &SnapshotRequest) -> Result<(), Failure> {
    use api::protocol::{Request, Response, SNAPSHOT_SINCE};
    if let Err(e) = std::fs::create_dir_all(&args.to) {
        return Err(bad_config(format!("--to {}: {e}", args.to.display())));
    }
    // The launcher may run elsewhere in the file system tree: absolute paths only.
    let dir = match std::fs::canonicalize(&args.to) {
        Ok(d) => d,
        Err(e) => return Err(bad_config(format!("--to {}: {e}", args.to.display()))),
    };
    let paths = vmm::SnapshotPaths::in_dir(&dir);
    let mut c = match crate::client::ControlClient::connect(&args.socket, SNAPSHOT_SINCE) {
        Ok(c) => c,
        Err(e) if e.starts_with("--socket") => return Err(bad_config(e)),
        Err(e) => return Err(host_error(e)),
    };
    let req = Request::Snapshot {
        memory_path: paths.memory.display().to_string(),
        state_path: paths.state.display().to_string(),
        stop: args.stop,
    };
    if let Err(e) = c.send(&req) {
        return Err(host_error(e));
    }
    let terminal = stderr_is_terminal();
    loop {
        match c.receive() {
            Ok(Response::Event(api::protocol::Event::SnapshotProgress { done, total })) => {
                if terminal {
                    eprint!(
                        "\rvirt-launcher: snapshot: memory {} of {} MiB",
                        done >> 20,
                        total >> 20
                    );
                }
            }
            Ok(Response::Event(_)) => {}
            Ok(Response::Snapshot(r)) => {
                if terminal {
                    eprintln!();
                }
                eprintln!(
                    "virt-launcher: snapshot in {}: state {} bytes, memory {} MiB ({} MiB written), guest paused {} ms{}",
                    dir.display(),
                    r.state_bytes,
                    r.memory_bytes >> 20,
                    r.memory_written_bytes >> 20,
                    r.paused_ms,
                    if args.stop { "; the VM stays paused" } else { "" }
                );
                return Ok(());
            }
            Ok(Response::Error { message }) => {
                return Err(host_error(format!("snapshot: {message}")))
            }
            Ok(other) => return Err(host_error(format!("unexpected answer {other:?}"))),
            Err(e) => return Err(host_error(e)),
        }
    }
}

fn stderr_is_terminal() -> bool {
    // SAFETY: isatty on stderr.
    unsafe { libc::isatty(2) == 1 }
}

/// `migrate`: asks the launcher on --socket to live-migrate its VM to --to.
pub fn migrate(args: &MigrateRequest) -> Result<(), Failure> {
    use api::protocol::{Event, MigrationOptions, Request, Response, MIGRATION_SINCE};
    let tls = tls_from(args.tls_dir.as_deref())?;
    let mut c = match crate::client::ControlClient::connect(&args.socket, MIGRATION_SINCE) {
        Ok(c) => c,
        Err(e) if e.starts_with("--socket") => return Err(bad_config(e)),
        Err(e) => return Err(host_error(e)),
    };
    let bandwidth = match args.bandwidth.as_deref().map(api::quantity::parse_bytes) {
        None => None,
        Some(Ok(b)) => Some(b),
        Some(Err(e)) => return Err(bad_config(format!("--bandwidth: {e}"))),
    };
    let options = MigrationOptions {
        bandwidth_bytes_per_second: bandwidth,
        completion_timeout_per_gib: args.completion_timeout_per_gib,
        max_downtime_ms: args.max_downtime_ms,
        progress_timeout_seconds: args.progress_timeout,
        allow_auto_converge: args.auto_converge,
        page_streams: args.page_streams,
    };
    if let Err(e) = options.validate() {
        return Err(bad_config(format!("migrate: {e}")));
    }
    if let Err(e) = args
        .to
        .parse::<crate::migration_link::MigrationAddress>()
        .and_then(|a| a.check_plain(tls.is_some()))
    {
        return Err(bad_config(format!("--to {e}")));
    }
    let req = Request::MigrateOut {
        target: args.to.clone(),
        options,
        tls,
    };
    if let Err(e) = c.send(&req) {
        return Err(host_error(e));
    }
    let terminal = stderr_is_terminal();
    let mut first_dirty = None;
    loop {
        match c.receive() {
            Ok(Response::Event(Event::MigrationProgress {
                phase,
                pass,
                data_processed_bytes,
                data_remaining_bytes,
                memory_transfer_rate_bytes,
                dirty_memory_rate_bytes,
                expected_downtime_ms,
                throttle_percent,
            })) => {
                // The bar fills as the dirty set shrinks from what the first pass left over.
                let base = *first_dirty.get_or_insert(data_remaining_bytes.max(1));
                let done = 1.0 - (data_remaining_bytes as f64 / base as f64).clamp(0.0, 1.0);
                let filled = (done * 20.0).round() as usize;
                let line = format!(
                    "[{}{}] {phase} pass {pass}: {} MiB sent, {} KiB dirty, {} MiB/s, dirtying {} MiB/s, downtime ~{expected_downtime_ms} ms{}",
                    "#".repeat(filled),
                    ".".repeat(20 - filled),
                    data_processed_bytes >> 20,
                    data_remaining_bytes >> 10,
                    memory_transfer_rate_bytes >> 20,
                    dirty_memory_rate_bytes >> 20,
                    if throttle_percent > 0 {
                        format!(", vCPUs throttled {throttle_percent}%")
                    } else {
                        String::new()
                    }
                );
                if terminal {
                    eprint!("\r\x1b[Kvirt-launcher: {line}");
                } else {
                    eprintln!("virt-launcher: {line}");
                }
            }
            Ok(Response::Event(_)) => {}
            Ok(Response::Migration(r)) => {
                if terminal {
                    eprintln!();
                }
                eprintln!(
                    "virt-launcher: migrated to {} in {} ms: {} passes, {:.1} MiB on the wire, guest paused {} ms{}",
                    args.to,
                    r.total_ms,
                    r.passes,
                    r.bytes_sent as f64 / (1u64 << 20) as f64,
                    r.downtime_ms,
                    if r.max_throttle_percent > 0 {
                        format!(", vCPUs throttled up to {}%", r.max_throttle_percent)
                    } else {
                        String::new()
                    }
                );
                return Ok(());
            }
            Ok(Response::Error { message }) => {
                if terminal {
                    eprintln!();
                }
                let where_ = if message.contains("stays paused here") {
                    ""
                } else {
                    "; the VM keeps running here"
                };
                return Err(host_error(format!("{message}{where_}")));
            }
            Ok(other) => return Err(host_error(format!("unexpected answer {other:?}"))),
            Err(e) => return Err(host_error(e)),
        }
    }
}
