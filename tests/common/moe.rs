//! Inputs and checks of the `ep_moe_forward` tests, shared by the
//! host-backend tests and the GPU tests: every rank's tokens and expert
//! weights made from seeds, what a rank reads back, and a straightforward
//! computation of every stage in f64, written from the API's definition
//! (`ep_moe_args_t`) without the reference code, to compare with.

use super::mega::{random_rows, Weights};
use super::normal::Input;
use super::{is_poisoned, routing, weights as routing_weights, Rng};
use ep::reference::fp8::e4m3_to_f32;
use ep::reference::mega::tolerance;
use ep::reference::moe::MoeWeights;
use ep::reference::normal::worst_case_rows;
use ep::reference::{Dtype, Topology};
use half::bf16;

/// One `ep_moe_forward` of every rank.
#[derive(Clone, Debug)]
pub struct MoeCase {
    pub world: usize,
    pub hidden: usize,
    /// `I`: the gate+up GEMM makes `2I` columns.
    pub intermediate: usize,
    pub experts: usize,
    pub topk: usize,
    pub dtype: Dtype,
    pub alignment: usize,
    /// Tokens of each rank.
    pub tokens: Vec<usize>,
    /// Probability that a slot is dropped (-1).
    pub drop: f32,
    /// Most tokens' first slot goes to this expert (uneven routing).
    pub hot: Option<usize>,
    pub seed: u64,
    /// The dispatch with `EP_DISPATCH_KEEP_PADDING`: its padding rows
    /// (expert-major x, scales, y1) keep what they held.
    pub keep_padding: bool,
}

impl MoeCase {
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

    /// The config's `max_tokens_per_rank`: the most tokens of a rank, at
    /// least 1.
    pub fn max_tokens(&self) -> usize {
        (*self.tokens.iter().max().unwrap()).max(1)
    }

    /// The worst-case expert-major rows (`ep_get_dispatch_capacity`).
    pub fn capacity(&self) -> usize {
        worst_case_rows(self.topo(), self.max_tokens(), self.alignment).1
    }

    fn rng(&self, what: u64, rank: usize) -> Rng {
        Rng::new(
            self.seed
                .wrapping_mul(1_000_033)
                .wrapping_add(what.wrapping_mul(104_729))
                .wrapping_add(rank as u64),
        )
    }
}

/// One rank's inputs: its tokens and its experts' weights.
pub struct RankData {
    pub tokens: Input,
    pub w1: Weights,
    pub w2: Weights,
}

impl RankData {
    pub fn weights(&self) -> MoeWeights<'_> {
        MoeWeights {
            w1: self.w1.view(),
            w2: self.w2.view(),
        }
    }
}

/// Rank `rank`'s inputs of `case`.
pub fn rank_data(case: &MoeCase, rank: usize) -> RankData {
    let mut rng = case.rng(1, rank);
    let n = case.tokens[rank];
    let topk_idx = routing(&mut rng, case.experts, case.topk, n, case.drop, case.hot);
    let topk_weights = routing_weights(&mut rng, n * case.topk);
    let (x, scales) = random_rows(&mut rng, case.dtype, n, case.hidden);
    let (l, i, hidden) = (case.local_experts(), case.intermediate, case.hidden);
    let mut rng = case.rng(2, rank);
    let w1 = Weights::random(case.dtype, l, 2 * i, hidden, &mut rng);
    let w2 = Weights::random(case.dtype, l, hidden, i, &mut rng);
    RankData {
        tokens: Input {
            num_tokens: n,
            x,
            scales,
            topk_idx,
            topk_weights,
        },
        w1,
        w2,
    }
}

/// What one rank reads back after its call: the dispatch's layout and
/// every intermediate over the whole capacity, and its combined tokens.
#[derive(Clone, Debug)]
pub struct MoeOutputs {
    pub offsets: Vec<i32>,
    pub counts: Vec<i32>,
    /// `[capacity, 2I]`.
    pub y1: Vec<bf16>,
    /// `[capacity, I]` BF16 bytes or e4m3 codes; FP8: `[capacity, I / 128]`.
    pub act: Vec<u8>,
    pub act_scales: Vec<f32>,
    /// `[capacity, hidden]`.
    pub y2: Vec<bf16>,
    /// `[num_tokens, hidden]`.
    pub out: Vec<bf16>,
}

/// A deliberate mistake of the straightforward computation, to show that
/// its comparisons fail on wrong results.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mistake {
    None,
    /// Every pair uses the weights of the next local expert.
    WrongExpert,
    /// The gate and up halves of `y1` swapped.
    SwappedHalves,
    /// Every slot takes the routing weight of the next slot.
    WrongRoutingWeight,
}

/// Element `i` of row `row` (`cols` wide) of BF16 bytes or e4m3 codes
/// with one scale per 128 columns, as f64.
fn element(dtype: Dtype, data: &[u8], scales: &[f32], cols: usize, row: usize, i: usize) -> f64 {
    match dtype {
        Dtype::Bf16 => {
            let at = 2 * (row * cols + i);
            f64::from(bf16::from_le_bytes([data[at], data[at + 1]]).to_f32())
        }
        Dtype::Fp8E4m3 => {
            let code = data[row * cols + i];
            let scale = scales[row * (cols / 128) + i / 128];
            f64::from(e4m3_to_f32(code)) * f64::from(scale)
        }
    }
}

/// Weight `(row, col)` of expert `e` of `w` (`[experts, n, k]`, FP8 with
/// one scale per 128 x 128 block), as f64.
fn weight(w: &Weights, e: usize, row: usize, col: usize) -> f64 {
    let at = (e * w.n + row) * w.k + col;
    match w.dtype {
        Dtype::Bf16 => {
            f64::from(bf16::from_le_bytes([w.data[2 * at], w.data[2 * at + 1]]).to_f32())
        }
        Dtype::Fp8E4m3 => {
            let blocks = (w.n / 128) * (w.k / 128);
            let scale = w.scales[e * blocks + (row / 128) * (w.k / 128) + col / 128];
            f64::from(e4m3_to_f32(w.data[at])) * f64::from(scale)
        }
    }
}

/// `x * w[e]^T` in f64 for one row `x` (`k` values): each output value and
/// the size of its products, `sqrt(sum (x_i w_i)^2)`.
fn product(x: &[f64], w: &Weights, e: usize) -> Vec<(f64, f64)> {
    (0..w.n)
        .map(|c| {
            let (mut sum, mut squares) = (0f64, 0f64);
            for (i, &xi) in x.iter().enumerate() {
                let p = xi * weight(w, e, c, i);
                sum += p;
                squares += p * p;
            }
            (sum, squares.sqrt())
        })
        .collect()
}

/// Checks a GEMM row against the f64 values, within the tolerance of the
/// fused calls' GEMM (`ep::reference::mega::tolerance`).
fn check_gemm(dtype: Dtype, got: &[bf16], want: &[(f64, f64)], what: &str) -> Result<(), String> {
    for (c, (g, &(value, size))) in got.iter().zip(want).enumerate() {
        let tol = f64::from(tolerance(dtype, value as f32, size as f32));
        let err = (f64::from(g.to_f32()) - value).abs();
        if !within(err, tol) {
            return Err(format!(
                "{what}: column {c}: {g}, computed {value}, error {err} > {tol}"
            ));
        }
    }
    Ok(())
}

/// `err <= tol`, false for a NaN (which no comparison accepts).
fn within(err: f64, tol: f64) -> bool {
    err <= tol
}

/// `silu(g) * u` in f64.
fn swiglu(g: f64, u: f64) -> f64 {
    g / (1.0 + (-g).exp()) * u
}

/// Checks an activation row against SwiGLU of the row `y1` (`2I`) in f64:
/// BF16 within one BF16 unit in the last place; FP8 scales within 1e-5
/// of `max(amax, 1e-4) / 448` and values within one e4m3 unit.
fn check_activation(
    dtype: Dtype,
    y1: &[bf16],
    act: &[u8],
    scales: &[f32],
    swapped: bool,
    what: &str,
) -> Result<(), String> {
    let i = y1.len() / 2;
    let (gate, up) = if swapped {
        (&y1[i..], &y1[..i])
    } else {
        (&y1[..i], &y1[i..])
    };
    let a: Vec<f64> = gate
        .iter()
        .zip(up)
        .map(|(g, u)| swiglu(f64::from(g.to_f32()), f64::from(u.to_f32())))
        .collect();
    for block in 0..i / 128 {
        let range = block * 128..(block + 1) * 128;
        let scale = match dtype {
            Dtype::Bf16 => 0.0,
            Dtype::Fp8E4m3 => {
                let amax = a[range.clone()].iter().fold(0f64, |m, v| m.max(v.abs()));
                let want = amax.max(1e-4) / 448.0;
                let got = f64::from(scales[block]);
                if !within((got - want).abs(), 1e-5 * want) {
                    return Err(format!(
                        "{what}: scale of block {block}: {got}, computed {want}"
                    ));
                }
                got
            }
        };
        for c in range {
            let got = element(dtype, act, scales, i, 0, c);
            let tol = match dtype {
                Dtype::Bf16 => a[c].abs() / 128.0 + 1e-30,
                Dtype::Fp8E4m3 => a[c].abs() / 8.0 + scale / 256.0,
            };
            if !within((got - a[c]).abs(), tol) {
                return Err(format!("{what}: column {c}: {got}, computed {}", a[c]));
            }
        }
    }
    Ok(())
}

/// The expert-major rows of one rank's local expert: (source rank, token,
/// slot) of each of its pairs, in source order.
fn pairs_of(case: &MoeCase, data: &[RankData], expert: usize) -> Vec<(usize, usize, usize)> {
    let mut pairs = Vec::new();
    for (s, d) in data.iter().enumerate() {
        let t = &d.tokens;
        for token in 0..t.num_tokens {
            for slot in 0..case.topk {
                if t.topk_idx[token * case.topk + slot] == expert as i32 {
                    pairs.push((s, token, slot));
                }
            }
        }
    }
    pairs
}

/// Compares every rank's outputs with the straightforward computation of
/// each stage from the previous stage's outputs (the API's definition):
/// the layout exactly; `y1` from the tokens, `y2` from `act` within the
/// GEMM tolerance; `act` from `y1` (see [`check_activation`]); every token
/// from `y2` within two BF16 roundings (`sum |w y2| / 64`); padding rows
/// of `y1` zero. `mistake` makes the computation wrong on purpose.
pub fn check_independent(
    case: &MoeCase,
    data: &[RankData],
    outs: &[MoeOutputs],
    mistake: Mistake,
) -> Result<(), String> {
    let (hidden, i, l, dtype) = (
        case.hidden,
        case.intermediate,
        case.local_experts(),
        case.dtype,
    );
    let (act_bytes, act_scales) = (dtype.row_bytes(i), dtype.scales_per_row(i));
    // (rank, expert-major row) of every (source, token, slot).
    let mut row_of = std::collections::HashMap::new();
    for (rank, out) in outs.iter().enumerate() {
        let w = &data[rank];
        let mut start = 0;
        for e in 0..l {
            let pairs = pairs_of(case, data, rank * l + e);
            let what = format!("rank {rank} expert {e}");
            if out.offsets[e] != start as i32 || out.counts[e] != pairs.len() as i32 {
                return Err(format!(
                    "{what}: offset {} count {}, computed {start} and {}",
                    out.offsets[e],
                    out.counts[e],
                    pairs.len()
                ));
            }
            let e_weights = match mistake {
                Mistake::WrongExpert => (e + 1) % l,
                _ => e,
            };
            for (p, &(s, token, slot)) in pairs.iter().enumerate() {
                let j = start + p;
                row_of.insert((s, token, slot), (rank, j));
                let what = format!("{what} row {j}");
                let t = &data[s].tokens;
                let x: Vec<f64> = (0..hidden)
                    .map(|c| element(dtype, &t.x, &t.scales, hidden, token, c))
                    .collect();
                let y1 = &out.y1[j * 2 * i..][..2 * i];
                check_gemm(
                    dtype,
                    y1,
                    &product(&x, &w.w1, e_weights),
                    &format!("{what}: y1"),
                )?;
                let act = &out.act[j * act_bytes..][..act_bytes];
                let scales = &out.act_scales[j * act_scales..][..act_scales];
                let swapped = mistake == Mistake::SwappedHalves;
                check_activation(dtype, y1, act, scales, swapped, &format!("{what}: act"))?;
                let a: Vec<f64> = (0..i)
                    .map(|c| element(dtype, act, scales, i, 0, c))
                    .collect();
                let y2 = &out.y2[j * hidden..][..hidden];
                check_gemm(
                    dtype,
                    y2,
                    &product(&a, &w.w2, e_weights),
                    &format!("{what}: y2"),
                )?;
            }
            let end = start + pairs.len().div_ceil(case.alignment) * case.alignment;
            for j in start + pairs.len()..end {
                let y1 = &out.y1[j * 2 * i..][..2 * i];
                if case.keep_padding {
                    if !is_poisoned(y1) {
                        return Err(format!("rank {rank}: padding row {j} of y1 was written"));
                    }
                } else if y1.iter().any(|v| v.to_bits() != 0) {
                    return Err(format!("rank {rank}: padding row {j} of y1 is not zero"));
                }
            }
            start = end;
        }
        if out.offsets[l] != start as i32 {
            return Err(format!(
                "rank {rank}: end offset {}, computed {start}",
                out.offsets[l]
            ));
        }
    }
    for (s, out) in outs.iter().enumerate() {
        let t = &data[s].tokens;
        for token in 0..t.num_tokens {
            let mut want = vec![0f64; hidden];
            let mut size = vec![0f64; hidden];
            for slot in 0..case.topk {
                let Some(&(rank, j)) = row_of.get(&(s, token, slot)) else {
                    continue;
                };
                let w_slot = match mistake {
                    Mistake::WrongRoutingWeight => (slot + 1) % case.topk,
                    _ => slot,
                };
                let w = f64::from(t.topk_weights[token * case.topk + w_slot]);
                for c in 0..hidden {
                    let term = w * f64::from(outs[rank].y2[j * hidden + c].to_f32());
                    want[c] += term;
                    size[c] += term.abs();
                }
            }
            for c in 0..hidden {
                let got = f64::from(out.out[token * hidden + c].to_f32());
                if !within((got - want[c]).abs(), size[c] / 64.0) {
                    return Err(format!(
                        "rank {s} token {token} channel {c}: {got}, computed {}",
                        want[c]
                    ));
                }
            }
        }
    }
    Ok(())
}
