// Hierarchical normal mode: dispatch and combine when the ranks form
// several nodes (src/reference/hierarchical.rs is the plan these kernels
// follow; src/runtime/gpu/hierarchical.rs has the buffer layout and the
// launch sequence). Notation: N nodes of R ranks, W = N * R, rank = node * R
// + local; the gateway of source s on node n is rank n * R + local(s) (its
// rail peer), s itself on its own node. T = max tokens per rank.
//
// The single-node kernels of kernels/normal.cu do most of the work: the
// count kernel (local), the pull kernel (receiver side) and the combine's
// send and reduce kernels run unchanged, given tables of "peer bases" that
// point them at the right copies (see hierarchical.rs). The kernels here
// are the hierarchy's own steps, each a launch on the caller's stream:
//
// Dispatch
//   1. count (normal.cu): chunk positions per rank and per expert.
//   2. stage (here): global positions; the totals (tokens per rank, pairs
//      per expert) and the token count for the notify step; one header per
//      token (its experts, weights, positions per expert and per rank) into
//      this rank's header slot [own node][t]; the tokens and FP8 scales
//      into the normal area's staging arrays; the handle's is-token-in-rank
//      and is-token-in-node.
//   3. send (here, the network leg): each token goes ONCE to each remote
//      destination node, to the gateway there: its header into the
//      gateway's header slot [this node][t], its row and scales into the
//      gateway's relay block for this node at token t. Remote nodes in ring
//      order (this node + 1, + 2, ...). Block 0 first puts the notify data
//      (totals and token count). Then the last block to finish signals
//      every remote gateway (DISPATCH, this node) once.
//   4. forward (here, gateway side): waits for the DISPATCH signals of the
//      rail sources of every remote node (call c: the count reaches c), then, for
//      every token those sources (and this rank itself) sent to this node,
//      writes the pull records into the area of each destination rank of
//      this node, over NVLink: the token index, and per slot the local
//      expert, its position and weight (the records the single-node stage
//      kernel pushes). Headers of older calls are skipped by their call
//      number. Notes in the handle which node ranks got which token of each
//      rail source (for the combine).
//   5. node barrier (barrier.cu over the node's ranks).
//   6. pull (normal.cu) through the dispatch table: source s's totals,
//      rows and scales are read from its gateway on this node (the relay
//      block, or s's own staging area on this node). Each token crosses
//      NVLink once per destination rank.
//   7. world barrier: node barrier, rail barrier (here: a signal to and
//      from the rank of this local index on every other node), node
//      barrier.
//
// Combine
//   1. send (normal.cu) through the combine table: each expert rank writes
//      its BF16 row for (source s, token t) into the normal area's return
//      rows of s's gateway on its own node, row (node(s) * R + local) * T +
//      t, over NVLink.
//   2. node barrier.
//   3. node reduce (here, gateway side): per rail source s_m of node m and
//      token t that came to this node: the node partial = BF16 of the fp32
//      sum of the rows of the node's ranks that got it, local index
//      ascending. For m = this node it goes into this rank's node sums;
//      otherwise it is staged and put over the network into s_m's node sums
//      [this node][t], nodes in ring order; then the last block to finish
//      signals every remote rail peer (COMBINE, this node).
//   4. wait (here): the COMBINE signals of every remote rail peer.
//   5. reduce (normal.cu) over the node partials: out[t] = BF16 of the
//      fp32 sum of the node partials of the nodes t went to, ascending.
//   6. world barrier.
// This is src/reference/hierarchical.rs::combine, step by step.
//
// The network leg (puts and signals) is kernels/include/ep_net.cuh: GIN for
// ranks this GPU cannot reach, an emulation over NVLink for the others, with
// the same buffers, chunking (a warp per token, one signal per call and
// peer), order and signals. Every wait is bounded, and ends at once when
// the peer it waits for is in another collective call (ep_wait_until).
#include <cuda_bf16.h>

#include "ep_device.cuh"
#include "ep_net.cuh"

// Warps of the move kernels' blocks.
#define EP_HIER_WARPS (EP_MOVE_THREADS / 32)
// Threads of the one-block wait and rail-barrier kernels: one per node.
#define EP_HIER_SMALL_THREADS EP_MAX_WORLD_SIZE

namespace {

// ---------------------------------------------------------------------------
// Addresses (byte offsets into a rank's buffer, the same on every rank)
// ---------------------------------------------------------------------------

__device__ __forceinline__ int nodes_of(const HierParams& p) {
    return p.world / p.ranks_per_node;
}

__device__ __forceinline__ int node_of(const HierParams& p, int rank) {
    return rank / p.ranks_per_node;
}

__device__ __forceinline__ int local_of(const HierParams& p, int rank) {
    return rank % p.ranks_per_node;
}

// The rank of this rank's local index on node `node`.
__device__ __forceinline__ int rail_peer(const HierParams& p, int node) {
    return node * p.ranks_per_node + local_of(p, p.rank);
}

// Remote node number `step` (1 .. N - 1) of this rank's ring order.
__device__ __forceinline__ int ring_node(const HierParams& p, int step) {
    return (node_of(p, p.rank) + step) % nodes_of(p);
}

// Offset of the relay block that node `at` keeps for the rail source of
// node `from` (from != at).
__device__ __forceinline__ int64_t relay_block(const HierParams& p, int from, int at) {
    const int n = nodes_of(p);
    const int slot = (from - at + n) % n - 1;
    return p.hier_relay + static_cast<int64_t>(slot) * p.relay_bytes;
}

// Offset of the header of token t of the rail source of node m.
__device__ __forceinline__ int64_t header_at(const HierParams& p, int m, int t) {
    return p.hier_headers + (static_cast<int64_t>(m) * p.max_tokens + t) * EP_HIER_HEADER_BYTES;
}

// Offset of the notify slot (token count, in 16 bytes) of node m's source.
__device__ __forceinline__ int64_t notify_at(const HierParams& p, int m) {
    return p.hier_notify + static_cast<int64_t>(m) * 16;
}

// Offset of a normal-area array.
__device__ __forceinline__ int64_t area_at(const HierParams& p, int64_t off) {
    return p.normal.area + off;
}

template <typename T>
__device__ __forceinline__ T* own(const HierParams& p, int64_t offset) {
    return reinterpret_cast<T*>(reinterpret_cast<uint8_t*>(p.own_base) + offset);
}

template <typename T>
__device__ __forceinline__ T* on_rank(const HierParams& p, int rank, int64_t offset) {
    return reinterpret_cast<T*>(p.peer_bases[rank] + offset);
}

__device__ __forceinline__ int* counter(const HierParams& p, int which) {
    return own<int>(p, p.hier_counters) + which;
}

__device__ __forceinline__ int signal_id(const HierParams& p, int kind, int node) {
    return kind * nodes_of(p) + node;
}

__device__ __forceinline__ EpNet net_of(const HierParams& p) {
    EpNet net;
    net.peer_bases = p.peer_bases;
    net.own_base = p.own_base;
    net.signals = p.hier_signals;
    net.comm = static_cast<const ncclDevComm*>(p.dev_comm);
    net.window = static_cast<ncclWindow_t>(p.window);
    net.gin_first_signal = 0;
    return net;
}

// Block-wide: waits until signal (kind, m) of this rank reached `call`
// for every remote node m (a thread per node): the rail peer there signals
// once per call. False in every thread when a wait failed (the error is
// recorded).
__device__ bool wait_remote_nodes(const HierParams& p, int kind, int call, int phase) {
    const uint64_t deadline = ep_deadline_after(p.timeout_ns);
    const EpNet net = net_of(p);
    bool ok = true;
    const int step = 1 + static_cast<int>(threadIdx.x);
    if (step < nodes_of(p)) {
        const int m = ring_node(p, step);
        const int peer = rail_peer(p, m);
        ok = ep_net_wait_signal(net, signal_id(p, kind, m), static_cast<uint64_t>(call), deadline,
                                p.abort_flag, p.status, peer, phase, ep_net_peer_call(net, peer));
    }
    return !__syncthreads_or(!ok);
}

// Block-wide, at the end of a launch that put data to the other nodes: the
// last block to arrive (on `arrivals`, a word of this rank) signals (kind,
// this node) once to the rail peer of every remote node. Each block's
// fence orders its puts before its arrival, and the last block's acquire
// of the arrivals before its signals, so one signal per call covers every
// block's puts whatever the grid (ranks sharing a GPU have smaller grids).
__device__ void signal_remote_nodes(const HierParams& p, int kind, int* arrivals) {
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        last = ep_last_block_to_arrive(arrivals);
    }
    __syncthreads();
    const int step = 1 + static_cast<int>(threadIdx.x);
    if (last && step < nodes_of(p)) {
        ep_net_signal(net_of(p), rail_peer(p, ring_node(p, step)),
                      signal_id(p, kind, node_of(p, p.rank)));
    }
}

}  // namespace

// ---------------------------------------------------------------------------
// Dispatch 2: stage (grid >= max(1, chunks), EP_CHUNK_TOKENS threads,
// dynamic shared memory (world + experts) ints)
// ---------------------------------------------------------------------------

extern "C" __global__ void ep_hier_stage_kernel(const HierParams p) {
    ep_kernel_start();
    extern __shared__ int chunk_base[];  // [world + experts]
    const int columns = p.world + p.num_experts;
    const int chunks = (p.num_tokens + EP_CHUNK_TOKENS - 1) / EP_CHUNK_TOKENS;
    const int nodes = nodes_of(p);
    const int home = node_of(p, p.rank);
    const int* chunk_counts = own<int>(p, area_at(p, p.normal.off_chunk_counts));

    if (blockIdx.x == 0) {
        int* totals = own<int>(p, area_at(p, p.normal.off_totals));
        ep_sum_chunk_counts(chunk_counts, columns, chunks, totals);
        if (threadIdx.x == 0) {
            own<int>(p, notify_at(p, home))[0] = p.num_tokens;
        }
    }
    if (static_cast<int>(blockIdx.x) < chunks) {
        ep_sum_chunk_counts(chunk_counts, columns, blockIdx.x, chunk_base);
        __syncthreads();
        const int t = blockIdx.x * EP_CHUNK_TOKENS + threadIdx.x;
        if (t < p.num_tokens) {
            const int* slot_rank = own<int>(p, area_at(p, p.normal.off_slot_rank)) +
                                   static_cast<int64_t>(t) * p.topk;
            const int* rank_pos = own<int>(p, area_at(p, p.normal.off_rank_pos)) +
                                  static_cast<int64_t>(t) * p.world;
            int ids[EP_MAX_TOPK], experts[EP_MAX_TOPK];
            ep_effective_experts(p.topk_idx + static_cast<int64_t>(t) * p.topk, p.topk,
                                 p.num_experts, ids, experts);
            const float* weights = p.topk_weights + static_cast<int64_t>(t) * p.topk;
            int* header = own<int>(p, header_at(p, home, t));
#pragma unroll
            for (int k = 0; k < EP_MAX_TOPK; ++k) {
                if (k >= p.topk) {
                    break;
                }
                const int e = experts[k];
                header[EP_HIER_HDR_EXPERTS + k] = e;
                header[EP_HIER_HDR_WEIGHTS + k] = __float_as_int(e >= 0 ? weights[k] : 0.0f);
                header[EP_HIER_HDR_SLOTS + k] = e >= 0 ? chunk_base[p.world + e] + slot_rank[k] : 0;
            }
            uint8_t* in_rank = p.handle_in_rank + static_cast<int64_t>(t) * p.world;
            uint8_t* in_node = p.handle_in_node + static_cast<int64_t>(t) * nodes;
            for (int n = 0; n < nodes; ++n) {
                in_node[n] = 0;
            }
            for (int r = 0; r < p.world; ++r) {
                const int pos = rank_pos[r];
                header[EP_HIER_HDR_RANKS + r] = pos >= 0 ? chunk_base[r] + pos : -1;
                in_rank[r] = pos >= 0;
                if (pos >= 0) {
                    in_node[node_of(p, r)] = 1;
                }
            }
        }
    }

    // Stage the tokens and scales for the network leg and the node's pulls.
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int4* x = reinterpret_cast<const int4*>(p.x);
    int4* staged_x = own<int4>(p, area_at(p, p.normal.off_staged_x));
    const int64_t vectors = static_cast<int64_t>(p.num_tokens) * p.row_bytes / 16;
    for (int64_t i = first; i < vectors; i += stride) {
        staged_x[i] = x[i];
    }
    float* staged_scales = own<float>(p, area_at(p, p.normal.off_staged_scales));
    for (int64_t i = first; i < static_cast<int64_t>(p.num_tokens) * p.scale_cols; i += stride) {
        staged_scales[i] = p.x_scales[i];
    }
}

// ---------------------------------------------------------------------------
// Dispatch 3: send, the network leg (grid = SM budget, EP_MOVE_THREADS)
// ---------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(EP_MOVE_THREADS)
    ep_hier_send_kernel(const HierParams p) {
    ep_kernel_start();
    const int call = ep_next_call(counter(p, EP_HIER_COUNTER_SEND));
    const EpNet net = net_of(p);
    const int nodes = nodes_of(p);
    const int home = node_of(p, p.rank);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t staged_x = area_at(p, p.normal.off_staged_x);
    const int64_t staged_scales = area_at(p, p.normal.off_staged_scales);

    // Notify: the totals and the token count, to every remote gateway.
    if (blockIdx.x == 0 && warp == 0) {
        const int64_t totals = area_at(p, p.normal.off_totals);
        const int64_t totals_bytes = static_cast<int64_t>(p.world + p.num_experts) * 4;
        for (int step = 1; step < nodes; ++step) {
            const int n = ring_node(p, step);
            const int gateway = rail_peer(p, n);
            const int64_t block = relay_block(p, home, n);
            ep_net_put_warp(net, gateway, block + (p.normal.off_totals - p.normal.off_staged_x), totals,
                            totals_bytes);
            ep_net_put_warp(net, gateway, notify_at(p, home), notify_at(p, home), 16);
        }
    }

    // A warp per token: its header, row and scales to the gateway of every
    // remote node it goes to, nodes in ring order.
    const int warps = gridDim.x * EP_HIER_WARPS;
    const int64_t scale_bytes = static_cast<int64_t>(p.scale_cols) * 4;
    for (int t = blockIdx.x * EP_HIER_WARPS + warp; t < p.num_tokens; t += warps) {
        const int64_t header = header_at(p, home, t);
        if (lane == 0) {
            own<int>(p, header)[EP_HIER_HDR_CALL] = call;
        }
        __syncwarp();
        const uint8_t* in_node = p.handle_in_node + static_cast<int64_t>(t) * nodes;
        for (int step = 1; step < nodes; ++step) {
            const int n = ring_node(p, step);
            if (!in_node[n]) {
                continue;
            }
            const int gateway = rail_peer(p, n);
            const int64_t block = relay_block(p, home, n);
            ep_net_put_warp(net, gateway, header, header, EP_HIER_HEADER_BYTES);
            ep_net_put_warp(net, gateway, block + static_cast<int64_t>(t) * p.row_bytes,
                            staged_x + static_cast<int64_t>(t) * p.row_bytes, p.row_bytes);
            if (scale_bytes > 0) {
                ep_net_put_warp(net, gateway,
                                block + (p.normal.off_staged_scales - p.normal.off_staged_x) + t * scale_bytes,
                                staged_scales + t * scale_bytes, scale_bytes);
            }
        }
    }
    signal_remote_nodes(p, EP_HIER_SIGNAL_DISPATCH, counter(p, EP_HIER_COUNTER_SEND_DONE));
}

// ---------------------------------------------------------------------------
// Dispatch 4: forward, gateway side (grid = SM budget, EP_MOVE_THREADS)
// ---------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(EP_MOVE_THREADS)
    ep_hier_forward_kernel(const HierParams p) {
    ep_kernel_start();
    const int call = ep_next_call(counter(p, EP_HIER_COUNTER_FORWARD));
    if (!wait_remote_nodes(p, EP_HIER_SIGNAL_DISPATCH, call, EP_PHASE_HIER_DISPATCH)) {
        return;
    }
    const int nodes = nodes_of(p);
    const int home = node_of(p, p.rank);
    const int R = p.ranks_per_node;
    const int L = p.num_experts / p.world;
    const int T = p.max_tokens;
    if (blockIdx.x == 0) {
        for (int m = threadIdx.x; m < nodes; m += blockDim.x) {
            const int n = own<int>(p, notify_at(p, m))[0];
            p.handle_relay_count[m] = n >= 0 && n <= T ? n : 0;
        }
    }
    // A thread per (source node, token).
    const int64_t items = static_cast<int64_t>(nodes) * T;
    for (int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; item < items;
         item += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int m = static_cast<int>(item / T), t = static_cast<int>(item % T);
        const int count = own<int>(p, notify_at(p, m))[0];
        if (t >= count || count > T) {
            continue;
        }
        const int* header = own<int>(p, header_at(p, m, t));
        const int source = m * R + local_of(p, p.rank);
        uint64_t mask = 0;
        // A remote header of another call is a token that did not come here.
        if (m == home || header[EP_HIER_HDR_CALL] == call) {
            for (int l = 0; l < R; ++l) {
                const int d = home * R + l;
                const int pos = header[EP_HIER_HDR_RANKS + d];
                if (pos < 0 || pos >= T) {
                    continue;
                }
                mask |= 1ull << l;
                // The record of row (source, pos) in d's area, as the
                // single-node stage kernel writes it.
                const int64_t record = static_cast<int64_t>(source) * T + pos;
                on_rank<int>(p, d, area_at(p, p.normal.off_in_token))[record] = t;
                int* in_local = on_rank<int>(p, d, area_at(p, p.normal.off_in_local)) + record * p.topk;
                int* in_rank = on_rank<int>(p, d, area_at(p, p.normal.off_in_rank)) + record * p.topk;
                float* in_weight =
                    on_rank<float>(p, d, area_at(p, p.normal.off_in_weight)) + record * p.topk;
                for (int k = 0; k < p.topk; ++k) {
                    const int e = header[EP_HIER_HDR_EXPERTS + k];
                    const bool here = e >= 0 && e < p.num_experts && e / L == d;
                    in_local[k] = here ? e - d * L : -1;
                    in_rank[k] = here ? header[EP_HIER_HDR_SLOTS + k] : 0;
                    in_weight[k] = here ? __int_as_float(header[EP_HIER_HDR_WEIGHTS + k]) : 0.0f;
                }
            }
        }
        p.handle_relay_mask[item] = mask;
    }
}

// ---------------------------------------------------------------------------
// Combine 3: node reduce, gateway side (grid = SM budget, EP_MOVE_THREADS)
// ---------------------------------------------------------------------------

// Warp-wide: dst = BF16 of the fp32 sum, in ascending order of the set bits
// l of `mask`, of the rows `rows + l * row_stride` (hidden BF16 each).
__device__ void sum_node_rows(__nv_bfloat16* dst, const __nv_bfloat16* rows, int64_t row_stride,
                              uint64_t mask, int hidden) {
    const int lane = threadIdx.x % 32;
    const int vectors = hidden / 8;
    // Row l, when bit l of the mask is set; rows above the highest bit are
    // never present.
    const int bound = 64 - __clzll(static_cast<long long>(mask));
    const auto node_row = [&](int l, const int4*& row, float& w) {
        row = reinterpret_cast<const int4*>(rows + l * row_stride);
        w = 1.0f;
        return ((mask >> l) & 1) != 0;
    };
    for (int base = lane; base < vectors; base += 32 * EP_SUM_UNROLL) {
        float acc[EP_SUM_UNROLL][8] = {};
        ep_add_weighted_rows(acc, bound, node_row, base, vectors);
        ep_store_bf16_vectors(reinterpret_cast<int4*>(dst), acc, base, vectors);
    }
}

extern "C" __global__ void __launch_bounds__(EP_MOVE_THREADS)
    ep_hier_node_reduce_kernel(const HierParams p) {
    ep_kernel_start();
    // After a failed node barrier the returned rows are incomplete: send
    // nothing (the source nodes then time out on the signals).
    if (!ep_last_barrier_passed(reinterpret_cast<uint64_t>(p.own_base))) {
        return;
    }
    const EpNet net = net_of(p);
    const int nodes = nodes_of(p);
    const int home = node_of(p, p.rank);
    const int R = p.ranks_per_node, T = p.max_tokens;
    const int warp = threadIdx.x / 32;
    const int64_t row_bytes = static_cast<int64_t>(p.hidden) * 2;
    const __nv_bfloat16* returned = own<__nv_bfloat16>(p, area_at(p, p.normal.off_returned));
    // A warp per (node, token): remote nodes in ring order first, then this
    // node (whose partials stay here).
    const int64_t items = static_cast<int64_t>(nodes) * T;
    for (int64_t item = static_cast<int64_t>(blockIdx.x) * EP_HIER_WARPS + warp; item < items;
         item += static_cast<int64_t>(gridDim.x) * EP_HIER_WARPS) {
        // Step N of the ring order is this node itself.
        const int m = ring_node(p, static_cast<int>(item / T) + 1);
        const int t = static_cast<int>(item % T);
        if (t >= p.handle_relay_count[m]) {
            continue;
        }
        const uint64_t mask = p.handle_relay_mask[static_cast<int64_t>(m) * T + t];
        if (mask == 0) {
            continue;
        }
        // Row (m * R + l) * T + t of the return rows holds rank l's row.
        const __nv_bfloat16* rows = returned + (static_cast<int64_t>(m) * R * T + t) * p.hidden;
        const int64_t node_sum = p.hier_node_sums + (static_cast<int64_t>(home) * T + t) * row_bytes;
        if (m == home) {
            sum_node_rows(own<__nv_bfloat16>(p, node_sum), rows, static_cast<int64_t>(T) * p.hidden,
                          mask, p.hidden);
            continue;
        }
        const int slot = (m - home + nodes) % nodes - 1;
        const int64_t staged =
            p.hier_combine_stage + (static_cast<int64_t>(slot) * T + t) * row_bytes;
        sum_node_rows(own<__nv_bfloat16>(p, staged), rows, static_cast<int64_t>(T) * p.hidden,
                      mask, p.hidden);
        __syncwarp();
        ep_net_put_warp(net, rail_peer(p, m), node_sum, staged, row_bytes);
    }
    signal_remote_nodes(p, EP_HIER_SIGNAL_COMBINE, counter(p, EP_HIER_COUNTER_REDUCE_DONE));
}

// ---------------------------------------------------------------------------
// Combine 4: wait for the node partials (one block, EP_HIER_SMALL_THREADS)
// ---------------------------------------------------------------------------

extern "C" __global__ void ep_hier_wait_kernel(const HierParams p) {
    ep_kernel_start();
    const int call = ep_next_call(counter(p, EP_HIER_COUNTER_WAIT));
    wait_remote_nodes(p, EP_HIER_SIGNAL_COMBINE, call, EP_PHASE_HIER_COMBINE);
}

// ---------------------------------------------------------------------------
// World barrier, middle step: the rail barrier (one block,
// EP_HIER_SMALL_THREADS threads). Between two node barriers it makes a
// barrier of all ranks: after the first, every rank of this node has
// arrived; this step tells every other node's rank of this local index so,
// and learns the same of theirs; the second node barrier passes that on to
// the whole node. Signals go one per call, so the waits use a launch of one
// block as the sender count.
// ---------------------------------------------------------------------------

extern "C" __global__ void ep_hier_rail_barrier_kernel(const HierParams p) {
    ep_kernel_start();
    const int call = ep_next_call(counter(p, EP_HIER_COUNTER_BARRIER));
    if (!ep_last_barrier_passed(reinterpret_cast<uint64_t>(p.own_base))) {
        return;
    }
    const EpNet net = net_of(p);
    const int step = 1 + static_cast<int>(threadIdx.x);
    bool ok = true;
    if (step < nodes_of(p)) {
        const int m = ring_node(p, step);
        const int home = node_of(p, p.rank);
        const int peer = rail_peer(p, m);
        ep_net_signal(net, peer, signal_id(p, EP_HIER_SIGNAL_BARRIER, home));
        ok = ep_net_wait_signal(net, signal_id(p, EP_HIER_SIGNAL_BARRIER, m),
                                static_cast<uint64_t>(call), ep_deadline_after(p.timeout_ns),
                                p.abort_flag, p.status, peer, EP_PHASE_HIER_BARRIER,
                                ep_net_peer_call(net, peer));
    }
    __syncthreads_and(ok);
}
