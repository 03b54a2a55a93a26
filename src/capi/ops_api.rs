//! The operations: layout, normal-mode dispatch and combine, low-latency
//! dispatch and combine, the fused megakernels, and the whole expert MLP
//! (`ep_moe_forward`). Each one is enqueued on
//! `stream` and returns; one thread at a time per context.

use super::context_api::dtype;
use super::entry::{deref, read_versioned, run};
use super::types::*;
use crate::error::{Error, Result};
use crate::reference::normal::worst_case_rows;
use crate::runtime::backend::LlTimeline;
use crate::runtime::context::Context;
use crate::runtime::contract;
use crate::runtime::log;
use crate::runtime::ops::{
    expert_alignment, CombineOp, DispatchOp, ExpertMajorOut, LayoutOp, LlCombineOp, LlDispatchOp,
    MegaCombineOp, MegaDispatchOp, MegaOp, MoeExperts, MoeOp, Phases, SourceOrderOut,
};
use std::os::raw::c_void;

/// The caller's context; the log's lines of this call name its rank.
unsafe fn context<'a>(ctx: *const ep_ctx_t) -> Result<&'a Context> {
    let context = &deref(ctx, "ctx")?.inner;
    log::enter(context.config());
    Ok(context)
}

fn count(name: &str, value: i32) -> Result<usize> {
    usize::try_from(value).map_err(|_| Error::invalid(format!("{name} = {value} is negative")))
}

/// Computes, for `num_tokens` tokens routed by `topk_idx` (`[num_tokens,
/// topk]`, -1 = no expert): tokens per rank (`[world_size]`), tokens per
/// expert (`[num_experts]`, counting (token, slot) pairs) and whether each
/// token goes to each rank (`[num_tokens, world_size]`, 0 or 1). An expert id
/// out of range, or listed twice for one token, is an error (on the GPU,
/// reported by `ep_ctx_get_async_error` and the next call), never used as an
/// address. Not collective.
///
/// Pointers: `ctx` is required. `topk_idx`: required when num_tokens > 0;
/// may be NULL otherwise (then nothing is read). `num_tokens_per_rank`:
/// required. `num_tokens_per_expert`: required. `is_token_in_rank`: required
/// when num_tokens > 0; may be NULL otherwise (then not written). `stream`:
/// may be NULL (the legacy default stream).
#[no_mangle]
pub unsafe extern "C" fn ep_get_dispatch_layout(
    ctx: *mut ep_ctx_t,
    topk_idx: *const i32,
    num_tokens: i32,
    num_tokens_per_rank: *mut i32,
    num_tokens_per_expert: *mut i32,
    is_token_in_rank: *mut u8,
    stream: ep_stream_t,
) -> ep_status_t {
    run("ep_get_dispatch_layout", || {
        let context = context(ctx)?;
        let op = LayoutOp {
            num_tokens: count("num_tokens", num_tokens)?,
            topk_idx,
            tokens_per_rank: num_tokens_per_rank,
            tokens_per_expert: num_tokens_per_expert,
            is_token_in_rank,
        };
        log::debug!("ep_get_dispatch_layout: {}", op.describe());
        context.layout(&op, stream as *mut c_void)
    })
}

/// Worst-case output rows of one normal-mode dispatch on this context: the
/// source-order rows (`recv_capacity`) and the expert-major rows with the
/// given alignment (`expert_capacity`). `expert_alignment` takes the values
/// `ep_dispatch` takes (0 means 1, at most 1024).
///
/// Pointers: `ctx` is required. `recv_rows`, `expert_rows`: may be NULL
/// (then not written).
#[no_mangle]
pub unsafe extern "C" fn ep_get_dispatch_capacity(
    ctx: *const ep_ctx_t,
    expert_alignment: i32,
    recv_rows: *mut i32,
    expert_rows: *mut i32,
) -> ep_status_t {
    run("ep_get_dispatch_capacity", || {
        let cfg = context(ctx)?.config();
        let alignment = crate::runtime::ops::expert_alignment(expert_alignment)?;
        let (recv, expert) = worst_case_rows(cfg.topo, cfg.max_tokens, alignment);
        let fits = |rows: usize| {
            i32::try_from(rows).map_err(|_| Error::invalid("capacity exceeds INT32_MAX rows"))
        };
        if !recv_rows.is_null() {
            *recv_rows = fits(recv)?;
        }
        if !expert_rows.is_null() {
            *expert_rows = fits(expert)?;
        }
        Ok(())
    })
}

/// Fills `*args` with the defaults (no outputs, BF16) and its header. `args` is required.
#[no_mangle]
pub unsafe extern "C" fn ep_dispatch_args_init(args: *mut ep_dispatch_args_t) -> ep_status_t {
    run("ep_dispatch_args_init", || {
        super::entry::init_versioned(args)
    })
}

/// Fills `*args` with the defaults (source order) and its header. `args` is required.
#[no_mangle]
pub unsafe extern "C" fn ep_combine_args_init(args: *mut ep_combine_args_t) -> ep_status_t {
    run("ep_combine_args_init", || {
        super::entry::init_versioned(args)
    })
}

/// Fills `*args` with the defaults (FP8 output, both phases) and its header. `args` is required.
#[no_mangle]
pub unsafe extern "C" fn ep_ll_dispatch_args_init(args: *mut ep_ll_dispatch_args_t) -> ep_status_t {
    run("ep_ll_dispatch_args_init", || {
        super::entry::init_versioned(args)
    })
}

/// Fills `*args` with the defaults (both phases) and its header. `args` is required.
#[no_mangle]
pub unsafe extern "C" fn ep_ll_combine_args_init(args: *mut ep_ll_combine_args_t) -> ep_status_t {
    run("ep_ll_combine_args_init", || {
        super::entry::init_versioned(args)
    })
}

/// Fills `*args` with the defaults (BF16, no pointers, all SMs) and its
/// header. `args` is required.
#[no_mangle]
pub unsafe extern "C" fn ep_mega_args_init(args: *mut ep_mega_args_t) -> ep_status_t {
    run("ep_mega_args_init", || super::entry::init_versioned(args))
}

/// Fills `*args` with the defaults (BF16, no pointers, all SMs) and its
/// header. `args` is required.
#[no_mangle]
pub unsafe extern "C" fn ep_moe_args_init(args: *mut ep_moe_args_t) -> ep_status_t {
    run("ep_moe_args_init", || super::entry::init_versioned(args))
}

/// Creates a routing handle for `ctx`; free it with `ep_handle_destroy`.
/// On the GPU backend a handle's device arrays come from its context, which
/// makes two sets when it is created and keeps those of destroyed handles
/// for the next ones: creating and destroying handles then neither
/// allocates nor frees device memory (which, where ranks share a GPU, must
/// not happen while a call is in flight, see `ep_ctx_create`). A third
/// handle held at once allocates a set, freed with the context.
/// Pointers: `ctx` and `handle` are required.
#[no_mangle]
pub unsafe extern "C" fn ep_handle_create(
    ctx: *mut ep_ctx_t,
    handle: *mut *mut ep_handle_t,
) -> ep_status_t {
    run("ep_handle_create", || {
        let context = context(ctx)?;
        if handle.is_null() {
            return Err(Error::null("handle"));
        }
        let inner = context.new_handle()?;
        *handle = Box::into_raw(Box::new(ep_handle_t { inner }));
        Ok(())
    })
}

/// Frees a handle (no work using it may still be running). `handle` may be
/// NULL (then nothing happens).
#[no_mangle]
pub unsafe extern "C" fn ep_handle_destroy(handle: *mut ep_handle_t) -> ep_status_t {
    run("ep_handle_destroy", || {
        if !handle.is_null() {
            drop(Box::from_raw(handle));
        }
        Ok(())
    })
}

fn dispatch_op(a: &ep_dispatch_args_t) -> Result<DispatchOp> {
    let known = EP_DISPATCH_NO_HOST_SYNC | EP_DISPATCH_REUSE_LAYOUT | EP_DISPATCH_KEEP_PADDING;
    if a.flags & !known != 0 {
        return Err(Error::invalid(format!(
            "unknown dispatch flags 0x{:x}",
            a.flags
        )));
    }
    let recv = (!a.recv_x.is_null())
        .then(|| -> Result<SourceOrderOut> {
            Ok(SourceOrderOut {
                capacity: count("recv_capacity", a.recv_capacity)?,
                x: a.recv_x as *mut u8,
                scales: a.recv_x_scales,
                topk_idx: a.recv_topk_idx,
                topk_weights: a.recv_topk_weights,
                src_info: a.recv_src_info,
                num_rows: a.recv_num_tokens,
            })
        })
        .transpose()?;
    let alignment = expert_alignment(a.expert_alignment)?;
    let expert = (!a.expert_x.is_null())
        .then(|| -> Result<ExpertMajorOut> {
            Ok(ExpertMajorOut {
                capacity: count("expert_capacity", a.expert_capacity)?,
                alignment,
                keep_padding: a.flags & EP_DISPATCH_KEEP_PADDING != 0,
                x: a.expert_x as *mut u8,
                scales: a.expert_x_scales,
                weights: a.expert_weights,
                src_row: a.expert_src_row,
                offsets: a.expert_offsets,
                counts: a.expert_counts,
            })
        })
        .transpose()?;
    Ok(DispatchOp {
        num_tokens: count("num_tokens", a.num_tokens)?,
        dtype: dtype("dtype", a.dtype)?,
        no_host_sync: a.flags & EP_DISPATCH_NO_HOST_SYNC != 0,
        reuse_layout: a.flags & EP_DISPATCH_REUSE_LAYOUT != 0,
        x: a.x as *const u8,
        x_scales: a.x_scales,
        topk_idx: a.topk_idx,
        topk_weights: a.topk_weights,
        recv,
        expert,
        host_recv_num_rows: a.host_recv_num_tokens,
        host_expert_counts: a.host_expert_counts,
    })
}

/// Normal-mode dispatch: sends this rank's tokens to the ranks of their
/// experts and writes what this rank receives (see `ep_dispatch_args_t`),
/// recording the layout in `handle` for `ep_combine`. Unless
/// `EP_DISPATCH_NO_HOST_SYNC`, waits for the counts and writes the `host_*`
/// outputs before returning (on the GPU with one node, as soon as the
/// counts are known, while the rows still move; the device outputs are
/// complete in stream order, like those of any enqueued work). Such a call
/// cannot be captured in a CUDA graph. Every rank of the context must call
/// it.
///
/// Pointers: `ctx`, `args` and `handle` are required; `stream` may be NULL
/// (the legacy default stream). The pointers in `args` follow their fields'
/// rules.
#[no_mangle]
pub unsafe extern "C" fn ep_dispatch(
    ctx: *mut ep_ctx_t,
    args: *const ep_dispatch_args_t,
    handle: *mut ep_handle_t,
    stream: ep_stream_t,
) -> ep_status_t {
    run("ep_dispatch", || {
        let context = context(ctx)?;
        let op = dispatch_op(&read_versioned(args)?)?;
        let handle = handle.as_mut().ok_or_else(|| Error::null("handle"))?;
        log::debug!("ep_dispatch: {}", op.describe());
        context.dispatch(&op, &mut handle.inner, stream as *mut c_void)
    })
}

fn combine_op(a: &ep_combine_args_t) -> Result<CombineOp> {
    let expert_major = match a.input_layout {
        EP_COMBINE_SOURCE_ORDER => false,
        EP_COMBINE_EXPERT_MAJOR => true,
        other => {
            return Err(Error::invalid(format!(
                "input_layout = {other} is not an EP_COMBINE_* value"
            )))
        }
    };
    Ok(CombineOp {
        expert_major,
        x: a.x as *const u8,
        out: a.out as *mut u8,
    })
}

/// Normal-mode combine: returns rows to the ranks their tokens came from and
/// sums them per token (see `ep_combine_args_t`), using the layout in
/// `handle`, whose dispatch must have produced the rows of `input_layout`
/// (else `EP_ERR_INVALID_ARGUMENT`). Every rank of the context must call it,
/// with handles of the same dispatch call.
///
/// Pointers: `ctx`, `args` and `handle` are required; `stream` may be NULL
/// (the legacy default stream). The pointers in `args` follow their fields'
/// rules.
#[no_mangle]
pub unsafe extern "C" fn ep_combine(
    ctx: *mut ep_ctx_t,
    args: *const ep_combine_args_t,
    handle: *const ep_handle_t,
    stream: ep_stream_t,
) -> ep_status_t {
    run("ep_combine", || {
        let context = context(ctx)?;
        let op = combine_op(&read_versioned(args)?)?;
        let handle = deref(handle, "handle")?;
        log::debug!("ep_combine: {}", op.describe());
        context.combine(&op, &handle.inner, stream as *mut c_void)
    })
}

fn check_ll_flags(flags: u32, allowed: u32) -> Result<Phases> {
    if flags & !allowed != 0 {
        return Err(Error::invalid(format!(
            "unknown low-latency flags 0x{:x}",
            flags & !allowed
        )));
    }
    Phases::from_flags(flags & EP_LL_SEND_ONLY != 0, flags & EP_LL_RECV_ONLY != 0)
}

/// Low-latency dispatch: quantizes (FP8) and sends this rank's tokens to the
/// ranks of their experts, and writes the masked layout this rank receives
/// (see `ep_ll_dispatch_args_t`). No host synchronisation; capturable in a
/// CUDA graph. With `EP_LL_SEND_ONLY` it returns after the send phase; the
/// same call with `EP_LL_RECV_ONLY` completes it, and no other operation of
/// the context may come between them. Every rank of the context must call it.
/// The context's calls must run on the GPU in the order they are made (one
/// stream, or streams ordered by events): a call acknowledges to the peers
/// that the previous one has finished reading their data.
///
/// Pointers: `ctx` and `args` are required; `stream` may be NULL (the legacy
/// default stream). The pointers in `args` follow their fields' rules.
///
/// Calls in flight: dispatch and combine each alternate between two buffer
/// sets of the context. Any number of calls may be enqueued. A rank's call
/// `n` writes into a peer's set only after that peer has finished receiving
/// call `n - 2` (the last user of the set), so a rank runs at most one call
/// ahead of its slowest peer and otherwise waits on the GPU. A peer that
/// stays behind (or never calls) for longer than `timeout_ms` ends the wait
/// in `EP_ERR_TIMEOUT` (`ep_ctx_get_async_error`); a call never reads the
/// data of another call.
#[no_mangle]
pub unsafe extern "C" fn ep_ll_dispatch(
    ctx: *mut ep_ctx_t,
    args: *const ep_ll_dispatch_args_t,
    stream: ep_stream_t,
) -> ep_status_t {
    run("ep_ll_dispatch", || {
        let context = context(ctx)?;
        let a = read_versioned(args)?;
        let phases = check_ll_flags(
            a.flags,
            EP_LL_SEND_ONLY | EP_LL_RECV_ONLY | EP_LL_UE8M0_SCALES,
        )?;
        let op = LlDispatchOp {
            num_tokens: count("num_tokens", a.num_tokens)?,
            out_dtype: dtype("out_dtype", a.out_dtype)?,
            ue8m0: a.flags & EP_LL_UE8M0_SCALES != 0,
            phases,
            x: a.x as *const u8,
            topk_idx: a.topk_idx,
            topk_weights: a.topk_weights,
            recv_x: a.recv_x as *mut u8,
            recv_scales: a.recv_x_scales,
            recv_count: a.recv_count,
            recv_src_info: a.recv_src_info,
            recv_layout_range: a.recv_layout_range,
            device_num_tokens: a.device_num_tokens,
        };
        log::debug!("ep_ll_dispatch: {}", op.describe());
        context.ll_dispatch(&op, stream as *mut c_void)
    })
}

/// Low-latency combine: returns expert outputs to the ranks their tokens came
/// from and writes the weighted sums (see `ep_ll_combine_args_t`). Same phase
/// rules as `ep_ll_dispatch`. Every rank of the context must call it. It
/// combines the context's most recent low-latency dispatch: call the two in
/// pairs (dispatch, combine, dispatch, combine), with the dispatch's
/// `num_tokens` and `topk_idx` (else `EP_ERR_INVALID_ARGUMENT`; the host
/// backend compares `topk_idx`, the GPU backend trusts it).
///
/// Pointers: `ctx` and `args` are required; `stream` may be NULL (the legacy
/// default stream). The pointers in `args` follow their fields' rules.
#[no_mangle]
pub unsafe extern "C" fn ep_ll_combine(
    ctx: *mut ep_ctx_t,
    args: *const ep_ll_combine_args_t,
    stream: ep_stream_t,
) -> ep_status_t {
    run("ep_ll_combine", || {
        let context = context(ctx)?;
        let a = read_versioned(args)?;
        let phases = check_ll_flags(a.flags, EP_LL_SEND_ONLY | EP_LL_RECV_ONLY | EP_LL_ZERO_COPY)?;
        let op = LlCombineOp {
            num_tokens: count("num_tokens", a.num_tokens)?,
            phases,
            zero_copy: a.flags & EP_LL_ZERO_COPY != 0,
            x: a.x as *const u8,
            topk_idx: a.topk_idx,
            topk_weights: a.topk_weights,
            src_info: a.src_info,
            layout_range: a.layout_range,
            out: a.out as *mut u8,
            device_num_tokens: a.device_num_tokens,
        };
        log::debug!("ep_ll_combine: {}", op.describe());
        context.ll_combine(&op, stream as *mut c_void)
    })
}

/// The library's low-latency combine send buffer, `[local_experts, W * M,
/// hidden]` BF16 (`*bytes` long): expert outputs written there in the masked
/// layout need no copy when combined with `EP_LL_ZERO_COPY`. Owned by the
/// context; valid until it is destroyed; read by the next `ep_ll_combine`
/// with `EP_LL_ZERO_COPY`. With several nodes (`ranks_per_node`), an
/// `ep_ll_combine` without it stages there the rows it returns to ranks of
/// other nodes (its contents are then overwritten).
///
/// Pointers: `ctx` and `buffer` are required; `bytes` may be NULL (then not
/// written).
#[no_mangle]
pub unsafe extern "C" fn ep_ll_get_combine_buffer(
    ctx: *mut ep_ctx_t,
    buffer: *mut *mut c_void,
    bytes: *mut usize,
) -> ep_status_t {
    run("ep_ll_get_combine_buffer", || {
        let context = context(ctx)?;
        if buffer.is_null() {
            return Err(Error::null("buffer"));
        }
        let (ptr, len) = context.ll_combine_buffer()?;
        *buffer = ptr as *mut c_void;
        if !bytes.is_null() {
            *bytes = len;
        }
        Ok(())
    })
}

/// For ep-bench's per-phase breakdown, not part of the C API: from now on
/// the low-latency kernels of `ctx` note device timestamps, or no longer
/// (GPU backend; `ll_timeline` reads them).
///
/// # Safety
/// `ctx` is NULL or a live context.
#[doc(hidden)]
pub unsafe fn ll_keep_timeline(ctx: *mut ep_ctx_t, keep: bool) -> Result<()> {
    context(ctx)?.ll_keep_timeline(keep)
}

/// The device timestamps of `ctx`'s last low-latency dispatch and combine
/// launches, after the caller has synchronised their stream (see
/// `LlTimeline`). Not part of the C API.
///
/// # Safety
/// `ctx` is NULL or a live context.
#[doc(hidden)]
pub unsafe fn ll_timeline(ctx: *mut ep_ctx_t) -> Result<LlTimeline> {
    context(ctx)?.ll_timeline()
}

/// The GEMM half of a fused call's arguments (its own values and pointers).
fn mega_op(a: &ep_mega_args_t) -> Result<MegaOp> {
    if a.flags != 0 {
        return Err(Error::invalid(format!(
            "unknown megakernel flags 0x{:x}",
            a.flags
        )));
    }
    Ok(MegaOp {
        dtype: dtype("weight_dtype", a.weight_dtype)?,
        n: count("n", a.n)?,
        k: count("k", a.k)?,
        num_sms: count("num_sms", a.num_sms)?,
        weights: a.weights as *const u8,
        weight_scales: a.weight_scales,
        y: a.y as *mut u8,
        x_scales: a.x_scales,
        dispatch_args: a.dispatch as *const c_void,
        combine_args: a.combine as *const c_void,
    })
}

/// Fused dispatch + grouped GEMM: dispatches like `ep_dispatch` (see
/// `ep_mega_args_t.dispatch`; the layout goes into `handle` for a later
/// combine) and multiplies each expert-major row by its local expert's
/// weights into `y` as soon as the row has arrived (see `ep_mega_args_t`).
/// Every rank of the context must call it.
///
/// Pointers: `ctx`, `args` and `handle` are required; `stream` may be NULL
/// (the legacy default stream). The pointers in `args` follow their fields'
/// rules (the dispatch half as for `ep_dispatch`, with its expert-major
/// output required).
#[no_mangle]
pub unsafe extern "C" fn ep_mega_dispatch_gemm(
    ctx: *mut ep_ctx_t,
    args: *const ep_mega_args_t,
    handle: *mut ep_handle_t,
    stream: ep_stream_t,
) -> ep_status_t {
    run("ep_mega_dispatch_gemm", || {
        let context = context(ctx)?;
        let handle = handle.as_mut().ok_or_else(|| Error::null("handle"))?;
        let a = read_versioned(args)?;
        let gemm = mega_op(&a)?;
        contract::check_field(contract::MEGA, "dispatch", &gemm, &gemm.facts(false))?;
        let mut dispatch = dispatch_op(&read_versioned(a.dispatch)?)?;
        // Implied: a fused dispatch never synchronises with the host.
        dispatch.no_host_sync = true;
        let op = MegaDispatchOp { dispatch, gemm };
        log::debug!("ep_mega_dispatch_gemm: {}", op.describe());
        context.mega_dispatch_gemm(&op, &mut handle.inner, stream as *mut c_void)
    })
}

/// Fused grouped GEMM + combine: multiplies the expert-major rows
/// `combine->x` of the handle's dispatch by their local experts' weights
/// into `y`, and combines `y` like `ep_combine` with
/// `EP_COMBINE_EXPERT_MAJOR` into `combine->out`, in the same persistent
/// kernel: once the GEMM has made all of `y`, every SM of the launch sends
/// tokens (see `ep_mega_args_t`). Every rank of the context must call it.
///
/// Pointers: `ctx`, `args` and `handle` are required; `stream` may be NULL
/// (the legacy default stream). The pointers in `args` follow their fields'
/// rules (the combine half's `x` is required, its `out` when the handle's
/// dispatch had tokens).
#[no_mangle]
pub unsafe extern "C" fn ep_mega_gemm_combine(
    ctx: *mut ep_ctx_t,
    args: *const ep_mega_args_t,
    handle: *const ep_handle_t,
    stream: ep_stream_t,
) -> ep_status_t {
    run("ep_mega_gemm_combine", || {
        let context = context(ctx)?;
        let handle = deref(handle, "handle")?;
        let a = read_versioned(args)?;
        let gemm = mega_op(&a)?;
        contract::check_field(contract::MEGA, "combine", &gemm, &gemm.facts(true))?;
        let combine = combine_op(&read_versioned(a.combine)?)?;
        let op = MegaCombineOp { combine, gemm };
        log::debug!("ep_mega_gemm_combine: {}", op.describe());
        context.mega_gemm_combine(&op, &handle.inner, stream as *mut c_void)
    })
}

/// The experts' half of `ep_moe_forward`'s arguments (its own values and
/// pointers).
fn moe_experts(a: &ep_moe_args_t) -> Result<MoeExperts> {
    if a.flags != 0 {
        return Err(Error::invalid(format!(
            "unknown ep_moe_forward flags 0x{:x}",
            a.flags
        )));
    }
    Ok(MoeExperts {
        dtype: dtype("weight_dtype", a.weight_dtype)?,
        intermediate: count("intermediate", a.intermediate)?,
        num_sms: count("num_sms", a.num_sms)?,
        w1: a.w1 as *const u8,
        w1_scales: a.w1_scales,
        w2: a.w2 as *const u8,
        w2_scales: a.w2_scales,
        y1: a.y1 as *mut u8,
        act: a.act as *mut u8,
        act_scales: a.act_scales,
        y2: a.y2 as *mut u8,
        dispatch_args: a.dispatch as *const c_void,
        combine_args: a.combine as *const c_void,
    })
}

/// The whole expert MLP of an MoE layer in one call: dispatch, the local
/// experts' gate+up GEMM, SwiGLU, down GEMM and combine (see
/// `ep_moe_args_t`), enqueued on `stream` without a host synchronisation.
/// The dispatch's layout goes into `handle` (on failure the handle holds
/// no layout). Every rank of the context must call it; it counts as two
/// collective calls (its dispatch, then its combine).
///
/// Pointers: `ctx`, `args` and `handle` are required; `stream` may be NULL
/// (the legacy default stream). The pointers in `args` follow their fields'
/// rules (the dispatch half as for `ep_dispatch`, with its expert-major
/// output required; of the combine half only `out` is used, required when
/// the dispatch has tokens).
#[no_mangle]
pub unsafe extern "C" fn ep_moe_forward(
    ctx: *mut ep_ctx_t,
    args: *const ep_moe_args_t,
    handle: *mut ep_handle_t,
    stream: ep_stream_t,
) -> ep_status_t {
    run("ep_moe_forward", || {
        let context = context(ctx)?;
        let handle = handle.as_mut().ok_or_else(|| Error::null("handle"))?;
        let a = read_versioned(args)?;
        let experts = moe_experts(&a)?;
        for half in ["dispatch", "combine"] {
            contract::check_field(contract::MOE, half, &experts, &experts.facts())?;
        }
        let mut dispatch = dispatch_op(&read_versioned(a.dispatch)?)?;
        // Implied: the call never synchronises with the host.
        dispatch.no_host_sync = true;
        let combine = combine_op(&read_versioned(a.combine)?)?;
        let op = MoeOp {
            dispatch,
            combine,
            experts,
        };
        log::debug!("ep_moe_forward: {}", op.describe());
        context.moe_forward(&op, &mut handle.inner, stream as *mut c_void)
    })
}
