//! virtio 1.2 devices on the virtio-mmio transport (version 2). The transport (`mmio`) owns
//! the register file and the device status state machine; each device folder holds the device
//! logic and its event handler side by side.

pub mod block;
pub mod mmio;
pub mod net;
pub mod persist;
pub mod rng;
pub mod vhost_user;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use virtio_queue::Queue;
use vmm_sys_util::eventfd::EventFd;

use crate::memory::GuestMemory;

pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;
pub const VIRTIO_F_RING_EVENT_IDX: u64 = 1 << 29;

pub const TYPE_NET: u32 = 1;
pub const TYPE_BLOCK: u32 = 2;
pub const TYPE_RNG: u32 = 4;

/// Device status bits (VIRTIO 1.2 §2.1).
pub mod status {
    pub const ACKNOWLEDGE: u32 = 1;
    pub const DRIVER: u32 = 2;
    pub const DRIVER_OK: u32 = 4;
    pub const FEATURES_OK: u32 = 8;
    pub const DEVICE_NEEDS_RESET: u32 = 64;
    pub const FAILED: u32 = 128;
}

/// Interrupt status bits (virtio-mmio InterruptStatus).
pub const INT_USED_RING: u32 = 1;
pub const INT_CONFIG_CHANGE: u32 = 2;

/// The device side of a virtio-mmio interrupt: a status word the driver reads and acks, and an
/// irqfd that injects the device's GSI.
pub struct VirtioInterrupt {
    pub status: AtomicU32,
    pub irqfd: EventFd,
    /// Set by a device whose driver broke the queue protocol (e.g. an available index running
    /// ahead of the queue size); the transport reports DEVICE_NEEDS_RESET.
    pub needs_reset: std::sync::atomic::AtomicBool,
}

impl VirtioInterrupt {
    pub fn new(irqfd: EventFd) -> Arc<Self> {
        Arc::new(VirtioInterrupt {
            status: AtomicU32::new(0),
            irqfd,
            needs_reset: Default::default(),
        })
    }

    pub fn device_needs_reset(&self) {
        self.needs_reset.store(true, Ordering::SeqCst);
        self.signal(INT_CONFIG_CHANGE);
    }

    pub fn signal(&self, bit: u32) {
        self.status.fetch_or(bit, Ordering::SeqCst);
        if let Err(e) = self.irqfd.write(1) {
            tracing::warn!("virtio interrupt: {e}");
        }
    }

    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    #[error("queue {0} is not ready or its rings are outside guest memory")]
    BadQueue(usize),
    #[error("{0}")]
    Backend(String),
}

/// What every device keeps alike: the features it offers and those the driver acked, its
/// config space, and the eventfd `activate` writes so the device's event handler (on the
/// event-manager thread) registers the queues. Devices hold one and the trait's feature and
/// config methods work on it, so a new device writes only what is its own.
pub struct DeviceBase {
    pub device_type: u32,
    /// The most descriptors each queue may have, one entry per queue.
    pub queue_sizes: Vec<u16>,
    /// The eventfds KVM signals when the driver notifies queue i (registered as ioeventfds).
    pub queue_evts: Vec<EventFd>,
    pub avail_features: u64,
    pub acked_features: u64,
    pub config: Vec<u8>,
    pub activate_evt: EventFd,
}

impl DeviceBase {
    /// A device of `device_type` with one queue of each size in `queue_sizes`.
    pub fn new(
        device_type: u32,
        queue_sizes: &[u16],
        avail_features: u64,
        config: Vec<u8>,
    ) -> std::io::Result<DeviceBase> {
        let evt = || EventFd::new(libc::EFD_NONBLOCK);
        Ok(DeviceBase {
            device_type,
            queue_sizes: queue_sizes.to_vec(),
            queue_evts: queue_sizes
                .iter()
                .map(|_| evt())
                .collect::<Result<_, _>>()?,
            avail_features,
            acked_features: 0,
            config,
            activate_evt: evt()?,
        })
    }

    pub fn acked(&self, feature: u64) -> bool {
        self.acked_features & feature != 0
    }

    /// Tells the event handler the queues are live (it registers them on the next event).
    pub fn announce_activation(&self) {
        let _ = self.activate_evt.write(1);
    }

    /// Registers every queue's notification and the activation eventfd with the event
    /// manager: all a device needs whose only work is its queues.
    pub fn watch_queues(&self, ops: &mut event_manager::EventOps, device: &str) {
        for fd in self.queue_evts.iter().chain([&self.activate_evt]) {
            if let Err(e) = ops.add(event_manager::Events::new(
                fd,
                vmm_sys_util::epoll::EventSet::IN,
            )) {
                tracing::error!(%device, "cannot watch a queue eventfd: {e:?}");
            }
        }
    }

    /// Clears whichever of [`DeviceBase::watch_queues`]'s eventfds `events` is for, so it
    /// does not fire again for the same notification.
    pub fn clear_event(&self, events: &event_manager::Events) {
        let fd = events.fd();
        if let Some(evt) = self
            .queue_evts
            .iter()
            .chain([&self.activate_evt])
            .find(|e| std::os::fd::AsRawFd::as_raw_fd(*e) == fd)
        {
            let _ = evt.read();
        }
    }
}

/// Implements [`VirtioDevice`] for a one-queue device: a struct with `base: DeviceBase` and
/// `active: Option<SingleQueue>`, whose requests are all served on the event thread.
macro_rules! single_queue_device {
    ($device:ty) => {
        impl $crate::devices::virtio::VirtioDevice for $device {
            fn base(&self) -> &$crate::devices::virtio::DeviceBase {
                &self.base
            }
            fn base_mut(&mut self) -> &mut $crate::devices::virtio::DeviceBase {
                &mut self.base
            }
            fn activate(
                &mut self,
                mem: $crate::memory::GuestMemory,
                queues: Vec<virtio_queue::Queue>,
                interrupt: std::sync::Arc<$crate::devices::virtio::VirtioInterrupt>,
            ) -> Result<(), $crate::devices::virtio::ActivateError> {
                self.active = Some($crate::devices::virtio::SingleQueue::activate(
                    &self.base, mem, queues, interrupt,
                )?);
                Ok(())
            }
            fn reset(&mut self) {
                self.active = None;
                self.base.acked_features = 0;
            }
            fn is_activated(&self) -> bool {
                self.active.is_some()
            }
            fn queue_states(&self) -> Vec<virtio_queue::QueueState> {
                self.active.iter().map(|a| a.queue.state()).collect()
            }
        }
    };
}
pub(crate) use single_queue_device;

/// A one-queue device's work while the driver runs it (virtio-blk, virtio-rng).
pub struct SingleQueue {
    pub mem: GuestMemory,
    pub queue: Queue,
    pub interrupt: Arc<VirtioInterrupt>,
}

impl SingleQueue {
    /// Takes queue 0 from what the transport activates, refusing a queue the driver did not
    /// make ready, and tells the event handler to start serving it: requests queued before
    /// activation completed are picked up on the event thread.
    pub fn activate(
        base: &DeviceBase,
        mem: GuestMemory,
        queues: Vec<Queue>,
        interrupt: Arc<VirtioInterrupt>,
    ) -> Result<SingleQueue, ActivateError> {
        let queue = queues
            .into_iter()
            .next()
            .filter(virtio_queue::QueueT::ready)
            .ok_or(ActivateError::BadQueue(0))?;
        base.announce_activation();
        Ok(SingleQueue {
            mem,
            queue,
            interrupt,
        })
    }

    /// Completes every available request with what `handle` makes of its descriptors (the
    /// bytes it wrote into the guest's buffers), then interrupts the guest once. A ring the
    /// guest broke marks the device as needing a reset instead.
    pub fn serve(
        &mut self,
        device: &str,
        mut handle: impl FnMut(&GuestMemory, &[virtio_queue::desc::split::Descriptor]) -> u32,
    ) {
        use virtio_queue::{QueueOwnedT, QueueT};
        let mut completed = false;
        loop {
            let chain = match self.queue.iter(&self.mem) {
                Ok(mut it) => it.next(),
                Err(e) => {
                    tracing::warn!(%device, "broken available ring ({e}); the device needs a reset");
                    self.interrupt.device_needs_reset();
                    return;
                }
            };
            let Some(chain) = chain else { break };
            let head = chain.head_index();
            let descs: Vec<_> = chain.collect();
            let used_len = handle(&self.mem, &descs);
            if let Err(e) = self.queue.add_used(&self.mem, head, used_len) {
                tracing::warn!(%device, "cannot complete a request: {e}");
                self.interrupt.device_needs_reset();
                return;
            }
            completed = true;
        }
        if completed && self.queue.needs_notification(&self.mem).unwrap_or(true) {
            self.interrupt.signal(INT_USED_RING);
        }
    }
}

/// What a device implements; the transport does the rest.
pub trait VirtioDevice: Send {
    fn base(&self) -> &DeviceBase;
    fn base_mut(&mut self) -> &mut DeviceBase;
    fn device_type(&self) -> u32 {
        self.base().device_type
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &self.base().queue_sizes
    }
    /// The eventfds KVM signals when the driver notifies queue i (registered as ioeventfds).
    fn queue_events(&self) -> &[EventFd] {
        &self.base().queue_evts
    }
    fn avail_features(&self) -> u64 {
        self.base().avail_features
    }
    /// Called once FEATURES_OK is accepted, with the features the driver acked.
    fn set_acked_features(&mut self, features: u64) {
        self.base_mut().acked_features = features;
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.base().config, offset, data);
    }
    /// Most of our config spaces are read-only to the driver; writes are ignored by default.
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}
    fn activate(
        &mut self,
        mem: GuestMemory,
        queues: Vec<Queue>,
        interrupt: Arc<VirtioInterrupt>,
    ) -> Result<(), ActivateError>;
    /// Returns to the state before activation (the driver wrote 0 to Status).
    fn reset(&mut self);
    fn is_activated(&self) -> bool;
    /// The features the driver acked (valid once FEATURES_OK was accepted).
    fn acked_features(&self) -> u64 {
        self.base().acked_features
    }
    /// The live state of the device's queues while activated (empty before): what a snapshot
    /// records, since the device, not the transport, advances the indices.
    fn queue_states(&self) -> Vec<virtio_queue::QueueState>;
}

/// Reads `data.len()` bytes at `offset` of a config space, zero beyond its end.
pub fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    for (i, b) in data.iter_mut().enumerate() {
        *b = usize::try_from(offset)
            .ok()
            .and_then(|o| o.checked_add(i))
            .and_then(|o| config.get(o))
            .copied()
            .unwrap_or(0);
    }
}
