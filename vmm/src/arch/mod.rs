//! x86_64 specifics: CPUID, registers, page tables, MP table.
pub mod cpuid;
pub mod mptable;
pub mod regs;
