//! CertificateSigningRequests as kube-apiserver keeps them: who asked is recorded by the
//! server (`spec.username`, `groups`, `uid`, `extra` — whatever the client sent there is
//! replaced), approval and denial go through the `approval` subresource, and a certificate
//! may be set on `status` only once the request is approved, and never changed after.

use super::*;

pub(super) const PLURAL: &str = "certificatesigningrequests";

/// Records the caller in the request's spec, as the server does on create.
pub(super) fn stamp(obj: &mut Value, caller: &Caller) {
    let spec = &mut obj["spec"];
    if !spec.is_object() {
        *spec = json!({});
    }
    spec["username"] = json!(caller.user);
    spec["groups"] = json!(caller.groups);
    spec["uid"] = json!(new_uid());
    if caller.extra.is_empty() {
        if let Some(s) = spec.as_object_mut() {
            s.remove("extra");
        }
    } else {
        spec["extra"] = json!(caller.extra);
    }
}

fn approved(obj: &Value) -> bool {
    obj.pointer("/status/conditions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "Approved" && c["status"] == "True")
}

/// What a `status` update of a request may not do.
pub(super) fn check_status_update(name: &str, old: &Value, new: &Value) -> ApiResult<()> {
    let cert = |o: &Value| {
        o.pointer("/status/certificate")
            .and_then(Value::as_str)
            .filter(|c| !c.is_empty())
            .map(str::to_string)
    };
    let invalid = |why: &str| {
        ApiError::new(
            422,
            "Invalid",
            format!("CertificateSigningRequest.certificates.k8s.io \"{name}\" is invalid: status.certificate: Forbidden: {why}"),
        )
    };
    match (cert(old), cert(new)) {
        (Some(a), Some(b)) if a != b => Err(invalid(
            "updates may not modify existing certificate content",
        )),
        (Some(_), None) => Err(invalid(
            "updates may not remove existing certificate content",
        )),
        (None, Some(_)) if !approved(old) => Err(invalid(
            "certificate can only be set once the request is approved",
        )),
        _ => Ok(()),
    }
}
