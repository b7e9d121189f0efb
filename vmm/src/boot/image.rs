//! A kernel or initrd file that linux-loader reads into guest memory — and that, where the
//! layout allows, maps its pages there instead of copying them.
//!
//! Copying a 9 MiB vmlinux costs a page fault and a 4 KiB copy per page before the first
//! KVM_RUN (most of a VMM's start-up on a host where faults are dear). Mapping the same pages
//! `MAP_PRIVATE | MAP_FIXED` from the file over the anonymous RAM costs one system call: the
//! guest reads them from the page cache when it first touches them, shares them with every
//! other VM booted from the same file, and gets a private copy on its first write, exactly as
//! if they had been copied. A run can only be mapped where the file offset and the host address
//! are both page-aligned; the rest (a partial last page, which must read as zeros beyond the
//! file's data, and every unaligned run) is read as before.
//!
//! Hand-written: linux-loader takes any `Read + ReadVolatile + Seek`, and no crate offers one
//! that maps instead of reading.
//!
//! The file must not be rewritten in place while the VM runs (replace it by renaming, as
//! package managers and container images do): pages the guest has not touched yet are read
//! from it when first used.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use vm_memory::bitmap::BitmapSlice;
use vm_memory::{ReadVolatile, VolatileMemoryError, VolatileSlice};

const PAGE: usize = 4096;
/// Below this a run is read: a mapping of its own would cost about what the copy does. (Low
/// enough that the probe guest's code is mapped, so its tests take this path.)
const MIN_MAPPED: usize = 16 * 1024;

/// A host address range of guest RAM now backed by a file's pages (private, copy on write).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MappedRun {
    pub host: usize,
    pub len: usize,
}

pub struct ImageFile {
    file: File,
    pos: u64,
    /// Guest RAM is anonymous private memory, so a run may be replaced by a private file
    /// mapping; false for memory another process shares (the pages must stay where it looks).
    map_pages: bool,
    mapped: Vec<MappedRun>,
}

impl ImageFile {
    pub fn new(file: File, map_pages: bool) -> ImageFile {
        ImageFile {
            file,
            pos: 0,
            map_pages,
            mapped: Vec::new(),
        }
    }

    /// The runs mapped rather than read so far.
    pub fn into_mapped(self) -> Vec<MappedRun> {
        self.mapped
    }

    /// Reads `len` bytes at `dst` from the current position, to the end of the file at most.
    fn read_into(&mut self, dst: *mut u8, len: usize) -> std::io::Result<usize> {
        let mut done = 0;
        while done < len {
            // SAFETY: the caller's slice covers `dst..dst + len`.
            let buf = unsafe { std::slice::from_raw_parts_mut(dst.add(done), len - done) };
            match self.file.read_at(buf, self.pos + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.pos += done as u64;
        Ok(done)
    }

    /// Maps the page-aligned head of `dst..dst + len` from the file at the current position;
    /// returns how many bytes it mapped (0 when the layout does not allow it).
    fn map_into(&mut self, dst: *mut u8, len: usize) -> std::io::Result<usize> {
        let file_len = self.file.metadata()?.len();
        let available = file_len.saturating_sub(self.pos).min(len as u64) as usize;
        let aligned = available & !(PAGE - 1);
        if !self.map_pages
            || aligned < MIN_MAPPED
            || !(dst as usize).is_multiple_of(PAGE)
            || !self.pos.is_multiple_of(PAGE as u64)
        {
            return Ok(0);
        }
        // SAFETY: `dst..dst + aligned` lies inside guest RAM, an anonymous private mapping this
        // VM owns (the caller's slice), so replacing those pages with private file pages of
        // identical protection changes what they hold, not who may use them; nothing else has
        // been given these pages yet (no vCPU runs before the kernel is loaded).
        let at = unsafe {
            libc::mmap(
                dst.cast(),
                aligned,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_FIXED,
                self.file.as_raw_fd(),
                self.pos as libc::off_t,
            )
        };
        if at == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        self.mapped.push(MappedRun {
            host: dst as usize,
            len: aligned,
        });
        self.pos += aligned as u64;
        Ok(aligned)
    }
}

impl Read for ImageFile {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.file.read_at(buf, self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl Seek for ImageFile {
    fn seek(&mut self, to: SeekFrom) -> std::io::Result<u64> {
        let base = match to {
            SeekFrom::Start(p) => {
                self.pos = p;
                return Ok(p);
            }
            SeekFrom::Current(d) => (self.pos, d),
            SeekFrom::End(d) => (self.file.metadata()?.len(), d),
        };
        self.pos = base.0.checked_add_signed(base.1).ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "seek before the start")
        })?;
        Ok(self.pos)
    }
}

impl ReadVolatile for ImageFile {
    fn read_volatile<B: BitmapSlice>(
        &mut self,
        buf: &mut VolatileSlice<B>,
    ) -> Result<usize, VolatileMemoryError> {
        let guard = buf.ptr_guard_mut();
        let dst = guard.as_ptr();
        let len = buf.len();
        let mapped = self
            .map_into(dst, len)
            .map_err(VolatileMemoryError::IOError)?;
        // SAFETY: `mapped <= len`, so the rest stays inside the slice.
        let read = self
            .read_into(unsafe { dst.add(mapped) }, len - mapped)
            .map_err(VolatileMemoryError::IOError)?;
        buf.bitmap().mark_dirty(0, mapped + read);
        Ok(mapped + read)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use vm_memory::{Bytes, GuestAddress};

    fn file_of(name: &str, bytes: &[u8]) -> File {
        let p = std::env::temp_dir().join(format!("mv-image-{}-{name}", std::process::id()));
        std::fs::File::create(&p).unwrap().write_all(bytes).unwrap();
        let f = File::open(&p).unwrap();
        std::fs::remove_file(&p).unwrap();
        f
    }

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + i / 4096) as u8).collect()
    }

    #[test]
    fn a_mapped_run_reads_as_a_copy_would_and_writes_stay_private() {
        let bytes = pattern(300 * 1024 + 123);
        let mem = crate::memory::GuestMemory::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let mut image = ImageFile::new(file_of("mapped", &bytes), true);
        mem.read_exact_volatile_from(GuestAddress(0x10000), &mut image, bytes.len())
            .unwrap();
        let runs = image.into_mapped();
        assert_eq!(runs.len(), 1, "the aligned head is mapped");
        assert_eq!(runs[0].len, 300 * 1024);
        let mut back = vec![0u8; bytes.len() + 4096];
        mem.read_slice(&mut back, GuestAddress(0x10000)).unwrap();
        assert_eq!(&back[..bytes.len()], &bytes[..]);
        assert!(
            back[bytes.len()..].iter().all(|&b| b == 0),
            "past the file's data the last page reads as zero"
        );
        mem.write_obj(0xabu8, GuestAddress(0x10000)).unwrap();
        assert_eq!(mem.read_obj::<u8>(GuestAddress(0x10000)).unwrap(), 0xab);
    }

    #[test]
    fn unaligned_or_shared_runs_are_read() {
        let bytes = pattern(200 * 1024);
        let mem = crate::memory::GuestMemory::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        for (addr, map_pages) in [(0x10010u64, true), (0x10000, false)] {
            let mut image = ImageFile::new(file_of("read", &bytes), map_pages);
            mem.read_exact_volatile_from(GuestAddress(addr), &mut image, bytes.len())
                .unwrap();
            assert!(image.into_mapped().is_empty());
            let mut back = vec![0u8; bytes.len()];
            mem.read_slice(&mut back, GuestAddress(addr)).unwrap();
            assert_eq!(back, bytes);
        }
    }

    #[test]
    fn seeking_follows_the_file() {
        let mut image = ImageFile::new(file_of("seek", &pattern(10_000)), true);
        assert_eq!(image.seek(SeekFrom::Start(4096)).unwrap(), 4096);
        assert_eq!(image.seek(SeekFrom::Current(-96)).unwrap(), 4000);
        assert_eq!(image.seek(SeekFrom::End(-10)).unwrap(), 9990);
        assert!(image.seek(SeekFrom::Current(-20_000)).is_err());
        let mut b = [0u8; 20];
        assert_eq!(image.read(&mut b).unwrap(), 10);
    }
}
