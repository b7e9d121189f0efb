//! The checked-in CRDs match the types, and carry what kubectl users rely on.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;

/// The file at `relative` (from the repository root) holds `generated`; `UPDATE_CRDS=1`
/// rewrites it, and `how` says how to regenerate it by hand.
fn assert_checked_in(relative: &str, generated: &str, how: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(relative);
    if std::env::var_os("UPDATE_CRDS").is_some() {
        std::fs::write(&path, generated).unwrap();
    }
    let on_disk = std::fs::read_to_string(&path).expect(relative);
    assert!(
        on_disk == generated,
        "{relative} drifted from the api types: run `{how} > {relative}`"
    );
}

#[test]
fn checked_in_crds_match_the_api_types() {
    assert_checked_in(
        "deploy/crds/microvirt.yaml",
        &controller::crds::yaml(),
        "cargo run -p controller -- crds",
    );
}

#[test]
fn checked_in_cdi_crds_match_the_api_types() {
    assert_checked_in(
        "deploy/cdi/datavolume-crd.yaml",
        &controller::crds::cdi_yaml(),
        "cargo run -p controller -- crds --cdi",
    );
}

fn crd(kind: &str) -> CustomResourceDefinition {
    controller::crds::all()
        .into_iter()
        .find(|c| c.spec.names.kind == kind)
        .unwrap()
}

#[test]
fn short_names_subresources_and_columns() {
    let vm = crd("VirtualMachine");
    assert_eq!(vm.spec.group, "kubevirt.io");
    assert_eq!(
        vm.spec.names.short_names.clone().unwrap(),
        vec!["vm", "vms"]
    );
    let v = &vm.spec.versions[0];
    assert!(v.subresources.as_ref().unwrap().status.is_some());
    let cols: Vec<_> = v
        .additional_printer_columns
        .as_ref()
        .unwrap()
        .iter()
        .map(|c| c.name.clone())
        .collect();
    assert_eq!(cols, ["Age", "Status", "Ready"]);

    let vmi = crd("VirtualMachineInstance");
    assert_eq!(
        vmi.spec.names.short_names.clone().unwrap(),
        vec!["vmi", "vmis"]
    );
    let cols: Vec<_> = vmi.spec.versions[0]
        .additional_printer_columns
        .as_ref()
        .unwrap()
        .iter()
        .map(|c| (c.name.clone(), c.priority.unwrap_or(0)))
        .collect();
    // `kubectl get vmi` shows KubeVirt's five columns; `-o wide` adds Live-Migratable.
    let names = ["Age", "Phase", "IP", "NodeName", "Ready", "Live-Migratable"];
    let want: Vec<_> = names
        .iter()
        .map(|n| (n.to_string(), i32::from(*n == "Live-Migratable")))
        .collect();
    assert_eq!(cols, want);

    let rs = crd("VirtualMachineInstanceReplicaSet");
    assert_eq!(
        rs.spec.names.short_names.clone().unwrap(),
        vec!["vmirs", "vmirss"]
    );
    let sub = rs.spec.versions[0].subresources.as_ref().unwrap();
    let scale = sub.scale.as_ref().expect("scale subresource");
    assert_eq!(scale.spec_replicas_path, ".spec.replicas");
    assert_eq!(scale.status_replicas_path, ".status.replicas");
    let cols: Vec<_> = rs.spec.versions[0]
        .additional_printer_columns
        .as_ref()
        .unwrap()
        .iter()
        .map(|c| c.name.clone())
        .collect();
    assert_eq!(cols, ["Desired", "Current", "Ready", "Age"]);

    let mig = crd("VirtualMachineInstanceMigration");
    assert_eq!(
        mig.spec.names.short_names.clone().unwrap(),
        vec!["vmim", "vmims"]
    );
    let cols: Vec<_> = mig.spec.versions[0]
        .additional_printer_columns
        .as_ref()
        .unwrap()
        .iter()
        .map(|c| c.name.clone())
        .collect();
    assert_eq!(cols, ["Phase", "VMI"]);

    let mp = crd("MigrationPolicy");
    assert_eq!(mp.spec.group, "migrations.kubevirt.io");
    assert_eq!(mp.spec.scope, "Cluster");
}

#[test]
fn schemas_keep_unknown_fields_where_users_write_them() {
    let vm = crd("VirtualMachine");
    let schema = serde_json::to_value(&vm.spec.versions[0].schema).unwrap();
    let spec = &schema["openAPIV3Schema"]["properties"]["spec"];
    assert_eq!(
        spec["x-kubernetes-preserve-unknown-fields"],
        serde_json::json!(true),
        "{spec}"
    );
}

/// Kubernetes only accepts structural schemas: every property and array item has a type,
/// unless it is int-or-string or keeps unknown fields.
fn assert_structural(path: &str, s: &serde_json::Value) {
    let typed = s.get("type").is_some()
        || s.get("x-kubernetes-int-or-string") == Some(&serde_json::json!(true))
        || s.get("x-kubernetes-preserve-unknown-fields") == Some(&serde_json::json!(true));
    assert!(typed, "{path}: schema without a type: {s}");
    assert!(
        !(s.get("properties").is_some() && s.get("additionalProperties").is_some()),
        "{path}: properties and additionalProperties together"
    );
    if let Some(props) = s.get("properties").and_then(|p| p.as_object()) {
        for (k, v) in props {
            assert_structural(&format!("{path}.{k}"), v);
        }
    }
    if let Some(items) = s.get("items") {
        assert_structural(&format!("{path}[]"), items);
    }
    if let Some(ap) = s.get("additionalProperties").filter(|a| a.is_object()) {
        assert_structural(&format!("{path}{{}}"), ap);
    }
}

#[test]
fn schemas_are_structural() {
    for crd in controller::crds::all() {
        for v in &crd.spec.versions {
            let schema =
                serde_json::to_value(&v.schema.as_ref().unwrap().open_api_v3_schema).unwrap();
            assert_structural(&crd.spec.names.kind, &schema);
        }
    }
}
