// Device-side helpers shared by every ep kernel: memory-ordered loads and
// stores at system scope, a nanosecond clock, error reporting to the host,
// the numbering of collective calls, and a bounded wait that never hangs the
// GPU and ends at once when a peer is in another call.
//
// Why system scope (".sys") everywhere: the flags these helpers touch are
// written by other GPUs (over NVLink, through peer mappings) or by the host
// (host-mapped memory). ".gpu" scope would only order accesses among the
// threads of this GPU; ".sys" is the scope that includes other devices and
// the CPU.
//
// Why kernels never __trap(): a trap poisons the whole CUDA context, and the
// context is the caller's (PyTorch's, say). A kernel that cannot finish
// records what happened in an EpDeviceStatus and returns; the host reads the
// status after the stream synchronizes and turns it into an error.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "ep_abi.h"

// ---------------------------------------------------------------------------
// Status reported to the host
// ---------------------------------------------------------------------------

// EpDeviceStatus, the EP_STATUS_* codes and the EP_PHASE_* values are
// defined in ep_abi.h (generated from src/abi/defs.rs). A rank's kernels
// keep the first error they hit there: `code` is claimed with an atomicCAS
// from EP_STATUS_OK, and only the thread that wins writes the other fields.

// ---------------------------------------------------------------------------
// Memory-ordered accesses at system scope (inline PTX)
// ---------------------------------------------------------------------------

// Acquire load: no later load or store of this thread may be performed
// before it. Pairs with ep_st_release_sys: once the value written by a
// release store is seen, everything the writer wrote before it is visible.
__device__ __forceinline__ int ep_ld_acquire_sys(const int* addr) {
    int value;
    asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(value) : "l"(addr) : "memory");
    return value;
}

// Relaxed load: no ordering, but a fresh value each call (the compiler may
// neither cache it in a register nor drop it). For flags that carry no data,
// such as the abort flag.
__device__ __forceinline__ int ep_ld_relaxed_sys(const int* addr) {
    int value;
    asm volatile("ld.relaxed.sys.global.s32 %0, [%1];" : "=r"(value) : "l"(addr) : "memory");
    return value;
}

// Release store: every load and store this thread did before it (and every
// write it has observed, the PTX model is cumulative) is visible to a thread
// that acquire-loads the stored value.
__device__ __forceinline__ void ep_st_release_sys(int* addr, int value) {
    asm volatile("st.release.sys.global.s32 [%0], %1;" : : "l"(addr), "r"(value) : "memory");
}

// 64-bit acquire load and release store, as ep_ld_acquire_sys and
// ep_st_release_sys: for a pair of values that must be seen together.
__device__ __forceinline__ uint64_t ep_ld_acquire_sys_u64(const uint64_t* addr) {
    uint64_t value;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(addr) : "memory");
    return value;
}

__device__ __forceinline__ void ep_st_release_sys_u64(uint64_t* addr, uint64_t value) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" : : "l"(addr), "l"(value) : "memory");
}

// A sequentially consistent fence, then a relaxed store: a release pattern
// of the PTX memory model, for a store that must also publish what this
// thread has not observed itself (the writes of the kernels before this one
// on the stream, or of the block's other threads, which only a fence
// orders). One fence: __threadfence_system() before a release store fences
// twice (MEMBAR.SC, then the release's MEMBAR.ALL).
__device__ __forceinline__ void ep_fence_and_store_sys(int* addr, int value) {
    asm volatile("fence.sc.sys;\n\tst.relaxed.sys.global.s32 [%0], %1;"
                 :
                 : "l"(addr), "r"(value)
                 : "memory");
}

__device__ __forceinline__ void ep_fence_and_store_sys_u64(uint64_t* addr, uint64_t value) {
    asm volatile("fence.sc.sys;\n\tst.relaxed.sys.global.u64 [%0], %1;"
                 :
                 : "l"(addr), "l"(value)
                 : "memory");
}

// The same at GPU scope, for flags that only blocks of this GPU read.
__device__ __forceinline__ void ep_fence_and_store_gpu(int* addr, int value) {
    asm volatile("fence.sc.gpu;\n\tst.relaxed.gpu.global.s32 [%0], %1;"
                 :
                 : "l"(addr), "r"(value)
                 : "memory");
}

// Acquire load and release store at GPU scope: for flags that only blocks of
// this GPU write and read (a fused kernel's row and tile signals). They are
// cheaper than the system-scope ones, which must also order against peers
// and the host.
__device__ __forceinline__ int ep_ld_acquire_gpu(const int* addr) {
    int value;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(addr) : "memory");
    return value;
}

__device__ __forceinline__ void ep_st_release_gpu(int* addr, int value) {
    asm volatile("st.release.gpu.global.s32 [%0], %1;" : : "l"(addr), "r"(value) : "memory");
}

// Relaxed load at GPU scope, and the acquire fence that completes it: for a
// long wait on such a flag beside other work of the SM. An acquire load
// also invalidates the SM's L1 (CCTL.IVALL) at every look; a waiter that
// looks with relaxed loads fences once, after the flag is seen.
__device__ __forceinline__ int ep_ld_relaxed_gpu(const int* addr) {
    int value;
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(addr) : "memory");
    return value;
}

__device__ __forceinline__ void ep_fence_acquire_gpu() {
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

// Release store, acquire load and fence-then-store at the narrowest scope
// that holds both ends of a signal: GPU scope where the writer and the
// reader run on this GPU (`same_gpu`: ranks that share a GPU, or a rank
// signalling itself), else system scope (a peer GPU). A release at system
// scope makes the thread's earlier writes visible to the whole system, peer
// GPUs and the host (MEMBAR.SYS), one at GPU scope only to this GPU
// (MEMBAR.GPU).
__device__ __forceinline__ void ep_st_release(int* addr, int value, bool same_gpu) {
    if (same_gpu) {
        ep_st_release_gpu(addr, value);
    } else {
        ep_st_release_sys(addr, value);
    }
}

__device__ __forceinline__ int ep_ld_acquire(const int* addr, bool same_gpu) {
    return same_gpu ? ep_ld_acquire_gpu(addr) : ep_ld_acquire_sys(addr);
}

__device__ __forceinline__ void ep_fence_and_store(int* addr, int value, bool same_gpu) {
    if (same_gpu) {
        ep_fence_and_store_gpu(addr, value);
    } else {
        ep_fence_and_store_sys(addr, value);
    }
}

// Add at GPU scope with release semantics, no value returned (the thread
// does not wait for it): the stores this thread made or observed before it
// (a block barrier's, too) are visible to a thread that reads a count
// including it with an acquire, or reads it and then fences.
__device__ __forceinline__ void ep_red_release_gpu(int* addr, int value) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(addr), "r"(value) : "memory");
}

// Atomic add at GPU scope with acquire and release semantics; returns the
// old value. For arrival counters among the blocks of one grid: every
// block's earlier accesses are ordered before its arrival, and the block
// that sees the last arrival sees all of them.
__device__ __forceinline__ int ep_atomic_add_acq_rel_gpu(int* addr, int value) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;"
                 : "=r"(old)
                 : "l"(addr), "r"(value)
                 : "memory");
    return old;
}

// By one thread of each block of a launch: counts the block in `*arrivals`
// and says whether it is the last block of the grid to arrive; the last
// one resets the count for the next launch. The count is an acquire-release
// at GPU scope: what each block did before it arrived is visible to the
// last one.
__device__ __forceinline__ bool ep_last_block_to_arrive(int* arrivals) {
    if (ep_atomic_add_acq_rel_gpu(arrivals, 1) != static_cast<int>(gridDim.x) - 1) {
        return false;
    }
    *arrivals = 0;
    return true;
}

// ---------------------------------------------------------------------------
// Kernel start: programmatic dependent launch
// ---------------------------------------------------------------------------

// The host launches ep kernels as programmatic dependents where it can
// (src/runtime/gpu/mod.rs, `programmatic_launch`: not the cooperative ones,
// not where ranks share a GPU): the GPU may start a kernel's blocks before
// the kernel ahead of it on the stream has finished, so its launch and its
// blocks' start overlap that kernel's tail instead of following it.
//
// The first statement of every ep kernel is this call, before any access
// to global memory: it waits until the kernel ahead (ours, the caller's,
// whatever the stream holds) has completed and its writes are visible,
// exactly what plain stream order gives, then allows the kernel after this
// one to start its blocks the same way. (A kernel ahead that never allows
// it, one not of ep, lets the next start when it ends; in a launch in plain
// stream order the wait returns at once.) tests/kernel_sources.rs checks
// that every kernel starts with it.
__device__ __forceinline__ void ep_kernel_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---------------------------------------------------------------------------
// Time
// ---------------------------------------------------------------------------

// The GPU's global timer in nanoseconds. It ticks in real time, the same on
// every SM (unlike clock64, which counts this SM's cycles), though on some
// GPUs it only advances every microsecond or so: fine for timeouts.
__device__ __forceinline__ uint64_t ep_globaltimer_ns() {
    uint64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    return now;
}

// The global-timer value `timeout_ns` from now, saturating instead of
// wrapping, so a huge timeout means "practically never" and not "already".
__device__ __forceinline__ uint64_t ep_deadline_after(uint64_t timeout_ns) {
    uint64_t now = ep_globaltimer_ns();
    return timeout_ns > UINT64_MAX - now ? UINT64_MAX : now + timeout_ns;
}

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

// Records an error unless one is already recorded (the first one wins).
// `call` is this rank's call word for a failed wait (mismatch, timeout,
// abort), else 0; `awaited` is the value a timed-out or aborted wait was for.
__device__ __forceinline__ void ep_record_error(EpDeviceStatus* status, int code, int rank,
                                                int phase, int detail, int call = 0,
                                                int awaited = 0) {
    // The CAS is at system scope because the host reads this word too; for
    // host-mapped memory the GPU's atomics are atomic among this GPU's
    // threads, which is all the "first one wins" rule needs (each rank has
    // its own status).
    if (atomicCAS_system(&status->code, EP_STATUS_OK, code) == EP_STATUS_OK) {
        volatile EpDeviceStatus* s = status;
        s->rank = rank;
        s->phase = phase;
        s->detail = detail;
        s->call = call;
        s->awaited = awaited;
        // Push the fields out to host memory before the kernel exits.
        __threadfence_system();
    }
}

// True when `value` has reached `target`, for counters that only grow.
// Compared through the signed difference rather than `value >= target`, so
// the test stays right when a counter wraps past INT_MAX (a barrier epoch
// after 2^31 barriers): it only needs the two within 2^31 of each other.
__device__ __forceinline__ bool ep_reached(int value, int target) {
    return static_cast<int>(static_cast<unsigned>(value) - static_cast<unsigned>(target)) >= 0;
}

// How many spins a wait does between two looks at the clock.
#define EP_WAIT_CHECK_EVERY 64

// How long a wait spins before it first looks at the abort flag and the
// status, and how often it looks again. Both live in host memory, and a
// read of host memory from the GPU is slow (a PCIe round trip, far slower
// under virtualization): polling them from the start would put that round
// trip into every barrier, while waits that end within this time (the
// normal case) never need them.
#define EP_HOST_POLL_NS 100000ull

// ---------------------------------------------------------------------------
// Collective calls
// ---------------------------------------------------------------------------

// Every rank makes the same collective calls in the same order. Each call
// is numbered on the device (so that CUDA-graph replays count too): the
// call's first kernel adds one to the rank's call counter and publishes the
// call word `op << EP_CALL_NUMBER_BITS | number` (op: the runtime's code of
// the operation) in the rank's buffer at EP_CALL_WORDS_OFFSET + 4, with a
// release store, before anything of the call waits. A rank that waits for a
// peer's signal reads the peer's call word now and then (ep_wait_until): a
// peer in the same call, or an earlier one, is slow, and the wait goes on;
// a peer in another operation's call of the same number, or in a later call,
// will never send what this call waits for (a later call starts only after
// the peer's part of this one has ended, and that part is visible once the
// later word is), so the wait ends at once with EP_STATUS_MISMATCH on both
// ranks, each waiting for the other, instead of a timeout.

// The call numbers' bits of a call word.
#define EP_CALL_NUMBER_MASK ((1 << EP_CALL_NUMBER_BITS) - 1)

__device__ __forceinline__ int ep_call_word(int op, int number) {
    return op << EP_CALL_NUMBER_BITS | (number & EP_CALL_NUMBER_MASK);
}

// A rank's two call words in its buffer at `base`: [0] the calls it has
// started, [1] the word of the call it is in.
__device__ __forceinline__ int* ep_call_words(uint64_t base) {
    return reinterpret_cast<int*>(base + EP_CALL_WORDS_OFFSET);
}

// The two halves of starting a collective call of operation `op`, for a
// kernel whose blocks read the call count (ep_call_words [0]) themselves:
// one thread publishes the call's word, ep_call_word(op, count + 1), at
// once (ep_publish_call), and the count grows only once every block has
// read it (ep_count_call).
// `peers_on_this_gpu`: every rank runs on this GPU, so GPU scope holds
// every reader of the word.
__device__ __forceinline__ void ep_publish_call(uint64_t own_base, int word,
                                                bool peers_on_this_gpu = false) {
    // The fence orders the earlier kernels' writes (which this thread has
    // not observed itself) before the word: a peer that reads this word
    // with an acquire sees every signal of the earlier calls.
    ep_fence_and_store(ep_call_words(own_base) + 1, word, peers_on_this_gpu);
}

__device__ __forceinline__ void ep_count_call(uint64_t own_base) {
    ep_call_words(own_base)[0] += 1;
}

// One thread, at the start of a call's first kernel: numbers this rank's
// call of operation `op` and publishes its word, which it returns.
__device__ __forceinline__ int ep_begin_collective(uint64_t own_base, int op) {
    const int word =
        ep_call_word(op, *reinterpret_cast<volatile int*>(ep_call_words(own_base)) + 1);
    ep_count_call(own_base);
    ep_publish_call(own_base, word);
    return word;
}

// The word of the call this rank is in (published by the call's first
// kernel, earlier on the stream).
__device__ __forceinline__ int ep_current_call(uint64_t own_base) {
    return reinterpret_cast<const volatile int*>(ep_call_words(own_base))[1];
}

// True when a peer whose call word is `theirs` is elsewhere than this
// rank's call `mine`: in a later call, or in another operation's call of
// the same number. Numbers are compared modulo 2^EP_CALL_NUMBER_BITS.
__device__ __forceinline__ bool ep_peer_elsewhere(int theirs, int mine) {
    const int shift = 32 - EP_CALL_NUMBER_BITS;
    const int ahead = static_cast<int>(static_cast<unsigned>((theirs & EP_CALL_NUMBER_MASK) -
                                                             (mine & EP_CALL_NUMBER_MASK))
                                       << shift) >> shift;
    return ahead > 0 || (ahead == 0 && theirs != mine);
}

// The call a wait belongs to: the peer's published word (in the peer's
// buffer) and this rank's call word.
struct EpPeerCall {
    const int* theirs;
    int mine;
};

// The peer call of a wait for rank `peer`, whose buffer is at `peer_base`.
__device__ __forceinline__ EpPeerCall ep_peer_call(uint64_t peer_base, int mine) {
    return EpPeerCall{ep_call_words(peer_base) + 1, mine};
}

// ---------------------------------------------------------------------------
// Bounded waits
// ---------------------------------------------------------------------------

// Spins until `load()` (an acquire load of a signal) returns a value that
// has reached `target` (see ep_reached): when it returns true, whatever the
// writer did before its release store is visible to this thread.
//
// Returns false, without waiting further, when
//   - the host set `*abort_flag` to non-zero: records EP_STATUS_ABORTED;
//   - the global timer passed `deadline_ns`: records EP_STATUS_TIMEOUT;
//   - the peer is in another call (ep_peer_elsewhere on `call`), and the
//     signal has not come even after its word was read: records
//     EP_STATUS_MISMATCH;
//   - `status` already holds an error (another thread of this rank failed,
//     or an earlier kernel did and the host has not cleared it): records
//     nothing, the first error stays.
// All but the first look are made only after EP_HOST_POLL_NS of waiting.
// `rank` and `phase` go into the record: the rank whose signal this wait is
// for, and the kernel's EP_PHASE_*. The caller must then leave the kernel.
template <typename Load>
__device__ __forceinline__ bool ep_wait_until(Load load, int target, uint64_t deadline_ns,
                                              const int* abort_flag, EpDeviceStatus* status,
                                              int rank, int phase, EpPeerCall call) {
    uint64_t next_poll_ns = 0;
    for (uint32_t spin = 0;; ++spin) {
        int value = load();
        if (ep_reached(value, target)) {
            return true;
        }
        if (spin % EP_WAIT_CHECK_EVERY != 0) {
            continue;
        }
        const uint64_t now = ep_globaltimer_ns();
        if (now >= deadline_ns) {
            ep_record_error(status, EP_STATUS_TIMEOUT, rank, phase, value, call.mine, target);
            return false;
        }
        if (next_poll_ns == 0) {
            next_poll_ns = now + EP_HOST_POLL_NS;
        }
        if (now < next_poll_ns) {
            continue;
        }
        next_poll_ns = now + EP_HOST_POLL_NS;
        const int theirs = ep_ld_acquire_sys(call.theirs);
        if (ep_peer_elsewhere(theirs, call.mine)) {
            // What the peer signalled in this call is visible after the
            // acquire of its later word: one more look.
            if (ep_reached(load(), target)) {
                return true;
            }
            ep_record_error(status, EP_STATUS_MISMATCH, rank, phase, theirs, call.mine);
            return false;
        }
        if (ep_ld_relaxed_sys(abort_flag) != 0) {
            ep_record_error(status, EP_STATUS_ABORTED, rank, phase, value, call.mine, target);
            return false;
        }
        if (ep_ld_relaxed_sys(&status->code) != EP_STATUS_OK) {
            return false;
        }
    }
}

// ep_wait_until for the int at `addr`, acquired at system scope, or at GPU
// scope where its writer runs on this GPU (`same_gpu`, see ep_ld_acquire).
__device__ __forceinline__ bool ep_wait_until_ge(const int* addr, int target, uint64_t deadline_ns,
                                                 const int* abort_flag, EpDeviceStatus* status,
                                                 int rank, int phase, EpPeerCall call,
                                                 bool same_gpu = false) {
    return ep_wait_until([addr, same_gpu] { return ep_ld_acquire(addr, same_gpu); }, target,
                         deadline_ns, abort_flag, status, rank, phase, call);
}

// ---------------------------------------------------------------------------
// The barrier's words in every rank's buffer
// ---------------------------------------------------------------------------

// Every rank's symmetric buffer starts with the barrier's [world] signal
// slots; at EP_BARRIER_COUNTER_OFFSET (ep_abi.h) follow two words of the
// rank itself: the number of barriers it has entered, then the number of
// the last one it passed.

struct EpBarrierWords {
    int entered;
    int passed;
    // This rank passed its latest barrier (or has run none).
    __device__ __forceinline__ bool last_passed() const { return entered == passed; }
};

// The two words, read from the rank's own buffer `own_base`.
__device__ __forceinline__ EpBarrierWords ep_barrier_words(uint64_t own_base) {
    const volatile int* words = reinterpret_cast<const volatile int*>(own_base + EP_BARRIER_COUNTER_OFFSET);
    return {words[0], words[1]};
}

// True when this rank passed its latest barrier (or has run none): kernels
// that use what peers wrote before a barrier check it first, and do nothing
// after a barrier that timed out or was aborted. Device memory, so the
// check costs no host round trip.
__device__ __forceinline__ bool ep_last_barrier_passed(uint64_t own_base) {
    return ep_barrier_words(own_base).last_passed();
}

// ---------------------------------------------------------------------------
// Warps, routing and BF16 vectors
// ---------------------------------------------------------------------------

// Chunk counts a thread loads at once when summing them: a 4096-token
// dispatch (16 chunks) sums in one round trip instead of a chain of them.
#define EP_SUM_CHUNKS_IN_FLIGHT 16

// A dispatch's per-chunk counts (`chunk_counts`, [chunks][columns])
// summed over the first `chunks` chunks, for every column, into `sums`: the
// totals (all chunks) or a chunk's bases (the chunks before it). The block's
// threads share the columns; each has EP_SUM_CHUNKS_IN_FLIGHT loads in
// flight before it adds them. The loads go to L2 (`__ldcg`): the counts may
// come from other blocks of the same kernel.
__device__ __forceinline__ void ep_sum_chunk_counts(const int* chunk_counts, int columns,
                                                    int chunks, int* sums) {
    for (int c = threadIdx.x; c < columns; c += blockDim.x) {
        int sum = 0;
        for (int first = 0; first < chunks; first += EP_SUM_CHUNKS_IN_FLIGHT) {
            int counts[EP_SUM_CHUNKS_IN_FLIGHT];
#pragma unroll
            for (int i = 0; i < EP_SUM_CHUNKS_IN_FLIGHT; ++i) {
                const int b = first + i;
                counts[i] = b < chunks ? __ldcg(chunk_counts + static_cast<int64_t>(b) * columns + c) : 0;
            }
#pragma unroll
            for (int i = 0; i < EP_SUM_CHUNKS_IN_FLIGHT; ++i) {
                sum += counts[i];
            }
        }
        sums[c] = sum;
    }
}

// Bit l set for every lane l below the calling lane.
__device__ __forceinline__ unsigned ep_lanemask_lt() {
    unsigned mask;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(mask));
    return mask;
}

// In the ascending `starts[0 .. n)` (n >= 1, starts[0] <= value), the index
// of the last entry at or below `value`: the segment (of an expert's rows or
// tiles) that holds `value`, empty segments sharing their successor's start.
__device__ __forceinline__ int ep_segment_of(const int* starts, int n, int value) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (starts[mid] <= value) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

// A dispatch's expert-major layout as the handle keeps it (`layout`: [L + 1]
// segment starts, then [L] real rows) into `offset` and `count`. Whole
// block; the arrays are read after its closing barrier.
__device__ __forceinline__ void ep_load_expert_layout(const int* layout, int experts, int* offset,
                                                      int* count) {
    for (int i = threadIdx.x; i <= experts; i += blockDim.x) {
        offset[i] = layout[i];
        if (i < experts) {
            count[i] = layout[experts + 1 + i];
        }
    }
    __syncthreads();
}

// Whether expert e's real rows fit its segment: what a dispatch writes, so
// false only for a layout that did not come from one.
__device__ __forceinline__ bool ep_expert_rows_fit(const int* offset, const int* count, int e) {
    return count[e] >= 0 && offset[e] + count[e] <= offset[e + 1];
}

// A token's per-slot values (ids, weights, a record's slots) move as whole
// 16-byte vectors where they can: `n` slots at `p`, when `p` is 16-byte
// aligned and n a multiple of 4, else one value at a time. A warp whose
// lanes hold consecutive tokens then reads or writes whole sectors with a
// quarter of the instructions, instead of one strided word per slot.
__device__ __forceinline__ bool ep_slots_vectorizable(const void* p, int n) {
    return n % 4 == 0 && (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

__device__ __forceinline__ int ep_word_bits(int v) { return v; }
__device__ __forceinline__ int ep_word_bits(float v) { return __float_as_int(v); }

// v[k] = src[k] for k < n; v[k] = fill from n on.
template <typename T>
__device__ __forceinline__ void ep_load_slots(const T* src, int n, T fill, T (&v)[EP_MAX_TOPK]) {
    static_assert(sizeof(T) == 4, "slots are 32-bit words");
    if (ep_slots_vectorizable(src, n)) {
#pragma unroll
        for (int k = 0; k < EP_MAX_TOPK; k += 4) {
            const T* q = src + k;
            if (k < n) {
                const int4 w = *reinterpret_cast<const int4*>(q);
                v[k] = *reinterpret_cast<const T*>(&w.x);
                v[k + 1] = *reinterpret_cast<const T*>(&w.y);
                v[k + 2] = *reinterpret_cast<const T*>(&w.z);
                v[k + 3] = *reinterpret_cast<const T*>(&w.w);
            } else {
                v[k] = v[k + 1] = v[k + 2] = v[k + 3] = fill;
            }
        }
    } else {
#pragma unroll
        for (int k = 0; k < EP_MAX_TOPK; ++k) {
            v[k] = k < n ? src[k] : fill;
        }
    }
}

// dst[k] = v[k] for k < n.
template <typename T>
__device__ __forceinline__ void ep_store_slots(T* dst, int n, const T (&v)[EP_MAX_TOPK]) {
    static_assert(sizeof(T) == 4, "slots are 32-bit words");
    if (ep_slots_vectorizable(dst, n)) {
#pragma unroll
        for (int k = 0; k < EP_MAX_TOPK; k += 4) {
            if (k >= n) {
                break;
            }
            reinterpret_cast<int4*>(dst + k)[0] =
                make_int4(ep_word_bits(v[k]), ep_word_bits(v[k + 1]), ep_word_bits(v[k + 2]),
                          ep_word_bits(v[k + 3]));
        }
    } else {
#pragma unroll
        for (int k = 0; k < EP_MAX_TOPK; ++k) {
            if (k >= n) {
                break;
            }
            dst[k] = v[k];
        }
    }
}

// The expert each slot of a token really uses (its "effective expert"):
// the id, or -1 when the slot is dropped (-1), is not an expert id, or
// repeats an earlier slot of the same token. Every kernel routes by these
// functions, so an id from the caller is never used as an address
// unchecked.
//
// A thread's token: its `topk` ids at `ids` into `id` (-1 from slot topk
// on) and each slot's effective expert into `experts` (-1 from slot topk
// on). The ids are loaded together (ep_load_slots), one memory round trip
// (checking slot by slot against the earlier slots in memory would chain
// up to topk loads per slot).
__device__ __forceinline__ void ep_effective_experts(const int* ids, int topk, int num_experts,
                                                     int (&id)[EP_MAX_TOPK],
                                                     int (&experts)[EP_MAX_TOPK]) {
    ep_load_slots(ids, topk, -1, id);
#pragma unroll
    for (int k = 0; k < EP_MAX_TOPK; ++k) {
        experts[k] = -1;
    }
    // Slots from topk on stay -1: the loop stops there, so a token of topk
    // slots makes topk (topk - 1) / 2 comparisons, not those of EP_MAX_TOPK.
#pragma unroll
    for (int k = 0; k < EP_MAX_TOPK; ++k) {
        if (k >= topk) {
            break;
        }
        bool effective = id[k] >= 0 && id[k] < num_experts;
#pragma unroll
        for (int j = 0; j < k; ++j) {
            effective = effective && id[j] != id[k];
        }
        experts[k] = effective ? id[k] : -1;
    }
}

// Warp-wide, a warp's token: lane k < topk gets slot k's
// effective expert (-1 in the other lanes), from one load per lane and
// shuffles instead of a chain of loads. Every lane must call it.
__device__ __forceinline__ int ep_effective_expert_of_lane(const int* ids, int topk,
                                                           int num_experts) {
    const int lane = threadIdx.x % 32;
    const int id = lane < topk ? ids[lane] : -1;
    bool effective = lane < topk && id >= 0 && id < num_experts;
#pragma unroll
    for (int j = 0; j < EP_MAX_TOPK; ++j) {
        const int earlier = __shfl_sync(0xffffffffu, id, j);
        effective = effective && !(j < lane && earlier == id);
    }
    return effective ? id : -1;
}

// Stores `value` at `array[index]` unless `array` is nullptr: for every
// output the caller may leave out (the API documents it "may be NULL").
template <typename T>
__device__ __forceinline__ void ep_store_optional(T* array, int64_t index, T value) {
    if (array != nullptr) {
        array[index] = value;
    }
}

// The 8 BF16 values of a 16-byte vector, widened to fp32 (exact).
__device__ __forceinline__ void ep_unpack_bf16x8(const int4& raw, float (&out)[8]) {
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(pairs[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

// 8 fp32 values rounded to BF16 (to nearest, ties to even), packed.
__device__ __forceinline__ int4 ep_pack_bf16x8(const float (&in)[8]) {
    int4 raw;
    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        pairs[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
    }
    return raw;
}

// 16-byte vectors (8 channels each) each lane sums at once in a combine.
#define EP_SUM_UNROLL 4

// Rows a lane loads before it adds them in ep_add_weighted_rows: with
// EP_SUM_UNROLL vectors of each, EP_SUM_ROWS_IN_FLIGHT * EP_SUM_UNROLL
// 16-byte loads in flight per lane (one row's vectors alone are too few to
// keep HBM or NVLink busy with the SM budget's warps).
#define EP_SUM_ROWS_IN_FLIGHT 2

// acc[u] += w_i * row_i[base + 32 u] for the rows i = 0 .. rows - 1 that
// `row_of(i, row, w)` says are present (it returns false for an absent
// one), i ascending, each product rounded before it is added (the
// reference's order; with w = 1 the product is exact, so plain sums use
// this too); vectors at `vectors` and beyond are left out. The vectors of
// up to EP_SUM_ROWS_IN_FLIGHT rows are loaded before any of them is added.
// kUnroll: vectors per lane and row (EP_SUM_UNROLL, or fewer where
// registers are scarce); kRows: rows loaded at once (EP_SUM_ROWS_IN_FLIGHT).
template <int kUnroll, int kRows = EP_SUM_ROWS_IN_FLIGHT, typename RowOf>
__device__ __forceinline__ void ep_add_weighted_rows(float (&acc)[kUnroll][8], int rows,
                                                     RowOf row_of, int base, int vectors) {
    for (int first = 0; first < rows; first += kRows) {
        int4 raw[kRows][kUnroll];
        float w[kRows];
        bool present[kRows];
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
            const int4* row = nullptr;
            present[i] = first + i < rows && row_of(first + i, row, w[i]);
            if (present[i]) {
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) {
                    if (base + u * 32 < vectors) {
                        raw[i][u] = row[base + u * 32];
                    }
                }
            }
        }
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
            if (!present[i]) {
                continue;
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                float f[8];
                ep_unpack_bf16x8(raw[i][u], f);
#pragma unroll
                for (int c = 0; c < 8; ++c) {
                    acc[u][c] = __fadd_rn(acc[u][c], __fmul_rn(w[i], f[c]));
                }
            }
        }
    }
}

// Two BF16 values with -0 made +0: what a sum that starts from an fp32 zero
// (the combine's reduce, the reference's sums) makes of a single row.
// Where a row is its token's whole sum, it is written through this.
__device__ __forceinline__ unsigned ep_bf16x2_plus_zero(unsigned pair) {
    constexpr unsigned kMagnitudes = 0x7fff7fffu;
    constexpr unsigned kSigns = 0x80008000u;
    // Bit 15 of each half of `nonzero` is set unless the half's magnitude
    // is 0: adding 0x7fff to a 15-bit magnitude carries into it, and no
    // carry crosses into the high half.
    const unsigned nonzero = (pair & kMagnitudes) + kMagnitudes;
    return pair & (kMagnitudes | (nonzero & kSigns));
}

// The same for the eight BF16 values of a 16-byte vector.
__device__ __forceinline__ int4 ep_bf16x8_plus_zero(int4 v) {
    v.x = static_cast<int>(ep_bf16x2_plus_zero(static_cast<unsigned>(v.x)));
    v.y = static_cast<int>(ep_bf16x2_plus_zero(static_cast<unsigned>(v.y)));
    v.z = static_cast<int>(ep_bf16x2_plus_zero(static_cast<unsigned>(v.z)));
    v.w = static_cast<int>(ep_bf16x2_plus_zero(static_cast<unsigned>(v.w)));
    return v;
}

// row[base + 32 u] = BF16 of acc[u], for the vectors of one lane below
// `vectors`; kPlusZero: with every -0 made +0 (ep_bf16x8_plus_zero).
template <int kUnroll, bool kPlusZero = false>
__device__ __forceinline__ void ep_store_bf16_vectors(int4* row, const float (&acc)[kUnroll][8],
                                                      int base, int vectors) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        if (base + u * 32 < vectors) {
            const int4 v = ep_pack_bf16x8(acc[u]);
            row[base + u * 32] = kPlusZero ? ep_bf16x8_plus_zero(v) : v;
        }
    }
}
