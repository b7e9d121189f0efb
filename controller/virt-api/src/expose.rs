//! `virtctl expose`: a Service for a VM, VMI or VMI ReplicaSet, selecting the launcher Pods by
//! the labels their VMIs carry (the Pods get the VMI's labels), as KubeVirt's virtctl does.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

/// What the flags say.
#[derive(Clone, Debug)]
pub struct ExposeFlags {
    pub service_name: String,
    pub port: i32,
    pub target_port: Option<i32>,
    /// ClusterIP, NodePort or LoadBalancer.
    pub service_type: String,
    /// TCP, UDP or SCTP.
    pub protocol: String,
}

/// The Service selecting what carries `labels` (`kind`/`name` only name it in errors).
pub fn service(
    kind: &str,
    name: &str,
    namespace: &str,
    labels: BTreeMap<String, String>,
    f: &ExposeFlags,
) -> Result<Service, String> {
    if labels.is_empty() {
        return Err(format!(
            "cannot expose {kind} {name} without any label: give its {} labels to select its Pods by",
            if kind == "VirtualMachine" { "template's" } else { "" }
        ));
    }
    if !(1..=65535).contains(&f.port) {
        return Err(format!("--port {}: a port is 1 to 65535", f.port));
    }
    if let Some(t) = f.target_port.filter(|t| !(1..=65535).contains(t)) {
        return Err(format!("--target-port {t}: a port is 1 to 65535"));
    }
    if !["ClusterIP", "NodePort", "LoadBalancer"].contains(&f.service_type.as_str()) {
        return Err(format!(
            "--type {:?}: one of ClusterIP, NodePort, LoadBalancer",
            f.service_type
        ));
    }
    if !["TCP", "UDP", "SCTP"].contains(&f.protocol.as_str()) {
        return Err(format!(
            "--protocol {:?}: one of TCP, UDP, SCTP",
            f.protocol
        ));
    }
    Ok(Service {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(f.service_name.clone()),
            namespace: Some(namespace.to_string()),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            selector: Some(labels),
            type_: Some(f.service_type.clone()),
            ports: Some(vec![ServicePort {
                port: f.port,
                target_port: Some(IntOrString::Int(f.target_port.unwrap_or(f.port))),
                protocol: Some(f.protocol.clone()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags() -> ExposeFlags {
        ExposeFlags {
            service_name: "web-ssh".into(),
            port: 22,
            target_port: None,
            service_type: "ClusterIP".into(),
            protocol: "TCP".into(),
        }
    }

    #[test]
    fn selects_by_the_labels_and_checks_the_flags() {
        let labels = BTreeMap::from([("app".to_string(), "web".to_string())]);
        let s = service("VirtualMachine", "web", "default", labels.clone(), &flags()).unwrap();
        let spec = s.spec.unwrap();
        assert_eq!(spec.selector.unwrap(), labels);
        assert_eq!(
            spec.ports.unwrap()[0].target_port,
            Some(IntOrString::Int(22))
        );
        let e = service(
            "VirtualMachine",
            "web",
            "default",
            BTreeMap::new(),
            &flags(),
        )
        .unwrap_err();
        assert!(e.contains("without any label"), "{e}");
        let mut f = flags();
        f.service_type = "External".into();
        assert!(service("VirtualMachine", "web", "default", labels, &f)
            .unwrap_err()
            .contains("--type"));
    }
}
