//! The Generic Event Device (`ACPI0013` in the DSDT, see `arch::acpi`): one interrupt and a
//! one-byte event register at `GED_PORT` that says which devices it is for. The guest's `_EVT`
//! method reads the register (which clears it) and notifies the power button or the VMGenID
//! device. Also here: the VMGenID generation ID, the 16 bytes at `VMGENID_START` that change
//! whenever the machine may be running as a copy of itself.
//!
//! Pending events are not persisted: a snapshot taken between an event and the guest's read
//! loses at most one button press, and a restore always announces a new generation anyway.

use vm_memory::{Bytes, GuestAddress, GuestMemory};
use vm_superio::Trigger;

use crate::arch::acpi::{GED_EVENT_GENERATION, GED_EVENT_POWER_BUTTON};
use crate::bus::BusDevice;
use crate::devices::EventFdTrigger;
use crate::layout::VMGENID_START;

/// A VMGenID generation ID.
pub type GenerationId = [u8; 16];

pub struct Ged {
    pending: u8,
    irq: EventFdTrigger,
}

impl Ged {
    pub fn new(irq: EventFdTrigger) -> Self {
        Ged { pending: 0, irq }
    }

    fn raise(&mut self, event: u8) -> std::io::Result<()> {
        self.pending |= event;
        self.irq.trigger()
    }

    /// Presses the ACPI power button: a guest with ACPI shuts down gracefully.
    pub fn press_power_button(&mut self) -> std::io::Result<()> {
        self.raise(GED_EVENT_POWER_BUTTON)
    }

    /// Writes a new generation ID into guest memory and, when `interrupt` (the guest set up
    /// the GED's line), tells the guest, as a restore that may run more than once must (the
    /// guest reseeds its random number generator). A guest not told reads the new ID the next
    /// time it looks. Returns the new ID.
    pub fn announce_new_generation<M: GuestMemory>(
        &mut self,
        mem: &M,
        interrupt: bool,
    ) -> std::io::Result<GenerationId> {
        let id = write_new_generation(mem)?;
        if interrupt {
            self.raise(GED_EVENT_GENERATION)?;
        }
        Ok(id)
    }
}

impl BusDevice for Ged {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if offset == 0 && !data.is_empty() {
            data[0] = std::mem::take(&mut self.pending);
        }
    }

    fn write(&mut self, _offset: u64, _data: &[u8]) {}
}

/// A fresh random generation ID, written where the DSDT's VMGenID device says it is.
pub fn write_new_generation<M: GuestMemory>(mem: &M) -> std::io::Result<GenerationId> {
    let id: GenerationId = crate::persist::files::random_bytes()?;
    mem.write_slice(&id, GuestAddress(VMGENID_START))
        .map_err(|e| std::io::Error::other(format!("writing the generation ID: {e}")))?;
    Ok(id)
}

/// The generation ID the guest sees now.
pub fn generation<M: GuestMemory>(mem: &M) -> Option<GenerationId> {
    let mut id = [0u8; 16];
    mem.read_slice(&mut id, GuestAddress(VMGENID_START))
        .ok()
        .map(|_| id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;
    use vmm_sys_util::eventfd::EventFd;

    fn ged() -> (Ged, EventFd) {
        let fd = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        (Ged::new(EventFdTrigger(fd.try_clone().unwrap())), fd)
    }

    fn memory() -> GuestMemoryMmap<()> {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap()
    }

    #[test]
    fn the_event_register_says_what_happened_once() {
        let (mut g, irq) = ged();
        g.press_power_button().unwrap();
        assert_eq!(irq.read().unwrap(), 1, "the interrupt fired");
        let mut b = [0xffu8; 1];
        g.read(0, &mut b);
        assert_eq!(b[0], GED_EVENT_POWER_BUTTON);
        g.read(0, &mut b);
        assert_eq!(b[0], 0, "reading clears it");
    }

    #[test]
    fn a_new_generation_differs_each_time_and_interrupts_only_a_listener() {
        let mem = memory();
        let (mut g, irq) = ged();
        let a = g.announce_new_generation(&mem, false).unwrap();
        assert_eq!(generation(&mem), Some(a));
        assert!(
            irq.read().is_err(),
            "a guest not listening is not interrupted"
        );
        let b = g.announce_new_generation(&mem, true).unwrap();
        assert_eq!(irq.read().unwrap(), 1);
        assert_ne!(a, b);
        assert_eq!(generation(&mem), Some(b));
        let mut r = [0u8; 1];
        g.read(0, &mut r);
        assert_eq!(r[0], GED_EVENT_GENERATION);
    }
}
