//! `cargo run --release -p bench --bin import-bench`: importing a disk image over loopback
//! HTTP, microvirt's `cdi-importer` against what CDI's importer runs (the download onto scratch
//! space with curl, then `qemu-img convert -O raw` into the volume), side by side in one run,
//! for a raw and a qcow2 image of BENCH_IMPORT_MIB (default 1024) MiB — two thirds data, one
//! third zeros, as disk images are. Both write the same sparse raw volume (checked once per
//! format). nginx (Debian's nginx-light) serves the images. Medians of BENCH_RUNS (default 3).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use bench::{env_or, median};

struct Nginx(Child);

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn run(cmd: &mut Command) -> Result<()> {
    let out = cmd.output().with_context(|| format!("{cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// `mib` MiB: 64 KiB chunks, every third one zeros, the rest incompressible.
fn write_raw(path: &Path, mib: u64) -> Result<()> {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut chunk = vec![0u8; 64 << 10];
    for i in 0..mib * 16 {
        if i % 3 == 1 {
            chunk.fill(0);
        } else {
            for w in chunk.chunks_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                w.copy_from_slice(&x.to_le_bytes());
            }
        }
        f.write_all(&chunk)?;
    }
    f.flush()?;
    Ok(())
}

fn nginx(dir: &Path, port: u16) -> Result<Nginx> {
    let d = dir.display();
    std::fs::create_dir_all(dir.join("tmp"))?;
    let user = if unsafe { libc::getuid() } == 0 {
        "user root;"
    } else {
        ""
    };
    std::fs::write(
        dir.join("nginx.conf"),
        format!(
            "daemon off; master_process off; pid {d}/nginx.pid; error_log {d}/error.log; {user}
             events {{}}
             http {{ access_log off; sendfile on;
               client_body_temp_path {d}/tmp; proxy_temp_path {d}/tmp; fastcgi_temp_path {d}/tmp;
               uwsgi_temp_path {d}/tmp; scgi_temp_path {d}/tmp;
               server {{ listen 127.0.0.1:{port}; root {d}/www; }} }}"
        ),
    )?;
    let child = Command::new("nginx")
        .args(["-e", &format!("{d}/error.log"), "-c"])
        .arg(dir.join("nginx.conf"))
        .spawn()
        .context("nginx (Debian's nginx-light)")?;
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            bail!("nginx did not listen");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    Ok(Nginx(child))
}

fn importer_path() -> Result<PathBuf> {
    run(Command::new(env!("CARGO"))
        .args([
            "build",
            "--release",
            "--quiet",
            "-p",
            "importer",
            "--bin",
            "cdi-importer",
        ])
        .current_dir(tests::repo_root()))?;
    Ok(tests::repo_root().join("target/release/cdi-importer"))
}

fn timed(cmd: &mut Command) -> Result<f64> {
    let t = Instant::now();
    run(cmd)?;
    Ok(t.elapsed().as_secs_f64())
}

fn main() -> Result<()> {
    let mib = env_or("BENCH_IMPORT_MIB", 1024);
    let runs = env_or("BENCH_RUNS", 3) as usize;
    let dir = std::env::temp_dir().join(format!("mv-import-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("www"))?;
    let importer = importer_path()?;
    write_raw(&dir.join("www/disk.raw"), mib)?;
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "qcow2"])
        .arg(dir.join("www/disk.raw"))
        .arg(dir.join("www/disk.qcow2")))?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let _server = nginx(&dir, port)?;
    let (ours, theirs, scratch) = (
        dir.join("ours.img"),
        dir.join("theirs.img"),
        dir.join("scratch"),
    );
    println!("import of a {mib} MiB image over loopback HTTP, median of {runs} runs");
    println!("| format | microvirt cdi-importer | curl + qemu-img convert (CDI's importer) | ratio (throughput) |");
    println!("| --- | --- | --- | --- |");
    for format in ["raw", "qcow2"] {
        let url = format!("http://127.0.0.1:{port}/disk.{format}");
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..runs {
            let _ = std::fs::remove_file(&ours);
            a.push(timed(
                Command::new(&importer)
                    .env("IMPORTER_ENDPOINT", &url)
                    .env("IMPORTER_TARGET", &ours)
                    .env("IMPORTER_SCRATCH", &scratch)
                    .env("RUST_LOG", "warn")
                    .stdout(Stdio::null()),
            )?);
            let _ = std::fs::remove_file(&theirs);
            let _ = std::fs::remove_file(&scratch);
            b.push(timed(Command::new("sh").args([
                "-ec",
                &format!(
                    "curl -sSf -o {s} {url}; qemu-img convert -t writeback -f {format} -O raw {s} {t}; rm -f {s}",
                    s = scratch.display(),
                    t = theirs.display()
                ),
            ]))?);
        }
        if std::fs::read(&ours)? != std::fs::read(&theirs)? {
            bail!("{format}: the two volumes differ");
        }
        let (ta, tb) = (median(a), median(b));
        let mibs = |t: f64| mib as f64 / t;
        println!(
            "| {format} | {ta:.2} s ({:.0} MiB/s) | {tb:.2} s ({:.0} MiB/s) | {:.2}× |",
            mibs(ta),
            mibs(tb),
            tb / ta
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
