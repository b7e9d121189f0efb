//! Per-vCPU CPUID, shaped from what KVM supports: APIC IDs, topology (one socket, one thread per
//! core, `count` cores) and the hypervisor bit.

use kvm_bindings::kvm_cpuid_entry2;

const LEAF_FEATURES: u32 = 0x1;
const LEAF_CACHE_PARAMS: u32 = 0x4;
const LEAF_EXT_TOPOLOGY: u32 = 0xb;
const LEAF_V2_EXT_TOPOLOGY: u32 = 0x1f;
const LEAF_AMD_SIZE_IDS: u32 = 0x8000_0008;

const ECX_HYPERVISOR: u32 = 1 << 31;
const EDX_HTT: u32 = 1 << 28;
/// CPUID.0xB level types.
const LEVEL_TYPE_SMT: u32 = 1;
const LEVEL_TYPE_CORE: u32 = 2;

/// Bits of the APIC ID that number cores in a package of `count` cores.
fn core_id_bits(count: u8) -> u32 {
    if count <= 1 {
        0
    } else {
        u8::BITS - (count - 1).leading_zeros()
    }
}

/// Rewrites `entries` (from KVM_GET_SUPPORTED_CPUID) for vCPU `cpu_id` of `count`.
pub fn shape(entries: &mut [kvm_cpuid_entry2], cpu_id: u8, count: u8) {
    let apic_id = cpu_id as u32;
    for e in entries.iter_mut() {
        match e.function {
            LEAF_FEATURES => {
                // EBX[31:24] initial APIC ID, EBX[23:16] logical processors per package.
                e.ebx = (e.ebx & 0x0000_ffff) | (apic_id << 24) | ((count as u32) << 16);
                e.ecx |= ECX_HYPERVISOR;
                if count > 1 {
                    e.edx |= EDX_HTT;
                } else {
                    e.edx &= !EDX_HTT;
                }
            }
            LEAF_CACHE_PARAMS => {
                // EAX[31:26] cores per package - 1; EAX[25:14] threads sharing this cache - 1:
                // one thread per core, so only a shared (level 3) cache spans all cores.
                let level = (e.eax >> 5) & 0x7;
                let sharing = if level >= 3 { count as u32 - 1 } else { 0 };
                e.eax = (e.eax & 0x3fff) | (sharing << 14) | ((count as u32 - 1) << 26);
            }
            LEAF_EXT_TOPOLOGY | LEAF_V2_EXT_TOPOLOGY => {
                e.edx = apic_id;
                match e.index {
                    0 => {
                        e.eax = 0; // one thread per core: no SMT bits
                        e.ebx = 1;
                        e.ecx = (LEVEL_TYPE_SMT << 8) | e.index;
                    }
                    1 => {
                        e.eax = core_id_bits(count);
                        e.ebx = count as u32;
                        e.ecx = (LEVEL_TYPE_CORE << 8) | e.index;
                    }
                    _ => {
                        e.eax = 0;
                        e.ebx = 0;
                        e.ecx = e.index; // level type 0: invalid, ends enumeration
                    }
                }
            }
            LEAF_AMD_SIZE_IDS => {
                // ECX[7:0] cores - 1, ECX[15:12] APIC ID size.
                e.ecx = (e.ecx & !0xf0ff) | (count as u32 - 1) | (core_id_bits(count) << 12);
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(function: u32, index: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            eax: 0xffff_ffff,
            ebx: 0xffff_ffff,
            ecx: 0,
            edx: 0,
            ..Default::default()
        }
    }

    fn supported() -> Vec<kvm_cpuid_entry2> {
        let mut l4 = entry(4, 0);
        l4.eax = 1 << 5 | 1; // L1 data
        let mut l4_3 = entry(4, 3);
        l4_3.eax = 3 << 5 | 3; // L3 unified
        vec![
            entry(1, 0),
            l4,
            l4_3,
            entry(0xb, 0),
            entry(0xb, 1),
            entry(0xb, 2),
            entry(0x8000_0008, 0),
        ]
    }

    #[test]
    fn apic_id_and_hypervisor_bit_per_vcpu() {
        for id in 0..4u8 {
            let mut c = supported();
            shape(&mut c, id, 4);
            let l1 = c.iter().find(|e| e.function == 1).unwrap();
            assert_eq!(l1.ebx >> 24, id as u32);
            assert_eq!((l1.ebx >> 16) & 0xff, 4);
            assert_ne!(l1.ecx & ECX_HYPERVISOR, 0);
            assert_ne!(l1.edx & EDX_HTT, 0);
            for e in c.iter().filter(|e| e.function == 0xb) {
                assert_eq!(e.edx, id as u32);
            }
        }
    }

    #[test]
    fn topology_levels() {
        let mut c = supported();
        shape(&mut c, 1, 3);
        let smt = c
            .iter()
            .find(|e| e.function == 0xb && e.index == 0)
            .unwrap();
        assert_eq!((smt.eax, smt.ebx, smt.ecx >> 8), (0, 1, 1));
        let core = c
            .iter()
            .find(|e| e.function == 0xb && e.index == 1)
            .unwrap();
        assert_eq!((core.eax, core.ebx, core.ecx >> 8), (2, 3, 2)); // 3 cores need 2 ID bits
        let end = c
            .iter()
            .find(|e| e.function == 0xb && e.index == 2)
            .unwrap();
        assert_eq!(end.ecx >> 8, 0);
        let l1d = c.iter().find(|e| e.function == 4 && e.index == 0).unwrap();
        assert_eq!((l1d.eax >> 26, (l1d.eax >> 14) & 0xfff), (2, 0));
        let l3 = c.iter().find(|e| e.function == 4 && e.index == 3).unwrap();
        assert_eq!((l3.eax >> 26, (l3.eax >> 14) & 0xfff), (2, 2));
        let amd = c.iter().find(|e| e.function == 0x8000_0008).unwrap();
        assert_eq!(amd.ecx & 0xff, 2);
    }

    #[test]
    fn single_vcpu_has_no_htt() {
        let mut c = supported();
        c[0].edx = EDX_HTT;
        shape(&mut c, 0, 1);
        assert_eq!(c[0].edx & EDX_HTT, 0);
        assert_eq!(core_id_bits(1), 0);
        assert_eq!(core_id_bits(2), 1);
        assert_eq!(core_id_bits(4), 2);
        assert_eq!(core_id_bits(5), 3);
    }
}
