//! A client for virt-controller's admission webhook as the API server uses it: HTTPS verified
//! against the webhook's CA bundle, AdmissionReview requests in and out.

use std::net::SocketAddr;
use std::sync::Arc;

use api::migratability::EvictionStrategy;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use serde_json::{json, Value};
use tokio_rustls::rustls;

pub struct Webhook {
    pub addr: SocketAddr,
    pub ca: String,
}

/// Serves the webhook on a loopback port with a fresh self-signed certificate (HostDisk off,
/// as a cluster has it by default).
pub async fn start_webhook(
    client: Option<kube::Client>,
    default_eviction_strategy: EvictionStrategy,
) -> Webhook {
    let settings = api::kubevirt::ClusterSettings {
        eviction_strategy: default_eviction_strategy,
        ..Default::default()
    };
    serve_webhook(controller::webhook::WebhookState {
        client,
        settings: controller_runtime::LiveSettings::fixed(settings),
        host_disk_prefixes: vec![],
    })
    .await
}

/// Serves the webhook with `state` on a loopback port with a fresh self-signed certificate.
pub async fn serve_webhook(state: controller::webhook::WebhookState) -> Webhook {
    let (cert, ca) = controller_runtime::tls::ServingCert::self_signed(vec![
        "virt-controller-webhook.microvirt.svc".into(),
    ])
    .unwrap();
    let tls = cert.server_config(None).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = controller::webhook::router(state);
    tokio::spawn(controller_runtime::tls::serve_tls(listener, tls, app));
    Webhook { addr, ca }
}

impl Webhook {
    /// POSTs `body` to `path` and returns the JSON answer (which must be a 200).
    pub async fn post(&self, path: &str, body: &Value) -> Value {
        let mut roots = rustls::RootCertStore::empty();
        for c in rustls_pemfile::certs(&mut self.ca.as_bytes()) {
            roots.add(c.unwrap()).unwrap();
        }
        let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect(self.addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("virt-controller-webhook.microvirt.svc")
            .unwrap();
        let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
            .connect(name, tcp)
            .await
            .expect("TLS handshake with the CA bundle");
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
                .await
                .unwrap();
        tokio::spawn(conn);
        let req = hyper::Request::post(path)
            .header("host", "virt-controller-webhook.microvirt.svc")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(serde_json::to_vec(body).unwrap())))
            .unwrap();
        let resp = sender.send_request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap()
    }
}

/// An AdmissionReview request for `object` in namespace `default`.
pub fn review(kind: &str, resource: &str, operation: &str, object: Value) -> Value {
    admission_review(
        "705ab4f5-6393-11e8-b7cc-42010a800002",
        kind,
        resource,
        operation,
        Some("default"),
        object,
        None,
    )
}

/// An AdmissionReview request as the API server sends it: group and version from the object's
/// apiVersion, the name "" for a create with generateName.
fn admission_review(
    uid: &str,
    kind: &str,
    resource: &str,
    operation: &str,
    namespace: Option<&str>,
    object: Value,
    old_object: Option<Value>,
) -> Value {
    let (group, version) = match object["apiVersion"]
        .as_str()
        .unwrap_or("v1")
        .split_once('/')
    {
        Some((g, v)) => (g.to_string(), v.to_string()),
        None => (String::new(), "v1".to_string()),
    };
    json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": group, "version": version, "kind": kind},
            "resource": {"group": group, "version": version, "resource": resource},
            "name": object["metadata"]["name"].as_str().unwrap_or(""),
            "namespace": namespace,
            "operation": operation,
            "userInfo": {"username": "admin"},
            "object": object, "oldObject": old_object, "dryRun": false,
        }
    })
}

/// The AdmissionReview the API server sends for `kubectl drain`'s eviction of `pod`.
pub fn eviction(pod: &str) -> Value {
    review(
        "Eviction",
        "pods",
        "CREATE",
        json!({"apiVersion": "policy/v1", "kind": "Eviction",
               "metadata": {"name": pod, "namespace": "default"}}),
    )
}

/// One webhook of `deploy/webhook.yaml` that admits objects: its name, its path, and the
/// rules (API groups, operations, resources) it is called for.
struct Registration {
    name: String,
    path: String,
    rules: Vec<Rule>,
}

struct Rule {
    groups: Vec<String>,
    operations: Vec<String>,
    resources: Vec<String>,
}

impl Registration {
    fn applies(&self, group: &str, operation: &str, resource: &str) -> bool {
        let has = |list: &[String], v: &str| list.iter().any(|x| x == v || x == "*");
        self.rules.iter().any(|r| {
            has(&r.groups, group) && has(&r.operations, operation) && has(&r.resources, resource)
        })
    }
}

/// The object webhooks `deploy/webhook.yaml` registers, read from the file the cluster gets,
/// mutating before validating as the API server calls them (a subresource's webhook, such as
/// `pods/eviction`, is the eviction admission's).
fn registrations() -> Vec<Registration> {
    let path = crate::repo_root().join("deploy/webhook.yaml");
    let text = std::fs::read_to_string(&path).expect("deploy/webhook.yaml");
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|x| x.as_str().map(str::to_string))
            .collect()
    };
    let mut out = vec![];
    for order in [
        "MutatingWebhookConfiguration",
        "ValidatingWebhookConfiguration",
    ] {
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let doc = <Value as serde::Deserialize>::deserialize(doc).expect("webhook.yaml parses");
            if doc["kind"] != order {
                continue;
            }
            for w in doc["webhooks"].as_array().into_iter().flatten() {
                let rules: Vec<Rule> = w["rules"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|r| Rule {
                        groups: strings(&r["apiGroups"]),
                        operations: strings(&r["operations"]),
                        resources: strings(&r["resources"])
                            .into_iter()
                            .filter(|r| !r.contains('/'))
                            .collect(),
                    })
                    .filter(|r| !r.resources.is_empty())
                    .collect();
                if rules.is_empty() {
                    continue;
                }
                out.push(Registration {
                    name: w["name"].as_str().unwrap_or_default().to_string(),
                    path: w["clientConfig"]["service"]["path"]
                        .as_str()
                        .unwrap_or("/")
                        .to_string(),
                    rules,
                });
            }
        }
    }
    out
}

impl Webhook {
    /// This webhook as the test API server's object admission, called as the API server calls
    /// the webhooks `deploy/webhook.yaml` registers: the mutating one's JSON patch applied, then
    /// the validating one's decision; warnings of both returned to the client.
    pub fn object_admission(self: Arc<Self>) -> crate::apiserver::ObjectAdmission {
        Arc::new(move |attrs: crate::apiserver::AdmissionAttributes| {
            let webhook = self.clone();
            Box::pin(async move { webhook.admit(attrs).await })
        })
    }

    async fn admit(
        &self,
        attrs: crate::apiserver::AdmissionAttributes,
    ) -> Result<(Value, Vec<String>), (u16, String)> {
        let mut object = attrs.object;
        let mut warnings = vec![];
        let called = registrations()
            .into_iter()
            .filter(|r| r.applies(attrs.group, attrs.operation, attrs.resource));
        for Registration { name, path, .. } in called {
            let review = admission_review(
                &crate::apiserver::new_uid(),
                attrs.kind,
                attrs.resource,
                attrs.operation,
                attrs.namespace.as_deref(),
                object.clone(),
                attrs.old_object.clone(),
            );
            let answer = self.post(&path, &review).await;
            let response = &answer["response"];
            for w in response["warnings"].as_array().into_iter().flatten() {
                if let Some(w) = w.as_str() {
                    warnings.push(w.to_string());
                }
            }
            if response["allowed"] != json!(true) {
                let code = response["status"]["code"].as_u64().unwrap_or(400) as u16;
                let message = response["status"]["message"].as_str().unwrap_or("");
                return Err((
                    code,
                    format!("admission webhook \"{name}\" denied the request: {message}"),
                ));
            }
            if let Some(patch) = response["patch"].as_str() {
                use base64::Engine;
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(patch)
                    .map_err(|e| (500, format!("webhook {name} sent a bad patch: {e}")))?;
                let patch: json_patch::Patch = serde_json::from_slice(&bytes)
                    .map_err(|e| (500, format!("webhook {name} sent a bad patch: {e}")))?;
                json_patch::patch(&mut object, &patch)
                    .map_err(|e| (500, format!("webhook {name}'s patch does not apply: {e}")))?;
            }
        }
        Ok((object, warnings))
    }
}
