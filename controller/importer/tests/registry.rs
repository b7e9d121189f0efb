//! The registry source against a real registry (Debian's docker-registry, the distribution
//! server) holding containerDisk images pushed with skopeo: the qcow2 under /disk/ lands in
//! the volume as qemu-img converts it; a missing tag, an image without /disk/ and a layer
//! whose bytes do not match its digest are refused.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{sh, Server as Registry};

fn registry() -> Registry {
    let (dir, port) = Registry::prepare("registry");
    std::fs::create_dir_all(dir.join("data")).unwrap();
    std::fs::write(
        dir.join("config.yml"),
        format!(
            "version: 0.1\nlog: {{level: error}}\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\n",
            dir.join("data").display()
        ),
    )
    .unwrap();
    let mut serve = Command::new("docker-registry");
    serve
        .arg("serve")
        .arg(dir.join("config.yml"))
        .stderr(std::process::Stdio::null());
    Registry::start(serve, dir, port)
}

/// Pushes an image whose one layer holds `files` (paths relative to the layer's root, each
/// copied from a host file) as `repo:tag`, through an OCI layout and skopeo.
fn push(r: &Registry, repo: &str, tag: &str, files: &[(&str, &Path)]) {
    let work = r.dir.join(format!("build-{repo}-{tag}").replace('/', "-"));
    let root = work.join("root");
    for (name, src) in files {
        let dst = root.join(name);
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::copy(src, dst).unwrap();
    }
    let w = work.display();
    sh(&format!(
        "cd {w}; mkdir -p layout/blobs/sha256; printf '{{\"imageLayoutVersion\":\"1.0.0\"}}' > layout/oci-layout
         tar -C root -cf layer.tar . ; diff=$(sha256sum layer.tar | cut -d' ' -f1)
         gzip -n layer.tar; l=$(sha256sum layer.tar.gz | cut -d' ' -f1); ls=$(stat -c %s layer.tar.gz)
         mv layer.tar.gz layout/blobs/sha256/$l
         printf '{{\"architecture\":\"amd64\",\"os\":\"linux\",\"rootfs\":{{\"type\":\"layers\",\"diff_ids\":[\"sha256:%s\"]}}}}' $diff > config.json
         c=$(sha256sum config.json | cut -d' ' -f1); cs=$(stat -c %s config.json); mv config.json layout/blobs/sha256/$c
         printf '{{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\"config\":{{\"mediaType\":\"application/vnd.oci.image.config.v1+json\",\"digest\":\"sha256:%s\",\"size\":%s}},\"layers\":[{{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar+gzip\",\"digest\":\"sha256:%s\",\"size\":%s}}]}}' $c $cs $l $ls > manifest.json
         m=$(sha256sum manifest.json | cut -d' ' -f1); ms=$(stat -c %s manifest.json); mv manifest.json layout/blobs/sha256/$m
         printf '{{\"schemaVersion\":2,\"manifests\":[{{\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\"digest\":\"sha256:%s\",\"size\":%s,\"annotations\":{{\"org.opencontainers.image.ref.name\":\"{tag}\"}}}}]}}' $m $ms > layout/index.json
         skopeo --insecure-policy copy -q --dest-tls-verify=false oci:layout:{tag} docker://127.0.0.1:{port}/{repo}:{tag}",
        port = r.port
    ));
}

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
