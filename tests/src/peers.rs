//! Real servers the import tests talk to, each a process on a loopback port with its own
//! directory, gone (process and directory) when dropped: nginx (TLS from a test CA, basic auth
//! and a required header on `/private/`, a rate limit on `/slow/`) and Debian's
//! `docker-registry` (the distribution server), filled with `skopeo`; moto's S3 server
//! (PyPI), enforcing IAM.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
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
        let dir = std::env::temp_dir().join(format!("mv-peer-{kind}-{}", std::process::id()));
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

/// nginx serving `www/` on https://localhost:PORT with a certificate of the test CA in `ca/`:
/// `/private/` wants user `alice` (password `secret`) and the header `X-Token: abc`; `/slow/`
/// is sent at 2 MiB/s.
pub fn nginx(tag: &str) -> Server {
    let (dir, port) = Server::prepare(&format!("nginx-{tag}"));
    for d in ["www/private", "www/slow", "tmp", "ca"] {
        std::fs::create_dir_all(dir.join(d)).unwrap();
    }
    let d = dir.display();
    sh(&format!(
        "cd {d}
         openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca.key -out ca/ca.crt -subj /CN=test-ca -days 2 2>/dev/null
         openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout srv.key -out srv.csr -subj /CN=localhost 2>/dev/null
         printf 'subjectAltName=DNS:localhost,IP:127.0.0.1' > ext
         openssl x509 -req -in srv.csr -CA ca/ca.crt -CAkey ca.key -CAcreateserial -out srv.crt -days 2 -extfile ext 2>/dev/null
         printf 'alice:%s\\n' \"$(openssl passwd -apr1 secret)\" > htpasswd
         chmod -R a+rX {d}"
    ));
    let conf = format!(
        "daemon off; master_process off; pid {d}/nginx.pid; error_log {d}/error.log;
         {user}
         events {{}}
         http {{
           access_log off;
           client_body_temp_path {d}/tmp; proxy_temp_path {d}/tmp; fastcgi_temp_path {d}/tmp;
           uwsgi_temp_path {d}/tmp; scgi_temp_path {d}/tmp;
           types {{ application/octet-stream img qcow2 xz gz zst; }}
           server {{
             listen 127.0.0.1:{port} ssl;
             ssl_certificate {d}/srv.crt; ssl_certificate_key {d}/srv.key;
             root {d}/www;
             location /private/ {{
               auth_basic images; auth_basic_user_file {d}/htpasswd;
               if ($http_x_token != \"abc\") {{ return 403; }}
             }}
             location /slow/ {{ limit_rate 2m; }}
           }}
         }}",
        user = if unsafe { libc::getuid() } == 0 {
            "user root;"
        } else {
            ""
        }
    );
    std::fs::write(dir.join("nginx.conf"), conf).unwrap();
    let mut nginx = Command::new("nginx");
    nginx
        .args(["-e", &format!("{d}/error.log"), "-c"])
        .arg(dir.join("nginx.conf"));
    Server::start(nginx, dir, port)
}

/// Debian's docker-registry on 127.0.0.1:PORT (plain HTTP, as a registry on localhost may be).
pub fn registry() -> Server {
    let (dir, port) = Server::prepare("registry");
    std::fs::create_dir_all(dir.join("data")).unwrap();
    std::fs::write(
        dir.join("config.yml"),
        format!(
            "version: 0.1\nlog: {{level: error}}\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\n",
            dir.join("data").display()
        ),
    )
    .unwrap();
    let mut serve = Command::new("docker-registry");
    serve
        .arg("serve")
        .arg(dir.join("config.yml"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    Server::start(serve, dir, port)
}

/// Pushes an image whose one layer holds `files` (paths relative to the layer's root, each
/// copied from a host file) as `repo:tag` to the registry `r`, through an OCI layout and
/// skopeo — as a containerDisk is built (`disk/…`).
pub fn push(r: &Server, repo: &str, tag: &str, files: &[(&str, &Path)]) {
    let work = r.dir.join(format!("build-{repo}-{tag}").replace('/', "-"));
    let root = work.join("root");
    for (name, src) in files {
        let dst = root.join(name);
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::copy(src, dst).unwrap();
    }
    let w = work.display();
    sh(&format!(
        "cd {w}; mkdir -p layout/blobs/sha256; printf '{{\"imageLayoutVersion\":\"1.0.0\"}}' > layout/oci-layout
         tar -C root -cf layer.tar . ; diff=$(sha256sum layer.tar | cut -d' ' -f1)
         gzip -n layer.tar; l=$(sha256sum layer.tar.gz | cut -d' ' -f1); ls=$(stat -c %s layer.tar.gz)
         mv layer.tar.gz layout/blobs/sha256/$l
         printf '{{\"architecture\":\"amd64\",\"os\":\"linux\",\"rootfs\":{{\"type\":\"layers\",\"diff_ids\":[\"sha256:%s\"]}}}}' $diff > config.json
         c=$(sha256sum config.json | cut -d' ' -f1); cs=$(stat -c %s config.json); mv config.json layout/blobs/sha256/$c
         printf '{{\"schemaVersion\":2,\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\"config\":{{\"mediaType\":\"application/vnd.oci.image.config.v1+json\",\"digest\":\"sha256:%s\",\"size\":%s}},\"layers\":[{{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar+gzip\",\"digest\":\"sha256:%s\",\"size\":%s}}]}}' $c $cs $l $ls > manifest.json
         m=$(sha256sum manifest.json | cut -d' ' -f1); ms=$(stat -c %s manifest.json); mv manifest.json layout/blobs/sha256/$m
         printf '{{\"schemaVersion\":2,\"manifests\":[{{\"mediaType\":\"application/vnd.oci.image.manifest.v1+json\",\"digest\":\"sha256:%s\",\"size\":%s,\"annotations\":{{\"org.opencontainers.image.ref.name\":\"{tag}\"}}}}]}}' $m $ms > layout/index.json
         skopeo --insecure-policy copy -q --dest-tls-verify=false oci:layout:{tag} docker://127.0.0.1:{port}/{repo}:{tag}",
        port = r.port
    ));
}

/// An S3 endpoint: moto's server on 127.0.0.1:PORT, enforcing IAM (after the set-up calls
/// that make user `importer` with read access): `objects` (key in bucket `images`, host file)
/// uploaded. Returns the server and the user's access key id and secret key.
pub fn s3(objects: &[(&str, &Path)]) -> (Server, String, String) {
    let (dir, port) = Server::prepare("s3");
    let mut serve = Command::new("moto_server");
    serve
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        // Requests are authenticated once the set-up below has made the user and its key:
        // create-user, put-user-policy, create-access-key (create-bucket and the uploads are
        // the user's own, signed).
        .env("INITIAL_NO_AUTH_ACTION_COUNT", "3")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let server = Server::start(serve, dir, port);
    let uploads: Vec<String> = objects
        .iter()
        .map(|(k, p)| format!("({k:?}, {:?})", p.display().to_string()))
        .collect();
    let script = format!(
        r#"
import boto3, json
ep = "http://127.0.0.1:{port}"
root = dict(endpoint_url=ep, region_name="us-east-1", aws_access_key_id="setup", aws_secret_access_key="setup")
iam = boto3.client("iam", **root)
iam.create_user(UserName="importer")
iam.put_user_policy(UserName="importer", PolicyName="images", PolicyDocument=json.dumps(
    {{"Version": "2012-10-17", "Statement": [{{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}}]}}))
k = iam.create_access_key(UserName="importer")["AccessKey"]
s3 = boto3.client("s3", endpoint_url=ep, region_name="us-east-1",
                  aws_access_key_id=k["AccessKeyId"], aws_secret_access_key=k["SecretAccessKey"])
s3.create_bucket(Bucket="images")
for key, path in [{uploads}]:
    s3.upload_file(path, "images", key)
print(k["AccessKeyId"], k["SecretAccessKey"])
"#,
        uploads = uploads.join(", ")
    );
    let out = Command::new("python3")
        .args(["-c", &script])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "setting up moto: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let keys = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let (id, secret) = keys.split_once(' ').expect("an access key");
    (server, id.to_string(), secret.to_string())
}

/// A backend process on a unix socket (virtiofsd, qemu-storage-daemon), killed on drop.
pub struct SocketDaemon(pub Child);

impl SocketDaemon {
    /// `command`, started, once `socket` exists.
    pub fn start(mut command: Command, socket: &Path) -> SocketDaemon {
        let _ = std::fs::remove_file(socket);
        let child = command
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("{command:?}: {e} (scripts/install-prerequisites installs it)")
            });
        crate::wait_for_path(socket, Duration::from_secs(10));
        SocketDaemon(child)
    }

    /// Kills it now (a backend dying under a running VM).
    pub fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for SocketDaemon {
    fn drop(&mut self) {
        self.kill();
    }
}

/// virtiofsd serving `dir` on `socket` (no sandbox: the tests run it as root beside them).
pub fn virtiofsd(dir: &Path, socket: &Path, read_only: bool) -> SocketDaemon {
    let mut cmd = Command::new("virtiofsd");
    cmd.arg("--shared-dir")
        .arg(dir)
        .arg("--socket-path")
        .arg(socket)
        .args(["--sandbox", "none", "--cache", "never"]);
    if read_only {
        cmd.arg("--readonly");
    }
    SocketDaemon::start(cmd, socket)
}

/// qemu-storage-daemon exporting the raw `image` as vhost-user-blk on `socket`.
pub fn storage_daemon(image: &Path, socket: &Path, writable: bool) -> SocketDaemon {
    let mut cmd = Command::new("qemu-storage-daemon");
    cmd.arg("--blockdev")
        .arg(format!(
            "driver=file,node-name=file,filename={}",
            image.display()
        ))
        .arg("--export")
        .arg(format!(
            "type=vhost-user-blk,id=export,addr.type=unix,addr.path={},node-name=file,writable={}",
            socket.display(),
            if writable { "on" } else { "off" }
        ));
    SocketDaemon::start(cmd, socket)
}

/// `storage_daemon`, writable, without QEMU's image locks: the two ends of a migration each
/// run one on the same image, as two hosts would on shared storage, and only one of them
/// writes at a time (the VMM hands the disk over at switch-over).
pub fn storage_daemon_unlocked(image: &Path, socket: &Path) -> SocketDaemon {
    let mut cmd = Command::new("qemu-storage-daemon");
    cmd.arg("--blockdev")
        .arg(format!(
            "driver=file,node-name=file,filename={},locking=off",
            image.display()
        ))
        .arg("--export")
        .arg(format!(
            "type=vhost-user-blk,id=export,addr.type=unix,addr.path={},node-name=file,writable=on",
            socket.display()
        ));
    SocketDaemon::start(cmd, socket)
}

/// DPDK's testpmd with a vhost-user-net port on `socket` (no huge pages, no NIC), forwarding
/// every frame back out of that port in `mode` (`io`: as it came, `macswap`: addresses
/// swapped). It polls a core flat out: run one at a time.
pub fn testpmd(socket: &Path, mode: &str) -> SocketDaemon {
    let prefix = format!(
        "mv-{}-{}",
        std::process::id(),
        socket.file_name().unwrap().to_string_lossy()
    );
    let mut cmd = Command::new("dpdk-testpmd");
    cmd.args(["--no-huge", "-m", "256", "--no-pci"])
        .arg(format!("--file-prefix={prefix}"))
        .arg(format!(
            "--vdev=net_vhost0,iface={},queues=1",
            socket.display()
        ))
        .arg("--")
        .arg(format!("--forward-mode={mode}"))
        .args([
            "--auto-start",
            "--stats-period",
            "60",
            "--total-num-mbufs=8192",
        ]);
    SocketDaemon::start(cmd, socket)
}
