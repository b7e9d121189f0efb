//! virtio-rng's own state beyond the transport: its counters. Requests complete on the event
//! thread, which a snapshot parks, so none is in flight.

use super::{Rng, RngCounters};
use crate::persist::object::Persist;

impl Persist for Rng {
    type State = RngCounters;
    type Args = String;

    fn save(&self) -> RngCounters {
        self.counters
    }

    fn restore(id: String, counters: &RngCounters) -> Result<Self, String> {
        let mut rng = Rng::new(id).map_err(|e| format!("virtio-rng: {e}"))?;
        rng.counters = *counters;
        Ok(rng)
    }
}
