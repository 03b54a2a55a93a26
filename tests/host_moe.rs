//! `ep_moe_forward` on the host backend, through the C API:
//! - every stage (the layout, `y1`, `act` and its scales, `y2`) and the
//!   combined tokens bit for bit against `ep::reference::moe::forward`
//!   (what the host backend runs), padding rows of `act` and `y2` untouched
//!   and the rows after the layout untouched in every buffer;
//! - every stage against a straightforward f64 computation from the API's
//!   definition (`tests/common/moe.rs`), which a wrong expert, swapped
//!   gate and up halves or wrong routing weights make fail;
//! - over BF16 and FP8, 1 to 3 ranks, 0, 1 and uneven token counts, dropped
//!   slots, a hot expert and experts without rows, several hidden sizes,
//!   intermediate sizes and alignments;
//! - and every bad input: each required NULL pointer, bad struct headers,
//!   `intermediate` not a multiple of 128, a capacity below the worst case,
//!   flags, dtypes and layouts, each with its status and message, changing
//!   nothing.

mod common;

use common::mega::check_expert_rows;
use common::moe::*;
use common::walk::{expect_error, expect_null};
use common::*;
use ep::capi::*;
use ep::reference::moe::{forward, MoeWeights};
use ep::reference::normal::RankTokens;
use ep::reference::Dtype;
use half::bf16;
use std::ptr::{null, null_mut};

/// A rank's buffers of one call, poisoned, and its arguments.
struct Call {
    dtype: Dtype,
    ex_x: Vec<u8>,
    ex_scales: Vec<f32>,
    ex_weights: Vec<f32>,
    ex_src: Vec<i32>,
    ex_offsets: Vec<i32>,
    ex_counts: Vec<i32>,
    y1: Vec<bf16>,
    act: Vec<u8>,
    act_scales: Vec<f32>,
    y2: Vec<bf16>,
    out: Vec<bf16>,
    dispatch: ep_dispatch_args_t,
    combine: ep_combine_args_t,
    args: ep_moe_args_t,
}

impl Call {
    /// The buffers for `case` on a rank with `data`; `capacity` expert-major
    /// rows. The argument structs are filled by [`Call::args`].
    fn new(case: &MoeCase, data: &RankData, capacity: usize) -> Call {
        let (dtype, hidden, i, l) = (
            case.dtype,
            case.hidden,
            case.intermediate,
            case.local_experts(),
        );
        Call {
            dtype,
            ex_x: poisoned(capacity * dtype.row_bytes(hidden)),
            ex_scales: poisoned(capacity * hidden / 128),
            ex_weights: poisoned(capacity),
            ex_src: poisoned(capacity),
            ex_offsets: poisoned(l + 1),
            ex_counts: poisoned(l),
            y1: poisoned(capacity * 2 * i),
            act: poisoned(capacity * dtype.row_bytes(i)),
            act_scales: poisoned(capacity * i / 128),
            y2: poisoned(capacity * hidden),
            out: poisoned(data.tokens.num_tokens * hidden),
            dispatch: dispatch_args(),
            combine: combine_args(),
            args: moe_args(),
        }
    }

    /// Fills the argument structs for a correct call (they point into this
    /// `Call` and `data`, which must not move until the call).
    fn args(&mut self, case: &MoeCase, data: &RankData, capacity: usize) -> &ep_moe_args_t {
        let fp8 = self.dtype == Dtype::Fp8E4m3;
        let t = &data.tokens;
        let d = &mut self.dispatch;
        d.num_tokens = t.num_tokens as i32;
        d.dtype = dtype_code(self.dtype);
        d.x = t.x.as_ptr() as *const _;
        d.x_scales = if fp8 { t.scales.as_ptr() } else { null() };
        d.topk_idx = t.topk_idx.as_ptr();
        d.topk_weights = t.topk_weights.as_ptr();
        d.expert_alignment = case.alignment as i32;
        d.expert_capacity = capacity as i32;
        d.expert_x = self.ex_x.as_mut_ptr() as *mut _;
        d.expert_x_scales = if fp8 {
            self.ex_scales.as_mut_ptr()
        } else {
            null_mut()
        };
        d.expert_weights = self.ex_weights.as_mut_ptr();
        d.expert_src_row = self.ex_src.as_mut_ptr();
        d.expert_offsets = self.ex_offsets.as_mut_ptr();
        d.expert_counts = self.ex_counts.as_mut_ptr();
        if case.keep_padding {
            d.flags |= EP_DISPATCH_KEEP_PADDING;
        }
        let c = &mut self.combine;
        c.input_layout = EP_COMBINE_EXPERT_MAJOR;
        // A rank without tokens may pass no output.
        c.out = if t.num_tokens == 0 {
            null_mut()
        } else {
            self.out.as_mut_ptr() as *mut _
        };
        let a = &mut self.args;
        a.dispatch = &self.dispatch;
        a.combine = &self.combine;
        a.weight_dtype = dtype_code(self.dtype);
        a.intermediate = case.intermediate as i32;
        a.w1 = data.w1.data.as_ptr() as *const _;
        a.w1_scales = if fp8 { data.w1.scales.as_ptr() } else { null() };
        a.w2 = data.w2.data.as_ptr() as *const _;
        a.w2_scales = if fp8 { data.w2.scales.as_ptr() } else { null() };
        a.y1 = self.y1.as_mut_ptr() as *mut _;
        a.act = self.act.as_mut_ptr() as *mut _;
        a.act_scales = if fp8 {
            self.act_scales.as_mut_ptr()
        } else {
            null_mut()
        };
        a.y2 = self.y2.as_mut_ptr() as *mut _;
        &self.args
    }

    fn outputs(&self) -> MoeOutputs {
        MoeOutputs {
            offsets: self.ex_offsets.clone(),
            counts: self.ex_counts.clone(),
            y1: self.y1.clone(),
            act: self.act.clone(),
            act_scales: self.act_scales.clone(),
            y2: self.y2.clone(),
            out: self.out.clone(),
        }
    }
}

fn moe_args() -> ep_moe_args_t {
    let mut a = std::mem::MaybeUninit::uninit();
    // SAFETY: the init function fills the whole struct.
    unsafe {
        assert_eq!(ep_moe_args_init(a.as_mut_ptr()), EP_SUCCESS);
        a.assume_init()
    }
}

fn config(case: &MoeCase) -> ep_config_t {
    let mut cfg = host_config(
        case.hidden as i32,
        case.topk as i32,
        case.experts as i32,
        case.max_tokens() as i32,
        0,
    );
    cfg.token_dtype = dtype_code(case.dtype);
    cfg
}

/// Runs `case` on the host backend through the C API; returns every
/// rank's inputs and outputs.
fn run_case(case: &MoeCase) -> (Vec<RankData>, Vec<MoeOutputs>) {
    let what = format!("{case:?}");
    let outs = run_world(case.world, &config(case), |rank, ctx| {
        let data = rank_data(case, rank);
        let mut capacity = 0;
        // SAFETY: live context, valid out-parameter.
        let status = unsafe {
            ep_get_dispatch_capacity(ctx.0, case.alignment as i32, null_mut(), &mut capacity)
        };
        assert_eq!(status, EP_SUCCESS);
        assert_eq!(capacity as usize, case.capacity());
        let mut call = Call::new(case, &data, case.capacity());
        let handle = ctx.handle();
        let args = *call.args(case, &data, case.capacity());
        // SAFETY: every pointer holds what the API asks for.
        let status = unsafe { ep_moe_forward(ctx.0, &args, handle.0, null_mut()) };
        assert_eq!(status, EP_SUCCESS, "{what} rank {rank}: {}", last_error());
        call.outputs()
    });
    let data = (0..case.world).map(|r| rank_data(case, r)).collect();
    (data, outs)
}

/// Compares every rank's outputs bit for bit with the reference forward,
/// and checks that padding rows (and rows after the layout) are untouched.
fn check_reference(case: &MoeCase, data: &[RankData], outs: &[MoeOutputs]) {
    let what = format!("{case:?}");
    let sources: Vec<RankTokens> = data.iter().map(|d| d.tokens.view()).collect();
    let weights: Vec<MoeWeights> = data.iter().map(RankData::weights).collect();
    let (want_out, ranks) = forward(case.topo(), case.dtype, &sources, &weights, case.alignment);
    let (hidden, i, dtype) = (case.hidden, case.intermediate, case.dtype);
    let (act_bytes, act_scales) = (dtype.row_bytes(i), dtype.scales_per_row(i));
    for (rank, (out, (d, s))) in outs.iter().zip(&ranks).enumerate() {
        let what = format!("{what} rank {rank}");
        assert_eq!(out.offsets, d.expert_offsets, "{what}: offsets");
        assert_eq!(out.counts, d.expert_counts, "{what}: counts");
        let rows = d.expert_rows;
        check_expert_rows(
            d,
            &out.y1,
            &s.y1,
            2 * i,
            case.keep_padding,
            &format!("{what}: y1"),
        );
        assert!(
            is_poisoned(&out.act[rows * act_bytes..]),
            "{what}: act after the rows"
        );
        assert!(
            is_poisoned(&out.y2[rows * hidden..]),
            "{what}: y2 after the rows"
        );
        for j in 0..rows {
            let act = &out.act[j * act_bytes..][..act_bytes];
            let scales = &out.act_scales[j * act_scales..][..act_scales];
            let y2 = &out.y2[j * hidden..][..hidden];
            if d.expert_src_row[j] >= 0 {
                assert!(
                    act == &s.act[j * act_bytes..][..act_bytes],
                    "{what}: act row {j}"
                );
                assert_eq!(
                    bits(scales),
                    bits(&s.act_scales[j * act_scales..][..act_scales]),
                    "{what}: act scales row {j}"
                );
                assert!(
                    bytes_of(y2) == bytes_of(&s.y2[j * hidden..][..hidden]),
                    "{what}: y2 row {j}"
                );
            } else {
                assert!(
                    is_poisoned(act),
                    "{what}: padding row {j} of act was written"
                );
                assert!(
                    is_poisoned(scales),
                    "{what}: padding row {j} of the act scales"
                );
                assert!(is_poisoned(y2), "{what}: padding row {j} of y2 was written");
            }
        }
        assert!(
            bytes_of(&out.out) == bytes_of(&want_out[rank]),
            "{what}: combined tokens"
        );
    }
}

fn base(world: usize, dtype: Dtype, seed: u64) -> MoeCase {
    MoeCase {
        world,
        hidden: 256,
        intermediate: 128,
        experts: 8,
        topk: 4,
        dtype,
        alignment: 1,
        tokens: vec![9; world],
        drop: 0.2,
        hot: None,
        seed,
        keep_padding: false,
    }
}

/// The cases: every world size and dtype with uneven token counts
/// (0 and 1 among them), a hot expert (others without rows), several
/// shapes and alignments.
fn cases() -> Vec<MoeCase> {
    let mut seed = 0x6d6f_0000;
    let mut next = move || {
        seed += 1;
        seed
    };
    let mut cases = Vec::new();
    for dtype in [Dtype::Bf16, Dtype::Fp8E4m3] {
        for world in [1, 2, 3] {
            let mut c = base(world, dtype, next());
            c.tokens = (0..world).map(|r| [5, 0, 1][r]).collect();
            c.experts = 6;
            cases.push(c);
            // Most first slots on one expert, few slots: experts without rows.
            let mut c = base(world, dtype, next());
            c.experts = 4 * world;
            c.topk = 2;
            c.drop = 0.4;
            c.hot = Some(1);
            c.alignment = 16;
            c.tokens = (0..world).map(|r| 7 + 5 * r).collect();
            cases.push(c);
            // Hidden 384, I 256, topk 1.
            let mut c = base(world, dtype, next());
            c.hidden = 384;
            c.intermediate = 256;
            c.topk = 1;
            c.experts = 2 * world;
            c.alignment = 4;
            cases.push(c);
            // Padding rows kept (EP_DISPATCH_KEEP_PADDING), alignment 16.
            let mut c = base(world, dtype, next());
            c.experts = 4 * world;
            c.alignment = 16;
            c.keep_padding = true;
            cases.push(c);
        }
        // One token; then none anywhere.
        let mut c = base(2, dtype, next());
        c.tokens = vec![1, 0];
        cases.push(c);
        let mut c = base(2, dtype, next());
        c.tokens = vec![0, 0];
        cases.push(c);
    }
    cases
}

#[test]
fn forward_matches_the_reference_and_the_definition() {
    for case in cases() {
        let (data, outs) = run_case(&case);
        check_reference(&case, &data, &outs);
        if let Err(e) = check_independent(&case, &data, &outs, Mistake::None) {
            panic!("{case:?}: {e}");
        }
    }
}

/// The straightforward computation fails on results it should not accept:
/// the comparisons are not vacuous.
#[test]
fn the_checks_catch_wrong_results() {
    for dtype in [Dtype::Bf16, Dtype::Fp8E4m3] {
        let case = base(2, dtype, 0x6d6f_1000);
        let (data, outs) = run_case(&case);
        assert_eq!(
            check_independent(&case, &data, &outs, Mistake::None),
            Ok(())
        );
        for mistake in [
            Mistake::WrongExpert,
            Mistake::SwappedHalves,
            Mistake::WrongRoutingWeight,
        ] {
            assert!(
                check_independent(&case, &data, &outs, mistake).is_err(),
                "{dtype:?}: {mistake:?} passed"
            );
        }
        // One value of y2 off by 2% fails the combine's check, one code of
        // act off by one fails the activation's.
        let mut bad = outs.clone();
        let j = (0..).find(|&j| bad[0].counts[0] as usize > j).unwrap();
        let v = &mut bad[0].y2[j * case.hidden];
        *v = bf16::from_f32(v.to_f32() * 1.02 + 1.0);
        assert!(check_independent(&case, &data, &bad, Mistake::None).is_err());
        let mut bad = outs.clone();
        bad[0].act[0] ^= if dtype == Dtype::Bf16 { 0x40 } else { 0x08 };
        assert!(check_independent(&case, &data, &bad, Mistake::None).is_err());
    }
}

/// One rank's correct call on a one-rank context, for the bad-input tests:
/// hidden 128, I 128, top-2 of 4 experts, 3 tokens.
struct Fixture {
    case: MoeCase,
    /// The tokens and weights the arguments point into.
    _data: RankData,
    call: Call,
}

impl Fixture {
    fn new(dtype: Dtype) -> Fixture {
        let case = MoeCase {
            world: 1,
            hidden: 128,
            intermediate: 128,
            experts: 4,
            topk: 2,
            dtype,
            alignment: 1,
            tokens: vec![3],
            drop: 0.0,
            hot: None,
            seed: 0x6d6f_2000,
            keep_padding: false,
        };
        let data = rank_data(&case, 0);
        let mut call = Call::new(&case, &data, case.capacity());
        call.args(&case, &data, case.capacity());
        Fixture {
            case,
            _data: data,
            call,
        }
    }

    /// Makes the call after `change` edits a copy of its arguments (the
    /// three structs); the pointers between them are set after the edit
    /// unless it cleared them.
    fn run(
        &self,
        ctx: &Ctx,
        change: impl Fn(&mut ep_moe_args_t, &mut ep_dispatch_args_t, &mut ep_combine_args_t),
    ) -> ep_status_t {
        let (mut a, mut d, mut c) = (self.call.args, self.call.dispatch, self.call.combine);
        change(&mut a, &mut d, &mut c);
        if !a.dispatch.is_null() {
            a.dispatch = &d;
        }
        if !a.combine.is_null() {
            a.combine = &c;
        }
        let handle = ctx.handle();
        // SAFETY: the pointers are the fixture's buffers, or what the test
        // put there to be refused.
        unsafe { ep_moe_forward(ctx.0, &a, handle.0, null_mut()) }
    }

    /// Every output is still poisoned.
    fn untouched(&self) -> bool {
        let c = &self.call;
        is_poisoned(&c.ex_x)
            && is_poisoned(&c.ex_offsets)
            && is_poisoned(&c.y1)
            && is_poisoned(&c.act)
            && is_poisoned(&c.act_scales)
            && is_poisoned(&c.y2)
            && is_poisoned(&c.out)
    }
}

type Change = Box<dyn Fn(&mut ep_moe_args_t, &mut ep_dispatch_args_t, &mut ep_combine_args_t)>;

#[test]
fn each_required_null_pointer_is_refused() {
    for dtype in [Dtype::Bf16, Dtype::Fp8E4m3] {
        let f = Fixture::new(dtype);
        let ctx = Ctx::single(&config(&f.case));
        let mut nulls: Vec<(&str, Change)> = vec![
            ("dispatch", Box::new(|a, _, _| a.dispatch = null())),
            ("combine", Box::new(|a, _, _| a.combine = null())),
            ("w1", Box::new(|a, _, _| a.w1 = null())),
            ("w2", Box::new(|a, _, _| a.w2 = null())),
            ("y1", Box::new(|a, _, _| a.y1 = null_mut())),
            ("act", Box::new(|a, _, _| a.act = null_mut())),
            ("y2", Box::new(|a, _, _| a.y2 = null_mut())),
            ("expert_x", Box::new(|_, d, _| d.expert_x = null_mut())),
            (
                "expert_src_row",
                Box::new(|_, d, _| d.expert_src_row = null_mut()),
            ),
            (
                "expert_offsets",
                Box::new(|_, d, _| d.expert_offsets = null_mut()),
            ),
            ("x", Box::new(|_, d, _| d.x = null())),
            ("topk_idx", Box::new(|_, d, _| d.topk_idx = null())),
            ("topk_weights", Box::new(|_, d, _| d.topk_weights = null())),
            ("out", Box::new(|_, _, c| c.out = null_mut())),
        ];
        if dtype == Dtype::Fp8E4m3 {
            nulls.extend([
                (
                    "w1_scales",
                    Box::new(|a: &mut ep_moe_args_t, _: &mut _, _: &mut _| a.w1_scales = null())
                        as Change,
                ),
                ("w2_scales", Box::new(|a, _, _| a.w2_scales = null())),
                ("act_scales", Box::new(|a, _, _| a.act_scales = null_mut())),
                (
                    "expert_x_scales",
                    Box::new(|_, d, _| d.expert_x_scales = null_mut()),
                ),
                ("x_scales", Box::new(|_, d, _| d.x_scales = null())),
            ]);
        }
        for (field, change) in &nulls {
            let what = format!("{dtype:?}: {field} NULL");
            expect_null(f.run(&ctx, change), "ep_moe_forward", field, &what);
            assert!(f.untouched(), "{what}: an output was written");
        }
        // The optional ones may be NULL; in BF16 the scales are not used.
        let optional: Vec<Change> = vec![
            Box::new(|_, d, _| d.expert_weights = null_mut()),
            Box::new(|_, d, _| d.expert_counts = null_mut()),
            Box::new(|_, _, c| c.x = null()),
        ];
        for change in &optional {
            assert_eq!(
                f.run(&ctx, change),
                EP_SUCCESS,
                "{dtype:?}: {}",
                last_error()
            );
        }
        if dtype == Dtype::Bf16 {
            let status = f.run(&ctx, |a, _, _| {
                a.w1_scales = null();
                a.w2_scales = null();
                a.act_scales = null_mut();
            });
            assert_eq!(status, EP_SUCCESS, "{}", last_error());
        }
        // The function's own arguments.
        let handle = ctx.handle();
        let a = f.call.args;
        // SAFETY: the NULL is the one refused; the rest is valid.
        unsafe {
            expect_null(
                ep_moe_forward(null_mut(), &a, handle.0, null_mut()),
                "ep_moe_forward",
                "ctx",
                "ctx NULL",
            );
            expect_null(
                ep_moe_forward(ctx.0, null(), handle.0, null_mut()),
                "ep_moe_forward",
                "moe args",
                "args NULL",
            );
            expect_null(
                ep_moe_forward(ctx.0, &a, null_mut(), null_mut()),
                "ep_moe_forward",
                "handle",
                "handle NULL",
            );
        }
    }
}

#[test]
fn bad_inputs_are_refused_with_their_status() {
    let f = Fixture::new(Dtype::Bf16);
    let ctx = Ctx::single(&config(&f.case));
    let size = std::mem::size_of::<ep_moe_args_t>() as u32;
    let worst = f.case.capacity() as i32;
    let bad: Vec<(Change, &[&str])> = vec![
        (Box::new(|a, _, _| a.struct_size = 8), &["struct_size 8"]),
        (
            Box::new(move |a, _, _| a.struct_size = size + 8),
            &["struct_size"],
        ),
        (
            Box::new(|a, _, _| a.magic = EP_MEGA_ARGS_MAGIC),
            &["moe args: bad magic"],
        ),
        (Box::new(|a, _, _| a.version = 0), &["version is 0"]),
        (
            Box::new(|_, d, _| d.magic = 0),
            &["dispatch args: bad magic"],
        ),
        (
            Box::new(|_, _, c| c.struct_size = 4),
            &["combine args: struct_size 4"],
        ),
        (
            Box::new(|a, _, _| a.intermediate = 100),
            &["intermediate = 100"],
        ),
        (
            Box::new(|a, _, _| a.intermediate = 0),
            &["intermediate = 0"],
        ),
        (
            Box::new(|a, _, _| a.intermediate = 192),
            &["intermediate = 192"],
        ),
        (
            Box::new(|a, _, _| a.intermediate = -128),
            &["intermediate = -128 is negative"],
        ),
        (
            Box::new(|a, _, _| a.intermediate = EP_MOE_MAX_INTERMEDIATE + 128),
            &["intermediate = 32896"],
        ),
        (
            Box::new(move |_, d, _| d.expert_capacity = worst - 1),
            &["expert_capacity", "below the worst case"],
        ),
        (
            Box::new(|a, _, _| a.flags = 1),
            &["unknown ep_moe_forward flags 0x1"],
        ),
        (Box::new(|a, _, _| a.weight_dtype = 7), &["weight_dtype"]),
        (
            Box::new(|a, _, _| a.weight_dtype = EP_DTYPE_FP8_E4M3),
            &["weight_dtype differs from the dispatch's dtype"],
        ),
        (
            Box::new(|_, _, c| c.input_layout = EP_COMBINE_SOURCE_ORDER),
            &["EP_COMBINE_EXPERT_MAJOR"],
        ),
        (
            Box::new(|_, d, _| d.flags = EP_DISPATCH_REUSE_LAYOUT),
            &["EP_DISPATCH_REUSE_LAYOUT"],
        ),
        (Box::new(|_, d, _| d.num_tokens = 4), &["num_tokens = 4"]),
        (Box::new(|a, _, _| a.num_sms = -1), &["num_sms = -1"]),
        (
            Box::new(|a, _, _| a.y1 = (a.y1 as usize + 1) as *mut _),
            &["`y1`", "2-byte aligned"],
        ),
        (
            Box::new(|a, _, c| c.out = a.y2.cast()),
            &["`out`", "overlaps `y2`"],
        ),
    ];
    for (change, needles) in &bad {
        let status = f.run(&ctx, change);
        let what = format!("{needles:?}");
        expect_error(
            status,
            EP_ERR_INVALID_ARGUMENT,
            "ep_moe_forward",
            needles,
            &what,
        );
        assert!(f.untouched(), "{what}: an output was written");
    }
    // An invalid expert id is the host backend's own check of the routing.
    let ids = [0, 9, 1, 2, 3, 0];
    let status = f.run(&ctx, |_, d, _| d.topk_idx = ids.as_ptr());
    expect_error(
        status,
        EP_ERR_INVALID_ARGUMENT,
        "ep_moe_forward",
        &["topk_idx[0][1] = 9"],
        "expert 9",
    );
    assert!(f.untouched());
    // None of them took a call: a correct call still works and is right.
    assert_eq!(f.run(&ctx, |_, _, _| {}), EP_SUCCESS, "{}", last_error());
    assert!(!is_poisoned(&f.call.out));
}

/// Refused calls take no call number: the ranks of a group that refused
/// different bad calls still pair their next correct calls. The handle
/// then holds the call's layout for a plain combine.
#[test]
fn refused_calls_leave_the_ranks_in_step() {
    let case = base(2, Dtype::Bf16, 0x6d6f_3000);
    let results = run_world(2, &config(&case), |rank, ctx| {
        let data = rank_data(&case, rank);
        let mut call = Call::new(&case, &data, case.capacity());
        let mut args = *call.args(&case, &data, case.capacity());
        let handle = ctx.handle();
        // Rank 0 refuses a bad I, rank 1 a NULL y2: neither is made.
        let good = args;
        if rank == 0 {
            args.intermediate = 64;
        } else {
            args.y2 = null_mut();
        }
        // SAFETY: every pointer is valid or the NULL the call refuses.
        let status = unsafe { ep_moe_forward(ctx.0, &args, handle.0, null_mut()) };
        assert_ne!(status, EP_SUCCESS);
        // SAFETY: as in run_case.
        let status = unsafe { ep_moe_forward(ctx.0, &good, handle.0, null_mut()) };
        assert_eq!(status, EP_SUCCESS, "rank {rank}: {}", last_error());
        // The handle holds the layout: a plain expert-major combine of the
        // y2 rows gives the same tokens.
        let mut out = poisoned::<bf16>(data.tokens.num_tokens * case.hidden);
        let mut c = combine_args();
        c.input_layout = EP_COMBINE_EXPERT_MAJOR;
        c.x = call.y2.as_ptr() as *const _;
        c.out = out.as_mut_ptr() as *mut _;
        // SAFETY: `x` holds the handle's expert-major rows.
        let status = unsafe { ep_combine(ctx.0, &c, handle.0, null_mut()) };
        assert_eq!(status, EP_SUCCESS, "rank {rank}: {}", last_error());
        assert!(
            bytes_of(&out) == bytes_of(&call.out),
            "rank {rank}: combine again"
        );
        call.outputs()
    });
    let data: Vec<RankData> = (0..2).map(|r| rank_data(&case, r)).collect();
    check_reference(&case, &data, &results);
}
