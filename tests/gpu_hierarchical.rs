//! The hierarchical normal mode on GPUs, on virtual nodes of one host
//! (`ranks_per_node` below the world size; the network leg is the NVLink
//! emulation of GIN): dispatch bit-exact and both combines in the
//! hierarchical summation order against the reference
//! (`ep::reference::hierarchical`, what the host backend runs), on the
//! inputs of tests/gpu_normal.rs (0, 1, 17 and 4096 tokens, BF16 and FP8,
//! uneven routing with dropped slots, host-synchronised and not); a rank
//! that never comes and an abort end the network leg's waits.
//!
//! The world sizes are a parameter: `EP_TEST_WORLDS` (default `2,4`). Rank
//! r runs on GPU `r % GPUs` (tests/common/gpu.rs), so on one GPU the ranks
//! share it (threads with their own streams and SM shares).
//! With `EP_TEST_NCCL=1` the contexts are made on NCCL communicators (one
//! GPU per rank: NCCL refuses two ranks of one communicator on one GPU).
//! Needs CUDA GPUs: `cargo test --release --test gpu_hierarchical --
//! --ignored --test-threads=1`.

mod common;

use common::gpu::*;
use common::last_error;
use common::normal::*;
use ep::capi::*;
use ep::reference::Topology;
use std::time::{Duration, Instant};

/// The world sizes to test, from `EP_TEST_WORLDS`.
fn worlds() -> Vec<usize> {
    let list = std::env::var("EP_TEST_WORLDS").unwrap_or_else(|_| "2,4".into());
    let worlds: Vec<usize> = list
        .split(',')
        .filter_map(|w| w.trim().parse().ok())
        .filter(|&w| w >= 2)
        .collect();
    assert!(
        !worlds.is_empty(),
        "EP_TEST_WORLDS={list}: no world size of 2 or more"
    );
    if nccl::requested() {
        let gpus = device_count();
        return worlds.into_iter().filter(|&w| w <= gpus).collect();
    }
    worlds
}

/// Every proper divisor of `world`: the node shapes with several nodes.
fn node_sizes(world: usize) -> Vec<usize> {
    (1..world).filter(|r| world.is_multiple_of(*r)).collect()
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn virtual_nodes_match_the_reference() {
    // One shape per node shape, in turn from this list.
    let shapes = [(7168, 8, 256), (2048, 4, 64), (128, 1, 8), (4096, 16, 64)];
    let mut next = 0;
    for world in worlds() {
        for rpn in node_sizes(world) {
            let (hidden, topk, experts) = shapes[next % shapes.len()];
            next += 1;
            let topo = Topology {
                world,
                num_experts: experts,
                topk,
                hidden,
            };
            if !fits(&topo, 4096) {
                continue;
            }
            let seed = 5000 + 100 * world as u64 + 10 * rpn as u64;
            check_shape_on_nodes(Ranks::Threads, world, rpn, hidden, topk, experts, seed);
        }
    }
}

/// Rank 0 dispatches, rank 1 (another node) never does: rank 0's wait for
/// the network leg gives up after the timeout and names rank 1.
#[test]
#[ignore = "needs CUDA GPUs"]
fn a_node_that_never_sends_makes_the_network_wait_time_out() {
    let timeout = Duration::from_millis(1500);
    let mut cfg = small_config(timeout.as_millis() as u32);
    cfg.ranks_per_node = 1;
    let gate = std::sync::Barrier::new(2);
    run_gpu_world(SMALL.world, &cfg, |rank, ctx| {
        if rank == 0 {
            let handle = ctx.handle();
            let d = SmallDispatch::random(ctx, 6, 8);
            d.expect_timeout(ctx, &handle, timeout, &["rank 1", "hierarchical dispatch"]);
        }
        gate.wait();
    });
}

/// An abort from another thread ends rank 0's wait for the network leg.
#[test]
#[ignore = "needs CUDA GPUs"]
fn abort_ends_a_network_wait() {
    let mut cfg = small_config(60_000);
    cfg.ranks_per_node = 1;
    let gate = std::sync::Barrier::new(2);
    run_gpu_world(SMALL.world, &cfg, |rank, ctx| {
        if rank == 0 {
            let handle = ctx.handle();
            let mut d = SmallDispatch::random(ctx, 7, 8);
            d.args.flags = EP_DISPATCH_NO_HOST_SYNC;
            let start = Instant::now();
            let raw = ctx.0 as usize;
            std::thread::scope(|s| {
                s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(500));
                    // SAFETY: the context outlives this scope.
                    unsafe { ep_ctx_abort(raw as *mut ep_ctx_t) };
                });
                assert_eq!(d.run(ctx, &handle), EP_SUCCESS, "{}", last_error());
                sync();
            });
            assert!(start.elapsed() < Duration::from_secs(20));
            assert_eq!(async_status(ctx), EP_ERR_ABORTED);
        }
        gate.wait();
    });
}
