//! Device plugins for the device nodes a launcher Pod needs: `devices.kubevirt.io/kvm`
//! (/dev/kvm), `devices.kubevirt.io/tun` (/dev/net/tun) and `devices.kubevirt.io/vhost-net`
//! (/dev/vhost-net), each with 1000 slots, over the kubelet's device-plugin API v1beta1 (gRPC on
//! unix sockets in the kubelet's device-plugins directory). A device node the host lacks is
//! advertised Unhealthy, so no Pod is scheduled against it. When the kubelet restarts (it
//! removes every plugin socket and makes a new `kubelet.sock`), each plugin serves a new socket
//! and registers again.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::Duration;

use futures::Stream;
use tokio::net::UnixListener;
use tonic::{Request, Response, Status};

#[allow(clippy::all, clippy::pedantic)]
pub mod v1beta1 {
    tonic::include_proto!("v1beta1");
}

use v1beta1::device_plugin_server::{DevicePlugin, DevicePluginServer};
use v1beta1::registration_client::RegistrationClient;
use v1beta1::*;

pub const API_VERSION: &str = "v1beta1";
pub const SLOTS: usize = 1000;
pub const KUBELET_SOCKET: &str = "kubelet.sock";

/// One resource backed by one device node.
#[derive(Clone, Debug)]
pub struct DeviceResource {
    /// `devices.kubevirt.io/kvm`
    pub name: &'static str,
    pub device: &'static str,
    /// The plugin's socket file name in the device-plugins directory.
    pub socket: &'static str,
}

pub const RESOURCES: [DeviceResource; 3] = [
    DeviceResource {
        name: "devices.kubevirt.io/kvm",
        device: "/dev/kvm",
        socket: "microvirt-kvm.sock",
    },
    DeviceResource {
        name: "devices.kubevirt.io/tun",
        device: "/dev/net/tun",
        socket: "microvirt-tun.sock",
    },
    DeviceResource {
        name: "devices.kubevirt.io/vhost-net",
        device: "/dev/vhost-net",
        socket: "microvirt-vhost-net.sock",
    },
];

#[derive(Clone)]
struct Plugin {
    resource: DeviceResource,
    /// Where to look for the device node (a test points this at its own tree).
    device_root: PathBuf,
}

impl Plugin {
    fn device_path(&self) -> PathBuf {
        self.device_root
            .join(self.resource.device.trim_start_matches('/'))
    }

    fn devices(&self) -> Vec<Device> {
        let health = if self.device_path().exists() {
            "Healthy"
        } else {
            "Unhealthy"
        };
        (0..SLOTS)
            .map(|i| Device {
                id: format!("{}-{i}", self.resource.socket.trim_end_matches(".sock")),
                health: health.into(),
                topology: None,
            })
            .collect()
    }
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for Plugin {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions::default()))
    }

    type ListAndWatchStream = DeviceStream;

    /// The slots now, then again whenever the device node appears or disappears.
    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let plugin = self.clone();
        let stream = async_stream_devices(plugin);
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        _: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        Ok(Response::new(PreferredAllocationResponse::default()))
    }

    /// Every slot is the same device node: each container gets it at the same path.
    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let device = self.resource.device;
        let responses = request
            .into_inner()
            .container_requests
            .iter()
            .map(|_| ContainerAllocateResponse {
                devices: vec![DeviceSpec {
                    container_path: device.into(),
                    host_path: device.into(),
                    permissions: "mrw".into(),
                }],
                ..Default::default()
            })
            .collect();
        Ok(Response::new(AllocateResponse {
            container_responses: responses,
        }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// The ListAndWatch stream: a list at once, and a new one when health changes.
fn async_stream_devices(
    plugin: Plugin,
) -> impl Stream<Item = Result<ListAndWatchResponse, Status>> + Send {
    futures::stream::unfold((plugin, None::<bool>), |(plugin, last)| async move {
        loop {
            let healthy = plugin.device_path().exists();
            if last != Some(healthy) {
                let devices = plugin.devices();
                return Some((
                    Ok(ListAndWatchResponse { devices }),
                    (plugin, Some(healthy)),
                ));
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    })
}

/// A gRPC channel over a unix socket (tonic wants a URI; the connector ignores it).
pub async fn unix_channel(
    path: &Path,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let path = path.to_path_buf();
    tonic::transport::Endpoint::from_static("http://[::1]:50051")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                tokio::net::UnixStream::connect(path)
                    .await
                    .map(hyper_util::rt::TokioIo::new)
            }
        }))
        .await
}

/// Serves one plugin's socket and registers it with the kubelet; returns when the socket is
/// gone (the kubelet restarted) so the caller starts over.
async fn serve_once(plugin: Plugin, dir: &Path) -> Result<(), String> {
    let socket = dir.join(plugin.resource.socket);
    let _ = std::fs::remove_file(&socket);
    let listener = UnixListener::bind(&socket).map_err(|e| format!("{}: {e}", socket.display()))?;
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    let server = tonic::transport::Server::builder()
        .add_service(DevicePluginServer::new(plugin.clone()))
        .serve_with_incoming(incoming);
    let watch_socket = socket.clone();
    let gone = async move {
        while watch_socket.exists() {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };
    let register = async {
        let channel = unix_channel(&dir.join(KUBELET_SOCKET))
            .await
            .map_err(|e| format!("kubelet socket: {e}"))?;
        RegistrationClient::new(channel)
            .register(RegisterRequest {
                version: API_VERSION.into(),
                endpoint: plugin.resource.socket.into(),
                resource_name: plugin.resource.name.into(),
                options: Some(DevicePluginOptions::default()),
            })
            .await
            .map_err(|e| format!("Register: {e}"))?;
        tracing::info!(resource = plugin.resource.name, "device plugin registered");
        Ok::<(), String>(())
    };
    tokio::select! {
        r = server => r.map_err(|e| e.to_string()),
        _ = async {
            if let Err(e) = register.await {
                tracing::warn!(resource = plugin.resource.name, "{e}; retrying");
                return;
            }
            gone.await;
        } => Ok(()),
    }
}

/// Runs every plugin for as long as the process lives, re-registering after kubelet restarts
/// (and retrying, with a pause, while the kubelet is not there).
pub async fn run(dir: PathBuf, device_root: PathBuf) {
    let tasks = RESOURCES.iter().cloned().map(|resource| {
        let dir = dir.clone();
        let plugin = Plugin {
            resource,
            device_root: device_root.clone(),
        };
        async move {
            loop {
                if let Err(e) = serve_once(plugin.clone(), &dir).await {
                    tracing::warn!(resource = plugin.resource.name, "device plugin: {e}");
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    });
    futures::future::join_all(tasks).await;
}
