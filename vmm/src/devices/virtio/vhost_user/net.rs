//! virtio-net over a vhost-user-net backend (DPDK's vhost PMD, OVS-DPDK): one receive and one
//! transmit queue; the MAC and link status are the frontend's config space, so the MAC feature
//! is offered by this side whatever the backend says.

use crate::config::MacAddr;

pub const QUEUES: usize = 2;
pub const QUEUE_SIZE: u16 = 256;

const F_MAC: u64 = 1 << 5;
const F_STATUS: u64 = 1 << 16;
/// A control queue and its commands, multiqueue, guest announce: they need a third queue
/// and a control path this frontend does not have.
const F_CTRL: u64 =
    (1 << 17) | (1 << 18) | (1 << 19) | (1 << 20) | (1 << 21) | (1 << 22) | (1 << 23);
const STATUS_LINK_UP: u16 = 1;

/// `struct virtio_net_config { u8 mac[6]; le16 status; le16 max_virtqueue_pairs; }`.
pub fn config_space(mac: MacAddr) -> Vec<u8> {
    let mut c = Vec::with_capacity(10);
    c.extend_from_slice(&mac.0);
    c.extend_from_slice(&STATUS_LINK_UP.to_le_bytes());
    c.extend_from_slice(&1u16.to_le_bytes());
    c
}

/// A NIC with `mac`, link up.
pub fn shape(mac: MacAddr) -> super::DeviceShape {
    super::DeviceShape {
        device_type: crate::devices::virtio::TYPE_NET,
        queue_sizes: vec![QUEUE_SIZE; QUEUES],
        config: config_space(mac),
        local_features: F_MAC | F_STATUS,
        hidden_features: F_CTRL,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_space_holds_the_mac_and_a_link_that_is_up() {
        let c = config_space(MacAddr([0x52, 0x54, 0, 1, 2, 3]));
        assert_eq!(c, [0x52, 0x54, 0, 1, 2, 3, 1, 0, 1, 0]);
        let s = shape(MacAddr([0x52, 0x54, 0, 1, 2, 3]));
        assert_eq!(s.local_features & s.hidden_features, 0);
    }
}
