//! Errors as the API server answers them: a `Status` object with code, reason and message.

use axum::body::Body;
use axum::http::{Response, StatusCode};
use serde_json::{json, Value};

/// An API error as a `Status` object.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub(crate) code: u16,
    pub(crate) reason: &'static str,
    pub(crate) message: String,
}

impl ApiError {
    pub(crate) fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            code,
            reason,
            message: message.into(),
        }
    }
    pub(crate) fn status(&self) -> Value {
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code,
        })
    }
}

pub(crate) type ApiResult<T> = Result<T, ApiError>;

pub(crate) fn json_response(code: u16, body: &Value) -> Response<Body> {
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap())
        .header("content-type", "application/json")
        .body(Body::from(serde_json::to_vec(body).unwrap()))
        .unwrap()
}

/// A response carrying admission warnings, as `Warning: 299 - "..."` headers (kubectl prints
/// each as `Warning: ...`).
pub(crate) fn with_warnings(mut resp: Response<Body>, warnings: &[String]) -> Response<Body> {
    for w in warnings {
        let text = w.replace('"', "'");
        if let Ok(v) = axum::http::HeaderValue::from_str(&format!("299 - \"{text}\"")) {
            resp.headers_mut().append("warning", v);
        }
    }
    resp
}
