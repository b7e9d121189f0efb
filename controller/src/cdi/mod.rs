//! The DataVolume controller: CDI's job for clusters without CDI. For each `cdi.kubevirt.io`
//! DataVolume it makes the claim (`claim`), runs an importer Pod of this project's
//! `cdi-importer` (`importer_pod`) that fills it from the source, and reports CDI's phases,
//! conditions, `progress` and `restartCount` (`assess`). A VM with `dataVolumeTemplates` waits
//! on the DataVolumes (`crate::datavolume`) and starts once they have Succeeded.
//!
//! **When CDI itself is installed, this controller does nothing.** CDI's operator creates the
//! cluster-scoped `cdis.cdi.kubevirt.io` kind (the `CDI` resource it is installed through);
//! when the API server serves it, every DataVolume is CDI's. That is asked of discovery at
//! most once a minute, so installing CDI later hands new imports over to it; a DataVolume
//! this controller has started (its importer Pod exists) it finishes. `--datavolume-import`
//! forces either way (`always`, `never`).

pub mod assess;
pub mod claim;
pub mod importer_pod;

use std::sync::Arc;
use std::time::{Duration, Instant};

use api::cdi::{DataVolume, DataVolumePhase, DataVolumeStatus};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::controller::Action;
use kube::ResourceExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::context::{Context, Error, Result};
use assess::{assess, Observed, PodAction};
use controller_runtime::events::event;
use importer_pod::ImportSource;

pub const CONTROLLER: &str = "datavolume-controller";

/// A DataVolume spec this importer cannot carry out: the field and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {reason}")]
pub struct SpecError {
    pub path: String,
    pub reason: String,
}

impl SpecError {
    pub fn new(path: &str, reason: &str) -> SpecError {
        SpecError {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

/// Who fills DataVolumes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum DataVolumeImport {
    /// microvirt's importer, unless CDI is installed.
    #[default]
    Auto,
    Always,
    Never,
}

/// Whether CDI is installed, as last asked of discovery.
#[derive(Default)]
pub struct CdiPresence(tokio::sync::Mutex<Option<(Instant, bool)>>);

const CDI_RECHECK: Duration = Duration::from_secs(60);

impl CdiPresence {
    async fn installed(&self, client: &kube::Client) -> Result<bool> {
        let mut last = self.0.lock().await;
        if let Some((at, installed)) = *last {
            if at.elapsed() < CDI_RECHECK {
                return Ok(installed);
            }
        }
        let installed = match client
            .list_api_group_resources("cdi.kubevirt.io/v1beta1")
            .await
        {
            Ok(list) => list.resources.iter().any(|r| r.name == "cdis"),
            Err(kube::Error::Api(s)) if s.code == 404 => false,
            Err(e) => return Err(e.into()),
        };
        if installed {
            tracing::info!(
                "CDI is installed (cdis.cdi.kubevirt.io is served): its importer fills DataVolumes"
            );
        }
        *last = Some((Instant::now(), installed));
        Ok(installed)
    }
}

pub fn error_policy(dv: Arc<DataVolume>, err: &Error, ctx: Arc<Context>) -> Action {
    ctx.retry(CONTROLLER, dv.as_ref(), err)
}

/// The StorageClass annotated as the default for virtualization, if the cluster has one (and
/// serves StorageClasses to this controller).
async fn default_virt_class(client: &kube::Client) -> Option<String> {
    use k8s_openapi::api::storage::v1::StorageClass;
    let classes = Api::<StorageClass>::all(client.clone())
        .list(&Default::default())
        .await
        .ok()?;
    classes.items.into_iter().find_map(|c| {
        (c.annotations()
            .get(claim::DEFAULT_VIRT_CLASS)
            .map(String::as_str)
            == Some("true"))
        .then(|| c.name_any())
    })
}

/// The progress the importer serves on its Pod's IP (CDI's metric, read as CDI reads it:
/// plain text, two seconds at most). By hand: one GET of a few hundred bytes per import.
async fn scraped_progress(pod: &Pod, owner_uid: &str) -> Option<String> {
    let ip: std::net::IpAddr = pod.status.as_ref()?.pod_ip.as_ref()?.parse().ok()?;
    let read = async {
        let mut s = tokio::net::TcpStream::connect((ip, api::cdi::importer::METRICS_PORT))
            .await
            .ok()?;
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: importer\r\n\r\n")
            .await
            .ok()?;
        let mut buf = Vec::new();
        s.take(64 << 10).read_to_end(&mut buf).await.ok()?;
        let text = String::from_utf8_lossy(&buf);
        api::cdi::importer::progress_of(text.split_once("\r\n\r\n")?.1, owner_uid)
    };
    tokio::time::timeout(Duration::from_secs(2), read)
        .await
        .ok()
        .flatten()
}

/// The public half of the key upload tokens are signed with, made (with its private half, in
/// a Secret of virt-controller's namespace that virt-api reads) the first time it is needed.
/// ECDSA P-256 (ES256 tokens), generated by rcgen, the project's certificate crate.
async fn upload_public_key(ctx: &Context) -> Result<String> {
    use api::cdi::upload::{KEY_SECRET, PRIVATE_KEY, PUBLIC_KEY};
    use k8s_openapi::api::core::v1::Secret;
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ctx.config.namespace);
    let public_of = |s: &Secret| {
        s.data
            .as_ref()
            .and_then(|d| d.get(PUBLIC_KEY))
            .map(|b| String::from_utf8_lossy(&b.0).into_owned())
    };
    if let Some(s) = secrets.get_opt(KEY_SECRET).await? {
        if let Some(p) = public_of(&s) {
            return Ok(p);
        }
    }
    let pair = controller_runtime::tls::signing_key_pair();
    let secret = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(KEY_SECRET.into()),
            namespace: Some(ctx.config.namespace.clone()),
            ..Default::default()
        },
        string_data: Some(std::collections::BTreeMap::from([
            (PRIVATE_KEY.to_string(), pair.0),
            (PUBLIC_KEY.to_string(), pair.1.clone()),
        ])),
        ..Default::default()
    };
    match secrets.create(&PostParams::default(), &secret).await {
        Ok(_) => Ok(pair.1),
        // Another replica made it first: use theirs.
        Err(kube::Error::Api(s)) if s.code == 409 => {
            let s = secrets.get(KEY_SECRET).await?;
            Ok(public_of(&s).unwrap_or_default())
        }
        Err(e) => Err(e.into()),
    }
}

/// Fails the DataVolume for a spec it cannot carry out (the field and why), once.
async fn refuse(
    dvs: &Api<DataVolume>,
    dv: &DataVolume,
    e: &SpecError,
    ctx: &Context,
) -> Result<Action> {
    let mut status = dv.status.clone().unwrap_or_default();
    if status.phase == Some(DataVolumePhase::Succeeded) {
        return Ok(Action::await_change());
    }
    let now = controller_runtime::time::now_rfc3339();
    let msg = e.to_string();
    status.phase = Some(DataVolumePhase::Failed);
    assess::set_condition(
        &mut status.conditions,
        "Running",
        false,
        "InvalidSpec",
        &msg,
        &now,
    );
    assess::set_condition(
        &mut status.conditions,
        "Ready",
        false,
        "InvalidSpec",
        &msg,
        &now,
    );
    if dv.status.as_ref() != Some(&status) {
        ctx.events
            .publish(dv, event(true, "InvalidSpec", "Import", msg.clone()))
            .await;
    }
    controller_runtime::write_status(dvs, dv, status).await?;
    Ok(Action::await_change())
}

/// One reconcile of one DataVolume.
pub async fn reconcile(dv: Arc<DataVolume>, ctx: Arc<Context>) -> Result<Action> {
    if dv.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let ns = dv.namespace().unwrap_or_default();
    let name = dv.name_any();
    let client = &ctx.client;
    let dvs: Api<DataVolume> = Api::namespaced(client.clone(), &ns);
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let pod_name = importer_pod::pod_name(&dv);
    let uid = dv.uid().unwrap_or_default();
    let pod = pods.get_opt(&pod_name).await?;
    let ours = match ctx.config.datavolume_import {
        DataVolumeImport::Always => true,
        DataVolumeImport::Never => false,
        // An import already started here is finished here.
        DataVolumeImport::Auto => {
            pod.as_ref()
                .is_some_and(|p| controller_runtime::controlled_by(p, &uid))
                || !ctx.cdi.installed(client).await?
        }
    };
    if !ours {
        return Ok(Action::requeue(CDI_RECHECK));
    }
    let src = match importer_pod::source_of(&dv) {
        Ok(s) => s,
        Err(e) => return refuse(&dvs, &dv, &e, &ctx).await,
    };
    let foreign = |kind: &str, n: &str| {
        SpecError::new(
            "metadata.name",
            &format!("{kind} {n} exists and is not controlled by this DataVolume; delete it or name the DataVolume otherwise"),
        )
    };
    if let Some(p) = &pod {
        if !controller_runtime::controlled_by(p, &uid) {
            return refuse(&dvs, &dv, &foreign("Pod", &pod_name), &ctx).await;
        }
    }
    let ClaimPlan {
        spec: claim_spec,
        shape,
        source_block,
        grow,
    } = match claim_plan(&dv, src, &pvcs, client).await? {
        Ok(p) => p,
        Err(e) => return refuse(&dvs, &dv, &e, &ctx).await,
    };
    let terminal = matches!(
        dv.status.as_ref().and_then(|s| s.phase),
        Some(DataVolumePhase::Succeeded | DataVolumePhase::Failed)
    );
    let claim = match pvcs.get_opt(&name).await? {
        Some(c) if controller_runtime::controlled_by(&c, &uid) => Some(c),
        Some(_) => return refuse(&dvs, &dv, &foreign("PersistentVolumeClaim", &name), &ctx).await,
        None if terminal => None,
        None => {
            let c = claim::claim(&dv, claim_spec, src.name());
            match pvcs.create(&PostParams::default(), &c).await {
                Ok(c) => Some(c),
                Err(kube::Error::Api(s)) if s.code == 409 => {
                    return Ok(Action::requeue(Duration::from_millis(200)))
                }
                Err(e) => return Err(e.into()),
            }
        }
    };
    let now = controller_runtime::time::now_rfc3339();
    let mut a = assess(&Observed {
        status: dv.status.as_ref(),
        claim: claim.as_ref(),
        pod: pod.as_ref(),
        flow: src.flow(),
        max_restarts: ctx.config.importer.max_restarts,
        now: &now,
    });
    let target = importer_pod::ImportTarget {
        claim: &name,
        shape,
        source_block,
        grow,
        upload_key: None,
    };
    carry_out(&ctx, &dv, src, a.pod, target, &pods).await?;
    let in_progress = matches!(
        a.status.phase,
        Some(DataVolumePhase::ImportInProgress | DataVolumePhase::CloneInProgress)
    );
    if in_progress {
        if let Some(p) = pod.as_ref() {
            if let Some(progress) = scraped_progress(p, &uid).await {
                a.status.progress = Some(progress);
            }
        }
    }
    announce(&ctx, &dv, &a.status).await;
    controller_runtime::write_status(&dvs, &dv, a.status).await?;
    ctx.succeeded(CONTROLLER, dv.as_ref());
    Ok(if in_progress {
        Action::requeue(ctx.config.import_progress_interval)
    } else {
        Action::requeue(Duration::from_secs(60))
    })
}

/// The claim to make and its shape; for a clone, whether its source is a block device and
/// whether the image is grown (not when the size is the source's). A clone's source must exist.
async fn claim_plan(
    dv: &DataVolume,
    src: ImportSource<'_>,
    pvcs: &Api<PersistentVolumeClaim>,
    client: &kube::Client,
) -> Result<Result<ClaimPlan, SpecError>> {
    let mut source_block = false;
    let mut grow = true;
    let mut spec_dv = dv.clone();
    if let ImportSource::Clone(c) = src {
        let Some(source) = pvcs.get_opt(&c.name).await? else {
            return Ok(Err(SpecError::new(
                "spec.source.pvc.name",
                &format!(
                    "PersistentVolumeClaim {} not found in namespace {}",
                    c.name,
                    dv.namespace().unwrap_or_default()
                ),
            )));
        };
        let sspec = source.spec.clone().unwrap_or_default();
        source_block = sspec.volume_mode.as_deref() == Some("Block");
        grow = !default_clone_size(&mut spec_dv, &sspec);
    }
    let mut data_source = None;
    if let ImportSource::Snapshot(c) = src {
        let snapshots: Api<api::snapshot::VolumeSnapshot> =
            Api::namespaced(client.clone(), &dv.namespace().unwrap_or_default());
        let found = match snapshots.get_opt(&c.name).await {
            Ok(found) => found,
            // No CSI snapshot kinds served: there is nothing to provision from.
            Err(kube::Error::Api(e)) if e.code == 404 => None,
            Err(e) => return Err(e.into()),
        };
        let Some(vs) = found else {
            return Ok(Err(SpecError::new(
                "spec.source.snapshot.name",
                &format!(
                    "VolumeSnapshot {} not found in namespace {}",
                    c.name,
                    dv.namespace().unwrap_or_default()
                ),
            )));
        };
        // No size given: the snapshot's restore size.
        if let Some(size) = vs.status.and_then(|s| s.restore_size) {
            let sized = k8s_openapi::api::core::v1::PersistentVolumeClaimSpec {
                resources: Some(k8s_openapi::api::core::v1::VolumeResourceRequirements {
                    requests: Some([("storage".to_string(), size)].into()),
                    ..Default::default()
                }),
                ..Default::default()
            };
            default_clone_size(&mut spec_dv, &sized);
        }
        data_source = Some(k8s_openapi::api::core::v1::TypedLocalObjectReference {
            api_group: Some("snapshot.storage.k8s.io".into()),
            kind: "VolumeSnapshot".into(),
            name: c.name.clone(),
        });
    }
    let default_class = default_virt_class(client).await;
    Ok(
        claim::claim_spec(&spec_dv, default_class.as_deref()).map(|(mut spec, shape)| {
            spec.data_source = data_source;
            ClaimPlan {
                spec,
                shape,
                source_block,
                grow,
            }
        }),
    )
}

/// The claim a DataVolume needs, and how its importer fills it.
struct ClaimPlan {
    spec: k8s_openapi::api::core::v1::PersistentVolumeClaimSpec,
    shape: claim::ClaimShape,
    source_block: bool,
    grow: bool,
}

/// Makes or removes the importer Pod, as assessed.
async fn carry_out(
    ctx: &Context,
    dv: &DataVolume,
    src: ImportSource<'_>,
    action: PodAction,
    mut target: importer_pod::ImportTarget<'_>,
    pods: &Api<Pod>,
) -> Result<()> {
    match action {
        PodAction::Keep => {}
        PodAction::Create => {
            if let ImportSource::Upload = src {
                target.upload_key = Some(upload_public_key(ctx).await?);
            }
            let p = importer_pod::render(dv, src, &target, &ctx.config.importer);
            match pods.create(&PostParams::default(), &p).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                Err(e) => return Err(e.into()),
            }
        }
        PodAction::Delete => {
            let name = importer_pod::pod_name(dv);
            controller_runtime::delete_if_present(pods, &name, &DeleteParams::default()).await?;
        }
    }
    Ok(())
}

/// A clone's size, when the DataVolume gives none: the source claim's. Whether it was taken.
fn default_clone_size(
    dv: &mut DataVolume,
    source: &k8s_openapi::api::core::v1::PersistentVolumeClaimSpec,
) -> bool {
    let given = [&dv.spec.storage, &dv.spec.pvc].into_iter().any(|s| {
        s.as_ref()
            .and_then(|s| s.resources.as_ref()?.requests.as_ref()?.get("storage"))
            .is_some()
    });
    if given {
        return false;
    }
    let Some(size) = source
        .resources
        .as_ref()
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage"))
        .cloned()
    else {
        return false;
    };
    let spec = match (&mut dv.spec.storage, &mut dv.spec.pvc) {
        (Some(s), _) | (None, Some(s)) => s,
        (None, None) => dv.spec.storage.get_or_insert_with(Default::default),
    };
    spec.resources
        .get_or_insert_with(Default::default)
        .requests
        .get_or_insert_with(Default::default)
        .insert("storage".into(), size);
    true
}

/// Events at the phase changes a user watches for.
async fn announce(ctx: &Context, dv: &DataVolume, next: &DataVolumeStatus) {
    let before = dv.status.as_ref().and_then(|s| s.phase);
    if before == next.phase {
        return;
    }
    let ready_msg = |t: &str| {
        next.conditions
            .iter()
            .find(|c| c.type_ == t)
            .and_then(|c| c.message.clone())
            .unwrap_or_default()
    };
    let (warning, reason, msg) = match next.phase {
        Some(DataVolumePhase::Succeeded) => (
            false,
            "ImportSucceeded",
            format!("Successfully imported into PVC {}", dv.name_any()),
        ),
        Some(DataVolumePhase::Failed) => (true, "ImportFailed", ready_msg("Ready")),
        Some(DataVolumePhase::ImportScheduled) => (
            false,
            "ImportScheduled",
            format!("Import into {} scheduled", dv.name_any()),
        ),
        _ => return,
    };
    ctx.events
        .publish(dv, event(warning, reason, "Import", msg))
        .await;
}
