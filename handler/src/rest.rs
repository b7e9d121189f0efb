//! virt-handler's server for virt-api (KubeVirt's console server on :8186): a VMI's serial
//! console as a websocket, pause / unpause and soft reboot, for the VMIs that run on this node. Mutual
//! TLS: the node's own certificate (the one its migrations use) serves; only a client whose
//! certificate chains to virt-api's CA and names virt-api is answered — a tenant's Pod on the
//! node network must not reach another tenant's console.

use std::sync::Arc;

use api::protocol::{Request, Response as LauncherResponse};
use api::{VirtualMachineInstance, VmiPhase};
use axum::extract::ws::{WebSocket, WebSocketUpgrade};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use axum::{Extension, Json, Router};
use controller_runtime::tls::PeerCertificate;
use kube::Api;
use serde_json::json;

use crate::context::Context;
use crate::launcher::LauncherClient;

/// The port KubeVirt's virt-handler serves virt-api on.
pub const DEFAULT_PORT: u16 = 8186;

/// A refusal, as `metav1.Status`.
#[derive(Debug)]
pub struct RestError {
    code: StatusCode,
    reason: &'static str,
    message: String,
}

impl RestError {
    fn new(code: StatusCode, reason: &'static str, message: impl Into<String>) -> Self {
        RestError {
            code,
            reason,
            message: message.into(),
        }
    }
}

impl IntoResponse for RestError {
    fn into_response(self) -> Response {
        let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": self.message, "reason": self.reason,
            "code": self.code.as_u16()});
        (self.code, Json(body)).into_response()
    }
}

/// Where and how the server is served: the listener, the node's certificate with virt-api's
/// CA for clients, and the name virt-api's certificate carries.
pub struct Serving {
    pub listener: tokio::net::TcpListener,
    pub tls: Arc<tokio_rustls::rustls::ServerConfig>,
    pub api_client_name: String,
}

impl Serving {
    /// The TLS side from this node's certificate (`tls`, the migration identity) and virt-api's
    /// CA (`api_client_ca`, PEM).
    /// This node's certificate as it is renewed; virt-api's client certificate checked against
    /// the CA file `api_client_ca` as it is when virt-api connects (the operator rotates it).
    pub fn tls_config(
        identity: &crate::node_certificate::NodeIdentity,
        api_client_ca: &std::path::Path,
    ) -> Result<Arc<tokio_rustls::rustls::ServerConfig>, String> {
        let served = crate::node_certificate::ServedIdentity::new(identity.clone());
        let path = api_client_ca.to_path_buf();
        let client_ca = controller_runtime::tls::FollowedClientCa::new(move || {
            std::fs::read_to_string(&path).ok()
        })
        .map_err(|e| format!("{}: {e}", api_client_ca.display()))?;
        controller_runtime::tls::server_config_following(Arc::new(served), Arc::new(client_ca))
    }

    /// Serves until the process ends.
    pub async fn serve(self, ctx: Arc<Context>) {
        let app = router(ctx, self.api_client_name);
        if let Err(e) = controller_runtime::tls::serve_tls(self.listener, self.tls, app).await {
            tracing::error!("console server: {e}");
        }
    }
}

struct RestState {
    ctx: Arc<Context>,
    /// The name (certificate common name) virt-api's client certificate carries.
    api_client_name: String,
}

pub fn router(ctx: Arc<Context>, api_client_name: String) -> Router {
    let base = "/v1/namespaces/{namespace}/virtualmachineinstances/{name}";
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route(&format!("{base}/console"), get(console))
        .route(&format!("{base}/pause"), put(pause))
        .route(&format!("{base}/unpause"), put(unpause))
        .route(&format!("{base}/softreboot"), put(soft_reboot))
        .with_state(Arc::new(RestState {
            ctx,
            api_client_name,
        }))
}

/// Only virt-api may call: its certificate (already checked against its CA) names it, as its
/// common name or a DNS name.
fn check_caller(state: &RestState, peer: &PeerCertificate) -> Result<(), RestError> {
    if peer.0.is_none() {
        return Err(RestError::new(
            StatusCode::UNAUTHORIZED,
            "Unauthorized",
            "a client certificate from virt-api's CA is required",
        ));
    }
    let names = peer.names();
    if names.contains(&state.api_client_name) {
        Ok(())
    } else {
        Err(RestError::new(
            StatusCode::FORBIDDEN,
            "Forbidden",
            format!(
                "client {names:?} is not virt-api ({:?})",
                state.api_client_name
            ),
        ))
    }
}

/// The launcher of VMI `namespace/name`, which must run on this node.
async fn launcher_of(
    ctx: &Context,
    namespace: &str,
    name: &str,
) -> Result<LauncherClient, RestError> {
    let vmis: Api<VirtualMachineInstance> = Api::namespaced(ctx.client.clone(), namespace);
    let vmi = vmis
        .get_opt(name)
        .await
        .map_err(|e| {
            RestError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                e.to_string(),
            )
        })?
        .ok_or_else(|| {
            RestError::new(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("virtualmachineinstances.kubevirt.io \"{name}\" not found"),
            )
        })?;
    let status = vmi.status.unwrap_or_default();
    let node = &ctx.config.node;
    if status.node_name.as_deref() != Some(node.as_str()) {
        return Err(RestError::new(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("VMI {namespace}/{name} does not run on node {node}"),
        ));
    }
    if status.phase != Some(VmiPhase::Running) {
        return Err(RestError::new(
            StatusCode::CONFLICT,
            "Conflict",
            "VMI is not running",
        ));
    }
    let pod_uid = crate::sync::launcher_pod(&status, node).ok_or_else(|| {
        RestError::new(
            StatusCode::CONFLICT,
            "Conflict",
            format!("VMI {namespace}/{name} has no launcher Pod on node {node}"),
        )
    })?;
    LauncherClient::connect_pod(&ctx.config.pods_dir, pod_uid, ctx.config.launcher_timeout)
        .await
        .map_err(|e| {
            RestError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                format!("the launcher of VMI {namespace}/{name}: {e}"),
            )
        })
}

async fn lifecycle(
    state: &RestState,
    peer: &PeerCertificate,
    ns: &str,
    name: &str,
    req: Request,
) -> Response {
    let r = async {
        check_caller(state, peer)?;
        let mut launcher = launcher_of(&state.ctx, ns, name).await?;
        if let Some((what, since)) = req
            .introduced()
            .filter(|(_, since)| launcher.protocol_version < *since)
        {
            return Err(RestError::new(
                StatusCode::CONFLICT,
                "Conflict",
                format!(
                    "the launcher of VMI {ns}/{name} ({}) speaks control protocol {}, and {what} needs {since}: restart the VM to move it to a current launcher",
                    launcher.launcher_version, launcher.protocol_version
                ),
            ));
        }
        tracing::info!(namespace = ns, name, request = ?req, "lifecycle request from virt-api");
        match launcher.call(&req).await {
            Ok(LauncherResponse::Ok) => Ok(StatusCode::OK.into_response()),
            Ok(LauncherResponse::Error { message }) => {
                Err(RestError::new(StatusCode::CONFLICT, "Conflict", message))
            }
            Ok(other) => Err(RestError::new(
                StatusCode::BAD_GATEWAY,
                "InternalError",
                format!("the launcher answered {other:?}"),
            )),
            Err(e) => Err(RestError::new(
                StatusCode::BAD_GATEWAY,
                "InternalError",
                e.to_string(),
            )),
        }
    }
    .await;
    r.unwrap_or_else(IntoResponse::into_response)
}

async fn pause(
    State(state): State<Arc<RestState>>,
    Extension(peer): Extension<PeerCertificate>,
    Path((ns, name)): Path<(String, String)>,
) -> Response {
    lifecycle(&state, &peer, &ns, &name, Request::Pause).await
}

async fn unpause(
    State(state): State<Arc<RestState>>,
    Extension(peer): Extension<PeerCertificate>,
    Path((ns, name)): Path<(String, String)>,
) -> Response {
    lifecycle(&state, &peer, &ns, &name, Request::Resume).await
}

/// Soft reboot: the guest is asked to reboot and restarts in the same launcher.
async fn soft_reboot(
    State(state): State<Arc<RestState>>,
    Extension(peer): Extension<PeerCertificate>,
    Path((ns, name)): Path<(String, String)>,
) -> Response {
    lifecycle(&state, &peer, &ns, &name, Request::SoftReboot).await
}

/// The console: the launcher's console stream (recent history first, then what the guest
/// writes) as binary websocket messages; what the viewer sends goes to the guest's input. A
/// viewer that stops reading only stops this relay: the launcher keeps a bounded backlog per
/// viewer and drops from it, never holding the guest.
async fn console(
    State(state): State<Arc<RestState>>,
    Extension(peer): Extension<PeerCertificate>,
    Path((ns, name)): Path<(String, String)>,
    ws: WebSocketUpgrade,
) -> Response {
    let opened = async {
        check_caller(&state, &peer)?;
        let mut launcher = launcher_of(&state.ctx, &ns, &name).await?;
        match launcher.call(&Request::Console).await {
            Ok(LauncherResponse::Ok) => Ok(launcher),
            Ok(other) => Err(RestError::new(
                StatusCode::BAD_GATEWAY,
                "InternalError",
                format!("the launcher answered {other:?} to Console"),
            )),
            Err(e) => Err(RestError::new(
                StatusCode::BAD_GATEWAY,
                "InternalError",
                e.to_string(),
            )),
        }
    }
    .await;
    match opened {
        Ok(launcher) => ws
            .protocols(["plain.kubevirt.io"])
            .on_upgrade(move |socket| relay(socket, launcher)),
        Err(e) => e.into_response(),
    }
}

async fn relay(socket: WebSocket, launcher: LauncherClient) {
    let (from_launcher, to_launcher) = launcher.into_stream();
    controller_runtime::websocket::relay(
        socket,
        from_launcher,
        to_launcher,
        controller_runtime::websocket::AtEnd::Stop,
    )
    .await;
}
