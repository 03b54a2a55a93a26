//! Contexts on NCCL: `ep_ctx_create_from_nccl` on a communicator made with
//! `ncclCommInitRank` (borrowed, never destroyed by ep), `ep_ctx_create`
//! with a communicator of its own (`EP_TRANSPORT=nccl`), and the refusal of
//! an NCCL of another version. Every rank of every test runs a normal-mode
//! and a low-latency round trip whose results are exact (see `Tokens`).
//! The whole GPU suite also runs on NCCL contexts with `EP_TEST_NCCL=1`
//! (scripts/gpu-check.sh does both).
//!
//! Needs CUDA GPUs and NCCL 2.28.9 (`EP_NCCL_LIBRARY` names its
//! libnccl.so.2, else the loader's `libnccl.so.2`):
//! `cargo test --release --test gpu_nccl -- --ignored --test-threads=1`.

mod common;

use common::gpu::nccl::{self, Comm, UniqueId};
use common::gpu::*;
use common::{last_error, run_ranks, Ctx};
use ep::capi::*;
use half::bf16;
use std::ptr::null_mut;

const HIDDEN: usize = 1024;
const TOPK: usize = 4;
const EXPERTS: usize = 16;
const TOKENS: usize = 64;
const LL_TOKENS: usize = 32;

fn config() -> ep_config_t {
    gpu_config(
        HIDDEN as i32,
        TOPK as i32,
        EXPERTS as i32,
        TOKENS as i32,
        LL_TOKENS as i32,
        60_000,
    )
}

/// One rank's tokens, chosen so that every sum of the round trips is exact
/// in BF16: values are multiples of 1/8 in [-1, 1], weights (k + 1) / 8,
/// distinct experts per token, one slot in seven dropped. Identity experts
/// then give `out[t] = sum over kept slots k of w_k * x[t]` exactly.
struct Tokens {
    x: Vec<bf16>,
    idx: Vec<i32>,
    w: Vec<f32>,
    want: Vec<bf16>,
}

impl Tokens {
    fn new(rank: usize) -> Tokens {
        let value = |t: usize, c: usize| ((rank * 31 + t * 7 + c) % 17) as f32 / 8.0 - 1.0;
        let expert = |t: usize, k: usize| {
            if (t + k).is_multiple_of(7) {
                -1
            } else {
                ((t * 7 + rank * 3 + k * 5) % EXPERTS) as i32
            }
        };
        let mut tokens = Tokens {
            x: Vec::new(),
            idx: Vec::new(),
            w: Vec::new(),
            want: Vec::new(),
        };
        for t in 0..TOKENS {
            let kept: f32 = (0..TOPK)
                .filter(|&k| expert(t, k) >= 0)
                .map(|k| (k + 1) as f32 / 8.0)
                .sum();
            for c in 0..HIDDEN {
                tokens.x.push(bf16::from_f32(value(t, c)));
                tokens.want.push(bf16::from_f32(kept * value(t, c)));
            }
            for k in 0..TOPK {
                tokens.idx.push(expert(t, k));
                tokens.w.push((k + 1) as f32 / 8.0);
            }
        }
        tokens
    }
}

/// A normal-mode (expert-major, the library weighs) and a low-latency
/// (BF16 rows, weights at combine) round trip of identity experts on `ctx`,
/// each checked exactly.
fn round_trips(ctx: &Ctx, world: usize, rank: usize) {
    let tokens = Tokens::new(rank);
    let x = DevBuf::from(&tokens.x);
    let idx = DevBuf::from(&tokens.idx);
    let w = DevBuf::from(&tokens.w);
    let local = EXPERTS / world;

    // Normal mode.
    let mut capacity = 0;
    // SAFETY: a live context and valid out-parameters.
    ok(
        unsafe { ep_get_dispatch_capacity(ctx.0, 1, null_mut(), &mut capacity) },
        "capacity",
    );
    let rows = capacity as usize;
    let expert_x = DevBuf::of::<bf16>(rows * HIDDEN);
    let expert_w = DevBuf::of::<f32>(rows);
    let expert_src = DevBuf::of::<i32>(rows);
    let offsets = DevBuf::of::<i32>(local + 1);
    let counts = DevBuf::of::<i32>(local);
    let out = DevBuf::of::<bf16>(TOKENS * HIDDEN);
    let handle = ctx.handle();
    let mut d = common::dispatch_args();
    d.num_tokens = TOKENS as i32;
    d.x = x.as_const();
    d.topk_idx = idx.as_const();
    d.topk_weights = w.as_const();
    d.expert_capacity = capacity;
    d.expert_x = expert_x.as_mut();
    d.expert_weights = expert_w.as_mut();
    d.expert_src_row = expert_src.as_mut();
    d.expert_offsets = offsets.as_mut();
    d.expert_counts = counts.as_mut();
    let mut c = common::combine_args();
    c.input_layout = EP_COMBINE_EXPERT_MAJOR;
    c.x = expert_x.as_const();
    c.out = out.as_mut();
    // SAFETY: device buffers of the sizes the config and capacity give.
    unsafe {
        ok(ep_dispatch(ctx.0, &d, handle.0, null_mut()), "dispatch");
        ok(ep_combine(ctx.0, &c, handle.0, null_mut()), "combine");
    }
    let got = out.download::<bf16>(TOKENS * HIDDEN);
    assert_eq!(async_status(ctx), EP_SUCCESS, "{}", last_error());
    assert!(got == tokens.want, "rank {rank}: normal-mode round trip");

    // Low-latency mode.
    let slots = local * world * LL_TOKENS;
    let recv_x = DevBuf::of::<bf16>(slots * HIDDEN);
    let recv_count = DevBuf::of::<i32>(local);
    let recv_src = DevBuf::of::<i32>(slots);
    let recv_range = DevBuf::of::<i32>(local * world * 2);
    out.poison();
    let mut ld = common::ll_dispatch_args();
    ld.num_tokens = LL_TOKENS as i32;
    ld.out_dtype = EP_DTYPE_BF16;
    ld.x = x.as_const();
    ld.topk_idx = idx.as_const();
    ld.recv_x = recv_x.as_mut();
    ld.recv_count = recv_count.as_mut();
    ld.recv_src_info = recv_src.as_mut();
    ld.recv_layout_range = recv_range.as_mut();
    let mut lc = common::ll_combine_args();
    lc.num_tokens = LL_TOKENS as i32;
    lc.x = recv_x.as_const();
    lc.topk_idx = idx.as_const();
    lc.topk_weights = w.as_const();
    lc.src_info = recv_src.as_const();
    lc.layout_range = recv_range.as_const();
    lc.out = out.as_mut();
    // SAFETY: device buffers sized for the config.
    unsafe {
        ok(ep_ll_dispatch(ctx.0, &ld, null_mut()), "ll dispatch");
        ok(ep_ll_combine(ctx.0, &lc, null_mut()), "ll combine");
    }
    let got = out.download::<bf16>(LL_TOKENS * HIDDEN);
    assert_eq!(async_status(ctx), EP_SUCCESS, "{}", last_error());
    assert!(
        got == tokens.want[..LL_TOKENS * HIDDEN],
        "rank {rank}: low-latency round trip"
    );
}

/// Rank `rank`'s communicator of a `world`-rank group whose NCCL id is `id`.
fn communicator(world: usize, rank: usize, id: UniqueId) -> Comm {
    use_device(rank);
    nccl::communicator(world, rank, id)
}

#[test]
#[ignore = "needs CUDA GPUs and NCCL 2.28.9"]
fn contexts_on_a_communicator_run_both_modes_and_leave_it_alone() {
    let world = device_count().min(4);
    let id = nccl::new_id();
    std::thread::scope(|s| {
        for rank in 0..world {
            s.spawn(move || {
                let comm = communicator(world, rank, id);
                for round in 0..2 {
                    let ctx = nccl::context_on(comm, &config(), rank);
                    let (mut r, mut w, mut backend) = (-1, -1, -1);
                    // SAFETY: a live context and valid out-parameters.
                    ok(
                        unsafe { ep_ctx_get_info(ctx.0, &mut r, &mut w, null_mut(), &mut backend) },
                        "info",
                    );
                    assert_eq!((r, w, backend), (rank as i32, world as i32, EP_BACKEND_GPU));
                    round_trips(&ctx, world, rank);
                    drop(ctx);
                    // The communicator is still the caller's, and alive.
                    let mut count = 0;
                    // SAFETY: the live communicator.
                    let status = unsafe { (nccl::lib().comm_count)(comm, &mut count) };
                    assert_eq!((status, count), (0, world as i32), "round {round}");
                }
                // SAFETY: our communicator, used no more.
                unsafe { (nccl::lib().comm_destroy)(comm) };
            });
        }
    });
}

/// `ep_ctx_create` with `EP_TRANSPORT=nccl`: the context makes its own
/// communicator from an `ncclUniqueId` its bootstrap carries (the path of
/// ranks on several hosts), and destroys it.
#[test]
#[ignore = "needs CUDA GPUs and NCCL 2.28.9"]
fn ep_ctx_create_makes_its_own_communicator() {
    // Loads NCCL first, so that ep finds this copy.
    nccl::lib();
    std::env::set_var("EP_TRANSPORT", "nccl");
    let world = device_count().min(4);
    let cfg = config();
    run_ranks(
        world,
        |rank, id| {
            use_device(rank);
            Ctx::create_on(world as i32, id, rank as i32, rank as i32, &cfg)
        },
        |rank, ctx| round_trips(ctx, world, rank),
    );
    std::env::remove_var("EP_TRANSPORT");
}

/// Environment of the child process of the next test.
const CHILD_ENV: &str = "EP_TEST_OTHER_NCCL_CHILD";

/// An NCCL of another version than the kernels' (the system's 2.28.3 on our
/// GPU machines) is refused with a message naming both versions. The check
/// runs in a child process that loads that NCCL (a process keeps the NCCL
/// it loaded first).
#[test]
#[ignore = "needs CUDA GPUs and NCCL 2.28.9"]
fn an_nccl_of_another_version_is_refused() {
    let other = "/usr/lib/x86_64-linux-gnu/libnccl.so.2";
    if std::env::var(CHILD_ENV).is_ok() {
        let mut version = 0;
        // SAFETY: writes one int.
        unsafe { (nccl::lib().get_version)(&mut version) };
        if version == 22809 {
            println!("{other} is NCCL 2.28.9 itself: nothing to refuse");
            return;
        }
        use_device(0);
        let comm = communicator(1, 0, nccl::new_id());
        let mut ctx = null_mut();
        // SAFETY: a live communicator, a valid config and out-parameter.
        let status = unsafe { ep_ctx_create_from_nccl(comm.cast(), &config(), &mut ctx) };
        let message = last_error();
        println!("refused: {message}");
        assert_eq!(status, EP_ERR_UNSUPPORTED, "{message}");
        assert!(ctx.is_null());
        assert!(message.contains("but ep's network kernels were compiled against NCCL 2.28.9"));
        let found = format!(
            "is NCCL {}.{}.{}",
            version / 10000,
            version % 10000 / 100,
            version % 100
        );
        assert!(message.contains(&found), "{message}");
        if version < 22809 {
            assert!(message.contains("Communicator does not support symmetric memory"));
        }
        // SAFETY: our communicator.
        unsafe { (nccl::lib().comm_destroy)(comm) };
        return;
    }
    if !std::path::Path::new(other).is_file() {
        eprintln!("{other} not found: nothing to refuse here");
        return;
    }
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "an_nccl_of_another_version_is_refused",
            "--exact",
            "--include-ignored",
            "--nocapture",
        ])
        .env(CHILD_ENV, "1")
        .env("EP_NCCL_LIBRARY", other)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    println!("{stdout}{}", String::from_utf8_lossy(&output.stderr));
    assert!(
        output.status.success() && stdout.contains("1 passed"),
        "the child failed"
    );
}
