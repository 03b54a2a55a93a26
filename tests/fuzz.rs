//! A random API-sequence fuzz on the host backend: groups of 2 to 4 ranks
//! (threads) make random mixes of valid calls (checked against the
//! reference), calls that fail their checks on every rank or on one rank
//! only (which then makes the call correctly), and mismatched collectives
//! (ranks in different operations); some groups end with an abort. Every
//! call must end in the status the plan expects, no call may panic, a valid
//! call made by every rank must give the reference result, and the context
//! must keep working after every failure (or refuse every call once
//! aborted).
//!
//! Runs for `EP_FUZZ_SECONDS` (default 20). The seed is printed and named
//! in every failure; `EP_FUZZ_SEED=<seed>` repeats a run.

mod common;

use common::calls::*;
use common::walk::*;
use common::*;
use ep::capi::*;
use std::time::{Duration, Instant};

static HOST: HostMem = HostMem;

/// Collective calls per group.
const STEPS: usize = 30;

#[test]
fn random_api_sequences() {
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    let seed = env("EP_FUZZ_SEED").unwrap_or_else(|| {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        now.map_or(1, |d| d.as_nanos() as u64)
    });
    let budget = Duration::from_secs(env("EP_FUZZ_SECONDS").unwrap_or(20));
    eprintln!("fuzz seed {seed} (EP_FUZZ_SEED={seed} repeats this run)");
    let start = Instant::now();
    let mut groups = Rng::new(seed);
    let mut count = 0;
    while start.elapsed() < budget {
        run_group(seed, groups.next_u64());
        count += 1;
    }
    eprintln!("fuzz seed {seed}: {count} groups of {STEPS} steps");
    assert!(count > 0);
}

/// One group: a random shape, `STEPS` random steps on every rank.
fn run_group(seed: u64, group: u64) {
    let mut rng = Rng::new(group);
    let world = 2 + rng.below(3);
    let experts = world * [1, 2, 4][rng.below(3)];
    let shape = Shape {
        world,
        hidden: [128, 256][rng.below(2)],
        topk: 1 + rng.below(4.min(experts)),
        experts,
        max_tokens: 12,
        ll_max: 6,
    };
    let abort_at_end = rng.chance(0.3);
    run_world(world, &shape.config(), |rank, ctx| {
        let mut fuzz = Fuzz {
            shape,
            rank,
            ctx,
            combine: None,
            ll_combine: None,
            what: String::new(),
        };
        for step in 0..STEPS {
            fuzz.what =
                format!("fuzz seed {seed}, group {group:#x}, step {step}, rank {rank}, {shape:?}");
            let mut plan = Rng::new(group ^ (step as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            fuzz.step(&mut plan);
        }
        if abort_at_end {
            fuzz.abort();
        }
    });
}

/// One rank's side of a group. Every rank draws the same plan, so all
/// make matching calls (or the mismatches the plan asks for).
struct Fuzz<'c> {
    shape: Shape,
    rank: usize,
    ctx: &'c Ctx,
    /// A combine whose dispatch ran (into its own handle), not combined yet.
    combine: Option<CombineOp<'static>>,
    /// A low-latency combine whose dispatch is still the context's last.
    ll_combine: Option<LlCombineOp<'static>>,
    what: String,
}

/// Token counts of every rank, 0 to `max` (at least 1 with `some`).
fn counts(plan: &mut Rng, world: usize, max: usize, some: bool) -> Vec<usize> {
    let least = usize::from(some);
    (0..world)
        .map(|_| least + plan.below(max + 1 - least))
        .collect()
}

fn ll_dispatch_case(plan: &mut Rng) -> LlDispatchCase {
    let fp8 = plan.chance(0.5);
    LlDispatchCase {
        fp8,
        ue8m0: fp8 && plan.chance(0.3),
        weights: plan.chance(0.6),
        split: plan.chance(0.3),
        device_count: plan.chance(0.3),
    }
}

fn ll_combine_case(plan: &mut Rng, dispatch: &LlDispatchCase) -> LlCombineCase {
    LlCombineCase {
        weights: !dispatch.weights || plan.chance(0.5),
        zero_copy: plan.chance(0.3),
        split: plan.chance(0.3),
        device_count: dispatch.device_count && plan.chance(0.7),
    }
}

/// The operations a step may make.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Layout,
    Dispatch,
    Combine,
    LlDispatch,
    LlCombine,
}

impl<'c> Fuzz<'c> {
    fn step(&mut self, plan: &mut Rng) {
        match plan.below(100) {
            0..12 => {
                let mut op = self.layout(plan, false);
                self.valid(&mut op);
            }
            12..27 => {
                let mut op = self.dispatch(plan, false);
                self.valid(&mut op);
            }
            27..35 => {
                let mut op = self.new_combine(plan, false);
                op.prepare(self.ctx);
                self.combine = Some(op);
            }
            35..45 => {
                if let Some(mut op) = self.combine.take() {
                    op.pointers().poison();
                    self.run_valid(&mut op);
                }
            }
            45..55 => {
                let mut op = self.ll_dispatch(plan, false);
                self.valid(&mut op);
                self.ll_combine = None;
            }
            55..63 => {
                let mut op = self.new_ll_combine(plan, false);
                op.prepare(self.ctx);
                self.ll_combine = Some(op);
            }
            63..73 => {
                if let Some(mut op) = self.ll_combine.take() {
                    op.pointers().poison();
                    self.run_valid(&mut op);
                }
            }
            73..86 => self.bad_everywhere(plan),
            86..93 => self.bad_on_one_rank(plan),
            _ => self.mismatch(plan),
        }
    }

    fn tokens(&self, plan: &mut Rng, some: bool) -> Tokens {
        let n = counts(plan, self.shape.world, self.shape.max_tokens, some);
        Tokens::new(&self.shape, plan.next_u64(), &n, plan.chance(0.3))
    }

    fn layout(&self, plan: &mut Rng, some: bool) -> LayoutOp<'static> {
        let tokens = self.tokens(plan, some);
        LayoutOp::new(&HOST, &self.shape, &tokens, self.rank)
    }

    /// A dispatch with a random case (both outputs for a bad call, whose
    /// list needs them).
    fn dispatch(&self, plan: &mut Rng, bad: bool) -> DispatchOp<'static> {
        let tokens = self.tokens(plan, bad);
        let output = if bad { 2 } else { plan.below(3) };
        let case = DispatchCase {
            source_order: output != 1,
            expert_major: output != 0,
            alignment: [1, 2, 4, 8][plan.below(4)],
            no_host_sync: !bad && plan.chance(0.3),
        };
        DispatchOp::new(&HOST, self.ctx, &self.shape, &tokens, self.rank, case)
    }

    fn new_combine(&self, plan: &mut Rng, some: bool) -> CombineOp<'static> {
        let tokens = self.tokens(plan, some);
        let expert_major = plan.chance(0.5);
        let seed = plan.next_u64();
        CombineOp::new(
            &HOST,
            self.ctx,
            &self.shape,
            &tokens,
            self.rank,
            seed,
            expert_major,
        )
    }

    fn ll_tokens(&self, plan: &mut Rng, some: bool) -> LlTokens {
        let n = counts(plan, self.shape.world, self.shape.ll_max, some);
        LlTokens::new(&self.shape, plan.next_u64(), &n)
    }

    fn ll_dispatch(&self, plan: &mut Rng, some: bool) -> LlDispatchOp<'static> {
        let tokens = self.ll_tokens(plan, some);
        let case = ll_dispatch_case(plan);
        LlDispatchOp::new(&HOST, &self.shape, &tokens, self.rank, case)
    }

    fn new_ll_combine(&self, plan: &mut Rng, some: bool) -> LlCombineOp<'static> {
        let tokens = self.ll_tokens(plan, some);
        let dispatch = ll_dispatch_case(plan);
        let case = ll_combine_case(plan, &dispatch);
        let seed = plan.next_u64();
        LlCombineOp::new(&HOST, &self.shape, &tokens, self.rank, seed, dispatch, case)
    }

    /// Prepares and makes a correct call on every rank ([`correct_call`]).
    fn valid(&mut self, op: &mut dyn Op) {
        let what = format!("{}: {}", self.what, op.label());
        correct_call(op, self.ctx, &what);
    }

    /// Makes a prepared correct call ([`run_correct`]).
    fn run_valid(&self, op: &mut dyn Op) {
        let what = format!("{}: {}", self.what, op.label());
        run_correct(op, self.ctx, &what);
    }

    /// Makes one call that fails its checks (a bad value, or a required
    /// pointer NULL) and expects its status, with nothing written.
    fn fail<T: Op>(&self, op: &mut T, plan: &mut Rng, bads: &[Bad<'_, T>]) {
        op.pointers().poison();
        if plan.chance(0.3) {
            // Every rank has tokens, so every rank has the same facts.
            let facts = op.phases()[0];
            let required: Vec<_> = op
                .fields()
                .into_iter()
                .filter(|f| f.required(&facts) && op.pointers().is_set(f.name))
                .collect();
            let field = required[plan.below(required.len())];
            op.pointers().null(field.name);
            let status = op.run(self.ctx, 0);
            expect_null(status, op.function(), field.name, &self.what);
        } else {
            let bad = &bads[plan.below(bads.len())];
            (bad.apply)(op);
            let status = op.run(self.ctx, 0);
            let needles: Vec<&str> = bad.needles.iter().map(|s| s.as_str()).collect();
            let what = format!("{}: {} with {}", self.what, op.label(), bad.what);
            expect_error(status, bad.status, op.function(), &needles, &what);
        }
        assert!(
            op.pointers().untouched(),
            "{}: an output was written",
            self.what
        );
        op.pointers().restore();
    }

    /// An operation with every rank's tokens, prepared, for a failing call.
    /// (A combine's NULL walk is left out here: whether its `x` is required
    /// depends on the rows each rank received.)
    fn failing_call(&mut self, plan: &mut Rng, retry: bool) {
        let shape = self.shape;
        match plan.below(4) {
            0 => {
                let mut op = self.layout(plan, true);
                self.fail(&mut op, plan, &bad_layout(&shape));
                if retry {
                    self.run_valid(&mut op);
                }
            }
            1 => {
                let mut op = self.dispatch(plan, true);
                self.fail(&mut op, plan, &bad_dispatch(&shape));
                if retry {
                    op.pointers().poison();
                    self.run_valid(&mut op);
                }
            }
            2 => {
                let mut op = self.ll_dispatch(plan, true);
                op.call.case.split = false;
                self.fail(&mut op, plan, &bad_ll_dispatch(&shape));
                self.ll_combine = None;
                if retry {
                    op.pointers().poison();
                    self.run_valid(&mut op);
                }
            }
            _ => {
                let mut op = self.new_ll_combine(plan, true);
                op.call.case.split = false;
                op.prepare(self.ctx);
                self.ll_combine = None;
                self.fail(&mut op, plan, &bad_ll_combine(&shape));
                if retry {
                    op.pointers().poison();
                    self.run_valid(&mut op);
                }
            }
        }
    }

    /// Every rank makes the same call, which fails its checks.
    fn bad_everywhere(&mut self, plan: &mut Rng) {
        self.failing_call(plan, false);
    }

    /// One rank's call fails its checks; that rank then makes it correctly,
    /// which pairs with the other ranks' call.
    fn bad_on_one_rank(&mut self, plan: &mut Rng) {
        let bad_rank = plan.below(self.shape.world);
        let mut mine = plan.clone();
        if self.rank == bad_rank {
            self.failing_call(&mut mine, true);
            return;
        }
        // The same operation and inputs as the bad rank's, made correctly.
        match mine.below(4) {
            0 => {
                let mut op = self.layout(&mut mine, true);
                self.valid(&mut op);
            }
            1 => {
                let mut op = self.dispatch(&mut mine, true);
                self.valid(&mut op);
            }
            2 => {
                let mut op = self.ll_dispatch(&mut mine, true);
                op.call.case.split = false;
                self.valid(&mut op);
                self.ll_combine = None;
            }
            _ => {
                let mut op = self.new_ll_combine(&mut mine, true);
                op.call.case.split = false;
                op.prepare(self.ctx);
                self.ll_combine = None;
                op.pointers().poison();
                self.run_valid(&mut op);
            }
        }
    }

    /// Ranks make different collective calls (at least two kinds): every
    /// rank ends in `EP_ERR_REMOTE`, with nothing written.
    fn mismatch(&mut self, plan: &mut Rng) {
        let mut kinds = vec![Kind::Dispatch, Kind::LlDispatch];
        if self.combine.is_some() {
            kinds.push(Kind::Combine);
        }
        if self
            .ll_combine
            .as_ref()
            .is_some_and(|op| !op.call.case.split)
        {
            kinds.push(Kind::LlCombine);
        }
        let mut chosen: Vec<Kind> = (0..self.shape.world)
            .map(|_| kinds[plan.below(kinds.len())])
            .collect();
        if chosen.iter().all(|&k| k == chosen[0]) {
            let other = kinds.iter().find(|&&k| k != chosen[0]).copied();
            let at = plan.below(chosen.len());
            chosen[at] = other.unwrap_or(Kind::Layout);
        }
        // Every rank builds every rank's inputs, so the plan stays shared.
        let mut dispatch = self.dispatch(plan, false);
        let mut ll_dispatch = self.ll_dispatch(plan, false);
        ll_dispatch.call.case.split = false;
        let mine = chosen[self.rank];
        let op: &mut dyn Op = match mine {
            Kind::Dispatch => &mut dispatch,
            Kind::LlDispatch => &mut ll_dispatch,
            Kind::Combine => self.combine.as_mut().unwrap(),
            Kind::LlCombine => self.ll_combine.as_mut().unwrap(),
            Kind::Layout => unreachable!("two kinds are always available"),
        };
        op.pointers().poison();
        let status = op.run(self.ctx, 0);
        let what = format!("{}: {:?} against {chosen:?}", self.what, mine);
        expect_error(status, EP_ERR_REMOTE, op.function(), &["while rank"], &what);
        assert!(op.pointers().untouched(), "{what}: an output was written");
        if chosen.contains(&Kind::LlDispatch) {
            self.ll_combine = None;
        }
    }

    /// Aborts this rank's context: every later call refuses.
    fn abort(&mut self) {
        let mut plan = Rng::new(self.rank as u64);
        let mut layout = self.layout(&mut plan, false);
        let mut dispatch = self.dispatch(&mut plan, false);
        // SAFETY: a live context.
        assert_eq!(unsafe { ep_ctx_abort(self.ctx.0) }, EP_SUCCESS);
        for op in [&mut layout as &mut dyn Op, &mut dispatch] {
            let status = op.run(self.ctx, 0);
            expect_error(
                status,
                EP_ERR_ABORTED,
                op.function(),
                &["aborted"],
                &self.what,
            );
        }
        let mut status = 0;
        // SAFETY: a live context and a valid out-parameter.
        unsafe { ep_ctx_get_async_error(self.ctx.0, &mut status) };
        assert_eq!(status, EP_ERR_ABORTED, "{}", self.what);
    }
}
