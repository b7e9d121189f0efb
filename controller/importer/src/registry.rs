//! A disk image out of a container image in an OCI registry, as KubeVirt builds containerDisks
//! and CDI's registry source reads them: the file under `disk/` in the image's layers (the
//! topmost layer that has one). Layers are pulled by the OCI distribution client crate, each
//! verified against its digest, onto scratch space; a registry on localhost may speak plain
//! HTTP (as Docker allows), any other only when named insecure.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};

use crate::format::{compression_of, Compression};
use crate::{ImportError, Result};

/// How to reach the registry.
#[derive(Clone, Debug, Default)]
pub struct RegistryAccess {
    /// Basic auth (the secretRef's accessKeyId and secretKey).
    pub credentials: Option<(String, String)>,
    /// PEM CA certificates to trust besides the system's.
    pub ca_pems: Vec<Vec<u8>>,
    /// Registries (`host:port`) reached over plain HTTP besides localhost's.
    pub insecure: Vec<String>,
}

fn err(what: &str, e: impl std::fmt::Display) -> ImportError {
    ImportError::Format(format!("{what}: {e}"))
}

/// `docker://HOST/REPO[:TAG|@DIGEST]` (or without the scheme) as a reference.
pub fn reference(url: &str) -> Result<Reference> {
    let bare = url.strip_prefix("docker://").unwrap_or(url);
    if bare.contains("://") {
        return Err(ImportError::Format(format!(
            "registry URL {url:?}: accepted is docker://HOST/REPOSITORY[:TAG|@DIGEST]"
        )));
    }
    bare.parse()
        .map_err(|e| err(&format!("registry URL {url:?}"), e))
}

/// Pulls the image's layers onto `scratch_dir` and returns the disk file's bytes as a stream
/// (the layer file stays until the stream is dropped and the caller removes `scratch_dir`).
pub fn disk_image(url: &str, access: &RegistryAccess, scratch_dir: &Path) -> Result<Box<dyn Read>> {
    let image = reference(url)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ImportError::Read)?;
    let layers = rt.block_on(pull_layers(&image, access, scratch_dir))?;
    // The topmost layer with a file under disk/ wins, as a container's filesystem shows it.
    for layer in layers.iter().rev() {
        if let Some(r) = disk_in_layer(layer)? {
            return Ok(r);
        }
    }
    Err(ImportError::Format(format!(
        "image {image} has no file under /disk/ (a containerDisk keeps its image there)"
    )))
}

/// A registry client for `image`'s registry (plain HTTP for localhost and the insecure ones,
/// the extra CAs trusted) and the credentials to send.
pub(crate) fn client_for(image: &Reference, access: &RegistryAccess) -> (Client, RegistryAuth) {
    let registry = image.resolve_registry().to_string();
    let mut insecure = access.insecure.clone();
    let host = registry.split(':').next().unwrap_or_default();
    if matches!(host, "localhost" | "127.0.0.1" | "[::1]") {
        insecure.push(registry.clone());
    }
    // The registry client's TLS takes the process's rustls provider: ring, the workspace's
    // (see Cargo.toml); installing it twice is harmless.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = Client::new(ClientConfig {
        protocol: ClientProtocol::HttpsExcept(insecure),
        extra_root_certificates: access
            .ca_pems
            .iter()
            .map(|pem| Certificate {
                encoding: CertificateEncoding::Pem,
                data: pem.clone(),
            })
            .collect(),
        ..Default::default()
    });
    let auth = match &access.credentials {
        Some((user, password)) => RegistryAuth::Basic(user.clone(), password.clone()),
        None => RegistryAuth::Anonymous,
    };
    (client, auth)
}

async fn pull_layers(
    image: &Reference,
    access: &RegistryAccess,
    scratch_dir: &Path,
) -> Result<Vec<PathBuf>> {
    let (client, auth) = client_for(image, access);
    let (manifest, _) = client
        .pull_image_manifest(image, &auth)
        .await
        .map_err(|e| ImportError::Source(format!("manifest of {image}: {e}")))?;
    std::fs::create_dir_all(scratch_dir).map_err(ImportError::Write)?;
    let mut files = Vec::new();
    for (i, layer) in manifest.layers.iter().enumerate() {
        let path = scratch_dir.join(format!("layer-{i}"));
        let out = tokio::fs::File::create(&path)
            .await
            .map_err(ImportError::Write)?;
        // The client checks the layer against its digest as it arrives.
        client
            .pull_blob(image, layer, out)
            .await
            .map_err(|e| ImportError::Source(format!("layer {} of {image}: {e}", layer.digest)))?;
        files.push(path);
    }
    Ok(files)
}

/// The layer at `path` as a tar stream, decompressed by what its bytes say it is.
pub(crate) fn layer_tar(path: &Path) -> Result<Box<dyn Read>> {
    let open = || File::open(path).map_err(ImportError::Read);
    let mut head = [0u8; 8];
    let n = open()?.read(&mut head).map_err(ImportError::Read)?;
    Ok(match compression_of(&head[..n]) {
        Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(open()?)),
        Compression::Zstd => {
            Box::new(zstd::stream::read::Decoder::new(open()?).map_err(ImportError::Read)?)
        }
        Compression::Xz => Box::new(xz2::read::XzDecoder::new(open()?)),
        Compression::None => Box::new(open()?),
    })
}

/// The file directly under `disk/` in the layer at `path`, if any, copied out beside it (tar
/// entries borrow their archive; CDI's pod pull stages on scratch space the same way).
fn disk_in_layer(path: &Path) -> Result<Option<Box<dyn Read>>> {
    let mut archive = tar::Archive::new(layer_tar(path)?);
    for entry in archive.entries().map_err(ImportError::Read)? {
        let mut entry = entry.map_err(ImportError::Read)?;
        let name = entry.path().map_err(ImportError::Read)?.into_owned();
        let name = name.strip_prefix("./").unwrap_or(&name).to_path_buf();
        let mut parts = name.components();
        let in_disk = parts.next().is_some_and(|c| c.as_os_str() == "disk");
        if in_disk && parts.count() == 1 && entry.header().entry_type().is_file() {
            let out = path.with_extension("disk");
            let mut f = File::create(&out).map_err(ImportError::Write)?;
            std::io::copy(&mut entry, &mut f).map_err(ImportError::Read)?;
            drop(f);
            let _ = std::fs::remove_file(path);
            return Ok(Some(Box::new(File::open(&out).map_err(ImportError::Read)?)));
        }
    }
    Ok(None)
}
