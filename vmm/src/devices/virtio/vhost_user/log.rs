//! The dirty log vhost-user backends write while a migration runs (VHOST_USER_SET_LOG_BASE
//! with the LOG_SHMFD protocol feature): one bit per 4 KiB page of guest-physical address
//! space, in a memfd every backend maps. A backend sets bits for the buffers it fills and the
//! used-ring entries it writes; the VMM takes and clears them pass by pass and ORs them into
//! its own dirty log, since KVM's log only sees what vCPUs write.

use std::fs::File;
use std::io::{IoSlice, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::memory::{DirtyLog, PAGE_SIZE};

/// `VHOST_LOG_PAGE`: the guest-physical span one bit of the log covers.
const LOG_PAGE: u64 = 0x1000;

/// A log covering guest-physical addresses below `end`, shared with the backends.
pub struct SharedDirtyLog {
    file: File,
    map: *mut AtomicU64,
    words: usize,
    map_len: usize,
}

// SAFETY: the mapping is only reached through atomics; the pointer is owned by this value.
unsafe impl Send for SharedDirtyLog {}
// SAFETY: as above: every access is an atomic operation.
unsafe impl Sync for SharedDirtyLog {}

impl SharedDirtyLog {
    /// A zeroed log for guest-physical addresses below `end`.
    pub fn new(end: u64) -> std::io::Result<SharedDirtyLog> {
        let pages = end.div_ceil(LOG_PAGE);
        let words = pages.div_ceil(64) as usize;
        let map_len = ((words * 8) as u64).div_ceil(PAGE_SIZE).max(1) as usize * PAGE_SIZE as usize;
        // SAFETY: a NUL-terminated name and valid flags.
        let fd = unsafe { libc::memfd_create(c"vhost-user-dirty-log".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a descriptor memfd_create just returned, owned from here on.
        let file = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        file.set_len(map_len as u64)?;
        // SAFETY: a fresh shared mapping of the whole memfd; unmapped in Drop.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(SharedDirtyLog {
            file,
            map: map.cast(),
            words,
            map_len,
        })
    }

    /// The size backends map.
    pub fn mapped_len(&self) -> u64 {
        self.map_len as u64
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        debug_assert!(i < self.words);
        // SAFETY: `i` is below `words`, inside the mapping, which lives as long as `self`.
        unsafe { &*self.map.add(i) }
    }

    /// Takes the pages logged since the last call, clearing them, into `into`.
    pub fn take_into(&self, into: &mut DirtyLog) {
        for i in 0..self.words {
            let w = self.word(i);
            // A cheap load first: most words stay zero, and a swap would dirty every
            // cache line of the log on every pass.
            if w.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut bits = w.swap(0, Ordering::AcqRel);
            while bits != 0 {
                let b = bits.trailing_zeros() as u64;
                bits &= bits - 1;
                into.mark(((i as u64) * 64 + b) * LOG_PAGE);
            }
        }
    }

    /// Sets the bit of `gpa` (as a backend would).
    #[cfg(test)]
    fn log(&self, gpa: u64) {
        let page = gpa / LOG_PAGE;
        self.word((page / 64) as usize)
            .fetch_or(1 << (page % 64), Ordering::SeqCst);
    }
}

impl AsFd for SharedDirtyLog {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

impl Drop for SharedDirtyLog {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, of that length.
        unsafe { libc::munmap(self.map.cast(), self.map_len) };
    }
}

/// `VHOST_USER_SET_LOG_BASE` with the log's memfd (protocol feature LOG_SHMFD), written by
/// hand on the frontend's socket: the vhost crate's version insists on a 16-byte reply, but
/// backends answer this message differently (libvhost-user — qemu-storage-daemon — with a
/// u64, DPDK with no payload; QEMU accepts either), so it would wait forever for bytes that
/// never come. The caller holds the device, so no other exchange is in flight on the socket.
pub fn set_log_base(socket: RawFd, log: &SharedDirtyLog) -> Result<(), String> {
    const SET_LOG_BASE: u32 = 6;
    const VERSION: u32 = 0x1;
    const REPLY: u32 = 0x4;
    let mut msg = Vec::with_capacity(28);
    msg.extend_from_slice(&SET_LOG_BASE.to_le_bytes());
    msg.extend_from_slice(&VERSION.to_le_bytes());
    msg.extend_from_slice(&16u32.to_le_bytes());
    msg.extend_from_slice(&log.mapped_len().to_le_bytes()); // mmap_size
    msg.extend_from_slice(&0u64.to_le_bytes()); // mmap_offset
    send_with_fd(socket, &msg, log.as_fd().as_raw_fd())
        .map_err(|e| format!("sending the dirty log: {e}"))?;
    // SAFETY: borrowed for the reads below only; the frontend owns the descriptor.
    let mut sock = std::mem::ManuallyDrop::new(unsafe {
        <std::os::unix::net::UnixStream as std::os::fd::FromRawFd>::from_raw_fd(socket)
    });
    let mut hdr = [0u8; 12];
    sock.read_exact(&mut hdr)
        .map_err(|e| format!("the backend did not acknowledge the dirty log: {e}"))?;
    let word = |i: usize| u32::from_le_bytes(hdr[i * 4..i * 4 + 4].try_into().unwrap());
    let (request, flags, size) = (word(0), word(1), word(2));
    if request != SET_LOG_BASE || flags & REPLY == 0 || size > 64 {
        return Err(format!(
            "the backend answered the dirty log with request {request}, flags {flags:#x}, {size} bytes"
        ));
    }
    let mut body = vec![0u8; size as usize];
    sock.read_exact(&mut body)
        .map_err(|e| format!("the backend's answer to the dirty log was cut short: {e}"))?;
    Ok(())
}

fn send_with_fd(socket: RawFd, bytes: &[u8], fd: RawFd) -> std::io::Result<()> {
    let iov = [IoSlice::new(bytes)];
    let mut cmsg = [0u8; 64];
    // SAFETY: CMSG_SPACE of one descriptor fits in 64 bytes; the header and data are written
    // through the libc helpers inside that buffer.
    unsafe {
        let space = libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) as usize;
        let mut mh: libc::msghdr = std::mem::zeroed();
        mh.msg_iov = iov.as_ptr() as *mut libc::iovec;
        mh.msg_iovlen = 1;
        mh.msg_control = cmsg.as_mut_ptr().cast();
        mh.msg_controllen = space as _;
        let c = libc::CMSG_FIRSTHDR(&mh);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd);
        let n = libc::sendmsg(socket, &mh, libc::MSG_NOSIGNAL);
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if n as usize != bytes.len() {
            return Err(std::io::Error::other("short write"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::DirtyRegion;

    #[test]
    fn logged_pages_land_in_their_regions_once() {
        let log = SharedDirtyLog::new(6 << 30).unwrap();
        assert!(log.mapped_len() >= (6u64 << 30) / LOG_PAGE / 8);
        for gpa in [0, 0x1000, 0x3f000, 5 << 30, (5 << 30) + 0x2345] {
            log.log(gpa);
        }
        let region = |guest_addr: u64, size: u64| DirtyRegion {
            guest_addr,
            size,
            bitmap: vec![0; (size / PAGE_SIZE).div_ceil(64) as usize],
        };
        let mut d = DirtyLog {
            regions: vec![region(0, 1 << 30), region(4 << 30, 2 << 30)],
        };
        log.take_into(&mut d);
        assert_eq!(
            d.pages().collect::<Vec<_>>(),
            vec![0, 0x1000, 0x3f000, 5 << 30, (5 << 30) + 0x2000]
        );
        let mut again = DirtyLog {
            regions: vec![region(0, 1 << 30)],
        };
        log.take_into(&mut again);
        assert_eq!(again.page_count(), 0, "taking clears the log");
    }
}
