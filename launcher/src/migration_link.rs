//! Where a migration stream goes: `tcp:HOST:PORT` (or plain `HOST:PORT`) between nodes, or
//! `unix:PATH` on one host; optionally wrapped in mutual TLS (`migration_tls`).
//!
//! Both ends get read and write timeouts: a link that goes silent (a cut cable, a node gone
//! without a reset) must fail the migration in bounded time, not hang it in the kernel's TCP
//! retransmissions for a quarter of an hour with the guest paused.

use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::Duration;

use api::protocol::MigrationTls;

use crate::migration_tls::{self, Duplex};
use crate::unix_socket::{bind_unix, connect_unix, peer_uid};

/// How long either end waits for the other before the migration fails.
pub const LINK_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MigrationAddress {
    Tcp(String),
    Unix(PathBuf),
}

impl std::str::FromStr for MigrationAddress {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(format!("{s:?}: unix: needs a socket path"));
            }
            return Ok(MigrationAddress::Unix(path.into()));
        }
        let hostport = s.strip_prefix("tcp:").unwrap_or(s);
        match hostport.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                Ok(MigrationAddress::Tcp(hostport.to_string()))
            }
            _ => Err(format!(
                "{s:?}: a migration address is tcp:HOST:PORT, HOST:PORT or unix:PATH"
            )),
        }
    }
}

impl std::fmt::Display for MigrationAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MigrationAddress::Tcp(a) => f.write_str(a),
            MigrationAddress::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// A bound migration listener. A unix socket file is removed when it is dropped.
pub enum MigrationListener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl MigrationAddress {
    /// Plain TCP carries guest memory readable to anyone on the path and accepts whoever
    /// connects first: only on loopback. Any other TCP address needs mutual TLS.
    pub fn check_plain(&self, tls: bool) -> Result<(), String> {
        let MigrationAddress::Tcp(a) = self else {
            return Ok(());
        };
        if tls {
            return Ok(());
        }
        let host = a.rsplit_once(':').map_or(a.as_str(), |(h, _)| h);
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let loopback = host == "localhost"
            || host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback());
        if loopback {
            Ok(())
        } else {
            Err(format!("{a}: plain TCP is accepted on loopback only; off this machine a migration needs mutual TLS (--tls-dir), or a unix: socket"))
        }
    }
}

impl MigrationListener {
    /// Binds `address`; a TCP address off loopback only with `tls` (see `check_plain`).
    pub fn bind(address: &str, tls: bool) -> Result<MigrationListener, String> {
        let parsed = address.parse::<MigrationAddress>()?;
        parsed.check_plain(tls)?;
        match parsed {
            MigrationAddress::Tcp(a) => TcpListener::bind(&a)
                .map(MigrationListener::Tcp)
                .map_err(|e| format!("cannot listen on {a}: {e}")),
            MigrationAddress::Unix(p) => bind_unix(&p)
                .map(|l| MigrationListener::Unix(l, p.clone()))
                .map_err(|e| format!("cannot listen on unix:{}: {e}", p.display())),
        }
    }

    /// Where the source must connect (a TCP port 0 resolved to the port the kernel chose).
    pub fn address(&self) -> String {
        match self {
            MigrationListener::Tcp(l) => l
                .local_addr()
                .map(|a| a.to_string())
                .unwrap_or_else(|e| format!("<unknown: {e}>")),
            MigrationListener::Unix(_, p) => MigrationAddress::Unix(p.clone()).to_string(),
        }
    }

    /// Waits for the source and returns its stream (TLS when `tls` is given).
    pub fn accept(&self, tls: Option<&MigrationTls>) -> Result<Box<dyn Duplex>, String> {
        self.accept_from(tls, None)
    }

    /// `accept`; on a unix socket with `only_uid`, a connection from another user is closed
    /// unread and the wait goes on (a node agent proxies the stream as root; a tenant's
    /// process in the same Pod must not feed or take a migration).
    pub fn accept_from(
        &self,
        tls: Option<&MigrationTls>,
        only_uid: Option<u32>,
    ) -> Result<Box<dyn Duplex>, String> {
        loop {
            if let Some(s) = self.accept_one(tls, only_uid)? {
                return Ok(s);
            }
        }
    }

    /// `accept_from`, giving up after `within`: a node agent that never comes must not keep
    /// the VM waiting to migrate, and a source that opened the conversation but not its page
    /// streams must not keep the target waiting for them.
    pub fn accept_within(
        &self,
        tls: Option<&MigrationTls>,
        only_uid: Option<u32>,
        within: Duration,
    ) -> Result<Box<dyn Duplex>, String> {
        let deadline = std::time::Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "nobody took the migration stream at {} within {within:?}",
                    self.address()
                ));
            }
            // poll(2) may wake a little before its timeout: only the deadline ends the wait.
            if !self.readable_within(left)? {
                continue;
            }
            if let Some(s) = self.accept_one(tls, only_uid)? {
                return Ok(s);
            }
        }
    }

    /// Whether a connection waits to be accepted, looking for at most `within`.
    fn readable_within(&self, within: Duration) -> Result<bool, String> {
        use std::os::fd::AsRawFd;
        let fd = match self {
            MigrationListener::Tcp(l) => l.as_raw_fd(),
            MigrationListener::Unix(l, _) => l.as_raw_fd(),
        };
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = within.as_micros().div_ceil(1000).clamp(1, i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd for the duration of the call.
        match unsafe { libc::poll(&mut pfd, 1, ms) } {
            n if n > 0 => Ok(true),
            0 => Ok(false),
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    Ok(false)
                } else {
                    Err(format!("poll: {e}"))
                }
            }
        }
    }

    /// Accepts one connection; None when `only_uid` names another user than its peer's (the
    /// connection is closed unread).
    fn accept_one(
        &self,
        tls: Option<&MigrationTls>,
        only_uid: Option<u32>,
    ) -> Result<Option<Box<dyn Duplex>>, String> {
        match self {
            MigrationListener::Tcp(l) => {
                let (s, peer) = l.accept().map_err(|e| format!("accept: {e}"))?;
                tracing::info!(%peer, tls = tls.is_some(), "incoming migration");
                let _ = s.set_nodelay(true);
                set_timeouts_tcp(&s)?;
                migration_tls::server(s, tls).map(Some)
            }
            MigrationListener::Unix(l, p) => {
                let (s, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
                if let Some(uid) = only_uid {
                    match peer_uid(&s) {
                        Ok(peer) if peer == uid => {}
                        Ok(peer) => {
                            tracing::warn!(
                                peer,
                                expected = uid,
                                "migration connection from another user closed"
                            );
                            return Ok(None);
                        }
                        Err(e) => {
                            tracing::warn!("migration connection: SO_PEERCRED: {e}");
                            return Ok(None);
                        }
                    }
                }
                tracing::info!(path = %p.display(), tls = tls.is_some(), "incoming migration");
                set_timeouts_unix(&s)?;
                migration_tls::server(s, tls).map(Some)
            }
        }
    }
}

impl Drop for MigrationListener {
    fn drop(&mut self) {
        if let MigrationListener::Unix(_, p) = self {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn set_timeouts_tcp(s: &TcpStream) -> Result<(), String> {
    s.set_read_timeout(Some(LINK_TIMEOUT))
        .and_then(|()| s.set_write_timeout(Some(LINK_TIMEOUT)))
        .map_err(|e| e.to_string())
}

fn set_timeouts_unix(s: &UnixStream) -> Result<(), String> {
    s.set_read_timeout(Some(LINK_TIMEOUT))
        .and_then(|()| s.set_write_timeout(Some(LINK_TIMEOUT)))
        .map_err(|e| e.to_string())
}

/// Connects to a target's listener (a TCP address off loopback only with `tls`).
pub fn connect(address: &str, tls: Option<&MigrationTls>) -> Result<Box<dyn Duplex>, String> {
    let parsed = address.parse::<MigrationAddress>()?;
    parsed.check_plain(tls.is_some())?;
    match parsed {
        MigrationAddress::Tcp(a) => {
            let addr = a
                .to_socket_addrs()
                .map_err(|e| format!("{a}: {e}"))?
                .next()
                .ok_or_else(|| format!("{a}: no address"))?;
            let s = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).map_err(|e| {
                format!("cannot reach the migration target at {a}: {e} (is it waiting?)")
            })?;
            let _ = s.set_nodelay(true);
            set_timeouts_tcp(&s)?;
            migration_tls::client(s, tls)
        }
        MigrationAddress::Unix(p) => {
            let s = connect_unix(&p).map_err(|e| {
                format!(
                    "cannot reach the migration target at unix:{}: {e} (is it waiting?)",
                    p.display()
                )
            })?;
            set_timeouts_unix(&s)?;
            migration_tls::client(s, tls)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_that_does_not_come_fails_the_wait_at_its_deadline() {
        let l = MigrationListener::bind("127.0.0.1:0", false).unwrap();
        let within = Duration::from_millis(300);
        let started = std::time::Instant::now();
        let e = match l.accept_within(None, None, within) {
            Err(e) => e,
            Ok(_) => panic!("a link nobody opened was accepted"),
        };
        assert!(
            e.contains(&format!("at {} within 300ms", l.address())),
            "{e}"
        );
        assert!(started.elapsed() >= within, "{:?}", started.elapsed());
        // One that comes in time is taken.
        let address = l.address();
        let client = std::thread::spawn(move || TcpStream::connect(address).unwrap());
        assert!(l.accept_within(None, None, Duration::from_secs(10)).is_ok());
        client.join().unwrap();
    }

    #[test]
    fn addresses() {
        for (s, want) in [
            (
                "tcp:10.0.0.1:4000",
                MigrationAddress::Tcp("10.0.0.1:4000".into()),
            ),
            ("127.0.0.1:0", MigrationAddress::Tcp("127.0.0.1:0".into())),
            ("tcp:[::1]:9", MigrationAddress::Tcp("[::1]:9".into())),
            (
                "unix:/run/m.sock",
                MigrationAddress::Unix("/run/m.sock".into()),
            ),
        ] {
            assert_eq!(s.parse::<MigrationAddress>().unwrap(), want, "{s}");
        }
        for (a, tls, ok) in [
            ("127.0.0.1:4000", false, true),
            ("localhost:4000", false, true),
            ("[::1]:4000", false, true),
            ("0.0.0.0:49152", false, false),
            ("10.0.0.2:4000", false, false),
            ("node-2.example:4000", false, false),
            ("10.0.0.2:4000", true, true),
            ("unix:/run/m.sock", false, true),
        ] {
            let r = a.parse::<MigrationAddress>().unwrap().check_plain(tls);
            assert_eq!(r.is_ok(), ok, "{a} tls={tls}: {r:?}");
            if let Err(e) = r {
                assert!(
                    e.contains("loopback only") && e.contains("--tls-dir"),
                    "{e}"
                );
            }
        }
        for bad in ["unix:", "localhost", "tcp:host:port", ":80", "tcp:h:70000"] {
            let e = bad.parse::<MigrationAddress>().unwrap_err();
            assert!(
                e.contains("tcp:HOST:PORT") || e.contains("socket path"),
                "{e}"
            );
        }
    }
}
