//! The cloud-init NoCloud seed: a small FAT file system labelled `cidata` holding `user-data`,
//! `meta-data` and `network-config`, attached to the guest as a read-only disk. Built with the
//! `fatfs` crate, without mounting anything.

use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

/// Seed image size: FAT12 needs at least a few hundred KiB; user data is small.
const SEED_SIZE: u64 = 1 << 20;

pub struct Seed<'a> {
    pub instance_id: &'a str,
    pub hostname: &'a str,
    pub user_data: &'a [u8],
    pub network_config: Option<&'a [u8]>,
}

pub fn write_seed(path: &Path, seed: &Seed) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    f.set_len(SEED_SIZE)?;
    fatfs::format_volume(
        &mut f,
        fatfs::FormatVolumeOptions::new().volume_label(*b"cidata     "),
    )?;
    f.seek(SeekFrom::Start(0))?;
    {
        let fs = fatfs::FileSystem::new(&mut f, fatfs::FsOptions::new())?;
        {
            let root = fs.root_dir();
            let meta = format!(
                "instance-id: {}\nlocal-hostname: {}\n",
                seed.instance_id, seed.hostname
            );
            root.create_file("meta-data")?.write_all(meta.as_bytes())?;
            root.create_file("user-data")?.write_all(seed.user_data)?;
            if let Some(n) = seed.network_config {
                root.create_file("network-config")?.write_all(n)?;
            }
        }
        fs.unmount()?;
    }
    f.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn seed_holds_the_nocloud_files_under_the_cidata_label() {
        let p = std::env::temp_dir().join(format!("mv-seed-{}.img", std::process::id()));
        write_seed(
            &p,
            &Seed {
                instance_id: "vm1",
                hostname: "vm1",
                user_data: b"#cloud-config\n",
                network_config: Some(b"version: 2\n"),
            },
        )
        .unwrap();
        let mut f = std::fs::File::open(&p).unwrap();
        let fs = fatfs::FileSystem::new(&mut f, fatfs::FsOptions::new()).unwrap();
        assert_eq!(fs.volume_label().trim_end(), "cidata");
        let mut s = String::new();
        fs.root_dir()
            .open_file("meta-data")
            .unwrap()
            .read_to_string(&mut s)
            .unwrap();
        assert_eq!(s, "instance-id: vm1\nlocal-hostname: vm1\n");
        s.clear();
        fs.root_dir()
            .open_file("user-data")
            .unwrap()
            .read_to_string(&mut s)
            .unwrap();
        assert_eq!(s, "#cloud-config\n");
        s.clear();
        fs.root_dir()
            .open_file("network-config")
            .unwrap()
            .read_to_string(&mut s)
            .unwrap();
        assert_eq!(s, "version: 2\n");
        drop(fs);
        std::fs::remove_file(p).unwrap();
    }
}
