//! The installation's certificates, made and rotated by the operator as KubeVirt's does: a
//! self-signed CA (Secret `kubevirt-ca`, its bundle in ConfigMap `kubevirt-ca` under
//! `ca-bundle`) and a serving certificate per endpoint the API server calls (the admission
//! webhook, virt-api), each in a Secret the component mounts and reloads when it changes.
//! Lifetimes come from `spec.certificateRotateStrategy.selfSigned` (KubeVirt's defaults: CA
//! 7 days, servers 1 day, renewed when 20 % of the lifetime is left). A replaced CA stays in
//! the bundle until it expires, so certificates it signed stay trusted while they are swapped.

use std::time::{Duration, SystemTime};

use api::kubevirt::{labels, KubeVirt};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::ByteString;
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde::Deserialize;

use api::duration::parse_duration;

/// The CA's Secret and ConfigMap.
pub const CA_NAME: &str = "kubevirt-ca";
/// The bundle's key in the ConfigMap, as KubeVirt names it.
pub const CA_BUNDLE_KEY: &str = "ca-bundle";
const FIELD_MANAGER: &str = "virt-operator";

/// A serving certificate the operator keeps: its Secret, and the Service it is for.
pub struct Served {
    pub secret: &'static str,
    pub service: &'static str,
}

/// The endpoints the API server calls, which need a certificate it trusts.
pub const SERVED: [Served; 3] = [
    Served {
        secret: "virt-controller-certs",
        service: "virt-controller-webhook",
    },
    Served {
        secret: "virt-api-certs",
        service: "virt-api",
    },
    Served {
        secret: crate::webhook::SECRET,
        service: "kubevirt-operator-webhook",
    },
];

/// virt-api's client certificate for the handlers' console servers (its Secret, and the
/// common name the handlers accept, `--api-client-name`).
pub const API_CLIENT: (&str, &str) = ("virt-api-handler-client", "virt-api");

/// ConfigMaps (key `ca.crt`) that carry the bundle to components reading a CA file: the
/// handlers check virt-api's client certificate against the first, virt-api the nodes'
/// certificates against the second.
pub const CA_FILES: [&str; 2] = ["virt-api-client-ca", "microvirt-node-ca"];

/// How long a certificate lives, and how long before its end it is replaced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifetime {
    pub duration: Duration,
    pub renew_before: Duration,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rotation {
    pub ca: Lifetime,
    pub server: Lifetime,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Strategy {
    self_signed: Option<SelfSigned>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct SelfSigned {
    ca: Option<LifetimeFields>,
    server: Option<LifetimeFields>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct LifetimeFields {
    duration: Option<String>,
    renew_before: Option<String>,
}

impl Rotation {
    /// KubeVirt's defaults: CA 7 days, servers 1 day, each renewed with 20 % left.
    pub fn default_rotation() -> Rotation {
        let day = Duration::from_secs(24 * 3600);
        Rotation {
            ca: Lifetime {
                duration: 7 * day,
                renew_before: 7 * day / 5,
            },
            server: Lifetime {
                duration: day,
                renew_before: day / 5,
            },
        }
    }

    /// The CR's rotation, or why it cannot be taken (by path).
    pub fn of(kv: &KubeVirt) -> Result<Rotation, String> {
        const PATH: &str = "spec.certificateRotateStrategy";
        let s: Strategy = match &kv.spec.certificate_rotate_strategy {
            Some(v) => serde_json::from_value(v.clone()).map_err(|e| format!("{PATH}: {e}"))?,
            None => Strategy::default(),
        };
        let s = s.self_signed.unwrap_or_default();
        let lifetime = |f: Option<LifetimeFields>, which: &str, default: Duration| {
            let f = f.unwrap_or_default();
            let path = format!("{PATH}.selfSigned.{which}");
            let parse = |v: &Option<String>, field: &str| -> Result<Option<Duration>, String> {
                v.as_deref()
                    .map(|t| {
                        parse_duration(t).filter(|d| !d.is_zero()).ok_or_else(|| {
                            format!("{path}.{field}: {t:?} is not a duration like 24h or 30m")
                        })
                    })
                    .transpose()
            };
            let duration = parse(&f.duration, "duration")?.unwrap_or(default);
            let renew_before = parse(&f.renew_before, "renewBefore")?.unwrap_or(duration / 5);
            if renew_before >= duration {
                return Err(format!(
                    "{path}.renewBefore: must be shorter than the duration"
                ));
            }
            Ok(Lifetime {
                duration,
                renew_before,
            })
        };
        Ok(Rotation {
            ca: lifetime(s.ca, "ca", Duration::from_secs(7 * 24 * 3600))?,
            server: lifetime(s.server, "server", Duration::from_secs(24 * 3600))?,
        })
    }
}

/// A PEM certificate and its key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pair {
    pub cert: String,
    pub key: String,
}

pub fn validity(params: &mut rcgen::CertificateParams, lifetime: Duration) {
    let now = time::OffsetDateTime::now_utc();
    // A minute back: clocks across the cluster differ a little.
    params.not_before = now - time::Duration::minutes(1);
    params.not_after = now + time::Duration::try_from(lifetime).unwrap_or(time::Duration::DAY);
}

/// A new self-signed ECDSA P-256 CA.
pub fn new_ca(lifetime: Duration) -> Result<Pair, String> {
    let key = rcgen::KeyPair::generate().map_err(|e| e.to_string())?;
    let mut params =
        rcgen::CertificateParams::new(Vec::<String>::new()).map_err(|e| e.to_string())?;
    params.distinguished_name.push(
        rcgen::DnType::CommonName,
        format!("kubevirt.io@{}", now_secs()),
    );
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    validity(&mut params, lifetime);
    let cert = params.self_signed(&key).map_err(|e| e.to_string())?;
    Ok(Pair {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// A client certificate with common name `cn`, signed by `ca`.
pub fn issue_client(ca: &Pair, cn: &str, lifetime: Duration) -> Result<Pair, String> {
    let mut params =
        rcgen::CertificateParams::new(Vec::<String>::new()).map_err(|e| e.to_string())?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, cn.to_string());
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    sign_new_key(ca, params, lifetime)
}

/// A serving certificate for `dns_names`, signed by `ca`.
pub fn issue(ca: &Pair, dns_names: Vec<String>, lifetime: Duration) -> Result<Pair, String> {
    let mut params = rcgen::CertificateParams::new(dns_names.clone()).map_err(|e| e.to_string())?;
    if let Some(first) = dns_names.first() {
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, first.clone());
    }
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    sign_new_key(ca, params, lifetime)
}

/// `ca` as the signer of new certificates.
pub fn ca_issuer(ca: &Pair) -> Result<rcgen::Issuer<'static, rcgen::KeyPair>, String> {
    let ca_key = rcgen::KeyPair::from_pem(&ca.key).map_err(|e| format!("the CA key: {e}"))?;
    rcgen::Issuer::from_ca_cert_pem(&ca.cert, ca_key)
        .map_err(|e| format!("the CA certificate: {e}"))
}

/// A new key, and `params` for it signed by `ca` for `lifetime`.
fn sign_new_key(
    ca: &Pair,
    mut params: rcgen::CertificateParams,
    lifetime: Duration,
) -> Result<Pair, String> {
    let issuer = ca_issuer(ca)?;
    let key = rcgen::KeyPair::generate().map_err(|e| e.to_string())?;
    validity(&mut params, lifetime);
    let cert = params.signed_by(&key, &issuer).map_err(|e| e.to_string())?;
    Ok(Pair {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// When each certificate in a PEM bundle expires, in order (unparseable ones left out).
pub fn not_after(pem: &str) -> Vec<(String, SystemTime)> {
    let mut out = Vec::new();
    for der in rustls_pemfile::certs(&mut pem.as_bytes()).flatten() {
        let Ok((_, cert)) = x509_parser::parse_x509_certificate(der.as_ref()) else {
            continue;
        };
        let end = cert.validity().not_after.timestamp();
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(end.max(0) as u64);
        let block = pem_block(der.as_ref());
        out.push((block, at));
    }
    out
}

fn pem_block(der: &[u8]) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).unwrap_or_default());
        out.push('\n');
    }
    out.push_str("-----END CERTIFICATE-----\n");
    out
}

/// When `cert` (its first certificate) is to be replaced; `None` when it cannot be read (so
/// it is replaced now).
pub fn renew_at(cert: &str, lifetime: &Lifetime) -> Option<SystemTime> {
    let (_, end) = not_after(cert).into_iter().next()?;
    end.checked_sub(lifetime.renew_before)
}

/// The CA bundle: the current CA first, then the earlier ones from `previous` that have not
/// expired yet (certificates they signed are still being served until replaced).
pub fn bundle(current: &str, previous: &str, now: SystemTime) -> String {
    let current_blocks: Vec<String> = not_after(current).into_iter().map(|(b, _)| b).collect();
    let mut out: String = current_blocks.concat();
    for (block, end) in not_after(previous) {
        if end > now && !current_blocks.contains(&block) {
            out.push_str(&block);
        }
    }
    out
}

/// The certificates as they are after this pass, and when the next one is due.
pub struct Issued {
    /// The CA bundle clients are to trust (PEM).
    pub bundle: String,
    /// The earliest time a certificate is to be replaced.
    pub next_renewal: SystemTime,
}

fn data_str(s: &Secret, key: &str) -> Option<String> {
    let v = s.data.as_ref()?.get(key)?;
    String::from_utf8(v.0.clone()).ok()
}

/// The installation's CA as stored, if it has been made.
pub async fn current_ca(client: &Client, namespace: &str) -> Result<Option<Pair>, kube::Error> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    Ok(secrets.get_opt(CA_NAME).await?.and_then(|s| {
        Some(Pair {
            cert: data_str(&s, "tls.crt")?,
            key: data_str(&s, "tls.key")?,
        })
    }))
}

/// Makes what is missing, replaces what is due, and publishes the bundle.
pub async fn ensure(
    client: &Client,
    kv: &KubeVirt,
    rotation: &Rotation,
) -> Result<Issued, kube::Error> {
    let ns = kv.namespace().unwrap_or_default();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let now = SystemTime::now();
    let stored = secrets.get_opt(CA_NAME).await?;
    let stored = stored.and_then(|s| {
        Some(Pair {
            cert: data_str(&s, "tls.crt")?,
            key: data_str(&s, "tls.key")?,
        })
    });
    let ca = match stored {
        Some(p) if renew_at(&p.cert, &rotation.ca).is_some_and(|t| t > now) => p,
        _ => {
            let p = new_ca(rotation.ca.duration).map_err(internal)?;
            tracing::info!("issued a new CA");
            apply_secret(&secrets, CA_NAME, &p, None).await?;
            p
        }
    };
    let previous = configmaps
        .get_opt(CA_NAME)
        .await?
        .and_then(|c| c.data?.get(CA_BUNDLE_KEY).cloned())
        .unwrap_or_default();
    let bundle = bundle(&ca.cert, &previous, now);
    // The bundle where each reader looks for it: KubeVirt's ConfigMap, and the `ca.crt` files
    // of the handlers and virt-api. Applied every pass (a no-op when unchanged), so one that
    // went missing comes back.
    let published = [(CA_NAME, CA_BUNDLE_KEY)]
        .into_iter()
        .chain(CA_FILES.map(|n| (n, "ca.crt")));
    for (name, key) in published {
        let cm = serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": ns, "labels": managed()},
            "data": {key: bundle},
        });
        configmaps
            .patch(
                name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&cm),
            )
            .await?;
    }
    let mut next_renewal = renew_at(&ca.cert, &rotation.ca).unwrap_or(now);
    let (client_secret, cn) = API_CLIENT;
    let due = ensure_leaf(&secrets, client_secret, &ca, rotation, now, || {
        issue_client(&ca, cn, rotation.server.duration)
    })
    .await?;
    next_renewal = next_renewal.min(due);
    for s in &SERVED {
        let due = ensure_leaf(&secrets, s.secret, &ca, rotation, now, || {
            let names = controller_runtime::tls::service_dns_names(s.service, &ns);
            issue(&ca, names, rotation.server.duration)
        })
        .await?;
        next_renewal = next_renewal.min(due);
    }
    Ok(Issued {
        bundle,
        next_renewal,
    })
}

/// One certificate the CA signs (a serving certificate, virt-api's client certificate) in its
/// Secret: issued anew when missing, due, or signed by a replaced CA; returns when it is next due.
async fn ensure_leaf(
    secrets: &Api<Secret>,
    secret: &str,
    ca: &Pair,
    rotation: &Rotation,
    now: SystemTime,
    issue_new: impl FnOnce() -> Result<Pair, String>,
) -> Result<SystemTime, kube::Error> {
    let current = secrets.get_opt(secret).await?;
    let signed_by_ca =
        current.as_ref().and_then(|c| data_str(c, "ca.crt")) == Some(ca.cert.clone());
    let renew = current
        .as_ref()
        .and_then(|c| data_str(c, "tls.crt"))
        .and_then(|c| renew_at(&c, &rotation.server));
    match renew {
        Some(at) if at > now && signed_by_ca => Ok(at),
        _ => {
            let pair = issue_new().map_err(internal)?;
            apply_secret(secrets, secret, &pair, Some(&ca.cert)).await?;
            tracing::info!(secret, "issued a certificate");
            Ok(renew_at(&pair.cert, &rotation.server).unwrap_or(now))
        }
    }
}

/// Removes the CA and every serving certificate (uninstall).
pub async fn remove(client: &Client, ns: &str) -> Result<(), kube::Error> {
    use controller_runtime::delete_if_present;
    let dp = Default::default();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    for name in SERVED
        .iter()
        .map(|s| s.secret)
        .chain([CA_NAME, API_CLIENT.0])
    {
        delete_if_present(&secrets, name, &dp).await?;
    }
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    for name in CA_FILES.into_iter().chain([CA_NAME]) {
        delete_if_present(&configmaps, name, &dp).await?;
    }
    Ok(())
}

fn managed() -> serde_json::Value {
    serde_json::json!({labels::MANAGED_BY: labels::MANAGED_BY_OPERATOR})
}

async fn apply_secret(
    secrets: &Api<Secret>,
    name: &str,
    pair: &Pair,
    ca: Option<&str>,
) -> Result<(), kube::Error> {
    let mut data = serde_json::Map::new();
    let b = |s: &str| serde_json::to_value(ByteString(s.as_bytes().to_vec())).unwrap_or_default();
    data.insert("tls.crt".into(), b(&pair.cert));
    data.insert("tls.key".into(), b(&pair.key));
    if let Some(ca) = ca {
        data.insert("ca.crt".into(), b(ca));
    }
    let secret = serde_json::json!({
        "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
        "metadata": {"name": name, "labels": managed()},
        "data": data,
    });
    secrets
        .patch(
            name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&secret),
        )
        .await?;
    Ok(())
}

fn internal(why: String) -> kube::Error {
    kube::Error::Service(why.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issued_certificates_chain_to_the_ca_and_are_due_at_renew_before() {
        let ca = new_ca(Duration::from_secs(3600)).unwrap();
        let served = issue(
            &ca,
            vec!["virt-api.kubevirt.svc".into()],
            Duration::from_secs(100),
        )
        .unwrap();
        let (_, cert) = x509_parser::pem::parse_x509_pem(served.cert.as_bytes()).unwrap();
        let cert = cert.parse_x509().unwrap();
        let (_, ca_pem) = x509_parser::pem::parse_x509_pem(ca.cert.as_bytes()).unwrap();
        let ca_cert = ca_pem.parse_x509().unwrap();
        assert_eq!(cert.issuer(), ca_cert.subject());
        let lifetime = Lifetime {
            duration: Duration::from_secs(100),
            renew_before: Duration::from_secs(20),
        };
        let at = renew_at(&served.cert, &lifetime).unwrap();
        let left = at.duration_since(SystemTime::now()).unwrap();
        assert!(
            left > Duration::from_secs(70) && left <= Duration::from_secs(80),
            "{left:?}"
        );
        assert_eq!(renew_at("garbage", &lifetime), None);
    }

    #[test]
    fn a_replaced_ca_stays_in_the_bundle_until_it_expires() {
        let old = new_ca(Duration::from_secs(3600)).unwrap();
        let new = new_ca(Duration::from_secs(3600)).unwrap();
        let now = SystemTime::now();
        let b = bundle(&new.cert, &bundle(&old.cert, "", now), now);
        assert_eq!(not_after(&b).len(), 2);
        assert!(b.starts_with(&not_after(&new.cert)[0].0));
        // Once the old one has expired it goes.
        let later = now + Duration::from_secs(7200);
        let b = bundle(&new.cert, &b, later);
        assert_eq!(not_after(&b).len(), 1);
        // The same CA is not listed twice.
        assert_eq!(not_after(&bundle(&new.cert, &new.cert, now)).len(), 1);
    }

    #[test]
    fn rotation_from_the_cr_with_defaults_and_refusals() {
        let kv = |v: serde_json::Value| {
            let mut kv = KubeVirt::new("kubevirt", Default::default());
            kv.spec.certificate_rotate_strategy = Some(v);
            kv
        };
        let r = Rotation::of(&kv(serde_json::json!({}))).unwrap();
        assert_eq!(r.ca.duration, Duration::from_secs(7 * 86400));
        assert_eq!(r.server.renew_before, Duration::from_secs(86400 / 5));
        let r = Rotation::of(&kv(serde_json::json!({"selfSigned": {"server": {"duration": "30s", "renewBefore": "10s"}}})))
            .unwrap();
        assert_eq!(
            r.server,
            Lifetime {
                duration: Duration::from_secs(30),
                renew_before: Duration::from_secs(10)
            }
        );
        for bad in [
            serde_json::json!({"selfSigned": {"ca": {"duration": "soon"}}}),
            serde_json::json!({"selfSigned": {"server": {"duration": "1h", "renewBefore": "2h"}}}),
        ] {
            let err = Rotation::of(&kv(bad)).unwrap_err();
            assert!(
                err.contains("spec.certificateRotateStrategy.selfSigned"),
                "{err}"
            );
        }
    }
}
