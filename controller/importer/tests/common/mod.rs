//! What the importer's tests against real servers share: a server process on a loopback port
//! with its own directory, gone (process and directory) when dropped.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

pub struct Server {
    pub child: Child,
    pub dir: PathBuf,
    pub port: u16,
}

impl Server {
    /// A fresh directory for a server of `kind`, and a free loopback port for it.
    pub fn prepare(kind: &str) -> (PathBuf, u16) {
        let dir = std::env::temp_dir().join(format!("mv-importer-{kind}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        (dir, port)
    }

    /// `command`, started, once it accepts connections on `port`.
    pub fn start(mut command: Command, dir: PathBuf, port: u16) -> Server {
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("{command:?}: {e}"));
        let s = Server { child, dir, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "{command:?} did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        s
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs a shell script, which must succeed; its output.
pub fn sh(script: &str) -> String {
    let out = Command::new("sh").args(["-ec", script]).output().unwrap();
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}
