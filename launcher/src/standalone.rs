//! `virt-launcher run`, `restore` and `run --incoming` on one machine, no cluster: the VM's
//! config from a manifest (`-f`), from flags, or from a snapshot's record, then the VM with
//! its console on this terminal (`foreground`). The binary only turns arguments into
//! [`RunOptions`]; what it prints and how it exits is [`Failure`]'s.

use std::path::{Path, PathBuf};

use vmm::config::{CacheMode, DiskConfig, MacAddr, NetConfig, TapSource};
use vmm::VmConfig;

pub use crate::failure::{bad_config, host_error, Failure, EXIT_BAD_CONFIG, EXIT_HOST_ERROR};
pub use crate::foreground::{Incoming, Start};

/// How a manifest's pod network is attached (`--network`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NetworkMode {
    /// Attach no NICs.
    None,
    /// A pod network gets a TAP on a NAT'd bridge in this network namespace.
    Nat,
}

/// What `run` / `restore` / `run --incoming` were asked for.
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub manifest: Option<PathBuf>,
    pub kernel: Option<PathBuf>,
    pub initrd: Option<PathBuf>,
    pub cmdline: String,
    pub vcpus: Option<u64>,
    pub memory: Option<u64>,
    pub console_log: Option<PathBuf>,
    /// Feed stdin to the guest's console.
    pub console_input: bool,
    /// `--disk` and `--net` specs (see [`parse_disk`], [`parse_net`]).
    pub disks: Vec<String>,
    pub nets: Vec<String>,
    /// `--fs` specs (see [`crate::virtiofs::parse_fs`]).
    pub filesystems: Vec<String>,
    /// `--rng`: a virtio-rng device.
    pub rng: bool,
    /// `--hugepages SIZE`.
    pub hugepages: Option<String>,
    pub environment: crate::translate::Environment,
    pub instancetype_dir: Option<PathBuf>,
    pub seccomp: bool,
    pub network: NetworkMode,
    /// `--network-status FILE`: where vhostuser interfaces find their sockets.
    pub network_status: Option<PathBuf>,
    pub socket: Option<PathBuf>,
    pub boot_timer: bool,
    /// Whether (and how) `-f` pulls images the image directory lacks.
    pub pull: crate::images::PullPolicy,
}

/// `validate -f` and `run --dry-run`: the plan as text, or the errors.
pub fn validate(
    path: &Path,
    environment: &crate::translate::Environment,
    instancetype_dir: Option<&Path>,
) -> Result<String, Failure> {
    let manifest = crate::manifest::read_with(&path.display().to_string(), instancetype_dir)
        .map_err(bad_config)?;
    for w in manifest.warnings() {
        eprintln!("virt-launcher: warning: {w}");
    }
    crate::translate::translate(&manifest.name(), manifest.vmi_spec(), environment)
        .map(|plan| plan.describe())
        .map_err(|e| bad_config(format!("{}: {e}", path.display())))
}

/// `--tls-dir`: the migration certificates in DIR, if given.
pub fn tls_from(dir: Option<&Path>) -> Result<Option<api::protocol::MigrationTls>, Failure> {
    dir.map(api::protocol::MigrationTls::from_dir)
        .transpose()
        .map_err(|e| bad_config(format!("--tls-dir: {e}")))
}

/// A config ready to boot or restore, and what must live as long as the VM.
struct Prepared {
    config: VmConfig,
    name: String,
    _network: Option<crate::network::PodNetwork>,
    ephemeral: Vec<PathBuf>,
    /// The manifest's filesystems, served by virtiofsd for their directories.
    filesystems: Vec<crate::virtiofs::FsSpec>,
}

/// `-f`: manifest → defaults and validation → translation → files. On a restore the disk
/// files are the snapshot's: they are used as they are, never created afresh.
fn manifest_config(path: &Path, opts: &RunOptions, restoring: bool) -> Result<Prepared, Failure> {
    let manifest = crate::manifest::read_with(
        &path.display().to_string(),
        opts.instancetype_dir.as_deref(),
    )
    .map_err(bad_config)?;
    for w in manifest.warnings() {
        eprintln!("virt-launcher: warning: {w}");
    }
    let env = opts.environment.clone();
    let name = manifest.name();
    crate::images::pull_missing(manifest.vmi_spec(), &env.image_dir, &opts.pull)
        .map_err(bad_config)?;
    let mut plan = crate::translate::translate(&name, manifest.vmi_spec(), &env)
        .map_err(|e| bad_config(format!("{}: {e}", path.display())))?;
    let mut network = None;
    // vhostuser NICs connect to the sockets Multus reported; the rest are the pod network's.
    let (vhost_user, taps): (Vec<_>, Vec<_>) = std::mem::take(&mut plan.nics)
        .into_iter()
        .partition(|n| n.binding == crate::translate::Binding::VhostUser);
    plan.nics = taps;
    if let Some(n) = vhost_user.first() {
        let status = opts.network_status.as_deref().ok_or_else(|| {
            bad_config(format!("{}: interface {}: binding vhostuser takes its socket from Multus' network-status; give it with --network-status FILE", path.display(), n.interface))
        })?;
        plan.config.vhost_user_nets =
            crate::network::vhost_user_nets(&vhost_user, status, std::time::Duration::ZERO)
                .map_err(|e| bad_config(format!("{}: {e}", path.display())))?;
    }
    if !plan.nics.is_empty() {
        match opts.network {
            NetworkMode::None => {
                let names: Vec<&str> = plan.nics.iter().map(|n| n.interface.as_str()).collect();
                eprintln!("virt-launcher: --network none: interfaces {names:?} are not attached");
            }
            NetworkMode::Nat => {
                let (net, nics, ip) = crate::network::PodNetwork::setup(&name, &plan.nics)
                    .map_err(|e| bad_config(format!("{}: network: {e}", path.display())))?;
                eprintln!(
                    "virt-launcher: {} on bridge {} (NAT), guest {}",
                    plan.nics[0].interface,
                    net.bridge(),
                    crate::network::GUEST
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
    let filesystems = plan
        .filesystems
        .iter()
        .map(|f| crate::virtiofs::FsSpec {
            tag: f.tag.clone(),
            source: crate::virtiofs::FsSource::Dir {
                dir: f.dir.clone(),
                read_only: f.read_only,
            },
        })
        .collect();
    Ok(Prepared {
        config: plan.config,
        name,
        _network: network,
        ephemeral,
        filesystems,
    })
}

/// `--kernel ...`: the VM from flags.
fn flags_config(kernel: PathBuf, opts: &RunOptions) -> Result<VmConfig, Failure> {
    let mut config = VmConfig::new(kernel);
    disk_flags(opts, &mut config)?;
    net_flags(opts, &mut config)?;
    config.initrd = opts.initrd.clone();
    config.cmdline = opts.cmdline.clone();
    config.vcpus = vcpus_arg(opts.vcpus.unwrap_or(1))?;
    config.memory_mib = opts.memory.unwrap_or(128);
    config.rng = opts.rng;
    Ok(config)
}

fn parse_specs<T>(specs: &[String], f: fn(&str) -> Result<T, String>) -> Result<Vec<T>, Failure> {
    specs.iter().map(|s| f(s).map_err(bad_config)).collect()
}

fn vcpus_arg(v: u64) -> Result<u8, Failure> {
    u8::try_from(v).map_err(|_| {
        bad_config(vmm::ConfigError::Vcpus {
            given: v,
            max: vmm::config::MAX_VCPUS as u64,
        })
    })
}

/// `--disk`: image disks and vhost-user ones.
fn disk_flags(opts: &RunOptions, config: &mut VmConfig) -> Result<(), Failure> {
    let (vhost_user, files): (Vec<String>, Vec<String>) = opts
        .disks
        .iter()
        .cloned()
        .partition(|d| d.starts_with("vhost-user="));
    config.disks = parse_specs(&files, parse_disk)?;
    config.vhost_user_disks = parse_specs(&vhost_user, parse_vhost_user_disk)?;
    Ok(())
}

/// `--net`: TAPs and vhost-user NICs.
fn net_flags(opts: &RunOptions, config: &mut VmConfig) -> Result<(), Failure> {
    let (vhost_user, taps): (Vec<String>, Vec<String>) = opts
        .nets
        .iter()
        .cloned()
        .partition(|n| n.starts_with("vhost-user="));
    config.nets = parse_specs(&taps, parse_net)?;
    config.vhost_user_nets = parse_specs(&vhost_user, parse_vhost_user_net)?;
    Ok(())
}

/// A restore without -f or --kernel: the machine the snapshot recorded, with the disks and
/// TAPs it used (or those --disk / --net give), checked against --vcpus / --memory if given.
fn recorded_config(paths: &vmm::SnapshotPaths, opts: &RunOptions) -> Result<VmConfig, Failure> {
    let state = vmm::persist::read_state_file(&paths.state).map_err(bad_config)?;
    let mut config = VmConfig::new(PathBuf::new());
    config.vcpus = match opts.vcpus {
        Some(v) => vcpus_arg(v)?,
        None => state.vcpus,
    };
    config.memory_mib = opts.memory.unwrap_or(state.memory_mib);
    config.cmdline = state.cmdline.clone();
    let mut disks = Vec::new();
    let mut nets = Vec::new();
    let mut vhost_user = Vec::new();
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
                None if opts.nets.is_empty() => {
                    return Err(bad_config(format!(
                        "restore: the snapshot's {} was attached by file descriptor; give --net tap=NAME for it",
                        d.id
                    )))
                }
                None => {}
            },
            vmm::persist::VirtioKindState::VhostUser { .. } => vhost_user.push(d.id.clone()),
            vmm::persist::VirtioKindState::Rng { .. } => config.rng = true,
        }
    }
    if opts.disks.is_empty() {
        config.disks = disks;
    } else {
        disk_flags(opts, &mut config)?;
    }
    if opts.nets.is_empty() {
        config.nets = nets;
    } else {
        net_flags(opts, &mut config)?;
    }
    // A backend's socket is the host's, not the guest's: the snapshot does not name it.
    if vhost_user.len() > config.vhost_user_disks.len() + config.vhost_user_nets.len() {
        return Err(bad_config(format!(
            "restore: the snapshot's {}; give each backend's socket with --disk vhost-user=SOCKET or --net vhost-user=SOCKET (with every other disk or NIC)",
            match vhost_user.as_slice() {
                [one] => format!("{one} is served by a vhost-user backend"),
                many => format!("{} are served by vhost-user backends", many.join(", ")),
            }
        )));
    }
    Ok(config)
}

/// `run`, `restore` and `receive`: the config from -f, from flags or (restore only) from the
/// snapshot, then the VM with its console on this terminal.
pub fn launch(opts: &RunOptions, start: Start) -> Result<u8, Failure> {
    let restoring = !matches!(start, Start::Boot);
    let snapshot = match &start {
        Start::Restore(p) => Some(p.clone()),
        _ => None,
    };
    let prepared = if let Some(path) = &opts.manifest {
        manifest_config(path, opts, restoring)?
    } else {
        let config = match (&opts.kernel, &snapshot) {
            (Some(kernel), _) => flags_config(kernel.clone(), opts),
            (None, Some(paths)) => recorded_config(paths, opts),
            (None, None) => return Err(bad_config("give -f MANIFEST or --kernel PATH")),
        };
        Prepared {
            config: config?,
            name: "vm".into(),
            _network: None,
            ephemeral: Vec::new(),
            filesystems: Vec::new(),
        }
    };
    let mut config = prepared.config.clone();
    let mut fs_specs = prepared.filesystems.clone();
    fs_specs.extend(parse_specs(&opts.filesystems, crate::virtiofs::parse_fs)?);
    let run_dir = std::env::temp_dir().join(format!("microvirt-{}", std::process::id()));
    let (shares, _virtiofsd) = crate::virtiofs::prepare(&fs_specs, &run_dir).map_err(bad_config)?;
    config.filesystems.extend(shares);
    if let Some(h) = &opts.hugepages {
        config.hugepages = Some(
            h.parse()
                .map_err(|e| bad_config(format!("--hugepages {h}: {e}")))?,
        );
    }
    config.boot_timer = opts.boot_timer;
    config.seccomp = opts.seccomp;
    let console = crate::foreground::Console {
        log: opts.console_log.clone(),
        input: opts.console_input,
        socket: opts.socket.clone(),
        host: opts.environment.clone(),
        name: prepared.name.clone(),
    };
    let code = crate::foreground::boot_with_console(config, console, &start);
    for f in &prepared.ephemeral {
        let _ = std::fs::remove_file(f);
    }
    drop(_virtiofsd);
    let _ = std::fs::remove_dir(&run_dir);
    code
}

/// Parses `PATH[,readonly][,serial=S][,cache=none|writeback]`.
pub fn parse_disk(spec: &str) -> Result<DiskConfig, String> {
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

/// Parses `vhost-user=SOCKET`: a disk a vhost-user-blk backend serves (its size, whether it
/// is read-only and its cache are the backend's, so no other option applies).
pub fn parse_vhost_user_disk(spec: &str) -> Result<vmm::config::VhostUserDiskConfig, String> {
    match spec.strip_prefix("vhost-user=") {
        Some(socket) if !socket.is_empty() && !socket.contains(',') => {
            Ok(vmm::config::VhostUserDiskConfig {
                socket: PathBuf::from(socket),
            })
        }
        _ => Err(format!(
            "--disk {spec}: vhost-user=SOCKET takes no other option (the backend decides size, read-only and caching)"
        )),
    }
}

/// Parses `vhost-user=SOCKET[,mac=MAC]`: a NIC a vhost-user-net backend serves.
pub fn parse_vhost_user_net(spec: &str) -> Result<vmm::config::VhostUserNetConfig, String> {
    let mut parts = spec.split(',');
    let socket = parts
        .next()
        .and_then(|s| s.strip_prefix("vhost-user="))
        .filter(|s| !s.is_empty())
        .ok_or_else(|| format!("--net {spec}: vhost-user=SOCKET is missing its socket"))?;
    let mut mac = None;
    for opt in parts {
        match opt.split_once('=') {
            Some(("mac", m)) => {
                mac = Some(m.parse::<MacAddr>().map_err(|e| format!("--net {spec}: {e}"))?)
            }
            _ => {
                return Err(format!(
                    "--net {spec}: unknown option {opt:?}; with vhost-user=SOCKET only mac=MAC is accepted"
                ))
            }
        }
    }
    Ok(vmm::config::VhostUserNetConfig {
        socket: PathBuf::from(socket),
        mac,
    })
}

/// Parses `tap=NAME[,mac=MAC]` or `fd=N[,mac=MAC]`.
pub fn parse_net(spec: &str) -> Result<NetConfig, String> {
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
