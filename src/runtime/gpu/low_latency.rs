//! Low-latency mode on GPUs: one-kernel FP8 dispatch and combine for decode.
//!
//! The kernels, the buffer layout and the signal protocol are described in
//! `kernels/low_latency.cu`. This side carves the mode's area of the
//! symmetric buffer and enqueues one launch per call. The runtime has
//! checked the arguments, the order of send-only and receive-only calls and
//! whether the dispatch had weights (`crate::runtime::context`).
//!
//! # Calls in flight
//! Each operation (dispatch, combine) alternates between two buffer sets,
//! and its call number lives in device memory, so CUDA graph replays advance
//! it. A rank may be one call ahead of a peer: its send phase of call `n`
//! writes set `n % 2` while the peer may still read set `(n - 1) % 2`, and
//! before writing it waits (bounded) until the peer has acknowledged reading
//! call `n - 2`, which the peer does when its call `n - 1` starts. This
//! relies on the context's calls running in order on the GPU (one stream,
//! or streams ordered by events), which the call numbers need anyway. A
//! peer that does
//! not keep up (or never calls) ends in `EP_ERR_TIMEOUT` from the async error
//! status, never in rows of another call.
//!
//! # Across nodes
//! With several nodes (`ranks_per_node`), what goes to a rank of another
//! node is put over the network leg (GIN, or its NVLink emulation on
//! virtual nodes) with signals in place of the flags and tags; the area
//! then has the signal words and this rank's staging of what it puts
//! (kernels/low_latency.cu, "Across nodes").
//!
//! # The combine's view of the dispatch
//! The combine returns the rows of this context's LAST dispatch: which rows
//! belong to which (source, token, slot), and the weights given at dispatch,
//! are kept on the device by that dispatch. `src_info` and `layout_range`
//! are not read. Weights at dispatch are checked on this rank only (its last
//! dispatch had weights); if ranks disagree, those that expect rows no peer
//! sends time out.

use super::{hierarchical, ptr, Bound, Runtime};
use crate::abi::{
    LlCounters, LlParams, LL_CHUNK_CHANNELS, LL_HEADER_BYTES, LL_MAX_TOKENS, LL_NET_CALL_UNIT,
    LL_SIGNAL_ROWS, LL_THREADS, LL_TIME_POINTS, MAX_HIDDEN, MAX_TOPK,
};
use crate::error::{Error, Result};
use crate::reference::Dtype;
use crate::runtime::backend::LlTimeline;
use crate::runtime::backend::Stream;
use crate::runtime::config::Config;
use crate::runtime::cuda::Kernel;
use crate::runtime::cuda::MappedHost;
use crate::runtime::ops::{LlCombineOp, LlDispatchOp};
use crate::runtime::sequence::Call;

/// Byte offsets of the mode's arrays inside its area of every rank's buffer
/// (the same on every rank); see the layout in `kernels/low_latency.cu`.
/// `W` = world, `M` = `ll_max_tokens`, `K` = topk, `L` = local experts,
/// `H` = hidden, `J` = `K + W`, `C` = `ceil(H / 512)`.
#[derive(Debug, Clone, Copy)]
struct Area {
    /// `LlCounters`: sequence numbers and arrival counts (this rank only).
    counters: usize,
    /// `[2, W]` announce flags the sources write, after their `[2, W, S]`
    /// row counts per local expert, token counts and (across nodes) masks of
    /// the tokens sent.
    dispatch_flags: usize,
    dispatch_counts: usize,
    /// `S`: ints of one counts entry, `L + 1 + ceil(M / 32)`.
    counts_stride: usize,
    /// `[2, W, M]` per-token arrival tags.
    dispatch_tags: usize,
    /// `[2, W, M]` messages of `msg_bytes`.
    dispatch_msgs: usize,
    /// `[W]` each rank's last finished dispatch receive.
    dispatch_acks: usize,
    /// `[2, M, J, C]` return-row chunk tags and `[2, M, J, H]` BF16 return
    /// rows.
    combine_tags: usize,
    combine_rows: usize,
    /// `[W]` each rank's last finished combine receive.
    combine_acks: usize,
    /// `[W]` tokens per source of the last dispatch.
    dispatch_tokens: usize,
    /// `[W, M, K]` row and weight of each received (source, token, slot).
    token_rows: usize,
    token_weights: usize,
    /// `[L, W * M, H]` BF16 zero-copy combine buffer.
    combine_buffer: usize,
    combine_buffer_bytes: usize,
    /// Across nodes (empty otherwise): `[LL_SIGNAL_ROWS, W]` u64 signal
    /// words, and the staging of what this rank puts: `[W, S]` counts, `[M]`
    /// messages, `[W, M, H]` BF16 partial sums.
    net_signals: usize,
    net_counts: usize,
    net_msgs: usize,
    net_partials: usize,
    /// Header, then the larger of a BF16 row and an FP8 row with scales.
    msg_bytes: usize,
    /// Bytes of the whole area.
    bytes: usize,
}

impl Area {
    fn new(cfg: &Config) -> Area {
        let t = &cfg.topo;
        let (m, world, topk, hidden) = (cfg.ll_max_tokens, t.world, t.topk, t.hidden);
        let local = t.local_experts();
        let msg_bytes = LL_HEADER_BYTES + 2 * hidden;
        let combine_buffer_bytes = local * world * m * hidden * 2;
        let counts_stride = local + 1 + m.div_ceil(32);
        // The network leg's pieces, with several nodes only.
        let net = |bytes: usize| {
            if cfg.nodes().is_hierarchical() {
                bytes
            } else {
                0
            }
        };
        let mut next = 0;
        // 256-byte aligned pieces: rows are moved as 16-byte vectors.
        let mut take = |bytes: usize| {
            let at = next;
            next = (at + bytes).div_ceil(256) * 256;
            at
        };
        Area {
            counters: take(std::mem::size_of::<LlCounters>()),
            dispatch_flags: take(2 * world * 4),
            dispatch_counts: take(2 * world * counts_stride * 4),
            counts_stride,
            dispatch_tags: take(2 * world * m * 4),
            dispatch_msgs: take(2 * world * m * msg_bytes),
            dispatch_acks: take(world * 4),
            combine_tags: take(2 * m * (topk + world) * hidden.div_ceil(LL_CHUNK_CHANNELS) * 4),
            combine_rows: take(2 * m * (topk + world) * hidden * 2),
            combine_acks: take(world * 4),
            dispatch_tokens: take(world * 4),
            token_rows: take(world * m * topk * 4),
            token_weights: take(world * m * topk * 4),
            combine_buffer: take(combine_buffer_bytes),
            combine_buffer_bytes,
            net_signals: take(net(LL_SIGNAL_ROWS * world * 8)),
            net_counts: take(net(world * counts_stride * 4)),
            net_msgs: take(net(m * msg_bytes)),
            net_partials: take(net(world * m * hidden * 2)),
            msg_bytes,
            bytes: next,
        }
    }
}

/// Bytes of symmetric buffer the low-latency mode needs for `cfg` (none when
/// the mode is disabled).
pub fn buffer_bytes(cfg: &Config) -> usize {
    if cfg.ll_max_tokens == 0 {
        return 0;
    }
    Area::new(cfg).bytes
}

// A call's puts to one rank must stay below the unit of its data signals
// (kernels/low_latency.cu, "Across nodes").
const _: () = assert!(
    LL_MAX_TOKENS * MAX_TOPK * MAX_HIDDEN.div_ceil(LL_CHUNK_CHANNELS) < LL_NET_CALL_UNIT as usize
);

/// GIN signals the mode needs for `cfg` (after the hierarchical mode's):
/// a row of `world` per kind across nodes, none otherwise.
pub fn gin_signals(cfg: &Config) -> usize {
    if cfg.ll_max_tokens == 0 || !cfg.nodes().is_hierarchical() {
        return 0;
    }
    LL_SIGNAL_ROWS * cfg.world()
}

/// The ranks on other nodes than `cfg.rank` (bit r for rank r).
fn net_mask(cfg: &Config) -> u64 {
    let nodes = cfg.nodes();
    let home = nodes.node_of(cfg.rank);
    (0..cfg.world())
        .filter(|&r| nodes.node_of(r) != home)
        .fold(0, |mask, r| mask | 1 << r)
}

/// The ranks whose kernels run on this rank's GPU, itself included (bit r
/// for rank r).
fn gpu_peers(rt: &Runtime) -> u64 {
    rt.placement
        .sharing
        .iter()
        .fold(0, |mask, &r| mask | 1 << r)
}

/// The parameters every launch of a context shares: its buffers, area
/// offsets, shape and network leg.
fn shared_params(rt: &Runtime, offset: usize, a: &Area) -> LlParams {
    let (cfg, topo) = (&rt.cfg, rt.cfg.topo);
    let nccl = rt.memory.nccl();
    LlParams {
        peer_bases: rt.memory.peer_bases(),
        status: rt.status_ptr(),
        abort_flag: rt.abort_ptr(),
        timeout_ns: rt.timeout_ns,
        area: offset as i64,
        off_counters: a.counters as i64,
        off_dispatch_flags: a.dispatch_flags as i64,
        off_dispatch_counts: a.dispatch_counts as i64,
        off_dispatch_tags: a.dispatch_tags as i64,
        off_dispatch_msgs: a.dispatch_msgs as i64,
        off_dispatch_acks: a.dispatch_acks as i64,
        off_combine_tags: a.combine_tags as i64,
        off_combine_rows: a.combine_rows as i64,
        off_combine_acks: a.combine_acks as i64,
        off_dispatch_tokens: a.dispatch_tokens as i64,
        off_token_rows: a.token_rows as i64,
        off_token_weights: a.token_weights as i64,
        msg_bytes: a.msg_bytes as i64,
        off_net_signals: a.net_signals as i64,
        off_net_counts: a.net_counts as i64,
        off_net_msgs: a.net_msgs as i64,
        off_net_partials: a.net_partials as i64,
        off_combine_buffer: a.combine_buffer as i64,
        counts_stride: a.counts_stride as i64,
        net_mask: net_mask(cfg),
        gpu_peers: gpu_peers(rt),
        dev_comm: nccl.as_ref().map_or(0, |n| n.dev_comm),
        window: nccl.as_ref().map_or(0, |n| n.window),
        gin_first_signal: hierarchical::gin_signals(cfg.nodes()) as i32,
        rank: cfg.rank as i32,
        world: topo.world as i32,
        num_experts: topo.num_experts as i32,
        topk: topo.topk as i32,
        hidden: topo.hidden as i32,
        max_tokens: cfg.ll_max_tokens as i32,
        ..LlParams::default()
    }
}

pub struct LlMode {
    area: Area,
    /// Blocks per launch: one per SM of this rank's share of the GPU.
    grid: u32,
    /// The parameters every launch shares (made once; each call fills in
    /// its operation's).
    shared: LlParams,
    /// `[2, grid, LL_TIME_POINTS]` device timestamps of the last dispatch
    /// and combine launches (`LlParams::timeline`), made when ep-bench
    /// first asks for them; launches note them while `keep_timeline`.
    timeline: Option<MappedHost<u64>>,
    keep_timeline: bool,
}

impl LlMode {
    /// The mode's area starts at `offset` of every rank's symmetric buffer.
    ///
    /// The kernels' blocks wait for each other, so a launch is cooperative
    /// (the driver starts the grid only when all of it is resident), and
    /// the grid is one block per SM of this rank's share: the grids of all
    /// ranks on the GPU fit on it at once (kernels/low_latency.cu,
    /// "Co-residency"). Errors: `Unsupported` when a block of
    /// `LL_THREADS` threads does not fit on an SM.
    pub fn new(rt: &Runtime, offset: usize) -> Result<LlMode> {
        let bound = rt.device.bind()?;
        let k = &rt.kernels;
        for kernel in [
            &k.ll_dispatch,
            &k.ll_combine,
            &k.ll_dispatch_net,
            &k.ll_combine_net,
        ] {
            if kernel.max_blocks_per_sm(&bound, LL_THREADS as u32, 0)? == 0 {
                return Err(Error::unsupported(format!(
                    "{}: a block of {LL_THREADS} threads does not fit on an SM of this GPU",
                    kernel.name()
                )));
            }
        }
        let area = Area::new(&rt.cfg);
        Ok(LlMode {
            shared: shared_params(rt, offset, &area),
            area,
            grid: rt.placement.sm_share(),
            timeline: None,
            keep_timeline: false,
        })
    }

    /// From now on every launch notes device timestamps in host-mapped
    /// memory (a few stores per block), or no longer does.
    pub fn keep_timeline(&mut self, rt: &Runtime, keep: bool) -> Result<()> {
        if keep && self.timeline.is_none() {
            let points = 2 * self.grid as usize * LL_TIME_POINTS;
            self.timeline = Some(MappedHost::new(&rt.device, points)?);
        }
        self.keep_timeline = keep;
        Ok(())
    }

    /// The timestamps of the last launches (their stream has been waited
    /// for by the caller).
    pub fn timeline(&self) -> Result<LlTimeline> {
        let kept = self.timeline.as_ref().ok_or_else(|| {
            Error::invalid("no device timestamps: ll_keep_timeline was never called")
        })?;
        Ok(LlTimeline {
            blocks: self.grid as usize,
            ns: (0..kept.len()).map(|i| kept.read(i)).collect(),
        })
    }

    /// Where launches of operation `op` (0 dispatch, 1 combine) note their
    /// timestamps, or 0.
    fn timeline_of(&self, op: usize) -> u64 {
        match &self.timeline {
            Some(t) if self.keep_timeline => {
                t.device_ptr() + (op * self.grid as usize * LL_TIME_POINTS * 8) as u64
            }
            _ => 0,
        }
    }

    /// Launches `kernel` with `params` on `stream`, cooperatively.
    fn launch(
        &self,
        rt: &Bound,
        kernel: &Kernel<LlParams>,
        params: &LlParams,
        stream: Stream,
    ) -> Result<()> {
        // SAFETY: the caller's arrays stay valid until the stream has run
        // the kernel (API rule), the context's buffers until it is
        // destroyed.
        unsafe {
            rt.launch_ex(
                true,
                kernel,
                self.grid,
                LL_THREADS as u32,
                0,
                stream,
                params,
            )
        }
    }

    pub fn dispatch(
        &mut self,
        rt: &Bound,
        call: Call,
        op: &LlDispatchOp,
        stream: Stream,
    ) -> Result<()> {
        let phases = op.phases;
        let params = LlParams {
            x: ptr(op.x),
            topk_idx: ptr(op.topk_idx),
            topk_weights: ptr(op.topk_weights),
            device_num_tokens: ptr(op.device_num_tokens),
            recv_x: ptr(op.recv_x),
            recv_scales: ptr(op.recv_scales),
            recv_count: ptr(op.recv_count),
            recv_src_info: ptr(op.recv_src_info),
            recv_layout_range: ptr(op.recv_layout_range),
            num_tokens: op.num_tokens as i32,
            fp8: (op.out_dtype == Dtype::Fp8E4m3) as i32,
            ue8m0: op.ue8m0 as i32,
            do_send: phases.send as i32,
            do_recv: phases.recv as i32,
            collective: call.op.code() as i32,
            timeline: self.timeline_of(0),
            ..self.shared
        };
        let kernel = if params.net_mask != 0 {
            &rt.kernels.ll_dispatch_net
        } else {
            &rt.kernels.ll_dispatch
        };
        self.launch(rt, kernel, &params, stream)
    }

    pub fn combine(
        &mut self,
        rt: &Bound,
        call: Call,
        op: &LlCombineOp,
        stream: Stream,
    ) -> Result<()> {
        let phases = op.phases;
        let weighted = op.weighted();
        let x = if op.zero_copy {
            self.combine_buffer(rt)?.0 as *const u8
        } else {
            op.x
        };
        let params = LlParams {
            x: ptr(x),
            topk_idx: ptr(op.topk_idx),
            topk_weights: ptr(op.topk_weights),
            out: ptr(op.out),
            device_num_tokens: ptr(op.device_num_tokens),
            num_tokens: op.num_tokens as i32,
            weighted: weighted as i32,
            do_send: phases.send as i32,
            do_recv: phases.recv as i32,
            collective: call.op.code() as i32,
            timeline: self.timeline_of(1),
            ..self.shared
        };
        let kernel = if params.net_mask != 0 {
            &rt.kernels.ll_combine_net
        } else {
            &rt.kernels.ll_combine
        };
        self.launch(rt, kernel, &params, stream)
    }

    /// This rank's BF16 `[L, W * M, hidden]` zero-copy combine buffer. Only
    /// the caller writes it; the kernels read it in an `EP_LL_ZERO_COPY`
    /// combine.
    pub fn combine_buffer(&mut self, rt: &Runtime) -> Result<(*mut u8, usize)> {
        let at =
            rt.memory.own_base() + (self.shared.area as usize + self.area.combine_buffer) as u64;
        Ok((at as *mut u8, self.area.combine_buffer_bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(world: usize, rank: usize, rpn: usize) -> Config {
        super::super::test_config(world, rank, rpn, 40)
    }

    /// With one node the network pieces take no room and no rank is on the
    /// network; with several, the ranks of the other nodes are, and the
    /// signals and staging are sized for the world (and counted by
    /// `buffer_bytes`, which `ep_get_buffer_size_hint` reports).
    #[test]
    fn network_pieces_exist_only_across_nodes() {
        let one = Area::new(&config(4, 1, 0));
        assert_eq!(net_mask(&config(4, 1, 0)), 0);
        assert_eq!(one.net_partials, one.bytes);
        assert_eq!(gin_signals(&config(4, 1, 0)), 0);
        for (world, rpn, rank, mask) in [(2, 1, 0, 0b10), (4, 2, 1, 0b1100), (4, 1, 2, 0b1011)] {
            let cfg = config(world, rank, rpn);
            assert_eq!(net_mask(&cfg), mask, "world {world} rpn {rpn} rank {rank}");
            let a = Area::new(&cfg);
            let stride = 24 / world + 1 + 40usize.div_ceil(32);
            assert_eq!(a.counts_stride, stride);
            assert!(a.net_counts - a.net_signals >= LL_SIGNAL_ROWS * world * 8);
            assert!(a.net_msgs - a.net_counts >= world * stride * 4);
            assert!(a.net_partials - a.net_msgs >= 40 * a.msg_bytes);
            assert!(a.bytes - a.net_partials >= world * 40 * 256 * 2);
            assert!(buffer_bytes(&cfg) > buffer_bytes(&config(world, rank, 0)));
            assert_eq!(gin_signals(&cfg), LL_SIGNAL_ROWS * world);
        }
    }
}
