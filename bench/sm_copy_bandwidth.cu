// How fast SMs can move token rows, against the copy engine: a standalone
// CUDA program (not part of the library) behind the normal mode's
// expert-major figures in bench/RESULTS.md.
//
//   nvcc -std=c++17 -arch=sm_90a -O3 -o sm_copy_bandwidth bench/sm_copy_bandwidth.cu
//   ./sm_copy_bandwidth
//
// It times, at 24, 48 and 132 blocks (one per SM), what the expert-major
// dispatch's pull does at world size 1 with 4096 tokens of top-8: every
// token row (14336 bytes: BF16, hidden 7168) copied into 8 scattered rows,
// and the zeros of padding rows. Each two ways: by warps with 16-byte loads
// and stores (the library's way, ep_warp_copy_row), and by TMA bulk copies
// through shared memory (one thread per warp issues them). Beside them,
// cudaMemcpyAsync and cudaMemsetAsync (the copy engine, no SM). Medians of
// 20 runs after 3, CUDA events. A last check compares the TMA copy's rows
// with the source.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "bench_common.cuh"

constexpr int kRowBytes = 14336;   // a BF16 row of hidden 7168
constexpr int kTokens = 4096;
constexpr int kCopies = 8;         // top-8, every expert local
constexpr int kZeroRows = 16384;   // 235 MB, about the padding at this shape
constexpr int kWarpThreads = 512;  // as the library's pull (EP_MOVE_THREADS)
constexpr int kVectors = kRowBytes / 16;

// Warps: a warp per token, kUnroll 16-byte loads per lane in flight, each
// stored into every destination row.
template <int kUnroll>
__global__ void __launch_bounds__(kWarpThreads)
    warp_copy(const uint8_t* src, uint8_t* dst, const int* dest_rows) {
    const int warps = gridDim.x * (kWarpThreads / 32);
    const int lane = threadIdx.x % 32;
    for (int t = blockIdx.x * (kWarpThreads / 32) + threadIdx.x / 32; t < kTokens; t += warps) {
        const int4* s = reinterpret_cast<const int4*>(src + int64_t(t) * kRowBytes);
        for (int base = 0; base < kVectors; base += 32 * kUnroll) {
            int4 v[kUnroll];
            load_vectors<kUnroll>(v, s, base, kVectors, lane);
            for (int k = 0; k < kCopies; ++k) {
                int4* d = reinterpret_cast<int4*>(dst + int64_t(dest_rows[t * kCopies + k]) * kRowBytes);
                store_vectors<kUnroll>(d, v, base, kVectors, lane);
            }
        }
    }
}

__global__ void __launch_bounds__(kWarpThreads) warp_zero(uint8_t* dst) {
    const int warps = gridDim.x * (kWarpThreads / 32);
    const int lane = threadIdx.x % 32;
    for (int r = blockIdx.x * (kWarpThreads / 32) + threadIdx.x / 32; r < kZeroRows; r += warps) {
        int4* x = reinterpret_cast<int4*>(dst + int64_t(r) * kRowBytes);
#pragma unroll 4
        for (int i = lane; i < kVectors; i += 32) x[i] = make_int4(0, 0, 0, 0);
    }
}

// TMA bulk copies (PTX cp.async.bulk).
__device__ __forceinline__ void bulk_load(void* smem, const void* global, int bytes, uint64_t* b) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            shared_address(smem)),
        "l"(global), "r"(bytes), "r"(shared_address(b))
        : "memory");
}
__device__ __forceinline__ void bulk_store(void* global, const void* smem, int bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(global),
                 "r"(shared_address(smem)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// TMA: lane 0 of each warp copies its tokens in kPiece-byte pieces through a
// ring of kBuffers pieces of shared memory: load, then one bulk store per
// destination row; a buffer is loaded again once its stores have read it.
template <int kPiece, int kBuffers, int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
    tma_copy(const uint8_t* src, uint8_t* dst, const int* dest_rows) {
    extern __shared__ __align__(128) uint8_t smem[];
    __shared__ uint64_t full[kWarps][kBuffers];
    constexpr int kPieces = kRowBytes / kPiece;
    const int w = threadIdx.x / 32;
    if (threadIdx.x % 32 != 0) return;
    uint8_t* ring = smem + w * kBuffers * kPiece;
    for (int b = 0; b < kBuffers; ++b) barrier_init(&full[w][b]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    const int copier = blockIdx.x * kWarps + w, copiers = gridDim.x * kWarps;
    const int tokens = kTokens > copier ? (kTokens - copier + copiers - 1) / copiers : 0;
    const int pieces = tokens * kPieces;
    auto token_of = [&](int i) { return copier + i / kPieces * copiers; };
    auto load = [&](int i) {
        uint64_t* b = &full[w][i % kBuffers];
        barrier_expect(b, kPiece);
        bulk_load(ring + i % kBuffers * kPiece,
                  src + int64_t(token_of(i)) * kRowBytes + i % kPieces * kPiece, kPiece, b);
    };
    for (int i = 0; i < kBuffers && i < pieces; ++i) load(i);
    for (int i = 0; i < pieces; ++i) {
        barrier_wait(&full[w][i % kBuffers], i / kBuffers & 1);
        for (int k = 0; k < kCopies; ++k) {
            bulk_store(dst + int64_t(dest_rows[token_of(i) * kCopies + k]) * kRowBytes + i % kPieces * kPiece,
                       ring + i % kBuffers * kPiece, kPiece);
        }
        bulk_commit();
        if (i >= 1 && i - 1 + kBuffers < pieces) {
            bulk_wait_read<1>();  // piece i - 1's stores have read its buffer
            load(i - 1 + kBuffers);
        }
    }
    bulk_wait_all();
}

// TMA zeros: bulk stores from a zeroed piece of shared memory.
template <int kPiece, int kWarps>
__global__ void __launch_bounds__(kWarps * 32) tma_zero(uint8_t* dst) {
    extern __shared__ __align__(128) uint8_t smem[];
    for (int i = threadIdx.x; i < kPiece / 16; i += blockDim.x) {
        reinterpret_cast<int4*>(smem)[i] = make_int4(0, 0, 0, 0);
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (threadIdx.x % 32 != 0) return;
    const int copier = blockIdx.x * kWarps + threadIdx.x / 32, copiers = gridDim.x * kWarps;
    int groups = 0;
    for (int r = copier; r < kZeroRows; r += copiers) {
        for (int piece = 0; piece < kRowBytes / kPiece; ++piece) {
            bulk_store(dst + int64_t(r) * kRowBytes + piece * kPiece, smem, kPiece);
        }
        bulk_commit();
        if (++groups > 4) bulk_wait_read<4>();
    }
    bulk_wait_all();
}

int main() {
    const size_t rows_bytes = size_t(kTokens) * kRowBytes, copies_bytes = rows_bytes * kCopies;
    uint8_t *src, *dst, *zeros, *copy;
    int* dest_rows;
    CHECK(cudaMalloc(&src, rows_bytes));
    CHECK(cudaMalloc(&dst, copies_bytes));
    CHECK(cudaMalloc(&copy, copies_bytes));
    CHECK(cudaMalloc(&zeros, size_t(kZeroRows) * kRowBytes));
    CHECK(cudaMalloc(&dest_rows, kTokens * kCopies * sizeof(int)));
    std::vector<int> rows(kTokens * kCopies);
    for (int i = 0; i < kTokens * kCopies; ++i) rows[i] = i;
    std::shuffle(rows.begin(), rows.end(), std::mt19937(1));
    CHECK(cudaMemcpy(dest_rows, rows.data(), rows.size() * sizeof(int), cudaMemcpyHostToDevice));
    CHECK(cudaMemset(src, 1, rows_bytes));

    const double moved = double(rows_bytes) * (1 + kCopies), zeroed = double(kZeroRows) * kRowBytes;
    const float memcpy_us = median_us([&] {
        CHECK(cudaMemcpyAsync(copy, dst, copies_bytes, cudaMemcpyDeviceToDevice));
    });
    printf("cudaMemcpyAsync D2D %.0f MB: %.1f us, %.0f GB/s (read + write)\n", copies_bytes / 1e6,
           memcpy_us, 2.0 * copies_bytes / memcpy_us / 1e3);
    const float memset_us = median_us([&] { CHECK(cudaMemsetAsync(zeros, 0, size_t(kZeroRows) * kRowBytes)); });
    printf("cudaMemsetAsync %.0f MB: %.1f us, %.0f GB/s\n", zeroed / 1e6, memset_us, zeroed / memset_us / 1e3);

    auto* tma_half = tma_copy<kRowBytes / 2, 3, 8>;
    auto* tma_whole = tma_copy<kRowBytes, 2, 4>;
    const int half_smem = 8 * 3 * kRowBytes / 2, whole_smem = 4 * 2 * kRowBytes;
    CHECK(cudaFuncSetAttribute(tma_half, cudaFuncAttributeMaxDynamicSharedMemorySize, half_smem));
    CHECK(cudaFuncSetAttribute(tma_whole, cudaFuncAttributeMaxDynamicSharedMemorySize, whole_smem));
    for (int blocks : {24, 48, 132}) {
        const float w = median_us([&] { warp_copy<16><<<blocks, kWarpThreads>>>(src, dst, dest_rows); });
        const float h = median_us([&] { tma_half<<<blocks, 256, half_smem>>>(src, dst, dest_rows); });
        const float f = median_us([&] { tma_whole<<<blocks, 128, whole_smem>>>(src, dst, dest_rows); });
        printf("scatter copy (%.0f MB read + written), %3d blocks: warps %.1f us (%.0f GB/s), "
               "TMA half rows %.1f us (%.0f GB/s), TMA whole rows %.1f us (%.0f GB/s)\n",
               moved / 1e6, blocks, w, moved / w / 1e3, h, moved / h / 1e3, f, moved / f / 1e3);
        const float z = median_us([&] { warp_zero<<<blocks, kWarpThreads>>>(zeros); });
        const float t = median_us([&] { tma_zero<kRowBytes, 8><<<blocks, 256, kRowBytes>>>(zeros); });
        printf("zero fill (%.0f MB), %3d blocks: warps %.1f us (%.0f GB/s), TMA %.1f us (%.0f GB/s)\n",
               zeroed / 1e6, blocks, z, zeroed / z / 1e3, t, zeroed / t / 1e3);
    }

    std::vector<uint8_t> pattern(rows_bytes), got(copies_bytes);
    for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = uint8_t(i * 7 + i / kRowBytes);
    CHECK(cudaMemcpy(src, pattern.data(), rows_bytes, cudaMemcpyHostToDevice));
    CHECK(cudaMemset(dst, 0, copies_bytes));
    tma_half<<<24, 256, half_smem>>>(src, dst, dest_rows);
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(got.data(), dst, copies_bytes, cudaMemcpyDeviceToHost));
    size_t bad = 0;
    for (int t = 0; t < kTokens; ++t) {
        for (int k = 0; k < kCopies; ++k) {
            bad += memcmp(&got[size_t(rows[t * kCopies + k]) * kRowBytes], &pattern[size_t(t) * kRowBytes],
                          kRowBytes) != 0;
        }
    }
    printf("TMA copy check: %zu wrong rows of %d\n", bad, kTokens * kCopies);
    return bad == 0 ? 0 : 1;
}
