// Shared by the normal-mode kernels (kernels/normal.cu) and the fused
// kernels (kernels/mega.cu): the launch parameters of the dispatch and the
// combine, and the row movement and reduction helpers both use. The protocol
// is described in kernels/normal.cu.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "ep_device.cuh"

// Tokens per chunk of the count kernel: one block of 8 warps, a warp per 32.
#define EP_CHUNK_TOKENS 256
#define EP_CHUNK_WARPS (EP_CHUNK_TOKENS / 32)
#define EP_MAX_TOPK 16
#define EP_MAX_WORLD 64
#define EP_MAX_EXPERTS 1024
// Threads of the pull, send and reduce kernels.
#define EP_MOVE_THREADS 512
#define EP_MOVE_WARPS (EP_MOVE_THREADS / 32)
// 16-byte vectors each lane has in flight when copying a row.
#define EP_COPY_UNROLL 8
// 16-byte vectors (8 channels each) each lane sums at once in a combine.
#define EP_SUM_UNROLL 4

// Mirrors `DispatchParams` in src/runtime/gpu/normal.rs (same order, same
// types; pointers are 64-bit, then 64-bit integers, then 32-bit ones).
struct DispatchParams {
    // The caller's inputs.
    const uint8_t* x;
    const float* x_scales;
    const int* topk_idx;
    const float* topk_weights;
    // Symmetric memory: [world] base addresses of every rank's buffer as
    // mapped here, and where this mode's arrays sit inside each buffer.
    const uint64_t* peer_bases;
    // Source-order outputs; recv_x == nullptr when not requested.
    uint8_t* recv_x;
    float* recv_scales;
    int* recv_topk_idx;
    float* recv_topk_weights;
    int* recv_src_info;
    int* recv_num_rows;
    // Expert-major outputs; expert_x == nullptr when not requested.
    uint8_t* expert_x;
    float* expert_scales;
    float* expert_weights;
    int* expert_src_row;
    int* expert_offsets;
    int* expert_counts;
    // The handle: what the combine needs.
    int* handle_row_src;         // [rows, 2] (source rank, token)
    int* handle_row_expert_pos;  // [rows, topk] expert-major row or -1
    float* handle_row_weights;   // [rows, topk] weight or 0
    int* handle_num_rows;        // [1]
    uint8_t* handle_in_rank;     // [max_tokens, world] this rank's tokens
    // [2 * local_experts + 1]: the expert-major segment starts (local_experts
    // + 1, the last one the end), then the real rows of each local expert.
    int* handle_expert_layout;
    // Host-mapped [1 + local_experts]: rows, then rows per local expert.
    int* host_counts;
    EpDeviceStatus* status;
    int64_t area;               // offset of this mode's area in every buffer
    int64_t off_staged_x;       // [max_tokens, row_bytes]
    int64_t off_staged_scales;  // [max_tokens, scale_cols]
    int64_t off_slot_rank;      // [max_tokens, topk] position in its expert
    int64_t off_rank_pos;       // [max_tokens, world] position or -1
    int64_t off_chunk_counts;   // [chunks, world + experts]
    int64_t off_totals;         // [world + experts]
    // Records pushed by the sources, [source, max_tokens] rows:
    int64_t off_in_token;       // [world, max_tokens] token index
    int64_t off_in_local;       // [world, max_tokens, topk] local expert or -1
    int64_t off_in_rank;        // [world, max_tokens, topk] position in the expert
    int64_t off_in_weight;      // [world, max_tokens, topk] weight or 0
    int64_t recv_capacity;
    int64_t expert_capacity;
    int num_tokens;
    int rank;
    int world;
    int num_experts;
    int topk;
    int row_bytes;   // bytes of one token row (hidden * element size)
    int scale_cols;  // fp32 scales per row (0 for BF16)
    int max_tokens;
    int alignment;   // expert-major segment alignment in rows
    // Non-zero: the pull writes every expert-major output except the rows
    // and their scales (the fused kernel of kernels/mega.cu moves them).
    int skip_expert_rows;
};

// Mirrors `CombineParams` in src/runtime/gpu/normal.rs.
struct CombineParams {
    const __nv_bfloat16* x;  // the caller's rows (source order or expert-major)
    __nv_bfloat16* out;      // [num_tokens, hidden]
    const uint64_t* peer_bases;
    const int* handle_row_src;
    const int* handle_row_expert_pos;
    const float* handle_row_weights;
    const int* handle_num_rows;
    const uint8_t* handle_in_rank;
    EpDeviceStatus* status;
    int64_t area;
    int64_t off_returned;  // [world, max_tokens, hidden] BF16 rows sent back
    int num_tokens;        // this rank's tokens of the handle's dispatch
    int expert_major;
    int rank;
    int world;
    int topk;
    int hidden;
    int max_tokens;
    int pad;
};


// ---------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------

// Address `offset` bytes into this mode's area of rank `r`'s buffer.
template <typename T>
__device__ __forceinline__ T* ep_area(const uint64_t* peer_bases, int r, int64_t area,
                                      int64_t offset) {
    return reinterpret_cast<T*>(peer_bases[r] + area + offset);
}

// Copies `bytes` (a multiple of 16) from `src` to `dst` (unless nullptr)
// and to the rows `extra_rows[0..num_extra)` of `extra_base`, with the
// whole warp: every lane keeps EP_COPY_UNROLL 16-byte loads in flight before
// it stores, so a remote (NVLink) source is read at full speed.
__device__ __forceinline__ void ep_warp_copy_row(const uint8_t* src, uint8_t* dst,
                                                 uint8_t* extra_base, const int* extra_rows,
                                                 int num_extra, int bytes, int lane) {
    const int4* s = reinterpret_cast<const int4*>(src);
    const int vectors = bytes / 16;
    for (int base = 0; base < vectors; base += 32 * EP_COPY_UNROLL) {
        int4 v[EP_COPY_UNROLL];
#pragma unroll
        for (int u = 0; u < EP_COPY_UNROLL; ++u) {
            const int i = base + u * 32 + lane;
            if (i < vectors) {
                v[u] = s[i];
            }
        }
        if (dst != nullptr) {
#pragma unroll
            for (int u = 0; u < EP_COPY_UNROLL; ++u) {
                const int i = base + u * 32 + lane;
                if (i < vectors) {
                    reinterpret_cast<int4*>(dst)[i] = v[u];
                }
            }
        }
        for (int e = 0; e < num_extra; ++e) {
            int4* row =
                reinterpret_cast<int4*>(extra_base + static_cast<int64_t>(extra_rows[e]) * bytes);
#pragma unroll
            for (int u = 0; u < EP_COPY_UNROLL; ++u) {
                const int i = base + u * 32 + lane;
                if (i < vectors) {
                    row[i] = v[u];
                }
            }
        }
    }
}

// acc[u] += w * row[base + 32 u] for the EP_SUM_UNROLL vectors of one lane,
// in fp32, each product rounded before it is added (the reference's order;
// with w = 1 the product is exact, so plain sums use this too).
__device__ __forceinline__ void ep_add_weighted_vectors(float (&acc)[EP_SUM_UNROLL][8],
                                                        const int4* row, float w, int base,
                                                        int vectors) {
    int4 raw[EP_SUM_UNROLL];
#pragma unroll
    for (int u = 0; u < EP_SUM_UNROLL; ++u) {
        if (base + u * 32 < vectors) {
            raw[u] = row[base + u * 32];
        }
    }
#pragma unroll
    for (int u = 0; u < EP_SUM_UNROLL; ++u) {
        float f[8];
        ep_unpack_bf16x8(raw[u], f);
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            acc[u][c] = __fadd_rn(acc[u][c], __fmul_rn(w, f[c]));
        }
    }
}

// row[base + 32 u] = BF16 of acc[u], for the vectors of one lane.
__device__ __forceinline__ void ep_store_bf16_vectors(int4* row, const float (&acc)[EP_SUM_UNROLL][8],
                                                      int base, int vectors) {
#pragma unroll
    for (int u = 0; u < EP_SUM_UNROLL; ++u) {
        if (base + u * 32 < vectors) {
            row[base + u * 32] = ep_pack_bf16x8(acc[u]);
        }
    }
}

// The expert-major combine of one received row: dst = BF16 of the fp32 sum
// of weight * row over the row's expert-major rows in ascending order (=
// local experts ascending, the reference's summation order), each product
// rounded before it is added. `slot_rows` and `slot_weights` are the warp's
// scratch of EP_MAX_TOPK entries in shared memory. Whole warp.
__device__ __forceinline__ void ep_combine_send_row(const CombineParams& p, int row, int4* dst,
                                                    int* slot_rows, float* slot_weights,
                                                    int lane) {
    const int vectors = p.hidden / 8;
    const int4* x = reinterpret_cast<const int4*>(p.x);
    // The row's expert rows in ascending order (= local experts
    // ascending, the reference's summation order).
    int pos = -1;
    float weight = 0.0f;
    if (lane < p.topk) {
        pos = p.handle_row_expert_pos[static_cast<int64_t>(row) * p.topk + lane];
        weight = p.handle_row_weights[static_cast<int64_t>(row) * p.topk + lane];
    }
    const unsigned valid = __ballot_sync(0xffffffffu, pos >= 0);
    if (pos >= 0) {
        int order = 0;
        for (int k = 0; k < p.topk; ++k) {
            const int other = __shfl_sync(valid, pos, k);
            order += ((valid >> k) & 1) && other < pos;
        }
        slot_rows[order] = pos;
        slot_weights[order] = weight;
    }
    __syncwarp();
    const int terms = __popc(valid);
    for (int base = lane; base < vectors; base += 32 * EP_SUM_UNROLL) {
        float acc[EP_SUM_UNROLL][8] = {};
        for (int i = 0; i < terms; ++i) {
            ep_add_weighted_vectors(acc, x + static_cast<int64_t>(slot_rows[i]) * vectors,
                                    slot_weights[i], base, vectors);
        }
        ep_store_bf16_vectors(dst, acc, base, vectors);
    }
}
