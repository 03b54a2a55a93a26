//! The hierarchical (multi-node) normal mode: how a token travels when the
//! ranks form nodes, and the combine's summation order.
//!
//! Ranks `[n * R, (n + 1) * R)` form node `n` (`R` = ranks per node); a
//! rank's *local index* is its position in its node, and the ranks of one
//! local index on every node form a *rail*. Ranks of a node reach each other
//! over NVLink; a network leg connects the nodes, rail to rail.
//!
//! # Dispatch
//! 1. Notify: each source sends its counts (tokens per node and per rank,
//!    (token, slot) pairs per expert, its token count) to its rail peer on
//!    every node, so every receiver knows its sizes before any row arrives.
//! 2. Network leg: each token crosses the network ONCE per destination node
//!    other than the source's own, to the source's rail peer there (its
//!    *gateway* on that node). A source sends to the remote nodes in ring
//!    order (`node + 1`, `node + 2`, ... modulo the node count), so the nodes
//!    do not all send to node 0 first.
//! 3. NVLink leg: the gateway forwards the token to each rank of its node
//!    that holds one of the token's experts, once per destination rank. On
//!    the source's own node the source is the gateway.
//!
//! What each rank receives is exactly the single-node dispatch of
//! [`super::normal::dispatch`]: the hierarchy changes the path of a row,
//! never the row or its place.
//!
//! # Combine
//! The reverse path, reducing as early as possible:
//! 1. every expert rank makes one row per received (source, token): the
//!    caller's row, or the weighted sum of its expert rows
//!    ([`super::normal::expert_partials`]), BF16;
//! 2. it sends that row over NVLink to the source's gateway on its own node,
//!    which sums the rows of its node (local index ascending) in fp32 and
//!    rounds to BF16: one *node partial* per (token, node);
//! 3. the gateway sends the node partial over the network to the source
//!    (one row per token and remote node);
//! 4. the source sums the node partials of its token, nodes ascending, in
//!    fp32 and rounds to BF16 once.
//!
//! [`combine`] is that order, exactly; with one rank per node or one node it
//! equals the single-node [`super::normal::combine`] bit for bit.

use super::normal::{add_rows, Returned};
use super::Topology;
use half::bf16;

/// How the ranks of a group form nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeShape {
    /// Ranks in the group.
    pub world: usize,
    /// Ranks per node; divides `world`.
    pub ranks_per_node: usize,
}

impl NodeShape {
    /// # Panics
    /// Unless `ranks_per_node` is at least 1 and divides `world`.
    pub fn new(world: usize, ranks_per_node: usize) -> NodeShape {
        assert!(
            ranks_per_node >= 1 && world.is_multiple_of(ranks_per_node),
            "ranks_per_node {ranks_per_node} must divide the world size {world}"
        );
        NodeShape {
            world,
            ranks_per_node,
        }
    }

    /// Number of nodes.
    pub fn nodes(&self) -> usize {
        self.world / self.ranks_per_node
    }

    /// True when there is more than one node (the hierarchical modes run).
    pub fn is_hierarchical(&self) -> bool {
        self.nodes() > 1
    }

    pub fn node_of(&self, rank: usize) -> usize {
        rank / self.ranks_per_node
    }

    /// Position of `rank` in its node (its rail).
    pub fn local_index(&self, rank: usize) -> usize {
        rank % self.ranks_per_node
    }

    /// The rank of local index `local` on node `node`.
    pub fn rank_at(&self, node: usize, local: usize) -> usize {
        node * self.ranks_per_node + local
    }

    /// The ranks of node `node`, ascending.
    pub fn ranks_of(&self, node: usize) -> std::ops::Range<usize> {
        node * self.ranks_per_node..(node + 1) * self.ranks_per_node
    }

    /// Where `source`'s tokens for node `node` arrive: the rank of `node`
    /// with `source`'s local index (its rail peer; `source` itself on its
    /// own node).
    pub fn gateway(&self, source: usize, node: usize) -> usize {
        self.rank_at(node, self.local_index(source))
    }

    /// The nodes other than `node`, in the order a rank of `node` sends to
    /// them: `node + 1`, `node + 2`, ... modulo the node count.
    pub fn ring_order(&self, node: usize) -> impl Iterator<Item = usize> {
        let n = self.nodes();
        (1..n).map(move |step| (node + step) % n)
    }
}

/// The ranks token `token` goes to: those holding one of its experts,
/// ascending. `topk_idx` must be validated.
pub fn destination_ranks(topo: Topology, topk_idx: &[i32], token: usize) -> Vec<usize> {
    let mut ranks: Vec<usize> = topk_idx[token * topo.topk..][..topo.topk]
        .iter()
        .filter_map(|&id| topo.locate(id).map(|(rank, _)| rank))
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    ranks
}

/// The nodes token `token` goes to, ascending.
pub fn destination_nodes(
    topo: Topology,
    shape: NodeShape,
    topk_idx: &[i32],
    token: usize,
) -> Vec<usize> {
    let mut nodes: Vec<usize> = destination_ranks(topo, topk_idx, token)
        .into_iter()
        .map(|r| shape.node_of(r))
        .collect();
    nodes.dedup();
    nodes
}

fn check_shapes(topo: Topology, shape: NodeShape, topk_idx: &[i32], num_tokens: usize) {
    topo.assert_consistent();
    assert_eq!(shape.world, topo.world, "node shape and topology disagree");
    assert_eq!(topk_idx.len(), num_tokens * topo.topk, "topk_idx length");
}

/// One move of one token's row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transfer {
    /// The token's index on its source rank.
    pub token: usize,
    /// The rank the row leaves.
    pub from: usize,
    /// The rank the row reaches.
    pub to: usize,
}

/// The path of every token of one source rank in a dispatch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DispatchPlan {
    /// The network leg, in issue order: for each remote node in ring order,
    /// the tokens that go there in token order, each to the source's
    /// gateway on that node.
    pub network: Vec<Transfer>,
    /// The NVLink leg: every (token, destination rank) in token order, then
    /// destination order, from the gateway of the destination's node (the
    /// source on its own node). `from == to` is a copy inside one GPU.
    pub forward: Vec<Transfer>,
}

/// The dispatch plan of `source`'s tokens, from its routing.
///
/// # Panics
/// On a shape mismatch or an invalid expert id (see
/// [`super::layout::validate_experts`]).
pub fn dispatch_plan(
    topo: Topology,
    shape: NodeShape,
    source: usize,
    topk_idx: &[i32],
    num_tokens: usize,
) -> DispatchPlan {
    check_shapes(topo, shape, topk_idx, num_tokens);
    let home = shape.node_of(source);
    let mut network = Vec::new();
    for node in shape.ring_order(home) {
        for token in 0..num_tokens {
            if destination_nodes(topo, shape, topk_idx, token).contains(&node) {
                network.push(Transfer {
                    token,
                    from: source,
                    to: shape.gateway(source, node),
                });
            }
        }
    }
    let mut forward = Vec::new();
    for token in 0..num_tokens {
        for to in destination_ranks(topo, topk_idx, token) {
            forward.push(Transfer {
                token,
                from: shape.gateway(source, shape.node_of(to)),
                to,
            });
        }
    }
    DispatchPlan { network, forward }
}

/// Rows one rank sends over each leg in one operation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LegRows {
    /// Rows that leave the rank's node.
    pub network: usize,
    /// Rows to another rank of the same node.
    pub nvlink: usize,
}

/// Rows each rank sends in a dispatch and in the matching combine, given
/// every rank's routing (`routing[r]` = rank `r`'s `topk_idx` and token
/// count). `hierarchical` chooses the paths of this module; `false` gives
/// the single-node paths on the same nodes (every (token, destination rank)
/// straight from source to destination, over the network when their nodes
/// differ), for comparison. Returns `(dispatch, combine)` per rank.
///
/// # Panics
/// As [`dispatch_plan`], for any rank's routing.
pub fn traffic(
    topo: Topology,
    shape: NodeShape,
    routing: &[(&[i32], usize)],
    hierarchical: bool,
) -> Vec<(LegRows, LegRows)> {
    assert_eq!(routing.len(), topo.world, "one routing per rank");
    let mut rows = vec![(LegRows::default(), LegRows::default()); topo.world];
    let count = |legs: &mut LegRows, from: usize, to: usize| {
        if shape.node_of(from) != shape.node_of(to) {
            legs.network += 1;
        } else if from != to {
            legs.nvlink += 1;
        }
    };
    for (source, &(topk_idx, num_tokens)) in routing.iter().enumerate() {
        // (from, to) of every row the dispatch moves.
        let moves: Vec<(usize, usize)> = if hierarchical {
            let plan = dispatch_plan(topo, shape, source, topk_idx, num_tokens);
            let legs = plan.network.iter().chain(&plan.forward);
            legs.map(|t| (t.from, t.to)).collect()
        } else {
            check_shapes(topo, shape, topk_idx, num_tokens);
            (0..num_tokens)
                .flat_map(|token| destination_ranks(topo, topk_idx, token))
                .map(|to| (source, to))
                .collect()
        };
        // The combine moves each of them back, from `to` to `from`.
        for (from, to) in moves {
            count(&mut rows[from].0, from, to);
            count(&mut rows[to].1, to, from);
        }
    }
    rows
}

/// The hierarchical combine: what `rank` gets for its `num_tokens` tokens
/// from the rows every rank returns (`returned[r]`: rank `r`'s rows, one per
/// source-order row of its dispatch, as for [`super::normal::combine`]).
///
/// Token `t` is `bf16(sum over nodes n ascending of f32(P_n))` where the
/// node partial `P_n = bf16(sum over the ranks r of node n ascending, then
/// their rows for (rank, t) in row order, of f32(row))`, both sums in fp32
/// from 0.0; nodes with no row for the token add nothing, and a token with
/// no row at all is zero. The result is `[num_tokens * hidden]`.
///
/// # Panics
/// As [`super::normal::combine`], or when `shape` does not match `topo`.
pub fn combine(
    topo: Topology,
    shape: NodeShape,
    rank: usize,
    num_tokens: usize,
    returned: &[Returned],
) -> Vec<bf16> {
    topo.assert_consistent();
    assert_eq!(shape.world, topo.world, "node shape and topology disagree");
    assert_eq!(returned.len(), topo.world, "one Returned per rank");
    let hidden = topo.hidden;
    let mut acc = vec![0f32; num_tokens * hidden];
    for node in 0..shape.nodes() {
        let mut partial = vec![0f32; num_tokens * hidden];
        for r in shape.ranks_of(node) {
            add_rows(
                &mut partial,
                hidden,
                returned[r].rows_for(r, rank, num_tokens, hidden),
            );
        }
        // The node partials are BF16 rows. A node with no row for a token
        // adds bf16(+0.0), which changes no sum: `acc` starts at +0.0 and an
        // fp32 sum is -0.0 only when both terms are.
        let partial: Vec<bf16> = partial.into_iter().map(bf16::from_f32).collect();
        add_rows(&mut acc, hidden, partial.chunks_exact(hidden).enumerate());
    }
    acc.into_iter().map(bf16::from_f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::normal::{self, dispatch, expert_partials, Dispatched, RankTokens};
    use crate::reference::testutil::{
        bf16_to_bytes, random_bf16, random_routing, random_weights, topologies, Rng,
    };
    use crate::reference::Dtype;

    /// Every node shape of every test topology: each divisor of the world
    /// size, plus worlds 6 and 8 with their divisors.
    fn shapes() -> Vec<(Topology, NodeShape)> {
        let mut topos = topologies();
        for world in [6, 8] {
            for (topk, hidden) in [(1, 128), (4, 256), (8, 128)] {
                topos.push(Topology {
                    world,
                    num_experts: 48,
                    topk,
                    hidden,
                });
            }
        }
        let mut out = Vec::new();
        for topo in topos {
            for rpn in (1..=topo.world).filter(|r| topo.world.is_multiple_of(*r)) {
                out.push((topo, NodeShape::new(topo.world, rpn)));
            }
        }
        out
    }

    struct Source {
        n: usize,
        x: Vec<u8>,
        topk_idx: Vec<i32>,
        weights: Vec<f32>,
    }

    fn sources(rng: &mut Rng, topo: Topology) -> Vec<Source> {
        (0..topo.world)
            .map(|r| {
                // Zero and one token on some ranks, up to 9 on others.
                let n = match r % 3 {
                    0 => rng.below(10),
                    1 => r % 2,
                    _ => 1 + rng.below(5),
                };
                let skewed = rng.chance(0.5);
                Source {
                    n,
                    x: bf16_to_bytes(&random_bf16(rng, n * topo.hidden)),
                    topk_idx: random_routing(rng, &topo, n, 0.2, skewed),
                    weights: random_weights(rng, n * topo.topk),
                }
            })
            .collect()
    }

    fn views(s: &[Source]) -> Vec<RankTokens<'_>> {
        s.iter()
            .map(|s| RankTokens {
                num_tokens: s.n,
                x: &s.x,
                scales: &[],
                topk_idx: &s.topk_idx,
                topk_weights: &s.weights,
            })
            .collect()
    }

    #[test]
    fn node_shape_arithmetic() {
        let s = NodeShape::new(8, 2);
        assert_eq!(s.nodes(), 4);
        assert!(s.is_hierarchical());
        assert_eq!((s.node_of(5), s.local_index(5), s.rank_at(2, 1)), (2, 1, 5));
        assert_eq!(s.gateway(5, 0), 1);
        assert_eq!(s.gateway(4, 3), 6);
        assert_eq!(s.ranks_of(3), 6..8);
        assert_eq!(s.ring_order(2).collect::<Vec<_>>(), vec![3, 0, 1]);
        assert_eq!(s.ring_order(0).collect::<Vec<_>>(), vec![1, 2, 3]);
        assert!(!NodeShape::new(4, 4).is_hierarchical());
        assert_eq!(NodeShape::new(4, 4).ring_order(0).count(), 0);
    }

    #[test]
    #[should_panic(expected = "must divide")]
    fn ranks_per_node_must_divide_the_world() {
        NodeShape::new(6, 4);
    }

    #[test]
    fn every_token_reaches_exactly_its_ranks_once() {
        let mut rng = Rng::new(31);
        for (topo, shape) in shapes() {
            let srcs = sources(&mut rng, topo);
            for (source, s) in srcs.iter().enumerate() {
                let plan = dispatch_plan(topo, shape, source, &s.topk_idx, s.n);
                let home = shape.node_of(source);
                for token in 0..s.n {
                    let ranks = destination_ranks(topo, &s.topk_idx, token);
                    let nodes = destination_nodes(topo, shape, &s.topk_idx, token);
                    // Network: once per remote destination node, to the rail peer.
                    let sent: Vec<&Transfer> =
                        plan.network.iter().filter(|t| t.token == token).collect();
                    let remote: Vec<usize> = nodes.iter().copied().filter(|&n| n != home).collect();
                    assert_eq!(sent.len(), remote.len(), "{topo:?} {shape:?}");
                    for t in &sent {
                        assert_eq!(t.from, source);
                        assert_eq!(shape.local_index(t.to), shape.local_index(source));
                        assert!(remote.contains(&shape.node_of(t.to)));
                    }
                    // NVLink: once per destination rank, from its node's gateway,
                    // which the network reached (or the source itself).
                    let fwd: Vec<&Transfer> =
                        plan.forward.iter().filter(|t| t.token == token).collect();
                    assert_eq!(fwd.iter().map(|t| t.to).collect::<Vec<_>>(), ranks);
                    for t in fwd {
                        assert_eq!(shape.node_of(t.from), shape.node_of(t.to));
                        assert!(
                            t.from == source || sent.iter().any(|n| n.to == t.from),
                            "forwarded from a rank the token never reached"
                        );
                    }
                }
                // Ring order: remote nodes in order home+1, home+2, ...
                let order: Vec<usize> = plan.network.iter().map(|t| shape.node_of(t.to)).collect();
                let mut expected: Vec<usize> = shape.ring_order(home).collect();
                expected.retain(|n| order.contains(n));
                let mut seen = order.clone();
                seen.dedup();
                assert_eq!(seen, expected, "{topo:?} {shape:?} source {source}");
            }
        }
    }

    #[test]
    fn traffic_counts_rows_per_leg() {
        // 2 nodes of 2 ranks, 8 experts (2 per rank); rank 0 sends one token
        // to experts on ranks 1, 2 and 3.
        let topo = Topology {
            world: 4,
            num_experts: 8,
            topk: 3,
            hidden: 128,
        };
        let shape = NodeShape::new(4, 2);
        let routing: Vec<(&[i32], usize)> = vec![(&[2, 4, 7], 1), (&[], 0), (&[], 0), (&[], 0)];
        let hier = traffic(topo, shape, &routing, true);
        let flat = traffic(topo, shape, &routing, false);
        // Hierarchical dispatch: 0 -> 2 over the network once, 0 -> 1 and
        // 2 -> 3 over NVLink. Flat: 0 -> 2 and 0 -> 3 over the network.
        assert_eq!(
            hier[0].0,
            LegRows {
                network: 1,
                nvlink: 1
            }
        );
        assert_eq!(
            hier[2].0,
            LegRows {
                network: 0,
                nvlink: 1
            }
        );
        assert_eq!(
            flat[0].0,
            LegRows {
                network: 2,
                nvlink: 1
            }
        );
        // Combine: 3 -> 2 (NVLink), 2 -> 0 (network), 1 -> 0 (NVLink).
        assert_eq!(
            hier[3].1,
            LegRows {
                network: 0,
                nvlink: 1
            }
        );
        assert_eq!(
            hier[2].1,
            LegRows {
                network: 1,
                nvlink: 0
            }
        );
        assert_eq!(
            hier[1].1,
            LegRows {
                network: 0,
                nvlink: 1
            }
        );
        assert_eq!(
            flat[3].1,
            LegRows {
                network: 1,
                nvlink: 0
            }
        );
        // Network rows never exceed the flat paths' on any shape.
        let mut rng = Rng::new(34);
        for (topo, shape) in shapes() {
            let srcs = sources(&mut rng, topo);
            let routing: Vec<(&[i32], usize)> =
                srcs.iter().map(|s| (&s.topk_idx[..], s.n)).collect();
            let hier = traffic(topo, shape, &routing, true);
            let flat = traffic(topo, shape, &routing, false);
            let sum = |rows: &[(LegRows, LegRows)], f: fn(&(LegRows, LegRows)) -> usize| {
                rows.iter().map(f).sum::<usize>()
            };
            assert!(sum(&hier, |r| r.0.network) <= sum(&flat, |r| r.0.network));
            assert!(sum(&hier, |r| r.1.network) <= sum(&flat, |r| r.1.network));
            if !shape.is_hierarchical() {
                assert_eq!(hier, flat);
            }
        }
    }

    /// Every rank's returned rows after a dispatch and an expert-side
    /// reduction with identity experts.
    fn returned_rows(topo: Topology, srcs: &[Source]) -> Vec<(Dispatched, Vec<bf16>)> {
        let v = views(srcs);
        (0..topo.world)
            .map(|rank| {
                let d = dispatch(topo, Dtype::Bf16, &v, rank, 1);
                let y = crate::reference::testutil::bytes_to_bf16(&d.expert_x);
                let rows = expert_partials(topo, &d, &y);
                (d, rows)
            })
            .collect()
    }

    #[test]
    fn combine_equals_the_flat_combine_with_one_node_or_one_rank_per_node() {
        let mut rng = Rng::new(35);
        for (topo, shape) in shapes() {
            if shape.is_hierarchical() && shape.ranks_per_node > 1 {
                continue;
            }
            let srcs = sources(&mut rng, topo);
            let rows = returned_rows(topo, &srcs);
            let returned: Vec<Returned> = rows
                .iter()
                .map(|(d, r)| Returned {
                    rows: r,
                    src_info: &d.src_info,
                })
                .collect();
            for (rank, s) in srcs.iter().enumerate() {
                let flat = normal::combine(topo, rank, s.n, &returned);
                let hier = combine(topo, shape, rank, s.n, &returned);
                let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&hier), bits(&flat), "{topo:?} {shape:?} rank {rank}");
            }
        }
    }

    #[test]
    fn combine_follows_the_documented_order() {
        // Written out by hand for every shape: node partials rounded to
        // BF16, then summed nodes ascending.
        let mut rng = Rng::new(36);
        for (topo, shape) in shapes() {
            let srcs = sources(&mut rng, topo);
            let rows = returned_rows(topo, &srcs);
            let returned: Vec<Returned> = rows
                .iter()
                .map(|(d, r)| Returned {
                    rows: r,
                    src_info: &d.src_info,
                })
                .collect();
            let h = topo.hidden;
            for (rank, s) in srcs.iter().enumerate() {
                let got = combine(topo, shape, rank, s.n, &returned);
                for token in 0..s.n {
                    for c in 0..h {
                        let mut total = 0f32;
                        for node in 0..shape.nodes() {
                            let mut part = 0f32;
                            let mut any = false;
                            for r in shape.ranks_of(node) {
                                let (d, y) = &rows[r];
                                for (i, info) in d.src_info.chunks_exact(2).enumerate() {
                                    if info == [rank as i32, token as i32] {
                                        part += y[i * h + c].to_f32();
                                        any = true;
                                    }
                                }
                            }
                            if any {
                                total += bf16::from_f32(part).to_f32();
                            }
                        }
                        assert_eq!(
                            got[token * h + c].to_bits(),
                            bf16::from_f32(total).to_bits(),
                            "{topo:?} {shape:?} rank {rank} token {token} channel {c}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn node_partials_round_once_per_node() {
        // Two nodes of two ranks; rank 0's token is on ranks 0 and 1 (node 0)
        // and 2 (node 1), which return 1, 2^-8 and 2^-8. Node 0's partial
        // 1 + 2^-8 rounds to 1 in BF16 (a tie, to even), so the hierarchical
        // total is bf16(1 + 2^-8) = 1; the flat sum 1 + 2^-7 is exact.
        let topo = Topology {
            world: 4,
            num_experts: 4,
            topk: 3,
            hidden: 128,
        };
        let shape = NodeShape::new(4, 2);
        let one = vec![bf16::ONE; 128];
        let tiny = vec![bf16::from_f32(2f32.powi(-8)); 128];
        let info = [0i32, 0];
        let returned = [
            Returned {
                rows: &one,
                src_info: &info,
            },
            Returned {
                rows: &tiny,
                src_info: &info,
            },
            Returned {
                rows: &tiny,
                src_info: &info,
            },
            Returned {
                rows: &[],
                src_info: &[],
            },
        ];
        let hier = combine(topo, shape, 0, 1, &returned);
        let flat = normal::combine(topo, 0, 1, &returned);
        assert!(hier.iter().all(|v| *v == bf16::ONE));
        assert!(flat.iter().all(|v| v.to_f32() == 1.0 + 2f32.powi(-7)));
    }
}
