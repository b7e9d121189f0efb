//! Answers in the format every Kubernetes client decodes (`metav1.Status`): what virtctl and
//! kubectl print on failure, and what scripts branch on (`code`, `reason`).

use serde_json::{json, Value};

/// A refusal or failure of a subresource call.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct SubresourceError {
    pub code: u16,
    /// One of Kubernetes' StatusReasons (`NotFound`, `Conflict`, `BadRequest`, …).
    pub reason: &'static str,
    pub message: String,
}

impl SubresourceError {
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        SubresourceError {
            code,
            reason,
            message: message.into(),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(409, "Conflict", message)
    }

    /// `resource` as the API server names it in messages (`virtualmachines.kubevirt.io`).
    pub fn not_found(resource: &str, name: &str) -> Self {
        Self::new(404, "NotFound", format!("{resource} \"{name}\" not found"))
    }

    /// A verb refused for the VM's state, in the API server's words for a conflict
    /// (`Operation cannot be fulfilled on virtualmachine.kubevirt.io "vm": VM is already
    /// running`); other errors unchanged.
    pub fn about_vm(self, name: &str) -> Self {
        if self.code != 409 {
            return self;
        }
        let message = format!(
            "Operation cannot be fulfilled on virtualmachine.kubevirt.io \"{name}\": {}",
            self.message
        );
        SubresourceError { message, ..self }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, "InternalError", message)
    }

    /// The error a Kubernetes API call failed with, passed on with its own code and words
    /// (a webhook's refusal reaches the user as the webhook wrote it).
    pub fn from_kube(e: kube::Error) -> Self {
        match e {
            kube::Error::Api(s) => {
                let reason = match s.code {
                    400 => "BadRequest",
                    401 => "Unauthorized",
                    403 => "Forbidden",
                    404 => "NotFound",
                    409 => "Conflict",
                    422 => "Invalid",
                    429 => "TooManyRequests",
                    _ => "InternalError",
                };
                Self::new(s.code, reason, s.message)
            }
            other => Self::internal(other.to_string()),
        }
    }

    pub fn to_status(&self) -> Value {
        json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        })
    }
}

impl axum::response::IntoResponse for SubresourceError {
    fn into_response(self) -> axum::response::Response {
        let code = http::StatusCode::from_u16(self.code)
            .unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
        (code, axum::Json(self.to_status())).into_response()
    }
}
