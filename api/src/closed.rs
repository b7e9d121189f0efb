//! KubeVirt's closed sets of string values as enums, so code that acts on them matches
//! exhaustively instead of comparing literals. A value outside the set is kept as written
//! (`Other`): validation quotes it in its refusal, and a read-modify-write never changes it.
//! On the wire and in the CRD schema each stays a plain string.

macro_rules! closed_set {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
        #[serde(from = "String", into = "String")]
        pub enum $name {
            $($(#[$vm])* $variant,)+
            /// A value KubeVirt does not define.
            Other(String),
        }

        impl $name {
            /// Every value of the set, as KubeVirt spells it.
            pub const KNOWN: &'static [&'static str] = &[$($text),+];

            pub fn as_str(&self) -> &str {
                match self {
                    $(Self::$variant => $text,)+
                    Self::Other(s) => s,
                }
            }
        }

        impl From<String> for $name {
            fn from(s: String) -> Self {
                match s.as_str() {
                    $($text => Self::$variant,)+
                    _ => Self::Other(s),
                }
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                Self::from(s.to_string())
            }
        }

        impl From<$name> for String {
            fn from(v: $name) -> String {
                v.as_str().to_string()
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

closed_set! {
    /// `disks[].disk.bus`, `cdrom.bus`, `lun.bus`.
    DiskBus {
        Virtio = "virtio",
        Sata = "sata",
        Scsi = "scsi",
        Usb = "usb",
    }
}

closed_set! {
    /// `disks[].cache`: the host page cache's part in the disk's I/O.
    DiskCache {
        /// O_DIRECT: writes reach the device before they are acknowledged... by the device.
        None = "none",
        Writethrough = "writethrough",
        Writeback = "writeback",
    }
}

closed_set! {
    /// `interfaces[].model`: the NIC the guest sees.
    NicModel {
        Virtio = "virtio",
        E1000 = "e1000",
        E1000e = "e1000e",
        Igb = "igb",
        Rtl8139 = "rtl8139",
        Pcnet = "pcnet",
        Ne2kPci = "ne2k_pci",
    }
}

/// How an interface is bound to its network (`interfaces[].masquerade`, `.bridge`, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binding {
    Masquerade,
    Bridge,
    Sriov,
    Slirp,
    /// `binding: {name: ...}` (validation accepts only `vhostuser`).
    Plugin,
}

impl Binding {
    pub fn field(self) -> &'static str {
        match self {
            Binding::Masquerade => "masquerade",
            Binding::Bridge => "bridge",
            Binding::Sriov => "sriov",
            Binding::Slirp => "slirp",
            Binding::Plugin => "binding",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_as_strings_and_strangers_are_kept() {
        let v: Vec<DiskBus> = serde_json::from_str(r#"["virtio", "sata", "floppy"]"#).unwrap();
        assert_eq!(
            v,
            vec![
                DiskBus::Virtio,
                DiskBus::Sata,
                DiskBus::Other("floppy".into())
            ]
        );
        assert_eq!(
            serde_json::to_string(&v).unwrap(),
            r#"["virtio","sata","floppy"]"#
        );
        assert_eq!(DiskCache::from("none"), DiskCache::None);
        assert_eq!(NicModel::Ne2kPci.to_string(), "ne2k_pci");
        assert!(DiskCache::KNOWN.contains(&"writethrough"));
    }
}
