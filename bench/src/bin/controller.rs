//! controller-bench: N VirtualMachines applied at once → N VMIs Running, through the real
//! `virt-controller run` process and one real `virt-handler run` process per node (10 nodes),
//! against the in-process API server holding both to their deploy/rbac rules.
//!
//! A stand-in scheduler and kubelet binds every new launcher Pod to a node and starts in it,
//! in the Pod's cgroup, **`launcher-stand-in`**: the launcher control protocol with no VM
//! behind it (see its source), because 1000 guests do not fit on this machine. Everything
//! else is the shipped path: the controller renders the Pods and moves the VMIs to Scheduled,
//! each node's virt-handler finds the Pod's control socket below its pods directory, checks
//! the listener is that Pod's, Syncs the VMI and reports it Running. Prints wall times,
//! request counts and the processes' RSS.
//!
//! Usage: cargo run --release -p bench --bin controller-bench [-- VMS]   (default 1000)

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use api::VirtualMachine;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tests::cluster::{Cluster, CONTROLLER_NAMESPACE};
use tests::rbac::service_account_user;

const NODES: usize = 10;

/// Builds `bin` of `package` in this binary's profile (release for the figures: the shipped
/// code's) and returns its path.
fn built(package: &str, bin: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("the bench binary's directory")?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "-q", "-p", package, "--bin", bin]);
    if dir.ends_with("release") {
        cmd.arg("--release");
    }
    if !cmd.status()?.success() {
        bail!("building {bin} failed");
    }
    Ok(dir.join(bin))
}

/// Child processes killed (and their Pod cgroups removed) when the bench ends, however it ends.
#[derive(Default)]
struct Processes(Mutex<Vec<(Child, Option<PathBuf>)>>);

impl Processes {
    fn keep(&self, child: Child, cgroup: Option<PathBuf>) {
        self.0.lock().unwrap().push((child, cgroup));
    }

    /// CPU seconds used by the processes kept in Pod cgroups (the launcher stand-ins).
    fn stand_ins_cpu_seconds(&self) -> f64 {
        let all = self.0.lock().unwrap();
        all.iter()
            .filter(|(_, cgroup)| cgroup.is_some())
            .map(|(c, _)| cpu_seconds(&c.id().to_string()))
            .sum()
    }

    /// Kills every process kept so far and removes its Pod cgroup.
    fn stop_all(&self) {
        let mut all = self.0.lock().unwrap();
        for (c, _) in all.iter_mut() {
            let _ = c.kill();
        }
        for (mut c, cgroup) in all.drain(..) {
            let _ = c.wait();
            if let Some(dir) = cgroup {
                let _ = std::fs::remove_dir(dir);
            }
        }
    }
}

impl Drop for Processes {
    fn drop(&mut self) {
        self.stop_all();
    }
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

/// CPU time (user + system) the process `pid` (or `self`) has used, in seconds; 0 once it is
/// gone.
fn cpu_seconds(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The command name may hold spaces: the fields start after its closing parenthesis, with
    // the state (field 3); utime and stime are fields 14 and 15.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    let ticks = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<u64>().ok());
    // SAFETY: sysconf reads a constant.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    ticks(14)
        .zip(ticks(15))
        .map_or(0.0, |(u, s)| (u + s) as f64 / per_second)
}

fn vm(i: usize) -> VirtualMachine {
    serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": format!("vm-{i:04}"), "namespace": "default"},
        "spec": {"runStrategy": "Always", "template": {
            "metadata": {"labels": {"app": "fleet"}},
            "spec": {
                // No NIC: virt-handler would wire the Pod network in the stand-in's network
                // namespace, which is this host's (a stand-in Pod has none of its own).
                "domain": {"cpu": {"cores": 1}, "memory": {"guest": "64Mi"},
                           "devices": {"autoattachPodInterface": false,
                                       "disks": [{"name": "root", "disk": {"bus": "virtio"}}]}},
                "volumes": [{"name": "root", "containerDisk": {"image": "quay.io/containerdisks/alpine:3.20"}}]
            }}}
    }))
    .expect("valid VM")
}

/// What the stand-in kubelets need: each node's pods directory (node-K's is `pods_dirs[K]`),
/// the stand-in launcher's binary, and where its processes are kept.
struct Kubelets {
    pods: Api<Pod>,
    pods_dirs: Vec<PathBuf>,
    stand_in: PathBuf,
    processes: Arc<Processes>,
    /// Nanoseconds spent, summed over Pods: binding, the stand-in's start until its socket
    /// is there, reporting the Pod Running.
    spent: [std::sync::atomic::AtomicU64; 3],
}

impl Kubelets {
    /// Binds every unbound launcher Pod to the next node and starts it there (the scheduler
    /// and the kubelets of all nodes).
    async fn run(self: Arc<Self>) {
        let mut next = 0usize;
        loop {
            let unbound = self
                .pods
                .list(&ListParams::default().fields("spec.nodeName="))
                .await
                .map(|l| l.items)
                .unwrap_or_default();
            let work = futures::stream::iter(unbound.into_iter().map(|p| {
                next += 1;
                let me = self.clone();
                let node = next % NODES;
                async move {
                    let name = p.metadata.name.clone().unwrap_or_default();
                    if let Err(e) = me.start(p, node).await {
                        eprintln!("controller-bench: kubelet of node-{node}, Pod {name}: {e:#}");
                    }
                }
            }));
            work.buffer_unordered(32).collect::<Vec<()>>().await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Binds `pod` to node `node`, starts its launcher stand-in in the Pod's cgroup with its
    /// control socket where the kubelet puts the Pod's `sockets` volume, and reports the Pod
    /// Running once the socket is there (as the real Pod's readiness would).
    async fn start(&self, pod: Pod, node: usize) -> anyhow::Result<()> {
        let name = pod.metadata.name.context("a Pod without a name")?;
        let uid = pod.metadata.uid.context("a Pod without a UID")?;
        let spend = |i: usize, since: Instant| {
            let ns = since.elapsed().as_nanos() as u64;
            self.spent[i].fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
            Instant::now()
        };
        let t = Instant::now();
        let bind = json!({"spec": {"nodeName": format!("node-{node}")}});
        self.pods
            .patch(&name, &PatchParams::default(), &Patch::Merge(bind))
            .await
            .context("binding")?;
        let t = spend(0, t);
        let socket = api::launcher_pod::control_socket_on_node(&self.pods_dirs[node], &uid);
        std::fs::create_dir_all(socket.parent().context("socket directory")?)?;
        let child = Command::new(&self.stand_in)
            .arg(&socket)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", self.stand_in.display()))?;
        // Moved into the Pod's cgroup before the Pod is Running: virt-handler only looks for
        // the socket then, and refuses a listener outside the Pod's cgroup.
        let cgroup = tests::pod_cgroup(&uid);
        let pid = child.id();
        self.processes.keep(child, Some(cgroup.clone()));
        std::fs::write(cgroup.join("cgroup.procs"), pid.to_string())
            .with_context(|| format!("moving the stand-in into {}", cgroup.display()))?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while !socket.exists() {
            if Instant::now() > deadline {
                bail!(
                    "the launcher stand-in made no socket at {} in 30 s",
                    socket.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let t = spend(1, t);
        let run = json!({"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}});
        self.pods
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(run))
            .await
            .context("reporting the Pod Running")?;
        spend(2, t);
        Ok(())
    }
}

/// virt-handler for `node` under its service account, its pods directory `pods_dir`.
fn start_handler(
    cluster: &Cluster,
    bin: &Path,
    node: &str,
    pods_dir: &Path,
    dir: &Path,
) -> anyhow::Result<Child> {
    let kubeconfig = dir.join(format!("{node}.kubeconfig"));
    let account = service_account_user(CONTROLLER_NAMESPACE, "virt-handler");
    cluster.api.write_kubeconfig(&kubeconfig, Some(&account));
    std::fs::create_dir_all(pods_dir)?;
    let log = std::fs::File::create(dir.join(format!("{node}.log")))?;
    Command::new(bin)
        .args(["run", "--node-name", node, "--no-device-plugins"])
        .args([
            "--metrics-addr",
            "127.0.0.1:0",
            "--console-addr",
            "127.0.0.1:0",
        ])
        .arg("--pods-dir")
        .arg(pods_dir)
        .env("KUBECONFIG", &kubeconfig)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))
}

/// How many VMIs have reached Scheduled (or gone past it to Running), and how many Running,
/// read from the server's store (so the bench's own looks cost no requests).
fn phases(api: &tests::apiserver::ApiServer) -> (usize, usize) {
    let phase_in = |p: &'static [&'static str]| {
        move |v: &serde_json::Value| {
            v["status"]["phase"]
                .as_str()
                .is_some_and(|x| p.contains(&x))
        }
    };
    (
        api.count(
            "virtualmachineinstances",
            phase_in(&["Scheduled", "Running"]),
        ),
        api.count("virtualmachineinstances", phase_in(&["Running"])),
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let n: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(1000);
    let controller = built("controller", "virt-controller")?;
    let handler = built("handler", "virt-handler")?;
    let stand_in = built("bench", "launcher-stand-in")?;
    let cluster = Cluster::start().await;
    let dir = std::env::temp_dir().join(format!("controller-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let processes = Arc::new(Processes::default());

    let kubeconfig = dir.join("controller.kubeconfig");
    let account = service_account_user(CONTROLLER_NAMESPACE, "virt-controller");
    cluster.api.write_kubeconfig(&kubeconfig, Some(&account));
    let child = Command::new(&controller)
        .args(["run", "--no-webhook", "--metrics-addr", "127.0.0.1:0"])
        .env("KUBECONFIG", &kubeconfig)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", controller.display()))?;
    let controller_pid = child.id();
    processes.keep(child, None);
    let mut pods_dirs = Vec::new();
    let mut handler_pids = Vec::new();
    for k in 0..NODES {
        let node = format!("node-{k}");
        let pods_dir = dir.join(&node).join("pods");
        let child = start_handler(&cluster, &handler, &node, &pods_dir, &dir)?;
        handler_pids.push(child.id());
        processes.keep(child, None);
        pods_dirs.push(pods_dir);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (idle_rss, _) = rss_kib(controller_pid);
    let requests_before = cluster.api.request_count();
    let logged_before = cluster.api.request_log().len();

    let client = cluster.client.clone();
    let vms: Api<VirtualMachine> = Api::namespaced(client.clone(), "default");
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let kubelets = Arc::new(Kubelets {
        pods,
        pods_dirs,
        stand_in,
        processes: processes.clone(),
        spent: Default::default(),
    });
    let kubelet_task = tokio::spawn(kubelets.clone().run());

    let cpu_at_start = [
        cpu_seconds(&controller_pid.to_string()),
        handler_pids
            .iter()
            .map(|p| cpu_seconds(&p.to_string()))
            .sum(),
        cpu_seconds("self"),
    ];
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
    let mut scheduled_done = None;
    let mut peak_rss = 0;
    let deadline = Duration::from_secs(600);
    let mut next_report = Duration::from_secs(5);
    loop {
        peak_rss = peak_rss.max(rss_kib(controller_pid).0);
        if pods_done.is_none() && cluster.api.count("pods", |_| true) >= n {
            pods_done = Some(start.elapsed());
        }
        let (scheduled, running) = phases(&cluster.api);
        if start.elapsed() >= next_report {
            eprintln!(
                "controller-bench: {:>5.1} s: {} Pods, {scheduled} VMIs Scheduled, {running} Running",
                start.elapsed().as_secs_f64(),
                cluster.api.count("pods", |_| true)
            );
            next_report += Duration::from_secs(5);
        }
        if scheduled_done.is_none() && scheduled >= n {
            scheduled_done = Some(start.elapsed());
        }
        if running >= n {
            break;
        }
        if start.elapsed() > deadline {
            bail!(
                "only {running}/{n} VMIs Running ({scheduled} Scheduled) after {deadline:?}; the handlers' logs are in {}",
                dir.display()
            );
        }
        let exited = processes
            .0
            .lock()
            .unwrap()
            .iter_mut()
            .filter(|(_, cgroup)| cgroup.is_none())
            .find_map(|(c, _)| c.try_wait().ok().flatten().map(|s| (c.id(), s)));
        if let Some((pid, status)) = exited {
            bail!(
                "process {pid} (virt-controller or a virt-handler) exited: {status}; logs in {}",
                dir.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let all_running = start.elapsed();
    let cpu = [
        cpu_seconds(&controller_pid.to_string()) - cpu_at_start[0],
        handler_pids
            .iter()
            .map(|p| cpu_seconds(&p.to_string()))
            .sum::<f64>()
            - cpu_at_start[1],
        cpu_seconds("self") - cpu_at_start[2],
        processes.stand_ins_cpu_seconds(),
    ];
    kubelet_task.abort();
    let (rss, hwm) = rss_kib(controller_pid);
    let handler_rss: Vec<(u64, u64)> = handler_pids.iter().map(|p| rss_kib(*p)).collect();
    let handler_mean = handler_rss.iter().map(|r| r.0).sum::<u64>() as f64 / NODES as f64;
    let handler_peak = handler_rss.iter().map(|r| r.1).max().unwrap_or(0);
    let pods_total = cluster.api.objects("pods").len();
    let requests = cluster.api.request_count() - requests_before;
    let by_kind = requests_by_kind(&cluster.api.request_log()[logged_before..]);
    // Before their directories go (the stand-in kubelet still holds the list).
    processes.stop_all();
    let _ = std::fs::remove_dir_all(&dir);

    let secs = |d: Option<Duration>| d.unwrap_or(all_running).as_secs_f64();
    println!("controller-bench: {n} VirtualMachines, {NODES} nodes: virt-controller and one virt-handler per node as separate processes,");
    println!("a launcher stand-in (the control protocol, no VM) in each launcher Pod");
    println!("| measure                                      | value             |");
    println!("|----------------------------------------------|-------------------|");
    println!(
        "| VMs applied (32 concurrent creates)          | {:>9.2} s       |",
        applied.as_secs_f64()
    );
    println!(
        "| all {n:>4} launcher Pods created               | {:>9.2} s       |",
        secs(pods_done)
    );
    println!(
        "| all {n:>4} VMIs Scheduled (virt-controller)    | {:>9.2} s       |",
        secs(scheduled_done)
    );
    println!(
        "| all {n:>4} VMIs Running (virt-handler)         | {:>9.2} s       |",
        all_running.as_secs_f64()
    );
    println!("| launcher Pods in the end (duplicates?)       | {pods_total:>9}         |");
    println!("| API requests (all clients)                   | {requests:>9}         |");
    println!(
        "| virt-controller RSS idle                     | {:>9.1} MiB     |",
        idle_rss as f64 / 1024.0
    );
    println!(
        "| virt-controller RSS at the end / peak (HWM)  | {:>5.1} / {:>5.1} MiB |",
        rss as f64 / 1024.0,
        hwm.max(peak_rss) as f64 / 1024.0
    );
    println!(
        "| virt-handler RSS per node, mean / peak (HWM) | {:>5.1} / {:>5.1} MiB |",
        handler_mean / 1024.0,
        handler_peak as f64 / 1024.0
    );
    let mean_ms = |i: usize| {
        kubelets.spent[i].load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e6 / n as f64
    };
    println!(
        "| stand-in kubelet per Pod: bind / start until the socket / Running (mean, 32 at once) | {:.1} / {:.1} / {:.1} ms |",
        mean_ms(0),
        mean_ms(1),
        mean_ms(2)
    );
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "CPU seconds from the first create to all Running ({:.1} s × {cores} cores = {:.1} CPU s):",
        all_running.as_secs_f64(),
        all_running.as_secs_f64() * cores as f64
    );
    println!(
        "  virt-controller {:.1} | virt-handlers ({NODES}) {:.1} | this bench (the API server, the stand-in kubelet, the creates) {:.1} | launcher stand-ins {:.1}",
        cpu[0], cpu[1], cpu[2], cpu[3]
    );
    println!("API requests by kind (most first; per VM in the last column):");
    for ((method, what, code), count) in by_kind.iter().take(20) {
        println!(
            "  {method:<6} {what:<46} {code} {count:>7} {:>6.2}",
            *count as f64 / n as f64
        );
    }
    if pods_total != n {
        bail!("{pods_total} launcher Pods for {n} VMIs");
    }
    Ok(())
}

/// Requests counted by method, what they touch (`pods`, `pods/{name}`, `pods/{name}/status`;
/// names and namespaces folded) and status code, most first.
fn requests_by_kind<M: std::fmt::Display>(
    log: &[(M, String, u16)],
) -> Vec<((String, String, u16), u64)> {
    let mut counts: std::collections::HashMap<(String, String, u16), u64> = Default::default();
    for (method, path, code) in log {
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        // /api/v1/... or /apis/{group}/{version}/...; then [namespaces/{ns}/]{plural}[/{name}[/{sub}]]
        let rest = match segments.first() {
            Some(&"api") => segments.get(2..).unwrap_or_default(),
            _ => segments.get(3..).unwrap_or_default(),
        };
        let rest = match rest {
            ["namespaces", _, tail @ ..] if !tail.is_empty() => tail,
            other => other,
        };
        let what = match rest {
            [plural] => plural.to_string(),
            [plural, _] => format!("{plural}/{{name}}"),
            [plural, _, sub, ..] => format!("{plural}/{{name}}/{sub}"),
            [] => path.clone(),
        };
        *counts.entry((method.to_string(), what, *code)).or_default() += 1;
    }
    let mut counts: Vec<_> = counts.into_iter().collect();
    counts.sort_by_key(|c| std::cmp::Reverse(c.1));
    counts
}
