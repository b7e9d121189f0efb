//! The kvm, tun and vhost-net device plugins against a test kubelet: a real gRPC Registration
//! server on `kubelet.sock`, and real gRPC calls to each plugin's socket, as the kubelet makes
//! them. A kubelet restart (new socket, plugin sockets removed) brings every plugin back.

use std::path::{Path, PathBuf};
use std::time::Duration;

use handler::deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
use handler::deviceplugin::v1beta1::registration_server::{Registration, RegistrationServer};
use handler::deviceplugin::v1beta1::*;
use handler::deviceplugin::{unix_channel, KUBELET_SOCKET, SLOTS};
use tokio::sync::mpsc;

struct TestKubelet(mpsc::UnboundedSender<RegisterRequest>);

#[tonic::async_trait]
impl Registration for TestKubelet {
    async fn register(
        &self,
        r: tonic::Request<RegisterRequest>,
    ) -> Result<tonic::Response<Empty>, tonic::Status> {
        let _ = self.0.send(r.into_inner());
        Ok(tonic::Response::new(Empty {}))
    }
}

/// Serves the Registration API on `dir/kubelet.sock` until the task is aborted.
fn start_kubelet(
    dir: &Path,
) -> (
    tokio::task::JoinHandle<()>,
    mpsc::UnboundedReceiver<RegisterRequest>,
) {
    let socket = dir.join(KUBELET_SOCKET);
    let _ = std::fs::remove_file(&socket);
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    let task = tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(TestKubelet(tx)))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener))
            .await
            .unwrap();
    });
    (task, rx)
}

async fn registrations(rx: &mut mpsc::UnboundedReceiver<RegisterRequest>) -> Vec<RegisterRequest> {
    let mut got = Vec::new();
    while got.len() < 3 {
        let r = tokio::time::timeout(Duration::from_secs(15), rx.recv())
            .await
            .expect("three registrations")
            .unwrap();
        got.push(r);
    }
    got.sort_by(|a, b| a.resource_name.cmp(&b.resource_name));
    got
}

async fn plugin(dir: &Path, endpoint: &str) -> DevicePluginClient<tonic::transport::Channel> {
    DevicePluginClient::new(unix_channel(&dir.join(endpoint)).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugins_register_advertise_allocate_and_come_back_after_a_kubelet_restart() {
    let dir = PathBuf::from(format!("/tmp/mvdp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // A device tree with kvm and tun but no vhost-net (as on these machines).
    let root = dir.join("root");
    std::fs::create_dir_all(root.join("dev/net")).unwrap();
    std::fs::write(root.join("dev/kvm"), b"").unwrap();
    std::fs::write(root.join("dev/net/tun"), b"").unwrap();

    let (kubelet, mut rx) = start_kubelet(&dir);
    tokio::spawn(handler::deviceplugin::run(dir.clone(), root.clone()));
    let regs = registrations(&mut rx).await;
    let names: Vec<&str> = regs.iter().map(|r| r.resource_name.as_str()).collect();
    assert_eq!(
        names,
        [
            "devices.kubevirt.io/kvm",
            "devices.kubevirt.io/tun",
            "devices.kubevirt.io/vhost-net"
        ]
    );
    assert!(regs.iter().all(|r| r.version == "v1beta1"));

    for r in &regs {
        let mut p = plugin(&dir, &r.endpoint).await;
        let mut stream = p.list_and_watch(Empty {}).await.unwrap().into_inner();
        let first = stream.message().await.unwrap().unwrap();
        assert_eq!(first.devices.len(), SLOTS, "{}", r.resource_name);
        let expected = if r.resource_name.ends_with("vhost-net") {
            "Unhealthy"
        } else {
            "Healthy"
        };
        assert!(
            first.devices.iter().all(|d| d.health == expected),
            "{}",
            r.resource_name
        );
        let ids: std::collections::HashSet<_> = first.devices.iter().map(|d| &d.id).collect();
        assert_eq!(ids.len(), SLOTS, "device IDs are unique");
        p.get_device_plugin_options(Empty {}).await.unwrap();
    }
    // Allocate: the device node, at the same path, for each container.
    let kvm = regs
        .iter()
        .find(|r| r.resource_name.ends_with("/kvm"))
        .unwrap();
    let a = plugin(&dir, &kvm.endpoint)
        .await
        .allocate(AllocateRequest {
            container_requests: vec![
                ContainerAllocateRequest {
                    devices_ids: vec!["microvirt-kvm-0".into()],
                },
                ContainerAllocateRequest {
                    devices_ids: vec!["microvirt-kvm-1".into()],
                },
            ],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(a.container_responses.len(), 2);
    for c in &a.container_responses {
        assert_eq!(c.devices.len(), 1);
        assert_eq!(
            (
                c.devices[0].host_path.as_str(),
                c.devices[0].container_path.as_str(),
                c.devices[0].permissions.as_str()
            ),
            ("/dev/kvm", "/dev/kvm", "mrw")
        );
    }

    // The kubelet restarts: it removes the plugin sockets and makes a new kubelet.sock.
    kubelet.abort();
    for r in &regs {
        let _ = std::fs::remove_file(dir.join(&r.endpoint));
    }
    let (_kubelet, mut rx) = start_kubelet(&dir);
    let again = registrations(&mut rx).await;
    assert_eq!(again.len(), 3);
    let mut p = plugin(&dir, &again[0].endpoint).await;
    assert!(p.get_device_plugin_options(Empty {}).await.is_ok());
    let _ = std::fs::remove_dir_all(&dir);
}
