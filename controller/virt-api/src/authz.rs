//! May this user do this? Asked of the API server as a SubjectAccessReview, so the answer is
//! the cluster's RBAC (KubeVirt's `kubevirt.io:admin/edit/view` roles grant the subresources)
//! and nothing virt-api decides by itself.

use std::collections::BTreeMap;

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};

use crate::identity::Identity;
use crate::status::SubresourceError;

/// One call, as RBAC sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct Access<'a> {
    /// The API group (`subresources.kubevirt.io`, or `upload.cdi.kubevirt.io` for upload
    /// tokens).
    pub group: &'a str,
    /// `get` for reads and streams, `update` for the verbs (KubeVirt's mapping of GET/PUT).
    pub verb: &'static str,
    /// `virtualmachines` or `virtualmachineinstances`.
    pub resource: &'a str,
    /// `start`, `console`, …
    pub subresource: &'a str,
    pub namespace: &'a str,
    pub name: &'a str,
}

impl Access<'_> {
    fn review(&self, who: &Identity) -> SubjectAccessReview {
        SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(who.user.clone()),
                groups: Some(who.groups.clone()),
                extra: (!who.extra.is_empty())
                    .then(|| who.extra.clone().into_iter().collect::<BTreeMap<_, _>>()),
                resource_attributes: Some(ResourceAttributes {
                    group: Some(self.group.into()),
                    version: Some("v1".into()),
                    resource: Some(self.resource.into()),
                    subresource: Some(self.subresource.into()),
                    verb: Some(self.verb.into()),
                    namespace: Some(self.namespace.into()),
                    name: Some(self.name.into()),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    /// The API server's words for a refusal.
    fn forbidden(&self, who: &Identity, why: Option<&str>) -> SubresourceError {
        let g = self.group;
        let what = if self.subresource.is_empty() {
            self.resource.to_string()
        } else {
            format!("{}/{}", self.resource, self.subresource)
        };
        let mut message = format!(
            "{}.{g} \"{}\" is forbidden: User \"{}\" cannot {} resource \"{what}\" in API group \"{g}\" in the namespace \"{}\"",
            self.resource, self.name, who.user, self.verb, self.namespace
        );
        if let Some(why) = why.filter(|w| !w.is_empty()) {
            message.push_str(": ");
            message.push_str(why);
        }
        SubresourceError::new(403, "Forbidden", message)
    }
}

/// Ok when the cluster's authorizers allow `who` the `access`; 403 in the API server's words
/// when they do not; 500 when the review itself fails (never allowed by default).
pub async fn authorize(
    client: &kube::Client,
    who: &Identity,
    access: &Access<'_>,
) -> Result<(), SubresourceError> {
    let reviews: Api<SubjectAccessReview> = Api::all(client.clone());
    let answer = reviews
        .create(&PostParams::default(), &access.review(who))
        .await
        .map_err(|e| SubresourceError::internal(format!("authorizing the request: {e}")))?;
    let status = answer.status.unwrap_or_default();
    if status.allowed && status.denied != Some(true) {
        Ok(())
    } else {
        Err(access.forbidden(who, status.reason.as_deref()))
    }
}
