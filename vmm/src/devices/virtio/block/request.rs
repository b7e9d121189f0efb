//! Parsing virtio-blk requests out of descriptor chains. Everything here is guest-controlled:
//! every address and length is checked against guest memory and the device's limits before any
//! I/O happens, and a malformed request becomes an error for that request only.

use virtio_queue::desc::split::Descriptor;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};

pub const SECTOR_SHIFT: u32 = 9;
pub const SECTOR_SIZE: u64 = 1 << SECTOR_SHIFT;

pub const VIRTIO_BLK_T_IN: u32 = 0;
pub const VIRTIO_BLK_T_OUT: u32 = 1;
pub const VIRTIO_BLK_T_FLUSH: u32 = 4;
pub const VIRTIO_BLK_T_GET_ID: u32 = 8;
pub const VIRTIO_BLK_T_DISCARD: u32 = 11;
pub const VIRTIO_BLK_T_WRITE_ZEROES: u32 = 13;

pub const VIRTIO_BLK_S_OK: u8 = 0;
pub const VIRTIO_BLK_S_IOERR: u8 = 1;
pub const VIRTIO_BLK_S_UNSUPP: u8 = 2;

/// Length of the serial returned by GET_ID.
pub const VIRTIO_BLK_ID_BYTES: u32 = 20;
/// A discard / write-zeroes segment: sector u64, num_sectors u32, flags u32.
pub const SEGMENT_SIZE: u32 = 16;
pub const WRITE_ZEROES_FLAG_UNMAP: u32 = 1;
/// Discard / write-zeroes segments per request: what the device advertises
/// (max_discard_seg, max_write_zeroes_seg). A guest that sends more is refused, not served:
/// 126 descriptors of 64 KiB would otherwise be half a million hole punches in one request.
pub const MAX_ZEROING_SEGMENTS: u64 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestType {
    In,
    Out,
    Flush,
    GetId,
    Discard,
    WriteZeroes,
    Unsupported(u32),
}

impl From<u32> for RequestType {
    fn from(v: u32) -> Self {
        match v {
            VIRTIO_BLK_T_IN => RequestType::In,
            VIRTIO_BLK_T_OUT => RequestType::Out,
            VIRTIO_BLK_T_FLUSH => RequestType::Flush,
            VIRTIO_BLK_T_GET_ID => RequestType::GetId,
            VIRTIO_BLK_T_DISCARD => RequestType::Discard,
            VIRTIO_BLK_T_WRITE_ZEROES => RequestType::WriteZeroes,
            other => RequestType::Unsupported(other),
        }
    }
}

/// Limits the device advertised (seg_max, size_max) and the disk's size.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub seg_max: u32,
    pub size_max: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub kind: RequestType,
    pub sector: u64,
    /// Data buffers in guest memory, in order.
    pub data: Vec<(GuestAddress, u32)>,
    pub status: GuestAddress,
}

impl Request {
    pub fn data_len(&self) -> u64 {
        self.data.iter().map(|(_, l)| *l as u64).sum()
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RequestError {
    #[error("descriptor chain is empty or too short")]
    ShortChain,
    #[error("request header is not a device-readable descriptor of at least 16 bytes")]
    BadHeader,
    #[error("status is not a device-writable descriptor of at least 1 byte")]
    BadStatus,
    #[error("a descriptor lies outside guest memory")]
    OutOfMemory,
    #[error("data descriptor has the wrong direction for the request")]
    WrongDirection,
    #[error("{0} data segments exceed seg_max")]
    TooManySegments(usize),
    #[error("segment of {0} bytes exceeds size_max")]
    SegmentTooLarge(u32),
    #[error("data length is not a multiple of the sector size")]
    Unaligned,
    #[error("data buffers are too small for the request")]
    ShortBuffer,
    #[error("{0} discard/write-zeroes segments; the device accepts {MAX_ZEROING_SEGMENTS}")]
    TooManyZeroingSegments(u64),
}

impl RequestError {
    /// Where to put the error status when the chain still has a usable status byte.
    pub fn status_reportable(&self) -> bool {
        !matches!(
            self,
            RequestError::ShortChain | RequestError::BadStatus | RequestError::OutOfMemory
        )
    }
}

fn in_memory<M: GuestMemoryBackend>(mem: &M, d: &Descriptor) -> bool {
    d.len() == 0 || mem.check_range(d.addr(), d.len() as usize)
}

/// Parses a chain (already collected into descriptors) into a request. On error returns the
/// status byte's address when one could be identified, so the error can be reported.
pub fn parse<M: GuestMemoryBackend>(
    mem: &M,
    descs: &[Descriptor],
    limits: Limits,
) -> Result<Request, (RequestError, Option<GuestAddress>)> {
    let (header, rest) = descs
        .split_first()
        .ok_or((RequestError::ShortChain, None))?;
    let (status, data) = rest.split_last().ok_or((RequestError::ShortChain, None))?;
    if !status.is_write_only() || status.len() < 1 || !in_memory(mem, status) {
        return Err((RequestError::BadStatus, None));
    }
    // The status byte is the last byte of the last descriptor.
    let status_addr = status
        .addr()
        .checked_add(status.len() as u64 - 1)
        .ok_or((RequestError::BadStatus, None))?;
    let fail = |e| Err((e, Some(status_addr)));
    if header.is_write_only() || header.len() < 16 || !in_memory(mem, header) {
        return fail(RequestError::BadHeader);
    }
    let kind_raw: u32 = mem
        .read_obj(header.addr())
        .map_err(|_| (RequestError::BadHeader, Some(status_addr)))?;
    let sector: u64 = mem
        .read_obj(header.addr().unchecked_add(8))
        .map_err(|_| (RequestError::BadHeader, Some(status_addr)))?;
    let kind = RequestType::from(kind_raw);
    if data.len() > limits.seg_max as usize {
        return fail(RequestError::TooManySegments(data.len()));
    }
    let mut buffers = Vec::with_capacity(data.len());
    for d in data {
        if !in_memory(mem, d) {
            return fail(RequestError::OutOfMemory);
        }
        if d.len() > limits.size_max {
            return fail(RequestError::SegmentTooLarge(d.len()));
        }
        let device_writes = matches!(kind, RequestType::In | RequestType::GetId);
        if d.is_write_only() != device_writes
            && !matches!(kind, RequestType::Unsupported(_) | RequestType::Flush)
        {
            return fail(RequestError::WrongDirection);
        }
        buffers.push((d.addr(), d.len()));
    }
    let req = Request {
        kind,
        sector,
        data: buffers,
        status: status_addr,
    };
    let len = req.data_len();
    match kind {
        RequestType::In | RequestType::Out if !len.is_multiple_of(SECTOR_SIZE) => {
            return fail(RequestError::Unaligned)
        }
        RequestType::GetId if len < VIRTIO_BLK_ID_BYTES as u64 => {
            return fail(RequestError::ShortBuffer)
        }
        RequestType::Discard | RequestType::WriteZeroes
            if len == 0 || !len.is_multiple_of(SEGMENT_SIZE as u64) =>
        {
            return fail(RequestError::ShortBuffer)
        }
        RequestType::Discard | RequestType::WriteZeroes
            if len / SEGMENT_SIZE as u64 > MAX_ZEROING_SEGMENTS =>
        {
            return fail(RequestError::TooManyZeroingSegments(
                len / SEGMENT_SIZE as u64,
            ))
        }
        _ => {}
    }
    Ok(req)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use virtio_bindings::bindings::virtio_ring::VRING_DESC_F_WRITE;
    use vm_memory::GuestMemoryMmap;

    const LIMITS: Limits = Limits {
        seg_max: 8,
        size_max: 1 << 20,
    };

    fn mem() -> GuestMemoryMmap<()> {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap()
    }

    fn d(addr: u64, len: u32, write: bool) -> Descriptor {
        Descriptor::new(
            addr,
            len,
            if write { VRING_DESC_F_WRITE as u16 } else { 0 },
            0,
        )
    }

    fn header(m: &GuestMemoryMmap<()>, at: u64, kind: u32, sector: u64) {
        m.write_obj(kind, GuestAddress(at)).unwrap();
        m.write_obj(sector, GuestAddress(at + 8)).unwrap();
    }

    #[test]
    fn parses_read_write_flush_getid() {
        let m = mem();
        header(&m, 0x1000, VIRTIO_BLK_T_IN, 7);
        let r = parse(
            &m,
            &[
                d(0x1000, 16, false),
                d(0x2000, 1024, true),
                d(0x3000, 1, true),
            ],
            LIMITS,
        )
        .unwrap();
        assert_eq!(
            (r.kind, r.sector, r.data_len(), r.status),
            (RequestType::In, 7, 1024, GuestAddress(0x3000))
        );
        header(&m, 0x1000, VIRTIO_BLK_T_OUT, 0);
        let r = parse(
            &m,
            &[
                d(0x1000, 16, false),
                d(0x2000, 512, false),
                d(0x3000, 1, true),
            ],
            LIMITS,
        )
        .unwrap();
        assert_eq!(r.kind, RequestType::Out);
        header(&m, 0x1000, VIRTIO_BLK_T_FLUSH, 0);
        assert_eq!(
            parse(&m, &[d(0x1000, 16, false), d(0x3000, 1, true)], LIMITS)
                .unwrap()
                .kind,
            RequestType::Flush
        );
        header(&m, 0x1000, VIRTIO_BLK_T_GET_ID, 0);
        let r = parse(
            &m,
            &[
                d(0x1000, 16, false),
                d(0x2000, 20, true),
                d(0x3000, 1, true),
            ],
            LIMITS,
        )
        .unwrap();
        assert_eq!(r.kind, RequestType::GetId);
    }

    #[test]
    fn rejects_malformed_requests() {
        let m = mem();
        header(&m, 0x1000, VIRTIO_BLK_T_IN, 0);
        let h = d(0x1000, 16, false);
        let st = d(0x3000, 1, true);
        assert_eq!(
            parse(&m, &[], LIMITS).unwrap_err().0,
            RequestError::ShortChain
        );
        assert_eq!(
            parse(&m, &[h], LIMITS).unwrap_err().0,
            RequestError::ShortChain
        );
        assert_eq!(
            parse(&m, &[h, d(0x3000, 1, false)], LIMITS).unwrap_err().0,
            RequestError::BadStatus
        );
        assert_eq!(
            parse(&m, &[d(0x1000, 8, false), st], LIMITS).unwrap_err(),
            (RequestError::BadHeader, Some(GuestAddress(0x3000)))
        );
        assert_eq!(
            parse(&m, &[h, d(0x2000, 512, false), st], LIMITS)
                .unwrap_err()
                .0,
            RequestError::WrongDirection
        );
        assert_eq!(
            parse(&m, &[h, d(0x2000, 100, true), st], LIMITS)
                .unwrap_err()
                .0,
            RequestError::Unaligned
        );
        assert_eq!(
            parse(&m, &[h, d(0xff000, 0x2000, true), st], LIMITS)
                .unwrap_err()
                .0,
            RequestError::OutOfMemory
        );
        assert_eq!(
            parse(&m, &[h, d(0x2000, 2 << 20, true), st], LIMITS)
                .unwrap_err()
                .0,
            RequestError::OutOfMemory
        );
        let many: Vec<_> = std::iter::once(h)
            .chain((0..9).map(|i| d(0x2000 + i * 512, 512, true)))
            .chain([st])
            .collect();
        assert_eq!(
            parse(&m, &many, LIMITS).unwrap_err().0,
            RequestError::TooManySegments(9)
        );
        // Status beyond memory.
        assert_eq!(
            parse(&m, &[h, d(1 << 20, 1, true)], LIMITS).unwrap_err().0,
            RequestError::BadStatus
        );
        // Status address + len overflowing u64.
        assert_eq!(
            parse(&m, &[h, d(u64::MAX, 2, true)], LIMITS).unwrap_err().0,
            RequestError::BadStatus
        );
    }

    fn arb_desc() -> impl Strategy<Value = Descriptor> {
        (
            prop_oneof![0u64..(2 << 20), Just(u64::MAX - 8), any::<u64>()],
            prop_oneof![0u32..8192, any::<u32>()],
            any::<bool>(),
        )
            .prop_map(|(a, l, w)| d(a, l, w))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(20_000))]
        /// Any chain a guest can build parses or fails cleanly, and a parsed request only ever
        /// points inside guest memory and within the advertised limits.
        #[test]
        fn any_chain_parses_safely(descs in proptest::collection::vec(arb_desc(), 0..12), kind in 0u32..16, sector in any::<u64>()) {
            let m = mem();
            header(&m, 0x1000, kind, sector);
            match parse(&m, &descs, LIMITS) {
                Ok(r) => {
                    prop_assert!(m.check_range(r.status, 1));
                    prop_assert!(r.data.len() <= LIMITS.seg_max as usize);
                    for (a, l) in &r.data {
                        prop_assert!(*l <= LIMITS.size_max);
                        prop_assert!(*l == 0 || m.check_range(*a, *l as usize));
                    }
                }
                Err((_, Some(status))) => prop_assert!(m.check_range(status, 1)),
                Err((_, None)) => {}
            }
        }
    }
}
