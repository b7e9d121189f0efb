//! ACPI tables, built with rust-vmm's `acpi_tables`: RSDP → XSDT → FADT (hardware-reduced),
//! MADT, and a DSDT that describes the power button, the Generic Event Device (GED) that
//! announces it, and the VMGenID device. They sit beside the MP table: a guest with ACPI reads
//! these, one without (the probe's processor discovery, Linux built without ACPI) the MP table.
//!
//! What the FADT points at is the machine's existing power port: the sleep control register
//! is `POWER_PORT`, whose power-off value is the S5 encoding `_S5_` announces, and the reset
//! register is the same port with `POWER_RESET_VALUE`. So an ACPI guest powers off and reboots
//! through the port every guest already uses, without the keyboard controller.

use acpi_tables::aml;
use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::gas::{AccessSize, AddressSpace, GAS};
use acpi_tables::madt::{
    EnabledStatus, IoApic, LocalInterruptController, ProcessorLocalApic, MADT,
};
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use acpi_tables::Aml;
use vm_memory::{Bytes, GuestAddress, GuestMemory};

use crate::layout::{
    ACPI_RSDP_START, ACPI_TABLES_START, APIC_START, GED_IRQ, GED_PORT, I8042_PORT, IOAPIC_START,
    KEYBOARD_IRQ, POWER_OFF_VALUE, POWER_PORT, POWER_RESET_VALUE, SERIAL_COM1_IRQ,
    SERIAL_COM1_PORT, VIRTIO_MMIO_SIZE, VMGENID_START,
};

// `_S5_` announces sleep type 5; the power port powers off on SLP_TYP 5 with SLP_EN.
const _: () = assert!(POWER_OFF_VALUE == (5 << 2) | (1 << 5));

const OEM_ID: [u8; 6] = *b"MCRVRT";
const OEM_TABLE_ID: [u8; 8] = *b"MICROVRT";
const OEM_REVISION: u32 = 1;

/// Bits of the GED's event register (see `devices::ged`): which device the interrupt is for.
pub const GED_EVENT_POWER_BUTTON: u8 = 1 << 0;
pub const GED_EVENT_GENERATION: u8 = 1 << 1;

#[derive(Debug, thiserror::Error)]
pub enum AcpiError {
    #[error("{0} vCPUs do not fit the MADT's 8-bit APIC IDs")]
    TooManyCpus(u8),
    #[error("the ACPI tables ({0} bytes) do not fit below the VMGenID area")]
    TooLarge(usize),
    #[error("guest memory does not hold the ACPI tables")]
    NotEnoughMemory,
}

/// The tables as the guest sees them: the RSDP at `ACPI_RSDP_START`, the rest (XSDT, FADT,
/// MADT, DSDT, in that order) from `ACPI_TABLES_START`.
pub struct AcpiTables {
    pub rsdp: Vec<u8>,
    pub tables: Vec<u8>,
}

/// The DSDT's AML. The GED's `_EVT` reads its event register once and notifies each device
/// whose bit is set: 0x80 is "status change" for the button and "new generation" for VMGenID.
fn dsdt(virtio: &[(u64, u32)]) -> Vec<u8> {
    let mut sdt = Sdt::new(*b"DSDT", 36, 6, OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    let mut body = Vec::new();
    devices(virtio, &mut body);
    aml::Device::new(
        "_SB_.PWRB".into(),
        vec![
            &aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0C0C")),
            &aml::Name::new("_UID".into(), &aml::ZERO),
        ],
    )
    .to_aml_bytes(&mut body);

    let (addr_low, addr_high) = (VMGENID_START as u32, (VMGENID_START >> 32) as u32);
    // Linux's vmgenid driver matches the _HID, Windows the _CID; both read ADDR.
    aml::Device::new(
        "_SB_.VGEN".into(),
        vec![
            &aml::Name::new("_HID".into(), &"VMGENCTR"),
            &aml::Name::new("_CID".into(), &"VM_Gen_Counter"),
            &aml::Name::new("_DDN".into(), &"VM_Gen_Counter"),
            &aml::Name::new(
                "ADDR".into(),
                &aml::Package::new(vec![&addr_low, &addr_high]),
            ),
        ],
    )
    .to_aml_bytes(&mut body);

    let irq = isa_interrupt(GED_IRQ);
    let crs = aml::ResourceTemplate::new(vec![&irq]);
    let (power_bit, generation_bit) = (GED_EVENT_POWER_BUTTON as u64, GED_EVENT_GENERATION as u64);
    let event = aml::Path::new("GDAT");
    let (pending, masked) = (aml::Local(0), aml::Local(1));
    let (button, vmgenid) = (aml::Path::new("\\_SB_.PWRB"), aml::Path::new("\\_SB_.VGEN"));
    let notify_power = aml::Notify::new(&button, &0x80u8);
    let notify_generation = aml::Notify::new(&vmgenid, &0x80u8);
    let and_power = aml::And::new(&masked, &pending, &power_bit);
    let and_generation = aml::And::new(&masked, &pending, &generation_bit);
    let is_power = aml::Equal::new(&masked, &power_bit);
    let is_generation = aml::Equal::new(&masked, &generation_bit);
    aml::Device::new(
        "_SB_.GED_".into(),
        vec![
            &aml::Name::new("_HID".into(), &"ACPI0013"),
            &aml::Name::new("_UID".into(), &aml::ZERO),
            &aml::Name::new("_CRS".into(), &crs),
            &aml::OpRegion::new(
                "GDST".into(),
                aml::OpRegionSpace::SystemIO,
                &(GED_PORT as u32),
                &1u8,
            ),
            &aml::Field::new(
                "GDST".into(),
                aml::FieldAccessType::Byte,
                aml::FieldLockRule::NoLock,
                aml::FieldUpdateRule::WriteAsZeroes,
                vec![aml::FieldEntry::Named(*b"GDAT", 8)],
            ),
            &aml::Method::new(
                "_EVT".into(),
                1,
                true,
                vec![
                    &aml::Store::new(&pending, &event),
                    &and_power,
                    &aml::If::new(&is_power, vec![&notify_power]),
                    &and_generation,
                    &aml::If::new(&is_generation, vec![&notify_generation]),
                ],
            ),
        ],
    )
    .to_aml_bytes(&mut body);

    // S5 (soft off) is sleep type 5: the value the power port takes.
    aml::Name::new(
        "_S5_".into(),
        &aml::Package::new(vec![&5u8, &0u8, &0u8, &0u8]),
    )
    .to_aml_bytes(&mut body);
    sdt.append_slice(&body);
    sdt.as_slice().to_vec()
}

fn fadt(dsdt_addr: u64) -> Vec<u8> {
    let port = |value_width: u8| {
        GAS::new(
            AddressSpace::SystemIo,
            value_width,
            0,
            AccessSize::ByteAccess,
            POWER_PORT as u64,
        )
    };
    let mut f = FADTBuilder::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION).dsdt_64(dsdt_addr);
    // The power button is a control-method device (the GED's), not the fixed-hardware one.
    f.flags =
        (Flags::HwReducedAcpi as u32 | Flags::PwrButton as u32 | Flags::ResetRegSup as u32).into();
    f.sleep_control_reg = port(8);
    f.sleep_status_reg = port(8);
    f.reset_reg = port(8);
    f.reset_value = POWER_RESET_VALUE;
    f.hypervisor_vendor_identity = u64::from_le_bytes(*b"MICROVRT").into();
    let mut out = Vec::new();
    f.finalize().to_aml_bytes(&mut out);
    out
}

fn madt(vcpus: u8) -> Result<Vec<u8>, AcpiError> {
    if vcpus == 0 || vcpus > 254 {
        return Err(AcpiError::TooManyCpus(vcpus));
    }
    let mut m = MADT::new(
        OEM_ID,
        OEM_TABLE_ID,
        OEM_REVISION,
        LocalInterruptController::Address(APIC_START as u32),
    );
    for cpu in 0..vcpus {
        m.add_structure(ProcessorLocalApic::new(cpu, cpu, EnabledStatus::Enabled));
    }
    // The same IOAPIC ID as the MP table gives it.
    let ioapic = super::mptable::ioapic_id(vcpus);
    m.add_structure(IoApic::new(ioapic, IOAPIC_START as u32, 0));
    let mut out = Vec::new();
    m.to_aml_bytes(&mut out);
    Ok(out)
}

/// Consumer, edge-triggered, active high, exclusive: an ISA interrupt's defaults.
fn isa_interrupt(irq: u32) -> aml::Interrupt {
    aml::Interrupt::new(true, true, false, false, irq)
}

/// The legacy devices and the virtio-mmio devices (`virtio`: each one's base and IRQ), with
/// their interrupts. A hardware-reduced machine has no legacy PIC, so Linux maps an IRQ only
/// for a device ACPI describes: the same devices on the command line (`virtio_mmio.device=`,
/// the 8250's fixed COM1) would get IRQ numbers nothing routes. As Firecracker does, the
/// DSDT names COM1 (PNP0501), the keyboard controller (PNP0303, found by i8042's PNP probe)
/// and every virtio-mmio device (LNRO0005, the ID Linux's virtio-mmio driver matches); the
/// command line keeps its entries for guests built without ACPI.
fn devices(virtio: &[(u64, u32)], body: &mut Vec<u8>) {
    let (com1, com1_irq) = (
        aml::IO::new(SERIAL_COM1_PORT, SERIAL_COM1_PORT, 1, 8),
        isa_interrupt(SERIAL_COM1_IRQ),
    );
    let (kbd_data, kbd_command, kbd_irq) = (
        aml::IO::new(I8042_PORT, I8042_PORT, 1, 1),
        aml::IO::new(I8042_PORT + 4, I8042_PORT + 4, 1, 1),
        isa_interrupt(KEYBOARD_IRQ),
    );
    let legacy: [(&str, &str, Vec<&dyn Aml>); 2] = [
        ("_SB_.COM1", "PNP0501", vec![&com1, &com1_irq]),
        (
            "_SB_.PS2_",
            "PNP0303",
            vec![&kbd_data, &kbd_command, &kbd_irq],
        ),
    ];
    for (path, id, resources) in legacy {
        let crs = aml::ResourceTemplate::new(resources);
        aml::Device::new(
            path.into(),
            vec![
                &aml::Name::new("_HID".into(), &aml::EISAName::new(id)),
                &aml::Name::new("_UID".into(), &aml::ZERO),
                &aml::Name::new("_CRS".into(), &crs),
            ],
        )
        .to_aml_bytes(body);
    }
    for (i, &(base, irq)) in virtio.iter().enumerate() {
        let window = aml::Memory32Fixed::new(true, base as u32, VIRTIO_MMIO_SIZE as u32);
        let interrupt = isa_interrupt(irq);
        let crs = aml::ResourceTemplate::new(vec![&window, &interrupt]);
        aml::Device::new(
            format!("_SB_.V{i:03X}").as_str().into(),
            vec![
                &aml::Name::new("_HID".into(), &"LNRO0005"),
                &aml::Name::new("_UID".into(), &(i as u64)),
                &aml::Name::new("_CRS".into(), &crs),
            ],
        )
        .to_aml_bytes(body);
    }
}

/// Builds every table for a machine of `vcpus` processors with the virtio-mmio devices
/// `virtio` (each one's base and IRQ).
pub fn build(vcpus: u8, virtio: &[(u64, u32)]) -> Result<AcpiTables, AcpiError> {
    let madt = madt(vcpus)?;
    // XSDT: header and two entries; its length is known before the others are placed.
    const XSDT_LEN: u64 = 36 + 2 * 8;
    let fadt_addr = ACPI_TABLES_START + XSDT_LEN;
    let fadt_len = acpi_tables::fadt::FADT::len() as u64;
    let madt_addr = fadt_addr + fadt_len;
    let dsdt_addr = madt_addr + madt.len() as u64;
    let mut xsdt = XSDT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    xsdt.add_entry(fadt_addr);
    xsdt.add_entry(madt_addr);
    let mut tables = Vec::new();
    xsdt.to_aml_bytes(&mut tables);
    debug_assert_eq!(tables.len() as u64, XSDT_LEN);
    tables.extend_from_slice(&fadt(dsdt_addr));
    tables.extend_from_slice(&madt);
    tables.extend_from_slice(&dsdt(virtio));
    if ACPI_TABLES_START + tables.len() as u64 > VMGENID_START {
        return Err(AcpiError::TooLarge(tables.len()));
    }
    let mut rsdp = Vec::new();
    Rsdp::new(OEM_ID, ACPI_TABLES_START).to_aml_bytes(&mut rsdp);
    Ok(AcpiTables { rsdp, tables })
}

/// Writes the tables into guest memory; returns the RSDP's address.
pub fn write<M: GuestMemory>(mem: &M, vcpus: u8, virtio: &[(u64, u32)]) -> Result<u64, AcpiError> {
    let t = build(vcpus, virtio)?;
    mem.write_slice(&t.rsdp, GuestAddress(ACPI_RSDP_START))
        .and_then(|_| mem.write_slice(&t.tables, GuestAddress(ACPI_TABLES_START)))
        .map_err(|_| AcpiError::NotEnoughMemory)?;
    Ok(ACPI_RSDP_START)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |a, x| a.wrapping_add(*x))
    }

    fn u32_at(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
    }

    fn u64_at(b: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
    }

    /// The table at guest address `addr`, by its own length.
    fn table(t: &AcpiTables, addr: u64) -> &[u8] {
        let at = (addr - ACPI_TABLES_START) as usize;
        &t.tables[at..at + u32_at(&t.tables, at + 4) as usize]
    }

    #[test]
    fn a_guest_walks_rsdp_xsdt_fadt_to_a_dsdt_with_every_checksum_right() {
        for vcpus in [1u8, 2, 8, 254] {
            let t = build(vcpus, &[]).unwrap();
            assert_eq!(&t.rsdp[..8], b"RSD PTR ");
            assert_eq!(sum(&t.rsdp[..20]), 0, "RSDP 1.0 checksum");
            assert_eq!(sum(&t.rsdp), 0, "RSDP extended checksum");
            let xsdt = table(&t, u64_at(&t.rsdp, 24));
            assert_eq!(&xsdt[..4], b"XSDT");
            assert_eq!(sum(xsdt), 0);
            let entries: Vec<u64> = (36..xsdt.len())
                .step_by(8)
                .map(|o| u64_at(xsdt, o))
                .collect();
            let (fadt, madt) = (table(&t, entries[0]), table(&t, entries[1]));
            assert_eq!((&fadt[..4], sum(fadt)), (&b"FACP"[..], 0));
            assert_eq!((&madt[..4], sum(madt)), (&b"APIC"[..], 0));
            assert_ne!(u32_at(fadt, 112) & Flags::HwReducedAcpi as u32, 0);
            let dsdt = table(&t, u64_at(fadt, 140));
            assert_eq!((&dsdt[..4], sum(dsdt)), (&b"DSDT"[..], 0));
            // One local APIC (8 bytes) per vCPU and the IOAPIC (12) after the 44-byte header.
            assert_eq!(madt.len(), 44 + 8 * vcpus as usize + 12);
        }
    }

    #[test]
    fn the_dsdt_names_the_generation_id_address_and_the_ged() {
        let d = dsdt(&[(0xd000_0000, 5)]);
        let find = |needle: &[u8]| d.windows(needle.len()).position(|w| w == needle);
        assert!(find(b"ACPI0013").is_some(), "no GED");
        assert!(find(b"LNRO0005").is_some(), "no virtio-mmio device");
        assert!(find(b"VMGENCTR").is_some(), "no VMGenID device");
        // Name(ADDR, Package(2) { DWord low, Zero }).
        let at = find(b"\x08ADDR\x12").expect("no ADDR package");
        let pkg = &d[at + 6..];
        assert_eq!(pkg[1], 2, "two elements");
        assert_eq!(pkg[2], 0x0c, "a DWord");
        assert_eq!(u32_at(pkg, 3) as u64, VMGENID_START);
        assert_eq!(pkg[7], 0x00, "high half zero");
    }

    /// ACPICA's disassembler (`iasl`, the reference AML parser, from acpica-tools) reads every
    /// table without an error, and the DSDT says what the guest is meant to run.
    #[test]
    fn acpica_disassembles_every_table() {
        let t = build(2, &[(0xd000_0000, 5), (0xd000_1000, 6)]).unwrap();
        let dir = std::env::temp_dir().join(format!("microvirt-acpi-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let xsdt = table(&t, u64_at(&t.rsdp, 24));
        let fadt = table(&t, u64_at(xsdt, 36));
        let madt = table(&t, u64_at(xsdt, 44));
        let dsdt = table(&t, u64_at(fadt, 140));
        let mut listings = String::new();
        for (name, bytes) in [
            ("xsdt", xsdt),
            ("facp", fadt),
            ("apic", madt),
            ("dsdt", dsdt),
        ] {
            let file = dir.join(format!("{name}.dat"));
            std::fs::write(&file, bytes).unwrap();
            let out = std::process::Command::new("iasl")
                .arg("-d")
                .arg(&file)
                .output()
                .expect("iasl (Debian's acpica-tools, scripts/install-prerequisites) runs");
            let said = String::from_utf8_lossy(&out.stdout).to_string()
                + &String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "iasl -d {name}: {said}");
            assert!(!said.contains("Error"), "iasl -d {name}: {said}");
            listings += &std::fs::read_to_string(dir.join(format!("{name}.dsl"))).unwrap();
        }
        std::fs::remove_dir_all(&dir).unwrap();
        for expected in [
            "Hardware Reduced (V5) : 1",
            "Name (_HID, \"ACPI0013\"",
            "Name (_HID, EisaId (\"PNP0C0C\")",
            "Name (_HID, \"VMGENCTR\")",
            "Notify (\\_SB.VGEN, 0x80)",
            "Notify (\\_SB.PWRB, 0x80)",
            "OperationRegion (GDST, SystemIO, 0x0610, One)",
            "Name (_S5, Package (0x04)",
            "Name (_HID, EisaId (\"PNP0501\")",
            "Name (_HID, EisaId (\"PNP0303\")",
            "Name (_HID, \"LNRO0005\")",
            "Device (_SB.V001)",
            "0xD0001000,         // Address Base",
        ] {
            assert!(
                listings.contains(expected),
                "no `{expected}` in:\n{listings}"
            );
        }
    }

    #[test]
    fn the_tables_fit_below_the_generation_id() {
        let t = build(254, &[(0xd000_0000, 5)]).unwrap();
        assert!(ACPI_TABLES_START + (t.tables.len() as u64) <= VMGENID_START);
        assert!(matches!(build(0, &[]), Err(AcpiError::TooManyCpus(0))));
    }
}
