//! The client side of the control protocol, for `virt-launcher snapshot` and `migrate` (and any
//! other front end): greet, send requests, read answers.

use std::io::{BufRead, BufReader, Lines, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use api::protocol::{Request, Response};

pub struct ControlClient {
    out: UnixStream,
    lines: Lines<BufReader<UnixStream>>,
}

impl ControlClient {
    /// Connects to a launcher's socket and greets it with protocol `version`.
    pub fn connect(socket: &Path, version: u32) -> Result<ControlClient, String> {
        let stream = UnixStream::connect(socket).map_err(|e| {
            format!(
                "--socket {}: {e} (is a launcher serving it? `virt-launcher run --socket` or `daemon`)",
                socket.display()
            )
        })?;
        let out = stream.try_clone().map_err(|e| e.to_string())?;
        let mut c = ControlClient {
            out,
            lines: BufReader::new(stream).lines(),
        };
        c.send(&Request::Hello { version })?;
        match c.receive()? {
            Response::Hello { .. } => Ok(c),
            Response::Error { message } => Err(message),
            other => Err(format!("unexpected answer {other:?}")),
        }
    }

    pub fn send(&mut self, r: &Request) -> Result<(), String> {
        let mut s = serde_json::to_string(r).expect("serializable");
        s.push('\n');
        self.out
            .write_all(s.as_bytes())
            .map_err(|e| format!("the launcher went away: {e}"))
    }

    /// The next answer line.
    pub fn receive(&mut self) -> Result<Response, String> {
        let line = self
            .lines
            .next()
            .ok_or("the launcher closed the connection")?
            .map_err(|e| e.to_string())?;
        serde_json::from_str(&line).map_err(|e| format!("bad answer {line:?}: {e}"))
    }
}
