//! virtio-rng (VIRTIO 1.2 §5.4, KubeVirt's `rng` device, Firecracker's entropy device): one
//! queue of guest buffers the device fills from the host kernel's random number generator.
//! A guest without RDRAND (or one that distrusts it) seeds its RNG from it at boot, and a
//! restored copy draws fresh bytes that no other copy sees.

pub mod event_handler;
pub mod persist;

use vm_memory::{Address, Bytes, GuestAddress};

use super::{DeviceBase, SingleQueue, TYPE_RNG, VIRTIO_F_VERSION_1};
use crate::memory::GuestMemory;

pub const QUEUE_SIZE: u16 = 64;
/// The most bytes one request gets, whatever buffers the guest offers: its kernel asks for
/// at most a page at a time, and a hostile guest cannot make one request drain the host.
pub const MAX_REQUEST_BYTES: u32 = 64 << 10;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RngCounters {
    pub requests: u64,
    pub bytes: u64,
    /// Requests refused: a read-only buffer, one outside guest memory, or no random bytes.
    pub errors: u64,
}

pub struct Rng {
    pub id: String,
    base: DeviceBase,
    active: Option<SingleQueue>,
    pub counters: RngCounters,
}

impl Rng {
    pub fn new(id: String) -> std::io::Result<Rng> {
        Ok(Rng {
            id,
            base: DeviceBase::new(TYPE_RNG, &[QUEUE_SIZE], VIRTIO_F_VERSION_1, Vec::new())?,
            active: None,
            counters: RngCounters::default(),
        })
    }

    /// Fills every available request; interrupts the guest once at the end.
    pub fn process_queue(&mut self) {
        let Some(active) = self.active.as_mut() else {
            return;
        };
        active.serve(&self.id, |mem, descs| {
            let buffers: Vec<_> = descs
                .iter()
                .map(|d| (d.addr(), d.len(), d.is_write_only()))
                .collect();
            fill(mem, &buffers, &mut self.counters)
        });
    }
}

/// Writes random bytes into a request's buffers (address, length, device-writable); returns
/// how many. A request with a buffer the device may not write, or one outside guest memory,
/// gets nothing: the spec has no error status for this device, and a partly filled request
/// would tell a confused guest less than an empty one.
fn fill(mem: &GuestMemory, descs: &[(GuestAddress, u32, bool)], counters: &mut RngCounters) -> u32 {
    counters.requests += 1;
    if descs.iter().any(|(_, _, writable)| !writable) {
        counters.errors += 1;
        return 0;
    }
    let mut written = 0u32;
    let mut bytes = vec![0u8; 4096];
    for &(addr, len, _) in descs {
        let len = len.min(MAX_REQUEST_BYTES - written);
        let mut done = 0u32;
        while done < len {
            let n = (len - done).min(bytes.len() as u32) as usize;
            let chunk = &mut bytes[..n];
            let stored = getrandom::fill(chunk)
                .map_err(|e| e.to_string())
                .and_then(|_| {
                    let at = addr
                        .checked_add(u64::from(done))
                        .ok_or_else(|| "address overflow".to_string())?;
                    mem.write_slice(chunk, at).map_err(|e| e.to_string())
                });
            if let Err(e) = stored {
                tracing::debug!("virtio-rng: request refused: {e}");
                counters.errors += 1;
                return 0;
            }
            done += n as u32;
        }
        written += len;
        if written == MAX_REQUEST_BYTES {
            break;
        }
    }
    counters.bytes += u64::from(written);
    written
}

super::single_queue_device!(Rng);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn memory() -> GuestMemory {
        GuestMemory::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap()
    }

    #[test]
    fn writable_buffers_are_filled_up_to_the_request_limit() {
        let mem = memory();
        let mut c = RngCounters::default();
        let n = fill(
            &mem,
            &[
                (GuestAddress(0x1000), 32, true),
                (GuestAddress(0x2000), 100, true),
            ],
            &mut c,
        );
        assert_eq!(n, 132);
        let mut got = [0u8; 32];
        mem.read_slice(&mut got, GuestAddress(0x1000)).unwrap();
        assert_ne!(got, [0u8; 32], "32 random bytes are not all zero");
        let big = fill(&mem, &[(GuestAddress(0), 512 << 10, true)], &mut c);
        assert_eq!(big, MAX_REQUEST_BYTES);
        assert_eq!(c.requests, 2);
        assert_eq!(c.bytes, 132 + u64::from(MAX_REQUEST_BYTES));
    }

    #[test]
    fn a_read_only_or_outside_buffer_gets_nothing() {
        let mem = memory();
        let mut c = RngCounters::default();
        assert_eq!(fill(&mem, &[(GuestAddress(0x1000), 16, false)], &mut c), 0);
        assert_eq!(
            fill(&mem, &[(GuestAddress((1 << 20) - 8), 16, true)], &mut c),
            0
        );
        assert_eq!(
            fill(&mem, &[(GuestAddress(u64::MAX - 4), 16, true)], &mut c),
            0
        );
        assert_eq!(c.errors, 3);
        assert_eq!(c.bytes, 0);
    }

    proptest! {
        /// Whatever buffers a guest offers, the device never writes outside them, never
        /// reports more than it wrote, and never more than the limit.
        #[test]
        fn any_request_stays_inside_its_buffers(
            descs in proptest::collection::vec((0u64..(2 << 20), 0u32..(128 << 10), any::<bool>()), 0..6)
        ) {
            let mem = memory();
            let descs: Vec<_> = descs.into_iter().map(|(a, l, w)| (GuestAddress(a), l, w)).collect();
            let mut c = RngCounters::default();
            let n = fill(&mem, &descs, &mut c);
            prop_assert!(n <= MAX_REQUEST_BYTES);
            let offered: u64 = descs.iter().map(|d| u64::from(d.1)).sum();
            prop_assert!(u64::from(n) <= offered);
            prop_assert_eq!(c.bytes, u64::from(n));
        }
    }
}
