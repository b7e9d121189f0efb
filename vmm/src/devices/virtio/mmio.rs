//! The virtio-mmio transport, version 2 (VIRTIO 1.2 §4.2.2): register file, feature
//! negotiation, the device status state machine, queue setup and interrupt status/ack.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use virtio_queue::{Queue, QueueT};

use super::{status, VirtioDevice, VirtioInterrupt, VIRTIO_F_VERSION_1};
use crate::bus::BusDevice;
use crate::memory::GuestMemory;

pub const MMIO_MAGIC: u32 = 0x7472_6976; // "virt"
pub const MMIO_VERSION: u32 = 2;
/// "MVRT": microvirt's vendor ID.
pub const VENDOR_ID: u32 = 0x5452_564d;
/// Offset of the notify register; KVM ioeventfds are registered at base + this.
pub const QUEUE_NOTIFY_OFFSET: u64 = 0x50;
const CONFIG_SPACE_OFFSET: u64 = 0x100;

pub struct MmioTransport {
    pub(super) device: Arc<Mutex<dyn VirtioDevice>>,
    pub(super) mem: GuestMemory,
    pub(super) interrupt: Arc<VirtioInterrupt>,
    pub(super) queues: Vec<Queue>,
    pub(super) queue_select: u32,
    pub(super) device_features_select: u32,
    pub(super) driver_features_select: u32,
    pub(super) driver_features: u64,
    pub(super) status: u32,
    pub(super) config_generation: u32,
    /// Queues whose driver wrote a size the spec forbids (0, above the maximum, not a power of
    /// two): checked here, because virtio-queue logs every such write at error level — a log
    /// any guest could flood — and keeps the old size. Such a queue fails activation (the
    /// device needs a reset). Not persisted: it only matters before DRIVER_OK.
    pub(super) bad_size: Vec<bool>,
}

impl MmioTransport {
    /// The device's config space changed under the guest (a restored clone's new MAC): a new
    /// config generation and the config change interrupt (virtio 1.x §4.2.2), so a driver
    /// reads it again.
    pub fn config_changed(&mut self) {
        self.config_generation = self.config_generation.wrapping_add(1);
        self.interrupt.signal(super::INT_CONFIG_CHANGE);
    }

    pub fn new(
        device: Arc<Mutex<dyn VirtioDevice>>,
        mem: GuestMemory,
        interrupt: Arc<VirtioInterrupt>,
    ) -> Self {
        let queues: Vec<Queue> = {
            let d = device.lock().unwrap_or_else(|p| p.into_inner());
            d.queue_max_sizes()
                .iter()
                .map(|&m| Queue::new(m).expect("queue max size is a power of 2"))
                .collect()
        };
        let queues_len = queues.len();
        MmioTransport {
            device,
            mem,
            interrupt,
            queues,
            queue_select: 0,
            device_features_select: 0,
            driver_features_select: 0,
            driver_features: 0,
            status: 0,
            config_generation: 0,
            bad_size: vec![false; queues_len],
        }
    }

    pub fn status(&self) -> u32 {
        self.status
    }

    pub(super) fn dev(&self) -> std::sync::MutexGuard<'_, dyn VirtioDevice + 'static> {
        self.device.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_select as usize)
    }

    /// Queue registers may only change before the driver is done (§4.2.2.3.2).
    fn queue_config_allowed(&self) -> bool {
        self.status & status::DRIVER_OK == 0 && self.status & status::FAILED == 0
    }

    fn update_queue(&mut self, f: impl FnOnce(&mut Queue)) {
        if !self.queue_config_allowed() {
            tracing::debug!("virtio-mmio: queue register written after DRIVER_OK; ignored");
            return;
        }
        if let Some(q) = self.selected_queue() {
            f(q);
        }
    }

    fn reset(&mut self) {
        self.dev().reset();
        for q in &mut self.queues {
            q.reset();
        }
        self.bad_size.iter_mut().for_each(|b| *b = false);
        self.status = 0;
        self.driver_features = 0;
        self.queue_select = 0;
        self.interrupt.status.store(0, Ordering::SeqCst);
        self.interrupt.needs_reset.store(false, Ordering::SeqCst);
    }

    fn set_needs_reset(&mut self) {
        self.interrupt.device_needs_reset();
    }

    fn write_status(&mut self, v: u32) {
        if v == 0 {
            self.reset();
            return;
        }
        // Bits may only be added, in order: ACKNOWLEDGE, DRIVER, FEATURES_OK, DRIVER_OK.
        let added = v & !self.status;
        if v & self.status != self.status {
            tracing::debug!("virtio-mmio: driver cleared status bits without reset; ignored");
            return;
        }
        if added & status::FAILED != 0 {
            self.status |= status::FAILED;
            return;
        }
        let allowed = match added {
            status::ACKNOWLEDGE => self.status == 0,
            status::DRIVER => self.status == status::ACKNOWLEDGE,
            status::FEATURES_OK => self.status == status::ACKNOWLEDGE | status::DRIVER,
            status::DRIVER_OK => {
                self.status == status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK
            }
            _ => false,
        };
        if !allowed {
            tracing::debug!(
                status = self.status,
                write = v,
                "virtio-mmio: out-of-order status write; ignored"
            );
            return;
        }
        match added {
            status::FEATURES_OK => {
                let offered = self.dev().avail_features();
                // A modern-only device: without VERSION_1, or with features we never offered,
                // FEATURES_OK does not stick and the driver sees negotiation fail.
                if self.driver_features & !offered != 0
                    || self.driver_features & VIRTIO_F_VERSION_1 == 0
                {
                    tracing::warn!(
                        offered = format_args!("{offered:#x}"),
                        acked = format_args!("{:#x}", self.driver_features),
                        "virtio-mmio: feature negotiation failed"
                    );
                    return;
                }
                self.dev().set_acked_features(self.driver_features);
                self.status |= status::FEATURES_OK;
            }
            status::DRIVER_OK => {
                self.status |= status::DRIVER_OK;
                self.activate();
            }
            _ => self.status |= added,
        }
    }

    fn activate(&mut self) {
        for (i, q) in self.queues.iter().enumerate() {
            if q.ready() && (self.bad_size[i] || !q.is_valid(&self.mem)) {
                tracing::warn!(
                    queue = i,
                    "virtio-mmio: queue rings are invalid; device needs reset"
                );
                self.set_needs_reset();
                return;
            }
        }
        // The device gets its own copies; the transport keeps the registers the driver wrote.
        let queues: Vec<Queue> = match self
            .queues
            .iter()
            .map(|q| Queue::try_from(q.state()))
            .collect()
        {
            Ok(q) => q,
            Err(e) => {
                tracing::warn!("virtio-mmio: invalid queue state: {e}");
                self.set_needs_reset();
                return;
            }
        };
        let mem = self.mem.clone();
        let interrupt = self.interrupt.clone();
        let activated = self.dev().activate(mem, queues, interrupt);
        if let Err(e) = activated {
            tracing::warn!("virtio-mmio: activation failed: {e}");
            self.set_needs_reset();
        }
    }

    fn read_reg(&mut self, offset: u64) -> u32 {
        match offset {
            0x000 => MMIO_MAGIC,
            0x004 => MMIO_VERSION,
            0x008 => self.dev().device_type(),
            0x00c => VENDOR_ID,
            0x010 => {
                let f = self.dev().avail_features();
                match self.device_features_select {
                    0 => f as u32,
                    1 => (f >> 32) as u32,
                    _ => 0,
                }
            }
            0x034 => self.selected_queue().map_or(0, |q| q.max_size() as u32),
            0x044 => self.selected_queue().is_some_and(|q| q.ready()) as u32,
            0x060 => self.interrupt.status.load(Ordering::SeqCst),
            0x070 => {
                if self.interrupt.needs_reset.load(Ordering::SeqCst) {
                    self.status |= status::DEVICE_NEEDS_RESET;
                }
                self.status
            }
            0x0fc => self.config_generation,
            _ => {
                tracing::debug!("virtio-mmio: read of unknown register {offset:#x}");
                0
            }
        }
    }

    fn write_reg(&mut self, offset: u64, v: u32) {
        match offset {
            0x014 => self.device_features_select = v,
            0x020 => {
                // Features are only writable between DRIVER and FEATURES_OK.
                if self.status & (status::DRIVER | status::FEATURES_OK) != status::DRIVER {
                    return;
                }
                match self.driver_features_select {
                    0 => self.driver_features = (self.driver_features & !0xffff_ffff) | v as u64,
                    1 => {
                        self.driver_features =
                            (self.driver_features & 0xffff_ffff) | ((v as u64) << 32)
                    }
                    _ => {}
                }
            }
            0x024 => self.driver_features_select = v,
            0x030 => self.queue_select = v,
            0x038 => {
                let sel = self.queue_select as usize;
                let Some(max) = self.queues.get(sel).map(|q| q.max_size() as u32) else {
                    return;
                };
                if !self.queue_config_allowed() {
                    return;
                }
                let valid = v != 0 && v <= max && v.is_power_of_two();
                if valid {
                    self.update_queue(|q| q.set_size(v as u16));
                } else {
                    tracing::debug!(queue = sel, size = v, "virtio-mmio: invalid queue size");
                }
                self.bad_size[sel] = !valid;
            }
            0x044 => self.update_queue(|q| q.set_ready(v == 1)),
            0x050 => {
                // Normally caught by the ioeventfd; reaching here means KVM did not match it.
                if let Some(evt) = self.dev().queue_events().get(v as usize) {
                    let _ = evt.write(1);
                }
            }
            0x064 => self.interrupt.ack(v),
            0x070 => self.write_status(v),
            0x080 => self.update_queue(|q| q.set_desc_table_address(Some(v), None)),
            0x084 => self.update_queue(|q| q.set_desc_table_address(None, Some(v))),
            0x090 => self.update_queue(|q| q.set_avail_ring_address(Some(v), None)),
            0x094 => self.update_queue(|q| q.set_avail_ring_address(None, Some(v))),
            0x0a0 => self.update_queue(|q| q.set_used_ring_address(Some(v), None)),
            0x0a4 => self.update_queue(|q| q.set_used_ring_address(None, Some(v))),
            _ => tracing::debug!("virtio-mmio: write of unknown register {offset:#x}"),
        }
    }
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= CONFIG_SPACE_OFFSET {
            self.dev().read_config(offset - CONFIG_SPACE_OFFSET, data);
            return;
        }
        if data.len() != 4 || !offset.is_multiple_of(4) {
            data.fill(0);
            return;
        }
        let v = self.read_reg(offset);
        data.copy_from_slice(&v.to_le_bytes());
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= CONFIG_SPACE_OFFSET {
            self.dev().write_config(offset - CONFIG_SPACE_OFFSET, data);
            self.config_generation = self.config_generation.wrapping_add(1);
            return;
        }
        if data.len() != 4 || !offset.is_multiple_of(4) {
            return;
        }
        self.write_reg(offset, u32::from_le_bytes(data.try_into().unwrap()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::{ActivateError, DeviceBase, INT_USED_RING};
    use std::sync::atomic::AtomicUsize;
    use vm_memory::GuestAddress;
    use vmm_sys_util::eventfd::EventFd;

    /// A device that records what the transport tells it.
    struct Recorder {
        base: DeviceBase,
        activations: Arc<AtomicUsize>,
        resets: usize,
        active: bool,
    }

    impl VirtioDevice for Recorder {
        fn base(&self) -> &DeviceBase {
            &self.base
        }
        fn base_mut(&mut self) -> &mut DeviceBase {
            &mut self.base
        }
        fn activate(
            &mut self,
            _: GuestMemory,
            queues: Vec<Queue>,
            _: Arc<VirtioInterrupt>,
        ) -> Result<(), ActivateError> {
            assert_eq!(queues.len(), 2);
            self.activations.fetch_add(1, Ordering::SeqCst);
            self.active = true;
            Ok(())
        }
        fn reset(&mut self) {
            self.resets += 1;
            self.active = false;
        }
        fn is_activated(&self) -> bool {
            self.active
        }
        fn queue_states(&self) -> Vec<virtio_queue::QueueState> {
            Vec::new()
        }
    }

    fn setup() -> (
        MmioTransport,
        Arc<Mutex<Recorder>>,
        Arc<AtomicUsize>,
        EventFd,
    ) {
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let activations = Arc::new(AtomicUsize::new(0));
        let dev = Arc::new(Mutex::new(Recorder {
            base: DeviceBase::new(
                2,
                &[16, 8],
                VIRTIO_F_VERSION_1 | 0b101,
                vec![1, 2, 3, 4, 5, 6, 7, 8],
            )
            .unwrap(),
            activations: activations.clone(),
            resets: 0,
            active: false,
        }));
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let t = MmioTransport::new(
            dev.clone(),
            mem,
            VirtioInterrupt::new(irq.try_clone().unwrap()),
        );
        (t, dev, activations, irq)
    }

    fn r(t: &mut MmioTransport, off: u64) -> u32 {
        let mut b = [0u8; 4];
        t.read(off, &mut b);
        u32::from_le_bytes(b)
    }

    fn w(t: &mut MmioTransport, off: u64, v: u32) {
        t.write(off, &v.to_le_bytes());
    }

    fn setup_queue(t: &mut MmioTransport, q: u32, size: u32, base: u64) {
        w(t, 0x30, q);
        w(t, 0x38, size);
        w(t, 0x80, base as u32);
        w(t, 0x90, (base + 0x1000) as u32);
        w(t, 0xa0, (base + 0x2000) as u32);
        w(t, 0x44, 1);
    }

    /// The driver initialisation sequence of VIRTIO 1.2 §3.1.1.
    fn negotiate(t: &mut MmioTransport, features: u64) -> bool {
        w(t, 0x70, 0);
        w(t, 0x70, status::ACKNOWLEDGE);
        w(t, 0x70, status::ACKNOWLEDGE | status::DRIVER);
        w(t, 0x24, 0);
        w(t, 0x20, features as u32);
        w(t, 0x24, 1);
        w(t, 0x20, (features >> 32) as u32);
        w(
            t,
            0x70,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
        );
        r(t, 0x70) & status::FEATURES_OK != 0
    }

    #[test]
    fn identification_registers() {
        let (mut t, ..) = setup();
        assert_eq!(r(&mut t, 0x000), MMIO_MAGIC);
        assert_eq!(r(&mut t, 0x004), 2);
        assert_eq!(r(&mut t, 0x008), 2);
        assert_eq!(r(&mut t, 0x00c), VENDOR_ID);
        w(&mut t, 0x14, 0);
        assert_eq!(r(&mut t, 0x10), 0b101);
        w(&mut t, 0x14, 1);
        assert_eq!(r(&mut t, 0x10), 1);
        w(&mut t, 0x30, 1);
        assert_eq!(r(&mut t, 0x34), 8);
        w(&mut t, 0x30, 7);
        assert_eq!(
            r(&mut t, 0x34),
            0,
            "a queue that does not exist has max size 0"
        );
        let mut b = [0u8; 2];
        t.read(0x102, &mut b);
        assert_eq!(b, [3, 4]);
        t.read(0x1fe, &mut b);
        assert_eq!(b, [0, 0], "beyond the config space reads as zero");
    }

    #[test]
    fn a_queue_size_the_spec_forbids_fails_activation_until_reset() {
        for bad in [15u32, 0, 3, 32, 0xffff] {
            let (mut t, _, activations, _) = setup();
            assert!(negotiate(&mut t, VIRTIO_F_VERSION_1));
            setup_queue(&mut t, 0, bad, 0x10000);
            let st = r(&mut t, 0x70);
            w(&mut t, 0x70, st | status::DRIVER_OK);
            assert_eq!(activations.load(Ordering::SeqCst), 0, "size {bad}");
            assert_ne!(
                r(&mut t, 0x70) & status::DEVICE_NEEDS_RESET,
                0,
                "size {bad}"
            );
            // A valid size after a reset is accepted again.
            assert!(negotiate(&mut t, VIRTIO_F_VERSION_1));
            setup_queue(&mut t, 0, 8, 0x10000);
            let st = r(&mut t, 0x70);
            w(&mut t, 0x70, st | status::DRIVER_OK);
            assert_eq!(activations.load(Ordering::SeqCst), 1, "size {bad} then 8");
        }
    }

    #[test]
    fn full_handshake_activates_once() {
        let (mut t, dev, activations, _) = setup();
        assert!(negotiate(&mut t, VIRTIO_F_VERSION_1 | 0b1));
        assert_eq!(
            dev.lock().unwrap().base.acked_features,
            VIRTIO_F_VERSION_1 | 0b1
        );
        setup_queue(&mut t, 0, 16, 0x10000);
        setup_queue(&mut t, 1, 8, 0x20000);
        w(
            &mut t,
            0x70,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK,
        );
        assert_eq!(activations.load(Ordering::SeqCst), 1);
        assert_eq!(r(&mut t, 0x70) & status::DEVICE_NEEDS_RESET, 0);
        // Queue registers are frozen after DRIVER_OK.
        w(&mut t, 0x30, 0);
        w(&mut t, 0x44, 0);
        assert_eq!(r(&mut t, 0x44), 1);
        // Reset returns everything to the start and tells the device.
        let resets = dev.lock().unwrap().resets;
        w(&mut t, 0x70, 0);
        assert_eq!(r(&mut t, 0x70), 0);
        assert_eq!(r(&mut t, 0x44), 0);
        assert_eq!(dev.lock().unwrap().resets, resets + 1);
        assert!(!dev.lock().unwrap().active);
    }

    #[test]
    fn features_without_version_1_or_not_offered_fail() {
        let (mut t, ..) = setup();
        assert!(!negotiate(&mut t, 0b1), "legacy drivers are refused");
        assert!(
            !negotiate(&mut t, VIRTIO_F_VERSION_1 | 0b10),
            "feature 1 was never offered"
        );
        assert!(negotiate(&mut t, VIRTIO_F_VERSION_1));
    }

    #[test]
    fn out_of_order_status_writes_are_ignored() {
        let (mut t, _, activations, _) = setup();
        w(
            &mut t,
            0x70,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK,
        );
        assert_eq!(r(&mut t, 0x70), 0);
        w(&mut t, 0x70, status::ACKNOWLEDGE);
        w(
            &mut t,
            0x70,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK,
        );
        assert_eq!(r(&mut t, 0x70), status::ACKNOWLEDGE);
        assert_eq!(activations.load(Ordering::SeqCst), 0);
        // FAILED sticks until reset.
        w(&mut t, 0x70, status::ACKNOWLEDGE | status::FAILED);
        assert_ne!(r(&mut t, 0x70) & status::FAILED, 0);
    }

    #[test]
    fn queue_rings_outside_memory_need_reset_not_activation() {
        let (mut t, _, activations, irq) = setup();
        assert!(negotiate(&mut t, VIRTIO_F_VERSION_1));
        setup_queue(&mut t, 0, 16, 0xffff_0000); // beyond the 1 MiB of guest memory
        w(
            &mut t,
            0x70,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK,
        );
        assert_eq!(activations.load(Ordering::SeqCst), 0);
        assert_ne!(r(&mut t, 0x70) & status::DEVICE_NEEDS_RESET, 0);
        assert_eq!(irq.read().unwrap(), 1, "config change interrupt");
        assert_ne!(
            r(&mut t, 0x60) & crate::devices::virtio::INT_CONFIG_CHANGE,
            0
        );
    }

    #[test]
    fn interrupt_ack_clears_bits() {
        let (mut t, ..) = setup();
        t.interrupt.signal(INT_USED_RING);
        assert_eq!(r(&mut t, 0x60), INT_USED_RING);
        w(&mut t, 0x64, INT_USED_RING);
        assert_eq!(r(&mut t, 0x60), 0);
    }

    #[test]
    fn notify_register_reaches_the_queue_event() {
        let (mut t, dev, ..) = setup();
        w(&mut t, 0x50, 1);
        assert_eq!(dev.lock().unwrap().base.queue_evts[1].read().unwrap(), 1);
        w(&mut t, 0x50, 99); // no such queue: ignored
    }

    #[test]
    fn odd_sized_register_accesses_are_harmless() {
        let (mut t, ..) = setup();
        let mut b = [0u8; 2];
        t.read(0x70, &mut b);
        assert_eq!(b, [0, 0]);
        t.write(0x70, &[1]);
        t.write(0x71, &[1, 2, 3, 4]);
        assert_eq!(r(&mut t, 0x70), 0);
    }
}
