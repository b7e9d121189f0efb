//! virtio-blk's own state beyond the transport: the counters a status report shows. Requests
//! are never in flight across a snapshot (they complete on the event thread, which is parked).

use serde::{Deserialize, Serialize};

use super::{Block, BlockCounters, Disk};
use crate::persist::object::Persist;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    pub counters: BlockCounters,
}

pub struct BlockArgs {
    pub id: String,
    pub disk: Disk,
    pub serial: Option<String>,
}

impl Persist for Block {
    type State = BlockState;
    type Args = BlockArgs;

    fn save(&self) -> BlockState {
        BlockState {
            counters: self.counters,
        }
    }

    fn restore(args: BlockArgs, s: &BlockState) -> Result<Self, String> {
        let mut b = Block::new(args.id, args.disk, args.serial.as_deref())
            .map_err(|e| format!("virtio-blk: {e}"))?;
        b.counters = s.counters;
        Ok(b)
    }
}
