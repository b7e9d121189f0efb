//! What one microvirt VM may have, in the VMM's own units. The VMM (`vmm::config`) enforces
//! the same numbers; `api` cannot depend on `vmm` (the control plane has no KVM), so the
//! launcher, which depends on both, asserts at compile time that they agree
//! (`launcher/src/translate.rs`).

/// vCPUs (the VMM's APIC IDs).
pub const MAX_VCPUS: u8 = 254;
/// Guest memory in MiB.
pub const MIN_MEMORY_MIB: u64 = 8;
pub const MAX_MEMORY_MIB: u64 = 1 << 20;
/// Disks and NICs together: one legacy IRQ per virtio device.
pub const MAX_VIRTIO_DEVICES: usize = 19;
