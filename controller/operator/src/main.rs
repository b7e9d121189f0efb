//! The `virt-operator` binary: `run` reconciles KubeVirt CRs; `crd` prints the KubeVirt CRD
//! `deploy/operator.yaml` carries; `objects` prints what a CR installs, without a cluster.

use std::sync::Arc;

use anyhow::Context as _;
use api::kubevirt::KubeVirt;
use clap::{Parser, Subcommand};
use futures::StreamExt;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use kube::runtime::{watcher, Controller};
use kube::{Api, Client, CustomResourceExt};
use virt_operator::install::{self, Release, DEFAULT_REGISTRY};
use virt_operator::reconcile::{error_policy, reconcile, Context};
use virt_operator::{node_certs, webhook};

#[derive(Parser)]
#[command(name = "virt-operator", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Reconcile every KubeVirt CR in the cluster.
    Run {
        /// The registry of this release's images (the CR's `imageRegistry` overrides it).
        #[arg(long, env = "OPERATOR_IMAGE_REGISTRY", default_value = DEFAULT_REGISTRY)]
        registry: String,
        /// Where the admission webhook listens (the `kubevirt-operator-webhook` Service's
        /// target port).
        #[arg(long, default_value = "0.0.0.0:8444")]
        webhook_addr: std::net::SocketAddr,
        /// The namespace the operator runs in, where its certificate Secret is (the
        /// Deployment passes its own through the downward API).
        #[arg(long, env = "POD_NAMESPACE", default_value = "kubevirt")]
        namespace: String,
    },
    /// Print the KubeVirt CRD.
    Crd,
    /// Print the objects a KubeVirt CR (a YAML file) installs.
    Objects {
        #[arg(short = 'f', long)]
        file: std::path::PathBuf,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Crd => print!("{}", serde_yaml::to_string(&KubeVirt::crd())?),
        Command::Objects { file } => {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            let kv: KubeVirt = serde_yaml::from_str(&text)
                .with_context(|| format!("{} is not a KubeVirt CR", file.display()))?;
            let release = Release::of(&kv, DEFAULT_REGISTRY);
            for obj in install::objects(&kv, &release, None)? {
                print!("---\n{}", serde_yaml::to_string(&obj)?);
            }
        }
        Command::Run {
            registry,
            webhook_addr,
            namespace,
        } => run(registry, webhook_addr, namespace).await?,
    }
    Ok(())
}

async fn run(
    registry: String,
    webhook_addr: std::net::SocketAddr,
    namespace: String,
) -> anyhow::Result<()> {
    let client = Client::try_default()
        .await
        .context("connecting to the API server")?;
    let cert = Arc::new(controller_runtime::tls::SwappableCert::default());
    let tls = cert.server_config().map_err(anyhow::Error::msg)?;
    let listener = tokio::net::TcpListener::bind(webhook_addr)
        .await
        .with_context(|| format!("--webhook-addr {webhook_addr}"))?;
    tokio::spawn(webhook::follow_secret(
        client.clone(),
        namespace.clone(),
        cert,
    ));
    // The signer of the nodes' certificates runs beside the installation's reconciler.
    let signer = Arc::new(node_certs::Signer {
        client: client.clone(),
        namespace,
    });
    let csrs: Api<CertificateSigningRequest> = Api::all(client.clone());
    tokio::spawn(
        Controller::new(csrs, watcher::Config::default())
            .run(node_certs::reconcile, node_certs::error_policy, signer)
            .for_each(|r| async move {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "node certificate request");
                }
            }),
    );
    tokio::spawn(controller_runtime::tls::serve_tls(
        listener,
        tls,
        webhook::router(client.clone()),
    ));
    let kvs: Api<KubeVirt> = Api::all(client.clone());
    let ctx = Arc::new(Context::new(client, registry));
    tracing::info!(version = %install::operator_version(), "virt-operator running");
    Controller::new(kvs, watcher::Config::default())
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx)
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "reconcile");
            }
        })
        .await;
    Ok(())
}
