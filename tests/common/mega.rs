//! Inputs and checks of the fused-kernel tests (`ep_mega_*`), shared by the
//! host-backend tests and the GPU tests: every rank's tokens, routing and
//! expert weights made from seeds (so any rank can remake any other's), the
//! reference dispatch, and the comparison of GEMM rows within the tolerance
//! of `ep::reference::mega`.

use super::normal::Input;
use super::{
    bf16_to_bytes, bytes_of, is_poisoned, random_bf16, routing, weights as routing_weights, Rng,
};
use ep::reference::fp8::quantize_rows;
use ep::reference::mega::{tolerance, DecodedExpert, ExpertWeights, RowResult};
use ep::reference::normal::Dispatched;
use ep::reference::{Dtype, Topology};
use half::bf16;

/// How tokens pick their experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routing {
    /// `topk` distinct random experts per token, 10% of the slots dropped.
    Uniform,
    /// Every token's first slot goes to one expert, its other slots are
    /// dropped: every row lands on one expert, the others get none.
    OneExpert,
}

/// One fused dispatch+GEMM then GEMM+combine of every rank.
#[derive(Clone, Debug)]
pub struct MegaCase {
    pub world: usize,
    pub hidden: usize,
    pub topk: usize,
    pub experts: usize,
    /// Output columns of the first GEMM (dispatch+GEMM).
    pub n: usize,
    /// Reduction length of the second GEMM (GEMM+combine, output `hidden`).
    pub k2: usize,
    pub dtype: Dtype,
    pub routing: Routing,
    pub alignment: usize,
    /// Tokens of each rank.
    pub tokens: Vec<usize>,
    pub seed: u64,
    /// The fused dispatch with `EP_DISPATCH_KEEP_PADDING`: its padding rows
    /// (expert-major x, scales, the first GEMM's y) keep what they held.
    pub keep_padding: bool,
}

impl MegaCase {
    pub fn topo(&self) -> Topology {
        Topology {
            world: self.world,
            num_experts: self.experts,
            topk: self.topk,
            hidden: self.hidden,
        }
    }

    pub fn local_experts(&self) -> usize {
        self.experts / self.world
    }

    /// The most tokens of a rank, at least 1: the config's
    /// `max_tokens_per_rank`.
    pub fn max_tokens(&self) -> usize {
        (*self.tokens.iter().max().unwrap()).max(1)
    }

    fn rng(&self, what: u64, rank: usize) -> Rng {
        Rng::new(
            self.seed
                .wrapping_mul(1_000_003)
                .wrapping_add(what.wrapping_mul(7919))
                .wrapping_add(rank as u64),
        )
    }
}

/// `rows` random rows of `cols` channels: BF16 in [-2, 2), or the same
/// values quantized to FP8 with one scale per 128 channels.
pub fn random_rows(rng: &mut Rng, dtype: Dtype, rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    let values = random_bf16(rng, rows * cols);
    match dtype {
        Dtype::Bf16 => (bf16_to_bytes(&values), Vec::new()),
        Dtype::Fp8E4m3 => quantize_rows(&values, cols),
    }
}

/// Rank `rank`'s tokens of `case`.
pub fn tokens(case: &MegaCase, rank: usize) -> Input {
    let mut rng = case.rng(1, rank);
    let n = case.tokens[rank];
    let topk_idx = match case.routing {
        Routing::Uniform => routing(&mut rng, case.experts, case.topk, n, 0.1, None),
        Routing::OneExpert => {
            let hot = (case.seed as usize) % case.experts;
            (0..n * case.topk)
                .map(|i| if i % case.topk == 0 { hot as i32 } else { -1 })
                .collect()
        }
    };
    let topk_weights = routing_weights(&mut rng, n * case.topk);
    let (x, scales) = random_rows(&mut rng, case.dtype, n, case.hidden);
    Input {
        num_tokens: n,
        x,
        scales,
        topk_idx,
        topk_weights,
    }
}

/// Every rank's tokens.
pub fn all_tokens(case: &MegaCase) -> Vec<Input> {
    (0..case.world).map(|r| tokens(case, r)).collect()
}

/// One rank's expert weights `[local_experts, n, k]` and FP8 block scales.
pub struct Weights {
    pub dtype: Dtype,
    pub n: usize,
    pub k: usize,
    pub data: Vec<u8>,
    pub scales: Vec<f32>,
}

impl Weights {
    /// Random weights: BF16 of magnitude 1/8 to 2, or FP8 codes of the
    /// same range (no NaN) with block scales in [1/128, 1/64).
    pub fn random(dtype: Dtype, experts: usize, n: usize, k: usize, rng: &mut Rng) -> Weights {
        let elements = experts * n * k;
        let mut data = vec![0u8; elements * dtype.elem_bytes()];
        match dtype {
            Dtype::Bf16 => {
                for chunk in data.chunks_mut(8) {
                    let r = rng.next_u64();
                    for (i, pair) in chunk.chunks_mut(2).enumerate() {
                        let bits = (r >> (16 * i)) as u16;
                        let sign = bits & 0x8000;
                        let exponent = (124 + (bits & 3)) << 7;
                        let mantissa = (bits >> 2) & 0x7f;
                        pair.copy_from_slice(&(sign | exponent | mantissa).to_le_bytes());
                    }
                }
            }
            Dtype::Fp8E4m3 => {
                for chunk in data.chunks_mut(8) {
                    let r = rng.next_u64();
                    for (i, b) in chunk.iter_mut().enumerate() {
                        let bits = (r >> (8 * i)) as u8;
                        // Codes 0x20..0x47: 1/8 to 1.875 * 2, never NaN.
                        *b = (bits & 0x80) | (0x20 + (bits & 0x7f) % 0x28);
                    }
                }
            }
        }
        let scales = match dtype {
            Dtype::Bf16 => Vec::new(),
            Dtype::Fp8E4m3 => (0..experts * (n / 128) * (k / 128))
                .map(|_| (1.0 + rng.unit()) / 128.0)
                .collect(),
        };
        Weights {
            dtype,
            n,
            k,
            data,
            scales,
        }
    }

    pub fn view(&self) -> ExpertWeights<'_> {
        ExpertWeights {
            dtype: self.dtype,
            n: self.n,
            k: self.k,
            data: &self.data,
            scales: &self.scales,
        }
    }
}

/// Rank `rank`'s weights of the first GEMM (`[L, n, hidden]`).
pub fn weights1(case: &MegaCase, rank: usize) -> Weights {
    let mut rng = case.rng(2, rank);
    Weights::random(
        case.dtype,
        case.local_experts(),
        case.n,
        case.hidden,
        &mut rng,
    )
}

/// Rank `rank`'s weights of the second GEMM (`[L, hidden, k2]`).
pub fn weights2(case: &MegaCase, rank: usize) -> Weights {
    let mut rng = case.rng(3, rank);
    Weights::random(
        case.dtype,
        case.local_experts(),
        case.hidden,
        case.k2,
        &mut rng,
    )
}

/// Rank `rank`'s input rows of the second GEMM: `rows` random rows of
/// `k2` channels (and FP8 scales).
pub fn activations(case: &MegaCase, rank: usize, rows: usize) -> (Vec<u8>, Vec<f32>) {
    let mut rng = case.rng(4, rank);
    random_rows(&mut rng, case.dtype, rows, case.k2)
}

/// The local expert of expert-major row `j` of `d`, when it is a real row.
pub fn expert_of_row(d: &Dispatched, j: usize) -> Option<usize> {
    let e = d.expert_offsets[1..]
        .iter()
        .position(|&end| j < end as usize)?;
    (j < d.expert_offsets[e] as usize + d.expert_counts[e] as usize).then_some(e)
}

/// Compares one GEMM output row with the reference row within the
/// documented tolerance; returns the worst ratio of error to tolerance.
pub fn check_row(dtype: Dtype, got: &[bf16], want: &RowResult, what: &str) -> f32 {
    assert_eq!(got.len(), want.values.len(), "{what}: row length");
    let mut worst = 0f32;
    for (c, (&g, (&r, &m))) in got
        .iter()
        .zip(want.values.iter().zip(&want.magnitudes))
        .enumerate()
    {
        let tol = tolerance(dtype, r, m);
        let err = (g.to_f32() - r).abs();
        assert!(
            err <= tol,
            "{what}: column {c}: got {g} (bits {:#06x}), reference {r}, error {err} > tolerance {tol}",
            g.to_bits()
        );
        worst = worst.max(err / tol);
    }
    worst
}

/// The reference output rows `rows` of a grouped GEMM of `weights` over
/// the expert-major `input` rows of `d` (only real rows may be asked for).
pub fn reference_rows(
    d: &Dispatched,
    weights: &Weights,
    input: &[u8],
    input_scales: &[f32],
    rows: &[usize],
) -> Vec<RowResult> {
    let (k, dtype) = (weights.k, weights.dtype);
    let (row_bytes, row_scales) = (dtype.row_bytes(k), dtype.scales_per_row(k));
    let view = weights.view();
    let mut decoded: Vec<Option<DecodedExpert>> =
        (0..d.expert_counts.len()).map(|_| None).collect();
    rows.iter()
        .map(|&j| {
            let e = expert_of_row(d, j).expect("a real row");
            let expert = decoded[e].get_or_insert_with(|| DecodedExpert::new(&view, e));
            expert.row(
                &input[j * row_bytes..][..row_bytes],
                &input_scales[j * row_scales..][..row_scales],
            )
        })
        .collect()
}

/// A fused dispatch's expert-major array `got` (rows of `row_len`
/// elements) against the reference's `want` (its `d.expert_rows` rows):
/// real rows bit for bit; padding rows zeros, or with `keep_padding` as
/// they were (poisoned); nothing written past the rows.
pub fn check_expert_rows<T: Copy>(
    d: &Dispatched,
    got: &[T],
    want: &[T],
    row_len: usize,
    keep_padding: bool,
    what: &str,
) {
    for j in 0..d.expert_rows {
        let (g, w) = (
            &got[j * row_len..][..row_len],
            &want[j * row_len..][..row_len],
        );
        if d.expert_src_row[j] >= 0 {
            assert!(bytes_of(g) == bytes_of(w), "{what}: row {j}");
        } else if keep_padding {
            assert!(is_poisoned(g), "{what}: padding row {j} was written");
        } else {
            assert!(
                bytes_of(g).iter().all(|&b| b == 0),
                "{what}: padding row {j} is not zero"
            );
        }
    }
    assert!(
        is_poisoned(&got[d.expert_rows * row_len..]),
        "{what}: written past the rows"
    );
}

/// The expert-major rows and (FP8) scales a fused dispatch wrote, against
/// the reference's (`check_expert_rows` for each).
pub fn check_dispatched_rows(
    dtype: Dtype,
    hidden: usize,
    d: &Dispatched,
    x: &[u8],
    scales: &[f32],
    keep_padding: bool,
    what: &str,
) {
    let row_bytes = dtype.row_bytes(hidden);
    check_expert_rows(
        d,
        x,
        &d.expert_x,
        row_bytes,
        keep_padding,
        &format!("{what}: expert_x"),
    );
    if dtype == Dtype::Fp8E4m3 {
        let cols = dtype.scales_per_row(hidden);
        let scales_what = format!("{what}: scales");
        check_expert_rows(
            d,
            scales,
            &d.expert_scales,
            cols,
            keep_padding,
            &scales_what,
        );
    }
}
