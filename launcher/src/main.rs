//! virt-launcher: the process that runs one VM. This file only parses arguments: the flows
//! are the library's (`standalone` for run/restore/receive, `foreground` for the console,
//! `remote` for snapshot/migrate, `daemon` for the Pod's control socket).
//!
//! `virt-launcher run --kernel PATH ...` boots a VM with the console on the terminal and exits
//! with a status that says how the guest ended (see `vmm::VmEnd::exit_code` and the README).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use launcher::remote::{MigrateRequest, SnapshotRequest};
use launcher::standalone::{
    tls_from, Failure, Incoming, NetworkMode, RunOptions, Start, EXIT_HOST_ERROR,
};

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
    /// Carry the pages on N more connections beside the conversation, each with a thread of
    /// its own on both sides (KubeVirt uses 8); the target must be started with the same N
    /// [default: 0, the conversation carries them].
    #[arg(long, value_name = "N", default_value_t = 0)]
    page_streams: u8,
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

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Pull {
    Missing,
    Never,
}

#[derive(Args)]
struct RunArgs {
    /// Boot this VirtualMachine or VirtualMachineInstance manifest (kubevirt.io/v1).
    #[arg(short = 'f', long = "filename", value_name = "MANIFEST", conflicts_with_all = ["kernel", "initrd", "disks", "nets", "rng"])]
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
    /// A virtio-blk disk: PATH[,readonly][,serial=S][,cache=none|writeback], or
    /// vhost-user=SOCKET for a vhost-user-blk backend (e.g. qemu-storage-daemon). Repeatable;
    /// the guest sees image disks in order as vda, vdb, ..., then the vhost-user ones.
    #[arg(long = "disk", value_name = "SPEC")]
    disks: Vec<String>,
    /// A virtio-net NIC on an existing TAP: tap=NAME[,mac=MAC] (or fd=N for an open TAP file
    /// descriptor), or vhost-user=SOCKET[,mac=MAC] for a vhost-user-net backend (DPDK).
    /// Repeatable; the guest sees them in order as eth0, eth1, ..., the vhost-user ones last.
    #[arg(long = "net", value_name = "SPEC")]
    nets: Vec<String>,
    /// A virtio-fs share the guest mounts with `mount -t virtiofs TAG /mnt`:
    /// tag=TAG,socket=PATH (a running vhost-user-fs backend such as virtiofsd) or
    /// tag=TAG,dir=DIR[,readonly] (the launcher runs virtiofsd for DIR). Repeatable.
    #[arg(long = "fs", value_name = "SPEC")]
    filesystems: Vec<String>,
    /// Back guest RAM with huge pages of this size (2Mi or 1Gi) from the host's hugetlb pool.
    #[arg(long, value_name = "SIZE")]
    hugepages: Option<String>,
    /// A virtio-rng device the guest draws random bytes from (a manifest asks with
    /// `spec.domain.devices.rng: {}`).
    #[arg(long)]
    rng: bool,
    #[command(flatten)]
    host: HostLayout,
    /// With -f: `nat` wires a pod network as a TAP on a NAT'd bridge (guest 10.0.2.2/24 via
    /// 10.0.2.1); `none` attaches no NICs (the manifest's interfaces are listed and dropped).
    #[arg(long, value_enum, default_value = "nat")]
    network: Network,
    /// With -f: Multus' network-status (the JSON of the Pod annotation
    /// `k8s.v1.cni.cncf.io/network-status`) naming the vhost-user socket of each interface
    /// with `binding: {name: vhostuser}`, by its Pod interface (net1, net2, … in the order of
    /// the manifest's Multus networks).
    #[arg(long, value_name = "FILE", requires = "manifest")]
    network_status: Option<PathBuf>,
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
    /// With -f: `missing` pulls containerDisk and kernelBoot images --image-dir lacks from
    /// their registry (with `microvirt-pull`, docker's config.json for credentials); `never`
    /// runs only from --image-dir.
    #[arg(long, value_enum, default_value = "missing")]
    pull: Pull,
    /// A registry (`host:port`) that may be reached over plain HTTP (localhost's always may).
    /// Repeatable.
    #[arg(long = "insecure-registry", value_name = "HOST:PORT")]
    insecure_registries: Vec<String>,
    /// Do not boot: wait at ADDR (tcp:HOST:PORT, HOST:PORT or unix:PATH) for one live
    /// migration of the VM described by -f or --kernel ..., then run it here.
    #[arg(long, value_name = "ADDR")]
    incoming: Option<String>,
    /// With --incoming: require mutual TLS with the certificates in DIR (ca.crt, tls.crt,
    /// tls.key; see deploy/README.md).
    #[arg(long, value_name = "DIR", requires = "incoming")]
    tls_dir: Option<PathBuf>,
    /// With --incoming: the source opens N page streams beside the conversation (its
    /// `migrate --page-streams N`).
    #[arg(long, value_name = "N", requires = "incoming", default_value_t = 0)]
    page_streams: u8,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) if args.dry_run => launcher::standalone::validate(
            args.manifest.as_deref().unwrap(),
            &args.host.environment(),
            args.host.instancetype_dir.as_deref(),
        )
        .map(|plan| {
            print!("{plan}");
            0
        }),
        Command::Run(args) => match &args.incoming {
            None => launcher::standalone::launch(&args.options(), Start::Boot),
            Some(addr) => tls_from(args.tls_dir.as_deref()).and_then(|tls| {
                let incoming = Incoming {
                    listen: addr.clone(),
                    tls,
                    page_streams: args.page_streams,
                };
                launcher::standalone::launch(&args.options(), Start::Receive(incoming))
            }),
        },
        Command::Daemon(args) => return daemon(args),
        Command::Snapshot(a) => launcher::remote::snapshot(&SnapshotRequest {
            socket: a.socket,
            to: a.to,
            stop: a.stop,
        })
        .map(|()| 0),
        Command::Restore(args) => {
            let paths = vmm::SnapshotPaths::in_dir(&args.from);
            launcher::standalone::launch(&args.run.options(), Start::Restore(paths))
        }
        Command::Migrate(a) => launcher::remote::migrate(&MigrateRequest {
            socket: a.socket,
            to: a.to,
            bandwidth: a.bandwidth,
            max_downtime_ms: a.max_downtime_ms,
            completion_timeout_per_gib: a.completion_timeout_per_gib,
            progress_timeout: a.progress_timeout,
            auto_converge: a.auto_converge,
            tls_dir: a.tls_dir,
            page_streams: a.page_streams,
        })
        .map(|()| 0),
        Command::Validate(args) => launcher::standalone::validate(
            &args.manifest,
            &args.host.environment(),
            args.host.instancetype_dir.as_deref(),
        )
        .map(|plan| {
            print!("{plan}");
            0
        }),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => exit(e),
    }
}

fn exit(e: Failure) -> ExitCode {
    eprintln!("virt-launcher: {e}");
    ExitCode::from(e.exit_code())
}

impl RunArgs {
    fn options(&self) -> RunOptions {
        RunOptions {
            manifest: self.manifest.clone(),
            kernel: self.kernel.clone(),
            initrd: self.initrd.clone(),
            cmdline: self.cmdline.clone(),
            vcpus: self.vcpus,
            memory: self.memory,
            console_log: self.console_log.clone(),
            console_input: !self.no_console_input,
            disks: self.disks.clone(),
            nets: self.nets.clone(),
            filesystems: self.filesystems.clone(),
            rng: self.rng,
            hugepages: self.hugepages.clone(),
            environment: self.host.environment(),
            instancetype_dir: self.host.instancetype_dir.clone(),
            seccomp: seccomp_setting(&self.host),
            network: match self.network {
                Network::None => NetworkMode::None,
                Network::Nat => NetworkMode::Nat,
            },
            network_status: self.network_status.clone(),
            socket: self.socket.clone(),
            boot_timer: self.boot_timer,
            pull: launcher::images::PullPolicy {
                enabled: self.pull == Pull::Missing,
                insecure_registries: self.insecure_registries.clone(),
            },
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Network {
    /// Attach no NICs.
    None,
    /// A pod network gets a TAP on a NAT'd bridge in this network namespace.
    Nat,
}
