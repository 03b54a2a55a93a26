// A barrier across the ranks of one node, run on the GPUs themselves, so it
// is ordered with the kernels around it on the stream.
//
// Memory: every rank owns a signal array of `world` 64-bit slots in
// symmetric memory (memory every peer GPU can write through a mapping),
// zeroed once when the buffers are set up and never again. peer_signals[p]
// is the address, valid on this GPU, of rank p's array (the start of its
// buffer); peer_signals[rank] is this rank's own. Slot [q] of rank p's array
// is written by rank q only: the epoch in the low half, and in the high half
// the call word of the collective call the barrier belongs to (see
// "Collective calls" in ep_device.cuh).
//
// Protocol for the barrier with number `epoch`, in call `call`:
//   1. for every rank p (this one too): store (call, epoch) into slot [rank]
//      of p's array, as one release: a system-scope fence, then the store
//      (ep_fence_and_store_sys_u64);
//   2. wait until every slot of this rank's own array has reached `epoch`,
//      with acquire loads; a slot at exactly `epoch` must carry `call`.
// When step 2 finishes, every rank has finished step 1, so every rank has
// reached the barrier. Because the stores are releases and the loads are
// acquires, whatever a rank wrote before the barrier (its earlier kernels on
// this stream included: stream order puts them before this kernel, and the
// fence orders them before the store) is visible to every
// rank after it. So a rank may write into a peer's buffer, barrier, and the
// peer may read.
//
// Why epochs that grow instead of flags that are reset: no slot is ever
// cleared, so no reset can race with a fast peer that is already signalling
// the next barrier. A rank can be at most one barrier ahead of a slow one
// (it cannot pass barrier k + 1 before the slow one signals k + 1), so a slot
// can hold `epoch` or `epoch + 1` when it is read, and "reached" (>=) is true
// for both. The comparison (ep_reached) survives the int wrapping around.
//
// Where the epoch comes from: `epoch_counter[0]`, a word of device memory of
// this rank that counts its barriers (zero before the first). The kernel
// reads it, uses the next value and stores that back, so the epoch advances
// on the device: a barrier captured in a CUDA graph gets a fresh epoch at
// every replay, which a value baked into the launch parameters would not.
// Every rank runs the same sequence of barriers, so the counters agree.
// Barriers of one rank must not run concurrently (they are ordered on the
// context's streams by the one-thread-per-context rule). When every wait
// succeeded, `epoch_counter[1]` becomes the epoch too: kernels after the
// barrier compare the two words (ep_last_barrier_passed) to learn, from
// device memory, whether the barrier failed.
//
// Roles (p.role): a plain barrier is only the above. The normal mode's
// exchanges (src/runtime/gpu/normal.rs, `Exchange`) keep one more word per
// rank, `*open_exchange`: the kind of the last exchange whose closing
// barrier has not run. A middle barrier, when it passes, sets it to its
// exchange's kind; a closing barrier of kind k returns at once, signalling
// nothing, unless the word holds k, and sets it to EP_EXCHANGE_NONE when it
// passes. Every rank runs the same exchanges in the same order, so every
// rank's word holds the same kind at the same barrier and every rank skips
// the same closing barriers: the epochs stay in step. The word lives on the
// device so that CUDA-graph replays, which the host does not see, keep it
// true.
//
// Launch: one block of at least `world` threads (a multiple of 32;
// EP_BARRIER_THREADS covers every world size). Thread p signals and waits for
// rank p; the other threads do nothing. Parameters: BarrierParams (ep_abi.h).
//
// Mismatched calls: a peer whose slot holds this epoch under another call
// word is in another collective call (same number of barriers so far, other
// operation): EP_STATUS_MISMATCH, rank = the peer, detail = its call word.
// A peer that never comes because it is in a call without barriers (the
// low-latency mode) or in a later call is found by the wait itself
// (ep_wait_until reads its published call word). Why a slot one epoch ahead
// needs no check: a peer passes barrier `epoch` only after it checked this
// rank's slot, and a rank whose barrier failed signals no later barrier.
//
// Failure: a wait that passes its deadline (timeout_ns after the thread
// starts waiting) records EP_STATUS_TIMEOUT with rank = the peer that did not
// arrive and detail = the epoch its slot held; a raised *abort_flag records
// EP_STATUS_ABORTED. Either way the kernel returns and the stream goes on;
// the rank's later barriers signal nothing and return at once (the two
// barrier words differ), so the peers see it stop rather than pass a later
// barrier, and the host must treat the group as broken. Argument errors
// (1 <= world <= blockDim.x, 0 <= rank < world) record
// EP_STATUS_INVALID_ARGUMENT and signal nothing.
#include "ep_device.cuh"

// A slot's value: `call` in the high half, `epoch` in the low half.
__device__ __forceinline__ uint64_t ep_barrier_signal(int epoch, int call) {
    return static_cast<uint64_t>(static_cast<uint32_t>(call)) << 32 | static_cast<uint32_t>(epoch);
}

__device__ __forceinline__ int ep_signal_epoch(uint64_t signal) {
    return static_cast<int>(static_cast<uint32_t>(signal));
}

__device__ __forceinline__ int ep_signal_call(uint64_t signal) {
    return static_cast<int>(static_cast<uint32_t>(signal >> 32));
}

extern "C" __global__ void ep_barrier_kernel(const BarrierParams p) {
    ep_kernel_start();
    const int rank = p.rank;
    const int world = p.world;
    uint64_t* const* peer_signals = p.peer_signals;
    int* epoch_counter = p.epoch_counter;
    if (world < 1 || world > static_cast<int>(blockDim.x) || rank < 0 || rank >= world) {
        if (threadIdx.x == 0) {
            ep_record_error(p.status, EP_STATUS_INVALID_ARGUMENT, -1, EP_PHASE_BARRIER, 0);
        }
        return;
    }
    // This rank's words, all read before any is used, so that they cost one
    // memory round trip instead of a chain of them: its two barrier words,
    // its open exchange and the call it is in (its buffer, the call words',
    // starts EP_BARRIER_COUNTER_OFFSET bytes before the barrier words), and
    // thread p's two slots of peer p.
    const uint64_t own_base = reinterpret_cast<uint64_t>(epoch_counter) - EP_BARRIER_COUNTER_OFFSET;
    const int peer = threadIdx.x;
    uint64_t* slot_at_peer = nullptr;            // peer's slot [rank]
    const uint64_t* my_slot_for_peer = nullptr;  // this rank's slot [peer]
    if (peer < world) {
        slot_at_peer = peer_signals[peer] + rank;
        my_slot_for_peer = peer_signals[rank] + peer;
    }
    const EpBarrierWords words = ep_barrier_words(own_base);
    const int open = *reinterpret_cast<const volatile int*>(p.open_exchange);
    const int call = ep_current_call(own_base);
    // After a failed barrier, signal nothing more (see "Failure").
    if (!words.last_passed()) {
        return;
    }
    // A closing barrier with nothing of its kind open (see "Roles").
    if (p.role == EP_BARRIER_CLOSING && open != p.exchange) {
        return;
    }
    const int epoch = words.entered + 1;
    // Every thread has read the old count before thread 0 replaces it.
    __syncthreads();
    if (threadIdx.x == 0) {
        epoch_counter[0] = epoch;
    }
    bool arrived = true;
    if (peer < world) {
        // Step 1: tell `peer` that this rank has arrived. The fence orders
        // the writes of the kernels before this one on the stream, which
        // this thread has not observed itself, before the signal.
        ep_fence_and_store_sys_u64(slot_at_peer, ep_barrier_signal(epoch, call));

        // Step 2: wait for `peer` to arrive here. A thread that fails stops
        // waiting; its siblings notice the recorded error on their next
        // poll and stop as well (see ep_wait_until).
        uint64_t seen = 0;
        const auto load = [&] {
            seen = ep_ld_acquire_sys_u64(my_slot_for_peer);
            return ep_signal_epoch(seen);
        };
        const uint64_t peer_base = reinterpret_cast<uint64_t>(slot_at_peer - rank);
        arrived = ep_wait_until(load, epoch, ep_deadline_after(p.timeout_ns), p.abort_flag,
                                p.status, peer, EP_PHASE_BARRIER, ep_peer_call(peer_base, call));
        if (arrived && ep_signal_epoch(seen) == epoch && ep_signal_call(seen) != call) {
            ep_record_error(p.status, EP_STATUS_MISMATCH, peer, EP_PHASE_BARRIER,
                            ep_signal_call(seen), call);
            arrived = false;
        }
    }
    if (__syncthreads_and(arrived) && threadIdx.x == 0) {
        epoch_counter[1] = epoch;
        if (p.role == EP_BARRIER_MIDDLE) {
            *p.open_exchange = p.exchange;
        } else if (p.role == EP_BARRIER_CLOSING) {
            *p.open_exchange = EP_EXCHANGE_NONE;
        }
    }
}
