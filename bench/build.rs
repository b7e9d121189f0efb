//! Builds the LD_PRELOAD library that stamps a VMM's first KVM_RUN (see kvm_run_stamp.c).
//! A C shared object, not Rust: it is loaded into Firecracker and QEMU as well, and must be
//! tiny and free of a second Rust runtime.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap()).join("libkvm_run_stamp.so");
    println!("cargo:rerun-if-changed=kvm_run_stamp.c");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-O2", "-shared", "-fPIC", "-Wall", "-o"])
        .arg(&out)
        .arg("kvm_run_stamp.c")
        .arg("-ldl")
        .status()
        .unwrap_or_else(|e| panic!("running {cc}: {e}"));
    assert!(status.success(), "{cc} failed to build kvm_run_stamp.c");
    println!("cargo:rustc-env=KVM_RUN_STAMP_SO={}", out.display());
}
