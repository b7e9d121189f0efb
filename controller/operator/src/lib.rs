//! virt-operator: microvirt installed, configured and removed as KubeVirt's operator does it,
//! from one `KubeVirt` custom resource (`api::kubevirt`).
//!
//! - [`certs`]: the CA and serving certificates, made and rotated.
//! - [`node_certs`]: the signer of virt-handler's node certificates (CSRs from node-bound
//!   tokens, each for its own node only).
//! - [`install`]: the objects of one release (the manifests of `deploy/`, carried by the
//!   operator) rendered for a CR: its namespace, registry and tag.
//! - [`status`]: the CR's phase and conditions from what was observed (pure).
//! - [`reconcile`]: apply (an upgrade in KubeVirt's order), watch the workloads, report;
//!   uninstall on deletion.
//! - [`workloads`]: running VMIs moved onto the new launcher after an upgrade.
//! - [`webhook`]: the deletion of an installation that still has workloads refused.

pub mod certs;
pub mod install;
pub mod node_certs;
pub mod reconcile;
pub mod status;
pub mod webhook;
pub mod workloads;
