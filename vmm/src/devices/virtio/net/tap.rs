//! TAP devices: opened by name from /dev/net/tun, or adopted from a file descriptor the
//! handler passes in. Always with a virtio-net header in front of every frame, so offloaded
//! (checksum-partial, GSO) frames pass through unchanged.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;

const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;
pub(crate) const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
pub(crate) const TUNGETIFF: libc::c_ulong = 0x8004_54d2;
pub(crate) const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54d0;
pub(crate) const TUNSETVNETHDRSZ: libc::c_ulong = 0x4004_54d8;
pub const TUN_F_CSUM: u32 = 0x01;
pub const TUN_F_TSO4: u32 = 0x02;
pub const TUN_F_TSO6: u32 = 0x04;
/// virtio_net_hdr_v1: the header size for VERSION_1 devices.
pub const VNET_HDR_LEN: usize = 12;

#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error(
        "tap {name}: no such TAP device (create it first, e.g. `ip tuntap add {name} mode tap`)"
    )]
    NotFound { name: String },
    #[error("tap {name}: busy (another process has it open)")]
    Busy { name: String },
    #[error("tap {name}: {reason}")]
    Other { name: String, reason: String },
}

pub struct Tap {
    file: File,
    pub name: String,
}

fn ifreq(name: &str, flags: libc::c_short) -> IfReq {
    let mut r = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags,
        _pad: [0; 22],
    };
    let n = name.len().min(libc::IFNAMSIZ - 1);
    r.name[..n].copy_from_slice(&name.as_bytes()[..n]);
    r
}

impl Tap {
    /// Creates a new TAP interface (with a virtio-net header) that lives as long as the returned
    /// descriptor: for front ends that wire the network themselves and hand the VM the fd.
    pub fn create(name: &str) -> Result<OwnedFd, TapError> {
        let other = |reason: String| TapError::Other {
            name: name.to_string(),
            reason,
        };
        if name.is_empty() || name.len() >= libc::IFNAMSIZ {
            return Err(other(format!(
                "interface names are 1 to {} characters",
                libc::IFNAMSIZ - 1
            )));
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open("/dev/net/tun")
            .map_err(|e| other(format!("/dev/net/tun: {e}")))?;
        let mut req = ifreq(name, IFF_TAP | IFF_NO_PI | IFF_VNET_HDR);
        // SAFETY: TUNSETIFF reads an ifreq we own.
        if unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, &mut req) } < 0 {
            return Err(other(format!("TUNSETIFF: {}", io::Error::last_os_error())));
        }
        Ok(file.into())
    }

    /// Attaches to an existing TAP interface. Refuses to create one: a name that does not exist
    /// is a configuration mistake, and an interface created here would not be wired anywhere.
    pub fn open(name: &str) -> Result<Tap, TapError> {
        let other = |reason: String| TapError::Other {
            name: name.to_string(),
            reason,
        };
        if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains('/') {
            return Err(other(format!(
                "interface names are 1 to {} characters without '/'",
                libc::IFNAMSIZ - 1
            )));
        }
        // if_nametoindex asks the calling thread's network namespace (sysfs would show the
        // namespace it was mounted in).
        let cname =
            std::ffi::CString::new(name).map_err(|_| other("contains a NUL byte".into()))?;
        // SAFETY: NUL-terminated string.
        if unsafe { libc::if_nametoindex(cname.as_ptr()) } == 0 {
            return Err(TapError::NotFound { name: name.into() });
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")
            .map_err(|e| other(format!("/dev/net/tun: {e}")))?;
        let mut req = ifreq(name, IFF_TAP | IFF_NO_PI | IFF_VNET_HDR);
        // SAFETY: TUNSETIFF reads an ifreq we own.
        if unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, &mut req) } < 0 {
            let e = io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::EBUSY) => TapError::Busy { name: name.into() },
                Some(libc::EINVAL) => {
                    other("exists but is not a TAP device (or lacks vnet_hdr support)".into())
                }
                _ => other(e.to_string()),
            });
        }
        let tap = Tap {
            file,
            name: name.into(),
        };
        tap.set_vnet_hdr_len()?;
        Ok(tap)
    }

    /// Adopts an open TAP file descriptor (e.g. handed over by virt-handler).
    pub fn from_fd(fd: OwnedFd) -> Result<Tap, TapError> {
        let file = File::from(fd);
        let mut req = ifreq("", 0);
        // SAFETY: TUNGETIFF fills an ifreq we own.
        if unsafe { libc::ioctl(file.as_raw_fd(), TUNGETIFF, &mut req) } < 0 {
            return Err(TapError::Other {
                name: format!("fd {}", file.as_raw_fd()),
                reason: "not a TUN/TAP file descriptor".into(),
            });
        }
        let len = req
            .name
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(req.name.len());
        let name = String::from_utf8_lossy(&req.name[..len]).into_owned();
        if req.flags & IFF_TAP == 0 || req.flags & IFF_VNET_HDR == 0 {
            return Err(TapError::Other {
                name,
                reason: "must be a TAP opened with IFF_VNET_HDR".into(),
            });
        }
        // SAFETY: F_GETFL/F_SETFL on our fd.
        unsafe {
            let fl = libc::fcntl(file.as_raw_fd(), libc::F_GETFL);
            libc::fcntl(file.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
        let tap = Tap { file, name };
        tap.set_vnet_hdr_len()?;
        Ok(tap)
    }

    fn set_vnet_hdr_len(&self) -> Result<(), TapError> {
        let len: libc::c_int = VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads one int.
        if unsafe { libc::ioctl(self.file.as_raw_fd(), TUNSETVNETHDRSZ, &len) } < 0 {
            return Err(TapError::Other {
                name: self.name.clone(),
                reason: format!("TUNSETVNETHDRSZ: {}", io::Error::last_os_error()),
            });
        }
        Ok(())
    }

    /// Which offloaded frames the kernel may hand us (those the guest said it can take).
    pub fn set_offload(&self, flags: u32) -> io::Result<()> {
        // SAFETY: TUNSETOFFLOAD takes the flags by value.
        if unsafe { libc::ioctl(self.file.as_raw_fd(), TUNSETOFFLOAD, flags as libc::c_ulong) } < 0
        {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    pub fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: reading into a buffer we own.
        let n = unsafe {
            libc::read(
                self.file.as_raw_fd(),
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    pub fn write(&self, buf: &[u8]) -> io::Result<usize> {
        // SAFETY: writing from a buffer we own.
        let n = unsafe {
            libc::write(
                self.file.as_raw_fd(),
                buf.as_ptr() as *const libc::c_void,
                buf.len(),
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }
}

impl Tap {
    /// Writes one frame gathered from `iovecs`.
    pub fn writev(&self, iovecs: &[libc::iovec]) -> io::Result<usize> {
        // SAFETY: the caller's iovecs point at memory that stays mapped for the call.
        let n = unsafe {
            libc::writev(
                self.file.as_raw_fd(),
                iovecs.as_ptr(),
                iovecs.len() as libc::c_int,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }
}

impl AsRawFd for Tap {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.file.as_raw_fd()
    }
}
