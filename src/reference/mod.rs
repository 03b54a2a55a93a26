//! Reference semantics of every `ep` operation.
//!
//! This module is the oracle: plain, single-threaded Rust that defines exactly what
//! each operation produces. GPU results are compared with it (bit-exact for dispatch,
//! FP8 quantization and scales; within rounding for the combines), and the host
//! backend runs it directly.
//!
//! Conventions shared by the submodules:
//! - An operation that moves tokens between ranks takes the inputs of *all* ranks
//!   (a slice indexed by rank) and returns what one rank (`rank`) ends up with.
//! - Token rows are raw little-endian bytes, `hidden * elem_bytes` per row, so BF16
//!   and FP8 share the data movement code. FP8 rows come with one `f32` scale per
//!   [`SCALE_BLOCK`] channels (value = fp8 * scale).
//! - `topk_idx` holds global expert ids, `topk` per token; `-1` means "no expert"
//!   (the slot was dropped). Any other id outside `[0, num_experts)` is invalid.
//! - Reductions accumulate in `f32` starting from `0.0` in a fixed, documented
//!   order and round to BF16 once (round-to-nearest-even) at the end.
//!
//! Wrong shapes (slice lengths that do not match the topology) are caller bugs and
//! panic. Invalid expert ids are data errors: [`layout::validate_experts`] reports
//! them, and the operations that take routing panic on them.

pub mod fp8;
pub mod hierarchical;
pub mod layout;
pub mod low_latency;
pub mod mega;
pub mod moe;
pub mod normal;

/// Number of channels that share one FP8 scale.
pub const SCALE_BLOCK: usize = 128;

/// Shape of an expert-parallel group.
///
/// Rank `r` holds the global experts `[r * L, (r + 1) * L)` where
/// `L = local_experts()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Topology {
    /// Number of ranks.
    pub world: usize,
    /// Number of experts over all ranks; a multiple of `world`.
    pub num_experts: usize,
    /// Expert slots per token (entries of `topk_idx` per token).
    pub topk: usize,
    /// Channels per token; a multiple of [`SCALE_BLOCK`].
    pub hidden: usize,
}

impl Topology {
    /// Experts held by each rank (`num_experts / world`).
    pub fn local_experts(&self) -> usize {
        self.num_experts / self.world
    }

    /// The rank that holds global expert `expert`.
    pub fn rank_of_expert(&self, expert: usize) -> usize {
        expert / self.local_experts()
    }

    /// Panics unless the topology is one the operations are defined for.
    fn assert_consistent(&self) {
        assert!(self.world >= 1, "world must be at least 1: {self:?}");
        assert!(
            self.num_experts >= self.world && self.num_experts.is_multiple_of(self.world),
            "num_experts must be a positive multiple of world: {self:?}"
        );
        assert!(self.topk >= 1, "topk must be at least 1: {self:?}");
        assert!(
            self.hidden > 0 && self.hidden.is_multiple_of(SCALE_BLOCK),
            "hidden must be a positive multiple of {SCALE_BLOCK}: {self:?}"
        );
    }

    /// Where the expert `id` from `topk_idx` lives: `Some((rank, local expert))`,
    /// or `None` for `-1` (dropped). The id must already be validated.
    fn locate(&self, id: i32) -> Option<(usize, usize)> {
        let expert = usize::try_from(id).ok()?;
        assert!(expert < self.num_experts, "unvalidated expert id {id}");
        let local = self.local_experts();
        Some((expert / local, expert % local))
    }
}

/// Element type of token rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// bfloat16, 2 bytes per element (little-endian `u16` bits).
    Bf16,
    /// FP8 E4M3 (OCP e4m3fn), 1 byte per element, plus one `f32` scale per
    /// [`SCALE_BLOCK`] channels.
    Fp8E4m3,
}

impl Dtype {
    /// Bytes per element.
    pub fn elem_bytes(self) -> usize {
        match self {
            Dtype::Bf16 => 2,
            Dtype::Fp8E4m3 => 1,
        }
    }

    /// Bytes per token row of `hidden` channels.
    pub fn row_bytes(self, hidden: usize) -> usize {
        hidden * self.elem_bytes()
    }

    /// Scales per token row of `hidden` channels (0 for BF16).
    pub fn scales_per_row(self, hidden: usize) -> usize {
        match self {
            Dtype::Bf16 => 0,
            Dtype::Fp8E4m3 => hidden / SCALE_BLOCK,
        }
    }
}

/// Helpers shared by the tests of all submodules.
#[cfg(test)]
mod testutil {
    use super::Topology;
    use half::bf16;

    /// Tiny deterministic PRNG (splitmix64), so tests need no dependency.
    pub struct Rng(u64);

    impl Rng {
        pub fn new(seed: u64) -> Self {
            Rng(seed)
        }

        pub fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }

        /// Uniform in `[0, n)`; `n` must be positive.
        pub fn below(&mut self, n: usize) -> usize {
            (self.next_u64() % n as u64) as usize
        }

        /// Uniform in `[0, 1)`, 24 random bits.
        pub fn unit(&mut self) -> f32 {
            (self.next_u64() >> 40) as f32 / (1u32 << 24) as f32
        }

        pub fn chance(&mut self, p: f32) -> bool {
            self.unit() < p
        }
    }

    /// The topologies every test sweeps: world 1, 2, 4; one local expert or 16
    /// experts in all; topk 1, 4, 16 where it fits; hidden 128 and 256.
    pub fn topologies() -> Vec<Topology> {
        let mut out = Vec::new();
        for world in [1, 2, 4] {
            for num_experts in [world, 16] {
                for topk in [1, 4, 16] {
                    for hidden in [128, 256] {
                        if topk <= num_experts {
                            out.push(Topology {
                                world,
                                num_experts,
                                topk,
                                hidden,
                            });
                        }
                    }
                }
            }
        }
        out
    }

    /// Routing for `num_tokens` tokens: `topk` distinct experts per token, each
    /// slot dropped (-1) with probability `drop`. `skewed` sends most tokens'
    /// first slot to expert 0.
    pub fn random_routing(
        rng: &mut Rng,
        topo: &Topology,
        num_tokens: usize,
        drop: f32,
        skewed: bool,
    ) -> Vec<i32> {
        let mut out = Vec::with_capacity(num_tokens * topo.topk);
        for _ in 0..num_tokens {
            // Partial Fisher-Yates shuffle: the first topk entries become the pick.
            let mut pool: Vec<i32> = (0..topo.num_experts as i32).collect();
            for k in 0..topo.topk {
                let hot = k == 0 && skewed && rng.chance(0.8);
                let pick = if hot {
                    0
                } else {
                    k + rng.below(topo.num_experts - k)
                };
                pool.swap(k, pick);
            }
            for &id in &pool[..topo.topk] {
                out.push(if rng.chance(drop) { -1 } else { id });
            }
        }
        out
    }

    /// Positive routing weights in `[0.05, 1.05)`.
    pub fn random_weights(rng: &mut Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| 0.05 + rng.unit()).collect()
    }

    /// BF16 values in `[-2, 2)`.
    pub fn random_bf16(rng: &mut Rng, n: usize) -> Vec<bf16> {
        (0..n)
            .map(|_| bf16::from_f32(4.0 * rng.unit() - 2.0))
            .collect()
    }

    pub fn bf16_to_bytes(values: &[bf16]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    pub fn bytes_to_bf16(bytes: &[u8]) -> Vec<bf16> {
        bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn experts_map_to_contiguous_ranks() {
        let topo = Topology {
            world: 4,
            num_experts: 16,
            topk: 4,
            hidden: 128,
        };
        topo.assert_consistent();
        assert_eq!(topo.local_experts(), 4);
        assert_eq!(topo.rank_of_expert(0), 0);
        assert_eq!(topo.rank_of_expert(3), 0);
        assert_eq!(topo.rank_of_expert(4), 1);
        assert_eq!(topo.rank_of_expert(15), 3);
        assert_eq!(topo.locate(-1), None);
        assert_eq!(topo.locate(9), Some((2, 1)));
    }

    #[test]
    fn dtype_sizes() {
        assert_eq!(Dtype::Bf16.elem_bytes(), 2);
        assert_eq!(Dtype::Fp8E4m3.elem_bytes(), 1);
        assert_eq!(Dtype::Bf16.row_bytes(256), 512);
        assert_eq!(Dtype::Fp8E4m3.row_bytes(256), 256);
        assert_eq!(Dtype::Bf16.scales_per_row(256), 0);
        assert_eq!(Dtype::Fp8E4m3.scales_per_row(256), 2);
    }

    #[test]
    #[should_panic(expected = "multiple of world")]
    fn uneven_experts_are_rejected() {
        Topology {
            world: 4,
            num_experts: 6,
            topk: 1,
            hidden: 128,
        }
        .assert_consistent();
    }
}
