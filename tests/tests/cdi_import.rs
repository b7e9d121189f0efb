//! DataVolumes filled by microvirt's own importer, end to end against the in-process API
//! server: virt-controller (its deployed RBAC) makes each claim and importer Pod; the node
//! stand-in binds claims to directories and runs the Pods' container — the real `cdi-importer`
//! as the Pod's user — against real peers: nginx over TLS with basic auth and headers, Debian's
//! docker-registry holding a containerDisk pushed with skopeo, moto's S3 server checking the
//! signatures of the importer's requests. What lands in each claim is
//! compared with `qemu-img convert -O raw` of the same image. A VM with `dataVolumeTemplates`
//! waits (Provisioning) and gets its VMI once every import has Succeeded; the launcher then runs
//! that VMI on the claims and the probe guest checks every disk. Bad sources end
//! Failed with the reason, after bounded retries where retrying can help, and never Ready.

use std::time::Duration;

use api::cdi::{DataVolume, DataVolumePhase};
use api::{VirtualMachine, VirtualMachineInstance};
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Pod, Secret};
use kube::api::PostParams;
use tests::cluster::{eventually, test_config, Cluster, NS};
use tests::peers::{nginx, push, registry, sh, Server};
use tests::storage::ImportNode;

const T: Duration = Duration::from_secs(60);

fn config() -> controller::context::ControllerConfig {
    let mut c = test_config();
    c.importer.max_restarts = 2;
    c.import_progress_interval = Duration::from_millis(200);
    c
}

/// The ConfigMap `cas` (a certConfigMap) holding the web server's CA.
async fn trust_ca(c: &Cluster, ca: &str) {
    let cm: ConfigMap = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "cas"}, "data": {"ca.crt": ca}}))
    .unwrap();
    c.api::<ConfigMap>()
        .create(&PostParams::default(), &cm)
        .await
        .unwrap();
}

/// The DataVolume once `pred` holds of it.
async fn dv_when(
    c: &Cluster,
    name: &str,
    what: &str,
    pred: impl Fn(&DataVolume) -> bool,
) -> DataVolume {
    let dvs = c.api::<DataVolume>();
    eventually(&format!("DataVolume {name} {what}"), T, || async {
        let d = dvs.get_opt(name).await.unwrap()?;
        if std::env::var_os("DEBUG_DV").is_some() {
            eprintln!("{name}: {:?}", d.status);
        }
        pred(&d).then_some(d)
    })
    .await
}

fn phase(d: &DataVolume) -> Option<DataVolumePhase> {
    d.status.as_ref()?.phase
}

fn condition(d: &DataVolume, t: &str) -> (String, String, String) {
    let c = d
        .status
        .as_ref()
        .unwrap()
        .conditions
        .iter()
        .find(|c| c.type_ == t)
        .unwrap_or_else(|| panic!("no {t} condition: {:?}", d.status));
    (
        c.status.clone(),
        c.reason.clone().unwrap_or_default(),
        c.message.clone().unwrap_or_default(),
    )
}

/// A 6 MiB image with zero stretches: raw in `dir`, and as compressed qcow2, xz'd, in
/// `www/private/`; its sha256 as served.
fn image(n: &Server) -> (Vec<u8>, String) {
    let mut b = vec![0u8; 6 << 20];
    for (i, v) in b.iter_mut().enumerate() {
        if (i >> 16) % 3 != 1 {
            *v = (i.wrapping_mul(2654435761) >> 11) as u8;
        }
    }
    std::fs::write(n.dir.join("disk.raw"), &b).unwrap();
    let d = n.dir.display();
    sh(&format!(
        "cd {d}; qemu-img convert -f raw -O qcow2 -c disk.raw www/private/disk.qcow2
         xz -k -T1 -0 www/private/disk.qcow2
         qemu-img convert -f qcow2 -O raw www/private/disk.qcow2 converted.raw
         head -c 8388608 /dev/urandom > www/slow/big.img
         chmod -R a+rX www"
    ));
    let want = std::fs::read(n.dir.join("converted.raw")).unwrap();
    assert_eq!(want, b, "qemu-img's conversion");
    let sum = sh(&format!(
        "sha256sum {d}/www/private/disk.qcow2.xz | cut -d' ' -f1"
    ));
    (want, sum)
}

fn disk_of(node: &ImportNode, claim: &str) -> Vec<u8> {
    std::fs::read(node.claim_dir(NS, claim).join("disk.img")).unwrap()
}

/// The VMI virt-controller made, run by the launcher on the claims as they are on the node:
/// the probe guest writes, reads back and verifies a pattern on every disk.
fn boot_probe_on(node: &ImportNode, vmi: &VirtualMachineInstance, work: &std::path::Path) {
    tests::require_kvm();
    let launcher = tests::build_bin("launcher", "virt-launcher");
    let manifest = work.join("vmi.yaml");
    std::fs::write(&manifest, serde_yaml::to_string(vmi).unwrap()).unwrap();
    let out = std::process::Command::new(launcher)
        .arg("run")
        .arg("-f")
        .arg(&manifest)
        .arg("--volume-dir")
        .arg(node.root.join(NS))
        .arg("--state-dir")
        .arg(work.join("state"))
        .arg("--default-kernel")
        .arg(tests::probe_path())
        .args(["--extra-cmdline", "probe.test=blk", "--network", "none"])
        .args(["--pull", "never", "--no-console-input"])
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("PROBE RESULT blk OK"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_waits_for_its_imports_from_web_registry_and_blank_and_a_clone_copies_a_claim() {
    let work = std::env::temp_dir().join(format!("mv-cdi-import-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let c = Cluster::start().await;
    let _controller = c.replica(config(), None);
    let node = ImportNode::start(&c, &work);
    let web = nginx("cdi-e2e");
    let (want, sum) = image(&web);
    let reg = registry();
    sh(&format!(
        "cd {d}; head -c 3145728 /dev/urandom > reg.raw; truncate -s 5M reg.raw
         qemu-img convert -f raw -O qcow2 reg.raw reg.qcow2",
        d = reg.dir.display()
    ));
    push(
        &reg,
        "disks/probe",
        "v1",
        &[("disk/disk.qcow2", &reg.dir.join("reg.qcow2"))],
    );
    let (bucket, key_id, secret_key) = tests::peers::s3(&[(
        "vm/disk.qcow2.xz",
        &web.dir.join("www/private/disk.qcow2.xz"),
    )]);
    let ca = std::fs::read_to_string(web.dir.join("ca/ca.crt")).unwrap();
    c.apply_yaml::<Secret>(
        "metadata: {name: creds}\nstringData: {accessKeyId: alice, secretKey: secret}",
    )
    .await;
    c.apply_yaml::<Secret>(&format!("metadata: {{name: s3-keys}}\nstringData: {{accessKeyId: {key_id}, secretKey: {secret_key}}}"),
    )
    .await;
    c.apply_yaml::<Secret>("metadata: {name: token}\nstringData: {x: 'X-Token: abc'}")
        .await;
    trust_ca(&c, &ca).await;

    c.apply_yaml::<VirtualMachine>(&format!(
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: web}}
spec:
  runStrategy: Always
  dataVolumeTemplates:
  - metadata: {{name: web-root}}
    spec:
      source:
        http:
          url: https://localhost:{wp}/private/disk.qcow2.xz
          secretRef: creds
          certConfigMap: cas
          secretExtraHeaders: [token]
          checksum: sha256:{sum}
      storage: {{resources: {{requests: {{storage: 64Mi}}}}}}
  - metadata: {{name: web-reg}}
    spec:
      source: {{registry: {{url: "docker://127.0.0.1:{rp}/disks/probe:v1"}}}}
      storage: {{resources: {{requests: {{storage: 32Mi}}}}}}
  - metadata: {{name: web-s3}}
    spec:
      source: {{s3: {{url: "http://127.0.0.1:{sp}/images/vm/disk.qcow2.xz", secretRef: s3-keys}}}}
      storage: {{resources: {{requests: {{storage: 8Mi}}}}}}
  - metadata: {{name: web-scratch}}
    spec:
      source: {{blank: {{}}}}
      pvc: {{accessModes: [ReadWriteOnce], resources: {{requests: {{storage: 16Mi}}}}}}
  template:
    spec:
      domain:
        memory: {{guest: 64Mi}}
        devices:
          disks:
          - {{name: root, disk: {{bus: virtio}}}}
          - {{name: reg, disk: {{bus: virtio}}}}
          - {{name: scratch, disk: {{bus: virtio}}}}
          - {{name: s3, disk: {{bus: virtio}}}}
      volumes:
      - {{name: root, dataVolume: {{name: web-root}}}}
      - {{name: reg, dataVolume: {{name: web-reg}}}}
      - {{name: scratch, dataVolume: {{name: web-scratch}}}}
      - {{name: s3, dataVolume: {{name: web-s3}}}}
"#,
        wp = web.port,
        rp = reg.port,
        sp = bucket.port
    ))
    .await;

    // The claims CDI would make: the DataVolume's name, controlled by it, with the file
    // system overhead on `storage` and `pvc` taken as written.
    let pvcs = c.api::<PersistentVolumeClaim>();
    let root_claim = eventually("web-root's claim", T, || async {
        pvcs.get_opt("web-root").await.unwrap()
    })
    .await;
    let spec = root_claim.spec.unwrap();
    assert_eq!(
        spec.resources.unwrap().requests.unwrap()["storage"].0,
        "69Mi"
    );
    assert_eq!(spec.access_modes.unwrap(), ["ReadWriteOnce"]);
    let scratch_claim = eventually("web-scratch's claim", T, || async {
        pvcs.get_opt("web-scratch").await.unwrap()
    })
    .await;
    assert_eq!(
        scratch_claim
            .spec
            .unwrap()
            .resources
            .unwrap()
            .requests
            .unwrap()["storage"]
            .0,
        "16Mi"
    );

    for dv in ["web-root", "web-reg", "web-scratch", "web-s3"] {
        let d = dv_when(&c, dv, "Succeeded", |d| {
            phase(d) == Some(DataVolumePhase::Succeeded)
        })
        .await;
        let s = d.status.as_ref().unwrap();
        assert_eq!(s.progress.as_deref(), Some("100.0%"), "{dv}");
        assert_eq!(s.claim_name.as_deref(), Some(dv));
        assert_eq!(condition(&d, "Ready").0, "True", "{dv}");
        assert_eq!(condition(&d, "Bound").0, "True", "{dv}");
        assert_eq!(s.restart_count, Some(0), "{dv}: {:?}", s.conditions);
    }
    // Byte for byte what qemu-img converts, grown to the size asked for.
    let root = disk_of(&node, "web-root");
    assert_eq!(root.len(), 64 << 20);
    assert!(
        root[..want.len()] == want[..],
        "web-root differs from qemu-img's conversion"
    );
    assert!(root[want.len()..].iter().all(|b| *b == 0));
    assert!(
        disk_of(&node, "web-s3")[..want.len()] == want[..],
        "web-s3 differs from qemu-img's conversion"
    );
    let reg_disk = disk_of(&node, "web-reg");
    let reg_raw = std::fs::read(reg.dir.join("reg.raw")).unwrap();
    assert!(reg_disk[..reg_raw.len()] == reg_raw[..], "web-reg differs");
    let scratch = std::fs::metadata(node.claim_dir(NS, "web-scratch").join("disk.img")).unwrap();
    assert_eq!(scratch.len(), 16 << 20);
    // Importer Pods are removed once done.
    let pods = c.api::<Pod>();
    eventually("importer Pods gone", T, || async {
        let l = pods.list(&Default::default()).await.unwrap();
        (!l.items.iter().any(|p| {
            p.metadata
                .name
                .as_deref()
                .unwrap_or("")
                .starts_with("importer-")
        }))
        .then_some(())
    })
    .await;
    // With every import done, the VM gets its VMI, the claims as its volumes.
    let vmi = eventually("the VMI", T, || async { c.vmi("web").await }).await;
    assert_eq!(vmi.spec.volumes.len(), 4);
    boot_probe_on(&node, &vmi, &work);
    // The guest wrote to the claim itself (a claim is the VM's disk, not a copy).
    let booted = disk_of(&node, "web-root");
    assert!(booted.windows(15).any(|w| w == b"MVPROBE sector "));

    // A slow download shows its progress while it runs, read from the importer as CDI does.
    c.apply_yaml::<DataVolume>(&format!(
            "apiVersion: cdi.kubevirt.io/v1beta1\nkind: DataVolume\nmetadata: {{name: slow}}\nspec:\n  source: {{http: {{url: 'https://localhost:{}/slow/big.img', certConfigMap: cas}}}}\n  storage: {{resources: {{requests: {{storage: 16Mi}}}}}}",
            web.port
        ),
    )
    .await;
    let d = dv_when(&c, "slow", "in progress, part done", |d| {
        let s = d.status.as_ref();
        let p = s
            .and_then(|s| s.progress.as_deref())
            .and_then(|p| p.strip_suffix('%'))
            .and_then(|p| p.parse::<f64>().ok());
        phase(d) == Some(DataVolumePhase::ImportInProgress)
            && p.is_some_and(|p| p > 0.0 && p < 100.0)
    })
    .await;
    assert_eq!(condition(&d, "Running").0, "True");
    assert_eq!(condition(&d, "Running").1, "Pod is running");
    dv_when(&c, "slow", "Succeeded", |d| {
        phase(d) == Some(DataVolumePhase::Succeeded)
    })
    .await;

    // A clone of a claim in the namespace copies it.
    c.apply_yaml::<DataVolume>("apiVersion: cdi.kubevirt.io/v1beta1\nkind: DataVolume\nmetadata: {name: copy}\nspec:\n  source: {pvc: {name: web-root}}\n  storage: {}",
    )
    .await;
    let d = dv_when(&c, "copy", "Succeeded", |d| {
        matches!(
            phase(d),
            Some(DataVolumePhase::Succeeded | DataVolumePhase::Failed)
        )
    })
    .await;
    assert_eq!(
        phase(&d),
        Some(DataVolumePhase::Succeeded),
        "{:?}",
        d.status
    );
    assert!(
        disk_of(&node, "copy") == booted,
        "the clone differs from its source"
    );
    node.stop().await;
    let _ = std::fs::remove_dir_all(&work);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_sources_fail_with_the_reason_and_are_never_ready() {
    let work = std::env::temp_dir().join(format!("mv-cdi-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let c = Cluster::start().await;
    let _controller = c.replica(config(), None);
    let node = ImportNode::start(&c, &work);
    let web = nginx("cdi-bad");
    let d = web.dir.display();
    sh(&format!(
        "cd {d}; qemu-img create -q -f qcow2 base.qcow2 8M
         qemu-img create -q -f qcow2 -b {d}/base.qcow2 -F qcow2 www/backed.qcow2 8M
         qemu-img create -q -f qcow2 www/huge.qcow2 128M
         head -c 1048576 /dev/urandom > www/plain.img; chmod -R a+rX www"
    ));
    let dv = |name: &str, source: String| {
        format!(
            "apiVersion: cdi.kubevirt.io/v1beta1\nkind: DataVolume\nmetadata: {{name: {name}}}\nspec:\n  source: {source}\n  storage: {{resources: {{requests: {{storage: 16Mi}}}}}}"
        )
    };
    let url = |path: &str| format!("https://localhost:{}/{path}", web.port);
    let ca = std::fs::read_to_string(web.dir.join("ca/ca.crt")).unwrap();
    trust_ca(&c, &ca).await;
    let http = |path: &str, extra: &str| {
        format!(
            "{{http: {{url: '{}', certConfigMap: cas{extra}}}}}",
            url(path)
        )
    };
    for (name, source) in [
        ("missing", http("nothing.img", "")),
        (
            "badsum",
            http(
                "plain.img",
                &format!(", checksum: 'sha256:{}'", "0".repeat(64)),
            ),
        ),
        ("backed", http("backed.qcow2", "")),
        ("huge", http("huge.qcow2", "")),
        ("gcs", "{gcs: {url: 'gs://bucket/disk.img'}}".to_string()),
    ] {
        c.apply_yaml::<DataVolume>(&dv(name, source)).await;
    }
    let failed = |name: &'static str| {
        dv_when(&c, name, "Failed", |d| {
            phase(d) == Some(DataVolumePhase::Failed)
        })
    };
    // A 404 may pass (the image may not be uploaded yet): retried, then given up.
    let d = failed("missing").await;
    let (ready, reason, msg) = condition(&d, "Ready");
    assert_eq!((ready.as_str(), reason.as_str()), ("False", "SourceError"));
    assert!(
        msg.starts_with("gave up after 2 restarts") && msg.contains("HTTP 404"),
        "{msg}"
    );
    assert_eq!(d.status.as_ref().unwrap().restart_count, Some(2));
    // What no retry can mend fails at once, with the reason.
    for (name, reason, words) in [
        ("badsum", "ChecksumError", "checksum mismatch"),
        ("backed", "ImageFormatError", "backing file"),
        ("huge", "LargerPVCRequired", "A larger PVC is required"),
    ] {
        let d = failed(name).await;
        let (_, r, msg) = condition(&d, "Running");
        assert_eq!(r, reason, "{name}: {msg}");
        assert!(msg.contains(words), "{name}: {msg}");
        // Failed at its first failure, not retried.
        assert_eq!(d.status.as_ref().unwrap().restart_count, Some(1), "{name}");
        assert!(!msg.starts_with("gave up"), "{name}: {msg}");
    }
    let d = failed("gcs").await;
    let (_, r, msg) = condition(&d, "Ready");
    assert_eq!(r, "InvalidSpec");
    assert!(msg.starts_with("spec.source.gcs: is not served"), "{msg}");
    // The Pods are gone and stay gone; the claims were never Ready.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let pods = c.api::<Pod>().list(&Default::default()).await.unwrap();
    assert!(
        pods.items.is_empty(),
        "{:?}",
        pods.items
            .iter()
            .map(|p| p.metadata.name.clone())
            .collect::<Vec<_>>()
    );
    for name in ["missing", "badsum", "backed", "huge", "gcs"] {
        let d = c.api::<DataVolume>().get(name).await.unwrap();
        assert_eq!(phase(&d), Some(DataVolumePhase::Failed), "{name}");
    }
    node.stop().await;
    let _ = std::fs::remove_dir_all(&work);
}

/// `virtctl image-upload` as a namespace user: the DataVolume made, its upload server (the
/// importer in upload mode) waited for, a token from virt-api's UploadTokenRequest (through
/// the API server's aggregation, the user's RBAC checked), the file through virt-api's upload
/// proxy into the claim. A request without a valid token is refused by the proxy and by the
/// upload server itself; a user without CDI's edit role gets no token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn virtctl_image_upload_fills_a_datavolume_through_the_proxy() {
    use tests::rbac::Authorizer;
    use tests::virt_api::grant;
    tests::build_bin("virt-api", "virtctl");
    let bins = tests::build_bin("virt-api", "virt-api")
        .parent()
        .unwrap()
        .to_path_buf();
    let work = std::env::temp_dir().join(format!("mv-cdi-upload-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let c = Cluster::start().await;
    let cdi_roles =
        std::fs::read_to_string(tests::repo_root().join("deploy/cdi/upload.yaml")).unwrap();
    c.api.enforce_rbac(
        Authorizer::from_dir(&tests::repo_root().join("deploy/rbac"))
            .with_yaml(&cdi_roles)
            .with_yaml(&grant("alice", "cdi.kubevirt.io:edit", NS))
            .with_yaml(&grant("bob", "cdi.kubevirt.io:view", NS)),
    );
    let _controller = c.replica(config(), None);
    let node = ImportNode::start(&c, &work.join("volumes"));
    let virt_api = tests::virt_api::start(&c, &bins.join("virt-api"), &work, &[]).await;
    let d = work.display();
    sh(&format!(
        "cd {d}; head -c 2097152 /dev/urandom > disk.raw; truncate -s 6M disk.raw
         qemu-img convert -f raw -O qcow2 disk.raw disk.qcow2; gzip -k disk.qcow2"
    ));
    let alice = work.join("alice.kubeconfig");
    c.api.write_kubeconfig(&alice, Some("alice"));
    let bob = work.join("bob.kubeconfig");
    c.api.write_kubeconfig(&bob, Some("bob"));
    let proxy = format!("https://{}", virt_api.addr);
    let virtctl = |kubeconfig: &std::path::Path, args: Vec<String>| {
        let (bin, kc) = (bins.join("virtctl"), kubeconfig.to_path_buf());
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(bin)
                .arg("--kubeconfig")
                .arg(kc)
                .args(args)
                .output()
                .unwrap()
        })
    };
    let upload_args = |name: &str| -> Vec<String> {
        [
            "image-upload",
            "dv",
            name,
            "--size=16Mi",
            "--image-path",
            &format!("{d}/disk.qcow2.gz"),
            "--uploadproxy-url",
            &proxy,
            "--insecure",
            "--wait-secs=60",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let out = virtctl(&alice, upload_args("up")).await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("Pod now ready"), "{stdout}");
    assert!(
        stdout.contains("Uploading data completed successfully")
            && stdout.contains("Processing completed successfully"),
        "{stdout}"
    );
    let d = c.api::<DataVolume>().get("up").await.unwrap();
    assert_eq!(phase(&d), Some(DataVolumePhase::Succeeded));
    let got = disk_of(&node, "up");
    let want = std::fs::read(work.join("disk.raw")).unwrap();
    assert_eq!(got.len(), 16 << 20);
    assert!(
        got[..want.len()] == want[..],
        "the upload differs from the image"
    );

    // Without a valid token the proxy takes nothing.
    let raw = std::process::Command::new("curl")
        .args(["-sk", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST"])
        .args([
            "-H",
            "Authorization: Bearer forged.token.value",
            "--data-binary",
            "abc",
        ])
        .arg(format!("{proxy}/v1beta1/upload"))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&raw.stdout), "401");
    // A viewer may not create DataVolumes or ask for upload tokens.
    let out = virtctl(&bob, upload_args("bobs")).await.unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("forbidden"), "{e}");
    node.stop().await;
    drop(virt_api);
    let _ = std::fs::remove_dir_all(&work);
}
