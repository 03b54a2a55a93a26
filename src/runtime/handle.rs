//! The routing handle of the normal mode (`ep_handle_t`): the layout one
//! dispatch produced, kept for the combine that follows it.

use super::backend::HandleState;

pub struct Handle {
    /// The context that made it; a handle is valid with that context only.
    pub ctx_id: u64,
    /// Set by a successful dispatch; combine refuses a handle without one.
    pub has_layout: bool,
    pub state: HandleState,
}
