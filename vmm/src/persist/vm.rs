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

/// Whether the guest set up its interrupt controllers to take ISA interrupt `irq` (< 8):
/// its IOAPIC pin unmasked, or the master PIC initialised (a vector base other than 0,
/// where the CPU's exceptions are) with the line unmasked. A guest that did neither (no
/// firmware ran, and the guest never programmed the PIC) would take the interrupt through
/// an unprogrammed PIC as a CPU exception, so a device must not raise it.
pub fn guest_takes_isa_irq(vm: &VmFd, irq: u32) -> Result<bool, String> {
    if irq >= 8 {
        return Err(format!("ISA IRQ {irq} is not on the master PIC"));
    }
    let ioapic = chip(vm, KVM_IRQCHIP_IOAPIC)?;
    // SAFETY: KVM_GET_IRQCHIP for the IOAPIC fills the union's `ioapic` member.
    let redirection = unsafe { ioapic.chip.ioapic.redirtbl[irq as usize].bits };
    if redirection & (1 << 16) == 0 {
        return Ok(true);
    }
    let pic = chip(vm, KVM_IRQCHIP_PIC_MASTER)?;
    // SAFETY: KVM_GET_IRQCHIP for a PIC fills the union's `pic` member.
    let pic = unsafe { pic.chip.pic };
    Ok(pic.irq_base != 0 && pic.imr & (1 << irq) == 0)
}
