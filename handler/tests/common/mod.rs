//! What the node-agent tests share: the real virt-handler and virt-launcher processes, started
//! as the DaemonSet and the kubelet would start them, against the in-process API server.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use api::VirtualMachineInstance;
use tests::cluster::{eventually, Cluster};
use tests::rbac::service_account_user;

pub const NODE: &str = "node-1";

/// Builds virt-launcher (another package's binary) once and returns its path.
pub fn launcher_bin() -> PathBuf {
    tests::build_bin("launcher", "virt-launcher")
}

/// A child process killed on drop, with the metrics and console addresses it announced.
pub struct Proc(
    pub Child,
    pub Option<std::net::SocketAddr>,
    pub Option<std::net::SocketAddr>,
);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What a kubelet does for a launcher Pod bound to this node: the `compute` container, i.e.
/// `virt-launcher daemon` with its socket in the Pod's `sockets` volume.
pub fn start_launcher(pods_dir: &Path, uid: &str, work: &Path) -> Proc {
    start_launcher_in(None, pods_dir, uid, work)
}

/// `start_launcher`, in a network namespace standing in for the Pod's node.
pub fn start_launcher_in(netns: Option<&str>, pods_dir: &Path, uid: &str, work: &Path) -> Proc {
    start_launcher_logged(netns, pods_dir, uid, work, None)
}

/// `start_launcher_in`, with the launcher's stderr in `log` (else discarded).
pub fn start_launcher_logged(
    netns: Option<&str>,
    pods_dir: &Path,
    uid: &str,
    work: &Path,
    log: Option<&Path>,
) -> Proc {
    // In the Pod the launcher binds its socket in its `sockets` volume, which the node sees
    // under the kubelet's pods directory: here the launcher binds that path itself. The
    // directory belongs to the Pod's user, as the kubelet's emptyDir does.
    let socket = handler::launcher::socket_path(pods_dir, uid);
    spawn_launcher(netns, &socket, uid, work, log)
}

/// A launcher as `start_launcher_in` starts it, its control socket behind a proxy in the Pod
/// that records every byte virt-handler sends it (`tests/scripts/record-proxy.py`, itself in
/// the Pod's cgroup and network namespace as a process of the Pod would be). Returns the
/// launcher, the proxy and the recording's path.
pub fn start_recorded_launcher(
    netns: &str,
    pods_dir: &Path,
    uid: &str,
    work: &Path,
) -> (Proc, Proc, PathBuf) {
    let socket = handler::launcher::socket_path(pods_dir, uid);
    let behind = socket.with_file_name("launcher-behind-proxy.sock");
    let launcher_log = work.join(format!("launcher-{uid}.log"));
    let launcher = spawn_launcher(Some(netns), &behind, uid, work, Some(&launcher_log));
    let log = work.join(format!("sent-to-pod-{uid}.bin"));
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", netns, "python3"])
        .arg(tests::repo_root().join("tests/scripts/record-proxy.py"))
        .arg(&socket)
        .arg(&behind)
        .arg(&log);
    tests::in_pod_cgroup(&mut cmd, uid);
    let proxy = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    tests::wait_for_path(&socket, Duration::from_secs(10));
    (launcher, Proc(proxy, None, None), log)
}

/// Starts `virt-launcher daemon` with its control socket at `socket`.
pub fn spawn_launcher(
    netns: Option<&str>,
    socket: &Path,
    uid: &str,
    work: &Path,
    log: Option<&Path>,
) -> Proc {
    std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
    tests::chown_to_pod_user(socket.parent().unwrap());
    let _ = std::fs::remove_file(socket);
    let mut launcher = Command::new(launcher_bin());
    launcher
        .arg("daemon")
        .arg("--socket")
        .arg(socket)
        .arg("--image-dir")
        .arg(work.join("images"))
        .arg("--state-dir")
        .arg(work.join("state"))
        // Where the kubelet mounts the Pod's claims: here every claim is a directory of it.
        .arg("--volume-dir")
        .arg(work.join("volumes"))
        .env("RUST_LOG", "error");
    std::fs::create_dir_all(work.join("volumes")).unwrap();
    // As the rendered Pod runs it: its non-root user, no capabilities, its own /dev/kvm.
    tests::chown_to_pod_user(&work.join("state"));
    let unprivileged = tests::as_pod_user(&launcher, work);
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns])
                .arg(unprivileged.get_program())
                .args(unprivileged.get_args())
                .env("RUST_LOG", "error");
            c
        }
        None => unprivileged,
    };
    // The kubelet starts the Pod's containers in the Pod's cgroup; virt-handler checks it.
    tests::in_pod_cgroup(&mut cmd, uid);
    let child = cmd
        .stdout(Stdio::null())
        .stderr(match log {
            Some(l) => Stdio::from(std::fs::File::create(l).unwrap()),
            None => Stdio::null(),
        })
        .spawn()
        .unwrap();
    tests::wait_for_path(socket, Duration::from_secs(10));
    let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
    let uid = status.lines().find_map(|l| l.strip_prefix("Uid:")).unwrap();
    assert_eq!(
        uid.split_whitespace().next(),
        Some(tests::POD_UID.to_string().as_str()),
        "the launcher runs as the Pod's user"
    );
    Proc(child, None, None)
}

pub fn start_handler(cluster: &Cluster, pods_dir: &Path, work: &Path) -> Proc {
    start_handler_on(NODE, cluster, pods_dir, work)
}

pub fn start_handler_on(node: &str, cluster: &Cluster, pods_dir: &Path, work: &Path) -> Proc {
    start_handler_with(node, cluster, pods_dir, work, None)
}

pub fn start_handler_with(
    node: &str,
    cluster: &Cluster,
    pods_dir: &Path,
    work: &Path,
    tls_dir: Option<&Path>,
) -> Proc {
    start_handler_args(node, cluster, pods_dir, work, tls_dir, &[])
}

/// virt-handler on `node` with `extra` arguments; waits for its metrics address (and, when it
/// serves one, its console server's address).
pub fn start_handler_args(
    node: &str,
    cluster: &Cluster,
    pods_dir: &Path,
    work: &Path,
    tls_dir: Option<&Path>,
    extra: &[String],
) -> Proc {
    let kubeconfig = work.join(format!("handler-{node}.kubeconfig"));
    let account = service_account_user("microvirt", "virt-handler");
    if extra.iter().any(|a| a == "--request-node-certificate") {
        // The kubelet mounts a node-bound token: the API server knows the handler's node.
        cluster
            .api
            .write_kubeconfig_on_node(&kubeconfig, &account, node);
    } else {
        cluster.api.write_kubeconfig(&kubeconfig, Some(&account));
    }
    let console = extra.iter().any(|a| a.starts_with("--api-client-ca"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_virt-handler"))
        .args(["run", "--node-name", node, "--resync-seconds", "1"])
        .args(["--metrics-addr", "127.0.0.1:0", "--no-device-plugins"])
        .args(["--console-addr", "127.0.0.1:0"])
        .args(tls_dir.map(|d| format!("--migration-tls-dir={}", d.display())))
        .args(extra)
        // Each node's handler its own address (node-N: 127.0.0.N) for migration streams.
        .arg(format!(
            "--migration-address=127.0.0.{}",
            node.strip_prefix("node-")
                .and_then(|n| n.parse::<u8>().ok())
                .unwrap_or(1)
        ))
        .arg("--pods-dir")
        .arg(pods_dir)
        .env("KUBECONFIG", &kubeconfig)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Lines name the metrics (and console) addresses; everything is passed through.
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stderr.take().unwrap()));
    let (mut metrics, mut console_addr) = (None, None);
    while metrics.is_none() || (console && console_addr.is_none()) {
        let line = lines.next().expect("virt-handler ended").unwrap();
        eprintln!("{line}");
        if let Some(a) = line.split("metrics on http://").nth(1) {
            metrics = Some(a.trim_end_matches("/metrics").parse().unwrap());
        }
        if let Some(a) = line.split("console server on https://").nth(1) {
            console_addr = Some(a.trim().parse().unwrap());
        }
    }
    std::thread::spawn(move || {
        for l in lines.map_while(Result::ok) {
            eprintln!("{l}");
        }
    });
    Proc(child, metrics, console_addr)
}

pub const VMI: &str = r#"
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

/// The VMI `name` once virt-controller has made it, and its launcher Pod.
pub async fn launcher_pod_of(cluster: &Cluster, name: &str) -> k8s_openapi::api::core::v1::Pod {
    let t = Duration::from_secs(30);
    let vmis = cluster.api::<VirtualMachineInstance>();
    let vmi = eventually("the VMI", t, || async { vmis.get_opt(name).await.unwrap() }).await;
    eventually("the launcher Pod", t, || async {
        cluster.pods_of(&vmi).await.into_iter().next()
    })
    .await
}

pub fn condition(vmi: &VirtualMachineInstance, t: &str) -> Option<(String, Option<String>)> {
    vmi.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == t)
        .map(|c| (c.status.clone(), c.reason.clone()))
}
