//! Firecracker's API as the benchmarks drive it: one HTTP/1.1 request per connection on its
//! Unix socket, and the snapshot calls built on that.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};

/// Arguments that keep Firecracker quiet and comparable (no seccomp: microvirt's filters are
/// on, which only makes microvirt's figures the more conservative).
pub const QUIET: [&str; 5] = [
    "--no-seccomp",
    "--log-path",
    "/dev/null",
    "--level",
    "Error",
];

/// Writes a `--config-file` for a guest of one vCPU and `mib` MiB booting `kernel` (with
/// `initrd`, if any) and `cmdline`, without drives or NICs.
pub fn write_config(
    path: &Path,
    kernel: &Path,
    initrd: Option<&Path>,
    cmdline: &str,
    mib: u64,
) -> Result<()> {
    let mut boot = serde_json::json!({"kernel_image_path": kernel, "boot_args": cmdline});
    if let Some(initrd) = initrd {
        boot["initrd_path"] = serde_json::json!(initrd);
    }
    let json = serde_json::json!({
        "boot-source": boot,
        "drives": [],
        "machine-config": {"vcpu_count": 1, "mem_size_mib": mib},
        "network-interfaces": [],
    });
    std::fs::write(path, json.to_string())?;
    Ok(())
}

/// One request on Firecracker's API socket; returns the status code, or an error with the
/// answer when it is not 2xx.
pub fn api(sock: &Path, method: &str, path: &str, body: &str) -> Result<u16> {
    let mut s = UnixStream::connect(sock)?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nAccept: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut buf = [0u8; 4096];
    let n = s.read(&mut buf)?;
    let head = String::from_utf8_lossy(&buf[..n]);
    let code = head
        .split_whitespace()
        .nth(1)
        .context("no HTTP status")?
        .parse()?;
    if !(200..300).contains(&code) {
        bail!("firecracker {method} {path}: {head}");
    }
    Ok(code)
}

/// Waits until Firecracker accepts on `sock` (the file appears a moment before it listens).
pub fn wait_accepting(sock: &Path) -> Result<()> {
    crate::wait_for_path(sock)?;
    for _ in 0..10_000 {
        if UnixStream::connect(sock).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    bail!("firecracker never accepted on {}", sock.display())
}

/// Pauses the VM and writes a full snapshot (PATCH /vm Paused, PUT /snapshot/create).
pub fn create_snapshot(sock: &Path, state: &Path, memory: &Path) -> Result<()> {
    api(sock, "PATCH", "/vm", r#"{"state": "Paused"}"#)?;
    api(
        sock,
        "PUT",
        "/snapshot/create",
        &format!(
            r#"{{"snapshot_type": "Full", "snapshot_path": "{}", "mem_file_path": "{}"}}"#,
            state.display(),
            memory.display()
        ),
    )?;
    Ok(())
}

/// Loads a snapshot into a fresh Firecracker and resumes it; answered once its vCPU threads
/// have acknowledged the resume. The memory file is mapped privately, so many Firecrackers
/// may load one file.
pub fn load_snapshot(sock: &Path, state: &Path, memory: &Path) -> Result<()> {
    api(
        sock,
        "PUT",
        "/snapshot/load",
        &format!(
            r#"{{"snapshot_path": "{}", "mem_backend": {{"backend_type": "File", "backend_path": "{}"}}, "resume_vm": true}}"#,
            state.display(),
            memory.display()
        ),
    )?;
    Ok(())
}
