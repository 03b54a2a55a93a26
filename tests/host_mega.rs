//! The fused calls (`ep_mega_dispatch_gemm`, `ep_mega_gemm_combine`) on the
//! host backend, through the C API, against the reference: the dispatch's
//! expert-major outputs, the GEMM rows and the combined tokens, bit for bit
//! (the host backend runs the reference), with poisoned outputs, over
//! BF16 and FP8, uneven token counts (0, 1, 17), uniform routing with
//! dropped slots and experts without rows, every row on one expert, several
//! hidden / n / k and alignments, and one and two ranks.

mod common;

use common::calls::combine_reference;
use common::mega::*;
use common::normal::dispatch_all;
use common::*;
use ep::capi::*;
use ep::reference::mega::{grouped_gemm, GemmRows};
use ep::reference::normal::Dispatched;
use ep::reference::Dtype;
use half::bf16;
use std::ptr::{null, null_mut};

/// The reference output of the second GEMM of `rank` (all expert-major
/// rows, zeros in padding).
fn reference_y2(case: &MegaCase, d: &Dispatched, rank: usize, capacity: usize) -> Vec<bf16> {
    let (x2, x2_scales) = activations(case, rank, capacity);
    let w2 = weights2(case, rank);
    grouped_gemm(
        &w2.view(),
        GemmRows {
            data: &x2,
            scales: &x2_scales,
        },
        &d.expert_offsets,
        &d.expert_counts,
    )
}

fn run_case(case: &MegaCase) {
    let mut cfg = host_config(
        case.hidden as i32,
        case.topk as i32,
        case.experts as i32,
        case.max_tokens() as i32,
        0,
    );
    cfg.token_dtype = dtype_code(case.dtype);
    let all = all_tokens(case);
    let refs = dispatch_all(case.topo(), case.dtype, &all, case.alignment);
    let what = format!("{case:?}");
    run_world(case.world, &cfg, |rank, ctx| {
        let (local, hidden, n) = (case.local_experts(), case.hidden, case.n);
        let dtype = case.dtype;
        let (row_bytes, cols) = (dtype.row_bytes(hidden), dtype.scales_per_row(hidden));
        let d = &refs[rank];
        let me = &all[rank];
        let mut capacity = 0;
        // SAFETY: live context, valid out-parameter.
        let status = unsafe {
            ep_get_dispatch_capacity(ctx.0, case.alignment as i32, null_mut(), &mut capacity)
        };
        assert_eq!(status, EP_SUCCESS);
        let cap = capacity as usize;

        // Dispatch + GEMM.
        let mut ex_x = poisoned::<u8>(cap * row_bytes);
        let mut ex_scales = poisoned::<f32>(cap * cols);
        let mut ex_w = poisoned::<f32>(cap);
        let mut ex_src = poisoned::<i32>(cap);
        let mut ex_off = poisoned::<i32>(local + 1);
        let mut ex_cnt = poisoned::<i32>(local);
        let mut y1 = poisoned::<bf16>(cap * n);
        let w1 = weights1(case, rank);
        let mut a = dispatch_args();
        a.num_tokens = me.num_tokens as i32;
        a.dtype = dtype_code(case.dtype);
        a.x = me.x.as_ptr() as *const _;
        a.x_scales = if dtype == Dtype::Fp8E4m3 {
            me.scales.as_ptr()
        } else {
            null()
        };
        a.topk_idx = me.topk_idx.as_ptr();
        a.topk_weights = me.topk_weights.as_ptr();
        a.expert_alignment = case.alignment as i32;
        a.expert_capacity = capacity;
        a.expert_x = ex_x.as_mut_ptr() as *mut _;
        a.expert_x_scales = ex_scales.as_mut_ptr();
        a.expert_weights = ex_w.as_mut_ptr();
        a.expert_src_row = ex_src.as_mut_ptr();
        a.expert_offsets = ex_off.as_mut_ptr();
        a.expert_counts = ex_cnt.as_mut_ptr();
        if case.keep_padding {
            a.flags |= EP_DISPATCH_KEEP_PADDING;
        }
        let mut m = mega_args();
        m.dispatch = &a;
        m.weight_dtype = dtype_code(case.dtype);
        m.n = n as i32;
        m.k = hidden as i32;
        m.weights = w1.data.as_ptr() as *const _;
        m.weight_scales = w1.scales.as_ptr();
        m.y = y1.as_mut_ptr() as *mut _;
        let handle = ctx.handle();
        // SAFETY: every pointer holds what the API asks for.
        let status = unsafe { ep_mega_dispatch_gemm(ctx.0, &m, handle.0, null_mut()) };
        assert_eq!(status, EP_SUCCESS, "{what}: {}", last_error());
        let rows = d.expert_rows;
        assert_eq!(ex_off, d.expert_offsets, "{what}: offsets");
        assert_eq!(ex_cnt, d.expert_counts, "{what}: counts");
        let keep = case.keep_padding;
        check_dispatched_rows(dtype, hidden, d, &ex_x, &ex_scales, keep, &what);
        assert_eq!(
            bits(&ex_w[..rows]),
            bits(&d.expert_weights),
            "{what}: weights"
        );
        assert_eq!(ex_src[..rows], d.expert_src_row[..], "{what}: src rows");
        let want_y1 = grouped_gemm(
            &w1.view(),
            GemmRows {
                data: &d.expert_x,
                scales: &d.expert_scales,
            },
            &d.expert_offsets,
            &d.expert_counts,
        );
        let first_y = format!("{what}: y of the first GEMM");
        check_expert_rows(d, &y1, &want_y1, n, keep, &first_y);

        // GEMM + combine of the same layout.
        let (x2, x2_scales) = activations(case, rank, cap);
        let w2 = weights2(case, rank);
        let mut y2 = poisoned::<bf16>(cap * hidden);
        let mut out = poisoned::<bf16>(me.num_tokens * hidden);
        let mut c = combine_args();
        c.input_layout = EP_COMBINE_EXPERT_MAJOR;
        c.x = x2.as_ptr() as *const _;
        // A rank without tokens may pass no output.
        c.out = if me.num_tokens == 0 {
            null_mut()
        } else {
            out.as_mut_ptr() as *mut _
        };
        let mut m = mega_args();
        m.combine = &c;
        m.weight_dtype = dtype_code(case.dtype);
        m.n = hidden as i32;
        m.k = case.k2 as i32;
        m.weights = w2.data.as_ptr() as *const _;
        m.weight_scales = w2.scales.as_ptr();
        m.x_scales = x2_scales.as_ptr();
        m.y = y2.as_mut_ptr() as *mut _;
        if me.num_tokens > 0 {
            // `out` may not overlap `y`: refused before anything is made (a
            // refused call takes no call number, so the ranks stay in step).
            let mut overlapping = c;
            overlapping.out = m.y;
            let mut bad = m;
            bad.combine = &overlapping;
            // SAFETY: as above.
            let status = unsafe { ep_mega_gemm_combine(ctx.0, &bad, handle.0, null_mut()) };
            assert_eq!(status, EP_ERR_INVALID_ARGUMENT, "{what}: {}", last_error());
            assert!(last_error().contains("overlaps `y`"), "{}", last_error());
            assert!(is_poisoned(&y2), "{what}: y written by a refused call");
        }
        // SAFETY: as above.
        let status = unsafe { ep_mega_gemm_combine(ctx.0, &m, handle.0, null_mut()) };
        assert_eq!(status, EP_SUCCESS, "{what}: {}", last_error());
        let want_y2: Vec<Vec<bf16>> = (0..case.world)
            .map(|r| reference_y2(case, &refs[r], r, cap))
            .collect();
        for j in 0..rows {
            let row = &y2[j * hidden..][..hidden];
            if expert_of_row(d, j).is_some() {
                assert!(
                    bf16_to_bytes(row) == bf16_to_bytes(&want_y2[rank][j * hidden..][..hidden]),
                    "{what}: y of the second GEMM, row {j}"
                );
            } else {
                assert!(is_poisoned(row), "{what}: padding row {j} of y was written");
            }
        }
        let want = combine_reference(case.topo(), rank, me.num_tokens, &refs, &want_y2, true);
        assert!(
            bf16_to_bytes(&out) == bf16_to_bytes(&want),
            "{what}: combined tokens"
        );
    });
}

fn case(world: usize, hidden: usize, n: usize, k2: usize, dtype: Dtype, seed: u64) -> MegaCase {
    MegaCase {
        world,
        hidden,
        topk: 4,
        experts: 8,
        n,
        k2,
        dtype,
        routing: Routing::Uniform,
        alignment: 1,
        tokens: vec![17; world],
        seed,
        keep_padding: false,
    }
}

#[test]
fn fused_calls_match_the_reference() {
    let mut seed = 0x3e6a_0000;
    let mut next = || {
        seed += 1;
        seed
    };
    let mut cases = Vec::new();
    for dtype in [Dtype::Bf16, Dtype::Fp8E4m3] {
        for world in [1, 2] {
            // Shapes: hidden, n, k2.
            for (hidden, n, k2) in [(128, 128, 128), (256, 384, 128), (384, 128, 256)] {
                cases.push(case(world, hidden, n, k2, dtype, next()));
            }
            // Token counts 0, 1, 17 across ranks, alignments 1, 16, 128.
            for (tokens, alignment) in [(0, 1), (1, 16), (17, 128)] {
                let mut c = case(world, 256, 256, 256, dtype, next());
                c.tokens = (0..world)
                    .map(|r| if r == 0 { tokens } else { 17 - tokens })
                    .collect();
                c.alignment = alignment;
                cases.push(c);
            }
            // Every row to one expert; topk 1 over 16 experts (most empty).
            let mut c = case(world, 256, 128, 128, dtype, next());
            c.routing = Routing::OneExpert;
            c.alignment = 16;
            cases.push(c);
            // Padding rows kept (EP_DISPATCH_KEEP_PADDING), alignment 16.
            let mut c = case(world, 256, 256, 128, dtype, next());
            c.alignment = 16;
            c.keep_padding = true;
            cases.push(c);
            let mut c = case(world, 128, 256, 128, dtype, next());
            c.topk = 1;
            c.experts = 16;
            cases.push(c);
        }
    }
    for c in &cases {
        run_case(c);
    }
}

#[test]
fn no_tokens_anywhere() {
    for dtype in [Dtype::Bf16, Dtype::Fp8E4m3] {
        let mut c = case(2, 128, 128, 128, dtype, 77);
        c.tokens = vec![0, 0];
        run_case(&c);
    }
}
