// The network leg of the hierarchical modes: puts into a peer's symmetric
// buffer, signals, and bounded waits for signals. Two implementations with
// the same buffers, chunking, ordering rule and signal protocol, chosen per
// destination rank:
//
//   - GIN (NCCL's GPU-initiated networking, device API of NCCL 2.28): for a
//     rank this GPU cannot reach by loads and stores (peer_bases[rank] == 0,
//     another node). put = ncclGin::put from this rank's window to the
//     peer's; signal = ncclGin::signal with SignalAdd, which NCCL makes
//     visible only after the payloads of the earlier puts of this context to
//     that peer have settled. Needs RDMA NICs.
//   - Emulation over NVLink: for a rank whose buffer is mapped here (virtual
//     nodes of one host, any rank of the NVLink domain). put = the warp
//     copies the bytes through the peer mapping; signal = a fence at system
//     scope (the copies of every thread of the block, which a __syncthreads
//     ordered before it) and an atomic add with release semantics on the
//     peer's signal word.
//
// Signals: a rank owns one counter per signal id (a u64 word in its own
// buffer for the emulation, an NCCL GIN signal for GIN; both start at 0 and
// only grow). A sender adds 1 per call, after all its puts of the call; the
// receiver of call number `c` waits until the counter reaches c, and reads
// the sum of its word and its GIN signal, so it needs not know which path a
// sender took. Counters never reset.
//
// Every wait is bounded: it gives up at the context's deadline or when the
// host raises the abort flag, records the error (ep_device.cuh's model) and
// returns false; kernels never trap.
//
// Call numbers: a kernel launched once per call (of every rank, in the same
// order) numbers its calls with a counter in its own buffer (see
// ep_next_call), so a CUDA graph replay gets a fresh number.
#pragma once

#include <nccl_device.h>

#include "ep_device.cuh"

static_assert(sizeof(ncclDevComm) <= EP_NCCL_DEV_COMM_BYTES,
              "ncclDevComm outgrew the room src/runtime/nccl.rs reserves (DEV_COMM_BYTES)");

// Where a rank's network leg starts from.
struct EpNet {
    const uint64_t* peer_bases;  // [world] every rank's buffer here, 0 = unreachable
    uint8_t* own_base;           // this rank's buffer
    int64_t signals;             // offset of the signal words in every buffer
    const ncclDevComm* comm;     // nullptr without GIN
    ncclWindow_t window;         // this buffer's window (GIN)
    int gin_first_signal;        // GIN signal of id 0 (modes share the comm's signals)
};

// Warp-wide copy of `bytes` (a multiple of 4, both ends 4-byte aligned):
// 16-byte vectors when both ends allow, 4-byte words otherwise.
__device__ __forceinline__ void ep_warp_copy_words(uint8_t* to, const uint8_t* from,
                                                   int64_t bytes) {
    const int lane = threadIdx.x % 32;
    int64_t done = 0;
    if (((reinterpret_cast<uint64_t>(to) | reinterpret_cast<uint64_t>(from)) & 15) == 0) {
        const int64_t vectors = bytes / 16;
        for (int64_t i = lane; i < vectors; i += 32) {
            reinterpret_cast<int4*>(to)[i] = reinterpret_cast<const int4*>(from)[i];
        }
        done = vectors * 16;
    }
    for (int64_t i = done / 4 + lane; i < bytes / 4; i += 32) {
        reinterpret_cast<int*>(to)[i] = reinterpret_cast<const int*>(from)[i];
    }
}

// ---------------------------------------------------------------------------
// GIN operations, one thread each. Not inlined: NCCL's device code for every
// network backend is large, and a kernel that puts from several places
// would otherwise carry a copy of it at each (the network leg is not where
// a call costs).
// ---------------------------------------------------------------------------

// The GIN signal of signal `id`.
__device__ __forceinline__ ncclGinSignal_t ep_net_gin_signal(const EpNet& net, int id) {
    return static_cast<ncclGinSignal_t>(net.gin_first_signal + id);
}

// Puts `bytes` from offset `src` of this rank's window to offset `dst` of
// rank `peer`'s.
__device__ __noinline__ void ep_gin_put(const EpNet& net, int peer, int64_t dst, int64_t src,
                                        int64_t bytes) {
    ncclGin gin(*net.comm, 0);
    gin.put(ncclTeamWorld(*net.comm), peer, net.window, static_cast<size_t>(dst), net.window,
            static_cast<size_t>(src), static_cast<size_t>(bytes));
}

// The same put, adding `value` to the peer's signal `id` once the payload
// has settled.
__device__ __noinline__ void ep_gin_put_signal(const EpNet& net, int peer, int64_t dst,
                                               int64_t src, int64_t bytes, int id,
                                               uint64_t value) {
    ncclGin gin(*net.comm, 0);
    gin.put(ncclTeamWorld(*net.comm), peer, net.window, static_cast<size_t>(dst), net.window,
            static_cast<size_t>(src), static_cast<size_t>(bytes),
            ncclGin_SignalAdd{ep_net_gin_signal(net, id), value});
}

// Adds `value` to signal `id` of rank `peer`, after this context's earlier
// puts to it.
__device__ __noinline__ void ep_gin_signal_add(const EpNet& net, int peer, int id,
                                               uint64_t value) {
    ncclGin gin(*net.comm, 0);
    gin.signal(ncclTeamWorld(*net.comm), peer,
               ncclGin_SignalAdd{ep_net_gin_signal(net, id), value});
}

// This rank's GIN signal `id` (acquire).
__device__ __noinline__ uint64_t ep_gin_read_signal(const EpNet& net, int id) {
    ncclGin gin(*net.comm, 0);
    return gin.readSignal(ep_net_gin_signal(net, id));
}

// Returns once the sources of this thread's puts have been read.
__device__ __noinline__ void ep_gin_flush(const EpNet& net) {
    ncclGin gin(*net.comm, 0);
    gin.flush(ncclCoopThread());
}

// Whether this rank's device communicator has GIN.
__device__ __forceinline__ bool ep_net_has_gin(const EpNet& net) {
    return net.comm != nullptr && net.comm->ginContextCount > 0;
}

// ---------------------------------------------------------------------------
// The network leg: NVLink emulation where the peer is mapped, else GIN
// ---------------------------------------------------------------------------

// Warp-wide: copies `bytes` (a multiple of 4, offsets 4-byte aligned) from
// offset `src` of this rank's buffer to offset `dst` of rank `peer`'s.
// Every lane must call it.
__device__ __forceinline__ void ep_net_put_warp(const EpNet& net, int peer, int64_t dst,
                                                int64_t src, int64_t bytes) {
    const uint64_t base = net.peer_bases[peer];
    const int lane = threadIdx.x % 32;
    if (base != 0) {
        ep_warp_copy_words(reinterpret_cast<uint8_t*>(base + dst), net.own_base + src, bytes);
    } else if (lane == 0) {
        // The source was written before this call by this warp (ordered by
        // the caller's __syncwarp) or by earlier kernels.
        ep_gin_put(net, peer, dst, src, bytes);
    }
}

// The emulated signal word `id` of the buffer at `base`.
__device__ __forceinline__ uint64_t* ep_net_signal_word(const EpNet& net, uint64_t base, int id) {
    return reinterpret_cast<uint64_t*>(base + net.signals) + id;
}

// Emulation: publishes everything the calling thread has observed (its
// block's or warp's copies, ordered before it by the caller's barrier, and
// what was published to it through an acquire) at system scope, then adds
// `value` to the word: a sequentially consistent fence, then a relaxed add,
// the PTX model's release pattern with one fence (as ep_fence_and_store_sys;
// a release add after __threadfence_system() fenced twice).
__device__ __forceinline__ void ep_net_release_add(uint64_t* word, uint64_t value) {
    asm volatile("fence.sc.sys;\n\tred.relaxed.sys.global.add.u64 [%0], %1;"
                 :
                 : "l"(word), "l"(value)
                 : "memory");
}

// Adds `value` to signal `id` of rank `peer`, after every put the calling
// thread has observed (its block's, ordered by a __syncthreads, and those
// published to it through an acquire; for GIN, NCCL orders it after this
// context's earlier puts to `peer`).
__device__ __forceinline__ void ep_net_signal_add(const EpNet& net, int peer, int id,
                                                  uint64_t value) {
    const uint64_t base = net.peer_bases[peer];
    if (base != 0) {
        ep_net_release_add(ep_net_signal_word(net, base, id), value);
    } else {
        ep_gin_signal_add(net, peer, id, value);
    }
}

// Adds 1 to signal `id` of rank `peer` (see ep_net_signal_add).
__device__ __forceinline__ void ep_net_signal(const EpNet& net, int peer, int id) {
    ep_net_signal_add(net, peer, id, 1);
}

// Warp-wide: puts `bytes` (a multiple of 4, offsets 4-byte aligned) from
// offset `src` of this rank's buffer to offset `dst` of rank `peer`'s, and
// adds `value` to the peer's signal `id` once these bytes have arrived: the
// copy, a warp barrier and lane 0's ep_net_release_add over NVLink; one GIN
// put with a SignalAdd action (NCCL makes the add visible only after the
// payload) on the network. The source was written before the call (by
// this warp, ordered by the caller's __syncwarp, or by the block, ordered
// by its __syncthreads). Every lane must call it.
__device__ __forceinline__ void ep_net_put_signal_warp(const EpNet& net, int peer, int64_t dst,
                                                       int64_t src, int64_t bytes, int id,
                                                       uint64_t value) {
    const uint64_t base = net.peer_bases[peer];
    const int lane = threadIdx.x % 32;
    if (base != 0) {
        ep_warp_copy_words(reinterpret_cast<uint8_t*>(base + dst), net.own_base + src, bytes);
        __syncwarp();
        if (lane == 0) {
            ep_net_release_add(ep_net_signal_word(net, base, id), value);
        }
    } else if (lane == 0) {
        ep_gin_put_signal(net, peer, dst, src, bytes, id, value);
    }
}

// Warp-wide, after a warp's last put of a launch: returns once the sources
// of this warp's GIN puts have been read (NCCL's flush), so that the next
// launch may write them again. Nothing to wait for over NVLink, where a put
// is a copy. Every lane must call it.
__device__ __forceinline__ void ep_net_flush_warp(const EpNet& net) {
    if (threadIdx.x % 32 == 0 && ep_net_has_gin(net)) {
        ep_gin_flush(net);
    }
    __syncwarp();
}

// This rank's signal `id`: its emulated word plus its GIN signal, with
// acquire semantics (what the senders put before their adds is visible).
__device__ __forceinline__ uint64_t ep_net_read_signal(const EpNet& net, int id) {
    const uint64_t* word =
        ep_net_signal_word(net, reinterpret_cast<uint64_t>(net.own_base), id);
    uint64_t value;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(word) : "memory");
    if (ep_net_has_gin(net)) {
        value += ep_gin_read_signal(net, id);
    }
    return value;
}

// Spins until this rank's signal `id` reaches `target`, bounded as every
// wait (ep_wait_until: the clock, the abort flag, the status, and the call
// the peer `call` is in); `from_rank` and `phase` go into the error record.
// Counts only grow, and are compared as ints like every signal (ep_reached
// is right across the wrap).
__device__ inline bool ep_net_wait_signal(const EpNet& net, int id, uint64_t target,
                                          uint64_t deadline_ns, const int* abort_flag,
                                          EpDeviceStatus* status, int from_rank, int phase,
                                          EpPeerCall call) {
    return ep_wait_until([&] { return static_cast<int>(ep_net_read_signal(net, id)); },
                         static_cast<int>(target), deadline_ns, abort_flag, status, from_rank,
                         phase, call);
}

// The call a wait for rank `peer` belongs to (see ep_peer_call): the peer's
// call word where its buffer is mapped here; a rank reached only by GIN
// cannot be read, so its wait ends on the clock, the abort or the status.
__device__ inline EpPeerCall ep_net_peer_call(const EpNet& net, int peer) {
    const uint64_t own = reinterpret_cast<uint64_t>(net.own_base);
    const uint64_t base = net.peer_bases[peer];
    return ep_peer_call(base != 0 ? base : own, ep_current_call(own));
}

// Block-wide, at the start of a kernel launched once per call: the number of
// this call (1 for the first). `counter[0]` holds the calls so far and
// `counter[1]` the blocks of the running launch that have read it: every
// block reads the count before it arrives, and the last block to arrive
// stores the new count and resets the arrivals, so no block of this launch
// sees the new value, and the next launch (later on the stream) does.
__device__ inline int ep_next_call(int* counter) {
    __shared__ int s_call;
    if (threadIdx.x == 0) {
        const int call = *reinterpret_cast<volatile int*>(counter) + 1;
        s_call = call;
        if (ep_last_block_to_arrive(counter + 1)) {
            counter[0] = call;
        }
    }
    __syncthreads();
    return s_call;
}
