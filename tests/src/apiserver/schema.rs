//! What the real API server does with a custom resource before it stores it, from the CRD's
//! structural schema: a value of the wrong type, or outside an enum, is refused (422 with
//! every offending path); a field the schema does not know is dropped (pruned), unless the
//! schema preserves unknown fields there; a null where the schema does not allow one is
//! dropped too. `metadata` is the server's own and not looked at here.

use serde_json::Value;

/// The outcome for one object: the paths pruned, and the type errors (path, message).
#[derive(Default, Debug)]
pub(crate) struct Conformance {
    pub(crate) pruned: Vec<String>,
    pub(crate) invalid: Vec<String>,
}

/// Prunes `obj` in place against `schema` and collects what does not fit.
pub(crate) fn conform(schema: &Value, obj: &mut Value) -> Conformance {
    let mut c = Conformance::default();
    let Some(m) = obj.as_object_mut() else {
        return c;
    };
    let keys: Vec<String> = m.keys().cloned().collect();
    for k in keys {
        if ["apiVersion", "kind", "metadata"].contains(&k.as_str()) {
            continue;
        }
        match schema["properties"].get(&k) {
            Some(s) => {
                if visit(s, m.get_mut(&k).unwrap(), &k, &mut c) == Keep::Drop {
                    m.remove(&k);
                }
            }
            None => {
                c.pruned.push(k.clone());
                m.remove(&k);
            }
        }
    }
    c
}

#[derive(PartialEq)]
enum Keep {
    Keep,
    Drop,
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_f64() => "number",
        Value::Number(_) => "integer",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn visit(schema: &Value, v: &mut Value, path: &str, c: &mut Conformance) -> Keep {
    if v.is_null() {
        return if schema["nullable"] == Value::Bool(true) {
            Keep::Keep
        } else {
            Keep::Drop
        };
    }
    let got = type_name(v);
    if schema["x-kubernetes-int-or-string"] == Value::Bool(true) {
        if !matches!(got, "integer" | "string") {
            c.invalid.push(format!("{path}: Invalid value: \"{got}\": {path} in body must be of type integer-or-string: {v}"));
        }
        return Keep::Keep;
    }
    if let Some(want) = schema["type"].as_str() {
        let fits = want == got || (want == "number" && got == "integer");
        if !fits {
            c.invalid.push(format!(
                "{path}: Invalid value: \"{got}\": {path} in body must be of type {want}: {v}"
            ));
            return Keep::Keep;
        }
    }
    if let Some(allowed) = schema["enum"].as_array() {
        if !allowed.contains(v) {
            let list: Vec<String> = allowed.iter().map(Value::to_string).collect();
            c.invalid.push(format!(
                "{path}: Unsupported value: {v}: supported values: {}",
                list.join(", ")
            ));
        }
    }
    match v {
        Value::Object(m) => visit_object(schema, m, path, c),
        Value::Array(items) => {
            if let Some(s) = schema.get("items") {
                for (i, item) in items.iter_mut().enumerate() {
                    // An array item is never dropped: a null in a list stays for the type check.
                    visit(s, item, &format!("{path}[{i}]"), c);
                }
            }
        }
        _ => {}
    }
    Keep::Keep
}

fn visit_object(
    schema: &Value,
    m: &mut serde_json::Map<String, Value>,
    path: &str,
    c: &mut Conformance,
) {
    let preserve = schema["x-kubernetes-preserve-unknown-fields"] == Value::Bool(true);
    let props = schema["properties"].as_object();
    let additional = schema.get("additionalProperties").filter(|a| a.is_object());
    let keys: Vec<String> = m.keys().cloned().collect();
    for k in keys {
        let sub = format!("{path}.{k}");
        let field_schema = props.and_then(|p| p.get(&k)).or(additional);
        let keep = match field_schema {
            Some(s) => visit(s, m.get_mut(&k).unwrap(), &sub, c),
            None if preserve || schema.get("additionalProperties") == Some(&Value::Bool(true)) => {
                Keep::Keep
            }
            None => {
                c.pruned.push(sub);
                Keep::Drop
            }
        };
        if keep == Keep::Drop {
            m.remove(&k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema() -> Value {
        json!({"type": "object", "properties": {
            "spec": {"type": "object", "properties": {
                "replicas": {"type": "integer"},
                "running": {"type": "boolean", "nullable": true},
                "strategy": {"type": "string", "enum": ["Always", "Halted"]},
                "size": {"x-kubernetes-int-or-string": true},
                "template": {"type": "object", "x-kubernetes-preserve-unknown-fields": true,
                             "properties": {"name": {"type": "string"}}},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "list": {"type": "array", "items": {"type": "object", "properties": {"a": {"type": "string"}}}}
            }}
        }})
    }

    #[test]
    fn unknown_fields_are_pruned_where_the_schema_does_not_keep_them() {
        let mut o = json!({"apiVersion": "x/v1", "kind": "K", "metadata": {"anything": 1},
            "spec": {"replicas": 1, "mystery": true, "running": null, "size": "1Gi",
                     "template": {"name": "t", "kept": 1}, "labels": {"a": "b"},
                     "list": [{"a": "x", "b": 2}]},
            "extra": 1});
        let mut c = conform(&schema(), &mut o);
        c.pruned.sort();
        assert_eq!(c.pruned, ["extra", "spec.list[0].b", "spec.mystery"]);
        assert!(c.invalid.is_empty(), "{:?}", c.invalid);
        assert_eq!(o["spec"]["template"]["kept"], 1);
        assert_eq!(o["spec"]["running"], Value::Null, "nullable: kept");
        assert!(o.get("extra").is_none() && o["spec"].get("mystery").is_none());
        assert_eq!(o["metadata"]["anything"], 1);
    }

    #[test]
    fn wrong_types_and_enum_strangers_are_named_by_path() {
        let mut o = json!({"spec": {"replicas": "3", "strategy": "Sometimes", "size": true,
                                    "labels": {"a": 1}, "running": 1}});
        let c = conform(&schema(), &mut o);
        let text = c.invalid.join("\n");
        for p in [
            "spec.replicas: Invalid value: \"string\"",
            "spec.strategy: Unsupported value: \"Sometimes\"",
            "spec.size: Invalid value: \"boolean\"",
            "spec.labels.a: Invalid value: \"integer\"",
            "spec.running: Invalid value: \"integer\"",
        ] {
            assert!(text.contains(p), "{p} in\n{text}");
        }
    }
}
