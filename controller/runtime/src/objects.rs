//! Writing objects the way a reconciler must: every write guarded by the resourceVersion it
//! was computed from (a stale read is a 409, retried with a fresh one, never a lost update),
//! owners and finalizers set as the garbage collector expects, and deletes that tolerate an
//! object already gone.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Resource, ResourceExt};

pub fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

pub fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// A controller owner reference to `owner` (blocks the owner's foreground deletion).
pub fn controller_ref<K: Resource<DynamicType = ()>>(owner: &K) -> Option<OwnerReference> {
    let mut r = owner.controller_owner_ref(&())?;
    r.block_owner_deletion = Some(true);
    Some(r)
}

/// Whether `obj` is controlled by the object with this uid.
pub fn controlled_by<K: Resource>(obj: &K, uid: &str) -> bool {
    obj.owner_references()
        .iter()
        .any(|r| r.controller == Some(true) && r.uid == uid)
}

/// A merge patch that adds or removes a finalizer, guarded by the resourceVersion it was
/// computed from so that a concurrent change is a conflict rather than a lost finalizer.
pub fn finalizer_patch<K: Resource>(obj: &K, finalizer: &str, present: bool) -> serde_json::Value {
    let mut f: Vec<String> = obj
        .finalizers()
        .iter()
        .filter(|x| *x != finalizer)
        .cloned()
        .collect();
    if present {
        f.push(finalizer.to_string());
    }
    serde_json::json!({
        "metadata": {"finalizers": f, "resourceVersion": obj.resource_version()}
    })
}

pub fn has_finalizer<K: Resource>(obj: &K, finalizer: &str) -> bool {
    obj.finalizers().iter().any(|f| f == finalizer)
}

/// Replaces `status` (PUT …/status, guarded by the object's resourceVersion) when it differs
/// from what the object has; a stale read is a conflict, retried by the error policy.
pub async fn write_status<K>(api: &Api<K>, obj: &K, status: K::Status) -> Result<K, kube::Error>
where
    K: kube::core::object::HasStatus
        + Resource
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
    K::Status: PartialEq,
{
    if obj.status() == Some(&status) {
        return Ok(obj.clone());
    }
    let mut new = obj.clone();
    *new.status_mut() = Some(status);
    api.replace_status(&obj.name_any(), &PostParams::default(), &new)
        .await
}

/// Sets the object's labels to `labels` with a merge patch guarded by its resourceVersion
/// (labels it had and `labels` lacks are removed); returns the object as written.
pub async fn write_labels<K>(
    api: &Api<K>,
    obj: &K,
    labels: &BTreeMap<String, String>,
) -> Result<K, kube::Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    if labels == obj.labels() {
        return Ok(obj.clone());
    }
    let mut l: serde_json::Map<String, serde_json::Value> = labels
        .iter()
        .map(|(k, v)| (k.clone(), v.clone().into()))
        .collect();
    for k in obj.labels().keys().filter(|k| !labels.contains_key(*k)) {
        l.insert(k.clone(), serde_json::Value::Null);
    }
    let p =
        serde_json::json!({"metadata": {"labels": l, "resourceVersion": obj.resource_version()}});
    api.patch(&obj.name_any(), &PatchParams::default(), &Patch::Merge(&p))
        .await
}

/// Creates an object; one of that name made before (by an earlier pass) is fine.
pub async fn create_if_absent<K>(api: &Api<K>, obj: &K) -> Result<(), kube::Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    match api.create(&PostParams::default(), obj).await {
        Ok(_) => Ok(()),
        Err(e) if is_conflict(&e) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Deletes an object; one that is already gone is fine.
pub async fn delete_if_present<K>(
    api: &Api<K>,
    name: &str,
    dp: &DeleteParams,
) -> Result<(), kube::Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, dp).await {
        Ok(_) => Ok(()),
        Err(e) if is_not_found(&e) => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;

    #[test]
    fn a_finalizer_patch_keeps_the_others_and_names_the_version() {
        let mut cm = ConfigMap::default();
        cm.metadata.finalizers = Some(vec!["a".into(), "b".into()]);
        cm.metadata.resource_version = Some("7".into());
        assert_eq!(
            finalizer_patch(&cm, "a", false),
            serde_json::json!({"metadata": {"finalizers": ["b"], "resourceVersion": "7"}})
        );
        assert_eq!(
            finalizer_patch(&cm, "c", true)["metadata"]["finalizers"],
            serde_json::json!(["a", "b", "c"])
        );
        assert!(has_finalizer(&cm, "b") && !has_finalizer(&cm, "c"));
    }
}
