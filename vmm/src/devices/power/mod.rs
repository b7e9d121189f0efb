//! The shutdown port (see `layout::POWER_PORT`): how a guest without ACPI powers off or resets.

use crate::bus::BusDevice;
use crate::end::{VmEnd, VmEndSignal};
use crate::layout::{POWER_OFF_VALUE, POWER_RESET_VALUE};

pub struct PowerPort {
    end: VmEndSignal,
}

impl PowerPort {
    pub fn new(end: VmEndSignal) -> Self {
        PowerPort { end }
    }
}

impl BusDevice for PowerPort {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset != 0 || data.is_empty() {
            return;
        }
        match data[0] {
            POWER_OFF_VALUE => self.end.signal(VmEnd::PoweredOff),
            POWER_RESET_VALUE => self.end.signal(VmEnd::Reset),
            _ => {}
        }
    }
}
