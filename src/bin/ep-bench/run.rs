//! What each rank thread does: inputs, contexts, the timed loops, the
//! cross-rank statistics and the tables (printed by rank 0).

use std::ptr;
use std::sync::Arc;

use ep::capi::*;

use crate::device::{capture_graph, destroy_graph, epc, fail, launch_graph, Buf, Dev};
use crate::nccl::{Comm, Nccl};
use crate::{Opts, Shared};

/// Expert-major segment alignment used by the expert-major dispatch.
const EXPERT_ALIGNMENT: i32 = 128;

/// splitmix64: small, fast, seeded per rank.
struct Rng(u64);

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
    fn below(&mut self, n: usize) -> usize {
        (((self.next() >> 32) * n as u64) >> 32) as usize
    }
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
    let mut idx = Vec::with_capacity(tokens * o.topk);
    let mut w = Vec::with_capacity(tokens * o.topk);
    for _ in 0..tokens {
        let start = idx.len();
        while idx.len() - start < o.topk {
            let e = rng.below(o.experts) as i32;
            if !idx[start..].contains(&e) {
                idx.push(e);
                w.push(rng.unit());
            }
        }
    }
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

/// One table row: the op's name, tokens, SMs ("-" where not used), the
/// cross-rank statistics, received bytes per rank and the NCCL median.
struct Row<'a> {
    op: &'a str,
    tokens: usize,
    sms: Option<i32>,
    stats: Stats,
    bytes: Option<f64>,
    nccl_us: Option<f64>,
}

pub struct Rank {
    r: usize,
    world: usize,
    sh: Arc<Shared>,
    o: Arc<Opts>,
    dev: Dev,
    nccl: Option<(Nccl, Comm)>,
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

    fn table_start(&self, title: &str) {
        if self.r == 0 {
            println!("\n{}\n\n**{title}**\n", self.sh.header);
            println!("| op | tokens | SMs | median us | p10 us | p90 us | GB/s | NCCL a2a us |");
            println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
        }
    }

    fn print_row(&self, row: Row) {
        if self.r != 0 {
            return;
        }
        let sms = row.sms.map_or("-".to_string(), |s| s.to_string());
        let gbps = row.bytes.map_or("-".to_string(), |b| {
            let g = b / row.stats.median / 1e3;
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
        println!(
            "| {} | {} | {sms} | {:.1} | {:.1} | {:.1} | {gbps} | {nccl} |",
            row.op, row.tokens, row.stats.median, row.stats.p10, row.stats.p90
        );
    }

    /// Runs `warmup + iters` iterations, each after a barrier of all ranks;
    /// `step(i, timed)` returns the times of its sub-ops, kept when timed.
    fn iterate(&self, iters: usize, mut step: impl FnMut(usize, bool) -> Vec<f64>) -> Samples {
        let mut out: Samples = Vec::new();
        for i in 0..self.o.warmup + iters {
            self.barrier();
            let timed = i >= self.o.warmup;
            let t = step(i, timed);
            if timed {
                out.resize(t.len(), Vec::new());
                for (k, v) in t.into_iter().enumerate() {
                    out[k].push(v);
                }
            }
        }
        out
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
                let a = self.dev.mark(0);
                nccl.all_to_all(comm, &self.dev, &send, s, &recv, r);
                let b = self.dev.mark(1);
                t.push(self.dev.elapsed_us(&a, &b));
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
                    self.r as i32,
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

        self.table_start(&format!(
            "normal mode: {} SMs, hidden {h}, top-{} of {} experts, {iters} iterations",
            sms, o.topk, o.experts
        ));
        for &t in token_list {
            let all = self.layouts(ctx, inp, t);
            let expected_rows: i64 = all.iter().map(|s| s[r] as i64).sum();
            let expected_pairs: i64 = all
                .iter()
                .map(|s| s[w + r * local..w + (r + 1) * local].iter().sum::<f64>() as i64)
                .sum();
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
            // what the layouts of all ranks say this rank must receive.
            let dispatch = |a: &mut ep_dispatch_args_t, what: &str, hc: &mut [i32]| -> f64 {
                let mut host_rows = -1i32;
                hc.fill(-1);
                a.host_recv_num_tokens = &mut host_rows;
                a.host_expert_counts = if a.expert_x.is_null() {
                    ptr::null_mut()
                } else {
                    hc.as_mut_ptr()
                };
                let m0 = dev.mark(0);
                // SAFETY: every pointer in `a` is a live buffer of its documented size.
                epc(
                    unsafe { ep_dispatch(ctx, a, handle, dev.ep_stream()) },
                    what,
                );
                let m1 = dev.mark(1);
                let us = dev.elapsed_us(&m0, &m1);
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
            let combine = |layout: i32, x: &Buf, what: &str| -> f64 {
                let mut c: ep_combine_args_t = unsafe { std::mem::zeroed() };
                // SAFETY: valid out-pointer; x and out are live buffers of the right size.
                epc(
                    unsafe { ep_combine_args_init(&mut c) },
                    "ep_combine_args_init",
                );
                c.input_layout = layout;
                c.x = x.ptr;
                c.out = out.ptr;
                let m0 = dev.mark(0);
                epc(
                    unsafe { ep_combine(ctx, &c, handle, dev.ep_stream()) },
                    what,
                );
                let m1 = dev.mark(1);
                dev.elapsed_us(&m0, &m1)
            };

            // Poisoned device row count, checked after the first dispatch.
            recv_num.fill(dev, 0xFF);
            let mut hc = host_counts.clone();
            let s = self.iterate(iters, |i, _| {
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
                let c_src = combine(EP_COMBINE_SOURCE_ORDER, &recv_x, "ep_combine source-order");
                self.barrier();
                let mut a = source_order(EP_DTYPE_FP8_E4M3);
                let d_fp8 = dispatch(&mut a, "ep_dispatch FP8", &mut hc);
                self.barrier();
                let mut a = base(EP_DTYPE_BF16);
                a.expert_capacity = expert_rows;
                a.expert_x = expert_x.ptr;
                a.expert_weights = expert_w.f32p();
                a.expert_src_row = expert_src.i32p();
                a.expert_offsets = expert_off.i32p();
                a.expert_counts = expert_cnt.i32p();
                let d_em = dispatch(&mut a, "ep_dispatch BF16 expert-major", &mut hc);
                self.barrier();
                let c_em = combine(
                    EP_COMBINE_EXPERT_MAJOR,
                    &expert_x,
                    "ep_combine expert-major",
                );
                vec![d_bf16, d_fp8, d_em, c_src, c_em]
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
            let bytes = self.mean(expected_rows as f64);
            let rows = [
                ("dispatch BF16", &s[0], bf16_row, nc[0]),
                ("dispatch FP8", &s[1], fp8_row, nc[1]),
                ("dispatch BF16 expert-major", &s[2], bf16_row, nc[0]),
                ("combine BF16 source-order", &s[3], bf16_row, nc[2]),
                ("combine BF16 expert-major", &s[4], bf16_row, nc[2]),
            ];
            for (op, times, row_bytes, nccl_us) in rows {
                let stats = self.stats(times);
                self.print_row(Row {
                    op,
                    tokens: t,
                    sms: Some(sms),
                    stats,
                    bytes: Some(bytes * row_bytes),
                    nccl_us,
                });
            }
        }
        drop((recv_x, expert_x, out));
        self.destroy_ctx(ctx, handle);
    }

    // -----------------------------------------------------------------------
    // Low-latency mode
    // -----------------------------------------------------------------------

    fn low_latency(&self, inp: &Inputs, t: usize) {
        let o = &*self.o;
        let (w, h, r) = (self.world, o.hidden, self.r);
        let local = o.experts / w;
        let iters = o.iters.unwrap_or(200);
        let ctx = self.create_ctx(t, o.sms[0], t);
        let dev = &self.dev;
        let rows = local * w * t;
        let recv_x = Buf::new(dev, rows * h);
        let recv_scales = Buf::new(dev, rows * h / 128 * 4);
        let recv_count = Buf::new(dev, local * 4);
        let recv_src = Buf::new(dev, rows * 4);
        let recv_range = Buf::new(dev, local * w * 2 * 4);
        let comb_x = Buf::new(dev, rows * h * 2);
        fill_random_bf16(dev, &comb_x, &mut Rng(0xC0FFEE + r as u64));
        let out = Buf::new(dev, t * h * 2);
        let all = self.layouts(ctx, inp, t);
        let mine = |s: &[f64], q: usize| -> usize {
            s[w + q * local..w + (q + 1) * local].iter().sum::<f64>() as usize
        };
        let expected_pairs: usize = all.iter().map(|s| mine(s, r)).sum();

        let dispatch_args = |flags: u32| -> ep_ll_dispatch_args_t {
            let mut a: ep_ll_dispatch_args_t = unsafe { std::mem::zeroed() };
            // SAFETY: valid out-pointer.
            epc(
                unsafe { ep_ll_dispatch_args_init(&mut a) },
                "ep_ll_dispatch_args_init",
            );
            a.flags = flags;
            a.num_tokens = t as i32;
            a.out_dtype = EP_DTYPE_FP8_E4M3;
            a.x = inp.x.ptr;
            a.topk_idx = inp.topk_idx.i32p();
            a.recv_x = recv_x.ptr;
            a.recv_x_scales = recv_scales.f32p();
            a.recv_count = recv_count.i32p();
            a.recv_src_info = recv_src.i32p();
            a.recv_layout_range = recv_range.i32p();
            a
        };
        let combine_args = |flags: u32| -> ep_ll_combine_args_t {
            let mut c: ep_ll_combine_args_t = unsafe { std::mem::zeroed() };
            // SAFETY: valid out-pointer.
            epc(
                unsafe { ep_ll_combine_args_init(&mut c) },
                "ep_ll_combine_args_init",
            );
            c.flags = flags;
            c.num_tokens = t as i32;
            c.x = comb_x.ptr;
            c.topk_idx = inp.topk_idx.i32p();
            c.topk_weights = inp.topk_weights.f32p();
            c.src_info = recv_src.i32p();
            c.layout_range = recv_range.i32p();
            c.out = out.ptr;
            c
        };
        // SAFETY (both): every pointer in the args is a live buffer of its documented size.
        let dispatch = |flags: u32| {
            epc(
                unsafe { ep_ll_dispatch(ctx, &dispatch_args(flags), dev.ep_stream()) },
                "ep_ll_dispatch",
            )
        };
        let combine = |flags: u32| {
            epc(
                unsafe { ep_ll_combine(ctx, &combine_args(flags), dev.ep_stream()) },
                "ep_ll_combine",
            )
        };
        let check_count = |when: &str| {
            let c: Vec<i32> = recv_count.download(dev, local);
            let got: i64 = c.iter().map(|&x| x as i64).sum();
            if got != expected_pairs as i64 || c.iter().any(|&x| x < 0) {
                fail(&format!("rank {r}: LL dispatch ({when}) received {got} rows; the layouts say {expected_pairs}"));
            }
        };
        let last = o.warmup + iters - 1;

        // Full dispatch and combine, back to back.
        let full = self.iterate(iters, |i, _| {
            if i == 0 || i == last {
                recv_count.fill(dev, 0xFF);
            }
            let m0 = dev.mark(0);
            dispatch(0);
            let m1 = dev.mark(1);
            combine(0);
            let m2 = dev.mark(2);
            if i == 0 || i == last {
                check_count(if i == 0 { "first call" } else { "last call" });
            }
            vec![
                dev.elapsed_us(&m0, &m1),
                dev.elapsed_us(&m1, &m2),
                dev.elapsed_us(&m0, &m2),
            ]
        });
        // Send and receive phases apart; all ranks finish sending before anyone receives.
        let split = self.iterate(iters, |_, _| {
            let m0 = dev.mark(0);
            dispatch(EP_LL_SEND_ONLY);
            let m1 = dev.mark(1);
            let ds = dev.elapsed_us(&m0, &m1);
            self.barrier();
            let m2 = dev.mark(2);
            dispatch(EP_LL_RECV_ONLY);
            let m3 = dev.mark(3);
            combine(EP_LL_SEND_ONLY);
            let m4 = dev.mark(4);
            let (dr, cs) = (dev.elapsed_us(&m2, &m3), dev.elapsed_us(&m3, &m4));
            self.barrier();
            let m5 = dev.mark(5);
            combine(EP_LL_RECV_ONLY);
            let m6 = dev.mark(6);
            vec![ds, dr, cs, dev.elapsed_us(&m5, &m6)]
        });
        // Many pairs in one CUDA graph: per-pair time without launch overhead.
        let graph = if o.gpu {
            let pairs = o.graph_pairs;
            dev.sync();
            let exec = capture_graph(dev, || {
                for _ in 0..pairs {
                    dispatch(0);
                    combine(0);
                }
            });
            let g = self.iterate(iters, |i, _| {
                if i == last {
                    recv_count.fill(dev, 0xFF);
                }
                let m0 = dev.mark(0);
                launch_graph(dev, exec);
                let m1 = dev.mark(1);
                if i == last {
                    check_count("graph");
                }
                vec![dev.elapsed_us(&m0, &m1) / pairs as f64]
            });
            dev.sync();
            destroy_graph(exec);
            Some(g)
        } else {
            None
        };

        // NCCL: FP8 rows (+ scales) for every (token, expert) pair out, BF16 back.
        let fp8_row = h + h / 128 * 4;
        let to: Vec<usize> = (0..w).map(|q| mine(&all[r], q)).collect();
        let from: Vec<usize> = all.iter().map(|s| mine(s, r)).collect();
        let scale = |v: &[usize], b: usize| v.iter().map(|&c| c * b).collect::<Vec<_>>();
        let nc = self.nccl_medians(
            iters,
            &[
                (scale(&to, fp8_row), scale(&from, fp8_row)),
                (scale(&from, h * 2), scale(&to, h * 2)),
            ],
        );
        let pairs = self.mean(expected_pairs as f64);
        let (db, cb) = (pairs * fp8_row as f64, pairs * (h * 2) as f64);
        let both = nc[0].zip(nc[1]).map(|(a, b)| a + b);

        self.table_start(&format!(
            "low-latency mode: hidden {h}, top-{} of {} experts, {iters} iterations, graph of {} pairs",
            o.topk, o.experts, o.graph_pairs
        ));
        let mut rows = vec![
            ("LL dispatch FP8", &full[0], Some(db), nc[0]),
            ("LL combine BF16", &full[1], Some(cb), nc[1]),
            ("LL dispatch+combine", &full[2], Some(db + cb), both),
            ("LL dispatch send-only", &split[0], None, None),
            ("LL dispatch recv-only", &split[1], None, None),
            ("LL combine send-only", &split[2], None, None),
            ("LL combine recv-only", &split[3], None, None),
        ];
        if let Some(g) = &graph {
            rows.push((
                "LL dispatch+combine, CUDA graph, per pair",
                &g[0],
                Some(db + cb),
                both,
            ));
        }
        for (op, times, bytes, nccl_us) in rows {
            let stats = self.stats(times);
            self.print_row(Row {
                op,
                tokens: t,
                sms: None,
                stats,
                bytes,
                nccl_us,
            });
        }
        if graph.is_none() && r == 0 {
            println!("| LL dispatch+combine, CUDA graph, per pair | {t} | - | n/a (host backend) | | | | |");
        }
        drop((recv_x, comb_x));
        self.destroy_ctx(ctx, ptr::null_mut());
    }
}

pub fn rank_main(r: usize, sh: Arc<Shared>, o: Arc<Opts>, nccl: Option<(Nccl, Comm)>) {
    let dev = Dev::new(o.gpu, r as i32);
    let world = sh.world;
    let rank = Rank {
        r,
        world,
        sh,
        o: Arc::clone(&o),
        dev,
        nccl,
    };
    let normal_tokens: Vec<usize> = if !o.sweep_tokens.is_empty() {
        o.sweep_tokens.clone()
    } else {
        vec![o.tokens.unwrap_or(4096)]
    };
    let ll_tokens = o.tokens.unwrap_or(128);
    if o.ll && ll_tokens > EP_LL_MAX_TOKENS as usize {
        fail(&format!(
            "low-latency mode takes at most {EP_LL_MAX_TOKENS} tokens per rank"
        ));
    }
    let max_tokens = normal_tokens
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .max(if o.ll { ll_tokens } else { 0 });
    let inp = make_inputs(&rank.dev, &o, r, max_tokens);
    if o.normal {
        for &sms in &o.sms {
            rank.normal(&inp, sms, &normal_tokens);
        }
    }
    if o.ll {
        rank.low_latency(&inp, ll_tokens);
    }
    rank.barrier();
    if r == 0 {
        println!();
    }
}
