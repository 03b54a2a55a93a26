//! The low-latency mode on real GPUs against the reference
//! (`ep::reference::low_latency`): every rank rebuilds all ranks' inputs from
//! a seed, runs the GPU dispatch and combine, and compares its outputs with
//! the reference computed on the host. Also: send/receive split, several
//! rounds on one context (alternating buffer sets), a CUDA graph replayed
//! with new inputs and token counts, ranks as processes, a peer that never
//! calls (timeout), a rank process killed mid-run, two runs of random
//! iterations that must give the same outputs bit for bit, a bad device token
//! count, and misuse.
//! Needs CUDA GPUs: `cargo test --release --test gpu_low_latency -- --ignored`.

mod common;

use common::gpu::*;
use common::{
    bits, bytes_to_bf16, dtype_code, dtype_of, is_poisoned, last_error, ll_combine_args,
    ll_dispatch_args, random_bf16, routing, weights, Ctx, Fnv, Rng,
};
use cudarc::driver::sys;
use ep::capi::*;
use ep::reference::low_latency::{
    ll_combine, ll_dispatch, LlDispatched, LlExpertOutputs, LlRankTokens,
};
use ep::reference::{Dtype, Topology};
use half::bf16;
use std::ptr::{null, null_mut};
use std::time::{Duration, Instant};

/// One test configuration.
#[derive(Clone, Copy, Debug)]
struct Case {
    world: usize,
    hidden: usize,
    topk: usize,
    experts: usize,
    /// `ll_max_tokens_per_rank`.
    max_tokens: usize,
    fp8: bool,
    ue8m0: bool,
    weights_at_dispatch: bool,
    zero_copy: bool,
    split: bool,
    /// Skew the routing towards expert 0.
    skewed: bool,
    /// Pass the token count in device memory (`device_num_tokens`), with
    /// `num_tokens` = `max_tokens` as its bound.
    count_in_memory: bool,
    /// `ranks_per_node` (0: one node): below the world size, the ranks of
    /// other nodes are reached over the network leg's NVLink emulation.
    ranks_per_node: usize,
    seed: u64,
}

impl Case {
    fn new(world: usize, hidden: usize, topk: usize, experts: usize, max_tokens: usize) -> Case {
        Case {
            world,
            hidden,
            topk,
            experts: experts - experts % world,
            max_tokens,
            fp8: true,
            ue8m0: false,
            weights_at_dispatch: false,
            zero_copy: false,
            split: false,
            skewed: false,
            count_in_memory: false,
            ranks_per_node: 0,
            seed: 1,
        }
    }

    fn topo(&self) -> Topology {
        Topology {
            world: self.world,
            num_experts: self.experts,
            topk: self.topk,
            hidden: self.hidden,
        }
    }

    fn dtype(&self) -> Dtype {
        dtype_of(self.fp8)
    }

    fn rows(&self) -> usize {
        self.experts * self.max_tokens
    }

    fn config(&self, timeout_ms: u32) -> ep_config_t {
        ep_config_t {
            ranks_per_node: self.ranks_per_node as i32,
            ..gpu_config(
                self.hidden as i32,
                self.topk as i32,
                self.experts as i32,
                16,
                self.max_tokens as i32,
                timeout_ms,
            )
        }
    }
}

/// One rank's inputs of one round.
struct Input {
    n: usize,
    x: Vec<bf16>,
    idx: Vec<i32>,
    w: Vec<f32>,
    /// The expert outputs this rank combines, `[L, W * M, hidden]`.
    y: Vec<bf16>,
}

impl Input {
    fn tokens(&self, with_weights: bool) -> LlRankTokens<'_> {
        LlRankTokens {
            num_tokens: self.n,
            x: &self.x,
            topk_idx: &self.idx,
            topk_weights: with_weights.then_some(&self.w[..]),
        }
    }
}

/// Every rank's inputs of round `round`, with `tokens[r]` tokens on rank r.
fn inputs(case: &Case, round: u64, tokens: &[usize]) -> Vec<Input> {
    tokens
        .iter()
        .enumerate()
        .map(|(r, &n)| input_of(case, round, r, n))
        .collect()
}

/// Rank `rank`'s inputs of round `round`, with `n` tokens.
fn input_of(case: &Case, round: u64, rank: usize, n: usize) -> Input {
    let mut rng = Rng::new(case.seed * 1_000_003 + round * 101 + rank as u64);
    let hot = case.skewed.then_some(0);
    Input {
        n,
        x: random_bf16(&mut rng, n * case.hidden),
        idx: routing(&mut rng, case.experts, case.topk, n, 0.1, hot),
        w: weights(&mut rng, n * case.topk),
        y: random_bf16(&mut rng, case.rows() * case.hidden),
    }
}

/// The device buffers of one rank's dispatch and combine.
struct Bufs {
    x: DevBuf,
    idx: DevBuf,
    w: DevBuf,
    recv_x: DevBuf,
    recv_scales: DevBuf,
    recv_count: DevBuf,
    recv_src_info: DevBuf,
    recv_range: DevBuf,
    y: DevBuf,
    out: DevBuf,
    /// The token count, for `Case::count_in_memory`.
    count: DevBuf,
}

impl Bufs {
    /// Poisoned buffers sized for `case` and `me`'s inputs (uploaded).
    fn new(case: &Case, me: &Input) -> Bufs {
        let (m, h, k) = (case.max_tokens, case.hidden, case.topk);
        let local = case.experts / case.world;
        let rows = case.rows();
        let bufs = Bufs {
            x: DevBuf::of::<bf16>(m * h),
            idx: DevBuf::of::<i32>(m * k),
            w: DevBuf::of::<f32>(m * k),
            recv_x: DevBuf::poisoned(rows * case.dtype().row_bytes(h)),
            recv_scales: DevBuf::of::<f32>(rows * h / 128),
            recv_count: DevBuf::of::<i32>(local),
            recv_src_info: DevBuf::of::<i32>(rows),
            recv_range: DevBuf::of::<i32>(local * case.world * 2),
            y: DevBuf::of::<bf16>(rows * h),
            out: DevBuf::of::<bf16>(m * h),
            count: DevBuf::of::<i32>(1),
        };
        bufs.upload(me);
        bufs
    }

    fn upload(&self, me: &Input) {
        self.x.upload(&me.x);
        self.idx.upload(&me.idx);
        self.w.upload(&me.w);
        self.y.upload(&me.y);
        self.count.upload(&[me.n as i32]);
    }

    fn poison_outputs(&self) {
        for b in [
            &self.recv_x,
            &self.recv_scales,
            &self.recv_count,
            &self.recv_src_info,
            &self.recv_range,
            &self.out,
        ] {
            b.poison();
        }
    }

    /// `num_tokens` and `device_num_tokens` of a call with `n` tokens (with
    /// the count in memory, `n` is what `upload` wrote there).
    fn token_count(&self, case: &Case, n: usize) -> (i32, *const i32) {
        if case.count_in_memory {
            (case.max_tokens as i32, self.count.as_const())
        } else {
            (n as i32, null())
        }
    }

    fn dispatch_args(&self, case: &Case, n: usize, flags: u32) -> ep_ll_dispatch_args_t {
        let mut a = ll_dispatch_args();
        a.flags = flags | if case.ue8m0 { EP_LL_UE8M0_SCALES } else { 0 };
        (a.num_tokens, a.device_num_tokens) = self.token_count(case, n);
        a.out_dtype = dtype_code(case.dtype());
        a.x = self.x.as_const();
        a.topk_idx = self.idx.as_const();
        a.topk_weights = if case.weights_at_dispatch {
            self.w.as_const()
        } else {
            null()
        };
        a.recv_x = self.recv_x.as_mut();
        a.recv_x_scales = if case.fp8 {
            self.recv_scales.as_mut()
        } else {
            null_mut()
        };
        a.recv_count = self.recv_count.as_mut();
        a.recv_src_info = self.recv_src_info.as_mut();
        a.recv_layout_range = self.recv_range.as_mut();
        a
    }

    fn combine_args(&self, case: &Case, n: usize, flags: u32) -> ep_ll_combine_args_t {
        let mut a = ll_combine_args();
        a.flags = flags | if case.zero_copy { EP_LL_ZERO_COPY } else { 0 };
        (a.num_tokens, a.device_num_tokens) = self.token_count(case, n);
        a.x = if case.zero_copy {
            null()
        } else {
            self.y.as_const()
        };
        a.topk_idx = self.idx.as_const();
        a.topk_weights = if case.weights_at_dispatch {
            null()
        } else {
            self.w.as_const()
        };
        a.src_info = self.recv_src_info.as_const();
        a.layout_range = self.recv_range.as_const();
        a.out = self.out.as_mut();
        a
    }
}

/// Writes `y` into the context's zero-copy combine buffer.
fn fill_combine_buffer(ctx: &Ctx, y: &[bf16]) {
    let mut buffer = null_mut();
    let mut bytes = 0;
    // SAFETY: live context, valid out-parameters.
    ok(
        unsafe { ep_ll_get_combine_buffer(ctx.0, &mut buffer, &mut bytes) },
        "combine buffer",
    );
    assert_eq!(bytes, std::mem::size_of_val(y));
    // An idle stream first (see `DevBuf::download`).
    sync();
    // SAFETY: the buffer is device memory of `bytes` bytes; `y` outlives
    // the sync.
    cu(
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                buffer as u64,
                y.as_ptr() as *const _,
                bytes,
                stream() as sys::CUstream,
            )
        },
        "fill combine buffer",
    );
    sync();
}

/// Runs one dispatch and one combine (split in send and receive calls when
/// `case.split`) on `stream`.
fn run_ops(ctx: &Ctx, case: &Case, bufs: &Bufs, n: usize, stream: ep_stream_t) {
    let phases: &[u32] = if case.split {
        &[EP_LL_SEND_ONLY, EP_LL_RECV_ONLY]
    } else {
        &[0]
    };
    for &flags in phases {
        let a = bufs.dispatch_args(case, n, flags);
        // SAFETY: device buffers sized for the config.
        ok(unsafe { ep_ll_dispatch(ctx.0, &a, stream) }, "ll dispatch");
    }
    for &flags in phases {
        let a = bufs.combine_args(case, n, flags);
        // SAFETY: as above.
        ok(unsafe { ep_ll_combine(ctx.0, &a, stream) }, "ll combine");
    }
}

/// Compares one rank's GPU results with the reference.
fn check(case: &Case, rank: usize, all: &[Input], bufs: &Bufs, what: &str) {
    check_but(case, rank, all, bufs, "", what);
}

/// One rank's outputs of a dispatch and combine, downloaded whole.
struct Got {
    count: Vec<i32>,
    range: Vec<i32>,
    recv_x: Vec<u8>,
    src_info: Vec<i32>,
    /// FP8 only.
    scales: Vec<f32>,
    out: Vec<u8>,
}

impl Got {
    fn download(case: &Case, bufs: &Bufs) -> Got {
        let (rows, h, local) = (case.rows(), case.hidden, case.experts / case.world);
        Got {
            count: bufs.recv_count.download(local),
            range: bufs.recv_range.download(local * case.world * 2),
            recv_x: bufs.recv_x.download(rows * case.dtype().row_bytes(h)),
            src_info: bufs.recv_src_info.download(rows),
            scales: if case.fp8 {
                bufs.recv_scales.download(rows * h / 128)
            } else {
                vec![]
            },
            out: bufs.out.download(case.max_tokens * h * 2),
        }
    }

    /// The valid rows of local expert `le` (`recv_count`), as rows of the
    /// masked layout.
    fn rows(&self, case: &Case, le: usize) -> std::ops::Range<usize> {
        let capacity = case.world * case.max_tokens;
        let count = self.count[le];
        assert!(
            (0..=capacity as i32).contains(&count),
            "recv_count[{le}] = {count}"
        );
        le * capacity..le * capacity + count as usize
    }

    /// Hashes what the API defines after a dispatch and combine of `n`
    /// tokens: the counts, the layout ranges, each local expert's valid rows
    /// (tokens, FP8 scales, source tokens: in the order the API promises, by
    /// source rank then token) and the combine output. Rows past the counts
    /// are not defined and left out.
    fn hash(&self, case: &Case, n: usize, hash: &mut Fnv) {
        let h = case.hidden;
        let row_bytes = case.dtype().row_bytes(h);
        hash.values(&self.count);
        hash.values(&self.range);
        for le in 0..self.count.len() {
            let rows = self.rows(case, le);
            hash.bytes(&self.recv_x[rows.start * row_bytes..rows.end * row_bytes]);
            hash.values(&self.src_info[rows.clone()]);
            if case.fp8 {
                hash.values(&self.scales[rows.start * h / 128..rows.end * h / 128]);
            }
        }
        hash.bytes(&self.out[..n * h * 2]);
    }
}

/// Compares one rank's GPU results but the output named `left_out` (its C
/// field name) with the reference.
fn check_but(case: &Case, rank: usize, all: &[Input], bufs: &Bufs, left_out: &str, what: &str) {
    let topo = case.topo();
    let (m, h, world) = (case.max_tokens, case.hidden, case.world);
    let sources: Vec<LlRankTokens> = all
        .iter()
        .map(|i| i.tokens(case.weights_at_dispatch))
        .collect();
    let dispatched: Vec<LlDispatched> = (0..world)
        .map(|r| ll_dispatch(topo, m, &sources, r, case.dtype(), case.ue8m0))
        .collect();
    let want = &dispatched[rank];

    let row_bytes = case.dtype().row_bytes(h);
    let got = Got::download(case, bufs);
    assert_eq!(got.count, want.recv_count, "{what}: recv_count");
    if left_out != "recv_layout_range" {
        assert_eq!(got.range, want.recv_layout_range, "{what}: layout range");
    }
    for le in 0..got.count.len() {
        let rows = got.rows(case, le);
        if left_out != "recv_src_info" {
            assert_eq!(
                got.src_info[rows.clone()],
                want.recv_src_info[rows.clone()],
                "{what}: src_info of expert {le}"
            );
        }
        let bytes = rows.start * row_bytes..rows.end * row_bytes;
        assert!(
            got.recv_x[bytes.clone()] == want.recv_x[bytes],
            "{what}: recv_x of expert {le}"
        );
        if case.fp8 {
            let s = rows.start * h / 128..rows.end * h / 128;
            assert_eq!(
                bits(&got.scales[s.clone()]),
                bits(&want.recv_scales[s]),
                "{what}: scales of expert {le}"
            );
        }
    }

    let experts: Vec<LlExpertOutputs> = (0..world)
        .map(|r| LlExpertOutputs {
            y: &all[r].y,
            src_info: &dispatched[r].recv_src_info,
            layout_range: &dispatched[r].recv_layout_range,
            weights: dispatched[r].recv_weights.as_deref(),
        })
        .collect();
    let me = &all[rank];
    let weights = (!case.weights_at_dispatch).then_some(&me.w[..]);
    let want_out = ll_combine(topo, m, rank, me.n, &me.idx, weights, &experts);
    assert!(
        is_poisoned(&got.out[me.n * h * 2..]),
        "{what}: combine wrote past the token count"
    );
    let out = bytes_to_bf16(&got.out[..me.n * h * 2]);
    let mismatch = out
        .iter()
        .zip(&want_out)
        .position(|(a, b)| a.to_bits() != b.to_bits());
    if let Some(i) = mismatch {
        panic!(
            "{what}: combine out[{}][{}] = {} but the reference has {}",
            i / h,
            i % h,
            out[i],
            want_out[i]
        );
    }
}

/// Runs `rounds` rounds of `case` on one context per rank (threads of this
/// process); round r uses `tokens(r, rank)` tokens on each rank.
fn run_case(case: Case, rounds: u64, tokens: impl Fn(u64, usize) -> usize + Sync) {
    run_case_on(Ranks::Threads, case, rounds, tokens);
}

fn run_case_on(ranks: Ranks, case: Case, rounds: u64, tokens: impl Fn(u64, usize) -> usize + Sync) {
    let world = case.world;
    let call = format!("{case:?}");
    run_gpu_ranks(ranks, &call, world, &case.config(20_000), |rank, ctx| {
        for round in 0..rounds {
            let counts: Vec<usize> = (0..world).map(|r| tokens(round, r)).collect();
            let all = inputs(&case, round, &counts);
            let me = &all[rank];
            let bufs = Bufs::new(&case, me);
            if case.zero_copy {
                fill_combine_buffer(ctx, &me.y);
            }
            gate();
            run_ops(ctx, &case, &bufs, me.n, stream());
            sync();
            assert_eq!(async_status(ctx), EP_SUCCESS, "{case:?} round {round}");
            check(
                &case,
                rank,
                &all,
                &bufs,
                &format!("{case:?} round {round} rank {rank}"),
            );
            // Every rank is done with the round before any frees its buffers.
            gate();
        }
    });
}

/// World sizes: 1, 2, 4 and 8 ranks, sharing the GPUs when there are fewer
/// (see `test_worlds`).
fn worlds() -> Vec<usize> {
    test_worlds(2)
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn dispatch_and_combine_match_the_reference() {
    for world in worlds() {
        for (hidden, topk, experts, m) in [
            (128, 1, 8, 17),
            (2048, 4, 64, 32),
            (128, 8, 256, 128),
            (7168, 8, 8, 128),
            (128, 16, 64, 256),
            (4096, 4, 64, 64),
            (16384, 8, 16, 32),
            // A large maximum: the warps skip each source's empty slots.
            (2048, 8, 32, 1024),
        ] {
            let topk = topk.min(experts - experts % world);
            let case = Case::new(world, hidden, topk, experts, m);
            // Uneven counts, 0 and 1 included, over two rounds.
            let counts = [[m, 1, 0, m / 2 + 1], [0, m, m / 2 + 1, 1]];
            run_case(case, 2, |round, r| counts[round as usize][r % 4]);
        }
    }
}

/// Ranks as processes: the symmetric buffers travel between processes as
/// file descriptors.
#[test]
#[ignore = "needs CUDA GPUs"]
fn ranks_as_processes_match_the_reference() {
    let ranks = Ranks::Processes {
        test: "ranks_as_processes_match_the_reference",
    };
    // A GPU per rank: processes cannot share one.
    let world = device_count();
    let base = Case::new(world, 7168, 8, 256, 128);
    let counts = |round: u64, r: usize| [128, 1, 0, 77][(round as usize + r) % 4];
    run_case_on(ranks, base, 3, counts);
    let case = Case {
        weights_at_dispatch: true,
        split: true,
        count_in_memory: true,
        ..Case::new(world, 2048, 16, 64, 64)
    };
    run_case_on(ranks, case, 3, |round, r| counts(round, r) / 2);
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn variants_match_the_reference() {
    for world in worlds() {
        variants(world);
    }
}

fn variants(world: usize) {
    let base = Case::new(world, 2048, 8, 64, 64);
    let cases = [
        Case { fp8: false, ..base },
        Case {
            ue8m0: true,
            ..base
        },
        Case {
            weights_at_dispatch: true,
            ..base
        },
        Case {
            weights_at_dispatch: true,
            fp8: false,
            ..base
        },
        Case {
            zero_copy: true,
            ..base
        },
        Case {
            zero_copy: true,
            weights_at_dispatch: true,
            ..base
        },
        Case {
            split: true,
            ..base
        },
        Case {
            split: true,
            weights_at_dispatch: true,
            zero_copy: true,
            ..base
        },
        Case {
            skewed: true,
            ..base
        },
        Case {
            count_in_memory: true,
            ..base
        },
        Case {
            skewed: true,
            weights_at_dispatch: true,
            topk: 16,
            ..base
        },
    ];
    for case in cases {
        run_case(case, 1, |_, r| 64 - 7 * r);
        // Small batches, as decode sends them: one token and a few, 0
        // included.
        run_case(case, 1, |_, r| [1, 8, 9, 0][r % 4]);
    }
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn rounds_alternate_buffer_sets_with_changing_counts() {
    for world in worlds() {
        rounds_alternate(world);
    }
}

fn rounds_alternate(world: usize) {
    let base = Case::new(world, 1024, 8, 64, 128);
    let counts = |round: u64, r: usize| [128, 0, 17, 1, 100, 128][(round as usize + r) % 6];
    run_case(base, 6, counts);
    run_case(
        Case {
            split: true,
            weights_at_dispatch: true,
            count_in_memory: true,
            ..base
        },
        5,
        counts,
    );
}

/// Rank 0 enqueues several rounds before the others start: its calls wait
/// on the GPU for the peers (a rank runs at most one call ahead), and every
/// round's results are right.
#[test]
#[ignore = "needs CUDA GPUs"]
fn a_rank_far_ahead_waits_and_every_call_is_right() {
    for world in worlds().into_iter().filter(|&w| w > 1) {
        far_ahead(world, 0);
    }
}

fn far_ahead(world: usize, ranks_per_node: usize) {
    let case = Case {
        weights_at_dispatch: true,
        ranks_per_node,
        ..Case::new(world, 1024, 8, 64, 64)
    };
    let rounds = 6;
    let counts = |round: u64| -> Vec<usize> {
        (0..world)
            .map(|r| [64, 0, 17, 1, 50, 64][(round as usize + r) % 6])
            .collect()
    };
    let all: Vec<Vec<Input>> = (0..rounds)
        .map(|round| inputs(&case, round, &counts(round)))
        .collect();
    run_gpu_world(world, &case.config(20_000), |rank, ctx| {
        let bufs: Vec<Bufs> = all
            .iter()
            .map(|inputs| Bufs::new(&case, &inputs[rank]))
            .collect();
        gate();
        if rank != 0 {
            std::thread::sleep(Duration::from_millis(300));
        }
        // Every round on one stream, without waiting in between.
        for (inputs, b) in all.iter().zip(&bufs) {
            run_ops(ctx, &case, b, inputs[rank].n, stream());
        }
        sync();
        assert_eq!(async_status(ctx), EP_SUCCESS, "rank {rank}");
        for (round, (inputs, b)) in all.iter().zip(&bufs).enumerate() {
            check(
                &case,
                rank,
                inputs,
                b,
                &format!("world {world} round {round} rank {rank}"),
            );
        }
        gate();
    });
}

/// One graph, captured once, replayed with new routing, inputs and token
/// counts (0 and the maximum included): the count is read from device
/// memory when each replay runs. 1000 replays on one rank, fewer on more.
#[test]
#[ignore = "needs CUDA GPUs"]
fn graph_replays_see_new_inputs_and_token_counts() {
    for world in worlds() {
        graph_replays(world, 1000 / world as u64);
    }
}

fn graph_replays(world: usize, replays: u64) {
    let base = Case {
        count_in_memory: true,
        ..Case::new(world, 256, 4, 16, 32)
    };
    run_gpu_world(world, &base.config(20_000), |rank, ctx| {
        for case in [
            base,
            Case {
                skewed: true,
                weights_at_dispatch: true,
                split: true,
                ..base
            },
        ] {
            let tokens = |replay: u64, r: usize| -> usize {
                let m = case.max_tokens as u64;
                [0, 1, m, (replay * 7 + r as u64 * 13) % (m + 1)][(replay % 4) as usize] as usize
            };
            let counts = |replay| (0..world).map(|r| tokens(replay, r)).collect::<Vec<_>>();
            let first = inputs(&case, 0, &counts(0));
            let bufs = Bufs::new(&case, &first[rank]);
            let graph = Graph::capture(|stream| run_ops(ctx, &case, &bufs, 0, stream));
            gate();
            let graph_replays = if case.split { replays / 4 } else { replays };
            for replay in 1..=graph_replays {
                let all = inputs(&case, replay, &counts(replay));
                bufs.upload(&all[rank]);
                bufs.poison_outputs();
                graph.replay();
                let what = format!("{case:?} replay {replay} rank {rank}");
                assert_eq!(async_status(ctx), EP_SUCCESS, "{what}");
                check(&case, rank, &all, &bufs, &what);
            }
            gate();
        }
    });
}

/// Several nodes on one host (`ranks_per_node` below the world size): what
/// goes to a rank of another node takes the network leg's NVLink emulation
/// (staged puts, signals in place of flags and tags; the GIN leg has the
/// same protocol). Every node shape of each world: the variants, two rounds
/// over both buffer sets with 0 and 1 tokens, a rank far ahead, and a rank
/// of another node that never calls.
#[test]
#[ignore = "needs CUDA GPUs"]
fn virtual_nodes_match_the_reference() {
    for world in worlds().into_iter().filter(|&w| w > 1) {
        for rpn in (1..world).filter(|r| world.is_multiple_of(*r)) {
            let base = Case {
                ranks_per_node: rpn,
                seed: 7000 + 10 * world as u64 + rpn as u64,
                ..Case::new(world, 2048, 8, 64, 64)
            };
            let cases = [
                base,
                Case { fp8: false, ..base },
                Case {
                    weights_at_dispatch: true,
                    zero_copy: true,
                    ..base
                },
                Case {
                    zero_copy: true,
                    ue8m0: true,
                    ..base
                },
                Case {
                    split: true,
                    count_in_memory: true,
                    ..base
                },
                Case {
                    skewed: true,
                    weights_at_dispatch: true,
                    topk: 16,
                    ..base
                },
                Case {
                    ranks_per_node: rpn,
                    ..Case::new(world, 7168, 8, 256, 128)
                },
                Case {
                    ranks_per_node: rpn,
                    weights_at_dispatch: true,
                    ..Case::new(world, 128, 1, 8, 17)
                },
            ];
            for case in cases {
                let m = case.max_tokens;
                let counts = [[m, 1, 0, m / 2 + 1], [0, m, m / 2 + 1, 1]];
                run_case(case, 2, |round, r| counts[round as usize][r % 4]);
            }
            far_ahead(world, rpn);
        }
        missing_peer(world, 1);
    }
}

/// ep-bench's per-phase breakdown: with timestamps kept, every block of
/// both kernels notes its points in launch order, the results stay right,
/// and with them off again the next launches note nothing new.
#[test]
#[ignore = "needs CUDA GPUs"]
fn device_timestamps_follow_the_phases() {
    use ep::abi::*;
    for world in [1, 2] {
        let case = Case::new(world, 2048, 8, 64, 32);
        run_gpu_world(world, &case.config(20_000), |rank, ctx| {
            let all = inputs(&case, 0, &vec![32; world]);
            let bufs = Bufs::new(&case, &all[rank]);
            // SAFETY: a live context.
            unsafe { ep::capi::ll_keep_timeline(ctx.0, true) }.unwrap();
            gate();
            run_ops(ctx, &case, &bufs, 32, stream());
            sync();
            assert_eq!(async_status(ctx), EP_SUCCESS);
            check(
                &case,
                rank,
                &all,
                &bufs,
                &format!("rank {rank} with timestamps"),
            );
            // SAFETY: as above; the stream is synchronised.
            let t = unsafe { ep::capi::ll_timeline(ctx.0) }.unwrap();
            assert_eq!(t.ns.len(), 2 * t.blocks * LL_TIME_POINTS);
            for op in 0..2 {
                for block in 0..t.blocks {
                    let at = |point: usize| t.ns[(op * t.blocks + block) * LL_TIME_POINTS + point];
                    let mut order = vec![
                        LL_TIME_START,
                        LL_TIME_NUMBERED,
                        LL_TIME_ACKED,
                        LL_TIME_ANNOUNCED,
                        LL_TIME_SENT,
                    ];
                    if op == 0 {
                        order.push(LL_TIME_COUNTS_IN);
                    } else {
                        assert_eq!(at(LL_TIME_COUNTS_IN), 0, "combine has no counts point");
                    }
                    order.push(LL_TIME_RECEIVED);
                    let times: Vec<u64> = order.iter().map(|&p| at(p)).collect();
                    assert!(
                        times[0] > 0 && times.windows(2).all(|w| w[0] <= w[1]),
                        "rank {rank} op {op} block {block}: {times:?}"
                    );
                }
            }
            // SAFETY: as above.
            unsafe { ep::capi::ll_keep_timeline(ctx.0, false) }.unwrap();
            run_ops(ctx, &case, &bufs, 32, stream());
            sync();
            // SAFETY: as above.
            let after = unsafe { ep::capi::ll_timeline(ctx.0) }.unwrap();
            assert_eq!(after, t, "rank {rank}: timestamps noted while off");
            gate();
        });
    }
}

/// A device token count outside `[0, num_tokens]` is an asynchronous
/// invalid argument on its rank, whose call sends or writes nothing; the
/// peers complete their calls or time out. Rank 0 gives the dispatch a count
/// above its bound in the first run, the combine a negative count in the
/// second.
#[test]
#[ignore = "needs CUDA GPUs"]
fn a_device_token_count_out_of_range_is_reported() {
    for world in [1, 2] {
        token_count_out_of_range(world);
    }
}

fn token_count_out_of_range(world: usize) {
    let case = Case {
        count_in_memory: true,
        ..Case::new(world, 128, 2, 8, 8)
    };
    for (bad_phase, bad_count) in [("dispatch", case.max_tokens as i32 + 1), ("combine", -1)] {
        run_gpu_world(world, &case.config(2000), |rank, ctx| {
            let all = inputs(&case, 0, &vec![3; world]);
            let bufs = Bufs::new(&case, &all[rank]);
            bufs.poison_outputs();
            let bad = |phase: &str| {
                if rank == 0 && phase == bad_phase {
                    bufs.count.upload(&[bad_count]);
                }
            };
            bad("dispatch");
            gate();
            // Rank 0's calls after its error, and the peers' after a
            // timeout, are refused: only the status tells.
            let a = bufs.dispatch_args(&case, 0, 0);
            // SAFETY: device buffers sized for the config.
            unsafe { ep_ll_dispatch(ctx.0, &a, stream()) };
            sync();
            if bad_phase == "dispatch" && async_status(ctx) == EP_SUCCESS {
                let range: Vec<i32> = bufs.recv_range.download(case.experts / world * world * 2);
                for (le, pair) in range.chunks(2 * world).enumerate() {
                    assert_eq!(pair[1], 0, "rank {rank}: rows of expert {le} from rank 0");
                }
            }
            bad("combine");
            let c = bufs.combine_args(&case, 0, 0);
            // SAFETY: as above.
            unsafe { ep_ll_combine(ctx.0, &c, stream()) };
            sync();
            let status = async_status(ctx);
            if rank == 0 {
                assert_eq!(status, EP_ERR_INVALID_ARGUMENT, "bad {bad_phase} count");
                assert!(
                    last_error().contains(&format!("device_num_tokens = {bad_count}")),
                    "{}",
                    last_error()
                );
                let out: Vec<u8> = bufs.out.download(case.max_tokens * case.hidden * 2);
                assert!(is_poisoned(&out), "rank 0 wrote output rows");
            } else {
                assert!(
                    status == EP_SUCCESS || status == EP_ERR_TIMEOUT,
                    "rank {rank}, bad {bad_phase} count: {status}"
                );
            }
            // Every rank keeps its buffers mapped until the others are done.
            gate();
        });
    }
}

/// A peer that never calls: the caller's kernels give up after the timeout,
/// on 2 and 4 ranks.
#[test]
#[ignore = "needs CUDA GPUs"]
fn a_missing_peer_times_out() {
    for world in [2, 4] {
        missing_peer(world, 0);
    }
}

fn missing_peer(world: usize, ranks_per_node: usize) {
    let case = Case {
        ranks_per_node,
        ..Case::new(world, 128, 2, 8, 8)
    };
    let timeout_ms = 2000;
    run_gpu_world(world, &case.config(timeout_ms), |rank, ctx| {
        if rank == 0 {
            let counts: Vec<usize> = vec![4; world];
            let all = inputs(&case, 0, &counts);
            let bufs = Bufs::new(&case, &all[0]);
            let start = Instant::now();
            let a = bufs.dispatch_args(&case, 4, 0);
            // SAFETY: device buffers sized for the config.
            ok(
                unsafe { ep_ll_dispatch(ctx.0, &a, stream()) },
                "ll dispatch",
            );
            sync();
            let elapsed = start.elapsed();
            assert_eq!(async_status(ctx), EP_ERR_TIMEOUT);
            assert!(
                elapsed < Duration::from_millis(timeout_ms as u64 + 3000),
                "took {elapsed:?}"
            );
        }
        // The others keep their buffers mapped until rank 0 is done.
        gate();
    });
}

/// A rank process killed (SIGKILL) while its dispatch is in flight, on one
/// process per GPU (2 to 8): every other rank sees `EP_ERR_TIMEOUT` within
/// the timeout and destroys its context (see `until_the_timeout`).
#[test]
#[ignore = "needs CUDA GPUs"]
fn a_killed_rank_process_makes_the_others_time_out() {
    let test = "a_killed_rank_process_makes_the_others_time_out";
    let Some(world) = one_process_per_gpu(test) else {
        return;
    };
    let case = Case::new(world, 512, 4, 32, 16);
    let timeout = Duration::from_millis(3000);
    let n = 12;
    run_with_a_killed_rank(
        test,
        world,
        &case.config(timeout.as_millis() as u32),
        |rank, ctx| {
            let all = inputs(&case, 0, &vec![n; world]);
            let bufs = Bufs::new(&case, &all[rank]);
            let dispatch = bufs.dispatch_args(&case, n, 0);
            let combine = bufs.combine_args(&case, n, 0);
            until_the_timeout(
                ctx,
                rank,
                world,
                timeout,
                // SAFETY: device buffers sized for the config.
                || unsafe { ep_ll_dispatch(ctx.0, &dispatch, stream()) },
                // SAFETY: as above.
                || unsafe { ep_ll_combine(ctx.0, &combine, stream()) },
            );
        },
    );
}

/// Two runs of `EP_REPEAT_ITERS` (default 200) random iterations, on fresh
/// contexts from the same seeds, give the same outputs bit for bit (see
/// `assert_repeatable` and `repeat_run`).
#[test]
#[ignore = "needs CUDA GPUs"]
fn two_runs_of_random_iterations_are_identical() {
    assert_repeatable("low-latency mode", repeat_run);
}

/// The case of iteration `i` of a repeatability run: FP8 (with UE8M0 scales
/// every other time) or BF16, weights at dispatch or at combine, split
/// calls or not, skewed routing or not, the token count in device memory
/// or not, zero-copy combine or not.
fn repeat_case(base: Case, i: usize) -> Case {
    Case {
        fp8: i.is_multiple_of(2),
        ue8m0: i.is_multiple_of(4),
        weights_at_dispatch: i % 3 == 1,
        split: i % 5 == 2,
        skewed: i % 4 == 3,
        count_in_memory: i % 7 == 4,
        zero_copy: i % 6 == 5,
        ..base
    }
}

/// One run of the repeatability test: in iteration i every rank dispatches
/// and combines random tokens (counts from 0 to 32, 0 and 1 included,
/// uneven routing with dropped slots) as `repeat_case(i)` says. Hashed: see
/// `Got::hash`. Iterations `checked_iteration` picks are also checked
/// against the reference. Returns each rank's running hash after each
/// iteration.
fn repeat_run(world: usize, iterations: usize) -> Vec<Vec<u64>> {
    let base = Case::new(world, 1024, 8, 32, 32);
    run_gpu_world(world, &base.config(20_000), |rank, ctx| {
        // BF16 rows: room for either output type.
        let bufs = Bufs::new(&Case { fp8: false, ..base }, &input_of(&base, 0, rank, 0));
        gate();
        let mut hash = Fnv::default();
        let mut hashes = Vec::with_capacity(iterations);
        for i in 0..iterations {
            let case = repeat_case(base, i);
            let counts: Vec<usize> = (0..world)
                .map(|r| repeat_count(i, r, case.max_tokens))
                .collect();
            let me = input_of(&case, i as u64, rank, counts[rank]);
            let what = format!("{case:?} iteration {i} rank {rank} ({} tokens)", me.n);
            bufs.upload(&me);
            bufs.poison_outputs();
            if case.zero_copy {
                // Only this rank's combine reads it, and its last one has ended.
                fill_combine_buffer(ctx, &me.y);
            }
            run_ops(ctx, &case, &bufs, me.n, stream());
            sync();
            assert_eq!(async_status(ctx), EP_SUCCESS, "{what}: {}", last_error());
            if checked_iteration(i) {
                check(&case, rank, &inputs(&case, i as u64, &counts), &bufs, &what);
            }
            Got::download(&case, &bufs).hash(&case, me.n, &mut hash);
            hashes.push(hash.0);
        }
        // Every rank is done before any frees its buffers.
        gate();
        hashes
    })
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn split_calls_out_of_order_are_rejected() {
    for world in [1, 2] {
        split_calls_out_of_order(world);
    }
}

fn split_calls_out_of_order(world: usize) {
    let case = Case::new(world, 128, 2, 8, 8);
    run_gpu_world(world, &case.config(20_000), |rank, ctx| {
        let counts = vec![3; world];
        let all = inputs(&case, 0, &counts);
        let bufs = Bufs::new(&case, &all[rank]);
        gate();
        let dispatch = |flags| {
            let a = bufs.dispatch_args(&case, 3, flags);
            // SAFETY: device buffers sized for the config.
            unsafe { ep_ll_dispatch(ctx.0, &a, stream()) }
        };
        let combine = |flags| {
            let a = bufs.combine_args(&case, 3, flags);
            // SAFETY: as above.
            unsafe { ep_ll_combine(ctx.0, &a, stream()) }
        };
        assert_eq!(dispatch(EP_LL_RECV_ONLY), EP_ERR_INVALID_ARGUMENT);
        assert_eq!(
            combine(EP_LL_SEND_ONLY),
            EP_ERR_INVALID_ARGUMENT,
            "no dispatch yet"
        );
        ok(dispatch(EP_LL_SEND_ONLY), "send");
        assert_eq!(dispatch(EP_LL_SEND_ONLY), EP_ERR_INVALID_ARGUMENT);
        assert_eq!(combine(0), EP_ERR_INVALID_ARGUMENT);
        ok(dispatch(EP_LL_RECV_ONLY), "receive");
        assert_eq!(combine(EP_LL_RECV_ONLY), EP_ERR_INVALID_ARGUMENT);
        ok(combine(0), "combine");
        sync();
        assert_eq!(async_status(ctx), EP_SUCCESS);
        check(&case, rank, &all, &bufs, "after rejected calls");
        gate();
    });
}

/// Ranks sharing a GPU must each pass a stream of their own: the legacy
/// default stream is refused before anything is enqueued, and the context
/// still works with a stream.
#[test]
#[ignore = "needs CUDA GPUs"]
fn ranks_sharing_a_gpu_refuse_the_legacy_stream() {
    let world = 2;
    let case = Case::new(world, 128, 2, 8, 8);
    let on_gpu_0 = |_| 0;
    run_gpu_world_on(world, &case.config(20_000), on_gpu_0, |rank, ctx| {
        let all = inputs(&case, 0, &[3, 3]);
        let bufs = Bufs::new(&case, &all[rank]);
        gate();
        let a = bufs.dispatch_args(&case, 3, 0);
        for legacy in [null_mut(), 1usize as ep_stream_t] {
            // SAFETY: device buffers sized for the config.
            let status = unsafe { ep_ll_dispatch(ctx.0, &a, legacy) };
            assert_eq!(status, EP_ERR_INVALID_ARGUMENT);
            assert!(last_error().contains("own stream"), "{}", last_error());
        }
        run_ops(ctx, &case, &bufs, 3, stream());
        sync();
        assert_eq!(async_status(ctx), EP_SUCCESS);
        check(&case, rank, &all, &bufs, "after the refused calls");
        gate();
    });
}

/// The dispatch outputs the API lets a caller leave out (NULL), left out one
/// at a time, on 1 and 2 ranks: nothing faults, the other outputs and the
/// combine after it are as the reference says.
#[test]
#[ignore = "needs CUDA GPUs"]
fn optional_outputs_may_be_null() {
    for world in [1, 2] {
        let case = Case::new(world, 512, 4, 16, 32);
        for field in ["recv_src_info", "recv_layout_range"] {
            run_gpu_world(world, &case.config(20_000), |rank, ctx| {
                let all = inputs(&case, 0, &vec![29; world]);
                let bufs = Bufs::new(&case, &all[rank]);
                gate();
                let mut a = bufs.dispatch_args(&case, 29, 0);
                match field {
                    "recv_src_info" => a.recv_src_info = null_mut(),
                    _ => a.recv_layout_range = null_mut(),
                }
                let what = format!("world {world} rank {rank}, {field} NULL");
                // SAFETY: device buffers sized for the config.
                ok(unsafe { ep_ll_dispatch(ctx.0, &a, stream()) }, &what);
                let mut c = bufs.combine_args(&case, 29, 0);
                c.src_info = null();
                c.layout_range = null();
                // SAFETY: as above.
                ok(unsafe { ep_ll_combine(ctx.0, &c, stream()) }, &what);
                sync();
                assert_eq!(async_status(ctx), EP_SUCCESS, "{what}");
                check_but(&case, rank, &all, &bufs, field, &what);
                gate();
            });
        }
    }
}
