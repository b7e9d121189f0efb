//! The importer's own seccomp filter, installed by `cdi-importer` before it does anything
//! else, so every thread it starts inherits it: a process that parses untrusted images and
//! talks to untrusted servers may make only the system calls an import needs — files, sockets
//! (client and the upload/progress server), memory, threads, time, randomness. Anything else
//! (mount, ptrace, bpf, keyctl, unshare, namespaces, module loading, process creation, …)
//! fails with EPERM, so an unforeseen path ends in an error the DataVolume shows rather than
//! a silent kill. `ioctl` is limited to the terminal and non-blocking requests.
//!
//! The list is what the importer's tests use under strace (http, s3, registry, qcow2, clone,
//! blank, upload), with the calls glibc and Rust's std may choose at run time beside them.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

const ALLOWED: &[i64] = &[
    // Files and the volume.
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_preadv,
    libc::SYS_pwritev,
    libc::SYS_lseek,
    libc::SYS_open,
    libc::SYS_openat,
    libc::SYS_close,
    libc::SYS_statx,
    libc::SYS_newfstatat,
    libc::SYS_fstat,
    libc::SYS_stat,
    libc::SYS_lstat,
    libc::SYS_statfs,
    libc::SYS_fstatfs,
    libc::SYS_fcntl,
    libc::SYS_ftruncate,
    libc::SYS_fallocate,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_getdents64,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_rmdir,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_access,
    libc::SYS_faccessat,
    libc::SYS_faccessat2,
    libc::SYS_readlink,
    libc::SYS_readlinkat,
    libc::SYS_getcwd,
    libc::SYS_copy_file_range,
    libc::SYS_sendfile,
    libc::SYS_splice,
    // Sockets: the source, DNS, and the upload and progress server.
    libc::SYS_socket,
    libc::SYS_socketpair,
    libc::SYS_connect,
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_setsockopt,
    libc::SYS_getsockopt,
    libc::SYS_shutdown,
    libc::SYS_sendto,
    libc::SYS_recvfrom,
    libc::SYS_sendmsg,
    libc::SYS_recvmsg,
    libc::SYS_sendmmsg,
    libc::SYS_recvmmsg,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_select,
    libc::SYS_pselect6,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_eventfd2,
    libc::SYS_pipe2,
    // Memory.
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mprotect,
    libc::SYS_mremap,
    libc::SYS_madvise,
    libc::SYS_brk,
    // Threads, signals, time, identity.
    libc::SYS_clone,
    libc::SYS_clone3,
    libc::SYS_futex,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_set_tid_address,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_gettid,
    libc::SYS_getpid,
    libc::SYS_getuid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getegid,
    libc::SYS_prlimit64,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_clock_gettime,
    libc::SYS_clock_getres,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_gettimeofday,
    libc::SYS_getrandom,
    libc::SYS_uname,
    libc::SYS_sysinfo,
    libc::SYS_prctl,
];

/// `ioctl` requests the importer may make: a terminal check (logging) and non-blocking /
/// close-on-exec flags.
const IOCTLS: &[u64] = &[libc::TCGETS, libc::TIOCGWINSZ, libc::FIONBIO, libc::FIOCLEX];

/// The filter's BPF program.
pub fn filter() -> Result<BpfProgram, String> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        ALLOWED.iter().map(|&nr| (nr, vec![])).collect();
    let ioctls = IOCTLS
        .iter()
        .map(|&req| {
            SeccompCondition::new(1, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, req)
                .and_then(|c| SeccompRule::new(vec![c]))
                .map_err(|e| e.to_string())
        })
        .collect::<Result<Vec<_>, _>>()?;
    rules.insert(libc::SYS_ioctl, ioctls);
    let f = SeccompFilter::new(
        rules,
        SeccompAction::Errno(libc::EPERM as u32),
        SeccompAction::Allow,
        TargetArch::x86_64,
    )
    .map_err(|e| e.to_string())?;
    f.try_into()
        .map_err(|e: seccompiler::BackendError| e.to_string())
}

/// Installs the filter on the calling thread (with PR_SET_NO_NEW_PRIVS, which seccomp needs
/// without CAP_SYS_ADMIN); threads started later inherit it.
pub fn install() -> Result<(), String> {
    let bpf = filter()?;
    seccompiler::apply_filter(&bpf).map_err(|e| e.to_string())
}
