//! Who is calling. virt-api is an aggregated API server: the Kubernetes API server
//! authenticates the user and forwards the request over TLS with its front-proxy client
//! certificate, naming the user in request headers (`X-Remote-User`, `X-Remote-Group`,
//! `X-Remote-Extra-*`). Those headers are believed only on a connection whose client
//! certificate chains to the request-header CA and carries an allowed name — anyone else
//! could write them. The CA, the names and the header names are what the API server publishes
//! in `kube-system/extension-apiserver-authentication`, read at start.

use std::collections::BTreeMap;

use controller_runtime::tls::PeerCertificate;
use http::HeaderMap;

use crate::status::SubresourceError;

/// Where the API server publishes its front-proxy settings.
pub const CONFIG_MAP_NAMESPACE: &str = "kube-system";
pub const CONFIG_MAP_NAME: &str = "extension-apiserver-authentication";

/// The request-header authentication settings (kube-apiserver's `--requestheader-*` flags).
#[derive(Clone, Debug, PartialEq)]
pub struct FrontProxy {
    /// PEM: the CA the front proxy's client certificate must chain to.
    pub client_ca: String,
    /// Common names the front proxy's certificate may carry; empty: any.
    pub allowed_names: Vec<String>,
    pub username_headers: Vec<String>,
    pub group_headers: Vec<String>,
    pub extra_headers_prefix: Vec<String>,
}

/// An authenticated user, as the API server named it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Identity {
    pub user: String,
    pub groups: Vec<String>,
    pub extra: BTreeMap<String, Vec<String>>,
}

fn json_list(data: &BTreeMap<String, String>, key: &str) -> Result<Vec<String>, String> {
    match data.get(key) {
        None => Ok(Vec::new()),
        Some(v) if v.trim().is_empty() => Ok(Vec::new()),
        Some(v) => serde_json::from_str(v).map_err(|e| {
            format!("{CONFIG_MAP_NAMESPACE}/{CONFIG_MAP_NAME} data.{key}: {e} (expected a JSON list of strings)")
        }),
    }
}

impl FrontProxy {
    /// The settings from the ConfigMap's data. Without a request-header CA the API server is
    /// not set up to front aggregated APIs, and virt-api cannot tell who calls.
    pub fn from_config_map(data: &BTreeMap<String, String>) -> Result<FrontProxy, String> {
        let client_ca = data
            .get("requestheader-client-ca-file")
            .filter(|v| !v.trim().is_empty())
            .cloned()
            .ok_or_else(|| format!(
                "{CONFIG_MAP_NAMESPACE}/{CONFIG_MAP_NAME} has no requestheader-client-ca-file: the API server runs without --requestheader-client-ca-file, so it cannot front aggregated APIs such as subresources.kubevirt.io"
            ))?;
        let or_default =
            |v: Vec<String>, d: &str| if v.is_empty() { vec![d.to_string()] } else { v };
        Ok(FrontProxy {
            client_ca,
            allowed_names: json_list(data, "requestheader-allowed-names")?,
            username_headers: or_default(
                json_list(data, "requestheader-username-headers")?,
                "X-Remote-User",
            ),
            group_headers: or_default(
                json_list(data, "requestheader-group-headers")?,
                "X-Remote-Group",
            ),
            extra_headers_prefix: or_default(
                json_list(data, "requestheader-extra-headers-prefix")?,
                "X-Remote-Extra-",
            ),
        })
    }

    /// The user a request comes from, or 401 when it did not come through the front proxy.
    pub fn identify(
        &self,
        peer: &PeerCertificate,
        headers: &HeaderMap,
    ) -> Result<Identity, SubresourceError> {
        let unauthorized = |why: String| SubresourceError::new(401, "Unauthorized", why);
        // The TLS layer only accepts a certificate that chains to the request-header CA.
        let Some(name) = peer.common_name() else {
            return Err(unauthorized(
                "Unauthorized: virt-api answers requests the Kubernetes API server forwards (with its front-proxy client certificate); call it through the API server".into(),
            ));
        };
        if !self.allowed_names.is_empty() && !self.allowed_names.contains(&name) {
            return Err(unauthorized(format!(
                "Unauthorized: client certificate {name:?} is not one of the front proxy's allowed names {:?}",
                self.allowed_names
            )));
        }
        let values = |h: &str| -> Vec<String> {
            headers
                .get_all(h)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .map(str::to_string)
                .collect()
        };
        let user = self
            .username_headers
            .iter()
            .find_map(|h| values(h).into_iter().find(|v| !v.is_empty()))
            .ok_or_else(|| {
                unauthorized(format!(
                    "Unauthorized: the front proxy named no user (headers {:?})",
                    self.username_headers
                ))
            })?;
        let groups = self.group_headers.iter().flat_map(|h| values(h)).collect();
        let mut extra: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (k, v) in headers {
            for prefix in &self.extra_headers_prefix {
                let key = k.as_str();
                if key.len() > prefix.len() && key[..prefix.len()].eq_ignore_ascii_case(prefix) {
                    if let Ok(v) = v.to_str() {
                        extra
                            .entry(key[prefix.len()..].to_ascii_lowercase())
                            .or_default()
                            .push(v.to_string());
                    }
                }
            }
        }
        Ok(Identity {
            user,
            groups,
            extra,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data() -> BTreeMap<String, String> {
        [
            ("requestheader-client-ca-file", "PEM"),
            ("requestheader-allowed-names", "[\"front-proxy-client\"]"),
            ("requestheader-username-headers", "[\"X-Remote-User\"]"),
            ("requestheader-group-headers", "[\"X-Remote-Group\"]"),
            (
                "requestheader-extra-headers-prefix",
                "[\"X-Remote-Extra-\"]",
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    #[test]
    fn settings_from_the_config_map() {
        let fp = FrontProxy::from_config_map(&data()).unwrap();
        assert_eq!(fp.allowed_names, ["front-proxy-client"]);
        assert_eq!(fp.group_headers, ["X-Remote-Group"]);
        let mut d = data();
        d.remove("requestheader-client-ca-file");
        let e = FrontProxy::from_config_map(&d).unwrap_err();
        assert!(e.contains("--requestheader-client-ca-file"), "{e}");
        let mut d = data();
        d.insert(
            "requestheader-allowed-names".into(),
            "front-proxy-client".into(),
        );
        let e = FrontProxy::from_config_map(&d).unwrap_err();
        assert!(e.contains("data.requestheader-allowed-names"), "{e}");
    }

    #[test]
    fn headers_are_not_believed_without_the_proxy_certificate() {
        let fp = FrontProxy::from_config_map(&data()).unwrap();
        let mut h = HeaderMap::new();
        h.insert("x-remote-user", "mallory".parse().unwrap());
        let e = fp.identify(&PeerCertificate(None), &h).unwrap_err();
        assert_eq!(e.code, 401);
        assert!(e.message.contains("through the API server"), "{e}");
    }
}
