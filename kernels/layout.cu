// Dispatch layout: from the router's top-k expert choices, count how many
// (token, slot) entries go to each expert, how many tokens go to each rank,
// and which ranks each token must be sent to.
//
// Experts are spread evenly over ranks: rank r owns experts
// [r * E/world, (r + 1) * E/world), with E = num_experts.
//
// Grid: exactly `world` blocks, any block size that is a multiple of 32 up to
// 1024 (256 is a good choice). Block r owns rank r: it scans every token and
// writes
//   - tokens_per_expert[e] for the experts of rank r,
//   - tokens_per_rank[r],
//   - is_token_in_rank[t * world + r] for every token t.
// Every output element therefore has exactly one writer and is written with a
// plain store, whatever the previous contents: no zeroing beforehand, no
// global atomics, and num_tokens == 0 is an ordinary launch that writes
// zero counts. The price is that each block reads the whole topk_idx array
// (L2 serves the repeats) and that only `world` SMs work; that is cheap next
// to the data movement this layout plans.
//
// Arguments (LayoutParams, ep_abi.h) checked here (code
// EP_STATUS_INVALID_ARGUMENT, nothing written): blockDim.x % 32 == 0,
// num_tokens >= 0, 1 <= topk, 1 <= world == gridDim.x,
// 1 <= num_experts <= EP_MAX_EXPERTS and num_experts % world == 0.
//
// Expert ids: -1 means "no expert" (a dropped slot) and is skipped. A slot
// whose id is outside [0, num_experts), or repeats an earlier slot of the
// same token (ep_effective_experts, as the dispatch kernels route), is never
// counted or used as an index: block 0 records EP_STATUS_INVALID_EXPERT with
// detail = token * topk + slot (the first recorded wins; which bad entry
// that is, when there are several, is not defined), and every block skips
// the entry. The reference rejects such routing (src/reference/layout.rs).
#include "ep_device.cuh"

extern "C" __global__ void ep_layout_kernel(const LayoutParams p) {
    ep_kernel_start();
    const int* topk_idx = p.topk_idx;
    const int num_tokens = p.num_tokens;
    const int topk = p.topk;
    const int num_experts = p.num_experts;
    const int world = p.world;
    EpDeviceStatus* status = p.status;
    // Every thread evaluates the same condition, so the whole grid returns
    // together and no thread is left at a __syncthreads below.
    bool bad_arguments = blockDim.x % 32 != 0 || num_tokens < 0 || topk < 1 || world < 1 ||
                         world != static_cast<int>(gridDim.x) || num_experts < 1 ||
                         num_experts > EP_MAX_EXPERTS || num_experts % world != 0;
    if (bad_arguments) {
        if (blockIdx.x == 0 && threadIdx.x == 0) {
            ep_record_error(status, EP_STATUS_INVALID_ARGUMENT, -1, EP_PHASE_LAYOUT, 0);
        }
        return;
    }

    // The per-block histogram lives in static shared memory: 4 KiB.
    __shared__ int expert_count[EP_MAX_EXPERTS];
    __shared__ int token_count;

    const int rank = blockIdx.x;
    const int experts_per_rank = num_experts / world;
    const int first_expert = rank * experts_per_rank;

    for (int i = threadIdx.x; i < experts_per_rank; i += blockDim.x) {
        expert_count[i] = 0;
    }
    if (threadIdx.x == 0) {
        token_count = 0;
    }
    __syncthreads();

    int my_tokens = 0;  // tokens of this thread that go to `rank`
    for (int token = threadIdx.x; token < num_tokens; token += blockDim.x) {
        bool in_rank = false;
        int ids[EP_MAX_TOPK], experts[EP_MAX_TOPK];
        ep_effective_experts(topk_idx + static_cast<int64_t>(token) * topk, topk, num_experts, ids,
                             experts);
#pragma unroll
        for (int slot = 0; slot < EP_MAX_TOPK; ++slot) {
            if (slot >= topk) {
                break;
            }
            const int expert = experts[slot];
            if (expert < 0) {
                if (rank == 0 && ids[slot] != -1) {
                    ep_record_error(status, EP_STATUS_INVALID_EXPERT, -1, EP_PHASE_LAYOUT,
                                    token * topk + slot);
                }
                continue;
            }
            // Unsigned compare: one test for first_expert <= expert < end.
            const unsigned local = static_cast<unsigned>(expert - first_expert);
            if (local < static_cast<unsigned>(experts_per_rank)) {
                atomicAdd(&expert_count[local], 1);
                in_rank = true;
            }
        }
        p.is_token_in_rank[static_cast<int64_t>(token) * world + rank] = in_rank ? 1 : 0;
        my_tokens += in_rank ? 1 : 0;
    }

    // Sum the per-thread token counts: within each warp by shuffles, then one
    // shared atomic per warp.
    for (int offset = 16; offset > 0; offset /= 2) {
        my_tokens += __shfl_down_sync(0xffffffffu, my_tokens, offset);
    }
    if (threadIdx.x % 32 == 0) {
        atomicAdd(&token_count, my_tokens);
    }
    __syncthreads();

    for (int i = threadIdx.x; i < experts_per_rank; i += blockDim.x) {
        p.tokens_per_expert[first_expert + i] = expert_count[i];
    }
    if (threadIdx.x == 0) {
        p.tokens_per_rank[rank] = token_count;
    }
}
