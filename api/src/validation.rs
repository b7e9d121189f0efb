//! Validation and defaulting of KubeVirt objects, as the admission webhook and the launcher
//! apply them. A rejected object gets one error listing every offending field path, why, and
//! what is accepted.

use std::collections::BTreeSet;
use std::fmt;

use crate::quantity::parse_bytes;
use crate::types::*;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::limits::{MAX_MEMORY_MIB, MAX_VCPUS, MAX_VIRTIO_DEVICES as MAX_DEVICES, MIN_MEMORY_MIB};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    pub path: String,
    pub reason: String,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ValidationError {
    pub kind: String,
    pub name: String,
    pub errors: Vec<FieldError>,
}

impl fmt::Display for ValidationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} is invalid:", self.kind, self.name)?;
        for e in &self.errors {
            write!(f, "\n  - {}: {}", e.path, e.reason)?;
        }
        Ok(())
    }
}

struct Errors(Vec<FieldError>);

impl Errors {
    fn add(&mut self, path: impl Into<String>, reason: impl Into<String>) {
        self.0.push(FieldError {
            path: path.into(),
            reason: reason.into(),
        });
    }
    fn unsupported(&mut self, path: impl Into<String>, what: &str, accepted: &str) {
        self.add(
            path,
            format!("{what} is not supported by microvirt; {accepted}"),
        );
    }
}

impl Errors {
    /// The field table's findings (`fields`): errors for paths validation has not already
    /// reported (its messages are the more specific).
    fn fields(&mut self, found: crate::fields::Findings) {
        for (path, reason) in found.errors {
            if !self.0.iter().any(|e| e.path.starts_with(&path)) {
                self.add(path, reason);
            }
        }
    }
}

/// The warnings for fields a manifest sets that change nothing here (admission warnings; the
/// launcher prints them).
pub fn warnings_vm(vm: &VirtualMachine) -> Vec<String> {
    vm_findings(vm).warnings
}

pub fn warnings_vmi(vmi: &VirtualMachineInstance) -> Vec<String> {
    vmi_findings(vmi).warnings
}

/// A VM's fields and its template's annotations against `crate::fields`.
fn vm_findings(vm: &VirtualMachine) -> crate::fields::Findings {
    let mut f = crate::fields::Findings::default();
    crate::fields::check_vm_spec(&serde_json::to_value(&vm.spec).unwrap_or_default(), &mut f);
    let template_annotations = vm
        .spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.annotations.as_ref());
    crate::fields::check_annotations(template_annotations, "spec.template.metadata", &mut f);
    f
}

/// A VMI's fields and annotations against `crate::fields`.
fn vmi_findings(vmi: &VirtualMachineInstance) -> crate::fields::Findings {
    let mut f = crate::fields::Findings::default();
    crate::fields::check_vmi_spec(
        &serde_json::to_value(&vmi.spec).unwrap_or_default(),
        "spec",
        &mut f,
    );
    crate::fields::check_annotations(vmi.metadata.annotations.as_ref(), "metadata", &mut f);
    f
}

fn finish(kind: &str, name: &str, errors: Errors) -> Result<(), ValidationError> {
    if errors.0.is_empty() {
        Ok(())
    } else {
        Err(ValidationError {
            kind: kind.into(),
            name: name.into(),
            errors: errors.0,
        })
    }
}

fn object_name(meta: &ObjectMeta) -> String {
    match (&meta.namespace, &meta.name) {
        (Some(ns), Some(n)) => format!("{ns}/{n}"),
        (None, Some(n)) => n.clone(),
        _ => "(unnamed)".into(),
    }
}

pub fn validate_vm(vm: &VirtualMachine) -> Result<(), ValidationError> {
    let mut e = Errors(Vec::new());
    if vm.spec.running.is_some() && vm.spec.run_strategy.is_some() {
        e.add(
            "spec.running",
            "conflicts with spec.runStrategy; set only runStrategy (running is deprecated)",
        );
    }
    if let Some(m) = &vm.spec.instancetype {
        if let Err(why) = crate::instancetype::instancetype_kind(m) {
            e.add("spec.instancetype.kind", why);
        }
    }
    if let Some(m) = &vm.spec.preference {
        if let Err(why) = crate::instancetype::preference_kind(m) {
            e.add("spec.preference.kind", why);
        }
    }
    match &vm.spec.template.spec {
        Some(spec) if vm.spec.instancetype.is_some() => {
            let c = crate::instancetype::conflicts(spec, "spec.template.spec");
            if !c.is_empty() {
                e.add(
                    "spec.template.spec",
                    crate::instancetype::conflict_message(&c),
                );
            }
            // The size comes from the instance type (resolved by virt-controller): the rest of
            // the template is checked as it will run.
            let mut sized = spec.clone();
            sized
                .domain
                .memory
                .get_or_insert_with(Default::default)
                .guest = Some(k8s_openapi::apimachinery::pkg::api::resource::Quantity(
                "1Gi".into(),
            ));
            sized.domain.cpu = None;
            validate_spec(&sized, "spec.template.spec", &mut e);
        }
        Some(spec) => validate_spec(spec, "spec.template.spec", &mut e),
        None => e.add("spec.template.spec", "is required"),
    }
    e.fields(vm_findings(vm));
    start_from_snapshot(&vm.metadata, "metadata", &mut e);
    if crate::snapshot::start_from_state(vm.metadata.annotations.as_ref()).is_some() {
        e.add(
            format!(
                "metadata.annotations[{}]",
                crate::snapshot::ANNOTATION_START_FROM_STATE
            ),
            format!(
                "is virt-controller's, on the VMIs it starts; name the snapshot to start from with metadata.annotations[{}]",
                crate::snapshot::ANNOTATION_START_FROM_SNAPSHOT
            ),
        );
    }
    let template = vm.spec.template.metadata.as_ref();
    let annotations = template.and_then(|m| m.annotations.as_ref());
    for key in [
        crate::snapshot::ANNOTATION_START_FROM_SNAPSHOT,
        crate::snapshot::ANNOTATION_START_FROM_STATE,
    ] {
        if annotations.is_some_and(|a| a.contains_key(key)) {
            // On the template every start would resume the same memory, older than the
            // disks after the first run.
            e.add(
                format!("spec.template.metadata.annotations[{key}]"),
                format!(
                    "is not accepted on a VirtualMachine's VMI template, where every start would resume the same memory; put {} on the VirtualMachine's own metadata.annotations (a VirtualMachinePool's spec.virtualMachineTemplate.metadata), where it is taken once",
                    crate::snapshot::ANNOTATION_START_FROM_SNAPSHOT
                ),
            );
        }
    }
    finish("VirtualMachine", &object_name(&vm.metadata), e)
}

pub fn validate_vmi(vmi: &VirtualMachineInstance) -> Result<(), ValidationError> {
    let mut e = Errors(Vec::new());
    validate_spec(&vmi.spec, "spec", &mut e);
    e.fields(vmi_findings(vmi));
    start_from_state(&vmi.metadata, "metadata", &mut e);
    start_from_snapshot(&vmi.metadata, "metadata", &mut e);
    finish("VirtualMachineInstance", &object_name(&vmi.metadata), e)
}

/// The snapshot `snapshot.microvirt.io/start-from-snapshot` names must be an object's name.
fn start_from_snapshot(meta: &ObjectMeta, base: &str, e: &mut Errors) {
    if let Some(name) = crate::snapshot::start_from_snapshot(meta.annotations.as_ref()) {
        dns_subdomain(
            e,
            format!(
                "{base}.annotations[{}]",
                crate::snapshot::ANNOTATION_START_FROM_SNAPSHOT
            ),
            name,
        );
    }
}

/// The claim `snapshot.microvirt.io/start-from-state` names must be a claim's name: the Pod
/// mounts it and the launcher reads its files beneath the volumes directory.
fn start_from_state(meta: &ObjectMeta, base: &str, e: &mut Errors) {
    if let Some(claim) = crate::snapshot::start_from_state(meta.annotations.as_ref()) {
        dns_subdomain(
            e,
            format!(
                "{base}.annotations[{}]",
                crate::snapshot::ANNOTATION_START_FROM_STATE
            ),
            claim,
        );
    }
}

pub fn validate_vmirs(rs: &VirtualMachineInstanceReplicaSet) -> Result<(), ValidationError> {
    let mut e = Errors(Vec::new());
    let template = rs.spec.template.metadata.as_ref();
    validate_target(&rs.spec.target, template, "spec.template", &mut e);
    match &rs.spec.template.spec {
        Some(spec) => validate_spec(spec, "spec.template.spec", &mut e),
        None => e.add("spec.template.spec", "is required"),
    }
    finish(
        "VirtualMachineInstanceReplicaSet",
        &object_name(&rs.metadata),
        e,
    )
}

/// The checks KubeVirt makes of every kind that keeps replicas: a count of 0 or more, and a
/// selector that selects the template at `template_path` (whose metadata is `template`).
fn validate_target(
    target: &ReplicaTarget,
    template: Option<&ObjectMeta>,
    template_path: &str,
    e: &mut Errors,
) {
    if target.replicas.is_some_and(|r| r < 0) {
        e.add("spec.replicas", "must be 0 or more");
    }
    let labels = template.and_then(|m| m.labels.as_ref());
    for (k, v) in target.selector.match_labels.iter().flatten() {
        if labels.and_then(|l| l.get(k)) != Some(v) {
            e.add(
                format!("spec.selector.matchLabels.{k}"),
                format!("does not match {template_path}.metadata.labels; the selector must select the template"),
            );
        }
    }
}

/// VM number `ordinal` of a pool, as virt-controller makes it (`<pool>-<ordinal>`, the
/// template's labels and annotations; virt-controller adds its owner reference).
pub fn pool_vm(pool: &VirtualMachinePool, ordinal: u32) -> VirtualMachine {
    let t = pool.spec.virtual_machine_template.clone();
    let meta = t.metadata.unwrap_or_default();
    let name = pool.metadata.name.clone().unwrap_or_default();
    let mut vm = VirtualMachine::new(&format!("{name}-{ordinal}"), t.spec);
    vm.metadata.namespace = pool.metadata.namespace.clone();
    vm.metadata.labels = meta.labels;
    vm.metadata.annotations = meta.annotations;
    index_data_volumes(&mut vm, ordinal);
    vm
}

/// As KubeVirt's pool does: each VM's DataVolumes named `<template name>-<ordinal>`, and its
/// volumes pointed at them, so every member gets disks of its own from one template.
fn index_data_volumes(vm: &mut VirtualMachine, ordinal: u32) {
    let Some(templates) = vm.spec.data_volume_templates.as_mut() else {
        return;
    };
    let mut renamed = Vec::new();
    for t in templates.iter_mut() {
        let Some(name) = t.pointer("/metadata/name").and_then(|n| n.as_str()) else {
            continue;
        };
        let indexed = format!("{name}-{ordinal}");
        renamed.push((name.to_string(), indexed.clone()));
        t["metadata"]["name"] = indexed.into();
    }
    let Some(spec) = vm.spec.template.spec.as_mut() else {
        return;
    };
    for v in spec.volumes.iter_mut() {
        if let Some(dv) = v.data_volume.as_mut() {
            if let Some((_, indexed)) = renamed.iter().find(|(n, _)| *n == dv.name) {
                dv.name = indexed.clone();
            }
        }
    }
}

/// KubeVirt's checks of a pool: replicas, the selector selects the template, and the VMs it
/// makes are valid (their errors named by the pool's paths).
pub fn validate_pool(pool: &VirtualMachinePool) -> Result<(), ValidationError> {
    let mut e = Errors(Vec::new());
    let template = pool.spec.virtual_machine_template.metadata.as_ref();
    validate_target(
        &pool.spec.target,
        template,
        "spec.virtualMachineTemplate",
        &mut e,
    );
    if let Err(vm) = validate_vm(&pool_vm(pool, 0)) {
        for f in vm.errors {
            let path = match f.path.strip_prefix("spec") {
                Some(rest) => format!("spec.virtualMachineTemplate.spec{rest}"),
                None => f.path,
            };
            e.add(path, f.reason);
        }
    }
    finish("VirtualMachinePool", &object_name(&pool.metadata), e)
}

pub fn validate_migration(m: &VirtualMachineInstanceMigration) -> Result<(), ValidationError> {
    let mut e = Errors(Vec::new());
    if m.spec.vmi_name.is_empty() {
        e.add("spec.vmiName", "is required");
    }
    finish(
        "VirtualMachineInstanceMigration",
        &object_name(&m.metadata),
        e,
    )
}

/// Guest memory in bytes: domain.memory.guest, else resources.requests.memory.
pub fn guest_memory(spec: &VirtualMachineInstanceSpec) -> Option<Result<u64, String>> {
    let q = spec
        .domain
        .memory
        .as_ref()
        .and_then(|m| m.guest.as_ref())
        .or_else(|| {
            spec.domain
                .resources
                .as_ref()
                .and_then(|r| r.requests.get("memory"))
        })?;
    Some(parse_bytes(&q.0))
}

/// vCPUs: sockets × cores × threads (each defaulting to 1).
pub fn vcpus(spec: &VirtualMachineInstanceSpec) -> u64 {
    let c = spec.domain.cpu.clone().unwrap_or_default();
    c.sockets.unwrap_or(1) as u64 * c.cores.unwrap_or(1) as u64 * c.threads.unwrap_or(1) as u64
}

const DEVICE_FEATURES_UNSUPPORTED: &[&str] = &[
    "gpus",
    "hostDevices",
    "watchdog",
    "tpm",
    "sound",
    "inputs",
    "clientPassthrough",
    "downwardMetrics",
    "video",
];

/// A VMI spec, section by section, every error collected into `e` with its path under `p`.
fn validate_spec(spec: &VirtualMachineInstanceSpec, p: &str, e: &mut Errors) {
    validate_memory(spec, p, e);
    validate_cpu(spec, p, e);
    validate_firmware(spec, p, e);
    validate_devices(spec, p, e);
    validate_volumes(spec, p, e);
    validate_interfaces(spec, p, e);
    validate_networks(spec, p, e);
    validate_lifecycle(spec, p, e);
}

fn validate_memory(spec: &VirtualMachineInstanceSpec, p: &str, e: &mut Errors) {
    let d = &spec.domain;
    match guest_memory(spec) {
        None => e.add(
            format!("{p}.domain.memory.guest"),
            "a memory size is required (domain.memory.guest or domain.resources.requests.memory)",
        ),
        Some(Err(why)) => e.add(format!("{p}.domain.memory.guest"), why),
        Some(Ok(b)) if !(MIN_MEMORY_MIB << 20..=MAX_MEMORY_MIB << 20).contains(&b) => e.add(
            format!("{p}.domain.memory.guest"),
            format!("{b} bytes is out of range; accepted: 8Mi to 1Ti"),
        ),
        _ => {}
    }
    if let Some(h) = d.memory.as_ref().and_then(|m| m.hugepages.as_ref()) {
        let hp = format!("{p}.domain.memory.hugepages.pageSize");
        match hugepage_bytes(h) {
            Err(why) => e.add(hp, why),
            Ok(page) => {
                if let Some(Ok(b)) = guest_memory(spec) {
                    if b % page != 0 {
                        e.add(
                            format!("{p}.domain.memory.guest"),
                            format!(
                                "{b} bytes is not a whole number of {} huge pages",
                                page_label(page)
                            ),
                        );
                    }
                }
            }
        }
    }
}

/// `memory.hugepages` as a page size in bytes: KubeVirt's `pageSize`, 2Mi or 1Gi (what x86
/// hugetlb pools hold).
pub fn hugepage_bytes(h: &serde_json::Value) -> Result<u64, String> {
    match h.get("pageSize").and_then(|p| p.as_str()) {
        None => Err("is required; accepted: 2Mi, 1Gi".into()),
        Some(s) => match parse_bytes(s) {
            Ok(b) if b == 2 << 20 || b == 1 << 30 => Ok(b),
            _ => Err(format!(
                "{s:?} is not a huge page size of this host kind; accepted: 2Mi, 1Gi"
            )),
        },
    }
}

fn page_label(bytes: u64) -> &'static str {
    if bytes == 2 << 20 {
        "2Mi"
    } else {
        "1Gi"
    }
}

fn validate_cpu(spec: &VirtualMachineInstanceSpec, p: &str, e: &mut Errors) {
    let d = &spec.domain;
    if let Some(c) = &d.cpu {
        for (f, v) in c.topology() {
            if v == Some(0) {
                e.add(format!("{p}.domain.cpu.{f}"), "must be at least 1");
            }
        }
        if let Some(m) = &c.model {
            if m != "host-passthrough" && m != "host-model" {
                e.unsupported(
                    format!("{p}.domain.cpu.model"),
                    &format!("model {m:?}"),
                    "accepted: host-passthrough, host-model (the guest sees the host CPU)",
                );
            }
        }
        for (i, f) in c.features.iter().enumerate() {
            e.unsupported(
                format!("{p}.domain.cpu.features[{i}]"),
                &format!("CPU feature {:?}", f.name),
                "remove it",
            );
        }
        if c.dedicated_cpu_placement == Some(true) {
            e.unsupported(
                format!("{p}.domain.cpu.dedicatedCpuPlacement"),
                "dedicated CPU placement",
                "remove it",
            );
        }
    }
    let n = vcpus(spec);
    if n > MAX_VCPUS as u64 {
        e.add(
            format!("{p}.domain.cpu"),
            format!("sockets × cores × threads = {n}; at most {MAX_VCPUS} vCPUs are accepted"),
        );
    }
}

fn validate_firmware(spec: &VirtualMachineInstanceSpec, p: &str, e: &mut Errors) {
    let d = &spec.domain;
    if let Some(fw) = &d.firmware {
        if fw.bootloader.as_ref().is_some_and(|b| b.efi.is_some()) {
            e.unsupported(
                format!("{p}.domain.firmware.bootloader.efi"),
                "EFI firmware",
                "microvirt boots the kernel directly; use bios or firmware.kernelBoot",
            );
        }
        if let Some(c) = fw.kernel_boot.as_ref().and_then(|k| k.container.as_ref()) {
            if c.image.is_empty() {
                e.add(
                    format!("{p}.domain.firmware.kernelBoot.container.image"),
                    "is required",
                );
            }
            if c.kernel_path.is_none() && c.initrd_path.is_none() {
                e.add(
                    format!("{p}.domain.firmware.kernelBoot.container"),
                    "kernelPath or initrdPath is required",
                );
            }
            for (field, path) in [
                ("kernelPath", &c.kernel_path),
                ("initrdPath", &c.initrd_path),
            ] {
                if let Some(path) = path {
                    confined_path(
                        e,
                        format!("{p}.domain.firmware.kernelBoot.container.{field}"),
                        path,
                        "the kernelBoot image",
                    );
                }
            }
        }
    }
    if let Some(m) = d.machine.as_ref().and_then(|m| m.type_.as_ref()) {
        if m != "microvm" && m != "q35" {
            e.unsupported(
                format!("{p}.domain.machine.type"),
                &format!("machine type {m:?}"),
                "accepted: microvm (q35 is accepted and means microvm)",
            );
        }
    }
}

/// Device classes microvirt refuses, graphics, the disks, and the device count.
fn validate_devices(spec: &VirtualMachineInstanceSpec, p: &str, e: &mut Errors) {
    let dev = &spec.domain.devices;
    for k in dev.extra.keys() {
        if DEVICE_FEATURES_UNSUPPORTED.contains(&k.as_str()) {
            e.unsupported(format!("{p}.domain.devices.{k}"), k, "remove it");
        }
    }
    if dev.autoattach_graphics_device == Some(true) {
        e.unsupported(
            format!("{p}.domain.devices.autoattachGraphicsDevice"),
            "a graphics device (VNC)",
            "set it to false; the serial console is available",
        );
    }
    let volumes: BTreeSet<&str> = spec.volumes.iter().map(|v| v.name.as_str()).collect();
    let mut seen = BTreeSet::new();
    for (i, disk) in dev.disks.iter().enumerate() {
        let dp = format!("{p}.domain.devices.disks[{i}]");
        if !seen.insert(disk.name.as_str()) {
            e.add(
                format!("{dp}.name"),
                format!("duplicate disk name {:?}", disk.name),
            );
        }
        if !volumes.contains(disk.name.as_str()) {
            e.add(
                format!("{dp}.name"),
                format!(
                    "no volume named {:?}; every disk needs a volume of the same name",
                    disk.name
                ),
            );
        }
        validate_disk(disk, &dp, e);
    }
    for (i, fs) in dev.filesystems.iter().enumerate() {
        let fp = format!("{p}.domain.devices.filesystems[{i}]");
        validate_filesystem(spec, fs, &fp, e);
        if !seen.insert(fs.name.as_str()) {
            e.add(
                format!("{fp}.name"),
                format!(
                    "{:?} is already a disk or filesystem; a volume is one or the other",
                    fs.name
                ),
            );
        }
    }
    let devices = dev.disks.len() + dev.interfaces.len() + dev.filesystems.len();
    if devices > MAX_DEVICES {
        e.add(
            format!("{p}.domain.devices"),
            format!(
                "{devices} disks, interfaces and filesystems; at most {MAX_DEVICES} in all are accepted"
            ),
        );
    }
}

/// The longest virtio-fs tag (`struct virtio_fs_config`'s tag field).
pub const FS_TAG_MAX: usize = 36;

/// A filesystem: virtiofs, a tag that fits, and a volume that is a directory to share
/// (a claim, a DataVolume, a ConfigMap, a Secret, a ServiceAccount's token or downwardAPI files).
fn validate_filesystem(
    spec: &VirtualMachineInstanceSpec,
    fs: &crate::types::Filesystem,
    fp: &str,
    e: &mut Errors,
) {
    if fs.virtiofs.is_none() {
        e.add(
            format!("{fp}.virtiofs"),
            "is required: `virtiofs: {}` is the only filesystem type",
        );
    }
    if fs.name.len() > FS_TAG_MAX {
        e.add(
            format!("{fp}.name"),
            format!(
                "{} characters; the guest mounts the share by this name, which holds at most {FS_TAG_MAX}",
                fs.name.len()
            ),
        );
    }
    match spec.volumes.iter().find(|v| v.name == fs.name) {
        None => e.add(
            format!("{fp}.name"),
            format!(
                "no volume named {:?}; every filesystem needs a volume of the same name",
                fs.name
            ),
        ),
        Some(v) => {
            let shareable = v.persistent_volume_claim.is_some()
                || v.data_volume.is_some()
                || v.config_map.is_some()
                || v.secret.is_some()
                || v.service_account.is_some()
                || v.downward_api.is_some();
            if !shareable {
                e.add(
                    format!("{fp}.name"),
                    format!("volume {:?} is not a directory to share; accepted for filesystems: persistentVolumeClaim, dataVolume, configMap, secret, serviceAccount, downwardAPI", fs.name),
                );
            }
        }
    }
}

/// One disk's target, bus, cache and serial.
fn validate_disk(disk: &crate::types::Disk, dp: &str, e: &mut Errors) {
    let targets = [
        disk.disk.is_some(),
        disk.cdrom.is_some(),
        disk.lun.is_some(),
    ]
    .iter()
    .filter(|t| **t)
    .count();
    if targets > 1 {
        e.add(dp.to_string(), "set at most one of disk, cdrom, lun");
    }
    if disk.lun.is_some() {
        e.unsupported(format!("{dp}.lun"), "a LUN (SCSI passthrough)", "use disk");
    }
    let bus = disk
        .disk
        .as_ref()
        .and_then(|t| t.bus.clone())
        .or_else(|| disk.cdrom.as_ref().and_then(|t| t.bus.clone()));
    if let Some(b) = bus {
        if b != DiskBus::Virtio {
            let which = if disk.cdrom.is_some() {
                "cdrom"
            } else {
                "disk"
            };
            e.unsupported(
                format!("{dp}.{which}.bus"),
                &format!("bus {:?}", b.as_str()),
                "accepted: virtio",
            );
        }
    }
    if let Some(c) = &disk.cache {
        if !matches!(c, DiskCache::None | DiskCache::Writeback) {
            e.unsupported(
                format!("{dp}.cache"),
                &format!("cache mode {:?}", c.as_str()),
                "accepted: none, writeback",
            );
        }
    }
    if disk
        .serial
        .as_ref()
        .is_some_and(|s| s.len() > 20 || !s.bytes().all(|b| b.is_ascii_graphic()))
    {
        e.add(
            format!("{dp}.serial"),
            "at most 20 printable ASCII characters are accepted",
        );
    }
}

fn validate_volumes(spec: &VirtualMachineInstanceSpec, p: &str, e: &mut Errors) {
    let mut seen = BTreeSet::new();
    for (i, v) in spec.volumes.iter().enumerate() {
        let vp = format!("{p}.volumes[{i}]");
        volume_names(v, &vp, e);
        if !seen.insert(v.name.as_str()) {
            e.add(
                format!("{vp}.name"),
                format!("duplicate volume name {:?}", v.name),
            );
        }
        let shared = spec
            .domain
            .devices
            .filesystems
            .iter()
            .any(|f| f.name == v.name);
        volume_source(v, &vp, shared, e);
    }
    // A Pod runs as one ServiceAccount, so one token is all a VMI can share (KubeVirt's rule).
    let accounts: Vec<usize> = (spec.volumes.iter().enumerate())
        .filter(|(_, v)| v.service_account.is_some())
        .map(|(i, _)| i)
        .collect();
    if let [_, second, ..] = accounts[..] {
        e.add(
            format!("{p}.volumes[{second}].serviceAccount"),
            "a second serviceAccount volume; a VMI runs as one ServiceAccount, so at most one is accepted",
        );
    }
}

/// The Pod fields a downwardAPI volume may name (what the API server accepts in a Pod's
/// downwardAPI volume); `metadata.labels['k']` and `metadata.annotations['k']` too.
const DOWNWARD_FIELDS: [&str; 5] = [
    "metadata.name",
    "metadata.namespace",
    "metadata.uid",
    "metadata.labels",
    "metadata.annotations",
];

/// A downwardAPI volume's files: relative paths that stay inside the share, each with one
/// source the launcher Pod has.
fn downward_api_files(d: &crate::types::DownwardApiSource, vp: &str, e: &mut Errors) {
    let mut paths = BTreeSet::new();
    for (i, f) in d.fields.iter().enumerate() {
        let fp = format!("{vp}.downwardAPI.fields[{i}]");
        let escapes = f.path.split('/').any(|c| c == "..");
        if f.path.is_empty() || f.path.starts_with('/') || escapes {
            e.add(
                format!("{fp}.path"),
                format!(
                    "{:?} must be a relative path without '..' (the file's name in the share)",
                    f.path
                ),
            );
        } else if !paths.insert(f.path.as_str()) {
            e.add(format!("{fp}.path"), format!("duplicate path {:?}", f.path));
        }
        match (&f.field_ref, &f.resource_field_ref) {
            (Some(r), None) => {
                let path = r.field_path.as_str();
                let keyed = ["metadata.labels['", "metadata.annotations['"]
                    .iter()
                    .any(|pre| path.starts_with(pre) && path.ends_with("']"));
                if !DOWNWARD_FIELDS.contains(&path) && !keyed {
                    e.add(
                        format!("{fp}.fieldRef.fieldPath"),
                        format!("{path:?} is not a field a downwardAPI volume can hold; accepted: {}, metadata.labels['KEY'], metadata.annotations['KEY']", DOWNWARD_FIELDS.join(", ")),
                    );
                }
            }
            (None, Some(r)) => {
                let accepted = [
                    "limits.cpu",
                    "limits.memory",
                    "requests.cpu",
                    "requests.memory",
                ];
                if !accepted.contains(&r.resource.as_str()) {
                    e.add(
                        format!("{fp}.resourceFieldRef.resource"),
                        format!(
                            "{:?} is not a resource of the VM's container; accepted: {}",
                            r.resource,
                            accepted.join(", ")
                        ),
                    );
                }
            }
            _ => e.add(fp, "set exactly one of fieldRef, resourceFieldRef"),
        }
    }
}

/// The names and paths a volume gives microvirt to open.
fn volume_names(v: &crate::types::Volume, vp: &str, e: &mut Errors) {
    plain_name(e, format!("{vp}.name"), &v.name);
    if let Some(c) = &v.persistent_volume_claim {
        plain_name(
            e,
            format!("{vp}.persistentVolumeClaim.claimName"),
            &c.claim_name,
        );
    }
    if let Some(d) = &v.data_volume {
        plain_name(e, format!("{vp}.dataVolume.name"), &d.name);
    }
    if let Some(a) = &v.service_account {
        dns_subdomain(
            e,
            format!("{vp}.serviceAccount.serviceAccountName"),
            &a.service_account_name,
        );
    }
    if let Some(path) = v.container_disk.as_ref().and_then(|c| c.path.as_ref()) {
        confined_path(
            e,
            format!("{vp}.containerDisk.path"),
            path,
            "the containerDisk image",
        );
    }
}

/// Exactly one supported source, and that source's fields.
/// `shared`: the volume is a filesystem's, where a ConfigMap or Secret is a directory.
fn volume_source(v: &crate::types::Volume, vp: &str, shared: bool, e: &mut Errors) {
    let sources = [
        v.container_disk.is_some(),
        v.persistent_volume_claim.is_some(),
        v.data_volume.is_some(),
        v.empty_disk.is_some(),
        v.host_disk.is_some(),
        v.cloud_init_no_cloud.is_some(),
        v.cloud_init_config_drive.is_some(),
        v.config_map.is_some(),
        v.secret.is_some(),
        v.service_account.is_some(),
        v.downward_api.is_some(),
        v.ephemeral.is_some(),
    ]
    .iter()
    .filter(|s| **s)
    .count()
        + v.extra.len();
    if sources != 1 {
        e.add(vp.to_string(), format!("exactly one volume source is required, found {sources}; accepted: containerDisk, persistentVolumeClaim, dataVolume, emptyDisk, hostDisk, cloudInitNoCloud, cloudInitConfigDrive"));
    }
    for k in v.extra.keys() {
        e.unsupported(format!("{vp}.{k}"), &format!("volume source {k:?}"), "accepted: containerDisk, persistentVolumeClaim, dataVolume, emptyDisk, hostDisk, cloudInitNoCloud, cloudInitConfigDrive");
    }
    for (set, name) in [
        (v.config_map.is_some() && !shared, "configMap"),
        (v.secret.is_some() && !shared, "secret"),
        (v.service_account.is_some() && !shared, "serviceAccount"),
        (v.downward_api.is_some() && !shared, "downwardAPI"),
        (v.ephemeral.is_some(), "ephemeral"),
    ] {
        if set {
            e.unsupported(format!("{vp}.{name}"), &format!("a {name} volume as a disk"), "accepted: containerDisk, persistentVolumeClaim, dataVolume, emptyDisk, hostDisk, cloudInitNoCloud, cloudInitConfigDrive; a configMap, secret, serviceAccount or downwardAPI volume is shared with a filesystem (domain.devices.filesystems, virtiofs)");
        }
    }
    if let Some(d) = &v.downward_api {
        downward_api_files(d, vp, e);
    }
    if let Some(ed) = &v.empty_disk {
        if let Err(why) = parse_bytes(&ed.capacity.0) {
            e.add(format!("{vp}.emptyDisk.capacity"), why);
        }
    }
    if let Some(h) = &v.host_disk {
        match h.type_.as_str() {
            "Disk" => {}
            "DiskOrCreate" => match &h.capacity {
                None => e.add(
                    format!("{vp}.hostDisk.capacity"),
                    "is required for type DiskOrCreate",
                ),
                Some(c) => {
                    if let Err(why) = parse_bytes(&c.0) {
                        e.add(format!("{vp}.hostDisk.capacity"), why);
                    }
                }
            },
            t => e.add(
                format!("{vp}.hostDisk.type"),
                format!("{t:?} is not a hostDisk type; accepted: Disk, DiskOrCreate"),
            ),
        }
        if !h.path.starts_with('/') {
            e.add(format!("{vp}.hostDisk.path"), "must be an absolute path");
        } else {
            confined_path(
                e,
                format!("{vp}.hostDisk.path"),
                &h.path,
                "the host directories the cluster allows",
            );
        }
    }
    if let Some(c) = &v.container_disk {
        if c.image.is_empty() {
            e.add(format!("{vp}.containerDisk.image"), "is required");
        }
    }
    for (ci, field) in [
        (&v.cloud_init_no_cloud, "cloudInitNoCloud"),
        (&v.cloud_init_config_drive, "cloudInitConfigDrive"),
    ] {
        let Some(ci) = ci else { continue };
        if ci.user_data_secret_ref.is_some() || ci.network_data_secret_ref.is_some() {
            e.unsupported(
                format!("{vp}.{field}"),
                "secret references",
                "inline userData/networkData (or their base64 forms)",
            );
        }
    }
}

fn validate_interfaces(spec: &VirtualMachineInstanceSpec, p: &str, e: &mut Errors) {
    let dev = &spec.domain.devices;
    let networks: BTreeSet<&str> = spec.networks.iter().map(|n| n.name.as_str()).collect();
    let mut seen = BTreeSet::new();
    for (i, iface) in dev.interfaces.iter().enumerate() {
        let ip = format!("{p}.domain.devices.interfaces[{i}]");
        if !seen.insert(iface.name.as_str()) {
            e.add(
                format!("{ip}.name"),
                format!("duplicate interface name {:?}", iface.name),
            );
        }
        if !networks.contains(iface.name.as_str()) {
            e.add(
                format!("{ip}.name"),
                format!(
                    "no network named {:?}; every interface needs a network of the same name",
                    iface.name
                ),
            );
        }
        validate_interface(iface, &ip, e);
    }
}

/// One interface's binding, model and MAC address.
fn validate_interface(iface: &crate::types::Interface, ip: &str, e: &mut Errors) {
    if iface.sriov.is_some() {
        e.unsupported(
            format!("{ip}.sriov"),
            "SR-IOV",
            "accepted bindings: masquerade, bridge",
        );
    }
    if iface.slirp.is_some() {
        e.unsupported(
            format!("{ip}.slirp"),
            "slirp",
            "accepted bindings: masquerade, bridge",
        );
    }
    if let Some(b) = &iface.binding {
        if b.name != crate::types::VHOST_USER_BINDING {
            e.add(
                format!("{ip}.binding.name"),
                format!("{:?} is not a network binding microvirt has (binding plugins' sidecars rewrite a libvirt domain, and there is none); accepted: vhostuser", b.name),
            );
        }
    }
    if iface.bindings().len() > 1 {
        e.add(
            ip.to_string(),
            "set exactly one binding method (masquerade, bridge or binding: {name: vhostuser})",
        );
    }
    if let Some(m) = &iface.model {
        if *m != NicModel::Virtio {
            e.unsupported(
                format!("{ip}.model"),
                &format!("NIC model {:?}", m.as_str()),
                "accepted: virtio",
            );
        }
    }
    if let Some(mac) = &iface.mac_address {
        if let Err(why) = check_mac(mac) {
            e.add(format!("{ip}.macAddress"), why);
        }
    }
}

fn validate_networks(spec: &VirtualMachineInstanceSpec, p: &str, e: &mut Errors) {
    let dev = &spec.domain.devices;
    let mut seen = BTreeSet::new();
    let mut pods = 0;
    for (i, n) in spec.networks.iter().enumerate() {
        let np = format!("{p}.networks[{i}]");
        if !seen.insert(n.name.as_str()) {
            e.add(
                format!("{np}.name"),
                format!("duplicate network name {:?}", n.name),
            );
        }
        match (n.pod.is_some(), n.multus.is_some()) {
            (true, false) => pods += 1,
            (false, true) => {}
            _ => e.add(np.clone(), "set exactly one of pod, multus"),
        }
        match dev.interfaces.iter().position(|i| i.name == n.name) {
            None => e.add(
                format!("{np}.name"),
                format!("no interface named {:?} uses this network", n.name),
            ),
            // The socket is made by a userspace CNI for a Multus network; the Pod network has
            // no such socket.
            Some(ii) if dev.interfaces[ii].binding.is_some() && n.pod.is_some() => e.add(
                format!("{p}.domain.devices.interfaces[{ii}].binding"),
                format!("vhostuser needs a Multus network whose CNI makes its vhost-user socket; network {:?} is the pod network", n.name),
            ),
            Some(_) => {}
        }
    }
    if pods > 1 {
        e.add(
            format!("{p}.networks"),
            "at most one pod network is accepted",
        );
    }
}

fn validate_lifecycle(spec: &VirtualMachineInstanceSpec, p: &str, e: &mut Errors) {
    if spec.termination_grace_period_seconds.is_some_and(|t| t < 0) {
        e.add(
            format!("{p}.terminationGracePeriodSeconds"),
            "must be 0 or more",
        );
    }
    if let Some(s) = &spec.eviction_strategy {
        if !["LiveMigrate", "LiveMigrateIfPossible", "None", "External"].contains(&s.as_str()) {
            e.add(
                format!("{p}.evictionStrategy"),
                format!("{s:?}; accepted: LiveMigrate, LiveMigrateIfPossible, None, External"),
            );
        }
    }
}

/// A path inside a directory microvirt provides (an image's files, an allowed host
/// directory): a `..` component would leave it, and NUL ends it early in every system call.
fn confined_path(e: &mut Errors, field: String, path: &str, inside: &str) {
    if path.contains('\0') {
        e.add(field, "must not contain a NUL character");
    } else if path.split('/').any(|c| c == "..") {
        e.add(
            field,
            format!("{path:?} has a \"..\" component, which would reach outside {inside}; give the path without \"..\""),
        );
    }
}

/// A Kubernetes object or volume name that microvirt turns into a file or directory name
/// (`<volume-dir>/<claim>`, `<state-dir>/<volume>.emptydisk.img`): it must not be a path.
fn plain_name(e: &mut Errors, field: String, name: &str) {
    let bad = name.is_empty()
        || name == "."
        || name == ".."
        || name.len() > 253
        || name
            .bytes()
            .any(|b| b == b'/' || b == 0 || b.is_ascii_control());
    if bad {
        e.add(
            field,
            format!("{name:?} is not a valid name: names are 1 to 253 characters without '/', control characters, \".\" or \"..\" alone (they name files microvirt creates)"),
        );
    }
}

/// A Kubernetes object name that must be a DNS subdomain (RFC 1123): what the API server
/// would refuse later, when the launcher Pod is created, refused now with the VMI's field.
fn dns_subdomain(e: &mut Errors, field: String, name: &str) {
    let label_ok = |l: &str| {
        let b = l.as_bytes();
        !b.is_empty()
            && b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric()
            && b.iter()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
    };
    if name.len() > 253 || !name.split('.').all(label_ok) {
        e.add(
            field,
            format!("{name:?} is not a valid name: lower-case letters, digits, '-' and '.', starting and ending with a letter or digit, at most 253 characters"),
        );
    }
}

/// A unicast MAC in `aa:bb:cc:dd:ee:ff` form.
pub fn check_mac(mac: &str) -> Result<[u8; 6], String> {
    let parts: Vec<&str> = mac.split(':').collect();
    let bad = || format!("{mac:?} is not a MAC address like 02:00:00:00:00:01");
    if parts.len() != 6 {
        return Err(bad());
    }
    let mut m = [0u8; 6];
    for (i, p) in parts.iter().enumerate() {
        if p.len() != 2 {
            return Err(bad());
        }
        m[i] = u8::from_str_radix(p, 16).map_err(|_| bad())?;
    }
    if m[0] & 1 != 0 {
        return Err(format!(
            "{mac:?} is a multicast address; a NIC needs a unicast address"
        ));
    }
    Ok(m)
}

/// The cluster's pod-network rules (`spec.configuration.network` of the KubeVirt CR).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NetworkDefaults {
    /// The binding of the interface added when a VMI names none (`defaultNetworkInterface`).
    pub binding: crate::closed::Binding,
    /// Whether an interface may bind the pod network as a bridge
    /// (`permitBridgeInterfaceOnPodNetwork`).
    pub permit_bridge_on_pod_network: bool,
}

impl Default for NetworkDefaults {
    /// KubeVirt's: bridge, permitted. (microvirt's built-in default binding is masquerade,
    /// which works on every pod network; the KubeVirt CR's `defaultNetworkInterface` changes
    /// it.)
    fn default() -> Self {
        NetworkDefaults {
            binding: crate::closed::Binding::Masquerade,
            permit_bridge_on_pod_network: true,
        }
    }
}

impl NetworkDefaults {
    /// The interfaces `spec` binds to the pod network as a bridge, when the cluster forbids it
    /// (KubeVirt's words), by path.
    pub fn refusals(&self, spec: &VirtualMachineInstanceSpec, base: &str) -> Vec<FieldError> {
        if self.permit_bridge_on_pod_network {
            return Vec::new();
        }
        spec.pod_network_bridges()
            .into_iter()
            .map(|(n, _)| FieldError {
                path: format!("{base}.domain.devices.interfaces[{n}].bridge"),
                reason: "Bridge on pod network configuration is not enabled under kubevirt-config (permitBridgeInterfaceOnPodNetwork is false); use masquerade".into(),
            })
            .collect()
    }

    /// [`refusals`](Self::refusals) as a validation result for `kind` named by `meta`.
    pub fn check(
        &self,
        kind: &str,
        meta: &ObjectMeta,
        spec: &VirtualMachineInstanceSpec,
        base: &str,
    ) -> Result<(), ValidationError> {
        let mut e = Errors(Vec::new());
        for f in self.refusals(spec, base) {
            e.add(f.path, f.reason);
        }
        finish(kind, &object_name(meta), e)
    }
}

/// KubeVirt's defaults for a VMI spec, with microvirt's pod-network defaults.
pub fn default_vmi_spec(spec: &mut VirtualMachineInstanceSpec) {
    default_vmi_spec_with(spec, &NetworkDefaults::default())
}

/// KubeVirt's defaults for a VMI spec, with the cluster's pod-network defaults.
pub fn default_vmi_spec_with(spec: &mut VirtualMachineInstanceSpec, network: &NetworkDefaults) {
    let d = &mut spec.domain;
    let cpu = d.cpu.get_or_insert_with(Default::default);
    cpu.sockets.get_or_insert(1);
    cpu.cores.get_or_insert(1);
    cpu.threads.get_or_insert(1);
    if d.memory.as_ref().and_then(|m| m.guest.as_ref()).is_none() {
        if let Some(req) = d
            .resources
            .as_ref()
            .and_then(|r| r.requests.get("memory"))
            .cloned()
        {
            d.memory.get_or_insert_with(Default::default).guest = Some(req);
        }
    }
    // Like KubeVirt's VMI mutator (SetDefaultVolumeDisk): a volume that no disk and no
    // filesystem refers to gets a disk of its own, so it is never silently left out.
    let filesystems: Vec<String> = d
        .devices
        .filesystems
        .iter()
        .map(|f| f.name.clone())
        .collect();
    for v in &spec.volumes {
        if !d.devices.disks.iter().any(|k| k.name == v.name) && !filesystems.contains(&v.name) {
            d.devices.disks.push(Disk {
                name: v.name.clone(),
                ..Default::default()
            });
        }
    }
    for disk in &mut d.devices.disks {
        if disk.disk.is_none() && disk.cdrom.is_none() && disk.lun.is_none() {
            disk.disk = Some(DiskTarget {
                bus: Some(DiskBus::Virtio),
                readonly: None,
            });
        }
        if let Some(t) = disk.disk.as_mut() {
            t.bus.get_or_insert(DiskBus::Virtio);
        }
        if let Some(t) = disk.cdrom.as_mut() {
            t.bus.get_or_insert(DiskBus::Virtio);
            t.readonly.get_or_insert(true);
        }
    }
    // Like KubeVirt: no networks and no interfaces means one masquerade interface on the pod
    // network, unless autoattachPodInterface is false.
    if spec.networks.is_empty()
        && d.devices.interfaces.is_empty()
        && d.devices.autoattach_pod_interface != Some(false)
    {
        spec.networks.push(Network {
            name: "default".into(),
            pod: Some(PodNetwork::default()),
            ..Default::default()
        });
        let mut auto = Interface {
            name: "default".into(),
            ..Default::default()
        };
        match network.binding {
            crate::closed::Binding::Bridge => auto.bridge = Some(serde_json::json!({})),
            _ => auto.masquerade = Some(serde_json::json!({})),
        }
        d.devices.interfaces.push(auto);
    }
    for i in &mut d.devices.interfaces {
        if i.bindings().is_empty() {
            i.bridge = Some(serde_json::json!({}));
        }
        i.model.get_or_insert(NicModel::Virtio);
    }
    d.devices.autoattach_serial_console.get_or_insert(true);
    d.devices.autoattach_graphics_device.get_or_insert(false);
    spec.termination_grace_period_seconds.get_or_insert(30);
}

/// The VM's effective run strategy: runStrategy, else `running` mapped as KubeVirt maps it.
pub fn run_strategy(vm: &VirtualMachine) -> RunStrategy {
    match (vm.spec.run_strategy, vm.spec.running) {
        (Some(s), _) => s,
        (None, Some(true)) => RunStrategy::Always,
        _ => RunStrategy::Halted,
    }
}

pub fn default_vm(vm: &mut VirtualMachine) {
    default_vm_with(vm, &NetworkDefaults::default())
}

/// [`default_vm`] with the cluster's pod-network defaults.
pub fn default_vm_with(vm: &mut VirtualMachine, network: &NetworkDefaults) {
    // A VM with an instance type or a preference is defaulted when its VMI is made, after the
    // expansion: defaults written into the template now would conflict with the instance type
    // and leave a preference nothing to fill (KubeVirt's VM mutator leaves them alone too).
    if vm.spec.instancetype.is_some() || vm.spec.preference.is_some() {
        return;
    }
    if let Some(spec) = vm.spec.template.spec.as_mut() {
        default_vmi_spec_with(spec, network);
    }
}

/// The cluster's rule for `hostDisk` volumes (KubeVirt's `HostDisk` feature gate). A hostDisk
/// is a file on the node that the kubelet mounts into the launcher Pod, and every launcher runs
/// as the same UID: without this rule one tenant could attach another's image or any host
/// file. Off by default, as in KubeVirt; when on, only paths below `allowed_prefixes` (each may
/// hold `{namespace}`, the VMI's namespace, so that tenants get a directory each).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostDiskPolicy {
    pub feature_gate: bool,
    pub allowed_prefixes: Vec<String>,
}

impl HostDiskPolicy {
    /// The prefixes that apply to `namespace`, `{namespace}` filled in.
    fn prefixes(&self, namespace: &str) -> Vec<std::path::PathBuf> {
        self.allowed_prefixes
            .iter()
            .map(|p| std::path::PathBuf::from(p.replace("{namespace}", namespace)))
            .collect()
    }

    /// Every hostDisk of `spec` (whose fields are named below `p`) this policy refuses, with
    /// the reason. A path is compared by whole components after `..` was refused by
    /// `validate_spec`, so `/var/lib/hostdisks-other` is not below `/var/lib/hostdisks`.
    pub fn refusals(
        &self,
        spec: &VirtualMachineInstanceSpec,
        p: &str,
        namespace: &str,
    ) -> Vec<FieldError> {
        let mut e = Errors(Vec::new());
        for (i, v) in spec.volumes.iter().enumerate() {
            let Some(h) = &v.host_disk else { continue };
            let field = format!("{p}.volumes[{i}].hostDisk");
            if !self.feature_gate {
                e.add(
                    field,
                    "HostDisk feature gate is not enabled (the cluster administrator enables it with --feature-gates HostDisk and allows host directories with --host-disk-prefix)",
                );
                continue;
            }
            let path = std::path::Path::new(&h.path);
            let prefixes = self.prefixes(namespace);
            let below = path
                .components()
                .any(|c| c == std::path::Component::ParentDir)
                || !prefixes
                    .iter()
                    .any(|pre| path.starts_with(pre) && path != pre);
            if below {
                let allowed: Vec<String> =
                    prefixes.iter().map(|p| p.display().to_string()).collect();
                e.add(
                    format!("{field}.path"),
                    format!(
                        "{} is outside the host directories this cluster allows for hostDisks in namespace {namespace:?} ({})",
                        h.path,
                        if allowed.is_empty() { "none are allowed".to_string() } else { allowed.join(", ") }
                    ),
                );
            }
        }
        e.0
    }

    /// `refusals` as the one error the webhook and virt-controller report.
    pub fn check(
        &self,
        kind: &str,
        meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
        spec: &VirtualMachineInstanceSpec,
        p: &str,
    ) -> Result<(), ValidationError> {
        let ns = meta.namespace.as_deref().unwrap_or("default");
        finish(kind, &object_name(meta), Errors(self.refusals(spec, p, ns)))
    }
}
