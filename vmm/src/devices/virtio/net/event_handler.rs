//! virtio-net on the event-manager thread: queue notifications, the TAP (edge-triggered, so a
//! TAP with frames but no guest buffers never makes the loop spin) and activation.

use std::os::fd::AsRawFd;

use event_manager::{EventOps, Events, MutEventSubscriber};
use vmm_sys_util::epoll::EventSet;

use super::Net;

impl MutEventSubscriber for Net {
    fn init(&mut self, ops: &mut EventOps) {
        let mut add = |ev: Events| {
            if let Err(e) = ops.add(ev) {
                tracing::error!("virtio-net: cannot watch fd: {e:?}");
            }
        };
        add(Events::new(&self.base.queue_evts[0], EventSet::IN));
        add(Events::new(&self.base.queue_evts[1], EventSet::IN));
        add(Events::new(&self.base.activate_evt, EventSet::IN));
        add(Events::new(
            &self.tap,
            EventSet::IN | EventSet::EDGE_TRIGGERED,
        ));
    }

    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        let fd = events.fd();
        if fd == self.base.queue_evts[1].as_raw_fd() {
            let _ = self.base.queue_evts[1].read();
            self.process_tx();
        } else if fd == self.base.queue_evts[0].as_raw_fd() {
            let _ = self.base.queue_evts[0].read();
            self.process_rx();
        } else if fd == self.tap.as_raw_fd() {
            self.process_rx();
        } else if fd == self.base.activate_evt.as_raw_fd() {
            let _ = self.base.activate_evt.read();
            self.process_tx();
            self.process_rx();
        }
    }
}
