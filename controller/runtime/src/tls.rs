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
        Self::from_pem(
            &read(cert)?,
            &cert.display().to_string(),
            &read(key)?,
            &key.display().to_string(),
        )
    }

    /// A PEM certificate chain and key held in memory; the names say where they came from.
    pub fn from_pem(
        cert: &[u8],
        cert_name: &str,
        key: &[u8],
        key_name: &str,
    ) -> Result<ServingCert, String> {
        let chain = rustls_pemfile::certs(&mut &cert[..])
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("{cert_name}: {e}"))?;
        if chain.is_empty() {
            return Err(format!("{cert_name}: no certificate found"));
        }
        let key = rustls_pemfile::private_key(&mut &key[..])
            .map_err(|e| format!("{key_name}: {e}"))?
            .ok_or_else(|| format!("{key_name}: no private key found"))?;
        Ok(ServingCert { chain, key })
    }

    /// A rustls server configuration (ring, TLS 1.2 and 1.3). With `client_ca`, clients may
    /// present a certificate, which must chain to one of those CAs (a client that presents
    /// none is let in unidentified: what it may do is the app's decision).
    pub fn server_config(
        self,
        client_ca: Option<&str>,
    ) -> Result<Arc<rustls::ServerConfig>, String> {
        let cfg = server_builder(client_ca)?
            .with_single_cert(self.chain, self.key)
            .map_err(|e| e.to_string())?;
        Ok(Arc::new(cfg))
    }
}

/// As [`ServingCert::server_config`], with the certificate and key read from PEM files and
/// read again when they change: the operator rotates serving certificates by replacing a
/// Secret, and the kubelet swaps the mounted files; new connections get the new pair with no
/// restart (established ones keep theirs).
pub fn reloading_server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&str>,
) -> Result<Arc<rustls::ServerConfig>, String> {
    let resolver = ReloadingCert::new(cert, key)?;
    let cfg = server_builder(client_ca)?.with_cert_resolver(Arc::new(resolver));
    Ok(Arc::new(cfg))
}

/// A server configuration whose certificate `resolver` picks at each handshake (a pair that
/// is renewed in memory), clients checked against `client_ca` as in
/// [`ServingCert::server_config`].
pub fn server_config_with(
    resolver: Arc<dyn rustls::server::ResolvesServerCert>,
    client_ca: Option<&str>,
) -> Result<Arc<rustls::ServerConfig>, String> {
    Ok(Arc::new(
        server_builder(client_ca)?.with_cert_resolver(resolver),
    ))
}

/// A client CA read again whenever it changes (a mounted ConfigMap the kubelet refreshes when
/// the operator rotates its CA): clients are checked against the bundle as it is when they
/// connect; one that presents no certificate is let in unidentified, as with
/// [`ServingCert::server_config`]'s `client_ca`. A bundle that cannot be read or parsed leaves
/// the last good one in force.
pub struct FollowedClientCa {
    read: Box<dyn Fn() -> Option<String> + Send + Sync>,
    cached: std::sync::Mutex<Option<(String, Arc<dyn rustls::server::danger::ClientCertVerifier>)>>,
}

impl std::fmt::Debug for FollowedClientCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FollowedClientCa")
    }
}

impl FollowedClientCa {
    /// Follows the PEM `read` returns; fails when there is none to start with.
    pub fn new(
        read: impl Fn() -> Option<String> + Send + Sync + 'static,
    ) -> Result<FollowedClientCa, String> {
        let f = FollowedClientCa {
            read: Box::new(read),
            cached: Default::default(),
        };
        f.current().map(|_| f)
    }

    fn current(&self) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>, String> {
        let mut cached = self.cached.lock().unwrap_or_else(|e| e.into_inner());
        let pem = (self.read)();
        if let (Some(pem), Some((seen, v))) = (&pem, cached.as_ref()) {
            if pem == seen {
                return Ok(v.clone());
            }
        }
        let built = pem
            .as_deref()
            .ok_or_else(|| "client CA: nothing to read".to_string())
            .and_then(client_verifier);
        match (built, cached.as_ref()) {
            (Ok(v), _) => {
                *cached = Some((pem.unwrap_or_default(), v.clone()));
                Ok(v)
            }
            (Err(e), Some((_, v))) => {
                tracing::warn!(error = %e, "client CA not reloaded");
                Ok(v.clone())
            }
            (Err(e), None) => Err(e),
        }
    }

    /// The verifier for this connection (the last good one if the bundle just broke).
    fn verifier(&self) -> Arc<dyn rustls::server::danger::ClientCertVerifier> {
        self.current()
            .unwrap_or_else(|_| Arc::new(rustls::server::NoClientAuth))
    }
}

fn client_verifier(
    pem: &str,
) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>, String> {
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pemfile::certs(&mut pem.as_bytes()) {
        let c = c.map_err(|e| format!("client CA: {e}"))?;
        roots.add(c).map_err(|e| format!("client CA: {e}"))?;
    }
    if roots.is_empty() {
        return Err("client CA: no certificate in the bundle".into());
    }
    rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
        .allow_unauthenticated()
        .build()
        .map_err(|e| format!("client CA: {e}"))
}

impl rustls::server::danger::ClientCertVerifier for FollowedClientCa {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        // Hints are optional; the bundle may change under a borrowed slice.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        self.verifier()
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.verifier().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.verifier().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.verifier().supported_verify_schemes()
    }
}

/// A server configuration with both ends followed: the certificate `resolver` picks, clients
/// checked against the client CA as it is when they connect.
pub fn server_config_following(
    resolver: Arc<dyn rustls::server::ResolvesServerCert>,
    client_ca: Arc<FollowedClientCa>,
) -> Result<Arc<rustls::ServerConfig>, String> {
    let cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_client_cert_verifier(client_ca)
        .with_cert_resolver(resolver);
    Ok(Arc::new(cfg))
}

/// A signing key for rustls from its DER.
pub fn certified_key(pair: ServingCert) -> Result<Arc<rustls::sign::CertifiedKey>, String> {
    let signing = provider()
        .key_provider
        .load_private_key(pair.key)
        .map_err(|e| format!("serving key: {e}"))?;
    Ok(Arc::new(rustls::sign::CertifiedKey::new(
        pair.chain, signing,
    )))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn server_builder(
    client_ca: Option<&str>,
) -> Result<rustls::ConfigBuilder<rustls::ServerConfig, rustls::server::WantsServerCert>, String> {
    let provider = provider();
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let Some(pem) = client_ca else {
        return Ok(builder.with_no_client_auth());
    };
    let verifier = client_verifier(pem)?;
    Ok(builder.with_client_cert_verifier(verifier))
}

/// How often the files behind a [`ReloadingCert`] are looked at (on a handshake, at most).
const RELOAD_CHECK: std::time::Duration = std::time::Duration::from_secs(1);

/// A serving certificate that follows its files (see [`reloading_server_config`]). A pair
/// that does not load (a key and a certificate caught mid-swap) is ignored until the next
/// look; the last good pair keeps serving.
#[derive(Debug)]
struct ReloadingCert {
    cert: std::path::PathBuf,
    key: std::path::PathBuf,
    state: std::sync::Mutex<Loaded>,
}

#[derive(Debug)]
struct Loaded {
    checked: std::time::Instant,
    /// The files' modification times when `current` was read.
    stamp: Option<(std::time::SystemTime, std::time::SystemTime)>,
    current: Arc<rustls::sign::CertifiedKey>,
}

impl ReloadingCert {
    fn new(cert: &Path, key: &Path) -> Result<ReloadingCert, String> {
        let current = Self::load(cert, key)?;
        Ok(ReloadingCert {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            state: std::sync::Mutex::new(Loaded {
                checked: std::time::Instant::now(),
                stamp: Self::stamp(cert, key),
                current,
            }),
        })
    }

    fn stamp(cert: &Path, key: &Path) -> Option<(std::time::SystemTime, std::time::SystemTime)> {
        let m = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        Some((m(cert)?, m(key)?))
    }

    fn load(cert: &Path, key: &Path) -> Result<Arc<rustls::sign::CertifiedKey>, String> {
        let pair = ServingCert::load_pem(cert, key)?;
        let signing = provider()
            .key_provider
            .load_private_key(pair.key)
            .map_err(|e| format!("{}: {e}", key.display()))?;
        Ok(Arc::new(rustls::sign::CertifiedKey::new(
            pair.chain, signing,
        )))
    }
}

impl ReloadingCert {
    /// The newest pair that loads, looking at the files at most every [`RELOAD_CHECK`].
    fn current(&self) -> Arc<rustls::sign::CertifiedKey> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.checked.elapsed() >= RELOAD_CHECK {
            state.checked = std::time::Instant::now();
            let stamp = Self::stamp(&self.cert, &self.key);
            if stamp.is_some() && stamp != state.stamp {
                match Self::load(&self.cert, &self.key) {
                    Ok(k) => {
                        tracing::info!(cert = %self.cert.display(), "serving certificate reloaded");
                        state.current = k;
                        state.stamp = stamp;
                    }
                    Err(e) => tracing::warn!(error = %e, "serving certificate not reloaded"),
                }
            }
        }
        state.current.clone()
    }
}

impl rustls::server::ResolvesServerCert for ReloadingCert {
    fn resolve(
        &self,
        _: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.current())
    }
}

/// A serving certificate held in memory and replaced at will, for a server that reads its
/// pair from an object itself rather than from mounted files (virt-operator's webhook serves
/// the certificate it issues into a Secret, which exists only after it first runs). Until a
/// pair is set, handshakes fail: callers see the server as unavailable, not as trusted.
#[derive(Debug, Default)]
pub struct SwappableCert(std::sync::RwLock<Option<Arc<rustls::sign::CertifiedKey>>>);

impl SwappableCert {
    /// Serves `pair` on new connections from now on.
    pub fn set(&self, pair: ServingCert) -> Result<(), String> {
        let key = certified_key(pair)?;
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = Some(key);
        Ok(())
    }

    /// A server configuration that serves whatever pair is set when a client connects.
    pub fn server_config(self: &Arc<Self>) -> Result<Arc<rustls::ServerConfig>, String> {
        server_config_with(self.clone(), None)
    }
}

impl rustls::server::ResolvesServerCert for SwappableCert {
    fn resolve(
        &self,
        _: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn write_pair(dir: &Path, name: &str) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec![name.to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        std::fs::write(dir.join("tls.crt"), cert.pem()).unwrap();
        std::fs::write(dir.join("tls.key"), key.serialize_pem()).unwrap();
        cert.der().to_vec()
    }

    #[test]
    fn a_replaced_pair_is_served_from_the_next_look_and_a_broken_one_never() {
        let dir = std::env::temp_dir().join(format!("mv-reload-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let first = write_pair(&dir, "first.example");
        let r = ReloadingCert::new(&dir.join("tls.crt"), &dir.join("tls.key")).unwrap();
        assert_eq!(r.current().cert[0].as_ref(), first.as_slice());
        std::thread::sleep(RELOAD_CHECK + std::time::Duration::from_millis(100));
        let second = write_pair(&dir, "second.example");
        // The files' timestamps may share a coarse tick with the first pair's: look until the
        // change is seen, within a few checks.
        let deadline = std::time::Instant::now() + RELOAD_CHECK * 5;
        while r.current().cert[0].as_ref() != second.as_slice() {
            assert!(
                std::time::Instant::now() < deadline,
                "the new pair is never served"
            );
            std::thread::sleep(std::time::Duration::from_millis(200));
            let _ = std::fs::write(
                dir.join("tls.crt"),
                std::fs::read(dir.join("tls.crt")).unwrap(),
            );
        }
        std::fs::write(dir.join("tls.key"), "not a key").unwrap();
        std::thread::sleep(RELOAD_CHECK + std::time::Duration::from_millis(100));
        assert_eq!(r.current().cert[0].as_ref(), second.as_slice());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
