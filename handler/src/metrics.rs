//! virt-handler's `/metrics`: per-VMI figures from each launcher's status report and from
//! migrations in progress, under KubeVirt's names: `kubevirt_vmi_network_{receive,transmit}_
//! {bytes,packets,errors}_total`, `kubevirt_vmi_storage_{read,write}_traffic_bytes_total`,
//! `kubevirt_vmi_storage_iops_{read,write}_total`, `kubevirt_vmi_storage_flush_requests_total`,
//! `kubevirt_vmi_memory_domain_bytes`, `kubevirt_vmi_node_vcpus` and
//! `kubevirt_vmi_migration_{data_processed_bytes,data_remaining_bytes,dirty_memory_rate_bytes,
//! memory_transfer_rate_bytes}`; and microvirt's own
//! `microvirt_vmi_network_spoofed_packets_dropped_total` (frames the source guard dropped at the
//! guest's TAP, read from the Pod's nftables counters). The launchers own the other counters;
//! the handler keeps the last report of each VMI and encodes it when scraped.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use api::protocol::{DiskCounters, NicCounters, StatusReport};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

type Labels = Vec<(String, String)>;

/// Where a migration is, for the migration gauges.
#[derive(Clone, Copy, Debug, Default)]
pub struct MigrationSample {
    pub data_processed_bytes: u64,
    pub data_remaining_bytes: u64,
    pub dirty_memory_rate_bytes: u64,
    pub memory_transfer_rate_bytes: u64,
}

#[derive(Debug, Default)]
struct Sample {
    report: Option<StatusReport>,
    migration: Option<MigrationSample>,
    /// Frames the source guard dropped, by VMI interface (`podnet::antispoof`).
    spoofed: BTreeMap<String, u64>,
}

#[derive(Debug)]
pub struct NodeMetrics {
    node: String,
    vmis: Mutex<BTreeMap<(String, String), Sample>>,
}

impl NodeMetrics {
    pub fn new(node: &str) -> Arc<NodeMetrics> {
        Arc::new(NodeMetrics {
            node: node.to_string(),
            vmis: Mutex::default(),
        })
    }

    pub fn record(&self, namespace: &str, name: &str, report: StatusReport) {
        self.vmis
            .lock()
            .unwrap()
            .entry((namespace.into(), name.into()))
            .or_default()
            .report = Some(report);
    }

    /// The source guard's drop counts of the VMI's interfaces.
    pub fn record_spoofed(&self, namespace: &str, name: &str, by_interface: Vec<(String, u64)>) {
        self.vmis
            .lock()
            .unwrap()
            .entry((namespace.into(), name.into()))
            .or_default()
            .spoofed = by_interface.into_iter().collect();
    }

    pub fn record_migration(&self, namespace: &str, name: &str, m: Option<MigrationSample>) {
        self.vmis
            .lock()
            .unwrap()
            .entry((namespace.into(), name.into()))
            .or_default()
            .migration = m;
    }

    /// The VMI no longer runs here.
    pub fn forget(&self, namespace: &str, name: &str) {
        self.vmis
            .lock()
            .unwrap()
            .remove(&(namespace.to_string(), name.to_string()));
    }

    pub fn render(self: &Arc<Self>) -> String {
        let mut r = Registry::default();
        r.register_collector(Box::new(self.clone()));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &r)
            .expect("encoding to a String cannot fail");
        out
    }
}

/// One family: its name, help, type, and its samples as (labels, value).
struct FamilyOut {
    name: &'static str,
    help: &'static str,
    counter: bool,
    samples: Vec<(Labels, u64)>,
}

/// One family whose samples each read one field of a kind of record (a NIC's counters, a
/// disk's, a migration's).
struct Field<T> {
    name: &'static str,
    help: &'static str,
    counter: bool,
    value: fn(&T) -> u64,
}

const fn counter<T>(name: &'static str, help: &'static str, value: fn(&T) -> u64) -> Field<T> {
    Field {
        name,
        help,
        counter: true,
        value,
    }
}

const fn gauge<T>(name: &'static str, help: &'static str, value: fn(&T) -> u64) -> Field<T> {
    Field {
        name,
        help,
        counter: false,
        value,
    }
}

const VMI_FIELDS: &[Field<StatusReport>] = &[
    gauge(
        "kubevirt_vmi_memory_domain_bytes",
        "Guest memory of the VMI",
        |r| r.memory_mib << 20,
    ),
    gauge("kubevirt_vmi_node_vcpus", "vCPUs of the VMI", |r| {
        r.vcpus as u64
    }),
];

const NIC_FIELDS: &[Field<NicCounters>] = &[
    counter(
        "kubevirt_vmi_network_receive_bytes",
        "Bytes the guest received",
        |n| n.rx_bytes,
    ),
    counter(
        "kubevirt_vmi_network_transmit_bytes",
        "Bytes the guest sent",
        |n| n.tx_bytes,
    ),
    counter(
        "kubevirt_vmi_network_receive_packets",
        "Frames the guest received",
        |n| n.rx_frames,
    ),
    counter(
        "kubevirt_vmi_network_transmit_packets",
        "Frames the guest sent",
        |n| n.tx_frames,
    ),
    counter(
        "kubevirt_vmi_network_receive_errors",
        "Frames that could not be delivered to the guest",
        |n| n.rx_errors,
    ),
    counter(
        "kubevirt_vmi_network_transmit_errors",
        "Guest frames that could not be sent",
        |n| n.tx_errors,
    ),
];

const DISK_FIELDS: &[Field<DiskCounters>] = &[
    counter(
        "kubevirt_vmi_storage_read_traffic_bytes",
        "Bytes the guest read from the disk",
        |d| d.read_bytes,
    ),
    counter(
        "kubevirt_vmi_storage_write_traffic_bytes",
        "Bytes the guest wrote to the disk",
        |d| d.write_bytes,
    ),
    counter(
        "kubevirt_vmi_storage_iops_read",
        "Read requests completed",
        |d| d.reads,
    ),
    counter(
        "kubevirt_vmi_storage_iops_write",
        "Write requests completed",
        |d| d.writes,
    ),
    counter(
        "kubevirt_vmi_storage_flush_requests",
        "Flush requests completed",
        |d| d.flushes,
    ),
];

const MIGRATION_FIELDS: &[Field<MigrationSample>] = &[
    gauge(
        "kubevirt_vmi_migration_data_processed_bytes",
        "Bytes this migration has sent",
        |m| m.data_processed_bytes,
    ),
    gauge(
        "kubevirt_vmi_migration_data_remaining_bytes",
        "Dirty bytes this migration still has to send",
        |m| m.data_remaining_bytes,
    ),
    gauge(
        "kubevirt_vmi_migration_dirty_memory_rate_bytes",
        "Bytes per second the guest dirties",
        |m| m.dirty_memory_rate_bytes,
    ),
    gauge(
        "kubevirt_vmi_migration_memory_transfer_rate_bytes",
        "Bytes per second this migration sends",
        |m| m.memory_transfer_rate_bytes,
    ),
];

const SPOOFED: Field<u64> = counter(
    "microvirt_vmi_network_spoofed_packets_dropped",
    "Frames from the guest with another source MAC or address than its own, dropped at its TAP",
    |n| *n,
);

/// The families being encoded, in the order their first sample came.
#[derive(Default)]
struct Families(Vec<FamilyOut>);

impl Families {
    fn add<T>(&mut self, field: &Field<T>, labels: &Labels, record: &T) {
        let value = (field.value)(record);
        match self.0.iter_mut().find(|f| f.name == field.name) {
            Some(f) => f.samples.push((labels.clone(), value)),
            None => self.0.push(FamilyOut {
                name: field.name,
                help: field.help,
                counter: field.counter,
                samples: vec![(labels.clone(), value)],
            }),
        }
    }

    /// Every field of `fields` for one record.
    fn add_all<T>(&mut self, fields: &[Field<T>], labels: &Labels, record: &T) {
        for f in fields {
            self.add(f, labels, record);
        }
    }

    fn encode(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for f in &self.0 {
            let t = if f.counter {
                MetricType::Counter
            } else {
                MetricType::Gauge
            };
            let mut d = encoder.encode_descriptor(f.name, f.help, None, t)?;
            for (labels, v) in &f.samples {
                let e = d.encode_family(labels)?;
                if f.counter {
                    ConstCounter::new(*v).encode(e)?;
                } else {
                    ConstGauge::new(*v as i64).encode(e)?;
                }
            }
        }
        Ok(())
    }
}

fn with(base: &Labels, key: &str, value: &str) -> Labels {
    let mut l = base.clone();
    l.push((key.into(), value.into()));
    l
}

impl Collector for NodeMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let vmis = self.vmis.lock().unwrap();
        let mut families = Families::default();
        for ((ns, name), s) in vmis.iter() {
            let base = vec![
                ("node".to_string(), self.node.clone()),
                ("namespace".to_string(), ns.clone()),
                ("name".to_string(), name.clone()),
            ];
            for (interface, dropped) in &s.spoofed {
                families.add(&SPOOFED, &with(&base, "interface", interface), dropped);
            }
            if let Some(r) = &s.report {
                families.add_all(VMI_FIELDS, &base, r);
                for n in &r.nics {
                    families.add_all(NIC_FIELDS, &with(&base, "interface", &n.name), n);
                }
                for d in &r.disks {
                    families.add_all(DISK_FIELDS, &with(&base, "drive", &d.name), d);
                }
            }
            if let Some(m) = &s.migration {
                families.add_all(MIGRATION_FIELDS, &base, m);
            }
        }
        families.encode(&mut encoder)
    }
}

/// Serves `/metrics` and `/healthz` over plain HTTP (virt-controller's server).
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<NodeMetrics>,
) -> std::io::Result<()> {
    controller_runtime::metrics_http::serve_text(listener, move || metrics.render()).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use api::protocol::{DiskCounters, NicCounters, VmState};

    #[test]
    fn renders_kubevirt_names_with_labels() {
        let m = NodeMetrics::new("n1");
        m.record(
            "default",
            "vm1",
            StatusReport {
                state: VmState::Running,
                name: Some("vm1".into()),
                vcpus: 2,
                memory_mib: 64,
                uptime_seconds: 1.0,
                software_emulated_kvm: false,
                end: None,
                disks: vec![DiskCounters {
                    name: "vda".into(),
                    requests: 5,
                    reads: 3,
                    writes: 2,
                    read_bytes: 1536,
                    write_bytes: 1024,
                    flushes: 1,
                    errors: 0,
                }],
                nics: vec![NicCounters {
                    name: "eth0".into(),
                    rx_frames: 4,
                    rx_bytes: 400,
                    tx_frames: 6,
                    tx_bytes: 600,
                    rx_errors: 0,
                    tx_errors: 0,
                    ..Default::default()
                }],
                network_attached: true,
                reboots: 0,
            },
        );
        m.record_migration(
            "default",
            "vm1",
            Some(MigrationSample {
                data_processed_bytes: 4096,
                ..Default::default()
            }),
        );
        m.record_spoofed("default", "vm1", vec![("default".into(), 6)]);
        let text = m.render();
        for line in [
            "kubevirt_vmi_network_receive_bytes_total{node=\"n1\",namespace=\"default\",name=\"vm1\",interface=\"eth0\"} 400",
            "kubevirt_vmi_storage_iops_read_total{node=\"n1\",namespace=\"default\",name=\"vm1\",drive=\"vda\"} 3",
            "kubevirt_vmi_storage_write_traffic_bytes_total{node=\"n1\",namespace=\"default\",name=\"vm1\",drive=\"vda\"} 1024",
            "kubevirt_vmi_memory_domain_bytes{node=\"n1\",namespace=\"default\",name=\"vm1\"} 67108864",
            "kubevirt_vmi_migration_data_processed_bytes{node=\"n1\",namespace=\"default\",name=\"vm1\"} 4096",
            "microvirt_vmi_network_spoofed_packets_dropped_total{node=\"n1\",namespace=\"default\",name=\"vm1\",interface=\"default\"} 6",
        ] {
            assert!(text.contains(line), "{line} missing in:\n{text}");
        }
        m.forget("default", "vm1");
        assert!(!m.render().contains("vm1"));
    }
}
