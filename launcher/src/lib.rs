//! virt-launcher's library: reading KubeVirt manifests, translating a VMI into the VMM's
//! config, and building what the guest needs on one machine (disk files, cloud-init seeds).

pub mod beneath;
pub mod client;
pub mod cloudinit;
pub mod daemon;
pub mod failure;
pub mod foreground;
pub mod images;
pub mod manifest;
pub mod migration_link;
pub mod migration_tls;
pub mod network;
pub mod remote;
pub mod standalone;
pub mod translate;
pub mod unix_socket;
pub mod virtiofs;
