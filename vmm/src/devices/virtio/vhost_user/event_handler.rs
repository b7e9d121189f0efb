//! A vhost-user device on the event-manager thread: queued activation and reset work, the
//! backend's call eventfds, the socket hanging up, and a reconnection's outcome.

use std::os::fd::AsRawFd;

use event_manager::{EventOps, Events, MutEventSubscriber};
use vmm_sys_util::epoll::EventSet;

use super::VhostUserDevice;

/// Event data: the backend's socket hung up / the reconnection thread finished.
const HANG_UP: u32 = 1;
const RECONNECTED: u32 = 2;

impl MutEventSubscriber for VhostUserDevice {
    fn init(&mut self, ops: &mut EventOps) {
        let mut fds: Vec<i32> = vec![self.base.activate_evt.as_raw_fd()];
        fds.extend(self.call_evts.iter().map(|e| e.as_raw_fd()));
        for fd in fds {
            if let Err(e) = ops.add(Events::with_data_raw(fd, 0, EventSet::IN)) {
                tracing::error!(device = %self.id, "vhost-user: cannot watch eventfd: {e:?}");
            }
        }
        if let Some(r) = &self.reconnector {
            let fd = r.ready.as_raw_fd();
            if let Err(e) = ops.add(Events::with_data_raw(fd, RECONNECTED, EventSet::IN)) {
                tracing::error!(device = %self.id, "vhost-user: cannot watch the reconnection: {e:?}");
            }
        }
        // The backend never writes to this socket unasked; a hang-up is its death.
        let sock = self.conn.frontend.as_raw_fd();
        if let Err(e) = ops.add(Events::with_data_raw(sock, HANG_UP, EventSet::HANG_UP)) {
            tracing::error!(device = %self.id, "vhost-user: cannot watch the socket: {e:?}");
        }
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let fd = events.fd();
        match events.data() {
            HANG_UP => {
                let _ = ops.remove(events);
                self.backend_gone();
                return;
            }
            RECONNECTED => {
                if let Some(sock) = self.reconnected() {
                    if let Err(e) = ops.add(Events::with_data_raw(sock, HANG_UP, EventSet::HANG_UP))
                    {
                        tracing::error!(device = %self.id, "vhost-user: cannot watch the socket: {e:?}");
                    }
                }
                return;
            }
            _ => {}
        }
        if fd == self.base.activate_evt.as_raw_fd() {
            let _ = self.base.activate_evt.read();
            self.run_pending();
        } else if let Some(i) = self.call_evts.iter().position(|e| e.as_raw_fd() == fd) {
            self.used(i);
        }
    }
}
