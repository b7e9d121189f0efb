//! The console path end to end, every hop real: `virtctl console` → the API server's
//! aggregation layer (websocket upgrade) → the virt-api binary → mutual TLS → this node's
//! virt-handler → the launcher's console stream → the probe guest, which echoes what it is
//! sent. `virtctl pause/unpause vmi` go the same way to the launcher; the guest's ticks stop
//! and start again. `virtctl soft-reboot` reboots the guest in its launcher, the VMI and the
//! console staying. Strangers on the handler's console port are refused.

mod common;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use api::{VirtualMachineInstance, VmiPhase};
use common::*;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams, PostParams};
use tests::cluster::{eventually, test_config, Cluster};
use tests::rbac::Authorizer;
use tests::virt_api::grant;

/// Builds virt-api and virtctl (another package's binaries) and returns their directory.
fn virt_api_bins() -> PathBuf {
    let status = Command::new(env!("CARGO"))
        .args(["build", "--quiet", "-p", "virt-api", "--bins"])
        .current_dir(tests::repo_root())
        .status()
        .unwrap();
    assert!(status.success());
    tests::repo_root().join("target/debug")
}

/// The virt-handler Pod as the DaemonSet's would be seen: on `node`, its console port named.
async fn handler_pod(cluster: &Cluster, node: &str, console: std::net::SocketAddr) {
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), "microvirt");
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("virt-handler-{node}"), "namespace": "microvirt",
                     "labels": {"app.kubernetes.io/name": "virt-handler"}},
        "spec": {"nodeName": node, "containers": [{"name": "virt-handler", "image": "virt-handler",
                 "ports": [{"name": "console", "containerPort": console.port()}]}]}
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    pods.patch_status(
        &format!("virt-handler-{node}"),
        &PatchParams::default(),
        &Patch::Merge(
            serde_json::json!({"status": {"phase": "Running", "podIP": console.ip().to_string()}}),
        ),
    )
    .await
    .unwrap();
}

/// A `virtctl console` session: its output gathered as it comes, its input ours to type.
struct ConsoleSession {
    child: std::process::Child,
    output: Arc<Mutex<String>>,
}

impl ConsoleSession {
    fn open(bins: &Path, kubeconfig: &Path, vmi: &str) -> ConsoleSession {
        let mut child = Command::new(bins.join("virtctl"))
            .args(["console", vmi])
            .env("KUBECONFIG", kubeconfig)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let output = Arc::new(Mutex::new(String::new()));
        let mut stdout = child.stdout.take().unwrap();
        let sink = output.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stdout.read(&mut buf) {
                if n == 0 {
                    return;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        ConsoleSession { child, output }
    }

    fn text(&self) -> String {
        self.output.lock().unwrap().clone()
    }

    fn ticks(&self) -> usize {
        self.text().matches("tick ").count()
    }

    fn type_bytes(&mut self, bytes: &[u8]) {
        let stdin = self.child.stdin.as_mut().unwrap();
        stdin.write_all(bytes).unwrap();
        stdin.flush().unwrap();
    }

    async fn wait_for(&self, what: &str, timeout: Duration) {
        let started = Instant::now();
        while !self.text().contains(what) {
            assert!(
                started.elapsed() < timeout,
                "{what:?} never came; the console showed: {}",
                self.text()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for ConsoleSession {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn virtctl(bins: &Path, kubeconfig: &Path, args: &[&str]) -> std::process::Output {
    Command::new(bins.join("virtctl"))
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_pause_unpause_and_soft_reboot_through_every_hop() {
    tests::require_kvm();
    let bins = virt_api_bins();
    let work = tests::probe_workdir("mv-console");
    let pods_dir = work.join("pods");
    let cluster = Cluster::start().await;
    cluster.api.enforce_rbac(
        Authorizer::from_dir(&tests::repo_root().join("deploy/rbac"))
            .with_yaml(&grant("alice", "kubevirt.io:edit", "default"))
            .with_yaml(&grant("bob", "kubevirt.io:view", "default")),
    );
    let _controller = cluster.replica(test_config(), None);
    // The node's certificate (the cluster's node CA) and virt-api's client certificate (its
    // own CA).
    let node_dir = tests::tls::write_dirs(&work.join("node-pki"), &[NODE]).remove(0);
    let api_dir = tests::tls::write_dirs(&work.join("api-pki"), &["virt-api"]).remove(0);
    let handler = start_handler_args(
        NODE,
        &cluster,
        &pods_dir,
        &work,
        Some(&node_dir),
        &[format!(
            "--api-client-ca={}",
            api_dir.join("ca.crt").display()
        )],
    );
    let console_addr = handler.2.expect("the handler serves consoles");
    handler_pod(&cluster, NODE, console_addr).await;
    let handler_flags = [
        format!("--handler-ca={}", node_dir.join("ca.crt").display()),
        format!(
            "--handler-client-cert={}",
            api_dir.join("tls.crt").display()
        ),
        format!("--handler-client-key={}", api_dir.join("tls.key").display()),
    ];
    let _virt_api =
        tests::virt_api::start(&cluster, &bins.join("virt-api"), &work, &handler_flags).await;

    // The probe's console test echoes every byte it is sent, and ticks meanwhile.
    // With probe.cad=reboot it also reboots on Ctrl-Alt-Del, as Linux's init does.
    cluster
        .apply_yaml::<VirtualMachineInstance>(
            &VMI.replace("probe.test=console", "probe.test=console probe.cad=reboot"),
        )
        .await;
    let pod = launcher_pod_of(&cluster, "probe").await;
    let uid = pod.metadata.uid.clone().unwrap();
    cluster
        .kubelet_run(pod.metadata.name.as_deref().unwrap(), NODE)
        .await;
    let _launcher = start_launcher(&pods_dir, &uid, &work);
    let vmis = cluster.api::<VirtualMachineInstance>();
    eventually("VMI Running", Duration::from_secs(60), || async {
        let v = vmis.get("probe").await.unwrap();
        (v.status?.phase == Some(VmiPhase::Running)).then_some(())
    })
    .await;

    let alice = work.join("alice.kubeconfig");
    cluster.api.write_kubeconfig(&alice, Some("alice"));
    let mut session = ConsoleSession::open(&bins, &alice, "probe");
    let t = Duration::from_secs(60);
    session.wait_for("tick ", t).await;
    session.type_bytes(b"hi");
    session.wait_for("echo h", t).await;
    session.wait_for("echo i", t).await;

    // A second viewer gets the recent history first, then sees what the first one types.
    let second = ConsoleSession::open(&bins, &alice, "probe");
    second.wait_for("echo i", t).await;
    session.type_bytes(b"!");
    session.wait_for("echo !", t).await;
    second.wait_for("echo !", t).await;
    drop(second);
    // Bob may look at VMs, not at their consoles.
    let bob = work.join("bob.kubeconfig");
    cluster.api.write_kubeconfig(&bob, Some("bob"));
    let out = virtctl(&bins, &bob, &["console", "probe"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("cannot get resource \"virtualmachineinstances/console\""),
        "{err}"
    );

    // Pause: the guest stops ticking; unpause: it goes on.
    let out = virtctl(&bins, &alice, &["pause", "vmi", "probe"]);
    tests::expect_success(&out, "");
    eventually("Paused=True", Duration::from_secs(20), || async {
        let v = vmis.get("probe").await.unwrap();
        (condition(&v, "Paused").map(|c| c.0).as_deref() == Some("True")).then_some(())
    })
    .await;
    let out = virtctl(&bins, &alice, &["pause", "vmi", "probe"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("VMI is already paused"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Ticks the guest wrote before it paused may still be on their way through the hops: wait
    // until none has come for a while (a running guest ticks several times a second, so this
    // never settles if the pause did not hold), then none may come at all.
    let settling = Instant::now();
    let mut held = session.ticks();
    loop {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let now = session.ticks();
        if now == held {
            break;
        }
        held = now;
        assert!(
            settling.elapsed() < t,
            "the guest kept ticking while paused"
        );
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(session.ticks(), held, "the guest ticked while paused");
    let out = virtctl(&bins, &alice, &["soft-reboot", "probe"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("VMI is paused"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = virtctl(&bins, &alice, &["unpause", "vmi", "probe"]);
    tests::expect_success(&out, "");
    let started = Instant::now();
    while session.ticks() <= held {
        assert!(started.elapsed() < t, "no tick after unpause");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Soft reboot: the guest reboots in its launcher; the VMI, its Pod and the console stay.
    let hellos = || {
        session
            .text()
            .matches("microvirt probe guest: hello")
            .count()
    };
    let before = hellos();
    let out = virtctl(&bins, &bob, &["soft-reboot", "probe"]);
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("cannot update resource \"virtualmachineinstances/softreboot\""),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = virtctl(&bins, &alice, &["soft-reboot", "probe"]);
    assert!(
        out.status.success()
            && String::from_utf8_lossy(&out.stdout)
                .contains("VMI probe was scheduled to soft-reboot"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    session.wait_for("probe: ctrl-alt-del, rebooting", t).await;
    let started = Instant::now();
    while hellos() <= before {
        assert!(
            started.elapsed() < t,
            "the guest did not boot again:\n{}",
            session.text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ticks = session.ticks();
    while session.ticks() <= ticks {
        assert!(started.elapsed() < t, "no tick after the reboot");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let v = vmis.get("probe").await.unwrap();
    assert_eq!(v.status.as_ref().unwrap().phase, Some(VmiPhase::Running));
    assert_eq!(
        launcher_pod_of(&cluster, "probe").await.metadata.uid,
        Some(uid.clone())
    );

    // Ctrl-] leaves; the guest runs on.
    session.type_bytes(&[0x1d]);
    let started = Instant::now();
    let status = loop {
        if let Some(s) = session.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "Ctrl-] did not leave the console"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success());
    assert_eq!(
        vmis.get("probe").await.unwrap().status.unwrap().phase,
        Some(VmiPhase::Running)
    );

    // Strangers on the handler's console port: without a client certificate 401; with a
    // certificate from another CA (the node's own) the handshake fails.
    let url = format!(
        "https://{NODE}:{}/v1/namespaces/default/virtualmachineinstances/probe/pause",
        console_addr.port()
    );
    let resolve = format!("{NODE}:{}:{}", console_addr.port(), console_addr.ip());
    let ca = node_dir.join("ca.crt");
    let out = Command::new("curl")
        .args(["-sS", "-X", "PUT", "--resolve", &resolve, "--cacert"])
        .arg(&ca)
        .arg(&url)
        .output()
        .unwrap();
    let body = String::from_utf8_lossy(&out.stdout);
    assert!(
        body.contains("\"code\":401"),
        "{body}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new("curl")
        .args(["-s", "-X", "PUT", "--resolve", &resolve, "--cacert"])
        .arg(&ca)
        .arg("--cert")
        .arg(node_dir.join("tls.crt"))
        .arg("--key")
        .arg(node_dir.join("tls.key"))
        .arg(&url)
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "a certificate from another CA was accepted: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(condition(&vmis.get("probe").await.unwrap(), "Paused").is_none());

    // The node's handler gone: a clear answer within seconds, not a hang.
    drop(handler);
    let asked = Instant::now();
    let out = virtctl(&bins, &alice, &["pause", "vmi", "probe"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("cannot be reached"),
        "{err}"
    );
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "{:?}",
        asked.elapsed()
    );
    let _ = std::fs::remove_dir_all(work);
}
