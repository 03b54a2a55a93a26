//! The host backend: the whole API on host memory, computed by the reference
//! code. Ranks are threads or processes of one host.
//!
//! Each rank owns one shared region (a memfd that every rank maps). An
//! operation runs in two steps separated by bootstrap barriers:
//! 1. publish: each rank copies its inputs into its own region, then barrier;
//! 2. gather: each rank reads every rank's published inputs, computes its own
//!    outputs with the reference code, then barrier (so no rank overwrites its
//!    region while another still reads it).
//!
//! With several nodes (`ranks_per_node`) the results are the GPU's
//! hierarchical ones: the normal combine sums inside each node first
//! (`reference::hierarchical::combine`); dispatch and the low-latency mode
//! give the same results on any node shape.
//!
//! The low-latency send/receive split maps onto these steps: `EP_LL_SEND_ONLY`
//! publishes, `EP_LL_RECV_ONLY` gathers. Errors found after the first barrier
//! are returned only after the second, so no rank is left waiting.

mod shm;

use super::backend::{Backend, HandleState, Monitor, Stream};
use super::bootstrap::Bootstrap;
use super::config::{agree_on_config, Config};
use super::ops::{CombineOp, DispatchOp, LayoutOp, LlCombineOp, LlDispatchOp};
use crate::error::{Error, ErrorKind, Result};
use crate::reference::hierarchical;
use crate::reference::layout::{dispatch_layout, validate_experts, InvalidExpert};
use crate::reference::low_latency::{ll_combine, ll_dispatch, LlExpertOutputs, LlRankTokens};
use crate::reference::normal::{
    combine, dispatch, expert_partials, Dispatched, RankTokens, Returned,
};
use crate::reference::{Dtype, Topology};
use half::bf16;
use shm::Mapping;
use std::borrow::Cow;
use std::os::fd::AsFd;
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::Arc;

pub fn create(
    cfg: &mut Config,
    unique_id: &[u8; 128],
) -> Result<(Box<dyn Backend>, Arc<dyn Monitor>)> {
    let aborted = Arc::new(AtomicBool::new(false));
    let boot = Bootstrap::connect(
        unique_id,
        cfg.rank,
        cfg.world(),
        cfg.timeout,
        aborted.clone(),
    )?;
    cfg.resolve_nodes(boot.local_ranks())?;
    agree_on_config(&boot, cfg)?;
    if boot.local_ranks().len() != cfg.world() {
        return Err(Error::unsupported(format!(
            "the host backend needs every rank on one host; {} of {} are on this one",
            boot.local_ranks().len(),
            cfg.world()
        )));
    }
    let areas = Areas::new(cfg);
    let fd = Mapping::create_memfd(&format!("ep-host-rank{}", cfg.rank), areas.total)?;
    let regions = boot
        .all_gather_fds(fd.as_fd())?
        .iter()
        .map(|peer| match peer {
            Some(peer_fd) => Mapping::map(peer_fd, areas.total),
            None => Err(Error::internal("a rank on this host sent no shared buffer")),
        })
        .collect::<Result<Vec<_>>>()?;
    let backend = HostBackend {
        cfg: *cfg,
        boot,
        regions,
        areas,
        pending: None,
        ll_recv_weights: None,
    };
    Ok((Box::new(backend), Arc::new(HostMonitor { aborted })))
}

struct HostMonitor {
    aborted: Arc<AtomicBool>,
}

impl Monitor for HostMonitor {
    fn async_error(&self) -> Result<()> {
        if self.aborted.load(Ordering::Acquire) {
            return Err(Error::new(ErrorKind::Aborted, "the context was aborted"));
        }
        Ok(())
    }

    fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
    }
}

/// Scalars each rank publishes at the start of its region.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Header {
    dispatch_tokens: u64,
    dispatch_dtype: u64,
    combine_rows: u64,
    ll_tokens: u64,
    ll_has_weights: u64,
    ll_combine_has_weights: u64,
}

/// Byte offsets of the published arrays inside every rank's region. Normal
/// dispatch and combine share space: they are never published together.
struct Areas {
    dispatch_x: usize,
    dispatch_scales: usize,
    dispatch_topk: usize,
    dispatch_weights: usize,
    combine_rows: usize,
    combine_src_info: usize,
    ll_x: usize,
    ll_topk: usize,
    ll_weights: usize,
    ll_combine_y: usize,
    ll_combine_src_info: usize,
    ll_combine_range: usize,
    ll_combine_weights: usize,
    ll_combine_y_bytes: usize,
    total: usize,
}

/// Hands out 64-byte-aligned offsets.
struct Carver(usize);

impl Carver {
    fn take(&mut self, bytes: usize) -> usize {
        let offset = self.0.div_ceil(64) * 64;
        self.0 = offset + bytes;
        offset
    }
}

impl Areas {
    fn new(cfg: &Config) -> Areas {
        let Topology {
            world,
            topk,
            hidden,
            ..
        } = cfg.topo;
        let (t, m, local) = (cfg.max_tokens, cfg.ll_max_tokens, cfg.local_experts());
        let scale_cols = hidden / 128;
        let mut carve = Carver(std::mem::size_of::<Header>());
        let normal_start = carve.0;
        let dispatch_x = carve.take(t * hidden * cfg.token_dtype.elem_bytes());
        let dispatch_scales = carve.take(t * scale_cols * 4);
        let dispatch_topk = carve.take(t * topk * 4);
        let dispatch_weights = carve.take(t * topk * 4);
        let dispatch_end = carve.0;
        carve.0 = normal_start;
        let combine_rows = carve.take(world * t * hidden * 2);
        let combine_src_info = carve.take(world * t * 2 * 4);
        carve.0 = carve.0.max(dispatch_end);
        let ll_x = carve.take(m * hidden * 2);
        let ll_topk = carve.take(m * topk * 4);
        let ll_weights = carve.take(m * topk * 4);
        let ll_combine_y_bytes = local * world * m * hidden * 2;
        let ll_combine_y = carve.take(ll_combine_y_bytes);
        let ll_combine_src_info = carve.take(local * world * m * 4);
        let ll_combine_range = carve.take(local * world * 2 * 4);
        let ll_combine_weights = carve.take(local * world * m * 4);
        Areas {
            dispatch_x,
            dispatch_scales,
            dispatch_topk,
            dispatch_weights,
            combine_rows,
            combine_src_info,
            ll_x,
            ll_topk,
            ll_weights,
            ll_combine_y,
            ll_combine_src_info,
            ll_combine_range,
            ll_combine_weights,
            ll_combine_y_bytes,
            total: carve.0,
        }
    }
}

/// A low-latency call whose send phase ran and whose receive phase is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pending {
    LlDispatchRecv,
    LlCombineRecv,
}

/// What a dispatch leaves in its handle for the combine.
#[derive(Default)]
struct HostHandle {
    num_tokens: usize,
    topk_idx: Vec<i32>,
    dispatched: Option<Dispatched>,
}

struct HostBackend {
    cfg: Config,
    boot: Bootstrap,
    /// Every rank's region, index = rank (this rank's too).
    regions: Vec<Mapping>,
    areas: Areas,
    pending: Option<Pending>,
    /// Per-row routing weights of the last low-latency dispatch, when its
    /// caller gave weights (for the expert-side reduction of the combine).
    ll_recv_weights: Option<Vec<f32>>,
}

fn invalid_expert(bad: InvalidExpert) -> Error {
    let why = if bad.duplicate {
        "is listed twice for this token"
    } else {
        "is not an expert id (-1 or 0..num_experts)"
    };
    Error::invalid(format!(
        "topk_idx[{}][{}] = {} {why}",
        bad.token, bad.slot, bad.id
    ))
}

/// The caller's array as a slice (empty for zero elements, where the pointer
/// may be NULL).
///
/// # Safety
/// A non-empty `ptr` must point to `len` readable elements.
unsafe fn caller<'a, T>(ptr: *const T, len: usize) -> &'a [T] {
    if len == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(ptr, len)
    }
}

/// Copies `src` to the caller's array `dst`, when the caller asked for it.
///
/// # Safety
/// A non-NULL `dst` must have room for `src.len()` elements.
unsafe fn give<T: Copy>(dst: *mut T, src: &[T]) {
    if !dst.is_null() && !src.is_empty() {
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len());
    }
}

impl HostBackend {
    fn rank(&self) -> usize {
        self.cfg.rank
    }

    /// `len` elements at `offset` of `rank`'s region.
    fn view<T>(&self, rank: usize, offset: usize, len: usize) -> &[T] {
        let region = &self.regions[rank];
        assert!(offset + len * std::mem::size_of::<T>() <= region.len());
        // SAFETY: in bounds (checked above), 64-byte aligned, and only read
        // between the barriers that order it after the owner's writes.
        unsafe { std::slice::from_raw_parts(region.base().add(offset) as *const T, len) }
    }

    /// Copies `src` into this rank's region at `offset`.
    fn publish<T: Copy>(&mut self, offset: usize, src: &[T]) {
        let region = &self.regions[self.cfg.rank];
        let bytes = std::mem::size_of_val(src);
        assert!(offset + bytes <= region.len());
        // SAFETY: in bounds (checked above); no other rank reads this area
        // until the barrier that follows publishing.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr() as *const u8,
                region.base().add(offset),
                bytes,
            )
        };
    }

    fn header(&self, rank: usize) -> Header {
        self.view::<Header>(rank, 0, 1)[0]
    }

    fn set_header(&mut self, update: impl FnOnce(&mut Header)) {
        let mut header = self.header(self.cfg.rank);
        update(&mut header);
        self.publish(0, std::slice::from_ref(&header));
    }

    /// A barrier that also orders this rank's plain memory accesses to the
    /// shared regions against the other ranks'.
    fn barrier(&self) -> Result<()> {
        fence(Ordering::SeqCst);
        self.boot.barrier()?;
        fence(Ordering::SeqCst);
        Ok(())
    }

    fn expect_pending(&self, want: Option<Pending>) -> Result<()> {
        if self.pending == want {
            return Ok(());
        }
        Err(Error::invalid(match (self.pending, want) {
            (Some(Pending::LlDispatchRecv), _) => {
                "a low-latency dispatch ran its send phase only: call it again with EP_LL_RECV_ONLY first"
            }
            (Some(Pending::LlCombineRecv), _) => {
                "a low-latency combine ran its send phase only: call it again with EP_LL_RECV_ONLY first"
            }
            (None, _) => "EP_LL_RECV_ONLY without a matching EP_LL_SEND_ONLY call",
        }))
    }
}

impl Backend for HostBackend {
    fn layout(&mut self, op: &LayoutOp, _stream: Stream) -> Result<()> {
        let topo = self.cfg.topo;
        // SAFETY: the context checked the pointers; sizes follow the config.
        let topk_idx = unsafe { caller(op.topk_idx, op.num_tokens * topo.topk) };
        let layout = dispatch_layout(topo, topk_idx, op.num_tokens).map_err(invalid_expert)?;
        unsafe {
            give(op.tokens_per_rank, &layout.tokens_per_rank);
            give(op.tokens_per_expert, &layout.tokens_per_expert);
            give(op.is_token_in_rank, &layout.is_token_in_rank);
        }
        Ok(())
    }

    fn new_handle_state(&mut self) -> Result<HandleState> {
        Ok(Box::new(HostHandle::default()))
    }

    fn dispatch(
        &mut self,
        op: &DispatchOp,
        handle: &mut HandleState,
        _stream: Stream,
    ) -> Result<()> {
        self.expect_pending(None)?;
        let topo = self.cfg.topo;
        let (n, fp8) = (op.num_tokens, op.dtype == Dtype::Fp8E4m3);
        let row_bytes = topo.hidden * op.dtype.elem_bytes();
        let scale_cols = topo.hidden / 128;
        // SAFETY: the context checked the pointers for `n` tokens.
        let (x, scales, topk_idx, weights) = unsafe {
            (
                caller(op.x, n * row_bytes),
                if fp8 {
                    caller(op.x_scales, n * scale_cols)
                } else {
                    &[]
                },
                caller(op.topk_idx, n * topo.topk),
                caller(op.topk_weights, n * topo.topk),
            )
        };
        validate_experts(topo, topk_idx, n).map_err(invalid_expert)?;
        let state = handle
            .downcast_mut::<HostHandle>()
            .ok_or_else(|| Error::internal("not a host handle"))?;
        if op.reuse_layout && (state.num_tokens != n || state.topk_idx != topk_idx) {
            return Err(Error::invalid(
                "EP_DISPATCH_REUSE_LAYOUT with routing that differs from the handle's dispatch",
            ));
        }

        let a = &self.areas;
        let offsets = (
            a.dispatch_x,
            a.dispatch_scales,
            a.dispatch_topk,
            a.dispatch_weights,
        );
        self.publish(offsets.0, x);
        self.publish(offsets.1, scales);
        self.publish(offsets.2, topk_idx);
        self.publish(offsets.3, weights);
        self.set_header(|h| {
            h.dispatch_tokens = n as u64;
            h.dispatch_dtype = fp8 as u64;
        });
        self.barrier()?;

        let gathered = (0..topo.world)
            .map(|r| {
                let h = self.header(r);
                if h.dispatch_dtype != fp8 as u64 {
                    return Err(Error::remote(format!(
                        "rank {r} dispatched another token type than this rank"
                    )));
                }
                let m = h.dispatch_tokens as usize;
                Ok(RankTokens {
                    num_tokens: m,
                    x: self.view(r, offsets.0, m * row_bytes),
                    scales: if fp8 {
                        self.view(r, offsets.1, m * scale_cols)
                    } else {
                        &[]
                    },
                    topk_idx: self.view(r, offsets.2, m * topo.topk),
                    topk_weights: self.view(r, offsets.3, m * topo.topk),
                })
            })
            .collect::<Result<Vec<_>>>()
            .map(|sources| {
                let alignment = op.expert.map_or(1, |e| e.alignment);
                dispatch(topo, op.dtype, &sources, self.rank(), alignment)
            });
        self.barrier()?;
        let d = gathered?;

        // SAFETY: the context checked every output pointer and capacity.
        let result = unsafe { write_dispatch_outputs(op, &d, &topo) };
        state.num_tokens = n;
        state.topk_idx = topk_idx.to_vec();
        state.dispatched = Some(d);
        result
    }

    fn combine(&mut self, op: &CombineOp, handle: &HandleState, _stream: Stream) -> Result<()> {
        self.expect_pending(None)?;
        let topo = self.cfg.topo;
        let hidden = topo.hidden;
        let state = handle
            .downcast_ref::<HostHandle>()
            .ok_or_else(|| Error::internal("not a host handle"))?;
        let d = state
            .dispatched
            .as_ref()
            .ok_or_else(|| Error::internal("handle marked dispatched without a layout"))?;
        let input_rows = if op.expert_major {
            d.expert_rows
        } else {
            d.num_rows
        };
        if input_rows > 0 && op.x.is_null() {
            return Err(Error::null("x"));
        }
        if state.num_tokens > 0 && op.out.is_null() {
            return Err(Error::null("out"));
        }
        // SAFETY: `x` holds the rows of the handle's dispatch.
        let x = unsafe { caller(op.x as *const bf16, input_rows * hidden) };
        let rows: Cow<[bf16]> = if op.expert_major {
            Cow::Owned(expert_partials(topo, d, x))
        } else {
            Cow::Borrowed(x)
        };
        let (rows_at, src_at) = (self.areas.combine_rows, self.areas.combine_src_info);
        self.publish(rows_at, &rows);
        self.publish(src_at, &d.src_info);
        self.set_header(|h| h.combine_rows = d.num_rows as u64);
        self.barrier()?;
        let returned: Vec<Returned> = (0..topo.world)
            .map(|r| {
                let m = self.header(r).combine_rows as usize;
                Returned {
                    rows: self.view(r, rows_at, m * hidden),
                    src_info: self.view(r, src_at, m * 2),
                }
            })
            .collect();
        // The GPU's summation order: node partials first when there are
        // several nodes.
        let nodes = self.cfg.nodes();
        let out = if nodes.is_hierarchical() {
            hierarchical::combine(topo, nodes, self.rank(), state.num_tokens, &returned)
        } else {
            combine(topo, self.rank(), state.num_tokens, &returned)
        };
        self.barrier()?;
        // SAFETY: `out` has room for the dispatch's tokens (checked above).
        unsafe { give(op.out as *mut bf16, &out) };
        Ok(())
    }

    fn ll_dispatch(&mut self, op: &LlDispatchOp, _stream: Stream) -> Result<()> {
        let topo = self.cfg.topo;
        let (m, hidden, topk) = (self.cfg.ll_max_tokens, topo.hidden, topo.topk);
        let a = (self.areas.ll_x, self.areas.ll_topk, self.areas.ll_weights);
        let mut count_check = Ok(());
        if op.phases.send {
            self.expect_pending(None)?;
            // SAFETY: the context checked the pointer's alignment; it is NULL
            // or the caller's count.
            let n = unsafe { ll_tokens(op.num_tokens, op.device_num_tokens, &mut count_check) };
            // SAFETY: the context checked the pointers for `n` tokens.
            let (x, topk_idx, weights) = unsafe {
                (
                    caller(op.x as *const bf16, n * hidden),
                    caller(op.topk_idx, n * topk),
                    (!op.topk_weights.is_null()).then(|| caller(op.topk_weights, n * topk)),
                )
            };
            validate_experts(topo, topk_idx, n).map_err(invalid_expert)?;
            self.publish(a.0, x);
            self.publish(a.1, topk_idx);
            self.publish(a.2, weights.unwrap_or(&[]));
            self.set_header(|h| {
                h.ll_tokens = n as u64;
                h.ll_has_weights = weights.is_some() as u64;
            });
            self.barrier()?;
            self.pending = Some(Pending::LlDispatchRecv);
        }
        if op.phases.recv {
            self.expect_pending(Some(Pending::LlDispatchRecv))?;
            let sources: Vec<LlRankTokens> = (0..topo.world)
                .map(|r| {
                    let h = self.header(r);
                    let n = h.ll_tokens as usize;
                    LlRankTokens {
                        num_tokens: n,
                        x: self.view(r, a.0, n * hidden),
                        topk_idx: self.view(r, a.1, n * topk),
                        topk_weights: (h.ll_has_weights != 0).then(|| self.view(r, a.2, n * topk)),
                    }
                })
                .collect();
            let d = ll_dispatch(topo, m, &sources, self.rank(), op.out_dtype, op.ue8m0);
            self.barrier()?;
            self.pending = None;
            // SAFETY: the context checked the output pointers; sizes follow
            // the masked layout of the config.
            unsafe {
                give(op.recv_x, &d.recv_x);
                if op.out_dtype == Dtype::Fp8E4m3 {
                    give(op.recv_scales, &d.recv_scales);
                }
                give(op.recv_count, &d.recv_count);
                give(op.recv_src_info, &d.recv_src_info);
                give(op.recv_layout_range, &d.recv_layout_range);
            }
            self.ll_recv_weights = d.recv_weights;
        }
        count_check
    }

    fn ll_combine(&mut self, op: &LlCombineOp, _stream: Stream) -> Result<()> {
        let topo = self.cfg.topo;
        let (m, hidden, topk) = (self.cfg.ll_max_tokens, topo.hidden, topo.topk);
        let slots = self.cfg.local_experts() * topo.world * m;
        let a = &self.areas;
        let (y_at, src_at, range_at, w_at) = (
            a.ll_combine_y,
            a.ll_combine_src_info,
            a.ll_combine_range,
            a.ll_combine_weights,
        );
        if op.phases.send {
            self.expect_pending(None)?;
            // SAFETY: the context checked the pointers; sizes follow the
            // masked layout of the config.
            unsafe {
                if !op.zero_copy {
                    self.publish(y_at, caller(op.x as *const bf16, slots * hidden));
                }
                self.publish(src_at, caller(op.src_info, slots));
                self.publish(range_at, caller(op.layout_range, slots / m * 2));
            }
            let weights = self.ll_recv_weights.take();
            self.publish(w_at, weights.as_deref().unwrap_or(&[]));
            self.set_header(|h| h.ll_combine_has_weights = weights.is_some() as u64);
            self.ll_recv_weights = weights;
            self.barrier()?;
            self.pending = Some(Pending::LlCombineRecv);
        }
        let mut count_check = Ok(());
        if op.phases.recv {
            self.expect_pending(Some(Pending::LlCombineRecv))?;
            // SAFETY: as in `ll_dispatch`.
            let n = unsafe { ll_tokens(op.num_tokens, op.device_num_tokens, &mut count_check) };
            let experts: Vec<LlExpertOutputs> = (0..topo.world)
                .map(|r| LlExpertOutputs {
                    y: self.view(r, y_at, slots * hidden),
                    src_info: self.view(r, src_at, slots),
                    layout_range: self.view(r, range_at, slots / m * 2),
                    weights: (self.header(r).ll_combine_has_weights != 0)
                        .then(|| self.view(r, w_at, slots)),
                })
                .collect();
            let weights_missing =
                op.topk_weights.is_null() && experts.iter().any(|e| e.weights.is_none());
            let out = (!weights_missing).then(|| {
                // SAFETY: the context checked the pointers for `n` tokens.
                let (topk_idx, weights) = unsafe {
                    (
                        caller(op.topk_idx, n * topk),
                        (!op.topk_weights.is_null()).then(|| caller(op.topk_weights, n * topk)),
                    )
                };
                ll_combine(topo, m, self.rank(), n, topk_idx, weights, &experts)
            });
            self.barrier()?;
            self.pending = None;
            let out = out.ok_or_else(|| {
                Error::invalid(
                    "topk_weights is NULL but not every rank's dispatch was given weights",
                )
            })?;
            // SAFETY: `out` has room for `n` tokens (checked by the context).
            unsafe { give(op.out as *mut bf16, &out) };
        }
        count_check
    }

    fn ll_combine_buffer(&mut self) -> Result<(*mut u8, usize)> {
        let region = &self.regions[self.cfg.rank];
        // SAFETY: the area lies inside the region (see `Areas::new`).
        let ptr = unsafe { region.base().add(self.areas.ll_combine_y) };
        Ok((ptr, self.areas.ll_combine_y_bytes))
    }
}

/// The tokens of a low-latency call: `*device_num_tokens` when given, else
/// `bound`. As on the GPU, a count outside `[0, bound]` lets the call go on
/// with no tokens and leaves the error in `check`, to be returned when the
/// call ends.
///
/// # Safety
/// `device_num_tokens` is NULL or points to an `i32`.
unsafe fn ll_tokens(bound: usize, device_num_tokens: *const i32, check: &mut Result<()>) -> usize {
    if device_num_tokens.is_null() {
        return bound;
    }
    let n = *device_num_tokens;
    match usize::try_from(n) {
        Ok(n) if n <= bound => n,
        _ => {
            *check = Err(Error::invalid(format!(
                "*device_num_tokens = {n} is outside [0, num_tokens = {bound}]; the call ran with no tokens"
            )));
            0
        }
    }
}

/// Writes a dispatch's results to the caller's outputs. Counts are always
/// written; rows only when they fit the capacity, else an error says how many
/// rows were needed.
///
/// # Safety
/// Output pointers must be valid for the sizes the config and capacities give.
unsafe fn write_dispatch_outputs(op: &DispatchOp, d: &Dispatched, topo: &Topology) -> Result<()> {
    let (topk, fp8) = (topo.topk, op.dtype == Dtype::Fp8E4m3);
    if !op.no_host_sync {
        if !op.host_recv_num_rows.is_null() {
            *op.host_recv_num_rows = d.num_rows as i32;
        }
        give(op.host_expert_counts, &d.expert_counts);
    }
    let mut result = Ok(());
    if let Some(recv) = &op.recv {
        give(recv.num_rows, &[d.num_rows as i32]);
        if d.num_rows > recv.capacity {
            result = Err(Error::invalid(format!(
                "recv_capacity = {} but {} rows arrived; no rows were written",
                recv.capacity, d.num_rows
            )));
        } else {
            give(recv.x, &d.x);
            if fp8 {
                give(recv.scales, &d.scales);
            }
            give(recv.topk_idx, &d.topk_idx[..d.num_rows * topk]);
            give(recv.topk_weights, &d.topk_weights[..d.num_rows * topk]);
            give(recv.src_info, &d.src_info);
        }
    }
    if let Some(expert) = &op.expert {
        give(expert.offsets, &d.expert_offsets);
        give(expert.counts, &d.expert_counts);
        if d.expert_rows > expert.capacity {
            result = result.and(Err(Error::invalid(format!(
                "expert_capacity = {} but {} expert-major rows are needed; no rows were written",
                expert.capacity, d.expert_rows
            ))));
        } else {
            give(expert.x, &d.expert_x);
            if fp8 {
                give(expert.scales, &d.expert_scales);
            }
            give(expert.weights, &d.expert_weights);
            give(expert.src_row, &d.expert_src_row);
        }
    }
    result
}

/// Bytes of the shared region one rank allocates for `cfg`.
pub fn buffer_bytes(cfg: &Config) -> usize {
    Areas::new(cfg).total
}
