//! A control-plane test bench: the in-process API server, virt-controller's real controllers
//! against it, and helpers that stand in for the parts of a cluster that are not there — the
//! scheduler and kubelet (bind a Pod, run it, fail it, finish its graceful deletion) and
//! virt-handler (mark a VMI Running, report migration progress).

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use api::{VirtualMachineInstance, VmiPhase};
use controller::context::ControllerConfig;
use controller::leader::LeaseConfig;
use controller::metrics::Metrics;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::Client;
use serde_json::json;

use crate::apiserver::ApiServer;
use crate::rbac::{service_account_user, Authorizer};

pub const NS: &str = "default";
/// Where virt-controller runs (its Lease lives there), as in `deploy/`.
pub const CONTROLLER_NAMESPACE: &str = "microvirt";

pub struct Replica {
    pub metrics: Arc<Metrics>,
    pub task: tokio::task::JoinHandle<Result<(), String>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Replica {
    /// Stops the replica cleanly (releasing its Lease).
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = self.task.await;
    }

    /// Kills the replica without cleanup, as a node failure would.
    pub fn kill(self) {
        self.task.abort();
    }
}

pub struct Cluster {
    pub api: ApiServer,
    pub client: Client,
}

/// Controller settings for tests: quick retries so recoveries show within seconds.
pub fn test_config() -> ControllerConfig {
    ControllerConfig {
        retry_base: Duration::from_millis(100),
        retry_max: Duration::from_secs(5),
        migration_queue_recheck: Duration::from_millis(300),
        ..Default::default()
    }
}

impl Cluster {
    /// Another handle on the same API server.
    pub fn clone_handle(&self) -> Cluster {
        Cluster {
            api: self.api.clone(),
            client: self.client.clone(),
        }
    }

    /// An API server holding virt-controller to the RBAC rules deployed with it
    /// (`deploy/rbac/`), and an admin client for the test.
    pub async fn start() -> Cluster {
        Self::start_with(Default::default()).await
    }

    /// `start`, with the API server made as `opts` say.
    pub async fn start_with(opts: crate::apiserver::ApiServerOptions) -> Cluster {
        let api = ApiServer::start_with(opts).await;
        api.enforce_rbac(Authorizer::from_dir(
            &crate::repo_root().join("deploy/rbac"),
        ));
        let client = api.client();
        // The namespace `deploy/` creates for virt-controller (its Lease lives there).
        let ns: k8s_openapi::api::core::v1::Namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": CONTROLLER_NAMESPACE}}))
                .unwrap();
        kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
            .create(&Default::default(), &ns)
            .await
            .expect("creating the controller's namespace");
        Cluster { api, client }
    }

    /// A client with virt-controller's service account, as its Deployment runs it.
    pub fn controller_client(&self) -> Client {
        self.api.client_as(&service_account_user(
            CONTROLLER_NAMESPACE,
            "virt-controller",
        ))
    }

    /// Starts a virt-controller replica (leader-elected when `lease` is given).
    pub fn replica(&self, config: ControllerConfig, lease: Option<LeaseConfig>) -> Replica {
        let metrics = Arc::new(Metrics::new());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(controller::run::run(
            self.controller_client(),
            config,
            lease,
            metrics.clone(),
            async {
                let _ = rx.await;
            },
        ));
        Replica {
            metrics,
            task,
            stop: Some(tx),
        }
    }

    /// The VMI `name` in the test namespace, if it exists.
    pub async fn vmi(&self, name: &str) -> Option<VirtualMachineInstance> {
        self.api::<VirtualMachineInstance>()
            .get_opt(name)
            .await
            .unwrap_or_else(|e| panic!("reading VMI {name}: {e}"))
    }

    pub fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as kube::Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), NS)
    }

    pub async fn apply_yaml<K>(&self, yaml: &str) -> K
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
            + serde::de::DeserializeOwned
            + serde::Serialize
            + Clone
            + std::fmt::Debug,
        <K as kube::Resource>::DynamicType: Default,
    {
        let obj: K = serde_yaml::from_str(yaml).expect("test manifest parses");
        self.api::<K>()
            .create(&PostParams::default(), &obj)
            .await
            .expect("create")
    }

    /// Launcher Pods of a VMI (by the created-by label), in creation order.
    pub async fn pods_of(&self, vmi: &VirtualMachineInstance) -> Vec<Pod> {
        let uid = vmi.metadata.uid.clone().unwrap();
        let mut pods = self
            .api::<Pod>()
            .list(&ListParams::default().labels(&format!("kubevirt.io/created-by={uid}")))
            .await
            .unwrap()
            .items;
        pods.sort_by_key(|p| {
            p.metadata
                .resource_version
                .clone()
                .unwrap()
                .parse::<u64>()
                .unwrap()
        });
        pods
    }

    /// The scheduler binds the Pod to `node`; the kubelet starts it (phase Running, Ready).
    pub async fn kubelet_run(&self, pod: &str, node: &str) {
        let pods = self.api::<Pod>();
        pods.patch(
            pod,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"nodeName": node}})),
        )
        .await
        .unwrap();
        pods.patch_status(
            pod,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Running", "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True"}]}})),
        )
        .await
        .unwrap();
    }

    /// The scheduler cannot place the Pod.
    pub async fn scheduler_unschedulable(&self, pod: &str) {
        self.api::<Pod>()
            .patch_status(
                pod,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"conditions": [{"type": "PodScheduled", "status": "False",
                    "reason": "Unschedulable", "message": "0/3 nodes are available: 3 Insufficient devices.kubevirt.io/kvm."}]}})),
            )
            .await
            .unwrap();
    }

    /// The kubelet reports the launcher container exited with `code`.
    pub async fn kubelet_exit(&self, pod: &str, code: i32) {
        let phase = if code == 0 { "Succeeded" } else { "Failed" };
        self.api::<Pod>()
            .patch_status(
                pod,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"phase": phase, "containerStatuses": [{
                    "name": "compute", "image": "", "imageID": "", "ready": false, "restartCount": 0,
                    "state": {"terminated": {"exitCode": code, "reason": if code == 0 { "Completed" } else { "Error" }}}}]}})),
            )
            .await
            .unwrap();
    }

    /// The kubelet finishes the graceful deletion of every Pod being deleted.
    pub async fn kubelet_finish_deletions(&self) -> usize {
        let pods = self.api::<Pod>();
        let mut n = 0;
        for p in pods.list(&ListParams::default()).await.unwrap().items {
            if p.metadata.deletion_timestamp.is_some() {
                let name = p.metadata.name.unwrap();
                let _ = pods
                    .delete(
                        &name,
                        &DeleteParams {
                            grace_period_seconds: Some(0),
                            ..Default::default()
                        },
                    )
                    .await;
                n += 1;
            }
        }
        n
    }

    /// virt-handler reports the guest running (phase Running, Ready), retrying on conflicts.
    pub async fn handler_running(&self, vmi: &str) {
        let vmis = self.api::<VirtualMachineInstance>();
        loop {
            let mut v = vmis.get(vmi).await.unwrap();
            let s = v.status.get_or_insert_with(Default::default);
            s.phase = Some(VmiPhase::Running);
            s.conditions.retain(|c| c.type_ != "Ready");
            s.conditions.push(api::Condition {
                type_: "Ready".into(),
                status: "True".into(),
                ..Default::default()
            });
            match vmis.replace_status(vmi, &PostParams::default(), &v).await {
                Ok(_) => return,
                Err(kube::Error::Api(s)) if s.code == 409 => continue,
                Err(e) => panic!("{e}"),
            }
        }
    }

    /// Waits for the VMI and its launcher Pod, runs the Pod on `node` (scheduler + kubelet),
    /// waits for the controller to mark the VMI Scheduled, then marks the guest running
    /// (virt-handler). Returns the VMI as it is then.
    pub async fn bring_up(&self, name: &str, node: &str) -> VirtualMachineInstance {
        let t = Duration::from_secs(20);
        let vmis = self.api::<VirtualMachineInstance>();
        let vmi = eventually("the VMI", t, || async { vmis.get_opt(name).await.unwrap() }).await;
        let pod = eventually("the launcher Pod", t, || async {
            self.pods_of(&vmi).await.into_iter().next()
        })
        .await;
        self.kubelet_run(pod.metadata.name.as_deref().unwrap(), node)
            .await;
        eventually("VMI Scheduled", t, || async {
            let phase = vmis.get(name).await.unwrap().status?.phase;
            (phase == Some(VmiPhase::Scheduled)).then_some(())
        })
        .await;
        self.handler_running(name).await;
        vmis.get(name).await.unwrap()
    }

    /// virt-handler edits `vmi.status.migrationState` (retrying on conflicts as it would).
    pub async fn handler_migration(&self, vmi: &str, f: impl Fn(&mut api::MigrationState)) {
        let vmis = self.api::<VirtualMachineInstance>();
        loop {
            let mut v = vmis.get(vmi).await.unwrap();
            let ms = v
                .status
                .get_or_insert_with(Default::default)
                .migration_state
                .get_or_insert_with(Default::default);
            f(ms);
            match vmis.replace_status(vmi, &PostParams::default(), &v).await {
                Ok(_) => return,
                Err(kube::Error::Api(s)) if s.code == 409 => continue,
                Err(e) => panic!("{e}"),
            }
        }
    }
}

impl Cluster {
    /// The target Pod the controller made for the migration with this uid, once it exists.
    pub async fn target_pod(&self, migration_uid: &str) -> Pod {
        let lp =
            ListParams::default().labels(&format!("kubevirt.io/migrationJobUID={migration_uid}"));
        eventually(
            "the migration's target Pod",
            Duration::from_secs(20),
            || async {
                self.api::<Pod>()
                    .list(&lp)
                    .await
                    .unwrap()
                    .items
                    .into_iter()
                    .next()
            },
        )
        .await
    }

    /// virt-handler on both nodes: once the controller has handed VMI `vmi` over for the
    /// migration with this uid, the target reports its address and the source reports the
    /// migration started and completed.
    pub async fn handler_complete_migration(&self, vmi: &str, migration_uid: &str) {
        let vmis = self.api::<VirtualMachineInstance>();
        eventually("the hand-off", Duration::from_secs(20), || async {
            let ms = vmis.get(vmi).await.unwrap().status?.migration_state?;
            (ms.migration_uid.as_deref() == Some(migration_uid)).then_some(())
        })
        .await;
        self.handler_migration(vmi, |m| {
            m.target_node_address = Some("10.0.0.2:4444".into());
            m.start_timestamp = Some("2026-11-30T08:00:00Z".into());
            m.completed = Some(true);
        })
        .await;
    }
}

/// Polls `f` until it returns Some, or panics with `what` after `timeout`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        if start.elapsed() > timeout {
            panic!("timed out after {timeout:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A plain HTTP/1.1 GET (for `/metrics`), returning the body.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use http_body_util::BodyExt;
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::get(path)
        .header("host", "localhost")
        .body(http_body_util::Empty::<hyper::body::Bytes>::new())
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200, "GET {path}");
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(body.to_vec()).unwrap()
}
