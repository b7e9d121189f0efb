//! virtio-blk on /dev/kvm: the probe's driver writes, flushes and reads real image files, and
//! the host checks what landed in them.

use std::time::Duration;

use tests::*;
use vmm::config::{CacheMode, DiskConfig};
use vmm::Vm;

const T: Duration = Duration::from_secs(120);
const SAMPLES: u64 = 16;

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("mv-blk-it-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The sectors the probe writes on a disk of `sectors` sectors (guest-images/probe/src/blk.rs).
fn sampled(sectors: u64) -> impl Iterator<Item = u64> {
    (0..SAMPLES).map(move |k| k * (sectors - 2) / (SAMPLES - 1))
}

fn check_image(path: &std::path::Path) {
    let data = std::fs::read(path).unwrap();
    let sectors = data.len() as u64 / 512;
    let mut written: Vec<u64> = sampled(sectors).collect();
    written.push(written[written.len() - 1] + 1); // the two-segment write covers two sectors
    for s in written {
        let tag = format!("MVPROBE sector {s}");
        let at = (s * 512) as usize;
        assert_eq!(
            &data[at..at + tag.len()],
            tag.as_bytes(),
            "sector {s} of {}",
            path.display()
        );
    }
}

fn run_blk(disks: Vec<DiskConfig>) -> (ProbeRun, Vec<vmm::devices::virtio::block::BlockCounters>) {
    require_kvm();
    let console = Console::default();
    let mut cfg = probe_config("blk", 1, 64, &console);
    cfg.disks = disks;
    let vm = Vm::build(&cfg).expect("building the VM");
    let blocks: Vec<_> = vm.blocks().to_vec();
    let run = run_to_end(vm, &console, T);
    let counters = blocks.iter().map(|b| b.lock().unwrap().counters).collect();
    (run, counters)
}

#[test]
fn probe_writes_flushes_and_reads_back_real_images() {
    let dir = tmpdir("rw");
    let a = dir.join("a.img");
    let b = dir.join("b.img");
    let ro = dir.join("ro.img");
    std::fs::File::create(&a).unwrap().set_len(1 << 20).unwrap();
    std::fs::File::create(&b).unwrap().set_len(4 << 20).unwrap();
    let ro_content: Vec<u8> = (0..64 * 1024).map(|i| (i % 251) as u8).collect();
    std::fs::write(&ro, &ro_content).unwrap();

    let mut da = DiskConfig::new(&a);
    da.serial = Some("disk-a".into());
    let mut db = DiskConfig::new(&b);
    db.cache = CacheMode::None;
    let mut dro = DiskConfig::new(&ro);
    dro.read_only = true;
    dro.serial = Some("ro-disk".into());
    let (run, counters) = run_blk(vec![da, db, dro]);
    let r = run
        .result
        .clone()
        .unwrap_or_else(|| panic!("no result: {:?}\n{}", run.end, run.console));
    assert!(r.ok, "{}", run.console);
    assert_eq!(r.field("disks"), Some("3"));
    assert_eq!(r.field("d0.serial"), Some("disk-a"));
    assert_eq!(r.field("d0.sectors"), Some("2048"));
    assert_eq!(r.field("d0.verified"), Some("16"));
    assert_eq!(r.field("d1.sectors"), Some("8192"));
    assert_eq!(r.field("d1.verified"), Some("16"));
    assert_eq!(r.field("d2.mode"), Some("ro"));
    assert_eq!(r.field("d2.serial"), Some("ro-disk"));
    assert_eq!(r.field("d2.write_rejected"), Some("1"));

    // What the guest wrote is in the files, and each writable disk saw its flush.
    check_image(&a);
    check_image(&b);
    assert_eq!(
        std::fs::read(&ro).unwrap(),
        ro_content,
        "read-only image changed"
    );
    assert!(
        counters[0].flushes >= 1 && counters[1].flushes >= 1,
        "{counters:?}"
    );
    assert!(counters[0].write_bytes >= 17 * 512);
    assert_eq!(counters[2].write_bytes, 0);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_disk_in_use_by_another_vm_is_refused() {
    let dir = tmpdir("lock");
    let a = dir.join("a.img");
    std::fs::File::create(&a).unwrap().set_len(1 << 20).unwrap();
    let console = Console::default();
    let mut cfg = probe_config("blk", 1, 64, &console);
    cfg.disks = vec![DiskConfig::new(&a)];
    // The first VM holds the image; a second one must not start.
    let console2 = Console::default();
    let mut first_cfg = probe_config("console", 1, 64, &console2);
    first_cfg.disks = vec![DiskConfig::new(&a)];
    require_kvm();
    let first = Vm::build(&first_cfg).unwrap();
    let err = Vm::build(&cfg).expect_err("second VM must be refused");
    assert!(err.is_config_error());
    assert_eq!(
        err.to_string(),
        format!(
            "--disk {}: locked by another VM (advisory lock held)",
            a.display()
        )
    );
    first.stop();
    let _ = first.wait();
    std::fs::remove_dir_all(dir).unwrap();
}

/// A guest that asks for more discard / write-zeroes segments than the device advertises (1):
/// a discard of two and a write-zeroes of 126 are refused whole (status non-zero; their sectors
/// keep their data, in the guest's view and in the file), single-segment ones zero their sector,
/// and the disk keeps working.
#[test]
fn zeroing_requests_beyond_the_advertised_segments_are_refused_whole() {
    require_kvm();
    let dir = tmpdir("discard");
    let a = dir.join("a.img");
    std::fs::File::create(&a).unwrap().set_len(1 << 20).unwrap();
    let console = Console::default();
    let mut cfg = probe_config("discard", 1, 64, &console);
    cfg.disks = vec![DiskConfig::new(&a)];
    let vm = Vm::build(&cfg).expect("building the VM");
    let run = run_to_end(vm, &console, T);
    let r = run
        .result
        .clone()
        .unwrap_or_else(|| panic!("no result: {:?}\n{}", run.end, run.console));
    assert!(r.ok, "{}", run.console);
    for (field, want) in [
        ("max_seg", "1"),
        ("one", "0"),
        ("zero", "0"),
        ("zeroed", "1"),
        ("kept", "1"),
        ("after", "1"),
    ] {
        assert_eq!(r.field(field), Some(want), "{field}: {}", run.console);
    }
    for field in ["two", "many"] {
        assert_ne!(
            r.field(field),
            Some("0"),
            "{field} was served: {}",
            run.console
        );
    }
    let data = std::fs::read(&a).unwrap();
    for s in 20..38usize {
        let tag = format!("MVPROBE sector {s}");
        assert_eq!(
            &data[s * 512..s * 512 + tag.len()],
            tag.as_bytes(),
            "sector {s}"
        );
    }
    assert!(
        data[8 * 512..10 * 512].iter().all(|&b| b == 0),
        "sectors 8, 9 not zeroed"
    );
    std::fs::remove_dir_all(dir).unwrap();
}
