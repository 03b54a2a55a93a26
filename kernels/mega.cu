// Fused kernels: the grouped GEMM of the local experts in one persistent
// launch with the dispatch before it (ep_mega_dispatch_gemm) or the combine
// after it (ep_mega_gemm_combine). Hopper only (warpgroup MMA and the tensor
// memory accelerator); on other targets the kernels compile to a stub that
// records EP_STATUS_INVALID_ARGUMENT, and the host never launches them there.
//
// The GEMM: expert-major row j of local expert e (rows of expert e are
// [offset[e], offset[e] + count[e]), its segment) times weights[e]^T, the
// weights [local experts, n, k] K-major; BF16 out. FP8: e4m3 rows with one
// fp32 scale per 128 columns of k, e4m3 weights with one per 128 x 128
// block; each 128-wide k block is summed by the tensor cores into a fresh
// fp32 accumulator, then added times (row scale * block scale) into the
// result (fma), as src/reference/mega.rs specifies.
//
// Tiles: an m-tile is EP_MEGA_BLOCK_M consecutive rows of ONE expert,
// starting at its segment start (so tiles need no particular expert
// alignment; the last tile of an expert is ragged: its stores skip the rows
// past the segment). A stage holds only as many boxes of A rows (kABoxRows:
// 32 in BF16, the whole m-tile in FP8) as cover the tile's real rows; the
// last box may reach past the segment into rows that hold anything, and the
// MMAs read the stage's other rows as earlier stages left them: no such
// row's result is stored. The last n-tile of a GEMM may be ragged too (TMA
// fills the weight rows past n with zeros); an FP8 one of at most 64 real
// columns runs 64-wide MMAs (consume_narrow).
// Work units: a unit is an (m-tile, n-tile) pair (in clusters of 2, two
// consecutive m-tiles of one expert, a block each, and one n-tile). Units
// are numbered expert by expert (early experts first), and inside an
// expert n-tile by n-tile with the m-tiles fastest, so the units that read
// one weight tile are neighbours. Blocks take units in that order from a
// counter (state[2]), the next one as each nears the end of its loads for
// the last (take_unit): units that share a weight tile start within
// microseconds of each other and find it in L2. (With block b taking units
// b, b + grid, ... the blocks drifted apart by whole tiles, a mostly empty
// tile finishing early, and at W3 the BF16 GEMM read 17 GB from DRAM for
// 1.9 GB of weights: bench/RESULTS.md.)
// The producer decodes each unit (its m-tile and n-tile; the m-tile's
// segment from the handle's layout in global memory) and writes it
// (MegaWork) into each k-block's stage; the consumers read it from the
// first stage of the unit and decode nothing. After the last unit
// the producer fills one stage with no data and unit EP_MEGA_NO_UNIT. In a
// cluster, block 0's producer takes the unit and posts it, numbered, into
// the mailbox of every block of the cluster; each producer reads its own.
//
// Roles inside a block of 384 threads (3 warpgroups):
//   warp 0        producer: waits until a tile's rows are there (dispatch),
//                 then streams its A and B k-blocks into a ring of shared
//                 memory stages with TMA (and the FP8 scales with cp.async);
//   warps 1-3     communication: the dispatch's row copies, or the
//                 combine's sends of the bands the GEMM has stored;
//   warpgroups 1-2 consumers: warpgroup MMA over the stages (64 rows each),
//                 then the epilogue stores the BF16 tile into y: through
//                 a box in shared memory with TMA stores (store_rows_tma),
//                 or, for a warpgroup whose 64 rows are not all real (an
//                 expert's last tile), straight from its registers.
// After a combine's GEMM every warp of the block (all 12) sends the last
// band.
// A consumer warpgroup whose 64 rows of a tile are all padding (a tile of at
// most 64 real rows, as at decode) skips its MMAs. Every thread has the
// same register budget (168, of the launch bounds), except in the FP8
// kernels' GEMM, where the consumers take registers from the producer
// warpgroup (EP_MEGA_CONSUMER_REGS).
// Stage s is guarded by two mbarriers: full[s] (the producer's expected
// bytes, plus for FP8 the 32 producer lanes' cp.async arrivals) and empty[s]
// (one arrival per consumer warp once it is done with the stage: its MMAs
// have read it, it has read the stage's unit). Per warp, not per
// warpgroup: a warpgroup that skips its MMAs has nothing that keeps its
// warps together, and a stage released by its first warp was refilled
// while the others had yet to read it; they then read the next unit's
// number, or waited for a phase of the barrier that had passed (the hang
// of the clusters of 2, which have many tiles without rows: cuda-gdb
// showed the warps of one warpgroup at different units, bench/RESULTS.md).
//
// ep_mega_dispatch_gemm = count, stage, barrier, pull (kernels/normal.cu,
// with `skip_expert_rows`: the pull writes every output but the expert-major
// rows), this kernel, barrier. Here the communication warps take the
// experts' segments of expert-major rows in ascending order (warp w: tasks
// w, w + W, ...), so early experts fill first; inside a segment a rank
// starts (rank / world) of the way in and wraps (ep_mega_spread_row), so
// that ranks do not all read from one source. Each real row is its own task:
// the token's FIRST expert-major row is copied from the source rank's staged
// row (over NVLink for a peer: the token crosses once), every later row of
// the token from that first row once its flag holds the sequence number
// (acquire); each task then release-stores the call's sequence number into
// row_ready[row] (ep_mega_move_rows). A padding row gets zeros (and its y
// row too), or with EP_DISPATCH_KEEP_PADDING nothing: the GEMM stores real
// rows only. The producer acquire-loads row_ready of every real row of a tile
// until each holds the sequence number, and release-stores the number into
// tile_ready[m-tile]; the producers of the tile's later units (other
// n-tiles) acquire that flag instead (wait_for_tile_rows). Then it issues
// `fence.proxy.async.global` before its TMA loads: the rows were written by
// generic stores, the TMA reads them through the async proxy.
//
// ep_mega_gemm_combine = this kernel, barrier, reduce (kernels/normal.cu),
// barrier. The GEMM's n-tiles are split into column bands (MegaParams::bands,
// ep_mega_bands), and units are taken band by band (inside a band in the
// order above: the units of a weight tile stay neighbours), so the bands
// are stored one after the other. The kernel has two phases:
//   1. GEMM. The producer and consumers run every tile of the block (the
//      GEMM reads the caller's rows: no wait). When a consumer warpgroup
//      takes its first unit of a later band, and at its end, it counts its
//      units of the band before (publish_band): the thread that issued its
//      TMA stores waits until they have written y and orders them before
//      its generic accesses (fence.proxy.async), each thread fences its
//      stores of y, the warpgroup meets, and that thread adds the units to
//      band_count[band] (a release add at GPU scope). Meanwhile the
//      communication warps send every band but the last
//      (ep_mega_send_early_bands): one of them looks at band_count[band]
//      (relaxed loads, one every EP_MEGA_LONG_POLL_SLEEP_NS) until it holds
//      all the band's units, fences (acquire), the three meet, and the
//      communication warps of the grid take received rows (warp w of W:
//      items w, w + W, ... spread over the sources, ep_spread_row) and
//      send the band's columns of each (ep_combine_send_row: the weighted
//      sum of its expert-major rows of y, to its source rank's returned
//      rows, or straight into `out` for a token that stays home,
//      ep_combine_row_dst).
//   2. The last band, once EVERY block's tiles are stored. The thread that
//      issued a warpgroup's TMA stores waits until they have written y and
//      orders them before its generic accesses (fence.proxy.async); each
//      thread fences its stores of y and the block meets; thread 0 adds
//      the block to gemm_count (a release add) and acquire-loads it until
//      it holds every block of the grid; the block meets again (its
//      communication warps once they have sent the earlier bands), and
//      every warp of the grid takes received rows and sends the last band's
//      columns of each.
//   The counts are adds, not compare-and-swaps of (call, count) words: at
//   a band's end about 2 x 132 warpgroups count at once, and a
//   compare-and-swap that every other one may make fail completes about one
//   per L2 round trip (with such counts the W3 GEMM took about 10 % longer;
//   at the GEMM's end, the decode call 55 us: bench/RESULTS.md). So the
//   counts start at zero: the call's last block zeroes them.
// Every column of a row is summed in the same order whatever its band (the
// reference's), so the bands change no bit of the result; they only move
// all but the last band's share of the send (about 130 us of reads of y
// at W3) under the GEMM. A band costs one more pass over the input rows
// (each expert's, from L2 within the band).
// Why bands, and not each row as soon as its tiles are stored: in source
// order a row's expert-major rows lie in about topk random experts, so
// almost no row is complete before almost every tile is. Waiting for them
// row by row kept three warps of every block with rows polling tile flags
// (GPU-scope acquires: each look a strong load plus an invalidation of the
// SM's L1, CCTL.IVALL) for the whole GEMM, and the call took about 100 times
// the GEMM's time (232 ms at W3, bench/RESULTS.md).
//
// Sequence numbers: state[0] is the number of the last fused call; every
// block reads it at its start and uses state[0] + 1; the last block to
// finish (state[1] counts them, reset by that block, which also resets the
// unit counter state[2]) stores the new number.
// The next launch on the stream sees it, and a CUDA graph replay gets a
// fresh number each time; no row flag is ever cleared. A row flag from an
// earlier call holds a smaller number, so it never passes for ready. The
// combine's counts (gemm_count, band_count) are zeroed by the same last
// block before it stores the number.
//
// Waits: every wait on another block (rows, bands, the grid's GEMM) is an
// ep_mega_wait (ep_wait_until with GPU-scope acquires and a short sleep
// between looks, or for a band relaxed looks every
// EP_MEGA_LONG_POLL_SLEEP_NS and one acquire fence) with the context timeout
// and abort flag. A wait that fails records the error and the block goes on
// without waiting any more (computing garbage, the call having failed), so
// no block, and no consumer waiting on a stage, hangs. The waits on stages
// and on the mailbox are local to a cluster (a block, or its pair) and
// complete once every warp of the cluster goes on, whatever the routing:
// each consumer warp releases every stage it waited for, and block 0 posts
// each unit before it waits for anything of that unit.
//
// Blocks of one launch must all be resident (a dispatch's tiles wait for
// rows other blocks move, a combine's blocks for every block's GEMM): the
// host launches at most one block per SM (each takes most of an SM's shared
// memory) on at most the SMs the call may use.
#include <cuda_bf16.h>

#include "ep_device.cuh"
#include "ep_normal.cuh"

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

// Threads of a warpgroup; the fused block (EP_MEGA_THREADS, ep_abi.h) has 3.
#define EP_MEGA_WARPGROUP 128
// The consumer warpgroups' threads.
#define EP_MEGA_CONSUMERS 256
// Communication warps: warps 1-3 of the producer warpgroup.
#define EP_MEGA_COMM_WARPS 3
// Warps of a block (all of them send a combine's rows after the GEMM).
#define EP_MEGA_WARPS (EP_MEGA_THREADS / 32)
// The unit number of the stage that ends a block's work.
#define EP_MEGA_NO_UNIT (-1)
// Columns of k (and of n) that share one FP8 scale.
#define EP_MEGA_SCALE_BLOCK EP_HIDDEN_ALIGNMENT
// Rows of a tile that one consumer warpgroup computes.
#define EP_MEGA_WARPGROUP_ROWS (EP_MEGA_BLOCK_M / (EP_MEGA_CONSUMERS / EP_MEGA_WARPGROUP))
// Named barriers (bar.sync ids; 0 is __syncthreads) of the two consumer
// warpgroups' TMA stores: EP_MEGA_STORE_BARRIER + warpgroup.
#define EP_MEGA_STORE_BARRIER 1
// Named barrier of the FP8 kernels' return to even register budgets (the
// first id after the store barriers): the consumers arrive once they have
// given registers back, the producer warpgroup waits there before it takes
// them (even_registers).
#define EP_MEGA_REGISTERS_BARRIER (EP_MEGA_STORE_BARRIER + EP_MEGA_CONSUMERS / EP_MEGA_WARPGROUP)
// Named barrier of a combine's communication warps (warps 1-3), where they
// meet after one of them has seen a band stored (ep_mega_send_early_bands).
#define EP_MEGA_COMM_BARRIER (EP_MEGA_REGISTERS_BARRIER + 1)
// Bytes of one row of a store box (MEGA_STORE_COLS BF16 columns).
#define EP_MEGA_STORE_ROW_BYTES (EP_MEGA_STORE_COLS * 2)
// Registers per thread of the FP8 kernels while the GEMM runs (warpgroup
// register reallocation, setmaxnreg): the producer warpgroup (the producer
// warp, the communication warps) gives registers up to the consumers, whose
// FP8 mainloop holds two 128 x 192 accumulators (a k-block's and the
// total: 192 registers a thread). 128 * 72 + 256 * 216 registers fit the
// SM's registers; 216 is the fewest with which ptxas spills nothing of the
// consumers (208: 28 bytes), and the communication warps' 72 keep two
// 16-byte vectors of each row in flight while a combine's bands are sent
// (56 kept one, and bands did not pay in FP8). After the GEMM every
// warpgroup goes back to EP_MEGA_EVEN_REGS (= the launch bounds' 168), for
// a combine's rows.
#define EP_MEGA_PRODUCER_REGS 72
#define EP_MEGA_CONSUMER_REGS 216
// Registers of a Hopper SM; setmaxnreg counts in multiples of 8.
#define EP_MEGA_SM_REGISTERS 65536
#define EP_MEGA_EVEN_REGS (EP_MEGA_SM_REGISTERS / EP_MEGA_THREADS / 8 * 8)
static_assert(EP_MEGA_WARPGROUP * EP_MEGA_PRODUCER_REGS +
                      (EP_MEGA_THREADS - EP_MEGA_WARPGROUP) * EP_MEGA_CONSUMER_REGS <=
                  EP_MEGA_SM_REGISTERS,
              "the warpgroups' registers fit the SM");
// 16-byte vectors a communication warp's lane of an FP8 kernel has in flight
// when it copies a row: few, to fit EP_MEGA_PRODUCER_REGS.
#define EP_MEGA_FP8_COPY_UNROLL 4
// The same for a combine's sums of rows during the FP8 GEMM (vectors per
// lane and row, ep_add_weighted_rows), from the same registers.
#define EP_MEGA_FP8_SEND_UNROLL 2
// Shared memory a Hopper block may have (227 KiB); the host launches every
// fused kernel with the device's maximum, and each checks it is enough.
#define EP_MEGA_MAX_SHARED_BYTES (227 * 1024)
// Alignment of the shared state (the 128-byte swizzled stages and store
// boxes); the dynamic shared memory has this much slack for it.
#define EP_MEGA_SHARED_ALIGN 1024

// The parameters, MegaParams (with the TMA descriptors, EpTmaDescriptor),
// are defined in src/abi/defs.rs and reach this file through ep_abi.h.

// Where an m-tile lies.
struct MegaTile {
    int expert;
    int first_row;  // its first expert-major row
    int rows;       // real rows, 0 (a cluster's filler) to EP_MEGA_BLOCK_M
};

// The column bands of a call's n-tiles (MegaParams::bands): band b holds
// the n-tiles [b * tiles, min((b + 1) * tiles, n_tiles)).
struct MegaBands {
    int n_tiles;  // of the GEMM
    int tiles;    // per band (the last band may have fewer)
    int count;    // bands that hold n-tiles
    int block_n;  // columns of an n-tile
};

// What every block keeps of the handle's expert layout: the m-tiles. The
// segments themselves (offsets and real rows, 8 KiB at EP_MAX_EXPERTS) stay
// in global memory, where only the producer reads them, once per unit
// (ep_mega_tile), and hands each unit's tile to its consumers in the stage;
// the shared memory they would take holds the FP8 kernels' fifth stage.
struct MegaLayout {
    int tile_start[EP_MAX_EXPERTS + 1];  // first m-tile of each expert; [L] = m-tiles
    int rows;                            // expert-major rows: the last segment's end
    int warp_rows[EP_MEGA_WARPS][EP_MAX_TOPK];  // scratch of each warp
    float warp_weights[EP_MEGA_WARPS][EP_MAX_TOPK];
    int usable;  // the routing and the layout are sane
    int failed;  // a wait of this block failed: wait no more
    int seq;     // this call's sequence number
};

// ---------------------------------------------------------------------------
// Layout and tiles (any target)
// ---------------------------------------------------------------------------

// The m-tiles of an expert with `count` rows, rounded up to a multiple of
// the cluster size (the blocks of a cluster take m-tiles of one expert).
__device__ __forceinline__ int ep_mega_expert_tiles(int count, int cluster) {
    const int tiles = (max(count, 0) + EP_MEGA_BLOCK_M - 1) / EP_MEGA_BLOCK_M;
    return (tiles + cluster - 1) / cluster * cluster;
}

// Loads the handle's layout and numbers the m-tiles; sets `usable` and
// `seq`. Whole block. A layout that cannot come from a dispatch (offsets
// out of order, counts beyond their segments, more rows than the buffers)
// is recorded as EP_STATUS_INVALID_ARGUMENT; a failed routing barrier was
// recorded before.
__device__ __forceinline__ void ep_mega_load_layout(const MegaParams& p, MegaLayout& l,
                                                    bool routed, int phase, int cluster, int seq) {
    const int experts = p.local_experts;
    const int* offset = p.expert_layout;               // [experts + 1] segment starts
    const int* count = p.expert_layout + experts + 1;  // [experts] real rows
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        const int per_lane = (experts + 31) / 32;
        const int first = min(experts, lane * per_lane);
        const int last = min(experts, first + per_lane);
        const int rows = offset[experts];
        bool sane = offset[0] == 0 && rows <= p.rows;
        int tiles = 0;
        for (int e = first; e < last; ++e) {
            sane = sane && ep_expert_rows_fit(offset, count, e);
            tiles += ep_mega_expert_tiles(count[e], cluster);
        }
        sane = __all_sync(0xffffffffu, sane);
        // Exclusive prefix of the lanes' tile counts.
        int before = tiles;
        for (int d = 1; d < 32; d *= 2) {
            const int other = __shfl_up_sync(0xffffffffu, before, d);
            before += lane >= d ? other : 0;
        }
        before -= tiles;
        for (int e = first; e < last; ++e) {
            l.tile_start[e] = before;
            before += ep_mega_expert_tiles(count[e], cluster);
        }
        if (lane == 31) {
            l.tile_start[experts] = before;
            sane = sane && before <= p.max_m_tiles;
            if (!sane && routed && blockIdx.x == 0) {
                ep_record_error(p.status, EP_STATUS_INVALID_ARGUMENT, -1, phase, 0);
            }
            l.usable = sane && routed;
            l.rows = sane ? rows : 0;
            l.failed = 0;
            l.seq = seq;
        }
    }
    __syncthreads();
}

// The m-tile `m`: its expert is the last one whose first tile is <= m
// (experts without rows share their successor's first tile). A tile past
// the expert's rows (rounding to the cluster size) has 0 rows. The
// segment's start and real rows are read from the handle's layout in global
// memory (constant during the kernel).
__device__ __forceinline__ MegaTile ep_mega_tile(const MegaParams& p, const MegaLayout& l, int m) {
    const int experts = p.local_experts;
    const int lo = ep_segment_of(l.tile_start, experts, m);
    const int skipped = (m - l.tile_start[lo]) * EP_MEGA_BLOCK_M;
    const int first = __ldg(p.expert_layout + lo);
    const int count = __ldg(p.expert_layout + experts + 1 + lo);
    return MegaTile{lo, first + skipped, min(EP_MEGA_BLOCK_M, max(0, count - skipped))};
}

// The call's bands for n-tiles of `block_n` columns: as many as asked
// (1 to EP_MEGA_MAX_BANDS), fewer where there are fewer n-tiles.
__device__ __forceinline__ MegaBands ep_mega_bands(const MegaParams& p, int block_n) {
    const int n_tiles = (p.n + block_n - 1) / block_n;
    const int wanted = min(max(p.bands, 1), EP_MEGA_MAX_BANDS);
    const int tiles = max((n_tiles + wanted - 1) / wanted, 1);
    return MegaBands{n_tiles, tiles, (n_tiles + tiles - 1) / tiles, block_n};
}

// The n-tiles of band `band`.
__device__ __forceinline__ int ep_mega_band_tiles(const MegaBands& b, int band) {
    return min(b.tiles, b.n_tiles - band * b.tiles);
}

// The band's columns as 16-byte vectors of a BF16 row of `n` columns:
// [*first, *end).
__device__ __forceinline__ void ep_mega_band_vectors(const MegaBands& b, int band, int n,
                                                     int* first, int* end) {
    *first = min(band * b.tiles * b.block_n, n) / 8;
    *end = min((band + 1) * b.tiles * b.block_n, n) / 8;
}

// How long a waiting thread sleeps between two looks at a flag: the polls
// should leave the memory system to the work they wait for (a dispatch's
// tiles wait for their rows while other tiles compute).
#define EP_MEGA_POLL_SLEEP_NS 256
// The same for waits beside the GEMM that may last as long as a band of it
// (ep_mega_wait's kLong): a look every 10 us. With one look per microsecond
// by one thread of each SM, the fused combine's GEMM at W3 took 30 to 40 %
// longer; with one per 5, 10 or 20 us it was as fast as without any
// (bench/RESULTS.md). The band's send starts at most this much late.
#define EP_MEGA_LONG_POLL_SLEEP_NS 10000

// A bounded wait of one thread for `*flag` (written by blocks of this GPU:
// a row's sequence number, or a count) to reach `target`, skipped once any
// wait of the block has failed. The wait has no peer: its "peer call" is
// `state[0]`, which no one changes while the kernel runs, so
// ep_wait_until's test for a peer in another call never fires. `kLong`: a
// wait beside the block's own GEMM that may last as long as a band of it,
// which looks with relaxed loads every EP_MEGA_LONG_POLL_SLEEP_NS and
// fences once at the end; the others look with acquire loads.
template <bool kLong = false>
__device__ __forceinline__ void ep_mega_wait(const MegaParams& p, MegaLayout& l, const int* flag,
                                             int target, int phase) {
    if (*reinterpret_cast<volatile int*>(&l.failed)) {
        return;
    }
    const EpPeerCall no_peer{p.state, l.seq - 1};
    const auto look = [flag, target] {
        const int value = kLong ? ep_ld_relaxed_gpu(flag) : ep_ld_acquire_gpu(flag);
        if (!ep_reached(value, target)) {
            __nanosleep(kLong ? EP_MEGA_LONG_POLL_SLEEP_NS : EP_MEGA_POLL_SLEEP_NS);
        }
        return value;
    };
    if (!ep_wait_until(look, target, ep_deadline_after(p.timeout_ns), p.abort_flag, p.status, -1,
                       phase, no_peer)) {
        *reinterpret_cast<volatile int*>(&l.failed) = 1;
    }
    if constexpr (kLong) {
        // Acquire: the flag seen by the relaxed looks.
        ep_fence_acquire_gpu();
    }
}

// ---------------------------------------------------------------------------
// Communication warps (any target)
// ---------------------------------------------------------------------------

// Zeros `bytes` (a multiple of 16) at `row` with the whole warp.
__device__ __forceinline__ void ep_mega_zero_row(uint8_t* row, int64_t bytes, int lane) {
    int4* v = reinterpret_cast<int4*>(row);
    for (int64_t i = lane; i < bytes / 16; i += 32) {
        v[i] = make_int4(0, 0, 0, 0);
    }
}

// The expert-major row that task `task` of a dispatch's row moves takes:
// the experts' segments in order, and inside each the rows from (rank /
// world) of the way in, wrapping around. A segment's rows are ordered by
// source rank, so without the turn every rank would read its first rows
// from rank 0's staging, then from rank 1's, and so on, all at once: one
// peer's NVLink port carrying the traffic of all ranks (as the normal
// mode's pull did, ep_spread_row). With one rank it is the identity.
__device__ __forceinline__ int ep_mega_spread_row(const MegaParams& p, int task) {
    const int expert = ep_segment_of(p.expert_layout, p.local_experts, task);
    const int start = __ldg(p.expert_layout + expert);
    const int rows = __ldg(p.expert_layout + expert + 1) - start;
    const int turn =
        static_cast<int>(static_cast<int64_t>(rows) * p.dispatch.rank / p.dispatch.world);
    const int inside = task - start + turn;
    return start + (inside >= rows ? inside - rows : inside);
}

// Dispatch: the expert-major rows, expert after expert (ep_mega_spread_row),
// `warp` of `warps`, each moved into its row by its own task, so an expert's
// rows are ready before the next expert's (the GEMM's units start with the
// first expert): a token's first row from the source rank's staged row (the
// only read of the token from its source, as the token crosses once), every
// later row of the token from that first row (local, once it is ready: it
// lies in an earlier expert's segment, so its task was taken earlier, and
// the earliest task still waited for never waits for one that is not
// taken). `kUnroll`: 16-byte vectors in flight per lane (ep_warp_copy_row).
// (When the first row's task moved the token into all its rows at once, an
// expert's rows were ready only once every task of its rows had written up
// to topk rows: at W3 the GEMM's producers waited for rows for a quarter of
// the kernel, bench/RESULTS.md.)
template <int kUnroll>
__device__ __forceinline__ void ep_mega_move_rows(const MegaParams& p, MegaLayout& l, int seq,
                                                  int warp, int warps, int lane) {
    const DispatchParams& d = p.dispatch;
    const int total = l.rows;
    for (int task = warp; task < total; task += warps) {
        const int j = ep_mega_spread_row(p, task);
        const int row = d.expert_src_row[j];
        if (row < 0 && d.keep_padding) {
            continue;  // padding left as it was (EP_DISPATCH_KEEP_PADDING)
        }
        if (row < 0) {
            // Padding: zero row, zero scales, zero output row.
            ep_mega_zero_row(d.expert_x + static_cast<int64_t>(j) * d.row_bytes, d.row_bytes, lane);
            for (int c = lane; c < d.scale_cols; c += 32) {
                d.expert_scales[static_cast<int64_t>(j) * d.scale_cols + c] = 0.0f;
            }
            ep_mega_zero_row(reinterpret_cast<uint8_t*>(p.y + static_cast<int64_t>(j) * p.n),
                             static_cast<int64_t>(p.n) * 2, lane);
            continue;
        }
        // The token's first expert-major row.
        const int pos = lane < d.topk ? d.handle_row_expert_pos[static_cast<int64_t>(row) * d.topk + lane]
                                      : -1;
        const int first = static_cast<int>(
            __reduce_min_sync(0xffffffffu, pos >= 0 ? static_cast<unsigned>(pos) : 0xffffffffu));
        const uint8_t* src;
        const float* scales;
        if (first == j) {
            const EpRowSource from = ep_row_source(d.handle_row_src, row);
            src = ep_token_row(d, from.source, from.token);
            scales = ep_token_scales(d, from.source, from.token);
        } else {
            ep_mega_wait(p, l, p.row_ready + first, seq, EP_PHASE_DISPATCH);
            src = d.expert_x + static_cast<int64_t>(first) * d.row_bytes;
            scales = d.expert_scales + static_cast<int64_t>(first) * d.scale_cols;
        }
        ep_warp_copy_row<kUnroll>(src, d.expert_x + static_cast<int64_t>(j) * d.row_bytes, nullptr,
                                  nullptr, 0, d.row_bytes, lane);
        for (int c = lane; c < d.scale_cols; c += 32) {
            d.expert_scales[static_cast<int64_t>(j) * d.scale_cols + c] = scales[c];
        }
        // Release: the row (every lane's stores) before its flag.
        __threadfence();
        __syncwarp();
        if (lane == 0) {
            ep_st_release_gpu(p.row_ready + j, seq);
        }
        __syncwarp();
    }
}

// Combine, once the tiles of a band are stored: the band's columns of the
// received rows, `warp` of `warps`, each the weighted sum of its
// expert-major rows of y sent back to its source rank, or into `out` for
// a token that stays home (ep_combine_send_row); `slot`: the warp in its
// block (its scratch).
template <int kUnroll>
__device__ __forceinline__ void ep_mega_send_rows(const MegaParams& p, MegaLayout& l,
                                                  const MegaBands& bands, int band, int warp,
                                                  int warps, int slot, int lane) {
    const CombineParams& c = p.combine;
    const int rows = *c.handle_num_rows;
    int first;
    int end;
    ep_mega_band_vectors(bands, band, c.hidden, &first, &end);
    const int items = ep_spread_items(rows, c.world);
    for (int i = warp; i < items; i += warps) {
        const int row = ep_spread_row(i, rows, c.world, c.rank);
        if (row < 0) {
            continue;
        }
        ep_combine_send_row<kUnroll>(c, row, l.warp_rows[slot], l.warp_weights[slot], first, end,
                                     lane);
        __syncwarp();
    }
}

// The communication warps of a combine's block (`comm_warp` 0-2, warps 1-3)
// meet (a hardware barrier).
__device__ __forceinline__ void ep_mega_comm_sync() {
    asm volatile("bar.sync %0, %1;" ::"n"(EP_MEGA_COMM_BARRIER), "n"(EP_MEGA_COMM_WARPS * 32)
                 : "memory");
}

// The units of band `band` each consumer warpgroup that sees them counts
// in band_count[band]: each unit is seen by both consumer warpgroups of
// every block of its cluster.
__device__ __forceinline__ int ep_mega_band_units(const MegaParams& p, const MegaLayout& l,
                                                  const MegaBands& bands, int band,
                                                  int cluster_size) {
    const int groups = l.tile_start[p.local_experts] / cluster_size;
    return groups * ep_mega_band_tiles(bands, band) * cluster_size *
           (EP_MEGA_CONSUMERS / EP_MEGA_WARPGROUP);
}

// A combine's communication warps while the GEMM runs: every band but the
// last, in order, once all its units are stored (band_count), sent by the
// grid's communication warps.
template <int kUnroll>
__device__ __forceinline__ void ep_mega_send_early_bands(const MegaParams& p, MegaLayout& l,
                                                         const MegaBands& bands, int cluster_size,
                                                         int comm_warp, int lane) {
    for (int band = 0; band + 1 < bands.count; ++band) {
        if (comm_warp == 0 && lane == 0) {
            // Acquire: every block's tiles of the band; the warps meet
            // (below) before any reads them.
            ep_mega_wait<true>(p, l, p.band_count + band,
                               ep_mega_band_units(p, l, bands, band, cluster_size),
                               EP_PHASE_COMBINE);
        }
        ep_mega_comm_sync();
        ep_mega_send_rows<kUnroll>(p, l, bands, band, blockIdx.x * EP_MEGA_COMM_WARPS + comm_warp,
                                   gridDim.x * EP_MEGA_COMM_WARPS, comm_warp + 1, lane);
    }
}

// Adds `n` to one of a combine's counts (gemm_count, band_count) with
// release semantics at GPU scope: the stores this thread made or fenced
// before it are visible to a thread that reads a count including it and
// then fences (ep_mega_wait).
__device__ __forceinline__ void ep_mega_count(int* count, int n) {
    ep_red_release_gpu(count, n);
}

// A combine's phase 2, whole block, after its GEMM (the kernel comment's
// protocol): count the block, wait for every block's, send the last band.
__device__ __forceinline__ void ep_mega_combine(const MegaParams& p, MegaLayout& l,
                                                const MegaBands& bands, int warp, int lane) {
    // Release, part 1: this thread's stores of y (a consumer's) are fenced
    // at GPU scope before the block meets, so thread 0's add publishes
    // them.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        // Release, part 2.
        ep_mega_count(p.gemm_count, 1);
        // Acquire: every block's y, then the block meets (below) before
        // any warp reads it.
        if (l.usable) {
            ep_mega_wait(p, l, p.gemm_count, gridDim.x, EP_PHASE_COMBINE);
        }
    }
    __syncthreads();
    if (l.usable) {
        ep_mega_send_rows<EP_SUM_UNROLL>(p, l, bands, max(bands.count - 1, 0),
                                         blockIdx.x * EP_MEGA_WARPS + warp,
                                         gridDim.x * EP_MEGA_WARPS, warp, lane);
    }
}

// Records that a fused kernel ran on a GPU it was not built for, without
// the shared memory it needs, or with the other mode's parameters.
__device__ __forceinline__ void ep_mega_unsupported(const MegaParams& p) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        ep_record_error(p.status, EP_STATUS_INVALID_ARGUMENT, -1,
                        p.mode == EP_MEGA_MODE_DISPATCH ? EP_PHASE_DISPATCH : EP_PHASE_COMBINE, 0);
    }
}

// ---------------------------------------------------------------------------
// The GEMM (Hopper)
// ---------------------------------------------------------------------------

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

namespace ep_mega {
using namespace cute;

// BF16: 128 x 256 tiles, k-blocks of 64, 4 stages (48 KiB each); one
// store box per consumer warpgroup, reused for the tile's four.
struct Bf16Gemm {
    using Element = bfloat16_t;
    using Atom = SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>;
    static constexpr int kBlockN = EP_MEGA_BF16_BLOCK_N;
    static constexpr int kBlockK = EP_MEGA_BF16_BLOCK_K;
    static constexpr int kStages = 4;
    static constexpr bool kScaled = false;
    static constexpr int kABoxRows = EP_MEGA_BF16_A_BOX_ROWS;
    // No narrow last n-tile (see Fp8Gemm).
    using NarrowAtom = Atom;
    static constexpr int kNarrowN = 0;
};

// FP8: 128 x 192 tiles, k-blocks of 128 (one scale block), 5 stages
// (40 KiB each); two accumulators (a k-block's and the total) per thread,
// which need the consumers' larger register budget
// (EP_MEGA_CONSUMER_REGS); one store box per consumer warpgroup, reused
// for the tile's three. (128 x 128 tiles kept the tensor cores busy under
// half the time at W3; a box per 64 columns, so that the epilogue never
// waited for its own stores, took the room of the fifth stage and was
// slower: bench/RESULTS.md.)
struct Fp8Gemm {
    using Element = float_e4m3_t;
    using Atom = SM90::GMMA::MMA_64x192x32_F32E4M3E4M3_SS_TN<>;
    static constexpr int kBlockN = EP_MEGA_FP8_BLOCK_N;
    static constexpr int kBlockK = EP_MEGA_FP8_BLOCK_K;
    static constexpr int kStages = 5;
    static constexpr bool kScaled = true;
    static constexpr int kABoxRows = EP_MEGA_FP8_A_BOX_ROWS;
    // The last n-tile of an n that is not a multiple of 192 (W3's 4096 and
    // 7168 are 21 and 37 tiles and 64 columns) has its real columns in the
    // first kNarrowN: its MMAs run that wide (consume_narrow), a third of
    // a whole tile's tensor work, instead of over the zeros TMA fills in
    // past n.
    using NarrowAtom = SM90::GMMA::MMA_64x64x32_F32E4M3E4M3_SS_TN<>;
    static constexpr int kNarrowN = 64;
};

// The m-tile, n-tile and band of a work unit for this block (ep_mega_unit).
struct MegaUnit {
    int m_tile;
    int n_tile;
    int band;
};

// What the producer hands the consumers with each stage it fills: the
// unit's number (EP_MEGA_NO_UNIT in the stage that ends the block's work),
// its place and its m-tile, so that the consumers, whose registers hold the
// accumulators, decode nothing.
struct MegaWork {
    int unit;
    MegaUnit place;
    MegaTile tile;
};

// The greatest common divisor, for the scale blocks an n-tile spans.
__host__ __device__ constexpr int ep_gcd(int a, int b) { return b == 0 ? a : ep_gcd(b, a % b); }

template <class G>
struct Gemm {
    using Element = typename G::Element;
    static constexpr int kBlockM = EP_MEGA_BLOCK_M;
    static constexpr int kBlockN = G::kBlockN;
    static constexpr int kBlockK = G::kBlockK;
    static constexpr int kStages = G::kStages;
    // An n-tile starts at a multiple of kBlockN, so its first column is a
    // multiple of kScaleAlign into its weight scale block, and the tile
    // spans at most kBScales blocks.
    static constexpr int kScaleAlign = ep_gcd(kBlockN, EP_MEGA_SCALE_BLOCK);
    static constexpr int kBScales =
        (EP_MEGA_SCALE_BLOCK - kScaleAlign + kBlockN + EP_MEGA_SCALE_BLOCK - 1) / EP_MEGA_SCALE_BLOCK;
    // A stage's A rows come in boxes of kABoxRows, each a whole number of
    // the 128-byte swizzle's 8-row atoms (1024 bytes), so boxes stacked in
    // a stage lay out its rows as one box of kBlockM would.
    static constexpr int kABoxRows = G::kABoxRows;
    static_assert(kBlockM % kABoxRows == 0 && kABoxRows % 8 == 0,
                  "A boxes tile an m-tile in whole swizzle atoms");
    // The A boxes of a tile of `rows` real rows: enough to cover them, or
    // the one box of a whole m-tile (a cluster's filler tile too).
    __device__ static int a_boxes(int rows) {
        return kABoxRows == kBlockM ? 1 : (rows + kABoxRows - 1) / kABoxRows;
    }
    // Bytes of a stage with `boxes` A boxes and the whole weight tile.
    __device__ static uint32_t stage_bytes(int boxes) {
        return (boxes * kABoxRows + kBlockN) * kBlockK * static_cast<uint32_t>(sizeof(Element));
    }
    // full[s] waits for the producer's arrive (and, FP8, 32 cp.async arrivals).
    static constexpr uint32_t kFullArrivals = G::kScaled ? 33 : 1;
    // empty[s] waits for each consumer warp of every block of the cluster
    // (a block's B half lands in its partner's stage too).
    static constexpr uint32_t kConsumerWarps = EP_MEGA_CONSUMERS / 32;
    // Mailbox entries: block 0 of a cluster is at most kStages loads ahead
    // of its partner's, so at most kStages units ahead (it posts a unit at
    // the unit's start).
    static constexpr int kMailbox = kStages + 1;

    // Two consumer warpgroups stacked along M: 128 x kBlockN per k-step.
    using TiledMma = decltype(make_tiled_mma(typename G::Atom{}, Layout<Shape<_2, _1, _1>>{}));
    using NarrowMma =
        decltype(make_tiled_mma(typename G::NarrowAtom{}, Layout<Shape<_2, _1, _1>>{}));
    using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                               make_shape(Int<kBlockM>{}, Int<kBlockK>{},
                                                          Int<kStages>{})));
    using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                               make_shape(Int<kBlockN>{}, Int<kBlockK>{},
                                                          Int<kStages>{})));

    struct alignas(EP_MEGA_SHARED_ALIGN) Shared {
        Element a[kStages * kBlockM * kBlockK];
        Element b[kStages * kBlockN * kBlockK];
        // Each consumer warpgroup's store box (store_rows_tma), 128-byte
        // swizzled as the y tensor map says.
        alignas(EP_MEGA_SHARED_ALIGN) uint8_t store[EP_MEGA_CONSUMERS / EP_MEGA_WARPGROUP]
                                   [EP_MEGA_STORE_ROWS * EP_MEGA_STORE_ROW_BYTES];
        float a_scales[kStages][kBlockM];
        float b_scales[kStages][kBScales];
        uint64_t full[kStages];
        uint64_t empty[kStages];
        MegaWork work[kStages];  // the unit each stage belongs to
        // Units posted by the cluster's block 0, (ordinal + 1) << 32 | unit.
        unsigned long long mailbox[kMailbox];
        MegaLayout layout;
    };
};

// A block's place in its cluster: `size` blocks (1, or 2 sharing the weight
// tile), this one `rank`.
struct Cluster {
    int size;
    int rank;
};

// The place of work unit `unit` for this block: a unit is a pair (group of
// `cluster.size` consecutive m-tiles of one expert, n-tile), the blocks of
// a cluster take one m-tile of the group each. The units of a band are all
// groups times its n-tiles; inside a band, an expert's units start at its
// first group times the band's n-tiles, and inside them the groups run
// fastest (the kernel comment's order).
__device__ __forceinline__ MegaUnit ep_mega_unit(const MegaLayout& l, int experts, int unit,
                                                 const MegaBands& bands, const Cluster& cluster) {
    const int all_groups = l.tile_start[experts] / cluster.size;
    const int band = unit / (all_groups * bands.tiles);
    const int tiles = ep_mega_band_tiles(bands, band);
    const int in_band = unit - band * all_groups * bands.tiles;
    const int expert = ep_segment_of(l.tile_start, experts, in_band / tiles * cluster.size);
    const int first_group = l.tile_start[expert] / cluster.size;
    const int groups = l.tile_start[expert + 1] / cluster.size - first_group;
    const int inside = in_band - first_group * tiles;
    return MegaUnit{(first_group + inside % groups) * cluster.size + cluster.rank,
                    band * bands.tiles + inside / groups, band};
}

// Units are taken in two steps, so that the counter's round trip overlaps
// the loads of the unit before: take_unit (lane 0 of the cluster's block 0
// adds one to the call's counter; the value is only read later), then, at
// the unit's start, read_unit. A unit is taken when its predecessor has
// EP_MEGA_TAKE_AHEAD k-blocks left to load: a few microseconds early, not
// enough to separate the units that share a weight tile.
#define EP_MEGA_TAKE_AHEAD 2

__device__ __forceinline__ unsigned take_unit(const MegaParams& p, const Cluster& cluster,
                                              int lane) {
    return lane == 0 && cluster.rank == 0 ? static_cast<unsigned>(atomicAdd(p.state + 2, 1)) : 0u;
}

// The producer warp's `ordinal`-th unit (from 0), `taken` by take_unit: a
// unit number below `total_units`, or EP_MEGA_NO_UNIT when none is left. In
// a cluster, block 0 posts it to every block's mailbox (release at cluster
// scope) and each block reads its own (acquire). The wait is local to the
// cluster: block 0 posts each unit before it waits for anything of that
// unit, and its partner has posted nothing it waits for.
template <int kMailbox>
__device__ __forceinline__ int read_unit(unsigned long long* mailbox, unsigned taken, int ordinal,
                                         int total_units, const Cluster& cluster, int lane) {
    if (lane == 0 && cluster.size > 1) {
        unsigned long long* entry = &mailbox[ordinal % kMailbox];
        const unsigned long long posted = static_cast<unsigned long long>(ordinal + 1) << 32;
        const uint32_t local = cute::cast_smem_ptr_to_uint(entry);
        if (cluster.rank == 0) {
            for (int block = 0; block < cluster.size; ++block) {
                uint32_t remote;
                asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                             : "=r"(remote)
                             : "r"(local), "r"(block));
                // Release: the post; nothing else is published with it.
                asm volatile("st.release.cluster.shared::cluster.u64 [%0], %1;" ::"r"(remote),
                             "l"(posted | taken)
                             : "memory");
            }
        }
        unsigned long long seen;
        do {
            // Acquire: block 0's post of this ordinal.
            asm volatile("ld.acquire.cluster.shared::cta.u64 %0, [%1];"
                         : "=l"(seen)
                         : "r"(local)
                         : "memory");
        } while ((seen & 0xffffffff00000000ull) != posted);
        taken = static_cast<unsigned>(seen & 0xffffffffull);
    }
    const unsigned unit = __shfl_sync(0xffffffffu, taken, 0);
    return unit < static_cast<unsigned>(total_units) ? static_cast<int>(unit) : EP_MEGA_NO_UNIT;
}

// The stage ring position of one role: stage index and the parity of the
// phase it waits for.
struct Ring {
    int stage;
    uint32_t parity;
    template <int kStages>
    __device__ __forceinline__ void advance() {
        if (++stage == kStages) {
            stage = 0;
            parity ^= 1;
        }
    }
};

// The stage that ends a block's work: no data, unit EP_MEGA_NO_UNIT, and
// as many arrivals on full[stage] as a loaded stage has (no bytes).
template <class G>
__device__ __forceinline__ void produce_end(typename Gemm<G>::Shared& s, Ring& ring, int lane) {
    cutlass::arch::ClusterBarrier::wait(&s.empty[ring.stage], ring.parity);
    if (lane == 0) {
        s.work[ring.stage].unit = EP_MEGA_NO_UNIT;
    }
    // The unit's store before the arrivals (every lane's arrival has
    // release semantics; the warp meets first).
    __syncwarp();
    for (uint32_t i = lane; i < Gemm<G>::kFullArrivals; i += 32) {
        cutlass::arch::ClusterBarrier::arrive(&s.full[ring.stage]);
    }
    __syncwarp();
    ring.advance<Gemm<G>::kStages>();
}

// Dispatch, producer warp: waits until every real row of m-tile `m_tile`
// (`t`) has been moved. A tile's rows are waited for by the producer of
// each of its units (one per n-tile), so the first producer to see them
// all release-stores the sequence number into tile_ready[m_tile] (after
// its lanes' acquires of the row flags and the warp's meeting), and the
// producers after it acquire that one flag instead of the tile's row flags
// (up to EP_MEGA_BLOCK_M acquire loads, each of which also invalidates the
// SM's L1).
__device__ __forceinline__ void wait_for_tile_rows(const MegaParams& p, MegaLayout& l,
                                                   const MegaTile& t, int m_tile, int seq,
                                                   int lane) {
    int seen = 0;
    if (lane == 0) {
        // Acquire: every row of the tile, moved before the flag's release.
        seen = ep_reached(ep_ld_acquire_gpu(p.tile_ready + m_tile), seq);
    }
    if (__shfl_sync(0xffffffffu, seen, 0)) {
        return;
    }
    for (int i = lane; i < t.rows; i += 32) {
        // Acquire: the row.
        ep_mega_wait(p, l, p.row_ready + t.first_row + i, seq, EP_PHASE_DISPATCH);
    }
    __syncwarp();
    if (lane == 0 && !*reinterpret_cast<volatile int*>(&l.failed)) {
        // Release: the rows every lane acquired (the warp met above).
        ep_st_release_gpu(p.tile_ready + m_tile, seq);
    }
    __syncwarp();
}

// Producer warp, FP8: the k-block `kb` of the m-tile's row scales and of
// the weight tile's block scales into the stage at `ring`, with cp.async
// (zeros past the rows and past n), then the lanes' arrivals on full[stage]
// once their copies land.
template <class G>
__device__ __forceinline__ void load_stage_scales(const MegaParams& p,
                                                  typename Gemm<G>::Shared& s, const Ring& ring,
                                                  const MegaTile& t, int n0, int kb,
                                                  int scale_cols, int lane) {
    using T = Gemm<G>;
    static_assert(T::kABoxRows == T::kBlockM, "a scaled kernel loads whole m-tiles of A");
    for (int i = lane; i < T::kBlockM; i += 32) {
        const int64_t row = t.first_row + i;
        const bool inside = row < p.rows;
        const float* src = p.a_scales + (inside ? row * scale_cols + kb : 0);
        const uint32_t dst = cute::cast_smem_ptr_to_uint(&s.a_scales[ring.stage][i]);
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src),
                     "r"(inside ? 4 : 0)
                     : "memory");
    }
    if (lane < T::kBScales) {
        const int n_block = n0 / EP_MEGA_SCALE_BLOCK + lane;
        const int n_blocks = p.n / EP_MEGA_SCALE_BLOCK;
        const bool inside = n_block < n_blocks;
        const float* src =
            p.b_scales +
            (inside ? (static_cast<int64_t>(t.expert) * n_blocks + n_block) * scale_cols + kb : 0);
        const uint32_t dst = cute::cast_smem_ptr_to_uint(&s.b_scales[ring.stage][lane]);
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src),
                     "r"(inside ? 4 : 0)
                     : "memory");
    }
    cutlass::arch::cpasync_barrier_arrive_noinc(&s.full[ring.stage]);
}

// Producer warp's lane 0: the unit (`work`) into the stage at `ring`, then
// the arrival that expects the stage's bytes and the TMA loads of k-block
// `kb`: the boxes of the m-tile's real A rows, and this block's part of the
// weight tile (all of it, or in a cluster of 2 its half, multicast to both
// blocks).
template <class G>
__device__ __forceinline__ void load_stage_tiles(const MegaParams& p, typename Gemm<G>::Shared& s,
                                                 const Ring& ring, const MegaWork& work, int n0,
                                                 int kb, const Cluster& cluster) {
    using T = Gemm<G>;
    const int b_rows = T::kBlockN / cluster.size;  // weight rows this block loads
    const uint16_t everyone = static_cast<uint16_t>((1 << cluster.size) - 1);
    // The unit before the arrival (program order).
    s.work[ring.stage] = work;
    uint64_t* full = &s.full[ring.stage];
    const int a_boxes = T::a_boxes(work.tile.rows);
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(full, T::stage_bytes(a_boxes));
    const uint64_t hint = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL);
    typename T::Element* a = s.a + ring.stage * T::kBlockM * T::kBlockK;
    for (int box = 0; box < a_boxes; ++box) {
        SM90_TMA_LOAD_2D::copy(&p.a, full, hint, a + box * T::kABoxRows * T::kBlockK,
                               kb * T::kBlockK, work.tile.first_row + box * T::kABoxRows);
    }
    typename T::Element* b = s.b + (ring.stage * T::kBlockN + cluster.rank * b_rows) * T::kBlockK;
    const int b_row = n0 + cluster.rank * b_rows;
    if (cluster.size == 1) {
        SM90_TMA_LOAD_3D::copy(&p.b, full, hint, b, kb * T::kBlockK, b_row, work.tile.expert);
    } else {
        SM90_TMA_LOAD_MULTICAST_3D::copy(&p.b, full, everyone, hint, b, kb * T::kBlockK, b_row,
                                         work.tile.expert);
    }
}

// Producer warp: for every unit this block takes, wait for its rows
// (kDispatch), then load its k-blocks into the stages (load_stage_scales,
// load_stage_tiles).
template <class G, bool kDispatch>
__device__ __forceinline__ void produce(const MegaParams& p, typename Gemm<G>::Shared& s, int seq,
                                        const MegaBands& bands, int total_units,
                                        const Cluster& cluster, int lane) {
    using T = Gemm<G>;
    MegaLayout& l = s.layout;
    const int k_blocks = p.k / T::kBlockK;
    const int scale_cols = p.k / EP_MEGA_SCALE_BLOCK;
    Ring ring{0, 1};  // empty stages: the phase before the first counts as done
    unsigned taken = take_unit(p, cluster, lane);
    for (int ordinal = 0;; ++ordinal) {
        const int unit = read_unit<T::kMailbox>(s.mailbox, taken, ordinal, total_units, cluster, lane);
        if (unit == EP_MEGA_NO_UNIT) {
            produce_end<G>(s, ring, lane);
            break;
        }
        const MegaUnit u = ep_mega_unit(l, p.local_experts, unit, bands, cluster);
        const MegaWork work{unit, u, ep_mega_tile(p, l, u.m_tile)};
        const int n0 = u.n_tile * T::kBlockN;
        if constexpr (kDispatch) {
            wait_for_tile_rows(p, l, work.tile, u.m_tile, seq, lane);
            // The rows were written by generic stores; TMA reads them
            // through the async proxy.
            asm volatile("fence.proxy.async.global;" ::: "memory");
        }
        for (int kb = 0; kb < k_blocks; ++kb) {
            if (kb == max(k_blocks - EP_MEGA_TAKE_AHEAD, 0)) {
                taken = take_unit(p, cluster, lane);
            }
            cutlass::arch::ClusterBarrier::wait(&s.empty[ring.stage], ring.parity);
            if constexpr (G::kScaled) {
                load_stage_scales<G>(p, s, ring, work.tile, n0, kb, scale_cols, lane);
            }
            if (lane == 0) {
                load_stage_tiles<G>(p, s, ring, work, n0, kb, cluster);
            }
            __syncwarp();
            ring.advance<T::kStages>();
        }
    }
    // Tail: wait until every stage's last load has been released by the
    // consumers of every block of the cluster, so none of their (remote)
    // arrivals is still on its way when the blocks leave.
    for (int i = 0; i < T::kStages; ++i) {
        cutlass::arch::ClusterBarrier::wait(&s.empty[ring.stage], ring.parity);
        ring.advance<T::kStages>();
    }
}

// One consumer warp's release of a stage (every lane calls it): one arrival
// per warp on the stage of every block of the cluster, once all its lanes
// are done with it (its MMAs on the stage have completed).
__device__ __forceinline__ void release_stage(uint64_t* empty, int consumer,
                                              const Cluster& cluster) {
    __syncwarp();
    if (consumer % 32 != 0) {
        return;
    }
    if (cluster.size == 1) {
        cutlass::arch::ClusterBarrier::arrive(empty);
        return;
    }
    // Every block of the cluster may write the stage next: tell them all.
    for (int block = 0; block < cluster.size; ++block) {
        cutlass::arch::ClusterBarrier::arrive(empty, block, 1);
    }
}

// A consumer warpgroup whose 64 rows of a tile are all beyond the tile's
// real rows (a tile of 64 rows or fewer, as at decode) still takes every
// stage in turn, but only to release it: no MMAs.
template <class G>
__device__ __forceinline__ void mainloop_skip(typename Gemm<G>::Shared& s, Ring& ring,
                                              int k_blocks, int consumer, const Cluster& cluster) {
    for (int kb = 0; kb < k_blocks; ++kb) {
        cutlass::arch::ClusterBarrier::wait(&s.full[ring.stage], ring.parity);
        release_stage(&s.empty[ring.stage], consumer, cluster);
        ring.advance<Gemm<G>::kStages>();
    }
}

// BF16 mainloop of one tile: accumulate all k-blocks, one batch of MMAs
// in flight while the next stage is waited for.
template <class G, class Frag, class FragA, class FragB>
__device__ __forceinline__ void mainloop_bf16(typename Gemm<G>::Shared& s, Ring& ring,
                                              int k_blocks, Frag& accum, FragA& tCrA, FragB& tCrB,
                                              int consumer, const Cluster& cluster) {
    using T = Gemm<G>;
    typename T::TiledMma tiled_mma;
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    int in_flight = -1;
    for (int kb = 0; kb < k_blocks; ++kb) {
        cutlass::arch::ClusterBarrier::wait(&s.full[ring.stage], ring.parity);
        warpgroup_fence_operand(accum);
        warpgroup_arrive();
        CUTLASS_PRAGMA_UNROLL
        for (int ks = 0; ks < size<2>(tCrA); ++ks) {
            cute::gemm(tiled_mma, tCrA(_, _, ks, ring.stage), tCrB(_, _, ks, ring.stage), accum);
            tiled_mma.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
        warpgroup_wait<1>();
        warpgroup_fence_operand(accum);
        if (in_flight >= 0) {
            release_stage(&s.empty[in_flight], consumer, cluster);
        }
        in_flight = ring.stage;
        ring.advance<T::kStages>();
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(accum);
    if (in_flight >= 0) {
        release_stage(&s.empty[in_flight], consumer, cluster);
    }
}

// Whether the tile's column `col` (a multiple of 8, known at compile time
// once the promotion is unrolled) lies in the tile's second weight scale
// block; `first_aligns`: the tile's columns in its first block, counted in
// kScaleAlign (the tile starts a multiple of kScaleAlign into its block).
// Only a column between kScaleAlign and one scale block needs the runtime
// test, and every column of one kScaleAlign group gets the same one, so the
// promotion selects each group's scales once per k-block (a select, not an
// index into an array, which would put the scales in local memory).
template <class T>
__device__ __forceinline__ bool in_second_scale_block(int col, int first_aligns) {
    static_assert(T::kBScales <= 2, "an FP8 n-tile spans at most two weight scale blocks");
    if (T::kBScales == 1 || col < T::kScaleAlign) {
        return false;
    }
    return col >= EP_MEGA_SCALE_BLOCK || col / T::kScaleAlign >= first_aligns;
}

// FP8 mainloop of one tile (its first column n0): per k-block, the MMAs
// into `block` from zero, then total += (row scale * weight block scale) *
// block. A thread's accumulator fragment holds two rows: by the warpgroup
// MMA's accumulator layout, element i is in row `row1` when bit 1 of i is
// set, else in `row0`, and in the group of 8 columns starting at column
// 8 (i / 4) of the tile, all in one weight scale block.
template <class G, class TiledMma, class Frag, class FragA, class FragB, class Coords>
__device__ __forceinline__ void mainloop_fp8(typename Gemm<G>::Shared& s, Ring& ring, int k_blocks,
                                             int n0, Frag& total, Frag& block, FragA& tCrA,
                                             FragB& tCrB, const Coords& tCcC, int consumer,
                                             const Cluster& cluster) {
    using T = Gemm<G>;
    TiledMma tiled_mma;
    const int row0 = get<0>(tCcC(0));
    const int row1 = get<0>(tCcC(2));
    const int first_aligns = (EP_MEGA_SCALE_BLOCK - n0 % EP_MEGA_SCALE_BLOCK) / T::kScaleAlign;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(total); ++i) {
        total(i) = 0.0f;
    }
    for (int kb = 0; kb < k_blocks; ++kb) {
        cutlass::arch::ClusterBarrier::wait(&s.full[ring.stage], ring.parity);
        warpgroup_fence_operand(block);
        warpgroup_arrive();
        tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
        CUTLASS_PRAGMA_UNROLL
        for (int ks = 0; ks < size<2>(tCrA); ++ks) {
            cute::gemm(tiled_mma, tCrA(_, _, ks, ring.stage), tCrB(_, _, ks, ring.stage), block);
            tiled_mma.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
        // first[h], second[h]: the scales of row h of the thread with the
        // tile's first and second weight block, read while the MMAs run
        // (the stage is ours until release_stage).
        const float a_scale[2] = {s.a_scales[ring.stage][row0], s.a_scales[ring.stage][row1]};
        const float b_first = s.b_scales[ring.stage][0];
        const float b_second = s.b_scales[ring.stage][T::kBScales - 1];
        const float first[2] = {a_scale[0] * b_first, a_scale[1] * b_first};
        const float second[2] = {a_scale[0] * b_second, a_scale[1] * b_second};
        warpgroup_wait<0>();
        warpgroup_fence_operand(block);
        release_stage(&s.empty[ring.stage], consumer, cluster);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(total); ++i) {
            const int h = (i >> 1) & 1;
            const float scale =
                in_second_scale_block<T>(8 * (i / 4), first_aligns) ? second[h] : first[h];
            total(i) = fmaf(scale, block(i), total(i));
        }
        ring.advance<T::kStages>();
    }
}

// Stores the real rows and columns of a tile's accumulator as BF16 pairs
// (a thread's fragment holds column pairs (c, c + 1) of one row).
template <class Frag, class Coords>
__device__ __forceinline__ void store_tile(const MegaParams& p, const MegaTile& t, int n0,
                                           const Frag& accum, const Coords& tCcC) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accum); i += 2) {
        const int m = get<0>(tCcC(i));
        const int col = n0 + get<1>(tCcC(i));
        if (m < t.rows && col < p.n) {
            *reinterpret_cast<__nv_bfloat162*>(p.y + static_cast<int64_t>(t.first_row + m) * p.n +
                                               col) = __floats2bfloat162_rn(accum(i), accum(i + 1));
        }
    }
}

// One consumer warpgroup's named barrier (its 128 threads). The ids are
// immediates: with an id in a register ptxas reserves all 16 barriers.
__device__ __forceinline__ void warpgroup_sync(int warpgroup) {
    if (warpgroup == 0) {
        asm volatile("bar.sync %0, %1;" ::"n"(EP_MEGA_STORE_BARRIER), "n"(EP_MEGA_WARPGROUP)
                     : "memory");
    } else {
        asm volatile("bar.sync %0, %1;" ::"n"(EP_MEGA_STORE_BARRIER + 1), "n"(EP_MEGA_WARPGROUP)
                     : "memory");
    }
}

// Stores a consumer warpgroup's 64 rows of a tile, when all are real rows
// (else store_tile), with TMA, EP_MEGA_STORE_COLS columns at a time through
// the warpgroup's box in shared memory: the warpgroup writes its
// accumulators' columns as BF16 into the box, then one thread (`issuer`)
// stores it into y (the tensor map `c`, which clips the columns past n).
// The stores are asynchronous: the warpgroup goes on, and waits only before
// it writes the box again, until the TMA has read it. (Before, every thread
// stored its accumulators straight into y, 4 bytes at a time, half a
// 32-byte sector per row and instruction; the fused kernels with TMA stores
// are 3 to 9 % faster at W3 on 1 x H200: bench/RESULTS.md.)
//
// Where a value goes: by the warpgroup MMA's accumulator layout, thread t
// of the warpgroup (warp w, lane l) holds element i = 4 g + 2 h + e at row
// 16 w + l / 4 + 8 h of its 64 and column 8 g + 2 (l % 4) + e. A box is
// 128-byte swizzled, as the tensor map says: the 16-byte piece j of box
// row r lies at piece j ^ (r % 8), and r % 8 = l / 4; so the 8 rows one
// store instruction of a warp covers fall in different banks.
template <int kBlockN, class Frag>
__device__ __forceinline__ void store_rows_tma(const MegaParams& p, uint8_t* box,
                                               const MegaTile& t, int n0, int warpgroup,
                                               const Frag& accum, int thread) {
    static_assert(EP_MEGA_STORE_ROWS == EP_MEGA_WARPGROUP_ROWS, "a box holds a warpgroup's rows");
    static_assert(EP_MEGA_STORE_ROW_BYTES == 128, "a box row spans the 128-byte swizzle");
    static_assert(kBlockN % EP_MEGA_STORE_COLS == 0, "an n-tile is whole boxes");
    constexpr int kGroups = EP_MEGA_STORE_COLS / 8;  // 8-column groups per box
    const int lane = thread % 32;
    const int quad = lane / 4;
    const bool issuer = thread == 0;
    // This thread's first byte in the box, as a shared-memory address.
    const uint32_t mine = cute::cast_smem_ptr_to_uint(box) +
                          (16 * (thread / 32) + quad) * EP_MEGA_STORE_ROW_BYTES + 4 * (lane % 4);
    CUTLASS_PRAGMA_UNROLL
    for (int round = 0; round < kBlockN / EP_MEGA_STORE_COLS; ++round) {
        const int col0 = n0 + round * EP_MEGA_STORE_COLS;
        if (col0 >= p.n) {
            break;
        }
        // The box is free once the TMA has read its last contents.
        if (issuer) {
            tma_store_wait<0>();
        }
        warpgroup_sync(warpgroup);
        CUTLASS_PRAGMA_UNROLL
        for (int g = 0; g < kGroups; ++g) {
            CUTLASS_PRAGMA_UNROLL
            for (int h = 0; h < 2; ++h) {
                const int i = 4 * (round * kGroups + g) + 2 * h;
                const __nv_bfloat162 pair = __floats2bfloat162_rn(accum(i), accum(i + 1));
                asm volatile("st.shared.b32 [%0], %1;" ::"r"(mine + h * 8 * EP_MEGA_STORE_ROW_BYTES +
                                                             (g ^ quad) * 16),
                             "r"(*reinterpret_cast<const uint32_t*>(&pair))
                             : "memory");
            }
        }
        // Release to the TMA: the box's generic stores before its
        // (async-proxy) reads, then the warpgroup meets.
        cutlass::arch::fence_view_async_shared();
        warpgroup_sync(warpgroup);
        if (issuer) {
            SM90_TMA_STORE_2D::copy(&p.c, box, col0,
                                    t.first_row + warpgroup * EP_MEGA_WARPGROUP_ROWS);
            tma_store_arrive();  // the round's bulk group
        }
    }
}

// The thread that issued a warpgroup's TMA stores of y: waits until they
// have written y, then orders their (async-proxy) writes before its later
// generic accesses, such as a release that publishes them.
__device__ __forceinline__ void wait_for_own_tma_stores() {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
}

// A consumer warpgroup has stored its `units` units of band `band` (all of
// them: units are taken band by band): once its TMA stores have written y,
// it counts them in band_count[band], for the communication warps
// (ep_mega_send_early_bands). `thread`: in the warpgroup; thread 0 issued
// its TMA stores.
__device__ __forceinline__ void publish_band(const MegaParams& p, int band, int units,
                                             int warpgroup, int thread) {
    if (thread == 0) {
        wait_for_own_tma_stores();
    }
    // Release, part 1: every thread's own stores of y (store_tile) are
    // fenced at GPU scope before the warpgroup meets, so thread 0's add
    // publishes them.
    __threadfence();
    warpgroup_sync(warpgroup);
    if (thread == 0) {
        // Release, part 2.
        ep_mega_count(p.band_count + band, units);
    }
}

// The work of the stage at `ring` (waiting for the stage to be full; the
// mainloop's wait for it then passes at once); a stage of unit
// EP_MEGA_NO_UNIT is released here.
template <class G>
__device__ __forceinline__ MegaWork consumed_work(typename Gemm<G>::Shared& s, Ring& ring,
                                                  int consumer, const Cluster& cluster) {
    cutlass::arch::ClusterBarrier::wait(&s.full[ring.stage], ring.parity);
    const MegaWork work = s.work[ring.stage];
    if (work.unit == EP_MEGA_NO_UNIT) {
        release_stage(&s.empty[ring.stage], consumer, cluster);
        ring.advance<Gemm<G>::kStages>();
    }
    return work;
}

// Stores a consumer warpgroup's rows of a tile's accumulator (`kBlockN`
// columns from n0): with TMA when all its rows are real, else from its
// registers.
template <int kBlockN, class Frag, class Coords>
__device__ __forceinline__ void store_unit(const MegaParams& p, uint8_t* box, const MegaTile& t,
                                           int n0, int warpgroup, const Frag& accum,
                                           const Coords& tCcC, int thread) {
    if (t.rows >= (warpgroup + 1) * EP_MEGA_WARPGROUP_ROWS) {
        store_rows_tma<kBlockN>(p, box, t, n0, warpgroup, accum, thread);
    } else {
        store_tile(p, t, n0, accum, tCcC);
    }
}

// A consumer warpgroup's MMAs and epilogue of a unit whose n-tile has at
// most G::kNarrowN real columns (Fp8Gemm): the MMAs read only the first
// kNarrowN rows of each stage's weight tile.
template <class G>
__device__ __forceinline__ void consume_narrow(const MegaParams& p, typename Gemm<G>::Shared& s,
                                               Ring& ring, int k_blocks, const MegaTile& t, int n0,
                                               const Cluster& cluster, int consumer) {
    using T = Gemm<G>;
    using Narrow = Int<G::kNarrowN>;
    typename T::NarrowMma tiled_mma;
    Tensor sA = make_tensor(make_smem_ptr(s.a), typename T::SmemLayoutA{});
    // (kNarrowN, kBlockK, stage): the first rows of every stage's tile.
    Tensor sB = flat_divide(make_tensor(make_smem_ptr(s.b), typename T::SmemLayoutB{}),
                            Shape<Narrow>{})(_, 0, _, _);
    const int warpgroup = consumer / EP_MEGA_WARPGROUP;
    auto wg_mma = tiled_mma.get_slice(warpgroup * EP_MEGA_WARPGROUP);
    Tensor tCrA = wg_mma.make_fragment_A(wg_mma.partition_A(sA));
    Tensor tCrB = wg_mma.make_fragment_B(wg_mma.partition_B(sB));
    Tensor tCcC = tiled_mma.get_thread_slice(consumer).partition_C(
        make_identity_tensor(make_shape(Int<T::kBlockM>{}, Narrow{})));
    Tensor total = partition_fragment_C(tiled_mma, make_shape(Int<T::kBlockM>{}, Narrow{}));
    Tensor block = partition_fragment_C(tiled_mma, make_shape(Int<T::kBlockM>{}, Narrow{}));
    mainloop_fp8<G, typename T::NarrowMma>(s, ring, k_blocks, n0, total, block, tCrA, tCrB, tCcC,
                                           consumer, cluster);
    store_unit<G::kNarrowN>(p, s.store[warpgroup], t, n0, warpgroup, total, tCcC,
                            consumer % EP_MEGA_WARPGROUP);
}

// Consumer warpgroups: the MMAs and the epilogue of every unit of this block.
template <class G>
__device__ __forceinline__ void consume(const MegaParams& p, typename Gemm<G>::Shared& s,
                                        const Cluster& cluster, int consumer) {
    using T = Gemm<G>;
    typename T::TiledMma tiled_mma;
    Tensor sA = make_tensor(make_smem_ptr(s.a), typename T::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(s.b), typename T::SmemLayoutB{});
    // A and B descriptors are per warpgroup; C fragments per thread.
    const int warpgroup = consumer / EP_MEGA_WARPGROUP;
    auto wg_mma = tiled_mma.get_slice(warpgroup * EP_MEGA_WARPGROUP);
    Tensor tCrA = wg_mma.make_fragment_A(wg_mma.partition_A(sA));  // (MMA, M, K, PIPE)
    Tensor tCrB = wg_mma.make_fragment_B(wg_mma.partition_B(sB));  // (MMA, N, K, PIPE)
    auto thread_mma = tiled_mma.get_thread_slice(consumer);
    Tensor tCcC = thread_mma.partition_C(
        make_identity_tensor(make_shape(Int<T::kBlockM>{}, Int<T::kBlockN>{})));
    Tensor accum = partition_fragment_C(tiled_mma, make_shape(Int<T::kBlockM>{}, Int<T::kBlockN>{}));
    const int k_blocks = p.k / T::kBlockK;
    const int thread = consumer % EP_MEGA_WARPGROUP;
    // The band of the units stored since the last publish_band (each unit
    // brings its band, MegaWork), and how many. The last band is published
    // with the whole GEMM (ep_mega_combine).
    int band = 0;
    int band_units = 0;
    Ring ring{0, 0};
    for (;;) {
        const MegaWork work = consumed_work<G>(s, ring, consumer, cluster);
        if (work.unit == EP_MEGA_NO_UNIT) {
            break;
        }
        const MegaUnit& u = work.place;
        const MegaTile& t = work.tile;
        if (u.band != band) {
            if (band_units > 0) {
                publish_band(p, band, band_units, warpgroup, thread);
            }
            band = u.band;
            band_units = 0;
        }
        ++band_units;
        const int n0 = u.n_tile * T::kBlockN;
        if (t.rows <= warpgroup * EP_MEGA_WARPGROUP_ROWS) {
            mainloop_skip<G>(s, ring, k_blocks, consumer, cluster);
            continue;
        }
        if constexpr (G::kNarrowN > 0) {
            if (p.n - n0 <= G::kNarrowN) {
                consume_narrow<G>(p, s, ring, k_blocks, t, n0, cluster, consumer);
                continue;
            }
        }
        if constexpr (G::kScaled) {
            Tensor block = partition_fragment_C(
                tiled_mma, make_shape(Int<T::kBlockM>{}, Int<T::kBlockN>{}));
            mainloop_fp8<G, typename T::TiledMma>(s, ring, k_blocks, n0, accum, block, tCrA, tCrB,
                                                  tCcC, consumer, cluster);
        } else {
            mainloop_bf16<G>(s, ring, k_blocks, accum, tCrA, tCrB, consumer, cluster);
        }
        store_unit<T::kBlockN>(p, s.store[warpgroup], t, n0, warpgroup, accum, tCcC, thread);
    }
    if (band_units > 0 && band + 1 < ep_mega_bands(p, T::kBlockN).count) {
        publish_band(p, band, band_units, warpgroup, thread);
    }
    if (thread == 0) {
        // Every TMA store of the warpgroup has written y (and its box may
        // go) before the block counts its tiles as stored (ep_mega_combine)
        // or ends.
        wait_for_own_tma_stores();
    }
}

// The FP8 kernels' return to even register budgets after the GEMM
// (EP_MEGA_EVEN_REGS, for a combine's rows): the consumers give registers
// back and arrive at a named barrier; the producer warpgroup waits there
// (a hardware barrier: a waiting warp issues nothing), then takes them.
// Without the barrier the producer warpgroup's increase, which finds the
// registers still taken, retried in a loop from the end of its loads (its
// communication warps: from the end of their row moves) until the
// consumers' last tile: at W3 that loop was 41 % of the dispatch+GEMM
// kernel's issued instructions, on the schedulers of the consumer warps
// (ncu, bench/RESULTS.md).
__device__ __forceinline__ void even_registers(bool producer_group) {
    if (producer_group) {
        asm volatile("bar.sync %0, %1;" ::"n"(EP_MEGA_REGISTERS_BARRIER), "n"(EP_MEGA_THREADS)
                     : "memory");
        cutlass::arch::warpgroup_reg_alloc<EP_MEGA_EVEN_REGS>();
    } else {
        cutlass::arch::warpgroup_reg_dealloc<EP_MEGA_EVEN_REGS>();
        asm volatile("bar.arrive %0, %1;" ::"n"(EP_MEGA_REGISTERS_BARRIER), "n"(EP_MEGA_THREADS)
                     : "memory");
    }
}

// Thread 0, at the block's start: the stages' barriers (a full stage waits
// for the producer's arrival, FP8 also for its lanes' scale copies; an
// empty one for every consumer warp of the cluster) and an empty mailbox.
template <class G, int kCluster>
__device__ __forceinline__ void init_stages(typename Gemm<G>::Shared& s) {
    using T = Gemm<G>;
    if (threadIdx.x == 0) {
        for (int i = 0; i < T::kStages; ++i) {
            cutlass::arch::ClusterBarrier::init(&s.full[i], T::kFullArrivals);
            cutlass::arch::ClusterBarrier::init(&s.empty[i], T::kConsumerWarps * kCluster);
        }
        // Shared memory holds what an earlier kernel left: no post of this
        // call before block 0 makes it (the cluster meets first, in run).
        for (int i = 0; i < T::kMailbox; ++i) {
            s.mailbox[i] = 0;
        }
        cutlass::arch::fence_barrier_init();
    }
}

// Thread 0, once its block is done: the last block to finish zeroes the
// call's counts (every block has taken its last unit and passed its last
// wait) and publishes this call's sequence number.
template <bool kDispatch>
__device__ __forceinline__ void finish_call(const MegaParams& p, int seq) {
    if (threadIdx.x == 0 && ep_last_block_to_arrive(p.state + 1)) {
        p.state[2] = 0;
        if constexpr (!kDispatch) {
            *p.gemm_count = 0;
            for (int band = 0; band < EP_MEGA_MAX_BANDS; ++band) {
                p.band_count[band] = 0;
            }
        }
        p.state[0] = seq;
    }
}

// The whole fused kernel for one GEMM type and one mode (kMode: the
// dispatch + GEMM, or the GEMM + combine), launched in clusters of
// `kCluster` blocks (1, or 2 that share each weight tile). A kernel per
// mode: each holds only its own mode's code, so that a change to one
// mode's communication does not move the other's GEMM in the machine code
// (a larger combine send once made the FP8 dispatch + GEMM 5 % slower,
// bench/RESULTS.md).
template <class G, int kCluster, int kMode>
__device__ __forceinline__ void run(const MegaParams& p) {
    using T = Gemm<G>;
    extern __shared__ uint8_t smem_raw[];
    // The swizzled stages need EP_MEGA_SHARED_ALIGN; the launch leaves the slack.
    // An offset from the shared array, not an address rounded as an integer:
    // so the compiler knows `s` is shared memory and reads its scales and
    // units with shared-memory loads, not generic ones.
    const uint32_t misalignment = cute::cast_smem_ptr_to_uint(smem_raw) % EP_MEGA_SHARED_ALIGN;
    auto& s = *reinterpret_cast<typename T::Shared*>(
        smem_raw + (EP_MEGA_SHARED_ALIGN - misalignment) % EP_MEGA_SHARED_ALIGN);
    MegaLayout& l = s.layout;
    static_assert(sizeof(typename T::Shared) + EP_MEGA_SHARED_ALIGN <= EP_MEGA_MAX_SHARED_BYTES,
                  "the stages do not fit the shared memory of an SM");
    constexpr bool dispatch = kMode == EP_MEGA_MODE_DISPATCH;
    if (p.mode != kMode) {
        ep_mega_unsupported(p);
        return;
    }
    const uint64_t own_base =
        dispatch ? p.dispatch.peer_bases[p.dispatch.rank] : p.combine.peer_bases[p.combine.rank];
    // A fused combine is its call's first kernel: it starts the collective
    // call (ep_device.cuh, "Collective calls"); the barriers after it carry
    // its word. (A fused dispatch's count kernel did.)
    if (!dispatch && blockIdx.x == 0 && threadIdx.x == 0) {
        ep_begin_collective(own_base, p.combine.collective);
    }
    uint32_t shared_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(shared_bytes));
    if (shared_bytes < sizeof(typename T::Shared) + EP_MEGA_SHARED_ALIGN) {
        ep_mega_unsupported(p);
        return;
    }
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int seq = p.state[0] + 1;
    const Cluster cluster{kCluster, kCluster > 1 ? static_cast<int>(block_rank_in_cluster()) : 0};

    init_stages<G, kCluster>(s);
    ep_mega_load_layout(p, l, ep_last_barrier_passed(own_base),
                        dispatch ? EP_PHASE_DISPATCH : EP_PHASE_COMBINE, kCluster, seq);
    if constexpr (kCluster > 1) {
        // The partner's barriers and mailbox are initialised before anything
        // lands there.
        cluster_sync();
    }
    // A dispatch's units in one band (its MegaParams::bands is 1).
    const MegaBands bands = ep_mega_bands(p, T::kBlockN);
    const int total_units =
        l.usable ? l.tile_start[p.local_experts] / kCluster * bands.n_tiles : 0;

    // The GEMM, and beside it a dispatch's row moves or a combine's sends
    // of the bands before the last.
    const bool producer_group = threadIdx.x < EP_MEGA_WARPGROUP;
    if constexpr (G::kScaled) {
        if (producer_group) {
            cutlass::arch::warpgroup_reg_dealloc<EP_MEGA_PRODUCER_REGS>();
        } else {
            cutlass::arch::warpgroup_reg_alloc<EP_MEGA_CONSUMER_REGS>();
        }
    }
    if (producer_group) {
        if (warp == 0) {
            produce<G, dispatch>(p, s, seq, bands, total_units, cluster, lane);
        } else if (dispatch && l.usable) {
            const int comm_warp = warp - 1;
            constexpr int unroll = G::kScaled ? EP_MEGA_FP8_COPY_UNROLL : EP_COPY_UNROLL;
            ep_mega_move_rows<unroll>(p, l, seq, blockIdx.x * EP_MEGA_COMM_WARPS + comm_warp,
                                      gridDim.x * EP_MEGA_COMM_WARPS, lane);
        } else if (l.usable) {
            constexpr int unroll = G::kScaled ? EP_MEGA_FP8_SEND_UNROLL : EP_SUM_UNROLL;
            ep_mega_send_early_bands<unroll>(p, l, bands, kCluster, warp - 1, lane);
        }
    } else {
        consume<G>(p, s, cluster, threadIdx.x - EP_MEGA_WARPGROUP);
    }
    if constexpr (G::kScaled) {
        even_registers(producer_group);
    }
    // A combine's rows, once every block's GEMM is stored.
    if (!dispatch) {
        ep_mega_combine(p, l, bands, warp, lane);
    }

    // No block leaves while its partner may still arrive on its barriers.
    if constexpr (kCluster > 1) {
        cluster_sync();
    } else {
        __syncthreads();
    }
    finish_call<dispatch>(p, seq);
}

}  // namespace ep_mega

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// grid = at most one block per SM (a multiple of the cluster size, at most
// the clusters that fit at once), EP_MEGA_THREADS threads, dynamic shared
// memory: the device's maximum (at least sizeof(Gemm<G>::Shared) +
// EP_MEGA_SHARED_ALIGN). A kernel per GEMM type and mode:
// ep_mega_{bf16,fp8}_{dispatch,combine}_kernel, and the *_pair kernels,
// which run in clusters of 2 blocks that share weight tiles.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define EP_MEGA_RUN(G, CLUSTER, MODE) ep_mega::run<ep_mega::G, CLUSTER, MODE>(p)
#else
#define EP_MEGA_RUN(G, CLUSTER, MODE) ep_mega_unsupported(p)
#endif

extern "C" __global__ void __launch_bounds__(EP_MEGA_THREADS, 1)
    ep_mega_bf16_dispatch_kernel(const __grid_constant__ MegaParams p) {
    ep_kernel_start();
    EP_MEGA_RUN(Bf16Gemm, 1, EP_MEGA_MODE_DISPATCH);
}

extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(EP_MEGA_THREADS, 1)
    ep_mega_bf16_dispatch_pair_kernel(const __grid_constant__ MegaParams p) {
    ep_kernel_start();
    EP_MEGA_RUN(Bf16Gemm, 2, EP_MEGA_MODE_DISPATCH);
}

extern "C" __global__ void __launch_bounds__(EP_MEGA_THREADS, 1)
    ep_mega_bf16_combine_kernel(const __grid_constant__ MegaParams p) {
    ep_kernel_start();
    EP_MEGA_RUN(Bf16Gemm, 1, EP_MEGA_MODE_COMBINE);
}

extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(EP_MEGA_THREADS, 1)
    ep_mega_bf16_combine_pair_kernel(const __grid_constant__ MegaParams p) {
    ep_kernel_start();
    EP_MEGA_RUN(Bf16Gemm, 2, EP_MEGA_MODE_COMBINE);
}

extern "C" __global__ void __launch_bounds__(EP_MEGA_THREADS, 1)
    ep_mega_fp8_dispatch_kernel(const __grid_constant__ MegaParams p) {
    ep_kernel_start();
    EP_MEGA_RUN(Fp8Gemm, 1, EP_MEGA_MODE_DISPATCH);
}

extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(EP_MEGA_THREADS, 1)
    ep_mega_fp8_dispatch_pair_kernel(const __grid_constant__ MegaParams p) {
    ep_kernel_start();
    EP_MEGA_RUN(Fp8Gemm, 2, EP_MEGA_MODE_DISPATCH);
}

extern "C" __global__ void __launch_bounds__(EP_MEGA_THREADS, 1)
    ep_mega_fp8_combine_kernel(const __grid_constant__ MegaParams p) {
    ep_kernel_start();
    EP_MEGA_RUN(Fp8Gemm, 1, EP_MEGA_MODE_COMBINE);
}

extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(EP_MEGA_THREADS, 1)
    ep_mega_fp8_combine_pair_kernel(const __grid_constant__ MegaParams p) {
    ep_kernel_start();
    EP_MEGA_RUN(Fp8Gemm, 2, EP_MEGA_MODE_COMBINE);
}
