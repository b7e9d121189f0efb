//! virtio-fs (device type 26) over a vhost-user-fs backend such as virtiofsd: one
//! high-priority queue and one request queue; the config space is the frontend's (the tag the
//! guest mounts by, and the number of request queues).

/// virtio-fs device type (VIRTIO 1.2 §5.11).
pub const TYPE_FS: u32 = 26;
/// The tag field of `struct virtio_fs_config` is 36 bytes, NUL-padded.
pub const TAG_MAX: usize = 36;
/// hiprio + one request queue.
pub const QUEUES: usize = 2;
pub const QUEUE_SIZE: u16 = 1024;

/// `struct virtio_fs_config { u8 tag[36]; le32 num_request_queues; }`.
pub fn config_space(tag: &str) -> Vec<u8> {
    let mut c = vec![0u8; TAG_MAX + 4];
    let t = tag.as_bytes();
    let n = t.len().min(TAG_MAX);
    c[..n].copy_from_slice(&t[..n]);
    c[TAG_MAX..].copy_from_slice(&((QUEUES as u32 - 1).to_le_bytes()));
    c
}

/// A share mounted by `tag`.
pub fn shape(tag: &str) -> super::DeviceShape {
    super::DeviceShape {
        device_type: TYPE_FS,
        queue_sizes: vec![QUEUE_SIZE; QUEUES],
        config: config_space(tag),
        local_features: 0,
        hidden_features: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_space_holds_the_tag_and_one_request_queue() {
        let c = config_space("share");
        assert_eq!(&c[..5], b"share");
        assert!(c[5..TAG_MAX].iter().all(|&b| b == 0));
        assert_eq!(u32::from_le_bytes(c[TAG_MAX..].try_into().unwrap()), 1);
        let long = "x".repeat(36);
        assert_eq!(&config_space(&long)[..36], long.as_bytes());
    }
}
