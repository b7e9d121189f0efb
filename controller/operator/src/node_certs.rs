//! The signer of virt-handler's node certificates ([`api::kubevirt::NODE_CERTIFICATE_SIGNER`]),
//! with which nodes migrate to each other and virt-api reaches their consoles.
//!
//! Each handler asks for its own certificate with a CertificateSigningRequest (its key never
//! leaves the node). All handlers share one service account, so the account cannot tell nodes
//! apart; the node-bound token the handler authenticates with can — the API server records its
//! node in the request's `spec.extra` ([`api::kubevirt::NODE_NAME_EXTRA`]). A request is signed
//! only when it comes from the installation's virt-handler account, names exactly that node,
//! and asks for no other use than TLS server and client; anything else is denied with the
//! reason, so one node can never hold another's identity. Certificates are signed by the
//! installation's CA (`certs`) for the server lifetime of `certificateRotateStrategy`; the
//! handler asks again before the end.

use std::sync::Arc;
use std::time::Duration;

use api::kubevirt::{KubeVirt, HANDLER_SERVICE_ACCOUNT, NODE_CERTIFICATE_SIGNER, NODE_NAME_EXTRA};
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Api, Client, ResourceExt};

use crate::certs::{self, Pair, Rotation};

/// The uses a node certificate may carry.
const ALLOWED_USAGES: [&str; 4] = [
    "digital signature",
    "key encipherment",
    "server auth",
    "client auth",
];

/// What to do with a request.
#[derive(Debug)]
pub enum Verdict {
    /// For another signer, or already decided.
    Skip,
    /// Sign it for this node.
    Issue {
        node: String,
        request: Box<rcgen::CertificateSigningRequestParams>,
    },
    /// Refuse it, with why.
    Deny(String),
}

fn decided(csr: &CertificateSigningRequest) -> bool {
    let status = csr.status.as_ref();
    let has_cert = status
        .and_then(|s| s.certificate.as_ref())
        .is_some_and(|c| !c.0.is_empty());
    let refused = status
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| (c.type_ == "Denied" || c.type_ == "Failed") && c.status == "True");
    has_cert || refused
}

/// Judges `csr` for the installation in `namespace` (pure: the request as the API server
/// stamped it).
pub fn judge(csr: &CertificateSigningRequest, namespace: &str) -> Verdict {
    let spec = &csr.spec;
    if spec.signer_name != NODE_CERTIFICATE_SIGNER || decided(csr) {
        return Verdict::Skip;
    }
    let account = format!("system:serviceaccount:{namespace}:{HANDLER_SERVICE_ACCOUNT}");
    let user = spec.username.as_deref().unwrap_or("");
    if user != account {
        return Verdict::Deny(format!(
            "requested by {user:?}: only {account} may ask {NODE_CERTIFICATE_SIGNER} for a node certificate"
        ));
    }
    let nodes: Vec<String> = spec
        .extra
        .as_ref()
        .and_then(|e| e.get(NODE_NAME_EXTRA))
        .cloned()
        .unwrap_or_default();
    let [node] = nodes.as_slice() else {
        return Verdict::Deny(format!(
            "the requester's token names no single node ({NODE_NAME_EXTRA}: {nodes:?}): virt-handler must authenticate with a node-bound service-account token"
        ));
    };
    if node == certs::API_CLIENT.1 {
        // The consoles take a certificate naming virt-api for virt-api's.
        return Verdict::Deny(format!(
            "node name {node:?} is reserved: it is the name of virt-api's client certificate"
        ));
    }
    for u in spec.usages.iter().flatten() {
        if !ALLOWED_USAGES.contains(&u.as_str()) {
            return Verdict::Deny(format!(
                "usage {u:?} is not for a node certificate (allowed: {})",
                ALLOWED_USAGES.join(", ")
            ));
        }
    }
    let pem = String::from_utf8_lossy(&spec.request.0);
    let request = match rcgen::CertificateSigningRequestParams::from_pem(&pem) {
        Ok(r) => r,
        Err(e) => {
            return Verdict::Deny(format!("spec.request is not a signed PKCS#10 request: {e}"))
        }
    };
    let names: Vec<String> = request
        .params
        .subject_alt_names
        .iter()
        .map(|n| match n {
            rcgen::SanType::DnsName(d) => d.as_str().to_string(),
            other => format!("{other:?}"),
        })
        .collect();
    if names != [node.clone()] {
        return Verdict::Deny(format!(
            "the request names {names:?}; a certificate for node {node:?} names that node alone"
        ));
    }
    Verdict::Issue {
        node: node.clone(),
        request: Box::new(request),
    }
}

/// The certificate for an accepted request: the node's name as its DNS name and common
/// name's suffix, TLS server and client use, signed by `ca` for `lifetime`.
pub fn sign(
    ca: &Pair,
    node: &str,
    mut request: rcgen::CertificateSigningRequestParams,
    lifetime: Duration,
) -> Result<String, String> {
    let issuer = certs::ca_issuer(ca)?;
    let p = &mut request.params;
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name.push(
        rcgen::DnType::CommonName,
        format!("kubevirt.io:system:node:{node}"),
    );
    p.is_ca = rcgen::IsCa::ExplicitNoCa;
    p.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
    ];
    certs::validity(p, lifetime);
    let cert = request.signed_by(&issuer).map_err(|e| e.to_string())?;
    Ok(cert.pem())
}

/// The signer's view of the cluster.
pub struct Signer {
    pub client: Client,
    /// The installation's namespace (the operator's own).
    pub namespace: String,
}

#[derive(Debug, thiserror::Error)]
pub enum SignerError {
    #[error(transparent)]
    Api(#[from] kube::Error),
    #[error("signing: {0}")]
    Sign(String),
}

fn condition(type_: &str, reason: &str, message: &str) -> serde_json::Value {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    serde_json::json!({"status": {"conditions": [{
        "type": type_, "status": "True", "reason": reason, "message": message,
        "lastUpdateTime": now, "lastTransitionTime": now,
    }]}})
}

/// Approves and signs, or denies, one request.
pub async fn reconcile(
    csr: Arc<CertificateSigningRequest>,
    signer: Arc<Signer>,
) -> Result<Action, SignerError> {
    let csrs: Api<CertificateSigningRequest> = Api::all(signer.client.clone());
    let name = csr.name_any();
    let pp = PatchParams::default();
    match judge(&csr, &signer.namespace) {
        Verdict::Skip => Ok(Action::await_change()),
        Verdict::Deny(why) => {
            tracing::warn!(csr = %name, reason = %why, "node certificate request denied");
            let patch = condition("Denied", "NotThisNode", &why);
            csrs.patch_approval(&name, &pp, &Patch::Merge(&patch))
                .await?;
            Ok(Action::await_change())
        }
        Verdict::Issue { node, request } => {
            // Without the CA (the installation not made yet), wait for it.
            let Some(ca) = certs::current_ca(&signer.client, &signer.namespace).await? else {
                return Ok(Action::requeue(Duration::from_secs(2)));
            };
            let lifetime = server_lifetime(&signer.client, &signer.namespace).await?;
            let cert = sign(&ca, &node, *request, lifetime).map_err(SignerError::Sign)?;
            let approve = condition(
                "Approved",
                "NodeCertificate",
                &format!("virt-handler on node {node}"),
            );
            csrs.patch_approval(&name, &pp, &Patch::Merge(&approve))
                .await?;
            use base64::Engine;
            let b64 = base64::engine::general_purpose::STANDARD.encode(cert);
            let status = serde_json::json!({"status": {"certificate": b64}});
            csrs.patch_status(&name, &pp, &Patch::Merge(&status))
                .await?;
            tracing::info!(csr = %name, %node, ?lifetime, "node certificate issued");
            Ok(Action::await_change())
        }
    }
}

/// The server lifetime the installation's CR asks for (KubeVirt's default without one).
async fn server_lifetime(client: &Client, namespace: &str) -> Result<Duration, kube::Error> {
    let kvs: Api<KubeVirt> = Api::namespaced(client.clone(), namespace);
    let mut list = kvs.list(&Default::default()).await?.items;
    list.sort_by_key(|k| k.metadata.creation_timestamp.clone().map(|t| t.0));
    let rotation = list
        .first()
        .and_then(|kv| Rotation::of(kv).ok())
        .unwrap_or_else(Rotation::default_rotation);
    Ok(rotation.server.duration)
}

pub fn error_policy(_: Arc<CertificateSigningRequest>, e: &SignerError, _: Arc<Signer>) -> Action {
    tracing::warn!(error = %e, "node certificate request");
    Action::requeue(Duration::from_secs(2))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::certificates::v1::CertificateSigningRequestSpec;
    use k8s_openapi::ByteString;

    fn csr(user: &str, node: Option<&str>, names: &[&str]) -> CertificateSigningRequest {
        let key = rcgen::KeyPair::generate().unwrap();
        let params =
            rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        let pem = params.serialize_request(&key).unwrap().pem().unwrap();
        CertificateSigningRequest {
            spec: CertificateSigningRequestSpec {
                request: ByteString(pem.into_bytes()),
                signer_name: NODE_CERTIFICATE_SIGNER.into(),
                username: Some(user.into()),
                extra: node.map(|n| [(NODE_NAME_EXTRA.to_string(), vec![n.to_string()])].into()),
                usages: Some(vec!["server auth".into(), "client auth".into()]),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    const HANDLER: &str = "system:serviceaccount:kubevirt:virt-handler";

    #[test]
    fn only_the_node_itself_gets_its_name() {
        let ok = judge(&csr(HANDLER, Some("node-a"), &["node-a"]), "kubevirt");
        let Verdict::Issue { node, request } = ok else {
            panic!("{ok:?}")
        };
        assert_eq!(node, "node-a");
        let ca = certs::new_ca(Duration::from_secs(3600)).unwrap();
        let pem = sign(&ca, &node, *request, Duration::from_secs(600)).unwrap();
        let (_, end) = certs::not_after(&pem)[0];
        let left = end.duration_since(std::time::SystemTime::now()).unwrap();
        assert!(
            left <= Duration::from_secs(600) && left > Duration::from_secs(590),
            "{left:?}"
        );

        for (c, why) in [
            (
                csr(HANDLER, Some("node-a"), &["node-b"]),
                "names [\"node-b\"]",
            ),
            (
                csr(HANDLER, Some("node-a"), &["node-a", "node-b"]),
                "names that node alone",
            ),
            (csr(HANDLER, None, &["node-a"]), "node-bound"),
            (
                csr(
                    "system:serviceaccount:default:tenant",
                    Some("node-a"),
                    &["node-a"],
                ),
                "only system:serviceaccount:kubevirt:virt-handler",
            ),
            (
                csr(
                    "system:serviceaccount:other:virt-handler",
                    Some("node-a"),
                    &["node-a"],
                ),
                "only system:serviceaccount:kubevirt:virt-handler",
            ),
        ] {
            match judge(&c, "kubevirt") {
                Verdict::Deny(m) => assert!(m.contains(why), "{m}"),
                v => panic!("{v:?}"),
            }
        }
        let mut forged = csr(HANDLER, Some("node-a"), &["node-a"]);
        forged.spec.request = ByteString(
            b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n"
                .to_vec(),
        );
        assert!(matches!(judge(&forged, "kubevirt"), Verdict::Deny(m) if m.contains("PKCS#10")));
        let mut other = csr(HANDLER, Some("node-a"), &["node-a"]);
        other.spec.signer_name = "kubernetes.io/kube-apiserver-client".into();
        assert!(matches!(judge(&other, "kubevirt"), Verdict::Skip));
    }
}
