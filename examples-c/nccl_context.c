/*
 * ep on an NCCL communicator: N ranks (default 1) as processes of one host,
 * each with an NCCL communicator made by ncclCommInitRank, and an ep context
 * made from it with ep_ctx_create_from_nccl.
 *
 *   nccl_context [N]          (N divides 16; rank r uses GPU r % GPUs)
 *
 * Child 0 makes the ncclUniqueId and passes it to the others through a pipe
 * (no CUDA or NCCL call happens before fork). Each rank then:
 *   - makes its communicator, and the ep context on it (which borrows it);
 *   - runs a normal-mode dispatch (expert-major output) and combine of
 *     identity experts: out[t] = sum_k w[t,k] * x[t];
 *   - runs a low-latency dispatch (BF16 rows) and combine of identity
 *     experts with the same expected result;
 *   - destroys the context, then the communicator (its own).
 * Values are chosen so that every sum is exact in BF16, and the results are
 * compared exactly. Each rank prints one line; the exit status is 0 only if
 * every rank passed.
 *
 * Build (the pinned NCCL wheel and the CUDA runtime wheel, as installed by
 * scripts/install-cuda-tools.sh, with N = .venv/lib/python3.X/site-packages/nvidia):
 *   cc -std=c11 -Iinclude -I$N/nccl/include -I$N/cu13/include \
 *      examples-c/nccl_context.c -Ltarget/release -lep \
 *      -L$N/nccl/lib -l:libnccl.so.2 -L$N/cu13/lib -l:libcudart.so.13
 * NCCL must be 2.28.9, the version ep's network kernels were built for.
 */
#define _POSIX_C_SOURCE 200809L

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "ep.h"

#define X_HIDDEN 1024
#define X_TOPK 4
#define X_EXPERTS 16
#define X_TOKENS 96
#define X_LL_TOKENS 32

#define CHECK(cond, ...)                                     \
    do {                                                     \
        if (!(cond)) {                                       \
            fprintf(stderr, "rank %d: ", g_rank);            \
            fprintf(stderr, __VA_ARGS__);                    \
            fprintf(stderr, "\n");                           \
            return 1;                                        \
        }                                                    \
    } while (0)
#define EP(call) CHECK((call) == EP_SUCCESS, "%s: %s", #call, ep_get_last_error())
#define CUDA(call) CHECK((call) == cudaSuccess, "%s failed", #call)
#define NCCL(call) CHECK((call) == ncclSuccess, "%s failed", #call)

static int g_rank;

static uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Channel c of token t of rank r: a multiple of 1/8 in [-1, 1]. */
static float token_value(int r, int t, int c) {
    return (float)((r * 31 + t * 7 + c) % 17 - 8) / 8.0f;
}

/* Slot k of token t of rank r: distinct experts (5 is coprime to 16), one
 * slot in seven dropped, weights (k + 1) / 8, so every sum is exact. */
static int32_t token_expert(int r, int t, int k) {
    return (t + k) % 7 == 0 ? -1 : (int32_t)((t * 7 + r * 3 + k * 5) % X_EXPERTS);
}

/* out[t] of rank r: sum over its kept slots of w * x. */
static float expected(int r, int t, int c) {
    float sum = 0.0f;
    for (int k = 0; k < X_TOPK; k++) {
        if (token_expert(r, t, k) >= 0) {
            sum += (float)(k + 1) / 8.0f * token_value(r, t, c);
        }
    }
    return sum;
}

static void *device_copy(const void *host, size_t bytes) {
    void *dev = NULL;
    if (cudaMalloc(&dev, bytes ? bytes : 16) != cudaSuccess) {
        return NULL;
    }
    if (bytes && cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
        cudaFree(dev);
        return NULL;
    }
    return dev;
}

static int check_output(const void *out, int tokens, const char *what) {
    size_t bytes = (size_t)tokens * X_HIDDEN * 2;
    uint16_t *host = malloc(bytes ? bytes : 2);
    CHECK(host != NULL, "out of memory");
    CUDA(cudaMemcpy(host, out, bytes, cudaMemcpyDeviceToHost));
    for (int t = 0; t < tokens; t++) {
        for (int c = 0; c < X_HIDDEN; c++) {
            float got = bf16_to_f32(host[(size_t)t * X_HIDDEN + c]);
            float want = expected(g_rank, t, c);
            if (got != want) {
                free(host);
                CHECK(0, "%s: token %d channel %d is %g, expected %g", what, t, c, got, want);
            }
        }
    }
    free(host);
    return 0;
}

static int run_rank(int world, int rank, ncclUniqueId id) {
    int devices = 0;
    ncclComm_t comm;
    ep_ctx_t *ctx = NULL;
    ep_config_t cfg;
    g_rank = rank;
    CUDA(cudaGetDeviceCount(&devices));
    CUDA(cudaSetDevice(rank % devices));
    NCCL(ncclCommInitRank(&comm, world, id, rank));

    EP(ep_config_init(&cfg));
    cfg.backend = EP_BACKEND_GPU;
    cfg.hidden = X_HIDDEN;
    cfg.topk = X_TOPK;
    cfg.num_experts = X_EXPERTS;
    cfg.max_tokens_per_rank = X_TOKENS;
    cfg.ll_max_tokens_per_rank = X_LL_TOKENS;
    cfg.timeout_ms = 60000;
    EP(ep_ctx_create_from_nccl(comm, &cfg, &ctx));
    int32_t info_rank, info_world, local, nodes, rpn;
    EP(ep_ctx_get_info(ctx, &info_rank, &info_world, &local, NULL));
    EP(ep_ctx_get_node_info(ctx, &rpn, &nodes));
    CHECK(info_rank == rank && info_world == world, "the context is rank %d of %d", info_rank,
          info_world);

    /* Inputs. */
    uint16_t *x = malloc((size_t)X_TOKENS * X_HIDDEN * 2);
    int32_t idx[X_TOKENS * X_TOPK];
    float w[X_TOKENS * X_TOPK];
    CHECK(x != NULL, "out of memory");
    for (int t = 0; t < X_TOKENS; t++) {
        for (int c = 0; c < X_HIDDEN; c++) {
            x[(size_t)t * X_HIDDEN + c] = f32_to_bf16(token_value(rank, t, c));
        }
        for (int k = 0; k < X_TOPK; k++) {
            idx[t * X_TOPK + k] = token_expert(rank, t, k);
            w[t * X_TOPK + k] = (float)(k + 1) / 8.0f;
        }
    }
    void *d_x = device_copy(x, (size_t)X_TOKENS * X_HIDDEN * 2);
    void *d_idx = device_copy(idx, sizeof idx);
    void *d_w = device_copy(w, sizeof w);
    free(x);
    CHECK(d_x && d_idx && d_w, "cudaMalloc failed");

    /* Normal mode: dispatch to expert-major rows, identity experts, combine
     * (the library weighs the rows). */
    int32_t expert_cap = 0;
    EP(ep_get_dispatch_capacity(ctx, 1, NULL, &expert_cap));
    void *expert_x = NULL, *expert_w = NULL, *expert_src = NULL, *offsets = NULL,
         *counts = NULL, *out = NULL;
    CUDA(cudaMalloc(&expert_x, (size_t)expert_cap * X_HIDDEN * 2));
    CUDA(cudaMalloc(&expert_w, (size_t)expert_cap * 4));
    CUDA(cudaMalloc(&expert_src, (size_t)expert_cap * 4));
    CUDA(cudaMalloc(&offsets, (size_t)(local + 1) * 4));
    CUDA(cudaMalloc(&counts, (size_t)local * 4));
    CUDA(cudaMalloc(&out, (size_t)X_TOKENS * X_HIDDEN * 2));
    ep_handle_t *handle = NULL;
    EP(ep_handle_create(ctx, &handle));
    ep_dispatch_args_t da;
    EP(ep_dispatch_args_init(&da));
    da.num_tokens = X_TOKENS;
    da.x = d_x;
    da.topk_idx = d_idx;
    da.topk_weights = d_w;
    da.expert_capacity = expert_cap;
    da.expert_x = expert_x;
    da.expert_weights = expert_w;
    da.expert_src_row = expert_src;
    da.expert_offsets = offsets;
    da.expert_counts = counts;
    EP(ep_dispatch(ctx, &da, handle, NULL));
    ep_combine_args_t ca;
    EP(ep_combine_args_init(&ca));
    ca.input_layout = EP_COMBINE_EXPERT_MAJOR;
    ca.x = expert_x;
    ca.out = out;
    EP(ep_combine(ctx, &ca, handle, NULL));
    CUDA(cudaDeviceSynchronize());
    ep_status_t async = EP_SUCCESS;
    EP(ep_ctx_get_async_error(ctx, &async));
    CHECK(async == EP_SUCCESS, "normal mode: %s", ep_get_last_error());
    if (check_output(out, X_TOKENS, "normal combine")) {
        return 1;
    }

    /* Low-latency mode: BF16 rows, identity experts, weights at combine. */
    size_t slots = (size_t)local * world * X_LL_TOKENS;
    void *recv_x = NULL, *recv_count = NULL, *recv_src = NULL, *recv_range = NULL;
    CUDA(cudaMalloc(&recv_x, slots * X_HIDDEN * 2));
    CUDA(cudaMalloc(&recv_count, (size_t)local * 4));
    CUDA(cudaMalloc(&recv_src, slots * 4));
    CUDA(cudaMalloc(&recv_range, (size_t)local * world * 2 * 4));
    CUDA(cudaMemset(out, 0xab, (size_t)X_TOKENS * X_HIDDEN * 2));
    ep_ll_dispatch_args_t ld;
    EP(ep_ll_dispatch_args_init(&ld));
    ld.num_tokens = X_LL_TOKENS;
    ld.out_dtype = EP_DTYPE_BF16;
    ld.x = d_x;
    ld.topk_idx = d_idx;
    ld.recv_x = recv_x;
    ld.recv_count = recv_count;
    ld.recv_src_info = recv_src;
    ld.recv_layout_range = recv_range;
    EP(ep_ll_dispatch(ctx, &ld, NULL));
    ep_ll_combine_args_t lc;
    EP(ep_ll_combine_args_init(&lc));
    lc.num_tokens = X_LL_TOKENS;
    lc.x = recv_x;
    lc.topk_idx = d_idx;
    lc.topk_weights = d_w;
    lc.src_info = recv_src;
    lc.layout_range = recv_range;
    lc.out = out;
    EP(ep_ll_combine(ctx, &lc, NULL));
    CUDA(cudaDeviceSynchronize());
    EP(ep_ctx_get_async_error(ctx, &async));
    CHECK(async == EP_SUCCESS, "low-latency mode: %s", ep_get_last_error());
    if (check_output(out, X_LL_TOKENS, "low-latency combine")) {
        return 1;
    }

    EP(ep_handle_destroy(handle));
    EP(ep_ctx_destroy(ctx));
    NCCL(ncclCommDestroy(comm));
    printf("rank %d of %d: %d node(s) of %d rank(s), normal and low-latency modes ok\n", rank,
           world, nodes, rpn);
    return 0;
}

int main(int argc, char **argv) {
    int world = argc > 1 ? atoi(argv[1]) : 1;
    int fds[2];
    if (world < 1 || X_EXPERTS % world != 0) {
        fprintf(stderr, "usage: nccl_context [N], N dividing %d\n", X_EXPERTS);
        return 2;
    }
    if (pipe(fds) != 0) {
        perror("pipe");
        return 1;
    }
    for (int rank = 0; rank < world; rank++) {
        pid_t pid = fork();
        if (pid < 0) {
            perror("fork");
            return 1;
        }
        if (pid == 0) {
            ncclUniqueId id;
            if (rank == 0) {
                if (ncclGetUniqueId(&id) != ncclSuccess) {
                    fprintf(stderr, "ncclGetUniqueId failed\n");
                    _exit(1);
                }
                for (int r = 1; r < world; r++) {
                    if (write(fds[1], &id, sizeof id) != (ssize_t)sizeof id) {
                        _exit(1);
                    }
                }
            } else if (read(fds[0], &id, sizeof id) != (ssize_t)sizeof id) {
                _exit(1);
            }
            _exit(run_rank(world, rank, id));
        }
    }
    int failed = 0;
    for (int rank = 0; rank < world; rank++) {
        int status = 0;
        wait(&status);
        failed |= !WIFEXITED(status) || WEXITSTATUS(status) != 0;
    }
    printf("%s\n", failed ? "FAILED" : "all ranks passed");
    return failed;
}
