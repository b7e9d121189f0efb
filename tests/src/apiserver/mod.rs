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
//! Not implemented (the controllers do not use them): deletecollection,
//! protobuf, admission (the webhook is tested on its own).

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
mod errors;
mod gc;
mod json;
pub mod resources;
mod schema;
mod selectors;
mod webhooks;

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
    users: HashMap<String, String>,
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
    /// The authenticated user (admission webhooks are told).
    user: String,
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
            user: String::new(),
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
            user: String::new(),
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
        let token = format!("token-{}", random_suffix(16));
        let mut auth = self.inner.auth.lock().unwrap();
        auth.users.insert(token.clone(), user.to_string());
        token
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

    /// Authentication by bearer token and RBAC authorization, as the real server does before
    /// anything else.
    fn authorize(
        &self,
        method: &Method,
        path: &str,
        q: &BTreeMap<String, String>,
        headers: &HeaderMap,
    ) -> ApiResult<()> {
        let caller = self.authenticate(headers)?;
        let Some(authorizer) = self.auth.lock().unwrap().rbac.clone() else {
            return Ok(());
        };
        if caller.groups.iter().any(|g| g == "system:masters") {
            return Ok(());
        }
        let t = self.route(path)?;
        let verb = match (method, &t.name) {
            (&Method::GET, None) if q.get("watch").is_some_and(|w| w == "true" || w == "1") => {
                "watch"
            }
            (&Method::GET, None) => "list",
            (&Method::GET, Some(_)) => "get",
            (&Method::POST, _) => "create",
            (&Method::PUT, _) => "update",
            (&Method::PATCH, _) => "patch",
            (&Method::DELETE, None) => "deletecollection",
            (&Method::DELETE, Some(_)) => "delete",
            _ => return Ok(()),
        };
        let attrs = RequestAttributes {
            verb: verb.into(),
            api_group: t.rtype.group.into(),
            resource: match &t.subresource {
                Some(sub) => format!("{}/{sub}", t.rtype.plural),
                None => t.rtype.plural.into(),
            },
            namespace: t.namespace.clone(),
            name: t.name.clone(),
        };
        if authorizer.allows_as(&caller.user, &caller.groups, &attrs) {
            Ok(())
        } else {
            let message = Authorizer::forbidden_message(&caller.user, &attrs);
            // Printed so that a test that then times out says why.
            eprintln!("test API server: 403 {message}");
            Err(ApiError::new(403, "Forbidden", message))
        }
    }

    /// Who a request comes from: the user its bearer token was issued to, or without a token
    /// the cluster admin (the test itself); an unknown token is 401.
    fn authenticate(&self, headers: &HeaderMap) -> ApiResult<Caller> {
        let Some(token) = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
        else {
            return Ok(Caller {
                user: "system:admin".into(),
                groups: vec!["system:masters".into(), "system:authenticated".into()],
            });
        };
        let user = self.auth.lock().unwrap().users.get(token).cloned();
        let Some(user) = user else {
            return Err(ApiError::new(401, "Unauthorized", "Unauthorized"));
        };
        let groups = groups_of(&user);
        Ok(Caller { user, groups })
    }

    /// A SubjectAccessReview, answered from the RBAC rules the server enforces (everything is
    /// allowed where it enforces none), never stored.
    fn review_access(&self, mut review: Value) -> ApiResult<Response<Body>> {
        let spec = &review["spec"];
        let user = spec["user"].as_str().unwrap_or_default().to_string();
        let groups: Vec<String> = spec["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|g| g.as_str().map(str::to_string))
            .collect();
        let Some(ra) = spec.get("resourceAttributes") else {
            return Err(ApiError::new(
                422,
                "Invalid",
                "SubjectAccessReview spec.resourceAttributes: Required value (nonResourceAttributes are not supported here)",
            ));
        };
        let text = |k: &str| ra[k].as_str().unwrap_or_default().to_string();
        let resource = match text("subresource").as_str() {
            "" => text("resource"),
            sub => format!("{}/{sub}", text("resource")),
        };
        let attrs = RequestAttributes {
            verb: text("verb"),
            api_group: text("group"),
            resource,
            namespace: Some(text("namespace")).filter(|n| !n.is_empty()),
            name: Some(text("name")).filter(|n| !n.is_empty()),
        };
        let rbac = self.auth.lock().unwrap().rbac.clone();
        let allowed = groups.iter().any(|g| g == "system:masters")
            || rbac.is_none_or(|a| a.allows_as(&user, &groups, &attrs));
        review["status"] = if allowed {
            json!({"allowed": true, "reason": "RBAC: allowed"})
        } else {
            json!({"allowed": false, "reason": ""})
        };
        Ok(json_response(201, &review))
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
        t.user = self
            .authenticate(headers)
            .map(|c| c.user)
            .unwrap_or_default();
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
            user: t.user.clone(),
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

    /// The Eviction API: admission webhooks first, then PodDisruptionBudgets (a budget whose
    /// selector matches the Pod must still have a disruption to spare counting the Pods that are
    /// Running and Ready), then a graceful delete. A Pod that is not Running is not protected.
    async fn evict(&self, t: &Target, name: &str, eviction: &Value) -> ApiResult<Response<Body>> {
        let pod = self.get(t, name)?;
        let ns = t.namespace.clone().unwrap_or_default();
        let mut object = eviction.clone();
        if let Some(m) = object["metadata"].as_object_mut() {
            m.entry("namespace").or_insert(json!(ns));
        }
        let mut attrs = self.admission_attributes(t, "CREATE", object, None);
        attrs.subresource = Some("eviction".into());
        attrs.name = Some(name.to_string());
        self.dynamic_admission(attrs, true).await?;
        let running = pod.pointer("/status/phase").and_then(Value::as_str) == Some("Running");
        if running {
            self.check_disruption_budgets(&ns, &pod)?;
        }
        let grace = eviction
            .pointer("/deleteOptions/gracePeriodSeconds")
            .and_then(Value::as_i64);
        let target = Target {
            rtype: t.rtype.clone(),
            namespace: t.namespace.clone(),
            name: Some(name.to_string()),
            subresource: None,
            dry_run: t.dry_run,
            user: t.user.clone(),
        };
        self.delete(&target, name, grace, None, gc::Propagation::Background)?;
        Ok(json_response(
            201,
            &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}),
        ))
    }

    fn check_disruption_budgets(&self, ns: &str, pod: &Value) -> ApiResult<()> {
        let st = self.state.lock().unwrap();
        let in_ns = |plural: &str| -> Vec<Value> {
            st.objects
                .iter()
                .filter(|(k, _)| k.ends_with(&format!("/{plural}")))
                .flat_map(|(_, m)| m.iter())
                .filter(|((n, _), _)| n == ns)
                .map(|(_, v)| v.clone())
                .collect()
        };
        let selects = |budget: &Value, obj: &Value| {
            let want = budget
                .pointer("/spec/selector/matchLabels")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default();
            !want.is_empty()
                && want.iter().all(|(k, v)| {
                    meta(obj)
                        .get("labels")
                        .and_then(|l| l.get(k))
                        .is_some_and(|x| x == v)
                })
        };
        let healthy = |p: &Value| {
            p.pointer("/status/phase").and_then(Value::as_str) == Some("Running")
                && meta(p).get("deletionTimestamp").is_none()
                && p.pointer("/status/conditions")
                    .and_then(Value::as_array)
                    .is_some_and(|c| {
                        c.iter()
                            .any(|c| c["type"] == "Ready" && c["status"] == "True")
                    })
        };
        let pods = in_ns("pods");
        for budget in in_ns("poddisruptionbudgets") {
            if !selects(&budget, pod) {
                continue;
            }
            let covered: Vec<&Value> = pods.iter().filter(|p| selects(&budget, p)).collect();
            let ready = covered.iter().filter(|p| healthy(p)).count() as i64;
            let spare = match (
                budget.pointer("/spec/minAvailable").and_then(Value::as_i64),
                budget
                    .pointer("/spec/maxUnavailable")
                    .and_then(Value::as_i64),
            ) {
                (Some(min), _) => ready - min,
                (None, Some(max)) => max - (covered.len() as i64 - ready),
                (None, None) => {
                    return Err(ApiError::new(
                        500,
                        "InternalError",
                        "this test server supports integer minAvailable/maxUnavailable only",
                    ))
                }
            };
            if spare < 1 {
                return Err(ApiError::new(
                    429,
                    "TooManyRequests",
                    format!(
                        "Cannot evict pod as it would violate the pod's disruption budget. (budget {}: {ready} healthy, {spare} disruptions allowed)",
                        meta_str(&budget, "name").unwrap_or_default()
                    ),
                ));
            }
        }
        Ok(())
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

    fn filter(&self, t: &Target, q: &BTreeMap<String, String>) -> ApiResult<Filter> {
        Ok(Filter {
            namespace: t.namespace.clone(),
            labels: q
                .get("labelSelector")
                .map(|s| parse_label_selector(s))
                .transpose()?
                .unwrap_or_default(),
            fields: self.field_selector(t, q)?,
        })
    }

    /// `fieldSelector`, on the fields the real server can select this kind on only.
    fn field_selector(
        &self,
        t: &Target,
        q: &BTreeMap<String, String>,
    ) -> ApiResult<Vec<(String, String, bool)>> {
        let Some(s) = q.get("fieldSelector") else {
            return Ok(vec![]);
        };
        let terms = parse_field_selector(s)?;
        if let Some((path, _, _)) = terms
            .iter()
            .find(|(p, _, _)| !selectable_field(t.rtype.kind, p))
        {
            return Err(ApiError::new(
                400,
                "BadRequest",
                format!("field label not supported: {path}"),
            ));
        }
        Ok(terms)
    }

    fn list(&self, t: &Target, q: &BTreeMap<String, String>) -> ApiResult<Value> {
        let filter = self.filter(t, q)?;
        let limit = q
            .get("limit")
            .and_then(|l| l.parse::<usize>().ok())
            .filter(|l| *l > 0);
        // continue token: "<list resourceVersion>/<namespace>/<name>" of the last item returned.
        let cont = q.get("continue").filter(|c| !c.is_empty());
        let st = self.state.lock().unwrap();
        let (list_rv, after) = match cont {
            Some(c) => {
                let mut parts = c.splitn(3, '/');
                let bad = || ApiError::new(400, "BadRequest", "invalid continue token");
                let rv = parts.next().ok_or_else(bad)?.to_string();
                let ns = parts.next().ok_or_else(bad)?.to_string();
                let name = parts.next().ok_or_else(bad)?.to_string();
                (rv, Some((ns, name)))
            }
            None => (st.rv.to_string(), None),
        };
        let empty = BTreeMap::new();
        let all = st.objects.get(&t.rtype.key()).unwrap_or(&empty);
        let mut items = vec![];
        let mut next = None;
        let range = match &after {
            Some(k) => all.range((
                std::ops::Bound::Excluded(k.clone()),
                std::ops::Bound::Unbounded,
            )),
            None => all.range::<Key, _>(..),
        };
        for (k, v) in range {
            if !filter.matches(v) {
                continue;
            }
            if limit.is_some_and(|l| items.len() >= l) {
                next = Some(format!(
                    "{list_rv}/{}/{}",
                    items_last_key(&items).0,
                    items_last_key(&items).1
                ));
                let _ = k;
                break;
            }
            items.push(v.clone());
        }
        // One store of Events behind both APIs, as the real server has: the events.k8s.io ones
        // (kube-rs's Recorder writes those) are listed as core v1 Events too (what `kubectl
        // describe` reads).
        if t.rtype.group.is_empty() && t.rtype.plural == "events" && cont.is_none() {
            let newer = st.objects.get("events.k8s.io/v1/events").unwrap_or(&empty);
            items.extend(newer.values().map(core_event).filter(|e| filter.matches(e)));
        }
        let mut metadata = json!({"resourceVersion": list_rv});
        if let Some(n) = next {
            metadata["continue"] = json!(n);
        }
        Ok(json!({
            "kind": format!("{}List", t.rtype.kind),
            "apiVersion": t.rtype.api_version(),
            "metadata": metadata,
            "items": items,
        }))
    }

    fn watch(
        self: Arc<Self>,
        t: &Target,
        q: &BTreeMap<String, String>,
    ) -> ApiResult<Response<Body>> {
        let filter = self.filter(t, q)?;
        let bookmarks = q.get("allowWatchBookmarks").is_some_and(|b| b == "true");
        let timeout = q
            .get("timeoutSeconds")
            .and_then(|s| s.parse::<u64>().ok())
            .map(Duration::from_secs)
            .unwrap_or(Duration::from_secs(1800));
        let from: Option<u64> = q
            .get("resourceVersion")
            .filter(|rv| !rv.is_empty() && *rv != "0")
            .map(|rv| {
                rv.parse().map_err(|_| {
                    ApiError::new(400, "BadRequest", format!("invalid resourceVersion {rv:?}"))
                })
            })
            .transpose()?;
        let rkey = t.rtype.key();
        let (replay, mut rx, start_rv) = {
            let st = self.state.lock().unwrap();
            let replay: Vec<Arc<WatchEvent>> = match from {
                Some(rv) if rv < st.compacted => {
                    let gone = ApiError::new(
                        410,
                        "Expired",
                        format!("too old resource version: {rv} ({})", st.compacted),
                    );
                    let line =
                        serde_json::to_vec(&json!({"type": "ERROR", "object": gone.status()}))
                            .unwrap();
                    return Ok(Response::builder()
                        .status(200)
                        .header("content-type", "application/json")
                        .body(Body::from([line, b"\n".to_vec()].concat()))
                        .unwrap());
                }
                Some(rv) => st
                    .history
                    .iter()
                    .filter(|e| e.rv > rv && e.rtype == rkey)
                    .cloned()
                    .map(Arc::new)
                    .collect(),
                None => st
                    .objects
                    .get(&rkey)
                    .into_iter()
                    .flat_map(|m| m.values())
                    .map(|o| {
                        Arc::new(WatchEvent {
                            rv: st.rv,
                            rtype: rkey.clone(),
                            kind: "ADDED",
                            old: None,
                            new: o.clone(),
                        })
                    })
                    .collect(),
            };
            (replay, self.events.subscribe(), from.unwrap_or(st.rv))
        };
        let mut epoch = self.watch_epoch.subscribe();
        let rtype = t.rtype.clone();
        let interval = self.bookmark_interval;
        let stream = async_stream::stream! {
            let line = |v: Value| -> Result<Bytes, std::io::Error> {
                let mut b = serde_json::to_vec(&v).unwrap();
                b.push(b'\n');
                Ok(Bytes::from(b))
            };
            let mut seen = start_rv;
            for ev in replay {
                seen = seen.max(ev.rv);
                if let Some(v) = render_event(&ev, &filter) { yield line(v); }
            }
            let deadline = tokio::time::Instant::now() + timeout;
            let mut tick = tokio::time::interval(interval);
            tick.tick().await;
            epoch.borrow_and_update();
            loop {
                tokio::select! {
                    _ = tokio::time::sleep_until(deadline) => break,
                    _ = epoch.changed() => break,
                    _ = tick.tick() => {
                        if bookmarks {
                            yield line(json!({"type": "BOOKMARK", "object": {
                                "kind": rtype.kind, "apiVersion": rtype.api_version(),
                                "metadata": {"resourceVersion": seen.to_string()}}}));
                        }
                    }
                    ev = rx.recv() => match ev {
                        Ok(ev) => {
                            seen = seen.max(ev.rv);
                            if ev.rtype == rkey {
                                if let Some(v) = render_event(&ev, &filter) { yield line(v); }
                            }
                        }
                        // A watcher this far behind is ended; the client resumes from `seen`.
                        Err(_) => break,
                    },
                }
            }
        };
        Ok(Response::builder()
            .status(200)
            .header("content-type", "application/json")
            .body(Body::from_stream(stream))
            .unwrap())
    }

    /// Records a change: bumps the resourceVersion, stores it in the object, queues the event.
    fn commit(
        &self,
        st: &mut State,
        rtype: &ResourceType,
        kind: &'static str,
        old: Option<Value>,
        mut new: Value,
    ) -> Value {
        st.rv += 1;
        let rv = st.rv;
        new["metadata"]["resourceVersion"] = json!(rv.to_string());
        let key = (
            meta_str(&new, "namespace").unwrap_or("").to_string(),
            meta_str(&new, "name").unwrap().to_string(),
        );
        let objs = st.objects.entry(rtype.key()).or_default();
        if kind == "DELETED" {
            objs.remove(&key);
        } else {
            objs.insert(key, new.clone());
        }
        let ev = WatchEvent {
            rv,
            rtype: rtype.key(),
            kind,
            old,
            new: new.clone(),
        };
        st.history.push_back(ev.clone());
        while st.history.len() > self.history_limit {
            let e = st.history.pop_front().unwrap();
            st.compacted = e.rv;
        }
        let _ = self.events.send(Arc::new(ev));
        new
    }

    fn create(&self, t: &Target, mut obj: Value) -> ApiResult<Value> {
        let rt = &t.rtype;
        if !obj.is_object() {
            return Err(ApiError::new(400, "BadRequest", "body must be an object"));
        }
        obj["kind"] = json!(rt.kind);
        obj["apiVersion"] = json!(rt.api_version());
        if !obj.get("metadata").is_some_and(Value::is_object) {
            obj["metadata"] = json!({});
        }
        let ns = self.ns_key(t);
        if rt.namespaced {
            if ns.is_empty() {
                return Err(ApiError::new(
                    400,
                    "BadRequest",
                    "a namespaced object needs a namespace in the path",
                ));
            }
            match meta_str(&obj, "namespace") {
                Some(n) if n != ns => {
                    return Err(ApiError::new(400, "BadRequest", format!("the namespace of the object ({n}) does not match the namespace on the request ({ns})")))
                }
                _ => obj["metadata"]["namespace"] = json!(ns),
            }
        }
        let mut st = self.state.lock().unwrap();
        if rt.namespaced {
            self.namespace_open(&st, &ns)?;
        }
        let name = match (meta_str(&obj, "name"), meta_str(&obj, "generateName")) {
            (Some(n), _) if !n.is_empty() => n.to_string(),
            (_, Some(g)) if !g.is_empty() => loop {
                let n = format!("{g}{}", random_suffix(5));
                if !st.objects.get(&rt.key()).is_some_and(|m| m.contains_key(&(ns.clone(), n.clone()))) {
                    break n;
                }
            },
            _ => {
                return Err(ApiError::new(422, "Invalid", format!("{} is invalid: metadata.name: Required value: name or generateName is required", rt.kind)))
            }
        };
        if st
            .objects
            .get(&rt.key())
            .is_some_and(|m| m.contains_key(&(ns.clone(), name.clone())))
        {
            return Err(ApiError::new(
                409,
                "AlreadyExists",
                format!("{}.{} \"{name}\" already exists", rt.plural, rt.group),
            ));
        }
        let m = &mut obj["metadata"];
        m["name"] = json!(name);
        m["uid"] = json!(uid());
        m["creationTimestamp"] = json!(now_rfc3339());
        m["generation"] = json!(1);
        if let Some(m) = m.as_object_mut() {
            m.remove("deletionTimestamp");
            m.remove("resourceVersion");
        }
        if rt.status_subresource {
            if rt.kind == "Pod" {
                obj["status"] = json!({"phase": "Pending"});
            } else if let Some(o) = obj.as_object_mut() {
                o.remove("status");
            }
        }
        conform(rt, &mut obj)?;
        if t.dry_run {
            return Ok(obj);
        }
        Ok(self.commit(&mut st, rt, "ADDED", None, obj))
    }

    fn update(
        &self,
        t: &Target,
        name: &str,
        sub: Option<&str>,
        update: Update,
    ) -> ApiResult<Value> {
        let rt = &t.rtype;
        let mut st = self.state.lock().unwrap();
        let old = self.stored(&st, t, name)?;
        if sub == Some("scale") {
            let (spec_path, _, _) = rt.scale.ok_or_else(|| not_found(rt, name))?;
            let mut scale = self.scale_of_locked(rt, &old)?;
            let stale = |obj: &Value| {
                meta_str(obj, "resourceVersion")
                    .is_some_and(|rv| Some(rv) != meta_str(&old, "resourceVersion"))
            };
            match update {
                Update::Replace(s) => {
                    if stale(&s) {
                        return Err(conflict(rt, name));
                    }
                    scale = s;
                }
                Update::Merge(p) => merge_patch(&mut scale, &p),
                Update::Json(p) => apply_json_patch(&mut scale, p)?,
            }
            let replicas = scale.pointer("/spec/replicas").cloned().unwrap_or(json!(0));
            let mut new = old.clone();
            set_path(&mut new, spec_path, replicas);
            let new = self.write(&mut st, rt, old, new, t.dry_run)?;
            return self.scale_of_locked(rt, &new);
        }
        if sub.is_some_and(|s| s != "status") {
            return Err(not_found(rt, name));
        }
        let mut body = match update {
            Update::Replace(obj) => {
                match meta_str(&obj, "resourceVersion") {
                    None | Some("") => {
                        return Err(ApiError::new(422, "Invalid", format!("{} \"{name}\" is invalid: metadata.resourceVersion: Invalid value: 0x0: must be specified for an update", rt.kind)))
                    }
                    Some(rv) if Some(rv) != meta_str(&old, "resourceVersion") => return Err(conflict(rt, name)),
                    _ => {}
                }
                obj
            }
            Update::Merge(p) => {
                if meta_str(&p, "resourceVersion")
                    .is_some_and(|rv| Some(rv) != meta_str(&old, "resourceVersion"))
                {
                    return Err(conflict(rt, name));
                }
                let mut o = old.clone();
                merge_patch(&mut o, &p);
                o
            }
            Update::Json(p) => {
                let mut o = old.clone();
                apply_json_patch(&mut o, p)?;
                o
            }
        };
        // What each endpoint may change.
        let mut new = old.clone();
        if sub == Some("status") {
            new["status"] = body.get("status").cloned().unwrap_or(Value::Null);
        } else {
            let status = old.get("status").cloned();
            if let Some(o) = body.as_object_mut() {
                o.remove("status");
            }
            new = body;
            if rt.status_subresource {
                if let Some(s) = status {
                    new["status"] = s;
                }
            } else if let Some(s) = old
                .get("status")
                .cloned()
                .filter(|_| new.get("status").is_none())
            {
                new["status"] = s;
            }
            // Immutable metadata.
            for f in [
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "namespace",
                "name",
                "generation",
            ] {
                match old["metadata"].get(f) {
                    Some(v) => new["metadata"][f] = v.clone(),
                    None => {
                        if let Some(m) = new["metadata"].as_object_mut() {
                            m.remove(f);
                        }
                    }
                }
            }
            new["kind"] = json!(rt.kind);
            new["apiVersion"] = json!(rt.api_version());
            if old.get("spec") != new.get("spec") {
                let g = old["metadata"]["generation"].as_i64().unwrap_or(1);
                new["metadata"]["generation"] = json!(g + 1);
            }
        }
        self.write(&mut st, rt, old, new, t.dry_run)
    }

    /// Stores an updated object, deleting it when it was being deleted and its last finalizer
    /// went. No-op writes change nothing (no new resourceVersion, no event).
    fn write(
        &self,
        st: &mut State,
        rt: &ResourceType,
        old: Value,
        mut new: Value,
        dry_run: bool,
    ) -> ApiResult<Value> {
        conform(rt, &mut new)?;
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"].clone();
        if new == old || dry_run {
            return Ok(new);
        }
        if meta(&new).get("deletionTimestamp").is_some()
            && !has_finalizers(&new)
            && !self.graceful_pending(rt, &new)
        {
            return Ok(self.commit(st, rt, "DELETED", Some(old), new));
        }
        Ok(self.commit(st, rt, "MODIFIED", Some(old), new))
    }

    /// A Pod bound to a node stays until its kubelet confirms deletion (gracePeriodSeconds=0);
    /// as in the real API server, unbound Pods and Pods that already ended go at once.
    fn graceful_pending(&self, rt: &ResourceType, obj: &Value) -> bool {
        let phase = get_path(obj, "status.phase").and_then(Value::as_str);
        rt.kind == "Pod"
            && !matches!(phase, Some("Succeeded" | "Failed"))
            && get_path(obj, "spec.nodeName")
                .and_then(Value::as_str)
                .is_some_and(|n| !n.is_empty())
            && meta(obj)
                .get("deletionGracePeriodSeconds")
                .and_then(Value::as_i64)
                .unwrap_or(0)
                > 0
    }

    fn delete(
        &self,
        t: &Target,
        name: &str,
        grace: Option<i64>,
        precondition_rv: Option<String>,
        propagation: gc::Propagation,
    ) -> ApiResult<Value> {
        let rt = &t.rtype;
        let mut st = self.state.lock().unwrap();
        let old = self.stored(&st, t, name)?;
        if precondition_rv.is_some_and(|rv| Some(rv.as_str()) != meta_str(&old, "resourceVersion"))
        {
            return Err(conflict(rt, name));
        }
        if t.dry_run {
            return Ok(old);
        }
        Ok(self.delete_locked(&mut st, rt, old, grace, propagation))
    }

    fn delete_locked(
        &self,
        st: &mut State,
        rt: &ResourceType,
        old: Value,
        grace: Option<i64>,
        propagation: gc::Propagation,
    ) -> Value {
        let mut new = old.clone();
        if let Some(f) = propagation.finalizer() {
            // The collector holds the owner while it deals with the dependents.
            let fs = new["metadata"]["finalizers"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            if !fs.iter().any(|x| x == f) && meta(&new).get("deletionTimestamp").is_none() {
                let mut fs = fs;
                fs.push(json!(f));
                new["metadata"]["finalizers"] = json!(fs);
            }
        }
        let pod_grace = if rt.kind == "Pod" {
            grace
                .or_else(|| {
                    get_path(&old, "spec.terminationGracePeriodSeconds").and_then(Value::as_i64)
                })
                .unwrap_or(30)
        } else {
            0
        };
        if meta(&new).get("deletionTimestamp").is_none() {
            // As the real server: the time the object is due to be gone, now + its grace.
            new["metadata"]["deletionTimestamp"] = json!(rfc3339_in(pod_grace));
        }
        // A shorter grace period may replace a longer one, never the other way round.
        let current = meta(&old)
            .get("deletionGracePeriodSeconds")
            .and_then(Value::as_i64);
        let g = current.map_or(pod_grace, |c| c.min(pod_grace));
        new["metadata"]["deletionGracePeriodSeconds"] = json!(g);
        if has_finalizers(&new) || self.graceful_pending(rt, &new) {
            if new == old {
                return old;
            }
            return self.commit(st, rt, "MODIFIED", Some(old), new);
        }
        self.commit(st, rt, "DELETED", Some(old), new)
    }

    /// A namespaced object may be created only in a namespace that exists and is not being
    /// deleted, as the real server's NamespaceLifecycle admission has it.
    fn namespace_open(&self, st: &State, ns: &str) -> ApiResult<()> {
        let namespace = st
            .objects
            .get("/v1/namespaces")
            .and_then(|m| m.get(&(String::new(), ns.to_string())));
        match namespace {
            None => Err(ApiError::new(
                404,
                "NotFound",
                format!("namespaces \"{ns}\" not found"),
            )),
            Some(n) if meta(n).get("deletionTimestamp").is_some() => Err(ApiError::new(
                403,
                "Forbidden",
                format!(
                    "unable to create new content in namespace {ns} because it is being terminated"
                ),
            )),
            Some(_) => Ok(()),
        }
    }

    fn uid_exists(&self, st: &State, uid: &str) -> bool {
        st.objects
            .values()
            .flat_map(|m| m.values())
            .any(|o| meta_str(o, "uid") == Some(uid))
    }

    fn scale_of(&self, t: &Target, obj: &Value) -> ApiResult<Value> {
        self.scale_of_locked(&t.rtype, obj)
    }

    fn scale_of_locked(&self, rt: &ResourceType, obj: &Value) -> ApiResult<Value> {
        let (spec, status, selector) = rt.scale.ok_or_else(|| {
            ApiError::new(
                404,
                "NotFound",
                format!("{} has no scale subresource", rt.plural),
            )
        })?;
        let m = meta(obj);
        Ok(json!({
            "kind": "Scale", "apiVersion": "autoscaling/v1",
            "metadata": {"name": m["name"], "namespace": m["namespace"], "uid": m["uid"],
                         "resourceVersion": m["resourceVersion"], "creationTimestamp": m["creationTimestamp"]},
            "spec": {"replicas": get_path(obj, spec).cloned().unwrap_or(json!(0))},
            "status": {"replicas": get_path(obj, status).cloned().unwrap_or(json!(0)),
                       "selector": get_path(obj, selector).cloned().unwrap_or(json!(""))},
        }))
    }
}

fn items_last_key(items: &[Value]) -> (String, String) {
    let last = items.last().unwrap();
    (
        meta_str(last, "namespace").unwrap_or("").to_string(),
        meta_str(last, "name").unwrap_or("").to_string(),
    )
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

/// The event a watcher with this filter sees, if any: objects entering the selection are
/// ADDED, leaving it DELETED.
fn render_event(ev: &WatchEvent, filter: &Filter) -> Option<Value> {
    let new_in = filter.matches(&ev.new);
    let old_in = ev.old.as_ref().is_some_and(|o| filter.matches(o));
    let kind = match (ev.kind, old_in, new_in) {
        ("DELETED", true, _) => "DELETED",
        ("DELETED", false, _) => return None,
        (_, true, true) => "MODIFIED",
        (_, false, true) => "ADDED",
        (_, true, false) => "DELETED",
        (_, false, false) => return None,
    };
    Some(json!({"type": kind, "object": ev.new}))
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
