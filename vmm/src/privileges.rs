//! Least privilege for the threads a guest drives. Linux keeps capabilities per thread, so
//! each vCPU thread and the device thread drop all of theirs (effective, permitted,
//! inheritable, ambient and — when they may — the bounding set) as their first act, before
//! their seccomp filter and long before the guest's first instruction: whatever the process
//! was started with, a guest that took over one of them holds no capability. The launcher's
//! daemon drops the same for the whole process before it starts a thread (it is handed its TAP
//! and sockets as descriptors and needs none).

use caps::{CapSet, Capability};

#[derive(Debug, thiserror::Error)]
#[error("dropping capabilities ({set}): {source}")]
pub struct PrivilegeError {
    set: &'static str,
    #[source]
    source: caps::errors::CapsError,
}

/// Drops every capability of the calling thread. Threads it creates afterwards inherit the
/// empty sets.
pub fn drop_capabilities() -> Result<(), PrivilegeError> {
    let err = |set| move |source| PrivilegeError { set, source };
    caps::clear(None, CapSet::Ambient).map_err(err("ambient"))?;
    // The bounding set can only shrink with CAP_SETPCAP; without it, nothing in it can be
    // regained anyway (no_new_privs, no file capabilities gained through exec).
    if caps::has_cap(None, CapSet::Effective, Capability::CAP_SETPCAP).unwrap_or(false) {
        caps::clear(None, CapSet::Bounding).map_err(err("bounding"))?;
    }
    caps::clear(None, CapSet::Inheritable).map_err(err("inheritable"))?;
    caps::clear(None, CapSet::Effective).map_err(err("effective"))?;
    caps::clear(None, CapSet::Permitted).map_err(err("permitted"))?;
    Ok(())
}

/// `PR_SET_NO_NEW_PRIVS` for the calling thread and what it creates: no exec can gain
/// privileges (setuid bits, file capabilities). seccompiler sets it too when it installs a
/// filter; set here so that it holds even with `--seccomp off`.
pub fn set_no_new_privs() -> std::io::Result<()> {
    // SAFETY: a prctl with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Closes every descriptor above stderr the process inherited (`close_range(3, ~0)`): the VMM
/// opens what it needs itself or is handed it over its control socket.
pub fn close_inherited_fds() -> std::io::Result<()> {
    // SAFETY: close_range on descriptors nobody in this process uses yet (called first thing).
    let r = unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status_field(tid: i32, field: &str) -> String {
        let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
        s.lines()
            .find_map(|l| l.strip_prefix(field))
            .unwrap()
            .trim()
            .to_string()
    }

    #[test]
    fn a_thread_that_drops_holds_nothing_and_its_siblings_are_untouched() {
        let before = status_field(unsafe { libc::gettid() }, "CapEff:");
        let (eff, prm, bnd, nnp) = std::thread::spawn(|| {
            drop_capabilities().unwrap();
            set_no_new_privs().unwrap();
            let tid = unsafe { libc::gettid() };
            (
                status_field(tid, "CapEff:"),
                status_field(tid, "CapPrm:"),
                status_field(tid, "CapBnd:"),
                status_field(tid, "NoNewPrivs:"),
            )
        })
        .join()
        .unwrap();
        assert_eq!(eff, "0000000000000000");
        assert_eq!(prm, "0000000000000000");
        if before != "0000000000000000" {
            // Started with capabilities (root): the bounding set went too.
            assert_eq!(bnd, "0000000000000000");
        }
        assert_eq!(nnp, "1");
        assert_eq!(status_field(unsafe { libc::gettid() }, "CapEff:"), before);
    }
}
