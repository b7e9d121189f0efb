//! virtio-net on a TAP device: MAC and link status in config space, checksum and TSO offloads
//! passed through with the virtio-net header, mergeable receive buffers.
//!
//! Receive only ever fills buffers the guest made available: when none are left the frame
//! waits in the TAP's kernel queue (not in a VMM buffer that could drop it) and the device
//! re-arms the queue notification; a refill notification resumes reception. No polling.

mod event_handler;
pub mod persist;
pub mod tap;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestMemoryBackend};

pub use tap::{Tap, TapError, VNET_HDR_LEN};

use super::{
    ActivateError, DeviceBase, VirtioDevice, VirtioInterrupt, INT_USED_RING, TYPE_NET,
    VIRTIO_F_VERSION_1,
};
use crate::memory::GuestMemory;

pub const VIRTIO_NET_F_CSUM: u64 = 1 << 0;
pub const VIRTIO_NET_F_GUEST_CSUM: u64 = 1 << 1;
pub const VIRTIO_NET_F_MAC: u64 = 1 << 5;
pub const VIRTIO_NET_F_GUEST_TSO4: u64 = 1 << 7;
pub const VIRTIO_NET_F_GUEST_TSO6: u64 = 1 << 8;
pub const VIRTIO_NET_F_HOST_TSO4: u64 = 1 << 11;
pub const VIRTIO_NET_F_HOST_TSO6: u64 = 1 << 12;
pub const VIRTIO_NET_F_MRG_RXBUF: u64 = 1 << 15;
pub const VIRTIO_NET_F_STATUS: u64 = 1 << 16;
pub const VIRTIO_NET_S_LINK_UP: u16 = 1;

pub const QUEUE_SIZE: u16 = 256;
const RX: usize = 0;
const TX: usize = 1;
/// Largest frame with its header: a 64 KiB GSO frame plus Ethernet and VLAN headers.
pub const MAX_FRAME: usize = VNET_HDR_LEN + 65_535 + 14 + 4;

pub use crate::config::MacAddr;

/// A RARP "request reverse" frame from `mac` (RFC 903), padded to Ethernet's minimum and
/// preceded by the zero virtio-net header the TAP expects.
pub fn rarp_frame(mac: MacAddr) -> Vec<u8> {
    let mut f = vec![0u8; VNET_HDR_LEN];
    f.extend_from_slice(&[0xff; 6]);
    f.extend_from_slice(&mac.0);
    f.extend_from_slice(&[0x80, 0x35]); // EtherType RARP
    f.extend_from_slice(&[0, 1, 0x08, 0, 6, 4, 0, 3]); // Ethernet/IPv4, op 3: request reverse
    f.extend_from_slice(&mac.0); // sender hardware address
    f.extend_from_slice(&[0; 4]);
    f.extend_from_slice(&mac.0); // target hardware address
    f.extend_from_slice(&[0; 4]);
    f.resize(VNET_HDR_LEN + 60, 0);
    f
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NetCounters {
    pub rx_frames: u64,
    pub rx_bytes: u64,
    pub tx_frames: u64,
    pub tx_bytes: u64,
    /// Frames the guest's buffers could not hold or that arrived in malformed chains.
    pub rx_errors: u64,
    pub tx_errors: u64,
}

pub struct Net {
    pub id: String,
    tap: Tap,
    mac: MacAddr,
    base: DeviceBase,
    active: Option<Active>,
    /// One frame read from the TAP that has not found guest buffers yet.
    rx_frame: Vec<u8>,
    rx_len: Option<usize>,
    pub counters: NetCounters,
}

struct Active {
    mem: GuestMemory,
    rx: Queue,
    tx: Queue,
    interrupt: Arc<VirtioInterrupt>,
}

impl Net {
    pub fn new(id: String, tap: Tap, mac: MacAddr) -> std::io::Result<Net> {
        let mut config = vec![0u8; 10];
        config[0..6].copy_from_slice(&mac.0);
        config[6..8].copy_from_slice(&VIRTIO_NET_S_LINK_UP.to_le_bytes());
        config[8..10].copy_from_slice(&1u16.to_le_bytes()); // max_virtqueue_pairs
        let avail_features = VIRTIO_F_VERSION_1
            | VIRTIO_NET_F_CSUM
            | VIRTIO_NET_F_GUEST_CSUM
            | VIRTIO_NET_F_MAC
            | VIRTIO_NET_F_GUEST_TSO4
            | VIRTIO_NET_F_GUEST_TSO6
            | VIRTIO_NET_F_HOST_TSO4
            | VIRTIO_NET_F_HOST_TSO6
            | VIRTIO_NET_F_MRG_RXBUF
            | VIRTIO_NET_F_STATUS;
        Ok(Net {
            id,
            tap,
            mac,
            base: DeviceBase::new(TYPE_NET, &[QUEUE_SIZE, QUEUE_SIZE], avail_features, config)?,
            active: None,
            rx_frame: vec![0u8; MAX_FRAME],
            rx_len: None,
            counters: NetCounters::default(),
        })
    }

    pub fn mac(&self) -> MacAddr {
        self.mac
    }

    pub fn tap(&self) -> &Tap {
        &self.tap
    }

    /// Tells the network where the guest now is, after a migration: a RARP from the guest's
    /// MAC written into the TAP, as if the guest had sent it, so bridges and switches move the
    /// MAC to this port at once instead of when the guest next talks. The guest driver is not
    /// involved (no VIRTIO_NET_F_GUEST_ANNOUNCE, which needs a control queue), so this works
    /// for every guest.
    pub fn announce(&self) -> std::io::Result<()> {
        self.tap.write(&rarp_frame(self.mac))?;
        Ok(())
    }

    /// Moves frames from the TAP into available receive buffers until either runs out.
    pub fn process_rx(&mut self) {
        let mut delivered = false;
        loop {
            if self.active.is_none() {
                return;
            }
            if self.rx_len.is_none() {
                match self.tap.read(&mut self.rx_frame) {
                    Ok(n) if n > VNET_HDR_LEN => self.rx_len = Some(n),
                    Ok(_) => continue, // runt: nothing to deliver
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => {
                        tracing::warn!(nic = %self.id, "tap read: {e}");
                        break;
                    }
                }
            }
            match self.deliver_rx() {
                RxOutcome::Delivered => {
                    delivered = true;
                    self.rx_len = None;
                }
                RxOutcome::Dropped => self.rx_len = None,
                RxOutcome::NoBuffers(seen) => {
                    let active = self.active.as_mut().unwrap();
                    // Re-arm the notification, then look again: buffers the driver added
                    // after our attempt may not come with a kick. Buffers we already saw and
                    // put back (too few for this frame) do not count as new.
                    let _ = active.rx.enable_notification(&active.mem);
                    match active.rx.avail_idx(&active.mem, Ordering::Acquire) {
                        Ok(now) if now.0 != seen => continue,
                        _ => break,
                    }
                }
                RxOutcome::Broken => return,
            }
        }
        if delivered {
            let active = self.active.as_mut().unwrap();
            if active.rx.needs_notification(&active.mem).unwrap_or(true) {
                active.interrupt.signal(INT_USED_RING);
            }
        }
    }

    fn deliver_rx(&mut self) -> RxOutcome {
        let len = self.rx_len.unwrap();
        let mergeable = self.base.acked(VIRTIO_NET_F_MRG_RXBUF);
        let active = self.active.as_mut().unwrap();
        let seen = match active.rx.avail_idx(&active.mem, Ordering::Acquire) {
            Ok(i) => i.0,
            Err(_) => {
                active.interrupt.device_needs_reset();
                return RxOutcome::Broken;
            }
        };
        let frame = &self.rx_frame[..len];
        let mut used: Vec<(u16, u32)> = Vec::new();
        let mut first_hdr = None;
        let mut written = 0usize;
        while written < len {
            let chain = match active.rx.iter(&active.mem) {
                Ok(mut it) => it.next(),
                Err(e) => {
                    tracing::warn!(nic = %self.id, "virtio-net: broken rx ring ({e}); device needs reset");
                    active.interrupt.device_needs_reset();
                    return RxOutcome::Broken;
                }
            };
            let Some(chain) = chain else {
                // Not enough buffers for the whole frame: put back what we took and wait.
                for _ in 0..used.len() {
                    active.rx.go_to_previous_position();
                }
                return RxOutcome::NoBuffers(seen);
            };
            let head = chain.head_index();
            let mut n_chain = 0u32;
            let mut bad = false;
            for d in chain {
                if !d.is_write_only() {
                    bad = true;
                    break;
                }
                let n = (d.len() as usize).min(len - written);
                if n == 0 {
                    break;
                }
                if active
                    .mem
                    .write_slice(&frame[written..written + n], d.addr())
                    .is_err()
                {
                    bad = true;
                    break;
                }
                if first_hdr.is_none() {
                    first_hdr = Some(d.addr());
                }
                written += n;
                n_chain += n as u32;
            }
            if bad || (n_chain as usize) < VNET_HDR_LEN.min(len) && used.is_empty() {
                // A malformed chain fails this frame only.
                let _ = active.rx.add_used(&active.mem, head, 0);
                for (h, _) in used.drain(..) {
                    let _ = active.rx.add_used(&active.mem, h, 0);
                }
                self.counters.rx_errors += 1;
                return RxOutcome::Dropped;
            }
            used.push((head, n_chain));
            if !mergeable && written < len {
                // Without mergeable buffers a frame must fit one chain.
                for (h, _) in used.drain(..) {
                    let _ = active.rx.add_used(&active.mem, h, 0);
                }
                self.counters.rx_errors += 1;
                return RxOutcome::Dropped;
            }
        }
        // num_buffers sits at offset 10 of the header in the first buffer.
        if let Some(hdr) = first_hdr {
            let _ = active
                .mem
                .write_obj(used.len() as u16, vm_memory::GuestAddress(hdr.0 + 10));
        }
        for (h, n) in used {
            if active.rx.add_used(&active.mem, h, n).is_err() {
                active.interrupt.device_needs_reset();
                return RxOutcome::Broken;
            }
        }
        self.counters.rx_frames += 1;
        self.counters.rx_bytes += (len - VNET_HDR_LEN) as u64;
        RxOutcome::Delivered
    }

    /// Sends every available transmit chain to the TAP, then interrupts once. While it drains
    /// the ring the driver is told not to kick (VRING_USED_F_NO_NOTIFY): a guest that keeps
    /// adding frames then costs no exit per frame. Notifications are switched back on before
    /// it stops, and chains that arrived in between are sent, so none waits for a kick that
    /// the driver did not send.
    pub fn process_tx(&mut self) {
        let mut completed = false;
        loop {
            let Some(active) = self.active.as_mut() else {
                return;
            };
            if active.tx.disable_notification(&active.mem).is_err() {
                active.interrupt.device_needs_reset();
                return;
            }
            match self.transmit_available() {
                Ok(sent) => completed |= sent,
                Err(Broken) => return,
            }
            let active = self.active.as_mut().unwrap();
            match active.tx.enable_notification(&active.mem) {
                Ok(true) => continue,
                Ok(false) => break,
                Err(_) => {
                    active.interrupt.device_needs_reset();
                    return;
                }
            }
        }
        let active = self.active.as_mut().unwrap();
        if completed && active.tx.needs_notification(&active.mem).unwrap_or(true) {
            active.interrupt.signal(INT_USED_RING);
        }
    }

    /// Writes each available transmit chain to the TAP and marks it used; whether any was.
    fn transmit_available(&mut self) -> Result<bool, Broken> {
        let active = self.active.as_mut().ok_or(Broken)?;
        let mut completed = false;
        // One chain's buffers as host pointers into guest RAM, refilled per chain. Guest RAM
        // is mmap'd and stays mapped while `active.mem` holds it, through the writev below; the
        // slices' pointer guards (which matter only for memory mapped on demand, as Xen's
        // grants) are therefore not kept.
        let mut iovecs: Vec<libc::iovec> = Vec::with_capacity(8);
        loop {
            let chain = match active.tx.iter(&active.mem) {
                Ok(mut it) => it.next(),
                Err(e) => {
                    tracing::warn!(nic = %self.id, "virtio-net: broken tx ring ({e}); device needs reset");
                    active.interrupt.device_needs_reset();
                    return Err(Broken);
                }
            };
            let Some(chain) = chain else { break };
            let head = chain.head_index();
            // Gather the chain as iovecs straight into guest memory: one writev, no copy.
            // Buffers that follow each other in memory (a header right before its frame)
            // become one iovec.
            iovecs.clear();
            let mut total = 0usize;
            let mut ok = true;
            for d in chain {
                let n = d.len() as usize;
                total += n;
                if d.is_write_only() || total > MAX_FRAME {
                    ok = false;
                    break;
                }
                let Ok(slice) = active.mem.get_slice(d.addr(), n) else {
                    ok = false;
                    break;
                };
                let at = slice.ptr_guard().as_ptr() as usize;
                match iovecs.last_mut() {
                    Some(last) if last.iov_base as usize + last.iov_len == at => last.iov_len += n,
                    _ => iovecs.push(libc::iovec {
                        iov_base: at as *mut libc::c_void,
                        iov_len: n,
                    }),
                }
            }
            if ok && total > VNET_HDR_LEN {
                match self.tap.writev(&iovecs) {
                    Ok(_) => {
                        self.counters.tx_frames += 1;
                        self.counters.tx_bytes += (total - VNET_HDR_LEN) as u64;
                    }
                    Err(e) => {
                        tracing::debug!(nic = %self.id, "tap write: {e}");
                        self.counters.tx_errors += 1;
                    }
                }
            } else {
                self.counters.tx_errors += 1;
            }
            if active.tx.add_used(&active.mem, head, 0).is_err() {
                active.interrupt.device_needs_reset();
                return Err(Broken);
            }
            completed = true;
        }
        Ok(completed)
    }

    fn tap_offload_flags(&self) -> u32 {
        let f = self.base.acked_features;
        let mut flags = 0;
        if f & VIRTIO_NET_F_GUEST_CSUM != 0 {
            flags |= tap::TUN_F_CSUM;
            if f & VIRTIO_NET_F_GUEST_TSO4 != 0 {
                flags |= tap::TUN_F_TSO4;
            }
            if f & VIRTIO_NET_F_GUEST_TSO6 != 0 {
                flags |= tap::TUN_F_TSO6;
            }
        }
        flags
    }
}

/// The ring cannot be walked: the device has asked for a reset.
struct Broken;

enum RxOutcome {
    Delivered,
    Dropped,
    /// Not enough buffers; carries the available index seen when trying.
    NoBuffers(u16),
    Broken,
}

impl VirtioDevice for Net {
    fn base(&self) -> &DeviceBase {
        &self.base
    }
    fn base_mut(&mut self) -> &mut DeviceBase {
        &mut self.base
    }
    fn activate(
        &mut self,
        mem: GuestMemory,
        queues: Vec<Queue>,
        interrupt: Arc<VirtioInterrupt>,
    ) -> Result<(), ActivateError> {
        let mut it = queues.into_iter();
        let (Some(rx), Some(tx)) = (it.next(), it.next()) else {
            return Err(ActivateError::BadQueue(RX));
        };
        if !rx.ready() {
            return Err(ActivateError::BadQueue(RX));
        }
        if !tx.ready() {
            return Err(ActivateError::BadQueue(TX));
        }
        self.tap
            .set_offload(self.tap_offload_flags())
            .map_err(|e| {
                ActivateError::Backend(format!("tap {}: TUNSETOFFLOAD: {e}", self.tap.name))
            })?;
        self.active = Some(Active {
            mem,
            rx,
            tx,
            interrupt,
        });
        self.base.announce_activation();
        Ok(())
    }
    fn reset(&mut self) {
        self.active = None;
        self.base.acked_features = 0;
        self.rx_len = None;
    }
    fn is_activated(&self) -> bool {
        self.active.is_some()
    }
    fn queue_states(&self) -> Vec<virtio_queue::QueueState> {
        self.active
            .iter()
            .flat_map(|a| [a.rx.state(), a.tx.state()])
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mac_parsing() {
        assert_eq!(
            "52:54:00:12:34:56".parse::<MacAddr>().unwrap().0,
            [0x52, 0x54, 0, 0x12, 0x34, 0x56]
        );
        assert!("01:00:5e:00:00:01"
            .parse::<MacAddr>()
            .unwrap_err()
            .contains("multicast"));
        assert!("00:00:00:00:00:00"
            .parse::<MacAddr>()
            .unwrap_err()
            .contains("all-zero"));
        assert!("52:54:00:12:34".parse::<MacAddr>().is_err());
        assert!("52:54:00:12:34:zz"
            .parse::<MacAddr>()
            .unwrap_err()
            .contains("not a hex byte"));
        assert_eq!(
            MacAddr([0x52, 0x54, 0, 1, 2, 3]).to_string(),
            "52:54:00:01:02:03"
        );
    }
}
