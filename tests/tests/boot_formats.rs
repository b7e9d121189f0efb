//! Kernel formats other than the probe's ELF: a hand-made bzImage entered through the 64-bit
//! boot protocol at its payload + 0x200, with RSI pointing at the zero page.

use std::time::Duration;

use tests::*;
use vmm::{Vm, VmConfig, VmEnd};

/// A bzImage whose 64-bit entry prints the zero page's "HdrS" magic byte ('H') read through RSI,
/// then 'Z', then powers off through the shutdown port.
fn tiny_bzimage() -> Vec<u8> {
    let setup_sects = 1u8;
    let mut img = vec![0u8; (setup_sects as usize + 1) * 512];
    img[0x1f1] = setup_sects;
    img[0x1fe..0x200].copy_from_slice(&0xaa55u16.to_le_bytes());
    img[0x202..0x206].copy_from_slice(b"HdrS");
    img[0x206..0x208].copy_from_slice(&0x020fu16.to_le_bytes());
    img[0x211] = 0x01; // LOADED_HIGH
    img[0x214..0x218].copy_from_slice(&0x10_0000u32.to_le_bytes());
    img[0x260..0x264].copy_from_slice(&0x10_0000u32.to_le_bytes()); // init_size
    let mut payload = vec![0xf4u8; 0x200]; // 32-bit entry: never used
    payload.extend_from_slice(&[
        0x8a, 0x86, 0x02, 0x02, 0x00, 0x00, // mov al, [rsi + 0x202]
        0x66, 0xba, 0xf8, 0x03, // mov dx, 0x3f8
        0xee, // out dx, al
        0xb0, b'Z', // mov al, 'Z'
        0xee, // out dx, al
        0x66, 0xba, 0x00, 0x06, // mov dx, 0x600
        0xb0, 0x34, // mov al, 0x34 (S5 | SLP_EN)
        0xee, // out dx, al
        0xf4, // hlt
    ]);
    img.extend_from_slice(&payload);
    img
}

#[test]
fn bzimage_enters_64bit_entry_with_zero_page_in_rsi() {
    require_kvm();
    let path = std::env::temp_dir().join(format!("mv-tiny-bzimage-{}", std::process::id()));
    std::fs::write(&path, tiny_bzimage()).unwrap();
    let console = Console::default();
    let mut cfg = VmConfig::new(&path);
    cfg.memory_mib = 32;
    cfg.serial.output = console.output();
    let vm = Vm::build(&cfg).unwrap();
    let run = run_to_end(vm, &console, Duration::from_secs(30));
    std::fs::remove_file(&path).unwrap();
    assert_eq!(run.console, "HZ");
    assert_eq!(run.end, VmEnd::PoweredOff);
}
