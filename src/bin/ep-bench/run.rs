//! What each rank thread does: inputs, contexts, the timed loops, the
//! cross-rank statistics and the tables (printed by rank 0).

use std::cell::Cell;
use std::ptr;
use std::sync::Arc;
use std::time::Instant;

use ep::abi::{
    LL_TIME_ACKED, LL_TIME_ANNOUNCED, LL_TIME_COUNTS_IN, LL_TIME_NUMBERED, LL_TIME_POINTS,
    LL_TIME_RECEIVED, LL_TIME_SENT, LL_TIME_START,
};
use ep::capi::*;
use ep::runtime::backend::LlTimeline;

use crate::device::{
    capture_graph, destroy_graph, epc, fail, launch_graph, Buf, Dev, Gate, HostWord,
};
use crate::nccl::{Comm, Nccl};
use crate::report::{Table, Value};
use crate::{Opts, Shared};

/// Expert-major segment alignment used by the expert-major dispatch.
const EXPERT_ALIGNMENT: i32 = 128;

/// The points of a low-latency launch that the per-phase breakdown names
/// (`ep::abi::LL_TIME_*`, noted by each block's first thread).
const LL_PHASES: [(usize, &str); 6] = [
    (LL_TIME_NUMBERED, "call numbered (begin_call)"),
    (LL_TIME_ACKED, "send: peers acknowledged the set"),
    (
        LL_TIME_ANNOUNCED,
        "send: counts and flags out (combine: closing signals)",
    ),
    (LL_TIME_SENT, "send phase done"),
    (LL_TIME_COUNTS_IN, "receive: every source's counts in"),
    (LL_TIME_RECEIVED, "receive phase done"),
];

/// For each operation (dispatch, combine) and each of `LL_PHASES`: when
/// the first and the last block passed the point, in us after the
/// operation's first block started (NaN where no block passed it).
fn phase_times(t: &LlTimeline) -> Vec<f64> {
    let mut out = Vec::new();
    for op in 0..2 {
        let at =
            |block: usize, point: usize| t.ns[(op * t.blocks + block) * LL_TIME_POINTS + point];
        let start = (0..t.blocks)
            .map(|b| at(b, LL_TIME_START))
            .min()
            .unwrap_or(0);
        for &(point, _) in &LL_PHASES {
            let passed: Vec<f64> = (0..t.blocks)
                .map(|b| at(b, point))
                .filter(|&ns| ns != 0)
                .map(|ns| ns.saturating_sub(start) as f64 / 1e3)
                .collect();
            out.push(passed.iter().copied().fold(f64::NAN, f64::min));
            out.push(passed.iter().copied().fold(f64::NAN, f64::max));
        }
    }
    out
}

/// The median of the samples that are numbers, or NaN.
fn median_of(samples: &[f64]) -> f64 {
    let mut v: Vec<f64> = samples.iter().copied().filter(|x| !x.is_nan()).collect();
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        f64::NAN
    } else {
        percentile(&v, 0.5)
    }
}

/// splitmix64: small, fast, seeded per rank.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (((self.next() >> 32) * n as u64) >> 32) as usize
    }
}

/// Uniform routing of `tokens` tokens: `topk` distinct experts each, drawn
/// from `rng`; with `weights`, each expert's weight (in [0, 1)) is drawn
/// right after it, else the weights are empty.
pub(crate) fn uniform_routing(
    rng: &mut Rng,
    o: &Opts,
    tokens: usize,
    weights: bool,
) -> (Vec<i32>, Vec<f32>) {
    let mut idx = Vec::with_capacity(tokens * o.topk);
    let mut w = Vec::new();
    for _ in 0..tokens {
        let start = idx.len();
        while idx.len() - start < o.topk {
            let e = rng.below(o.experts) as i32;
            if !idx[start..].contains(&e) {
                idx.push(e);
                if weights {
                    w.push(rng.unit());
                }
            }
        }
    }
    (idx, w)
}

/// How long `call` takes on the host, in microseconds.
fn host_us(call: impl FnOnce()) -> f64 {
    let start = Instant::now();
    call();
    start.elapsed().as_secs_f64() * 1e6
}

fn random_bf16(rng: &mut Rng, n: usize) -> Vec<u16> {
    (0..n)
        .map(|_| half::bf16::from_f32(rng.unit() * 2.0 - 1.0).to_bits())
        .collect()
}

/// One rank's inputs for the largest token count; smaller counts use a prefix.
struct Inputs {
    x: Buf,
    x_fp8: Buf,
    x_scales: Buf,
    topk_idx: Buf,
    topk_weights: Buf,
}

fn make_inputs(dev: &Dev, o: &Opts, rank: usize, tokens: usize) -> Inputs {
    let mut rng = Rng(0x5EED_0000 + rank as u64 * 7919);
    let h = o.hidden;
    let x = Buf::from_slice(dev, &random_bf16(&mut rng, tokens * h));
    // E4M3 bytes, never the NaN encodings (0x7F, 0xFF).
    let fp8: Vec<u8> = (0..tokens * h)
        .map(|_| (rng.below(0x7F) as u8) | ((rng.next() as u8) & 0x80))
        .collect();
    let x_fp8 = Buf::from_slice(dev, &fp8);
    let scales: Vec<f32> = (0..tokens * h / 128)
        .map(|_| 0.001 + rng.unit() * 0.01)
        .collect();
    let x_scales = Buf::from_slice(dev, &scales);
    let (idx, w) = uniform_routing(&mut rng, o, tokens, true);
    Inputs {
        x,
        x_fp8,
        x_scales,
        topk_idx: Buf::from_slice(dev, &idx),
        topk_weights: Buf::from_slice(dev, &w),
    }
}

/// Fills a large BF16 buffer with random values by repeating a random block.
fn fill_random_bf16(dev: &Dev, buf: &Buf, rng: &mut Rng) {
    let elems = buf.bytes / 2;
    let block = random_bf16(rng, elems.min(1 << 22));
    let mut at = 0;
    while at < elems {
        let n = block.len().min(elems - at);
        buf.upload(dev, &block[..n], at * 2);
        at += n;
    }
}

struct Stats {
    median: f64,
    p10: f64,
    p90: f64,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// One table row: the op's name, this rank's times per iteration, received
/// bytes per rank, the NCCL median and the copy floor.
struct Row<'a> {
    op: String,
    times: &'a [f64],
    bytes: Option<f64>,
    nccl_us: Option<f64>,
    /// The time a device-to-device copy takes to read and write as many
    /// bytes as the op must (see [`Rank::copy_gbps`]).
    floor_us: Option<f64>,
}

fn row(op: impl Into<String>, times: &[f64], bytes: Option<f64>, nccl_us: Option<f64>) -> Row<'_> {
    Row {
        op: op.into(),
        times,
        bytes,
        nccl_us,
        floor_us: None,
    }
}

impl Row<'_> {
    /// The row with its copy floor: `bytes` read and written at
    /// `copy_gbps` (read + write GB/s).
    fn floor(self, bytes: f64, copy_gbps: f64) -> Self {
        Row {
            floor_us: Some(bytes / copy_gbps / 1e3),
            ..self
        }
    }
}

/// Bytes of one device-to-device copy that measures the copy floor's
/// bandwidth (a sixteenth of it on the host backend), and the copies timed.
const COPY_BYTES: usize = 256 << 20;
const COPY_ITERS: usize = 20;

/// Where a low-latency dispatch/combine pair passes the routing weights.
#[derive(Clone, Copy, PartialEq, Eq)]
enum WeightsAt {
    /// The dispatch gets them: the combine sums each token's local experts
    /// on the expert side and returns one row per (token, rank).
    Dispatch,
    /// The combine gets them: every (token, expert) row returns and is
    /// weighted at the source.
    Combine,
}

impl std::fmt::Display for WeightsAt {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(match self {
            WeightsAt::Dispatch => "weights at dispatch",
            WeightsAt::Combine => "weights at combine",
        })
    }
}

/// A low-latency context's buffers, in the masked layout of its
/// `ll_max_tokens_per_rank` (the largest token count of the run).
struct LlBuffers {
    recv_x: Buf,
    recv_scales: Buf,
    recv_count: Buf,
    recv_src: Buf,
    recv_range: Buf,
    /// The expert outputs the combines send back.
    comb_x: Buf,
    out: Buf,
}

pub struct Rank {
    r: usize,
    world: usize,
    sh: Arc<Shared>,
    o: Arc<Opts>,
    dev: Dev,
    nccl: Option<(Nccl, Comm)>,
    /// `None` on the host backend and where the driver cannot gate a stream.
    gate: Option<Gate>,
}

/// Times per timed iteration of each sub-op (sub-op index, then iteration).
type Samples = Vec<Vec<f64>>;

impl Rank {
    fn barrier(&self) {
        self.sh.barrier.wait();
    }

    /// Every rank passes a vector; every rank gets all of them, by rank.
    fn allgather(&self, v: Vec<f64>) -> Vec<Vec<f64>> {
        self.sh.slots.lock().unwrap()[self.r] = v;
        self.barrier();
        let all = self.sh.slots.lock().unwrap().clone();
        self.barrier();
        all
    }

    /// Median/p10/p90 over iterations of the slowest rank's time.
    fn stats(&self, times: &[f64]) -> Stats {
        let all = self.allgather(times.to_vec());
        let n = all.iter().map(Vec::len).min().unwrap_or(0);
        let mut worst: Vec<f64> = (0..n)
            .map(|i| all.iter().map(|t| t[i]).fold(f64::MIN, f64::max))
            .collect();
        worst.sort_by(|a, b| a.total_cmp(b));
        Stats {
            median: percentile(&worst, 0.5),
            p10: percentile(&worst, 0.1),
            p90: percentile(&worst, 0.9),
        }
    }

    fn mean(&self, v: f64) -> f64 {
        let all = self.allgather(vec![v]);
        all.iter().map(|x| x[0]).sum::<f64>() / all.len() as f64
    }

    /// Prints a table's title and head; records it for `--json`.
    fn table_start(&self, title: &str, mode: &'static str, sms: Option<i32>, iterations: usize) {
        if self.r == 0 {
            let o = &*self.o;
            self.sh.report.lock().unwrap().tables.push(Table {
                title: title.to_string(),
                mode,
                hidden: o.hidden,
                topk: o.topk,
                experts: o.experts,
                iterations,
                sms,
                rows: Vec::new(),
            });
            println!("\n{}\n\n**{title}**\n", self.sh.header);
            println!("| op | tokens | SMs | median us | p10 us | p90 us | GB/s | NCCL a2a us | copy floor us | x floor |");
            println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
        }
    }

    /// Prints the rows of one token count (rank 0) and records them for
    /// `--json`; `sms` is "-" where not used. Collective: each row's
    /// statistics gather every rank's times.
    fn print_rows(&self, tokens: usize, sms: Option<i32>, rows: Vec<Row>) {
        for row in rows {
            let stats = self.stats(row.times);
            if self.r != 0 {
                continue;
            }
            let gbps = row.bytes.map(|b| b / stats.median / 1e3);
            if let Some(table) = self.sh.report.lock().unwrap().tables.last_mut() {
                table.rows.push(Value::Obj(vec![
                    ("op", Value::Str(row.op.clone())),
                    ("tokens", Value::Num(tokens as f64)),
                    ("sms", Value::opt_num(sms)),
                    ("median_us", Value::Num(stats.median)),
                    ("p10_us", Value::Num(stats.p10)),
                    ("p90_us", Value::Num(stats.p90)),
                    ("gbps", Value::opt_num(gbps)),
                    ("nccl_us", Value::opt_num(row.nccl_us)),
                    ("floor_us", Value::opt_num(row.floor_us)),
                ]));
            }
            let sms = sms.map_or("-".to_string(), |s| s.to_string());
            let gbps = gbps.map_or("-".to_string(), |g| {
                if g >= 10.0 {
                    format!("{g:.0}")
                } else {
                    format!("{g:.3}")
                }
            });
            let nccl = match (&self.nccl, row.nccl_us) {
                (_, Some(t)) => format!("{t:.1}"),
                (None, _) => "n/a".to_string(),
                _ => "-".to_string(),
            };
            let (floor, times_floor) = row.floor_us.map_or(("-".into(), "-".into()), |f| {
                (format!("{f:.1}"), format!("{:.2}", stats.median / f))
            });
            println!(
                "| {} | {tokens} | {sms} | {:.1} | {:.1} | {:.1} | {gbps} | {nccl} | {floor} | {times_floor} |",
                row.op, stats.median, stats.p10, stats.p90
            );
        }
    }

    /// Runs the dispatch+combine pair `iters` times (gated) with the
    /// low-latency kernels' device timestamps on: the samples of
    /// `phase_times`, one column per (op, phase, first/last block).
    fn ll_phases(
        &self,
        ctx: *mut ep_ctx_t,
        iters: usize,
        dispatch: &dyn Fn(),
        combine: &dyn Fn(),
    ) -> Samples {
        // SAFETY: a live context of this rank.
        let keep = |on: bool| {
            if let Err(e) = unsafe { ll_keep_timeline(ctx, on) } {
                fail(&format!("device timestamps: {}", e.message));
            }
        };
        keep(true);
        let samples = self.iterate(iters, |_, gate| {
            self.time_ops(gate, [dispatch, combine]);
            // SAFETY: as above; time_ops waited for both launches.
            match unsafe { ll_timeline(ctx) } {
                Ok(t) => phase_times(&t),
                Err(e) => fail(&format!("device timestamps: {}", e.message)),
            }
        });
        keep(false);
        samples
    }

    /// Rank 0 prints its per-phase breakdown (`ll_phases`) of `tokens`.
    fn print_phases(&self, tokens: usize, iters: usize, samples: &Samples) {
        if self.r != 0 {
            return;
        }
        println!(
            "\n**low-latency phases of rank 0 from device timestamps, {tokens} token(s), weights \
             at dispatch: us after the op's first block started, first and last block to \
             pass, median of {iters}**\n"
        );
        println!("| point | dispatch first | dispatch last | combine first | combine last |");
        println!("| --- | ---: | ---: | ---: | ---: |");
        let cell = |column: usize| {
            let m = median_of(&samples[column]);
            if m.is_nan() {
                "-".to_string()
            } else {
                format!("{m:.1}")
            }
        };
        let per_op = 2 * LL_PHASES.len();
        for (i, (_, name)) in LL_PHASES.iter().enumerate() {
            println!(
                "| {name} | {} | {} | {} | {} |",
                cell(2 * i),
                cell(2 * i + 1),
                cell(per_op + 2 * i),
                cell(per_op + 2 * i + 1)
            );
        }
    }

    /// Collective: the read + write bandwidth (GB/s) of a device-to-device
    /// copy on this rank's stream, every rank copying at once as the ops
    /// run: twice `COPY_BYTES` over the slowest rank's median time. The
    /// copy floor of an op is the bytes it must read and write at this rate.
    fn copy_gbps(&self) -> f64 {
        let bytes = if self.dev.gpu {
            COPY_BYTES
        } else {
            COPY_BYTES / 16
        };
        let src = Buf::new(&self.dev, bytes);
        let dst = Buf::new(&self.dev, bytes);
        src.fill(&self.dev, 0x3C);
        let s = self.iterate(COPY_ITERS, |_, gate| {
            self.time_ops(gate, [&|| dst.copy_from(&self.dev, &src)])
                .to_vec()
        });
        2.0 * bytes as f64 / self.stats(&s[0]).median / 1e3
    }

    /// Runs `warmup + iters` iterations, each after a barrier of all ranks;
    /// `step(i, gate)` returns the times of its sub-ops, kept after the
    /// warm-up. `gate` (see [`Rank::time_ops`]) is false in the first
    /// iteration: the first call of an op may load its kernel, and loading
    /// can wait for every stream of the context, the gated one included.
    fn iterate(&self, iters: usize, mut step: impl FnMut(usize, bool) -> Vec<f64>) -> Samples {
        let mut out: Samples = Vec::new();
        for i in 0..self.o.warmup + iters {
            self.barrier();
            let t = step(i, i > 0);
            if i >= self.o.warmup {
                out.resize(t.len(), Vec::new());
                for (k, v) in t.into_iter().enumerate() {
                    out[k].push(v);
                }
            }
        }
        out
    }

    /// Enqueues `ops` back to back on the rank's stream and returns the
    /// time of each: CUDA events around it (host instants on the host
    /// backend). With `gate`, where this run has a gate, the stream first
    /// waits until every rank has enqueued the section (collective then):
    /// the times are the GPU's alone, launch latency excluded. An op that
    /// waits on the host for its own kernels must not be gated.
    fn time_ops<const N: usize>(&self, gate: bool, ops: [&dyn Fn(); N]) -> [f64; N] {
        let gate = self.gate.as_ref().filter(|_| gate);
        if let Some(g) = gate {
            g.hold(&self.dev);
        }
        let mut marks = vec![self.dev.mark(0)];
        for (k, op) in ops.iter().enumerate() {
            op();
            marks.push(self.dev.mark(k + 1));
        }
        if let Some(g) = gate {
            self.barrier();
            g.open();
        }
        std::array::from_fn(|k| self.dev.elapsed_us(&marks[k], &marks[k + 1]))
    }

    /// Collective: rank 0 allocates the gate word, every rank maps it; the
    /// run is gated only where every rank's stream can wait on it, and
    /// unless `--ungated` was given.
    fn make_gate(&self) -> Option<Gate> {
        if self.o.ungated {
            return None;
        }
        let owner = if self.r == 0 { HostWord::alloc() } else { None };
        if self.r == 0 {
            *self.sh.gate_word.lock().unwrap() = owner.as_ref().map(HostWord::addr);
        }
        self.barrier();
        let addr = *self.sh.gate_word.lock().unwrap();
        let gate = addr.and_then(|a| Gate::new(&self.dev, a, owner));
        let everywhere = self
            .allgather(vec![f64::from(u8::from(gate.is_some()))])
            .iter()
            .all(|v| v[0] == 1.0);
        if !everywhere && self.r == 0 {
            eprintln!("ep-bench: cuStreamWaitValue32 on a host-mapped word is not available: per-op times include launch latency");
        }
        gate.filter(|_| everywhere)
    }

    /// How a table's timed sections were taken, for its title.
    fn gate_note(&self, subject: &str) -> String {
        match (self.o.gpu, self.gate.is_some()) {
            (false, _) => format!("{subject}: host wall clock"),
            (true, true) => format!("{subject}: GPU only (gated start)"),
            (true, false) if self.o.ungated => {
                format!("{subject} include launch latency (--ungated)")
            }
            (true, false) => {
                format!("{subject} include launch latency (cuStreamWaitValue32 unavailable)")
            }
        }
    }

    /// Times an NCCL all-to-all of each payload (bytes to / from each peer).
    /// Collective: every rank passes the same number of payloads.
    fn nccl_medians(
        &self,
        iters: usize,
        payloads: &[(Vec<usize>, Vec<usize>)],
    ) -> Vec<Option<f64>> {
        let Some((nccl, comm)) = self.nccl else {
            return vec![None; payloads.len()];
        };
        let send_max = payloads
            .iter()
            .map(|p| p.0.iter().sum::<usize>())
            .max()
            .unwrap_or(0);
        let recv_max = payloads
            .iter()
            .map(|p| p.1.iter().sum::<usize>())
            .max()
            .unwrap_or(0);
        let send = Buf::new(&self.dev, send_max);
        let recv = Buf::new(&self.dev, recv_max);
        let samples = self.iterate(iters, |_, _| {
            let mut t = Vec::new();
            for (k, (s, r)) in payloads.iter().enumerate() {
                if k > 0 {
                    self.barrier();
                }
                // Not gated: NCCL does not promise that a call never waits
                // for the stream it enqueues on, which would wait for the
                // gate forever.
                let [us] = self.time_ops(
                    false,
                    [&|| nccl.all_to_all(comm, &self.dev, &send, s, &recv, r)],
                );
                t.push(us);
            }
            t
        });
        samples.iter().map(|s| Some(self.stats(s).median)).collect()
    }

    /// Collective context creation: rank 0 makes the id, all ranks join.
    fn create_ctx(&self, max_tokens: usize, sms: i32, ll_tokens: usize) -> *mut ep_ctx_t {
        let mut cfg: ep_config_t = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointers throughout.
        unsafe {
            epc(ep_config_init(&mut cfg), "ep_config_init");
            cfg.max_tokens_per_rank = max_tokens as i32;
            cfg.hidden = self.o.hidden as i32;
            cfg.topk = self.o.topk as i32;
            cfg.num_experts = self.o.experts as i32;
            cfg.token_dtype = EP_DTYPE_BF16;
            cfg.backend = if self.o.gpu {
                EP_BACKEND_GPU
            } else {
                EP_BACKEND_HOST
            };
            cfg.num_sms = sms;
            cfg.timeout_ms = self.o.timeout_ms;
            cfg.ll_max_tokens_per_rank = ll_tokens as i32;
            // Several nodes (virtual ones on one host): the network legs.
            cfg.ranks_per_node = self.o.ranks_per_node.unwrap_or(0) as i32;
            if self.r == 0 {
                let mut id = ep_unique_id_t {
                    internal: [0; EP_UNIQUE_ID_BYTES],
                };
                epc(ep_get_unique_id(&mut id), "ep_get_unique_id");
                *self.sh.id.lock().unwrap() = Some(id);
            }
            self.barrier();
            let id = self
                .sh
                .id
                .lock()
                .unwrap()
                .unwrap_or_else(|| fail("no unique id"));
            let mut ctx = ptr::null_mut();
            epc(
                ep_ctx_create(
                    &mut ctx,
                    self.world as i32,
                    id,
                    self.r as i32,
                    (self.r % self.sh.devices) as i32,
                    &cfg,
                ),
                &format!("ep_ctx_create (rank {})", self.r),
            );
            self.barrier();
            ctx
        }
    }

    fn destroy_ctx(&self, ctx: *mut ep_ctx_t, handle: *mut ep_handle_t) {
        self.dev.sync();
        self.barrier();
        // SAFETY: ours, nothing of them still running.
        unsafe {
            if !handle.is_null() {
                epc(ep_handle_destroy(handle), "ep_handle_destroy");
            }
            epc(ep_ctx_destroy(ctx), "ep_ctx_destroy");
        }
        self.barrier();
    }

    /// Layout of this rank's first `tokens` tokens, gathered from all ranks:
    /// `all[s]` = tokens per rank (`world`) then (token, expert) pairs per
    /// expert (`experts`) of source rank `s`.
    fn layouts(&self, ctx: *mut ep_ctx_t, inp: &Inputs, tokens: usize) -> Vec<Vec<f64>> {
        let (w, e) = (self.world, self.o.experts);
        let per_rank = Buf::new(&self.dev, w * 4);
        let per_expert = Buf::new(&self.dev, e * 4);
        let in_rank = Buf::new(&self.dev, tokens * w);
        // SAFETY: buffers sized as the API says.
        epc(
            unsafe {
                ep_get_dispatch_layout(
                    ctx,
                    inp.topk_idx.i32p(),
                    tokens as i32,
                    per_rank.i32p(),
                    per_expert.i32p(),
                    in_rank.ptr.cast(),
                    self.dev.ep_stream(),
                )
            },
            "ep_get_dispatch_layout",
        );
        let pr: Vec<i32> = per_rank.download(&self.dev, w);
        let pe: Vec<i32> = per_expert.download(&self.dev, e);
        if pe.iter().map(|&c| c as usize).sum::<usize>() != tokens * self.o.topk
            || pr.iter().any(|&c| c < 0)
        {
            fail(&format!(
                "rank {}: ep_get_dispatch_layout counts do not add up",
                self.r
            ));
        }
        self.allgather(pr.iter().chain(pe.iter()).map(|&c| c as f64).collect())
    }

    // -----------------------------------------------------------------------
    // Normal mode
    // -----------------------------------------------------------------------

    fn normal(&self, inp: &Inputs, sms: i32, token_list: &[usize]) {
        let o = &*self.o;
        let (w, h, r) = (self.world, o.hidden, self.r);
        let local = o.experts / w;
        let max_tokens = *token_list.iter().max().unwrap();
        let iters = o.iters.unwrap_or(50);
        let ctx = self.create_ctx(max_tokens, sms, 0);
        let mut handle = ptr::null_mut();
        let (mut recv_rows, mut expert_rows) = (0, 0);
        // SAFETY: valid out-pointers.
        unsafe {
            epc(ep_handle_create(ctx, &mut handle), "ep_handle_create");
            epc(
                ep_get_dispatch_capacity(ctx, EXPERT_ALIGNMENT, &mut recv_rows, &mut expert_rows),
                "ep_get_dispatch_capacity",
            );
        }
        let (rr, er) = (recv_rows as usize, expert_rows as usize);
        let dev = &self.dev;
        let recv_x = Buf::new(dev, rr * h * 2);
        let recv_scales = Buf::new(dev, rr * h / 128 * 4);
        let recv_topk_idx = Buf::new(dev, rr * o.topk * 4);
        let recv_topk_w = Buf::new(dev, rr * o.topk * 4);
        let recv_src = Buf::new(dev, rr * 2 * 4);
        let recv_num = Buf::new(dev, 4);
        let expert_x = Buf::new(dev, er * h * 2);
        let expert_w = Buf::new(dev, er * 4);
        let expert_src = Buf::new(dev, er * 4);
        let expert_off = Buf::new(dev, (local + 1) * 4);
        let expert_cnt = Buf::new(dev, local * 4);
        let out = Buf::new(dev, max_tokens * h * 2);
        let mut host_counts = vec![0i32; local];
        let fp8_row = (h + h / 128 * 4) as f64;
        let bf16_row = (h * 2) as f64;

        let copy_gbps = self.copy_gbps();
        self.table_start(
            &format!(
                "normal mode: {} SMs, hidden {h}, top-{} of {} experts, {iters} iterations; {}; \
                 copy floor: the bytes an op must read and write at the {copy_gbps:.0} GB/s \
                 (read + write) of a device-to-device copy",
                sms,
                o.topk,
                o.experts,
                self.gate_note("combine times")
            ),
            "normal",
            Some(sms),
            iters,
        );
        for &t in token_list {
            let all = self.layouts(ctx, inp, t);
            let expected_rows: i64 = all.iter().map(|s| s[r] as i64).sum();
            let expected_pairs: i64 = all
                .iter()
                .map(|s| s[w + r * local..w + (r + 1) * local].iter().sum::<f64>() as i64)
                .sum();
            // Expert-major rows with their padding, and the rows this rank
            // sends: with the rows received and the tokens, the bytes each
            // op must at least read and write (its copy floor).
            let padded_rows: u64 = (0..local)
                .map(|le| {
                    let rows: u64 = all.iter().map(|s| s[w + r * local + le] as u64).sum();
                    rows.next_multiple_of(EXPERT_ALIGNMENT as u64)
                })
                .sum();
            let sent_rows: f64 = all[r][..w].iter().sum();
            let (received_rows, pairs) = (expected_rows as f64, expected_pairs as f64);
            let base = |dtype: i32| -> ep_dispatch_args_t {
                let mut a: ep_dispatch_args_t = unsafe { std::mem::zeroed() };
                // SAFETY: valid out-pointer.
                epc(
                    unsafe { ep_dispatch_args_init(&mut a) },
                    "ep_dispatch_args_init",
                );
                a.num_tokens = t as i32;
                a.dtype = dtype;
                if dtype == EP_DTYPE_FP8_E4M3 {
                    a.x = inp.x_fp8.ptr;
                    a.x_scales = inp.x_scales.f32p();
                } else {
                    a.x = inp.x.ptr;
                }
                a.topk_idx = inp.topk_idx.i32p();
                a.topk_weights = inp.topk_weights.f32p();
                a.expert_alignment = EXPERT_ALIGNMENT;
                a
            };
            let source_order = |dtype: i32| -> ep_dispatch_args_t {
                let mut a = base(dtype);
                a.recv_capacity = recv_rows;
                a.recv_x = recv_x.ptr;
                if dtype == EP_DTYPE_FP8_E4M3 {
                    a.recv_x_scales = recv_scales.f32p();
                }
                a.recv_topk_idx = recv_topk_idx.i32p();
                a.recv_topk_weights = recv_topk_w.f32p();
                a.recv_src_info = recv_src.i32p();
                a.recv_num_tokens = recv_num.i32p();
                a
            };
            // Times one dispatch and checks the host-side row count against
            // what the layouts of all ranks say this rank must receive. Not
            // gated: the host-synchronised dispatch waits for its kernels.
            let dispatch = |a: &mut ep_dispatch_args_t, what: &str, hc: &mut [i32]| -> f64 {
                let mut host_rows = -1i32;
                hc.fill(-1);
                a.host_recv_num_tokens = &mut host_rows;
                a.host_expert_counts = if a.expert_x.is_null() {
                    ptr::null_mut()
                } else {
                    hc.as_mut_ptr()
                };
                let a = &*a;
                // SAFETY: every pointer in `a` is a live buffer of its documented size.
                let [us] = self.time_ops(
                    false,
                    [&|| {
                        epc(
                            unsafe { ep_dispatch(ctx, a, handle, dev.ep_stream()) },
                            what,
                        )
                    }],
                );
                if !a.recv_x.is_null() && host_rows as i64 != expected_rows {
                    fail(&format!("rank {r}: {what} received {host_rows} rows; the layouts say {expected_rows}"));
                }
                if !a.expert_x.is_null() {
                    let pairs: i64 = hc.iter().map(|&c| c as i64).sum();
                    if pairs != expected_pairs || hc.iter().any(|&c| c < 0) {
                        fail(&format!("rank {r}: {what} expert counts sum to {pairs}; the layouts say {expected_pairs}"));
                    }
                }
                us
            };
            // The host's side of a call: how long the call itself takes on
            // the CPU, from entry to return (`ep_combine` enqueues only).
            let combine_host_us = Cell::new(0.0);
            let combine = |layout: i32, x: &Buf, what: &str, gate: bool| -> f64 {
                let mut c: ep_combine_args_t = unsafe { std::mem::zeroed() };
                // SAFETY: valid out-pointer; x and out are live buffers of the right size.
                epc(
                    unsafe { ep_combine_args_init(&mut c) },
                    "ep_combine_args_init",
                );
                c.input_layout = layout;
                c.x = x.ptr;
                c.out = out.ptr;
                let [us] = self.time_ops(
                    gate,
                    [&|| {
                        combine_host_us.set(host_us(|| {
                            epc(
                                unsafe { ep_combine(ctx, &c, handle, dev.ep_stream()) },
                                what,
                            )
                        }))
                    }],
                );
                us
            };
            // A dispatch without host synchronisation, timed on the host
            // only: the CPU cost of a call that enqueues its kernels.
            let dispatch_host_us = || -> f64 {
                let mut a = source_order(EP_DTYPE_BF16);
                a.flags = EP_DISPATCH_NO_HOST_SYNC;
                // SAFETY: every pointer in `a` is a live buffer of its documented size.
                let us = host_us(|| {
                    epc(
                        unsafe { ep_dispatch(ctx, &a, handle, dev.ep_stream()) },
                        "ep_dispatch BF16 no host sync",
                    )
                });
                dev.sync();
                us
            };

            // Between barriers, an untimed combine of the handle's dispatch,
            // so that the next timed dispatch follows a combine.
            let untimed_combine = |layout: i32, x: &Buf| {
                self.barrier();
                combine(layout, x, "ep_combine (untimed)", false);
                self.barrier();
            };

            // Poisoned device row count, checked after the first dispatch.
            recv_num.fill(dev, 0xFF);
            let mut hc = host_counts.clone();
            let s = self.iterate(iters, |i, gate| {
                let mut a = source_order(EP_DTYPE_BF16);
                let d_bf16 = dispatch(&mut a, "ep_dispatch BF16", &mut hc);
                if i == 0 {
                    let n: Vec<i32> = recv_num.download(dev, 1);
                    if n[0] as i64 != expected_rows {
                        fail(&format!(
                            "rank {r}: recv_num_tokens is {}; the layouts say {expected_rows}",
                            n[0]
                        ));
                    }
                }
                self.barrier();
                let c_src = combine(
                    EP_COMBINE_SOURCE_ORDER,
                    &recv_x,
                    "ep_combine source-order",
                    gate,
                );
                let c_src_host = combine_host_us.get();
                self.barrier();
                let mut a = source_order(EP_DTYPE_FP8_E4M3);
                let d_fp8 = dispatch(&mut a, "ep_dispatch FP8", &mut hc);
                self.barrier();
                // A dispatch right after a dispatch first runs the earlier
                // one's closing barrier; every other timed dispatch follows
                // a combine, as in a model's layers (untimed combines below
                // keep it so).
                let mut a = source_order(EP_DTYPE_BF16);
                let d_after_d = dispatch(&mut a, "ep_dispatch BF16 after a dispatch", &mut hc);
                untimed_combine(EP_COMBINE_SOURCE_ORDER, &recv_x);
                let expert_major = |flags: u32| {
                    let mut a = base(EP_DTYPE_BF16);
                    a.flags = flags;
                    a.expert_capacity = expert_rows;
                    a.expert_x = expert_x.ptr;
                    a.expert_weights = expert_w.f32p();
                    a.expert_src_row = expert_src.i32p();
                    a.expert_offsets = expert_off.i32p();
                    a.expert_counts = expert_cnt.i32p();
                    a
                };
                let mut a = expert_major(0);
                let d_em = dispatch(&mut a, "ep_dispatch BF16 expert-major", &mut hc);
                self.barrier();
                let c_em = combine(
                    EP_COMBINE_EXPERT_MAJOR,
                    &expert_x,
                    "ep_combine expert-major",
                    gate,
                );
                self.barrier();
                let mut a = expert_major(EP_DISPATCH_KEEP_PADDING);
                let d_em_kept = dispatch(
                    &mut a,
                    "ep_dispatch BF16 expert-major, padding kept",
                    &mut hc,
                );
                untimed_combine(EP_COMBINE_EXPERT_MAJOR, &expert_x);
                let d_host = dispatch_host_us();
                untimed_combine(EP_COMBINE_SOURCE_ORDER, &recv_x);
                vec![
                    d_bf16, d_fp8, d_em, c_src, c_em, d_host, c_src_host, d_em_kept, d_after_d,
                ]
            });
            host_counts = hc;

            // NCCL all-to-all of the same payloads: BF16 rows, FP8 rows (+
            // scales), and the combine direction (BF16, back to the sources).
            let send_rows: Vec<usize> = all[r][..w].iter().map(|&c| c as usize).collect();
            let recv_from: Vec<usize> = all.iter().map(|s| s[r] as usize).collect();
            let scale = |v: &[usize], b: f64| v.iter().map(|&c| c * b as usize).collect::<Vec<_>>();
            let nc = self.nccl_medians(
                iters,
                &[
                    (scale(&send_rows, bf16_row), scale(&recv_from, bf16_row)),
                    (scale(&send_rows, fp8_row), scale(&recv_from, fp8_row)),
                    (scale(&recv_from, bf16_row), scale(&send_rows, bf16_row)),
                ],
            );
            let received = self.mean(expected_rows as f64);
            let (bf16, fp8) = (Some(received * bf16_row), Some(received * fp8_row));
            let (tokens, padded) = (t as f64, padded_rows as f64);
            let rows = vec![
                row("dispatch BF16", &s[0], bf16, nc[0])
                    .floor((sent_rows + received_rows) * bf16_row, copy_gbps),
                row("dispatch FP8", &s[1], fp8, nc[1])
                    .floor((sent_rows + received_rows) * fp8_row, copy_gbps),
                row("dispatch BF16 after a dispatch", &s[8], bf16, nc[0])
                    .floor((sent_rows + received_rows) * bf16_row, copy_gbps),
                row("dispatch BF16 expert-major", &s[2], bf16, nc[0])
                    .floor((sent_rows + padded) * bf16_row, copy_gbps),
                row(
                    "dispatch BF16 expert-major, padding kept (EP_DISPATCH_KEEP_PADDING)",
                    &s[7],
                    bf16,
                    nc[0],
                )
                .floor((sent_rows + pairs) * bf16_row, copy_gbps),
                row("combine BF16 source-order", &s[3], bf16, nc[2])
                    .floor((received_rows + tokens) * bf16_row, copy_gbps),
                row("combine BF16 expert-major", &s[4], bf16, nc[2])
                    .floor((pairs + tokens) * bf16_row, copy_gbps),
                row(
                    "dispatch BF16 no host sync: host time per call",
                    &s[5],
                    None,
                    None,
                ),
                row(
                    "combine BF16 source-order: host time per call",
                    &s[6],
                    None,
                    None,
                ),
            ];
            self.print_rows(t, Some(sms), rows);
        }
        drop((recv_x, expert_x, out));
        self.destroy_ctx(ctx, handle);
    }

    // -----------------------------------------------------------------------
    // Low-latency mode
    // -----------------------------------------------------------------------

    fn low_latency(&self, inp: &Inputs, token_list: &[usize]) {
        let o = &*self.o;
        let (w, h) = (self.world, o.hidden);
        let local = o.experts / w;
        let iters = o.iters.unwrap_or(200);
        let max_tokens = *token_list.iter().max().unwrap();
        let ctx = self.create_ctx(max_tokens, o.sms[0], max_tokens);
        let dev = &self.dev;
        let rows = local * w * max_tokens;
        let comb_x = Buf::new(dev, rows * h * 2);
        fill_random_bf16(dev, &comb_x, &mut Rng(0xC0FFEE + self.r as u64));
        let bufs = LlBuffers {
            recv_x: Buf::new(dev, rows * h),
            recv_scales: Buf::new(dev, rows * h / 128 * 4),
            recv_count: Buf::new(dev, local * 4),
            recv_src: Buf::new(dev, rows * 4),
            recv_range: Buf::new(dev, local * w * 2 * 4),
            comb_x,
            out: Buf::new(dev, max_tokens * h * 2),
        };
        self.table_start(
            &format!(
                "low-latency mode: hidden {h}, top-{} of {} experts, {iters} iterations, graph of {} pairs; {}",
                o.topk,
                o.experts,
                o.graph_pairs,
                self.gate_note("per-op times")
            ),
            "ll",
            None,
            iters,
        );
        // The per-phase breakdowns follow the table, one per token count.
        let phases: Vec<(usize, Samples)> = token_list
            .iter()
            .filter_map(|&t| {
                self.low_latency_rows(ctx, inp, &bufs, t, iters)
                    .map(|p| (t, p))
            })
            .collect();
        for (t, samples) in &phases {
            self.print_phases(*t, iters, samples);
        }
        drop(bufs);
        self.destroy_ctx(ctx, ptr::null_mut());
    }

    /// Times and prints the low-latency rows of one token count; returns
    /// its per-phase samples (`ll_phases`) on GPUs.
    fn low_latency_rows(
        &self,
        ctx: *mut ep_ctx_t,
        inp: &Inputs,
        b: &LlBuffers,
        t: usize,
        iters: usize,
    ) -> Option<Samples> {
        let o = &*self.o;
        let (w, h, r) = (self.world, o.hidden, self.r);
        let local = o.experts / w;
        let dev = &self.dev;
        let (wd, wc) = (WeightsAt::Dispatch, WeightsAt::Combine);
        let all = self.layouts(ctx, inp, t);
        let mine = |s: &[f64], q: usize| -> usize {
            s[w + q * local..w + (q + 1) * local].iter().sum::<f64>() as usize
        };
        let expected_pairs: usize = all.iter().map(|s| mine(s, r)).sum();

        // SAFETY (both): every pointer in the args is a live buffer of its documented size.
        let dispatch = |flags: u32, at: WeightsAt| {
            let mut a: ep_ll_dispatch_args_t = unsafe { std::mem::zeroed() };
            epc(
                unsafe { ep_ll_dispatch_args_init(&mut a) },
                "ep_ll_dispatch_args_init",
            );
            a.flags = flags;
            a.num_tokens = t as i32;
            a.out_dtype = EP_DTYPE_FP8_E4M3;
            a.x = inp.x.ptr;
            a.topk_idx = inp.topk_idx.i32p();
            if at == WeightsAt::Dispatch {
                a.topk_weights = inp.topk_weights.f32p();
            }
            a.recv_x = b.recv_x.ptr;
            a.recv_x_scales = b.recv_scales.f32p();
            a.recv_count = b.recv_count.i32p();
            a.recv_src_info = b.recv_src.i32p();
            a.recv_layout_range = b.recv_range.i32p();
            epc(
                unsafe { ep_ll_dispatch(ctx, &a, dev.ep_stream()) },
                "ep_ll_dispatch",
            )
        };
        let combine = |flags: u32, at: WeightsAt| {
            let mut c: ep_ll_combine_args_t = unsafe { std::mem::zeroed() };
            epc(
                unsafe { ep_ll_combine_args_init(&mut c) },
                "ep_ll_combine_args_init",
            );
            c.flags = flags;
            c.num_tokens = t as i32;
            c.x = b.comb_x.ptr;
            c.topk_idx = inp.topk_idx.i32p();
            if at == WeightsAt::Combine {
                c.topk_weights = inp.topk_weights.f32p();
            }
            c.src_info = b.recv_src.i32p();
            c.layout_range = b.recv_range.i32p();
            c.out = b.out.ptr;
            epc(
                unsafe { ep_ll_combine(ctx, &c, dev.ep_stream()) },
                "ep_ll_combine",
            )
        };
        // Outputs are poisoned before a checked call (counts to -1, `out` to
        // BF16 NaNs), so that a call which writes nothing cannot pass.
        let poison = || {
            b.recv_count.fill(dev, 0xFF);
            b.out.fill(dev, 0xFF);
        };
        let check = |when: &str| {
            let c: Vec<i32> = b.recv_count.download(dev, local);
            let got: i64 = c.iter().map(|&x| x as i64).sum();
            if got != expected_pairs as i64 || c.iter().any(|&x| x < 0) {
                fail(&format!("rank {r}: LL dispatch ({when}) received {got} rows; the layouts say {expected_pairs}"));
            }
            let y: Vec<u16> = b.out.download(dev, t * h);
            if let Some(at) = y.iter().position(|&v| half::bf16::from_bits(v).is_nan()) {
                fail(&format!(
                    "rank {r}: LL combine ({when}) left token {} unwritten",
                    at / h
                ));
            }
        };
        let last = o.warmup + iters - 1;

        // Dispatch and combine back to back: each op's time and the pair's,
        // and each call's time on the host (entry to return: they enqueue).
        let pair = |at: WeightsAt| {
            self.iterate(iters, |i, gate| {
                let checked = i == 0 || i == last;
                if checked {
                    poison();
                }
                let (dispatch_host, combine_host) = (Cell::new(0.0), Cell::new(0.0));
                let [d, c] = self.time_ops(
                    gate,
                    [&|| dispatch_host.set(host_us(|| dispatch(0, at))), &|| {
                        combine_host.set(host_us(|| combine(0, at)))
                    }],
                );
                if checked {
                    let call = if i == 0 { "first" } else { "last" };
                    check(&format!("{at}, {call} call"));
                }
                vec![d, c, d + c, dispatch_host.get(), combine_host.get()]
            })
        };
        let pair_wd = pair(wd);
        let pair_wc = pair(wc);
        // Send and receive phases apart (weights at dispatch). time_ops has
        // waited for this rank's section when it returns, so after the
        // barrier every rank's send phase has finished before any receive
        // phase starts.
        let split = self.iterate(iters, |i, gate| {
            if i == last {
                poison();
            }
            let [ds] = self.time_ops(gate, [&|| dispatch(EP_LL_SEND_ONLY, wd)]);
            self.barrier();
            let [dr, cs] = self.time_ops(
                gate,
                [&|| dispatch(EP_LL_RECV_ONLY, wd), &|| {
                    combine(EP_LL_SEND_ONLY, wd)
                }],
            );
            self.barrier();
            let [cr] = self.time_ops(gate, [&|| combine(EP_LL_RECV_ONLY, wd)]);
            if i == last {
                check(&format!("send/recv split, {wd}, last call"));
            }
            vec![ds, dr, cs, cr]
        });
        // Many pairs in one CUDA graph: per-pair time without launch
        // overhead. Not gated: one launch serves all the pairs.
        let graph = |at: WeightsAt| -> Option<Samples> {
            if !o.gpu {
                return None;
            }
            let pairs = o.graph_pairs;
            dev.sync();
            let exec = capture_graph(dev, || {
                for _ in 0..pairs {
                    dispatch(0, at);
                    combine(0, at);
                }
            });
            let g = self.iterate(iters, |i, _| {
                if i == last {
                    poison();
                }
                let [us] = self.time_ops(false, [&|| launch_graph(dev, exec)]);
                if i == last {
                    check(&format!("CUDA graph, {at}"));
                }
                vec![us / pairs as f64]
            });
            dev.sync();
            destroy_graph(exec);
            Some(g)
        };
        let graph_wd = graph(wd);
        let graph_wc = graph(wc);
        // Where the microseconds go: the pair (weights at dispatch) again,
        // gated, with the kernels' device timestamps on.
        let phases = o
            .gpu
            .then(|| self.ll_phases(ctx, iters, &|| dispatch(0, wd), &|| combine(0, wd)));

        // NCCL: FP8 rows (+ scales) for every (token, expert) pair out; BF16
        // back, one row per (token, expert) pair with weights at combine,
        // one per (token, rank) with weights at dispatch.
        let (fp8_row, bf16_row) = (h + h / 128 * 4, h * 2);
        let to: Vec<usize> = (0..w).map(|q| mine(&all[r], q)).collect();
        let from: Vec<usize> = all.iter().map(|s| mine(s, r)).collect();
        let tokens_to: Vec<usize> = all[r][..w].iter().map(|&c| c as usize).collect();
        let tokens_from: Vec<usize> = all.iter().map(|s| s[r] as usize).collect();
        let scale = |v: &[usize], b: usize| v.iter().map(|&c| c * b).collect::<Vec<_>>();
        let nc = self.nccl_medians(
            iters,
            &[
                (scale(&to, fp8_row), scale(&from, fp8_row)),
                (scale(&from, bf16_row), scale(&to, bf16_row)),
                (scale(&tokens_from, bf16_row), scale(&tokens_to, bf16_row)),
            ],
        );
        let pairs = self.mean(expected_pairs as f64);
        let token_ranks = self.mean(tokens_to.iter().sum::<usize>() as f64);
        let db = pairs * fp8_row as f64;
        let (cb_wd, cb_wc) = (token_ranks * bf16_row as f64, pairs * bf16_row as f64);
        let (both_wd, both_wc) = (Some(db + cb_wd), Some(db + cb_wc));
        let sum = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(x, y)| x + y);
        let (nc_wd, nc_wc) = (sum(nc[0], nc[2]), sum(nc[0], nc[1]));

        const GRAPH_OP: &str = "LL dispatch+combine, CUDA graph, per pair";
        let op = |name: &str, at: WeightsAt| format!("{name} ({at})");
        let mut rows = vec![
            row(op("LL dispatch FP8", wd), &pair_wd[0], Some(db), nc[0]),
            row(op("LL combine BF16", wd), &pair_wd[1], Some(cb_wd), nc[2]),
            row(op("LL combine BF16", wc), &pair_wc[1], Some(cb_wc), nc[1]),
            row(op("LL dispatch+combine", wd), &pair_wd[2], both_wd, nc_wd),
            row(op("LL dispatch+combine", wc), &pair_wc[2], both_wc, nc_wc),
            row(op("LL dispatch send-only", wd), &split[0], None, None),
            row(op("LL dispatch recv-only", wd), &split[1], None, None),
            row(op("LL combine send-only", wd), &split[2], None, None),
            row(op("LL combine recv-only", wd), &split[3], None, None),
            row(
                op("LL dispatch: host time per call", wd),
                &pair_wd[3],
                None,
                None,
            ),
            row(
                op("LL combine: host time per call", wd),
                &pair_wd[4],
                None,
                None,
            ),
        ];
        if let (Some(gd), Some(gc)) = (&graph_wd, &graph_wc) {
            rows.push(row(op(GRAPH_OP, wd), &gd[0], both_wd, nc_wd));
            rows.push(row(op(GRAPH_OP, wc), &gc[0], both_wc, nc_wc));
        }
        self.print_rows(t, None, rows);
        if !o.gpu && r == 0 {
            for at in [wd, wc] {
                println!("| {GRAPH_OP} ({at}) | {t} | - | n/a (host backend) | | | | |");
            }
        }
        phases
    }
}

pub fn rank_main(r: usize, sh: Arc<Shared>, o: Arc<Opts>, nccl: Option<(Nccl, Comm)>) {
    let dev = Dev::new(o.gpu, (r % sh.devices) as i32);
    let world = sh.world;
    let mut rank = Rank {
        r,
        world,
        sh,
        o: Arc::clone(&o),
        dev,
        nccl,
        gate: None,
    };
    if o.gpu {
        rank.gate = rank.make_gate();
    }
    // Each mode takes the sweep, else --tokens, else its default count.
    let token_list = |default: usize| -> Vec<usize> {
        if o.sweep_tokens.is_empty() {
            vec![o.tokens.unwrap_or(default)]
        } else {
            o.sweep_tokens.clone()
        }
    };
    let normal_tokens = token_list(4096);
    let ll_tokens = token_list(128);
    let ll_max = ll_tokens.iter().copied().max().unwrap_or(0);
    if o.ll && ll_max > EP_LL_MAX_TOKENS as usize {
        fail(&format!(
            "low-latency mode takes at most {EP_LL_MAX_TOKENS} tokens per rank (--tokens, --sweep-tokens); sweep larger counts with --mode normal"
        ));
    }
    let max_tokens = normal_tokens
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .max(if o.ll { ll_max } else { 0 });
    let inp = make_inputs(&rank.dev, &o, r, max_tokens);
    if o.normal {
        for &sms in &o.sms {
            rank.normal(&inp, sms, &normal_tokens);
        }
    }
    if o.ll {
        rank.low_latency(&inp, &ll_tokens);
    }
    rank.barrier();
    if r == 0 {
        println!();
    }
}
