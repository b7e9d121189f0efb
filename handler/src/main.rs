//! `virt-handler run`: the DaemonSet's command (see deploy/handler.yaml).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "virt-handler", version, about = "microvirt's node agent")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve this node: sync the VMIs scheduled here into their launchers and report their
    /// status. Uses $KUBECONFIG, or the in-cluster service account.
    Run {
        /// The node this handler runs on.
        #[arg(long, env = "NODE_NAME")]
        node_name: String,
        /// The kubelet's pods directory (launcher sockets are in each Pod's `sockets` volume).
        #[arg(long, default_value = "/var/lib/kubelet/pods")]
        pods_dir: PathBuf,
        /// Seconds between status checks of a running VMI.
        #[arg(long, default_value_t = 2)]
        resync_seconds: u64,
        /// Where to serve /metrics and /healthz.
        #[arg(long, default_value = "0.0.0.0:8080")]
        metrics_addr: String,
        /// The kubelet's device-plugins directory (its `kubelet.sock` and the plugins' sockets).
        #[arg(long, default_value = "/var/lib/kubelet/device-plugins")]
        device_plugins_dir: PathBuf,
        /// Do not serve the kvm, tun and vhost-net device plugins.
        #[arg(long)]
        no_device_plugins: bool,
        /// Mutual TLS for migrations between nodes: a directory with `ca.crt`, `tls.crt` and
        /// `tls.key` (the certificate for migration.microvirt.internal, server and client use).
        /// Without it migration streams are plain TCP.
        #[arg(long, conflicts_with = "request_node_certificate")]
        migration_tls_dir: Option<PathBuf>,
        /// Ask the cluster for this node's certificate instead (as virt-operator installs it):
        /// a key made in memory, a CertificateSigningRequest to virt-operator's signer
        /// (kubevirt.io/virt-handler) under a node-bound token, renewed before it expires; the
        /// CA bundle from ConfigMap kubevirt-ca in --namespace.
        #[arg(long)]
        request_node_certificate: bool,
        /// virt-handler's namespace (the DaemonSet passes its own).
        #[arg(long, env = "POD_NAMESPACE", default_value = "microvirt")]
        namespace: String,
        /// The node address migration targets listen on and publish (the DaemonSet sets
        /// POD_IP, the node's address on the host network). Without it: loopback only.
        #[arg(long, env = "POD_IP")]
        migration_address: Option<std::net::IpAddr>,
        /// Where to serve virt-api (consoles, pause/unpause), with mutual TLS: this node's
        /// certificate from --migration-tls-dir, clients from --api-client-ca.
        #[arg(long, default_value = "0.0.0.0:8186")]
        console_addr: String,
        /// The CA (PEM file) that signs virt-api's client certificate. Without it (or without
        /// --migration-tls-dir) no console server runs.
        #[arg(long)]
        api_client_ca: Option<PathBuf>,
        /// The common name of virt-api's client certificate.
        #[arg(long, default_value = "virt-api")]
        api_client_name: String,
        /// Where the device nodes are looked for (tests).
        #[arg(long, default_value = "/", hide = true)]
        device_root: PathBuf,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    match Cli::parse().command {
        Command::Run {
            node_name,
            pods_dir,
            resync_seconds,
            metrics_addr,
            device_plugins_dir,
            no_device_plugins,
            device_root,
            migration_tls_dir,
            request_node_certificate,
            namespace,
            migration_address,
            console_addr,
            api_client_ca,
            api_client_name,
        } => {
            let migration_tls = match &migration_tls_dir {
                Some(d) => match api::protocol::MigrationTls::from_dir(d).and_then(|t| {
                    handler::migration_proxy::NodeTls::new(&t)?;
                    Ok(t)
                }) {
                    Ok(t) => Some(handler::node_certificate::NodeIdentity::new(t)),
                    Err(e) => {
                        eprintln!("virt-handler: --migration-tls-dir: {e}");
                        return ExitCode::from(2);
                    }
                },
                None if request_node_certificate => None,
                None => {
                    tracing::warn!(
                        "no --migration-tls-dir or --request-node-certificate: migrations between nodes are not encrypted"
                    );
                    None
                }
            };
            if !no_device_plugins {
                tokio::spawn(handler::deviceplugin::run(device_plugins_dir, device_root));
            }
            let listener = match tokio::net::TcpListener::bind(&metrics_addr).await {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("virt-handler: --metrics-addr {metrics_addr}: {e}");
                    return ExitCode::from(2);
                }
            };
            if let Ok(a) = listener.local_addr() {
                eprintln!("virt-handler: metrics on http://{a}/metrics");
            }
            let client = match kube::Client::try_default().await {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("virt-handler: no Kubernetes API to talk to: {e} (set KUBECONFIG, or run in a cluster)");
                    return ExitCode::from(2);
                }
            };
            let migration_tls = if request_node_certificate {
                let requester = handler::node_certificate::CertificateRequester {
                    client: client.clone(),
                    node: node_name.clone(),
                    namespace,
                    patience: std::time::Duration::from_secs(30),
                };
                let identity = requester.first().await;
                tokio::spawn(requester.keep_renewed(identity.clone()));
                Some(identity)
            } else {
                migration_tls
            };
            let console = match console_server(
                migration_tls.as_ref(),
                api_client_ca,
                &console_addr,
                api_client_name,
            )
            .await
            {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("virt-handler: {e}");
                    return ExitCode::from(2);
                }
            };
            let mut config = handler::HandlerConfig::new(node_name);
            config.pods_dir = pods_dir;
            config.resync = std::time::Duration::from_secs(resync_seconds.max(1));
            config.migration_tls = migration_tls;
            match migration_address {
                Some(ip) => config.migration_ip = ip,
                None => tracing::warn!(
                    "no --migration-address (POD_IP): migration targets listen on loopback only"
                ),
            }
            handler::run(client, config, Some(listener), console).await;
            ExitCode::SUCCESS
        }
    }
}

/// The server virt-api reaches this node's consoles and pause/unpause through: with this
/// node's certificate and virt-api's CA, else (either missing) none, said in the log. A CA file
/// not installed yet (an optional ConfigMap) means no console server, not a node agent that
/// does not start.
async fn console_server(
    node_tls: Option<&handler::node_certificate::NodeIdentity>,
    api_client_ca: Option<PathBuf>,
    addr: &str,
    api_client_name: String,
) -> Result<Option<handler::rest::Serving>, String> {
    let api_client_ca = api_client_ca.filter(|ca| {
        let there = ca.exists();
        if !there {
            tracing::warn!(path = %ca.display(), "--api-client-ca does not exist (yet)");
        }
        there
    });
    let (Some(tls), Some(ca)) = (node_tls, api_client_ca) else {
        tracing::warn!("no --api-client-ca or --migration-tls-dir: no console server (virt-api cannot reach consoles or pause VMIs on this node)");
        return Ok(None);
    };
    let tls =
        handler::rest::Serving::tls_config(tls, &ca).map_err(|e| format!("console server: {e}"))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("--console-addr {addr}: {e}"))?;
    if let Ok(a) = listener.local_addr() {
        eprintln!("virt-handler: console server on https://{a}");
    }
    Ok(Some(handler::rest::Serving {
        listener,
        tls,
        api_client_name,
    }))
}
