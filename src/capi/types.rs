//! Every `#[repr(C)]` type, handle and constant of the public header.
//!
//! Conventions (see README.md, "API conventions"):
//! - Every struct the caller passes starts with `struct_size`, `magic` and
//!   `version`. Fill them with the matching `ep_*_init` function (or the
//!   `EP_*_MAGIC` constant, `sizeof` and `EP_API_VERSION`). A struct from an
//!   older, smaller release is accepted down to its `EP_*_MIN_SIZE`; the fields
//!   it lacks take the defaults of its `ep_*_init`. A wrong magic, a size below
//!   the minimum or above this release's `sizeof` is rejected.
//! - Pointers named `host_*` are host memory. Every other data pointer is
//!   device memory of the context's GPU on the GPU backend, and host memory on
//!   the host backend. Tokens are row-major, one row of `hidden` elements each.
//! - Operations enqueue work on the caller's stream and return; outputs are
//!   ready when the stream reaches that point. The host backend computes
//!   synchronously and ignores the stream.
//! - Pointers: the doc of every pointer field and parameter says "Required."
//!   or when it may be NULL and what NULL then means. A required pointer that
//!   is NULL is `EP_ERR_NULL_POINTER`, naming it, before anything is
//!   enqueued; a NULL that is allowed is honoured (nothing read or written
//!   there). Every pointer must be aligned to its element (4 bytes for
//!   `int32_t` and `float`, 2 for BF16 rows), else `EP_ERR_INVALID_ARGUMENT`.
//! - Dispatch and combine (both modes) are collective: every rank of the
//!   context makes the same collective calls in the same order. Each
//!   context numbers its collective calls, and every exchange between ranks
//!   carries the operation and the number, so ranks in different calls all
//!   stop with `EP_ERR_REMOTE` (naming both calls) instead of mixing data. A
//!   call that fails its argument checks returns at once on its rank and is
//!   not made there (it takes no number and changes nothing): the peers'
//!   matching calls pair with that rank's next collective call if it is the
//!   same operation, end in `EP_ERR_REMOTE` if it is another, and in
//!   `EP_ERR_TIMEOUT` after `timeout_ms` if it does not come.
//! - A context whose enqueued work failed (`ep_ctx_get_async_error` is not
//!   `EP_SUCCESS`) refuses every call until it is destroyed; see
//!   `ep_ctx_get_async_error` for what to do.
#![allow(non_camel_case_types)]

use std::os::raw::c_void;

/// Status code returned by every function. `EP_SUCCESS` is zero.
pub type ep_status_t = i32;

/// The operation succeeded.
pub const EP_SUCCESS: ep_status_t = 0;
/// An argument is out of range or inconsistent with the configuration.
pub const EP_ERR_INVALID_ARGUMENT: ep_status_t = 1;
/// A required pointer argument is NULL.
pub const EP_ERR_NULL_POINTER: ep_status_t = 2;
/// The operation is not available on this backend, device or build.
pub const EP_ERR_UNSUPPORTED: ep_status_t = 3;
/// A host or device allocation failed.
pub const EP_ERR_OUT_OF_MEMORY: ep_status_t = 4;
/// The GPU backend was asked for, but no CUDA driver or GPU is usable.
pub const EP_ERR_CUDA_UNAVAILABLE: ep_status_t = 5;
/// A CUDA driver call or a kernel launch failed.
pub const EP_ERR_CUDA: ep_status_t = 6;
/// A peer rank did not answer in time (bootstrap or a device-side wait).
pub const EP_ERR_TIMEOUT: ep_status_t = 7;
/// The operation was enqueued and has not completed (async-error query).
pub const EP_IN_PROGRESS: ep_status_t = 8;
/// The context was aborted with `ep_ctx_abort`.
pub const EP_ERR_ABORTED: ep_status_t = 9;
/// A bug in the library; the message says where.
pub const EP_ERR_INTERNAL: ep_status_t = 10;
/// An operating-system call (socket, shared memory) failed.
pub const EP_ERR_SYSTEM: ep_status_t = 11;
/// A peer rank refused the connection, disagreed on the setup, or vanished.
pub const EP_ERR_REMOTE: ep_status_t = 12;

/// Version of this API, `major * 10000 + minor * 100 + patch`.
pub const EP_API_VERSION: u32 = 100;

/// Number of bytes of an `ep_unique_id_t`.
pub const EP_UNIQUE_ID_BYTES: usize = 128;
/// Largest supported `topk`.
pub const EP_MAX_TOPK: i32 = 16;
/// Largest supported number of experts.
pub const EP_MAX_EXPERTS: i32 = 1024;
/// Largest supported hidden size; every hidden size must be a multiple of
/// `EP_HIDDEN_ALIGNMENT`.
pub const EP_MAX_HIDDEN: i32 = 16384;
/// Hidden sizes, and the FP8 scaling blocks, are multiples of this.
pub const EP_HIDDEN_ALIGNMENT: i32 = 128;
/// Largest supported world size.
pub const EP_MAX_WORLD_SIZE: i32 = 64;
/// Largest `ll_max_tokens_per_rank`.
pub const EP_LL_MAX_TOKENS: i32 = 1024;
/// Largest `n` and `k` of a fused call's GEMM (`ep_mega_args_t`).
pub const EP_MEGA_MAX_DIM: i32 = 65536;
/// Largest intermediate size `I` of `ep_moe_forward` (`ep_moe_args_t`):
/// its gate+up GEMM makes `2I` columns, at most `EP_MEGA_MAX_DIM`.
pub const EP_MOE_MAX_INTERMEDIATE: i32 = 32768;

// The public limits are literals (cbindgen writes them into ep.h); the
// runtime and the kernels use the same values from src/abi/defs.rs.
const _: () = {
    use crate::abi;
    assert!(EP_MAX_TOPK as usize == abi::MAX_TOPK);
    assert!(EP_MAX_EXPERTS as usize == abi::MAX_EXPERTS);
    assert!(EP_MAX_HIDDEN as usize == abi::MAX_HIDDEN);
    assert!(EP_HIDDEN_ALIGNMENT as usize == abi::HIDDEN_ALIGNMENT);
    assert!(EP_MAX_WORLD_SIZE as usize == abi::MAX_WORLD_SIZE);
    assert!(EP_LL_MAX_TOKENS as usize == abi::LL_MAX_TOKENS);
    assert!(EP_MEGA_MAX_DIM as usize == crate::runtime::config::MAX_GEMM_DIM);
    assert!(EP_MOE_MAX_INTERMEDIATE as usize == crate::runtime::ops::MAX_INTERMEDIATE);
    assert!(2 * EP_MOE_MAX_INTERMEDIATE == EP_MEGA_MAX_DIM);
};

/// Backend selection (`ep_config_t.backend`).
/// `EP_BACKEND_AUTO`: the environment variable `EP_BACKEND` (`gpu` or
/// `host`) decides, and the GPU backend when it is unset. There is never a
/// silent fallback from the GPU to the host.
pub const EP_BACKEND_AUTO: i32 = 0;
/// CUDA GPUs; `ep_ctx_create` fails with `EP_ERR_CUDA_UNAVAILABLE` without one.
pub const EP_BACKEND_GPU: i32 = 1;
/// Host memory and the CPU, computed by the reference code. All ranks must be
/// on one host (threads or processes).
pub const EP_BACKEND_HOST: i32 = 2;

/// Token element types.
/// bfloat16, 2 bytes per element.
pub const EP_DTYPE_BF16: i32 = 1;
/// FP8 e4m3 (1 byte per element) with one fp32 scale per 128 channels:
/// `value = fp8 * scale`. Scales are `[rows, hidden / 128]` fp32.
pub const EP_DTYPE_FP8_E4M3: i32 = 2;

/// `ep_dispatch_args_t.flags`: no host synchronisation. Counts are written to
/// device memory only, outputs must have worst-case capacity
/// (`ep_get_dispatch_capacity`), and the call can be captured in a CUDA graph.
pub const EP_DISPATCH_NO_HOST_SYNC: u32 = 1;
/// `ep_dispatch_args_t.flags`: reuse the routing stored in the handle by an
/// earlier dispatch with the same `topk_idx` and `num_tokens`: the call
/// skips the host synchronisation and writes the `host_*` outputs from the
/// handle (the counts of that earlier dispatch, if it learned them). The
/// host backend checks that the routing is the same and fails otherwise; the
/// GPU backend cannot check without a synchronisation: its device outputs
/// follow the routing passed, its host counts stay the handle's.
pub const EP_DISPATCH_REUSE_LAYOUT: u32 = 2;
/// `ep_dispatch_args_t.flags`: the padding rows of the expert-major output
/// keep what they held: `expert_x` and `expert_x_scales` are written for
/// the rows of real (token, expert) pairs only, while `expert_weights` (0)
/// and `expert_src_row` (-1) still mark the padding. For grouped GEMMs that
/// skip padding rows, or whose results there are never read (the
/// expert-major combine ignores them): with a large `expert_alignment` and
/// few rows per expert, the padding is most of the output's bytes. Without
/// the flag padding rows are zeros. `ep_mega_dispatch_gemm` leaves the
/// padding rows of its GEMM's output `y` as they were too (its GEMM stores
/// the real rows only), and `ep_moe_forward` those of `y1` (`act` and `y2`
/// have their padding rows left as they were in any case).
pub const EP_DISPATCH_KEEP_PADDING: u32 = 4;

/// `ep_combine_args_t.input_layout`: one row per received source-order row
/// (`recv_x` order), already reduced over the rank's experts by the caller.
pub const EP_COMBINE_SOURCE_ORDER: i32 = 0;
/// `ep_combine_args_t.input_layout`: one row per expert-major row
/// (`expert_x` order); the library multiplies each row by its routing weight
/// and reduces a token's local experts before sending it back.
pub const EP_COMBINE_EXPERT_MAJOR: i32 = 1;

/// Low-latency flags (`ep_ll_*_args_t.flags`): run only the send phase and
/// return. The receive phase is run later by the same call with
/// `EP_LL_RECV_ONLY` and the same arguments, on any stream ordered after it.
pub const EP_LL_SEND_ONLY: u32 = 1;
/// Run only the receive phase of a call started with `EP_LL_SEND_ONLY`.
pub const EP_LL_RECV_ONLY: u32 = 2;
/// Dispatch: quantize to FP8 with power-of-two (UE8M0) scales.
pub const EP_LL_UE8M0_SCALES: u32 = 4;
/// Combine: `x` is the buffer returned by `ep_ll_get_combine_buffer`, already
/// filled in place by the caller (no copy).
pub const EP_LL_ZERO_COPY: u32 = 8;

/// Magic numbers of the versioned structs.
pub const EP_CONFIG_MAGIC: u32 = 0x4550_4346; // "EPCF"
pub const EP_DISPATCH_ARGS_MAGIC: u32 = 0x4550_4441; // "EPDA"
pub const EP_COMBINE_ARGS_MAGIC: u32 = 0x4550_4341; // "EPCA"
pub const EP_LL_DISPATCH_ARGS_MAGIC: u32 = 0x4550_4C44; // "EPLD"
pub const EP_LL_COMBINE_ARGS_MAGIC: u32 = 0x4550_4C43; // "EPLC"
pub const EP_MEGA_ARGS_MAGIC: u32 = 0x4550_4D47; // "EPMG"
pub const EP_MOE_ARGS_MAGIC: u32 = 0x4550_4D4F; // "EPMO"

/// Opaque communicator: one per rank. Created by `ep_ctx_create`, freed by
/// `ep_ctx_destroy`. Not thread-safe: one thread at a time may call functions
/// on a context, except `ep_ctx_abort` and `ep_ctx_get_async_error`, which any
/// thread may call at any time.
pub struct ep_ctx_t {
    pub(crate) inner: crate::runtime::context::Context,
}

/// Opaque routing handle of the normal mode: `ep_dispatch` writes the layout
/// of one dispatch into it and `ep_combine` reads it. Created with
/// `ep_handle_create`, reusable for any number of dispatches of its context;
/// freed by `ep_handle_destroy` (before its context). Its storage has a fixed
/// address, so a dispatch/combine pair that uses it can be captured in a CUDA
/// graph.
pub struct ep_handle_t {
    pub(crate) inner: crate::runtime::handle::Handle,
}

/// The caller's CUDA stream (`cudaStream_t` and `CUstream` are this type).
/// NULL is the legacy default stream (refused where ranks share a GPU, see
/// `ep_ctx_create`).
pub type ep_stream_t = *mut CUstream_st;

/// CUDA's opaque stream type, declared so that no CUDA header is needed.
pub enum CUstream_st {}

/// NCCL's opaque communicator type (`ncclComm_t` is a pointer to it),
/// declared so that no NCCL header is needed.
pub enum ncclComm {}

/// 128 opaque bytes made by `ep_get_unique_id` on one rank and sent by the
/// caller to every other rank. They hold the rendezvous address and a random
/// secret: treat them as a credential.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ep_unique_id_t {
    pub internal: [u8; EP_UNIQUE_ID_BYTES],
}

/// Configuration of a context. Every rank passes the same values.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ep_config_t {
    /// `sizeof(ep_config_t)` as the caller compiled it.
    pub struct_size: u32,
    /// `EP_CONFIG_MAGIC`.
    pub magic: u32,
    /// `EP_API_VERSION` as the caller compiled it.
    pub version: u32,
    /// Normal mode: most tokens one rank passes to one dispatch (default 4096).
    pub max_tokens_per_rank: i32,
    /// Elements per token; a multiple of 128, at most `EP_MAX_HIDDEN` (default 7168).
    pub hidden: i32,
    /// Experts per token, 1 to `EP_MAX_TOPK` (default 8).
    pub topk: i32,
    /// Experts in total, divisible by the world size, at most `EP_MAX_EXPERTS`
    /// (default 256). Rank `r` holds experts `[r * E / W, (r + 1) * E / W)`.
    pub num_experts: i32,
    /// Widest token type the normal mode will carry: `EP_DTYPE_BF16` (either
    /// type may be dispatched) or `EP_DTYPE_FP8_E4M3` (smaller buffers, FP8
    /// only). Default BF16.
    pub token_dtype: i32,
    /// `EP_BACKEND_*` (default `EP_BACKEND_AUTO`).
    pub backend: i32,
    /// Streaming multiprocessors the normal-mode kernels may use (default
    /// 24); on a GPU that ranks share, at most this rank's share of it (see
    /// `ep_ctx_create`).
    pub num_sms: i32,
    /// Longest wait, in milliseconds, for a peer during bootstrap and inside
    /// any kernel before giving up with `EP_ERR_TIMEOUT` (default 100000).
    pub timeout_ms: u32,
    /// Low-latency mode: most tokens one rank passes to one LL call, at most
    /// `EP_LL_MAX_TOKENS` (default 128); 0 disables the mode and its buffers.
    pub ll_max_tokens_per_rank: i32,
    /// Ranks per node: ranks `[n * R, (n + 1) * R)` form node `n`, and the
    /// ranks of one position in their nodes form a rail. 0 (default): the
    /// hosts decide (every host one node; its ranks must be consecutive and
    /// every host must hold as many); `ep_get_buffer_size_hint` then counts
    /// one node. Otherwise a divisor of the world size. With one node the
    /// single-node modes run. With several, `ep_dispatch` sends each token
    /// across the network once per destination node (to the rank of the
    /// source's rail there), which forwards it inside its node, and
    /// `ep_combine` sums inside each node first (see `ep_combine_args_t`);
    /// the low-latency calls put each (token, destination rank) across the
    /// network directly, with the same results as on one node.
    /// A value below a host's rank count splits the host into virtual nodes
    /// joined by an emulated network leg, to run the multi-node path on one
    /// host. Every rank passes the same value.
    pub ranks_per_node: i32,
}

/// Bytes of the oldest accepted `ep_config_t` (through `token_dtype`).
pub const EP_CONFIG_MIN_SIZE: u32 = 32;

/// Arguments of `ep_dispatch` (normal mode).
///
/// Received rows come in "source order": grouped by source rank (0 first),
/// and within one source in token order; a token appears once on each rank
/// that holds at least one of its experts. The optional "expert-major" output
/// holds one row per (received token, local expert) pair, each local expert's
/// rows contiguous (in source order), each expert's segment starting at a
/// multiple of `expert_alignment`. Either output may be skipped by passing a
/// NULL `recv_x` or `expert_x`, not both. Within a requested output, only the
/// rows (and their FP8 scales) and `expert_offsets` are required: the other
/// arrays may be NULL, for callers that do not need them (the combine keeps
/// its own copy of the routing in the handle).
///
/// On the GPU backend `x`, `recv_x` and `expert_x` must be 16-byte aligned
/// (rows move as 16-byte vectors; `cudaMalloc` memory is).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ep_dispatch_args_t {
    pub struct_size: u32,
    /// `EP_DISPATCH_ARGS_MAGIC`.
    pub magic: u32,
    pub version: u32,
    /// `EP_DISPATCH_*` flags.
    pub flags: u32,
    /// Tokens of this rank, 0 to `max_tokens_per_rank`.
    pub num_tokens: i32,
    /// `EP_DTYPE_BF16` or `EP_DTYPE_FP8_E4M3`.
    pub dtype: i32,
    /// `[num_tokens, hidden]` tokens. Required when num_tokens > 0; may be
    /// NULL otherwise (then nothing is read).
    pub x: *const c_void,
    /// FP8 only: `[num_tokens, hidden / 128]` fp32 scales. Required when
    /// dtype is FP8 and num_tokens > 0; may be NULL otherwise (then nothing
    /// is read).
    pub x_scales: *const f32,
    /// `[num_tokens, topk]` global expert ids; -1 means no expert. Required
    /// when num_tokens > 0; may be NULL otherwise (then nothing is read).
    pub topk_idx: *const i32,
    /// `[num_tokens, topk]` routing weights. Required when num_tokens > 0;
    /// may be NULL otherwise (then nothing is read).
    pub topk_weights: *const f32,

    /// Source-order output rows available (see `ep_get_dispatch_capacity`).
    pub recv_capacity: i32,
    /// Expert-major segment alignment in rows, 1 to 1024 (0 means 1).
    pub expert_alignment: i32,
    /// `[recv_capacity, hidden]` received tokens, the source-order output.
    /// Required when `expert_x` is NULL; may be NULL otherwise (then no
    /// source-order output; the other recv_* pointers are not used).
    pub recv_x: *mut c_void,
    /// FP8 only: `[recv_capacity, hidden / 128]` scales. Required when
    /// `recv_x` is given and dtype is FP8; may be NULL otherwise (then not
    /// written).
    pub recv_x_scales: *mut f32,
    /// `[recv_capacity, topk]` local expert ids (global id minus this rank's
    /// first expert), -1 for experts on other ranks and dropped entries.
    /// May be NULL (then not written).
    pub recv_topk_idx: *mut i32,
    /// `[recv_capacity, topk]` weights, 0 where `recv_topk_idx` is -1. May be
    /// NULL (then not written).
    pub recv_topk_weights: *mut f32,
    /// `[recv_capacity, 2]` (source rank, source token index) of each row.
    /// May be NULL (then not written).
    pub recv_src_info: *mut i32,
    /// Device scalar: number of source-order rows received. May be NULL
    /// (then not written).
    pub recv_num_tokens: *mut i32,

    /// Expert-major output rows available (see `ep_get_dispatch_capacity`).
    pub expert_capacity: i32,
    /// `[expert_capacity, hidden]` tokens in expert-major order, the
    /// expert-major output. Required when `recv_x` is NULL; may be NULL
    /// otherwise (then no expert-major output; the other expert_* pointers
    /// are not used).
    pub expert_x: *mut c_void,
    /// FP8 only: `[expert_capacity, hidden / 128]` scales. Required when
    /// `expert_x` is given and dtype is FP8; may be NULL otherwise (then not
    /// written).
    pub expert_x_scales: *mut f32,
    /// `[expert_capacity]` routing weight of each row; 0 in padding rows. May
    /// be NULL (then not written).
    pub expert_weights: *mut f32,
    /// `[expert_capacity]` source-order row index of each row; -1 in padding.
    /// May be NULL (then not written).
    pub expert_src_row: *mut i32,
    /// `[local_experts + 1]` padded start of each expert's segment; the last
    /// entry is the total padded row count. Ready for a grouped GEMM, and the
    /// only way to find the segments without a host synchronisation, hence
    /// required with the output. Required when `expert_x` is given; may be NULL
    /// otherwise (then not written).
    pub expert_offsets: *mut i32,
    /// `[local_experts]` rows of each local expert, without padding. May be
    /// NULL (then not written).
    pub expert_counts: *mut i32,

    /// Host scalar, written before return unless `EP_DISPATCH_NO_HOST_SYNC`:
    /// source-order rows received. May be NULL (then not written).
    pub host_recv_num_tokens: *mut i32,
    /// Host `[local_experts]`, written before return unless
    /// `EP_DISPATCH_NO_HOST_SYNC`: rows per local expert. May be NULL (then
    /// not written).
    pub host_expert_counts: *mut i32,
}

/// Bytes of the oldest accepted `ep_dispatch_args_t` (all fields).
pub const EP_DISPATCH_ARGS_MIN_SIZE: u32 = std::mem::size_of::<ep_dispatch_args_t>() as u32;

/// Arguments of `ep_combine` (normal mode): sums the rows that came back for
/// each of this rank's tokens, in fp32, into BF16 `out`. On the GPU backend
/// `x` and `out` must be 16-byte aligned.
///
/// Summation order (the same on every backend, so results are
/// deterministic): each expert rank first makes one BF16 row per received
/// token (the caller's row, or with `EP_COMBINE_EXPERT_MAJOR` the fp32 sum
/// of weight * row over its local experts ascending). With one node, `out`
/// is the fp32 sum of those rows, ranks ascending, rounded to BF16 once.
/// With several nodes (`ranks_per_node`), each node's rows are first summed
/// in fp32, ranks ascending, and rounded to BF16 (one node partial per token
/// and node); `out` is the fp32 sum of the node partials, nodes ascending,
/// rounded to BF16.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ep_combine_args_t {
    pub struct_size: u32,
    /// `EP_COMBINE_ARGS_MAGIC`.
    pub magic: u32,
    pub version: u32,
    /// `EP_COMBINE_SOURCE_ORDER` or `EP_COMBINE_EXPERT_MAJOR`.
    pub input_layout: i32,
    /// BF16 rows in the order the handle's dispatch produced them: its
    /// source-order rows, or its expert-major rows (padding rows are ignored).
    /// The dispatch must have produced that output. Required when the
    /// handle's dispatch received rows for this layout or ran with
    /// EP_DISPATCH_NO_HOST_SYNC; may be NULL otherwise (then nothing is
    /// read).
    pub x: *const c_void,
    /// `[num_tokens, hidden]` BF16 output for this rank's tokens of the
    /// dispatch; a token routed nowhere gets zeros. Here num_tokens is the
    /// dispatch's. Must not overlap `x` (the GPU writes a token's output
    /// while it still reads other rows); refused when it does and the host
    /// knows the rows `x` holds (a dispatch with host synchronisation), and
    /// when it is `x` itself. Required when num_tokens > 0; may be NULL
    /// otherwise (then not written).
    pub out: *mut c_void,
}

/// Bytes of the oldest accepted `ep_combine_args_t` (all fields).
pub const EP_COMBINE_ARGS_MIN_SIZE: u32 = std::mem::size_of::<ep_combine_args_t>() as u32;

/// Arguments of `ep_ll_dispatch` (low-latency mode).
///
/// Output is the masked layout: for local expert `e`, rows
/// `[e * W * M, e * W * M + recv_count[e])` of `recv_x` are valid, where
/// `W` is the world size and `M` is `ll_max_tokens_per_rank`; they are grouped
/// by source rank (0 first), each source's tokens in token order.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ep_ll_dispatch_args_t {
    pub struct_size: u32,
    /// `EP_LL_DISPATCH_ARGS_MAGIC`.
    pub magic: u32,
    pub version: u32,
    /// `EP_LL_SEND_ONLY`, `EP_LL_RECV_ONLY`, `EP_LL_UE8M0_SCALES`.
    pub flags: u32,
    /// Tokens of this rank, 0 to `ll_max_tokens_per_rank` (the bound of
    /// `device_num_tokens` when that is given).
    pub num_tokens: i32,
    /// Output type: `EP_DTYPE_FP8_E4M3` (quantized online) or `EP_DTYPE_BF16`.
    pub out_dtype: i32,
    /// `[num_tokens, hidden]` BF16 tokens. Required when the send phase runs
    /// (no EP_LL_RECV_ONLY) and num_tokens > 0; may be NULL otherwise (then
    /// nothing is read).
    pub x: *const c_void,
    /// `[num_tokens, topk]` global expert ids; -1 means no expert. Required
    /// when the send phase runs (no EP_LL_RECV_ONLY) and num_tokens > 0; may
    /// be NULL otherwise (then nothing is read).
    pub topk_idx: *const i32,
    /// `[num_tokens, topk]` weights. When given, `ep_ll_combine` may omit
    /// its weights and reduces on the expert side. May be NULL (then the
    /// matching ep_ll_combine must be given topk_weights).
    pub topk_weights: *const f32,
    /// `[local_experts, W * M, hidden]` received tokens. Required when the
    /// receive phase runs (no EP_LL_SEND_ONLY); may be NULL otherwise (then
    /// not written).
    pub recv_x: *mut c_void,
    /// FP8 only: `[local_experts, W * M, hidden / 128]` fp32 scales.
    /// Required when the receive phase runs (no EP_LL_SEND_ONLY) and
    /// out_dtype is FP8; may be NULL otherwise (then not written).
    pub recv_x_scales: *mut f32,
    /// `[local_experts]` valid rows per local expert. Required when the
    /// receive phase runs (no EP_LL_SEND_ONLY); may be NULL otherwise (then
    /// not written).
    pub recv_count: *mut i32,
    /// `[local_experts, W * M]` source token index of each row. May be NULL
    /// (then not written).
    pub recv_src_info: *mut i32,
    /// `[local_experts, W, 2]` (first row, row count) of each source rank.
    /// May be NULL (then not written).
    pub recv_layout_range: *mut i32,
    /// Device scalar, or NULL. When given, the call reads its token count
    /// from it when it runs on the stream, and `num_tokens` is only the
    /// bound (the caller's arrays have room for `num_tokens` tokens): a CUDA
    /// graph captured once then replays with a different count each time. A
    /// count outside `[0, num_tokens]` is `EP_ERR_INVALID_ARGUMENT`
    /// (reported by `ep_ctx_get_async_error` on the GPU backend): the call
    /// then sends no tokens, and the peers' matching calls may end in
    /// `EP_ERR_TIMEOUT`, as after any failed call. May be NULL (then
    /// num_tokens is the token count).
    pub device_num_tokens: *const i32,
}

/// Bytes of the oldest accepted `ep_ll_dispatch_args_t` (all fields).
pub const EP_LL_DISPATCH_ARGS_MIN_SIZE: u32 = std::mem::size_of::<ep_ll_dispatch_args_t>() as u32;

/// Arguments of `ep_ll_combine`: for each of this rank's tokens,
/// `out[t] = sum_k topk_weights[t, k] * expert_output(t, k)` in fp32, BF16 out.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ep_ll_combine_args_t {
    pub struct_size: u32,
    /// `EP_LL_COMBINE_ARGS_MAGIC`.
    pub magic: u32,
    pub version: u32,
    /// `EP_LL_SEND_ONLY`, `EP_LL_RECV_ONLY`, `EP_LL_ZERO_COPY`.
    pub flags: u32,
    /// Tokens of this rank in the matching dispatch: its `num_tokens` (the
    /// bound when `device_num_tokens` is given), else
    /// `EP_ERR_INVALID_ARGUMENT`.
    pub num_tokens: i32,
    /// `[local_experts, W * M, hidden]` BF16 expert outputs in the masked
    /// layout of the matching dispatch. Required when the send phase runs
    /// (no EP_LL_RECV_ONLY) and EP_LL_ZERO_COPY is not set; may be NULL
    /// otherwise (then nothing is read).
    pub x: *const c_void,
    /// `[num_tokens, topk]` the dispatch's expert ids. Required when the
    /// receive phase runs (no EP_LL_SEND_ONLY) and num_tokens > 0; may be
    /// NULL otherwise (then nothing is read).
    pub topk_idx: *const i32,
    /// `[num_tokens, topk]` weights. Required when the matching
    /// ep_ll_dispatch was given no topk_weights; may be NULL otherwise (then
    /// the weights given to the dispatch apply). Every rank's dispatch must
    /// then have had weights, else `EP_ERR_INVALID_ARGUMENT` on every rank.
    /// A split call gives it to both halves or to neither.
    pub topk_weights: *const f32,
    /// The dispatch's `recv_src_info`. Not used; may be NULL (the context
    /// keeps the layout of its dispatch).
    pub src_info: *const i32,
    /// The dispatch's `recv_layout_range`. Not used; may be NULL (the context
    /// keeps the layout of its dispatch).
    pub layout_range: *const i32,
    /// `[num_tokens, hidden]` BF16 output. Required when the receive phase
    /// runs (no EP_LL_SEND_ONLY) and num_tokens > 0; may be NULL otherwise
    /// (then not written).
    pub out: *mut c_void,
    /// Device scalar: the token count read when the call runs, as in
    /// `ep_ll_dispatch_args_t` (give the matching dispatch's). A count
    /// outside `[0, num_tokens]` is `EP_ERR_INVALID_ARGUMENT`, and the call
    /// then writes no tokens. May be NULL (then num_tokens is the token
    /// count).
    pub device_num_tokens: *const i32,
}

/// Bytes of the oldest accepted `ep_ll_combine_args_t` (all fields).
pub const EP_LL_COMBINE_ARGS_MIN_SIZE: u32 = std::mem::size_of::<ep_ll_combine_args_t>() as u32;

/// Arguments of the fused megakernels: a grouped GEMM over the local
/// experts fused with the dispatch before it or the combine after it, run as
/// one persistent kernel in which row movement and GEMM tiles share the SMs.
///
/// The GEMM: for every expert-major row `j` of local expert `e`,
/// `y[j] = x[j] * weights[e]^T`, `weights` being `[local_experts, n, k]`
/// (K-major: each of the `n` output columns is `k` contiguous elements),
/// products accumulated in fp32 and rounded to BF16 once. BF16 runs take BF16
/// rows and weights. FP8 runs take e4m3 rows with one fp32 scale per row and
/// 128 columns of `k` (the dispatch's FP8 scales) and e4m3 weights with one
/// fp32 scale per block of 128 x 128 (`[local_experts, n / 128, k / 128]`,
/// the DeepSeek-V3 layout); each 128-wide block of `k` is summed in fp32 and
/// then added times its row scale and weight-block scale. The tolerance
/// against the reference (`src/reference/mega.rs`): `|y - ref| <= 2^-7 |ref|
/// + c sqrt(sum_k (x_k w_k)^2)` with `c = 2^-10` for BF16 and `2^-5` for FP8,
/// `ref` being the reference's fp32 value.
///
/// Both calls need `n` and `k` to be multiples of 128 up to
/// `EP_MEGA_MAX_DIM`, never synchronise with the host (capturable in a CUDA
/// graph), and run on the GPU in the order they are made, like every
/// operation of the context. On the GPU
/// backend they need a Hopper GPU (compute capability 9.0) and a context
/// within one node; elsewhere they return `EP_ERR_UNSUPPORTED`. Any
/// `expert_alignment` works (a GEMM tile's rows belong to one expert). Data
/// pointers must be 16-byte aligned.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ep_mega_args_t {
    pub struct_size: u32,
    /// `EP_MEGA_ARGS_MAGIC`.
    pub magic: u32,
    pub version: u32,
    /// No flags are defined yet: 0.
    pub flags: u32,
    /// The dispatch, as `ep_dispatch` runs it, with `EP_DISPATCH_NO_HOST_SYNC`
    /// implied (the capacities must be the worst case; the `host_*` outputs
    /// are not written); `EP_DISPATCH_REUSE_LAYOUT` is refused. Its
    /// expert-major output is required (`expert_x`, whose rows the GEMM
    /// multiplies, and `expert_src_row`); its source-order output stays
    /// optional. Required when the call is ep_mega_dispatch_gemm; may be NULL
    /// otherwise (then not read).
    pub dispatch: *const ep_dispatch_args_t,
    /// The combine: its `input_layout` must be `EP_COMBINE_EXPERT_MAJOR`; `x`
    /// (required) holds the GEMM's input rows, `[expert_capacity, k]` of
    /// `weight_dtype` in the expert-major order of the handle's dispatch
    /// (`expert_capacity` being that dispatch's; only the rows of real
    /// (token, expert) pairs are read); `out` (required when the dispatch had
    /// tokens) receives the combined tokens, as `ep_combine` writes them from
    /// the rows `y`, which it may not overlap. Required when the call is
    /// ep_mega_gemm_combine; may be NULL otherwise (then not read).
    pub combine: *const ep_combine_args_t,
    /// `EP_DTYPE_BF16` or `EP_DTYPE_FP8_E4M3`: the type of the weights and of
    /// the GEMM's input rows (for `ep_mega_dispatch_gemm`, the dispatch's
    /// `dtype`).
    pub weight_dtype: i32,
    /// GEMM output columns, a multiple of 128. `ep_mega_gemm_combine`: the
    /// context's `hidden`.
    pub n: i32,
    /// GEMM reduction length, a multiple of 128. `ep_mega_dispatch_gemm`: the
    /// context's `hidden`.
    pub k: i32,
    /// Streaming multiprocessors the fused kernel may use; 0 means all of
    /// the device's. The routing kernels before it use the config's
    /// `num_sms`.
    pub num_sms: i32,
    /// Required. `[local_experts, n, k]` expert weights of `weight_dtype`.
    pub weights: *const c_void,
    /// `[local_experts, n / 128, k / 128]` fp32 block scales. Required when
    /// weight_dtype is FP8; may be NULL otherwise (then nothing is read).
    pub weight_scales: *const f32,
    /// Required. The GEMM's BF16 output, one row of `n` per expert-major row.
    /// `ep_mega_dispatch_gemm`: `[expert_capacity, n]`; the dispatch's
    /// expert-major rows (`expert_offsets[local_experts]` of them) are
    /// written, padding rows between experts with zeros (left as they were
    /// with `EP_DISPATCH_KEEP_PADDING`); the rows after them are left as
    /// they were. `ep_mega_gemm_combine`: `[expert_capacity, n]`, the expert
    /// outputs before the routing weights, which the combine then reduces;
    /// rows of real pairs are written, padding rows are left as they were.
    pub y: *mut c_void,
    /// `[expert_capacity, k / 128]` fp32 scales of `combine->x`. Required
    /// when the call is ep_mega_gemm_combine and weight_dtype is FP8; may be
    /// NULL otherwise (then nothing is read).
    pub x_scales: *const f32,
}

/// Bytes of the oldest accepted `ep_mega_args_t` (all fields).
pub const EP_MEGA_ARGS_MIN_SIZE: u32 = std::mem::size_of::<ep_mega_args_t>() as u32;

/// Arguments of `ep_moe_forward`: the whole expert MLP of an MoE layer,
/// dispatch, gate+up GEMM, SwiGLU, down GEMM and combine, in three steps
/// on the caller's stream:
/// 1. the dispatch and the gate+up GEMM, as `ep_mega_dispatch_gemm` runs
///    them: for each expert-major row `j` of local expert `e`,
///    `y1[j] = x[j] * w1[e]^T`, `w1` being `[local_experts, 2I, hidden]`
///    (output columns `[0, I)` the gate, `[I, 2I)` the up projection);
/// 2. SwiGLU of every real row: `a[c] = silu(y1[j][c]) * y1[j][I + c]`
///    for `c < I`, `silu(g) = g / (1 + e^-g)`, computed in fp32 from the
///    BF16 values of `y1`. BF16 runs write `a` rounded to BF16 into `act`;
///    FP8 runs quantize `a` (the fp32 values) to e4m3 with one fp32 scale
///    per 128 columns by the low-latency mode's rule: per block `amax =
///    max(max |a|, 1e-4)`, `scale = amax / 448`, `code = e4m3(a * (448 /
///    amax))` (nearest even, saturating at 448);
/// 3. the down GEMM and the combine, as `ep_mega_gemm_combine` runs them:
///    `y2[j] = act[j] * w2[e]^T`, `w2` being `[local_experts, hidden, I]`,
///    then the combine of the rows `y2` like `ep_combine` with
///    `EP_COMBINE_EXPERT_MAJOR` into `combine->out`.
///
/// Tolerance against the reference (`src/reference/moe.rs`, which the host
/// backend runs): each GEMM within the tolerance of `ep_mega_args_t` given
/// its input rows; step 2 bit for bit given `y1` (the GPU runs the
/// reference's operations in its order, `e^x` included); the combine bit
/// for bit given `y2`.
///
/// The intermediates are the caller's, each with one row per expert-major
/// row of the dispatch (`expert_capacity` rows): when the stream has run
/// the call, their rows of real (token, expert) pairs hold each step's
/// output. Padding rows: `y1` as `ep_mega_dispatch_gemm` writes it (zeros
/// between experts, or as they were with `EP_DISPATCH_KEEP_PADDING`; rows
/// after the last expert's segment left as they were); `act`, `act_scales`
/// and `y2` are left as they were.
///
/// As for the fused calls: `I` is a multiple of 128 up to
/// `EP_MOE_MAX_INTERMEDIATE`; the call never synchronises with the host
/// (capturable in a CUDA graph); on the GPU backend it needs a Hopper GPU
/// and a context within one node (else `EP_ERR_UNSUPPORTED`), and data
/// pointers must be 16-byte aligned.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ep_moe_args_t {
    pub struct_size: u32,
    /// `EP_MOE_ARGS_MAGIC`.
    pub magic: u32,
    pub version: u32,
    /// No flags are defined yet: 0.
    pub flags: u32,
    /// The dispatch, as `ep_dispatch` runs it, with `EP_DISPATCH_NO_HOST_SYNC`
    /// implied (its `expert_capacity` must be the worst case,
    /// `ep_get_dispatch_capacity`; the `host_*` outputs are not written);
    /// `EP_DISPATCH_REUSE_LAYOUT` is refused. Its `dtype` must be
    /// `weight_dtype`. Its expert-major output is required (`expert_x`,
    /// `expert_offsets` and `expert_src_row`); its source-order output stays
    /// optional. Its layout goes into the handle. Required.
    pub dispatch: *const ep_dispatch_args_t,
    /// The combine: its `input_layout` must be `EP_COMBINE_EXPERT_MAJOR`,
    /// its `out` (`[num_tokens, hidden]` BF16, required when the dispatch
    /// has tokens) receives the combined tokens, and its `x` is not read
    /// (the rows `y2` are the combine's input, which `out` may not
    /// overlap). Required.
    pub combine: *const ep_combine_args_t,
    /// `EP_DTYPE_BF16` or `EP_DTYPE_FP8_E4M3`: the type of both weights, of
    /// the dispatched tokens and of `act`.
    pub weight_dtype: i32,
    /// `I`, the experts' intermediate size: a multiple of 128 up to
    /// `EP_MOE_MAX_INTERMEDIATE`.
    pub intermediate: i32,
    /// Streaming multiprocessors the fused kernels (and the activation
    /// kernel between them) may use; 0 means all of the device's. The
    /// routing kernels use the config's `num_sms`.
    pub num_sms: i32,
    /// `[local_experts, 2I, hidden]` gate+up weights of `weight_dtype`,
    /// K-major. Required.
    pub w1: *const c_void,
    /// `[local_experts, 2I / 128, hidden / 128]` fp32 block scales of `w1`.
    /// Required when weight_dtype is FP8; may be NULL otherwise (then
    /// nothing is read).
    pub w1_scales: *const f32,
    /// `[local_experts, hidden, I]` down weights of `weight_dtype`,
    /// K-major. Required.
    pub w2: *const c_void,
    /// `[local_experts, hidden / 128, I / 128]` fp32 block scales of `w2`.
    /// Required when weight_dtype is FP8; may be NULL otherwise (then
    /// nothing is read).
    pub w2_scales: *const f32,
    /// `[expert_capacity, 2I]` BF16: the gate+up GEMM's rows. Required.
    pub y1: *mut c_void,
    /// `[expert_capacity, I]` activations: BF16, or e4m3 codes (one byte
    /// each) when weight_dtype is FP8. Required.
    pub act: *mut c_void,
    /// `[expert_capacity, I / 128]` fp32 scales of `act`. Required when
    /// weight_dtype is FP8; may be NULL otherwise (then not written).
    pub act_scales: *mut f32,
    /// `[expert_capacity, hidden]` BF16: the down GEMM's rows, before the
    /// routing weights. Required.
    pub y2: *mut c_void,
}

/// Bytes of the oldest accepted `ep_moe_args_t` (all fields).
pub const EP_MOE_ARGS_MIN_SIZE: u32 = std::mem::size_of::<ep_moe_args_t>() as u32;
