//! Seccomp filters per VMM thread kind, built with `seccompiler` (the rust-vmm crate Firecracker
//! uses) and installed by each thread on itself before it does anything the guest can drive: a
//! vCPU thread before its first KVM_RUN, the device thread before its first event; and the
//! launcher daemon's control filter, installed on its first thread and inherited by all.
//!
//! Each filter allows what that thread was seen to call (strace of the probe, block, net,
//! snapshot and migration tests; allocator and thread start/exit calls included), `ioctl` only
//! for KVM's (0xAE) and TUN's (0x54, 'T') request types. Anything else is **trapped**: the
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

/// ioctl request types (bits 8..16 of the request) the vCPU and device threads may use: KVM's
/// (0xAE) and TUN's (0x54, 'T').
const IOCTL_TYPES: &[u64] = &[0xAE, 0x54];
/// The control threads', besides: block devices (0x12, BLKGETSIZE64 for a raw PVC), vhost
/// (0xAF) and socket interface queries (0x89).
const CONTROL_IOCTL_TYPES: &[u64] = &[0xAE, 0x54, 0x12, 0xAF, 0x89];

// The VM-level KVM requests a guest-driven thread must never make (numbers computed from the
// kvm-bindings structures, as the kernel's _IO/_IOW macros do).
mod vm_level {
    use kvm_bindings::{
        kvm_create_device, kvm_enable_cap, kvm_ioeventfd, kvm_irq_routing, kvm_irqfd,
        kvm_userspace_memory_region, kvm_userspace_memory_region2, KVMIO,
    };
    vmm_sys_util::ioctl_io_nr!(KVM_CREATE_VM, KVMIO, 0x01);
    vmm_sys_util::ioctl_io_nr!(KVM_CREATE_VCPU, KVMIO, 0x41);
    vmm_sys_util::ioctl_iow_nr!(
        KVM_SET_USER_MEMORY_REGION,
        KVMIO,
        0x46,
        kvm_userspace_memory_region
    );
    vmm_sys_util::ioctl_iow_nr!(
        KVM_SET_USER_MEMORY_REGION2,
        KVMIO,
        0x49,
        kvm_userspace_memory_region2
    );
    vmm_sys_util::ioctl_iow_nr!(KVM_SET_GSI_ROUTING, KVMIO, 0x6a, kvm_irq_routing);
    vmm_sys_util::ioctl_iow_nr!(KVM_IRQFD, KVMIO, 0x76, kvm_irqfd);
    vmm_sys_util::ioctl_iow_nr!(KVM_IOEVENTFD, KVMIO, 0x79, kvm_ioeventfd);
    vmm_sys_util::ioctl_iow_nr!(KVM_ENABLE_CAP, KVMIO, 0xa3, kvm_enable_cap);
    vmm_sys_util::ioctl_iowr_nr!(KVM_CREATE_DEVICE, KVMIO, 0xe0, kvm_create_device);

    /// New VMs and vCPUs, the guest's memory map (a thread that could change it could map
    /// host memory into the guest), interrupt and ioeventfd wiring, capabilities, in-kernel
    /// devices: the control thread sets these up before the guest's first instruction.
    pub fn requests() -> [u64; 9] {
        [
            KVM_CREATE_VM(),
            KVM_CREATE_VCPU(),
            KVM_SET_USER_MEMORY_REGION(),
            KVM_SET_USER_MEMORY_REGION2(),
            KVM_SET_GSI_ROUTING(),
            KVM_IRQFD(),
            KVM_IOEVENTFD(),
            KVM_ENABLE_CAP(),
            KVM_CREATE_DEVICE(),
        ]
        .map(u64::from)
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

/// Rules allowing ioctl requests of `types` only (of TUN's type only TUN's requests); with
/// `guest_driven`, KVM's VM-level requests (`vm_level::requests`) are refused too.
fn ioctl_rules(types: &[u64], guest_driven: bool) -> Result<Vec<SeccompRule>, String> {
    let mut rules = Vec::new();
    for nr in tun_requests() {
        rules.push(
            SeccompRule::new(vec![SeccompCondition::new(
                1,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::Eq,
                nr,
            )
            .map_err(|e| e.to_string())?])
            .map_err(|e| e.to_string())?,
        );
    }
    let typed: Result<Vec<SeccompRule>, String> = types
        .iter()
        .filter(|&&t| t != 0x54)
        .map(|&t| {
            let mut conditions = vec![SeccompCondition::new(
                1,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::MaskedEq(0xff00),
                t << 8,
            )
            .map_err(|e| e.to_string())?];
            if guest_driven && t == 0xAE {
                for nr in vm_level::requests() {
                    conditions.push(
                        SeccompCondition::new(1, SeccompCmpArgLen::Dword, SeccompCmpOp::Ne, nr)
                            .map_err(|e| e.to_string())?,
                    );
                }
            }
            SeccompRule::new(conditions).map_err(|e| e.to_string())
        })
        .collect();
    rules.extend(typed?);
    Ok(rules)
}

/// The BPF program of `kind`.
pub fn filter(kind: ThreadKind) -> Result<BpfProgram, SeccompError> {
    let build = |e: String| SeccompError::Build(kind, e);
    let (own, ioctl_types): (&[&[i64]], _) = match kind {
        ThreadKind::Vcpu(_) => (&[VCPU], IOCTL_TYPES),
        ThreadKind::Devices => (&[DEVICES], IOCTL_TYPES),
        // Every thread of the daemon inherits it, so it covers the others' calls too.
        ThreadKind::Control => (&[CONTROL, VCPU, DEVICES], CONTROL_IOCTL_TYPES),
    };
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for &nr in COMMON.iter().chain(own.iter().flat_map(|l| l.iter())) {
        let r = if nr == libc::SYS_ioctl {
            ioctl_rules(ioctl_types, kind != ThreadKind::Control).map_err(build)?
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
    let bpf = filter(kind)?;
    let clone3 = clone3_filter().map_err(|e| SeccompError::Build(kind, e))?;
    KIND.with(|k| k.set(Some(kind)));
    seccompiler::apply_filter(&clone3).map_err(|e| SeccompError::Install(kind, e.to_string()))?;
    seccompiler::apply_filter(&bpf).map_err(|e| SeccompError::Install(kind, e.to_string()))?;
    #[cfg(debug_assertions)]
    bite_for_test(kind);
    Ok(())
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
        let nr = vm_level::requests()[2];
        // SAFETY: a plain syscall on an invalid descriptor; the filter traps it.
        unsafe { libc::ioctl(-1, nr as libc::c_ulong, 0) };
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
    fn vm_level_requests_have_the_kernels_numbers() {
        // From <linux/kvm.h> on x86_64.
        assert_eq!(
            vm_level::requests(),
            [
                0xae01,
                0xae41,
                0x4020_ae46,
                0x40a0_ae49,
                0x4008_ae6a,
                0x4020_ae76,
                0x4040_ae79,
                0x4068_aea3,
                0xc00c_aee0
            ]
        );
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
