// What the standalone benchmark programs (sm_copy_bandwidth.cu,
// p2p_bandwidth.cu, weight_stream_bandwidth.cu) share: the check of a CUDA
// runtime call, a warp's 16-byte vectors of a row copy, loaded all before
// any is stored (as the library's ep_warp_copy_row keeps them in flight),
// the shared-memory barriers that TMA copies complete on, and the median
// time of a run.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

// Prints the call and the error, then exits with status 1.
#define CHECK(x)                                                   \
    do {                                                           \
        cudaError_t e = (x);                                       \
        if (e != cudaSuccess) {                                    \
            printf("%s: %s\n", #x, cudaGetErrorString(e));         \
            exit(1);                                               \
        }                                                          \
    } while (0)

// Lane `lane`'s kUnroll vectors of the round at vector `base` (those below
// `vectors`).
template <int kUnroll>
__device__ __forceinline__ void load_vectors(int4 (&v)[kUnroll], const int4* src, int base,
                                             int vectors, int lane) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i < vectors) v[u] = src[i];
    }
}

template <int kUnroll>
__device__ __forceinline__ void store_vectors(int4* dst, const int4 (&v)[kUnroll], int base,
                                              int vectors, int lane) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i < vectors) dst[i] = v[u];
    }
}

// Shared-memory barriers (PTX mbarrier) for TMA copies: one arrival each.
__device__ __forceinline__ uint32_t shared_address(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void barrier_init(uint64_t* b) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(b)));
}
__device__ __forceinline__ void barrier_expect(uint64_t* b, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(b)),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void barrier_wait(uint64_t* b, int parity) {
    asm volatile(
        "{ .reg .pred done; WAIT: mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1; "
        "@!done bra WAIT; }" ::"r"(shared_address(b)),
        "r"(parity)
        : "memory");
}

// The median of 20 runs of `run` (work enqueued on the legacy default
// stream) after 3 unmeasured ones, in microseconds, from CUDA events.
template <class F>
float median_us(F run) {
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    for (int i = 0; i < 3; ++i) run();
    std::vector<float> times;
    for (int i = 0; i < 20; ++i) {
        CHECK(cudaEventRecord(start));
        run();
        CHECK(cudaEventRecord(stop));
        CHECK(cudaEventSynchronize(stop));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, start, stop));
        times.push_back(ms * 1000);
    }
    CHECK(cudaGetLastError());
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
}
