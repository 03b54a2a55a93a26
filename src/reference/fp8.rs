//! FP8 E4M3 conversion and per-128-channel quantization.
//!
//! The format is OCP "e4m3fn": 1 sign bit, 4 exponent bits (bias 7), 3 mantissa
//! bits, no infinities, and a single NaN pattern per sign (`0x7f` / `0xff`).
//! Finite magnitudes run from the smallest subnormal 2^-9 up to 448.
//!
//! Quantization must match the GPU kernel bit for bit, so every step below is a
//! single correctly rounded `f32` operation, written in the order the kernel does it.

use super::SCALE_BLOCK;
use half::bf16;

/// The largest finite E4M3 magnitude and the floor of a block's absolute
/// maximum, defined once with the kernels' constants (`EP_E4M3_MAX`,
/// `EP_AMAX_FLOOR`).
pub use crate::abi::{AMAX_FLOOR, E4M3_MAX};

/// The encoding of NaN that [`f32_to_e4m3`] produces.
pub const E4M3_NAN: u8 = 0x7f;

/// `2^k` as an `f32`, for `k` in the normal range `[-126, 127]`.
fn pow2(k: i32) -> f32 {
    debug_assert!((-126..=127).contains(&k));
    f32::from_bits(((k + 127) as u32) << 23)
}

/// Converts `x` to E4M3 with round-to-nearest-even, saturating to +-448.
///
/// This is CUDA's `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)`:
/// magnitudes above 448 (including infinities) become +-448, NaN becomes `0x7f`,
/// and the sign of zero is kept.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return E4M3_NAN;
    }
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    // Rounding can only reach 448 or the next value up (480, not representable),
    // and SATFINITE turns both into 448.
    if a > E4M3_MAX {
        return sign | 0x7e;
    }
    // The binade of `a` is [2^e, 2^(e+1)). E4M3 has 3 mantissa bits, so its values
    // there are multiples of 2^(e-3). Below the smallest normal 2^-6 the spacing
    // stays at that of the lowest binade, 2^-9 (subnormals), hence the clamp.
    // An f32 zero or subnormal has a biased exponent of 0 and lands in the clamp.
    let e = ((a.to_bits() >> 23) as i32 - 127).max(-6);
    // Scaling by a power of two is exact, so this is the one rounding step:
    // `steps` is `a` in units of 2^(e-3), rounded to nearest even, in [0, 16].
    let steps = (a * pow2(3 - e)).round_ties_even() as u8;
    // For a normal result the code is (biased exponent e+7) * 8 + (mantissa steps-8)
    // = (e+6) * 8 + steps. When rounding carries to steps == 16 this gives the
    // first code of the next binade, which is the right value. For subnormals
    // (e clamped to -6) it gives `steps` itself: mantissa `steps`, exponent field
    // 0, and steps == 8 is the smallest normal, code 0x08.
    let e_code = (e + 6) as u8;
    sign | (e_code * 8 + steps)
}

/// Decodes an E4M3 byte. `0x7f` and `0xff` decode to NaN.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let magnitude = b & 0x7f;
    if magnitude == E4M3_NAN {
        return f32::NAN;
    }
    let exponent = i32::from(magnitude >> 3);
    let mantissa = f32::from(magnitude & 0x07);
    let value = if exponent == 0 {
        // Subnormal: mantissa * 2^-9.
        mantissa * pow2(-9)
    } else {
        // Normal: 1.mmm * 2^(exponent-7) = (8 + mantissa) * 2^(exponent-10).
        (8.0 + mantissa) * pow2(exponent - 10)
    };
    if b & 0x80 != 0 {
        -value
    } else {
        value
    }
}

/// Rounds a positive, normal `s` up to a power of two; returns the power and its
/// exact reciprocal.
///
/// The rounding is done on the bits: a nonzero mantissa bumps the exponent and
/// clears the mantissa. The reciprocal of 2^(E-127) is 2^(127-E), whose biased
/// exponent is 254 - E, so it is built from bits too and no division rounds.
fn round_up_to_pow2(s: f32) -> (f32, f32) {
    let bits = s.to_bits();
    let mut exponent = bits >> 23;
    // The amax floor keeps s >= 1e-4 / 448, far above the subnormals.
    assert!(
        bits >> 31 == 0 && exponent != 0,
        "scale must be positive and normal"
    );
    if bits & 0x007f_ffff != 0 {
        exponent += 1;
    }
    let scale = f32::from_bits(exponent << 23);
    // Only an infinite block maximum (an infinite input) makes the scale infinite;
    // a multiplier of 0 then matches the default mode's 448 / inf.
    let inverse = if scale.is_finite() {
        f32::from_bits((254 - exponent) << 23)
    } else {
        0.0
    };
    (scale, inverse)
}

/// Quantizes one BF16 row to E4M3 with one scale per [`SCALE_BLOCK`] channels.
///
/// For each block of 128 channels:
/// - `amax = max(max |x|, 1e-4)` in `f32` (NaN inputs do not count),
/// - default scales: `scale = amax / 448`, `q = e4m3(x * (448 / amax))`,
/// - UE8M0 scales (`ue8m0 = true`): `scale = amax / 448` rounded up to a power
///   of two, `q = e4m3(x * (1 / scale))` with the exact reciprocal,
///
/// where every operation is one correctly rounded `f32` operation and `e4m3` is
/// [`f32_to_e4m3`]. `out[c]` receives `q` for channel `c`, `scales[b]` the scale
/// of block `b`; dequantize as `e4m3_to_f32(q) * scale`.
///
/// # Panics
/// If `row.len()` is not a multiple of 128, `out.len() != row.len()` or
/// `scales.len() != row.len() / 128`.
pub fn quantize_row(row: &[bf16], ue8m0: bool, out: &mut [u8], scales: &mut [f32]) {
    quantize_blocks(row, bf16::to_f32, ue8m0, out, scales);
}

/// [`quantize_row`]'s rule for a row of any element type that widens to
/// `f32` exactly (`to_f32`).
fn quantize_blocks<T: Copy>(
    row: &[T],
    to_f32: impl Fn(T) -> f32,
    ue8m0: bool,
    out: &mut [u8],
    scales: &mut [f32],
) {
    check_row_shapes(row.len(), out, scales);
    let blocks = row
        .chunks_exact(SCALE_BLOCK)
        .zip(out.chunks_exact_mut(SCALE_BLOCK))
        .zip(scales.iter_mut());
    for ((block, out_block), scale) in blocks {
        let amax = block_amax(block.iter().map(|&v| to_f32(v)));
        let multiplier = if ue8m0 {
            let (pow2_scale, inverse) = round_up_to_pow2(amax / E4M3_MAX);
            *scale = pow2_scale;
            inverse
        } else {
            let (default_scale, multiplier) = default_scale(amax);
            *scale = default_scale;
            multiplier
        };
        for (q, &v) in out_block.iter_mut().zip(block) {
            *q = f32_to_e4m3(to_f32(v) * multiplier);
        }
    }
}

/// The quantizers' shape rule: a row of a multiple of 128 channels, one
/// output byte per channel, one scale per block.
fn check_row_shapes(len: usize, out: &[u8], scales: &[f32]) {
    assert_eq!(len % SCALE_BLOCK, 0, "row length must be a multiple of 128");
    assert_eq!(out.len(), len, "output length must match the row");
    assert_eq!(
        scales.len(),
        len / SCALE_BLOCK,
        "one scale per 128 channels"
    );
}

/// A block's absolute maximum, floored at [`AMAX_FLOOR`]. `f32::max`
/// ignores a NaN operand, as the GPU's `fmaxf` does; the maximum does not
/// depend on the order of the values, so a GPU may reduce them as a tree.
fn block_amax(values: impl Iterator<Item = f32>) -> f32 {
    values.fold(0.0f32, |m, v| m.max(v.abs())).max(AMAX_FLOOR)
}

/// The default (not UE8M0) scale of a block of maximum `amax`, and the
/// multiplier that quantizes it: `(amax / 448, 448 / amax)`, each one
/// correctly rounded division.
fn default_scale(amax: f32) -> (f32, f32) {
    (amax / E4M3_MAX, E4M3_MAX / amax)
}

/// Quantizes one row of `f32` values to E4M3 with one scale per
/// [`SCALE_BLOCK`] channels, by the default rule of [`quantize_row`]: per
/// block `amax = max(max |x|, 1e-4)`, `scale = amax / 448`, `q = e4m3(x *
/// (448 / amax))`. The same codes and scales as [`quantize_row`] for values
/// that are BF16 (a BF16 value widens to `f32` exactly). Used where the
/// values were computed in `f32` and are quantized without a BF16 rounding
/// first (the SwiGLU activations of `ep_moe_forward`, `super::moe`).
///
/// # Panics
/// If `row.len()` is not a multiple of 128, `out.len() != row.len()` or
/// `scales.len() != row.len() / 128`.
pub fn quantize_f32_row(row: &[f32], out: &mut [u8], scales: &mut [f32]) {
    quantize_blocks(row, |v| v, false, out, scales);
}

/// [`quantize_row`] (no UE8M0) of each row of `cols` channels of `values`:
/// (e4m3 bytes, `[rows, cols / 128]` scales).
pub fn quantize_rows(values: &[bf16], cols: usize) -> (Vec<u8>, Vec<f32>) {
    let blocks = cols / SCALE_BLOCK;
    let mut out = vec![0u8; values.len()];
    let mut scales = vec![0f32; values.len() / SCALE_BLOCK];
    let rows = values
        .chunks_exact(cols)
        .zip(out.chunks_exact_mut(cols))
        .zip(scales.chunks_exact_mut(blocks));
    for ((row, out_row), row_scales) in rows {
        quantize_row(row, false, out_row, row_scales);
    }
    (out, scales)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::testutil::Rng;

    /// Independent oracle: the nearest finite E4M3 value by exhaustive search,
    /// ties to the even code (even mantissa), saturating at +-448.
    fn nearest_by_search(x: f32) -> u8 {
        let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = f64::from(x.abs());
        let mut best = 0u8;
        for code in 0..0x7fu8 {
            let d_new = (f64::from(e4m3_to_f32(code)) - a).abs();
            let d_best = (f64::from(e4m3_to_f32(best)) - a).abs();
            if d_new < d_best || (d_new == d_best && code % 2 == 0) {
                best = code;
            }
        }
        sign | best
    }

    #[test]
    fn every_byte_round_trips() {
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            if b & 0x7f == 0x7f {
                assert!(v.is_nan(), "{b:#04x}");
                assert_eq!(f32_to_e4m3(v), E4M3_NAN);
            } else {
                assert_eq!(f32_to_e4m3(v), b, "{b:#04x} decodes to {v}");
            }
        }
    }

    #[test]
    fn decodes_known_values() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert!(e4m3_to_f32(0x80).is_sign_negative());
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x07), 7.0 * 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x39), 1.125);
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0xfe), -448.0);
        assert!(e4m3_to_f32(0xff).is_nan());
    }

    #[test]
    fn ties_round_to_even() {
        // Between 1.0 (0x38) and 1.125 (0x39): even is 0x38.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        // Between 1.125 (0x39) and 1.25 (0x3a): even is 0x3a.
        assert_eq!(f32_to_e4m3(1.1875), 0x3a);
        assert_eq!(f32_to_e4m3(-1.1875), 0xba);
        // Just off the tie goes to the nearer value.
        assert_eq!(f32_to_e4m3(f32::from_bits(1.0625f32.to_bits() + 1)), 0x39);
        // Between 416 (0x7d) and 448 (0x7e): even is 0x7e.
        assert_eq!(f32_to_e4m3(432.0), 0x7e);
        // Between 384 (0x7c) and 416 (0x7d): even is 0x7c.
        assert_eq!(f32_to_e4m3(400.0), 0x7c);
    }

    #[test]
    fn large_values_saturate() {
        for x in [448.5, 463.9, 464.0, 480.0, 1e9, f32::MAX, f32::INFINITY] {
            assert_eq!(f32_to_e4m3(x), 0x7e, "{x}");
            assert_eq!(f32_to_e4m3(-x), 0xfe, "{}", -x);
        }
        assert_eq!(f32_to_e4m3(f32::NAN), E4M3_NAN);
        assert_eq!(f32_to_e4m3(-f32::NAN), E4M3_NAN);
    }

    #[test]
    fn subnormal_midpoints() {
        let quantum = 2f32.powi(-9);
        // Halfway between 0 and the smallest subnormal: ties to 0.
        assert_eq!(f32_to_e4m3(0.5 * quantum), 0x00);
        assert_eq!(f32_to_e4m3(-0.5 * quantum), 0x80);
        assert_eq!(f32_to_e4m3(0.5001 * quantum), 0x01);
        // 1.5 -> 2, 2.5 -> 2, 3.5 -> 4 (units of 2^-9).
        assert_eq!(f32_to_e4m3(1.5 * quantum), 0x02);
        assert_eq!(f32_to_e4m3(2.5 * quantum), 0x02);
        assert_eq!(f32_to_e4m3(3.5 * quantum), 0x04);
        // 7.5 units: between the largest subnormal and the smallest normal (0x08).
        assert_eq!(f32_to_e4m3(7.5 * quantum), 0x08);
        // f32 subnormals and zero.
        assert_eq!(f32_to_e4m3(f32::from_bits(1)), 0x00);
        assert_eq!(f32_to_e4m3(0.0), 0x00);
        assert_eq!(f32_to_e4m3(-0.0), 0x80);
    }

    #[test]
    fn matches_exhaustive_nearest_search() {
        let mut rng = Rng::new(7);
        let mut inputs = vec![];
        // Every representable value and every midpoint between neighbours.
        for code in 0..0x7eu8 {
            let lo = e4m3_to_f32(code);
            let hi = e4m3_to_f32(code + 1);
            inputs.extend([lo, 0.5 * (lo + hi)]);
        }
        // Random magnitudes spread over the whole range, with random signs.
        for _ in 0..2000 {
            let exponent = rng.below(24) as i32 - 14;
            let x = (1.0 + rng.unit()) * 2f32.powi(exponent);
            inputs.push(if rng.chance(0.5) { -x } else { x });
        }
        for x in inputs {
            assert_eq!(f32_to_e4m3(x), nearest_by_search(x), "{x:e}");
        }
    }

    #[test]
    fn quantize_known_row() {
        // Block 0 has amax 448: scale 1, values pass through.
        // Block 1 has amax 2: scale 2/448, multiplier 224.
        let mut row = vec![bf16::ZERO; 256];
        row[0] = bf16::from_f32(448.0);
        row[1] = bf16::from_f32(-1.0);
        row[2] = bf16::from_f32(0.0625);
        row[128] = bf16::from_f32(2.0);
        row[129] = bf16::from_f32(-0.5);
        row[130] = bf16::from_f32(0.01);
        let mut out = vec![0u8; 256];
        let mut scales = vec![0f32; 2];
        quantize_row(&row, false, &mut out, &mut scales);
        assert_eq!(scales, [1.0, 2.0 / 448.0]);
        assert_eq!(&out[..4], [0x7e, 0xb8, 0x18, 0x00]);
        // 2 * 224 = 448; -0.5 * 224 = -112 (0xee); bf16(0.01) * 224 = 2.2421875 -> 2.25 (0x41).
        assert_eq!(&out[128..132], [0x7e, 0xee, 0x41, 0x00]);
        let mult = 448.0f32 / 2.0;
        assert_eq!(out[130], f32_to_e4m3(bf16::from_f32(0.01).to_f32() * mult));

        // UE8M0: block 0's scale is exactly 1; block 1's 2/448 rounds up to 2^-7.
        quantize_row(&row, true, &mut out, &mut scales);
        assert_eq!(scales, [1.0, 2f32.powi(-7)]);
        assert_eq!(&out[..3], [0x7e, 0xb8, 0x18]);
        // Multiplier 128: 2 -> 256 (0x78), -0.5 -> -64 (0xe8).
        assert_eq!(&out[128..130], [0x78, 0xe8]);
    }

    #[test]
    fn default_multiplier_is_one_division() {
        // 448 / amax and 1 / (amax / 448) differ in the last bit here, and this x
        // lands close enough to a rounding boundary for the code to differ.
        let amax = bf16::from_f32(1.078125);
        let x = bf16::from_bits(0x39cf); // ~3.948e-4
        let mut row = vec![bf16::ZERO; 128];
        row[0] = amax;
        row[1] = x;
        let mut out = vec![0u8; 128];
        let mut scales = vec![0f32; 1];
        quantize_row(&row, false, &mut out, &mut scales);
        let amax = amax.to_f32();
        assert_ne!(448.0 / amax, 1.0 / (amax / 448.0));
        assert_eq!(out[1], 0x22);
        assert_eq!(f32_to_e4m3(x.to_f32() * (1.0 / (amax / 448.0))), 0x23);
    }

    #[test]
    fn f32_rows_quantize_like_bf16_rows_of_the_same_values() {
        let mut rng = Rng::new(17);
        let row: Vec<bf16> = (0..384)
            .map(|c| bf16::from_f32((1 + c / 128) as f32 * 3.0 * (2.0 * rng.unit() - 1.0)))
            .collect();
        let wide: Vec<f32> = row.iter().map(|v| v.to_f32()).collect();
        let (mut a, mut b) = (vec![0u8; 384], vec![0u8; 384]);
        let (mut sa, mut sb) = (vec![0f32; 3], vec![0f32; 3]);
        quantize_row(&row, false, &mut a, &mut sa);
        quantize_f32_row(&wide, &mut b, &mut sb);
        assert_eq!(a, b);
        assert_eq!(sa, sb);
        // The f32 values are quantized as they are, not rounded to BF16
        // first: 1.0625 + 2^-12 is just above the midpoint of 1.0 (0x38)
        // and 1.125 (0x39), while its BF16 rounding is the midpoint itself,
        // which goes to the even code.
        let mut fine = vec![0f32; 128];
        fine[0] = 448.0;
        fine[1] = 1.0625 + 2f32.powi(-12);
        let mut q = vec![0u8; 128];
        let mut s = vec![0f32; 1];
        quantize_f32_row(&fine, &mut q, &mut s);
        assert_eq!(s[0], 1.0);
        assert_eq!((q[0], q[1]), (0x7e, 0x39));
        assert_eq!(f32_to_e4m3(bf16::from_f32(fine[1]).to_f32()), 0x38);
        // An all-zero block takes the floor, as in quantize_row.
        quantize_f32_row(&[0.0; 128], &mut q, &mut s);
        assert_eq!(s[0], AMAX_FLOOR / E4M3_MAX);
        assert!(q.iter().all(|&c| c == 0));
    }

    #[test]
    fn quantize_zero_row_uses_the_amax_floor() {
        let row = vec![bf16::ZERO; 128];
        let mut out = vec![0xaau8; 128];
        let mut scales = vec![0f32; 1];
        quantize_row(&row, false, &mut out, &mut scales);
        assert!(out.iter().all(|&q| q == 0));
        assert_eq!(scales[0], 1e-4f32 / 448.0);
        quantize_row(&row, true, &mut out, &mut scales);
        assert!(out.iter().all(|&q| q == 0));
        // 1e-4 / 448 ~ 2.23e-7 rounds up to 2^-22.
        assert_eq!(scales[0], 2f32.powi(-22));
    }

    #[test]
    fn quantize_random_rows_dequantize_closely() {
        let mut rng = Rng::new(11);
        for ue8m0 in [false, true] {
            for _ in 0..20 {
                // Blocks of very different magnitudes.
                let row: Vec<bf16> = (0..256)
                    .map(|c| {
                        let magnitude = if c < 128 { 1000.0 } else { 0.001 };
                        bf16::from_f32(magnitude * (2.0 * rng.unit() - 1.0))
                    })
                    .collect();
                let mut out = vec![0u8; 256];
                let mut scales = vec![0f32; 2];
                quantize_row(&row, ue8m0, &mut out, &mut scales);
                for (c, (&q, x)) in out.iter().zip(&row).enumerate() {
                    let scale = scales[c / 128];
                    let back = e4m3_to_f32(q) * scale;
                    let x = x.to_f32();
                    // 3 mantissa bits: relative error <= 2^-4, plus the subnormal
                    // spacing 2^-9 (in units of the scale) near zero.
                    let tol = x.abs() / 16.0 + scale * 2f32.powi(-9);
                    assert!((back - x).abs() <= tol, "{x} -> {back}");
                    if ue8m0 {
                        assert_eq!(scale.to_bits() & 0x007f_ffff, 0, "power of two");
                    }
                }
            }
        }
    }

    #[test]
    fn ue8m0_scale_is_exact_power_of_two_at_or_above() {
        let mut rng = Rng::new(3);
        for _ in 0..1000 {
            let s = (1.0 + rng.unit()) * 2f32.powi(rng.below(60) as i32 - 30);
            let (p, inv) = round_up_to_pow2(s);
            assert!(p >= s && p / 2.0 < s, "{s} -> {p}");
            assert_eq!(p * inv, 1.0);
        }
        assert_eq!(round_up_to_pow2(0.25), (0.25, 4.0));
        // Any nonzero mantissa bit rounds up, down to the last one.
        assert_eq!(round_up_to_pow2(1f32.next_up()), (2.0, 0.5));
        assert_eq!(round_up_to_pow2(0.5f32.next_down()), (0.5, 2.0));
    }

    #[test]
    fn infinite_input_gives_nan_code_and_zeros() {
        let mut row = vec![bf16::from_f32(1.0); 128];
        row[5] = bf16::INFINITY;
        let mut out = vec![0u8; 128];
        let mut scales = vec![0f32; 1];
        for ue8m0 in [false, true] {
            quantize_row(&row, ue8m0, &mut out, &mut scales);
            assert_eq!(scales[0], f32::INFINITY);
            assert_eq!(out[5], E4M3_NAN);
            assert_eq!(out[0], 0x00);
        }
    }
}
