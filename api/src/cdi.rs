//! CDI's `cdi.kubevirt.io/v1beta1` DataVolume, with CDI's field names, phases and conditions, so
//! manifests written for CDI work unchanged — and the facts virt-controller's DataVolume
//! controller and the `cdi-importer` binary share: the importer Pod's environment, its metrics
//! port and the termination message it leaves.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::PersistentVolumeClaimSpec;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::types::{preserved_object, Extra};

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "cdi.kubevirt.io",
    version = "v1beta1",
    kind = "DataVolume",
    namespaced,
    shortname = "dv",
    shortname = "dvs",
    status = "DataVolumeStatus",
    derive = "PartialEq",
    derive = "Default",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Progress","type":"string","jsonPath":".status.progress"}"#,
    printcolumn = r#"{"name":"Restarts","type":"integer","jsonPath":".status.restartCount"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
/// A claim and where its contents come from: CDI creates the PersistentVolumeClaim (of the
/// DataVolume's name) and fills it from the source.
pub struct DataVolumeSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<DataVolumeSource>,
    /// A DataSource to take the source from (not served by microvirt's importer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserved_object")]
    pub source_ref: Option<Value>,
    /// The claim, as a raw PersistentVolumeClaimSpec (Kubernetes' defaults).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pvc: Option<PersistentVolumeClaimSpec>,
    /// The claim, with access and volume modes filled in by the storage profile (CDI's
    /// recommended form).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<PersistentVolumeClaimSpec>,
    /// `kubevirt` (a disk image, the default) or `archive` (a tar to unpack).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preallocation: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// Where a DataVolume's contents come from: exactly one kind.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct DataVolumeSource {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpSource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub s3: Option<S3Source>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registry: Option<RegistrySource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pvc: Option<ClaimSource>,
    /// A CSI VolumeSnapshot of the same namespace: the claim is provisioned from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<ClaimSource>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserved_object")]
    pub upload: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserved_object")]
    pub blank: Option<Value>,
    /// The kinds microvirt does not import (gcs, imageio, vddk), kept as written.
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct HttpSource {
    pub url: String,
    /// A Secret with `accessKeyId` and `secretKey`: basic auth.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<String>,
    /// A ConfigMap of PEM CA certificates to trust.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_config_map: Option<String>,
    /// `Name: value` headers sent with the request.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extra_headers: Vec<String>,
    /// Secrets whose every value is a `Name: value` header.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secret_extra_headers: Vec<String>,
    /// `algo:hex` of the bytes as served (sha256, sha512).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub insecure_skip_verify: Option<bool>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct S3Source {
    pub url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_config_map: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
pub struct RegistrySource {
    /// `docker://registry/repository:tag` (or `@sha256:…`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_stream: Option<String>,
    /// `pod` (the importer pulls, the default) or `node` (the kubelet pulls).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pull_method: Option<String>,
    /// A Secret with `accessKeyId` and `secretKey`: the registry's user and password.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_config_map: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// Another claim to copy.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClaimSource {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    pub name: String,
}

/// CDI's phases ([`DataVolumePhase::Unknown`] stands for any this project does not know).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum DataVolumePhase {
    #[default]
    Pending,
    PVCBound,
    WaitForFirstConsumer,
    PendingPopulation,
    ImportScheduled,
    ImportInProgress,
    CloneScheduled,
    CloneInProgress,
    UploadScheduled,
    UploadReady,
    Succeeded,
    Failed,
    Paused,
    #[serde(other)]
    Unknown,
}

impl DataVolumePhase {
    /// Populated, or waiting for its first consumer: a VM may start on it.
    pub fn lets_consumers_start(self) -> bool {
        matches!(
            self,
            Self::Succeeded | Self::WaitForFirstConsumer | Self::PendingPopulation
        )
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DataVolumeStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<DataVolumePhase>,
    /// `"45.00%"`, or `"N/A"` when the size is not known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_count: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_name: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<DataVolumeCondition>,
}

/// `Bound`, `Running` or `Ready`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DataVolumeCondition {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_heartbeat_time: Option<String>,
}

/// The importer Pod, as the controller renders it and the importer reads it.
pub mod importer {
    use super::*;

    /// Labels of every importer Pod (CDI's `app` label value).
    pub const APP: &str = "containerized-data-importer";
    pub const COMPONENT_LABEL: &str = "cdi.kubevirt.io";
    pub const COMPONENT: &str = "importer";
    /// The user the importer runs as (CDI's importer image runs as 1001).
    pub const UID: i64 = 1001;
    /// Where the Pod serves `kubevirt_cdi_import_progress_total{ownerUID}` (CDI's port).
    pub const METRICS_PORT: u16 = 8443;
    pub const PROGRESS_METRIC: &str = "kubevirt_cdi_import_progress_total";
    /// A Filesystem claim's image, a Block claim's device, and the scratch space.
    pub const DATA_DIR: &str = "/data";
    pub const TARGET_FILE: &str = "/data/disk.img";
    pub const TARGET_DEVICE: &str = "/dev/cdi-block-volume";
    pub const SCRATCH_DIR: &str = "/scratch";
    pub const CERT_DIR: &str = "/certs";
    /// A source claim being cloned (mounted read-only).
    pub const SOURCE_DIR: &str = "/source";
    pub const SOURCE_DEVICE: &str = "/dev/cdi-source-block-volume";
    pub const TERMINATION_LOG: &str = "/dev/termination-log";

    /// The environment, CDI's names where CDI has one.
    pub const ENV_SOURCE: &str = "IMPORTER_SOURCE";
    pub const ENV_ENDPOINT: &str = "IMPORTER_ENDPOINT";
    pub const ENV_IMAGE_SIZE: &str = "IMPORTER_IMAGE_SIZE";
    pub const ENV_ACCESS_KEY_ID: &str = "IMPORTER_ACCESS_KEY_ID";
    pub const ENV_SECRET_KEY: &str = "IMPORTER_SECRET_KEY";
    pub const ENV_CERT_DIR: &str = "IMPORTER_CERT_DIR";
    pub const ENV_EXTRA_HEADERS: &str = "IMPORTER_EXTRA_HEADERS";
    /// Each Secret of `secretExtraHeaders` is given as environment variables of this prefix
    /// (`envFrom`), every value a header.
    pub const ENV_SECRET_HEADER_PREFIX: &str = "IMPORTER_SECRET_EXTRA_HEADER_";
    pub const ENV_CHECKSUM: &str = "IMPORTER_CHECKSUM";
    pub const ENV_INSECURE_TLS: &str = "IMPORTER_INSECURE_TLS";
    pub const ENV_INSECURE_REGISTRIES: &str = "IMPORTER_INSECURE_REGISTRIES";
    pub const ENV_TARGET: &str = "IMPORTER_TARGET";
    pub const ENV_SCRATCH: &str = "IMPORTER_SCRATCH";
    pub const ENV_OWNER_UID: &str = "OWNER_UID";
    /// The Pod's IP (downward API), where the metrics are served.
    pub const ENV_POD_IP: &str = "POD_IP";
    pub const ENV_TERMINATION_LOG: &str = "IMPORTER_TERMINATION_LOG";

    /// Why an import ended badly, as the importer leaves it in its termination message (JSON)
    /// and the DataVolume's `Running` condition shows it.
    #[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
    #[serde(rename_all = "camelCase")]
    pub struct Outcome {
        /// The condition reason: `ChecksumError` (CDI's), `LargerPVCRequired`,
        /// `ImageFormatError`, `SourceError`, `VolumeError`.
        pub reason: String,
        pub message: String,
        /// Whether another attempt can help (a network error may pass; a bad checksum will not).
        pub retryable: bool,
    }

    impl Outcome {
        /// The outcome in a termination message, if it is one.
        pub fn parse(message: &str) -> Option<Outcome> {
            serde_json::from_str(message.trim()).ok()
        }
    }

    /// Keys of the Secret a `secretRef` names.
    pub const SECRET_ACCESS_KEY_ID: &str = "accessKeyId";
    pub const SECRET_SECRET_KEY: &str = "secretKey";

    /// The progress in `metrics` (Prometheus text) for the DataVolume of `owner_uid`, as
    /// CDI's status shows it: `"45.00%"`.
    pub fn progress_of(metrics: &str, owner_uid: &str) -> Option<String> {
        let label = format!("ownerUID=\"{owner_uid}\"");
        metrics.lines().find_map(|l| {
            let rest = l.strip_prefix(PROGRESS_METRIC)?.strip_prefix('{')?;
            let (labels, value) = rest.split_once('}')?;
            if !labels.split(',').any(|kv| kv.trim() == label) {
                return None;
            }
            let v: f64 = value.trim().parse().ok()?;
            Some(format!("{:.2}%", v.clamp(0.0, 100.0)))
        })
    }

    /// The metrics line for `percent` done of the DataVolume of `owner_uid`.
    pub fn progress_line(owner_uid: &str, percent: f64) -> String {
        format!("{PROGRESS_METRIC}{{ownerUID=\"{owner_uid}\"}} {percent:.2}\n")
    }

    /// Labels every importer Pod carries.
    pub fn labels() -> BTreeMap<String, String> {
        BTreeMap::from([
            ("app".to_string(), APP.to_string()),
            (COMPONENT_LABEL.to_string(), COMPONENT.to_string()),
        ])
    }
}

/// `virtctl image-upload`'s path: a token from an `UploadTokenRequest`
/// (`upload.cdi.kubevirt.io/v1beta1`, served by virt-api) and the upload proxy (virt-api's
/// `/v1beta1/upload`), which passes the bytes to the DataVolume's importer Pod in upload mode.
/// The token is an ES256 JWT signed with a key only virt-controller and virt-api read; the
/// importer checks it again against the public key in its Pod, so the Pod, reachable on the
/// Pod network, takes data only for its own claim.
pub mod upload {
    use super::*;

    pub const GROUP: &str = "upload.cdi.kubevirt.io";
    pub const VERSION: &str = "v1beta1";
    pub const PLURAL: &str = "uploadtokenrequests";
    /// The upload proxy's synchronous and asynchronous paths (CDI's).
    pub const UPLOAD_PATH: &str = "/v1beta1/upload";
    pub const UPLOAD_ASYNC_PATH: &str = "/v1beta1/upload-async";
    /// The Secret (in virt-controller's namespace) holding the signing key pair.
    pub const KEY_SECRET: &str = "microvirt-upload-token";
    pub const PRIVATE_KEY: &str = "private.pem";
    pub const PUBLIC_KEY: &str = "public.pem";
    /// A token's life (CDI's: five minutes).
    pub const TOKEN_TTL_SECS: u64 = 300;
    /// The upload-mode importer's environment.
    pub const ENV_PUBLIC_KEY: &str = "IMPORTER_UPLOAD_PUBLIC_KEY";
    pub const ENV_CLAIM: &str = "IMPORTER_UPLOAD_CLAIM";
    pub const ENV_NAMESPACE: &str = "POD_NAMESPACE";

    /// What a token allows: uploading into one claim of one namespace until `exp`.
    #[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
    pub struct TokenClaims {
        pub pvc: String,
        pub namespace: String,
        pub iat: u64,
        pub exp: u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdis_example_manifest_reads_and_round_trips() {
        let y = r#"
apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {name: fedora}
spec:
  source:
    http:
      url: https://example.org/fedora.qcow2
      secretRef: creds
      extraHeaders: ["X-A: b"]
      checksum: sha256:00
  storage:
    resources: {requests: {storage: 5Gi}}
  checkpoints: [{previous: "", current: a}]
status: {phase: CSICloneInProgress, progress: "N/A"}
"#;
        let dv: DataVolume = serde_yaml::from_str(y).unwrap();
        let http = dv.spec.source.as_ref().unwrap().http.as_ref().unwrap();
        assert_eq!(http.secret_ref.as_deref(), Some("creds"));
        assert_eq!(http.extra_headers, ["X-A: b"]);
        assert!(dv.spec.extra.contains_key("checkpoints"));
        assert_eq!(
            dv.status.as_ref().unwrap().phase,
            Some(DataVolumePhase::Unknown)
        );
        let back = serde_json::to_value(&dv).unwrap();
        assert_eq!(back["spec"]["checkpoints"][0]["current"], "a");
    }

    #[test]
    fn progress_is_read_for_the_owner_only() {
        let m = format!(
            "# HELP x\n{}{}",
            importer::progress_line("other", 10.0),
            importer::progress_line("u-1", 45.0)
        );
        assert_eq!(importer::progress_of(&m, "u-1").as_deref(), Some("45.00%"));
        assert_eq!(importer::progress_of(&m, "u-2"), None);
        assert_eq!(
            importer::progress_of(
                "kubevirt_cdi_import_progress_total{ownerUID=\"a\"} 300",
                "a"
            )
            .as_deref(),
            Some("100.00%")
        );
    }

    #[test]
    fn outcomes_round_trip_through_the_termination_message() {
        let o = importer::Outcome {
            reason: "ChecksumError".into(),
            message: "checksum mismatch".into(),
            retryable: false,
        };
        let s = serde_json::to_string(&o).unwrap();
        assert_eq!(importer::Outcome::parse(&s), Some(o));
        assert_eq!(importer::Outcome::parse("Unable to process data: x"), None);
    }
}
