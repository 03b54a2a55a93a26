//! The contract walks, for any backend and memory:
//! - [`walk_nulls`] sets each pointer of a call to NULL in turn and expects
//!   what the runtime's contract table says: `EP_ERR_NULL_POINTER` naming
//!   the field with nothing written for a required pointer, success and the
//!   reference result (with nothing written through the NULL) for an
//!   optional one;
//! - [`walk_bad`] makes each call with one bad value (counts, struct
//!   headers, flags, expert ids, misaligned pointers) and expects its status
//!   and message.
//!
//! After every call, a correct call must still work and give the reference
//! result. Every rank runs the same walk with the same facts, so a call that
//! fails its local checks fails on every rank and the ranks stay in step.

use super::calls::*;
use super::gpu::gate;
use super::{last_error, Ctx, Handle};
use ep::capi::*;
use ep::reference::normal;
use ep::runtime::contract::{self, Facts, Field};

/// A call's pointers, whatever its args struct.
pub trait Pointers {
    fn is_set(&mut self, name: &str) -> bool;
    fn null(&mut self, name: &str);
    fn restore(&mut self);
    fn poison(&self);
    fn untouched(&self) -> bool;
}

impl<A: PointerFields> Pointers for Call<'_, A> {
    fn is_set(&mut self, name: &str) -> bool {
        Call::is_set(self, name)
    }
    fn null(&mut self, name: &str) {
        Call::null(self, name)
    }
    fn restore(&mut self) {
        Call::restore(self)
    }
    fn poison(&self) {
        Call::poison(self)
    }
    fn untouched(&self) -> bool {
        Call::untouched(self)
    }
}

/// An operation under test: one call of one rank, made of one or two
/// halves (`EP_LL_SEND_ONLY` then `EP_LL_RECV_ONLY`).
pub trait Op {
    fn label(&self) -> String;
    /// The C function, which every message names.
    fn function(&self) -> &'static str;
    /// The runtime's rules for its pointers.
    fn fields(&self) -> Vec<Field>;
    /// The facts of each half, as this test states them.
    fn phases(&self) -> Vec<Facts>;
    fn pointers(&mut self) -> &mut dyn Pointers;
    /// Makes what the call needs first (a dispatch before a combine).
    fn prepare(&mut self, ctx: &Ctx);
    fn run(&mut self, ctx: &Ctx, phase: usize) -> ep_status_t;
    /// Compares the outputs with the reference.
    fn check(&mut self) -> Result<(), String>;
    /// The status of a correct call.
    fn success(&self) -> ep_status_t {
        EP_SUCCESS
    }
}

/// Prepares a correct call with its arguments as built and its outputs
/// poisoned, then makes it ([`run_correct`]).
pub fn correct_call(op: &mut dyn Op, ctx: &Ctx, what: &str) {
    op.pointers().restore();
    op.prepare(ctx);
    op.pointers().poison();
    run_correct(op, ctx, what);
}

/// Makes a prepared correct call: every half ends in `op.success()` and the
/// outputs are the reference's. `what` (which names the call) starts every
/// failure message.
pub fn run_correct(op: &mut dyn Op, ctx: &Ctx, what: &str) {
    for phase in 0..op.phases().len() {
        let status = op.run(ctx, phase);
        assert_eq!(status, op.success(), "{what}: {}", last_error());
    }
    if let Err(e) = op.check() {
        panic!("{what}: {e}");
    }
}

/// Asserts `status` and that the last error names `function` and contains
/// every needle.
#[track_caller]
pub fn expect_error(
    status: ep_status_t,
    want: ep_status_t,
    function: &str,
    needles: &[&str],
    what: &str,
) {
    let msg = last_error();
    assert_eq!(status, want, "{what}: status {status}, message {msg:?}");
    assert!(
        msg.starts_with(&format!("{function}: ")),
        "{what}: the message does not name {function}: {msg:?}"
    );
    for needle in needles {
        assert!(
            msg.contains(needle),
            "{what}: the message lacks {needle:?}: {msg:?}"
        );
    }
}

/// Asserts that a call with `field` NULL was refused for it.
#[track_caller]
pub fn expect_null(status: ep_status_t, function: &str, field: &str, what: &str) {
    let needle = format!("`{field}` is NULL");
    expect_error(status, EP_ERR_NULL_POINTER, function, &[&needle], what);
}

/// Sets each pointer that `op` passes to NULL in turn (see the module doc).
pub fn walk_nulls(op: &mut dyn Op, ctx: &Ctx, rank: usize) {
    // Rank threads on one GPU meet before their first call and after their
    // last (tests/common/gpu.rs): the handles of the operations are freed
    // between the walks.
    gate();
    let phases = op.phases();
    for field in op.fields() {
        if !op.pointers().is_set(field.name) {
            continue;
        }
        let what = format!("rank {rank}: {} with `{}` NULL", op.label(), field.name);
        op.pointers().restore();
        op.prepare(ctx);
        op.pointers().null(field.name);
        op.pointers().poison();
        let mut refused = None;
        for (phase, facts) in phases.iter().enumerate() {
            let status = op.run(ctx, phase);
            if field.required(facts) {
                expect_null(status, op.function(), field.name, &what);
                assert!(op.pointers().untouched(), "{what}: an output was written");
                refused = Some(phase);
                break;
            }
            assert_eq!(
                status,
                op.success(),
                "{what} (half {phase}): {}",
                last_error()
            );
        }
        match refused {
            // The refused half again, correctly: a split call's receive
            // half is still due.
            Some(phase) => {
                op.pointers().restore();
                for rest in phase..phases.len() {
                    let status = op.run(ctx, rest);
                    assert_eq!(
                        status,
                        op.success(),
                        "{what}, then correct: {}",
                        last_error()
                    );
                }
                op.check()
                    .unwrap_or_else(|e| panic!("{what}, then correct: {e}"));
            }
            None => op.check().unwrap_or_else(|e| panic!("{what}: {e}")),
        }
        let again = format!("rank {rank}: {} after `{}` NULL", op.label(), field.name);
        correct_call(op, ctx, &again);
    }
    gate();
}

/// One bad input of an operation `T`.
pub struct Bad<'a, T: ?Sized> {
    pub what: &'static str,
    pub apply: Box<dyn Fn(&mut T) + 'a>,
    pub status: ep_status_t,
    pub needles: Vec<String>,
    /// Found by the host backend reading the caller's arrays; the GPU
    /// backend reports it from the device instead.
    pub host_only: bool,
}

impl<'a, T: ?Sized> Bad<'a, T> {
    pub fn new(
        what: &'static str,
        apply: impl Fn(&mut T) + 'a,
        status: ep_status_t,
        needles: &[&str],
    ) -> Bad<'a, T> {
        Bad {
            what,
            apply: Box::new(apply),
            status,
            needles: needles.iter().map(|n| n.to_string()).collect(),
            host_only: false,
        }
    }

    pub fn host_only(mut self) -> Self {
        self.host_only = true;
        self
    }
}

/// Makes `op`'s call with each bad input (its first half), expects its
/// status and message and no output written, then a correct call.
pub fn walk_bad<T: Op>(op: &mut T, bads: &[Bad<'_, T>], ctx: &Ctx, rank: usize, host: bool) {
    gate();
    for bad in bads.iter().filter(|b| host || !b.host_only) {
        let what = format!("rank {rank}: {} with {}", op.label(), bad.what);
        op.pointers().restore();
        op.prepare(ctx);
        op.pointers().poison();
        (bad.apply)(op);
        let status = op.run(ctx, 0);
        let needles: Vec<&str> = bad.needles.iter().map(|s| s.as_str()).collect();
        expect_error(status, bad.status, op.function(), &needles, &what);
        assert!(op.pointers().untouched(), "{what}: an output was written");
        let again = format!("rank {rank}: {} after {}", op.label(), bad.what);
        correct_call(op, ctx, &again);
    }
    gate();
}

fn facts_of_tokens(n: usize) -> Facts {
    Facts {
        tokens: n > 0,
        ..Facts::default()
    }
}

/// `ep_get_dispatch_layout`.
pub struct LayoutOp<'m> {
    pub call: LayoutCall<'m>,
    n: usize,
}

impl<'m> LayoutOp<'m> {
    pub fn new(mem: &'m dyn Mem, shape: &Shape, tokens: &Tokens, rank: usize) -> Self {
        let mut call = LayoutCall::new(mem, shape, &tokens.idx[rank], tokens.n[rank]);
        call.call.save();
        LayoutOp {
            call,
            n: tokens.n[rank],
        }
    }
}

impl Op for LayoutOp<'_> {
    fn label(&self) -> String {
        format!("layout of {} tokens", self.n)
    }
    fn function(&self) -> &'static str {
        "ep_get_dispatch_layout"
    }
    fn fields(&self) -> Vec<Field> {
        contract::fields(contract::LAYOUT).copied().collect()
    }
    fn phases(&self) -> Vec<Facts> {
        vec![facts_of_tokens(self.n)]
    }
    fn pointers(&mut self) -> &mut dyn Pointers {
        &mut self.call.call
    }
    fn prepare(&mut self, _ctx: &Ctx) {}
    fn run(&mut self, ctx: &Ctx, _phase: usize) -> ep_status_t {
        self.call.run(ctx)
    }
    fn check(&mut self) -> Result<(), String> {
        self.call.check()
    }
}

fn dispatch_facts(case: &DispatchCase, n: usize, fp8: bool) -> Facts {
    Facts {
        tokens: n > 0,
        fp8,
        source_order: case.source_order,
        expert_major: case.expert_major,
        ..Facts::default()
    }
}

/// `ep_dispatch`.
pub struct DispatchOp<'m> {
    pub call: DispatchCall<'m>,
    pub handle: Handle,
    n: usize,
    fp8: bool,
}

impl<'m> DispatchOp<'m> {
    pub fn new(
        mem: &'m dyn Mem,
        ctx: &Ctx,
        shape: &Shape,
        tokens: &Tokens,
        rank: usize,
        case: DispatchCase,
    ) -> Self {
        let mut call = DispatchCall::new(mem, shape, tokens, rank, case);
        call.call.save();
        DispatchOp {
            call,
            handle: ctx.handle(),
            n: tokens.n[rank],
            fp8: tokens.fp8,
        }
    }
}

impl Op for DispatchOp<'_> {
    fn label(&self) -> String {
        let c = &self.call.case;
        format!(
            "dispatch of {} {} tokens (source order {}, expert-major {})",
            self.n,
            if self.fp8 { "FP8" } else { "BF16" },
            c.source_order,
            c.expert_major
        )
    }
    fn function(&self) -> &'static str {
        "ep_dispatch"
    }
    fn fields(&self) -> Vec<Field> {
        contract::fields(contract::DISPATCH).copied().collect()
    }
    fn phases(&self) -> Vec<Facts> {
        vec![dispatch_facts(&self.call.case, self.n, self.fp8)]
    }
    fn pointers(&mut self) -> &mut dyn Pointers {
        &mut self.call.call
    }
    fn prepare(&mut self, _ctx: &Ctx) {}
    fn run(&mut self, ctx: &Ctx, _phase: usize) -> ep_status_t {
        self.call.run(ctx, self.handle.0)
    }
    fn check(&mut self) -> Result<(), String> {
        self.call.check()
    }
}

/// `ep_combine` in one layout, after a dispatch with both outputs.
pub struct CombineOp<'m> {
    pub dispatch: DispatchCall<'m>,
    pub call: CombineCall<'m>,
    pub handle: Handle,
    expert_major: bool,
    facts: Facts,
    tolerance: f32,
}

impl<'m> CombineOp<'m> {
    pub fn new(
        mem: &'m dyn Mem,
        ctx: &Ctx,
        shape: &Shape,
        tokens: &Tokens,
        rank: usize,
        seed: u64,
        expert_major: bool,
    ) -> Self {
        let case = both(4);
        let dispatch = DispatchCall::new(mem, shape, tokens, rank, case);
        let all: Vec<_> = (0..shape.world)
            .map(|r| tokens.dispatched(shape, r, case.alignment))
            .collect();
        let n = tokens.n[rank];
        let mut call = CombineCall::new(mem, shape, rank, n, &all, seed, expert_major);
        call.call.save();
        let d = &all[rank];
        let rows = if expert_major {
            d.expert_rows
        } else {
            d.num_rows
        };
        CombineOp {
            dispatch,
            call,
            handle: ctx.handle(),
            expert_major,
            facts: Facts {
                tokens: n > 0,
                rows: rows > 0,
                ..Facts::default()
            },
            tolerance: mem.combine_tolerance(),
        }
    }
}

impl Op for CombineOp<'_> {
    fn label(&self) -> String {
        let layout = if self.expert_major {
            "expert-major"
        } else {
            "source-order"
        };
        format!("{layout} combine ({:?})", self.facts)
    }
    fn function(&self) -> &'static str {
        "ep_combine"
    }
    fn fields(&self) -> Vec<Field> {
        contract::fields(contract::COMBINE).copied().collect()
    }
    fn phases(&self) -> Vec<Facts> {
        vec![self.facts]
    }
    fn pointers(&mut self) -> &mut dyn Pointers {
        &mut self.call.call
    }
    fn prepare(&mut self, ctx: &Ctx) {
        let status = self.dispatch.run(ctx, self.handle.0);
        assert_eq!(
            status,
            EP_SUCCESS,
            "dispatch before a combine: {}",
            last_error()
        );
    }
    fn run(&mut self, ctx: &Ctx, _phase: usize) -> ep_status_t {
        self.call.run(ctx, self.handle.0)
    }
    fn check(&mut self) -> Result<(), String> {
        self.call.check(self.tolerance)
    }
}

fn ll_facts(split: bool, base: Facts) -> Vec<Facts> {
    if split {
        vec![Facts { send: true, ..base }, Facts { recv: true, ..base }]
    } else {
        vec![Facts {
            send: true,
            recv: true,
            ..base
        }]
    }
}

/// `ep_ll_dispatch`.
pub struct LlDispatchOp<'m> {
    pub call: LlDispatchCall<'m>,
    n: usize,
}

impl<'m> LlDispatchOp<'m> {
    pub fn new(
        mem: &'m dyn Mem,
        shape: &Shape,
        tokens: &LlTokens,
        rank: usize,
        case: LlDispatchCase,
    ) -> Self {
        let mut call = LlDispatchCall::new(mem, shape, tokens, rank, case);
        call.call.save();
        LlDispatchOp {
            call,
            n: tokens.n[rank],
        }
    }
}

impl Op for LlDispatchOp<'_> {
    fn label(&self) -> String {
        format!(
            "low-latency dispatch of {} tokens {:?}",
            self.n, self.call.case
        )
    }
    fn function(&self) -> &'static str {
        "ep_ll_dispatch"
    }
    fn fields(&self) -> Vec<Field> {
        contract::fields(contract::LL_DISPATCH).copied().collect()
    }
    fn phases(&self) -> Vec<Facts> {
        let base = Facts {
            tokens: self.n > 0,
            fp8: self.call.case.fp8,
            ..Facts::default()
        };
        ll_facts(self.call.case.split, base)
    }
    fn pointers(&mut self) -> &mut dyn Pointers {
        &mut self.call.call
    }
    fn prepare(&mut self, _ctx: &Ctx) {}
    fn run(&mut self, ctx: &Ctx, phase: usize) -> ep_status_t {
        self.call.run(ctx, phase)
    }
    fn check(&mut self) -> Result<(), String> {
        self.call.check()
    }
}

/// `ep_ll_combine`, after a low-latency dispatch.
pub struct LlCombineOp<'m> {
    pub dispatch: LlDispatchCall<'m>,
    pub call: LlCombineCall<'m>,
    mem: &'m dyn Mem,
    n: usize,
}

impl<'m> LlCombineOp<'m> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        mem: &'m dyn Mem,
        shape: &Shape,
        tokens: &LlTokens,
        rank: usize,
        seed: u64,
        dispatch_case: LlDispatchCase,
        case: LlCombineCase,
    ) -> Self {
        let dispatch = LlDispatchCall::new(mem, shape, tokens, rank, dispatch_case);
        let all: Vec<_> = (0..shape.world)
            .map(|r| tokens.dispatched(shape, r, &dispatch_case))
            .collect();
        let mut call = LlCombineCall::new(mem, shape, tokens, &all, rank, seed, case);
        call.call.save();
        LlCombineOp {
            dispatch,
            call,
            mem,
            n: tokens.n[rank],
        }
    }
}

impl Op for LlCombineOp<'_> {
    fn label(&self) -> String {
        format!(
            "low-latency combine of {} tokens {:?} after {:?}",
            self.n, self.call.case, self.dispatch.case
        )
    }
    fn function(&self) -> &'static str {
        "ep_ll_combine"
    }
    fn fields(&self) -> Vec<Field> {
        contract::fields(contract::LL_COMBINE).copied().collect()
    }
    fn phases(&self) -> Vec<Facts> {
        let base = Facts {
            tokens: self.n > 0,
            zero_copy: self.call.case.zero_copy,
            unweighted: !self.dispatch.case.weights,
            ..Facts::default()
        };
        ll_facts(self.call.case.split, base)
    }
    fn pointers(&mut self) -> &mut dyn Pointers {
        &mut self.call.call
    }
    fn prepare(&mut self, ctx: &Ctx) {
        let status = self.dispatch.run_all(ctx);
        assert_eq!(
            status,
            EP_SUCCESS,
            "dispatch before a combine: {}",
            last_error()
        );
        self.call.fill_combine_buffer(ctx, self.mem);
    }
    fn run(&mut self, ctx: &Ctx, phase: usize) -> ep_status_t {
        self.call.run(ctx, phase)
    }
    fn check(&mut self) -> Result<(), String> {
        self.call.check(self.mem.combine_tolerance())
    }
}

/// `ep_mega_dispatch_gemm` or `ep_mega_gemm_combine` with zero weights (the
/// GEMM's values are tested by tests/host_mega.rs and tests/gpu_mega.rs):
/// the dispatch half's outputs as `ep_dispatch`'s, `y` and the combined
/// tokens all zeros.
pub struct MegaOp<'m> {
    pub call: Call<'m, MegaArgs>,
    pub handle: Handle,
    /// The dispatch a combine combines, run by `prepare`.
    before: Option<DispatchCall<'m>>,
    /// The dispatch half's reference.
    want: Option<normal::Dispatched>,
    /// Rows of `y` the call writes: (start, len) in bytes.
    y_rows: Vec<(usize, usize)>,
    facts: Facts,
    /// `Mem::fused_status`.
    success: ep_status_t,
}

/// Args of a BF16 GEMM of `n` x `k` with its half set (the combine's when
/// `combine`, else the dispatch's).
fn gemm_args(combine: bool, n: usize, k: usize) -> MegaArgs {
    let mut args = super::mega_args();
    args.weight_dtype = EP_DTYPE_BF16;
    args.n = n as i32;
    args.k = k as i32;
    if combine {
        args.combine = MegaArgs::marker();
    } else {
        args.dispatch = MegaArgs::marker();
    }
    MegaArgs {
        args,
        dispatch: super::dispatch_args(),
        combine: super::combine_args(),
        is_combine: combine,
    }
}

/// The GEMM's zero weights and its output `y` of `capacity` rows.
fn gemm_buffers(call: &mut Call<'_, MegaArgs>, shape: &Shape, capacity: usize) {
    let (n, k) = (call.args.args.n as usize, call.args.args.k as usize);
    call.input("weights", &vec![0u16; shape.local() * n * k]);
    call.output("y", capacity * n * 2);
}

/// Byte ranges of the real rows of `d`'s expert-major order, `row` bytes each.
fn real_rows(d: &normal::Dispatched, row: usize) -> Vec<(usize, usize)> {
    (0..d.expert_counts.len())
        .map(|e| {
            let start = d.expert_offsets[e] as usize;
            (start * row, d.expert_counts[e] as usize * row)
        })
        .collect()
}

impl<'m> MegaOp<'m> {
    /// The dispatch half with `tokens` (BF16), both outputs, then a GEMM
    /// with n = 128.
    pub fn dispatch(
        mem: &'m dyn Mem,
        ctx: &Ctx,
        shape: &Shape,
        tokens: &Tokens,
        rank: usize,
    ) -> Self {
        assert!(!tokens.fp8, "the walk's fused dispatch is BF16");
        let case = DispatchCase {
            no_host_sync: true,
            ..both(1)
        };
        let dispatch = DispatchCall::new(mem, shape, tokens, rank, case);
        let capacity = dispatch.call.args.expert_capacity as usize;
        let n = 128;
        let want = dispatch.want.clone();
        // Padding rows between experts get zeros too.
        let y_rows = vec![(0, want.expert_rows * n * 2)];
        let mut args = gemm_args(false, n, shape.hidden);
        args.dispatch = dispatch.call.args;
        let mut call = dispatch.call.into_args(args);
        gemm_buffers(&mut call, shape, capacity);
        let facts = dispatch_facts(&case, tokens.n[rank], false);
        MegaOp::new(mem, ctx, call, None, Some(want), y_rows, facts)
    }

    /// The combine half, expert-major, of a BF16 dispatch of `tokens`: a
    /// GEMM with k = 128 and n = hidden.
    pub fn combine(
        mem: &'m dyn Mem,
        ctx: &Ctx,
        shape: &Shape,
        tokens: &Tokens,
        rank: usize,
    ) -> Self {
        let before = DispatchCall::new(mem, shape, tokens, rank, both(4));
        let capacity = before.call.args.expert_capacity as usize;
        let (n, k) = (shape.hidden, 128);
        let mut args = gemm_args(true, n, k);
        args.combine.input_layout = EP_COMBINE_EXPERT_MAJOR;
        let mut call = Call::new(mem, args);
        let mut rng = super::Rng::new(0x3e6a ^ rank as u64);
        call.input("x", &super::random_bf16(&mut rng, capacity * k));
        call.output("out", tokens.n[rank] * shape.hidden * 2);
        gemm_buffers(&mut call, shape, capacity);
        let y_rows = real_rows(&before.want, n * 2);
        let facts = Facts {
            tokens: tokens.n[rank] > 0,
            rows: true,
            fused_combine: true,
            ..Facts::default()
        };
        MegaOp::new(mem, ctx, call, Some(before), None, y_rows, facts)
    }

    fn new(
        mem: &'m dyn Mem,
        ctx: &Ctx,
        mut call: Call<'m, MegaArgs>,
        before: Option<DispatchCall<'m>>,
        want: Option<normal::Dispatched>,
        y_rows: Vec<(usize, usize)>,
        facts: Facts,
    ) -> Self {
        call.save();
        MegaOp {
            call,
            handle: ctx.handle(),
            before,
            want,
            y_rows,
            facts,
            success: mem.fused_status(),
        }
    }

    /// Whether every byte of `ranges` of output `name` (when passed) is 0.
    fn zeros(&mut self, name: &str, ranges: &[(usize, usize)]) -> Result<(), String> {
        let end = ranges.iter().map(|(s, l)| s + l).max().unwrap_or(0);
        self.call.expect_rows(name, &vec![0; end], ranges)
    }
}

impl Op for MegaOp<'_> {
    fn label(&self) -> String {
        format!("{} ({:?})", self.function(), self.facts)
    }
    fn function(&self) -> &'static str {
        if self.call.args.is_combine {
            "ep_mega_gemm_combine"
        } else {
            "ep_mega_dispatch_gemm"
        }
    }
    fn fields(&self) -> Vec<Field> {
        let combine = self.call.args.is_combine;
        let half: Vec<Field> = if combine {
            contract::fields(contract::COMBINE).copied().collect()
        } else {
            // The GEMM multiplies the expert-major rows, found through
            // their source rows: both are required.
            contract::fields(contract::DISPATCH)
                .map(|f| match f.name {
                    "expert_x" | "expert_src_row" => Field {
                        need: contract::Need::Always,
                        ..*f
                    },
                    _ => *f,
                })
                .collect()
        };
        let own = contract::fields(contract::MEGA)
            .filter(|f| combine || f.name != "x_scales")
            .copied();
        half.into_iter().chain(own).collect()
    }
    fn phases(&self) -> Vec<Facts> {
        vec![self.facts]
    }
    fn pointers(&mut self) -> &mut dyn Pointers {
        &mut self.call
    }
    fn prepare(&mut self, ctx: &Ctx) {
        if let Some(before) = &mut self.before {
            let status = before.run(ctx, self.handle.0);
            assert_eq!(
                status,
                EP_SUCCESS,
                "dispatch before a fused combine: {}",
                last_error()
            );
        }
    }
    fn run(&mut self, ctx: &Ctx, _phase: usize) -> ep_status_t {
        let (args, handle, stream) = (self.call.args.c_args(), self.handle.0, self.call.stream());
        // SAFETY: live context and handle; buffers as the API says.
        unsafe {
            if self.call.args.is_combine {
                ep_mega_gemm_combine(ctx.0, &args, handle, stream)
            } else {
                ep_mega_dispatch_gemm(ctx.0, &args, handle, stream)
            }
        }
    }
    fn check(&mut self) -> Result<(), String> {
        if self.success != EP_SUCCESS {
            return match self.call.untouched() {
                true => Ok(()),
                false => Err("an unsupported fused call wrote an output".to_string()),
            };
        }
        if let Some(want) = &self.want {
            check_dispatched(&mut self.call, want, true)?;
        }
        let y_rows = self.y_rows.clone();
        self.zeros("y", &y_rows)?;
        if self.call.args.is_combine {
            let bytes = self.call.buf("out").len();
            // Only the real tokens' bytes (the buffer has at least 16).
            let used = (self.facts.tokens as usize) * bytes;
            let got: Vec<u16> = from_bytes(&self.call.buf("out").read());
            if self.call.is_set("out") && got[..used / 2].iter().any(|&v| v & 0x7fff != 0) {
                return Err("`out` is not all zeros".to_string());
            }
        }
        Ok(())
    }
    fn success(&self) -> ep_status_t {
        self.success
    }
}

const INVALID: ep_status_t = EP_ERR_INVALID_ARGUMENT;

/// A struct header made bad in the ways every versioned struct is checked.
macro_rules! header_bads {
    ($op:ty, |$o:ident| $args:expr, $min:expr, $size:expr, $name:expr) => {
        vec![
            Bad::new(
                "struct_size below the minimum",
                move |$o: &mut $op| $args.struct_size = $min - 4,
                INVALID,
                &[$name, "struct_size"],
            ),
            Bad::new(
                "struct_size above this release's",
                move |$o: &mut $op| $args.struct_size = $size + 8,
                INVALID,
                &[$name, "struct_size"],
            ),
            Bad::new(
                "a bad magic",
                move |$o: &mut $op| $args.magic ^= 0x0101_0101,
                INVALID,
                &[$name, "bad magic"],
            ),
            Bad::new(
                "version 0",
                move |$o: &mut $op| $args.version = 0,
                INVALID,
                &[$name, "version is 0"],
            ),
        ]
    };
}

/// A token count above the configured `max`, and a negative one, set by
/// `set`.
fn bad_counts<'a, T: Op + 'a>(max: usize, set: fn(&mut T, i32)) -> Vec<Bad<'a, T>> {
    let max = max as i32;
    let above = format!(
        "num_tokens = {} is above the configured maximum {max}",
        max + 1
    );
    vec![
        Bad::new(
            "num_tokens above the maximum",
            move |o: &mut T| set(o, max + 1),
            INVALID,
            &[&above],
        ),
        Bad::new(
            "a negative num_tokens",
            move |o: &mut T| set(o, -1),
            INVALID,
            &["num_tokens = -1 is negative"],
        ),
    ]
}

/// Points an operation's `topk_idx` to a changed copy of its routing.
type ReplaceRouting<T> = fn(&mut T, &dyn Fn(&mut Vec<i32>));

/// Bad routing: an id out of range, a negative id other than -1, and (with
/// topk > 1) an expert listed twice for token 0.
fn bad_routing<'a, T: Op + 'a>(shape: &Shape, replace: ReplaceRouting<T>) -> Vec<Bad<'a, T>> {
    let e = shape.experts as i32;
    let mut bads = vec![
        Bad::new(
            "an expert id out of range",
            move |o: &mut T| replace(o, &|idx| idx[0] = e),
            INVALID,
            &[&format!("topk_idx[0][0] = {e} is not an expert id")],
        )
        .host_only(),
        Bad::new(
            "a negative expert id",
            move |o: &mut T| replace(o, &|idx| idx[0] = -2),
            INVALID,
            &["topk_idx[0][0] = -2 is not an expert id"],
        )
        .host_only(),
    ];
    if shape.topk > 1 {
        bads.push(
            Bad::new(
                "an expert listed twice for one token",
                move |o: &mut T| {
                    replace(o, &|idx| {
                        idx[0] = 0;
                        idx[1] = 0;
                    })
                },
                INVALID,
                &["topk_idx[0][1] = 0 is listed twice"],
            )
            .host_only(),
        );
    }
    bads
}

/// Routing that differs from `idx` in one slot and is still valid.
pub fn other_routing(idx: &mut [i32]) {
    match idx.iter().position(|&id| id >= 0) {
        Some(at) => idx[at] = -1,
        None => idx[0] = 0,
    }
}

/// Bad inputs of `ep_get_dispatch_layout` (`max` tokens per rank).
pub fn bad_layout<'m>(shape: &Shape) -> Vec<Bad<'m, LayoutOp<'m>>> {
    let mut bads = bad_counts(shape.max_tokens, |o: &mut LayoutOp<'m>, n| {
        o.call.call.args.num_tokens = n
    });
    bads.extend([Bad::new(
        "a misaligned topk_idx",
        |o: &mut LayoutOp<'m>| o.call.call.offset("topk_idx", 2),
        INVALID,
        &["`topk_idx`", "is not 4-byte aligned"],
    )]);
    bads.extend(bad_routing(shape, |o: &mut LayoutOp<'m>, f| {
        o.call.call.replace("topk_idx", f)
    }));
    bads
}

/// Bad inputs of `ep_dispatch` (both outputs requested).
pub fn bad_dispatch<'m>(shape: &Shape) -> Vec<Bad<'m, DispatchOp<'m>>> {
    let size = std::mem::size_of::<ep_dispatch_args_t>() as u32;
    let mut bads = header_bads!(
        DispatchOp,
        |o| o.call.call.args,
        EP_DISPATCH_ARGS_MIN_SIZE,
        size,
        "dispatch args"
    );
    bads.extend(bad_counts(shape.max_tokens, |o: &mut DispatchOp<'m>, n| {
        o.call.call.args.num_tokens = n
    }));
    bads.extend([
        Bad::new(
            "an unknown flag",
            |o: &mut DispatchOp<'m>| o.call.call.args.flags |= 0x40,
            INVALID,
            &["unknown dispatch flags"],
        ),
        Bad::new(
            "an unknown dtype",
            |o: &mut DispatchOp<'m>| o.call.call.args.dtype = 9,
            INVALID,
            &["dtype = 9 is not an EP_DTYPE_* value"],
        ),
        Bad::new(
            "expert_alignment 1025",
            |o: &mut DispatchOp<'m>| o.call.call.args.expert_alignment = 1025,
            INVALID,
            &["expert_alignment = 1025 is outside [1, 1024]"],
        ),
        Bad::new(
            "a negative recv_capacity",
            |o: &mut DispatchOp<'m>| o.call.call.args.recv_capacity = -1,
            INVALID,
            &["recv_capacity = -1 is negative"],
        ),
        Bad::new(
            "EP_DISPATCH_NO_HOST_SYNC below the worst case",
            |o: &mut DispatchOp<'m>| {
                o.call.call.args.flags |= EP_DISPATCH_NO_HOST_SYNC;
                o.call.call.args.expert_capacity = 1;
            },
            INVALID,
            &["expert_capacity = 1 is below the worst case"],
        ),
        Bad::new(
            "a misaligned topk_weights",
            |o: &mut DispatchOp<'m>| o.call.call.offset("topk_weights", 1),
            INVALID,
            &["`topk_weights`", "is not 4-byte aligned"],
        ),
        Bad::new(
            "a misaligned expert_offsets",
            |o: &mut DispatchOp<'m>| o.call.call.offset("expert_offsets", 2),
            INVALID,
            &["`expert_offsets`", "is not 4-byte aligned"],
        ),
    ]);
    bads.extend(bad_routing(shape, |o: &mut DispatchOp<'m>, f| {
        o.call.call.replace("topk_idx", f)
    }));
    bads
}

/// Bad inputs of `ep_combine`.
pub fn bad_combine<'m>() -> Vec<Bad<'m, CombineOp<'m>>> {
    let size = std::mem::size_of::<ep_combine_args_t>() as u32;
    let mut bads = header_bads!(
        CombineOp,
        |o| o.call.call.args,
        EP_COMBINE_ARGS_MIN_SIZE,
        size,
        "combine args"
    );
    bads.extend([
        Bad::new(
            "an unknown input_layout",
            |o: &mut CombineOp<'m>| o.call.call.args.input_layout = 7,
            INVALID,
            &["input_layout = 7 is not an EP_COMBINE_* value"],
        ),
        Bad::new(
            "a misaligned x",
            |o: &mut CombineOp<'m>| o.call.call.offset("x", 1),
            INVALID,
            &["`x`", "is not 2-byte aligned"],
        ),
    ]);
    bads
}

/// Bad inputs of `ep_ll_dispatch` (FP8 output).
pub fn bad_ll_dispatch<'m>(shape: &Shape) -> Vec<Bad<'m, LlDispatchOp<'m>>> {
    let size = std::mem::size_of::<ep_ll_dispatch_args_t>() as u32;
    let mut bads = header_bads!(
        LlDispatchOp,
        |o| o.call.call.args,
        EP_LL_DISPATCH_ARGS_MIN_SIZE,
        size,
        "low-latency dispatch args"
    );
    bads.extend(bad_counts(shape.ll_max, |o: &mut LlDispatchOp<'m>, n| {
        o.call.call.args.num_tokens = n
    }));
    bads.extend([
        Bad::new(
            "a misaligned device_num_tokens",
            |o: &mut LlDispatchOp<'m>| o.call.call.offset("device_num_tokens", 1),
            INVALID,
            &["`device_num_tokens`", "is not 4-byte aligned"],
        ),
        Bad::new(
            "an unknown out_dtype",
            |o: &mut LlDispatchOp<'m>| o.call.call.args.out_dtype = 0,
            INVALID,
            &["out_dtype = 0 is not an EP_DTYPE_* value"],
        ),
        Bad::new(
            "a combine-only flag",
            |o: &mut LlDispatchOp<'m>| o.call.call.args.flags = EP_LL_ZERO_COPY,
            INVALID,
            &["unknown low-latency flags 0x8"],
        ),
        Bad::new(
            "EP_LL_SEND_ONLY and EP_LL_RECV_ONLY",
            |o: &mut LlDispatchOp<'m>| o.call.call.args.flags = EP_LL_SEND_ONLY | EP_LL_RECV_ONLY,
            INVALID,
            &["EP_LL_SEND_ONLY and EP_LL_RECV_ONLY together"],
        ),
        Bad::new(
            "EP_LL_RECV_ONLY without a send",
            |o: &mut LlDispatchOp<'m>| o.call.call.args.flags = EP_LL_RECV_ONLY,
            INVALID,
            &["EP_LL_RECV_ONLY without a matching EP_LL_SEND_ONLY call"],
        ),
        Bad::new(
            "EP_LL_UE8M0_SCALES with BF16 output",
            |o: &mut LlDispatchOp<'m>| {
                o.call.call.args.out_dtype = EP_DTYPE_BF16;
                o.call.call.args.flags = EP_LL_UE8M0_SCALES;
            },
            INVALID,
            &["EP_LL_UE8M0_SCALES needs out_dtype FP8"],
        ),
    ]);
    bads.extend(bad_routing(shape, |o: &mut LlDispatchOp<'m>, f| {
        o.call.call.replace("topk_idx", f)
    }));
    bads
}

/// Bad inputs of `ep_ll_combine` (after a dispatch of the same tokens).
pub fn bad_ll_combine<'m>(shape: &Shape) -> Vec<Bad<'m, LlCombineOp<'m>>> {
    let size = std::mem::size_of::<ep_ll_combine_args_t>() as u32;
    let e = shape.experts as i32;
    let mut bads = header_bads!(
        LlCombineOp,
        |o| o.call.call.args,
        EP_LL_COMBINE_ARGS_MIN_SIZE,
        size,
        "low-latency combine args"
    );
    bads.extend([
        Bad::new(
            "fewer tokens than its dispatch",
            |o: &mut LlCombineOp<'m>| o.call.call.args.num_tokens -= 1,
            INVALID,
            &["but the low-latency dispatch it combines", "had num_tokens"],
        ),
        Bad::new(
            "a misaligned device_num_tokens",
            |o: &mut LlCombineOp<'m>| o.call.call.offset("device_num_tokens", 2),
            INVALID,
            &["`device_num_tokens`", "is not 4-byte aligned"],
        ),
        Bad::new(
            "a dispatch-only flag",
            |o: &mut LlCombineOp<'m>| o.call.call.args.flags = EP_LL_UE8M0_SCALES,
            INVALID,
            &["unknown low-latency flags 0x4"],
        ),
        Bad::new(
            "EP_LL_RECV_ONLY without a send",
            |o: &mut LlCombineOp<'m>| o.call.call.args.flags = EP_LL_RECV_ONLY,
            INVALID,
            &["EP_LL_RECV_ONLY without a matching EP_LL_SEND_ONLY call"],
        ),
        Bad::new(
            "a topk_idx out of range",
            move |o: &mut LlCombineOp<'m>| {
                o.call
                    .call
                    .replace("topk_idx", |idx: &mut Vec<i32>| idx[0] = e)
            },
            INVALID,
            &[&format!("topk_idx[0][0] = {e} is not an expert id")],
        )
        .host_only(),
        Bad::new(
            "a topk_idx other than its dispatch's",
            |o: &mut LlCombineOp<'m>| {
                o.call
                    .call
                    .replace("topk_idx", |idx: &mut Vec<i32>| other_routing(idx))
            },
            INVALID,
            &["but the low-latency dispatch it combines had"],
        )
        .host_only(),
    ]);
    bads
}

/// Bad inputs of `ep_mega_dispatch_gemm`: the headers of its args and of
/// its dispatch half, its dimensions and flags.
pub fn bad_mega_dispatch<'m>() -> Vec<Bad<'m, MegaOp<'m>>> {
    let size = std::mem::size_of::<ep_mega_args_t>() as u32;
    let mut bads = header_bads!(
        MegaOp,
        |o| o.call.args.args,
        EP_MEGA_ARGS_MIN_SIZE,
        size,
        "megakernel args"
    );
    bads.extend([
        Bad::new(
            "a dispatch half with a bad magic",
            |o: &mut MegaOp<'m>| o.call.args.dispatch.magic ^= 0x0101_0101,
            INVALID,
            &["dispatch args", "bad magic"],
        ),
        Bad::new(
            "EP_DISPATCH_REUSE_LAYOUT",
            |o: &mut MegaOp<'m>| o.call.args.dispatch.flags |= EP_DISPATCH_REUSE_LAYOUT,
            INVALID,
            &["cannot reuse a layout"],
        ),
        Bad::new(
            "n not a multiple of 128",
            |o: &mut MegaOp<'m>| o.call.args.args.n = 100,
            INVALID,
            &["n = 100 is not a multiple of 128"],
        ),
        Bad::new(
            "k other than hidden",
            |o: &mut MegaOp<'m>| o.call.args.args.k += 128,
            INVALID,
            &["must be the context's hidden size"],
        ),
        Bad::new(
            "FP8 weights for BF16 rows",
            |o: &mut MegaOp<'m>| o.call.args.args.weight_dtype = EP_DTYPE_FP8_E4M3,
            INVALID,
            &["weight_dtype differs from the dispatch's dtype"],
        ),
        Bad::new(
            "unknown flags",
            |o: &mut MegaOp<'m>| o.call.args.args.flags = 4,
            INVALID,
            &["unknown megakernel flags 0x4"],
        ),
    ]);
    bads
}

/// The group of the contract walks on `world` ranks: 4 experts per rank of
/// 2 ranks, topk 4, hidden 256; 24 tokens (normal), 8 (low-latency).
pub fn contract_shape(world: usize) -> Shape {
    Shape {
        world,
        hidden: 256,
        topk: 4,
        experts: 8,
        max_tokens: 24,
        ll_max: 8,
    }
}

/// Uneven token counts of the ranks of [`contract_shape`] (every rank has
/// some); a world of 1 takes the first.
pub const SOME: [usize; 2] = [13, 7];
pub const LL_SOME: [usize; 2] = [5, 8];

/// `DispatchCase` with both outputs, the host synchronised.
pub fn both(alignment: usize) -> DispatchCase {
    DispatchCase {
        source_order: true,
        expert_major: true,
        alignment,
        no_host_sync: false,
    }
}

/// `LlDispatchCase` of one phase, read from `num_tokens`.
pub fn ll_dispatch_case(fp8: bool, weights: bool, split: bool) -> LlDispatchCase {
    LlDispatchCase {
        fp8,
        ue8m0: false,
        weights,
        split,
        device_count: false,
    }
}

/// The NULL walk of the normal mode, one rank's part, with `mem`'s buffers:
/// the layout, the dispatch with each output order and both, both combines,
/// the megakernels. `some`: every rank's token count (none of them 0); the
/// walk also runs with no tokens anywhere.
pub fn null_walk_of_the_normal_mode(
    mem: &dyn Mem,
    s: &Shape,
    ctx: &Ctx,
    rank: usize,
    some: &[usize],
) {
    let none = &vec![0; s.world][..];
    for (seed, n) in [(1, some), (2, none)] {
        let tokens = Tokens::new(s, seed, n, false);
        walk_nulls(&mut LayoutOp::new(mem, s, &tokens, rank), ctx, rank);
    }
    let cases = [
        (3, some, false, both(4)),
        (4, some, true, both(1)),
        (5, none, false, both(2)),
        (
            6,
            some,
            false,
            DispatchCase {
                expert_major: false,
                ..both(1)
            },
        ),
        (
            7,
            some,
            true,
            DispatchCase {
                source_order: false,
                ..both(8)
            },
        ),
    ];
    for (seed, n, fp8, case) in cases {
        let tokens = Tokens::new(s, seed, n, fp8);
        let mut op = DispatchOp::new(mem, ctx, s, &tokens, rank, case);
        walk_nulls(&mut op, ctx, rank);
    }
    for (seed, n) in [(8, some), (9, none)] {
        let tokens = Tokens::new(s, seed, n, false);
        for expert_major in [false, true] {
            let mut op = CombineOp::new(mem, ctx, s, &tokens, rank, seed, expert_major);
            walk_nulls(&mut op, ctx, rank);
        }
    }
    let tokens = Tokens::new(s, 10, some, false);
    walk_nulls(&mut MegaOp::dispatch(mem, ctx, s, &tokens, rank), ctx, rank);
    walk_nulls(&mut MegaOp::combine(mem, ctx, s, &tokens, rank), ctx, rank);
}

/// The NULL walk of the low-latency mode, one rank's part, with `mem`'s
/// buffers: dispatches and combines of every variant (FP8 or BF16, weights
/// at dispatch or combine, split, zero copy, device token count). `some`:
/// every rank's token count.
pub fn null_walk_of_the_low_latency_mode(
    mem: &dyn Mem,
    s: &Shape,
    ctx: &Ctx,
    rank: usize,
    some: &[usize],
) {
    let none = &vec![0; s.world][..];
    let dispatches = [
        (
            11,
            some,
            LlDispatchCase {
                device_count: true,
                ..ll_dispatch_case(true, true, false)
            },
        ),
        (12, some, ll_dispatch_case(false, false, false)),
        (
            13,
            some,
            LlDispatchCase {
                ue8m0: true,
                ..ll_dispatch_case(true, true, true)
            },
        ),
        (14, none, ll_dispatch_case(false, true, false)),
    ];
    for (seed, n, case) in dispatches {
        let tokens = LlTokens::new(s, seed, n);
        walk_nulls(
            &mut LlDispatchOp::new(mem, s, &tokens, rank, case),
            ctx,
            rank,
        );
    }
    let combine = |weights, zero_copy, split| LlCombineCase {
        weights,
        zero_copy,
        split,
        device_count: false,
    };
    let weighted = ll_dispatch_case(true, true, false);
    let combines = [
        (
            15,
            some,
            weighted,
            LlCombineCase {
                device_count: true,
                ..combine(true, false, false)
            },
        ),
        (16, some, weighted, combine(false, false, false)),
        (17, some, weighted, combine(true, true, true)),
        (
            18,
            some,
            ll_dispatch_case(false, false, true),
            combine(true, false, true),
        ),
        (19, none, weighted, combine(true, false, false)),
    ];
    for (seed, n, dispatch, case) in combines {
        let tokens = LlTokens::new(s, seed, n);
        let mut op = LlCombineOp::new(mem, s, &tokens, rank, seed, dispatch, case);
        walk_nulls(&mut op, ctx, rank);
    }
}

/// The walk of bad inputs other than NULL pointers, one rank's part, with
/// `mem`'s buffers; `host`: also the cases only the host backend detects
/// before the call (it reads the caller's arrays).
pub fn bad_input_walk(
    mem: &dyn Mem,
    s: &Shape,
    ctx: &Ctx,
    rank: usize,
    (some, ll_some): (&[usize], &[usize]),
    host: bool,
) {
    let tokens = Tokens::new(s, 21, some, false);
    let mut layout = LayoutOp::new(mem, s, &tokens, rank);
    walk_bad(&mut layout, &bad_layout(s), ctx, rank, host);
    let mut dispatch = DispatchOp::new(mem, ctx, s, &tokens, rank, both(2));
    walk_bad(&mut dispatch, &bad_dispatch(s), ctx, rank, host);
    let mut combine = CombineOp::new(mem, ctx, s, &tokens, rank, 22, true);
    walk_bad(&mut combine, &bad_combine(), ctx, rank, host);
    let mut mega = MegaOp::dispatch(mem, ctx, s, &tokens, rank);
    walk_bad(&mut mega, &bad_mega_dispatch(), ctx, rank, host);

    let ll = LlTokens::new(s, 23, ll_some);
    let case = LlDispatchCase {
        device_count: true,
        ..ll_dispatch_case(true, true, false)
    };
    let mut dispatch = LlDispatchOp::new(mem, s, &ll, rank, case);
    walk_bad(&mut dispatch, &bad_ll_dispatch(s), ctx, rank, host);
    let combine_case = LlCombineCase {
        weights: true,
        zero_copy: false,
        split: false,
        device_count: true,
    };
    let mut combine = LlCombineOp::new(mem, s, &ll, rank, 24, case, combine_case);
    walk_bad(&mut combine, &bad_ll_combine(s), ctx, rank, host);
}
