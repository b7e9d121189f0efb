//! The launcher Pod for a VMI (`LaunchPodTemplate`): what KubeVirt users see as
//! `virt-launcher-<vmi>-xxxxx`, with microvirt's much smaller memory overhead.
//!
//! Memory request = guest memory + overhead, where overhead is
//! `24 MiB fixed + guest / 512 (page tables and dirty bitmaps) + 1 MiB per vCPU (thread stacks)`.
//! The fixed part covers the VMM (≈3.2 MiB RSS measured by `bench`), the launcher and the
//! event loop with ample room; KubeVirt's fixed part is ~240 MiB.

use std::collections::BTreeMap;

use api::launcher_pod::{
    control_socket_in_pod, CONTAINER_DISKS, LAUNCHER_UID, RESOURCE_KVM, RESOURCE_TUN, SOCKETS,
    SOCKETS_VOLUME, STATE, VOLUMES,
};
use api::quantity::parse_bytes;
use api::validation::{guest_memory, vcpus};
use api::{VirtualMachineInstance, VirtualMachineInstanceSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapProjection, ConfigMapVolumeSource, Container, DownwardAPIProjection,
    DownwardAPIVolumeFile, DownwardAPIVolumeSource, EmptyDirVolumeSource, HostPathVolumeSource,
    KeyToPath, ObjectFieldSelector, PersistentVolumeClaimVolumeSource, Pod, PodSecurityContext,
    PodSpec, ProjectedVolumeSource, ResourceRequirements, SeccompProfile, SecretVolumeSource,
    SecurityContext, ServiceAccountTokenProjection, Volume, VolumeMount, VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

/// The Pod's volume of the claim a VMI starts from (`snapshot.microvirt.io/start-from-state`).
const MACHINE_STATE_VOLUME: &str = "machine-state";

pub const OVERHEAD_FIXED: u64 = 24 << 20;
pub const OVERHEAD_PER_VCPU: u64 = 1 << 20;

/// Least privilege for every container of the Pod: a fixed non-root user, no privilege
/// escalation, a read-only root file system (the launcher writes only to its emptyDir and
/// volume mounts), no capabilities (the launcher is handed its TAPs by virt-handler and gets
/// /dev/kvm from the device plugin). The importer Pod's container gets the same, as its user.
pub fn container_security_as(uid: i64) -> SecurityContext {
    SecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(uid),
        run_as_group: Some(uid),
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        privileged: Some(false),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            add: None,
        }),
        ..Default::default()
    }
}

/// The Pod's: the same user, volumes group-owned by it (`fsGroup`, so a PVC's disk image is
/// writable), and the container runtime's default seccomp profile around the launcher's own
/// per-thread filters (the importer Pod's, around the importer's own filter).
pub fn pod_security_as(uid: i64) -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(uid),
        run_as_group: Some(uid),
        fs_group: Some(uid),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            localhost_profile: None,
        }),
        ..Default::default()
    }
}

fn container_security() -> SecurityContext {
    container_security_as(LAUNCHER_UID)
}

fn pod_security() -> PodSecurityContext {
    pod_security_as(LAUNCHER_UID)
}

#[derive(Clone, Debug, Default)]
pub struct PodConfig {
    pub launcher_image: String,
    /// Whether, and where, a VMI may mount a host directory for a hostDisk.
    pub host_disks: api::validation::HostDiskPolicy,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{path}: {reason}")]
pub struct RenderError {
    pub path: String,
    pub reason: String,
}

/// Bytes of Pod memory beyond the guest's.
pub fn memory_overhead(guest: u64, vcpus: u64) -> u64 {
    OVERHEAD_FIXED + guest / 512 + vcpus * OVERHEAD_PER_VCPU
}

fn mib_quantity(bytes: u64) -> Quantity {
    Quantity(format!("{}Mi", bytes.div_ceil(1 << 20)))
}

fn mount(name: &str, path: &str) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        ..Default::default()
    }
}

fn mount_ro(name: &str, path: &str) -> VolumeMount {
    VolumeMount {
        read_only: Some(true),
        ..mount(name, path)
    }
}

/// One virtiofsd per filesystem, unprivileged beside the launcher as KubeVirt runs it (the
/// container is its sandbox): it serves the volume's directory (as the launcher mounts it)
/// on a socket in the shared sockets directory; ConfigMaps and Secrets read-only.
fn virtiofs_containers(
    cfg: &PodConfig,
    spec: &VirtualMachineInstanceSpec,
    mounts: &[VolumeMount],
) -> Vec<Container> {
    spec.domain
        .devices
        .filesystems
        .iter()
        .filter_map(|fs| {
            let vname = format!("volume-{}", fs.name);
            let m = mounts.iter().find(|m| m.name == vname)?.clone();
            let read_only = m.read_only == Some(true);
            let mut command = vec![
                "virtiofsd".to_string(),
                format!(
                    "--socket-path={SOCKETS}/{}",
                    api::launcher_pod::virtiofs_socket(&fs.name)
                ),
                format!("--shared-dir={}", m.mount_path),
                "--sandbox=none".into(),
                "--cache=auto".into(),
            ];
            if read_only {
                command.push("--readonly".into());
            }
            Some(Container {
                name: format!("virtiofs-{}", fs.name),
                image: Some(cfg.launcher_image.clone()),
                command: Some(command),
                volume_mounts: Some(vec![mount(SOCKETS_VOLUME, SOCKETS), m]),
                resources: Some(ResourceRequirements {
                    requests: Some(BTreeMap::from([
                        ("cpu".to_string(), Quantity("10m".into())),
                        ("memory".to_string(), Quantity("40Mi".into())),
                    ])),
                    ..Default::default()
                }),
                security_context: Some(container_security()),
                ..Default::default()
            })
        })
        .collect()
}

fn err(path: &str, reason: String) -> RenderError {
    RenderError {
        path: path.into(),
        reason,
    }
}

/// Renders the launcher Pod of a (defaulted, validated) VMI.
pub fn render(vmi: &VirtualMachineInstance, cfg: &PodConfig) -> Result<Pod, RenderError> {
    let name = vmi
        .metadata
        .name
        .clone()
        .ok_or_else(|| err("metadata.name", "is required".into()))?;
    let uid = vmi
        .metadata
        .uid
        .clone()
        .ok_or_else(|| err("metadata.uid", "is required (the VMI must exist)".into()))?;
    let spec = &vmi.spec;
    let resources = resources(spec)?;
    let mut storage = Storage::new();
    for (i, v) in spec.volumes.iter().enumerate() {
        storage.add(vmi, cfg, i, v)?;
    }
    if let Some(claim) = api::snapshot::start_from_state(vmi.metadata.annotations.as_ref()) {
        storage.add_machine_state(claim);
    }
    if let Some(c) = kernel_boot_container(spec) {
        storage.init_containers.push(c);
    }
    if let Some((volume, mount)) = network_info_volume(spec) {
        storage.volumes.push(volume);
        storage.mounts.push(mount);
    }
    let grace = spec.termination_grace_period_seconds.unwrap_or(30);
    let Storage {
        volumes,
        mounts,
        init_containers,
        service_account,
    } = storage;
    Ok(Pod {
        metadata: metadata(vmi, name, uid),
        spec: Some(PodSpec {
            init_containers: (!init_containers.is_empty()).then_some(init_containers),
            containers: std::iter::once(compute_container(cfg, resources, mounts.clone()))
                .chain(virtiofs_containers(cfg, spec, &mounts))
                .collect(),
            security_context: Some(pod_security()),
            volumes: Some(volumes),
            node_selector: spec.node_selector.clone(),
            affinity: spec.affinity.clone(),
            tolerations: spec.tolerations.clone(),
            priority_class_name: spec.priority_class_name.clone(),
            // The launcher needs the guest's grace period plus a moment to tear down.
            termination_grace_period_seconds: Some(grace + 15),
            hostname: spec.hostname.clone(),
            subdomain: spec.subdomain.clone(),
            automount_service_account_token: Some(false),
            service_account_name: service_account,
            restart_policy: Some("Never".into()),
            ..Default::default()
        }),
        status: None,
    })
}

/// The Pod's name, labels, annotations and the VMI as its controller.
/// The VMI's labels are the Pod's (as in KubeVirt: a Service selecting a VMI's labels reaches
/// its guest, and a downwardAPI volume sees them), under microvirt's own; its annotations too,
/// but for those that are KubeVirt's, kubectl's or Multus' to set.
fn metadata(vmi: &VirtualMachineInstance, name: String, uid: String) -> ObjectMeta {
    // Labels the controllers set on Pods and VMIs themselves stay theirs to set.
    let owned = [
        api::labels::NODE_NAME,
        api::labels::MIGRATION_JOB,
        api::labels::MIGRATION_TARGET_NODE,
    ];
    let mut labels: BTreeMap<String, String> = (vmi.metadata.labels.iter().flatten())
        .filter(|(k, _)| !owned.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    labels.extend([
        (
            api::labels::APP.to_string(),
            api::labels::APP_LAUNCHER.to_string(),
        ),
        (api::labels::CREATED_BY.to_string(), uid.clone()),
        (api::labels::VM_NAME.to_string(), name.clone()),
    ]);
    let mut annotations: BTreeMap<String, String> = (vmi.metadata.annotations.iter().flatten())
        .filter(|(k, _)| {
            ![
                "kubevirt.io/",
                "kubectl.kubernetes.io/",
                "k8s.v1.cni.cncf.io/",
            ]
            .iter()
            .any(|p| k.starts_with(p))
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    annotations.insert(api::labels::ANNOTATION_DOMAIN.to_string(), name.clone());
    if let Some(networks) = multus_networks(&vmi.spec, vmi.metadata.namespace.as_deref()) {
        annotations.insert(api::launcher_pod::MULTUS_NETWORKS.to_string(), networks);
    }
    ObjectMeta {
        generate_name: Some(format!("virt-launcher-{name}-")),
        namespace: vmi.metadata.namespace.clone(),
        labels: Some(labels),
        annotations: Some(annotations),
        owner_references: Some(vec![OwnerReference {
            api_version: "kubevirt.io/v1".into(),
            kind: "VirtualMachineInstance".into(),
            name,
            uid,
            controller: Some(true),
            block_owner_deletion: Some(true),
        }]),
        ..Default::default()
    }
}

/// Multus' `k8s.v1.cni.cncf.io/networks`: each Multus network of the VMI (`networkName`
/// as `name` or `namespace/name`), on the Pod interface virt-handler and the launcher expect
/// (`api::launcher_pod::multus_interfaces`). None without Multus networks.
fn multus_networks(spec: &VirtualMachineInstanceSpec, namespace: Option<&str>) -> Option<String> {
    let ifaces = api::launcher_pod::multus_interfaces(spec);
    let list: Vec<serde_json::Value> = ifaces
        .iter()
        .filter_map(|(network, pod_iface)| {
            let m = spec
                .networks
                .iter()
                .find(|n| &n.name == network)?
                .multus
                .as_ref()?;
            let (ns, name) = match m.network_name.split_once('/') {
                Some((ns, name)) => (Some(ns), name),
                None => (namespace, m.network_name.as_str()),
            };
            let mut entry = serde_json::json!({"name": name, "interface": pod_iface});
            if let Some(ns) = ns {
                entry["namespace"] = ns.into();
            }
            Some(entry)
        })
        .collect();
    (!list.is_empty()).then(|| serde_json::Value::from(list).to_string())
}

/// The Pod's own network-status annotation as a file, for interfaces whose vhost-user
/// socket Multus reports there (`binding: {name: vhostuser}`); None without such interfaces.
fn network_info_volume(spec: &VirtualMachineInstanceSpec) -> Option<(Volume, VolumeMount)> {
    if !spec
        .domain
        .devices
        .interfaces
        .iter()
        .any(|i| i.binding.is_some())
    {
        return None;
    }
    let file = DownwardAPIVolumeFile {
        path: api::launcher_pod::NETWORK_STATUS_FILE.into(),
        field_ref: Some(ObjectFieldSelector {
            api_version: Some("v1".into()),
            field_path: format!(
                "metadata.annotations['{}']",
                api::launcher_pod::MULTUS_NETWORK_STATUS
            ),
        }),
        ..Default::default()
    };
    let volume = Volume {
        name: "network-info".into(),
        downward_api: Some(DownwardAPIVolumeSource {
            items: Some(vec![file]),
            default_mode: None,
        }),
        ..Default::default()
    };
    Some((
        volume,
        mount_ro("network-info", api::launcher_pod::NETWORK_INFO),
    ))
}

/// The launcher itself, serving its control socket with the Pod's directories.
fn compute_container(
    cfg: &PodConfig,
    resources: ResourceRequirements,
    mounts: Vec<VolumeMount>,
) -> Container {
    Container {
        name: "compute".into(),
        image: Some(cfg.launcher_image.clone()),
        command: Some(vec![
            "virt-launcher".into(),
            "daemon".into(),
            "--socket".into(),
            control_socket_in_pod(),
            "--image-dir".into(),
            CONTAINER_DISKS.into(),
            "--volume-dir".into(),
            VOLUMES.into(),
            "--state-dir".into(),
            STATE.into(),
        ]),
        resources: Some(resources),
        volume_mounts: Some(mounts),
        security_context: Some(container_security()),
        ..Default::default()
    }
}

/// Requests and limits: guest memory plus microvirt's overhead, CPU (KubeVirt's default
/// allocation ratio), and the KVM and TUN devices from virt-handler's device plugins.
fn resources(spec: &VirtualMachineInstanceSpec) -> Result<ResourceRequirements, RenderError> {
    let guest = guest_memory(spec)
        .ok_or_else(|| err("spec.domain.memory.guest", "is required".into()))?
        .map_err(|r| err("spec.domain.memory.guest", r))?;
    let n = vcpus(spec);
    let mut requests = BTreeMap::new();
    // Huge-page guest RAM comes from the node's hugetlb pool, a resource of its own (requests
    // equal to limits, as Kubernetes requires); the memory request is then only the overhead.
    let hugepages = match spec
        .domain
        .memory
        .as_ref()
        .and_then(|m| m.hugepages.as_ref())
    {
        Some(h) => Some(
            api::validation::hugepage_bytes(h)
                .map_err(|r| err("spec.domain.memory.hugepages.pageSize", r))?,
        ),
        None => None,
    };
    let guest_in_memory = if hugepages.is_some() { 0 } else { guest };
    requests.insert(
        "memory".to_string(),
        mib_quantity(guest_in_memory + memory_overhead(guest, n)),
    );
    let cpu = spec
        .domain
        .resources
        .as_ref()
        .and_then(|r| r.requests.get("cpu").cloned())
        // KubeVirt's default CPU allocation ratio of 10: 100m per vCPU.
        .unwrap_or_else(|| Quantity(format!("{}m", 100 * n)));
    requests.insert("cpu".to_string(), cpu);
    let mut limits = BTreeMap::new();
    limits.insert(RESOURCE_KVM.to_string(), Quantity("1".into()));
    if let Some(page) = hugepages {
        let name = if page == 2 << 20 {
            "hugepages-2Mi"
        } else {
            "hugepages-1Gi"
        };
        requests.insert(name.to_string(), mib_quantity(guest));
        limits.insert(name.to_string(), mib_quantity(guest));
    }
    if !spec.domain.devices.interfaces.is_empty() {
        limits.insert(RESOURCE_TUN.to_string(), Quantity("1".into()));
    }
    // Extended resources the VMI asks for (a device plugin's `vhostuser/sockets`, a GPU, …)
    // go to the launcher, as KubeVirt passes them on; the kubelet mounts what they grant.
    if let Some(r) = spec.domain.resources.as_ref() {
        let extended = |m: &BTreeMap<String, Quantity>| {
            m.iter()
                .filter(|(k, _)| k.contains('/'))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<Vec<_>>()
        };
        limits.extend(extended(&r.limits));
        requests.extend(extended(&r.requests));
    }
    requests.extend(
        limits
            .iter()
            .filter(|(k, _)| k.starts_with("devices."))
            .map(|(k, v)| (k.clone(), v.clone())),
    );
    if let Some(l) = spec
        .domain
        .resources
        .as_ref()
        .and_then(|r| r.limits.get("memory"))
    {
        let bytes = parse_bytes(&l.0).map_err(|r| err("spec.domain.resources.limits.memory", r))?;
        let in_memory = if hugepages.is_some() { 0 } else { bytes };
        limits.insert(
            "memory".into(),
            mib_quantity(in_memory + memory_overhead(guest, n)),
        );
    }
    Ok(ResourceRequirements {
        requests: Some(requests),
        limits: Some(limits),
        ..Default::default()
    })
}

/// The Pod's volumes, the launcher's mounts of them, and the init containers that fill the
/// container-disks directory.
struct Storage {
    volumes: Vec<Volume>,
    mounts: Vec<VolumeMount>,
    init_containers: Vec<Container>,
    /// The ServiceAccount a serviceAccount volume names: the Pod runs as it, so its token can
    /// be projected.
    service_account: Option<String>,
}

fn empty_dir(name: &str) -> Volume {
    Volume {
        name: name.into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Default::default()
    }
}

/// The Pod volume behind a ConfigMap, Secret, ServiceAccount or downwardAPI volume of the VMI.
fn shared_volume_source(v: &api::Volume) -> Volume {
    if let Some(c) = &v.config_map {
        Volume {
            config_map: Some(ConfigMapVolumeSource {
                name: c.name.clone(),
                optional: c.optional,
                ..Default::default()
            }),
            ..Default::default()
        }
    } else if let Some(sec) = &v.secret {
        Volume {
            secret: Some(SecretVolumeSource {
                secret_name: Some(sec.secret_name.clone()),
                optional: sec.optional,
                ..Default::default()
            }),
            ..Default::default()
        }
    } else if v.service_account.is_some() {
        // The files the kubelet mounts for a Pod's own account (token, CA, namespace), asked
        // for by name because the launcher Pod automounts nothing into its containers.
        let token = ServiceAccountTokenProjection {
            path: "token".into(),
            expiration_seconds: Some(3607),
            audience: None,
        };
        let ca = ConfigMapProjection {
            name: "kube-root-ca.crt".into(),
            items: Some(vec![KeyToPath {
                key: "ca.crt".into(),
                path: "ca.crt".into(),
                mode: None,
            }]),
            optional: None,
        };
        let namespace = DownwardAPIProjection {
            items: Some(vec![DownwardAPIVolumeFile {
                path: "namespace".into(),
                field_ref: Some(ObjectFieldSelector {
                    api_version: Some("v1".into()),
                    field_path: "metadata.namespace".into(),
                }),
                ..Default::default()
            }]),
        };
        Volume {
            projected: Some(ProjectedVolumeSource {
                sources: Some(vec![
                    VolumeProjection {
                        service_account_token: Some(token),
                        ..Default::default()
                    },
                    VolumeProjection {
                        config_map: Some(ca),
                        ..Default::default()
                    },
                    VolumeProjection {
                        downward_api: Some(namespace),
                        ..Default::default()
                    },
                ]),
                default_mode: None,
            }),
            ..Default::default()
        }
    } else if let Some(d) = &v.downward_api {
        // A resource of "the container" is the VM's: the launcher's compute container.
        let items = d
            .fields
            .iter()
            .map(|f| {
                let mut f = f.clone();
                if let Some(r) = &mut f.resource_field_ref {
                    r.container_name.get_or_insert_with(|| "compute".into());
                }
                f
            })
            .collect();
        Volume {
            downward_api: Some(DownwardAPIVolumeSource {
                items: Some(items),
                default_mode: None,
            }),
            ..Default::default()
        }
    } else {
        Volume::default()
    }
}

/// Where the init containers copy an image's files: one directory per image reference.
fn image_dir(image: &str) -> String {
    format!("{CONTAINER_DISKS}/{}", image.replace(['/', ':'], "_"))
}

impl Storage {
    /// The sockets, private state and container-disks directories every launcher has.
    fn new() -> Storage {
        Storage {
            volumes: vec![
                empty_dir(SOCKETS_VOLUME),
                empty_dir("private"),
                empty_dir("container-disks"),
            ],
            mounts: vec![
                mount(SOCKETS_VOLUME, SOCKETS),
                mount("private", STATE),
                mount("container-disks", CONTAINER_DISKS),
            ],
            init_containers: Vec::new(),
            service_account: None,
        }
    }

    /// What `spec.volumes[i]` needs in the Pod.
    fn add(
        &mut self,
        vmi: &VirtualMachineInstance,
        cfg: &PodConfig,
        i: usize,
        v: &api::Volume,
    ) -> Result<(), RenderError> {
        let vname = format!("volume-{}", v.name);
        if let Some(c) = &v.container_disk {
            // An init container from the containerDisk image copies its disk where the launcher
            // looks for images (`--image-dir`, one directory per image reference).
            let dir = image_dir(&c.image);
            self.init_containers.push(Container {
                name: format!("container-disk-{}", v.name),
                image: Some(c.image.clone()),
                image_pull_policy: c.image_pull_policy.clone(),
                command: Some(vec![
                    "/bin/sh".into(),
                    "-c".into(),
                    format!("mkdir -p {dir} && cp -a /disk/. {dir}/"),
                ]),
                volume_mounts: Some(vec![mount("container-disks", CONTAINER_DISKS)]),
                security_context: Some(container_security()),
                ..Default::default()
            });
        } else if let Some((claim, read_only)) = v
            .persistent_volume_claim
            .as_ref()
            .map(|p| (p.claim_name.clone(), p.read_only))
            .or_else(|| v.data_volume.as_ref().map(|d| (d.name.clone(), None)))
        {
            self.volumes.push(Volume {
                name: vname.clone(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: claim.clone(),
                    read_only,
                }),
                ..Default::default()
            });
            self.mounts
                .push(mount(&vname, &format!("{VOLUMES}/{claim}")));
        } else if let Some(h) = &v.host_disk {
            self.add_host_disk(vmi, cfg, i, &vname, h)?;
        } else if let Some((dir, _)) = api::launcher_pod::shared_dir(v) {
            // Shared with virtio-fs (validation allows nothing else), read-only, where the
            // launcher's translation looks for it.
            self.volumes.push(Volume {
                name: vname.clone(),
                ..shared_volume_source(v)
            });
            self.mounts
                .push(mount_ro(&vname, &format!("{VOLUMES}/{dir}")));
            if let Some(a) = &v.service_account {
                self.service_account = Some(a.service_account_name.clone());
            }
        } else if v.empty_disk.is_none()
            && v.cloud_init_no_cloud.is_none()
            && v.cloud_init_config_drive.is_none()
        {
            return Err(err(
                &format!("spec.volumes[{i}]"),
                "has no source a launcher Pod can provide".into(),
            ));
        }
        Ok(())
    }

    /// A hostDisk: its directory from the node, where the policy allows it.
    /// The claim a VMI starting from a machine state reads it from: read-only (one snapshot's
    /// claim serves every VM started from it; each maps the memory file privately), where the
    /// launcher looks for claims.
    fn add_machine_state(&mut self, claim: &str) {
        self.volumes.push(Volume {
            name: MACHINE_STATE_VOLUME.into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: claim.into(),
                read_only: Some(true),
            }),
            ..Default::default()
        });
        self.mounts.push(mount_ro(
            MACHINE_STATE_VOLUME,
            &format!("{VOLUMES}/{claim}"),
        ));
    }

    fn add_host_disk(
        &mut self,
        vmi: &VirtualMachineInstance,
        cfg: &PodConfig,
        i: usize,
        vname: &str,
        h: &api::HostDiskSource,
    ) -> Result<(), RenderError> {
        // Checked here as well as at admission: a webhook can be bypassed, and this is
        // the point where a host directory is handed to a tenant.
        let ns = vmi.metadata.namespace.as_deref().unwrap_or("default");
        if let Some(refused) = cfg
            .host_disks
            .refusals(&vmi.spec, "spec", ns)
            .into_iter()
            .find(|f| f.path.starts_with(&format!("spec.volumes[{i}].")))
        {
            return Err(err(&refused.path, refused.reason));
        }
        let parent = std::path::Path::new(&h.path)
            .parent()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "/".into());
        // The kubelet creates the directory only for DiskOrCreate, and then only below an
        // allowed prefix (checked above).
        let host_type = if h.type_ == "DiskOrCreate" {
            "DirectoryOrCreate"
        } else {
            "Directory"
        };
        self.volumes.push(Volume {
            name: vname.into(),
            host_path: Some(HostPathVolumeSource {
                path: parent.clone(),
                type_: Some(host_type.into()),
            }),
            ..Default::default()
        });
        self.mounts.push(mount(vname, &parent));
        Ok(())
    }
}

/// The init container that copies a kernelBoot image's kernel and initrd where the launcher
/// resolves `kernelPath`.
fn kernel_boot_container(spec: &VirtualMachineInstanceSpec) -> Option<Container> {
    let k = spec
        .domain
        .firmware
        .as_ref()
        .and_then(|f| f.kernel_boot.as_ref())
        .and_then(|k| k.container.as_ref())?;
    // The tenant's paths reach the shell as arguments, never as script text.
    let mut command: Vec<String> = vec![
        "/bin/sh".into(),
        "-c".into(),
        r#"set -e; dir=$1; shift; for p; do mkdir -p "$dir$(dirname "$p")"; cp "$p" "$dir$p"; done"#.into(),
        "kernel-boot".into(),
        image_dir(&k.image),
    ];
    command.extend(
        [&k.kernel_path, &k.initrd_path]
            .into_iter()
            .flatten()
            .cloned(),
    );
    Some(Container {
        name: "kernel-boot".into(),
        image: Some(k.image.clone()),
        image_pull_policy: k.image_pull_policy.clone(),
        command: Some(command),
        volume_mounts: Some(vec![mount("container-disks", CONTAINER_DISKS)]),
        security_context: Some(container_security()),
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Pod of the VMI `json`, with a launcher image and nothing else configured.
    fn render_json(json: serde_json::Value) -> Pod {
        let vmi: VirtualMachineInstance = serde_json::from_value(json).unwrap();
        let cfg = PodConfig {
            launcher_image: "launcher".into(),
            ..Default::default()
        };
        render(&vmi, &cfg).unwrap()
    }

    #[test]
    fn each_filesystem_gets_an_unprivileged_virtiofsd_on_the_shared_sockets_directory() {
        let pod = render_json(serde_json::json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "web", "namespace": "default", "uid": "u-1"},
            "spec": {"domain": {"memory": {"guest": "64Mi"},
                                "devices": {"filesystems": [{"name": "data", "virtiofs": {}},
                                                            {"name": "cfg", "virtiofs": {}}]}},
                     "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "pvc-1"}},
                                 {"name": "cfg", "configMap": {"name": "app"}}]},
        }));
        let spec = pod.spec.unwrap();
        let names: Vec<&str> = spec.containers.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["compute", "virtiofs-data", "virtiofs-cfg"]);
        let data = &spec.containers[1];
        let cmd = data.command.clone().unwrap();
        assert!(cmd.contains(&format!("--socket-path={SOCKETS}/virtiofs-data.sock")));
        assert!(cmd.contains(&format!("--shared-dir={VOLUMES}/pvc-1")));
        assert!(!cmd.contains(&"--readonly".to_string()));
        let cfg = spec.containers[2].command.clone().unwrap();
        assert!(cfg.contains(&format!("--shared-dir={VOLUMES}/configmap/app")));
        assert!(cfg.contains(&"--readonly".to_string()), "{cfg:?}");
        let compute_mounts = spec.containers[0].volume_mounts.clone().unwrap();
        let cm = compute_mounts
            .iter()
            .find(|m| m.name == "volume-cfg")
            .unwrap();
        assert_eq!(cm.read_only, Some(true));
        let volumes = spec.volumes.unwrap();
        let v = volumes.iter().find(|v| v.name == "volume-cfg").unwrap();
        assert_eq!(v.config_map.as_ref().unwrap().name, "app");
        for c in &spec.containers {
            let sc = c.security_context.clone().unwrap();
            assert_eq!(sc.run_as_non_root, Some(true), "{}", c.name);
            assert_eq!(sc.allow_privilege_escalation, Some(false), "{}", c.name);
        }
    }

    #[test]
    fn a_service_account_and_downward_api_are_shared_read_only_and_the_pod_runs_as_the_account() {
        let pod = render_json(serde_json::json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "web", "namespace": "default", "uid": "u-1",
                         "labels": {"app": "shop", "kubevirt.io/nodeName": "n1"},
                         "annotations": {"team": "red", "kubevirt.io/latest-observed-api-version": "v1"}},
            "spec": {"domain": {"memory": {"guest": "64Mi"},
                                "devices": {"filesystems": [{"name": "sa", "virtiofs": {}},
                                                            {"name": "meta", "virtiofs": {}}]}},
                     "volumes": [{"name": "sa", "serviceAccount": {"serviceAccountName": "builder"}},
                                 {"name": "meta", "downwardAPI": {"fields": [
                                     {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
                                     {"path": "mem", "resourceFieldRef": {"resource": "limits.memory"}}]}}]},
        }));
        let labels = pod.metadata.labels.clone().unwrap();
        assert_eq!(labels["app"], "shop", "the VMI's labels are the Pod's");
        assert!(!labels.contains_key("kubevirt.io/nodeName"), "{labels:?}");
        let annotations = pod.metadata.annotations.clone().unwrap();
        assert_eq!(annotations["team"], "red");
        assert!(!annotations.contains_key("kubevirt.io/latest-observed-api-version"));
        let spec = pod.spec.unwrap();
        assert_eq!(spec.service_account_name.as_deref(), Some("builder"));
        assert_eq!(spec.automount_service_account_token, Some(false));
        let volumes = spec.volumes.unwrap();
        let sa = volumes.iter().find(|v| v.name == "volume-sa").unwrap();
        let sources = sa.projected.as_ref().unwrap().sources.clone().unwrap();
        let token = sources[0].service_account_token.as_ref().unwrap();
        assert_eq!(token.path, "token");
        assert_eq!(
            sources[1].config_map.as_ref().unwrap().name,
            "kube-root-ca.crt"
        );
        let meta = volumes.iter().find(|v| v.name == "volume-meta").unwrap();
        let items = meta.downward_api.as_ref().unwrap().items.clone().unwrap();
        assert_eq!(
            items[0].field_ref.as_ref().unwrap().field_path,
            "metadata.labels"
        );
        let mem = items[1].resource_field_ref.as_ref().unwrap();
        assert_eq!(mem.container_name.as_deref(), Some("compute"));
        for (container, dir) in [
            (&spec.containers[1], "serviceaccount"),
            (&spec.containers[2], "downwardapi/meta"),
        ] {
            let cmd = container.command.clone().unwrap();
            assert!(
                cmd.contains(&format!("--shared-dir={VOLUMES}/{dir}")),
                "{cmd:?}"
            );
            assert!(cmd.contains(&"--readonly".to_string()), "{cmd:?}");
        }
    }

    #[test]
    fn multus_networks_are_asked_for_and_a_vhostuser_nic_reads_its_socket_from_network_status() {
        let pod = render_json(serde_json::json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "vnf", "namespace": "tenant", "uid": "u-1"},
            "spec": {"domain": {"memory": {"guest": "64Mi"},
                                "resources": {"requests": {"vhostuser/sockets": "1"},
                                              "limits": {"vhostuser/sockets": "1"}},
                                "devices": {"interfaces": [
                                    {"name": "default", "masquerade": {}},
                                    {"name": "dp", "binding": {"name": "vhostuser"}},
                                    {"name": "blue", "bridge": {}}]}},
                     "networks": [{"name": "default", "pod": {}},
                                  {"name": "dp", "multus": {"networkName": "dpdk-net"}},
                                  {"name": "blue", "multus": {"networkName": "infra/blue-net"}}]},
        }));
        let annotations = pod.metadata.annotations.clone().unwrap();
        let networks: serde_json::Value =
            serde_json::from_str(&annotations[api::launcher_pod::MULTUS_NETWORKS]).unwrap();
        assert_eq!(
            networks,
            serde_json::json!([
                {"name": "dpdk-net", "namespace": "tenant", "interface": "net1"},
                {"name": "blue-net", "namespace": "infra", "interface": "net2"}
            ])
        );
        let spec = pod.spec.unwrap();
        let compute = &spec.containers[0];
        let r = compute.resources.clone().unwrap();
        assert_eq!(r.limits.unwrap()["vhostuser/sockets"].0, "1");
        assert_eq!(r.requests.unwrap()["vhostuser/sockets"].0, "1");
        let mounts = compute.volume_mounts.clone().unwrap();
        let m = mounts.iter().find(|m| m.name == "network-info").unwrap();
        assert_eq!(m.mount_path, api::launcher_pod::NETWORK_INFO);
        let volumes = spec.volumes.unwrap();
        let v = volumes.iter().find(|v| v.name == "network-info").unwrap();
        let items = v.downward_api.as_ref().unwrap().items.clone().unwrap();
        assert_eq!(
            items[0].field_ref.as_ref().unwrap().field_path,
            "metadata.annotations['k8s.v1.cni.cncf.io/network-status']"
        );
    }

    #[test]
    fn huge_page_guests_request_the_pool_and_only_the_overhead_as_memory() {
        let vmi: VirtualMachineInstance = serde_json::from_value(serde_json::json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "web", "namespace": "default", "uid": "u-1"},
            "spec": {"domain": {"memory": {"guest": "1Gi", "hugepages": {"pageSize": "2Mi"}},
                                "devices": {}}},
        }))
        .unwrap();
        let r = resources(&vmi.spec).unwrap();
        let (req, lim) = (r.requests.unwrap(), r.limits.unwrap());
        assert_eq!(req["hugepages-2Mi"], Quantity("1024Mi".into()));
        assert_eq!(lim["hugepages-2Mi"], Quantity("1024Mi".into()));
        assert_eq!(
            req["memory"],
            mib_quantity(memory_overhead(1 << 30, 1)),
            "guest RAM is not ordinary memory"
        );
    }

    #[test]
    fn a_vmi_starting_from_a_machine_state_mounts_its_claim_read_only() {
        let pod = render_json(serde_json::json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "web", "namespace": "default", "uid": "u-1",
                         "annotations": {"snapshot.microvirt.io/start-from-state": "vmstate-s1"}},
            "spec": {"domain": {"memory": {"guest": "64Mi"}, "devices": {}}},
        }));
        let spec = pod.spec.unwrap();
        let volume = spec
            .volumes
            .unwrap()
            .into_iter()
            .find(|v| v.name == MACHINE_STATE_VOLUME)
            .unwrap();
        let claim = volume.persistent_volume_claim.unwrap();
        assert_eq!(claim.claim_name, "vmstate-s1");
        assert_eq!(claim.read_only, Some(true));
        let mount = spec.containers[0]
            .volume_mounts
            .clone()
            .unwrap()
            .into_iter()
            .find(|m| m.name == MACHINE_STATE_VOLUME)
            .unwrap();
        assert_eq!(mount.mount_path, format!("{VOLUMES}/vmstate-s1"));
        assert_eq!(mount.read_only, Some(true));
    }

    #[test]
    fn every_container_runs_unprivileged() {
        let pod = render_json(serde_json::json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "web", "namespace": "default", "uid": "u-1"},
            "spec": {"domain": {"memory": {"guest": "64Mi"},
                                "devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}]}},
                     "volumes": [{"name": "root", "containerDisk": {"image": "quay.io/containerdisks/alpine:3.20"}}]},
        }));
        let spec = pod.spec.unwrap();
        let ps = spec.security_context.unwrap();
        assert_eq!(ps.run_as_non_root, Some(true));
        assert_eq!(ps.run_as_user, Some(107));
        assert_eq!(ps.fs_group, Some(107));
        assert_eq!(ps.seccomp_profile.unwrap().type_, "RuntimeDefault");
        let containers: Vec<Container> = spec
            .init_containers
            .unwrap()
            .into_iter()
            .chain(spec.containers)
            .collect();
        assert_eq!(containers.len(), 2);
        for c in containers {
            let sc = c.security_context.unwrap();
            assert_eq!(sc.run_as_non_root, Some(true), "{}", c.name);
            assert_eq!(sc.run_as_user, Some(107), "{}", c.name);
            assert_eq!(sc.allow_privilege_escalation, Some(false), "{}", c.name);
            assert_eq!(sc.read_only_root_filesystem, Some(true), "{}", c.name);
            assert_eq!(
                sc.capabilities.unwrap().drop.unwrap(),
                ["ALL"],
                "{}",
                c.name
            );
        }
    }

    #[test]
    fn overhead_formula() {
        assert_eq!(
            memory_overhead(1 << 30, 2),
            (24 << 20) + (2 << 20) + (2 << 20)
        );
        assert_eq!(
            mib_quantity((1 << 30) + memory_overhead(1 << 30, 2)).0,
            "1052Mi"
        );
    }
}
