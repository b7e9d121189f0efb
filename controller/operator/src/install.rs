//! The install strategy: the objects one release of microvirt consists of, rendered for a
//! `KubeVirt` CR. The operator carries the manifests of its own release (`deploy/`, the files
//! `kubectl apply -k deploy/` applies), as KubeVirt's operator carries its install strategy,
//! and renders them into the CR's namespace with the CR's registry and tag.

use api::kubevirt::{labels, KubeVirt};
use kube::api::{ApiResource, GroupVersionKind};
use kube::ResourceExt;
use serde::Deserialize;
use serde_json::Value;

/// The registry the manifests name, and this operator's default.
pub const DEFAULT_REGISTRY: &str = "quay.io/microvirt";
/// The namespace `deploy/` installs into; the operator installs into the CR's instead.
const MANIFEST_NAMESPACE: &str = "microvirt";

/// The manifests of this release, in the order they are applied: definitions and permissions
/// before the workloads that need them. (`deploy/namespace.yaml` is left out: the CR's
/// namespace exists already.)
const MANIFESTS: &[(&str, &str)] = &[
    (
        "crds/microvirt.yaml",
        include_str!("../../../deploy/crds/microvirt.yaml"),
    ),
    (
        "rbac/controller.yaml",
        include_str!("../../../deploy/rbac/controller.yaml"),
    ),
    (
        "rbac/handler.yaml",
        include_str!("../../../deploy/rbac/handler.yaml"),
    ),
    (
        "rbac/virt-api.yaml",
        include_str!("../../../deploy/rbac/virt-api.yaml"),
    ),
    (
        "rbac/kubevirt-roles.yaml",
        include_str!("../../../deploy/rbac/kubevirt-roles.yaml"),
    ),
    ("handler.yaml", include_str!("../../../deploy/handler.yaml")),
    (
        "controller.yaml",
        include_str!("../../../deploy/controller.yaml"),
    ),
    ("webhook.yaml", include_str!("../../../deploy/webhook.yaml")),
    (
        "operator-webhook.yaml",
        include_str!("../../../deploy/operator-webhook.yaml"),
    ),
    (
        "virt-api.yaml",
        include_str!("../../../deploy/virt-api.yaml"),
    ),
];

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("deploy/{file}: {reason}")]
    Manifest { file: &'static str, reason: String },
}

/// This operator's own release tag (`v` and the crate version), the default `imageTag`.
pub fn operator_version() -> String {
    format!("v{}", env!("CARGO_PKG_VERSION"))
}

/// Which release to run and where its images come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Release {
    pub registry: String,
    pub tag: String,
    pub pull_policy: Option<String>,
}

impl Release {
    /// The release `kv` asks for, this operator's own where it is silent.
    pub fn of(kv: &KubeVirt, registry: &str) -> Release {
        let non_empty = |s: &Option<String>| s.clone().filter(|s| !s.is_empty());
        Release {
            registry: non_empty(&kv.spec.image_registry).unwrap_or_else(|| registry.into()),
            tag: non_empty(&kv.spec.image_tag).unwrap_or_else(operator_version),
            pull_policy: non_empty(&kv.spec.image_pull_policy),
        }
    }

    /// A component's image in this release (`virt-handler` → `<registry>/virt-handler:<tag>`).
    pub fn image(&self, component: &str) -> String {
        format!(
            "{}/{component}:{}",
            self.registry.trim_end_matches('/'),
            self.tag
        )
    }
}

/// A workload the operator waits on before it calls the installation available.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    pub kind: WorkloadKind,
    pub name: String,
}

impl Workload {
    /// Whether `obj` is this workload.
    pub fn is(&self, obj: &Value) -> bool {
        let kind = match self.kind {
            WorkloadKind::Deployment => "Deployment",
            WorkloadKind::DaemonSet => "DaemonSet",
        };
        obj["kind"] == kind && obj["metadata"]["name"] == self.name.as_str()
    }
}

/// The order an upgrade replaces the workloads in, as KubeVirt's install strategy does: the
/// node agents first (a new handler keeps serving old launchers), then the controllers, and
/// virt-api last, which turns new features on.
pub const UPGRADE_ORDER: [&str; 3] = ["virt-handler", "virt-controller", "virt-api"];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkloadKind {
    Deployment,
    DaemonSet,
}

/// One release's objects for `kv`: in its namespace, with its images, labelled as the
/// operator's. With `ca_bundle` (the operator's CA bundle, PEM) the API server is told to
/// trust it for the webhook and virt-api, and those serve the operator's certificates
/// (`certs::SERVED`) instead of making their own.
pub fn objects(
    kv: &KubeVirt,
    release: &Release,
    ca_bundle: Option<&str>,
) -> Result<Vec<Value>, InstallError> {
    let namespace = kv.namespace().unwrap_or_default();
    let mut out = Vec::new();
    for &(file, text) in MANIFESTS {
        for doc in serde_yaml::Deserializer::from_str(text) {
            let mut obj = Value::deserialize(doc).map_err(|e| InstallError::Manifest {
                file,
                reason: e.to_string(),
            })?;
            if obj.is_null() {
                continue;
            }
            render(&mut obj, &namespace, release);
            if let Some(bundle) = ca_bundle {
                use_operator_certificates(&mut obj, bundle);
            }
            out.push(obj);
        }
    }
    Ok(out)
}

/// The Deployments and DaemonSets among `objects`.
pub fn workloads(objects: &[Value]) -> Vec<Workload> {
    objects
        .iter()
        .filter_map(|o| {
            let kind = match o["kind"].as_str()? {
                "Deployment" => WorkloadKind::Deployment,
                "DaemonSet" => WorkloadKind::DaemonSet,
                _ => return None,
            };
            let name = o["metadata"]["name"].as_str()?.to_string();
            Some(Workload { kind, name })
        })
        .collect()
}

/// The API resource of an object (its plural from the kind, as every kind shipped here forms
/// it) and whether it lives in a namespace.
pub fn resource_of(obj: &Value) -> (ApiResource, bool) {
    let api_version = obj["apiVersion"].as_str().unwrap_or_default();
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let gvk = GroupVersionKind::gvk(group, version, obj["kind"].as_str().unwrap_or_default());
    let namespaced = obj["metadata"]["namespace"].is_string();
    (ApiResource::from_gvk(&gvk), namespaced)
}

fn render(obj: &mut Value, namespace: &str, release: &Release) {
    let meta = &mut obj["metadata"];
    if meta["namespace"] == MANIFEST_NAMESPACE {
        meta["namespace"] = namespace.into();
    }
    meta["labels"][labels::MANAGED_BY] = labels::MANAGED_BY_OPERATOR.into();
    meta["labels"][labels::VERSION] = release.tag.clone().into();
    // Where other objects point into the install namespace.
    for s in obj["subjects"].as_array_mut().into_iter().flatten() {
        if s["namespace"] == MANIFEST_NAMESPACE {
            s["namespace"] = namespace.into();
        }
    }
    for w in obj["webhooks"].as_array_mut().into_iter().flatten() {
        let service = &mut w["clientConfig"]["service"];
        if service["namespace"] == MANIFEST_NAMESPACE {
            service["namespace"] = namespace.into();
        }
    }
    if obj["kind"] == "APIService" && obj["spec"]["service"]["namespace"] == MANIFEST_NAMESPACE {
        obj["spec"]["service"]["namespace"] = namespace.into();
    }
    let is_controller = obj["kind"] == "Deployment" && obj["metadata"]["name"] == "virt-controller";
    if obj["kind"] == "DaemonSet" && obj["metadata"]["name"] == "virt-handler" {
        request_node_certificates(obj);
    }
    let template = &mut obj["spec"]["template"];
    if template.is_null() {
        return;
    }
    template["metadata"]["labels"][labels::VERSION] = release.tag.clone().into();
    for c in template["spec"]["containers"]
        .as_array_mut()
        .into_iter()
        .flatten()
    {
        if let Some(component) = component_of(c["image"].as_str().unwrap_or_default()) {
            c["image"] = release.image(&component).into();
        }
        if let Some(p) = &release.pull_policy {
            c["imagePullPolicy"] = p.clone().into();
        }
        if is_controller {
            // The Pods virt-controller makes run this release's launcher and importer.
            let args = c["args"].as_array_mut();
            if let Some(args) = args {
                args.push(format!("--launcher-image={}", release.image("virt-launcher")).into());
                args.push(format!("--importer-image={}", release.image("cdi-importer")).into());
            }
        }
    }
}

/// The handlers of an operator install ask the operator's signer for their node certificates
/// (`node_certs`) instead of reading them from a directory each node was given by hand.
fn request_node_certificates(obj: &mut Value) {
    let spec = &mut obj["spec"]["template"]["spec"];
    if let Some(v) = spec["volumes"].as_array_mut() {
        v.retain(|v| v["name"] != "migration-tls");
    }
    for c in spec["containers"].as_array_mut().into_iter().flatten() {
        if let Some(m) = c["volumeMounts"].as_array_mut() {
            m.retain(|m| m["name"] != "migration-tls");
        }
        if let Some(args) = c["args"].as_array_mut() {
            args.retain(|a| !a.as_str().unwrap_or("").starts_with("--migration-tls-dir"));
            args.push("--request-node-certificate".into());
        }
        let env = serde_json::json!({"name": "POD_NAMESPACE",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}});
        match c["env"].as_array_mut() {
            Some(e) if !e.iter().any(|x| x["name"] == "POD_NAMESPACE") => e.push(env),
            Some(_) => {}
            None => c["env"] = serde_json::json!([env]),
        }
    }
}

/// Where a component mounts its serving certificate.
const CERT_DIR: &str = "/etc/microvirt/serving-certs";

/// Points the API server at the operator's CA, and the webhook and virt-api at the
/// operator's certificates (they follow the files, so a rotation needs no restart).
fn use_operator_certificates(obj: &mut Value, bundle: &str) {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(bundle);
    for w in obj["webhooks"].as_array_mut().into_iter().flatten() {
        w["clientConfig"]["caBundle"] = b64.clone().into();
    }
    if obj["kind"] == "APIService" {
        obj["spec"]["caBundle"] = b64.into();
        obj["spec"]["insecureSkipTLSVerify"] = false.into();
        return;
    }
    if obj["kind"] != "Deployment" {
        return;
    }
    let name = obj["metadata"]["name"].as_str().unwrap_or_default();
    let Some(served) = crate::certs::SERVED
        .iter()
        .find(|s| s.secret.strip_suffix("-certs") == Some(name))
    else {
        return;
    };
    let spec = &mut obj["spec"]["template"]["spec"];
    let volume =
        serde_json::json!({"name": "serving-certs", "secret": {"secretName": served.secret}});
    match spec["volumes"].as_array_mut() {
        Some(v) => v.push(volume),
        None => spec["volumes"] = serde_json::json!([volume]),
    }
    for c in spec["containers"].as_array_mut().into_iter().flatten() {
        let mount =
            serde_json::json!({"name": "serving-certs", "mountPath": CERT_DIR, "readOnly": true});
        match c["volumeMounts"].as_array_mut() {
            Some(m) => m.push(mount),
            None => c["volumeMounts"] = serde_json::json!([mount]),
        }
        if let Some(args) = c["args"].as_array_mut() {
            args.push(format!("--tls-cert={CERT_DIR}/tls.crt").into());
            args.push(format!("--tls-key={CERT_DIR}/tls.key").into());
        }
    }
}

/// `virt-handler` from `quay.io/microvirt/virt-handler:v0.1.0`: a component of this project.
fn component_of(image: &str) -> Option<String> {
    let rest = image.strip_prefix(DEFAULT_REGISTRY)?.strip_prefix('/')?;
    let name = rest.split([':', '@']).next()?;
    Some(name.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(yaml: &str) -> KubeVirt {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn renders_into_the_namespace_with_the_release_images() {
        let kv = kv("apiVersion: kubevirt.io/v1\nkind: KubeVirt\nmetadata: {name: kubevirt, namespace: kubevirt}\nspec: {imageTag: v9.9.9, imageRegistry: registry.local:5000/mv}\n");
        let release = Release::of(&kv, DEFAULT_REGISTRY);
        let objs = objects(&kv, &release, None).unwrap();
        let find = |kind: &str, name: &str| {
            objs.iter()
                .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
                .unwrap_or_else(|| panic!("{kind} {name}"))
        };
        let handler = find("DaemonSet", "virt-handler");
        assert_eq!(handler["metadata"]["namespace"], "kubevirt");
        assert_eq!(
            handler["spec"]["template"]["spec"]["containers"][0]["image"],
            "registry.local:5000/mv/virt-handler:v9.9.9"
        );
        assert_eq!(handler["metadata"]["labels"][labels::VERSION], "v9.9.9");
        // Node certificates come from the operator's signer, not from a directory per node.
        let pod = &handler["spec"]["template"]["spec"];
        let args = pod["containers"][0]["args"].to_string();
        assert!(args.contains("--request-node-certificate"), "{args}");
        assert!(!args.contains("--migration-tls-dir"), "{args}");
        assert!(!pod.to_string().contains("migration-tls"), "{pod}");
        assert!(pod["containers"][0]["env"]
            .to_string()
            .contains("POD_NAMESPACE"));
        let controller = find("Deployment", "virt-controller");
        let args = controller["spec"]["template"]["spec"]["containers"][0]["args"].to_string();
        assert!(
            args.contains("--launcher-image=registry.local:5000/mv/virt-launcher:v9.9.9"),
            "{args}"
        );
        for o in &objs {
            assert_ne!(o["metadata"]["namespace"], MANIFEST_NAMESPACE, "{o}");
            assert_eq!(
                o["metadata"]["labels"][labels::MANAGED_BY],
                labels::MANAGED_BY_OPERATOR
            );
        }
        let hook = find("ValidatingWebhookConfiguration", "microvirt");
        assert_eq!(
            hook["webhooks"][0]["clientConfig"]["service"]["namespace"],
            "kubevirt"
        );
        let api = find("APIService", "v1.subresources.kubevirt.io");
        assert_eq!(api["spec"]["service"]["namespace"], "kubevirt");
        for pdb in ["virt-api-pdb", "virt-controller-pdb"] {
            assert_eq!(find("PodDisruptionBudget", pdb)["spec"]["minAvailable"], 1);
        }
        let kinds: Vec<_> = workloads(&objs).into_iter().map(|w| w.name).collect();
        assert_eq!(kinds, ["virt-handler", "virt-controller", "virt-api"]);
    }

    #[test]
    fn defaults_to_the_operators_release() {
        let kv = kv("apiVersion: kubevirt.io/v1\nkind: KubeVirt\nmetadata: {name: kubevirt, namespace: kubevirt}\nspec: {imageTag: ''}\n");
        let r = Release::of(&kv, DEFAULT_REGISTRY);
        assert_eq!(r.tag, operator_version());
        assert_eq!(
            r.image("virt-api"),
            format!("quay.io/microvirt/virt-api:{}", operator_version())
        );
    }
}
