//! cdi-importer: fills a volume from a DataVolume's source, configured as CDI's importer Pod
//! is (the `IMPORTER_*` environment), or from flags when run by hand. Sources: `http` (https
//! with the `certConfigMap`'s CAs, basic auth from the `secretRef`, extra headers),
//! `s3` (an object, signed with the secretRef's keys), `registry` (`docker://…`: the file
//! under `/disk/` of a containerDisk image), `blank` and
//! `pvc` (a clone of another claim, mounted read-only).
//! Exit status 0 when the volume holds the whole image, 1 otherwise: the reason on stderr and,
//! as JSON ([`api::cdi::importer::Outcome`]), in the Pod's termination message, where the
//! DataVolume controller reads whether another attempt can help. While it runs, the progress
//! is served as CDI's importer serves it, for the controller to show in `status.progress`.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use api::cdi::importer as pod;
use clap::Parser;
use importer::verify::Checksum;
use importer::{import, ImportError, SparseWriter};

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Fill a volume from a DataVolume source (CDI's importer)"
)]
struct Args {
    /// `http`, `registry` or `blank`.
    #[arg(long, env = "IMPORTER_SOURCE", default_value = "http")]
    source: String,
    /// The image's URL (http source).
    #[arg(long, env = "IMPORTER_ENDPOINT")]
    endpoint: Option<String>,
    /// The size asked for (a quantity, e.g. 10Gi): the most the image may take, and what a
    /// smaller image's volume is grown to.
    #[arg(long, env = "IMPORTER_IMAGE_SIZE")]
    image_size: Option<String>,
    /// Basic auth user (the secretRef's accessKeyId).
    #[arg(long, env = "IMPORTER_ACCESS_KEY_ID", hide_env_values = true)]
    access_key_id: Option<String>,
    /// Basic auth password (the secretRef's secretKey).
    #[arg(long, env = "IMPORTER_SECRET_KEY", hide_env_values = true)]
    secret_key: Option<String>,
    /// A directory of PEM CA certificates to trust for https (the certConfigMap, mounted).
    #[arg(long, env = "IMPORTER_CERT_DIR")]
    cert_dir: Option<PathBuf>,
    /// Extra request headers, `Name: value`, one per line in the environment.
    #[arg(
        long = "extra-header",
        env = "IMPORTER_EXTRA_HEADERS",
        value_delimiter = '\n'
    )]
    extra_headers: Vec<String>,
    /// `sha256:HEX` or `sha512:HEX` of the bytes as downloaded.
    #[arg(long, env = "IMPORTER_CHECKSUM")]
    checksum: Option<String>,
    /// Registries (`host:port`, comma-separated) reached over plain HTTP; localhost's always
    /// may be.
    #[arg(long, env = "IMPORTER_INSECURE_REGISTRIES", value_delimiter = ',')]
    insecure_registries: Vec<String>,
    /// Accept any server certificate (the http source's `insecureSkipVerify`).
    #[arg(long, env = "IMPORTER_INSECURE_TLS")]
    insecure_tls: bool,
    /// The DataVolume's UID, the label of the progress metric.
    #[arg(long, env = "OWNER_UID")]
    owner_uid: Option<String>,
    /// Where the progress is served (`POD_IP`, port 8443 as CDI's importer): none when unset.
    #[arg(long, env = "POD_IP")]
    pod_ip: Option<std::net::IpAddr>,
    /// Where the outcome of a failed import is left (the container's termination message).
    #[arg(
        long,
        env = "IMPORTER_TERMINATION_LOG",
        default_value = "/dev/termination-log"
    )]
    termination_log: PathBuf,
    /// The volume: a Filesystem claim's disk.img, or a Block claim's device.
    #[arg(long, env = "IMPORTER_TARGET", default_value = "/data/disk.img")]
    target: PathBuf,
    /// Where a qcow2 image is staged (CDI's scratch space).
    #[arg(long, env = "IMPORTER_SCRATCH", default_value = "/scratch/tmpimage")]
    scratch: PathBuf,
}

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    // Before any thread exists, so all of them inherit it.
    if let Err(e) = importer::seccomp::install() {
        eprintln!("Unable to process data: installing the seccomp filter: {e}");
        std::process::exit(1);
    }
    // The upload server takes the Pod's port itself; an upload's progress is the client's.
    let uploading = args.source == "upload";
    if let (Some(ip), Some(owner), false) = (args.pod_ip, args.owner_uid.clone(), uploading) {
        if let Err(e) = serve_progress(ip, owner) {
            tracing::warn!("progress is not served: {e}");
        }
    }
    if let Err(e) = run(&args) {
        eprintln!("Unable to process data: {e:#}");
        let outcome = outcome_of(&e);
        // A container without a termination-log file still fails with its stderr.
        if let Ok(json) = serde_json::to_string(&outcome) {
            let _ = std::fs::write(&args.termination_log, json);
        }
        std::process::exit(1);
    }
}

/// What the DataVolume shows of a failure: the importer's own errors say whether to retry;
/// a transport error may pass; anything else (the volume could not be opened, ...) is tried
/// again too, as the kubelet restarts a failed importer.
fn outcome_of(e: &anyhow::Error) -> pod::Outcome {
    let message = format!("Unable to process data: {e:#}");
    if let Some(ie) = e.downcast_ref::<ImportError>() {
        return pod::Outcome {
            message,
            ..ie.outcome()
        };
    }
    let reason = if e.downcast_ref::<reqwest::Error>().is_some() {
        "SourceError"
    } else {
        "Error"
    };
    pod::Outcome {
        reason: reason.into(),
        message,
        retryable: true,
    }
}

/// Hundredths of a percent done, `u64::MAX` while the size is unknown.
static PROGRESS: AtomicU64 = AtomicU64::new(u64::MAX);

/// Serves `kubevirt_cdi_import_progress_total{ownerUID}` on `ip`:8443 for the controller's
/// scrapes. By hand: one fixed plain-text answer to a GET every two seconds needs no HTTP
/// framework in the importer (the controller reads it with a 2 s timeout, as CDI's does).
fn serve_progress(ip: std::net::IpAddr, owner: String) -> std::io::Result<()> {
    use std::io::Write;
    let listener = std::net::TcpListener::bind((ip, pod::METRICS_PORT))?;
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
            // The request is read (to its end of headers, bounded) and not otherwise looked at.
            let mut req = [0u8; 4096];
            let mut n = 0;
            while n < req.len() && !req[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                match conn.read(&mut req[n..]) {
                    Ok(0) | Err(_) => break,
                    Ok(k) => n += k,
                }
            }
            let body = match PROGRESS.load(Ordering::Relaxed) {
                u64::MAX => String::new(),
                p => pod::progress_line(&owner, p as f64 / 100.0),
            };
            let _ = write!(
                conn,
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    Ok(())
}

fn run(args: &Args) -> anyhow::Result<()> {
    let requested = args
        .image_size
        .as_deref()
        .map(api::quantity::parse_bytes)
        .transpose()
        .map_err(|e| anyhow::anyhow!("IMPORTER_IMAGE_SIZE: {e}"))?;
    let target = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&args.target)
        .with_context(|| format!("opening the volume {}", args.target.display()))?;
    let available = available_bytes(&target, &args.target, requested)?;
    let mut writer = SparseWriter::new(target.try_clone()?)?;
    let virtual_size = match args.source.as_str() {
        "blank" => {
            let size = requested.context("a blank volume needs IMPORTER_IMAGE_SIZE")?;
            writer.finish(size)?;
            size
        }
        "http" => http_import(args, &mut writer, available)?,
        "registry" => registry_import(args, &mut writer, available)?,
        "pvc" => clone_import(args, &mut writer, available)?,
        "s3" => s3_import(args, &mut writer, available)?,
        "upload" => upload_import(args, &mut writer, available)?,
        other => bail!(
            "source {other:?} is not served by this importer; accepted: http, s3, registry, blank, pvc, upload"
        ),
    };
    // A smaller image's volume grows to the size asked for (never shrinks), as CDI resizes.
    if let Some(size) = requested.filter(|s| *s > virtual_size) {
        if target.metadata()?.file_type().is_file() {
            target.set_len(size.min(available))?;
        }
    }
    PROGRESS.store(10_000, Ordering::Relaxed);
    tracing::info!(virtual_size, "import complete");
    Ok(())
}

/// The room the image may take: the size asked for, and no more than the volume holds.
fn available_bytes(target: &File, path: &Path, requested: Option<u64>) -> anyhow::Result<u64> {
    let meta = target.metadata()?;
    use std::os::unix::fs::FileTypeExt;
    let room = if meta.file_type().is_block_device() {
        let mut f = target;
        use std::io::Seek;
        f.seek(std::io::SeekFrom::End(0))?
    } else {
        let dir = path.parent().unwrap_or(Path::new("."));
        let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())?;
        // SAFETY: statvfs fills the struct we own from a NUL-terminated path.
        let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
            return Err(std::io::Error::last_os_error()).context("statvfs of the volume");
        }
        s.f_bavail * s.f_frsize + meta.len()
    };
    Ok(requested.map_or(room, |r| r.min(room)))
}

/// The https client: the certConfigMap's CAs trusted besides the system's.
fn http_client(args: &Args) -> anyhow::Result<reqwest::blocking::Client> {
    let mut client = reqwest::blocking::Client::builder()
        .connect_timeout(Duration::from_secs(30))
        // A large image takes as long as it takes; a failed Pod is retried by the kubelet.
        .timeout(None)
        .danger_accept_invalid_certs(args.insecure_tls);
    for (path, pem) in ca_pems(args)? {
        for cert in reqwest::Certificate::from_pem_bundle(&pem)
            .with_context(|| format!("CA certificates in {}", path.display()))?
        {
            client = client.add_root_certificate(cert);
        }
    }
    Ok(client.build()?)
}

/// The image at the endpoint, downloaded, checked and converted into the volume.
fn http_import(args: &Args, writer: &mut SparseWriter, available: u64) -> anyhow::Result<u64> {
    let url = args
        .endpoint
        .as_deref()
        .context("the http source needs IMPORTER_ENDPOINT")?;
    let client = http_client(args)?;
    let mut req = client.get(url);
    if let Some(user) = &args.access_key_id {
        req = req.basic_auth(user, args.secret_key.as_deref());
    }
    // secretExtraHeaders: every value of each Secret, given as variables of one prefix.
    let secret_headers: Vec<String> = std::env::vars()
        .filter(|(k, _)| k.starts_with(pod::ENV_SECRET_HEADER_PREFIX))
        .map(|(_, v)| v)
        .collect();
    for h in args
        .extra_headers
        .iter()
        .chain(&secret_headers)
        .filter(|h| !h.trim().is_empty())
    {
        let (name, value) = h
            .split_once(':')
            .with_context(|| format!("extra header {h:?}: expected `Name: value`"))?;
        req = req.header(name.trim(), value.trim());
    }
    download(args, req, url, writer, available)
}

/// An S3 object (`https://ENDPOINT/BUCKET/KEY`, or AWS's virtual-hosted form), fetched with
/// a request signed (AWS Signature V4) with the secretRef's keys, or unsigned for a public
/// object.
fn s3_import(args: &Args, writer: &mut SparseWriter, available: u64) -> anyhow::Result<u64> {
    let url = args
        .endpoint
        .as_deref()
        .context("the s3 source needs IMPORTER_ENDPOINT")?;
    let object = importer::s3::S3Object::parse(url)?;
    let client = http_client(args)?;
    let mut req = client.get(object.url());
    if let (Some(key), Some(secret)) = (&args.access_key_id, &args.secret_key) {
        for (name, value) in object.signed_headers(key, secret, std::time::SystemTime::now())? {
            req = req.header(name, value);
        }
    }
    download(args, req, url, writer, available)
}

/// Sends `req`; the body, counted for the progress and hashed if a checksum is given,
/// converted into the volume.
fn download(
    args: &Args,
    req: reqwest::blocking::RequestBuilder,
    url: &str,
    writer: &mut SparseWriter,
    available: u64,
) -> anyhow::Result<u64> {
    let resp = req.send().with_context(|| format!("GET {url}"))?;
    let status = resp.status();
    if !status.is_success() {
        return Err(ImportError::Source(format!("GET {url}: HTTP {status}")).into());
    }
    let total = resp.content_length();
    let counted = Progress::new(resp, total);
    let report = match args.checksum.as_deref().map(Checksum::parse).transpose()? {
        Some(sum) => {
            let mut digesting = sum.reader(counted);
            let r = import(&mut digesting, &args.scratch, writer, available)?;
            // Whatever the image's format stopped at, the whole download is hashed.
            std::io::copy(&mut digesting, &mut std::io::sink())?;
            digesting.verify()?;
            r
        }
        None => import(counted, &args.scratch, writer, available)?,
    };
    tracing::info!(?report.compression, ?report.format, written = report.written_bytes, "converted");
    Ok(report.virtual_size)
}

/// Upload mode (CDI's upload server): serves `POST /v1beta1/upload` on the Pod's IP, port
/// 8443, for the upload proxy; the body, once its token proves it is for this claim of this
/// namespace and not expired, is imported as any image. A request without a valid token is
/// refused and the server keeps waiting; a failed import ends the Pod (the kubelet restarts
/// it, the DataVolume shows why). By hand on tiny_http: one request at a time is all an upload
/// needs.
fn upload_import(args: &Args, writer: &mut SparseWriter, available: u64) -> anyhow::Result<u64> {
    use api::cdi::upload;
    let env = |k: &str| std::env::var(k).with_context(|| format!("upload mode needs {k}"));
    let key = env(upload::ENV_PUBLIC_KEY)?;
    let claim = env(upload::ENV_CLAIM)?;
    let namespace = env(upload::ENV_NAMESPACE)?;
    let decoding = jsonwebtoken::DecodingKey::from_ec_pem(key.as_bytes())
        .context("the upload token's public key")?;
    let ip = args
        .pod_ip
        .unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED));
    let server = tiny_http::Server::http((ip, pod::METRICS_PORT))
        .map_err(|e| anyhow::anyhow!("serving uploads on {ip}:{}: {e}", pod::METRICS_PORT))?;
    tracing::info!(%ip, claim, "waiting for the upload");
    loop {
        let mut req = server.recv()?;
        let path = req.url().split('?').next().unwrap_or_default().to_string();
        let method = req.method().clone();
        if path == "/healthz" || (method == tiny_http::Method::Head && path == upload::UPLOAD_PATH)
        {
            let _ = req.respond(tiny_http::Response::from_string("ok"));
            continue;
        }
        if method != tiny_http::Method::Post || path != upload::UPLOAD_PATH {
            let _ = req.respond(
                tiny_http::Response::from_string(format!("POST {} only", upload::UPLOAD_PATH))
                    .with_status_code(404),
            );
            continue;
        }
        let bearer = req
            .headers()
            .iter()
            .find(|h| h.field.equiv("Authorization"))
            .and_then(|h| h.value.as_str().strip_prefix("Bearer "))
            .map(str::to_string);
        let valid = bearer.and_then(|t| {
            let v = jsonwebtoken::Validation::new(jsonwebtoken::Algorithm::ES256);
            jsonwebtoken::decode::<upload::TokenClaims>(&t, &decoding, &v).ok()
        });
        match valid {
            Some(t) if t.claims.pvc == claim && t.claims.namespace == namespace => {}
            _ => {
                let _ = req.respond(
                    tiny_http::Response::from_string(
                        "the upload token is missing, expired or not for this claim",
                    )
                    .with_status_code(401),
                );
                continue;
            }
        }
        let total = req.body_length().map(|l| l as u64);
        let result = import(
            Progress::new(req.as_reader(), total),
            &args.scratch,
            writer,
            available,
        );
        return match result {
            Ok(report) => {
                let _ = req.respond(tiny_http::Response::from_string("uploaded"));
                Ok(report.virtual_size)
            }
            Err(e) => {
                let _ = req.respond(
                    tiny_http::Response::from_string(format!("Unable to process data: {e}"))
                        .with_status_code(400),
                );
                Err(e.into())
            }
        };
    }
}

/// Another claim's image (its `disk.img`, or its device), mounted read-only: copied sparsely,
/// converted if someone left a qcow2 there.
fn clone_import(args: &Args, writer: &mut SparseWriter, available: u64) -> anyhow::Result<u64> {
    let path = args
        .endpoint
        .as_deref()
        .context("the pvc source needs IMPORTER_ENDPOINT (the source claim's image)")?;
    let source = File::open(path)
        .map_err(ImportError::Read)
        .with_context(|| format!("opening the source claim's image {path}"))?;
    let total = source.metadata().ok().map(|m| m.len()).filter(|l| *l > 0);
    let report = import(
        Progress::new(source, total),
        &args.scratch,
        writer,
        available,
    )?;
    Ok(report.virtual_size)
}

/// The PEM files in the certConfigMap's directory.
fn ca_pems(args: &Args) -> anyhow::Result<Vec<(PathBuf, Vec<u8>)>> {
    let Some(dir) = &args.cert_dir else {
        return Ok(Vec::new());
    };
    let mut pems = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("{}", dir.display()))? {
        let path = entry?.path();
        if path.is_file() {
            pems.push((path.clone(), std::fs::read(&path)?));
        }
    }
    Ok(pems)
}

/// The disk image of a containerDisk in a registry, its layers verified by digest.
fn registry_import(args: &Args, writer: &mut SparseWriter, available: u64) -> anyhow::Result<u64> {
    let url = args
        .endpoint
        .as_deref()
        .context("the registry source needs IMPORTER_ENDPOINT")?;
    let access = importer::registry::RegistryAccess {
        credentials: args.access_key_id.clone().zip(args.secret_key.clone()),
        ca_pems: ca_pems(args)?.into_iter().map(|(_, pem)| pem).collect(),
        insecure: args.insecure_registries.clone(),
    };
    let layers = args.scratch.with_extension("layers");
    let result = importer::registry::disk_image(url, &access, &layers)
        .and_then(|disk| import(disk, &args.scratch, writer, available));
    let _ = std::fs::remove_dir_all(&layers);
    let report = result?;
    tracing::info!(?report.compression, ?report.format, written = report.written_bytes, "converted");
    Ok(report.virtual_size)
}

/// Bytes read so far of the download, logged as CDI reports progress, and a body cut short of
/// its Content-Length as an error rather than a smaller image.
struct Progress<R> {
    inner: R,
    done: u64,
    total: Option<u64>,
    logged: Instant,
}

impl<R> Progress<R> {
    fn new(inner: R, total: Option<u64>) -> Self {
        Progress {
            inner,
            done: 0,
            total,
            logged: Instant::now(),
        }
    }
}

impl<R: Read> Read for Progress<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf).map_err(|e| {
            let of = self.total.map(|t| format!(" of {t}")).unwrap_or_default();
            std::io::Error::new(
                e.kind(),
                format!("the download broke off after {}{of} bytes: {e}", self.done),
            )
        })?;
        self.done += n as u64;
        if n == 0 {
            if let Some(t) = self.total.filter(|t| self.done < *t) {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("the download ended after {} of {t} bytes", self.done),
                ));
            }
        }
        if let Some(t) = self.total.filter(|t| *t > 0) {
            PROGRESS.store(self.done * 10_000 / t, Ordering::Relaxed);
        }
        if self.logged.elapsed() >= Duration::from_secs(1) || n == 0 {
            self.logged = Instant::now();
            match self.total {
                Some(t) if t > 0 => {
                    tracing::info!("{:.2}%", self.done as f64 * 100.0 / t as f64)
                }
                _ => tracing::info!(bytes = self.done, "N/A"),
            }
        }
        Ok(n)
    }
}
