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

/// The kinds microvirt's control plane touches.
pub fn default_types() -> Vec<ResourceType> {
    let t = |group, version, plural, kind, namespaced, status| ResourceType {
        group,
        version,
        plural,
        kind,
        namespaced,
        status_subresource: status,
        scale: None,
    };
    let mut rs = t(
        "kubevirt.io",
        "v1",
        "virtualmachineinstancereplicasets",
        "VirtualMachineInstanceReplicaSet",
        true,
        true,
    );
    rs.scale = Some(("spec.replicas", "status.replicas", "status.labelSelector"));
    let mut pool = t(
        "pool.kubevirt.io",
        "v1beta1",
        "virtualmachinepools",
        "VirtualMachinePool",
        true,
        true,
    );
    pool.scale = Some(("spec.replicas", "status.replicas", "status.labelSelector"));
    vec![
        t("", "v1", "pods", "Pod", true, true),
        t("", "v1", "nodes", "Node", false, true),
        t("", "v1", "namespaces", "Namespace", false, true),
        t(
            "",
            "v1",
            "persistentvolumeclaims",
            "PersistentVolumeClaim",
            true,
            true,
        ),
        t(
            "policy",
            "v1",
            "poddisruptionbudgets",
            "PodDisruptionBudget",
            true,
            true,
        ),
        t("", "v1", "events", "Event", true, false),
        t("events.k8s.io", "v1", "events", "Event", true, false),
        t("coordination.k8s.io", "v1", "leases", "Lease", true, false),
        t(
            "kubevirt.io",
            "v1",
            "virtualmachines",
            "VirtualMachine",
            true,
            true,
        ),
        t(
            "kubevirt.io",
            "v1",
            "virtualmachineinstances",
            "VirtualMachineInstance",
            true,
            true,
        ),
        rs,
        pool,
        t(
            "kubevirt.io",
            "v1",
            "virtualmachineinstancemigrations",
            "VirtualMachineInstanceMigration",
            true,
            true,
        ),
        t(
            "migrations.kubevirt.io",
            "v1alpha1",
            "migrationpolicies",
            "MigrationPolicy",
            false,
            true,
        ),
        t(
            "instancetype.kubevirt.io",
            "v1beta1",
            "virtualmachineinstancetypes",
            "VirtualMachineInstancetype",
            true,
            false,
        ),
        t(
            "instancetype.kubevirt.io",
            "v1beta1",
            "virtualmachineclusterinstancetypes",
            "VirtualMachineClusterInstancetype",
            false,
            false,
        ),
        t(
            "instancetype.kubevirt.io",
            "v1beta1",
            "virtualmachinepreferences",
            "VirtualMachinePreference",
            true,
            false,
        ),
        t(
            "instancetype.kubevirt.io",
            "v1beta1",
            "virtualmachineclusterpreferences",
            "VirtualMachineClusterPreference",
            false,
            false,
        ),
        // CDI's, for dataVolumeTemplates (the tests play CDI).
        t(
            "cdi.kubevirt.io",
            "v1beta1",
            "datavolumes",
            "DataVolume",
            true,
            true,
        ),
        t(
            "apps",
            "v1",
            "controllerrevisions",
            "ControllerRevision",
            true,
            false,
        ),
    ]
}
