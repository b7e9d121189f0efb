//! virt-launcher: the process that runs one VM.
//!
//! `virt-launcher run --kernel PATH ...` boots a VM with the console on the terminal and exits
//! with a status that says how the guest ended (see `vmm::VmEnd::exit_code` and the README).

use std::os::fd::FromRawFd;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use vmm::config::{CacheMode, DiskConfig, MacAddr, NetConfig, TapSource};
use vmm::{SerialInput, SerialOutput, Vm, VmConfig};

/// Exit status for a configuration the user must fix; nothing was started.
const EXIT_BAD_CONFIG: u8 = 2;
/// Exit status for a host failure (KVM unavailable, out of memory, ...).
const EXIT_HOST_ERROR: u8 = 1;

#[derive(Parser)]
#[command(name = "virt-launcher", version, about = "Runs one microvirt VM")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Boot a VM in the foreground with its serial console on this terminal.
    Run(RunArgs),
    /// Serve the control protocol on a unix socket and run the VM a client Syncs (the mode of a
    /// VM Pod). SIGTERM shuts the VM down gracefully.
    Daemon(DaemonArgs),
    /// Snapshot the VM of a launcher serving --socket: writes DIR/state and DIR/memory, then
    /// the VM resumes (or stays paused with --stop).
    Snapshot(SnapshotArgs),
    /// Restore a VM from DIR (written by `snapshot`) and run it with the console on this
    /// terminal; the machine continues where it was. The snapshot's own record of disks and
    /// NICs is used unless -f, --kernel, --disk or --net say otherwise.
    Restore(RestoreArgs),
    /// Live-migrate the VM of a launcher serving --socket to a target (`run --incoming`, or a
    /// daemon given PrepareMigrationTarget) listening at --to ADDR. Exit code 0 once the
    /// target runs the VM; otherwise the reason, and the VM keeps running here.
    Migrate(MigrateArgs),
    /// Default, validate and translate a manifest and print what would boot — vCPUs, memory,
    /// kernel and command line, every disk with its source and guest device, every NIC with
    /// its binding and MAC — without creating anything. Exit 0, or 2 with every error.
    Validate(ValidateArgs),
}

#[derive(Args)]
struct ValidateArgs {
    /// The VirtualMachine or VirtualMachineInstance manifest (kubevirt.io/v1).
    #[arg(short = 'f', long = "filename", value_name = "MANIFEST")]
    manifest: PathBuf,
    #[command(flatten)]
    host: HostLayout,
}

#[derive(Args)]
struct MigrateArgs {
    /// The control socket of the launcher running the VM.
    #[arg(long)]
    socket: PathBuf,
    /// The target: tcp:HOST:PORT (or HOST:PORT) or unix:PATH.
    #[arg(long, value_name = "ADDR")]
    to: String,
    /// At most this much per second, a Kubernetes quantity (64Mi, 1G, ...) [default: unlimited].
    #[arg(long, value_name = "QUANTITY")]
    bandwidth: Option<String>,
    /// The longest pause the final copy may take [default: 900, as KubeVirt].
    #[arg(long, value_name = "MS")]
    max_downtime_ms: Option<u64>,
    /// Give up (the VM stays) after this many seconds per GiB of guest memory [default: 150].
    #[arg(long, value_name = "SECONDS")]
    completion_timeout_per_gib: Option<u64>,
    /// Give up (the VM stays) when the data left to send has not shrunk for this long
    /// [default: 150].
    #[arg(long, value_name = "SECONDS")]
    progress_timeout: Option<u64>,
    /// Slow the vCPUs down in steps while the guest dirties memory faster than it is sent.
    #[arg(long)]
    auto_converge: bool,
    /// Mutual TLS: a directory with ca.crt, tls.crt and tls.key (see deploy/README.md).
    #[arg(long, value_name = "DIR")]
    tls_dir: Option<PathBuf>,
}

#[derive(Args)]
struct SnapshotArgs {
    /// The control socket of the launcher running the VM.
    #[arg(long)]
    socket: PathBuf,
    /// Directory for the snapshot (created if missing).
    #[arg(long, value_name = "DIR")]
    to: PathBuf,
    /// Leave the VM paused after the snapshot.
    #[arg(long)]
    stop: bool,
}

#[derive(Args)]
struct RestoreArgs {
    /// Directory written by `virt-launcher snapshot --to DIR`.
    #[arg(long, value_name = "DIR")]
    from: PathBuf,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Args)]
struct DaemonArgs {
    /// The control socket to create.
    #[arg(long)]
    socket: PathBuf,
    #[command(flatten)]
    host: HostLayout,
}

/// Where a manifest's images, volumes and scratch files are on this host, and the default
/// guest kernel (used by `run -f` and `daemon`).
#[derive(Args)]
struct HostLayout {
    /// Where containerDisk and kernelBoot images are (`<dir>/<image>`, `/` and `:` replaced
    /// by `_`).
    #[arg(long, env = "MICROVIRT_IMAGES", default_value = "images")]
    image_dir: PathBuf,
    /// Where PVCs and DataVolumes are (`<dir>/<claim>/disk.img` or a block device).
    #[arg(long, env = "MICROVIRT_VOLUMES", default_value = "volumes")]
    volume_dir: PathBuf,
    /// Scratch space for emptyDisks, cloud-init seeds and containerDisk copies.
    #[arg(long, env = "MICROVIRT_STATE", default_value = "/tmp/microvirt")]
    state_dir: PathBuf,
    /// The guest kernel when a manifest has no firmware.kernelBoot.
    #[arg(
        long,
        env = "MICROVIRT_KERNEL",
        default_value = "/usr/share/microvirt/vmlinux"
    )]
    default_kernel: PathBuf,
    /// Appended to the kernel command line (e.g. flags a software-emulated host needs).
    #[arg(long, default_value = "")]
    extra_cmdline: String,
    /// With -f: instance types and preferences (instancetype.kubevirt.io YAML files) a VM may
    /// name, besides those in its own file.
    #[arg(long, value_name = "DIR")]
    instancetype_dir: Option<PathBuf>,
    /// Per-thread seccomp filters on the vCPU and device threads; `off` only for debugging.
    #[arg(long, value_enum, default_value = "on")]
    seccomp: Toggle,
}

impl HostLayout {
    fn environment(&self) -> launcher::translate::Environment {
        launcher::translate::Environment {
            image_dir: self.image_dir.clone(),
            volume_dir: self.volume_dir.clone(),
            state_dir: self.state_dir.clone(),
            default_kernel: self.default_kernel.clone(),
            default_initrd: None,
            extra_cmdline: self.extra_cmdline.clone(),
            seccomp: self.seccomp == Toggle::On,
        }
    }
}

/// `--seccomp`, with the warning `off` deserves.
fn seccomp_setting(host: &HostLayout) -> bool {
    if host.seccomp == Toggle::Off {
        tracing::warn!(
            "--seccomp off: the VMM threads run without syscall filters (debugging only)"
        );
        eprintln!("virt-launcher: warning: --seccomp off: the VMM threads run without syscall filters (debugging only)");
        return false;
    }
    true
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Toggle {
    On,
    Off,
}

/// Runs the daemon until the VM has ended (plus a moment for clients to read its end), or
/// until SIGTERM has shut it down.
fn daemon(args: DaemonArgs) -> ExitCode {
    // Least privilege before anything else, while this is the only thread: nothing inherited
    // stays open, no capability is held (the launcher Pod's daemon is handed its TAPs and
    // sockets as descriptors and needs none), and no exec could gain any.
    for (what, r) in [
        (
            "closing inherited descriptors",
            vmm::privileges::close_inherited_fds(),
        ),
        ("setting no_new_privs", vmm::privileges::set_no_new_privs()),
        (
            "dropping capabilities",
            vmm::privileges::drop_capabilities().map_err(std::io::Error::other),
        ),
    ] {
        if let Err(e) = r {
            eprintln!("virt-launcher: {what}: {e}");
            return ExitCode::from(EXIT_HOST_ERROR);
        }
    }
    // SIGTERM is taken synchronously by one thread: block it everywhere first.
    // SAFETY: plain signal-mask calls.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
    if seccomp_setting(&args.host) {
        // Inherited by every thread from here on (see vmm::seccomp::ThreadKind::Control).
        if let Err(e) = vmm::seccomp::install(vmm::seccomp::ThreadKind::Control) {
            eprintln!("virt-launcher: {e}");
            return ExitCode::from(EXIT_HOST_ERROR);
        }
    }
    let d = launcher::daemon::Daemon::new(args.host.environment());
    if let Err(e) = launcher::daemon::listen(d.clone(), &args.socket) {
        eprintln!("virt-launcher: {}: {e}", args.socket.display());
        return ExitCode::from(EXIT_HOST_ERROR);
    }
    let term = d.clone();
    std::thread::spawn(move || {
        let mut sig = 0;
        // SAFETY: waits for the blocked SIGTERM.
        unsafe { libc::sigwait(&set, &mut sig) };
        tracing::info!("SIGTERM: shutting the VM down");
        if term.shutdown(None).is_err() {
            std::process::exit(0); // no VM running
        }
    });
    loop {
        if let Some(end) = d.ended() {
            d.wait_idle(Duration::from_secs(5));
            std::thread::sleep(std::time::Duration::from_millis(500));
            let _ = std::fs::remove_file(&args.socket);
            eprintln!("virt-launcher: {end}");
            return ExitCode::from(end.exit_code() as u8);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[derive(Args)]
struct RunArgs {
    /// Boot this VirtualMachine or VirtualMachineInstance manifest (kubevirt.io/v1).
    #[arg(short = 'f', long = "filename", value_name = "MANIFEST", conflicts_with_all = ["kernel", "initrd", "disks", "nets"])]
    manifest: Option<PathBuf>,
    /// Guest kernel: an ELF vmlinux (PVH entry if it has the note) or a bzImage.
    #[arg(long)]
    kernel: Option<PathBuf>,
    /// Initial ramdisk loaded high in guest RAM.
    #[arg(long)]
    initrd: Option<PathBuf>,
    /// Kernel command line (at most 2047 bytes).
    #[arg(long, default_value = "console=ttyS0 reboot=k panic=1")]
    cmdline: String,
    /// Number of vCPUs (1 up to what KVM allows, at most 254) [default: 1; restore: the
    /// snapshot's].
    #[arg(long)]
    vcpus: Option<u64>,
    /// Guest memory in MiB (8 to 1048576) [default: 128; restore: the snapshot's].
    #[arg(long)]
    memory: Option<u64>,
    /// Write the console to this file instead of stdout.
    #[arg(long)]
    console_log: Option<PathBuf>,
    /// Do not feed stdin to the guest's console.
    #[arg(long)]
    no_console_input: bool,
    /// A virtio-blk disk: PATH[,readonly][,serial=S][,cache=none|writeback]. Repeatable; the
    /// guest sees them in order as vda, vdb, ...
    #[arg(long = "disk", value_name = "SPEC")]
    disks: Vec<String>,
    /// A virtio-net NIC on an existing TAP: tap=NAME[,mac=MAC] (or fd=N for an open TAP file
    /// descriptor). Repeatable; the guest sees them in order as eth0, eth1, ...
    #[arg(long = "net", value_name = "SPEC")]
    nets: Vec<String>,
    #[command(flatten)]
    host: HostLayout,
    /// With -f: `nat` wires a pod network as a TAP on a NAT'd bridge (guest 10.0.2.2/24 via
    /// 10.0.2.1); `none` attaches no NICs (the manifest's interfaces are listed and dropped).
    #[arg(long, value_enum, default_value = "nat")]
    network: NetworkMode,
    /// Also serve the control protocol on this unix socket while the VM runs in the
    /// foreground (status, pause/resume, snapshot, shutdown).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// With -f: print the plan (as `validate`) and exit without booting.
    #[arg(long, requires = "manifest")]
    dry_run: bool,
    /// Print when the first vCPU first enters KVM_RUN (for benchmarks).
    #[arg(long, hide = true)]
    boot_timer: bool,
    /// Do not boot: wait at ADDR (tcp:HOST:PORT, HOST:PORT or unix:PATH) for one live
    /// migration of the VM described by -f or --kernel ..., then run it here.
    #[arg(long, value_name = "ADDR")]
    incoming: Option<String>,
    /// With --incoming: require mutual TLS with the certificates in DIR (ca.crt, tls.crt,
    /// tls.key; see deploy/README.md).
    #[arg(long, value_name = "DIR", requires = "incoming")]
    tls_dir: Option<PathBuf>,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Run(args) if args.dry_run => {
            validate(args.manifest.as_deref().unwrap(), &args.host)
        }
        Command::Run(args) => match &args.incoming {
            None => launch(&args, Start::Boot),
            Some(addr) => {
                let tls = match tls_from(args.tls_dir.as_deref()) {
                    Ok(t) => t,
                    Err(code) => return code,
                };
                launch(&args, Start::Receive(addr.clone(), tls))
            }
        },
        Command::Daemon(args) => daemon(args),
        Command::Snapshot(args) => snapshot(args),
        Command::Restore(args) => {
            let paths = vmm::SnapshotPaths::in_dir(&args.from);
            launch(&args.run, Start::Restore(paths))
        }
        Command::Migrate(args) => migrate(args),
        Command::Validate(args) => validate(&args.manifest, &args.host),
    }
}

/// `validate -f` and `run --dry-run`: the plan, or the errors.
fn validate(path: &std::path::Path, host: &HostLayout) -> ExitCode {
    let manifest = match launcher::manifest::read_with(
        &path.display().to_string(),
        host.instancetype_dir.as_deref(),
    ) {
        Ok(m) => m,
        Err(e) => return bad_config(e),
    };
    for w in manifest.warnings() {
        eprintln!("virt-launcher: warning: {w}");
    }
    match launcher::translate::translate(&manifest.name(), manifest.vmi_spec(), &host.environment())
    {
        Ok(plan) => {
            print!("{}", plan.describe());
            ExitCode::SUCCESS
        }
        Err(e) => bad_config(format!("{}: {e}", path.display())),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum NetworkMode {
    /// Attach no NICs.
    None,
    /// A pod network gets a TAP on a NAT'd bridge in this network namespace.
    Nat,
}

fn bad_config(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("virt-launcher: {msg}");
    ExitCode::from(EXIT_BAD_CONFIG)
}

/// A config ready to boot or restore, and what must live as long as the VM.
struct Prepared {
    config: VmConfig,
    name: String,
    _network: Option<launcher::network::PodNetwork>,
    ephemeral: Vec<PathBuf>,
}

/// `-f`: manifest → defaults and validation → translation → files. On a restore the disk
/// files are the snapshot's: they are used as they are, never created afresh.
fn manifest_config(
    path: &std::path::Path,
    args: &RunArgs,
    restoring: bool,
) -> Result<Prepared, ExitCode> {
    let manifest = launcher::manifest::read_with(
        &path.display().to_string(),
        args.host.instancetype_dir.as_deref(),
    )
    .map_err(bad_config)?;
    for w in manifest.warnings() {
        eprintln!("virt-launcher: warning: {w}");
    }
    let env = args.host.environment();
    let name = manifest.name();
    let mut plan = launcher::translate::translate(&name, manifest.vmi_spec(), &env)
        .map_err(|e| bad_config(format!("{}: {e}", path.display())))?;
    let mut network = None;
    if !plan.nics.is_empty() {
        match args.network {
            NetworkMode::None => {
                let names: Vec<&str> = plan.nics.iter().map(|n| n.interface.as_str()).collect();
                eprintln!("virt-launcher: --network none: interfaces {names:?} are not attached");
            }
            NetworkMode::Nat => {
                let (net, nics, ip) = launcher::network::PodNetwork::setup(&name, &plan.nics)
                    .map_err(|e| bad_config(format!("{}: network: {e}", path.display())))?;
                eprintln!(
                    "virt-launcher: {} on bridge {} (NAT), guest {}",
                    plan.nics[0].interface,
                    net.bridge(),
                    launcher::network::GUEST
                );
                plan.config.nets = nics;
                if !plan.config.cmdline.contains("ip=") {
                    plan.config.cmdline.push(' ');
                    plan.config.cmdline.push_str(&ip);
                }
                network = Some(net);
            }
        }
    }
    let ephemeral = if restoring {
        Vec::new()
    } else {
        plan.prepare().map_err(bad_config)?
    };
    Ok(Prepared {
        config: plan.config,
        name,
        _network: network,
        ephemeral,
    })
}

/// `--kernel ...`: the VM from flags.
fn flags_config(kernel: PathBuf, args: &RunArgs) -> Result<VmConfig, ExitCode> {
    let mut config = VmConfig::new(kernel);
    config.disks = parse_specs(&args.disks, parse_disk)?;
    config.nets = parse_specs(&args.nets, parse_net)?;
    config.initrd = args.initrd.clone();
    config.cmdline = args.cmdline.clone();
    config.vcpus = vcpus_arg(args.vcpus.unwrap_or(1))?;
    config.memory_mib = args.memory.unwrap_or(128);
    Ok(config)
}

fn parse_specs<T>(specs: &[String], f: fn(&str) -> Result<T, String>) -> Result<Vec<T>, ExitCode> {
    specs.iter().map(|s| f(s).map_err(bad_config)).collect()
}

fn vcpus_arg(v: u64) -> Result<u8, ExitCode> {
    u8::try_from(v).map_err(|_| {
        bad_config(vmm::ConfigError::Vcpus {
            given: v,
            max: vmm::config::MAX_VCPUS as u64,
        })
    })
}

/// A restore without -f or --kernel: the machine the snapshot recorded, with the disks and
/// TAPs it used (or those --disk / --net give), checked against --vcpus / --memory if given.
fn recorded_config(paths: &vmm::SnapshotPaths, args: &RunArgs) -> Result<VmConfig, ExitCode> {
    let state = vmm::persist::read_state_file(&paths.state).map_err(bad_config)?;
    let mut config = VmConfig::new(PathBuf::new());
    config.vcpus = match args.vcpus {
        Some(v) => vcpus_arg(v)?,
        None => state.vcpus,
    };
    config.memory_mib = args.memory.unwrap_or(state.memory_mib);
    config.cmdline = state.cmdline.clone();
    let mut disks = Vec::new();
    let mut nets = Vec::new();
    for d in &state.devices.virtio {
        match &d.kind {
            vmm::persist::VirtioKindState::Block { disk, .. } => disks.push(DiskConfig {
                path: disk.path.clone(),
                read_only: disk.read_only,
                serial: disk.serial.clone(),
                cache: disk.cache,
            }),
            vmm::persist::VirtioKindState::Net { tap, mac, .. } => match tap {
                Some(name) => nets.push(NetConfig {
                    tap: TapSource::Name(name.clone()),
                    mac: Some(*mac),
                }),
                None if args.nets.is_empty() => {
                    return Err(bad_config(format!(
                        "restore: the snapshot's {} was attached by file descriptor; give --net tap=NAME for it",
                        d.id
                    )))
                }
                None => {}
            },
        }
    }
    config.disks = if args.disks.is_empty() {
        disks
    } else {
        parse_specs(&args.disks, parse_disk)?
    };
    config.nets = if args.nets.is_empty() {
        nets
    } else {
        parse_specs(&args.nets, parse_net)?
    };
    Ok(config)
}

/// How the VM comes to be.
enum Start {
    Boot,
    Restore(vmm::SnapshotPaths),
    /// Live migration from a source connecting to this address (over mutual TLS when given).
    Receive(String, Option<api::protocol::MigrationTls>),
}

/// `run`, `restore` and `receive`: the config from -f, from flags or (restore only) from the
/// snapshot, then the VM with its console on this terminal.
fn launch(args: &RunArgs, start: Start) -> ExitCode {
    let restoring = !matches!(start, Start::Boot);
    let snapshot = match &start {
        Start::Restore(p) => Some(p.clone()),
        _ => None,
    };
    let prepared = if let Some(path) = &args.manifest {
        match manifest_config(path, args, restoring) {
            Ok(p) => p,
            Err(code) => return code,
        }
    } else {
        let config = match (&args.kernel, &snapshot) {
            (Some(kernel), _) => flags_config(kernel.clone(), args),
            (None, Some(paths)) => recorded_config(paths, args),
            (None, None) => return bad_config("give -f MANIFEST or --kernel PATH"),
        };
        match config {
            Ok(config) => Prepared {
                config,
                name: "vm".into(),
                _network: None,
                ephemeral: Vec::new(),
            },
            Err(code) => return code,
        }
    };
    let mut config = prepared.config.clone();
    config.boot_timer = args.boot_timer;
    config.seccomp = seccomp_setting(&args.host);
    let console = Console {
        log: args.console_log.clone(),
        input: !args.no_console_input,
        socket: args.socket.clone(),
        host: args.host.environment(),
        name: prepared.name.clone(),
    };
    let code = boot_with_console(config, console, &start);
    for f in &prepared.ephemeral {
        let _ = std::fs::remove_file(f);
    }
    code
}

/// Ctrl-]: detach from the console and stop the VM.
const DETACH_KEY: u8 = 0x1d;

/// Where the console goes and who else may drive the VM.
struct Console {
    log: Option<PathBuf>,
    input: bool,
    socket: Option<PathBuf>,
    host: launcher::translate::Environment,
    name: String,
}

/// Writes to two sinks: the terminal (or log) and the control socket's console clients.
struct Tee(
    Box<dyn std::io::Write + Send>,
    std::sync::Arc<std::sync::Mutex<launcher::daemon::ConsoleHub>>,
);

impl std::io::Write for Tee {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = self.1.lock().map(|mut h| h.write(buf));
        self.0.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

/// Boots (or restores) `config` with the console on this terminal (or the log file) and
/// waits for the end; with a socket, the control protocol drives the VM meanwhile.
fn boot_with_console(mut config: VmConfig, console: Console, start: &Start) -> ExitCode {
    config.serial.output = match &console.log {
        Some(p) => SerialOutput::File(p.clone()),
        None => SerialOutput::Stdout,
    };
    let daemon = console
        .socket
        .as_ref()
        .map(|_| launcher::daemon::Daemon::new(console.host.clone()));
    if let Some(d) = &daemon {
        let sink: Box<dyn std::io::Write + Send> = match &console.log {
            Some(p) => match std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
            {
                Ok(f) => Box::new(f),
                Err(e) => return bad_config(format!("--console-log {}: {e}", p.display())),
            },
            None => Box::new(std::io::stdout()),
        };
        config.serial.output = SerialOutput::Writer(std::sync::Arc::new(std::sync::Mutex::new(
            Tee(sink, d.console()),
        )));
    }
    // Input goes through a pipe so the launcher sees the detach key first.
    let mut forward = None;
    config.serial.input = SerialInput::None;
    if console.input {
        let mut fds = [0i32; 2];
        // SAFETY: pipe2 fills two descriptors we then own.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } == 0 {
            config.serial.input = SerialInput::Fd(fds[0]);
            forward = Some(fds[1]);
        }
    }
    if config.seccomp {
        // From here on, as in the daemon, every thread (the control socket's, the migration
        // receiver's, the vCPUs and devices under their own filters) runs under the control
        // filter. Installed after the manifest's files and network are set up (they run
        // programs), before anything reads a snapshot, a migration stream or a client.
        if let Err(e) = vmm::seccomp::install(vmm::seccomp::ThreadKind::Control) {
            return host_error(e);
        }
    }
    let built = match start {
        Start::Boot => Vm::build(&config),
        Start::Restore(paths) => Vm::restore(&config, paths),
        Start::Receive(listen, tls) => {
            let listener =
                match launcher::migration_link::MigrationListener::bind(listen, tls.is_some()) {
                    Ok(l) => l,
                    Err(e) => return bad_config(format!("--incoming: {e}")),
                };
            eprintln!(
                "virt-launcher: waiting for a live migration on {}",
                listener.address()
            );
            let received = listener
                .accept(tls.as_ref())
                .and_then(|mut s| Vm::migrate_in(&mut s, &config).map_err(|e| e.to_string()));
            drop(listener);
            match received {
                Ok(vm) => {
                    eprintln!("virt-launcher: the VM arrived");
                    Ok(vm)
                }
                Err(e) => return host_error(e),
            }
        }
    };
    let vm = match built {
        Ok(vm) => std::sync::Arc::new(vm),
        Err(e) => {
            if let Some(w) = forward {
                // SAFETY: our write end; the read end went to (and was dropped with) the config.
                unsafe { libc::close(w) };
            }
            eprintln!("virt-launcher: {e}");
            return ExitCode::from(if e.is_config_error() {
                EXIT_BAD_CONFIG
            } else {
                EXIT_HOST_ERROR
            });
        }
    };
    if let (Some(d), Some(socket)) = (&daemon, &console.socket) {
        d.adopt(vm.clone(), console.name.clone(), 30);
        if let Err(e) = launcher::daemon::listen(d.clone(), socket) {
            vm.stop();
            return bad_config(format!("--socket {}: {e}", socket.display()));
        }
    }
    let _raw = forward.map(|w| {
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
    });
    let end = vm.end_signal().wait();
    vm.stop();
    if let Some(d) = &daemon {
        d.wait_idle(Duration::from_secs(5));
    }
    drop(_raw);
    if let Some(socket) = &console.socket {
        let _ = std::fs::remove_file(socket);
    }
    match (&end, daemon.as_ref().and_then(|d| d.migrated_to())) {
        (vmm::VmEnd::Migrated, Some(to)) => eprintln!("virt-launcher: the VM migrated to {to}"),
        _ => eprintln!("virt-launcher: {end}"),
    }
    ExitCode::from(end.exit_code() as u8)
}

/// `snapshot`: asks the launcher on --socket for a snapshot into --to, showing progress on a
/// terminal.
fn snapshot(args: SnapshotArgs) -> ExitCode {
    use api::protocol::{Request, Response, SNAPSHOT_SINCE};
    if let Err(e) = std::fs::create_dir_all(&args.to) {
        return bad_config(format!("--to {}: {e}", args.to.display()));
    }
    // The launcher may run elsewhere in the file system tree: absolute paths only.
    let dir = match std::fs::canonicalize(&args.to) {
        Ok(d) => d,
        Err(e) => return bad_config(format!("--to {}: {e}", args.to.display())),
    };
    let paths = vmm::SnapshotPaths::in_dir(&dir);
    let mut c = match launcher::client::ControlClient::connect(&args.socket, SNAPSHOT_SINCE) {
        Ok(c) => c,
        Err(e) if e.starts_with("--socket") => return bad_config(e),
        Err(e) => return host_error(e),
    };
    let req = Request::Snapshot {
        memory_path: paths.memory.display().to_string(),
        state_path: paths.state.display().to_string(),
        stop: args.stop,
    };
    if let Err(e) = c.send(&req) {
        return host_error(e);
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
                return ExitCode::SUCCESS;
            }
            Ok(Response::Error { message }) => return host_error(format!("snapshot: {message}")),
            Ok(other) => return host_error(format!("unexpected answer {other:?}")),
            Err(e) => return host_error(e),
        }
    }
}

fn stderr_is_terminal() -> bool {
    // SAFETY: isatty on stderr.
    unsafe { libc::isatty(2) == 1 }
}

/// `--tls-dir`: the migration certificates in DIR, if given.
fn tls_from(
    dir: Option<&std::path::Path>,
) -> Result<Option<api::protocol::MigrationTls>, ExitCode> {
    dir.map(api::protocol::MigrationTls::from_dir)
        .transpose()
        .map_err(|e| bad_config(format!("--tls-dir: {e}")))
}

/// `migrate`: asks the launcher on --socket to live-migrate its VM to --to.
fn migrate(args: MigrateArgs) -> ExitCode {
    use api::protocol::{Event, MigrationOptions, Request, Response, MIGRATION_SINCE};
    let tls = match tls_from(args.tls_dir.as_deref()) {
        Ok(t) => t,
        Err(code) => return code,
    };
    let mut c = match launcher::client::ControlClient::connect(&args.socket, MIGRATION_SINCE) {
        Ok(c) => c,
        Err(e) if e.starts_with("--socket") => return bad_config(e),
        Err(e) => return host_error(e),
    };
    let bandwidth = match args.bandwidth.as_deref().map(api::quantity::parse_bytes) {
        None => None,
        Some(Ok(b)) => Some(b),
        Some(Err(e)) => return bad_config(format!("--bandwidth: {e}")),
    };
    let options = MigrationOptions {
        bandwidth_bytes_per_second: bandwidth,
        completion_timeout_per_gib: args.completion_timeout_per_gib,
        max_downtime_ms: args.max_downtime_ms,
        progress_timeout_seconds: args.progress_timeout,
        allow_auto_converge: args.auto_converge,
    };
    if let Err(e) = options.validate() {
        return bad_config(format!("migrate: {e}"));
    }
    if let Err(e) = args
        .to
        .parse::<launcher::migration_link::MigrationAddress>()
        .and_then(|a| a.check_plain(tls.is_some()))
    {
        return bad_config(format!("--to {e}"));
    }
    let req = Request::MigrateOut {
        target: args.to.clone(),
        options,
        tls,
    };
    if let Err(e) = c.send(&req) {
        return host_error(e);
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
                return ExitCode::SUCCESS;
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
                return host_error(format!("{message}{where_}"));
            }
            Ok(other) => return host_error(format!("unexpected answer {other:?}")),
            Err(e) => return host_error(e),
        }
    }
}

fn host_error(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("virt-launcher: {msg}");
    ExitCode::from(EXIT_HOST_ERROR)
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

/// Parses `PATH[,readonly][,serial=S][,cache=none|writeback]`.
fn parse_disk(spec: &str) -> Result<DiskConfig, String> {
    let mut parts = spec.split(',');
    let path = parts
        .next()
        .filter(|p| !p.is_empty())
        .ok_or_else(|| format!("--disk {spec:?}: the image path is missing"))?;
    let mut d = DiskConfig::new(path);
    for opt in parts {
        match opt.split_once('=') {
            None if opt == "readonly" || opt == "ro" => d.read_only = true,
            Some(("serial", s)) => d.serial = Some(s.to_string()),
            Some(("cache", "none")) => d.cache = CacheMode::None,
            Some(("cache", "writeback")) => d.cache = CacheMode::Writeback,
            Some(("cache", other)) => {
                return Err(format!("--disk {path}: cache={other} is not accepted; use cache=none or cache=writeback"))
            }
            _ => {
                return Err(format!(
                    "--disk {path}: unknown option {opt:?}; accepted: readonly, serial=S, cache=none|writeback"
                ))
            }
        }
    }
    Ok(d)
}

/// Parses `tap=NAME[,mac=MAC]` or `fd=N[,mac=MAC]`.
fn parse_net(spec: &str) -> Result<NetConfig, String> {
    let mut tap = None;
    let mut mac = None;
    for opt in spec.split(',') {
        match opt.split_once('=') {
            Some(("tap", name)) if !name.is_empty() => {
                tap = Some(TapSource::Name(name.to_string()))
            }
            Some(("fd", n)) => {
                let fd = n.parse::<i32>().ok().filter(|f| *f >= 0).ok_or_else(|| {
                    format!("--net {spec}: fd={n} is not a file descriptor number")
                })?;
                tap = Some(TapSource::Fd(fd));
            }
            Some(("mac", m)) => {
                mac = Some(
                    m.parse::<MacAddr>()
                        .map_err(|e| format!("--net {spec}: {e}"))?,
                )
            }
            _ => {
                return Err(format!(
                    "--net {spec}: unknown option {opt:?}; accepted: tap=NAME or fd=N, mac=MAC"
                ))
            }
        }
    }
    let tap = tap.ok_or_else(|| format!("--net {spec}: tap=NAME (or fd=N) is required"))?;
    Ok(NetConfig { tap, mac })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn net_specs() {
        let n = parse_net("tap=tap0,mac=52:54:00:00:00:01").unwrap();
        assert_eq!(n.tap, TapSource::Name("tap0".into()));
        assert_eq!(n.mac.unwrap().to_string(), "52:54:00:00:00:01");
        assert_eq!(parse_net("fd=5").unwrap().tap, TapSource::Fd(5));
        assert!(parse_net("mac=52:54:00:00:00:01")
            .unwrap_err()
            .contains("tap=NAME (or fd=N) is required"));
        assert!(parse_net("tap=t,mac=01:00:00:00:00:01")
            .unwrap_err()
            .contains("multicast"));
        assert!(parse_net("tap=t,speed=10")
            .unwrap_err()
            .contains("unknown option"));
    }

    #[test]
    fn disk_specs() {
        let d = parse_disk("/a.img,readonly,serial=abc,cache=none").unwrap();
        assert_eq!(
            (d.read_only, d.serial.as_deref(), d.cache),
            (true, Some("abc"), CacheMode::None)
        );
        assert_eq!(parse_disk("/a.img").unwrap(), DiskConfig::new("/a.img"));
        assert!(parse_disk("/a.img,cache=unsafe")
            .unwrap_err()
            .contains("cache=unsafe is not accepted"));
        assert!(parse_disk("/a.img,bogus")
            .unwrap_err()
            .contains("unknown option \"bogus\""));
        assert!(parse_disk(",readonly")
            .unwrap_err()
            .contains("path is missing"));
    }
}
