//! HTTPS serving for the cluster's own endpoints (virt-controller's admission webhook,
//! virt-api): serving certificates loaded from PEM or made self-signed, optional client
//! certificates verified against a CA, and an axum app served per connection with the
//! verified client's certificate at hand (`PeerCertificate`), for servers whose callers are
//! identified by their certificate (an aggregated API server behind the front proxy).

use std::path::Path;
use std::sync::Arc;

use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The verified client certificate of a connection (leaf only), when the client sent one.
#[derive(Clone, Debug, Default)]
pub struct PeerCertificate(pub Option<CertificateDer<'static>>);

impl PeerCertificate {
    /// Every name the certificate carries: its common name and its DNS names.
    pub fn names(&self) -> Vec<String> {
        let Some(der) = self.0.as_ref() else {
            return Vec::new();
        };
        let Ok((_, cert)) = x509_parser::parse_x509_certificate(der.as_ref()) else {
            return Vec::new();
        };
        let mut names: Vec<String> = cert
            .subject()
            .iter_common_name()
            .filter_map(|cn| cn.as_str().ok().map(str::to_string))
            .collect();
        if let Ok(Some(san)) = cert.subject_alternative_name() {
            for n in &san.value.general_names {
                if let x509_parser::extensions::GeneralName::DNSName(d) = n {
                    names.push(d.to_string());
                }
            }
        }
        names
    }

    /// The subject's common name, which Kubernetes takes as the client's name.
    pub fn common_name(&self) -> Option<String> {
        let der = self.0.as_ref()?;
        let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref()).ok()?;
        let cn = cert.subject().iter_common_name().next()?;
        cn.as_str().ok().map(str::to_string)
    }
}

/// The DNS names a Service `service` in `namespace` is reached by, for its certificate.
pub fn service_dns_names(service: &str, namespace: &str) -> Vec<String> {
    vec![
        service.to_string(),
        format!("{service}.{namespace}"),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ]
}

/// A serving certificate and key, as DER.
pub struct ServingCert {
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
}

impl ServingCert {
    /// A self-signed certificate for `dns_names`, and its PEM (the CA bundle to give clients:
    /// a webhook configuration's `caBundle`, an APIService's).
    pub fn self_signed(dns_names: Vec<String>) -> Result<(ServingCert, String), String> {
        let key = rcgen::KeyPair::generate().map_err(|e| e.to_string())?;
        let params = rcgen::CertificateParams::new(dns_names).map_err(|e| e.to_string())?;
        let cert = params.self_signed(&key).map_err(|e| e.to_string())?;
        let pem = cert.pem();
        let serving = ServingCert {
            chain: vec![cert.der().clone()],
            key: PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        };
        Ok((serving, pem))
    }

    /// A PEM certificate chain and key (e.g. from a cert-manager Secret).
    pub fn load_pem(cert: &Path, key: &Path) -> Result<ServingCert, String> {
        let read = |p: &Path| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
        let chain = rustls_pemfile::certs(&mut read(cert)?.as_slice())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("{}: {e}", cert.display()))?;
        if chain.is_empty() {
            return Err(format!("{}: no certificate found", cert.display()));
        }
        let key = rustls_pemfile::private_key(&mut read(key)?.as_slice())
            .map_err(|e| format!("{}: {e}", key.display()))?
            .ok_or_else(|| format!("{}: no private key found", key.display()))?;
        Ok(ServingCert { chain, key })
    }

    /// A rustls server configuration (ring, TLS 1.2 and 1.3). With `client_ca`, clients may
    /// present a certificate, which must chain to one of those CAs (a client that presents
    /// none is let in unidentified: what it may do is the app's decision).
    pub fn server_config(
        self,
        client_ca: Option<&str>,
    ) -> Result<Arc<rustls::ServerConfig>, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?;
        let builder = match client_ca {
            None => builder.with_no_client_auth(),
            Some(pem) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in rustls_pemfile::certs(&mut pem.as_bytes()) {
                    let c = c.map_err(|e| format!("client CA: {e}"))?;
                    roots.add(c).map_err(|e| format!("client CA: {e}"))?;
                }
                if roots.is_empty() {
                    return Err("client CA: no certificate in the bundle".into());
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .allow_unauthenticated()
                .build()
                .map_err(|e| format!("client CA: {e}"))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let cfg = builder
            .with_single_cert(self.chain, self.key)
            .map_err(|e| e.to_string())?;
        Ok(Arc::new(cfg))
    }
}

/// A new ECDSA P-256 key pair for signing tokens (ES256): the private key (PKCS#8 PEM) and
/// the public key (SPKI PEM).
pub fn signing_key_pair() -> (String, String) {
    let pair = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
        .expect("generating a P-256 key");
    (pair.serialize_pem(), pair.public_key_pem())
}

/// Serves `app` over TLS on `listener` until the process ends; each request carries the
/// connection's `PeerCertificate` as an extension.
pub async fn serve_tls(
    listener: tokio::net::TcpListener,
    tls: Arc<rustls::ServerConfig>,
    app: axum::Router,
) -> std::io::Result<()> {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    loop {
        let (tcp, peer) = listener.accept().await?;
        let acceptor = acceptor.clone();
        let app = app.clone();
        tokio::spawn(async move {
            let stream = match acceptor.accept(tcp).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
            };
            let leaf = stream
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .map(|c| c.clone().into_owned());
            let app = app.layer(axum::Extension(PeerCertificate(leaf)));
            let service = hyper_util::service::TowerToHyperService::new(app);
            let builder =
                hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
            if let Err(e) = builder
                .serve_connection_with_upgrades(hyper_util::rt::TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
}
