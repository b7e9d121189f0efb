//! What virt-handler's reconcilers share: its settings, the client, the Event sink, per-VMI
//! retry backoff, the migration legs it has started, and the error type.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use api::VirtualMachineInstance;
use controller_runtime::{EventSink, RetryBackoff};
use kube::Client;

use crate::launcher::LauncherError;

/// virt-handler's settings (flags of `virt-handler run`).
#[derive(Clone, Debug)]
pub struct HandlerConfig {
    /// The node this handler serves.
    pub node: String,
    /// The kubelet's pods directory, where launcher Pods' socket volumes are.
    pub pods_dir: PathBuf,
    /// How often a running VMI's status is checked against its launcher.
    pub resync: Duration,
    /// How long a launcher may take to answer.
    pub launcher_timeout: Duration,
    pub retry_base: Duration,
    pub retry_max: Duration,
    /// Mutual TLS for migration streams between nodes: this node's own certificate (its name
    /// as DNS name) and the cluster's CA; None: plain.
    pub migration_tls: Option<crate::node_certificate::NodeIdentity>,
    /// The node address a migration target listens on and publishes (the handler's Pod IP,
    /// which is the node's: it runs on the host network).
    pub migration_ip: std::net::IpAddr,
}

impl HandlerConfig {
    pub fn new(node: impl Into<String>) -> Self {
        HandlerConfig {
            node: node.into(),
            pods_dir: "/var/lib/kubelet/pods".into(),
            resync: Duration::from_secs(2),
            launcher_timeout: Duration::from_secs(5),
            retry_base: Duration::from_millis(500),
            retry_max: Duration::from_secs(60),
            migration_tls: None,
            migration_ip: std::net::Ipv4Addr::LOCALHOST.into(),
        }
    }
}

impl Context {
    /// This node's migration identity, when it has one.
    pub fn node_tls(&self) -> Result<Option<crate::migration_proxy::NodeTls>, String> {
        self.config
            .migration_tls
            .as_ref()
            .map(|identity| crate::migration_proxy::NodeTls::new(&identity.current()))
            .transpose()
    }
}

pub struct Context {
    pub client: Client,
    pub config: HandlerConfig,
    pub backoff: RetryBackoff,
    pub events: EventSink,
    pub legs: crate::legs::Legs,
    pub metrics: Arc<crate::metrics::NodeMetrics>,
}

impl Context {
    pub fn new(client: Client, config: HandlerConfig) -> Arc<Context> {
        Arc::new(Context {
            events: EventSink::new(client.clone(), "virt-handler", Some(config.node.clone())),
            client,
            metrics: crate::metrics::NodeMetrics::new(&config.node),
            config,
            backoff: RetryBackoff::default(),
            legs: Default::default(),
        })
    }

    pub(crate) async fn event(
        &self,
        vmi: &VirtualMachineInstance,
        warning: bool,
        reason: &str,
        note: String,
    ) {
        let ev = controller_runtime::events::event(warning, reason, reason, note);
        self.events.publish(vmi, ev).await
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    Launcher(#[from] LauncherError),
}
