//! No silent drops: every field path of the schemas microvirt serves (generated from the `api`
//! types) is honoured, refused, or accepted with a warning — a path in none of the lists fails
//! here, so a new field cannot be added without deciding what it does.

use api::fields::{treatment, VMI_SPEC, VM_SPEC};
use serde_json::Value;

fn walk(v: &Value, defs: &Value, p: &str, out: &mut Vec<String>, depth: usize) {
    if depth > 14 {
        return;
    }
    let mut v = v.clone();
    if let Some(r) = v.get("$ref").and_then(|r| r.as_str()) {
        v = defs[r.rsplit('/').next().unwrap()].clone();
    }
    for key in ["anyOf", "oneOf", "allOf"] {
        if let Some(a) = v.get(key).and_then(|a| a.as_array()) {
            for x in a {
                walk(x, defs, p, out, depth + 1);
            }
        }
    }
    if let Some(props) = v.get("properties").and_then(|p| p.as_object()) {
        for (k, sub) in props {
            let q = if p.is_empty() {
                k.clone()
            } else {
                format!("{p}.{k}")
            };
            out.push(q.clone());
            walk(sub, defs, &q, out, depth + 1);
        }
    }
    if let Some(items) = v.get("items") {
        walk(items, defs, &format!("{p}[]"), out, depth + 1);
    }
}

fn paths<T: schemars::JsonSchema>() -> Vec<String> {
    let v = serde_json::to_value(schemars::schema_for!(T)).unwrap();
    let defs = v.get("$defs").cloned().unwrap_or_default();
    let mut out = vec![];
    walk(&v, &defs, "", &mut out, 0);
    out.sort();
    out.dedup();
    out
}

#[test]
fn every_schema_path_is_honoured_refused_or_warned() {
    let vmi = paths::<api::VirtualMachineInstanceSpec>();
    assert!(vmi.len() > 150, "the walk found the schema: {}", vmi.len());
    let missing: Vec<&String> = vmi
        .iter()
        .filter(|p| treatment(VMI_SPEC, p).is_none())
        .collect();
    assert!(missing.is_empty(), "VMI spec paths in no list: {missing:?}");
    let vm: Vec<String> = paths::<api::VirtualMachineSpec>()
        .into_iter()
        .filter(|p| !p.starts_with("template.spec."))
        .collect();
    let missing: Vec<&String> = vm
        .iter()
        .filter(|p| treatment(VM_SPEC, p).is_none())
        .collect();
    assert!(missing.is_empty(), "VM spec paths in no list: {missing:?}");
}
