//! The fused megakernels' grouped GEMM: every expert-major row times its
//! local expert's weight matrix.
//!
//! `ep_mega_dispatch_gemm` is [`dispatch`](super::normal::dispatch) (its
//! expert-major rows) followed by [`grouped_gemm`]; `ep_mega_gemm_combine` is
//! [`grouped_gemm`] followed by [`expert_partials`](super::normal::expert_partials)
//! and [`combine`](super::normal::combine), the expert-major combine. Only the
//! GEMM is new here.
//!
//! # The GEMM
//! Weights are `[experts, n, k]`, K-major (output column `c` of expert `e` is
//! the `k` contiguous elements at `(e * n + c) * k`). For one input row `x`:
//! - BF16: `y[c] = sum_k x[k] * w[c][k]`, in `f32`, `k` ascending from 0.0,
//!   each product exact in `f32` and each sum rounded;
//! - FP8 (e4m3, DeepSeek-V3 scaling): the row has one scale `sx[b]` per block
//!   `b` of 128 columns of `k`, the weights one scale `sw[c / 128][b]` per
//!   128 x 128 block. Per block, `p_b = sum_{k in b} x[k] * w[c][k]` over the
//!   raw e4m3 values (products exact, `k` ascending, in `f32`), then
//!   `y[c] = fma(sx[b] * sw[c / 128][b], p_b, y[c])`, blocks ascending: the
//!   block-wise promotion of DeepGEMM's kernels;
//!
//! and the result is rounded to BF16 once (nearest, ties to even).
//!
//! # Tolerance
//! The GPU's tensor cores sum in another order (and, for FP8, with fewer
//! bits inside one block), so a GPU result `g` is compared with the
//! reference's `f32` value `r` before rounding, not bit for bit:
//! `|g - r| <= 2^-7 |r| + c * m`, where `m = sqrt(sum_k (x_k w_k)^2)` over
//! the dequantized products (the size of a sum of `k` terms of random sign)
//! and `c` is [`BF16_ERROR`] or [`FP8_ERROR`]. The first term covers the
//! BF16 rounding of the output, the second the summation. A wrong row,
//! expert, block scale or a missing 128-wide block is far outside it (such a
//! block alone moves the sum by about `m * sqrt(128 / k)`).

use super::fp8::e4m3_to_f32;
use super::{Dtype, SCALE_BLOCK};
use half::bf16;
use std::ops::Range;

/// `c` of the tolerance for BF16 GEMMs.
pub const BF16_ERROR: f32 = 1.0 / 1024.0;
/// `c` of the tolerance for FP8 GEMMs.
pub const FP8_ERROR: f32 = 1.0 / 32.0;

/// The tolerance of one output value (see the module comment): how far a
/// GPU result may be from the reference value `reference` whose products
/// have the size `magnitude`.
pub fn tolerance(dtype: Dtype, reference: f32, magnitude: f32) -> f32 {
    let c = match dtype {
        Dtype::Bf16 => BF16_ERROR,
        Dtype::Fp8E4m3 => FP8_ERROR,
    };
    reference.abs() / 128.0 + c * magnitude
}

/// Expert weights of a grouped GEMM.
#[derive(Clone, Copy, Debug)]
pub struct ExpertWeights<'a> {
    pub dtype: Dtype,
    /// Output columns; a multiple of 128.
    pub n: usize,
    /// Reduction length; a multiple of 128.
    pub k: usize,
    /// `[experts, n, k]` elements as little-endian bytes.
    pub data: &'a [u8],
    /// FP8: `[experts, n / 128, k / 128]` block scales; BF16: empty.
    pub scales: &'a [f32],
}

impl ExpertWeights<'_> {
    /// Number of experts the arrays hold.
    ///
    /// # Panics
    /// If the shape is not a multiple of 128 or the arrays disagree with it.
    pub fn experts(&self) -> usize {
        assert!(
            self.n > 0
                && self.k > 0
                && self.n.is_multiple_of(SCALE_BLOCK)
                && self.k.is_multiple_of(SCALE_BLOCK),
            "n = {} and k = {} must be positive multiples of {SCALE_BLOCK}",
            self.n,
            self.k
        );
        let per_expert = self.n * self.k * self.dtype.elem_bytes();
        assert_eq!(self.data.len() % per_expert, 0, "weights length");
        let experts = self.data.len() / per_expert;
        if self.dtype == Dtype::Fp8E4m3 {
            let blocks = (self.n / SCALE_BLOCK) * (self.k / SCALE_BLOCK);
            assert_eq!(self.scales.len(), experts * blocks, "weight scales length");
        }
        experts
    }
}

/// One element of a row of `dtype` as `f32` (FP8: the raw e4m3 value, the
/// scale not applied).
fn element(dtype: Dtype, bytes: &[u8], i: usize) -> f32 {
    match dtype {
        Dtype::Bf16 => bf16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32(),
        Dtype::Fp8E4m3 => e4m3_to_f32(bytes[i]),
    }
}

/// One expert's weights decoded to `f32` once, to multiply many rows.
pub struct DecodedExpert {
    dtype: Dtype,
    n: usize,
    k: usize,
    /// `[n, k]` raw values (FP8: scales not applied).
    w: Vec<f32>,
    /// FP8: `[n / 128, k / 128]`; BF16: empty.
    scales: Vec<f32>,
}

/// One output row before rounding: the `f32` values and, per value, the
/// size `m` of its products for [`tolerance`].
#[derive(Clone, Debug, PartialEq)]
pub struct RowResult {
    pub values: Vec<f32>,
    pub magnitudes: Vec<f32>,
}

impl RowResult {
    /// The values rounded to BF16: the GEMM's output row.
    pub fn to_bf16(&self) -> Vec<bf16> {
        self.values.iter().map(|&v| bf16::from_f32(v)).collect()
    }
}

impl DecodedExpert {
    /// Decodes expert `expert` of `weights`.
    ///
    /// # Panics
    /// If the weights are inconsistent (see [`ExpertWeights::experts`]) or
    /// `expert` is out of range.
    pub fn new(weights: &ExpertWeights, expert: usize) -> DecodedExpert {
        let experts = weights.experts();
        assert!(expert < experts, "expert {expert} of {experts}");
        let (n, k, dtype) = (weights.n, weights.k, weights.dtype);
        let bytes = n * k * dtype.elem_bytes();
        let data = &weights.data[expert * bytes..][..bytes];
        let w = (0..n * k).map(|i| element(dtype, data, i)).collect();
        let scales = match dtype {
            Dtype::Bf16 => Vec::new(),
            Dtype::Fp8E4m3 => {
                let blocks = (n / SCALE_BLOCK) * (k / SCALE_BLOCK);
                weights.scales[expert * blocks..][..blocks].to_vec()
            }
        };
        DecodedExpert {
            dtype,
            n,
            k,
            w,
            scales,
        }
    }

    /// `x * w^T` for one input row (`k` elements as bytes, and for FP8 its
    /// `k / 128` scales), in the order the module comment gives.
    ///
    /// # Panics
    /// If the row or its scales have the wrong length.
    pub fn row(&self, x: &[u8], x_scales: &[f32]) -> RowResult {
        let k = self.k;
        assert_eq!(x.len(), k * self.dtype.elem_bytes(), "row length");
        let xs: Vec<f32> = (0..k).map(|i| element(self.dtype, x, i)).collect();
        let mut values = Vec::with_capacity(self.n);
        let mut magnitudes = Vec::with_capacity(self.n);
        match self.dtype {
            Dtype::Bf16 => {
                for c in 0..self.n {
                    let w = &self.w[c * k..][..k];
                    let (mut acc, mut squares) = (0f32, 0f32);
                    for (&a, &b) in xs.iter().zip(w) {
                        let p = a * b;
                        acc += p;
                        squares += p * p;
                    }
                    values.push(acc);
                    magnitudes.push(squares.sqrt());
                }
            }
            Dtype::Fp8E4m3 => {
                let blocks = k / SCALE_BLOCK;
                assert_eq!(x_scales.len(), blocks, "row scales length");
                for c in 0..self.n {
                    let w = &self.w[c * k..][..k];
                    let w_scales = &self.scales[(c / SCALE_BLOCK) * blocks..][..blocks];
                    let (mut acc, mut squares) = (0f32, 0f32);
                    for b in 0..blocks {
                        let (mut partial, mut block_squares) = (0f32, 0f32);
                        let range = b * SCALE_BLOCK..(b + 1) * SCALE_BLOCK;
                        for (&a, &v) in xs[range.clone()].iter().zip(&w[range]) {
                            let p = a * v;
                            partial += p;
                            block_squares += p * p;
                        }
                        let scale = x_scales[b] * w_scales[b];
                        acc = scale.mul_add(partial, acc);
                        squares += scale * scale * block_squares;
                    }
                    values.push(acc);
                    magnitudes.push(squares.sqrt());
                }
            }
        }
        RowResult { values, magnitudes }
    }
}

/// The GEMM's input rows: `[rows, k]` elements of `dtype` as bytes, with
/// FP8 `[rows, k / 128]` scales.
#[derive(Clone, Copy, Debug)]
pub struct GemmRows<'a> {
    pub data: &'a [u8],
    pub scales: &'a [f32],
}

/// The grouped GEMM over expert-major rows: local expert `e` owns rows
/// `offsets[e]..offsets[e + 1]`, the first `counts[e]` of them real, the
/// rest padding. Returns `[offsets[L] * n]` BF16 values: real rows times
/// their expert's weights, zeros in padding rows.
///
/// # Panics
/// If the shapes disagree (rows, scales, offsets and counts, weights).
pub fn grouped_gemm(
    weights: &ExpertWeights,
    rows: GemmRows,
    offsets: &[i32],
    counts: &[i32],
) -> Vec<bf16> {
    let experts = weights.experts();
    let (n, k, dtype) = (weights.n, weights.k, weights.dtype);
    assert_eq!(counts.len(), experts, "one count per expert");
    let (total, real) = real_rows(offsets, counts);
    let (row_bytes, row_scales) = (dtype.row_bytes(k), dtype.scales_per_row(k));
    assert!(rows.data.len() >= total * row_bytes, "input rows");
    assert!(rows.scales.len() >= total * row_scales, "input scales");
    let mut y = vec![bf16::ZERO; total * n];
    for (e, rows_of_e) in real.into_iter().enumerate() {
        if rows_of_e.is_empty() {
            continue;
        }
        let expert = DecodedExpert::new(weights, e);
        for j in rows_of_e {
            let result = expert.row(
                &rows.data[j * row_bytes..][..row_bytes],
                &rows.scales[j * row_scales..][..row_scales],
            );
            y[j * n..][..n].copy_from_slice(&result.to_bf16());
        }
    }
    y
}

/// The rows of an expert-major layout (local expert `e` owns rows
/// `offsets[e]..offsets[e + 1]`, the first `counts[e]` of them real): all
/// of them (`offsets[L]`), and each expert's real rows.
///
/// # Panics
/// If there is not one offset per expert plus the end, or an expert's real
/// rows do not fit its segment.
pub fn real_rows(offsets: &[i32], counts: &[i32]) -> (usize, Vec<Range<usize>>) {
    let experts = counts.len();
    assert_eq!(
        offsets.len(),
        experts + 1,
        "one offset per expert, plus the end"
    );
    let total = usize::try_from(offsets[experts]).expect("offsets are non-negative");
    let real = (0..experts)
        .map(|e| {
            let start = offsets[e] as usize;
            let count = counts[e] as usize;
            assert!(
                start + count <= offsets[e + 1] as usize,
                "expert {e}: {count} rows do not fit its segment"
            );
            start..start + count
        })
        .collect();
    (total, real)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::fp8::{f32_to_e4m3, quantize_row};
    use crate::reference::testutil::{bf16_to_bytes, random_bf16, Rng};

    fn bf16_weights(rng: &mut Rng, experts: usize, n: usize, k: usize) -> Vec<u8> {
        bf16_to_bytes(&random_bf16(rng, experts * n * k))
    }

    #[test]
    fn bf16_rows_are_plain_dot_products() {
        let (n, k) = (128, 256);
        let mut rng = Rng::new(1);
        let data = bf16_weights(&mut rng, 2, n, k);
        let weights = ExpertWeights {
            dtype: Dtype::Bf16,
            n,
            k,
            data: &data,
            scales: &[],
        };
        let x = random_bf16(&mut rng, k);
        let expert = DecodedExpert::new(&weights, 1);
        let got = expert.row(&bf16_to_bytes(&x), &[]);
        for c in [0, 5, 127] {
            let mut want = 0f64;
            for i in 0..k {
                let w = bf16::from_le_bytes([
                    data[2 * ((n + c) * k + i)],
                    data[2 * ((n + c) * k + i) + 1],
                ]);
                want += f64::from(x[i].to_f32()) * f64::from(w.to_f32());
            }
            let err = (f64::from(got.values[c]) - want).abs();
            assert!(err <= 1e-4 * f64::from(got.magnitudes[c]), "column {c}");
        }
    }

    #[test]
    fn fp8_blocks_are_scaled_separately() {
        // Row of ones; weights of ones; block scales make each 128-block of
        // k and each 128-block of n distinct.
        let (n, k) = (256, 256);
        let one = f32_to_e4m3(1.0);
        let data = vec![one; n * k];
        let w_scales = [1.0, 2.0, 4.0, 8.0]; // [n / 128][k / 128]
        let weights = ExpertWeights {
            dtype: Dtype::Fp8E4m3,
            n,
            k,
            data: &data,
            scales: &w_scales,
        };
        let expert = DecodedExpert::new(&weights, 0);
        let got = expert.row(&vec![one; k], &[0.5, 0.25]);
        // Column block 0: 128 * (0.5 * 1 + 0.25 * 2) = 128; block 1:
        // 128 * (0.5 * 4 + 0.25 * 8) = 512.
        assert!(got.values[..128].iter().all(|&v| v == 128.0));
        assert!(got.values[128..].iter().all(|&v| v == 512.0));
    }

    #[test]
    fn fp8_matches_the_dequantized_product() {
        let (n, k) = (128, 384);
        let mut rng = Rng::new(3);
        let mut data = vec![0u8; n * k];
        let mut w_scales = vec![0f32; k / 128];
        for c in 0..n {
            // Quantize each weight row per 128 channels; one scale per
            // block is enough for a one-column-block matrix when all rows
            // share it, so use the scale of row 0 for all and quantize with it.
            let row = random_bf16(&mut rng, k);
            let mut scales = vec![0f32; k / 128];
            quantize_row(&row, false, &mut data[c * k..][..k], &mut scales);
            if c == 0 {
                w_scales.copy_from_slice(&scales);
            }
        }
        let weights = ExpertWeights {
            dtype: Dtype::Fp8E4m3,
            n,
            k,
            data: &data,
            scales: &w_scales,
        };
        let x = random_bf16(&mut rng, k);
        let mut xq = vec![0u8; k];
        let mut xs = vec![0f32; k / 128];
        quantize_row(&x, false, &mut xq, &mut xs);
        let got = DecodedExpert::new(&weights, 0).row(&xq, &xs);
        for c in 0..n {
            let mut want = 0f64;
            for i in 0..k {
                let b = i / 128;
                want += f64::from(e4m3_to_f32(xq[i]) * xs[b])
                    * f64::from(e4m3_to_f32(data[c * k + i]) * w_scales[b]);
            }
            let err = (f64::from(got.values[c]) - want).abs();
            assert!(
                err <= 1e-4 * f64::from(got.magnitudes[c]) + 1e-6,
                "column {c}"
            );
        }
    }

    #[test]
    fn grouped_gemm_zeroes_padding_and_skips_empty_experts() {
        let (n, k) = (128, 128);
        let mut rng = Rng::new(5);
        let data = bf16_weights(&mut rng, 3, n, k);
        let weights = ExpertWeights {
            dtype: Dtype::Bf16,
            n,
            k,
            data: &data,
            scales: &[],
        };
        // Expert 0: 1 row + 1 padding; expert 1: none; expert 2: 2 rows.
        let offsets = [0, 2, 2, 4];
        let counts = [1, 0, 2];
        let x = random_bf16(&mut rng, 4 * k);
        let rows = bf16_to_bytes(&x);
        let y = grouped_gemm(
            &weights,
            GemmRows {
                data: &rows,
                scales: &[],
            },
            &offsets,
            &counts,
        );
        assert_eq!(y.len(), 4 * n);
        assert!(y[n..2 * n].iter().all(|v| v.to_bits() == 0));
        let e2 = DecodedExpert::new(&weights, 2);
        let want = e2.row(&rows[3 * 2 * k..4 * 2 * k], &[]).to_bf16();
        assert_eq!(&y[3 * n..4 * n], &want[..]);
        let e0 = DecodedExpert::new(&weights, 0);
        assert_eq!(&y[..n], &e0.row(&rows[..2 * k], &[]).to_bf16()[..]);
    }

    #[test]
    fn tolerance_catches_a_missing_block() {
        let (n, k) = (128, 7168);
        let mut rng = Rng::new(8);
        let data = bf16_weights(&mut rng, 1, n, k);
        let weights = ExpertWeights {
            dtype: Dtype::Bf16,
            n,
            k,
            data: &data,
            scales: &[],
        };
        let x = random_bf16(&mut rng, k);
        let mut bytes = bf16_to_bytes(&x);
        let full = DecodedExpert::new(&weights, 0).row(&bytes, &[]);
        bytes[..256].fill(0); // the first 128 channels
        let partial = DecodedExpert::new(&weights, 0).row(&bytes, &[]);
        for dtype in [Dtype::Bf16, Dtype::Fp8E4m3] {
            let caught = (0..n)
                .filter(|&c| {
                    (full.values[c] - partial.values[c]).abs()
                        > tolerance(dtype, full.values[c], full.magnitudes[c])
                })
                .count();
            assert!(
                caught > n / 2,
                "{dtype:?}: only {caught} of {n} columns differ"
            );
        }
    }
}
