//! The defaults of every versioned struct: what its `ep_*_init` writes and
//! what an older, smaller struct gets for the fields it lacks.

use super::entry::Versioned;
use super::types::*;
use std::ptr::{null, null_mut};

fn header<T>(magic: u32) -> (u32, u32, u32) {
    (std::mem::size_of::<T>() as u32, magic, EP_API_VERSION)
}

impl Versioned for ep_config_t {
    const NAME: &'static str = "config";
    const MAGIC: u32 = EP_CONFIG_MAGIC;
    const MIN_SIZE: u32 = EP_CONFIG_MIN_SIZE;
    fn defaults() -> Self {
        let (struct_size, magic, version) = header::<Self>(Self::MAGIC);
        ep_config_t {
            struct_size,
            magic,
            version,
            max_tokens_per_rank: 4096,
            hidden: 7168,
            topk: 8,
            num_experts: 256,
            token_dtype: EP_DTYPE_BF16,
            backend: EP_BACKEND_AUTO,
            num_sms: 24,
            timeout_ms: 100_000,
            ll_max_tokens_per_rank: 128,
            ranks_per_node: 0,
        }
    }
}

impl Versioned for ep_dispatch_args_t {
    const NAME: &'static str = "dispatch args";
    const MAGIC: u32 = EP_DISPATCH_ARGS_MAGIC;
    const MIN_SIZE: u32 = EP_DISPATCH_ARGS_MIN_SIZE;
    fn defaults() -> Self {
        let (struct_size, magic, version) = header::<Self>(Self::MAGIC);
        ep_dispatch_args_t {
            struct_size,
            magic,
            version,
            flags: 0,
            num_tokens: 0,
            dtype: EP_DTYPE_BF16,
            x: null(),
            x_scales: null(),
            topk_idx: null(),
            topk_weights: null(),
            recv_capacity: 0,
            expert_alignment: 1,
            recv_x: null_mut(),
            recv_x_scales: null_mut(),
            recv_topk_idx: null_mut(),
            recv_topk_weights: null_mut(),
            recv_src_info: null_mut(),
            recv_num_tokens: null_mut(),
            expert_capacity: 0,
            expert_x: null_mut(),
            expert_x_scales: null_mut(),
            expert_weights: null_mut(),
            expert_src_row: null_mut(),
            expert_offsets: null_mut(),
            expert_counts: null_mut(),
            host_recv_num_tokens: null_mut(),
            host_expert_counts: null_mut(),
        }
    }
}

impl Versioned for ep_combine_args_t {
    const NAME: &'static str = "combine args";
    const MAGIC: u32 = EP_COMBINE_ARGS_MAGIC;
    const MIN_SIZE: u32 = EP_COMBINE_ARGS_MIN_SIZE;
    fn defaults() -> Self {
        let (struct_size, magic, version) = header::<Self>(Self::MAGIC);
        ep_combine_args_t {
            struct_size,
            magic,
            version,
            input_layout: EP_COMBINE_SOURCE_ORDER,
            x: null(),
            out: null_mut(),
        }
    }
}

impl Versioned for ep_ll_dispatch_args_t {
    const NAME: &'static str = "low-latency dispatch args";
    const MAGIC: u32 = EP_LL_DISPATCH_ARGS_MAGIC;
    const MIN_SIZE: u32 = EP_LL_DISPATCH_ARGS_MIN_SIZE;
    fn defaults() -> Self {
        let (struct_size, magic, version) = header::<Self>(Self::MAGIC);
        ep_ll_dispatch_args_t {
            struct_size,
            magic,
            version,
            flags: 0,
            num_tokens: 0,
            out_dtype: EP_DTYPE_FP8_E4M3,
            x: null(),
            topk_idx: null(),
            topk_weights: null(),
            recv_x: null_mut(),
            recv_x_scales: null_mut(),
            recv_count: null_mut(),
            recv_src_info: null_mut(),
            recv_layout_range: null_mut(),
            device_num_tokens: null(),
        }
    }
}

impl Versioned for ep_ll_combine_args_t {
    const NAME: &'static str = "low-latency combine args";
    const MAGIC: u32 = EP_LL_COMBINE_ARGS_MAGIC;
    const MIN_SIZE: u32 = EP_LL_COMBINE_ARGS_MIN_SIZE;
    fn defaults() -> Self {
        let (struct_size, magic, version) = header::<Self>(Self::MAGIC);
        ep_ll_combine_args_t {
            struct_size,
            magic,
            version,
            flags: 0,
            num_tokens: 0,
            x: null(),
            topk_idx: null(),
            topk_weights: null(),
            src_info: null(),
            layout_range: null(),
            out: null_mut(),
            device_num_tokens: null(),
        }
    }
}

impl Versioned for ep_mega_args_t {
    const NAME: &'static str = "megakernel args";
    const MAGIC: u32 = EP_MEGA_ARGS_MAGIC;
    const MIN_SIZE: u32 = EP_MEGA_ARGS_MIN_SIZE;
    fn defaults() -> Self {
        let (struct_size, magic, version) = header::<Self>(Self::MAGIC);
        ep_mega_args_t {
            struct_size,
            magic,
            version,
            flags: 0,
            dispatch: null(),
            combine: null(),
            weight_dtype: EP_DTYPE_BF16,
            n: 0,
            k: 0,
            num_sms: 0,
            weights: null(),
            weight_scales: null(),
            y: null_mut(),
            x_scales: null(),
        }
    }
}

impl Versioned for ep_moe_args_t {
    const NAME: &'static str = "moe args";
    const MAGIC: u32 = EP_MOE_ARGS_MAGIC;
    const MIN_SIZE: u32 = EP_MOE_ARGS_MIN_SIZE;
    fn defaults() -> Self {
        let (struct_size, magic, version) = header::<Self>(Self::MAGIC);
        ep_moe_args_t {
            struct_size,
            magic,
            version,
            flags: 0,
            dispatch: null(),
            combine: null(),
            weight_dtype: EP_DTYPE_BF16,
            intermediate: 0,
            num_sms: 0,
            w1: null(),
            w1_scales: null(),
            w2: null(),
            w2_scales: null(),
            y1: null_mut(),
            act: null_mut(),
            act_scales: null_mut(),
            y2: null_mut(),
        }
    }
}
