//! What the benchmark binaries share: medians and the release launcher they measure.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Result};

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Builds `virt-launcher` in release mode and returns its path.
pub fn launcher_path() -> Result<PathBuf> {
    let status = Command::new(env!("CARGO"))
        .args(["build", "--release", "--quiet", "-p", "launcher"])
        .current_dir(tests::repo_root())
        .status()?;
    if !status.success() {
        bail!("building virt-launcher failed");
    }
    Ok(tests::repo_root().join("target/release/virt-launcher"))
}
