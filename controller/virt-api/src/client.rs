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

    /// `GET …/virtualmachineinstances/{name}/{sub}`, answered with JSON.
    pub async fn vmi_get(&self, name: &str, sub: &str) -> Result<Value, CallError> {
        let req = Request::get(self.path("virtualmachineinstances", name, sub))
            .body(Vec::new())
            .map_err(|e| CallError::Transport(e.to_string()))?;
        Ok(self.client.request::<Value>(req).await?)
    }

    /// virt-api's version (`GET /apis/subresources.kubevirt.io/v1/version`).
    pub async fn server_version(&self) -> Result<Value, CallError> {
        let req = Request::get(format!("/apis/{GROUP}/v1/version"))
            .body(Vec::new())
            .map_err(|e| CallError::Transport(e.to_string()))?;
        Ok(self.client.request::<Value>(req).await?)
    }
}
