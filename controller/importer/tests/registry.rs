//! The registry source against a real registry (Debian's docker-registry, the distribution
//! server) holding containerDisk images pushed with skopeo: the qcow2 under /disk/ lands in
//! the volume as qemu-img converts it; a missing tag, an image without /disk/ and a layer
//! whose bytes do not match its digest are refused.

use std::path::Path;
use std::process::{Command, Output};

use tests::peers::{push, registry, sh, Server as Registry};

fn importer(r: &Registry, image: &str, target: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cdi-importer"))
        .env("IMPORTER_SOURCE", "registry")
        .env(
            "IMPORTER_ENDPOINT",
            format!("docker://127.0.0.1:{}/{image}", r.port),
        )
        .env("IMPORTER_TARGET", target)
        .env("IMPORTER_SCRATCH", r.dir.join("scratch"))
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

#[test]
fn a_container_disk_in_a_registry_fills_the_volume() {
    let r = registry();
    let d = r.dir.display();
    sh(&format!(
        "cd {d}; head -c 3145728 /dev/urandom > disk.raw; truncate -s 5M disk.raw
         qemu-img convert -f raw -O qcow2 disk.raw disk.qcow2; echo hello > readme"
    ));
    push(
        &r,
        "disks/probe",
        "v1",
        &[("disk/disk.qcow2", &r.dir.join("disk.qcow2"))],
    );
    let target = r.dir.join("disk.img");
    let o = importer(&r, "disks/probe:v1", &target);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want = std::fs::read(r.dir.join("disk.raw")).unwrap();
    assert!(
        std::fs::read(&target).unwrap() == want,
        "the volume differs from the image's disk"
    );
    assert!(
        !r.dir.join("scratch.layers").exists(),
        "layers left on scratch space"
    );

    let refused = |image: &str, words: &str| {
        let o = importer(&r, image, &target);
        let e = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(
            !o.status.success() && e.contains(words),
            "{image}: want {words:?}: {e}"
        );
    };
    refused("disks/probe:v2", "manifest of");
    push(
        &r,
        "disks/empty",
        "v1",
        &[("etc/readme", &r.dir.join("readme"))],
    );
    refused("disks/empty:v1", "has no file under /disk/");
    // A layer whose stored bytes no longer match its digest.
    let blobs = r.dir.join("data/docker/registry/v2/blobs/sha256");
    let layer = sh(&format!(
        "find {} -name data -size +100k | head -n1",
        blobs.display()
    ));
    let mut bytes = std::fs::read(&layer).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&layer, bytes).unwrap();
    refused("disks/probe:v1", "Invalid digest. Expected sha256:");
}
