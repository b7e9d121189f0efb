//! The s3 source against an S3 endpoint that checks signatures (moto's server with IAM
//! enforced): an object fetched with requests signed by the user's keys lands in the volume
//! as qemu-img converts it; a wrong secret (403) and a missing object (404) are refused.

use std::process::{Command, Output};

use tests::peers::{s3, sh};

fn importer(port: u16, key: &str, id: &str, secret: &str, dir: &std::path::Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cdi-importer"))
        .env("IMPORTER_SOURCE", "s3")
        .env(
            "IMPORTER_ENDPOINT",
            format!("http://127.0.0.1:{port}/images/{key}"),
        )
        .env("IMPORTER_ACCESS_KEY_ID", id)
        .env("IMPORTER_SECRET_KEY", secret)
        .env("IMPORTER_TARGET", dir.join("disk.img"))
        .env("IMPORTER_SCRATCH", dir.join("scratch"))
        .env("IMPORTER_TERMINATION_LOG", dir.join("termination-log"))
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

#[test]
fn an_s3_object_signed_for_fills_the_volume_and_bad_keys_are_refused() {
    let dir = std::env::temp_dir().join(format!("mv-importer-s3-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.display();
    sh(&format!(
        "cd {d}; head -c 2097152 /dev/urandom > disk.raw; truncate -s 4M disk.raw
         qemu-img convert -f raw -O qcow2 -c disk.raw disk.qcow2; gzip -k disk.qcow2"
    ));
    let (server, id, secret) = s3(&[("vm/disk.qcow2.gz", &dir.join("disk.qcow2.gz"))]);
    let o = importer(server.port, "vm/disk.qcow2.gz", &id, &secret, &dir);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        std::fs::read(dir.join("disk.img")).unwrap()
            == std::fs::read(dir.join("disk.raw")).unwrap(),
        "the volume differs from the image"
    );
    let o = importer(server.port, "vm/disk.qcow2.gz", &id, "not-the-secret", &dir);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("HTTP 403"), "{e}");
    let outcome = std::fs::read_to_string(dir.join("termination-log")).unwrap();
    assert!(outcome.contains(r#""reason":"SourceError""#), "{outcome}");
    let o = importer(server.port, "vm/nothing.img", &id, &secret, &dir);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("HTTP 404"), "{e}");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}
