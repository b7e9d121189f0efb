//! virtio-net's own state beyond the transport: counters and a frame read from the TAP that
//! had not found guest buffers yet (it would be lost otherwise).

use serde::{Deserialize, Serialize};

use super::{MacAddr, Net, NetCounters, Tap, MAX_FRAME};
use crate::persist::object::Persist;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetState {
    pub counters: NetCounters,
    pub pending_rx: Option<Vec<u8>>,
}

pub struct NetArgs {
    pub id: String,
    pub tap: Tap,
    pub mac: MacAddr,
}

impl Persist for Net {
    type State = NetState;
    type Args = NetArgs;

    fn save(&self) -> NetState {
        NetState {
            counters: self.counters,
            pending_rx: self.rx_len.map(|n| self.rx_frame[..n].to_vec()),
        }
    }

    fn restore(args: NetArgs, s: &NetState) -> Result<Self, String> {
        let mut n =
            Net::new(args.id, args.tap, args.mac).map_err(|e| format!("virtio-net: {e}"))?;
        n.counters = s.counters;
        if let Some(frame) = &s.pending_rx {
            if frame.len() > MAX_FRAME {
                return Err(format!(
                    "virtio-net: a pending frame of {} bytes (at most {MAX_FRAME})",
                    frame.len()
                ));
            }
            n.rx_frame[..frame.len()].copy_from_slice(frame);
            n.rx_len = Some(frame.len());
        }
        Ok(n)
    }
}
