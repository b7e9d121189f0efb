//! KubeVirt's `clone.kubevirt.io/v1beta1` VirtualMachineClone, with KubeVirt's fields, phases
//! and conditions, and the pure decisions taken from it: which source it names, which labels and
//! annotations the clone keeps (KubeVirt's filters: `*` wildcards, `!` negation, the last filter
//! that matches a key decides), and the JSON patches that give the clone its own identity (new
//! or cleared MAC addresses, no firmware UUID, a new or cleared SMBIOS serial).
//!
//! A clone is carried out as KubeVirt carries it out: a VirtualMachineSnapshot of the source VM
//! (none when the source is a snapshot), then a VirtualMachineRestore of that snapshot into a new
//! VM with these patches; both are the clone's own and go when it is done.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::TypedLocalObjectReference;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::snapshot::{SnapshottedVm, VolumeRestorePolicy, NOT_CARRIED_ANNOTATIONS};
use crate::types::{Condition, Extra};
use crate::validation::check_mac;

/// The API group of the kind.
pub const GROUP: &str = "clone.kubevirt.io";

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "clone.kubevirt.io",
    version = "v1beta1",
    kind = "VirtualMachineClone",
    namespaced,
    shortname = "vmclone",
    shortname = "vmclones",
    status = "VirtualMachineCloneStatus",
    derive = "PartialEq",
    derive = "Default",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"SourceVirtualMachine","type":"string","jsonPath":".spec.source.name"}"#,
    printcolumn = r#"{"name":"TargetVirtualMachine","type":"string","jsonPath":".spec.target.name"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-preserve-unknown-fields" = true))]
/// A new VM made from a VM (through a snapshot of it) or from a VM snapshot, with its own
/// identity: new MAC addresses, no firmware UUID, a new SMBIOS serial.
pub struct VirtualMachineCloneSpec {
    /// A VirtualMachine (`apiGroup: kubevirt.io`) or a VirtualMachineSnapshot
    /// (`apiGroup: snapshot.kubevirt.io`) in the clone's namespace.
    pub source: TypedLocalObjectReference,
    /// The VM to create (`kind: VirtualMachine`); a name is made up when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<TypedLocalObjectReference>,
    /// Which of the source VM's annotations the clone keeps (default: all).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub annotation_filters: Vec<String>,
    /// Which of the source VM's labels the clone keeps (default: all).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub label_filters: Vec<String>,
    /// The same filters for the VMI template's labels and annotations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<CloneTemplateFilters>,
    /// Interface name → the clone's MAC address; an interface not named gets a new one.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub new_mac_addresses: BTreeMap<String, String>,
    /// The clone's SMBIOS serial (default: none, so not the source's).
    #[serde(
        default,
        rename = "newSMBiosSerial",
        skip_serializing_if = "Option::is_none"
    )]
    pub new_smbios_serial: Option<String>,
    /// JSON patches (RFC 6902, one per string) applied to the clone after the above.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub patches: Vec<String>,
    /// How the clone's claims are named: `RandomizeNames` (default) or `PrefixTargetName`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_name_policy: Option<VolumeRestorePolicy>,
    #[serde(flatten, default)]
    #[schemars(skip)]
    pub extra: Extra,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CloneTemplateFilters {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub annotation_filters: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub label_filters: Vec<String>,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum ClonePhase {
    SnapshotInProgress,
    #[serde(rename = "CreatingTargetVM")]
    CreatingTargetVm,
    RestoreInProgress,
    Succeeded,
    Failed,
    Unknown,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineCloneStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<ClonePhase>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_name: Option<String>,
}

/// What a clone is made from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CloneSource {
    /// A VM: it is snapshotted first.
    Vm(String),
    /// A VirtualMachineSnapshot, used as it is.
    Snapshot(String),
}

/// `spec.source` judged.
pub fn source_of(spec: &VirtualMachineCloneSpec) -> Result<CloneSource, String> {
    let s = &spec.source;
    if s.name.is_empty() {
        return Err("spec.source.name: must name the VM or snapshot to clone".into());
    }
    let group = s.api_group.as_deref().unwrap_or_default();
    match (group, s.kind.as_str()) {
        ("kubevirt.io", "VirtualMachine") => Ok(CloneSource::Vm(s.name.clone())),
        (crate::snapshot::GROUP, "VirtualMachineSnapshot") => {
            Ok(CloneSource::Snapshot(s.name.clone()))
        }
        _ => Err(format!(
            "spec.source: {group:?}/{:?} cannot be cloned; accepted: kind VirtualMachine \
             (apiGroup kubevirt.io) or kind VirtualMachineSnapshot (apiGroup snapshot.kubevirt.io)",
            s.kind
        )),
    }
}

/// The name of the VM the clone makes: `spec.target.name`, else one made from the clone's UID
/// (the same on every pass, so nothing has to be remembered before the VM exists).
pub fn target_name_of(spec: &VirtualMachineCloneSpec, clone_uid: &str) -> Result<String, String> {
    match &spec.target {
        None => Ok(format!("clone-{}", short_uid(clone_uid))),
        Some(t) => {
            crate::snapshot::check_vm_reference(t, "spec.target")?;
            Ok(t.name.clone())
        }
    }
}

/// The snapshot a clone of a VM takes (KubeVirt's name for it).
pub fn temporary_snapshot_name(clone_uid: &str) -> String {
    format!("tmp-snapshot-{clone_uid}")
}

/// The restore a clone runs (KubeVirt's name for it).
pub fn temporary_restore_name(clone_uid: &str) -> String {
    format!("tmp-restore-{clone_uid}")
}

fn short_uid(uid: &str) -> String {
    uid.chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .take(8)
        .collect::<String>()
        .to_lowercase()
}

/// Whether a key passes `filters` (KubeVirt's clone filters): none at all keeps every key;
/// otherwise the last filter that matches decides (`!pattern` drops, `pattern` keeps) and a key
/// no filter matches is dropped. `*` matches any run of characters.
pub fn filters_keep(filters: &[String], key: &str) -> bool {
    if filters.is_empty() {
        return true;
    }
    let mut kept = false;
    for f in filters {
        let (negated, pattern) = match f.strip_prefix('!') {
            Some(p) => (true, p),
            None => (false, f.as_str()),
        };
        if glob(pattern, key) {
            kept = !negated;
        }
    }
    kept
}

/// `*` matches any run (also empty); everything else itself.
fn glob(pattern: &str, text: &str) -> bool {
    let Some((head, rest)) = pattern.split_once('*') else {
        return pattern == text;
    };
    let Some(mut left) = text.strip_prefix(head) else {
        return false;
    };
    let parts: Vec<&str> = rest.split('*').collect();
    let (last, middle) = parts.split_last().expect("split yields one part at least");
    for p in middle {
        match left.find(p) {
            Some(i) => left = &left[i + p.len()..],
            None => return false,
        }
    }
    left.len() >= last.len() && left.ends_with(last)
}

/// Every filter list well formed: no empty filter, no bare `!`.
fn check_filters(filters: &[String], field: &str) -> Result<(), String> {
    for (i, f) in filters.iter().enumerate() {
        if f.is_empty() || f == "!" {
            return Err(format!(
                "{field}[{i}]: {f:?} is not a filter; accepted: a key, a pattern with * \
                 wildcards, either one after ! to exclude"
            ));
        }
    }
    Ok(())
}

/// RFC 6901: `~` and `/` escaped in a path segment.
fn pointer_segment(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

/// The JSON patches (one JSON document per string, as a VirtualMachineRestore takes them) that
/// turn the VM a restore of `source` would create into the clone `spec` asks for: labels and
/// annotations the filters drop removed (on the VM and its template), each interface's MAC
/// replaced by `newMacAddresses` or removed (a VM without one is given one derived from its
/// own name), the firmware UUID removed, the SMBIOS serial replaced or removed; then
/// `spec.patches`. Bad input is refused here, before anything is created.
pub fn identity_patches(
    spec: &VirtualMachineCloneSpec,
    source: &SnapshottedVm,
) -> Result<Vec<String>, String> {
    validate_clone(spec)?;
    let template_filters = spec.template.clone().unwrap_or_default();
    let mut ops: Vec<Value> = Vec::new();
    let dropped = |map: Option<&BTreeMap<String, String>>, filters: &[String], at: &str| {
        map.into_iter()
            .flatten()
            .filter(|(k, _)| !filters_keep(filters, k))
            .map(|(k, _)| json!({"op": "remove", "path": format!("{at}/{}", pointer_segment(k))}))
            .collect::<Vec<_>>()
    };
    ops.extend(dropped(
        source.metadata.labels.as_ref(),
        &spec.label_filters,
        "/metadata/labels",
    ));
    let carried: Option<BTreeMap<String, String>> = source.metadata.annotations.as_ref().map(|a| {
        a.iter()
            .filter(|(k, _)| !NOT_CARRIED_ANNOTATIONS.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    });
    ops.extend(dropped(
        carried.as_ref(),
        &spec.annotation_filters,
        "/metadata/annotations",
    ));
    let template_meta = source.spec.template.metadata.as_ref();
    ops.extend(dropped(
        template_meta.and_then(|m| m.labels.as_ref()),
        &template_filters.label_filters,
        "/spec/template/metadata/labels",
    ));
    ops.extend(dropped(
        template_meta.and_then(|m| m.annotations.as_ref()),
        &template_filters.annotation_filters,
        "/spec/template/metadata/annotations",
    ));

    let vmi = source.spec.template.spec.clone().unwrap_or_default();
    let interfaces = &vmi.domain.devices.interfaces;
    for name in spec.new_mac_addresses.keys() {
        if !interfaces.iter().any(|i| &i.name == name) {
            let known: Vec<&str> = interfaces.iter().map(|i| i.name.as_str()).collect();
            return Err(format!(
                "spec.newMacAddresses[{name}]: the source VM has no interface {name:?} \
                 (its interfaces: {known:?})"
            ));
        }
    }
    for (i, iface) in interfaces.iter().enumerate() {
        let path = format!("/spec/template/spec/domain/devices/interfaces/{i}/macAddress");
        match spec.new_mac_addresses.get(&iface.name) {
            Some(mac) => ops.push(json!({"op": "add", "path": path, "value": mac})),
            None if iface.mac_address.is_some() => ops.push(json!({"op": "remove", "path": path})),
            None => {}
        }
    }
    if let Some(fw) = &vmi.domain.firmware {
        let at = "/spec/template/spec/domain/firmware";
        if fw.uuid.is_some() {
            ops.push(json!({"op": "remove", "path": format!("{at}/uuid")}));
        }
        match &spec.new_smbios_serial {
            Some(serial) => {
                ops.push(json!({"op": "add", "path": format!("{at}/serial"), "value": serial}))
            }
            None if fw.serial.is_some() => {
                ops.push(json!({"op": "remove", "path": format!("{at}/serial")}))
            }
            None => {}
        }
    } else if let Some(serial) = &spec.new_smbios_serial {
        ops.push(
            json!({"op": "add", "path": "/spec/template/spec/domain/firmware",
            "value": {"serial": serial}}),
        );
    }

    let mut patches: Vec<String> = ops.iter().map(Value::to_string).collect();
    patches.extend(spec.patches.iter().cloned());
    Ok(patches)
}

/// Everything a clone's spec says that can be judged without its source (the admission
/// webhook's check, and the controller's before it writes anything): the source and target
/// kinds, the filters, the MAC addresses, the patches, the claim naming. Valid, its source.
pub fn validate_clone(spec: &VirtualMachineCloneSpec) -> Result<CloneSource, String> {
    let source = source_of(spec)?;
    if let Some(t) = &spec.target {
        crate::snapshot::check_vm_reference(t, "spec.target")?;
    }
    check_filters(&spec.label_filters, "spec.labelFilters")?;
    check_filters(&spec.annotation_filters, "spec.annotationFilters")?;
    let template = spec.template.clone().unwrap_or_default();
    check_filters(&template.label_filters, "spec.template.labelFilters")?;
    check_filters(
        &template.annotation_filters,
        "spec.template.annotationFilters",
    )?;
    for (name, mac) in &spec.new_mac_addresses {
        check_mac(mac).map_err(|why| format!("spec.newMacAddresses[{name}]: {why}"))?;
    }
    crate::snapshot::check_patches(&spec.patches)?;
    if spec.volume_name_policy == Some(VolumeRestorePolicy::InPlace) {
        return Err(
            "spec.volumeNamePolicy: InPlace would take the source's claims; accepted: \
             RandomizeNames, PrefixTargetName"
                .into(),
        );
    }
    Ok(source)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::VirtualMachine;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn filters_follow_kubevirt() {
        assert!(filters_keep(&[], "anything"));
        let f = strings(&["*", "!some/key*"]);
        assert!(filters_keep(&f, "app"));
        assert!(!filters_keep(&f, "some/key"));
        assert!(!filters_keep(&f, "some/keyring"));
        assert!(filters_keep(&f, "other/key"));
        // The last match decides; nothing matching drops.
        let f = strings(&["!team*", "team/keep"]);
        assert!(filters_keep(&f, "team/keep"));
        assert!(!filters_keep(&f, "team/drop"));
        assert!(!filters_keep(&f, "app"));
        assert!(glob("a*b*c", "a-b-b-c"));
        assert!(!glob("a*b*c", "a-c"));
        assert!(glob("*", ""));
        assert!(!glob("ab*ba", "aba"));
    }

    #[test]
    fn sources_and_targets_are_judged() {
        let mut spec: VirtualMachineCloneSpec = serde_json::from_value(json!({
            "source": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": "vm"}}))
        .unwrap();
        assert_eq!(source_of(&spec), Ok(CloneSource::Vm("vm".into())));
        assert_eq!(
            target_name_of(&spec, "1A2b-3c4d-5e6f").unwrap(),
            "clone-1a2b3c4d"
        );
        spec.source.kind = "Pod".into();
        assert!(source_of(&spec).unwrap_err().contains("cannot be cloned"));
        spec.source.api_group = Some("snapshot.kubevirt.io".into());
        spec.source.kind = "VirtualMachineSnapshot".into();
        assert_eq!(source_of(&spec), Ok(CloneSource::Snapshot("vm".into())));
        spec.target = Some(TypedLocalObjectReference {
            api_group: Some("kubevirt.io".into()),
            kind: "VirtualMachineInstance".into(),
            name: "x".into(),
        });
        assert!(target_name_of(&spec, "u")
            .unwrap_err()
            .starts_with("spec.target"));
    }

    fn source() -> SnapshottedVm {
        let vm: VirtualMachine = serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": "db", "labels": {"app": "db", "team/x": "1"},
                "annotations": {"note": "n", "kubectl.kubernetes.io/last-applied-configuration": "{}"}},
            "spec": {"runStrategy": "Halted", "template": {
                "metadata": {"labels": {"kubevirt.io/vm": "db", "tier": "a"}},
                "spec": {"domain": {"devices": {"interfaces": [
                    {"name": "default", "masquerade": {}, "macAddress": "02:00:00:00:00:01"},
                    {"name": "second", "bridge": {}}]},
                    "firmware": {"uuid": "5d307ca9-b3ef-428c-8861-06e72d69f223", "serial": "s1"}},
                 "networks": [{"name": "default", "pod": {}}]}}}}))
        .unwrap();
        SnapshottedVm {
            metadata: vm.metadata,
            spec: vm.spec,
            status: None,
        }
    }

    fn patched(spec: &VirtualMachineCloneSpec) -> Value {
        let src = source();
        let mut doc = json!({"metadata": serde_json::to_value(&src.metadata).unwrap(),
            "spec": serde_json::to_value(&src.spec).unwrap()});
        doc["metadata"]["annotations"]
            .as_object_mut()
            .unwrap()
            .remove("kubectl.kubernetes.io/last-applied-configuration");
        for p in identity_patches(spec, &src).unwrap() {
            let patch = crate::snapshot::parse_json_patch(&p).unwrap();
            json_patch::patch(&mut doc, &patch).unwrap();
        }
        doc
    }

    #[test]
    fn a_clone_gets_its_own_identity() {
        let mut spec: VirtualMachineCloneSpec = serde_json::from_value(json!({
            "source": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": "db"},
            "labelFilters": ["*", "!team/*"],
            "annotationFilters": ["!note"],
            "template": {"labelFilters": ["kubevirt.io/*"]},
            "newMacAddresses": {"second": "02:00:00:00:00:22"}}))
        .unwrap();
        let doc = patched(&spec);
        assert_eq!(doc["metadata"]["labels"], json!({"app": "db"}));
        assert_eq!(doc["metadata"]["annotations"], json!({}));
        assert_eq!(
            doc["spec"]["template"]["metadata"]["labels"],
            json!({"kubevirt.io/vm": "db"})
        );
        let ifaces = &doc["spec"]["template"]["spec"]["domain"]["devices"]["interfaces"];
        assert!(ifaces[0].get("macAddress").is_none(), "{ifaces}");
        assert_eq!(ifaces[1]["macAddress"], "02:00:00:00:00:22");
        let fw = &doc["spec"]["template"]["spec"]["domain"]["firmware"];
        assert_eq!(fw, &json!({}));

        spec.new_smbios_serial = Some("clone-serial".into());
        spec.patches =
            vec![r#"{"op": "replace", "path": "/spec/runStrategy", "value": "Always"}"#.into()];
        let doc = patched(&spec);
        assert_eq!(
            doc["spec"]["template"]["spec"]["domain"]["firmware"]["serial"],
            "clone-serial"
        );
        assert_eq!(doc["spec"]["runStrategy"], "Always");
    }

    #[test]
    fn bad_clones_are_refused_with_the_field() {
        let base =
            json!({"source": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": "db"}});
        let refused = |extra: Value| {
            let mut v = base.clone();
            v.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            let spec: VirtualMachineCloneSpec = serde_json::from_value(v).unwrap();
            identity_patches(&spec, &source()).unwrap_err()
        };
        let why = refused(json!({"newMacAddresses": {"eth9": "02:00:00:00:00:01"}}));
        assert!(
            why.starts_with("spec.newMacAddresses[eth9]") && why.contains("\"default\""),
            "{why}"
        );
        let why = refused(json!({"newMacAddresses": {"default": "nope"}}));
        assert!(
            why.starts_with("spec.newMacAddresses[default]: \"nope\" is not a MAC"),
            "{why}"
        );
        let why = refused(json!({"labelFilters": ["*", ""]}));
        assert!(why.starts_with("spec.labelFilters[1]"), "{why}");
        let why = refused(json!({"patches": ["{not json"]}));
        assert!(why.starts_with("spec.patches[0]"), "{why}");
        let why = refused(json!({"volumeNamePolicy": "InPlace"}));
        assert!(why.starts_with("spec.volumeNamePolicy"), "{why}");
    }
}
