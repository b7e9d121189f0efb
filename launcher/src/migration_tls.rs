//! Mutual TLS around a migration stream (rustls, TLS 1.3): the target requires a client
//! certificate signed by the shared CA, the source checks the target's certificate against it
//! and `api::protocol::MIGRATION_TLS_NAME`. A peer with another CA never gets a byte of guest
//! memory.

use std::io::{Read, Write};
use std::sync::Arc;

use api::protocol::{MigrationTls, MIGRATION_TLS_NAME};
use rustls::pki_types::ServerName;

/// A migration byte stream: plain TCP or TLS over it.
pub trait Duplex: Read + Write + Send {}
impl<T: Read + Write + Send> Duplex for T {}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(tls: &MigrationTls) -> Result<rustls::RootCertStore, String> {
    let mut r = rustls::RootCertStore::empty();
    for c in tls.ca_certs()? {
        r.add(c).map_err(|e| format!("CA: {e}"))?;
    }
    Ok(r)
}

/// The target's end of an accepted connection.
pub fn server<S: Read + Write + Send + 'static>(
    tcp: S,
    tls: Option<&MigrationTls>,
) -> Result<Box<dyn Duplex>, String> {
    let Some(tls) = tls else {
        return Ok(Box::new(tcp));
    };
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots(tls)?),
        provider(),
    )
    .build()
    .map_err(|e| format!("client verifier: {e}"))?;
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_client_cert_verifier(verifier)
        .with_single_cert(tls.cert_chain()?, tls.private_key()?)
        .map_err(|e| format!("server certificate: {e}"))?;
    let conn = rustls::ServerConnection::new(Arc::new(config)).map_err(|e| e.to_string())?;
    Ok(Box::new(rustls::StreamOwned::new(conn, tcp)))
}

/// The source's end of a connection to the target.
pub fn client<S: Read + Write + Send + 'static>(
    tcp: S,
    tls: Option<&MigrationTls>,
) -> Result<Box<dyn Duplex>, String> {
    let Some(tls) = tls else {
        return Ok(Box::new(tcp));
    };
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots(tls)?)
        .with_client_auth_cert(tls.cert_chain()?, tls.private_key()?)
        .map_err(|e| format!("client certificate: {e}"))?;
    let name = ServerName::try_from(MIGRATION_TLS_NAME).expect("a valid DNS name");
    let conn = rustls::ClientConnection::new(Arc::new(config), name).map_err(|e| e.to_string())?;
    Ok(Box::new(rustls::StreamOwned::new(conn, tcp)))
}
