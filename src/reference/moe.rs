//! The whole expert MLP of an MoE layer (`ep_moe_forward`): dispatch, the
//! experts' gate+up GEMM, SwiGLU, the down GEMM, combine.
//!
//! For every rank: [`dispatch`](super::normal::dispatch) to expert-major
//! rows, then for each local expert `e` and each of its rows `x`:
//! 1. `y1 = x * W1[e]^T` ([`grouped_gemm`], `W1` being `[experts, 2I,
//!    hidden]`: output columns `[0, I)` are the gate, `[I, 2I)` the up
//!    projection), BF16;
//! 2. `a[c] = silu(y1[c]) * y1[I + c]` for `c < I` ([`swiglu`]), computed in
//!    `f32` from the BF16 values of `y1`; BF16 runs round `a` to BF16, FP8
//!    runs quantize it to e4m3 with one scale per 128 columns
//!    ([`quantize_f32_row`]: the low-latency mode's rule, `scale = max(amax,
//!    1e-4) / 448`), from the `f32` values;
//! 3. `y2 = a * W2[e]^T` ([`grouped_gemm`], `W2` being `[experts, hidden,
//!    I]`), BF16;
//!
//! then the expert-major combine ([`expert_partials`] and
//! [`combine`](super::normal::combine)) of the `y2` rows into each source's
//! tokens. Only step 2 is new here.
//!
//! # Bit for bit
//! A GPU computes step 2 with the same operations in the same order, each
//! a single correctly rounded `f32` operation (no contraction into fused
//! multiply-adds other than the ones written here), so its `a` equals this
//! one bit for bit given the same `y1`. That is why [`exp`] is not
//! `f32::exp` (whose last bit depends on the math library) but a fixed
//! sequence of operations: a range reduction by `ln 2` in two parts,
//! a degree-7 polynomial (Horner, fused multiply-adds), and a scaling by a
//! power of two built from bits.

use super::fp8::quantize_f32_row;
use super::mega::{grouped_gemm, real_rows, ExpertWeights, GemmRows};
use super::normal::{combine, dispatch, expert_partials, Dispatched, RankTokens, Returned};
use super::{Dtype, Topology, SCALE_BLOCK};
use half::bf16;

/// `log2(e)` rounded to `f32`.
const LOG2_E: u32 = 0x3fb8_aa3b;
/// `ln 2` in two parts: the high part has 15 significant bits, so `n *
/// LN2_HI` is exact for every `|n| <= 2^9`; the low part is the rest.
const LN2_HI: u32 = 0x3f31_7200;
const LN2_LO: u32 = 0x35bf_be8e;
/// `1 / k!` for `k` = 7 down to 2, rounded to `f32`: the polynomial of
/// `e^r` on `|r| <= ln(2) / 2` (its constant and linear terms are 1).
const EXP_POLY: [u32; 6] = [
    0x3950_0d01,
    0x3ab6_0b61,
    0x3c08_8889,
    0x3d2a_aaab,
    0x3e2a_aaab,
    0x3f00_0000,
];
/// Above this `e^x` is `+inf`, below the other bound 0: within them the
/// power of two `2^n` of the range reduction is a normal `f32`.
const EXP_HIGHEST: f32 = 88.0;
const EXP_LOWEST: f32 = -87.0;

/// `e^x` in `f32`, by the sequence the GPU kernel (kernels/moe.cu) runs:
/// - NaN gives NaN, `x > 88` gives `+inf`, `x < -87` gives `0`;
/// - `n = round_ties_even(x * log2(e))` (the product rounded to `f32`);
/// - `r = fma(-n, LN2_LO, fma(-n, LN2_HI, x))`;
/// - `p = 1 + r (1 + r (1/2 + r (1/6 + ... + r / 5040)))` by Horner's rule,
///   one fused multiply-add per coefficient;
/// - `e^x = p * 2^n`, `2^n` built from its bits.
///
/// Within 2 units in the last place of the exact value (tested).
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x > EXP_HIGHEST {
        return f32::INFINITY;
    }
    if x < EXP_LOWEST {
        return 0.0;
    }
    let n = (x * f32::from_bits(LOG2_E)).round_ties_even();
    let r = (-n).mul_add(f32::from_bits(LN2_HI), x);
    let r = (-n).mul_add(f32::from_bits(LN2_LO), r);
    let mut p = f32::from_bits(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = p.mul_add(r, f32::from_bits(c));
    }
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    // n is in [-126, 127] (|x| bounds above): 2^n is a normal f32.
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `silu(g) = g / (1 + e^-g)`: [`exp`], then one rounded addition and one
/// rounded division.
pub fn silu(g: f32) -> f32 {
    g / (1.0 + exp(-g))
}

/// One SwiGLU value: `silu(gate) * up`, the product rounded once.
pub fn swiglu(gate: f32, up: f32) -> f32 {
    silu(gate) * up
}

/// The activation of one row: `y1` is its `2I` BF16 values (gate, then
/// up); `act` receives `I` values of `dtype` (BF16 as little-endian bytes,
/// or e4m3 codes) and, for FP8, `scales` their `I / 128` scales.
///
/// # Panics
/// If `y1` has an odd length or one that is not twice a multiple of 128,
/// or `act` and `scales` do not match it.
pub fn activate_row(dtype: Dtype, y1: &[bf16], act: &mut [u8], scales: &mut [f32]) {
    let i = y1.len() / 2;
    assert!(
        y1.len() == 2 * i && i > 0 && i.is_multiple_of(SCALE_BLOCK),
        "a y1 row holds 2I values, I a positive multiple of {SCALE_BLOCK}"
    );
    assert_eq!(act.len(), dtype.row_bytes(i), "act row length");
    assert_eq!(scales.len(), dtype.scales_per_row(i), "act scales length");
    let (gate, up) = y1.split_at(i);
    let a: Vec<f32> = gate
        .iter()
        .zip(up)
        .map(|(g, u)| swiglu(g.to_f32(), u.to_f32()))
        .collect();
    match dtype {
        Dtype::Bf16 => {
            for (out, &v) in act.chunks_exact_mut(2).zip(&a) {
                out.copy_from_slice(&bf16::from_f32(v).to_le_bytes());
            }
        }
        Dtype::Fp8E4m3 => quantize_f32_row(&a, act, scales),
    }
}

/// The activations of the expert-major rows of a layout: local expert `e`
/// owns rows `offsets[e]..offsets[e + 1]`, the first `counts[e]` of them
/// real. `y1` holds `[offsets[L], 2 * intermediate]` BF16 values. Returns
/// `[offsets[L] * row_bytes]` activations of `dtype` and, for FP8,
/// `[offsets[L] * intermediate / 128]` scales: each real row activated
/// ([`activate_row`]), padding rows zero here (`ep_moe_forward` leaves the
/// caller's padding rows as they were).
///
/// # Panics
/// If the shapes disagree.
pub fn activate(
    dtype: Dtype,
    intermediate: usize,
    y1: &[bf16],
    offsets: &[i32],
    counts: &[i32],
) -> (Vec<u8>, Vec<f32>) {
    let (rows, real) = real_rows(offsets, counts);
    assert_eq!(y1.len(), rows * 2 * intermediate, "y1 length");
    let (row_bytes, row_scales) = (
        dtype.row_bytes(intermediate),
        dtype.scales_per_row(intermediate),
    );
    let mut act = vec![0u8; rows * row_bytes];
    let mut scales = vec![0f32; rows * row_scales];
    for j in real.into_iter().flatten() {
        activate_row(
            dtype,
            &y1[j * 2 * intermediate..][..2 * intermediate],
            &mut act[j * row_bytes..][..row_bytes],
            &mut scales[j * row_scales..][..row_scales],
        );
    }
    (act, scales)
}

/// One rank's expert weights: gate+up `w1` (`[L, 2I, hidden]`) and down
/// `w2` (`[L, hidden, I]`), of one dtype.
#[derive(Clone, Copy, Debug)]
pub struct MoeWeights<'a> {
    pub w1: ExpertWeights<'a>,
    pub w2: ExpertWeights<'a>,
}

impl MoeWeights<'_> {
    /// `I`, checked against both matrices.
    ///
    /// # Panics
    /// If the shapes or dtypes of `w1` and `w2` disagree.
    pub fn intermediate(&self) -> usize {
        let (w1, w2) = (&self.w1, &self.w2);
        assert_eq!(w1.dtype, w2.dtype, "w1 and w2 have one dtype");
        assert_eq!(w1.n, 2 * w2.k, "w1 has 2I rows, w2 I columns");
        assert_eq!(w1.k, w2.n, "w1 has hidden columns, w2 hidden rows");
        w2.k
    }
}

/// What one rank's experts make of its dispatch, stage by stage, over all
/// `expert_rows` expert-major rows (padding rows zero).
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertStages {
    /// `[rows, 2I]` the gate+up GEMM.
    pub y1: Vec<bf16>,
    /// `[rows, I]` SwiGLU, BF16 bytes or e4m3 codes; FP8: `[rows, I / 128]`
    /// scales (else empty).
    pub act: Vec<u8>,
    pub act_scales: Vec<f32>,
    /// `[rows, hidden]` the down GEMM.
    pub y2: Vec<bf16>,
}

/// Steps 1 to 3 of the module comment on the expert-major rows of `d`.
///
/// # Panics
/// If the shapes disagree.
pub fn expert_stages(d: &Dispatched, weights: &MoeWeights) -> ExpertStages {
    let intermediate = weights.intermediate();
    let dtype = weights.w1.dtype;
    let y1 = grouped_gemm(
        &weights.w1,
        GemmRows {
            data: &d.expert_x,
            scales: &d.expert_scales,
        },
        &d.expert_offsets,
        &d.expert_counts,
    );
    let (act, act_scales) = activate(
        dtype,
        intermediate,
        &y1,
        &d.expert_offsets,
        &d.expert_counts,
    );
    let y2 = grouped_gemm(
        &weights.w2,
        GemmRows {
            data: &act,
            scales: &act_scales,
        },
        &d.expert_offsets,
        &d.expert_counts,
    );
    ExpertStages {
        y1,
        act,
        act_scales,
        y2,
    }
}

/// The whole forward on one node: every rank's tokens (`sources[r]`,
/// rows of `dtype`) dispatched with `alignment`, run through the experts of
/// their ranks (`weights[r]`) and combined. Returns every rank's
/// `[num_tokens, hidden]` BF16 output, and each rank's dispatch and stages.
///
/// # Panics
/// If the shapes disagree or an expert id is invalid (as
/// [`dispatch`](super::normal::dispatch)).
pub fn forward(
    topo: Topology,
    dtype: Dtype,
    sources: &[RankTokens],
    weights: &[MoeWeights],
    alignment: usize,
) -> (Vec<Vec<bf16>>, Vec<(Dispatched, ExpertStages)>) {
    assert_eq!(weights.len(), topo.world, "one set of weights per rank");
    let ranks: Vec<(Dispatched, ExpertStages)> = (0..topo.world)
        .map(|rank| {
            assert_eq!(weights[rank].w1.dtype, dtype, "rank {rank}: weight dtype");
            let d = dispatch(topo, dtype, sources, rank, alignment);
            let stages = expert_stages(&d, &weights[rank]);
            (d, stages)
        })
        .collect();
    let partials: Vec<Vec<bf16>> = ranks
        .iter()
        .map(|(d, s)| expert_partials(topo, d, &s.y2))
        .collect();
    let returned: Vec<Returned> = ranks
        .iter()
        .zip(&partials)
        .map(|((d, _), rows)| Returned {
            rows,
            src_info: &d.src_info,
        })
        .collect();
    let out = (0..topo.world)
        .map(|rank| combine(topo, rank, sources[rank].num_tokens, &returned))
        .collect();
    (out, ranks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::fp8::e4m3_to_f32;
    use crate::reference::testutil::{bf16_to_bytes, random_bf16, Rng};

    /// Units in the last place of `got` away from the exact `want`.
    fn ulps(got: f32, want: f64) -> f64 {
        let spacing = f64::from(got.abs().next_up() - got.abs()).max(f64::from(f32::MIN_POSITIVE));
        (f64::from(got) - want).abs() / spacing
    }

    #[test]
    fn constants_are_their_values_rounded() {
        assert_eq!(f32::from_bits(LOG2_E), std::f32::consts::LOG2_E);
        let ln2 = f64::from(f32::from_bits(LN2_HI)) + f64::from(f32::from_bits(LN2_LO));
        assert!((ln2 - std::f64::consts::LN_2).abs() < 1e-13);
        // 15 significant bits: n * LN2_HI is exact for |n| <= 2^9.
        assert_eq!(f32::from_bits(LN2_HI).to_bits() & 0x1ff, 0);
        let factorials = [5040.0f32, 720.0, 120.0, 24.0, 6.0, 2.0];
        for (&bits, f) in EXP_POLY.iter().zip(factorials) {
            assert_eq!(f32::from_bits(bits), 1.0 / f);
        }
    }

    #[test]
    fn exp_is_within_two_ulps() {
        let mut rng = Rng::new(21);
        let mut worst = 0f64;
        let mut xs: Vec<f32> = (0..20_000)
            .map(|_| EXP_LOWEST + (EXP_HIGHEST - EXP_LOWEST) * rng.unit())
            .collect();
        xs.extend((0..5_000).map(|_| 8.0 * rng.unit() - 4.0));
        xs.extend([0.0, -0.0, 1.0, -1.0, EXP_HIGHEST, EXP_LOWEST, 1e-8, -1e-8]);
        for x in xs {
            let err = ulps(exp(x), f64::from(x).exp());
            assert!(
                err <= 2.0,
                "exp({x}) = {} vs {}",
                exp(x),
                f64::from(x).exp()
            );
            worst = worst.max(err);
        }
        assert!(worst > 0.0, "the test compares something");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert_eq!(exp(-100.0), 0.0);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn silu_and_swiglu_follow_their_definitions() {
        let mut rng = Rng::new(22);
        for _ in 0..10_000 {
            let g = 24.0 * rng.unit() - 12.0;
            let u = 4.0 * rng.unit() - 2.0;
            let exact = f64::from(g) / (1.0 + (-f64::from(g)).exp());
            assert!(
                (f64::from(silu(g)) - exact).abs() <= 1e-6 * exact.abs().max(1e-3),
                "silu({g}) = {} vs {exact}",
                silu(g)
            );
            // One rounding of the product, no fused multiply-add.
            assert_eq!(swiglu(g, u).to_bits(), (silu(g) * u).to_bits());
        }
        assert_eq!(silu(0.0), 0.0);
        assert_eq!(silu(100.0), 100.0);
        assert_eq!(silu(-100.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(silu(f32::INFINITY), f32::INFINITY);
    }

    #[test]
    fn rows_take_gate_then_up() {
        let i = 256;
        let mut rng = Rng::new(23);
        let y1 = random_bf16(&mut rng, 2 * i);
        let mut act = vec![0u8; 2 * i];
        activate_row(Dtype::Bf16, &y1, &mut act, &mut []);
        for c in 0..i {
            let got = bf16::from_le_bytes([act[2 * c], act[2 * c + 1]]);
            let want = bf16::from_f32(swiglu(y1[c].to_f32(), y1[i + c].to_f32()));
            assert_eq!(got.to_bits(), want.to_bits(), "column {c}");
        }
        // Swapping the halves changes the result: the order is tested.
        let swapped = [&y1[i..], &y1[..i]].concat();
        let mut other = vec![0u8; 2 * i];
        activate_row(Dtype::Bf16, &swapped, &mut other, &mut []);
        assert_ne!(act, other);

        // FP8: per 128 columns, the codes and scale of the f32 values.
        let mut codes = vec![0u8; i];
        let mut scales = vec![0f32; i / 128];
        activate_row(Dtype::Fp8E4m3, &y1, &mut codes, &mut scales);
        for b in 0..i / 128 {
            let block: Vec<f32> = (b * 128..(b + 1) * 128)
                .map(|c| swiglu(y1[c].to_f32(), y1[i + c].to_f32()))
                .collect();
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(scales[b], amax / 448.0, "block {b}");
            for (k, &v) in block.iter().enumerate() {
                let back = e4m3_to_f32(codes[b * 128 + k]) * scales[b];
                assert!((back - v).abs() <= v.abs() / 16.0 + scales[b] / 512.0);
            }
        }
    }

    #[test]
    fn activate_skips_padding_and_empty_experts() {
        let i = 128;
        let mut rng = Rng::new(24);
        // Expert 0: 2 rows + 2 padding; expert 1: none; expert 2: 1 row.
        let (offsets, counts) = ([0, 4, 4, 5], [2, 0, 1]);
        let y1 = random_bf16(&mut rng, 5 * 2 * i);
        for dtype in [Dtype::Bf16, Dtype::Fp8E4m3] {
            let (act, scales) = activate(dtype, i, &y1, &offsets, &counts);
            let (rb, rs) = (dtype.row_bytes(i), dtype.scales_per_row(i));
            assert_eq!((act.len(), scales.len()), (5 * rb, 5 * rs));
            for j in [2, 3] {
                assert!(
                    act[j * rb..][..rb].iter().all(|&b| b == 0),
                    "{dtype:?} row {j}"
                );
            }
            for j in [0, 1, 4] {
                let mut row = vec![0u8; rb];
                let mut row_scales = vec![0f32; rs];
                activate_row(dtype, &y1[j * 2 * i..][..2 * i], &mut row, &mut row_scales);
                assert_eq!(&act[j * rb..][..rb], &row[..], "{dtype:?} row {j}");
                assert_eq!(&scales[j * rs..][..rs], &row_scales[..]);
            }
        }
    }

    /// The forward of one token on one rank with one expert, topk 1,
    /// written out with f64 sums: the composition is right.
    #[test]
    fn one_token_through_one_expert() {
        let (hidden, i) = (128, 128);
        let topo = Topology {
            world: 1,
            num_experts: 2,
            topk: 1,
            hidden,
        };
        let mut rng = Rng::new(25);
        let x = random_bf16(&mut rng, hidden);
        let w1: Vec<bf16> = random_bf16(&mut rng, 2 * 2 * i * hidden);
        let w2: Vec<bf16> = random_bf16(&mut rng, 2 * hidden * i);
        let (x_bytes, w1_bytes, w2_bytes) =
            (bf16_to_bytes(&x), bf16_to_bytes(&w1), bf16_to_bytes(&w2));
        let weights = MoeWeights {
            w1: ExpertWeights {
                dtype: Dtype::Bf16,
                n: 2 * i,
                k: hidden,
                data: &w1_bytes,
                scales: &[],
            },
            w2: ExpertWeights {
                dtype: Dtype::Bf16,
                n: hidden,
                k: i,
                data: &w2_bytes,
                scales: &[],
            },
        };
        let weight = 0.75f32;
        let source = RankTokens {
            num_tokens: 1,
            x: &x_bytes,
            scales: &[],
            topk_idx: &[1],
            topk_weights: &[weight],
        };
        let (out, ranks) = forward(topo, Dtype::Bf16, &[source], &[weights], 1);
        let expert = 1;
        let h1: Vec<f32> = (0..2 * i)
            .map(|c| {
                let row = &w1[(expert * 2 * i + c) * hidden..][..hidden];
                let sum: f64 = x
                    .iter()
                    .zip(row)
                    .map(|(a, b)| f64::from(a.to_f32()) * f64::from(b.to_f32()))
                    .sum();
                bf16::from_f64(sum).to_f32()
            })
            .collect();
        let a: Vec<f32> = (0..i)
            .map(|c| {
                let (g, u) = (f64::from(h1[c]), f64::from(h1[i + c]));
                bf16::from_f64(g / (1.0 + (-g).exp()) * u).to_f32()
            })
            .collect();
        assert_eq!(ranks[0].1.y1.len(), 2 * i);
        for c in 0..hidden {
            let row = &w2[(expert * hidden + c) * i..][..i];
            let y2: f64 = a
                .iter()
                .zip(row)
                .map(|(&v, w)| f64::from(v) * f64::from(w.to_f32()))
                .sum();
            let want = f64::from(weight) * f64::from(bf16::from_f64(y2).to_f32());
            let got = f64::from(out[0][c].to_f32());
            let magnitude: f64 = a
                .iter()
                .zip(row)
                .map(|(&v, w)| (f64::from(v) * f64::from(w.to_f32())).abs())
                .sum();
            assert!(
                (got - want).abs() <= 0.02 * want.abs() + 0.01 * magnitude,
                "column {c}: {got} vs {want}"
            );
        }
    }
}
