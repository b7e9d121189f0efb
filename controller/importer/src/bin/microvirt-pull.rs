//! microvirt-pull: pulls containerDisk and kernelBoot images from OCI registries into an image
//! directory, as `virt-launcher run -f` finds them (it runs this for images it has not got).
//! A separate binary so the launcher — the process in every VM's Pod, where the kubelet pulls
//! images — carries no HTTP, TLS or registry code. Credentials come from docker's
//! `config.json` (`docker login`); a registry on localhost may speak plain HTTP, as Docker
//! allows, any other only when named with `--insecure-registry`.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use importer::pull::{docker_config_auth, pull_into, PullProgress};
use importer::registry::{reference, RegistryAccess};

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Pull containerDisk and kernelBoot images into an image directory"
)]
struct Args {
    /// The images (`registry/repository:tag` or `@sha256:…`, `docker://` optional).
    #[arg(required = true)]
    images: Vec<String>,
    /// Where images go (`<dir>/<image with / and : as _>/`, layers in `<dir>/.blobs/`).
    #[arg(long, env = "MICROVIRT_IMAGES", default_value = "images")]
    image_dir: PathBuf,
    /// A registry (`host:port`) reached over plain HTTP. Repeatable.
    #[arg(long = "insecure-registry", value_delimiter = ',')]
    insecure_registries: Vec<String>,
    /// Docker's config.json with registry credentials [default: $DOCKER_CONFIG/config.json,
    /// else ~/.docker/config.json].
    #[arg(long)]
    docker_config: Option<PathBuf>,
    /// PEM CA certificates to trust besides the system's.
    #[arg(long)]
    ca_file: Vec<PathBuf>,
}

/// A progress bar on a terminal (indicatif draws nothing when stderr is not one).
struct Bar(Option<indicatif::ProgressBar>);

impl PullProgress for Bar {
    fn started(&mut self, image: &str, total: u64) {
        let bar = indicatif::ProgressBar::new(total);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        bar.set_message(format!("pulling {image}"));
        self.0 = Some(bar);
    }
    fn advanced(&mut self, bytes: u64) {
        if let Some(b) = &self.0 {
            b.inc(bytes);
        }
    }
    fn finished(&mut self) {
        if let Some(b) = self.0.take() {
            b.finish_and_clear();
        }
    }
}

fn docker_config_path(args: &Args) -> Option<PathBuf> {
    args.docker_config.clone().or_else(|| {
        std::env::var_os("DOCKER_CONFIG")
            .map(|d| PathBuf::from(d).join("config.json"))
            .or_else(|| {
                std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".docker/config.json"))
            })
    })
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let args = Args::parse();
    let config = docker_config_path(&args).and_then(|p| std::fs::read_to_string(p).ok());
    let mut ca_pems = Vec::new();
    for f in &args.ca_file {
        ca_pems.push(std::fs::read(f).with_context(|| format!("--ca-file {}", f.display()))?);
    }
    for image in &args.images {
        let registry = reference(image)?.resolve_registry().to_string();
        let access = RegistryAccess {
            credentials: config
                .as_deref()
                .and_then(|c| docker_config_auth(c, &registry)),
            ca_pems: ca_pems.clone(),
            insecure: args.insecure_registries.clone(),
        };
        let dir = pull_into(image, &access, &args.image_dir, &mut Bar(None))
            .with_context(|| format!("pulling {image}"))?;
        println!("{}", dir.display());
    }
    Ok(())
}
