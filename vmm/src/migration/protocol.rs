//! The migration's message sequence, written once: the stages a conversation passes through
//! and which frame, from which side, moves it on. The source and the target each hold a
//! [`Conversation`] and put every frame they send or receive through it, so a frame out of
//! turn is refused the same way on both sides and neither side's code restates the order.
//!
//! ```text
//! Hello     ─ source: Hello ─────────────▶ Offered
//! Offered   ─ target: Ready ─────────────▶ Precopy        (target: Refuse ▶ Ended)
//! Precopy   ─ source: Plan ──────────────▶ Precopy
//!           ─ source: Pages ─────────────▶ Precopy
//!           ─ source: Sync ──────────────▶ Syncing ─ target: Synced ▶ Precopy
//!           ─ source: State ─────────────▶ StateSent
//! StateSent ─ target: Restored ──────────▶ Restored
//! Restored  ─ source: Go ────────────────▶ Handover
//! Handover  ─ target: Running ───────────▶ Done
//! ```
//! Until Go the source may Cancel, and from the Hello until Running the target may say Failed
//! (a stream it cannot read ends there too); both end the conversation (the guest stays on
//! the source).

use std::io::{Read, Write};

use super::wire::{self, FrameHeader, Kind, WireError};
use super::{MigrationError, Side};
use crate::memory::RegionLayout;

/// Where a conversation is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Nothing said yet: the source offers the machine.
    Hello,
    /// The target decides whether it can take the machine.
    Offered,
    /// Memory flows while the guest runs on the source (and, paused, its last pages).
    Precopy,
    /// The source waits until the target has taken in every page sent.
    Syncing,
    /// The target restores the machine state, paused.
    StateSent,
    /// The target holds the restored machine; the source hands it over.
    Restored,
    /// The target was told to run the guest; it resumes it and confirms.
    Handover,
    /// The guest runs on the target.
    Done,
    /// Refused, cancelled or failed: nothing more is said.
    Ended,
}

const KINDS: [Kind; 13] = [
    Kind::Hello,
    Kind::Pages,
    Kind::State,
    Kind::Go,
    Kind::Cancel,
    Kind::Sync,
    Kind::Plan,
    Kind::Ready,
    Kind::Refuse,
    Kind::Restored,
    Kind::Failed,
    Kind::Running,
    Kind::Synced,
];

/// The stage after `from` says `kind` in `stage`; `None`: that frame is out of turn.
pub fn next(stage: Stage, from: Side, kind: Kind) -> Option<Stage> {
    use Side::{Source, Target};
    use Stage::*;
    Some(match (stage, from, kind) {
        (Hello, Source, Kind::Hello) => Offered,
        (Offered, Target, Kind::Ready) => Precopy,
        (Offered, Target, Kind::Refuse) => Ended,
        (Precopy, Source, Kind::Plan | Kind::Pages) => Precopy,
        (Precopy, Source, Kind::Sync) => Syncing,
        (Syncing, Target, Kind::Synced) => Precopy,
        (Precopy, Source, Kind::State) => StateSent,
        (StateSent, Target, Kind::Restored) => Restored,
        (Restored, Source, Kind::Go) => Handover,
        (Handover, Target, Kind::Running) => Done,
        (Offered | Precopy | Syncing | StateSent | Restored, Source, Kind::Cancel) => Ended,
        (Offered | Precopy | Syncing | StateSent | Restored | Handover, Target, Kind::Failed) => {
            Ended
        }
        _ => return None,
    })
}

/// What `from` may say next in `stage`, other than giving up ("Ready", "Pages, Sync or State").
pub fn expected(stage: Stage, from: Side) -> String {
    let names: Vec<String> = KINDS
        .iter()
        .filter(|k| !matches!(k, Kind::Cancel | Kind::Failed | Kind::Refuse))
        .filter(|k| next(stage, from, **k).is_some())
        .map(|k| format!("{k:?}"))
        .collect();
    match names.as_slice() {
        [] => "nothing".into(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}

fn other(side: Side) -> Side {
    match side {
        Side::Source => Side::Target,
        Side::Target => Side::Source,
    }
}

/// One side's end of the conversation over `stream`.
pub struct Conversation<'s, S> {
    stream: &'s mut S,
    side: Side,
    stage: Stage,
}

impl<'s, S: Read + Write> Conversation<'s, S> {
    fn new(stream: &'s mut S, side: Side) -> Self {
        Conversation {
            stream,
            side,
            stage: Stage::Hello,
        }
    }

    /// The source's end: the stream's header written (the Hello is the source's to say).
    pub fn open(stream: &'s mut S) -> Result<Self, MigrationError> {
        wire::write_header(stream)?;
        Ok(Self::new(stream, Side::Source))
    }

    /// The target's end: the stream's header read and checked.
    pub fn accept(stream: &'s mut S) -> Result<Self, MigrationError> {
        wire::read_header(stream)?;
        Ok(Self::new(stream, Side::Target))
    }

    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// Sends a frame (not yet flushed); a frame out of turn is this side's own bug, refused.
    pub fn send(&mut self, kind: Kind, payload: &[u8]) -> Result<(), MigrationError> {
        let next = next(self.stage, self.side, kind).ok_or(MigrationError::OutOfTurn {
            kind,
            stage: self.stage,
        })?;
        wire::write_frame(self.stream, kind, payload)?;
        self.stage = next;
        Ok(())
    }

    pub fn flush(&mut self) -> Result<(), MigrationError> {
        Ok(self.stream.flush()?)
    }

    /// Sends and flushes.
    pub fn say(&mut self, kind: Kind, payload: &[u8]) -> Result<(), MigrationError> {
        self.send(kind, payload)?;
        self.flush()
    }

    /// The stream, for the Pages frames `PagesWriter` builds in pre-copy.
    pub fn pages_stream(&mut self) -> &mut S {
        debug_assert_eq!(self.stage, Stage::Precopy, "Pages only in pre-copy");
        self.stream
    }

    /// The other side's next frame. A frame out of turn is an error naming what was expected;
    /// the other side giving up (Refuse, Failed, Cancel) is the error with its reason.
    pub fn receive(&mut self) -> Result<(Kind, Vec<u8>), MigrationError> {
        let header = self.receive_header()?;
        let mut payload = Vec::new();
        let (kind, len) = self.payload(header, &mut payload)?;
        payload.truncate(len);
        Ok((kind, payload))
    }

    /// As `receive`, for the target taking in memory: a Pages frame's runs go straight into
    /// `memory` (see `FrameHeader::read_pages`), any other payload into `buf[..len]` (one
    /// buffer reused for every frame).
    /// With page streams (`page_streams` > 0) the pages travel there, and Pages here are
    /// refused.
    pub fn receive_into_memory(
        &mut self,
        buf: &mut Vec<u8>,
        memory: &crate::memory::GuestMemory,
        layout: &[RegionLayout],
        page_streams: usize,
    ) -> Result<(Kind, usize), MigrationError> {
        let header = self.receive_header()?;
        if header.kind == Kind::Pages {
            if page_streams > 0 {
                return Err(WireError::Malformed("Pages (the page streams carry them)").into());
            }
            header.read_pages(self.stream, memory, layout, None)?;
            return Ok((Kind::Pages, header.len));
        }
        self.payload(header, buf)
    }

    /// The next frame's header, refused when out of turn.
    fn receive_header(&mut self) -> Result<FrameHeader, MigrationError> {
        let from = other(self.side);
        let header = wire::read_frame_header(self.stream)?;
        let Some(next) = next(self.stage, from, header.kind) else {
            return Err(WireError::Unexpected {
                expected: expected(self.stage, from),
                got: header.kind,
            }
            .into());
        };
        self.stage = next;
        Ok(header)
    }

    /// The payload after `header` into `buf[..len]`; giving up is the error with its reason.
    fn payload(
        &mut self,
        header: FrameHeader,
        buf: &mut Vec<u8>,
    ) -> Result<(Kind, usize), MigrationError> {
        header.read_payload(self.stream, buf)?;
        let reason = || String::from_utf8_lossy(&buf[..header.len]).into_owned();
        match header.kind {
            Kind::Refuse => Err(MigrationError::Refused(reason())),
            Kind::Failed => Err(MigrationError::TargetFailed(reason())),
            Kind::Cancel => Err(MigrationError::Cancelled(reason())),
            kind => Ok((kind, header.len)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sequence both sides follow in a successful migration, frame by frame.
    const HAPPY: &[(Side, Kind)] = &[
        (Side::Source, Kind::Hello),
        (Side::Target, Kind::Ready),
        (Side::Source, Kind::Plan),
        (Side::Source, Kind::Pages),
        (Side::Source, Kind::Sync),
        (Side::Target, Kind::Synced),
        (Side::Source, Kind::Pages),
        (Side::Source, Kind::State),
        (Side::Target, Kind::Restored),
        (Side::Source, Kind::Go),
        (Side::Target, Kind::Running),
    ];

    #[test]
    fn a_successful_migration_walks_every_stage_to_done() {
        let mut stage = Stage::Hello;
        for (side, kind) in HAPPY {
            stage = next(stage, *side, *kind).unwrap_or_else(|| panic!("{kind:?} in {stage:?}"));
        }
        assert_eq!(stage, Stage::Done);
    }

    #[test]
    fn nobody_gives_up_once_the_guest_may_run_on_the_target() {
        for stage in [Stage::Handover, Stage::Done, Stage::Ended] {
            assert_eq!(next(stage, Side::Source, Kind::Cancel), None, "{stage:?}");
        }
        assert_eq!(next(Stage::Done, Side::Target, Kind::Failed), None);
        // A target that cannot read what was offered says so at once.
        assert_eq!(
            next(Stage::Offered, Side::Target, Kind::Failed),
            Some(Stage::Ended)
        );
        // Only the target says its side of things, only the source the source's.
        assert_eq!(next(Stage::Restored, Side::Target, Kind::Go), None);
        assert_eq!(next(Stage::Precopy, Side::Target, Kind::Pages), None);
        // A plan comes before the state; once the state is sent there is nothing to plan.
        assert_eq!(next(Stage::StateSent, Side::Source, Kind::Plan), None);
        assert_eq!(next(Stage::Offered, Side::Source, Kind::Plan), None);
    }

    #[test]
    fn what_is_expected_is_read_off_the_table() {
        assert_eq!(expected(Stage::Hello, Side::Source), "Hello");
        assert_eq!(expected(Stage::Offered, Side::Target), "Ready");
        assert_eq!(
            expected(Stage::Precopy, Side::Source),
            "Pages, State, Sync or Plan"
        );
        assert_eq!(expected(Stage::Restored, Side::Source), "Go");
        assert_eq!(expected(Stage::Done, Side::Source), "nothing");
    }

    #[test]
    fn a_frame_out_of_turn_is_refused_by_the_receiver() {
        let mut bytes = Vec::new();
        wire::write_frame(&mut bytes, Kind::Go, &[]).unwrap();
        let mut stream = std::io::Cursor::new(bytes);
        let mut c = Conversation::new(&mut stream, Side::Target);
        let e = c.receive().unwrap_err();
        assert_eq!(e.to_string(), "expected \"Hello\", got Go");
        // And a side may not say the other's lines.
        let mut sink = std::io::Cursor::new(Vec::new());
        let mut c = Conversation::new(&mut sink, Side::Source);
        assert!(c.send(Kind::Ready, &[]).is_err());
        assert!(sink.get_ref().is_empty(), "nothing written");
    }
}
