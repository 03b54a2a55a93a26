/*
 * ep demo: N ranks (default 4) as processes of one host.
 *
 *   demo [N]
 *
 * The parent makes the unique id and forks N children; child r is rank r on
 * CUDA device r (the device is ignored by the host backend, EP_BACKEND=host).
 * Each rank routes its tokens at random (seeded by rank, with some dropped
 * slots), then checks:
 *   - ep_get_dispatch_layout against counts computed here;
 *   - ep_dispatch (BF16) into the source-order and the expert-major (aligned
 *     to 16 rows) outputs: row counts, received rows, ids, weights, offsets;
 *   - ep_combine of identity experts, expert-major (the library weighs) and
 *     source-order (the caller weighs): out[t] ~ sum_k w[t,k] * x[t];
 *   - ep_ll_dispatch (FP8, weights given) and ep_ll_combine of identity
 *     experts on the dequantized rows: out[t] ~ sum_k w[t,k] * x[t].
 * Every rank can regenerate every rank's tokens and routing (both are
 * functions of the rank), so what it receives is checked exactly.
 * Each rank prints one line; the exit status is 0 only if every check of
 * every rank passed. On the GPU backend all buffers are device memory.
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "device_memory.h"
#include "ep.h"

#define D_HIDDEN 2048
#define D_TOPK 4
#define D_EXPERTS 16
#define D_MAX_TOKENS 256
#define D_LL_MAX_TOKENS 64
#define D_ALIGNMENT 16
#define D_MAX_RANKS D_EXPERTS

/* ---- numbers ---------------------------------------------------------- */

static uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    }
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* FP8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities. */
static float e4m3_to_f32(uint8_t v) {
    int sign = v >> 7, exp = (v >> 3) & 0xf, man = v & 7;
    float mag;
    if (exp == 0xf && man == 7) {
        return NAN;
    }
    mag = exp == 0 ? ldexpf((float)man / 8.0f, -6) : ldexpf(1.0f + (float)man / 8.0f, exp - 7);
    return sign ? -mag : mag;
}

static uint32_t mix(uint32_t h) {
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    h *= 0x846ca68bu;
    h ^= h >> 16;
    return h;
}

/* Channel c of token t of rank `src`, a bf16 value in [-1, 1). */
static uint16_t token_value(int src, int t, int c) {
    uint32_t h = mix((uint32_t)src * 0x9e3779b1u ^ mix((uint32_t)t * 0x85ebca77u ^ (uint32_t)c));
    return f32_to_bf16((float)(h >> 8) / 8388608.0f - 1.0f);
}

static uint32_t rng_next(uint32_t *state) {
    uint32_t x = *state;
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    return *state = x;
}

/* ---- what every rank sends ------------------------------------------- */

typedef struct {
    int num_tokens;    /* normal mode */
    int ll_num_tokens; /* low-latency mode: the first ll_num_tokens tokens */
    int32_t idx[D_MAX_TOKENS * D_TOPK];
    float w[D_MAX_TOKENS * D_TOPK];
} routing_t;

/* Random routing of rank `r`: distinct experts per token, about one slot in
 * eight dropped (-1), weights in [0.1, 1). */
static void make_routing(int r, routing_t *out) {
    uint32_t state = 0x2545f491u ^ (uint32_t)(r + 1) * 0x9e3779b9u;
    int t, k, j;
    for (t = 0; t < 16; t++) {
        (void)rng_next(&state);
    }
    out->num_tokens = 160 + (r * 37) % 96;
    out->ll_num_tokens = 40 + (r * 7) % 25;
    for (t = 0; t < out->num_tokens; t++) {
        for (k = 0; k < D_TOPK; k++) {
            int32_t e;
            int again;
            do {
                e = (int32_t)(rng_next(&state) % D_EXPERTS);
                again = 0;
                for (j = 0; j < k; j++) {
                    again |= out->idx[t * D_TOPK + j] == e;
                }
            } while (again);
            out->idx[t * D_TOPK + k] = e;
            out->w[t * D_TOPK + k] = 0.1f + 0.9f * (float)(rng_next(&state) % 1000) / 1000.0f;
        }
        for (k = 0; k < D_TOPK; k++) {
            if (rng_next(&state) % 8 == 0) {
                out->idx[t * D_TOPK + k] = -1;
            }
        }
    }
}

/* ---- checks ------------------------------------------------------------ */

static int g_rank;
static int g_failures;

/* Reports a failed check (the first ten of a rank), as one write. */
#define FAIL(...)                                                      \
    do {                                                               \
        if (g_failures++ < 10) {                                       \
            char msg_[512];                                            \
            int at_ = snprintf(msg_, sizeof msg_, "rank %d: FAIL: ", g_rank); \
            snprintf(msg_ + at_, sizeof msg_ - (size_t)at_, __VA_ARGS__); \
            fprintf(stderr, "%s\n", msg_);                             \
        }                                                              \
    } while (0)

#define EP_CALL(call)                                                                   \
    do {                                                                                \
        ep_status_t status_ = (call);                                                   \
        if (status_ != EP_SUCCESS) {                                                    \
            fprintf(stderr, "rank %d: %s failed: %s (%s)\n", g_rank, #call,             \
                    ep_get_error_string(status_), ep_get_last_error());                 \
            fflush(stderr);                                                             \
            _exit(2);                                                                   \
        }                                                                               \
    } while (0)

#define DM_CALL(call)                                                    \
    do {                                                                 \
        if ((call) != 0) {                                               \
            fprintf(stderr, "rank %d: %s failed\n", g_rank, #call);      \
            fflush(stderr);                                              \
            _exit(2);                                                    \
        }                                                                \
    } while (0)

static void *xmalloc(size_t bytes) {
    void *p = calloc(1, bytes ? bytes : 1);
    if (p == NULL) {
        fprintf(stderr, "rank %d: out of host memory\n", g_rank);
        _exit(2);
    }
    return p;
}

static void *dalloc(dm_t *dm, size_t bytes) {
    void *p = dm_alloc(dm, bytes);
    if (p == NULL) {
        fprintf(stderr, "rank %d: buffer allocation of %zu bytes failed\n", g_rank, bytes);
        _exit(2);
    }
    return p;
}

/* Checks `out` (BF16 [num_tokens, D_HIDDEN]) against sum_k w * x of rank `r`'s
 * first `num_tokens` tokens; `rel` is the relative tolerance. */
static void check_combined(const char *what, int r, const routing_t *rt, int num_tokens,
                           const uint16_t *out, float rel) {
    int t, k, c, bad = 0;
    for (t = 0; t < num_tokens; t++) {
        float wsum = 0.0f;
        for (k = 0; k < D_TOPK; k++) {
            if (rt->idx[t * D_TOPK + k] >= 0) {
                wsum += rt->w[t * D_TOPK + k];
            }
        }
        for (c = 0; c < D_HIDDEN; c++) {
            float x = bf16_to_f32(token_value(r, t, c));
            float want = wsum * x;
            float got = bf16_to_f32(out[(size_t)t * D_HIDDEN + c]);
            float tol = rel * wsum * fabsf(x) + 1e-3f;
            if (!(fabsf(got - want) <= tol)) {
                if (bad++ == 0) {
                    FAIL("%s: token %d channel %d: got %g, want %g (tolerance %g)", what, t, c,
                         (double)got, (double)want, (double)tol);
                }
            }
        }
    }
    if (bad > 1) {
        FAIL("%s: %d values out of tolerance", what, bad);
    }
}

/* ---- one rank ----------------------------------------------------------- */

static int run_rank(int world, int rank, ep_unique_id_t id) {
    static routing_t all[D_MAX_RANKS];
    ep_config_t config;
    ep_ctx_t *ctx = NULL;
    ep_handle_t *handle = NULL;
    dm_t dm;
    int32_t info_rank = -1, info_world = -1, local = -1, backend = -1;
    int s, t, k, c, e, i, j;
    const routing_t *me;
    int nt, first_expert, recv_cap = 0, expert_cap = 0;
    size_t row_bytes = (size_t)D_HIDDEN * 2;

    g_rank = rank;
    for (s = 0; s < world; s++) {
        make_routing(s, &all[s]);
    }
    me = &all[rank];
    nt = me->num_tokens;

    EP_CALL(ep_config_init(&config));
    config.hidden = D_HIDDEN;
    config.topk = D_TOPK;
    config.num_experts = D_EXPERTS;
    config.max_tokens_per_rank = D_MAX_TOKENS;
    config.ll_max_tokens_per_rank = D_LL_MAX_TOKENS;
    config.timeout_ms = 60000;
    EP_CALL(ep_ctx_create(&ctx, world, id, rank, rank, &config));
    EP_CALL(ep_ctx_get_info(ctx, &info_rank, &info_world, &local, &backend));
    if (info_rank != rank || info_world != world || local != D_EXPERTS / world) {
        FAIL("ep_ctx_get_info: rank %d world %d local experts %d", info_rank, info_world, local);
    }
    first_expert = rank * local;
    DM_CALL(dm_init(&dm, backend == EP_BACKEND_GPU, rank));

    /* Inputs. */
    {
        uint16_t *hx = xmalloc((size_t)nt * row_bytes);
        for (t = 0; t < nt; t++) {
            for (c = 0; c < D_HIDDEN; c++) {
                hx[(size_t)t * D_HIDDEN + c] = token_value(rank, t, c);
            }
        }
        /* d_x etc. are set up below. */
        {
            void *d_x = dalloc(&dm, (size_t)nt * row_bytes);
            int32_t *d_idx = dalloc(&dm, sizeof(int32_t) * nt * D_TOPK);
            float *d_w = dalloc(&dm, sizeof(float) * nt * D_TOPK);
            int32_t *d_per_rank = dalloc(&dm, sizeof(int32_t) * world);
            int32_t *d_per_expert = dalloc(&dm, sizeof(int32_t) * D_EXPERTS);
            uint8_t *d_in_rank = dalloc(&dm, (size_t)nt * world);
            int32_t h_per_rank[D_MAX_RANKS], h_per_expert[D_EXPERTS];
            int32_t want_per_rank[D_MAX_RANKS] = {0}, want_per_expert[D_EXPERTS] = {0};
            uint8_t *h_in_rank = xmalloc((size_t)nt * world);
            int32_t want_recv = 0, want_counts[D_EXPERTS] = {0};
            int32_t host_recv = -1, host_counts[D_EXPERTS];
            ep_dispatch_args_t da;
            ep_combine_args_t ca;
            void *d_recv_x, *d_expert_x, *d_out, *d_y;
            int32_t *d_recv_idx, *d_recv_src, *d_recv_num, *d_src_row, *d_offsets, *d_counts;
            float *d_recv_w, *d_expert_w;
            uint16_t *h_recv_x, *h_expert_x, *h_out, *h_y;
            int32_t *h_recv_idx, *h_recv_src, *h_src_row, h_offsets[D_EXPERTS + 1],
                h_counts[D_EXPERTS], h_recv_num = -1;
            float *h_recv_w, *h_expert_w;
            int bad_rows = 0;

            DM_CALL(dm_to_device(&dm, d_x, hx, (size_t)nt * row_bytes));
            DM_CALL(dm_to_device(&dm, d_idx, me->idx, sizeof(int32_t) * nt * D_TOPK));
            DM_CALL(dm_to_device(&dm, d_w, me->w, sizeof(float) * nt * D_TOPK));

            /* 1. Layout. */
            EP_CALL(ep_get_dispatch_layout(ctx, d_idx, nt, d_per_rank, d_per_expert, d_in_rank,
                                           NULL));
            DM_CALL(dm_sync(&dm));
            DM_CALL(dm_to_host(&dm, h_per_rank, d_per_rank, sizeof(int32_t) * world));
            DM_CALL(dm_to_host(&dm, h_per_expert, d_per_expert, sizeof h_per_expert));
            DM_CALL(dm_to_host(&dm, h_in_rank, d_in_rank, (size_t)nt * world));
            for (t = 0; t < nt; t++) {
                int to[D_MAX_RANKS] = {0};
                for (k = 0; k < D_TOPK; k++) {
                    e = me->idx[t * D_TOPK + k];
                    if (e >= 0) {
                        want_per_expert[e]++;
                        to[e / local] = 1;
                    }
                }
                for (s = 0; s < world; s++) {
                    want_per_rank[s] += to[s];
                    if (h_in_rank[(size_t)t * world + s] != to[s]) {
                        FAIL("layout: is_token_in_rank[%d][%d] = %d, want %d", t, s,
                             h_in_rank[(size_t)t * world + s], to[s]);
                    }
                }
            }
            for (s = 0; s < world; s++) {
                if (h_per_rank[s] != want_per_rank[s]) {
                    FAIL("layout: num_tokens_per_rank[%d] = %d, want %d", s, h_per_rank[s],
                         want_per_rank[s]);
                }
            }
            for (e = 0; e < D_EXPERTS; e++) {
                if (h_per_expert[e] != want_per_expert[e]) {
                    FAIL("layout: num_tokens_per_expert[%d] = %d, want %d", e, h_per_expert[e],
                         want_per_expert[e]);
                }
            }

            /* 2. Dispatch, both outputs. What this rank should receive: */
            for (s = 0; s < world; s++) {
                for (t = 0; t < all[s].num_tokens; t++) {
                    int here = 0;
                    for (k = 0; k < D_TOPK; k++) {
                        e = all[s].idx[t * D_TOPK + k];
                        if (e >= first_expert && e < first_expert + local) {
                            here = 1;
                            want_counts[e - first_expert]++;
                        }
                    }
                    want_recv += here;
                }
            }
            EP_CALL(ep_get_dispatch_capacity(ctx, D_ALIGNMENT, &recv_cap, &expert_cap));
            d_recv_x = dalloc(&dm, (size_t)recv_cap * row_bytes);
            d_recv_idx = dalloc(&dm, sizeof(int32_t) * recv_cap * D_TOPK);
            d_recv_w = dalloc(&dm, sizeof(float) * recv_cap * D_TOPK);
            d_recv_src = dalloc(&dm, sizeof(int32_t) * recv_cap * 2);
            d_recv_num = dalloc(&dm, sizeof(int32_t));
            d_expert_x = dalloc(&dm, (size_t)expert_cap * row_bytes);
            d_expert_w = dalloc(&dm, sizeof(float) * expert_cap);
            d_src_row = dalloc(&dm, sizeof(int32_t) * expert_cap);
            d_offsets = dalloc(&dm, sizeof(int32_t) * (local + 1));
            d_counts = dalloc(&dm, sizeof(int32_t) * local);

            EP_CALL(ep_handle_create(ctx, &handle));
            EP_CALL(ep_dispatch_args_init(&da));
            da.num_tokens = nt;
            da.dtype = EP_DTYPE_BF16;
            da.x = d_x;
            da.topk_idx = d_idx;
            da.topk_weights = d_w;
            da.recv_capacity = recv_cap;
            da.expert_alignment = D_ALIGNMENT;
            da.recv_x = d_recv_x;
            da.recv_topk_idx = d_recv_idx;
            da.recv_topk_weights = d_recv_w;
            da.recv_src_info = d_recv_src;
            da.recv_num_tokens = d_recv_num;
            da.expert_capacity = expert_cap;
            da.expert_x = d_expert_x;
            da.expert_weights = d_expert_w;
            da.expert_src_row = d_src_row;
            da.expert_offsets = d_offsets;
            da.expert_counts = d_counts;
            da.host_recv_num_tokens = &host_recv;
            da.host_expert_counts = host_counts;
            EP_CALL(ep_dispatch(ctx, &da, handle, NULL));
            DM_CALL(dm_sync(&dm));

            if (host_recv != want_recv) {
                FAIL("dispatch: host_recv_num_tokens = %d, want %d", host_recv, want_recv);
            }
            if (host_recv < 0 || host_recv > recv_cap) {
                fprintf(stderr, "rank %d: received row count %d is unusable\n", rank, host_recv);
                _exit(2);
            }
            for (e = 0; e < local; e++) {
                if (host_counts[e] != want_counts[e]) {
                    FAIL("dispatch: host_expert_counts[%d] = %d, want %d", e, host_counts[e],
                         want_counts[e]);
                }
            }
            h_recv_x = xmalloc((size_t)recv_cap * row_bytes);
            h_recv_idx = xmalloc(sizeof(int32_t) * recv_cap * D_TOPK);
            h_recv_w = xmalloc(sizeof(float) * recv_cap * D_TOPK);
            h_recv_src = xmalloc(sizeof(int32_t) * recv_cap * 2);
            DM_CALL(dm_to_host(&dm, &h_recv_num, d_recv_num, sizeof(int32_t)));
            DM_CALL(dm_to_host(&dm, h_recv_x, d_recv_x, (size_t)host_recv * row_bytes));
            DM_CALL(dm_to_host(&dm, h_recv_idx, d_recv_idx, sizeof(int32_t) * host_recv * D_TOPK));
            DM_CALL(dm_to_host(&dm, h_recv_w, d_recv_w, sizeof(float) * host_recv * D_TOPK));
            DM_CALL(dm_to_host(&dm, h_recv_src, d_recv_src, sizeof(int32_t) * host_recv * 2));
            DM_CALL(dm_to_host(&dm, h_offsets, d_offsets, sizeof(int32_t) * (local + 1)));
            DM_CALL(dm_to_host(&dm, h_counts, d_counts, sizeof(int32_t) * local));
            if (h_recv_num != host_recv) {
                FAIL("dispatch: recv_num_tokens = %d, host_recv_num_tokens = %d", h_recv_num,
                     host_recv);
            }

            /* Source-order rows: by source rank, then token order. */
            i = 0;
            for (s = 0; s < world; s++) {
                for (t = 0; t < all[s].num_tokens; t++) {
                    int here = 0;
                    for (k = 0; k < D_TOPK; k++) {
                        e = all[s].idx[t * D_TOPK + k];
                        here |= e >= first_expert && e < first_expert + local;
                    }
                    if (!here) {
                        continue;
                    }
                    if (i >= host_recv) {
                        i++;
                        continue;
                    }
                    if (h_recv_src[2 * i] != s || h_recv_src[2 * i + 1] != t) {
                        FAIL("dispatch: row %d comes from (%d, %d), want (%d, %d)", i,
                             h_recv_src[2 * i], h_recv_src[2 * i + 1], s, t);
                    }
                    for (k = 0; k < D_TOPK; k++) {
                        int32_t g = all[s].idx[t * D_TOPK + k];
                        int mine = g >= first_expert && g < first_expert + local;
                        int32_t want_idx = mine ? g - first_expert : -1;
                        float want_w = mine ? all[s].w[t * D_TOPK + k] : 0.0f;
                        if (h_recv_idx[i * D_TOPK + k] != want_idx ||
                            h_recv_w[i * D_TOPK + k] != want_w) {
                            FAIL("dispatch: row %d slot %d: expert %d weight %g, want %d %g", i,
                                 k, h_recv_idx[i * D_TOPK + k], (double)h_recv_w[i * D_TOPK + k],
                                 want_idx, (double)want_w);
                        }
                    }
                    for (c = 0; c < D_HIDDEN; c++) {
                        if (h_recv_x[(size_t)i * D_HIDDEN + c] != token_value(s, t, c)) {
                            bad_rows++;
                            break;
                        }
                    }
                    i++;
                }
            }
            if (i != host_recv) {
                FAIL("dispatch: %d source-order rows, want %d", host_recv, i);
            }
            if (bad_rows) {
                FAIL("dispatch: %d received rows differ from the source tokens", bad_rows);
            }

            /* Expert-major rows. */
            if (h_offsets[0] != 0) {
                FAIL("dispatch: expert_offsets[0] = %d", h_offsets[0]);
            }
            for (e = 0; e < local; e++) {
                if (h_counts[e] != want_counts[e]) {
                    FAIL("dispatch: expert_counts[%d] = %d, want %d", e, h_counts[e],
                         want_counts[e]);
                }
                if (h_offsets[e] % D_ALIGNMENT != 0 || h_offsets[e + 1] < h_offsets[e] + h_counts[e]) {
                    FAIL("dispatch: expert %d segment [%d, %d) holds %d rows (alignment %d)", e,
                         h_offsets[e], h_offsets[e + 1], h_counts[e], D_ALIGNMENT);
                }
            }
            if (h_offsets[local] < 0 || h_offsets[local] > expert_cap) {
                fprintf(stderr, "rank %d: expert-major row count %d is unusable\n", rank,
                        h_offsets[local]);
                _exit(2);
            }
            h_expert_x = xmalloc((size_t)expert_cap * row_bytes);
            h_expert_w = xmalloc(sizeof(float) * expert_cap);
            h_src_row = xmalloc(sizeof(int32_t) * expert_cap);
            DM_CALL(dm_to_host(&dm, h_expert_x, d_expert_x, (size_t)h_offsets[local] * row_bytes));
            DM_CALL(dm_to_host(&dm, h_expert_w, d_expert_w, sizeof(float) * h_offsets[local]));
            DM_CALL(dm_to_host(&dm, h_src_row, d_src_row, sizeof(int32_t) * h_offsets[local]));
            for (e = 0; e < local; e++) {
                int prev = -1;
                for (j = h_offsets[e]; j < h_offsets[e + 1]; j++) {
                    int32_t r = h_src_row[j];
                    if (j >= h_offsets[e] + h_counts[e]) {
                        if (r != -1 || h_expert_w[j] != 0.0f) {
                            FAIL("dispatch: padding row %d: src_row %d weight %g", j, r,
                                 (double)h_expert_w[j]);
                        }
                        continue;
                    }
                    if (r <= prev || r >= host_recv) {
                        FAIL("dispatch: expert-major row %d: src_row %d after %d", j, r, prev);
                        continue;
                    }
                    prev = r;
                    for (k = 0; k < D_TOPK && h_recv_idx[r * D_TOPK + k] != e; k++) {
                    }
                    if (k == D_TOPK || h_expert_w[j] != h_recv_w[r * D_TOPK + k]) {
                        FAIL("dispatch: expert-major row %d: weight %g for expert %d of row %d", j,
                             (double)h_expert_w[j], e, r);
                    }
                    if (memcmp(h_expert_x + (size_t)j * D_HIDDEN, h_recv_x + (size_t)r * D_HIDDEN,
                               row_bytes) != 0) {
                        FAIL("dispatch: expert-major row %d differs from source-order row %d", j, r);
                    }
                }
            }

            /* 3. Combine, expert-major: identity experts, the library weighs. */
            d_out = dalloc(&dm, (size_t)nt * row_bytes);
            h_out = xmalloc((size_t)nt * row_bytes);
            EP_CALL(ep_combine_args_init(&ca));
            ca.input_layout = EP_COMBINE_EXPERT_MAJOR;
            ca.x = d_expert_x;
            ca.out = d_out;
            EP_CALL(ep_combine(ctx, &ca, handle, NULL));
            DM_CALL(dm_sync(&dm));
            DM_CALL(dm_to_host(&dm, h_out, d_out, (size_t)nt * row_bytes));
            check_combined("combine (expert-major)", rank, me, nt, h_out, 1.0f / 64);

            /* 4. Combine, source order: the caller reduces its local experts. */
            h_y = xmalloc((size_t)recv_cap * row_bytes);
            d_y = dalloc(&dm, (size_t)recv_cap * row_bytes);
            for (i = 0; i < host_recv; i++) {
                float wsum = 0.0f;
                for (k = 0; k < D_TOPK; k++) {
                    if (h_recv_idx[i * D_TOPK + k] >= 0) {
                        wsum += h_recv_w[i * D_TOPK + k];
                    }
                }
                for (c = 0; c < D_HIDDEN; c++) {
                    h_y[(size_t)i * D_HIDDEN + c] =
                        f32_to_bf16(wsum * bf16_to_f32(h_recv_x[(size_t)i * D_HIDDEN + c]));
                }
            }
            DM_CALL(dm_to_device(&dm, d_y, h_y, (size_t)host_recv * row_bytes));
            memset(h_out, 0xff, (size_t)nt * row_bytes);
            EP_CALL(ep_combine_args_init(&ca));
            ca.input_layout = EP_COMBINE_SOURCE_ORDER;
            ca.x = d_y;
            ca.out = d_out;
            EP_CALL(ep_combine(ctx, &ca, handle, NULL));
            DM_CALL(dm_sync(&dm));
            DM_CALL(dm_to_host(&dm, h_out, d_out, (size_t)nt * row_bytes));
            check_combined("combine (source order)", rank, me, nt, h_out, 1.0f / 64);

            /* 5. Low latency: FP8 dispatch with weights, identity experts on the
             * dequantized rows, combine (the expert side weighs). */
            {
                int ll_nt = me->ll_num_tokens;
                size_t rows = (size_t)local * world * D_LL_MAX_TOKENS;
                int blocks = D_HIDDEN / 128;
                ep_ll_dispatch_args_t la;
                ep_ll_combine_args_t lc;
                uint8_t *d_lx = dalloc(&dm, rows * D_HIDDEN);
                float *d_lscales = dalloc(&dm, sizeof(float) * rows * blocks);
                int32_t *d_lcount = dalloc(&dm, sizeof(int32_t) * local);
                int32_t *d_lsrc = dalloc(&dm, sizeof(int32_t) * rows);
                int32_t *d_lrange = dalloc(&dm, sizeof(int32_t) * local * world * 2);
                uint16_t *d_ly = dalloc(&dm, rows * row_bytes);
                uint8_t *h_lx = xmalloc(rows * D_HIDDEN);
                float *h_lscales = xmalloc(sizeof(float) * rows * blocks);
                int32_t h_lcount[D_EXPERTS], *h_lsrc = xmalloc(sizeof(int32_t) * rows);
                int32_t *h_lrange = xmalloc(sizeof(int32_t) * local * world * 2);
                uint16_t *h_ly = xmalloc(rows * row_bytes);
                int bad_values = 0;

                EP_CALL(ep_ll_dispatch_args_init(&la));
                la.num_tokens = ll_nt;
                la.out_dtype = EP_DTYPE_FP8_E4M3;
                la.x = d_x;
                la.topk_idx = d_idx;
                la.topk_weights = d_w;
                la.recv_x = d_lx;
                la.recv_x_scales = d_lscales;
                la.recv_count = d_lcount;
                la.recv_src_info = d_lsrc;
                la.recv_layout_range = d_lrange;
                EP_CALL(ep_ll_dispatch(ctx, &la, NULL));
                DM_CALL(dm_sync(&dm));
                DM_CALL(dm_to_host(&dm, h_lcount, d_lcount, sizeof(int32_t) * local));
                DM_CALL(dm_to_host(&dm, h_lx, d_lx, rows * D_HIDDEN));
                DM_CALL(dm_to_host(&dm, h_lscales, d_lscales, sizeof(float) * rows * blocks));
                DM_CALL(dm_to_host(&dm, h_lsrc, d_lsrc, sizeof(int32_t) * rows));
                DM_CALL(dm_to_host(&dm, h_lrange, d_lrange, sizeof(int32_t) * local * world * 2));
                for (e = 0; e < local; e++) {
                    int want = 0;
                    for (s = 0; s < world; s++) {
                        int first = h_lrange[(e * world + s) * 2], n = h_lrange[(e * world + s) * 2 + 1];
                        int from_s = 0;
                        for (t = 0; t < all[s].ll_num_tokens; t++) {
                            for (k = 0; k < D_TOPK; k++) {
                                from_s += all[s].idx[t * D_TOPK + k] == first_expert + e;
                            }
                        }
                        if (n != from_s || first != want) {
                            FAIL("ll_dispatch: expert %d source %d: rows [%d, +%d), want [%d, +%d)",
                                 e, s, first, n, want, from_s);
                            want += from_s;
                            continue;
                        }
                        for (i = first; i < first + n; i++) {
                            size_t row = (size_t)e * world * D_LL_MAX_TOKENS + (size_t)i;
                            int tok = h_lsrc[row];
                            if (tok < 0 || tok >= all[s].ll_num_tokens) {
                                FAIL("ll_dispatch: expert %d row %d: source token %d", e, i, tok);
                                continue;
                            }
                            for (c = 0; c < D_HIDDEN; c++) {
                                float v = e4m3_to_f32(h_lx[row * D_HIDDEN + c]) *
                                          h_lscales[row * blocks + c / 128];
                                float x = bf16_to_f32(token_value(s, tok, c));
                                if (!(fabsf(v - x) <= fabsf(x) / 16.0f + 1e-3f)) {
                                    bad_values++;
                                }
                                /* Identity expert: y = dequantized row, as BF16. */
                                h_ly[row * D_HIDDEN + c] = f32_to_bf16(v);
                            }
                        }
                        want += from_s;
                    }
                    if (h_lcount[e] != want) {
                        FAIL("ll_dispatch: recv_count[%d] = %d, want %d", e, h_lcount[e], want);
                    }
                }
                if (bad_values) {
                    FAIL("ll_dispatch: %d dequantized values differ from the tokens by > 1/16",
                         bad_values);
                }
                DM_CALL(dm_to_device(&dm, d_ly, h_ly, rows * row_bytes));

                EP_CALL(ep_ll_combine_args_init(&lc));
                lc.num_tokens = ll_nt;
                lc.x = d_ly;
                lc.topk_idx = d_idx;
                lc.topk_weights = NULL; /* given at dispatch */
                lc.src_info = d_lsrc;
                lc.layout_range = d_lrange;
                lc.out = d_out;
                EP_CALL(ep_ll_combine(ctx, &lc, NULL));
                DM_CALL(dm_sync(&dm));
                DM_CALL(dm_to_host(&dm, h_out, d_out, (size_t)ll_nt * row_bytes));
                check_combined("ll_combine (FP8)", rank, me, ll_nt, h_out, 1.0f / 16 + 1.0f / 64);

                printf("rank %d/%d: %s backend, %d tokens, layout ok, dispatch received %d rows "
                       "(%d expert-major rows), combine expert-major + source-order, "
                       "LL FP8 %d tokens: %s\n",
                       rank, world, backend == EP_BACKEND_GPU ? "gpu" : "host", nt, host_recv,
                       h_offsets[local], ll_nt, g_failures ? "FAILED" : "ok");
                fflush(stdout);

                dm_free(&dm, d_lx);
                dm_free(&dm, d_lscales);
                dm_free(&dm, d_lcount);
                dm_free(&dm, d_lsrc);
                dm_free(&dm, d_lrange);
                dm_free(&dm, d_ly);
                free(h_lx);
                free(h_lscales);
                free(h_lsrc);
                free(h_lrange);
                free(h_ly);
            }

            EP_CALL(ep_handle_destroy(handle));
            EP_CALL(ep_ctx_destroy(ctx));
            dm_free(&dm, d_x);
            dm_free(&dm, d_idx);
            dm_free(&dm, d_w);
            dm_free(&dm, d_per_rank);
            dm_free(&dm, d_per_expert);
            dm_free(&dm, d_in_rank);
            dm_free(&dm, d_recv_x);
            dm_free(&dm, d_recv_idx);
            dm_free(&dm, d_recv_w);
            dm_free(&dm, d_recv_src);
            dm_free(&dm, d_recv_num);
            dm_free(&dm, d_expert_x);
            dm_free(&dm, d_expert_w);
            dm_free(&dm, d_src_row);
            dm_free(&dm, d_offsets);
            dm_free(&dm, d_counts);
            dm_free(&dm, d_out);
            dm_free(&dm, d_y);
            free(h_in_rank);
            free(h_recv_x);
            free(h_recv_idx);
            free(h_recv_w);
            free(h_recv_src);
            free(h_expert_x);
            free(h_expert_w);
            free(h_src_row);
            free(h_out);
            free(h_y);
        }
        free(hx);
    }
    return g_failures == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
    int world = 4, r, failed = 0;
    ep_unique_id_t id;
    pid_t pids[D_MAX_RANKS];
    ep_status_t status;

    if (argc > 1) {
        char *end = NULL;
        long n = strtol(argv[1], &end, 10);
        if (end == argv[1] || *end != '\0' || n < 1 || n > D_MAX_RANKS || D_EXPERTS % n != 0) {
            fprintf(stderr, "usage: %s [N]  (N ranks: 1, 2, 4, 8 or 16)\n", argv[0]);
            return 2;
        }
        world = (int)n;
    }
    status = ep_get_unique_id(&id);
    if (status != EP_SUCCESS) {
        fprintf(stderr, "ep_get_unique_id failed: %s (%s)\n", ep_get_error_string(status),
                ep_get_last_error());
        return 1;
    }
    fflush(stdout);
    fflush(stderr);
    for (r = 0; r < world; r++) {
        pid_t pid = fork();
        if (pid < 0) {
            perror("fork");
            return 1;
        }
        if (pid == 0) {
            int rc = run_rank(world, r, id);
            fflush(stdout);
            fflush(stderr);
            _exit(rc);
        }
        pids[r] = pid;
    }
    for (r = 0; r < world; r++) {
        int wstatus = 0;
        if (waitpid(pids[r], &wstatus, 0) < 0) {
            perror("waitpid");
            failed++;
        } else if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0) {
            if (WIFSIGNALED(wstatus)) {
                fprintf(stderr, "rank %d: killed by signal %d\n", r, WTERMSIG(wstatus));
            } else {
                fprintf(stderr, "rank %d: exit status %d\n", r, WEXITSTATUS(wstatus));
            }
            failed++;
        }
    }
    if (failed) {
        fprintf(stderr, "demo: %d of %d ranks failed\n", failed, world);
        return 1;
    }
    printf("demo: all %d ranks passed\n", world);
    return 0;
}
