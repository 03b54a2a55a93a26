//! The interface both backends implement. The context validates every
//! operation (values, pointers, the order of calls) before calling into a
//! backend, and numbers the collective calls (`super::sequence`).

use super::contract::PointerCheck;
use super::ops::{
    CombineOp, DispatchOp, LayoutOp, LlCombineOp, LlDispatchOp, MegaCombineOp, MegaDispatchOp,
    MoeOp, Received,
};
use super::sequence::{Call, Collective};
use crate::error::{Error, Result};
use std::any::Any;
use std::os::raw::c_void;

/// The caller's CUDA stream (`CUstream`); ignored by the host backend.
pub type Stream = *mut c_void;

/// A backend's private routing state, kept in an `ep_handle_t`.
pub type HandleState = Box<dyn Any + Send>;

/// A collective operation whose caller's arrays a backend may check before
/// the call is made ([`Backend::check_inputs`]).
#[derive(Clone, Copy)]
pub enum Inputs<'a> {
    Dispatch(&'a DispatchOp, &'a HandleState),
    LlDispatch(&'a LlDispatchOp),
    LlCombine(&'a LlCombineOp),
}

/// A backend. Its [`PointerCheck`] says whether a pointer is memory it can
/// use: the host backend accepts any pointer; the GPU backend wants device
/// memory of its device for [`super::contract::Memory::Device`] fields.
pub trait Backend: PointerCheck + Send {
    /// Checks that this context may enqueue work on `stream` (the GPU
    /// backend: a stream of its device, or NULL); the host backend ignores
    /// streams.
    fn check_stream(&self, stream: Stream) -> Result<()>;
    /// Whether calls of `op` run here (the GPU backend: the fused and the
    /// low-latency calls need certain GPUs and NVLink domains); checked
    /// before such a call takes its collective number.
    fn check_supported(&self, _op: Collective) -> Result<()> {
        Ok(())
    }

    /// Checks what only this backend can check of the caller's arrays, before
    /// the call is made: nothing may be communicated or enqueued, and a
    /// failure leaves the backend as it was. The host backend reads the
    /// arrays (expert ids, routing against the dispatch's); the GPU backend
    /// cannot, and reports such errors from the device.
    fn check_inputs(&mut self, inputs: Inputs<'_>) -> Result<()>;

    fn layout(&mut self, op: &LayoutOp, stream: Stream) -> Result<()>;
    fn new_handle_state(&mut self) -> Result<HandleState>;
    /// Returns the rows received when this call told the host (a host
    /// synchronisation), else `None`; the context carries a reused layout's
    /// rows over from the handle's earlier dispatch.
    fn dispatch(
        &mut self,
        call: Call,
        op: &DispatchOp,
        handle: &mut HandleState,
        stream: Stream,
    ) -> Result<Option<Received>>;
    fn combine(
        &mut self,
        call: Call,
        op: &CombineOp,
        handle: &HandleState,
        stream: Stream,
    ) -> Result<()>;
    /// `ep_mega_dispatch_gemm`: the dispatch (recorded in the handle as by
    /// `dispatch`, never synchronising with the host), then the grouped GEMM
    /// of its expert-major rows.
    fn mega_dispatch_gemm(
        &mut self,
        call: Call,
        op: &MegaDispatchOp,
        handle: &mut HandleState,
        stream: Stream,
    ) -> Result<()>;
    /// `ep_mega_gemm_combine`: the grouped GEMM of the handle's expert-major
    /// rows, then the expert-major combine of its output.
    fn mega_gemm_combine(
        &mut self,
        call: Call,
        op: &MegaCombineOp,
        handle: &HandleState,
        stream: Stream,
    ) -> Result<()>;
    /// `ep_moe_forward`: the dispatch and the gate+up GEMM as
    /// `mega_dispatch_gemm` runs them (`op.gate_up`, call `calls[0]`, the
    /// layout recorded in the handle), SwiGLU of the real expert-major rows
    /// of `y1` into `act` (`crate::reference::moe::activate_row`; padding
    /// rows left as they were), then the down GEMM and the combine as
    /// `mega_gemm_combine` runs them (`op.down`, call `calls[1]`).
    fn moe_forward(
        &mut self,
        calls: [Call; 2],
        op: &MoeOp,
        handle: &mut HandleState,
        stream: Stream,
    ) -> Result<()>;
    fn ll_dispatch(&mut self, call: Call, op: &LlDispatchOp, stream: Stream) -> Result<()>;
    fn ll_combine(&mut self, call: Call, op: &LlCombineOp, stream: Stream) -> Result<()>;
    /// The buffer a caller may fill with expert outputs in the masked layout
    /// and pass to `ll_combine` with `zero_copy`: (pointer, bytes).
    fn ll_combine_buffer(&mut self) -> Result<(*mut u8, usize)>;
    /// From now on the low-latency kernels note device timestamps (for
    /// ep-bench's per-phase breakdown), or no longer do; a GPU backend's
    /// only.
    fn ll_keep_timeline(&mut self, _keep: bool) -> Result<()> {
        Err(Error::unsupported(
            "device timestamps exist on the GPU backend only",
        ))
    }
    /// The timestamps of the last low-latency dispatch and combine launches
    /// since `ll_keep_timeline`.
    fn ll_timeline(&mut self) -> Result<LlTimeline> {
        Err(Error::unsupported(
            "device timestamps exist on the GPU backend only",
        ))
    }
}

/// Device timestamps (global timer, ns) of the last low-latency dispatch
/// and combine launches: `ns[(op * blocks + block) * LL_TIME_POINTS +
/// point]`, op 0 the dispatch and 1 the combine, points
/// `crate::abi::LL_TIME_*`; 0 where a launch did not pass a point.
#[derive(Debug, Clone, PartialEq)]
pub struct LlTimeline {
    pub blocks: usize,
    pub ns: Vec<u64>,
}

/// The part of a backend that any thread may use while another thread is
/// inside an operation (which holds the backend's lock).
pub trait Monitor: Send + Sync {
    /// The error that ended this context's usefulness, or `Ok`: an error
    /// raised by enqueued work (a device-side timeout), a collective that
    /// failed on the host (a peer gone or silent), or `Aborted` after
    /// `abort`. Once set it stays, and the context refuses every call.
    fn async_error(&self) -> Result<()>;
    /// Makes waiting host calls and in-flight kernels give up.
    fn abort(&self);
}
