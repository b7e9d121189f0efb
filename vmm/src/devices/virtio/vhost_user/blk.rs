//! virtio-blk over a vhost-user-blk backend (qemu-storage-daemon's export, SPDK): one
//! request queue; the config space (capacity, limits) is the backend's, fetched once when the
//! device is built.

/// `struct virtio_blk_config` up to `write_zeroes_may_unmap` and its padding (VIRTIO 1.2
/// §5.2.4): what Linux reads.
pub const CONFIG_LEN: usize = 60;
pub const QUEUES: usize = 1;
pub const QUEUE_SIZE: u16 = 256;

/// The capacity in 512-byte sectors a config space announces.
pub fn capacity(config: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(config.get(..8)?.try_into().ok()?))
}

/// A disk with the backend's `config` space.
pub fn shape(config: Vec<u8>) -> super::DeviceShape {
    super::DeviceShape {
        device_type: crate::devices::virtio::TYPE_BLOCK,
        queue_sizes: vec![QUEUE_SIZE; QUEUES],
        config,
        local_features: 0,
        hidden_features: 0,
    }
}
