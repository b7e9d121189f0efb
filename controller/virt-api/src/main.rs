//! virt-api: serves `subresources.kubevirt.io` (start, stop, restart, migrate, …) to the
//! Kubernetes API server that fronts it through an APIService.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use controller_runtime::tls::ServingCert;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use virt_api::handlers::HandlerDialer;
use virt_api::identity::{FrontProxy, CONFIG_MAP_NAME, CONFIG_MAP_NAMESPACE};
use virt_api::server::{router, ApiState};

#[derive(Parser)]
#[command(
    name = "virt-api",
    version,
    about = "KubeVirt's subresources.kubevirt.io API for microvirt"
)]
struct Args {
    /// Where to serve HTTPS.
    #[arg(long, default_value = "0.0.0.0:8443")]
    listen: SocketAddr,
    /// Serving certificate and key (PEM). Without them virt-api makes a self-signed one for its
    /// Service and publishes it as the APIServices' caBundle.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// The Service in front of virt-api (for the self-signed certificate's names).
    #[arg(long, default_value = "virt-api")]
    service: String,
    #[arg(long, env = "POD_NAMESPACE", default_value = "microvirt")]
    namespace: String,
    /// The CA of the nodes' certificates (PEM): virt-handler's console server shows its node's.
    #[arg(long, requires_all = ["handler_client_cert", "handler_client_key"])]
    handler_ca: Option<PathBuf>,
    /// virt-api's client certificate and key for virt-handler (PEM).
    #[arg(long, requires = "handler_ca")]
    handler_client_cert: Option<PathBuf>,
    #[arg(long, requires = "handler_ca")]
    handler_client_key: Option<PathBuf>,
    /// Where virt-handler's Pods run (default: virt-api's namespace).
    #[arg(long)]
    handler_namespace: Option<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API (in-cluster config or $KUBECONFIG)")?;
    let front_proxy = read_front_proxy(&client).await?;
    let client_ca = Some(front_proxy.client_ca.as_str());
    let (tls, ca) = match (&args.tls_cert, &args.tls_key) {
        // Given files are followed: a rotated Secret is served without a restart.
        (Some(c), Some(k)) => (
            controller_runtime::tls::reloading_server_config(c, k, client_ca),
            None,
        ),
        _ => {
            let names = controller_runtime::tls::service_dns_names(&args.service, &args.namespace);
            let (cert, pem) = ServingCert::self_signed(names).map_err(anyhow::Error::msg)?;
            (cert.server_config(client_ca), Some(pem))
        }
    };
    let tls = tls
        .map_err(anyhow::Error::msg)
        .context("the serving certificate, or the front proxy's request-header CA")?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("--listen {}", args.listen))?;
    if let Some(pem) = ca {
        tokio::spawn(publish_ca_bundle(client.clone(), pem));
    }
    let handlers = match (
        &args.handler_ca,
        &args.handler_client_cert,
        &args.handler_client_key,
    ) {
        // Files not installed yet (optional ConfigMap and Secret): no consoles, said below.
        (Some(ca), Some(cert), Some(key)) if ca.exists() && cert.exists() && key.exists() => {
            let ns = args.handler_namespace.as_deref().unwrap_or(&args.namespace);
            Some(HandlerDialer::from_files(ca, cert, key, ns).map_err(anyhow::Error::msg)?)
        }
        _ => {
            tracing::warn!("no --handler-ca and client certificate (or the files are not there): consoles and pause/unpause answer 503");
            None
        }
    };
    let app = router(Arc::new(ApiState {
        client,
        namespace: args.namespace.clone(),
        front_proxy,
        handlers,
    }));
    tracing::info!(listen = %args.listen, "serving subresources.kubevirt.io");
    controller_runtime::tls::serve_tls(listener, tls, app).await?;
    Ok(())
}

/// The API server's front-proxy settings; without them no caller can be identified, so
/// virt-api does not start.
async fn read_front_proxy(client: &kube::Client) -> anyhow::Result<FrontProxy> {
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), CONFIG_MAP_NAMESPACE);
    let cm = cms
        .get(CONFIG_MAP_NAME)
        .await
        .with_context(|| format!("reading {CONFIG_MAP_NAMESPACE}/{CONFIG_MAP_NAME} (the API server's front-proxy settings; virt-api's service account needs the extension-apiserver-authentication-reader Role)"))?;
    FrontProxy::from_config_map(&cm.data.unwrap_or_default()).map_err(anyhow::Error::msg)
}

/// The upload tokens' APIService (`deploy/cdi/`, only on clusters without CDI) gets the
/// bundle too — but only when it points at virt-api: CDI's own, pointing at cdi-api, is left
/// alone.
async fn publish_to_upload_apiservice(
    services: &Api<kube::api::DynamicObject>,
    patch: &serde_json::Value,
) {
    use kube::api::{Patch, PatchParams};
    let name = format!("{}.{}", api::cdi::upload::VERSION, api::cdi::upload::GROUP);
    let Ok(Some(svc)) = services.get_opt(&name).await else {
        return;
    };
    if svc
        .data
        .pointer("/spec/service/name")
        .and_then(|n| n.as_str())
        != Some("virt-api")
    {
        tracing::info!(apiservice = %name, "served by another component (CDI): left alone");
        return;
    }
    if let Err(e) = services
        .patch(&name, &PatchParams::default(), &Patch::Merge(patch))
        .await
    {
        tracing::warn!(apiservice = %name, error = %e, "publishing the CA bundle failed");
    }
}

/// The self-signed certificate as the caBundle of virt-api's APIServices, so the API server
/// trusts it; retried until the APIServices exist.
async fn publish_ca_bundle(client: kube::Client, pem: String) {
    use kube::api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
    let gvk = GroupVersionKind::gvk("apiregistration.k8s.io", "v1", "APIService");
    let services: Api<DynamicObject> = Api::all_with(client, &ApiResource::from_gvk(&gvk));
    let bundle = k8s_openapi::ByteString(pem.into_bytes());
    let patch = serde_json::json!({"spec": {"caBundle": bundle, "insecureSkipTLSVerify": false}});
    let mut delay = Duration::from_secs(1);
    loop {
        let mut result = Ok(());
        for v in virt_api::VERSIONS {
            let name = format!("{v}.{}", virt_api::GROUP);
            if let Err(e) = services
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                result = Err((name, e));
                break;
            }
        }
        match result {
            Ok(()) => {
                publish_to_upload_apiservice(&services, &patch).await;
                return;
            }
            Err((name, e)) => {
                tracing::warn!(apiservice = %name, error = %e, retry_in = ?delay, "publishing the CA bundle failed")
            }
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(60));
    }
}
