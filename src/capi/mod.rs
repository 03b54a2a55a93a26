//! The C boundary. Only `#[repr(C)]` types ([`types`]) and `extern "C"`
//! functions live here; each function reads and checks what the caller passed,
//! then hands validated values to the runtime.

mod context_api;
mod defaults;
mod entry;
mod ops_api;
pub mod types;

pub use context_api::*;
pub use ops_api::*;
pub use types::*;
