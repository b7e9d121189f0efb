//! kubectl, the real client, drives microvirt: the in-process API server serves discovery,
//! OpenAPI v3 and Table output from virt-controller's CRDs and sends objects through
//! virt-controller's admission webhook as `deploy/webhook.yaml` registers it; virt-controller
//! runs against it under its RBAC; kubectl's own output is asserted — what a KubeVirt user sees.

use std::time::Duration;

use api::migratability::EvictionStrategy;
use api::VirtualMachine;
use tests::admission::start_webhook;
use tests::cluster::{test_config, Cluster};
use tests::kubectl::Kubectl;

const T: Duration = Duration::from_secs(30);

/// The lines of a table whose first column is `name`, split into columns.
fn row(table: &str, name: &str) -> Option<Vec<String>> {
    table
        .lines()
        .map(|l| l.split_whitespace().map(str::to_string).collect::<Vec<_>>())
        .find(|cols| cols.first().map(String::as_str) == Some(name))
}

fn header(table: &str) -> Vec<String> {
    table
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// An API server with virt-controller, its webhook in the admission path, and kubectl.
async fn cluster(tag: &str) -> (Cluster, tests::cluster::Replica, Kubectl) {
    let cluster = Cluster::start().await;
    let webhook = start_webhook(Some(cluster.client.clone()), EvictionStrategy::None).await;
    webhook.register(&cluster.api).await;
    let controller = cluster.replica(test_config(), None);
    let kubectl = Kubectl::new(&cluster.api, tag);
    (cluster, controller, kubectl)
}

fn corpus(name: &str) -> String {
    tests::repo_root()
        .join("launcher/tests/corpus")
        .join(name)
        .display()
        .to_string()
}

/// Deletes with kubectl while a kubelet finishes the launcher Pods' graceful deletions (kubectl
/// waits until the object is gone, as it does against a cluster).
async fn delete(cluster: &Cluster, kubectl: &Kubectl, args: &[&str]) -> String {
    let c = cluster.clone_handle();
    let kubelet = tokio::spawn(async move {
        loop {
            c.kubelet_finish_deletions().await;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    let out = tokio::time::timeout(T, kubectl.ok(args))
        .await
        .expect("kubectl delete finishes");
    kubelet.abort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_applies_lists_describes_explains_and_deletes_a_vm() {
    let (cluster, _controller, kubectl) = cluster("vm").await;

    // A published-style Fedora VM (decimal memory, `running: true`): created, with the
    // webhook's deprecation warning printed by kubectl.
    let applied = kubectl
        .run(&["apply", "-f", &corpus("fedora-vm.yaml")])
        .await;
    assert_eq!(applied.code, 0, "{}", applied.stderr);
    assert_eq!(
        applied.stdout.trim(),
        "virtualmachine.kubevirt.io/fedora created"
    );
    assert!(
        applied
            .stderr
            .contains("Warning: spec.running is deprecated, please use spec.runStrategy instead."),
        "{}",
        applied.stderr
    );
    // Applying it again changes nothing.
    let again = kubectl
        .ok(&["apply", "-f", &corpus("fedora-vm.yaml")])
        .await;
    assert_eq!(again.trim(), "virtualmachine.kubevirt.io/fedora unchanged");

    cluster.bring_up("fedora", "node-a").await;

    // `get` with KubeVirt's printer columns, rendered by the server as a Table.
    let vms = kubectl
        .until(&["get", "vm"], "the VM Running and Ready", |t| {
            row(t, "fedora").is_some_and(|r| r.len() == 4 && r[2] == "Running" && r[3] == "True")
        })
        .await;
    assert_eq!(header(&vms), ["NAME", "AGE", "STATUS", "READY"]);
    let vmis = kubectl.ok(&["get", "vmi"]).await;
    assert_eq!(
        header(&vmis),
        ["NAME", "AGE", "PHASE", "IP", "NODENAME", "READY"]
    );
    // Columns of priority 1 only in the wide output, as KubeVirt's CRD has them.
    let wide = kubectl.ok(&["get", "vmi", "-o", "wide"]).await;
    assert_eq!(header(&wide).last().unwrap(), "LIVE-MIGRATABLE", "{wide}");
    let r = row(&vmis, "fedora").expect("the VMI is listed");
    assert_eq!(r[2], "Running", "{vmis}");
    assert!(r.contains(&"node-a".to_string()), "{vmis}");
    // Several kinds at once, by short name, each under its kind.
    let both = kubectl.ok(&["get", "vm,vmi"]).await;
    assert!(both.contains("virtualmachine.kubevirt.io/fedora"), "{both}");
    assert!(
        both.contains("virtualmachineinstance.kubevirt.io/fedora"),
        "{both}"
    );

    // `-o yaml` is the stored object: KubeVirt's field names, the webhook's defaults applied.
    let yaml = kubectl.ok(&["get", "vm", "fedora", "-o", "yaml"]).await;
    let vm: VirtualMachine = serde_yaml::from_str(&yaml).expect("kubectl -o yaml is a VM");
    let tmpl = vm.spec.template.spec.clone().unwrap();
    assert_eq!(
        tmpl.domain
            .memory
            .as_ref()
            .unwrap()
            .guest
            .as_ref()
            .map(|q| q.0.as_str()),
        Some("1024M")
    );
    assert_eq!(
        vm.status.as_ref().unwrap().printable_status.as_deref(),
        Some("Running")
    );
    assert!(vm
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key("kubectl.kubernetes.io/last-applied-configuration")));

    // `describe` (kubectl's generic describer for custom resources).
    let described = kubectl.ok(&["describe", "vm", "fedora"]).await;
    for want in [
        "Name:         fedora",
        "Namespace:    default",
        "API Version:  kubevirt.io/v1",
        "Kind:         VirtualMachine",
        "Printable Status:",
        "Guest:  1024M",
    ] {
        assert!(
            described.contains(want),
            "describe lacks {want:?}:\n{described}"
        );
    }

    // `explain` from the OpenAPI v3 document built from the CRD schema.
    let explained = kubectl.ok(&["explain", "virtualmachine.spec"]).await;
    for want in [
        "GROUP:      kubevirt.io",
        "KIND:       VirtualMachine",
        "VERSION:    v1",
        "FIELD: spec <Object>",
        "runStrategy\t<string>",
        "template\t<Object> -required-",
        "instancetype\t<Object>",
        "When the VM runs: Always",
    ] {
        assert!(
            explained.contains(want),
            "explain lacks {want:?}:\n{explained}"
        );
    }
    let memory = kubectl
        .ok(&["explain", "vm.spec.template.spec.domain.memory.guest"])
        .await;
    assert!(
        memory.contains("FIELD: guest") && memory.contains("Quantity is a fixed-point"),
        "{memory}"
    );

    // `delete` waits until the VM (and so its VMI) is gone.
    let deleted = delete(&cluster, &kubectl, &["delete", "vm", "fedora"]).await;
    assert_eq!(
        deleted.trim(),
        "virtualmachine.kubevirt.io \"fedora\" deleted"
    );
    let none = kubectl.run(&["get", "vm"]).await;
    assert_eq!(none.code, 0);
    assert_eq!(
        none.stderr.trim(),
        "No resources found in default namespace."
    );
    kubectl
        .until(&["get", "vmi", "-o", "name"], "the VMI gone", |t| {
            t.trim().is_empty()
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_scales_a_replica_set_and_lists_migrations() {
    let (cluster, _controller, kubectl) = cluster("vmirs").await;
    let rs = kubectl.file(
        "rs.yaml",
        r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstanceReplicaSet
metadata:
  name: web
spec:
  replicas: 1
  selector:
    matchLabels: {app: web}
  template:
    metadata:
      labels: {app: web}
    spec:
      evictionStrategy: LiveMigrate
      domain:
        memory: {guest: 64Mi}
        devices:
          disks:
          - name: root
            disk: {bus: virtio}
      volumes:
      - name: root
        containerDisk: {image: quay.io/containerdisks/alpine:3.20}
"#,
    );
    assert_eq!(
        kubectl.ok(&["apply", "-f", &rs]).await.trim(),
        "virtualmachineinstancereplicaset.kubevirt.io/web created"
    );
    let scaled = kubectl.ok(&["scale", "vmirs", "web", "--replicas=3"]).await;
    assert_eq!(
        scaled.trim(),
        "virtualmachineinstancereplicaset.kubevirt.io/web scaled"
    );
    let table = kubectl
        .until(&["get", "vmirs"], "three VMIs", |t| {
            row(t, "web").is_some_and(|r| r[1] == "3" && r[2] == "3")
        })
        .await;
    assert_eq!(
        header(&table),
        ["NAME", "DESIRED", "CURRENT", "READY", "AGE"]
    );
    let names = kubectl
        .ok(&["get", "vmi", "-l", "app=web", "-o", "name"])
        .await;
    assert_eq!(names.lines().count(), 3, "{names}");
    // The controller's events, as `describe` shows them.
    let described = kubectl
        .until(&["describe", "vmirs", "web"], "the create events", |t| {
            t.contains("SuccessfulCreate")
        })
        .await;
    assert!(
        described.contains("Created virtual machine instance web"),
        "{described}"
    );

    // A migration of one of them, listed with its phase and VMI.
    let vmi = names
        .lines()
        .next()
        .unwrap()
        .trim_start_matches("virtualmachineinstance.kubevirt.io/")
        .to_string();
    cluster.bring_up(&vmi, "node-a").await;
    let mig = kubectl.file(
        "mig.yaml",
        &format!("apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstanceMigration\nmetadata:\n  name: move-web\nspec:\n  vmiName: {vmi}\n"),
    );
    assert_eq!(
        kubectl.ok(&["create", "-f", &mig]).await.trim(),
        "virtualmachineinstancemigration.kubevirt.io/move-web created"
    );
    let migrations = kubectl
        .until(&["get", "vmim"], "the migration scheduling", |t| {
            row(t, "move-web").is_some_and(|r| r.len() == 3 && r[1] != "<none>")
        })
        .await;
    assert_eq!(header(&migrations), ["NAME", "PHASE", "VMI"]);
    assert_eq!(row(&migrations, "move-web").unwrap()[2], vmi);
    // A second migration of the same VMI is refused by the webhook, in its words.
    let second = kubectl.file(
        "mig2.yaml",
        &format!("apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstanceMigration\nmetadata:\n  name: again\nspec:\n  vmiName: {vmi}\n"),
    );
    let refused = kubectl.run(&["create", "-f", &second]).await;
    assert_ne!(refused.code, 0);
    assert!(
        refused.stderr.contains("admission webhook \"validate.microvirt.kubevirt.io\" denied the request: spec.vmiName:")
            && refused.stderr.contains("is already being migrated by \"move-web\""),
        "{}",
        refused.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_shows_why_a_manifest_is_refused() {
    let (_cluster, _controller, kubectl) = cluster("bad").await;

    // The webhook's refusal, every offending path in it, nothing stored.
    let r = kubectl
        .run(&["apply", "-f", &corpus("efi-and-typo-vm.yaml")])
        .await;
    assert_eq!(r.code, 1);
    for want in [
        "admission webhook \"validate.microvirt.kubevirt.io\" denied the request",
        "spec.template.spec.domain.firmware.bootloader.efi: EFI firmware is not supported by microvirt",
        "spec.template.spec.domain.devices.interface: is not a field microvirt knows",
    ] {
        assert!(r.stderr.contains(want), "{want:?} not in:\n{}", r.stderr);
    }

    // A field the schema does not have at all: the server's strict decoding (kubectl asks for
    // it with fieldValidation=Strict).
    let typo = kubectl.file(
        "typo.yaml",
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstanceMigration\nmetadata:\n  name: m\nspec:\n  vmiName: x\n  vmiNmae: y\n",
    );
    let r = kubectl.run(&["apply", "-f", &typo]).await;
    assert_eq!(r.code, 1);
    assert!(
        r.stderr
            .contains("strict decoding error: unknown field \"spec.vmiNmae\""),
        "{}",
        r.stderr
    );

    // A quantity that does not parse: the field, the value and the accepted forms.
    let quantity = kubectl.file(
        "quantity.yaml",
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata:\n  name: q\nspec:\n  domain:\n    memory: {guest: 1GiB}\n    devices: {autoattachPodInterface: false}\n",
    );
    let r = kubectl.run(&["apply", "-f", &quantity]).await;
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains("spec.domain.memory.guest") && r.stderr.contains("1GiB"),
        "{}",
        r.stderr
    );

    let none = kubectl.run(&["get", "vm,vmi,vmim", "-o", "name"]).await;
    assert_eq!(none.stdout.trim(), "", "nothing refused was stored");
}

/// `kubectl apply --server-side`: created, applied again, a field the file no longer sets
/// removed, and another field manager's different value a conflict until forced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_applies_server_side_with_field_ownership() {
    let (_cluster, _controller, kubectl) = cluster("ssa").await;
    let vm = |labels: &str, strategy: &str| {
        format!(
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachine\nmetadata:\n  name: ssa\n  labels: {{{labels}}}\nspec:\n  runStrategy: {strategy}\n  template:\n    spec:\n      domain:\n        memory: {{guest: 64Mi}}\n        devices: {{}}\n"
        )
    };
    let first = kubectl.file("ssa1.yaml", &vm("app: a, tier: t", "Halted"));
    let out = kubectl.ok(&["apply", "--server-side", "-f", &first]).await;
    assert_eq!(
        out.trim(),
        "virtualmachine.kubevirt.io/ssa serverside-applied"
    );
    let out = kubectl.ok(&["apply", "--server-side", "-f", &first]).await;
    assert_eq!(
        out.trim(),
        "virtualmachine.kubevirt.io/ssa serverside-applied"
    );
    let managers = kubectl
        .ok(&[
            "get",
            "vm",
            "ssa",
            "--show-managed-fields",
            "-o",
            "jsonpath={.metadata.managedFields[*].manager}",
        ])
        .await;
    assert_eq!(managers, "kubectl");

    // The file drops the tier label: applying it removes the label kubectl applied before.
    let second = kubectl.file("ssa2.yaml", &vm("app: a", "Halted"));
    kubectl.ok(&["apply", "--server-side", "-f", &second]).await;
    let labels = kubectl
        .ok(&["get", "vm", "ssa", "-o", "jsonpath={.metadata.labels}"])
        .await;
    assert_eq!(labels, r#"{"app":"a"}"#);

    // Another manager wanting another runStrategy conflicts, until it forces.
    let other = kubectl.file("ssa3.yaml", &vm("app: a", "Always"));
    let refused = kubectl
        .run(&[
            "apply",
            "--server-side",
            "--field-manager",
            "other",
            "-f",
            &other,
        ])
        .await;
    assert_ne!(refused.code, 0);
    assert!(
        refused
            .stderr
            .contains("conflict with \"kubectl\": .spec.runStrategy"),
        "{}",
        refused.stderr
    );
    kubectl
        .ok(&[
            "apply",
            "--server-side",
            "--field-manager",
            "other",
            "--force-conflicts",
            "-f",
            &other,
        ])
        .await;
    let strategy = kubectl
        .ok(&["get", "vm", "ssa", "-o", "jsonpath={.spec.runStrategy}"])
        .await;
    assert_eq!(strategy, "Always");
}
