//! VMI spec → VMM config. Pure: it resolves every path and decides every device; `Plan::prepare`
//! then creates the files the guest needs (emptyDisks, cloud-init seeds, containerDisk copies).
//!
//! Where things come from on one machine (standalone mode; in a Pod the same directories are
//! volume mounts):
//! - containerDisk / kernelBoot images: `<image_dir>/<image>` with `/` and `:` in the image
//!   reference replaced by `_`; either a disk file, or a directory holding `disk.img` (or a
//!   single `*.img`/`*.raw`) and, for kernelBoot, the kernelPath/initrdPath inside it.
//!   containerDisks are ephemeral as in KubeVirt: the guest writes to a copy that is deleted
//!   when the VM stops.
//! - persistentVolumeClaim / dataVolume: `<volume_dir>/<claim>/disk.img` (filesystem mode) or
//!   `<volume_dir>/<claim>` when that is a block device.
//! - emptyDisk: a sparse file in `<state_dir>`, deleted when the VM stops.
//! - hostDisk: the path itself; DiskOrCreate creates a sparse file of `capacity`.
//! - cloudInitNoCloud / cloudInitConfigDrive: a FAT seed labelled `cidata` / `config-2` in
//!   `<state_dir>`, attached read-only (see `crate::cloudinit`).
//! - filesystems (virtiofs): the directory itself — a claim's `<volume_dir>/<claim>`, a
//!   ConfigMap's `<volume_dir>/configmap/<name>`, a Secret's `<volume_dir>/secret/<name>`, the
//!   ServiceAccount token's `<volume_dir>/serviceaccount`, a downwardAPI volume's
//!   `<volume_dir>/downwardapi/<volume>` (all but claims read-only, as KubeVirt shares them;
//!   `api::launcher_pod::shared_dir`); virtiofsd serves it under the filesystem's name.
//! - kernel: firmware.kernelBoot.container, else the launcher's default guest kernel
//!   (`--default-kernel`, `$MICROVIRT_KERNEL`, or `/usr/share/microvirt/vmlinux` in the image).

use std::path::{Path, PathBuf};

use api::quantity::parse_bytes;
use api::validation::{guest_memory, vcpus};
use api::{Disk, DiskBus, DiskCache, NicModel, VirtualMachineInstanceSpec, Volume};
use vmm::config::{CacheMode, DiskConfig, MacAddr};
use vmm::VmConfig;

// The limits validation applies are the VMM's (see `api::limits`): the build fails if they part.
const _: () = {
    assert!(api::limits::MAX_VCPUS == vmm::config::MAX_VCPUS);
    assert!(api::limits::MIN_MEMORY_MIB == vmm::config::MIN_MEMORY_MIB);
    assert!(api::limits::MAX_MEMORY_MIB == vmm::config::MAX_MEMORY_MIB);
    assert!(api::limits::MAX_VIRTIO_DEVICES == vmm::config::MAX_VIRTIO_DEVICES);
};

#[derive(Clone, Debug)]
pub struct Environment {
    pub image_dir: PathBuf,
    pub volume_dir: PathBuf,
    pub state_dir: PathBuf,
    pub default_kernel: PathBuf,
    pub default_initrd: Option<PathBuf>,
    /// Appended to every kernel command line (e.g. flags a software-emulated host needs).
    pub extra_cmdline: String,
    /// The VMM threads' seccomp filters (`--seccomp`).
    pub seccomp: bool,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{path}: {reason}")]
pub struct TranslateError {
    pub path: String,
    pub reason: String,
}

fn err(path: impl Into<String>, reason: impl Into<String>) -> TranslateError {
    TranslateError {
        path: path.into(),
        reason: reason.into(),
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiskSource {
    /// Use the file or block device as it is.
    Existing(PathBuf),
    /// An ephemeral copy of a containerDisk image.
    CopyOf { image: PathBuf, to: PathBuf },
    /// A sparse file of `size` bytes, created if missing; `ephemeral` ones are deleted at stop.
    Sparse {
        path: PathBuf,
        size: u64,
        ephemeral: bool,
    },
    /// A cloud-init seed (NoCloud or ConfigDrive layout) built from inline data.
    CloudInit {
        path: PathBuf,
        layout: crate::cloudinit::Layout,
        user_data: Vec<u8>,
        network_config: Option<Vec<u8>>,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskPlan {
    /// The KubeVirt disk name.
    pub name: String,
    pub source: DiskSource,
    pub config: DiskConfig,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binding {
    Masquerade,
    Bridge,
    /// `binding: {name: vhostuser}`: the vhost-user socket Multus reports for the NIC's Pod
    /// interface (`api::launcher_pod::vhost_user_socket`).
    VhostUser,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NicPlan {
    pub interface: String,
    pub binding: Binding,
    pub mac: Option<MacAddr>,
    /// None for the pod network, else the Multus network name.
    pub multus: Option<String>,
    /// The Pod interface Multus makes for it (`net1`, …); None on the pod network.
    pub pod_interface: Option<String>,
}

/// A directory the guest mounts with virtio-fs, by `tag`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FsPlan {
    pub tag: String,
    pub dir: PathBuf,
    pub read_only: bool,
}

#[derive(Debug)]
pub struct Plan {
    pub name: String,
    /// Everything but disks and NICs, which `prepare` and the network wiring fill in.
    pub config: VmConfig,
    pub disks: Vec<DiskPlan>,
    pub nics: Vec<NicPlan>,
    /// virtio-fs shares; whoever runs the VM starts (or finds) their virtiofsd.
    pub filesystems: Vec<FsPlan>,
}

fn image_path(env: &Environment, image: &str) -> PathBuf {
    env.image_dir.join(image.replace(['/', ':'], "_"))
}

/// The disk file inside a containerDisk image directory.
fn image_disk(dir: &Path) -> Result<PathBuf, String> {
    if dir.is_file() {
        return Ok(dir.to_path_buf());
    }
    if !dir.is_dir() {
        return Err(format!("image not found at {}", dir.display()));
    }
    let d = dir.join("disk.img");
    if d.is_file() {
        return Ok(d);
    }
    let found: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "img" || x == "raw"))
        .collect();
    match found.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err(format!(
            "{} holds no disk.img, *.img or *.raw",
            dir.display()
        )),
        _ => Err(format!(
            "{} holds several images; name one disk.img",
            dir.display()
        )),
    }
}

fn b64(s: &str, path: &str) -> Result<Vec<u8>, TranslateError> {
    // Minimal standard base64 (RFC 4648) decoder: user data is small and this avoids a
    // dependency for one call site.
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0);
    for c in s.bytes().filter(|c| !c.is_ascii_whitespace()) {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            b'=' => break,
            _ => return Err(err(path, "is not valid base64")),
        };
        acc = (acc << 6) | v as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    Ok(out)
}

/// What a volume's source becomes on this host: `read_only` is raised where the source
/// says so (a read-only claim, a cloud-init seed).
fn disk_source(
    name: &str,
    vol: &Volume,
    vp: &str,
    env: &Environment,
    read_only: &mut bool,
) -> Result<DiskSource, TranslateError> {
    let state = env.state_dir.join(name);
    if let Some(c) = &vol.container_disk {
        return container_disk_source(c, &state, vol, vp, env);
    }
    if let Some(claim) = vol
        .persistent_volume_claim
        .as_ref()
        .map(|p| p.claim_name.clone())
        .or_else(|| vol.data_volume.as_ref().map(|d| d.name.clone()))
    {
        if vol
            .persistent_volume_claim
            .as_ref()
            .and_then(|p| p.read_only)
            == Some(true)
        {
            *read_only = true;
        }
        return claim_source(&claim, vol, vp, env);
    }
    if let Some(e) = &vol.empty_disk {
        let size =
            parse_bytes(&e.capacity.0).map_err(|r| err(format!("{vp}.emptyDisk.capacity"), r))?;
        return Ok(DiskSource::Sparse {
            path: state.join(format!("{}.emptydisk.img", vol.name)),
            size,
            ephemeral: true,
        });
    }
    if let Some(h) = &vol.host_disk {
        return host_disk_source(h, vp);
    }
    if let Some((ci, layout)) = vol
        .cloud_init_no_cloud
        .as_ref()
        .map(|c| (c, crate::cloudinit::Layout::NoCloud))
        .or_else(|| {
            vol.cloud_init_config_drive
                .as_ref()
                .map(|c| (c, crate::cloudinit::Layout::ConfigDrive))
        })
    {
        *read_only = true;
        return cloud_init_source(ci, layout, &state, vol, vp);
    }
    Err(err(vp, "has no volume source microvirt can attach"))
}

/// A containerDisk: its image (or `path` in it) copied to the VM's state directory.
fn container_disk_source(
    c: &api::ContainerDiskSource,
    state: &Path,
    vol: &Volume,
    vp: &str,
    env: &Environment,
) -> Result<DiskSource, TranslateError> {
    let dir = image_path(env, &c.image);
    let field = if c.path.is_some() { "path" } else { "image" };
    let base = match &c.path {
        Some(p) => dir.join(p.trim_start_matches('/')),
        None => dir.clone(),
    };
    let in_images = |p: &Path| crate::beneath::resolve(&env.image_dir, p, "image directory");
    let image = in_images(&base)
        .and_then(|b| image_disk(&b))
        .and_then(|i| in_images(&i))
        .map_err(|r| err(format!("{vp}.containerDisk.{field}"), r))?;
    Ok(DiskSource::CopyOf {
        image,
        to: state.join(format!("{}.containerdisk.img", vol.name)),
    })
}

/// A claim (PVC or DataVolume): its block device, or `disk.img` in its directory.
fn claim_source(
    claim: &str,
    vol: &Volume,
    vp: &str,
    env: &Environment,
) -> Result<DiskSource, TranslateError> {
    use std::os::unix::fs::FileTypeExt;
    let which = if vol.data_volume.is_some() {
        "dataVolume.name"
    } else {
        "persistentVolumeClaim.claimName"
    };
    let p = env.volume_dir.join(claim);
    let in_volumes = |p: &Path| crate::beneath::resolve(&env.volume_dir, p, "volume directory");
    let meta = std::fs::metadata(&p).map_err(|_| {
        err(
            format!("{vp}.{which}"),
            format!("volume {claim:?} not found at {}", p.display()),
        )
    })?;
    let p = in_volumes(&p).map_err(|r| err(format!("{vp}.{which}"), r))?;
    if meta.file_type().is_block_device() {
        return Ok(DiskSource::Existing(p));
    }
    let img = p.join("disk.img");
    if !img.is_file() {
        return Err(err(
            format!("{vp}.{which}"),
            format!("{} has no disk.img", p.display()),
        ));
    }
    Ok(DiskSource::Existing(
        in_volumes(&img).map_err(|r| err(format!("{vp}.{which}"), r))?,
    ))
}

/// A hostDisk: the image at its path (made sparse for DiskOrCreate).
fn host_disk_source(h: &api::HostDiskSource, vp: &str) -> Result<DiskSource, TranslateError> {
    let path = PathBuf::from(&h.path);
    if h.type_ == "Disk" {
        if !path.exists() {
            return Err(err(format!("{vp}.hostDisk.path"), format!("{} does not exist (type Disk needs an existing image; DiskOrCreate creates one)", h.path)));
        }
        return Ok(DiskSource::Existing(path));
    }
    let size = h
        .capacity
        .as_ref()
        .map(|c| parse_bytes(&c.0))
        .transpose()
        .map_err(|r| err(format!("{vp}.hostDisk.capacity"), r))?
        .unwrap_or(0);
    Ok(DiskSource::Sparse {
        path,
        size,
        ephemeral: false,
    })
}

/// A cloud-init seed (NoCloud or ConfigDrive) with the user and network data.
fn cloud_init_source(
    ci: &api::CloudInitNoCloudSource,
    layout: crate::cloudinit::Layout,
    state: &Path,
    vol: &Volume,
    vp: &str,
) -> Result<DiskSource, TranslateError> {
    let field = layout.field();
    let user_data = match (&ci.user_data, &ci.user_data_base64) {
        (Some(u), _) => u.clone().into_bytes(),
        (None, Some(b)) => b64(b, &format!("{vp}.{field}.userDataBase64"))?,
        (None, None) => Vec::new(),
    };
    let network_config = match (&ci.network_data, &ci.network_data_base64) {
        (Some(n), _) => Some(n.clone().into_bytes()),
        (None, Some(b)) => Some(b64(b, &format!("{vp}.{field}.networkDataBase64"))?),
        (None, None) => None,
    };
    Ok(DiskSource::CloudInit {
        path: state.join(format!("{}.{}.img", vol.name, layout.label())),
        layout,
        user_data,
        network_config,
    })
}

/// The host cache mode of a disk's `cache`; KubeVirt's default (none given) is writeback.
/// Validation refuses the others; they are refused here too, never mapped to another mode.
fn cache_mode(cache: Option<&DiskCache>, dp: &str) -> Result<CacheMode, TranslateError> {
    match cache {
        Some(DiskCache::None) => Ok(CacheMode::None),
        None | Some(DiskCache::Writeback) => Ok(CacheMode::Writeback),
        Some(c @ (DiskCache::Writethrough | DiskCache::Other(_))) => Err(err(
            format!("{dp}.cache"),
            format!(
                "cache mode {:?} is not supported; accepted: none, writeback",
                c.as_str()
            ),
        )),
    }
}

/// The guest sees every disk on virtio-blk.
fn check_bus(disk: &Disk, dp: &str) -> Result<(), TranslateError> {
    let targets = [
        ("disk", disk.disk.as_ref().and_then(|t| t.bus.as_ref())),
        ("cdrom", disk.cdrom.as_ref().and_then(|t| t.bus.as_ref())),
        ("lun", disk.lun.as_ref().and_then(|t| t.bus.as_ref())),
    ];
    for (which, bus) in targets {
        match bus {
            None | Some(DiskBus::Virtio) => {}
            Some(b @ (DiskBus::Sata | DiskBus::Scsi | DiskBus::Usb | DiskBus::Other(_))) => {
                return Err(err(
                    format!("{dp}.{which}.bus"),
                    format!("bus {:?} is not supported; accepted: virtio", b.as_str()),
                ))
            }
        }
    }
    Ok(())
}

fn disk_plan(
    name: &str,
    disk: &Disk,
    dp: &str,
    vol: &Volume,
    vp: &str,
    env: &Environment,
) -> Result<DiskPlan, TranslateError> {
    check_bus(disk, dp)?;
    let mut read_only =
        disk.disk.as_ref().and_then(|d| d.readonly).unwrap_or(false) || disk.cdrom.is_some();
    let source = disk_source(name, vol, vp, env, &mut read_only)?;
    Ok(DiskPlan {
        name: disk.name.clone(),
        config: DiskConfig {
            path: match &source {
                DiskSource::Existing(p) => p.clone(),
                DiskSource::CopyOf { to, .. } => to.clone(),
                DiskSource::Sparse { path, .. } | DiskSource::CloudInit { path, .. } => {
                    path.clone()
                }
            },
            read_only,
            serial: disk.serial.clone(),
            cache: cache_mode(disk.cache.as_ref(), dp)?,
        },
        source,
    })
}

/// Translates a defaulted, validated VMI spec.
pub fn translate(
    name: &str,
    spec: &VirtualMachineInstanceSpec,
    env: &Environment,
) -> Result<Plan, TranslateError> {
    let memory = guest_memory(spec)
        .ok_or_else(|| err("spec.domain.memory.guest", "is required"))?
        .map_err(|r| err("spec.domain.memory.guest", r))?;
    let mut config = VmConfig::new(env.default_kernel.clone());
    // Not a whole MiB (a decimal `1024M`): rounded up, never down (README, "Memory sizes").
    config.memory_mib = api::quantity::guest_mib(memory);
    config.vcpus = vcpus(spec).min(254) as u8;
    if let Some(h) = spec
        .domain
        .memory
        .as_ref()
        .and_then(|m| m.hugepages.as_ref())
    {
        let page = api::validation::hugepage_bytes(h)
            .map_err(|r| err("spec.domain.memory.hugepages.pageSize", r))?;
        config.hugepages = Some(if page == 2 << 20 {
            vmm::config::HugePageSize::Size2M
        } else {
            vmm::config::HugePageSize::Size1G
        });
    }
    config.seccomp = env.seccomp;
    config.rng = spec.domain.devices.rng.is_some();
    config.initrd = env.default_initrd.clone();
    let kernel_boot = spec
        .domain
        .firmware
        .as_ref()
        .and_then(|f| f.kernel_boot.as_ref());
    if let Some(c) = kernel_boot.and_then(|k| k.container.as_ref()) {
        kernel_from_image(c, env, &mut config)?;
    }
    let disks = disk_plans(name, spec, env)?;
    let nics = nic_plans(name, spec)?;
    let filesystems = fs_plans(spec, env)?;
    config.cmdline = command_line(spec, &config, &disks, env);
    config.disks = disks.iter().map(|d| d.config.clone()).collect();
    Ok(Plan {
        name: name.to_string(),
        config,
        disks,
        nics,
        filesystems,
    })
}

/// The directory each filesystem shares: what its volume is on this host.
fn fs_plans(
    spec: &VirtualMachineInstanceSpec,
    env: &Environment,
) -> Result<Vec<FsPlan>, TranslateError> {
    let mut out = Vec::new();
    for (i, fs) in spec.domain.devices.filesystems.iter().enumerate() {
        let fp = format!("spec.domain.devices.filesystems[{i}].name");
        let vol = spec
            .volumes
            .iter()
            .find(|v| v.name == fs.name)
            .ok_or_else(|| err(&fp, "has no volume"))?;
        let (rel, read_only) = api::launcher_pod::shared_dir(vol)
            .ok_or_else(|| err(&fp, "its volume is not a directory to share"))?;
        let dir = env.volume_dir.join(rel);
        let what = if vol.config_map.is_some() {
            "ConfigMap"
        } else if vol.secret.is_some() {
            "Secret"
        } else if vol.service_account.is_some() {
            "ServiceAccount token"
        } else if vol.downward_api.is_some() {
            "downwardAPI volume"
        } else {
            "claim"
        };
        if !dir.is_dir() {
            return Err(err(
                &fp,
                format!("the {what}'s directory {} does not exist", dir.display()),
            ));
        }
        let dir = crate::beneath::resolve(&env.volume_dir, &dir, "volume directory")
            .map_err(|r| err(&fp, r))?;
        out.push(FsPlan {
            tag: fs.name.clone(),
            dir,
            read_only,
        });
    }
    Ok(out)
}

/// kernelBoot from a container image: its kernel and initrd, resolved inside the image.
fn kernel_from_image(
    c: &api::KernelBootContainer,
    env: &Environment,
    config: &mut VmConfig,
) -> Result<(), TranslateError> {
    let dir = image_path(env, &c.image);
    let kp = "spec.domain.firmware.kernelBoot.container";
    if !dir.is_dir() {
        return Err(err(
            format!("{kp}.image"),
            format!("image not found at {}", dir.display()),
        ));
    }
    // A file in the image, resolved without leaving the image directory.
    let inside = |p: &str, field: &str| {
        let path = dir.join(p.trim_start_matches('/'));
        if !path.is_file() {
            return Err(err(
                format!("{kp}.{field}"),
                format!("{p} not found in image {}", c.image),
            ));
        }
        crate::beneath::resolve(&env.image_dir, &path, "image directory")
            .map_err(|r| err(format!("{kp}.{field}"), r))
    };
    if let Some(k) = &c.kernel_path {
        config.kernel = inside(k, "kernelPath")?;
    }
    config.initrd = match &c.initrd_path {
        Some(i) => Some(inside(i, "initrdPath")?),
        None => None,
    };
    Ok(())
}

/// Disks in boot order: those with bootOrder first (ascending), then the rest as written.
fn disk_plans(
    name: &str,
    spec: &VirtualMachineInstanceSpec,
    env: &Environment,
) -> Result<Vec<DiskPlan>, TranslateError> {
    let mut order: Vec<(usize, &Disk)> = spec.domain.devices.disks.iter().enumerate().collect();
    order.sort_by_key(|(i, d)| (d.boot_order.unwrap_or(u32::MAX), *i));
    let mut disks = Vec::new();
    for (i, disk) in order {
        let (vi, vol) = spec
            .volumes
            .iter()
            .enumerate()
            .find(|(_, v)| v.name == disk.name)
            .ok_or_else(|| {
                err(
                    format!("spec.domain.devices.disks[{i}].name"),
                    "has no volume",
                )
            })?;
        disks.push(disk_plan(
            name,
            disk,
            &format!("spec.domain.devices.disks[{i}]"),
            vol,
            &format!("spec.volumes[{vi}]"),
            env,
        )?);
    }
    Ok(disks)
}

fn nic_plans(
    name: &str,
    spec: &VirtualMachineInstanceSpec,
) -> Result<Vec<NicPlan>, TranslateError> {
    let mut nics = Vec::new();
    let multus_ifaces = api::launcher_pod::multus_interfaces(spec);
    for (i, iface) in spec.domain.devices.interfaces.iter().enumerate() {
        let net = spec.networks.iter().find(|n| n.name == iface.name);
        // KubeVirt users expect a NIC's MAC to survive restarts and migrations: without
        // macAddress, one derived from the VMI and interface names (the same in every launcher,
        // and the one virt-handler lets out of the TAP).
        let mac = Some(MacAddr(api::mac::of_interface(name, iface).map_err(
            |r| err(format!("spec.domain.devices.interfaces[{i}].macAddress"), r),
        )?));
        let ip = format!("spec.domain.devices.interfaces[{i}]");
        match &iface.model {
            None | Some(NicModel::Virtio) => {}
            Some(m) => {
                return Err(err(
                    format!("{ip}.model"),
                    format!(
                        "NIC model {:?} is not supported; accepted: virtio",
                        m.as_str()
                    ),
                ))
            }
        }
        let binding = match iface.bindings().as_slice() {
            [api::Binding::Masquerade] => Binding::Masquerade,
            [api::Binding::Bridge] => Binding::Bridge,
            [api::Binding::Plugin] => Binding::VhostUser,
            [b @ (api::Binding::Sriov | api::Binding::Slirp)] => {
                return Err(err(
                    format!("{ip}.{}", b.field()),
                    "is not supported; accepted bindings: masquerade, bridge, vhostuser",
                ))
            }
            _ => return Err(err(
                ip,
                "set exactly one binding method (masquerade, bridge or binding: {name: vhostuser})",
            )),
        };
        let pod_interface = multus_ifaces
            .iter()
            .find(|(network, _)| *network == iface.name)
            .map(|(_, pod_iface)| pod_iface.clone());
        nics.push(NicPlan {
            interface: iface.name.clone(),
            binding,
            mac,
            multus: net.and_then(|n| n.multus.as_ref().map(|m| m.network_name.clone())),
            pod_interface,
        });
    }
    Ok(nics)
}

/// Command line: kernelArgs as given, else a microvirt default; the serial console, the root
/// disk when booting from one, and the host's extra flags.
fn command_line(
    spec: &VirtualMachineInstanceSpec,
    config: &VmConfig,
    disks: &[DiskPlan],
    env: &Environment,
) -> String {
    let kernel_boot = spec
        .domain
        .firmware
        .as_ref()
        .and_then(|f| f.kernel_boot.as_ref());
    let mut cmdline = kernel_boot
        .and_then(|k| k.kernel_args.clone())
        .unwrap_or_else(|| "reboot=k panic=1".into());
    if spec.domain.devices.autoattach_serial_console != Some(false) && !cmdline.contains("console=")
    {
        cmdline = format!("console=ttyS0 {cmdline}");
    }
    if config.initrd.is_none() && !disks.is_empty() && !cmdline.contains("root=") {
        let mode = if disks[0].config.read_only {
            "ro"
        } else {
            "rw"
        };
        cmdline.push_str(&format!(" root=/dev/vda {mode}"));
    }
    if !env.extra_cmdline.is_empty() {
        cmdline.push(' ');
        cmdline.push_str(&env.extra_cmdline);
    }
    cmdline
}

impl Plan {
    /// Creates the files the disks need. Returns the ephemeral ones, to delete at stop.
    pub fn prepare(&self) -> Result<Vec<PathBuf>, TranslateError> {
        let mut ephemeral = Vec::new();
        for d in &self.disks {
            let path = d.config.path.clone();
            let fail = |e: std::io::Error| {
                err(
                    format!("disk {}", d.name),
                    format!("{}: {e}", path.display()),
                )
            };
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(fail)?;
            }
            match &d.source {
                DiskSource::Existing(_) => {}
                DiskSource::CopyOf { image, to } => {
                    std::fs::copy(image, to).map_err(fail)?;
                    ephemeral.push(to.clone());
                }
                DiskSource::Sparse {
                    path,
                    size,
                    ephemeral: eph,
                } => {
                    if !path.exists() {
                        std::fs::File::create(path)
                            .and_then(|f| f.set_len(*size))
                            .map_err(fail)?;
                    }
                    if *eph {
                        ephemeral.push(path.clone());
                    }
                }
                DiskSource::CloudInit {
                    path,
                    layout,
                    user_data,
                    network_config,
                } => {
                    crate::cloudinit::write_seed(
                        path,
                        &crate::cloudinit::Seed {
                            layout: *layout,
                            instance_id: &self.name,
                            hostname: &self.name,
                            user_data,
                            network_config: network_config.as_deref(),
                        },
                    )
                    .map_err(fail)?;
                    ephemeral.push(path.clone());
                }
            }
        }
        Ok(ephemeral)
    }
}

impl Plan {
    /// A stable, human-readable rendering (golden tests, `--dry-run`).
    pub fn describe(&self) -> String {
        let c = &self.config;
        let mut s = format!(
            "vm {}\nvcpus {}\nmemory_mib {}{}\nkernel {}\ninitrd {}\ncmdline {}\n",
            self.name,
            c.vcpus,
            c.memory_mib,
            c.hugepages
                .map_or(String::new(), |h| format!(" hugepages={}", h.label())),
            c.kernel.display(),
            c.initrd
                .as_ref()
                .map_or("-".into(), |p| p.display().to_string()),
            c.cmdline
        );
        for (i, d) in self.disks.iter().enumerate() {
            let src = match &d.source {
                DiskSource::Existing(p) => format!("existing {}", p.display()),
                DiskSource::CopyOf { image, .. } => format!("copy-of {}", image.display()),
                DiskSource::Sparse {
                    size, ephemeral, ..
                } => format!("sparse {size} ephemeral={ephemeral}"),
                DiskSource::CloudInit {
                    layout,
                    user_data,
                    network_config,
                    ..
                } => {
                    format!(
                        "cloud-init layout={} user-data={}B network-config={}",
                        layout.label(),
                        user_data.len(),
                        network_config
                            .as_ref()
                            .map_or("-".into(), |n| format!("{}B", n.len()))
                    )
                }
            };
            s += &format!(
                "disk {} {} path={} ro={} serial={} cache={:?} source={}\n",
                vmm::config::disk_name(i),
                d.name,
                d.config.path.display(),
                d.config.read_only,
                d.config.serial.as_deref().unwrap_or("-"),
                d.config.cache,
                src
            );
        }
        for n in &self.nics {
            s += &format!(
                "nic {} binding={:?} mac={} network={}\n",
                n.interface,
                n.binding,
                n.mac.map_or("-".into(), |m| m.to_string()),
                n.multus.as_deref().unwrap_or("pod")
            );
        }
        for f in &self.filesystems {
            s += &format!("fs {} dir={} ro={}\n", f.tag, f.dir.display(), f.read_only);
        }
        if c.rng {
            s += "rng virtio-rng\n";
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_cache_value_has_one_meaning() {
        let dp = "spec.domain.devices.disks[0]";
        assert_eq!(cache_mode(None, dp).unwrap(), CacheMode::Writeback);
        assert_eq!(
            cache_mode(Some(&DiskCache::None), dp).unwrap(),
            CacheMode::None
        );
        assert_eq!(
            cache_mode(Some(&DiskCache::Writeback), dp).unwrap(),
            CacheMode::Writeback
        );
        // Never silently another mode.
        for refused in [DiskCache::Writethrough, DiskCache::from("unsafe")] {
            let e = cache_mode(Some(&refused), dp).unwrap_err().to_string();
            assert!(
                e.contains("disks[0].cache") && e.contains("accepted: none, writeback"),
                "{e}"
            );
        }
    }
}
