//! Support for microvirt's integration tests: building and locating guest images, running a
//! VM in-process with its console captured, and reading the probe guest's result line.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use vmm::{SerialInput, SerialOutput, Vm, VmConfig, VmEnd};

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Tests that need KVM fail loudly without it; they never pass by skipping.
pub fn require_kvm() {
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        panic!("this test needs /dev/kvm and cannot open it: {e}");
    }
}

/// Runs `guest-images/build ARGS` and returns the paths on its last output line.
pub fn build_guest_image(args: &[&str]) -> Vec<PathBuf> {
    let out = Command::new(repo_root().join("guest-images/build"))
        .args(args)
        .output()
        .expect("running guest-images/build");
    assert!(
        out.status.success(),
        "guest-images/build {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let last = stdout
        .lines()
        .last()
        .expect("guest-images/build printed nothing");
    last.split_whitespace().map(PathBuf::from).collect()
}

pub fn probe_path() -> PathBuf {
    static PROBE: OnceLock<PathBuf> = OnceLock::new();
    PROBE
        .get_or_init(|| build_guest_image(&["probe"]).remove(0))
        .clone()
}

/// A console sink shared with the test.
#[derive(Clone, Default)]
pub struct Console(Arc<Mutex<Vec<u8>>>);

impl Console {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
    pub fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn output(&self) -> SerialOutput {
        SerialOutput::Writer(self.0.clone() as Arc<Mutex<dyn Write + Send>>)
    }
    /// Waits until the console contains `needle`.
    pub fn wait_for(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.text().contains(needle) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

/// The probe's `PROBE RESULT <test> OK|FAIL <details>` line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeResult {
    pub test: String,
    pub ok: bool,
    pub details: String,
}

impl ProbeResult {
    pub fn parse(console: &str) -> Option<ProbeResult> {
        let line = console
            .lines()
            .find_map(|l| l.strip_prefix("PROBE RESULT "))?;
        let mut it = line.splitn(3, ' ');
        let test = it.next()?.to_string();
        let ok = match it.next()? {
            "OK" => true,
            "FAIL" => false,
            _ => return None,
        };
        Some(ProbeResult {
            test,
            ok,
            details: it.next().unwrap_or("").trim_end().to_string(),
        })
    }

    /// The value of `key=value` in the details.
    pub fn field(&self, key: &str) -> Option<&str> {
        self.details
            .split(' ')
            .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
    }
}

pub struct ProbeRun {
    pub console: String,
    pub end: VmEnd,
    pub result: Option<ProbeResult>,
}

pub fn probe_config(test: &str, vcpus: u8, memory_mib: u64, console: &Console) -> VmConfig {
    let mut c = VmConfig::new(probe_path());
    c.vcpus = vcpus;
    c.memory_mib = memory_mib;
    c.cmdline = format!("console=ttyS0 probe.test={test}");
    c.serial.output = console.output();
    c.serial.input = SerialInput::None;
    c
}

/// Boots the probe with `probe.test=<test>` and waits for the VM to end.
pub fn run_probe(test: &str, vcpus: u8, memory_mib: u64, timeout: Duration) -> ProbeRun {
    require_kvm();
    let console = Console::default();
    let vm = Vm::build(&probe_config(test, vcpus, memory_mib, &console)).expect("building the VM");
    run_to_end(vm, &console, timeout)
}

/// Waits for `vm` to end; a VM still running after `timeout` fails the test.
pub fn run_to_end(vm: Vm, console: &Console, timeout: Duration) -> ProbeRun {
    let ended = vm.end_signal().wait_timeout(timeout);
    if ended.is_none() {
        vm.stop();
        let _ = vm.wait();
        panic!(
            "VM still running after {timeout:?}; console:\n{}",
            console.text()
        );
    }
    let end = vm.wait();
    let text = console.text();
    ProbeRun {
        result: ProbeResult::parse(&text),
        console: text,
        end,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_result_lines() {
        let r = ProbeResult::parse("hello\nPROBE RESULT smp OK cpus=2 mask=0x3\n").unwrap();
        assert_eq!((r.test.as_str(), r.ok), ("smp", true));
        assert_eq!(r.field("cpus"), Some("2"));
        assert_eq!(r.field("nope"), None);
        assert!(
            !ProbeResult::parse("PROBE RESULT boot FAIL e820: empty")
                .unwrap()
                .ok
        );
        assert_eq!(ProbeResult::parse("PROBE RESULT boot MAYBE"), None);
        assert_eq!(ProbeResult::parse("no result"), None);
    }
}
