//! The API contract on the GPU backend: the table-driven walks of
//! tests/contract.rs (every pointer of every operation NULL in turn, every
//! other checkable input bad in turn) with device buffers, on 1 rank and on
//! 2 ranks (sharing the GPU when there is one); and the checks only the GPU
//! backend makes before a call: the memory behind each pointer, misaligned
//! rows, the stream.
//! Needs CUDA GPUs: `cargo test --release --test gpu_contract -- --ignored`.

mod common;

use common::calls::{Call, PointerFields, Shape, Tokens};
use common::gpu::*;
use common::walk::{self, contract_shape, DispatchOp, LayoutOp, Op, LL_SOME, SOME};
use common::{last_error, Ctx};
use cudarc::driver::sys;
use ep::capi::*;
use std::ffi::c_void;
use std::ptr::null_mut;

fn config(s: &Shape) -> ep_config_t {
    let mut cfg = s.config();
    cfg.backend = EP_BACKEND_GPU;
    cfg
}

/// Device buffers; combines are within BF16 rounding of the reference.
static DEVICE: DeviceMem = DeviceMem {
    combine_tolerance: 1.0 / 128.0,
};

/// Runs `walk` on every rank of 1 and of 2 ranks.
fn on_worlds(walk: impl Fn(&Shape, &Ctx, usize) + Sync) {
    for world in [1, 2] {
        let s = contract_shape(world);
        run_gpu_world(world, &config(&s), |rank, ctx| walk(&s, ctx, rank));
    }
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn null_walk_of_the_normal_mode() {
    on_worlds(|s, ctx, rank| {
        walk::null_walk_of_the_normal_mode(&DEVICE, s, ctx, rank, &SOME[..s.world])
    });
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn null_walk_of_the_low_latency_mode() {
    on_worlds(|s, ctx, rank| {
        walk::null_walk_of_the_low_latency_mode(&DEVICE, s, ctx, rank, &LL_SOME[..s.world])
    });
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn bad_input_walk() {
    on_worlds(|s, ctx, rank| {
        let counts = (&SOME[..s.world], &LL_SOME[..s.world]);
        walk::bad_input_walk(&DEVICE, s, ctx, rank, counts, false)
    });
}

/// Memory that is not device memory of the context's device, passed where
/// the kernels need it, and what the call must say: `None` when it is
/// accepted.
struct Foreign {
    what: &'static str,
    ptr: *mut c_void,
    refusal: Option<&'static str>,
}

/// Pageable host memory (refused), pinned host memory mapped for the device
/// (accepted: the kernels reach it over PCIe), a stray address (refused),
/// and device memory of another GPU when there is one (refused).
fn foreign_memory(bytes: usize) -> (Vec<Foreign>, impl Drop) {
    struct Owned {
        _pageable: Vec<u8>,
        pinned: *mut c_void,
        other: Option<(usize, u64)>,
    }
    impl Drop for Owned {
        fn drop(&mut self) {
            // SAFETY: allocated below, freed once, nothing runs any more.
            unsafe {
                sys::cuMemFreeHost(self.pinned);
                if let Some((ordinal, ptr)) = self.other {
                    use_device(ordinal);
                    sys::cuMemFree_v2(ptr);
                    use_device(device_of(0));
                }
            }
        }
    }
    let mut pageable = vec![0u8; bytes + 16];
    let aligned = pageable
        .as_mut_ptr()
        .wrapping_add(pageable.as_ptr().align_offset(16));
    let mut pinned = null_mut();
    // SAFETY: allocates `bytes` of host memory mapped for the device.
    cu(
        unsafe { sys::cuMemHostAlloc(&mut pinned, bytes, sys::CU_MEMHOSTALLOC_DEVICEMAP) },
        "cuMemHostAlloc",
    );
    let mut list = vec![
        Foreign {
            what: "pageable host memory",
            ptr: aligned.cast(),
            refusal: Some("host memory (or no memory) that CUDA does not know"),
        },
        Foreign {
            what: "pinned host memory mapped for the device",
            ptr: pinned,
            refusal: None,
        },
        Foreign {
            what: "a stray address",
            ptr: 0x1000 as *mut c_void,
            refusal: Some("that CUDA does not know"),
        },
    ];
    let mut other = None;
    if device_count() > 1 {
        let ordinal = (device_of(0) + 1) % device_count();
        use_device(ordinal);
        let mut ptr = 0;
        // SAFETY: allocates `bytes` on the other device.
        cu(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }, "cuMemAlloc");
        use_device(device_of(0));
        list.push(Foreign {
            what: "device memory of another GPU",
            ptr: ptr as *mut c_void,
            refusal: Some("device memory of device"),
        });
        other = Some((ordinal, ptr));
    } else {
        println!("skipped device memory of another GPU: this machine has one GPU");
    }
    let owned = Owned {
        _pageable: pageable,
        pinned,
        other,
    };
    (list, owned)
}

/// Device pointers of a dispatch and of a layout, in turn pointing at each
/// kind of foreign memory: refused before anything is enqueued with
/// `EP_ERR_INVALID_ARGUMENT` naming the field and what the memory is (the
/// kernels would fault, which kills the caller's CUDA context), or accepted;
/// the context works afterwards.
#[test]
#[ignore = "needs CUDA GPUs"]
fn memory_the_kernels_cannot_use_is_refused() {
    let s = contract_shape(1);
    run_gpu_world(1, &config(&s), |rank, ctx| {
        let tokens = Tokens::new(&s, 61, &SOME[..1], false);
        let mut dispatch = DispatchOp::new(&DEVICE, ctx, &s, &tokens, rank, walk::both(1));
        let mut layout = LayoutOp::new(&DEVICE, &s, &tokens, rank);
        let (foreign, _owned) = foreign_memory(1 << 20);
        for f in &foreign {
            for field in ["x", "topk_idx", "recv_x", "expert_weights"] {
                point(&mut dispatch.call.call, field, f);
                check_foreign(&mut dispatch, ctx, field, f);
            }
            for field in ["topk_idx", "num_tokens_per_expert"] {
                point(&mut layout.call.call, field, f);
                check_foreign(&mut layout, ctx, field, f);
            }
        }
    });
}

/// Points `field` of `call` at `f`, first copying the field's bytes there
/// when the call is to be accepted (pinned host memory is host memory).
fn point<A: PointerFields>(call: &mut Call<'_, A>, field: &str, f: &Foreign) {
    call.restore();
    if f.refusal.is_none() {
        let bytes = call.buf(field).read();
        // SAFETY: `f.ptr` is host memory of 1 MiB, more than any buffer here.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), f.ptr.cast(), bytes.len()) };
    }
    call.set(field, f.ptr.cast());
}

/// Makes `op`'s call with its pointer as `point` left it and checks the
/// outcome, then makes a correct call.
fn check_foreign(op: &mut dyn Op, ctx: &Ctx, field: &str, f: &Foreign) {
    let what = format!("{} with `{field}` = {}", op.label(), f.what);
    op.prepare(ctx);
    op.pointers().poison();
    let status = op.run(ctx, 0);
    match f.refusal {
        Some(words) => {
            assert_eq!(status, EP_ERR_INVALID_ARGUMENT, "{what}: {}", last_error());
            let message = last_error();
            assert!(
                message.contains(&format!("`{field}`")) && message.contains(words),
                "{what}: {message}"
            );
            assert!(op.pointers().untouched(), "{what}: an output was written");
        }
        None => assert_eq!(status, op.success(), "{what}: {}", last_error()),
    }
    sync();
    assert_eq!(async_status(ctx), EP_SUCCESS, "{what}: {}", last_error());
    walk::correct_call(op, ctx, &format!("{what}, then correct"));
}

/// A stream of another device, or of another CUDA context than the
/// device's primary one, is refused before anything is enqueued.
#[test]
#[ignore = "needs CUDA GPUs"]
fn a_stream_the_context_cannot_use_is_refused() {
    let s = contract_shape(1);
    run_gpu_world(1, &config(&s), |rank, ctx| {
        let tokens = Tokens::new(&s, 62, &SOME[..1], false);
        let mut layout = LayoutOp::new(&DEVICE, &s, &tokens, rank);
        let layout_on = |stream: ep_stream_t| layout.call.run_on(ctx, stream);
        // The thread's own streams are fine.
        for fine in [stream(), null_mut(), 2usize as ep_stream_t] {
            common::gpu::ok(layout_on(fine), "layout");
            sync();
            // SAFETY: the legacy stream's and this thread's work is done.
            cu(unsafe { sys::cuCtxSynchronize() }, "sync");
        }
        if device_count() > 1 {
            let other = (device_of(rank) + 1) % device_count();
            use_device(other);
            let mut foreign = null_mut();
            // SAFETY: a stream of the other device's primary context.
            cu(
                unsafe {
                    sys::cuStreamCreate(
                        &mut foreign,
                        sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                    )
                },
                "cuStreamCreate",
            );
            use_device(device_of(rank));
            assert_eq!(layout_on(foreign as ep_stream_t), EP_ERR_INVALID_ARGUMENT);
            assert!(
                last_error().contains(&format!("a stream of device {other}")),
                "{}",
                last_error()
            );
            // SAFETY: unused, destroyed once.
            unsafe { sys::cuStreamDestroy_v2(foreign) };
        } else {
            println!("skipped a stream of another GPU: this machine has one GPU");
        }
        layout.pointers().restore();
        assert_eq!(layout.run(ctx, 0), EP_SUCCESS);
        layout.check().unwrap();
    });
}
