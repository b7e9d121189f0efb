//! The `virt-operator` binary: `run` reconciles KubeVirt CRs; `crd` prints the KubeVirt CRD
//! `deploy/operator.yaml` carries; `objects` prints what a CR installs, without a cluster.

use std::sync::Arc;

use anyhow::Context as _;
use api::kubevirt::KubeVirt;
use clap::{Parser, Subcommand};
use futures::StreamExt;
use kube::runtime::{watcher, Controller};
use kube::{Api, Client, CustomResourceExt};
use virt_operator::install::{self, Release, DEFAULT_REGISTRY};
use virt_operator::reconcile::{error_policy, reconcile, Context};

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
        Command::Run { registry } => run(registry).await?,
    }
    Ok(())
}

async fn run(registry: String) -> anyhow::Result<()> {
    let client = Client::try_default()
        .await
        .context("connecting to the API server")?;
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
