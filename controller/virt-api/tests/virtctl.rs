//! virtctl → the API server's aggregation layer → the real virt-api binary → the API, with
//! virt-controller's real controllers carrying the changes out (the scheduler, kubelet and
//! virt-handler stand-ins of `tests::cluster`). virt-api runs as its deployed service account
//! under `deploy/rbac/`, reads the front-proxy settings the API server publishes and patches
//! its own CA bundle into the APIServices `deploy/virt-api.yaml` defines; users are held to
//! KubeVirt's `kubevirt.io:edit` / `kubevirt.io:view` roles.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use api::{RunStrategy, VirtualMachine, VirtualMachineInstance, VirtualMachineInstanceMigration};
use kube::api::Api;
use kube::ResourceExt;
use tests::cluster::{eventually, test_config, Cluster, Replica, NS};
use tests::rbac::Authorizer;
use tests::virt_api::grant;

const T: Duration = Duration::from_secs(20);

/// Alice may make Services too, as Kubernetes' `edit` lets her.
const SERVICES_EDITOR: &str = r#"
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: services-editor, namespace: default}
rules: [{apiGroups: [""], resources: ["services"], verbs: ["get", "create"]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: alice-services, namespace: default}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: services-editor}
subjects: [{kind: User, name: alice}]
"#;

struct Bench {
    c: Cluster,
    controller: Option<Replica>,
    virt_api: tests::virt_api::VirtApi,
    dir: PathBuf,
}

impl Drop for Bench {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

impl Bench {
    async fn start(tag: &str) -> Bench {
        let c = Cluster::start().await;
        c.api.enforce_rbac(
            Authorizer::from_dir(&repo().join("deploy/rbac"))
                .with_yaml(SERVICES_EDITOR)
                // Alice may edit VMs in `default`, Bob may only look.
                .with_yaml(&grant("alice", "kubevirt.io:edit", NS))
                .with_yaml(&grant("bob", "kubevirt.io:view", NS)),
        );
        let dir = std::env::temp_dir().join(format!("mv-virtctl-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let virt_api =
            tests::virt_api::start(&c, Path::new(env!("CARGO_BIN_EXE_virt-api")), &dir, &[]).await;
        for user in ["alice", "bob"] {
            c.api
                .write_kubeconfig(&dir.join(format!("{user}.kubeconfig")), Some(user));
        }
        Bench {
            controller: Some(c.replica(test_config(), None)),
            c,
            virt_api,
            dir,
        }
    }

    /// Runs virtctl as `user`, as `kubectl virt` would.
    async fn virtctl(&self, user: &str, args: &[&str]) -> Output {
        let kubeconfig = self.dir.join(format!("{user}.kubeconfig"));
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        tokio::task::spawn_blocking(move || {
            Command::new(env!("CARGO_BIN_EXE_virtctl"))
                .args(&args)
                .env("KUBECONFIG", kubeconfig)
                .output()
                .unwrap()
        })
        .await
        .unwrap()
    }

    async fn vm(&self, name: &str) -> VirtualMachine {
        self.c.api::<VirtualMachine>().get(name).await.unwrap()
    }

    /// A running VM `name` whose guest virt-handler reports at this host's loopback address
    /// (where the tests' stand-in guest services listen).
    async fn running_at_loopback(&self, name: &str) {
        use kube::api::{Patch, PatchParams};
        self.c
            .apply_yaml::<VirtualMachine>(&vm_yaml(name, "Always"))
            .await;
        self.c.bring_up(name, "node-a").await;
        let status = serde_json::json!({"status": {"interfaces": [{"name": "default", "ipAddress": "127.0.0.1"}]}});
        self.c
            .api::<VirtualMachineInstance>()
            .patch_status(name, &PatchParams::default(), &Patch::Merge(status))
            .await
            .unwrap();
    }

    async fn stop(mut self) {
        if let Some(r) = self.controller.take() {
            r.stop().await;
        }
    }
}

fn vm_yaml(name: &str, strategy: &str) -> String {
    format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: {name}, namespace: default}}
spec:
  runStrategy: {strategy}
  template:
    spec:
      domain:
        devices: {{}}
        resources: {{requests: {{memory: 64Mi}}}}
"#
    )
}

fn ok(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "virtctl failed ({:?}): {stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn refused(out: &Output) -> String {
    assert_eq!(
        out.status.code(),
        Some(1),
        "virtctl should have been refused: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_stop_and_restart_through_the_api_server() {
    let b = Bench::start("lifecycle").await;
    b.c.apply_yaml::<VirtualMachine>(&vm_yaml("web", "Halted"))
        .await;

    // A dry run changes nothing.
    let out = ok(&b.virtctl("alice", &["start", "web", "--dry-run"]).await);
    assert!(out.contains("dry run"), "{out}");
    assert_eq!(
        b.vm("web").await.spec.run_strategy,
        Some(RunStrategy::Halted)
    );

    let out = ok(&b.virtctl("alice", &["start", "web"]).await);
    assert_eq!(out.trim(), "VM web was scheduled to start");
    // virt-api asked the API server whether Alice may, before it changed anything.
    assert!(b.c.api.request_log().iter().any(|(m, p, code)| m == "POST"
        && p == "/apis/authorization.k8s.io/v1/subjectaccessreviews"
        && *code == 201));
    assert_eq!(
        b.vm("web").await.spec.run_strategy,
        Some(RunStrategy::Always)
    );
    let first = b.c.bring_up("web", "node-a").await;

    // A second start is refused in KubeVirt's words, and changes nothing.
    let err = refused(&b.virtctl("alice", &["start", "web"]).await);
    assert!(
        err.contains("Operation cannot be fulfilled on virtualmachine.kubevirt.io \"web\": VM is already running"),
        "{err}"
    );

    // Restart: the running VMI goes and a new one comes.
    ok(&b.virtctl("alice", &["restart", "web"]).await);
    let second = eventually("a new VMI after the restart", T, || async {
        b.c.kubelet_finish_deletions().await;
        let v =
            b.c.api::<VirtualMachineInstance>()
                .get_opt("web")
                .await
                .unwrap()?;
        (v.uid() != first.uid()).then_some(v)
    })
    .await;
    assert!(second.metadata.deletion_timestamp.is_none());
    eventually("the restart requests carried out", T, || async {
        let vm = b.vm("web").await;
        vm.status
            .is_some_and(|s| s.state_change_requests.is_empty())
            .then_some(())
    })
    .await;
    b.c.bring_up("web", "node-a").await;

    // Stop: runStrategy Halted, the VMI goes.
    let out = ok(&b.virtctl("alice", &["stop", "web"]).await);
    assert_eq!(out.trim(), "VM web was scheduled to stop");
    assert_eq!(
        b.vm("web").await.spec.run_strategy,
        Some(RunStrategy::Halted)
    );
    eventually("the VMI gone", T, || async {
        b.c.kubelet_finish_deletions().await;
        let v =
            b.c.api::<VirtualMachineInstance>()
                .get_opt("web")
                .await
                .unwrap();
        v.is_none().then_some(())
    })
    .await;
    let err = refused(&b.virtctl("alice", &["stop", "web"]).await);
    assert!(err.contains("VM is not running"), "{err}");
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_makes_a_migration_and_migrate_cancel_removes_it() {
    let b = Bench::start("migrate").await;
    // virt-controller's webhook in the admission path, as deployed.
    let webhook = tests::admission::start_webhook(
        Some(b.c.client.clone()),
        api::migratability::EvictionStrategy::None,
    )
    .await;
    webhook.register(&b.c.api).await;
    b.c.apply_yaml::<VirtualMachine>(&vm_yaml("db", "Always"))
        .await;
    let err = refused(&b.virtctl("alice", &["migrate", "nope"]).await);
    assert!(
        err.contains("virtualmachines.kubevirt.io \"nope\" not found"),
        "{err}"
    );
    b.c.bring_up("db", "node-a").await;
    let out = ok(&b.virtctl("alice", &["migrate", "db"]).await);
    assert_eq!(out.trim(), "VM db was scheduled to migrate");
    let vmims: Api<VirtualMachineInstanceMigration> = Api::namespaced(b.c.client.clone(), NS);
    let all = vmims.list(&Default::default()).await.unwrap().items;
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].spec.vmi_name, "db");
    assert!(all[0].name_any().starts_with("kubevirt-migrate-vm-"));

    let out = ok(&b.virtctl("alice", &["migrate-cancel", "db"]).await);
    assert!(
        out.contains("was scheduled to cancel its migration"),
        "{out}"
    );
    eventually("the migration gone", T, || async {
        let n = vmims.list(&Default::default()).await.unwrap().items.len();
        (n == 0).then_some(())
    })
    .await;
    let err = refused(&b.virtctl("alice", &["migrate-cancel", "db"]).await);
    assert!(err.contains("Found no migration to cancel for db"), "{err}");

    // A VMI that cannot be live-migrated (bridge binding on the Pod network): the webhook's
    // reason reaches the user, and no migration is made.
    b.c.apply_yaml::<VirtualMachine>(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: pinned, namespace: default}
spec:
  runStrategy: Always
  template:
    spec:
      domain:
        devices:
          interfaces: [{name: default, bridge: {}}]
        resources: {requests: {memory: 64Mi}}
      networks: [{name: default, pod: {}}]
"#,
    )
    .await;
    b.c.bring_up("pinned", "node-a").await;
    eventually("LiveMigratable=False published", T, || async {
        let v =
            b.c.api::<VirtualMachineInstance>()
                .get("pinned")
                .await
                .unwrap();
        let s = v.status?;
        api::conditions::find(&s.conditions, "LiveMigratable")
            .filter(|c| c.status == "False")
            .map(|_| ())
    })
    .await;
    let err = refused(&b.virtctl("alice", &["migrate", "pinned"]).await);
    assert!(
        err.contains("cannot be live-migrated") && err.contains("InterfaceNotLiveMigratable"),
        "{err}"
    );
    assert!(vmims
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .is_empty());
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn who_may_do_what_and_answers_for_what_microvirt_lacks() {
    let b = Bench::start("authz").await;
    b.c.apply_yaml::<VirtualMachine>(&vm_yaml("app", "Always"))
        .await;
    b.c.bring_up("app", "node-a").await;

    // Bob may look, not stop.
    let err = refused(&b.virtctl("bob", &["stop", "app"]).await);
    assert!(
        err.contains("User \"bob\" cannot update resource \"virtualmachines/stop\" in API group \"subresources.kubevirt.io\""),
        "{err}"
    );
    assert_eq!(
        b.vm("app").await.spec.run_strategy,
        Some(RunStrategy::Always)
    );
    // A guest-agent query Bob may make, answered with why there is no answer.
    let err = refused(&b.virtctl("bob", &["guestosinfo", "app"]).await);
    assert!(
        err.contains("VMI does not have guest agent connected"),
        "{err}"
    );
    let err = refused(&b.virtctl("alice", &["vnc", "app"]).await);
    assert!(err.contains("no graphics device"), "{err}");
    let err = refused(&b.virtctl("alice", &["start", "app", "--paused"]).await);
    assert!(err.contains("startStrategy"), "{err}");
    // A stopped VM has no console to open.
    b.c.apply_yaml::<VirtualMachine>(&vm_yaml("off", "Halted"))
        .await;
    let err = refused(&b.virtctl("alice", &["console", "off"]).await);
    assert!(
        err.contains("virtualmachineinstances.kubevirt.io \"off\" not found"),
        "{err}"
    );
    let err = refused(&b.virtctl("alice", &["start", "ghost"]).await);
    assert!(err.contains("\"ghost\" not found"), "{err}");
    let err = refused(
        &b.virtctl("alice", &["stop", "app", "--grace-period", "3"])
            .await,
    );
    assert!(
        err.contains("--force and --grace-period go together"),
        "{err}"
    );

    // Straight to virt-api, past the API server: the identity headers alone are not believed.
    let out = tokio::task::spawn_blocking({
        let addr = b.virt_api.addr;
        move || {
            Command::new("curl")
                .args(["-sk", "-X", "PUT", "-H", "X-Remote-User: system:admin", "-H", "X-Remote-Group: system:masters"])
                .arg(format!("https://{addr}/apis/subresources.kubevirt.io/v1/namespaces/default/virtualmachines/app/stop"))
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    let body = String::from_utf8_lossy(&out.stdout);
    assert!(body.contains("\"code\":401"), "{body}");
    assert_eq!(
        b.vm("app").await.spec.run_strategy,
        Some(RunStrategy::Always)
    );

    // version: the client's and virt-api's.
    let out = ok(&b.virtctl("bob", &["version"]).await);
    assert!(
        out.contains("Client Version") && out.contains("Server Version"),
        "{out}"
    );
    assert!(out.contains("-microvirt"), "{out}");
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_finds_the_plugin() {
    let b = Bench::start("plugin").await;
    // `kubectl-virt` on PATH is virtctl, as the install puts it.
    let bin = b.dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_virtctl"), bin.join("kubectl-virt")).unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let kubeconfig = b.dir.join("alice.kubeconfig");
    let out = tokio::task::spawn_blocking({
        let path = path.clone();
        move || {
            Command::new("kubectl")
                .args(["plugin", "list"])
                .env("PATH", path)
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("kubectl-virt"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = tokio::task::spawn_blocking(move || {
        Command::new("kubectl")
            .args(["virt", "version"])
            .env("PATH", path)
            .env("KUBECONFIG", kubeconfig)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("Server Version"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_vm_applies_and_expose_makes_a_service() {
    let b = Bench::start("create").await;
    let out = ok(&b
        .virtctl(
            "alice",
            &[
                "create",
                "vm",
                "--name",
                "made",
                "--volume-containerdisk",
                "src:quay.io/containerdisks/fedora:40,name:root",
                "--cloud-init-user-data",
                "I2Nsb3VkLWNvbmZpZwo=",
            ],
        )
        .await);
    // `virtctl create vm … | kubectl apply -f -`, as the admin.
    let admin = b.dir.join("admin.kubeconfig");
    b.c.api.write_kubeconfig(&admin, None);
    let applied = tokio::task::spawn_blocking(move || {
        let mut child = Command::new("kubectl")
            .args(["apply", "-f", "-"])
            .env("KUBECONFIG", admin)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(out.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    })
    .await
    .unwrap();
    tests::expect_success(&applied, "");
    let vm = b.vm("made").await;
    let spec = vm.spec.template.spec.clone().unwrap();
    assert_eq!(spec.volumes[0].name, "root");
    assert_eq!(
        spec.volumes[0].container_disk.as_ref().unwrap().image,
        "quay.io/containerdisks/fedora:40"
    );
    // A bad flag: which, and why; nothing printed to apply.
    let out = b
        .virtctl("alice", &["create", "vm", "--volume-pvc", "claim:x"])
        .await;
    let err = refused(&out);
    assert!(
        err.contains("--volume-pvc") && err.contains("claim"),
        "{err}"
    );
    assert!(out.stdout.is_empty());

    // expose: a Service selecting the VM's Pods by its template's labels.
    b.c.apply_yaml::<VirtualMachine>(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: labelled, namespace: default}
spec:
  runStrategy: Halted
  template:
    metadata: {labels: {app: labelled}}
    spec:
      domain:
        devices: {}
        resources: {requests: {memory: 64Mi}}
"#,
    )
    .await;
    let out = ok(&b
        .virtctl(
            "alice",
            &[
                "expose",
                "vm",
                "labelled",
                "--name",
                "labelled-ssh",
                "--port",
                "2222",
                "--target-port",
                "22",
            ],
        )
        .await);
    assert!(out.contains("labelled-ssh successfully exposed"), "{out}");
    let svc = Api::<k8s_openapi::api::core::v1::Service>::namespaced(b.c.client.clone(), NS)
        .get("labelled-ssh")
        .await
        .unwrap();
    let spec = svc.spec.unwrap();
    assert_eq!(spec.selector.unwrap()["app"], "labelled");
    assert_eq!(spec.ports.unwrap()[0].port, 2222);
    let err = refused(
        &b.virtctl(
            "alice",
            &["expose", "vm", "made", "--name", "x", "--port", "80"],
        )
        .await,
    );
    assert!(err.contains("without any label"), "{err}");
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expand_shows_the_vm_as_its_instance_type_and_preference_make_it() {
    use api::instancetype::{VirtualMachineClusterInstancetype, VirtualMachinePreference};
    let b = Bench::start("expand").await;
    Api::<VirtualMachineClusterInstancetype>::all(b.c.client.clone())
        .create(
            &Default::default(),
            &serde_yaml::from_str(
                "apiVersion: instancetype.kubevirt.io/v1beta1\nkind: VirtualMachineClusterInstancetype\nmetadata: {name: u1.medium}\nspec: {cpu: {guest: 4}, memory: {guest: 2Gi}}\n",
            )
            .unwrap(),
        )
        .await
        .unwrap();
    b.c.apply_yaml::<VirtualMachinePreference>(
        "apiVersion: instancetype.kubevirt.io/v1beta1\nkind: VirtualMachinePreference\nmetadata: {name: cores}\nspec:\n  cpu: {preferredCPUTopology: preferCores}\n",
    )
    .await;
    b.c.apply_yaml::<VirtualMachine>(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: sized, namespace: default}
spec:
  runStrategy: Halted
  instancetype: {name: u1.medium}
  preference: {kind: VirtualMachinePreference, name: cores}
  template:
    spec:
      domain: {devices: {}}
"#,
    )
    .await;
    let out = ok(&b
        .virtctl("bob", &["expand", "--vm", "sized", "-o", "json"])
        .await);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let domain = &v["spec"]["template"]["spec"]["domain"];
    assert_eq!(domain["cpu"]["cores"], 4, "{out}");
    assert_eq!(domain["cpu"]["sockets"], 1, "{out}");
    assert_eq!(domain["memory"]["guest"], "2Gi", "{out}");
    assert!(
        v["spec"]["instancetype"].is_null() && v["spec"]["preference"].is_null(),
        "{out}"
    );
    // Nothing written: the VM is as it was applied (but for what virt-controller records).
    assert!(b.vm("sized").await.spec.instancetype.is_some());

    b.c.apply_yaml::<VirtualMachine>(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: unsized, namespace: default}
spec:
  runStrategy: Halted
  instancetype: {name: u9.nowhere}
  template:
    spec:
      domain: {devices: {}}
"#,
    )
    .await;
    let err = refused(&b.virtctl("bob", &["expand", "--vm", "unsized"]).await);
    assert!(err.contains("\"u9.nowhere\" not found"), "{err}");
    b.stop().await;
}

/// A TCP echo server standing in for a service in the guest: the probe guest has no TCP/IP
/// stack, so the VMI's reported address is this host's loopback and the server listens there
/// (what port-forward carries is the same bytes either way).
async fn echo_server() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((conn, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let (mut r, mut w) = conn.into_split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_forward_carries_a_tcp_connection_to_the_guest() {
    let b = Bench::start("portforward").await;
    b.running_at_loopback("srv").await;
    let port = echo_server().await;

    // --stdio, as ssh's ProxyCommand runs it.
    let kubeconfig = b.dir.join("alice.kubeconfig");
    let target = format!("vmi/srv.{NS}");
    let out = tokio::task::spawn_blocking({
        let kubeconfig = kubeconfig.clone();
        let target = target.clone();
        move || {
            use std::io::Write;
            let mut child = Command::new(env!("CARGO_BIN_EXE_virtctl"))
                .args(["port-forward", "--stdio", &target, &port.to_string()])
                .env("KUBECONFIG", kubeconfig)
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            child
                .stdin
                .take()
                .unwrap()
                .write_all(b"hello over a websocket\n")
                .unwrap();
            child.wait_with_output().unwrap()
        }
    })
    .await
    .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "hello over a websocket\n",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Listening locally: any free port, printed; a connection there reaches the guest's port.
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_virtctl"))
        .args(["port-forward", "vm/srv", &format!("0:{port}")])
        .env("KUBECONFIG", &kubeconfig)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    tokio::io::AsyncBufReadExt::read_line(&mut lines, &mut line)
        .await
        .unwrap();
    let local: std::net::SocketAddr = line
        .strip_prefix("Forwarding from ")
        .and_then(|l| l.split(" -> ").next())
        .unwrap_or_else(|| panic!("{line}"))
        .parse()
        .unwrap();
    for _ in 0..2 {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut conn = tokio::net::TcpStream::connect(local).await.unwrap();
        conn.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        tokio::time::timeout(T, conn.read_exact(&mut got))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&got, b"ping");
    }
    let _ = child.kill().await;

    // Nothing listening on that port: said at once. Bob may not forward.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let err = refused(
        &b.virtctl(
            "alice",
            &["port-forward", "--stdio", "vmi/srv", &closed.to_string()],
        )
        .await,
    );
    assert!(err.contains("dialing 127.0.0.1"), "{err}");
    let err = refused(
        &b.virtctl(
            "bob",
            &["port-forward", "--stdio", "vmi/srv", &port.to_string()],
        )
        .await,
    );
    assert!(err.contains("virtualmachineinstances/portforward"), "{err}");
    b.stop().await;
}

/// OpenSSH's sshd on loopback, standing in for the guest's (the probe has no TCP/IP stack):
/// a host key and root's authorized key made for the test. Killed on drop.
struct Sshd(std::process::Child);

impl Drop for Sshd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn sshd(dir: &Path) -> (Sshd, u16, PathBuf) {
    assert!(
        Path::new("/usr/sbin/sshd").exists(),
        "needs OpenSSH's sshd (openssh-server, installed by scripts/install-prerequisites)"
    );
    std::fs::create_dir_all("/run/sshd").unwrap();
    let keygen = |path: &Path| {
        let ok = Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-f"])
            .arg(path)
            .status()
            .unwrap()
            .success();
        assert!(ok);
    };
    keygen(&dir.join("host_key"));
    keygen(&dir.join("user_key"));
    std::fs::copy(dir.join("user_key.pub"), dir.join("authorized_keys")).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = dir.join("sshd_config");
    std::fs::write(
        &config,
        format!(
            "ListenAddress 127.0.0.1\nPort {port}\nHostKey {}\nPidFile {}\nAuthorizedKeysFile {}\nStrictModes no\nPermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nSubsystem sftp internal-sftp\n",
            dir.join("host_key").display(),
            dir.join("sshd.pid").display(),
            dir.join("authorized_keys").display()
        ),
    )
    .unwrap();
    let child = Command::new("/usr/sbin/sshd")
        .args(["-D", "-e", "-f"])
        .arg(&config)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "sshd did not listen"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    (Sshd(child), port, dir.join("user_key"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ssh_and_scp_go_through_port_forward() {
    let b = Bench::start("ssh").await;
    b.running_at_loopback("shell").await;
    let (_sshd, port, key) = sshd(&b.dir);
    let port = port.to_string();
    let key = key.to_string_lossy().into_owned();
    let opts = [
        "--local-ssh-opts=-o StrictHostKeyChecking=no",
        "--local-ssh-opts=-o UserKnownHostsFile=/dev/null",
        "--local-ssh-opts=-o LogLevel=ERROR",
    ];
    let mut args = vec!["ssh", "root@vm/shell", "-p", &port, "-i", &key];
    args.extend(opts);
    args.extend(["--command", "echo hello from $(hostname -s) && echo done"]);
    let out = ok(&b.virtctl("alice", &args).await);
    assert!(
        out.contains("hello from") && out.ends_with("done\n"),
        "{out}"
    );

    // scp there and back.
    let sent = b.dir.join("sent.txt");
    std::fs::write(&sent, "a file for the guest\n").unwrap();
    let remote = format!(
        "root@vmi/shell.{NS}:{}",
        b.dir.join("in-guest.txt").display()
    );
    let mut args = vec![
        "scp",
        sent.to_str().unwrap(),
        &remote,
        "-p",
        &port,
        "-i",
        &key,
    ];
    args.extend(opts);
    ok(&b.virtctl("alice", &args).await);
    let back = b.dir.join("back.txt");
    let mut args = vec![
        "scp",
        &remote,
        back.to_str().unwrap(),
        "-p",
        &port,
        "-i",
        &key,
    ];
    args.extend(opts);
    ok(&b.virtctl("alice", &args).await);
    assert_eq!(
        std::fs::read_to_string(back).unwrap(),
        "a file for the guest\n"
    );

    // Neither side remote: said which shape is wanted.
    let err = refused(&b.virtctl("alice", &["scp", "a", "b"]).await);
    assert!(err.contains("[user@]vm|vmi/NAME[.NS]:PATH"), "{err}");
    b.stop().await;
}
