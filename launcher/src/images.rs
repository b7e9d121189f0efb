//! Images a `run -f` manifest names that the image directory does not have — its
//! containerDisks and its kernelBoot container — pulled before the VM is built, by
//! `microvirt-pull` (installed beside the launcher). The launcher itself has no registry code:
//! in a Pod the kubelet pulls images, so the process every VM runs in stays small. An image
//! already in `--image-dir` is used as it is (offline runs keep working); `--pull never`
//! turns pulling off.

use std::path::{Path, PathBuf};
use std::process::Command;

use api::VirtualMachineInstanceSpec;

/// How `run -f` gets images it has not got.
#[derive(Clone, Debug, Default)]
pub struct PullPolicy {
    pub enabled: bool,
    /// Registries (`host:port`) that may be reached over plain HTTP (localhost's always may).
    pub insecure_registries: Vec<String>,
}

/// The images `spec` names, in order, each once.
pub fn named_images(spec: &VirtualMachineInstanceSpec) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let kernel = spec
        .domain
        .firmware
        .as_ref()
        .and_then(|f| f.kernel_boot.as_ref())
        .and_then(|k| k.container.as_ref())
        .map(|c| c.image.clone());
    let disks = spec
        .volumes
        .iter()
        .filter_map(|v| v.container_disk.as_ref().map(|c| c.image.clone()));
    for image in kernel.into_iter().chain(disks) {
        if !image.is_empty() && !out.contains(&image) {
            out.push(image);
        }
    }
    out
}

/// The pull helper: beside this executable, else on PATH.
fn helper() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join("microvirt-pull")))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("microvirt-pull"))
}

/// Pulls the images `spec` names that `image_dir` lacks.
pub fn pull_missing(
    spec: &VirtualMachineInstanceSpec,
    image_dir: &Path,
    policy: &PullPolicy,
) -> Result<(), String> {
    let missing: Vec<String> = named_images(spec)
        .into_iter()
        .filter(|i| !image_dir.join(i.replace(['/', ':'], "_")).exists())
        .collect();
    if missing.is_empty() || !policy.enabled {
        return Ok(());
    }
    let helper = helper();
    let mut cmd = Command::new(&helper);
    cmd.arg("--image-dir").arg(image_dir);
    for r in &policy.insecure_registries {
        cmd.arg("--insecure-registry").arg(r);
    }
    cmd.args(&missing);
    // Its progress bar and errors go to our stderr; the directories it prints are not needed.
    let out = cmd
        .stdout(std::process::Stdio::null())
        .status()
        .map_err(|e| {
            format!(
                "pulling {}: cannot run {} ({e}); install it beside virt-launcher, or put the images under --image-dir",
                missing.join(", "),
                helper.display()
            )
        })?;
    if !out.success() {
        return Err(format!(
            "pulling {} failed (see above); to run offline, put the images under --image-dir {}",
            missing.join(", "),
            image_dir.display()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_image_then_each_container_disk_once() {
        let spec: VirtualMachineInstanceSpec = serde_yaml::from_str(
            "domain:\n  devices: {}\n  firmware: {kernelBoot: {container: {image: 'r/k:1', kernelPath: /k}}}\nvolumes:\n- {name: a, containerDisk: {image: 'r/d:1'}}\n- {name: b, containerDisk: {image: 'r/d:1'}}\n- {name: c, emptyDisk: {capacity: 1Gi}}\n",
        )
        .unwrap();
        assert_eq!(named_images(&spec), ["r/k:1", "r/d:1"]);
        // Everything present: nothing to do, even without a helper.
        let dir = std::env::temp_dir().join(format!("mv-images-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("r_k_1")).unwrap();
        std::fs::create_dir_all(dir.join("r_d_1")).unwrap();
        let policy = PullPolicy {
            enabled: true,
            ..Default::default()
        };
        assert_eq!(pull_missing(&spec, &dir, &policy), Ok(()));
        std::fs::remove_dir_all(dir.join("r_d_1")).unwrap();
        // Pulling off: the missing image is left for translate to name.
        assert_eq!(pull_missing(&spec, &dir, &PullPolicy::default()), Ok(()));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
