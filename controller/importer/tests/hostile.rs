//! A guest's owner controls the image: any bytes in a qcow2 header or its tables end in an
//! image or an error — never a panic, never more than the claim, never unbounded memory (the
//! converter holds one table and one cluster at a time; cluster_bits is capped at 21).

use std::fs::File;
use std::process::Command;

use importer::{import, SparseWriter};
use proptest::prelude::*;

const AVAILABLE: u64 = 16 << 20;

/// A small image qemu-img made: 1 MiB of data in 4 KiB clusters, some compressed.
fn base() -> Vec<u8> {
    let d = std::env::temp_dir().join(format!("mv-importer-hostile-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let raw = d.join("r.raw");
    let img = d.join("r.qcow2");
    let data: Vec<u8> = (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    std::fs::write(&raw, data).unwrap();
    let ok = Command::new("qemu-img")
        .args([
            "convert",
            "-c",
            "-f",
            "raw",
            "-O",
            "qcow2",
            "-o",
            "cluster_size=4096",
        ])
        .arg(&raw)
        .arg(&img)
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let b = std::fs::read(&img).unwrap();
    let _ = std::fs::remove_dir_all(&d);
    b
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
    #[test]
    fn any_corruption_is_an_image_or_an_error(
        edits in proptest::collection::vec((0usize..32768, any::<u8>()), 1..24),
        keep in prop_oneof![Just(usize::MAX), 0usize..200_000],
    ) {
        static BASE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
        let mut b = BASE.get_or_init(base).clone();
        // Edits land in the header and the tables (the first clusters), where the offsets are.
        for (at, v) in edits {
            let at = at % b.len().min(32 << 10);
            b[at] = v;
        }
        b.truncate(keep.min(b.len()));
        let d = std::env::temp_dir().join(format!("mv-importer-h-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let img = d.join("img");
        std::fs::write(&img, &b).unwrap();
        let out = d.join("out");
        let target = File::options().read(true).write(true).create(true).truncate(true).open(&out).unwrap();
        let mut w = SparseWriter::new(target).unwrap();
        let r = import(File::open(&img).unwrap(), &d.join("scratch"), &mut w, AVAILABLE);
        if r.is_ok() {
            prop_assert!(std::fs::metadata(&out).unwrap().len() <= AVAILABLE);
        }
        let _ = std::fs::remove_dir_all(&d);
    }
}
