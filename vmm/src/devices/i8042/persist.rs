//! The i8042's registers and output queue.

use serde::{Deserialize, Serialize};

use super::{Expect, I8042};
use crate::devices::EventFdTrigger;
use crate::persist::object::Persist;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct I8042State {
    pub status: u8,
    pub command_byte: u8,
    pub out: Vec<u8>,
    pub expect: Expect,
    pub last_read: u8,
}

/// The reset event and keyboard IRQ a restored controller raises.
pub struct I8042Args {
    pub reset_evt: EventFdTrigger,
    pub irq: EventFdTrigger,
}

use super::MAX_QUEUED;

impl Persist for I8042 {
    type State = I8042State;
    type Args = I8042Args;

    fn save(&self) -> I8042State {
        I8042State {
            status: self.status,
            command_byte: self.command_byte,
            out: self.out.iter().copied().collect(),
            expect: self.expect,
            last_read: self.last_read,
        }
    }

    fn restore(args: I8042Args, s: &I8042State) -> Result<Self, String> {
        if s.out.len() > MAX_QUEUED {
            return Err(format!(
                "i8042: {} queued bytes (at most {MAX_QUEUED})",
                s.out.len()
            ));
        }
        let mut d = I8042::new(args.reset_evt, args.irq);
        d.status = s.status;
        d.command_byte = s.command_byte;
        d.out = s.out.iter().copied().collect();
        d.expect = s.expect;
        d.last_read = s.last_read;
        Ok(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bus::BusDevice;
    use vmm_sys_util::eventfd::EventFd;

    fn args() -> I8042Args {
        I8042Args {
            reset_evt: EventFdTrigger(EventFd::new(libc::EFD_NONBLOCK).unwrap()),
            irq: EventFdTrigger(EventFd::new(libc::EFD_NONBLOCK).unwrap()),
        }
    }

    #[test]
    fn a_half_read_reply_survives() {
        let a = args();
        let mut d = I8042::new(a.reset_evt, a.irq);
        d.write(0, &[0xf2]); // identify: ACK, 0xab, 0x83
        let mut b = [0u8];
        d.read(0, &mut b);
        d.write(4, &[0x60]); // a command byte write is pending
        let state = d.save();
        let mut back = I8042::restore(args(), &state).unwrap();
        assert_eq!(back.save(), state);
        back.read(0, &mut b);
        assert_eq!(b[0], 0xab);
        let too_many = I8042State {
            out: vec![0; 65],
            ..state
        };
        assert!(I8042::restore(args(), &too_many).is_err());
    }
}
