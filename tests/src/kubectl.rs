//! The real kubectl against the test API server, as the cluster's admin: each call's output
//! printed for the test log, exit codes and output returned.

use std::path::PathBuf;
use std::time::Duration;

use crate::apiserver::ApiServer;

/// How long [`Kubectl::until`] keeps asking.
const T: Duration = Duration::from_secs(30);

pub struct Kubectl {
    pub kubeconfig: PathBuf,
    cache: PathBuf,
    pub dir: PathBuf,
}

pub struct Ran {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Kubectl {
    /// kubectl as the cluster's admin, with a kubeconfig and cache of its own under a
    /// fresh directory named by `tag`.
    pub fn new(server: &ApiServer, tag: &str) -> Kubectl {
        let dir =
            std::env::temp_dir().join(format!("microvirt-kubectl-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let kubeconfig = dir.join("kubeconfig");
        server.write_kubeconfig(&kubeconfig, None);
        Kubectl {
            kubeconfig,
            cache: dir.join("cache"),
            dir,
        }
    }

    /// A manifest file for `-f`.
    pub fn file(&self, name: &str, text: &str) -> String {
        let p = self.dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    }

    pub async fn run(&self, args: &[&str]) -> Ran {
        let ran = self.run_quietly(args).await;
        eprintln!(
            "$ kubectl {}\n{}{}(exit {})",
            args.join(" "),
            ran.stdout,
            ran.stderr,
            ran.code
        );
        ran
    }

    pub async fn run_quietly(&self, args: &[&str]) -> Ran {
        let out = tokio::process::Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--cache-dir")
            .arg(&self.cache)
            .args(args)
            .output()
            .await
            .expect("kubectl runs (the kubectl package is installed by .ci/run)");
        let ran = Ran {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into(),
            stderr: String::from_utf8_lossy(&out.stderr).into(),
        };
        ran
    }

    /// Runs and requires exit 0; returns stdout.
    pub async fn ok(&self, args: &[&str]) -> String {
        let r = self.run(args).await;
        assert_eq!(r.code, 0, "kubectl {args:?} failed: {}", r.stderr);
        r.stdout
    }

    /// Runs until `check` accepts stdout (the controllers work asynchronously); the last
    /// output is printed either way.
    pub async fn until(&self, args: &[&str], what: &str, check: impl Fn(&str) -> bool) -> String {
        let deadline = tokio::time::Instant::now() + T;
        loop {
            let r = self.run_quietly(args).await;
            if r.code == 0 && check(&r.stdout) {
                return r.stdout;
            }
            if tokio::time::Instant::now() > deadline {
                self.run(args).await;
                panic!("timed out after {T:?} waiting for: {what}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}
