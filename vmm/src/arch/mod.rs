//! x86_64 specifics: CPUID, registers, page tables, MP table, ACPI tables.
pub mod acpi;
pub mod cpuid;
pub mod mptable;
pub mod regs;
