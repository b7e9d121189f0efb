//! Server-side apply (`PATCH` with `application/apply-patch+yaml`, `kubectl apply
//! --server-side`), with field ownership in `metadata.managedFields` as the real server keeps
//! it (FieldsV1). Each manager owns the fields it last applied: applying again sets them,
//! removes those it applied before and no longer does (unless another manager owns them
//! too), and a field another manager owns with another value is a conflict (409) unless
//! `force=true`, which takes it over.
//!
//! Lists are atomic here: a list is one field, owned and replaced whole. That is what the
//! real server does for a CRD's lists without `x-kubernetes-list-type` (all of microvirt's);
//! built-in kinds' associative lists (a Pod's containers by name) would merge by key there.
//! Writes other than apply do not record ownership.

use std::collections::BTreeSet;

use serde_json::{json, Map, Value};

/// A field: its path of object keys from the root.
pub(crate) type Field = Vec<String>;

/// The fields an applied configuration sets: its leaves (scalars, lists, empty objects),
/// without what names the object (apiVersion, kind, metadata.name and .namespace).
pub(crate) fn fields_of(applied: &Value) -> BTreeSet<Field> {
    let mut out = BTreeSet::new();
    walk(applied, &mut vec![], &mut out);
    out.retain(|f| {
        // The root itself is no field (an empty or non-object body applies nothing).
        !f.is_empty()
            && !matches!(
                f.iter().map(String::as_str).collect::<Vec<_>>().as_slice(),
                ["apiVersion"]
                    | ["kind"]
                    | ["metadata", "name"]
                    | ["metadata", "namespace"]
                    | ["metadata", "managedFields", ..]
                    | ["metadata", "resourceVersion"]
            )
    });
    out
}

fn walk(v: &Value, at: &mut Vec<String>, out: &mut BTreeSet<Field>) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, sub) in m {
                at.push(k.clone());
                walk(sub, at, out);
                at.pop();
            }
        }
        _ => {
            out.insert(at.clone());
        }
    }
}

/// FieldsV1 (`{"f:spec": {"f:running": {}}}`) of a set of fields.
pub(crate) fn to_fields_v1(fields: &BTreeSet<Field>) -> Value {
    let mut root = Map::new();
    for f in fields {
        let mut node = &mut root;
        for k in f {
            node = node
                .entry(format!("f:{k}"))
                .or_insert_with(|| json!({}))
                .as_object_mut()
                .expect("FieldsV1 nodes are objects");
        }
    }
    Value::Object(root)
}

/// The set of fields of a FieldsV1 value (the leaves of its `f:` tree).
pub(crate) fn from_fields_v1(v: &Value) -> BTreeSet<Field> {
    fn go(v: &Value, at: &mut Vec<String>, out: &mut BTreeSet<Field>) {
        let keys: Vec<(&String, &Value)> = v
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(k, _)| k.starts_with("f:"))
            .collect();
        if keys.is_empty() {
            if !at.is_empty() {
                out.insert(at.clone());
            }
            return;
        }
        for (k, sub) in keys {
            at.push(k[2..].to_string());
            go(sub, at, out);
            at.pop();
        }
    }
    let mut out = BTreeSet::new();
    go(v, &mut vec![], &mut out);
    out
}

fn get<'a>(v: &'a Value, f: &[String]) -> Option<&'a Value> {
    f.iter().try_fold(v, |v, k| v.get(k))
}

fn set(v: &mut Value, f: &[String], value: Value) {
    if f.is_empty() {
        return;
    }
    let mut node = v;
    for k in &f[..f.len() - 1] {
        if !node.get(k).is_some_and(Value::is_object) {
            node[k] = json!({});
        }
        node = node.get_mut(k).unwrap();
    }
    node[f[f.len() - 1].as_str()] = value;
}

fn remove(v: &mut Value, f: &[String]) {
    let Some((last, parents)) = f.split_last() else {
        return;
    };
    let mut node = v;
    for k in parents {
        match node.get_mut(k) {
            Some(n) => node = n,
            None => return,
        }
    }
    if let Some(m) = node.as_object_mut() {
        m.remove(last);
    }
}

fn path(f: &Field) -> String {
    format!(".{}", f.join("."))
}

/// Each manager's fields, from `metadata.managedFields` (apply entries).
fn owners(obj: &Value) -> Vec<(String, BTreeSet<Field>)> {
    obj["metadata"]["managedFields"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["operation"] == "Apply")
        .map(|e| {
            (
                e["manager"].as_str().unwrap_or_default().to_string(),
                from_fields_v1(&e["fieldsV1"]),
            )
        })
        .collect()
}

/// Applies `applied` for `manager` to `current` (None: the object does not exist yet).
/// Returns the object to store, or the conflicts (409's message).
pub(crate) fn apply(
    current: Option<&Value>,
    applied: &Value,
    manager: &str,
    force: bool,
    api_version: &str,
    now: &str,
) -> Result<Value, String> {
    let mine = fields_of(applied);
    let mut result = current.cloned().unwrap_or_else(|| {
        json!({"apiVersion": applied["apiVersion"], "kind": applied["kind"],
               "metadata": {"name": applied["metadata"]["name"]}})
    });
    let mut others = owners(&result);
    let before: BTreeSet<Field> = others
        .iter()
        .find(|(m, _)| m == manager)
        .map(|(_, f)| f.clone())
        .unwrap_or_default();
    others.retain(|(m, _)| m != manager);
    let conflicts: Vec<(String, Field)> = others
        .iter()
        .flat_map(|(m, fs)| fs.iter().map(move |f| (m.clone(), f.clone())))
        .filter(|(_, f)| mine.contains(f) && get(&result, f) != get(applied, f))
        .collect();
    if !conflicts.is_empty() && !force {
        let list: Vec<String> = conflicts
            .iter()
            .map(|(m, f)| format!("conflict with \"{m}\": {}", path(f)))
            .collect();
        return Err(format!(
            "Apply failed with {} conflict{}: {}",
            conflicts.len(),
            if conflicts.len() == 1 { "" } else { "s" },
            list.join(", ")
        ));
    }
    // Forced: the others lose the fields they disagreed on (a field applied with the same
    // value stays shared).
    for (m, fs) in &mut others {
        fs.retain(|f| !conflicts.iter().any(|(cm, cf)| cm == m && cf == f));
    }
    // What this manager no longer applies goes, unless someone else still owns it.
    for f in before.difference(&mine) {
        if !others.iter().any(|(_, fs)| fs.contains(f)) {
            remove(&mut result, f);
        }
    }
    for f in &mine {
        set(
            &mut result,
            f,
            get(applied, f).cloned().unwrap_or(Value::Null),
        );
    }
    let mut entries: Vec<Value> = others
        .into_iter()
        .filter(|(_, fs)| !fs.is_empty())
        .map(|(m, fs)| entry(&m, &fs, api_version, now))
        .collect();
    entries.push(entry(manager, &mine, api_version, now));
    result["metadata"]["managedFields"] = Value::Array(entries);
    Ok(result)
}

fn entry(manager: &str, fields: &BTreeSet<Field>, api_version: &str, now: &str) -> Value {
    json!({"manager": manager, "operation": "Apply", "apiVersion": api_version, "time": now,
           "fieldsType": "FieldsV1", "fieldsV1": to_fields_v1(fields)})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn applied(spec: Value) -> Value {
        json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
               "metadata": {"name": "v", "labels": {"app": "a"}}, "spec": spec})
    }

    #[test]
    fn a_body_without_fields_applies_nothing() {
        assert!(fields_of(&json!({})).is_empty());
        assert!(fields_of(&json!([1, 2])).is_empty());
        let now = "2026-01-01T00:00:00Z";
        assert!(apply(None, &json!("x"), "m", false, "v1", now).is_ok());
    }

    #[test]
    fn fields_round_trip_through_fields_v1() {
        let f = fields_of(&applied(
            json!({"running": true, "template": {"spec": {"x": [1, 2]}}}),
        ));
        let names: Vec<String> = f.iter().map(path).collect();
        assert_eq!(
            names,
            [
                ".metadata.labels.app",
                ".spec.running",
                ".spec.template.spec.x"
            ]
        );
        assert_eq!(from_fields_v1(&to_fields_v1(&f)), f);
    }

    #[test]
    fn a_manager_sets_what_it_applies_and_removes_what_it_dropped() {
        let now = "2026-01-01T00:00:00Z";
        let a = apply(
            None,
            &applied(json!({"running": true, "extra": 1})),
            "kubectl",
            false,
            "kubevirt.io/v1",
            now,
        )
        .unwrap();
        assert_eq!(
            (a["spec"]["running"].clone(), a["spec"]["extra"].clone()),
            (json!(true), json!(1))
        );
        let b = apply(
            Some(&a),
            &applied(json!({"running": false})),
            "kubectl",
            false,
            "kubevirt.io/v1",
            now,
        )
        .unwrap();
        assert_eq!(
            b["spec"],
            json!({"running": false}),
            "extra no longer applied: gone"
        );
        assert_eq!(b["metadata"]["managedFields"].as_array().unwrap().len(), 1);
    }

    #[test]
    fn another_managers_field_conflicts_unless_forced() {
        let now = "2026-01-01T00:00:00Z";
        let a = apply(
            None,
            &applied(json!({"running": true})),
            "alice",
            false,
            "v1",
            now,
        )
        .unwrap();
        let same = apply(
            Some(&a),
            &applied(json!({"running": true})),
            "bob",
            false,
            "v1",
            now,
        );
        assert!(
            same.is_ok(),
            "the same value is shared ownership, no conflict"
        );
        let e = apply(
            Some(&a),
            &applied(json!({"running": false})),
            "bob",
            false,
            "v1",
            now,
        )
        .unwrap_err();
        assert_eq!(
            e,
            "Apply failed with 1 conflict: conflict with \"alice\": .spec.running"
        );
        let forced = apply(
            Some(&a),
            &applied(json!({"running": false})),
            "bob",
            true,
            "v1",
            now,
        )
        .unwrap();
        assert_eq!(forced["spec"]["running"], json!(false));
        let alice = owners(&forced)
            .into_iter()
            .find(|(m, _)| m == "alice")
            .unwrap()
            .1;
        assert!(!alice.contains(&vec!["spec".to_string(), "running".to_string()]));
    }
}
