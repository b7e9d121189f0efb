//! controller-bench: N VirtualMachines applied at once → N launcher Pods rendered and N VMIs
//! Scheduled, with the real `virt-controller run` process against the in-process API server.
//! A stand-in scheduler+kubelet binds every new Pod to one of 10 nodes and marks it Running.
//! Prints wall times, request counts and the controller process's RSS.
//!
//! Usage: cargo run --release -p bench --bin controller-bench [-- VMS]   (default 1000)

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use api::{VirtualMachine, VirtualMachineInstance, VmiPhase};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tests::apiserver::ApiServer;

const NODES: usize = 10;

fn controller_binary() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let path = exe.parent().unwrap().join("virt-controller");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // Built here (release, like this binary) so the figure is the shipped controller's.
    let release = exe.parent().unwrap().ends_with("release");
    let mut cmd = Command::new(cargo);
    cmd.args([
        "build",
        "-q",
        "-p",
        "controller",
        "--bin",
        "virt-controller",
    ]);
    if release {
        cmd.arg("--release");
    }
    if !cmd.status()?.success() {
        bail!("building virt-controller failed");
    }
    Ok(path)
}

fn rss_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn vm(i: usize) -> VirtualMachine {
    serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": format!("vm-{i:04}"), "namespace": "default"},
        "spec": {"runStrategy": "Always", "template": {
            "metadata": {"labels": {"app": "fleet"}},
            "spec": {
                "domain": {"cpu": {"cores": 1}, "memory": {"guest": "64Mi"},
                           "devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}]}},
                "volumes": [{"name": "root", "containerDisk": {"image": "quay.io/containerdisks/alpine:3.20"}}]
            }}}
    }))
    .expect("valid VM")
}

/// Binds and starts every unbound launcher Pod (the scheduler and kubelets of 10 nodes).
async fn kubelets(pods: Api<Pod>) {
    let mut next = 0usize;
    loop {
        let unbound = pods
            .list(&ListParams::default().fields("spec.nodeName="))
            .await
            .map(|l| l.items)
            .unwrap_or_default();
        let work = futures::stream::iter(unbound.into_iter().map(|p| {
            next += 1;
            let node = format!("node-{}", next % NODES);
            let pods = pods.clone();
            async move {
                let name = p.metadata.name.unwrap();
                let bind = json!({"spec": {"nodeName": node}});
                if pods.patch(&name, &PatchParams::default(), &Patch::Merge(bind)).await.is_ok() {
                    let run = json!({"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}});
                    let _ = pods.patch_status(&name, &PatchParams::default(), &Patch::Merge(run)).await;
                }
            }
        }));
        work.buffer_unordered(16).collect::<Vec<()>>().await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let n: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(1000);
    let bin = controller_binary()?;
    let api = ApiServer::start().await;
    let dir = std::env::temp_dir().join(format!("controller-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let kubeconfig = dir.join("kubeconfig");
    api.write_kubeconfig(&kubeconfig, None);
    let mut child = Command::new(&bin)
        .args(["run", "--no-webhook", "--metrics-addr", "127.0.0.1:0"])
        .env("KUBECONFIG", &kubeconfig)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let pid = child.id();
    let client = api.client();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (idle_rss, _) = rss_kib(pid);
    let requests_before = api.request_count();

    let vms: Api<VirtualMachine> = Api::namespaced(client.clone(), "default");
    let vmis: Api<VirtualMachineInstance> = Api::namespaced(client.clone(), "default");
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    tokio::spawn(kubelets(pods.clone()));

    let start = Instant::now();
    futures::stream::iter((0..n).map(|i| {
        let vms = vms.clone();
        async move { vms.create(&PostParams::default(), &vm(i)).await.map(|_| ()) }
    }))
    .buffer_unordered(32)
    .collect::<Vec<_>>()
    .await
    .into_iter()
    .collect::<Result<Vec<()>, _>>()?;
    let applied = start.elapsed();

    let mut pods_done = None;
    let mut peak_rss = 0;
    let deadline = Duration::from_secs(600);
    loop {
        let (rss, _) = rss_kib(pid);
        peak_rss = peak_rss.max(rss);
        let pod_count = api.objects("pods").len();
        if pods_done.is_none() && pod_count >= n {
            pods_done = Some(start.elapsed());
        }
        let scheduled = vmis
            .list(&ListParams::default())
            .await?
            .items
            .iter()
            .filter(|v| v.status.as_ref().and_then(|s| s.phase) == Some(VmiPhase::Scheduled))
            .count();
        if scheduled >= n {
            break;
        }
        if start.elapsed() > deadline {
            bail!("only {scheduled}/{n} VMIs Scheduled after {deadline:?}");
        }
        if let Some(status) = child.try_wait()? {
            bail!("virt-controller exited: {status}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let all_scheduled = start.elapsed();
    let (rss, hwm) = rss_kib(pid);
    let pods_total = api.objects("pods").len();
    let requests = api.request_count() - requests_before;
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);

    println!("controller-bench: {n} VirtualMachines, {NODES} nodes, virt-controller as a separate process");
    println!("| measure                                  | value        |");
    println!("|------------------------------------------|--------------|");
    println!(
        "| VMs applied (32 concurrent creates)      | {:>9.2} s  |",
        applied.as_secs_f64()
    );
    println!(
        "| all {n:>4} launcher Pods created           | {:>9.2} s  |",
        pods_done.unwrap_or(all_scheduled).as_secs_f64()
    );
    println!(
        "| all {n:>4} VMIs Scheduled                  | {:>9.2} s  |",
        all_scheduled.as_secs_f64()
    );
    println!("| launcher Pods in the end (duplicates?)   | {pods_total:>9}    |");
    println!("| API requests (all clients)               | {requests:>9}    |");
    println!(
        "| controller RSS idle                      | {:>9.1} MiB |",
        idle_rss as f64 / 1024.0
    );
    println!(
        "| controller RSS at the end / peak (HWM)   | {:>5.1} / {:>5.1} MiB |",
        rss as f64 / 1024.0,
        hwm.max(peak_rss) as f64 / 1024.0
    );
    if pods_total != n {
        bail!("{pods_total} launcher Pods for {n} VMIs");
    }
    Ok(())
}
