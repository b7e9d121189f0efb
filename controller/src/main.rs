//! virt-controller. `virt-controller crds` prints the CustomResourceDefinitions;
//! `virt-controller run` reconciles (leader-elected), serves the admission webhook and metrics.

use controller_runtime::tls::ServingCert;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use api::migratability::EvictionStrategy;
use clap::{Parser, Subcommand};
use controller::context::ControllerConfig;
use controller::leader::LeaseConfig;
use controller::metrics::Metrics;

#[derive(Parser)]
#[command(
    name = "virt-controller",
    version,
    about = "microvirt's cluster controller"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Elect a leader through this Lease (in $POD_NAMESPACE); without it every replica acts.
    #[arg(long)]
    leader_election_lease: Option<String>,
    /// This replica's identity in the Lease.
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    #[arg(long, env = "POD_NAMESPACE", default_value = "microvirt")]
    namespace: String,
    /// Lease duration in seconds (renew deadline is 2/3 of it, retry period 2/15).
    #[arg(long, default_value_t = 15)]
    lease_duration: u64,
    #[arg(long, default_value = "quay.io/microvirt/virt-launcher:v0.1.0")]
    launcher_image: String,
    #[arg(long, default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
    #[arg(long, default_value = "0.0.0.0:8443")]
    webhook_addr: SocketAddr,
    /// Do not serve the admission webhook.
    #[arg(long)]
    no_webhook: bool,
    /// The webhook Service: its DNS names go into the self-signed certificate, whose CA is
    /// patched into the `microvirt` webhook configurations.
    #[arg(long)]
    webhook_service: Option<String>,
    /// Serve the webhook with this certificate and key (PEM) instead of a self-signed one.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    #[arg(long)]
    tls_key: Option<PathBuf>,
    #[arg(long, default_value_t = 5)]
    parallel_migrations_per_cluster: usize,
    #[arg(long, default_value_t = 2)]
    parallel_outbound_migrations_per_node: usize,
    /// The eviction strategy of VMIs that set none (KubeVirt's cluster-wide evictionStrategy):
    /// None, LiveMigrate, LiveMigrateIfPossible or External.
    #[arg(long, default_value = "None", value_parser = parse_strategy)]
    default_eviction_strategy: EvictionStrategy,
    /// Nodes with a taint of this key are drained of VMs that can move (KubeVirt's
    /// nodeDrainTaintKey); an empty value turns that off.
    #[arg(long, default_value = api::labels::DEFAULT_DRAIN_TAINT)]
    node_drain_taint_key: String,
    /// KubeVirt feature gates to enable (comma-separated); microvirt knows HostDisk.
    #[arg(long, value_delimiter = ',', value_parser = parse_feature_gate)]
    feature_gates: Vec<String>,
    /// A host directory below which hostDisks may lie (repeatable; `{namespace}` is replaced
    /// by the VMI's namespace). Without one, HostDisk allows nothing.
    #[arg(long, value_parser = parse_host_disk_prefix)]
    host_disk_prefix: Vec<String>,
    /// Who fills DataVolumes: `auto` (microvirt's importer unless CDI is installed), `always`,
    /// `never`.
    #[arg(long, value_enum, default_value = "auto")]
    datavolume_import: controller::cdi::DataVolumeImport,
    /// The importer image (this project's `cdi-importer`).
    #[arg(long, default_value = "quay.io/microvirt/cdi-importer:v0.1.0")]
    importer_image: String,
    /// Registries (`host:port`, comma-separated) importers may reach over plain HTTP.
    #[arg(long, value_delimiter = ',')]
    insecure_registries: Vec<String>,
    /// Failed import attempts after which a DataVolume is Failed.
    #[arg(long, default_value_t = 5)]
    import_max_restarts: i32,
}

fn parse_feature_gate(s: &str) -> Result<String, String> {
    match s {
        "HostDisk" => Ok(s.into()),
        _ => Err(format!(
            "unknown feature gate {s:?}; microvirt knows: HostDisk"
        )),
    }
}

fn parse_host_disk_prefix(p: &str) -> Result<String, String> {
    if !p.starts_with('/') || p.split('/').any(|c| c == "..") || p.trim_end_matches('/').is_empty()
    {
        return Err(format!(
            "{p:?}: an absolute directory other than / and without \"..\" is required"
        ));
    }
    Ok(p.into())
}

fn parse_strategy(s: &str) -> Result<EvictionStrategy, String> {
    s.parse()
}

#[derive(Subcommand)]
enum Command {
    /// Print the CustomResourceDefinitions (kubectl apply -f - installs them).
    Crds {
        /// CDI's DataVolume CRD instead, for a cluster without CDI.
        #[arg(long)]
        cdi: bool,
    },
    /// Run the controllers (uses in-cluster config or $KUBECONFIG).
    Run(Box<RunArgs>),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Crds { cdi } => {
            if cdi {
                print!("{}", controller::crds::cdi_yaml());
            } else {
                print!("{}", controller::crds::yaml());
            }
            Ok(())
        }
        Command::Run(args) => {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| "info".into()),
                )
                .with_writer(std::io::stderr)
                .init();
            tokio::runtime::Runtime::new()?.block_on(run(*args))
        }
    }
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing a SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let host_disks = api::validation::HostDiskPolicy {
        feature_gate: args.feature_gates.iter().any(|g| g == "HostDisk"),
        allowed_prefixes: args.host_disk_prefix.clone(),
    };
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API (in-cluster config or $KUBECONFIG)")?;
    let metrics = Arc::new(Metrics::new());
    let listener = tokio::net::TcpListener::bind(args.metrics_addr)
        .await
        .with_context(|| format!("--metrics-addr {}", args.metrics_addr))?;
    tokio::spawn(controller::metrics::serve(listener, metrics.clone()));

    if !args.no_webhook {
        let (tls, ca) = match (&args.tls_cert, &args.tls_key) {
            // Given files are followed: a rotated Secret is served without a restart.
            (Some(c), Some(k)) => (
                controller_runtime::tls::reloading_server_config(c, k, None)
                    .map_err(anyhow::Error::msg)?,
                None,
            ),
            _ => {
                let svc = args
                    .webhook_service
                    .clone()
                    .unwrap_or_else(|| "virt-controller-webhook".into());
                let names = controller_runtime::tls::service_dns_names(&svc, &args.namespace);
                let (cert, pem) = ServingCert::self_signed(names).map_err(anyhow::Error::msg)?;
                (
                    cert.server_config(None).map_err(anyhow::Error::msg)?,
                    Some(pem),
                )
            }
        };
        let listener = tokio::net::TcpListener::bind(args.webhook_addr)
            .await
            .with_context(|| format!("--webhook-addr {}", args.webhook_addr))?;
        // The webhook follows the KubeVirt CR on its own, as the reconcilers do.
        let defaults = api::kubevirt::ClusterSettings {
            eviction_strategy: args.default_eviction_strategy,
            feature_gates: args.feature_gates.iter().cloned().collect(),
            ..Default::default()
        };
        let app = controller::webhook::router(controller::webhook::WebhookState {
            client: Some(client.clone()),
            settings: controller_runtime::LiveSettings::follow(client.clone(), defaults),
            host_disk_prefixes: host_disks.allowed_prefixes.clone(),
        });
        tokio::spawn(controller_runtime::tls::serve_tls(listener, tls, app));
        if let (Some(pem), Some(_)) = (ca, &args.webhook_service) {
            tokio::spawn(publish_ca_bundle(client.clone(), pem));
        }
    }

    let lease = args.leader_election_lease.as_ref().map(|name| {
        let identity = args.identity.clone().unwrap_or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_else(|_| "virt-controller".into())
        });
        let mut l = LeaseConfig::new(&args.namespace, name, &identity);
        l.lease_duration = Duration::from_secs(args.lease_duration.max(3));
        l.renew_deadline = l.lease_duration * 2 / 3;
        l.retry_period = (l.lease_duration * 2 / 15).max(Duration::from_millis(200));
        l
    });
    let mut config = ControllerConfig::default();
    config.pod.launcher_image = args.launcher_image.clone();
    config.pod.host_disks = host_disks;
    config.parallel_migrations_per_cluster = args.parallel_migrations_per_cluster;
    config.parallel_outbound_migrations_per_node = args.parallel_outbound_migrations_per_node;
    config.default_eviction_strategy = args.default_eviction_strategy;
    config.drain_taint_key = Some(args.node_drain_taint_key.clone()).filter(|k| !k.is_empty());
    config.datavolume_import = args.datavolume_import;
    config.namespace = args.namespace.clone();
    config.importer.image = args.importer_image.clone();
    config.importer.insecure_registries = args.insecure_registries.clone();
    config.importer.max_restarts = args.import_max_restarts;
    controller::run::run(client, config, lease, metrics, shutdown_signal())
        .await
        .map_err(anyhow::Error::msg)
}

/// Puts the webhook's CA into both `microvirt` webhook configurations, retrying until it works.
async fn publish_ca_bundle(client: kube::Client, pem: String) {
    use k8s_openapi::api::admissionregistration::v1::{
        MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
    };
    use k8s_openapi::ByteString;
    use kube::api::{Api, Patch, PatchParams};
    let bundle = serde_json::to_value(ByteString(pem.into_bytes())).unwrap_or_default();
    let mut delay = Duration::from_secs(1);
    loop {
        let patch = |n: usize| -> Patch<serde_json::Value> {
            let ops: Vec<serde_json::Value> = (0..n)
                .map(|i| serde_json::json!({"op": "add", "path": format!("/webhooks/{i}/clientConfig/caBundle"), "value": bundle}))
                .collect();
            Patch::Json(serde_json::from_value(serde_json::Value::Array(ops)).unwrap())
        };
        let v: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
        let m: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
        let result = async {
            let vn = v.get("microvirt").await?.webhooks.map_or(0, |w| w.len());
            v.patch("microvirt", &PatchParams::default(), &patch(vn))
                .await?;
            let mn = m.get("microvirt").await?.webhooks.map_or(0, |w| w.len());
            m.patch("microvirt", &PatchParams::default(), &patch(mn))
                .await?;
            Ok::<_, kube::Error>(())
        }
        .await;
        match result {
            Ok(()) => return,
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?delay, "publishing the webhook CA bundle failed")
            }
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(60));
    }
}
