//! GPU contexts on real devices: ranks as threads, symmetric memory mapped
//! between them, the layout kernel against the reference, a garbage expert id
//! reported as an async error, and the caller's current context left alone.
//! Needs CUDA GPUs: `cargo test --release --test gpu_context -- --ignored`.

mod common;

use common::gpu::{async_status, device_count, gpu_config, ok, run_gpu_world, DevBuf};
use common::{routing, Rng};
use ep::capi::*;
use ep::reference::layout::dispatch_layout;
use ep::reference::Topology;
use std::ptr::null_mut;

#[test]
#[ignore = "needs CUDA GPUs"]
fn layout_kernel_matches_the_reference() {
    let world = device_count();
    for (topk, experts, tokens) in [(8, 256, 4096), (1, 8, 1), (4, 64, 17), (8, 64, 0)] {
        let experts = experts - experts % world;
        let topo = Topology {
            world,
            num_experts: experts,
            topk,
            hidden: 128,
        };
        let cfg = gpu_config(128, topk as i32, experts as i32, 4096, 128, 10_000);
        run_gpu_world(world, &cfg, |rank, ctx| {
            let mut rng = Rng::new(rank as u64 * 7 + tokens as u64);
            let idx = routing(&mut rng, experts, topk, tokens, 0.1, None);
            let want = dispatch_layout(topo, &idx, tokens).unwrap();
            let d_idx = DevBuf::from(&idx);
            let d_rank = DevBuf::of::<i32>(world);
            let d_expert = DevBuf::of::<i32>(experts);
            let d_in = DevBuf::of::<u8>(tokens * world);
            // SAFETY: device buffers of the sizes the layout needs.
            ok(
                unsafe {
                    ep_get_dispatch_layout(
                        ctx.0,
                        d_idx.as_const(),
                        tokens as i32,
                        d_rank.as_mut(),
                        d_expert.as_mut(),
                        d_in.as_mut(),
                        null_mut(),
                    )
                },
                "layout",
            );
            assert_eq!(d_rank.download::<i32>(world), want.tokens_per_rank);
            assert_eq!(d_expert.download::<i32>(experts), want.tokens_per_expert);
            assert_eq!(d_in.download::<u8>(tokens * world), want.is_token_in_rank);
            assert_eq!(async_status(ctx), EP_SUCCESS);
        });
    }
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn invalid_expert_id_becomes_an_async_error() {
    let world = device_count().min(2);
    let cfg = gpu_config(128, 2, 8, 4096, 128, 10_000);
    run_gpu_world(world, &cfg, |_, ctx| {
        let d_idx = DevBuf::from(&[0i32, 99]);
        let d_rank = DevBuf::of::<i32>(world);
        let d_expert = DevBuf::of::<i32>(8);
        let d_in = DevBuf::of::<u8>(world);
        // SAFETY: device buffers of the sizes the layout needs.
        ok(
            unsafe {
                ep_get_dispatch_layout(
                    ctx.0,
                    d_idx.as_const(),
                    1,
                    d_rank.as_mut(),
                    d_expert.as_mut(),
                    d_in.as_mut(),
                    null_mut(),
                )
            },
            "layout",
        );
        d_rank.download::<i32>(world);
        assert_eq!(async_status(ctx), EP_ERR_INVALID_ARGUMENT);
    });
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn abort_is_reported_and_sticks() {
    let world = device_count().min(2);
    let cfg = gpu_config(128, 2, 8, 4096, 128, 10_000);
    run_gpu_world(world, &cfg, |_, ctx| {
        // SAFETY: a live context.
        ok(unsafe { ep_ctx_abort(ctx.0) }, "abort");
        assert_eq!(async_status(ctx), EP_ERR_ABORTED);
    });
}
