//! Crash consistency of disks: `kill -9` of the launcher while the guest streams writes loses
//! nothing the guest had flushed, and leaves no sector half-written: the probe's `blkstream`
//! flushes every 16 writes and reports every 32 (so a report means everything up to it was
//! flushed); the launcher is killed right after a report, and the image must hold at least every
//! write up to it, each later sector either its pattern or untouched zeroes. With the host's
//! page cache (`cache=writeback`) and without it (`cache=none`, O_DIRECT).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

const DISK_BYTES: u64 = 8 << 20;
/// 4 KiB writes: the whole disk.
const WRITES: u64 = DISK_BYTES / 4096;
/// Kill at the first report at or past this many writes.
const KILL_AFTER: u64 = 256;

fn killed_mid_stream(cache: &str) -> (u64, Vec<u8>) {
    let dir = std::env::temp_dir().join(format!("mv-crash-{cache}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let image = dir.join("disk.img");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(DISK_BYTES)
        .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_virt-launcher"))
        .args(["run", "--no-console-input", "--memory", "64", "--kernel"])
        .arg(tests::probe_path())
        .arg("--disk")
        .arg(format!("{},cache={cache}", image.display()))
        .arg("--cmdline")
        .arg(format!(
            "console=ttyS0 probe.test=blkstream probe.writes={WRITES}"
        ))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut flushed = None;
    let mut console = String::new();
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        console.push_str(&line);
        console.push('\n');
        if let Some(n) = line
            .strip_prefix("PROBE PROGRESS blkstream writes=")
            .and_then(|n| n.trim().parse::<u64>().ok())
        {
            if n >= KILL_AFTER {
                // SAFETY: signals our own child.
                unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGKILL) };
                flushed = Some(n);
                break;
            }
        }
        assert!(
            !line.starts_with("PROBE RESULT"),
            "the stream ended before the kill:\n{console}"
        );
    }
    let status = child.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{console}");
    let flushed = flushed.unwrap_or_else(|| panic!("no progress report:\n{console}"));
    let bytes = std::fs::read(&image).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    (flushed, bytes)
}

#[test]
fn a_killed_launcher_keeps_every_flushed_write_and_tears_no_sector() {
    tests::require_kvm();
    for cache in ["writeback", "none"] {
        let (flushed, image) = killed_mid_stream(cache);
        for s in 0..flushed * 8 {
            assert!(
                tests::blkstream_sector_ok(&image, s),
                "cache={cache}: sector {s} of the {flushed} flushed writes is lost"
            );
        }
        let mut later = 0;
        for s in flushed * 8..DISK_BYTES / 512 {
            let sector = &image[s as usize * 512..(s as usize + 1) * 512];
            if tests::blkstream_sector_ok(&image, s) {
                later += 1;
            } else {
                assert!(
                    sector.iter().all(|&b| b == 0),
                    "cache={cache}: sector {s} is neither written nor untouched"
                );
            }
        }
        eprintln!("cache={cache}: killed after {flushed} flushed writes; {later} later sectors made it too");
    }
}
