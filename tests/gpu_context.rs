//! GPU contexts on real devices: ranks as threads, symmetric memory mapped
//! between them, the layout kernel against the reference, a garbage expert id
//! reported as an async error, and the caller's current context left alone.
//! Needs CUDA GPUs: `cargo test --release --test gpu_context -- --ignored`.

use cudarc::driver::sys;
use ep::capi::*;
use ep::reference::layout::dispatch_layout;
use ep::reference::Topology;
use std::ffi::CStr;
use std::ptr::null_mut;

fn ok(status: ep_status_t, what: &str) {
    if status != EP_SUCCESS {
        // SAFETY: the library returns a valid C string.
        let msg = unsafe { CStr::from_ptr(ep_get_last_error()) };
        panic!("{what}: status {status}: {}", msg.to_string_lossy());
    }
}

fn cu(res: sys::CUresult, what: &str) {
    assert_eq!(res, sys::CUresult::CUDA_SUCCESS, "{what}");
}

fn device_count() -> usize {
    // SAFETY: plain driver calls.
    unsafe {
        cu(sys::cuInit(0), "cuInit");
        let mut n = 0;
        cu(sys::cuDeviceGetCount(&mut n), "cuDeviceGetCount");
        n as usize
    }
}

/// Makes device `ordinal`'s primary context current on this thread.
fn use_device(ordinal: usize) {
    // SAFETY: plain driver calls.
    unsafe {
        let mut dev = 0;
        cu(sys::cuDeviceGet(&mut dev, ordinal as i32), "cuDeviceGet");
        let mut ctx = null_mut();
        cu(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), "retain");
        cu(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    }
}

fn to_device<T: Copy>(host: &[T]) -> u64 {
    let bytes = std::mem::size_of_val(host).max(4);
    let mut ptr = 0;
    // SAFETY: allocation and copy of `bytes` bytes.
    unsafe {
        cu(sys::cuMemAlloc_v2(&mut ptr, bytes), "cuMemAlloc");
        cu(sys::cuMemsetD8_v2(ptr, 0xAB, bytes), "poison");
        if !host.is_empty() {
            cu(
                sys::cuMemcpyHtoD_v2(ptr, host.as_ptr() as *const _, std::mem::size_of_val(host)),
                "HtoD",
            );
        }
    }
    ptr
}

fn to_host<T: Copy + Default>(ptr: u64, len: usize) -> Vec<T> {
    let mut out = vec![T::default(); len];
    if len > 0 {
        // SAFETY: `ptr` holds at least `len` elements.
        unsafe {
            cu(sys::cuCtxSynchronize(), "sync");
            cu(
                sys::cuMemcpyDtoH_v2(
                    out.as_mut_ptr() as *mut _,
                    ptr,
                    std::mem::size_of_val(&out[..]),
                ),
                "DtoH",
            );
        }
    }
    out
}

/// A small deterministic generator (splitmix64).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Distinct experts per token, some slots dropped (-1).
fn routing(rng: &mut Rng, tokens: usize, topk: usize, experts: usize) -> Vec<i32> {
    let mut out = Vec::new();
    for _ in 0..tokens {
        let mut pool: Vec<i32> = (0..experts as i32).collect();
        for k in 0..topk {
            let pick = k + rng.below(experts - k);
            pool.swap(k, pick);
        }
        out.extend(
            pool[..topk]
                .iter()
                .map(|&e| if rng.below(10) == 0 { -1 } else { e }),
        );
    }
    out
}

fn config(hidden: i32, topk: i32, experts: i32, timeout_ms: u32) -> ep_config_t {
    let mut cfg: ep_config_t = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a config.
    ok(unsafe { ep_config_init(&mut cfg) }, "config_init");
    cfg.backend = EP_BACKEND_GPU;
    cfg.hidden = hidden;
    cfg.topk = topk;
    cfg.num_experts = experts;
    cfg.max_tokens_per_rank = 4096;
    cfg.ll_max_tokens_per_rank = 128;
    cfg.timeout_ms = timeout_ms;
    cfg
}

/// Runs `body(rank, ctx)` on `world` threads, each with its own context.
fn with_world(world: usize, cfg: ep_config_t, body: impl Fn(usize, *mut ep_ctx_t) + Sync) {
    let mut id = ep_unique_id_t { internal: [0; 128] };
    // SAFETY: a valid pointer.
    ok(unsafe { ep_get_unique_id(&mut id) }, "unique id");
    std::thread::scope(|s| {
        for rank in 0..world {
            let body = &body;
            s.spawn(move || {
                use_device(rank);
                let mut before = null_mut();
                // SAFETY: plain driver calls and C API calls with valid pointers.
                unsafe {
                    cu(sys::cuCtxGetCurrent(&mut before), "current");
                    let mut ctx = null_mut();
                    ok(
                        ep_ctx_create(&mut ctx, world as i32, id, rank as i32, rank as i32, &cfg),
                        "ctx_create",
                    );
                    let mut after = null_mut();
                    cu(sys::cuCtxGetCurrent(&mut after), "current");
                    assert_eq!(before, after, "ep_ctx_create changed the current context");
                    body(rank, ctx);
                    ok(ep_ctx_destroy(ctx), "ctx_destroy");
                }
            });
        }
    });
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn layout_kernel_matches_the_reference() {
    let world = device_count().min(4);
    for (topk, experts, tokens) in [(8, 256, 4096), (1, 8, 1), (4, 64, 17), (8, 64, 0)] {
        let experts = experts - experts % world;
        let topo = Topology {
            world,
            num_experts: experts,
            topk,
            hidden: 128,
        };
        with_world(
            world,
            config(128, topk as i32, experts as i32, 10_000),
            |rank, ctx| {
                let idx = routing(
                    &mut Rng(rank as u64 * 7 + tokens as u64),
                    tokens,
                    topk,
                    experts,
                );
                let want = dispatch_layout(topo, &idx, tokens).unwrap();
                let d_idx = to_device(&idx);
                let d_rank = to_device(&vec![0i32; world]);
                let d_expert = to_device(&vec![0i32; experts]);
                let d_in = to_device(&vec![0u8; tokens * world]);
                // SAFETY: device buffers of the sizes the layout needs.
                ok(
                    unsafe {
                        ep_get_dispatch_layout(
                            ctx,
                            d_idx as *const i32,
                            tokens as i32,
                            d_rank as *mut i32,
                            d_expert as *mut i32,
                            d_in as *mut u8,
                            null_mut(),
                        )
                    },
                    "layout",
                );
                assert_eq!(to_host::<i32>(d_rank, world), want.tokens_per_rank);
                assert_eq!(to_host::<i32>(d_expert, experts), want.tokens_per_expert);
                assert_eq!(to_host::<u8>(d_in, tokens * world), want.is_token_in_rank);
                let mut status = -1;
                // SAFETY: valid pointers.
                ok(unsafe { ep_ctx_get_async_error(ctx, &mut status) }, "async");
                assert_eq!(status, EP_SUCCESS);
            },
        );
    }
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn invalid_expert_id_becomes_an_async_error() {
    let world = device_count().min(2);
    with_world(world, config(128, 2, 8, 10_000), |_, ctx| {
        let d_idx = to_device(&[0i32, 99]);
        let d_rank = to_device(&vec![0i32; world]);
        let d_expert = to_device(&[0i32; 8]);
        let d_in = to_device(&vec![0u8; world]);
        // SAFETY: device buffers of the sizes the layout needs.
        ok(
            unsafe {
                ep_get_dispatch_layout(
                    ctx,
                    d_idx as *const i32,
                    1,
                    d_rank as *mut i32,
                    d_expert as *mut i32,
                    d_in as *mut u8,
                    null_mut(),
                )
            },
            "layout",
        );
        to_host::<i32>(d_rank, world);
        let mut status = -1;
        // SAFETY: valid pointers.
        ok(unsafe { ep_ctx_get_async_error(ctx, &mut status) }, "async");
        assert_eq!(status, EP_ERR_INVALID_ARGUMENT);
    });
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn abort_is_reported_and_sticks() {
    let world = device_count().min(2);
    with_world(world, config(128, 2, 8, 10_000), |_, ctx| {
        let mut status = -1;
        // SAFETY: valid pointers.
        unsafe {
            ok(ep_ctx_abort(ctx), "abort");
            ok(ep_ctx_get_async_error(ctx, &mut status), "async");
        }
        assert_eq!(status, EP_ERR_ABORTED);
    });
}
