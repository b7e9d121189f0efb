//! Every object `kubectl apply -k deploy/` would create parses as its Kubernetes type, and the
//! references between them line up: namespaces, service accounts, roles, services, ports,
//! selectors, volumes and webhook services.

use std::collections::BTreeMap;
use std::path::Path;

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Namespace, PodTemplateSpec, Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::Deserialize;

#[derive(Default)]
struct Objects {
    namespaces: Vec<Namespace>,
    crds: Vec<CustomResourceDefinition>,
    service_accounts: Vec<ServiceAccount>,
    cluster_roles: Vec<ClusterRole>,
    cluster_role_bindings: Vec<ClusterRoleBinding>,
    roles: Vec<Role>,
    role_bindings: Vec<RoleBinding>,
    deployments: Vec<Deployment>,
    daemon_sets: Vec<DaemonSet>,
    services: Vec<Service>,
    validating: Vec<ValidatingWebhookConfiguration>,
    mutating: Vec<MutatingWebhookConfiguration>,
    /// APIServices, as JSON (k8s-openapi has no kube-aggregator types).
    api_services: Vec<serde_json::Value>,
    budgets: Vec<PodDisruptionBudget>,
}

/// Roles every cluster bootstraps, which the manifests bind to without defining.
const BOOTSTRAP_CLUSTER_ROLES: [&str; 1] = ["system:auth-delegator"];
const BOOTSTRAP_ROLES: [(&str, &str); 1] =
    [("kube-system", "extension-apiserver-authentication-reader")];

fn load() -> Objects {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let k: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(dir.join("kustomization.yaml")).unwrap())
            .unwrap();
    let mut o = Objects::default();
    for res in k["resources"].as_sequence().unwrap() {
        let path = dir.join(res.as_str().unwrap());
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let v = serde_yaml::Value::deserialize(doc).unwrap();
            if v.is_null() {
                continue;
            }
            let kind = v["kind"]
                .as_str()
                .unwrap_or_else(|| panic!("{}: object without kind", path.display()))
                .to_string();
            assert!(
                v["metadata"]["name"].as_str().is_some(),
                "{}: {kind} without a name",
                path.display()
            );
            let ctx = format!(
                "{}: {kind} {}",
                path.display(),
                v["metadata"]["name"].as_str().unwrap()
            );
            macro_rules! push {
                ($field:ident) => {
                    o.$field.push(
                        serde_yaml::from_value(v.clone()).unwrap_or_else(|e| panic!("{ctx}: {e}")),
                    )
                };
            }
            match kind.as_str() {
                "Namespace" => push!(namespaces),
                "CustomResourceDefinition" => push!(crds),
                "ServiceAccount" => push!(service_accounts),
                "ClusterRole" => push!(cluster_roles),
                "ClusterRoleBinding" => push!(cluster_role_bindings),
                "Role" => push!(roles),
                "RoleBinding" => push!(role_bindings),
                "Deployment" => push!(deployments),
                "DaemonSet" => push!(daemon_sets),
                "Service" => push!(services),
                "ValidatingWebhookConfiguration" => push!(validating),
                "MutatingWebhookConfiguration" => push!(mutating),
                "APIService" => push!(api_services),
                "PodDisruptionBudget" => push!(budgets),
                other => panic!("{ctx}: unexpected kind {other}"),
            }
        }
    }
    o
}

fn ns_of(m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> &str {
    m.namespace
        .as_deref()
        .unwrap_or_else(|| panic!("{:?} has no namespace", m.name))
}

fn check_pod_template(o: &Objects, ns: &str, what: &str, t: &PodTemplateSpec) {
    let spec = t.spec.as_ref().unwrap();
    let sa = spec
        .service_account_name
        .as_deref()
        .unwrap_or_else(|| panic!("{what}: no serviceAccountName"));
    assert!(
        o.service_accounts
            .iter()
            .any(|s| s.metadata.name.as_deref() == Some(sa) && ns_of(&s.metadata) == ns),
        "{what}: service account {sa} does not exist in {ns}"
    );
    let volumes: Vec<&str> = spec
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .collect();
    for c in &spec.containers {
        for m in c.volume_mounts.iter().flatten() {
            assert!(
                volumes.contains(&m.name.as_str()),
                "{what}: container {} mounts unknown volume {}",
                c.name,
                m.name
            );
        }
        for e in c.env.iter().flatten() {
            assert!(
                e.value.is_some() || e.value_from.is_some(),
                "{what}: env {} has no value",
                e.name
            );
        }
    }
}

fn matches(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

#[test]
fn manifests_parse_and_references_line_up() {
    let o = load();
    assert_eq!(o.namespaces.len(), 1);
    let ns = o.namespaces[0].metadata.name.clone().unwrap();
    assert_eq!(
        o.crds.len(),
        controller::crds::all().len(),
        "every kind has a CRD"
    );
    for sa in &o.service_accounts {
        assert_eq!(ns_of(&sa.metadata), ns);
    }
    // Workloads.
    assert_eq!(o.deployments.len(), 2, "virt-controller and virt-api");
    let d = o
        .deployments
        .iter()
        .find(|d| d.metadata.name.as_deref() == Some("virt-controller"))
        .unwrap();
    let dspec = d.spec.as_ref().unwrap();
    assert_eq!(
        dspec.replicas,
        Some(2),
        "two controller replicas (leader election)"
    );
    let tlabels = dspec
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap();
    assert!(matches(
        dspec.selector.match_labels.as_ref().unwrap(),
        &tlabels
    ));
    // Each Deployment keeps one replica through a drain: a budget selecting its Pods, in its
    // namespace, that allows fewer than all of them down.
    let workloads = o
        .deployments
        .iter()
        .map(|d| {
            let s = d.spec.as_ref().unwrap();
            let what = format!("Deployment {}", d.metadata.name.as_deref().unwrap());
            (&d.metadata, what, &s.selector, &s.template)
        })
        .chain(o.daemon_sets.iter().map(|ds| {
            let s = ds.spec.as_ref().unwrap();
            (
                &ds.metadata,
                "DaemonSet".to_string(),
                &s.selector,
                &s.template,
            )
        }));
    for (meta, what, selector, template) in workloads {
        let labels = template.metadata.as_ref().unwrap().labels.clone().unwrap();
        assert!(
            matches(selector.match_labels.as_ref().unwrap(), &labels),
            "{what}: its selector does not select its own pods"
        );
        check_pod_template(&o, ns_of(meta), &what, template);
    }
    // Services select a workload and target ports it declares.
    let templates: Vec<&PodTemplateSpec> = o
        .deployments
        .iter()
        .map(|d| &d.spec.as_ref().unwrap().template)
        .chain(
            o.daemon_sets
                .iter()
                .map(|d| &d.spec.as_ref().unwrap().template),
        )
        .collect();
    for svc in &o.services {
        let s = svc.spec.as_ref().unwrap();
        let sel = s.selector.clone().unwrap();
        let t = templates
            .iter()
            .find(|t| matches(&sel, t.metadata.as_ref().unwrap().labels.as_ref().unwrap()))
            .unwrap_or_else(|| panic!("Service {:?} selects no workload", svc.metadata.name));
        let ports: Vec<String> = t
            .spec
            .as_ref()
            .unwrap()
            .containers
            .iter()
            .flat_map(|c| c.ports.iter().flatten())
            .filter_map(|p| p.name.clone())
            .collect();
        for p in s.ports.iter().flatten() {
            if let Some(IntOrString::String(name)) = &p.target_port {
                assert!(
                    ports.contains(name),
                    "Service {:?} targets unknown port {name}",
                    svc.metadata.name
                );
            }
        }
    }
    // RBAC: bindings point at roles and service accounts that exist.
    let sa_exists = |name: &str, ns: &str| {
        o.service_accounts
            .iter()
            .any(|s| s.metadata.name.as_deref() == Some(name) && ns_of(&s.metadata) == ns)
    };
    for b in &o.cluster_role_bindings {
        assert!(
            BOOTSTRAP_CLUSTER_ROLES.contains(&b.role_ref.name.as_str())
                || o.cluster_roles
                    .iter()
                    .any(|r| r.metadata.name.as_deref() == Some(b.role_ref.name.as_str())),
            "{:?}",
            b.metadata.name
        );
        for s in b
            .subjects
            .iter()
            .flatten()
            .filter(|s| s.kind == "ServiceAccount")
        {
            assert!(
                sa_exists(&s.name, s.namespace.as_deref().unwrap()),
                "{:?}: subject {}",
                b.metadata.name,
                s.name
            );
        }
    }
    for b in &o.role_bindings {
        let ns = ns_of(&b.metadata);
        assert!(
            BOOTSTRAP_ROLES.contains(&(ns, b.role_ref.name.as_str()))
                || o.roles.iter().any(|r| {
                    r.metadata.name.as_deref() == Some(b.role_ref.name.as_str())
                        && ns_of(&r.metadata) == ns
                }),
            "{:?}",
            b.metadata.name
        );
        for s in b.subjects.iter().flatten() {
            assert!(sa_exists(&s.name, s.namespace.as_deref().unwrap()));
        }
    }
    let leases = o
        .roles
        .iter()
        .flat_map(|r| r.rules.iter().flatten())
        .any(|r| r.resources.iter().flatten().any(|x| x == "leases"));
    assert!(leases, "leader election needs leases");
    // Least privilege: nobody gets wildcards.
    for r in o
        .cluster_roles
        .iter()
        .flat_map(|r| r.rules.iter().flatten())
    {
        assert!(
            !r.verbs.iter().any(|v| v == "*") && !r.resources.iter().flatten().any(|x| x == "*"),
            "wildcard rule {r:?}"
        );
    }
    // Webhooks call a Service that exists, on a port it serves.
    let hooks = o
        .validating
        .iter()
        .flat_map(|v| {
            v.webhooks
                .iter()
                .flatten()
                .map(|w| w.client_config.service.clone())
        })
        .chain(o.mutating.iter().flat_map(|m| {
            m.webhooks
                .iter()
                .flatten()
                .map(|w| w.client_config.service.clone())
        }));
    let mut n = 0;
    for svc_ref in hooks {
        let r = svc_ref.expect("webhooks call a Service");
        let svc = o
            .services
            .iter()
            .find(|s| {
                s.metadata.name.as_deref() == Some(r.name.as_str())
                    && ns_of(&s.metadata) == r.namespace
            })
            .unwrap_or_else(|| panic!("webhook service {}/{} missing", r.namespace, r.name));
        let port = r.port.unwrap_or(443);
        assert!(svc
            .spec
            .as_ref()
            .unwrap()
            .ports
            .iter()
            .flatten()
            .any(|p| p.port == port));
        // Served by controller::webhook::router.
        let path = r.path.as_deref().unwrap_or("/");
        assert!(
            ["/validate", "/mutate", "/eviction"].contains(&path),
            "webhook path {path} is not served"
        );
        n += 1;
    }
    assert_eq!(n, 3);
    // virt-api's APIServices name a Service that exists and serves their port, one per version
    // virt-api serves.
    let mut versions = Vec::new();
    for a in &o.api_services {
        let svc = &a["spec"]["service"];
        let (name, ns) = (
            svc["name"].as_str().unwrap(),
            svc["namespace"].as_str().unwrap(),
        );
        let port = svc["port"].as_i64().unwrap_or(443) as i32;
        let s = o
            .services
            .iter()
            .find(|s| s.metadata.name.as_deref() == Some(name) && ns_of(&s.metadata) == ns)
            .unwrap_or_else(|| {
                panic!(
                    "APIService {}: no Service {ns}/{name}",
                    a["metadata"]["name"]
                )
            });
        assert!(s
            .spec
            .as_ref()
            .unwrap()
            .ports
            .iter()
            .flatten()
            .any(|p| p.port == port));
        assert_eq!(a["spec"]["group"], virt_api::GROUP);
        let v = a["spec"]["version"].as_str().unwrap();
        assert_eq!(a["metadata"]["name"], format!("{v}.{}", virt_api::GROUP));
        versions.push(v.to_string());
    }
    versions.sort();
    let mut served: Vec<String> = virt_api::VERSIONS.iter().map(|v| v.to_string()).collect();
    served.sort();
    assert_eq!(versions, served);
}
