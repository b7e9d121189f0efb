//! The cdi-importer binary against a real web server: nginx over TLS with a test CA, basic
//! auth and a required header in front of the images; a server that cuts a download short.
//! What lands in the volume is compared byte for byte with `qemu-img convert -O raw`.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tests::peers::{nginx, sh, Server as Nginx};

fn importer(envs: &[(&str, String)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cdi-importer"))
        .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A 5 MiB image with zero stretches, as raw and as xz-compressed qcow2 in `www/private/`.
fn images(n: &Nginx) -> (PathBuf, String) {
    let raw = n.dir.join("disk.raw");
    let mut b = vec![0u8; 5 << 20];
    for (i, v) in b.iter_mut().enumerate() {
        if (i >> 16) % 3 != 1 {
            *v = (i.wrapping_mul(2654435761) >> 11) as u8;
        }
    }
    std::fs::write(&raw, &b).unwrap();
    let d = n.dir.display();
    sh(&format!(
        "cd {d}; qemu-img convert -f raw -O qcow2 -c disk.raw www/private/disk.qcow2
         xz -k -T1 -0 www/private/disk.qcow2; cp disk.raw www/plain.img"
    ));
    let sum = Command::new("sha256sum")
        .arg(n.dir.join("www/private/disk.qcow2.xz"))
        .output()
        .unwrap();
    let sum = String::from_utf8_lossy(&sum.stdout)
        .split(' ')
        .next()
        .unwrap()
        .to_string();
    (raw, sum)
}

fn base_env(n: &Nginx, target: &Path, path: &str) -> Vec<(&'static str, String)> {
    vec![
        ("IMPORTER_SOURCE", "http".into()),
        (
            "IMPORTER_ENDPOINT",
            format!("https://localhost:{}/{path}", n.port),
        ),
        ("IMPORTER_CERT_DIR", n.dir.join("ca").display().to_string()),
        ("IMPORTER_TARGET", target.display().to_string()),
        (
            "IMPORTER_SCRATCH",
            n.dir.join("scratch").display().to_string(),
        ),
        ("IMPORTER_IMAGE_SIZE", "64Mi".into()),
    ]
}

#[test]
fn an_https_import_with_auth_headers_and_checksum_fills_the_volume() {
    let n = nginx("ok");
    let (raw, sum) = images(&n);
    let target = n.dir.join("disk.img");
    let mut env = base_env(&n, &target, "private/disk.qcow2.xz");
    env.extend([
        ("IMPORTER_ACCESS_KEY_ID", "alice".to_string()),
        ("IMPORTER_SECRET_KEY", "secret".to_string()),
        ("IMPORTER_EXTRA_HEADERS", "X-Token: abc".to_string()),
        ("IMPORTER_CHECKSUM", format!("sha256:{sum}")),
    ]);
    let o = importer(&env);
    assert!(o.status.success(), "{}", stderr(&o));
    // Grown to the size asked for; the image's bytes first, zeros after, holes for zeros.
    let got = std::fs::read(&target).unwrap();
    assert_eq!(got.len(), 64 << 20);
    let want = std::fs::read(&raw).unwrap();
    assert!(got[..want.len()] == want[..], "the image's bytes differ");
    assert!(got[want.len()..].iter().all(|b| *b == 0));
    assert!(std::fs::metadata(&target).unwrap().blocks() * 512 < 5 << 20);
    assert!(!n.dir.join("scratch").exists(), "scratch space left behind");

    // The same server, what it refuses: each an exit status 1 with the reason.
    let refused = |env: &[(&str, String)], words: &str| {
        let o = importer(env);
        assert!(
            !o.status.success() && stderr(&o).contains(words),
            "want {words:?}: {}",
            stderr(&o)
        );
    };
    let mut no_auth = env.clone();
    no_auth.retain(|(k, _)| *k != "IMPORTER_ACCESS_KEY_ID");
    refused(&no_auth, "HTTP 401");
    let mut no_header = env.clone();
    no_header.retain(|(k, _)| *k != "IMPORTER_EXTRA_HEADERS");
    refused(&no_header, "HTTP 403");
    let mut missing = env.clone();
    missing[1].1 = format!("https://localhost:{}/private/nothing.img", n.port);
    refused(&missing, "HTTP 404");
    let mut untrusted = env.clone();
    untrusted.retain(|(k, _)| *k != "IMPORTER_CERT_DIR");
    refused(&untrusted, "certificate");
    let mut wrong_sum = env.clone();
    wrong_sum.last_mut().unwrap().1 = format!("sha256:{}", "0".repeat(64));
    refused(&wrong_sum, "checksum mismatch");
    let mut too_small = base_env(&n, &target, "plain.img");
    too_small.last_mut().unwrap().1 = "4Mi".into();
    refused(&too_small, "A larger PVC is required");
}

#[test]
fn a_download_cut_short_and_a_blank_volume() {
    // A server that promises 1 MiB and sends half.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut req = [0u8; 4096];
        let _ = s.read(&mut req);
        let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 1048576\r\n\r\n");
        let _ = s.write_all(&vec![7u8; 512 << 10]);
    });
    let dir = std::env::temp_dir().join(format!("mv-importer-cut-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let target = dir.join("disk.img");
    let o = importer(&[
        (
            "IMPORTER_ENDPOINT",
            format!("http://127.0.0.1:{port}/disk.img"),
        ),
        ("IMPORTER_TARGET", target.display().to_string()),
        (
            "IMPORTER_SCRATCH",
            dir.join("scratch").display().to_string(),
        ),
    ]);
    assert!(!o.status.success(), "a cut download succeeded");
    assert!(
        stderr(&o).contains("the download broke off after 524288 of 1048576 bytes")
            || stderr(&o).contains("the download ended after 524288 of 1048576 bytes"),
        "{}",
        stderr(&o)
    );

    let o = importer(&[
        ("IMPORTER_SOURCE", "blank".into()),
        ("IMPORTER_IMAGE_SIZE", "1Gi".into()),
        ("IMPORTER_TARGET", target.display().to_string()),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let m = std::fs::metadata(&target).unwrap();
    assert_eq!((m.len(), m.blocks()), (1 << 30, 0));
    let o = importer(&[
        ("IMPORTER_SOURCE", "ftp".into()),
        ("IMPORTER_TARGET", target.display().to_string()),
    ]);
    assert!(
        stderr(&o).contains("accepted: http, s3, registry, blank, pvc, upload"),
        "{}",
        stderr(&o)
    );
    let _ = std::fs::remove_dir_all(dir);
}
