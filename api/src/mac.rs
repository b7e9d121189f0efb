//! The MAC address a VMI's interface has: `macAddress` when the spec gives one, else one
//! derived from the VMI's and the interface's names. virt-handler and virt-launcher both need
//! it — the launcher gives it to the guest's NIC, the handler lets only frames from it leave the
//! guest's TAP — so it is decided here, once, from the API object alone.

use crate::types::Interface;

/// Six bytes, most significant first.
pub type Mac = [u8; 6];

/// A locally administered unicast MAC (52:54:00 like QEMU/KubeVirt) from `seed`: the same seed
/// gives the same MAC in every process and every release, so a NIC keeps its address across
/// restarts, snapshots and migrations. FNV-1a: no cryptographic need, only spread.
pub fn derived(seed: &str) -> Mac {
    let h = seed.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    let [_, a, b, c] = h.to_be_bytes();
    [0x52, 0x54, 0x00, a, b, c]
}

/// The MAC of interface `iface` of the VMI named `vmi_name`.
pub fn of_interface(vmi_name: &str, iface: &Interface) -> Result<Mac, String> {
    match &iface.mac_address {
        Some(m) => crate::validation::check_mac(m),
        None => Ok(derived(&format!("{vmi_name}/{}", iface.name))),
    }
}

/// `aa:bb:cc:dd:ee:ff`.
pub fn display(m: &Mac) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_macs_are_stable_local_unicast() {
        let a = derived("vm1/default");
        assert_eq!(a, derived("vm1/default"));
        assert_ne!(a, derived("vm2/default"));
        assert_eq!(&a[..3], &[0x52, 0x54, 0x00]);
        // The value every earlier release gave this seed: a migrating guest keeps its MAC.
        assert_eq!(
            display(&derived("default/vm1/default")),
            "52:54:00:de:ab:33"
        );
    }

    #[test]
    fn the_spec_mac_wins() {
        let mut iface: Interface =
            serde_json::from_value(serde_json::json!({"name": "default", "masquerade": {}}))
                .unwrap();
        assert_eq!(of_interface("vm1", &iface).unwrap(), derived("vm1/default"));
        iface.mac_address = Some("02:00:00:00:00:42".into());
        assert_eq!(of_interface("vm1", &iface).unwrap(), [2, 0, 0, 0, 0, 0x42]);
        iface.mac_address = Some("01:00:5e:00:00:01".into());
        assert!(of_interface("vm1", &iface)
            .unwrap_err()
            .contains("multicast"));
    }
}
