//! What the test API server tells a generic client about itself, as the real one does: the
//! discovery documents (`/api`, `/apis`, `/apis/<group>/<version>`), OpenAPI v3 (`/openapi/v3`
//! and one document per group-version) and `/version`, plus the server-side Table rendering of
//! `kubectl get`. Everything about microvirt's kinds — short names, subresources, schemas,
//! printer columns — is taken from the CRDs virt-controller installs (`controller::crds::all()`),
//! so what kubectl shows here is what it would show against a cluster with those CRDs.

use std::sync::OnceLock;

use jsonpath_rust::JsonPath;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, CustomResourceDefinitionVersion,
};
use serde_json::{json, Value};

use crate::apiserver::resources::ResourceType;

/// The Kubernetes version this server claims (kubectl only compares the minor for its skew
/// warning).
const SERVER_VERSION: (&str, &str) = ("1", "32");

fn crds() -> &'static [CustomResourceDefinition] {
    static CRDS: OnceLock<Vec<CustomResourceDefinition>> = OnceLock::new();
    CRDS.get_or_init(|| {
        let mut all = controller::crds::all();
        all.extend(controller::crds::cdi());
        all.extend(controller::crds::operator());
        all
    })
}

fn crd_of(
    rt: &ResourceType,
) -> Option<(
    &'static CustomResourceDefinition,
    &'static CustomResourceDefinitionVersion,
)> {
    let crd = crds()
        .iter()
        .find(|c| c.spec.group == rt.group && c.spec.names.plural == rt.plural)?;
    let version = crd.spec.versions.iter().find(|v| v.name == rt.version)?;
    Some((crd, version))
}

/// The structural schema (`openAPIV3Schema`) of a kind the server serves from a CRD, as JSON;
/// `None` for built-in kinds.
pub fn schema_of(rt: &ResourceType) -> Option<&'static Value> {
    static SCHEMAS: OnceLock<std::collections::HashMap<String, Value>> = OnceLock::new();
    let all = SCHEMAS.get_or_init(|| {
        crds()
            .iter()
            .flat_map(|c| {
                c.spec.versions.iter().filter_map(move |v| {
                    let schema = v.schema.as_ref()?.open_api_v3_schema.as_ref()?;
                    let key = format!("{}/{}/{}", c.spec.group, v.name, c.spec.names.plural);
                    Some((key, serde_json::to_value(schema).unwrap()))
                })
            })
            .collect()
    });
    all.get(&rt.key())
}

/// Singular name and short names of a built-in kind (the ones this server stores).
fn builtin_names(plural: &str) -> (&'static str, &'static [&'static str]) {
    match plural {
        "pods" => ("pod", &["po"]),
        "nodes" => ("node", &["no"]),
        "namespaces" => ("namespace", &["ns"]),
        "persistentvolumeclaims" => ("persistentvolumeclaim", &["pvc"]),
        "poddisruptionbudgets" => ("poddisruptionbudget", &["pdb"]),
        "events" => ("event", &["ev"]),
        "leases" => ("lease", &[]),
        "controllerrevisions" => ("controllerrevision", &[]),
        "customresourcedefinitions" => ("customresourcedefinition", &["crd", "crds"]),
        "serviceaccounts" => ("serviceaccount", &["sa"]),
        "deployments" => ("deployment", &["deploy"]),
        "daemonsets" => ("daemonset", &["ds"]),
        _ => ("", &[]),
    }
}

/// The verbs this server implements on a resource (no deletecollection).
const VERBS: [&str; 7] = [
    "create", "delete", "get", "list", "patch", "update", "watch",
];

fn api_resources(types: &[ResourceType], group: &str, version: &str) -> Vec<Value> {
    let mut out = vec![];
    for rt in types
        .iter()
        .filter(|t| t.group == group && t.version == version)
    {
        let (singular, short, categories) = match crd_of(rt) {
            Some((crd, _)) => (
                crd.spec.names.singular.clone().unwrap_or_default(),
                crd.spec.names.short_names.clone().unwrap_or_default(),
                crd.spec.names.categories.clone().unwrap_or_default(),
            ),
            None => {
                let (s, short) = builtin_names(rt.plural);
                (
                    s.to_string(),
                    short.iter().map(|s| s.to_string()).collect(),
                    vec![],
                )
            }
        };
        let mut r = json!({
            "name": rt.plural, "singularName": singular, "namespaced": rt.namespaced,
            "kind": rt.kind, "verbs": VERBS,
        });
        if !short.is_empty() {
            r["shortNames"] = json!(short);
        }
        if !categories.is_empty() {
            r["categories"] = json!(categories);
        }
        out.push(r);
        if rt.status_subresource {
            out.push(json!({
                "name": format!("{}/status", rt.plural), "singularName": "",
                "namespaced": rt.namespaced, "kind": rt.kind, "verbs": ["get", "patch", "update"],
            }));
        }
        if rt.scale.is_some() {
            out.push(json!({
                "name": format!("{}/scale", rt.plural), "singularName": "",
                "namespaced": rt.namespaced, "group": "autoscaling", "version": "v1",
                "kind": "Scale", "verbs": ["get", "patch", "update"],
            }));
        }
        if rt.plural == "pods" {
            out.push(json!({
                "name": "pods/eviction", "singularName": "", "namespaced": true,
                "group": "policy", "version": "v1", "kind": "Eviction", "verbs": ["create"],
            }));
        }
    }
    out
}

/// Groups (other than the core group) and their versions, in the order the types list them.
fn groups(types: &[ResourceType]) -> Vec<(&'static str, Vec<&'static str>)> {
    let mut out: Vec<(&'static str, Vec<&'static str>)> = vec![];
    for t in types.iter().filter(|t| !t.group.is_empty()) {
        match out.iter_mut().find(|(g, _)| *g == t.group) {
            Some((_, vs)) if !vs.contains(&t.version) => vs.push(t.version),
            Some(_) => {}
            None => out.push((t.group, vec![t.version])),
        }
    }
    out
}

/// The answer to a discovery, version or OpenAPI request, or None when `path` is not one.
/// `Err` is a 404 with that message (a group-version this server does not serve).
pub fn serve(types: &[ResourceType], path: &str, host: &str) -> Option<Result<Value, String>> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let not_found = || {
        Some(Err(format!(
            "the server could not find the requested resource ({path})"
        )))
    };
    let group_doc = |name: &str, versions: &[&str]| {
        let vs: Vec<Value> = versions
            .iter()
            .map(|v| json!({"groupVersion": format!("{name}/{v}"), "version": v}))
            .collect();
        json!({"name": name, "versions": vs, "preferredVersion": vs[0]})
    };
    let resource_list = |group: &str, version: &str| {
        let resources = api_resources(types, group, version);
        if resources.is_empty() {
            return not_found();
        }
        let gv = if group.is_empty() {
            version.to_string()
        } else {
            format!("{group}/{version}")
        };
        Some(Ok(json!({
            "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv,
            "resources": resources,
        })))
    };
    match segs.as_slice() {
        ["version"] => Some(Ok(json!({
            "major": SERVER_VERSION.0, "minor": SERVER_VERSION.1,
            "gitVersion": format!("v{}.{}.0-microvirt-test", SERVER_VERSION.0, SERVER_VERSION.1),
            "platform": "linux/amd64",
        }))),
        ["api"] => Some(Ok(json!({
            "kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": host}],
        }))),
        ["api", v] => resource_list("", v),
        ["apis"] => Some(Ok(json!({
            "kind": "APIGroupList", "apiVersion": "v1",
            "groups": groups(types).iter().map(|(g, vs)| group_doc(g, vs)).collect::<Vec<_>>(),
        }))),
        ["apis", g] => match groups(types).into_iter().find(|(name, _)| name == g) {
            Some((name, vs)) => {
                let mut doc = group_doc(name, &vs);
                doc["kind"] = json!("APIGroup");
                doc["apiVersion"] = json!("v1");
                Some(Ok(doc))
            }
            None => not_found(),
        },
        ["apis", g, v] => resource_list(g, v),
        ["openapi", "v3"] => {
            let mut paths = serde_json::Map::new();
            for (g, v) in openapi_group_versions(types) {
                let key = if g.is_empty() {
                    format!("api/{v}")
                } else {
                    format!("apis/{g}/{v}")
                };
                let hash = openapi_hash(&openapi_document(types, g, v));
                paths.insert(
                    key.clone(),
                    json!({"serverRelativeURL": format!("/openapi/v3/{key}?hash={hash}")}),
                );
            }
            Some(Ok(json!({"paths": paths})))
        }
        ["openapi", "v3", "api", v] if openapi_group_versions(types).contains(&("", *v)) => {
            Some(Ok(openapi_document(types, "", v)))
        }
        ["openapi", "v3", "apis", g, v] => {
            if openapi_group_versions(types).contains(&(*g, *v)) {
                Some(Ok(openapi_document(types, g, v)))
            } else {
                not_found()
            }
        }
        ["openapi", ..] => not_found(),
        _ => None,
    }
}

/// The group-versions with an OpenAPI document: every one the server stores. (kubectl asks for
/// the document of every kind it validates or applies, built-in ones too.)
fn openapi_group_versions(types: &[ResourceType]) -> Vec<(&'static str, &'static str)> {
    let mut out = vec![];
    for t in types {
        if !out.contains(&(t.group, t.version)) {
            out.push((t.group, t.version));
        }
    }
    out
}

fn openapi_hash(doc: &Value) -> String {
    // FNV-1a of the document: kubectl caches documents by this hash, so it must change with them.
    let mut h: u64 = 0xcbf29ce484222325;
    for b in serde_json::to_vec(doc).unwrap() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100000001b3);
    }
    format!("{h:016X}")
}

/// The OpenAPI name of a CRD's kind, as the API server builds it: the group reversed (the
/// core group's kinds as `io.k8s.api.core`).
fn schema_name(group: &str, version: &str, kind: &str) -> String {
    let group = if group.is_empty() {
        "core.api.k8s.io"
    } else {
        group
    };
    let reversed: Vec<&str> = group.split('.').rev().collect();
    format!("{}.{version}.{kind}", reversed.join("."))
}

/// One group-version's OpenAPI v3 document: for each kind, its schema (the CRD's, with
/// apiVersion, kind and metadata described as the API server adds them) and its list, and the
/// paths with the operations and parameters a client looks for (`fieldValidation` among them,
/// which tells kubectl to leave field validation to the server).
fn openapi_document(types: &[ResourceType], group: &str, version: &str) -> Value {
    let mut schemas = serde_json::Map::new();
    let mut paths = serde_json::Map::new();
    for rt in types
        .iter()
        .filter(|t| t.group == group && t.version == version)
    {
        let gvk = json!([{"group": group, "version": version, "kind": rt.kind}]);
        // A built-in kind's schema is left open: its fields are the real server's to check,
        // and the `fieldValidation` parameter below leaves checking to the server anyway.
        let mut schema = crd_of(rt)
            .and_then(|(_, v)| v.schema.as_ref()?.open_api_v3_schema.as_ref())
            .map(|s| serde_json::to_value(s).unwrap())
            .unwrap_or_else(
                || json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true}),
            );
        let props = schema["properties"].as_object_mut();
        if let Some(props) = props {
            props.insert("apiVersion".into(), json!({"type": "string", "description": "APIVersion defines the versioned schema of this representation of an object. Servers should convert recognized schemas to the latest internal value, and may reject unrecognized values."}));
            props.insert("kind".into(), json!({"type": "string", "description": "Kind is a string value representing the REST resource this object represents. Servers may infer this from the endpoint the client submits requests to. In CamelCase."}));
            props.insert(
                "metadata".into(),
                json!({"type": "object", "description": "Standard object's metadata."}),
            );
        }
        schema["x-kubernetes-group-version-kind"] = gvk.clone();
        let name = schema_name(group, version, rt.kind);
        schemas.insert(name.clone(), schema);
        schemas.insert(
            format!("{name}List"),
            json!({
                "type": "object", "required": ["items"],
                "description": format!("{}List is a list of {}", rt.kind, rt.kind),
                "properties": {
                    "apiVersion": {"type": "string"}, "kind": {"type": "string"},
                    "metadata": {"type": "object"},
                    "items": {"type": "array", "items": {"$ref": format!("#/components/schemas/{name}")}},
                },
                "x-kubernetes-group-version-kind": [{"group": group, "version": version, "kind": format!("{}List", rt.kind)}],
            }),
        );
        let body = json!({"content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{name}")}}}});
        let param = |n: &str| json!({"name": n, "in": "query", "schema": {"type": "string", "uniqueItems": true}});
        let write_params = json!([
            param("dryRun"),
            param("fieldManager"),
            param("fieldValidation")
        ]);
        let op = |action: &str, with_body: bool| {
            let mut o = json!({
                "operationId": format!("{action}{}", rt.kind),
                "x-kubernetes-action": action,
                "x-kubernetes-group-version-kind": {"group": group, "version": version, "kind": rt.kind},
                "responses": {"200": body.clone()},
            });
            if with_body {
                o["requestBody"] = body.clone();
                o["parameters"] = write_params.clone();
            }
            o
        };
        let prefix = if group.is_empty() {
            format!("/api/{version}")
        } else {
            format!("/apis/{group}/{version}")
        };
        let base = if rt.namespaced {
            format!("{prefix}/namespaces/{{namespace}}/{}", rt.plural)
        } else {
            format!("{prefix}/{}", rt.plural)
        };
        paths.insert(
            base.clone(),
            json!({"get": op("list", false), "post": op("post", true)}),
        );
        paths.insert(
            format!("{base}/{{name}}"),
            json!({"get": op("get", false), "put": op("put", true), "patch": op("patch", true),
                   "delete": op("delete", false)}),
        );
    }
    json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes CRD Swagger", "version": "v0.1.0"},
        "paths": paths,
        "components": {"schemas": schemas},
    })
}

/// The fields of `obj` its kind's schema does not know, as the API server's strict decoding
/// names them (`spec.template.spec.domain.foo`, `spec.volumes[0].bar`); metadata is the
/// server's own and not looked at. Built-in kinds are not checked.
pub fn unknown_fields(rt: &ResourceType, obj: &Value) -> Vec<String> {
    let Some(schema) = crd_of(rt)
        .and_then(|(_, v)| v.schema.as_ref())
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .map(|s| serde_json::to_value(s).unwrap())
    else {
        return vec![];
    };
    let mut out = vec![];
    if let Some(m) = obj.as_object() {
        for (k, v) in m {
            if ["apiVersion", "kind", "metadata"].contains(&k.as_str()) {
                continue;
            }
            match schema["properties"].get(k) {
                Some(s) => unknown_below(s, v, k.clone(), &mut out),
                None => out.push(k.clone()),
            }
        }
    }
    out
}

fn unknown_below(schema: &Value, v: &Value, path: String, out: &mut Vec<String>) {
    if schema["x-kubernetes-preserve-unknown-fields"] == json!(true) {
        return;
    }
    match v {
        Value::Object(m) => {
            if let Some(props) = schema["properties"].as_object() {
                for (k, sub) in m {
                    match props.get(k) {
                        Some(s) => unknown_below(s, sub, format!("{path}.{k}"), out),
                        None if schema.get("additionalProperties").is_none() => {
                            out.push(format!("{path}.{k}"))
                        }
                        None => {}
                    }
                }
            } else if let Some(ap) = schema.get("additionalProperties").filter(|a| a.is_object()) {
                for (k, sub) in m {
                    unknown_below(ap, sub, format!("{path}.{k}"), out);
                }
            }
        }
        Value::Array(items) => {
            if let Some(s) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    unknown_below(s, item, format!("{path}[{i}]"), out);
                }
            }
        }
        _ => {}
    }
}

/// Whether the client asked for a `meta.k8s.io` Table (kubectl get does, for the columns).
pub fn wants_table(accept: &str) -> bool {
    accept
        .split(',')
        .next()
        .is_some_and(|first| first.contains("as=Table"))
}

/// `object` or a list rendered as a `meta.k8s.io/v1` Table: Name and the CRD's printer columns
/// (or Name and Age for a kind without them), each cell the first match of the column's
/// JSONPath, `date` columns as the age kubectl shows. `include` is the `includeObject` query
/// parameter (`Metadata` by default, as the server does).
pub fn table(rt: &ResourceType, body: &Value, include: Option<&str>) -> Value {
    let columns: Vec<(String, String, String, String, i32)> = match crd_of(rt) {
        Some((_, v)) if v.additional_printer_columns.as_ref().is_some_and(|c| !c.is_empty()) => v
            .additional_printer_columns
            .as_ref()
            .unwrap()
            .iter()
            .map(|c| {
                (
                    c.name.clone(),
                    c.type_.clone(),
                    c.json_path.clone(),
                    c.description.clone().unwrap_or_default(),
                    c.priority.unwrap_or(0),
                )
            })
            .collect(),
        _ => vec![(
            "Age".into(),
            "date".into(),
            ".metadata.creationTimestamp".into(),
            "CreationTimestamp is a timestamp representing the server time when this object was created.".into(),
            0,
        )],
    };
    let mut defs = vec![json!({
        "name": "Name", "type": "string", "format": "name", "priority": 0,
        "description": "Name must be unique within a namespace.",
    })];
    for (name, ty, _, description, priority) in &columns {
        defs.push(json!({"name": name, "type": ty, "format": "", "description": description, "priority": priority}));
    }
    let objects: Vec<&Value> = match body.get("items").and_then(Value::as_array) {
        Some(items) => items.iter().collect(),
        None => vec![body],
    };
    let rows: Vec<Value> = objects
        .into_iter()
        .map(|obj| {
            let mut cells = vec![obj["metadata"]["name"].clone()];
            for (_, ty, path, _, _) in &columns {
                cells.push(cell(obj, ty, path));
            }
            let mut row = json!({"cells": cells});
            match include {
                Some("None") => {}
                Some("Object") => row["object"] = obj.clone(),
                _ => {
                    row["object"] = json!({
                        "kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                        "metadata": obj["metadata"],
                    })
                }
            }
            row
        })
        .collect();
    let mut metadata = json!({});
    for k in ["resourceVersion", "continue"] {
        if let Some(v) = body["metadata"].get(k) {
            metadata[k] = v.clone();
        }
    }
    json!({
        "kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": metadata,
        "columnDefinitions": defs, "rows": rows,
    })
}

/// One cell: the first value the (Kubernetes-style, `$`-less) JSONPath selects, or null.
fn cell(obj: &Value, ty: &str, path: &str) -> Value {
    let expr = format!("${path}");
    let found = obj
        .query(&expr)
        .ok()
        .and_then(|r| r.first().map(|v| (*v).clone()));
    match (found, ty) {
        (Some(Value::String(ts)), "date") => match ts.parse::<jiff::Timestamp>() {
            Ok(t) => json!(human_age(
                jiff::Timestamp::now().as_second() - t.as_second()
            )),
            Err(_) => json!("<unknown>"),
        },
        (Some(v), _) => v,
        (None, _) => Value::Null,
    }
}

/// An age in kubectl's words (apimachinery's `duration.HumanDuration`): `45s`, `3m20s`, `5h`,
/// `2d3h`, `1y10d`.
pub fn human_age(seconds: i64) -> String {
    if seconds < 0 {
        return "0s".into();
    }
    let (s, m, h) = (seconds, seconds / 60, seconds / 3600);
    if s < 120 {
        format!("{s}s")
    } else if m < 10 {
        if s % 60 == 0 {
            format!("{m}m")
        } else {
            format!("{m}m{}s", s % 60)
        }
    } else if m < 180 {
        format!("{m}m")
    } else if h < 8 {
        if m % 60 == 0 {
            format!("{h}h")
        } else {
            format!("{h}h{}m", m % 60)
        }
    } else if h < 48 {
        format!("{h}h")
    } else if h < 24 * 8 {
        if h % 24 == 0 {
            format!("{}d", h / 24)
        } else {
            format!("{}d{}h", h / 24, h % 24)
        }
    } else if h < 24 * 365 * 2 {
        format!("{}d", h / 24)
    } else if h < 24 * 365 * 8 {
        let days = h / 24 - 365 * (h / 24 / 365);
        if days == 0 {
            format!("{}y", h / 24 / 365)
        } else {
            format!("{}y{days}d", h / 24 / 365)
        }
    } else {
        format!("{}y", h / 24 / 365)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_like_kubectl() {
        for (s, want) in [
            (0, "0s"),
            (119, "119s"),
            (125, "2m5s"),
            (600, "10m"),
            (3 * 3600 + 5 * 60, "3h5m"),
            (30 * 3600, "30h"),
            (3 * 86400 + 3600, "3d1h"),
            (40 * 86400, "40d"),
            (3 * 365 * 86400 + 10 * 86400, "3y10d"),
        ] {
            assert_eq!(human_age(s), want, "{s}s");
        }
    }

    #[test]
    fn printer_columns_follow_the_crd() {
        let rt = crate::apiserver::resources::default_types()
            .into_iter()
            .find(|t| t.plural == "virtualmachines")
            .unwrap();
        let created = jiff::Timestamp::now() - jiff::SignedDuration::from_secs(3 * 3600 + 5 * 60);
        let vm = json!({"metadata": {"name": "testvm", "creationTimestamp": created.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()},
                        "status": {"printableStatus": "Running",
                                   "conditions": [{"type": "Paused", "status": "False"},
                                                  {"type": "Ready", "status": "True"}]}});
        let t = table(
            &rt,
            &json!({"metadata": {"resourceVersion": "7"}, "items": [vm]}),
            None,
        );
        let names: Vec<&str> = t["columnDefinitions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["Name", "Age", "Status", "Ready"]);
        let cells = &t["rows"][0]["cells"];
        assert_eq!(cells[0], "testvm");
        assert_eq!(cells[1], "3h5m");
        assert_eq!(cells[2], "Running");
        assert_eq!(cells[3], "True");
        assert_eq!(t["metadata"]["resourceVersion"], "7");
    }
}
