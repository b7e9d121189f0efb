//! The 16550's registers and receive FIFO, saved and restored through vm-superio's own
//! `SerialState`.

use std::io::Write;

use serde::{Deserialize, Serialize};
use vm_superio::serial::SerialState;
use vm_superio::Serial;
use vmm_sys_util::eventfd::EventFd;

use super::{InputDrained, SerialDevice};
use crate::devices::EventFdTrigger;
use crate::persist::object::Persist;

/// serde's view of vm-superio's `SerialState` (that crate has no serde): the registers and the
/// receive FIFO.
#[derive(Serialize, Deserialize)]
#[serde(remote = "SerialState")]
pub struct SerialStateDef {
    pub baud_divisor_low: u8,
    pub baud_divisor_high: u8,
    pub interrupt_enable: u8,
    pub interrupt_identification: u8,
    pub line_control: u8,
    pub line_status: u8,
    pub modem_control: u8,
    pub modem_status: u8,
    pub scratch: u8,
    pub in_buffer: Vec<u8>,
}

/// What a restored UART is connected to: its IRQ, the FIFO-drained event and the console sink.
pub struct SerialArgs {
    pub irq: EventFdTrigger,
    pub drained: EventFd,
    pub out: Box<dyn Write + Send>,
}

impl Persist for SerialDevice {
    type State = SerialState;
    type Args = SerialArgs;

    fn save(&self) -> SerialState {
        self.uart.state()
    }

    fn restore(args: SerialArgs, state: &SerialState) -> Result<Self, String> {
        let uart = Serial::from_state(state, args.irq, InputDrained(args.drained), args.out)
            .map_err(|e| format!("serial: {e:?}"))?;
        Ok(SerialDevice { uart })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bus::BusDevice;

    #[test]
    fn registers_and_fifo_survive() {
        let args = || SerialArgs {
            irq: EventFdTrigger(EventFd::new(libc::EFD_NONBLOCK).unwrap()),
            drained: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            out: Box::new(std::io::sink()),
        };
        let a = args();
        let mut dev = SerialDevice::new(a.irq, a.drained, a.out);
        dev.write(3, &[0x83]); // DLAB on
        dev.write(0, &[0x0c]); // divisor 12: 9600 baud
        dev.write(3, &[0x03]); // 8N1
        dev.write(7, &[0x5a]); // scratch
        dev.uart.enqueue_raw_bytes(b"ab").unwrap();
        let state = dev.save();
        let mut back = SerialDevice::restore(args(), &state).unwrap();
        assert_eq!(back.save(), state);
        let mut b = [0u8];
        back.read(7, &mut b);
        assert_eq!(b[0], 0x5a);
        back.read(0, &mut b);
        assert_eq!(b[0], b'a', "the receive FIFO came along");
    }
}
