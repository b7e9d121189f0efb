//! The node parts an import needs, for the in-process API server: a storage provisioner that
//! binds each claim to a directory of its own (`<root>/<namespace>/<claim>`, owned by the
//! importer's user as an `fsGroup` mount would be), and a kubelet for importer Pods that runs
//! the Pod's container — the real `cdi-importer` binary, as the Pod's non-root user without
//! capabilities — with its volumes, Secrets, ConfigMaps and downward API resolved as the
//! kubelet resolves them, its termination message read back, and `restartPolicy: OnFailure`
//! honoured (restartCount, lastState, a back-off between attempts). It also plays the CSI
//! snapshot controller: a VolumeSnapshot of a bound claim becomes a copy of its directory, and
//! a claim whose `dataSource` is a ready VolumeSnapshot starts as a copy of it.
//!
//! The kubelet bind-mounts volumes at the container's paths; here the process runs in the
//! host's mount namespace, so paths under a mount (in the environment) are rewritten to the
//! volume's host directory instead. Block volumes are not emulated.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use api::snapshot::VolumeSnapshot;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;

use crate::cluster::Cluster;

/// The importer's user (`api::cdi::importer::UID`).
const IMPORTER_UID: u32 = api::cdi::importer::UID as u32;

pub struct ImportNode {
    pub root: PathBuf,
    stop: Arc<AtomicBool>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// Builds the importer (another package's binary) and returns its path.
pub fn importer_bin() -> PathBuf {
    let status = Command::new(env!("CARGO"))
        .args([
            "build",
            "--quiet",
            "-p",
            "importer",
            "--bin",
            "cdi-importer",
        ])
        .current_dir(crate::repo_root())
        .status()
        .unwrap();
    assert!(status.success());
    crate::repo_root().join("target/debug/cdi-importer")
}

/// Copies the contents of `from` into `to` (ownership and sparseness kept, as a CSI driver's
/// copy-on-write snapshot would leave them).
fn copy_tree(from: &Path, to: &Path) {
    let status = Command::new("cp")
        .args(["-a", "--sparse=always"])
        .arg(from.join("."))
        .arg(to)
        .status()
        .unwrap();
    assert!(status.success(), "cp {} {}", from.display(), to.display());
}

fn give_to_importer(p: &Path) {
    std::fs::create_dir_all(p).unwrap();
    std::os::unix::fs::chown(p, Some(IMPORTER_UID), Some(IMPORTER_UID)).unwrap();
}

impl ImportNode {
    /// Starts provisioning claims under `root` and running importer Pods.
    pub fn start(cluster: &Cluster, root: &Path) -> ImportNode {
        let bin = importer_bin();
        let stop = Arc::new(AtomicBool::new(false));
        let (client, root_dir, s) = (cluster.client.clone(), root.to_path_buf(), stop.clone());
        let task = tokio::spawn(async move {
            let mut node = Node {
                client,
                root: root_dir,
                bin,
                running: HashMap::new(),
                next_ip: 10,
            };
            while !s.load(Ordering::SeqCst) {
                node.take_snapshots().await;
                node.provision().await;
                node.sync_pods().await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            for (_, cancel) in node.running.drain() {
                cancel.store(true, Ordering::SeqCst);
            }
        });
        ImportNode {
            root: root.to_path_buf(),
            stop,
            task: Some(task),
        }
    }

    /// Where the claim `name` in `namespace` keeps its contents.
    pub fn claim_dir(&self, namespace: &str, name: &str) -> PathBuf {
        self.root.join(namespace).join(name)
    }

    pub async fn stop(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for ImportNode {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

struct Node {
    client: Client,
    root: PathBuf,
    bin: PathBuf,
    /// Pod UID → its runner's cancel flag.
    running: HashMap<String, Arc<AtomicBool>>,
    next_ip: u8,
}

impl Node {
    /// Binds every Pending claim to a fresh directory of its size.
    async fn provision(&self) {
        let pvcs: Api<PersistentVolumeClaim> = Api::all(self.client.clone());
        let Ok(list) = pvcs.list(&ListParams::default()).await else {
            return;
        };
        for c in list.items {
            let phase = c.status.as_ref().and_then(|s| s.phase.as_deref());
            if phase == Some("Bound") || c.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let ns = c.namespace().unwrap_or_default();
            let name = c.name_any();
            let spec = c.spec.clone().unwrap_or_default();
            let dir = self.root.join(&ns).join(&name);
            give_to_importer(&dir);
            if let Some(source) = spec
                .data_source
                .as_ref()
                .filter(|d| d.kind == "VolumeSnapshot")
            {
                // A claim from a snapshot is bound once the snapshot is ready, holding its data.
                let Some(from) = self.ready_snapshot(&ns, &source.name).await else {
                    continue;
                };
                copy_tree(&from, &dir);
            }
            let size = spec
                .resources
                .and_then(|r| r.requests)
                .and_then(|r| r.get("storage").cloned());
            let api: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), &ns);
            let _ = api
                .patch(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"volumeName": format!("pv-{ns}-{name}")}})),
                )
                .await;
            let _ = api
                .patch_status(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"status": {"phase": "Bound",
                        "accessModes": spec.access_modes, "capacity": {"storage": size}}})),
                )
                .await;
        }
    }

    /// Where the CSI snapshot `name` in `namespace` keeps its copy of the claim.
    fn snapshot_dir(&self, namespace: &str, name: &str) -> PathBuf {
        self.root.join(".snapshots").join(namespace).join(name)
    }

    /// The copy held by VolumeSnapshot `name`, once it is ready.
    async fn ready_snapshot(&self, namespace: &str, name: &str) -> Option<PathBuf> {
        let api: Api<VolumeSnapshot> = Api::namespaced(self.client.clone(), namespace);
        let vs = api.get_opt(name).await.ok()??;
        (vs.status?.ready_to_use == Some(true)).then(|| self.snapshot_dir(namespace, name))
    }

    /// The CSI snapshotter's part: each new VolumeSnapshot of a bound claim becomes a copy of
    /// the claim's directory, made ready with the claim's size; one of a claim that does not
    /// exist or is not bound gets an error, as the external-snapshotter reports it.
    async fn take_snapshots(&self) {
        let all: Api<VolumeSnapshot> = Api::all(self.client.clone());
        let Ok(list) = all.list(&ListParams::default()).await else {
            return;
        };
        for vs in list.items {
            if vs.status.is_some() || vs.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let ns = vs.namespace().unwrap_or_default();
            let claim = vs
                .spec
                .source
                .persistent_volume_claim_name
                .clone()
                .unwrap_or_default();
            let claims: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), &ns);
            let bound =
                claims.get_opt(&claim).await.ok().flatten().filter(|c| {
                    c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound")
                });
            let now = jiff::Timestamp::now()
                .round(jiff::Unit::Second)
                .unwrap()
                .to_string();
            let status = match bound {
                None => json!({"readyToUse": false, "error": {"time": now,
                    "message": format!("claim {claim:?} does not exist or is not bound")}}),
                Some(c) => {
                    let to = self.snapshot_dir(&ns, &vs.name_any());
                    give_to_importer(&to);
                    copy_tree(&self.root.join(&ns).join(&claim), &to);
                    let size = c
                        .status
                        .and_then(|s| s.capacity)
                        .and_then(|c| c.get("storage").cloned());
                    json!({"readyToUse": true, "creationTime": now, "restoreSize": size,
                        "boundVolumeSnapshotContentName": format!("snapcontent-{}", vs.uid().unwrap_or_default())})
                }
            };
            let api: Api<VolumeSnapshot> = Api::namespaced(self.client.clone(), &ns);
            let _ = api
                .patch_status(
                    &vs.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(json!({ "status": status })),
                )
                .await;
        }
    }

    /// Starts the importer Pods not yet running; ends the deleted ones.
    async fn sync_pods(&mut self) {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let lp = ListParams::default().labels(&format!("app={}", api::cdi::importer::APP));
        let Ok(list) = pods.list(&lp).await else {
            return;
        };
        let present: Vec<String> = list.items.iter().filter_map(|p| p.uid()).collect();
        self.running.retain(|uid, cancel| {
            let keep = present.contains(uid);
            if !keep {
                cancel.store(true, Ordering::SeqCst);
            }
            keep
        });
        for p in list.items {
            let uid = p.uid().unwrap_or_default();
            let ns = p.namespace().unwrap_or_default();
            if p.metadata.deletion_timestamp.is_some() {
                if let Some(cancel) = self.running.remove(&uid) {
                    cancel.store(true, Ordering::SeqCst);
                }
                let api: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
                let _ = api
                    .delete(
                        &p.name_any(),
                        &DeleteParams {
                            grace_period_seconds: Some(0),
                            ..Default::default()
                        },
                    )
                    .await;
                continue;
            }
            let finished = matches!(
                p.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Succeeded" | "Failed")
            );
            if finished || self.running.contains_key(&uid) {
                continue;
            }
            let cancel = Arc::new(AtomicBool::new(false));
            self.running.insert(uid.clone(), cancel.clone());
            let ip = format!("127.0.0.{}", self.next_ip);
            self.next_ip = if self.next_ip >= 250 {
                10
            } else {
                self.next_ip + 1
            };
            let runner = Runner {
                client: self.client.clone(),
                pod: p,
                root: self.root.clone(),
                bin: self.bin.clone(),
                ip,
                cancel,
            };
            tokio::spawn(runner.run());
        }
    }
}

/// One importer Pod, run as the kubelet runs it.
struct Runner {
    client: Client,
    pod: Pod,
    root: PathBuf,
    bin: PathBuf,
    ip: String,
    cancel: Arc<AtomicBool>,
}

impl Runner {
    fn pod_dir(&self) -> PathBuf {
        self.root
            .join(".pods")
            .join(self.pod.uid().unwrap_or_default())
    }

    async fn set_status(&self, status: serde_json::Value) {
        let api: Api<Pod> = Api::namespaced(
            self.client.clone(),
            &self.pod.namespace().unwrap_or_default(),
        );
        let _ = api
            .patch_status(
                &self.pod.name_any(),
                &PatchParams::default(),
                &Patch::Merge(json!({ "status": status })),
            )
            .await;
    }

    fn container_status(
        restarts: i32,
        state: serde_json::Value,
        last: &serde_json::Value,
    ) -> serde_json::Value {
        json!([{"name": "importer", "ready": state.get("running").is_some(),
            "restartCount": restarts, "image": "cdi-importer", "imageID": "",
            "state": state, "lastState": last}])
    }

    async fn run(self) {
        // As the kubelet does, the container waits until its volumes, Secrets and ConfigMaps
        // are there, showing why meanwhile.
        let (env, log_path) = loop {
            match self.prepare().await {
                Ok(x) => break x,
                Err(why) => {
                    if self.cancel.load(Ordering::SeqCst) {
                        return;
                    }
                    self.set_status(json!({"phase": "Pending", "containerStatuses": Self::container_status(
                        0, json!({"waiting": {"reason": "CreateContainerConfigError", "message": why}}), &json!({}))}))
                        .await;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        let mut restarts = 0;
        let mut last = json!({});
        loop {
            if self.cancel.load(Ordering::SeqCst) {
                return;
            }
            self.set_status(json!({"phase": "Running", "podIP": self.ip,
                "podIPs": [{"ip": self.ip}],
                "containerStatuses": Self::container_status(restarts, json!({"running": {}}), &last)}))
                .await;
            let _ = std::fs::write(&log_path, "");
            let code = self.run_once(&env).await;
            let Some(code) = code else { return };
            if code == 0 {
                self.set_status(json!({"phase": "Succeeded", "containerStatuses": Self::container_status(
                    restarts, json!({"terminated": {"exitCode": 0, "reason": "Completed"}}), &last)}))
                    .await;
                return;
            }
            let mut message = std::fs::read_to_string(log_path.with_file_name("termination-log"))
                .unwrap_or_default();
            message.truncate(4096);
            restarts += 1;
            last = json!({"terminated": {"exitCode": code, "reason": "Error", "message": message}});
            self.set_status(
                json!({"phase": "Running", "containerStatuses": Self::container_status(
                restarts, json!({"waiting": {"reason": "CrashLoopBackOff"}}), &last)}),
            )
            .await;
            let backoff = Duration::from_millis((100u64 << restarts.min(4)).min(1000));
            tokio::time::sleep(backoff).await;
        }
    }

    /// Runs the container once; its exit code, or None when the Pod went away meanwhile.
    async fn run_once(&self, env: &BTreeMap<String, String>) -> Option<i32> {
        let dir = self.pod_dir();
        let _ = std::fs::remove_file(dir.join("termination-log"));
        let log = std::fs::File::create(dir.join("log")).unwrap();
        let mut cmd = if unsafe { libc::getuid() } == 0 {
            let mut c = Command::new("setpriv");
            c.args([
                &format!("--reuid={IMPORTER_UID}"),
                &format!("--regid={IMPORTER_UID}"),
                "--clear-groups",
                "--inh-caps=-all",
                "--bounding-set=-all",
            ])
            .arg(&self.bin);
            c
        } else {
            Command::new(&self.bin)
        };
        cmd.env_clear()
            .envs(env)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        let mut child = cmd.spawn().unwrap();
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return Some(status.code().unwrap_or(128));
            }
            if self.cancel.load(Ordering::SeqCst) {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The container's environment with volumes at their host directories; and where its
    /// log goes.
    async fn prepare(&self) -> Result<(BTreeMap<String, String>, PathBuf), String> {
        let ns = self.pod.namespace().unwrap_or_default();
        let spec = self.pod.spec.clone().unwrap_or_default();
        let c = spec.containers.first().ok_or("no container")?;
        let dir = self.pod_dir();
        give_to_importer(&dir);
        // Volumes: name → host directory.
        let mut volumes: HashMap<String, PathBuf> = HashMap::new();
        for v in spec.volumes.unwrap_or_default() {
            let host = if let Some(pvc) = &v.persistent_volume_claim {
                let d = self.root.join(&ns).join(&pvc.claim_name);
                if !d.exists() {
                    return Err(format!("claim {} is not bound", pvc.claim_name));
                }
                d
            } else if let Some(cm) = &v.config_map {
                let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), &ns);
                let m = api
                    .get(&cm.name)
                    .await
                    .map_err(|e| format!("configmap {}: {e}", cm.name))?;
                let d = dir.join(&v.name);
                std::fs::create_dir_all(&d).unwrap();
                for (k, val) in m.data.unwrap_or_default() {
                    std::fs::write(d.join(k), val).unwrap();
                }
                d
            } else if v.empty_dir.is_some() {
                let d = dir.join(&v.name);
                give_to_importer(&d);
                d
            } else {
                return Err(format!("volume {}: kind not emulated", v.name));
            };
            volumes.insert(v.name.clone(), host);
        }
        if c.volume_devices.as_ref().is_some_and(|d| !d.is_empty()) {
            return Err("block volumes are not emulated".into());
        }
        let mounts: Vec<(String, PathBuf)> = c
            .volume_mounts
            .clone()
            .unwrap_or_default()
            .into_iter()
            .map(|m| (m.mount_path, volumes[&m.name].clone()))
            .collect();
        let termination = c
            .termination_message_path
            .clone()
            .unwrap_or_else(|| "/dev/termination-log".into());
        let host_of = |value: &str| -> String {
            if value == termination {
                return dir.join("termination-log").display().to_string();
            }
            for (path, host) in &mounts {
                if value == path {
                    return host.display().to_string();
                }
                if let Some(rest) = value.strip_prefix(&format!("{path}/")) {
                    return host.join(rest).display().to_string();
                }
            }
            value.to_string()
        };
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), &ns);
        let secret_data = |s: Secret| -> BTreeMap<String, String> {
            s.data
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k, String::from_utf8_lossy(&v.0).into_owned()))
                .collect()
        };
        let mut env = BTreeMap::new();
        for e in c.env_from.clone().unwrap_or_default() {
            if let Some(s) = e.secret_ref {
                let secret = secrets
                    .get(&s.name)
                    .await
                    .map_err(|e| format!("secret {}: {e}", s.name))?;
                for (k, v) in secret_data(secret) {
                    env.insert(format!("{}{k}", e.prefix.clone().unwrap_or_default()), v);
                }
            }
        }
        for e in c.env.clone().unwrap_or_default() {
            let value = if let Some(v) = e.value {
                host_of(&v)
            } else if let Some(from) = e.value_from {
                if let Some(k) = from.secret_key_ref {
                    let secret = secrets
                        .get(&k.name)
                        .await
                        .map_err(|e| format!("secret {}: {e}", k.name))?;
                    secret_data(secret)
                        .remove(&k.key)
                        .ok_or(format!("secret {} has no key {}", k.name, k.key))?
                } else if let Some(f) = from.field_ref {
                    match f.field_path.as_str() {
                        "status.podIP" => self.ip.clone(),
                        "metadata.namespace" => ns.clone(),
                        other => return Err(format!("env {}: field {other} not emulated", e.name)),
                    }
                } else {
                    return Err(format!("env {}: source not emulated", e.name));
                }
            } else {
                String::new()
            };
            env.insert(e.name, value);
        }
        env.insert("PATH".into(), "/usr/bin:/bin".into());
        Ok((env, dir.join("log")))
    }
}
