//! Operations as the runtime sees them: plain values and raw pointers (device
//! pointers on the GPU backend, host pointers on the host backend), checked
//! against the configuration by `validate` before any backend runs them.

use super::config::{Config, MAX_EXPERT_ALIGNMENT, MAX_GEMM_DIM};
use crate::error::{Error, Result};
use crate::reference::{normal, Dtype, SCALE_BLOCK};

fn require<T>(ptr: *const T, name: &str) -> Result<()> {
    if ptr.is_null() {
        Err(Error::null(name))
    } else {
        Ok(())
    }
}

fn check_max(name: &str, value: usize, max: usize) -> Result<()> {
    if value > max {
        return Err(Error::invalid(format!(
            "{name} = {value} is above the configured maximum {max}"
        )));
    }
    Ok(())
}

/// A low-latency call's optional device token count must be an aligned
/// `int32_t`.
fn check_device_count(ptr: *const i32) -> Result<()> {
    if !ptr.is_aligned() {
        return Err(Error::invalid(format!(
            "device_num_tokens = {ptr:p} is not 4-byte aligned"
        )));
    }
    Ok(())
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
    pub fn new(cfg: &Config, num_tokens: usize, topk_idx: *const i32) -> Result<LayoutOp> {
        check_max("num_tokens", num_tokens, cfg.max_tokens)?;
        if num_tokens > 0 {
            require(topk_idx, "topk_idx")?;
        }
        Ok(LayoutOp {
            num_tokens,
            topk_idx,
            tokens_per_rank: std::ptr::null_mut(),
            tokens_per_expert: std::ptr::null_mut(),
            is_token_in_rank: std::ptr::null_mut(),
        })
    }

    pub fn validate_outputs(&self) -> Result<()> {
        require(self.tokens_per_rank, "num_tokens_per_rank")?;
        require(self.tokens_per_expert, "num_tokens_per_expert")?;
        if self.num_tokens > 0 {
            require(self.is_token_in_rank, "is_token_in_rank")?;
        }
        Ok(())
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

/// Expert-major outputs of a dispatch.
#[derive(Debug, Clone, Copy)]
pub struct ExpertMajorOut {
    pub capacity: usize,
    pub alignment: usize,
    pub x: *mut u8,
    pub scales: *mut f32,
    pub weights: *mut f32,
    pub src_row: *mut i32,
    pub offsets: *mut i32,
    pub counts: *mut i32,
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
        let fp8 = self.dtype == Dtype::Fp8E4m3;
        if self.num_tokens > 0 {
            require(self.x, "x")?;
            require(self.topk_idx, "topk_idx")?;
            require(self.topk_weights, "topk_weights")?;
            if fp8 {
                require(self.x_scales, "x_scales")?;
            }
        }
        if self.recv.is_none() && self.expert.is_none() {
            return Err(Error::invalid(
                "no output requested: set recv_x (source order), expert_x (expert-major), or both",
            ));
        }
        if let Some(recv) = &self.recv {
            let (worst, _) = normal::worst_case_rows(cfg.topo, cfg.max_tokens, 1);
            if fp8 {
                require(recv.scales, "recv_x_scales")?;
            }
            if self.no_host_sync && recv.capacity < worst {
                return Err(Error::invalid(format!(
                    "recv_capacity = {} is below the worst case {worst} that EP_DISPATCH_NO_HOST_SYNC needs",
                    recv.capacity
                )));
            }
        }
        if let Some(expert) = &self.expert {
            if !(1..=MAX_EXPERT_ALIGNMENT).contains(&expert.alignment) {
                return Err(Error::invalid(format!(
                    "expert_alignment = {} is outside [1, {MAX_EXPERT_ALIGNMENT}]",
                    expert.alignment
                )));
            }
            if fp8 {
                require(expert.scales, "expert_x_scales")?;
            }
            let (_, worst) = normal::worst_case_rows(cfg.topo, cfg.max_tokens, expert.alignment);
            if self.no_host_sync && expert.capacity < worst {
                return Err(Error::invalid(format!(
                    "expert_capacity = {} is below the worst case {worst} that EP_DISPATCH_NO_HOST_SYNC needs",
                    expert.capacity
                )));
            }
        }
        Ok(())
    }
}

/// `ep_combine`.
#[derive(Debug, Clone, Copy)]
pub struct CombineOp {
    pub expert_major: bool,
    pub x: *const u8,
    pub out: *mut u8,
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

fn check_ll_enabled(cfg: &Config) -> Result<()> {
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
        check_device_count(self.device_num_tokens)?;
        if self.ue8m0 && self.out_dtype != Dtype::Fp8E4m3 {
            return Err(Error::invalid("EP_LL_UE8M0_SCALES needs out_dtype FP8"));
        }
        if self.phases.send && self.num_tokens > 0 {
            require(self.x, "x")?;
            require(self.topk_idx, "topk_idx")?;
        }
        if self.phases.recv {
            require(self.recv_x, "recv_x")?;
            require(self.recv_count, "recv_count")?;
            require(self.recv_src_info, "recv_src_info")?;
            require(self.recv_layout_range, "recv_layout_range")?;
            if self.out_dtype == Dtype::Fp8E4m3 {
                require(self.recv_scales, "recv_x_scales")?;
            }
        }
        Ok(())
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
        check_max("num_tokens", self.num_tokens, cfg.ll_max_tokens)?;
        check_device_count(self.device_num_tokens)?;
        if self.phases.send {
            if !self.zero_copy {
                require(self.x, "x")?;
            }
            require(self.src_info, "src_info")?;
            require(self.layout_range, "layout_range")?;
        }
        if self.phases.recv && self.num_tokens > 0 {
            require(self.topk_idx, "topk_idx")?;
            require(self.out, "out")?;
        }
        Ok(())
    }
}

/// The grouped GEMM of a fused call (`ep_mega_*`).
#[derive(Debug, Clone, Copy)]
pub struct GemmOp {
    pub dtype: Dtype,
    pub n: usize,
    pub k: usize,
    /// SMs of the fused kernel; 0 = all of the device's.
    pub num_sms: usize,
    pub weights: *const u8,
    pub weight_scales: *const f32,
    pub y: *mut u8,
}

impl GemmOp {
    fn validate(&self) -> Result<()> {
        for (name, value) in [("n", self.n), ("k", self.k)] {
            if value == 0 || !value.is_multiple_of(SCALE_BLOCK) || value > MAX_GEMM_DIM {
                return Err(Error::invalid(format!(
                    "{name} = {value} is not a multiple of {SCALE_BLOCK} in [{SCALE_BLOCK}, {MAX_GEMM_DIM}]"
                )));
            }
        }
        require(self.weights, "weights")?;
        if self.dtype == Dtype::Fp8E4m3 {
            require(self.weight_scales, "weight_scales")?;
        }
        require(self.y, "y")
    }
}

/// `ep_mega_dispatch_gemm`: a dispatch with its expert-major output, then the
/// GEMM of those rows.
#[derive(Debug, Clone, Copy)]
pub struct MegaDispatchOp {
    pub dispatch: DispatchOp,
    pub gemm: GemmOp,
}

impl MegaDispatchOp {
    pub fn validate(&self, cfg: &Config) -> Result<()> {
        let d = &self.dispatch;
        if !d.no_host_sync || d.reuse_layout {
            return Err(Error::invalid(
                "a fused dispatch never synchronises with the host (EP_DISPATCH_NO_HOST_SYNC is implied) and cannot reuse a layout",
            ));
        }
        let expert = d.expert.ok_or_else(|| Error::null("dispatch->expert_x"))?;
        d.validate(cfg)?;
        require(expert.weights, "dispatch->expert_weights")?;
        require(expert.src_row, "dispatch->expert_src_row")?;
        require(expert.offsets, "dispatch->expert_offsets")?;
        require(expert.counts, "dispatch->expert_counts")?;
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

/// `ep_mega_gemm_combine`: the GEMM of a dispatch's expert-major rows, then
/// the expert-major combine of its output.
#[derive(Debug, Clone, Copy)]
pub struct MegaCombineOp {
    /// `[expert rows, k]` GEMM input in the handle's expert-major order.
    pub x: *const u8,
    /// FP8: `[expert rows, k / 128]` scales of `x`.
    pub x_scales: *const f32,
    /// `[num_tokens, hidden]` BF16 combined tokens.
    pub out: *mut u8,
    pub gemm: GemmOp,
}

impl MegaCombineOp {
    pub fn validate(&self, cfg: &Config) -> Result<()> {
        self.gemm.validate()?;
        if self.gemm.n != cfg.topo.hidden {
            return Err(Error::invalid(format!(
                "n = {} must be the context's hidden size {} (the combine reduces the GEMM's output rows)",
                self.gemm.n, cfg.topo.hidden
            )));
        }
        require(self.x, "combine->x")?;
        if self.gemm.dtype == Dtype::Fp8E4m3 {
            require(self.x_scales, "x_scales")?;
        }
        Ok(())
    }
}
