//! Release builds of virt-launcher lay their code out by use: the functions a launcher runs
//! (start-up, the vCPU and device loops, migration, snapshots, manifests) are placed next to each
//! other, in the order `layout/virt-launcher.order` gives (written by `scripts/launcher-layout`).
//!
//! Why: the kernel maps a binary's code 64 KiB at a time around each page a process touches
//! (fault-around), and every mapped page counts in the process's RSS. Scattered over 7 MiB of
//! text, the ~1100 functions a launcher runs fell in 37 such windows, 2.2 MiB resident in every
//! VM Pod. Placed together they fill a few. Ordering by symbol is a feature of LLVM's lld (GNU
//! ld 2.40 has none); rustc ships lld and links with it by default on x86_64 Linux, so the
//! layout applies to release builds wherever that lld (or a system `ld.lld`) is found, and a
//! warning says when it is not.
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let order = Path::new(env!("CARGO_MANIFEST_DIR")).join("layout/virt-launcher.order");
    println!("cargo:rerun-if-changed={}", order.display());
    println!("cargo:rerun-if-env-changed=MICROVIRT_LAUNCHER_MAP");
    if std::env::var("PROFILE").as_deref() != Ok("release") {
        return;
    }
    let Some((lld_dir, rustc_own)) = lld_dir() else {
        println!(
            "cargo:warning=no lld found (rustc's own or ld.lld on PATH): virt-launcher links \
             without its code layout, which costs about 1.7 MiB more RSS per VM"
        );
        return;
    };
    let mut args = vec![
        format!("-B{}", lld_dir.display()),
        "-fuse-ld=lld".to_string(),
        format!("-Wl,--symbol-ordering-file={}", order.display()),
        // The order names the functions of one build; one renamed or inlined since is skipped.
        "-Wl,--no-warn-symbol-ordering".to_string(),
    ];
    if rustc_own {
        // Relative relocations packed as bitmaps (DT_RELR, glibc 2.36+, what every image here
        // is built on): 7,900 of them took 190 KiB that the loader read at every start; packed
        // they take a few KiB. Only rustc's lld is known to be new enough (lld 15+).
        args.push("-Wl,-z,pack-relative-relocs".to_string());
    }
    // scripts/launcher-layout asks for the linker's map: the release binary is stripped, and its
    // symbols' names depend on the profile, so the map of the very build is where they are found.
    if let Some(map) = std::env::var_os("MICROVIRT_LAUNCHER_MAP") {
        args.push(format!("-Wl,-Map={}", Path::new(&map).display()));
        args.push("-Wl,--no-demangle".to_string());
    }
    for arg in args {
        println!("cargo:rustc-link-arg-bin=virt-launcher={arg}");
    }
}

/// A directory holding `ld.lld`: rustc's own (`<sysroot>/lib/rustlib/<target>/bin/gcc-ld`, the
/// one rustc links with by default; then `true`), else the first on PATH.
fn lld_dir() -> Option<(PathBuf, bool)> {
    let rustc = std::env::var_os("RUSTC")?;
    let target = std::env::var("TARGET").ok()?;
    let own = Command::new(rustc)
        .args(["--print", "sysroot"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            Path::new(String::from_utf8_lossy(&o.stdout).trim())
                .join("lib/rustlib")
                .join(target)
                .join("bin/gcc-ld")
        });
    let path = std::env::var_os("PATH");
    own.map(|dir| (dir, true))
        .into_iter()
        .chain(
            path.iter()
                .flat_map(std::env::split_paths)
                .map(|dir| (dir, false)),
        )
        .find(|(dir, _)| dir.join("ld.lld").is_file())
}
