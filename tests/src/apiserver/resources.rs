//! The kinds the server stores, as the real one knows them from its built-in types and CRDs.

/// A kind the server stores.
#[derive(Clone, Debug)]
pub struct ResourceType {
    pub group: &'static str,
    pub version: &'static str,
    pub plural: &'static str,
    pub kind: &'static str,
    pub namespaced: bool,
    pub status_subresource: bool,
    /// JSON paths (without the leading dot) of spec replicas, status replicas, status selector.
    pub scale: Option<(&'static str, &'static str, &'static str)>,
}

impl ResourceType {
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
    /// A custom resource (a CRD's kind), not one of the server's own: what its group says.
    pub fn is_custom(&self) -> bool {
        self.group.contains('.') && !self.group.ends_with(".k8s.io")
    }

    pub fn key(&self) -> String {
        format!("{}/{}/{}", self.group, self.version, self.plural)
    }
}

/// The scale subresource's paths: spec replicas, status replicas, status selector.
type Scale = Option<(&'static str, &'static str, &'static str)>;
/// Group, version, plural, kind, namespaced, status subresource, scale subresource.
type Kind = (
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    bool,
    bool,
    Scale,
);

/// Replicas for the scale subresource: spec, status, status selector.
const REPLICAS: Scale = Some(("spec.replicas", "status.replicas", "status.labelSelector"));

/// The kinds microvirt's control plane touches: group, version, plural, kind, namespaced,
/// status subresource, scale subresource.
#[rustfmt::skip]
const KINDS: &[Kind] = &[
    ("", "v1", "pods", "Pod", true, true, None),
    ("", "v1", "nodes", "Node", false, true, None),
    ("", "v1", "namespaces", "Namespace", false, true, None),
    ("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", true, true, None),
    ("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", true, true, None),
    ("", "v1", "events", "Event", true, false, None),
    ("events.k8s.io", "v1", "events", "Event", true, false, None),
    ("coordination.k8s.io", "v1", "leases", "Lease", true, false, None),
    ("kubevirt.io", "v1", "virtualmachines", "VirtualMachine", true, true, None),
    ("kubevirt.io", "v1", "virtualmachineinstances", "VirtualMachineInstance", true, true, None),
    ("kubevirt.io", "v1", "virtualmachineinstancereplicasets", "VirtualMachineInstanceReplicaSet", true, true, REPLICAS),
    ("pool.kubevirt.io", "v1beta1", "virtualmachinepools", "VirtualMachinePool", true, true, REPLICAS),
    ("kubevirt.io", "v1", "virtualmachineinstancemigrations", "VirtualMachineInstanceMigration", true, true, None),
    ("migrations.kubevirt.io", "v1alpha1", "migrationpolicies", "MigrationPolicy", false, true, None),
    ("instancetype.kubevirt.io", "v1beta1", "virtualmachineinstancetypes", "VirtualMachineInstancetype", true, false, None),
    ("instancetype.kubevirt.io", "v1beta1", "virtualmachineclusterinstancetypes", "VirtualMachineClusterInstancetype", false, false, None),
    ("instancetype.kubevirt.io", "v1beta1", "virtualmachinepreferences", "VirtualMachinePreference", true, false, None),
    ("instancetype.kubevirt.io", "v1beta1", "virtualmachineclusterpreferences", "VirtualMachineClusterPreference", false, false, None),
    // CDI's DataVolume (its CRD from `deploy/cdi/`), filled by virt-controller's importer.
    ("cdi.kubevirt.io", "v1beta1", "datavolumes", "DataVolume", true, true, None),
    ("storage.k8s.io", "v1", "storageclasses", "StorageClass", false, false, None),
    // KubeVirt's VM snapshots, and the CSI snapshot kinds they are made of (the
    // external-snapshotter's CRDs; its controller is played by `storage::ImportNode`).
    ("snapshot.kubevirt.io", "v1beta1", "virtualmachinesnapshots", "VirtualMachineSnapshot", true, true, None),
    ("snapshot.kubevirt.io", "v1beta1", "virtualmachinesnapshotcontents", "VirtualMachineSnapshotContent", true, true, None),
    ("snapshot.kubevirt.io", "v1beta1", "virtualmachinerestores", "VirtualMachineRestore", true, true, None),
    ("clone.kubevirt.io", "v1beta1", "virtualmachineclones", "VirtualMachineClone", true, true, None),
    ("snapshot.storage.k8s.io", "v1", "volumesnapshots", "VolumeSnapshot", true, true, None),
    ("snapshot.storage.k8s.io", "v1", "volumesnapshotclasses", "VolumeSnapshotClass", false, false, None),
    ("", "v1", "secrets", "Secret", true, false, None),
    ("apps", "v1", "controllerrevisions", "ControllerRevision", true, false, None),
    ("", "v1", "configmaps", "ConfigMap", true, false, None),
    ("", "v1", "services", "Service", true, true, None),
    // The aggregation layer (see `aggregator`) and delegated authorization.
    ("apiregistration.k8s.io", "v1", "apiservices", "APIService", false, true, None),
    ("authorization.k8s.io", "v1", "subjectaccessreviews", "SubjectAccessReview", false, false, None),
    // What virt-operator installs, and the CR it installs from.
    ("kubevirt.io", "v1", "kubevirts", "KubeVirt", true, true, None),
    ("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", false, true, None),
    ("", "v1", "serviceaccounts", "ServiceAccount", true, false, None),
    ("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", false, false, None),
    ("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", false, false, None),
    ("rbac.authorization.k8s.io", "v1", "roles", "Role", true, false, None),
    ("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding", true, false, None),
    ("apps", "v1", "deployments", "Deployment", true, true, None),
    ("apps", "v1", "daemonsets", "DaemonSet", true, true, None),
    ("admissionregistration.k8s.io", "v1", "validatingwebhookconfigurations", "ValidatingWebhookConfiguration", false, false, None),
    ("admissionregistration.k8s.io", "v1", "mutatingwebhookconfigurations", "MutatingWebhookConfiguration", false, false, None),
    // virt-handler's node certificates (see `csr`).
    ("certificates.k8s.io", "v1", "certificatesigningrequests", "CertificateSigningRequest", false, true, None),
];

/// The kinds microvirt's control plane touches.
pub fn default_types() -> Vec<ResourceType> {
    KINDS
        .iter()
        .map(
            |&(group, version, plural, kind, namespaced, status_subresource, scale)| ResourceType {
                group,
                version,
                plural,
                kind,
                namespaced,
                status_subresource,
                scale,
            },
        )
        .collect()
}
