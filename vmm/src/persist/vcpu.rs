//! A vCPU's complete state, read and written on the vCPU's own thread (KVM wants vCPU ioctls
//! from the thread that runs the vCPU), in the order KVM requires.

use kvm_bindings::{
    kvm_cpuid_entry2, kvm_debugregs, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_regs,
    kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, CpuId, Msrs, Xsave, KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};
use serde::{Deserialize, Serialize};

const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;
/// MSRs KVM lists but that describe the host or are write-once at VM creation, so writing them
/// back fails or is wrong: feature control (locked by firmware), the MCE extended control
/// (depends on host LMCE), SMBASE (SMM only).
const NOT_SAVED: &[u32] = &[0x3a, 0x4d0, 0x9e];
/// TSC frequencies within this many parts per million count as the same (as Firecracker).
const TSC_TOLERANCE_PPM: u64 = 250;

/// What this host's KVM can save for a vCPU, decided once per VM.
#[derive(Clone, Debug)]
pub struct VcpuStateSupport {
    /// MSRs to save: KVM_GET_MSR_INDEX_LIST minus `NOT_SAVED`, TSC_DEADLINE last.
    pub msrs: Vec<u32>,
    /// Size in bytes of KVM_GET_XSAVE2's buffer when KVM has KVM_CAP_XSAVE2.
    pub xsave2_size: Option<usize>,
    pub xcrs: bool,
    pub tsc_khz: bool,
    pub tsc_control: bool,
}

impl VcpuStateSupport {
    pub fn probe(kvm: &Kvm, vm: &VmFd) -> Result<Self, String> {
        let list = kvm
            .get_msr_index_list()
            .map_err(|e| format!("KVM_GET_MSR_INDEX_LIST: {e}"))?;
        let mut msrs: Vec<u32> = list
            .as_slice()
            .iter()
            .copied()
            .filter(|m| !NOT_SAVED.contains(m) && *m != MSR_IA32_TSC_DEADLINE)
            .collect();
        if list.as_slice().contains(&MSR_IA32_TSC_DEADLINE) {
            // Written after IA32_TSC, or the deadline is judged against the old TSC.
            msrs.push(MSR_IA32_TSC_DEADLINE);
        }
        let xsave2 = vm.check_extension_int(Cap::Xsave2);
        Ok(VcpuStateSupport {
            msrs,
            xsave2_size: (xsave2 as usize > std::mem::size_of::<kvm_xsave>())
                .then_some(xsave2 as usize),
            xcrs: vm.check_extension(Cap::Xcrs),
            tsc_khz: vm.check_extension(Cap::GetTscKhz),
            tsc_control: vm.check_extension(Cap::TscControl),
        })
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VcpuState {
    pub id: u8,
    /// The CPUID the guest was given, so a restore on another host shows the guest the same CPU.
    pub cpuid: Vec<kvm_cpuid_entry2>,
    pub mp_state: kvm_mp_state,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    /// The legacy 4 KiB XSAVE area (1024 words), and what KVM_GET_XSAVE2 returns beyond it
    /// (AMX state).
    pub xsave: Vec<u32>,
    pub xsave_extra: Vec<u32>,
    pub xcrs: Option<kvm_xcrs>,
    pub debug_regs: kvm_debugregs,
    pub lapic: kvm_lapic_state,
    pub msrs: Vec<kvm_msr_entry>,
    pub vcpu_events: kvm_vcpu_events,
    pub tsc_khz: Option<u32>,
}

fn e(what: &'static str) -> impl Fn(kvm_ioctls::Error) -> String {
    move |err| format!("{what}: {err}")
}

/// Reads MSRs in `indices`; an MSR KVM refuses to read is left out (KVM stops a KVM_GET_MSRS at
/// the first MSR it cannot read and returns how many it read).
fn read_msrs(fd: &VcpuFd, indices: &[u32]) -> Result<Vec<kvm_msr_entry>, String> {
    let mut out = Vec::with_capacity(indices.len());
    let mut rest: Vec<u32> = indices.to_vec();
    while !rest.is_empty() {
        let entries: Vec<kvm_msr_entry> = rest
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs = Msrs::from_entries(&entries).map_err(|e| format!("MSR list: {e:?}"))?;
        let n = fd.get_msrs(&mut msrs).map_err(e("KVM_GET_MSRS"))?;
        out.extend_from_slice(&msrs.as_slice()[..n]);
        if n < rest.len() {
            tracing::debug!(
                msr = format_args!("{:#x}", rest[n]),
                "MSR not readable; not saved"
            );
            rest.drain(..=n);
        } else {
            rest.clear();
        }
    }
    Ok(out)
}

/// Saves the vCPU. The order follows Firecracker's, which follows what KVM needs: mp_state
/// first (it may flush pending events into the registers), vcpu_events last.
pub fn save(fd: &VcpuFd, id: u8, support: &VcpuStateSupport) -> Result<VcpuState, String> {
    let mp_state = fd.get_mp_state().map_err(e("KVM_GET_MP_STATE"))?;
    let regs = fd.get_regs().map_err(e("KVM_GET_REGS"))?;
    let sregs = fd.get_sregs().map_err(e("KVM_GET_SREGS"))?;
    let (xsave, xsave_extra) = match support.xsave2_size {
        Some(size) => {
            let extra = (size - std::mem::size_of::<kvm_xsave>()).div_ceil(4);
            let mut x = Xsave::new(extra).map_err(|e| format!("xsave buffer: {e:?}"))?;
            // SAFETY: `x` holds `size` bytes, what KVM_CAP_XSAVE2 said the kernel writes.
            unsafe { fd.get_xsave2(&mut x) }.map_err(e("KVM_GET_XSAVE2"))?;
            let region = x.as_fam_struct_ref().xsave.region.to_vec();
            (region, x.as_slice().to_vec())
        }
        None => (
            fd.get_xsave().map_err(e("KVM_GET_XSAVE"))?.region.to_vec(),
            Vec::new(),
        ),
    };
    let xcrs = if support.xcrs {
        Some(fd.get_xcrs().map_err(e("KVM_GET_XCRS"))?)
    } else {
        None
    };
    let debug_regs = fd.get_debug_regs().map_err(e("KVM_GET_DEBUGREGS"))?;
    let lapic = fd.get_lapic().map_err(e("KVM_GET_LAPIC"))?;
    let tsc_khz = if support.tsc_khz {
        fd.get_tsc_khz().ok()
    } else {
        None
    };
    let cpuid = fd
        .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
        .map_err(e("KVM_GET_CPUID2"))?
        .as_slice()
        .to_vec();
    let mut msrs = read_msrs(fd, &support.msrs)?;
    // A zero deadline restored as is can leave a guest waiting for a timer that was about to
    // fire; the current TSC makes it fire at once instead (Firecracker does the same).
    let tsc = msrs
        .iter()
        .find(|m| m.index == MSR_IA32_TSC)
        .map(|m| m.data);
    if let (Some(tsc), Some(d)) = (
        tsc,
        msrs.iter_mut()
            .find(|m| m.index == MSR_IA32_TSC_DEADLINE && m.data == 0),
    ) {
        d.data = tsc;
    }
    let vcpu_events = fd.get_vcpu_events().map_err(e("KVM_GET_VCPU_EVENTS"))?;
    Ok(VcpuState {
        id,
        cpuid,
        mp_state,
        regs,
        sregs,
        xsave,
        xsave_extra,
        xcrs,
        debug_regs,
        lapic,
        msrs,
        vcpu_events,
        tsc_khz,
    })
}

/// Sets CPUID and TSC frequency: what must be in place before the rest of the state.
pub fn restore_identity(
    fd: &VcpuFd,
    state: &VcpuState,
    support: &VcpuStateSupport,
) -> Result<(), String> {
    let cpuid = CpuId::from_entries(&state.cpuid).map_err(|e| format!("CPUID: {e:?}"))?;
    fd.set_cpuid2(&cpuid).map_err(e("KVM_SET_CPUID2"))?;
    if let Some(khz) = state.tsc_khz {
        let here = fd.get_tsc_khz().ok();
        let differs = here.is_some_and(|h| {
            (h as u64).abs_diff(khz as u64) * 1_000_000 / khz.max(1) as u64 > TSC_TOLERANCE_PPM
        });
        if differs {
            if support.tsc_control {
                fd.set_tsc_khz(khz).map_err(e("KVM_SET_TSC_KHZ"))?;
            } else {
                tracing::warn!(
                    saved_khz = khz,
                    host_khz = ?here,
                    "TSC frequency differs and KVM cannot scale it; guest time may drift"
                );
            }
        }
    }
    Ok(())
}

/// Restores everything else, in Firecracker's order: LAPIC after sregs (the APIC base MSR
/// lives in sregs), MSRs after the LAPIC (TSC_DEADLINE needs it), vcpu_events last.
pub fn restore(fd: &VcpuFd, state: &VcpuState) -> Result<(), String> {
    fd.set_mp_state(state.mp_state)
        .map_err(e("KVM_SET_MP_STATE"))?;
    fd.set_regs(&state.regs).map_err(e("KVM_SET_REGS"))?;
    fd.set_sregs(&state.sregs).map_err(e("KVM_SET_SREGS"))?;
    let mut region = [0u32; 1024];
    if state.xsave.len() != region.len() {
        return Err(format!(
            "XSAVE area of {} words (expected {})",
            state.xsave.len(),
            region.len()
        ));
    }
    region.copy_from_slice(&state.xsave);
    if state.xsave_extra.is_empty() {
        let x = kvm_xsave {
            region,
            ..Default::default()
        };
        // SAFETY: a kvm_xsave is exactly what KVM_SET_XSAVE reads.
        unsafe { fd.set_xsave(&x) }.map_err(e("KVM_SET_XSAVE"))?;
    } else {
        let mut x = Xsave::new(state.xsave_extra.len()).map_err(|e| format!("xsave: {e:?}"))?;
        // SAFETY: only the fixed-size header is written; the length stays as allocated.
        unsafe { x.as_mut_fam_struct() }.xsave.region = region;
        x.as_mut_slice().copy_from_slice(&state.xsave_extra);
        // SAFETY: the buffer holds the header plus every extra word saved from KVM_GET_XSAVE2.
        unsafe { fd.set_xsave2(&x) }.map_err(e("KVM_SET_XSAVE2"))?;
    }
    if let Some(xcrs) = &state.xcrs {
        fd.set_xcrs(xcrs).map_err(e("KVM_SET_XCRS"))?;
    }
    fd.set_debug_regs(&state.debug_regs)
        .map_err(e("KVM_SET_DEBUGREGS"))?;
    fd.set_lapic(&state.lapic).map_err(e("KVM_SET_LAPIC"))?;
    let msrs = Msrs::from_entries(&state.msrs).map_err(|e| format!("MSR list: {e:?}"))?;
    let n = fd.set_msrs(&msrs).map_err(e("KVM_SET_MSRS"))?;
    if n != state.msrs.len() {
        return Err(format!(
            "KVM_SET_MSRS: this host refused MSR {:#x} ({n} of {} restored)",
            state.msrs[n].index,
            state.msrs.len()
        ));
    }
    fd.set_vcpu_events(&state.vcpu_events)
        .map_err(e("KVM_SET_VCPU_EVENTS"))?;
    Ok(())
}
