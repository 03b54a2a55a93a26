//! The host backend: the whole API on host memory, computed by the reference
//! code. Ranks are threads or processes of one host.
//!
//! Each rank owns one shared region (a memfd that every rank maps). A
//! collective call runs in two steps, each ending in an all-gather of the
//! call's tag (`Call::tag`: operation, call number, step):
//! 1. publish: each rank copies its inputs into its own region, then step 0;
//! 2. gather: each rank reads every rank's published inputs, computes its own
//!    outputs with the reference code, then step 1 (so no rank overwrites its
//!    region while another still reads it).
//!
//! With several nodes (`ranks_per_node`) the results are the GPU's
//! hierarchical ones: the normal combine sums inside each node first
//! (`reference::hierarchical::combine`); dispatch and the low-latency mode
//! give the same results on any node shape.
//!
//! Every rank sees every rank's tag at each step, so ranks in different calls
//! all stop at the same step with `EP_ERR_REMOTE` and read nothing. Errors
//! found between the steps are returned only after step 1, so no rank is
//! left waiting. The caller's arrays are checked before the call is made
//! ([`Backend::check_inputs`]); after that the reference code only sees data
//! that it accepts, so it cannot panic on a caller's mistake.
//!
//! The low-latency send/receive split maps onto the steps: `EP_LL_SEND_ONLY`
//! publishes, `EP_LL_RECV_ONLY` gathers. A low-latency combine returns rows
//! by the layout that each rank published at the end of its last dispatch,
//! never by arrays the caller passes back.
//!
//! A failed step (a peer gone or silent, an abort) breaks the context for
//! good: [`HostMonitor`] then reports it and the context refuses every call.

mod shm;

use super::backend::{Backend, HandleState, Inputs, Monitor, Stream};
use super::bootstrap::Bootstrap;
use super::config::Config;
use super::contract::{Field, PointerCheck};
use super::log;
use super::ops::{
    CombineOp, DispatchOp, LayoutOp, LlCombineOp, LlDispatchOp, MegaCombineOp, MegaDispatchOp,
    MegaOp, MoeOp, Received,
};
use super::sequence::Call;
use crate::error::{Error, ErrorKind, Result};
use crate::reference::hierarchical;
use crate::reference::layout::{dispatch_layout, validate_experts, InvalidExpert};
use crate::reference::low_latency::{ll_combine, ll_dispatch, LlExpertOutputs, LlRankTokens};
use crate::reference::mega::{grouped_gemm, real_rows, ExpertWeights, GemmRows};
use crate::reference::moe::activate_row;
use crate::reference::normal::{
    combine, dispatch, expert_partials, Dispatched, RankTokens, Returned,
};
use crate::reference::{Dtype, Topology};
use half::bf16;
use shm::Mapping;
use std::borrow::Cow;
use std::os::fd::AsFd;
use std::os::raw::c_void;
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// The steps of a collective call.
const PUBLISH: u32 = 0;
const GATHER: u32 = 1;

pub fn create(
    cfg: &mut Config,
    unique_id: &[u8; 128],
) -> Result<(Box<dyn Backend>, Arc<dyn Monitor>)> {
    let (boot, aborted) = Bootstrap::join(unique_id, cfg)?;
    if boot.local_ranks().len() != cfg.world() {
        return Err(Error::unsupported(format!(
            "the host backend needs every rank on one host; {} of {} are on this one",
            boot.local_ranks().len(),
            cfg.world()
        )));
    }
    let areas = Areas::new(cfg);
    log::info!(
        "host backend: shared buffer {} per rank, from max_tokens_per_rank {}, hidden {}, topk {}, token_dtype {}, world {}, ll_max_tokens_per_rank {}",
        log::human_bytes(areas.total),
        cfg.max_tokens,
        cfg.topo.hidden,
        cfg.topo.topk,
        super::describe::dtype(cfg.token_dtype),
        cfg.world(),
        cfg.ll_max_tokens
    );
    let fd = Mapping::create_memfd(&format!("ep-host-rank{}", cfg.rank), areas.total)?;
    let regions = boot
        .all_gather_fds(fd.as_fd())?
        .iter()
        .map(|peer| match peer {
            Some(peer_fd) => Mapping::map(peer_fd, areas.total),
            None => Err(Error::internal("a rank on this host sent no shared buffer")),
        })
        .collect::<Result<Vec<_>>>()?;
    let broken = Arc::new(Mutex::new(None));
    let backend = HostBackend {
        cfg: *cfg,
        boot,
        regions,
        areas,
        broken: broken.clone(),
        ll_sent: None,
    };
    Ok((Box::new(backend), Arc::new(HostMonitor { aborted, broken })))
}

struct HostMonitor {
    aborted: Arc<AtomicBool>,
    /// The failure of a step, once one failed.
    broken: Arc<Mutex<Option<Error>>>,
}

impl Monitor for HostMonitor {
    fn async_error(&self) -> Result<()> {
        if self.aborted.load(Ordering::Acquire) {
            return Err(Error::new(ErrorKind::Aborted, "the context was aborted"));
        }
        let broken = self.broken.lock().unwrap_or_else(|p| p.into_inner());
        match broken.as_ref() {
            None => Ok(()),
            Some(e) => Err(Error::new(
                e.kind,
                format!(
                    "the context is unusable since a collective call failed (destroy it): {}",
                    e.message
                ),
            )),
        }
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
    /// The rank published the layout of its last low-latency dispatch (its
    /// receive phase completed) for the combines of that dispatch.
    ll_combine_ready: u64,
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

/// What a dispatch leaves in its handle for the combine.
#[derive(Default)]
struct HostHandle {
    num_tokens: usize,
    topk_idx: Vec<i32>,
    dispatched: Option<Dispatched>,
}

/// The tokens this rank sent in its last low-latency dispatch.
struct LlSent {
    num_tokens: usize,
    topk_idx: Vec<i32>,
}

struct HostBackend {
    cfg: Config,
    boot: Bootstrap,
    /// Every rank's region, index = rank (this rank's too).
    regions: Vec<Mapping>,
    areas: Areas,
    /// Shared with the monitor: the failure of a step, once one failed.
    broken: Arc<Mutex<Option<Error>>>,
    ll_sent: Option<LlSent>,
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

/// Why the tags of a step differ: names this rank's call and the first
/// other rank's.
fn mismatch(me: usize, mine: &Call, step: u32, peer: usize, theirs: &[u8]) -> Error {
    let theirs = match Call::from_tag(theirs) {
        Some((Ok(call), their_step)) if their_step != step => {
            format!("{call} (step {their_step}, this rank step {step})")
        }
        Some((Ok(call), _)) => call.to_string(),
        Some((Err(code), _)) => format!("an unknown operation (code {code})"),
        None => "a malformed step".to_string(),
    };
    Error::remote(format!(
        "rank {peer} is in {theirs} while rank {me} (this rank) is in {mine}: \
         every rank must make the same collective calls in the same order \
         (a call that fails its argument checks is not made on its rank)"
    ))
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
        // between the steps that order it after the owner's writes.
        unsafe { std::slice::from_raw_parts(region.base().add(offset) as *const T, len) }
    }

    /// Copies `src` into this rank's region at `offset`.
    fn publish<T: Copy>(&mut self, offset: usize, src: &[T]) {
        let region = &self.regions[self.cfg.rank];
        let bytes = std::mem::size_of_val(src);
        assert!(offset + bytes <= region.len());
        // SAFETY: in bounds (checked above); no other rank reads this area
        // until the step that follows publishing.
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

    /// One step of `call`: every rank's tag is gathered (which also orders
    /// this rank's plain accesses to the shared regions against the other
    /// ranks'), and any rank in another call or step stops every rank.
    fn step(&self, call: &Call, step: u32) -> Result<()> {
        let mine = call.tag(step);
        fence(Ordering::SeqCst);
        let tags = self.boot.all_gather(&mine).inspect_err(|e| {
            let mut broken = self.broken.lock().unwrap_or_else(|p| p.into_inner());
            broken.get_or_insert_with(|| e.clone());
        })?;
        fence(Ordering::SeqCst);
        match tags.iter().position(|t| t[..] != mine[..]) {
            None => Ok(()),
            Some(peer) => Err(mismatch(self.rank(), call, step, peer, &tags[peer])),
        }
    }
}

impl PointerCheck for HostBackend {
    /// Host memory is all the host backend uses: any pointer will do.
    fn check_pointer(&self, _field: &Field, _ptr: *const c_void) -> Result<()> {
        Ok(())
    }
}

impl Backend for HostBackend {
    fn check_stream(&self, _stream: Stream) -> Result<()> {
        Ok(())
    }

    fn check_inputs(&mut self, inputs: Inputs<'_>) -> Result<()> {
        let topo = self.cfg.topo;
        match inputs {
            Inputs::Dispatch(op, handle) => {
                // SAFETY: the context checked the pointer for `n` tokens.
                let topk_idx = unsafe { caller(op.topk_idx, op.num_tokens * topo.topk) };
                validate_experts(topo, topk_idx, op.num_tokens).map_err(invalid_expert)?;
                // The context checked that the handle holds a dispatch of
                // as many tokens.
                let state = host_handle(handle)?;
                if op.reuse_layout && state.topk_idx != topk_idx {
                    return Err(Error::invalid(
                        "EP_DISPATCH_REUSE_LAYOUT with routing that differs from the handle's dispatch",
                    ));
                }
            }
            Inputs::LlDispatch(op) if op.phases.send => {
                // SAFETY: the context checked the pointers; the count is
                // NULL or the caller's aligned `int32_t`.
                let n = unsafe { ll_count(op.num_tokens, op.device_num_tokens) }.unwrap_or(0);
                let topk_idx = unsafe { caller(op.topk_idx, n * topo.topk) };
                validate_experts(topo, topk_idx, n).map_err(invalid_expert)?;
            }
            Inputs::LlCombine(op) if op.phases.recv => {
                // A count out of range is reported when the call runs.
                // SAFETY: as for the dispatch.
                let Ok(n) = (unsafe { ll_count(op.num_tokens, op.device_num_tokens) }) else {
                    return Ok(());
                };
                let sent = self.ll_sent.as_ref().ok_or_else(|| {
                    Error::internal("low-latency combine without a dispatch on the host backend")
                })?;
                if n != sent.num_tokens {
                    return Err(Error::invalid(format!(
                        "the combine has {n} tokens but the low-latency dispatch it combines had {}",
                        sent.num_tokens
                    )));
                }
                // SAFETY: the context checked the pointer for `n` tokens.
                let topk_idx = unsafe { caller(op.topk_idx, n * topo.topk) };
                validate_experts(topo, topk_idx, n).map_err(invalid_expert)?;
                if let Some(i) = (0..topk_idx.len()).find(|&i| topk_idx[i] != sent.topk_idx[i]) {
                    return Err(Error::invalid(format!(
                        "topk_idx[{}][{}] = {} but the low-latency dispatch it combines had {}: pass the dispatch's topk_idx",
                        i / topo.topk,
                        i % topo.topk,
                        topk_idx[i],
                        sent.topk_idx[i]
                    )));
                }
            }
            Inputs::LlDispatch(_) | Inputs::LlCombine(_) => {}
        }
        Ok(())
    }

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
        call: Call,
        op: &DispatchOp,
        handle: &mut HandleState,
        _stream: Stream,
    ) -> Result<Option<Received>> {
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
        self.step(&call, PUBLISH)?;

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
            .map(|sources| dispatch(topo, op.dtype, &sources, self.rank(), op.alignment()));
        self.step(&call, GATHER)?;
        let d = gathered?;

        // SAFETY: the context checked every output pointer; capacities are
        // checked against the rows before any row is written.
        unsafe { write_dispatch_outputs(op, &d, &topo) }?;
        let received = (!op.no_host_sync).then_some(Received {
            source_rows: d.num_rows,
            expert_rows: d.expert_rows,
        });
        let state = host_handle_mut(handle)?;
        state.num_tokens = n;
        state.topk_idx = topk_idx.to_vec();
        state.dispatched = Some(d);
        Ok(received)
    }

    fn combine(
        &mut self,
        call: Call,
        op: &CombineOp,
        handle: &HandleState,
        _stream: Stream,
    ) -> Result<()> {
        let topo = self.cfg.topo;
        let hidden = topo.hidden;
        let state = host_handle(handle)?;
        let d = dispatched(handle)?;
        let input_rows = if op.expert_major {
            d.expert_rows
        } else {
            d.num_rows
        };
        // SAFETY: `x` holds the rows of the handle's dispatch (the context
        // checked that it is given where there are rows).
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
        self.step(&call, PUBLISH)?;
        // Every rank combines the same dispatch (the step compared the
        // dispatch call numbers), so every row addressed here names one of
        // this rank's tokens of it.
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
        self.step(&call, GATHER)?;
        // SAFETY: `out` has room for the dispatch's tokens (checked by the
        // context where there are any).
        unsafe { give(op.out as *mut bf16, &out) };
        Ok(())
    }

    fn mega_dispatch_gemm(
        &mut self,
        call: Call,
        op: &MegaDispatchOp,
        handle: &mut HandleState,
        stream: Stream,
    ) -> Result<()> {
        self.dispatch(call, &op.dispatch, handle, stream)?;
        let d = dispatched(handle)?;
        let rows = GemmRows {
            data: &d.expert_x,
            scales: &d.expert_scales,
        };
        // SAFETY: the context checked the weights for the configured shape;
        // `y` has room for the expert capacity, at least the rows of a
        // dispatch that succeeded.
        unsafe {
            let y = self.gemm(&op.gemm, rows, d);
            let keep_padding = op.dispatch.expert.is_some_and(|e| e.keep_padding);
            give_expert_rows(op.gemm.y as *mut bf16, &y, op.gemm.n, d, keep_padding);
        }
        Ok(())
    }

    fn mega_gemm_combine(
        &mut self,
        call: Call,
        op: &MegaCombineOp,
        handle: &HandleState,
        stream: Stream,
    ) -> Result<()> {
        let d = dispatched(handle)?;
        let g = &op.gemm;
        let rows = d.expert_rows;
        // SAFETY: the API gives `x` and its scales the dispatch's expert
        // capacity, at least its rows.
        let y = unsafe {
            let x = caller(op.combine.x, rows * g.dtype.row_bytes(g.k));
            let scales = match g.dtype {
                Dtype::Fp8E4m3 => caller(g.x_scales, rows * g.dtype.scales_per_row(g.k)),
                Dtype::Bf16 => &[],
            };
            self.gemm(g, GemmRows { data: x, scales }, d)
        };
        // Rows of real pairs go to the caller; padding rows stay as they were.
        // SAFETY: `y` has room for every expert-major row.
        unsafe { give_real_rows(g.y as *mut bf16, &y, g.n, d) };
        let combine = CombineOp {
            x: y.as_ptr() as *const u8,
            ..op.combine
        };
        self.combine(call, &combine, handle, stream)
    }

    fn moe_forward(
        &mut self,
        calls: [Call; 2],
        op: &MoeOp,
        handle: &mut HandleState,
        stream: Stream,
    ) -> Result<()> {
        let hidden = self.cfg.topo.hidden;
        self.mega_dispatch_gemm(calls[0], &op.gate_up(hidden), handle, stream)?;
        // SAFETY: the context checked `y1`, `act` and `act_scales` for the
        // expert capacity, at least the rows of a dispatch that succeeded;
        // `y1` holds the dispatch's rows, just written.
        unsafe { activate(op, dispatched(handle)?) };
        self.mega_gemm_combine(calls[1], &op.down(hidden), handle, stream)
    }

    fn ll_dispatch(&mut self, call: Call, op: &LlDispatchOp, _stream: Stream) -> Result<()> {
        let topo = self.cfg.topo;
        let (m, hidden, topk) = (self.cfg.ll_max_tokens, topo.hidden, topo.topk);
        let a = (self.areas.ll_x, self.areas.ll_topk, self.areas.ll_weights);
        let mut count_check = Ok(());
        if op.phases.send {
            // SAFETY: the context checked the count pointer's alignment.
            let n = unsafe { ll_count(op.num_tokens, op.device_num_tokens) }.unwrap_or_else(|e| {
                count_check = Err(e);
                0
            });
            // SAFETY: the context checked the pointers for `n` tokens.
            let (x, topk_idx, weights) = unsafe {
                (
                    caller(op.x as *const bf16, n * hidden),
                    caller(op.topk_idx, n * topk),
                    (!op.topk_weights.is_null()).then(|| caller(op.topk_weights, n * topk)),
                )
            };
            self.publish(a.0, x);
            self.publish(a.1, topk_idx);
            self.publish(a.2, weights.unwrap_or(&[]));
            self.set_header(|h| {
                h.ll_tokens = n as u64;
                // No tokens, nothing to weigh: such a rank counts as having
                // given its weights (as in the context's pairing rule).
                h.ll_has_weights = (weights.is_some() || n == 0) as u64;
                // The last dispatch's layout is gone; this one's comes with
                // its receive phase.
                h.ll_combine_has_weights = 0;
                h.ll_combine_ready = 0;
            });
            self.ll_sent = Some(LlSent {
                num_tokens: n,
                topk_idx: topk_idx.to_vec(),
            });
            self.step(&call, PUBLISH)?;
        }
        if op.phases.recv {
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
            self.step(&call, GATHER)?;
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
            // The layout this dispatch's combines return rows by. Every rank
            // has passed the gather step, and ranks read these areas only
            // between a combine's two steps, so nobody reads them now.
            let a = &self.areas;
            let (src_at, range_at, w_at) = (
                a.ll_combine_src_info,
                a.ll_combine_range,
                a.ll_combine_weights,
            );
            self.publish(src_at, &d.recv_src_info);
            self.publish(range_at, &d.recv_layout_range);
            self.publish(w_at, d.recv_weights.as_deref().unwrap_or(&[]));
            self.set_header(|h| {
                h.ll_combine_has_weights = d.recv_weights.is_some() as u64;
                h.ll_combine_ready = 1;
            });
        }
        count_check
    }

    fn ll_combine(&mut self, call: Call, op: &LlCombineOp, _stream: Stream) -> Result<()> {
        let topo = self.cfg.topo;
        let (m, hidden, topk) = (self.cfg.ll_max_tokens, topo.hidden, topo.topk);
        let slots = self.cfg.local_experts() * topo.world * m;
        let ranges = slots / m * 2;
        let a = &self.areas;
        let (y_at, src_at, range_at, w_at) = (
            a.ll_combine_y,
            a.ll_combine_src_info,
            a.ll_combine_range,
            a.ll_combine_weights,
        );
        if op.phases.send {
            if !op.zero_copy {
                // SAFETY: the context checked the pointer; its size is the
                // masked layout of the config.
                let y = unsafe { caller(op.x as *const bf16, slots * hidden) };
                self.publish(y_at, y);
            }
            // The layout went out with the dispatch's receive phase (not if
            // that did not complete: every rank then learns it below).
            self.step(&call, PUBLISH)?;
        }
        let mut count_check = Ok(());
        if op.phases.recv {
            // SAFETY: the context checked the count pointer's alignment.
            let n = unsafe { ll_count(op.num_tokens, op.device_num_tokens) }.unwrap_or_else(|e| {
                count_check = Err(e);
                0
            });
            let unready = (0..topo.world).find(|&r| self.header(r).ll_combine_ready == 0);
            let experts: Vec<LlExpertOutputs> = (0..topo.world)
                .map(|r| LlExpertOutputs {
                    y: self.view(r, y_at, slots * hidden),
                    src_info: self.view(r, src_at, slots),
                    layout_range: self.view(r, range_at, ranges),
                    weights: (self.header(r).ll_combine_has_weights != 0)
                        .then(|| self.view(r, w_at, slots)),
                })
                .collect();
            let weights_missing =
                op.topk_weights.is_null() && experts.iter().any(|e| e.weights.is_none());
            let out = match unready {
                Some(r) => Err(Error::invalid(format!(
                    "rank {r} has no layout of the low-latency dispatch this combine pairs with (call #{}): that dispatch failed",
                    call.pairs_with
                ))),
                None if weights_missing => Err(Error::invalid(
                    "topk_weights is NULL but not every rank's dispatch was given weights",
                )),
                None => {
                    // SAFETY: the context checked the pointers for `n` tokens,
                    // and `check_inputs` that they are the dispatch's routing.
                    let (topk_idx, weights) = unsafe {
                        (
                            caller(op.topk_idx, n * topk),
                            (!op.topk_weights.is_null())
                                .then(|| caller(op.topk_weights, n * topk)),
                        )
                    };
                    Ok(ll_combine(
                        topo,
                        m,
                        self.rank(),
                        n,
                        topk_idx,
                        weights,
                        &experts,
                    ))
                }
            };
            self.step(&call, GATHER)?;
            // SAFETY: `out` has room for `n` tokens (checked by the context).
            unsafe { give(op.out as *mut bf16, &out?) };
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

fn host_handle(handle: &HandleState) -> Result<&HostHandle> {
    handle
        .downcast_ref::<HostHandle>()
        .ok_or_else(|| Error::internal("not a host handle"))
}

fn host_handle_mut(handle: &mut HandleState) -> Result<&mut HostHandle> {
    handle
        .downcast_mut::<HostHandle>()
        .ok_or_else(|| Error::internal("not a host handle"))
}

/// The tokens of a low-latency call: `*device_num_tokens` when given, else
/// `bound`. As on the GPU, a count outside `[0, bound]` is an error that the
/// call reports when it ends, having run with no tokens.
///
/// # Safety
/// `device_num_tokens` is NULL or points to an aligned `i32`.
unsafe fn ll_count(bound: usize, device_num_tokens: *const i32) -> Result<usize> {
    if device_num_tokens.is_null() {
        return Ok(bound);
    }
    let n = *device_num_tokens;
    match usize::try_from(n) {
        Ok(n) if n <= bound => Ok(n),
        _ => Err(Error::invalid(format!(
            "*device_num_tokens = {n} is outside [0, num_tokens = {bound}]; the call ran with no tokens"
        ))),
    }
}

/// The reference layout a dispatch left in a handle.
fn dispatched(handle: &HandleState) -> Result<&Dispatched> {
    host_handle(handle)?
        .dispatched
        .as_ref()
        .ok_or_else(|| Error::internal("a host handle without a layout"))
}

impl HostBackend {
    /// The grouped GEMM of a fused call over the expert-major `rows` of the
    /// dispatch `d`: `[d.expert_rows, n]`, zeros in padding rows.
    ///
    /// # Safety
    /// The weight pointers must hold `[local_experts, n, k]` elements (and
    /// FP8 scales), as the API says.
    unsafe fn gemm(&self, op: &MegaOp, rows: GemmRows, d: &Dispatched) -> Vec<bf16> {
        let (n, k, dtype) = (op.n, op.k, op.dtype);
        let experts = self.cfg.local_experts();
        let blocks = (n / 128) * (k / 128);
        let weights = ExpertWeights {
            dtype,
            n,
            k,
            data: caller(op.weights, experts * n * k * dtype.elem_bytes()),
            scales: match dtype {
                Dtype::Fp8E4m3 => caller(op.weight_scales, experts * blocks),
                Dtype::Bf16 => &[],
            },
        };
        grouped_gemm(&weights, rows, &d.expert_offsets, &d.expert_counts)
    }
}

/// `ep_moe_forward`'s SwiGLU: reads the real expert-major rows of the
/// caller's `y1` (as the first GEMM wrote them) and writes their
/// activations to `act` (and FP8 scales to `act_scales`); padding rows are
/// left as they were.
///
/// # Safety
/// `y1`, `act` and `act_scales` hold the expert-major rows of `d`.
unsafe fn activate(op: &MoeOp, d: &Dispatched) {
    let e = &op.experts;
    let (i, dtype) = (e.intermediate, e.dtype);
    let (row_bytes, row_scales) = (dtype.row_bytes(i), dtype.scales_per_row(i));
    let y1 = caller(e.y1 as *const bf16, d.expert_rows * 2 * i);
    let mut act = vec![0u8; row_bytes];
    let mut scales = vec![0f32; row_scales];
    let (_, real) = real_rows(&d.expert_offsets, &d.expert_counts);
    for j in real.into_iter().flatten() {
        activate_row(dtype, &y1[j * 2 * i..][..2 * i], &mut act, &mut scales);
        give(e.act.add(j * row_bytes), &act);
        if dtype == Dtype::Fp8E4m3 {
            give(e.act_scales.add(j * row_scales), &scales);
        }
    }
}

/// Copies the rows of real (token, expert) pairs of the expert-major array
/// `src` (rows of `row_len` elements, laid out as `d`'s expert-major rows)
/// to the caller's `dst`, leaving its padding rows as they were.
///
/// # Safety
/// `dst` must have room for `d`'s expert-major rows.
unsafe fn give_real_rows<T: Copy>(dst: *mut T, src: &[T], row_len: usize, d: &Dispatched) {
    let (_, real) = real_rows(&d.expert_offsets, &d.expert_counts);
    for rows in real {
        give(
            dst.add(rows.start * row_len),
            &src[rows.start * row_len..rows.end * row_len],
        );
    }
}

/// Copies the expert-major array `src` (rows of `row_len` elements, laid
/// out as `d`'s expert-major rows) to the caller's `dst`: every row, or with
/// `keep_padding` (`EP_DISPATCH_KEEP_PADDING`) the real rows only.
///
/// # Safety
/// `dst` must have room for `d`'s expert-major rows.
unsafe fn give_expert_rows<T: Copy>(
    dst: *mut T,
    src: &[T],
    row_len: usize,
    d: &Dispatched,
    keep_padding: bool,
) {
    if keep_padding {
        give_real_rows(dst, src, row_len, d);
    } else {
        give(dst, src);
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
        result = recv.check_rows(d.num_rows);
        if result.is_ok() {
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
        let fits = expert.check_rows(d.expert_rows);
        if fits.is_ok() {
            let (row_bytes, row_scales) = (
                op.dtype.row_bytes(topo.hidden),
                op.dtype.scales_per_row(topo.hidden),
            );
            give_expert_rows(expert.x, &d.expert_x, row_bytes, d, expert.keep_padding);
            if fp8 {
                let scales = &d.expert_scales;
                give_expert_rows(expert.scales, scales, row_scales, d, expert.keep_padding);
            }
            give(expert.weights, &d.expert_weights);
            give(expert.src_row, &d.expert_src_row);
        }
        result = result.and(fits);
    }
    result
}

/// Bytes of the shared region one rank allocates for `cfg`.
pub fn buffer_bytes(cfg: &Config) -> usize {
    Areas::new(cfg).total
}
