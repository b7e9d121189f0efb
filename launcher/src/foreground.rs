//! A VM in the foreground: its console on this terminal (raw mode, Ctrl-] to stop it) or in a
//! log file, optionally the control protocol on a socket meanwhile, and the exit status that
//! says how the guest ended.

use std::os::fd::FromRawFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vmm::{SerialInput, SerialOutput, Vm, VmConfig};

use crate::daemon::{ConsoleHub, Daemon};
use crate::failure::{bad_config, host_error, Failure};

/// How the VM comes to be.
pub enum Start {
    Boot,
    Restore(vmm::SnapshotPaths),
    /// Live migration from a source connecting to this address (over mutual TLS when given).
    Receive(Incoming),
}

/// Where and how a migrated VM arrives (`run --incoming`).
pub struct Incoming {
    pub listen: String,
    pub tls: Option<api::protocol::MigrationTls>,
    /// Page streams the source opens beside the conversation (`--page-streams`).
    pub page_streams: u8,
}

/// Ctrl-]: detach from the console and stop the VM.
const DETACH_KEY: u8 = 0x1d;

/// Where the console goes and who else may drive the VM.
pub struct Console {
    pub log: Option<PathBuf>,
    pub input: bool,
    pub socket: Option<PathBuf>,
    pub host: crate::translate::Environment,
    pub name: String,
}

/// Writes to two sinks: the terminal (or log) and the control socket's console clients.
struct Tee(Box<dyn std::io::Write + Send>, Arc<Mutex<ConsoleHub>>);

impl std::io::Write for Tee {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = self.1.lock().map(|mut h| h.write(buf));
        self.0.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

/// Boots (or restores, or receives) `config` with the console on this terminal (or the log
/// file) and waits for the end; with a socket, the control protocol drives the VM meanwhile.
/// Returns the exit status for how the guest ended.
pub fn boot_with_console(
    mut config: VmConfig,
    console: Console,
    start: &Start,
) -> Result<u8, Failure> {
    let daemon = console
        .socket
        .as_ref()
        .map(|_| Daemon::new(console.host.clone()));
    config.serial.output = serial_output(&console, daemon.as_ref())?;
    // Input goes through a pipe so the launcher sees the detach key first.
    config.serial.input = SerialInput::None;
    let forward = console.input.then(input_pipe).flatten().map(|(r, w)| {
        config.serial.input = SerialInput::Fd(r);
        w
    });
    if config.seccomp {
        // From here on, as in the daemon, every thread (the control socket's, the migration
        // receiver's, the vCPUs and devices under their own filters) runs under the control
        // filter. Installed after the manifest's files and network are set up (they run
        // programs), before anything reads a snapshot, a migration stream or a client.
        vmm::seccomp::install(vmm::seccomp::ThreadKind::Control).map_err(host_error)?;
    }
    let vm = match start_vm(&config, start) {
        Ok(vm) => Arc::new(vm),
        Err(e) => {
            if let Some(w) = forward {
                // SAFETY: our write end; the read end went to (and was dropped with) the config.
                unsafe { libc::close(w) };
            }
            return Err(e);
        }
    };
    if let (Some(d), Some(socket)) = (&daemon, &console.socket) {
        d.adopt(vm.clone(), console.name.clone(), 30);
        if let Err(e) = crate::daemon::listen(d.clone(), socket) {
            vm.stop();
            return Err(bad_config(format!("--socket {}: {e}", socket.display())));
        }
    }
    let raw = forward.map(|w| forward_stdin(&vm, w));
    let end = vm.end_signal().wait();
    vm.stop();
    if let Some(d) = &daemon {
        d.wait_idle(Duration::from_secs(5));
    }
    drop(raw);
    if let Some(socket) = &console.socket {
        let _ = std::fs::remove_file(socket);
    }
    match (&end, daemon.as_ref().and_then(|d| d.migrated_to())) {
        (vmm::VmEnd::Migrated, Some(to)) => eprintln!("virt-launcher: the VM migrated to {to}"),
        _ => eprintln!("virt-launcher: {end}"),
    }
    Ok(end.exit_code() as u8)
}

/// The console's sink: the log file or stdout, and with a control socket also its clients.
fn serial_output(console: &Console, daemon: Option<&Arc<Daemon>>) -> Result<SerialOutput, Failure> {
    let Some(d) = daemon else {
        return Ok(match &console.log {
            Some(p) => SerialOutput::File(p.clone()),
            None => SerialOutput::Stdout,
        });
    };
    let sink: Box<dyn std::io::Write + Send> = match &console.log {
        Some(p) => match std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
        {
            Ok(f) => Box::new(f),
            Err(e) => return Err(bad_config(format!("--console-log {}: {e}", p.display()))),
        },
        None => Box::new(std::io::stdout()),
    };
    Ok(SerialOutput::Writer(Arc::new(Mutex::new(Tee(
        sink,
        d.console(),
    )))))
}

/// A pipe for the console's input: (read end for the VM, write end for the stdin forwarder).
fn input_pipe() -> Option<(i32, i32)> {
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 fills two descriptors we then own.
    (unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } == 0).then_some((fds[0], fds[1]))
}

/// The VM as `start` asks: booted, restored, or received from a live migration.
fn start_vm(config: &VmConfig, start: &Start) -> Result<Vm, Failure> {
    let built = match start {
        Start::Boot => Vm::build(config),
        Start::Restore(paths) => Vm::restore(config, paths),
        Start::Receive(incoming) => return receive(config, incoming),
    };
    built.map_err(|e| {
        if e.is_config_error() {
            Failure::BadConfig(e.to_string())
        } else {
            Failure::Host(e.to_string())
        }
    })
}

/// `run --incoming`: waits at `listen` for one live migration of the VM `config` describes:
/// the conversation's link, then one per page stream.
fn receive(config: &VmConfig, incoming: &Incoming) -> Result<Vm, Failure> {
    let tls = incoming.tls.as_ref();
    api::protocol::validate_page_streams(incoming.page_streams)
        .map_err(|e| bad_config(format!("--page-streams: {e}")))?;
    let listener = crate::migration_link::MigrationListener::bind(&incoming.listen, tls.is_some())
        .map_err(|e| bad_config(format!("--incoming: {e}")))?;
    eprintln!(
        "virt-launcher: waiting for a live migration on {}",
        listener.address()
    );
    // The source opens its page streams right after the conversation.
    let received = (0..=incoming.page_streams)
        .map(|i| match i {
            0 => listener.accept(tls),
            _ => listener.accept_within(tls, None, crate::migration_link::LINK_TIMEOUT),
        })
        .collect::<Result<Vec<_>, _>>()
        .and_then(|mut links| {
            let mut conversation = links.remove(0);
            Vm::migrate_in_streams(&mut conversation, &mut links, config).map_err(|e| e.to_string())
        });
    drop(listener);
    let vm = received.map_err(host_error)?;
    eprintln!("virt-launcher: the VM arrived");
    Ok(vm)
}

/// Copies stdin (in raw mode) to the console's pipe until Ctrl-], which stops the VM.
fn forward_stdin(vm: &Vm, w: i32) -> RawTerminal {
    eprintln!("virt-launcher: console attached; press Ctrl-] to stop the VM");
    let end = vm.end_signal();
    let raw = RawTerminal::enter();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        // SAFETY: we own the pipe's write end.
        let mut pipe = unsafe { std::fs::File::from_raw_fd(w) };
        let mut buf = [0u8; 256];
        loop {
            let n = match std::io::stdin().read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if let Some(i) = buf[..n].iter().position(|&b| b == DETACH_KEY) {
                let _ = pipe.write_all(&buf[..i]);
                end.signal(vmm::VmEnd::Stopped);
                return;
            }
            if pipe.write_all(&buf[..n]).is_err() {
                return;
            }
        }
    });
    raw
}

/// Puts an interactive terminal in raw mode (keys go to the guest, not the line discipline)
/// and restores it on drop.
struct RawTerminal(Option<libc::termios>);

impl RawTerminal {
    fn enter() -> RawTerminal {
        // SAFETY: termios calls on stdin with structs we own.
        unsafe {
            if libc::isatty(0) != 1 {
                return RawTerminal(None);
            }
            let mut t: libc::termios = std::mem::zeroed();
            if libc::tcgetattr(0, &mut t) != 0 {
                return RawTerminal(None);
            }
            let saved = t;
            libc::cfmakeraw(&mut t);
            t.c_oflag |= libc::OPOST | libc::ONLCR; // keep output readable
            libc::tcsetattr(0, libc::TCSANOW, &t);
            RawTerminal(Some(saved))
        }
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        if let Some(t) = self.0 {
            // SAFETY: restoring the attributes we read.
            unsafe { libc::tcsetattr(0, libc::TCSANOW, &t) };
        }
    }
}
