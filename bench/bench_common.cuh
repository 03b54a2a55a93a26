// What the standalone benchmark programs (sm_copy_bandwidth.cu,
// p2p_bandwidth.cu) share: the check of a CUDA runtime call, and a warp's
// 16-byte vectors of a row copy, loaded all before any is stored (as the
// library's ep_warp_copy_row keeps them in flight).
#pragma once
#include <cstdio>
#include <cstdlib>

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
