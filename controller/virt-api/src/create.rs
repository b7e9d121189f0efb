//! `virtctl create vm`: a VirtualMachine manifest from flags, as KubeVirt's virtctl writes it
//! (`--instancetype`, `--preference`, `--volume-containerdisk`, `--volume-pvc`,
//! `--volume-datasource`, `--cloud-init-user-data`), checked by the same validation the
//! webhook runs, so what it prints is what `kubectl apply` accepts.

use std::collections::BTreeMap;

use api::VirtualMachine;
use serde_json::{json, Value};

/// What the flags say (virtctl parses them straight into this).
#[derive(Clone, Debug, Default, clap::Args)]
pub struct VmFlags {
    /// The VM's name (default: vm-<random>).
    #[arg(long, default_value_t = random_vm_name(), hide_default_value = true)]
    pub name: String,
    #[arg(long, default_value = "Always")]
    pub run_strategy: String,
    #[arg(long, default_value_t = 180)]
    pub termination_grace_period: i64,
    /// Guest memory, when no instance type sizes the VM (default 512Mi).
    #[arg(long)]
    pub memory: Option<String>,
    /// `[kind/]name` (kind default: VirtualMachineClusterInstancetype).
    #[arg(long)]
    pub instancetype: Option<String>,
    /// `[kind/]name` (kind default: VirtualMachineClusterPreference).
    #[arg(long)]
    pub preference: Option<String>,
    /// `src:IMAGE[,name:NAME]`; repeatable.
    #[arg(long = "volume-containerdisk")]
    pub container_disks: Vec<String>,
    /// `src:CLAIM[,name:NAME]`; repeatable.
    #[arg(long = "volume-pvc")]
    pub pvcs: Vec<String>,
    /// `src:[NAMESPACE/]DATASOURCE[,name:NAME][,size:SIZE]`; repeatable.
    #[arg(long = "volume-datasource")]
    pub data_sources: Vec<String>,
    /// The cloud-init user data, base64-encoded.
    #[arg(long)]
    pub cloud_init_user_data: Option<String>,
}

/// `vm-` and five hex digits from the clock, as virtctl names a VM it is not given a name for.
fn random_vm_name() -> String {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    format!("vm-{:05x}", n & 0xfffff)
}

/// `key:value,key:value` as KubeVirt's volume flags take it; a value may hold ':' (an image
/// tag), a key may not. Keys outside `allowed` are refused, naming the flag.
fn params(flag: &str, text: &str, allowed: &[&str]) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    for part in text.split(',') {
        let Some((k, v)) = part.split_once(':') else {
            return Err(format!(
                "--{flag} {text:?}: {part:?} is not key:value (keys: {})",
                allowed.join(", ")
            ));
        };
        if !allowed.contains(&k) {
            return Err(format!(
                "--{flag} {text:?}: unknown key {k:?} (keys: {})",
                allowed.join(", ")
            ));
        }
        if v.is_empty() {
            return Err(format!("--{flag} {text:?}: {k} is empty"));
        }
        out.insert(k.to_string(), v.to_string());
    }
    if !out.contains_key("src") {
        return Err(format!("--{flag} {text:?}: src is required"));
    }
    Ok(out)
}

/// `[kind/]name` with `default_kind`.
fn matcher(text: &str, default_kind: &str) -> Value {
    match text.split_once('/') {
        Some((kind, name)) => json!({"kind": kind, "name": name}),
        None => json!({"kind": default_kind, "name": text}),
    }
}

/// The manifest, as KubeVirt's `create vm` lays it out.
pub fn vm_manifest(f: &VmFlags) -> Result<VirtualMachine, String> {
    let mut volumes: Vec<Value> = Vec::new();
    let mut templates: Vec<Value> = Vec::new();
    let mut n = 0;
    let mut next_name = |given: Option<&String>, prefix: &str| {
        n += 1;
        given
            .cloned()
            .unwrap_or_else(|| format!("{}-{prefix}-{n}", f.name))
    };
    for c in &f.container_disks {
        let p = params("volume-containerdisk", c, &["src", "name"])?;
        let name = next_name(p.get("name"), "containerdisk");
        volumes.push(json!({"name": name, "containerDisk": {"image": p["src"]}}));
    }
    for c in &f.pvcs {
        let p = params("volume-pvc", c, &["src", "name"])?;
        let name = next_name(p.get("name"), "pvc");
        volumes.push(json!({"name": name, "persistentVolumeClaim": {"claimName": p["src"]}}));
    }
    for c in &f.data_sources {
        let p = params("volume-datasource", c, &["src", "name", "size"])?;
        let name = next_name(p.get("name"), "ds");
        let (ns, source) = match p["src"].split_once('/') {
            Some((ns, s)) => (Some(ns.to_string()), s.to_string()),
            None => (None, p["src"].clone()),
        };
        let mut source_ref = json!({"kind": "DataSource", "name": source});
        if let Some(ns) = ns {
            source_ref["namespace"] = json!(ns);
        }
        let mut storage = json!({});
        if let Some(size) = p.get("size") {
            storage = json!({"resources": {"requests": {"storage": size}}});
        }
        templates.push(json!({"metadata": {"name": name},
            "spec": {"sourceRef": source_ref, "storage": storage}}));
        volumes.push(json!({"name": name, "dataVolume": {"name": name}}));
    }
    if let Some(data) = &f.cloud_init_user_data {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD
            .decode(data)
            .map_err(|e| {
                format!(
                    "--cloud-init-user-data: not base64 ({e}); give the user data base64-encoded"
                )
            })?;
        volumes
            .push(json!({"name": "cloudinitdisk", "cloudInitNoCloud": {"userDataBase64": data}}));
    }
    let mut domain = json!({"devices": {}});
    if f.instancetype.is_none() {
        domain["memory"] = json!({"guest": f.memory.as_deref().unwrap_or("512Mi")});
    } else if f.memory.is_some() {
        return Err(
            "--memory and --instancetype go apart: the instance type sizes the VM's memory".into(),
        );
    }
    let mut spec = json!({
        "runStrategy": f.run_strategy,
        "template": {"spec": {
            "domain": domain,
            "terminationGracePeriodSeconds": f.termination_grace_period,
            "volumes": volumes,
        }},
    });
    if let Some(it) = &f.instancetype {
        spec["instancetype"] = matcher(it, "VirtualMachineClusterInstancetype");
    }
    if let Some(p) = &f.preference {
        spec["preference"] = matcher(p, "VirtualMachineClusterPreference");
    }
    if !templates.is_empty() {
        spec["dataVolumeTemplates"] = json!(templates);
    }
    let doc = json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": f.name},
        "spec": spec,
    });
    let vm: VirtualMachine =
        serde_json::from_value(doc).map_err(|e| format!("the manifest does not parse: {e}"))?;
    api::validation::validate_vm(&vm).map_err(|e| e.to_string())?;
    Ok(vm)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags() -> VmFlags {
        VmFlags {
            name: "web".into(),
            run_strategy: "Always".into(),
            termination_grace_period: 180,
            ..Default::default()
        }
    }

    #[test]
    fn container_disk_and_cloud_init() {
        let mut f = flags();
        f.container_disks = vec!["src:quay.io/containerdisks/fedora:40,name:root".into()];
        f.cloud_init_user_data = Some("I2Nsb3VkLWNvbmZpZwo=".into());
        let vm = vm_manifest(&f).unwrap();
        let v = serde_json::to_value(&vm).unwrap();
        assert_eq!(v["spec"]["runStrategy"], "Always");
        let volumes = &v["spec"]["template"]["spec"]["volumes"];
        assert_eq!(volumes[0]["name"], "root");
        assert_eq!(
            volumes[0]["containerDisk"]["image"],
            "quay.io/containerdisks/fedora:40"
        );
        assert_eq!(
            volumes[1]["cloudInitNoCloud"]["userDataBase64"],
            "I2Nsb3VkLWNvbmZpZwo="
        );
        assert_eq!(
            v["spec"]["template"]["spec"]["domain"]["memory"]["guest"],
            "512Mi"
        );
    }

    #[test]
    fn instancetype_preference_and_data_source() {
        let mut f = flags();
        f.instancetype = Some("u1.medium".into());
        f.preference = Some("VirtualMachinePreference/fedora".into());
        f.data_sources = vec!["src:os-images/fedora,size:10Gi".into()];
        let v = serde_json::to_value(vm_manifest(&f).unwrap()).unwrap();
        assert_eq!(
            v["spec"]["instancetype"]["kind"],
            "VirtualMachineClusterInstancetype"
        );
        assert_eq!(v["spec"]["preference"]["kind"], "VirtualMachinePreference");
        assert!(v["spec"]["template"]["spec"]["domain"]["memory"].is_null());
        let dv = &v["spec"]["dataVolumeTemplates"][0];
        assert_eq!(dv["metadata"]["name"], "web-ds-1");
        assert_eq!(dv["spec"]["sourceRef"]["namespace"], "os-images");
        assert_eq!(
            dv["spec"]["storage"]["resources"]["requests"]["storage"],
            "10Gi"
        );
    }

    #[test]
    fn bad_flags_say_which_and_why() {
        let mut f = flags();
        f.container_disks = vec!["image:x".into()];
        let e = vm_manifest(&f).unwrap_err();
        assert!(
            e.contains("--volume-containerdisk") && e.contains("unknown key \"image\""),
            "{e}"
        );
        let mut f = flags();
        f.cloud_init_user_data = Some("not base64!".into());
        assert!(vm_manifest(&f)
            .unwrap_err()
            .contains("--cloud-init-user-data"));
        let mut f = flags();
        f.instancetype = Some("u1.small".into());
        f.memory = Some("1Gi".into());
        assert!(vm_manifest(&f)
            .unwrap_err()
            .contains("--memory and --instancetype"));
        let mut f = flags();
        f.run_strategy = "Sometimes".into();
        assert!(vm_manifest(&f).is_err());
    }
}
