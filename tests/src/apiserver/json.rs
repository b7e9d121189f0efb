//! Paths into JSON objects, their metadata, and JSON merge patch (RFC 7386).

use serde_json::{json, Map, Value};

pub(crate) fn get_path<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(v, |v, k| v.get(k))
}

pub(crate) fn set_path(v: &mut Value, path: &str, value: Value) {
    let mut cur = v;
    let parts: Vec<&str> = path.split('.').collect();
    for k in &parts[..parts.len() - 1] {
        if !cur.get(*k).is_some_and(Value::is_object) {
            cur[*k] = json!({});
        }
        cur = cur.get_mut(*k).unwrap();
    }
    cur[parts[parts.len() - 1]] = value;
}

pub(crate) fn meta(v: &Value) -> &Value {
    v.get("metadata").unwrap_or(&Value::Null)
}

pub(crate) fn meta_str<'a>(v: &'a Value, field: &str) -> Option<&'a str> {
    meta(v).get(field).and_then(Value::as_str)
}

pub(crate) fn has_finalizers(v: &Value) -> bool {
    meta(v)
        .get("finalizers")
        .and_then(Value::as_array)
        .is_some_and(|f| !f.is_empty())
}

/// RFC 7386 JSON merge patch.
pub(crate) fn merge_patch(target: &mut Value, patch: &Value) {
    if let Value::Object(p) = patch {
        if !target.is_object() {
            *target = Value::Object(Map::new());
        }
        let t = target.as_object_mut().unwrap();
        for (k, v) in p {
            if v.is_null() {
                t.remove(k);
            } else {
                merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
    } else {
        *target = patch.clone();
    }
}
