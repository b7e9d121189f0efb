//! Who is asking and what they may do: bearer tokens, RBAC (when a test enforces it), and
//! `SubjectAccessReview`s answered from the same rules.

use super::*;

impl Inner {
    /// Authentication by bearer token and RBAC authorization, as the real server does before
    /// anything else.
    pub(super) fn authorize(
        &self,
        method: &Method,
        path: &str,
        q: &BTreeMap<String, String>,
        headers: &HeaderMap,
    ) -> ApiResult<()> {
        let caller = self.authenticate(headers)?;
        let Some(authorizer) = self.auth.lock().unwrap().rbac.clone() else {
            return Ok(());
        };
        if caller.groups.iter().any(|g| g == "system:masters") {
            return Ok(());
        }
        let t = self.route(path)?;
        let verb = match (method, &t.name) {
            (&Method::GET, None) if q.get("watch").is_some_and(|w| w == "true" || w == "1") => {
                "watch"
            }
            (&Method::GET, None) => "list",
            (&Method::GET, Some(_)) => "get",
            (&Method::POST, _) => "create",
            (&Method::PUT, _) => "update",
            (&Method::PATCH, _) => "patch",
            (&Method::DELETE, None) => "deletecollection",
            (&Method::DELETE, Some(_)) => "delete",
            _ => return Ok(()),
        };
        let attrs = RequestAttributes {
            verb: verb.into(),
            api_group: t.rtype.group.into(),
            resource: match &t.subresource {
                Some(sub) => format!("{}/{sub}", t.rtype.plural),
                None => t.rtype.plural.into(),
            },
            namespace: t.namespace.clone(),
            name: t.name.clone(),
        };
        if authorizer.allows_as(&caller.user, &caller.groups, &attrs) {
            Ok(())
        } else {
            let message = Authorizer::forbidden_message(&caller.user, &attrs);
            // Printed so that a test that then times out says why.
            eprintln!("test API server: 403 {message}");
            Err(ApiError::new(403, "Forbidden", message))
        }
    }

    /// Who a request comes from: the user its bearer token was issued to, or without a token
    /// the cluster admin (the test itself); an unknown token is 401.
    pub(super) fn authenticate(&self, headers: &HeaderMap) -> ApiResult<Caller> {
        let Some(token) = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
        else {
            return Ok(Caller {
                user: "system:admin".into(),
                groups: vec!["system:masters".into(), "system:authenticated".into()],
                extra: Default::default(),
            });
        };
        let user = self.auth.lock().unwrap().users.get(token).cloned();
        let Some((user, extra)) = user else {
            return Err(ApiError::new(401, "Unauthorized", "Unauthorized"));
        };
        let groups = groups_of(&user);
        Ok(Caller {
            user,
            groups,
            extra,
        })
    }

    /// A SubjectAccessReview, answered from the RBAC rules the server enforces (everything is
    /// allowed where it enforces none), never stored.
    pub(super) fn review_access(&self, mut review: Value) -> ApiResult<Response<Body>> {
        let spec = &review["spec"];
        let user = spec["user"].as_str().unwrap_or_default().to_string();
        let groups: Vec<String> = spec["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|g| g.as_str().map(str::to_string))
            .collect();
        let Some(ra) = spec.get("resourceAttributes") else {
            return Err(ApiError::new(
                422,
                "Invalid",
                "SubjectAccessReview spec.resourceAttributes: Required value (nonResourceAttributes are not supported here)",
            ));
        };
        let text = |k: &str| ra[k].as_str().unwrap_or_default().to_string();
        let resource = match text("subresource").as_str() {
            "" => text("resource"),
            sub => format!("{}/{sub}", text("resource")),
        };
        let attrs = RequestAttributes {
            verb: text("verb"),
            api_group: text("group"),
            resource,
            namespace: Some(text("namespace")).filter(|n| !n.is_empty()),
            name: Some(text("name")).filter(|n| !n.is_empty()),
        };
        let rbac = self.auth.lock().unwrap().rbac.clone();
        let allowed = groups.iter().any(|g| g == "system:masters")
            || rbac.is_none_or(|a| a.allows_as(&user, &groups, &attrs));
        review["status"] = if allowed {
            json!({"allowed": true, "reason": "RBAC: allowed"})
        } else {
            json!({"allowed": false, "reason": ""})
        };
        Ok(json_response(201, &review))
    }
}
