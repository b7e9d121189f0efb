//! Loading a kernel (ELF `vmlinux` or bzImage) and an initrd with linux-loader, and writing the
//! boot information the kernel reads: the Linux zero page or the PVH start_info, each with the
//! e820 map and the command line, plus the MP table.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};

use std::path::Path;

use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::{boot_params, setup_header};
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use linux_loader::loader::elf::PvhBootCapability;
use linux_loader::loader::{self, BzImage, Cmdline, Elf, KernelLoader};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory, GuestMemoryBackend};

pub mod image;

use crate::arch::regs::EntryMode;
use crate::config::ConfigError;
use crate::layout::*;

const XEN_HVM_START_MAGIC: u32 = 0x336e_c578;
const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448; // "HdrS"
/// "Undefined" boot loader ID; Linux accepts it for loaders without an assigned ID.
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT_BYTES: u32 = 0x0100_0000;
/// Default highest initrd address for kernels whose header does not say (boot protocol < 2.03).
const DEFAULT_INITRD_ADDR_MAX: u64 = 0x37ff_ffff;
const PAGE_SIZE: u64 = 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelFormat {
    Elf,
    BzImage,
}

/// Where the kernel wants to go, known before any memory is allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelExtent {
    pub format: KernelFormat,
    /// One past the highest guest-physical byte the kernel occupies once loaded.
    pub end: u64,
}

/// Identifies the kernel format and how much memory it needs, so that a wrong file or a too
/// small guest is a configuration error, not a loader failure halfway through.
pub fn inspect_kernel(path: &Path) -> Result<KernelExtent, ConfigError> {
    let err = |reason: String| ConfigError::Kernel {
        path: path.display().to_string(),
        reason,
    };
    let mut f = File::open(path).map_err(|e| err(e.to_string()))?;
    let mut head = vec![0u8; 0x280];
    let n = read_up_to(&mut f, &mut head).map_err(|e| err(e.to_string()))?;
    head.truncate(n);
    if head.starts_with(b"\x7fELF") {
        if head.len() < 64
            || head[4] != 2
            || head[5] != 1
            || u16::from_le_bytes([head[18], head[19]]) != 62
        {
            return Err(err(
                "ELF file is not a little-endian ELF64 x86_64 image".into()
            ));
        }
        let phoff = u64::from_le_bytes(head[32..40].try_into().unwrap());
        let phentsize = u16::from_le_bytes([head[54], head[55]]) as u64;
        let phnum = u16::from_le_bytes([head[56], head[57]]) as u64;
        if phentsize < 56 || phnum == 0 || phnum > 512 {
            return Err(err("ELF program headers are missing or malformed".into()));
        }
        let mut end = 0u64;
        for i in 0..phnum {
            let mut ph = [0u8; 56];
            f.seek(SeekFrom::Start(phoff + i * phentsize))
                .map_err(|e| err(e.to_string()))?;
            f.read_exact(&mut ph)
                .map_err(|_| err("ELF program header table is truncated".into()))?;
            if u32::from_le_bytes(ph[0..4].try_into().unwrap()) != 1 {
                continue; // not PT_LOAD
            }
            let paddr = u64::from_le_bytes(ph[24..32].try_into().unwrap());
            let memsz = u64::from_le_bytes(ph[40..48].try_into().unwrap());
            if paddr < HIMEM_START {
                return Err(err(format!("ELF segment at {paddr:#x} is below 1 MiB; kernels load at or above {HIMEM_START:#x}")));
            }
            end = end.max(
                paddr
                    .checked_add(memsz)
                    .ok_or_else(|| err("ELF segment size overflows".into()))?,
            );
        }
        if end == 0 {
            return Err(err("ELF file has no loadable segment".into()));
        }
        return Ok(KernelExtent {
            format: KernelFormat::Elf,
            end,
        });
    }
    if head.len() >= 0x264 && head[0x202..0x206] == *b"HdrS" {
        let version = u16::from_le_bytes([head[0x206], head[0x207]]);
        if version < 0x0206 || head[0x211] & 1 == 0 {
            return Err(err(format!(
                "bzImage boot protocol {}.{:02} without LOADED_HIGH is not supported; 2.06 or newer is",
                version >> 8,
                version & 0xff
            )));
        }
        // init_size (boot protocol 2.10+) is the memory the kernel needs from its load address,
        // including its decompression buffer.
        let init_size = u32::from_le_bytes(head[0x260..0x264].try_into().unwrap()) as u64;
        let file_len = f.metadata().map(|m| m.len()).unwrap_or(0);
        return Ok(KernelExtent {
            format: KernelFormat::BzImage,
            end: HIMEM_START + init_size.max(file_len),
        });
    }
    Err(err(
        "neither an ELF vmlinux nor a bzImage (no ELF magic, no \"HdrS\" header)".into(),
    ))
}

fn read_up_to(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

fn mib_ceil(bytes: u64) -> u64 {
    bytes.div_ceil(MIB)
}

/// Where the initrd goes: the highest page-aligned spot under both the low RAM end and the
/// kernel's `initrd_addr_max`, above the kernel.
pub fn initrd_address(
    mem_size: u64,
    kernel_end: u64,
    initrd_size: u64,
    addr_max: u64,
) -> Option<u64> {
    let top = low_ram_end(mem_size).min(addr_max.saturating_add(1));
    let start = top.checked_sub(initrd_size)? & !(PAGE_SIZE - 1);
    (start >= kernel_end.next_multiple_of(PAGE_SIZE)).then_some(start)
}

/// Checks kernel and initrd fit in the configured memory; returns the kernel's extent.
pub fn check_fits(
    memory_mib: u64,
    kernel: &Path,
    initrd: Option<&Path>,
) -> Result<KernelExtent, ConfigError> {
    let extent = inspect_kernel(kernel)?;
    let mem = memory_mib * MIB;
    let low = low_ram_end(mem);
    let initrd_size = match initrd {
        Some(p) => std::fs::metadata(p)
            .map_err(|e| ConfigError::Initrd {
                path: p.display().to_string(),
                reason: e.to_string(),
            })?
            .len(),
        None => 0,
    };
    let needed = extent.end.next_multiple_of(PAGE_SIZE) + initrd_size.next_multiple_of(PAGE_SIZE);
    if needed > low {
        let what = if initrd.is_some() {
            "the kernel plus initrd"
        } else {
            "the kernel"
        };
        return Err(ConfigError::MemoryTooSmall {
            memory_mib,
            what: what.into(),
            needed_mib: mib_ceil(needed),
        });
    }
    Ok(extent)
}

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("loading kernel: {0}")]
    Kernel(#[from] loader::Error),
    #[error("reading {0}: {1}")]
    Io(String, std::io::Error),
    #[error("initrd of {size} bytes does not fit below {limit:#x} above the kernel")]
    InitrdTooLarge { size: u64, limit: u64 },
    #[error("writing boot parameters: {0}")]
    BootParams(String),
    #[error("command line: {0}")]
    Cmdline(String),
    #[error(transparent)]
    MpTable(#[from] crate::arch::mptable::MpTableError),
    #[error("ACPI tables: {0}")]
    Acpi(#[from] crate::arch::acpi::AcpiError),
}

/// Everything the vCPUs need to enter the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BootEntry {
    pub entry: u64,
    pub mode: EntryMode,
    /// Zero page (Linux64) or start_info (PVH) address.
    pub boot_info: u64,
}

/// The files a fresh boot loads.
pub struct Images<'a> {
    pub mem_size: u64,
    pub kernel: &'a Path,
    /// What `check_fits` found the kernel to be (read once, not again here).
    pub extent: KernelExtent,
    pub initrd: Option<&'a Path>,
    /// Guest RAM is anonymous private memory, so file pages may be mapped into it rather than
    /// copied (see `image`).
    pub map_pages: bool,
}

/// Kernel and initrd in guest memory: where the kernel starts, where the initrd went, and the
/// runs of RAM now backed by the files' pages.
pub struct LoadedImages {
    kernel: loader::KernelLoaderResult,
    entry: u64,
    mode: EntryMode,
    initrd: Option<(u64, u64)>,
    pub mapped: Vec<image::MappedRun>,
}

/// Loads kernel and initrd. Needs nothing but RAM, so it may run while the RAM is being
/// registered with KVM and before any device exists.
pub fn load_images<M: GuestMemoryBackend>(
    mem: &M,
    images: &Images,
) -> Result<LoadedImages, BootError> {
    let kpath = images.kernel.display().to_string();
    let kfile = File::open(images.kernel).map_err(|e| BootError::Io(kpath.clone(), e))?;
    let mut kfile = image::ImageFile::new(kfile, images.map_pages);
    let (kernel, entry, mode) = match images.extent.format {
        KernelFormat::Elf => {
            let r = Elf::load(mem, None, &mut kfile, Some(GuestAddress(HIMEM_START)))?;
            match r.pvh_boot_cap {
                PvhBootCapability::PvhEntryPresent(addr) => (r, addr.raw_value(), EntryMode::Pvh),
                _ => (r, r.kernel_load.raw_value(), EntryMode::Linux64),
            }
        }
        KernelFormat::BzImage => {
            let r = BzImage::load(mem, None, &mut kfile, Some(GuestAddress(HIMEM_START)))?;
            // The 64-bit entry point sits 0x200 bytes into the protected-mode kernel.
            (r, r.kernel_load.raw_value() + 0x200, EntryMode::Linux64)
        }
    };
    let mut mapped = kfile.into_mapped();
    let initrd = match images.initrd {
        Some(p) => {
            let (at, runs) = load_initrd(
                mem,
                images.mem_size,
                kernel.kernel_end,
                kernel.setup_header.as_ref(),
                p,
                images.map_pages,
            )?;
            mapped.extend(runs);
            Some(at)
        }
        None => None,
    };
    Ok(LoadedImages {
        kernel,
        entry,
        mode,
        initrd,
        mapped,
    })
}

/// What the boot tables describe.
pub struct DescribedMachine<'a> {
    pub mem_size: u64,
    pub vcpus: u8,
    /// Each virtio-mmio device's base and IRQ.
    pub virtio: &'a [(u64, u32)],
}

/// Writes the command line, MP table, ACPI tables, boot tables and boot parameters for loaded
/// images.
pub fn write_boot_info<M: GuestMemoryBackend>(
    mem: &M,
    loaded: &LoadedImages,
    machine: &DescribedMachine,
    cmdline: &str,
) -> Result<BootEntry, BootError> {
    let DescribedMachine {
        mem_size,
        vcpus,
        virtio,
    } = *machine;
    let mut line = Cmdline::new(CMDLINE_MAX_SIZE).map_err(|e| BootError::Cmdline(e.to_string()))?;
    line.insert_str(cmdline)
        .map_err(|e| BootError::Cmdline(e.to_string()))?;
    loader::load_cmdline(mem, GuestAddress(CMDLINE_START), &line)?;
    crate::arch::mptable::write(mem, vcpus)?;
    crate::arch::acpi::write(mem, vcpus, virtio)?;
    crate::devices::ged::write_new_generation(mem)
        .map_err(|e| BootError::BootParams(format!("VMGenID: {e}")))?;
    crate::arch::regs::write_boot_tables(mem, loaded.mode)
        .map_err(|e| BootError::BootParams(format!("boot tables: {e}")))?;

    let e820 = e820_map(mem_size);
    let boot_info = match loaded.mode {
        EntryMode::Linux64 => {
            write_zero_page(
                mem,
                loaded.kernel.setup_header,
                cmdline.len(),
                loaded.initrd,
                &e820,
            )?;
            ZERO_PAGE_START
        }
        EntryMode::Pvh => {
            write_pvh_start_info(mem, loaded.initrd, &e820)?;
            PVH_INFO_START
        }
    };
    let (entry, mode) = (loaded.entry, loaded.mode);
    tracing::debug!(?mode, entry = format_args!("{entry:#x}"), "kernel loaded");
    Ok(BootEntry {
        entry,
        mode,
        boot_info,
    })
}

/// Copies (or maps) the initrd to its place; returns where it went and the runs mapped.
fn load_initrd<M: GuestMemoryBackend>(
    mem: &M,
    mem_size: u64,
    kernel_end: u64,
    hdr: Option<&setup_header>,
    path: &Path,
    map_pages: bool,
) -> Result<((u64, u64), Vec<image::MappedRun>), BootError> {
    let pstr = path.display().to_string();
    let f = File::open(path).map_err(|e| BootError::Io(pstr.clone(), e))?;
    let size = f
        .metadata()
        .map_err(|e| BootError::Io(pstr.clone(), e))?
        .len();
    let addr_max = hdr
        .map(|h| h.initrd_addr_max as u64)
        .filter(|m| *m != 0)
        .unwrap_or(DEFAULT_INITRD_ADDR_MAX);
    let addr =
        initrd_address(mem_size, kernel_end, size, addr_max).ok_or(BootError::InitrdTooLarge {
            size,
            limit: low_ram_end(mem_size).min(addr_max),
        })?;
    let mut f = image::ImageFile::new(f, map_pages);
    mem.read_exact_volatile_from(GuestAddress(addr), &mut f, size as usize)
        .map_err(|e| BootError::BootParams(format!("copying initrd: {e}")))?;
    Ok(((addr, size), f.into_mapped()))
}

fn write_zero_page<M: GuestMemoryBackend>(
    mem: &M,
    header: Option<setup_header>,
    cmdline_len: usize,
    initrd: Option<(u64, u64)>,
    e820: &[E820Entry],
) -> Result<(), BootError> {
    let mut params = boot_params::default();
    if let Some(h) = header {
        params.hdr = h;
    }
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.cmd_line_ptr = CMDLINE_START as u32;
    params.hdr.cmdline_size = cmdline_len as u32 + 1;
    if params.hdr.kernel_alignment == 0 {
        params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT_BYTES;
    }
    if let Some((addr, size)) = initrd {
        params.hdr.ramdisk_image = addr as u32;
        params.hdr.ramdisk_size = size as u32;
    }
    if e820.len() > params.e820_table.len() {
        return Err(BootError::BootParams("too many e820 entries".into()));
    }
    for (slot, e) in params.e820_table.iter_mut().zip(e820) {
        slot.addr = e.addr;
        slot.size = e.size;
        slot.r#type = e.kind as u32;
    }
    params.e820_entries = e820.len() as u8;
    params.acpi_rsdp_addr = ACPI_RSDP_START;
    let bp = BootParams::new::<boot_params>(&params, GuestAddress(ZERO_PAGE_START));
    LinuxBootConfigurator::write_bootparams::<M>(&bp, mem)
        .map_err(|e| BootError::BootParams(e.to_string()))
}

fn write_pvh_start_info<M: GuestMemoryBackend>(
    mem: &M,
    initrd: Option<(u64, u64)>,
    e820: &[E820Entry],
) -> Result<(), BootError> {
    if e820.len() > PVH_MEMMAP_MAX_ENTRIES {
        return Err(BootError::BootParams(
            "too many memory map entries for PVH".into(),
        ));
    }
    let mut info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC,
        version: 1,
        cmdline_paddr: CMDLINE_START,
        memmap_paddr: PVH_MEMMAP_START,
        memmap_entries: e820.len() as u32,
        rsdp_paddr: ACPI_RSDP_START,
        ..Default::default()
    };
    let memmap: Vec<hvm_memmap_table_entry> = e820
        .iter()
        .map(|e| hvm_memmap_table_entry {
            addr: e.addr,
            size: e.size,
            type_: e.kind as u32,
            reserved: 0,
        })
        .collect();
    let mut modules = Vec::new();
    if let Some((paddr, size)) = initrd {
        info.nr_modules = 1;
        info.modlist_paddr = PVH_MODLIST_START;
        modules.push(hvm_modlist_entry {
            paddr,
            size,
            ..Default::default()
        });
    }
    let mut bp = BootParams::new::<hvm_start_info>(&info, GuestAddress(PVH_INFO_START));
    bp.set_sections::<hvm_memmap_table_entry>(&memmap, GuestAddress(PVH_MEMMAP_START));
    if !modules.is_empty() {
        bp.set_modules::<hvm_modlist_entry>(&modules, GuestAddress(PVH_MODLIST_START));
    }
    PvhBootConfigurator::write_bootparams::<M>(&bp, mem)
        .map_err(|e| BootError::BootParams(e.to_string()))
}

/// Reads `len` bytes of guest memory, for diagnostics; out-of-range parts are skipped.
pub fn read_guest_bytes<M: GuestMemory>(mem: &M, addr: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    for i in 0..len as u64 {
        match mem.read_obj::<u8>(GuestAddress(addr.wrapping_add(i))) {
            Ok(b) => out.push(b),
            Err(_) => break,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn tmpfile(name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("mv-boot-{}-{name}", std::process::id()));
        std::fs::File::create(&p).unwrap().write_all(bytes).unwrap();
        p
    }

    /// A minimal ELF64 x86_64 header with one PT_LOAD segment.
    fn elf(paddr: u64, memsz: u64) -> Vec<u8> {
        let mut b = vec![0u8; 64 + 56];
        b[0..4].copy_from_slice(b"\x7fELF");
        b[4] = 2;
        b[5] = 1;
        b[6] = 1;
        b[16..18].copy_from_slice(&2u16.to_le_bytes());
        b[18..20].copy_from_slice(&62u16.to_le_bytes());
        b[24..32].copy_from_slice(&paddr.to_le_bytes());
        b[32..40].copy_from_slice(&64u64.to_le_bytes());
        b[52..54].copy_from_slice(&64u16.to_le_bytes());
        b[54..56].copy_from_slice(&56u16.to_le_bytes());
        b[56..58].copy_from_slice(&1u16.to_le_bytes());
        let ph = &mut b[64..];
        ph[0..4].copy_from_slice(&1u32.to_le_bytes());
        ph[16..24].copy_from_slice(&paddr.to_le_bytes());
        ph[24..32].copy_from_slice(&paddr.to_le_bytes());
        ph[40..48].copy_from_slice(&memsz.to_le_bytes());
        b
    }

    #[test]
    fn recognises_elf_and_rejects_garbage() {
        let p = tmpfile("elf", &elf(0x20_0000, 0x10_0000));
        assert_eq!(
            inspect_kernel(&p).unwrap(),
            KernelExtent {
                format: KernelFormat::Elf,
                end: 0x30_0000
            }
        );
        let g = tmpfile("garbage", b"#!/bin/sh\necho not a kernel\n");
        let e = inspect_kernel(&g).unwrap_err().to_string();
        assert!(e.contains("neither an ELF vmlinux nor a bzImage"), "{e}");
        let low = tmpfile("low", &elf(0x1000, 0x1000));
        assert!(inspect_kernel(&low)
            .unwrap_err()
            .to_string()
            .contains("below 1 MiB"));
        for p in [p, g, low] {
            std::fs::remove_file(p).unwrap();
        }
    }

    #[test]
    fn recognises_bzimage_header() {
        let mut b = vec![0u8; 0x1000];
        b[0x202..0x206].copy_from_slice(b"HdrS");
        b[0x206..0x208].copy_from_slice(&0x0205u16.to_le_bytes());
        let p = tmpfile("bz-old", &b);
        assert!(inspect_kernel(&p)
            .unwrap_err()
            .to_string()
            .contains("boot protocol 2.05"));
        b[0x206..0x208].copy_from_slice(&0x020fu16.to_le_bytes());
        b[0x211] = 1;
        b[0x260..0x264].copy_from_slice(&(32u32 << 20).to_le_bytes());
        let p = tmpfile("bz", &b);
        let x = inspect_kernel(&p).unwrap();
        assert_eq!(
            x,
            KernelExtent {
                format: KernelFormat::BzImage,
                end: HIMEM_START + (32 << 20)
            }
        );
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn memory_too_small_names_what_is_needed() {
        let k = tmpfile("big", &elf(0x100_0000, 40 << 20)); // ends at 56 MiB
        let e = check_fits(32, &k, None).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--memory 32: the kernel needs 56 MiB of guest RAM; give at least that"
        );
        check_fits(64, &k, None).unwrap();
        let i = tmpfile("initrd", &vec![0u8; 10 << 20]);
        assert!(matches!(
            check_fits(64, &k, Some(&i)),
            Err(ConfigError::MemoryTooSmall { needed_mib: 66, .. })
        ));
        for p in [k, i] {
            std::fs::remove_file(p).unwrap();
        }
    }

    #[test]
    fn initrd_goes_high_and_page_aligned() {
        let a = initrd_address(256 * MIB, 0x200_0000, 5000, DEFAULT_INITRD_ADDR_MAX).unwrap();
        assert_eq!(a % PAGE_SIZE, 0);
        assert!(a + 5000 <= 256 * MIB);
        // Large guest: capped by initrd_addr_max, not the end of RAM.
        let a = initrd_address(8 * GIB, 0x200_0000, 1 << 20, DEFAULT_INITRD_ADDR_MAX).unwrap();
        assert!(a + (1 << 20) <= DEFAULT_INITRD_ADDR_MAX + 1);
        // Does not fit above the kernel.
        assert_eq!(
            initrd_address(64 * MIB, 60 * MIB, 8 * MIB, DEFAULT_INITRD_ADDR_MAX),
            None
        );
    }
}
