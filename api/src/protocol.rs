//! The launcher control protocol: JSON, one message per line, on the launcher's unix socket.
//!
//! Every connection starts with `Hello { version }`; a launcher answers `Hello` with its own
//! version, or `Error` and closes when it does not speak the client's version (the VM is not
//! touched). After that a client sends requests and reads one response per request, except:
//! - `Console` turns the connection into a raw byte stream: guest console output to the client,
//!   client bytes to the guest's console input (several clients may attach);
//! - `Events` turns it into a stream of `Event` lines.
//!
//! Versions: 1 is the lifecycle above. 2 adds `Snapshot`, answered by zero or more
//! `Event(SnapshotProgress)` lines on the same connection and then `Snapshot` (or `Error`).
//! 3 adds live migration: `PrepareMigrationTarget` on the target (answered at once with the
//! address it listens on), `MigrateOut` on the source (zero or more `Event(MigrationProgress)`
//! lines, then `Migration` or `Error`) and `CancelMigration`. Migration addresses are
//! `tcp:HOST:PORT` (or plain `HOST:PORT`) and `unix:PATH`. 4 adds `AttachNetwork`: the
//! message carries open file descriptors (SCM_RIGHTS) — each NIC's TAP and the socket its DHCP
//! server answers on — which virt-handler made in the Pod's network namespace, so the launcher
//! needs no NET_ADMIN. Page streams (`pageStreams` on `PrepareMigrationTarget` and in
//! `MigrateOut`'s options) need no new version: a source and target that disagree on the
//! count refuse the migration with the reason in the stream's Hello, before any memory moves,
//! and the VM stays on the source. 5 adds `SoftReboot`: the guest is asked to reboot (Ctrl-Alt-Del, the
//! signal Linux's init turns into a clean reboot) and its reset restarts it in the same
//! launcher, as a guest-initiated reboot does since this version; the status counts reboots. A
//! launcher speaks every version from `MIN_PROTOCOL_VERSION` to `PROTOCOL_VERSION` and answers
//! `Hello` with the version the client asked for; a version-1 client sees version 1 exactly.

use serde::{Deserialize, Serialize};

use crate::VirtualMachineInstance;

/// The newest version this build speaks.
pub const PROTOCOL_VERSION: u32 = 5;
/// The oldest version a launcher still serves.
pub const MIN_PROTOCOL_VERSION: u32 = 1;
/// The version that introduced each request beyond version 1.
pub const SNAPSHOT_SINCE: u32 = 2;
pub const MIGRATION_SINCE: u32 = 3;
pub const NETWORK_SINCE: u32 = 4;
pub const REBOOT_SINCE: u32 = 5;

/// The longest control-socket line either side reads (requests and answers, newline
/// included). The largest real message is a VMI spec or a status report, well under this; a
/// peer that sends more without a newline is dropped rather than buffered without end.
pub const MAX_LINE_BYTES: usize = 1 << 20;
/// How long a peer may take to send one whole line once it has been asked for one (the
/// launcher waiting for the next request; virt-handler waiting for an answer is bounded by its
/// own per-call timeout): a deadline per line, not per read, so trickling bytes does not help.
pub const LINE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);
/// The most descriptors a launcher keeps from one connection before they are used (a VMI
/// has at most two per NIC and 19 devices).
pub const MAX_HELD_FDS: usize = 64;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(tag = "request", rename_all = "camelCase")]
pub enum Request {
    Hello {
        version: u32,
    },
    /// Create and start the VM this VMI describes (no-op if it already runs).
    Sync {
        vmi: Box<VirtualMachineInstance>,
    },
    Pause,
    Resume,
    /// Ask the guest to shut down; kill it after `grace_period_seconds` (default: the VMI's
    /// terminationGracePeriodSeconds).
    Shutdown {
        #[serde(
            rename = "gracePeriodSeconds",
            default,
            skip_serializing_if = "Option::is_none"
        )]
        grace_period_seconds: Option<u64>,
    },
    Kill,
    /// Ask the guest to reboot; the VM restarts in this launcher when it resets. Refused
    /// while paused. Since version 5.
    SoftReboot,
    Status,
    Console,
    Events,
    Ping,
    /// Pause, write the machine state and guest memory to these paths (on the launcher's
    /// host), then resume unless `stop` (the VM stays paused). Since version 2.
    #[serde(rename_all = "camelCase")]
    Snapshot {
        memory_path: String,
        state_path: String,
        #[serde(default)]
        stop: bool,
    },
    /// Prepare to receive this VMI by live migration: listen on `listen` (`tcp:HOST:PORT`,
    /// port 0 for any, or `unix:PATH`) for one source. Since version 3.
    PrepareMigrationTarget {
        vmi: Box<VirtualMachineInstance>,
        listen: String,
        /// Mutual TLS for the migration stream; None: plain TCP (KubeVirt's `disableTLS`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tls: Option<MigrationTls>,
        /// How many page streams the source opens beside the conversation (its
        /// `MigrationOptions::page_streams`); the target takes that many more connections.
        #[serde(rename = "pageStreams", default, skip_serializing_if = "is_zero")]
        page_streams: u8,
    },
    /// Live-migrate the running VM to the target listening at `target`. Since version 3.
    MigrateOut {
        target: String,
        #[serde(default)]
        options: MigrationOptions,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tls: Option<MigrationTls>,
    },
    /// Abort a running MigrateOut; the VM stays here. Since version 3.
    CancelMigration,
    /// The Pod network's NICs, wired by virt-handler: sent before `Sync` (or
    /// `PrepareMigrationTarget`), with `fds` descriptors attached to this very message. Since
    /// version 4.
    AttachNetwork {
        nics: Vec<HandedNic>,
        /// How many descriptors ride along (SCM_RIGHTS), in the order the NICs name them.
        fds: usize,
    },
}

impl Request {
    /// The request's name and the protocol version that introduced it, for those newer than
    /// version 1: both ends check a connection's version against it.
    pub fn introduced(&self) -> Option<(&'static str, u32)> {
        Some(match self {
            Request::Snapshot { .. } => ("snapshot", SNAPSHOT_SINCE),
            Request::PrepareMigrationTarget { .. }
            | Request::MigrateOut { .. }
            | Request::CancelMigration => ("migration", MIGRATION_SINCE),
            Request::AttachNetwork { .. } => ("attachNetwork", NETWORK_SINCE),
            Request::SoftReboot => ("softReboot", REBOOT_SINCE),
            _ => return None,
        })
    }
}

/// One NIC of a VMI as virt-handler wired it in the Pod's network namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct HandedNic {
    /// The VMI's interface (`spec.domain.devices.interfaces[].name`).
    pub interface: String,
    /// Index into the message's descriptors of the TAP (opened with IFF_VNET_HDR).
    pub tap_fd: usize,
    /// The MAC the guest must use (bridge binding hands the Pod interface's MAC to the guest);
    /// None: the launcher's own (the VMI's `macAddress`, else derived from the VMI's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    /// What the guest is offered by DHCP, and the descriptor of the UDP socket (port 67, bound
    /// to the NIC's bridge) to answer on. None: no DHCP (a secondary network without an IP).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhcp: Option<DhcpLease>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhcp_fd: Option<usize>,
    /// The addresses to report for this interface in the VMI's status (the Pod's addresses:
    /// what the cluster reaches the guest at).
    #[serde(default)]
    pub ip_addresses: Vec<String>,
    /// The Pod interface behind this NIC (`eth0`, or the one Multus made).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_interface: Option<String>,
}

/// One DHCPv4 lease: the only answer a NIC's DHCP server gives, and only to the guest's MAC.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct DhcpLease {
    pub address: std::net::Ipv4Addr,
    pub prefix_len: u8,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router: Option<std::net::Ipv4Addr>,
    /// The server's own address (DHCP option 54, and the replies' source).
    pub server: std::net::Ipv4Addr,
    #[serde(default)]
    pub dns: Vec<std::net::Ipv4Addr>,
    #[serde(default)]
    pub search: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
}

/// The certificates of a mutually authenticated migration stream, PEM-encoded: the CA both
/// ends trust, and this end's certificate and key. The server's certificate must name
/// `MIGRATION_TLS_NAME`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct MigrationTls {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

impl MigrationTls {
    /// Reads `ca.crt`, `tls.crt` and `tls.key` from `dir` (a kubernetes.io/tls Secret with the
    /// CA added, as deploy/ mounts it into virt-handler).
    pub fn from_dir(dir: &std::path::Path) -> Result<MigrationTls, String> {
        let read = |f: &str| {
            std::fs::read_to_string(dir.join(f))
                .map_err(|e| format!("{}: {e}", dir.join(f).display()))
        };
        Ok(MigrationTls {
            ca_pem: read("ca.crt")?,
            cert_pem: read("tls.crt")?,
            key_pem: read("tls.key")?,
        })
    }
}

impl MigrationTls {
    /// This end's certificate chain, as DER.
    pub fn cert_chain(&self) -> Result<Vec<rustls_pki_types::CertificateDer<'static>>, String> {
        pem_certs(&self.cert_pem).map_err(|e| format!("certificate: {e}"))
    }

    /// This end's private key, as DER.
    pub fn private_key(&self) -> Result<rustls_pki_types::PrivateKeyDer<'static>, String> {
        rustls_pemfile::private_key(&mut self.key_pem.as_bytes())
            .map_err(|e| format!("key: {e}"))?
            .ok_or_else(|| "key: no private key in the PEM".to_string())
    }

    /// The CA certificates a peer's certificate must chain to, as DER.
    pub fn ca_certs(&self) -> Result<Vec<rustls_pki_types::CertificateDer<'static>>, String> {
        pem_certs(&self.ca_pem).map_err(|e| format!("CA: {e}"))
    }
}

fn pem_certs(pem: &str) -> std::io::Result<Vec<rustls_pki_types::CertificateDer<'static>>> {
    rustls_pemfile::certs(&mut pem.as_bytes()).collect()
}

/// The DNS name a migration target's certificate is issued for (all nodes share it).
pub const MIGRATION_TLS_NAME: &str = "migration.microvirt.internal";

/// KubeVirt's migration configuration as the launcher takes it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct MigrationOptions {
    /// Bytes per second at most (`bandwidthPerMigration`); none: unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth_bytes_per_second: Option<u64>,
    /// Seconds per GiB of guest memory before the migration is cancelled (KubeVirt: 150).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_timeout_per_gib: Option<u64>,
    /// Longest acceptable pause for the final copy, in milliseconds (KubeVirt: 900).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_downtime_ms: Option<u64>,
    /// Seconds without a new low of the data still to send before the migration is cancelled
    /// (KubeVirt: 150).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress_timeout_seconds: Option<u64>,
    /// Throttle the vCPUs while the guest dirties memory faster than it is sent.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_auto_converge: bool,
    /// Connections that carry guest pages beside the conversation, each sent and received by
    /// a thread of its own (KubeVirt's multifd channels: 8, none for a VMI with CPU limits or
    /// dedicated CPUs); 0: the conversation carries them. The target must have been prepared
    /// with the same count. At most `MAX_PAGE_STREAMS`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub page_streams: u8,
}

/// The most page streams one migration opens.
pub const MAX_PAGE_STREAMS: u8 = 32;

/// KubeVirt's multifd channel count (`parallelMultifdMigrationThreads`).
pub const DEFAULT_PAGE_STREAMS: u8 = 8;

/// The page streams a VMI migrates with, as KubeVirt picks its multifd channels: 8, or none
/// for a VMI with a CPU limit or dedicated CPUs, whose sending threads would only take CPU
/// time from its vCPUs. Both nodes' agents derive it from the same VMI, so they agree.
pub fn page_streams_for(vmi: &VirtualMachineInstance) -> u8 {
    let domain = &vmi.spec.domain;
    let cpu_limit = domain
        .resources
        .as_ref()
        .is_some_and(|r| r.limits.contains_key("cpu"));
    let dedicated = domain.cpu.as_ref().and_then(|c| c.dedicated_cpu_placement) == Some(true);
    if cpu_limit || dedicated {
        0
    } else {
        DEFAULT_PAGE_STREAMS
    }
}

fn is_zero(n: &u8) -> bool {
    *n == 0
}

/// Refuses a page-stream count above `MAX_PAGE_STREAMS`, naming the field.
pub fn validate_page_streams(n: u8) -> Result<(), String> {
    if n > MAX_PAGE_STREAMS {
        return Err(format!(
            "pageStreams: {n} is more than the {MAX_PAGE_STREAMS} a migration may open"
        ));
    }
    Ok(())
}

impl MigrationOptions {
    /// Refuses values no migration can run with, naming the option.
    pub fn validate(&self) -> Result<(), String> {
        if self.bandwidth_bytes_per_second == Some(0) {
            return Err("bandwidth: 0 is not a limit a migration can finish under; leave it unset for unlimited".into());
        }
        if self.completion_timeout_per_gib == Some(0) {
            return Err("completionTimeoutPerGiB: must be at least 1 second".into());
        }
        if self.progress_timeout_seconds == Some(0) {
            return Err("progressTimeout: must be at least 1 second".into());
        }
        if self.max_downtime_ms == Some(0) {
            return Err("maxDowntimeMs: must be at least 1 ms".into());
        }
        validate_page_streams(self.page_streams)
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(tag = "response", rename_all = "camelCase")]
pub enum Response {
    Hello {
        version: u32,
        launcher: String,
    },
    Ok,
    Pong,
    Error {
        message: String,
    },
    Status(Box<StatusReport>),
    Event(Event),
    Snapshot(SnapshotReport),
    /// PrepareMigrationTarget: where the target listens.
    MigrationListening {
        address: String,
    },
    Migration(MigrationReport),
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct MigrationReport {
    /// Pre-copy passes, the first full one included.
    pub passes: u32,
    /// Bytes on the wire.
    pub bytes_sent: u64,
    pub total_ms: u64,
    /// Source paused → target running, in milliseconds.
    pub downtime_ms: u64,
    /// Auto-converge's highest vCPU throttle, in percent.
    #[serde(default)]
    pub max_throttle_percent: u8,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotReport {
    pub state_bytes: u64,
    /// Guest RAM size: the memory file's apparent size.
    pub memory_bytes: u64,
    /// What was actually written (zero pages are holes).
    pub memory_written_bytes: u64,
    /// How long the guest was stopped for the snapshot.
    pub paused_ms: u64,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum VmState {
    /// No Sync yet.
    NoVm,
    Running,
    Paused,
    ShutDown,
    Crashed,
    /// The VM now runs on another host.
    Migrated,
    /// A PrepareMigrationTarget target waiting for its source.
    WaitingForMigration,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct StatusReport {
    pub state: VmState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub vcpus: u32,
    pub memory_mib: u64,
    pub uptime_seconds: f64,
    pub software_emulated_kvm: bool,
    /// How the VM ended, once it has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<String>,
    #[serde(default)]
    pub disks: Vec<DiskCounters>,
    #[serde(default)]
    pub nics: Vec<NicCounters>,
    /// virt-handler has handed over the Pod network (AttachNetwork) — so a handler that
    /// restarts before the VM starts does not wire it twice. Since version 4.
    #[serde(default)]
    pub network_attached: bool,
    /// How often the guest rebooted in place (its reset restarted it here). Since version 5.
    #[serde(default)]
    pub reboots: u32,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct DiskCounters {
    pub name: String,
    pub requests: u64,
    #[serde(default)]
    pub reads: u64,
    #[serde(default)]
    pub writes: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub flushes: u64,
    pub errors: u64,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct NicCounters {
    pub name: String,
    /// The guest's MAC on this NIC (since version 4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    /// The addresses the VMI's status reports for this NIC (since version 4).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ip_addresses: Vec<String>,
    /// The Pod interface behind it, as virt-handler wired it (since version 4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_interface: Option<String>,
    pub rx_frames: u64,
    pub rx_bytes: u64,
    pub tx_frames: u64,
    pub tx_bytes: u64,
    pub rx_errors: u64,
    pub tx_errors: u64,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(tag = "event", rename_all = "camelCase")]
pub enum Event {
    Started,
    Paused,
    Resumed,
    /// The guest ended normally (power off, reset, or a host request).
    ShutDown {
        reason: String,
    },
    /// The guest ended abnormally (triple fault, KVM error).
    Crashed {
        reason: String,
    },
    /// A snapshot's progress: guest memory written so far (`done` of `total` bytes).
    #[serde(rename_all = "camelCase")]
    SnapshotProgress {
        done: u64,
        total: u64,
    },
    /// A migration's progress after each pass (KubeVirt's migration metrics).
    #[serde(rename_all = "camelCase")]
    MigrationProgress {
        /// `pre-copy`, `completed`.
        phase: String,
        pass: u32,
        data_processed_bytes: u64,
        data_remaining_bytes: u64,
        dirty_memory_rate_bytes: u64,
        memory_transfer_rate_bytes: u64,
        /// What the final pause would take if the migration stopped iterating now.
        expected_downtime_ms: u64,
        /// Auto-converge's vCPU throttle, in percent.
        #[serde(default)]
        throttle_percent: u8,
    },
    /// The VM left for another host, or arrived from one.
    MigratedOut,
    MigratedIn,
    /// An incoming or outgoing migration failed; the VM runs where it was.
    #[serde(rename_all = "camelCase")]
    MigrationFailed {
        reason: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmi(domain: serde_json::Value) -> VirtualMachineInstance {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachineInstance",
            "metadata": {"name": "v"},
            "spec": {"domain": domain},
        }))
        .unwrap()
    }

    #[test]
    fn page_streams_follow_kubevirts_multifd_choice() {
        let devices = serde_json::json!({});
        assert_eq!(
            page_streams_for(&vmi(serde_json::json!({"devices": devices}))),
            8
        );
        let limited = vmi(serde_json::json!({
            "devices": devices,
            "resources": {"limits": {"cpu": "2"}},
        }));
        assert_eq!(page_streams_for(&limited), 0, "a CPU limit");
        let memory_only = vmi(serde_json::json!({
            "devices": devices,
            "resources": {"limits": {"memory": "1Gi"}},
        }));
        assert_eq!(page_streams_for(&memory_only), 8, "a memory limit only");
        let dedicated = vmi(serde_json::json!({
            "devices": devices,
            "cpu": {"dedicatedCpuPlacement": true},
        }));
        assert_eq!(page_streams_for(&dedicated), 0, "dedicated CPUs");
    }

    #[test]
    fn page_streams_are_named_on_the_wire_and_bounded() {
        let o = MigrationOptions {
            page_streams: 8,
            ..Default::default()
        };
        assert_eq!(serde_json::to_string(&o).unwrap(), r#"{"pageStreams":8}"#);
        assert_eq!(
            serde_json::to_string(&MigrationOptions::default()).unwrap(),
            "{}",
            "none: the field is left out, as an older launcher sends it"
        );
        let too_many = MigrationOptions {
            page_streams: MAX_PAGE_STREAMS + 1,
            ..Default::default()
        };
        let e = too_many.validate().unwrap_err();
        assert!(e.starts_with("pageStreams: 33"), "{e}");
    }

    #[test]
    fn wire_format_is_tagged_json() {
        assert_eq!(
            serde_json::to_string(&Request::Hello { version: 1 }).unwrap(),
            r#"{"request":"hello","version":1}"#
        );
        assert_eq!(
            serde_json::to_string(&Request::Pause).unwrap(),
            r#"{"request":"pause"}"#
        );
        assert_eq!(
            serde_json::to_string(&Response::Event(Event::ShutDown { reason: "x".into() }))
                .unwrap(),
            r#"{"response":"event","event":"shutDown","reason":"x"}"#
        );
        let r: Request =
            serde_json::from_str(r#"{"request":"shutdown","gracePeriodSeconds":5}"#).unwrap();
        assert_eq!(
            r,
            Request::Shutdown {
                grace_period_seconds: Some(5)
            }
        );
        assert!(serde_json::from_str::<Request>(r#"{"request":"reboot"}"#).is_err());
        let r: Request = serde_json::from_str(
            r#"{"request":"snapshot","memoryPath":"/s/memory","statePath":"/s/state"}"#,
        )
        .unwrap();
        assert_eq!(
            r,
            Request::Snapshot {
                memory_path: "/s/memory".into(),
                state_path: "/s/state".into(),
                stop: false
            }
        );
    }
}
