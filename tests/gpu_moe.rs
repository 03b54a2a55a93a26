//! `ep_moe_forward` on real GPUs against the reference (`ep::reference`,
//! the code the host backend runs), stage by stage, on fresh random inputs
//! with every output poisoned first:
//! - the dispatch's expert-major outputs bit for bit;
//! - `y1` within the fused GEMM's tolerance (`ep::reference::mega`) of the
//!   reference GEMM of the dispatched rows (every real row of small cases,
//!   a sample of large ones), its padding rows zero;
//! - `act` (and the FP8 scales) bit for bit against the reference SwiGLU
//!   (`ep::reference::moe::activate_row`) of the GPU's own `y1`, on every
//!   real row; padding rows untouched;
//! - `y2` within the GEMM tolerance of the reference GEMM of the GPU's own
//!   `act`, padding rows untouched; the combined tokens bit for bit against
//!   the reference combine of the GPU's own `y2` (the combine is exact
//!   given its input);
//! - small cases also against the straightforward f64 computation of
//!   `tests/common/moe.rs`;
//!
//! over BF16 and FP8, hidden 2048 to 7168, intermediate 512 to 2048, 8 to
//! 256 experts, 0, 1, 17, 128 and 1000 tokens, dropped slots, a hot expert
//! and experts without rows, alignments 1 to 128; and one call captured in
//! a CUDA graph, replayed with fresh routing. World sizes 1 and 2 (two
//! GPUs, or two ranks sharing one). Needs a Hopper GPU:
//! `cargo test --release --test gpu_moe -- --ignored`.

mod common;

use common::calls::combine_reference;
use common::gpu::*;
use common::mega::{check_dispatched_rows, check_row, reference_rows, Weights};
use common::moe::*;
use common::normal::{dispatch_all, DeviceInput};
use common::{bits, bytes_of, dtype_code, is_poisoned, last_error, Ctx, Handle, Rng};
use ep::capi::*;
use ep::reference::moe::activate_row;
use ep::reference::normal::Dispatched;
use ep::reference::Dtype;
use half::bf16;
use std::time::Instant;

/// Rows of a GEMM checked against the reference: all real rows up to this
/// many, else a sample of this size.
const CHECKED_ROWS: usize = 48;

/// Cases whose stages are also computed in f64 from the definition: at
/// most this many real rows on a rank.
const INDEPENDENT_ROWS: usize = 64;

/// A rank's device buffers of one case.
struct Buffers {
    input: DeviceInput,
    expert_x: DevBuf,
    expert_scales: DevBuf,
    expert_weights: DevBuf,
    expert_src_row: DevBuf,
    expert_offsets: DevBuf,
    expert_counts: DevBuf,
    w1: DevBuf,
    w1_scales: DevBuf,
    w2: DevBuf,
    w2_scales: DevBuf,
    y1: DevBuf,
    act: DevBuf,
    act_scales: DevBuf,
    y2: DevBuf,
    out: DevBuf,
}

/// What a rank reads back: the dispatch's expert-major outputs and
/// [`MoeOutputs`].
struct Results {
    expert_x: Vec<u8>,
    expert_scales: Vec<f32>,
    expert_weights: Vec<f32>,
    expert_src_row: Vec<i32>,
    moe: MoeOutputs,
}

impl Buffers {
    fn new(case: &MoeCase, data: &RankData) -> Buffers {
        let cap = case.capacity();
        let (dtype, hidden, i, l) = (
            case.dtype,
            case.hidden,
            case.intermediate,
            case.local_experts(),
        );
        Buffers {
            input: DeviceInput::new(&data.tokens),
            expert_x: DevBuf::poisoned(cap * dtype.row_bytes(hidden)),
            expert_scales: DevBuf::of::<f32>(cap * hidden / 128),
            expert_weights: DevBuf::of::<f32>(cap),
            expert_src_row: DevBuf::of::<i32>(cap),
            expert_offsets: DevBuf::of::<i32>(l + 1),
            expert_counts: DevBuf::of::<i32>(l),
            w1: DevBuf::from(&data.w1.data),
            w1_scales: DevBuf::from(&data.w1.scales),
            w2: DevBuf::from(&data.w2.data),
            w2_scales: DevBuf::from(&data.w2.scales),
            y1: DevBuf::of::<bf16>(cap * 2 * i),
            act: DevBuf::poisoned(cap * dtype.row_bytes(i)),
            act_scales: DevBuf::of::<f32>(cap * i / 128),
            y2: DevBuf::of::<bf16>(cap * hidden),
            out: DevBuf::of::<bf16>(case.max_tokens() * hidden),
        }
    }

    fn poison_outputs(&self) {
        for b in [
            &self.expert_x,
            &self.expert_scales,
            &self.expert_weights,
            &self.expert_src_row,
            &self.expert_offsets,
            &self.expert_counts,
            &self.y1,
            &self.act,
            &self.act_scales,
            &self.y2,
            &self.out,
        ] {
            b.poison();
        }
    }

    /// The three argument structs of a call of `num_tokens` tokens; the
    /// moe args point at the other two, so they are returned boxed.
    fn args(
        &self,
        case: &MoeCase,
        num_tokens: usize,
    ) -> Box<(ep_dispatch_args_t, ep_combine_args_t, ep_moe_args_t)> {
        let fp8 = case.dtype == Dtype::Fp8E4m3;
        let mut d = common::dispatch_args();
        d.num_tokens = num_tokens as i32;
        d.dtype = dtype_code(case.dtype);
        d.x = self.input.x.as_const();
        d.x_scales = self.input.scales.as_const();
        d.topk_idx = self.input.topk_idx.as_const();
        d.topk_weights = self.input.topk_weights.as_const();
        d.expert_alignment = case.alignment as i32;
        d.expert_capacity = case.capacity() as i32;
        d.expert_x = self.expert_x.as_mut();
        d.expert_x_scales = self.expert_scales.as_mut();
        d.expert_weights = self.expert_weights.as_mut();
        d.expert_src_row = self.expert_src_row.as_mut();
        d.expert_offsets = self.expert_offsets.as_mut();
        d.expert_counts = self.expert_counts.as_mut();
        if case.keep_padding {
            d.flags |= EP_DISPATCH_KEEP_PADDING;
        }
        let mut c = common::combine_args();
        c.input_layout = EP_COMBINE_EXPERT_MAJOR;
        c.out = self.out.as_mut();
        let mut m = std::mem::MaybeUninit::uninit();
        // SAFETY: the init function fills the whole struct.
        let mut m: ep_moe_args_t = unsafe {
            ok(ep_moe_args_init(m.as_mut_ptr()), "ep_moe_args_init");
            m.assume_init()
        };
        m.weight_dtype = dtype_code(case.dtype);
        m.intermediate = case.intermediate as i32;
        m.w1 = self.w1.as_const();
        m.w2 = self.w2.as_const();
        if fp8 {
            m.w1_scales = self.w1_scales.as_const();
            m.w2_scales = self.w2_scales.as_const();
            m.act_scales = self.act_scales.as_mut();
        }
        m.y1 = self.y1.as_mut();
        m.act = self.act.as_mut();
        m.y2 = self.y2.as_mut();
        let mut all = Box::new((d, c, m));
        all.2.dispatch = &all.0;
        all.2.combine = &all.1;
        all
    }

    fn download(&self, case: &MoeCase, want: &Dispatched, num_tokens: usize) -> Results {
        let cap = case.capacity();
        let (dtype, hidden, i, l) = (
            case.dtype,
            case.hidden,
            case.intermediate,
            case.local_experts(),
        );
        let rows = want.expert_rows;
        Results {
            expert_x: self.expert_x.download(rows * dtype.row_bytes(hidden)),
            expert_scales: self
                .expert_scales
                .download(rows * dtype.scales_per_row(hidden)),
            expert_weights: self.expert_weights.download(rows),
            expert_src_row: self.expert_src_row.download(rows),
            moe: MoeOutputs {
                offsets: self.expert_offsets.download(l + 1),
                counts: self.expert_counts.download(l),
                y1: self.y1.download(cap * 2 * i),
                act: self.act.download(cap * dtype.row_bytes(i)),
                act_scales: self.act_scales.download(cap * dtype.scales_per_row(i)),
                y2: self.y2.download(cap * hidden),
                out: self.out.download(num_tokens * hidden),
            },
        }
    }
}

/// Runs one call on a rank's buffers and waits for it.
fn run_call(ctx: &Ctx, handle: &Handle, case: &MoeCase, b: &Buffers, n: usize, what: &str) {
    let args = b.args(case, n);
    // SAFETY: every pointer holds what the API asks for.
    unsafe {
        ok(
            ep_moe_forward(ctx.0, &args.2, handle.0, stream()),
            &format!("{what}: ep_moe_forward"),
        );
    }
    sync();
    assert_eq!(async_status(ctx), EP_SUCCESS, "{what}: {}", last_error());
}

/// The real expert-major rows of `d` whose GEMM rows are checked: all of
/// them, or each expert's first and last and random ones.
fn checked_rows(d: &Dispatched, rng: &mut Rng) -> Vec<usize> {
    let real: Vec<usize> = (0..d.expert_rows)
        .filter(|&j| d.expert_src_row[j] >= 0)
        .collect();
    if real.len() <= CHECKED_ROWS {
        return real;
    }
    let mut rows = Vec::new();
    for (e, &count) in d.expert_counts.iter().enumerate() {
        if count > 0 && rows.len() < CHECKED_ROWS / 2 {
            let start = d.expert_offsets[e] as usize;
            rows.push(start);
            rows.push(start + count as usize - 1);
        }
    }
    while rows.len() < CHECKED_ROWS {
        rows.push(real[rng.below(real.len())]);
    }
    rows.sort_unstable();
    rows.dedup();
    rows
}

/// Checks the GEMM rows `rows` of `got` (`w.n` wide) against the reference
/// GEMM of `input`, on all cores; returns the worst error / tolerance.
fn check_gemm_rows(
    d: &Dispatched,
    w: &Weights,
    input: (&[u8], &[f32]),
    rows: &[usize],
    got: &[bf16],
    what: &str,
) -> f32 {
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let chunk = rows.len().div_ceil(threads).max(1);
    let want: Vec<_> = std::thread::scope(|s| {
        let parts: Vec<_> = rows
            .chunks(chunk)
            .map(|part| s.spawn(move || reference_rows(d, w, input.0, input.1, part)))
            .collect();
        parts.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    let n = w.n;
    rows.iter()
        .zip(&want)
        .map(|(&j, r)| check_row(w.dtype, &got[j * n..][..n], r, &format!("{what}: row {j}")))
        .fold(0.0, f32::max)
}

/// Checks one rank's dispatch outputs and stages (see the file comment);
/// returns the worst error ratios of the two GEMMs.
fn check_rank(
    case: &MoeCase,
    d: &Dispatched,
    data: &RankData,
    r: &Results,
    rng: &mut Rng,
    what: &str,
) -> (f32, f32) {
    let (hidden, i, dtype) = (case.hidden, case.intermediate, case.dtype);
    let (act_bytes, act_cols) = (dtype.row_bytes(i), dtype.scales_per_row(i));
    let m = &r.moe;
    assert_eq!(m.offsets, d.expert_offsets, "{what}: offsets");
    assert_eq!(m.counts, d.expert_counts, "{what}: counts");
    let keep = case.keep_padding;
    let (x, scales) = (&r.expert_x, &r.expert_scales);
    check_dispatched_rows(dtype, hidden, d, x, scales, keep, what);
    assert_eq!(
        bits(&r.expert_weights),
        bits(&d.expert_weights),
        "{what}: weights"
    );
    assert_eq!(r.expert_src_row, d.expert_src_row, "{what}: src rows");
    let rows = d.expert_rows;
    assert!(
        is_poisoned(&m.y1[rows * 2 * i..]),
        "{what}: y1 after the rows"
    );
    assert!(
        is_poisoned(&m.act[rows * act_bytes..]),
        "{what}: act after the rows"
    );
    assert!(
        is_poisoned(&m.y2[rows * hidden..]),
        "{what}: y2 after the rows"
    );
    let (mut row_act, mut row_scales) = (vec![0u8; act_bytes], vec![0f32; act_cols]);
    for j in 0..rows {
        let act = &m.act[j * act_bytes..][..act_bytes];
        let scales = &m.act_scales[j * act_cols..][..act_cols];
        if d.expert_src_row[j] < 0 {
            let y1 = &m.y1[j * 2 * i..][..2 * i];
            if keep {
                assert!(is_poisoned(y1), "{what}: padding row {j} of y1 was written");
            } else {
                assert!(
                    y1.iter().all(|v| v.to_bits() == 0),
                    "{what}: padding row {j} of y1 is not zero"
                );
            }
            assert!(
                is_poisoned(act),
                "{what}: padding row {j} of act was written"
            );
            assert!(
                is_poisoned(scales),
                "{what}: padding row {j} of the act scales"
            );
            assert!(
                is_poisoned(&m.y2[j * hidden..][..hidden]),
                "{what}: padding row {j} of y2 was written"
            );
            continue;
        }
        // SwiGLU of the GPU's own y1, bit for bit.
        activate_row(
            dtype,
            &m.y1[j * 2 * i..][..2 * i],
            &mut row_act,
            &mut row_scales,
        );
        if act != &row_act[..] || bits(scales) != bits(&row_scales) {
            let c = (0..act_bytes).find(|&c| act[c] != row_act[c]);
            panic!(
                "{what}: act row {j} differs from the reference SwiGLU of y1 (first byte {c:?})"
            );
        }
    }
    let checked = checked_rows(d, rng);
    let worst1 = check_gemm_rows(
        d,
        &data.w1,
        (&d.expert_x, &d.expert_scales),
        &checked,
        &m.y1,
        &format!("{what}: y1"),
    );
    let worst2 = check_gemm_rows(
        d,
        &data.w2,
        (&m.act, &m.act_scales),
        &checked,
        &m.y2,
        &format!("{what}: y2"),
    );
    (worst1, worst2)
}

/// Checks every rank's combined tokens against the reference combine of
/// the `y2` rows the GPU produced.
fn check_combines(case: &MoeCase, refs: &[Dispatched], results: &[&Results], what: &str) {
    let rows: Vec<Vec<bf16>> = refs
        .iter()
        .zip(results)
        .map(|(d, r)| r.moe.y2[..d.expert_rows * case.hidden].to_vec())
        .collect();
    for (rank, r) in results.iter().enumerate() {
        let want = combine_reference(case.topo(), rank, case.tokens[rank], refs, &rows, true);
        assert!(
            bytes_of(&r.moe.out) == bytes_of(&want),
            "{what}: rank {rank}: combined tokens"
        );
    }
}

/// Runs one case on `case.world` ranks and checks everything.
fn run_case(case: &MoeCase) {
    let start = Instant::now();
    let what = format!(
        "world {} hidden {} I {} experts {} topk {} {:?} tokens {:?} alignment {} hot {:?}",
        case.world,
        case.hidden,
        case.intermediate,
        case.experts,
        case.topk,
        case.dtype,
        case.tokens,
        case.alignment,
        case.hot
    );
    let data: Vec<RankData> = (0..case.world).map(|r| rank_data(case, r)).collect();
    let inputs: Vec<_> = data.iter().map(|d| d.tokens.clone()).collect();
    let refs = dispatch_all(case.topo(), case.dtype, &inputs, case.alignment);
    drop(inputs);
    let cfg = gpu_config(
        case.hidden as i32,
        case.topk as i32,
        case.experts as i32,
        case.max_tokens() as i32,
        0,
        20_000,
    );
    let results: Vec<Results> = run_gpu_world(case.world, &cfg, |rank, ctx| {
        let b = Buffers::new(case, &data[rank]);
        let handle = ctx.handle();
        gate();
        run_call(ctx, &handle, case, &b, case.tokens[rank], &what);
        let r = b.download(case, &refs[rank], case.tokens[rank]);
        gate();
        r
    });
    let mut rng = Rng::new(case.seed ^ 0xa5a5);
    let mut worst = (0f32, 0f32);
    for (rank, r) in results.iter().enumerate() {
        let w = check_rank(
            case,
            &refs[rank],
            &data[rank],
            r,
            &mut rng,
            &format!("{what} rank {rank}"),
        );
        worst = (worst.0.max(w.0), worst.1.max(w.1));
    }
    let all: Vec<&Results> = results.iter().collect();
    check_combines(case, &refs, &all, &what);
    let most_rows = refs.iter().map(|d| d.expert_rows).max().unwrap_or(0);
    if most_rows <= INDEPENDENT_ROWS {
        let outs: Vec<MoeOutputs> = results.into_iter().map(|r| r.moe).collect();
        if let Err(e) = check_independent(case, &data, &outs, Mistake::None) {
            panic!("{what}: against the definition: {e}");
        }
    }
    println!(
        "{what}: ok in {:.1} s; worst error / tolerance: y1 {:.3}, y2 {:.3}",
        start.elapsed().as_secs_f64(),
        worst.0,
        worst.1
    );
}

/// 1 and 2 ranks (on one GPU the two share it; not on NCCL communicators,
/// which refuse two ranks on one GPU).
fn worlds() -> Vec<usize> {
    let gpus = device_count();
    assert!(gpus >= 1, "these tests need a GPU");
    let mut worlds = vec![1, 2];
    if nccl::requested() {
        worlds.retain(|&w| w <= gpus);
    }
    worlds
}

#[allow(clippy::too_many_arguments)]
fn case(
    world: usize,
    hidden: usize,
    intermediate: usize,
    experts: usize,
    dtype: Dtype,
    tokens: usize,
    seed: u64,
) -> MoeCase {
    MoeCase {
        world,
        hidden,
        intermediate,
        experts,
        topk: 8,
        dtype,
        alignment: 1,
        tokens: vec![tokens; world],
        drop: 0.1,
        hot: None,
        seed,
        keep_padding: false,
    }
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn small_and_uneven_cases_match_the_reference() {
    for world in worlds() {
        for dtype in [Dtype::Bf16, Dtype::Fp8E4m3] {
            // 0 and 1 tokens, then a few: every row checked against the
            // definition too.
            let mut c = case(world, 2048, 512, 8, dtype, 0, 11);
            c.tokens = (0..world).map(|r| r % 2).collect();
            run_case(&c);
            let mut c = case(world, 2048, 1024, 16, dtype, 5, 12);
            c.topk = 4;
            c.alignment = 16;
            c.tokens = (0..world).map(|r| 5 - 2 * r).collect();
            run_case(&c);
            // 64 experts, 17 tokens, alignment 128: mostly padding; then
            // the same with the padding rows kept (EP_DISPATCH_KEEP_PADDING).
            let mut c = case(world, 4096, 1024, 64, dtype, 17, 13);
            c.alignment = 128;
            run_case(&c);
            c.keep_padding = true;
            run_case(&c);
            // A hot expert, 256 experts: most of them without rows.
            let mut c = case(world, 2048, 512, 256, dtype, 17, 14);
            c.hot = Some(3);
            c.drop = 0.3;
            c.tokens = (0..world).map(|r| 17 - r).collect();
            run_case(&c);
        }
    }
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn decode_and_prefill_shapes_match_the_reference() {
    for dtype in [Dtype::Bf16, Dtype::Fp8E4m3] {
        // DeepSeek-V3's expert shape: hidden 7168, I 2048; 32 local
        // experts, 128 tokens of top-8 (decode).
        run_case(&case(1, 7168, 2048, 32, dtype, 128, 21));
        // 1000 tokens, a hot expert (about 850 rows on it).
        let mut c = case(1, 4096, 1024, 32, dtype, 1000, 22);
        c.hot = Some(5);
        run_case(&c);
    }
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn one_call_replays_in_a_cuda_graph_with_fresh_routing() {
    for dtype in [Dtype::Bf16, Dtype::Fp8E4m3] {
        let mut c = case(1, 1024, 512, 16, dtype, 64, 41);
        c.topk = 4;
        c.alignment = 8;
        let cfg = gpu_config(1024, 4, 16, 64, 0, 20_000);
        run_gpu_world(1, &cfg, |_, ctx| {
            let data = rank_data(&c, 0);
            let b = Buffers::new(&c, &data);
            let handle = ctx.handle();
            let args = b.args(&c, 64);
            let graph = Graph::capture(|stream| {
                // SAFETY: every pointer holds what the API asks for.
                unsafe {
                    ok(
                        ep_moe_forward(ctx.0, &args.2, handle.0, stream),
                        "capture ep_moe_forward",
                    );
                }
            });
            let mut rng = Rng::new(77);
            for replay in 0..20 {
                let mut fresh = c.clone();
                fresh.seed = c.seed + 1000 + replay;
                let tokens = rank_data(&fresh, 0).tokens;
                b.input.upload(&tokens);
                b.poison_outputs();
                graph.replay();
                assert_eq!(
                    async_status(ctx),
                    EP_SUCCESS,
                    "replay {replay}: {}",
                    last_error()
                );
                let want = dispatch_all(fresh.topo(), dtype, &[tokens], fresh.alignment).remove(0);
                let r = b.download(&c, &want, 64);
                let what = format!("{dtype:?} replay {replay}");
                check_rank(&c, &want, &data, &r, &mut rng, &what);
                check_combines(&c, std::slice::from_ref(&want), &[&r], &what);
            }
        });
    }
}
