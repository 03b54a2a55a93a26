// ep_moe_forward's activation: SwiGLU between the experts' two GEMMs.
//
// ep_moe_forward = the fused dispatch + gate/up GEMM (kernels/mega.cu, mode
// dispatch: routing kernels, the fused kernel), THIS kernel, then the fused
// down GEMM + combine (kernels/mega.cu, mode combine, and the normal
// combine's barrier and reduce), all on the caller's stream,
// without a host synchronisation (capturable in a CUDA graph). The
// semantics are src/reference/moe.rs, bit for bit given the same y1.
//
// What it does: for every REAL expert-major row j (rows [offset[e],
// offset[e] + count[e]) of local expert e, the layout the dispatch of the
// same call wrote into the handle), with y1[j] = (gate | up), 2I BF16
// values:
//     a[c] = silu(gate[c]) * up[c],  silu(g) = g / (1 + e^-g),  c < I,
// in fp32, each operation one correctly rounded fp32 operation (__fmul_rn,
// __fadd_rn, __fdiv_rn, __fmaf_rn: nvcc would otherwise contract a
// multiply and an add into one fma), and e^x by the reference's fixed
// sequence (ep_moe_exp), never expf, whose last bit is the math library's.
// BF16: act[j][c] = a[c] rounded to BF16 (nearest, ties to even). FP8: each
// 128 columns quantized from the fp32 values by the low-latency mode's rule
// (src/reference/fp8.rs, quantize_f32_row): amax = max(max |a|, 1e-4),
// scale = amax / 448, code = e4m3(a * (448 / amax)), saturating.
// Padding rows (between experts, and after the last expert's segment) are
// left as they were; so are the scales of padding rows.
//
// Work split: one warp per row, warp w of the grid's W takes rows w, w + W,
// w + 2W, ... below offset[L] and skips the padding ones; each lane moves
// 8 channels (one 16-byte vector of gate and one of up) per pass, so 16
// lanes cover one 128-column scale block and the block's maximum is a
// shuffle reduction among them. No block waits for anything: the kernel
// needs no residency guarantee and polls no flag.
//
// Errors, as every kernel (kernels/include/ep_device.cuh): nothing traps.
// After a failed barrier of the dispatch (recorded by the barrier kernel)
// the layout may be stale: the kernel then writes nothing. A layout that
// cannot come from a dispatch (offsets out of order, counts beyond their
// segments, more rows than the buffers hold) is recorded as
// EP_STATUS_INVALID_ARGUMENT (phase EP_PHASE_MOE_ACTIVATION) and nothing is
// written.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "ep_device.cuh"

// Warps of a block (EP_MOE_THREADS, ep_abi.h).
#define EP_MOE_WARPS (EP_MOE_THREADS / 32)
// BF16 channels of a 16-byte vector: what a lane moves at once.
#define EP_MOE_VECTOR 8
// Lanes whose vectors make one FP8 scale block (128 channels).
#define EP_MOE_BLOCK_LANES (EP_HIDDEN_ALIGNMENT / EP_MOE_VECTOR)

// src/reference/moe.rs, exp: the constants as bits (so no compiler rounds
// a decimal literal), and the range outside which e^x is +inf or 0.
#define EP_MOE_LOG2_E 0x3fb8aa3b
#define EP_MOE_LN2_HI 0x3f317200
#define EP_MOE_LN2_LO 0x35bfbe8e
#define EP_MOE_EXP_HIGHEST 88.0f
#define EP_MOE_EXP_LOWEST (-87.0f)
// 1 / k! for k = 7 down to 2.
__constant__ const unsigned kExpPoly[6] = {0x39500d01u, 0x3ab60b61u, 0x3c088889u,
                                           0x3d2aaaabu, 0x3e2aaaabu, 0x3f000000u};

// The handle's layout, as every block reads it.
struct MoeLayout {
    int offset[EP_MAX_EXPERTS + 1];  // segment starts; [L] = end
    int count[EP_MAX_EXPERTS];       // real rows
    int usable;                      // routed and sane: rows may be written
};

// ---------------------------------------------------------------------------
// SwiGLU, as src/reference/moe.rs computes it
// ---------------------------------------------------------------------------

// e^x: n = rint(x log2 e), r = x - n ln 2 (two fmas), a degree-7 Horner
// polynomial (fmas), times 2^n built from bits. See src/reference/moe.rs.
__device__ __forceinline__ float ep_moe_exp(float x) {
    if (isnan(x)) {
        return x;
    }
    if (x > EP_MOE_EXP_HIGHEST) {
        return __int_as_float(0x7f800000);  // +inf
    }
    if (x < EP_MOE_EXP_LOWEST) {
        return 0.0f;
    }
    const float n = rintf(__fmul_rn(x, __int_as_float(EP_MOE_LOG2_E)));
    float r = __fmaf_rn(-n, __int_as_float(EP_MOE_LN2_HI), x);
    r = __fmaf_rn(-n, __int_as_float(EP_MOE_LN2_LO), r);
    float poly = __int_as_float(kExpPoly[0]);
#pragma unroll
    for (int i = 1; i < 6; ++i) {
        poly = __fmaf_rn(poly, r, __int_as_float(kExpPoly[i]));
    }
    poly = __fmaf_rn(poly, r, 1.0f);
    poly = __fmaf_rn(poly, r, 1.0f);
    // n is in [-126, 127]: 2^n is a normal float.
    return __fmul_rn(poly, __int_as_float((static_cast<int>(n) + 127) << 23));
}

// silu(gate) * up: g / (1 + e^-g), then the product, each rounded once.
__device__ __forceinline__ float ep_moe_swiglu(float gate, float up) {
    const float silu = __fdiv_rn(gate, __fadd_rn(1.0f, ep_moe_exp(-gate)));
    return __fmul_rn(silu, up);
}

// The 8 activations of one lane's vectors of gate and up.
__device__ __forceinline__ void ep_moe_swiglu8(const int4& gate, const int4& up, float (&a)[8]) {
    float g[8], u[8];
    ep_unpack_bf16x8(gate, g);
    ep_unpack_bf16x8(up, u);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        a[i] = ep_moe_swiglu(g[i], u[i]);
    }
}

// ---------------------------------------------------------------------------
// Rows
// ---------------------------------------------------------------------------

// Row j, BF16 out: each lane its vectors v = lane, lane + 32, ...
__device__ __forceinline__ void ep_moe_row_bf16(const MoeParams& p, int64_t j, int lane) {
    const int vectors = p.intermediate / EP_MOE_VECTOR;
    const int4* gate = reinterpret_cast<const int4*>(p.y1) + j * 2 * vectors;
    const int4* up = gate + vectors;
    int4* out = reinterpret_cast<int4*>(p.act) + j * vectors;
    for (int v = lane; v < vectors; v += 32) {
        float a[8];
        ep_moe_swiglu8(__ldg(gate + v), __ldg(up + v), a);
        out[v] = ep_pack_bf16x8(a);
    }
}

// Row j, FP8 out. Every lane runs every pass (the scale block's maximum is
// a shuffle among 16 lanes); `vectors` is a multiple of 16, so the 16
// lanes of a block all have data or none has.
__device__ __forceinline__ void ep_moe_row_fp8(const MoeParams& p, int64_t j, int lane) {
    const int vectors = p.intermediate / EP_MOE_VECTOR;
    const int4* gate = reinterpret_cast<const int4*>(p.y1) + j * 2 * vectors;
    const int4* up = gate + vectors;
    uint2* out = reinterpret_cast<uint2*>(p.act + j * p.intermediate);
    float* scales = p.act_scales + j * (p.intermediate / EP_HIDDEN_ALIGNMENT);
    for (int base = 0; base < vectors; base += 32) {
        const int v = base + lane;
        const bool mine = v < vectors;
        float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (mine) {
            ep_moe_swiglu8(__ldg(gate + v), __ldg(up + v), a);
        }
        // fmaxf ignores a NaN operand, as the reference's f32::max does;
        // the maximum does not depend on the order.
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            amax = fmaxf(amax, fabsf(a[i]));
        }
#pragma unroll
        for (int offset = EP_MOE_BLOCK_LANES / 2; offset > 0; offset /= 2) {
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
        }
        amax = fmaxf(amax, EP_AMAX_FLOOR);
        const float multiplier = __fdiv_rn(EP_E4M3_MAX, amax);
        if (!mine) {
            continue;
        }
        uint8_t codes[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            codes[i] = __nv_cvt_float_to_fp8(__fmul_rn(a[i], multiplier), __NV_SATFINITE, __NV_E4M3);
        }
        out[v] = *reinterpret_cast<const uint2*>(codes);
        if (v % EP_MOE_BLOCK_LANES == 0) {
            scales[v / EP_MOE_BLOCK_LANES] = __fdiv_rn(amax, EP_E4M3_MAX);
        }
    }
}

// ---------------------------------------------------------------------------
// Layout
// ---------------------------------------------------------------------------

// Loads the handle's layout into shared memory and sets `usable`. Whole
// block. See the file comment for what is refused.
__device__ __forceinline__ void ep_moe_load_layout(const MoeParams& p, MoeLayout& l) {
    const int experts = p.local_experts;
    ep_load_expert_layout(p.expert_layout, experts, l.offset, l.count);
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        bool sane = l.offset[0] == 0 && l.offset[experts] <= p.rows;
        for (int e = lane; e < experts; e += 32) {
            sane = sane && ep_expert_rows_fit(l.offset, l.count, e);
        }
        sane = __all_sync(0xffffffffu, sane);
        if (lane == 0) {
            const bool routed = ep_last_barrier_passed(p.own_base);
            if (routed && !sane && blockIdx.x == 0) {
                ep_record_error(p.status, EP_STATUS_INVALID_ARGUMENT, -1, EP_PHASE_MOE_ACTIVATION,
                                0);
            }
            l.usable = routed && sane;
        }
    }
    __syncthreads();
}

// The local expert whose segment holds row j (< offset[L]): the last one
// whose segment starts at or before j (empty experts share their
// successor's start).
__device__ __forceinline__ int ep_moe_expert_of_row(const MoeLayout& l, int experts, int j) {
    return ep_segment_of(l.offset, experts, j);
}

// grid: any number of blocks (the host gives EP_MOE_BLOCKS_PER_SM per SM of
// the call's budget), EP_MOE_THREADS threads, no dynamic shared memory.
extern "C" __global__ void __launch_bounds__(EP_MOE_THREADS)
    ep_moe_activation_kernel(const __grid_constant__ MoeParams p) {
    ep_kernel_start();
    __shared__ MoeLayout l;
    ep_moe_load_layout(p, l);
    if (!l.usable) {
        return;
    }
    const int lane = threadIdx.x % 32;
    const int warps = gridDim.x * EP_MOE_WARPS;
    const int rows = l.offset[p.local_experts];
    for (int j = blockIdx.x * EP_MOE_WARPS + threadIdx.x / 32; j < rows; j += warps) {
        const int e = ep_moe_expert_of_row(l, p.local_experts, j);
        if (j - l.offset[e] >= l.count[e]) {
            continue;  // padding: left as it was
        }
        if (p.fp8) {
            ep_moe_row_fp8(p, j, lane);
        } else {
            ep_moe_row_bf16(p, j, lane);
        }
    }
}
