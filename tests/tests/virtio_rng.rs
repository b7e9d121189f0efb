//! virtio-rng (KubeVirt's `rng: {}`): the probe guest draws random bytes through the device
//! and checks a buffer it marked read-only is left alone.

use std::time::Duration;

use tests::{expect_probe_ok, probe_config, require_kvm, run_built};

const T: Duration = Duration::from_secs(60);

fn run_rng(with_device: bool) -> tests::ProbeRun {
    require_kvm();
    run_built(
        |console| {
            let mut c = probe_config("rng", 1, 64, console);
            c.rng = with_device;
            c
        },
        T,
    )
}

#[test]
fn the_guest_draws_different_random_bytes_on_every_boot() {
    let first = expect_probe_ok(&run_rng(true), "rng");
    let second = expect_probe_ok(&run_rng(true), "rng");
    let bytes = |r: &tests::ProbeResult| r.field("bytes").unwrap().to_string();
    assert_eq!(bytes(&first).len(), 16, "{}", first.details);
    assert_ne!(
        bytes(&first),
        bytes(&second),
        "two boots drew the same bytes"
    );
}

#[test]
fn without_the_device_the_guest_finds_none() {
    let run = run_rng(false);
    let r = run.result.expect("a result line");
    assert!(!r.ok, "{}", run.console);
    assert!(r.details.contains("no virtio-rng device"), "{}", r.details);
}
