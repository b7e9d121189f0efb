//! Seccomp filters per VMM thread kind, built with `seccompiler` (the rust-vmm crate Firecracker
//! uses) and installed by each thread on itself before it does anything the guest can drive: a
//! vCPU thread before its first KVM_RUN, the device thread before its first event; and the
//! launcher daemon's control filter, installed on its first thread and inherited by all.
//!
//! Each filter allows what that thread was seen to call (strace of the probe, block, net,
//! snapshot and migration tests; allocator and thread start/exit calls included), `ioctl` only
//! with listed request numbers (a vCPU thread: its own KVM requests and TUN's; the device
//! thread: TUN's) or, on control threads, of listed request types. Anything else is **trapped**: the
//! SIGSYS handler writes one line naming the thread and the syscall number, and the process
//! exits with `EXIT_SECCOMP`. A trap rather than SECCOMP_RET_KILL_PROCESS because the kill
//! action leaves only an audit record, which a Pod's log never shows; the handler makes the
//! denial visible where the VM's user looks.

use std::cell::Cell;
use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// The exit status when a filter denies a call (31 is SIGSYS).
pub const EXIT_SECCOMP: i32 = 31;

/// Which filter a thread gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThreadKind {
    Vcpu(u8),
    /// The device event loop (virtio queues, serial input, TAP and disk I/O).
    Devices,
    /// The launcher daemon's own threads (control connections, which build VMs, snapshots,
    /// migration senders and receivers, DHCP, watchers), installed once on its first thread
    /// and inherited by every later one, the vCPU and device threads included (their own
    /// allow-lists stack on top).
    Control,
}

thread_local! {
    /// What this thread is, for the SIGSYS handler (plain data: safe to read in a handler).
    static KIND: Cell<Option<ThreadKind>> = const { Cell::new(None) };
}

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("building the {0:?} filter: {1}")]
    Build(ThreadKind, String),
    #[error("installing the {0:?} filter: {1}")]
    Install(ThreadKind, String),
}

/// Calls every thread makes: memory (the allocator), locks, signals, its own start and exit,
/// time, logging to stderr.
const COMMON: &[i64] = &[
    libc::SYS_futex,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_madvise,
    libc::SYS_mprotect,
    libc::SYS_brk,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigprocmask,
    libc::SYS_sigaltstack,
    libc::SYS_restart_syscall,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_gettid,
    libc::SYS_getpid,
    libc::SYS_tgkill,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_getrandom,
    libc::SYS_write,
    libc::SYS_writev,
    libc::SYS_close,
    libc::SYS_fcntl,
    libc::SYS_exit,
    libc::SYS_exit_group,
];

/// A vCPU thread: KVM_RUN and the device emulation it does on exits (register writes that kick
/// the event loop through eventfds, console output, TAP offload setup on activation). No
/// socket sends: console clients are fed by the launcher's drain thread, never by a vCPU.
const VCPU: &[i64] = &[libc::SYS_ioctl];

/// The device thread: the queues' disk and TAP I/O, eventfds, epoll.
const DEVICES: &[i64] = &[
    libc::SYS_ioctl,
    libc::SYS_read,
    libc::SYS_readv,
    libc::SYS_pread64,
    libc::SYS_preadv,
    libc::SYS_pwrite64,
    libc::SYS_pwritev,
    libc::SYS_fdatasync,
    libc::SYS_fsync,
    libc::SYS_fallocate,
    libc::SYS_lseek,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_ctl,
    libc::SYS_sendto,
    libc::SYS_sendmsg,
    libc::SYS_recvfrom,
    libc::SYS_recvmsg,
];

/// The control threads (and, as the filter is inherited, every thread of the daemon): what the
/// daemon was seen to call building, running, snapshotting and migrating VMs (strace of the
/// launcher's daemon, snapshot and migration tests and of the virt-handler tests, which drive
/// daemons through the network hand-over, DHCP and mutual-TLS migrations), plus the file,
/// socket and thread calls the same code makes on paths those tests do not take (creating
/// and truncating images, directories, polling). Not in it, so trapped: running programs,
/// fork, tracing or reading other processes, mounts and namespaces, modules and kexec, BPF and
/// perf, keyrings, raw port I/O, changing identity, the clock or the host's name, mknod.
/// (capset stays: the vCPU and device threads drop their capabilities with it; without
/// capabilities it cannot gain any.)
const CONTROL: &[i64] = &[
    // Besides the vCPU and device lists (chained in): files and images.
    libc::SYS_open,
    libc::SYS_openat,
    // Manifest paths resolved without leaving the image and volume directories.
    libc::SYS_openat2,
    libc::SYS_close_range,
    libc::SYS_stat,
    libc::SYS_fstat,
    libc::SYS_lstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_statfs,
    libc::SYS_fstatfs,
    libc::SYS_access,
    libc::SYS_faccessat,
    libc::SYS_faccessat2,
    libc::SYS_readlink,
    libc::SYS_readlinkat,
    libc::SYS_getdents64,
    libc::SYS_getcwd,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_rmdir,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_ftruncate,
    libc::SYS_sync_file_range,
    libc::SYS_fchmod,
    libc::SYS_fchown,
    libc::SYS_umask,
    libc::SYS_flock,
    libc::SYS_dup,
    libc::SYS_dup2,
    libc::SYS_dup3,
    libc::SYS_pipe2,
    libc::SYS_memfd_create,
    libc::SYS_msync,
    libc::SYS_mincore,
    // Sockets: the control socket, descriptors over SCM_RIGHTS, migration streams, DHCP.
    libc::SYS_socket,
    libc::SYS_socketpair,
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_connect,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_setsockopt,
    libc::SYS_getsockopt,
    libc::SYS_sendmmsg,
    libc::SYS_recvmmsg,
    libc::SYS_shutdown,
    // Waiting and events.
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_select,
    libc::SYS_pselect6,
    libc::SYS_epoll_create1,
    libc::SYS_eventfd2,
    libc::SYS_timerfd_create,
    libc::SYS_timerfd_settime,
    libc::SYS_rt_sigtimedwait,
    libc::SYS_rt_sigaction,
    // Threads and the process itself.
    libc::SYS_clone,
    libc::SYS_clone3,
    libc::SYS_set_robust_list,
    libc::SYS_get_robust_list,
    libc::SYS_rseq,
    libc::SYS_set_tid_address,
    libc::SYS_arch_prctl,
    libc::SYS_prctl,
    libc::SYS_prlimit64,
    libc::SYS_getrlimit,
    libc::SYS_capget,
    libc::SYS_capset,
    libc::SYS_seccomp,
    libc::SYS_sched_setaffinity,
    libc::SYS_getuid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getegid,
    libc::SYS_getppid,
    libc::SYS_uname,
    libc::SYS_sysinfo,
    libc::SYS_clock_getres,
    libc::SYS_gettimeofday,
    libc::SYS_membarrier,
];

/// Escapes no daemon thread may make: none of them is in any allow-list (checked by a test).
#[cfg(test)]
const ESCAPES: &[i64] = &[
    libc::SYS_execve,
    libc::SYS_execveat,
    libc::SYS_fork,
    libc::SYS_vfork,
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_pidfd_getfd,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_chroot,
    libc::SYS_setns,
    libc::SYS_unshare,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_kexec_load,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_keyctl,
    libc::SYS_iopl,
    libc::SYS_ioperm,
    libc::SYS_setuid,
    libc::SYS_setresuid,
    libc::SYS_setgroups,
    libc::SYS_mknod,
    libc::SYS_mknodat,
    libc::SYS_userfaultfd,
    libc::SYS_reboot,
];

/// ioctl request types (bits 8..16 of the request) the control threads may use: KVM's (0xAE),
/// TUN's (0x54, 'T', of which only `tun_requests` and `terminal_requests`), block devices (0x12, BLKGETSIZE64 for a raw PVC), vhost
/// (0xAF) and socket interface queries (0x89).
const CONTROL_IOCTL_TYPES: &[u64] = &[0xAE, 0x54, 0x12, 0xAF, 0x89];

// The KVM requests (type 0xAE) a vCPU thread makes, by number (computed from the kvm-bindings
// structures, as the kernel's _IO/_IOR/_IOW macros do): KVM_RUN, the registers and state it
// reads and writes for a snapshot, a migration or a restore (CPUID included), and the identity
// (CPUID, TSC rate) a restore sets. Nothing else of KVM's: not the VM-level requests that change the guest's
// memory map, its interrupt wiring or its devices, nor any request on /dev/kvm.
mod vcpu_requests {
    use kvm_bindings::{
        kvm_cpuid2, kvm_debugregs, kvm_lapic_state, kvm_mp_state, kvm_msrs, kvm_regs, kvm_sregs,
        kvm_vcpu_events, kvm_xcrs, kvm_xsave, KVMIO,
    };
    vmm_sys_util::ioctl_io_nr!(KVM_RUN, KVMIO, 0x80);
    vmm_sys_util::ioctl_ior_nr!(KVM_GET_REGS, KVMIO, 0x81, kvm_regs);
    vmm_sys_util::ioctl_iow_nr!(KVM_SET_REGS, KVMIO, 0x82, kvm_regs);
    vmm_sys_util::ioctl_ior_nr!(KVM_GET_SREGS, KVMIO, 0x83, kvm_sregs);
    vmm_sys_util::ioctl_iow_nr!(KVM_SET_SREGS, KVMIO, 0x84, kvm_sregs);
    vmm_sys_util::ioctl_iowr_nr!(KVM_GET_MSRS, KVMIO, 0x88, kvm_msrs);
    vmm_sys_util::ioctl_iow_nr!(KVM_SET_MSRS, KVMIO, 0x89, kvm_msrs);
    vmm_sys_util::ioctl_ior_nr!(KVM_GET_LAPIC, KVMIO, 0x8e, kvm_lapic_state);
    vmm_sys_util::ioctl_iow_nr!(KVM_SET_LAPIC, KVMIO, 0x8f, kvm_lapic_state);
    vmm_sys_util::ioctl_iow_nr!(KVM_SET_CPUID2, KVMIO, 0x90, kvm_cpuid2);
    vmm_sys_util::ioctl_iowr_nr!(KVM_GET_CPUID2, KVMIO, 0x91, kvm_cpuid2);
    vmm_sys_util::ioctl_ior_nr!(KVM_GET_MP_STATE, KVMIO, 0x98, kvm_mp_state);
    vmm_sys_util::ioctl_iow_nr!(KVM_SET_MP_STATE, KVMIO, 0x99, kvm_mp_state);
    vmm_sys_util::ioctl_ior_nr!(KVM_GET_VCPU_EVENTS, KVMIO, 0x9f, kvm_vcpu_events);
    vmm_sys_util::ioctl_iow_nr!(KVM_SET_VCPU_EVENTS, KVMIO, 0xa0, kvm_vcpu_events);
    vmm_sys_util::ioctl_ior_nr!(KVM_GET_DEBUGREGS, KVMIO, 0xa1, kvm_debugregs);
    vmm_sys_util::ioctl_iow_nr!(KVM_SET_DEBUGREGS, KVMIO, 0xa2, kvm_debugregs);
    vmm_sys_util::ioctl_io_nr!(KVM_SET_TSC_KHZ, KVMIO, 0xa2);
    vmm_sys_util::ioctl_io_nr!(KVM_GET_TSC_KHZ, KVMIO, 0xa3);
    vmm_sys_util::ioctl_ior_nr!(KVM_GET_XSAVE, KVMIO, 0xa4, kvm_xsave);
    vmm_sys_util::ioctl_iow_nr!(KVM_SET_XSAVE, KVMIO, 0xa5, kvm_xsave);
    vmm_sys_util::ioctl_ior_nr!(KVM_GET_XCRS, KVMIO, 0xa6, kvm_xcrs);
    vmm_sys_util::ioctl_iow_nr!(KVM_SET_XCRS, KVMIO, 0xa7, kvm_xcrs);
    vmm_sys_util::ioctl_ior_nr!(KVM_GET_XSAVE2, KVMIO, 0xcf, kvm_xsave);
    // Not allowed; the debug hook makes it to see the filter trap it.
    #[cfg(debug_assertions)]
    vmm_sys_util::ioctl_iow_nr!(
        KVM_SET_USER_MEMORY_REGION,
        KVMIO,
        0x46,
        kvm_bindings::kvm_userspace_memory_region
    );

    pub fn allowed() -> [u64; 24] {
        [
            KVM_RUN(),
            KVM_GET_REGS(),
            KVM_SET_REGS(),
            KVM_GET_SREGS(),
            KVM_SET_SREGS(),
            KVM_GET_MSRS(),
            KVM_SET_MSRS(),
            KVM_GET_LAPIC(),
            KVM_SET_LAPIC(),
            KVM_SET_CPUID2(),
            KVM_GET_CPUID2(),
            KVM_GET_MP_STATE(),
            KVM_SET_MP_STATE(),
            KVM_GET_VCPU_EVENTS(),
            KVM_SET_VCPU_EVENTS(),
            KVM_GET_DEBUGREGS(),
            KVM_SET_DEBUGREGS(),
            KVM_SET_TSC_KHZ(),
            KVM_GET_TSC_KHZ(),
            KVM_GET_XSAVE(),
            KVM_SET_XSAVE(),
            KVM_GET_XCRS(),
            KVM_SET_XCRS(),
            KVM_GET_XSAVE2(),
        ]
        .map(u64::from)
    }

    #[cfg(debug_assertions)]
    pub fn set_user_memory_region() -> u64 {
        KVM_SET_USER_MEMORY_REGION()
    }
}

/// The requests of type 0x54 ('T') microvirt makes: TUN's, and the generic descriptor ones
/// std issues (FIONBIO for non-blocking sockets and timeouts on connect, FIONREAD, FIOCLEX /
/// FIONCLEX). The type is the terminals' too: TIOCSTI (0x5412) would let a thread type into a
/// terminal it holds. Only these numbers pass.
fn tun_requests() -> [u64; 8] {
    use crate::devices::virtio::net::tap::{TUNGETIFF, TUNSETIFF, TUNSETOFFLOAD, TUNSETVNETHDRSZ};
    [
        TUNSETIFF,
        TUNGETIFF,
        TUNSETOFFLOAD,
        TUNSETVNETHDRSZ,
        libc::FIONBIO,
        libc::FIONREAD,
        libc::FIOCLEX,
        libc::FIONCLEX,
    ]
}

/// The terminal requests a standalone `virt-launcher run` makes on its own terminal (is it one,
/// raw mode on and off, its size). Not TIOCSTI or any other request that puts input into a
/// terminal or takes one over.
fn terminal_requests() -> [u64; 5] {
    [
        libc::TCGETS,
        libc::TCSETS,
        libc::TCSETSW,
        libc::TCSETSF,
        libc::TIOCGWINSZ,
    ]
}

/// Namespace flags no launcher thread may pass to clone.
const CLONE_NAMESPACES: u64 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWCGROUP) as u64;

/// clone only makes threads: CLONE_THREAD set, no namespace flag (so no fork and no new
/// namespace through it). clone3 takes its flags in memory, which seccomp cannot read; it is
/// answered ENOSYS by a second filter (`install`), and libc falls back to clone.
fn clone_rules() -> Result<Vec<SeccompRule>, String> {
    let thread = libc::CLONE_THREAD as u64;
    Ok(vec![SeccompRule::new(vec![
        SeccompCondition::new(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(thread),
            thread,
        )
        .map_err(|e| e.to_string())?,
        SeccompCondition::new(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(CLONE_NAMESPACES),
            0,
        )
        .map_err(|e| e.to_string())?,
    ])
    .map_err(|e| e.to_string())?])
}

/// The filter stacked under every thread's own: clone3 gets ENOSYS (the stricter action of
/// stacked filters wins, and the thread's own filter allows clone3 so that this one decides).
fn clone3_filter() -> Result<BpfProgram, String> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    rules.insert(libc::SYS_clone3, vec![]);
    let f = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        TargetArch::x86_64,
    )
    .map_err(|e| e.to_string())?;
    f.try_into()
        .map_err(|e: seccompiler::BackendError| e.to_string())
}

/// A rule: the ioctl request (argument 1) is `nr`.
fn request_is(nr: u64) -> Result<SeccompRule, String> {
    SeccompRule::new(vec![SeccompCondition::new(
        1,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::Eq,
        nr,
    )
    .map_err(|e| e.to_string())?])
    .map_err(|e| e.to_string())
}

/// The ioctl requests `kind` may make. Every thread: TUN's (`tun_requests`). A vCPU thread:
/// its own KVM requests, each by number (`vcpu_requests`). The device thread: no KVM request
/// (it signals interrupts and is kicked through eventfds). The control threads: the terminal
/// requests and every request of `CONTROL_IOCTL_TYPES` (they build the VM).
fn ioctl_rules(kind: ThreadKind) -> Result<Vec<SeccompRule>, String> {
    let mut rules: Vec<SeccompRule> = tun_requests()
        .into_iter()
        .map(request_is)
        .collect::<Result<_, _>>()?;
    match kind {
        ThreadKind::Vcpu(_) => {
            for nr in vcpu_requests::allowed() {
                rules.push(request_is(nr)?);
            }
        }
        ThreadKind::Devices => {}
        ThreadKind::Control => {
            for nr in terminal_requests() {
                rules.push(request_is(nr)?);
            }
            for &t in CONTROL_IOCTL_TYPES.iter().filter(|&&t| t != 0x54) {
                rules.push(
                    SeccompRule::new(vec![SeccompCondition::new(
                        1,
                        SeccompCmpArgLen::Dword,
                        SeccompCmpOp::MaskedEq(0xff00),
                        t << 8,
                    )
                    .map_err(|e| e.to_string())?])
                    .map_err(|e| e.to_string())?,
                );
            }
        }
    }
    Ok(rules)
}

/// The BPF program of `kind`.
pub fn filter(kind: ThreadKind) -> Result<BpfProgram, SeccompError> {
    let build = |e: String| SeccompError::Build(kind, e);
    let own: &[&[i64]] = match kind {
        ThreadKind::Vcpu(_) => &[VCPU],
        ThreadKind::Devices => &[DEVICES],
        // Every thread of the daemon inherits it, so it covers the others' calls too.
        ThreadKind::Control => &[CONTROL, VCPU, DEVICES],
    };
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for &nr in COMMON.iter().chain(own.iter().flat_map(|l| l.iter())) {
        let r = if nr == libc::SYS_ioctl {
            ioctl_rules(kind).map_err(build)?
        } else if nr == libc::SYS_clone {
            clone_rules().map_err(build)?
        } else {
            vec![]
        };
        rules.insert(nr, r);
    }
    let f = SeccompFilter::new(
        rules,
        SeccompAction::Trap,
        SeccompAction::Allow,
        TargetArch::x86_64,
    )
    .map_err(|e| build(e.to_string()))?;
    f.try_into()
        .map_err(|e: seccompiler::BackendError| build(e.to_string()))
}

/// Installs `kind`'s filter on the calling thread (and PR_SET_NO_NEW_PRIVS, which seccomp
/// needs), after the SIGSYS handler.
pub fn install(kind: ThreadKind) -> Result<(), SeccompError> {
    install_sigsys_handler().map_err(|e| SeccompError::Install(kind, e.to_string()))?;
    keep_freed_heap();
    let bpf = filter(kind)?;
    let clone3 = clone3_filter().map_err(|e| SeccompError::Build(kind, e))?;
    KIND.with(|k| k.set(Some(kind)));
    seccompiler::apply_filter(&clone3).map_err(|e| SeccompError::Install(kind, e.to_string()))?;
    seccompiler::apply_filter(&bpf).map_err(|e| SeccompError::Install(kind, e.to_string()))?;
    #[cfg(debug_assertions)]
    bite_for_test(kind);
    Ok(())
}

/// glibc gives a thread arena's freed top back to the kernel through `shrink_heap`, which the
/// first time in a process opens /proc/sys/vm/overcommit_memory: an open a filtered thread must
/// not make (and does not need — guest memory is mapped, not heap). A trim threshold of 2 GiB
/// keeps freed heap mapped, so that path is never taken. Process-wide and idempotent.
fn keep_freed_heap() {
    // SAFETY: mallopt only sets an allocator parameter.
    unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX) };
}

/// Debug builds only: `MICROVIRT_SECCOMP_TEST_DENIED=vcpu|devices` makes that thread call a
/// syscall outside its filter right after installing it, so a test can see the filter bite.
#[cfg(debug_assertions)]
fn bite_for_test(kind: ThreadKind) {
    let wanted = std::env::var("MICROVIRT_SECCOMP_TEST_DENIED").unwrap_or_default();
    let hit = matches!(
        (wanted.as_str(), kind),
        ("vcpu", ThreadKind::Vcpu(0)) | ("devices", ThreadKind::Devices)
    );
    if wanted == "vcpu-memory" && kind == ThreadKind::Vcpu(0) {
        // KVM_SET_USER_MEMORY_REGION, on no descriptor at all: the filter must trap it by its
        // number although KVM_RUN, of the same type, is allowed.
        let nr = vcpu_requests::set_user_memory_region();
        // SAFETY: a plain syscall on an invalid descriptor; the filter traps it.
        unsafe { libc::ioctl(-1, nr as libc::c_ulong, 0) };
    }
    if wanted == "vcpu-heap" && kind == ThreadKind::Vcpu(0) {
        // Grows this thread's heap by 32 MiB in blocks below the mmap threshold and frees it
        // all, as a burst of device work on an exit could: the allocator must not trim it in a
        // way the filter traps (see `install`).
        let blocks: Vec<Vec<u8>> = (0..512).map(|i| vec![i as u8; 64 * 1024]).collect();
        let sum: u64 = blocks.iter().map(|b| b[0] as u64).sum();
        drop(blocks);
        eprintln!(
            "microvirt: seccomp test: the vcpu0 thread grew and freed 32 MiB of heap ({sum})"
        );
    }
    if wanted == "tiocsti" && kind == ThreadKind::Vcpu(0) {
        // TIOCSTI is of TUN's ioctl type ('T') but not one of TUN's requests: trapped.
        // SAFETY: a plain syscall on an invalid descriptor; the filter traps it.
        unsafe { libc::ioctl(-1, libc::TIOCSTI, 0) };
    }
    if wanted == "clone-namespace" && kind == ThreadKind::Control {
        // A thread-making clone that also asks for a mount namespace: trapped by its flags.
        // (Were it let through, the kernel would refuse CLONE_NEWNS with CLONE_FS: harmless.)
        let flags = libc::CLONE_VM
            | libc::CLONE_FS
            | libc::CLONE_SIGHAND
            | libc::CLONE_THREAD
            | libc::CLONE_NEWNS;
        // SAFETY: a raw clone the filter traps (or the kernel refuses) before anything runs.
        unsafe { libc::syscall(libc::SYS_clone, flags as libc::c_ulong, 0, 0, 0, 0) };
    }
    if wanted == "clone3" && kind == ThreadKind::Control {
        // clone3 is answered ENOSYS: the launcher says so and goes on.
        // SAFETY: clone3 with a null argument; the filter answers before the kernel reads it.
        let r = unsafe { libc::syscall(libc::SYS_clone3, 0usize, 0usize) };
        let e = std::io::Error::last_os_error();
        eprintln!("microvirt: seccomp test: clone3 returned {r} ({e})");
    }
    if wanted == "control" && kind == ThreadKind::Control {
        // unshare(0) changes nothing, but no launcher thread may call it.
        // SAFETY: a plain syscall; the filter traps it.
        unsafe { libc::syscall(libc::SYS_unshare, 0) };
    }
    if hit {
        // socket(2): no VMM thread has any use for it.
        // SAFETY: a plain syscall; the filter traps it before it does anything.
        unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
    }
}

fn install_sigsys_handler() -> std::io::Result<()> {
    static ONCE: std::sync::Once = std::sync::Once::new();
    let mut r = Ok(());
    ONCE.call_once(|| {
        // SAFETY: a zeroed sigaction with our handler; SA_SIGINFO for the syscall number.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigsys as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(libc::SIGSYS, &sa, std::ptr::null_mut()) != 0 {
                r = Err(std::io::Error::last_os_error());
            }
        }
    });
    r
}

/// Appends `n` in decimal to `buf` at `at` (no allocation: this runs in a signal handler).
fn put_number(buf: &mut [u8], mut at: usize, n: u64) -> usize {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    let mut n = n;
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for &d in &digits[i..] {
        if at < buf.len() {
            buf[at] = d;
            at += 1;
        }
    }
    at
}

fn put(buf: &mut [u8], mut at: usize, s: &[u8]) -> usize {
    for &b in s {
        if at < buf.len() {
            buf[at] = b;
            at += 1;
        }
    }
    at
}

/// The syscall number of a SIGSYS: `si_syscall`, after si_signo, si_errno, si_code, padding and
/// `si_call_addr` in the kernel's siginfo layout on x86_64.
const SI_SYSCALL_OFFSET: usize = 24;

extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel hands a valid siginfo for SIGSYS; the field is a plain int.
    let nr = unsafe { *((info as *const u8).add(SI_SYSCALL_OFFSET) as *const i32) };
    let kind = KIND.with(|k| k.get());
    let mut buf = [0u8; 200];
    // A newline first: the guest console may be in the middle of a line.
    let mut at = put(&mut buf, 0, b"\nmicrovirt: seccomp: the ");
    at = match kind {
        Some(ThreadKind::Vcpu(id)) => {
            let a = put(&mut buf, at, b"vcpu");
            put_number(&mut buf, a, id as u64)
        }
        Some(ThreadKind::Devices) => put(&mut buf, at, b"vmm-events"),
        // A control thread (the filter is inherited, the thread-local is not): its name.
        Some(ThreadKind::Control) | None => {
            let mut name = [0u8; 16];
            // SAFETY: PR_GET_NAME writes at most 16 bytes; prctl is async-signal-safe and no
            // filter denies it.
            unsafe { libc::prctl(libc::PR_GET_NAME, name.as_mut_ptr()) };
            let len = name.iter().position(|&b| b == 0).unwrap_or(16);
            let a = put(&mut buf, at, &name[..len]);
            put(&mut buf, a, b" (control)")
        }
    };
    at = put(&mut buf, at, b" thread made syscall ");
    at = put_number(&mut buf, at, nr.max(0) as u64);
    at = put(
        &mut buf,
        at,
        b", which its seccomp filter does not allow; the VMM stops\n",
    );
    // SAFETY: write(2) and _exit(2) are async-signal-safe and allowed by every filter.
    unsafe {
        libc::write(2, buf.as_ptr() as *const libc::c_void, at);
        libc::_exit(EXIT_SECCOMP);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_build_for_every_thread_kind() {
        for k in [
            ThreadKind::Vcpu(0),
            ThreadKind::Devices,
            ThreadKind::Control,
        ] {
            assert!(!filter(k).unwrap().is_empty());
        }
    }

    #[test]
    fn vcpu_requests_have_the_kernels_numbers() {
        // From <linux/kvm.h> on x86_64.
        assert_eq!(
            vcpu_requests::allowed(),
            [
                0xae80,
                0x8090_ae81,
                0x4090_ae82,
                0x8138_ae83,
                0x4138_ae84,
                0xc008_ae88,
                0x4008_ae89,
                0x8400_ae8e,
                0x4400_ae8f,
                0x4008_ae90,
                0xc008_ae91,
                0x8004_ae98,
                0x4004_ae99,
                0x8040_ae9f,
                0x4040_aea0,
                0x8080_aea1,
                0x4080_aea2,
                0xaea2,
                0xaea3,
                0x9000_aea4,
                0x5000_aea5,
                0x8188_aea6,
                0x4188_aea7,
                0x9000_aecf,
            ]
        );
        #[cfg(debug_assertions)]
        assert_eq!(vcpu_requests::set_user_memory_region(), 0x4020_ae46);
    }

    #[test]
    fn no_thread_may_escape() {
        for list in [COMMON, VCPU, DEVICES, CONTROL] {
            for nr in ESCAPES {
                assert!(!list.contains(nr), "syscall {nr} is allowed");
            }
        }
    }

    #[test]
    fn numbers_without_allocation() {
        let mut b = [0u8; 8];
        let n = put_number(&mut b, 0, 41);
        assert_eq!(&b[..n], b"41");
        let n = put_number(&mut b, 0, 0);
        assert_eq!(&b[..n], b"0");
    }
}
