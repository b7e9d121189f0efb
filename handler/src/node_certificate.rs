//! This node's certificate for migrations and consoles, asked of the cluster instead of copied
//! onto the node by hand. virt-handler makes its key in memory (it never leaves the process),
//! asks virt-operator's signer ([`api::kubevirt::NODE_CERTIFICATE_SIGNER`]) for a certificate
//! naming its node through a CertificateSigningRequest, and asks again before it expires.
//!
//! Every handler runs under one service account, so the account alone cannot say which node
//! is asking; the API server stamps the request with the node its node-bound token was issued
//! for ([`api::kubevirt::NODE_NAME_EXTRA`]) and the signer issues only for that name — one
//! node's agent cannot obtain another node's identity.
//!
//! A new certificate replaces the old in the [`NodeIdentity`] every migration and console
//! connection reads when it starts; connections already established keep the session they
//! have, so a rotation in the middle of a migration does not touch it.

use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use api::protocol::MigrationTls;
use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestSpec,
};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::ByteString;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};

/// The CA bundle's ConfigMap and key in the install namespace (as virt-operator publishes it).
pub const CA_CONFIG_MAP: &str = "kubevirt-ca";
pub const CA_BUNDLE_KEY: &str = "ca-bundle";

#[derive(Debug, thiserror::Error)]
pub enum NodeCertificateError {
    #[error("making the key or certificate request: {0}")]
    Key(String),
    #[error("the API server: {0}")]
    Api(#[from] kube::Error),
    #[error("certificate request {name} was {verdict}: {reason}")]
    Refused {
        name: String,
        verdict: String,
        reason: String,
    },
    #[error("certificate request {0} was not signed within {1:?} (is virt-operator running?)")]
    NotSigned(String, Duration),
    #[error("no CA bundle in ConfigMap {namespace}/{CA_CONFIG_MAP} (key {CA_BUNDLE_KEY})")]
    NoBundle { namespace: String },
    #[error("the issued certificate: {0}")]
    Certificate(String),
}

/// The node's current certificate, key and CA bundle, replaced as a whole on renewal.
#[derive(Clone)]
pub struct NodeIdentity(Arc<RwLock<MigrationTls>>);

impl std::fmt::Debug for NodeIdentity {
    // The key stays out of logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NodeIdentity(..)")
    }
}

/// The node's current certificate as a TLS server presents it (the console server): rebuilt
/// on the first handshake after a renewal.
#[derive(Debug)]
pub struct ServedIdentity {
    identity: NodeIdentity,
    cached: std::sync::Mutex<Option<(String, Arc<tokio_rustls::rustls::sign::CertifiedKey>)>>,
}

impl ServedIdentity {
    pub fn new(identity: NodeIdentity) -> ServedIdentity {
        ServedIdentity {
            identity,
            cached: Default::default(),
        }
    }
}

impl tokio_rustls::rustls::server::ResolvesServerCert for ServedIdentity {
    fn resolve(
        &self,
        _: tokio_rustls::rustls::server::ClientHello<'_>,
    ) -> Option<Arc<tokio_rustls::rustls::sign::CertifiedKey>> {
        let tls = self.identity.current();
        let mut cached = self.cached.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((pem, key)) = cached.as_ref() {
            if *pem == tls.cert_pem {
                return Some(key.clone());
            }
        }
        let pair = controller_runtime::tls::ServingCert {
            chain: tls.cert_chain().ok()?,
            key: tls.private_key().ok()?,
        };
        let key = controller_runtime::tls::certified_key(pair).ok()?;
        *cached = Some((tls.cert_pem, key.clone()));
        Some(key)
    }
}

impl NodeIdentity {
    pub fn new(tls: MigrationTls) -> NodeIdentity {
        NodeIdentity(Arc::new(RwLock::new(tls)))
    }

    /// What a connection starting now uses.
    pub fn current(&self) -> MigrationTls {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn replace(&self, tls: MigrationTls) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = tls;
    }
}

/// Asks for and renews this node's certificate.
#[derive(Clone)]
pub struct CertificateRequester {
    pub client: Client,
    pub node: String,
    /// Where the CA bundle is published (virt-handler's own namespace).
    pub namespace: String,
    /// How long to wait for the signer.
    pub patience: Duration,
}

/// When a certificate received at `received` is to be replaced: with 20 % of its remaining
/// validity left (KubeVirt's share), counted from when it arrived — a signer back-dates
/// `notBefore` for clock skew, which must not make a short-lived certificate look older.
pub fn renewal_time(cert_pem: &str, received: SystemTime) -> Result<SystemTime, String> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(cert_pem.as_bytes())
        .map_err(|e| format!("not a PEM certificate: {e}"))?;
    let cert = pem
        .parse_x509()
        .map_err(|e| format!("not an X.509 certificate: {e}"))?;
    let at = |t: x509_parser::time::ASN1Time| {
        SystemTime::UNIX_EPOCH + Duration::from_secs(t.timestamp().max(0) as u64)
    };
    let start = at(cert.validity().not_before).max(received);
    let end = at(cert.validity().not_after);
    let life = end.duration_since(start).unwrap_or_default();
    Ok(start + life.mul_f64(0.8))
}

impl CertificateRequester {
    /// A new key, and a certificate for it naming this node, signed and returned with the
    /// CA bundle clients and servers are to trust.
    pub async fn request(&self) -> Result<MigrationTls, NodeCertificateError> {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
            .map_err(|e| NodeCertificateError::Key(e.to_string()))?;
        let mut params = rcgen::CertificateParams::new(vec![self.node.clone()])
            .map_err(|e| NodeCertificateError::Key(e.to_string()))?;
        params.distinguished_name.push(
            rcgen::DnType::CommonName,
            format!("kubevirt.io:system:node:{}", self.node),
        );
        let request = params
            .serialize_request(&key)
            .and_then(|r| r.pem())
            .map_err(|e| NodeCertificateError::Key(e.to_string()))?;
        let csrs: Api<CertificateSigningRequest> = Api::all(self.client.clone());
        let csr = CertificateSigningRequest {
            metadata: ObjectMeta {
                generate_name: Some(format!("virt-handler-{}-", self.node)),
                labels: Some([(api::labels::NODE_NAME.to_string(), self.node.clone())].into()),
                ..Default::default()
            },
            spec: CertificateSigningRequestSpec {
                request: ByteString(request.into_bytes()),
                signer_name: api::kubevirt::NODE_CERTIFICATE_SIGNER.into(),
                usages: Some(
                    ["digital signature", "server auth", "client auth"]
                        .map(String::from)
                        .into(),
                ),
                ..Default::default()
            },
            status: None,
        };
        let created = csrs.create(&PostParams::default(), &csr).await?;
        let name = created.metadata.name.unwrap_or_default();
        // The request stays as the record of what was issued to whom (the cluster's CSR
        // cleaner removes issued ones after an hour).
        let cert_pem = self.wait_signed(&csrs, &name).await?;
        Ok(MigrationTls {
            ca_pem: self.bundle().await?,
            cert_pem,
            key_pem: key.serialize_pem(),
        })
    }

    async fn wait_signed(
        &self,
        csrs: &Api<CertificateSigningRequest>,
        name: &str,
    ) -> Result<String, NodeCertificateError> {
        let deadline = tokio::time::Instant::now() + self.patience;
        loop {
            let csr = csrs.get(name).await?;
            let status = csr.status.unwrap_or_default();
            let refused = status
                .conditions
                .iter()
                .flatten()
                .find(|c| (c.type_ == "Denied" || c.type_ == "Failed") && c.status == "True");
            if let Some(c) = refused {
                return Err(NodeCertificateError::Refused {
                    name: name.to_string(),
                    verdict: c.type_.to_lowercase(),
                    reason: format!(
                        "{}: {}",
                        c.reason.as_deref().unwrap_or(""),
                        c.message.as_deref().unwrap_or("")
                    ),
                });
            }
            if let Some(cert) = status.certificate.filter(|c| !c.0.is_empty()) {
                return String::from_utf8(cert.0)
                    .map_err(|e| NodeCertificateError::Certificate(e.to_string()));
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(NodeCertificateError::NotSigned(
                    name.to_string(),
                    self.patience,
                ));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// The CA bundle as published now.
    pub async fn bundle(&self) -> Result<String, NodeCertificateError> {
        let cms: Api<ConfigMap> = Api::namespaced(self.client.clone(), &self.namespace);
        cms.get_opt(CA_CONFIG_MAP)
            .await?
            .and_then(|c| c.data?.get(CA_BUNDLE_KEY).cloned())
            .filter(|b| !b.is_empty())
            .ok_or_else(|| NodeCertificateError::NoBundle {
                namespace: self.namespace.clone(),
            })
    }

    /// The first certificate, asked for until it is issued (the operator may not have made
    /// its CA yet when the handler starts).
    pub async fn first(&self) -> NodeIdentity {
        let mut wait = Duration::from_secs(1);
        loop {
            match self.request().await {
                Ok(tls) => {
                    tracing::info!(node = %self.node, "node certificate issued");
                    return NodeIdentity::new(tls);
                }
                Err(e) => {
                    tracing::warn!(error = %e, retry_in = ?wait, "node certificate not issued yet");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(30));
                }
            }
        }
    }

    /// Keeps `identity` current for as long as the handler runs: a new certificate at its
    /// renewal time, and the CA bundle followed (a rotated CA is added before it signs
    /// anything, so peers' new certificates are trusted by the time they appear).
    pub async fn keep_renewed(self, identity: NodeIdentity) {
        const LOOK: Duration = Duration::from_secs(5);
        let mut received = SystemTime::now();
        loop {
            let current = identity.current();
            let due = renewal_time(&current.cert_pem, received).unwrap_or(received);
            let left = due
                .duration_since(SystemTime::now())
                .unwrap_or(Duration::ZERO);
            tokio::time::sleep(left.min(LOOK)).await;
            if SystemTime::now() >= due {
                match self.request().await {
                    Ok(tls) => {
                        tracing::info!(node = %self.node, "node certificate renewed");
                        identity.replace(tls);
                        received = SystemTime::now();
                    }
                    Err(e) => {
                        // Due already, so the next look would not wait: an API server that
                        // refuses at once must not be asked in a tight loop.
                        tracing::warn!(error = %e, retry_in = ?LOOK, "node certificate not renewed yet");
                        tokio::time::sleep(LOOK).await;
                    }
                }
            } else if let Ok(bundle) = self.bundle().await {
                if bundle != current.ca_pem {
                    tracing::info!("CA bundle changed");
                    identity.replace(MigrationTls {
                        ca_pem: bundle,
                        ..current
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewal_comes_at_four_fifths_of_the_validity() {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::new(vec!["node-a".to_string()]).unwrap();
        let start = time::OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap();
        p.not_before = start;
        p.not_after = start + time::Duration::seconds(1000);
        let cert = p.self_signed(&key).unwrap();
        let epoch = |s: u64| SystemTime::UNIX_EPOCH + Duration::from_secs(s);
        let at = renewal_time(&cert.pem(), epoch(1_700_000_000)).unwrap();
        assert_eq!(at, epoch(1_800_000_800));
        // Received after its start (a back-dated notBefore): 80 % of what was left then.
        let at = renewal_time(&cert.pem(), epoch(1_800_000_500)).unwrap();
        assert_eq!(at, epoch(1_800_000_900));
        assert!(renewal_time("not a certificate", epoch(0)).is_err());
    }
}
