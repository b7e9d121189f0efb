//! Calls to `subresources.kubevirt.io` through the Kubernetes API server, as virtctl makes
//! them: the API server authenticates the caller and forwards to virt-api.

use http::Request;
use serde_json::Value;

use crate::GROUP;

/// A failed call: the server's `metav1.Status` words when it answered, else the transport's.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("{message}")]
    Refused { code: u16, message: String },
    #[error("{0}")]
    Transport(String),
}

impl CallError {
    pub fn code(&self) -> Option<u16> {
        match self {
            CallError::Refused { code, .. } => Some(*code),
            CallError::Transport(_) => None,
        }
    }
}

impl From<kube::Error> for CallError {
    fn from(e: kube::Error) -> Self {
        match e {
            kube::Error::Api(s) => CallError::Refused {
                code: s.code,
                message: s.message,
            },
            other => CallError::Transport(other.to_string()),
        }
    }
}

/// A websocket through the API server.
pub type Socket =
    tokio_tungstenite::WebSocketStream<hyper_util::rt::TokioIo<hyper::upgrade::Upgraded>>;

pub struct Subresources {
    pub client: kube::Client,
    pub namespace: String,
}

impl Subresources {
    fn path(&self, resource: &str, name: &str, sub: &str) -> String {
        format!(
            "/apis/{GROUP}/v1/namespaces/{}/{resource}/{name}/{sub}",
            self.namespace
        )
    }

    /// `PUT …/virtualmachines/{name}/{verb}` with `options` as the body.
    pub async fn vm_verb(&self, name: &str, verb: &str, options: &Value) -> Result<(), CallError> {
        let req = Request::put(self.path("virtualmachines", name, verb))
            .header("content-type", "application/json")
            .body(serde_json::to_vec(options).expect("options serialize"))
            .map_err(|e| CallError::Transport(e.to_string()))?;
        self.client.request_text(req).await?;
        Ok(())
    }

    /// `GET …/virtualmachines/{name}/{sub}`, answered with JSON (expand-spec).
    pub async fn vm_get(&self, name: &str, sub: &str) -> Result<Value, CallError> {
        let req = Request::get(self.path("virtualmachines", name, sub))
            .body(Vec::new())
            .map_err(|e| CallError::Transport(e.to_string()))?;
        Ok(self.client.request::<Value>(req).await?)
    }

    /// `GET …/virtualmachineinstances/{name}/{sub}`, answered with JSON.
    pub async fn vmi_get(&self, name: &str, sub: &str) -> Result<Value, CallError> {
        let req = Request::get(self.path("virtualmachineinstances", name, sub))
            .body(Vec::new())
            .map_err(|e| CallError::Transport(e.to_string()))?;
        Ok(self.client.request::<Value>(req).await?)
    }

    /// `PUT …/virtualmachineinstances/{name}/{verb}` (pause, unpause).
    pub async fn vmi_verb(&self, name: &str, verb: &str) -> Result<(), CallError> {
        let req = Request::put(self.path("virtualmachineinstances", name, verb))
            .body(Vec::new())
            .map_err(|e| CallError::Transport(e.to_string()))?;
        self.client.request_text(req).await?;
        Ok(())
    }

    /// The VMI's serial console: a websocket with KubeVirt's `plain.kubevirt.io` subprotocol
    /// (raw bytes both ways), through the API server.
    pub async fn console(&self, name: &str) -> Result<Socket, CallError> {
        self.websocket(self.path("virtualmachineinstances", name, "console"))
            .await
    }

    /// A TCP connection to `port` of the guest of `resource` (`virtualmachineinstances` or
    /// `virtualmachines`) `name`, as a websocket.
    pub async fn port_forward(
        &self,
        resource: &str,
        name: &str,
        port: u16,
    ) -> Result<Socket, CallError> {
        self.websocket(self.path(resource, name, &format!("portforward/{port}")))
            .await
    }

    async fn websocket(&self, path: String) -> Result<Socket, CallError> {
        use tokio_tungstenite::tungstenite::handshake::client::generate_key;
        use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
        let key = generate_key();
        let req = Request::get(path)
            .header("connection", "Upgrade")
            .header("upgrade", "websocket")
            .header("sec-websocket-version", "13")
            .header("sec-websocket-key", &key)
            .header("sec-websocket-protocol", "plain.kubevirt.io")
            .body(kube::client::Body::empty())
            .map_err(|e| CallError::Transport(e.to_string()))?;
        let resp = self.client.send(req).await?;
        let status = resp.status();
        if status != http::StatusCode::SWITCHING_PROTOCOLS {
            let body = http_body_util::BodyExt::collect(resp.into_body())
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let v: Value = serde_json::from_slice(&body).unwrap_or_default();
            let message = v["message"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| format!("{status}: {}", String::from_utf8_lossy(&body)));
            return Err(CallError::Refused {
                code: status.as_u16(),
                message,
            });
        }
        let accepted = resp
            .headers()
            .get("sec-websocket-accept")
            .is_some_and(|v| v.as_bytes() == derive_accept_key(key.as_bytes()).as_bytes());
        if !accepted {
            return Err(CallError::Transport(
                "the websocket handshake was not answered properly".into(),
            ));
        }
        let upgraded = hyper::upgrade::on(resp)
            .await
            .map_err(|e| CallError::Transport(e.to_string()))?;
        Ok(tokio_tungstenite::WebSocketStream::from_raw_socket(
            hyper_util::rt::TokioIo::new(upgraded),
            tokio_tungstenite::tungstenite::protocol::Role::Client,
            None,
        )
        .await)
    }

    /// virt-api's version (`GET /apis/subresources.kubevirt.io/v1/version`).
    pub async fn server_version(&self) -> Result<Value, CallError> {
        let req = Request::get(format!("/apis/{GROUP}/v1/version"))
            .body(Vec::new())
            .map_err(|e| CallError::Transport(e.to_string()))?;
        Ok(self.client.request::<Value>(req).await?)
    }
}
