//! Daemon mode: one VM driven over the versioned control protocol (`api::protocol`) on a unix
//! socket, as virt-handler drives the launcher in a VM Pod. Plain threads: one per connection,
//! one watching the VM's end; the VMM's own threads do the work.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::FromRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use api::protocol::*;
use api::validation::{default_vmi_spec, validate_vmi};
use api::VirtualMachineInstance;
use vmm::{SerialInput, SerialOutput, Vm, VmEnd};

use crate::translate::{translate, Environment};

/// Console output fan-out to every attached client, with recent history for late attachers.
#[derive(Default)]
pub struct ConsoleHub {
    clients: Vec<UnixStream>,
    history: Vec<u8>,
}

const HISTORY: usize = 64 * 1024;

impl Write for ConsoleHub {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.history.extend_from_slice(buf);
        if self.history.len() > HISTORY {
            let cut = self.history.len() - HISTORY;
            self.history.drain(..cut);
        }
        // A client that went away is dropped; it never stalls the guest.
        self.clients.retain_mut(|c| c.write_all(buf).is_ok());
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[derive(Default)]
struct Inner {
    vm: Option<Arc<Vm>>,
    name: Option<String>,
    started: Option<Instant>,
    end: Option<VmEnd>,
    paused: bool,
    vcpus: u32,
    memory_mib: u64,
    software_emulated: bool,
    grace_seconds: u64,
    console_input: Option<std::fs::File>,
    ephemeral: Vec<PathBuf>,
}

pub struct Daemon {
    env: Environment,
    inner: Mutex<Inner>,
    events: Mutex<Vec<Sender<Event>>>,
    console: Arc<Mutex<ConsoleHub>>,
}

impl Daemon {
    pub fn new(env: Environment) -> Arc<Daemon> {
        Arc::new(Daemon {
            env,
            inner: Mutex::default(),
            events: Mutex::default(),
            console: Arc::default(),
        })
    }

    /// The console fan-out that `Console` clients attach to.
    pub fn console(&self) -> Arc<Mutex<ConsoleHub>> {
        self.console.clone()
    }

    fn emit(&self, e: Event) {
        self.events
            .lock()
            .unwrap()
            .retain(|s| s.send(e.clone()).is_ok());
    }

    fn vm(&self) -> Result<Arc<Vm>, String> {
        let g = self.inner.lock().unwrap();
        match (&g.vm, &g.end) {
            (Some(vm), None) => Ok(vm.clone()),
            (_, Some(end)) => Err(format!("the VM has ended ({end})")),
            (None, None) => Err("no VM: send Sync first".into()),
        }
    }

    fn sync(self: &Arc<Self>, mut vmi: VirtualMachineInstance) -> Result<(), String> {
        if self.inner.lock().unwrap().vm.is_some() {
            return Ok(());
        }
        default_vmi_spec(&mut vmi.spec);
        validate_vmi(&vmi).map_err(|e| e.to_string())?;
        let name = vmi.metadata.name.clone().unwrap_or_else(|| "vm".into());
        let plan = translate(&name, &vmi.spec, &self.env).map_err(|e| e.to_string())?;
        if !plan.nics.is_empty() {
            // In a VM Pod the TAPs come from virt-handler; until it hands them over the VM runs
            // without NICs rather than not at all.
            let names: Vec<&str> = plan.nics.iter().map(|n| n.interface.as_str()).collect();
            tracing::warn!(interfaces = ?names, "no TAP devices handed over; interfaces not attached");
        }
        let ephemeral = plan.prepare().map_err(|e| e.to_string())?;
        let mut config = plan.config;
        config.serial.output = SerialOutput::Writer(self.console.clone());
        let mut fds = [0i32; 2];
        // SAFETY: pipe2 fills two descriptors we then own.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(format!("pipe: {}", std::io::Error::last_os_error()));
        }
        config.serial.input = SerialInput::Fd(fds[0]);
        // SAFETY: we own the write end.
        let input = unsafe { std::fs::File::from_raw_fd(fds[1]) };
        let vm = match Vm::build(&config) {
            Ok(vm) => Arc::new(vm),
            Err(e) => {
                for f in ephemeral {
                    let _ = std::fs::remove_file(f);
                }
                return Err(e.to_string());
            }
        };
        let grace = vmi
            .spec
            .termination_grace_period_seconds
            .unwrap_or(30)
            .max(0) as u64;
        self.install(vm, name, grace, Some(input), ephemeral);
        Ok(())
    }

    /// Takes charge of a VM built elsewhere (`virt-launcher run --socket` and `restore
    /// --socket`): the control protocol then drives it as if a client had Synced it.
    pub fn adopt(self: &Arc<Self>, vm: Arc<Vm>, name: String, grace_seconds: u64) {
        self.install(vm, name, grace_seconds, None, Vec::new());
    }

    fn install(
        self: &Arc<Self>,
        vm: Arc<Vm>,
        name: String,
        grace_seconds: u64,
        console_input: Option<std::fs::File>,
        ephemeral: Vec<PathBuf>,
    ) {
        {
            let mut g = self.inner.lock().unwrap();
            g.name = Some(name);
            g.started = Some(Instant::now());
            g.vcpus = vm.info.vcpus as u32;
            g.memory_mib = vm.info.memory_mib;
            g.software_emulated = vm.info.acceleration.is_software_emulated();
            g.grace_seconds = grace_seconds;
            g.console_input = console_input;
            g.ephemeral = ephemeral;
            g.vm = Some(vm.clone());
        }
        self.emit(Event::Started);
        let me = self.clone();
        std::thread::spawn(move || me.watch(vm));
    }

    /// Snapshot into the two paths, streaming progress to `progress` and to event listeners.
    fn snapshot(
        &self,
        memory_path: &str,
        state_path: &str,
        stop: bool,
        progress: &mut dyn FnMut(Event),
    ) -> Result<SnapshotReport, String> {
        let vm = self.vm()?;
        let paths = vmm::SnapshotPaths {
            state: PathBuf::from(state_path),
            memory: PathBuf::from(memory_path),
        };
        let mut last = 0;
        let stats = vm
            .snapshot_with_progress(&paths, stop, &mut |p| {
                if let vmm::SnapshotProgress::Memory { done, total } = p {
                    // At most one event per 1/16 of memory (and the last one).
                    if done == total || done - last >= total / 16 {
                        last = done;
                        let e = Event::SnapshotProgress { done, total };
                        self.emit(e.clone());
                        progress(e);
                    }
                }
            })
            .map_err(|e| e.to_string())?;
        if stop {
            self.inner.lock().unwrap().paused = true;
            self.emit(Event::Paused);
        }
        Ok(SnapshotReport {
            state_bytes: stats.state_bytes,
            memory_bytes: stats.memory_bytes,
            memory_written_bytes: stats.memory_written_bytes,
            paused_ms: stats.paused_for.as_millis() as u64,
        })
    }

    /// Waits for the VM's end, then records it, cleans up and tells event listeners.
    fn watch(&self, vm: Arc<Vm>) {
        let end = vm.end_signal().wait();
        let ephemeral = {
            let mut g = self.inner.lock().unwrap();
            g.end = Some(end.clone());
            g.console_input = None;
            std::mem::take(&mut g.ephemeral)
        };
        // Stop and join the VM's threads (the last Arc drops the Vm).
        vm.stop();
        for f in ephemeral {
            let _ = std::fs::remove_file(f);
        }
        let reason = end.to_string();
        self.emit(match end {
            VmEnd::PoweredOff | VmEnd::Reset | VmEnd::Stopped => Event::ShutDown { reason },
            _ => Event::Crashed { reason },
        });
    }

    fn status(&self) -> StatusReport {
        let g = self.inner.lock().unwrap();
        let state = match (&g.vm, &g.end) {
            (None, _) => VmState::NoVm,
            (_, Some(VmEnd::PoweredOff | VmEnd::Reset | VmEnd::Stopped)) => VmState::ShutDown,
            (_, Some(_)) => VmState::Crashed,
            _ if g.paused => VmState::Paused,
            _ => VmState::Running,
        };
        let (disks, nics) = match &g.vm {
            Some(vm) => (
                vm.blocks()
                    .iter()
                    .map(|b| {
                        let b = b.lock().unwrap();
                        let c = b.counters;
                        DiskCounters {
                            name: b.id.clone(),
                            requests: c.requests,
                            read_bytes: c.read_bytes,
                            write_bytes: c.write_bytes,
                            flushes: c.flushes,
                            errors: c.errors,
                        }
                    })
                    .collect(),
                vm.nets()
                    .iter()
                    .map(|n| {
                        let n = n.lock().unwrap();
                        let c = n.counters;
                        NicCounters {
                            name: n.id.clone(),
                            rx_frames: c.rx_frames,
                            rx_bytes: c.rx_bytes,
                            tx_frames: c.tx_frames,
                            tx_bytes: c.tx_bytes,
                            rx_errors: c.rx_errors,
                            tx_errors: c.tx_errors,
                        }
                    })
                    .collect(),
            ),
            None => (vec![], vec![]),
        };
        StatusReport {
            state,
            name: g.name.clone(),
            vcpus: g.vcpus,
            memory_mib: g.memory_mib,
            uptime_seconds: g.started.map_or(0.0, |s| s.elapsed().as_secs_f64()),
            software_emulated_kvm: g.software_emulated,
            end: g.end.as_ref().map(|e| e.to_string()),
            disks,
            nics,
        }
    }

    /// Graceful shutdown: the guest gets Ctrl-Alt-Del and `grace` seconds to end, then it is
    /// killed.
    pub fn shutdown(&self, grace: Option<u64>) -> Result<(), String> {
        let vm = self.vm()?;
        vm.ctrl_alt_del();
        let grace = grace.unwrap_or_else(|| self.inner.lock().unwrap().grace_seconds);
        std::thread::spawn(move || {
            if vm
                .end_signal()
                .wait_timeout(Duration::from_secs(grace))
                .is_none()
            {
                vm.stop();
            }
        });
        Ok(())
    }

    fn handle(self: &Arc<Self>, req: Request) -> Response {
        let ok = |r: Result<(), String>| {
            r.map_or_else(|message| Response::Error { message }, |_| Response::Ok)
        };
        match req {
            Request::Hello { .. } => Response::Error {
                message: "already greeted".into(),
            },
            Request::Ping => Response::Pong,
            Request::Status => Response::Status(Box::new(self.status())),
            Request::Sync { vmi } => ok(self.sync(*vmi)),
            Request::Pause => ok(self.vm().map(|vm| {
                vm.pause();
                self.inner.lock().unwrap().paused = true;
                self.emit(Event::Paused);
            })),
            Request::Resume => ok(self.vm().map(|vm| {
                vm.resume();
                self.inner.lock().unwrap().paused = false;
                self.emit(Event::Resumed);
            })),
            Request::Kill => ok(self.vm().map(|vm| vm.stop())),
            Request::Shutdown {
                grace_period_seconds,
            } => ok(self.shutdown(grace_period_seconds)),
            Request::Console | Request::Events | Request::Snapshot { .. } => Response::Error {
                message: "handled by the connection".into(),
            },
        }
    }

    /// Serves one client connection.
    pub fn serve_connection(self: &Arc<Self>, stream: UnixStream) -> std::io::Result<()> {
        let mut out = stream.try_clone()?;
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        let send = |out: &mut UnixStream, r: &Response| -> std::io::Result<()> {
            let mut s = serde_json::to_string(r).expect("serializable");
            s.push('\n');
            out.write_all(s.as_bytes())
        };
        // Greeting: the client names its protocol version; every version this launcher
        // speaks is answered in that version.
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let version = match serde_json::from_str::<Request>(&line) {
            Ok(Request::Hello { version })
                if (MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version) =>
            {
                send(
                    &mut out,
                    &Response::Hello {
                        version,
                        launcher: env!("CARGO_PKG_VERSION").into(),
                    },
                )?;
                version
            }
            Ok(Request::Hello { version }) => {
                return send(&mut out, &Response::Error { message: format!("protocol version {version} is not supported; this launcher speaks versions {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}") });
            }
            _ => {
                return send(
                    &mut out,
                    &Response::Error {
                        message: format!("expected hello with a protocol version from {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}"),
                    },
                )
            }
        };
        loop {
            line.clear();
            if reader.read_line(&mut line)? == 0 {
                return Ok(());
            }
            let req = match serde_json::from_str::<Request>(&line) {
                Ok(r) => r,
                Err(e) => {
                    send(
                        &mut out,
                        &Response::Error {
                            message: format!("bad request: {e}"),
                        },
                    )?;
                    continue;
                }
            };
            match req {
                Request::Console => {
                    send(&mut out, &Response::Ok)?;
                    let mut hub = self.console.lock().unwrap();
                    let history = hub.history.clone();
                    out.write_all(&history)?;
                    hub.clients.push(out.try_clone()?);
                    drop(hub);
                    // From now on the client's bytes are console input.
                    let mut buf = [0u8; 1024];
                    loop {
                        use std::io::Read;
                        let n = reader.read(&mut buf)?;
                        if n == 0 {
                            return Ok(());
                        }
                        let mut g = self.inner.lock().unwrap();
                        if let Some(input) = g.console_input.as_mut() {
                            let _ = input.write_all(&buf[..n]);
                        }
                    }
                }
                Request::Events => {
                    send(&mut out, &Response::Ok)?;
                    let (tx, rx) = channel();
                    self.events.lock().unwrap().push(tx);
                    for e in rx {
                        send(&mut out, &Response::Event(e))?;
                    }
                    return Ok(());
                }
                Request::Snapshot { .. } if version < SNAPSHOT_SINCE => {
                    send(
                        &mut out,
                        &Response::Error {
                            message: format!("snapshot needs protocol version {SNAPSHOT_SINCE}; this connection speaks version {version}"),
                        },
                    )?;
                }
                Request::Snapshot {
                    memory_path,
                    state_path,
                    stop,
                } => {
                    let mut sink = out.try_clone()?;
                    let r = self.snapshot(&memory_path, &state_path, stop, &mut |e| {
                        let _ = send(&mut sink, &Response::Event(e));
                    });
                    send(
                        &mut out,
                        &r.map_or_else(|message| Response::Error { message }, Response::Snapshot),
                    )?;
                }
                other => {
                    let r = self.handle(other);
                    send(&mut out, &r)?;
                }
            }
        }
    }

    /// The VM's end, once it has ended.
    pub fn ended(&self) -> Option<VmEnd> {
        self.inner.lock().unwrap().end.clone()
    }
}

/// Accepts connections on `socket` until the process exits.
pub fn listen(daemon: Arc<Daemon>, socket: &Path) -> std::io::Result<()> {
    let _ = std::fs::remove_file(socket);
    let listener = UnixListener::bind(socket)?;
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let d = daemon.clone();
            std::thread::spawn(move || {
                if let Err(e) = d.serve_connection(stream) {
                    tracing::debug!("control connection: {e}");
                }
            });
        }
    });
    Ok(())
}
