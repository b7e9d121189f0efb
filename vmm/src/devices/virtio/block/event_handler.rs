//! virtio-blk on the event-manager thread: queue notifications (ioeventfd) and activation.

use std::os::fd::AsRawFd;

use event_manager::{EventOps, Events, MutEventSubscriber};
use vmm_sys_util::epoll::EventSet;

use super::Block;

impl MutEventSubscriber for Block {
    fn init(&mut self, ops: &mut EventOps) {
        for fd in [&self.base.queue_evts[0], &self.base.activate_evt] {
            if let Err(e) = ops.add(Events::new(fd, EventSet::IN)) {
                tracing::error!(disk = %self.id, "virtio-blk: cannot watch eventfd: {e:?}");
            }
        }
    }

    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        let fd = events.fd();
        if fd == self.base.queue_evts[0].as_raw_fd() {
            let _ = self.base.queue_evts[0].read();
        } else if fd == self.base.activate_evt.as_raw_fd() {
            let _ = self.base.activate_evt.read();
        }
        self.process_queue();
    }
}
