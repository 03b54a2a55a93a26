// Low-latency (LL) mode: dispatch and combine of a few hundred decode tokens
// over NVLink, one kernel launch per call, no host synchronisation, safe to
// capture in a CUDA graph. The semantics are src/reference/low_latency.rs
// (and src/reference/fp8.rs for the quantization), bit for bit.
//
// Notation: W = world, M = ll_max_tokens_per_rank, K = topk, L = local
// experts, H = hidden, J = K + W (return rows per token, see below), C =
// ceil(H / 512) (512-channel chunks of a combine row).
//
// The design goal is a short critical path: every receiver learns where each
// row goes from the first message of each source (its per-expert counts),
// so rows are placed as they arrive, and the combine moves and sums rows in
// chunks spread over every warp of the GPU, each chunk with its own signal.
//
// ---------------------------------------------------------------------------
// Buffer layout (byte offsets computed in src/runtime/gpu/low_latency.rs,
// identical on every rank, the area zeroed when the context is created)
// ---------------------------------------------------------------------------
// Written by peers (the sets alternate between calls: set = seq & 1):
//   dispatch_flags  [2][W] int    source s announces call `seq` here, after
//   dispatch_counts [2][W][S]     ...its rows for each local expert of THIS
//                                 rank, then its token count (entry L), then
//                                 (from another node only) the mask of the
//                                 tokens it sent here; S = counts_stride
//   dispatch_tags   [2][W][M] int token t of source s has arrived (= seq)
//   dispatch_msgs   [2][W][M] messages, `msg_bytes` each:
//       int   route[16]   per slot: the slot's expert | position of the
//                         (token, slot) among the source's rows for that
//                         expert << EP_LL_ROUTE_POS_SHIFT (16); -1 for no
//                         expert (the same header goes to every rank, each
//                         keeps its experts)
//       float weight[16]  per slot: the routing weight (0 without weights)
//       data              FP8: H codes then H/128 fp32 scales; BF16: 2H bytes
//   dispatch_acks   [W] int       rank d has finished receiving its dispatch
//                                 call `value` (rank d writes slot [d])
//   combine_tags    [2][M][J][C]  chunk c of return row j of token t has
//                                 arrived (= seq)
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
//   dispatch_tokens [W] int       tokens each source sent in the last dispatch
//   token_rows      [W][M][K] int masked-layout row of each received (source,
//                                 token, slot), or -1: what the combine sends
//   token_weights   [W][M][K] f32 the weight of that row
//   combine_buffer  [L][W*M][H]   BF16, for EP_LL_ZERO_COPY (only the caller
//                                 writes it, but across nodes)
// Across nodes only (see below; empty with one node):
//   net_signals     [8][W] u64    the emulated network signals
//   net_counts      [W][S] int    staged counts for each rank
//   net_msgs        [M]           staged message of each token
//   net_partials    [W][M][H]     staged partial sums (weights at dispatch)
//
// ---------------------------------------------------------------------------
// Dispatch, call number `seq` (seq = counters.dispatch_seq + 1 when the send
// phase runs; a receive-only launch uses the current value)
// ---------------------------------------------------------------------------
// Send (every block):
//   1. wait until dispatch_acks[d] >= seq - 2 for every rank d: d has read
//      everything of the set we are about to overwrite (call seq - 2 used it;
//      each block's first look is taken while the call is numbered);
//   2. every block reads the whole routing into shared memory (the effective
//      expert of each (token, slot): -1 for dropped, invalid and repeated
//      ids); it is a few KB, read from L2;
//   3. block d (for each rank d): counts this rank's rows for each of d's
//      local experts, stores them and the token count into d's
//      dispatch_counts[set][rank], then __syncthreads and RELEASE-stores seq
//      into d's dispatch_flags[set][rank];
//   4. per token t (a block per token, from block W on): the position of each (t, slot) among
//      this rank's rows for its expert (the number of earlier tokens routed
//      to that expert, one warp per slot); the header into slot
//      [set][rank][t] of EVERY rank of the node, and the quantized row (or
//      BF16 copy) into the ranks that hold at least one of its experts: a
//      token crosses NVLink once per destination rank, not once per expert. Then
//      __syncthreads, and thread d RELEASE-stores seq into rank d's
//      dispatch_tags[set][rank][t] (a release is cumulative: it publishes
//      the other threads' stores the barrier ordered before it).
// Receive (every block):
//   5. ACQUIRE-wait every source's flag; the prefix over sources of the
//      counts gives the first row of each (local expert, source); block 0
//      writes recv_count, recv_layout_range and dispatch_tokens;
//   6. a warp per (source, token, 1 KB chunk of the row), dealt from half a
//      grid away from the sending blocks, as soon as the token's tag
//      arrives: reads the header and copies its chunk to every local
//      expert's row the header names (row = first row of (expert, source) +
//      position); the first chunk's warp also copies the scales and
//      src_info and notes (row, weight) per slot in token_rows /
//      token_weights for the combine.
// Start (every launch with a send phase, see begin_call): each block reads
// counters.dispatch_seq; the grid's last block (the keeper) RELEASE-stores
// seq - 1 into dispatch_acks[rank] of every rank: this rank's receive of
// call seq - 1 ended before this launch began (step 1 of their call seq +
// 1). The other blocks count their arrival (a release add, not waited
// for), and at the end of its launch the keeper, having seen them all,
// stores seq for the next launch (end_call). No other block waits at the
// end of a kernel.
//
// Combine mirrors it, in 512-channel chunks: the expert side waits
// combine_acks >= seq - 2; a warp per (source, token, chunk) of the last
// dispatch sends either the chunk of each of its rows (j = slot) or of one
// partial row sum_{local experts ascending} w * y rounded to BF16 (j = K +
// rank), then RELEASE-stores the chunk's tags. On the source side a warp per
// (token, chunk) ACQUIRE-waits the tags of the rows its routing expects and
// sums them in fp32 (slots ascending, or expert ranks ascending), products
// rounded before they are added (__fmul_rn / __fadd_rn, never an FMA), as
// the reference.
//
// In flight: a rank may run the send phase of call seq while a peer still
// receives call seq - 1 (the other set); it waits until the peer has
// started call seq - 1, which it does only after receiving seq - 2. Nothing is ever reset, values only grow, so a late reader sees a
// stale value as "not yet" (ep_reached). A rank that stops calling makes its
// peers time out (EP_STATUS_TIMEOUT), never read a half-written set.
//
// Scopes: RELEASE and ACQUIRE above are at system scope between ranks on
// different GPUs, and at GPU scope between ranks whose kernels run on the
// same GPU (LlParams::gpu_peers: ranks that share it, and a rank with
// itself), where a release need not make the earlier writes visible beyond
// this GPU (MEMBAR.GPU, not MEMBAR.SYS). Both ends of a signal agree on its
// scope: both know the placement.
//
// Collective calls: a launch with a send phase is a new collective call of
// the rank (ep_device.cuh, "Collective calls"): begin_call publishes its
// call word, and every wait above reads the peer's word now and then, so a
// peer in another call (a normal-mode call, the other low-latency operation,
// or a later call) ends the wait at once with EP_STATUS_MISMATCH instead of
// a timeout. A receive-only launch waits under its send's word (kept in
// LlCounters).
//
// Co-residency: blocks wait for each other (steps 5 and 6 for the sends of
// every block of every rank, step 1 for acknowledgements), so no block may
// wait for one that cannot start. Within one rank's grid the launch is
// cooperative: the driver starts the grid only when all its blocks are
// resident. That is not enough when R ranks share a GPU (threads of one
// process, src/runtime/gpu/placement.rs): it makes a grid co-resident with
// itself, not with the other ranks' grids. What makes them fit together is
// the share: each rank's grid is one block per SM of G = floor(SMs / R), and
// one block of each kernel fits on an empty SM (checked at create). A rank
// runs its kernels in order on one stream, so it has at most one waiting
// kernel resident at a time, on at most G SMs (the normal mode's barrier
// kernel is one block). All ranks' waiting kernels together thus need at
// most R * G <= SMs SMs: while some rank's grid waits to start, at least G
// SMs hold no waiting kernel, and whatever else runs there (the normal
// mode's copy kernels, the application's kernels) never waits for a peer
// and finishes, after which the grid is resident. (A rank with a GPU of its
// own launches its kernels as programmatic dependents: blocks of the next
// kernel may be resident early, but they wait only for the kernel ahead on
// the stream, never for a peer; ranks that share a GPU do not.) Waits are
// bounded all the same (ep_wait_until_ge); kernels never trap.
//
// Across nodes: with several nodes (ranks_per_node), what goes to a rank of
// another node (bit r of net_mask) takes the network leg of
// kernels/include/ep_net.cuh instead of stores: a put from this rank's
// buffer into the peer's, over GIN where the peer is not mapped here and
// emulated over NVLink where it is (virtual nodes), with the same buffers,
// order and signals. A put's data is staged first (net_counts, net_msgs,
// the combine buffer's row, net_partials), lands where a store would have
// put it, and the tags and flags become signals (rows EP_LL_SIGNAL_*,
// one per peer):
//   - counts: step 3 puts [S] ints with the mask of the tokens that have an
//     expert on d and adds 1 to d's counts signal of the set; the receiver
//     waits for the set's call count instead of the flag;
//   - tokens: step 4 stages each token's message once and puts it to every
//     network destination with an expert there, each put adding 1 to that
//     rank's tokens signal of the set; step 3 adds the rest of
//     EP_LL_NET_CALL_UNIT (unit - tokens sent). The receiver skips tokens
//     not in the mask and, instead of a token's tag, waits until the signal
//     reaches calls on the set * unit: all of that source's tokens are in;
//   - combine: a chunk's put adds 1 to the source's combine signal of the
//     set, a closing add the rest of the unit (from token_rows, what the
//     puts will be); the source waits for that instead of the chunk's tag;
//   - acknowledgements: begin_call adds 1 to d's acknowledgement signal
//     from call 2 on, so it counts like the int (seq - 1).
// Only this rank writes a peer's signal of its column, values only grow, and
// a call's data signal stays below the next multiple of the unit until all
// of its puts have landed (GIN makes a put's add visible after its
// payload; the emulation fences at system scope before the add). A set is
// rewritten only two calls later, after the acknowledgement, as in one node.
// A send phase ends with NCCL's flush, so the staging may be rewritten by
// the next launch.
//
// Expert ids: an id outside [0, E) other than -1, or one repeated within a
// token, counts as -1 everywhere and the dispatch reports
// EP_STATUS_INVALID_EXPERT (the reference rejects such routing).
//
// Token count: the launch's num_tokens, or the caller's device scalar read
// when the launch runs (the send phase of a dispatch, the receive phase of a
// combine), so that one captured graph serves changing batch sizes; see
// call_tokens.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "ep_net.cuh"

// Warps of both kernels' blocks (EP_LL_THREADS threads, ep_abi.h).
#define EP_LL_WARPS (EP_LL_THREADS / 32)
// FP8 scales of a row per lane.
#define EP_LL_SCALES_PER_LANE (EP_MAX_HIDDEN / EP_HIDDEN_ALIGNMENT / 32)
// 16-byte vectors of the chunks a warp moves at once, 2 per lane: 1 KB of
// a dispatch message, EP_LL_CHUNK_CHANNELS channels of a combine row.
#define EP_LL_CHUNK_VECS (EP_LL_CHUNK_CHANNELS / 8)
#define EP_LL_LANE_VECS (EP_LL_CHUNK_VECS / 32)
// Rows whose chunks a combine warp loads before it adds or stores them.
#define EP_LL_ROWS_IN_FLIGHT 4
// A slot's route in a message header: its expert in the low bits, the
// position of the (token, slot) among the source's rows for that expert
// from bit EP_LL_ROUTE_POS_SHIFT on.
#define EP_LL_ROUTE_POS_SHIFT 16
#define EP_LL_ROUTE_EXPERT_MASK ((1 << EP_LL_ROUTE_POS_SHIFT) - 1)

// The kernels' parameters (LlParams) and this rank's counters (LlCounters)
// are defined in src/abi/defs.rs and reach this file through ep_abi.h.

namespace {

// ---------------------------------------------------------------------------
// Addresses
// ---------------------------------------------------------------------------

// Every rank's buffer as mapped here (LlParams::peer_bases; 0 for a rank
// reached only over the network), copied into shared memory by each block
// at the start of a launch (load_peer_bases): an address in a peer's area
// then takes no round trip to global memory.
__shared__ uint64_t s_peer_bases[EP_MAX_WORLD_SIZE];

// Block-wide, first thing in a launch; begin_call's barrier orders it
// before every use (ll_at, peer_base).
__device__ __forceinline__ void load_peer_bases(const LlParams& p) {
    for (int r = threadIdx.x; r < p.world; r += blockDim.x) {
        s_peer_bases[r] = p.peer_bases[r];
    }
}

__device__ __forceinline__ uint64_t peer_base(int rank) {
    return s_peer_bases[rank];
}

template <typename T>
__device__ __forceinline__ T* ll_at(const LlParams& p, int rank, int64_t offset) {
    return reinterpret_cast<T*>(peer_base(rank) + p.area + offset);
}

__device__ __forceinline__ int local_experts(const LlParams& p) {
    return p.num_experts / p.world;
}

// The tokens of this call: the caller's device scalar when given (read when
// the launch runs, so replays of a captured graph may change it; the launch's
// num_tokens is then its bound), else the launch's num_tokens. An
// out-of-range count is recorded as EP_STATUS_INVALID_TOKEN_COUNT and the call
// goes on with no tokens (its waits then give up as after any error, so the
// peers may time out).
__device__ int call_tokens(const LlParams& p, int phase) {
    if (p.device_num_tokens == nullptr) {
        return p.num_tokens;
    }
    const int n = *p.device_num_tokens;
    if (n >= 0 && n <= p.num_tokens) {
        return n;
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        ep_record_error(p.status, EP_STATUS_INVALID_TOKEN_COUNT, -1, phase, n);
    }
    return 0;
}

__device__ __forceinline__ LlCounters* counters(const LlParams& p) {
    // Read before load_peer_bases (the counters are the launch's first
    // reads): from the parameters' array.
    return reinterpret_cast<LlCounters*>(p.peer_bases[p.rank] + p.area + p.off_counters);
}

// Offset in the area of source `source`'s counts of set `set`: [L] rows per
// local expert, [L] the token count, then (from a rank on another node) the
// mask of the tokens it sent.
__device__ __forceinline__ int64_t counts_offset(const LlParams& p, int set, int source) {
    return p.off_dispatch_counts +
           (static_cast<int64_t>(set) * p.world + source) * p.counts_stride * sizeof(int);
}

__device__ __forceinline__ int* dispatch_counts(const LlParams& p, int rank, int set, int source) {
    return ll_at<int>(p, rank, counts_offset(p, set, source));
}

// Offset in the area of message slot [set][source][token].
__device__ __forceinline__ int64_t msg_offset(const LlParams& p, int set, int source, int token) {
    const int64_t slot = (static_cast<int64_t>(set) * p.world + source) * p.max_tokens + token;
    return p.off_dispatch_msgs + slot * p.msg_bytes;
}

// Message slot [set][source][token] in `rank`'s buffer.
__device__ __forceinline__ uint8_t* dispatch_msg(const LlParams& p, int rank, int set, int source,
                                                 int token) {
    return ll_at<uint8_t>(p, rank, msg_offset(p, set, source, token));
}

// Bytes of a message that carry data: the header, then the FP8 codes and
// scales or the BF16 row.
__device__ __forceinline__ int msg_used_bytes(const LlParams& p) {
    const int row = p.fp8 ? p.hidden + p.hidden / EP_HIDDEN_ALIGNMENT * 4 : 2 * p.hidden;
    return EP_LL_HEADER_BYTES + row;
}

__device__ __forceinline__ int* dispatch_tag(const LlParams& p, int rank, int set, int source,
                                             int token) {
    return ll_at<int>(p, rank, p.off_dispatch_tags) +
           (static_cast<int64_t>(set) * p.world + source) * p.max_tokens + token;
}

__device__ __forceinline__ int combine_rows_per_token(const LlParams& p) {
    return p.topk + p.world;
}

// 16-byte vectors of a BF16 row, and the combine's chunks of one.
__device__ __forceinline__ int row_vecs(const LlParams& p) {
    return p.hidden / 8;
}

__device__ __forceinline__ int chunks_per_row(const LlParams& p) {
    return (row_vecs(p) + EP_LL_CHUNK_VECS - 1) / EP_LL_CHUNK_VECS;
}

// Index of return row j of token t in set `set`, in combine_rows (times H).
__device__ __forceinline__ int64_t combine_slot(const LlParams& p, int set, int token, int j) {
    return (static_cast<int64_t>(set) * p.max_tokens + token) * combine_rows_per_token(p) + j;
}

// The tag of chunk c of that row, in `rank`'s buffer.
__device__ __forceinline__ int* combine_tag(const LlParams& p, int rank, int set, int token, int j,
                                            int c) {
    return ll_at<int>(p, rank, p.off_combine_tags) +
           combine_slot(p, set, token, j) * chunks_per_row(p) + c;
}

// (source, token, slot) entry of token_rows / token_weights.
__device__ __forceinline__ int64_t token_entry(const LlParams& p, int source, int token,
                                               int slot) {
    return (static_cast<int64_t>(source) * p.max_tokens + token) * p.topk + slot;
}

// ---------------------------------------------------------------------------
// Across nodes (see "Across nodes" in the header)
// ---------------------------------------------------------------------------

// Whether `rank` is on another node: what goes to it takes the network leg.
// Each kernel has two instantiations (see the kernels at the end): kNet
// false for contexts of one node, which then carry no network code at all.
template <bool kNet>
__device__ __forceinline__ bool on_net(const LlParams& p, int rank) {
    return kNet && (p.net_mask >> rank & 1) != 0;
}

// Whether rank r's kernels run on this GPU (LlParams::gpu_peers): a signal
// between this rank and r then needs release/acquire at GPU scope only
// (ep_st_release, ep_ld_acquire).
__device__ __forceinline__ bool on_this_gpu(const LlParams& p, int r) {
    return (p.gpu_peers >> r & 1) != 0;
}

// Every rank of the world (bit r for rank r).
__device__ __forceinline__ uint64_t all_ranks(const LlParams& p) {
    return p.world == 64 ? ~0ull : (1ull << p.world) - 1;
}

// Whether every rank runs on this GPU.
__device__ __forceinline__ bool all_on_this_gpu(const LlParams& p) {
    return p.gpu_peers == all_ranks(p);
}

__device__ __forceinline__ EpNet net_of(const LlParams& p) {
    EpNet net;
    net.peer_bases = p.peer_bases;
    net.own_base = reinterpret_cast<uint8_t*>(p.peer_bases[p.rank]);
    net.signals = p.area + p.off_net_signals;
    net.comm = static_cast<const ncclDevComm*>(p.dev_comm);
    net.window = static_cast<ncclWindow_t>(p.window);
    net.gin_first_signal = p.gin_first_signal;
    return net;
}

// The signal of row `row` (EP_LL_SIGNAL_*, plus the set where it has one)
// for peer `peer`.
__device__ __forceinline__ int net_signal(const LlParams& p, int row, int peer) {
    return row * p.world + peer;
}

// Calls up to call `seq` that used its buffer set (the sets alternate).
__device__ __forceinline__ uint64_t calls_on_set(int seq) {
    return static_cast<uint64_t>((seq + 1) / 2);
}

// The value a data signal of call `seq`'s set reaches once everything a
// peer put in that call has arrived.
__device__ __forceinline__ uint64_t all_data_of(int seq) {
    return calls_on_set(seq) * static_cast<uint64_t>(EP_LL_NET_CALL_UNIT);
}

// Whether source `source` (on another node) sent token `token` of set `set`
// here: bit `token` of the mask after its counts.
__device__ __forceinline__ bool token_sent(const LlParams& p, int set, int source, int token) {
    const unsigned* mask =
        reinterpret_cast<const unsigned*>(dispatch_counts(p, p.rank, set, source) +
                                          local_experts(p) + 1);
    return (mask[token / 32] >> (token % 32) & 1) != 0;
}

// ---------------------------------------------------------------------------
// Device timestamps (LlParams::timeline, for ep-bench's per-phase breakdown)
// ---------------------------------------------------------------------------

// Thread 0 notes the global timer at `point` (EP_LL_TIME_*) of this block's
// timeline; nothing when the launch keeps none.
__device__ __forceinline__ void note_time(const LlParams& p, int point) {
    if (p.timeline != nullptr && threadIdx.x == 0) {
        p.timeline[blockIdx.x * EP_LL_TIME_POINTS + point] = ep_globaltimer_ns();
    }
}

// At the start of a launch: clears the block's points, then notes the start.
__device__ __forceinline__ void start_timeline(const LlParams& p) {
    if (p.timeline != nullptr && threadIdx.x == 0) {
        for (int point = 0; point < EP_LL_TIME_POINTS; ++point) {
            p.timeline[blockIdx.x * EP_LL_TIME_POINTS + point] = 0;
        }
    }
    note_time(p, EP_LL_TIME_START);
}

// ---------------------------------------------------------------------------
// FP8 quantization (src/reference/fp8.rs, quantize_row)
// ---------------------------------------------------------------------------

struct Fp8Vector {
    int4 codes;   // 16 E4M3 codes, channel order
    float scale;  // the scale of the vector's 128-channel block
};

// Quantizes 16 channels. The 8 lanes of each aligned group of 8 hold the
// 8 pairs of vectors of one 128-channel block: every lane of the warp must
// call this (the block maximum is a shuffle reduction); lanes without data
// pass zeros.
__device__ __forceinline__ Fp8Vector quantize_16(const int4& lo, const int4& hi, bool ue8m0) {
    float v[16];
    ep_unpack_bf16x8(lo, *reinterpret_cast<float(*)[8]>(&v[0]));
    ep_unpack_bf16x8(hi, *reinterpret_cast<float(*)[8]>(&v[8]));
    // fmaxf ignores a NaN operand, as the reference's f32::max does.
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        amax = fmaxf(amax, fabsf(v[i]));
    }
#pragma unroll
    for (int offset = 4; offset > 0; offset /= 2) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    }
    amax = fmaxf(amax, EP_AMAX_FLOOR);
    float scale, multiplier;
    if (ue8m0) {
        // Round amax / 448 up to a power of two on the bits; the reciprocal
        // of 2^(E-127) is 2^(127-E), biased exponent 254 - E (exact).
        const unsigned bits = __float_as_uint(__fdiv_rn(amax, EP_E4M3_MAX));
        unsigned exponent = bits >> 23;
        if (bits & 0x007fffffu) {
            ++exponent;
        }
        scale = __uint_as_float(exponent << 23);
        multiplier = exponent < 255 ? __uint_as_float((254 - exponent) << 23) : 0.0f;
    } else {
        scale = __fdiv_rn(amax, EP_E4M3_MAX);
        multiplier = __fdiv_rn(EP_E4M3_MAX, amax);
    }
    Fp8Vector q;
    uint8_t* codes = reinterpret_cast<uint8_t*>(&q.codes);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        codes[i] = __nv_cvt_float_to_fp8(__fmul_rn(v[i], multiplier), __NV_SATFINITE, __NV_E4M3);
    }
    q.scale = scale;
    return q;
}

// ---------------------------------------------------------------------------
// Block and warp building blocks
// ---------------------------------------------------------------------------

// The call a launch works on: its number among the operation's calls
// (`seq`, which picks the buffer set), its collective call word (see
// "Collective calls" in ep_device.cuh), and the deadline of its waits.
struct LlCall {
    int seq;
    int word;
    uint64_t deadline;
    // This thread's look at the acknowledgement it waits for in the send
    // phase (see acked_rank), taken while the call was numbered: whether
    // it looked, and what it saw.
    bool ack_looked;
    int ack_seen;
};

// The rank whose acknowledgement thread threadIdx.x waits for in a send
// phase (wait_for_acks; outside [0, world) for the others): the block's
// last `world` threads, away from warp 0, whose thread 0 numbers the call
// (begin_call) and whose first threads load the routing (dispatch_send),
// so that their round trips overlap instead of following each other.
__device__ __forceinline__ int acked_rank(const LlParams& p) {
    return static_cast<int>(threadIdx.x) - (static_cast<int>(blockDim.x) - p.world);
}

// What a wait for rank `peer` in `call` compares against (ep_peer_call):
// the peer's call word where its buffer is mapped here. A rank reached only
// by GIN cannot be read: its waits end on the clock, the abort or the
// status (this rank's own word, read again, is never elsewhere).
__device__ __forceinline__ EpPeerCall ll_peer_call(const LlParams& p, int peer,
                                                   const LlCall& call) {
    const uint64_t base = peer_base(peer);
    if (base != 0) {
        return ep_peer_call(base, call.word);
    }
    const uint64_t own = peer_base(p.rank);
    return ep_peer_call(own, ep_current_call(own));
}

// Waits until the int at `addr`, written by rank `from`, reaches `target`,
// for `call` (ep_wait_until_ge: bounded, and ended at once by a peer in
// another call).
__device__ __forceinline__ bool wait_for(const LlParams& p, const int* addr, int target,
                                         const LlCall& call, int from, int phase) {
    return ep_wait_until_ge(addr, target, call.deadline, p.abort_flag, p.status, from, phase,
                            ll_peer_call(p, from, call), on_this_gpu(p, from));
}

// Waits until this rank's network signal `id`, which rank `from` adds to,
// reaches `target` (ACQUIRE: what `from` put before its adds is visible).
__device__ __forceinline__ bool wait_for_signal(const LlParams& p, int id, uint64_t target,
                                                const LlCall& call, int from, int phase) {
    return ep_net_wait_signal(net_of(p), id, target, call.deadline, p.abort_flag, p.status, from,
                              phase, ll_peer_call(p, from, call));
}

// Block-wide: waits until every rank d has acknowledged call seq - 2 (the
// set this call writes is then free on d): in `acks[d]`, or for a rank on
// another node in its acknowledgement signal `ack_row` (which counts the
// same). Returns false in every thread when a wait failed (the error is
// recorded).
// A thread whose look at the start (begin_call) already saw the
// acknowledgement waits no more: acknowledgements only grow, and that look
// was an ACQUIRE.
template <bool kNet>
__device__ bool wait_for_acks(const LlParams& p, const int* acks, int ack_row, const LlCall& call,
                              int phase) {
    const int d = acked_rank(p);
    bool failed = false;
    if (d >= 0 && d < p.world && !(call.ack_looked && ep_reached(call.ack_seen, call.seq - 2))) {
        failed = on_net<kNet>(p, d)
                     ? !wait_for_signal(p, net_signal(p, ack_row, d),
                                        static_cast<uint64_t>(call.seq - 2), call, d, phase)
                     : !wait_for(p, acks + d, call.seq - 2, call, d, phase);
    }
    return !__syncthreads_or(failed);
}

// The first item of this warp where a phase deals its items a warp each,
// blocks first (item i to warp i / G of block i % G, for a grid of G
// blocks), from the block at place `place` of the deal: consecutive items
// land on different SMs, so the chunks of one token are moved by as many
// SMs as it has chunks, not all by the warps of one SM. The next item of
// the warp is EP_LL_WARPS * G further (deal_stride).
__device__ __forceinline__ int dealt_item(int place) {
    return static_cast<int>(threadIdx.x / 32 * gridDim.x) + place;
}

__device__ __forceinline__ int deal_stride() {
    return static_cast<int>(gridDim.x) * EP_LL_WARPS;
}

// The first item at or past `end` in the deal of the warp at `item` (item +
// k * stride): how a combine send warp steps over a source's token slots
// past the tokens the source sent. Without it the warp looked up every slot
// up to the maximum, a round trip each, and the 1-token pair took 3.5 us
// longer with M = 1024 than with M = 128 (bench/RESULTS.md).
__device__ __forceinline__ int skip_to(int item, int end, int stride) {
    const int gap = end - item;
    // Mostly the next item of the deal is past the end already: no division.
    return gap <= stride ? item + stride : item + (gap + stride - 1) / stride * stride;
}

// This block's place in the deal of a receive phase: half a grid away from
// the blocks of the send phase, whose items (and the dispatch's tokens,
// after the counts' blocks) start at block 0. At a few tokens the blocks
// that send then do not also receive: a receiver waits for its item while
// the data is on its way, instead of after its own send.
__device__ __forceinline__ int receiving_place() {
    return static_cast<int>((blockIdx.x + gridDim.x / 2) % gridDim.x);
}

// Warp-wide: lane 0 runs `wait` (an ACQUIRE wait); true in every lane when
// it succeeded. The warp barrier orders the other lanes' later reads after
// the acquire (a shuffle alone orders no memory).
template <typename Wait>
__device__ __forceinline__ bool warp_wait(Wait wait) {
    bool arrived = true;
    if (threadIdx.x % 32 == 0) {
        arrived = wait();
    }
    __syncwarp();
    return __shfl_sync(0xffffffffu, arrived, 0);
}

// The block that keeps a launch's numbers (begin_call, end_call): the
// grid's last one, and in it the thread that publishes and stores them,
// away from warp 0 and from the acknowledging threads (acked_rank), whose
// round trips it would otherwise follow. In the other blocks the same
// thread counts the block's arrival.
__device__ __forceinline__ bool keeper_block() {
    return blockIdx.x == gridDim.x - 1;
}

__device__ __forceinline__ bool bookkeeping_thread() {
    return threadIdx.x == blockDim.x / 2;
}

// Block-wide, at the start of every launch: the call this launch works on.
// A launch with a send phase starts call `*seq_counter + 1`, which is also
// a new collective call (ep_device.cuh). Every block reads the numbers at
// its start. The keeper block then publishes the call word at once
// (keeping it in `*call_store` for the receive-only launch of a split
// call) and acknowledges the previous call's receive phase to every rank
// (it ended before this launch started: the calls of a context are
// ordered); every other block counts its arrival in `*arrivals`, a release
// add it does not wait for. The new numbers are stored at the end of the
// keeper's launch (end_call), when every block has read the old ones: so no
// block's start waits for a round trip to a shared counter.
template <bool kNet>
__device__ LlCall begin_call(const LlParams& p, int* seq_counter, int* arrivals, int* call_store,
                             int64_t off_acks, int ack_row) {
    __shared__ int s_seq, s_word;
    const uint64_t deadline = ep_deadline_after(p.timeout_ns);
    // From the parameters' array: s_peer_bases is complete only after the
    // barrier below.
    const uint64_t own_base = p.peer_bases[p.rank];
    // The acknowledgement this thread waits for in the send phase, looked
    // at (ACQUIRE) while thread 0 reads the numbers: mostly it is there
    // already, and the send phase then needs no round trip for it. This
    // rank's own array; a rank on another node signals instead.
    const int acked = acked_rank(p);
    const bool ack_looked =
        p.do_send && acked >= 0 && acked < p.world && !on_net<kNet>(p, acked);
    const int ack_seen =
        ack_looked
            ? ep_ld_acquire(reinterpret_cast<const int*>(own_base + p.area + off_acks) + acked,
                            on_this_gpu(p, acked))
            : 0;
    if (threadIdx.x == 0) {
        const int calls = *reinterpret_cast<volatile int*>(ep_call_words(own_base));
        s_seq = *reinterpret_cast<volatile int*>(seq_counter) + p.do_send;
        s_word = p.do_send ? ep_call_word(p.collective, calls + 1)
                           : *reinterpret_cast<volatile int*>(call_store);
    }
    // The barrier also orders thread 0's reads before the arrival below (a
    // release is cumulative).
    __syncthreads();
    const LlCall call{s_seq, s_word, deadline, ack_looked, ack_seen};
    if (!p.do_send) {
        return call;
    }
    if (!keeper_block()) {
        if (bookkeeping_thread()) {
            ep_red_release_gpu(arrivals, 1);
        }
        return call;
    }
    if (bookkeeping_thread()) {
        *call_store = call.word;
        ep_publish_call(own_base, call.word, all_on_this_gpu(p));
    }
    const int d = threadIdx.x;
    if (d < p.world) {
        if (!on_net<kNet>(p, d)) {
            ep_st_release(ll_at<int>(p, d, off_acks) + p.rank, call.seq - 1, on_this_gpu(p, d));
        } else if (call.seq > 1) {
            // The signal counts acknowledged calls: seq - 1 after this add.
            ep_net_signal(net_of(p), d, net_signal(p, ack_row, p.rank));
        }
    }
    return call;
}

// The keeper's bookkeeping thread, at the end of a launch with a send
// phase: waits until every other block has counted its arrival (each did
// right after its start, so the first look mostly sees them all), then
// stores the call's numbers for the next launch and resets the count. The
// numbers are stored even when the wait failed (the error is recorded), as
// every peer's launch stores its own.
__device__ void end_call(const LlParams& p, const LlCall& call, int* seq_counter, int* arrivals,
                         int phase) {
    if (!p.do_send || !keeper_block() || !bookkeeping_thread()) {
        return;
    }
    const uint64_t own_base = peer_base(p.rank);
    // The other blocks of this grid count with GPU-scope adds.
    ep_wait_until_ge(arrivals, static_cast<int>(gridDim.x) - 1, call.deadline, p.abort_flag,
                     p.status, p.rank, phase, ep_peer_call(own_base, call.word), true);
    *arrivals = 0;
    *seq_counter = call.seq;
    ep_count_call(own_base);
}

// ---------------------------------------------------------------------------
// Dispatch: send phase
// ---------------------------------------------------------------------------

// Block-wide (step 2): the effective expert of every (token, slot) of this
// rank's `n` tokens into `experts` (token-major), from the caller's
// topk_idx, a thread per token (its ids in one round trip). Block 0
// reports ids that are neither -1 nor effective.
__device__ void load_routing(const LlParams& p, int n, int16_t* experts) {
    for (int t = threadIdx.x; t < n; t += blockDim.x) {
        const int first = t * p.topk;
        int ids[EP_MAX_TOPK], effective[EP_MAX_TOPK];
        ep_effective_experts(p.topk_idx + first, p.topk, p.num_experts, ids, effective);
#pragma unroll
        for (int k = 0; k < EP_MAX_TOPK; ++k) {
            if (k >= p.topk) {
                break;
            }
            if (blockIdx.x == 0 && effective[k] < 0 && ids[k] != -1) {
                ep_record_error(p.status, EP_STATUS_INVALID_EXPERT, -1, EP_PHASE_LL_DISPATCH,
                                first + k);
            }
            experts[first + k] = static_cast<int16_t>(effective[k]);
        }
    }
}

// Words of the mask of tokens sent in a counts message.
__device__ __forceinline__ int mask_words(const LlParams& p) {
    return (p.max_tokens + 31) / 32;
}

// Block-wide (step 3) for destination rank d: this rank's row count for
// each of d's local experts into `counts`, then the token count `n`, then
// (for a rank on another node) the mask of the tokens with an expert on d;
// returns how many those are (0 for a rank of this node: nothing uses it).
template <bool kNet>
__device__ int count_rows_for(const LlParams& p, int d, int n, const int16_t* experts,
                              int* counts) {
    __shared__ int s_sent;
    const int L = local_experts(p);
    const int entries = n * p.topk;
    const bool with_mask = on_net<kNet>(p, d);
    unsigned* mask = reinterpret_cast<unsigned*>(counts + L + 1);
    for (int i = threadIdx.x; i < L + 1 + mask_words(p); i += blockDim.x) {
        counts[i] = i == L ? n : 0;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < entries; i += blockDim.x) {
        const int e = experts[i];
        if (e >= 0 && e / L == d) {
            atomicAdd(&counts[e - d * L], 1);
            if (with_mask) {
                const int t = i / p.topk;
                atomicOr(&mask[t / 32], 1u << (t % 32));
            }
        }
    }
    __syncthreads();
    if (!with_mask) {
        return 0;
    }
    if (threadIdx.x == 0) {
        int sent = 0;
        for (int w = 0; w < mask_words(p); ++w) {
            sent += __popc(mask[w]);
        }
        s_sent = sent;
    }
    __syncthreads();
    return s_sent;
}

// Block-wide (step 3) to a rank of this node: the counts into its
// dispatch_counts, then the flag.
__device__ void send_counts_direct(const LlParams& p, int seq, int d, const int* counts) {
    int* dst = dispatch_counts(p, d, seq & 1, p.rank);
    for (int i = threadIdx.x; i <= local_experts(p); i += blockDim.x) {
        dst[i] = counts[i];
    }
    // The barrier orders every thread's stores before thread 0's release.
    __syncthreads();
    if (threadIdx.x == 0) {
        ep_st_release(ll_at<int>(p, d, p.off_dispatch_flags) + (seq & 1) * p.world + p.rank, seq,
                      on_this_gpu(p, d));
    }
}

// Block-wide (step 3) to a rank on another node: the counts and the mask
// staged in this rank's net_counts[d], put to d with an add to its counts
// signal; then the closing add to its tokens signal (the puts of the
// `sent` tokens add the rest of EP_LL_NET_CALL_UNIT).
__device__ void send_counts_net(const LlParams& p, int seq, int d, const int* counts, int sent) {
    const int set = seq & 1;
    const int words = static_cast<int>(p.counts_stride);
    const int64_t staged = p.off_net_counts + static_cast<int64_t>(d) * words * sizeof(int);
    int* stage = ll_at<int>(p, p.rank, staged);
    for (int i = threadIdx.x; i < words; i += blockDim.x) {
        stage[i] = counts[i];
    }
    // The barrier orders the staging before warp 0's put.
    __syncthreads();
    if (threadIdx.x < 32) {
        const EpNet net = net_of(p);
        ep_net_put_signal_warp(net, d, p.area + counts_offset(p, set, p.rank), p.area + staged,
                               words * static_cast<int64_t>(sizeof(int)),
                               net_signal(p, EP_LL_SIGNAL_DISPATCH_COUNTS + set, p.rank), 1);
        if (threadIdx.x == 0) {
            ep_net_signal_add(net, d, net_signal(p, EP_LL_SIGNAL_DISPATCH_TOKENS + set, p.rank),
                              static_cast<uint64_t>(EP_LL_NET_CALL_UNIT - sent));
        }
    }
}

// Block-wide: writes token t's row (quantized or BF16) into the message
// slot `slots[d]` of every rank d in `dest_mask`. A thread moves 16
// channels: one 16-byte store of FP8 codes, or two of BF16.
__device__ void send_token_row(const LlParams& p, int t, uint64_t dest_mask, uint8_t* const* slots) {
    const int pairs = p.hidden / 16;  // a multiple of 8: whole scale blocks
    const int4* row = reinterpret_cast<const int4*>(p.x) + static_cast<int64_t>(t) * (p.hidden / 8);
    // Every thread runs the same passes, so whole warps take part in the
    // quantization shuffles.
    for (int base = 0; base < pairs; base += blockDim.x) {
        const int v = base + threadIdx.x;
        int4 lo = make_int4(0, 0, 0, 0), hi = lo;
        if (v < pairs) {
            lo = __ldg(row + 2 * v);
            hi = __ldg(row + 2 * v + 1);
        }
        if (p.fp8) {
            const Fp8Vector q = quantize_16(lo, hi, p.ue8m0 != 0);
            if (v >= pairs) {
                continue;
            }
            for (uint64_t m = dest_mask; m != 0; m &= m - 1) {
                uint8_t* data = slots[__ffsll(static_cast<long long>(m)) - 1] + EP_LL_HEADER_BYTES;
                reinterpret_cast<int4*>(data)[v] = q.codes;
                if (v % 8 == 0) {
                    reinterpret_cast<float*>(data + p.hidden)[v / 8] = q.scale;
                }
            }
        } else if (v < pairs) {
            for (uint64_t m = dest_mask; m != 0; m &= m - 1) {
                int4* data = reinterpret_cast<int4*>(slots[__ffsll(static_cast<long long>(m)) - 1] +
                                                     EP_LL_HEADER_BYTES);
                data[2 * v] = lo;
                data[2 * v + 1] = hi;
            }
        }
    }
}

// Offset in the area of this rank's staging slot for token t's message.
__device__ __forceinline__ int64_t net_msg_offset(const LlParams& p, int t) {
    return p.off_net_msgs + static_cast<int64_t>(t) * p.msg_bytes;
}

// Block-wide (step 4 across nodes): puts token t's staged message to each
// rank of `dests` (ranks on other nodes, a warp each), each put adding 1 to
// the rank's tokens signal of set `set`.
__device__ void put_token(const LlParams& p, int set, int t, uint64_t dests) {
    const int warp = threadIdx.x / 32;
    int i = 0;
    for (uint64_t m = dests; m != 0; m &= m - 1, ++i) {
        if (i % EP_LL_WARPS != warp) {
            continue;
        }
        const int d = __ffsll(static_cast<long long>(m)) - 1;
        ep_net_put_signal_warp(net_of(p), d, p.area + msg_offset(p, set, p.rank, t),
                               p.area + net_msg_offset(p, t), msg_used_bytes(p),
                               net_signal(p, EP_LL_SIGNAL_DISPATCH_TOKENS + set, p.rank), 1);
    }
}

// Warp k of step 4, for token t: the route of slot k (its expert, and its
// position among this rank's rows for that expert = the earlier (token,
// slot) entries with the same expert; a token lists an expert at most once)
// and its weight, into the block's s_expert[k], s_route[k] (as in the
// header) and s_weight[k].
__device__ __forceinline__ void route_slot(const LlParams& p, int t, int k,
                                           const int16_t* s_experts, int* s_expert, int* s_route,
                                           float* s_weight) {
    const int lane = threadIdx.x % 32;
    const int K = p.topk;
    // The caller's weight is loaded first: its latency overlaps the count
    // below.
    const float weight = lane == 0 && p.topk_weights != nullptr
                             ? p.topk_weights[static_cast<int64_t>(t) * K + k]
                             : 0.0f;
    const int expert = s_experts[t * K + k];
    int earlier = 0;
    if (expert >= 0) {
        for (int i = lane; i < t * K; i += 32) {
            earlier += s_experts[i] == expert;
        }
    }
    earlier = __reduce_add_sync(0xffffffffu, earlier);
    if (lane == 0) {
        s_expert[k] = expert;
        s_route[k] = expert >= 0 ? expert | earlier << EP_LL_ROUTE_POS_SHIFT : -1;
        s_weight[k] = weight;
    }
}

// Block-wide part of step 4: the token's header (the routes, then the
// weights; the same for every rank) into the message slot s_slot[d] of
// every rank d of `header_mask`.
__device__ __forceinline__ void write_headers(const LlParams& p, uint64_t header_mask,
                                              const int* s_route, const float* s_weight,
                                              uint8_t* const* s_slot) {
    const int K = p.topk;
    for (int i = threadIdx.x; i < p.world * 32; i += blockDim.x) {
        const int d = i / 32, j = i % 32;
        if ((header_mask >> d & 1) == 0) {
            continue;
        }
        int word;
        if (j < EP_MAX_TOPK) {
            word = j < K ? s_route[j] : -1;
        } else {
            word = __float_as_int(j - EP_MAX_TOPK < K ? s_weight[j - EP_MAX_TOPK] : 0.0f);
        }
        reinterpret_cast<int*>(s_slot[d])[j] = word;
    }
}

// Block-wide send phase of dispatch call `call` (steps 1-4 of the header).
template <bool kNet>
__device__ bool dispatch_send(const LlParams& p, const LlCall& call) {
    __shared__ int16_t s_experts[EP_LL_MAX_TOKENS * EP_MAX_TOPK];
    // Counts of one destination: [L] rows, the token count, the sent mask.
    __shared__ int s_counts[EP_MAX_EXPERTS + 1 + EP_LL_MAX_TOKENS / 32];
    __shared__ int s_route[EP_MAX_TOPK];  // as in the header
    __shared__ int s_expert[EP_MAX_TOPK];
    __shared__ float s_weight[EP_MAX_TOPK];
    __shared__ uint8_t* s_slot[EP_MAX_WORLD_SIZE];
    const int seq = call.seq, set = seq & 1;
    const int tid = threadIdx.x, warp = tid / 32;
    const int K = p.topk, L = local_experts(p);
    // The routing is the caller's: read it before waiting (the wait's
    // barrier also orders it for the whole block).
    const int n = call_tokens(p, EP_PHASE_LL_DISPATCH);
    load_routing(p, n, s_experts);
    if (!wait_for_acks<kNet>(p, ll_at<int>(p, p.rank, p.off_dispatch_acks),
                             EP_LL_SIGNAL_DISPATCH_ACK, call, EP_PHASE_LL_DISPATCH)) {
        return false;
    }
    note_time(p, EP_LL_TIME_ACKED);
    for (int d = blockIdx.x; d < p.world; d += gridDim.x) {
        const int sent = count_rows_for<kNet>(p, d, n, s_experts, s_counts);
        if (on_net<kNet>(p, d)) {
            send_counts_net(p, seq, d, s_counts, sent);
        } else {
            send_counts_direct(p, seq, d, s_counts);
        }
    }
    note_time(p, EP_LL_TIME_ANNOUNCED);
    // Tokens start at block W, so the first tokens do not wait for the
    // blocks that send the counts.
    const int first_token = (blockIdx.x + gridDim.x - p.world % gridDim.x) % gridDim.x;
    for (int t = first_token; t < n; t += gridDim.x) {
        // The previous token's readers of the shared arrays are done.
        __syncthreads();
        if (warp < K) {
            route_slot(p, t, warp, s_experts, s_expert, s_route, s_weight);
        }
        // A rank of this node gets the message in its slot; the ranks on
        // other nodes get it from this rank's staging slot for the token.
        if (tid < p.world) {
            s_slot[tid] = on_net<kNet>(p, tid) ? ll_at<uint8_t>(p, p.rank, net_msg_offset(p, t))
                                               : dispatch_msg(p, tid, set, p.rank, t);
        }
        __syncthreads();
        uint64_t dest_mask = 0;
        for (int k = 0; k < K; ++k) {
            if (s_expert[k] >= 0) {
                dest_mask |= 1ull << (s_expert[k] / L);
            }
        }
        const uint64_t net_dests = dest_mask & p.net_mask;
        // The staging slot is written once, as the lowest network
        // destination's.
        const uint64_t staged = net_dests & (~net_dests + 1);
        const uint64_t in_node = ~p.net_mask & all_ranks(p);
        // The header (the same for every rank) to every rank of this node
        // (those without an expert see only other ranks' experts) and the
        // staging slot.
        write_headers(p, in_node | staged, s_route, s_weight, s_slot);
        send_token_row(p, t, (dest_mask & in_node) | staged, s_slot);
        // The barrier orders every thread's header and row stores before
        // thread d's release store, which (being cumulative) publishes them,
        // and before the puts.
        __syncthreads();
        if (tid < p.world && !on_net<kNet>(p, tid)) {
            ep_st_release(dispatch_tag(p, tid, set, p.rank, t), seq, on_this_gpu(p, tid));
        }
        if constexpr (kNet) {
            put_token(p, set, t, net_dests);
        }
    }
    if constexpr (kNet) {
        ep_net_flush_warp(net_of(p));
    }
    note_time(p, EP_LL_TIME_SENT);
    return true;
}

// ---------------------------------------------------------------------------
// Dispatch: receive phase
// ---------------------------------------------------------------------------

// A lane's share of one chunk (EP_LL_CHUNK_VECS 16-byte vectors, 1 KB) of
// a row of `vecs` vectors: vectors first_vec + lane and first_vec + 32 +
// lane (zeros past the row's end).
__device__ __forceinline__ void load_chunk(int4 (&v)[EP_LL_LANE_VECS], const void* row,
                                           int first_vec, int vecs) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int u = 0; u < EP_LL_LANE_VECS; ++u) {
        const int i = first_vec + 32 * u + lane;
        v[u] = i < vecs ? reinterpret_cast<const int4*>(row)[i] : make_int4(0, 0, 0, 0);
    }
}

__device__ __forceinline__ void store_chunk(void* row, const int4 (&v)[EP_LL_LANE_VECS],
                                            int first_vec, int vecs) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int u = 0; u < EP_LL_LANE_VECS; ++u) {
        const int i = first_vec + 32 * u + lane;
        if (i < vecs) {
            reinterpret_cast<int4*>(row)[i] = v[u];
        }
    }
}

// What the receive phase's steps need of the call, computed once: the token
// bookkeeping arrays (rows and weights of each received token's slots), the
// local experts, the rows per expert, and a row's bytes, 16-byte vectors and
// FP8 scale columns.
struct ReceivedRows {
    int* token_rows;
    float* token_weights;
    int local_experts;
    int capacity;
    int row_bytes;
    int data_vecs;
    int scale_cols;
};

__device__ __forceinline__ ReceivedRows received_rows(const LlParams& p) {
    const int row_bytes = p.fp8 ? p.hidden : 2 * p.hidden;
    return ReceivedRows{ll_at<int>(p, p.rank, p.off_token_rows),
                        ll_at<float>(p, p.rank, p.off_token_weights),
                        local_experts(p),
                        p.world * p.max_tokens,
                        row_bytes,
                        row_bytes / 16,
                        p.hidden / EP_HIDDEN_ALIGNMENT};
}

// Step 5, block-wide: thread s < W waits for source s's counts (the flag of
// a source of this node, the counts signal of one on another node: one add
// per call, so the set's calls). Returns false to every thread when a wait
// failed (the error is recorded).
template <bool kNet>
__device__ __forceinline__ bool wait_for_counts(const LlParams& p, const LlCall& call) {
    const int seq = call.seq, set = seq & 1;
    const int W = p.world;
    const int source = threadIdx.x;
    bool failed = false;
    if (source < W) {
        const int counts_signal = net_signal(p, EP_LL_SIGNAL_DISPATCH_COUNTS + set, source);
        failed = on_net<kNet>(p, source)
                     ? !wait_for_signal(p, counts_signal, calls_on_set(seq), call, source,
                                        EP_PHASE_LL_DISPATCH)
                     : !wait_for(p, ll_at<int>(p, p.rank, p.off_dispatch_flags) + set * W + source,
                                 seq, call, source, EP_PHASE_LL_DISPATCH);
    }
    return !__syncthreads_or(failed);
}

// Block-wide, after wait_for_counts: the sources' counts of set `set` laid
// out: s_first[le * W + s] the first row of (local expert le, source s),
// s_tokens[s] the tokens of s; block 0 also writes the caller's recv_count
// and recv_layout_range and the tokens per source the combine reads.
__device__ __forceinline__ void read_counts(const LlParams& p, const ReceivedRows& r, int set,
                                            int* s_first, int* s_tokens) {
    const int W = p.world, L = r.local_experts;
    // The flags were acquired by threads 0..W-1; the barrier of
    // wait_for_counts orders every thread's reads of the counts after those
    // acquires.
    for (int le = threadIdx.x; le < L; le += blockDim.x) {
        int first = 0;
        for (int s = 0; s < W; ++s) {
            const int count = dispatch_counts(p, p.rank, set, s)[le];
            s_first[le * W + s] = first;
            if (blockIdx.x == 0) {
                ep_store_optional(p.recv_layout_range, (le * W + s) * 2, first);
                ep_store_optional(p.recv_layout_range, (le * W + s) * 2 + 1, count);
            }
            first += count;
        }
        if (blockIdx.x == 0) {
            p.recv_count[le] = first;
        }
    }
    if (threadIdx.x < W) {
        const int n = dispatch_counts(p, p.rank, set, threadIdx.x)[L];
        s_tokens[threadIdx.x] = n;
        if (blockIdx.x == 0) {
            ll_at<int>(p, p.rank, p.off_dispatch_tokens)[threadIdx.x] = n;
        }
    }
    __syncthreads();
}

// Step 6, one warp: chunk c of token t of source s, whose message has
// arrived: the chunk (and with the first chunk the FP8 scales) into every
// row of this rank's experts the header names; the first chunk's warp also
// keeps the token's bookkeeping (its rows, its weights, recv_src_info).
__device__ __forceinline__ void receive_chunk(const LlParams& p, const ReceivedRows& r, int set,
                                              int s, int t, int c, const int* s_first) {
    const int lane = threadIdx.x % 32;
    const int W = p.world, K = p.topk, L = r.local_experts;
    const int capacity = r.capacity, row_bytes = r.row_bytes, data_vecs = r.data_vecs;
    const int scale_cols = r.scale_cols;
    const uint8_t* msg = dispatch_msg(p, p.rank, set, s, t);
    // The chunk, and with the first chunk the FP8 scales, are loaded
    // before the header is read: neither load needs the other, so their
    // latencies overlap. (For a token with no expert here the slot's data
    // is stale and goes unused.)
    const uint8_t* data = msg + EP_LL_HEADER_BYTES;
    int4 v[EP_LL_LANE_VECS];
    load_chunk(v, data, c * EP_LL_CHUNK_VECS, data_vecs);
    const bool with_scales = p.fp8 && c == 0;
    float scale[EP_LL_SCALES_PER_LANE];
#pragma unroll
    for (int u = 0; u < EP_LL_SCALES_PER_LANE; ++u) {
        const int col = lane + 32 * u;
        scale[u] = with_scales && col < scale_cols
                       ? reinterpret_cast<const float*>(data + p.hidden)[col]
                       : 0.0f;
    }
    int row = -1;
    if (lane < K) {
        // The slot's expert, if it is one of this rank's (the header is
        // the same for every rank).
        const int route = reinterpret_cast<const int*>(msg)[lane];
        const int le = (route & EP_LL_ROUTE_EXPERT_MASK) - p.rank * L;
        const int pos = route >> EP_LL_ROUTE_POS_SHIFT;
        // A position past the expert's segment cannot come from a peer
        // with this configuration; guard the caller's arrays anyway.
        if (route >= 0 && le >= 0 && le < L && s_first[le * W + s] + pos < capacity) {
            row = le * capacity + s_first[le * W + s] + pos;
        }
        // The first chunk's warp keeps the token's bookkeeping.
        if (c == 0) {
            r.token_rows[token_entry(p, s, t, lane)] = row;
            r.token_weights[token_entry(p, s, t, lane)] =
                reinterpret_cast<const float*>(msg)[EP_MAX_TOPK + lane];
            if (row >= 0) {
                ep_store_optional(p.recv_src_info, row, t);
            }
        }
    }
    const unsigned rows_mask = __ballot_sync(0xffffffffu, row >= 0);
    for (unsigned m = rows_mask; m != 0; m &= m - 1) {
        const int to = __shfl_sync(0xffffffffu, row, __ffs(m) - 1);
        store_chunk(p.recv_x + static_cast<int64_t>(to) * row_bytes, v, c * EP_LL_CHUNK_VECS,
                    data_vecs);
#pragma unroll
        for (int u = 0; u < EP_LL_SCALES_PER_LANE; ++u) {
            const int col = lane + 32 * u;
            if (with_scales && col < scale_cols) {
                p.recv_scales[static_cast<int64_t>(to) * scale_cols + col] = scale[u];
            }
        }
    }
}

// Block-wide receive phase of dispatch call `call` (steps 5-6 of the
// header). Returns early when a wait failed (the error is recorded).
template <bool kNet>
__device__ void dispatch_receive(const LlParams& p, const LlCall& call) {
    // First row of (local expert le, source s) at [le * W + s]; tokens of s.
    __shared__ int s_first[EP_MAX_EXPERTS];
    __shared__ int s_tokens[EP_MAX_WORLD_SIZE];
    const int seq = call.seq, set = seq & 1;
    const int lane = threadIdx.x % 32;
    const int W = p.world, M = p.max_tokens, K = p.topk;
    const ReceivedRows rows = received_rows(p);
    if (!wait_for_counts<kNet>(p, call)) {
        return;
    }
    note_time(p, EP_LL_TIME_COUNTS_IN);
    read_counts(p, rows, set, s_first, s_tokens);

    // Step 6: a warp per (source, token, chunk of the message data).
    const int chunks = (rows.data_vecs + EP_LL_CHUNK_VECS - 1) / EP_LL_CHUNK_VECS;
    for (int item = dealt_item(receiving_place()); item < W * M * chunks;
         item += deal_stride()) {
        const int c = item % chunks, t = item / chunks % M, s = item / (chunks * M);
        if (t >= s_tokens[s]) {
            continue;
        }
        const bool net = on_net<kNet>(p, s);
        if (net && !token_sent(p, set, s, t)) {
            // No expert here: nothing was put, and the token has no rows.
            if (c == 0 && lane < K) {
                rows.token_rows[token_entry(p, s, t, lane)] = -1;
            }
            continue;
        }
        // A source of this node tags each token; one on another node has
        // put all of its tokens when its tokens signal reaches the unit.
        const bool arrived = warp_wait([&] {
            return net ? wait_for_signal(p, net_signal(p, EP_LL_SIGNAL_DISPATCH_TOKENS + set, s),
                                         all_data_of(seq), call, s, EP_PHASE_LL_DISPATCH)
                       : wait_for(p, dispatch_tag(p, p.rank, set, s, t), seq, call, s,
                                  EP_PHASE_LL_DISPATCH);
        });
        if (!arrived) {
            return;
        }
        receive_chunk(p, rows, set, s, t, c, s_first);
    }
}

// ---------------------------------------------------------------------------
// Combine
// ---------------------------------------------------------------------------

// acc += w * y (or y when !weighted) for a lane's share of a chunk; each
// product rounded before it is added, as the reference.
__device__ __forceinline__ void accumulate(float (&acc)[EP_LL_LANE_VECS][8],
                                           const int4 (&y)[EP_LL_LANE_VECS], bool weighted,
                                           float w) {
#pragma unroll
    for (int u = 0; u < EP_LL_LANE_VECS; ++u) {
        float f[8];
        ep_unpack_bf16x8(y[u], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            acc[u][i] = __fadd_rn(acc[u][i], weighted ? __fmul_rn(w, f[i]) : f[i]);
        }
    }
}

// Warp-wide: takes the next EP_LL_ROWS_IN_FLIGHT set bits of `terms`, lowest
// first, into `term` (-1 past the last) and loads the chunk of row
// `row_of(term[g])` of each into `y[g]`: the loads of a group are all in
// flight before anything uses them.
template <typename RowOf>
__device__ __forceinline__ void load_next_rows(uint64_t& terms, int (&term)[EP_LL_ROWS_IN_FLIGHT],
                                               int4 (&y)[EP_LL_ROWS_IN_FLIGHT][EP_LL_LANE_VECS],
                                               int first_vec, int vecs, RowOf row_of) {
#pragma unroll
    for (int g = 0; g < EP_LL_ROWS_IN_FLIGHT; ++g) {
        term[g] = terms != 0 ? __ffsll(static_cast<long long>(terms)) - 1 : -1;
        terms &= terms - 1;
        if (term[g] >= 0) {
            load_chunk(y[g], row_of(term[g]), first_vec, vecs);
        }
    }
}

// Warp-wide: acc = the sum, in ascending order of term, over the set bits i
// of `terms` of w_i * (chunk of row `row_of(i)`) (or the plain row when
// !weighted; `w_of(i)` is called only when weighted).
template <typename RowOf, typename WeightOf>
__device__ __forceinline__ void sum_chunk(float (&acc)[EP_LL_LANE_VECS][8], uint64_t terms,
                                          bool weighted, int first_vec, int vecs, RowOf row_of,
                                          WeightOf w_of) {
#pragma unroll
    for (int u = 0; u < EP_LL_LANE_VECS; ++u) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            acc[u][i] = 0.0f;
        }
    }
    while (terms != 0) {
        int term[EP_LL_ROWS_IN_FLIGHT];
        int4 y[EP_LL_ROWS_IN_FLIGHT][EP_LL_LANE_VECS];
        load_next_rows(terms, term, y, first_vec, vecs, row_of);
#pragma unroll
        for (int g = 0; g < EP_LL_ROWS_IN_FLIGHT; ++g) {
            if (term[g] >= 0) {
                accumulate(acc, y[g], weighted, weighted ? w_of(term[g]) : 1.0f);
            }
        }
    }
}

__device__ __forceinline__ void pack_chunk(int4 (&v)[EP_LL_LANE_VECS],
                                           const float (&acc)[EP_LL_LANE_VECS][8]) {
#pragma unroll
    for (int u = 0; u < EP_LL_LANE_VECS; ++u) {
        v[u] = ep_pack_bf16x8(acc[u]);
    }
}

// Warp-wide, for a source s on another node: adds to s's combine signal
// of set `set` what this call's puts to it will not (each adds 1): one put
// per chunk of every row returned (weights at combine) or of every partial
// sum (weights at dispatch, one per token with rows here).
__device__ void close_combine(const LlParams& p, int set, int s) {
    const int lane = threadIdx.x % 32;
    const int* token_rows = ll_at<int>(p, p.rank, p.off_token_rows);
    const int tokens = ll_at<int>(p, p.rank, p.off_dispatch_tokens)[s];
    int puts = 0;
    for (int t = lane; t < tokens; t += 32) {
        int rows = 0;
        for (int k = 0; k < p.topk; ++k) {
            rows += token_rows[token_entry(p, s, t, k)] >= 0;
        }
        puts += p.weighted ? rows : rows > 0;
    }
    puts = __reduce_add_sync(0xffffffffu, puts) * chunks_per_row(p);
    if (lane == 0) {
        ep_net_signal_add(net_of(p), s, net_signal(p, EP_LL_SIGNAL_COMBINE + set, p.rank),
                          static_cast<uint64_t>(EP_LL_NET_CALL_UNIT - puts));
    }
}

// Row of net_partials that stages this rank's partial sum for token t of
// source s.
__device__ __forceinline__ int64_t partial_row(const LlParams& p, int s, int t) {
    return static_cast<int64_t>(s) * p.max_tokens + t;
}

// Offsets in the area of chunk `first_vec` of BF16 row `row` of the array
// at `off`, and its bytes (the last chunk of a row may be short).
__device__ __forceinline__ int64_t chunk_offset(const LlParams& p, int64_t off, int64_t row,
                                                int first_vec) {
    return off + (row * p.hidden + first_vec * 8) * static_cast<int64_t>(sizeof(__nv_bfloat16));
}

__device__ __forceinline__ int64_t chunk_bytes(const LlParams& p, int first_vec) {
    return static_cast<int64_t>(min(EP_LL_CHUNK_VECS, row_vecs(p) - first_vec)) * 16;
}

// Warp-wide: puts the staged chunk at `first_vec` of what token t of
// source s (on another node) gets from this rank: the chunk of each row of
// `valid` (weights at combine; lane k holds slot k's row) or of the partial
// sum, each put adding 1 to s's combine signal of set `set`.
__device__ void put_chunks(const LlParams& p, const EpNet& net, int set, int s, int t,
                           int first_vec, int row, unsigned valid) {
    const int K = p.topk;
    const int id = net_signal(p, EP_LL_SIGNAL_COMBINE + set, p.rank);
    const int64_t bytes = chunk_bytes(p, first_vec);
    // Where return row j of token t lands in s's combine_rows.
    const auto dst = [&](int j) {
        return p.area + chunk_offset(p, p.off_combine_rows, combine_slot(p, set, t, j), first_vec);
    };
    if (!p.weighted) {
        const int64_t src = chunk_offset(p, p.off_net_partials, partial_row(p, s, t), first_vec);
        ep_net_put_signal_warp(net, s, dst(K + p.rank), p.area + src, bytes, id, 1);
        return;
    }
    for (unsigned m = valid; m != 0; m &= m - 1) {
        const int k = __ffs(m) - 1;
        const int r = __shfl_sync(0xffffffffu, row, k);
        const int64_t src = chunk_offset(p, p.off_combine_buffer, r, first_vec);
        ep_net_put_signal_warp(net, s, dst(k), p.area + src, bytes, id, 1);
    }
}

// A combine send warp's item of the last dispatch: source s, token t, chunk
// c, and in lane k < K the row of the token's slot k on this rank (-1 for
// none, and in every lane when the source sent fewer tokens) and its
// weight.
struct ReturnItem {
    int s, t, c;
    int sent;  // the tokens source s sent
    int end;   // the first item past source s's slots
    int row;
    float w;
};

// Item `item` (source-major, then token, then chunk; one node: the sources
// in turn from this rank's next one), warp-wide. The source's token count
// and the token's rows are read at once (every token slot is in bounds),
// so the look-up costs one round trip.
template <bool kNet>
__device__ __forceinline__ ReturnItem return_item(const LlParams& p, int item, int lane) {
    const int M = p.max_tokens, K = p.topk, C = chunks_per_row(p);
    ReturnItem it;
    it.c = item % C;
    it.t = item / C % M;
    it.s = kNet ? item / (C * M) % p.world : (item / (C * M) + p.rank + 1) % p.world;
    it.end = (item / (C * M) + 1) * C * M;
    const int sent = ll_at<int>(p, p.rank, p.off_dispatch_tokens)[it.s];
    const int64_t entry = token_entry(p, it.s, it.t, lane);
    const int row = lane < K ? ll_at<int>(p, p.rank, p.off_token_rows)[entry] : -1;
    const float w = lane < K ? ll_at<float>(p, p.rank, p.off_token_weights)[entry] : 0.0f;
    it.sent = sent;
    it.row = it.t < sent ? row : -1;
    it.w = it.t < sent ? w : 0.0f;
    return it;
}

// Row r of the expert rows the combine sends (the caller's x).
__device__ __forceinline__ const __nv_bfloat16* expert_row(const LlParams& p, int r) {
    return p.x + static_cast<int64_t>(r) * p.hidden;
}

// Where the chunks of return row j of item `it`'s token go: the source's
// combine_rows, or, to a source on another node (`to_net`), this rank's
// staging: expert row r's row of the zero-copy combine buffer (j < K), or
// the token's row of net_partials.
__device__ __forceinline__ __nv_bfloat16* return_target(const LlParams& p, int set,
                                                        const ReturnItem& it, bool to_net, int j,
                                                        int r) {
    if (!to_net) {
        return ll_at<__nv_bfloat16>(p, it.s, p.off_combine_rows) +
               combine_slot(p, set, it.t, j) * p.hidden;
    }
    const int64_t off = j < p.topk
                            ? chunk_offset(p, p.off_combine_buffer, r, 0)
                            : chunk_offset(p, p.off_net_partials, partial_row(p, it.s, it.t), 0);
    return ll_at<__nv_bfloat16>(p, p.rank, off);
}

// Warp-wide, weights at combine: the chunk at `first_vec` of each of the
// token's rows here (the lanes of `valid`), to return row j = slot.
__device__ __forceinline__ void send_slot_rows(const LlParams& p, int set, const ReturnItem& it,
                                               bool to_net, unsigned valid, int first_vec) {
    const int vecs = row_vecs(p);
    for (uint64_t slots = valid; slots != 0;) {
        int slot[EP_LL_ROWS_IN_FLIGHT];
        int4 y[EP_LL_ROWS_IN_FLIGHT][EP_LL_LANE_VECS];
        load_next_rows(slots, slot, y, first_vec, vecs, [&](int k) {
            return expert_row(p, __shfl_sync(0xffffffffu, it.row, k));
        });
#pragma unroll
        for (int g = 0; g < EP_LL_ROWS_IN_FLIGHT; ++g) {
            if (slot[g] >= 0) {
                const int r = __shfl_sync(0xffffffffu, it.row, slot[g]);
                store_chunk(return_target(p, set, it, to_net, slot[g], r), y[g], first_vec, vecs);
            }
        }
    }
}

// Warp-wide, weights at dispatch: the chunk at `first_vec` of one partial
// sum over the token's rows here (the lanes of `valid`), rows ascending (=
// local experts ascending), to return row j = K + rank. Term i is the lane
// of the i-th smallest row.
__device__ __forceinline__ void send_partial_sum(const LlParams& p, int set, const ReturnItem& it,
                                                 bool to_net, unsigned valid, int first_vec) {
    const int vecs = row_vecs(p);
    const int row = it.row;
    int order = 0;
    for (int k = 0; k < p.topk; ++k) {
        const int other = __shfl_sync(0xffffffffu, row, k);
        order += row >= 0 && other >= 0 && other < row;
    }
    const uint64_t terms = (1ull << __popc(valid)) - 1;
    const auto lane_of = [&](int i) {
        return __ffs(__ballot_sync(0xffffffffu, row >= 0 && order == i)) - 1;
    };
    float acc[EP_LL_LANE_VECS][8];
    sum_chunk(
        acc, terms, true, first_vec, vecs,
        [&](int i) { return expert_row(p, __shfl_sync(0xffffffffu, row, lane_of(i))); },
        [&](int i) { return __shfl_sync(0xffffffffu, it.w, lane_of(i)); });
    int4 sum[EP_LL_LANE_VECS];
    pack_chunk(sum, acc);
    store_chunk(return_target(p, set, it, to_net, p.topk + p.rank, -1), sum, first_vec, vecs);
}

// Warp-wide, once every lane has stored its share of item `it`'s chunk at
// `first_vec`: publishes it, with the release stores of its tags (a tag per
// row returned), or the puts to a source on another node.
__device__ __forceinline__ void publish_chunk(const LlParams& p, const EpNet& net, int seq,
                                              const ReturnItem& it, bool to_net, unsigned valid,
                                              int first_vec) {
    const int lane = threadIdx.x % 32, set = seq & 1;
    // The warp barrier orders every lane's row stores before the release
    // stores, which publish them, or before the puts.
    __syncwarp();
    if (to_net) {
        put_chunks(p, net, set, it.s, it.t, first_vec, it.row, valid);
    } else if (p.weighted && it.row >= 0) {
        ep_st_release(combine_tag(p, it.s, set, it.t, lane, it.c), seq, on_this_gpu(p, it.s));
    } else if (!p.weighted && lane == 0) {
        ep_st_release(combine_tag(p, it.s, set, it.t, p.topk + p.rank, it.c), seq,
                      on_this_gpu(p, it.s));
    }
}

// Block-wide send phase (expert side) of combine call `call`: a warp per
// (source, token, chunk) of the last dispatch. To a source on another node
// the chunks are staged in this rank's buffer (an expert row in its row of
// the zero-copy combine buffer, a partial sum in net_partials) and put.
template <bool kNet>
__device__ bool combine_send(const LlParams& p, const LlCall& call) {
    const int lane = threadIdx.x % 32;
    const int M = p.max_tokens, C = chunks_per_row(p);
    const int items = p.world * M * C, stride = deal_stride();
    const int first = dealt_item(blockIdx.x);
    // The warp's first item is looked up before the wait: it reads this
    // rank's own arrays of the last dispatch, which the acknowledgements
    // do not guard.
    const ReturnItem first_item = return_item<kNet>(p, first, lane);
    if (!wait_for_acks<kNet>(p, ll_at<int>(p, p.rank, p.off_combine_acks),
                             EP_LL_SIGNAL_COMBINE_ACK, call, EP_PHASE_LL_COMBINE)) {
        return false;
    }
    const int seq = call.seq, set = seq & 1;
    note_time(p, EP_LL_TIME_ACKED);
    if (threadIdx.x < 32) {
        for (int s = blockIdx.x; s < p.world; s += gridDim.x) {
            if (on_net<kNet>(p, s)) {
                close_combine(p, set, s);
            }
        }
    }
    note_time(p, EP_LL_TIME_ANNOUNCED);
    const EpNet net = net_of(p);
    // One node: the sources in turn from this rank's next one. The grid's
    // warps cover a few sources at a time, and in source order every rank
    // would write rank 0's return rows first, one NVLink port taking all
    // ranks' traffic (as ep_spread_row says of the normal mode). Across
    // nodes the order stays the sources' own (not measured there).
    for (int item = first, next; item < items; item = next) {
        const ReturnItem it = item == first ? first_item : return_item<kNet>(p, item, lane);
        // The source's items past its last token are empty: the warp's next
        // item skips them (and the first item's arithmetic is done before
        // the wait, in return_item).
        const int sent_end = it.end - (M - it.sent) * C;
        next = item + stride < sent_end ? item + stride : skip_to(item, it.end, stride);
        if (it.t >= it.sent) {
            continue;
        }
        const unsigned valid = __ballot_sync(0xffffffffu, it.row >= 0);
        if (valid == 0) {
            continue;  // no expert of this rank: the source expects nothing
        }
        const int first_vec = it.c * EP_LL_CHUNK_VECS;
        const bool to_net = on_net<kNet>(p, it.s);
        if (p.weighted) {
            send_slot_rows(p, set, it, to_net, valid, first_vec);
        } else {
            send_partial_sum(p, set, it, to_net, valid, first_vec);
        }
        publish_chunk(p, net, seq, it, to_net, valid, first_vec);
    }
    if constexpr (kNet) {
        ep_net_flush_warp(net);
    }
    note_time(p, EP_LL_TIME_SENT);
    return true;
}

// Block-wide receive phase (source side) of combine call `call`: a warp per
// (token, chunk). Returns early when a wait failed (the error is recorded).
template <bool kNet>
__device__ void combine_receive(const LlParams& p, const LlCall& call) {
    const int set = call.seq & 1;
    const int lane = threadIdx.x % 32;
    const int K = p.topk, L = local_experts(p), C = chunks_per_row(p), vecs = row_vecs(p);
    const __nv_bfloat16* rows = ll_at<__nv_bfloat16>(p, p.rank, p.off_combine_rows);
    const int n = call_tokens(p, EP_PHASE_LL_COMBINE);
    // A receiver reads its token's routing while the rows are on their way.
    for (int item = dealt_item(receiving_place()); item < n * C; item += deal_stride()) {
        const int t = item / C, c = item % C;
        const int expert =
            ep_effective_expert_of_lane(p.topk_idx + static_cast<int64_t>(t) * K, K, p.num_experts);
        // Terms in summation order: slots ascending (weights at combine), or
        // the ranks holding any of the token's experts, ascending.
        uint64_t terms;
        if (p.weighted) {
            terms = __ballot_sync(0xffffffffu, expert >= 0);
        } else {
            const int r = expert >= 0 ? expert / L : -1;
            const unsigned lo = __reduce_or_sync(0xffffffffu, r >= 0 && r < 32 ? 1u << r : 0u);
            const unsigned hi = __reduce_or_sync(0xffffffffu, r >= 32 ? 1u << (r - 32) : 0u);
            terms = static_cast<uint64_t>(hi) << 32 | lo;
        }
        const auto return_row = [&](int i) { return p.weighted ? i : K + i; };
        // The caller's weight, loaded before the waits so that its latency
        // hides behind them.
        const float w = p.weighted && expert >= 0 ? p.topk_weights[static_cast<int64_t>(t) * K + lane]
                                                  : 0.0f;
        // Lane i waits for term i (and i + 32 for ranks past 31); a slot's
        // term is its own lane's.
        bool arrived = true;
        for (int i = lane; i < 64 && arrived; i += 32) {
            if (terms >> i & 1) {
                // A rank of this node tags each chunk; one on another node
                // has put everything when its combine signal reaches the
                // unit.
                const int from = p.weighted ? expert / L : i;
                arrived = on_net<kNet>(p, from)
                              ? wait_for_signal(p, net_signal(p, EP_LL_SIGNAL_COMBINE + set, from),
                                                all_data_of(call.seq), call, from,
                                                EP_PHASE_LL_COMBINE)
                              : wait_for(p, combine_tag(p, p.rank, set, t, return_row(i), c),
                                         call.seq, call, from, EP_PHASE_LL_COMBINE);
            }
        }
        // The warp barrier orders every lane's reads of the rows after the
        // acquires of the other lanes.
        __syncwarp();
        if (!__all_sync(0xffffffffu, arrived)) {
            return;
        }
        float acc[EP_LL_LANE_VECS][8];
        const int first_vec = c * EP_LL_CHUNK_VECS;
        sum_chunk(
            acc, terms, p.weighted != 0, first_vec, vecs,
            [&](int i) { return rows + combine_slot(p, set, t, return_row(i)) * p.hidden; },
            [&](int i) { return __shfl_sync(0xffffffffu, w, i); });
        int4 out[EP_LL_LANE_VECS];
        pack_chunk(out, acc);
        store_chunk(p.out + static_cast<int64_t>(t) * p.hidden, out, first_vec, vecs);
    }
}

// One launch of an operation: its call numbered (begin_call on the
// operation's counters and acknowledgements), then its send phase, its
// receive phase, or both; `send(call)` returns false when a wait failed.
template <bool kNet, typename Send, typename Receive>
__device__ void run_launch(const LlParams& p, int* seq_counter, int* arrivals, int* call_store,
                           int64_t off_acks, int ack_row, int phase, Send send, Receive receive) {
    start_timeline(p);
    load_peer_bases(p);
    const LlCall call = begin_call<kNet>(p, seq_counter, arrivals, call_store, off_acks, ack_row);
    note_time(p, EP_LL_TIME_NUMBERED);
    const bool sent = !p.do_send || send(call);
    if (p.do_recv && sent) {
        receive(call);
        note_time(p, EP_LL_TIME_RECEIVED);
    }
    end_call(p, call, seq_counter, arrivals, phase);
}

template <bool kNet>
__device__ void ll_dispatch(const LlParams& p) {
    LlCounters* c = counters(p);
    run_launch<kNet>(
        p, &c->dispatch_seq, &c->dispatch_arrivals, &c->dispatch_call, p.off_dispatch_acks,
        EP_LL_SIGNAL_DISPATCH_ACK, EP_PHASE_LL_DISPATCH,
        [&](const LlCall& call) { return dispatch_send<kNet>(p, call); },
        [&](const LlCall& call) { dispatch_receive<kNet>(p, call); });
}

template <bool kNet>
__device__ void ll_combine(const LlParams& p) {
    LlCounters* c = counters(p);
    run_launch<kNet>(
        p, &c->combine_seq, &c->combine_arrivals, &c->combine_call, p.off_combine_acks,
        EP_LL_SIGNAL_COMBINE_ACK, EP_PHASE_LL_COMBINE,
        [&](const LlCall& call) { return combine_send<kNet>(p, call); },
        [&](const LlCall& call) { combine_receive<kNet>(p, call); });
}

}  // namespace

// ---------------------------------------------------------------------------
// Kernels: grid = one block per SM of the rank's share of the GPU (see
// "Co-residency"), launched cooperatively; EP_LL_THREADS threads, no dynamic
// shared memory. One launch runs the send phase, the receive phase, or both.
// The `_net` kernels are the same with the network leg, for contexts of
// several nodes (LlParams::net_mask != 0); the others have none of its code
// (fewer registers, no stack).
// ---------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(EP_LL_THREADS, 1)
    ep_ll_dispatch_kernel(const LlParams p) {
    ep_kernel_start();
    ll_dispatch<false>(p);
}

extern "C" __global__ void __launch_bounds__(EP_LL_THREADS, 1)
    ep_ll_combine_kernel(const LlParams p) {
    ep_kernel_start();
    ll_combine<false>(p);
}

extern "C" __global__ void __launch_bounds__(EP_LL_THREADS, 1)
    ep_ll_dispatch_net_kernel(const LlParams p) {
    ep_kernel_start();
    ll_dispatch<true>(p);
}

extern "C" __global__ void __launch_bounds__(EP_LL_THREADS, 1)
    ep_ll_combine_net_kernel(const LlParams p) {
    ep_kernel_start();
    ll_combine<true>(p);
}
