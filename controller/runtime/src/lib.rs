//! What every microvirt reconciler and in-cluster server shares (virt-controller, virt-handler,
//! virt-api), and
//! nothing about KubeVirt's objects themselves (those facts are in `api`):
//! - [`objects`]: status and label writes guarded by resourceVersion, owners, finalizers,
//!   deletes that tolerate absence, and the API errors reconcilers branch on;
//! - [`conditions`]: setting and removing a condition the way the API conventions ask;
//! - [`settings`]: the KubeVirt CR's `spec.configuration`, followed live;
//! - [`time`]: the timestamps Kubernetes objects carry;
//! - [`backoff`]: per-object exponential retry (client-go's per-item rate limiter);
//! - [`unseen_writes`]: a reconciler's own writes its cache has not shown yet;
//! - [`events`]: Events that never fail a reconcile;
//! - [`metrics_http`]: the `/metrics` and `/healthz` endpoint;
//! - [`tls`]: HTTPS serving with optional client certificates (webhook, virt-api);
//! - [`websocket`]: a byte stream carried over a websocket (consoles, port-forward).

pub mod backoff;
pub mod conditions;
pub mod events;
pub mod metrics_http;
pub mod objects;
pub mod settings;
pub mod time;
pub mod tls;
pub mod unseen_writes;
pub mod websocket;

pub use backoff::RetryBackoff;
pub use conditions::{remove_condition, set_condition};
pub use events::EventSink;
pub use objects::{
    controlled_by, controller_ref, create_if_absent, delete_if_present, finalizer_patch,
    has_finalizer, is_conflict, is_not_found, write_labels, write_status,
};
pub use settings::LiveSettings;
pub use unseen_writes::UnseenWrites;
