//! The i8042 keyboard controller with a minimal AT keyboard behind it: enough for a guest to
//! reset the machine (`reboot=k`: command 0xFE on port 0x64) and for the host to deliver
//! Ctrl-Alt-Del, which is how a guest without ACPI is asked to shut down gracefully.
//!
//! Written here rather than taken from vm-superio, whose I8042Device only implements the reset
//! command: Ctrl-Alt-Del needs the controller's self-test, command byte and output buffer and
//! the keyboard's reset/identify/LED/enable commands that Linux's i8042 and atkbd drivers use.

pub mod persist;

use std::collections::VecDeque;

use vm_superio::Trigger;

use crate::bus::BusDevice;
use crate::devices::EventFdTrigger;

const DATA: u64 = 0; // port 0x60
const COMMAND: u64 = 4; // port 0x64

const SB_OUT_FULL: u8 = 0x01;
const SB_SYS: u8 = 0x04;
const SB_LAST_WAS_COMMAND: u8 = 0x08;
/// The keylock switch is open (keyboard not inhibited); Linux warns "Keylock active" without it.
const SB_UNLOCKED: u8 = 0x10;

/// Command byte bits.
const CB_KBD_INT: u8 = 0x01;
const CB_POST_OK: u8 = 0x04;
const CB_KBD_DISABLED: u8 = 0x10;
const CB_TRANSLATE: u8 = 0x40;

const ACK: u8 = 0xfa;

/// The most bytes the keyboard holds for the guest (a saved state holds no more either).
pub(crate) const MAX_QUEUED: usize = 64;

/// Ctrl, Alt, Del pressed then released, in scancode set 1 (what the guest reads with
/// translation on) and set 2.
const CTRL_ALT_DEL_SET1: &[u8] = &[0x1d, 0x38, 0xe0, 0x53, 0xe0, 0xd3, 0xb8, 0x9d];
const CTRL_ALT_DEL_SET2: &[u8] = &[
    0x14, 0x11, 0xe0, 0x71, 0xe0, 0xf0, 0x71, 0xf0, 0x11, 0xf0, 0x14,
];

/// What the next byte written to the data port means.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Expect {
    KeyboardCommand,
    CommandByte,
    OutputPort,
    KeyboardOutput,
    AuxByte,
    /// The argument of a keyboard command (LEDs, typematic rate, scancode set).
    KeyboardArgument(u8),
}

pub struct I8042 {
    reset_evt: EventFdTrigger,
    irq: EventFdTrigger,
    status: u8,
    command_byte: u8,
    out: VecDeque<u8>,
    expect: Expect,
    last_read: u8,
}

impl I8042 {
    pub fn new(reset_evt: EventFdTrigger, irq: EventFdTrigger) -> Self {
        I8042 {
            reset_evt,
            irq,
            status: SB_SYS | SB_UNLOCKED,
            command_byte: CB_KBD_INT | CB_POST_OK | CB_TRANSLATE,
            out: VecDeque::new(),
            expect: Expect::KeyboardCommand,
            last_read: 0,
        }
    }

    /// Queues bytes for the guest to read. The queue is the keyboard's buffer, and like a
    /// real keyboard's it overruns: bytes beyond `MAX_QUEUED` are dropped. A guest writing
    /// commands without reading the answers (`out 0x60, 0xf2` in a loop) would otherwise grow
    /// it without bound, and a restore refuses more than that many.
    fn push(&mut self, bytes: &[u8]) {
        let was_empty = self.out.is_empty();
        let room = MAX_QUEUED.saturating_sub(self.out.len());
        if bytes.len() > room {
            tracing::debug!(
                "i8042: keyboard buffer overrun, {} bytes dropped",
                bytes.len() - room
            );
        }
        self.out.extend(&bytes[..bytes.len().min(room)]);
        if was_empty {
            self.signal();
        }
    }

    /// One interrupt per byte, as a real keyboard delivers them.
    fn signal(&mut self) {
        if !self.out.is_empty()
            && self.command_byte & CB_KBD_INT != 0
            && self.command_byte & CB_KBD_DISABLED == 0
        {
            let _ = self.irq.trigger();
        }
    }

    /// Queues Ctrl-Alt-Del as key presses and releases.
    pub fn ctrl_alt_del(&mut self) {
        let codes = if self.command_byte & CB_TRANSLATE != 0 {
            CTRL_ALT_DEL_SET1
        } else {
            CTRL_ALT_DEL_SET2
        };
        self.push(codes);
    }

    fn command(&mut self, cmd: u8) {
        self.status |= SB_LAST_WAS_COMMAND;
        match cmd {
            0x20 => self.push(&[self.command_byte]),
            0x60 => self.expect = Expect::CommandByte,
            0xa7 | 0xa8 => {} // disable / enable the aux port: there is none
            0xa9 => self.push(&[0xff]), // aux port test: no aux device
            0xaa => self.push(&[0x55]), // controller self-test passed
            0xab => self.push(&[0x00]), // keyboard port test passed
            0xad => self.command_byte |= CB_KBD_DISABLED,
            0xae => {
                self.command_byte &= !CB_KBD_DISABLED;
                self.signal();
            }
            0xd1 => self.expect = Expect::OutputPort,
            0xd2 => self.expect = Expect::KeyboardOutput,
            0xd3 | 0xd4 => self.expect = Expect::AuxByte,
            0xfe => {
                if let Err(e) = self.reset_evt.trigger() {
                    tracing::warn!("i8042 reset: {e}");
                }
            }
            other => tracing::debug!("i8042: unhandled controller command {other:#x}"),
        }
    }

    fn data(&mut self, v: u8) {
        self.status &= !SB_LAST_WAS_COMMAND;
        match std::mem::replace(&mut self.expect, Expect::KeyboardCommand) {
            Expect::CommandByte => {
                self.command_byte = v;
                self.signal();
            }
            Expect::OutputPort => {
                // Bit 0 low pulses the CPU reset line.
                if v & 1 == 0 {
                    let _ = self.reset_evt.trigger();
                }
            }
            Expect::KeyboardOutput => self.push(&[v]),
            Expect::AuxByte => {}
            Expect::KeyboardArgument(cmd) => {
                self.push(&[ACK]);
                if cmd == 0xf0 && v == 0 {
                    self.push(&[if self.command_byte & CB_TRANSLATE != 0 {
                        0x41
                    } else {
                        0x02
                    }]);
                }
            }
            Expect::KeyboardCommand => match v {
                0xff => self.push(&[ACK, 0xaa]),       // reset, self-test passed
                0xf2 => self.push(&[ACK, 0xab, 0x83]), // identify: MF2 keyboard
                0xee => self.push(&[0xee]),            // echo
                0xed | 0xf0 | 0xf3 => {
                    self.push(&[ACK]);
                    self.expect = Expect::KeyboardArgument(v); // LEDs, scancode set, typematic
                }
                _ => self.push(&[ACK]), // enable, disable, defaults, ...
            },
        }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if data.len() != 1 {
            data.fill(0xff);
            return;
        }
        data[0] = match offset {
            COMMAND => self.status | if self.out.is_empty() { 0 } else { SB_OUT_FULL },
            DATA => {
                if let Some(b) = self.out.pop_front() {
                    self.last_read = b;
                    self.signal();
                }
                self.last_read
            }
            _ => 0xff,
        };
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if data.len() != 1 {
            return;
        }
        match offset {
            COMMAND => self.command(data[0]),
            DATA => self.data(data[0]),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_sys_util::eventfd::EventFd;

    fn dev() -> (I8042, EventFd, EventFd) {
        let reset = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let d = I8042::new(
            EventFdTrigger(reset.try_clone().unwrap()),
            EventFdTrigger(irq.try_clone().unwrap()),
        );
        (d, reset, irq)
    }

    fn rd(d: &mut I8042, off: u64) -> u8 {
        let mut b = [0u8];
        d.read(off, &mut b);
        b[0]
    }

    /// `out 0x60, 0xf2` in a loop without reading: the buffer overruns at its size and the
    /// controller can still be saved and restored (so the VM can still migrate).
    #[test]
    fn a_guest_that_never_reads_cannot_grow_the_buffer() {
        use crate::persist::Persist;
        let (mut d, reset, irq) = dev();
        for _ in 0..100_000 {
            d.write(DATA, &[0xf2]);
        }
        assert_eq!(d.out.len(), MAX_QUEUED);
        let state = d.save();
        let args = persist::I8042Args {
            reset_evt: EventFdTrigger(reset.try_clone().unwrap()),
            irq: EventFdTrigger(irq.try_clone().unwrap()),
        };
        let mut back = I8042::restore(args, &state).expect("a full buffer restores");
        assert_eq!(rd(&mut back, DATA), ACK);
    }

    #[test]
    fn linux_probe_sequence() {
        let (mut d, _, _) = dev();
        assert_eq!(rd(&mut d, COMMAND) & SB_OUT_FULL, 0);
        d.write(COMMAND, &[0xaa]);
        assert_eq!(rd(&mut d, COMMAND) & SB_OUT_FULL, SB_OUT_FULL);
        assert_eq!(rd(&mut d, DATA), 0x55);
        d.write(COMMAND, &[0x20]);
        let cb = rd(&mut d, DATA);
        assert_eq!(cb & CB_TRANSLATE, CB_TRANSLATE);
        d.write(COMMAND, &[0x60]);
        d.write(DATA, &[cb & !CB_KBD_INT]);
        d.write(COMMAND, &[0x20]);
        assert_eq!(rd(&mut d, DATA), cb & !CB_KBD_INT);
        d.write(DATA, &[0xf2]);
        assert_eq!(
            [rd(&mut d, DATA), rd(&mut d, DATA), rd(&mut d, DATA)],
            [ACK, 0xab, 0x83]
        );
        d.write(DATA, &[0xed]);
        assert_eq!(rd(&mut d, DATA), ACK);
        d.write(DATA, &[0x02]);
        assert_eq!(rd(&mut d, DATA), ACK);
        assert_eq!(rd(&mut d, COMMAND) & SB_OUT_FULL, 0);
    }

    #[test]
    fn ctrl_alt_del_arrives_one_interrupt_per_byte() {
        let (mut d, _, irq) = dev();
        d.ctrl_alt_del();
        let mut got = vec![];
        while rd(&mut d, COMMAND) & SB_OUT_FULL != 0 {
            assert!(irq.read().unwrap() >= 1, "an interrupt for every byte");
            got.push(rd(&mut d, DATA));
        }
        assert_eq!(got, CTRL_ALT_DEL_SET1);
        assert!(irq.read().is_err(), "no interrupt once empty");
    }

    #[test]
    fn reset_commands_trigger_the_reset_event() {
        let (mut d, reset, _) = dev();
        d.write(COMMAND, &[0xfe]);
        assert_eq!(reset.read().unwrap(), 1);
        d.write(COMMAND, &[0xd1]);
        d.write(DATA, &[0xfe]);
        assert_eq!(reset.read().unwrap(), 1);
    }
}
