//! The one plain configuration a VM is built from. Every front end (the launcher's flags, its
//! control socket, a VirtualMachine manifest) produces a `VmConfig`; `VmConfig::validate` is the
//! single place that judges it, so every front end reports the same errors.

use std::fmt;
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use crate::layout::CMDLINE_MAX_SIZE;

/// Upper bound on vCPUs regardless of what KVM allows: the MP table and xAPIC IDs are 8-bit and
/// 0xff is the broadcast ID.
pub const MAX_VCPUS: u8 = 254;
pub const MIN_MEMORY_MIB: u64 = 8;
/// 1 TiB: beyond that the identity map and memory slots need more than this VMM sets up.
pub const MAX_MEMORY_MIB: u64 = 1 << 20;

#[derive(Clone, Debug)]
pub struct VmConfig {
    pub vcpus: u8,
    pub memory_mib: u64,
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub cmdline: String,
    pub serial: SerialConfig,
    /// Print `microvirt boot-timer: first KVM_RUN unix_ns=<n>` on stderr when vCPU 0 first
    /// enters the guest, for start-up benchmarks.
    pub boot_timer: bool,
    /// virtio-blk disks, in guest order (vda, vdb, ...).
    pub disks: Vec<DiskConfig>,
    /// virtio-net NICs, in guest order (eth0, eth1, ...).
    pub nets: Vec<NetConfig>,
    /// virtio-blk disks a vhost-user-blk backend serves (qemu-storage-daemon, SPDK), attached
    /// after `disks` (the guest sees them next, in order).
    pub vhost_user_disks: Vec<VhostUserDiskConfig>,
    /// virtio-net NICs a vhost-user-net backend serves (DPDK, OVS-DPDK), attached after `nets`.
    pub vhost_user_nets: Vec<VhostUserNetConfig>,
    /// virtio-fs shares served by vhost-user-fs backends (virtiofsd), in guest order. These
    /// and `vhost_user_disks` make guest RAM a shared memfd the backends map.
    pub filesystems: Vec<FsConfig>,
    /// A virtio-rng device (KubeVirt's `rng`), after every other virtio device: entropy from
    /// the host's RNG for the guest.
    pub rng: bool,
    /// Back guest RAM with huge pages of this size (KubeVirt's `memory.hugepages.pageSize`):
    /// a hugetlb memfd, reserved when the VM is built, so a host short of pages refuses the VM
    /// instead of failing the guest later.
    pub hugepages: Option<HugePageSize>,
    /// Each vCPU and the device thread install their seccomp filter (`seccomp`) before they
    /// run guest-driven code. On by default; off only for debugging.
    pub seccomp: bool,
}

/// A MAC address; only unicast addresses are accepted for a NIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MacAddr(pub [u8; 6]);

impl std::str::FromStr for MacAddr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let parts: Vec<&str> = s.split(':').collect();
        if parts.len() != 6 {
            return Err(format!(
                "mac={s}: expected six hex bytes like 52:54:00:12:34:56"
            ));
        }
        let mut m = [0u8; 6];
        for (i, p) in parts.iter().enumerate() {
            if p.len() != 2 {
                return Err(format!(
                    "mac={s}: expected six hex bytes like 52:54:00:12:34:56"
                ));
            }
            m[i] = u8::from_str_radix(p, 16)
                .map_err(|_| format!("mac={s}: {p:?} is not a hex byte"))?;
        }
        if m[0] & 1 != 0 {
            return Err(format!(
                "mac={s}: a multicast address; a NIC needs a unicast address (first byte even)"
            ));
        }
        if m == [0; 6] {
            return Err(format!(
                "mac={s}: the all-zero address is not a valid NIC address"
            ));
        }
        Ok(MacAddr(m))
    }
}

impl std::fmt::Display for MacAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let m = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

/// Where a NIC's TAP comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TapSource {
    /// An existing TAP interface in the VMM's network namespace, attached by name.
    Name(String),
    /// An open TAP file descriptor; the VM takes ownership of it.
    Fd(i32),
}

impl std::fmt::Display for TapSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TapSource::Name(n) => write!(f, "tap={n}"),
            TapSource::Fd(fd) => write!(f, "tap-fd={fd}"),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetConfig {
    pub tap: TapSource,
    /// None: a locally administered address is generated.
    pub mac: Option<MacAddr>,
}

/// A huge page size the host's hugetlb pool provides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HugePageSize {
    Size2M,
    Size1G,
}

impl HugePageSize {
    pub fn bytes(self) -> u64 {
        match self {
            HugePageSize::Size2M => 2 << 20,
            HugePageSize::Size1G => 1 << 30,
        }
    }

    /// As Kubernetes writes it (`hugepages-2Mi`).
    pub fn label(self) -> &'static str {
        match self {
            HugePageSize::Size2M => "2Mi",
            HugePageSize::Size1G => "1Gi",
        }
    }
}

impl std::str::FromStr for HugePageSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "2Mi" | "2M" => Ok(HugePageSize::Size2M),
            "1Gi" | "1G" => Ok(HugePageSize::Size1G),
            other => Err(format!(
                "{other:?} is not a huge page size; accepted: 2Mi, 1Gi"
            )),
        }
    }
}

/// A disk whose backend listens on a vhost-user socket; whether it is read-only, its size and
/// its limits are the backend's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VhostUserDiskConfig {
    pub socket: PathBuf,
}

/// A NIC whose backend listens on a vhost-user socket. None: a MAC derived from the socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VhostUserNetConfig {
    pub socket: PathBuf,
    pub mac: Option<MacAddr>,
}

/// A virtio-fs share: the tag the guest mounts (`mount -t virtiofs TAG /mnt`) and the
/// vhost-user socket of the backend that serves it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FsConfig {
    pub tag: String,
    pub socket: PathBuf,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum CacheMode {
    /// O_DIRECT: no host page cache; data reaches the device on completion of FLUSH.
    None,
    /// Host page cache; FLUSH is an fdatasync.
    #[default]
    Writeback,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskConfig {
    pub path: PathBuf,
    pub read_only: bool,
    /// Returned to the guest by GET_ID (at most 20 bytes).
    pub serial: Option<String>,
    pub cache: CacheMode,
}

impl DiskConfig {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        DiskConfig {
            path: path.into(),
            read_only: false,
            serial: None,
            cache: CacheMode::Writeback,
        }
    }
}

/// The guest name of the i-th disk: vda, vdb, ..., vdz, vdaa, ...
pub fn disk_name(i: usize) -> String {
    let mut n = i;
    let mut s = Vec::new();
    loop {
        s.push(b'a' + (n % 26) as u8);
        if n < 26 {
            break;
        }
        n = n / 26 - 1;
    }
    s.reverse();
    format!("vd{}", String::from_utf8(s).unwrap())
}

/// The most virtio-mmio devices a VM gets: one legacy IRQ each, 5 to 23.
pub const MAX_VIRTIO_DEVICES: usize = 19;

impl VmConfig {
    /// A config with defaults a user of Firecracker would expect: 1 vCPU, 128 MiB, serial on stdout.
    pub fn new(kernel: impl Into<PathBuf>) -> Self {
        VmConfig {
            vcpus: 1,
            memory_mib: 128,
            kernel: kernel.into(),
            initrd: None,
            cmdline: String::from("console=ttyS0 reboot=k panic=1"),
            serial: SerialConfig::default(),
            boot_timer: false,
            disks: Vec::new(),
            nets: Vec::new(),
            vhost_user_disks: Vec::new(),
            vhost_user_nets: Vec::new(),
            filesystems: Vec::new(),
            rng: false,
            hugepages: None,
            seccomp: true,
        }
    }
}

/// Where the guest's COM1 output goes.
#[derive(Clone, Default)]
pub enum SerialOutput {
    #[default]
    Stdout,
    File(PathBuf),
    /// Connect to a unix stream socket and write the console there.
    UnixSocket(PathBuf),
    /// Any writer the embedder provides (tests, the launcher's console fan-out).
    Writer(Arc<Mutex<dyn Write + Send>>),
    /// Discard output.
    Null,
}

impl fmt::Debug for SerialOutput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SerialOutput::Stdout => write!(f, "Stdout"),
            SerialOutput::File(p) => write!(f, "File({})", p.display()),
            SerialOutput::UnixSocket(p) => write!(f, "UnixSocket({})", p.display()),
            SerialOutput::Writer(_) => write!(f, "Writer"),
            SerialOutput::Null => write!(f, "Null"),
        }
    }
}

/// Where the guest's COM1 input comes from.
#[derive(Clone, Debug, Default)]
pub enum SerialInput {
    #[default]
    None,
    Stdin,
    /// Connect to a unix stream socket and feed what it sends to the guest.
    UnixSocket(PathBuf),
    /// Read from this file descriptor (a pipe or socket); the VM takes ownership of it.
    Fd(i32),
}

#[derive(Clone, Debug, Default)]
pub struct SerialConfig {
    pub output: SerialOutput,
    pub input: SerialInput,
}

/// A rejected configuration: which option, what was given, what is accepted.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("--vcpus {given}: must be between 1 and {max}")]
    Vcpus { given: u64, max: u64 },
    #[error("--memory {given}: must be between {min} and {max} MiB")]
    Memory { given: u64, min: u64, max: u64 },
    #[error("--kernel {path}: {reason}")]
    Kernel { path: String, reason: String },
    #[error("--initrd {path}: {reason}")]
    Initrd { path: String, reason: String },
    #[error("--cmdline: {len} bytes is too long, at most {max} bytes are accepted")]
    CmdlineTooLong { len: usize, max: usize },
    #[error("--cmdline: {0}")]
    Cmdline(String),
    #[error("--disk {path}: {reason}")]
    Disk { path: String, reason: String },
    #[error("--net {tap}: {reason}")]
    Net { tap: String, reason: String },
    #[error("--hugepages {size}: {reason}")]
    Hugepages { size: String, reason: String },
    #[error("--fs {tag}: {reason}")]
    Fs { tag: String, reason: String },
    #[error("{given} virtio devices requested; at most {max} are supported")]
    TooManyDevices { given: usize, max: usize },
    #[error(
        "--memory {memory_mib}: {what} needs {needed_mib} MiB of guest RAM; give at least that"
    )]
    MemoryTooSmall {
        memory_mib: u64,
        what: String,
        needed_mib: u64,
    },
}

impl VmConfig {
    /// True when a vhost-user backend maps guest RAM (it must then be shared memory).
    pub fn has_vhost_user_devices(&self) -> bool {
        !self.filesystems.is_empty()
            || !self.vhost_user_disks.is_empty()
            || !self.vhost_user_nets.is_empty()
    }

    /// Checks everything that can be checked without KVM. `max_vcpus` is KVM's limit when known.
    pub fn validate(&self, kvm_max_vcpus: Option<usize>) -> Result<(), ConfigError> {
        self.validate_devices(kvm_max_vcpus)?;
        check_readable_file(&self.kernel).map_err(|reason| ConfigError::Kernel {
            path: self.kernel.display().to_string(),
            reason,
        })?;
        if let Some(initrd) = &self.initrd {
            check_readable_file(initrd).map_err(|reason| ConfigError::Initrd {
                path: initrd.display().to_string(),
                reason,
            })?;
        }
        Ok(())
    }

    /// Everything `validate` checks except the kernel and initrd, which a restore does not load.
    pub fn validate_devices(&self, kvm_max_vcpus: Option<usize>) -> Result<(), ConfigError> {
        let max_vcpus =
            kvm_max_vcpus.map_or(MAX_VCPUS as u64, |m| (m as u64).min(MAX_VCPUS as u64));
        if self.vcpus == 0 || self.vcpus as u64 > max_vcpus {
            return Err(ConfigError::Vcpus {
                given: self.vcpus as u64,
                max: max_vcpus,
            });
        }
        if !(MIN_MEMORY_MIB..=MAX_MEMORY_MIB).contains(&self.memory_mib) {
            return Err(ConfigError::Memory {
                given: self.memory_mib,
                min: MIN_MEMORY_MIB,
                max: MAX_MEMORY_MIB,
            });
        }
        if let Some(h) = self.hugepages {
            if !(self.memory_mib << 20).is_multiple_of(h.bytes()) {
                return Err(ConfigError::Hugepages {
                    size: h.label().into(),
                    reason: format!(
                        "--memory {} MiB is not a whole number of {} pages",
                        self.memory_mib,
                        h.label()
                    ),
                });
            }
        }
        // The NUL terminator also needs room.
        if self.cmdline.len() >= CMDLINE_MAX_SIZE {
            return Err(ConfigError::CmdlineTooLong {
                len: self.cmdline.len(),
                max: CMDLINE_MAX_SIZE - 1,
            });
        }
        if let Some(bad) = self
            .cmdline
            .chars()
            .find(|c| !c.is_ascii() || (c.is_ascii_control() && *c != ' '))
        {
            return Err(ConfigError::Cmdline(format!(
                "character {bad:?} is not accepted; only printable ASCII is"
            )));
        }
        // Disks, NICs and shares share the virtio window and its IRQs.
        let devices = self.disks.len()
            + self.vhost_user_disks.len()
            + self.nets.len()
            + self.vhost_user_nets.len()
            + self.filesystems.len();
        if devices > MAX_VIRTIO_DEVICES {
            return Err(ConfigError::TooManyDevices {
                given: devices,
                max: MAX_VIRTIO_DEVICES,
            });
        }
        for (i, f) in self.filesystems.iter().enumerate() {
            let fs_err = |reason: String| ConfigError::Fs {
                tag: f.tag.clone(),
                reason,
            };
            let max = crate::devices::virtio::vhost_user::fs::TAG_MAX;
            if f.tag.is_empty() || f.tag.len() > max || !f.tag.bytes().all(|b| b.is_ascii_graphic())
            {
                return Err(fs_err(format!(
                    "the tag must be 1 to {max} printable ASCII characters without spaces"
                )));
            }
            if self.filesystems[..i].iter().any(|o| o.tag == f.tag) {
                return Err(fs_err(
                    "the tag is given twice; each share needs its own".into(),
                ));
            }
        }
        for (i, d) in self.disks.iter().enumerate() {
            let path = d.path.display().to_string();
            if self.disks[..i].iter().any(|o| o.path == d.path) {
                return Err(ConfigError::Disk {
                    path,
                    reason: format!(
                        "given twice (as {} and {})",
                        disk_name(self.disks.iter().position(|o| o.path == d.path).unwrap()),
                        disk_name(i)
                    ),
                });
            }
            if let Some(serial) = &d.serial {
                if serial.len() > 20 || !serial.bytes().all(|b| b.is_ascii_graphic()) {
                    return Err(ConfigError::Disk {
                        path,
                        reason: format!(
                            "serial={serial:?}: at most 20 printable ASCII characters are accepted"
                        ),
                    });
                }
            }
        }
        Ok(())
    }
}

fn check_readable_file(path: &std::path::Path) -> Result<(), String> {
    let meta = std::fs::metadata(path).map_err(io_reason)?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    std::fs::File::open(path).map_err(io_reason)?;
    Ok(())
}

fn io_reason(e: std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => "no such file".into(),
        std::io::ErrorKind::PermissionDenied => "permission denied (not readable)".into(),
        _ => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Any readable regular file stands in for a kernel here; the loader judges its format.
    fn exe() -> VmConfig {
        VmConfig::new(std::env::current_exe().unwrap())
    }

    #[test]
    fn disk_names_follow_linux() {
        assert_eq!(disk_name(0), "vda");
        assert_eq!(disk_name(25), "vdz");
        assert_eq!(disk_name(26), "vdaa");
        assert_eq!(disk_name(27), "vdab");
    }

    #[test]
    fn rejects_duplicate_disks_and_bad_serials() {
        let mut c = exe();
        c.disks = vec![DiskConfig::new("/tmp/a.img"), DiskConfig::new("/tmp/a.img")];
        assert_eq!(
            c.validate(None).unwrap_err().to_string(),
            "--disk /tmp/a.img: given twice (as vda and vdb)"
        );
        let mut d = DiskConfig::new("/tmp/a.img");
        d.serial = Some("x".repeat(21));
        c.disks = vec![d];
        assert!(c
            .validate(None)
            .unwrap_err()
            .to_string()
            .contains("at most 20 printable ASCII"));
        c.disks = (0..20)
            .map(|i| DiskConfig::new(format!("/tmp/{i}.img")))
            .collect();
        assert_eq!(
            c.validate(None),
            Err(ConfigError::TooManyDevices { given: 20, max: 19 })
        );
    }

    #[test]
    fn accepts_defaults() {
        exe().validate(Some(32)).unwrap();
    }

    #[test]
    fn rejects_zero_and_too_many_vcpus() {
        let mut c = exe();
        c.vcpus = 0;
        assert_eq!(
            c.validate(Some(4)),
            Err(ConfigError::Vcpus { given: 0, max: 4 })
        );
        c.vcpus = 5;
        let e = c.validate(Some(4)).unwrap_err();
        assert_eq!(e.to_string(), "--vcpus 5: must be between 1 and 4");
        c.vcpus = 255;
        assert_eq!(
            c.validate(None),
            Err(ConfigError::Vcpus {
                given: 255,
                max: 254
            })
        );
    }

    #[test]
    fn rejects_memory_out_of_range() {
        let mut c = exe();
        c.memory_mib = 4;
        assert!(c
            .validate(None)
            .unwrap_err()
            .to_string()
            .starts_with("--memory 4: must be between 8 and"));
        c.memory_mib = MAX_MEMORY_MIB + 1;
        assert!(matches!(c.validate(None), Err(ConfigError::Memory { .. })));
    }

    #[test]
    fn rejects_long_cmdline() {
        let mut c = exe();
        c.cmdline = "a".repeat(CMDLINE_MAX_SIZE);
        assert_eq!(
            c.validate(None).unwrap_err().to_string(),
            "--cmdline: 2048 bytes is too long, at most 2047 bytes are accepted"
        );
        c.cmdline = "a".repeat(CMDLINE_MAX_SIZE - 1);
        c.validate(None).unwrap();
    }

    #[test]
    fn rejects_control_characters_in_cmdline() {
        let mut c = exe();
        c.cmdline = "console=ttyS0\nfoo".into();
        assert!(matches!(c.validate(None), Err(ConfigError::Cmdline(_))));
    }

    #[test]
    fn rejects_missing_kernel_and_directories() {
        let mut c = exe();
        c.kernel = "/nonexistent/vmlinux".into();
        assert_eq!(
            c.validate(None).unwrap_err().to_string(),
            "--kernel /nonexistent/vmlinux: no such file"
        );
        c.kernel = "/tmp".into();
        assert_eq!(
            c.validate(None).unwrap_err().to_string(),
            "--kernel /tmp: not a regular file"
        );
        let mut c = exe();
        c.initrd = Some("/nonexistent/initrd".into());
        assert_eq!(
            c.validate(None).unwrap_err().to_string(),
            "--initrd /nonexistent/initrd: no such file"
        );
    }
}
