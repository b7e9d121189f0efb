//! Installing microvirt as KubeVirt is installed: the real `kubectl` applies
//! `deploy/operator.yaml` and `deploy/kubevirt-cr.yaml` to the test API server, the real
//! `virt-operator` binary installs every other object from the CR, and `kubectl wait kv
//! kubevirt --for condition=Available` returns once the workloads are ready. The test stands in
//! for the Deployment and DaemonSet controllers (there is no kube-controller-manager here): it
//! reports the workloads rolled out, which is what the operator waits for.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use api::kubevirt::{conditions, KubeVirt, KubeVirtPhase};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::rbac::v1::ClusterRole;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};
use kube::Client;
use serde_json::json;
use tests::apiserver::ApiServer;
use tests::cluster::eventually;
use tests::kubectl::Kubectl;

const T: Duration = Duration::from_secs(60);
const NS: &str = "kubevirt";

/// The real operator, as its Deployment runs it (the API server reached through a
/// kubeconfig instead of the Pod's service account files).
struct Operator(Child);

impl Operator {
    /// Starts the operator with its admission webhook on `webhook`.
    fn start(kubeconfig: &Path, webhook: std::net::SocketAddr) -> Operator {
        let bin = tests::build_bin("virt-operator", "virt-operator");
        let child = Command::new(bin)
            .arg("run")
            .arg(format!("--webhook-addr={webhook}"))
            .env("KUBECONFIG", kubeconfig)
            .env("POD_NAMESPACE", NS)
            .env("RUST_LOG", "info,kube=warn")
            .stdout(Stdio::null())
            .spawn()
            .expect("virt-operator starts");
        Operator(child)
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn repo(path: &str) -> String {
    tests::repo_root().join(path).display().to_string()
}

/// `kubectl wait kv kubevirt --for condition=Available`: its exit code.
async fn wait_available(kubectl: &Kubectl, timeout: &str) -> i32 {
    let timeout = format!("--timeout={timeout}");
    let args = [
        "wait",
        "kv",
        "kubevirt",
        "-n",
        NS,
        "--for",
        "condition=Available",
        &timeout,
    ];
    kubectl.run(&args).await.code
}

/// What the Deployment and DaemonSet controllers report once every Pod of the current
/// generation is ready (one node here).
async fn roll_out(client: &Client) {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    for d in deployments.list(&Default::default()).await.unwrap() {
        let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
        let status = json!({"status": {
            "observedGeneration": d.metadata.generation,
            "replicas": want, "updatedReplicas": want, "readyReplicas": want,
            "availableReplicas": want,
        }});
        let name = d.metadata.name.unwrap();
        deployments
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(status))
            .await
            .unwrap();
    }
    let daemonsets: Api<DaemonSet> = Api::namespaced(client.clone(), NS);
    for d in daemonsets.list(&Default::default()).await.unwrap() {
        let status = json!({"status": {
            "observedGeneration": d.metadata.generation,
            "desiredNumberScheduled": 1, "currentNumberScheduled": 1,
            "updatedNumberScheduled": 1, "numberReady": 1, "numberMisscheduled": 0,
        }});
        let name = d.metadata.name.unwrap();
        daemonsets
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(status))
            .await
            .unwrap();
    }
}

async fn condition(kvs: &Api<KubeVirt>, name: &str, type_: &str) -> Option<(String, String)> {
    let kv = kvs.get(name).await.ok()?;
    let c = kv
        .status?
        .conditions
        .into_iter()
        .find(|c| c.type_ == type_)?;
    Some((c.status, c.reason.unwrap_or_default()))
}

/// A cluster with the operator installed and running, as a user gets it from the two files.
struct Installed {
    server: ApiServer,
    kubectl: Kubectl,
    _operator: Operator,
}

async fn install(tag: &str) -> Installed {
    let cr = std::fs::read_to_string(repo("deploy/kubevirt-cr.yaml")).unwrap();
    install_with(tag, &cr).await
}

/// [`install`] from the CR `cr` (YAML).
async fn install_with(tag: &str, cr: &str) -> Installed {
    let server = ApiServer::start().await;
    let kubectl = Kubectl::new(&server, &format!("operator-{tag}"));
    kubectl
        .ok(&["apply", "-f", &repo("deploy/operator.yaml")])
        .await;
    // The operator's webhook Service leads to the operator, as its selector would.
    let webhook = free_addr();
    server.set_service_endpoint(NS, "kubevirt-operator-webhook", webhook);
    let operator = Operator::start(&kubectl.kubeconfig, webhook);
    let cr = kubectl.file("kubevirt-cr.yaml", cr);
    kubectl.ok(&["apply", "-f", &cr]).await;
    Installed {
        server,
        kubectl,
        _operator: operator,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_installs_reports_available_and_uninstalls_once_workloads_are_gone() {
    let Installed {
        server,
        kubectl,
        _operator,
    } = install("install").await;
    let client = server.client();

    // Everything else comes from the CR: definitions, permissions, webhooks, workloads.
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    let controller = eventually("virt-controller installed", T, || async {
        deployments.get_opt("virt-controller").await.unwrap()
    })
    .await;
    let image = &controller.spec.unwrap().template.spec.unwrap().containers[0].image;
    assert_eq!(
        image.as_deref(),
        Some("quay.io/microvirt/virt-controller:v0.1.0")
    );
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in [
        "virtualmachines.kubevirt.io",
        "virtualmachinepools.pool.kubevirt.io",
    ] {
        eventually(crd, T, || async { crds.get_opt(crd).await.unwrap() }).await;
    }
    let roles: Api<ClusterRole> = Api::all(client.clone());
    eventually("kubevirt.io:edit", T, || async {
        roles.get_opt("kubevirt.io:edit").await.unwrap()
    })
    .await;
    let kvs: Api<KubeVirt> = Api::namespaced(client.clone(), NS);
    let waiting = eventually("Progressing while the workloads start", T, || async {
        condition(&kvs, "kubevirt", conditions::AVAILABLE)
            .await
            .filter(|c| c.0 == "False")
    })
    .await;
    assert_eq!(waiting.1, conditions::DEPLOYMENT_IN_PROGRESS);
    let code = wait_available(&kubectl, "1s").await;
    assert_ne!(code, 0, "Available before any workload is ready");

    roll_out(&client).await;
    assert_eq!(wait_available(&kubectl, "60s").await, 0);
    let kv = kvs.get("kubevirt").await.unwrap();
    let status = kv.status.unwrap();
    assert_eq!(status.phase, Some(KubeVirtPhase::Deployed));
    assert_eq!(status.observed_kube_virt_version.as_deref(), Some("v0.1.0"));

    // A bad edit is reported on the CR and tears nothing down.
    let bad = json!({"spec": {"certificateRotateStrategy": {"selfSigned": {"server": {"duration": "a while"}}},
                              "configuration": {"migrations": {"bandwidthPerMigration": "fast"}},
                              "infra": {"replicas": 3}}});
    kvs.patch("kubevirt", &PatchParams::default(), &Patch::Merge(bad))
        .await
        .unwrap();
    let degraded = eventually("the bad edit reported", T, || async {
        condition(&kvs, "kubevirt", conditions::DEGRADED)
            .await
            .filter(|c| c.1 == conditions::INVALID_CONFIGURATION)
    })
    .await;
    assert_eq!(degraded.0, "True");
    let kv = kvs.get("kubevirt").await.unwrap();
    let conds = kv.status.unwrap().conditions;
    let find = |t: &str| conds.iter().find(|c| c.type_ == t).unwrap().clone();
    let degraded = find(conditions::DEGRADED);
    assert!(
        degraded
            .message
            .as_deref()
            .unwrap()
            .contains("spec.configuration.migrations.bandwidthPerMigration"),
        "{degraded:?}"
    );
    assert_eq!(find(conditions::AVAILABLE).status, "True");
    let not_honoured = find(conditions::FIELDS_NOT_HONOURED);
    assert!(
        not_honoured
            .message
            .as_deref()
            .unwrap()
            .contains("spec.infra"),
        "{not_honoured:?}"
    );
    assert!(deployments.get_opt("virt-api").await.unwrap().is_some());
    let fixed = json!({"spec": {"certificateRotateStrategy": null, "infra": null,
                                "configuration": {"migrations": null}}});
    kvs.patch("kubevirt", &PatchParams::default(), &Patch::Merge(fixed))
        .await
        .unwrap();
    eventually("the fix taken", T, || async {
        condition(&kvs, "kubevirt", conditions::DEGRADED)
            .await
            .filter(|c| c.0 == "False")
    })
    .await;

    // A second CR is not an installation of its own.
    let second = std::fs::read_to_string(repo("deploy/kubevirt-cr.yaml"))
        .unwrap()
        .replace("name: kubevirt\n", "name: second\n");
    let second_path = kubectl.file("second.yaml", &second);
    kubectl.ok(&["apply", "-f", &second_path]).await;
    let ignored = eventually("the second CR reported", T, || async {
        condition(&kvs, "second", conditions::SYNCHRONIZED).await
    })
    .await;
    assert_eq!(ignored.1, conditions::MULTIPLE_KUBEVIRTS);
    kubectl
        .ok(&["delete", "kv", "second", "-n", NS, "--timeout=30s"])
        .await;

    // With a VM present, deleting the CR is refused by the operator's webhook, as KubeVirt
    // refuses it, and nothing is torn down. (virt-controller's webhook admits the VM.)
    let _webhook = serve_controller_webhook(&server).await;
    kubectl
        .ok(&["apply", "-f", &repo("examples/probe-smp.yaml")])
        .await;
    let refused = kubectl
        .run(&["delete", "kv", "kubevirt", "-n", NS, "--wait=false"])
        .await;
    assert_ne!(refused.code, 0, "{}", refused.stdout);
    assert!(
        refused.stderr.contains(
            "admission webhook \"kubevirt-validator.kubevirt.io\" denied the request: there are still Virtual Machines present"
        ),
        "{}",
        refused.stderr
    );
    let kv = kvs.get("kubevirt").await.unwrap();
    assert!(kv.metadata.deletion_timestamp.is_none());
    assert_eq!(kv.status.unwrap().phase, Some(KubeVirtPhase::Deployed));
    assert!(deployments
        .get_opt("virt-controller")
        .await
        .unwrap()
        .is_some());

    // Once the VM is gone, the installation goes, then the CR.
    kubectl
        .ok(&["delete", "-f", &repo("examples/probe-smp.yaml")])
        .await;
    kubectl
        .ok(&["delete", "kv", "kubevirt", "-n", NS, "--wait=false"])
        .await;
    eventually("the CR removed", T, || async {
        kvs.get_opt("kubevirt")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    assert!(deployments
        .get_opt("virt-controller")
        .await
        .unwrap()
        .is_none());
    assert!(crds
        .get_opt("virtualmachines.kubevirt.io")
        .await
        .unwrap()
        .is_none());
}

fn image_of(template: Option<k8s_openapi::api::core::v1::PodTemplateSpec>) -> String {
    template.unwrap().spec.unwrap().containers[0]
        .image
        .clone()
        .unwrap()
}

async fn deployment_image(client: &Client, name: &str) -> String {
    let d = Api::<Deployment>::namespaced(client.clone(), NS)
        .get(name)
        .await
        .unwrap();
    image_of(d.spec.map(|s| s.template))
}

async fn handler_image(client: &Client) -> String {
    let d = Api::<DaemonSet>::namespaced(client.clone(), NS)
        .get("virt-handler")
        .await
        .unwrap();
    image_of(d.spec.map(|s| s.template))
}

/// A running VMI in a launcher Pod of `image`, as virt-controller and virt-handler leave it.
async fn running_vmi(client: &Client, name: &str, image: &str) {
    let vmis: Api<api::VirtualMachineInstance> = Api::namespaced(client.clone(), "default");
    let vmi: api::VirtualMachineInstance = serde_yaml::from_str(&format!(
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {{name: {name}}}\nspec:\n  domain:\n    memory: {{guest: 64Mi}}\n    devices: {{}}\n"
    ))
    .unwrap();
    let vmi = vmis.create(&Default::default(), &vmi).await.unwrap();
    let uid = vmi.metadata.uid.clone().unwrap();
    let status = json!({"status": {"phase": "Running", "nodeName": "node-a", "conditions": [
        {"type": "LiveMigratable", "status": "True"}, {"type": "Ready", "status": "True"}]}});
    vmis.patch_status(name, &PatchParams::default(), &Patch::Merge(status))
        .await
        .unwrap();
    let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
        "metadata": {"name": format!("virt-launcher-{name}"), "namespace": "default",
                     "labels": {"kubevirt.io": "virt-launcher", "kubevirt.io/created-by": uid}},
        "spec": {"nodeName": "node-a", "containers": [{"name": "compute", "image": image}]},
    }))
    .unwrap();
    Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), "default")
        .create(&Default::default(), &pod)
        .await
        .unwrap();
}

/// virt-controller's admission webhook served as its Pod serves it — the real router, with
/// the certificate the operator issued into `virt-controller-certs` — and its Service pointed
/// there, so the API server calls it through the registration the operator made (trusted
/// through the operator's CA bundle). Returns the server task.
async fn serve_controller_webhook(server: &ApiServer) -> tokio::task::JoinHandle<()> {
    let client = server.client();
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), NS);
    let s = eventually("the webhook's certificate", T, || async {
        secrets.get_opt("virt-controller-certs").await.unwrap()
    })
    .await;
    let pair = controller_runtime::tls::ServingCert::from_pem(
        &secret_field(&s, "tls.crt"),
        "tls.crt",
        &secret_field(&s, "tls.key"),
        "tls.key",
    )
    .unwrap();
    let tls = pair.server_config(None).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    server.set_service_endpoint(
        NS,
        "virt-controller-webhook",
        listener.local_addr().unwrap(),
    );
    let app = controller::webhook::router(controller::webhook::WebhookState {
        client: Some(client),
        settings: controller_runtime::LiveSettings::fixed(Default::default()),
        host_disk_prefixes: vec![],
    });
    tokio::spawn(async move {
        let _ = controller_runtime::tls::serve_tls(listener, tls, app).await;
    })
}

/// A new `imageTag` rolls out in KubeVirt's order — virt-handler, then virt-controller, then
/// virt-api, each once the one before is ready — while `Available` stays True with
/// `Progressing` and `Degraded` telling the upgrade apart; then, with `LiveMigrate`, running
/// VMIs on the old launcher are migrated (onto Pods the new virt-controller makes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_tag_rolls_out_in_order_and_workloads_follow_by_live_migration() {
    // Every part bound: the operator lives as long as the test.
    let Installed {
        server,
        kubectl,
        _operator,
    } = install("upgrade").await;
    let client = server.client();
    let kvs: Api<KubeVirt> = Api::namespaced(client.clone(), NS);
    eventually("installed", T, || async {
        Api::<Deployment>::namespaced(client.clone(), NS)
            .get_opt("virt-api")
            .await
            .unwrap()
    })
    .await;
    roll_out(&client).await;
    assert_eq!(wait_available(&kubectl, "60s").await, 0);
    let _webhook = serve_controller_webhook(&server).await;
    running_vmi(&client, "old", "quay.io/microvirt/virt-launcher:v0.1.0").await;

    let patch = json!({"spec": {"imageTag": "v0.2.0",
        "workloadUpdateStrategy": {"workloadUpdateMethods": ["LiveMigrate"], "batchEvictionSize": 5}}});
    kvs.patch("kubevirt", &PatchParams::default(), &Patch::Merge(patch))
        .await
        .unwrap();
    let new = |c: &str| format!("quay.io/microvirt/{c}:v0.2.0");
    eventually("virt-handler first", T, || async {
        (handler_image(&client).await == new("virt-handler")).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        deployment_image(&client, "virt-controller").await,
        "quay.io/microvirt/virt-controller:v0.1.0",
        "the controllers wait for the new virt-handler"
    );
    assert_eq!(
        condition(&kvs, "kubevirt", conditions::AVAILABLE).await,
        Some(("True".into(), conditions::UPDATE_IN_PROGRESS.into()))
    );
    assert_eq!(
        condition(&kvs, "kubevirt", conditions::PROGRESSING).await,
        Some(("True".into(), conditions::UPDATE_IN_PROGRESS.into()))
    );
    assert_eq!(wait_available(&kubectl, "5s").await, 0);

    roll_out(&client).await;
    eventually("virt-controller next", T, || async {
        (deployment_image(&client, "virt-controller").await == new("virt-controller")).then_some(())
    })
    .await;
    assert_eq!(
        deployment_image(&client, "virt-api").await,
        "quay.io/microvirt/virt-api:v0.1.0",
        "virt-api waits for the new controllers"
    );
    roll_out(&client).await;
    eventually("virt-api last", T, || async {
        (deployment_image(&client, "virt-api").await == new("virt-api")).then_some(())
    })
    .await;
    roll_out(&client).await;
    eventually("the upgrade done", T, || async {
        condition(&kvs, "kubevirt", conditions::PROGRESSING)
            .await
            .filter(|c| c.0 == "False")
    })
    .await;
    let status = kvs.get("kubevirt").await.unwrap().status.unwrap();
    assert_eq!(status.observed_kube_virt_version.as_deref(), Some("v0.2.0"));
    assert_eq!(status.outdated_virtual_machine_instance_workloads, Some(1));
    let migrations: Api<api::VirtualMachineInstanceMigration> =
        Api::namespaced(client.clone(), "default");
    let m = eventually("a workload-update migration", T, || async {
        migrations
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .pop()
    })
    .await;
    assert_eq!(m.spec.vmi_name, "old");
    assert!(m
        .metadata
        .annotations
        .unwrap()
        .contains_key("kubevirt.io/workloadUpdateMigration"));
}

/// The leaf certificate a TLS server at `addr` presents for `name`, verified against `bundle`
/// (PEM) alone.
async fn leaf_trusted_by(addr: std::net::SocketAddr, name: &str, bundle: &str) -> Vec<u8> {
    use tokio_rustls::rustls;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pemfile::certs(&mut bundle.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let cfg = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let server = rustls::pki_types::ServerName::try_from(name.to_string()).unwrap();
    let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg))
        .connect(server, tcp)
        .await
        .expect("the served certificate is trusted through the CA bundle");
    tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

fn secret_field(s: &k8s_openapi::api::core::v1::Secret, key: &str) -> Vec<u8> {
    s.data.as_ref().unwrap()[key].0.clone()
}

/// The webhook configuration's caBundle, as the API server reads it.
async fn webhook_bundle(client: &Client) -> String {
    let hooks: Api<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration> =
        Api::all(client.clone());
    let Some(cfg) = hooks.get_opt("microvirt").await.unwrap() else {
        return String::new();
    };
    let webhook = &cfg.webhooks.unwrap()[0];
    let b = webhook.client_config.ca_bundle.clone().unwrap_or_default();
    String::from_utf8(b.0).unwrap()
}

/// The operator makes a CA and serving certificates, tells the API server to trust the CA
/// (webhook configurations, APIServices), points the webhook and virt-api at the certificates,
/// and replaces them before they expire; the real webhook server, serving the mounted files,
/// presents the new certificate with no restart, still trusted through the bundle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_are_issued_trusted_and_rotated_without_a_restart() {
    let cr = std::fs::read_to_string(repo("deploy/kubevirt-cr.yaml"))
        .unwrap()
        .replace(
            "certificateRotateStrategy: {}",
            "certificateRotateStrategy: {selfSigned: {server: {duration: 20s, renewBefore: 14s}}}",
        );
    let Installed {
        server,
        kubectl,
        _operator,
    } = install_with("certs", &cr).await;
    let client = server.client();
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), NS);
    let first = eventually("the webhook's certificate", T, || async {
        secrets.get_opt("virt-controller-certs").await.unwrap()
    })
    .await;
    let bundle = eventually("the webhook configuration trusts the CA", T, || async {
        let b = webhook_bundle(&client).await;
        (!b.is_empty()).then_some(b)
    })
    .await;
    {
        use base64::Engine;
        let gvk = kube::api::GroupVersionKind::gvk("apiregistration.k8s.io", "v1", "APIService");
        let ar = kube::api::ApiResource::from_gvk(&gvk);
        let services: Api<kube::api::DynamicObject> = Api::all_with(client.clone(), &ar);
        // The operator writes the APIService after the webhook configurations: wait for it.
        let b64 = eventually("virt-api's APIService with the CA", T, || async {
            let svc = services
                .get_opt("v1.subresources.kubevirt.io")
                .await
                .unwrap()?;
            svc.data["spec"]["caBundle"].as_str().map(str::to_string)
        })
        .await;
        let pem = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap();
        assert_eq!(String::from_utf8(pem).unwrap(), bundle);
    }
    let deployments = Api::<Deployment>::namespaced(client.clone(), NS);
    let controller = eventually("virt-controller installed", T, || async {
        deployments.get_opt("virt-controller").await.unwrap()
    })
    .await;
    let args = controller.spec.unwrap().template.spec.unwrap().containers[0]
        .args
        .clone()
        .unwrap();
    assert!(
        args.iter().any(|a| a.starts_with("--tls-cert=")),
        "{args:?}"
    );

    // The mounted Secret, served by the real webhook server as virt-controller serves it.
    let dir = kubectl.dir.join("serving-certs");
    std::fs::create_dir_all(&dir).unwrap();
    let mount = |s: &k8s_openapi::api::core::v1::Secret| {
        std::fs::write(dir.join("tls.crt"), secret_field(s, "tls.crt")).unwrap();
        std::fs::write(dir.join("tls.key"), secret_field(s, "tls.key")).unwrap();
    };
    mount(&first);
    let tls = controller_runtime::tls::reloading_server_config(
        &dir.join("tls.crt"),
        &dir.join("tls.key"),
        None,
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = controller::webhook::router(controller::webhook::WebhookState {
        client: None,
        settings: controller_runtime::LiveSettings::fixed(Default::default()),
        host_disk_prefixes: vec![],
    });
    tokio::spawn(controller_runtime::tls::serve_tls(listener, tls, app));
    let name = format!("virt-controller-webhook.{NS}.svc");
    let leaf = leaf_trusted_by(addr, &name, &bundle).await;
    let pem_der = |pem: &[u8]| {
        rustls_pemfile::certs(&mut &pem[..])
            .next()
            .unwrap()
            .unwrap()
            .to_vec()
    };
    assert_eq!(leaf, pem_der(&secret_field(&first, "tls.crt")));

    // virt-api's client certificate for the consoles, signed by the CA whose bundle the
    // handlers and virt-api read as files.
    let api_client = eventually("virt-api's client certificate", T, || async {
        secrets.get_opt("virt-api-handler-client").await.unwrap()
    })
    .await;
    let configmaps: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(client.clone(), NS);
    for cm in ["virt-api-client-ca", "microvirt-node-ca"] {
        let data = eventually(cm, T, || async {
            configmaps.get_opt(cm).await.unwrap()?.data
        })
        .await;
        assert_eq!(data["ca.crt"], bundle, "{cm}");
    }

    // Six seconds after issue the certificate is due (20 s lifetime, renewed 14 s before).
    let rotated = eventually("a new certificate", T, || async {
        let s = secrets.get("virt-controller-certs").await.unwrap();
        (secret_field(&s, "tls.crt") != secret_field(&first, "tls.crt")).then_some(s)
    })
    .await;
    mount(&rotated);
    let want = pem_der(&secret_field(&rotated, "tls.crt"));
    eventually("the new certificate served", T, || async {
        let bundle = webhook_bundle(&client).await;
        (leaf_trusted_by(addr, &name, &bundle).await == want).then_some(())
    })
    .await;
    eventually("virt-api's client certificate rotated too", T, || async {
        let s = secrets.get("virt-api-handler-client").await.unwrap();
        (secret_field(&s, "tls.crt") != secret_field(&api_client, "tls.crt")).then_some(())
    })
    .await;
}

/// A free loopback address (a Pod would have an IP of its own; here every component shares
/// the host's).
fn free_addr() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// A process started as the kubelet would start a Deployment's container, killed on drop.
struct Container(Child);

impl Drop for Container {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// How the test kubelet runs one Pod of a workload the operator made: the real binary `bin`
/// (package, binary), the workload's arguments and environment with `extra` arguments (its
/// own loopback listen flags: a Pod would have an IP of its own), as `node`, with `kubeconfig`.
struct PodRun<'a> {
    name: &'a str,
    bin: (&'a str, &'a str),
    extra: Vec<String>,
    node: &'a str,
    kubeconfig: std::path::PathBuf,
}

/// Writes each Secret or ConfigMap volume's files into a directory of its own and returns
/// (mount path, directory) for every mount it backs.
async fn mount_volumes(
    client: &Client,
    kubectl: &Kubectl,
    name: &str,
    pod: &k8s_openapi::api::core::v1::PodSpec,
) -> Vec<(String, String)> {
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), NS);
    let configmaps: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(client.clone(), NS);
    let mut rewrites = vec![];
    for m in pod.containers[0].volume_mounts.iter().flatten() {
        let v = pod
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == m.name)
            .unwrap();
        let files: Vec<(String, Vec<u8>)> = if let Some(secret) = &v.secret {
            let secret_name = secret.secret_name.clone().unwrap();
            let s = if secret.optional == Some(true) {
                secrets.get_opt(&secret_name).await.unwrap()
            } else {
                Some(
                    eventually(&secret_name, T, || async {
                        secrets.get_opt(&secret_name).await.unwrap()
                    })
                    .await,
                )
            };
            s.and_then(|s| s.data)
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k, v.0))
                .collect()
        } else if let Some(cm) = &v.config_map {
            let c = configmaps.get_opt(&cm.name).await.unwrap();
            c.and_then(|c| c.data)
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k, v.into_bytes()))
                .collect()
        } else {
            continue; // host paths: the node's own
        };
        let dir = kubectl.dir.join(format!("{name}-{}", m.name));
        std::fs::create_dir_all(&dir).unwrap();
        for (k, v) in files {
            std::fs::write(dir.join(k), v).unwrap();
        }
        rewrites.push((m.mount_path.clone(), dir.display().to_string()));
    }
    rewrites
}

/// Runs `pod` as the kubelet would (see [`PodRun`]); killed on drop.
async fn run_pod(
    client: &Client,
    kubectl: &Kubectl,
    pod: k8s_openapi::api::core::v1::PodSpec,
    run: PodRun<'_>,
) -> Container {
    let rewrites = mount_volumes(client, kubectl, run.name, &pod).await;
    let c = &pod.containers[0];
    let args: Vec<String> = c
        .args
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|a| {
            rewrites
                .iter()
                .fold(a, |a, (from, to)| a.replace(from.as_str(), to))
        })
        .collect();
    let mut cmd = Command::new(tests::build_bin(run.bin.0, run.bin.1));
    for e in c.env.iter().flatten() {
        let field = e
            .value_from
            .as_ref()
            .and_then(|v| v.field_ref.as_ref())
            .map(|f| f.field_path.as_str());
        let value = match (field, &e.value) {
            (Some("spec.nodeName"), _) => run.node.to_string(),
            (Some("metadata.namespace"), _) => NS.to_string(),
            (Some("metadata.name"), _) => format!("{}-0", run.name),
            (Some("status.podIP"), _) => "127.0.0.1".to_string(),
            (_, Some(v)) => v.clone(),
            _ => continue,
        };
        cmd.env(&e.name, value);
    }
    let child = cmd
        .args(&args)
        .args(&run.extra)
        .env("KUBECONFIG", &run.kubeconfig)
        .env("POD_NAMESPACE", NS)
        .env("POD_NAME", format!("{}-0", run.name))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{} starts: {e}", run.name));
    Container(child)
}

/// A Deployment the operator made, run as its Pod would run it (see [`run_pod`]), with the
/// admin's kubeconfig.
async fn run_deployment(
    client: &Client,
    kubectl: &Kubectl,
    name: &str,
    bin: (&str, &str),
    ports: &[String],
) -> Container {
    let d = Api::<Deployment>::namespaced(client.clone(), NS)
        .get(name)
        .await
        .unwrap();
    let run = PodRun {
        name,
        bin,
        extra: ports.to_vec(),
        node: "node-a",
        kubeconfig: kubectl.kubeconfig.clone(),
    };
    run_pod(client, kubectl, d.spec.unwrap().template.spec.unwrap(), run).await
}

/// The virt-handler DaemonSet's Pod on `node`, run as the kubelet would run it (see
/// [`run_pod`]) under its service account with a node-bound token, as the kubelet mounts one.
async fn run_handler_daemonset(
    server: &ApiServer,
    kubectl: &Kubectl,
    node: &str,
    extra: Vec<String>,
) -> Container {
    let client = server.client();
    let ds = Api::<DaemonSet>::namespaced(client.clone(), NS)
        .get("virt-handler")
        .await
        .unwrap();
    let pod = ds.spec.unwrap().template.spec.unwrap();
    let account = pod.service_account_name.clone().unwrap();
    let kubeconfig = kubectl.dir.join(format!("virt-handler-{node}.kubeconfig"));
    server.write_kubeconfig_on_node(
        &kubeconfig,
        &format!("system:serviceaccount:{NS}:{account}"),
        node,
    );
    let run = PodRun {
        name: "virt-handler",
        bin: ("handler", "virt-handler"),
        extra,
        node,
        kubeconfig,
    };
    run_pod(&client, kubectl, pod, run).await
}

/// The virt-controller Deployment, run by [`run_deployment`]: the container and its metrics
/// and webhook addresses.
async fn run_controller_deployment(
    client: &Client,
    kubectl: &Kubectl,
) -> (Container, std::net::SocketAddr, std::net::SocketAddr) {
    let (metrics, webhook) = (free_addr(), free_addr());
    let ports = [
        format!("--metrics-addr={metrics}"),
        format!("--webhook-addr={webhook}"),
    ];
    let c = run_deployment(
        client,
        kubectl,
        "virt-controller",
        ("controller", "virt-controller"),
        &ports,
    )
    .await;
    (c, metrics, webhook)
}

/// The operator's workloads run as made: the virt-controller Deployment's real binary takes its
/// arguments, serves the admission webhook with the operator's certificate (trusted through
/// the bundle in the webhook configuration), turns an applied VM into a VMI and a launcher
/// Pod of the release's launcher image; virt-api's Deployment answers through the APIService;
/// virt-handler's DaemonSet Pod gets its node's certificate from the operator's signer and
/// serves its console with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operators_controller_deployment_runs_as_made() {
    let Installed {
        server,
        kubectl,
        _operator,
    } = install("run").await;
    let client = server.client();
    eventually("virt-controller installed", T, || async {
        Api::<Deployment>::namespaced(client.clone(), NS)
            .get_opt("virt-controller")
            .await
            .unwrap()
    })
    .await;
    let (_controller, metrics, webhook) = run_controller_deployment(&client, &kubectl).await;
    // The webhook Service leads to the Pod: the API server calls it for the VM below.
    server.set_service_endpoint(NS, "virt-controller-webhook", webhook);
    eventually("virt-controller serving", T, || async {
        tokio::net::TcpStream::connect(metrics).await.ok()
    })
    .await;
    assert_eq!(tests::cluster::http_get(metrics, "/healthz").await, "ok");
    let bundle = webhook_bundle(&client).await;
    eventually("the webhook serving", T, || async {
        tokio::net::TcpStream::connect(webhook).await.ok()
    })
    .await;
    let leaf = leaf_trusted_by(
        webhook,
        &format!("virt-controller-webhook.{NS}.svc"),
        &bundle,
    )
    .await;
    let secret = Api::<k8s_openapi::api::core::v1::Secret>::namespaced(client.clone(), NS)
        .get("virt-controller-certs")
        .await
        .unwrap();
    let served = rustls_pemfile::certs(&mut &secret_field(&secret, "tls.crt")[..])
        .next()
        .unwrap()
        .unwrap();
    assert_eq!(leaf, served.to_vec());

    kubectl
        .ok(&["apply", "-f", &repo("examples/probe-smp.yaml")])
        .await;
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), "default");
    let pod = eventually("the launcher Pod", T, || async {
        pods.list(&Default::default()).await.unwrap().items.pop()
    })
    .await;
    let compute = pod
        .spec
        .unwrap()
        .containers
        .into_iter()
        .find(|c| c.name == "compute")
        .unwrap();
    assert_eq!(
        compute.image.as_deref(),
        Some("quay.io/microvirt/virt-launcher:v0.1.0")
    );

    // virt-api from its Deployment, with the operator's certificate; the API server reaches
    // it through the APIService the operator made (trusting the operator's CA), and the real
    // virtctl stops the VM through it.
    let api_addr = free_addr();
    let _virt_api = run_deployment(
        &client,
        &kubectl,
        "virt-api",
        ("virt-api", "virt-api"),
        &[format!("--listen={api_addr}")],
    )
    .await;
    server.set_service_endpoint(NS, "virt-api", api_addr);
    let version = kubectl
        .until(
            &["get", "--raw", "/apis/subresources.kubevirt.io/v1/version"],
            "virt-api served through the aggregation layer",
            |t| t.contains("gitVersion"),
        )
        .await;
    assert!(version.contains("gitVersion"), "{version}");
    let virtctl = tests::build_bin("virt-api", "virtctl");
    let out = Command::new(virtctl)
        .args(["stop", "probe-smp"])
        .env("KUBECONFIG", &kubectl.kubeconfig)
        .output()
        .unwrap();
    tests::expect_success(&out, "");
    let vms: Api<api::VirtualMachine> = Api::namespaced(client.clone(), "default");
    let vm = vms.get("probe-smp").await.unwrap();
    assert_eq!(
        vm.spec.run_strategy,
        Some(api::RunStrategy::Halted),
        "stopped through virt-api"
    );

    // virt-handler from its DaemonSet on node-a, under its node-bound token: it asks the
    // operator's signer for node-a's certificate and serves its console server with it.
    let configmaps: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(client.clone(), NS);
    eventually("the client CA published", T, || async {
        configmaps.get_opt("virt-api-client-ca").await.unwrap()
    })
    .await;
    let pods_dir = kubectl.dir.join("node-a-pods");
    std::fs::create_dir_all(&pods_dir).unwrap();
    let (handler_metrics, console) = (free_addr(), free_addr());
    let _handler = run_handler_daemonset(
        &server,
        &kubectl,
        "node-a",
        vec![
            format!("--metrics-addr={handler_metrics}"),
            format!("--console-addr={console}"),
            format!("--pods-dir={}", pods_dir.display()),
            "--no-device-plugins".into(),
        ],
    )
    .await;
    let csrs: Api<k8s_openapi::api::certificates::v1::CertificateSigningRequest> =
        Api::all(client.clone());
    let node_cert = eventually("node-a's certificate issued", T, || async {
        csrs.list(&Default::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|c| {
                c.spec.username.as_deref() == Some("system:serviceaccount:kubevirt:virt-handler")
            })
            .find_map(|c| c.status?.certificate)
            .map(|b| b.0)
    })
    .await;
    eventually("the console server", T, || async {
        tokio::net::TcpStream::connect(console).await.ok()
    })
    .await;
    let bundle = configmaps.get("kubevirt-ca").await.unwrap().data.unwrap()["ca-bundle"].clone();
    let leaf = leaf_trusted_by(console, "node-a", &bundle).await;
    let issued = rustls_pemfile::certs(&mut &node_cert[..])
        .next()
        .unwrap()
        .unwrap();
    assert_eq!(
        leaf,
        issued.to_vec(),
        "the console serves node-a's issued certificate"
    );
}
