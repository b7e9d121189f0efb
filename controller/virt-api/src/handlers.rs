//! virt-api's way to a VMI's node: the virt-handler Pod on that node (its Pod IP and the port
//! named `console`), over mutual TLS — virt-api presents its client certificate, and checks
//! that the server's certificate is the node's own (signed by the cluster's node CA, naming the
//! node), so a Pod that takes over the address cannot pose as the handler.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::ServerName;

use crate::status::SubresourceError;

/// The label virt-handler's Pods carry (deploy/handler.yaml).
const HANDLER_LABEL: &str = "app.kubernetes.io/name=virt-handler";
/// KubeVirt's console server port, when the Pod does not name one.
const DEFAULT_PORT: u16 = 8186;

pub struct HandlerDialer {
    tls: Arc<rustls::ClientConfig>,
    /// Where virt-handler runs.
    namespace: String,
}

fn unavailable(message: String) -> SubresourceError {
    SubresourceError::new(503, "ServiceUnavailable", message)
}

impl HandlerDialer {
    /// `node_ca`: the CA of the nodes' certificates; `cert`, `key`: virt-api's client
    /// certificate (PEM files).
    pub fn from_files(
        node_ca: &Path,
        cert: &Path,
        key: &Path,
        namespace: &str,
    ) -> Result<HandlerDialer, String> {
        let read = |p: &Path| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
        let mut roots = rustls::RootCertStore::empty();
        for c in rustls_pemfile::certs(&mut read(node_ca)?.as_slice()) {
            let c = c.map_err(|e| format!("{}: {e}", node_ca.display()))?;
            roots
                .add(c)
                .map_err(|e| format!("{}: {e}", node_ca.display()))?;
        }
        let chain = rustls_pemfile::certs(&mut read(cert)?.as_slice())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("{}: {e}", cert.display()))?;
        let key_der = rustls_pemfile::private_key(&mut read(key)?.as_slice())
            .map_err(|e| format!("{}: {e}", key.display()))?
            .ok_or_else(|| format!("{}: no private key", key.display()))?;
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key_der)
        .map_err(|e| format!("virt-api's client certificate: {e}"))?;
        Ok(HandlerDialer {
            tls: Arc::new(tls),
            namespace: namespace.to_string(),
        })
    }

    /// The address of the virt-handler serving `node`.
    async fn locate(
        &self,
        client: &kube::Client,
        node: &str,
    ) -> Result<SocketAddr, SubresourceError> {
        let pods: Api<Pod> = Api::namespaced(client.clone(), &self.namespace);
        let lp = ListParams::default()
            .labels(HANDLER_LABEL)
            .fields(&format!("spec.nodeName={node}"));
        let list = pods.list(&lp).await.map_err(SubresourceError::from_kube)?;
        let pod = list
            .items
            .iter()
            .find(|p| p.status.as_ref().and_then(|s| s.pod_ip.as_ref()).is_some())
            .ok_or_else(|| {
                unavailable(format!(
                    "no virt-handler is running on node {node}: the VMI's node cannot be reached"
                ))
            })?;
        let ip = pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.as_deref())
            .unwrap_or_default();
        let port = pod
            .spec
            .iter()
            .flat_map(|s| &s.containers)
            .flat_map(|c| c.ports.iter().flatten())
            .find(|p| p.name.as_deref() == Some("console"))
            .map(|p| p.container_port as u16)
            .unwrap_or(DEFAULT_PORT);
        let ip: std::net::IpAddr = ip.parse().map_err(|_| {
            unavailable(format!(
                "virt-handler on node {node} has no usable Pod IP ({ip:?})"
            ))
        })?;
        Ok(SocketAddr::new(ip, port))
    }

    /// A TLS connection to `node`'s virt-handler, whose certificate must name `node`.
    async fn connect(
        &self,
        client: &kube::Client,
        node: &str,
    ) -> Result<TlsStream<TcpStream>, SubresourceError> {
        let addr = self.locate(client, node).await?;
        let unreachable = |e: String| {
            unavailable(format!(
                "virt-handler on node {node} ({addr}) cannot be reached: {e}"
            ))
        };
        let tcp = tokio::time::timeout(std::time::Duration::from_secs(5), TcpStream::connect(addr))
            .await
            .map_err(|_| unreachable("timed out".into()))?
            .map_err(|e| unreachable(e.to_string()))?;
        let name =
            ServerName::try_from(node.to_string()).map_err(|e| unreachable(e.to_string()))?;
        tokio_rustls::TlsConnector::from(self.tls.clone())
            .connect(name, tcp)
            .await
            .map_err(|e| unreachable(format!("TLS: {e}")))
    }

    fn path(namespace: &str, name: &str, verb: &str) -> String {
        format!("/v1/namespaces/{namespace}/virtualmachineinstances/{name}/{verb}")
    }

    /// `PUT` `verb` (pause, unpause) on the node's virt-handler; its refusal passed on.
    pub async fn lifecycle(
        &self,
        client: &kube::Client,
        node: &str,
        namespace: &str,
        name: &str,
        verb: &str,
    ) -> Result<(), SubresourceError> {
        let tls = self.connect(client, node).await?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
                .await
                .map_err(|e| unavailable(e.to_string()))?;
        tokio::spawn(conn);
        let req = hyper::Request::put(Self::path(namespace, name, verb))
            .header("host", node)
            .body(Empty::<Bytes>::new())
            .map_err(|e| SubresourceError::internal(e.to_string()))?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        let code = resp.status().as_u16();
        if resp.status().is_success() {
            return Ok(());
        }
        let body = resp
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        Err(from_status(code, &body))
    }

    /// The VMI's console on its node, as a websocket.
    pub async fn console(
        &self,
        client: &kube::Client,
        node: &str,
        namespace: &str,
        name: &str,
    ) -> Result<tokio_tungstenite::WebSocketStream<TlsStream<TcpStream>>, SubresourceError> {
        use tokio_tungstenite::tungstenite::client::IntoClientRequest;
        let tls = self.connect(client, node).await?;
        let url = format!("wss://{node}{}", Self::path(namespace, name, "console"));
        let mut req = url
            .into_client_request()
            .map_err(|e| SubresourceError::internal(e.to_string()))?;
        req.headers_mut().insert(
            "sec-websocket-protocol",
            http::HeaderValue::from_static("plain.kubevirt.io"),
        );
        match tokio_tungstenite::client_async(req, tls).await {
            Ok((ws, _)) => Ok(ws),
            Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
                let code = resp.status().as_u16();
                Err(from_status(
                    code,
                    resp.body().as_deref().unwrap_or_default(),
                ))
            }
            Err(e) => Err(unavailable(format!("console of {namespace}/{name}: {e}"))),
        }
    }
}

/// A virt-handler refusal (`metav1.Status`) as virt-api's.
fn from_status(code: u16, body: &[u8]) -> SubresourceError {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let message = v["message"]
        .as_str()
        .map(str::to_string)
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
    let reason = match code {
        404 => "NotFound",
        409 => "Conflict",
        401 | 403 => "InternalError", // virt-api's own credentials were refused
        _ => "ServiceUnavailable",
    };
    let code = if matches!(code, 401 | 403) { 500 } else { code };
    SubresourceError::new(code, reason, message)
}
