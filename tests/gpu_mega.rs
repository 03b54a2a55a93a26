//! The fused calls (`ep_mega_dispatch_gemm`, `ep_mega_gemm_combine`) on real
//! GPUs against the reference (`ep::reference::mega` and `normal`, the code
//! the host backend runs), on fresh random inputs with poisoned outputs:
//! - the dispatch's expert-major outputs bit for bit;
//! - GEMM rows within the documented tolerance (every row of small cases,
//!   a sample of rows of large ones: each expert's first and last rows and
//!   random ones), padding rows of the first GEMM zero, of the second
//!   untouched;
//! - the combined tokens bit for bit against the reference combine of the
//!   GEMM rows the GPU produced (the combine is exact given its input);
//!
//! over hidden / k in {2048, 4096, 7168}, n in {1024, 2048, 4096}, 8 to 256
//! experts, 0, 1, 17, 128 and 4096 tokens, uniform routing with dropped slots
//! and experts without rows, every row on one expert, BF16 and FP8; and a
//! CUDA graph of both calls captured once and replayed 100 times with fresh
//! routing. The world size is a parameter: 1, and 2 (two GPUs, or two
//! ranks sharing one). Both kernel variants run (single blocks, the
//! default, and clusters of 2 blocks sharing weight tiles:
//! `EP_MEGA_CLUSTER`), and the combine's GEMM both in one column band and
//! in several (`EP_MEGA_COMBINE_BANDS`; by default calls of 1024 tokens or
//! more use bands: 4 in BF16, 3 in FP8). Needs a
//! Hopper GPU: `cargo test --release --test gpu_mega -- --ignored`.

mod common;

use common::calls::combine_reference;
use common::gpu::*;
use common::mega::*;
use common::normal::{dispatch_all, DeviceInput, Input};
use common::{bits, dtype_code, is_poisoned, last_error, Ctx, Handle, Rng};
use ep::capi::*;
use ep::reference::mega::RowResult;
use ep::reference::normal::{worst_case_rows, Dispatched};
use ep::reference::Dtype;
use half::bf16;
use std::time::Instant;

/// Rows of a GEMM output checked against the reference: all of them up to
/// this many, else a sample of this size.
const CHECKED_ROWS: usize = 48;

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
    y1: DevBuf,
    x2: DevBuf,
    x2_scales: DevBuf,
    w2: DevBuf,
    w2_scales: DevBuf,
    y2: DevBuf,
    out: DevBuf,
}

/// What a rank's host side holds of one case: its inputs and weights.
struct RankData {
    tokens: Input,
    w1: Weights,
    w2: Weights,
    x2: Vec<u8>,
    x2_scales: Vec<f32>,
}

/// What a rank reads back after its two calls.
struct Results {
    offsets: Vec<i32>,
    counts: Vec<i32>,
    expert_x: Vec<u8>,
    expert_scales: Vec<f32>,
    expert_weights: Vec<f32>,
    expert_src_row: Vec<i32>,
    y1: Vec<bf16>,
    y2: Vec<bf16>,
    out: Vec<bf16>,
}

fn capacity(case: &MegaCase) -> usize {
    worst_case_rows(case.topo(), case.max_tokens(), case.alignment).1
}

fn rank_data(case: &MegaCase, rank: usize) -> RankData {
    let (x2, x2_scales) = activations(case, rank, capacity(case));
    RankData {
        tokens: tokens(case, rank),
        w1: weights1(case, rank),
        w2: weights2(case, rank),
        x2,
        x2_scales,
    }
}

impl Buffers {
    fn new(case: &MegaCase, data: &RankData) -> Buffers {
        let cap = capacity(case);
        let (dtype, hidden, l) = (case.dtype, case.hidden, case.local_experts());
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
            y1: DevBuf::of::<bf16>(cap * case.n),
            x2: DevBuf::from(&data.x2),
            x2_scales: DevBuf::from(&data.x2_scales),
            w2: DevBuf::from(&data.w2.data),
            w2_scales: DevBuf::from(&data.w2.scales),
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
            &self.y2,
            &self.out,
        ] {
            b.poison();
        }
    }

    fn dispatch_args(&self, case: &MegaCase, num_tokens: usize) -> ep_dispatch_args_t {
        let mut a = common::dispatch_args();
        a.num_tokens = num_tokens as i32;
        a.dtype = dtype_code(case.dtype);
        a.x = self.input.x.as_const();
        a.x_scales = self.input.scales.as_const();
        a.topk_idx = self.input.topk_idx.as_const();
        a.topk_weights = self.input.topk_weights.as_const();
        a.expert_alignment = case.alignment as i32;
        a.expert_capacity = capacity(case) as i32;
        a.expert_x = self.expert_x.as_mut();
        a.expert_x_scales = self.expert_scales.as_mut();
        a.expert_weights = self.expert_weights.as_mut();
        a.expert_src_row = self.expert_src_row.as_mut();
        a.expert_offsets = self.expert_offsets.as_mut();
        a.expert_counts = self.expert_counts.as_mut();
        if case.keep_padding {
            a.flags |= EP_DISPATCH_KEEP_PADDING;
        }
        a
    }

    fn combine_args(&self) -> ep_combine_args_t {
        let mut c = common::combine_args();
        c.input_layout = EP_COMBINE_EXPERT_MAJOR;
        c.x = self.x2.as_const();
        c.out = self.out.as_mut();
        c
    }

    /// The arguments of both calls; `dispatch` and `combine` must outlive
    /// the calls.
    fn mega_args(
        &self,
        case: &MegaCase,
        dispatch: &ep_dispatch_args_t,
        combine: &ep_combine_args_t,
    ) -> (ep_mega_args_t, ep_mega_args_t) {
        let mut m1 = common::mega_args();
        m1.dispatch = dispatch;
        m1.weight_dtype = dtype_code(case.dtype);
        m1.n = case.n as i32;
        m1.k = case.hidden as i32;
        m1.weights = self.w1.as_const();
        m1.weight_scales = self.w1_scales.as_const();
        m1.y = self.y1.as_mut();
        let mut m2 = common::mega_args();
        m2.combine = combine;
        m2.weight_dtype = dtype_code(case.dtype);
        m2.n = case.hidden as i32;
        m2.k = case.k2 as i32;
        m2.weights = self.w2.as_const();
        m2.weight_scales = self.w2_scales.as_const();
        m2.x_scales = self.x2_scales.as_const();
        m2.y = self.y2.as_mut();
        (m1, m2)
    }

    fn download(&self, case: &MegaCase, want: &Dispatched, num_tokens: usize) -> Results {
        let (dtype, hidden, l) = (case.dtype, case.hidden, case.local_experts());
        let rows = want.expert_rows;
        Results {
            offsets: self.expert_offsets.download(l + 1),
            counts: self.expert_counts.download(l),
            expert_x: self.expert_x.download(rows * dtype.row_bytes(hidden)),
            expert_scales: self
                .expert_scales
                .download(rows * dtype.scales_per_row(hidden)),
            expert_weights: self.expert_weights.download(rows),
            expert_src_row: self.expert_src_row.download(rows),
            y1: self.y1.download(rows * case.n),
            y2: self.y2.download(rows * hidden),
            out: self.out.download(num_tokens * hidden),
        }
    }
}

/// Runs both calls on one rank's buffers and waits for them.
fn run_calls(ctx: &Ctx, handle: &Handle, case: &MegaCase, b: &Buffers, n: usize, what: &str) {
    let d = b.dispatch_args(case, n);
    let c = b.combine_args();
    let (m1, m2) = b.mega_args(case, &d, &c);
    // SAFETY: every pointer holds what the API asks for.
    unsafe {
        ok(
            ep_mega_dispatch_gemm(ctx.0, &m1, handle.0, stream()),
            &format!("{what}: dispatch+GEMM"),
        );
        ok(
            ep_mega_gemm_combine(ctx.0, &m2, handle.0, stream()),
            &format!("{what}: GEMM+combine"),
        );
    }
    sync();
    assert_eq!(async_status(ctx), EP_SUCCESS, "{what}: {}", last_error());
}

/// The expert-major rows of `d` whose GEMM rows are checked: all real rows,
/// or each expert's first and last real row and random ones.
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

/// The reference rows of a GEMM, computed on all cores.
fn reference_rows_parallel(
    d: &Dispatched,
    w: &Weights,
    input: &[u8],
    scales: &[f32],
    rows: &[usize],
) -> Vec<RowResult> {
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let chunk = rows.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        let parts: Vec<_> = rows
            .chunks(chunk)
            .map(|part| s.spawn(move || reference_rows(d, w, input, scales, part)))
            .collect();
        parts.into_iter().flat_map(|h| h.join().unwrap()).collect()
    })
}

/// Checks the GEMM rows `rows` of `got` (`n` wide) against the reference;
/// returns the worst ratio of error to tolerance.
#[allow(clippy::too_many_arguments)]
fn check_gemm_rows(
    d: &Dispatched,
    w: &Weights,
    input: &[u8],
    scales: &[f32],
    rows: &[usize],
    got: &[bf16],
    n: usize,
    what: &str,
) -> f32 {
    let want = reference_rows_parallel(d, w, input, scales, rows);
    rows.iter()
        .zip(&want)
        .map(|(&j, r)| check_row(w.dtype, &got[j * n..][..n], r, &format!("{what}: row {j}")))
        .fold(0.0, f32::max)
}

/// Checks one rank's dispatch outputs and GEMM rows; returns the worst
/// error ratios of the two GEMMs.
fn check_rank(
    case: &MegaCase,
    d: &Dispatched,
    data: &RankData,
    r: &Results,
    rng: &mut Rng,
    what: &str,
) -> (f32, f32) {
    let (n, hidden, keep) = (case.n, case.hidden, case.keep_padding);
    assert_eq!(r.offsets, d.expert_offsets, "{what}: offsets");
    assert_eq!(r.counts, d.expert_counts, "{what}: counts");
    let (x, scales) = (&r.expert_x, &r.expert_scales);
    check_dispatched_rows(case.dtype, hidden, d, x, scales, keep, what);
    assert_eq!(
        bits(&r.expert_weights),
        bits(&d.expert_weights),
        "{what}: weights"
    );
    assert_eq!(r.expert_src_row, d.expert_src_row, "{what}: src rows");
    for j in 0..d.expert_rows {
        if d.expert_src_row[j] < 0 {
            let y1 = &r.y1[j * n..][..n];
            if keep {
                assert!(
                    is_poisoned(y1),
                    "{what}: padding row {j} of the first GEMM was written"
                );
            } else {
                assert!(
                    y1.iter().all(|v| v.to_bits() == 0),
                    "{what}: padding row {j} of the first GEMM is not zero"
                );
            }
            assert!(
                is_poisoned(&r.y2[j * hidden..][..hidden]),
                "{what}: padding row {j} of the second GEMM was written"
            );
        }
    }
    let rows = checked_rows(d, rng);
    let worst1 = check_gemm_rows(
        d,
        &data.w1,
        &d.expert_x,
        &d.expert_scales,
        &rows,
        &r.y1,
        n,
        &format!("{what}: first GEMM"),
    );
    let worst2 = check_gemm_rows(
        d,
        &data.w2,
        &data.x2,
        &data.x2_scales,
        &rows,
        &r.y2,
        hidden,
        &format!("{what}: second GEMM"),
    );
    (worst1, worst2)
}

/// Checks every rank's combined tokens against the reference combine of
/// the second GEMM's rows the GPU produced.
fn check_combines(case: &MegaCase, refs: &[Dispatched], results: &[Results], what: &str) {
    let rows: Vec<Vec<bf16>> = results.iter().map(|r| r.y2.clone()).collect();
    for (rank, r) in results.iter().enumerate() {
        let want = combine_reference(case.topo(), rank, case.tokens[rank], refs, &rows, true);
        let same = r
            .out
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{what}: rank {rank}: combined tokens");
    }
}

/// Selects the fused kernels' cluster size (1 or 2) for the contexts
/// created after this call (the library reads `EP_MEGA_CLUSTER` when a
/// context is created; the tests run one at a time).
fn use_cluster(size: usize) {
    std::env::set_var("EP_MEGA_CLUSTER", size.to_string());
}

/// Selects the fused combine's column bands (1 to 8; `None`: the library's
/// choice) for the contexts created after this call, as `use_cluster`.
fn use_bands(bands: Option<usize>) {
    match bands {
        Some(bands) => std::env::set_var("EP_MEGA_COMBINE_BANDS", bands.to_string()),
        None => std::env::remove_var("EP_MEGA_COMBINE_BANDS"),
    }
}

/// Runs one case on `case.world` GPUs and checks everything.
fn run_case(case: &MegaCase) {
    let start = Instant::now();
    let what = format!(
        "cluster {} bands {} world {} hidden {} n {} k2 {} experts {} topk {} {:?} {:?} tokens {:?} alignment {}{}",
        std::env::var("EP_MEGA_CLUSTER").unwrap_or_default(),
        std::env::var("EP_MEGA_COMBINE_BANDS").unwrap_or_else(|_| "default".into()),
        case.world,
        case.hidden,
        case.n,
        case.k2,
        case.experts,
        case.topk,
        case.dtype,
        case.routing,
        case.tokens,
        case.alignment,
        if case.keep_padding { ", padding kept" } else { "" }
    );
    let all = all_tokens(case);
    let refs = dispatch_all(case.topo(), case.dtype, &all, case.alignment);
    drop(all);
    let cfg = gpu_config(
        case.hidden as i32,
        case.topk as i32,
        case.experts as i32,
        case.max_tokens() as i32,
        0,
        20_000,
    );
    let results: Vec<(RankData, Results)> = run_gpu_world(case.world, &cfg, |rank, ctx| {
        let data = rank_data(case, rank);
        let b = Buffers::new(case, &data);
        b.poison_outputs();
        let handle = ctx.handle();
        run_calls(ctx, &handle, case, &b, case.tokens[rank], &what);
        let r = b.download(case, &refs[rank], case.tokens[rank]);
        (data, r)
    });
    let mut rng = Rng::new(case.seed ^ 0x5a5a);
    let mut worst = (0f32, 0f32);
    for (rank, (data, r)) in results.iter().enumerate() {
        let w = check_rank(
            case,
            &refs[rank],
            data,
            r,
            &mut rng,
            &format!("{what} rank {rank}"),
        );
        worst = (worst.0.max(w.0), worst.1.max(w.1));
    }
    let only: Vec<Results> = results.into_iter().map(|(_, r)| r).collect();
    check_combines(case, &refs, &only, &what);
    println!(
        "{what}: ok in {:.1} s; worst error / tolerance: first GEMM {:.3}, second {:.3}",
        start.elapsed().as_secs_f64(),
        worst.0,
        worst.1
    );
}

/// 1 and 2 ranks (on one GPU the two share it, each with half its SMs; not
/// on NCCL communicators, which refuse two ranks on one GPU).
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
    n: usize,
    k2: usize,
    experts: usize,
    dtype: Dtype,
    tokens: usize,
    seed: u64,
) -> MegaCase {
    MegaCase {
        world,
        hidden,
        topk: 8,
        experts,
        n,
        k2,
        dtype,
        routing: Routing::Uniform,
        alignment: 1,
        tokens: vec![tokens; world],
        seed,
        keep_padding: false,
    }
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn small_and_uneven_cases_match_the_reference() {
    // Clusters of 2 with the combine's GEMM in 3 column bands (BF16 and
    // FP8), single blocks with the library's choice (one band here).
    for (world, cluster) in worlds().into_iter().flat_map(|w| [(w, 2), (w, 1)]) {
        use_cluster(cluster);
        use_bands(if cluster == 2 { Some(3) } else { None });
        for dtype in [Dtype::Bf16, Dtype::Fp8E4m3] {
            // 0, 1 and 17 tokens; 8, 64 and 256 experts; alignments 1, 16, 128.
            let mut c = case(world, 2048, 1024, 2048, 8, dtype, 0, 11);
            c.tokens = (0..world).map(|r| r % 2).collect();
            run_case(&c);
            let mut c = case(world, 4096, 2048, 1024, 64, dtype, 17, 12);
            c.alignment = 16;
            run_case(&c);
            let mut c = case(world, 2048, 1024, 2048, 256, dtype, 17, 13);
            c.alignment = 128;
            c.tokens = (0..world).map(|r| 17 - r).collect();
            run_case(&c);
            // Every row on one expert, the other experts empty.
            let mut c = case(world, 2048, 1024, 1024, 8, dtype, 1000, 14);
            c.routing = Routing::OneExpert;
            run_case(&c);
            // Padding rows kept (EP_DISPATCH_KEEP_PADDING), alignment 128.
            let mut c = case(world, 2048, 1024, 1024, 16, dtype, 33, 15);
            c.alignment = 128;
            c.keep_padding = true;
            run_case(&c);
        }
    }
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn decode_shape_matches_the_reference() {
    // 32 experts, 128 tokens of top-8: about 32 rows per expert.
    use_bands(None);
    for cluster in [2, 1] {
        use_cluster(cluster);
        for dtype in [Dtype::Bf16, Dtype::Fp8E4m3] {
            run_case(&case(1, 7168, 4096, 2048, 32, dtype, 128, 21));
        }
    }
    // As bench/mega_bench.py's decode with --keep-padding: alignment 128,
    // padding rows kept.
    for dtype in [Dtype::Bf16, Dtype::Fp8E4m3] {
        let mut c = case(1, 7168, 4096, 2048, 32, dtype, 128, 22);
        c.alignment = 128;
        c.keep_padding = true;
        run_case(&c);
    }
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn w3_shape_matches_the_reference() {
    // One rank of EP8 at 4096 tokens: 32 experts of about 1024 rows,
    // hidden 7168, n 4096 (gate+up), k 2048 (down); single blocks, then
    // the BF16 case in clusters of 2. The combines run in the library's
    // column bands (4 in BF16, 3 in FP8).
    use_bands(None);
    use_cluster(1);
    for dtype in [Dtype::Bf16, Dtype::Fp8E4m3] {
        run_case(&case(1, 7168, 4096, 2048, 32, dtype, 4096, 31));
    }
    // 256 experts, hidden 4096.
    run_case(&case(1, 4096, 2048, 1024, 256, Dtype::Fp8E4m3, 4096, 32));
    use_cluster(2);
    run_case(&case(1, 7168, 4096, 2048, 32, Dtype::Bf16, 4096, 33));
}

#[test]
#[ignore = "needs a Hopper GPU"]
fn both_calls_replay_in_a_cuda_graph_with_fresh_routing() {
    let mut c = case(1, 1024, 1024, 512, 16, Dtype::Bf16, 128, 41);
    c.topk = 4;
    c.alignment = 8;
    // Every combine in 4 column bands but the last configuration's.
    for (dtype, cluster, bands) in [
        (Dtype::Bf16, 2, Some(4)),
        (Dtype::Fp8E4m3, 2, Some(4)),
        (Dtype::Bf16, 1, None),
    ] {
        use_cluster(cluster);
        use_bands(bands);
        c.dtype = dtype;
        let cfg = gpu_config(1024, 4, 16, 128, 0, 20_000);
        run_gpu_world(1, &cfg, |_, ctx| {
            let data = rank_data(&c, 0);
            let b = Buffers::new(&c, &data);
            let handle = ctx.handle();
            let d = b.dispatch_args(&c, 128);
            let cm = b.combine_args();
            let (m1, m2) = b.mega_args(&c, &d, &cm);
            let graph = Graph::capture(|stream| {
                // SAFETY: every pointer holds what the API asks for.
                unsafe {
                    ok(
                        ep_mega_dispatch_gemm(ctx.0, &m1, handle.0, stream),
                        "capture dispatch",
                    );
                    ok(
                        ep_mega_gemm_combine(ctx.0, &m2, handle.0, stream),
                        "capture combine",
                    );
                }
            });
            let mut rng = Rng::new(99);
            for replay in 0..100 {
                let mut fresh = c.clone();
                fresh.seed = c.seed + 1000 + replay;
                let tokens = tokens(&fresh, 0);
                b.input.upload(&tokens);
                b.poison_outputs();
                graph.replay();
                assert_eq!(
                    async_status(ctx),
                    EP_SUCCESS,
                    "replay {replay}: {}",
                    last_error()
                );
                let want =
                    dispatch_all(fresh.topo(), fresh.dtype, &[tokens], fresh.alignment).remove(0);
                let r = b.download(&c, &want, 128);
                let what = format!("{dtype:?} cluster {cluster} replay {replay}");
                check_rank(&c, &want, &data, &r, &mut rng, &what);
                check_combines(
                    &c,
                    std::slice::from_ref(&want),
                    std::slice::from_ref(&r),
                    &what,
                );
            }
        });
    }
}
