//! The VirtualMachinePool controller (pool.kubevirt.io/v1beta1): keeps `spec.replicas`
//! VirtualMachines made from `virtualMachineTemplate`, named `<pool>-<ordinal>` with the lowest
//! free ordinals, controlled by the pool. On scale-down the VMs that are not ready go first,
//! then the highest ordinals, so ready VMs keep their names and are disturbed last (KubeVirt's
//! pool does the same). `status.replicas`, `readyReplicas` and `labelSelector` feed the scale
//! subresource (`kubectl scale vmpool`).

use std::collections::BTreeSet;

use api::{VirtualMachine, VirtualMachinePool};
use kube::ResourceExt;

use crate::replicas::ReplicaOwner;
use controller_runtime::controller_ref;

impl ReplicaOwner for VirtualMachinePool {
    type Member = VirtualMachine;
    const CONTROLLER: &'static str = "vmpool";
    const MEMBER: &'static str = "virtual machine";

    fn validate(&self) -> Result<(), String> {
        api::validation::validate_pool(self).map_err(|e| e.to_string())
    }

    fn is_ready(v: &VirtualMachine) -> bool {
        v.status.as_ref().and_then(|s| s.ready) == Some(true)
    }

    /// A VM does not end: a stopped one is still the pool's.
    fn has_finished(_: &VirtualMachine) -> bool {
        false
    }

    /// The lowest free ordinals.
    /// (The VMs' VMIs get the cluster's defaults when the VM controller makes them.)
    fn new_members(
        &self,
        active: &[VirtualMachine],
        count: usize,
        _: &api::kubevirt::ClusterSettings,
    ) -> Vec<VirtualMachine> {
        let name = self.name_any();
        let used: BTreeSet<u32> = active
            .iter()
            .filter_map(|v| ordinal(&name, &v.name_any()))
            .collect();
        (0..)
            .filter(|n| !used.contains(n))
            .take(count)
            .map(|n| vm_for(self, n))
            .collect()
    }

    fn removal_order(&self, active: &mut [VirtualMachine]) {
        scale_down_order(&self.name_any(), active);
    }
}

/// The ordinal of a pool member's name (`<pool>-<n>`).
pub fn ordinal(pool: &str, vm: &str) -> Option<u32> {
    vm.strip_prefix(pool)?.strip_prefix('-')?.parse().ok()
}

/// Which surplus VMs go: not ready first, then the highest ordinal.
pub fn scale_down_order(pool: &str, vms: &mut [VirtualMachine]) {
    vms.sort_by_key(|v| {
        (
            VirtualMachinePool::is_ready(v),
            std::cmp::Reverse(ordinal(pool, &v.name_any()).unwrap_or(u32::MAX)),
        )
    });
}

/// The pool's template as a VM named `<pool>-<n>`.
pub fn vm_for(pool: &VirtualMachinePool, n: u32) -> VirtualMachine {
    let mut vm = api::validation::pool_vm(pool, n);
    vm.metadata.owner_references = controller_ref(pool).map(|r| vec![r]);
    vm
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_ready_first_then_the_highest_ordinals() {
        let vm = |n: &str, ready: bool| {
            let mut v = VirtualMachine::new(n, Default::default());
            v.status = Some(api::VirtualMachineStatus {
                ready: Some(ready),
                ..Default::default()
            });
            v
        };
        let mut vms = vec![
            vm("p-0", true),
            vm("p-1", false),
            vm("p-2", true),
            vm("p-10", true),
        ];
        scale_down_order("p", &mut vms);
        let names: Vec<String> = vms.iter().map(|v| v.name_any()).collect();
        assert_eq!(names, ["p-1", "p-10", "p-2", "p-0"]);
        assert_eq!(ordinal("p", "p-10"), Some(10));
        assert_eq!(ordinal("p", "px-1"), None);
    }
}
