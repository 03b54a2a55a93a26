//! The routing handle of the normal mode (`ep_handle_t`): the layout one
//! dispatch produced, kept for the combine that follows it.

use super::backend::HandleState;
use super::ops::{DispatchOp, Received};

pub struct Handle {
    /// The context that made it; a handle is valid with that context only.
    pub ctx_id: u64,
    /// Set by a successful dispatch; combine refuses a handle without one.
    pub dispatch: Option<DispatchRecord>,
    pub state: HandleState,
}

/// What the runtime knows of the dispatch a handle holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DispatchRecord {
    /// Its call number (`super::sequence`): a combine carries it, so every
    /// rank checks that its peers combine the same dispatch.
    pub call: u64,
    pub num_tokens: usize,
    /// Which outputs it produced: a combine reads rows of one of them.
    pub source_order: bool,
    pub expert_major: bool,
    /// The rows it received, when the host learned them.
    pub received: Option<Received>,
}

impl DispatchRecord {
    /// The dispatch half of a fused call (call number `call`): expert-major
    /// rows always, source-order rows if asked for, and no host
    /// synchronisation, so the host has not learned the rows it received.
    pub fn fused(call: u64, op: &DispatchOp) -> DispatchRecord {
        DispatchRecord {
            call,
            num_tokens: op.num_tokens,
            source_order: op.recv.is_some(),
            expert_major: true,
            received: None,
        }
    }
}
