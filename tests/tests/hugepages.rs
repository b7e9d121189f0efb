//! Guest RAM on huge pages from the host's hugetlb pool (KubeVirt's
//! `memory.hugepages.pageSize: 2Mi`): the pages are reserved when the VM is built, the probe
//! writes and checks all of RAM on them, and a pool too small refuses the VM with the count.

use std::time::Duration;

use tests::*;
use vmm::config::HugePageSize;
use vmm::Vm;

const POOL: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB";

fn read(f: &str) -> u64 {
    std::fs::read_to_string(format!("{POOL}/{f}"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Free 2 MiB pages nobody has reserved.
fn available() -> u64 {
    read("free_hugepages") - read("resv_hugepages")
}

/// Grows the 2 MiB pool by `extra` pages for the test; puts it back on drop.
struct Pool(u64);

impl Pool {
    fn grow(extra: u64) -> Pool {
        let before = read("nr_hugepages");
        std::fs::write(format!("{POOL}/nr_hugepages"), (before + extra).to_string()).unwrap();
        assert!(
            read("nr_hugepages") >= before + extra,
            "the host could not give {extra} huge pages"
        );
        Pool(before)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let _ = std::fs::write(format!("{POOL}/nr_hugepages"), self.0.to_string());
    }
}

#[test]
fn guest_ram_on_2mi_huge_pages_is_reserved_at_build_and_a_short_pool_is_refused() {
    require_kvm();
    let _pool = Pool::grow(48);
    let before = available();
    let console = Console::default();
    let mut cfg = probe_config("memory", 1, 64, &console);
    cfg.hugepages = Some(HugePageSize::Size2M);
    let vm = Vm::build(&cfg).expect("building the VM");
    // 64 MiB = 32 pages, all reserved for the VM as it is built.
    assert_eq!(before - available(), 32);
    let run = run_to_end(vm, &console, Duration::from_secs(120));
    expect_probe_ok(&run, "memory");
    assert_eq!(available(), before, "the pages went back to the pool");

    // 256 MiB needs 128 pages; the pool has 48 more than before.
    let mut big = probe_config("boot", 1, 256, &console);
    big.hugepages = Some(HugePageSize::Size2M);
    let Err(e) = Vm::build(&big) else {
        panic!("a VM larger than the pool was built")
    };
    let text = e.to_string();
    assert!(
        text.contains("2Mi huge pages") && text.contains("of them free"),
        "{text}"
    );

    // Memory that is not a whole number of pages.
    let mut odd = probe_config("boot", 1, 65, &console);
    odd.hugepages = Some(HugePageSize::Size2M);
    let Err(e) = Vm::build(&odd) else {
        panic!("65 MiB on 2 MiB pages was built")
    };
    assert!(e.is_config_error(), "{e}");
    assert!(
        e.to_string()
            .contains("--hugepages 2Mi: --memory 65 MiB is not a whole number of 2Mi pages"),
        "{e}"
    );
}
