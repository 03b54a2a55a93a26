//! `ep_moe_forward` on GPUs: the fused kernels' two calls with the
//! activation between them, all enqueued on the caller's stream, never
//! synchronising with the host (capturable in a CUDA graph):
//! - the dispatch and the gate+up GEMM into `y1` (`MegaMode::dispatch_gemm`:
//!   routing kernels, the fused kernel), the first collective call;
//! - SwiGLU of the real expert-major rows of `y1` into `act`, BF16 or
//!   requantized to FP8 (kernels/moe.cu, one launch; it reads the layout
//!   the dispatch wrote into the handle, so the host needs no counts);
//! - the down GEMM of `act` into `y2` and the combine into the caller's
//!   `out` (`MegaMode::gemm_combine`: the fused kernel, barrier, reduce),
//!   the second collective call. Neither needs a closing barrier: the
//!   combine's middle barrier closes the dispatch, and the next call's
//!   closes the combine when it needs it (`normal::Exchange`).

use super::mega::MegaMode;
use super::normal::{GpuHandle, NormalMode};
use super::{ptr, Bound};
use crate::abi::{MoeParams, MOE_BLOCKS_PER_SM, MOE_THREADS};
use crate::error::{Error, Result};
use crate::reference::Dtype;
use crate::runtime::backend::{HandleState, Stream};
use crate::runtime::ops::MoeOp;
use crate::runtime::sequence::Call;

/// `ep_moe_forward` (calls `calls[0]` and `calls[1]`).
pub fn forward(
    rt: &Bound,
    normal: &mut NormalMode,
    mega: &mut MegaMode,
    calls: [Call; 2],
    op: &MoeOp,
    handle: &mut HandleState,
    stream: Stream,
) -> Result<()> {
    let hidden = rt.cfg.topo.hidden;
    mega.dispatch_gemm(rt, normal, calls[0], &op.gate_up(hidden), handle, stream)?;
    let layout = handle
        .downcast_ref::<GpuHandle>()
        .ok_or_else(|| Error::internal("not a GPU handle"))?
        .expert_layout
        .ptr();
    let e = &op.experts;
    let fp8 = e.dtype == Dtype::Fp8E4m3;
    let params = MoeParams {
        y1: ptr(e.y1),
        act: ptr(e.act),
        act_scales: if fp8 { ptr(e.act_scales) } else { 0 },
        expert_layout: layout,
        own_base: rt.memory.own_base(),
        status: rt.status_ptr(),
        rows: op.rows() as i64,
        intermediate: e.intermediate as i32,
        local_experts: rt.cfg.local_experts() as i32,
        fp8: fp8 as i32,
    };
    // SAFETY: the parameters describe the caller's arrays (valid until the
    // stream has run the kernels, API rule), the handle's layout and the
    // context's words.
    unsafe {
        rt.launch(
            &rt.kernels.moe_activation,
            activation_grid(rt, e.num_sms),
            MOE_THREADS as u32,
            0,
            stream,
            &params,
        )?;
    }
    mega.gemm_combine(rt, normal, calls[1], &op.down(hidden), handle, stream)
}

/// Blocks of the activation kernel: `MOE_BLOCKS_PER_SM` per SM of the
/// call's budget (`num_sms`, 0 = all), at most this rank's share of the
/// GPU. Its blocks wait for nothing, so any number runs correctly.
fn activation_grid(rt: &Bound, num_sms: usize) -> u32 {
    let mut sms = rt.placement.sm_share();
    if num_sms > 0 {
        sms = sms.min(num_sms as u32);
    }
    sms * MOE_BLOCKS_PER_SM as u32
}
