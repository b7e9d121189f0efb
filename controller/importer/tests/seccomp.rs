//! The importer's seccomp filter, installed in a child process (this test binary run again):
//! what an import needs works — files, a TCP round trip, threads — and what it never needs
//! (ptrace, namespaces, mounts, running programs, ioctls beyond the terminal's) is refused
//! with EPERM.

use std::io::{Read, Write};

const CHILD: &str = "MV_IMPORTER_SECCOMP_CHILD";

#[test]
fn the_filter_allows_an_import_and_refuses_the_rest() {
    if std::env::var_os(CHILD).is_some() {
        return child();
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "the_filter_allows_an_import_and_refuses_the_rest",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("child checks passed"), "{text}");
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn child() {
    importer::seccomp::install().unwrap();
    // What an import does.
    let dir = std::env::temp_dir().join(format!("mv-seccomp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("f"), b"data").unwrap();
    assert_eq!(std::fs::read(dir.join("f")).unwrap(), b"data");
    std::fs::remove_dir_all(&dir).unwrap();
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.write_all(b"pong").unwrap();
    });
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    let mut buf = [0u8; 4];
    c.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"pong");
    t.join().unwrap();
    // What it never does.
    // SAFETY: raw system calls with constant arguments; each is expected to be refused.
    unsafe {
        assert_eq!(libc::ptrace(libc::PTRACE_TRACEME, 0, 0, 0), -1);
        assert_eq!(errno(), libc::EPERM, "ptrace");
        assert_eq!(libc::unshare(libc::CLONE_NEWUSER), -1);
        assert_eq!(errno(), libc::EPERM, "unshare");
        let none = c"none".as_ptr();
        assert_eq!(
            libc::mount(
                none,
                c"/mnt".as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                std::ptr::null()
            ),
            -1
        );
        assert_eq!(errno(), libc::EPERM, "mount");
        let mut n: libc::c_int = 0;
        assert_eq!(libc::ioctl(0, libc::FIONREAD, &mut n), -1);
        assert_eq!(errno(), libc::EPERM, "ioctl FIONREAD");
    }
    let spawned = std::process::Command::new("/bin/true").status();
    assert!(spawned.is_err(), "a program ran: {spawned:?}");
    println!("child checks passed");
}
