//! The C boundary. Only `#[repr(C)]` types ([`types`]) and `extern "C"`
//! functions live here; each function reads and checks what the caller passed,
//! then hands validated values to the runtime.
//!
//! The exported functions are `unsafe`: C callers pass raw pointers. Their
//! contract is the header's (see `types`): every pointer is NULL or valid for
//! the sizes the configuration and the arguments give, and is checked for
//! NULL here; so no per-function `# Safety` section repeats it.
#![allow(clippy::missing_safety_doc)]

mod context_api;
mod defaults;
mod entry;
mod ops_api;
pub mod types;

pub use context_api::*;
pub use ops_api::*;
pub use types::*;
