//! virt-launcher: the process that runs one VM.
//!
//! `virt-launcher run --kernel PATH ...` boots a VM with the console on the terminal and exits
//! with a status that says how the guest ended (see `vmm::VmEnd::exit_code` and the README).

use std::path::PathBuf;
use std::process::ExitCode;

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
}

#[derive(Args)]
struct RunArgs {
    /// Guest kernel: an ELF vmlinux (PVH entry if it has the note) or a bzImage.
    #[arg(long)]
    kernel: PathBuf,
    /// Initial ramdisk loaded high in guest RAM.
    #[arg(long)]
    initrd: Option<PathBuf>,
    /// Kernel command line (at most 2047 bytes).
    #[arg(long, default_value = "console=ttyS0 reboot=k panic=1")]
    cmdline: String,
    /// Number of vCPUs (1 up to what KVM allows, at most 254).
    #[arg(long, default_value_t = 1)]
    vcpus: u64,
    /// Guest memory in MiB (8 to 1048576).
    #[arg(long, default_value_t = 128)]
    memory: u64,
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
    /// Print when the first vCPU first enters KVM_RUN (for benchmarks).
    #[arg(long, hide = true)]
    boot_timer: bool,
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
        Command::Run(args) => run(args),
    }
}

fn run(args: RunArgs) -> ExitCode {
    let Ok(vcpus) = u8::try_from(args.vcpus) else {
        let e = vmm::ConfigError::Vcpus {
            given: args.vcpus,
            max: vmm::config::MAX_VCPUS as u64,
        };
        eprintln!("virt-launcher: {e}");
        return ExitCode::from(EXIT_BAD_CONFIG);
    };
    let mut disks = Vec::new();
    for spec in &args.disks {
        match parse_disk(spec) {
            Ok(d) => disks.push(d),
            Err(e) => {
                eprintln!("virt-launcher: {e}");
                return ExitCode::from(EXIT_BAD_CONFIG);
            }
        }
    }
    let mut nets = Vec::new();
    for spec in &args.nets {
        match parse_net(spec) {
            Ok(n) => nets.push(n),
            Err(e) => {
                eprintln!("virt-launcher: {e}");
                return ExitCode::from(EXIT_BAD_CONFIG);
            }
        }
    }
    let mut config = VmConfig::new(args.kernel);
    config.disks = disks;
    config.nets = nets;
    config.initrd = args.initrd;
    config.cmdline = args.cmdline;
    config.vcpus = vcpus;
    config.memory_mib = args.memory;
    config.boot_timer = args.boot_timer;
    config.serial.output = match args.console_log {
        Some(p) => SerialOutput::File(p),
        None => SerialOutput::Stdout,
    };
    config.serial.input = if args.no_console_input {
        SerialInput::None
    } else {
        SerialInput::Stdin
    };

    let vm = match Vm::build(&config) {
        Ok(vm) => vm,
        Err(e) => {
            eprintln!("virt-launcher: {e}");
            return ExitCode::from(if e.is_config_error() {
                EXIT_BAD_CONFIG
            } else {
                EXIT_HOST_ERROR
            });
        }
    };
    let end = vm.wait();
    eprintln!("virt-launcher: {end}");
    ExitCode::from(end.exit_code() as u8)
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
