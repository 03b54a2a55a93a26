// Normal mode: dispatch and combine of thousands of tokens over NVLink.
//
// Every rank owns one symmetric area (mapped by every peer, see
// src/runtime/gpu/normal.rs for the byte layout). A dispatch is at most
// four launches on the caller's stream; kernels of one rank only ever write
// their own area, except the stage, which pushes records into the peers'
// areas, and the combine's send, which writes the peers' return rows:
//
//   1. count (source side): for every chunk of 256 tokens, how many tokens go
//      to each rank and how many (token, slot) pairs to each expert, and the
//      position of every token / pair inside its chunk.
//   2. stage (source side, in the same kernel: "Dispatch 1"): turns chunk
//      positions into positions over all tokens (the prefix over earlier
//      chunks, which each chunk's block waits for), writes the totals,
//      pushes a small record per (token, destination rank) into the
//      destination's area (token index, marked EP_ONE_RANK_BIT when the
//      token goes to that rank only, and per slot the local expert, its
//      weight and the pair's position among this source's pairs of that
//      expert), and copies the tokens (and scales) into its own area for
//      the peers to pull; the pull reads the rank's own tokens from the
//      caller's `x`, so with one rank nothing is copied.
//   3. barrier: every rank's stage is complete and visible.
//   4. pull (receiver side): reads every source's totals, lays out the
//      source-order rows (by source rank, then token order) and the
//      expert-major rows (by local expert, then source-order row, padded to
//      the alignment) from the records in its own area, and copies each
//      received token ONCE over NVLink into its source-order row and all its
//      expert-major rows. Only the token data crosses NVLink here, so a row
//      costs one remote round trip, not a chain of them. The warps running
//      at once take rows of every source (ep_spread_row), not one source
//      after the other. It also clears the count's chunk sync words for
//      the next dispatch (ep_clear_chunk_sync).
//   5. closing barrier: nobody restages (next dispatch) while a peer still
//      reads. The runtime enqueues it only before the next dispatch, and
//      only if no other exchange came between (a combine's middle barrier
//      closes the dispatch too; src/runtime/gpu/normal.rs, `Exchange`).
//
// A combine is at most four launches:
//   1. send (expert side): for each received row, the caller's row (source
//      order) or the weighted sum of its expert rows (expert-major, fp32, the
//      products rounded before they are added, local experts ascending),
//      rounded to BF16 and written into the source's return rows, slot
//      (this rank, token); rows of every source at once, as the pull. A
//      row of one of this rank's own tokens that went to no other rank
//      (every routed token with one rank; "stays home": the record the
//      stage pushed says so, EP_ONE_RANK_BIT, and the pull marks the row)
//      is the token's whole sum: it goes straight into `out` (with -0 made
//      +0, as the reduce's sum from a zero makes it), not through the
//      return rows.
//   2. barrier.
//   3. reduce (source side): out[t] = BF16 of the fp32 sum of the returned
//      rows of token t, ranks ascending; zeros for a token routed nowhere;
//      a token that stays home is left as the send wrote it.
//   4. closing barrier: nobody sends the next combine's rows before this
//      reduce; enqueued, like the dispatch's, only when the next exchange
//      is a combine.
//
// Both sums follow src/reference/normal.rs step by step, so the results are
// bit-exact with the reference, not only close.
//
// Collective calls: the first kernel of a dispatch (count) or combine
// (send) numbers the call and publishes its word (ep_begin_collective); the
// barriers carry it, so ranks in different calls stop at the first barrier
// with EP_STATUS_MISMATCH, and the kernels after a failed barrier do nothing
// (ep_last_barrier_passed): no rank uses what a peer wrote for another call.
//
// Waiting: only the barrier kernel (one block) waits for other ranks. Of
// the other kernels only the count waits for other blocks, and only for
// blocks that took an earlier ticket ("Dispatch 1"), so any number of their
// blocks may be resident. The row-moving grids are the config's SM budget,
// at most the rank's share of the GPU when ranks share it
// (src/runtime/gpu/placement.rs; kernels/low_latency.cu, "Co-residency",
// says why every rank's waiting kernel then finds room).
//
// Optional outputs: every output pointer that the API lets the caller pass
// as NULL (recv_topk_idx, recv_topk_weights, recv_src_info, recv_num_rows,
// expert_weights, expert_src_row, expert_counts) is tested for nullptr
// before each store; the runtime rejects the required ones (and the other
// recv_* or expert_* pointers are only used when recv_x or expert_x is
// given). The combine reads only the handle's arrays, which are the
// library's own.
//
// Expert ids: the effective id of a slot is its id, or -1 when the slot is
// dropped (-1), out of range, or repeats an earlier slot of the same token.
// The count kernel reports the last two as EP_STATUS_INVALID_EXPERT; every
// kernel uses the effective id, so a bad id is never an address.
#include <cuda_bf16.h>

#include "ep_device.cuh"
#include "ep_normal.cuh"

// The kernels' parameters, DispatchParams and CombineParams, are defined in
// src/abi/defs.rs and reach this file through ep_abi.h; the row helpers are
// in ep_normal.cuh (shared with kernels/mega.cu).

// ---------------------------------------------------------------------------
// Staging: the records of a token and the copy of the rows peers pull (the
// count kernel's work after counting, "Dispatch 1")
// ---------------------------------------------------------------------------

// What the count kernel's thread of token t (lane t % 32 of its warp) knows
// of its token once its chunk is counted (ep_count_chunk), kept in
// registers for the stage: no round trip through global memory between
// counting a token and pushing its records.
struct EpCountedToken {
    int experts[EP_MAX_TOPK];   // effective expert of each slot, or -1
    float weights[EP_MAX_TOPK];  // routing weight of each slot (stage only)
    int slot_pos[EP_MAX_TOPK];  // position of (t, slot) among the chunk's
                                // pairs of its expert
    uint64_t ranks;             // bit r: the token goes to rank r
};

// One token's part of the stage, by every thread of the count kernel's
// block (the rank positions come from ballots; a thread past the last
// token goes nowhere): the handle's is-token-in-rank, and the token's
// record in the area of every rank it goes to. Its position there is its
// position among its warp's tokens for that rank, plus its warp's base in
// the chunk (`warp_base`, [world + experts], ep_scan_warp_counts), plus
// the chunk's base (`chunk_base`, the counts of the earlier chunks).
__device__ void ep_push_records(const DispatchParams& p, int token, const EpCountedToken& mine,
                                const int* warp_base, const int* chunk_base) {
    const int local_experts = p.num_experts / p.world;
    const bool real = token < p.num_tokens;
    const int token_mark = __popcll(mine.ranks) == 1 ? token | EP_ONE_RANK_BIT : token;
    for (int r = 0; r < p.world; ++r) {
        const bool goes = (mine.ranks >> r) & 1;
        const unsigned going = __ballot_sync(0xffffffffu, goes);
        if (real) {
            p.handle_in_rank[static_cast<int64_t>(token) * p.world + r] = goes;
        }
        if (!goes) {
            continue;
        }
        // The record goes to row (this rank, pos) of rank r's area.
        const int pos = chunk_base[r] + warp_base[r] + __popc(going & ep_lanemask_lt());
        const int64_t record = static_cast<int64_t>(p.rank) * p.max_tokens + pos;
        ep_area<int>(p.peer_bases, r, p.normal.area, p.normal.off_in_token)[record] = token_mark;
        int local[EP_MAX_TOPK], ranks[EP_MAX_TOPK];
        float weights[EP_MAX_TOPK];
#pragma unroll
        for (int k = 0; k < EP_MAX_TOPK; ++k) {
            const int e = mine.experts[k];
            const bool here = e >= 0 && e / local_experts == r;
            local[k] = here ? e - r * local_experts : -1;
            ranks[k] = here ? chunk_base[p.world + e] + mine.slot_pos[k] : 0;
            weights[k] = here ? mine.weights[k] : 0.0f;
        }
        const int64_t first = record * p.topk;
        ep_store_slots(ep_area<int>(p.peer_bases, r, p.normal.area, p.normal.off_in_local) + first,
                       p.topk, local);
        ep_store_slots(ep_area<int>(p.peer_bases, r, p.normal.area, p.normal.off_in_rank) + first,
                       p.topk, ranks);
        ep_store_slots(ep_area<float>(p.peer_bases, r, p.normal.area, p.normal.off_in_weight) + first,
                       p.topk, weights);
    }
}

// The stage's copy, a warp per token over the whole grid: with peers, every
// token (and its scales) goes into this rank's area for the peers to pull,
// without waiting for the count (a token that no peer receives is copied
// too: with uniform routing of 8 slots over 2 ranks, 1 in 256); this rank's
// own rows are pulled from `x` itself (ep_token_row), so with one rank
// nothing is copied.
__device__ void ep_stage_rows(const DispatchParams& p) {
    if (p.world == 1) {
        return;
    }
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int warps = gridDim.x * (blockDim.x / 32);
    uint8_t* staged_x = ep_area<uint8_t>(p.peer_bases, p.rank, p.normal.area, p.normal.off_staged_x);
    float* staged_scales = ep_area<float>(p.peer_bases, p.rank, p.normal.area, p.normal.off_staged_scales);
    for (int token = blockIdx.x * (blockDim.x / 32) + warp; token < p.num_tokens; token += warps) {
        const int64_t row = static_cast<int64_t>(token) * p.row_bytes;
        ep_warp_copy_row(reinterpret_cast<const uint8_t*>(p.x) + row, staged_x + row, nullptr,
                         nullptr, 0, p.row_bytes, lane);
        const int64_t scales = static_cast<int64_t>(token) * p.scale_cols;
        for (int c = lane; c < p.scale_cols; c += 32) {
            staged_scales[scales + c] = p.x_scales[scales + c];
        }
    }
}

// ---------------------------------------------------------------------------
// Dispatch 1: count and stage (EP_CHUNK_TOKENS threads, dynamic shared
// memory EP_COUNT_SHARED_ROWS * (world + experts) ints)
// ---------------------------------------------------------------------------

// With `stage_in_count` (every single-node dispatch; grid max(chunks, SM
// budget)) one kernel counts and stages. Blocks take tickets as they start
// (`chunk_sync`, EP_CHUNK_SYNC_TICKET): tickets below the chunk count are
// chunks to count. A block that has counted its chunk publishes its counts
// (ready flag c, a GPU-scope release), waits for the counts of every
// earlier chunk (acquires), sums them into its chunk's bases and stages its
// tokens; the last chunk also writes the totals, and publishes no flag:
// only later chunks wait for one. Then every block takes its share of the
// copy for the peers. A block only ever waits for chunks of lower tickets,
// whose blocks are running (they took their tickets first) and wait for
// nobody later, so the waits end whatever the residency. A dispatch of one
// chunk (up to EP_CHUNK_TOKENS tokens) takes no tickets: nobody waits, so
// block 0 counts it at once. The pull, which follows on the stream, clears
// the tickets and flags for the next dispatch (ep_clear_chunk_sync).
// Without `stage_in_count` (the hierarchical mode, which stages in its own
// kernels) block b counts chunk b and stops.
//
// The words of `chunk_sync` (normal.off_chunk_sync, EP_CHUNK_SYNC_HEADER
// words, then a ready flag per chunk).
#define EP_CHUNK_SYNC_TICKET 0

// The count kernel's dynamic shared memory, EP_COUNT_SHARED_ROWS rows of
// `columns` (world + experts) ints: EP_CHUNK_WARPS rows of the warps'
// masks, then bases (ep_count_chunk); the chunk's bases (the counts of the
// earlier chunks); the chunk's own counts.
static_assert(EP_COUNT_SHARED_ROWS == EP_CHUNK_WARPS + 2, "count kernel's shared rows");

__device__ __forceinline__ int* ep_chunk_base(int* shared, int columns) {
    return shared + EP_CHUNK_WARPS * columns;
}

__device__ __forceinline__ int* ep_chunk_total(int* shared, int columns) {
    return shared + (EP_CHUNK_WARPS + 1) * columns;
}

__device__ __forceinline__ int ep_chunk_count(int num_tokens) {
    return max(1, (num_tokens + EP_CHUNK_TOKENS - 1) / EP_CHUNK_TOKENS);
}

// Block-wide: the warps' lane masks (`warp_counts`, [warp][columns], see
// ep_count_chunk) become each warp's base (exclusive, token order: the
// tokens of earlier warps), and the chunk's totals go to
// chunk_counts[chunk] (for the later chunks) and to the block's
// `chunk_total` (for itself, without a round trip through global memory).
__device__ __forceinline__ void ep_scan_warp_counts(int* warp_counts, int* chunk_counts,
                                                    int* chunk_total, int chunk, int columns) {
    for (int c = threadIdx.x; c < columns; c += blockDim.x) {
        int running = 0;
        for (int w = 0; w < EP_CHUNK_WARPS; ++w) {
            const int count = __popc(static_cast<unsigned>(warp_counts[w * columns + c]));
            warp_counts[w * columns + c] = running;
            running += count;
        }
        chunk_counts[static_cast<int64_t>(chunk) * columns + c] = running;
        chunk_total[c] = running;
    }
}

// For chunk `chunk`, by the whole block (thread i holds the chunk's token
// i), writes chunk_counts[chunk][r] (tokens of the chunk that go to rank
// r) and chunk_counts[chunk][world + e] ((token, slot) pairs of the chunk
// for expert e), and fills `mine` (the weights only with
// `stage_in_count`). Without `stage_in_count` (the hierarchical mode,
// whose stage kernels read them) it also writes
//   rank_pos[t][r]   position of token t among the chunk's tokens for rank
//                    r, or -1 when t does not go there,
//   slot_rank[t][k]  position of (t, k) among the chunk's pairs of its
//                    expert (effective experts).
// Positions follow token order. Each warp first builds, in its row of
// `shared` (the kernel's dynamic shared memory, whose first rows are the
// warps', [warp][world + experts], zeroed here; see EP_COUNT_SHARED_ROWS),
// a mask per column: bit l when its token l goes to that rank or expert (a
// token names an expert once, so OR-ing the bits in any order gives the
// same masks). A token's position among its warp's tokens of a column is
// then the number of lower bits set, and the block scan turns the masks
// into per-warp bases.
__device__ void ep_count_chunk(const DispatchParams& p, int chunk, int* shared,
                               EpCountedToken& mine) {
    const int columns = p.world + p.num_experts;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int local_experts = p.num_experts / p.world;
    const int token = chunk * EP_CHUNK_TOKENS + threadIdx.x;
    const bool real = token < p.num_tokens;
    int* const chunk_counts = ep_area<int>(p.peer_bases, p.rank, p.normal.area, p.normal.off_chunk_counts);
    for (int i = threadIdx.x; i < EP_CHUNK_WARPS * columns; i += blockDim.x) {
        shared[i] = 0;
    }

    // The token's ids and effective experts, and its weights, each loaded
    // in one round trip; ids that are neither -1 nor effective are errors.
    const int64_t first_pair = static_cast<int64_t>(token) * p.topk;
    int ids[EP_MAX_TOPK];
    ep_effective_experts(p.topk_idx + first_pair, real ? p.topk : 0, p.num_experts, ids,
                         mine.experts);
    ep_load_slots(p.topk_weights + first_pair, p.stage_in_count && real ? p.topk : 0, 0.0f,
                  mine.weights);
#pragma unroll
    for (int k = 0; k < EP_MAX_TOPK; ++k) {
        if (mine.experts[k] < 0 && ids[k] != -1) {
            ep_record_error(p.status, EP_STATUS_INVALID_EXPERT, -1, EP_PHASE_DISPATCH,
                            token * p.topk + k);
        }
    }
    __syncthreads();

    // The warp's masks.
    unsigned* const masks = reinterpret_cast<unsigned*>(shared + warp * columns);
    mine.ranks = 0;
#pragma unroll
    for (int k = 0; k < EP_MAX_TOPK; ++k) {
        const int e = mine.experts[k];
        if (e >= 0) {
            atomicOr(masks + p.world + e, 1u << lane);
            mine.ranks |= 1ull << (e / local_experts);
        }
    }
    for (int r = 0; r < p.world; ++r) {
        const unsigned going = __ballot_sync(0xffffffffu, (mine.ranks >> r) & 1);
        if (lane == 0) {
            masks[r] = going;
        }
    }
    __syncwarp();
    int in_warp[EP_MAX_TOPK];
#pragma unroll
    for (int k = 0; k < EP_MAX_TOPK; ++k) {
        const int e = mine.experts[k];
        in_warp[k] = e >= 0 ? __popc(masks[p.world + e] & ep_lanemask_lt()) : 0;
    }
    __syncthreads();
    ep_scan_warp_counts(shared, chunk_counts, ep_chunk_total(shared, columns), chunk, columns);
    __syncthreads();

    const int* const warp_base = shared + warp * columns;
#pragma unroll
    for (int k = 0; k < EP_MAX_TOPK; ++k) {
        const int e = mine.experts[k];
        mine.slot_pos[k] = e >= 0 ? warp_base[p.world + e] + in_warp[k] : 0;
    }
    if (p.stage_in_count) {
        return;
    }
    int* const slot_rank = ep_area<int>(p.peer_bases, p.rank, p.normal.area, p.normal.off_slot_rank);
    int* const rank_pos = ep_area<int>(p.peer_bases, p.rank, p.normal.area, p.normal.off_rank_pos);
#pragma unroll
    for (int k = 0; k < EP_MAX_TOPK; ++k) {
        if (k >= p.topk) {
            break;
        }
        if (real && mine.experts[k] >= 0) {
            slot_rank[first_pair + k] = mine.slot_pos[k];
        }
    }
    for (int r = 0; r < p.world; ++r) {
        const bool goes = (mine.ranks >> r) & 1;
        const unsigned going = __ballot_sync(0xffffffffu, goes);
        if (real) {
            rank_pos[static_cast<int64_t>(token) * p.world + r] =
                goes ? warp_base[r] + __popc(going & ep_lanemask_lt()) : -1;
        }
    }
}

// After ep_count_chunk, with `stage_in_count`: publishes the chunk's counts
// unless it is the last chunk, waits for the earlier chunks' (see
// "Dispatch 1"), sums them into the chunk's bases (ep_chunk_base in the
// kernel's shared memory `shared`) and pushes the records of the chunk's
// tokens (`mine`: this thread's); the last chunk writes the totals. After a
// failed wait (recorded) it stages nothing.
__device__ void ep_stage_chunk(const DispatchParams& p, int chunk, int chunks, int* shared,
                               const EpCountedToken& mine) {
    const int columns = p.world + p.num_experts;
    const int* chunk_counts = ep_area<int>(p.peer_bases, p.rank, p.normal.area, p.normal.off_chunk_counts);
    int* const ready = ep_area<int>(p.peer_bases, p.rank, p.normal.area, p.normal.off_chunk_sync) +
                       EP_CHUNK_SYNC_HEADER;
    int* const chunk_base = ep_chunk_base(shared, columns);
    // The block's stores of its counts are done, and visible to its own
    // threads; the fence and the release publish them to the blocks that
    // wait for them. Nobody waits for the last chunk.
    __syncthreads();
    if (threadIdx.x == 0 && chunk < chunks - 1) {
        ep_fence_and_store_gpu(ready + chunk, 1);
    }
    // The wait has no peer: its "peer call" is this chunk's own flag, 1
    // (the last chunk's stays 0), never ahead of 1, so ep_wait_until's test
    // for a peer in another call never fires.
    const EpPeerCall no_peer{ready + chunk, 1};
    bool arrived = true;
    for (int earlier = threadIdx.x; earlier < chunk && arrived; earlier += blockDim.x) {
        const auto look = [&] { return ep_ld_acquire_gpu(ready + earlier); };
        arrived = ep_wait_until(look, 1, ep_deadline_after(p.timeout_ns), p.abort_flag, p.status,
                                p.rank, EP_PHASE_DISPATCH, no_peer);
    }
    if (!__syncthreads_and(arrived)) {
        return;
    }
    ep_sum_chunk_counts(chunk_counts, columns, chunk, chunk_base);
    __syncthreads();
    if (chunk == chunks - 1) {
        int* totals = ep_area<int>(p.peer_bases, p.rank, p.normal.area, p.normal.off_totals);
        const int* chunk_total = ep_chunk_total(shared, columns);
        for (int c = threadIdx.x; c < columns; c += blockDim.x) {
            totals[c] = chunk_base[c] + chunk_total[c];
        }
    }
    const int warp = threadIdx.x / 32;
    ep_push_records(p, chunk * EP_CHUNK_TOKENS + threadIdx.x, mine, shared + warp * columns,
                    chunk_base);
}

// The chunk this block counts (none when >= chunks), by the whole block,
// with `stage_in_count` (see "Dispatch 1"): its ticket, or with one chunk
// its index. The block that counts no chunk, or the only block, starts the
// collective call (ep_device.cuh, "Collective calls"; the barriers carry
// its word): the last ticket, or with one chunk the grid's last block.
// `ticket` is a shared int.
__device__ __forceinline__ int ep_block_chunk(const DispatchParams& p, int chunks, int& ticket) {
    const int last = static_cast<int>(gridDim.x) - 1;
    if (chunks == 1) {
        if (threadIdx.x == 0 && static_cast<int>(blockIdx.x) == last) {
            ep_begin_collective(p.peer_bases[p.rank], p.collective);
        }
        return blockIdx.x;
    }
    if (threadIdx.x == 0) {
        int* sync = ep_area<int>(p.peer_bases, p.rank, p.normal.area, p.normal.off_chunk_sync);
        ticket = atomicAdd(sync + EP_CHUNK_SYNC_TICKET, 1);
        if (ticket == last) {
            ep_begin_collective(p.peer_bases[p.rank], p.collective);
        }
    }
    __syncthreads();
    return ticket;
}

// By the pull after a staging count (`stage_in_count`), with block 0: the
// count's tickets and ready flags back to zero for the next dispatch. The
// count has ended by then (the barrier kernel between them waited for it),
// so no block of it still reads them, and the count itself ends without
// waiting for its last block.
__device__ void ep_clear_chunk_sync(const DispatchParams& p) {
    if (!p.stage_in_count || blockIdx.x != 0) {
        return;
    }
    int* sync = ep_area<int>(p.peer_bases, p.rank, p.normal.area, p.normal.off_chunk_sync);
    for (int i = threadIdx.x; i < EP_CHUNK_SYNC_HEADER + ep_chunk_count(p.num_tokens);
         i += blockDim.x) {
        sync[i] = 0;
    }
}

extern "C" __global__ void ep_dispatch_count_kernel(const DispatchParams p) {
    ep_kernel_start();
    // EP_COUNT_SHARED_ROWS rows of world + experts ints (see above).
    extern __shared__ int shared[];
    __shared__ int ticket;
    EpCountedToken mine;
    const int chunks = ep_chunk_count(p.num_tokens);
    // Without staging, block 0 starts the collective call last, so that its
    // other warps do not wait for its system-scope fence.
    if (!p.stage_in_count) {
        ep_count_chunk(p, blockIdx.x, shared, mine);
        if (blockIdx.x == 0 && threadIdx.x == 0) {
            ep_begin_collective(p.peer_bases[p.rank], p.collective);
        }
        return;
    }
    const int chunk = ep_block_chunk(p, chunks, ticket);
    if (chunk < chunks) {
        ep_count_chunk(p, chunk, shared, mine);
        ep_stage_chunk(p, chunk, chunks, shared, mine);
    }
    ep_stage_rows(p);
}

// ---------------------------------------------------------------------------
// Dispatch 4: pull (grid = SM budget, EP_MOVE_THREADS threads)
// ---------------------------------------------------------------------------

// Row layout every block derives from the sources' totals.
struct PullLayout {
    int source_offset[EP_MAX_WORLD_SIZE + 1];  // first source-order row of each source
    int expert_base[EP_MAX_EXPERTS];      // [source][local expert]: rows of earlier sources
    int expert_total[EP_MAX_EXPERTS];     // [local expert]: real rows
    int expert_offset[EP_MAX_EXPERTS + 1];  // [local expert]: padded segment start
    long long scan[EP_MAX_EXPERTS];       // scratch: padded segment sizes, then starts
    long long warp_sums[32 + 1];          // scratch of the scan
    int destinations[EP_MOVE_WARPS][EP_MAX_TOPK];  // per warp: expert rows of its row
};

// Exclusive prefix sums of values[0 .. n) in place, with the whole block
// (at most 32 warps): each thread sums a run of consecutive entries, the
// warps scan those sums with shuffles, warp 0 scans the warps' totals.
// Returns the sum of all n values to every thread. `warp_sums` has room for
// 33 values.
__device__ long long ep_block_exclusive_scan(long long* values, int n, long long* warp_sums) {
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int warps = (blockDim.x + 31) / 32;
    const int per_thread = (n + blockDim.x - 1) / blockDim.x;
    const int first = threadIdx.x * per_thread;
    const int last = min(first + per_thread, n);
    long long own = 0;
    for (int i = first; i < last; ++i) {
        own += values[i];
    }
    long long inclusive = own;
    for (int d = 1; d < 32; d <<= 1) {
        const long long below = __shfl_up_sync(0xffffffffu, inclusive, d);
        inclusive += lane >= d ? below : 0;
    }
    if (lane == 31) {
        warp_sums[warp] = inclusive;
    }
    __syncthreads();
    if (warp == 0) {
        const long long total = lane < warps ? warp_sums[lane] : 0;
        long long scanned = total;
        for (int d = 1; d < 32; d <<= 1) {
            const long long below = __shfl_up_sync(0xffffffffu, scanned, d);
            scanned += lane >= d ? below : 0;
        }
        if (lane < warps) {
            warp_sums[lane] = scanned - total;
        }
        if (lane == 31) {
            warp_sums[32] = scanned;
        }
    }
    __syncthreads();
    long long running = warp_sums[warp] + inclusive - own;
    for (int i = first; i < last; ++i) {
        const long long value = values[i];
        values[i] = running;
        running += value;
    }
    const long long sum = warp_sums[32];
    __syncthreads();
    return sum;
}

// Every source's totals for this rank (read over NVLink) into `layout`,
// unscanned, with the whole block: its rows (source_offset[source + 1])
// and its rows for each local expert (expert_base). The pull reads them
// while it reads its barrier words, before it knows whether the barrier
// passed: the barrier kernel has ended (stream order), so when it passed
// they are every source's final totals; when it failed they go unused.
__device__ __forceinline__ void ep_pull_read_totals(const DispatchParams& p, PullLayout& layout) {
    const int local_experts = p.num_experts / p.world;
    for (int i = threadIdx.x; i < p.world * local_experts; i += blockDim.x) {
        const int source = i / local_experts;
        const int le = i % local_experts;
        const int* totals = ep_area<int>(p.peer_bases, source, p.normal.area, p.normal.off_totals);
        layout.expert_base[i] = totals[p.world + p.rank * local_experts + le];
    }
    if (threadIdx.x < p.world) {
        const int* totals = ep_area<int>(p.peer_bases, threadIdx.x, p.normal.area, p.normal.off_totals);
        layout.source_offset[threadIdx.x + 1] = totals[p.rank];
    }
}

// Completes `layout` from the totals ep_pull_read_totals read, with the
// whole block: the source-order rows of each source, and each local
// expert's rows from earlier sources, real rows and padded segment start.
// Returns false (and records the error) when a total is out of range,
// which only a peer that wrote garbage can cause; the sizes must then not
// be used.
__device__ bool ep_pull_layout(const DispatchParams& p, PullLayout& layout) {
    const int local_experts = p.num_experts / p.world;
    __syncthreads();
    // A thread per local expert: its rows from earlier sources, its total,
    // and its padded segment size, scanned into segment starts below.
    bool sane = true;
    for (int le = threadIdx.x; le < local_experts; le += blockDim.x) {
        int running = 0;
        for (int s = 0; s < p.world; ++s) {
            const int count = layout.expert_base[s * local_experts + le];
            sane = sane && count >= 0 && count <= p.max_tokens;
            layout.expert_base[s * local_experts + le] = running;
            running += sane ? count : 0;
        }
        layout.expert_total[le] = running;
        layout.scan[le] = (static_cast<long long>(running) + p.alignment - 1) / p.alignment * p.alignment;
    }
    if (threadIdx.x == 0) {
        layout.source_offset[0] = 0;
        for (int s = 0; s < p.world; ++s) {
            const int count = layout.source_offset[s + 1];
            sane = sane && count >= 0 && count <= p.max_tokens;
            layout.source_offset[s + 1] = layout.source_offset[s] + (sane ? count : 0);
        }
    }
    sane = __syncthreads_and(sane);
    const long long padded_rows = ep_block_exclusive_scan(layout.scan, local_experts, layout.warp_sums);
    for (int le = threadIdx.x; le < local_experts; le += blockDim.x) {
        layout.expert_offset[le] = static_cast<int>(min(layout.scan[le], padded_rows));
    }
    if (threadIdx.x == 0) {
        layout.expert_offset[local_experts] = static_cast<int>(min(padded_rows, 0x7fffffffLL));
        if (!sane) {
            ep_record_error(p.status, EP_STATUS_INVALID_ARGUMENT, -1, EP_PHASE_DISPATCH, 0);
        }
    }
    __syncthreads();
    return sane;
}

// The grid's last block (ep_last_block; the others return at once): the
// layout's outputs: the received rows (0 when the layout is not sane), the
// handle's rows (0 unless they fit the buffers), and the expert-major
// offsets and real rows (also the handle's copy). A host that waits for
// the counts (`host_counts`) learns them here, before the rows move: after
// the counts, thread 0 publishes the dispatch's number (host_counts_seq,
// when not 0) behind them.
__device__ __forceinline__ void ep_pull_publish_layout(const DispatchParams& p,
                                                       const PullLayout& layout, bool sane,
                                                       bool fits, int local_experts) {
    if (ep_last_block() && threadIdx.x == 0) {
        const int written_rows = sane ? layout.source_offset[p.world] : 0;
        ep_store_optional(p.recv_num_rows, 0, written_rows);
        *p.handle_num_rows = fits ? layout.source_offset[p.world] : 0;
        ep_store_optional(p.host_counts, 0, written_rows);
    }
    if (ep_last_block() && sane) {
        for (int le = threadIdx.x; le <= local_experts; le += blockDim.x) {
            if (p.expert_x != nullptr) {
                p.expert_offsets[le] = layout.expert_offset[le];
            }
            p.handle_expert_layout[le] = layout.expert_offset[le];
            if (le < local_experts) {
                p.handle_expert_layout[local_experts + 1 + le] = layout.expert_total[le];
                ep_store_optional(p.expert_counts, le, layout.expert_total[le]);
                ep_store_optional(p.host_counts, 1 + le, layout.expert_total[le]);
            }
        }
    }
    if (ep_last_block() && p.host_counts != nullptr && p.host_counts_seq != 0) {
        // The barrier orders every thread's counts before thread 0's
        // release (a release is cumulative: it publishes the stores the
        // barrier ordered before it), which the host's acquire pairs with
        // (src/runtime/gpu/normal.rs, `wait_for_host_counts`).
        __syncthreads();
        if (threadIdx.x == 0) {
            ep_st_release_sys(p.host_counts + 1 + local_experts, p.host_counts_seq);
        }
    }
}

// One warp: received (source-order) row `row`: its source's record (token,
// and per slot the local expert, weight and rank among the source's rows
// for that expert) into the outputs and the handle, then the token's row
// and scales into recv_x and into its expert-major rows.
__device__ __forceinline__ void ep_pull_row(const DispatchParams& p, PullLayout& layout, int row,
                                            int local_experts, int warp, int lane) {
    int source = 0;
    while (layout.source_offset[source + 1] <= row) {
        ++source;
    }
    // The source's record for this row, in this rank's own area.
    const int64_t record =
        static_cast<int64_t>(source) * p.max_tokens + row - layout.source_offset[source];
    const int marked = ep_area<int>(p.peer_bases, p.rank, p.normal.area, p.normal.off_in_token)[record];
    const int token = marked & ~EP_ONE_RANK_BIT;

    // Lane k < topk handles slot k: its local expert, weight and
    // expert-major row.
    int local = -1;
    float weight = 0.0f;
    int pos = -1;
    if (lane < p.topk) {
        const int64_t slot = record * p.topk + lane;
        local = ep_area<int>(p.peer_bases, p.rank, p.normal.area, p.normal.off_in_local)[slot];
        if (local >= 0 && local < local_experts) {
            weight = ep_area<float>(p.peer_bases, p.rank, p.normal.area, p.normal.off_in_weight)[slot];
            pos = layout.expert_offset[local] +
                  layout.expert_base[source * local_experts + local] +
                  ep_area<int>(p.peer_bases, p.rank, p.normal.area, p.normal.off_in_rank)[slot];
        } else {
            local = -1;
        }
    }
    if (lane < p.topk) {
        const int64_t out = static_cast<int64_t>(row) * p.topk + lane;
        ep_store_optional(p.recv_topk_idx, out, local);
        ep_store_optional(p.recv_topk_weights, out, weight);
        p.handle_row_expert_pos[out] = pos;
        p.handle_row_weights[out] = weight;
        if (pos >= 0) {
            ep_store_optional(p.expert_weights, pos, weight);
            ep_store_optional(p.expert_src_row, pos, row);
        }
    }
    if (lane == 0) {
        ep_store_optional(p.recv_src_info, 2 * row, source);
        ep_store_optional(p.recv_src_info, 2 * row + 1, token);
        p.handle_row_src[2 * row] = source;
        // The mark stays for a token of this rank's own (ep_row_source).
        p.handle_row_src[2 * row + 1] = source == p.rank ? marked : token;
    }

    // The expert-major rows of this token, in slot order (none when the
    // fused kernel moves them, `skip_expert_rows`).
    const unsigned has_pos = __ballot_sync(0xffffffffu, pos >= 0);
    const int num_extra = p.expert_x == nullptr || p.skip_expert_rows ? 0 : __popc(has_pos);
    if (num_extra > 0 && pos >= 0) {
        layout.destinations[warp][__popc(has_pos & ep_lanemask_lt())] = pos;
    }
    __syncwarp();
    const int* extra_rows = layout.destinations[warp];
    const uint8_t* src = ep_token_row(p, source, token);
    uint8_t* dst = p.recv_x == nullptr ? nullptr : p.recv_x + static_cast<int64_t>(row) * p.row_bytes;
    if (dst != nullptr || num_extra > 0) {
        ep_warp_copy_row<EP_PULL_COPY_UNROLL>(src, dst, p.expert_x, extra_rows, num_extra,
                                              p.row_bytes, lane);
    }

    if (p.scale_cols > 0 && (dst != nullptr || num_extra > 0)) {
        const float* scales = ep_token_scales(p, source, token);
        for (int c = lane; c < p.scale_cols; c += 32) {
            const float v = scales[c];
            if (p.recv_x != nullptr) {
                p.recv_scales[static_cast<int64_t>(row) * p.scale_cols + c] = v;
            }
            for (int i = 0; i < num_extra; ++i) {
                p.expert_scales[static_cast<int64_t>(extra_rows[i]) * p.scale_cols + c] = v;
            }
        }
    }
    __syncwarp();
}

// One warp: expert-major row `r`, if it is padding of its expert's segment:
// zeros (unless the fused kernel writes them, `skip_expert_rows`, or the
// caller keeps them, `keep_padding`), weight 0, row -1.
__device__ __forceinline__ void ep_pull_padding_row(const DispatchParams& p,
                                                    const PullLayout& layout, int r,
                                                    int local_experts, int lane) {
    // The expert whose segment holds row r.
    const int lo = ep_segment_of(layout.expert_offset, local_experts, r);
    if (r < layout.expert_offset[lo] + layout.expert_total[lo]) {
        return;  // a real row
    }
    if (!p.skip_expert_rows && !p.keep_padding) {
        int4* x = reinterpret_cast<int4*>(p.expert_x + static_cast<int64_t>(r) * p.row_bytes);
#pragma unroll 4
        for (int i = lane; i < p.row_bytes / 16; i += 32) {
            x[i] = make_int4(0, 0, 0, 0);
        }
        for (int c = lane; c < p.scale_cols; c += 32) {
            p.expert_scales[static_cast<int64_t>(r) * p.scale_cols + c] = 0.0f;
        }
    }
    if (lane == 0) {
        ep_store_optional(p.expert_weights, r, 0.0f);
        ep_store_optional(p.expert_src_row, r, -1);
    }
}

extern "C" __global__ void __launch_bounds__(EP_MOVE_THREADS)
    ep_dispatch_pull_kernel(const DispatchParams p) {
    ep_kernel_start();
    ep_clear_chunk_sync(p);
    __shared__ PullLayout layout;
    // The barrier words and the totals in one round trip (see
    // ep_pull_read_totals).
    const EpBarrierWords words = ep_barrier_words(p.peer_bases[p.rank]);
    ep_pull_read_totals(p, layout);
    if (!words.last_passed()) {
        return;
    }
    const int local_experts = p.num_experts / p.world;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;

    const bool sane = ep_pull_layout(p, layout);
    const int64_t padded_rows = layout.expert_offset[local_experts];
    const bool fits = sane &&
                      (p.recv_x == nullptr || layout.source_offset[p.world] <= p.recv_capacity) &&
                      (p.expert_x == nullptr || padded_rows <= p.expert_capacity);
    ep_pull_publish_layout(p, layout, sane, fits, local_experts);
    if (!fits) {
        return;
    }

    const int rows = layout.source_offset[p.world];
    const int items = ep_spread_items(rows, p.world);
    for (int i = ep_first_item(warp); i < items; i += ep_item_stride()) {
        const int row = ep_spread_row(i, rows, p.world, p.rank);
        if (row >= 0) {
            ep_pull_row(p, layout, row, local_experts, warp, lane);
        }
    }

    // Padding rows of the expert-major segments. Every warp of the grid
    // takes rows of the whole expert-major region in turn (a warp per expert
    // would leave most of the GPU idle, and at small token counts the
    // padding is most of the output).
    if (p.expert_x == nullptr) {
        return;
    }
    for (int r = ep_first_item(warp); r < padded_rows; r += ep_item_stride()) {
        ep_pull_padding_row(p, layout, r, local_experts, lane);
    }
}

// ---------------------------------------------------------------------------
// Combine
// ---------------------------------------------------------------------------

// Combine 1: send (grid = SM budget, EP_MOVE_THREADS threads). A warp per
// received row writes its BF16 row into the source's returned rows, or
// into `out` for a token that stays home (ep_combine_row_dst).
extern "C" __global__ void __launch_bounds__(EP_MOVE_THREADS)
    ep_combine_send_kernel(const CombineParams p) {
    ep_kernel_start();
    __shared__ int slot_rows[EP_MOVE_WARPS][EP_MAX_TOPK];
    __shared__ float slot_weights[EP_MOVE_WARPS][EP_MAX_TOPK];
    // The combine's first kernel starts the collective call, from the
    // grid's last warp: the last to get a row (ep_first_item), so no row
    // waits for its system-scope fence.
    if (ep_last_warp_of_grid() && threadIdx.x % 32 == 0) {
        ep_begin_collective(p.peer_bases[p.rank], p.collective);
    }
    // After a failed dispatch the handle's rows cannot be trusted.
    if (!ep_last_barrier_passed(p.peer_bases[p.rank])) {
        return;
    }
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int rows = *p.handle_num_rows;
    if (p.x == nullptr && rows > 0) {
        if (blockIdx.x == 0 && threadIdx.x == 0) {
            ep_record_error(p.status, EP_STATUS_INVALID_ARGUMENT, -1, EP_PHASE_COMBINE, rows);
        }
        return;
    }
    const int vectors = p.hidden / 8;
    const int4* x = reinterpret_cast<const int4*>(p.x);
    const int items = ep_spread_items(rows, p.world);
    for (int i = ep_first_item(warp); i < items; i += ep_item_stride()) {
        const int row = ep_spread_row(i, rows, p.world, p.rank);
        if (row < 0) {
            continue;
        }
        if (!p.expert_major) {
            bool home;
            uint8_t* dst = reinterpret_cast<uint8_t*>(ep_combine_row_dst(p, row, vectors, &home));
            const uint8_t* src =
                reinterpret_cast<const uint8_t*>(x + static_cast<int64_t>(row) * vectors);
            if (home) {
                ep_warp_copy_row<EP_COPY_UNROLL, true>(src, dst, nullptr, nullptr, 0, p.hidden * 2,
                                                       lane);
            } else {
                ep_warp_copy_row(src, dst, nullptr, nullptr, 0, p.hidden * 2, lane);
            }
            continue;
        }
        ep_combine_send_row(p, row, slot_rows[warp], slot_weights[warp], 0, vectors, lane);
        __syncwarp();
    }
}

// Combine 3: reduce (grid = SM budget, EP_MOVE_THREADS threads). A warp per
// token of this rank sums the rows the ranks returned for it; a token that
// stays home (ep_stays_home) the send has written already.
//
// Loads in flight: each lane loads EP_REDUCE_UNROLL vectors of a returned
// row before it adds them, one row at a time. A token has one returned row
// per rank it went to, so at small world sizes the combine send's shape
// (EP_SUM_ROWS_IN_FLIGHT rows of EP_SUM_UNROLL vectors) left 4 loads per
// lane in flight, and with the SM budget's few warps the sum waited on
// memory latency; from two rows on the loads in flight are as many as with
// that shape (bench/RESULTS.md, 2026-11-27, the reduce's loads in flight).
#define EP_REDUCE_UNROLL 8
#define EP_REDUCE_ROWS_IN_FLIGHT 1
extern "C" __global__ void __launch_bounds__(EP_MOVE_THREADS)
    ep_combine_reduce_kernel(const CombineParams p) {
    ep_kernel_start();
    if (!ep_last_barrier_passed(p.peer_bases[p.rank])) {
        return;
    }
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int vectors = p.hidden / 8;
    const int4* returned = ep_area<int4>(p.peer_bases, p.rank, p.normal.area, p.normal.off_returned);
    int4* out = reinterpret_cast<int4*>(p.out);
    for (int token = ep_first_item(warp); token < p.num_tokens; token += ep_item_stride()) {
        const uint64_t ranks = ep_token_ranks(p, token, lane);
        if (ep_stays_home(p, ranks)) {
            continue;
        }
        // Rank r's returned row, when the token went to r.
        const auto returned_row = [&](int r, const int4*& row, float& w) {
            row = returned + (static_cast<int64_t>(r) * p.max_tokens + token) * vectors;
            w = 1.0f;
            return ((ranks >> r) & 1) != 0;
        };
        for (int base = lane; base < vectors; base += 32 * EP_REDUCE_UNROLL) {
            float acc[EP_REDUCE_UNROLL][8] = {};
            ep_add_weighted_rows<EP_REDUCE_UNROLL, EP_REDUCE_ROWS_IN_FLIGHT>(
                acc, p.world, returned_row, base, vectors);
            ep_store_bf16_vectors(out + static_cast<int64_t>(token) * vectors, acc, base, vectors);
        }
    }
}
