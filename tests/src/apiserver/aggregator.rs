//! The aggregation layer, as kube-apiserver has it: a request under `/apis/<group>/<version>`
//! that an `APIService` claims is authenticated and authorized here, then forwarded over TLS
//! to the Service the APIService names — verified against its `caBundle`, presenting the
//! front proxy's client certificate, the user in `X-Remote-User` / `X-Remote-Group` /
//! `X-Remote-Extra-*` and the caller's own credentials removed. The front-proxy CA and the
//! header names are published in `kube-system/extension-apiserver-authentication`, where
//! aggregated servers read them.
//!
//! Services have no cluster network here: a test says where a Service's endpoints listen
//! (`ApiServer::set_service_endpoint`), as the endpoints controller would.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, Method, Response, Uri};
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use super::errors::{ApiError, ApiResult};
use super::Inner;

/// The common name of the front proxy's client certificate (kube-apiserver's
/// `--requestheader-allowed-names` default in kubeadm clusters).
pub const FRONT_PROXY_CLIENT: &str = "front-proxy-client";

/// The front proxy's CA and the client certificate it signed.
pub struct FrontProxy {
    pub ca_pem: String,
    chain: Vec<CertificateDer<'static>>,
    key_der: Vec<u8>,
}

impl FrontProxy {
    pub fn generate() -> FrontProxy {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "front-proxy-ca");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, FRONT_PROXY_CLIENT);
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let issuer = rcgen::Issuer::from_params(&ca_params, &ca_key);
        let cert = params.signed_by(&key, &issuer).unwrap();
        FrontProxy {
            ca_pem: ca.pem(),
            chain: vec![cert.der().clone()],
            key_der: key.serialize_der(),
        }
    }

    /// `kube-system/extension-apiserver-authentication`, as kube-apiserver publishes it.
    pub fn config_map(&self) -> Value {
        json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "extension-apiserver-authentication", "namespace": "kube-system"},
            "data": {
                "requestheader-client-ca-file": self.ca_pem,
                "requestheader-allowed-names": format!("[\"{FRONT_PROXY_CLIENT}\"]"),
                "requestheader-username-headers": "[\"X-Remote-User\"]",
                "requestheader-group-headers": "[\"X-Remote-Group\"]",
                "requestheader-extra-headers-prefix": "[\"X-Remote-Extra-\"]",
            }
        })
    }

    fn client_config(&self, roots: rustls::RootCertStore) -> ApiResult<rustls::ClientConfig> {
        rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("default protocol versions")
        .with_root_certificates(roots)
        .with_client_auth_cert(
            self.chain.clone(),
            PrivateKeyDer::Pkcs8(self.key_der.clone().into()),
        )
        .map_err(|e| ApiError::new(500, "InternalError", format!("front-proxy client: {e}")))
    }
}

/// Who made a request, as the authenticator says.
#[derive(Clone, Debug, Default)]
pub struct Caller {
    pub user: String,
    pub groups: Vec<String>,
    /// What the token says beyond the user (a node-bound token's node).
    pub extra: std::collections::BTreeMap<String, Vec<String>>,
}

/// Where an APIService sends its group/version.
struct Route {
    name: String,
    service_namespace: String,
    service_name: String,
    ca_bundle: Option<String>,
}

/// The groups kube-apiserver gives every authenticated user, service accounts theirs too.
pub fn groups_of(user: &str) -> Vec<String> {
    let mut groups = Vec::new();
    if let Some(rest) = user.strip_prefix("system:serviceaccount:") {
        groups.push("system:serviceaccounts".to_string());
        if let Some((ns, _)) = rest.split_once(':') {
            groups.push(format!("system:serviceaccounts:{ns}"));
        }
    }
    groups.push("system:authenticated".into());
    groups
}

fn unavailable(message: String) -> ApiError {
    ApiError::new(503, "ServiceUnavailable", message)
}

impl Inner {
    /// The APIService that claims `path`'s group and version, if one does.
    fn aggregated_route(&self, path: &str) -> Option<Route> {
        let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
        let ["apis", group, version, ..] = segs.as_slice() else {
            return None;
        };
        let name = format!("{version}.{group}");
        let st = self.state.lock().unwrap();
        let svc = st
            .objects
            .get("apiregistration.k8s.io/v1/apiservices")?
            .get(&(String::new(), name.clone()))?;
        let service = svc.pointer("/spec/service")?;
        let ca_bundle = svc
            .pointer("/spec/caBundle")
            .and_then(Value::as_str)
            .and_then(|b| {
                use base64::Engine;
                base64::engine::general_purpose::STANDARD.decode(b).ok()
            })
            .and_then(|b| String::from_utf8(b).ok());
        Some(Route {
            name,
            service_namespace: service["namespace"].as_str()?.to_string(),
            service_name: service["name"].as_str()?.to_string(),
            ca_bundle,
        })
    }

    /// Answers `path` by proxy when an APIService claims it: authentication and RBAC as for
    /// any request, then the call forwarded to the Service.
    pub(super) async fn aggregate(
        &self,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        body: &Bytes,
    ) -> Option<ApiResult<Response<Body>>> {
        let route = self.aggregated_route(uri.path())?;
        Some(self.forward(route, method, uri, headers, body).await)
    }

    /// A websocket (or other upgrade) request on an aggregated path: forwarded like any other,
    /// and once the backend switches protocols, the bytes of both connections spliced.
    pub(super) async fn aggregate_upgrade(
        &self,
        mut req: axum::extract::Request,
    ) -> Option<ApiResult<Response<Body>>> {
        let route = self.aggregated_route(req.uri().path())?;
        let on_client_upgrade = hyper::upgrade::on(&mut req);
        Some(self.forward_upgrade(route, req, on_client_upgrade).await)
    }

    async fn forward_upgrade(
        &self,
        route: Route,
        req: axum::extract::Request,
        on_client_upgrade: hyper::upgrade::OnUpgrade,
    ) -> ApiResult<Response<Body>> {
        let (method, uri, headers) = (
            req.method().clone(),
            req.uri().clone(),
            req.headers().clone(),
        );
        let caller = self.authenticate(&headers)?;
        self.authorize_aggregated(&caller, &method, uri.path())?;
        let (endpoint, cfg, server_name) = self.backend(&route)?;
        let backend = connect(endpoint, cfg, &server_name)
            .await
            .map_err(|e| unavailable(format!("error trying to reach service: {e}")))?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(backend))
                .await
                .map_err(|e| unavailable(e.to_string()))?;
        tokio::spawn(conn.with_upgrades());
        let forwarded = request(&server_name, &method, &uri, &headers, Bytes::new(), &caller)
            .map_err(unavailable)?;
        let mut resp = sender
            .send_request(forwarded)
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        if resp.status() != hyper::StatusCode::SWITCHING_PROTOCOLS {
            let (parts, body) = resp.into_parts();
            let bytes = body
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            return Ok(Response::from_parts(parts, Body::from(bytes)));
        }
        let on_backend_upgrade = hyper::upgrade::on(&mut resp);
        tokio::spawn(async move {
            let (Ok(client), Ok(backend)) = (on_client_upgrade.await, on_backend_upgrade.await)
            else {
                return;
            };
            let mut client = hyper_util::rt::TokioIo::new(client);
            let mut backend = hyper_util::rt::TokioIo::new(backend);
            let _ = tokio::io::copy_bidirectional(&mut client, &mut backend).await;
        });
        let mut answer = Response::builder().status(hyper::StatusCode::SWITCHING_PROTOCOLS);
        for (k, v) in resp.headers() {
            answer = answer.header(k, v);
        }
        Ok(answer.body(Body::empty()).expect("a 101 answer"))
    }

    /// Where `route`'s Service listens, and the TLS to reach it with.
    fn backend(&self, route: &Route) -> ApiResult<(SocketAddr, rustls::ClientConfig, String)> {
        let endpoint = self
            .endpoints
            .lock()
            .unwrap()
            .get(&(route.service_namespace.clone(), route.service_name.clone()))
            .copied()
            .ok_or_else(|| {
                unavailable(format!(
                    "no endpoints available for service \"{}/{}\" (APIService {})",
                    route.service_namespace, route.service_name, route.name
                ))
            })?;
        let mut roots = rustls::RootCertStore::empty();
        for c in rustls_pemfile::certs(&mut route.ca_bundle.as_deref().unwrap_or("").as_bytes())
            .flatten()
        {
            let _ = roots.add(c);
        }
        if roots.is_empty() {
            return Err(unavailable(format!(
                "APIService {} has no caBundle: the server's certificate cannot be verified",
                route.name
            )));
        }
        let server_name = format!("{}.{}.svc", route.service_name, route.service_namespace);
        Ok((
            endpoint,
            self.front_proxy.client_config(roots)?,
            server_name,
        ))
    }

    async fn forward(
        &self,
        route: Route,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        body: &Bytes,
    ) -> ApiResult<Response<Body>> {
        let caller = self.authenticate(headers)?;
        self.authorize_aggregated(&caller, method, uri.path())?;
        let (endpoint, cfg, server_name) = self.backend(&route)?;
        let resp = send(
            endpoint,
            cfg,
            &server_name,
            method,
            uri,
            headers,
            body,
            &caller,
        )
        .await
        .map_err(|e| unavailable(format!("error trying to reach service: {e}")))?;
        Ok(resp)
    }

    /// RBAC on an aggregated path, from its request info (resource, name, subresource) as
    /// kube-apiserver parses any path.
    fn authorize_aggregated(&self, caller: &Caller, method: &Method, path: &str) -> ApiResult<()> {
        let Some(authorizer) = self.auth.lock().unwrap().rbac.clone() else {
            return Ok(());
        };
        if caller.groups.iter().any(|g| g == "system:masters") {
            return Ok(());
        }
        let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
        let ["apis", group, _version, rest @ ..] = segs.as_slice() else {
            return Ok(());
        };
        let (namespace, rest) = match rest {
            ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some(ns.to_string()), rest),
            r => (None, r),
        };
        let (resource, name) = match rest {
            [] => return Ok(()), // discovery of the group version: readable by all
            [r] => (r.to_string(), None),
            [r, n] => (r.to_string(), Some(n.to_string())),
            [r, n, sub, ..] => (format!("{r}/{sub}"), Some(n.to_string())),
        };
        let verb = match *method {
            Method::GET | Method::HEAD if name.is_some() => "get",
            Method::GET | Method::HEAD => "list",
            Method::POST => "create",
            Method::PUT => "update",
            Method::PATCH => "patch",
            Method::DELETE => "delete",
            _ => "unknown",
        };
        let attrs = crate::rbac::RequestAttributes {
            verb: verb.into(),
            api_group: group.to_string(),
            resource,
            namespace,
            name,
        };
        if authorizer.allows_as(&caller.user, &caller.groups, &attrs) {
            Ok(())
        } else {
            let message = crate::rbac::Authorizer::forbidden_message(&caller.user, &attrs);
            eprintln!("test API server: 403 {message}");
            Err(ApiError::new(403, "Forbidden", message))
        }
    }
}

/// A TLS connection to the Service's endpoint, verified as `server_name`.
async fn connect(
    endpoint: SocketAddr,
    cfg: rustls::ClientConfig,
    server_name: &str,
) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, String> {
    let tcp = tokio::net::TcpStream::connect(endpoint)
        .await
        .map_err(|e| format!("dial tcp {endpoint}: {e}"))?;
    let name = ServerName::try_from(server_name.to_string()).map_err(|e| e.to_string())?;
    tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(name, tcp)
        .await
        .map_err(|e| format!("TLS with {server_name}: {e}"))
}

/// The request as the aggregator forwards it: the caller's own credentials stay here, the
/// user goes in the front proxy's headers.
fn request(
    server_name: &str,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: Bytes,
    caller: &Caller,
) -> Result<hyper::Request<Full<Bytes>>, String> {
    let path = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let mut req = hyper::Request::builder()
        .method(method.clone())
        .uri(path)
        .header("host", server_name);
    for (k, v) in headers {
        let k = k.as_str();
        if k == "authorization" || k == "host" || k.starts_with("x-remote-") {
            continue;
        }
        req = req.header(k, v);
    }
    req = req.header(
        "X-Remote-User",
        HeaderValue::from_str(&caller.user).map_err(|e| e.to_string())?,
    );
    for g in &caller.groups {
        req = req.header(
            "X-Remote-Group",
            HeaderValue::from_str(g).map_err(|e| e.to_string())?,
        );
    }
    req.body(Full::new(body)).map_err(|e| e.to_string())
}

#[allow(clippy::too_many_arguments)]
async fn send(
    endpoint: SocketAddr,
    cfg: rustls::ClientConfig,
    server_name: &str,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &Bytes,
    caller: &Caller,
) -> Result<Response<Body>, String> {
    let tls = connect(endpoint, cfg, server_name).await?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = request(server_name, method, uri, headers, body.clone(), caller)?;
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok(Response::from_parts(parts, Body::from(bytes)))
}
