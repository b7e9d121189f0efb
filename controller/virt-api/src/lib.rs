//! virt-api: KubeVirt's aggregated API, `subresources.kubevirt.io`, which the Kubernetes API
//! server fronts (an `APIService`), and virtctl, the command line that speaks it.
//!
//! A call's way through virt-api: the route names the object and the verb (`server`); the
//! front proxy's certificate and headers say who calls (`identity`); a SubjectAccessReview
//! says whether they may (`authz`); the verb's rules decide what changes (`verbs`, pure); the
//! change is written with virt-api's own service account; refusals are `metav1.Status`
//! (`status`). virt-controller then carries the change out, as it would a hand-written one.

pub mod authz;
pub mod client;
pub mod create;
pub mod expose;
pub mod handlers;
pub mod identity;
pub mod image_upload;
pub mod server;
pub mod status;
pub mod upload;
pub mod verbs;

/// The API group virt-api serves.
pub const GROUP: &str = "subresources.kubevirt.io";
/// The versions it serves: `v1`, and `v1alpha3`, which older virtctl releases use.
pub const VERSIONS: [&str; 2] = ["v1", "v1alpha3"];
