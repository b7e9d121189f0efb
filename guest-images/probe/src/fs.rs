//! `probe.test=virtiofs probe.tag=T`: on the virtio-fs device whose tag is T, speaks FUSE the
//! way Linux's virtio-fs driver does (INIT, LOOKUP, OPEN, READ, CREATE, WRITE, RELEASE on the
//! request queue): reads `hello.txt` from the share, creates `written.txt` holding
//! `probe wrote`, reads it back, and prints the first line of `hello.txt`.

use core::fmt::Write;
use core::ptr::{addr_of_mut, read_volatile, write_volatile};

use crate::virtio::{Device, Queue, Rings, DESC_F_WRITE};
use crate::{result, Line};

const TYPE_FS: u32 = 26;
const TAG_MAX: usize = 36;
/// The backend runs in another process on a host that emulates the guest: be patient.
const SPINS: u32 = 100_000_000;

const LOOKUP: u32 = 1;
const OPEN: u32 = 14;
const READ: u32 = 15;
const WRITE: u32 = 16;
const RELEASE: u32 = 18;
const INIT: u32 = 26;
const CREATE: u32 = 35;
const ROOT: u64 = 1;
const DEVICE_NEEDS_RESET: u32 = 64;
const IN_HEADER: usize = 40;
const OUT_HEADER: usize = 16;
const O_RDONLY: u32 = 0;
const O_RDWR: u32 = 2;
const O_CREAT: u32 = 0o100;
const O_TRUNC: u32 = 0o1000;

static mut RINGS: [Rings; 2] = [const { Rings::new() }; 2];

#[repr(C, align(4096))]
struct Page([u8; 4096]);
static mut REQ: Page = Page([0; 4096]);
static mut REPLY: Page = Page([0; 4096]);

fn req() -> *mut u8 {
    unsafe { addr_of_mut!(REQ.0) as *mut u8 }
}
fn reply() -> *mut u8 {
    unsafe { addr_of_mut!(REPLY.0) as *mut u8 }
}

fn put<const N: usize>(at: usize, bytes: [u8; N]) {
    for (i, b) in bytes.iter().enumerate() {
        unsafe { write_volatile(req().add(at + i), *b) };
    }
}

fn get_u32(at: usize) -> u32 {
    let mut b = [0u8; 4];
    for (i, x) in b.iter_mut().enumerate() {
        *x = unsafe { read_volatile(reply().add(at + i)) };
    }
    u32::from_le_bytes(b)
}

fn get_u64(at: usize) -> u64 {
    get_u32(at) as u64 | (get_u32(at + 4) as u64) << 32
}

struct Session {
    dev: Device,
    q: Queue,
    unique: u64,
}

impl Session {
    /// Sends one request (header + `args` already at REQ+40, `in_len` bytes of them) and waits
    /// for the reply (up to `out_len` bytes after the out header). Returns the reply's payload
    /// length, or the negated errno the server answered.
    fn call(
        &mut self,
        opcode: u32,
        node: u64,
        in_len: usize,
        out_len: usize,
    ) -> Result<usize, i32> {
        self.unique += 2;
        let total = IN_HEADER + in_len;
        put(0, (total as u32).to_le_bytes());
        put(4, opcode.to_le_bytes());
        put(8, self.unique.to_le_bytes());
        put(16, node.to_le_bytes());
        put(24, [0u8; 16]); // uid, gid, pid, total_extlen, padding
        unsafe { core::ptr::write_bytes(reply(), 0, OUT_HEADER + out_len) };
        self.q.push(&[
            (req() as u64, total as u32, 0),
            (reply() as u64, (OUT_HEADER + out_len) as u32, DESC_F_WRITE),
        ]);
        self.dev.notify(&self.q);
        let mut answered = false;
        for _ in 0..SPINS / 1024 {
            if self.q.wait_used(1024).is_some() {
                answered = true;
                break;
            }
            // A backend that died makes the device ask for a reset: give up at once.
            if self.dev.status() & DEVICE_NEEDS_RESET != 0 {
                return Err(-5); // EIO
            }
        }
        if !answered {
            return Err(-110); // ETIMEDOUT
        }
        let len = get_u32(0) as usize;
        let error = get_u32(4) as i32;
        if get_u64(8) != self.unique {
            return Err(-71); // EPROTO
        }
        if error != 0 {
            return Err(error);
        }
        Ok(len.saturating_sub(OUT_HEADER).min(out_len))
    }

    /// Puts a NUL-terminated name at REQ+40+`at`; returns the bytes used.
    fn name(at: usize, name: &str) -> usize {
        for (i, b) in name.bytes().enumerate() {
            unsafe { write_volatile(req().add(IN_HEADER + at + i), b) };
        }
        unsafe { write_volatile(req().add(IN_HEADER + at + name.len()), 0) };
        name.len() + 1
    }

    fn lookup(&mut self, name: &str) -> Result<(u64, u64), i32> {
        let n = Self::name(0, name);
        self.call(LOOKUP, ROOT, n, 128)?;
        // fuse_entry_out: nodeid, generation, entry_valid, attr_valid, nsecs, then fuse_attr
        // whose size is its second field.
        Ok((get_u64(OUT_HEADER), get_u64(OUT_HEADER + 48)))
    }

    fn open(&mut self, node: u64, flags: u32) -> Result<u64, i32> {
        put(IN_HEADER, flags.to_le_bytes());
        put(IN_HEADER + 4, 0u32.to_le_bytes());
        self.call(OPEN, node, 8, 16)?;
        Ok(get_u64(OUT_HEADER))
    }

    fn read(&mut self, node: u64, fh: u64, size: u32) -> Result<usize, i32> {
        put(IN_HEADER, fh.to_le_bytes());
        put(IN_HEADER + 8, 0u64.to_le_bytes());
        put(IN_HEADER + 16, size.to_le_bytes());
        put(IN_HEADER + 20, [0u8; 20]);
        self.call(READ, node, 40, size as usize)
    }

    fn release(&mut self, node: u64, fh: u64) -> Result<(), i32> {
        put(IN_HEADER, fh.to_le_bytes());
        put(IN_HEADER + 8, [0u8; 16]);
        self.call(RELEASE, node, 24, 0).map(|_| ())
    }

    /// Creates (or truncates) `name` in the root; returns (node, fh).
    fn create(&mut self, name: &str) -> Result<(u64, u64), i32> {
        put(IN_HEADER, (O_RDWR | O_CREAT | O_TRUNC).to_le_bytes());
        put(IN_HEADER + 4, 0o644u32.to_le_bytes());
        put(IN_HEADER + 8, 0o022u32.to_le_bytes());
        put(IN_HEADER + 12, 0u32.to_le_bytes());
        let n = Self::name(16, name);
        self.call(CREATE, ROOT, 16 + n, 128 + 16)?;
        Ok((get_u64(OUT_HEADER), get_u64(OUT_HEADER + 128)))
    }

    fn write(&mut self, node: u64, fh: u64, data: &[u8]) -> Result<u32, i32> {
        put(IN_HEADER, fh.to_le_bytes());
        put(IN_HEADER + 8, 0u64.to_le_bytes());
        put(IN_HEADER + 16, (data.len() as u32).to_le_bytes());
        put(IN_HEADER + 20, [0u8; 20]);
        for (i, b) in data.iter().enumerate() {
            unsafe { write_volatile(req().add(IN_HEADER + 40 + i), *b) };
        }
        self.call(WRITE, node, 40 + data.len(), 8)?;
        Ok(get_u32(OUT_HEADER))
    }
}

/// The device's tag from its config space.
fn tag_of(dev: &Device, out: &mut [u8; TAG_MAX]) -> usize {
    for (i, b) in out.iter_mut().enumerate() {
        *b = dev.config_u8(i as u64);
    }
    out.iter().position(|&b| b == 0).unwrap_or(TAG_MAX)
}

pub fn run(boot: &crate::BootInfo) -> ! {
    let want = boot.param("probe.tag").unwrap_or("");
    let reads: u32 = boot
        .param("probe.reads")
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    let mut bases = [0u64; 8];
    let n = crate::virtio::devices(boot.cmdline, &mut bases);
    let mut seen = Line::new();
    for &b in &bases[..n] {
        let dev = Device { base: b };
        if dev.device_id() != TYPE_FS {
            continue;
        }
        let mut t = [0u8; TAG_MAX];
        let len = tag_of(&dev, &mut t);
        let tag = core::str::from_utf8(&t[..len]).unwrap_or("?");
        let _ = write!(seen, " {tag}");
        if tag == want {
            match exercise(dev, reads) {
                Ok(line) => result(true, format_args!("{}", line.as_str())),
                Err((what, 0)) => result(false, format_args!("tag={tag}: {what}")),
                Err((what, errno)) => result(
                    false,
                    format_args!("tag={tag}: {what} failed: errno {errno}"),
                ),
            }
        }
    }
    result(
        false,
        format_args!(
            "no virtio-fs device with tag {want:?}; tags:{}",
            seen.as_str()
        ),
    )
}

/// What failed, and the errno the server answered (0: not a server error).
type Failure = (&'static str, i32);

/// With `reads` > 0, reads `hello.txt` that many more times (printing progress every 8), a
/// workload that is mid-request when the host kills the backend.
fn exercise(dev: Device, reads: u32) -> Result<Line, Failure> {
    let fail = |what: &'static str, e: i32| (what, -e);
    let msg = |what: &'static str| (what, 0);
    dev.init(0).map_err(msg)?;
    let rings = unsafe { &mut *addr_of_mut!(RINGS) };
    let (hiprio, request) = rings.split_at_mut(1);
    dev.setup_queue(0, &mut hiprio[0]).map_err(msg)?;
    let q = dev.setup_queue(1, &mut request[0]).map_err(msg)?;
    dev.driver_ok();
    let mut s = Session { dev, q, unique: 0 };

    // fuse_init_in: major 7, minor 31, max_readahead, flags.
    put(IN_HEADER, 7u32.to_le_bytes());
    put(IN_HEADER + 4, 31u32.to_le_bytes());
    put(IN_HEADER + 8, 0u32.to_le_bytes());
    put(IN_HEADER + 12, 0u32.to_le_bytes());
    s.call(INIT, 0, 16, 64).map_err(|e| fail("INIT", e))?;
    let (major, minor) = (get_u32(OUT_HEADER), get_u32(OUT_HEADER + 4));
    if major != 7 {
        return Err(msg("INIT: the server does not speak FUSE 7"));
    }

    let (node, size) = s
        .lookup("hello.txt")
        .map_err(|e| fail("LOOKUP hello.txt", e))?;
    let fh = s
        .open(node, O_RDONLY)
        .map_err(|e| fail("OPEN hello.txt", e))?;
    let got = s
        .read(node, fh, 2048)
        .map_err(|e| fail("READ hello.txt", e))?;
    let mut first = [0u8; 128];
    let mut first_len = 0;
    for i in 0..got.min(first.len()) {
        let b = unsafe { read_volatile(reply().add(OUT_HEADER + i)) };
        if b == b'\n' {
            break;
        }
        first[i] = b;
        first_len = i + 1;
    }
    for k in 1..=reads {
        s.read(node, fh, 2048)
            .map_err(|e| fail("READ hello.txt again", e))?;
        if k % 8 == 0 {
            crate::genid::report();
            let _ = writeln!(crate::hw::Serial, "PROBE PROGRESS virtiofs reads={k}");
        }
    }
    s.release(node, fh)
        .map_err(|e| fail("RELEASE hello.txt", e))?;

    let (wnode, wfh) = s
        .create("written.txt")
        .map_err(|e| fail("CREATE written.txt", e))?;
    let wrote = s
        .write(wnode, wfh, b"probe wrote\n")
        .map_err(|e| fail("WRITE written.txt", e))?;
    s.release(wnode, wfh)
        .map_err(|e| fail("RELEASE written.txt", e))?;
    let (_, wsize) = s
        .lookup("written.txt")
        .map_err(|e| fail("LOOKUP written.txt", e))?;

    let mut out = Line::new();
    let _ = write!(
        out,
        "fuse=7.{minor} hello.size={size} read={got} wrote={wrote} written.size={wsize} first-line={}",
        core::str::from_utf8(&first[..first_len]).unwrap_or("?")
    );
    Ok(out)
}
