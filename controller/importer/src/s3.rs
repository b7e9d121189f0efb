//! An S3 object as CDI's `s3` source names it — `https://ENDPOINT/BUCKET/KEY` (path style,
//! any S3-compatible endpoint) or AWS's virtual-hosted `https://BUCKET.s3.REGION.amazonaws.com/KEY`
//! — and its GET signed with AWS Signature V4 in the `Authorization` header, as CDI's AWS SDK
//! signs it. The signing is AWS's own `aws-sigv4` crate (sans-IO: it gives the headers; the
//! importer's HTTP client sends them, with the same TLS and progress as `http`).

use std::time::SystemTime;

use aws_sigv4::http_request::{
    sign, PayloadChecksumKind, PercentEncodingMode, SignableBody, SignableRequest, SigningSettings,
    UriPathNormalizationMode,
};
use aws_sigv4::sign::v4;
use url::Url;

use crate::{ImportError, Result};

/// The region when the endpoint does not say (AWS's default; other servers ignore it).
const DEFAULT_REGION: &str = "us-east-1";

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct S3Object {
    /// The endpoint's base URL (scheme, host, port).
    pub endpoint: Url,
    pub bucket: String,
    pub key: String,
    pub region: String,
    pub style: Style,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Style {
    Path,
    VirtualHost,
}

fn bad(url: &str, why: &str) -> ImportError {
    ImportError::Format(format!(
        "s3 URL {url:?}: {why}; accepted: https://ENDPOINT/BUCKET/KEY or https://BUCKET.s3.REGION.amazonaws.com/KEY"
    ))
}

impl S3Object {
    pub fn parse(url: &str) -> Result<S3Object> {
        let u = Url::parse(url).map_err(|e| bad(url, &e.to_string()))?;
        if !matches!(u.scheme(), "http" | "https") {
            return Err(bad(url, "the scheme must be http or https"));
        }
        let host = u.host_str().ok_or_else(|| bad(url, "no host"))?.to_string();
        let path = u.path().trim_start_matches('/').to_string();
        // AWS: BUCKET.s3.REGION.amazonaws.com or s3.REGION.amazonaws.com (and s3.amazonaws.com).
        let aws = host.strip_suffix(".amazonaws.com");
        let region_of = |rest: &str| {
            rest.strip_prefix("s3.")
                .or_else(|| rest.strip_prefix("s3-"))
                .filter(|r| !r.is_empty())
                .unwrap_or(DEFAULT_REGION)
                .to_string()
        };
        let mut endpoint = u.clone();
        endpoint.set_path("/");
        endpoint.set_query(None);
        endpoint.set_fragment(None);
        if let Some(rest) = aws {
            if let Some(i) = rest.find(".s3") {
                let (bucket, service) = (&rest[..i], &rest[i + 1..]);
                if path.is_empty() {
                    return Err(bad(url, "no object key"));
                }
                endpoint
                    .set_host(Some(&format!("{service}.amazonaws.com")))
                    .map_err(|e| bad(url, &e.to_string()))?;
                return Ok(S3Object {
                    endpoint,
                    bucket: bucket.to_string(),
                    key: path,
                    region: region_of(service),
                    style: Style::VirtualHost,
                });
            }
        }
        let (bucket, key) = path
            .split_once('/')
            .filter(|(b, k)| !b.is_empty() && !k.is_empty())
            .ok_or_else(|| bad(url, "expected a bucket and an object key in the path"))?;
        Ok(S3Object {
            endpoint,
            bucket: bucket.to_string(),
            key: key.to_string(),
            region: aws.map(region_of).unwrap_or_else(|| DEFAULT_REGION.into()),
            style: Style::Path,
        })
    }

    /// The object's URL.
    pub fn url(&self) -> String {
        let mut u = self.endpoint.clone();
        match self.style {
            Style::Path => u.set_path(&format!("/{}/{}", self.bucket, self.key)),
            Style::VirtualHost => {
                let host = format!("{}.{}", self.bucket, u.host_str().unwrap_or_default());
                let _ = u.set_host(Some(&host));
                u.set_path(&format!("/{}", self.key));
            }
        }
        u.to_string()
    }

    /// The headers of a GET of the object signed with the access key (S3's flavour of
    /// Signature V4: the payload unsigned, the path encoded once and not normalised).
    pub fn signed_headers(
        &self,
        access_key_id: &str,
        secret_key: &str,
        at: SystemTime,
    ) -> Result<Vec<(String, String)>> {
        let signing =
            |e: &dyn std::fmt::Display| ImportError::Format(format!("signing the s3 request: {e}"));
        let identity = aws_credential_types::Credentials::new(
            access_key_id,
            secret_key,
            None,
            None,
            "datavolume",
        )
        .into();
        let mut settings = SigningSettings::default();
        settings.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
        settings.percent_encoding_mode = PercentEncodingMode::Single;
        settings.uri_path_normalization_mode = UriPathNormalizationMode::Disabled;
        let params = v4::SigningParams::builder()
            .identity(&identity)
            .region(&self.region)
            .name("s3")
            .time(at)
            .settings(settings)
            .build()
            .map_err(|e| signing(&e))?
            .into();
        let url = self.url();
        let req = SignableRequest::new(
            "GET",
            &url,
            std::iter::empty(),
            SignableBody::UnsignedPayload,
        )
        .map_err(|e| signing(&e))?;
        let (instructions, _) = sign(req, &params).map_err(|e| signing(&e))?.into_parts();
        Ok(instructions
            .headers()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bucket, key, region and addressing style.
    fn parts(o: &S3Object) -> (&str, &str, &str, Style) {
        (&o.bucket, &o.key, &o.region, o.style)
    }

    #[test]
    fn path_and_virtual_hosted_urls() {
        let o = S3Object::parse("http://127.0.0.1:9000/images/dir/disk.qcow2").unwrap();
        assert_eq!(
            parts(&o),
            ("images", "dir/disk.qcow2", "us-east-1", Style::Path)
        );
        assert_eq!(o.endpoint.as_str(), "http://127.0.0.1:9000/");
        let o = S3Object::parse("https://s3.eu-west-1.amazonaws.com/b/k.img").unwrap();
        assert_eq!((o.bucket.as_str(), o.region.as_str()), ("b", "eu-west-1"));
        let o = S3Object::parse("https://b.s3.us-west-2.amazonaws.com/k/x.img").unwrap();
        assert_eq!(parts(&o), ("b", "k/x.img", "us-west-2", Style::VirtualHost));
        assert_eq!(o.url(), "https://b.s3.us-west-2.amazonaws.com/k/x.img");
        let h = o
            .signed_headers("AKID", "secret", SystemTime::UNIX_EPOCH)
            .unwrap();
        let auth = &h.iter().find(|(n, _)| n == "authorization").unwrap().1;
        assert!(
            auth.starts_with("AWS4-HMAC-SHA256 Credential=AKID/19700101/us-west-2/s3/aws4_request"),
            "{auth}"
        );
        assert!(h
            .iter()
            .any(|(n, v)| n == "x-amz-content-sha256" && v == "UNSIGNED-PAYLOAD"));
        for bad in [
            "ftp://h/b/k",
            "http://h/bucket-only",
            "http://h/",
            "not a url",
        ] {
            let e = S3Object::parse(bad).unwrap_err().to_string();
            assert!(
                e.contains("accepted: https://ENDPOINT/BUCKET/KEY"),
                "{bad}: {e}"
            );
        }
    }
}
