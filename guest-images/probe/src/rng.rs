//! `probe.test=rng`: on the virtio-rng device, asks for two 32-byte buffers and checks each
//! comes back full, not all zero and unlike the other; offers a buffer the device may not
//! write and checks it is completed with nothing written. Prints the first random bytes.

use core::fmt::Write;
use core::ptr::{addr_of_mut, read_volatile};

use crate::virtio::{Device, Rings, DESC_F_WRITE};
use crate::{result, Line};

const TYPE_RNG: u32 = 4;
const SPINS: u32 = 5_000_000;
const ASK: u32 = 32;

static mut RINGS: Rings = Rings::new();

#[repr(C, align(4096))]
struct Page([u8; 4096]);
static mut BUF: Page = Page([0; 4096]);

pub fn run(cmdline: &str) -> ! {
    let mut bases = [0u64; 8];
    let n = crate::virtio::devices(cmdline, &mut bases);
    let Some(&base) = bases[..n]
        .iter()
        .find(|&&b| Device { base: b }.device_id() == TYPE_RNG)
    else {
        result(false, format_args!("no virtio-rng device"))
    };
    match exercise(Device { base }) {
        Ok(line) => result(true, format_args!("{}", line.as_str())),
        Err(what) => result(false, format_args!("{what}")),
    }
}

fn exercise(dev: Device) -> Result<Line, &'static str> {
    dev.init(0)?;
    let mut q = dev.setup_queue(0, unsafe { &mut *addr_of_mut!(RINGS) })?;
    dev.driver_ok();
    let buf = unsafe { addr_of_mut!(BUF.0) as *mut u8 };
    let at = |off: usize| unsafe { buf.add(off) };
    let bytes = |off: usize| -> [u8; ASK as usize] {
        core::array::from_fn(|i| unsafe { read_volatile(at(off + i)) })
    };
    let mut ask = |off: usize, flags: u16| -> Result<u32, &'static str> {
        q.push(&[(at(off) as u64, ASK, flags)]);
        dev.notify(&q);
        q.wait_used(SPINS)
            .map(|(_, len)| len)
            .ok_or("no answer from the device")
    };
    for off in [0, 64] {
        if ask(off, DESC_F_WRITE)? != ASK {
            return Err("a request was not filled");
        }
    }
    let (first, second) = (bytes(0), bytes(64));
    if first == [0; ASK as usize] || first == second {
        return Err("the device's bytes are not random");
    }
    // A buffer the driver marked read-only: the device must not write it.
    if ask(128, 0)? != 0 || bytes(128) != [0; ASK as usize] {
        return Err("the device wrote a read-only buffer");
    }
    let mut line = Line::new();
    let _ = write!(line, "bytes=");
    for b in &first[..8] {
        let _ = write!(line, "{b:02x}");
    }
    Ok(line)
}
