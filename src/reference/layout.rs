//! Expert-id validation and the dispatch layout (who sends what where).

use super::Topology;
use std::fmt;

/// An entry of `topk_idx` that is neither `-1` nor a valid expert id, or
/// that repeats an expert already listed for the same token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InvalidExpert {
    /// Token index of the bad entry.
    pub token: usize,
    /// Slot (`0..topk`) of the bad entry.
    pub slot: usize,
    /// The offending id.
    pub id: i32,
    /// The id is valid but an earlier slot of the token holds it already.
    pub duplicate: bool,
}

impl fmt::Display for InvalidExpert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let why = if self.duplicate {
            "listed twice for one token"
        } else {
            "expected -1 or 0..num_experts"
        };
        write!(
            f,
            "invalid expert id {} at token {}, slot {} ({why})",
            self.id, self.token, self.slot
        )
    }
}

impl std::error::Error for InvalidExpert {}

/// Checks that every entry of `topk_idx` (`num_tokens * topk`, token-major) is
/// `-1` or in `[0, num_experts)`, and that no token lists an expert twice;
/// reports the first bad one in (token, slot) order. The API rejects
/// duplicates so that a token adds at most one row per expert (the buffer
/// sizes and the GPU kernels rely on it); the functions of this module still
/// define a result for them.
///
/// # Panics
/// If `topk_idx.len() != num_tokens * topo.topk`.
pub fn validate_experts(
    topo: Topology,
    topk_idx: &[i32],
    num_tokens: usize,
) -> Result<(), InvalidExpert> {
    assert_eq!(
        topk_idx.len(),
        num_tokens * topo.topk,
        "topk_idx must hold num_tokens * topk entries"
    );
    for (n, &id) in topk_idx.iter().enumerate() {
        let (token, slot) = (n / topo.topk, n % topo.topk);
        let valid = id == -1 || usize::try_from(id).is_ok_and(|e| e < topo.num_experts);
        let earlier = &topk_idx[token * topo.topk..n];
        let duplicate = valid && id != -1 && earlier.contains(&id);
        if !valid || duplicate {
            return Err(InvalidExpert {
                token,
                slot,
                id,
                duplicate,
            });
        }
    }
    Ok(())
}

/// What a rank's routing implies for dispatch; see [`dispatch_layout`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// `[world]`: tokens with at least one expert on each rank.
    pub tokens_per_rank: Vec<i32>,
    /// `[num_experts]`: (token, slot) entries routed to each expert.
    pub tokens_per_expert: Vec<i32>,
    /// `[num_tokens * world]`, token-major: 1 if the token has at least one expert
    /// on that rank, else 0.
    pub is_token_in_rank: Vec<u8>,
}

/// Computes the dispatch layout of one rank's routing `topk_idx`
/// (`num_tokens * topk`, token-major). Dropped entries (-1) count nowhere; a token
/// that lists one expert twice counts twice for that expert but once for its rank.
///
/// # Panics
/// If the topology is inconsistent or `topk_idx` has the wrong length.
pub fn dispatch_layout(
    topo: Topology,
    topk_idx: &[i32],
    num_tokens: usize,
) -> Result<Layout, InvalidExpert> {
    topo.assert_consistent();
    validate_experts(topo, topk_idx, num_tokens)?;
    let world = topo.world;
    let mut layout = Layout {
        tokens_per_rank: vec![0; world],
        tokens_per_expert: vec![0; topo.num_experts],
        is_token_in_rank: vec![0; num_tokens * world],
    };
    for (ids, in_rank) in topk_idx
        .chunks_exact(topo.topk)
        .zip(layout.is_token_in_rank.chunks_exact_mut(world))
    {
        for &id in ids {
            if let Some((rank, _)) = topo.locate(id) {
                layout.tokens_per_expert[id as usize] += 1;
                in_rank[rank] = 1;
            }
        }
        for (count, &flag) in layout.tokens_per_rank.iter_mut().zip(in_rank.iter()) {
            *count += i32::from(flag);
        }
    }
    Ok(layout)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::testutil::{random_routing, topologies, Rng};

    fn topo(world: usize, num_experts: usize, topk: usize) -> Topology {
        Topology {
            world,
            num_experts,
            topk,
            hidden: 128,
        }
    }

    #[test]
    fn hand_computed_layout() {
        // 2 ranks, 2 experts each (rank 0: experts 0,1; rank 1: experts 2,3).
        let t = topo(2, 4, 2);
        let topk_idx = [
            0, 1, // token 0: rank 0 only
            3, -1, // token 1: rank 1 only
            -1, -1, // token 2: nowhere
            2, 3, // token 3: rank 1, two experts
            1, 2, // token 4: both ranks
        ];
        let layout = dispatch_layout(t, &topk_idx, 5).unwrap();
        assert_eq!(layout.tokens_per_rank, [2, 3]);
        assert_eq!(layout.tokens_per_expert, [1, 2, 2, 2]);
        assert_eq!(layout.is_token_in_rank, [1, 0, 0, 1, 0, 0, 0, 1, 1, 1]);
    }

    #[test]
    fn zero_tokens() {
        let layout = dispatch_layout(topo(4, 8, 2), &[], 0).unwrap();
        assert_eq!(layout.tokens_per_rank, [0; 4]);
        assert_eq!(layout.tokens_per_expert, [0; 8]);
        assert!(layout.is_token_in_rank.is_empty());
    }

    #[test]
    fn first_invalid_entry_is_reported() {
        let t = topo(2, 4, 2);
        let topk_idx = [0, 1, 2, 4, -2, 0];
        let err = validate_experts(t, &topk_idx, 3).unwrap_err();
        assert_eq!(
            err,
            InvalidExpert {
                token: 1,
                slot: 1,
                id: 4,
                duplicate: false,
            }
        );
        assert_eq!(dispatch_layout(t, &topk_idx, 3).unwrap_err(), err);
        let err = validate_experts(t, &[-2, 0], 1).unwrap_err();
        assert_eq!((err.token, err.slot, err.id), (0, 0, -2));
        assert!(err.to_string().contains("-2"));
        assert!(validate_experts(t, &[-1, 3, 0, -1], 2).is_ok());
        let err = validate_experts(t, &[0, i32::MIN], 1).unwrap_err();
        assert_eq!(err.id, i32::MIN);
        let err = validate_experts(t, &[-1, -1, 3, 3], 2).unwrap_err();
        assert_eq!(
            (err.token, err.slot, err.id, err.duplicate),
            (1, 1, 3, true)
        );
        assert!(err.to_string().contains("twice"));
    }

    #[test]
    fn random_layouts_agree_with_direct_counts() {
        let mut rng = Rng::new(5);
        for t in topologies() {
            for skewed in [false, true] {
                let num_tokens = rng.below(20);
                let topk_idx = random_routing(&mut rng, &t, num_tokens, 0.2, skewed);
                let layout = dispatch_layout(t, &topk_idx, num_tokens).unwrap();
                for expert in 0..t.num_experts {
                    let n = topk_idx.iter().filter(|&&id| id == expert as i32).count();
                    assert_eq!(layout.tokens_per_expert[expert], n as i32);
                }
                for rank in 0..t.world {
                    let mut tokens = 0;
                    for token in 0..num_tokens {
                        let ids = &topk_idx[token * t.topk..][..t.topk];
                        let here = ids
                            .iter()
                            .any(|&id| id >= 0 && t.rank_of_expert(id as usize) == rank);
                        assert_eq!(
                            layout.is_token_in_rank[token * t.world + rank],
                            u8::from(here)
                        );
                        tokens += usize::from(here);
                    }
                    assert_eq!(layout.tokens_per_rank[rank], tokens as i32);
                }
            }
        }
    }
}
