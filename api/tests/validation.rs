//! Validation: each offending field path, why, and what is accepted — in one error.

use api::validation::*;
use api::*;

/// `v` is refused with (at least) each of `expected` among its errors.
fn assert_refused(v: &VirtualMachineInstance, expected: &[&str]) {
    let text = validate_vmi(v).unwrap_err().to_string();
    for e in expected {
        assert!(text.contains(e), "missing {e:?} in:\n{text}");
    }
}

fn vmi(yaml: &str) -> VirtualMachineInstance {
    serde_yaml::from_str(yaml).unwrap()
}

#[test]
fn every_problem_is_listed_with_its_path() {
    let v = vmi(r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: bad, namespace: ns}
spec:
  domain:
    cpu: {cores: 0, model: Haswell, features: [{name: vmx}]}
    devices:
      autoattachGraphicsDevice: true
      gpus: [{name: g, deviceName: nvidia}]
      disks:
        - {name: root, disk: {bus: sata}}
        - {name: root, disk: {bus: virtio}}
        - {name: orphan}
        - {name: lun, lun: {}}
      interfaces:
        - {name: default, sriov: {}}
    firmware: {bootloader: {efi: {}}}
  networks: [{name: default, pod: {}}]
  volumes:
    - {name: root, containerDisk: {image: x}}
    - {name: lun, persistentVolumeClaim: {claimName: c}, emptyDisk: {capacity: 1Gi}}
    - {name: cm, configMap: {name: cfg}}
"#);
    let err = validate_vmi(&v).unwrap_err();
    let text = err.to_string();
    let expect = [
        "spec.domain.memory.guest: a memory size is required",
        "spec.domain.cpu.cores: must be at least 1",
        "spec.domain.cpu.model: model \"Haswell\" is not supported by microvirt; accepted: host-passthrough, host-model",
        "spec.domain.cpu.features[0]: CPU feature \"vmx\" is not supported by microvirt",
        "spec.domain.firmware.bootloader.efi: EFI firmware is not supported by microvirt",
        "spec.domain.devices.gpus: gpus is not supported by microvirt",
        "spec.domain.devices.autoattachGraphicsDevice: a graphics device (VNC) is not supported",
        "spec.domain.devices.disks[0].disk.bus: bus \"sata\" is not supported by microvirt; accepted: virtio",
        "spec.domain.devices.disks[1].name: duplicate disk name \"root\"",
        "spec.domain.devices.disks[2].name: no volume named \"orphan\"; every disk needs a volume of the same name",
        "spec.domain.devices.disks[3].lun: a LUN (SCSI passthrough) is not supported",
        "spec.volumes[1]: exactly one volume source is required, found 2",
        "spec.volumes[2].configMap: a configMap volume as a disk is not supported",
        "spec.domain.devices.interfaces[0].sriov: SR-IOV is not supported by microvirt; accepted bindings: masquerade, bridge",
    ];
    for e in expect {
        assert!(text.contains(e), "missing {e:?} in:\n{text}");
    }
    assert!(
        text.starts_with("VirtualMachineInstance ns/bad is invalid:"),
        "{text}"
    );
    assert_eq!(err.errors.len(), expect.len(), "{text}");
}

#[test]
fn conflicting_running_and_run_strategy() {
    let vm: VirtualMachine = serde_yaml::from_str(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: vm}
spec:
  running: true
  runStrategy: Always
  template: {spec: {domain: {memory: {guest: 64Mi}, devices: {}}}}
"#,
    )
    .unwrap();
    let e = validate_vm(&vm).unwrap_err();
    assert_eq!(e.errors.len(), 1);
    assert_eq!(e.errors[0].path, "spec.running");
    assert!(e.errors[0]
        .reason
        .contains("conflicts with spec.runStrategy"));
}

#[test]
fn bad_quantities_and_ranges() {
    for (q, why) in [
        ("12Xi", "unknown suffix"),
        ("4Mi", "out of range"),
        ("1.5", "out of range"),
        ("-1Gi", "negative"),
        ("1GB", "accepted: a number with an optional suffix"),
    ] {
        let v = vmi(&format!(
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {{name: q}}\nspec: {{domain: {{memory: {{guest: \"{q}\"}}, devices: {{}}}}}}\n"
        ));
        let e = validate_vmi(&v).unwrap_err().to_string();
        assert!(
            e.contains("spec.domain.memory.guest") && e.contains(why),
            "{q}: {e}"
        );
    }
}

/// What KubeVirt's published examples write: decimal quantities and exponents are memory
/// sizes like any other.
#[test]
fn decimal_quantities_are_accepted() {
    for q in ["1024M", "1G", "2e9", "100000001", "1.5Gi"] {
        let v = vmi(&format!(
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {{name: q}}\nspec: {{domain: {{memory: {{guest: \"{q}\"}}, devices: {{}}}}}}\n"
        ));
        validate_vmi(&v).unwrap_or_else(|e| panic!("{q}: {e}"));
    }
}

#[test]
fn defaults_as_kubevirt_applies_them() {
    let mut v = vmi(r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: d}
spec:
  domain:
    resources: {requests: {memory: 128Mi}}
    devices:
      disks: [{name: root}]
  volumes: [{name: root, containerDisk: {image: img}}]
"#);
    default_vmi_spec(&mut v.spec);
    validate_vmi(&v).unwrap();
    let s = &v.spec;
    assert_eq!(
        s.domain.memory.as_ref().unwrap().guest.as_ref().unwrap().0,
        "128Mi"
    );
    let cpu = s.domain.cpu.as_ref().unwrap();
    assert_eq!(
        (cpu.sockets, cpu.cores, cpu.threads),
        (Some(1), Some(1), Some(1))
    );
    assert_eq!(
        s.domain.devices.disks[0].disk.as_ref().unwrap().bus,
        Some(api::DiskBus::Virtio)
    );
    assert_eq!(s.networks[0].name, "default");
    assert!(s.networks[0].pod.is_some());
    assert!(s.domain.devices.interfaces[0].masquerade.is_some());
    assert_eq!(s.termination_grace_period_seconds, Some(30));
    assert_eq!(vcpus(s), 1);
}

/// A volume without a disk is not dropped: KubeVirt gives it a virtio disk of its own.
#[test]
fn every_volume_gets_a_disk() {
    let mut v = vmi(r##"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: d}
spec:
  domain:
    memory: {guest: 128Mi}
    devices:
      disks: [{name: data, disk: {bus: virtio}}]
  volumes:
  - {name: root, containerDisk: {image: quay.io/containerdisks/fedora:40}}
  - {name: data, emptyDisk: {capacity: 1Gi}}
  - {name: cloudinit, cloudInitNoCloud: {userData: "#cloud-config"}}
"##);
    default_vmi_spec(&mut v.spec);
    let names: Vec<&str> = v
        .spec
        .domain
        .devices
        .disks
        .iter()
        .map(|d| d.name.as_str())
        .collect();
    assert_eq!(names, ["data", "root", "cloudinit"]);
    let bus = v.spec.domain.devices.disks[1]
        .disk
        .as_ref()
        .unwrap()
        .bus
        .clone();
    assert_eq!(bus, Some(api::DiskBus::Virtio));
    default_vmi_spec(&mut v.spec);
    assert_eq!(
        v.spec.domain.devices.disks.len(),
        3,
        "defaulting is idempotent"
    );
}

#[test]
fn run_strategy_from_deprecated_running() {
    let mut vm = VirtualMachine::new("vm", VirtualMachineSpec::default());
    assert_eq!(run_strategy(&vm), RunStrategy::Halted);
    vm.spec.running = Some(true);
    assert_eq!(run_strategy(&vm), RunStrategy::Always);
    vm.spec.running = Some(false);
    assert_eq!(run_strategy(&vm), RunStrategy::Halted);
    vm.spec.run_strategy = Some(RunStrategy::Manual);
    assert_eq!(run_strategy(&vm), RunStrategy::Manual);
}

#[test]
fn paths_that_leave_their_directory_are_refused_by_field() {
    let v = vmi(r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: escape
  namespace: ns
  annotations: {snapshot.microvirt.io/start-from-state: ../../other-tenant/vmstate-1}
spec:
  domain:
    memory: {guest: 64Mi}
    firmware:
      kernelBoot:
        container: {image: k, kernelPath: /boot/../../etc/shadow, initrdPath: ../initrd}
    devices:
      disks: [{name: a}, {name: b}, {name: c}, {name: d}, {name: ..}]
  volumes:
    - {name: a, containerDisk: {image: x, path: /disk/../../../../etc/passwd}}
    - {name: b, persistentVolumeClaim: {claimName: ../other-tenant}}
    - {name: c, dataVolume: {name: a/b}}
    - {name: d, hostDisk: {path: /var/lib/hostdisks/../../../etc/x.img, type: Disk}}
    - {name: .., emptyDisk: {capacity: 1Mi}}
"#);
    assert_refused(&v, &[
        "spec.domain.firmware.kernelBoot.container.kernelPath: \"/boot/../../etc/shadow\" has a \"..\" component",
        "spec.domain.firmware.kernelBoot.container.initrdPath: \"../initrd\" has a \"..\" component",
        "spec.volumes[0].containerDisk.path: \"/disk/../../../../etc/passwd\" has a \"..\" component",
        "spec.volumes[1].persistentVolumeClaim.claimName: \"../other-tenant\" is not a valid name",
        "spec.volumes[2].dataVolume.name: \"a/b\" is not a valid name",
        "spec.volumes[3].hostDisk.path: \"/var/lib/hostdisks/../../../etc/x.img\" has a \"..\" component",
        "spec.volumes[4].name: \"..\" is not a valid name",
        "metadata.annotations[snapshot.microvirt.io/start-from-state]: \"../../other-tenant/vmstate-1\" is not a valid name",
    ]);
}

#[test]
fn host_disks_follow_the_cluster_policy() {
    let v = vmi(r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: h, namespace: team-a}
spec:
  domain:
    memory: {guest: 64Mi}
    devices:
      disks: [{name: own}, {name: theirs}, {name: sibling}]
  volumes:
    - {name: own, hostDisk: {path: /srv/disks/team-a/own.img, type: Disk}}
    - {name: theirs, hostDisk: {path: /srv/disks/team-b/db.img, type: Disk}}
    - {name: sibling, hostDisk: {path: /srv/disks/team-a-evil/x.img, type: DiskOrCreate, capacity: 1Gi}}
"#);
    validate_vmi(&v).unwrap();
    let off = HostDiskPolicy::default();
    let refused = off.refusals(&v.spec, "spec", "team-a");
    assert_eq!(refused.len(), 3);
    assert!(refused
        .iter()
        .all(|f| f.reason.starts_with("HostDisk feature gate is not enabled")));
    let on = HostDiskPolicy {
        feature_gate: true,
        allowed_prefixes: vec!["/srv/disks/{namespace}".into()],
    };
    let refused: Vec<String> = on
        .refusals(&v.spec, "spec", "team-a")
        .iter()
        .map(|f| format!("{}: {}", f.path, f.reason))
        .collect();
    assert_eq!(
        refused,
        [
            "spec.volumes[1].hostDisk.path: /srv/disks/team-b/db.img is outside the host directories this cluster allows for hostDisks in namespace \"team-a\" (/srv/disks/team-a)",
            "spec.volumes[2].hostDisk.path: /srv/disks/team-a-evil/x.img is outside the host directories this cluster allows for hostDisks in namespace \"team-a\" (/srv/disks/team-a)",
        ]
    );
    // The same VMI in team-b may use only team-b's directory.
    assert_eq!(on.refusals(&v.spec, "spec", "team-b").len(), 2);
    let err = on
        .check("VirtualMachineInstance", &v.metadata, &v.spec, "spec")
        .unwrap_err();
    assert!(
        err.to_string()
            .starts_with("VirtualMachineInstance team-a/h is invalid:"),
        "{err}"
    );
}

#[test]
fn filesystems_share_claims_config_maps_and_secrets_by_their_name() {
    let good = vmi(r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: fs, namespace: ns}
spec:
  domain:
    memory: {guest: 64Mi}
    devices:
      filesystems:
        - {name: data, virtiofs: {}}
        - {name: cfg, virtiofs: {}}
        - {name: creds, virtiofs: {}}
  volumes:
    - {name: data, persistentVolumeClaim: {claimName: data-pvc}}
    - {name: cfg, configMap: {name: app-config}}
    - {name: creds, secret: {secretName: app-secret}}
"#);
    validate_vmi(&good).unwrap();
    // A shared volume gets no disk of its own.
    let mut defaulted = good.clone();
    default_vmi_spec(&mut defaulted.spec);
    assert!(defaulted.spec.domain.devices.disks.is_empty());

    let bad = vmi(r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: fs, namespace: ns}
spec:
  domain:
    memory: {guest: 64Mi}
    devices:
      disks: [{name: root}]
      filesystems:
        - {name: nofs}
        - {name: root, virtiofs: {}}
        - {name: scratch, virtiofs: {}}
        - {name: ghost, virtiofs: {}}
        - {name: a-name-far-too-long-for-a-virtiofs-tag-x, virtiofs: {}}
  volumes:
    - {name: root, containerDisk: {image: x}}
    - {name: nofs, persistentVolumeClaim: {claimName: c}}
    - {name: scratch, emptyDisk: {capacity: 1Gi}}
    - {name: a-name-far-too-long-for-a-virtiofs-tag-x, persistentVolumeClaim: {claimName: d}}
"#);
    assert_refused(&bad, &[
        "spec.domain.devices.filesystems[0].virtiofs: is required",
        "spec.domain.devices.filesystems[1].name: \"root\" is already a disk or filesystem",
        "spec.domain.devices.filesystems[1].name: volume \"root\" is not a directory to share",
        "spec.domain.devices.filesystems[2].name: volume \"scratch\" is not a directory to share",
        "spec.domain.devices.filesystems[3].name: no volume named \"ghost\"",
        "spec.domain.devices.filesystems[4].name: 40 characters; the guest mounts the share by this name, which holds at most 36",
    ]);
}

#[test]
fn a_service_account_token_and_downward_api_files_are_shared_not_attached() {
    let good = vmi(r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: fs, namespace: ns}
spec:
  domain:
    memory: {guest: 64Mi}
    devices:
      filesystems:
        - {name: sa, virtiofs: {}}
        - {name: meta, virtiofs: {}}
  volumes:
    - {name: sa, serviceAccount: {serviceAccountName: builder}}
    - name: meta
      downwardAPI:
        fields:
          - {path: labels, fieldRef: {fieldPath: metadata.labels}}
          - {path: owner, fieldRef: {fieldPath: "metadata.annotations['owner']"}}
          - {path: cpu, resourceFieldRef: {resource: limits.cpu}}
"#);
    validate_vmi(&good).unwrap();

    let bad = vmi(r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: fs, namespace: ns}
spec:
  domain:
    memory: {guest: 64Mi}
    devices:
      disks: [{name: sa}]
      filesystems:
        - {name: meta, virtiofs: {}}
        - {name: sa2, virtiofs: {}}
  volumes:
    - {name: sa, serviceAccount: {serviceAccountName: builder}}
    - {name: sa2, serviceAccount: {serviceAccountName: "Not_A_Name"}}
    - name: meta
      downwardAPI:
        fields:
          - {path: ../escape, fieldRef: {fieldPath: metadata.name}}
          - {path: ip, fieldRef: {fieldPath: status.podIP}}
          - {path: both, fieldRef: {fieldPath: metadata.name}, resourceFieldRef: {resource: limits.cpu}}
          - {path: gpu, resourceFieldRef: {resource: limits.nvidia.com/gpu}}
"#);
    assert_refused(&bad, &[
        "spec.volumes[0].serviceAccount: a serviceAccount volume as a disk",
        "spec.volumes[1].serviceAccount: a second serviceAccount volume",
        "spec.volumes[1].serviceAccount.serviceAccountName",
        "spec.volumes[2].downwardAPI.fields[0].path: \"../escape\" must be a relative path",
        "spec.volumes[2].downwardAPI.fields[1].fieldRef.fieldPath: \"status.podIP\" is not a field",
        "spec.volumes[2].downwardAPI.fields[2]: set exactly one of fieldRef, resourceFieldRef",
        "spec.volumes[2].downwardAPI.fields[3].resourceFieldRef.resource: \"limits.nvidia.com/gpu\"",
    ]);
}

#[test]
fn the_vhostuser_binding_is_the_only_named_one_and_needs_a_multus_network() {
    let good = vmi(r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: vnf, namespace: ns}
spec:
  domain:
    memory: {guest: 64Mi}
    devices:
      interfaces:
        - {name: default, masquerade: {}}
        - {name: dp, binding: {name: vhostuser}}
  networks:
    - {name: default, pod: {}}
    - {name: dp, multus: {networkName: dpdk}}
"#);
    validate_vmi(&good).unwrap();
    let mut defaulted = good.clone();
    default_vmi_spec(&mut defaulted.spec);
    let dp = &defaulted.spec.domain.devices.interfaces[1];
    assert!(
        dp.bridge.is_none(),
        "a named binding gets no default bridge"
    );

    let bad = vmi(r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: vnf, namespace: ns}
spec:
  domain:
    memory: {guest: 64Mi}
    devices:
      interfaces:
        - {name: default, binding: {name: vhostuser}}
        - {name: a, binding: {name: passt}}
        - {name: b, bridge: {}, binding: {name: vhostuser}}
  networks:
    - {name: default, pod: {}}
    - {name: a, multus: {networkName: x}}
    - {name: b, multus: {networkName: y}}
"#);
    assert_refused(&bad, &[
        "spec.domain.devices.interfaces[0].binding: vhostuser needs a Multus network",
        "spec.domain.devices.interfaces[1].binding.name: \"passt\" is not a network binding microvirt has",
        "spec.domain.devices.interfaces[2]: set exactly one binding method",
    ]);
}

#[test]
fn hugepages_take_kubevirt_page_sizes_and_whole_pages_of_guest_memory() {
    let with = |page: &str, guest: &str| {
        vmi(&format!(
            r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: hp, namespace: ns}}
spec:
  domain:
    memory: {{guest: {guest}, hugepages: {{pageSize: {page}}}}}
    devices: {{}}
"#
        ))
    };
    validate_vmi(&with("2Mi", "1Gi")).unwrap();
    validate_vmi(&with("1Gi", "2Gi")).unwrap();
    let text = validate_vmi(&with("4Ki", "64Mi")).unwrap_err().to_string();
    assert!(
        text.contains("spec.domain.memory.hugepages.pageSize: \"4Ki\" is not a huge page size"),
        "{text}"
    );
    let text = validate_vmi(&with("2Mi", "65Mi")).unwrap_err().to_string();
    assert!(
        text.contains(
            "spec.domain.memory.guest: 68157440 bytes is not a whole number of 2Mi huge pages"
        ),
        "{text}"
    );
}

/// microvirt's start-from-snapshot extension: named on the VM itself (taken once), never on
/// its VMI template (every start would resume the same memory); the VMI-level claim is the
/// controller's to write.
#[test]
fn start_from_snapshot_is_taken_from_the_vm_and_refused_on_its_template() {
    let vm = |meta: &str, template_meta: &str| -> VirtualMachine {
        serde_yaml::from_str(&format!(
            r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: vm, namespace: ns, annotations: {meta}}}
spec:
  runStrategy: Always
  template:
    metadata: {{annotations: {template_meta}}}
    spec:
      domain: {{memory: {{guest: 64Mi}}}}
"#
        ))
        .unwrap()
    };
    validate_vm(&vm(
        "{snapshot.microvirt.io/start-from-snapshot: snap}",
        "{}",
    ))
    .unwrap();
    let refused = |v: VirtualMachine| validate_vm(&v).unwrap_err().to_string();
    let text = refused(vm(
        "{snapshot.microvirt.io/start-from-snapshot: Snap/1}",
        "{snapshot.microvirt.io/start-from-snapshot: snap}",
    ));
    assert!(
        text.contains("metadata.annotations[snapshot.microvirt.io/start-from-snapshot]: \"Snap/1\" is not a valid name"),
        "{text}"
    );
    assert!(
        text.contains("spec.template.metadata.annotations[snapshot.microvirt.io/start-from-snapshot]: is not accepted on a VirtualMachine's VMI template"),
        "{text}"
    );
    let text = refused(vm(
        "{snapshot.microvirt.io/start-from-state: vmstate-1}",
        "{}",
    ));
    assert!(
        text.contains(
            "metadata.annotations[snapshot.microvirt.io/start-from-state]: is virt-controller's"
        ),
        "{text}"
    );
}
