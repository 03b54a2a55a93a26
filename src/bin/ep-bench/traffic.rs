//! `--mode traffic`: what one normal-mode dispatch and combine send over
//! each leg when the ranks form nodes (`--ranks-per-node`), computed from
//! the plans of `ep::reference::hierarchical` (the paths the GPU kernels
//! take) on random routing. No GPU and no context: the numbers are counts
//! of rows, the same on every machine.
//!
//! Hierarchical: a token crosses the network once per destination node
//! other than its own (to the rank of its rail there), then NVLink once per
//! destination rank; combine rows go back the same way, reduced per node
//! first. Single-node paths on the same nodes (for comparison): every
//! (token, destination rank) goes straight from source to destination, over
//! the network when their nodes differ.
//!
//! Bytes are BF16 rows (`hidden * 2`); the hierarchical network leg adds one
//! header (`HIER_HEADER_BYTES`) per token and node.

use ep::abi::HIER_HEADER_BYTES;
use ep::reference::hierarchical::{traffic, LegRows, NodeShape};
use ep::reference::Topology;

use crate::device::fail;
use crate::run::{uniform_routing, Rng};
use crate::Opts;

fn mib(bytes: usize) -> String {
    format!("{:.2}", bytes as f64 / (1 << 20) as f64)
}

/// Prints the traffic tables for `world` ranks; returns nothing, fails on
/// a bad shape.
pub fn print(o: &Opts, world: usize, header: &str) {
    let rpn = o.ranks_per_node.unwrap_or(world);
    if rpn == 0 || !world.is_multiple_of(rpn) {
        fail(&format!(
            "--ranks-per-node {rpn} does not divide {world} ranks"
        ));
    }
    let tokens = o.tokens.unwrap_or(4096);
    let topo = Topology {
        world,
        num_experts: o.experts,
        topk: o.topk,
        hidden: o.hidden,
    };
    let shape = NodeShape::new(world, rpn);
    // Uniform routing, seeded per rank.
    let idx: Vec<Vec<i32>> = (0..world)
        .map(|r| uniform_routing(&mut Rng(0x7A5F_1C00 + r as u64 * 7919), o, tokens, false).0)
        .collect();
    let plans: Vec<(&[i32], usize)> = idx.iter().map(|i| (&i[..], tokens)).collect();
    let hier = traffic(topo, shape, &plans, true);
    let flat = traffic(topo, shape, &plans, false);
    let row = o.hidden * 2;
    let net_bytes = |legs: &LegRows, headers: bool| {
        legs.network * (row + if headers { HIER_HEADER_BYTES } else { 0 })
    };

    println!("{header}");
    println!();
    println!(
        "**Bytes each rank sends in one dispatch + combine, {world} ranks in {} node(s) of {rpn}, \
         {tokens} tokens per rank, hidden {}, top-{} of {} experts (uniform routing), BF16 rows**",
        shape.nodes(),
        o.hidden,
        o.topk,
        o.experts
    );
    println!();
    println!(
        "| rank | network MiB, hierarchical | network MiB, single-node paths | NVLink MiB, hierarchical | NVLink MiB, single-node paths |"
    );
    println!("|---|---|---|---|---|");
    let (mut sums, mut lines) = ([0usize; 4], Vec::new());
    for r in 0..world {
        let (hd, hc) = (&hier[r].0, &hier[r].1);
        let (fd, fc) = (&flat[r].0, &flat[r].1);
        let values = [
            net_bytes(hd, true) + net_bytes(hc, false),
            net_bytes(fd, false) + net_bytes(fc, false),
            (hd.nvlink + hc.nvlink) * row,
            (fd.nvlink + fc.nvlink) * row,
        ];
        for (s, v) in sums.iter_mut().zip(values) {
            *s += v;
        }
        lines.push(format!(
            "| {r} | {} | {} | {} | {} |",
            mib(values[0]),
            mib(values[1]),
            mib(values[2]),
            mib(values[3])
        ));
    }
    for line in lines {
        println!("{line}");
    }
    println!(
        "| all | {} | {} | {} | {} |",
        mib(sums[0]),
        mib(sums[1]),
        mib(sums[2]),
        mib(sums[3])
    );
    println!();
    if sums[1] > 0 {
        println!(
            "Network bytes: hierarchical / single-node paths = {:.3} (each token crosses the network once per destination node instead of once per destination rank).",
            sums[0] as f64 / sums[1] as f64
        );
    } else {
        println!("Network bytes: none (one node).");
    }
}
