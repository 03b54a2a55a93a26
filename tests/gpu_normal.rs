//! Normal-mode dispatch and combine on real GPUs against the reference
//! (`ep::reference::normal`, the code the host backend runs), on fresh
//! random inputs: uneven and skewed routing with dropped slots, zero, one,
//! 17 and 4096 tokens, hidden sizes from 128 to 16384, BF16 and FP8, both
//! output orders, both combine inputs, the no-sync path inside a CUDA graph
//! replayed with new routing, bad expert ids, a rank that never comes and a
//! rank process killed mid-run, and two runs of random iterations that must
//! give the same outputs bit for bit; ranks as threads of one process and as
//! processes.
//! Needs CUDA GPUs: `cargo test --release --test gpu_normal -- --ignored`.

mod common;

use common::calls::combine_reference;
use common::gpu::*;
use common::normal::*;
use common::{bytes_to_bf16, last_error, Fnv, Rng};
use ep::capi::*;
use ep::reference::normal::Dispatched;
use ep::reference::{Dtype, Topology};
use half::bf16;
use std::ptr::null_mut;
use std::time::Duration;

/// World sizes: 1, 2, 4 and 8 ranks, sharing the GPUs when there are fewer
/// (see `test_worlds`); a shape runs at a world size when it fits (`fits`).
fn worlds() -> Vec<usize> {
    test_worlds(1)
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
            let topo = Topology {
                world,
                num_experts: experts,
                topk,
                hidden,
            };
            if fits(&topo, 4096) {
                let seed = 1000 * world as u64 + i as u64;
                check_shape(Ranks::Threads, world, hidden, topk, experts, seed);
            }
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

/// The reference combine of rank `rank`'s `n` tokens when every rank
/// returns its received BF16 rows as they are (`all`: every rank's
/// dispatch): its source-order rows (the sum over ranks of each token's
/// row), or with `expert_major` its expert-major rows.
fn combine_of_received_rows(
    topo: Topology,
    all: &[Dispatched],
    rank: usize,
    n: usize,
    expert_major: bool,
) -> Vec<bf16> {
    let rows: Vec<Vec<bf16>> = all
        .iter()
        .map(|d| bytes_to_bf16(if expert_major { &d.expert_x } else { &d.x }))
        .collect();
    combine_reference(topo, rank, n, all, &rows, expert_major)
}

/// The no-sync dispatch and a combine, captured once in a CUDA graph and
/// replayed with new routing and tokens, on 2 and 4 ranks. A dispatch that
/// waits for its counts is refused during the capture, which goes on.
#[test]
#[ignore = "needs CUDA GPUs"]
fn no_sync_dispatch_and_combine_replay_in_a_cuda_graph() {
    for world in [2, 4] {
        replay_in_a_cuda_graph(world);
    }
}

fn replay_in_a_cuda_graph(world: usize) {
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
        let synced = ep_dispatch_args_t { flags: 0, ..args };
        // SAFETY (every call): device buffers that outlive every replay.
        let graph = Graph::capture(|stream| unsafe {
            assert_eq!(
                ep_dispatch(ctx.0, &synced, handle.0, stream),
                EP_ERR_INVALID_ARGUMENT,
                "a host-synchronised dispatch during a capture"
            );
            ok(
                ep_dispatch(ctx.0, &args, handle.0, stream),
                "captured dispatch",
            );
            ok(ep_combine(ctx.0, &c, handle.0, stream), "captured combine");
        });
        gate();
        for (i, inputs) in rounds.iter().enumerate() {
            input.upload(&inputs[rank]);
            out.poison();
            y.poison();
            graph.replay();
            let all = dispatch_all(topo, Dtype::Bf16, inputs, 16);
            let what = format!("world {world} replay {i} rank {rank}");
            out.check(&topo, Dtype::Bf16, &all[rank], &what);
            let want = combine_of_received_rows(topo, &all, rank, n, false);
            assert_close(&y.download::<bf16>(n * topo.hidden), &want, &what);
            assert_eq!(async_status(ctx), EP_SUCCESS, "{what}");
        }
        gate();
    });
}

/// Bad expert ids on one rank (out of range, repeated, negative) are
/// reported on that rank and never used; its peer's dispatch completes.
#[test]
#[ignore = "needs CUDA GPUs"]
fn bad_expert_ids_are_reported_not_used() {
    let cfg = small_config(20_000);
    for bad in [[0, 99], [3, 3], [1, -7]] {
        run_gpu_world(SMALL.world, &cfg, |rank, ctx| {
            let handle = ctx.handle();
            let mut rng = Rng::new(5);
            let mut input = Input::random(&mut rng, &SMALL, Dtype::Bf16, 4, false);
            if rank == 0 {
                input.topk_idx[2..4].copy_from_slice(&bad);
            }
            let d = SmallDispatch::new(ctx, &input);
            gate();
            let status = d.run(ctx, &handle);
            if rank == 0 {
                assert_eq!(status, EP_ERR_INVALID_ARGUMENT, "ids {bad:?}");
                assert!(
                    common::last_error().contains("topk_idx entry 3"),
                    "{}",
                    common::last_error()
                );
            } else {
                ok(status, &format!("rank 1 beside ids {bad:?}"));
            }
            gate();
        });
    }
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn a_rank_that_never_dispatches_makes_the_others_time_out() {
    let timeout = Duration::from_millis(1500);
    let cfg = small_config(timeout.as_millis() as u32);
    run_gpu_world(SMALL.world, &cfg, |rank, ctx| {
        if rank == 0 {
            let handle = ctx.handle();
            let d = SmallDispatch::random(ctx, 6, 8);
            d.expect_timeout(ctx, &handle, timeout, &["rank 1"]);
        }
        // Rank 1 keeps its buffers mapped until rank 0 is done.
        gate();
    });
}

/// A rank process killed (SIGKILL) while its dispatch is in flight, on one
/// process per GPU (2 to 8): every other rank sees `EP_ERR_TIMEOUT` within
/// the timeout and destroys its context (see `until_the_timeout`).
#[test]
#[ignore = "needs CUDA GPUs"]
fn a_killed_rank_process_makes_the_others_time_out() {
    let test = "a_killed_rank_process_makes_the_others_time_out";
    let Some(world) = one_process_per_gpu(test) else {
        return;
    };
    let topo = Topology {
        world,
        num_experts: 4 * world,
        topk: 2,
        hidden: 256,
    };
    let n = 48;
    let timeout = Duration::from_millis(3000);
    let cfg = gpu_config(256, 2, 4 * world as i32, 64, 0, timeout.as_millis() as u32);
    run_with_a_killed_rank(test, world, &cfg, |rank, ctx| {
        let handle = ctx.handle();
        let mut rng = Rng::new(rank as u64);
        let input = DeviceInput::new(&Input::random(&mut rng, &topo, Dtype::Bf16, n, false));
        let out = Outputs::new(ctx, &topo, 1);
        let y = DevBuf::of::<bf16>(n * topo.hidden);
        // No host sync: the dispatch returns once enqueued.
        let mut args = out.args(&input, n, Dtype::Bf16, 1);
        args.flags = EP_DISPATCH_NO_HOST_SYNC;
        let mut c = common::combine_args();
        c.x = out.recv_x.as_const();
        c.out = y.as_mut();
        until_the_timeout(
            ctx,
            rank,
            world,
            timeout,
            // SAFETY: device buffers of the sizes the arguments give.
            || unsafe { ep_dispatch(ctx.0, &args, handle.0, stream()) },
            // SAFETY: as above.
            || unsafe { ep_combine(ctx.0, &c, handle.0, stream()) },
        );
    });
}

/// Two runs of `EP_REPEAT_ITERS` (default 200) random iterations, on fresh
/// contexts from the same seeds, give the same outputs bit for bit (see
/// `assert_repeatable` and `repeat_run`).
#[test]
#[ignore = "needs CUDA GPUs"]
fn two_runs_of_random_iterations_are_identical() {
    assert_repeatable("normal mode", repeat_run);
}

/// One run of the repeatability test: in iteration i every rank dispatches
/// (every fourth iteration after a dispatch of other tokens) random BF16
/// tokens (counts from 0 to 128, 0 and 1 included, uneven and
/// skewed routing with dropped slots; alignment 1, 4 or 128; host sync or
/// not) and combines its received rows twice, as source-order and as
/// expert-major input. Hashed: every dispatch output the API defines (the
/// rows come in the order the API promises: by source rank, then token),
/// padding rows of the expert-major output included (zeros), and both
/// combine outputs. Iterations `checked_iteration` picks are also checked
/// against the reference. Returns each rank's running hash after each
/// iteration.
fn repeat_run(world: usize, iterations: usize) -> Vec<Vec<u64>> {
    let experts = 64 - 64 % world;
    let (hidden, topk, max_tokens) = (1024, 8, 128);
    let topo = Topology {
        world,
        num_experts: experts,
        topk,
        hidden,
    };
    let cfg = gpu_config(
        hidden as i32,
        topk as i32,
        experts as i32,
        max_tokens as i32,
        0,
        20_000,
    );
    let input = |i: usize, rank: usize| {
        let mut rng = Rng::new(repeat_seed(i, rank));
        let n = repeat_count(i, rank, max_tokens);
        Input::random(&mut rng, &topo, Dtype::Bf16, n, i % 4 == 1)
    };
    let l = topo.local_experts();
    run_gpu_world(world, &cfg, |rank, ctx| {
        let handle = ctx.handle();
        // Input buffers for the most tokens.
        let largest = Input::random(&mut Rng::new(0), &topo, Dtype::Bf16, max_tokens, false);
        let dev = DeviceInput::new(&largest);
        let first = DeviceInput::new(&largest);
        let out = Outputs::new(ctx, &topo, 128);
        let y = DevBuf::of::<bf16>(max_tokens * hidden);
        gate();
        let mut hash = Fnv::default();
        let mut hashes = Vec::with_capacity(iterations);
        for i in 0..iterations {
            let me = input(i, rank);
            let n = me.num_tokens;
            let alignment = [1, 4, 128][i % 3];
            let what = format!("world {world} iteration {i} rank {rank} ({n} tokens)");
            dev.upload(&me);
            // Every fourth iteration dispatches twice in a row: the second
            // dispatch must not restage while a peer still pulls the
            // first's rows (its closing barrier, which the runtime enqueues
            // only before a dispatch that follows a dispatch).
            if i % 4 == 3 {
                let args = out.args(&first, max_tokens, Dtype::Bf16, alignment);
                // SAFETY: device buffers of the sizes the arguments give.
                ok(
                    unsafe { ep_dispatch(ctx.0, &args, handle.0, stream()) },
                    &format!("{what}: the first of two dispatches"),
                );
            }
            out.poison();
            let mut args = out.args(&dev, n, Dtype::Bf16, alignment);
            if i % 2 == 1 {
                args.flags = EP_DISPATCH_NO_HOST_SYNC;
            }
            // SAFETY: device buffers of the sizes the arguments give.
            ok(
                unsafe { ep_dispatch(ctx.0, &args, handle.0, stream()) },
                &what,
            );
            let rows = out.recv_num_rows.download::<i32>(1)[0];
            let erows = out.expert_offsets.download::<i32>(l + 1)[l];
            assert!(
                rows >= 0 && erows >= 0,
                "{what}: {rows} rows, {erows} expert rows"
            );
            for (_, bytes) in out.defined(&topo, Dtype::Bf16, rows as usize, erows as usize) {
                hash.bytes(&bytes);
            }
            let mut combined = Vec::new();
            for (layout, x) in [
                (EP_COMBINE_SOURCE_ORDER, &out.recv_x),
                (EP_COMBINE_EXPERT_MAJOR, &out.expert_x),
            ] {
                y.poison();
                let mut c = common::combine_args();
                c.input_layout = layout;
                c.x = x.as_const();
                c.out = y.as_mut();
                // SAFETY: device buffers of the sizes the dispatch gives.
                ok(unsafe { ep_combine(ctx.0, &c, handle.0, stream()) }, &what);
                let got = y.download::<bf16>(n * hidden);
                hash.values(&got);
                combined.push(got);
            }
            assert_eq!(async_status(ctx), EP_SUCCESS, "{what}");
            if checked_iteration(i) {
                let inputs: Vec<Input> = (0..world).map(|r| input(i, r)).collect();
                let all = dispatch_all(topo, Dtype::Bf16, &inputs, alignment as usize);
                out.check(&topo, Dtype::Bf16, &all[rank], &what);
                for (expert_major, got) in [false, true].into_iter().zip(&combined) {
                    let want = combine_of_received_rows(topo, &all, rank, n, expert_major);
                    assert_close(got, &want, &format!("{what}: combine"));
                }
            }
            hashes.push(hash.0);
        }
        // Every rank is done before any frees its buffers.
        gate();
        hashes
    })
}

/// Every dispatch output the API lets a caller leave out (NULL), left out
/// one at a time, on 1 and 2 ranks: the call succeeds (nothing faults), the
/// other outputs are as the reference says, and a combine after it is
/// right.
#[test]
#[ignore = "needs CUDA GPUs"]
fn optional_outputs_may_be_null() {
    const OPTIONAL: [&str; 7] = [
        "recv_topk_idx",
        "recv_topk_weights",
        "recv_src_info",
        "recv_num_tokens",
        "expert_weights",
        "expert_src_row",
        "expert_counts",
    ];
    for world in [1, 2] {
        let topo = Topology {
            world,
            num_experts: 16,
            topk: 4,
            hidden: 256,
        };
        let n = 64;
        let cfg = gpu_config(256, 4, 16, n as i32, 0, 20_000);
        let mut rng = Rng::new(11);
        let inputs: Vec<Input> = (0..world)
            .map(|_| Input::random(&mut rng, &topo, Dtype::Bf16, n, true))
            .collect();
        let all = dispatch_all(topo, Dtype::Bf16, &inputs, 4);
        run_gpu_world(world, &cfg, |rank, ctx| {
            let handle = ctx.handle();
            let input = DeviceInput::new(&inputs[rank]);
            let out = Outputs::new(ctx, &topo, 4);
            let y = DevBuf::of::<bf16>(n * topo.hidden);
            let combined = combine_of_received_rows(topo, &all, rank, n, false);
            gate();
            for (i, field) in OPTIONAL.into_iter().enumerate() {
                let what = format!("world {world} rank {rank}, {field} NULL");
                out.poison();
                y.poison();
                let mut args = out.args(&input, n, Dtype::Bf16, 4);
                if i % 2 == 1 {
                    args.flags = EP_DISPATCH_NO_HOST_SYNC;
                }
                match field {
                    "recv_topk_idx" => args.recv_topk_idx = null_mut(),
                    "recv_topk_weights" => args.recv_topk_weights = null_mut(),
                    "recv_src_info" => args.recv_src_info = null_mut(),
                    "recv_num_tokens" => args.recv_num_tokens = null_mut(),
                    "expert_weights" => args.expert_weights = null_mut(),
                    "expert_src_row" => args.expert_src_row = null_mut(),
                    _ => args.expert_counts = null_mut(),
                }
                // SAFETY: device buffers of the sizes the arguments give.
                ok(
                    unsafe { ep_dispatch(ctx.0, &args, handle.0, stream()) },
                    &what,
                );
                sync();
                assert_eq!(async_status(ctx), EP_SUCCESS, "{what}");
                out.check_but(&topo, Dtype::Bf16, &all[rank], field, &what);
                let mut c = common::combine_args();
                c.x = out.recv_x.as_const();
                c.out = y.as_mut();
                // SAFETY: device buffers of the sizes the dispatch gives.
                ok(unsafe { ep_combine(ctx.0, &c, handle.0, stream()) }, &what);
                let got = y.download::<bf16>(n * topo.hidden);
                let status = async_status(ctx);
                assert_eq!(status, EP_SUCCESS, "{what}: combine: {}", last_error());
                assert_close(&got, &combined, &what);
            }
            gate();
        });
    }
}
