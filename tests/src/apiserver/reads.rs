//! Reads: list (selectors, paging) and watch (replay from a resourceVersion, selection
//! changes as ADDED/DELETED, bookmarks, timeouts, 410 Gone after compaction).

use super::*;

impl Inner {
    pub(super) fn filter(&self, t: &Target, q: &BTreeMap<String, String>) -> ApiResult<Filter> {
        Ok(Filter {
            namespace: t.namespace.clone(),
            labels: q
                .get("labelSelector")
                .map(|s| parse_label_selector(s))
                .transpose()?
                .unwrap_or_default(),
            fields: self.field_selector(t, q)?,
        })
    }

    /// `fieldSelector`, on the fields the real server can select this kind on only.
    pub(super) fn field_selector(
        &self,
        t: &Target,
        q: &BTreeMap<String, String>,
    ) -> ApiResult<Vec<(String, String, bool)>> {
        let Some(s) = q.get("fieldSelector") else {
            return Ok(vec![]);
        };
        let terms = parse_field_selector(s)?;
        if let Some((path, _, _)) = terms
            .iter()
            .find(|(p, _, _)| !selectable_field(t.rtype.kind, p))
        {
            return Err(ApiError::new(
                400,
                "BadRequest",
                format!("field label not supported: {path}"),
            ));
        }
        Ok(terms)
    }

    pub(super) fn list(&self, t: &Target, q: &BTreeMap<String, String>) -> ApiResult<Value> {
        let filter = self.filter(t, q)?;
        let limit = q
            .get("limit")
            .and_then(|l| l.parse::<usize>().ok())
            .filter(|l| *l > 0);
        // continue token: "<list resourceVersion>/<namespace>/<name>" of the last item returned.
        let cont = q.get("continue").filter(|c| !c.is_empty());
        let st = self.state.lock().unwrap();
        let (list_rv, after) = match cont {
            Some(c) => {
                let mut parts = c.splitn(3, '/');
                let bad = || ApiError::new(400, "BadRequest", "invalid continue token");
                let rv = parts.next().ok_or_else(bad)?.to_string();
                let ns = parts.next().ok_or_else(bad)?.to_string();
                let name = parts.next().ok_or_else(bad)?.to_string();
                (rv, Some((ns, name)))
            }
            None => (st.rv.to_string(), None),
        };
        let empty = BTreeMap::new();
        let all = st.objects.get(&t.rtype.key()).unwrap_or(&empty);
        let mut items = vec![];
        let mut next = None;
        let range = match &after {
            Some(k) => all.range((
                std::ops::Bound::Excluded(k.clone()),
                std::ops::Bound::Unbounded,
            )),
            None => all.range::<Key, _>(..),
        };
        for (k, v) in range {
            if !filter.matches(v) {
                continue;
            }
            if limit.is_some_and(|l| items.len() >= l) {
                next = Some(format!(
                    "{list_rv}/{}/{}",
                    items_last_key(&items).0,
                    items_last_key(&items).1
                ));
                let _ = k;
                break;
            }
            items.push(v.clone());
        }
        // One store of Events behind both APIs, as the real server has: the events.k8s.io ones
        // (kube-rs's Recorder writes those) are listed as core v1 Events too (what `kubectl
        // describe` reads).
        if t.rtype.group.is_empty() && t.rtype.plural == "events" && cont.is_none() {
            let newer = st.objects.get("events.k8s.io/v1/events").unwrap_or(&empty);
            items.extend(newer.values().map(core_event).filter(|e| filter.matches(e)));
        }
        let mut metadata = json!({"resourceVersion": list_rv});
        if let Some(n) = next {
            metadata["continue"] = json!(n);
        }
        Ok(json!({
            "kind": format!("{}List", t.rtype.kind),
            "apiVersion": t.rtype.api_version(),
            "metadata": metadata,
            "items": items,
        }))
    }

    pub(super) fn watch(
        self: Arc<Self>,
        t: &Target,
        q: &BTreeMap<String, String>,
    ) -> ApiResult<Response<Body>> {
        let filter = self.filter(t, q)?;
        let bookmarks = q.get("allowWatchBookmarks").is_some_and(|b| b == "true");
        let timeout = q
            .get("timeoutSeconds")
            .and_then(|s| s.parse::<u64>().ok())
            .map(Duration::from_secs)
            .unwrap_or(Duration::from_secs(1800));
        let from: Option<u64> = q
            .get("resourceVersion")
            .filter(|rv| !rv.is_empty() && *rv != "0")
            .map(|rv| {
                rv.parse().map_err(|_| {
                    ApiError::new(400, "BadRequest", format!("invalid resourceVersion {rv:?}"))
                })
            })
            .transpose()?;
        let rkey = t.rtype.key();
        let (replay, mut rx, start_rv) = {
            let st = self.state.lock().unwrap();
            let replay: Vec<Arc<WatchEvent>> = match from {
                Some(rv) if rv < st.compacted => {
                    let gone = ApiError::new(
                        410,
                        "Expired",
                        format!("too old resource version: {rv} ({})", st.compacted),
                    );
                    let line =
                        serde_json::to_vec(&json!({"type": "ERROR", "object": gone.status()}))
                            .unwrap();
                    return Ok(Response::builder()
                        .status(200)
                        .header("content-type", "application/json")
                        .body(Body::from([line, b"\n".to_vec()].concat()))
                        .unwrap());
                }
                Some(rv) => st
                    .history
                    .iter()
                    .filter(|e| e.rv > rv && e.rtype == rkey)
                    .cloned()
                    .map(Arc::new)
                    .collect(),
                None => st
                    .objects
                    .get(&rkey)
                    .into_iter()
                    .flat_map(|m| m.values())
                    .map(|o| {
                        Arc::new(WatchEvent {
                            rv: st.rv,
                            rtype: rkey.clone(),
                            kind: "ADDED",
                            old: None,
                            new: o.clone(),
                        })
                    })
                    .collect(),
            };
            (replay, self.events.subscribe(), from.unwrap_or(st.rv))
        };
        let mut epoch = self.watch_epoch.subscribe();
        let rtype = t.rtype.clone();
        let interval = self.bookmark_interval;
        let stream = async_stream::stream! {
            let line = |v: Value| -> Result<Bytes, std::io::Error> {
                let mut b = serde_json::to_vec(&v).unwrap();
                b.push(b'\n');
                Ok(Bytes::from(b))
            };
            let mut seen = start_rv;
            for ev in replay {
                seen = seen.max(ev.rv);
                if let Some(v) = render_event(&ev, &filter) { yield line(v); }
            }
            let deadline = tokio::time::Instant::now() + timeout;
            let mut tick = tokio::time::interval(interval);
            tick.tick().await;
            epoch.borrow_and_update();
            loop {
                tokio::select! {
                    _ = tokio::time::sleep_until(deadline) => break,
                    _ = epoch.changed() => break,
                    _ = tick.tick() => {
                        if bookmarks {
                            yield line(json!({"type": "BOOKMARK", "object": {
                                "kind": rtype.kind, "apiVersion": rtype.api_version(),
                                "metadata": {"resourceVersion": seen.to_string()}}}));
                        }
                    }
                    ev = rx.recv() => match ev {
                        Ok(ev) => {
                            seen = seen.max(ev.rv);
                            if ev.rtype == rkey {
                                if let Some(v) = render_event(&ev, &filter) { yield line(v); }
                            }
                        }
                        // A watcher this far behind is ended; the client resumes from `seen`.
                        Err(_) => break,
                    },
                }
            }
        };
        Ok(Response::builder()
            .status(200)
            .header("content-type", "application/json")
            .body(Body::from_stream(stream))
            .unwrap())
    }
}

pub(super) fn items_last_key(items: &[Value]) -> (String, String) {
    let last = items.last().unwrap();
    (
        meta_str(last, "namespace").unwrap_or("").to_string(),
        meta_str(last, "name").unwrap_or("").to_string(),
    )
}

/// The event a watcher with this filter sees, if any: objects entering the selection are
/// ADDED, leaving it DELETED.
pub(super) fn render_event(ev: &WatchEvent, filter: &Filter) -> Option<Value> {
    let new_in = filter.matches(&ev.new);
    let old_in = ev.old.as_ref().is_some_and(|o| filter.matches(o));
    let kind = match (ev.kind, old_in, new_in) {
        ("DELETED", true, _) => "DELETED",
        ("DELETED", false, _) => return None,
        (_, true, true) => "MODIFIED",
        (_, false, true) => "ADDED",
        (_, true, false) => "DELETED",
        (_, false, false) => return None,
    };
    Some(json!({"type": kind, "object": ev.new}))
}
