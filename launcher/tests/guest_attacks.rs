//! The guest-attack suite: the probe behaves like a hostile kernel (`probe.test=attack`: see
//! guest-images/probe/src/attack.rs) against a launcher with a read-write and a read-only disk
//! and a NIC on a real TAP, into which the host keeps sending broadcasts (so the receive path is
//! attacked too).
//! Every attack must leave the VMM alive and the disk working (the probe checks after each one
//! and ends the run with its result); the host then checks what the guest cannot see: the launcher
//! exits cleanly without a panic, both disk images are byte-for-byte what they were (every write
//! the probe attempts carries an invalid buffer, a read-only target or nothing), and the
//! launcher's peak memory stays within a bound of a benign run's.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// What the probe's health check reads back from sector 0 (attack.rs `MARK`).
const MARK: &[u8] = b"MICROVIRT ATTACK DISK";
const DISK_BYTES: usize = 1 << 20;

/// A disk image: the marker, then bytes that differ everywhere (so any stray write shows).
fn image(path: &Path, seed: u64) -> Vec<u8> {
    let mut x = seed;
    let mut bytes: Vec<u8> = (0..DISK_BYTES)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 56) as u8
        })
        .collect();
    bytes[..MARK.len()].copy_from_slice(MARK);
    std::fs::write(path, &bytes).unwrap();
    bytes
}

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    /// Peak resident memory of the launcher, KiB (getrusage's ru_maxrss of the child).
    max_rss_kib: i64,
}

/// A TAP with an address, up, and a thread broadcasting UDP datagrams out of it until dropped.
struct Tap {
    name: String,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Tap {
    fn new() -> Tap {
        let name = format!("mvatk{}", std::process::id() % 10_000);
        let ip = |args: &[&str]| {
            let st = Command::new("ip").args(args).status().unwrap();
            assert!(st.success(), "ip {args:?}");
        };
        let _ = Command::new("ip").args(["link", "del", &name]).status();
        ip(&["tuntap", "add", &name, "mode", "tap"]);
        ip(&["addr", "add", "10.213.0.1/24", "dev", &name]);
        ip(&["link", "set", &name, "up"]);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (s, n) = (stop.clone(), name.clone());
        std::thread::spawn(move || {
            let sock = std::net::UdpSocket::bind("10.213.0.1:0").unwrap();
            sock.set_broadcast(true).unwrap();
            use std::os::fd::AsRawFd;
            // SAFETY: SO_BINDTODEVICE with the interface name and its length.
            unsafe {
                libc::setsockopt(
                    sock.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_BINDTODEVICE,
                    n.as_ptr() as *const libc::c_void,
                    n.len() as libc::socklen_t,
                )
            };
            while !s.load(std::sync::atomic::Ordering::SeqCst) {
                // Fails while the TAP has no reader (no carrier); that is fine.
                let _ = sock.send_to(&[0x42; 100], "10.213.0.255:9999");
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        });
        Tap { name, stop }
    }
}

impl Drop for Tap {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let _ = Command::new("ip")
            .args(["link", "del", &self.name])
            .status();
    }
}

fn run_probe(dir: &Path, test: &str, tap: &Tap) -> Run {
    let (rw, ro) = (dir.join("rw.img"), dir.join("ro.img"));
    // Reaped below by wait4, which also gives its peak memory (std's wait does not).
    #[allow(clippy::zombie_processes)]
    let child = Command::new(env!("CARGO_BIN_EXE_virt-launcher"))
        .args([
            "run",
            "--no-console-input",
            "--memory",
            "64",
            "--vcpus",
            "1",
            "--kernel",
        ])
        .arg(tests::probe_path())
        .arg("--disk")
        .arg(&rw)
        .arg("--disk")
        .arg(format!("{},readonly", ro.display()))
        .arg("--net")
        .arg(format!("tap={}", tap.name))
        .arg("--cmdline")
        .arg(format!("console=ttyS0 probe.test={test}"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let out = std::thread::spawn({
        let mut stdout = child.stdout.unwrap();
        move || {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut stdout, &mut s).unwrap();
            s
        }
    });
    let err = std::thread::spawn({
        let mut stderr = child.stderr.unwrap();
        move || {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut stderr, &mut s).unwrap();
            s
        }
    });
    let mut status = 0;
    // SAFETY: waits for our own child, with an rusage to fill in.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(r, pid, "wait4: {}", std::io::Error::last_os_error());
    Run {
        code: libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status)),
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
        max_rss_kib: usage.ru_maxrss,
    }
}

fn workdir(tag: &str) -> (PathBuf, Vec<u8>, Vec<u8>) {
    let dir = std::env::temp_dir().join(format!("mv-attack-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let rw = image(&dir.join("rw.img"), 1);
    let ro = image(&dir.join("ro.img"), 2);
    (dir, rw, ro)
}

#[test]
fn a_hostile_guest_neither_breaks_the_vmm_nor_writes_where_it_must_not() {
    tests::require_kvm();
    // A benign run with the same devices, for the memory bound.
    let tap = Tap::new();
    let (base_dir, _, _) = workdir("baseline");
    let baseline = run_probe(&base_dir, "boot", &tap);
    assert_eq!(baseline.code, Some(0), "{}", baseline.stderr);

    let (dir, rw, ro) = workdir("hostile");
    let run = run_probe(&dir, "attack", &tap);
    assert_eq!(
        run.code,
        Some(0),
        "the launcher must end cleanly (the guest powers off):\n{}\n{}",
        run.stdout,
        run.stderr
    );
    let result = tests::ProbeResult::parse(&run.stdout).expect("the probe's result line");
    assert!(result.ok, "{}", run.stdout);
    let attacks: usize = result.field("attacks").unwrap().parse().unwrap();
    assert_eq!(
        run.stdout.matches("; disk healthy").count() + run.stdout.matches("; nic healthy").count(),
        attacks,
        "every attack reported, the device healthy after each"
    );
    assert!(attacks >= 70, "{attacks} attacks");
    assert_eq!(result.field("disks"), Some("2"));
    assert_eq!(result.field("nics"), Some("1"));
    assert!(
        result.field("ports").unwrap().parse::<u32>().unwrap() > 65_000,
        "port I/O to (nearly) every port"
    );
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);

    // Nothing written: the read-write disk only ever got writes with invalid buffers or none,
    // the read-only one must refuse them all.
    assert!(
        std::fs::read(dir.join("rw.img")).unwrap() == rw,
        "the read-write image changed"
    );
    assert!(
        std::fs::read(dir.join("ro.img")).unwrap() == ro,
        "the read-only image changed"
    );

    // Bounded memory: descriptor lengths near 4 GiB must not turn into host allocations.
    let growth = run.max_rss_kib - baseline.max_rss_kib;
    eprintln!(
        "peak RSS: benign {} KiB, hostile {} KiB",
        baseline.max_rss_kib, run.max_rss_kib
    );
    assert!(
        growth < 16 * 1024,
        "the hostile run peaked {growth} KiB above the benign one"
    );
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(base_dir);
}
