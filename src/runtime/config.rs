//! The validated configuration of one context.

use crate::error::{Error, Result};
use crate::reference::hierarchical::NodeShape;
use crate::reference::{Dtype, Topology};
use std::time::Duration;

/// Largest values the library supports (src/abi/defs.rs, shared with the
/// kernels; the header's `EP_MAX_*` are checked against them in src/capi).
pub use crate::abi::{
    HIDDEN_ALIGNMENT, LL_MAX_TOKENS, MAX_EXPERTS, MAX_HIDDEN, MAX_TOPK, MAX_WORLD_SIZE,
};
/// Normal-mode tokens per rank; large enough for any prefill chunk, small
/// enough that buffer sizes cannot overflow.
pub const MAX_TOKENS_PER_RANK: usize = 1 << 20;
pub const MAX_EXPERT_ALIGNMENT: usize = 1024;
/// Largest `n` and `k` of a fused call's GEMM.
pub const MAX_GEMM_DIM: usize = 65536;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    Host,
    Gpu,
}

/// What the caller asked for, before validation (plain numbers from C).
#[derive(Debug, Clone, Copy)]
pub struct ConfigRequest {
    pub world: i32,
    pub rank: i32,
    pub device: i32,
    pub max_tokens_per_rank: i32,
    pub hidden: i32,
    pub topk: i32,
    pub num_experts: i32,
    pub token_dtype: Dtype,
    pub backend: BackendKind,
    pub num_sms: i32,
    pub timeout_ms: u32,
    pub ll_max_tokens_per_rank: i32,
    pub ranks_per_node: i32,
}

#[derive(Debug, Clone, Copy)]
pub struct Config {
    pub rank: usize,
    pub device: i32,
    pub topo: Topology,
    pub max_tokens: usize,
    pub token_dtype: Dtype,
    pub backend: BackendKind,
    pub num_sms: usize,
    pub timeout: Duration,
    /// 0 when the low-latency mode is disabled.
    pub ll_max_tokens: usize,
    /// Ranks per node; 0 until [`Config::settle`] asks the hosts.
    pub ranks_per_node: usize,
}

fn in_range(name: &str, value: i32, lo: usize, hi: usize) -> Result<usize> {
    let ok = value >= 0 && (lo..=hi).contains(&(value as usize));
    if ok {
        Ok(value as usize)
    } else {
        Err(Error::invalid(format!(
            "{name} = {value} is outside [{lo}, {hi}]"
        )))
    }
}

impl Config {
    pub fn new(req: &ConfigRequest) -> Result<Config> {
        let world = in_range("world_size", req.world, 1, MAX_WORLD_SIZE)?;
        if req.rank < 0 || req.rank as usize >= world {
            return Err(Error::invalid(format!(
                "rank {} is outside [0, world_size {world})",
                req.rank
            )));
        }
        if req.device < 0 {
            return Err(Error::invalid(format!("device {} is negative", req.device)));
        }
        let hidden = in_range("hidden", req.hidden, HIDDEN_ALIGNMENT, MAX_HIDDEN)?;
        if hidden % HIDDEN_ALIGNMENT != 0 {
            return Err(Error::invalid(format!(
                "hidden = {hidden} is not a multiple of {HIDDEN_ALIGNMENT}"
            )));
        }
        let num_experts = in_range("num_experts", req.num_experts, 1, MAX_EXPERTS)?;
        if num_experts % world != 0 {
            return Err(Error::invalid(format!(
                "num_experts = {num_experts} is not divisible by world_size = {world}"
            )));
        }
        let topk = in_range("topk", req.topk, 1, MAX_TOPK.min(num_experts))?;
        let max_tokens = in_range(
            "max_tokens_per_rank",
            req.max_tokens_per_rank,
            1,
            MAX_TOKENS_PER_RANK,
        )?;
        let num_sms = in_range("num_sms", req.num_sms, 0, 1024)?;
        let ll_max_tokens = in_range(
            "ll_max_tokens_per_rank",
            req.ll_max_tokens_per_rank,
            0,
            LL_MAX_TOKENS,
        )?;
        let ranks_per_node = in_range("ranks_per_node", req.ranks_per_node, 0, world)?;
        if ranks_per_node > 0 && !world.is_multiple_of(ranks_per_node) {
            return Err(Error::invalid(format!(
                "ranks_per_node = {ranks_per_node} does not divide world_size = {world}"
            )));
        }
        Ok(Config {
            rank: req.rank as usize,
            device: req.device,
            topo: Topology {
                world,
                num_experts,
                topk,
                hidden,
            },
            max_tokens,
            token_dtype: req.token_dtype,
            backend: req.backend,
            num_sms: if num_sms == 0 { 24 } else { num_sms },
            timeout: Duration::from_millis(if req.timeout_ms == 0 {
                100_000
            } else {
                req.timeout_ms as u64
            }),
            ll_max_tokens,
            ranks_per_node,
        })
    }

    pub fn world(&self) -> usize {
        self.topo.world
    }

    pub fn local_experts(&self) -> usize {
        self.topo.local_experts()
    }

    /// The nodes the ranks form; one node while `ranks_per_node` is 0 (as
    /// `ep_get_buffer_size_hint` counts it).
    pub fn nodes(&self) -> NodeShape {
        match self.ranks_per_node {
            0 => NodeShape::new(self.world(), self.world()),
            r => NodeShape::new(self.world(), r),
        }
    }

    /// Fixes `ranks_per_node` when the caller left it to the hosts: every
    /// host is a node. `host_ranks` are the ranks on this rank's host,
    /// ascending; they must be consecutive and start at a multiple of their
    /// count (every host holding as many is checked when the ranks agree on
    /// the configuration).
    fn resolve_nodes(&mut self, host_ranks: &[usize]) -> Result<()> {
        if self.ranks_per_node != 0 {
            return Ok(());
        }
        let n = host_ranks.len();
        let consecutive = host_ranks.windows(2).all(|w| w[1] == w[0] + 1);
        let aligned = host_ranks.first().is_some_and(|&f| f % n.max(1) == 0);
        if n == 0 || !consecutive || !aligned || !self.world().is_multiple_of(n) {
            return Err(Error::unsupported(format!(
                "ranks_per_node = 0 makes every host a node, which needs each host's ranks consecutive and as many on every host; this host holds ranks {host_ranks:?} of {}: set ranks_per_node",
                self.world()
            )));
        }
        self.ranks_per_node = n;
        Ok(())
    }

    /// Once the ranks have met in `group`: the nodes from `host_ranks` (see
    /// `resolve_nodes`), then the check that every rank passed the
    /// same configuration. Every backend runs this before it makes
    /// anything of the group.
    pub fn settle(
        &mut self,
        group: &dyn super::group::HostGroup,
        host_ranks: &[usize],
    ) -> Result<()> {
        self.resolve_nodes(host_ranks)?;
        agree_on_config(group, self)
    }
}

/// Checks that every rank passed the same configuration; a mismatch would
/// otherwise surface as corrupted data or a hang.
fn agree_on_config(group: &dyn super::group::HostGroup, cfg: &Config) -> Result<()> {
    let t = &cfg.topo;
    let fields: [(&str, u64); 10] = [
        ("max_tokens_per_rank", cfg.max_tokens as u64),
        ("hidden", t.hidden as u64),
        ("topk", t.topk as u64),
        ("num_experts", t.num_experts as u64),
        ("token_dtype", (cfg.token_dtype == Dtype::Fp8E4m3) as u64),
        ("backend", (cfg.backend == BackendKind::Gpu) as u64),
        ("num_sms", cfg.num_sms as u64),
        ("timeout_ms", cfg.timeout.as_millis() as u64),
        ("ll_max_tokens_per_rank", cfg.ll_max_tokens as u64),
        ("ranks_per_node", cfg.ranks_per_node as u64),
    ];
    let mine: Vec<u8> = fields.iter().flat_map(|(_, v)| v.to_le_bytes()).collect();
    for (peer, theirs) in group.all_gather(&mine)?.iter().enumerate() {
        if theirs.len() != mine.len() {
            return Err(Error::remote(format!(
                "rank {peer} sent a malformed configuration"
            )));
        }
        for (i, (name, value)) in fields.iter().enumerate() {
            let other = u64::from_le_bytes(theirs[i * 8..i * 8 + 8].try_into().unwrap());
            if other != *value {
                return Err(Error::invalid(format!(
                    "ranks disagree on the configuration: {name} is {value} here and {other} on rank {peer}"
                )));
            }
        }
    }
    Ok(())
}
