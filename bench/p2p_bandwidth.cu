// SM-driven NVLink traffic between the GPUs of one host, read (pull) against
// write (push): a standalone CUDA program (not part of the library) behind
// the normal mode's multi-GPU figures in bench/RESULTS.md.
//
//   nvcc -std=c++17 -arch=sm_90a -O3 -o p2p_bandwidth bench/p2p_bandwidth.cu
//   ./p2p_bandwidth
//
// Every GPU moves kRows rows of 14336 bytes (BF16, hidden 7168) from or to
// each of its peers, a warp per row with 16 loads of 16 bytes per lane in
// flight (the library's pull, ep_warp_copy_row): "pull" reads a peer's rows
// over NVLink and stores them locally, "push" reads local rows and stores
// them into the peer. All GPUs at once (an all-to-all, as a dispatch), at
// 24, 48 and 132 blocks per GPU, then the same with only GPU 0 active.
// Figures: bytes crossing NVLink into (pull) or out of (push) one GPU,
// divided by the slowest GPU's time; medians of 10 runs after 2. Beside
// them, cudaMemcpyPeerAsync from GPU 1 to GPU 0 (the copy engine).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "bench_common.cuh"

constexpr int kRowBytes = 14336;
constexpr int kRows = 4096;  // rows per peer
constexpr int kVectors = kRowBytes / 16;
constexpr int kThreads = 512;
constexpr int kUnroll = 16;
constexpr int kMaxGpus = 8;

struct Peers {
    const uint8_t* src[kMaxGpus];  // where row r of peer p is read
    uint8_t* dst[kMaxGpus];        // where it is written
    int count;
};

// A warp per (peer, row), peers interleaved so every peer is busy at once.
__global__ void __launch_bounds__(kThreads) move_rows(Peers peers) {
    const int warps = gridDim.x * (kThreads / 32), lane = threadIdx.x % 32;
    for (int w = blockIdx.x * (kThreads / 32) + threadIdx.x / 32; w < kRows * peers.count; w += warps) {
        const int p = w % peers.count, r = w / peers.count;
        const int4* s = reinterpret_cast<const int4*>(peers.src[p] + int64_t(r) * kRowBytes);
        int4* d = reinterpret_cast<int4*>(peers.dst[p] + int64_t(r) * kRowBytes);
        for (int base = 0; base < kVectors; base += 32 * kUnroll) {
            int4 v[kUnroll];
            load_vectors<kUnroll>(v, s, base, kVectors, lane);
            store_vectors<kUnroll>(d, v, base, kVectors, lane);
        }
    }
}

int main() {
    int gpus = 0;
    CHECK(cudaGetDeviceCount(&gpus));
    gpus = std::min(gpus, kMaxGpus);
    if (gpus < 2) {
        printf("needs 2 GPUs or more\n");
        return 1;
    }
    const size_t block_bytes = size_t(kRows) * kRowBytes;
    // Each GPU: an outbox per peer (what peers pull, or what it pushes) and
    // an inbox per peer (where pulled rows land, or peers push).
    std::vector<uint8_t*> outbox(gpus), inbox(gpus);
    std::vector<cudaStream_t> streams(gpus);
    std::vector<cudaEvent_t> start(gpus), stop(gpus);
    for (int g = 0; g < gpus; ++g) {
        CHECK(cudaSetDevice(g));
        for (int p = 0; p < gpus; ++p) {
            if (p != g) CHECK(cudaDeviceEnablePeerAccess(p, 0));
        }
        CHECK(cudaMalloc(&outbox[g], block_bytes * gpus));
        CHECK(cudaMalloc(&inbox[g], block_bytes * gpus));
        CHECK(cudaMemset(outbox[g], g + 1, block_bytes * gpus));
        CHECK(cudaStreamCreateWithFlags(&streams[g], cudaStreamNonBlocking));
        CHECK(cudaEventCreate(&start[g]));
        CHECK(cudaEventCreate(&stop[g]));
    }
    // Pull: GPU g reads peer p's outbox[g] and writes its inbox[p]. Push:
    // GPU g reads its outbox[p] and writes peer p's inbox[g].
    auto peers_of = [&](int g, bool pull) {
        Peers peers{};
        for (int p = 0; p < gpus; ++p) {
            if (p == g) continue;
            if (pull) {
                peers.src[peers.count] = outbox[p] + size_t(g) * block_bytes;
                peers.dst[peers.count] = inbox[g] + size_t(p) * block_bytes;
            } else {
                peers.src[peers.count] = outbox[g] + size_t(p) * block_bytes;
                peers.dst[peers.count] = inbox[p] + size_t(g) * block_bytes;
            }
            ++peers.count;
        }
        return peers;
    };
    // Median over runs of the slowest active GPU's time, us.
    auto run = [&](bool pull, int blocks, int active) {
        std::vector<float> times;
        for (int it = 0; it < 12; ++it) {
            for (int g = 0; g < active; ++g) {
                CHECK(cudaSetDevice(g));
                CHECK(cudaDeviceSynchronize());
            }
            for (int g = 0; g < active; ++g) {
                CHECK(cudaSetDevice(g));
                CHECK(cudaEventRecord(start[g], streams[g]));
                move_rows<<<blocks, kThreads, 0, streams[g]>>>(peers_of(g, pull));
                CHECK(cudaGetLastError());
                CHECK(cudaEventRecord(stop[g], streams[g]));
            }
            float slowest = 0;
            for (int g = 0; g < active; ++g) {
                CHECK(cudaSetDevice(g));
                CHECK(cudaEventSynchronize(stop[g]));
                float ms;
                CHECK(cudaEventElapsedTime(&ms, start[g], stop[g]));
                slowest = std::max(slowest, ms * 1000);
            }
            if (it >= 2) times.push_back(slowest);
        }
        std::sort(times.begin(), times.end());
        return times[times.size() / 2];
    };
    const double nvlink_bytes = double(block_bytes) * (gpus - 1);  // per GPU, one direction
    printf("%d GPUs; per GPU %.0f MB cross NVLink in each direction of a run\n", gpus, nvlink_bytes / 1e6);
    for (int active : {gpus, 1}) {
        for (int blocks : {24, 48, 132}) {
            const float pull = run(true, blocks, active), push = run(false, blocks, active);
            printf("%s, %3d blocks per GPU: pull %.1f us (%.0f GB/s per GPU), push %.1f us (%.0f GB/s per GPU)\n",
                   active == gpus ? "all GPUs at once" : "GPU 0 alone     ", blocks, pull,
                   nvlink_bytes / pull / 1e3, push, nvlink_bytes / push / 1e3);
        }
    }
    CHECK(cudaSetDevice(0));
    std::vector<float> times;
    for (int it = 0; it < 12; ++it) {
        CHECK(cudaEventRecord(start[0], streams[0]));
        CHECK(cudaMemcpyPeerAsync(inbox[0] + block_bytes, 0, outbox[1], 1, block_bytes, streams[0]));
        CHECK(cudaEventRecord(stop[0], streams[0]));
        CHECK(cudaEventSynchronize(stop[0]));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, start[0], stop[0]));
        if (it >= 2) times.push_back(ms * 1000);
    }
    std::sort(times.begin(), times.end());
    printf("cudaMemcpyPeerAsync GPU 1 -> GPU 0, %.0f MB: %.1f us, %.0f GB/s\n", block_bytes / 1e6,
           times[times.size() / 2], block_bytes / times[times.size() / 2] / 1e3);
    return 0;
}
