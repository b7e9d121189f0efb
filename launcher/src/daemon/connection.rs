//! One client of the control socket: the greeting that fixes the protocol version, then
//! request lines answered in order. `Console` and `Events` turn the connection into a stream
//! for as long as the client stays; the streaming requests (`Snapshot`, `MigrateOut`) send
//! their progress as events before the answer.

use std::collections::VecDeque;
use std::io::{BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::mpsc::channel;
use std::sync::Arc;

use api::protocol::*;

use super::{read_request, ConsoleHub, Daemon, FdReader, InFlight};
use crate::unix_socket::peer_uid;

/// The reading and writing sides of one client connection.
struct Connection {
    out: UnixStream,
    reader: BufReader<FdReader>,
    line: String,
}

impl Connection {
    fn send(&mut self, r: &Response) -> std::io::Result<()> {
        send(&mut self.out, r)
    }

    fn error(&mut self, message: String) -> std::io::Result<()> {
        self.send(&Response::Error { message })
    }

    /// The client's Hello: the version this connection speaks, or None when the client went
    /// away or spoke no version this launcher does (it was told why).
    fn greet(&mut self) -> std::io::Result<Option<u32>> {
        if !read_request(&mut self.reader, &mut self.line)? {
            return Ok(None);
        }
        match serde_json::from_str::<Request>(&self.line) {
            Ok(Request::Hello { version })
                if (MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version) =>
            {
                self.send(&Response::Hello {
                    version,
                    launcher: env!("CARGO_PKG_VERSION").into(),
                })?;
                Ok(Some(version))
            }
            Ok(Request::Hello { version }) => {
                self.error(format!("protocol version {version} is not supported; this launcher speaks versions {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}"))?;
                Ok(None)
            }
            _ => {
                self.error(format!("expected hello with a protocol version from {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}"))?;
                Ok(None)
            }
        }
    }

    /// The next request; a line that is not one is answered with why and skipped. None once
    /// the client has gone.
    fn next_request(&mut self) -> std::io::Result<Option<Request>> {
        loop {
            if !read_request(&mut self.reader, &mut self.line)? {
                return Ok(None);
            }
            match serde_json::from_str::<Request>(&self.line) {
                Ok(r) => return Ok(Some(r)),
                Err(e) => self.error(format!("bad request: {e}"))?,
            }
        }
    }

    /// The descriptors that arrived with the messages so far (SCM_RIGHTS).
    fn fds(&mut self) -> &mut VecDeque<std::os::fd::OwnedFd> {
        &mut self.reader.get_mut().fds
    }
}

fn send(out: &mut UnixStream, r: &Response) -> std::io::Result<()> {
    let mut s = serde_json::to_string(r).expect("serializable");
    s.push('\n');
    out.write_all(s.as_bytes())
}

/// Why `req` cannot be asked in protocol `version`, if it cannot.
fn too_old(req: &Request, version: u32) -> Option<String> {
    let (what, since) = req.introduced()?;
    (version < since).then(|| {
        format!("{what} needs protocol version {since}; this connection speaks version {version}")
    })
}

impl Daemon {
    /// Serves one client connection.
    pub fn serve_connection(self: &Arc<Self>, stream: UnixStream) -> std::io::Result<()> {
        let requester = peer_uid(&stream).ok();
        let mut conn = Connection {
            out: stream.try_clone()?,
            reader: BufReader::new(FdReader {
                stream,
                fds: VecDeque::new(),
                deadline: None,
            }),
            line: String::new(),
        };
        let Some(version) = conn.greet()? else {
            return Ok(());
        };
        while let Some(req) = conn.next_request()? {
            match req {
                Request::Console => return self.stream_console(conn),
                Request::Events => return self.stream_events(conn),
                req => {
                    // Counted while answered: the process waits for them before it exits.
                    let _busy = InFlight::enter(&self.in_flight);
                    match too_old(&req, version) {
                        Some(why) => conn.error(why)?,
                        None => self.answer(&mut conn, req, requester)?,
                    }
                }
            }
        }
        Ok(())
    }

    /// Console: the guest's output to the client from now on, the client's bytes to the
    /// guest's console input.
    fn stream_console(&self, mut conn: Connection) -> std::io::Result<()> {
        conn.send(&Response::Ok)?;
        ConsoleHub::attach(&self.console, conn.out.try_clone()?);
        let mut buf = [0u8; 1024];
        loop {
            let n = conn.reader.read(&mut buf)?;
            if n == 0 {
                return Ok(());
            }
            let mut g = self.inner.lock().unwrap();
            if let Some(input) = g.console_input.as_mut() {
                let _ = input.write_all(&buf[..n]);
            }
        }
    }

    /// Events: every event from now on, until the client goes away.
    fn stream_events(&self, mut conn: Connection) -> std::io::Result<()> {
        conn.send(&Response::Ok)?;
        let (tx, rx) = channel();
        self.events.lock().unwrap().push(tx);
        for e in rx {
            conn.send(&Response::Event(e))?;
        }
        Ok(())
    }

    /// Answers one request (its progress events first, for the streaming ones).
    fn answer(
        self: &Arc<Self>,
        conn: &mut Connection,
        req: Request,
        requester: Option<u32>,
    ) -> std::io::Result<()> {
        let answer = match req {
            Request::AttachNetwork { nics, fds } => self
                .attach_network(nics, fds, conn.fds())
                .map_or_else(|message| Response::Error { message }, |_| Response::Ok),
            Request::MigrateOut {
                target,
                options,
                tls,
            } => {
                let mut sink = conn.out.try_clone()?;
                self.migrate_out(&target, &options, tls.as_ref(), requester, &mut |e| {
                    let _ = send(&mut sink, &Response::Event(e));
                })
                .map_or_else(|message| Response::Error { message }, Response::Migration)
            }
            Request::Snapshot {
                memory_path,
                state_path,
                stop,
            } => {
                let mut sink = conn.out.try_clone()?;
                self.snapshot(&memory_path, &state_path, stop, &mut |e| {
                    let _ = send(&mut sink, &Response::Event(e));
                })
                .map_or_else(|message| Response::Error { message }, Response::Snapshot)
            }
            other => self.handle(other, requester),
        };
        conn.send(&answer)
    }
}
