//! The machine's state as one versioned value, the `Persist` trait each stateful object
//! implements next to its own code, and the state file that carries it.
//!
//! State file: `magic (8) | format version (u32 LE) | VMM version (u16 LE length + UTF-8) |
//! payload length (u64 LE) | payload (postcard) | CRC-32 of everything before it (u32 LE)`.
//! Guest memory is not in it: it goes to a separate, sparse memory file (see `memory.rs`).

pub mod files;
pub mod object;
pub mod vcpu;
pub mod vm;

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::{CacheMode, MacAddr};
use crate::devices::i8042::persist::I8042State;
use crate::devices::serial::persist::SerialStateDef;
use crate::devices::virtio::block::persist::BlockState;
use crate::devices::virtio::net::persist::NetState;
use crate::devices::virtio::persist::TransportState;
use crate::devices::virtio::rng::RngCounters;
use crate::memory::RegionLayout;
pub use files::{create_private, new_memory_seal, MemorySeal};
pub use object::Persist;
pub use vcpu::VcpuState;
pub use vm::KvmVmState;

pub const STATE_MAGIC: [u8; 8] = *b"MVRTSTAT";
/// Bumped whenever `MachineState`'s encoding or what it implies of the machine changes; a
/// restore refuses any other version. Format 4: every machine has ACPI tables and a VMGenID
/// device (a restore gives it a new generation ID, whatever the guest left in its memory).
pub const FORMAT_VERSION: u32 = 4;
pub const VMM_VERSION: &str = env!("CARGO_PKG_VERSION");
/// Far above any real state (a few KiB per vCPU): a length beyond it is corruption.
const MAX_PAYLOAD: u64 = 64 << 20;

/// Where a virtio-mmio device lives: recorded so a restored guest finds each device where its
/// drivers left it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotState {
    pub base: u64,
    pub irq: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskRecord {
    pub path: PathBuf,
    pub read_only: bool,
    pub serial: Option<String>,
    pub cache: CacheMode,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum VirtioKindState {
    Block {
        disk: DiskRecord,
        state: BlockState,
    },
    Net {
        /// The TAP's name when the VM opened it by name (a restore without a config reopens it).
        tap: Option<String>,
        mac: MacAddr,
        state: NetState,
    },
    /// A device a vhost-user backend serves: the transport holds its rings' positions (taken
    /// back from the backend before the save); the backend itself is the configuration's
    /// (a migration target's own socket).
    VhostUser {
        device_type: u32,
        /// A NIC's MAC (the frontend's, so the guest keeps it on another backend).
        mac: Option<MacAddr>,
    },
    Rng {
        state: RngCounters,
    },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VirtioDeviceState {
    pub id: String,
    pub slot: SlotState,
    pub transport: TransportState,
    pub kind: VirtioKindState,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DevicesState {
    #[serde(with = "SerialStateDef")]
    pub serial: vm_superio::serial::SerialState,
    pub i8042: I8042State,
    pub virtio: Vec<VirtioDeviceState>,
}

/// Everything but guest memory's contents.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MachineState {
    pub vcpus: u8,
    pub memory_mib: u64,
    /// The command line the guest booted with (devices' entries included), for the record.
    pub cmdline: String,
    pub memory: Vec<RegionLayout>,
    pub vm: KvmVmState,
    pub vcpu_states: Vec<VcpuState>,
    pub devices: DevicesState,
    /// A snapshot's memory file ends with this value after guest RAM (see `MemorySeal`):
    /// a restore refuses a memory file from another snapshot. `None` in a migration stream,
    /// which carries memory itself.
    pub memory_seal: Option<MemorySeal>,
}

#[derive(Debug, thiserror::Error)]
pub enum StateFileError {
    #[error("state file {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("state file {path}: not a microvirt state file (bad magic)")]
    Magic { path: String },
    #[error("state file {path}: format version {found} (written by microvirt {vmm}); this microvirt ({VMM_VERSION}) reads format version {FORMAT_VERSION} only")]
    Version {
        path: String,
        found: u32,
        vmm: String,
    },
    #[error("state file {path}: truncated ({len} bytes; the header says {expected})")]
    Truncated {
        path: String,
        len: u64,
        expected: u64,
    },
    #[error("state file {path}: checksum mismatch (the file is corrupted)")]
    Checksum { path: String },
    #[error("state file {path}: cannot decode the machine state: {reason}")]
    Decode { path: String, reason: String },
}

/// The two files of a snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotPaths {
    pub state: PathBuf,
    pub memory: PathBuf,
}

impl SnapshotPaths {
    /// `DIR/state` and `DIR/memory`, the layout `virt-launcher snapshot --to DIR` writes.
    pub fn in_dir(dir: &Path) -> SnapshotPaths {
        SnapshotPaths {
            state: dir.join("state"),
            memory: dir.join("memory"),
        }
    }
}

/// Encodes the state with header and checksum.
pub fn encode(state: &MachineState) -> Vec<u8> {
    let payload = postcard::to_stdvec(state).expect("machine state serializes");
    let mut out = Vec::with_capacity(payload.len() + 64);
    out.extend_from_slice(&STATE_MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(VMM_VERSION.len() as u16).to_le_bytes());
    out.extend_from_slice(VMM_VERSION.as_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&payload);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Checks header, length and checksum, then decodes. `path` names the file in errors.
pub fn decode(bytes: &[u8], path: &Path) -> Result<MachineState, StateFileError> {
    let p = path.display().to_string();
    let len = bytes.len() as u64;
    if bytes.len() < 8 || bytes[..8] != STATE_MAGIC {
        return Err(StateFileError::Magic { path: p });
    }
    let truncated = |expected: u64| StateFileError::Truncated {
        path: p.clone(),
        len,
        expected,
    };
    let rd = |at: usize, n: usize| {
        bytes
            .get(at..at + n)
            .ok_or_else(|| truncated(at as u64 + n as u64))
    };
    let version = u32::from_le_bytes(rd(8, 4)?.try_into().unwrap());
    let vlen = u16::from_le_bytes(rd(12, 2)?.try_into().unwrap()) as usize;
    let vmm = String::from_utf8_lossy(rd(14, vlen)?).into_owned();
    if version != FORMAT_VERSION {
        return Err(StateFileError::Version {
            path: p,
            found: version,
            vmm,
        });
    }
    let at = 14 + vlen;
    let plen = u64::from_le_bytes(rd(at, 8)?.try_into().unwrap());
    if plen > MAX_PAYLOAD {
        return Err(StateFileError::Checksum { path: p });
    }
    let expected = at as u64 + 8 + plen + 4;
    if len < expected {
        return Err(truncated(expected));
    }
    let body_end = at + 8 + plen as usize;
    let crc = u32::from_le_bytes(bytes[body_end..body_end + 4].try_into().unwrap());
    if crc32fast::hash(&bytes[..body_end]) != crc || len != expected {
        return Err(StateFileError::Checksum { path: p });
    }
    postcard::from_bytes(&bytes[at + 8..body_end]).map_err(|e| StateFileError::Decode {
        path: p,
        reason: e.to_string(),
    })
}

/// The temporary a snapshot file is written as before it is renamed into place: `path` with
/// `.tmp` appended, not its extension replaced, so a state and a memory file named alike
/// (`vm.state`, `vm.memory`) never share one.
pub fn temporary_of(path: &Path) -> std::path::PathBuf {
    let mut name = path.as_os_str().to_os_string();
    name.push(".tmp");
    name.into()
}

/// Writes the state file atomically: a temporary file, fsync, rename. A crash mid-write leaves
/// the previous snapshot (if any) intact.
pub fn write_state_file(path: &Path, state: &MachineState) -> Result<u64, StateFileError> {
    let n = write_state_file_uncommitted(path, state)?;
    commit_state_file(path)?;
    Ok(n)
}

/// The first half of `write_state_file`: the temporary beside `path`, written and synced.
pub fn write_state_file_uncommitted(
    path: &Path,
    state: &MachineState,
) -> Result<u64, StateFileError> {
    let err = |source| StateFileError::Io {
        path: path.display().to_string(),
        source,
    };
    let bytes = encode(state);
    let mut f = create_private(&temporary_of(path)).map_err(err)?;
    f.write_all(&bytes).map_err(err)?;
    f.sync_all().map_err(err)?;
    Ok(bytes.len() as u64)
}

/// The second half: the temporary renamed over `path`.
pub fn commit_state_file(path: &Path) -> Result<(), StateFileError> {
    std::fs::rename(temporary_of(path), path).map_err(|source| StateFileError::Io {
        path: path.display().to_string(),
        source,
    })
}

pub fn read_state_file(path: &Path) -> Result<MachineState, StateFileError> {
    let bytes = std::fs::read(path).map_err(|source| StateFileError::Io {
        path: path.display().to_string(),
        source,
    })?;
    decode(&bytes, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::persist::{QueueSnapshot, TransportState};
    use proptest::prelude::*;

    fn sample() -> MachineState {
        let vcpu = VcpuState {
            id: 0,
            cpuid: vec![Default::default(); 3],
            mp_state: Default::default(),
            regs: Default::default(),
            sregs: Default::default(),
            xsave: vec![7; 1024],
            xsave_extra: vec![],
            xcrs: Some(Default::default()),
            debug_regs: Default::default(),
            lapic: Default::default(),
            msrs: vec![Default::default(); 40],
            vcpu_events: Default::default(),
            tsc_khz: Some(2_000_000),
        };
        let q = QueueSnapshot(virtio_queue::QueueState {
            max_size: 256,
            next_avail: 3,
            next_used: 3,
            event_idx_enabled: false,
            size: 256,
            ready: true,
            desc_table: 0x1000,
            avail_ring: 0x2000,
            used_ring: 0x3000,
        });
        MachineState {
            vcpus: 1,
            memory_mib: 64,
            cmdline: "console=ttyS0".into(),
            memory: crate::memory::file_layout(&crate::layout::ram_regions(64 << 20)),
            vm: KvmVmState {
                pic_master: Default::default(),
                pic_slave: Default::default(),
                ioapic: Default::default(),
                pit: Default::default(),
                clock: Default::default(),
            },
            vcpu_states: vec![vcpu],
            devices: DevicesState {
                serial: vm_superio::serial::SerialState {
                    baud_divisor_low: 12,
                    baud_divisor_high: 0,
                    interrupt_enable: 0,
                    interrupt_identification: 1,
                    line_control: 3,
                    line_status: 0x60,
                    modem_control: 8,
                    modem_status: 0xb0,
                    scratch: 0,
                    in_buffer: b"x".to_vec(),
                },
                i8042: I8042State {
                    status: 4,
                    command_byte: 0x45,
                    out: vec![],
                    expect: crate::devices::i8042::Expect::KeyboardCommand,
                    last_read: 0,
                },
                virtio: vec![VirtioDeviceState {
                    id: "vda".into(),
                    slot: SlotState {
                        base: crate::layout::VIRTIO_MMIO_START,
                        irq: 5,
                    },
                    transport: TransportState {
                        queue_select: 0,
                        device_features_select: 1,
                        driver_features_select: 1,
                        driver_features: 1 << 32,
                        status: 15,
                        config_generation: 0,
                        interrupt_status: 1,
                        needs_reset: false,
                        queues: vec![q],
                        activated: Some(1 << 32),
                    },
                    kind: VirtioKindState::Block {
                        disk: DiskRecord {
                            path: "/d.img".into(),
                            read_only: false,
                            serial: None,
                            cache: CacheMode::Writeback,
                        },
                        state: BlockState {
                            counters: Default::default(),
                        },
                    },
                }],
            },
            memory_seal: Some([7; 16]),
        }
    }

    #[test]
    fn round_trips_and_fits_the_budget() {
        let bytes = encode(&sample());
        assert!(bytes.len() < 64 << 10, "{} bytes", bytes.len());
        let back = decode(&bytes, Path::new("s")).unwrap();
        assert_eq!(back.devices, sample().devices);
        assert_eq!(back.vcpu_states[0].xsave, vec![7; 1024]);
    }

    proptest! {
        /// A state file is input: any corruption is an error, never a panic or a wrong state.
        #[test]
        fn corrupted_files_are_refused(at in 0usize..4096, xor in 1u8..=255, cut in 0usize..4096) {
            let good = encode(&sample());
            let mut bad = good.clone();
            let i = at % bad.len();
            bad[i] ^= xor;
            prop_assert!(decode(&bad, Path::new("s")).is_err());
            let n = cut % good.len();
            prop_assert!(decode(&good[..n], Path::new("s")).is_err());
        }

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut b = STATE_MAGIC.to_vec();
            b.extend_from_slice(&bytes);
            let _ = decode(&b, Path::new("s"));
        }
    }
}
