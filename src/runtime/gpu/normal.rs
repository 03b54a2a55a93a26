//! Normal mode on GPUs: layout, dispatch and combine over NVLink.

use super::{arg, Runtime};
use crate::error::{Error, Result};
use crate::runtime::backend::{HandleState, Stream};
use crate::runtime::config::Config;
use crate::runtime::ops::{CombineOp, DispatchOp, LayoutOp};

/// Threads per block of the layout kernel.
const LAYOUT_THREADS: u32 = 256;

/// Bytes of symmetric buffer the normal mode needs for `cfg`.
pub fn buffer_bytes(_cfg: &Config) -> usize {
    0
}

pub struct NormalMode {}

impl NormalMode {
    /// The mode's area starts at `offset` of every rank's symmetric buffer.
    pub fn new(_rt: &Runtime, _offset: usize) -> Result<NormalMode> {
        Ok(NormalMode {})
    }

    pub fn layout(&mut self, rt: &Runtime, op: &LayoutOp, stream: Stream) -> Result<()> {
        let topo = rt.cfg.topo;
        let mut topk_idx = op.topk_idx;
        let mut num_tokens = op.num_tokens as i32;
        let mut topk = topo.topk as i32;
        let mut num_experts = topo.num_experts as i32;
        let mut world = topo.world as i32;
        let mut per_rank = op.tokens_per_rank;
        let mut per_expert = op.tokens_per_expert;
        let mut in_rank = op.is_token_in_rank;
        let mut status = rt.status_ptr();
        let mut params = [
            arg(&mut topk_idx),
            arg(&mut num_tokens),
            arg(&mut topk),
            arg(&mut num_experts),
            arg(&mut world),
            arg(&mut per_rank),
            arg(&mut per_expert),
            arg(&mut in_rank),
            arg(&mut status),
        ];
        // SAFETY: the parameters match the kernel's signature; the caller's
        // arrays stay valid until the stream reaches the kernel (API rule).
        unsafe {
            rt.launch(
                "ep_layout_kernel",
                topo.world as u32,
                LAYOUT_THREADS,
                0,
                stream,
                &mut params,
            )
        }
    }

    pub fn new_handle_state(&mut self, _rt: &Runtime) -> Result<HandleState> {
        Ok(Box::new(()))
    }

    pub fn dispatch(
        &mut self,
        _rt: &Runtime,
        _op: &DispatchOp,
        _handle: &mut HandleState,
        _stream: Stream,
    ) -> Result<()> {
        Err(Error::unsupported(
            "the normal-mode dispatch is not available on the GPU backend in this build",
        ))
    }

    pub fn combine(
        &mut self,
        _rt: &Runtime,
        _op: &CombineOp,
        _handle: &HandleState,
        _stream: Stream,
    ) -> Result<()> {
        Err(Error::unsupported(
            "the normal-mode combine is not available on the GPU backend in this build",
        ))
    }
}
