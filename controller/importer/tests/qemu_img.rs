//! Conversions checked byte for byte against `qemu-img convert -O raw` (Debian's qemu-utils)
//! on the same images, which qemu-img itself makes: qcow2 v2 and v3, several cluster sizes,
//! deflate- and zstd-compressed clusters, zero clusters; raw and qcow2 inside gzip, xz and
//! zstd. Then what must be refused.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use importer::{import, Compression, Format, ImportError, SparseWriter};

struct Work(PathBuf);

impl Work {
    fn new(tag: &str) -> Work {
        let d = std::env::temp_dir().join(format!("mv-importer-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Work(d)
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn run(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// 6 MiB and three sectors: data (not compressible to nothing) with zero stretches between.
fn raw_image(path: &Path) {
    let len = 6 * 1024 * 1024 + 3 * 512;
    let mut b = vec![0u8; len];
    let mut x = 0x9e37_79b9u32;
    for (i, chunk) in b.chunks_mut(64 * 1024).enumerate() {
        if i % 3 == 1 {
            continue; // a zero stretch
        }
        for (k, v) in chunk.iter_mut().enumerate() {
            if k % 7 == 0 {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
            }
            *v = x as u8;
        }
    }
    std::fs::write(path, b).unwrap();
}

/// Imports `image` into `out` with `available` bytes of room.
fn import_file(
    w: &Work,
    image: &Path,
    out: &Path,
    available: u64,
) -> Result<importer::ImportReport, ImportError> {
    let target = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(out)
        .unwrap();
    let mut writer = SparseWriter::new(target)?;
    import(
        File::open(image).unwrap(),
        &w.path("scratch"),
        &mut writer,
        available,
    )
}

fn assert_same_as_qemu_img(w: &Work, image: &Path, expect: (Compression, Format)) {
    let ours = w.path("ours.raw");
    let theirs = w.path("theirs.raw");
    let report = import_file(w, image, &ours, 1 << 30).unwrap();
    assert_eq!((report.compression, report.format), expect, "{image:?}");
    // qemu-img reads the compressed wrappers only through our decompression: give it the
    // decompressed image.
    let plain = match expect.0 {
        Compression::None => image.to_path_buf(),
        c => {
            let p = w.path("plain");
            let tool = match c {
                Compression::Gzip => "gzip",
                Compression::Xz => "xz",
                _ => "zstd",
            };
            let out = Command::new(tool)
                .args(["-dc"])
                .arg(image)
                .output()
                .unwrap();
            std::fs::write(&p, out.stdout).unwrap();
            p
        }
    };
    let fmt = if expect.1 == Format::Qcow2 {
        "qcow2"
    } else {
        "raw"
    };
    run(
        "qemu-img",
        &[
            "convert",
            "-f",
            fmt,
            "-O",
            "raw",
            plain.to_str().unwrap(),
            theirs.to_str().unwrap(),
        ],
    );
    let (a, b) = (
        std::fs::read(&ours).unwrap(),
        std::fs::read(&theirs).unwrap(),
    );
    assert_eq!(a.len(), b.len(), "{image:?}: virtual size");
    assert!(a == b, "{image:?}: contents differ from qemu-img's");
    assert_eq!(report.virtual_size, a.len() as u64);
    // Sparse: the zero stretches (a third of the image) are holes.
    let m = std::fs::metadata(&ours).unwrap();
    assert!(
        m.blocks() * 512 < m.len() * 3 / 4,
        "{image:?}: {} bytes allocated of {}",
        m.blocks() * 512,
        m.len()
    );
    assert!(report.written_bytes < m.len() * 3 / 4);
}

#[test]
fn qcow2_images_convert_as_qemu_img_converts_them() {
    let w = Work::new("qcow2");
    let raw = w.path("disk.raw");
    raw_image(&raw);
    let r = raw.to_str().unwrap();
    assert_same_as_qemu_img(&w, &raw, (Compression::None, Format::Raw));
    let variants: &[(&str, &[&str])] = &[
        ("v3.qcow2", &[]),
        ("v2.qcow2", &["-o", "compat=0.10"]),
        ("c4k.qcow2", &["-o", "cluster_size=4096"]),
        ("c2m.qcow2", &["-o", "cluster_size=2M"]),
        ("c512.qcow2", &["-o", "cluster_size=512"]),
        ("deflate.qcow2", &["-c"]),
        ("deflate-v2.qcow2", &["-c", "-o", "compat=0.10"]),
        ("zstd.qcow2", &["-c", "-o", "compression_type=zstd"]),
    ];
    for (name, opts) in variants {
        let img = w.path(name);
        let mut args = vec!["convert", "-f", "raw", "-O", "qcow2"];
        args.extend_from_slice(opts);
        args.extend_from_slice(&[r, img.to_str().unwrap()]);
        run("qemu-img", &args);
        assert_same_as_qemu_img(&w, &img, (Compression::None, Format::Qcow2));
    }
    // Zero clusters (version 3's flag) over data, and a bigger virtual size than data.
    let z = w.path("zero.qcow2");
    std::fs::copy(w.path("v3.qcow2"), &z).unwrap();
    run(
        "qemu-io",
        &[
            "-f",
            "qcow2",
            "-c",
            "write -z 0 1M",
            "-c",
            "write -z 2M 192k",
            z.to_str().unwrap(),
        ],
    );
    run(
        "qemu-img",
        &["resize", "-f", "qcow2", z.to_str().unwrap(), "9M"],
    );
    assert_same_as_qemu_img(&w, &z, (Compression::None, Format::Qcow2));
}

#[test]
fn compressed_downloads_are_decompressed_first() {
    let w = Work::new("wrapped");
    let raw = w.path("disk.raw");
    raw_image(&raw);
    let q = qcow2_of(&w, &raw);
    for (src, format) in [(&raw, Format::Raw), (&q, Format::Qcow2)] {
        for (tool, ext, c) in [
            ("gzip", "gz", Compression::Gzip),
            ("xz", "xz", Compression::Xz),
            ("zstd", "zst", Compression::Zstd),
        ] {
            let out = Command::new(tool).args(["-c"]).arg(src).output().unwrap();
            let p = w.path(&format!("image.{ext}"));
            std::fs::write(&p, out.stdout).unwrap();
            assert_same_as_qemu_img(&w, &p, (c, format));
        }
    }
}

/// `raw` as a default qcow2 image (version 3, 64 KiB clusters), made by qemu-img.
fn qcow2_of(w: &Work, raw: &Path) -> PathBuf {
    let q = w.path("disk.qcow2");
    let (r, o) = (raw.to_str().unwrap(), q.to_str().unwrap());
    run("qemu-img", &["convert", "-f", "raw", "-O", "qcow2", r, o]);
    q
}

fn refusal(w: &Work, image: &Path, available: u64) -> String {
    let e = import_file(w, image, &w.path("out.raw"), available).unwrap_err();
    e.to_string()
}

#[test]
fn images_that_cannot_be_imported_are_refused_with_the_reason() {
    let w = Work::new("bad");
    let raw = w.path("disk.raw");
    raw_image(&raw);
    let r = raw.to_str().unwrap();
    let q = qcow2_of(&w, &raw);

    // A backing file names a path on the importer's host.
    let over = w.path("over.qcow2");
    run(
        "qemu-img",
        &[
            "create",
            "-f",
            "qcow2",
            "-b",
            q.to_str().unwrap(),
            "-F",
            "qcow2",
            over.to_str().unwrap(),
        ],
    );
    assert!(refusal(&w, &over, 1 << 30).contains("backing file"));

    // Larger than the claim: CDI's words, for raw and qcow2.
    let small = 4 << 20;
    let e = refusal(&w, &q, small);
    assert!(e.starts_with("Virtual image size 6292992 is larger than the reported available storage 4194304. A larger PVC is required."), "{e}");
    assert!(refusal(&w, &raw, small).contains("A larger PVC is required"));

    // Cut short: the tables point past the end.
    let cut = w.path("cut.qcow2");
    let bytes = std::fs::read(&q).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let e = refusal(&w, &cut, 1 << 30);
    assert!(e.contains("outside the"), "{e}");

    // Formats CDI converts with qemu-img that this importer does not: named.
    let vmdk = w.path("disk.vmdk");
    run(
        "qemu-img",
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "vmdk",
            r,
            vmdk.to_str().unwrap(),
        ],
    );
    let e = refusal(&w, &vmdk, 1 << 30);
    assert!(e.contains("VMDK") && e.contains("accepted: raw"), "{e}");

    // A download cut half-way through its compression.
    let gz = w.path("disk.raw.gz");
    let out = Command::new("gzip").args(["-c", r]).output().unwrap();
    std::fs::write(&gz, &out.stdout[..out.stdout.len() / 2]).unwrap();
    let e = refusal(&w, &gz, 1 << 30);
    assert!(e.starts_with("reading the image"), "{e}");

    // Marked corrupt, external data file, unknown features: the header's bits.
    for (bit, words) in [
        (1u64 << 1, "corrupt"),
        (1 << 2, "external file"),
        (1 << 40, "unknown incompatible"),
    ] {
        let mut b = bytes.clone();
        let v = u64::from_be_bytes(b[72..80].try_into().unwrap()) | bit;
        b[72..80].copy_from_slice(&v.to_be_bytes());
        let p = w.path("bits.qcow2");
        std::fs::write(&p, b).unwrap();
        let e = refusal(&w, &p, 1 << 30);
        assert!(e.contains(words), "{e}");
    }
}
