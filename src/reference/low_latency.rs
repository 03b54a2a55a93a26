//! Low-latency mode: dispatch into a fixed-capacity masked layout per local
//! expert (optionally quantizing to FP8), and the matching combine.
//!
//! Each local expert owns a block of `W * M` rows (`W` = world, `M` =
//! `max_tokens`, the most tokens any one rank may send). Row `r` of local expert `le` is at index
//! `le * W * M + r`; only rows `[0, recv_count[le])` are valid.

use super::fp8::quantize_row;
use super::layout::validate_experts;
use super::{Dtype, Topology};
use half::bf16;

/// The tokens one rank sends into [`ll_dispatch`].
#[derive(Clone, Copy, Debug)]
pub struct LlRankTokens<'a> {
    /// Number of tokens on this rank (at most `max_tokens`).
    pub num_tokens: usize,
    /// `num_tokens * hidden` BF16 values, row-major.
    pub x: &'a [bf16],
    /// `num_tokens * topk` global expert ids, token-major; -1 = dropped.
    pub topk_idx: &'a [i32],
    /// `num_tokens * topk` routing weights, if given at dispatch.
    pub topk_weights: Option<&'a [f32]>,
}

/// What one rank receives from [`ll_dispatch`]. `L` = local experts, `W` =
/// world, `M` = `max_tokens`; every array is indexed by the row index
/// `le * W * M + r`, and rows past an expert's count are zero.
#[derive(Clone, Debug, PartialEq)]
pub struct LlDispatched {
    /// `[L * W * M * row_bytes]`: token rows, BF16 bytes or FP8 codes.
    pub recv_x: Vec<u8>,
    /// FP8: `[L * W * M * hidden / 128]` scales from `quantize_row`; BF16: empty.
    pub recv_scales: Vec<f32>,
    /// `[L]`: valid rows of each local expert.
    pub recv_count: Vec<i32>,
    /// `[L * W * M]`: token index of each row on its source rank (0 past the count).
    pub recv_src_info: Vec<i32>,
    /// `[L * W * 2]`: for (local expert, source rank), the (first row, row count)
    /// of that source's rows in the expert's block. A source that sent nothing has
    /// count 0 and first row where its rows would have started.
    pub recv_layout_range: Vec<i32>,
    /// `[L * W * M]`: the routing weight of each row's (token, expert), present
    /// when every source gave weights (0.0 past the count).
    pub recv_weights: Option<Vec<f32>>,
}

/// Dispatches the tokens of all ranks (`sources[s]` is rank `s`'s input) and
/// returns what `rank` receives, in the masked layout described in
/// [`LlDispatched`].
///
/// For each local expert `le`, the valid rows are packed by source rank
/// ascending; within one source there is one row per (token, slot) routed to the
/// expert, in token order then slot order (routing never lists an expert twice
/// for one token: see [`validate_experts`](super::layout::validate_experts)). With `out_dtype == Dtype::Fp8E4m3` each row is quantized with
/// [`quantize_row`] (`ue8m0` as given); with BF16 the bytes are copied and
/// `ue8m0` is ignored.
///
/// # Panics
/// If the topology is inconsistent, `sources.len() != world`, `rank >= world`, a
/// source has more than `max_tokens` tokens, a slice has the wrong length, a
/// source's `topk_idx` holds an invalid expert id (check with
/// [`validate_experts`] first), or an expert receives more than `W * M` rows
/// (possible only when tokens list one expert more than once).
pub fn ll_dispatch(
    topo: Topology,
    max_tokens: usize,
    sources: &[LlRankTokens],
    rank: usize,
    out_dtype: Dtype,
    ue8m0: bool,
) -> LlDispatched {
    topo.assert_consistent();
    assert_eq!(sources.len(), topo.world, "one input per rank");
    assert!(rank < topo.world, "rank {rank} out of range");
    let (world, topk, hidden) = (topo.world, topo.topk, topo.hidden);
    for (src, s) in sources.iter().enumerate() {
        assert!(
            s.num_tokens <= max_tokens,
            "source {src}: {} tokens > max_tokens {max_tokens}",
            s.num_tokens
        );
        assert_eq!(s.x.len(), s.num_tokens * hidden, "source {src}: x length");
        if let Some(w) = s.topk_weights {
            assert_eq!(w.len(), s.num_tokens * topk, "source {src}: weights length");
        }
        if let Err(e) = validate_experts(topo, s.topk_idx, s.num_tokens) {
            panic!("source {src}: {e}");
        }
    }
    let local_experts = topo.local_experts();
    let capacity = world * max_tokens;
    let rows = local_experts * capacity;
    let row_bytes = out_dtype.row_bytes(hidden);
    let row_scales = out_dtype.scales_per_row(hidden);
    let source_weights: Option<Vec<&[f32]>> = sources.iter().map(|s| s.topk_weights).collect();

    let mut out = LlDispatched {
        recv_x: vec![0; rows * row_bytes],
        recv_scales: vec![0.0; rows * row_scales],
        recv_count: vec![0; local_experts],
        recv_src_info: vec![0; rows],
        recv_layout_range: vec![0; local_experts * world * 2],
        recv_weights: source_weights.as_ref().map(|_| vec![0.0; rows]),
    };
    for le in 0..local_experts {
        let expert = (rank * local_experts + le) as i32;
        let mut count = 0;
        for (src, s) in sources.iter().enumerate() {
            let first = count;
            for token in 0..s.num_tokens {
                for slot in 0..topk {
                    if s.topk_idx[token * topk + slot] != expert {
                        continue;
                    }
                    assert!(
                        count < capacity,
                        "expert {expert} receives more than {capacity} rows"
                    );
                    let row = le * capacity + count;
                    let x = &s.x[token * hidden..][..hidden];
                    let dst = &mut out.recv_x[row * row_bytes..][..row_bytes];
                    match out_dtype {
                        Dtype::Bf16 => {
                            for (d, v) in dst.chunks_exact_mut(2).zip(x) {
                                d.copy_from_slice(&v.to_le_bytes());
                            }
                        }
                        Dtype::Fp8E4m3 => {
                            let scales = &mut out.recv_scales[row * row_scales..][..row_scales];
                            quantize_row(x, ue8m0, dst, scales);
                        }
                    }
                    out.recv_src_info[row] = token as i32;
                    if let (Some(recv), Some(given)) = (&mut out.recv_weights, &source_weights) {
                        recv[row] = given[src][token * topk + slot];
                    }
                    count += 1;
                }
            }
            let range = &mut out.recv_layout_range[(le * world + src) * 2..][..2];
            range.copy_from_slice(&[first as i32, (count - first) as i32]);
        }
        out.recv_count[le] = count as i32;
    }
    out
}

/// The outputs of one rank's experts, returned to [`ll_combine`].
#[derive(Clone, Copy, Debug)]
pub struct LlExpertOutputs<'a> {
    /// `[L * W * M * hidden]`: expert outputs in the masked layout.
    pub y: &'a [bf16],
    /// `[L * W * M]`: `recv_src_info` of that rank's dispatch.
    pub src_info: &'a [i32],
    /// `[L * W * 2]`: `recv_layout_range` of that rank's dispatch.
    pub layout_range: &'a [i32],
    /// `[L * W * M]`: `recv_weights` of that rank's dispatch, if any.
    pub weights: Option<&'a [f32]>,
}

impl LlExpertOutputs<'_> {
    fn assert_shapes(&self, topo: &Topology, max_tokens: usize, expert_rank: usize) {
        let rows = topo.local_experts() * topo.world * max_tokens;
        let r = expert_rank;
        assert_eq!(
            self.y.len(),
            rows * topo.hidden,
            "expert rank {r}: y length"
        );
        assert_eq!(
            self.src_info.len(),
            rows,
            "expert rank {r}: src_info length"
        );
        assert_eq!(
            self.layout_range.len(),
            topo.local_experts() * topo.world * 2,
            "expert rank {r}: layout_range length"
        );
        if let Some(w) = self.weights {
            assert_eq!(w.len(), rows, "expert rank {r}: weights length");
        }
    }

    /// The rows `source` sent to local expert `le`, as row indices into `y`.
    fn segment(
        &self,
        topo: &Topology,
        max_tokens: usize,
        le: usize,
        source: usize,
    ) -> std::ops::Range<usize> {
        let capacity = topo.world * max_tokens;
        let range = &self.layout_range[(le * topo.world + source) * 2..][..2];
        let [first, count] =
            [range[0], range[1]].map(|v| usize::try_from(v).expect("negative layout range"));
        assert!(
            first + count <= capacity,
            "layout range {range:?} exceeds the {capacity}-row block"
        );
        le * capacity + first..le * capacity + first + count
    }
}

/// Combines the expert outputs of all ranks (`experts[r]` is what rank `r`'s
/// experts produced) into the `num_tokens` tokens of `rank`, whose routing was
/// `topk_idx`.
///
/// With `topk_weights = Some(w)`:
/// `out[t] = bf16(sum over slots k ascending with topk_idx[t][k] != -1 of
/// w[t][k] * f32(y(t, k)))`, where `y(t, k)` is the row that (t, k) produced
/// in the segment `layout_range[le][rank]` of expert `topk_idx[t][k]` (on rank
/// `e / L`, local `le`). That segment holds this rank's (token, slot) pairs for
/// the expert in token-then-slot order, so the n-th pair is its n-th row.
///
/// With `None` (weights given at dispatch; the expert side reduces):
/// for each expert rank `r` ascending,
/// `partial_r[t] = bf16(sum of recv_weight * f32(y))` over the rows of `t` on
/// `r`, local experts ascending then row order; then
/// `out[t] = bf16(sum over r ascending of f32(partial_r[t]))` over the ranks
/// holding at least one of `t`'s experts.
///
/// Sums are in `f32` from 0.0, each product rounded before it is added. Tokens
/// with no experts are zero. The result is `[num_tokens * hidden]`.
///
/// # Panics
/// If the topology is inconsistent, `experts.len() != world`, a slice has the
/// wrong length, `topk_idx` holds an invalid expert id, weights are `None` and
/// some expert rank has no `weights`, or the layout does not match the routing
/// (a segment too short, or a row with the wrong `src_info`).
pub fn ll_combine(
    topo: Topology,
    max_tokens: usize,
    rank: usize,
    num_tokens: usize,
    topk_idx: &[i32],
    topk_weights: Option<&[f32]>,
    experts: &[LlExpertOutputs],
) -> Vec<bf16> {
    topo.assert_consistent();
    assert_eq!(experts.len(), topo.world, "one LlExpertOutputs per rank");
    assert!(rank < topo.world, "rank {rank} out of range");
    if let Err(e) = validate_experts(topo, topk_idx, num_tokens) {
        panic!("{e}");
    }
    for (r, ex) in experts.iter().enumerate() {
        ex.assert_shapes(&topo, max_tokens, r);
    }
    match topk_weights {
        Some(weights) => {
            assert_eq!(weights.len(), num_tokens * topo.topk, "topk_weights length");
            combine_weighted(
                topo, max_tokens, rank, num_tokens, topk_idx, weights, experts,
            )
        }
        None => combine_pre_weighted(topo, max_tokens, rank, num_tokens, topk_idx, experts),
    }
}

/// `ll_combine` with weights given at combine: one weighted sum per token.
fn combine_weighted(
    topo: Topology,
    max_tokens: usize,
    rank: usize,
    num_tokens: usize,
    topk_idx: &[i32],
    weights: &[f32],
    experts: &[LlExpertOutputs],
) -> Vec<bf16> {
    let (topk, hidden) = (topo.topk, topo.hidden);
    // (token, slot) pairs of this rank already matched, per global expert: the
    // next pair of an expert is the next row of its segment.
    let mut matched = vec![0usize; topo.num_experts];
    let mut out = Vec::with_capacity(num_tokens * hidden);
    for token in 0..num_tokens {
        let mut acc = vec![0f32; hidden];
        for slot in 0..topk {
            let id = topk_idx[token * topk + slot];
            let Some((r, le)) = topo.locate(id) else {
                continue;
            };
            let ex = &experts[r];
            let segment = ex.segment(&topo, max_tokens, le, rank);
            let n = matched[id as usize];
            matched[id as usize] += 1;
            assert!(
                n < segment.len(),
                "expert {id} returned too few rows for rank {rank}"
            );
            let row = segment.start + n;
            assert_eq!(
                ex.src_info[row], token as i32,
                "expert {id}, row {row}: src_info mismatch"
            );
            let w = weights[token * topk + slot];
            for (a, &v) in acc.iter_mut().zip(&ex.y[row * hidden..][..hidden]) {
                *a += w * v.to_f32();
            }
        }
        out.extend(acc.into_iter().map(bf16::from_f32));
    }
    out
}

/// `ll_combine` with weights given at dispatch: each expert rank reduces its
/// rows to one BF16 partial per token, and the partials are summed.
fn combine_pre_weighted(
    topo: Topology,
    max_tokens: usize,
    rank: usize,
    num_tokens: usize,
    topk_idx: &[i32],
    experts: &[LlExpertOutputs],
) -> Vec<bf16> {
    let hidden = topo.hidden;
    let mut total = vec![0f32; num_tokens * hidden];
    for (r, ex) in experts.iter().enumerate() {
        let weights = ex
            .weights
            .unwrap_or_else(|| panic!("expert rank {r} has no dispatch weights"));
        let mut partial = vec![0f32; num_tokens * hidden];
        for le in 0..topo.local_experts() {
            for row in ex.segment(&topo, max_tokens, le, rank) {
                let token = usize::try_from(ex.src_info[row])
                    .ok()
                    .filter(|&t| t < num_tokens)
                    .unwrap_or_else(|| panic!("expert rank {r}, row {row}: bad src_info"));
                let w = weights[row];
                for (a, &v) in partial[token * hidden..][..hidden]
                    .iter_mut()
                    .zip(&ex.y[row * hidden..][..hidden])
                {
                    *a += w * v.to_f32();
                }
            }
        }
        for (token, ids) in topk_idx.chunks_exact(topo.topk).enumerate() {
            let uses_rank = ids
                .iter()
                .any(|&id| topo.locate(id).is_some_and(|(er, _)| er == r));
            if uses_rank {
                let dst = &mut total[token * hidden..][..hidden];
                for (t, &p) in dst.iter_mut().zip(&partial[token * hidden..][..hidden]) {
                    *t += bf16::from_f32(p).to_f32();
                }
            }
        }
    }
    total.into_iter().map(bf16::from_f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::fp8::e4m3_to_f32;
    use crate::reference::testutil::{
        bf16_to_bytes, bytes_to_bf16, random_bf16, random_routing, random_weights, topologies, Rng,
    };

    /// One rank's input, owned.
    struct Source {
        num_tokens: usize,
        x: Vec<bf16>,
        topk_idx: Vec<i32>,
        topk_weights: Option<Vec<f32>>,
    }

    impl Source {
        fn view(&self) -> LlRankTokens<'_> {
            LlRankTokens {
                num_tokens: self.num_tokens,
                x: &self.x,
                topk_idx: &self.topk_idx,
                topk_weights: self.topk_weights.as_deref(),
            }
        }
    }

    /// Random sources with the given token counts; weights on every source
    /// unless `weightless` names one that has none.
    fn random_sources(
        rng: &mut Rng,
        topo: &Topology,
        counts: &[usize],
        skewed: bool,
        weightless: Option<usize>,
    ) -> Vec<Source> {
        counts
            .iter()
            .enumerate()
            .map(|(src, &n)| Source {
                num_tokens: n,
                x: random_bf16(rng, n * topo.hidden),
                topk_idx: random_routing(rng, topo, n, 0.25, skewed),
                topk_weights: (weightless != Some(src)).then(|| random_weights(rng, n * topo.topk)),
            })
            .collect()
    }

    /// Output formats to try: BF16, FP8 with plain scales, FP8 with UE8M0 scales.
    const FORMATS: [(Dtype, bool); 3] = [
        (Dtype::Bf16, false),
        (Dtype::Fp8E4m3, false),
        (Dtype::Fp8E4m3, true),
    ];

    /// An identity expert: each received row, dequantized to BF16.
    fn identity_expert(d: &LlDispatched, dtype: Dtype, hidden: usize) -> Vec<bf16> {
        match dtype {
            Dtype::Bf16 => bytes_to_bf16(&d.recv_x),
            Dtype::Fp8E4m3 => d
                .recv_x
                .iter()
                .enumerate()
                .map(|(i, &q)| bf16::from_f32(e4m3_to_f32(q) * d.recv_scales[i / 128]))
                .collect(),
        }
        .into_iter()
        .take(d.recv_src_info.len() * hidden)
        .collect()
    }

    #[test]
    fn masked_layout_follows_the_routing() {
        let mut rng = Rng::new(21);
        for topo in topologies() {
            for (dtype, ue8m0) in FORMATS {
                let (world, topk, hidden) = (topo.world, topo.topk, topo.hidden);
                let l = topo.local_experts();
                let counts: Vec<usize> = (0..world).map(|_| rng.below(8)).collect();
                let max_tokens = counts.iter().max().unwrap() + rng.below(2);
                let weightless = rng.chance(0.3).then(|| rng.below(world));
                let skewed = rng.chance(0.5);
                let sources = random_sources(&mut rng, &topo, &counts, skewed, weightless);
                let views: Vec<LlRankTokens> = sources.iter().map(Source::view).collect();
                let capacity = world * max_tokens;
                let row_bytes = dtype.row_bytes(hidden);
                let row_scales = dtype.scales_per_row(hidden);
                for rank in 0..world {
                    let d = ll_dispatch(topo, max_tokens, &views, rank, dtype, ue8m0);
                    assert_eq!(d.recv_x.len(), l * capacity * row_bytes);
                    assert_eq!(d.recv_scales.len(), l * capacity * row_scales);
                    assert_eq!(d.recv_src_info.len(), l * capacity);
                    assert_eq!(d.recv_layout_range.len(), l * world * 2);
                    assert_eq!(d.recv_weights.is_some(), weightless.is_none());
                    for le in 0..l {
                        let expert = (rank * l + le) as i32;
                        // Expected rows: (src, token, slot) in source, token, slot order.
                        let mut expected = vec![];
                        for (src, s) in sources.iter().enumerate() {
                            let first = expected.len() as i32;
                            for token in 0..s.num_tokens {
                                for slot in 0..topk {
                                    if s.topk_idx[token * topk + slot] == expert {
                                        expected.push((src, token, slot));
                                    }
                                }
                            }
                            let range = &d.recv_layout_range[(le * world + src) * 2..][..2];
                            assert_eq!(range, [first, expected.len() as i32 - first]);
                        }
                        assert_eq!(d.recv_count[le], expected.len() as i32);
                        for r in 0..capacity {
                            let row = le * capacity + r;
                            let x = &d.recv_x[row * row_bytes..][..row_bytes];
                            let scales = &d.recv_scales[row * row_scales..][..row_scales];
                            let weight = d.recv_weights.as_ref().map(|w| w[row]);
                            let Some(&(src, token, slot)) = expected.get(r) else {
                                assert!(x.iter().all(|&b| b == 0));
                                assert!(scales.iter().all(|&s| s == 0.0));
                                assert_eq!(d.recv_src_info[row], 0);
                                assert!(weight.is_none_or(|w| w == 0.0));
                                continue;
                            };
                            let s = &sources[src];
                            let source_row = &s.x[token * hidden..][..hidden];
                            assert_eq!(d.recv_src_info[row], token as i32);
                            if let Some(w) = weight {
                                assert_eq!(
                                    w,
                                    s.topk_weights.as_ref().unwrap()[token * topk + slot]
                                );
                            }
                            match dtype {
                                Dtype::Bf16 => assert_eq!(x, bf16_to_bytes(source_row)),
                                Dtype::Fp8E4m3 => {
                                    let mut want_x = vec![0u8; row_bytes];
                                    let mut want_scales = vec![0f32; row_scales];
                                    quantize_row(source_row, ue8m0, &mut want_x, &mut want_scales);
                                    assert_eq!(x, want_x);
                                    assert_eq!(scales, want_scales);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn identity_experts_round_trip_in_both_combine_modes() {
        let mut rng = Rng::new(77);
        for topo in topologies() {
            for (dtype, ue8m0) in FORMATS {
                let (world, topk, hidden) = (topo.world, topo.topk, topo.hidden);
                let mut counts: Vec<usize> = (0..world).map(|_| rng.below(7)).collect();
                if rng.chance(0.2) {
                    counts = vec![0; world];
                }
                let max_tokens = counts.iter().max().unwrap() + 1;
                let skewed = rng.chance(0.5);
                let sources = random_sources(&mut rng, &topo, &counts, skewed, None);
                let views: Vec<LlRankTokens> = sources.iter().map(Source::view).collect();
                let dispatched: Vec<LlDispatched> = (0..world)
                    .map(|rank| ll_dispatch(topo, max_tokens, &views, rank, dtype, ue8m0))
                    .collect();
                let ys: Vec<Vec<bf16>> = dispatched
                    .iter()
                    .map(|d| identity_expert(d, dtype, hidden))
                    .collect();
                let experts = outputs(&dispatched, &ys);
                // BF16 rows pass through exactly, so only the combine roundings
                // count (two of at most 2^-8 each); FP8 adds up to 2^-4 relative,
                // plus the subnormal spacing near zero.
                let relative = match dtype {
                    Dtype::Bf16 => 1.0 / 64.0,
                    Dtype::Fp8E4m3 => 1.0 / 16.0 + 1.0 / 64.0,
                };
                for (rank, s) in sources.iter().enumerate() {
                    let weights = s.topk_weights.as_deref().unwrap();
                    let given = ll_combine(
                        topo,
                        max_tokens,
                        rank,
                        s.num_tokens,
                        &s.topk_idx,
                        Some(weights),
                        &experts,
                    );
                    let reduced = ll_combine(
                        topo,
                        max_tokens,
                        rank,
                        s.num_tokens,
                        &s.topk_idx,
                        None,
                        &experts,
                    );
                    for token in 0..s.num_tokens {
                        let x = &s.x[token * hidden..][..hidden];
                        let amax = x
                            .iter()
                            .fold(0f64, |m, v| m.max(f64::from(v.to_f32().abs())));
                        for c in 0..hidden {
                            let (mut exact, mut magnitude, mut weight_sum) = (0f64, 0f64, 0f64);
                            for slot in 0..topk {
                                if s.topk_idx[token * topk + slot] >= 0 {
                                    let w = f64::from(weights[token * topk + slot]);
                                    exact += w * f64::from(x[c].to_f32());
                                    magnitude += (w * f64::from(x[c].to_f32())).abs();
                                    weight_sum += w;
                                }
                            }
                            let tol = magnitude * relative + weight_sum * amax * 1e-4;
                            for (mode, out) in [("given", &given), ("reduced", &reduced)] {
                                let got = f64::from(out[token * hidden + c].to_f32());
                                assert!(
                                    (got - exact).abs() <= tol,
                                    "{topo:?} {dtype:?} {mode} token {token} channel {c}: {got} vs {exact}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// Combines the outputs `ys` (one per expert rank) of the dispatches `ds`.
    fn outputs<'a>(ds: &'a [LlDispatched], ys: &'a [Vec<bf16>]) -> Vec<LlExpertOutputs<'a>> {
        ds.iter()
            .zip(ys)
            .map(|(d, y)| LlExpertOutputs {
                y,
                src_info: &d.recv_src_info,
                layout_range: &d.recv_layout_range,
                weights: d.recv_weights.as_deref(),
            })
            .collect()
    }

    /// Weights given at dispatch round each expert rank's partial to BF16 before
    /// the sum; weights given at combine round once. 1 + 2^-8 alone rounds to 1.0
    /// (a tie, to even), but 1 + 2^-8 + 2^-8 = 1 + 2^-7 is a BF16 value.
    #[test]
    fn dispatch_weights_round_per_rank_partial() {
        let topo = Topology {
            world: 2,
            num_experts: 2,
            topk: 2,
            hidden: 128,
        };
        let x = vec![bf16::ONE; 128];
        let topk_idx = [0, 1];
        let weights = [1.0 + 2f32.powi(-8), 2f32.powi(-8)];
        let empty = LlRankTokens {
            num_tokens: 0,
            x: &[],
            topk_idx: &[],
            topk_weights: Some(&[]),
        };
        let src = LlRankTokens {
            num_tokens: 1,
            x: &x,
            topk_idx: &topk_idx,
            topk_weights: Some(&weights),
        };
        let ds: Vec<LlDispatched> = (0..2)
            .map(|rank| ll_dispatch(topo, 1, &[src, empty], rank, Dtype::Bf16, false))
            .collect();
        let ys: Vec<Vec<bf16>> = ds.iter().map(|d| bytes_to_bf16(&d.recv_x)).collect();
        let experts = outputs(&ds, &ys);
        let given = ll_combine(topo, 1, 0, 1, &topk_idx, Some(&weights), &experts);
        let reduced = ll_combine(topo, 1, 0, 1, &topk_idx, None, &experts);
        assert!(given.iter().all(|v| v.to_f32() == 1.0 + 2f32.powi(-7)));
        assert!(reduced.iter().all(|v| v.to_f32() == 1.0));
        // Rank 1 sent nothing and gets an empty result.
        assert!(ll_combine(topo, 1, 1, 0, &[], None, &experts).is_empty());
    }

    #[test]
    fn tokens_without_experts_combine_to_zero() {
        let topo = Topology {
            world: 2,
            num_experts: 4,
            topk: 2,
            hidden: 128,
        };
        let x = vec![bf16::from_f32(3.0); 256];
        let topk_idx = [-1, -1, 2, -1];
        let weights = [1.0; 4];
        let src = LlRankTokens {
            num_tokens: 2,
            x: &x,
            topk_idx: &topk_idx,
            topk_weights: Some(&weights),
        };
        let ds: Vec<LlDispatched> = (0..2)
            .map(|rank| ll_dispatch(topo, 2, &[src, src], rank, Dtype::Fp8E4m3, true))
            .collect();
        assert_eq!(ds[0].recv_count, [0, 0]);
        assert_eq!(ds[1].recv_count, [2, 0]);
        let ys: Vec<Vec<bf16>> = ds
            .iter()
            .map(|d| identity_expert(d, Dtype::Fp8E4m3, 128))
            .collect();
        let experts = outputs(&ds, &ys);
        for weights in [Some(&weights[..]), None] {
            let out = ll_combine(topo, 2, 0, 2, &topk_idx, weights, &experts);
            assert!(out[..128].iter().all(|v| v.to_bits() == 0));
            assert!(out[128..].iter().all(|v| v.to_f32() == 3.0));
        }
    }

    #[test]
    #[should_panic(expected = "no dispatch weights")]
    fn reduced_combine_needs_dispatch_weights() {
        let topo = Topology {
            world: 1,
            num_experts: 1,
            topk: 1,
            hidden: 128,
        };
        let x = vec![bf16::ONE; 128];
        let src = LlRankTokens {
            num_tokens: 1,
            x: &x,
            topk_idx: &[0],
            topk_weights: None,
        };
        let d = ll_dispatch(topo, 1, &[src], 0, Dtype::Bf16, false);
        assert!(d.recv_weights.is_none());
        let ys = [bytes_to_bf16(&d.recv_x)];
        let ds = [d];
        ll_combine(topo, 1, 0, 1, &[0], None, &outputs(&ds, &ys));
    }

    #[test]
    #[should_panic(expected = "max_tokens")]
    fn more_tokens_than_max_tokens_panics() {
        let topo = Topology {
            world: 1,
            num_experts: 1,
            topk: 1,
            hidden: 128,
        };
        let x = vec![bf16::ONE; 256];
        let src = LlRankTokens {
            num_tokens: 2,
            x: &x,
            topk_idx: &[0, 0],
            topk_weights: None,
        };
        ll_dispatch(topo, 1, &[src], 0, Dtype::Bf16, false);
    }

    #[test]
    fn products_are_rounded_before_they_are_added() {
        // As in the normal-mode test: w2 * y2 rounds to exactly -w1 * y1.
        let topo = Topology {
            world: 1,
            num_experts: 2,
            topk: 2,
            hidden: 128,
        };
        let x = vec![bf16::ZERO; 128];
        let topk_idx = [0, 1];
        let weights = [
            -(1.0 + 2f32.powi(-7) + 2f32.powi(-23)),
            1.0 + 2f32.powi(-23),
        ];
        let src = LlRankTokens {
            num_tokens: 1,
            x: &x,
            topk_idx: &topk_idx,
            topk_weights: Some(&weights),
        };
        let d = ll_dispatch(topo, 1, &[src], 0, Dtype::Bf16, false);
        // One row per expert block: expert 0 outputs 1, expert 1 outputs 1 + 2^-7.
        let y = [
            vec![bf16::ONE; 128],
            vec![bf16::from_f32(1.0 + 2f32.powi(-7)); 128],
        ]
        .concat();
        let ds = [d];
        let ys = [y];
        for w in [Some(&weights[..]), None] {
            let out = ll_combine(topo, 1, 0, 1, &topk_idx, w, &outputs(&ds, &ys));
            assert!(out.iter().all(|v| v.to_bits() == 0), "{w:?}");
        }
    }
}
