//! cloud-init seeds, attached to the guest as a small read-only disk holding a FAT file system
//! (built with the `fatfs` crate, without mounting anything), in either layout KubeVirt offers:
//! - NoCloud (`cloudInitNoCloud`): label `cidata`, `user-data`, `meta-data` and
//!   `network-config` at the root;
//! - ConfigDrive (`cloudInitConfigDrive`): label `config-2`, OpenStack's config drive v2 layout
//!   under `openstack/latest/` (`meta_data.json`, `user_data`, `network_data.json`), which is what
//!   cloud-init's ConfigDrive data source looks for (it accepts vfat as well as iso9660).

use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

/// Seed image size: FAT12 needs at least a few hundred KiB; user data is small.
const SEED_SIZE: u64 = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    NoCloud,
    ConfigDrive,
}

impl Layout {
    /// The file system label cloud-init finds the seed by.
    pub fn label(self) -> &'static str {
        match self {
            Layout::NoCloud => "cidata",
            Layout::ConfigDrive => "config-2",
        }
    }

    /// The KubeVirt volume source field.
    pub fn field(self) -> &'static str {
        match self {
            Layout::NoCloud => "cloudInitNoCloud",
            Layout::ConfigDrive => "cloudInitConfigDrive",
        }
    }
}

pub struct Seed<'a> {
    pub layout: Layout,
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
    let mut label = [b' '; 11];
    label[..seed.layout.label().len()].copy_from_slice(seed.layout.label().as_bytes());
    fatfs::format_volume(
        &mut f,
        fatfs::FormatVolumeOptions::new().volume_label(label),
    )?;
    f.seek(SeekFrom::Start(0))?;
    {
        let fs = fatfs::FileSystem::new(&mut f, fatfs::FsOptions::new())?;
        {
            let root = fs.root_dir();
            match seed.layout {
                Layout::NoCloud => {
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
                Layout::ConfigDrive => {
                    let dir = root.create_dir("openstack")?.create_dir("latest")?;
                    let meta = serde_json::json!({
                        "uuid": seed.instance_id,
                        "hostname": seed.hostname,
                        "name": seed.hostname,
                    });
                    dir.create_file("meta_data.json")?
                        .write_all(meta.to_string().as_bytes())?;
                    dir.create_file("user_data")?.write_all(seed.user_data)?;
                    if let Some(n) = seed.network_config {
                        dir.create_file("network_data.json")?.write_all(n)?;
                    }
                }
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
                layout: Layout::NoCloud,
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

    #[test]
    fn config_drive_holds_the_openstack_layout_under_the_config_2_label() {
        let p = std::env::temp_dir().join(format!("mv-configdrive-{}.img", std::process::id()));
        write_seed(
            &p,
            &Seed {
                layout: Layout::ConfigDrive,
                instance_id: "vm1",
                hostname: "web",
                user_data: b"#cloud-config\n",
                network_config: Some(br#"{"links": []}"#),
            },
        )
        .unwrap();
        let mut f = std::fs::File::open(&p).unwrap();
        let fs = fatfs::FileSystem::new(&mut f, fatfs::FsOptions::new()).unwrap();
        assert_eq!(fs.volume_label().trim_end(), "config-2");
        let read = |name: &str| {
            let mut s = String::new();
            fs.root_dir()
                .open_file(&format!("openstack/latest/{name}"))
                .unwrap()
                .read_to_string(&mut s)
                .unwrap();
            s
        };
        let meta: serde_json::Value = serde_json::from_str(&read("meta_data.json")).unwrap();
        assert_eq!(meta["uuid"], "vm1");
        assert_eq!(meta["hostname"], "web");
        assert_eq!(read("user_data"), "#cloud-config\n");
        assert_eq!(read("network_data.json"), r#"{"links": []}"#);
        assert!(fs.root_dir().open_file("user-data").is_err());
        drop(fs);
        std::fs::remove_file(p).unwrap();
    }
}
