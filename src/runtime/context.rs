//! The context behind `ep_ctx_t`: one rank's configuration, its backend, and
//! the state that any thread may query.
//!
//! Every operation is checked here, once for both backends, before the
//! backend sees it: its values against the configuration, its pointers
//! against the contract (`super::contract`: NULL, alignment, memory kind),
//! the stream, the order of calls (split low-latency calls, dispatch before
//! combine, a combine's layout), then the backend's own checks (of the
//! caller's arrays, and whether it runs such calls at all). A call that
//! fails any of these changes nothing. A
//! collective call that passes them takes the next call number
//! (`super::sequence`) and runs.

use super::backend::{Backend, Inputs, LlTimeline, Monitor, Stream};
use super::config::{BackendKind, Config};
use super::contract::{self, check_pointers, Facts};
use super::handle::{DispatchRecord, Handle};
use super::ops::{
    check_ll_enabled, CombineOp, DispatchOp, LayoutOp, LlCombineOp, LlDispatchOp, MegaCombineOp,
    MegaDispatchOp, MoeOp,
};
use super::sequence::{Call, Collective};
use super::{gpu, host};
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

static NEXT_CONTEXT_ID: AtomicU64 = AtomicU64::new(1);

pub struct Context {
    id: u64,
    cfg: Config,
    /// Operations hold this lock, so one thread at a time runs them (the
    /// header's rule); a second thread waits rather than racing.
    inner: Mutex<Inner>,
    monitor: Arc<dyn Monitor>,
}

/// The backend and the runtime's bookkeeping of the calls made on it.
struct Inner {
    backend: Box<dyn Backend>,
    /// Number of the last collective call made (0 before the first).
    calls: u64,
    /// The last low-latency dispatch whose send phase ran.
    ll_dispatch: Option<LlDispatchRecord>,
    /// A low-latency call whose send phase ran alone (`EP_LL_SEND_ONLY`)
    /// and whose receive phase is due.
    pending: Option<Pending>,
}

#[derive(Debug, Clone, Copy)]
struct LlDispatchRecord {
    call: u64,
    num_tokens: usize,
    weighted: bool,
}

#[derive(Debug, Clone, Copy)]
struct Pending {
    call: Call,
    /// A combine's send phase applied weights of its own.
    weighted: bool,
}

impl Inner {
    fn next_call(&mut self, op: Collective, pairs_with: u64) -> Call {
        self.calls += 1;
        Call {
            op,
            number: self.calls,
            pairs_with,
        }
    }

    /// A call that starts a collective: no split call may be half done.
    fn nothing_pending(&self) -> Result<()> {
        self.pending.map_or(Ok(()), |p| Err(half_done(p)))
    }

    /// An `EP_LL_RECV_ONLY` call of `op`: the send-only call it completes.
    fn pending_receive(&self, op: Collective) -> Result<Pending> {
        match self.pending {
            Some(p) if p.call.op == op => Ok(p),
            Some(p) => Err(half_done(p)),
            None => Err(Error::invalid(format!(
                "EP_LL_RECV_ONLY without a matching EP_LL_SEND_ONLY call: the last {} call ran both phases, or its send phase failed",
                op.function()
            ))),
        }
    }

    fn check_stream(&self, stream: Stream) -> Result<()> {
        self.backend.check_stream(stream)
    }
}

/// The error for a call made while `p`'s receive phase is due.
fn half_done(p: Pending) -> Error {
    let what = match p.call.op {
        Collective::LlCombine => "combine",
        _ => "dispatch",
    };
    Error::invalid(format!(
        "a low-latency {what} ran its send phase only ({}, EP_LL_SEND_ONLY): call {} with EP_LL_RECV_ONLY first",
        p.call,
        p.call.op.function()
    ))
}

impl Context {
    /// Joins the group described by `unique_id` and sets up the backend.
    /// The backend fixes what the configuration left to the hosts
    /// (`ranks_per_node`).
    pub fn create(mut cfg: Config, unique_id: &[u8; 128]) -> Result<Context> {
        let (backend, monitor) = match cfg.backend {
            BackendKind::Host => host::create(&mut cfg, unique_id)?,
            BackendKind::Gpu => gpu::create(&mut cfg, unique_id)?,
        };
        Ok(Context::with(cfg, backend, monitor))
    }

    fn with(cfg: Config, backend: Box<dyn Backend>, monitor: Arc<dyn Monitor>) -> Context {
        Context {
            id: NEXT_CONTEXT_ID.fetch_add(1, Ordering::Relaxed),
            cfg,
            inner: Mutex::new(Inner {
                backend,
                calls: 0,
                ll_dispatch: None,
                pending: None,
            }),
            monitor,
        }
    }

    /// A GPU context on the caller's NCCL communicator.
    ///
    /// # Safety
    /// `comm` is a live communicator of the loaded NCCL that outlives the
    /// context.
    pub unsafe fn create_from_nccl(mut cfg: Config, comm: super::nccl::Comm) -> Result<Context> {
        let (backend, monitor) = gpu::create_from_nccl(&mut cfg, comm)?;
        Ok(Context::with(cfg, backend, monitor))
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn abort(&self) {
        self.monitor.abort();
    }

    pub fn async_error(&self) -> Result<()> {
        self.monitor.async_error()
    }

    /// Locks the backend for one call, refusing every call once the context
    /// has failed for good (an async error, a lost peer, an abort: it must
    /// then be destroyed).
    ///
    /// A panic inside an earlier call (a bug: that call returned
    /// `EP_ERR_INTERNAL`) does not poison the context: the bookkeeping here
    /// is only updated after a backend returns, and the call numbers make
    /// any disagreement with the peers an error rather than wrong data.
    fn lock(&self) -> Result<MutexGuard<'_, Inner>> {
        self.monitor.async_error()?;
        Ok(self.inner.lock().unwrap_or_else(|poisoned| {
            self.inner.clear_poison();
            poisoned.into_inner()
        }))
    }

    fn check_handle(&self, handle: &Handle) -> Result<()> {
        if handle.ctx_id != self.id {
            return Err(Error::invalid("the handle belongs to another context"));
        }
        Ok(())
    }

    pub fn layout(&self, op: &LayoutOp, stream: Stream) -> Result<()> {
        let mut inner = self.lock()?;
        op.validate(&self.cfg)?;
        check_pointers(contract::LAYOUT, op, &op.facts(), &*inner.backend)?;
        inner.check_stream(stream)?;
        inner.backend.layout(op, stream)
    }

    pub fn new_handle(&self) -> Result<Handle> {
        Ok(Handle {
            ctx_id: self.id,
            dispatch: None,
            state: self.lock()?.backend.new_handle_state()?,
        })
    }

    pub fn dispatch(&self, op: &DispatchOp, handle: &mut Handle, stream: Stream) -> Result<()> {
        let mut inner = self.lock()?;
        self.check_handle(handle)?;
        op.validate(&self.cfg)?;
        inner.nothing_pending()?;
        if op.reuse_layout {
            match handle.dispatch {
                Some(d) if d.num_tokens == op.num_tokens => {}
                Some(d) => {
                    return Err(Error::invalid(format!(
                        "EP_DISPATCH_REUSE_LAYOUT with num_tokens = {}, but the handle's dispatch had {}",
                        op.num_tokens, d.num_tokens
                    )))
                }
                None => {
                    return Err(Error::invalid(
                        "EP_DISPATCH_REUSE_LAYOUT with a handle that holds no layout yet",
                    ))
                }
            }
        }
        check_pointers(contract::DISPATCH, op, &op.facts(), &*inner.backend)?;
        inner.check_stream(stream)?;
        inner
            .backend
            .check_inputs(Inputs::Dispatch(op, &handle.state))?;

        let call = inner.next_call(Collective::Dispatch, 0);
        let previous = handle.dispatch.take();
        let received = inner
            .backend
            .dispatch(call, op, &mut handle.state, stream)?;
        // A reused layout received what the dispatch it reuses received.
        let received = received.or(previous
            .filter(|_| op.reuse_layout)
            .and_then(|p| p.received));
        handle.dispatch = Some(DispatchRecord {
            call: call.number,
            num_tokens: op.num_tokens,
            source_order: op.recv.is_some(),
            expert_major: op.expert.is_some(),
            received,
        });
        Ok(())
    }

    /// Bytes of a BF16 row of `hidden` channels (a combine's rows).
    fn bf16_row_bytes(&self) -> usize {
        self.cfg.topo.hidden * 2
    }

    pub fn combine(&self, op: &CombineOp, handle: &Handle, stream: Stream) -> Result<()> {
        let mut inner = self.lock()?;
        self.check_handle(handle)?;
        let d = combined_dispatch(op, handle)?;
        inner.nothing_pending()?;
        let rows = d.received.is_none_or(|r| {
            let rows = if op.expert_major {
                r.expert_rows
            } else {
                r.source_rows
            };
            rows > 0
        });
        let facts = Facts {
            tokens: d.num_tokens > 0,
            rows,
            ..Facts::default()
        };
        check_pointers(contract::COMBINE, op, &facts, &*inner.backend)?;
        let received = d.received.map(|r| {
            if op.expert_major {
                r.expert_rows
            } else {
                r.source_rows
            }
        });
        op.check_disjoint("x", op.x, received, d.num_tokens, self.bf16_row_bytes())?;
        inner.check_stream(stream)?;
        let call = inner.next_call(Collective::Combine, d.call);
        inner.backend.combine(call, op, &handle.state, stream)
    }

    pub fn ll_dispatch(&self, op: &LlDispatchOp, stream: Stream) -> Result<()> {
        let mut inner = self.lock()?;
        op.validate(&self.cfg)?;
        let continued = if op.phases.send {
            inner.nothing_pending()?;
            None
        } else {
            Some(inner.pending_receive(Collective::LlDispatch)?)
        };
        check_pointers(contract::LL_DISPATCH, op, &op.facts(), &*inner.backend)?;
        inner.check_stream(stream)?;
        inner.backend.check_inputs(Inputs::LlDispatch(op))?;
        inner.backend.check_supported(Collective::LlDispatch)?;

        let call = match continued {
            Some(p) => p.call,
            None => inner.next_call(Collective::LlDispatch, 0),
        };
        if op.phases.send {
            inner.ll_dispatch = Some(LlDispatchRecord {
                call: call.number,
                num_tokens: op.num_tokens,
                // A dispatch of no tokens has nothing to weigh: it counts as
                // given its weights, so its combine may omit them too.
                weighted: !op.topk_weights.is_null()
                    || (op.num_tokens == 0 && op.device_num_tokens.is_null()),
            });
        }
        inner.pending = None;
        let result = inner.backend.ll_dispatch(call, op, stream);
        if result.is_ok() && !op.phases.recv {
            inner.pending = Some(Pending {
                call,
                weighted: false,
            });
        }
        result
    }

    pub fn ll_combine(&self, op: &LlCombineOp, stream: Stream) -> Result<()> {
        let mut inner = self.lock()?;
        op.validate(&self.cfg)?;
        let d = inner.ll_dispatch.ok_or_else(|| {
            Error::invalid("low-latency combine before any low-latency dispatch on this context")
        })?;
        if op.num_tokens != d.num_tokens {
            return Err(Error::invalid(format!(
                "num_tokens = {} but the low-latency dispatch it combines (call #{}) had num_tokens = {}: pass the same value",
                op.num_tokens, d.call, d.num_tokens
            )));
        }
        let continued = if op.phases.send {
            inner.nothing_pending()?;
            None
        } else {
            let p = inner.pending_receive(Collective::LlCombine)?;
            if p.weighted != op.weighted() {
                return Err(Error::invalid(
                    "EP_LL_RECV_ONLY combine with topk_weights given or not unlike its EP_LL_SEND_ONLY call",
                ));
            }
            Some(p)
        };
        let facts = op.facts(d.weighted);
        check_pointers(contract::LL_COMBINE, op, &facts, &*inner.backend)?;
        inner.check_stream(stream)?;
        inner.backend.check_inputs(Inputs::LlCombine(op))?;
        inner.backend.check_supported(Collective::LlCombine)?;

        let call = match continued {
            Some(p) => p.call,
            None => inner.next_call(Collective::LlCombine, d.call),
        };
        inner.pending = None;
        let result = inner.backend.ll_combine(call, op, stream);
        if result.is_ok() && !op.phases.recv {
            inner.pending = Some(Pending {
                call,
                weighted: op.weighted(),
            });
        }
        result
    }

    pub fn ll_combine_buffer(&self) -> Result<(*mut u8, usize)> {
        let mut inner = self.lock()?;
        check_ll_enabled(&self.cfg)?;
        inner.backend.ll_combine_buffer()
    }

    /// ep-bench's per-phase breakdown: the low-latency kernels note device
    /// timestamps from now on, or no longer (GPU backend).
    pub fn ll_keep_timeline(&self, keep: bool) -> Result<()> {
        let mut inner = self.lock()?;
        check_ll_enabled(&self.cfg)?;
        inner.backend.ll_keep_timeline(keep)
    }

    /// The timestamps of the last low-latency launches (see `LlTimeline`).
    /// The caller has waited for them (the stream is synchronised).
    pub fn ll_timeline(&self) -> Result<LlTimeline> {
        let mut inner = self.lock()?;
        check_ll_enabled(&self.cfg)?;
        inner.backend.ll_timeline()
    }

    /// `ep_mega_dispatch_gemm`: checked as a dispatch (values, the
    /// dispatch's pointer table, the backend's checks of its inputs) plus
    /// the GEMM's values and pointers; recorded in the handle as a
    /// dispatch that did not tell the host its rows.
    pub fn mega_dispatch_gemm(
        &self,
        op: &MegaDispatchOp,
        handle: &mut Handle,
        stream: Stream,
    ) -> Result<()> {
        let mut inner = self.lock()?;
        self.check_handle(handle)?;
        op.validate(&self.cfg)?;
        inner.nothing_pending()?;
        let d = &op.dispatch;
        check_pointers(contract::DISPATCH, d, &d.facts(), &*inner.backend)?;
        check_pointers(
            contract::MEGA,
            &op.gemm,
            &op.gemm.facts(false),
            &*inner.backend,
        )?;
        inner.check_stream(stream)?;
        inner
            .backend
            .check_inputs(Inputs::Dispatch(d, &handle.state))?;
        inner.backend.check_supported(Collective::MegaDispatch)?;

        let call = inner.next_call(Collective::MegaDispatch, 0);
        handle.dispatch = None;
        inner
            .backend
            .mega_dispatch_gemm(call, op, &mut handle.state, stream)?;
        handle.dispatch = Some(DispatchRecord::fused(call.number, d));
        Ok(())
    }

    /// `ep_mega_gemm_combine`: checked as an expert-major combine of the
    /// handle's dispatch (whose rows the host may not know: its input rows
    /// are required) plus the GEMM's values and pointers.
    pub fn mega_gemm_combine(
        &self,
        op: &MegaCombineOp,
        handle: &Handle,
        stream: Stream,
    ) -> Result<()> {
        let mut inner = self.lock()?;
        self.check_handle(handle)?;
        op.validate(&self.cfg)?;
        let d = combined_dispatch(&op.combine, handle)?;
        inner.nothing_pending()?;
        let facts = Facts {
            tokens: d.num_tokens > 0,
            rows: true,
            ..Facts::default()
        };
        check_pointers(contract::COMBINE, &op.combine, &facts, &*inner.backend)?;
        check_pointers(
            contract::MEGA,
            &op.gemm,
            &op.gemm.facts(true),
            &*inner.backend,
        )?;
        // The combine sums the GEMM's output rows `y`.
        let rows = d.received.map(|r| r.expert_rows);
        op.combine
            .check_disjoint("y", op.gemm.y, rows, d.num_tokens, self.bf16_row_bytes())?;
        inner.check_stream(stream)?;
        inner.backend.check_supported(Collective::MegaCombine)?;
        let call = inner.next_call(Collective::MegaCombine, d.call);
        inner
            .backend
            .mega_gemm_combine(call, op, &handle.state, stream)
    }

    /// `ep_moe_forward`: checked as a fused dispatch (values, the
    /// dispatch's pointer table, the backend's checks of its inputs), plus
    /// the combine's `out` (for the dispatch's tokens), the experts' values
    /// and pointers (`MOE`), all before anything is communicated or
    /// enqueued. It makes two collective calls, numbered one after the
    /// other; the handle records the first as a dispatch that did not tell
    /// the host its rows, once both have been made.
    pub fn moe_forward(&self, op: &MoeOp, handle: &mut Handle, stream: Stream) -> Result<()> {
        let mut inner = self.lock()?;
        self.check_handle(handle)?;
        op.validate(&self.cfg)?;
        inner.nothing_pending()?;
        let d = &op.dispatch;
        check_pointers(contract::DISPATCH, d, &d.facts(), &*inner.backend)?;
        // Only the combine's `out` is used: its `x` is not read.
        let combine = CombineOp {
            x: std::ptr::null(),
            ..op.combine
        };
        let facts = Facts {
            tokens: d.num_tokens > 0,
            ..Facts::default()
        };
        check_pointers(contract::COMBINE, &combine, &facts, &*inner.backend)?;
        let experts = &op.experts;
        check_pointers(contract::MOE, experts, &experts.facts(), &*inner.backend)?;
        // The combine sums the down GEMM's rows `y2`, whose count the host
        // does not learn (the dispatch is fused).
        combine.check_disjoint("y2", experts.y2, None, d.num_tokens, self.bf16_row_bytes())?;
        inner.check_stream(stream)?;
        inner
            .backend
            .check_inputs(Inputs::Dispatch(d, &handle.state))?;
        inner.backend.check_supported(Collective::MoeDispatch)?;

        let first = inner.next_call(Collective::MoeDispatch, 0);
        let second = inner.next_call(Collective::MoeCombine, first.number);
        handle.dispatch = None;
        inner
            .backend
            .moe_forward([first, second], op, &mut handle.state, stream)?;
        handle.dispatch = Some(DispatchRecord::fused(first.number, d));
        Ok(())
    }
}

/// The dispatch a combine returns rows of: the handle's, which must have
/// produced the combine's input layout.
fn combined_dispatch(op: &CombineOp, handle: &Handle) -> Result<DispatchRecord> {
    let d = handle.dispatch.ok_or_else(|| {
        Error::invalid("the handle holds no layout: pass the handle of a successful ep_dispatch")
    })?;
    let (produced, layout, output) = if op.expert_major {
        (
            d.expert_major,
            "EP_COMBINE_EXPERT_MAJOR",
            "expert-major (expert_x)",
        )
    } else {
        (
            d.source_order,
            "EP_COMBINE_SOURCE_ORDER",
            "source-order (recv_x)",
        )
    };
    if !produced {
        return Err(Error::invalid(format!(
            "input_layout {layout}, but the handle's dispatch (call #{}) produced no {output} output",
            d.call
        )));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::Dtype;
    use crate::runtime::backend::HandleState;
    use crate::runtime::config::ConfigRequest;
    use crate::runtime::contract::{Field, PointerCheck};
    use crate::runtime::ops::Received;
    use std::os::raw::c_void;
    use std::panic::{catch_unwind, AssertUnwindSafe};

    /// A backend whose next layout call panics, as a bug would.
    struct Buggy {
        panic_next: bool,
    }

    impl PointerCheck for Buggy {
        fn check_pointer(&self, _field: &Field, _ptr: *const c_void) -> Result<()> {
            Ok(())
        }
    }

    fn not_here<T>() -> Result<T> {
        Err(Error::unsupported("not in this test"))
    }

    impl Backend for Buggy {
        fn check_stream(&self, _stream: Stream) -> Result<()> {
            Ok(())
        }
        fn check_inputs(&mut self, _inputs: Inputs<'_>) -> Result<()> {
            Ok(())
        }
        fn layout(&mut self, _op: &LayoutOp, _stream: Stream) -> Result<()> {
            if std::mem::take(&mut self.panic_next) {
                panic!("a bug in a backend");
            }
            Ok(())
        }
        fn new_handle_state(&mut self) -> Result<HandleState> {
            not_here()
        }
        fn dispatch(
            &mut self,
            _: Call,
            _: &DispatchOp,
            _: &mut HandleState,
            _: Stream,
        ) -> Result<Option<Received>> {
            not_here()
        }
        fn combine(&mut self, _: Call, _: &CombineOp, _: &HandleState, _: Stream) -> Result<()> {
            not_here()
        }
        fn mega_dispatch_gemm(
            &mut self,
            _: Call,
            _: &MegaDispatchOp,
            _: &mut HandleState,
            _: Stream,
        ) -> Result<()> {
            not_here()
        }
        fn mega_gemm_combine(
            &mut self,
            _: Call,
            _: &MegaCombineOp,
            _: &HandleState,
            _: Stream,
        ) -> Result<()> {
            not_here()
        }
        fn moe_forward(
            &mut self,
            _: [Call; 2],
            _: &MoeOp,
            _: &mut HandleState,
            _: Stream,
        ) -> Result<()> {
            not_here()
        }
        fn ll_dispatch(&mut self, _: Call, _: &LlDispatchOp, _: Stream) -> Result<()> {
            not_here()
        }
        fn ll_combine(&mut self, _: Call, _: &LlCombineOp, _: Stream) -> Result<()> {
            not_here()
        }
        fn ll_combine_buffer(&mut self) -> Result<(*mut u8, usize)> {
            not_here()
        }
    }

    struct Quiet;

    impl Monitor for Quiet {
        fn async_error(&self) -> Result<()> {
            Ok(())
        }
        fn abort(&self) {}
    }

    #[test]
    fn a_panic_in_a_call_does_not_poison_the_context() {
        let cfg = Config::new(&ConfigRequest {
            world: 1,
            rank: 0,
            device: 0,
            max_tokens_per_rank: 8,
            hidden: 128,
            topk: 1,
            num_experts: 2,
            token_dtype: Dtype::Bf16,
            backend: BackendKind::Host,
            num_sms: 0,
            timeout_ms: 1000,
            ll_max_tokens_per_rank: 0,
            ranks_per_node: 0,
        })
        .unwrap();
        let ctx = Context {
            id: 0,
            cfg,
            inner: Mutex::new(Inner {
                backend: Box::new(Buggy { panic_next: true }),
                calls: 0,
                ll_dispatch: None,
                pending: None,
            }),
            monitor: Arc::new(Quiet),
        };
        let (mut per_rank, mut per_expert) = ([0i32; 1], [0i32; 2]);
        let op = LayoutOp {
            num_tokens: 0,
            topk_idx: std::ptr::null(),
            tokens_per_rank: per_rank.as_mut_ptr(),
            tokens_per_expert: per_expert.as_mut_ptr(),
            is_token_in_rank: std::ptr::null_mut(),
        };
        let first = catch_unwind(AssertUnwindSafe(|| ctx.layout(&op, std::ptr::null_mut())));
        assert!(first.is_err(), "the bug did not panic");
        assert_eq!(ctx.layout(&op, std::ptr::null_mut()), Ok(()));
    }
}
