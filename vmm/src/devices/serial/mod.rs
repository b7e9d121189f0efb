//! COM1: a 16550 UART from vm-superio on port 0x3f8, IRQ 4 through an irqfd.
mod event_handler;
pub mod persist;

pub use event_handler::{InputSource, SerialInputHandler};

use std::io::{self, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use vm_superio::serial::SerialEvents;
use vm_superio::Serial;
use vmm_sys_util::eventfd::EventFd;

use crate::bus::BusDevice;
use crate::config::SerialOutput;
use crate::devices::EventFdTrigger;

/// Tells the input handler when the guest has drained the receive FIFO, so input is read from
/// the host again only when there is room (no busy loop, no dropped keystrokes).
pub struct InputDrained(pub EventFd);

impl SerialEvents for InputDrained {
    fn buffer_read(&self) {}
    fn out_byte(&self) {}
    fn tx_lost_byte(&self) {}
    fn in_buffer_empty(&self) {
        let _ = self.0.write(1);
    }
}

pub type Uart = Serial<EventFdTrigger, InputDrained, Box<dyn Write + Send>>;

pub struct SerialDevice {
    pub uart: Uart,
}

struct SharedWriter(Arc<Mutex<dyn Write + Send>>);

impl Write for SharedWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).flush()
    }
}

/// Opens the configured console sink.
pub fn open_output(out: &SerialOutput) -> io::Result<Box<dyn Write + Send>> {
    Ok(match out {
        SerialOutput::Stdout => Box::new(io::stdout()),
        SerialOutput::File(p) => Box::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)?,
        ),
        SerialOutput::UnixSocket(p) => Box::new(UnixStream::connect(p)?),
        SerialOutput::Writer(w) => Box::new(SharedWriter(w.clone())),
        SerialOutput::Null => Box::new(io::sink()),
    })
}

impl SerialDevice {
    pub fn new(irq: EventFdTrigger, drained: EventFd, out: Box<dyn Write + Send>) -> Self {
        SerialDevice {
            uart: Serial::with_events(irq, InputDrained(drained), out),
        }
    }
}

impl BusDevice for SerialDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if data.len() == 1 && offset < 8 {
            data[0] = self.uart.read(offset as u8);
        } else {
            data.fill(0xff);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if data.len() == 1 && offset < 8 {
            if let Err(e) = self.uart.write(offset as u8, data[0]) {
                // A console sink that went away must not stop the guest.
                tracing::debug!("serial write: {e:?}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<u8>>>);
    impl Write for Capture {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn guest_writes_reach_sink_and_raise_irq_when_enabled() {
        let cap = Capture::default();
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let drained = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut dev = SerialDevice::new(
            EventFdTrigger(irq.try_clone().unwrap()),
            drained,
            Box::new(cap.clone()),
        );
        dev.write(1, &[0x02]); // IER: THR empty interrupt
        for b in b"hi" {
            dev.write(0, &[*b]);
        }
        assert_eq!(&*cap.0.lock().unwrap(), b"hi");
        assert!(irq.read().unwrap() >= 1);
    }

    #[test]
    fn input_is_readable_and_draining_signals() {
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let drained = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut dev = SerialDevice::new(
            EventFdTrigger(irq),
            drained.try_clone().unwrap(),
            Box::new(io::sink()),
        );
        dev.uart.enqueue_raw_bytes(b"ok").unwrap();
        let mut b = [0u8];
        dev.read(0, &mut b);
        assert_eq!(b[0], b'o');
        dev.read(0, &mut b);
        assert_eq!(b[0], b'k');
        assert_eq!(drained.read().unwrap(), 1);
    }
}
