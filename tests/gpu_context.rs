//! GPU contexts on real devices: ranks as threads (sharing the GPU when
//! there are fewer GPUs than ranks), symmetric memory mapped between them,
//! the layout kernel against the reference, a garbage expert id reported as
//! an async error after which every call is refused, ranks as processes on
//! one GPU refused, destroy after an async error or a timeout leaking
//! nothing, destroy right after a dispatch that returned with its rows in
//! flight, and the caller's current context left alone.
//! Needs CUDA GPUs: `cargo test --release --test gpu_context -- --ignored`.

mod common;

use common::gpu::{
    async_status, gate, gpu_config, memory_info, ok, run_gpu_world, run_gpu_world_on, stream, sync,
    test_worlds, trim_pool, DevBuf,
};
use common::normal::{dispatch_all, DeviceInput, Input, Outputs};
use common::{last_error, ll_combine_args, ll_dispatch_args, routing, Ctx, Rng};
use ep::capi::*;
use ep::reference::layout::dispatch_layout;
use ep::reference::{Dtype, Topology};
use std::ptr::{null, null_mut};
use std::time::{Duration, Instant};

#[test]
#[ignore = "needs CUDA GPUs"]
fn layout_kernel_matches_the_reference() {
    for world in test_worlds(1) {
        layout_kernel(world);
    }
}

fn layout_kernel(world: usize) {
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
                        stream(),
                    )
                },
                "layout",
            );
            assert_eq!(d_rank.download::<i32>(world), want.tokens_per_rank);
            assert_eq!(d_expert.download::<i32>(experts), want.tokens_per_expert);
            assert_eq!(d_in.download::<u8>(tokens * world), want.is_token_in_rank);
            assert_eq!(async_status(ctx), EP_SUCCESS);
            gate();
        });
    }
}

/// The layout of one token whose second expert id is out of range, on
/// this rank's stream, after which the stream is synchronized: the call is
/// accepted (the ids are device memory), the kernel reports the bad id.
fn layout_with_a_bad_id(ctx: &Ctx, world: usize, topk: usize, experts: usize) -> ep_status_t {
    let mut idx = vec![-1i32; topk];
    idx[..2].copy_from_slice(&[0, 99]);
    let d_idx = DevBuf::from(&idx);
    let d_rank = DevBuf::of::<i32>(world);
    let d_expert = DevBuf::of::<i32>(experts);
    let d_in = DevBuf::of::<u8>(world);
    // SAFETY: device buffers of the sizes the layout needs.
    let status = unsafe {
        ep_get_dispatch_layout(
            ctx.0,
            d_idx.as_const(),
            1,
            d_rank.as_mut(),
            d_expert.as_mut(),
            d_in.as_mut(),
            stream(),
        )
    };
    sync();
    status
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn invalid_expert_id_becomes_an_async_error() {
    let world = 2;
    let cfg = gpu_config(128, 2, 8, 4096, 128, 10_000);
    run_gpu_world(world, &cfg, |_, ctx| {
        ok(layout_with_a_bad_id(ctx, world, 2, 8), "layout");
        assert_eq!(async_status(ctx), EP_ERR_INVALID_ARGUMENT);
        gate();
    });
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn abort_is_reported_and_sticks() {
    let world = 2;
    let cfg = gpu_config(128, 2, 8, 4096, 128, 10_000);
    run_gpu_world(world, &cfg, |_, ctx| {
        // SAFETY: a live context.
        ok(unsafe { ep_ctx_abort(ctx.0) }, "abort");
        assert_eq!(async_status(ctx), EP_ERR_ABORTED);
    });
}

/// A context config whose buffers are large enough (over 100 MiB a rank)
/// that a leaked one shows in the device's free memory.
fn large_config(timeout_ms: u32) -> ep_config_t {
    gpu_config(7168, 8, 64, 4096, 128, timeout_ms)
}

/// Makes `ctx` fail with an invalid expert id (an async error) and checks
/// that every call that would use the device is refused with that error
/// until the context is destroyed.
fn fail_and_check_refusals(ctx: &Ctx) {
    let handle = ctx.handle();
    // Top-8 of 64 experts, as `large_config`.
    let layout = || layout_with_a_bad_id(ctx, 1, 8, 64);
    ok(layout(), "layout");
    let error = async_status(ctx);
    assert_eq!(error, EP_ERR_INVALID_ARGUMENT);
    let d_in = DevBuf::of::<u8>(16);
    let d_rank = DevBuf::of::<i32>(64);
    let d_expert = DevBuf::of::<i32>(2 * 64);
    let refused = |status: ep_status_t, call: &str| {
        assert_eq!(
            status,
            error,
            "{call} after an async error: {}",
            last_error()
        );
        assert!(
            last_error().contains("invalid expert id"),
            "{call}: {}",
            last_error()
        );
    };
    refused(layout(), "ep_get_dispatch_layout");
    let mut h = null_mut();
    // SAFETY: live context, valid out-parameter.
    refused(
        unsafe { ep_handle_create(ctx.0, &mut h) },
        "ep_handle_create",
    );
    let (mut buffer, mut bytes) = (null_mut(), 0);
    // SAFETY: live context, valid out-parameters.
    refused(
        unsafe { ep_ll_get_combine_buffer(ctx.0, &mut buffer, &mut bytes) },
        "ep_ll_get_combine_buffer",
    );
    let mut d = common::dispatch_args();
    d.recv_x = d_in.as_mut();
    // SAFETY: no tokens: nothing is read or written.
    refused(
        unsafe { ep_dispatch(ctx.0, &d, handle.0, stream()) },
        "ep_dispatch",
    );
    let c = common::combine_args();
    // SAFETY: as above.
    let status = unsafe { ep_combine(ctx.0, &c, handle.0, stream()) };
    assert_ne!(status, EP_SUCCESS, "ep_combine after an async error");
    let mut l = ll_dispatch_args();
    l.out_dtype = EP_DTYPE_BF16;
    l.recv_x = d_in.as_mut();
    l.recv_count = d_rank.as_mut();
    l.recv_src_info = d_expert.as_mut();
    l.recv_layout_range = d_expert.as_mut();
    // SAFETY: as above.
    refused(
        unsafe { ep_ll_dispatch(ctx.0, &l, stream()) },
        "ep_ll_dispatch",
    );
    let lc = ll_combine_args();
    // SAFETY: as above.
    let status = unsafe { ep_ll_combine(ctx.0, &lc, stream()) };
    assert_ne!(status, EP_SUCCESS, "ep_ll_combine after an async error");
    assert_eq!(async_status(ctx), error, "the error stays");
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn a_context_after_an_async_error_refuses_every_call() {
    run_gpu_world(1, &large_config(10_000), |_, ctx| {
        fail_and_check_refusals(ctx)
    });
}

/// What this process holds: the device's free memory, open descriptors and
/// threads.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Holdings {
    free_bytes: usize,
    fds: usize,
    threads: usize,
}

impl Holdings {
    fn now() -> Holdings {
        trim_pool(0);
        let free_bytes = memory_info(0).0;
        let (fds, threads) = common::fds_and_threads();
        Holdings {
            free_bytes,
            fds,
            threads,
        }
    }

    /// Waits up to 10 s for the descriptors and threads to come back to
    /// `before` (the rendezvous thread of an id exits shortly after its
    /// group formed), then checks that nothing stayed behind.
    fn assert_back_to(before: Holdings, what: &str) {
        let start = Instant::now();
        let mut after = Holdings::now();
        while (after.fds > before.fds || after.threads > before.threads)
            && start.elapsed() < Duration::from_secs(10)
        {
            std::thread::sleep(Duration::from_millis(50));
            after = Holdings::now();
        }
        assert!(
            after.fds <= before.fds && after.threads <= before.threads,
            "{what}: before {before:?}, after {after:?}"
        );
        // One context holds over 100 MiB; the driver may keep a little.
        let lost = before.free_bytes.saturating_sub(after.free_bytes);
        assert!(
            lost < 32 << 20,
            "{what}: {} MiB of device memory not returned (before {before:?}, after {after:?})",
            lost >> 20
        );
    }
}

/// Create, fail, destroy, 100 times (`EP_TEST_LEAK_CYCLES` to change it):
/// once with an async error (one rank), once with a timeout (two ranks on
/// GPU 0, one never calls); the device's free memory, the descriptors and
/// the threads are what they were. Nothing else may use the GPU meanwhile.
#[test]
#[ignore = "needs CUDA GPUs"]
fn destroy_after_an_async_error_or_a_timeout_leaks_nothing() {
    let cycles: usize = std::env::var("EP_TEST_LEAK_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let on_gpu_0 = |_| 0;
    // The first context loads the driver's own state; measure after it.
    run_gpu_world_on(1, &large_config(10_000), on_gpu_0, |_, _| ());
    let before = Holdings::now();
    for _ in 0..cycles {
        run_gpu_world_on(1, &large_config(10_000), on_gpu_0, |_, ctx| {
            fail_and_check_refusals(ctx)
        });
    }
    Holdings::assert_back_to(before, "after async errors");

    let before = Holdings::now();
    let timeout = Duration::from_millis(300);
    let cfg = large_config(timeout.as_millis() as u32);
    for _ in 0..cycles {
        run_gpu_world_on(2, &cfg, on_gpu_0, |rank, ctx| {
            if rank == 0 {
                let x = DevBuf::of::<u16>(7168);
                let idx = DevBuf::from(&[0i32, 1, 40, 41, 2, 3, 42, 43]);
                // [local experts, world * ll_max_tokens, hidden] BF16.
                let recv = DevBuf::poisoned(32 * 2 * 128 * 7168 * 2);
                let count = DevBuf::of::<i32>(32);
                let src_info = DevBuf::of::<i32>(32 * 2 * 128);
                let range = DevBuf::of::<i32>(32 * 2 * 2);
                let mut a = ll_dispatch_args();
                a.num_tokens = 1;
                a.out_dtype = EP_DTYPE_BF16;
                a.x = x.as_const();
                a.topk_idx = idx.as_const();
                a.topk_weights = null();
                a.recv_x = recv.as_mut();
                a.recv_count = count.as_mut();
                a.recv_src_info = src_info.as_mut();
                a.recv_layout_range = range.as_mut();
                // SAFETY: device buffers sized for the config.
                ok(
                    unsafe { ep_ll_dispatch(ctx.0, &a, stream()) },
                    "ll dispatch",
                );
                sync();
                assert_eq!(async_status(ctx), EP_ERR_TIMEOUT, "{}", last_error());
            }
            // Rank 1 never calls; it keeps its context until rank 0 is done.
            gate();
        });
    }
    Holdings::assert_back_to(before, "after timeouts");
}

/// Ranks in different processes cannot share a GPU (that needs MPS): every
/// rank's ep_ctx_create says so.
#[test]
#[ignore = "needs CUDA GPUs"]
fn ranks_as_processes_on_one_gpu_are_refused() {
    let cfg = gpu_config(128, 2, 8, 64, 8, 10_000);
    common::run_ranks_in_processes(
        "ranks_as_processes_on_one_gpu_are_refused",
        "two processes on GPU 0",
        2,
        |rank, id| {
            common::gpu::use_device(0);
            let mut ctx = null_mut();
            // SAFETY: valid out-parameter and config.
            let status = unsafe { ep_ctx_create(&mut ctx, 2, id, rank as i32, 0, &cfg) };
            assert_eq!(status, EP_ERR_UNSUPPORTED, "rank {rank}: {}", last_error());
            assert!(last_error().contains("MPS"), "{}", last_error());
            assert!(ctx.is_null());
            Ctx(null_mut())
        },
        |_, _| (),
    );
}

/// A host-synchronised dispatch returns once its counts are known, while
/// its pull still moves rows through the context's buffers. A caller that
/// destroys the context right after it, without waiting for its stream,
/// must neither crash the device nor lose rows: the destroy waits for them.
/// Outputs and inputs are the test's own and outlive the context.
#[test]
#[ignore = "needs CUDA GPUs"]
fn destroy_right_after_a_dispatch_waits_for_its_rows() {
    const TOKENS: usize = 4096;
    const ALIGNMENT: i32 = 128;
    let topo = Topology {
        world: 1,
        num_experts: 256,
        topk: 8,
        hidden: 7168,
    };
    let cfg = gpu_config(7168, 8, 256, TOKENS as i32, 0, 10_000);
    let mut rng = Rng::new(77);
    let input = Input::random(&mut rng, &topo, Dtype::Bf16, TOKENS, false);
    let want = dispatch_all(
        topo,
        Dtype::Bf16,
        std::slice::from_ref(&input),
        ALIGNMENT as usize,
    );
    run_gpu_world_on(
        1,
        &cfg,
        |_| 0,
        |_, _| {
            let dev = DeviceInput::new(&input);
            for round in 0..3 {
                // A context of its own, destroyed in the round.
                let ctx = Ctx::create_on(1, common::unique_id(), 0, 0, &cfg);
                let handle = ctx.handle();
                let out = Outputs::new(&ctx, &topo, ALIGNMENT);
                let args = out.args(&dev, TOKENS, Dtype::Bf16, ALIGNMENT);
                // SAFETY: device buffers of the sizes the arguments give.
                ok(
                    unsafe { ep_dispatch(ctx.0, &args, handle.0, stream()) },
                    "dispatch",
                );
                drop(handle);
                drop(ctx);
                // A fault of the dispatch's kernels would fail this wait.
                sync();
                out.check(&topo, Dtype::Bf16, &want[0], &format!("round {round}"));
            }
        },
    );
}
