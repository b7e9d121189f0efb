//! Feeds host input (stdin or a socket) into the UART on the event-manager thread.

use std::io::Read;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex};

use event_manager::{EventOps, Events, MutEventSubscriber};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use super::SerialDevice;

pub trait InputSource: Read + AsRawFd + Send {}
impl<T: Read + AsRawFd + Send> InputSource for T {}

pub struct SerialInputHandler {
    device: Arc<Mutex<SerialDevice>>,
    input: Box<dyn InputSource>,
    drained: EventFd,
    /// Bytes read from the host the guest has no FIFO room for yet.
    pending: Vec<u8>,
    input_registered: bool,
    input_eof: bool,
}

impl SerialInputHandler {
    pub fn new(
        device: Arc<Mutex<SerialDevice>>,
        input: Box<dyn InputSource>,
        drained: EventFd,
    ) -> Self {
        SerialInputHandler {
            device,
            input,
            drained,
            pending: Vec::new(),
            input_registered: false,
            input_eof: false,
        }
    }

    fn input_fd(&self) -> RawFd {
        self.input.as_raw_fd()
    }

    fn push_pending(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let mut dev = self.device.lock().unwrap_or_else(|p| p.into_inner());
        if dev.uart.fifo_capacity() == 0 {
            return;
        }
        match dev.uart.enqueue_raw_bytes(&self.pending) {
            Ok(n) => {
                self.pending.drain(..n);
            }
            Err(e) => tracing::warn!("serial input: {e:?}"),
        }
    }

    /// Reads from the host only while nothing is pending, so a guest that does not read its
    /// console cannot make the VMM buffer without bound.
    fn update_registration(&mut self, ops: &mut EventOps) {
        let want = self.pending.is_empty() && !self.input_eof;
        if want != self.input_registered {
            let ev = Events::new_raw(self.input_fd(), EventSet::IN);
            let r = if want { ops.add(ev) } else { ops.remove(ev) };
            match r {
                Ok(()) => self.input_registered = want,
                Err(e) => {
                    tracing::warn!("serial input cannot be polled ({e:?}); console input disabled");
                    self.input_eof = true;
                    self.input_registered = false;
                }
            }
        }
    }
}

impl MutEventSubscriber for SerialInputHandler {
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(&self.drained, EventSet::IN)) {
            tracing::error!("serial: cannot watch FIFO drain events: {e:?}");
        }
        self.update_registration(ops);
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        if events.fd() == self.drained.as_raw_fd() {
            let _ = self.drained.read();
        } else if events.fd() == self.input_fd() {
            let mut buf = [0u8; 64];
            match self.input.read(&mut buf) {
                Ok(0) => self.input_eof = true,
                Ok(n) => self.pending.extend_from_slice(&buf[..n]),
                Err(e)
                    if e.kind() == std::io::ErrorKind::Interrupted
                        || e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => {
                    tracing::warn!("serial input read failed: {e}");
                    self.input_eof = true;
                }
            }
            if events.event_set().contains(EventSet::HANG_UP) && self.pending.is_empty() {
                self.input_eof = true;
            }
        }
        self.push_pending();
        self.update_registration(ops);
    }
}
