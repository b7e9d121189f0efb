//! `virt-launcher run -f`: translation golden tests, every probe example booted to its result
//! line, and the documented errors for malformed manifests.

use std::path::{Path, PathBuf};
use std::process::Command;

use launcher::translate::{translate, Environment};

fn repo() -> PathBuf {
    tests::repo_root()
}

/// An image/volume layout like a node's, in a temp dir.
struct Fixture {
    root: PathBuf,
}

impl Fixture {
    fn new(tag: &str) -> Fixture {
        let root = tests::probe_workdir(&format!("mv-manifests-{tag}"));
        let img = root.join("images");
        std::fs::create_dir_all(img.join("quay.io_containerdisks_fedora_40")).unwrap();
        std::fs::write(
            img.join("quay.io_containerdisks_fedora_40/disk.img"),
            vec![0u8; 1 << 20],
        )
        .unwrap();
        std::fs::create_dir_all(img.join("registry.example.com_kernels_linux_6.1/boot")).unwrap();
        std::fs::copy(
            tests::probe_path(),
            img.join("registry.example.com_kernels_linux_6.1/boot/vmlinux"),
        )
        .unwrap();
        std::fs::write(
            img.join("registry.example.com_kernels_linux_6.1/boot/initramfs.cpio.gz"),
            b"initrd",
        )
        .unwrap();
        for claim in ["data-pvc", "full-root"] {
            std::fs::create_dir_all(root.join("volumes").join(claim)).unwrap();
            std::fs::write(
                root.join("volumes").join(claim).join("disk.img"),
                vec![0u8; 1 << 20],
            )
            .unwrap();
        }
        Fixture { root }
    }

    fn env(&self) -> Environment {
        Environment {
            image_dir: self.root.join("images"),
            volume_dir: self.root.join("volumes"),
            state_dir: self.root.join("state"),
            default_kernel: PathBuf::from("/usr/share/microvirt/vmlinux"),
            default_initrd: None,
            extra_cmdline: String::new(),
            seccomp: true,
        }
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn golden(name: &str, actual: &str) {
    let path = repo().join("launcher/tests/golden").join(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, actual).unwrap();
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|_| panic!("missing golden file {}", path.display()));
    assert_eq!(
        actual,
        expected,
        "translation differs from {} (UPDATE_GOLDEN=1 rewrites it)",
        path.display()
    );
}

#[test]
fn translation_golden_full_vm() {
    let f = Fixture::new("golden");
    let text = std::fs::read_to_string(repo().join("api/tests/data/vm-full.yaml")).unwrap();
    // The full manifest also carries hostDisk at an absolute path; point it into the fixture.
    let text = text.replace(
        "/var/lib/vms/host.img",
        &f.root.join("host.img").display().to_string(),
    );
    // It carries a field no KubeVirt version has (the API types keep it verbatim): the
    // launcher refuses it by path rather than ignore it.
    let e = launcher::manifest::parse("vm-full.yaml", &text)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("spec.template.spec.futureField: is not a field microvirt knows"),
        "{e}"
    );
    let text = text.replace("      futureField:\n        something: 1\n", "");
    let m = launcher::manifest::parse("vm-full.yaml", &text).unwrap();
    let plan = translate(&m.name(), m.vmi_spec(), &f.env()).unwrap();
    let described = plan
        .describe()
        .replace(&f.root.display().to_string(), "$ROOT");
    golden("vm-full.txt", &described);
    // Preparing creates the files the guest needs.
    let ephemeral = plan.prepare().unwrap();
    assert!(
        f.root.join("host.img").exists(),
        "hostDisk DiskOrCreate creates its image"
    );
    assert_eq!(
        std::fs::metadata(f.root.join("host.img")).unwrap().len(),
        1 << 30
    );
    assert_eq!(
        ephemeral.len(),
        3,
        "containerDisk copy, emptyDisk and cloud-init seed are ephemeral"
    );
}

#[test]
fn translation_golden_examples() {
    let f = Fixture::new("examples");
    for ex in ["probe-smp.yaml", "probe-blk.yaml"] {
        let m = launcher::manifest::read(&repo().join("examples").join(ex).display().to_string())
            .unwrap();
        let plan = translate(&m.name(), m.vmi_spec(), &f.env()).unwrap();
        golden(
            &ex.replace(".yaml", ".txt"),
            &plan
                .describe()
                .replace(&f.root.display().to_string(), "$ROOT"),
        );
    }
}

fn launcher_run(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_virt-launcher"))
        .arg("run")
        .args(args)
        .arg("--no-console-input")
        .env("RUST_LOG", "error")
        .output()
        .unwrap()
}

#[test]
fn every_probe_example_boots_to_its_result_line() {
    tests::require_kvm();
    let f = Fixture::new("run");
    let mut n = 0;
    for entry in std::fs::read_dir(repo().join("examples")).unwrap() {
        let p = entry.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        if !name.starts_with("probe-") {
            continue;
        }
        let test = name.trim_start_matches("probe-").trim_end_matches(".yaml");
        let out = launcher_run(&[
            "-f",
            p.to_str().unwrap(),
            "--image-dir",
            f.root.join("images").to_str().unwrap(),
            "--state-dir",
            f.root.join("state").to_str().unwrap(),
        ]);
        let stdout = tests::expect_success(&out, &name);
        let line = format!("PROBE RESULT {test} OK");
        assert!(stdout.contains(&line), "{name}: no {line:?} in\n{stdout}");
        n += 1;
    }
    assert!(n >= 4, "only {n} probe examples");
    // Ephemeral files are gone after the VM stopped; the state dir holds nothing but dirs.
    let leftovers: Vec<_> = walk(&f.root.join("state"))
        .into_iter()
        .filter(|p| p.is_file())
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    let _ = std::fs::remove_file("/tmp/microvirt-probe-blk-data.img");
}

fn walk(p: &Path) -> Vec<PathBuf> {
    let mut out = vec![];
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            let path = e.path();
            if path.is_dir() {
                out.extend(walk(&path));
            }
            out.push(path);
        }
    }
    out
}

fn assert_rejected(manifest: &str, expected: &[&str]) {
    let path = std::env::temp_dir().join(format!(
        "mv-bad-{}-{}.yaml",
        std::process::id(),
        expected[0].len()
    ));
    std::fs::write(&path, manifest).unwrap();
    // Offline: these are about the manifest, not about pulling the images it names.
    let out = launcher_run(&["-f", path.to_str().unwrap(), "--pull", "never"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    for e in expected {
        assert!(stderr.contains(e), "expected {e:?} in:\n{stderr}");
    }
    assert!(out.stdout.is_empty());
    std::fs::remove_file(path).unwrap();
}

#[test]
fn malformed_manifests_are_rejected_with_exit_code_2() {
    assert_rejected("apiVersion: kubevirt.io/v1\nkind: VirtualMachine\nmetadata:\n  name: [unclosed\n", &["YAML syntax error at line 5, column 1: did not find expected ',' or ']', while parsing a flow sequence"]);
    assert_rejected("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n", &["apiVersion \"v1\" kind \"Pod\" is not accepted; accepted: apiVersion kubevirt.io/v1 with kind VirtualMachine, VirtualMachineInstance or VirtualMachineInstanceReplicaSet, or pool.kubevirt.io/v1beta1 VirtualMachinePool"]);
    assert_rejected(
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {name: x}\nspec:\n  domain:\n    memory: {guest: 64Mi}\n    devices:\n      disks: [{name: d, disk: {bus: sata}}]\n    firmware: {bootloader: {efi: {}}}\n  volumes: [{name: d, emptyDisk: {capacity: 1Gi}}]\n",
        &[
            "VirtualMachineInstance x is invalid:",
            "spec.domain.devices.disks[0].disk.bus: bus \"sata\" is not supported by microvirt; accepted: virtio",
            "spec.domain.firmware.bootloader.efi: EFI firmware is not supported",
        ],
    );
    assert_rejected(
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {name: y}\nspec:\n  domain:\n    memory: {guest: 64Mi}\n    devices: {autoattachPodInterface: false}\n    firmware: {kernelBoot: {container: {image: nope/none, kernelPath: /k}}}\n",
        &["spec.domain.firmware.kernelBoot.container.image: image not found at"],
    );
}

/// KubeVirt's published examples size memory in decimal units: `1024M` is 976.56 MiB, and the
/// guest gets 977 MiB (rounded up to the VMM's MiB granularity), not an error.
#[test]
fn decimal_memory_is_rounded_up_to_whole_mib() {
    let f = Fixture::new("decimal");
    for (q, mib) in [("1024M", 977), ("1G", 954), ("2e8", 191), ("64Mi", 64)] {
        let yaml = format!(
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {{name: d}}\nspec:\n  domain:\n    memory: {{guest: \"{q}\"}}\n    devices: {{autoattachPodInterface: false}}\n"
        );
        let path = f.root.join("d.yaml");
        std::fs::write(&path, yaml).unwrap();
        let m = launcher::manifest::read(&path.display().to_string()).unwrap();
        let plan = translate(&m.name(), m.vmi_spec(), &f.env()).unwrap();
        assert_eq!(plan.config.memory_mib, mib, "{q}");
    }
}

/// A corpus of manifests in the styles KubeVirt users write (`launcher/tests/corpus/`): each is
/// translated to its golden plan, or refused with its golden message (`<name>.plan`, with the
/// warnings first). `UPDATE_GOLDEN=1` rewrites them.
#[test]
fn corpus_of_kubevirt_manifests() {
    let f = Fixture::new("corpus");
    for image in [
        "quay.io_kubevirt_cirros-container-disk-demo_latest",
        "quay.io_containerdisks_alpine_3.20",
    ] {
        let d = f.root.join("images").join(image);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("disk.img"), vec![0u8; 1 << 20]).unwrap();
    }
    let dir = repo().join("launcher/tests/corpus");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 10, "{files:?}");
    for path in files {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let shown = format!("corpus/{name}");
        let text = std::fs::read_to_string(&path).unwrap();
        let result = launcher::manifest::parse_with(&shown, &text, Default::default())
            .map_err(|e| e.to_string())
            .and_then(|m| {
                let mut out: String = m
                    .warnings()
                    .iter()
                    .map(|w| format!("warning: {w}\n"))
                    .collect();
                let plan =
                    translate(&m.name(), m.vmi_spec(), &f.env()).map_err(|e| e.to_string())?;
                out.push_str(&plan.describe());
                Ok(out)
            });
        let actual = match result {
            Ok(plan) => plan,
            Err(e) => format!("error: {e}\n"),
        }
        .replace(&f.root.display().to_string(), "$ROOT");
        let golden_path = dir.join(name.replace(".yaml", ".plan"));
        if std::env::var_os("UPDATE_GOLDEN").is_some() {
            std::fs::write(&golden_path, &actual).unwrap();
        }
        let expected = std::fs::read_to_string(&golden_path).unwrap_or_else(|_| {
            panic!(
                "missing {} (UPDATE_GOLDEN=1 writes it)",
                golden_path.display()
            )
        });
        assert_eq!(actual, expected, "{name} (UPDATE_GOLDEN=1 rewrites it)");
    }
}

/// What an image or a claim holds is not the launcher's: a containerDisk whose disk.img is a
/// link to a host file, a claim directory that is a link to another VM's volume, a kernelBoot
/// kernel that links out of its image — each refused by field, without reading the target. A
/// link that stays inside its image is followed.
#[test]
fn links_out_of_images_and_volumes_are_refused() {
    let f = Fixture::new("links");
    let images = f.root.join("images");
    let volumes = f.root.join("volumes");
    let outside = f.root.join("other-vm");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("disk.img"), vec![7u8; 4096]).unwrap();
    let evil = images.join("evil_disk_1");
    std::fs::create_dir_all(&evil).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", evil.join("disk.img")).unwrap();
    let kern = images.join("evil_kernel_1");
    std::fs::create_dir_all(&kern).unwrap();
    std::os::unix::fs::symlink(outside.join("disk.img"), kern.join("vmlinux")).unwrap();
    std::os::unix::fs::symlink(&outside, volumes.join("stolen")).unwrap();
    let fine = images.join("fine_disk_1");
    std::fs::create_dir_all(fine.join("real")).unwrap();
    std::fs::write(fine.join("real/disk.img"), vec![0u8; 4096]).unwrap();
    std::os::unix::fs::symlink("real/disk.img", fine.join("disk.img")).unwrap();

    let vmi = |devices: &str, volumes: &str, firmware: &str| {
        format!("apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {{name: l}}\nspec:\n  domain:\n    memory: {{guest: 64Mi}}\n    devices: {{autoattachPodInterface: false, disks: [{devices}]}}\n{firmware}  volumes: [{volumes}]\n")
    };
    let translate_yaml = |yaml: String| {
        let path = f.root.join("l.yaml");
        std::fs::write(&path, yaml).unwrap();
        let m = launcher::manifest::read(&path.display().to_string()).unwrap();
        translate(&m.name(), m.vmi_spec(), &f.env()).map(|p| p.disks.len())
    };
    let e = translate_yaml(vmi(
        "{name: d, disk: {}}",
        "{name: d, containerDisk: {image: evil/disk:1}}",
        "",
    ))
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("spec.volumes[0].containerDisk.image")
            && e.contains("leads outside the image directory"),
        "{e}"
    );
    let e = translate_yaml(vmi(
        "{name: d, disk: {}}",
        "{name: d, persistentVolumeClaim: {claimName: stolen}}",
        "",
    ))
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("spec.volumes[0].persistentVolumeClaim.claimName")
            && e.contains("leads outside the volume directory"),
        "{e}"
    );
    let e = translate_yaml(vmi(
        "",
        "",
        "    firmware: {kernelBoot: {container: {image: evil/kernel:1, kernelPath: /vmlinux}}}\n",
    ))
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("spec.domain.firmware.kernelBoot.container.kernelPath")
            && e.contains("leads outside the image directory"),
        "{e}"
    );
    assert_eq!(
        translate_yaml(vmi(
            "{name: d, disk: {}}",
            "{name: d, containerDisk: {image: fine/disk:1}}",
            "",
        ))
        .unwrap(),
        1,
        "a link inside the image is followed"
    );
}

/// KubeVirt's `filesystems` with `virtiofs: {}`: a claim shared read-write, a ConfigMap and a
/// ServiceAccount's token shared read-only, each served by a virtiofsd the launcher starts;
/// the probe mounts by tag.
#[test]
fn virtiofs_filesystems_share_a_claim_and_a_read_only_config_map() {
    tests::require_kvm();
    let f = Fixture::new("virtiofs");
    let volumes = f.root.join("volumes");
    std::fs::create_dir_all(volumes.join("shared-pvc")).unwrap();
    std::fs::write(volumes.join("shared-pvc/hello.txt"), "from the claim\n").unwrap();
    std::fs::create_dir_all(volumes.join("configmap/app-config")).unwrap();
    std::fs::write(
        volumes.join("configmap/app-config/hello.txt"),
        "from the config map\n",
    )
    .unwrap();
    // Where the launcher Pod mounts the projected token (`api::launcher_pod::shared_dir`).
    std::fs::create_dir_all(volumes.join("serviceaccount")).unwrap();
    std::fs::write(volumes.join("serviceaccount/hello.txt"), "token\n").unwrap();
    let manifest = |tag: &str| {
        format!(
            r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: probe-virtiofs}}
spec:
  terminationGracePeriodSeconds: 0
  domain:
    memory: {{guest: 64Mi}}
    devices:
      autoattachPodInterface: false
      filesystems:
        - {{name: data, virtiofs: {{}}}}
        - {{name: cfg, virtiofs: {{}}}}
        - {{name: sa, virtiofs: {{}}}}
    firmware:
      kernelBoot:
        container: {{image: registry.example.com/kernels/linux:6.1, kernelPath: /boot/vmlinux}}
        kernelArgs: "console=ttyS0 probe.test=virtiofs probe.tag={tag}"
  volumes:
    - {{name: data, persistentVolumeClaim: {{claimName: shared-pvc}}}}
    - {{name: cfg, configMap: {{name: app-config}}}}
    - {{name: sa, serviceAccount: {{serviceAccountName: builder}}}}
"#
        )
    };
    let run = |tag: &str| {
        let path = f.root.join(format!("fs-{tag}.yaml"));
        std::fs::write(&path, manifest(tag)).unwrap();
        let out = launcher_run(&[
            "-f",
            path.to_str().unwrap(),
            "--image-dir",
            f.root.join("images").to_str().unwrap(),
            "--volume-dir",
            volumes.to_str().unwrap(),
            "--state-dir",
            f.root.join("state").to_str().unwrap(),
        ]);
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr)
    };
    let data = run("data");
    assert!(
        data.contains("PROBE RESULT virtiofs OK") && data.contains("first-line=from the claim"),
        "{data}"
    );
    assert_eq!(
        std::fs::read_to_string(volumes.join("shared-pvc/written.txt")).unwrap(),
        "probe wrote\n"
    );
    let cfg = run("cfg");
    assert!(
        cfg.contains("PROBE RESULT virtiofs FAIL tag=cfg: CREATE written.txt failed: errno 30"),
        "{cfg}"
    );
    assert!(!volumes.join("configmap/app-config/written.txt").exists());
    let sa = run("sa");
    assert!(
        sa.contains("PROBE RESULT virtiofs FAIL tag=sa: CREATE written.txt failed: errno 30"),
        "{sa}"
    );
    assert!(!volumes.join("serviceaccount/written.txt").exists());
}

/// KubeVirt's vhostuser binding on a Multus network: the interface's socket is the one Multus
/// reports for its Pod interface (`net1`) in the Pod's network-status, here DPDK's testpmd
/// looping the probe's frames back; without the status, or with a socket the VM would have
/// to create, the launcher refuses with the interface named.
#[test]
fn a_vhostuser_interface_connects_to_the_socket_multus_reports() {
    tests::require_kvm();
    let f = Fixture::new("vhostuser");
    let socket = f.root.join("net1.sock");
    let _switch = tests::peers::testpmd(&socket, "io");
    let manifest = f.root.join("vnf.yaml");
    std::fs::write(
        &manifest,
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: probe-vnf}
spec:
  terminationGracePeriodSeconds: 0
  domain:
    memory: {guest: 64Mi}
    devices:
      interfaces:
        - {name: dataplane, binding: {name: vhostuser}, macAddress: "52:54:00:aa:bb:07"}
    firmware:
      kernelBoot:
        container: {image: registry.example.com/kernels/linux:6.1, kernelPath: /boot/vmlinux}
        kernelArgs: "console=ttyS0 probe.test=netloop"
  networks:
    - {name: dataplane, multus: {networkName: userspace-net}}
"#,
    )
    .unwrap();
    let status = |mode: &str| {
        let path = f.root.join(format!("status-{mode}.json"));
        let json = serde_json::json!([
            {"name": "default", "interface": "eth0", "ips": ["10.244.0.9"]},
            {"name": "ns/userspace-net", "interface": "net1",
             "device-info": {"type": "vhost-user", "version": "1.1.0",
                             "vhost-user": {"mode": mode, "path": socket}}}
        ]);
        std::fs::write(&path, json.to_string()).unwrap();
        path
    };
    let dirs = ["images", "volumes", "state"].map(|d| f.root.join(d));
    let run = |extra: &[&str]| {
        let mut args = vec![
            "-f",
            manifest.to_str().unwrap(),
            "--image-dir",
            dirs[0].to_str().unwrap(),
            "--volume-dir",
            dirs[1].to_str().unwrap(),
            "--state-dir",
            dirs[2].to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let out = launcher_run(&args);
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.code(), text)
    };
    let client = status("client");
    let (code, out) = run(&["--network-status", client.to_str().unwrap()]);
    assert!(
        out.contains("PROBE RESULT netloop OK") && out.contains("mac=52:54:00:aa:bb:07"),
        "{out}"
    );
    assert!(out.contains("looped=3"), "{out}");
    assert_eq!(code, Some(0), "{out}");

    let (code, out) = run(&[]);
    assert_eq!(code, Some(2), "{out}");
    assert!(
        out.contains("interface dataplane: binding vhostuser takes its socket from Multus' network-status; give it with --network-status FILE"),
        "{out}"
    );
    let server = status("server");
    let (code, out) = run(&["--network-status", server.to_str().unwrap()]);
    assert_eq!(code, Some(2), "{out}");
    assert!(
        out.contains("interface dataplane (") && out.contains("socket is in server mode"),
        "{out}"
    );
}
