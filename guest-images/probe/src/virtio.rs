//! A minimal virtio-mmio (version 2) driver with split queues, polled (the probe runs with
//! interrupts off): enough to drive virtio-blk and virtio-net the way Linux does.

use core::ptr::{read_volatile, write_volatile};
use core::sync::atomic::{compiler_fence, Ordering};

pub const QUEUE_SIZE: u16 = 16;
const VIRTIO_F_VERSION_1: u64 = 1 << 32;
const DESC_F_NEXT: u16 = 1;
pub const DESC_F_WRITE: u16 = 2;

/// `virtio_mmio.device=<size>@<base>:<irq>` entries on the command line, in order.
pub fn devices(cmdline: &str, out: &mut [u64; 8]) -> usize {
    let mut n = 0;
    for w in cmdline.split(' ') {
        let Some(spec) = w.strip_prefix("virtio_mmio.device=") else {
            continue;
        };
        let Some(at) = spec.split('@').nth(1) else {
            continue;
        };
        let base = at.split(':').next().unwrap_or("");
        let base = base.strip_prefix("0x").unwrap_or(base);
        if let (Ok(b), true) = (u64::from_str_radix(base, 16), n < out.len()) {
            out[n] = b;
            n += 1;
        }
    }
    n
}

#[repr(C, align(4096))]
pub struct Rings {
    desc: [[u64; 2]; QUEUE_SIZE as usize], // addr, (len | flags << 32 | next << 48)
    avail: [u16; 3 + QUEUE_SIZE as usize],
    _pad: [u8; 4096 - 16 * QUEUE_SIZE as usize - 2 * (3 + QUEUE_SIZE as usize)],
    used: [u32; 2 + 2 * QUEUE_SIZE as usize],
}

impl Rings {
    pub const fn new() -> Self {
        Rings {
            desc: [[0; 2]; QUEUE_SIZE as usize],
            avail: [0; 3 + QUEUE_SIZE as usize],
            _pad: [0; 4096 - 16 * QUEUE_SIZE as usize - 2 * (3 + QUEUE_SIZE as usize)],
            used: [0; 2 + 2 * QUEUE_SIZE as usize],
        }
    }
}

impl Default for Rings {
    fn default() -> Self {
        Self::new()
    }
}

pub struct Queue {
    rings: &'static mut Rings,
    index: u32,
    next_avail: u16,
    last_used: u16,
    free_head: u16,
}

pub struct Device {
    pub base: u64,
}

impl Device {
    pub fn read(&self, off: u64) -> u32 {
        unsafe { read_volatile((self.base + off) as *const u32) }
    }
    pub fn write(&self, off: u64, v: u32) {
        unsafe { write_volatile((self.base + off) as *mut u32, v) }
    }
    pub fn config_u8(&self, off: u64) -> u8 {
        unsafe { read_volatile((self.base + 0x100 + off) as *const u8) }
    }
    pub fn config_u64(&self, off: u64) -> u64 {
        self.read(0x100 + off) as u64 | (self.read(0x100 + off + 4) as u64) << 32
    }
    pub fn device_id(&self) -> u32 {
        if self.read(0) != 0x7472_6976 || self.read(4) != 2 {
            return 0;
        }
        self.read(8)
    }
    pub fn features(&self) -> u64 {
        self.write(0x14, 0);
        let lo = self.read(0x10) as u64;
        self.write(0x14, 1);
        lo | (self.read(0x10) as u64) << 32
    }

    /// Resets and negotiates `wanted` (plus VERSION_1) as the spec's init sequence says.
    /// Returns the negotiated features.
    pub fn init(&self, wanted: u64) -> Result<u64, &'static str> {
        self.write(0x70, 0);
        self.write(0x70, 1);
        self.write(0x70, 1 | 2);
        let offered = self.features();
        if offered & VIRTIO_F_VERSION_1 == 0 {
            return Err("device does not offer VERSION_1");
        }
        let f = (wanted | VIRTIO_F_VERSION_1) & offered;
        self.write(0x24, 0);
        self.write(0x20, f as u32);
        self.write(0x24, 1);
        self.write(0x20, (f >> 32) as u32);
        self.write(0x70, 1 | 2 | 8);
        if self.read(0x70) & 8 == 0 {
            return Err("FEATURES_OK did not stick");
        }
        Ok(f)
    }

    pub fn setup_queue(
        &self,
        index: u32,
        rings: &'static mut Rings,
    ) -> Result<Queue, &'static str> {
        self.write(0x30, index);
        if self.read(0x34) < QUEUE_SIZE as u32 {
            return Err("queue too small");
        }
        Ok(self.setup_queue_sized(index, QUEUE_SIZE as u32, rings))
    }

    pub fn status(&self) -> u32 {
        self.read(0x70)
    }

    /// Like `setup_queue`, with the queue size the caller chooses (possibly invalid).
    pub fn setup_queue_sized(&self, index: u32, size: u32, rings: &'static mut Rings) -> Queue {
        self.write(0x30, index);
        self.write(0x38, size);
        let d = rings.desc.as_ptr() as u64;
        let a = rings.avail.as_ptr() as u64;
        let u = rings.used.as_ptr() as u64;
        self.write(0x80, d as u32);
        self.write(0x84, (d >> 32) as u32);
        self.write(0x90, a as u32);
        self.write(0x94, (a >> 32) as u32);
        self.write(0xa0, u as u32);
        self.write(0xa4, (u >> 32) as u32);
        self.write(0x44, 1);
        Queue {
            rings,
            index,
            next_avail: 0,
            last_used: 0,
            free_head: 0,
        }
    }

    pub fn driver_ok(&self) {
        self.write(0x70, 1 | 2 | 8 | 4);
    }

    pub fn notify(&self, q: &Queue) {
        compiler_fence(Ordering::SeqCst);
        self.write(0x50, q.index);
    }
}

impl Queue {
    /// Puts a chain of (addr, len, flags) buffers on the available ring. Descriptors are used
    /// round-robin; callers keep at most QUEUE_SIZE in flight.
    pub fn push(&mut self, bufs: &[(u64, u32, u16)]) -> u16 {
        let head = self.free_head;
        for (i, &(addr, len, flags)) in bufs.iter().enumerate() {
            let idx = (self.free_head + i as u16) % QUEUE_SIZE;
            let next = (idx + 1) % QUEUE_SIZE;
            let f = flags | if i + 1 < bufs.len() { DESC_F_NEXT } else { 0 };
            unsafe {
                write_volatile(&mut self.rings.desc[idx as usize][0], addr);
                write_volatile(
                    &mut self.rings.desc[idx as usize][1],
                    len as u64 | (f as u64) << 32 | (next as u64) << 48,
                );
            }
        }
        self.free_head = (self.free_head + bufs.len() as u16) % QUEUE_SIZE;
        let slot = 2 + (self.next_avail % QUEUE_SIZE) as usize;
        unsafe { write_volatile(&mut self.rings.avail[slot], head) };
        compiler_fence(Ordering::SeqCst);
        self.next_avail = self.next_avail.wrapping_add(1);
        unsafe { write_volatile(&mut self.rings.avail[1], self.next_avail) };
        head
    }

    /// Writes descriptor `i` as given, unchecked (the guest-attack tests build hostile chains).
    pub fn set_desc(&mut self, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let i = (i % QUEUE_SIZE) as usize;
        unsafe {
            write_volatile(&mut self.rings.desc[i][0], addr);
            write_volatile(
                &mut self.rings.desc[i][1],
                len as u64 | (flags as u64) << 32 | (next as u64) << 48,
            );
        }
    }

    /// Puts `head` on the available ring and moves the index by `step` (1 normally; more to
    /// claim entries that were never written).
    pub fn publish(&mut self, head: u16, step: u16) {
        let slot = 2 + (self.next_avail % QUEUE_SIZE) as usize;
        unsafe { write_volatile(&mut self.rings.avail[slot], head) };
        compiler_fence(Ordering::SeqCst);
        self.next_avail = self.next_avail.wrapping_add(step);
        unsafe { write_volatile(&mut self.rings.avail[1], self.next_avail) };
    }

    /// The address of descriptor `i` (for tables that point into the queue itself).
    pub fn desc_addr(&self, i: u16) -> u64 {
        self.rings.desc[(i % QUEUE_SIZE) as usize].as_ptr() as u64
    }

    /// Returns (head, len) of the next used element, if any.
    pub fn pop_used(&mut self) -> Option<(u16, u32)> {
        let idx = unsafe { read_volatile(&self.rings.used[0]) } >> 16;
        if idx as u16 == self.last_used {
            return None;
        }
        compiler_fence(Ordering::SeqCst);
        let slot = 1 + 2 * (self.last_used % QUEUE_SIZE) as usize;
        let (id, len) = unsafe {
            (
                read_volatile(&self.rings.used[slot]),
                read_volatile(&self.rings.used[slot + 1]),
            )
        };
        self.last_used = self.last_used.wrapping_add(1);
        Some((id as u16, len))
    }

    /// Polls for a used element for a bounded number of spins.
    pub fn wait_used(&mut self, spins: u32) -> Option<(u16, u32)> {
        for _ in 0..spins {
            if let Some(u) = self.pop_used() {
                return Some(u);
            }
            core::hint::spin_loop();
        }
        None
    }
}
