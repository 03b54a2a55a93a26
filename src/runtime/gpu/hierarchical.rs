//! The hierarchical normal mode on GPUs: dispatch and combine when the ranks
//! form several nodes (`ranks_per_node` below the world size).
//!
//! The plan is `src/reference/hierarchical.rs`; the kernels and their
//! protocol are described at the top of `kernels/hierarchical.cu`. This side
//! carves the mode's area of the symmetric buffer, builds the tables that
//! point the single-node pull and combine kernels (`kernels/normal.cu`) at
//! the gateways' copies, keeps the hierarchy's part of the routing in the
//! handle, and enqueues the launches. [`super::normal::NormalMode`] calls it
//! in place of its single-node exchange, so validation, the count kernel,
//! the host synchronisation and the handle's life cycle stay in one place.
//!
//! # Tables
//! The single-node kernels reach "source s" at `peer_bases[s] + area + off`.
//! Two tables of bases (device arrays, one entry per rank, built once) make
//! them read and write the hierarchy's copies instead:
//! - pull table: for a source on this node, its own buffer; for a source on
//!   node m, its gateway g on this node plus the distance from the normal
//!   area's staging array to the relay block g keeps for node m, which has
//!   the same layout from `staged_x` to `totals` (rows and scales at token
//!   t, the totals the source put there). Entry `rank` is this rank's own
//!   buffer, where the pull finds its records (written by the gateways).
//! - combine table: for source s on node m, its gateway g on this node plus
//!   `(m - this node) * R * T` return rows, so that this rank's row for
//!   (s, t), which the send kernel writes at row `rank * T + t`, lands at
//!   row `(m * R + local) * T + t` of g: one band of `R * T` rows per source
//!   node, each rank of the node its own row in it.
//!
//! # Buffer (the mode's area, after the other modes')
//! `N` = nodes, `T` = max tokens per rank, `H` = hidden:
//! signals `[3, N]` u64 | counters | notify `[N]` (16 bytes each) | headers
//! `[N, T]` | relay blocks `[N - 1]` | node sums `[N, T, H]` BF16 | combine
//! staging `[N - 1, T, H]` BF16.

use super::normal::{chunks, Area as NormalArea};
use super::{Bound, Runtime};
use crate::abi::{
    CombineParams, DispatchParams, HierParams, NormalOffsets, CHUNK_TOKENS, HIER_COUNTER_INTS,
    HIER_HEADER_BYTES, HIER_SIGNAL_KINDS, MAX_WORLD_SIZE, MOVE_THREADS,
};
use crate::error::{Error, Result};
use crate::reference::hierarchical::NodeShape;
use crate::runtime::backend::Stream;
use crate::runtime::config::Config;
use crate::runtime::cuda::DeviceBuffer;

/// Threads of the one-block wait and rail-barrier kernels
/// (`EP_HIER_SMALL_THREADS`): one per possible node.
const SMALL_THREADS: u32 = MAX_WORLD_SIZE as u32;

/// Byte offsets of the mode's arrays in every rank's buffer (absolute, the
/// same on every rank).
#[derive(Debug, Clone, Copy)]
struct HierArea {
    signals: usize,
    counters: usize,
    notify: usize,
    headers: usize,
    relay: usize,
    /// Bytes of one relay block: the normal area's span from `staged_x` to
    /// the end of `totals`.
    relay_bytes: usize,
    node_sums: usize,
    combine_stage: usize,
    /// End of the area.
    end: usize,
}

impl HierArea {
    /// The area from `start` on, for the normal mode's area `normal`.
    fn new(cfg: &Config, start: usize, normal: &NormalArea) -> HierArea {
        let nodes = cfg.nodes().nodes();
        let t = cfg.max_tokens;
        let row = cfg.topo.hidden * 2;
        let columns = cfg.world() + cfg.topo.num_experts;
        let relay_bytes = (normal.totals + columns * 4 - normal.staged_x).div_ceil(256) * 256;
        let mut next = start.div_ceil(256) * 256;
        let mut take = |bytes: usize| {
            let at = next;
            next = (at + bytes).div_ceil(256) * 256;
            at
        };
        HierArea {
            signals: take(HIER_SIGNAL_KINDS * nodes * 8),
            counters: take(HIER_COUNTER_INTS * 4),
            notify: take(nodes * 16),
            headers: take(nodes * t * HIER_HEADER_BYTES),
            relay: take((nodes - 1) * relay_bytes),
            relay_bytes,
            node_sums: take(nodes * t * row),
            combine_stage: take((nodes - 1) * t * row),
            end: next,
        }
    }
}

/// Bytes of symmetric buffer the hierarchical mode adds for `cfg` (none
/// with one node).
pub fn buffer_bytes(cfg: &Config) -> usize {
    if !cfg.nodes().is_hierarchical() {
        return 0;
    }
    HierArea::new(cfg, 0, &NormalArea::new(cfg)).end
}

/// GIN signals a device communicator needs for `nodes` nodes.
pub fn gin_signals(nodes: NodeShape) -> usize {
    HIER_SIGNAL_KINDS * nodes.nodes()
}

/// The bases the kernels of one rank use (see the module comment): `node`
/// its node's ranks' buffers, `pull` the pull kernel's and `send` the
/// combine send kernel's, one per rank. Entries are addresses as this rank
/// maps them; arithmetic wraps (an entry is only ever used with the offsets
/// it was made for).
struct Tables {
    node: Vec<u64>,
    pull: Vec<u64>,
    send: Vec<u64>,
}

impl Tables {
    /// From every rank's buffer as mapped here (`bases`, 0 where not
    /// mapped), the normal area (its offset and its arrays) and the
    /// hierarchical area.
    fn new(
        cfg: &Config,
        bases: &[u64],
        normal_offset: usize,
        normal: &NormalArea,
        area: &HierArea,
    ) -> Result<Tables> {
        let nodes = cfg.nodes();
        let home = nodes.node_of(cfg.rank);
        let base_of = |rank: usize| -> Result<u64> {
            match bases[rank] {
                0 => Err(Error::unsupported(format!(
                    "rank {rank} is on the node of rank {} but not reachable over NVLink",
                    cfg.rank
                ))),
                b => Ok(b),
            }
        };
        let staged_x = (normal_offset + normal.staged_x) as u64;
        let band = (nodes.ranks_per_node * cfg.max_tokens * cfg.topo.hidden * 2) as u64;
        let (mut pull, mut send) = (Vec::new(), Vec::new());
        for s in 0..cfg.world() {
            let m = nodes.node_of(s);
            let gateway = base_of(nodes.gateway(s, home))?;
            pull.push(if m == home {
                gateway
            } else {
                let slot = (m + nodes.nodes() - home) % nodes.nodes() - 1;
                let block = (area.relay + slot * area.relay_bytes) as u64;
                gateway.wrapping_add(block).wrapping_sub(staged_x)
            });
            let bands = (m as u64).wrapping_sub(home as u64).wrapping_mul(band);
            send.push(gateway.wrapping_add(bands));
        }
        let node = nodes.ranks_of(home).map(base_of).collect::<Result<_>>()?;
        Ok(Tables { node, pull, send })
    }
}

/// The hierarchy's part of a dispatch's routing, in the handle.
pub struct HierHandle {
    /// `[T, N]` whether each of this rank's tokens went to each node.
    in_node: DeviceBuffer,
    /// `[N, T]` u64: which ranks of this node got token t of the rail
    /// source of node m.
    relay_mask: DeviceBuffer,
    /// `[N]` token counts of the rail sources.
    relay_count: DeviceBuffer,
}

pub struct Hierarchy {
    nodes: NodeShape,
    /// Where the normal mode's area starts in every buffer, and its arrays.
    normal_offset: usize,
    normal: NormalArea,
    area: HierArea,
    /// `[R]` the buffers of this node's ranks (the node barrier's table).
    node_table: DeviceBuffer,
    /// `[W]` the pull kernel's and the combine send kernel's bases (see
    /// the module comment).
    pull_table: DeviceBuffer,
    send_table: DeviceBuffer,
    /// The device communicator and window for GIN, or 0.
    dev_comm: u64,
    window: u64,
}

impl Hierarchy {
    /// The mode's area starts at `offset`; the normal mode's, `normal`, at
    /// `normal_offset`.
    pub fn new(
        rt: &Runtime,
        normal_offset: usize,
        normal: NormalArea,
        offset: usize,
    ) -> Result<Hierarchy> {
        let cfg = &rt.cfg;
        let nodes = cfg.nodes();
        let area = HierArea::new(cfg, offset, &normal);
        let bases = rt.memory.host_peer_bases();
        let tables = Tables::new(cfg, bases, normal_offset, &normal, &area)?;
        let upload = |values: &[u64]| DeviceBuffer::from_host(&rt.device, values);
        let nccl = rt.memory.nccl();
        Ok(Hierarchy {
            nodes,
            normal_offset,
            normal,
            area,
            node_table: upload(&tables.node)?,
            pull_table: upload(&tables.pull)?,
            send_table: upload(&tables.send)?,
            dev_comm: nccl.map_or(0, |n| n.dev_comm),
            window: nccl.map_or(0, |n| n.window),
        })
    }

    pub fn new_handle(&self, rt: &Runtime) -> Result<HierHandle> {
        let (n, t) = (self.nodes.nodes(), rt.cfg.max_tokens);
        Ok(HierHandle {
            in_node: DeviceBuffer::new(&rt.device, t * n)?,
            relay_mask: DeviceBuffer::new(&rt.device, n * t * 8)?,
            relay_count: DeviceBuffer::new(&rt.device, n * 4)?,
        })
    }

    /// The parameters every hierarchical kernel shares; the dispatch's
    /// fill in the caller's tokens.
    fn params(&self, rt: &Runtime, handle: &HierHandle, in_rank: u64) -> HierParams {
        let cfg = &rt.cfg;
        let a = &self.area;
        HierParams {
            peer_bases: rt.memory.peer_bases(),
            own_base: rt.memory.own_base(),
            dev_comm: self.dev_comm,
            window: self.window,
            status: rt.status_ptr(),
            abort_flag: rt.abort_ptr(),
            timeout_ns: rt.timeout_ns,
            handle_in_rank: in_rank,
            handle_in_node: handle.in_node.ptr(),
            handle_relay_mask: handle.relay_mask.ptr(),
            handle_relay_count: handle.relay_count.ptr(),
            normal: self.normal.offsets(self.normal_offset),
            hier_signals: a.signals as i64,
            hier_counters: a.counters as i64,
            hier_relay: a.relay as i64,
            relay_bytes: a.relay_bytes as i64,
            hier_headers: a.headers as i64,
            hier_notify: a.notify as i64,
            hier_node_sums: a.node_sums as i64,
            hier_combine_stage: a.combine_stage as i64,
            rank: cfg.rank as i32,
            world: cfg.world() as i32,
            ranks_per_node: self.nodes.ranks_per_node as i32,
            num_experts: cfg.topo.num_experts as i32,
            topk: cfg.topo.topk as i32,
            hidden: cfg.topo.hidden as i32,
            max_tokens: cfg.max_tokens as i32,
            ..HierParams::default()
        }
    }

    /// A barrier of this node's ranks (kernels/barrier.cu over the node).
    ///
    /// # Safety
    /// `stream` is a stream of the context's device (or null).
    unsafe fn node_barrier(&self, rt: &Bound, stream: Stream) -> Result<()> {
        rt.barrier_over(
            self.node_table.ptr(),
            self.nodes.local_index(rt.cfg.rank),
            self.nodes.ranks_per_node,
            stream,
        )
    }

    /// A barrier of all ranks: node barrier, rail barrier, node barrier.
    ///
    /// # Safety
    /// As [`Hierarchy::node_barrier`].
    unsafe fn world_barrier(&self, rt: &Bound, params: &HierParams, stream: Stream) -> Result<()> {
        self.node_barrier(rt, stream)?;
        rt.launch(
            &rt.kernels.hier_rail_barrier,
            1,
            SMALL_THREADS,
            0,
            stream,
            params,
        )?;
        self.node_barrier(rt, stream)
    }

    /// The exchange of a dispatch, after the count kernel: stage, network
    /// leg, forwarding, node barrier, pull, world barrier. `flat` are the
    /// single-node kernels' parameters of the same dispatch.
    ///
    /// # Safety
    /// The caller's arrays in `flat` stay valid until the stream has run
    /// the kernels; `stream` is a stream of the context's device.
    pub unsafe fn dispatch(
        &self,
        rt: &Bound,
        flat: &DispatchParams,
        handle: &HierHandle,
        stream: Stream,
    ) -> Result<()> {
        let cfg = &rt.cfg;
        let params = HierParams {
            x: flat.x,
            x_scales: flat.x_scales,
            topk_idx: flat.topk_idx,
            topk_weights: flat.topk_weights,
            num_tokens: flat.num_tokens,
            row_bytes: flat.row_bytes,
            scale_cols: flat.scale_cols,
            ..self.params(rt, handle, flat.handle_in_rank)
        };
        let pull = DispatchParams {
            peer_bases: self.pull_table.ptr(),
            ..*flat
        };
        let chunks = chunks(flat.num_tokens as usize);
        let columns = cfg.world() + cfg.topo.num_experts;
        let sms = rt.normal_grid();
        let k = &rt.kernels;
        rt.launch(
            &k.hier_stage,
            chunks.max(sms),
            CHUNK_TOKENS as u32,
            (columns * 4) as u32,
            stream,
            &params,
        )?;
        rt.launch(&k.hier_send, sms, MOVE_THREADS as u32, 0, stream, &params)?;
        rt.launch(
            &k.hier_forward,
            sms,
            MOVE_THREADS as u32,
            0,
            stream,
            &params,
        )?;
        self.node_barrier(rt, stream)?;
        rt.launch(&k.dispatch_pull, sms, MOVE_THREADS as u32, 0, stream, &pull)?;
        self.world_barrier(rt, &params, stream)
    }

    /// A combine: the expert side's rows to the gateways, node partials,
    /// network leg, sum over the nodes, world barrier. `flat` are the
    /// single-node kernels' parameters of the same combine.
    ///
    /// # Safety
    /// As [`Hierarchy::dispatch`].
    pub unsafe fn combine(
        &self,
        rt: &Bound,
        flat: &CombineParams,
        handle: &HierHandle,
        stream: Stream,
    ) -> Result<()> {
        let params = self.params(rt, handle, flat.handle_in_rank);
        // Every row goes through the node partials: no token stays home
        // (`flat.home_tokens` is 0 with a hierarchy, see `combine_params`).
        let send = CombineParams {
            peer_bases: self.send_table.ptr(),
            ..*flat
        };
        // The final sum reads the node partials: one per node, nodes
        // ascending, where the handle says the token went.
        let reduce = CombineParams {
            handle_in_rank: handle.in_node.ptr(),
            normal: NormalOffsets {
                off_returned: (self.area.node_sums - self.normal_offset) as i64,
                ..flat.normal
            },
            world: self.nodes.nodes() as i32,
            ..*flat
        };
        let sms = rt.normal_grid();
        let k = &rt.kernels;
        rt.launch(&k.combine_send, sms, MOVE_THREADS as u32, 0, stream, &send)?;
        self.node_barrier(rt, stream)?;
        rt.launch(
            &k.hier_node_reduce,
            sms,
            MOVE_THREADS as u32,
            0,
            stream,
            &params,
        )?;
        rt.launch(&k.hier_wait, 1, SMALL_THREADS, 0, stream, &params)?;
        rt.launch(
            &k.combine_reduce,
            sms,
            MOVE_THREADS as u32,
            0,
            stream,
            &reduce,
        )?;
        self.world_barrier(rt, &params, stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(world: usize, rank: usize, rpn: usize) -> Config {
        super::super::test_config(world, rank, rpn, 0)
    }

    /// The tables send every access of the single-node kernels where the
    /// hierarchical kernels put or expect the data.
    #[test]
    fn tables_point_at_the_gateways_copies() {
        for (world, rpn) in [(2, 1), (4, 2), (4, 1), (6, 3), (6, 2), (8, 4)] {
            for rank in 0..world {
                let cfg = config(world, rank, rpn);
                let nodes = cfg.nodes();
                let normal = NormalArea::new(&cfg);
                let normal_offset = 65536;
                let area = HierArea::new(&cfg, 1 << 30, &normal);
                // Rank r's buffer at r << 40 (all reachable: virtual nodes).
                let bases: Vec<u64> = (0..world as u64).map(|r| (r + 1) << 40).collect();
                let t = Tables::new(&cfg, &bases, normal_offset, &normal, &area).unwrap();
                let home = nodes.node_of(rank);
                assert_eq!(t.pull[rank], bases[rank], "own records");
                assert_eq!(t.send[rank], bases[rank], "own return rows");
                let at = |table: &[u64], s: usize, off: usize| {
                    table[s].wrapping_add((normal_offset + off) as u64)
                };
                for s in 0..world {
                    let m = nodes.node_of(s);
                    let g = bases[nodes.gateway(s, home)];
                    // The pull reads s's rows where s's gateway keeps them.
                    let rows = if m == home {
                        bases[s] + (normal_offset + normal.staged_x) as u64
                    } else {
                        let slot = (m + nodes.nodes() - home) % nodes.nodes() - 1;
                        g + (area.relay + slot * area.relay_bytes) as u64
                    };
                    assert_eq!(at(&t.pull, s, normal.staged_x), rows);
                    // ... and its totals at the same distance in that block.
                    assert_eq!(
                        at(&t.pull, s, normal.totals),
                        rows + (normal.totals - normal.staged_x) as u64
                    );
                    assert!(normal.totals - normal.staged_x < area.relay_bytes);
                    // The send kernel's row (rank, token) of source s lands in
                    // band node(s), row local(rank), of the gateway.
                    let row = (cfg.topo.hidden * 2) as u64;
                    let tok = 7u64;
                    let written = at(&t.send, s, normal.returned)
                        .wrapping_add((rank as u64 * 100 + tok) * row);
                    let band_row = (m * rpn + nodes.local_index(rank)) as u64 * 100 + tok;
                    assert_eq!(
                        written,
                        g + (normal_offset + normal.returned) as u64 + band_row * row
                    );
                }
                assert_eq!(
                    t.node,
                    nodes.ranks_of(home).map(|r| bases[r]).collect::<Vec<_>>()
                );
            }
        }
    }

    #[test]
    fn the_area_holds_every_array_apart() {
        let cfg = config(8, 3, 2);
        let a = HierArea::new(&cfg, 12345, &NormalArea::new(&cfg));
        let n = cfg.nodes().nodes();
        let spans = [
            (a.signals, HIER_SIGNAL_KINDS * n * 8),
            (a.counters, HIER_COUNTER_INTS * 4),
            (a.notify, n * 16),
            (a.headers, n * 100 * HIER_HEADER_BYTES),
            (a.relay, (n - 1) * a.relay_bytes),
            (a.node_sums, n * 100 * 512),
            (a.combine_stage, (n - 1) * 100 * 512),
        ];
        let mut end = 12345;
        for (start, bytes) in spans {
            assert!(start >= end && start.is_multiple_of(256));
            end = start + bytes;
        }
        assert!(a.end >= end);
        assert_eq!(
            buffer_bytes(&cfg),
            HierArea::new(&cfg, 0, &NormalArea::new(&cfg)).end
        );
        assert_eq!(buffer_bytes(&config(4, 0, 4)), 0, "one node adds nothing");
    }
}
