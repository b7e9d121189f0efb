//! The Eviction API (`pods/<name>/eviction`): admission webhooks, then PodDisruptionBudgets,
//! then a graceful delete — what `kubectl drain` meets.

use super::*;

impl Inner {
    /// The Eviction API: admission webhooks first, then PodDisruptionBudgets (a budget whose
    /// selector matches the Pod must still have a disruption to spare counting the Pods that are
    /// Running and Ready), then a graceful delete. A Pod that is not Running is not protected.
    pub(super) async fn evict(
        &self,
        t: &Target,
        name: &str,
        eviction: &Value,
    ) -> ApiResult<Response<Body>> {
        let pod = self.get(t, name)?;
        let ns = t.namespace.clone().unwrap_or_default();
        let mut object = eviction.clone();
        if let Some(m) = object["metadata"].as_object_mut() {
            m.entry("namespace").or_insert(json!(ns));
        }
        let mut attrs = self.admission_attributes(t, "CREATE", object, None);
        attrs.subresource = Some("eviction".into());
        attrs.name = Some(name.to_string());
        self.dynamic_admission(attrs, true).await?;
        let running = pod.pointer("/status/phase").and_then(Value::as_str) == Some("Running");
        if running {
            self.check_disruption_budgets(&ns, &pod)?;
        }
        let grace = eviction
            .pointer("/deleteOptions/gracePeriodSeconds")
            .and_then(Value::as_i64);
        let target = Target {
            rtype: t.rtype.clone(),
            namespace: t.namespace.clone(),
            name: Some(name.to_string()),
            subresource: None,
            dry_run: t.dry_run,
            caller: t.caller.clone(),
        };
        self.delete(&target, name, grace, None, gc::Propagation::Background)?;
        Ok(json_response(
            201,
            &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}),
        ))
    }

    pub(super) fn check_disruption_budgets(&self, ns: &str, pod: &Value) -> ApiResult<()> {
        let st = self.state.lock().unwrap();
        let in_ns = |plural: &str| -> Vec<Value> {
            st.objects
                .iter()
                .filter(|(k, _)| k.ends_with(&format!("/{plural}")))
                .flat_map(|(_, m)| m.iter())
                .filter(|((n, _), _)| n == ns)
                .map(|(_, v)| v.clone())
                .collect()
        };
        let selects = |budget: &Value, obj: &Value| {
            let want = budget
                .pointer("/spec/selector/matchLabels")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default();
            !want.is_empty()
                && want.iter().all(|(k, v)| {
                    meta(obj)
                        .get("labels")
                        .and_then(|l| l.get(k))
                        .is_some_and(|x| x == v)
                })
        };
        let healthy = |p: &Value| {
            p.pointer("/status/phase").and_then(Value::as_str) == Some("Running")
                && meta(p).get("deletionTimestamp").is_none()
                && p.pointer("/status/conditions")
                    .and_then(Value::as_array)
                    .is_some_and(|c| {
                        c.iter()
                            .any(|c| c["type"] == "Ready" && c["status"] == "True")
                    })
        };
        let pods = in_ns("pods");
        for budget in in_ns("poddisruptionbudgets") {
            if !selects(&budget, pod) {
                continue;
            }
            let covered: Vec<&Value> = pods.iter().filter(|p| selects(&budget, p)).collect();
            let ready = covered.iter().filter(|p| healthy(p)).count() as i64;
            let spare = match (
                budget.pointer("/spec/minAvailable").and_then(Value::as_i64),
                budget
                    .pointer("/spec/maxUnavailable")
                    .and_then(Value::as_i64),
            ) {
                (Some(min), _) => ready - min,
                (None, Some(max)) => max - (covered.len() as i64 - ready),
                (None, None) => {
                    return Err(ApiError::new(
                        500,
                        "InternalError",
                        "this test server supports integer minAvailable/maxUnavailable only",
                    ))
                }
            };
            if spare < 1 {
                return Err(ApiError::new(
                    429,
                    "TooManyRequests",
                    format!(
                        "Cannot evict pod as it would violate the pod's disruption budget. (budget {}: {ready} healthy, {spare} disruptions allowed)",
                        meta_str(&budget, "name").unwrap_or_default()
                    ),
                ));
            }
        }
        Ok(())
    }
}
