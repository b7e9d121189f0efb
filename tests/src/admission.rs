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

impl Webhook {
    /// Registers this webhook with `api` as a cluster has it: the configurations of
    /// `deploy/webhook.yaml` created with this webhook's CA as their `caBundle` (as
    /// virt-controller publishes it), and the Service they name pointed at this server. The
    /// API server then calls it as kube-apiserver would, for what the file registers.
    pub async fn register(&self, api: &crate::apiserver::ApiServer) {
        use k8s_openapi::api::admissionregistration::v1::{
            MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
        };
        use kube::api::PostParams;
        let text = std::fs::read_to_string(crate::repo_root().join("deploy/webhook.yaml"))
            .expect("deploy/webhook.yaml");
        let bundle = {
            use base64::Engine;
            base64::engine::general_purpose::STANDARD.encode(&self.ca)
        };
        let client = api.client();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let mut doc =
                <Value as serde::Deserialize>::deserialize(doc).expect("webhook.yaml parses");
            for w in doc["webhooks"].as_array_mut().into_iter().flatten() {
                w["clientConfig"]["caBundle"] = json!(bundle);
                let svc = &w["clientConfig"]["service"];
                api.set_service_endpoint(
                    svc["namespace"].as_str().unwrap(),
                    svc["name"].as_str().unwrap(),
                    self.addr,
                );
            }
            let pp = PostParams::default();
            match doc["kind"].as_str() {
                Some("ValidatingWebhookConfiguration") => {
                    let obj: ValidatingWebhookConfiguration = serde_json::from_value(doc).unwrap();
                    kube::Api::all(client.clone())
                        .create(&pp, &obj)
                        .await
                        .unwrap();
                }
                Some("MutatingWebhookConfiguration") => {
                    let obj: MutatingWebhookConfiguration = serde_json::from_value(doc).unwrap();
                    kube::Api::all(client.clone())
                        .create(&pp, &obj)
                        .await
                        .unwrap();
                }
                other => panic!("deploy/webhook.yaml holds a {other:?}"),
            }
        }
    }
}
