//! The interface both backends implement. The context validates every
//! operation against the configuration before calling into a backend.

use super::ops::{
    CombineOp, DispatchOp, LayoutOp, LlCombineOp, LlDispatchOp, MegaCombineOp, MegaDispatchOp,
};
use crate::error::Result;
use std::any::Any;
use std::os::raw::c_void;

/// The caller's CUDA stream (`CUstream`); ignored by the host backend.
pub type Stream = *mut c_void;

/// A backend's private routing state, kept in an `ep_handle_t`.
pub type HandleState = Box<dyn Any + Send>;

pub trait Backend: Send {
    fn layout(&mut self, op: &LayoutOp, stream: Stream) -> Result<()>;
    fn new_handle_state(&mut self) -> Result<HandleState>;
    fn dispatch(&mut self, op: &DispatchOp, handle: &mut HandleState, stream: Stream)
        -> Result<()>;
    fn combine(&mut self, op: &CombineOp, handle: &HandleState, stream: Stream) -> Result<()>;
    /// `ep_mega_dispatch_gemm`: the dispatch (recorded in the handle as by
    /// `dispatch`), then the grouped GEMM of its expert-major rows.
    fn mega_dispatch_gemm(
        &mut self,
        op: &MegaDispatchOp,
        handle: &mut HandleState,
        stream: Stream,
    ) -> Result<()>;
    /// `ep_mega_gemm_combine`: the grouped GEMM of the handle's expert-major
    /// rows, then the expert-major combine of its output.
    fn mega_gemm_combine(
        &mut self,
        op: &MegaCombineOp,
        handle: &HandleState,
        stream: Stream,
    ) -> Result<()>;
    fn ll_dispatch(&mut self, op: &LlDispatchOp, stream: Stream) -> Result<()>;
    fn ll_combine(&mut self, op: &LlCombineOp, stream: Stream) -> Result<()>;
    /// The buffer a caller may fill with expert outputs in the masked layout
    /// and pass to `ll_combine` with `zero_copy`: (pointer, bytes).
    fn ll_combine_buffer(&mut self) -> Result<(*mut u8, usize)>;
}

/// The part of a backend that any thread may use while another thread is
/// inside an operation (which holds the backend's lock).
pub trait Monitor: Send + Sync {
    /// An error raised by enqueued work (a device-side timeout), or `Aborted`
    /// after `abort`.
    fn async_error(&self) -> Result<()>;
    /// Makes waiting host calls and in-flight kernels give up.
    fn abort(&self);
}
