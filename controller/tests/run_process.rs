//! The `virt-controller run` binary as deployed: kubeconfig from $KUBECONFIG, leader election,
//! self-signed webhook, metrics; reconciles a VM, and on SIGTERM releases its Lease and exits 0.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};
use tests::apiserver::ApiServer;
use tests::rbac::{service_account_user, Authorizer};

async fn wait<T>(what: &str, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_reconciles_and_releases_its_lease_on_sigterm() {
    let api = ApiServer::start().await;
    // The namespace `deploy/` makes for virt-controller, where its Lease lives.
    let ns: k8s_openapi::api::core::v1::Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "microvirt"}})).unwrap();
    Api::all(api.client())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    // The process runs under its deployed service account and RBAC rules.
    api.enforce_rbac(Authorizer::from_dir(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/rbac"),
    ));
    let dir = std::env::temp_dir().join(format!("virt-controller-run-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = dir.join("kubeconfig");
    api.write_kubeconfig(
        &kubeconfig,
        Some(&service_account_user("microvirt", "virt-controller")),
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_virt-controller"))
        .args([
            "run",
            "--leader-election-lease",
            "virt-controller",
            "--namespace",
            "microvirt",
            "--identity",
            "replica-1",
            "--lease-duration",
            "3",
            "--metrics-addr",
            "127.0.0.1:0",
            "--webhook-addr",
            "127.0.0.1:0",
        ])
        .env("KUBECONFIG", &kubeconfig)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let client = api.client();
    let vm: api::VirtualMachine = serde_yaml::from_str(
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachine\nmetadata:\n  name: p\n  namespace: default\nspec:\n  runStrategy: Always\n  template:\n    spec:\n      domain:\n        memory: {guest: 32Mi}\n        devices: {}\n",
    )
    .unwrap();
    Api::<api::VirtualMachine>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &vm)
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    wait("the launcher Pod", async || {
        pods.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .next()
    })
    .await;
    let leases: Api<Lease> = Api::namespaced(client.clone(), "microvirt");
    let holder = leases
        .get("virt-controller")
        .await
        .unwrap()
        .spec
        .unwrap()
        .holder_identity;
    assert_eq!(holder.as_deref(), Some("replica-1"));

    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = wait("the process to exit", async || child.try_wait().unwrap()).await;
    assert!(status.success(), "{status}");
    let holder = leases
        .get("virt-controller")
        .await
        .unwrap()
        .spec
        .unwrap()
        .holder_identity;
    assert_eq!(holder, None, "the Lease is released on SIGTERM");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn run_without_a_cluster_says_how_it_looked_for_one() {
    let out = Command::new(env!("CARGO_BIN_EXE_virt-controller"))
        .args(["run", "--no-webhook", "--metrics-addr", "127.0.0.1:0"])
        .env("KUBECONFIG", "/nonexistent/kubeconfig")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("in-cluster config or $KUBECONFIG"), "{err}");
}
