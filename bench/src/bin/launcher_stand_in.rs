//! launcher-stand-in: **a stand-in for virt-launcher, for controller-bench only.** It serves a
//! launcher Pod's control socket in the real control protocol (`api::protocol`, the same
//! Hello, Status and Sync lines a launcher reads and writes) but runs no VM behind it: 1000
//! real guests do not fit on a 2-core machine, and the bench measures the control plane
//! (virt-controller and virt-handler), not the monitor.
//!
//! What it does: answers Hello in every version a launcher speaks; Sync records the VMI's
//! name, vCPUs and memory and reports Running from then on; Pause / Resume / Shutdown / Kill
//! change the reported state; everything else (consoles, snapshots, migrations, the Pod
//! network) is refused with the reason, so a bench that strays there fails loudly.
//!
//! Usage: launcher-stand-in SOCKET

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use anyhow::Context;
use api::protocol::{
    Request, Response, StatusReport, VmState, LINE_DEADLINE, MAX_LINE_BYTES, MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
};

/// What the stand-in reports: the VM a Sync asked for, and its state.
struct Machine {
    state: VmState,
    name: Option<String>,
    vcpus: u32,
    memory_mib: u64,
    started: Option<Instant>,
}

impl Machine {
    fn report(&self) -> StatusReport {
        StatusReport {
            state: self.state.clone(),
            name: self.name.clone(),
            vcpus: self.vcpus,
            memory_mib: self.memory_mib,
            uptime_seconds: self.started.map_or(0.0, |s| s.elapsed().as_secs_f64()),
            software_emulated_kvm: false,
            end: None,
            disks: Vec::new(),
            nics: Vec::new(),
            network_attached: false,
            reboots: 0,
        }
    }

    fn answer(&mut self, request: Request) -> Response {
        let refuse = |what: &str| Response::Error {
            message: format!("{what}: the launcher stand-in (controller-bench) runs no VM"),
        };
        match request {
            Request::Hello { .. } => Response::Error {
                message: "hello twice on one connection".into(),
            },
            Request::Sync { vmi } => {
                if self.state == VmState::NoVm {
                    let memory = api::validation::guest_memory(&vmi.spec)
                        .unwrap_or(Ok(0))
                        .unwrap_or(0);
                    self.name = vmi.metadata.name.clone();
                    self.vcpus = u32::try_from(api::validation::vcpus(&vmi.spec)).unwrap_or(0);
                    self.memory_mib = memory >> 20;
                    self.state = VmState::Running;
                    self.started = Some(Instant::now());
                }
                Response::Ok
            }
            Request::Status => Response::Status(Box::new(self.report())),
            Request::Ping => Response::Pong,
            Request::Pause if self.state == VmState::Running => {
                self.state = VmState::Paused;
                Response::Ok
            }
            Request::Resume if self.state == VmState::Paused => {
                self.state = VmState::Running;
                Response::Ok
            }
            Request::Pause | Request::Resume => Response::Error {
                message: format!("the VM is {:?}", self.state),
            },
            Request::Shutdown { .. } | Request::Kill => {
                self.state = VmState::ShutDown;
                Response::Ok
            }
            Request::SoftReboot => refuse("SoftReboot"),
            Request::Console => refuse("Console"),
            Request::Events => refuse("Events"),
            Request::Snapshot { .. } => refuse("Snapshot"),
            Request::PrepareMigrationTarget { .. } => refuse("PrepareMigrationTarget"),
            Request::MigrateOut { .. } => refuse("MigrateOut"),
            Request::CancelMigration => refuse("CancelMigration"),
            Request::AttachNetwork { .. } => refuse("AttachNetwork"),
        }
    }
}

fn send(out: &mut UnixStream, r: &Response) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(r)?;
    line.push(b'\n');
    out.write_all(&line)
}

/// One line, bounded in length like the launcher's; None once the client has gone.
fn next_line(reader: &mut BufReader<UnixStream>, line: &mut String) -> std::io::Result<bool> {
    line.clear();
    let n = reader
        .by_ref()
        .take(MAX_LINE_BYTES as u64)
        .read_line(line)?;
    Ok(n > 0 && line.ends_with('\n'))
}

/// One client, greeted as a launcher greets (the version it asks for, if a launcher speaks it).
fn serve(stream: UnixStream, machine: &mut Machine) -> std::io::Result<()> {
    stream.set_read_timeout(Some(LINE_DEADLINE))?;
    let mut out = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    if !next_line(&mut reader, &mut line)? {
        return Ok(());
    }
    match serde_json::from_str::<Request>(&line) {
        Ok(Request::Hello { version })
            if (MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version) =>
        {
            let launcher = format!("launcher-stand-in {}", env!("CARGO_PKG_VERSION"));
            send(&mut out, &Response::Hello { version, launcher })?;
        }
        // Worded as the launcher words them: virt-handler retries an older version on "is
        // not supported".
        Ok(Request::Hello { version }) => {
            let message = format!("protocol version {version} is not supported; this launcher speaks versions {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}");
            return send(&mut out, &Response::Error { message });
        }
        _ => {
            let message = format!(
                "expected hello with a protocol version from {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}"
            );
            return send(&mut out, &Response::Error { message });
        }
    }
    while next_line(&mut reader, &mut line)? {
        let answer = match serde_json::from_str::<Request>(&line) {
            Ok(r) => machine.answer(r),
            Err(e) => Response::Error {
                message: format!("bad request: {e}"),
            },
        };
        send(&mut out, &answer)?;
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let socket = std::env::args()
        .nth(1)
        .context("usage: launcher-stand-in SOCKET")?;
    // A unix socket path is limited to 107 bytes and a Pod's sockets volume below the pods
    // directory is longer: bound by its name from its directory, as the launcher's is in
    // its container.
    let path = std::path::Path::new(&socket);
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::env::set_current_dir(dir).with_context(|| format!("entering {}", dir.display()))?;
    }
    let name = path.file_name().context("the socket path names no file")?;
    let listener =
        UnixListener::bind(name).with_context(|| format!("binding the control socket {socket}"))?;
    let mut machine = Machine {
        state: VmState::NoVm,
        name: None,
        vcpus: 0,
        memory_mib: 0,
        started: None,
    };
    // One client at a time, as virt-handler talks to a launcher: a connection per reconcile.
    // A client that stalls is dropped at the line deadline.
    for stream in listener.incoming() {
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                eprintln!("launcher-stand-in: accept: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if let Err(e) = serve(stream, &mut machine) {
            eprintln!("launcher-stand-in: {e}");
        }
    }
    Ok(())
}
