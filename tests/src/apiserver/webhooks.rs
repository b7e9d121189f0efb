//! Dynamic admission as kube-apiserver does it: a create, update or delete of an object (and a
//! `pods/eviction`) is sent to the webhooks registered in the server's own
//! `MutatingWebhookConfiguration` objects, then to those in `ValidatingWebhookConfiguration`
//! objects — configurations in name order, webhooks in their order — matched by their rules,
//! `namespaceSelector` and `objectSelector`, called over TLS verified against their
//! `caBundle`, with their `failurePolicy` and `timeoutSeconds`.
//!
//! Registrations are read from the store at each request, so a test registers a webhook the
//! way a cluster does: by applying the configuration (e.g. `deploy/webhook.yaml`, or what
//! virt-operator creates) and saying where the Service listens
//! (`ApiServer::set_service_endpoint`). A registration the file does not make is not called,
//! and one that cannot work on a real server (an `objectSelector` on a subresource, whose
//! object has no labels) does not work here either.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use serde_json::{json, Value};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::ServerName;

use super::errors::{ApiError, ApiResult};
use super::json::meta;
use super::selectors::{labels_match, LabelReq};
use super::{AdmissionAttributes, Inner};

/// The kind of configuration, in the order the server calls them.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    Mutating,
    Validating,
}

impl Phase {
    fn store_key(self) -> &'static str {
        match self {
            Phase::Mutating => "admissionregistration.k8s.io/v1/mutatingwebhookconfigurations",
            Phase::Validating => "admissionregistration.k8s.io/v1/validatingwebhookconfigurations",
        }
    }
}

/// One registered webhook, as read from its configuration.
struct Registration {
    phase: Phase,
    spec: Value,
}

impl Registration {
    fn name(&self) -> &str {
        self.spec["name"].as_str().unwrap_or("")
    }

    /// Whether a rule names this request: group, version, operation, resource (with its
    /// subresource, `*` and `resource/*` as the API documents) and scope.
    fn rules_match(&self, attrs: &AdmissionAttributes, namespaced: bool) -> bool {
        let resource = match &attrs.subresource {
            Some(sub) => format!("{}/{sub}", attrs.resource),
            None => attrs.resource.to_string(),
        };
        let strings = |v: &Value| -> Vec<String> {
            v.as_array()
                .into_iter()
                .flatten()
                .filter_map(|x| x.as_str().map(str::to_string))
                .collect()
        };
        let has = |list: &[String], v: &str| list.iter().any(|x| x == v || x == "*");
        self.spec["rules"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|r| {
                let resources = strings(&r["resources"]);
                let resource_ok = resources.iter().any(|x| match &attrs.subresource {
                    None => x == &resource || x == "*",
                    Some(sub) => {
                        x == &resource
                            || x == "*/*"
                            || x.strip_suffix("/*") == Some(attrs.resource)
                            || x.strip_prefix("*/") == Some(sub.as_str())
                    }
                });
                let scope_ok = match r["scope"].as_str().unwrap_or("*") {
                    "Namespaced" => namespaced,
                    "Cluster" => !namespaced,
                    _ => true,
                };
                has(&strings(&r["apiGroups"]), attrs.group)
                    && has(&strings(&r["apiVersions"]), attrs.version)
                    && has(&strings(&r["operations"]), attrs.operation)
                    && resource_ok
                    && scope_ok
            })
    }

    fn failure_ignored(&self) -> bool {
        self.spec["failurePolicy"].as_str() == Some("Ignore")
    }

    fn timeout(&self) -> Duration {
        Duration::from_secs(
            self.spec["timeoutSeconds"]
                .as_u64()
                .unwrap_or(10)
                .clamp(1, 30),
        )
    }
}

/// A label selector (`matchLabels`, `matchExpressions`) as requirements; an absent or empty
/// selector selects everything.
fn selector(v: &Value) -> Vec<LabelReq> {
    let mut reqs = vec![];
    for (k, val) in v["matchLabels"].as_object().into_iter().flatten() {
        reqs.push(LabelReq::Eq(k.clone(), val.as_str().unwrap_or("").into()));
    }
    for e in v["matchExpressions"].as_array().into_iter().flatten() {
        let key = e["key"].as_str().unwrap_or("").to_string();
        let values: Vec<String> = e["values"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|x| x.as_str().map(str::to_string))
            .collect();
        reqs.push(match e["operator"].as_str().unwrap_or("") {
            "In" => LabelReq::In(key, values),
            "NotIn" => LabelReq::NotIn(key, values),
            "DoesNotExist" => LabelReq::NotExists(key),
            _ => LabelReq::Exists(key),
        });
    }
    reqs
}

/// Whether `obj` can carry labels at all: an Eviction's metadata is its own, so it has none
/// of the Pod's.
fn object_selected(reqs: &[LabelReq], obj: Option<&Value>) -> bool {
    obj.is_some_and(|o| !o.is_null() && labels_match(o, reqs))
}

impl Inner {
    /// Whether any registered webhook's rules name `operation` on `t`'s resource (the
    /// selectors aside): without one, a write needs no admission round.
    pub(super) fn has_webhooks_for(&self, t: &super::Target, operation: &'static str) -> bool {
        let attrs = self.admission_attributes(t, operation, Value::Null, None);
        [Phase::Mutating, Phase::Validating]
            .into_iter()
            .flat_map(|p| self.registrations(p))
            .any(|r| r.rules_match(&attrs, t.rtype.namespaced))
    }

    /// Every webhook of `phase`, configurations in name order.
    fn registrations(&self, phase: Phase) -> Vec<Registration> {
        let st = self.state.lock().unwrap();
        st.objects
            .get(phase.store_key())
            .into_iter()
            .flat_map(|m| m.values())
            .flat_map(|c| c["webhooks"].as_array().cloned().unwrap_or_default())
            .map(|spec| Registration { phase, spec })
            .collect()
    }

    /// The labels a `namespaceSelector` is matched against: the Namespace object's (a
    /// Namespace's own for a Namespace), none for a namespace that does not exist.
    fn namespace_object(&self, attrs: &AdmissionAttributes) -> Value {
        if attrs.resource == "namespaces" && attrs.group.is_empty() {
            return attrs.object.clone();
        }
        let Some(ns) = &attrs.namespace else {
            return json!({});
        };
        let st = self.state.lock().unwrap();
        st.objects
            .get("/v1/namespaces")
            .and_then(|m| m.get(&(String::new(), ns.clone())))
            .cloned()
            .unwrap_or_else(|| json!({}))
    }

    fn selected(&self, reg: &Registration, attrs: &AdmissionAttributes, namespaced: bool) -> bool {
        if !reg.rules_match(attrs, namespaced) {
            return false;
        }
        let ns_reqs = selector(&reg.spec["namespaceSelector"]);
        if (namespaced || attrs.resource == "namespaces")
            && !ns_reqs.is_empty()
            && !labels_match(&self.namespace_object(attrs), &ns_reqs)
        {
            return false;
        }
        let obj_reqs = selector(&reg.spec["objectSelector"]);
        obj_reqs.is_empty()
            || object_selected(&obj_reqs, Some(&attrs.object))
            || object_selected(&obj_reqs, attrs.old_object.as_ref())
    }

    /// Runs the registered webhooks on `attrs`: the object as the mutating ones leave it, and
    /// the warnings of all; or the refusal, as the real server words it.
    pub(super) async fn dynamic_admission(
        &self,
        mut attrs: AdmissionAttributes,
        namespaced: bool,
    ) -> ApiResult<(Value, Vec<String>)> {
        let mut warnings = vec![];
        for phase in [Phase::Mutating, Phase::Validating] {
            for reg in self.registrations(phase) {
                if !self.selected(&reg, &attrs, namespaced) {
                    continue;
                }
                let name = reg.name().to_string();
                let response = match self.call(&reg, &attrs).await {
                    Ok(r) => r,
                    Err(_) if reg.failure_ignored() => continue,
                    Err(e) => {
                        return Err(ApiError::new(
                            500,
                            "InternalError",
                            format!(
                                "Internal error occurred: failed calling webhook \"{name}\": {e}"
                            ),
                        ))
                    }
                };
                for w in response["warnings"].as_array().into_iter().flatten() {
                    if let Some(w) = w.as_str() {
                        warnings.push(w.to_string());
                    }
                }
                if response["allowed"] != json!(true) {
                    return Err(denial(&name, &response));
                }
                if let (Phase::Mutating, Some(patch)) = (reg.phase, response["patch"].as_str()) {
                    apply_patch(&name, &mut attrs.object, patch)?;
                }
            }
        }
        Ok((attrs.object, warnings))
    }

    /// One AdmissionReview round trip; `Err` is a call that failed (unreachable, TLS not
    /// verified, timed out, a malformed answer), which `failurePolicy` decides on.
    async fn call(&self, reg: &Registration, attrs: &AdmissionAttributes) -> Result<Value, String> {
        let uid = super::new_uid();
        let review = review(&uid, attrs);
        let (endpoint, server_name, path) = self.webhook_address(&reg.spec["clientConfig"])?;
        let url = format!("https://{server_name}{path}");
        let ca = reg.spec["clientConfig"]["caBundle"]
            .as_str()
            .and_then(|b| {
                use base64::Engine;
                base64::engine::general_purpose::STANDARD.decode(b).ok()
            })
            .unwrap_or_default();
        let post = post(endpoint, &ca, &server_name, &path, &review);
        let answer = tokio::time::timeout(reg.timeout(), post)
            .await
            .map_err(|_| {
                format!("failed to call webhook: Post \"{url}\": context deadline exceeded")
            })?
            .map_err(|e| format!("failed to call webhook: Post \"{url}\": {e}"))?;
        let response = answer["response"].clone();
        if response["uid"].as_str() != Some(uid.as_str()) {
            return Err(format!(
                "received invalid webhook response: expected response.uid=\"{uid}\", got \"{}\"",
                response["uid"].as_str().unwrap_or("")
            ));
        }
        Ok(response)
    }

    /// Where a webhook's `clientConfig` points: a Service (through the endpoints the test set)
    /// or a URL.
    fn webhook_address(&self, cc: &Value) -> Result<(SocketAddr, String, String), String> {
        if let Some(svc) = cc.get("service").filter(|s| s.is_object()) {
            let ns = svc["namespace"].as_str().unwrap_or("");
            let name = svc["name"].as_str().unwrap_or("");
            let endpoint = self
                .endpoints
                .lock()
                .unwrap()
                .get(&(ns.to_string(), name.to_string()))
                .copied()
                .ok_or_else(|| {
                    format!("service \"{name}\" not found in namespace \"{ns}\" (no endpoints)")
                })?;
            let path = svc["path"].as_str().unwrap_or("/").to_string();
            return Ok((endpoint, format!("{name}.{ns}.svc"), path));
        }
        let url = cc["url"]
            .as_str()
            .ok_or("clientConfig has neither service nor url")?;
        let rest = url
            .strip_prefix("https://")
            .ok_or_else(|| format!("webhook URL {url:?} is not https"))?;
        let (hostport, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (host, port) = hostport.rsplit_once(':').unwrap_or((hostport, "443"));
        let addr = format!("{host}:{port}")
            .parse::<SocketAddr>()
            .or_else(|_| {
                use std::net::ToSocketAddrs;
                format!("{host}:{port}")
                    .to_socket_addrs()
                    .ok()
                    .and_then(|mut a| a.next())
                    .ok_or(())
            })
            .map_err(|_| format!("cannot resolve {hostport}"))?;
        Ok((addr, host.to_string(), format!("/{path}")))
    }
}

/// The AdmissionReview v1 request the server sends.
fn review(uid: &str, attrs: &AdmissionAttributes) -> Value {
    let (object, old_object) = match attrs.operation {
        "DELETE" => (Value::Null, attrs.old_object.clone()),
        _ => (attrs.object.clone(), attrs.old_object.clone()),
    };
    let name = meta(attrs.old_object.as_ref().unwrap_or(&attrs.object))
        .get("name")
        .cloned()
        .unwrap_or(json!(""));
    let (kind_group, kind_version, kind) = match attrs.subresource.as_deref() {
        Some("eviction") => ("policy", "v1", "Eviction"),
        _ => (attrs.group, attrs.version, attrs.kind),
    };
    json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": kind_group, "version": kind_version, "kind": kind},
            "resource": {"group": attrs.group, "version": attrs.version, "resource": attrs.resource},
            "subResource": attrs.subresource,
            "requestKind": {"group": kind_group, "version": kind_version, "kind": kind},
            "requestResource": {"group": attrs.group, "version": attrs.version, "resource": attrs.resource},
            "name": attrs.name.clone().map(Value::from).unwrap_or(name),
            "namespace": attrs.namespace,
            "operation": attrs.operation,
            "userInfo": {"username": attrs.user},
            "object": object, "oldObject": old_object, "dryRun": attrs.dry_run,
        }
    })
}

/// The refusal as kube-apiserver returns it: the webhook's code (400 if it gave none), its
/// message prefixed with the webhook's name.
fn denial(name: &str, response: &Value) -> ApiError {
    let code = response["status"]["code"]
        .as_u64()
        .filter(|c| (400..600).contains(c))
        .unwrap_or(400) as u16;
    let message = response["status"]["message"].as_str().unwrap_or("");
    let reason = match code {
        403 => "Forbidden",
        409 => "Conflict",
        422 => "Invalid",
        429 => "TooManyRequests",
        500 => "InternalError",
        _ => "BadRequest",
    };
    let message = if message.is_empty() {
        format!("admission webhook \"{name}\" denied the request without explanation")
    } else {
        format!("admission webhook \"{name}\" denied the request: {message}")
    };
    ApiError::new(code, reason, message)
}

fn apply_patch(name: &str, object: &mut Value, patch: &str) -> ApiResult<()> {
    use base64::Engine;
    let bad = |e: String| {
        ApiError::new(
            500,
            "InternalError",
            format!("Internal error occurred: webhook \"{name}\" sent a patch that cannot be applied: {e}"),
        )
    };
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(patch)
        .map_err(|e| bad(e.to_string()))?;
    let patch: json_patch::Patch =
        serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
    json_patch::patch(object, &patch).map_err(|e| bad(e.to_string()))
}

/// POSTs `review` to the webhook over TLS verified against `ca` as `server_name`.
async fn post(
    endpoint: SocketAddr,
    ca: &[u8],
    server_name: &str,
    path: &str,
    review: &Value,
) -> Result<Value, String> {
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pemfile::certs(&mut &ca[..]).flatten() {
        let _ = roots.add(c);
    }
    if roots.is_empty() {
        return Err("tls: failed to verify certificate: x509: certificate signed by unknown authority (no caBundle)".into());
    }
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(endpoint)
        .await
        .map_err(|e| format!("dial tcp {endpoint}: {e}"))?;
    let name = ServerName::try_from(server_name.to_string()).map_err(|e| e.to_string())?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(name, tcp)
        .await
        .map_err(|e| format!("tls: failed to verify certificate: {e}"))?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = hyper::Request::post(path)
        .header("host", server_name)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(review).unwrap())))
        .map_err(|e| e.to_string())?;
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    if !status.is_success() {
        return Err(format!(
            "the server responded with the status code {} but did not return more information",
            status.as_u16()
        ));
    }
    serde_json::from_slice(&body).map_err(|e| format!("received invalid webhook response: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs(resource: &'static str, sub: Option<&str>, op: &'static str) -> AdmissionAttributes {
        AdmissionAttributes {
            operation: op,
            group: "",
            version: "v1",
            resource,
            kind: "Pod",
            subresource: sub.map(str::to_string),
            namespace: Some("default".into()),
            name: Some("p".into()),
            object: json!({"metadata": {"name": "p", "labels": {"kubevirt.io": "virt-launcher"}}}),
            old_object: None,
            user: "admin".into(),
            dry_run: false,
        }
    }

    fn reg(rules: Value) -> Registration {
        Registration {
            phase: Phase::Validating,
            spec: json!({"name": "w", "rules": rules}),
        }
    }

    #[test]
    fn rules_name_resources_and_subresources_as_the_api_documents() {
        let r = reg(
            json!([{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods/eviction"]}]),
        );
        assert!(r.rules_match(&attrs("pods", Some("eviction"), "CREATE"), true));
        assert!(!r.rules_match(&attrs("pods", None, "CREATE"), true));
        let r = reg(
            json!([{"apiGroups": ["*"], "apiVersions": ["*"], "operations": ["*"], "resources": ["*"]}]),
        );
        assert!(r.rules_match(&attrs("pods", None, "DELETE"), true));
        assert!(!r.rules_match(&attrs("pods", Some("eviction"), "CREATE"), true));
        let r = reg(
            json!([{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"], "scope": "Cluster"}]),
        );
        assert!(!r.rules_match(&attrs("pods", None, "CREATE"), true));
    }

    #[test]
    fn an_object_selector_never_selects_an_eviction() {
        let reqs = selector(&json!({"matchLabels": {"kubevirt.io": "virt-launcher"}}));
        let eviction =
            json!({"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "p"}});
        assert!(!object_selected(&reqs, Some(&eviction)));
        assert!(!object_selected(&reqs, Some(&Value::Null)));
        let pod = json!({"metadata": {"labels": {"kubevirt.io": "virt-launcher"}}});
        assert!(object_selected(&reqs, Some(&pod)));
    }
}
