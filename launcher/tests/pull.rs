//! `virt-launcher run -f` with images it has not got: the manifest's kernelBoot container and
//! containerDisk are pulled from a real registry (Debian's docker-registry, filled with skopeo
//! as KubeVirt's containerDisks are built: the disk under `/disk/`, here a qcow2), the disk
//! converted to raw, and the probe guest boots from them and checks the disk. With
//! `--pull never` the same manifest is refused, naming the missing image.

use std::process::Command;

use tests::peers::{push, registry, sh};

#[test]
fn run_pulls_the_kernel_and_container_disk_it_has_not_got_and_boots() {
    tests::require_kvm();
    // Found beside virt-launcher, as installed.
    tests::build_bin("importer", "microvirt-pull");
    let reg = registry();
    let d = reg.dir.display();
    sh(&format!(
        "cd {d}; head -c 1048576 /dev/urandom > data.raw; truncate -s 8M data.raw
         qemu-img convert -f raw -O qcow2 data.raw data.qcow2"
    ));
    push(
        &reg,
        "microvirt/probe",
        "v1",
        &[("probe", &tests::probe_path())],
    );
    push(
        &reg,
        "disks/data",
        "v1",
        &[("disk/data.qcow2", &reg.dir.join("data.qcow2"))],
    );
    let manifest = reg.dir.join("vmi.yaml");
    std::fs::write(
        &manifest,
        format!(
            r#"apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: pulled}}
spec:
  domain:
    memory: {{guest: 64Mi}}
    devices:
      autoattachPodInterface: false
      disks: [{{name: data, disk: {{bus: virtio}}}}]
    firmware:
      kernelBoot:
        container: {{image: "127.0.0.1:{p}/microvirt/probe:v1", kernelPath: /probe}}
        kernelArgs: "console=ttyS0 probe.test=blk"
  volumes:
  - {{name: data, containerDisk: {{image: "127.0.0.1:{p}/disks/data:v1"}}}}
"#,
            p = reg.port
        ),
    )
    .unwrap();
    let images = reg.dir.join("images");
    let run = |pull: &str| {
        Command::new(env!("CARGO_BIN_EXE_virt-launcher"))
            .arg("run")
            .arg("-f")
            .arg(&manifest)
            .arg("--image-dir")
            .arg(&images)
            .arg("--state-dir")
            .arg(reg.dir.join("state"))
            .args(["--pull", pull, "--no-console-input"])
            .env("RUST_LOG", "error")
            .output()
            .unwrap()
    };
    let refused = run("never");
    let e = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{e}");
    assert!(e.contains("image not found"), "{e}");

    let out = run("missing");
    let stdout = tests::expect_success(&out, "");
    assert!(stdout.contains("PROBE RESULT blk OK"), "{stdout}");
    // What was pulled: the kernel as a file of the image, the disk converted to raw (the
    // guest wrote only to its copy), the layers kept by digest for the next pull.
    let kernel = images.join(format!("127.0.0.1_{}_microvirt_probe_v1/probe", reg.port));
    assert_eq!(
        std::fs::read(kernel).unwrap(),
        std::fs::read(tests::probe_path()).unwrap()
    );
    let disk = images.join(format!("127.0.0.1_{}_disks_data_v1/disk.img", reg.port));
    assert!(
        std::fs::read(disk).unwrap() == std::fs::read(reg.dir.join("data.raw")).unwrap(),
        "the pulled disk differs from the image's"
    );
    let blobs = std::fs::read_dir(images.join(".blobs/sha256"))
        .unwrap()
        .count();
    assert_eq!(blobs, 2);
    // Present now: a second run needs no registry.
    // SAFETY: a signal to our own child, the registry.
    unsafe { libc::kill(reg.child.id() as i32, libc::SIGKILL) };
    let again = run("missing");
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("PROBE RESULT blk OK"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
}
