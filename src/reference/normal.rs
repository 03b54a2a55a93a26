//! Normal (high-throughput) mode: dispatch to source-order and expert-major rows,
//! the expert-side reduction, and combine.
//!
//! Every function takes the inputs of all ranks and computes what one rank sees.

use super::layout::validate_experts;
use super::{Dtype, Topology};
use half::bf16;

/// The tokens one rank sends into [`dispatch`].
#[derive(Clone, Copy, Debug)]
pub struct RankTokens<'a> {
    /// Number of tokens on this rank.
    pub num_tokens: usize,
    /// `num_tokens * row_bytes` bytes of token rows, row-major.
    pub x: &'a [u8],
    /// FP8: `num_tokens * hidden / 128` scales, row-major; BF16: empty.
    pub scales: &'a [f32],
    /// `num_tokens * topk` global expert ids, token-major; -1 = dropped.
    pub topk_idx: &'a [i32],
    /// `num_tokens * topk` routing weights, token-major.
    pub topk_weights: &'a [f32],
}

/// What one rank receives from [`dispatch`], in two orders.
///
/// Source order: one row per token that has at least one expert on this rank,
/// grouped by source rank ascending, each source's tokens in token order.
///
/// Expert-major order: for each local expert ascending, one row per (source-order
/// row, slot) routed to it, in row then slot order, padded to a multiple of the
/// expert alignment with zero rows.
#[derive(Clone, Debug, PartialEq)]
pub struct Dispatched {
    /// Source-order rows.
    pub num_rows: usize,
    /// `[num_rows * row_bytes]`: the token rows, bit-exact copies.
    pub x: Vec<u8>,
    /// FP8: `[num_rows * hidden / 128]` scales, copied; BF16: empty.
    pub scales: Vec<f32>,
    /// `[num_rows * topk]`: the local expert id (global - rank * L) where the
    /// slot's expert is on this rank, else -1 (also for dropped slots).
    pub topk_idx: Vec<i32>,
    /// `[num_rows * topk]`: the weight where `topk_idx` is local, else 0.0.
    pub topk_weights: Vec<f32>,
    /// `[num_rows * 2]`: (source rank, token index on the source) of each row.
    pub src_info: Vec<i32>,
    /// `[world + 1]`: rows of source `s` are `source_offsets[s]..source_offsets[s + 1]`.
    pub source_offsets: Vec<usize>,
    /// `[expert_rows * row_bytes]`: expert-major rows; padding rows are zero.
    pub expert_x: Vec<u8>,
    /// FP8: `[expert_rows * hidden / 128]`, padding 0.0; BF16: empty.
    pub expert_scales: Vec<f32>,
    /// `[expert_rows]`: the routing weight of the (row, slot); padding 0.0.
    pub expert_weights: Vec<f32>,
    /// `[expert_rows]`: index of the source-order row; padding -1.
    pub expert_src_row: Vec<i32>,
    /// `[L + 1]`: expert `le` owns rows `expert_offsets[le]..expert_offsets[le + 1]`;
    /// each segment length is its count rounded up to the expert alignment.
    pub expert_offsets: Vec<i32>,
    /// `[L]`: real (non-padding) rows of each local expert.
    pub expert_counts: Vec<i32>,
    /// Total expert-major rows, padding included (= `expert_offsets[L]`).
    pub expert_rows: usize,
}

/// Dispatches the tokens of all ranks (`sources[s]` is rank `s`'s input) and
/// returns what `rank` receives; see [`Dispatched`] for the two row orders.
///
/// `expert_alignment` (at least 1) is the multiple each expert's expert-major
/// segment is padded to. Rows are moved as bytes, so the result is bit-exact for
/// both dtypes.
///
/// # Panics
/// If the topology is inconsistent, `sources.len() != world`, `rank >= world`,
/// `expert_alignment == 0`, a slice has the wrong length, or a source's
/// `topk_idx` holds an invalid expert id (check with [`validate_experts`] first).
pub fn dispatch(
    topo: Topology,
    dtype: Dtype,
    sources: &[RankTokens],
    rank: usize,
    expert_alignment: usize,
) -> Dispatched {
    topo.assert_consistent();
    assert_eq!(sources.len(), topo.world, "one input per rank");
    assert!(rank < topo.world, "rank {rank} out of range");
    assert!(expert_alignment >= 1, "expert_alignment must be at least 1");
    let topk = topo.topk;
    let row_bytes = dtype.row_bytes(topo.hidden);
    let row_scales = dtype.scales_per_row(topo.hidden);

    // Source order.
    let mut x = Vec::new();
    let mut scales = Vec::new();
    let mut topk_idx = Vec::new();
    let mut topk_weights = Vec::new();
    let mut src_info = Vec::new();
    let mut source_offsets = vec![0];
    for (src, s) in sources.iter().enumerate() {
        assert_eq!(
            s.x.len(),
            s.num_tokens * row_bytes,
            "source {src}: x length"
        );
        assert_eq!(
            s.scales.len(),
            s.num_tokens * row_scales,
            "source {src}: scales length"
        );
        assert_eq!(
            s.topk_weights.len(),
            s.num_tokens * topk,
            "source {src}: weights length"
        );
        if let Err(e) = validate_experts(topo, s.topk_idx, s.num_tokens) {
            panic!("source {src}: {e}");
        }
        for token in 0..s.num_tokens {
            let ids = &s.topk_idx[token * topk..][..topk];
            let weights = &s.topk_weights[token * topk..][..topk];
            // The local expert of each slot, or -1 where it is elsewhere or dropped.
            let local: Vec<i32> = ids
                .iter()
                .map(|&id| match topo.locate(id) {
                    Some((r, le)) if r == rank => le as i32,
                    _ => -1,
                })
                .collect();
            if local.iter().all(|&le| le == -1) {
                continue;
            }
            x.extend_from_slice(&s.x[token * row_bytes..][..row_bytes]);
            scales.extend_from_slice(&s.scales[token * row_scales..][..row_scales]);
            topk_idx.extend_from_slice(&local);
            topk_weights.extend(
                local
                    .iter()
                    .zip(weights)
                    .map(|(&le, &w)| if le >= 0 { w } else { 0.0 }),
            );
            src_info.extend([src as i32, token as i32]);
        }
        source_offsets.push(src_info.len() / 2);
    }
    let num_rows = src_info.len() / 2;

    // Expert-major order: count, lay out padded segments, then fill them in one
    // pass over (row, slot), which keeps each expert's rows in row-then-slot order.
    let local_experts = topo.local_experts();
    let mut counts = vec![0usize; local_experts];
    for &le in &topk_idx {
        if le >= 0 {
            counts[le as usize] += 1;
        }
    }
    let mut offsets = vec![0usize; local_experts + 1];
    for le in 0..local_experts {
        offsets[le + 1] = offsets[le] + counts[le].div_ceil(expert_alignment) * expert_alignment;
    }
    let expert_rows = offsets[local_experts];
    let mut expert_x = vec![0u8; expert_rows * row_bytes];
    let mut expert_scales = vec![0f32; expert_rows * row_scales];
    let mut expert_weights = vec![0f32; expert_rows];
    let mut expert_src_row = vec![-1i32; expert_rows];
    let mut next_row = offsets[..local_experts].to_vec();
    for row in 0..num_rows {
        for slot in 0..topk {
            let Ok(le) = usize::try_from(topk_idx[row * topk + slot]) else {
                continue;
            };
            let j = next_row[le];
            next_row[le] += 1;
            expert_x[j * row_bytes..][..row_bytes]
                .copy_from_slice(&x[row * row_bytes..][..row_bytes]);
            expert_scales[j * row_scales..][..row_scales]
                .copy_from_slice(&scales[row * row_scales..][..row_scales]);
            expert_weights[j] = topk_weights[row * topk + slot];
            expert_src_row[j] = row as i32;
        }
    }

    Dispatched {
        num_rows,
        x,
        scales,
        topk_idx,
        topk_weights,
        src_info,
        source_offsets,
        expert_x,
        expert_scales,
        expert_weights,
        expert_src_row,
        expert_offsets: offsets.iter().map(|&o| o as i32).collect(),
        expert_counts: counts.iter().map(|&c| c as i32).collect(),
        expert_rows,
    }
}

/// Buffer sizes that hold any dispatch result: `(source-order rows,
/// expert-major rows)` a rank can receive when every rank sends at most
/// `max_tokens_per_rank` tokens and segments are padded to `alignment`.
///
/// Source order: `world * max_tokens_per_rank`. Expert-major:
/// `world * max_tokens_per_rank * min(topk, L) + L * (alignment - 1)`.
/// The expert-major bound holds because no token lists one expert twice (see
/// [`validate_experts`](super::layout::validate_experts)).
///
/// # Panics
/// If the topology is inconsistent or `alignment == 0`.
pub fn worst_case_rows(
    topo: Topology,
    max_tokens_per_rank: usize,
    alignment: usize,
) -> (usize, usize) {
    topo.assert_consistent();
    assert!(alignment >= 1, "alignment must be at least 1");
    let local_experts = topo.local_experts();
    let source_rows = topo.world * max_tokens_per_rank;
    let expert_rows = source_rows * topo.topk.min(local_experts) + local_experts * (alignment - 1);
    (source_rows, expert_rows)
}

/// The expert-side reduction: folds the expert outputs `y` (`expert_rows *
/// hidden`, expert-major order of `d`) back to one row per source-order row.
///
/// Row `i` of the result is `bf16(sum of weight_j * f32(y_j))` over the
/// expert-major rows `j` with `expert_src_row[j] == i`, in ascending `j`, summed
/// in `f32` from 0.0 (product rounded, then added) and rounded to BF16 once.
/// Rows with no expert rows are zero. The result is `[num_rows * hidden]` and is
/// sent back to the sources like any source-order rows (see [`combine`]).
///
/// # Panics
/// If `y` has the wrong length.
pub fn expert_partials(topo: Topology, d: &Dispatched, y: &[bf16]) -> Vec<bf16> {
    let hidden = topo.hidden;
    assert_eq!(
        y.len(),
        d.expert_rows * hidden,
        "y must hold expert_rows * hidden values"
    );
    let mut acc = vec![0f32; d.num_rows * hidden];
    for (j, y_row) in y.chunks_exact(hidden).enumerate() {
        // Padding rows have src_row -1 and contribute nothing.
        let Ok(row) = usize::try_from(d.expert_src_row[j]) else {
            continue;
        };
        let w = d.expert_weights[j];
        for (a, &v) in acc[row * hidden..][..hidden].iter_mut().zip(y_row) {
            *a += w * v.to_f32();
        }
    }
    acc.into_iter().map(bf16::from_f32).collect()
}

/// Rows one rank sends back to the sources in [`combine`].
#[derive(Clone, Copy, Debug)]
pub struct Returned<'a> {
    /// `n * hidden`: that rank's source-order rows (e.g. from [`expert_partials`]).
    pub rows: &'a [bf16],
    /// `n * 2`: (source rank, source token) of each row, as from [`dispatch`].
    pub src_info: &'a [i32],
}

/// Combines the rows that every rank returns (`returned[r]` is what rank `r`
/// holds) into the `num_tokens` tokens of `rank`.
///
/// Token `t` is `bf16(sum of f32(row))` over every row whose `src_info` is
/// `(rank, t)`, summed in `f32` from 0.0, ranks ascending then rows ascending, and
/// rounded to BF16 once. Tokens with no rows are zero. The result is
/// `[num_tokens * hidden]`.
///
/// # Panics
/// If the topology is inconsistent, `returned.len() != world`, the lengths of a
/// `Returned` disagree, or a row addressed to `rank` names a token `>= num_tokens`.
pub fn combine(topo: Topology, rank: usize, num_tokens: usize, returned: &[Returned]) -> Vec<bf16> {
    topo.assert_consistent();
    assert_eq!(returned.len(), topo.world, "one Returned per rank");
    let hidden = topo.hidden;
    let mut acc = vec![0f32; num_tokens * hidden];
    for (r, ret) in returned.iter().enumerate() {
        add_rows(&mut acc, hidden, ret.rows_for(r, rank, num_tokens, hidden));
    }
    acc.into_iter().map(bf16::from_f32).collect()
}

/// Adds each `(token, row)` to the fp32 sums of `token` (`acc[token *
/// hidden..][..hidden] += f32(row)`), in the order given: the combines'
/// summation step.
pub(super) fn add_rows<'a>(
    acc: &mut [f32],
    hidden: usize,
    rows: impl IntoIterator<Item = (usize, &'a [bf16])>,
) {
    for (token, row) in rows {
        for (a, &v) in acc[token * hidden..][..hidden].iter_mut().zip(row) {
            *a += v.to_f32();
        }
    }
}

impl<'a> Returned<'a> {
    /// The rows that rank `r` (which returned these) addresses to `rank`,
    /// in row order, with their token.
    ///
    /// # Panics
    /// If the lengths disagree, or such a row names a token `>= num_tokens`.
    pub fn rows_for(
        &self,
        r: usize,
        rank: usize,
        num_tokens: usize,
        hidden: usize,
    ) -> impl Iterator<Item = (usize, &'a [bf16])> {
        assert_eq!(self.src_info.len() % 2, 0, "rank {r}: src_info holds pairs");
        assert_eq!(
            self.rows.len(),
            self.src_info.len() / 2 * hidden,
            "rank {r}: one row per src_info pair"
        );
        self.src_info
            .chunks_exact(2)
            .zip(self.rows.chunks_exact(hidden))
            .filter(move |(info, _)| info[0] == rank as i32)
            .map(move |(info, row)| {
                let token = usize::try_from(info[1])
                    .ok()
                    .filter(|&t| t < num_tokens)
                    .unwrap_or_else(|| {
                        panic!("rank {r}: row for token {} of {num_tokens}", info[1])
                    });
                (token, row)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::testutil::{
        bf16_to_bytes, bytes_to_bf16, random_bf16, random_routing, random_weights, topologies, Rng,
    };

    /// One rank's input, owned.
    struct Source {
        num_tokens: usize,
        x: Vec<u8>,
        scales: Vec<f32>,
        topk_idx: Vec<i32>,
        topk_weights: Vec<f32>,
    }

    impl Source {
        fn view(&self) -> RankTokens<'_> {
            RankTokens {
                num_tokens: self.num_tokens,
                x: &self.x,
                scales: &self.scales,
                topk_idx: &self.topk_idx,
                topk_weights: &self.topk_weights,
            }
        }
    }

    fn random_sources(
        rng: &mut Rng,
        topo: &Topology,
        dtype: Dtype,
        token_counts: &[usize],
        skewed: bool,
    ) -> Vec<Source> {
        token_counts
            .iter()
            .map(|&n| {
                let x = match dtype {
                    Dtype::Bf16 => bf16_to_bytes(&random_bf16(rng, n * topo.hidden)),
                    // Any byte pattern, NaN codes included: dispatch only moves bits.
                    Dtype::Fp8E4m3 => (0..n * topo.hidden).map(|_| rng.next_u64() as u8).collect(),
                };
                let scales = random_weights(rng, n * dtype.scales_per_row(topo.hidden));
                Source {
                    num_tokens: n,
                    x,
                    scales,
                    topk_idx: random_routing(rng, topo, n, 0.25, skewed),
                    topk_weights: random_weights(rng, n * topo.topk),
                }
            })
            .collect()
    }

    /// Token counts per rank to try: all empty, a single token, and random ones.
    fn token_count_patterns(rng: &mut Rng, world: usize) -> Vec<Vec<usize>> {
        let mut one = vec![0; world];
        one[world - 1] = 1;
        vec![
            vec![0; world],
            one,
            (0..world).map(|_| rng.below(7)).collect(),
            (0..world).map(|_| rng.below(12)).collect(),
        ]
    }

    /// Runs `check` on the dispatch result of every rank for every test case.
    fn for_each_case(
        mut check: impl FnMut(&Topology, Dtype, &[Source], usize, usize, &Dispatched),
    ) {
        let mut rng = Rng::new(42);
        for topo in topologies() {
            for dtype in [Dtype::Bf16, Dtype::Fp8E4m3] {
                for counts in token_count_patterns(&mut rng, topo.world) {
                    let skewed = rng.chance(0.5);
                    let alignment = [1, 4][rng.below(2)];
                    let sources = random_sources(&mut rng, &topo, dtype, &counts, skewed);
                    let views: Vec<RankTokens> = sources.iter().map(Source::view).collect();
                    for rank in 0..topo.world {
                        let d = dispatch(topo, dtype, &views, rank, alignment);
                        check(&topo, dtype, &sources, rank, alignment, &d);
                    }
                }
            }
        }
    }

    #[test]
    fn source_order_rows_follow_the_routing() {
        for_each_case(|topo, dtype, sources, rank, _, d| {
            let topk = topo.topk;
            let l = topo.local_experts();
            let row_bytes = dtype.row_bytes(topo.hidden);
            let row_scales = dtype.scales_per_row(topo.hidden);
            // Expected rows: (src, token) in order, kept iff an expert is on `rank`.
            let mut expected = vec![];
            for (src, s) in sources.iter().enumerate() {
                for token in 0..s.num_tokens {
                    let ids = &s.topk_idx[token * topk..][..topk];
                    if ids
                        .iter()
                        .any(|&id| id >= 0 && topo.rank_of_expert(id as usize) == rank)
                    {
                        expected.push([src as i32, token as i32]);
                    }
                }
            }
            let got: Vec<[i32; 2]> = d.src_info.chunks_exact(2).map(|p| [p[0], p[1]]).collect();
            assert_eq!(got, expected, "{topo:?} rank {rank}");
            assert_eq!(d.num_rows, expected.len());
            assert_eq!(d.x.len(), d.num_rows * row_bytes);
            assert_eq!(d.scales.len(), d.num_rows * row_scales);
            assert_eq!(d.topk_idx.len(), d.num_rows * topk);
            assert_eq!(d.topk_weights.len(), d.num_rows * topk);

            // source_offsets agree with src_info.
            assert_eq!(d.source_offsets.len(), topo.world + 1);
            assert_eq!(d.source_offsets[0], 0);
            assert_eq!(d.source_offsets[topo.world], d.num_rows);
            for src in 0..topo.world {
                for row in d.source_offsets[src]..d.source_offsets[src + 1] {
                    assert_eq!(d.src_info[row * 2], src as i32);
                }
            }

            for (row, &[src, token]) in expected.iter().enumerate() {
                let s = &sources[src as usize];
                let token = token as usize;
                assert_eq!(
                    d.x[row * row_bytes..][..row_bytes],
                    s.x[token * row_bytes..][..row_bytes]
                );
                assert_eq!(
                    d.scales[row * row_scales..][..row_scales],
                    s.scales[token * row_scales..][..row_scales]
                );
                for slot in 0..topk {
                    let id = s.topk_idx[token * topk + slot];
                    let local = d.topk_idx[row * topk + slot];
                    let weight = d.topk_weights[row * topk + slot];
                    if id >= 0 && id as usize / l == rank {
                        assert_eq!(local as usize, id as usize - rank * l);
                        assert_eq!(weight, s.topk_weights[token * topk + slot]);
                    } else {
                        assert_eq!((local, weight), (-1, 0.0));
                    }
                }
            }
        });
    }

    #[test]
    fn expert_major_rows_follow_the_source_order_rows() {
        for_each_case(|topo, dtype, sources, rank, alignment, d| {
            let topk = topo.topk;
            let l = topo.local_experts();
            let row_bytes = dtype.row_bytes(topo.hidden);
            let row_scales = dtype.scales_per_row(topo.hidden);
            // The number of local (token, slot) pairs, straight from the sources.
            let local_pairs = sources
                .iter()
                .flat_map(|s| &s.topk_idx)
                .filter(|&&id| id >= 0 && id as usize / l == rank)
                .count();
            let total: i32 = d.expert_counts.iter().sum();
            assert_eq!(total as usize, local_pairs);
            assert_eq!(d.expert_offsets.len(), l + 1);
            assert_eq!(d.expert_offsets[0], 0);
            assert_eq!(d.expert_rows, d.expert_offsets[l] as usize);
            assert_eq!(d.expert_x.len(), d.expert_rows * row_bytes);
            assert_eq!(d.expert_scales.len(), d.expert_rows * row_scales);
            assert_eq!(d.expert_weights.len(), d.expert_rows);
            assert_eq!(d.expert_src_row.len(), d.expert_rows);
            for le in 0..l {
                // The (row, slot) pairs of this expert in row-then-slot order.
                let pairs: Vec<(usize, usize)> = (0..d.num_rows)
                    .flat_map(|i| (0..topk).map(move |k| (i, k)))
                    .filter(|&(i, k)| d.topk_idx[i * topk + k] == le as i32)
                    .collect();
                let start = d.expert_offsets[le] as usize;
                let end = d.expert_offsets[le + 1] as usize;
                assert_eq!(d.expert_counts[le] as usize, pairs.len());
                assert_eq!(end - start, pairs.len().div_ceil(alignment) * alignment);
                for j in start..end {
                    let xj = &d.expert_x[j * row_bytes..][..row_bytes];
                    let sj = &d.expert_scales[j * row_scales..][..row_scales];
                    if let Some(&(i, k)) = pairs.get(j - start) {
                        assert_eq!(d.expert_src_row[j], i as i32);
                        assert_eq!(d.expert_weights[j], d.topk_weights[i * topk + k]);
                        assert_eq!(xj, &d.x[i * row_bytes..][..row_bytes]);
                        assert_eq!(sj, &d.scales[i * row_scales..][..row_scales]);
                    } else {
                        assert_eq!((d.expert_src_row[j], d.expert_weights[j]), (-1, 0.0));
                        assert!(xj.iter().all(|&b| b == 0) && sj.iter().all(|&s| s == 0.0));
                    }
                }
            }
            let max_tokens = sources.iter().map(|s| s.num_tokens).max().unwrap();
            let (source_rows, expert_rows) = worst_case_rows(*topo, max_tokens, alignment);
            assert!(d.num_rows <= source_rows && d.expert_rows <= expert_rows);
        });
    }

    #[test]
    fn worst_case_rows_formula() {
        let topo = Topology {
            world: 4,
            num_experts: 16,
            topk: 8,
            hidden: 128,
        };
        assert_eq!(worst_case_rows(topo, 10, 1), (40, 160));
        assert_eq!(worst_case_rows(topo, 10, 8), (40, 160 + 4 * 7));
        let topo = Topology { topk: 2, ..topo };
        assert_eq!(worst_case_rows(topo, 10, 1), (40, 80));
    }

    #[test]
    #[should_panic(expected = "invalid expert id 4")]
    fn invalid_expert_panics() {
        let topo = Topology {
            world: 1,
            num_experts: 4,
            topk: 1,
            hidden: 128,
        };
        let x = vec![0u8; 256];
        let src = RankTokens {
            num_tokens: 1,
            x: &x,
            scales: &[],
            topk_idx: &[4],
            topk_weights: &[1.0],
        };
        dispatch(topo, Dtype::Bf16, &[src], 0, 1);
    }

    #[test]
    fn dispatch_partials_combine_round_trip() {
        let mut rng = Rng::new(9);
        for topo in topologies() {
            for counts in token_count_patterns(&mut rng, topo.world) {
                let skewed = rng.chance(0.5);
                let sources = random_sources(&mut rng, &topo, Dtype::Bf16, &counts, skewed);
                let views: Vec<RankTokens> = sources.iter().map(Source::view).collect();
                let alignment = 1 + rng.below(4);
                // Each rank dispatches, runs identity experts (y = received x) and
                // reduces its expert rows to one partial per source-order row.
                let dispatched: Vec<Dispatched> = (0..topo.world)
                    .map(|rank| dispatch(topo, Dtype::Bf16, &views, rank, alignment))
                    .collect();
                let partials: Vec<Vec<bf16>> = dispatched
                    .iter()
                    .map(|d| expert_partials(topo, d, &bytes_to_bf16(&d.expert_x)))
                    .collect();
                let returned: Vec<Returned> = dispatched
                    .iter()
                    .zip(&partials)
                    .map(|(d, rows)| Returned {
                        rows,
                        src_info: &d.src_info,
                    })
                    .collect();
                for (rank, s) in sources.iter().enumerate() {
                    let out = combine(topo, rank, s.num_tokens, &returned);
                    assert_eq!(out.len(), s.num_tokens * topo.hidden);
                    let x = bytes_to_bf16(&s.x);
                    for token in 0..s.num_tokens {
                        for c in 0..topo.hidden {
                            let xc = f64::from(x[token * topo.hidden + c].to_f32());
                            let (mut exact, mut magnitude) = (0f64, 0f64);
                            for slot in 0..topo.topk {
                                if s.topk_idx[token * topo.topk + slot] >= 0 {
                                    let term =
                                        f64::from(s.topk_weights[token * topo.topk + slot]) * xc;
                                    exact += term;
                                    magnitude += term.abs();
                                }
                            }
                            // Two BF16 roundings (per rank, then the total), each
                            // within 2^-8 relative; f32 sums add far less.
                            let got = f64::from(out[token * topo.hidden + c].to_f32());
                            assert!(
                                (got - exact).abs() <= magnitude / 64.0,
                                "{topo:?} token {token} channel {c}: {got} vs {exact}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn single_expert_round_trip_is_one_bf16_rounding() {
        // One rank, topk 1: out = bf16(w * x) exactly.
        let topo = Topology {
            world: 1,
            num_experts: 2,
            topk: 1,
            hidden: 128,
        };
        let mut rng = Rng::new(4);
        let x = random_bf16(&mut rng, 3 * 128);
        let bytes = bf16_to_bytes(&x);
        let weights = [0.3, 0.7, 1.1];
        let src = RankTokens {
            num_tokens: 3,
            x: &bytes,
            scales: &[],
            topk_idx: &[1, -1, 0],
            topk_weights: &weights,
        };
        let d = dispatch(topo, Dtype::Bf16, &[src], 0, 1);
        let partial = expert_partials(topo, &d, &bytes_to_bf16(&d.expert_x));
        let out = combine(
            topo,
            0,
            3,
            &[Returned {
                rows: &partial,
                src_info: &d.src_info,
            }],
        );
        for token in 0..3 {
            for c in 0..128 {
                let want = if token == 1 {
                    bf16::ZERO
                } else {
                    bf16::from_f32(weights[token] * x[token * 128 + c].to_f32())
                };
                assert_eq!(out[token * 128 + c].to_bits(), want.to_bits());
            }
        }
    }

    #[test]
    fn combine_takes_only_rows_addressed_to_the_rank() {
        let topo = Topology {
            world: 2,
            num_experts: 2,
            topk: 1,
            hidden: 128,
        };
        let row = |v: f32| vec![bf16::from_f32(v); 128];
        let rows0 = [row(1.0), row(100.0), row(2.0)].concat();
        let rows1 = [row(0.5), row(8.0)].concat();
        let returned = [
            Returned {
                rows: &rows0,
                src_info: &[0, 2, 1, 0, 0, 0],
            },
            Returned {
                rows: &rows1,
                src_info: &[0, 2, 0, 0],
            },
        ];
        let out = combine(topo, 0, 4, &returned);
        let token = |t: usize| out[t * 128].to_f32();
        assert_eq!(
            [token(0), token(1), token(2), token(3)],
            [10.0, 0.0, 1.5, 0.0]
        );
        assert!(out[128..256].iter().all(|v| v.to_bits() == 0));
    }

    #[test]
    fn expert_partials_sum_in_fp32_and_round_once() {
        // Each product 1 + 2^-8 rounds to 1.0 in BF16 on its own; three of them
        // summed in f32 give 3 + 3 * 2^-8, which rounds to 3 + 2^-6.
        let topo = Topology {
            world: 1,
            num_experts: 4,
            topk: 3,
            hidden: 128,
        };
        let x = bf16_to_bytes(&vec![bf16::ONE; 128]);
        let w = 1.0 + 2f32.powi(-8);
        let src = RankTokens {
            num_tokens: 1,
            x: &x,
            scales: &[],
            topk_idx: &[0, 3, 1],
            topk_weights: &[w, w, w],
        };
        let d = dispatch(topo, Dtype::Bf16, &[src], 0, 4);
        assert_eq!(d.expert_rows, 12);
        let partial = expert_partials(topo, &d, &bytes_to_bf16(&d.expert_x));
        assert!(partial.iter().all(|v| v.to_f32() == 3.0 + 2f32.powi(-6)));
    }

    #[test]
    fn products_are_rounded_before_they_are_added() {
        // w2 * y2 = 1 + 2^-7 + 2^-23 + 2^-30 rounds to exactly -w1, so the sum is 0.
        // A fused multiply-add would keep the 2^-30 and give a nonzero result.
        let topo = Topology {
            world: 1,
            num_experts: 2,
            topk: 2,
            hidden: 128,
        };
        let x = vec![0u8; 256];
        let w1 = -(1.0 + 2f32.powi(-7) + 2f32.powi(-23));
        let w2 = 1.0 + 2f32.powi(-23);
        let src = RankTokens {
            num_tokens: 1,
            x: &x,
            scales: &[],
            topk_idx: &[0, 1],
            topk_weights: &[w1, w2],
        };
        let d = dispatch(topo, Dtype::Bf16, &[src], 0, 1);
        let y = [
            vec![bf16::ONE; 128],
            vec![bf16::from_f32(1.0 + 2f32.powi(-7)); 128],
        ]
        .concat();
        let partial = expert_partials(topo, &d, &y);
        assert!(partial.iter().all(|v| v.to_bits() == 0));
        assert_ne!(w2.mul_add(1.0 + 2f32.powi(-7), w1), 0.0);
    }
}
