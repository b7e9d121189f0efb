//! The VM-wide KVM state: the in-kernel PIC pair and IOAPIC, the PIT and kvmclock.

use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, kvm_pit_state2, KVM_CLOCK_TSC_STABLE, KVM_IRQCHIP_IOAPIC,
    KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
};
use kvm_ioctls::VmFd;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct KvmVmState {
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
    pub pit: kvm_pit_state2,
    pub clock: kvm_clock_data,
}

fn chip(vm: &VmFd, id: u32) -> Result<kvm_irqchip, String> {
    let mut c = kvm_irqchip {
        chip_id: id,
        ..Default::default()
    };
    vm.get_irqchip(&mut c)
        .map_err(|e| format!("KVM_GET_IRQCHIP {id}: {e}"))?;
    Ok(c)
}

impl KvmVmState {
    /// Read with every vCPU paused, so no interrupt changes the chips while they are read.
    pub fn save(vm: &VmFd) -> Result<Self, String> {
        let mut clock = vm.get_clock().map_err(|e| format!("KVM_GET_CLOCK: {e}"))?;
        // KVM_SET_CLOCK refuses flags it does not take; TSC_STABLE is an output only.
        clock.flags &= !KVM_CLOCK_TSC_STABLE;
        Ok(KvmVmState {
            pic_master: chip(vm, KVM_IRQCHIP_PIC_MASTER)?,
            pic_slave: chip(vm, KVM_IRQCHIP_PIC_SLAVE)?,
            ioapic: chip(vm, KVM_IRQCHIP_IOAPIC)?,
            pit: vm.get_pit2().map_err(|e| format!("KVM_GET_PIT2: {e}"))?,
            clock,
        })
    }

    pub fn restore(&self, vm: &VmFd) -> Result<(), String> {
        for c in [&self.pic_master, &self.pic_slave, &self.ioapic] {
            vm.set_irqchip(c)
                .map_err(|e| format!("KVM_SET_IRQCHIP {}: {e}", c.chip_id))?;
        }
        vm.set_pit2(&self.pit)
            .map_err(|e| format!("KVM_SET_PIT2: {e}"))?;
        vm.set_clock(&self.clock)
            .map_err(|e| format!("KVM_SET_CLOCK: {e}"))?;
        Ok(())
    }
}
