//! virtio-rng on the event-manager thread: queue notifications (ioeventfd) and activation.

use event_manager::{EventOps, Events, MutEventSubscriber};

use super::Rng;

impl MutEventSubscriber for Rng {
    fn init(&mut self, ops: &mut EventOps) {
        self.base.watch_queues(ops, &self.id);
    }

    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        self.base.clear_event(&events);
        self.process_queue();
    }
}
