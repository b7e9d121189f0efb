//! Golden tests for the rendered launcher Pod.

use api::validation::{default_vmi_spec, validate_vmi};
use api::{VirtualMachine, VirtualMachineInstance};
use controller::pod::{render, PodConfig};

fn golden(name: &str, actual: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, actual).unwrap();
    }
    let expected =
        std::fs::read_to_string(&path).unwrap_or_else(|_| panic!("missing {}", path.display()));
    assert_eq!(
        actual,
        expected,
        "rendered Pod differs from {} (UPDATE_GOLDEN=1 rewrites it)",
        path.display()
    );
}

fn vmi_from_vm(yaml: &str) -> VirtualMachineInstance {
    let vm: VirtualMachine = serde_yaml::from_str(yaml).unwrap();
    let mut vmi = VirtualMachineInstance::new(
        vm.metadata.name.as_deref().unwrap(),
        vm.spec.template.spec.clone().unwrap(),
    );
    vmi.metadata.namespace = vm.metadata.namespace.clone();
    vmi.metadata.uid = Some("0b2a6f3e-1c1d-4e55-9d6a-2f1e5c0c0001".into());
    // The fixture carries a field no KubeVirt has, to prove the types keep it; validation
    // refuses it by path, so it goes before the Pod is rendered.
    vmi.spec.extra.remove("futureField");
    default_vmi_spec(&mut vmi.spec);
    validate_vmi(&vmi).unwrap();
    vmi
}

/// The full manifest's hostDisk lies in /var/lib/vms, which this cluster allows.
fn full_config() -> PodConfig {
    PodConfig {
        launcher_image: "quay.io/microvirt/virt-launcher:v0.1.0".into(),
        host_disks: api::validation::HostDiskPolicy {
            feature_gate: true,
            allowed_prefixes: vec!["/var/lib/vms".into()],
        },
    }
}

#[test]
fn host_disks_need_the_gate_and_an_allowed_prefix() {
    let vmi = vmi_from_vm(include_str!("../../api/tests/data/vm-full.yaml"));
    let i = vmi
        .spec
        .volumes
        .iter()
        .position(|v| v.host_disk.is_some())
        .unwrap();
    let gate_off = render(&vmi, &PodConfig::default()).unwrap_err();
    assert_eq!(gate_off.path, format!("spec.volumes[{i}].hostDisk"));
    assert!(
        gate_off
            .reason
            .starts_with("HostDisk feature gate is not enabled"),
        "{gate_off}"
    );
    for prefixes in [
        vec![],
        vec!["/var/lib/vm".to_string()],
        vec!["/var/lib/vms/{namespace}".into()],
    ] {
        let cfg = PodConfig {
            host_disks: api::validation::HostDiskPolicy {
                feature_gate: true,
                allowed_prefixes: prefixes.clone(),
            },
            ..Default::default()
        };
        let outside = render(&vmi, &cfg).unwrap_err();
        assert_eq!(
            outside.path,
            format!("spec.volumes[{i}].hostDisk.path"),
            "{prefixes:?}"
        );
        assert!(
            outside
                .reason
                .contains("/var/lib/vms/host.img is outside the host directories"),
            "{outside}"
        );
    }
    // Allowed: the kubelet creates the parent only for DiskOrCreate.
    let pod = render(&vmi, &full_config()).unwrap();
    let host = pod
        .spec
        .unwrap()
        .volumes
        .unwrap()
        .into_iter()
        .find_map(|v| v.host_path)
        .unwrap();
    assert_eq!(
        (host.path.as_str(), host.type_.as_deref()),
        ("/var/lib/vms", Some("DirectoryOrCreate"))
    );
}

#[test]
fn full_vm_renders_the_documented_pod() {
    let vmi = vmi_from_vm(include_str!("../../api/tests/data/vm-full.yaml"));
    let pod = render(&vmi, &full_config()).unwrap();
    golden(
        "launcher-pod-full.yaml",
        &serde_yaml::to_string(&pod).unwrap(),
    );
    let spec = pod.spec.unwrap();
    let c = &spec.containers[0];
    assert_eq!(c.name, "compute");
    let req = c.resources.as_ref().unwrap().requests.as_ref().unwrap();
    // 1 GiB guest + 24 MiB + 2 MiB page tables + 2 vCPUs × 1 MiB.
    assert_eq!(req["memory"].0, "1052Mi");
    assert_eq!(req["cpu"].0, "500m");
    let lim = c.resources.as_ref().unwrap().limits.as_ref().unwrap();
    assert_eq!(lim["devices.kubevirt.io/kvm"].0, "1");
    assert_eq!(lim["devices.kubevirt.io/tun"].0, "1");
    let labels = pod.metadata.labels.unwrap();
    assert_eq!(labels["kubevirt.io"], "virt-launcher");
    assert_eq!(
        labels["kubevirt.io/created-by"],
        "0b2a6f3e-1c1d-4e55-9d6a-2f1e5c0c0001"
    );
    assert_eq!(labels["vm.kubevirt.io/name"], "full");
    assert_eq!(
        pod.metadata.annotations.unwrap()["kubevirt.io/domain"],
        "full"
    );
    assert_eq!(
        pod.metadata.generate_name.as_deref(),
        Some("virt-launcher-full-")
    );
    assert_eq!(spec.termination_grace_period_seconds, Some(60));
    assert_eq!(spec.priority_class_name.as_deref(), Some("high"));
    assert_eq!(
        spec.tolerations.unwrap()[0].key.as_deref(),
        Some("dedicated")
    );
    assert!(spec.affinity.is_some());
    assert_eq!(spec.node_selector.unwrap()["kubernetes.io/arch"], "amd64");
    let vols: Vec<_> = spec.volumes.unwrap().into_iter().map(|v| v.name).collect();
    assert!(
        vols.contains(&"volume-data".to_string())
            && vols.contains(&"volume-cd".to_string())
            && vols.contains(&"volume-host".to_string()),
        "{vols:?}"
    );
    assert_eq!(
        spec.init_containers.unwrap()[0].image.as_deref(),
        Some("quay.io/containerdisks/fedora:40")
    );
}

#[test]
fn a_vmi_without_interfaces_needs_no_tun() {
    let mut vmi = VirtualMachineInstance::new(
        "small",
        serde_yaml::from_str(
            "domain: {memory: {guest: 64Mi}, devices: {autoattachPodInterface: false}}",
        )
        .unwrap(),
    );
    vmi.metadata.uid = Some("u".into());
    default_vmi_spec(&mut vmi.spec);
    let pod = render(
        &vmi,
        &PodConfig {
            launcher_image: "l".into(),
            ..Default::default()
        },
    )
    .unwrap();
    let c = &pod.spec.unwrap().containers[0];
    let lim = c.resources.as_ref().unwrap().limits.as_ref().unwrap();
    assert!(!lim.contains_key("devices.kubevirt.io/tun"));
    // 64 MiB + 24 MiB + 128 KiB + 1 MiB, rounded up to MiB.
    assert_eq!(
        c.resources.as_ref().unwrap().requests.as_ref().unwrap()["memory"].0,
        "90Mi"
    );
    assert_eq!(
        c.resources.as_ref().unwrap().requests.as_ref().unwrap()["cpu"].0,
        "100m"
    );
}

#[test]
fn a_vmi_without_uid_is_not_rendered() {
    let vmi = VirtualMachineInstance::new(
        "x",
        serde_yaml::from_str("domain: {memory: {guest: 64Mi}, devices: {}}").unwrap(),
    );
    let e = render(
        &vmi,
        &PodConfig {
            launcher_image: "l".into(),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert_eq!(e.path, "metadata.uid");
}

#[test]
fn migration_target_pod_avoids_the_source_node() {
    let vmi = vmi_from_vm(include_str!("../../api/tests/data/vm-full.yaml"));
    let mut m = api::VirtualMachineInstanceMigration::new(
        "migrate-full",
        api::VirtualMachineInstanceMigrationSpec {
            vmi_name: vmi.metadata.name.clone().unwrap(),
        },
    );
    m.metadata.uid = Some("7d5c3a1e-0000-4000-8000-00000000beef".into());
    let pod = controller::migration::target_pod(&vmi, &m, &full_config()).unwrap();
    golden(
        "migration-target-pod-full.yaml",
        &serde_yaml::to_string(&pod).unwrap(),
    );
    // Everything but the migration label and the anti-affinity term is the launcher Pod's.
    let source = render(&vmi, &full_config()).unwrap();
    assert_eq!(
        pod.spec.as_ref().unwrap().containers,
        source.spec.as_ref().unwrap().containers
    );
    let labels = pod.metadata.labels.unwrap();
    assert_eq!(
        labels["kubevirt.io/migrationJobUID"],
        "7d5c3a1e-0000-4000-8000-00000000beef"
    );
}
