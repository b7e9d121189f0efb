//! The PersistentVolumeClaim a DataVolume fills, as CDI makes it: named as the DataVolume, in
//! its namespace, controlled by it. `spec.pvc` is taken as written (Kubernetes' defaults);
//! `spec.storage` gets CDI's storage-profile defaults — ReadWriteOnce, Filesystem, the class
//! annotated as the default for virtualization when the DataVolume names none — and, on a
//! Filesystem claim, room for the file system's own overhead.

use std::collections::BTreeMap;

use api::cdi::DataVolume;
use api::quantity::parse_bytes;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, PersistentVolumeClaimSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;

use super::SpecError;

/// CDI's default file system overhead (`filesystemOverhead.global`, 6 %).
pub const FILESYSTEM_OVERHEAD: f64 = 0.06;
/// The annotation on the StorageClass CDI prefers for `spec.storage` claims.
pub const DEFAULT_VIRT_CLASS: &str = "storageclass.kubevirt.io/is-default-virt-class";

/// What the importer needs to know of the claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimShape {
    /// A raw block device rather than a file system with `disk.img`.
    pub block: bool,
    /// The size the DataVolume asked for (the image's room), in bytes.
    pub requested: u64,
}

/// The claim's spec as the DataVolume asks for it, and its shape. `default_virt_class` is the
/// StorageClass annotated as the default for virtualization, if the cluster has one.
pub fn claim_spec(
    dv: &DataVolume,
    default_virt_class: Option<&str>,
) -> Result<(PersistentVolumeClaimSpec, ClaimShape), SpecError> {
    let (mut spec, path, storage_api) = match (&dv.spec.pvc, &dv.spec.storage) {
        (Some(p), None) => (p.clone(), "spec.pvc", false),
        (None, Some(s)) => (s.clone(), "spec.storage", true),
        (Some(_), Some(_)) => {
            return Err(SpecError::new(
                "spec",
                "spec.pvc and spec.storage are mutually exclusive; give one",
            ))
        }
        (None, None) => {
            return Err(SpecError::new(
                "spec.storage",
                "is required (or spec.pvc): the claim the DataVolume fills",
            ))
        }
    };
    let size_path = format!("{path}.resources.requests.storage");
    let size = spec
        .resources
        .as_ref()
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage"))
        .ok_or_else(|| SpecError::new(&size_path, "is required: the size of the claim"))?;
    let requested = parse_bytes(&size.0).map_err(|e| SpecError::new(&size_path, &e))?;
    if requested == 0 {
        return Err(SpecError::new(&size_path, "must be more than 0"));
    }
    let block = spec.volume_mode.as_deref() == Some("Block");
    match spec.volume_mode.as_deref() {
        None | Some("Filesystem") | Some("Block") => {}
        Some(other) => {
            return Err(SpecError::new(
                &format!("{path}.volumeMode"),
                &format!("{other:?} is not a volume mode; accepted: Filesystem, Block"),
            ))
        }
    }
    if storage_api {
        spec.access_modes
            .get_or_insert_with(|| vec!["ReadWriteOnce".into()]);
        spec.volume_mode.get_or_insert_with(|| "Filesystem".into());
        if spec.storage_class_name.is_none() {
            spec.storage_class_name = default_virt_class.map(str::to_string);
        }
        if !block {
            let with_overhead = (requested as f64 / (1.0 - FILESYSTEM_OVERHEAD)).ceil() as u64;
            // Whole MiB, as a claim's size is usually shown.
            let mib = with_overhead.div_ceil(1 << 20);
            let requests = spec
                .resources
                .get_or_insert_with(Default::default)
                .requests
                .get_or_insert_with(BTreeMap::new);
            requests.insert("storage".into(), Quantity(format!("{mib}Mi")));
        }
    }
    Ok((spec, ClaimShape { block, requested }))
}

/// The claim object: the DataVolume's name and namespace, controlled by it, annotated with
/// the import's source as CDI annotates it.
pub fn claim(
    dv: &DataVolume,
    spec: PersistentVolumeClaimSpec,
    source: &str,
) -> PersistentVolumeClaim {
    PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some(dv.name_any()),
            namespace: dv.namespace(),
            labels: Some(BTreeMap::from([(
                "app".to_string(),
                api::cdi::importer::APP.to_string(),
            )])),
            annotations: Some(BTreeMap::from([(
                "cdi.kubevirt.io/storage.import.source".to_string(),
                source.to_string(),
            )])),
            owner_references: controller_runtime::controller_ref(dv).map(|r| vec![r]),
            ..Default::default()
        },
        spec: Some(spec),
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dv(spec: &str) -> DataVolume {
        serde_yaml::from_str(&format!(
            "apiVersion: cdi.kubevirt.io/v1beta1\nkind: DataVolume\nmetadata: {{name: d, namespace: ns, uid: u}}\nspec: {spec}"
        ))
        .unwrap()
    }

    #[test]
    fn storage_gets_cdis_defaults_and_the_file_system_overhead() {
        let (spec, shape) = claim_spec(
            &dv("{source: {blank: {}}, storage: {resources: {requests: {storage: 1Gi}}}}"),
            Some("fast"),
        )
        .unwrap();
        assert_eq!(spec.access_modes.unwrap(), ["ReadWriteOnce"]);
        assert_eq!(spec.volume_mode.as_deref(), Some("Filesystem"));
        assert_eq!(spec.storage_class_name.as_deref(), Some("fast"));
        // 1 GiB / 0.94, whole MiB.
        assert_eq!(
            spec.resources.unwrap().requests.unwrap()["storage"].0,
            "1090Mi"
        );
        assert_eq!(
            shape,
            ClaimShape {
                block: false,
                requested: 1 << 30
            }
        );
    }

    #[test]
    fn pvc_is_taken_as_written_and_block_claims_have_no_overhead() {
        let (spec, shape) = claim_spec(
            &dv("{source: {blank: {}}, pvc: {accessModes: [ReadWriteMany], volumeMode: Block, resources: {requests: {storage: 2Gi}}}}"),
            Some("fast"),
        )
        .unwrap();
        assert_eq!(spec.storage_class_name, None);
        assert_eq!(
            spec.resources.unwrap().requests.unwrap()["storage"].0,
            "2Gi"
        );
        assert!(shape.block);
    }

    #[test]
    fn a_missing_or_bad_size_names_the_field() {
        let e = claim_spec(&dv("{source: {blank: {}}, storage: {}}"), None).unwrap_err();
        assert_eq!(e.path, "spec.storage.resources.requests.storage");
        let e = claim_spec(&dv("{source: {blank: {}}}"), None).unwrap_err();
        assert_eq!(e.path, "spec.storage");
        let e = claim_spec(
            &dv("{source: {blank: {}}, pvc: {volumeMode: Tape, resources: {requests: {storage: 1Gi}}}}"),
            None,
        )
        .unwrap_err();
        assert!(e.reason.contains("accepted: Filesystem, Block"), "{e}");
    }
}
