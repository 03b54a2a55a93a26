// How fast one GPU can stream a decode batch's expert weights into shared
// memory the way the fused grouped GEMM reads them: a standalone CUDA
// program (not part of the library) behind the decode figures in
// bench/RESULTS.md.
//
//   nvcc -std=c++17 -arch=sm_90a -O3 -o weight_stream_bandwidth bench/weight_stream_bandwidth.cu
//   ./weight_stream_bandwidth
//
// The weights are [32 experts, 4096, k] of 7168 bytes a row (FP8, k 7168) or
// 14336 (BF16). One block per SM takes work units from a counter in the
// kernels' order (expert by expert, n-tile by n-tile); a unit streams its
// `rows` x k tile in k-blocks of `inner` bytes a row, each a 3-D TMA load
// into a ring of `stages` shared-memory stages, as the fused kernel's
// producer warp does. A consumer warp only waits for each stage and frees
// it: no math, so the figure is the ceiling of the load pattern alone.
// Variants: the box of the FP8 kernel (192 rows x 128 bytes, 5 stages) and
// of the BF16 one (256 x 128, 4 stages); deeper rings; two k-blocks issued
// back to back (the DRAM sees 256 bytes of a row at once); 256-byte boxes;
// the consumer keeping each stage a while (as the fused kernels' MMAs do);
// an activation box loaded into each stage beside the weights, as the
// fused kernels load their A rows, from [4096, k] rows whose tiles are
// shared by the units of an expert (decode: 22 FP8 or 16 BF16 n-tiles read
// one m-tile) or by fewer.
// Beside them a plain read of the same bytes by every thread of the GPU
// (16-byte loads, summed) as the read ceiling. Medians of 20 runs after 3,
// CUDA events; GB/s are weight bytes per second.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "bench_common.cuh"

constexpr int kExperts = 32;
constexpr int kN = 4096;
constexpr int kThreads = 64;  // warp 0 produces (lane 0), warp 1 consumes
constexpr int kMaxStages = 8;

struct Variant {
    const char* name;
    int row_bytes;  // k bytes of a weight row
    int rows;       // n rows of a unit (the box's outer size)
    int inner;      // bytes of a row per k-block (the box's inner size)
    int stages;
    int pair;       // k-blocks issued back to back (1 or 2)
    int a_rows;     // rows of an activation box loaded into each stage too (0: none)
    int hold_ns;    // how long the consumer keeps each stage before freeing it
    int a_first;    // 1: the activation box is issued before the weight box
    int a_share;    // units that read the same activation rows (1: each its own)
};

// Activations: [kARows, row_bytes]; a unit reads the tile at row
// (unit / a_share * a_rows) % kARows.
constexpr int kARows = 4096;

__device__ __forceinline__ uint64_t globaltimer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ void barrier_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar)) : "memory");
}

__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int x,
                                            int y, int z) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(shared_address(dst)),
        "l"(map), "r"(shared_address(bar)), "r"(x), "r"(y), "r"(z)
        : "memory");
}

// One block per SM: units (expert, n-tile) from `counter`, each streamed
// k-block by k-block through the ring.
__global__ void __launch_bounds__(kThreads, 1)
    stream_weights(const __grid_constant__ CUtensorMap map, const __grid_constant__ CUtensorMap a_map,
                   Variant v, int* counter) {
    extern __shared__ uint8_t stage_bytes[];
    __shared__ uint64_t full[kMaxStages], empty[kMaxStages];
    __shared__ int unit_of[kMaxStages];
    // The 128-byte swizzle wants stages on 1024-byte boundaries.
    uint8_t* base = stage_bytes + ((1024 - shared_address(stage_bytes) % 1024) % 1024);
    const int b_size = v.rows * v.inner;
    const int stage_size = b_size + v.a_rows * v.inner;
    const int k_blocks = v.row_bytes / v.inner;
    const int n_tiles = (kN + v.rows - 1) / v.rows;  // the last one ragged: rows past n come as zeros, not from memory
    const int units = kExperts * n_tiles;
    if (threadIdx.x == 0) {
        for (int s = 0; s < v.stages; ++s) {
            barrier_init(&full[s]);
            barrier_init(&empty[s]);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // producer
        int stage = 0;
        uint32_t parity = 1;  // empty stages: the phase before the first counts as done
        for (;;) {
            const int unit = atomicAdd(counter, 1);
            if (unit >= units) {  // the end: a stage with no data and unit -1
                barrier_wait(&empty[stage], parity);
                unit_of[stage] = -1;
                barrier_arrive(&full[stage]);
                break;
            }
            const int expert = unit / n_tiles, row = (unit % n_tiles) * v.rows;
            for (int kb = 0; kb < k_blocks; kb += v.pair) {
                const int group = min(v.pair, k_blocks - kb);
                // Wait for every stage of the group first, then issue them.
                int s = stage;
                uint32_t ph = parity;
                for (int i = 0; i < group; ++i) {
                    barrier_wait(&empty[s], ph);
                    if (++s == v.stages) s = 0, ph ^= 1;
                }
                for (int i = 0; i < group; ++i) {
                    unit_of[stage] = unit;
                    barrier_expect(&full[stage], stage_size);
                    const auto load_a = [&] {
                        const int a_row = (unit / max(v.a_share, 1) * v.a_rows) % kARows;
                        tma_load_3d(base + stage * stage_size + b_size, &a_map, &full[stage],
                                    (kb + i) * v.inner, a_row, 0);
                    };
                    if (v.a_rows > 0 && v.a_first) {
                        load_a();
                    }
                    tma_load_3d(base + stage * stage_size, &map, &full[stage], (kb + i) * v.inner,
                                row, expert);
                    if (v.a_rows > 0 && !v.a_first) {
                        load_a();
                    }
                    if (++stage == v.stages) stage = 0, parity ^= 1;
                }
            }
        }
    } else if (threadIdx.x == 32) {  // consumer
        int stage = 0;
        uint32_t parity = 0;
        for (;;) {
            barrier_wait(&full[stage], parity);
            const int unit = unit_of[stage];
            // The fused kernels' consumers keep a stage for their MMAs (and
            // the A rows it waits for): a hold of that order.
            for (const uint64_t until = globaltimer_ns() + v.hold_ns; globaltimer_ns() < until;) {
            }
            barrier_arrive(&empty[stage]);
            if (++stage == v.stages) stage = 0, parity ^= 1;
            if (unit < 0) break;
        }
    }
}

// Every thread reads 16-byte vectors of the array, grid-strided, and sums
// them (stored only if the sum is a value no input makes, so the loads stay).
__global__ void read_all(const int4* src, int64_t vectors, int* sink) {
    int acc = 0;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < vectors;
         i += int64_t(gridDim.x) * blockDim.x) {
        const int4 x = src[i];
        acc ^= x.x ^ x.y ^ x.z ^ x.w;
    }
    if (acc == 0x7fffffff) *sink = acc;
}

static PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
    if (fn == nullptr) {
        printf("cuTensorMapEncodeTiled not found\n");
        exit(1);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
}

int main() {
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int64_t max_bytes = int64_t(kExperts) * kN * 14336;
    uint8_t* weights;
    int *counter, *sink;
    CHECK(cudaMalloc(&weights, max_bytes));
    CHECK(cudaMemset(weights, 1, max_bytes));
    uint8_t* activations;
    CHECK(cudaMalloc(&activations, int64_t(kARows) * 14336));
    CHECK(cudaMemset(activations, 1, int64_t(kARows) * 14336));
    CHECK(cudaMalloc(&counter, sizeof(int)));
    CHECK(cudaMalloc(&sink, sizeof(int)));
    auto encode = encode_tiled();
    CHECK(cudaFuncSetAttribute(stream_weights, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               220 * 1024));

    // name, row bytes, box rows, box bytes per row, stages, pair, A rows,
    // hold ns, A box first, units sharing A rows
    const Variant variants[] = {
        {"FP8 box 192 x 128 B, 5 stages (the FP8 kernel)", 7168, 192, 128, 5, 1, 0, 0, 0, 1},
        {"FP8 box 192 x 128 B, 8 stages", 7168, 192, 128, 8, 1, 0, 0, 0, 1},
        {"FP8 box 192 x 128 B, 6 stages, pairs", 7168, 192, 128, 6, 2, 0, 0, 0, 1},
        {"FP8 box 192 x 256 B, 3 stages", 7168, 192, 256, 3, 1, 0, 0, 0, 1},
        {"FP8 box 256 x 128 B, 5 stages", 7168, 256, 128, 5, 1, 0, 0, 0, 1},
        {"FP8 box 128 x 128 B, 8 stages", 7168, 128, 128, 8, 1, 0, 0, 0, 1},
        {"FP8 the kernel's, each stage held 250 ns", 7168, 192, 128, 5, 1, 0, 250, 0, 1},
        {"FP8 the kernel's, each stage held 500 ns", 7168, 192, 128, 5, 1, 0, 500, 0, 1},
        {"FP8 the kernel's, each stage held 1000 ns", 7168, 192, 128, 5, 1, 0, 1000, 0, 1},
        {"FP8 + 128-row A box per stage, 22 units per A tile (decode)", 7168, 192, 128, 5, 1, 128, 0, 0, 22},
        {"FP8 + 128-row A box per stage, 22 units per A tile, A first", 7168, 192, 128, 5, 1, 128, 0, 1, 22},
        {"FP8 + 128-row A box per stage, about 4 units per A tile", 7168, 192, 128, 5, 1, 128, 0, 0, 1},
        {"FP8 + 128-row A box per stage, 22 units per A tile, held 250 ns", 7168, 192, 128, 5, 1, 128, 250, 0, 22},
        {"FP8 + 32-row A box per stage, 22 units per A tile, 7 stages", 7168, 192, 128, 7, 1, 32, 0, 0, 22},
        {"BF16 box 256 x 128 B, 4 stages (the BF16 kernel)", 14336, 256, 128, 4, 1, 0, 0, 0, 1},
        {"BF16 box 256 x 128 B, 6 stages", 14336, 256, 128, 6, 1, 0, 0, 0, 1},
        {"BF16 box 256 x 128 B, 6 stages, pairs", 14336, 256, 128, 6, 2, 0, 0, 0, 1},
        {"BF16 box 256 x 256 B, 3 stages", 14336, 256, 256, 3, 1, 0, 0, 0, 1},
        {"BF16 the kernel's, each stage held 500 ns", 14336, 256, 128, 4, 1, 0, 500, 0, 1},
        {"BF16 + 32-row A box per stage, 16 units per A tile (decode)", 14336, 256, 128, 4, 1, 32, 0, 0, 16},
        {"BF16 + 32-row A box per stage, 16 units per A tile, A first", 14336, 256, 128, 4, 1, 32, 0, 1, 16},
        {"BF16 + 32-row A box per stage, about 1 unit per A tile", 14336, 256, 128, 4, 1, 32, 0, 0, 1},
    };
    printf("| load pattern (%d blocks) | weights MB | median us | GB/s |\n| --- | ---: | ---: | ---: |\n",
           sms);
    for (const Variant& v : variants) {
        const int64_t bytes = int64_t(kExperts) * kN * v.row_bytes;
        CUtensorMap map;
        const cuuint64_t dims[3] = {cuuint64_t(v.row_bytes), kN, kExperts};
        const cuuint64_t strides[2] = {cuuint64_t(v.row_bytes), cuuint64_t(v.row_bytes) * kN};
        const cuuint32_t box[3] = {cuuint32_t(v.inner), cuuint32_t(v.rows), 1};
        const cuuint32_t unit_strides[3] = {1, 1, 1};
        const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, weights, dims, strides, box,
                                  unit_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                  v.inner == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
        if (r != CUDA_SUCCESS) {
            printf("cuTensorMapEncodeTiled failed (%d) for %s\n", int(r), v.name);
            return 1;
        }
        CUtensorMap a_map;
        const cuuint64_t a_dims[3] = {cuuint64_t(v.row_bytes), kARows, 1};
        const cuuint64_t a_strides[2] = {cuuint64_t(v.row_bytes), cuuint64_t(v.row_bytes) * kARows};
        const cuuint32_t a_box[3] = {cuuint32_t(v.inner), cuuint32_t(v.a_rows > 0 ? v.a_rows : 8), 1};
        if (encode(&a_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, activations, a_dims, a_strides, a_box,
                   unit_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                   v.inner == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                   CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
            printf("cuTensorMapEncodeTiled failed for the activations of %s\n", v.name);
            return 1;
        }
        const int smem = (v.rows + v.a_rows) * v.inner * v.stages + 1024;
        const float us = median_us([&] {
            CHECK(cudaMemsetAsync(counter, 0, sizeof(int)));
            stream_weights<<<sms, kThreads, smem>>>(map, a_map, v, counter);
        });
        printf("| %s | %.0f | %.1f | %.0f |\n", v.name, bytes / 1e6, us, bytes / (us * 1e3));
    }
    for (int row_bytes : {7168, 14336}) {
        const int64_t bytes = int64_t(kExperts) * kN * row_bytes;
        for (int per_sm : {2, 4}) {
            const float us = median_us([&] {
                read_all<<<sms * per_sm, 512>>>(reinterpret_cast<const int4*>(weights), bytes / 16,
                                               sink);
            });
            printf("| plain 16-byte loads, %d x 512 threads per SM | %.0f | %.1f | %.0f |\n", per_sm,
                   bytes / 1e6, us, bytes / (us * 1e3));
        }
    }
    CHECK(cudaDeviceSynchronize());
    return 0;
}
