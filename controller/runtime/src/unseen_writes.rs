//! A reconciler's own writes that its cache has not shown yet.
//!
//! A reconciler reads an object from its watch's store, writes it, and may be woken again (by
//! another object it follows) before the watch has brought the echo of that write. A pass on
//! the old copy computes what was already written and writes it again with the old
//! resourceVersion: a 409, a retry, and a request for nothing. At a thousand VMIs that was a
//! fifth of virt-controller's requests.
//!
//! So each write remembers the versions it replaced, and a pass that finds the object still at
//! one of them does nothing: the echo is on its way and wakes the reconciler again (a watch
//! that restarts lists the object afresh, at a newer version). KubeVirt's controllers make the
//! same check with their "expectations".
//!
//! resourceVersions are opaque, so only equality is used: a copy at any version other than the
//! replaced ones (the write's own, or a later one by anyone) is current enough to act on.

use std::collections::HashMap;
use std::sync::Mutex;

use kube::{Resource, ResourceExt};

/// The resourceVersions each object (by UID) had before this reconciler's last write to it,
/// until its cache shows a version past them.
#[derive(Default)]
pub struct UnseenWrites {
    replaced: Mutex<HashMap<String, Vec<String>>>,
}

impl UnseenWrites {
    /// The object `before` (as this pass read it) was written; `also_replaced` are versions it
    /// went through in between (a labels write before a status write), each older than the
    /// last write's.
    pub fn wrote<K: Resource>(&self, before: &K, also_replaced: &[String]) {
        let (Some(uid), Some(version)) = (before.uid(), before.resource_version()) else {
            return;
        };
        let mut versions = vec![version];
        versions.extend(also_replaced.iter().cloned());
        self.replaced.lock().unwrap().insert(uid, versions);
    }

    /// Whether `obj` (as a cache shows it) is older than this reconciler's last write to it.
    /// Once it is not, the write is forgotten.
    pub fn predate_own_write<K: Resource>(&self, obj: &K) -> bool {
        let Some(uid) = obj.uid() else {
            return false;
        };
        let mut replaced = self.replaced.lock().unwrap();
        let Some(versions) = replaced.get(&uid) else {
            return false;
        };
        if obj
            .resource_version()
            .is_some_and(|v| versions.contains(&v))
        {
            return true;
        }
        replaced.remove(&uid);
        false
    }

    /// Forgets the object (it is gone).
    pub fn forget<K: Resource>(&self, obj: &K) {
        if let Some(uid) = obj.uid() {
            self.replaced.lock().unwrap().remove(&uid);
        }
    }

    /// How many objects have a write not seen yet.
    pub fn len(&self) -> usize {
        self.replaced.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;

    fn at(uid: &str, version: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                uid: Some(uid.into()),
                resource_version: Some(version.into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn a_copy_from_before_the_write_waits_and_a_later_one_acts() {
        let w = UnseenWrites::default();
        assert!(!w.predate_own_write(&at("a", "5")), "nothing written yet");
        w.wrote(&at("a", "5"), &["6".to_string()]);
        assert!(w.predate_own_write(&at("a", "5")));
        assert!(
            w.predate_own_write(&at("a", "6")),
            "the labels write's echo"
        );
        assert!(!w.predate_own_write(&at("b", "5")), "another object");
        assert!(
            !w.predate_own_write(&at("a", "7")),
            "the status write's echo"
        );
        assert!(w.is_empty(), "forgotten once seen");
        assert!(
            !w.predate_own_write(&at("a", "5")),
            "an old copy after that acts"
        );
    }

    #[test]
    fn someone_elses_later_write_is_acted_on_and_gone_objects_forgotten() {
        let w = UnseenWrites::default();
        w.wrote(&at("a", "5"), &[]);
        assert!(!w.predate_own_write(&at("a", "9")));
        w.wrote(&at("b", "3"), &[]);
        w.forget(&at("b", "3"));
        assert!(w.is_empty());
        let no_uid = ConfigMap::default();
        w.wrote(&no_uid, &[]);
        assert!(!w.predate_own_write(&no_uid));
        assert!(w.is_empty());
    }
}
