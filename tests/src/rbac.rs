//! Kubernetes RBAC authorization for the test API server, from the manifests in `deploy/rbac/`:
//! a request made with a component's token is allowed only when one of the roles bound to its
//! service account grants that verb on that resource (Kubernetes' RBAC authorizer rules:
//! apiGroups, resources with `*` and `resource/subresource`, verbs, resourceNames, namespaced
//! Roles only in their namespace). The control-plane tests run virt-controller under it, so a
//! call the deployed ClusterRole does not allow fails a test instead of a production cluster.

use std::path::Path;

use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};

/// What a request asks for, as the RBAC authorizer sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestAttributes {
    pub verb: String,
    pub api_group: String,
    /// `pods`, or `pods/status` for a subresource.
    pub resource: String,
    pub namespace: Option<String>,
    pub name: Option<String>,
}

#[derive(Clone, Debug, Default)]
pub struct Authorizer {
    cluster_roles: Vec<ClusterRole>,
    cluster_role_bindings: Vec<ClusterRoleBinding>,
    roles: Vec<Role>,
    role_bindings: Vec<RoleBinding>,
}

/// The user name of a service account.
pub fn service_account_user(namespace: &str, name: &str) -> String {
    format!("system:serviceaccount:{namespace}:{name}")
}

fn matches(list: &[String], value: &str) -> bool {
    list.iter().any(|v| v == "*" || v == value)
}

fn rule_allows(rule: &PolicyRule, a: &RequestAttributes) -> bool {
    let groups = rule.api_groups.as_deref().unwrap_or_default();
    let resources = rule.resources.as_deref().unwrap_or_default();
    let names = rule.resource_names.as_deref().unwrap_or_default();
    matches(&rule.verbs, &a.verb)
        && matches(groups, &a.api_group)
        && matches(resources, &a.resource)
        && (names.is_empty()
            || a.name
                .as_deref()
                .is_some_and(|n| names.iter().any(|r| r == n)))
}

impl Authorizer {
    /// Loads every RBAC object in the YAML files under `dir`.
    pub fn from_dir(dir: &Path) -> Authorizer {
        let mut a = Authorizer::default();
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
            .collect();
        files.sort();
        a.add_bootstrap_roles();
        for f in files {
            a = a.with_yaml(&std::fs::read_to_string(&f).unwrap());
        }
        a
    }

    /// These rules too: every Role, ClusterRole and binding in `text` (YAML documents), as a
    /// test grants its users access.
    pub fn with_yaml(mut self, text: &str) -> Authorizer {
        for doc in serde_yaml::Deserializer::from_str(text) {
            let v: serde_json::Value = serde::Deserialize::deserialize(doc).unwrap();
            match v["kind"].as_str() {
                Some("ClusterRole") => self.cluster_roles.push(serde_json::from_value(v).unwrap()),
                Some("ClusterRoleBinding") => self
                    .cluster_role_bindings
                    .push(serde_json::from_value(v).unwrap()),
                Some("Role") => self.roles.push(serde_json::from_value(v).unwrap()),
                Some("RoleBinding") => self.role_bindings.push(serde_json::from_value(v).unwrap()),
                _ => {}
            }
        }
        self
    }

    /// Roles every cluster has from the start, which deployments bind to rather than define:
    /// aggregated API servers delegate authorization (`system:auth-delegator`) and read the
    /// front-proxy settings (`extension-apiserver-authentication-reader`).
    fn add_bootstrap_roles(&mut self) {
        let docs = serde_json::json!([
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
             "metadata": {"name": "system:auth-delegator"},
             "rules": [
                {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
                {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
             "metadata": {"name": "extension-apiserver-authentication-reader", "namespace": "kube-system"},
             "rules": [
                {"apiGroups": [""], "resources": ["configmaps"],
                 "resourceNames": ["extension-apiserver-authentication"], "verbs": ["get", "list", "watch"]}]}
        ]);
        self.cluster_roles
            .push(serde_json::from_value(docs[0].clone()).unwrap());
        self.roles
            .push(serde_json::from_value(docs[1].clone()).unwrap());
    }

    fn bound(
        subjects: &Option<Vec<k8s_openapi::api::rbac::v1::Subject>>,
        user: &str,
        groups: &[String],
    ) -> bool {
        subjects.iter().flatten().any(|s| match s.kind.as_str() {
            "ServiceAccount" => {
                service_account_user(s.namespace.as_deref().unwrap_or_default(), &s.name) == user
            }
            "User" => s.name == user,
            "Group" => groups.contains(&s.name),
            _ => false,
        })
    }

    fn cluster_role_rules(&self, name: &str) -> Vec<&PolicyRule> {
        self.cluster_roles
            .iter()
            .filter(|r| r.metadata.name.as_deref() == Some(name))
            .flat_map(|r| r.rules.iter().flatten())
            .collect()
    }

    /// Whether `user` (with the groups the authenticator gives every such user) may do what
    /// `a` asks.
    pub fn allows(&self, user: &str, a: &RequestAttributes) -> bool {
        self.allows_as(user, &crate::apiserver::groups_of(user), a)
    }

    /// Whether `user`, a member of `groups`, may do what `a` asks.
    pub fn allows_as(&self, user: &str, groups: &[String], a: &RequestAttributes) -> bool {
        let from_cluster = self
            .cluster_role_bindings
            .iter()
            .filter(|b| Self::bound(&b.subjects, user, groups) && b.role_ref.kind == "ClusterRole")
            .flat_map(|b| self.cluster_role_rules(&b.role_ref.name))
            .any(|r| rule_allows(r, a));
        if from_cluster {
            return true;
        }
        let Some(ns) = &a.namespace else {
            return false;
        };
        self.role_bindings
            .iter()
            .filter(|b| {
                b.metadata.namespace.as_ref() == Some(ns) && Self::bound(&b.subjects, user, groups)
            })
            .flat_map(|b| match b.role_ref.kind.as_str() {
                "ClusterRole" => self.cluster_role_rules(&b.role_ref.name),
                _ => self
                    .roles
                    .iter()
                    .filter(|r| {
                        r.metadata.name.as_deref() == Some(b.role_ref.name.as_str())
                            && r.metadata.namespace.as_ref() == Some(ns)
                    })
                    .flat_map(|r| r.rules.iter().flatten())
                    .collect(),
            })
            .any(|r| rule_allows(r, a))
    }

    /// Kubernetes' message for a refused request.
    pub fn forbidden_message(user: &str, a: &RequestAttributes) -> String {
        let (resource, sub) = match a.resource.split_once('/') {
            Some((r, s)) => (r, Some(s)),
            None => (a.resource.as_str(), None),
        };
        let name = a
            .name
            .as_ref()
            .map(|n| format!(" \"{n}\""))
            .unwrap_or_default();
        let sub = sub.map(|s| format!("/{s}")).unwrap_or_default();
        let scope = match &a.namespace {
            Some(ns) => format!("in the namespace \"{ns}\""),
            None => "at the cluster scope".into(),
        };
        format!(
            "{resource}{sub}{name} is forbidden: User \"{user}\" cannot {} resource \"{resource}{sub}\" in API group \"{}\" {scope}",
            a.verb, a.api_group
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs(verb: &str, group: &str, resource: &str, ns: Option<&str>) -> RequestAttributes {
        RequestAttributes {
            verb: verb.into(),
            api_group: group.into(),
            resource: resource.into(),
            namespace: ns.map(str::to_string),
            name: None,
        }
    }

    #[test]
    fn the_deployed_controller_role_is_what_it_says() {
        let a = Authorizer::from_dir(&crate::repo_root().join("deploy/rbac"));
        let sa = service_account_user("microvirt", "virt-controller");
        assert!(a.allows(&sa, &attrs("create", "", "pods", Some("default"))));
        assert!(a.allows(
            &sa,
            &attrs(
                "update",
                "kubevirt.io",
                "virtualmachineinstances/status",
                Some("x")
            )
        ));
        assert!(!a.allows(&sa, &attrs("update", "", "pods", Some("default"))));
        assert!(!a.allows(&sa, &attrs("get", "", "secrets", Some("default"))));
        // Leases only in the controller's own namespace (a Role, not a ClusterRole).
        assert!(a.allows(
            &sa,
            &attrs("update", "coordination.k8s.io", "leases", Some("microvirt"))
        ));
        assert!(!a.allows(
            &sa,
            &attrs("update", "coordination.k8s.io", "leases", Some("default"))
        ));
        // resourceNames narrow a rule.
        let mut patch = attrs(
            "patch",
            "admissionregistration.k8s.io",
            "validatingwebhookconfigurations",
            None,
        );
        assert!(!a.allows(&sa, &patch));
        patch.name = Some("microvirt".into());
        assert!(a.allows(&sa, &patch));
        assert!(!a.allows("system:anonymous", &attrs("list", "", "pods", None)));
        let msg = Authorizer::forbidden_message(&sa, &attrs("list", "", "secrets", None));
        assert_eq!(msg, "secrets is forbidden: User \"system:serviceaccount:microvirt:virt-controller\" cannot list resource \"secrets\" in API group \"\" at the cluster scope");
    }
}
