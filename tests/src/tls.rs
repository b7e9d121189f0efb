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
