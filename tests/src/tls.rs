//! Migration certificates as a cluster holds them: one CA, and a certificate per node that
//! names the node (server and client use), each in a directory as `--migration-tls-dir` and
//! `--tls-dir` read it (`ca.crt`, `tls.crt`, `tls.key`).

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair};

/// A fresh CA; for each name a directory `base/<name>` with a certificate for that DNS name.
/// Returns the directories in `names` order.
pub fn write_dirs(base: &Path, names: &[&str]) -> Vec<PathBuf> {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    // Distinct subjects: with rcgen's default one on both, OpenSSL clients take the leaf for
    // a self-signed certificate.
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "microvirt test CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    names
        .iter()
        .map(|name| {
            let dir = base.join(name);
            std::fs::create_dir_all(&dir).unwrap();
            let key = KeyPair::generate().unwrap();
            let mut p = CertificateParams::new(vec![name.to_string()]).unwrap();
            p.distinguished_name
                .push(rcgen::DnType::CommonName, name.to_string());
            p.extended_key_usages = vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ];
            let cert = p.signed_by(&key, &issuer).unwrap();
            std::fs::write(dir.join("ca.crt"), ca.pem()).unwrap();
            std::fs::write(dir.join("tls.crt"), cert.pem()).unwrap();
            std::fs::write(dir.join("tls.key"), key.serialize_pem()).unwrap();
            dir
        })
        .collect()
}

/// Panics if `recorded` holds any piece of the private key in any of `dirs` (`tls.key`): a run
/// of 32 characters of its PEM base64, or of 16 bytes of its DER — whether the key went out as
/// PEM text, JSON-escaped PEM, or raw bytes. `what` names the recording.
pub fn assert_no_key_in(dirs: &[PathBuf], recorded: &[u8], what: &str) {
    use base64::Engine;
    for dir in dirs {
        let pem = std::fs::read_to_string(dir.join("tls.key")).unwrap();
        let body: String = pem
            .lines()
            .filter(|l| !l.starts_with("-----"))
            .collect::<Vec<_>>()
            .concat();
        let der = base64::engine::general_purpose::STANDARD
            .decode(&body)
            .unwrap();
        let contains = |needle: &[u8]| recorded.windows(needle.len()).any(|w| w == needle);
        for line in pem.lines().filter(|l| !l.starts_with("-----")) {
            for w in line.as_bytes().windows(32) {
                assert!(
                    !contains(w),
                    "{what} holds part of {}'s private key (PEM)",
                    dir.display()
                );
            }
        }
        for w in der.windows(16).step_by(4) {
            assert!(
                !contains(w),
                "{what} holds part of {}'s private key (DER)",
                dir.display()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The check finds a key sent as JSON-escaped PEM and as raw DER, and passes clean bytes.
    #[test]
    fn a_key_in_a_recording_is_found() {
        let base = std::env::temp_dir().join(format!("mv-keycheck-{}", std::process::id()));
        let dirs = write_dirs(&base, &["n1"]);
        let pem = std::fs::read_to_string(dirs[0].join("tls.key")).unwrap();
        let json = serde_json::to_vec(&serde_json::json!({"keyPem": pem})).unwrap();
        let der = rustls_pemfile::private_key(&mut pem.as_bytes())
            .unwrap()
            .unwrap()
            .secret_der()
            .to_vec();
        let mut raw = b"frame header".to_vec();
        raw.extend_from_slice(&der[8..40]);
        for leaked in [json, raw] {
            let r = std::panic::catch_unwind(|| assert_no_key_in(&dirs, &leaked, "recording"));
            assert!(r.is_err(), "a leaked key was not found");
        }
        assert_no_key_in(&dirs, b"{\"request\":\"status\"}\n", "recording");
        let _ = std::fs::remove_dir_all(base);
    }
}
