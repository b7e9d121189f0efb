//! What the VM and VMI reconcilers read from a watch instead of asking the API server on every
//! pass: the launcher Pods (for the VMI reconciler) and the VMIs (for the VM reconciler).
//!
//! Each cache is the reflector store of the very watch that wakes the reconciler, so a pass
//! woken by a change always reads at least that change (kube-runtime's shared streams would
//! let one watch feed several controllers, but they do not pass deletions on, and a VM must
//! see its VMI go).
//!
//! A cache may lag the API server, never lead it. So it answers only "here it is":
//! - a hit may be a moment old; the change that makes it current wakes the reconciler again;
//! - a miss ("no launcher Pod", "no VMI") is asked of the API server before anything is
//!   created or declared gone. A Pod created a moment ago is therefore never created twice,
//!   and a VMI is never marked Failed for a Pod the cache has not seen yet.
//!
//! KubeVirt's controllers read informer caches and guard creates with "expectations"; the
//! miss-goes-to-the-server rule is that guard without bookkeeping, for a read per VMI or two
//! instead of one per pass.

use std::sync::{Arc, RwLock};

use api::VirtualMachineInstance;
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Pod, PodSpec};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, ResourceExt};

/// The stores of one leadership term (none while this replica does not lead).
#[derive(Default)]
pub struct Caches {
    stores: RwLock<Option<Stores>>,
}

#[derive(Clone)]
struct Stores {
    launcher_pods: Store<Pod>,
    vmis: Store<VirtualMachineInstance>,
}

/// The watches that fill a term's caches; each is to be the trigger stream of the reconciler
/// that reads it.
pub struct Feeds {
    pub launcher_pods: Feed<Pod>,
    pub vmis: Feed<VirtualMachineInstance>,
}

/// The objects a watch touched (applied or deleted), each after its store has taken it.
pub type Feed<K> = std::pin::Pin<Box<dyn Stream<Item = watcher::Result<K>> + Send>>;

impl Caches {
    /// New stores for a leadership term, and the watches that fill them.
    pub fn start(
        &self,
        pods: Api<Pod>,
        launcher_pods: watcher::Config,
        vmis: Api<VirtualMachineInstance>,
    ) -> Feeds {
        let (pod_store, pod_writer) = reflector::store();
        let (vmi_store, vmi_writer) = reflector::store();
        *self.stores.write().unwrap() = Some(Stores {
            launcher_pods: pod_store,
            vmis: vmi_store,
        });
        Feeds {
            launcher_pods: watcher(pods, launcher_pods)
                .default_backoff()
                .modify(keep_what_the_vmi_follows)
                .reflect(pod_writer)
                .touched_objects()
                .boxed(),
            vmis: watcher(vmis, watcher::Config::default())
                .default_backoff()
                .modify(|v| v.metadata.managed_fields = None)
                .reflect(vmi_writer)
                .touched_objects()
                .boxed(),
        }
    }

    /// The term ended: every later read goes to the API server.
    pub fn stop(&self) {
        *self.stores.write().unwrap() = None;
    }

    fn stores(&self) -> Option<Stores> {
        self.stores.read().unwrap().clone()
    }

    /// The launcher (and migration target) Pods the cache holds that `vmi` controls. Only
    /// what the VMI follows is kept of each (see [`keep_what_the_vmi_follows`]).
    pub fn launcher_pods_of(&self, vmi: &VirtualMachineInstance) -> Vec<Arc<Pod>> {
        let Some(stores) = self.stores() else {
            return vec![];
        };
        let (ns, uid) = (vmi.namespace(), vmi.uid().unwrap_or_default());
        stores.launcher_pods.state_filter(|p| {
            p.namespace() == ns && api::ownership::controlled_by_vmi(&p.metadata, &uid)
        })
    }

    /// The VMI `name` in `namespace`, if the cache holds it.
    pub fn vmi(&self, namespace: &str, name: &str) -> Option<Arc<VirtualMachineInstance>> {
        let stores = self.stores()?;
        stores.vmis.get(&ObjectRef::new(name).within(namespace))
    }
}

/// A launcher Pod as the VMI reconciler reads it: metadata (less the managed fields), the node
/// and the whole status. The containers, volumes and the rest of the spec are dropped: at a
/// thousand Pods they are most of the controller's memory, and nothing read from the cache
/// needs them.
fn keep_what_the_vmi_follows(pod: &mut Pod) {
    pod.metadata.managed_fields = None;
    if let Some(spec) = pod.spec.as_mut() {
        *spec = PodSpec {
            node_name: spec.node_name.take(),
            ..Default::default()
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cached_launcher_pod_keeps_its_node_status_and_owner() {
        let mut pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "virt-launcher-a-x", "namespace": "default",
                "labels": {"kubevirt.io/created-by": "u1"},
                "ownerReferences": [{"apiVersion": "kubevirt.io/v1",
                    "kind": "VirtualMachineInstance", "name": "a", "uid": "u1",
                    "controller": true}],
                "managedFields": [{"manager": "kubectl"}]},
            "spec": {"nodeName": "node-1", "containers": [{"name": "compute",
                "image": "launcher"}]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .unwrap();
        let before = pod.clone();
        keep_what_the_vmi_follows(&mut pod);
        assert_eq!(pod.metadata.managed_fields, None);
        assert_eq!(
            pod.metadata.owner_references,
            before.metadata.owner_references
        );
        assert_eq!(pod.metadata.labels, before.metadata.labels);
        let spec = pod.spec.unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("node-1"));
        assert!(spec.containers.is_empty());
        assert_eq!(pod.status, before.status);
    }

    #[test]
    fn without_a_term_the_caches_hold_nothing() {
        let caches = Caches::default();
        let vmi: VirtualMachineInstance = serde_json::from_value(serde_json::json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "a", "namespace": "default", "uid": "u1"},
            "spec": {"domain": {"devices": {}}}
        }))
        .unwrap();
        assert!(caches.launcher_pods_of(&vmi).is_empty());
        assert!(caches.vmi("default", "a").is_none());
    }
}
