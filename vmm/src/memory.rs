//! Guest RAM and its KVM memory slots: who maps it (anonymous for a boot, `MAP_PRIVATE` of a
//! memory file for a restore), which slot each region is, and the dirty log that snapshot and
//! migration read (KVM's log of guest writes OR vm-memory's bitmap of the VMM's own writes).

use std::fs::File;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvm_bindings::{kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES};
use kvm_ioctls::VmFd;
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{
    FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, GuestRegionMmap,
    MemoryRegionAddress,
};

/// Guest RAM. The dirty bitmap tracks writes the VMM itself makes (device DMA), which KVM's
/// dirty log cannot see; the dirty log ORs both.
pub type GuestMemory = vm_memory::GuestMemoryMmap<AtomicBitmap>;

pub const PAGE_SIZE: u64 = 4096;

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("guest memory: {0}")]
    Map(String),
    #[error("KVM_SET_USER_MEMORY_REGION slot {slot}: {source}")]
    Slot {
        slot: u32,
        source: kvm_ioctls::Error,
    },
    #[error("KVM_GET_DIRTY_LOG slot {slot}: {source}")]
    DirtyLog {
        slot: u32,
        source: kvm_ioctls::Error,
    },
    #[error("KVM_CLEAR_DIRTY_LOG slot {slot}: {source}")]
    ClearDirtyLog { slot: u32, source: std::io::Error },
    #[error("memory file {path}: {source}")]
    File {
        path: String,
        source: std::io::Error,
    },
}

/// One RAM region as the state file records it: where the guest sees it and where its bytes
/// are in the memory file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RegionLayout {
    pub guest_addr: u64,
    pub size: u64,
    pub file_offset: u64,
}

/// The regions of `ram_regions`, laid end to end in a memory file.
pub fn file_layout(regions: &[(GuestAddress, usize)]) -> Vec<RegionLayout> {
    let mut off = 0;
    regions
        .iter()
        .map(|(a, s)| {
            let r = RegionLayout {
                guest_addr: a.0,
                size: *s as u64,
                file_offset: off,
            };
            off += *s as u64;
            r
        })
        .collect()
}

/// What writing a memory file cost and produced.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryFileStats {
    /// Size of the file as `ls` shows it (all of guest RAM).
    pub logical_bytes: u64,
    /// Bytes actually written (non-zero pages).
    pub written_bytes: u64,
}

/// Guest RAM plus the KVM slots it is registered as.
pub struct GuestRam {
    memory: GuestMemory,
    layout: Vec<RegionLayout>,
    /// Dirty logging on (slots carry KVM_MEM_LOG_DIRTY_PAGES).
    logging: AtomicBool,
    /// KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2 enabled on this VM: reading the log does not re-protect
    /// pages, KVM_CLEAR_DIRTY_LOG does (for only the pages read).
    manual_protect: bool,
    /// Anonymous memory (not a memory file): a page the kernel never backed reads as zero.
    anonymous: bool,
    /// Host ranges of anonymous RAM a boot mapped from kernel or initrd pages (see
    /// `boot::image`): the page map may show them unbacked (the page cache may drop a clean
    /// page), yet they hold the file's data.
    file_backed: Vec<std::ops::Range<usize>>,
}

fn map_err(e: impl std::fmt::Display) -> MemoryError {
    MemoryError::Map(e.to_string())
}

impl GuestRam {
    /// Anonymous RAM for a fresh boot.
    pub fn anonymous(regions: &[(GuestAddress, usize)]) -> Result<GuestRam, MemoryError> {
        let memory = GuestMemory::from_ranges(regions).map_err(map_err)?;
        Ok(GuestRam {
            memory,
            layout: file_layout(regions),
            logging: AtomicBool::new(false),
            manual_protect: false,
            anonymous: true,
            file_backed: Vec::new(),
        })
    }

    /// RAM other processes can map: one sealed `memfd` (its size can neither grow nor shrink,
    /// so a backend's mapping never loses its pages), each region mapped `MAP_SHARED` at its
    /// file offset. vhost-user backends get the descriptor and the offsets
    /// (`VHOST_USER_SET_MEM_TABLE`) and read and write the guest's buffers in place. Pages are
    /// allocated on first touch, as for anonymous RAM.
    ///
    /// With `huge`, the memfd is hugetlb and the mapping reserves its pages up front (no
    /// `MAP_NORESERVE`): a host without enough free huge pages fails here, with the count,
    /// rather than the guest dying of SIGBUS on a page the pool cannot give.
    pub fn shared(
        regions: &[(GuestAddress, usize)],
        huge: Option<crate::config::HugePageSize>,
    ) -> Result<GuestRam, MemoryError> {
        let layout = file_layout(regions);
        let file = sealed_memfd(file_end(&layout), huge).map_err(|source| MemoryError::File {
            path: "memfd guest-ram".into(),
            source,
        })?;
        let file = Arc::new(file);
        let flags = match huge {
            None => libc::MAP_SHARED | libc::MAP_NORESERVE,
            Some(_) => libc::MAP_SHARED,
        };
        let mut mapped = Vec::with_capacity(layout.len());
        for r in &layout {
            mapped.push(file_region(&file, r, flags).map_err(|e| match huge {
                Some(h) => MemoryError::Map(format!(
                    "{} bytes of guest RAM on {} huge pages: {e}; {}",
                    r.size,
                    h.label(),
                    huge_pages_free(h)
                )),
                None => e,
            })?);
        }
        let memory = GuestMemory::from_regions(mapped).map_err(map_err)?;
        Ok(GuestRam {
            memory,
            layout,
            logging: AtomicBool::new(false),
            manual_protect: false,
            anonymous: false,
            file_backed: Vec::new(),
        })
    }

    /// True when another process can map this RAM (`shared`): every region has a file.
    pub fn is_shared(&self) -> bool {
        self.memory
            .iter()
            .all(|r| r.file_offset().is_some() && r.flags() & libc::MAP_SHARED != 0)
    }

    /// RAM mapped `MAP_PRIVATE` from a memory file: pages are read from the file when the guest
    /// first touches them and copied on its first write, so this costs the same for any size and
    /// never writes to the file.
    /// With `seal`, the file must end with it (it was written with this snapshot's state).
    pub fn from_file(
        path: &Path,
        layout: &[RegionLayout],
        seal: Option<&crate::persist::files::MemorySeal>,
    ) -> Result<GuestRam, MemoryError> {
        let file_err = |source| MemoryError::File {
            path: path.display().to_string(),
            source,
        };
        let file = Arc::new(File::open(path).map_err(file_err)?);
        let len = file.metadata().map_err(file_err)?.len();
        let mut regions = Vec::with_capacity(layout.len());
        for r in layout {
            let end = r.file_offset.checked_add(r.size);
            if end.is_none_or(|e| e > len) {
                return Err(file_err(std::io::Error::other(format!(
                    "is {len} bytes, too short for guest RAM at {:#x} ({} bytes at file offset {})",
                    r.guest_addr, r.size, r.file_offset
                ))));
            }
            regions.push(file_region(
                &file,
                r,
                libc::MAP_PRIVATE | libc::MAP_NORESERVE,
            )?);
        }
        // After the length checks, so a short file is reported as short.
        if let Some(seal) = seal {
            use std::os::unix::fs::FileExt;
            let mut found = [0u8; 16];
            let at = file_end(layout);
            if file.read_exact_at(&mut found, at).is_err() || &found != seal {
                return Err(file_err(std::io::Error::other(
                    "belongs to another snapshot than the state file (their seals differ): refusing to pair them",
                )));
            }
        }
        let memory = GuestMemory::from_regions(regions).map_err(map_err)?;
        Ok(GuestRam {
            memory,
            layout: layout.to_vec(),
            logging: AtomicBool::new(false),
            manual_protect: false,
            anonymous: false,
            file_backed: Vec::new(),
        })
    }

    pub fn memory(&self) -> &GuestMemory {
        &self.memory
    }

    /// Copies `from`'s non-zero pages into this RAM of the same layout (a snapshot's privately
    /// mapped memory file into RAM a vhost-user backend can share; zero pages are skipped, so
    /// they stay unallocated here too).
    pub fn fill_from(&self, from: &GuestRam) -> Result<(), MemoryError> {
        if self.layout.len() != from.layout.len()
            || self
                .layout
                .iter()
                .zip(&from.layout)
                .any(|(a, b)| a.guest_addr != b.guest_addr || a.size != b.size)
        {
            return Err(map_err("the memory layouts differ"));
        }
        let mut page = vec![0u8; PAGE_SIZE as usize];
        for r in &self.layout {
            for off in (0..r.size).step_by(PAGE_SIZE as usize) {
                let at = GuestAddress(r.guest_addr + off);
                vm_memory::Bytes::read_slice(&from.memory, &mut page, at)
                    .map_err(|e| map_err(e.to_string()))?;
                if page.iter().any(|&b| b != 0) {
                    vm_memory::Bytes::write_slice(&self.memory, &page, at)
                        .map_err(|e| map_err(e.to_string()))?;
                }
            }
        }
        Ok(())
    }

    /// True for anonymous RAM, where `Unbacked` may skip pages the kernel never backed.
    pub fn is_anonymous(&self) -> bool {
        self.anonymous
    }

    /// Records runs a boot mapped from files into this (anonymous) RAM.
    pub fn note_file_backed(&mut self, runs: &[crate::boot::image::MappedRun]) {
        self.file_backed
            .extend(runs.iter().map(|r| r.host..r.host + r.len));
    }

    /// True when the page at host address `host` holds a file's data (it may look unbacked).
    pub fn is_file_backed(&self, host: usize) -> bool {
        self.file_backed.iter().any(|r| r.contains(&host))
    }

    /// Every non-zero page of RAM (guest-physical addresses, ascending), found lazily so a
    /// caller can act on pages while the scan goes on (a migration's link never falls silent
    /// during a large guest's scan). Pages of anonymous RAM the kernel never backed are skipped
    /// without being read, unless a boot mapped them from a file.
    ///
    /// The guest may write pages concurrently; a caller that needs them stable logs dirty pages
    /// and looks again.
    pub fn nonzero_pages(&self) -> impl Iterator<Item = u64> + '_ {
        self.maybe_backed_pages().filter_map(|(gpa, at)| {
            // SAFETY: `at` is a page of a region mapped for the lifetime of `self`.
            let page = unsafe { std::slice::from_raw_parts(at as *const u8, PAGE_SIZE as usize) };
            (!is_zero(page)).then_some(gpa)
        })
    }

    /// Runs `(gpa, pages)` of the pages the kernel has backed (or a boot mapped from a file):
    /// a superset of what `nonzero_pages` yields, found from the page map alone, without
    /// reading guest memory. Empty when RAM is not anonymous (shared or huge-page RAM, whose
    /// page map says nothing useful here) or the page map cannot be read, as every page would
    /// then count.
    pub fn backed_runs(&self) -> Vec<(u64, u32)> {
        let mut runs: Vec<(u64, u32)> = Vec::new();
        let readable = self.memory.iter().all(|region| {
            region
                .get_host_address(MemoryRegionAddress(0))
                .is_ok_and(|host| Unbacked::new(host).is_some())
        });
        if !self.anonymous || !readable {
            return runs;
        }
        for (gpa, _) in self.maybe_backed_pages() {
            match runs.last_mut() {
                Some((s, n)) if *s + *n as u64 * PAGE_SIZE == gpa && *n < u32::MAX => *n += 1,
                _ => runs.push((gpa, 1)),
            }
        }
        runs
    }

    /// `(gpa, host address)` of every page of RAM, ascending, except those of anonymous RAM
    /// the page map says were never backed (and a boot did not map from a file).
    fn maybe_backed_pages(&self) -> impl Iterator<Item = (u64, usize)> + '_ {
        self.memory.iter().flat_map(move |region| {
            let (host, len) = match region.get_host_address(MemoryRegionAddress(0)) {
                Ok(h) => (h as *const u8, region.len()),
                Err(_) => (std::ptr::null(), 0),
            };
            let start = region.start_addr().0;
            let mut unbacked = self.anonymous.then(|| Unbacked::new(host)).flatten();
            (0..len / PAGE_SIZE).filter_map(move |i| {
                let at = host as usize + (i * PAGE_SIZE) as usize;
                if !self.is_file_backed(at) && unbacked.as_mut().is_some_and(|u| u.is_unbacked(i)) {
                    return None;
                }
                Some((start + i * PAGE_SIZE, at))
            })
        })
    }

    pub fn layout(&self) -> &[RegionLayout] {
        &self.layout
    }

    pub fn size(&self) -> u64 {
        self.layout.iter().map(|r| r.size).sum()
    }

    /// Turns on manual dirty-log protection when KVM has it (must precede any dirty logging).
    pub fn use_manual_protect(&mut self, vm_fd: &VmFd) {
        const KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE: u64 = 1;
        let cap = kvm_bindings::KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2;
        let supported = vm_fd.check_extension_raw(cap as libc::c_ulong) as u64;
        if supported & KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE == 0 {
            return;
        }
        let mut enable = kvm_bindings::kvm_enable_cap {
            cap,
            ..Default::default()
        };
        enable.args[0] = KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE;
        match vm_fd.enable_cap(&enable) {
            Ok(()) => self.manual_protect = true,
            Err(e) => tracing::debug!("KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2: {e}"),
        }
    }

    /// Registers (or re-registers with new flags) every region as KVM slot = its index.
    /// The KVM memory slots that describe this RAM (one per region), with or without dirty
    /// logging.
    fn slot_regions(
        &self,
        log_dirty: bool,
    ) -> Result<Vec<kvm_userspace_memory_region>, MemoryError> {
        self.memory
            .iter()
            .enumerate()
            .map(|(slot, region)| {
                let host = region
                    .get_host_address(MemoryRegionAddress(0))
                    .map_err(map_err)?;
                Ok(kvm_userspace_memory_region {
                    slot: slot as u32,
                    flags: if log_dirty {
                        KVM_MEM_LOG_DIRTY_PAGES
                    } else {
                        0
                    },
                    guest_phys_addr: region.start_addr().0,
                    memory_size: region.len(),
                    userspace_addr: host as u64,
                })
            })
            .collect()
    }

    fn set_slots(&self, vm_fd: &VmFd, log_dirty: bool) -> Result<(), MemoryError> {
        set_slot_regions(vm_fd, &self.slot_regions(log_dirty)?)
    }

    /// What `register` would tell KVM, to be told from another thread (`set_slot_regions`)
    /// while this RAM is filled.
    pub fn registration(&self) -> Result<Vec<kvm_userspace_memory_region>, MemoryError> {
        self.slot_regions(self.logging.load(Ordering::SeqCst))
    }

    pub fn register(&self, vm_fd: &VmFd) -> Result<(), MemoryError> {
        self.set_slots(vm_fd, self.logging.load(Ordering::SeqCst))
    }

    /// Starts dirty logging: from now on every guest write is logged. Clears what the VMM's own
    /// bitmap collected before, so the first `dirty_log` reports writes since this call.
    pub fn start_dirty_log(&self, vm_fd: &VmFd) -> Result<(), MemoryError> {
        self.set_slots(vm_fd, true)?;
        self.logging.store(true, Ordering::SeqCst);
        for region in self.memory.iter() {
            own_bitmap(region).reset();
        }
        Ok(())
    }

    /// Stops dirty logging and restores the slots to how they were.
    pub fn stop_dirty_log(&self, vm_fd: &VmFd) -> Result<(), MemoryError> {
        self.logging.store(false, Ordering::SeqCst);
        self.set_slots(vm_fd, false)
    }

    pub fn is_logging(&self) -> bool {
        self.logging.load(Ordering::SeqCst)
    }

    /// The pages written since dirty logging started or since the last call, by the guest
    /// (KVM's log) or by the VMM (vm-memory's bitmap); reading resets both.
    pub fn dirty_log(&self, vm_fd: &VmFd) -> Result<DirtyLog, MemoryError> {
        let mut regions = Vec::with_capacity(self.layout.len());
        for (slot, (region, r)) in self.memory.iter().zip(&self.layout).enumerate() {
            let slot = slot as u32;
            let mut bits = vm_fd
                .get_dirty_log(slot, r.size as usize)
                .map_err(|source| MemoryError::DirtyLog { slot, source })?;
            if self.manual_protect {
                clear_dirty_log(vm_fd, slot, &bits, r.size / PAGE_SIZE)
                    .map_err(|source| MemoryError::ClearDirtyLog { slot, source })?;
            }
            let own = own_bitmap(region).get_and_reset();
            for (b, o) in bits.iter_mut().zip(own) {
                *b |= o;
            }
            regions.push(DirtyRegion {
                guest_addr: r.guest_addr,
                size: r.size,
                bitmap: bits,
            });
        }
        Ok(DirtyLog { regions })
    }

    /// Writes all of RAM to `path` in the file layout, sparsely: zero pages are holes, never
    /// written. `path` is created anew (never an existing mapped file rewritten in place).
    /// `seal` follows the RAM (see `persist::MemorySeal`); the file is created 0600.
    pub fn write_file(
        &self,
        path: &Path,
        seal: &crate::persist::files::MemorySeal,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<MemoryFileStats, MemoryError> {
        let err = |source| MemoryError::File {
            path: path.display().to_string(),
            source,
        };
        let file = crate::persist::files::create_private(path).map_err(err)?;
        let total = self.size();
        file.set_len(total).map_err(err)?;
        {
            use std::os::unix::fs::FileExt;
            file.write_all_at(seal, file_end(&self.layout))
                .map_err(err)?;
        }
        let mut written = 0;
        // Progress in chunks, so a caller can show how far a large guest got.
        const CHUNK: usize = 256 << 20;
        let mut done = 0;
        for (region, r) in self.memory.iter().zip(&self.layout) {
            let host = region
                .get_host_address(MemoryRegionAddress(0))
                .map_err(map_err)?;
            // SAFETY: the region maps `r.size` bytes at `host` for the lifetime of `self`; the
            // VM is paused, so nothing writes them while we read.
            let bytes = unsafe { std::slice::from_raw_parts(host as *const u8, r.size as usize) };
            for (i, chunk) in bytes.chunks(CHUNK).enumerate() {
                let at = r.file_offset + (i * CHUNK) as u64;
                written += write_nonzero_runs(&file, chunk, at).map_err(err)?;
                done += chunk.len() as u64;
                progress(done, total);
            }
        }
        file.sync_all().map_err(err)?;
        Ok(MemoryFileStats {
            logical_bytes: total,
            written_bytes: written,
        })
    }
}

/// A memfd of `len` bytes sealed against growing and shrinking (`F_SEAL_SEAL` last, so the
/// seals themselves cannot change). Written by hand: vm-memory maps files but does not create
/// them, and memfd_create is one system call.
fn sealed_memfd(len: u64, huge: Option<crate::config::HugePageSize>) -> std::io::Result<File> {
    use std::os::fd::FromRawFd;
    let name = c"microvirt-guest-ram";
    let mut flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    flags |= match huge {
        None => 0,
        Some(crate::config::HugePageSize::Size2M) => libc::MFD_HUGETLB | libc::MFD_HUGE_2MB,
        Some(crate::config::HugePageSize::Size1G) => libc::MFD_HUGETLB | libc::MFD_HUGE_1GB,
    };
    // SAFETY: a valid NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nothing else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(len)?;
    let seals = libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on a descriptor we own.
    if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file)
}

/// Region `r` of guest RAM mapped from `file` at its file offset with mmap `flags`, with a
/// bitmap of the VMM's own writes.
fn file_region(
    file: &Arc<File>,
    r: &RegionLayout,
    flags: i32,
) -> Result<GuestRegionMmap<AtomicBitmap>, MemoryError> {
    let size = r.size as usize;
    let page = std::num::NonZeroUsize::new(PAGE_SIZE as usize).unwrap();
    let mapping = MmapRegionBuilder::new_with_bitmap(size, AtomicBitmap::new(size, page))
        .with_file_offset(FileOffset::from_arc(file.clone(), r.file_offset))
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(flags)
        .build()
        .map_err(map_err)?;
    GuestRegionMmap::new(mapping, GuestAddress(r.guest_addr))
        .ok_or_else(|| map_err("region wraps the address space"))
}

/// What the host's pool of `size` pages has free, for an error message.
fn huge_pages_free(size: crate::config::HugePageSize) -> String {
    let kb = size.bytes() >> 10;
    let dir = format!("/sys/kernel/mm/hugepages/hugepages-{kb}kB");
    let read = |f: &str| {
        std::fs::read_to_string(format!("{dir}/{f}"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
    };
    match (read("free_hugepages"), read("resv_hugepages")) {
        (Some(free), Some(resv)) => format!(
            "the host has {} of them free (reserve more in {dir}/nr_hugepages)",
            free.saturating_sub(resv)
        ),
        _ => format!("the host has no {} huge page pool ({dir})", size.label()),
    }
}

/// The region's whole bitmap (vm-memory's `bitmap()` on a region gives a slice view).
fn own_bitmap(region: &GuestRegionMmap<AtomicBitmap>) -> &AtomicBitmap {
    let mapping: &vm_memory::mmap::MmapRegion<AtomicBitmap> = region;
    mapping.bitmap()
}

/// Writes the non-zero pages of `bytes` at `base` (+ their offset); returns bytes written.
fn write_nonzero_runs(file: &File, bytes: &[u8], base: u64) -> std::io::Result<u64> {
    use std::os::unix::fs::FileExt;
    let page = PAGE_SIZE as usize;
    let mut written = 0u64;
    let mut run_start: Option<usize> = None;
    let mut flush = |start: usize, end: usize| -> std::io::Result<()> {
        file.write_all_at(&bytes[start..end], base + start as u64)?;
        written += (end - start) as u64;
        Ok(())
    };
    let mut off = 0;
    while off < bytes.len() {
        let end = (off + page).min(bytes.len());
        let zero = is_zero(&bytes[off..end]);
        match (zero, run_start) {
            (false, None) => run_start = Some(off),
            (true, Some(s)) => {
                flush(s, off)?;
                run_start = None;
            }
            _ => {}
        }
        // Runs are capped so one write never needs more than 64 MiB at a time.
        if let Some(s) = run_start {
            if end - s >= 64 << 20 {
                flush(s, end)?;
                run_start = None;
            }
        }
        off = end;
    }
    if let Some(s) = run_start {
        flush(s, bytes.len())?;
    }
    Ok(written)
}

/// Which pages of an anonymous mapping the kernel has never backed — neither present nor
/// swapped out, so they read as zero — from `/proc/self/pagemap` (8 bytes per page; the flags
/// need no privilege). Scanning a large, mostly untouched guest for its non-zero pages then
/// costs a read of its page map instead of a page fault for every page. Hand-written: no crate
/// wraps pagemap for one's own process without pulling in a process-inspection library.
pub(crate) struct Unbacked {
    pagemap: std::fs::File,
    host: usize,
    first: u64,
    entries: Vec<u64>,
}

impl Unbacked {
    /// Pages read from the page map at a time (256 KiB of entries).
    const CHUNK: u64 = 32 * 1024;

    /// For the mapping at `host` (page-aligned); None when the page map cannot be read.
    pub(crate) fn new(host: *const u8) -> Option<Unbacked> {
        let pagemap = std::fs::File::open("/proc/self/pagemap").ok()?;
        Some(Unbacked {
            pagemap,
            host: host as usize,
            first: u64::MAX,
            entries: Vec::new(),
        })
    }

    /// True when page `i` of the mapping was never backed; false when it was or when unsure.
    pub(crate) fn is_unbacked(&mut self, i: u64) -> bool {
        use std::os::unix::fs::FileExt;
        let first = i - i % Self::CHUNK;
        if first != self.first {
            self.first = first;
            self.entries.clear();
            let mut buf = vec![0u8; (Self::CHUNK * 8) as usize];
            let at = (self.host as u64 / PAGE_SIZE + first) * 8;
            // A short read (the end of the mapping's range) leaves fewer entries: unsure.
            if let Ok(n) = self.pagemap.read_at(&mut buf, at) {
                self.entries = buf[..n - n % 8]
                    .chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                    .collect();
            }
        }
        const PRESENT: u64 = 1 << 63;
        const SWAPPED: u64 = 1 << 62;
        self.entries
            .get((i - first) as usize)
            .is_some_and(|e| e & (PRESENT | SWAPPED) == 0)
    }
}

pub(crate) fn is_zero(b: &[u8]) -> bool {
    // SAFETY: u64 has no invalid bit patterns; align_to only reinterprets the aligned middle.
    let (head, mid, tail) = unsafe { b.align_to::<u64>() };
    head.iter().all(|&x| x == 0) && mid.iter().all(|&x| x == 0) && tail.iter().all(|&x| x == 0)
}

/// KVM_CLEAR_DIRTY_LOG: written here because kvm-ioctls 0.25 has no wrapper for it.
fn clear_dirty_log(vm_fd: &VmFd, slot: u32, bits: &[u64], pages: u64) -> std::io::Result<()> {
    vmm_sys_util::ioctl_iowr_nr!(
        KVM_CLEAR_DIRTY_LOG,
        kvm_bindings::KVMIO,
        0xc0,
        kvm_bindings::kvm_clear_dirty_log
    );
    if pages == 0 {
        return Ok(());
    }
    // The kernel wants num_pages a multiple of 64 unless the range ends at the slot's end.
    let mut copy = bits.to_vec();
    let arg = kvm_bindings::kvm_clear_dirty_log {
        slot,
        num_pages: pages as u32,
        first_page: 0,
        __bindgen_anon_1: kvm_bindings::kvm_clear_dirty_log__bindgen_ty_1 {
            dirty_bitmap: copy.as_mut_ptr() as *mut libc::c_void,
        },
    };
    // SAFETY: a VM fd, a correctly sized kvm_clear_dirty_log whose bitmap covers `pages` bits.
    let r = unsafe { vmm_sys_util::ioctl::ioctl_with_ref(vm_fd, KVM_CLEAR_DIRTY_LOG(), &arg) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Dirty pages of one RAM region: bit i of the bitmap is the page at guest_addr + i * 4 KiB.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirtyRegion {
    pub guest_addr: u64,
    pub size: u64,
    pub bitmap: Vec<u64>,
}

/// The set of guest pages written in an interval.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DirtyLog {
    pub regions: Vec<DirtyRegion>,
}

impl DirtyLog {
    pub fn page_count(&self) -> u64 {
        self.regions
            .iter()
            .flat_map(|r| &r.bitmap)
            .map(|w| w.count_ones() as u64)
            .sum()
    }

    pub fn contains(&self, gpa: u64) -> bool {
        self.regions.iter().any(|r| {
            gpa >= r.guest_addr && gpa - r.guest_addr < r.size && {
                let page = ((gpa - r.guest_addr) / PAGE_SIZE) as usize;
                r.bitmap
                    .get(page / 64)
                    .is_some_and(|w| w & (1 << (page % 64)) != 0)
            }
        })
    }

    /// Marks the page holding `gpa` dirty (a write someone else logged); an address outside
    /// every region is ignored.
    pub fn mark(&mut self, gpa: u64) {
        if let Some(r) = self
            .regions
            .iter_mut()
            .find(|r| gpa >= r.guest_addr && gpa - r.guest_addr < r.size)
        {
            let page = ((gpa - r.guest_addr) / PAGE_SIZE) as usize;
            if let Some(w) = r.bitmap.get_mut(page / 64) {
                *w |= 1 << (page % 64);
            }
        }
    }

    /// Guest-physical addresses of the dirty pages, in order.
    pub fn pages(&self) -> impl Iterator<Item = u64> + '_ {
        self.regions.iter().flat_map(|r| {
            r.bitmap.iter().enumerate().flat_map(move |(i, &w)| {
                (0..64)
                    .filter(move |b| w & (1u64 << b) != 0)
                    .map(move |b| r.guest_addr + (i as u64 * 64 + b) * PAGE_SIZE)
                    .filter(move |&a| a < r.guest_addr + r.size)
            })
        })
    }
}

/// Registers memory slots with KVM. The mappings they name must outlive the VM's use of them:
/// the `Vm` owns both its RAM and its VM fd and joins the vCPU threads before dropping RAM.
pub fn set_slot_regions(
    vm_fd: &VmFd,
    regions: &[kvm_userspace_memory_region],
) -> Result<(), MemoryError> {
    for r in regions {
        // SAFETY: see above; `r` names a mapping of this process's guest RAM.
        unsafe { vm_fd.set_user_memory_region(*r) }.map_err(|source| MemoryError::Slot {
            slot: r.slot,
            source,
        })?;
    }
    Ok(())
}

/// Where guest RAM ends in the memory file: the seal goes there.
fn file_end(layout: &[RegionLayout]) -> u64 {
    layout
        .iter()
        .map(|r| r.file_offset.saturating_add(r.size))
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unbacked_pages_are_the_ones_never_written() {
        let ram = GuestRam::anonymous(&[(GuestAddress(0), 256 << 20)]).unwrap();
        let host = ram.memory().get_host_address(GuestAddress(0)).unwrap() as *const u8;
        let written = [0u64, 5, 40_000, 65_535];
        for page in written {
            ram.memory()
                .write_obj(1u8, GuestAddress(page * PAGE_SIZE))
                .unwrap();
        }
        let mut u = Unbacked::new(host).unwrap();
        for page in written {
            assert!(!u.is_unbacked(page), "page {page} was written");
        }
        // Either side of each, in both page-map chunks.
        for page in [1u64, 4, 6, 39_999, 40_001, 65_534] {
            assert!(u.is_unbacked(page), "page {page} was never written");
        }
        assert!(ram.is_anonymous());
        // Backed runs: each written page, alone, and nothing else.
        let runs = ram.backed_runs();
        assert_eq!(
            runs,
            written
                .iter()
                .map(|p| (p * PAGE_SIZE, 1))
                .collect::<Vec<_>>()
        );
        ram.memory()
            .write_slice(&[1u8; 3 * PAGE_SIZE as usize], GuestAddress(6 * PAGE_SIZE))
            .unwrap();
        assert_eq!(ram.backed_runs()[1], (5 * PAGE_SIZE, 4));
    }
    use vm_memory::Bytes;

    /// Kernel pages a boot mapped from the file and the guest never touched are absent from
    /// the page map; the scan a migration sends must still find them, or the target would
    /// run a kernel with holes.
    #[test]
    fn pages_mapped_from_a_file_are_found_though_never_touched() {
        use std::io::Write;
        let path = std::env::temp_dir().join(format!("mv-ram-mapped-{}", std::process::id()));
        let data: Vec<u8> = (0..64 * 1024).map(|i| (i % 251) as u8 + 1).collect();
        std::fs::File::create(&path)
            .unwrap()
            .write_all(&data)
            .unwrap();
        let mut ram = GuestRam::anonymous(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let mut image =
            crate::boot::image::ImageFile::new(std::fs::File::open(&path).unwrap(), true);
        std::fs::remove_file(&path).unwrap();
        ram.memory()
            .read_exact_volatile_from(GuestAddress(0x40000), &mut image, data.len())
            .unwrap();
        let runs = image.into_mapped();
        assert_eq!(runs.len(), 1);
        let expected: Vec<u64> = (0..16).map(|p| 0x40000 + p * PAGE_SIZE).collect();
        let seen_unnoted: Vec<u64> = ram.nonzero_pages().collect();
        assert!(
            seen_unnoted.is_empty(),
            "untouched file pages look unbacked to the page map: {seen_unnoted:x?}"
        );
        ram.note_file_backed(&runs);
        assert_eq!(ram.nonzero_pages().collect::<Vec<_>>(), expected);
    }

    #[test]
    fn memory_file_is_sparse_and_maps_back_privately() {
        let regions = [(GuestAddress(0), 4 << 20), (GuestAddress(1 << 30), 2 << 20)];
        let ram = GuestRam::anonymous(&regions).unwrap();
        let m = ram.memory();
        m.write_obj(0xdead_beefu64, GuestAddress(0x1000)).unwrap();
        m.write_obj(0x1234u32, GuestAddress((1 << 30) + 0x1f_fffc))
            .unwrap();
        let path = std::env::temp_dir().join(format!("mv-memfile-{}", std::process::id()));
        let seal = [5u8; 16];
        let stats = ram.write_file(&path, &seal, &mut |_, _| {}).unwrap();
        assert_eq!(stats.logical_bytes, 6 << 20);
        assert_eq!(stats.written_bytes, 2 * PAGE_SIZE, "only non-zero pages");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(
            mode & 0o777,
            0o600,
            "guest RAM is readable by its owner only"
        );
        let back = GuestRam::from_file(&path, ram.layout(), Some(&seal)).unwrap();
        let bm = back.memory();
        assert_eq!(
            bm.read_obj::<u64>(GuestAddress(0x1000)).unwrap(),
            0xdead_beef
        );
        assert_eq!(
            bm.read_obj::<u32>(GuestAddress((1 << 30) + 0x1f_fffc))
                .unwrap(),
            0x1234
        );
        // Private: writing the restored RAM leaves the file as it was.
        bm.write_obj(7u64, GuestAddress(0x1000)).unwrap();
        let again = GuestRam::from_file(&path, ram.layout(), Some(&seal)).unwrap();
        // Another snapshot's seal: refused.
        let e = GuestRam::from_file(&path, ram.layout(), Some(&[6u8; 16]))
            .err()
            .unwrap();
        assert!(e.to_string().contains("belongs to another snapshot"), "{e}");
        assert_eq!(
            again
                .memory()
                .read_obj::<u64>(GuestAddress(0x1000))
                .unwrap(),
            0xdead_beef
        );
        // A file shorter than the layout is refused.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(5 << 20)
            .unwrap();
        let e = GuestRam::from_file(&path, ram.layout(), None)
            .err()
            .unwrap();
        assert!(e.to_string().contains("too short"), "{e}");
        std::fs::remove_file(path).unwrap();
    }

    /// Writes the VMM makes (device DMA) never reach KVM's log; the dirty log must still report
    /// them, once.
    #[test]
    fn dirty_log_includes_the_vmms_own_writes() {
        let kvm = kvm_ioctls::Kvm::new().expect("this test needs /dev/kvm");
        let vm = kvm.create_vm().unwrap();
        let mut ram = GuestRam::anonymous(&[(GuestAddress(0), 8 << 20)]).unwrap();
        ram.use_manual_protect(&vm);
        ram.register(&vm).unwrap();
        ram.memory().write_obj(1u8, GuestAddress(0x5000)).unwrap();
        ram.start_dirty_log(&vm).unwrap();
        assert_eq!(
            ram.dirty_log(&vm).unwrap().page_count(),
            0,
            "writes before logging do not count"
        );
        ram.memory()
            .write_obj(2u64, GuestAddress(0x3_0008))
            .unwrap();
        ram.memory()
            .write_slice(&[3u8; 8192], GuestAddress(0x7f_e000))
            .unwrap();
        let log = ram.dirty_log(&vm).unwrap();
        let pages: Vec<u64> = log.pages().collect();
        assert_eq!(pages, vec![0x3_0000, 0x7f_e000, 0x7f_f000]);
        assert_eq!(
            ram.dirty_log(&vm).unwrap().page_count(),
            0,
            "reading resets"
        );
        ram.stop_dirty_log(&vm).unwrap();
        assert!(!ram.is_logging());
    }

    #[test]
    fn dirty_log_page_iteration() {
        let log = DirtyLog {
            regions: vec![DirtyRegion {
                guest_addr: 0x10_0000,
                size: 70 * PAGE_SIZE,
                bitmap: vec![0b101, 1 << 5],
            }],
        };
        assert_eq!(log.page_count(), 3);
        let pages: Vec<u64> = log.pages().collect();
        assert_eq!(
            pages,
            vec![0x10_0000, 0x10_2000, 0x10_0000 + 69 * PAGE_SIZE]
        );
        assert!(log.contains(0x10_2fff));
        assert!(!log.contains(0x10_1000));
    }
}
