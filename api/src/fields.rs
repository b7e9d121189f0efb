//! Every field of a VM or VMI manifest is honoured, refused, or — only when it truly changes
//! nothing on a microVM — accepted with a warning that says so. Never silently ignored: the
//! manifest is walked key by key (modelled fields and the ones kept verbatim in `extra` alike)
//! against this table, and a field in none of the lists is refused with its path.
//!
//! Paths are relative to a VMI spec (`domain.cpu.cores`), list items written `[]`. An entry
//! ending in `..` covers its whole subtree.

use serde_json::Value;

/// What microvirt does with a field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Treatment {
    /// Used as KubeVirt uses it (values are checked by validation).
    Honoured,
    /// Accepted, changes nothing here; the warning says why.
    NoEffect(&'static str),
    /// Refused: why, and what to do instead.
    Refused(&'static str, &'static str),
}

use Treatment::*;

const DEVICE_FIELDS_REFUSED: &str =
    "a device a microVM does not have (virtio block, net and the serial console are what there is)";

/// The VMI spec's fields.
pub const VMI_SPEC: &[(&str, Treatment)] = &[
    ("affinity..", Honoured),
    ("nodeSelector..", Honoured),
    ("tolerations..", Honoured),
    ("priorityClassName", Honoured),
    ("evictionStrategy", Honoured),
    ("terminationGracePeriodSeconds", Honoured),
    ("hostname", Honoured),
    ("subdomain", Honoured),
    ("schedulerName", Honoured),
    ("domain", Honoured),
    ("domain.cpu", Honoured),
    ("domain.cpu.sockets", Honoured),
    ("domain.cpu.cores", Honoured),
    ("domain.cpu.threads", Honoured),
    ("domain.cpu.model", Honoured),
    ("domain.cpu.features..", Refused("CPU features cannot be changed: the guest sees the host CPU", "remove it")),
    ("domain.cpu.dedicatedCpuPlacement", Honoured),
    ("domain.cpu.maxSockets", NoEffect("vCPU hotplug is not supported: the VM has sockets × cores × threads vCPUs for its life")),
    ("domain.memory", Honoured),
    ("domain.memory.guest", Honoured),
    ("domain.memory.hugepages", Honoured),
    ("domain.memory.hugepages.pageSize", Honoured),
    ("domain.memory.maxGuest", NoEffect("memory hotplug is not supported: the guest has memory.guest for its life")),
    ("domain.resources", Honoured),
    ("domain.resources.requests..", Honoured),
    ("domain.resources.limits..", Honoured),
    ("domain.resources.overcommitGuestOverhead", NoEffect("the launcher Pod's overhead is a few MiB and always requested")),
    ("domain.machine", Honoured),
    ("domain.machine.type", Honoured),
    ("domain.firmware", Honoured),
    ("domain.firmware.kernelBoot..", Honoured),
    ("domain.firmware.bootloader", Honoured),
    ("domain.firmware.bootloader.bios..", NoEffect("there is no BIOS: the kernel is booted directly")),
    ("domain.firmware.bootloader.efi..", Refused("EFI firmware is not supported: the kernel is booted directly", "use bios or firmware.kernelBoot")),
    ("domain.firmware.uuid", NoEffect("a microVM has no SMBIOS tables to carry it")),
    ("domain.firmware.serial", NoEffect("a microVM has no SMBIOS tables to carry it")),
    ("domain.clock..", NoEffect("the guest keeps time with kvm-clock from the host")),
    ("domain.features..", NoEffect("ACPI, APIC, SMM and Hyper-V switches of a PC: a microVM's devices are fixed")),
    ("domain.devices", Honoured),
    ("domain.devices.autoattachSerialConsole", Honoured),
    ("domain.devices.autoattachGraphicsDevice", Honoured),
    ("domain.devices.autoattachPodInterface", Honoured),
    ("domain.devices.autoattachMemBalloon", NoEffect("there is no memory balloon")),
    ("domain.devices.autoattachInputDevice", NoEffect("there are no input devices besides the i8042 keyboard controller")),
    ("domain.devices.autoattachVSOCK", Refused("vsock is not supported", "remove it")),
    ("domain.devices.networkInterfaceMultiqueue", NoEffect("each virtio-net device has one queue pair")),
    ("domain.devices.blockMultiQueue", NoEffect("each virtio-blk device has one queue")),
    ("domain.devices.useVirtioTransitional", NoEffect("devices are virtio-mmio, modern only")),
    // KubeVirt's Rng has no fields: `rng: {}` asks for a virtio-rng device.
    ("domain.devices.rng", Honoured),
    ("domain.devices.disks", Honoured),
    ("domain.devices.disks[].name", Honoured),
    ("domain.devices.disks[].disk", Honoured),
    ("domain.devices.disks[].disk.bus", Honoured),
    ("domain.devices.disks[].disk.readonly", Honoured),
    ("domain.devices.disks[].disk.pciAddress", NoEffect("devices are virtio-mmio: there is no PCI bus")),
    ("domain.devices.disks[].cdrom", Honoured),
    ("domain.devices.disks[].cdrom.bus", Honoured),
    ("domain.devices.disks[].cdrom.readonly", Honoured),
    ("domain.devices.disks[].cdrom.tray", NoEffect("a CD-ROM is a read-only virtio disk: it has no tray")),
    ("domain.devices.disks[].lun..", Refused("a LUN (SCSI passthrough) is not supported", "use disk")),
    ("domain.devices.disks[].serial", Honoured),
    ("domain.devices.disks[].cache", Honoured),
    ("domain.devices.disks[].bootOrder", Honoured),
    ("domain.devices.disks[].io", NoEffect("I/O is done by the VMM's own thread")),
    ("domain.devices.disks[].dedicatedIOThread", NoEffect("I/O is done by the VMM's own thread")),
    ("domain.devices.disks[].blockSize..", NoEffect("the guest sees 512-byte sectors")),
    ("domain.devices.interfaces", Honoured),
    ("domain.devices.interfaces[].name", Honoured),
    ("domain.devices.interfaces[].masquerade..", Honoured),
    ("domain.devices.interfaces[].bridge..", Honoured),
    ("domain.devices.interfaces[].binding", Honoured),
    ("domain.devices.interfaces[].binding.name", Honoured),
    ("domain.devices.interfaces[].sriov..", Refused("SR-IOV is not supported", "accepted bindings: masquerade, bridge, vhostuser")),
    ("domain.devices.interfaces[].slirp..", Refused("slirp is not supported", "accepted bindings: masquerade, bridge, vhostuser")),
    ("domain.devices.interfaces[].macAddress", Honoured),
    ("domain.devices.interfaces[].model", Honoured),
    ("domain.devices.interfaces[].ports..", Honoured),
    ("domain.devices.interfaces[].bootOrder", NoEffect("there is no network boot")),
    ("domain.devices.interfaces[].pciAddress", NoEffect("devices are virtio-mmio: there is no PCI bus")),
    ("domain.devices.interfaces[].dhcpOptions..", NoEffect("the DHCP server offers the Pod's DNS, MTU and the VM's hostname; extra options are not sent")),
    ("domain.devices.gpus..", Refused(DEVICE_FIELDS_REFUSED, "remove it")),
    ("domain.devices.hostDevices..", Refused(DEVICE_FIELDS_REFUSED, "remove it")),
    ("domain.devices.watchdog..", Refused(DEVICE_FIELDS_REFUSED, "remove it")),
    ("domain.devices.tpm..", Refused(DEVICE_FIELDS_REFUSED, "remove it")),
    ("domain.devices.sound..", Refused(DEVICE_FIELDS_REFUSED, "remove it")),
    ("domain.devices.filesystems", Honoured),
    ("domain.devices.filesystems[].name", Honoured),
    ("domain.devices.filesystems[].virtiofs..", Honoured),
    ("domain.devices.inputs..", Refused(DEVICE_FIELDS_REFUSED, "remove it")),
    ("domain.devices.clientPassthrough..", Refused(DEVICE_FIELDS_REFUSED, "remove it")),
    ("domain.devices.downwardMetrics..", Refused(DEVICE_FIELDS_REFUSED, "remove it")),
    ("domain.devices.video..", Refused(DEVICE_FIELDS_REFUSED, "remove it; the serial console is available")),
    ("networks", Honoured),
    ("networks[].name", Honoured),
    ("networks[].pod..", Honoured),
    ("networks[].multus..", Honoured),
    ("volumes", Honoured),
    ("volumes[].name", Honoured),
    ("volumes[].containerDisk..", Honoured),
    ("volumes[].persistentVolumeClaim", Honoured),
    ("volumes[].persistentVolumeClaim.claimName", Honoured),
    ("volumes[].persistentVolumeClaim.readOnly", Honoured),
    ("volumes[].persistentVolumeClaim.hotpluggable", NoEffect("volumes are attached when the VM starts; hotplug is not supported")),
    ("volumes[].dataVolume", Honoured),
    ("volumes[].dataVolume.name", Honoured),
    ("volumes[].dataVolume.hotpluggable", NoEffect("volumes are attached when the VM starts; hotplug is not supported")),
    ("volumes[].emptyDisk..", Honoured),
    ("volumes[].hostDisk..", Honoured),
    ("volumes[].cloudInitNoCloud..", Honoured),
    ("volumes[].ephemeral..", Honoured),
    ("volumes[].configMap..", Honoured),
    ("volumes[].secret..", Honoured),
    ("volumes[].serviceAccount..", Honoured),
    ("volumes[].cloudInitConfigDrive..", Honoured),
    ("volumes[].sysprep..", Honoured),
    ("volumes[].downwardAPI..", Honoured),
    ("volumes[].downwardMetrics..", Honoured),
    ("volumes[].memoryDump..", Honoured),
    ("readinessProbe..", NoEffect("guest probes need the guest agent, which is not supported yet; the VMI is Ready when its guest runs")),
    ("livenessProbe..", NoEffect("guest probes need the guest agent, which is not supported yet")),
    ("accessCredentials..", Refused("access credentials are injected by the guest agent, which is not supported", "put the keys in cloud-init user data")),
    ("startStrategy", Refused("startStrategy Paused is not supported", "remove it and pause with the launcher's pause request")),
    ("dnsPolicy", Honoured),
    ("dnsConfig..", Honoured),
    ("topologySpreadConstraints..", Honoured),
    ("architecture", Honoured),
];

/// A VirtualMachine's own fields (its template's spec is a VMI spec).
pub const VM_SPEC: &[(&str, Treatment)] = &[
    ("running", Honoured),
    ("runStrategy", Honoured),
    ("template", Honoured),
    ("template.metadata..", Honoured),
    ("template.spec", Honoured),
    ("instancetype..", Honoured),
    ("preference..", Honoured),
    // virt-controller makes each a CDI DataVolume and starts the VM once they are ready; the
    // templates' contents are CDI's to judge.
    ("dataVolumeTemplates..", Honoured),
    (
        "updateVolumesStrategy",
        NoEffect("volumes are fixed for a VM's life"),
    ),
    (
        "liveUpdateFeatures..",
        NoEffect("CPU and memory hotplug are not supported"),
    ),
];

/// Annotations of a VMI (or a VM's template) that change a VM's behaviour in KubeVirt, with what
/// microvirt does with each. Other annotations under a KubeVirt domain (`kubevirt.io/`,
/// `*.kubevirt.io/`) that are not here get a warning; everyone else's are metadata and pass.
pub const ANNOTATIONS: &[(&str, Treatment)] = &[
    (crate::migratability::ALLOW_POD_BRIDGE_MIGRATION, Honoured),
    // Set by KubeVirt's (and microvirt's) controllers themselves.
    ("kubevirt.io/latest-observed-api-version", Honoured),
    ("kubevirt.io/storage-observed-api-version", Honoured),
    ("kubevirt.io/vm-generation", Honoured),
    ("kubevirt.io/domain", Honoured),
    ("kubevirt.io/instancetype-name", Honoured),
    ("kubevirt.io/cluster-instancetype-name", Honoured),
    ("kubevirt.io/preference-name", Honoured),
    ("kubevirt.io/cluster-preference-name", Honoured),
    ("instancetype.kubevirt.io/object-kind", Honoured),
    (
        "hooks.kubevirt.io/hookSidecars",
        Refused(
            "hook sidecars rewrite the libvirt domain before it starts, and microvirt has no libvirt domain: the sidecar would change nothing",
            "remove it and express the change in the VMI spec",
        ),
    ),
    (
        "kubevirt.io/ignitiondata",
        Refused(
            "Ignition data is not passed to the guest",
            "use a cloudInitNoCloud or cloudInitConfigDrive volume",
        ),
    ),
    (
        "kubevirt.io/libvirt-log-filters",
        NoEffect("there is no libvirt; the VMM logs as the launcher's RUST_LOG says"),
    ),
    (
        "kubevirt.io/keep-launcher-alive-after-failure",
        NoEffect("the launcher ends with its VM; its log stays with the Pod"),
    ),
];

/// Checks `annotations` (of the object at `base`, e.g. `metadata` or
/// `spec.template.metadata`) against `ANNOTATIONS`.
pub fn check_annotations(
    annotations: Option<&std::collections::BTreeMap<String, String>>,
    base: &str,
    out: &mut Findings,
) {
    for key in annotations.into_iter().flat_map(|a| a.keys()) {
        let shown = format!("{base}.annotations[{key}]");
        match ANNOTATIONS.iter().find(|(k, _)| k == key).map(|(_, t)| *t) {
            Some(Honoured) => {}
            Some(NoEffect(why)) => out
                .warnings
                .push(format!("{shown}: accepted, but has no effect: {why}")),
            Some(Refused(why, instead)) => out.errors.push((shown, format!("{why}; {instead}"))),
            None => {
                let domain = key.split_once('/').map_or("", |(d, _)| d);
                if domain == "kubevirt.io" || domain.ends_with(".kubevirt.io") {
                    out.warnings.push(format!(
                        "{shown}: not a KubeVirt annotation microvirt knows; it has no effect here"
                    ));
                }
            }
        }
    }
}

/// The treatment of `path` (items as `[]`) in `table`.
pub fn treatment(table: &[(&str, Treatment)], path: &str) -> Option<Treatment> {
    table.iter().find_map(|(p, t)| {
        let covers = match p.strip_suffix("..") {
            Some(prefix) => {
                path == prefix
                    || path
                        .strip_prefix(prefix)
                        .is_some_and(|rest| rest.starts_with('.') || rest.starts_with('['))
            }
            None => path == *p,
        };
        covers.then_some(*t)
    })
}

fn covered(table: &[(&str, Treatment)], path: &str) -> bool {
    table.iter().any(|(p, _)| {
        p.strip_suffix("..")
            .is_some_and(|prefix| path.starts_with(prefix) && path != prefix)
    })
}

/// What a manifest's fields amount to: errors (path, reason) and warnings.
#[derive(Debug, Default, PartialEq)]
pub struct Findings {
    pub errors: Vec<(String, String)>,
    pub warnings: Vec<String>,
}

/// Walks `value` (a VMI spec as JSON, as the user wrote it) under `base`.
pub fn check_vmi_spec(value: &Value, base: &str, out: &mut Findings) {
    walk(VMI_SPEC, value, "", base, out);
}

/// Walks a VirtualMachine's `spec` as JSON.
pub fn check_vm_spec(value: &Value, out: &mut Findings) {
    let Some(obj) = value.as_object() else {
        return;
    };
    for (k, v) in obj {
        if k == "template" {
            if let Some(t) = v.as_object() {
                for (tk, tv) in t {
                    match tk.as_str() {
                        "spec" => check_vmi_spec(tv, "spec.template.spec", out),
                        "metadata" => {}
                        other => out.errors.push((
                            format!("spec.template.{other}"),
                            "is not a field of a VirtualMachine's template; remove it".into(),
                        )),
                    }
                }
            }
            continue;
        }
        apply(VM_SPEC, k, v, "spec", k, out);
    }
}

fn join(base: &str, rel: &str) -> String {
    if base.is_empty() {
        rel.to_string()
    } else {
        format!("{base}.{rel}")
    }
}

fn walk(table: &[(&str, Treatment)], value: &Value, rel: &str, base: &str, out: &mut Findings) {
    match value {
        Value::Object(m) => {
            for (k, v) in m {
                let r = if rel.is_empty() {
                    k.clone()
                } else {
                    format!("{rel}.{k}")
                };
                let shown = join(base, &r);
                apply(table, &r, v, base, &shown, out);
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                let r = format!("{rel}[]");
                // Items are walked with their index in what the user sees.
                let shown_base = format!("{}[{i}]", join(base, rel));
                if let Value::Object(m) = v {
                    for (k, iv) in m {
                        let rr = format!("{r}.{k}");
                        let shown = format!("{shown_base}.{k}");
                        apply(table, &rr, iv, base, &shown, out);
                    }
                }
            }
        }
        _ => {}
    }
}

fn apply(
    table: &[(&str, Treatment)],
    rel: &str,
    value: &Value,
    base: &str,
    shown: &str,
    out: &mut Findings,
) {
    match treatment(table, rel) {
        Some(Honoured) => {
            // A subtree entry covers what is below; otherwise every child is looked up.
            if !covered(table, &format!("{rel}.x")) && !covered(table, &format!("{rel}[]")) {
                walk(table, value, rel, base, out);
            }
        }
        Some(NoEffect(why)) => out
            .warnings
            .push(format!("{shown}: accepted, but has no effect: {why}")),
        Some(Refused(why, instead)) => out
            .errors
            .push((shown.to_string(), format!("{why}; {instead}"))),
        None => out.errors.push((
            shown.to_string(),
            "is not a field microvirt knows (a typo, or a KubeVirt field it does not support); remove it".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn behaviour_changing_annotations_are_refused_or_warned() {
        let a: std::collections::BTreeMap<String, String> = [
            ("hooks.kubevirt.io/hookSidecars", "[{\"image\": \"x\"}]"),
            ("kubevirt.io/libvirt-log-filters", "3:remote"),
            ("kubevirt.io/mystery", "1"),
            ("kubevirt.io/allow-pod-bridge-network-live-migration", ""),
            ("example.com/owner", "team-a"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let mut f = Findings::default();
        check_annotations(Some(&a), "metadata", &mut f);
        assert_eq!(f.errors.len(), 1, "{f:?}");
        assert_eq!(
            f.errors[0].0,
            "metadata.annotations[hooks.kubevirt.io/hookSidecars]"
        );
        assert!(f.errors[0].1.contains("no libvirt domain"), "{f:?}");
        assert_eq!(f.warnings.len(), 2, "{f:?}");
        assert!(f
            .warnings
            .iter()
            .any(|w| w.contains("libvirt-log-filters]: accepted, but has no effect")));
        assert!(f
            .warnings
            .iter()
            .any(|w| w.contains("kubevirt.io/mystery]: not a KubeVirt annotation")));
    }

    #[test]
    fn every_field_is_classified() {
        let mut f = Findings::default();
        check_vmi_spec(
            &json!({
                "domain": {"cpu": {"cores": 2}, "clock": {"utc": {}}, "devices": {"gpus": [{"name": "g"}],
                           "disks": [{"name": "a", "disk": {"bus": "virtio"}, "tray": "x"}]}, "mystery": 1},
                "affinity": {"nodeAffinity": {"anything": true}},
            }),
            "spec",
            &mut f,
        );
        assert_eq!(f.warnings.len(), 1, "{f:?}");
        assert!(f.warnings[0].starts_with("spec.domain.clock: accepted, but has no effect"));
        let paths: Vec<&str> = f.errors.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(
            paths,
            [
                "spec.domain.devices.disks[0].tray",
                "spec.domain.devices.gpus",
                "spec.domain.mystery"
            ]
        );
    }
}
