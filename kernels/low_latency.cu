// Low-latency (LL) mode: dispatch and combine of a few hundred decode tokens
// over NVLink, one kernel launch per call, no host synchronisation, safe to
// capture in a CUDA graph. The semantics are src/reference/low_latency.rs
// (and src/reference/fp8.rs for the quantization), bit for bit.
//
// Notation: W = world, M = ll_max_tokens_per_rank, K = topk, L = local
// experts, H = hidden, J = K + W (return rows per token, see below).
//
// ---------------------------------------------------------------------------
// Buffer layout (byte offsets computed in src/runtime/gpu/low_latency.rs,
// identical on every rank, the area zeroed when the context is created)
// ---------------------------------------------------------------------------
// Written by peers (the sets alternate between calls: set = seq & 1):
//   dispatch_flags  [2][W] int    source s announces call `seq` here
//   dispatch_counts [2][W] int    ...and how many tokens it has (0..M)
//   dispatch_tags   [2][W][M] int token t of source s has arrived (= seq)
//   dispatch_msgs   [2][W][M] messages, `msg_bytes` each:
//       int   local[16]   per slot: the local expert of THIS rank, or -1
//       float weight[16]  per slot: the routing weight (0 without weights)
//       data              FP8: H codes then H/128 fp32 scales; BF16: 2H bytes
//   dispatch_acks   [W] int       rank d has finished receiving its dispatch
//                                 call `value` (rank d writes slot [d])
//   combine_tags    [2][M][J] int return row j of token t has arrived
//   combine_rows    [2][M][J][H] BF16 return rows: j < K is the expert row
//                                 of slot j (weights at combine); j = K + r
//                                 is expert rank r's partial sum (weights
//                                 at dispatch). Disjoint indices, so ranks
//                                 that disagree on the mode time out instead
//                                 of mixing rows.
//   combine_acks    [W] int       rank d has finished receiving its combine
//                                 call `value`
// Used by this rank only:
//   counters        LlCounters    sequence numbers and grid arrival counts
//   scan_origin     [L][W][M] int dispatch scratch: (token | slot << 16) of
//                                 the n-th row of (local expert, source)
//   dispatch_tokens [W] int       tokens each source sent in the last dispatch
//   token_rows      [W][M][K] int masked-layout row of each received (source,
//                                 token, slot), or -1: what the combine sends
//   token_weights   [W][M][K] f32 the weight of that row
//   combine_buffer  [L][W*M][H]   BF16, for EP_LL_ZERO_COPY (only the caller
//                                 writes it)
//
// ---------------------------------------------------------------------------
// Dispatch, call number `seq` (seq = counters.dispatch_seq + 1 when the send
// phase runs; a receive-only launch uses the current value)
// ---------------------------------------------------------------------------
// Send (every block):
//   1. wait until dispatch_acks[d] >= seq - 2 for every rank d: d has read
//      everything of the set we are about to overwrite (call seq - 2 used it);
//   2. block 0: for every rank d, store count = num_tokens into d's
//      dispatch_counts[set][rank], then RELEASE-store seq into
//      dispatch_flags[set][rank] (same thread: the release orders the count);
//   3. per token t (a block per token): write the message header into slot
//      [set][rank][t] of EVERY rank (local experts of that rank or -1), and
//      the quantized row (or BF16 copy) into the ranks that hold at least one
//      of its experts: a token crosses NVLink once per destination rank, not
//      once per expert. Then __syncthreads, and thread d RELEASE-stores seq
//      into rank d's dispatch_tags[set][rank][t] (a release is cumulative:
//      it publishes the other threads' stores the barrier ordered before it).
// Receive (a block per local expert le):
//   4. warp per source s: ACQUIRE-wait dispatch_flags[set][s] >= seq, read
//      the count n; each lane ACQUIRE-waits the tag of its token, reads the
//      header and, with a ballot, gives each token routed to le its position
//      among source s's tokens for le (earlier tokens first, as the
//      reference). Data acquired by one lane is read by other warps after a
//      __syncthreads, which orders it at block scope.
//   5. prefix over sources -> recv_layout_range / recv_count; copy each row
//      (codes, scales, src_info) from the message into the caller's arrays
//      and note (row, weight) in token_rows / token_weights for the combine.
// Finish (every launch): each block fences and bumps an arrival counter; the
// last block to arrive resets it, stores seq into counters.dispatch_seq when
// the send phase ran (every block has read the old value by then: it read it
// before arriving), and when the receive phase ran RELEASE-stores seq into
// dispatch_acks[rank] of every rank (step 1 of their call seq + 2).
//
// Combine mirrors it: the expert side waits combine_acks >= seq - 2, sends
// for each (source, token) of the last dispatch either its rows (j = slot)
// or one partial row sum_{local experts ascending} w * y rounded to BF16
// (j = K + rank), fences, and RELEASE-stores the tags; the source side
// ACQUIRE-waits the tags of the rows its routing expects and sums them in
// fp32 (slots ascending, or expert ranks ascending), products rounded before
// they are added (__fmul_rn / __fadd_rn, never an FMA), as the reference.
//
// In flight: a rank may run the send phase of call seq while a peer still
// receives call seq - 1 (the other set); it waits for the peer to finish
// seq - 2. Nothing is ever reset, values only grow, so a late reader sees a
// stale value as "not yet" (ep_reached). A rank that stops calling makes its
// peers time out (EP_STATUS_TIMEOUT), never read a half-written set.
//
// Co-residency: the grid has one block per SM, so every block runs at once
// and a block that waits (step 4) never waits for one that has not started.
// Waits are bounded all the same (ep_wait_until_ge); kernels never trap.
//
// Expert ids: an id outside [0, E) other than -1, or one repeated within a
// token, counts as -1 everywhere and the dispatch reports
// EP_STATUS_INVALID_EXPERT (the reference rejects such routing).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "ep_device.cuh"

// Threads of both kernels' blocks (src/runtime/gpu/low_latency.rs).
#define EP_LL_THREADS 512
#define EP_LL_WARPS (EP_LL_THREADS / 32)
#define EP_LL_MAX_TOPK 16
#define EP_LL_MAX_WORLD 64
// Message header: int local[16] then float weight[16].
#define EP_LL_HEADER_BYTES 128
// 16-byte vectors each thread loads before it stores, per pass of a copy.
#define EP_LL_COPY_UNROLL 4
// 16-byte vectors (8 channels) per lane in one pass of a combine sum.
#define EP_LL_SUM_VECS 4
// src/reference/fp8.rs: AMAX_FLOOR and E4M3_MAX.
#define EP_LL_AMAX_FLOOR 1e-4f
#define EP_LL_E4M3_MAX 448.0f

// Mirrors `LlParams` in src/runtime/gpu/low_latency.rs field by field.
struct LlParams {
    // Dispatch: the BF16 tokens [num_tokens, H]. Combine: the expert rows
    // [L, W * M, H] (the caller's, or the combine buffer).
    const __nv_bfloat16* x;
    const int* topk_idx;       // [num_tokens, K]
    const float* topk_weights; // [num_tokens, K] or nullptr
    // Dispatch outputs.
    uint8_t* recv_x;
    float* recv_scales;
    int* recv_count;
    int* recv_src_info;
    int* recv_layout_range;
    // Combine output [num_tokens, H].
    __nv_bfloat16* out;
    const uint64_t* peer_bases;  // [W] every rank's buffer, mapped here
    EpDeviceStatus* status;
    const int* abort_flag;
    uint64_t timeout_ns;
    int64_t area;  // offset of this mode's area in every buffer
    int64_t off_counters;
    int64_t off_dispatch_flags;
    int64_t off_dispatch_counts;
    int64_t off_dispatch_tags;
    int64_t off_dispatch_msgs;
    int64_t off_dispatch_acks;
    int64_t off_combine_tags;
    int64_t off_combine_rows;
    int64_t off_combine_acks;
    int64_t off_scan_origin;
    int64_t off_dispatch_tokens;
    int64_t off_token_rows;
    int64_t off_token_weights;
    int64_t msg_bytes;
    int num_tokens;
    int rank;
    int world;
    int num_experts;
    int topk;
    int hidden;
    int max_tokens;
    int fp8;       // dispatch: quantize to E4M3 (else BF16 rows)
    int ue8m0;     // dispatch: power-of-two scales
    int weighted;  // combine: topk_weights given (else weights at dispatch)
    int do_send;
    int do_recv;
};

// Sequence numbers and arrival counters, this rank only.
struct LlCounters {
    int dispatch_seq;       // calls whose send phase has run
    int combine_seq;
    int dispatch_arrivals;  // blocks of the running launch that finished
    int combine_arrivals;
};

namespace {

// ---------------------------------------------------------------------------
// Addresses
// ---------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ T* ll_at(const LlParams& p, int rank, int64_t offset) {
    return reinterpret_cast<T*>(p.peer_bases[rank] + p.area + offset);
}

__device__ __forceinline__ int local_experts(const LlParams& p) {
    return p.num_experts / p.world;
}

__device__ __forceinline__ LlCounters* counters(const LlParams& p) {
    return ll_at<LlCounters>(p, p.rank, p.off_counters);
}

// Message slot [set][source][token] in `rank`'s buffer.
__device__ __forceinline__ uint8_t* dispatch_msg(const LlParams& p, int rank, int set, int source,
                                                 int token) {
    const int64_t slot = (static_cast<int64_t>(set) * p.world + source) * p.max_tokens + token;
    return ll_at<uint8_t>(p, rank, p.off_dispatch_msgs) + slot * p.msg_bytes;
}

__device__ __forceinline__ int* dispatch_tag(const LlParams& p, int rank, int set, int source,
                                             int token) {
    return ll_at<int>(p, rank, p.off_dispatch_tags) +
           (static_cast<int64_t>(set) * p.world + source) * p.max_tokens + token;
}

__device__ __forceinline__ int combine_rows_per_token(const LlParams& p) {
    return p.topk + p.world;
}

// Index of return row j of token t in set `set`: for combine_tags and,
// times H, combine_rows.
__device__ __forceinline__ int64_t combine_slot(const LlParams& p, int set, int token, int j) {
    return (static_cast<int64_t>(set) * p.max_tokens + token) * combine_rows_per_token(p) + j;
}

// (source, token, slot) entry of token_rows / token_weights.
__device__ __forceinline__ int64_t token_entry(const LlParams& p, int source, int token,
                                               int slot) {
    return (static_cast<int64_t>(source) * p.max_tokens + token) * p.topk + slot;
}

// ---------------------------------------------------------------------------
// Routing
// ---------------------------------------------------------------------------

// ---------------------------------------------------------------------------
// FP8 quantization (src/reference/fp8.rs, quantize_row)
// ---------------------------------------------------------------------------

struct Fp8Vector {
    uint2 codes;  // 8 E4M3 codes, channel order
    float scale;  // the scale of the vector's 128-channel block
};

// Quantizes 8 channels. The 16 lanes of each half-warp hold the 16 vectors
// of one 128-channel block: every lane of the warp must call this (the block
// maximum is a shuffle reduction); lanes without data pass zeros.
__device__ __forceinline__ Fp8Vector quantize_vector(const int4& raw, bool ue8m0) {
    float v[8];
    ep_unpack_bf16x8(raw, v);
    // fmaxf ignores a NaN operand, as the reference's f32::max does.
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        amax = fmaxf(amax, fabsf(v[i]));
    }
#pragma unroll
    for (int offset = 8; offset > 0; offset /= 2) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    }
    amax = fmaxf(amax, EP_LL_AMAX_FLOOR);
    float scale, multiplier;
    if (ue8m0) {
        // Round amax / 448 up to a power of two on the bits; the reciprocal
        // of 2^(E-127) is 2^(127-E), biased exponent 254 - E (exact).
        const unsigned bits = __float_as_uint(__fdiv_rn(amax, EP_LL_E4M3_MAX));
        unsigned exponent = bits >> 23;
        if (bits & 0x007fffffu) {
            ++exponent;
        }
        scale = __uint_as_float(exponent << 23);
        multiplier = exponent < 255 ? __uint_as_float((254 - exponent) << 23) : 0.0f;
    } else {
        scale = __fdiv_rn(amax, EP_LL_E4M3_MAX);
        multiplier = __fdiv_rn(EP_LL_E4M3_MAX, amax);
    }
    Fp8Vector q;
    uint8_t* codes = reinterpret_cast<uint8_t*>(&q.codes);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        codes[i] = __nv_cvt_float_to_fp8(__fmul_rn(v[i], multiplier), __NV_SATFINITE, __NV_E4M3);
    }
    q.scale = scale;
    return q;
}

// ---------------------------------------------------------------------------
// Block and warp building blocks
// ---------------------------------------------------------------------------

// Warp-wide copy of `n` 16-byte vectors, loads issued before stores.
__device__ __forceinline__ void warp_copy(int4* dst, const int4* src, int n) {
    const int lane = threadIdx.x % 32;
    for (int base = lane; base < n; base += 32 * EP_LL_COPY_UNROLL) {
        int4 v[EP_LL_COPY_UNROLL];
#pragma unroll
        for (int u = 0; u < EP_LL_COPY_UNROLL; ++u) {
            const int i = base + 32 * u;
            if (i < n) {
                v[u] = src[i];
            }
        }
#pragma unroll
        for (int u = 0; u < EP_LL_COPY_UNROLL; ++u) {
            const int i = base + 32 * u;
            if (i < n) {
                dst[i] = v[u];
            }
        }
    }
}

// Block-wide: waits until every rank d has acknowledged call seq - 2 in
// `acks[d]` (the set this call writes is then free on d). Returns false in
// every thread when a wait failed (the error is recorded).
__device__ bool wait_for_acks(const LlParams& p, const int* acks, int seq, uint64_t deadline,
                              int phase) {
    const int d = threadIdx.x;
    const bool failed = d < p.world && !ep_wait_until_ge(acks + d, seq - 2, deadline, p.abort_flag,
                                                          p.status, d, phase);
    return !__syncthreads_or(failed);
}

// Block-wide; true in every thread of the last block of the grid to get
// here, after every block has. The counter is reset for the next launch.
//
// GPU-scope fences suffice here although the blocks' work includes stores
// to peers: the last block's later system-scope release stores are
// cumulative (PTX memory model), so they cover everything the blocks
// ordered before their arrival, and a system-scope fence per block would
// cost a full NVLink drain on the critical path.
__device__ bool last_block_to_arrive(int* arrivals) {
    __shared__ bool s_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        s_last = atomicAdd(arrivals, 1) == static_cast<int>(gridDim.x) - 1;
        if (s_last) {
            __threadfence();
            *arrivals = 0;
        }
    }
    __syncthreads();
    return s_last;
}

// Run by the last block: publishes the end of call `seq`, thread d
// acknowledging to rank d (the release stores go out in parallel).
__device__ void finish_call(const LlParams& p, int seq, int* seq_counter, int64_t off_acks) {
    if (p.do_send && threadIdx.x == 0) {
        *seq_counter = seq;
    }
    if (p.do_recv && threadIdx.x < p.world) {
        ep_st_release_sys(ll_at<int>(p, threadIdx.x, off_acks) + p.rank, seq);
    }
}

// ---------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------

// Block-wide: writes token t's row (quantized or BF16) into the message slot
// `slots[d]` of every rank d in `dest_mask`.
__device__ void send_token_row(const LlParams& p, int t, uint64_t dest_mask, uint8_t* const* slots) {
    const int vecs = p.hidden / 8;  // a multiple of 16: whole scale blocks
    const int4* row = reinterpret_cast<const int4*>(p.x) + static_cast<int64_t>(t) * vecs;
    // Every thread runs the same passes, so whole warps take part in the
    // quantization shuffles.
    for (int base = 0; base < vecs; base += blockDim.x * EP_LL_COPY_UNROLL) {
        int4 raw[EP_LL_COPY_UNROLL];
#pragma unroll
        for (int u = 0; u < EP_LL_COPY_UNROLL; ++u) {
            const int v = base + u * blockDim.x + threadIdx.x;
            raw[u] = v < vecs ? __ldg(row + v) : make_int4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < EP_LL_COPY_UNROLL; ++u) {
            const int v = base + u * blockDim.x + threadIdx.x;
            if (p.fp8) {
                const Fp8Vector q = quantize_vector(raw[u], p.ue8m0 != 0);
                if (v >= vecs) {
                    continue;
                }
                for (uint64_t m = dest_mask; m != 0; m &= m - 1) {
                    uint8_t* data = slots[__ffsll(static_cast<long long>(m)) - 1] +
                                    EP_LL_HEADER_BYTES;
                    reinterpret_cast<uint2*>(data)[v] = q.codes;
                    if (v % 16 == 0) {
                        reinterpret_cast<float*>(data + p.hidden)[v / 16] = q.scale;
                    }
                }
            } else if (v < vecs) {
                for (uint64_t m = dest_mask; m != 0; m &= m - 1) {
                    uint8_t* data = slots[__ffsll(static_cast<long long>(m)) - 1] +
                                    EP_LL_HEADER_BYTES;
                    reinterpret_cast<int4*>(data)[v] = raw[u];
                }
            }
        }
    }
}

// Block-wide send phase of dispatch call `seq` (steps 1-3 of the header).
__device__ bool dispatch_send(const LlParams& p, int seq, uint64_t deadline) {
    __shared__ int s_expert[EP_LL_MAX_TOPK];
    __shared__ float s_weight[EP_LL_MAX_TOPK];
    __shared__ uint8_t* s_slot[EP_LL_MAX_WORLD];
    const int set = seq & 1;
    const int tid = threadIdx.x;
    const int L = local_experts(p);
    if (!wait_for_acks(p, ll_at<int>(p, p.rank, p.off_dispatch_acks), seq, deadline,
                       EP_PHASE_LL_DISPATCH)) {
        return false;
    }
    if (blockIdx.x == 0 && tid < p.world) {
        ll_at<int>(p, tid, p.off_dispatch_counts)[set * p.world + p.rank] = p.num_tokens;
        ep_st_release_sys(ll_at<int>(p, tid, p.off_dispatch_flags) + set * p.world + p.rank, seq);
    }
    for (int t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
        // The previous token's readers of the shared arrays are done.
        __syncthreads();
        if (tid < p.topk) {
            const int* ids = p.topk_idx + static_cast<int64_t>(t) * p.topk;
            const int expert = ep_effective_expert(ids, tid, p.num_experts);
            if (expert < 0 && ids[tid] != -1) {
                ep_record_error(p.status, EP_STATUS_INVALID_EXPERT, -1, EP_PHASE_LL_DISPATCH,
                                t * p.topk + tid);
            }
            s_expert[tid] = expert;
            s_weight[tid] =
                p.topk_weights != nullptr ? p.topk_weights[static_cast<int64_t>(t) * p.topk + tid]
                                          : 0.0f;
        }
        if (tid < p.world) {
            s_slot[tid] = dispatch_msg(p, tid, set, p.rank, t);
        }
        __syncthreads();
        uint64_t dest_mask = 0;
        for (int k = 0; k < p.topk; ++k) {
            if (s_expert[k] >= 0) {
                dest_mask |= 1ull << (s_expert[k] / L);
            }
        }
        // Header for every rank (those without an expert read all -1).
        for (int i = tid; i < p.world * 32; i += blockDim.x) {
            const int d = i / 32, j = i % 32;
            int word;
            if (j < EP_LL_MAX_TOPK) {
                const int e = j < p.topk ? s_expert[j] : -1;
                word = e >= 0 && e / L == d ? e % L : -1;
            } else {
                word = __float_as_int(j - 16 < p.topk ? s_weight[j - 16] : 0.0f);
            }
            reinterpret_cast<int*>(s_slot[d])[j] = word;
        }
        send_token_row(p, t, dest_mask, s_slot);
        // The barrier orders every thread's header and row stores before
        // thread d's release store, which (being cumulative) publishes them.
        __syncthreads();
        if (tid < p.world) {
            ep_st_release_sys(dispatch_tag(p, tid, set, p.rank, t), seq);
        }
    }
    return true;
}

// Block-wide receive phase of dispatch call `seq` for local expert `le`
// (steps 4-5 of the header).
__device__ bool dispatch_receive_expert(const LlParams& p, int seq, int le, uint64_t deadline) {
    __shared__ int s_count[EP_LL_MAX_WORLD];
    __shared__ int s_first[EP_LL_MAX_WORLD];
    const int set = seq & 1;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int W = p.world, M = p.max_tokens, K = p.topk;
    int* origin = ll_at<int>(p, p.rank, p.off_scan_origin) + static_cast<int64_t>(le) * W * M;
    int* token_rows = ll_at<int>(p, p.rank, p.off_token_rows);
    float* token_weights = ll_at<float>(p, p.rank, p.off_token_weights);

    // Step 4: positions of the tokens routed to `le`, per source.
    bool ok = true;
    for (int s = warp; s < W && ok; s += EP_LL_WARPS) {
        ok = ep_wait_until_ge(ll_at<int>(p, p.rank, p.off_dispatch_flags) + set * W + s, seq,
                              deadline, p.abort_flag, p.status, s, EP_PHASE_LL_DISPATCH);
        if (!__all_sync(0xffffffffu, ok)) {
            ok = false;
            break;
        }
        const int n = ll_at<int>(p, p.rank, p.off_dispatch_counts)[set * W + s];
        if (le == 0 && lane == 0) {
            ll_at<int>(p, p.rank, p.off_dispatch_tokens)[s] = n;
        }
        int found = 0;
        for (int base = 0; base < n; base += 32) {
            const int t = base + lane;
            int slot = -1;
            bool arrived = true;
            if (t < n) {
                arrived = ep_wait_until_ge(dispatch_tag(p, p.rank, set, s, t), seq, deadline,
                                           p.abort_flag, p.status, s, EP_PHASE_LL_DISPATCH);
            }
            if (!__all_sync(0xffffffffu, arrived)) {
                ok = false;
                break;
            }
            if (t < n) {
                const int* local = reinterpret_cast<const int*>(dispatch_msg(p, p.rank, set, s, t));
                for (int k = 0; k < K; ++k) {
                    const int l = local[k];
                    if (l == le) {
                        slot = k;
                    }
                    // Block 0's expert also marks the slots of no local expert.
                    if (le == 0 && l < 0) {
                        token_rows[token_entry(p, s, t, k)] = -1;
                    }
                }
            }
            const unsigned hits = __ballot_sync(0xffffffffu, slot >= 0);
            if (slot >= 0) {
                origin[s * M + found + __popc(hits & ep_lanemask_lt())] = t | slot << 16;
            }
            found += __popc(hits);
        }
        if (lane == 0) {
            s_count[s] = found;
        }
    }
    if (__syncthreads_or(!ok)) {
        return false;
    }

    // Step 5: the layout, then the rows.
    if (threadIdx.x == 0) {
        int first = 0;
        for (int s = 0; s < W; ++s) {
            s_first[s] = first;
            first += s_count[s];
        }
        p.recv_count[le] = first;
    }
    __syncthreads();
    if (threadIdx.x < W) {
        const int s = threadIdx.x;
        p.recv_layout_range[(le * W + s) * 2] = s_first[s];
        p.recv_layout_range[(le * W + s) * 2 + 1] = s_count[s];
    }
    const int row_bytes = p.fp8 ? p.hidden : 2 * p.hidden;
    const int scale_cols = p.hidden / 128;
    for (int s = 0; s < W; ++s) {
        for (int pos = warp; pos < s_count[s]; pos += EP_LL_WARPS) {
            const int packed = origin[s * M + pos];
            const int t = packed & 0xffff, k = packed >> 16;
            const int row = le * W * M + s_first[s] + pos;
            const uint8_t* msg = dispatch_msg(p, p.rank, set, s, t);
            const uint8_t* data = msg + EP_LL_HEADER_BYTES;
            warp_copy(reinterpret_cast<int4*>(p.recv_x + static_cast<int64_t>(row) * row_bytes),
                      reinterpret_cast<const int4*>(data), row_bytes / 16);
            if (p.fp8) {
                const float* scales = reinterpret_cast<const float*>(data + p.hidden);
                for (int c = lane; c < scale_cols; c += 32) {
                    p.recv_scales[static_cast<int64_t>(row) * scale_cols + c] = scales[c];
                }
            }
            if (lane == 0) {
                p.recv_src_info[row] = t;
                token_rows[token_entry(p, s, t, k)] = row;
                token_weights[token_entry(p, s, t, k)] =
                    reinterpret_cast<const float*>(msg)[EP_LL_MAX_TOPK + k];
            }
        }
    }
    return true;
}

// ---------------------------------------------------------------------------
// Combine
// ---------------------------------------------------------------------------

// Adds `w * y` (or `y` when !weighted) for 32 * EP_LL_SUM_VECS channels of a
// BF16 row, starting at vector `first_vec`; products rounded, then added.
__device__ __forceinline__ void accumulate_row(float (&acc)[EP_LL_SUM_VECS][8],
                                               const __nv_bfloat16* row, int first_vec, int vecs,
                                               bool weighted, float w) {
    const int lane = threadIdx.x % 32;
    int4 raw[EP_LL_SUM_VECS];
#pragma unroll
    for (int u = 0; u < EP_LL_SUM_VECS; ++u) {
        const int v = first_vec + 32 * u + lane;
        raw[u] = v < vecs ? reinterpret_cast<const int4*>(row)[v] : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < EP_LL_SUM_VECS; ++u) {
        float y[8];
        ep_unpack_bf16x8(raw[u], y);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            acc[u][i] = __fadd_rn(acc[u][i], weighted ? __fmul_rn(w, y[i]) : y[i]);
        }
    }
}

// Stores the sums as BF16 (round to nearest even).
__device__ __forceinline__ void store_row(__nv_bfloat16* row, const float (&acc)[EP_LL_SUM_VECS][8],
                                          int first_vec, int vecs) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int u = 0; u < EP_LL_SUM_VECS; ++u) {
        const int v = first_vec + 32 * u + lane;
        if (v < vecs) {
            reinterpret_cast<int4*>(row)[v] = ep_pack_bf16x8(acc[u]);
        }
    }
}

__device__ __forceinline__ void zero(float (&acc)[EP_LL_SUM_VECS][8]) {
#pragma unroll
    for (int u = 0; u < EP_LL_SUM_VECS; ++u) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            acc[u][i] = 0.0f;
        }
    }
}

// Warp-wide, weights at dispatch: source s's token t partial sum over this
// rank's rows of it, local experts ascending (= rows ascending), into the
// source's return row K + rank. `row`/`w`: lane k's entry (row -1: none).
__device__ void send_partial(const LlParams& p, __nv_bfloat16* dst, int row, float w) {
    const int vecs = p.hidden / 8;
    // Lane k's rank among the valid entries, by row.
    int order = 0;
    for (int j = 0; j < p.topk; ++j) {
        const int other = __shfl_sync(0xffffffffu, row, j);
        if (row >= 0 && other >= 0 && other < row) {
            ++order;
        }
    }
    const int entries = __popc(__ballot_sync(0xffffffffu, row >= 0));
    for (int first_vec = 0; first_vec < vecs; first_vec += 32 * EP_LL_SUM_VECS) {
        float acc[EP_LL_SUM_VECS][8];
        zero(acc);
        for (int i = 0; i < entries; ++i) {
            const int src = __ffs(__ballot_sync(0xffffffffu, row >= 0 && order == i)) - 1;
            const int r = __shfl_sync(0xffffffffu, row, src);
            const float wr = __shfl_sync(0xffffffffu, w, src);
            accumulate_row(acc, p.x + static_cast<int64_t>(r) * p.hidden, first_vec, vecs, true,
                           wr);
        }
        store_row(dst, acc, first_vec, vecs);
    }
}

// Block-wide send phase (expert side) of combine call `seq`.
__device__ bool combine_send(const LlParams& p, int seq, uint64_t deadline) {
    if (!wait_for_acks(p, ll_at<int>(p, p.rank, p.off_combine_acks), seq, deadline,
                       EP_PHASE_LL_COMBINE)) {
        return false;
    }
    const int set = seq & 1;
    const int lane = threadIdx.x % 32;
    const int M = p.max_tokens, K = p.topk;
    const int* dispatched = ll_at<int>(p, p.rank, p.off_dispatch_tokens);
    const int* token_rows = ll_at<int>(p, p.rank, p.off_token_rows);
    const float* token_weights = ll_at<float>(p, p.rank, p.off_token_weights);
    const int warps = gridDim.x * EP_LL_WARPS;
    for (int item = blockIdx.x * EP_LL_WARPS + threadIdx.x / 32; item < p.world * M;
         item += warps) {
        const int s = item / M, t = item % M;
        if (t >= dispatched[s]) {
            continue;
        }
        const int row = lane < K ? token_rows[token_entry(p, s, t, lane)] : -1;
        const float w = lane < K ? token_weights[token_entry(p, s, t, lane)] : 0.0f;
        const unsigned valid = __ballot_sync(0xffffffffu, row >= 0);
        if (valid == 0) {
            continue;  // no expert of this rank: the source expects nothing
        }
        __nv_bfloat16* rows = ll_at<__nv_bfloat16>(p, s, p.off_combine_rows);
        int* tags = ll_at<int>(p, s, p.off_combine_tags);
        if (p.weighted) {
            for (unsigned m = valid; m != 0; m &= m - 1) {
                const int k = __ffs(m) - 1;
                const int r = __shfl_sync(0xffffffffu, row, k);
                warp_copy(reinterpret_cast<int4*>(rows + combine_slot(p, set, t, k) * p.hidden),
                          reinterpret_cast<const int4*>(p.x + static_cast<int64_t>(r) * p.hidden),
                          p.hidden / 8);
            }
        } else {
            send_partial(p, rows + combine_slot(p, set, t, K + p.rank) * p.hidden, row, w);
        }
        // The warp barrier orders every lane's row stores before the
        // release stores, which publish them.
        __syncwarp();
        if (p.weighted && row >= 0) {
            ep_st_release_sys(tags + combine_slot(p, set, t, lane), seq);
        } else if (!p.weighted && lane == 0) {
            ep_st_release_sys(tags + combine_slot(p, set, t, K + p.rank), seq);
        }
    }
    return true;
}

// Block-wide receive phase (source side) of combine call `seq`: a warp per
// (token, 32 * EP_LL_SUM_VECS channels).
__device__ bool combine_receive(const LlParams& p, int seq, uint64_t deadline) {
    const int set = seq & 1;
    const int K = p.topk, L = local_experts(p);
    const int vecs = p.hidden / 8;
    const int chunks = (vecs + 32 * EP_LL_SUM_VECS - 1) / (32 * EP_LL_SUM_VECS);
    const __nv_bfloat16* rows = ll_at<__nv_bfloat16>(p, p.rank, p.off_combine_rows);
    const int* tags = ll_at<int>(p, p.rank, p.off_combine_tags);
    const int warps = gridDim.x * EP_LL_WARPS;
    bool ok = true;
    for (int item = blockIdx.x * EP_LL_WARPS + threadIdx.x / 32; ok && item < p.num_tokens * chunks;
         item += warps) {
        const int t = item / chunks;
        const int first_vec = (item % chunks) * 32 * EP_LL_SUM_VECS;
        const int* ids = p.topk_idx + static_cast<int64_t>(t) * K;
        float acc[EP_LL_SUM_VECS][8];
        zero(acc);
        // Return rows j in summation order: slots ascending, or expert
        // ranks ascending (each rank holding an expert of t once).
        uint64_t ranks = 0;
        for (int k = 0; k < K && !p.weighted; ++k) {
            const int e = ep_effective_expert(ids, k, p.num_experts);
            if (e >= 0) {
                ranks |= 1ull << (e / L);
            }
        }
        const int terms = p.weighted ? K : p.world;
        for (int i = 0; i < terms && ok; ++i) {
            int from_rank;
            if (p.weighted) {
                const int e = ep_effective_expert(ids, i, p.num_experts);
                if (e < 0) {
                    continue;
                }
                from_rank = e / L;
            } else {
                if (!(ranks >> i & 1)) {
                    continue;
                }
                from_rank = i;
            }
            const int j = p.weighted ? i : K + i;
            ok = ep_wait_until_ge(tags + combine_slot(p, set, t, j), seq, deadline, p.abort_flag,
                                  p.status, from_rank, EP_PHASE_LL_COMBINE);
            if (!__all_sync(0xffffffffu, ok)) {
                ok = false;
                break;
            }
            const float w = p.weighted ? p.topk_weights[static_cast<int64_t>(t) * K + i] : 1.0f;
            accumulate_row(acc, rows + combine_slot(p, set, t, j) * p.hidden, first_vec, vecs,
                           p.weighted != 0, w);
        }
        if (ok) {
            store_row(p.out + static_cast<int64_t>(t) * p.hidden, acc, first_vec, vecs);
        }
    }
    return !__syncthreads_or(!ok);
}

}  // namespace

// ---------------------------------------------------------------------------
// Kernels: grid = one block per SM, EP_LL_THREADS threads, no dynamic shared
// memory. One launch runs the send phase, the receive phase, or both.
// ---------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(EP_LL_THREADS, 1)
    ep_ll_dispatch_kernel(const LlParams p) {
    const uint64_t deadline = ep_deadline_after(p.timeout_ns);
    LlCounters* c = counters(p);
    const int seq = c->dispatch_seq + p.do_send;
    bool ok = true;
    if (p.do_send) {
        ok = dispatch_send(p, seq, deadline);
    }
    if (p.do_recv && ok) {
        for (int le = blockIdx.x; le < local_experts(p) && ok; le += gridDim.x) {
            ok = dispatch_receive_expert(p, seq, le, deadline);
        }
    }
    if (last_block_to_arrive(&c->dispatch_arrivals)) {
        finish_call(p, seq, &c->dispatch_seq, p.off_dispatch_acks);
    }
}

extern "C" __global__ void __launch_bounds__(EP_LL_THREADS, 1)
    ep_ll_combine_kernel(const LlParams p) {
    const uint64_t deadline = ep_deadline_after(p.timeout_ns);
    LlCounters* c = counters(p);
    const int seq = c->combine_seq + p.do_send;
    bool ok = true;
    if (p.do_send) {
        ok = combine_send(p, seq, deadline);
    }
    if (p.do_recv && ok) {
        ok = combine_receive(p, seq, deadline);
    }
    if (last_block_to_arrive(&c->combine_arrivals)) {
        finish_call(p, seq, &c->combine_seq, p.off_combine_acks);
    }
}
