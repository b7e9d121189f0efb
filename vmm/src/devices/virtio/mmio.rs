//! The virtio-mmio transport, version 2 (VIRTIO 1.2 §4.2.2): register file, feature
//! negotiation, the device status state machine, queue setup and interrupt status/ack.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use virtio_queue::{Queue, QueueT};

use super::{status, VirtioDevice, VirtioInterrupt, VIRTIO_F_VERSION_1};
use crate::bus::BusDevice;
use crate::vm::GuestMemory;

pub const MMIO_MAGIC: u32 = 0x7472_6976; // "virt"
pub const MMIO_VERSION: u32 = 2;
/// "MVRT": microvirt's vendor ID.
pub const VENDOR_ID: u32 = 0x5452_564d;
/// Offset of the notify register; KVM ioeventfds are registered at base + this.
pub const QUEUE_NOTIFY_OFFSET: u64 = 0x50;
const CONFIG_SPACE_OFFSET: u64 = 0x100;

pub struct MmioTransport {
    device: Arc<Mutex<dyn VirtioDevice>>,
    mem: GuestMemory,
    interrupt: Arc<VirtioInterrupt>,
    queues: Vec<Queue>,
    queue_select: u32,
    device_features_select: u32,
    driver_features_select: u32,
    driver_features: u64,
    status: u32,
    config_generation: u32,
}

impl MmioTransport {
    pub fn new(
        device: Arc<Mutex<dyn VirtioDevice>>,
        mem: GuestMemory,
        interrupt: Arc<VirtioInterrupt>,
    ) -> Self {
        let queues = {
            let d = device.lock().unwrap_or_else(|p| p.into_inner());
            d.queue_max_sizes()
                .iter()
                .map(|&m| Queue::new(m).expect("queue max size is a power of 2"))
                .collect()
        };
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
        }
    }

    pub fn status(&self) -> u32 {
        self.status
    }

    fn dev(&self) -> std::sync::MutexGuard<'_, dyn VirtioDevice + 'static> {
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
            if q.ready() && !q.is_valid(&self.mem) {
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
            0x038 => self.update_queue(|q| q.set_size(v as u16)),
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
