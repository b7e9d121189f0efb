//! State of the virtio-mmio transport and its queues. The transport records the registers the
//! driver wrote; once a device is activated its queues' live indices are the device's, so a
//! save asks the device for them and a restore activates the device again with them.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueState, QueueT};

use super::mmio::MmioTransport;
use super::{VirtioDevice, VirtioInterrupt};
use crate::memory::GuestMemory;
use crate::persist::object::Persist;

/// serde's view of virtio-queue's `QueueState` (that crate has no serde).
#[derive(Serialize, Deserialize)]
#[serde(remote = "QueueState")]
struct QueueStateDef {
    max_size: u16,
    next_avail: u16,
    next_used: u16,
    event_idx_enabled: bool,
    size: u16,
    ready: bool,
    desc_table: u64,
    avail_ring: u64,
    used_ring: u64,
}

/// One queue's registers and live indices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueSnapshot(#[serde(with = "QueueStateDef")] pub QueueState);

impl QueueSnapshot {
    /// Rebuilds the queue; sizes that are not powers of two or exceed the maximum are refused
    /// by virtio-queue (a state file is input like any other).
    pub fn to_queue(self) -> Result<Queue, String> {
        Queue::try_from(self.0).map_err(|e| format!("queue: {e}"))
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportState {
    pub queue_select: u32,
    pub device_features_select: u32,
    pub driver_features_select: u32,
    pub driver_features: u64,
    pub status: u32,
    pub config_generation: u32,
    pub interrupt_status: u32,
    pub needs_reset: bool,
    pub queues: Vec<QueueSnapshot>,
    /// The device was activated (DRIVER_OK accepted) with these features.
    pub activated: Option<u64>,
}

/// What a restored transport is connected to.
pub struct TransportArgs {
    pub device: Arc<Mutex<dyn VirtioDevice>>,
    pub mem: GuestMemory,
    pub interrupt: Arc<VirtioInterrupt>,
}

impl Persist for MmioTransport {
    type State = TransportState;
    type Args = TransportArgs;

    fn save(&self) -> TransportState {
        let dev = self.dev();
        let live = dev.queue_states();
        let queues = if dev.is_activated() && live.len() == self.queues.len() {
            live
        } else {
            self.queues.iter().map(|q| q.state()).collect()
        };
        TransportState {
            queue_select: self.queue_select,
            device_features_select: self.device_features_select,
            driver_features_select: self.driver_features_select,
            driver_features: self.driver_features,
            status: self.status,
            config_generation: self.config_generation,
            interrupt_status: self.interrupt.status.load(Ordering::SeqCst),
            needs_reset: self.interrupt.needs_reset.load(Ordering::SeqCst),
            queues: queues.into_iter().map(QueueSnapshot).collect(),
            activated: dev.is_activated().then(|| dev.acked_features()),
        }
    }

    fn restore(args: TransportArgs, s: &TransportState) -> Result<Self, String> {
        let mut t = MmioTransport::new(args.device, args.mem, args.interrupt);
        if s.queues.len() != t.queues.len() {
            return Err(format!(
                "{} queues recorded, the device has {}",
                s.queues.len(),
                t.queues.len()
            ));
        }
        for (q, snap) in t.queues.iter_mut().zip(&s.queues) {
            if snap.0.max_size != q.max_size() {
                return Err(format!(
                    "queue max size {} recorded, the device has {}",
                    snap.0.max_size,
                    q.max_size()
                ));
            }
            *q = snap.to_queue()?;
        }
        t.queue_select = s.queue_select;
        t.device_features_select = s.device_features_select;
        t.driver_features_select = s.driver_features_select;
        t.driver_features = s.driver_features;
        t.status = s.status;
        t.config_generation = s.config_generation;
        t.interrupt
            .status
            .store(s.interrupt_status, Ordering::SeqCst);
        t.interrupt
            .needs_reset
            .store(s.needs_reset, Ordering::SeqCst);
        if let Some(features) = s.activated {
            let offered = t.dev().avail_features();
            if features & !offered != 0 {
                return Err(format!(
                    "features {features:#x} were acked, this device offers {offered:#x}"
                ));
            }
            let queues = s
                .queues
                .iter()
                .map(|q| q.to_queue())
                .collect::<Result<Vec<_>, _>>()?;
            let mem = t.mem.clone();
            let interrupt = t.interrupt.clone();
            let mut dev = t.dev();
            dev.set_acked_features(features);
            dev.activate(mem, queues, interrupt)
                .map_err(|e| format!("re-activating the device: {e}"))?;
        }
        Ok(t)
    }
}
