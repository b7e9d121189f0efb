//! The real `virt-handler` binary against the in-process API server (under its deploy/ RBAC),
//! with virt-controller running and a real launcher process per Pod booting the probe: the
//! handler, not the test, turns the VMI Running; it survives its own restart without touching
//! the guest, and reports a launcher that died.

use std::path::{Path, PathBuf};
use std::time::Duration;

use api::{VirtualMachineInstance, VmiPhase};
use tests::cluster::{eventually, test_config, Cluster};

mod common;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_syncs_the_launcher_and_keeps_the_vmi_status_true() {
    tests::require_kvm();
    let work = tests::probe_workdir("mv-handler");
    let pods_dir = work.join("pods");
    let cluster = Cluster::start().await;
    let _controller = cluster.replica(test_config(), None);
    let vmis = cluster.api::<VirtualMachineInstance>();
    cluster.apply_yaml::<VirtualMachineInstance>(VMI).await;
    let t = Duration::from_secs(30);
    let pod = launcher_pod_of(&cluster, "probe").await;
    let pod_name = pod.metadata.name.clone().unwrap();
    let uid = pod.metadata.uid.clone().unwrap();
    cluster.kubelet_run(&pod_name, NODE).await;
    let launcher = start_launcher(&pods_dir, &uid, &work);
    let handler = start_handler(&cluster, &pods_dir, &work);

    // The handler Syncs the VMI into the launcher and reports it Running.
    let running = eventually(
        "VMI Running (set by virt-handler)",
        Duration::from_secs(60),
        || async {
            let v = vmis.get("probe").await.unwrap();
            let ready = condition(&v, "Ready").is_some_and(|(s, _)| s == "True");
            (v.status.as_ref()?.phase == Some(VmiPhase::Running) && ready).then_some(v)
        },
    )
    .await;
    let s = running.status.clone().unwrap();
    assert_eq!(s.node_name.as_deref(), Some(NODE));
    assert_eq!(
        s.launcher_container_image_version.as_deref(),
        Some(env!("CARGO_PKG_VERSION"))
    );
    assert_eq!(
        condition(&running, "Synchronized").map(|c| c.0).as_deref(),
        Some("True")
    );
    let kvm = vmm::KvmContext::open().unwrap();
    assert_eq!(
        condition(&running, "SoftwareEmulation").is_some(),
        kvm.acceleration.is_software_emulated()
    );

    // Per-VMI metrics under KubeVirt's names.
    let text = tests::cluster::http_get(handler.1.unwrap(), "/metrics").await;
    assert!(
        text.contains(&format!("kubevirt_vmi_memory_domain_bytes{{node=\"{NODE}\",namespace=\"default\",name=\"probe\"}} 67108864")),
        "{text}"
    );

    // A handler restart leaves the guest alone: the same launcher still runs the same VM.
    let uptime = |pods_dir: PathBuf, uid: String| async move {
        let mut c = handler::launcher::LauncherClient::connect(
            &handler::launcher::socket_path(&pods_dir, &uid),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        c.status().await.unwrap().uptime_seconds
    };
    let before = uptime(pods_dir.clone(), uid.clone()).await;
    drop(handler);
    let _handler = start_handler(&cluster, &pods_dir, &work);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = uptime(pods_dir.clone(), uid.clone()).await;
    assert!(
        after > before,
        "the guest was restarted ({before} s → {after} s)"
    );
    assert_eq!(
        vmis.get("probe").await.unwrap().status.unwrap().phase,
        Some(VmiPhase::Running)
    );

    // The launcher dies: the handler says it cannot reach it; the Pod's end fails the VMI.
    drop(launcher);
    eventually(
        "Synchronized=False LauncherUnreachable",
        Duration::from_secs(30),
        || async {
            let v = vmis.get("probe").await.unwrap();
            (condition(&v, "Synchronized")
                == Some(("False".into(), Some("LauncherUnreachable".into()))))
            .then_some(())
        },
    )
    .await;
    cluster.kubelet_exit(&pod_name, 137).await;
    eventually("VMI Failed", t, || async {
        let v = vmis.get("probe").await.unwrap();
        (v.status?.phase == Some(VmiPhase::Failed)).then_some(())
    })
    .await;
    let _ = std::fs::remove_dir_all(work);
}

/// The kubelet reports the Pod's IP (the node namespace's address in these tests).
async fn kubelet_pod_ip(cluster: &Cluster, pod: &str, ip: &str) {
    use kube::api::{Patch, PatchParams};
    cluster
        .api::<k8s_openapi::api::core::v1::Pod>()
        .patch_status(
            pod,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"podIP": ip, "podIPs": [{"ip": ip}]}})),
        )
        .await
        .unwrap();
}

/// A migration through the API: virt-controller makes the target Pod, the target node's
/// handler prepares its launcher and publishes the address, the source node's handler has the
/// source launcher send the VM; the VMIM ends Succeeded with the guest running on node-2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_moves_the_guest_between_two_node_namespaces() {
    use api::{MigrationPhase, VirtualMachineInstanceMigration};
    tests::require_kvm();
    let work = tests::probe_workdir("mv-handler-mig");
    let pods_dir = work.join("pods");
    // Two nodes joined by a veth pair: node-1 is 10.78.0.1, node-2 10.78.0.2.
    let (n1, n2) = tests::two_nodes("hm1", "hm2");

    let cluster = Cluster::start().await;
    let _controller = cluster.replica(test_config(), None);
    let vmis = cluster.api::<VirtualMachineInstance>();
    cluster
        .apply_yaml::<VirtualMachineInstance>(
            &VMI.replace("probe.test=console", "probe.test=dirty probe.passes=100000"),
        )
        .await;
    let t = Duration::from_secs(30);
    let source = launcher_pod_of(&cluster, "probe").await;
    let source_name = source.metadata.name.clone().unwrap();
    cluster.kubelet_run(&source_name, "node-1").await;
    kubelet_pod_ip(&cluster, &source_name, "10.78.0.1").await;
    let source_uid = source.metadata.uid.clone().unwrap();
    let (_l1, _p1, sent_to_source) =
        start_recorded_launcher(&n1.name, &pods_dir, &source_uid, &work);
    // Each node its own certificate (its name as DNS name) from the cluster's CA; node-3's is
    // a real certificate of another node, which must not pass for node-1.
    let tls = tests::tls::write_dirs(&work.join("tls"), &["node-1", "node-2", "node-3"]);
    let _h1 = start_handler_with("node-1", &cluster, &pods_dir, &work, Some(&tls[0]));
    let _h2 = start_handler_with("node-2", &cluster, &pods_dir, &work, Some(&tls[1]));
    eventually("VMI Running on node-1", Duration::from_secs(60), || async {
        let v = vmis.get("probe").await.unwrap();
        (v.status?.phase == Some(VmiPhase::Running)).then_some(())
    })
    .await;

    let m = cluster
        .apply_yaml::<VirtualMachineInstanceMigration>(
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstanceMigration\nmetadata: {name: mig}\nspec: {vmiName: probe}\n",
        )
        .await;
    let target = cluster.target_pod(&m.metadata.uid.clone().unwrap()).await;
    let target_name = target.metadata.name.clone().unwrap();
    cluster.kubelet_run(&target_name, "node-2").await;
    kubelet_pod_ip(&cluster, &target_name, "10.78.0.2").await;
    let target_uid = target.metadata.uid.clone().unwrap();
    let (_l2, _p2, sent_to_target) =
        start_recorded_launcher(&n2.name, &pods_dir, &target_uid, &work);

    // Attackers at the target handler's port as soon as it is published: one trickles bytes
    // and never finishes a handshake, one shows node-3's certificate. Neither holds the
    // migration up, and neither is taken for the source.
    let address = eventually("the target's address", t, || async {
        vmis.get("probe")
            .await
            .unwrap()
            .status?
            .migration_state?
            .target_node_address
    })
    .await;
    let trickler = {
        let address = address.clone();
        std::thread::spawn(move || {
            use std::io::Write;
            let Ok(mut s) = std::net::TcpStream::connect(&address) else {
                return; // already closed: the source was first
            };
            for _ in 0..30 {
                if s.write_all(&[0x16]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_secs(1));
            }
        })
    };
    let impostor = {
        let address = address.clone();
        let dir = tls[2].clone();
        tokio::spawn(async move { impostor_handshake(&address, &dir).await })
    };
    // Nothing listens for migrations in the target Pod's network.
    let pod_port = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &n1.name,
            "bash",
            "-c",
            "exec 3<>/dev/tcp/10.78.0.2/49152",
        ])
        .output()
        .unwrap();
    assert!(
        !pod_port.status.success(),
        "something listens on the target Pod's 49152"
    );

    let migrations = cluster.api::<VirtualMachineInstanceMigration>();
    let done = eventually("the migration to end", Duration::from_secs(90), || async {
        let m = migrations.get("mig").await.unwrap();
        let p = m.status.as_ref()?.phase?;
        matches!(p, MigrationPhase::Succeeded | MigrationPhase::Failed).then_some(m)
    })
    .await;
    let vmi = vmis.get("probe").await.unwrap();
    let ms = vmi
        .status
        .clone()
        .unwrap()
        .migration_state
        .unwrap_or_default();
    assert_eq!(
        done.status.as_ref().unwrap().phase,
        Some(MigrationPhase::Succeeded),
        "{ms:?}"
    );
    // The address is node-2's handler's, never the target Pod's.
    assert_eq!(
        ms.target_node_address
            .as_deref()
            .map(|a| a.starts_with("127.0.0.2:")),
        Some(true),
        "{ms:?}"
    );
    assert!(
        ms.start_timestamp.is_some() && ms.end_timestamp.is_some(),
        "{ms:?}"
    );
    assert_eq!(
        vmi.status.as_ref().unwrap().node_name.as_deref(),
        Some("node-2")
    );
    // The guest runs on in the target launcher, reported by node-2's handler.
    let mut c = handler::launcher::LauncherClient::connect(
        &handler::launcher::socket_path(&pods_dir, &target_uid),
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert_eq!(
        c.status().await.unwrap().state,
        api::protocol::VmState::Running
    );
    eventually("VMI Running on node-2", t, || async {
        let v = vmis.get("probe").await.unwrap();
        let s = v.status?;
        (s.phase == Some(VmiPhase::Running) && s.node_name.as_deref() == Some("node-2"))
            .then_some(())
    })
    .await;
    assert!(
        impostor.await.unwrap().is_err(),
        "node-3's certificate was taken for node-1's"
    );
    trickler.join().unwrap();
    // Everything virt-handler sent either Pod was recorded — the migration's requests among
    // it — and no piece of any node's private key is in it.
    for (log, request) in [
        (&sent_to_source, "\"request\":\"migrateOut\""),
        (&sent_to_target, "\"request\":\"prepareMigrationTarget\""),
    ] {
        let sent = std::fs::read(log).unwrap();
        assert!(
            String::from_utf8_lossy(&sent).contains(request),
            "{} lacks {request}: the recording missed the handler's requests",
            log.display()
        );
        tests::tls::assert_no_key_in(&tls, &sent, &log.display().to_string());
    }
    drop((n1, n2));
    let _ = std::fs::remove_dir_all(work);
}

/// A TLS client with the certificate in `dir`, as another node would connect: Ok if the target
/// handler kept the connection open for a migration stream after the handshake.
async fn impostor_handshake(address: &str, dir: &Path) -> Result<(), String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let tls = api::protocol::MigrationTls::from_dir(dir)?;
    let mut roots = tokio_rustls::rustls::RootCertStore::empty();
    for c in tls.ca_certs()? {
        roots.add(c).unwrap();
    }
    let (certs, key) = (tls.cert_chain()?, tls.private_key()?);
    let provider = std::sync::Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let cfg = tokio_rustls::rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(certs, key)
        .unwrap();
    let Ok(tcp) = tokio::net::TcpStream::connect(address).await else {
        return Err("closed".into());
    };
    let name = tokio_rustls::rustls::pki_types::ServerName::try_from("node-2").unwrap();
    let mut s = tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg))
        .connect(name, tcp)
        .await
        .map_err(|e| e.to_string())?;
    // TLS 1.3: a refused client certificate shows as the server closing on the first read.
    let _ = s.write_all(b"x").await;
    let mut b = [0u8; 1];
    match tokio::time::timeout(Duration::from_secs(15), s.read(&mut b)).await {
        Ok(Ok(0)) | Ok(Err(_)) => Err("closed by the target handler".into()),
        Ok(Ok(_)) => Ok(()),
        Err(_) => Ok(()), // held open: taken for a source
    }
}

/// The pod network end to end: the launcher runs in a Pod namespace (eth0 to a node
/// namespace, as a CNI leaves it); virt-handler wires masquerade in it from the outside and
/// hands the TAP and DHCP socket over; the probe configures itself by DHCP and its UDP datagram
/// reaches a peer on the node from the Pod's address; the VMI's status shows the interface
/// with the Pod's IP, set by the handler. A VMI whose Multus interface is missing fails,
/// naming it, and leaves nothing behind in its Pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_puts_the_guest_on_the_pod_network() {
    tests::require_kvm();
    let work = tests::probe_workdir("mv-handler-net");
    let pods_dir = work.join("pods");
    let cluster = Cluster::start().await;
    let _controller = cluster.replica(test_config(), None);
    let vmis = cluster.api::<VirtualMachineInstance>();
    let (node, podns) = tests::pod_namespace("hnet", "10.244.0.5", "10.244.0.1");
    let echo = tests::UdpEcho::start(&node, 7777);
    cluster
        .apply_yaml::<VirtualMachineInstance>(&tests::probe_vmi_yaml(
            "netprobe",
            "probe.test=dhcp probe.peer=10.244.0.1:7777",
            r#"[{name: default, masquerade: {}}]"#,
            r#"[{name: default, pod: {}}]"#,
        ))
        .await;
    let t = Duration::from_secs(30);
    let pod = launcher_pod_of(&cluster, "netprobe").await;
    let pod_name = pod.metadata.name.clone().unwrap();
    let uid = pod.metadata.uid.clone().unwrap();
    cluster.kubelet_run(&pod_name, NODE).await;
    kubelet_pod_ip(&cluster, &pod_name, "10.244.0.5").await;
    let mut launcher = start_launcher_in(Some(&podns.name), &pods_dir, &uid, &work);
    let _handler = start_handler(&cluster, &pods_dir, &work);

    let iface = eventually(
        "status.interfaces (set by virt-handler)",
        Duration::from_secs(60),
        || async {
            let v = vmis.get("netprobe").await.unwrap();
            v.status?.interfaces.into_iter().next()
        },
    )
    .await;
    assert_eq!(iface.name.as_deref(), Some("default"));
    assert_eq!(iface.ip_address.as_deref(), Some("10.244.0.5"));
    assert_eq!(iface.pod_interface_name.as_deref(), Some("eth0"));
    assert_eq!(iface.info_source.as_deref(), Some("domain"));
    assert!(
        iface.mac.as_deref().is_some_and(|m| m.len() == 17),
        "{iface:?}"
    );
    // The guest's datagram arrives from the Pod's address (masqueraded) and is echoed back;
    // the probe then powers off and the VMI Succeeds.
    let seen =
        tokio::task::spawn_blocking(move || echo.wait_from("10.244.0.5", Duration::from_secs(120)))
            .await
            .unwrap();
    assert!(seen, "no datagram from the guest through the Pod's address");
    // The guest powered off: the launcher (the Pod's container) exits 0, and the Pod's end
    // makes the VMI Succeeded.
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let code = loop {
        if let Some(st) = launcher.0.try_wait().unwrap() {
            break st.code();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the launcher did not end"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(code, Some(0));
    cluster.kubelet_exit(&pod_name, 0).await;
    eventually("VMI Succeeded", t, || async {
        let v = vmis.get("netprobe").await.unwrap();
        (v.status?.phase == Some(VmiPhase::Succeeded)).then_some(())
    })
    .await;
    let links = std::process::Command::new("ip")
        .args(["netns", "exec", &podns.name, "ip", "-o", "link"])
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&links.stdout).contains("tap0"),
        "the TAP went with the launcher"
    );

    // A Multus network whose interface the Pod does not have.
    let (_node2, podns2) = tests::pod_namespace("hnet2", "10.244.1.5", "10.244.1.1");
    cluster
        .apply_yaml::<VirtualMachineInstance>(&tests::probe_vmi_yaml(
            "blueprobe",
            "probe.test=console",
            r#"[{name: default, masquerade: {}}, {name: blue, bridge: {}}]"#,
            r#"[{name: default, pod: {}}, {name: blue, multus: {networkName: blue-net}}]"#,
        ))
        .await;
    let pod = launcher_pod_of(&cluster, "blueprobe").await;
    let pod_name = pod.metadata.name.clone().unwrap();
    let uid = pod.metadata.uid.clone().unwrap();
    cluster.kubelet_run(&pod_name, NODE).await;
    let _launcher2 = start_launcher_in(Some(&podns2.name), &pods_dir, &uid, &work);
    let failed = eventually("VMI Failed", Duration::from_secs(60), || async {
        let v = vmis.get("blueprobe").await.unwrap();
        (v.status.as_ref()?.phase == Some(VmiPhase::Failed)).then_some(v)
    })
    .await;
    let reason = failed.status.unwrap().reason.unwrap_or_default();
    assert!(
        reason.starts_with("NetworkSetupFailed")
            && reason.contains("interface blue")
            && reason.contains("net1"),
        "{reason}"
    );
    let links = std::process::Command::new("ip")
        .args(["netns", "exec", &podns2.name, "ip", "-o", "link"])
        .output()
        .unwrap();
    let links = String::from_utf8_lossy(&links.stdout);
    assert!(
        !links.contains("k6t-") && !links.contains("tap0"),
        "left behind: {links}"
    );
    let _ = std::fs::remove_dir_all(work);
}

/// A live migration of a guest that is talking to a peer the whole time: each node has a Pod
/// namespace behind it (10.244.1.5 on node-1, 10.244.2.5 on node-2), both handlers wire their
/// Pod, and the guest — which ran DHCP and ARP once, before the move — keeps its MAC, its
/// address and its gateway's ARP entry: its datagrams reach the peer from the source Pod's
/// address before and from the target Pod's after, and the VMI's status follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migrated_guest_keeps_its_mac_address_and_peer() {
    use api::{MigrationPhase, VirtualMachineInstanceMigration};
    tests::require_kvm();
    let work = tests::probe_workdir("mv-handler-netmig");
    let pods_dir = work.join("pods");
    let (n1, n2) = tests::two_nodes("nm1", "nm2");
    let pod1 = tests::pod_namespace_on(&n1, "nm1", "10.244.1.5", "10.244.1.1");
    let pod2 = tests::pod_namespace_on(&n2, "nm2", "10.244.2.5", "10.244.2.1");
    // The nodes route each other's Pod subnets (what the CNI's routes do).
    n1.exec(&["ip", "route", "add", "10.244.2.0/24", "via", "10.78.0.2"]);
    n2.exec(&["ip", "route", "add", "10.244.1.0/24", "via", "10.78.0.1"]);
    for n in [&n1, &n2] {
        n.exec(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
    }
    let echo = tests::UdpEcho::start(&n1, 7777);

    let cluster = Cluster::start().await;
    let _controller = cluster.replica(test_config(), None);
    let vmis = cluster.api::<VirtualMachineInstance>();
    cluster
        .apply_yaml::<VirtualMachineInstance>(&tests::probe_vmi_yaml(
            "talker",
            "probe.test=dhcp probe.peer=10.78.0.1:7777 probe.echoes=100000000 probe.spoof=1",
            r#"[{name: default, masquerade: {}}]"#,
            r#"[{name: default, pod: {}}]"#,
        ))
        .await;
    let source = launcher_pod_of(&cluster, "talker").await;
    let source_name = source.metadata.name.clone().unwrap();
    cluster.kubelet_run(&source_name, "node-1").await;
    kubelet_pod_ip(&cluster, &source_name, "10.244.1.5").await;
    let source_uid = source.metadata.uid.clone().unwrap();
    let _l1 = start_launcher_in(Some(&pod1.name), &pods_dir, &source_uid, &work);
    let h1 = start_handler_on("node-1", &cluster, &pods_dir, &work);
    let _h2 = start_handler_on("node-2", &cluster, &pods_dir, &work);
    let before = eventually(
        "the interface on node-1",
        Duration::from_secs(60),
        || async {
            let v = vmis.get("talker").await.unwrap();
            let i = v.status?.interfaces.into_iter().next()?;
            (i.ip_address.as_deref() == Some("10.244.1.5")).then_some(i)
        },
    )
    .await;
    let echo = std::sync::Arc::new(echo);
    let e = echo.clone();
    assert!(
        tokio::task::spawn_blocking(move || e.wait_from("10.244.1.5", Duration::from_secs(120)))
            .await
            .unwrap(),
        "the guest is not talking through node-1's Pod"
    );
    // Before its first honest datagram the guest forged six (probe.spoof=1: three from another
    // address, three from another MAC): node-1's source guard dropped them, the VMI's metric
    // counts them, and the peer saw none.
    let h1_metrics = h1.1.unwrap();
    eventually(
        "the forged frames counted in node-1's metrics",
        Duration::from_secs(30),
        || async {
            let text = tests::cluster::http_get(h1_metrics, "/metrics").await;
            text.contains("microvirt_vmi_network_spoofed_packets_dropped_total{node=\"node-1\",namespace=\"default\",name=\"talker\",interface=\"default\"} 6")
                .then_some(())
        },
    )
    .await;
    let forged = |e: &tests::UdpEcho| {
        e.payloads()
            .iter()
            .filter(|p| p.starts_with(b"MVPROBE spoof"))
            .count()
    };
    assert_eq!(forged(&echo), 0, "a forged datagram reached the peer");

    cluster
        .apply_yaml::<VirtualMachineInstanceMigration>(
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstanceMigration\nmetadata: {name: netmig}\nspec: {vmiName: talker}\n",
        )
        .await;
    let m = cluster
        .api::<VirtualMachineInstanceMigration>()
        .get("netmig")
        .await
        .unwrap();
    let target = cluster.target_pod(&m.metadata.uid.clone().unwrap()).await;
    let target_name = target.metadata.name.clone().unwrap();
    cluster.kubelet_run(&target_name, "node-2").await;
    kubelet_pod_ip(&cluster, &target_name, "10.244.2.5").await;
    let target_uid = target.metadata.uid.clone().unwrap();
    let _l2 = start_launcher_in(Some(&pod2.name), &pods_dir, &target_uid, &work);
    let migrations = cluster.api::<VirtualMachineInstanceMigration>();
    let done = eventually("the migration to end", Duration::from_secs(120), || async {
        let m = migrations.get("netmig").await.unwrap();
        let p = m.status.as_ref()?.phase?;
        matches!(p, MigrationPhase::Succeeded | MigrationPhase::Failed).then_some(m)
    })
    .await;
    let ms = vmis
        .get("talker")
        .await
        .unwrap()
        .status
        .and_then(|s| s.migration_state);
    assert_eq!(
        done.status.as_ref().unwrap().phase,
        Some(MigrationPhase::Succeeded),
        "{ms:?}"
    );
    let e = echo.clone();
    assert!(
        tokio::task::spawn_blocking(move || e.wait_from("10.244.2.5", Duration::from_secs(120)))
            .await
            .unwrap(),
        "after the move the guest's datagrams do not come through node-2's Pod"
    );
    let after = eventually(
        "the interface on node-2",
        Duration::from_secs(60),
        || async {
            let v = vmis.get("talker").await.unwrap();
            let i = v.status?.interfaces.into_iter().next()?;
            (i.ip_address.as_deref() == Some("10.244.2.5")).then_some(i)
        },
    )
    .await;
    assert_eq!(after.mac, before.mac, "the guest kept its MAC");
    drop((pod1, pod2, n1, n2));
    let _ = std::fs::remove_dir_all(work);
}

/// The bridge binding: the guest takes over the Pod interface's address and MAC (by DHCP from
/// the handler-wired bridge), and talks to the node as the Pod itself, without NAT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_bridge_binding_the_guest_is_the_pod_on_the_network() {
    tests::require_kvm();
    let work = tests::probe_workdir("mv-handler-br");
    let pods_dir = work.join("pods");
    let cluster = Cluster::start().await;
    let _controller = cluster.replica(test_config(), None);
    let vmis = cluster.api::<VirtualMachineInstance>();
    let (node, podns) = tests::pod_namespace("hbr", "10.244.0.5", "10.244.0.1");
    let pod_mac = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &podns.name,
            "cat",
            "/sys/class/net/eth0/address",
        ])
        .output()
        .unwrap();
    let pod_mac = String::from_utf8_lossy(&pod_mac.stdout).trim().to_string();
    let echo = tests::UdpEcho::start(&node, 7777);
    cluster
        .apply_yaml::<VirtualMachineInstance>(&tests::probe_vmi_yaml(
            "bridged",
            "probe.test=dhcp probe.peer=10.244.0.1:7777 probe.echoes=3",
            r#"[{name: default, bridge: {}}]"#,
            r#"[{name: default, pod: {}}]"#,
        ))
        .await;
    let pod = launcher_pod_of(&cluster, "bridged").await;
    let pod_name = pod.metadata.name.clone().unwrap();
    let uid = pod.metadata.uid.clone().unwrap();
    cluster.kubelet_run(&pod_name, NODE).await;
    kubelet_pod_ip(&cluster, &pod_name, "10.244.0.5").await;
    let _launcher = start_launcher_in(Some(&podns.name), &pods_dir, &uid, &work);
    let _handler = start_handler(&cluster, &pods_dir, &work);
    let iface = eventually("status.interfaces", Duration::from_secs(60), || async {
        let v = vmis.get("bridged").await.unwrap();
        v.status?.interfaces.into_iter().next()
    })
    .await;
    assert_eq!(iface.ip_address.as_deref(), Some("10.244.0.5"));
    assert_eq!(
        iface.mac.as_deref(),
        Some(pod_mac.as_str()),
        "the Pod's MAC"
    );
    let seen =
        tokio::task::spawn_blocking(move || echo.wait_from("10.244.0.5", Duration::from_secs(120)))
            .await
            .unwrap();
    assert!(seen, "no datagram from the guest at the Pod's address");
    let _ = std::fs::remove_dir_all(work);
}

/// What a kubelet does with the launcher Pods bound to this node, for real: every launcher
/// Pod gets a Pod network namespace (eth0 behind a node namespace) and a `virt-launcher daemon`
/// process in it; a Pod being deleted gets SIGTERM, and once the launcher has exited its
/// deletion is finished. Runs until dropped.
struct TestKubelet {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: Option<tokio::task::JoinHandle<Vec<EndedLauncher>>>,
}

/// What the kubelet does with a Pod that only mounts a claim (the attachment Pod of a
/// machine-state capture): the claim's directory (`<work>/volumes/<claim>`, where the storage
/// node provisions it) bind-mounted where the kubelet mounts a CSI volume, and the Pod Running;
/// on deletion, unmounted and the deletion finished.
async fn attach(
    cluster: &Cluster,
    attached: &mut std::collections::BTreeMap<String, PathBuf>,
    pod: &k8s_openapi::api::core::v1::Pod,
    claim: &str,
    node: &str,
    pods_dir: &Path,
    work: &Path,
) {
    use kube::ResourceExt;
    let (name, uid) = (pod.name_any(), pod.uid().unwrap());
    if pod.metadata.deletion_timestamp.is_some() {
        if let Some(mount) = attached.remove(&uid) {
            let status = std::process::Command::new("umount").arg(&mount).status();
            assert!(status.unwrap().success(), "umount {}", mount.display());
        }
        let _ = cluster
            .api::<k8s_openapi::api::core::v1::Pod>()
            .delete(
                &name,
                &kube::api::DeleteParams {
                    grace_period_seconds: Some(0),
                    ..Default::default()
                },
            )
            .await;
        return;
    }
    let source = work.join("volumes").join(claim);
    if attached.contains_key(&uid) || !source.is_dir() {
        return;
    }
    let mount = pods_dir
        .join(&uid)
        .join("volumes/kubernetes.io~csi")
        .join(format!("pvc-{claim}"))
        .join("mount");
    std::fs::create_dir_all(&mount).unwrap();
    let status = std::process::Command::new("mount")
        .arg("--bind")
        .arg(&source)
        .arg(&mount)
        .status();
    assert!(
        status.unwrap().success(),
        "mount --bind {}",
        source.display()
    );
    attached.insert(uid, mount);
    cluster.kubelet_run(&name, node).await;
}

/// The last Pod network a test kubelet of this process made (`k<n>`, 10.245.<n>.5).
static POD_NUMBER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A launcher the test kubelet saw end: its Pod, exit code and stderr.
type EndedLauncher = (String, Option<i32>, String);

impl TestKubelet {
    fn start(cluster: &Cluster, node: &str, pods_dir: &Path, work: &Path) -> TestKubelet {
        use k8s_openapi::api::core::v1::Pod;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (cluster, node, pods_dir, work) = (
            cluster.clone_handle(),
            node.to_string(),
            pods_dir.to_path_buf(),
            work.to_path_buf(),
        );
        let s = stop.clone();
        let task = tokio::spawn(async move {
            let pods = cluster.api::<Pod>();
            // Pod UID → (launcher, its Pod namespace, its node namespace, where its stderr goes).
            let mut running: std::collections::BTreeMap<
                String,
                (Proc, tests::NetNs, tests::NetNs, PathBuf),
            > = Default::default();
            let mut ended = Vec::new();
            // Attachment Pod UID → where its claim is mounted.
            let mut attached: std::collections::BTreeMap<String, PathBuf> = Default::default();
            while !s.load(std::sync::atomic::Ordering::SeqCst) {
                for p in pods.list(&Default::default()).await.unwrap().items {
                    let (name, uid) = (
                        p.metadata.name.clone().unwrap(),
                        p.metadata.uid.clone().unwrap(),
                    );
                    let deleting = p.metadata.deletion_timestamp.is_some();
                    if let Some(claim) =
                        kube::ResourceExt::labels(&p).get(api::snapshot::LABEL_STATE_ATTACHMENT)
                    {
                        attach(&cluster, &mut attached, &p, claim, &node, &pods_dir, &work).await;
                        continue;
                    }
                    if let Some((mut l, pod_ns, node_ns, log)) =
                        (deleting).then(|| running.remove(&uid)).flatten()
                    {
                        // SAFETY: a signal to our own child.
                        unsafe { libc::kill(l.0.id() as i32, libc::SIGTERM) };
                        let code = tokio::task::spawn_blocking(move || {
                            let c = l.0.wait().unwrap().code();
                            (c, l)
                        })
                        .await
                        .unwrap()
                        .0;
                        ended.push((
                            name.clone(),
                            code,
                            std::fs::read_to_string(&log).unwrap_or_default(),
                        ));
                        drop((pod_ns, node_ns));
                        let _ = pods
                            .delete(
                                &name,
                                &kube::api::DeleteParams {
                                    grace_period_seconds: Some(0),
                                    ..Default::default()
                                },
                            )
                            .await;
                        continue;
                    }
                    if deleting
                        || running.contains_key(&uid)
                        || p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Succeeded")
                    {
                        continue;
                    }
                    // Numbered across every kubelet of this process: tests run side by side,
                    // and a namespace of the same name would replace another test's.
                    let n = POD_NUMBER.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                    let ip = format!("10.245.{n}.5");
                    let (node_ns, pod_ns) =
                        tests::pod_namespace(&format!("k{n}"), &ip, &format!("10.245.{n}.1"));
                    cluster.kubelet_run(&name, &node).await;
                    kubelet_pod_ip(&cluster, &name, &ip).await;
                    let log = work.join(format!("launcher-{n}.log"));
                    let l = start_launcher_logged(
                        Some(&pod_ns.name),
                        &pods_dir,
                        &uid,
                        &work,
                        Some(&log),
                    );
                    running.insert(uid, (l, pod_ns, node_ns, log));
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            for mount in attached.values() {
                let _ = std::process::Command::new("umount").arg(mount).status();
            }
            ended
        });
        TestKubelet {
            stop,
            task: Some(task),
        }
    }

    /// Stops watching; returns the launchers that ended: (Pod, exit code, stderr).
    async fn finish(mut self) -> Vec<EndedLauncher> {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.task.take().unwrap().await.unwrap()
    }
}

/// KubeVirt's everyday path with nothing stood in for: a VirtualMachine applied through the
/// API becomes a VMI and a launcher Pod (virt-controller), the kubelet starts the launcher in
/// the Pod's namespace, virt-handler wires the Pod network and Syncs it — the VMI turns Running
/// with its interface's IP, set by the handler. Stopping the VM deletes the Pod; the launcher
/// gets SIGTERM and the guest shuts down gracefully (it powers off on Ctrl-Alt-Del).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_applied_through_the_api_runs_on_the_pod_network_and_stops_gracefully() {
    use api::VirtualMachine;
    tests::require_kvm();
    let work = tests::probe_workdir("mv-handler-vm");
    let pods_dir = work.join("pods");
    let cluster = Cluster::start().await;
    let _controller = cluster.replica(test_config(), None);
    let kubelet = TestKubelet::start(&cluster, NODE, &pods_dir, &work);
    let _handler = start_handler(&cluster, &pods_dir, &work);
    cluster
        .apply_yaml::<VirtualMachine>(
            r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: kbd}
spec:
  runStrategy: Always
  template:
    spec:
      terminationGracePeriodSeconds: 60
      domain:
        memory: {guest: 64Mi}
        devices:
          interfaces: [{name: default, masquerade: {}}]
        firmware:
          kernelBoot:
            container: {image: "microvirt/probe:latest", kernelPath: /probe}
            kernelArgs: "console=ttyS0 probe.test=keyboard"
      networks: [{name: default, pod: {}}]
"#,
        )
        .await;
    let vmis = cluster.api::<VirtualMachineInstance>();
    let running = eventually(
        "VMI Running with its IP (virt-handler)",
        Duration::from_secs(90),
        || async {
            let v = vmis.get_opt("kbd").await.unwrap()?;
            let s = v.status.clone()?;
            let ip = s.interfaces.first()?.ip_address.clone()?;
            (s.phase == Some(VmiPhase::Running)).then_some(ip)
        },
    )
    .await;
    let pod = launcher_pod_of(&cluster, "kbd").await;
    assert_eq!(
        Some(running),
        pod.status.and_then(|s| s.pod_ip),
        "the VMI's interface has its Pod's IP"
    );
    use kube::api::{Patch, PatchParams};
    cluster
        .api::<VirtualMachine>()
        .patch(
            "kbd",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"runStrategy": "Halted"}})),
        )
        .await
        .unwrap();
    eventually("the VMI gone", Duration::from_secs(90), || async {
        vmis.get_opt("kbd").await.unwrap().is_none().then_some(())
    })
    .await;
    // The kubelet finishes the Pod's deletion once its launcher has exited.
    eventually("the launcher Pod gone", Duration::from_secs(60), || async {
        let pods = cluster
            .api::<k8s_openapi::api::core::v1::Pod>()
            .list(&Default::default())
            .await
            .unwrap();
        pods.items.is_empty().then_some(())
    })
    .await;
    let ended = kubelet.finish().await;
    assert_eq!(ended.len(), 1, "{ended:?}");
    let (_, code, log) = &ended[0];
    assert_eq!(*code, Some(0), "{log}");
    assert!(
        log.contains("guest powered off"),
        "not a graceful shutdown: {log}"
    );
    let _ = std::fs::remove_dir_all(work);
}

/// The nodes' certificates from the cluster, as virt-operator installs them: each handler asks
/// with a CSR under its node-bound token (`--request-node-certificate`), the operator's signer
/// issues for that node alone — 20-second certificates here — and the handlers renew them on
/// their own. The guest migrates node-1 → node-2 on the first certificates and back after
/// those have expired, on renewed ones. A request for another node's name, even with a real
/// handler token, is denied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_certificates_from_the_operators_signer_carry_migrations_across_renewals() {
    use futures::StreamExt;
    use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
    use kube::api::{Api, PostParams};
    tests::require_kvm();
    let work = tests::probe_workdir("mv-handler-csr");
    let pods_dir = work.join("pods");
    let (n1, n2) = tests::two_nodes("hc1", "hc2");
    let cluster = Cluster::start().await;
    let _controller = cluster.replica(test_config(), None);

    // The installation's CA as virt-operator keeps it, its CR asking for 20 s server
    // certificates, and the operator's signer.
    let ca = virt_operator::certs::new_ca(Duration::from_secs(3600)).unwrap();
    let secret: k8s_openapi::api::core::v1::Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "kubevirt-ca", "namespace": "microvirt"},
        "stringData": {"tls.crt": ca.cert, "tls.key": ca.key},
    }))
    .unwrap();
    let pp = PostParams::default();
    Api::namespaced(cluster.client.clone(), "microvirt")
        .create(&pp, &secret)
        .await
        .unwrap();
    let bundle: k8s_openapi::api::core::v1::ConfigMap = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "kubevirt-ca", "namespace": "microvirt"},
        "data": {"ca-bundle": ca.cert},
    }))
    .unwrap();
    Api::namespaced(cluster.client.clone(), "microvirt")
        .create(&pp, &bundle)
        .await
        .unwrap();
    let kv: api::kubevirt::KubeVirt = serde_yaml::from_str(
        "apiVersion: kubevirt.io/v1\nkind: KubeVirt\nmetadata: {name: kubevirt, namespace: microvirt}\nspec:\n  certificateRotateStrategy: {selfSigned: {server: {duration: 20s, renewBefore: 4s}}}\n",
    )
    .unwrap();
    Api::namespaced(cluster.client.clone(), "microvirt")
        .create(&pp, &kv)
        .await
        .unwrap();
    let signer = std::sync::Arc::new(virt_operator::node_certs::Signer {
        client: cluster.client.clone(),
        namespace: "microvirt".into(),
    });
    let csrs: Api<CertificateSigningRequest> = Api::all(cluster.client.clone());
    let _signer = tokio::spawn(
        kube::runtime::Controller::new(csrs.clone(), Default::default())
            .run(
                virt_operator::node_certs::reconcile,
                virt_operator::node_certs::error_policy,
                signer,
            )
            .for_each(|_| async {}),
    );

    // node-1's own token cannot get node-2's name.
    let account = tests::rbac::service_account_user("microvirt", "virt-handler");
    let forged = handler::node_certificate::CertificateRequester {
        client: cluster.api.client_on_node(&account, "node-1"),
        node: "node-2".into(),
        namespace: "microvirt".into(),
        patience: Duration::from_secs(20),
    };
    let refused = forged.request().await.unwrap_err().to_string();
    assert!(
        refused.contains("denied") && refused.contains("node-2"),
        "{refused}"
    );

    let vmis = cluster.api::<VirtualMachineInstance>();
    cluster
        .apply_yaml::<VirtualMachineInstance>(&VMI.replace(
            "probe.test=console",
            "probe.test=dirty probe.passes=1000000",
        ))
        .await;
    let source = launcher_pod_of(&cluster, "probe").await;
    let source_name = source.metadata.name.clone().unwrap();
    cluster.kubelet_run(&source_name, "node-1").await;
    kubelet_pod_ip(&cluster, &source_name, "10.78.0.1").await;
    let _l1 = start_launcher_in(
        Some(&n1.name),
        &pods_dir,
        source.metadata.uid.as_deref().unwrap(),
        &work,
    );
    let request = ["--request-node-certificate".to_string()];
    let _h1 = start_handler_args("node-1", &cluster, &pods_dir, &work, None, &request);
    let _h2 = start_handler_args("node-2", &cluster, &pods_dir, &work, None, &request);
    eventually("VMI Running on node-1", Duration::from_secs(60), || async {
        let v = vmis.get("probe").await.unwrap();
        (v.status?.phase == Some(VmiPhase::Running)).then_some(())
    })
    .await;

    // The issued certificates: one per node, each naming its node.
    let issued = |node: &'static str| {
        let csrs = csrs.clone();
        async move {
            let mut out: Vec<String> = csrs
                .list(&Default::default())
                .await
                .unwrap()
                .items
                .into_iter()
                .filter(|c| {
                    c.spec
                        .extra
                        .as_ref()
                        .and_then(|e| e.get(api::kubevirt::NODE_NAME_EXTRA))
                        == Some(&vec![node.to_string()])
                })
                .filter_map(|c| String::from_utf8(c.status?.certificate?.0).ok())
                .collect();
            out.sort();
            out
        }
    };
    for node in ["node-1", "node-2"] {
        let certs = eventually(
            &format!("{node}'s certificate"),
            Duration::from_secs(30),
            || async {
                let c = issued(node).await;
                (!c.is_empty()).then_some(c)
            },
        )
        .await;
        let (_, pem) = x509_parser::pem::parse_x509_pem(certs[0].as_bytes()).unwrap();
        let cert = pem.parse_x509().unwrap();
        let names: Vec<String> = cert
            .subject_alternative_name()
            .unwrap()
            .unwrap()
            .value
            .general_names
            .iter()
            .map(|n| n.to_string())
            .collect();
        assert_eq!(names, [format!("DNSName({node})")]);
    }

    let (first, _l2) = migrate(
        &cluster,
        &pods_dir,
        &work,
        "there",
        ("node-2", &n2.name, "10.78.0.2"),
    )
    .await;
    assert_eq!(first, api::MigrationPhase::Succeeded);

    // Both handlers renew (every ~16 s); once the first certificates have expired, the guest
    // goes back on renewed ones.
    let t = Duration::from_secs(90);
    let first_ends = std::time::SystemTime::now() + Duration::from_secs(21);
    for node in ["node-1", "node-2"] {
        eventually(&format!("{node} renewed twice"), t, || async {
            (issued(node).await.len() >= 3).then_some(())
        })
        .await;
    }
    while std::time::SystemTime::now() < first_ends {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let (back, _l3) = migrate(
        &cluster,
        &pods_dir,
        &work,
        "back",
        ("node-1", &n1.name, "10.78.0.1"),
    )
    .await;
    assert_eq!(back, api::MigrationPhase::Succeeded);
    eventually("VMI Running on node-1 again", t, || async {
        let s = vmis.get("probe").await.unwrap().status?;
        (s.phase == Some(VmiPhase::Running) && s.node_name.as_deref() == Some("node-1"))
            .then_some(())
    })
    .await;
    drop((n1, n2));
    let _ = std::fs::remove_dir_all(work);
}

/// Migrates the VMI `probe` through the API to `(node, its namespace, its address)`: the
/// migration `name`, its target Pod run there with a real launcher; returns how it ended, and
/// the target launcher (the guest runs on in it).
async fn migrate(
    cluster: &Cluster,
    pods_dir: &Path,
    work: &Path,
    name: &str,
    (node, netns, ip): (&str, &str, &str),
) -> (api::MigrationPhase, Proc) {
    use api::{MigrationPhase, VirtualMachineInstanceMigration};
    let m = cluster
        .apply_yaml::<VirtualMachineInstanceMigration>(&format!(
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstanceMigration\nmetadata: {{name: {name}}}\nspec: {{vmiName: probe}}\n"
        ))
        .await;
    let target = cluster.target_pod(&m.metadata.uid.clone().unwrap()).await;
    let target_name = target.metadata.name.clone().unwrap();
    cluster.kubelet_run(&target_name, node).await;
    kubelet_pod_ip(cluster, &target_name, ip).await;
    let launcher = start_launcher_in(
        Some(netns),
        pods_dir,
        target.metadata.uid.as_deref().unwrap(),
        work,
    );
    let migrations = cluster.api::<VirtualMachineInstanceMigration>();
    let phase = eventually(
        &format!("migration {name} to end"),
        Duration::from_secs(90),
        || async {
            let p = migrations.get(name).await.unwrap().status?.phase?;
            matches!(p, MigrationPhase::Succeeded | MigrationPhase::Failed).then_some(p)
        },
    )
    .await;
    (phase, launcher)
}

/// A VM for the sandbox tests: the probe with `args`, 64 MiB, on the Pod network.
fn sandbox_vm(run_strategy: &str, args: &str) -> serde_json::Value {
    serde_json::json!({
        "runStrategy": run_strategy,
        "template": {"spec": {
            "domain": {
                "memory": {"guest": "64Mi"},
                "devices": {"interfaces": [{"name": "default", "masquerade": {}}]},
                "firmware": {"kernelBoot": {
                    "container": {"image": "microvirt/probe:latest", "kernelPath": "/probe"},
                    "kernelArgs": format!("console=ttyS0 {args}"),
                }},
            },
            "networks": [{"name": "default", "pod": {}}],
        }},
    })
}

/// The guest's console of the launcher in `pod_uid`, as virt-handler reaches it.
async fn console_of(
    pods_dir: &Path,
    pod_uid: &str,
) -> tokio::io::BufReader<tokio::net::unix::OwnedReadHalf> {
    use api::protocol::{Request, Response};
    let socket = handler::launcher::socket_path(pods_dir, pod_uid);
    // A loaded node (several guests, tests side by side) can keep a launcher from answering
    // for a while: asked again, as virt-handler would.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let answer = match handler::launcher::LauncherClient::connect(
            &socket,
            Duration::from_secs(10),
        )
        .await
        {
            Ok(mut c) => match c.call(&Request::Console).await {
                Ok(Response::Ok) => return c.into_stream().0,
                other => format!("{other:?}"),
            },
            Err(e) => e.to_string(),
        };
        assert!(
            tokio::time::Instant::now() < deadline,
            "no console from {}: {answer}",
            socket.display()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Reads the console until the whole line holding `needle` is there; returns all read.
async fn console_line(
    console: &mut tokio::io::BufReader<tokio::net::unix::OwnedReadHalf>,
    needle: &str,
    seen: &mut String,
) {
    use tokio::io::AsyncReadExt;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let mut buf = [0u8; 1024];
    loop {
        if let Some(at) = seen.find(needle) {
            if seen[at..].contains('\n') {
                return;
            }
        }
        let n = tokio::time::timeout_at(deadline, console.read(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("no {needle:?} line on the console; got:\n{seen}"))
            .unwrap();
        assert!(n > 0, "the console closed before {needle:?}; got:\n{seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
}

/// The cluster for machine-state snapshots: virt-controller, a storage node provisioning
/// claims under `storage/<namespace>/<claim>` (which the launchers see as their volumes), the
/// test kubelet, virt-handler, and the KubeVirt CR naming a `vmStateStorageClass`.
struct StateSite {
    work: PathBuf,
    pods_dir: PathBuf,
    storage: PathBuf,
    cluster: Cluster,
    _controller: tests::cluster::Replica,
    node: tests::storage::ImportNode,
    kubelet: TestKubelet,
    _handler: Proc,
}

impl StateSite {
    async fn start(tag: &str) -> StateSite {
        tests::require_kvm();
        let work = tests::probe_workdir(tag);
        let pods_dir = work.join("pods");
        let storage = work.join("storage");
        std::fs::create_dir_all(storage.join("default")).unwrap();
        std::os::unix::fs::symlink(storage.join("default"), work.join("volumes")).unwrap();
        let cluster = Cluster::start().await;
        let controller = cluster.replica(test_config(), None);
        let node = tests::storage::ImportNode::start(&cluster, &storage);
        let kubelet = TestKubelet::start(&cluster, NODE, &pods_dir, &work);
        let handler = start_handler(&cluster, &pods_dir, &work);
        let kv: api::kubevirt::KubeVirt = serde_yaml::from_str(
            "apiVersion: kubevirt.io/v1\nkind: KubeVirt\nmetadata: {name: kubevirt, namespace: microvirt}\nspec:\n  configuration: {vmStateStorageClass: local}\n",
        )
        .unwrap();
        kube::Api::<api::kubevirt::KubeVirt>::namespaced(cluster.client.clone(), "microvirt")
            .create(&Default::default(), &kv)
            .await
            .unwrap();
        StateSite {
            work,
            pods_dir,
            storage,
            cluster,
            _controller: controller,
            node,
            kubelet,
            _handler: handler,
        }
    }

    /// A VirtualMachineSnapshot `name` of VM `vm`, once it has Succeeded.
    async fn snapshot(&self, name: &str, vm: &str) -> api::snapshot::VirtualMachineSnapshot {
        use api::snapshot::{SnapshotPhase, VirtualMachineSnapshot};
        let snapshots = self.cluster.api::<VirtualMachineSnapshot>();
        let snapshot: VirtualMachineSnapshot = serde_yaml::from_str(&format!(
            "apiVersion: snapshot.kubevirt.io/v1beta1\nkind: VirtualMachineSnapshot\nmetadata: {{name: {name}}}\nspec:\n  source: {{apiGroup: kubevirt.io, kind: VirtualMachine, name: {vm}}}\n",
        ))
        .unwrap();
        snapshots
            .create(&Default::default(), &snapshot)
            .await
            .unwrap();
        eventually(
            &format!("snapshot {name} Succeeded"),
            Duration::from_secs(90),
            || async {
                let s = snapshots.get(name).await.unwrap();
                let st = s.status.clone()?;
                assert_ne!(st.phase, Some(SnapshotPhase::Failed), "{:?}", st.error);
                (st.phase == Some(SnapshotPhase::Succeeded)).then_some(s)
            },
        )
        .await
    }

    /// A VirtualMachineClone of snapshot `snapshot` into VM `name`, with `extra` spec lines.
    async fn clone_of(&self, snapshot: &str, name: &str, extra: &str) {
        let clone: api::clone::VirtualMachineClone = serde_yaml::from_str(&format!(
            "apiVersion: clone.kubevirt.io/v1beta1\nkind: VirtualMachineClone\nmetadata: {{name: {name}}}\nspec:\n  source: {{apiGroup: snapshot.kubevirt.io, kind: VirtualMachineSnapshot, name: {snapshot}}}\n  target: {{apiGroup: kubevirt.io, kind: VirtualMachine, name: {name}}}\n  {extra}\n"
        ))
        .unwrap();
        self.cluster
            .api::<api::clone::VirtualMachineClone>()
            .create(&Default::default(), &clone)
            .await
            .unwrap();
    }

    async fn finish(self) {
        self.kubelet.finish().await;
        self.node.stop().await;
        let _ = std::fs::remove_dir_all(&self.work);
    }
}

/// The console of VM `name`'s first launcher, followed from a task started as soon as its
/// Pod exists (the launcher keeps its console's start for late readers, but not past its end:
/// a guest that finishes its run ends it), up to the line holding `until`.
fn follow(
    site: &StateSite,
    name: &str,
    until: &str,
) -> tokio::task::JoinHandle<(
    tokio::io::BufReader<tokio::net::unix::OwnedReadHalf>,
    String,
)> {
    let (cluster, pods_dir) = (site.cluster.clone_handle(), site.pods_dir.clone());
    let (name, until) = (name.to_string(), until.to_string());
    tokio::spawn(async move {
        let uid = launcher_pod_of(&cluster, &name).await.metadata.uid.unwrap();
        let mut console = console_of(&pods_dir, &uid).await;
        let mut seen = String::new();
        console_line(&mut console, &until, &mut seen).await;
        (console, seen)
    })
}

/// What a followed console read, once it has its line.
async fn read(
    followed: tokio::task::JoinHandle<(
        tokio::io::BufReader<tokio::net::unix::OwnedReadHalf>,
        String,
    )>,
) -> String {
    followed.await.unwrap().1
}

/// The guest on `console` resumed a saved run — a booted probe greets first.
fn assert_resumed(name: &str, console: &str) {
    assert!(
        !console.contains("microvirt probe guest: hello"),
        "{name} booted:\n{console}"
    );
}

/// The last generation ID the probe announced on `console`.
fn generation(console: &str) -> Option<String> {
    console
        .lines()
        .filter_map(|l| l.strip_prefix("PROBE GENID "))
        .next_back()
        .map(|id| id.trim().to_string())
}

/// The ticks the first progress line of the probe's timer run on `console` counts.
fn first_ticks(console: &str) -> Option<u64> {
    console
        .lines()
        .find_map(|l| l.strip_prefix("PROBE PROGRESS timer ticks="))
        .and_then(|n| n.trim().parse().ok())
}

/// A VirtualMachineSnapshot of a running VM keeps its memory and machine state (microvirt's
/// extension, with the cluster's `vmStateStorageClass` set): virt-controller makes the state
/// claim and an attachment Pod on the VMI's node, virt-handler has the launcher save the
/// machine and moves it into the claim, the disks are cut while the guest is paused, and the
/// guest goes on to finish its run. A VirtualMachineRestore of the snapshot into a new VM
/// resumes the saved guest — which finishes the same run, though the restore's patch gives
/// the VM the kernel arguments of another probe test, which a booted guest would run. Two
/// VirtualMachineClones of the snapshot start running the same way, each with a MAC and a
/// generation ID of its own. From a snapshot of an idle guest, a VirtualMachinePool annotated
/// `snapshot.microvirt.io/start-from-snapshot: <snapshot>` starts every member from it (each
/// VM taking the annotation once) and reaches all Ready, and so does a VMI ReplicaSet whose
/// template carries it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_of_a_running_vm_restores_and_pools_to_guests_that_resume() {
    const MEMBERS: usize = 10;
    use api::snapshot::{VirtualMachineRestore, VirtualMachineSnapshotContent};
    use api::VirtualMachine;
    use kube::api::PostParams;
    use kube::ResourceExt;
    let site = StateSite::start("mv-handler-state-capture").await;
    let cluster = &site.cluster;
    let vms = cluster.api::<VirtualMachine>();
    let vmis = cluster.api::<VirtualMachineInstance>();
    let create = |name: &str, spec: serde_json::Value| {
        let vm: VirtualMachine = serde_json::from_value(serde_json::json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": name}, "spec": spec,
        }))
        .unwrap();
        let vms = vms.clone();
        async move { vms.create(&PostParams::default(), &vm).await.unwrap() }
    };
    // Runs once: what is restored or cloned from it finishes its run and stops.
    create(
        "source",
        sandbox_vm("Once", "probe.test=dirty probe.passes=40"),
    )
    .await;
    let (mut console, mut seen) = follow(&site, "source", "PROBE PROGRESS dirty pass=3")
        .await
        .unwrap();
    let source_mac = eventually("the source's MAC", Duration::from_secs(30), || async {
        let v = vmis.get_opt("source").await.unwrap()?;
        v.status?.interfaces.first()?.mac.clone()
    })
    .await;
    let done = site.snapshot("snap", "source").await;
    // The capture request is off the VMI (which goes once its single run is over).
    if let Some(vmi) = vmis.get_opt("source").await.unwrap() {
        assert_eq!(
            api::snapshot::capture_state(vmi.metadata.annotations.as_ref()),
            None
        );
    }
    let claim = api::snapshot::state_claim_name(&done.uid().unwrap());
    let content = cluster
        .api::<VirtualMachineSnapshotContent>()
        .get(
            done.status
                .as_ref()
                .unwrap()
                .virtual_machine_snapshot_content_name
                .as_deref()
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(
        content
            .annotations()
            .get(api::snapshot::ANNOTATION_STATE_CLAIM),
        Some(&claim)
    );
    let saved = site.storage.join("default").join(&claim);
    assert!(std::fs::metadata(saved.join("memory")).unwrap().len() >= 64 << 20);
    assert!(saved.join("state").is_file());
    // The source goes on where it was paused, to the end of its run; the attachment Pod is
    // gone.
    console_line(&mut console, "PROBE RESULT", &mut seen).await;
    assert!(seen.contains("PROBE RESULT dirty OK"), "{seen}");
    eventually(
        "the attachment Pod gone",
        Duration::from_secs(30),
        || async {
            let pods = cluster.api::<k8s_openapi::api::core::v1::Pod>();
            let name = api::snapshot::state_attachment_name(&claim);
            pods.get_opt(&name).await.unwrap().is_none().then_some(())
        },
    )
    .await;

    let restore: VirtualMachineRestore = serde_yaml::from_str(&format!(
        "apiVersion: snapshot.kubevirt.io/v1beta1\nkind: VirtualMachineRestore\nmetadata: {{name: back}}\nspec:\n  target: {{apiGroup: kubevirt.io, kind: VirtualMachine, name: restored}}\n  virtualMachineSnapshotName: snap\n  patches: [{:?}]\n",
        r#"[{"op": "replace", "path": "/spec/template/spec/domain/firmware/kernelBoot/kernelArgs", "value": "console=ttyS0 probe.test=keyboard"}]"#
    ))
    .unwrap();
    let restores = cluster.api::<VirtualMachineRestore>();
    restores
        .create(&PostParams::default(), &restore)
        .await
        .unwrap();
    let restored = read(follow(&site, "restored", "PROBE RESULT")).await;
    assert!(restored.contains("PROBE RESULT dirty OK"), "{restored}");
    assert_resumed("restored", &restored);
    // Taken once its VMI ran: the restored VM keeps no annotation for its next start.
    eventually("the annotation taken", Duration::from_secs(30), || async {
        let vm = vms.get("restored").await.unwrap();
        api::snapshot::start_from_snapshot(vm.metadata.annotations.as_ref())
            .is_none()
            .then_some(())
    })
    .await;

    // A restore that would resume the machine with another memory size: refused, the reason on
    // its Failure condition, no VM written.
    let bigger: VirtualMachineRestore = serde_yaml::from_str(&format!(
        "apiVersion: snapshot.kubevirt.io/v1beta1\nkind: VirtualMachineRestore\nmetadata: {{name: bigger}}\nspec:\n  target: {{apiGroup: kubevirt.io, kind: VirtualMachine, name: bigger}}\n  virtualMachineSnapshotName: snap\n  patches: [{:?}]\n",
        r#"[{"op": "replace", "path": "/spec/template/spec/domain/memory/guest", "value": "128Mi"}]"#
    ))
    .unwrap();
    restores
        .create(&PostParams::default(), &bigger)
        .await
        .unwrap();
    let why = eventually("the restore refused", Duration::from_secs(30), || async {
        let r = restores.get("bigger").await.unwrap();
        r.status?
            .conditions
            .iter()
            .find(|c| c.type_ == "Failure" && c.status == "True")
            .and_then(|c| c.message.clone())
    })
    .await;
    assert!(
        why.contains("its CPU topology and guest memory cannot be changed"),
        "{why}"
    );
    assert!(vms.get_opt("bigger").await.unwrap().is_none());

    // Two clones of the snapshot start running, each resuming the saved guest with a MAC of
    // its own (one given, one derived from its name), never the source's, and a generation ID
    // of its own.
    site.clone_of(
        "snap",
        "clone-a",
        r#"newMacAddresses: {default: "02:00:00:00:aa:01"}"#,
    )
    .await;
    site.clone_of("snap", "clone-b", "").await;
    let followed = ["clone-a", "clone-b"].map(|name| follow(&site, name, "PROBE RESULT"));
    // Each clone's MAC as its VMI reports it while it runs (it runs once: its VMI goes when
    // the run is over).
    let reported_macs = ["clone-a", "clone-b"].map(|name| {
        let vmis = vmis.clone();
        tokio::spawn(async move {
            eventually(
                &format!("{name}'s MAC"),
                Duration::from_secs(90),
                || async {
                    let v = vmis.get_opt(name).await.unwrap()?;
                    v.status?.interfaces.first()?.mac.clone()
                },
            )
            .await
        })
    });
    let mut generations = vec![generation(&seen).expect("the source's generation ID")];
    let mut macs = Vec::new();
    let clones = ["clone-a", "clone-b"].into_iter().zip(followed);
    for ((name, followed), mac) in clones.zip(reported_macs) {
        let console = read(followed).await;
        assert!(
            console.contains("PROBE RESULT dirty OK"),
            "{name} did not finish the run:\n{console}"
        );
        assert_resumed(name, &console);
        generations.push(generation(&console).expect("a new generation announced"));
        macs.push(mac.await.unwrap());
    }
    assert_eq!(macs[0], "02:00:00:00:aa:01");
    assert_ne!(macs[1], macs[0]);
    assert_ne!(macs[1], source_mac);
    assert!(
        generations[0] != generations[1]
            && generations[1] != generations[2]
            && generations[0] != generations[2],
        "source and clones share a generation ID: {generations:?}"
    );

    // Sandboxes: an idle guest (the probe's 100 Hz timer) snapshotted warm, then a pool and a
    // VMI ReplicaSet started from it, whose members stay up. A member that resumed counts on
    // from the snapshot's ticks; a booted one would greet and run its template's test.
    create(
        "warm",
        sandbox_vm("Always", "probe.test=timer probe.ticks=1000000"),
    )
    .await;
    follow(&site, "warm", "PROBE PROGRESS timer ticks=30")
        .await
        .unwrap();
    let warm = site.snapshot("warm", "warm").await;
    let warm_claim = api::snapshot::state_claim_name(&warm.uid().unwrap());
    vms.delete("warm", &Default::default()).await.unwrap();
    let mut member = sandbox_vm("Always", "probe.test=keyboard");
    member["template"]["metadata"] =
        serde_json::json!({"labels": {"kubevirt.io/vmpool": "sandboxes"}});
    let pool: api::VirtualMachinePool = serde_json::from_value(serde_json::json!({
        "apiVersion": "pool.kubevirt.io/v1beta1", "kind": "VirtualMachinePool",
        "metadata": {"name": "sandboxes"},
        "spec": {
            "replicas": MEMBERS,
            "selector": {"matchLabels": {"kubevirt.io/vmpool": "sandboxes"}},
            "virtualMachineTemplate": {
                "metadata": {
                    "labels": {"kubevirt.io/vmpool": "sandboxes"},
                    "annotations": {api::snapshot::ANNOTATION_START_FROM_SNAPSHOT: "warm"},
                },
                "spec": member,
            },
        },
    }))
    .unwrap();
    cluster
        .api::<api::VirtualMachinePool>()
        .create(&PostParams::default(), &pool)
        .await
        .unwrap();
    let mut template = sandbox_vm("Always", "probe.test=keyboard")["template"].clone();
    template["metadata"] = serde_json::json!({
        "labels": {"app": "sandbox-rs"},
        "annotations": {api::snapshot::ANNOTATION_START_FROM_SNAPSHOT: "warm"},
    });
    let rs: api::VirtualMachineInstanceReplicaSet = serde_json::from_value(serde_json::json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstanceReplicaSet",
        "metadata": {"name": "sandbox-rs"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "sandbox-rs"}},
            "template": template,
        },
    }))
    .unwrap();
    cluster
        .api::<api::VirtualMachineInstanceReplicaSet>()
        .create(&PostParams::default(), &rs)
        .await
        .unwrap();
    let replicas = eventually("two replicas", Duration::from_secs(30), || async {
        let lp = kube::api::ListParams::default().labels("app=sandbox-rs");
        let names: Vec<String> = vmis
            .list(&lp)
            .await
            .unwrap()
            .items
            .iter()
            .map(|v| v.name_any())
            .collect();
        (names.len() == 2).then_some(names)
    })
    .await;
    let names: Vec<String> = (0..MEMBERS)
        .map(|i| format!("sandboxes-{i}"))
        .chain(replicas)
        .collect();
    let followed: Vec<_> = names
        .iter()
        .map(|n| follow(&site, n, "PROBE PROGRESS timer ticks="))
        .collect();
    for (name, followed) in names.iter().zip(followed) {
        let console = read(followed).await;
        assert_resumed(name, &console);
        let ticks = first_ticks(&console);
        assert!(
            ticks.is_some_and(|t| t > 30),
            "{name} did not count on from the snapshot:\n{console}"
        );
        let vmi = vmis.get(name).await.unwrap();
        assert_eq!(
            api::snapshot::start_from_state(vmi.metadata.annotations.as_ref()),
            Some(warm_claim.as_str())
        );
    }
    eventually("the pool Ready", Duration::from_secs(60), || async {
        let p = cluster
            .api::<api::VirtualMachinePool>()
            .get("sandboxes")
            .await
            .unwrap();
        (p.status?.ready_replicas == MEMBERS as i32).then_some(())
    })
    .await;
    site.finish().await;
}

/// Clones of a running-state snapshot resume writing disks of their own: the guest streams
/// writes to its claim (`blkstream`) and is captured mid-stream — its disk cut, on a CSI
/// storage class, while it is paused for its machine state — then two VirtualMachineClones of
/// the snapshot go on from where it was, each on its own copy: both verify every sector the
/// run wrote, before and after the capture, while the snapshot's copy of the disk keeps
/// exactly what was written up to the capture.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clones_of_a_running_state_snapshot_resume_writing_their_own_disks() {
    use api::VirtualMachine;
    use kube::api::{DynamicObject, PostParams};
    use kube::ResourceExt;
    const WRITES: u64 = 512;
    let site = StateSite::start("mv-handler-state-disks").await;
    let cluster = &site.cluster;
    let sc: k8s_openapi::api::storage::v1::StorageClass = serde_json::from_value(
        serde_json::json!({"metadata": {"name": "csi"}, "provisioner": "csi.example.com"}),
    )
    .unwrap();
    kube::Api::<k8s_openapi::api::storage::v1::StorageClass>::all(cluster.client.clone())
        .create(&PostParams::default(), &sc)
        .await
        .unwrap();
    let classes = kube::Api::<DynamicObject>::all_with(
        cluster.client.clone(),
        &kube::api::ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk(
                "snapshot.storage.k8s.io",
                "v1",
                "VolumeSnapshotClass",
            ),
            "volumesnapshotclasses",
        ),
    );
    let vsc: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass",
        "metadata": {"name": "csi-snapshots"}, "driver": "csi.example.com",
        "deletionPolicy": "Delete"}))
    .unwrap();
    classes.create(&PostParams::default(), &vsc).await.unwrap();
    let pvc: k8s_openapi::api::core::v1::PersistentVolumeClaim =
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "writer-root"},
            "spec": {"storageClassName": "csi", "accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": "16Mi"}}},
        }))
        .unwrap();
    let claims = cluster.api::<k8s_openapi::api::core::v1::PersistentVolumeClaim>();
    claims.create(&PostParams::default(), &pvc).await.unwrap();
    eventually("the claim bound", Duration::from_secs(30), || async {
        let c = claims.get("writer-root").await.unwrap();
        (c.status?.phase.as_deref() == Some("Bound")).then_some(())
    })
    .await;
    let root = site.storage.join("default/writer-root");
    let image = tests::blkstream_image(&root);
    tests::chown_to_pod_user(&image);

    let mut spec = sandbox_vm(
        "Once",
        &format!("probe.test=blkstream probe.writes={WRITES}"),
    );
    spec["template"]["spec"]["domain"]["devices"]["disks"] =
        serde_json::json!([{"name": "root", "disk": {"bus": "virtio"}}]);
    spec["template"]["spec"]["volumes"] = serde_json::json!([{"name": "root", "persistentVolumeClaim": {"claimName": "writer-root"}}]);
    let writer: VirtualMachine = serde_json::from_value(serde_json::json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": "writer"}, "spec": spec,
    }))
    .unwrap();
    let vms = cluster.api::<VirtualMachine>();
    vms.create(&PostParams::default(), &writer).await.unwrap();
    let (mut console, mut seen) = follow(&site, "writer", "PROBE PROGRESS blkstream writes=64")
        .await
        .unwrap();
    let done = site.snapshot("disks", "writer").await;
    // The source goes on to the end of its run on its own disk.
    console_line(&mut console, "PROBE RESULT", &mut seen).await;
    assert!(seen.contains("PROBE RESULT blkstream OK"), "{seen}");
    let cut = site
        .storage
        .join(".snapshots/default")
        .join(api::snapshot::volume_snapshot_name(
            &done.uid().unwrap(),
            "root",
        ))
        .join("disk.img");
    let at_capture = std::fs::read(&cut)
        .unwrap_or_else(|e| panic!("the VolumeSnapshot's copy {}: {e}", cut.display()));

    let clones = ["disk-clone-a", "disk-clone-b"];
    for name in clones {
        site.clone_of("disks", name, "").await;
    }
    let followed = clones.map(|name| follow(&site, name, "PROBE RESULT"));
    let mut disks = Vec::new();
    for (name, followed) in clones.into_iter().zip(followed) {
        let seen = read(followed).await;
        assert!(
            seen.contains("PROBE RESULT blkstream OK"),
            "{name} did not finish the run:\n{seen}"
        );
        assert_resumed(name, &seen);
        let vm = vms.get(name).await.unwrap();
        let spec = vm.spec.template.spec.unwrap();
        let volume = &spec.volumes[0];
        let claim = volume
            .persistent_volume_claim
            .as_ref()
            .map(|p| p.claim_name.clone())
            .or_else(|| volume.data_volume.as_ref().map(|d| d.name.clone()))
            .unwrap();
        assert_ne!(claim, "writer-root");
        disks.push(site.storage.join("default").join(claim).join("disk.img"));
    }
    assert_ne!(disks[0], disks[1]);
    for d in &disks {
        tests::assert_blkstream_image(d, WRITES);
    }
    tests::assert_blkstream_image(&image, WRITES);
    // The capture's copy: what was written up to it, unchanged by the clones' writes.
    assert_eq!(std::fs::read(&cut).unwrap(), at_capture);
    let written = (0..WRITES * 8)
        .take_while(|&s| tests::blkstream_sector_ok(&at_capture, s))
        .count() as u64;
    assert!(
        (64 * 8..WRITES * 8).contains(&written),
        "the capture holds {written} sectors; it was taken mid-stream"
    );
    site.finish().await;
}
