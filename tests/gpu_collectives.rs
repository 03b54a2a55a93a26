//! Mismatched collective calls on real GPUs: ranks that make different
//! calls (a low-latency dispatch against a normal dispatch, a combine
//! against a dispatch, in either mode) end promptly with `EP_ERR_REMOTE` on
//! every rank, long before the timeout, and never with rows of another call.
//! Ranks are threads, sharing the GPU when there are fewer GPUs than ranks.
//! Needs CUDA GPUs: `cargo test --release --test gpu_collectives -- --ignored`.

mod common;

use common::gpu::{async_status, gate, gpu_config, run_gpu_world, stream, sync, DevBuf};
use common::{last_error, ll_combine_args, ll_dispatch_args, Ctx, Handle};
use ep::capi::*;
use std::ptr::null;
use std::time::{Duration, Instant};

const HIDDEN: usize = 128;
const TOPK: usize = 2;
const EXPERTS: usize = 8;
const TOKENS: usize = 4;
/// Normal-mode and low-latency token bound of the contexts.
const MAX_TOKENS: usize = 8;
/// Long, so that a mismatch that went unnoticed would show as slow.
const TIMEOUT: Duration = Duration::from_secs(30);

/// A collective call of the tests.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    Dispatch,
    Combine,
    LlDispatch,
    LlCombine,
}

/// The contexts' config: both modes, the long timeout.
fn config() -> ep_config_t {
    gpu_config(
        HIDDEN as i32,
        TOPK as i32,
        EXPERTS as i32,
        MAX_TOKENS as i32,
        MAX_TOKENS as i32,
        TIMEOUT.as_millis() as u32,
    )
}

/// Every device buffer the four operations need, for `world` ranks.
struct Bufs {
    x: DevBuf,
    idx: DevBuf,
    weights: DevBuf,
    recv_x: DevBuf,
    recv_count: DevBuf,
    recv_src_info: DevBuf,
    recv_range: DevBuf,
    ll_y: DevBuf,
    out: DevBuf,
    recv_rows: i32,
}

impl Bufs {
    fn new(world: usize) -> Bufs {
        let rows = world * MAX_TOKENS * EXPERTS;
        // Token t goes to experts t and t + 4 (both ranks of a world of 2).
        let idx: Vec<i32> = (0..TOKENS as i32).flat_map(|t| [t, t + 4]).collect();
        Bufs {
            x: DevBuf::of::<u16>(MAX_TOKENS * HIDDEN),
            idx: DevBuf::from(&idx),
            weights: DevBuf::from(&[0.5f32; TOKENS * TOPK]),
            recv_x: DevBuf::of::<u16>(rows * HIDDEN),
            recv_count: DevBuf::of::<i32>(EXPERTS),
            recv_src_info: DevBuf::of::<i32>(rows),
            recv_range: DevBuf::of::<i32>(EXPERTS * world * 2),
            ll_y: DevBuf::of::<u16>(rows * HIDDEN),
            out: DevBuf::of::<u16>(MAX_TOKENS * HIDDEN),
            recv_rows: (world * MAX_TOKENS) as i32,
        }
    }

    /// Enqueues `op` and returns its status.
    fn call(&self, ctx: &Ctx, handle: &Handle, op: Op) -> ep_status_t {
        // SAFETY (every call): device buffers sized for the config.
        match op {
            Op::Dispatch => {
                let mut a = common::dispatch_args();
                a.num_tokens = TOKENS as i32;
                a.x = self.x.as_const();
                a.topk_idx = self.idx.as_const();
                a.topk_weights = self.weights.as_const();
                a.recv_capacity = self.recv_rows;
                a.recv_x = self.recv_x.as_mut();
                a.flags = EP_DISPATCH_NO_HOST_SYNC;
                unsafe { ep_dispatch(ctx.0, &a, handle.0, stream()) }
            }
            Op::Combine => {
                let mut c = common::combine_args();
                c.x = self.recv_x.as_const();
                c.out = self.out.as_mut();
                unsafe { ep_combine(ctx.0, &c, handle.0, stream()) }
            }
            Op::LlDispatch => {
                let mut a = ll_dispatch_args();
                a.num_tokens = TOKENS as i32;
                a.out_dtype = EP_DTYPE_BF16;
                a.x = self.x.as_const();
                a.topk_idx = self.idx.as_const();
                a.topk_weights = self.weights.as_const();
                a.recv_x = self.recv_x.as_mut();
                a.recv_count = self.recv_count.as_mut();
                a.recv_src_info = self.recv_src_info.as_mut();
                a.recv_layout_range = self.recv_range.as_mut();
                unsafe { ep_ll_dispatch(ctx.0, &a, stream()) }
            }
            Op::LlCombine => {
                let mut c = ll_combine_args();
                c.num_tokens = TOKENS as i32;
                c.x = self.ll_y.as_const();
                c.topk_idx = self.idx.as_const();
                c.topk_weights = null();
                c.src_info = self.recv_src_info.as_const();
                c.layout_range = self.recv_range.as_const();
                c.out = self.out.as_mut();
                unsafe { ep_ll_combine(ctx.0, &c, stream()) }
            }
        }
    }
}

/// Both ranks make the calls of `common`, then rank r makes `last[r]`:
/// every rank's last call ends in `EP_ERR_REMOTE` (returned, or from the
/// async status), quickly, and the context refuses the next call.
fn mismatch(world: usize, common: &[Op], last: [Op; 2]) {
    let cfg = config();
    run_gpu_world(world, &cfg, |rank, ctx| {
        let handle = ctx.handle();
        let bufs = Bufs::new(world);
        gate();
        for &op in common {
            common::gpu::ok(bufs.call(ctx, &handle, op), &format!("{op:?}"));
        }
        sync();
        assert_eq!(
            async_status(ctx),
            EP_SUCCESS,
            "rank {rank}: the common calls"
        );
        let op = last[rank.min(1)];
        let what = format!("world {world} rank {rank}: {op:?} after {common:?} against {last:?}");
        let start = Instant::now();
        let status = bufs.call(ctx, &handle, op);
        sync();
        let took = start.elapsed();
        let status = if status == EP_SUCCESS {
            async_status(ctx)
        } else {
            status
        };
        assert_eq!(status, EP_ERR_REMOTE, "{what}: {}", last_error());
        assert!(took < TIMEOUT / 10, "{what}: took {took:?}");
        // The context is done for: the next call is refused.
        assert_ne!(
            bufs.call(ctx, &handle, Op::LlDispatch),
            EP_SUCCESS,
            "{what}"
        );
        gate();
    });
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn a_low_latency_dispatch_against_a_normal_dispatch() {
    for world in [2, 4] {
        mismatch(world, &[], [Op::LlDispatch, Op::Dispatch]);
        mismatch(world, &[], [Op::Dispatch, Op::LlDispatch]);
    }
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn a_combine_against_a_dispatch() {
    for world in [2, 4] {
        mismatch(world, &[Op::Dispatch], [Op::Combine, Op::Dispatch]);
        mismatch(world, &[Op::LlDispatch], [Op::LlCombine, Op::LlDispatch]);
        mismatch(world, &[Op::Dispatch], [Op::Combine, Op::LlDispatch]);
    }
}

/// The message names both ranks' calls.
#[test]
#[ignore = "needs CUDA GPUs"]
fn the_error_names_both_calls() {
    let cfg = config();
    run_gpu_world(2, &cfg, |rank, ctx| {
        let handle = ctx.handle();
        let bufs = Bufs::new(2);
        gate();
        let op = [Op::LlDispatch, Op::Dispatch][rank];
        common::gpu::ok(bufs.call(ctx, &handle, op), "the call");
        sync();
        assert_eq!(async_status(ctx), EP_ERR_REMOTE);
        // A refused call reports the async error's message.
        assert_ne!(bufs.call(ctx, &handle, op), EP_SUCCESS);
        let message = last_error();
        let (mine, theirs) = if rank == 0 {
            ("ep_ll_dispatch", "ep_dispatch")
        } else {
            ("ep_dispatch", "ep_ll_dispatch")
        };
        assert!(
            message.contains(&format!("this rank is in {mine} (collective call 1"))
                && message.contains(&format!(
                    "rank {} is in {theirs} (collective call 1",
                    1 - rank
                )),
            "rank {rank}: {message}"
        );
        gate();
    });
}
