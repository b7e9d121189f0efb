//! The migration legs this node agent has started, remembered across reconciles.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

/// What this handler has started, so a reconcile that runs again does not start it twice.
#[derive(Default)]
pub struct Legs {
    /// Migration uid → the address the target launcher listens on.
    pub(crate) incoming: Mutex<HashMap<String, String>>,
    /// Migration uids whose MigrateOut this handler runs or ran: a reconcile working from a
    /// stale read must never start one again.
    pub(crate) outgoing: Mutex<HashSet<String>>,
    /// Those whose MigrateOut has ended.
    pub(crate) finished: Mutex<HashSet<String>>,
}
