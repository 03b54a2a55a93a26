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
// In a token's record (off_in_token) and in the handle's row_src: the token
// went to one rank only, the record's (ep_push_records); set in row_src
// only for a row of this rank's own tokens, which then "stays home" in the
// combine (ep_combine_row_dst). Token indices are far below it
// (MAX_TOKENS_PER_RANK, src/runtime/config.rs).
#define EP_ONE_RANK_BIT (1 << 30)

// ---------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------

// Address `offset` bytes into this mode's area of rank `r`'s buffer.
template <typename T>
__device__ __forceinline__ T* ep_area(const uint64_t* peer_bases, int r, int64_t area,
                                      int64_t offset) {
    return reinterpret_cast<T*>(peer_bases[r] + area + offset);
}

// The work items (rows, tokens) of a move kernel, a warp each: item i goes
// to warp i / grid of block i % grid, so that a small batch spreads over
// every block of the grid instead of filling the first blocks' warps (with
// 256 rows on 132 blocks of 16 warps, 16 blocks took every row and their
// SMs moved all the bytes while the other 116 idled).
//   for (int i = ep_first_item(warp); i < items; i += ep_item_stride()) ...
__device__ __forceinline__ int ep_first_item(int warp) {
    return warp * static_cast<int>(gridDim.x) + static_cast<int>(blockIdx.x);
}

__device__ __forceinline__ int ep_item_stride() {
    return static_cast<int>(gridDim.x) * EP_MOVE_WARPS;
}

// The grid's last block, and the last warp of it: they get the fewest
// work items (ep_first_item), so what a move kernel does besides its items
// (publishing a layout, numbering a call) is done there, where it delays
// the fewest rows.
__device__ __forceinline__ bool ep_last_block() {
    return blockIdx.x == gridDim.x - 1;
}

__device__ __forceinline__ bool ep_last_warp_of_grid() {
    return ep_last_block() && threadIdx.x / 32 == blockDim.x / 32 - 1;
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
// stores, so a remote (NVLink) source is read at full speed. kPlusZero: the
// rows are BF16, copied with every -0 made +0 (ep_bf16x8_plus_zero).
template <int kUnroll = EP_COPY_UNROLL, bool kPlusZero = false>
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
        // After every load is issued, so that they are in flight together.
        if (kPlusZero) {
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                if (base + u * 32 + lane < vectors) {
                    v[u] = ep_bf16x8_plus_zero(v[u]);
                }
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

// A received row's source rank and token (the handle's row_src, written by
// the pull), and whether the token went to its source's rank alone
// (EP_ONE_RANK_BIT, set only where that rank is this one).
struct EpRowSource {
    int source;
    int token;
    bool one_rank;
};

__device__ __forceinline__ EpRowSource ep_row_source(const int* row_src, int row) {
    const int source = row_src[2 * row];
    const int token = row_src[2 * row + 1];
    return {source, token & ~EP_ONE_RANK_BIT, (token & EP_ONE_RANK_BIT) != 0};
}

// The ranks this rank's token `token` went to, bit r for rank r (the
// handle's in_rank row), read by the whole warp at once: one round trip,
// not one per rank.
__device__ __forceinline__ uint64_t ep_token_ranks(const CombineParams& p, int token, int lane) {
    static_assert(EP_MAX_WORLD_SIZE <= 64, "a token's ranks are one 64-bit mask");
    const uint8_t* in_rank = p.handle_in_rank + static_cast<int64_t>(token) * p.world;
    uint64_t ranks = 0;
    for (int first = 0; first < p.world; first += 32) {
        const int r = first + lane;
        const unsigned went = __ballot_sync(0xffffffffu, r < p.world && in_rank[r] != 0);
        ranks |= static_cast<uint64_t>(went) << first;
    }
    return ranks;
}

// Whether a combine may write a token of this rank that went to this rank
// alone straight into `out`: its combine is then the one row this rank
// sends it, not a trip through the returned rows and a sum of one row.
// With one rank every routed token "stays home"; with more, one whose
// experts all live on its own rank. Not where the reduce's rows are not
// the send's (`p.home_tokens` is 0 in the hierarchical mode), nor without
// `out`.
__device__ __forceinline__ bool ep_home_allowed(const CombineParams& p) {
    return p.home_tokens && p.out != nullptr;
}

// Whether the reduce finds this rank's token that went to `ranks`
// (ep_token_ranks) written by the send already.
__device__ __forceinline__ bool ep_stays_home(const CombineParams& p, uint64_t ranks) {
    return ep_home_allowed(p) && ranks == (uint64_t{1} << p.rank);
}

// Where a combine writes received row `row` (`vectors` 16-byte vectors):
// the token's row of `out` when it is one of this rank's tokens that stays
// home (the pull marked it, EP_ONE_RANK_BIT; `*home` is then true), else its
// source rank's returned rows, slot (this rank, token). No load waits for
// another: the mark travels with the row's source.
__device__ __forceinline__ int4* ep_combine_row_dst(const CombineParams& p, int row, int vectors,
                                                    bool* home) {
    const EpRowSource src = ep_row_source(p.handle_row_src, row);
    *home = src.one_rank && ep_home_allowed(p);
    if (*home) {
        return reinterpret_cast<int4*>(p.out) + static_cast<int64_t>(src.token) * vectors;
    }
    return ep_area<int4>(p.peer_bases, src.source, p.normal.area, p.normal.off_returned) +
           (static_cast<int64_t>(p.rank) * p.max_tokens + src.token) * vectors;
}

// dst[v] = BF16 of the sum of the `terms` weighted rows that `term` gives
// (ep_add_weighted_rows), for the vectors v in [first, end) of this lane;
// kPlusZero: with every -0 made +0. Whole warp.
template <int kUnroll, bool kPlusZero, typename Term>
__device__ __forceinline__ void ep_store_weighted_sums(int4* dst, int terms, Term term, int first,
                                                       int end, int lane) {
    for (int base = first + lane; base < end; base += 32 * kUnroll) {
        float acc[kUnroll][8] = {};
        ep_add_weighted_rows(acc, terms, term, base, end);
        ep_store_bf16_vectors<kUnroll, kPlusZero>(dst, acc, base, end);
    }
}

// The expert-major combine of one received row: BF16 of the fp32 sum of
// weight * row over the row's expert-major rows in ascending order (= local
// experts ascending, the reference's summation order), each product
// rounded before it is added, into the row's destination
// (ep_combine_row_dst: the source's returned row, or `out` for a token that
// stays home, then with -0 made +0 as the reduce would); only the 16-byte
// vectors [first, end) of the row (a fused combine sends a row's columns
// band by band). `slot_rows` and `slot_weights` are the warp's scratch of
// EP_MAX_TOPK entries in shared memory. kUnroll: vectors per lane and row
// in flight (ep_add_weighted_rows). Whole warp.
template <int kUnroll = EP_SUM_UNROLL>
__device__ __forceinline__ void ep_combine_send_row(const CombineParams& p, int row,
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
    // Its destination, while those loads are on their way.
    bool home;
    int4* dst = ep_combine_row_dst(p, row, vectors, &home);
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
    // One loop or the other, chosen once per row: a choice per vector
    // costs the sums' loop a few instructions, which shows where the send
    // is bound by them (a few SMs).
    if (home) {
        ep_store_weighted_sums<kUnroll, true>(dst, terms, term, first, end, lane);
    } else {
        ep_store_weighted_sums<kUnroll, false>(dst, terms, term, first, end, lane);
    }
}
