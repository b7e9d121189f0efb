//! A VM's instance type and preference, resolved as KubeVirt does: the first time from the
//! (Cluster)Instancetype / (Cluster)Preference objects, whose spec is then captured in a
//! ControllerRevision owned by the VM (its name recorded in `spec.instancetype.revisionName`);
//! from then on from that revision, so editing or deleting the instance type never changes a VM
//! that already uses it.

use api::instancetype::{instancetype_kind, preference_kind, InstancetypeSpec, PreferenceSpec};
use api::{Matcher, VirtualMachine};
use k8s_openapi::api::apps::v1::ControllerRevision;
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde::de::DeserializeOwned;

/// What a VM's template is expanded with.
#[derive(Clone, Debug, Default)]
pub struct Expansion {
    pub instancetype: Option<InstancetypeSpec>,
    pub preference: Option<PreferenceSpec>,
}

#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The VM names something that is not there (a user error: the VM reports it).
    #[error("{0}")]
    Missing(String),
    #[error(transparent)]
    Kube(#[from] kube::Error),
}

fn resource(kind: &str) -> ApiResource {
    let plural = format!("{}s", kind.to_ascii_lowercase());
    ApiResource {
        group: api::instancetype::GROUP.into(),
        version: api::instancetype::VERSION.into(),
        api_version: format!(
            "{}/{}",
            api::instancetype::GROUP,
            api::instancetype::VERSION
        ),
        kind: kind.into(),
        plural,
    }
}

/// Where a spec was found: in the VM's revision, or in the object itself (not yet captured).
enum Found<T> {
    Revision(T),
    Object {
        spec: T,
        spec_value: serde_json::Value,
        uid: String,
        generation: i64,
    },
}

impl<T> Found<T> {
    fn into_spec(self) -> T {
        match self {
            Found::Revision(s) | Found::Object { spec: s, .. } => s,
        }
    }
}

/// Which kind a matcher names, and whether it is namespaced.
type KindOf = fn(&Matcher) -> Result<(&'static str, bool), String>;

/// What a VM's `spec.instancetype` or `spec.preference` points at.
struct Reference<'a> {
    vm: &'a VirtualMachine,
    m: &'a Matcher,
    /// The kind named, cluster-wide or not.
    kind: &'static str,
    namespaced: bool,
    /// The VM's field: `instancetype` or `preference`.
    what: &'static str,
}

impl<'a> Reference<'a> {
    /// The VM's instance type and preference references, those it has.
    fn of(vm: &'a VirtualMachine) -> Result<[Option<Reference<'a>>; 2], ResolveError> {
        let to = |m: Option<&'a Matcher>, what, kind_of: KindOf| {
            m.map(|m| {
                let (kind, namespaced) = kind_of(m).map_err(ResolveError::Missing)?;
                Ok::<_, ResolveError>(Reference {
                    vm,
                    m,
                    kind,
                    namespaced,
                    what,
                })
            })
            .transpose()
        };
        Ok([
            to(
                vm.spec.instancetype.as_ref(),
                "instancetype",
                instancetype_kind,
            )?,
            to(vm.spec.preference.as_ref(), "preference", preference_kind)?,
        ])
    }
}

/// The spec `r` points at, from its revision when there is one, else from the object; reads
/// only.
async fn find<T: DeserializeOwned>(
    client: &Client,
    r: &Reference<'_>,
) -> Result<Found<T>, ResolveError> {
    let Reference {
        vm,
        m,
        kind,
        namespaced,
        what,
    } = *r;
    let ns = vm.namespace().unwrap_or_default();
    if let Some(rev) = &m.revision_name {
        let revisions: Api<ControllerRevision> = Api::namespaced(client.clone(), &ns);
        let r = revisions.get_opt(rev).await?.ok_or_else(|| {
            ResolveError::Missing(format!(
                "spec.{what}.revisionName: ControllerRevision {ns}/{rev} is gone"
            ))
        })?;
        let spec = r
            .data
            .and_then(|d| d.0.get("spec").cloned())
            .ok_or_else(|| {
                ResolveError::Missing(format!("ControllerRevision {ns}/{rev} holds no spec"))
            })?;
        let spec = serde_json::from_value(spec)
            .map_err(|e| ResolveError::Missing(format!("ControllerRevision {ns}/{rev}: {e}")))?;
        return Ok(Found::Revision(spec));
    }
    let ar = resource(kind);
    let objs: Api<DynamicObject> = if namespaced {
        Api::namespaced_with(client.clone(), &ns, &ar)
    } else {
        Api::all_with(client.clone(), &ar)
    };
    let where_ = if namespaced {
        format!("{kind} {ns}/{}", m.name)
    } else {
        format!("{kind} {}", m.name)
    };
    let obj = objs.get_opt(&m.name).await?.ok_or_else(|| {
        ResolveError::Missing(format!(
            "spec.{what}: {} {:?} not found (looked for {where_})",
            if what == "instancetype" {
                "instance type"
            } else {
                "preference"
            },
            m.name
        ))
    })?;
    let spec_value = obj.data.get("spec").cloned().unwrap_or_default();
    let spec: T = serde_json::from_value(spec_value.clone())
        .map_err(|e| ResolveError::Missing(format!("{where_}: spec: {e}")))?;
    Ok(Found::Object {
        spec,
        spec_value,
        uid: obj.uid().unwrap_or_default(),
        generation: obj.metadata.generation.unwrap_or(1),
    })
}

/// The spec `r` points at, from its revision when there is one, else from the object —
/// captured in a new revision. Returns the spec and, when a revision was made, its name.
async fn resolve_one<T: DeserializeOwned + serde::Serialize>(
    client: &Client,
    r: &Reference<'_>,
) -> Result<(T, Option<String>), ResolveError> {
    let Reference { vm, m, kind, .. } = *r;
    let (spec, spec_value, uid, generation) = match find(client, r).await? {
        Found::Revision(spec) => return Ok((spec, None)),
        Found::Object {
            spec,
            spec_value,
            uid,
            generation,
        } => (spec, spec_value, uid, generation),
    };
    let ns = vm.namespace().unwrap_or_default();
    let revisions: Api<ControllerRevision> = Api::namespaced(client.clone(), &ns);
    let ar = resource(kind);
    let mut name = format!(
        "{}-{}-{}-{generation}",
        vm.name_any(),
        m.name,
        uid.get(..8).unwrap_or(&uid)
    );
    name.truncate(253);
    let rev = ControllerRevision {
        metadata: kube::api::ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(ns.clone()),
            owner_references: controller_runtime::controller_ref(vm).map(|r| vec![r]),
            labels: Some(
                [(
                    "instancetype.kubevirt.io/object-kind".to_string(),
                    kind.to_string(),
                )]
                .into(),
            ),
            ..Default::default()
        },
        data: Some(RawExtension(serde_json::json!({
            "apiVersion": ar.api_version,
            "kind": kind,
            "metadata": {"name": m.name, "uid": uid, "generation": generation},
            "spec": spec_value,
        }))),
        revision: 1,
    };
    match revisions.create(&PostParams::default(), &rev).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {} // made by an earlier attempt
        Err(e) => return Err(e.into()),
    }
    Ok((spec, Some(name)))
}

/// The VM's instance type and preference as they are now, without writing anything (what
/// `expand-spec` shows).
pub async fn look_up(client: &Client, vm: &VirtualMachine) -> Result<Expansion, ResolveError> {
    let [instancetype, preference] = Reference::of(vm)?;
    let mut out = Expansion::default();
    if let Some(r) = instancetype {
        out.instancetype = Some(find(client, &r).await?.into_spec());
    }
    if let Some(r) = preference {
        out.preference = Some(find(client, &r).await?.into_spec());
    }
    Ok(out)
}

/// Resolves the VM's instance type and preference, capturing new revisions and recording their
/// names in the VM.
pub async fn resolve(client: &Client, vm: &VirtualMachine) -> Result<Expansion, ResolveError> {
    let [instancetype, preference] = Reference::of(vm)?;
    let mut out = Expansion::default();
    let mut revisions = Vec::new();
    if let Some(r) = instancetype {
        let (spec, rev) = resolve_one(client, &r).await?;
        out.instancetype = Some(spec);
        revisions.extend(rev.map(|rev| (r.what, rev)));
    }
    if let Some(r) = preference {
        let (spec, rev) = resolve_one(client, &r).await?;
        out.preference = Some(spec);
        revisions.extend(rev.map(|rev| (r.what, rev)));
    }
    let patch: serde_json::Map<_, _> = revisions
        .into_iter()
        .map(|(what, rev)| (what.to_string(), serde_json::json!({ "revisionName": rev })))
        .collect();
    if !patch.is_empty() {
        let vms: Api<VirtualMachine> =
            Api::namespaced(client.clone(), &vm.namespace().unwrap_or_default());
        vms.patch(
            &vm.name_any(),
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "spec": patch })),
        )
        .await?;
    }
    Ok(out)
}
