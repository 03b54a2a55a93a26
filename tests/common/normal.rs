//! The normal-mode GPU tests' machinery, shared by tests/gpu_normal.rs and
//! tests/gpu_hierarchical.rs: random inputs, poisoned device outputs checked
//! bit for bit against the reference, and `check_shape`, which runs
//! dispatches and both combines of many token counts on one context shape
//! (with `ranks_per_node`, on several nodes).

use super::gpu::*;
use super::{
    bf16_to_bytes, bytes_of, dtype_code, last_error, random_bf16, routing, weights, Ctx, Handle,
    Rng,
};
use ep::capi::*;
use ep::reference::hierarchical::{self, NodeShape};
use ep::reference::normal::{
    combine, dispatch, expert_partials, worst_case_rows, Dispatched, RankTokens, Returned,
};
use ep::reference::{Dtype, Topology};
use ep::runtime::describe;
use half::bf16;
use std::time::{Duration, Instant};

/// One rank's dispatch input, owned.
#[derive(Clone)]
pub struct Input {
    pub num_tokens: usize,
    pub x: Vec<u8>,
    pub scales: Vec<f32>,
    pub topk_idx: Vec<i32>,
    pub topk_weights: Vec<f32>,
}

impl Input {
    pub fn random(rng: &mut Rng, topo: &Topology, dtype: Dtype, n: usize, skewed: bool) -> Input {
        let x = match dtype {
            Dtype::Bf16 => bf16_to_bytes(&random_bf16(rng, n * topo.hidden)),
            // Any byte pattern: dispatch moves bits.
            Dtype::Fp8E4m3 => {
                let mut bytes = vec![0; n * topo.hidden];
                rng.bytes(&mut bytes);
                bytes
            }
        };
        let hot = skewed.then(|| rng.below(topo.num_experts));
        Input {
            num_tokens: n,
            x,
            scales: weights(rng, n * dtype.scales_per_row(topo.hidden)),
            topk_idx: routing(rng, topo.num_experts, topo.topk, n, 0.1, hot),
            topk_weights: weights(rng, n * topo.topk),
        }
    }

    pub fn view(&self) -> RankTokens<'_> {
        RankTokens {
            num_tokens: self.num_tokens,
            x: &self.x,
            scales: &self.scales,
            topk_idx: &self.topk_idx,
            topk_weights: &self.topk_weights,
        }
    }
}

/// The reference dispatch of every rank of `topo`, `inputs` being every
/// rank's input.
pub fn dispatch_all(
    topo: Topology,
    dtype: Dtype,
    inputs: &[Input],
    alignment: usize,
) -> Vec<Dispatched> {
    let views: Vec<RankTokens> = inputs.iter().map(Input::view).collect();
    (0..topo.world)
        .map(|r| dispatch(topo, dtype, &views, r, alignment))
        .collect()
}

/// Device copies of one rank's input.
pub struct DeviceInput {
    pub x: DevBuf,
    pub scales: DevBuf,
    pub topk_idx: DevBuf,
    pub topk_weights: DevBuf,
}

impl DeviceInput {
    pub fn new(input: &Input) -> DeviceInput {
        DeviceInput {
            x: DevBuf::from(&input.x),
            scales: DevBuf::from(&input.scales),
            topk_idx: DevBuf::from(&input.topk_idx),
            topk_weights: DevBuf::from(&input.topk_weights),
        }
    }

    /// Overwrites the copies with `input` (at most as large as the first).
    pub fn upload(&self, input: &Input) {
        self.x.upload(&input.x);
        self.scales.upload(&input.scales);
        self.topk_idx.upload(&input.topk_idx);
        self.topk_weights.upload(&input.topk_weights);
    }
}

/// Poisoned device outputs of a dispatch, at the worst-case capacities.
pub struct Outputs {
    pub recv_rows: usize,
    pub expert_rows: usize,
    pub recv_x: DevBuf,
    pub recv_scales: DevBuf,
    pub recv_topk_idx: DevBuf,
    pub recv_topk_weights: DevBuf,
    pub recv_src_info: DevBuf,
    pub recv_num_rows: DevBuf,
    pub expert_x: DevBuf,
    pub expert_scales: DevBuf,
    pub expert_weights: DevBuf,
    pub expert_src_row: DevBuf,
    pub expert_offsets: DevBuf,
    pub expert_counts: DevBuf,
}

impl Outputs {
    pub fn new(ctx: &Ctx, topo: &Topology, alignment: i32) -> Outputs {
        let (mut recv_rows, mut expert_rows) = (0, 0);
        // SAFETY: live context, valid out-parameters.
        ok(
            unsafe { ep_get_dispatch_capacity(ctx.0, alignment, &mut recv_rows, &mut expert_rows) },
            "capacity",
        );
        let (r, e) = (recv_rows as usize, expert_rows as usize);
        let (h, k, l) = (topo.hidden, topo.topk, topo.local_experts());
        Outputs {
            recv_rows: r,
            expert_rows: e,
            recv_x: DevBuf::poisoned(r * h * 2),
            recv_scales: DevBuf::of::<f32>(r * h / 128),
            recv_topk_idx: DevBuf::of::<i32>(r * k),
            recv_topk_weights: DevBuf::of::<f32>(r * k),
            recv_src_info: DevBuf::of::<i32>(r * 2),
            recv_num_rows: DevBuf::of::<i32>(1),
            expert_x: DevBuf::poisoned(e * h * 2),
            expert_scales: DevBuf::of::<f32>(e * h / 128),
            expert_weights: DevBuf::of::<f32>(e),
            expert_src_row: DevBuf::of::<i32>(e),
            expert_offsets: DevBuf::of::<i32>(l + 1),
            expert_counts: DevBuf::of::<i32>(l),
        }
    }

    pub fn poison(&self) {
        for b in [
            &self.recv_x,
            &self.recv_scales,
            &self.recv_topk_idx,
            &self.recv_topk_weights,
            &self.recv_src_info,
            &self.recv_num_rows,
            &self.expert_x,
            &self.expert_scales,
            &self.expert_weights,
            &self.expert_src_row,
            &self.expert_offsets,
            &self.expert_counts,
        ] {
            b.poison();
        }
    }

    /// Dispatch arguments writing both orders into these outputs.
    pub fn args(
        &self,
        input: &DeviceInput,
        n: usize,
        dtype: Dtype,
        alignment: i32,
    ) -> ep_dispatch_args_t {
        let mut a = super::dispatch_args();
        a.num_tokens = n as i32;
        a.dtype = dtype_code(dtype);
        a.x = input.x.as_const();
        a.x_scales = input.scales.as_const();
        a.topk_idx = input.topk_idx.as_const();
        a.topk_weights = input.topk_weights.as_const();
        a.recv_capacity = self.recv_rows as i32;
        a.expert_alignment = alignment;
        a.recv_x = self.recv_x.as_mut();
        a.recv_x_scales = self.recv_scales.as_mut();
        a.recv_topk_idx = self.recv_topk_idx.as_mut();
        a.recv_topk_weights = self.recv_topk_weights.as_mut();
        a.recv_src_info = self.recv_src_info.as_mut();
        a.recv_num_tokens = self.recv_num_rows.as_mut();
        a.expert_capacity = self.expert_rows as i32;
        a.expert_x = self.expert_x.as_mut();
        a.expert_x_scales = self.expert_scales.as_mut();
        a.expert_weights = self.expert_weights.as_mut();
        a.expert_src_row = self.expert_src_row.as_mut();
        a.expert_offsets = self.expert_offsets.as_mut();
        a.expert_counts = self.expert_counts.as_mut();
        a
    }

    /// Checks every output against the reference, bit for bit.
    pub fn check(&self, topo: &Topology, dtype: Dtype, want: &Dispatched, what: &str) {
        self.check_but(topo, dtype, want, "", what);
    }

    /// Checks the outputs of a dispatch with `EP_DISPATCH_KEEP_PADDING`:
    /// as [`Outputs::check`], but the padding rows of `expert_x` and
    /// `expert_x_scales` must still hold the poison they were given.
    pub fn check_kept_padding(&self, topo: &Topology, dtype: Dtype, want: &Dispatched, what: &str) {
        let mut kept = want.clone();
        let (row_bytes, sc) = (
            dtype.row_bytes(topo.hidden),
            dtype.scales_per_row(topo.hidden),
        );
        let poison = f32::from_bits(u32::from_ne_bytes([super::POISON; 4]));
        for j in (0..want.expert_rows).filter(|&j| want.expert_src_row[j] < 0) {
            kept.expert_x[j * row_bytes..][..row_bytes].fill(super::POISON);
            kept.expert_scales[j * sc..][..sc].fill(poison);
        }
        self.check(topo, dtype, &kept, what);
    }

    /// Checks every output but the one named `left_out` (its C field name)
    /// against the reference, bit for bit.
    pub fn check_but(
        &self,
        topo: &Topology,
        dtype: Dtype,
        want: &Dispatched,
        left_out: &str,
        what: &str,
    ) {
        let rows = [want.num_rows as i32];
        // In the order of `defined`.
        let wanted: [&[u8]; 12] = [
            bytes_of(&rows),
            &want.x,
            bytes_of(&want.scales),
            bytes_of(&want.topk_idx),
            bytes_of(&want.topk_weights),
            bytes_of(&want.src_info),
            bytes_of(&want.expert_offsets),
            bytes_of(&want.expert_counts),
            &want.expert_x,
            bytes_of(&want.expert_scales),
            bytes_of(&want.expert_weights),
            bytes_of(&want.expert_src_row),
        ];
        let got = self.defined(topo, dtype, want.num_rows, want.expert_rows);
        for ((name, got), want) in got.into_iter().zip(wanted) {
            if name != left_out {
                assert!(got == want, "{what}: {name}");
            }
        }
    }

    /// The bytes of every output that a dispatch of `rows` source-order rows
    /// and `erows` expert-major rows (padding included) defines, named by
    /// their C fields.
    pub fn defined(
        &self,
        topo: &Topology,
        dtype: Dtype,
        rows: usize,
        erows: usize,
    ) -> Vec<(&'static str, Vec<u8>)> {
        let (h, k, l) = (topo.hidden, topo.topk, topo.local_experts());
        let row_bytes = dtype.row_bytes(h);
        let sc = dtype.scales_per_row(h);
        // Bytes of `n` 32-bit values (ints or floats) or of `n` rows.
        let words = |buf: &DevBuf, n: usize| buf.download::<u8>(4 * n);
        let rows_of = |buf: &DevBuf, n: usize| buf.download::<u8>(n * row_bytes);
        vec![
            ("recv_num_tokens", words(&self.recv_num_rows, 1)),
            ("recv_x", rows_of(&self.recv_x, rows)),
            ("recv_x_scales", words(&self.recv_scales, rows * sc)),
            ("recv_topk_idx", words(&self.recv_topk_idx, rows * k)),
            (
                "recv_topk_weights",
                words(&self.recv_topk_weights, rows * k),
            ),
            ("recv_src_info", words(&self.recv_src_info, rows * 2)),
            ("expert_offsets", words(&self.expert_offsets, l + 1)),
            ("expert_counts", words(&self.expert_counts, l)),
            ("expert_x", rows_of(&self.expert_x, erows)),
            ("expert_x_scales", words(&self.expert_scales, erows * sc)),
            ("expert_weights", words(&self.expert_weights, erows)),
            ("expert_src_row", words(&self.expert_src_row, erows)),
        ]
    }
}

/// The combine inputs of rank `rank` for round `round`: random source-order
/// rows and random expert-major rows of the right counts.
pub fn combine_inputs(topo: &Topology, d: &Dispatched, seed: u64) -> (Vec<bf16>, Vec<bf16>) {
    /// Every this many channels one is a negative zero in the source-order
    /// rows, and the negative BF16 of least magnitude in the expert-major
    /// rows (times a weight below 1/2, the sum of one row rounds to -0):
    /// a sum made from zero turns them into +0, and a row that is a token's
    /// whole sum must too.
    const SIGNED_ZERO_EVERY: usize = 61;
    let mut rng = Rng::new(seed);
    let mut rows = random_bf16(&mut rng, d.num_rows * topo.hidden);
    let mut experts = random_bf16(&mut rng, d.expert_rows * topo.hidden);
    for v in rows.iter_mut().step_by(SIGNED_ZERO_EVERY) {
        *v = bf16::NEG_ZERO;
    }
    for v in experts.iter_mut().step_by(SIGNED_ZERO_EVERY) {
        *v = -bf16::from_bits(1);
    }
    (rows, experts)
}

/// Asserts `got` equals `want` within BF16 rounding (one ulp of the larger
/// magnitude; zeros of the same sign), and returns whether it is bit-exact.
pub fn assert_close(got: &[bf16], want: &[bf16], what: &str) -> bool {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut exact = true;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if g.to_bits() == w.to_bits() {
            continue;
        }
        exact = false;
        let (g, w) = (g.to_f32(), w.to_f32());
        assert!(
            g != 0.0 || w != 0.0,
            "{what}: element {i}: got {g:?}, want {w:?} (zeros of different signs)"
        );
        let tolerance = w.abs().max(g.abs()) / 128.0 + 1e-6;
        assert!(
            (g - w).abs() <= tolerance,
            "{what}: element {i}: got {g}, want {w}"
        );
    }
    exact
}

/// One round of `check_shape`: every rank's inputs, and what the reference
/// says about them, worked out once by the first rank that needs it (the
/// ranks of a process share it).
pub struct Round {
    pub dtype: Dtype,
    pub inputs: Vec<Input>,
    pub alignment: i32,
    pub expected: std::sync::OnceLock<Expected>,
}

/// The reference's results of one round.
pub struct Expected {
    /// Every rank's dispatch.
    pub all: Vec<Dispatched>,
    /// Every rank's combine inputs: (source-order rows, expert-major rows).
    pub combine_x: Vec<(Vec<bf16>, Vec<bf16>)>,
    /// Every rank's combine output from [source-order, expert-major] input.
    pub combined: Vec<[Vec<bf16>; 2]>,
}

impl Round {
    /// The reference's results; with `nodes` (several nodes) the combine in
    /// the hierarchical summation order.
    pub fn expected(&self, topo: Topology, nodes: Option<NodeShape>, seed: u64) -> &Expected {
        self.expected.get_or_init(|| {
            let world = topo.world;
            let all = dispatch_all(topo, self.dtype, &self.inputs, self.alignment as usize);
            let combine_x: Vec<(Vec<bf16>, Vec<bf16>)> = all
                .iter()
                .enumerate()
                .map(|(r, d)| combine_inputs(&topo, d, seed ^ r as u64))
                .collect();
            let partials: Vec<Vec<bf16>> = all
                .iter()
                .zip(&combine_x)
                .map(|(d, (_, experts))| expert_partials(topo, d, experts))
                .collect();
            // Every rank's combine output when rank r returns `rows[r]`.
            let combined_all = |rows: Vec<&[bf16]>| -> Vec<Vec<bf16>> {
                let returned: Vec<Returned> = all
                    .iter()
                    .zip(rows)
                    .map(|(d, rows)| Returned {
                        rows,
                        src_info: &d.src_info,
                    })
                    .collect();
                (0..world)
                    .map(|rank| {
                        let n = self.inputs[rank].num_tokens;
                        match nodes {
                            Some(shape) => hierarchical::combine(topo, shape, rank, n, &returned),
                            None => combine(topo, rank, n, &returned),
                        }
                    })
                    .collect()
            };
            let from_rows = combined_all(combine_x.iter().map(|x| &x.0[..]).collect());
            let from_experts = combined_all(partials.iter().map(|p| &p[..]).collect());
            let combined = from_rows
                .into_iter()
                .zip(from_experts)
                .map(|(a, b)| [a, b])
                .collect();
            Expected {
                all,
                combine_x,
                combined,
            }
        })
    }
}

/// Runs dispatch + both combines for every (token count, routing, dtype)
/// on one context shape, every rank checked against the reference.
pub fn check_shape(
    ranks: Ranks,
    world: usize,
    hidden: usize,
    topk: usize,
    experts: usize,
    seed: u64,
) {
    check_shape_on_nodes(ranks, world, 0, hidden, topk, experts, seed);
}

/// As [`check_shape`], with `ranks_per_node` in the config (0: the hosts
/// decide): with several nodes the combine must follow the hierarchical
/// summation order (`ep::reference::hierarchical::combine`).
pub fn check_shape_on_nodes(
    ranks: Ranks,
    world: usize,
    ranks_per_node: usize,
    hidden: usize,
    topk: usize,
    experts: usize,
    seed: u64,
) {
    let topo = Topology {
        world,
        num_experts: experts,
        topk,
        hidden,
    };
    let mut cfg = gpu_config(hidden as i32, topk as i32, experts as i32, 4096, 0, 20_000);
    cfg.ranks_per_node = ranks_per_node as i32;
    let nodes = (ranks_per_node > 0 && ranks_per_node < world)
        .then(|| NodeShape::new(world, ranks_per_node));
    // Every rank's inputs of every round, made once, by the first rank that
    // needs them (a rank process of another call never does).
    let rounds = std::sync::OnceLock::new();
    let make_rounds = || {
        let mut rounds = Vec::new();
        let mut rng = Rng::new(seed);
        for (case, counts) in [
            vec![0; world],
            (0..world).map(|r| (r == world - 1) as usize).collect(),
            (0..world).map(|r| 17 - r).collect(),
            (0..world).map(|r| 4096 - 100 * r).collect::<Vec<_>>(),
        ]
        .into_iter()
        .enumerate()
        {
            for dtype in [Dtype::Bf16, Dtype::Fp8E4m3] {
                let skewed = case % 2 == 1 || dtype == Dtype::Fp8E4m3;
                let inputs: Vec<Input> = counts
                    .iter()
                    .map(|&n| Input::random(&mut rng, &topo, dtype, n, skewed))
                    .collect();
                rounds.push(Round {
                    dtype,
                    inputs,
                    alignment: [1, 4, 128][rounds.len() % 3],
                    expected: std::sync::OnceLock::new(),
                });
            }
        }
        rounds
    };
    let shape = format!(
        "world {world} ranks_per_node {ranks_per_node} hidden {hidden} topk {topk} experts {experts}"
    );
    run_gpu_ranks(ranks, &shape, world, &cfg, |rank, ctx| {
        let rounds: &Vec<Round> = rounds.get_or_init(make_rounds);
        let handle = ctx.handle();
        let mut exact = true;
        for (i, round) in rounds.iter().enumerate() {
            let (dtype, alignment) = (round.dtype, round.alignment);
            let n = round.inputs[rank].num_tokens;
            // Every third round keeps the padding rows as they were.
            let keep_padding = i % 3 == 2;
            let what = format!(
                "{shape} rank {rank} round {i} ({}, {n} tokens, alignment {alignment}{})",
                describe::dtype(dtype),
                if keep_padding { ", padding kept" } else { "" },
            );
            let expected = round.expected(topo, nodes, seed ^ (i as u64 * 64));
            let want = &expected.all[rank];

            // Every device buffer of the round, made before the gate (see
            // tests/common/gpu.rs).
            let input = DeviceInput::new(&round.inputs[rank]);
            let out = Outputs::new(ctx, &topo, alignment);
            let (rows, experts) = &expected.combine_x[rank];
            let combine_x = [DevBuf::from(rows), DevBuf::from(experts)];
            let y = DevBuf::of::<bf16>(n * hidden);
            gate();

            let mut args = out.args(&input, n, dtype, alignment);
            let no_sync = i % 2 == 1;
            if keep_padding {
                args.flags |= EP_DISPATCH_KEEP_PADDING;
            }
            let mut host_rows = -1;
            let mut host_counts = vec![-1; topo.local_experts()];
            if no_sync {
                args.flags |= EP_DISPATCH_NO_HOST_SYNC;
            } else {
                args.host_recv_num_tokens = &mut host_rows;
                args.host_expert_counts = host_counts.as_mut_ptr();
            }
            // SAFETY: device buffers of the sizes the arguments give.
            ok(
                unsafe { ep_dispatch(ctx.0, &args, handle.0, stream()) },
                &what,
            );
            sync();
            if keep_padding {
                out.check_kept_padding(&topo, dtype, want, &what);
            } else {
                out.check(&topo, dtype, want, &what);
            }
            if !no_sync {
                assert_eq!(host_rows, want.num_rows as i32, "{what}: host rows");
                assert_eq!(host_counts, want.expert_counts, "{what}: host counts");
            }

            for (layout, (x, combined)) in [EP_COMBINE_SOURCE_ORDER, EP_COMBINE_EXPERT_MAJOR]
                .into_iter()
                .zip(combine_x.iter().zip(&expected.combined[rank]))
            {
                y.poison();
                let mut c = super::combine_args();
                c.input_layout = layout;
                c.x = x.as_const();
                c.out = y.as_mut();
                // SAFETY: device buffers of the sizes the handle's dispatch gives.
                ok(unsafe { ep_combine(ctx.0, &c, handle.0, stream()) }, &what);
                let got = y.download::<bf16>(n * hidden);
                let kind = if layout == EP_COMBINE_EXPERT_MAJOR {
                    "expert-major"
                } else {
                    "source-order"
                };
                // A device error first: it explains an output left unwritten.
                assert_eq!(
                    async_status(ctx),
                    EP_SUCCESS,
                    "{what}: combine {kind}: {}",
                    last_error()
                );
                exact &= assert_close(&got, combined, &format!("{what}: combine {kind}"));
            }
            assert_eq!(async_status(ctx), EP_SUCCESS, "{what}");
            // Every rank is done with the round before any frees its buffers.
            gate();
        }
        println!(
            "{shape} ({ranks:?}) rank {rank}: dispatch bit-exact, combine {}",
            if exact {
                "bit-exact"
            } else {
                "within BF16 rounding"
            }
        );
    });
}

/// Whether `world` ranks of `topo` fit the machine: the GPU that holds the
/// most ranks has room for their worst-case outputs and buffers, and the
/// host for the reference's results (`Expected` of the two large rounds).
/// Prints why when they do not.
pub fn fits(topo: &Topology, max_tokens: usize) -> bool {
    let world = topo.world;
    let (rows, expert_rows) = worst_case_rows(*topo, max_tokens, 128);
    let row = topo.hidden * 2;
    // Outputs, the library's buffers (returned rows and staged tokens), and
    // the combine's input and output.
    let per_rank = (2 * rows + expert_rows) * row + 2 * max_tokens * row;
    let ranks_per_gpu = world.div_ceil(device_count());
    let (free, _) = memory_info(0);
    // A rank receives at most W * T source rows and T * topk expert rows;
    // a round keeps about three copies of them per rank.
    let host = 5 * world * (world + topo.topk) * max_tokens * row;
    let host_total = host_memory();
    let fits = ranks_per_gpu * per_rank <= free / 10 * 8 && host <= host_total / 2;
    if !fits {
        println!(
            "skipped world {world} hidden {} topk {} experts {}: {ranks_per_gpu} ranks of {} MiB \
             on one GPU with {} MiB free, {} MiB of host memory for the reference of {} MiB",
            topo.hidden,
            topo.topk,
            topo.num_experts,
            per_rank >> 20,
            free >> 20,
            host >> 20,
            host_total >> 20
        );
    }
    fits
}

/// Bytes of host memory (`MemTotal` of /proc/meminfo; 0 when unknown).
pub fn host_memory() -> usize {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
        .map_or(0, |kib| kib << 10)
}

/// The shape of the tests of one lone dispatch: 2 ranks, 8 experts, top-2,
/// hidden 128.
pub const SMALL: Topology = Topology {
    world: 2,
    num_experts: 8,
    topk: 2,
    hidden: 128,
};

/// A GPU config of [`SMALL`], up to 64 tokens per rank, with `timeout_ms`.
pub fn small_config(timeout_ms: u32) -> ep_config_t {
    let t = SMALL;
    gpu_config(
        t.hidden as i32,
        t.topk as i32,
        t.num_experts as i32,
        64,
        0,
        timeout_ms,
    )
}

/// One BF16 dispatch of [`SMALL`] (alignment 1): its input on the device,
/// its poisoned outputs, and its arguments.
pub struct SmallDispatch {
    pub input: DeviceInput,
    pub out: Outputs,
    pub args: ep_dispatch_args_t,
}

impl SmallDispatch {
    /// The dispatch of `input`.
    pub fn new(ctx: &Ctx, input: &Input) -> SmallDispatch {
        let dev = DeviceInput::new(input);
        let out = Outputs::new(ctx, &SMALL, 1);
        let args = out.args(&dev, input.num_tokens, Dtype::Bf16, 1);
        SmallDispatch {
            input: dev,
            out,
            args,
        }
    }

    /// The dispatch of `n` random tokens (uniform routing) from `seed`.
    pub fn random(ctx: &Ctx, seed: u64, n: usize) -> SmallDispatch {
        let mut rng = Rng::new(seed);
        let input = Input::random(&mut rng, &SMALL, Dtype::Bf16, n, false);
        SmallDispatch::new(ctx, &input)
    }

    /// `ep_dispatch` of these arguments on the rank's stream.
    pub fn run(&self, ctx: &Ctx, handle: &Handle) -> ep_status_t {
        // SAFETY: device buffers of the sizes the arguments give.
        unsafe { ep_dispatch(ctx.0, &self.args, handle.0, stream()) }
    }

    /// Makes the dispatch while a peer never joins: it fails with
    /// `EP_ERR_TIMEOUT` naming every needle, before three `timeout`s, and
    /// the context's asynchronous status is the timeout.
    pub fn expect_timeout(&self, ctx: &Ctx, handle: &Handle, timeout: Duration, needles: &[&str]) {
        let start = Instant::now();
        let status = self.run(ctx, handle);
        let took = start.elapsed();
        assert_eq!(status, EP_ERR_TIMEOUT, "{}", last_error());
        let message = last_error();
        for needle in needles {
            assert!(message.contains(needle), "{message}");
        }
        assert!(took < timeout * 3, "took {took:?}");
        assert_eq!(async_status(ctx), EP_ERR_TIMEOUT);
    }
}
