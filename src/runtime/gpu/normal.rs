//! Normal mode on GPUs: layout, dispatch and combine over NVLink.
//!
//! The kernels and the protocol are described in `kernels/normal.cu`. This
//! side carves the mode's area of the symmetric buffer, keeps the routing of
//! a dispatch in the handle (device arrays that the combine reads, so a
//! dispatch/combine pair needs no host synchronisation and can be captured
//! in a CUDA graph), and enqueues the launches.

use super::hierarchical::{HierHandle, Hierarchy};
use super::{ptr, Bound, Runtime};
use crate::abi::{
    CombineParams, DispatchParams, LayoutParams, NormalOffsets, BARRIER_CLOSING, BARRIER_MIDDLE,
    CHUNK_SYNC_HEADER, CHUNK_TOKENS, COUNT_SHARED_ROWS, EXCHANGE_COMBINE, EXCHANGE_DISPATCH,
    LAYOUT_THREADS, MOVE_THREADS,
};
use crate::error::{Error, Result};
use crate::reference::{normal::worst_case_rows, Dtype};
use crate::runtime::backend::{HandleState, Stream};
use crate::runtime::config::Config;
use crate::runtime::cuda::{DeviceBuffer, Event, MappedHost};
use crate::runtime::ops::{CombineOp, DispatchOp, LayoutOp, Received};
use crate::runtime::sequence::Call;
use std::mem::ManuallyDrop;
use std::ops::Deref;
use std::sync::{Arc, Mutex, PoisonError};

/// Blocks of the count kernel: one per chunk of `CHUNK_TOKENS` tokens, at
/// least one.
pub(super) fn chunks(num_tokens: usize) -> u32 {
    num_tokens.div_ceil(CHUNK_TOKENS).max(1) as u32
}

/// Byte offsets of the mode's arrays inside its area of every rank's
/// buffer (the same on every rank). `T` = max tokens per rank, `W` = world,
/// `E` = experts. The hierarchical mode keeps copies of the span from
/// `staged_x` to `totals` for other nodes (see hierarchical.rs).
#[derive(Debug, Clone, Copy)]
pub(super) struct Area {
    /// `[T, row]` this rank's tokens, for the peers to pull.
    pub(super) staged_x: usize,
    /// `[T, hidden / 128]` their FP8 scales.
    pub(super) staged_scales: usize,
    /// `[T, topk]` position of each (token, slot) among its chunk's, then
    /// among all, pairs of its expert.
    pub(super) slot_rank: usize,
    /// `[T, W]` position of each token among its chunk's tokens for each
    /// rank, or -1.
    pub(super) rank_pos: usize,
    /// `[chunks, W + E]` the count kernel's per-chunk counts.
    pub(super) chunk_counts: usize,
    /// `[W + E]` tokens per rank, then pairs per expert (read by peers).
    pub(super) totals: usize,
    /// `[CHUNK_SYNC_HEADER + chunks]` the staging count kernel's tickets
    /// and per-chunk ready flags.
    pub(super) chunk_sync: usize,
    /// Records the sources push here, one per token they send, `[W, T]`
    /// rows: the token index, and per slot the local expert (or -1), its
    /// position among that source's pairs of the expert, and the weight.
    pub(super) in_token: usize,
    pub(super) in_local: usize,
    pub(super) in_rank: usize,
    pub(super) in_weight: usize,
    /// `[W, T, hidden]` BF16 rows the ranks return in a combine.
    pub(super) returned: usize,
    /// Bytes of the whole area.
    pub(super) bytes: usize,
}

impl Area {
    pub(super) fn new(cfg: &Config) -> Area {
        let t = &cfg.topo;
        let (tokens, world) = (cfg.max_tokens, t.world);
        let chunks = tokens.div_ceil(CHUNK_TOKENS);
        let columns = world + t.num_experts;
        let mut next = 0;
        // 256-byte aligned pieces: rows are read as 16-byte vectors.
        let mut take = |bytes: usize| {
            let at = next;
            next = (at + bytes).div_ceil(256) * 256;
            at
        };
        Area {
            staged_x: take(tokens * cfg.token_dtype.row_bytes(t.hidden)),
            staged_scales: take(tokens * Dtype::Fp8E4m3.scales_per_row(t.hidden) * 4),
            slot_rank: take(tokens * t.topk * 4),
            rank_pos: take(tokens * world * 4),
            chunk_counts: take(chunks * columns * 4),
            totals: take(columns * 4),
            chunk_sync: take((CHUNK_SYNC_HEADER + chunks) * 4),
            in_token: take(world * tokens * 4),
            in_local: take(world * tokens * t.topk * 4),
            in_rank: take(world * tokens * t.topk * 4),
            in_weight: take(world * tokens * t.topk * 4),
            returned: take(world * tokens * t.hidden * 2),
            bytes: next,
        }
    }
}

impl Area {
    /// The layout as the kernels take it, for an area that starts `area`
    /// bytes into every rank's buffer.
    pub(super) fn offsets(&self, area: usize) -> NormalOffsets {
        NormalOffsets {
            area: area as i64,
            off_staged_x: self.staged_x as i64,
            off_staged_scales: self.staged_scales as i64,
            off_slot_rank: self.slot_rank as i64,
            off_rank_pos: self.rank_pos as i64,
            off_chunk_counts: self.chunk_counts as i64,
            off_totals: self.totals as i64,
            off_chunk_sync: self.chunk_sync as i64,
            off_in_token: self.in_token as i64,
            off_in_local: self.in_local as i64,
            off_in_rank: self.in_rank as i64,
            off_in_weight: self.in_weight as i64,
            off_returned: self.returned as i64,
        }
    }
}

/// Bytes of symmetric buffer the normal mode needs for `cfg`.
pub fn buffer_bytes(cfg: &Config) -> usize {
    Area::new(cfg).bytes
}

/// What a dispatch leaves in its handle: device arrays the combine reads,
/// sized for the worst case so one handle serves any dispatch.
pub(super) struct HandleArrays {
    /// `[W * T, 2]` (source rank, token) of each received row.
    row_src: DeviceBuffer,
    /// `[W * T, topk]` expert-major row of each (row, slot), or -1.
    row_expert_pos: DeviceBuffer,
    /// `[W * T, topk]` routing weight of each (row, slot), or 0.
    row_weights: DeviceBuffer,
    /// `[1]` received rows.
    num_rows: DeviceBuffer,
    /// `[T, W]` whether each of this rank's tokens went to each rank.
    in_rank: DeviceBuffer,
    /// `[2 L + 1]` the expert-major segment starts (`L + 1`), then the real
    /// rows of each local expert: what a fused combine multiplies.
    pub(super) expert_layout: DeviceBuffer,
    /// The hierarchy's part, with several nodes.
    hier: Option<HierHandle>,
}

impl HandleArrays {
    fn new(rt: &Runtime, hier: Option<&Hierarchy>) -> Result<HandleArrays> {
        let cfg = &rt.cfg;
        let (rows, _) = worst_case_rows(cfg.topo, cfg.max_tokens, 1);
        let slots = rows * cfg.topo.topk;
        Ok(HandleArrays {
            row_src: DeviceBuffer::new(&rt.device, rows * 2 * 4)?,
            row_expert_pos: DeviceBuffer::new(&rt.device, slots * 4)?,
            row_weights: DeviceBuffer::new(&rt.device, slots * 4)?,
            num_rows: DeviceBuffer::new(&rt.device, 4)?,
            in_rank: DeviceBuffer::new(&rt.device, cfg.max_tokens * cfg.world())?,
            expert_layout: DeviceBuffer::new(&rt.device, (2 * cfg.local_experts() + 1) * 4)?,
            hier: hier.map(|h| h.new_handle(rt)).transpose()?,
        })
    }
}

/// The device arrays of handles not in use, kept for the next handles.
///
/// Freeing device memory (`cuMemFree`) waits for the whole device, and an
/// allocation may: where ranks share a GPU, a handle freed or made while a
/// peer's kernel waits for this rank would hold this rank's next launch
/// until that wait timed out. So the context makes [`SPARE_HANDLES`] sets
/// of arrays when it is created, a handle takes a set and gives it back when
/// destroyed (after its work, API rule), and the sets are freed with the
/// context, when no call of it runs.
#[derive(Clone, Default)]
struct SpareArrays(Arc<Mutex<Vec<HandleArrays>>>);

/// Handles a context can hold at once without allocating device memory: a
/// dispatch/combine pair in flight while the next batch's dispatch starts.
const SPARE_HANDLES: usize = 2;

impl SpareArrays {
    fn take(&self) -> Option<HandleArrays> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).pop()
    }

    fn give_back(&self, arrays: HandleArrays) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(arrays);
    }
}

/// A routing handle on the GPU: a set of arrays, lent by the context's
/// spares, and the dispatch they hold.
pub(super) struct GpuHandle {
    arrays: ManuallyDrop<HandleArrays>,
    spares: SpareArrays,
    /// The last dispatch recorded here, if it succeeded.
    pub(super) dispatched: Option<Dispatched>,
}

impl Deref for GpuHandle {
    type Target = HandleArrays;

    fn deref(&self) -> &HandleArrays {
        &self.arrays
    }
}

impl Drop for GpuHandle {
    fn drop(&mut self) {
        // SAFETY: `arrays` is not used again; this is its only take.
        let arrays = unsafe { ManuallyDrop::take(&mut self.arrays) };
        self.spares.give_back(arrays);
    }
}

#[derive(Debug, Clone)]
pub(super) struct Dispatched {
    pub(super) num_tokens: usize,
    /// The counts the host learned (`None` after a no-sync dispatch).
    host_counts: Option<Vec<i32>>,
    /// The expert-major rows the caller gave room for, when the dispatch
    /// wrote them.
    pub(super) expert_capacity: Option<usize>,
}

impl Dispatched {
    /// A dispatch whose counts stayed on the device.
    pub(super) fn on_device(num_tokens: usize, expert_capacity: Option<usize>) -> Dispatched {
        Dispatched {
            num_tokens,
            host_counts: None,
            expert_capacity,
        }
    }
}

/// The mode's two exchanges, for the barrier that closes them.
///
/// Closing barriers: after an exchange, peers may still be reading what it
/// left in the areas: after a dispatch, this rank's staged rows and totals
/// and the records it pushed into their areas (their pulls); after a
/// combine, the rows it sent into their return rows (their reduces). The
/// next exchange of the same kind overwrites exactly those, so it must not
/// start before every rank has passed a barrier after them. An exchange of
/// the other kind writes none of them, and every exchange has a barrier of
/// all ranks in its middle, which every rank passes only after finishing
/// its earlier work on its stream (calls run on the GPU in the order they
/// are made, API rule). So the closing barrier of an exchange is left for
/// later and runs only before the next exchange of the mode when that is of
/// the same kind: a dispatch/combine pair, as a model's layers make them,
/// runs two barriers instead of four.
///
/// Which exchange is open is known on the device (the open-exchange word,
/// kernels/barrier.cu, "Roles"): CUDA-graph replays run exchanges the host
/// does not see. The host keeps a copy of it to skip the closing barrier's
/// launch, and stops trusting the copy once a call of the context has been
/// captured: from then on it launches every closing barrier, and the
/// device skips those with nothing open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub(super) enum Exchange {
    /// `ep_dispatch`, or the dispatch of a fused call.
    Dispatch = EXCHANGE_DISPATCH,
    /// `ep_combine`, or the combine of a fused call.
    Combine = EXCHANGE_COMBINE,
}

/// The host's copy of the open exchange (see [`Exchange`]).
#[derive(Debug, Default)]
struct Unclosed {
    /// The last exchange enqueued, unless a closing barrier followed it.
    open: Option<Exchange>,
    /// Whether a call was captured into a CUDA graph: `open` may be stale.
    graphs: bool,
}

impl Unclosed {
    /// Before an exchange of kind `next` (`captured` into a graph): whether
    /// to launch the closing barrier of kind `next`. It runs exactly when
    /// the open exchange is of that kind; either way nothing is open after
    /// `next`'s middle barrier.
    fn open(&mut self, next: Exchange, captured: bool) -> bool {
        self.graphs |= captured;
        self.open.take() == Some(next) || self.graphs
    }

    /// After an exchange of kind `done` was enqueued, with its middle
    /// barrier and without its closing one.
    fn leave(&mut self, done: Exchange) {
        self.open = Some(done);
    }
}

pub struct NormalMode {
    /// Where the mode's area starts in every rank's buffer.
    offset: usize,
    area: Area,
    /// `[1 + local experts + 1]`: rows received, rows per local expert,
    /// then the number of the host-synchronised dispatch they belong to,
    /// written by the pull kernel (see [`NormalMode::wait_for_host_counts`]).
    host_counts: MappedHost<i32>,
    /// The number of the last host-synchronised dispatch (never 0, the
    /// buffer's first value).
    host_counts_seq: i32,
    /// Recorded after each dispatch that returned at its counts, whose row
    /// copies may still run then: the context waits for it before its
    /// buffers go ([`NormalMode::wait_for_rows`]), so that a caller who
    /// destroys it right after such a call does not free memory under a
    /// running kernel.
    rows_in_flight: Event,
    /// With several nodes: the hierarchical exchange, which replaces the
    /// single-node one.
    hier: Option<Hierarchy>,
    /// Arrays for the handles (made here, not per handle).
    spares: SpareArrays,
    /// The last single-node exchange, when its closing barrier has not run.
    unclosed: Unclosed,
}

impl NormalMode {
    /// Whether the dispatch and combine take the hierarchical path (several
    /// nodes).
    pub fn hierarchical(&self) -> bool {
        self.hier.is_some()
    }

    /// The mode's area starts at `offset` of every rank's symmetric buffer;
    /// with several nodes the hierarchical mode's at `hier_offset`.
    pub fn new(rt: &Runtime, offset: usize, hier_offset: usize) -> Result<NormalMode> {
        let area = Area::new(&rt.cfg);
        let hier = if rt.cfg.nodes().is_hierarchical() {
            Some(Hierarchy::new(rt, offset, area, hier_offset)?)
        } else {
            None
        };
        let spares = SpareArrays::default();
        for _ in 0..SPARE_HANDLES {
            spares.give_back(HandleArrays::new(rt, hier.as_ref())?);
        }
        Ok(NormalMode {
            offset,
            area,
            host_counts: MappedHost::new(&rt.device, 1 + rt.cfg.local_experts() + 1)?,
            host_counts_seq: 0,
            rows_in_flight: Event::new(&rt.device)?,
            hier,
            spares,
            unclosed: Unclosed::default(),
        })
    }

    /// Enqueues, before a single-node exchange of kind `next`, the closing
    /// barrier of the last exchange if `next` may need it (see
    /// [`Exchange`]). The exchange then follows, with
    /// [`Self::middle_barrier`] in it, and is then recorded as left open
    /// (`Unclosed::leave`): [`Self::enqueue_routing`] does both for a
    /// dispatch, [`Self::enqueue_reduce`] leaves a combine open.
    ///
    /// # Safety
    /// `stream` must be a stream of this context's device (or null).
    pub(super) unsafe fn open(&mut self, rt: &Bound, next: Exchange, stream: Stream) -> Result<()> {
        // SAFETY: passed on from the caller.
        unsafe {
            // Once a call was captured the answer no longer matters.
            let captured = self.unclosed.graphs || rt.capturing(stream)?;
            if self.unclosed.open(next, captured) {
                rt.exchange_barrier(BARRIER_CLOSING, next as i32, stream)?;
            }
        }
        Ok(())
    }

    /// The barrier in the middle of an exchange of kind `exchange`: every
    /// rank's writes before it are visible to every rank after it, and the
    /// exchange stays open on the device.
    ///
    /// # Safety
    /// As [`Self::open`].
    unsafe fn middle_barrier(rt: &Bound, exchange: Exchange, stream: Stream) -> Result<()> {
        // SAFETY: passed on from the caller.
        unsafe { rt.exchange_barrier(BARRIER_MIDDLE, exchange as i32, stream) }
    }

    pub fn layout(&mut self, rt: &Bound, op: &LayoutOp, stream: Stream) -> Result<()> {
        let topo = rt.cfg.topo;
        let params = LayoutParams {
            topk_idx: ptr(op.topk_idx),
            tokens_per_rank: ptr(op.tokens_per_rank),
            tokens_per_expert: ptr(op.tokens_per_expert),
            is_token_in_rank: ptr(op.is_token_in_rank),
            status: rt.status_ptr(),
            num_tokens: op.num_tokens as i32,
            topk: topo.topk as i32,
            num_experts: topo.num_experts as i32,
            world: topo.world as i32,
        };
        // SAFETY: the caller's arrays stay valid until the stream reaches
        // the kernel (API rule).
        unsafe {
            rt.launch(
                &rt.kernels.layout,
                topo.world as u32,
                LAYOUT_THREADS as u32,
                0,
                stream,
                &params,
            )
        }
    }

    pub fn new_handle_state(&mut self, rt: &Runtime) -> Result<HandleState> {
        let arrays = match self.spares.take() {
            Some(arrays) => arrays,
            None => HandleArrays::new(rt, self.hier.as_ref())?,
        };
        Ok(Box::new(GpuHandle {
            arrays: ManuallyDrop::new(arrays),
            spares: self.spares.clone(),
            dispatched: None,
        }))
    }

    pub fn dispatch(
        &mut self,
        rt: &Bound,
        call: Call,
        op: &DispatchOp,
        handle: &mut HandleState,
        stream: Stream,
    ) -> Result<Option<Received>> {
        let handle = handle
            .downcast_mut::<GpuHandle>()
            .ok_or_else(|| Error::internal("not a GPU handle"))?;
        // A reused layout needs no host synchronisation: the host counts
        // are those of the handle's earlier dispatch of the same routing
        // (the context checked that the handle holds one, of as many
        // tokens).
        let cached = if op.reuse_layout {
            handle
                .dispatched
                .as_ref()
                .and_then(|d| d.host_counts.clone())
        } else {
            None
        };
        let host_sync = !op.no_host_sync && cached.is_none();
        // SAFETY: the caller's stream of this device (API rule).
        if host_sync && unsafe { rt.capturing(stream)? } {
            return Err(Error::invalid(
                "a dispatch that waits for its counts cannot be captured in a CUDA graph \
                 (EP_DISPATCH_NO_HOST_SYNC can)",
            ));
        }
        handle.dispatched = None;
        let hierarchical = self.hier.is_some() && handle.hier.is_some();
        let mut params = self.dispatch_params(rt, call, op, handle, host_sync);
        // A single-node dispatch's counts are final once its pull has laid
        // out the rows: nothing after that waits for anyone, so nothing can
        // fail. The hierarchical pull is followed by the world barrier: its
        // host waits for the stream, so that the call reports its errors.
        let early_counts = host_sync && !hierarchical;
        if early_counts {
            self.host_counts_seq = self.host_counts_seq.checked_add(1).unwrap_or(1);
            params.host_counts_seq = self.host_counts_seq;
        }
        // SAFETY: the parameters describe the caller's arrays, which stay
        // valid until the stream has run the kernels (API rule), and the
        // handle's and the context's, valid until they are destroyed.
        unsafe {
            match (&self.hier, &handle.hier) {
                (Some(hier), Some(hier_handle)) => {
                    self.enqueue_count(rt, &params, chunks(op.num_tokens), stream)?;
                    hier.dispatch(rt, &params, hier_handle, stream)?;
                }
                _ => {
                    let grid = rt.normal_grid();
                    self.enqueue_routing(rt, &params, op.num_tokens, grid, stream)?
                }
            }
            if early_counts {
                // The caller's stream of this device (API rule).
                self.rows_in_flight.record(stream as _)?;
            }
        }
        let host_counts = if host_sync {
            let counts = if early_counts {
                self.wait_for_host_counts(rt, stream)?
            } else {
                rt.synchronize(stream)?;
                self.read_host_counts()
            };
            check_capacity(op, &counts)?;
            Some(counts)
        } else {
            cached
        };
        if let Some(counts) = &host_counts {
            // SAFETY: the context checked the host pointers' presence; the
            // API gives `host_expert_counts` room for the local experts.
            unsafe {
                if !op.host_recv_num_rows.is_null() {
                    *op.host_recv_num_rows = counts[0];
                }
                if !op.host_expert_counts.is_null() {
                    std::ptr::copy_nonoverlapping(
                        counts[1..].as_ptr(),
                        op.host_expert_counts,
                        counts.len() - 1,
                    );
                }
            }
        }
        // The context carries a reused layout's rows over itself.
        let received = host_counts
            .as_ref()
            .filter(|_| host_sync)
            .map(|counts| Received {
                source_rows: counts[0] as usize,
                expert_rows: padded_rows(&counts[1..], op.alignment()),
            });
        handle.dispatched = Some(Dispatched {
            num_tokens: op.num_tokens,
            host_counts,
            expert_capacity: op.expert.map(|e| e.capacity),
        });
        Ok(received)
    }

    /// The counts of the host-synchronised dispatch just enqueued on
    /// `stream` (rows received, then rows per local expert), as soon as the
    /// pull has laid out its rows: the host waits for the number the pull
    /// writes after them, not for the stream, whose pull goes on moving the
    /// rows (what `ep_dispatch` promises: the counts before it returns; its
    /// outputs in stream order). Errors a kernel recorded by then are
    /// reported here, as a synchronisation would.
    fn wait_for_host_counts(&self, rt: &Bound, stream: Stream) -> Result<Vec<i32>> {
        let published = self.host_counts.len() - 1;
        let seq = self.host_counts_seq;
        rt.wait_until_published(stream, "the dispatch's counts", || {
            self.host_counts.load_acquire(published) == seq
        })?;
        Ok(self.read_host_counts())
    }

    /// Waits until the row copies of the last dispatch that returned at its
    /// counts have run (at once if none did): before the context's buffers
    /// go, since such a call returns while its pull still reads and writes
    /// them.
    pub(super) fn wait_for_rows(&self) -> Result<()> {
        self.rows_in_flight.synchronize()
    }

    /// The counts in `host_counts` (rows received, then rows per local
    /// expert), without the number after them.
    fn read_host_counts(&self) -> Vec<i32> {
        (0..self.host_counts.len() - 1)
            .map(|i| self.host_counts.read(i))
            .collect()
    }

    /// The dispatch kernels' parameters for `op` (call `call`), recording
    /// into `handle`; `host_sync` asks the pull for the host-mapped counts.
    pub(super) fn dispatch_params(
        &self,
        rt: &Runtime,
        call: Call,
        op: &DispatchOp,
        handle: &GpuHandle,
        host_sync: bool,
    ) -> DispatchParams {
        let cfg = &rt.cfg;
        let topo = cfg.topo;
        let a = &self.area;
        let recv = op.recv;
        let expert = op.expert;
        DispatchParams {
            x: ptr(op.x),
            x_scales: ptr(op.x_scales),
            topk_idx: ptr(op.topk_idx),
            topk_weights: ptr(op.topk_weights),
            peer_bases: rt.memory.peer_bases(),
            recv_x: recv.map_or(0, |r| ptr(r.x)),
            recv_scales: recv.map_or(0, |r| ptr(r.scales)),
            recv_topk_idx: recv.map_or(0, |r| ptr(r.topk_idx)),
            recv_topk_weights: recv.map_or(0, |r| ptr(r.topk_weights)),
            recv_src_info: recv.map_or(0, |r| ptr(r.src_info)),
            recv_num_rows: recv.map_or(0, |r| ptr(r.num_rows)),
            expert_x: expert.map_or(0, |e| ptr(e.x)),
            expert_scales: expert.map_or(0, |e| ptr(e.scales)),
            expert_weights: expert.map_or(0, |e| ptr(e.weights)),
            expert_src_row: expert.map_or(0, |e| ptr(e.src_row)),
            expert_offsets: expert.map_or(0, |e| ptr(e.offsets)),
            expert_counts: expert.map_or(0, |e| ptr(e.counts)),
            handle_row_src: handle.row_src.ptr(),
            handle_row_expert_pos: handle.row_expert_pos.ptr(),
            handle_row_weights: handle.row_weights.ptr(),
            handle_num_rows: handle.num_rows.ptr(),
            handle_in_rank: handle.in_rank.ptr(),
            handle_expert_layout: handle.expert_layout.ptr(),
            host_counts: if host_sync {
                self.host_counts.device_ptr()
            } else {
                0
            },
            status: rt.status_ptr(),
            abort_flag: rt.abort_ptr(),
            timeout_ns: rt.timeout_ns,
            normal: a.offsets(self.offset),
            recv_capacity: recv.map_or(0, |r| r.capacity as i64),
            expert_capacity: expert.map_or(0, |e| e.capacity as i64),
            num_tokens: op.num_tokens as i32,
            rank: cfg.rank as i32,
            world: topo.world as i32,
            num_experts: topo.num_experts as i32,
            topk: topo.topk as i32,
            row_bytes: op.dtype.row_bytes(topo.hidden) as i32,
            scale_cols: op.dtype.scales_per_row(topo.hidden) as i32,
            max_tokens: cfg.max_tokens as i32,
            alignment: expert.map_or(1, |e| e.alignment as i32),
            collective: call.op.code() as i32,
            skip_expert_rows: 0,
            keep_padding: expert.map_or(0, |e| e.keep_padding as i32),
            stage_in_count: 0,
            host_counts_seq: 0,
        }
    }

    /// Enqueues the dispatch's count kernel, which starts the collective
    /// call, on `blocks` blocks: one per chunk, or with
    /// `params.stage_in_count` at least one per chunk.
    ///
    /// # Safety
    /// `params` must come from [`Self::dispatch_params`], with every array
    /// valid until the stream has run the kernels.
    unsafe fn enqueue_count(
        &self,
        rt: &Bound,
        params: &DispatchParams,
        blocks: u32,
        stream: Stream,
    ) -> Result<()> {
        let columns = rt.cfg.topo.world + rt.cfg.topo.num_experts;
        // SAFETY: the caller vouches for the arrays.
        unsafe {
            rt.launch(
                &rt.kernels.dispatch_count,
                blocks,
                CHUNK_TOKENS as u32,
                (COUNT_SHARED_ROWS * columns * 4) as u32,
                stream,
                params,
            )
        }
    }

    /// Enqueues the single-node dispatch up to its rows: the closing barrier
    /// of the last dispatch if it needs one, count and stage in one kernel
    /// (`stage_in_count`, on max(chunks, SM budget) blocks), barrier, pull
    /// on `pull_grid` blocks (which moves the expert-major rows too unless
    /// `params.skip_expert_rows`, and clears the count's chunk sync words);
    /// the dispatch is then left open (see [`Exchange`]).
    ///
    /// # Safety
    /// As [`Self::enqueue_count`].
    pub(super) unsafe fn enqueue_routing(
        &mut self,
        rt: &Bound,
        params: &DispatchParams,
        num_tokens: usize,
        pull_grid: u32,
        stream: Stream,
    ) -> Result<()> {
        let sms = rt.normal_grid();
        let k = &rt.kernels;
        let staging = DispatchParams {
            stage_in_count: 1,
            ..*params
        };
        // SAFETY: the caller vouches for the arrays.
        unsafe {
            self.open(rt, Exchange::Dispatch, stream)?;
            self.enqueue_count(rt, &staging, chunks(num_tokens).max(sms), stream)?;
            Self::middle_barrier(rt, Exchange::Dispatch, stream)?;
            rt.launch(
                &k.dispatch_pull,
                pull_grid,
                MOVE_THREADS as u32,
                0,
                stream,
                &staging,
            )?;
        }
        self.unclosed.leave(Exchange::Dispatch);
        Ok(())
    }

    pub fn combine(
        &mut self,
        rt: &Bound,
        call: Call,
        op: &CombineOp,
        handle: &HandleState,
        stream: Stream,
    ) -> Result<()> {
        let (handle, dispatched) = combined(handle)?;
        let params = self.combine_params(rt, call, op, handle, dispatched);
        // SAFETY: buffers stay valid as for the dispatch.
        unsafe {
            if let (Some(hier), Some(hier_handle)) = (&self.hier, &handle.hier) {
                return hier.combine(rt, &params, hier_handle, stream);
            }
            self.open(rt, Exchange::Combine, stream)?;
            rt.launch(
                &rt.kernels.combine_send,
                rt.normal_grid(),
                MOVE_THREADS as u32,
                0,
                stream,
                &params,
            )?;
            self.enqueue_reduce(rt, &params, rt.normal_grid(), stream)
        }
    }

    /// The combine kernels' parameters for `op` (call `call`) over the
    /// layout in `handle`.
    pub(super) fn combine_params(
        &self,
        rt: &Runtime,
        call: Call,
        op: &CombineOp,
        handle: &GpuHandle,
        dispatched: &Dispatched,
    ) -> CombineParams {
        let cfg = &rt.cfg;
        CombineParams {
            x: ptr(op.x),
            out: ptr(op.out),
            peer_bases: rt.memory.peer_bases(),
            handle_row_src: handle.row_src.ptr(),
            handle_row_expert_pos: handle.row_expert_pos.ptr(),
            handle_row_weights: handle.row_weights.ptr(),
            handle_num_rows: handle.num_rows.ptr(),
            handle_in_rank: handle.in_rank.ptr(),
            status: rt.status_ptr(),
            normal: self.area.offsets(self.offset),
            num_tokens: dispatched.num_tokens as i32,
            expert_major: op.expert_major as i32,
            rank: cfg.rank as i32,
            world: cfg.world() as i32,
            topk: cfg.topo.topk as i32,
            hidden: cfg.topo.hidden as i32,
            max_tokens: cfg.max_tokens as i32,
            collective: call.op.code() as i32,
            // The hierarchical reduce sums node partials, which its own
            // kernels write (src/runtime/gpu/hierarchical.rs).
            home_tokens: self.hier.is_none() as i32,
        }
    }

    /// Enqueues the combine after its send: barrier, reduce on `grid`
    /// blocks; the closing barrier is left for later (see [`Exchange`]).
    ///
    /// # Safety
    /// `params` must come from [`Self::combine_params`], with every array
    /// valid until the stream has run the kernels.
    pub(super) unsafe fn enqueue_reduce(
        &mut self,
        rt: &Bound,
        params: &CombineParams,
        grid: u32,
        stream: Stream,
    ) -> Result<()> {
        // SAFETY: the caller vouches for the arrays.
        unsafe {
            Self::middle_barrier(rt, Exchange::Combine, stream)?;
            rt.launch(
                &rt.kernels.combine_reduce,
                grid,
                MOVE_THREADS as u32,
                0,
                stream,
                params,
            )?;
        }
        self.unclosed.leave(Exchange::Combine);
        Ok(())
    }
}

/// The GPU handle a combine reads and the dispatch it holds.
pub(super) fn combined(handle: &HandleState) -> Result<(&GpuHandle, &Dispatched)> {
    let handle = handle
        .downcast_ref::<GpuHandle>()
        .ok_or_else(|| Error::internal("not a GPU handle"))?;
    let dispatched = handle
        .dispatched
        .as_ref()
        .ok_or_else(|| Error::internal("the handle holds no successful dispatch"))?;
    Ok((handle, dispatched))
}

/// After a host-synchronised dispatch: an error when the rows that arrived
/// did not fit the caller's capacities (the kernels then wrote no rows).
fn check_capacity(op: &DispatchOp, counts: &[i32]) -> Result<()> {
    if let Some(recv) = &op.recv {
        recv.check_rows(counts[0] as usize)?;
    }
    if let Some(expert) = &op.expert {
        expert.check_rows(padded_rows(&counts[1..], expert.alignment))?;
    }
    Ok(())
}

/// Expert-major rows of experts with `counts` rows, each segment padded to
/// `alignment`.
fn padded_rows(counts: &[i32], alignment: usize) -> usize {
    counts
        .iter()
        .map(|&c| (c as usize).div_ceil(alignment) * alignment)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::{Exchange, Unclosed};
    use Exchange::{Combine, Dispatch};

    /// Which calls of `calls` enqueue the closing barrier of the one before.
    fn closing_barriers(calls: &[Exchange]) -> Vec<bool> {
        let mut unclosed = Unclosed::default();
        calls
            .iter()
            .map(|&call| {
                let barrier = unclosed.open(call, false);
                unclosed.leave(call);
                barrier
            })
            .collect()
    }

    #[test]
    fn only_an_exchange_of_the_same_kind_closes_the_last_one() {
        // A model's layers: dispatch/combine pairs, no closing barriers.
        assert_eq!(
            closing_barriers(&[Dispatch, Combine, Dispatch, Combine]),
            [false; 4]
        );
        // Two dispatches (or combines) in a row: the second one first
        // closes the first; a third closes the second.
        assert_eq!(
            closing_barriers(&[Dispatch, Dispatch, Dispatch, Combine, Combine, Dispatch]),
            [false, true, true, false, true, false]
        );
    }

    #[test]
    fn after_a_capture_every_closing_barrier_is_launched() {
        let mut unclosed = Unclosed::default();
        assert!(!unclosed.open(Dispatch, false));
        unclosed.leave(Dispatch);
        // Captured: launched, though a combine follows a dispatch (a
        // replay may follow a combine).
        assert!(unclosed.open(Combine, true));
        unclosed.leave(Combine);
        // Not captured, but a replay may have run since: still launched.
        assert!(unclosed.open(Dispatch, false));
    }
}
