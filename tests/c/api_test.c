/*
 * C API test: every bad input gets its exact status code and a last-error
 * message that names the cause; then a good 1-rank run on the host backend.
 * Every context here has world size 1, so no call waits for a peer.
 *
 * Prints one line per failed check and, last, "N passed, M failed";
 * the exit status is 1 if any check failed.
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ep.h"

static int passed, failed;

static void expect(int ok, const char *what, int line) {
    if (ok) {
        passed++;
    } else {
        failed++;
        printf("FAIL (line %d): %s\n", line, what);
    }
}
#define EXPECT(cond) expect((cond) ? 1 : 0, #cond, __LINE__)

/* `call` returns exactly `code`, and the thread's last error mentions both
 * `function` and `cause` (for a failure). */
static void expect_status(ep_status_t got, ep_status_t code, const char *function,
                          const char *cause, const char *what, int line) {
    const char *msg = ep_get_last_error();
    char buf[1024];
    int ok = got == code;
    if (ok && code != EP_SUCCESS) {
        ok = msg != NULL && strstr(msg, function) != NULL && strstr(msg, cause) != NULL;
    }
    if (ok) {
        passed++;
        return;
    }
    failed++;
    snprintf(buf, sizeof buf, "%s: status %d (%s), want %d (%s); last error \"%s\", want \"%s\"",
             what, got, ep_get_error_string(got), code, ep_get_error_string(code),
             msg ? msg : "(null)", cause);
    printf("FAIL (line %d): %s\n", line, buf);
}
#define EXPECT_STATUS(call, code, function, cause) \
    expect_status((call), (code), (function), (cause), #call, __LINE__)

/* Small config of the tests: world 1, host backend. */
#define HIDDEN 256
#define TOPK 4
#define EXPERTS 8
#define MAXTOK 16

static ep_config_t small_config(void) {
    ep_config_t c;
    if (ep_config_init(&c) != EP_SUCCESS) {
        printf("ep_config_init failed\n");
        exit(1);
    }
    c.backend = EP_BACKEND_HOST;
    c.hidden = HIDDEN;
    c.topk = TOPK;
    c.num_experts = EXPERTS;
    c.max_tokens_per_rank = MAXTOK;
    c.ll_max_tokens_per_rank = 8;
    c.timeout_ms = 10000;
    return c;
}

static ep_unique_id_t new_id(void) {
    ep_unique_id_t id;
    if (ep_get_unique_id(&id) != EP_SUCCESS) {
        printf("ep_get_unique_id failed: %s\n", ep_get_last_error());
        exit(1);
    }
    return id;
}

/* A world-1 context with config `c`; returns the status. */
static ep_status_t create(ep_ctx_t **ctx, const ep_config_t *c) {
    return ep_ctx_create(ctx, 1, new_id(), 0, 0, c);
}

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

static void test_library_functions(void) {
    static const ep_status_t codes[] = {
        EP_SUCCESS,      EP_ERR_INVALID_ARGUMENT, EP_ERR_NULL_POINTER, EP_ERR_UNSUPPORTED,
        EP_ERR_OUT_OF_MEMORY, EP_ERR_CUDA_UNAVAILABLE, EP_ERR_CUDA,     EP_ERR_TIMEOUT,
        EP_IN_PROGRESS,  EP_ERR_ABORTED,          EP_ERR_INTERNAL,     EP_ERR_SYSTEM,
        EP_ERR_REMOTE};
    const size_t n = sizeof codes / sizeof codes[0];
    const char *unknown = ep_get_error_string(12345);
    size_t i, j;
    uint32_t version = 0;

    EXPECT_STATUS(ep_get_version(&version), EP_SUCCESS, "", "");
    EXPECT(version == EP_API_VERSION);
    EXPECT_STATUS(ep_get_version(NULL), EP_ERR_NULL_POINTER, "ep_get_version", "version");

    /* Every code has its own non-empty name; unknown codes share one. */
    EXPECT(unknown != NULL && strstr(unknown, "unknown") != NULL);
    EXPECT(ep_get_error_string(-1) == unknown || strcmp(ep_get_error_string(-1), unknown) == 0);
    for (i = 0; i < n; i++) {
        const char *s = ep_get_error_string(codes[i]);
        EXPECT(s != NULL && s[0] != '\0' && strcmp(s, unknown) != 0);
        for (j = 0; j < i; j++) {
            EXPECT(s != NULL && strcmp(s, ep_get_error_string(codes[j])) != 0);
        }
    }
    EXPECT(strcmp(ep_get_error_string(EP_SUCCESS), "success") == 0);
    EXPECT(ep_get_last_error() != NULL);

    EXPECT_STATUS(ep_config_init(NULL), EP_ERR_NULL_POINTER, "ep_config_init", "config");
    EXPECT_STATUS(ep_get_unique_id(NULL), EP_ERR_NULL_POINTER, "ep_get_unique_id", "id");
    EXPECT_STATUS(ep_dispatch_args_init(NULL), EP_ERR_NULL_POINTER, "ep_dispatch_args_init",
                  "dispatch args");
    EXPECT_STATUS(ep_combine_args_init(NULL), EP_ERR_NULL_POINTER, "ep_combine_args_init",
                  "combine args");
    EXPECT_STATUS(ep_ll_dispatch_args_init(NULL), EP_ERR_NULL_POINTER,
                  "ep_ll_dispatch_args_init", "args");
    EXPECT_STATUS(ep_ll_combine_args_init(NULL), EP_ERR_NULL_POINTER, "ep_ll_combine_args_init",
                  "args");

    /* Destroying NULL is a no-op. */
    EXPECT_STATUS(ep_ctx_destroy(NULL), EP_SUCCESS, "", "");
    EXPECT_STATUS(ep_handle_destroy(NULL), EP_SUCCESS, "", "");
}

static void test_config(void) {
    ep_config_t c = small_config();
    ep_ctx_t *ctx = (ep_ctx_t *)&c; /* must be overwritten with NULL on failure */
    ep_unique_id_t garbage;
    size_t bytes = 0;
    unsigned i;

    EXPECT(c.struct_size == sizeof(ep_config_t));
    EXPECT(c.magic == EP_CONFIG_MAGIC);
    EXPECT(c.version == EP_API_VERSION);

    EXPECT_STATUS(ep_ctx_create(NULL, 1, new_id(), 0, 0, &c), EP_ERR_NULL_POINTER,
                  "ep_ctx_create", "`ctx`");
    EXPECT_STATUS(ep_ctx_create(&ctx, 1, new_id(), 0, 0, NULL), EP_ERR_NULL_POINTER,
                  "ep_ctx_create", "config");
    EXPECT(ctx == NULL);

    c = small_config();
    c.magic = 0xdeadbeefu;
    EXPECT_STATUS(create(&ctx, &c), EP_ERR_INVALID_ARGUMENT, "ep_ctx_create", "magic");
    EXPECT(ctx == NULL);

    c = small_config();
    c.struct_size = EP_CONFIG_MIN_SIZE - 4;
    EXPECT_STATUS(create(&ctx, &c), EP_ERR_INVALID_ARGUMENT, "ep_ctx_create", "struct_size");
    c.struct_size = 0;
    EXPECT_STATUS(create(&ctx, &c), EP_ERR_INVALID_ARGUMENT, "ep_ctx_create", "struct_size");
    c.struct_size = sizeof(ep_config_t) + 4;
    EXPECT_STATUS(create(&ctx, &c), EP_ERR_INVALID_ARGUMENT, "ep_ctx_create", "struct_size");

    c = small_config();
    EXPECT_STATUS(ep_ctx_create(&ctx, 1, new_id(), 1, 0, &c), EP_ERR_INVALID_ARGUMENT,
                  "ep_ctx_create", "rank 1");
    EXPECT_STATUS(ep_ctx_create(&ctx, 2, new_id(), 5, 0, &c), EP_ERR_INVALID_ARGUMENT,
                  "ep_ctx_create", "rank 5");
    EXPECT_STATUS(ep_ctx_create(&ctx, 1, new_id(), -1, 0, &c), EP_ERR_INVALID_ARGUMENT,
                  "ep_ctx_create", "rank -1");
    EXPECT_STATUS(ep_ctx_create(&ctx, 0, new_id(), 0, 0, &c), EP_ERR_INVALID_ARGUMENT,
                  "ep_ctx_create", "world_size");
    EXPECT_STATUS(ep_ctx_create(&ctx, EP_MAX_WORLD_SIZE + 1, new_id(), 0, 0, &c),
                  EP_ERR_INVALID_ARGUMENT, "ep_ctx_create", "world_size");

    c = small_config();
    c.num_experts = 32;
    c.topk = EP_MAX_TOPK + 1;
    EXPECT_STATUS(create(&ctx, &c), EP_ERR_INVALID_ARGUMENT, "ep_ctx_create", "topk");
    c.topk = 0;
    EXPECT_STATUS(create(&ctx, &c), EP_ERR_INVALID_ARGUMENT, "ep_ctx_create", "topk");

    c = small_config();
    c.hidden = 200;
    EXPECT_STATUS(create(&ctx, &c), EP_ERR_INVALID_ARGUMENT, "ep_ctx_create", "hidden");
    c.hidden = 384 + 64;
    EXPECT_STATUS(create(&ctx, &c), EP_ERR_INVALID_ARGUMENT, "ep_ctx_create", "multiple of 128");
    c.hidden = EP_MAX_HIDDEN + 128;
    EXPECT_STATUS(create(&ctx, &c), EP_ERR_INVALID_ARGUMENT, "ep_ctx_create", "hidden");

    c = small_config();
    c.token_dtype = 7;
    EXPECT_STATUS(create(&ctx, &c), EP_ERR_INVALID_ARGUMENT, "ep_ctx_create", "token_dtype");

    c = small_config();
    c.backend = 9;
    EXPECT_STATUS(create(&ctx, &c), EP_ERR_INVALID_ARGUMENT, "ep_ctx_create", "backend");

    c = small_config();
    c.num_experts = EP_MAX_EXPERTS + 1;
    EXPECT_STATUS(create(&ctx, &c), EP_ERR_INVALID_ARGUMENT, "ep_ctx_create", "num_experts");
    c = small_config();
    c.ll_max_tokens_per_rank = EP_LL_MAX_TOKENS + 1;
    EXPECT_STATUS(create(&ctx, &c), EP_ERR_INVALID_ARGUMENT, "ep_ctx_create",
                  "ll_max_tokens_per_rank");
    c = small_config();
    c.max_tokens_per_rank = 0;
    EXPECT_STATUS(create(&ctx, &c), EP_ERR_INVALID_ARGUMENT, "ep_ctx_create",
                  "max_tokens_per_rank");

    /* Random bytes are no unique id. */
    srand(12345);
    for (i = 0; i < EP_UNIQUE_ID_BYTES; i++) {
        garbage.internal[i] = (uint8_t)(rand() & 0xff);
    }
    c = small_config();
    EXPECT_STATUS(ep_ctx_create(&ctx, 1, garbage, 0, 0, &c), EP_ERR_INVALID_ARGUMENT,
                  "ep_ctx_create", "unique id");
    EXPECT(ctx == NULL);
    memset(&garbage, 0, sizeof garbage);
    EXPECT_STATUS(ep_ctx_create(&ctx, 1, garbage, 0, 0, &c), EP_ERR_INVALID_ARGUMENT,
                  "ep_ctx_create", "unique id");

    /* The buffer size hint checks the config the same way. */
    c = small_config();
    EXPECT_STATUS(ep_get_buffer_size_hint(&c, 1, &bytes), EP_SUCCESS, "", "");
    EXPECT(bytes > 0);
    EXPECT_STATUS(ep_get_buffer_size_hint(NULL, 1, &bytes), EP_ERR_NULL_POINTER,
                  "ep_get_buffer_size_hint", "config");
    EXPECT_STATUS(ep_get_buffer_size_hint(&c, 1, NULL), EP_ERR_NULL_POINTER,
                  "ep_get_buffer_size_hint", "bytes");
    c.topk = EP_MAX_TOPK + 1;
    EXPECT_STATUS(ep_get_buffer_size_hint(&c, 1, &bytes), EP_ERR_INVALID_ARGUMENT,
                  "ep_get_buffer_size_hint", "topk");
}

/* Everything a world-1 dispatch needs, on the host. */
typedef struct {
    int nt;
    uint16_t x[MAXTOK * HIDDEN];
    int32_t idx[MAXTOK * TOPK];
    float w[MAXTOK * TOPK];
    int32_t recv_cap, expert_cap;
    uint16_t *recv_x, *expert_x, *y, *out;
    int32_t *recv_idx, *recv_src, *src_row;
    float *recv_w, *expert_w;
    int32_t offsets[EXPERTS + 1], counts[EXPERTS], host_counts[EXPERTS], host_recv;
} bufs_t;

static void bufs_init(bufs_t *b, ep_ctx_t *ctx, ep_dispatch_args_t *da) {
    int t, k, c;
    memset(b, 0, sizeof *b);
    b->nt = 10;
    for (t = 0; t < b->nt; t++) {
        for (c = 0; c < HIDDEN; c++) {
            b->x[t * HIDDEN + c] = f32_to_bf16((float)((t * 31 + c * 7) % 64 - 32) / 32.0f);
        }
        for (k = 0; k < TOPK; k++) {
            /* Distinct experts per token; token 3 is routed nowhere; token 5
             * drops one slot. */
            b->idx[t * TOPK + k] = (t == 3 || (t == 5 && k == 1)) ? -1 : (t + 2 * k) % EXPERTS;
            b->w[t * TOPK + k] = 0.25f * (float)(k + 1);
        }
    }
    if (ep_get_dispatch_capacity(ctx, 4, &b->recv_cap, &b->expert_cap) != EP_SUCCESS) {
        printf("ep_get_dispatch_capacity failed: %s\n", ep_get_last_error());
        exit(1);
    }
    b->recv_x = calloc((size_t)b->recv_cap * HIDDEN, 2);
    b->y = calloc((size_t)b->recv_cap * HIDDEN, 2);
    b->expert_x = calloc((size_t)b->expert_cap * HIDDEN, 2);
    b->out = calloc((size_t)MAXTOK * HIDDEN, 2);
    b->recv_idx = calloc((size_t)b->recv_cap * TOPK, sizeof(int32_t));
    b->recv_w = calloc((size_t)b->recv_cap * TOPK, sizeof(float));
    b->recv_src = calloc((size_t)b->recv_cap * 2, sizeof(int32_t));
    b->src_row = calloc((size_t)b->expert_cap, sizeof(int32_t));
    b->expert_w = calloc((size_t)b->expert_cap, sizeof(float));
    if (!b->recv_x || !b->y || !b->expert_x || !b->out || !b->recv_idx || !b->recv_w ||
        !b->recv_src || !b->src_row || !b->expert_w) {
        printf("out of memory\n");
        exit(1);
    }
    ep_dispatch_args_init(da);
    da->num_tokens = b->nt;
    da->dtype = EP_DTYPE_BF16;
    da->x = b->x;
    da->topk_idx = b->idx;
    da->topk_weights = b->w;
    da->recv_capacity = b->recv_cap;
    da->recv_x = b->recv_x;
    da->recv_topk_idx = b->recv_idx;
    da->recv_topk_weights = b->recv_w;
    da->recv_src_info = b->recv_src;
    da->expert_alignment = 4;
    da->expert_capacity = b->expert_cap;
    da->expert_x = b->expert_x;
    da->expert_weights = b->expert_w;
    da->expert_src_row = b->src_row;
    da->expert_offsets = b->offsets;
    da->expert_counts = b->counts;
    da->host_recv_num_tokens = &b->host_recv;
    da->host_expert_counts = b->host_counts;
}

static void bufs_free(bufs_t *b) {
    free(b->recv_x);
    free(b->y);
    free(b->expert_x);
    free(b->out);
    free(b->recv_idx);
    free(b->recv_w);
    free(b->recv_src);
    free(b->src_row);
    free(b->expert_w);
}

/* out[t] ~ sum_k w * x[t] for every token. */
static int combined_ok(const bufs_t *b) {
    int t, k, c;
    for (t = 0; t < b->nt; t++) {
        float wsum = 0.0f;
        for (k = 0; k < TOPK; k++) {
            if (b->idx[t * TOPK + k] >= 0) {
                wsum += b->w[t * TOPK + k];
            }
        }
        for (c = 0; c < HIDDEN; c++) {
            float x = bf16_to_f32(b->x[t * HIDDEN + c]);
            float got = bf16_to_f32(b->out[t * HIDDEN + c]);
            if (!(fabsf(got - wsum * x) <= wsum * fabsf(x) / 64 + 1e-3f)) {
                printf("  token %d channel %d: got %g, want %g\n", t, c, (double)got,
                       (double)(wsum * x));
                return 0;
            }
        }
    }
    return 1;
}

static void test_operations(void) {
    ep_config_t c = small_config();
    ep_ctx_t *ctx = NULL;
    ep_handle_t *handle = NULL;
    ep_dispatch_args_t da, bad;
    ep_combine_args_t ca, cbad;
    ep_ll_dispatch_args_t la;
    static bufs_t b;
    int32_t per_rank[1], per_expert[EXPERTS], rank = -1, world = -1, local = -1, backend = -1;
    uint8_t in_rank[MAXTOK];
    int32_t idx_bad[MAXTOK * TOPK];
    int t, k, i, e;

    EXPECT_STATUS(create(&ctx, &c), EP_SUCCESS, "", "");
    if (ctx == NULL) {
        printf("FAIL: no world-1 context: %s\n", ep_get_last_error());
        failed++;
        return;
    }
    EXPECT_STATUS(ep_ctx_get_info(ctx, &rank, &world, &local, &backend), EP_SUCCESS, "", "");
    EXPECT(rank == 0 && world == 1 && local == EXPERTS && backend == EP_BACKEND_HOST);
    EXPECT_STATUS(ep_ctx_get_info(ctx, NULL, NULL, NULL, NULL), EP_SUCCESS, "", "");
    EXPECT_STATUS(ep_ctx_get_info(NULL, &rank, NULL, NULL, NULL), EP_ERR_NULL_POINTER,
                  "ep_ctx_get_info", "ctx");
    EXPECT_STATUS(ep_handle_create(ctx, NULL), EP_ERR_NULL_POINTER, "ep_handle_create", "handle");
    EXPECT_STATUS(ep_handle_create(NULL, &handle), EP_ERR_NULL_POINTER, "ep_handle_create",
                  "ctx");
    EXPECT_STATUS(ep_handle_create(ctx, &handle), EP_SUCCESS, "", "");
    bufs_init(&b, ctx, &da);

    /* Layout: NULL pointers, a bad expert id, too many tokens. */
    EXPECT_STATUS(ep_get_dispatch_layout(NULL, b.idx, b.nt, per_rank, per_expert, in_rank, NULL),
                  EP_ERR_NULL_POINTER, "ep_get_dispatch_layout", "ctx");
    EXPECT_STATUS(ep_get_dispatch_layout(ctx, NULL, b.nt, per_rank, per_expert, in_rank, NULL),
                  EP_ERR_NULL_POINTER, "ep_get_dispatch_layout", "topk_idx");
    EXPECT_STATUS(ep_get_dispatch_layout(ctx, b.idx, b.nt, NULL, per_expert, in_rank, NULL),
                  EP_ERR_NULL_POINTER, "ep_get_dispatch_layout", "num_tokens_per_rank");
    EXPECT_STATUS(ep_get_dispatch_layout(ctx, b.idx, MAXTOK + 1, per_rank, per_expert, in_rank,
                                         NULL),
                  EP_ERR_INVALID_ARGUMENT, "ep_get_dispatch_layout", "num_tokens");
    EXPECT_STATUS(ep_get_dispatch_layout(ctx, b.idx, -1, per_rank, per_expert, in_rank, NULL),
                  EP_ERR_INVALID_ARGUMENT, "ep_get_dispatch_layout", "num_tokens");
    memcpy(idx_bad, b.idx, sizeof idx_bad);
    idx_bad[2 * TOPK + 1] = EXPERTS;
    EXPECT_STATUS(ep_get_dispatch_layout(ctx, idx_bad, b.nt, per_rank, per_expert, in_rank, NULL),
                  EP_ERR_INVALID_ARGUMENT, "ep_get_dispatch_layout", "topk_idx[2][1]");

    /* Dispatch: NULL pointers. */
    EXPECT_STATUS(ep_dispatch(NULL, &da, handle, NULL), EP_ERR_NULL_POINTER, "ep_dispatch",
                  "ctx");
    EXPECT_STATUS(ep_dispatch(ctx, NULL, handle, NULL), EP_ERR_NULL_POINTER, "ep_dispatch",
                  "dispatch args");
    EXPECT_STATUS(ep_dispatch(ctx, &da, NULL, NULL), EP_ERR_NULL_POINTER, "ep_dispatch",
                  "handle");
    bad = da;
    bad.x = NULL;
    EXPECT_STATUS(ep_dispatch(ctx, &bad, handle, NULL), EP_ERR_NULL_POINTER, "ep_dispatch", "`x`");
    bad = da;
    bad.topk_weights = NULL;
    EXPECT_STATUS(ep_dispatch(ctx, &bad, handle, NULL), EP_ERR_NULL_POINTER, "ep_dispatch",
                  "topk_weights");

    /* Dispatch: the struct header. */
    bad = da;
    bad.magic = EP_COMBINE_ARGS_MAGIC;
    EXPECT_STATUS(ep_dispatch(ctx, &bad, handle, NULL), EP_ERR_INVALID_ARGUMENT, "ep_dispatch",
                  "bad magic");
    bad = da;
    bad.struct_size = 8;
    EXPECT_STATUS(ep_dispatch(ctx, &bad, handle, NULL), EP_ERR_INVALID_ARGUMENT, "ep_dispatch",
                  "struct_size");
    bad.struct_size = sizeof(ep_dispatch_args_t) - 8;
    EXPECT_STATUS(ep_dispatch(ctx, &bad, handle, NULL), EP_ERR_INVALID_ARGUMENT, "ep_dispatch",
                  "struct_size");
    bad.struct_size = sizeof(ep_dispatch_args_t) + 8;
    EXPECT_STATUS(ep_dispatch(ctx, &bad, handle, NULL), EP_ERR_INVALID_ARGUMENT, "ep_dispatch",
                  "struct_size");

    /* Dispatch: values. */
    bad = da;
    bad.num_tokens = MAXTOK + 1;
    EXPECT_STATUS(ep_dispatch(ctx, &bad, handle, NULL), EP_ERR_INVALID_ARGUMENT, "ep_dispatch",
                  "num_tokens");
    bad = da;
    bad.dtype = 3;
    EXPECT_STATUS(ep_dispatch(ctx, &bad, handle, NULL), EP_ERR_INVALID_ARGUMENT, "ep_dispatch",
                  "dtype");
    bad = da;
    bad.dtype = 0;
    EXPECT_STATUS(ep_dispatch(ctx, &bad, handle, NULL), EP_ERR_INVALID_ARGUMENT, "ep_dispatch",
                  "dtype");
    bad = da;
    bad.flags = 0x100;
    EXPECT_STATUS(ep_dispatch(ctx, &bad, handle, NULL), EP_ERR_INVALID_ARGUMENT, "ep_dispatch",
                  "flags");
    bad = da;
    bad.expert_alignment = EP_MAX_EXPERTS + 1;
    EXPECT_STATUS(ep_dispatch(ctx, &bad, handle, NULL), EP_ERR_INVALID_ARGUMENT, "ep_dispatch",
                  "expert_alignment");
    bad = da;
    bad.recv_x = NULL;
    bad.expert_x = NULL; /* no output at all: one of the two is required */
    EXPECT_STATUS(ep_dispatch(ctx, &bad, handle, NULL), EP_ERR_NULL_POINTER, "ep_dispatch",
                  "`recv_x` is NULL (required when `expert_x` is NULL)");
    bad = da;
    bad.dtype = EP_DTYPE_FP8_E4M3; /* FP8 without scales */
    EXPECT_STATUS(ep_dispatch(ctx, &bad, handle, NULL), EP_ERR_NULL_POINTER, "ep_dispatch",
                  "x_scales");

    /* An expert id out of range, negative, or listed twice for one token. */
    bad = da;
    bad.topk_idx = idx_bad; /* idx_bad[2][1] = EXPERTS */
    EXPECT_STATUS(ep_dispatch(ctx, &bad, handle, NULL), EP_ERR_INVALID_ARGUMENT, "ep_dispatch",
                  "topk_idx[2][1]");
    memcpy(idx_bad, b.idx, sizeof idx_bad);
    idx_bad[4 * TOPK + 3] = -2;
    EXPECT_STATUS(ep_dispatch(ctx, &bad, handle, NULL), EP_ERR_INVALID_ARGUMENT, "ep_dispatch",
                  "topk_idx[4][3] = -2");
    memcpy(idx_bad, b.idx, sizeof idx_bad);
    idx_bad[6 * TOPK + 2] = idx_bad[6 * TOPK + 0];
    EXPECT_STATUS(ep_dispatch(ctx, &bad, handle, NULL), EP_ERR_INVALID_ARGUMENT, "ep_dispatch",
                  "topk_idx[6][2]");
    EXPECT_STATUS(ep_get_dispatch_layout(ctx, idx_bad, b.nt, per_rank, per_expert, in_rank, NULL),
                  EP_ERR_INVALID_ARGUMENT, "ep_get_dispatch_layout", "topk_idx[6][2]");

    /* A good dispatch: everything comes back to rank 0. */
    EXPECT_STATUS(ep_get_dispatch_layout(ctx, b.idx, b.nt, per_rank, per_expert, in_rank, NULL),
                  EP_SUCCESS, "", "");
    EXPECT(per_rank[0] == b.nt - 1); /* token 3 goes nowhere */
    for (e = 0; e < EXPERTS; e++) {
        int want = 0;
        for (i = 0; i < b.nt * TOPK; i++) {
            want += b.idx[i] == e;
        }
        EXPECT(per_expert[e] == want);
    }
    for (t = 0; t < b.nt; t++) {
        EXPECT(in_rank[t] == (t != 3));
    }
    EXPECT_STATUS(ep_dispatch(ctx, &da, handle, NULL), EP_SUCCESS, "", "");
    EXPECT(b.host_recv == b.nt - 1);
    for (i = 0; i < b.host_recv && i < b.nt; i++) {
        int src = i < 3 ? i : i + 1;
        EXPECT(b.recv_src[2 * i] == 0 && b.recv_src[2 * i + 1] == src);
        EXPECT(memcmp(b.recv_x + (size_t)i * HIDDEN, b.x + src * HIDDEN, HIDDEN * 2) == 0);
        for (k = 0; k < TOPK; k++) {
            EXPECT(b.recv_idx[i * TOPK + k] == b.idx[src * TOPK + k]);
        }
    }
    for (e = 0; e < EXPERTS; e++) {
        EXPECT(b.counts[e] == per_expert[e] && b.host_counts[e] == per_expert[e]);
        EXPECT(b.offsets[e] % 4 == 0 && b.offsets[e + 1] >= b.offsets[e] + b.counts[e]);
    }

    /* Combine: NULL pointers and bad values. */
    ep_combine_args_init(&ca);
    ca.input_layout = EP_COMBINE_EXPERT_MAJOR;
    ca.x = b.expert_x;
    ca.out = b.out;
    EXPECT_STATUS(ep_combine(NULL, &ca, handle, NULL), EP_ERR_NULL_POINTER, "ep_combine", "ctx");
    EXPECT_STATUS(ep_combine(ctx, NULL, handle, NULL), EP_ERR_NULL_POINTER, "ep_combine",
                  "combine args");
    EXPECT_STATUS(ep_combine(ctx, &ca, NULL, NULL), EP_ERR_NULL_POINTER, "ep_combine", "handle");
    cbad = ca;
    cbad.magic = EP_DISPATCH_ARGS_MAGIC;
    EXPECT_STATUS(ep_combine(ctx, &cbad, handle, NULL), EP_ERR_INVALID_ARGUMENT, "ep_combine",
                  "bad magic");
    cbad = ca;
    cbad.struct_size = sizeof(ep_combine_args_t) + 4;
    EXPECT_STATUS(ep_combine(ctx, &cbad, handle, NULL), EP_ERR_INVALID_ARGUMENT, "ep_combine",
                  "struct_size");
    cbad.struct_size = 4;
    EXPECT_STATUS(ep_combine(ctx, &cbad, handle, NULL), EP_ERR_INVALID_ARGUMENT, "ep_combine",
                  "struct_size");
    cbad = ca;
    cbad.input_layout = 7;
    EXPECT_STATUS(ep_combine(ctx, &cbad, handle, NULL), EP_ERR_INVALID_ARGUMENT, "ep_combine",
                  "input_layout");

    /* Good combines: expert-major, then source order. */
    EXPECT_STATUS(ep_combine(ctx, &ca, handle, NULL), EP_SUCCESS, "", "");
    EXPECT(combined_ok(&b));
    for (i = 0; i < b.host_recv; i++) {
        float wsum = 0.0f;
        int cc;
        for (k = 0; k < TOPK; k++) {
            if (b.recv_idx[i * TOPK + k] >= 0) {
                wsum += b.recv_w[i * TOPK + k];
            }
        }
        for (cc = 0; cc < HIDDEN; cc++) {
            size_t at = (size_t)i * HIDDEN + (size_t)cc;
            b.y[at] = f32_to_bf16(wsum * bf16_to_f32(b.recv_x[at]));
        }
    }
    memset(b.out, 0xff, (size_t)MAXTOK * HIDDEN * 2);
    ca.input_layout = EP_COMBINE_SOURCE_ORDER;
    ca.x = b.y;
    EXPECT_STATUS(ep_combine(ctx, &ca, handle, NULL), EP_SUCCESS, "", "");
    EXPECT(combined_ok(&b));

    /* Low latency: NULL args, bad header, too many tokens. */
    EXPECT_STATUS(ep_ll_dispatch(ctx, NULL, NULL), EP_ERR_NULL_POINTER, "ep_ll_dispatch", "args");
    ep_ll_dispatch_args_init(&la);
    la.magic = 0;
    EXPECT_STATUS(ep_ll_dispatch(ctx, &la, NULL), EP_ERR_INVALID_ARGUMENT, "ep_ll_dispatch",
                  "bad magic");
    ep_ll_dispatch_args_init(&la);
    la.num_tokens = c.ll_max_tokens_per_rank + 1;
    EXPECT_STATUS(ep_ll_dispatch(ctx, &la, NULL), EP_ERR_INVALID_ARGUMENT, "ep_ll_dispatch",
                  "num_tokens");
    EXPECT_STATUS(ep_ll_combine(ctx, NULL, NULL), EP_ERR_NULL_POINTER, "ep_ll_combine", "args");

    EXPECT_STATUS(ep_handle_destroy(handle), EP_SUCCESS, "", "");
    EXPECT_STATUS(ep_ctx_destroy(ctx), EP_SUCCESS, "", "");
    bufs_free(&b);
}

int main(void) {
    test_library_functions();
    test_config();
    test_operations();
    printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
