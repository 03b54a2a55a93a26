// Shared by the normal-mode kernels (kernels/normal.cu) and the fused
// kernels (kernels/mega.cu): the row movement and the expert-major combine's
// send of one row (its vector sums are ep_device.cuh's).
// The protocol is described in kernels/normal.cu.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "ep_device.cuh"

// The kernels' parameters, DispatchParams and CombineParams, and the shared
// constants (EP_CHUNK_TOKENS, EP_MOVE_THREADS, EP_MAX_TOPK, ...) are defined
// in src/abi/defs.rs and reach this file through ep_abi.h.

// Warps of a count kernel's block: one per 32 of its EP_CHUNK_TOKENS tokens.
#define EP_CHUNK_WARPS (EP_CHUNK_TOKENS / 32)
// Warps of the pull, send and reduce kernels (EP_MOVE_THREADS threads).
#define EP_MOVE_WARPS (EP_MOVE_THREADS / 32)
// 16-byte vectors each lane has in flight when copying a row.
#define EP_COPY_UNROLL 8
// The same for the dispatch's pull, whose rows are latency-bound at small
// batches (a warp per row): a 7168-wide BF16 row (896 vectors) in two
// rounds of loads instead of four. The pull has the registers for it (64
// of the 128 a thread may use at EP_MOVE_THREADS); the send kernel (122)
// and the fused kernel do not.
#define EP_PULL_COPY_UNROLL 16

// ---------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------

// Address `offset` bytes into this mode's area of rank `r`'s buffer.
template <typename T>
__device__ __forceinline__ T* ep_area(const uint64_t* peer_bases, int r, int64_t area,
                                      int64_t offset) {
    return reinterpret_cast<T*>(peer_bases[r] + area + offset);
}

// Row loops over rows ordered by source rank (a dispatch's received rows,
// which the pull reads from their sources; a combine's rows, which the send
// writes back to them): work item `i` takes row ep_spread_row(i) (-1: none)
// for i below ep_spread_items. The rows are cut into `world` stripes of
// equal length and item i takes row i / world of stripe (i + rank) % world,
// so the warps running at once move rows of every source rather than of
// one source after the other. In source order every rank pulled from (or
// sent to) the same peer at the same time, whose NVLink port then carried
// the traffic of all ranks: with 4 ranks on 4 x H200 a dispatch moved 150
// GB/s into each GPU, where SM copies in an all-to-all reach 320 GB/s
// (bench/p2p_bandwidth.cu, bench/RESULTS.md). With one rank it is the
// identity.
__device__ __forceinline__ int ep_spread_items(int rows, int world) {
    return (rows + world - 1) / world * world;
}

__device__ __forceinline__ int ep_spread_row(int i, int rows, int world, int rank) {
    const int stripe = (rows + world - 1) / world;
    const int row = (i + rank) % world * stripe + i / world;
    return row < rows ? row : -1;
}

// Where the pull reads a received token (row and FP8 scales): a peer's
// token from the peer's staging area, one of this rank's own tokens from the
// caller's `x` itself (with one rank nothing is staged).
__device__ __forceinline__ const uint8_t* ep_token_row(const DispatchParams& p, int source,
                                                       int token) {
    const uint8_t* rows = source == p.rank
                              ? reinterpret_cast<const uint8_t*>(p.x)
                              : ep_area<uint8_t>(p.peer_bases, source, p.normal.area,
                                                 p.normal.off_staged_x);
    return rows + static_cast<int64_t>(token) * p.row_bytes;
}

__device__ __forceinline__ const float* ep_token_scales(const DispatchParams& p, int source,
                                                        int token) {
    const float* scales = source == p.rank
                              ? p.x_scales
                              : ep_area<float>(p.peer_bases, source, p.normal.area,
                                               p.normal.off_staged_scales);
    return scales + static_cast<int64_t>(token) * p.scale_cols;
}

// Copies `bytes` (a multiple of 16) from `src` to `dst` (unless nullptr)
// and to the rows `extra_rows[0..num_extra)` of `extra_base`, with the
// whole warp: every lane keeps kUnroll 16-byte loads in flight before it
// stores, so a remote (NVLink) source is read at full speed.
template <int kUnroll = EP_COPY_UNROLL>
__device__ __forceinline__ void ep_warp_copy_row(const uint8_t* src, uint8_t* dst,
                                                 uint8_t* extra_base, const int* extra_rows,
                                                 int num_extra, int bytes, int lane) {
    const int4* s = reinterpret_cast<const int4*>(src);
    const int vectors = bytes / 16;
    for (int base = 0; base < vectors; base += 32 * kUnroll) {
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int i = base + u * 32 + lane;
            if (i < vectors) {
                v[u] = s[i];
            }
        }
        if (dst != nullptr) {
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
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
            for (int u = 0; u < kUnroll; ++u) {
                const int i = base + u * 32 + lane;
                if (i < vectors) {
                    row[i] = v[u];
                }
            }
        }
    }
}

// Where a combine returns received row `row` (`vectors` 16-byte vectors):
// its source rank's returned rows, slot (this rank, token).
__device__ __forceinline__ int4* ep_returned_row(const CombineParams& p, int row, int vectors) {
    const int source = p.handle_row_src[2 * row];
    const int token = p.handle_row_src[2 * row + 1];
    return ep_area<int4>(p.peer_bases, source, p.normal.area, p.normal.off_returned) +
           (static_cast<int64_t>(p.rank) * p.max_tokens + token) * vectors;
}

// The expert-major combine of one received row: dst = BF16 of the fp32 sum
// of weight * row over the row's expert-major rows in ascending order (=
// local experts ascending, the reference's summation order), each product
// rounded before it is added; only the 16-byte vectors [first, end) of the
// row (a fused combine sends a row's columns band by band). `slot_rows`
// and `slot_weights` are the warp's scratch of EP_MAX_TOPK entries in
// shared memory. kUnroll: vectors per lane and row in flight
// (ep_add_weighted_rows). Whole warp.
template <int kUnroll = EP_SUM_UNROLL>
__device__ __forceinline__ void ep_combine_send_row(const CombineParams& p, int row, int4* dst,
                                                    int* slot_rows, float* slot_weights,
                                                    int first, int end, int lane) {
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
    const auto term = [&](int i, const int4*& row, float& w) {
        row = x + static_cast<int64_t>(slot_rows[i]) * vectors;
        w = slot_weights[i];
        return true;
    };
    for (int base = first + lane; base < end; base += 32 * kUnroll) {
        float acc[kUnroll][8] = {};
        ep_add_weighted_rows(acc, terms, term, base, end);
        ep_store_bf16_vectors(dst, acc, base, end);
    }
}
