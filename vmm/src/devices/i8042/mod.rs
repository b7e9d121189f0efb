//! The i8042 keyboard controller, so the guest can reset the machine (`reboot=k`: command 0xFE
//! on port 0x64). vm-superio's device covers exactly that; a keyboard for Ctrl-Alt-Del (graceful
//! shutdown from the host) is added with the launcher's Shutdown command.

use vm_superio::I8042Device;

use crate::bus::BusDevice;
use crate::devices::EventFdTrigger;

pub struct I8042 {
    inner: I8042Device<EventFdTrigger>,
}

impl I8042 {
    pub fn new(reset_evt: EventFdTrigger) -> Self {
        I8042 {
            inner: I8042Device::new(reset_evt),
        }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if data.len() == 1 {
            data[0] = self.inner.read(offset as u8);
        } else {
            data.fill(0xff);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if data.len() == 1 {
            if let Err(e) = self.inner.write(offset as u8, data[0]) {
                tracing::warn!("i8042 write failed: {e:?}");
            }
        }
    }
}
