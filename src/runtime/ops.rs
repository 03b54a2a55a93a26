//! Operations as the runtime sees them: plain values and raw pointers (device
//! pointers on the GPU backend, host pointers on the host backend). Each
//! operation checks its values against the configuration (`validate`) and
//! states the facts its pointer rules depend on (`facts`); the context checks
//! its pointers against the contract (`super::contract`) before any backend
//! runs it.

use super::config::{Config, MAX_EXPERT_ALIGNMENT, MAX_GEMM_DIM};
use super::contract::Facts;
use crate::error::{Error, ErrorKind, Result};
use crate::reference::{normal, Dtype, SCALE_BLOCK};
use std::os::raw::c_void;

fn check_max(name: &str, value: usize, max: usize) -> Result<()> {
    if value > max {
        return Err(Error::invalid(format!(
            "{name} = {value} is above the configured maximum {max}"
        )));
    }
    Ok(())
}

/// The expert-major segment alignment a caller asked for: 0 means 1, else
/// 1 to `MAX_EXPERT_ALIGNMENT`. Shared by `ep_dispatch` and
/// `ep_get_dispatch_capacity`, so both accept the same values.
pub fn expert_alignment(requested: i32) -> Result<usize> {
    match usize::try_from(requested) {
        Ok(0) => Ok(1),
        Ok(a) if a <= MAX_EXPERT_ALIGNMENT => Ok(a),
        _ => Err(Error::invalid(format!(
            "expert_alignment = {requested} is outside [1, {MAX_EXPERT_ALIGNMENT}] (0 means 1)"
        ))),
    }
}

/// `ep_get_dispatch_layout`.
#[derive(Debug, Clone, Copy)]
pub struct LayoutOp {
    pub num_tokens: usize,
    pub topk_idx: *const i32,
    pub tokens_per_rank: *mut i32,
    pub tokens_per_expert: *mut i32,
    pub is_token_in_rank: *mut u8,
}

impl LayoutOp {
    pub fn validate(&self, cfg: &Config) -> Result<()> {
        check_max("num_tokens", self.num_tokens, cfg.max_tokens)
    }

    pub fn facts(&self) -> Facts {
        Facts {
            tokens: self.num_tokens > 0,
            ..Facts::default()
        }
    }
}

/// Source-order outputs of a dispatch.
#[derive(Debug, Clone, Copy)]
pub struct SourceOrderOut {
    pub capacity: usize,
    pub x: *mut u8,
    pub scales: *mut f32,
    pub topk_idx: *mut i32,
    pub topk_weights: *mut f32,
    pub src_info: *mut i32,
    pub num_rows: *mut i32,
}

impl SourceOrderOut {
    /// An error when `rows` received rows do not fit the capacity (then no
    /// row is written).
    pub fn check_rows(&self, rows: usize) -> Result<()> {
        rows_fit("recv_capacity", self.capacity, rows, "rows arrived")
    }
}

/// Expert-major outputs of a dispatch.
#[derive(Debug, Clone, Copy)]
pub struct ExpertMajorOut {
    pub capacity: usize,
    pub alignment: usize,
    /// `EP_DISPATCH_KEEP_PADDING`: padding rows of `x` and `scales` are not
    /// written.
    pub keep_padding: bool,
    pub x: *mut u8,
    pub scales: *mut f32,
    pub weights: *mut f32,
    pub src_row: *mut i32,
    pub offsets: *mut i32,
    pub counts: *mut i32,
}

impl ExpertMajorOut {
    /// An error when `padded_rows` expert-major rows (padding included) do
    /// not fit the capacity (then no row is written).
    pub fn check_rows(&self, padded_rows: usize) -> Result<()> {
        let needed = "expert-major rows are needed";
        rows_fit("expert_capacity", self.capacity, padded_rows, needed)
    }
}

/// An error when `rows` rows (`what`: "rows arrived") exceed `capacity`,
/// the value of the argument `name`.
fn rows_fit(name: &str, capacity: usize, rows: usize, what: &str) -> Result<()> {
    if rows > capacity {
        return Err(Error::invalid(format!(
            "{name} = {capacity} but {rows} {what}; no rows were written"
        )));
    }
    Ok(())
}

/// `ep_dispatch`.
#[derive(Debug, Clone, Copy)]
pub struct DispatchOp {
    pub num_tokens: usize,
    pub dtype: Dtype,
    pub no_host_sync: bool,
    pub reuse_layout: bool,
    pub x: *const u8,
    pub x_scales: *const f32,
    pub topk_idx: *const i32,
    pub topk_weights: *const f32,
    pub recv: Option<SourceOrderOut>,
    pub expert: Option<ExpertMajorOut>,
    pub host_recv_num_rows: *mut i32,
    pub host_expert_counts: *mut i32,
}

impl DispatchOp {
    pub fn validate(&self, cfg: &Config) -> Result<()> {
        check_max("num_tokens", self.num_tokens, cfg.max_tokens)?;
        if self.dtype == Dtype::Bf16 && cfg.token_dtype == Dtype::Fp8E4m3 {
            return Err(Error::invalid(
                "BF16 dispatch on a context configured with token_dtype FP8 (its buffers are sized for FP8)",
            ));
        }
        // Source-order rows do not depend on the alignment.
        let (worst_source, worst_expert) =
            normal::worst_case_rows(cfg.topo, cfg.max_tokens, self.alignment());
        if let Some(recv) = &self.recv {
            if self.no_host_sync && recv.capacity < worst_source {
                return Err(Error::invalid(format!(
                    "recv_capacity = {} is below the worst case {worst_source} that EP_DISPATCH_NO_HOST_SYNC needs",
                    recv.capacity
                )));
            }
        }
        if let Some(expert) = &self.expert {
            if self.no_host_sync && expert.capacity < worst_expert {
                return Err(Error::invalid(format!(
                    "expert_capacity = {} is below the worst case {worst_expert} that EP_DISPATCH_NO_HOST_SYNC needs",
                    expert.capacity
                )));
            }
        }
        Ok(())
    }

    /// `validate`, and what a fused call (`call`, which `needs` the
    /// expert-major rows) asks of its dispatch besides: a layout of its
    /// own, and the expert-major rows with their source rows (the fused
    /// kernel finds each row's token through its source row).
    fn validate_fused(&self, cfg: &Config, call: &str, needs: &str) -> Result<()> {
        if self.reuse_layout {
            return Err(Error::invalid(format!(
                "EP_DISPATCH_REUSE_LAYOUT: the dispatch of {call} cannot reuse a layout"
            )));
        }
        let null = |name: &str| {
            Error::new(
                ErrorKind::NullPointer,
                format!("`{name}` is NULL (required by {call}, {needs})"),
            )
        };
        let expert = self.expert.ok_or_else(|| null("expert_x"))?;
        if expert.src_row.is_null() {
            return Err(null("expert_src_row"));
        }
        self.validate(cfg)
    }

    pub fn facts(&self) -> Facts {
        Facts {
            tokens: self.num_tokens > 0,
            fp8: self.dtype == Dtype::Fp8E4m3,
            source_order: self.recv.is_some(),
            expert_major: self.expert.is_some(),
            ..Facts::default()
        }
    }

    /// Expert-major segment alignment (1 without that output).
    pub fn alignment(&self) -> usize {
        self.expert.map_or(1, |e| e.alignment)
    }
}

/// Rows a dispatch received, when the host learned them (a host-synchronised
/// dispatch, or one that reused such a dispatch's layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Received {
    /// Source-order rows.
    pub source_rows: usize,
    /// Expert-major rows, padding included.
    pub expert_rows: usize,
}

/// `ep_combine`.
#[derive(Debug, Clone, Copy)]
pub struct CombineOp {
    pub expert_major: bool,
    pub x: *const u8,
    pub out: *mut u8,
}

impl CombineOp {
    /// An error when `out` (`num_tokens` rows) overlaps the rows it sums:
    /// `rows` rows at `input` (`input_name`). When the host does not know
    /// how many rows arrived (`rows` is `None`: a dispatch without host
    /// synchronisation, or a fused one), only an `out` at the input's own
    /// address is refused: the rank may have received no row, and its input
    /// may then be any small buffer, right next to `out` too. The GPU writes
    /// the output of a token that went to its own rank alone while it still
    /// reads other rows (kernels/normal.cu), so the output may not be the
    /// input, on any backend. Rows are `row_bytes` long.
    pub fn check_disjoint(
        &self,
        input_name: &str,
        input: *const u8,
        rows: Option<usize>,
        num_tokens: usize,
        row_bytes: usize,
    ) -> Result<()> {
        let span = |ptr: *const u8, rows: usize| {
            let start = ptr as usize;
            start..start.saturating_add(rows.saturating_mul(row_bytes))
        };
        let written = span(self.out, num_tokens);
        if input.is_null() || self.out.is_null() || written.is_empty() {
            return Ok(());
        }
        let overlaps = match rows {
            Some(rows) => {
                let read = span(input, rows);
                !read.is_empty() && read.start < written.end && written.start < read.end
            }
            None => input as usize == written.start,
        };
        if overlaps {
            return Err(Error::invalid(format!(
                "`out` ({:#x}, {num_tokens} rows) overlaps `{input_name}` ({:#x}, {} rows): the \
                 combine's output must not be its input",
                written.start,
                input as usize,
                rows.map_or("unknown".to_string(), |r| r.to_string())
            )));
        }
        Ok(())
    }
}

/// Which halves of a low-latency call to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Phases {
    pub send: bool,
    pub recv: bool,
}

impl Phases {
    pub fn from_flags(send_only: bool, recv_only: bool) -> Result<Phases> {
        if send_only && recv_only {
            return Err(Error::invalid(
                "EP_LL_SEND_ONLY and EP_LL_RECV_ONLY together: pass neither to run both phases",
            ));
        }
        Ok(Phases {
            send: !recv_only,
            recv: !send_only,
        })
    }
}

/// `ep_ll_dispatch`.
#[derive(Debug, Clone, Copy)]
pub struct LlDispatchOp {
    pub num_tokens: usize,
    pub out_dtype: Dtype,
    pub ue8m0: bool,
    pub phases: Phases,
    pub x: *const u8,
    pub topk_idx: *const i32,
    pub topk_weights: *const f32,
    pub recv_x: *mut u8,
    pub recv_scales: *mut f32,
    pub recv_count: *mut i32,
    pub recv_src_info: *mut i32,
    pub recv_layout_range: *mut i32,
    /// The caller's token count in device memory, or NULL: read when the
    /// call runs, `num_tokens` being its bound.
    pub device_num_tokens: *const i32,
}

/// An error unless the configuration enables the low-latency mode.
pub fn check_ll_enabled(cfg: &Config) -> Result<()> {
    if cfg.ll_max_tokens == 0 {
        return Err(Error::invalid(
            "the low-latency mode is disabled (config ll_max_tokens_per_rank = 0)",
        ));
    }
    Ok(())
}

impl LlDispatchOp {
    pub fn validate(&self, cfg: &Config) -> Result<()> {
        check_ll_enabled(cfg)?;
        check_max("num_tokens", self.num_tokens, cfg.ll_max_tokens)?;
        if self.ue8m0 && self.out_dtype != Dtype::Fp8E4m3 {
            return Err(Error::invalid("EP_LL_UE8M0_SCALES needs out_dtype FP8"));
        }
        Ok(())
    }

    pub fn facts(&self) -> Facts {
        Facts {
            tokens: self.num_tokens > 0,
            fp8: self.out_dtype == Dtype::Fp8E4m3,
            send: self.phases.send,
            recv: self.phases.recv,
            ..Facts::default()
        }
    }
}

/// `ep_ll_combine`.
#[derive(Debug, Clone, Copy)]
pub struct LlCombineOp {
    pub num_tokens: usize,
    pub phases: Phases,
    pub zero_copy: bool,
    pub x: *const u8,
    pub topk_idx: *const i32,
    pub topk_weights: *const f32,
    pub src_info: *const i32,
    pub layout_range: *const i32,
    pub out: *mut u8,
    /// The caller's token count in device memory, or NULL: read when the
    /// call runs, `num_tokens` being its bound.
    pub device_num_tokens: *const i32,
}

impl LlCombineOp {
    pub fn validate(&self, cfg: &Config) -> Result<()> {
        check_ll_enabled(cfg)?;
        check_max("num_tokens", self.num_tokens, cfg.ll_max_tokens)
    }

    /// `dispatch_weighted`: the dispatch this combine pairs with had weights.
    pub fn facts(&self, dispatch_weighted: bool) -> Facts {
        Facts {
            tokens: self.num_tokens > 0,
            send: self.phases.send,
            recv: self.phases.recv,
            zero_copy: self.zero_copy,
            unweighted: !dispatch_weighted,
            ..Facts::default()
        }
    }

    /// Whether the combine applies weights of its own (else the dispatch's).
    pub fn weighted(&self) -> bool {
        !self.topk_weights.is_null()
    }
}

/// The grouped GEMM of a fused call (`ep_mega_*`): its own values and
/// pointers (the call's dispatch or combine half is a [`DispatchOp`] or a
/// [`CombineOp`]).
#[derive(Debug, Clone, Copy)]
pub struct MegaOp {
    /// The type of the weights and of the GEMM's input rows.
    pub dtype: Dtype,
    pub n: usize,
    pub k: usize,
    /// SMs of the fused kernel; 0 = all of the device's (this rank's share).
    pub num_sms: usize,
    pub weights: *const u8,
    pub weight_scales: *const f32,
    pub y: *mut u8,
    /// `ep_mega_gemm_combine` with FP8: the scales of the input rows.
    pub x_scales: *const f32,
    /// The caller's pointers to the call's half (`ep_dispatch_args_t` or
    /// `ep_combine_args_t`), read by the C boundary.
    pub dispatch_args: *const c_void,
    pub combine_args: *const c_void,
}

impl MegaOp {
    fn validate(&self) -> Result<()> {
        for (name, value) in [("n", self.n), ("k", self.k)] {
            if value == 0 || !value.is_multiple_of(SCALE_BLOCK) || value > MAX_GEMM_DIM {
                return Err(Error::invalid(format!(
                    "{name} = {value} is not a multiple of {SCALE_BLOCK} in [{SCALE_BLOCK}, {MAX_GEMM_DIM}]"
                )));
            }
        }
        Ok(())
    }

    /// The facts of its pointer rules; `combine`: the call is
    /// `ep_mega_gemm_combine`.
    pub fn facts(&self, combine: bool) -> Facts {
        Facts {
            fp8: self.dtype == Dtype::Fp8E4m3,
            fused_combine: combine,
            ..Facts::default()
        }
    }
}

/// `ep_mega_dispatch_gemm`: a dispatch with its expert-major output, then the
/// grouped GEMM of those rows.
#[derive(Debug, Clone, Copy)]
pub struct MegaDispatchOp {
    /// Never synchronises with the host: `no_host_sync` is set (the C
    /// boundary sets it, EP_DISPATCH_NO_HOST_SYNC being implied).
    pub dispatch: DispatchOp,
    pub gemm: MegaOp,
}

impl MegaDispatchOp {
    pub fn validate(&self, cfg: &Config) -> Result<()> {
        let d = &self.dispatch;
        d.validate_fused(
            cfg,
            "ep_mega_dispatch_gemm",
            "whose GEMM multiplies the expert-major rows",
        )?;
        self.gemm.validate()?;
        if self.gemm.dtype != d.dtype {
            return Err(Error::invalid(
                "weight_dtype differs from the dispatch's dtype (the GEMM multiplies the dispatched rows)",
            ));
        }
        if self.gemm.k != cfg.topo.hidden {
            return Err(Error::invalid(format!(
                "k = {} must be the context's hidden size {} (the GEMM multiplies the dispatched rows)",
                self.gemm.k, cfg.topo.hidden
            )));
        }
        Ok(())
    }
}

/// `ep_mega_gemm_combine`: the GEMM of a dispatch's expert-major rows
/// (`combine.x`), then the expert-major combine of its output.
#[derive(Debug, Clone, Copy)]
pub struct MegaCombineOp {
    pub combine: CombineOp,
    pub gemm: MegaOp,
}

impl MegaCombineOp {
    pub fn validate(&self, cfg: &Config) -> Result<()> {
        self.gemm.validate()?;
        if !self.combine.expert_major {
            return Err(Error::invalid(
                "combine->input_layout must be EP_COMBINE_EXPERT_MAJOR (the GEMM's rows are expert-major)",
            ));
        }
        if self.gemm.n != cfg.topo.hidden {
            return Err(Error::invalid(format!(
                "n = {} must be the context's hidden size {} (the combine reduces the GEMM's output rows)",
                self.gemm.n, cfg.topo.hidden
            )));
        }
        Ok(())
    }
}

/// The experts' half of `ep_moe_forward` (`ep_moe_args_t` less its
/// dispatch and combine): the weights of both GEMMs and the caller's
/// intermediate buffers.
#[derive(Debug, Clone, Copy)]
pub struct MoeExperts {
    /// The type of the weights, of the dispatched rows and of `act`.
    pub dtype: Dtype,
    /// `I`: columns of the activation (the gate+up GEMM makes `2I`).
    pub intermediate: usize,
    /// SMs of the fused kernels; 0 = all of the device's (this rank's share).
    pub num_sms: usize,
    pub w1: *const u8,
    pub w1_scales: *const f32,
    pub w2: *const u8,
    pub w2_scales: *const f32,
    pub y1: *mut u8,
    pub act: *mut u8,
    pub act_scales: *mut f32,
    pub y2: *mut u8,
    /// The caller's pointers to its `ep_dispatch_args_t` and
    /// `ep_combine_args_t`, read by the C boundary.
    pub dispatch_args: *const c_void,
    pub combine_args: *const c_void,
}

impl MoeExperts {
    /// The facts of its pointer rules.
    pub fn facts(&self) -> Facts {
        Facts {
            fp8: self.dtype == Dtype::Fp8E4m3,
            ..Facts::default()
        }
    }
}

/// `ep_moe_forward`: the dispatch and the gate+up GEMM (an
/// `ep_mega_dispatch_gemm`), SwiGLU, then the down GEMM and the combine
/// (an `ep_mega_gemm_combine`).
#[derive(Debug, Clone, Copy)]
pub struct MoeOp {
    /// Never synchronises with the host: `no_host_sync` is set (the C
    /// boundary sets it, as for a fused dispatch).
    pub dispatch: DispatchOp,
    /// The combine: its `out` (its `x` is not read: `act` is the down
    /// GEMM's input).
    pub combine: CombineOp,
    pub experts: MoeExperts,
}

/// The largest `I`: the gate+up GEMM's `2I` columns are at most
/// `MAX_GEMM_DIM`.
pub const MAX_INTERMEDIATE: usize = MAX_GEMM_DIM / 2;

impl MoeOp {
    /// Checks the values against the configuration (the pointers are the
    /// contract's, checked by the context).
    pub fn validate(&self, cfg: &Config) -> Result<()> {
        let d = &self.dispatch;
        d.validate_fused(
            cfg,
            "ep_moe_forward",
            "whose experts multiply the expert-major rows",
        )?;
        let i = self.experts.intermediate;
        if i == 0 || !i.is_multiple_of(SCALE_BLOCK) || i > MAX_INTERMEDIATE {
            return Err(Error::invalid(format!(
                "intermediate = {i} is not a multiple of {SCALE_BLOCK} in [{SCALE_BLOCK}, {MAX_INTERMEDIATE}]"
            )));
        }
        if self.experts.dtype != d.dtype {
            return Err(Error::invalid(
                "weight_dtype differs from the dispatch's dtype (the gate+up GEMM multiplies the dispatched rows)",
            ));
        }
        if !self.combine.expert_major {
            return Err(Error::invalid(
                "combine->input_layout must be EP_COMBINE_EXPERT_MAJOR (the down GEMM's rows are expert-major)",
            ));
        }
        Ok(())
    }

    /// Rows of `y1`, `act` (and its scales) and `y2`: the dispatch's
    /// expert capacity (0 without expert-major output, which `validate`
    /// refuses).
    pub fn rows(&self) -> usize {
        self.dispatch.expert.map_or(0, |e| e.capacity)
    }

    /// The first fused call: the dispatch, and `y1 = x * W1^T` (`n = 2I`,
    /// `k = hidden`).
    pub fn gate_up(&self, hidden: usize) -> MegaDispatchOp {
        let e = &self.experts;
        MegaDispatchOp {
            dispatch: self.dispatch,
            gemm: MegaOp {
                dtype: e.dtype,
                n: 2 * e.intermediate,
                k: hidden,
                num_sms: e.num_sms,
                weights: e.w1,
                weight_scales: e.w1_scales,
                y: e.y1,
                x_scales: std::ptr::null(),
                dispatch_args: e.dispatch_args,
                combine_args: std::ptr::null(),
            },
        }
    }

    /// The second fused call: `y2 = act * W2^T` (`n = hidden`, `k = I`),
    /// and the expert-major combine of `y2` into the caller's `out`.
    pub fn down(&self, hidden: usize) -> MegaCombineOp {
        let e = &self.experts;
        MegaCombineOp {
            combine: CombineOp {
                expert_major: true,
                x: e.act,
                out: self.combine.out,
            },
            gemm: MegaOp {
                dtype: e.dtype,
                n: hidden,
                k: e.intermediate,
                num_sms: e.num_sms,
                weights: e.w2,
                weight_scales: e.w2_scales,
                y: e.y2,
                x_scales: e.act_scales,
                dispatch_args: std::ptr::null(),
                combine_args: e.combine_args,
            },
        }
    }
}
