//! Address-range dispatch of port I/O and MMIO exits to devices.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// A device on a bus: `offset` is relative to the range the device was inserted at.
pub trait BusDevice: Send {
    fn read(&mut self, offset: u64, data: &mut [u8]);
    fn write(&mut self, offset: u64, data: &[u8]);
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    #[error("bus range {base:#x}+{len:#x} is empty or overlaps a device already present")]
    Overlap { base: u64, len: u64 },
}

struct Range {
    len: u64,
    device: Arc<Mutex<dyn BusDevice>>,
}

/// Built before the vCPUs start and read-only afterwards, so lookups take no lock.
#[derive(Default)]
pub struct Bus {
    ranges: BTreeMap<u64, Range>,
}

impl Bus {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(
        &mut self,
        base: u64,
        len: u64,
        device: Arc<Mutex<dyn BusDevice>>,
    ) -> Result<(), BusError> {
        let end = base
            .checked_add(len)
            .filter(|_| len > 0)
            .ok_or(BusError::Overlap { base, len })?;
        if let Some((b, r)) = self.ranges.range(..end).next_back() {
            if b + r.len > base {
                return Err(BusError::Overlap { base, len });
            }
        }
        self.ranges.insert(base, Range { len, device });
        Ok(())
    }

    fn find(&self, addr: u64) -> Option<(u64, &Range)> {
        let (base, r) = self.ranges.range(..=addr).next_back()?;
        (addr - base < r.len).then_some((addr - base, r))
    }

    /// Returns false when no device claims `addr`.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr) {
            Some((off, r)) => {
                r.device
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .read(off, data);
                true
            }
            None => false,
        }
    }

    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr) {
            Some((off, r)) => {
                r.device
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .write(off, data);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Recorder(Vec<(u64, u8)>);
    impl BusDevice for Recorder {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.0.push((offset, data[0]));
        }
    }

    #[test]
    fn dispatches_by_range_with_offsets() {
        let mut bus = Bus::new();
        let d = Arc::new(Mutex::new(Recorder(vec![])));
        bus.insert(0x3f8, 8, d.clone()).unwrap();
        let mut b = [0u8; 1];
        assert!(bus.read(0x3fd, &mut b));
        assert_eq!(b[0], 5);
        assert!(bus.write(0x3f8, &[0x41]));
        assert!(!bus.write(0x400, &[0]));
        assert!(!bus.read(0x3f7, &mut b));
        assert_eq!(d.lock().unwrap().0, vec![(0, 0x41)]);
    }

    #[test]
    fn rejects_overlaps_and_empty_ranges() {
        let mut bus = Bus::new();
        let d = Arc::new(Mutex::new(Recorder(vec![])));
        bus.insert(0x100, 0x10, d.clone()).unwrap();
        assert!(bus.insert(0x108, 4, d.clone()).is_err());
        assert!(bus.insert(0xf8, 0x10, d.clone()).is_err());
        assert!(bus.insert(0x200, 0, d.clone()).is_err());
        assert!(bus.insert(u64::MAX, 2, d.clone()).is_err());
        bus.insert(0x110, 4, d.clone()).unwrap();
        bus.insert(0xf0, 0x10, d).unwrap();
    }
}
