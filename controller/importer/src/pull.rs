//! A containerDisk or kernelBoot image pulled from an OCI registry into an image directory, as
//! `virt-launcher run -f` finds images: `<image_dir>/<image with / and : as _>/`, holding the
//! image's files (kernelPath, initrdPath inside it) and, for a containerDisk, its disk (the file
//! under `/disk/`) converted to a raw `disk.img`. Layers are kept content-addressed in
//! `<image_dir>/.blobs/sha256/<digest>`, each verified against its digest as it arrives (the
//! OCI client checks it), so a second image sharing layers downloads only what is new.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::registry::{layer_tar, reference, RegistryAccess};
use crate::{ImportError, Result, SparseWriter};

/// Where `image` lives in `image_dir` (the launcher's naming).
pub fn image_path(image_dir: &Path, image: &str) -> PathBuf {
    image_dir.join(image.replace(['/', ':'], "_"))
}

/// Credentials for `registry` from a docker `config.json` (`auths.<registry>.auth`, base64 of
/// `user:password`, or `username`/`password`), as `docker login` leaves them.
pub fn docker_config_auth(config: &str, registry: &str) -> Option<(String, String)> {
    use base64::Engine;
    let v: serde_json::Value = serde_json::from_str(config).ok()?;
    let auths = v.get("auths")?.as_object()?;
    let docker_hub = matches!(
        registry,
        "docker.io" | "index.docker.io" | "registry-1.docker.io"
    );
    let entry = auths.iter().find_map(|(k, e)| {
        let host = k
            .trim_start_matches("https://")
            .trim_start_matches("http://")
            .split('/')
            .next()
            .unwrap_or_default();
        (host == registry || (docker_hub && host.ends_with("docker.io"))).then_some(e)
    })?;
    if let Some(a) = entry.get("auth").and_then(|a| a.as_str()) {
        let raw = base64::engine::general_purpose::STANDARD.decode(a).ok()?;
        let s = String::from_utf8(raw).ok()?;
        let (u, p) = s.split_once(':')?;
        return Some((u.to_string(), p.to_string()));
    }
    Some((
        entry.get("username")?.as_str()?.to_string(),
        entry.get("password")?.as_str()?.to_string(),
    ))
}

/// Reports how much of an image's layers has arrived.
pub trait PullProgress: Send {
    fn started(&mut self, image: &str, total_bytes: u64);
    fn advanced(&mut self, bytes: u64);
    fn finished(&mut self);
}

/// No report.
pub struct Quiet;
impl PullProgress for Quiet {
    fn started(&mut self, _: &str, _: u64) {}
    fn advanced(&mut self, _: u64) {}
    fn finished(&mut self) {}
}

/// Pulls `image` into `image_dir` and returns its directory. An image already there is
/// replaced only once the new one is complete.
pub fn pull_into(
    image: &str,
    access: &RegistryAccess,
    image_dir: &Path,
    progress: &mut dyn PullProgress,
) -> Result<PathBuf> {
    let blobs = image_dir.join(".blobs/sha256");
    std::fs::create_dir_all(&blobs).map_err(ImportError::Write)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ImportError::Read)?;
    let layers = rt.block_on(fetch_layers(image, access, &blobs, progress))?;
    let dest = image_path(image_dir, image);
    let partial = dest.with_extension("partial");
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(&partial).map_err(ImportError::Write)?;
    let unpacked = layers
        .iter()
        .try_for_each(|l| unpack_layer(l, &partial))
        .and_then(|_| disk_to_raw(&partial));
    if let Err(e) = unpacked {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(e);
    }
    let _ = std::fs::remove_dir_all(&dest);
    std::fs::rename(&partial, &dest).map_err(ImportError::Write)?;
    Ok(dest)
}

async fn fetch_layers(
    image: &str,
    access: &RegistryAccess,
    blobs: &Path,
    progress: &mut dyn PullProgress,
) -> Result<Vec<PathBuf>> {
    let reference = reference(image)?;
    let (client, auth) = crate::registry::client_for(&reference, access);
    let (manifest, _) = client
        .pull_image_manifest(&reference, &auth)
        .await
        .map_err(|e| ImportError::Source(format!("manifest of {reference}: {e}")))?;
    let total: u64 = manifest.layers.iter().map(|l| l.size.max(0) as u64).sum();
    progress.started(image, total);
    let mut files = Vec::new();
    for layer in &manifest.layers {
        let hex = layer
            .digest
            .strip_prefix("sha256:")
            .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(|| {
                ImportError::Source(format!("layer digest {:?} is not sha256", layer.digest))
            })?;
        let path = blobs.join(hex);
        if !path.exists() {
            let part = blobs.join(format!("{hex}.partial"));
            let out = tokio::fs::File::create(&part)
                .await
                .map_err(ImportError::Write)?;
            // The client checks the bytes against the digest as they arrive.
            let pulled = client.pull_blob(&reference, layer, out).await;
            if let Err(e) = pulled {
                let _ = std::fs::remove_file(&part);
                return Err(ImportError::Source(format!(
                    "layer {} of {reference}: {e}",
                    layer.digest
                )));
            }
            std::fs::rename(&part, &path).map_err(ImportError::Write)?;
        }
        progress.advanced(layer.size.max(0) as u64);
        files.push(path);
    }
    progress.finished();
    Ok(files)
}

/// Applies one layer to `dest`: its files written (never outside `dest`: the tar crate refuses
/// entries that would land elsewhere), OCI whiteouts removing what lower layers had.
fn unpack_layer(layer: &Path, dest: &Path) -> Result<()> {
    let mut archive = tar::Archive::new(layer_tar(layer)?);
    archive.set_preserve_permissions(false);
    archive.set_unpack_xattrs(false);
    for entry in archive.entries().map_err(ImportError::Read)? {
        let mut entry = entry.map_err(ImportError::Read)?;
        let path = entry.path().map_err(ImportError::Read)?.into_owned();
        if let Some(name) = path.file_name().and_then(|n| n.to_str()) {
            if let Some(gone) = name.strip_prefix(".wh.") {
                if gone != ".wh..opq" {
                    let target = dest.join(path.with_file_name(gone));
                    if target.starts_with(dest) {
                        let _ = std::fs::remove_dir_all(&target);
                        let _ = std::fs::remove_file(&target);
                    }
                }
                continue;
            }
        }
        // Device nodes and the like are not a disk's or kernel's business.
        let kind = entry.header().entry_type();
        if !(kind.is_file() || kind.is_dir() || kind.is_symlink() || kind.is_hard_link()) {
            continue;
        }
        entry.unpack_in(dest).map_err(ImportError::Write)?;
    }
    Ok(())
}

/// A containerDisk's disk (the one file under `disk/`, raw or qcow2, compressed or not)
/// converted to `disk.img`, the file the launcher boots from; `disk/` is then removed.
fn disk_to_raw(dir: &Path) -> Result<()> {
    let disk_dir = dir.join("disk");
    let Ok(entries) = std::fs::read_dir(&disk_dir) else {
        return Ok(());
    };
    let files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    let [source] = files.as_slice() else {
        return Err(ImportError::Format(format!(
            "the image's disk/ holds {} files; a containerDisk holds one",
            files.len()
        )));
    };
    let target = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(dir.join("disk.img"))
        .map_err(ImportError::Write)?;
    let mut writer = SparseWriter::new(target)?;
    let reader: Box<dyn Read> = Box::new(File::open(source).map_err(ImportError::Read)?);
    crate::import(reader, &dir.join(".scratch"), &mut writer, u64::MAX)?;
    std::fs::remove_dir_all(&disk_dir).map_err(ImportError::Write)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn docker_config_credentials() {
        let cfg = r#"{"auths": {"registry.example:5000": {"auth": "YWxpY2U6czNjcmV0"},
                      "https://index.docker.io/v1/": {"username": "bob", "password": "pw"}}}"#;
        assert_eq!(
            docker_config_auth(cfg, "registry.example:5000"),
            Some(("alice".into(), "s3cret".into()))
        );
        assert_eq!(
            docker_config_auth(cfg, "docker.io"),
            Some(("bob".into(), "pw".into()))
        );
        assert_eq!(docker_config_auth(cfg, "quay.io"), None);
        assert_eq!(docker_config_auth("not json", "quay.io"), None);
    }

    #[test]
    fn images_are_named_as_the_launcher_finds_them() {
        assert_eq!(
            image_path(Path::new("/i"), "quay.io/containerdisks/fedora:40"),
            Path::new("/i/quay.io_containerdisks_fedora_40")
        );
    }
}
