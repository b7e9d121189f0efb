//! Writes to the store: create, update (main resource or subresource), delete with
//! finalizers and grace, each committed with a new resourceVersion and a watch event.

use super::*;

impl Inner {
    /// Records a change: bumps the resourceVersion, stores it in the object, queues the event.
    pub(super) fn commit(
        &self,
        st: &mut State,
        rtype: &ResourceType,
        kind: &'static str,
        old: Option<Value>,
        mut new: Value,
    ) -> Value {
        st.rv += 1;
        let rv = st.rv;
        new["metadata"]["resourceVersion"] = json!(rv.to_string());
        let key = (
            meta_str(&new, "namespace").unwrap_or("").to_string(),
            meta_str(&new, "name").unwrap().to_string(),
        );
        let objs = st.objects.entry(rtype.key()).or_default();
        if kind == "DELETED" {
            objs.remove(&key);
        } else {
            objs.insert(key, new.clone());
        }
        let ev = WatchEvent {
            rv,
            rtype: rtype.key(),
            kind,
            old,
            new: new.clone(),
        };
        st.history.push_back(ev.clone());
        while st.history.len() > self.history_limit {
            let e = st.history.pop_front().unwrap();
            st.compacted = e.rv;
        }
        let _ = self.events.send(Arc::new(ev));
        new
    }

    pub(super) fn create(&self, t: &Target, mut obj: Value) -> ApiResult<Value> {
        let rt = &t.rtype;
        if !obj.is_object() {
            return Err(ApiError::new(400, "BadRequest", "body must be an object"));
        }
        obj["kind"] = json!(rt.kind);
        obj["apiVersion"] = json!(rt.api_version());
        if !obj.get("metadata").is_some_and(Value::is_object) {
            obj["metadata"] = json!({});
        }
        let ns = self.ns_key(t);
        if rt.namespaced {
            if ns.is_empty() {
                return Err(ApiError::new(
                    400,
                    "BadRequest",
                    "a namespaced object needs a namespace in the path",
                ));
            }
            match meta_str(&obj, "namespace") {
                Some(n) if n != ns => {
                    return Err(ApiError::new(400, "BadRequest", format!("the namespace of the object ({n}) does not match the namespace on the request ({ns})")))
                }
                _ => obj["metadata"]["namespace"] = json!(ns),
            }
        }
        let mut st = self.state.lock().unwrap();
        if rt.namespaced {
            self.namespace_open(&st, &ns)?;
        }
        let name = match (meta_str(&obj, "name"), meta_str(&obj, "generateName")) {
            (Some(n), _) if !n.is_empty() => n.to_string(),
            (_, Some(g)) if !g.is_empty() => loop {
                let n = format!("{g}{}", random_suffix(5));
                if !st.objects.get(&rt.key()).is_some_and(|m| m.contains_key(&(ns.clone(), n.clone()))) {
                    break n;
                }
            },
            _ => {
                return Err(ApiError::new(422, "Invalid", format!("{} is invalid: metadata.name: Required value: name or generateName is required", rt.kind)))
            }
        };
        if st
            .objects
            .get(&rt.key())
            .is_some_and(|m| m.contains_key(&(ns.clone(), name.clone())))
        {
            return Err(ApiError::new(
                409,
                "AlreadyExists",
                format!("{}.{} \"{name}\" already exists", rt.plural, rt.group),
            ));
        }
        let m = &mut obj["metadata"];
        m["name"] = json!(name);
        m["uid"] = json!(uid());
        m["creationTimestamp"] = json!(now_rfc3339());
        m["generation"] = json!(1);
        if let Some(m) = m.as_object_mut() {
            m.remove("deletionTimestamp");
            m.remove("resourceVersion");
        }
        if rt.status_subresource {
            if rt.kind == "Pod" {
                obj["status"] = json!({"phase": "Pending"});
            } else if let Some(o) = obj.as_object_mut() {
                o.remove("status");
            }
        }
        conform(rt, &mut obj)?;
        if t.dry_run {
            return Ok(obj);
        }
        Ok(self.commit(&mut st, rt, "ADDED", None, obj))
    }

    pub(super) fn update(
        &self,
        t: &Target,
        name: &str,
        sub: Option<&str>,
        update: Update,
    ) -> ApiResult<Value> {
        let rt = &t.rtype;
        let mut st = self.state.lock().unwrap();
        let old = self.stored(&st, t, name)?;
        if sub == Some("scale") {
            let (spec_path, _, _) = rt.scale.ok_or_else(|| not_found(rt, name))?;
            let mut scale = self.scale_of_locked(rt, &old)?;
            let stale = |obj: &Value| {
                meta_str(obj, "resourceVersion")
                    .is_some_and(|rv| Some(rv) != meta_str(&old, "resourceVersion"))
            };
            match update {
                Update::Replace(s) => {
                    if stale(&s) {
                        return Err(conflict(rt, name));
                    }
                    scale = s;
                }
                Update::Merge(p) => merge_patch(&mut scale, &p),
                Update::Json(p) => apply_json_patch(&mut scale, p)?,
            }
            let replicas = scale.pointer("/spec/replicas").cloned().unwrap_or(json!(0));
            let mut new = old.clone();
            set_path(&mut new, spec_path, replicas);
            let new = self.write(&mut st, rt, old, new, t.dry_run)?;
            return self.scale_of_locked(rt, &new);
        }
        let approval = sub == Some("approval") && rt.plural == super::csr::PLURAL;
        if sub.is_some_and(|s| s != "status") && !approval {
            return Err(not_found(rt, name));
        }
        let mut body = match update {
            Update::Replace(obj) => {
                match meta_str(&obj, "resourceVersion") {
                    None | Some("") => {
                        return Err(ApiError::new(422, "Invalid", format!("{} \"{name}\" is invalid: metadata.resourceVersion: Invalid value: 0x0: must be specified for an update", rt.kind)))
                    }
                    Some(rv) if Some(rv) != meta_str(&old, "resourceVersion") => return Err(conflict(rt, name)),
                    _ => {}
                }
                obj
            }
            Update::Merge(p) => {
                if meta_str(&p, "resourceVersion")
                    .is_some_and(|rv| Some(rv) != meta_str(&old, "resourceVersion"))
                {
                    return Err(conflict(rt, name));
                }
                let mut o = old.clone();
                merge_patch(&mut o, &p);
                o
            }
            Update::Json(p) => {
                let mut o = old.clone();
                apply_json_patch(&mut o, p)?;
                o
            }
        };
        // What each endpoint may change.
        let mut new = old.clone();
        if approval {
            new["status"]["conditions"] = body
                .pointer("/status/conditions")
                .cloned()
                .unwrap_or(Value::Null);
        } else if sub == Some("status") {
            new["status"] = body.get("status").cloned().unwrap_or(Value::Null);
            if rt.plural == super::csr::PLURAL {
                super::csr::check_status_update(name, &old, &new)?;
            }
        } else {
            let status = old.get("status").cloned();
            if let Some(o) = body.as_object_mut() {
                o.remove("status");
            }
            new = body;
            if rt.status_subresource {
                if let Some(s) = status {
                    new["status"] = s;
                }
            } else if let Some(s) = old
                .get("status")
                .cloned()
                .filter(|_| new.get("status").is_none())
            {
                new["status"] = s;
            }
            // Immutable metadata.
            for f in [
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "namespace",
                "name",
                "generation",
            ] {
                match old["metadata"].get(f) {
                    Some(v) => new["metadata"][f] = v.clone(),
                    None => {
                        if let Some(m) = new["metadata"].as_object_mut() {
                            m.remove(f);
                        }
                    }
                }
            }
            new["kind"] = json!(rt.kind);
            new["apiVersion"] = json!(rt.api_version());
            if old.get("spec") != new.get("spec") {
                let g = old["metadata"]["generation"].as_i64().unwrap_or(1);
                new["metadata"]["generation"] = json!(g + 1);
            }
        }
        self.write(&mut st, rt, old, new, t.dry_run)
    }

    /// Stores an updated object, deleting it when it was being deleted and its last finalizer
    /// went. No-op writes change nothing (no new resourceVersion, no event).
    pub(super) fn write(
        &self,
        st: &mut State,
        rt: &ResourceType,
        old: Value,
        mut new: Value,
        dry_run: bool,
    ) -> ApiResult<Value> {
        conform(rt, &mut new)?;
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"].clone();
        if new == old || dry_run {
            return Ok(new);
        }
        if meta(&new).get("deletionTimestamp").is_some()
            && !has_finalizers(&new)
            && !self.graceful_pending(rt, &new)
        {
            return Ok(self.commit(st, rt, "DELETED", Some(old), new));
        }
        Ok(self.commit(st, rt, "MODIFIED", Some(old), new))
    }

    /// A Pod bound to a node stays until its kubelet confirms deletion (gracePeriodSeconds=0);
    /// as in the real API server, unbound Pods and Pods that already ended go at once.
    pub(super) fn graceful_pending(&self, rt: &ResourceType, obj: &Value) -> bool {
        let phase = get_path(obj, "status.phase").and_then(Value::as_str);
        rt.kind == "Pod"
            && !matches!(phase, Some("Succeeded" | "Failed"))
            && get_path(obj, "spec.nodeName")
                .and_then(Value::as_str)
                .is_some_and(|n| !n.is_empty())
            && meta(obj)
                .get("deletionGracePeriodSeconds")
                .and_then(Value::as_i64)
                .unwrap_or(0)
                > 0
    }

    pub(super) fn delete(
        &self,
        t: &Target,
        name: &str,
        grace: Option<i64>,
        precondition_rv: Option<String>,
        propagation: gc::Propagation,
    ) -> ApiResult<Value> {
        let rt = &t.rtype;
        let mut st = self.state.lock().unwrap();
        let old = self.stored(&st, t, name)?;
        if precondition_rv.is_some_and(|rv| Some(rv.as_str()) != meta_str(&old, "resourceVersion"))
        {
            return Err(conflict(rt, name));
        }
        if t.dry_run {
            return Ok(old);
        }
        Ok(self.delete_locked(&mut st, rt, old, grace, propagation))
    }

    pub(super) fn delete_locked(
        &self,
        st: &mut State,
        rt: &ResourceType,
        old: Value,
        grace: Option<i64>,
        propagation: gc::Propagation,
    ) -> Value {
        let mut new = old.clone();
        if let Some(f) = propagation.finalizer() {
            // The collector holds the owner while it deals with the dependents.
            let fs = new["metadata"]["finalizers"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            if !fs.iter().any(|x| x == f) && meta(&new).get("deletionTimestamp").is_none() {
                let mut fs = fs;
                fs.push(json!(f));
                new["metadata"]["finalizers"] = json!(fs);
            }
        }
        let pod_grace = if rt.kind == "Pod" {
            grace
                .or_else(|| {
                    get_path(&old, "spec.terminationGracePeriodSeconds").and_then(Value::as_i64)
                })
                .unwrap_or(30)
        } else {
            0
        };
        if meta(&new).get("deletionTimestamp").is_none() {
            // As the real server: the time the object is due to be gone, now + its grace.
            new["metadata"]["deletionTimestamp"] = json!(rfc3339_in(pod_grace));
        }
        // A shorter grace period may replace a longer one, never the other way round.
        let current = meta(&old)
            .get("deletionGracePeriodSeconds")
            .and_then(Value::as_i64);
        let g = current.map_or(pod_grace, |c| c.min(pod_grace));
        new["metadata"]["deletionGracePeriodSeconds"] = json!(g);
        if has_finalizers(&new) || self.graceful_pending(rt, &new) {
            if new == old {
                return old;
            }
            return self.commit(st, rt, "MODIFIED", Some(old), new);
        }
        self.commit(st, rt, "DELETED", Some(old), new)
    }

    /// A namespaced object may be created only in a namespace that exists and is not being
    /// deleted, as the real server's NamespaceLifecycle admission has it.
    pub(super) fn namespace_open(&self, st: &State, ns: &str) -> ApiResult<()> {
        let namespace = st
            .objects
            .get("/v1/namespaces")
            .and_then(|m| m.get(&(String::new(), ns.to_string())));
        match namespace {
            None => Err(ApiError::new(
                404,
                "NotFound",
                format!("namespaces \"{ns}\" not found"),
            )),
            Some(n) if meta(n).get("deletionTimestamp").is_some() => Err(ApiError::new(
                403,
                "Forbidden",
                format!(
                    "unable to create new content in namespace {ns} because it is being terminated"
                ),
            )),
            Some(_) => Ok(()),
        }
    }

    pub(super) fn scale_of(&self, t: &Target, obj: &Value) -> ApiResult<Value> {
        self.scale_of_locked(&t.rtype, obj)
    }

    pub(super) fn scale_of_locked(&self, rt: &ResourceType, obj: &Value) -> ApiResult<Value> {
        let (spec, status, selector) = rt.scale.ok_or_else(|| {
            ApiError::new(
                404,
                "NotFound",
                format!("{} has no scale subresource", rt.plural),
            )
        })?;
        let m = meta(obj);
        Ok(json!({
            "kind": "Scale", "apiVersion": "autoscaling/v1",
            "metadata": {"name": m["name"], "namespace": m["namespace"], "uid": m["uid"],
                         "resourceVersion": m["resourceVersion"], "creationTimestamp": m["creationTimestamp"]},
            "spec": {"replicas": get_path(obj, spec).cloned().unwrap_or(json!(0))},
            "status": {"replicas": get_path(obj, status).cloned().unwrap_or(json!(0)),
                       "selector": get_path(obj, selector).cloned().unwrap_or(json!(""))},
        }))
    }
}
