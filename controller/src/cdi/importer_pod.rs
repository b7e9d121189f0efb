//! The importer Pod (`ImporterPod`) that fills a DataVolume's claim: the `cdi-importer`
//! binary of this project, configured through CDI's `IMPORTER_*` environment, as a non-root
//! user without capabilities, restarted by the kubelet on failure (`restartPolicy: OnFailure`,
//! as CDI's), its progress served on the Pod's IP for the controller to read.
//!
//! Everything the Pod reads is in the DataVolume's namespace — the claim, a clone's source
//! claim, the `secretRef` Secret and the `certConfigMap` — because a Pod can mount nothing
//! else: a DataVolume cannot reach another tenant's claims or credentials through it.

use std::collections::BTreeMap;

use api::cdi::importer as env;
use api::cdi::{ClaimSource, DataVolume, HttpSource, RegistrySource, S3Source};
use k8s_openapi::api::core::v1::{
    ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource, EnvFromSource, EnvVar,
    EnvVarSource, ObjectFieldSelector, PersistentVolumeClaimVolumeSource, Pod, PodSpec,
    ResourceRequirements, SecretEnvSource, SecretKeySelector, Volume, VolumeDevice, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;

use super::claim::ClaimShape;
use super::SpecError;

/// How importer Pods are made, cluster-wide.
#[derive(Clone, Debug)]
pub struct ImporterConfig {
    pub image: String,
    /// Registries (`host:port`) the importer may reach over plain HTTP (CDIConfig's
    /// `insecureRegistries`).
    pub insecure_registries: Vec<String>,
    /// Failed attempts after which the DataVolume is Failed (CDI retries forever).
    pub max_restarts: i32,
}

impl Default for ImporterConfig {
    fn default() -> Self {
        ImporterConfig {
            image: "quay.io/microvirt/cdi-importer:v0.1.0".into(),
            insecure_registries: Vec::new(),
            max_restarts: 5,
        }
    }
}

/// The source kinds this importer serves.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ImportSource<'a> {
    Http(&'a HttpSource),
    S3(&'a S3Source),
    Registry(&'a RegistrySource),
    Blank,
    /// Another claim of the same namespace, copied.
    Clone(&'a ClaimSource),
    /// Bytes `virtctl image-upload` sends through the upload proxy.
    Upload,
    /// A CSI VolumeSnapshot of the same namespace: the storage provisions the claim from it,
    /// no importer runs.
    Snapshot(&'a ClaimSource),
}

impl ImportSource<'_> {
    /// The `IMPORTER_SOURCE` value (and the claim's source annotation).
    pub fn name(&self) -> &'static str {
        match self {
            ImportSource::Http(_) => "http",
            ImportSource::S3(_) => "s3",
            ImportSource::Registry(_) => "registry",
            ImportSource::Blank => "blank",
            ImportSource::Clone(_) => "pvc",
            ImportSource::Upload => "upload",
            ImportSource::Snapshot(_) => "snapshot",
        }
    }

    /// How the claim is filled (which names the phases).
    pub fn flow(&self) -> super::assess::Flow {
        match self {
            ImportSource::Clone(_) => super::assess::Flow::Clone,
            ImportSource::Upload => super::assess::Flow::Upload,
            ImportSource::Snapshot(_) => super::assess::Flow::Provision,
            _ => super::assess::Flow::Import,
        }
    }
}

const SERVED: &str =
    "accepted: http, s3, registry, blank, upload, pvc or snapshot (same namespace)";

/// The DataVolume's one source, or why it cannot be imported here.
pub fn source_of(dv: &DataVolume) -> Result<ImportSource<'_>, SpecError> {
    if dv.spec.source_ref.is_some() {
        return Err(SpecError::new(
            "spec.sourceRef",
            "DataSource references are not served by microvirt's importer; give spec.source",
        ));
    }
    if let Some(t) = dv.spec.content_type.as_deref().filter(|t| *t != "kubevirt") {
        return Err(SpecError::new(
            "spec.contentType",
            &format!("{t:?} is not served; accepted: kubevirt (a disk image)"),
        ));
    }
    let Some(s) = &dv.spec.source else {
        return Err(SpecError::new(
            "spec.source",
            &format!("is required: where the claim's contents come from; {SERVED}"),
        ));
    };
    let mut found: Vec<ImportSource> = Vec::new();
    let mut kinds: Vec<String> = Vec::new();
    if let Some(h) = &s.http {
        found.push(ImportSource::Http(h));
        kinds.push("http".into());
    }
    if let Some(o) = &s.s3 {
        found.push(ImportSource::S3(o));
        kinds.push("s3".into());
    }
    if let Some(r) = &s.registry {
        found.push(ImportSource::Registry(r));
        kinds.push("registry".into());
    }
    if s.blank.is_some() {
        found.push(ImportSource::Blank);
        kinds.push("blank".into());
    }
    if let Some(c) = &s.pvc {
        found.push(ImportSource::Clone(c));
        kinds.push("pvc".into());
    }
    if s.upload.is_some() {
        found.push(ImportSource::Upload);
        kinds.push("upload".into());
    }
    if let Some(c) = &s.snapshot {
        found.push(ImportSource::Snapshot(c));
        kinds.push("snapshot".into());
    }
    kinds.extend(s.extra.keys().cloned());
    if kinds.len() != 1 {
        return Err(SpecError::new(
            "spec.source",
            &format!(
                "exactly one source kind is required, found {}: {}; {SERVED}",
                kinds.len(),
                kinds.join(", ")
            ),
        ));
    }
    let Some(one) = found.pop() else {
        return Err(SpecError::new(
            &format!("spec.source.{}", kinds[0]),
            &format!("is not served by microvirt's importer; {SERVED}"),
        ));
    };
    match one {
        ImportSource::Http(h) if !(h.url.starts_with("http://") || h.url.starts_with("https://")) => {
            Err(SpecError::new(
                "spec.source.http.url",
                &format!("{:?} is not an http:// or https:// URL", h.url),
            ))
        }
        ImportSource::S3(o) if !(o.url.starts_with("http://") || o.url.starts_with("https://")) => {
            Err(SpecError::new(
                "spec.source.s3.url",
                &format!(
                    "{:?}: accepted is https://ENDPOINT/BUCKET/KEY (or http://)",
                    o.url
                ),
            ))
        }
        ImportSource::Registry(r) => {
            if r.image_stream.is_some() {
                return Err(SpecError::new(
                    "spec.source.registry.imageStream",
                    "OpenShift image streams are not served; give spec.source.registry.url",
                ));
            }
            match r.url.as_deref() {
                Some(u) if u.starts_with("docker://") => Ok(one),
                Some(u) => Err(SpecError::new(
                    "spec.source.registry.url",
                    &format!("{u:?}: accepted is docker://REGISTRY/REPOSITORY[:TAG|@DIGEST]"),
                )),
                None => Err(SpecError::new("spec.source.registry.url", "is required")),
            }
        }
        ImportSource::Clone(c) => match c.namespace.as_deref() {
            Some(ns) if Some(ns) != dv.namespace().as_deref() => Err(SpecError::new(
                "spec.source.pvc.namespace",
                &format!(
                    "cloning from another namespace ({ns}) is not served: the copy runs in a Pod of the DataVolume's namespace, which can mount only that namespace's claims"
                ),
            )),
            _ if c.name.is_empty() => Err(SpecError::new("spec.source.pvc.name", "is required")),
            _ => Ok(one),
        },
        ImportSource::Snapshot(c) => match c.namespace.as_deref() {
            Some(ns) if Some(ns) != dv.namespace().as_deref() => Err(SpecError::new(
                "spec.source.snapshot.namespace",
                &format!(
                    "a claim is provisioned from a VolumeSnapshot of its own namespace only (not {ns})"
                ),
            )),
            _ if c.name.is_empty() => {
                Err(SpecError::new("spec.source.snapshot.name", "is required"))
            }
            _ => Ok(one),
        },
        _ => Ok(one),
    }
}

/// The importer Pod's name for a DataVolume (CDI's `importer-<claim>`).
pub fn pod_name(dv: &DataVolume) -> String {
    format!("importer-{}", dv.name_any())
}

fn var(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.into()),
        value_from: None,
    }
}

fn secret_var(name: &str, secret: &str, key: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: None,
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.into(),
                key: key.into(),
                optional: Some(false),
            }),
            ..Default::default()
        }),
    }
}

fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only: read_only.then_some(true),
        ..Default::default()
    }
}

fn claim_volume(name: &str, claim: &str, read_only: bool) -> Volume {
    Volume {
        name: name.into(),
        persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
            claim_name: claim.into(),
            read_only: read_only.then_some(true),
        }),
        ..Default::default()
    }
}

/// What the container is given: environment, mounts, devices and the Pod's volumes.
#[derive(Default)]
struct Wiring {
    env: Vec<EnvVar>,
    env_from: Vec<EnvFromSource>,
    mounts: Vec<VolumeMount>,
    devices: Vec<VolumeDevice>,
    volumes: Vec<Volume>,
}

impl Wiring {
    fn credentials(&mut self, secret: Option<&String>) {
        if let Some(s) = secret {
            self.env.push(secret_var(
                env::ENV_ACCESS_KEY_ID,
                s,
                env::SECRET_ACCESS_KEY_ID,
            ));
            self.env
                .push(secret_var(env::ENV_SECRET_KEY, s, env::SECRET_SECRET_KEY));
        }
    }

    fn certs(&mut self, config_map: Option<&String>) {
        if let Some(cm) = config_map {
            self.volumes.push(Volume {
                name: "cdi-cert-vol".into(),
                config_map: Some(ConfigMapVolumeSource {
                    name: cm.clone(),
                    ..Default::default()
                }),
                ..Default::default()
            });
            self.mounts.push(mount("cdi-cert-vol", env::CERT_DIR, true));
            self.env.push(var(env::ENV_CERT_DIR, env::CERT_DIR));
        }
    }

    /// The claim written to: its `disk.img` on a file system, or the device itself.
    fn target(&mut self, claim: &str, shape: &ClaimShape) {
        self.volumes
            .push(claim_volume("cdi-data-vol", claim, false));
        if shape.block {
            self.devices.push(VolumeDevice {
                name: "cdi-data-vol".into(),
                device_path: env::TARGET_DEVICE.into(),
            });
            self.env.push(var(env::ENV_TARGET, env::TARGET_DEVICE));
        } else {
            self.mounts
                .push(mount("cdi-data-vol", env::DATA_DIR, false));
            self.env.push(var(env::ENV_TARGET, env::TARGET_FILE));
        }
    }

    fn source(&mut self, src: ImportSource, cfg: &ImporterConfig, source_block: bool) {
        self.env.push(var(env::ENV_SOURCE, src.name()));
        match src {
            ImportSource::Http(h) => {
                self.env.push(var(env::ENV_ENDPOINT, &h.url));
                self.credentials(h.secret_ref.as_ref());
                self.certs(h.cert_config_map.as_ref());
                if !h.extra_headers.is_empty() {
                    self.env
                        .push(var(env::ENV_EXTRA_HEADERS, h.extra_headers.join("\n")));
                }
                for (i, s) in h.secret_extra_headers.iter().enumerate() {
                    self.env_from.push(EnvFromSource {
                        prefix: Some(format!("{}{i}_", env::ENV_SECRET_HEADER_PREFIX)),
                        secret_ref: Some(SecretEnvSource {
                            name: s.clone(),
                            optional: Some(false),
                        }),
                        ..Default::default()
                    });
                }
                if let Some(sum) = &h.checksum {
                    self.env.push(var(env::ENV_CHECKSUM, sum));
                }
                if h.insecure_skip_verify == Some(true) {
                    self.env.push(var(env::ENV_INSECURE_TLS, "true"));
                }
            }
            ImportSource::S3(o) => {
                self.env.push(var(env::ENV_ENDPOINT, &o.url));
                self.credentials(o.secret_ref.as_ref());
                self.certs(o.cert_config_map.as_ref());
            }
            ImportSource::Registry(r) => {
                self.env
                    .push(var(env::ENV_ENDPOINT, r.url.clone().unwrap_or_default()));
                self.credentials(r.secret_ref.as_ref());
                self.certs(r.cert_config_map.as_ref());
                if !cfg.insecure_registries.is_empty() {
                    self.env.push(var(
                        env::ENV_INSECURE_REGISTRIES,
                        cfg.insecure_registries.join(","),
                    ));
                }
            }
            // No importer runs for a snapshot (the flow never asks for a Pod).
            ImportSource::Blank | ImportSource::Snapshot(_) => {}
            ImportSource::Upload => {
                // The claim and namespace a token must name; the key to check it with.
                self.env.push(EnvVar {
                    name: api::cdi::upload::ENV_NAMESPACE.into(),
                    value: None,
                    value_from: Some(EnvVarSource {
                        field_ref: Some(ObjectFieldSelector {
                            field_path: "metadata.namespace".into(),
                            api_version: None,
                        }),
                        ..Default::default()
                    }),
                });
            }
            ImportSource::Clone(c) => {
                self.volumes
                    .push(claim_volume("cdi-source-vol", &c.name, true));
                if source_block {
                    self.devices.push(VolumeDevice {
                        name: "cdi-source-vol".into(),
                        device_path: env::SOURCE_DEVICE.into(),
                    });
                    self.env.push(var(env::ENV_ENDPOINT, env::SOURCE_DEVICE));
                } else {
                    self.mounts
                        .push(mount("cdi-source-vol", env::SOURCE_DIR, true));
                    self.env.push(var(
                        env::ENV_ENDPOINT,
                        format!("{}/disk.img", env::SOURCE_DIR),
                    ));
                }
            }
        }
    }
}

/// The claim an importer Pod fills.
pub struct ImportTarget<'a> {
    pub claim: &'a str,
    pub shape: ClaimShape,
    /// Whether a clone's source claim is a block device.
    pub source_block: bool,
    /// Grow the image to the size asked for (not when a clone's size was the source's).
    pub grow: bool,
    /// The upload tokens' public key (PEM), for an upload.
    pub upload_key: Option<String>,
}

/// The importer Pod of `dv`, filling `target` from `src`.
pub fn render(
    dv: &DataVolume,
    src: ImportSource,
    target: &ImportTarget,
    cfg: &ImporterConfig,
) -> Pod {
    let shape = &target.shape;
    let mut w = Wiring::default();
    w.source(src, cfg, target.source_block);
    w.target(target.claim, shape);
    if let (ImportSource::Upload, Some(key)) = (src, &target.upload_key) {
        w.env.push(var(api::cdi::upload::ENV_PUBLIC_KEY, key));
        w.env.push(var(api::cdi::upload::ENV_CLAIM, target.claim));
    }
    // Scratch space for a qcow2 image (random access) or registry layers: node-local, as
    // large as the image may be. CDI uses a scratch claim of the DataVolume's size instead.
    w.volumes.push(Volume {
        name: "cdi-scratch-vol".into(),
        empty_dir: Some(EmptyDirVolumeSource {
            size_limit: Some(Quantity(format!("{}", shape.requested.saturating_mul(2)))),
            ..Default::default()
        }),
        ..Default::default()
    });
    w.mounts
        .push(mount("cdi-scratch-vol", env::SCRATCH_DIR, false));
    w.env.push(var(
        env::ENV_SCRATCH,
        format!("{}/tmpimage", env::SCRATCH_DIR),
    ));
    if target.grow {
        w.env
            .push(var(env::ENV_IMAGE_SIZE, shape.requested.to_string()));
    }
    w.env
        .push(var(env::ENV_OWNER_UID, dv.uid().unwrap_or_default()));
    w.env.push(EnvVar {
        name: env::ENV_POD_IP.into(),
        value: None,
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: "status.podIP".into(),
                api_version: None,
            }),
            ..Default::default()
        }),
    });
    w.env
        .push(var(env::ENV_TERMINATION_LOG, env::TERMINATION_LOG));
    let uid = env::UID;
    Pod {
        metadata: ObjectMeta {
            name: Some(pod_name(dv)),
            namespace: dv.namespace(),
            labels: Some(env::labels()),
            owner_references: controller_runtime::controller_ref(dv).map(|r| vec![r]),
            ..Default::default()
        },
        spec: Some(PodSpec {
            restart_policy: Some("OnFailure".into()),
            priority_class_name: dv.spec.priority_class_name.clone(),
            automount_service_account_token: Some(false),
            security_context: Some(crate::pod::pod_security_as(uid)),
            containers: vec![Container {
                name: "importer".into(),
                image: Some(cfg.image.clone()),
                command: Some(vec!["/usr/bin/cdi-importer".into()]),
                env: Some(w.env),
                env_from: (!w.env_from.is_empty()).then_some(w.env_from),
                volume_mounts: (!w.mounts.is_empty()).then_some(w.mounts),
                volume_devices: (!w.devices.is_empty()).then_some(w.devices),
                ports: Some(vec![ContainerPort {
                    name: Some("metrics".into()),
                    container_port: env::METRICS_PORT.into(),
                    protocol: Some("TCP".into()),
                    ..Default::default()
                }]),
                termination_message_path: Some(env::TERMINATION_LOG.into()),
                resources: Some(ResourceRequirements {
                    requests: Some(BTreeMap::from([
                        ("cpu".to_string(), Quantity("100m".into())),
                        ("memory".to_string(), Quantity("64Mi".into())),
                    ])),
                    // The importer's memory is bounded whatever the image says.
                    limits: Some(BTreeMap::from([(
                        "memory".to_string(),
                        Quantity("600Mi".into()),
                    )])),
                    ..Default::default()
                }),
                security_context: Some(crate::pod::container_security_as(uid)),
                ..Default::default()
            }],
            volumes: Some(w.volumes),
            ..Default::default()
        }),
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dv(spec: &str) -> DataVolume {
        serde_yaml::from_str(&format!(
            "apiVersion: cdi.kubevirt.io/v1beta1\nkind: DataVolume\nmetadata: {{name: d, namespace: ns, uid: u-1}}\nspec: {spec}"
        ))
        .unwrap()
    }

    fn env_of(p: &Pod) -> BTreeMap<String, EnvVar> {
        p.spec.as_ref().unwrap().containers[0]
            .env
            .clone()
            .unwrap()
            .into_iter()
            .map(|e| (e.name.clone(), e))
            .collect()
    }

    const FS: ClaimShape = ClaimShape {
        block: false,
        requested: 1 << 30,
    };

    #[test]
    fn an_http_source_is_cdis_environment_with_secrets_by_reference() {
        let d = dv("{source: {http: {url: 'https://h/i.qcow2', secretRef: creds, certConfigMap: cas, extraHeaders: ['A: b', 'C: d'], secretExtraHeaders: [hs], checksum: 'sha256:ab'}}}");
        let src = source_of(&d).unwrap();
        let t = ImportTarget {
            claim: "d",
            shape: FS,
            source_block: false,
            grow: true,
            upload_key: None,
        };
        let p = render(&d, src, &t, &ImporterConfig::default());
        let e = env_of(&p);
        assert_eq!(e["IMPORTER_SOURCE"].value.as_deref(), Some("http"));
        assert_eq!(
            e["IMPORTER_ENDPOINT"].value.as_deref(),
            Some("https://h/i.qcow2")
        );
        assert_eq!(
            e["IMPORTER_EXTRA_HEADERS"].value.as_deref(),
            Some("A: b\nC: d")
        );
        assert_eq!(e["IMPORTER_CHECKSUM"].value.as_deref(), Some("sha256:ab"));
        assert_eq!(
            e["IMPORTER_TARGET"].value.as_deref(),
            Some("/data/disk.img")
        );
        assert_eq!(
            e["IMPORTER_IMAGE_SIZE"].value.as_deref(),
            Some("1073741824")
        );
        assert_eq!(e["OWNER_UID"].value.as_deref(), Some("u-1"));
        // The credentials never appear in the Pod: they are references to the Secret.
        let key = e["IMPORTER_SECRET_KEY"].value_from.as_ref().unwrap();
        let sel = key.secret_key_ref.as_ref().unwrap();
        assert_eq!(
            (sel.name.as_str(), sel.key.as_str()),
            ("creds", "secretKey")
        );
        assert!(e["IMPORTER_SECRET_KEY"].value.is_none());
        let spec = p.spec.unwrap();
        assert_eq!(spec.restart_policy.as_deref(), Some("OnFailure"));
        assert_eq!(spec.security_context.unwrap().run_as_user, Some(1001));
        let c = &spec.containers[0];
        assert_eq!(
            c.env_from.as_ref().unwrap()[0].prefix.as_deref(),
            Some("IMPORTER_SECRET_EXTRA_HEADER_0_")
        );
        let names: Vec<_> = spec.volumes.unwrap().into_iter().map(|v| v.name).collect();
        assert_eq!(names, ["cdi-cert-vol", "cdi-data-vol", "cdi-scratch-vol"]);
        assert_eq!(p.metadata.name.as_deref(), Some("importer-d"));
        assert_eq!(p.metadata.owner_references.unwrap()[0].uid, "u-1");
    }

    #[test]
    fn a_block_claim_is_a_device_and_a_clone_mounts_its_source_read_only() {
        let d = dv("{source: {pvc: {name: golden}}}");
        let src = source_of(&d).unwrap();
        let block = ClaimShape {
            block: true,
            requested: 1 << 30,
        };
        let t = ImportTarget {
            claim: "d",
            shape: block,
            source_block: false,
            grow: false,
            upload_key: None,
        };
        let p = render(&d, src, &t, &ImporterConfig::default());
        let e = env_of(&p);
        assert_eq!(e["IMPORTER_SOURCE"].value.as_deref(), Some("pvc"));
        assert!(!e.contains_key("IMPORTER_IMAGE_SIZE"));
        assert_eq!(
            e["IMPORTER_TARGET"].value.as_deref(),
            Some("/dev/cdi-block-volume")
        );
        assert_eq!(
            e["IMPORTER_ENDPOINT"].value.as_deref(),
            Some("/source/disk.img")
        );
        let c = &p.spec.as_ref().unwrap().containers[0];
        assert_eq!(c.volume_devices.as_ref().unwrap()[0].name, "cdi-data-vol");
        let source = c
            .volume_mounts
            .as_ref()
            .unwrap()
            .iter()
            .find(|m| m.name == "cdi-source-vol")
            .unwrap();
        assert_eq!(source.read_only, Some(true));
    }

    #[test]
    fn sources_not_served_are_refused_naming_the_field() {
        for (spec, path, words) in [
            ("{}", "spec.source", "is required"),
            ("{source: {}}", "spec.source", "found 0"),
            (
                "{source: {blank: {}, http: {url: 'http://a'}}}",
                "spec.source",
                "found 2: http, blank",
            ),
            (
                "{source: {s3: {url: 's3://b/k'}}}",
                "spec.source.s3.url",
                "ENDPOINT/BUCKET/KEY",
            ),
            (
                "{source: {gcs: {url: 'gs://b/o'}}}",
                "spec.source.gcs",
                "not served",
            ),
            (
                "{source: {http: {url: 'ftp://a'}}}",
                "spec.source.http.url",
                "not an http",
            ),
            (
                "{source: {registry: {url: 'quay.io/a'}}}",
                "spec.source.registry.url",
                "docker://",
            ),
            (
                "{source: {pvc: {namespace: other, name: x}}}",
                "spec.source.pvc.namespace",
                "another namespace",
            ),
            (
                "{source: {snapshot: {namespace: other, name: x}}}",
                "spec.source.snapshot.namespace",
                "its own namespace",
            ),
            (
                "{source: {snapshot: {name: ''}}}",
                "spec.source.snapshot.name",
                "required",
            ),
            (
                "{contentType: archive, source: {blank: {}}}",
                "spec.contentType",
                "archive",
            ),
            (
                "{sourceRef: {kind: DataSource, name: x}}",
                "spec.sourceRef",
                "DataSource",
            ),
        ] {
            let d = dv(spec);
            let e = source_of(&d).unwrap_err();
            assert_eq!(e.path, path, "{spec}: {e}");
            assert!(e.reason.contains(words), "{spec}: {e}");
        }
        let d = dv("{source: {pvc: {namespace: ns, name: x}}}");
        assert_eq!(
            source_of(&d).unwrap().flow(),
            crate::cdi::assess::Flow::Clone
        );
    }
}
