//! Label and field selectors, parsed and matched as the API server does.

use serde_json::Value;

use super::errors::{ApiError, ApiResult};
use super::json::{get_path, meta, meta_str};

#[derive(Debug, Clone)]
pub(crate) enum LabelReq {
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// Splits on commas that are not inside parentheses.
pub(crate) fn split_terms(s: &str) -> Vec<String> {
    let mut out = vec![];
    let mut depth = 0;
    let mut cur = String::new();
    for c in s.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    if !cur.trim().is_empty() {
        out.push(cur);
    }
    out
}

pub(crate) fn parse_label_selector(s: &str) -> ApiResult<Vec<LabelReq>> {
    let bad = || {
        ApiError::new(
            400,
            "BadRequest",
            format!("unable to parse labelSelector {s:?}"),
        )
    };
    let set = |v: &str| -> ApiResult<Vec<String>> {
        let v = v.trim();
        let inner = v
            .strip_prefix('(')
            .and_then(|v| v.strip_suffix(')'))
            .ok_or_else(bad)?;
        Ok(inner.split(',').map(|x| x.trim().to_string()).collect())
    };
    split_terms(s)
        .iter()
        .map(|t| {
            let t = t.trim();
            if let Some((k, v)) = t.split_once(" notin ") {
                Ok(LabelReq::NotIn(k.trim().into(), set(v)?))
            } else if let Some((k, v)) = t.split_once(" in ") {
                Ok(LabelReq::In(k.trim().into(), set(v)?))
            } else if let Some((k, v)) = t.split_once("!=") {
                Ok(LabelReq::Ne(k.trim().into(), v.trim().into()))
            } else if let Some((k, v)) = t.split_once("==").or_else(|| t.split_once('=')) {
                Ok(LabelReq::Eq(k.trim().into(), v.trim().into()))
            } else if let Some(k) = t.strip_prefix('!') {
                Ok(LabelReq::NotExists(k.trim().into()))
            } else if !t.is_empty() && !t.contains(' ') {
                Ok(LabelReq::Exists(t.into()))
            } else {
                Err(bad())
            }
        })
        .collect()
}

pub(crate) fn labels_match(obj: &Value, reqs: &[LabelReq]) -> bool {
    let labels = meta(obj).get("labels");
    let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
    reqs.iter().all(|r| match r {
        LabelReq::Eq(k, v) => get(k) == Some(v),
        LabelReq::Ne(k, v) => get(k) != Some(v),
        LabelReq::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
        LabelReq::NotIn(k, vs) => !get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
        LabelReq::Exists(k) => get(k).is_some(),
        LabelReq::NotExists(k) => get(k).is_none(),
    })
}

/// Field selector terms: (path, wanted value, equal?).
pub(crate) fn parse_field_selector(s: &str) -> ApiResult<Vec<(String, String, bool)>> {
    s.split(',')
        .filter(|t| !t.trim().is_empty())
        .map(|t| {
            if let Some((k, v)) = t.split_once("!=") {
                Ok((k.trim().into(), v.trim().into(), false))
            } else if let Some((k, v)) = t.split_once("==").or_else(|| t.split_once('=')) {
                Ok((k.trim().into(), v.trim().into(), true))
            } else {
                Err(ApiError::new(
                    400,
                    "BadRequest",
                    format!("invalid fieldSelector term {t:?}"),
                ))
            }
        })
        .collect()
}

pub(crate) fn fields_match(obj: &Value, reqs: &[(String, String, bool)]) -> bool {
    reqs.iter().all(|(path, want, eq)| {
        let got = match get_path(obj, path) {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Null) | None => String::new(),
            Some(v) => v.to_string(),
        };
        (got == *want) == *eq
    })
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Filter {
    pub(crate) namespace: Option<String>,
    pub(crate) labels: Vec<LabelReq>,
    pub(crate) fields: Vec<(String, String, bool)>,
}

impl Filter {
    pub(crate) fn matches(&self, obj: &Value) -> bool {
        if let Some(ns) = &self.namespace {
            if meta_str(obj, "namespace") != Some(ns) {
                return false;
            }
        }
        labels_match(obj, &self.labels) && fields_match(obj, &self.fields)
    }
}

/// Whether the real API server selects `kind` on field `path`: every kind on its name and
/// namespace, the built-in kinds on the fields their registries add, custom resources on
/// nothing else (no CRD here declares selectableFields).
pub(crate) fn selectable_field(kind: &str, path: &str) -> bool {
    if matches!(path, "metadata.name" | "metadata.namespace") {
        return true;
    }
    let extra: &[&str] = match kind {
        "Pod" => &[
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "spec.hostNetwork",
            "status.phase",
            "status.podIP",
            "status.podIPs",
            "status.nominatedNodeName",
        ],
        "Node" => &["spec.unschedulable"],
        "Namespace" => &["status.phase"],
        "Secret" => &["type"],
        "ReplicaSet" | "ReplicationController" => &["status.replicas"],
        "Event" => &[
            "involvedObject.kind",
            "involvedObject.namespace",
            "involvedObject.name",
            "involvedObject.uid",
            "involvedObject.apiVersion",
            "involvedObject.resourceVersion",
            "involvedObject.fieldPath",
            "reason",
            "reportingComponent",
            "source",
            "type",
            "regarding.kind",
            "regarding.namespace",
            "regarding.name",
            "regarding.uid",
        ],
        _ => &[],
    };
    extra.contains(&path)
}
