//! One-line descriptions of the operations for the debug log: the shape of
//! a call and the path it takes through a backend.

use super::ops::{
    CombineOp, DispatchOp, LayoutOp, LlCombineOp, LlDispatchOp, MegaCombineOp, MegaDispatchOp,
    MegaOp, MoeOp, Phases,
};
use crate::reference::Dtype;

/// "BF16" or "FP8".
pub fn dtype(d: Dtype) -> &'static str {
    match d {
        Dtype::Bf16 => "BF16",
        Dtype::Fp8E4m3 => "FP8",
    }
}

fn phases(p: Phases) -> &'static str {
    match (p.send, p.recv) {
        (true, true) => "send+receive",
        (true, false) => "send phase only",
        (false, true) => "receive phase only",
        (false, false) => "no phase",
    }
}

/// The token count of a low-latency call: fixed, or read from device memory.
fn ll_tokens(num_tokens: usize, device_num_tokens: *const i32) -> String {
    if device_num_tokens.is_null() {
        format!("{num_tokens} tokens")
    } else {
        format!("up to {num_tokens} tokens (count read from device memory)")
    }
}

impl LayoutOp {
    pub fn describe(&self) -> String {
        format!("{} tokens", self.num_tokens)
    }
}

impl DispatchOp {
    pub fn describe(&self) -> String {
        let mut outputs = Vec::new();
        if let Some(r) = &self.recv {
            outputs.push(format!("source-order ({} rows)", r.capacity));
        }
        if let Some(e) = &self.expert {
            outputs.push(format!(
                "expert-major ({} rows, alignment {})",
                e.capacity, e.alignment
            ));
        }
        let path = if self.reuse_layout {
            "reusing the handle's layout (no count step, no host synchronisation)"
        } else if self.no_host_sync {
            "no host synchronisation (counts in device memory; graph-capturable)"
        } else {
            "host-synchronised (counts copied to the host before return)"
        };
        format!(
            "{} tokens {} -> {}; {path}",
            self.num_tokens,
            dtype(self.dtype),
            outputs.join(" + ")
        )
    }
}

impl CombineOp {
    pub fn describe(&self) -> String {
        if self.expert_major {
            "expert-major input (weighted and reduced per rank before the return)".to_string()
        } else {
            "source-order input (already reduced by the caller)".to_string()
        }
    }
}

impl LlDispatchOp {
    pub fn describe(&self) -> String {
        let out = match (self.out_dtype, self.ue8m0) {
            (Dtype::Fp8E4m3, true) => "FP8 with UE8M0 scales",
            (Dtype::Fp8E4m3, false) => "FP8",
            (Dtype::Bf16, _) => "BF16",
        };
        let weights = if self.topk_weights.is_null() {
            "weights at combine"
        } else {
            "weights at dispatch"
        };
        format!(
            "{} -> {out}; {weights}; {}",
            ll_tokens(self.num_tokens, self.device_num_tokens),
            phases(self.phases)
        )
    }
}

impl LlCombineOp {
    pub fn describe(&self) -> String {
        let weights = if self.topk_weights.is_null() {
            "weights from the dispatch (expert-side reduction)"
        } else {
            "weights at combine"
        };
        let input = if self.zero_copy {
            "zero-copy input"
        } else {
            "input copied"
        };
        format!(
            "{}; {weights}; {input}; {}",
            ll_tokens(self.num_tokens, self.device_num_tokens),
            phases(self.phases)
        )
    }
}

impl MegaOp {
    pub fn describe(&self) -> String {
        let sms = match self.num_sms {
            0 => "all SMs".to_string(),
            n => format!("{n} SMs"),
        };
        format!(
            "{} grouped GEMM n {} k {} on {sms}",
            dtype(self.dtype),
            self.n,
            self.k
        )
    }
}

impl MegaDispatchOp {
    pub fn describe(&self) -> String {
        format!(
            "{}; then {}",
            self.dispatch.describe(),
            self.gemm.describe()
        )
    }
}

impl MegaCombineOp {
    pub fn describe(&self) -> String {
        format!("{}; then a combine", self.gemm.describe())
    }
}

impl MoeOp {
    pub fn describe(&self) -> String {
        let sms = match self.experts.num_sms {
            0 => "all SMs".to_string(),
            n => format!("{n} SMs"),
        };
        format!(
            "{}; then {} experts (gate+up GEMM, SwiGLU, down GEMM), intermediate {}, on {sms}; then a combine",
            self.dispatch.describe(),
            dtype(self.experts.dtype),
            self.experts.intermediate
        )
    }
}
