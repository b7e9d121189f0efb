//! The routes of `subresources.kubevirt.io` and what each one does.

use std::sync::Arc;

use api::{VirtualMachine, VirtualMachineInstance, VirtualMachineInstanceMigration};
use axum::body::Bytes;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::{Extension, Json, Router};
use controller_runtime::tls::PeerCertificate;
use http::{HeaderMap, Method, StatusCode};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::authz::{authorize, Access};
use crate::handlers::HandlerDialer;
use crate::identity::FrontProxy;
use crate::status::SubresourceError;
use crate::verbs::{self, Plan, VmChange};
use crate::{GROUP, VERSIONS};

pub struct ApiState {
    /// virt-api's own service account: it writes what a verb changes.
    pub client: kube::Client,
    /// virt-api's namespace (where the upload tokens' signing key is).
    pub namespace: String,
    pub front_proxy: FrontProxy,
    /// The way to virt-handler (consoles, pause/unpause); None: not configured.
    pub handlers: Option<HandlerDialer>,
}

pub fn router(state: Arc<ApiState>) -> Router {
    let base = format!("/apis/{GROUP}/{{version}}");
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .merge(crate::upload::router())
        .route(&base, get(discovery))
        .route(&format!("{base}/healthz"), get(|| async { "ok" }))
        .route(&format!("{base}/version"), get(version))
        .route(
            &format!("{base}/namespaces/{{namespace}}/{{resource}}/{{name}}/{{verb}}"),
            any(call),
        )
        .route(
            &format!("{base}/namespaces/{{namespace}}/{{resource}}/{{name}}/{{verb}}/{{detail}}"),
            any(call),
        )
        .route(
            &format!("{base}/namespaces/{{namespace}}/{{resource}}/{{name}}/{{verb}}/{{detail}}/{{protocol}}"),
            any(call),
        )
        .fallback(|| async {
            SubresourceError::new(
                404,
                "NotFound",
                format!("the server could not find the requested resource: {GROUP} serves /apis/{GROUP}/v1/namespaces/<namespace>/(virtualmachines|virtualmachineinstances)/<name>/<subresource>"),
            )
        })
        .with_state(state)
}

fn check_version(version: &str) -> Result<(), SubresourceError> {
    if VERSIONS.contains(&version) {
        Ok(())
    } else {
        Err(SubresourceError::new(
            404,
            "NotFound",
            format!("{GROUP}/{version} is not served; served versions: {VERSIONS:?}"),
        ))
    }
}

/// The subresources served, as the API server's discovery lists them.
const VM_SUBRESOURCES: [&str; 5] = ["start", "stop", "restart", "migrate", "expand-spec"];
const VMI_SUBRESOURCES: [&str; 11] = [
    "console",
    "portforward",
    "pause",
    "unpause",
    "softreboot",
    "guestosinfo",
    "userlist",
    "filesystemlist",
    "vnc",
    "vnc/screenshot",
    "usbredir",
];

async fn discovery(Path(version): Path<String>) -> Result<Json<Value>, SubresourceError> {
    check_version(&version)?;
    let entry = |resource: &str, sub: &str, verbs: &[&str]| {
        json!({"name": format!("{resource}/{sub}"), "singularName": "", "namespaced": true,
               "kind": "", "verbs": verbs})
    };
    let mut resources: Vec<Value> = VM_SUBRESOURCES
        .iter()
        .map(|s| {
            let verbs: &[&str] = if *s == "expand-spec" {
                &["get"]
            } else {
                &["update"]
            };
            entry("virtualmachines", s, verbs)
        })
        .collect();
    resources.extend(VMI_SUBRESOURCES.iter().map(|s| {
        let verbs: &[&str] = if matches!(*s, "pause" | "unpause" | "softreboot") {
            &["update"]
        } else {
            &["get"]
        };
        entry("virtualmachineinstances", s, verbs)
    }));
    Ok(Json(json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": format!("{GROUP}/{version}"),
        "resources": resources,
    })))
}

async fn version(Path(version): Path<String>) -> Result<Json<Value>, SubresourceError> {
    check_version(&version)?;
    Ok(Json(server_version()))
}

/// What `virtctl version` prints for the server.
pub fn server_version() -> Value {
    json!({
        "gitVersion": concat!("v", env!("CARGO_PKG_VERSION"), "-microvirt"),
        "gitCommit": "",
        "gitTreeState": "clean",
        "goVersion": "",
        "compiler": "rustc",
        "platform": format!("{}/{}", std::env::consts::OS, std::env::consts::ARCH),
    })
}

/// The object a route names, and the subresource (`vnc/screenshot` for nested ones).
struct Target {
    version: String,
    namespace: String,
    resource: String,
    name: String,
    verb: String,
}

impl Target {
    fn from_params(mut p: std::collections::HashMap<String, String>) -> (Target, String) {
        let mut take = |k: &str| p.remove(k).unwrap_or_default();
        let t = Target {
            version: take("version"),
            namespace: take("namespace"),
            resource: take("resource"),
            name: take("name"),
            verb: take("verb"),
        };
        let sub = match (p.remove("detail"), p.remove("protocol")) {
            (Some(d), Some(proto)) => format!("{}/{d}/{proto}", t.verb),
            (Some(d), None) => format!("{}/{d}", t.verb),
            _ => t.verb.clone(),
        };
        (t, sub)
    }
}

/// What virt-api asks of a VMI's node's virt-handler (its path there is the subresource's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum NodeCall {
    Pause,
    Unpause,
    SoftReboot,
}

impl NodeCall {
    fn subresource(self) -> &'static str {
        match self {
            NodeCall::Pause => "pause",
            NodeCall::Unpause => "unpause",
            NodeCall::SoftReboot => "softreboot",
        }
    }

    /// Why a VMI paused (or not) cannot take this call, in KubeVirt's words.
    fn refused(self, paused: bool) -> Option<&'static str> {
        match (self, paused) {
            (NodeCall::Pause, true) => Some("VMI is already paused"),
            (NodeCall::Unpause, false) => Some("VMI is not paused"),
            (NodeCall::SoftReboot, true) => Some("VMI is paused"),
            _ => None,
        }
    }
}

/// What a subresource does.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Verb {
    Start,
    Stop,
    Restart,
    Migrate,
    /// The VM with its instance type and preference applied.
    ExpandSpec,
    /// The serial console, a websocket to the VMI's node.
    Console,
    /// A TCP connection to a port of the guest, as a websocket.
    PortForward,
    /// Pause, unpause or soft-reboot the VMI, on its node.
    OnNode(NodeCall),
    /// A guest-agent query: microvirt guests have no agent channel.
    GuestAgent,
    /// A device microvirt VMs do not have.
    NoDevice(&'static str),
}

/// The verb a route names, with the HTTP method and RBAC verb it takes.
fn verb_of(resource: &str, sub: &str) -> Result<(Verb, Method, &'static str), SubresourceError> {
    let put = |v| Ok((v, Method::PUT, "update"));
    let get = |v| Ok((v, Method::GET, "get"));
    const NO_GRAPHICS: &str = "microvirt VMs have no graphics device, so there is no VNC display to connect to; use `virtctl console` for the serial console";
    match (resource, sub) {
        ("virtualmachines", "start") => put(Verb::Start),
        ("virtualmachines", "stop") => put(Verb::Stop),
        ("virtualmachines", "restart") => put(Verb::Restart),
        ("virtualmachines", "migrate") => put(Verb::Migrate),
        ("virtualmachines", "expand-spec") => get(Verb::ExpandSpec),
        ("virtualmachineinstances", "console") => get(Verb::Console),
        ("virtualmachineinstances" | "virtualmachines", s) if s.starts_with("portforward/") => {
            get(Verb::PortForward)
        }
        ("virtualmachineinstances", "pause") => put(Verb::OnNode(NodeCall::Pause)),
        ("virtualmachineinstances", "unpause") => put(Verb::OnNode(NodeCall::Unpause)),
        ("virtualmachineinstances", "softreboot") => put(Verb::OnNode(NodeCall::SoftReboot)),
        ("virtualmachineinstances", "guestosinfo" | "userlist" | "filesystemlist") => {
            get(Verb::GuestAgent)
        }
        ("virtualmachineinstances", "vnc" | "vnc/screenshot") => get(Verb::NoDevice(NO_GRAPHICS)),
        ("virtualmachineinstances", "usbredir") => get(Verb::NoDevice(
            "microvirt VMs have no USB controller, so there is nothing to redirect a USB device to",
        )),
        ("virtualmachines" | "virtualmachineinstances", _) => {
            let served = if resource == "virtualmachines" {
                VM_SUBRESOURCES.join(", ")
            } else {
                VMI_SUBRESOURCES.join(", ")
            };
            Err(SubresourceError::new(
                404,
                "NotFound",
                format!("{resource}/{sub} is not served by this virt-api; served: {served}"),
            ))
        }
        _ => Err(SubresourceError::new(
            404,
            "NotFound",
            format!("{GROUP} has no resource {resource:?}; it serves subresources of virtualmachines and virtualmachineinstances"),
        )),
    }
}

async fn call(
    State(state): State<Arc<ApiState>>,
    Extension(peer): Extension<PeerCertificate>,
    Path(params): Path<std::collections::HashMap<String, String>>,
    method: Method,
    headers: HeaderMap,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
    body: Bytes,
) -> Response {
    let (target, sub) = Target::from_params(params);
    let request = Call {
        peer: &peer,
        headers: &headers,
        method: &method,
        ws: ws.ok(),
        body,
    };
    let r = handle(&state, request, &target, &sub).await;
    r.unwrap_or_else(IntoResponse::into_response)
}

/// One request as it came.
struct Call<'a> {
    peer: &'a PeerCertificate,
    headers: &'a HeaderMap,
    method: &'a Method,
    /// The websocket upgrade, when the request asks for one.
    ws: Option<WebSocketUpgrade>,
    body: Bytes,
}

async fn handle(
    state: &ApiState,
    call: Call<'_>,
    t: &Target,
    sub: &str,
) -> Result<Response, SubresourceError> {
    check_version(&t.version)?;
    let who = state.front_proxy.identify(call.peer, call.headers)?;
    let (verb, wanted, rbac_verb) = verb_of(&t.resource, sub)?;
    if *call.method != wanted {
        return Err(SubresourceError::new(
            405,
            "MethodNotAllowed",
            format!("{}/{sub} takes {wanted}, not {}", t.resource, call.method),
        ));
    }
    let access = Access {
        group: GROUP,
        verb: rbac_verb,
        resource: &t.resource,
        // RBAC names the subresource by its first segment (`vnc` for `vnc/screenshot`).
        subresource: &t.verb,
        namespace: &t.namespace,
        name: &t.name,
    };
    authorize(&state.client, &who, &access).await?;
    tracing::info!(user = %who.user, namespace = %t.namespace, name = %t.name, subresource = %sub, "subresource call");
    let calls = Calls {
        client: &state.client,
        namespace: &t.namespace,
        name: &t.name,
    };
    let body = &call.body;
    match verb {
        Verb::Start => {
            calls
                .vm_verb(verbs::start, body, |o: &verbs::StartOptions| &o.dry_run)
                .await
        }
        Verb::Stop => {
            calls
                .vm_verb(verbs::stop, body, |o: &verbs::StopOptions| &o.dry_run)
                .await
        }
        Verb::Restart => {
            calls
                .vm_verb(verbs::restart, body, |o: &verbs::RestartOptions| &o.dry_run)
                .await
        }
        Verb::Migrate => calls.migrate(body).await,
        Verb::ExpandSpec => calls.expand_spec().await,
        Verb::OnNode(c) => calls.on_node(handlers(state), c).await,
        Verb::Console => calls.console(handlers(state), call.ws).await,
        Verb::PortForward => calls.port_forward(forward_port(sub)?.0, call.ws).await,
        Verb::GuestAgent => {
            calls.vmi().await?;
            Err(SubresourceError::conflict(
                "VMI does not have guest agent connected",
            ))
        }
        Verb::NoDevice(why) => {
            calls.vmi().await?;
            Err(SubresourceError::bad_request(why))
        }
    }
}

/// `portforward/{port}[/{protocol}]`: the port, and that the protocol is TCP.
fn forward_port(sub: &str) -> Result<(u16, &str), SubresourceError> {
    let mut parts = sub.split('/').skip(1);
    let port = parts.next().unwrap_or_default();
    let protocol = parts.next().unwrap_or("tcp");
    let port: u16 = port.parse().ok().filter(|p| *p > 0).ok_or_else(|| {
        SubresourceError::bad_request(format!(
            "portforward/{port}: the port is a number from 1 to 65535"
        ))
    })?;
    if protocol != "tcp" {
        return Err(SubresourceError::bad_request(format!(
            "portforward over {protocol:?} is not supported: only tcp"
        )));
    }
    Ok((port, protocol))
}

fn handlers(state: &ApiState) -> Result<&HandlerDialer, SubresourceError> {
    state.handlers.as_ref().ok_or_else(|| {
        SubresourceError::new(
            503,
            "ServiceUnavailable",
            "virt-api runs without --handler-ca and --handler-client-cert/--handler-client-key, so it cannot reach virt-handler for consoles and pause/unpause",
        )
    })
}

/// The viewer's websocket and the node's, message for message, until either side closes.
async fn splice<S>(viewer: WebSocket, node: tokio_tungstenite::WebSocketStream<S>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use futures::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message as NodeMessage;
    let (mut to_viewer, mut from_viewer) = viewer.split();
    let (mut to_node, mut from_node) = node.split();
    let down = async {
        while let Some(Ok(m)) = from_node.next().await {
            let m = match m {
                NodeMessage::Binary(b) => Message::Binary(b),
                NodeMessage::Text(t) => Message::Text(t.as_str().into()),
                NodeMessage::Close(_) => break,
                _ => continue,
            };
            if to_viewer.send(m).await.is_err() {
                break;
            }
        }
        let _ = to_viewer.close().await;
    };
    let up = async {
        while let Some(Ok(m)) = from_viewer.next().await {
            let m = match m {
                Message::Binary(b) => NodeMessage::Binary(b),
                Message::Text(t) => NodeMessage::Text(t.as_str().into()),
                Message::Close(_) => break,
                _ => continue,
            };
            if to_node.send(m).await.is_err() {
                break;
            }
        }
        let _ = to_node.close().await;
    };
    tokio::select! {
        _ = down => {}
        _ = up => {}
    }
}

/// A request body of options; an empty body is the defaults.
fn options<T: DeserializeOwned + Default>(body: &Bytes) -> Result<T, SubresourceError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| {
        SubresourceError::bad_request(format!(
            "the request body is not valid {}: {e}",
            std::any::type_name::<T>()
                .rsplit("::")
                .next()
                .unwrap_or("options")
        ))
    })
}

/// `MigrateOptions`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct MigrateOptions {
    #[serde(default)]
    dry_run: Vec<String>,
    #[serde(default)]
    added_node_selector: Option<std::collections::BTreeMap<String, String>>,
}

/// The API server's conflict for a write on a stale read (not a verb's own refusal).
fn is_stale(e: &SubresourceError) -> bool {
    e.message.contains("the object has been modified")
}

/// The calls one request makes, with virt-api's service account.
struct Calls<'a> {
    client: &'a kube::Client,
    namespace: &'a str,
    name: &'a str,
}

impl Calls<'_> {
    fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
    {
        Api::namespaced(self.client.clone(), self.namespace)
    }

    async fn vm(&self) -> Result<VirtualMachine, SubresourceError> {
        self.api::<VirtualMachine>()
            .get_opt(self.name)
            .await
            .map_err(SubresourceError::from_kube)?
            .ok_or_else(|| SubresourceError::not_found("virtualmachines.kubevirt.io", self.name))
    }

    async fn vmi_opt(&self) -> Result<Option<VirtualMachineInstance>, SubresourceError> {
        self.api::<VirtualMachineInstance>()
            .get_opt(self.name)
            .await
            .map_err(SubresourceError::from_kube)
    }

    async fn vmi(&self) -> Result<VirtualMachineInstance, SubresourceError> {
        self.vmi_opt().await?.ok_or_else(|| {
            SubresourceError::not_found("virtualmachineinstances.kubevirt.io", self.name)
        })
    }

    /// The node of the running VMI; with `call`, also that the VMI's pause state allows it
    /// (KubeVirt's words).
    async fn running_node(&self, call: Option<NodeCall>) -> Result<String, SubresourceError> {
        let vmi = self.vmi().await?;
        let status = vmi.status.unwrap_or_default();
        if status.phase != Some(api::VmiPhase::Running) {
            return Err(SubresourceError::conflict("VMI is not running"));
        }
        let paused = api::conditions::is_true(&status.conditions, api::conditions::PAUSED);
        if let Some(why) = call.and_then(|c| c.refused(paused)) {
            return Err(SubresourceError::conflict(why));
        }
        status
            .node_name
            .ok_or_else(|| SubresourceError::conflict("VMI has no node yet"))
    }

    /// pause / unpause / softreboot on the VMI's node.
    async fn on_node(
        &self,
        dialer: Result<&HandlerDialer, SubresourceError>,
        call: NodeCall,
    ) -> Result<Response, SubresourceError> {
        let node = self.running_node(Some(call)).await?;
        let verb = call.subresource();
        dialer?
            .lifecycle(self.client, &node, self.namespace, self.name, verb)
            .await?;
        Ok(StatusCode::OK.into_response())
    }

    /// The console: the node's console websocket, connected before the upgrade so that a node
    /// that cannot be reached is an answer, then spliced to the caller's.
    async fn console(
        &self,
        dialer: Result<&HandlerDialer, SubresourceError>,
        ws: Option<WebSocketUpgrade>,
    ) -> Result<Response, SubresourceError> {
        let Some(ws) = ws else {
            return Err(SubresourceError::bad_request(
                "console is a websocket: connect with `Upgrade: websocket` and the subprotocol plain.kubevirt.io (`virtctl console` does)",
            ));
        };
        let node = self.running_node(None).await?;
        let upstream = dialer?
            .console(self.client, &node, self.namespace, self.name)
            .await?;
        Ok(ws
            .protocols(["plain.kubevirt.io"])
            .on_upgrade(move |socket| splice(socket, upstream)))
    }

    /// portforward: the guest's port dialled before the upgrade, so that a port nobody
    /// listens on is an answer, then carried over the websocket.
    async fn port_forward(
        &self,
        port: u16,
        ws: Option<WebSocketUpgrade>,
    ) -> Result<Response, SubresourceError> {
        let Some(ws) = ws else {
            return Err(SubresourceError::bad_request(
                "portforward is a websocket: connect with `Upgrade: websocket` (`virtctl port-forward` does)",
            ));
        };
        let target = self.guest_address(port).await?;
        let unreachable = |why: String| {
            SubresourceError::new(
                503,
                "ServiceUnavailable",
                format!("dialing {target}: {why}"),
            )
        };
        let tcp = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            tokio::net::TcpStream::connect(target),
        )
        .await
        .map_err(|_| unreachable("timed out".into()))?
        .map_err(|e| unreachable(e.to_string()))?;
        Ok(ws
            .protocols(["plain.kubevirt.io"])
            .on_upgrade(move |socket| {
                let (r, w) = tcp.into_split();
                controller_runtime::websocket::relay(
                    socket,
                    r,
                    w,
                    controller_runtime::websocket::AtEnd::Stop,
                )
            }))
    }

    /// Where `port` of the running VMI is reached: its first interface's address, which the
    /// Pod network (masquerade's DNAT) carries to the guest.
    async fn guest_address(&self, port: u16) -> Result<std::net::SocketAddr, SubresourceError> {
        let vmi = self.vmi().await?;
        let status = vmi.status.unwrap_or_default();
        if status.phase != Some(api::VmiPhase::Running) {
            return Err(SubresourceError::conflict("VMI is not running"));
        }
        let ip = status
            .interfaces
            .iter()
            .find_map(|i| i.ip_address.clone())
            .ok_or_else(|| SubresourceError::conflict("VMI has no IP address (yet)"))?;
        let ip: std::net::IpAddr = ip
            .parse()
            .map_err(|_| SubresourceError::internal(format!("VMI reports IP address {ip:?}")))?;
        Ok(std::net::SocketAddr::new(ip, port))
    }

    /// start, stop, restart: the plan from the VM and its VMI, then its writes.
    async fn vm_verb<O: DeserializeOwned + Default>(
        &self,
        plan: impl Fn(
            &VirtualMachine,
            Option<&VirtualMachineInstance>,
            &O,
        ) -> Result<Plan, SubresourceError>,
        body: &Bytes,
        dry_run_of: impl FnOnce(&O) -> &Vec<String>,
    ) -> Result<Response, SubresourceError> {
        let opts: O = options(body)?;
        let dry_run = verbs::dry_run(dry_run_of(&opts))?;
        // The writes are guarded by the resourceVersion read, and virt-controller writes the
        // VM's status all the time: on a conflict the VM is read again and the verb decided
        // again on what it is now, a few times before the conflict is the caller's.
        let mut attempts = 0;
        loop {
            attempts += 1;
            match self.vm_verb_once(&plan, &opts, dry_run).await {
                Err(e)
                    if e.code == 409 && e.reason == "Conflict" && attempts < 5 && is_stale(&e) =>
                {
                    continue
                }
                r => return r,
            }
        }
    }

    async fn vm_verb_once<O>(
        &self,
        plan: &impl Fn(
            &VirtualMachine,
            Option<&VirtualMachineInstance>,
            &O,
        ) -> Result<Plan, SubresourceError>,
        opts: &O,
        dry_run: bool,
    ) -> Result<Response, SubresourceError> {
        let vm = self.vm().await?;
        let vmi = self.vmi_opt().await?;
        let plan = plan(&vm, vmi.as_ref(), opts).map_err(|e| e.about_vm(self.name))?;
        let pp = PatchParams {
            dry_run,
            ..Default::default()
        };
        if let Some(grace) = plan.vmi_grace_period {
            let patch = json!({"spec": {"terminationGracePeriodSeconds": grace}});
            self.api::<VirtualMachineInstance>()
                .patch(self.name, &pp, &Patch::Merge(&patch))
                .await
                .map_err(SubresourceError::from_kube)?;
        }
        let vms = self.api::<VirtualMachine>();
        match plan.change {
            VmChange::Spec(patch) if patch == json!({}) => {}
            VmChange::Spec(patch) => {
                vms.patch(self.name, &pp, &Patch::Merge(&patch))
                    .await
                    .map_err(SubresourceError::from_kube)?;
            }
            VmChange::Requests(requests) => {
                // Guarded by the resourceVersion read: a request made meanwhile is a conflict,
                // never overwritten.
                let patch = json!({
                    "metadata": {"resourceVersion": vm.metadata.resource_version},
                    "status": {"stateChangeRequests": requests},
                });
                vms.patch_status(self.name, &pp, &Patch::Merge(&patch))
                    .await
                    .map_err(SubresourceError::from_kube)?;
            }
        }
        Ok(StatusCode::ACCEPTED.into_response())
    }

    /// expand-spec: the VM as its VMIs are made, its instance type and preference applied to
    /// the template (and the references to them gone); nothing is written.
    async fn expand_spec(&self) -> Result<Response, SubresourceError> {
        let mut vm = self.vm().await?;
        let found = controller::instancetype::look_up(self.client, &vm)
            .await
            .map_err(|e| match e {
                controller::instancetype::ResolveError::Missing(m) => {
                    SubresourceError::bad_request(m)
                }
                controller::instancetype::ResolveError::Kube(e) => SubresourceError::from_kube(e),
            })?;
        let mut spec = vm.spec.template.spec.clone().unwrap_or_default();
        api::instancetype::expand(
            &mut spec,
            found.instancetype.as_ref(),
            found.preference.as_ref(),
            "spec.template.spec",
        )
        .map_err(SubresourceError::bad_request)?;
        vm.spec.template.spec = Some(spec);
        vm.spec.instancetype = None;
        vm.spec.preference = None;
        Ok(Json(vm).into_response())
    }

    /// migrate: a VirtualMachineInstanceMigration for the VM's VMI (the webhook refuses one
    /// that cannot migrate, in its own words, which reach the caller).
    async fn migrate(&self, body: &Bytes) -> Result<Response, SubresourceError> {
        let opts: MigrateOptions = options(body)?;
        let dry_run = verbs::dry_run(&opts.dry_run)?;
        if opts.added_node_selector.is_some_and(|s| !s.is_empty()) {
            return Err(SubresourceError::bad_request(
                "addedNodeSelector is not supported: the target node is chosen by the scheduler from the VMI's own node selector and affinity",
            ));
        }
        self.vm().await?;
        if self.vmi_opt().await?.is_none() {
            return Err(SubresourceError::conflict("VM is not running").about_vm(self.name));
        }
        let mut vmim = VirtualMachineInstanceMigration::new(
            "",
            api::VirtualMachineInstanceMigrationSpec {
                vmi_name: self.name.to_string(),
            },
        );
        vmim.metadata.name = None;
        vmim.metadata.generate_name = Some("kubevirt-migrate-vm-".into());
        let pp = PostParams {
            dry_run,
            ..Default::default()
        };
        self.api::<VirtualMachineInstanceMigration>()
            .create(&pp, &vmim)
            .await
            .map_err(SubresourceError::from_kube)?;
        Ok(StatusCode::ACCEPTED.into_response())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verbs_methods_and_unknown_subresources() {
        assert_eq!(
            verb_of("virtualmachines", "start").unwrap(),
            (Verb::Start, Method::PUT, "update")
        );
        assert_eq!(
            verb_of("virtualmachineinstances", "guestosinfo").unwrap(),
            (Verb::GuestAgent, Method::GET, "get")
        );
        let e = verb_of("virtualmachines", "frobnicate").unwrap_err();
        assert_eq!(e.code, 404);
        assert!(
            e.message.contains("served: start, stop, restart, migrate"),
            "{e}"
        );
        let e = verb_of("pods", "start").unwrap_err();
        assert!(e.message.contains("no resource \"pods\""), "{e}");
        assert!(matches!(
            verb_of("virtualmachineinstances", "vnc").unwrap().0,
            Verb::NoDevice(w) if w.contains("no graphics device")
        ));
    }
}
