//! Legacy devices. Each device keeps its logic and its event handler side by side.
pub mod ged;
pub mod i8042;
pub mod manager;
pub mod power;
pub mod serial;
pub mod virtio;

use vm_superio::Trigger;
use vmm_sys_util::eventfd::EventFd;

/// A vm-superio trigger backed by an eventfd (an irqfd for interrupts, or a plain event).
pub struct EventFdTrigger(pub EventFd);

impl Trigger for EventFdTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

impl EventFdTrigger {
    pub fn try_clone(&self) -> std::io::Result<Self> {
        Ok(EventFdTrigger(self.0.try_clone()?))
    }
}
