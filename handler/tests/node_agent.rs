//! The real `virt-handler` binary against the in-process API server (under its deploy/ RBAC),
//! with virt-controller running and a real launcher process per Pod booting the probe: the
//! handler, not the test, turns the VMI Running; it survives its own restart without touching
//! the guest, and reports a launcher that died.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use api::{VirtualMachineInstance, VmiPhase};
use tests::cluster::{eventually, test_config, Cluster};
use tests::rbac::service_account_user;

const NODE: &str = "node-1";

/// Builds virt-launcher (another package's binary) once and returns its path.
fn launcher_bin() -> PathBuf {
    let status = Command::new(env!("CARGO"))
        .args([
            "build",
            "--quiet",
            "-p",
            "launcher",
            "--bin",
            "virt-launcher",
        ])
        .current_dir(tests::repo_root())
        .status()
        .unwrap();
    assert!(status.success());
    tests::repo_root().join("target/debug/virt-launcher")
}

struct Proc(Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What a kubelet does for a launcher Pod bound to this node: the `compute` container, i.e.
/// `virt-launcher daemon` with its socket in the Pod's `sockets` volume.
fn start_launcher(pods_dir: &Path, uid: &str, work: &Path) -> Proc {
    // In the Pod the launcher binds a short path in its `sockets` volume; the node sees it
    // under the kubelet's (long) pods directory. A symlink stands in for that mount.
    let socket = handler::launcher::socket_path(pods_dir, uid);
    std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
    let short = std::env::temp_dir().join(format!("mvh-{}-{}.sock", std::process::id(), &uid[..8]));
    let _ = std::fs::remove_file(&short);
    let _ = std::fs::remove_file(&socket);
    std::os::unix::fs::symlink(&short, &socket).unwrap();
    let child = Command::new(launcher_bin())
        .arg("daemon")
        .arg("--socket")
        .arg(&short)
        .arg("--image-dir")
        .arg(work.join("images"))
        .arg("--state-dir")
        .arg(work.join("state"))
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    tests::wait_for_path(&short, Duration::from_secs(10));
    Proc(child)
}

fn start_handler(cluster: &Cluster, pods_dir: &Path, work: &Path) -> Proc {
    let kubeconfig = work.join("handler.kubeconfig");
    cluster.api.write_kubeconfig(
        &kubeconfig,
        Some(&service_account_user("microvirt", "virt-handler")),
    );
    Proc(
        Command::new(env!("CARGO_BIN_EXE_virt-handler"))
            .args(["run", "--node-name", NODE, "--resync-seconds", "1"])
            .arg("--pods-dir")
            .arg(pods_dir)
            .env("KUBECONFIG", &kubeconfig)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    )
}

const VMI: &str = r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: probe}
spec:
  terminationGracePeriodSeconds: 5
  domain:
    memory: {guest: 64Mi}
    devices: {autoattachPodInterface: false}
    firmware:
      kernelBoot:
        container: {image: "microvirt/probe:latest", kernelPath: /probe}
        kernelArgs: "console=ttyS0 probe.test=console"
"#;

fn condition(vmi: &VirtualMachineInstance, t: &str) -> Option<(String, Option<String>)> {
    vmi.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == t)
        .map(|c| (c.status.clone(), c.reason.clone()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_syncs_the_launcher_and_keeps_the_vmi_status_true() {
    tests::require_kvm();
    let work = tests::probe_workdir("mv-handler");
    let pods_dir = work.join("pods");
    let cluster = Cluster::start().await;
    let _controller = cluster.replica(test_config(), None);
    let vmis = cluster.api::<VirtualMachineInstance>();
    cluster.apply_yaml::<VirtualMachineInstance>(VMI).await;
    let t = Duration::from_secs(30);
    let vmi = eventually("the VMI", t, || async {
        vmis.get_opt("probe").await.unwrap()
    })
    .await;
    let pod = eventually("the launcher Pod", t, || async {
        cluster.pods_of(&vmi).await.into_iter().next()
    })
    .await;
    let pod_name = pod.metadata.name.clone().unwrap();
    let uid = pod.metadata.uid.clone().unwrap();
    cluster.kubelet_run(&pod_name, NODE).await;
    let launcher = start_launcher(&pods_dir, &uid, &work);
    let handler = start_handler(&cluster, &pods_dir, &work);

    // The handler Syncs the VMI into the launcher and reports it Running.
    let running = eventually(
        "VMI Running (set by virt-handler)",
        Duration::from_secs(60),
        || async {
            let v = vmis.get("probe").await.unwrap();
            let ready = condition(&v, "Ready").is_some_and(|(s, _)| s == "True");
            (v.status.as_ref()?.phase == Some(VmiPhase::Running) && ready).then_some(v)
        },
    )
    .await;
    let s = running.status.clone().unwrap();
    assert_eq!(s.node_name.as_deref(), Some(NODE));
    assert_eq!(
        s.launcher_container_image_version.as_deref(),
        Some(env!("CARGO_PKG_VERSION"))
    );
    assert_eq!(
        condition(&running, "Synchronized").map(|c| c.0).as_deref(),
        Some("True")
    );
    let kvm = vmm::KvmContext::open().unwrap();
    assert_eq!(
        condition(&running, "SoftwareEmulation").is_some(),
        kvm.acceleration.is_software_emulated()
    );

    // A handler restart leaves the guest alone: the same launcher still runs the same VM.
    let uptime = |pods_dir: PathBuf, uid: String| async move {
        let mut c = handler::launcher::LauncherClient::connect(
            &handler::launcher::socket_path(&pods_dir, &uid),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        c.status().await.unwrap().uptime_seconds
    };
    let before = uptime(pods_dir.clone(), uid.clone()).await;
    drop(handler);
    let _handler = start_handler(&cluster, &pods_dir, &work);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = uptime(pods_dir.clone(), uid.clone()).await;
    assert!(
        after > before,
        "the guest was restarted ({before} s → {after} s)"
    );
    assert_eq!(
        vmis.get("probe").await.unwrap().status.unwrap().phase,
        Some(VmiPhase::Running)
    );

    // The launcher dies: the handler says it cannot reach it; the Pod's end fails the VMI.
    drop(launcher);
    eventually(
        "Synchronized=False LauncherUnreachable",
        Duration::from_secs(30),
        || async {
            let v = vmis.get("probe").await.unwrap();
            (condition(&v, "Synchronized")
                == Some(("False".into(), Some("LauncherUnreachable".into()))))
            .then_some(())
        },
    )
    .await;
    cluster.kubelet_exit(&pod_name, 137).await;
    eventually("VMI Failed", t, || async {
        let v = vmis.get("probe").await.unwrap();
        (v.status?.phase == Some(VmiPhase::Failed)).then_some(())
    })
    .await;
    let _ = std::fs::remove_dir_all(work);
}
