//! The garbage collector, as kube-controller-manager runs it beside the API server: after the
//! deletes that cause it, not inside them, and by the propagation policy each delete asked for:
//! - Background (the default): the owner goes at once; dependents whose owners are all gone
//!   are deleted afterwards;
//! - Foreground: the owner stays (deletionTimestamp, finalizer `foregroundDeletion`) until its
//!   dependents that block owner deletion are gone; they are deleted first;
//! - Orphan: the owner stays (finalizer `orphan`) until its dependents no longer name it; then
//!   it goes and they stay.

use std::collections::HashSet;

use serde_json::{json, Value};

use super::json::{meta, meta_str};
use super::resources::ResourceType;
use super::{Inner, State};

pub(crate) const FOREGROUND: &str = "foregroundDeletion";
pub(crate) const ORPHAN: &str = "orphan";

/// How a delete propagates to the dependents (`propagationPolicy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Propagation {
    Background,
    Foreground,
    Orphan,
}

impl Propagation {
    pub(crate) fn parse(s: Option<&str>) -> Result<Propagation, String> {
        match s {
            None | Some("Background") => Ok(Propagation::Background),
            Some("Foreground") => Ok(Propagation::Foreground),
            Some("Orphan") => Ok(Propagation::Orphan),
            Some(other) => Err(format!(
                "propagationPolicy: Unsupported value: {other:?}: supported values: \"Background\", \"Foreground\", \"Orphan\""
            )),
        }
    }

    /// The finalizer that holds the owner while the collector works, if any.
    pub(crate) fn finalizer(self) -> Option<&'static str> {
        match self {
            Propagation::Background => None,
            Propagation::Foreground => Some(FOREGROUND),
            Propagation::Orphan => Some(ORPHAN),
        }
    }
}

fn owner_uids(o: &Value) -> Vec<String> {
    meta(o)
        .get("ownerReferences")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|r| r.get("uid").and_then(Value::as_str).map(str::to_string))
        .collect()
}

fn has_finalizer(o: &Value, f: &str) -> bool {
    meta(o)
        .get("finalizers")
        .and_then(Value::as_array)
        .is_some_and(|fs| fs.iter().any(|x| x == f))
}

fn without_finalizer(o: &Value, f: &str) -> Value {
    let mut n = o.clone();
    if let Some(fs) = n["metadata"]["finalizers"].as_array_mut() {
        fs.retain(|x| x != f);
    }
    n
}

impl Inner {
    /// Every stored object of a served kind, borrowed (a pass clones only what it acts on: it
    /// runs every 20 ms beside thousands of objects in controller-bench).
    fn each_object<'a>(
        &'a self,
        st: &'a State,
    ) -> impl Iterator<Item = (&'a ResourceType, &'a Value)> {
        self.types.iter().flat_map(move |rt| {
            st.objects
                .get(&rt.key())
                .into_iter()
                .flat_map(|m| m.values())
                .map(move |o| (rt, o))
        })
    }

    /// One pass of the collector over the store: linear in the objects stored (each owner
    /// looked up in one set of the UIDs that exist, not by a scan per dependent).
    pub(crate) fn collect_garbage(&self) {
        let mut st = self.state.lock().unwrap();
        let uid_of = |o: &Value| meta_str(o, "uid").unwrap_or_default().to_string();
        // Owners being deleted, and the objects that name any of them.
        let deleting: Vec<(ResourceType, Value)> = self
            .each_object(&st)
            .filter(|(_, o)| meta(o).get("deletionTimestamp").is_some())
            .map(|(rt, o)| (rt.clone(), o.clone()))
            .collect();
        let deleting_uids: HashSet<String> = deleting.iter().map(|(_, o)| uid_of(o)).collect();
        let named: Vec<(ResourceType, Value, Vec<String>)> = if deleting_uids.is_empty() {
            Vec::new()
        } else {
            self.each_object(&st)
                .filter_map(|(rt, o)| {
                    let owners = owner_uids(o);
                    owners
                        .iter()
                        .any(|u| deleting_uids.contains(u))
                        .then(|| (rt.clone(), o.clone(), owners))
                })
                .collect()
        };
        let dependents_of = |uid: &str| -> Vec<(ResourceType, Value)> {
            named
                .iter()
                .filter(|(_, _, owners)| owners.iter().any(|u| u == uid))
                .map(|(rt, o, _)| (rt.clone(), o.clone()))
                .collect()
        };
        for (rt, owner) in &deleting {
            let uid = uid_of(owner);
            if has_finalizer(owner, ORPHAN) {
                for (drt, d) in dependents_of(&uid) {
                    let mut n = d.clone();
                    if let Some(refs) = n["metadata"]["ownerReferences"].as_array_mut() {
                        refs.retain(|r| r.get("uid").and_then(Value::as_str) != Some(&uid));
                    }
                    let _ = self.write(&mut st, &drt, d, n, false);
                }
                let _ = self.write(
                    &mut st,
                    rt,
                    owner.clone(),
                    without_finalizer(owner, ORPHAN),
                    false,
                );
            } else if has_finalizer(owner, FOREGROUND) {
                let deps = dependents_of(&uid);
                let blocking = deps.iter().any(|(_, d)| {
                    meta(d)
                        .get("ownerReferences")
                        .and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                        .any(|r| {
                            r.get("uid").and_then(Value::as_str) == Some(&uid)
                                && r.get("blockOwnerDeletion") == Some(&json!(true))
                        })
                });
                for (drt, d) in deps {
                    if meta(&d).get("deletionTimestamp").is_none() {
                        self.delete_locked(&mut st, &drt, d, None, Propagation::Background);
                    }
                }
                if !blocking {
                    let _ = self.write(
                        &mut st,
                        rt,
                        owner.clone(),
                        without_finalizer(owner, FOREGROUND),
                        false,
                    );
                }
            }
        }
        // Background: dependents whose owners are all gone (after the writes above).
        let existing: HashSet<&str> = st
            .objects
            .values()
            .flat_map(|m| m.values())
            .filter_map(|o| meta_str(o, "uid"))
            .collect();
        let orphaned: Vec<(ResourceType, Value)> = self
            .each_object(&st)
            .filter(|(_, o)| {
                let owners = owner_uids(o);
                !owners.is_empty()
                    && meta(o).get("deletionTimestamp").is_none()
                    && !owners.iter().any(|u| existing.contains(u.as_str()))
            })
            .map(|(rt, o)| (rt.clone(), o.clone()))
            .collect();
        drop(existing);
        for (rt, o) in orphaned {
            self.delete_locked(&mut st, &rt, o, None, Propagation::Background);
        }
    }
}
