//! Every kind survives YAML → typed → YAML unchanged, including fields microvirt does not model.

use api::*;

fn roundtrip<T: serde::de::DeserializeOwned + serde::Serialize>(yaml: &str) {
    let original: serde_json::Value = serde_yaml::from_str(yaml).unwrap();
    let typed: T = serde_yaml::from_str(yaml).unwrap();
    let back = serde_json::to_value(&typed).unwrap();
    assert_eq!(back, original, "round trip changed the object");
    // And once more through the typed form: stable.
    let again: T = serde_json::from_value(back.clone()).unwrap();
    assert_eq!(serde_json::to_value(&again).unwrap(), back);
}

#[test]
fn virtual_machine_with_every_modelled_field_and_unknown_ones() {
    let yaml = include_str!("data/vm-full.yaml");
    roundtrip::<VirtualMachine>(yaml);
    let vm: VirtualMachine = serde_yaml::from_str(yaml).unwrap();
    let spec = vm.spec.template.spec.as_ref().unwrap();
    assert_eq!(vm.spec.run_strategy, Some(RunStrategy::RerunOnFailure));
    assert_eq!(spec.domain.cpu.as_ref().unwrap().cores, Some(2));
    assert_eq!(spec.volumes.len(), 6);
    assert!(
        spec.extra.contains_key("futureField"),
        "unknown fields are kept"
    );
    assert!(vm.spec.extra.contains_key("updateVolumesStrategy"));
    assert_eq!(
        spec.tolerations.as_ref().unwrap()[0].key.as_deref(),
        Some("dedicated")
    );
}

#[test]
fn virtual_machine_instance() {
    roundtrip::<VirtualMachineInstance>(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: vmi1, namespace: default}
spec:
  domain:
    memory: {guest: 128Mi}
    devices:
      disks: [{name: root, disk: {bus: virtio}}]
      interfaces: [{name: default, masquerade: {}}]
  networks: [{name: default, pod: {}}]
  volumes: [{name: root, containerDisk: {image: "img:1"}}]
status:
  phase: Running
  nodeName: node-a
  interfaces: [{name: default, ipAddress: 10.244.0.7, ipAddresses: [10.244.0.7], mac: "02:00:00:00:00:01", interfaceName: eth0}]
  migrationState:
    migrationUid: "1234"
    sourceNode: node-a
    targetNode: node-b
    targetPod: virt-launcher-vmi1-abcde
    completed: false
    migrationConfiguration: {bandwidthPerMigration: 64Mi, completionTimeoutPerGiB: 150, allowAutoConverge: false, allowPostCopy: false, maxDowntimeMs: 300}
  conditions: [{type: Ready, status: "True"}]
"#,
    );
}

#[test]
fn replica_set_migration_and_policy() {
    roundtrip::<VirtualMachineInstanceReplicaSet>(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstanceReplicaSet
metadata: {name: rs}
spec:
  replicas: 3
  selector: {matchLabels: {app: rs}}
  template:
    metadata: {labels: {app: rs}}
    spec:
      domain: {memory: {guest: 64Mi}, devices: {}}
status: {replicas: 3, readyReplicas: 2, labelSelector: app=rs}
"#,
    );
    roundtrip::<VirtualMachineInstanceMigration>(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstanceMigration
metadata: {name: mig}
spec: {vmiName: vmi1}
status:
  phase: Running
  phaseTransitionTimestamps: [{phase: Pending, phaseTransitionTimestamp: "2026-11-30T00:00:00Z"}]
"#,
    );
    roundtrip::<MigrationPolicy>(
        r#"
apiVersion: migrations.kubevirt.io/v1alpha1
kind: MigrationPolicy
metadata: {name: fast}
spec:
  allowAutoConverge: true
  bandwidthPerMigration: 1Gi
  completionTimeoutPerGiB: 30
  allowPostCopy: false
  selectors:
    namespaceSelector: {tier: prod}
    virtualMachineInstanceSelector: {workload: db}
"#,
    );
}
