//! An in-process Kubernetes API server over HTTP, for running the real controllers (kube-rs
//! clients, watchers and `Controller`s) without a cluster.
//!
//! Written by hand because no maintained crate serves the Kubernetes REST protocol in-process:
//! kube-rs's own test support mocks at the tower-service level (below HTTP), which would tell the
//! client it is not talking to an API server. What this one implements, as the real one does:
//! - list with label selectors and field selectors (on the fields the real server selects each
//!   kind on: name and namespace, and for built-in kinds their registries' fields), `limit`/
//!   `continue` paging and the list's resourceVersion;
//! - watch from a resourceVersion with replay, ADDED/MODIFIED/DELETED as objects enter and leave a
//!   selector, BOOKMARK events (`allowWatchBookmarks`), `timeoutSeconds`, and 410 Gone once a
//!   resourceVersion has been compacted away;
//! - create (generateName, uid, creationTimestamp, generation), update and patch (JSON merge,
//!   strategic merge as JSON merge for built-in kinds and 415 for custom resources, JSON patch)
//!   with 409 Conflict on a stale resourceVersion,
//!   no-op writes that do not bump the resourceVersion;
//! - the status subresource (the main resource ignores status, `/status` ignores the rest) and
//!   the scale subresource (autoscaling/v1 Scale);
//! - deletion with finalizers (deletionTimestamp at now + grace, removal once finalizers are
//!   gone), graceful
//!   deletion of Pods bound to a node (the kubelet completes it with gracePeriodSeconds=0), and
//!   ownerReference garbage collection beside the server, after the delete, by its
//!   `propagationPolicy` (Background, Foreground, Orphan; see `gc`);
//! - fault injection for the error-handling tests: failing requests with a status code, and
//!   dropping every open watch.
//!
//! - discovery, OpenAPI v3, `/version` and Table output for kubectl (see [`crate::discovery`]).
//!
//! - namespaced objects only in a namespace that exists and is not being deleted (`default`,
//!   `kube-system`, `kube-public` and `kube-node-lease` exist from the start);
//! - `dryRun=All` on every write: checked, admitted and answered, never stored;
//! - custom resources stored as their CRD's structural schema has them (`schema`): a wrong
//!   type or a value outside an enum refused with 422, unknown fields pruned where the schema
//!   does not preserve them.
//!
//! - server-side apply with field ownership in `managedFields` (`apply`; lists atomic).
//!
//! - the aggregation layer (`aggregator`): paths an `APIService` claims are authenticated,
//!   authorized and forwarded to its Service with the front proxy's client certificate and
//!   identity headers; `SubjectAccessReview`s answered from the RBAC rules enforced; the
//!   front-proxy settings in `kube-system/extension-apiserver-authentication`.
//!
//! - admission webhooks called from the registrations stored in it (`webhooks`), and the
//!   Eviction API with PodDisruptionBudgets (`eviction`).
//!
//! Concerns by module: `auth` (tokens, RBAC, access reviews), `reads` (list, watch), `writes`
//! (the store), `webhooks`, `eviction`, `apply`, `gc`, `schema`, `aggregator`, `selectors`.
//!
//! Not implemented (the controllers do not use them): deletecollection, protobuf.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Method, Response, Uri};
use serde_json::{json, Value};
use tokio::sync::broadcast;

use crate::rbac::{Authorizer, RequestAttributes};

mod aggregator;
mod apply;
mod auth;
mod csr;
mod errors;
mod eviction;
mod gc;
mod json;
mod reads;
pub mod resources;
mod schema;
mod selectors;
mod webhooks;
mod writes;

pub use aggregator::{groups_of, Caller, FRONT_PROXY_CLIENT};
use errors::{json_response, with_warnings, ApiError, ApiResult};
use json::{get_path, has_finalizers, merge_patch, meta, meta_str, set_path};
pub use resources::{default_types, ResourceType};
use selectors::{parse_field_selector, parse_label_selector, selectable_field, Filter};

#[derive(Clone, Debug)]
struct WatchEvent {
    rv: u64,
    rtype: String,
    kind: &'static str,
    old: Option<Value>,
    new: Value,
}

/// A request fault: the next `remaining` requests whose method and path match fail with `code`.
#[derive(Clone, Debug)]
struct Fault {
    method: Option<Method>,
    path_contains: String,
    /// Fail with this code, or (0) answer normally after `delay`.
    code: u16,
    delay: Duration,
    remaining: u64,
}

type Key = (String, String); // namespace ("" for cluster-scoped), name

struct State {
    rv: u64,
    objects: BTreeMap<String, BTreeMap<Key, Value>>,
    history: VecDeque<WatchEvent>,
    /// Watches from a resourceVersion below this get 410 Gone.
    compacted: u64,
    faults: Vec<Fault>,
}

struct Inner {
    types: Vec<ResourceType>,
    state: Mutex<State>,
    events: broadcast::Sender<Arc<WatchEvent>>,
    /// Bumped to end every open watch.
    watch_epoch: tokio::sync::watch::Sender<u64>,
    bookmark_interval: Duration,
    history_limit: usize,
    requests: AtomicU64,
    request_log: Mutex<Vec<(Method, String, u16)>>,
    auth: Mutex<Authentication>,
    /// The aggregation layer's client certificate and CA (see `aggregator`).
    front_proxy: aggregator::FrontProxy,
    /// Where each Service's endpoints listen, by (namespace, name).
    endpoints: Mutex<HashMap<(String, String), SocketAddr>>,
}

/// A create, update or delete of an object (or a `pods/eviction`), as the API server hands it
/// to admission webhooks.
#[derive(Clone, Debug)]
pub struct AdmissionAttributes {
    /// `CREATE`, `UPDATE` or `DELETE`.
    pub operation: &'static str,
    pub group: &'static str,
    pub version: &'static str,
    pub resource: &'static str,
    pub kind: &'static str,
    pub subresource: Option<String>,
    pub namespace: Option<String>,
    pub name: Option<String>,
    /// The object as it would be stored (null for a delete).
    pub object: Value,
    /// The stored object, for an update or a delete.
    pub old_object: Option<Value>,
    /// Who asked.
    pub user: String,
    pub dry_run: bool,
}

/// Bearer token → user, and the RBAC rules such users are held to. Requests without a token
/// are the cluster admin's (the test itself).
#[derive(Default)]
struct Authentication {
    /// Token → user and the token's extra (a node-bound token's node).
    users: HashMap<String, (String, BTreeMap<String, Vec<String>>)>,
    rbac: Option<Arc<Authorizer>>,
}

/// A running server; dropping it does not stop it (it lives as long as the runtime).
#[derive(Clone)]
pub struct ApiServer {
    inner: Arc<Inner>,
    pub addr: SocketAddr,
}

#[derive(Clone, Debug)]
pub struct ApiServerOptions {
    pub bookmark_interval: Duration,
    /// Events kept for watch replay; older resourceVersions get 410 Gone.
    pub history_limit: usize,
    /// Serve CDI's own `cdis.cdi.kubevirt.io` kind, as a cluster with CDI installed does.
    pub cdi_installed: bool,
}

impl Default for ApiServerOptions {
    fn default() -> Self {
        ApiServerOptions {
            bookmark_interval: Duration::from_secs(1),
            history_limit: 100_000,
            cdi_installed: false,
        }
    }
}

fn now_rfc3339() -> String {
    jiff::Timestamp::now()
        .round(jiff::Unit::Second)
        .unwrap()
        .to_string()
}

/// A custom resource as its CRD's structural schema has it (`schema`): unknown fields pruned,
/// a wrong type refused with 422 naming every path, as the real server does before storing.
fn conform(rt: &ResourceType, obj: &mut Value) -> ApiResult<()> {
    if rt.kind == "Secret" {
        // A Secret's write-only `stringData` is merged into `data` (base64), as the real
        // server stores it.
        use base64::Engine;
        if let Some(Value::Object(plain)) = obj.as_object_mut().and_then(|o| o.remove("stringData"))
        {
            let data = obj["data"].as_object().cloned().unwrap_or_default();
            let mut data = data;
            for (k, v) in plain {
                let v = v.as_str().unwrap_or_default().as_bytes().to_vec();
                data.insert(
                    k,
                    base64::engine::general_purpose::STANDARD.encode(v).into(),
                );
            }
            obj["data"] = Value::Object(data);
        }
    }
    let Some(schema) = crate::discovery::schema_of(rt) else {
        return Ok(());
    };
    let c = schema::conform(schema, obj);
    if c.invalid.is_empty() {
        return Ok(());
    }
    let name = meta_str(obj, "name").unwrap_or_default();
    let what = if c.invalid.len() == 1 {
        c.invalid[0].clone()
    } else {
        format!("[{}]", c.invalid.join(", "))
    };
    Err(ApiError::new(
        422,
        "Invalid",
        format!("{}.{} \"{name}\" is invalid: {what}", rt.kind, rt.group),
    ))
}

/// `dryRun`: `All` or nothing, as the real server accepts.
fn dry_run(q: &BTreeMap<String, String>) -> ApiResult<bool> {
    match q.get("dryRun").map(String::as_str) {
        None => Ok(false),
        Some("All") => Ok(true),
        Some(other) => Err(ApiError::new(
            400,
            "BadRequest",
            format!("dryRun: unsupported value {other:?}: supported values: \"All\""),
        )),
    }
}

/// `seconds` from now, as a timestamp.
fn rfc3339_in(seconds: i64) -> String {
    let now = jiff::Timestamp::now().round(jiff::Unit::Second).unwrap();
    now.checked_add(jiff::SignedDuration::from_secs(seconds))
        .unwrap_or(now)
        .to_string()
}

fn random_suffix(n: usize) -> String {
    // Kubernetes' generateName alphabet (no vowels, no confusable digits).
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    (0..n)
        .map(|_| ALPHABET[fastrand::usize(..ALPHABET.len())] as char)
        .collect()
}

/// A fresh UID, as the server gives objects (and admission requests).
/// What a node-bound service-account token says beyond the user: the node.
fn node_bound(node: &str) -> BTreeMap<String, Vec<String>> {
    [(
        "authentication.kubernetes.io/node-name".to_string(),
        vec![node.to_string()],
    )]
    .into()
}

pub fn new_uid() -> String {
    uid()
}

fn uid() -> String {
    let b: [u8; 16] = std::array::from_fn(|_| fastrand::u8(..));
    format!(
        "{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-4{:01x}{:02x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
        b[0], b[1], b[2], b[3], b[4], b[5], b[6] & 0xf, b[7], (b[8] & 0x3f) | 0x80, b[9], b[10], b[11], b[12], b[13],
        b[14], b[15]
    )
}

/// The `fieldValidation` query parameter (kubectl sends `Strict`): fields the schema does not
/// know refused (`Strict`) or warned about (`Warn`), as the server's strict decoding does; a
/// client that does not ask gets neither.
fn field_validation(
    rt: &ResourceType,
    q: &BTreeMap<String, String>,
    obj: &Value,
) -> ApiResult<Vec<String>> {
    let mode = q.get("fieldValidation").map(String::as_str);
    if !matches!(mode, Some("Strict") | Some("Warn")) {
        return Ok(vec![]);
    }
    let unknown: Vec<String> = crate::discovery::unknown_fields(rt, obj)
        .into_iter()
        .map(|f| format!("unknown field \"{f}\""))
        .collect();
    if unknown.is_empty() {
        Ok(vec![])
    } else if mode == Some("Strict") {
        Err(ApiError::new(
            400,
            "BadRequest",
            format!(
                "{} in version \"{}\" cannot be handled as a {}: strict decoding error: {}",
                rt.kind,
                rt.version,
                rt.kind,
                unknown.join(", ")
            ),
        ))
    } else {
        Ok(unknown)
    }
}

/// An events.k8s.io/v1 Event as core v1 shows it (the API server's conversion).
fn core_event(e: &Value) -> Value {
    let mut c = json!({
        "apiVersion": "v1", "kind": "Event", "metadata": e["metadata"],
        "involvedObject": e["regarding"], "reason": e["reason"], "message": e["note"],
        "type": e["type"], "action": e["action"], "eventTime": e["eventTime"],
        "reportingComponent": e["reportingController"],
        "reportingInstance": e["reportingInstance"],
        "source": e.get("deprecatedSource").cloned()
            .unwrap_or_else(|| json!({"component": e["reportingController"]})),
        "count": e.get("deprecatedCount").cloned().unwrap_or(json!(1)),
    });
    for (from, to) in [
        ("deprecatedFirstTimestamp", "firstTimestamp"),
        ("deprecatedLastTimestamp", "lastTimestamp"),
        ("related", "related"),
        ("series", "series"),
    ] {
        if let Some(v) = e.get(from) {
            c[to] = v.clone();
        }
    }
    c
}

// ---------------------------------------------------------------------------------------------
// Request routing

struct Target {
    rtype: ResourceType,
    namespace: Option<String>,
    name: Option<String>,
    subresource: Option<String>,
    /// `dryRun=All`: the write is checked and answered as if stored, and nothing is stored.
    dry_run: bool,
    /// Who is asking (admission webhooks are told; a CSR is stamped with it).
    caller: Caller,
}

impl Inner {
    fn route(&self, path: &str) -> ApiResult<Target> {
        let not_found = || {
            ApiError::new(
                404,
                "NotFound",
                format!("the server could not find the requested resource ({path})"),
            )
        };
        let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
        let (group, version, rest) = match segs.as_slice() {
            ["api", v, rest @ ..] => ("", *v, rest),
            ["apis", g, v, rest @ ..] => (*g, *v, rest),
            _ => return Err(not_found()),
        };
        let (namespace, rest) = match rest {
            ["namespaces", ns, r, rest @ ..] => (Some(ns.to_string()), {
                let mut v = vec![*r];
                v.extend_from_slice(rest);
                v
            }),
            r => (None, r.to_vec()),
        };
        let (plural, name, sub) = match rest.as_slice() {
            [p] => (*p, None, None),
            [p, n] => (*p, Some(n.to_string()), None),
            [p, n, s] => (*p, Some(n.to_string()), Some(s.to_string())),
            _ => return Err(not_found()),
        };
        let rtype = self
            .types
            .iter()
            .find(|t| t.group == group && t.version == version && t.plural == plural)
            .ok_or_else(not_found)?
            .clone();
        if namespace.is_some() && !rtype.namespaced {
            return Err(not_found());
        }
        Ok(Target {
            rtype,
            namespace,
            name,
            subresource: sub,
            dry_run: false,
            caller: Caller::default(),
        })
    }
}

fn query_map(uri: &Uri) -> BTreeMap<String, String> {
    uri.query()
        .map(|q| {
            url::form_urlencoded::parse(q.as_bytes())
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect()
        })
        .unwrap_or_default()
}

impl ApiServer {
    pub async fn start() -> ApiServer {
        Self::start_with(ApiServerOptions::default()).await
    }

    pub async fn start_with(opts: ApiServerOptions) -> ApiServer {
        let (events, _) = broadcast::channel(1 << 16);
        let (watch_epoch, _) = tokio::sync::watch::channel(0);
        let mut types = default_types();
        if opts.cdi_installed {
            types.push(resources::ResourceType {
                group: "cdi.kubevirt.io",
                version: "v1beta1",
                plural: "cdis",
                kind: "CDI",
                namespaced: false,
                status_subresource: true,
                scale: None,
            });
        }
        let inner = Arc::new(Inner {
            types,
            state: Mutex::new(State {
                rv: 1,
                objects: BTreeMap::new(),
                history: VecDeque::new(),
                compacted: 0,
                faults: vec![],
            }),
            events,
            watch_epoch,
            bookmark_interval: opts.bookmark_interval,
            history_limit: opts.history_limit,
            requests: AtomicU64::new(0),
            request_log: Mutex::new(vec![]),
            auth: Mutex::new(Authentication::default()),
            front_proxy: aggregator::FrontProxy::generate(),
            endpoints: Mutex::new(HashMap::new()),
        });
        // The namespaces a real server makes for itself.
        let namespaces = Target {
            rtype: inner
                .types
                .iter()
                .find(|t| t.plural == "namespaces")
                .expect("namespaces are served")
                .clone(),
            namespace: None,
            name: None,
            subresource: None,
            dry_run: false,
            caller: Caller::default(),
        };
        for ns in ["default", "kube-system", "kube-public", "kube-node-lease"] {
            let obj = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}});
            inner.create(&namespaces, obj).expect("a system namespace");
        }
        // What kube-apiserver publishes for aggregated API servers.
        let config_maps = inner
            .route("/api/v1/namespaces/kube-system/configmaps")
            .unwrap();
        inner
            .create(&config_maps, inner.front_proxy.config_map())
            .expect("the front-proxy settings");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app_inner = inner.clone();
        let app = axum::Router::new().fallback(move |req: axum::extract::Request| {
            let inner = app_inner.clone();
            async move { inner.entry(req).await }
        });
        tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        // The garbage collector runs beside the server, as kube-controller-manager's does.
        let collector = Arc::downgrade(&inner);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(20)).await;
                match collector.upgrade() {
                    Some(inner) => inner.collect_garbage(),
                    None => return,
                }
            }
        });
        ApiServer { inner, addr }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kube client for this server, as `kubectl`/a controller would build from a kubeconfig.
    pub fn client(&self) -> kube::Client {
        let config = kube::Config::new(self.url().parse().unwrap());
        kube::Client::try_from(config).unwrap()
    }

    /// Holds every request made with a token (see [`ApiServer::client_as`]) to these RBAC
    /// rules: what they do not grant is refused with 403 Forbidden.
    pub fn enforce_rbac(&self, authorizer: Authorizer) {
        self.inner.auth.lock().unwrap().rbac = Some(Arc::new(authorizer));
    }

    /// Says that the endpoints of Service `namespace/name` listen at `addr` (the aggregation
    /// layer forwards there).
    pub fn set_service_endpoint(&self, namespace: &str, name: &str, addr: SocketAddr) {
        self.inner
            .endpoints
            .lock()
            .unwrap()
            .insert((namespace.into(), name.into()), addr);
    }

    /// A new bearer token that authenticates as `user`.
    fn issue_token(&self, user: &str) -> String {
        self.issue_token_with(user, BTreeMap::new())
    }

    fn issue_token_with(&self, user: &str, extra: BTreeMap<String, Vec<String>>) -> String {
        let token = format!("token-{}", random_suffix(16));
        let mut auth = self.inner.auth.lock().unwrap();
        auth.users.insert(token.clone(), (user.to_string(), extra));
        token
    }

    /// A kubeconfig (see [`ApiServer::write_kubeconfig`]) with a node-bound token of `user`
    /// on `node` (see [`ApiServer::client_on_node`]).
    pub fn write_kubeconfig_on_node(&self, path: &std::path::Path, user: &str, node: &str) {
        let token = self.issue_token_with(user, node_bound(node));
        self.write_kubeconfig_with(path, &format!("{{token: {token}}}"));
    }

    /// A client with a node-bound token of `user` (a service account) for a Pod on `node`, as
    /// the kubelet mounts it (Kubernetes ≥ 1.30): the server knows the node the caller runs on
    /// and records it where it records who asked (a CertificateSigningRequest's `spec.extra`).
    pub fn client_on_node(&self, user: &str, node: &str) -> kube::Client {
        let token = self.issue_token_with(user, node_bound(node));
        let mut config = kube::Config::new(self.url().parse().unwrap());
        config.auth_info.token = Some(secrecy::SecretString::from(token));
        kube::Client::try_from(config).unwrap()
    }

    /// A client authenticated as `user` (a bearer token the server maps to that user), as a
    /// component running under its service account would be.
    pub fn client_as(&self, user: &str) -> kube::Client {
        let token = self.issue_token(user);
        let mut config = kube::Config::new(self.url().parse().unwrap());
        config.auth_info.token = Some(secrecy::SecretString::from(token));
        kube::Client::try_from(config).unwrap()
    }

    /// A kubeconfig file pointing at this server, for controller processes: as the cluster
    /// admin, or as `user` (with a token, see [`ApiServer::client_as`]).
    pub fn write_kubeconfig(&self, path: &std::path::Path, user: Option<&str>) {
        let credentials = match user {
            Some(u) => format!("{{token: {}}}", self.issue_token(u)),
            None => "{}".into(),
        };
        self.write_kubeconfig_with(path, &credentials);
    }

    fn write_kubeconfig_with(&self, path: &std::path::Path, credentials: &str) {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\nusers:\n- name: fake\n  user: {credentials}\ncurrent-context: fake\n",
            self.url()
        );
        std::fs::write(path, text).unwrap();
    }

    /// The next `count` requests with this method (any if None) whose path contains
    /// `path_contains` fail with `code`.
    pub fn fail_requests(
        &self,
        method: Option<Method>,
        path_contains: &str,
        code: u16,
        count: u64,
    ) {
        self.inner.state.lock().unwrap().faults.push(Fault {
            method,
            path_contains: path_contains.into(),
            code,
            delay: Duration::ZERO,
            remaining: count,
        });
    }

    /// The next `count` matching requests are answered only after `delay` (a slow or hung
    /// API server).
    pub fn delay_requests(
        &self,
        method: Option<Method>,
        path_contains: &str,
        delay: Duration,
        count: u64,
    ) {
        self.inner.state.lock().unwrap().faults.push(Fault {
            method,
            path_contains: path_contains.into(),
            code: 0,
            delay,
            remaining: count,
        });
    }

    /// How many injected faults have not been hit yet.
    pub fn pending_faults(&self) -> u64 {
        let st = self.inner.state.lock().unwrap();
        st.faults.iter().map(|f| f.remaining).sum()
    }

    /// Forgets the injected faults on paths containing `path_contains` that were not hit yet.
    pub fn clear_faults(&self, path_contains: &str) {
        let mut st = self.inner.state.lock().unwrap();
        st.faults.retain(|f| f.path_contains != path_contains);
    }

    /// Ends every open watch stream (as an API server restart or a load balancer would).
    pub fn drop_watches(&self) {
        self.inner.watch_epoch.send_modify(|e| *e += 1);
    }

    /// Forgets watch history so that resuming from any earlier resourceVersion gets 410 Gone.
    pub fn compact(&self) {
        let mut st = self.inner.state.lock().unwrap();
        st.compacted = st.rv;
        st.history.clear();
    }

    pub fn request_count(&self) -> u64 {
        self.inner.requests.load(Ordering::Relaxed)
    }

    /// (method, path, status code) of every request so far.
    pub fn request_log(&self) -> Vec<(Method, String, u16)> {
        self.inner.request_log.lock().unwrap().clone()
    }

    /// How many stored objects of a kind (by plural) `f` holds for, without copying them.
    pub fn count(&self, plural: &str, f: impl Fn(&Value) -> bool) -> usize {
        let st = self.inner.state.lock().unwrap();
        let suffix = format!("/{plural}");
        st.objects
            .iter()
            .filter(|(k, _)| k.ends_with(&suffix))
            .flat_map(|(_, m)| m.values())
            .filter(|o| f(o))
            .count()
    }

    /// Every stored object of a kind (by plural, e.g. "pods"), in key order.
    pub fn objects(&self, plural: &str) -> Vec<Value> {
        let st = self.inner.state.lock().unwrap();
        st.objects
            .iter()
            .filter(|(k, _)| k.ends_with(&format!("/{plural}")))
            .flat_map(|(_, m)| m.values().cloned())
            .collect()
    }
}

impl Inner {
    /// Every request: an upgrade to an aggregated API keeps its connection (see
    /// `aggregator`), anything else is read whole and handled.
    async fn entry(self: Arc<Self>, req: axum::extract::Request) -> Response<Body> {
        let upgrade = req
            .headers()
            .get("upgrade")
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"websocket"));
        if upgrade {
            let (method, path) = (req.method().clone(), req.uri().path().to_string());
            let resp = match self.aggregate_upgrade(req).await {
                Some(answer) => answer.unwrap_or_else(|e| json_response(e.code, &e.status())),
                None => json_response(
                    400,
                    &ApiError::new(
                        400,
                        "BadRequest",
                        format!("no websocket is served at {path}"),
                    )
                    .status(),
                ),
            };
            self.request_log
                .lock()
                .unwrap()
                .push((method, path, resp.status().as_u16()));
            return resp;
        }
        let (parts, body) = req.into_parts();
        let body = match axum::body::to_bytes(body, 64 << 20).await {
            Ok(b) => b,
            Err(e) => {
                return json_response(
                    413,
                    &ApiError::new(413, "RequestEntityTooLarge", e.to_string()).status(),
                )
            }
        };
        self.handle(parts.method, parts.uri, parts.headers, body)
            .await
    }

    async fn handle(
        self: Arc<Self>,
        method: Method,
        uri: Uri,
        headers: HeaderMap,
        body: Bytes,
    ) -> Response<Body> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let path = uri.path().to_string();
        let q = query_map(&uri);
        let host = headers
            .get("host")
            .and_then(|h| h.to_str().ok())
            .unwrap_or("")
            .to_string();
        if let Some(answer) = self.aggregate(&method, &uri, &headers, &body).await {
            let resp = answer.unwrap_or_else(|e| json_response(e.code, &e.status()));
            self.request_log
                .lock()
                .unwrap()
                .push((method, path, resp.status().as_u16()));
            return resp;
        }
        // Discovery, OpenAPI and /version are readable by every user (the real server's
        // system:discovery and system:public-info-viewer roles).
        if let Some(answer) = crate::discovery::serve(&self.types, &path, &host) {
            let resp = match answer {
                Ok(v) => json_response(200, &v),
                Err(message) => {
                    json_response(404, &ApiError::new(404, "NotFound", message).status())
                }
            };
            self.request_log
                .lock()
                .unwrap()
                .push((method, path, resp.status().as_u16()));
            return resp;
        }
        let resp = match self.authorize(&method, &path, &q, &headers) {
            Err(e) => Err(e),
            Ok(()) => {
                self.clone()
                    .serve(method.clone(), &path, &q, &headers, &body)
                    .await
            }
        };
        let resp = resp.unwrap_or_else(|e| json_response(e.code, &e.status()));
        self.request_log
            .lock()
            .unwrap()
            .push((method, path, resp.status().as_u16()));
        resp
    }

    async fn serve(
        self: Arc<Self>,
        method: Method,
        path: &str,
        q: &BTreeMap<String, String>,
        headers: &HeaderMap,
        body: &Bytes,
    ) -> ApiResult<Response<Body>> {
        let path = path.to_string();
        let resp = match self.check_fault(&method, &path) {
            Some(Err(e)) => Err(e),
            Some(Ok(delay)) => {
                tokio::time::sleep(delay).await;
                self.clone()
                    .dispatch(&method, &path, q, headers, body)
                    .await
            }
            None => {
                self.clone()
                    .dispatch(&method, &path, q, headers, body)
                    .await
            }
        };
        resp
    }

    /// A matching fault: Err to fail the request, Ok(delay) to answer it late.
    fn check_fault(&self, method: &Method, path: &str) -> Option<Result<Duration, ApiError>> {
        let mut st = self.state.lock().unwrap();
        let f = st.faults.iter_mut().find(|f| {
            f.remaining > 0
                && f.method.as_ref().is_none_or(|m| m == method)
                && path.contains(&f.path_contains)
        })?;
        f.remaining -= 1;
        if f.code == 0 {
            return Some(Ok(f.delay));
        }
        let reason = match f.code {
            409 => "Conflict",
            429 => "TooManyRequests",
            500 => "InternalError",
            503 => "ServiceUnavailable",
            504 => "Timeout",
            _ => "Unknown",
        };
        Some(Err(ApiError::new(f.code, reason, "injected fault")))
    }

    async fn dispatch(
        self: Arc<Self>,
        method: &Method,
        path: &str,
        q: &BTreeMap<String, String>,
        headers: &HeaderMap,
        body: &Bytes,
    ) -> ApiResult<Response<Body>> {
        let mut t = self.route(path)?;
        t.dry_run = dry_run(q)?;
        t.caller = self.authenticate(headers).unwrap_or_default();
        let body_json = || -> ApiResult<Value> {
            serde_json::from_slice(body)
                .map_err(|e| ApiError::new(400, "BadRequest", format!("invalid JSON body: {e}")))
        };
        let content_type = headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        match (method, &t.name, t.subresource.as_deref()) {
            (&Method::GET, None, None) => {
                let watch = q.get("watch").is_some_and(|w| w == "true" || w == "1");
                if watch {
                    self.watch(&t, q)
                } else {
                    Ok(json_response(
                        200,
                        &self.as_requested(&t, headers, q, self.list(&t, q)?),
                    ))
                }
            }
            (&Method::POST, None, None) if t.rtype.plural == "subjectaccessreviews" => {
                self.review_access(body_json()?)
            }
            (&Method::POST, None, None) => self.create_request(&t, q, body_json()?).await,
            (&Method::POST, Some(name), Some("eviction")) if t.rtype.plural == "pods" => {
                let eviction = body_json()?;
                self.evict(&t, name, &eviction).await
            }
            (&Method::GET, Some(name), None | Some("status")) => Ok(json_response(
                200,
                &self.as_requested(&t, headers, q, self.get(&t, name)?),
            )),
            (&Method::GET, Some(name), Some("scale")) => Ok(json_response(
                200,
                &self.scale_of(&t, &self.get(&t, name)?)?,
            )),
            (&Method::PUT, Some(name), None) => {
                self.admitted_update(&t, name, q, Update::Replace(body_json()?))
                    .await
            }
            (&Method::PUT, Some(name), sub) => {
                let obj = body_json()?;
                Ok(json_response(
                    200,
                    &self.update(&t, name, sub, Update::Replace(obj))?,
                ))
            }
            (&Method::PATCH, Some(name), sub) => {
                self.patch_request(&t, name, sub, q, &content_type, body_json()?)
                    .await
            }
            (&Method::DELETE, Some(name), None) => {
                let opts = if body.is_empty() {
                    json!({})
                } else {
                    body_json()?
                };
                let name = name.clone();
                self.delete_request(&mut t, &name, q, &opts).await
            }
            _ => Err(ApiError::new(
                405,
                "MethodNotAllowed",
                format!("{method} {path} is not supported"),
            )),
        }
    }

    /// POST of an object: field validation, the admission webhooks, then the store.
    async fn create_request(
        &self,
        t: &Target,
        q: &BTreeMap<String, String>,
        mut obj: Value,
    ) -> ApiResult<Response<Body>> {
        let mut warnings = field_validation(&t.rtype, q, &obj)?;
        if let (Some(ns), Some(m)) = (&t.namespace, obj["metadata"].as_object_mut()) {
            m.entry("namespace").or_insert(json!(ns));
        }
        if t.rtype.plural == csr::PLURAL {
            csr::stamp(&mut obj, &t.caller);
        }
        let attrs = self.admission_attributes(t, "CREATE", obj, None);
        let (admitted, more) = self.dynamic_admission(attrs, t.rtype.namespaced).await?;
        obj = admitted;
        warnings.extend(more);
        Ok(with_warnings(
            json_response(201, &self.create(t, obj)?),
            &warnings,
        ))
    }

    /// Server-side apply (`apply`): creates the object or updates the fields the manager
    /// applies, through admission either way.
    async fn apply_request(
        &self,
        t: &Target,
        name: &str,
        q: &BTreeMap<String, String>,
        applied: Value,
    ) -> ApiResult<Response<Body>> {
        let manager = q
            .get("fieldManager")
            .filter(|m| !m.is_empty())
            .ok_or_else(|| {
                ApiError::new(
                    400,
                    "BadRequest",
                    "fieldManager is required for apply requests",
                )
            })?;
        if meta_str(&applied, "name").is_some_and(|n| n != name) {
            return Err(ApiError::new(
                400,
                "BadRequest",
                format!(
                    "the name of the object ({}) does not match the name on the URL ({name})",
                    meta_str(&applied, "name").unwrap_or_default()
                ),
            ));
        }
        let force = q.get("force").is_some_and(|f| f == "true");
        let current = match self.get(t, name) {
            Ok(c) => Some(c),
            Err(e) if e.code == 404 => None,
            Err(e) => return Err(e),
        };
        let result = apply::apply(
            current.as_ref(),
            &applied,
            manager,
            force,
            &t.rtype.api_version(),
            &now_rfc3339(),
        )
        .map_err(|m| ApiError::new(409, "Conflict", m))?;
        match current {
            None => self.create_request(t, q, result).await,
            Some(_) => {
                self.admitted_update(t, name, q, Update::Replace(result))
                    .await
            }
        }
    }

    /// PATCH of an object or its subresource: merge, JSON patch, or (built-in kinds only)
    /// strategic merge as merge.
    async fn patch_request(
        &self,
        t: &Target,
        name: &str,
        sub: Option<&str>,
        q: &BTreeMap<String, String>,
        content_type: &str,
        patch: Value,
    ) -> ApiResult<Response<Body>> {
        if content_type.starts_with("application/apply-patch") && sub.is_none() {
            return self.apply_request(t, name, q, patch).await;
        }
        let strategic = content_type.starts_with("application/strategic-merge-patch+json");
        if strategic && t.rtype.is_custom() {
            // Custom resources carry no patch strategies: the real server refuses.
            return Err(ApiError::new(
                415,
                "UnsupportedMediaType",
                format!("the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml (not {content_type:?} for {})", t.rtype.plural),
            ));
        }
        let kind = if content_type.starts_with("application/merge-patch+json") || strategic {
            Update::Merge(patch)
        } else if content_type.starts_with("application/json-patch+json") {
            Update::Json(patch)
        } else {
            return Err(ApiError::new(
                415,
                "UnsupportedMediaType",
                format!("patch type {content_type:?} is not supported by this test server"),
            ));
        };
        if sub.is_none() {
            return self.admitted_update(t, name, q, kind).await;
        }
        Ok(json_response(200, &self.update(t, name, sub, kind)?))
    }

    /// DELETE with its options (query or DeleteOptions body): grace period, preconditions,
    /// propagation policy, dry run.
    async fn delete_request(
        &self,
        t: &mut Target,
        name: &str,
        q: &BTreeMap<String, String>,
        opts: &Value,
    ) -> ApiResult<Response<Body>> {
        // DeleteOptions may carry it in the body too.
        if opts
            .get("dryRun")
            .and_then(Value::as_array)
            .is_some_and(|d| d.iter().any(|v| v == "All"))
        {
            t.dry_run = true;
        }
        let grace = q
            .get("gracePeriodSeconds")
            .and_then(|g| g.parse::<i64>().ok())
            .or_else(|| opts.get("gracePeriodSeconds").and_then(Value::as_i64));
        let precondition_rv = opts
            .pointer("/preconditions/resourceVersion")
            .and_then(Value::as_str)
            .map(str::to_string);
        let propagation = gc::Propagation::parse(
            q.get("propagationPolicy")
                .map(String::as_str)
                .or_else(|| opts.get("propagationPolicy").and_then(Value::as_str)),
        )
        .map_err(|m| ApiError::new(400, "BadRequest", m))?;
        if self.has_webhooks_for(t, "DELETE") {
            let old = self.get(t, name)?;
            let attrs = self.admission_attributes(t, "DELETE", Value::Null, Some(old));
            self.dynamic_admission(attrs, t.rtype.namespaced).await?;
        }
        Ok(json_response(
            200,
            &self.delete(t, name, grace, precondition_rv, propagation)?,
        ))
    }

    fn admission_attributes(
        &self,
        t: &Target,
        operation: &'static str,
        object: Value,
        old_object: Option<Value>,
    ) -> AdmissionAttributes {
        let name = meta_str(old_object.as_ref().unwrap_or(&object), "name")
            .map(str::to_string)
            .or_else(|| t.name.clone());
        AdmissionAttributes {
            operation,
            group: t.rtype.group,
            version: t.rtype.version,
            resource: t.rtype.plural,
            kind: t.rtype.kind,
            subresource: None,
            namespace: t.namespace.clone(),
            name,
            object,
            old_object,
            user: t.caller.user.clone(),
            dry_run: t.dry_run,
        }
    }

    /// An update or patch of an object, through the admission webhooks registered for it:
    /// they see the object as it would be stored; it is then stored only if nothing changed it meanwhile
    /// (a patch is retried on the newer object, as the real server does; a replace with the
    /// client's resourceVersion gets the conflict).
    async fn admitted_update(
        &self,
        t: &Target,
        name: &str,
        q: &BTreeMap<String, String>,
        update: Update,
    ) -> ApiResult<Response<Body>> {
        if !self.has_webhooks_for(t, "UPDATE") {
            let warnings = match &update {
                Update::Replace(obj) => field_validation(&t.rtype, q, obj)?,
                _ => vec![],
            };
            let stored = self.update(t, name, None, update)?;
            return Ok(with_warnings(json_response(200, &stored), &warnings));
        }
        let client_pinned = match &update {
            Update::Replace(_) => true,
            Update::Merge(p) => p.pointer("/metadata/resourceVersion").is_some(),
            Update::Json(_) => false,
        };
        for _ in 0..10 {
            let old = self.get(t, name)?;
            let candidate = match &update {
                Update::Replace(obj) => obj.clone(),
                Update::Merge(p) => {
                    let mut o = old.clone();
                    merge_patch(&mut o, p);
                    o
                }
                Update::Json(p) => {
                    let mut o = old.clone();
                    apply_json_patch(&mut o, p.clone())?;
                    o
                }
            };
            let mut warnings = field_validation(&t.rtype, q, &candidate)?;
            let attrs = self.admission_attributes(t, "UPDATE", candidate, Some(old));
            let (admitted, more) = self.dynamic_admission(attrs, t.rtype.namespaced).await?;
            warnings.extend(more);
            match self.update(t, name, None, Update::Replace(admitted)) {
                Err(e) if e.code == 409 && !client_pinned => continue,
                r => return Ok(with_warnings(json_response(200, &r?), &warnings)),
            }
        }
        Err(conflict(&t.rtype, name))
    }

    /// `body` as the client asked for it: as a Table when its Accept header says so.
    fn as_requested(
        &self,
        t: &Target,
        headers: &HeaderMap,
        q: &BTreeMap<String, String>,
        body: Value,
    ) -> Value {
        let accept = headers
            .get("accept")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if crate::discovery::wants_table(accept) {
            crate::discovery::table(&t.rtype, &body, q.get("includeObject").map(String::as_str))
        } else {
            body
        }
    }

    fn ns_key(&self, t: &Target) -> String {
        if t.rtype.namespaced {
            t.namespace.clone().unwrap_or_default()
        } else {
            String::new()
        }
    }

    fn get(&self, t: &Target, name: &str) -> ApiResult<Value> {
        let st = self.state.lock().unwrap();
        self.stored(&st, t, name)
    }

    /// The stored object `name` of the target's kind and namespace, or 404.
    fn stored(&self, st: &State, t: &Target, name: &str) -> ApiResult<Value> {
        st.objects
            .get(&t.rtype.key())
            .and_then(|m| m.get(&(self.ns_key(t), name.to_string())))
            .cloned()
            .ok_or_else(|| not_found(&t.rtype, name))
    }
}

enum Update {
    Replace(Value),
    Merge(Value),
    Json(Value),
}

fn apply_json_patch(target: &mut Value, patch: Value) -> ApiResult<()> {
    let p: json_patch::Patch = serde_json::from_value(patch)
        .map_err(|e| ApiError::new(400, "BadRequest", format!("invalid JSON patch: {e}")))?;
    json_patch::patch(target, &p)
        .map_err(|e| ApiError::new(422, "Invalid", format!("JSON patch failed: {e}")))
}

fn not_found(rt: &ResourceType, name: &str) -> ApiError {
    let g = if rt.group.is_empty() {
        String::new()
    } else {
        format!(".{}", rt.group)
    };
    ApiError::new(
        404,
        "NotFound",
        format!("{}{g} \"{name}\" not found", rt.plural),
    )
}

fn conflict(rt: &ResourceType, name: &str) -> ApiError {
    let g = if rt.group.is_empty() {
        String::new()
    } else {
        format!(".{}", rt.group)
    };
    ApiError::new(
        409,
        "Conflict",
        format!("Operation cannot be fulfilled on {}{g} \"{name}\": the object has been modified; please apply your changes to the latest version and try again", rt.plural),
    )
}

#[cfg(test)]
mod tests {
    use super::selectors::labels_match;
    use super::*;

    #[test]
    fn label_selectors() {
        let obj = json!({"metadata": {"labels": {"a": "1", "b": "x"}}});
        let m = |s: &str| labels_match(&obj, &parse_label_selector(s).unwrap());
        assert!(m("a=1"));
        assert!(m("a==1,b=x"));
        assert!(!m("a!=1"));
        assert!(m("a in (1,2)"));
        assert!(!m("a notin (1,2)"));
        assert!(m("b,!c"));
        assert!(!m("c"));
        assert!(parse_label_selector("a in 1").is_err());
    }

    #[test]
    fn merge_patch_rfc7386() {
        let mut t = json!({"a": {"b": 1, "c": 2}, "l": [1, 2]});
        merge_patch(&mut t, &json!({"a": {"b": null, "d": 3}, "l": [3]}));
        assert_eq!(t, json!({"a": {"c": 2, "d": 3}, "l": [3]}));
    }
}
