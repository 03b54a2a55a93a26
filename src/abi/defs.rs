// Every struct and constant that the runtime and the kernels share, defined
// once. `build.rs` turns this file into `ep_abi.h` (in the build's output
// directory), which every kernel includes; the header's static_asserts make
// a kernel that disagrees with these layouts fail to compile. Included by
// `src/abi/mod.rs` and by `build.rs`: items only, no `crate::` paths.
//
// Device pointers are `u64` here and name their C type (`=> "const int*"`);
// a 0 means "not given" wherever the kernels accept an optional pointer.

abi_consts! {
    /// Largest `topk` (mirrors the public `EP_MAX_TOPK`).
    MAX_TOPK: usize = 16;
    /// Largest number of experts (mirrors the public `EP_MAX_EXPERTS`).
    MAX_EXPERTS: usize = 1024;
    /// Largest world size (mirrors the public `EP_MAX_WORLD_SIZE`).
    MAX_WORLD_SIZE: usize = 64;
    /// Largest low-latency batch (mirrors the public `EP_LL_MAX_TOKENS`).
    LL_MAX_TOKENS: usize = 1024;
    /// Largest hidden size (mirrors the public `EP_MAX_HIDDEN`).
    MAX_HIDDEN: usize = 16384;
    /// Hidden sizes and FP8 scaling blocks are multiples of this (mirrors
    /// the public `EP_HIDDEN_ALIGNMENT`).
    HIDDEN_ALIGNMENT: usize = 128;
    /// Largest finite FP8 E4M3 magnitude (src/reference/fp8.rs).
    E4M3_MAX: f32 = 448.0;
    /// Lower bound on an FP8 block's absolute maximum, so all-zero blocks
    /// get a finite scale (src/reference/fp8.rs).
    AMAX_FLOOR: f32 = 1e-4;

    /// Every rank's symmetric buffer starts with the barrier's `[world]`
    /// 64-bit signal slots (epoch in the low half, the signalling rank's
    /// call word in the high half); at this offset follow the rank's own
    /// two barrier words: barriers entered, then the last barrier passed.
    BARRIER_COUNTER_OFFSET: usize = MAX_WORLD_SIZE * 8;
    /// Then the rank's two call words: the collective calls it has started
    /// on the device, then the call word of the call it is in, which peers
    /// read to tell a slow rank from one in another call.
    CALL_WORDS_OFFSET: usize = BARRIER_COUNTER_OFFSET + 8;
    /// Then the normal mode's open-exchange word: the kind
    /// (`EXCHANGE_DISPATCH` or `EXCHANGE_COMBINE`) of its last exchange
    /// whose closing barrier has not run, or `EXCHANGE_NONE`
    /// (src/runtime/gpu/normal.rs, `Exchange`).
    OPEN_EXCHANGE_OFFSET: usize = CALL_WORDS_OFFSET + 8;
    /// Normal-mode exchanges, for the open-exchange word: none open.
    EXCHANGE_NONE: i32 = 0;
    /// A dispatch (or the dispatch of a fused call) is open.
    EXCHANGE_DISPATCH: i32 = 1;
    /// A combine (or the combine of a fused call) is open.
    EXCHANGE_COMBINE: i32 = 2;
    /// Barrier roles (`BarrierParams::role`): a barrier of its own,
    BARRIER_PLAIN: i32 = 0;
    /// the middle barrier of an exchange, which leaves it open,
    BARRIER_MIDDLE: i32 = 1;
    /// the closing barrier of an open exchange of kind
    /// `BarrierParams::exchange`, which does nothing when none is open.
    BARRIER_CLOSING: i32 = 2;
    /// A call word is `op << CALL_NUMBER_BITS | number mod 2^CALL_NUMBER_BITS`:
    /// the operation's code (`Collective` of src/runtime/sequence.rs) and
    /// the call number counted on the device (so CUDA-graph replays count).
    CALL_NUMBER_BITS: u32 = 24;
    /// Threads of the barrier kernel's one block: one per possible rank.
    BARRIER_THREADS: usize = MAX_WORLD_SIZE;
    /// Threads per block of the layout kernel.
    LAYOUT_THREADS: usize = 256;

    /// Normal mode: tokens (= threads) per block of the count and stage
    /// kernels.
    CHUNK_TOKENS: usize = 256;
    /// Normal mode: words of the count kernel's `chunk_sync` before its
    /// per-chunk ready flags (kernels/normal.cu, "Dispatch 1").
    CHUNK_SYNC_HEADER: usize = 1;
    /// Normal mode: rows of `world + experts` ints in the count kernel's
    /// dynamic shared memory: a row per warp (`CHUNK_TOKENS / 32`), the
    /// chunk's bases, the chunk's own counts (kernels/normal.cu,
    /// "Dispatch 1").
    COUNT_SHARED_ROWS: usize = CHUNK_TOKENS / 32 + 2;
    /// Normal mode: threads per block of the pull, send and reduce kernels.
    MOVE_THREADS: usize = 512;

    /// Low-latency mode: threads per block of both kernels.
    LL_THREADS: usize = 512;
    /// Low-latency dispatch message header: per slot of up to `MAX_TOPK`,
    /// the route (int), then per slot the weight (float).
    LL_HEADER_BYTES: usize = MAX_TOPK * 8;
    /// Low-latency combine: channels of a return-row chunk, each chunk with
    /// its own arrival tag (64 vectors of 8 BF16 values).
    LL_CHUNK_CHANNELS: usize = 512;
    /// Low-latency mode across nodes: rows of `world` network signals each
    /// rank owns (kernels/low_latency.cu, "Across nodes"); signal
    /// `row * world + peer`. Dispatch counts and dispatch tokens, and the
    /// combine's return chunks, have a row per buffer set (row + set); the
    /// acknowledgements one row each.
    LL_SIGNAL_DISPATCH_COUNTS: i32 = 0;
    LL_SIGNAL_DISPATCH_TOKENS: i32 = 2;
    LL_SIGNAL_COMBINE: i32 = 4;
    LL_SIGNAL_DISPATCH_ACK: i32 = 6;
    LL_SIGNAL_COMBINE_ACK: i32 = 7;
    LL_SIGNAL_ROWS: usize = 8;
    /// Low-latency mode across nodes: what the puts of one call from one
    /// rank to another add to a data signal in all (each put adds 1, a
    /// closing signal the rest), so a call's data has all arrived when the
    /// signal reaches `calls * LL_NET_CALL_UNIT`. Above the most puts of a
    /// call: `LL_MAX_TOKENS * MAX_TOPK * MAX_HIDDEN / LL_CHUNK_CHANNELS`.
    LL_NET_CALL_UNIT: i32 = 1 << 20;
    /// Low-latency mode, device timestamps (ep-bench's per-phase
    /// breakdown): the points of a launch at which thread 0 of each block
    /// notes the global timer (ns) in `LlParams::timeline`, `[blocks,
    /// LL_TIME_POINTS]`; 0 where a launch has no such point. The block
    /// started; its call was numbered (begin_call); the peers had
    /// acknowledged the set (send); the counts and flags were out (dispatch)
    /// or the closing signals (combine); the send phase ended; every
    /// source's counts were in (dispatch receive); the receive phase ended.
    LL_TIME_START: usize = 0;
    LL_TIME_NUMBERED: usize = 1;
    LL_TIME_ACKED: usize = 2;
    LL_TIME_ANNOUNCED: usize = 3;
    LL_TIME_SENT: usize = 4;
    LL_TIME_COUNTS_IN: usize = 5;
    LL_TIME_RECEIVED: usize = 6;
    LL_TIME_POINTS: usize = 7;

    /// Fused kernels: threads of a block (3 warpgroups: the producer and
    /// communication warps, then two consumer warpgroups).
    MEGA_THREADS: usize = 384;
    /// Fused kernels: rows of an m-tile (one expert's).
    MEGA_BLOCK_M: usize = 128;
    /// Fused BF16 kernel: columns of an n-tile, and of k per stage.
    MEGA_BF16_BLOCK_N: usize = 256;
    MEGA_BF16_BLOCK_K: usize = 64;
    /// Fused FP8 kernel: columns of an n-tile (which spans at most two
    /// weight scale blocks), and of k per stage (one scale block).
    MEGA_FP8_BLOCK_N: usize = 192;
    MEGA_FP8_BLOCK_K: usize = 128;
    /// Fused BF16 kernel: rows of one TMA load of a tile's A rows. A stage
    /// gets as many boxes as cover the tile's real rows, so a decode tile
    /// of 32 rows reads 32 rows of A, not 128 (the MMAs read the rest of
    /// the stage as they find it: those rows' results are never stored).
    /// The FP8 kernel loads a whole m-tile in one box: there four boxes
    /// made the W3 calls 20-25 % slower (its producer warp, whose stage
    /// loads any added instruction delayed, is on the critical path;
    /// bench/RESULTS.md).
    MEGA_BF16_A_BOX_ROWS: usize = 32;
    MEGA_FP8_A_BOX_ROWS: usize = 128;
    /// Fused kernels: the box in which a consumer warpgroup stores its
    /// rows of a tile with TMA: 64 BF16 columns (128 bytes, the swizzle's
    /// span) by the warpgroup's 64 rows.
    MEGA_STORE_COLS: usize = 64;
    MEGA_STORE_ROWS: usize = 64;
    /// `MegaParams::mode`: dispatch + GEMM.
    MEGA_MODE_DISPATCH: i32 = 0;
    /// `MegaParams::mode`: GEMM + combine.
    MEGA_MODE_COMBINE: i32 = 1;
    /// Fused GEMM + combine: the most column bands (`MegaParams::bands`)
    /// a call's n-tiles are split into; the communication warps send the
    /// rows of a band while the GEMM computes the bands after it.
    MEGA_MAX_BANDS: usize = 8;

    /// `ep_moe_forward`'s activation kernel (kernels/moe.cu): threads of a
    /// block (a warp per expert-major row), and blocks per streaming
    /// multiprocessor of the call's budget.
    MOE_THREADS: usize = 256;
    MOE_BLOCKS_PER_SM: usize = 4;

    /// Hierarchical mode: bytes of the header a source stages per token and
    /// puts to the gateway of every remote destination node (ints):
    /// `[HIER_HDR_EXPERTS + k]` effective expert of slot k (-1 if none),
    /// `[HIER_HDR_WEIGHTS + k]` its weight (float bits), `[HIER_HDR_SLOTS +
    /// k]` the pair's position among the source's pairs of that expert,
    /// `[HIER_HDR_RANKS + r]` the token's position among the source's
    /// tokens for rank r or -1, `[HIER_HDR_CALL]` the dispatch call that
    /// wrote it.
    HIER_HEADER_BYTES: usize = 512;
    HIER_HDR_EXPERTS: usize = 0;
    HIER_HDR_WEIGHTS: usize = MAX_TOPK;
    HIER_HDR_SLOTS: usize = 2 * MAX_TOPK;
    HIER_HDR_RANKS: usize = 3 * MAX_TOPK;
    HIER_HDR_CALL: usize = 3 * MAX_TOPK + MAX_WORLD_SIZE;
    /// Hierarchical mode: kinds of network signal; each rank has one
    /// signal per (kind, source node), id `kind * nodes + node`.
    HIER_SIGNAL_DISPATCH: i32 = 0;
    HIER_SIGNAL_COMBINE: i32 = 1;
    HIER_SIGNAL_BARRIER: i32 = 2;
    HIER_SIGNAL_KINDS: usize = 3;
    /// Hierarchical mode: the call counters of its kernels, each a pair
    /// (calls so far, blocks of the running launch that read it), ints in
    /// the rank's own area.
    HIER_COUNTER_SEND: usize = 0;
    HIER_COUNTER_FORWARD: usize = 2;
    HIER_COUNTER_WAIT: usize = 4;
    HIER_COUNTER_BARRIER: usize = 6;
    /// Blocks of the running send and node-reduce launches that finished
    /// their puts (the last one signals).
    HIER_COUNTER_SEND_DONE: usize = 8;
    HIER_COUNTER_REDUCE_DONE: usize = 9;
    HIER_COUNTER_INTS: usize = 10;
    /// Hierarchical mode: bytes reserved for an `ncclDevComm` (NCCL
    /// 2.28.9's is 200; the kernels check).
    NCCL_DEV_COMM_BYTES: usize = 512;

    /// `DeviceStatus::code`: no error.
    STATUS_OK: i32 = 0;
    /// A bounded wait passed its deadline.
    STATUS_TIMEOUT: i32 = 1;
    /// The host raised the abort flag while a kernel waited.
    STATUS_ABORTED: i32 = 2;
    /// An expert id outside [-1, num_experts), or listed twice by one token.
    STATUS_INVALID_EXPERT: i32 = 3;
    /// A kernel was launched with arguments it cannot work with.
    STATUS_INVALID_ARGUMENT: i32 = 4;
    /// A low-latency kernel read a device token count outside [0, num_tokens].
    STATUS_INVALID_TOKEN_COUNT: i32 = 5;
    /// A peer is in another collective call than this rank (another
    /// operation under the same call number, or a later call): the ranks'
    /// calls do not match.
    STATUS_MISMATCH: i32 = 6;

    /// `DeviceStatus::phase`: which kernel recorded the error.
    PHASE_LAYOUT: i32 = 1;
    PHASE_BARRIER: i32 = 2;
    PHASE_DISPATCH: i32 = 3;
    PHASE_COMBINE: i32 = 4;
    PHASE_LL_DISPATCH: i32 = 5;
    PHASE_LL_COMBINE: i32 = 6;
    PHASE_HIER_DISPATCH: i32 = 7;
    PHASE_HIER_COMBINE: i32 = 8;
    PHASE_HIER_BARRIER: i32 = 9;
    PHASE_MOE_ACTIVATION: i32 = 10;
}

abi_struct! {
    /// The first error a rank's kernels hit. It lives in host-mapped memory,
    /// one per rank, zeroed by the host. `code` is claimed with an atomicCAS
    /// from STATUS_OK, and only the thread that wins writes the other
    /// fields: read them after the stream has synchronized.
    pub struct DeviceStatus as "EpDeviceStatus" {
        /// `STATUS_*`.
        code: i32,
        /// The rank a failed wait was waiting for; -1 if none.
        rank: i32,
        /// `PHASE_*`.
        phase: i32,
        /// Timeout or abort: the last value seen. Invalid expert: the flat
        /// index `token * topk + slot`. Invalid token count: the count.
        /// Invalid argument: 0 or the bad value. Mismatch: the peer's call
        /// word.
        detail: i32,
        /// Mismatch, timeout or abort: this rank's call word (see
        /// `CALL_NUMBER_BITS`); else 0.
        call: i32,
        /// Timeout or abort: the value the wait was for; else 0.
        awaited: i32,
    }
}

abi_struct! {
    /// The barrier kernel's parameters (kernels/barrier.cu).
    pub struct BarrierParams {
        /// `[world]` address, valid on this GPU, of every rank's signal
        /// slots (the start of its symmetric buffer).
        peer_signals: u64 => "uint64_t* const*",
        /// This rank's two barrier words: `BARRIER_COUNTER_OFFSET` into
        /// its buffer, the one `peer_signals[rank]` names (the kernel
        /// finds the buffer's call words from this address).
        epoch_counter: u64 => "int*",
        /// This rank's open-exchange word (`OPEN_EXCHANGE_OFFSET`).
        open_exchange: u64 => "int*",
        abort_flag: u64 => "const int*",
        status: u64 => "EpDeviceStatus*",
        timeout_ns: u64,
        rank: i32,
        world: i32,
        /// `BARRIER_PLAIN`, `BARRIER_MIDDLE` or `BARRIER_CLOSING`.
        role: i32,
        /// With `BARRIER_MIDDLE` or `BARRIER_CLOSING`: the exchange's kind
        /// (`EXCHANGE_DISPATCH` or `EXCHANGE_COMBINE`).
        exchange: i32,
    }
}

abi_struct! {
    /// The layout kernel's parameters (kernels/layout.cu).
    pub struct LayoutParams {
        /// `[num_tokens, topk]` global expert ids.
        topk_idx: u64 => "const int*",
        /// `[world]` output.
        tokens_per_rank: u64 => "int*",
        /// `[num_experts]` output.
        tokens_per_expert: u64 => "int*",
        /// `[num_tokens, world]` output.
        is_token_in_rank: u64 => "uint8_t*",
        status: u64 => "EpDeviceStatus*",
        num_tokens: i32,
        topk: i32,
        num_experts: i32,
        world: i32,
    }
}

abi_struct! {
    /// Where the normal mode's arrays are in every rank's buffer: the mode's
    /// area starts `area` bytes into the buffer, and each `off_*` is bytes
    /// into the area (src/runtime/gpu/normal.rs has the layout). Shared by
    /// the dispatch, combine and hierarchical kernels' parameters.
    pub struct NormalOffsets {
        /// Offset of the mode's area in every buffer.
        area: i64,
        /// `[max_tokens, row_bytes]` tokens staged for the peers to pull.
        off_staged_x: i64,
        /// `[max_tokens, scale_cols]` their FP8 scales.
        off_staged_scales: i64,
        /// `[max_tokens, topk]` position of each pair in its expert.
        off_slot_rank: i64,
        /// `[max_tokens, world]` position of each token for each rank, or -1.
        off_rank_pos: i64,
        /// `[chunks, world + experts]` the count kernel's per-chunk counts.
        off_chunk_counts: i64,
        /// `[world + experts]` tokens per rank, then pairs per expert.
        off_totals: i64,
        /// `[CHUNK_SYNC_HEADER + chunks]` the staging count kernel's
        /// tickets, finished blocks, then a ready flag per chunk (zero
        /// between dispatches).
        off_chunk_sync: i64,
        /// Records pushed by the sources, `[world, max_tokens]` rows: the
        /// token index, then per slot the local expert or -1, the position
        /// in the expert, and the weight.
        off_in_token: i64,
        off_in_local: i64,
        off_in_rank: i64,
        off_in_weight: i64,
        /// `[world, max_tokens, hidden]` BF16 rows sent back in a combine.
        off_returned: i64,
    }
}

abi_struct! {
    /// Parameters of the normal-mode dispatch kernels (kernels/normal.cu).
    pub struct DispatchParams {
        /// The caller's inputs.
        x: u64 => "const uint8_t*",
        x_scales: u64 => "const float*",
        topk_idx: u64 => "const int*",
        topk_weights: u64 => "const float*",
        /// `[world]` base address of every rank's buffer, as mapped here.
        peer_bases: u64 => "const uint64_t*",
        /// Source-order outputs; recv_x == nullptr when not requested.
        recv_x: u64 => "uint8_t*",
        recv_scales: u64 => "float*",
        recv_topk_idx: u64 => "int*",
        recv_topk_weights: u64 => "float*",
        recv_src_info: u64 => "int*",
        recv_num_rows: u64 => "int*",
        /// Expert-major outputs; expert_x == nullptr when not requested.
        expert_x: u64 => "uint8_t*",
        expert_scales: u64 => "float*",
        expert_weights: u64 => "float*",
        expert_src_row: u64 => "int*",
        expert_offsets: u64 => "int*",
        expert_counts: u64 => "int*",
        /// The handle: `[rows, 2]` (source rank, token) of each row.
        handle_row_src: u64 => "int*",
        /// `[rows, topk]` expert-major row of each (row, slot), or -1.
        handle_row_expert_pos: u64 => "int*",
        /// `[rows, topk]` weight of each (row, slot), or 0.
        handle_row_weights: u64 => "float*",
        /// `[1]` rows received.
        handle_num_rows: u64 => "int*",
        /// `[max_tokens, world]` whether this rank's tokens went to each rank.
        handle_in_rank: u64 => "uint8_t*",
        /// `[2 * local_experts + 1]`: the expert-major segment starts
        /// (`local_experts + 1`, the last one the end), then the real rows of
        /// each local expert (what a fused combine multiplies).
        handle_expert_layout: u64 => "int*",
        /// Host-mapped `[1 + local_experts + 1]`: rows, rows per local
        /// expert, then `host_counts_seq` once they are written; nullptr
        /// when the host does not wait for them.
        host_counts: u64 => "int*",
        status: u64 => "EpDeviceStatus*",
        abort_flag: u64 => "const int*",
        /// Bound of the staging count kernel's waits for earlier chunks.
        timeout_ns: u64,
        normal: NormalOffsets,
        recv_capacity: i64,
        expert_capacity: i64,
        num_tokens: i32,
        rank: i32,
        world: i32,
        num_experts: i32,
        topk: i32,
        /// Bytes of one token row (hidden * element size).
        row_bytes: i32,
        /// fp32 scales per row (0 for BF16).
        scale_cols: i32,
        max_tokens: i32,
        /// Expert-major segment alignment in rows.
        alignment: i32,
        /// The operation's code, for its call word (`CALL_NUMBER_BITS`).
        collective: i32,
        /// Non-zero: the pull writes every expert-major output except the
        /// rows and their scales, which the fused kernel (kernels/mega.cu)
        /// moves.
        skip_expert_rows: i32,
        /// Non-zero (`EP_DISPATCH_KEEP_PADDING`): the padding rows of
        /// `expert_x` and `expert_scales` are not written.
        keep_padding: i32,
        /// Non-zero: the count kernel (grid max(chunks, SM budget)) also
        /// stages (every single-node dispatch), and the pull after it
        /// clears the count's chunk sync words; zero: the hierarchical
        /// mode's count, which stages in its own kernels.
        stage_in_count: i32,
        /// With `host_counts`: the number the pull writes after the counts
        /// (the host's count of its waiting dispatches), which tells the
        /// waiting host that this dispatch's counts are complete; 0: none
        /// (the host waits for the stream).
        host_counts_seq: i32,
    }
}

abi_struct! {
    /// Parameters of the normal-mode combine kernels (kernels/normal.cu).
    pub struct CombineParams {
        /// The caller's rows (source order or expert-major).
        x: u64 => "const __nv_bfloat16*",
        /// `[num_tokens, hidden]` output.
        out: u64 => "__nv_bfloat16*",
        peer_bases: u64 => "const uint64_t*",
        handle_row_src: u64 => "const int*",
        handle_row_expert_pos: u64 => "const int*",
        handle_row_weights: u64 => "const float*",
        handle_num_rows: u64 => "const int*",
        handle_in_rank: u64 => "const uint8_t*",
        status: u64 => "EpDeviceStatus*",
        /// Where the rows are sent back (`off_returned`).
        normal: NormalOffsets,
        /// This rank's tokens of the handle's dispatch.
        num_tokens: i32,
        expert_major: i32,
        rank: i32,
        world: i32,
        topk: i32,
        hidden: i32,
        max_tokens: i32,
        /// The operation's code, for its call word (`CALL_NUMBER_BITS`).
        collective: i32,
        /// Nonzero: a token of this rank that went to this rank alone
        /// "stays home": the send writes its one row straight into `out`
        /// and the reduce leaves it alone (kernels/normal.cu). Zero where
        /// the reduce's rows are not the send's (the hierarchical mode's
        /// node partials).
        home_tokens: i32,
    }
}

abi_struct! {
    /// Sequence numbers and arrival counters of the low-latency mode, in
    /// this rank's area (kernels/low_latency.cu).
    pub struct LlCounters {
        /// Dispatch calls whose send phase has run.
        dispatch_seq: i32,
        combine_seq: i32,
        /// Blocks of the running launch, but its last (the keeper), that
        /// have read the call numbers: the keeper stores the new ones
        /// once all have.
        dispatch_arrivals: i32,
        combine_arrivals: i32,
        /// The call word of the last send phase, which a receive-only
        /// launch of the same call waits under.
        dispatch_call: i32,
        combine_call: i32,
    }
}

abi_struct! {
    /// Parameters of both low-latency kernels (kernels/low_latency.cu).
    pub struct LlParams {
        /// Dispatch: the BF16 tokens `[num_tokens, H]`. Combine: the expert
        /// rows `[L, W * M, H]` (the caller's, or the combine buffer).
        x: u64 => "const __nv_bfloat16*",
        /// `[num_tokens, K]`.
        topk_idx: u64 => "const int*",
        /// `[num_tokens, K]` or nullptr.
        topk_weights: u64 => "const float*",
        /// The caller's device token count, or nullptr.
        device_num_tokens: u64 => "const int*",
        /// Dispatch outputs.
        recv_x: u64 => "uint8_t*",
        recv_scales: u64 => "float*",
        recv_count: u64 => "int*",
        recv_src_info: u64 => "int*",
        recv_layout_range: u64 => "int*",
        /// Combine output `[num_tokens, H]`.
        out: u64 => "__nv_bfloat16*",
        /// `[W]` every rank's buffer, mapped here.
        peer_bases: u64 => "const uint64_t*",
        status: u64 => "EpDeviceStatus*",
        abort_flag: u64 => "const int*",
        timeout_ns: u64,
        /// Offset of this mode's area in every buffer; then the offsets of
        /// its arrays inside it (see the layout in kernels/low_latency.cu).
        area: i64,
        off_counters: i64,
        off_dispatch_flags: i64,
        off_dispatch_counts: i64,
        off_dispatch_tags: i64,
        off_dispatch_msgs: i64,
        off_dispatch_acks: i64,
        off_combine_tags: i64,
        off_combine_rows: i64,
        off_combine_acks: i64,
        off_dispatch_tokens: i64,
        off_token_rows: i64,
        off_token_weights: i64,
        msg_bytes: i64,
        /// Across nodes (0 with one node): the network signal words
        /// `[LL_SIGNAL_ROWS, W]` u64, and this rank's staging of what it
        /// puts: `[W, counts_stride]` counts, `[M]` messages, `[W, M, H]`
        /// BF16 partial sums; the zero-copy combine buffer stages expert
        /// rows.
        off_net_signals: i64,
        off_net_counts: i64,
        off_net_msgs: i64,
        off_net_partials: i64,
        off_combine_buffer: i64,
        /// Ints per (set, source) of dispatch_counts: `L + 1` counts, then
        /// `ceil(M / 32)` words of the mask of tokens sent (network only).
        counts_stride: i64,
        /// Ranks on other nodes (bit r for rank r): their data takes the
        /// network leg (kernels/include/ep_net.cuh); 0 with one node.
        net_mask: u64,
        /// Ranks whose kernels run on this GPU, this rank included (bit r
        /// for rank r; ranks that are threads of one process may share a
        /// GPU): signals between this rank and them take release/acquire at
        /// GPU scope, cheaper than the system scope that a peer GPU needs.
        gpu_peers: u64,
        /// The device communicator (`ncclDevComm`) and the buffer's window
        /// (`ncclWindow_t`), or 0 without NCCL; the first GIN signal of
        /// this mode (the hierarchical mode's come first).
        dev_comm: u64 => "const void*",
        window: u64 => "void*",
        gin_first_signal: i32,
        /// `[blocks, LL_TIME_POINTS]` device timestamps of this launch, or
        /// nullptr (kept only when ep-bench asks).
        timeline: u64 => "unsigned long long*",
        num_tokens: i32,
        rank: i32,
        world: i32,
        num_experts: i32,
        topk: i32,
        hidden: i32,
        max_tokens: i32,
        /// Dispatch: quantize to E4M3 (else BF16 rows).
        fp8: i32,
        /// Dispatch: power-of-two scales.
        ue8m0: i32,
        /// Combine: topk_weights given (else weights at dispatch).
        weighted: i32,
        do_send: i32,
        do_recv: i32,
        /// The operation's code, for its call word (`CALL_NUMBER_BITS`).
        collective: i32,
    }
}

abi_struct! {
    /// A TMA descriptor (`CUtensorMap`): 128 opaque bytes that the host
    /// makes with `cuTensorMapEncodeTiled` and a kernel takes by value.
    pub struct TmaDescriptor as "EpTmaDescriptor" align 128 {
        opaque: [u64; 16],
    }
}

abi_struct! {
    /// Parameters of the kernel that reads where a symmetric NCCL window's
    /// copies are on the ranks of this rank's LSA team
    /// (kernels/nccl_window.cu).
    pub struct NcclPeerBasesParams {
        /// `ncclWindow_t` of the symmetric buffer.
        window: u64 => "void*",
        /// `[world]` output: the window's base on each rank, or 0.
        peer_bases: u64 => "uint64_t*",
        /// World rank of the team's first rank (the team is consecutive).
        first_lsa_rank: i32,
        lsa_size: i32,
        world: i32,
    }
}

abi_struct! {
    /// Parameters of the fused kernels (kernels/mega.cu, which describes
    /// them), both modes.
    pub struct MegaParams {
        /// The GEMM's input rows, 2-D (k, rows).
        a: TmaDescriptor,
        /// The weights, 3-D (k, n, local experts).
        b: TmaDescriptor,
        /// The output `y`, 2-D (n, rows), box (`MEGA_STORE_COLS`,
        /// `MEGA_STORE_ROWS`).
        c: TmaDescriptor,
        /// Mode dispatch: the routing of this call (its pull ran with
        /// `skip_expert_rows`).
        dispatch: DispatchParams,
        /// Mode combine: the combine, whose `x` is `y`; the fused kernel is
        /// the call's first kernel and starts it (`combine.collective`).
        combine: CombineParams,
        /// `[rows, n]` BF16 GEMM output.
        y: u64 => "__nv_bfloat16*",
        /// FP8: `[rows, k / 128]` scales of the input rows.
        a_scales: u64 => "const float*",
        /// FP8: `[local experts, n / 128, k / 128]` weight block scales.
        b_scales: u64 => "const float*",
        /// The handle's `[L + 1]` segment starts, then `[L]` real rows.
        expert_layout: u64 => "const int*",
        /// `[rows]`: sequence number of the call that moved each row.
        row_ready: u64 => "int*",
        /// `[max_m_tiles]`: sequence number of the last dispatch call in
        /// which a producer saw every row of each m-tile moved.
        tile_ready: u64 => "int*",
        /// `[1]`: blocks of this combine call that have stored their GEMM
        /// tiles (zeroed by the call's last block).
        gemm_count: u64 => "int*",
        /// `[MEGA_MAX_BANDS]`: units of each band of this combine call
        /// stored, counted by the consumer warpgroups (zeroed by the call's
        /// last block).
        band_count: u64 => "int*",
        /// `[3]`: the last call's sequence number, blocks finished, units
        /// taken (the tile counter).
        state: u64 => "int*",
        abort_flag: u64 => "const int*",
        status: u64 => "EpDeviceStatus*",
        timeout_ns: u64,
        /// Rows of the input, its scales and `y` (the expert capacity).
        rows: i64,
        /// `MEGA_MODE_*`.
        mode: i32,
        n: i32,
        k: i32,
        local_experts: i32,
        /// The most m-tiles a call can have (a layout with more is refused).
        max_m_tiles: i32,
        /// Column bands of the n-tiles, 1 to `MEGA_MAX_BANDS` (a combine's;
        /// a dispatch has 1): units are taken band by band.
        bands: i32,
    }
}

abi_struct! {
    /// Parameters of `ep_moe_forward`'s activation kernel (kernels/moe.cu):
    /// SwiGLU of the gate+up GEMM's rows, BF16 or requantized to FP8.
    pub struct MoeParams {
        /// `[rows, 2 * intermediate]` BF16 output of the first GEMM.
        y1: u64 => "const __nv_bfloat16*",
        /// `[rows, intermediate]` activations: BF16, or e4m3 codes.
        act: u64 => "uint8_t*",
        /// FP8: `[rows, intermediate / 128]` scales of `act`; else 0.
        act_scales: u64 => "float*",
        /// The handle's `[L + 1]` segment starts, then `[L]` real rows
        /// (what the dispatch of the same call wrote).
        expert_layout: u64 => "const int*",
        /// This rank's buffer: its last barrier (the dispatch's) passed.
        own_base: u64,
        status: u64 => "EpDeviceStatus*",
        /// Rows of `y1`, `act` and `act_scales` (the expert capacity).
        rows: i64,
        intermediate: i32,
        local_experts: i32,
        /// Non-zero: quantize to e4m3 (else round to BF16).
        fp8: i32,
    }
}

abi_struct! {
    /// Parameters of the hierarchical kernels (kernels/hierarchical.cu).
    /// `hier_*` are bytes into the buffer (src/runtime/gpu/hierarchical.rs
    /// has the layout).
    pub struct HierParams {
        /// The caller's tokens, scales, routing and weights (dispatch).
        x: u64 => "const uint8_t*",
        x_scales: u64 => "const float*",
        topk_idx: u64 => "const int*",
        topk_weights: u64 => "const float*",
        /// `[world]` every rank's buffer as mapped here; 0 for a rank this
        /// GPU cannot reach (the network leg then uses GIN).
        peer_bases: u64 => "const uint64_t*",
        /// This rank's buffer.
        own_base: u64 => "uint8_t*",
        /// The device communicator (`ncclDevComm`) and the buffer's window
        /// (`ncclWindow_t`), or 0 without NCCL.
        dev_comm: u64 => "const void*",
        window: u64 => "void*",
        status: u64 => "EpDeviceStatus*",
        abort_flag: u64 => "const int*",
        timeout_ns: u64,
        /// The handle: `[max_tokens, world]` and `[max_tokens, nodes]`
        /// whether each of this rank's tokens went to each rank and node;
        /// `[nodes, max_tokens]` bit l set when the token of the rail
        /// source on node m went to rank l of this node; `[nodes]` token
        /// counts of those sources.
        handle_in_rank: u64 => "uint8_t*",
        handle_in_node: u64 => "uint8_t*",
        handle_relay_mask: u64 => "uint64_t*",
        handle_relay_count: u64 => "int*",
        /// The normal mode's area and arrays.
        normal: NormalOffsets,
        /// `[HIER_SIGNAL_KINDS, nodes]` u64 emulated signal words.
        hier_signals: i64,
        /// `[HIER_COUNTER_INTS]` call counters.
        hier_counters: i64,
        /// `[nodes - 1]` relay blocks of `relay_bytes` each: the normal
        /// area's `[staged_x, totals]` span for the rail source of another
        /// node, slot `(m - node + nodes) % nodes - 1`.
        hier_relay: i64,
        relay_bytes: i64,
        /// `[nodes, max_tokens]` headers, `HIER_HEADER_BYTES` each.
        hier_headers: i64,
        /// `[nodes]` token counts of the rail sources.
        hier_notify: i64,
        /// `[nodes, max_tokens, hidden]` BF16 node partials of this rank's
        /// tokens.
        hier_node_sums: i64,
        /// `[nodes - 1, max_tokens, hidden]` BF16 node partials this rank
        /// computed for the rail sources of other nodes, before the put.
        hier_combine_stage: i64,
        num_tokens: i32,
        rank: i32,
        world: i32,
        ranks_per_node: i32,
        num_experts: i32,
        topk: i32,
        /// Bytes of one token row, fp32 scales per row (0 for BF16).
        row_bytes: i32,
        scale_cols: i32,
        hidden: i32,
        max_tokens: i32,
    }
}

/// The whole `ep_abi.h`, as build.rs writes it.
pub fn c_header() -> String {
    let mut out = String::from(
        "// Generated by build.rs from src/abi/defs.rs: do not edit.\n\
         // Structs and constants shared by the runtime and the kernels.\n\
         #pragma once\n\n\
         #include <cuda_bf16.h>\n\
         #include <stddef.h>\n\
         #include <stdint.h>\n\n",
    );
    out.push_str(&c_constants());
    for definition in [
        DeviceStatus::c_definition(),
        BarrierParams::c_definition(),
        LayoutParams::c_definition(),
        NormalOffsets::c_definition(),
        DispatchParams::c_definition(),
        CombineParams::c_definition(),
        LlCounters::c_definition(),
        LlParams::c_definition(),
        TmaDescriptor::c_definition(),
        MegaParams::c_definition(),
        MoeParams::c_definition(),
        NcclPeerBasesParams::c_definition(),
        HierParams::c_definition(),
    ] {
        out.push('\n');
        out.push_str(&definition);
    }
    out
}
