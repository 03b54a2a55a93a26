// ep demo in C++17: 4 ranks as threads of one process, on the host backend.
//
// Each rank routes its tokens at random (with some dropped slots), checks
// ep_get_dispatch_layout, dispatches BF16 tokens into the source-order and
// the expert-major outputs, runs identity experts and combines both ways:
// expert-major (the library weighs each row) and source order (the caller
// reduces its local experts first). out[t] must be sum_k w[t,k] * x[t].
// Exit status 0 only if every check of every rank passed.
#include "ep.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int kWorld = 4;
constexpr int kHidden = 1024;
constexpr int kTopk = 4;
constexpr int kExperts = 16;
constexpr int kMaxTokens = 128;
constexpr int kAlignment = 8;

// Throws with the library's message when a call fails.
void check(ep_status_t status, const char *what) {
    if (status != EP_SUCCESS) {
        throw std::runtime_error(std::string(what) + " failed: " + ep_get_error_string(status) +
                                 " (" + ep_get_last_error() + ")");
    }
}

struct CtxDeleter {
    void operator()(ep_ctx_t *ctx) const noexcept { ep_ctx_destroy(ctx); }
};
struct HandleDeleter {
    void operator()(ep_handle_t *handle) const noexcept { ep_handle_destroy(handle); }
};
using Ctx = std::unique_ptr<ep_ctx_t, CtxDeleter>;
using Handle = std::unique_ptr<ep_handle_t, HandleDeleter>;

Ctx make_ctx(int world, int rank, const ep_unique_id_t &id, const ep_config_t &config) {
    ep_ctx_t *raw = nullptr;
    check(ep_ctx_create(&raw, world, id, rank, /*device=*/rank, &config), "ep_ctx_create");
    return Ctx(raw);
}

Handle make_handle(ep_ctx_t *ctx) {
    ep_handle_t *raw = nullptr;
    check(ep_handle_create(ctx, &raw), "ep_handle_create");
    return Handle(raw);
}

uint16_t to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

float from_bf16(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

// Runs rank `rank`; returns the number of failed checks.
int run_rank(int rank, const ep_unique_id_t &id, std::mutex &print) {
    int failures = 0;
    auto fail = [&](const std::string &msg) {
        if (failures++ < 10) {
            std::lock_guard<std::mutex> lock(print);
            std::fprintf(stderr, "rank %d: FAIL: %s\n", rank, msg.c_str());
        }
    };

    ep_config_t config;
    check(ep_config_init(&config), "ep_config_init");
    config.backend = EP_BACKEND_HOST;
    config.hidden = kHidden;
    config.topk = kTopk;
    config.num_experts = kExperts;
    config.max_tokens_per_rank = kMaxTokens;
    config.ll_max_tokens_per_rank = 0;
    config.timeout_ms = 60000;
    Ctx ctx = make_ctx(kWorld, rank, id, config);
    int32_t local = 0;
    check(ep_ctx_get_info(ctx.get(), nullptr, nullptr, &local, nullptr), "ep_ctx_get_info");

    // Tokens and routing.
    std::mt19937 rng(1234u + static_cast<unsigned>(rank));
    const int nt = 64 + 16 * rank;
    std::vector<uint16_t> x(static_cast<size_t>(nt) * kHidden);
    std::uniform_real_distribution<float> value(-1.0f, 1.0f), weight(0.1f, 1.0f);
    for (auto &v : x) v = to_bf16(value(rng));
    std::vector<int32_t> idx(static_cast<size_t>(nt) * kTopk);
    std::vector<float> w(idx.size());
    for (int t = 0; t < nt; t++) {
        std::vector<int32_t> experts(kExperts);
        for (int e = 0; e < kExperts; e++) experts[e] = e;
        std::shuffle(experts.begin(), experts.end(), rng);
        for (int k = 0; k < kTopk; k++) {
            idx[t * kTopk + k] = rng() % 6 == 0 ? -1 : experts[k];
            w[t * kTopk + k] = weight(rng);
        }
    }

    // Layout.
    std::vector<int32_t> per_rank(kWorld), per_expert(kExperts);
    std::vector<uint8_t> in_rank(static_cast<size_t>(nt) * kWorld);
    check(ep_get_dispatch_layout(ctx.get(), idx.data(), nt, per_rank.data(), per_expert.data(),
                                 in_rank.data(), nullptr),
          "ep_get_dispatch_layout");
    std::vector<int32_t> want_rank(kWorld), want_expert(kExperts);
    for (int t = 0; t < nt; t++) {
        bool to[kWorld] = {};
        for (int k = 0; k < kTopk; k++) {
            int e = idx[t * kTopk + k];
            if (e >= 0) {
                want_expert[e]++;
                to[e / local] = true;
            }
        }
        for (int r = 0; r < kWorld; r++) {
            want_rank[r] += to[r];
            if (in_rank[t * kWorld + r] != to[r]) fail("is_token_in_rank differs");
        }
    }
    if (per_rank != want_rank) fail("num_tokens_per_rank differs");
    if (per_expert != want_expert) fail("num_tokens_per_expert differs");

    // Dispatch into both layouts.
    int32_t recv_cap = 0, expert_cap = 0;
    check(ep_get_dispatch_capacity(ctx.get(), kAlignment, &recv_cap, &expert_cap),
          "ep_get_dispatch_capacity");
    std::vector<uint16_t> recv_x(static_cast<size_t>(recv_cap) * kHidden);
    std::vector<int32_t> recv_idx(static_cast<size_t>(recv_cap) * kTopk);
    std::vector<float> recv_w(recv_idx.size());
    std::vector<int32_t> recv_src(static_cast<size_t>(recv_cap) * 2);
    std::vector<uint16_t> expert_x(static_cast<size_t>(expert_cap) * kHidden);
    std::vector<float> expert_w(expert_cap);
    std::vector<int32_t> src_row(expert_cap), offsets(local + 1), counts(local);
    int32_t recv_rows = -1;
    std::vector<int32_t> host_counts(local, -1);

    Handle handle = make_handle(ctx.get());
    ep_dispatch_args_t da;
    check(ep_dispatch_args_init(&da), "ep_dispatch_args_init");
    da.num_tokens = nt;
    da.dtype = EP_DTYPE_BF16;
    da.x = x.data();
    da.topk_idx = idx.data();
    da.topk_weights = w.data();
    da.recv_capacity = recv_cap;
    da.recv_x = recv_x.data();
    da.recv_topk_idx = recv_idx.data();
    da.recv_topk_weights = recv_w.data();
    da.recv_src_info = recv_src.data();
    da.expert_alignment = kAlignment;
    da.expert_capacity = expert_cap;
    da.expert_x = expert_x.data();
    da.expert_weights = expert_w.data();
    da.expert_src_row = src_row.data();
    da.expert_offsets = offsets.data();
    da.expert_counts = counts.data();
    da.host_recv_num_tokens = &recv_rows;
    da.host_expert_counts = host_counts.data();
    check(ep_dispatch(ctx.get(), &da, handle.get(), nullptr), "ep_dispatch");
    if (recv_rows < 0 || recv_rows > recv_cap) {
        throw std::runtime_error("unusable received row count " + std::to_string(recv_rows));
    }
    if (host_counts != counts) fail("host_expert_counts differs from expert_counts");
    for (int i = 0; i < recv_rows; i++) {
        int s = recv_src[2 * i];
        bool any = false;
        for (int k = 0; k < kTopk; k++) {
            int le = recv_idx[i * kTopk + k];
            any |= le >= 0;
            if (le < -1 || le >= local) fail("received local expert id out of range");
        }
        if (s < 0 || s >= kWorld || !any) fail("received row " + std::to_string(i) + " is bogus");
        if (i > 0 && (recv_src[2 * i - 2] > s ||
                      (recv_src[2 * i - 2] == s && recv_src[2 * i - 1] >= recv_src[2 * i + 1]))) {
            fail("received rows are not in source order");
        }
    }
    for (int e = 0; e < local; e++) {
        if (offsets[e] % kAlignment != 0 || offsets[e + 1] < offsets[e] + counts[e]) {
            fail("expert segment " + std::to_string(e) + " is misaligned or short");
        }
        for (int j = offsets[e]; j < offsets[e] + counts[e]; j++) {
            int r = src_row[j];
            if (r < 0 || r >= recv_rows ||
                std::memcmp(&expert_x[static_cast<size_t>(j) * kHidden],
                            &recv_x[static_cast<size_t>(r) * kHidden], kHidden * 2) != 0) {
                fail("expert-major row " + std::to_string(j) + " differs from its source row");
            }
        }
    }

    // Expected combine: sum_k w * x over the kept slots.
    auto check_out = [&](const std::vector<uint16_t> &out, const char *what) {
        int bad = 0;
        for (int t = 0; t < nt; t++) {
            float wsum = 0.0f;
            for (int k = 0; k < kTopk; k++) {
                if (idx[t * kTopk + k] >= 0) wsum += w[t * kTopk + k];
            }
            for (int c = 0; c < kHidden; c++) {
                float xv = from_bf16(x[static_cast<size_t>(t) * kHidden + c]);
                float got = from_bf16(out[static_cast<size_t>(t) * kHidden + c]);
                if (!(std::fabs(got - wsum * xv) <= wsum * std::fabs(xv) / 64 + 1e-3f)) bad++;
            }
        }
        if (bad) fail(std::string(what) + ": " + std::to_string(bad) + " values out of tolerance");
    };

    // Identity experts, combined from the expert-major rows.
    std::vector<uint16_t> out(static_cast<size_t>(nt) * kHidden);
    ep_combine_args_t ca;
    check(ep_combine_args_init(&ca), "ep_combine_args_init");
    ca.input_layout = EP_COMBINE_EXPERT_MAJOR;
    ca.x = expert_x.data();
    ca.out = out.data();
    check(ep_combine(ctx.get(), &ca, handle.get(), nullptr), "ep_combine (expert-major)");
    check_out(out, "combine (expert-major)");

    // Identity experts, reduced here per source-order row, then combined.
    std::vector<uint16_t> y(static_cast<size_t>(recv_rows) * kHidden + 1);
    for (int i = 0; i < recv_rows; i++) {
        float wsum = 0.0f;
        for (int k = 0; k < kTopk; k++) {
            if (recv_idx[i * kTopk + k] >= 0) wsum += recv_w[i * kTopk + k];
        }
        for (int c = 0; c < kHidden; c++) {
            size_t at = static_cast<size_t>(i) * kHidden + c;
            y[at] = to_bf16(wsum * from_bf16(recv_x[at]));
        }
    }
    std::fill(out.begin(), out.end(), uint16_t{0xffff});
    ca.input_layout = EP_COMBINE_SOURCE_ORDER;
    ca.x = y.data();
    check(ep_combine(ctx.get(), &ca, handle.get(), nullptr), "ep_combine (source order)");
    check_out(out, "combine (source order)");

    std::lock_guard<std::mutex> lock(print);
    std::printf("rank %d/%d (thread): %d tokens, received %d rows, %d expert-major rows: %s\n",
                rank, kWorld, nt, recv_rows, offsets[local], failures ? "FAILED" : "ok");
    return failures;
}

}  // namespace

int main() {
    ep_unique_id_t id;
    if (ep_get_unique_id(&id) != EP_SUCCESS) {
        std::fprintf(stderr, "ep_get_unique_id: %s\n", ep_get_last_error());
        return 1;
    }
    std::mutex print;
    std::atomic<int> failed{0};
    std::vector<std::thread> ranks;
    for (int r = 0; r < kWorld; r++) {
        ranks.emplace_back([r, &id, &print, &failed] {
            try {
                if (run_rank(r, id, print) != 0) failed++;
            } catch (const std::exception &e) {
                std::lock_guard<std::mutex> lock(print);
                std::fprintf(stderr, "rank %d: %s\n", r, e.what());
                failed++;
            }
        });
    }
    for (auto &t : ranks) t.join();
    if (failed != 0) {
        std::fprintf(stderr, "demo.cpp: %d of %d ranks failed\n", failed.load(), kWorld);
        return 1;
    }
    std::printf("demo.cpp: all %d ranks passed\n", kWorld);
    return 0;
}
