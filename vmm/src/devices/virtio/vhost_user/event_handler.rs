//! A vhost-user device on the event-manager thread: queued activation and reset work, the
//! backend's call eventfds, and the socket hanging up.

use std::os::fd::AsRawFd;

use event_manager::{EventOps, Events, MutEventSubscriber};
use vmm_sys_util::epoll::EventSet;

use super::VhostUserDevice;

impl MutEventSubscriber for VhostUserDevice {
    fn init(&mut self, ops: &mut EventOps) {
        let mut fds: Vec<i32> = vec![self.base.activate_evt.as_raw_fd()];
        fds.extend(self.call_evts.iter().map(|e| e.as_raw_fd()));
        for fd in fds {
            if let Err(e) = ops.add(Events::with_data_raw(fd, 0, EventSet::IN)) {
                tracing::error!(device = %self.id, "vhost-user: cannot watch eventfd: {e:?}");
            }
        }
        // The backend never writes to this socket unasked; a hang-up is its death.
        let sock = self.conn.frontend.as_raw_fd();
        if let Err(e) = ops.add(Events::with_data_raw(sock, 1, EventSet::HANG_UP)) {
            tracing::error!(device = %self.id, "vhost-user: cannot watch the socket: {e:?}");
        }
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let fd = events.fd();
        if events.data() == 1 {
            let _ = ops.remove(events);
            self.fail("the backend closed its socket");
            return;
        }
        if fd == self.base.activate_evt.as_raw_fd() {
            let _ = self.base.activate_evt.read();
            self.run_pending();
        } else if let Some(i) = self.call_evts.iter().position(|e| e.as_raw_fd() == fd) {
            self.used(i);
        }
    }
}
