//! `virtctl image-upload dv NAME --size SIZE --image-path FILE --uploadproxy-url URL`, as
//! KubeVirt's: the DataVolume (`source.upload`) made unless `--no-create`, its upload server
//! waited for (UploadReady), a token asked for (an `UploadTokenRequest`, as the caller), the
//! file POSTed to the upload proxy with it, then the import waited for (Succeeded), with
//! KubeVirt's messages along the way.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use api::cdi::upload;
use api::cdi::{DataVolume, DataVolumePhase};
use kube::api::{Api, PostParams};
use serde_json::{json, Value};

/// What the command was asked.
pub struct UploadRequest {
    pub name: String,
    pub namespace: String,
    pub size: Option<String>,
    pub image_path: PathBuf,
    pub proxy_url: String,
    pub insecure: bool,
    pub no_create: bool,
    pub storage_class: Option<String>,
    pub access_mode: Option<String>,
    pub volume_mode: Option<String>,
    /// How long to wait for the upload server, and for the processing.
    pub wait: Duration,
}

fn datavolume(r: &UploadRequest, size: &str) -> anyhow::Result<DataVolume> {
    let mut storage = json!({"resources": {"requests": {"storage": size}}});
    if let Some(c) = &r.storage_class {
        storage["storageClassName"] = json!(c);
    }
    if let Some(m) = &r.access_mode {
        storage["accessModes"] = json!([m]);
    }
    if let Some(m) = &r.volume_mode {
        storage["volumeMode"] = json!(m);
    }
    Ok(serde_json::from_value(json!({
        "apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume",
        "metadata": {"name": r.name, "namespace": r.namespace},
        "spec": {"source": {"upload": {}}, "storage": storage},
    }))?)
}

/// The DataVolume once `done` says so of its phase; a Failed one is an error with its reason.
async fn wait_for(
    dvs: &Api<DataVolume>,
    name: &str,
    within: Duration,
    done: impl Fn(DataVolumePhase) -> bool,
    what: &str,
) -> anyhow::Result<()> {
    let start = Instant::now();
    loop {
        let dv = dvs.get(name).await?;
        let status = dv.status.unwrap_or_default();
        let phase = status.phase.unwrap_or_default();
        if done(phase) {
            return Ok(());
        }
        if phase == DataVolumePhase::Failed {
            let why = status
                .conditions
                .iter()
                .find(|c| c.type_ == "Ready")
                .and_then(|c| c.message.clone())
                .unwrap_or_default();
            bail!("DataVolume {name} failed: {why}");
        }
        if start.elapsed() > within {
            bail!(
                "timed out after {within:?} waiting for DataVolume {name} {what} (phase {phase:?})"
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// A token for the claim, asked of the API server as the caller.
async fn token(client: &kube::Client, namespace: &str, claim: &str) -> anyhow::Result<String> {
    let body = json!({
        "apiVersion": format!("{}/{}", upload::GROUP, upload::VERSION),
        "kind": "UploadTokenRequest",
        "metadata": {"name": claim, "namespace": namespace},
        "spec": {"pvcName": claim},
    });
    let req = http::Request::post(format!(
        "/apis/{}/{}/namespaces/{namespace}/{}",
        upload::GROUP,
        upload::VERSION,
        upload::PLURAL
    ))
    .header(http::header::CONTENT_TYPE, "application/json")
    .body(serde_json::to_vec(&body)?)?;
    let answer: Value = client
        .request(req)
        .await
        .context("requesting an upload token")?;
    answer
        .pointer("/status/token")
        .and_then(Value::as_str)
        .map(str::to_string)
        .context("the UploadTokenRequest came back without a token")
}

/// POSTs the file to the proxy (on a blocking thread: a file body, streamed).
async fn send(r: &UploadRequest, token: &str) -> anyhow::Result<()> {
    let url = format!(
        "{}{}",
        r.proxy_url.trim_end_matches('/'),
        upload::UPLOAD_PATH
    );
    let path = r.image_path.clone();
    let (insecure, token) = (r.insecure, token.to_string());
    tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        let file = std::fs::File::open(&path)
            .with_context(|| format!("--image-path {}", path.display()))?;
        let client = reqwest::blocking::Client::builder()
            .danger_accept_invalid_certs(insecure)
            .timeout(None)
            .build()?;
        let resp = client
            .post(&url)
            .bearer_auth(token)
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .body(file)
            .send()
            .with_context(|| format!("POST {url}"))?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().unwrap_or_default();
            bail!(
                "unexpected return value {}, {}",
                status.as_u16(),
                text.trim()
            );
        }
        Ok(())
    })
    .await?
}

pub async fn image_upload(client: &kube::Client, r: &UploadRequest) -> anyhow::Result<()> {
    let dvs: Api<DataVolume> = Api::namespaced(client.clone(), &r.namespace);
    let len = std::fs::metadata(&r.image_path)
        .with_context(|| format!("--image-path {}", r.image_path.display()))?
        .len();
    match (dvs.get_opt(&r.name).await?, r.no_create) {
        (Some(dv), _) => {
            let uploads = dv.spec.source.as_ref().is_some_and(|s| s.upload.is_some());
            if !uploads {
                bail!("DataVolume {} exists and its source is not upload", r.name);
            }
            if !r.no_create {
                bail!(
                    "DataVolume {} already exists; use --no-create to upload into it",
                    r.name
                );
            }
            println!("Using existing DataVolume {}/{}", r.namespace, r.name);
        }
        (None, true) => bail!("DataVolume {} not found (--no-create)", r.name),
        (None, false) => {
            let size = r
                .size
                .as_deref()
                .context("--size is required to create the DataVolume (e.g. --size=10Gi)")?;
            dvs.create(&PostParams::default(), &datavolume(r, size)?)
                .await?;
            println!("DataVolume {}/{} created", r.namespace, r.name);
        }
    }
    println!("Waiting for PVC {} upload pod to be ready...", r.name);
    wait_for(
        &dvs,
        &r.name,
        r.wait,
        |p| p == DataVolumePhase::UploadReady,
        "UploadReady",
    )
    .await?;
    println!("Pod now ready");
    let token = token(client, &r.namespace, &r.name).await?;
    println!("Uploading data to {}", r.proxy_url);
    println!();
    println!(" {len} bytes");
    send(r, &token).await?;
    println!("Uploading data completed successfully, waiting for processing to complete, you can hit ctrl-c without interrupting the progress");
    wait_for(
        &dvs,
        &r.name,
        r.wait,
        |p| p == DataVolumePhase::Succeeded,
        "Succeeded",
    )
    .await?;
    println!("Processing completed successfully");
    println!(
        "Uploading {} completed successfully",
        r.image_path.display()
    );
    Ok(())
}
