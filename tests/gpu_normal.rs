//! Normal-mode dispatch and combine on real GPUs against the reference
//! (`ep::reference::normal`, the code the host backend runs), on fresh
//! random inputs: uneven and skewed routing with dropped slots, zero, one,
//! 17 and 4096 tokens, hidden sizes from 128 to 16384, BF16 and FP8, both
//! output orders, both combine inputs, the no-sync path inside a CUDA graph
//! replayed with new routing, bad expert ids, and a rank that never comes;
//! ranks as threads of one process and as processes.
//! Needs CUDA GPUs: `cargo test --release --test gpu_normal -- --ignored`.

mod common;

use common::gpu::*;
use common::normal::*;
use common::{bytes_to_bf16, Rng};
use ep::capi::*;
use ep::reference::normal::{combine, dispatch, Dispatched, RankTokens, Returned};
use ep::reference::{Dtype, Topology};
use half::bf16;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

/// 2, 4 and 8 ranks as far as the machine has GPUs; one rank on a machine
/// with one GPU (the kernels' own arithmetic, without NVLink).
fn worlds() -> Vec<usize> {
    let n = device_count();
    assert!(n >= 1, "these tests need a GPU");
    if n == 1 {
        return vec![1];
    }
    [2, 4, 8].into_iter().filter(|&w| w <= n).collect()
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn dispatch_and_combine_match_the_reference() {
    for world in worlds() {
        for (i, (hidden, topk, experts)) in [
            (7168, 8, 256),
            (128, 1, 8),
            (2048, 4, 64),
            (4096, 16, 256),
            (16384, 16, 64),
            (7168, 4, 8),
        ]
        .into_iter()
        .enumerate()
        {
            let seed = 1000 * world as u64 + i as u64;
            check_shape(Ranks::Threads, world, hidden, topk, experts, seed);
        }
    }
}

/// Ranks as processes: the symmetric buffers travel between processes as
/// file descriptors.
#[test]
#[ignore = "needs CUDA GPUs"]
fn ranks_as_processes_match_the_reference() {
    let ranks = Ranks::Processes {
        test: "ranks_as_processes_match_the_reference",
    };
    for world in worlds() {
        for (i, (hidden, topk, experts)) in [(7168, 8, 256), (2048, 16, 64)].into_iter().enumerate()
        {
            check_shape(
                ranks,
                world,
                hidden,
                topk,
                experts,
                2000 * world as u64 + i as u64,
            );
        }
    }
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn no_sync_dispatch_and_combine_replay_in_a_cuda_graph() {
    let world = 2;
    let topo = Topology {
        world,
        num_experts: 64,
        topk: 8,
        hidden: 2048,
    };
    let n = 300;
    let cfg = gpu_config(2048, 8, 64, 512, 0, 20_000);
    let replays = 100;
    let mut rng = Rng::new(77);
    let rounds: Vec<Vec<Input>> = (0..replays)
        .map(|i| {
            (0..world)
                .map(|_| Input::random(&mut rng, &topo, Dtype::Bf16, n, i % 3 == 0))
                .collect()
        })
        .collect();
    run_gpu_world(world, &cfg, |rank, ctx| {
        let handle = ctx.handle();
        let input = DeviceInput::new(&rounds[0][rank]);
        let out = Outputs::new(ctx, &topo, 16);
        let mut args = out.args(&input, n, Dtype::Bf16, 16);
        args.flags = EP_DISPATCH_NO_HOST_SYNC;
        // The combine returns the received rows: out = sum over ranks of x.
        let y = DevBuf::of::<bf16>(n * topo.hidden);
        let mut c = common::combine_args();
        c.x = out.recv_x.as_const();
        c.out = y.as_mut();
        // SAFETY (both calls): device buffers that outlive every replay.
        let graph = Graph::capture(|stream| unsafe {
            ok(
                ep_dispatch(ctx.0, &args, handle.0, stream),
                "captured dispatch",
            );
            ok(ep_combine(ctx.0, &c, handle.0, stream), "captured combine");
        });
        for (i, inputs) in rounds.iter().enumerate() {
            let mine = &inputs[rank];
            input.x.upload(&mine.x);
            input.topk_idx.upload(&mine.topk_idx);
            input.topk_weights.upload(&mine.topk_weights);
            out.poison();
            y.poison();
            graph.replay();
            let views: Vec<RankTokens> = inputs.iter().map(Input::view).collect();
            let all: Vec<Dispatched> = (0..world)
                .map(|r| dispatch(topo, Dtype::Bf16, &views, r, 16))
                .collect();
            let what = format!("replay {i} rank {rank}");
            out.check(&topo, Dtype::Bf16, &all[rank], &what);
            let rows: Vec<Vec<bf16>> = all.iter().map(|d| bytes_to_bf16(&d.x)).collect();
            let returned: Vec<Returned> = all
                .iter()
                .zip(&rows)
                .map(|(d, rows)| Returned {
                    rows,
                    src_info: &d.src_info,
                })
                .collect();
            let want = combine(topo, rank, n, &returned);
            assert_close(&y.download::<bf16>(n * topo.hidden), &want, &what);
            assert_eq!(async_status(ctx), EP_SUCCESS, "{what}");
        }
    });
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn bad_expert_ids_are_reported_not_used() {
    let world = 2;
    let topo = Topology {
        world,
        num_experts: 8,
        topk: 2,
        hidden: 128,
    };
    let cfg = gpu_config(128, 2, 8, 64, 0, 20_000);
    for bad in [[0, 99], [3, 3], [1, -7]] {
        run_gpu_world(world, &cfg, |rank, ctx| {
            let handle = ctx.handle();
            let mut rng = Rng::new(5);
            let mut input = Input::random(&mut rng, &topo, Dtype::Bf16, 4, false);
            if rank == 0 {
                input.topk_idx[2..4].copy_from_slice(&bad);
            }
            let dev = DeviceInput::new(&input);
            let out = Outputs::new(ctx, &topo, 1);
            let args = out.args(&dev, 4, Dtype::Bf16, 1);
            // SAFETY: device buffers of the sizes the arguments give.
            let status = unsafe { ep_dispatch(ctx.0, &args, handle.0, null_mut()) };
            if rank == 0 {
                assert_eq!(status, EP_ERR_INVALID_ARGUMENT, "ids {bad:?}");
                assert!(
                    common::last_error().contains("topk_idx entry 3"),
                    "{}",
                    common::last_error()
                );
            }
        });
    }
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn a_rank_that_never_dispatches_makes_the_others_time_out() {
    let world = 2;
    let topo = Topology {
        world,
        num_experts: 8,
        topk: 2,
        hidden: 128,
    };
    let timeout = Duration::from_millis(1500);
    let cfg = gpu_config(128, 2, 8, 64, 0, timeout.as_millis() as u32);
    let gate = std::sync::Barrier::new(world);
    run_gpu_world(world, &cfg, |rank, ctx| {
        if rank == 0 {
            let handle = ctx.handle();
            let mut rng = Rng::new(6);
            let input = Input::random(&mut rng, &topo, Dtype::Bf16, 8, false);
            let dev = DeviceInput::new(&input);
            let out = Outputs::new(ctx, &topo, 1);
            let args = out.args(&dev, 8, Dtype::Bf16, 1);
            let start = Instant::now();
            // SAFETY: device buffers of the sizes the arguments give.
            let status = unsafe { ep_dispatch(ctx.0, &args, handle.0, null_mut()) };
            let took = start.elapsed();
            assert_eq!(status, EP_ERR_TIMEOUT, "{}", common::last_error());
            assert!(
                common::last_error().contains("rank 1"),
                "{}",
                common::last_error()
            );
            assert!(took < timeout * 3, "took {took:?}");
            assert_eq!(async_status(ctx), EP_ERR_TIMEOUT);
        }
        gate.wait();
    });
}
