//! The host backend, driven through the C API, against the reference code on
//! fresh random inputs: every rank poisons its outputs, runs the operation,
//! and compares with the reference computed over all ranks' inputs (each rank
//! regenerates every rank's inputs from the seeds). The host backend runs the
//! reference, so every comparison is bit-exact.

mod common;

use common::calls::LlTokens;
use common::normal::{dispatch_all, Input};
use common::*;
use ep::capi::*;
use ep::reference::fp8::quantize_rows;
use ep::reference::hierarchical::{self, NodeShape};
use ep::reference::layout::dispatch_layout;
use ep::reference::low_latency::{ll_combine, ll_dispatch, LlDispatched, LlExpertOutputs};
use ep::reference::normal::{self, Returned};
use ep::reference::{Dtype, Topology};
use half::bf16;
use std::ptr::{null, null_mut};

/// Most tokens per rank in the normal-mode tests.
const MAX_TOKENS: i32 = 100;
/// `ll_max_tokens_per_rank` of the low-latency tests.
const LL_MAX: usize = 24;

#[derive(Clone, Copy, Debug)]
struct Shape {
    world: usize,
    hidden: usize,
    topk: usize,
    experts: usize,
}

impl Shape {
    fn topo(&self) -> Topology {
        Topology {
            world: self.world,
            num_experts: self.experts,
            topk: self.topk,
            hidden: self.hidden,
        }
    }

    fn config(&self, token_dtype: i32, ll_max: usize) -> ep_config_t {
        let mut cfg = host_config(
            self.hidden as i32,
            self.topk as i32,
            self.experts as i32,
            MAX_TOKENS,
            ll_max as i32,
        );
        cfg.token_dtype = token_dtype;
        cfg
    }
}

/// One normal-mode dispatch + combine of every rank.
#[derive(Clone, Debug)]
struct Run {
    tokens: Vec<usize>,
    skewed: bool,
    fp8: bool,
    alignment: usize,
    no_sync: bool,
    /// `EP_DISPATCH_KEEP_PADDING`.
    keep_padding: bool,
    seed: u64,
}

/// One rank's normal-mode inputs of `run`.
fn input(shape: &Shape, run: &Run, rank: usize) -> Input {
    let mut rng = Rng::new(run.seed.wrapping_mul(1_000_003).wrapping_add(rank as u64));
    let n = run.tokens[rank];
    let hot = run.skewed.then(|| run.seed as usize % shape.experts);
    let topk_idx = routing(&mut rng, shape.experts, shape.topk, n, 0.15, hot);
    let weights = weights(&mut rng, n * shape.topk);
    let values = random_bf16(&mut rng, n * shape.hidden);
    let (x, scales) = if run.fp8 {
        quantize_rows(&values, shape.hidden)
    } else {
        (bf16_to_bytes(&values), Vec::new())
    };
    Input {
        num_tokens: n,
        x,
        scales,
        topk_idx,
        topk_weights: weights,
    }
}

/// The "expert": a deterministic BF16 function of each received row.
fn expert_fn(rows: &[u8], dtype: Dtype, hidden: usize) -> Vec<bf16> {
    match dtype {
        Dtype::Bf16 => bytes_to_bf16(rows)
            .iter()
            .enumerate()
            .map(|(i, v)| bf16::from_f32(v.to_f32() * 1.5 + (i % hidden % 7) as f32 * 0.125))
            .collect(),
        Dtype::Fp8E4m3 => rows
            .iter()
            .map(|&b| bf16::from_f32((b as i8) as f32 / 8.0))
            .collect(),
    }
}

/// Dispatches, compares every output with the reference, then combines with
/// both input layouts and compares. Panics on a mismatch.
fn check_normal(shape: &Shape, run: &Run, rank: usize, ctx: &Ctx) {
    let topo = shape.topo();
    let (hidden, topk, world) = (shape.hidden, shape.topk, shape.world);
    let local = topo.local_experts();
    let dtype = dtype_of(run.fp8);
    let row_bytes = dtype.row_bytes(hidden);
    let cols = dtype.scales_per_row(hidden);
    let inputs: Vec<Input> = (0..world).map(|r| input(shape, run, r)).collect();
    let refs = dispatch_all(topo, dtype, &inputs, run.alignment);
    let d = &refs[rank];
    let me = &inputs[rank];
    let what = format!("rank {rank} {shape:?} {run:?}");

    let (mut worst_recv, mut worst_expert) = (0, 0);
    let status = unsafe {
        ep_get_dispatch_capacity(
            ctx.0,
            run.alignment as i32,
            &mut worst_recv,
            &mut worst_expert,
        )
    };
    assert_eq!(status, EP_SUCCESS);
    let (rc, ec) = if run.no_sync {
        (worst_recv as usize, worst_expert as usize)
    } else {
        (d.num_rows + 3, d.expert_rows + 3)
    };
    let mut recv_x = poisoned::<u8>(rc * row_bytes);
    let mut recv_scales = poisoned::<f32>(rc * cols);
    let mut recv_idx = poisoned::<i32>(rc * topk);
    let mut recv_w = poisoned::<f32>(rc * topk);
    let mut recv_src = poisoned::<i32>(rc * 2);
    let mut recv_n = poisoned::<i32>(1);
    let mut ex_x = poisoned::<u8>(ec * row_bytes);
    let mut ex_scales = poisoned::<f32>(ec * cols);
    let mut ex_w = poisoned::<f32>(ec);
    let mut ex_src = poisoned::<i32>(ec);
    let mut ex_off = poisoned::<i32>(local + 1);
    let mut ex_cnt = poisoned::<i32>(local);
    let mut host_n = poisoned::<i32>(1);
    let mut host_cnt = poisoned::<i32>(local);

    let mut a = dispatch_args();
    a.flags = if run.no_sync {
        EP_DISPATCH_NO_HOST_SYNC
    } else {
        0
    } | if run.keep_padding {
        EP_DISPATCH_KEEP_PADDING
    } else {
        0
    };
    a.num_tokens = me.num_tokens as i32;
    a.dtype = dtype_code(dtype);
    a.x = me.x.as_ptr() as *const _;
    a.x_scales = if run.fp8 { me.scales.as_ptr() } else { null() };
    a.topk_idx = me.topk_idx.as_ptr();
    a.topk_weights = me.topk_weights.as_ptr();
    a.recv_capacity = rc as i32;
    a.expert_alignment = run.alignment as i32;
    a.recv_x = recv_x.as_mut_ptr() as *mut _;
    a.recv_x_scales = if run.fp8 {
        recv_scales.as_mut_ptr()
    } else {
        null_mut()
    };
    a.recv_topk_idx = recv_idx.as_mut_ptr();
    a.recv_topk_weights = recv_w.as_mut_ptr();
    a.recv_src_info = recv_src.as_mut_ptr();
    a.recv_num_tokens = recv_n.as_mut_ptr();
    a.expert_capacity = ec as i32;
    a.expert_x = ex_x.as_mut_ptr() as *mut _;
    a.expert_x_scales = if run.fp8 {
        ex_scales.as_mut_ptr()
    } else {
        null_mut()
    };
    a.expert_weights = ex_w.as_mut_ptr();
    a.expert_src_row = ex_src.as_mut_ptr();
    a.expert_offsets = ex_off.as_mut_ptr();
    a.expert_counts = ex_cnt.as_mut_ptr();
    a.host_recv_num_tokens = host_n.as_mut_ptr();
    a.host_expert_counts = host_cnt.as_mut_ptr();
    let handle = ctx.handle();
    let status = unsafe { ep_dispatch(ctx.0, &a, handle.0, null_mut()) };
    assert_eq!(status, EP_SUCCESS, "{what}: {}", last_error());

    let rows = d.num_rows;
    assert_eq!(recv_n[0] as usize, rows, "{what}: recv_num_tokens");
    assert!(recv_x[..rows * row_bytes] == d.x[..], "{what}: recv_x");
    assert!(
        is_poisoned(&recv_x[rows * row_bytes..]),
        "{what}: recv_x written past its rows"
    );
    if run.fp8 {
        assert_eq!(
            bits(&recv_scales[..rows * cols]),
            bits(&d.scales),
            "{what}: recv scales"
        );
    }
    assert_eq!(
        recv_idx[..rows * topk],
        d.topk_idx[..],
        "{what}: recv_topk_idx"
    );
    assert_eq!(
        bits(&recv_w[..rows * topk]),
        bits(&d.topk_weights),
        "{what}: recv weights"
    );
    assert_eq!(recv_src[..rows * 2], d.src_info[..], "{what}: src_info");
    assert_eq!(ex_off, d.expert_offsets, "{what}: expert_offsets");
    assert_eq!(ex_cnt, d.expert_counts, "{what}: expert_counts");
    let erows = d.expert_rows;
    assert_eq!(
        ex_src[..erows],
        d.expert_src_row[..],
        "{what}: expert_src_row"
    );
    assert_eq!(
        bits(&ex_w[..erows]),
        bits(&d.expert_weights),
        "{what}: expert_weights"
    );
    for j in (0..erows).filter(|&j| d.expert_src_row[j] >= 0) {
        assert!(
            ex_x[j * row_bytes..][..row_bytes] == d.expert_x[j * row_bytes..][..row_bytes],
            "{what}: expert_x row {j}"
        );
        if run.fp8 {
            assert_eq!(
                bits(&ex_scales[j * cols..][..cols]),
                bits(&d.expert_scales[j * cols..][..cols]),
                "{what}: expert scales row {j}"
            );
        }
    }
    // Padding rows: zeros, or as they were with EP_DISPATCH_KEEP_PADDING.
    for j in (0..erows).filter(|&j| d.expert_src_row[j] < 0) {
        let row = &ex_x[j * row_bytes..][..row_bytes];
        let scales = bits(&ex_scales[j * cols..][..cols]);
        if run.keep_padding {
            assert!(is_poisoned(row), "{what}: padding row {j} written");
            assert!(
                !run.fp8 || is_poisoned(&ex_scales[j * cols..][..cols]),
                "{what}: padding scales of row {j} written"
            );
        } else {
            assert!(
                row.iter().all(|&b| b == 0),
                "{what}: padding row {j} not zero"
            );
            assert!(
                !run.fp8 || scales.iter().all(|&b| b == 0),
                "{what}: padding scales of row {j} not zero"
            );
        }
    }
    assert!(
        is_poisoned(&ex_x[erows * row_bytes..]),
        "{what}: expert_x written past its rows"
    );
    if run.no_sync {
        assert!(
            is_poisoned(&host_n) && is_poisoned(&host_cnt),
            "{what}: host outputs written under NO_HOST_SYNC"
        );
    } else {
        assert_eq!(host_n[0] as usize, rows, "{what}: host_recv_num_tokens");
        assert_eq!(host_cnt, d.expert_counts, "{what}: host_expert_counts");
    }

    // Combine, source order: the expert function of each received row.
    let y_src: Vec<Vec<bf16>> = refs
        .iter()
        .map(|r| expert_fn(&r.x, dtype, hidden))
        .collect();
    let returned: Vec<Returned> = (0..world)
        .map(|r| Returned {
            rows: &y_src[r],
            src_info: &refs[r].src_info,
        })
        .collect();
    let want = combine_reference(ctx, topo, rank, me.num_tokens, &returned);
    let mut out = poisoned::<bf16>(me.num_tokens * hidden);
    let mut c = combine_args();
    c.input_layout = EP_COMBINE_SOURCE_ORDER;
    c.x = y_src[rank].as_ptr() as *const _;
    c.out = out.as_mut_ptr() as *mut _;
    let status = unsafe { ep_combine(ctx.0, &c, handle.0, null_mut()) };
    assert_eq!(status, EP_SUCCESS, "{what}: combine: {}", last_error());
    assert!(
        bf16_to_bytes(&out) == bf16_to_bytes(&want),
        "{what}: source-order combine"
    );

    // Combine, expert-major: padding rows hold garbage that must be ignored.
    let y_em: Vec<Vec<bf16>> = refs
        .iter()
        .map(|r| {
            let mut y = expert_fn(&r.expert_x, dtype, hidden);
            for j in (0..r.expert_rows).filter(|&j| r.expert_src_row[j] < 0) {
                y[j * hidden..][..hidden].fill(bf16::from_f32(1.0e4));
            }
            y
        })
        .collect();
    let partials: Vec<Vec<bf16>> = (0..world)
        .map(|r| normal::expert_partials(topo, &refs[r], &y_em[r]))
        .collect();
    let returned: Vec<Returned> = (0..world)
        .map(|r| Returned {
            rows: &partials[r],
            src_info: &refs[r].src_info,
        })
        .collect();
    let want = combine_reference(ctx, topo, rank, me.num_tokens, &returned);
    let mut out = poisoned::<bf16>(me.num_tokens * hidden);
    c.input_layout = EP_COMBINE_EXPERT_MAJOR;
    c.x = y_em[rank].as_ptr() as *const _;
    c.out = out.as_mut_ptr() as *mut _;
    let status = unsafe { ep_combine(ctx.0, &c, handle.0, null_mut()) };
    assert_eq!(status, EP_SUCCESS, "{what}: combine: {}", last_error());
    assert!(
        bf16_to_bytes(&out) == bf16_to_bytes(&want),
        "{what}: expert-major combine"
    );
}

/// The combine the context must give: single-node, or node partials first
/// when the context has several nodes.
fn combine_reference(
    ctx: &Ctx,
    topo: Topology,
    rank: usize,
    n: usize,
    returned: &[Returned],
) -> Vec<bf16> {
    let (mut rpn, mut nodes) = (0, 0);
    let status = unsafe { ep_ctx_get_node_info(ctx.0, &mut rpn, &mut nodes) };
    assert_eq!(status, EP_SUCCESS, "{}", last_error());
    assert_eq!(rpn * nodes, topo.world as i32);
    if nodes > 1 {
        let shape = NodeShape::new(topo.world, rpn as usize);
        hierarchical::combine(topo, shape, rank, n, returned)
    } else {
        normal::combine(topo, rank, n, returned)
    }
}

fn random_run(rng: &mut Rng, world: usize, fp8_ok: bool, bf16_ok: bool) -> Run {
    let choices = [0usize, 1, 17, 100];
    Run {
        tokens: (0..world).map(|_| choices[rng.below(4)]).collect(),
        skewed: rng.chance(0.5),
        fp8: fp8_ok && (!bf16_ok || rng.chance(0.5)),
        alignment: [1, 16][rng.below(2)],
        no_sync: rng.chance(0.5),
        keep_padding: rng.chance(0.5),
        seed: rng.next_u64(),
    }
}

/// Every shape of the sweep: world {1, 2, 4}, hidden {128, 256, 2048}, topk
/// {1, 4, 8}, experts {8, 64}.
fn all_shapes() -> Vec<Shape> {
    let mut out = Vec::new();
    for world in [1, 2, 4] {
        for hidden in [128, 256, 2048] {
            for topk in [1, 4, 8] {
                for experts in [8, 64] {
                    out.push(Shape {
                        world,
                        hidden,
                        topk,
                        experts,
                    });
                }
            }
        }
    }
    out
}

/// A sample of the shapes: every (world, hidden) pair, with topk and experts
/// drawn by a fixed seed, plus the extreme corners.
fn sampled_shapes(seed: u64) -> Vec<Shape> {
    let mut rng = Rng::new(seed);
    let all = all_shapes();
    let mut out: Vec<Shape> = Vec::new();
    for world in [1, 2, 4] {
        for hidden in [128, 256, 2048] {
            let group: Vec<&Shape> = all
                .iter()
                .filter(|s| s.world == world && s.hidden == hidden)
                .collect();
            out.push(*group[rng.below(group.len())]);
        }
    }
    out.push(Shape {
        world: 4,
        hidden: 128,
        topk: 8,
        experts: 8,
    });
    out.push(Shape {
        world: 4,
        hidden: 256,
        topk: 1,
        experts: 64,
    });
    out
}

#[test]
fn normal_dispatch_and_combine_match_reference() {
    let mut rng = Rng::new(0x5eed_0001);
    for (i, shape) in all_shapes().into_iter().enumerate() {
        // Alternate the configured token type; a BF16 context carries both.
        let token_dtype = if i % 3 == 2 {
            EP_DTYPE_FP8_E4M3
        } else {
            EP_DTYPE_BF16
        };
        let mut runs: Vec<Run> = (0..3)
            .map(|_| random_run(&mut rng, shape.world, true, token_dtype == EP_DTYPE_BF16))
            .collect();
        // One run where every rank sends the maximum and routing is skewed.
        runs.push(Run {
            tokens: vec![MAX_TOKENS as usize; shape.world],
            skewed: true,
            fp8: token_dtype == EP_DTYPE_FP8_E4M3,
            alignment: 16,
            no_sync: i % 2 == 0,
            keep_padding: i % 2 == 1,
            seed: rng.next_u64(),
        });
        let cfg = shape.config(token_dtype, 0);
        run_world(shape.world, &cfg, |rank, ctx| {
            for run in &runs {
                check_normal(&shape, run, rank, ctx);
            }
        });
    }
}

/// Several nodes (`ranks_per_node` below the world size, virtual nodes of
/// one host): dispatch gives the single-node results, combine the
/// hierarchical summation order; the low-latency mode is unchanged.
#[test]
fn hierarchical_node_shapes_match_reference() {
    let mut rng = Rng::new(0x5eed_0002);
    for (world, rpn) in [(2, 1), (4, 1), (4, 2), (6, 2), (6, 3), (8, 2), (8, 4)] {
        let shape = Shape {
            world,
            hidden: [128, 256][rng.below(2)],
            topk: [1, 4, 8][rng.below(3)],
            experts: 48 / world * world,
        };
        let mut cfg = shape.config(EP_DTYPE_BF16, LL_MAX);
        cfg.ranks_per_node = rpn;
        let runs: Vec<Run> = (0..3)
            .map(|_| random_run(&mut rng, world, true, true))
            .collect();
        let mode = LlMode {
            out_dtype: EP_DTYPE_FP8_E4M3,
            ue8m0: false,
            dispatch_weights: true,
            combine_weights: false,
            zero_copy: false,
            split: true,
            count_in_memory: false,
        };
        let ll_tokens: Vec<usize> = (0..world).map(|r| [0, 1, 17, LL_MAX][r % 4]).collect();
        let seed = rng.next_u64();
        run_world(world, &cfg, |rank, ctx| {
            let (mut got_rpn, mut nodes) = (0, 0);
            unsafe { ep_ctx_get_node_info(ctx.0, &mut got_rpn, &mut nodes) };
            assert_eq!((got_rpn, nodes), (rpn, world as i32 / rpn));
            for run in &runs {
                check_normal(&shape, run, rank, ctx);
            }
            check_ll(&shape, mode, &ll_tokens, seed, rank, ctx);
        });
    }
}

/// `ranks_per_node = 0` on one host: one node of every rank.
#[test]
fn ranks_per_node_zero_means_one_node_per_host() {
    let shape = Shape {
        world: 4,
        hidden: 128,
        topk: 4,
        experts: 8,
    };
    let cfg = shape.config(EP_DTYPE_BF16, 0);
    run_world(4, &cfg, |_, ctx| {
        let (mut rpn, mut nodes) = (-1, -1);
        let status = unsafe { ep_ctx_get_node_info(ctx.0, &mut rpn, &mut nodes) };
        assert_eq!(status, EP_SUCCESS);
        assert_eq!((rpn, nodes), (4, 1));
    });
}

#[test]
fn normal_zero_tokens_everywhere() {
    let shape = Shape {
        world: 2,
        hidden: 128,
        topk: 4,
        experts: 8,
    };
    let cfg = shape.config(EP_DTYPE_BF16, 0);
    run_world(2, &cfg, |rank, ctx| {
        for (fp8, no_sync) in [(false, false), (true, true)] {
            let run = Run {
                tokens: vec![0, 0],
                skewed: false,
                fp8,
                alignment: 1,
                no_sync,
                keep_padding: no_sync,
                seed: 7,
            };
            check_normal(&shape, &run, rank, ctx);
        }
    });
}

#[test]
fn normal_ranks_as_processes() {
    let shape = Shape {
        world: 2,
        hidden: 256,
        topk: 4,
        experts: 8,
    };
    let runs = [
        Run {
            tokens: vec![17, 100],
            skewed: true,
            fp8: false,
            alignment: 16,
            no_sync: false,
            keep_padding: false,
            seed: 42,
        },
        Run {
            tokens: vec![1, 0],
            skewed: false,
            fp8: true,
            alignment: 1,
            no_sync: true,
            keep_padding: false,
            seed: 43,
        },
    ];
    let cfg = shape.config(EP_DTYPE_BF16, 0);
    run_ranks_in_processes(
        "normal_ranks_as_processes",
        "world 2",
        shape.world,
        |rank, id| Ctx::create(shape.world as i32, id, rank as i32, &cfg),
        |rank, ctx| {
            for run in &runs {
                check_normal(&shape, run, rank, ctx);
            }
        },
    );
}

#[test]
fn layout_matches_reference() {
    let mut rng = Rng::new(0x1a7);
    for shape in sampled_shapes(5) {
        let cfg = shape.config(EP_DTYPE_BF16, 0);
        let seeds: Vec<u64> = (0..3).map(|_| rng.next_u64()).collect();
        run_world(shape.world, &cfg, |rank, ctx| {
            for (i, &seed) in seeds.iter().enumerate() {
                let mut r = Rng::new(seed ^ rank as u64);
                let n = [0usize, 1, 17, 100][(i + rank) % 4];
                let hot = (i == 1).then_some(0);
                let idx = routing(&mut r, shape.experts, shape.topk, n, 0.2, hot);
                let want = dispatch_layout(shape.topo(), &idx, n).unwrap();
                let mut per_rank = poisoned::<i32>(shape.world);
                let mut per_expert = poisoned::<i32>(shape.experts);
                let mut in_rank = poisoned::<u8>(n * shape.world);
                let status = unsafe {
                    ep_get_dispatch_layout(
                        ctx.0,
                        idx.as_ptr(),
                        n as i32,
                        per_rank.as_mut_ptr(),
                        per_expert.as_mut_ptr(),
                        in_rank.as_mut_ptr(),
                        null_mut(),
                    )
                };
                assert_eq!(status, EP_SUCCESS, "{}", last_error());
                assert_eq!(per_rank, want.tokens_per_rank, "{shape:?} n={n}");
                assert_eq!(per_expert, want.tokens_per_expert, "{shape:?} n={n}");
                assert_eq!(in_rank, want.is_token_in_rank, "{shape:?} n={n}");
            }
        });
    }
}

/// Dispatches `input` with only the source-order output and returns its status
/// and rows.
fn dispatch_simple(
    ctx: &Ctx,
    handle: &Handle,
    inp: &Input,
    flags: u32,
    capacity: usize,
    hidden: usize,
    topk: usize,
) -> (ep_status_t, Vec<u8>) {
    let mut recv_x = poisoned::<u8>(capacity * hidden * 2);
    let mut recv_idx = poisoned::<i32>(capacity * topk);
    let mut recv_w = poisoned::<f32>(capacity * topk);
    let mut recv_src = poisoned::<i32>(capacity * 2);
    let mut a = dispatch_args();
    a.flags = flags;
    a.num_tokens = inp.num_tokens as i32;
    a.x = inp.x.as_ptr() as *const _;
    a.topk_idx = inp.topk_idx.as_ptr();
    a.topk_weights = inp.topk_weights.as_ptr();
    a.recv_capacity = capacity as i32;
    a.recv_x = recv_x.as_mut_ptr() as *mut _;
    a.recv_topk_idx = recv_idx.as_mut_ptr();
    a.recv_topk_weights = recv_w.as_mut_ptr();
    a.recv_src_info = recv_src.as_mut_ptr();
    let status = unsafe { ep_dispatch(ctx.0, &a, handle.0, null_mut()) };
    (status, recv_x)
}

#[test]
fn reuse_layout_same_routing_works_and_different_routing_is_rejected() {
    let shape = Shape {
        world: 2,
        hidden: 128,
        topk: 4,
        experts: 8,
    };
    let cfg = shape.config(EP_DTYPE_BF16, 0);
    run_world(2, &cfg, |rank, ctx| {
        let run = Run {
            tokens: vec![17, 9],
            skewed: false,
            fp8: false,
            alignment: 1,
            no_sync: false,
            keep_padding: false,
            seed: 99,
        };
        let inputs: Vec<Input> = (0..2).map(|r| input(&shape, &run, r)).collect();
        let want = dispatch_all(shape.topo(), Dtype::Bf16, &inputs, 1).swap_remove(rank);
        let handle = ctx.handle();
        let cap = 2 * MAX_TOKENS as usize;
        let me = &inputs[rank];
        let (status, _) = dispatch_simple(ctx, &handle, me, 0, cap, 128, 4);
        assert_eq!(status, EP_SUCCESS, "{}", last_error());
        // Same routing, new token values: reused layout, fresh rows.
        let mut shifted: Vec<Input> = inputs
            .iter()
            .map(|i| Input {
                x: i.x.iter().map(|b| b.wrapping_add(1)).collect(),
                ..i.clone()
            })
            .collect();
        let want_rows = dispatch_all(shape.topo(), Dtype::Bf16, &shifted, 1)
            .swap_remove(rank)
            .x;
        let mut again = shifted.swap_remove(rank);
        let (status, rows) =
            dispatch_simple(ctx, &handle, &again, EP_DISPATCH_REUSE_LAYOUT, cap, 128, 4);
        assert_eq!(status, EP_SUCCESS, "{}", last_error());
        assert_eq!(want_rows.len(), want.x.len());
        assert!(
            rows[..want_rows.len()] == want_rows[..],
            "rank {rank}: reused-layout rows"
        );
        // Different routing on every rank: rejected before any exchange.
        let first = again.topk_idx.iter().position(|&e| e >= 0).unwrap();
        again.topk_idx[first] = -1;
        let (status, _) =
            dispatch_simple(ctx, &handle, &again, EP_DISPATCH_REUSE_LAYOUT, cap, 128, 4);
        assert_eq!(status, EP_ERR_INVALID_ARGUMENT);
        let msg = last_error();
        assert!(
            msg.contains("ep_dispatch") && msg.contains("REUSE_LAYOUT"),
            "{msg}"
        );
    });
}

/// How one low-latency round is run.
#[derive(Clone, Copy, Debug)]
struct LlMode {
    out_dtype: i32,
    ue8m0: bool,
    dispatch_weights: bool,
    /// Weights passed to the combine (else NULL: the dispatch's are used).
    combine_weights: bool,
    zero_copy: bool,
    split: bool,
    /// The token count is passed in memory (`device_num_tokens`), with
    /// `num_tokens` = `LL_MAX` as its bound.
    count_in_memory: bool,
}

/// Every rank's low-latency inputs ([`LlTokens`]): `tokens[r]` tokens on
/// rank r.
fn ll_inputs(shape: &Shape, seed: u64, tokens: &[usize]) -> LlTokens {
    let shape = calls::Shape {
        world: shape.world,
        hidden: shape.hidden,
        topk: shape.topk,
        experts: shape.experts,
        max_tokens: MAX_TOKENS as usize,
        ll_max: LL_MAX,
    };
    LlTokens::new(&shape, seed, tokens)
}

fn check_ll(shape: &Shape, mode: LlMode, tokens: &[usize], seed: u64, rank: usize, ctx: &Ctx) {
    let topo = shape.topo();
    let (world, hidden, m) = (shape.world, shape.hidden, LL_MAX);
    let local = topo.local_experts();
    let slots = local * world * m;
    let dtype = dtype_of(mode.out_dtype == EP_DTYPE_FP8_E4M3);
    let (row_bytes, cols) = (dtype.row_bytes(hidden), dtype.scales_per_row(hidden));
    let what = format!("rank {rank} {shape:?} {mode:?} tokens {tokens:?}");
    let all = ll_inputs(shape, seed, tokens);
    let sources = all.sources(mode.dispatch_weights);
    let refs: Vec<LlDispatched> = (0..world)
        .map(|r| ll_dispatch(topo, m, &sources, r, dtype, mode.ue8m0))
        .collect();
    let d = &refs[rank];
    let n = tokens[rank];
    let (mut x, mut idx, mut w) = (
        all.x[rank].clone(),
        all.idx[rank].clone(),
        all.w[rank].clone(),
    );
    // With the count in memory, the arrays have room for the bound; the rows
    // past the count hold ids no call may read (they are not valid experts).
    let (bound, tokens_in_memory) = (if mode.count_in_memory { m } else { n }, n as i32);
    x.resize(bound * hidden, bf16::from_f32(f32::NAN));
    idx.resize(bound * shape.topk, i32::MAX);
    w.resize(bound * shape.topk, f32::NAN);

    let mut recv_x = poisoned::<u8>(slots * row_bytes);
    let mut recv_scales = poisoned::<f32>(slots * cols);
    let mut count = poisoned::<i32>(local);
    let mut src = poisoned::<i32>(slots);
    let mut range = poisoned::<i32>(local * world * 2);
    let mut a = ll_dispatch_args();
    a.num_tokens = bound as i32;
    if mode.count_in_memory {
        a.device_num_tokens = &tokens_in_memory;
    }
    a.out_dtype = mode.out_dtype;
    a.x = x.as_ptr() as *const _;
    a.topk_idx = idx.as_ptr();
    // A rank of no tokens passes no weights even when the others do (an
    // empty array is often NULL, as torch's is): it counts as given them.
    let no_tokens = n == 0 && !mode.count_in_memory;
    a.topk_weights = if mode.dispatch_weights && !no_tokens {
        w.as_ptr()
    } else {
        null()
    };
    a.recv_x = recv_x.as_mut_ptr() as *mut _;
    a.recv_x_scales = if cols > 0 {
        recv_scales.as_mut_ptr()
    } else {
        null_mut()
    };
    a.recv_count = count.as_mut_ptr();
    a.recv_src_info = src.as_mut_ptr();
    a.recv_layout_range = range.as_mut_ptr();
    let ue = if mode.ue8m0 { EP_LL_UE8M0_SCALES } else { 0 };
    let phases: &[u32] = if mode.split {
        &[EP_LL_SEND_ONLY, EP_LL_RECV_ONLY]
    } else {
        &[0]
    };
    for &phase in phases {
        a.flags = phase | ue;
        let status = unsafe { ep_ll_dispatch(ctx.0, &a, null_mut()) };
        assert_eq!(status, EP_SUCCESS, "{what}: ll_dispatch: {}", last_error());
    }
    assert_eq!(count, d.recv_count, "{what}: recv_count");
    assert_eq!(range, d.recv_layout_range, "{what}: layout_range");
    for le in 0..local {
        let rows = le * world * m..le * world * m + d.recv_count[le] as usize;
        assert!(
            recv_x[rows.start * row_bytes..rows.end * row_bytes]
                == d.recv_x[rows.start * row_bytes..rows.end * row_bytes],
            "{what}: recv_x of local expert {le}"
        );
        assert_eq!(
            bits(&recv_scales[rows.start * cols..rows.end * cols]),
            bits(&d.recv_scales[rows.start * cols..rows.end * cols]),
            "{what}: scales of local expert {le}"
        );
        assert_eq!(
            src[rows.clone()],
            d.recv_src_info[rows.clone()],
            "{what}: src_info of local expert {le}"
        );
    }

    // Combine: every rank's experts apply the expert function to their rows.
    let ys: Vec<Vec<bf16>> = refs
        .iter()
        .map(|r| expert_fn(&r.recv_x, dtype, hidden))
        .collect();
    let experts: Vec<LlExpertOutputs> = (0..world)
        .map(|r| LlExpertOutputs {
            y: &ys[r],
            src_info: &refs[r].recv_src_info,
            layout_range: &refs[r].recv_layout_range,
            weights: refs[r].recv_weights.as_deref(),
        })
        .collect();
    let combine_w: Vec<f32> = w.iter().map(|v| v * 0.75).collect();
    let given = mode.combine_weights.then_some(&combine_w[..]);
    let k = n * shape.topk;
    let want = ll_combine(
        topo,
        m,
        rank,
        n,
        &idx[..k],
        given.map(|g| &g[..k]),
        &experts,
    );
    let mut out = poisoned::<bf16>(bound * hidden);
    let mut c = ll_combine_args();
    c.num_tokens = bound as i32;
    if mode.count_in_memory {
        c.device_num_tokens = &tokens_in_memory;
    }
    c.topk_idx = idx.as_ptr();
    c.topk_weights = given.map_or(null(), |g| g.as_ptr());
    c.src_info = src.as_ptr();
    c.layout_range = range.as_ptr();
    c.out = out.as_mut_ptr() as *mut _;
    let mut zc = 0;
    if mode.zero_copy {
        let mut buf = null_mut();
        let mut bytes = 0usize;
        let status = unsafe { ep_ll_get_combine_buffer(ctx.0, &mut buf, &mut bytes) };
        assert_eq!(status, EP_SUCCESS, "{}", last_error());
        assert_eq!(bytes, slots * hidden * 2, "{what}: combine buffer size");
        unsafe {
            std::ptr::copy_nonoverlapping(ys[rank].as_ptr(), buf as *mut bf16, slots * hidden)
        };
        zc = EP_LL_ZERO_COPY;
    } else {
        c.x = ys[rank].as_ptr() as *const _;
    }
    for &phase in phases {
        c.flags = phase | zc;
        let status = unsafe { ep_ll_combine(ctx.0, &c, null_mut()) };
        assert_eq!(status, EP_SUCCESS, "{what}: ll_combine: {}", last_error());
    }
    assert!(
        bf16_to_bytes(&out[..n * hidden]) == bf16_to_bytes(&want),
        "{what}: ll_combine output"
    );
    assert!(
        is_poisoned(&out[n * hidden..]),
        "{what}: ll_combine wrote past the token count"
    );
}

#[test]
fn low_latency_matches_reference() {
    let mut rng = Rng::new(0x11_2233);
    let shapes = [
        Shape {
            world: 1,
            hidden: 256,
            topk: 4,
            experts: 8,
        },
        Shape {
            world: 2,
            hidden: 128,
            topk: 8,
            experts: 8,
        },
        Shape {
            world: 2,
            hidden: 2048,
            topk: 1,
            experts: 64,
        },
        Shape {
            world: 4,
            hidden: 128,
            topk: 4,
            experts: 64,
        },
        Shape {
            world: 4,
            hidden: 256,
            topk: 8,
            experts: 8,
        },
    ];
    for shape in shapes {
        let cfg = shape.config(EP_DTYPE_BF16, LL_MAX);
        // Alternating calls on one context with changing token counts and modes.
        let rounds: Vec<(LlMode, Vec<usize>, u64)> = (0..6)
            .map(|i| {
                let out_dtype = if i % 3 == 1 {
                    EP_DTYPE_BF16
                } else {
                    EP_DTYPE_FP8_E4M3
                };
                let dispatch_weights = i % 2 == 0;
                let mode = LlMode {
                    out_dtype,
                    ue8m0: out_dtype == EP_DTYPE_FP8_E4M3 && i % 4 == 2,
                    dispatch_weights,
                    combine_weights: !dispatch_weights || rng.chance(0.5),
                    zero_copy: i % 3 == 2,
                    split: i % 2 == 1 || i == 4,
                    count_in_memory: i % 3 == 0,
                };
                let tokens = (0..shape.world)
                    .map(|_| [0usize, 1, 17, LL_MAX][rng.below(4)])
                    .collect();
                (mode, tokens, rng.next_u64())
            })
            .collect();
        run_world(shape.world, &cfg, |rank, ctx| {
            for (mode, tokens, seed) in &rounds {
                check_ll(&shape, *mode, tokens, *seed, rank, ctx);
            }
        });
    }
}

#[test]
fn low_latency_and_normal_mode_interleave() {
    let shape = Shape {
        world: 2,
        hidden: 128,
        topk: 4,
        experts: 8,
    };
    let cfg = shape.config(EP_DTYPE_BF16, LL_MAX);
    run_world(2, &cfg, |rank, ctx| {
        for i in 0..3u64 {
            let mode = LlMode {
                out_dtype: EP_DTYPE_FP8_E4M3,
                ue8m0: i == 1,
                dispatch_weights: true,
                combine_weights: i == 2,
                zero_copy: i == 0,
                split: i != 2,
                count_in_memory: i == 1,
            };
            check_ll(&shape, mode, &[17, 3], 100 + i, rank, ctx);
            let run = Run {
                tokens: vec![9, 17],
                skewed: i == 1,
                fp8: i == 2,
                alignment: 16,
                no_sync: false,
                keep_padding: false,
                seed: 200 + i,
            };
            check_normal(&shape, &run, rank, ctx);
        }
    });
}

/// ep-bench's device timestamps exist on GPUs only: the host backend says
/// so instead of returning an empty timeline.
#[test]
fn device_timestamps_are_refused_on_the_host_backend() {
    let shape = Shape {
        world: 1,
        hidden: 128,
        topk: 4,
        experts: 8,
    };
    let cfg = shape.config(EP_DTYPE_BF16, LL_MAX);
    run_world(1, &cfg, |_, ctx| {
        // SAFETY: a live context.
        let keep = unsafe { ll_keep_timeline(ctx.0, true) }.unwrap_err();
        assert_eq!(keep.kind, ep::error::ErrorKind::Unsupported, "{keep:?}");
        // SAFETY: as above.
        let read = unsafe { ll_timeline(ctx.0) }.unwrap_err();
        assert!(read.message.contains("GPU backend only"), "{read:?}");
    });
}

#[test]
fn low_latency_count_in_memory_out_of_range_is_an_error_and_sends_nothing() {
    let shape = Shape {
        world: 2,
        hidden: 128,
        topk: 4,
        experts: 8,
    };
    let (hidden, m, local) = (shape.hidden, LL_MAX, 4);
    let cfg = shape.config(EP_DTYPE_BF16, m);
    run_world(2, &cfg, |rank, ctx| {
        let n = 4;
        let all = ll_inputs(&shape, 5, &[n, n]);
        let (x, idx, w) = (&all.x[rank], &all.idx[rank], &all.w[rank]);
        // Rank 0 passes counts above its bound (dispatch) and below zero
        // (combine); rank 1 passes its count.
        let (dispatch_count, combine_count) = if rank == 0 { (5, -1) } else { (4, 4) };
        let mut recv_x = poisoned::<u8>(local * 2 * m * hidden);
        let mut recv_scales = poisoned::<f32>(local * 2 * m * hidden / 128);
        let mut count = poisoned::<i32>(local);
        let mut src = poisoned::<i32>(local * 2 * m);
        let mut range = poisoned::<i32>(local * 2 * 2);
        let mut a = ll_dispatch_args();
        a.num_tokens = n as i32;
        a.device_num_tokens = &dispatch_count;
        a.x = x.as_ptr() as *const _;
        a.topk_idx = idx.as_ptr();
        a.topk_weights = w.as_ptr();
        a.recv_x = recv_x.as_mut_ptr() as *mut _;
        a.recv_x_scales = recv_scales.as_mut_ptr();
        a.recv_count = count.as_mut_ptr();
        a.recv_src_info = src.as_mut_ptr();
        a.recv_layout_range = range.as_mut_ptr();
        // Rank 0's calls fail with a message naming its count; the others'
        // succeed.
        let expect = |status: ep_status_t, count: i32| {
            if rank == 0 {
                assert_eq!(status, EP_ERR_INVALID_ARGUMENT);
                let msg = last_error();
                assert!(
                    msg.contains(&format!("device_num_tokens = {count}")),
                    "{msg}"
                );
            } else {
                assert_eq!(status, EP_SUCCESS, "{}", last_error());
            }
        };
        expect(
            unsafe { ep_ll_dispatch(ctx.0, &a, null_mut()) },
            dispatch_count,
        );
        // Every rank received no rows from rank 0.
        for le in 0..local {
            assert_eq!(range[le * 4 + 1], 0, "rank {rank}: rows from rank 0");
        }

        let y = vec![bf16::from_f32(1.0); local * 2 * m * hidden];
        let mut out = poisoned::<bf16>(n * hidden);
        let mut c = ll_combine_args();
        c.num_tokens = n as i32;
        c.device_num_tokens = &combine_count;
        c.x = y.as_ptr() as *const _;
        c.topk_idx = idx.as_ptr();
        c.src_info = src.as_ptr();
        c.layout_range = range.as_ptr();
        c.out = out.as_mut_ptr() as *mut _;
        expect(
            unsafe { ep_ll_combine(ctx.0, &c, null_mut()) },
            combine_count,
        );
        if rank == 0 {
            assert!(is_poisoned(&out), "rank 0 wrote output rows");
        }
    });
}
