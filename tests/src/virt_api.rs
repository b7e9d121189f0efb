//! virt-api as the tests run it: the APIServices `deploy/virt-api.yaml` defines, the binary
//! under its deployed service account behind the test API server's aggregation layer.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};

use crate::cluster::{eventually, Cluster};
use crate::rbac::service_account_user;

/// A RoleBinding (YAML) giving `user` the ClusterRole `role` in `namespace`, for
/// `Authorizer::with_yaml`.
pub fn grant(user: &str, role: &str, namespace: &str) -> String {
    format!(
        "---\napiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {{name: {user}-{}, namespace: {namespace}}}\nroleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: \"{role}\"}}\nsubjects: [{{kind: User, name: {user}}}]\n",
        role.replace([':', '.'], "-")
    )
}

/// A running virt-api, killed on drop.
pub struct VirtApi {
    child: Child,
    /// Where it serves (straight, past the API server).
    pub addr: SocketAddr,
}

impl Drop for VirtApi {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The APIServices of `deploy/virt-api.yaml` and `deploy/cdi/upload.yaml` (a cluster without
/// CDI; their caBundle is virt-api's to publish).
async fn create_apiservices(client: &kube::Client) {
    let gvk = GroupVersionKind::gvk("apiregistration.k8s.io", "v1", "APIService");
    let services: Api<DynamicObject> = Api::all_with(client.clone(), &ApiResource::from_gvk(&gvk));
    let root = crate::repo_root();
    let text = std::fs::read_to_string(root.join("deploy/virt-api.yaml")).unwrap()
        + "\n---\n"
        + &std::fs::read_to_string(root.join("deploy/cdi/upload.yaml")).unwrap();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let v: serde_json::Value = serde::Deserialize::deserialize(doc).unwrap();
        if v["kind"] == "APIService" {
            let obj: DynamicObject = serde_json::from_value(v).unwrap();
            services.create(&PostParams::default(), &obj).await.unwrap();
        }
    }
}

/// Starts the virt-api binary `bin` with `extra` arguments as its Deployment runs it, and
/// waits until the API server reaches it with the CA bundle it published.
pub async fn start(cluster: &Cluster, bin: &Path, work: &Path, extra: &[String]) -> VirtApi {
    create_apiservices(&cluster.client).await;
    let kubeconfig = work.join("virt-api.kubeconfig");
    cluster.api.write_kubeconfig(
        &kubeconfig,
        Some(&service_account_user("microvirt", "virt-api")),
    );
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let child = Command::new(bin)
        .args(["--listen", &addr.to_string(), "--service", "virt-api"])
        .args(extra)
        .env("KUBECONFIG", &kubeconfig)
        .env("POD_NAMESPACE", "microvirt")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    cluster
        .api
        .set_service_endpoint("microvirt", "virt-api", addr);
    let client = cluster.client.clone();
    eventually(
        "virt-api serving through the API server",
        Duration::from_secs(20),
        || async {
            let req = http::Request::get("/apis/subresources.kubevirt.io/v1/version")
                .body(Vec::new())
                .unwrap();
            client.request_text(req).await.ok()
        },
    )
    .await;
    VirtApi { child, addr }
}
