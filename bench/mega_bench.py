#!/usr/bin/env python3
"""Fused-kernel benchmark: ep's fused calls next to ep's unfused path and
torch's grouped GEMMs, in one process on one GPU (world size 1), or with
--ranks N in N processes on N GPUs of one host (rank r on GPU r, all in one
ep context).

    python3 bench/mega_bench.py [--lib path/to/libep.so] [--ranks 1] [--iters 30] [--warmup 5]
                                [--only mega|moe]

Workload W3 (bench/README.md), per rank: 4096 tokens of top-8 over 32 experts
(32 / N local experts on each rank, weights [32 / N, n, k]), hidden 7168,
uniform random routing; GEMM1 (gate+up) k 7168 -> n 4096, GEMM2 (down)
k 2048 -> n 7168, that is an expert MLP of intermediate size I = 2048; and
the decode shape: 128 tokens of top-8 (about 32 rows per expert). Every
figure is the median of --iters runs timed with CUDA events after --warmup
runs. Each timed run is gated: a spinning kernel of a few milliseconds holds
the stream while the host enqueues the run, so the events time the GPU's
work and not the host's (Python's, ep's checks, the launches), as ep-bench
gates its ops; --ungated times from an idle stream instead. Rows of the
table, per shape and dtype (BF16, FP8); --only mega keeps the first eight,
--only moe the last three:

  fused dispatch+GEMM      ep_mega_dispatch_gemm (routing, row moves, GEMM)
  ep_dispatch alone        ep_dispatch (expert-major output)
  unfused dispatch+GEMM    ep_dispatch (expert-major) + torch grouped GEMM
  torch GEMM1 alone        torch._grouped_mm (BF16) / _scaled_grouped_mm (FP8,
                           rowwise scales) on the same rows
  fused GEMM+combine       ep_mega_gemm_combine (GEMM, weighted sums, reduce)
  ep_combine alone         ep_combine (expert-major input)
  unfused GEMM+combine     torch grouped GEMM + ep_combine (expert-major)
  torch GEMM2 alone        as torch GEMM1 alone, for GEMM2
  ep_moe_forward           the whole expert MLP in one call: dispatch, GEMM1,
                           SwiGLU (FP8: requantized per 128 columns), GEMM2,
                           combine (w1 [L, 2I, hidden]: gate rows, then up)
  unfused MLP              what an engine runs today: ep_dispatch
                           (expert-major) + torch grouped GEMM1 + torch
                           SwiGLU, silu(gate) * up (FP8: then a per-128-column
                           quantization in torch) + torch grouped GEMM2 +
                           ep_combine (expert-major)
  torch MLP GEMMs alone    the unfused MLP's torch part alone (GEMM1,
                           SwiGLU, quantization, GEMM2) on the same rows

TFLOP/s count 2 * rows * n * k over the real (token, expert) rows (per
rank: tokens * top-k, the average over the ranks); the MLP rows count both
GEMMs, 2 * rows * 2I * hidden + 2 * rows * hidden * I. With --ranks N every
rank makes the same calls in the same order; the ranks meet at a host
barrier before each op's warm-up and again before its timed runs, and a
row's figure is the slowest rank's median. A rank that fails (with several
ranks, any failed ep call) stops the run with its traceback. The closing
lines divide each fused time by the larger of its parts alone
(communication alone, torch GEMM alone), against the target of at most
1.05, and ep_moe_forward's time by the unfused MLP's and by the torch MLP
GEMMs' alone.

Before its timed runs, ep_moe_forward is checked once (per shape, dtype and
cluster size): its combined tokens against those of the unfused path (the
same steps with every GEMM in fp32 with the real FP8 scales, see
check_moe), per token within a loose relative tolerance; a mismatch ends
the run with an error. torch's FP8 GEMMs in the timed rows take unit
rowwise scales: their cost is right, their values are not ep's (DeepSeek-V3
block scales).

--trace N prints, after the timing of each of ep's calls, the GPU timeline
of its kernels (torch's profiler over N more runs, one GPU): each kernel's
start after the call's first kernel, its length and the gap before it, so
that the time of a call outside its main kernel has names.

Needs torch with CUDA and a Hopper GPU per rank. --backend host runs the
same steps on the library's host backend with small shapes and CPU
tensors: a smoke run of the script without a GPU, whose times mean nothing.
"""
import argparse
import collections
import ctypes
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import statistics
import sys
import threading
import time
import traceback
import importlib.util
from ctypes import byref, c_int32, c_void_p

import torch


def load_abi():
    """The header's constants, structs and signatures: python/ep/_abi.py,
    generated from include/ep.h (beside this file in the GPU bundle, at the
    repository's python/ otherwise)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for path in [os.path.join(here, "python", "ep", "_abi.py"),
                 os.path.join(here, "..", "python", "ep", "_abi.py")]:
        if os.path.exists(path):
            spec = importlib.util.spec_from_file_location("ep_abi", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    raise RuntimeError("python/ep/_abi.py not found")


abi = load_abi()
EP_SUCCESS = abi.EP_SUCCESS
EP_BACKEND_GPU = abi.EP_BACKEND_GPU
EP_BACKEND_HOST = abi.EP_BACKEND_HOST
EP_DTYPE_BF16 = abi.EP_DTYPE_BF16
EP_DTYPE_FP8_E4M3 = abi.EP_DTYPE_FP8_E4M3
EP_DISPATCH_NO_HOST_SYNC = abi.EP_DISPATCH_NO_HOST_SYNC
EP_DISPATCH_KEEP_PADDING = abi.EP_DISPATCH_KEEP_PADDING
EP_COMBINE_EXPERT_MAJOR = abi.EP_COMBINE_EXPERT_MAJOR
EP_UNIQUE_ID_BYTES = abi.EP_UNIQUE_ID_BYTES
EP_MAX_WORLD_SIZE = abi.EP_MAX_WORLD_SIZE
ep_config_t = abi.ep_config_t
ep_unique_id_t = abi.ep_unique_id_t
ep_dispatch_args_t = abi.ep_dispatch_args_t
ep_combine_args_t = abi.ep_combine_args_t
ep_mega_args_t = abi.ep_mega_args_t
ep_moe_args_t = abi.ep_moe_args_t
P = c_void_p

# The shapes, per rank: W3 and decode on the GPU; small ones that the host
# backend's reference code runs in a moment (--backend host). GEMM1 is the
# gate+up projection of an expert MLP of intermediate size I = k2 (n1 = 2I),
# GEMM2 its down projection.
Dims = collections.namedtuple("Dims", "hidden n1 k2 experts topk tokens")
GPU_DIMS = Dims(hidden=7168, n1=4096, k2=2048, experts=32, topk=8,
                tokens={"w3": 4096, "decode": 128})
HOST_DIMS = Dims(hidden=256, n1=256, k2=128, experts=8, topk=2,
                 tokens={"w3": 64, "decode": 8})
# Expert-major segment alignment of every dispatch (rows), unless
# --alignment says otherwise.
ALIGNMENT = 128
# Rank r draws its tokens and weights from seed (tokens + r * RANK_SEED_STRIDE).
RANK_SEED_STRIDE = 7919
# The gate before each timed run (time_op): a spinning kernel of this many
# clock cycles (1.5-2.5 ms at Hopper's clocks), far longer than the host
# takes to enqueue one run of any op here, and the name of that kernel.
GATE_CYCLES = 4_000_000
GATE_KERNEL = "spin_kernel"
# Target of the fused calls: fused time <= TARGET_RATIO x max(communication
# alone, GEMM alone).
TARGET_RATIO = 1.05
# Largest relative error, per token, of ep_moe_forward's combined tokens
# against the unfused path's (check_moe): ||fused - unfused|| / ||unfused||
# over the token's hidden values. Loose on purpose: both paths compute the
# same function, but the fused GEMMs sum in another order (fp32 tiles; FP8:
# each 128-wide k block on the tensor cores' FP8 accumulators, then scaled
# and added) than the check's fp32 products or torch's GEMMs, within the
# fused calls' documented bound per value (ep.h, ep_mega_args_t: 2^-7 |ref|
# + c sqrt(sum_k (x_k w_k)^2), c = 2^-10 for BF16, 2^-5 for FP8). So a y1
# value may round to the neighbouring BF16 value (2^-8 relative), and
# torch's path rounds silu and the product to BF16 apart. FP8 adds the
# requantization of act: a y1 value one BF16 step off can move an e4m3 code
# by a whole step (2^-3 relative) or, through a block's amax, the scale of
# 128 columns. A token's norm averages these errors over its hidden values:
# on the host backend at I = 2048, 1e-3 (BF16; 4e-3 against torch's BF16
# SwiGLU) and 4e-4 (FP8). Real faults (gate and up swapped, a wrong expert,
# scale block or routing weight) give errors of order 1.
MOE_TOLERANCE = {"BF16": 0.02, "FP8": 0.06}
# With several ranks: the contexts' timeout_ms, the longest wait for a peer
# inside a call (the ranks start each op together, so a peer that has not
# come after this long has failed; the default is 100 s).
PEER_TIMEOUT_MS = 30000
# Longest wait of a rank at a barrier for its peers (a peer that failed is
# stopped by the parent long before).
BARRIER_TIMEOUT_S = 600
# Every rank's environment: never NVLink multicast.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                    "NVSHMEM_DISABLE_NVLS": "1"}


def load(path):
    # A file that exists is loaded from where it is: the loader takes a name
    # without a slash ("libep.so") from its search path, not the folder.
    lib = ctypes.CDLL(os.path.abspath(path) if os.path.isfile(path) else path)
    for name, (res, args, _names) in abi.FUNCTIONS.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res
    return lib


class EpError(RuntimeError):
    """A failed ep call."""


def check(lib, status, what):
    if status != EP_SUCCESS:
        raise EpError("%s: status %d: %s" % (what, status, lib.ep_get_last_error().decode()))


def init(lib, cls, fn):
    s = cls()
    check(lib, getattr(lib, fn)(byref(s)), fn)
    if s.struct_size != ctypes.sizeof(cls):
        raise RuntimeError("%s: the library's struct has %d bytes, this mirror %d"
                           % (cls.__name__, s.struct_size, ctypes.sizeof(cls)))
    return s


def ptr(t):
    return None if t is None else t.data_ptr()


def quantize_fp8(x):
    """Per-128-column e4m3 quantization of a 2-D (or 3-D) tensor; returns
    (values, scales) with value = fp8 * scale."""
    shape = x.shape
    blocks = x.float().reshape(*shape[:-1], shape[-1] // 128, 128)
    amax = blocks.abs().amax(-1).clamp(min=1e-4)
    scale = amax / 448.0
    q = (blocks / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(shape)
    return q.contiguous(), scale.contiguous()


def dequantize_rows(q, scales):
    """fp32 values of e4m3 rows q [rows, k] with one scale per 128 columns
    ([rows, k / 128])."""
    return q.float() * scales.repeat_interleave(128, dim=-1)


def dequantize_weights(q, scales):
    """fp32 values of one expert's e4m3 weights q [n, k] with one scale per
    128 x 128 block ([n / 128, k / 128])."""
    return q.float() * scales.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)


def weight_block_scales(w):
    """FP8 weights [E, n, k] with one scale per 128 x 128 block."""
    e, n, k = w.shape
    blocks = w.float().reshape(e, n // 128, 128, k // 128, 128)
    amax = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-4)
    scale = amax / 448.0
    q = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).reshape(e, n, k)
    return q.contiguous(), scale.contiguous()


def gate(gated):
    """With gated, holds the current stream for GATE_CYCLES clock cycles
    (a spinning kernel), long enough for the host to enqueue the next run
    before the GPU reaches it."""
    if gated:
        torch.cuda._sleep(GATE_CYCLES)


def time_op(fn, iters, warmup, meet=lambda: None, cuda=True, gated=True):
    """Median time of fn in microseconds over iters runs after warmup runs;
    meet() runs between the two (the ranks' barrier). CUDA events on the
    current stream, each run gated (see gate) unless gated is False, or
    (cuda False: the host backend) wall-clock."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    meet()
    times = []
    for _ in range(iters):
        if not cuda:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
            continue
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        gate(gated)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def trace_op(fn, iters, warmup, gated=True):
    """The GPU timeline of fn: runs it warmup times, then iters times under
    torch's profiler (CUPTI sees every kernel of the process, ep's too),
    each run gated and followed by a synchronisation as in time_op (the
    gate's kernel left out). Returns a list of
    (kernel name, median start after the run's first kernel started, median
    duration, median gap after the kernel before it), in microseconds, and
    the median span (first kernel's start to last kernel's end); None where
    the runs did not launch the same number of kernels."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            gate(gated)
            fn()
            torch.cuda.synchronize()
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA
                      and not e.name.startswith("Memcpy") and not e.name.startswith("Memset")
                      and GATE_KERNEL not in e.name),
                     key=lambda k: k[0])
    if not kernels or len(kernels) % iters:
        return None
    per = len(kernels) // iters
    runs = [kernels[i * per:(i + 1) * per] for i in range(iters)]
    rows = []
    for j in range(per):
        starts = [r[j][0] - r[0][0] for r in runs]
        lengths = [r[j][1] - r[j][0] for r in runs]
        gaps = [r[j][0] - r[j - 1][1] if j else 0.0 for r in runs]
        rows.append((runs[0][j][2], statistics.median(starts), statistics.median(lengths),
                     statistics.median(gaps)))
    span = statistics.median(r[-1][1] - r[0][0] for r in runs)
    return rows, span


def short_kernel_name(name):
    """A kernel's name without its template arguments and parameter list."""
    name = name.split("(")[0]
    return name.split("<")[0]


class Group:
    """This process's rank among the ranks of the run and what they share
    (made by launch()): a barrier, the unique id of the next context (rank 0
    writes it) and one figure per rank. A world of one rank shares nothing."""

    def __init__(self, rank=0, world=1, barrier=None, uid=None, figures=None):
        self.rank, self.world = rank, world
        self._barrier, self._uid, self._figures = barrier, uid, figures
        # Prefix of the lines a rank prints about itself.
        self.tag = "rank %d: " % rank if world > 1 else ""

    def barrier(self):
        if self.world > 1:
            self._barrier.wait(BARRIER_TIMEOUT_S)

    def unique_id(self, lib):
        """The unique id of a new context: rank 0 makes it (the rendezvous
        service runs in rank 0's process, which stays alive until every
        rank has joined, its own ep_ctx_create waiting for them), the others
        read it. An id serves one group, so each context gets its own."""
        uid = ep_unique_id_t()
        if self.rank == 0:
            check(lib, lib.ep_get_unique_id(byref(uid)), "ep_get_unique_id")
            if self.world > 1:
                self._uid[:] = bytes(uid.internal)
        # Rank 0 writes the next id only after its ep_ctx_create with this
        # one has returned, that is after every rank has read this one.
        self.barrier()
        if self.rank != 0:
            uid.internal[:] = self._uid[:]
        return uid

    def slowest(self, us):
        """The largest of the ranks' figures us (None where a rank has
        none: then None). Every rank calls it."""
        if self.world == 1:
            return us
        self._figures[self.rank] = math.nan if us is None else us
        self.barrier()
        figures = list(self._figures)
        self.barrier()  # no rank writes the next figure before all have read these
        return None if any(math.isnan(f) for f in figures) else max(figures)


class Ep:
    """One context of the benchmark's shape (world size group.world) and
    its buffers."""

    # The fused calls' SM budget (ep_mega_args_t.num_sms; 0: every SM).
    mega_sms = 0

    def __init__(self, lib, group, backend, hidden, topk, experts, max_tokens, alignment,
                 keep_padding=False):
        self.lib = lib
        self.cuda = backend == "gpu"
        cfg = init(lib, ep_config_t, "ep_config_init")
        cfg.backend = EP_BACKEND_GPU if self.cuda else EP_BACKEND_HOST
        cfg.hidden, cfg.topk, cfg.num_experts = hidden, topk, experts
        cfg.max_tokens_per_rank = max_tokens
        cfg.ll_max_tokens_per_rank = 0
        cfg.num_sms = 24
        if group.world > 1:
            cfg.timeout_ms = PEER_TIMEOUT_MS
        uid = group.unique_id(lib)
        device = torch.cuda.current_device() if self.cuda else 0
        self.ctx = P()
        check(lib, lib.ep_ctx_create(byref(self.ctx), group.world, uid, group.rank, device,
                                     byref(cfg)), "ep_ctx_create")
        self.handle = P()
        check(lib, lib.ep_handle_create(self.ctx, byref(self.handle)), "ep_handle_create")
        cap = c_int32()
        check(lib, lib.ep_get_dispatch_capacity(self.ctx, alignment, None, byref(cap)), "capacity")
        self.capacity = cap.value
        local = experts // group.world
        self.hidden, self.experts, self.alignment = hidden, local, alignment
        self.keep_padding = keep_padding
        dev = "cuda" if self.cuda else "cpu"
        self.expert_x = torch.empty(self.capacity * hidden * 2, dtype=torch.uint8, device=dev)
        self.expert_scales = torch.empty(self.capacity, hidden // 128, dtype=torch.float32, device=dev)
        self.expert_weights = torch.empty(self.capacity, dtype=torch.float32, device=dev)
        self.expert_src_row = torch.empty(self.capacity, dtype=torch.int32, device=dev)
        self.expert_offsets = torch.empty(local + 1, dtype=torch.int32, device=dev)
        self.expert_counts = torch.empty(local, dtype=torch.int32, device=dev)

    def stream(self):
        return P(torch.cuda.current_stream().cuda_stream) if self.cuda else None

    def dispatch_args(self, x, x_scales, topk_idx, topk_weights, dtype):
        a = init(self.lib, ep_dispatch_args_t, "ep_dispatch_args_init")
        a.flags = EP_DISPATCH_NO_HOST_SYNC | (EP_DISPATCH_KEEP_PADDING if self.keep_padding else 0)
        a.num_tokens = x.shape[0]
        a.dtype = dtype
        a.x, a.x_scales = ptr(x), ptr(x_scales)
        a.topk_idx, a.topk_weights = ptr(topk_idx), ptr(topk_weights)
        a.expert_alignment = self.alignment
        a.expert_capacity = self.capacity
        a.expert_x, a.expert_x_scales = ptr(self.expert_x), ptr(self.expert_scales)
        a.expert_weights, a.expert_src_row = ptr(self.expert_weights), ptr(self.expert_src_row)
        a.expert_offsets, a.expert_counts = ptr(self.expert_offsets), ptr(self.expert_counts)
        return a

    def dispatch(self, a):
        check(self.lib, self.lib.ep_dispatch(self.ctx, byref(a), self.handle, self.stream()),
              "ep_dispatch")

    def combine(self, y, out):
        c = init(self.lib, ep_combine_args_t, "ep_combine_args_init")
        c.input_layout = EP_COMBINE_EXPERT_MAJOR
        c.x, c.out = ptr(y), ptr(out)
        check(self.lib, self.lib.ep_combine(self.ctx, byref(c), self.handle, self.stream()),
              "ep_combine")

    def mega_dispatch_gemm(self, a, dtype, w, w_scales, y, n):
        m = init(self.lib, ep_mega_args_t, "ep_mega_args_init")
        m.dispatch = ctypes.addressof(a)
        m.weight_dtype, m.n, m.k = dtype, n, self.hidden
        m.weights, m.weight_scales, m.y = ptr(w), ptr(w_scales), ptr(y)
        m.num_sms = self.mega_sms
        check(self.lib, self.lib.ep_mega_dispatch_gemm(self.ctx, byref(m), self.handle,
                                                       self.stream()), "ep_mega_dispatch_gemm")

    def mega_gemm_combine(self, dtype, x2, x2_scales, w, w_scales, y, out):
        c = init(self.lib, ep_combine_args_t, "ep_combine_args_init")
        c.input_layout = EP_COMBINE_EXPERT_MAJOR
        c.x, c.out = ptr(x2), ptr(out)
        m = init(self.lib, ep_mega_args_t, "ep_mega_args_init")
        m.combine = ctypes.addressof(c)
        m.weight_dtype, m.n, m.k = dtype, self.hidden, x2.shape[1]
        m.weights, m.weight_scales, m.y, m.x_scales = ptr(w), ptr(w_scales), ptr(y), ptr(x2_scales)
        m.num_sms = self.mega_sms
        check(self.lib, self.lib.ep_mega_gemm_combine(self.ctx, byref(m), self.handle,
                                                      self.stream()), "ep_mega_gemm_combine")

    def moe_args(self, a, dtype, intermediate, w1, w1_scales, w2, w2_scales, y1, act,
                 act_scales, y2, out):
        """The argument structs of ep_moe_forward on the dispatch a, made
        once so that a timed run only enqueues the call: (dispatch, combine,
        moe), kept together since the moe args point at the other two. Of
        the combine only out is used: the rows y2 are its input."""
        c = init(self.lib, ep_combine_args_t, "ep_combine_args_init")
        c.input_layout = EP_COMBINE_EXPERT_MAJOR
        c.out = ptr(out)
        m = init(self.lib, ep_moe_args_t, "ep_moe_args_init")
        m.dispatch, m.combine = ctypes.addressof(a), ctypes.addressof(c)
        m.weight_dtype, m.intermediate = dtype, intermediate
        m.w1, m.w1_scales = ptr(w1), ptr(w1_scales)
        m.w2, m.w2_scales = ptr(w2), ptr(w2_scales)
        m.y1, m.act, m.act_scales, m.y2 = ptr(y1), ptr(act), ptr(act_scales), ptr(y2)
        return a, c, m

    def moe_forward(self, args):
        check(self.lib, self.lib.ep_moe_forward(self.ctx, byref(args[2]), self.handle,
                                                self.stream()), "ep_moe_forward")

    def status(self):
        s = c_int32()
        check(self.lib, self.lib.ep_ctx_get_async_error(self.ctx, byref(s)), "async error")
        if s.value != EP_SUCCESS:
            raise EpError("async error %d: %s" % (s.value, self.lib.ep_get_last_error().decode()))

    def close(self):
        if self.cuda:
            torch.cuda.synchronize()
        self.lib.ep_handle_destroy(self.handle)
        self.lib.ep_ctx_destroy(self.ctx)


def routing(tokens, experts, topk, dev="cuda"):
    idx = torch.rand(tokens, experts, device=dev).topk(topk, dim=1).indices.to(torch.int32)
    weights = torch.rand(tokens, topk, device=dev, dtype=torch.float32)
    return idx.contiguous(), weights.contiguous()


def grouped_bf16(a, w, offs):
    return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs, out_dtype=torch.bfloat16)


def grouped_fp8(a, a_scale, w, w_scale, offs):
    return torch._scaled_grouped_mm(a, w.transpose(-2, -1), a_scale, w_scale, offs=offs,
                                    out_dtype=torch.bfloat16)


def swiglu(h, intermediate):
    """silu(gate) * up of gate+up rows h ([rows, 2I], gate columns first)
    as an engine runs it in torch: BF16 in, BF16 out."""
    return torch.nn.functional.silu(h[:, :intermediate]) * h[:, intermediate:]


def reference_expert_rows(ep, fp8, intermediate, w1, w1_scales, w2, w2_scales, y2):
    """The expert MLP of the rows of ep's last dispatch (expert-major), for
    the check: per local expert, GEMM1 in fp32 from the dispatched rows
    (FP8: dequantized with their row scales and the weights' block scales)
    rounded to BF16, SwiGLU in fp32 from those BF16 values, act rounded to
    BF16 (FP8: quantized per 128 columns), GEMM2 in fp32, rounded to BF16
    into the real rows of y2 ([capacity, hidden]; others left as they
    were). The steps of ep_moe_forward (ep.h), on torch's GEMMs."""
    hidden = ep.hidden
    offsets = ep.expert_offsets.tolist()
    counts = ep.expert_counts.tolist()
    codes = ep.expert_x[:ep.capacity * hidden * (1 if fp8 else 2)]
    codes = codes.view(torch.float8_e4m3fn if fp8 else torch.bfloat16).view(ep.capacity, hidden)
    for e in range(ep.experts):
        lo, count = offsets[e], counts[e]
        if count == 0:
            continue
        rows = slice(lo, lo + count)
        if fp8:
            x = dequantize_rows(codes[rows], ep.expert_scales[rows])
            wa, wb = dequantize_weights(w1[e], w1_scales[e]), dequantize_weights(w2[e], w2_scales[e])
        else:
            x, wa, wb = codes[rows].float(), w1[e].float(), w2[e].float()
        h = (x @ wa.t()).to(torch.bfloat16).float()
        gate, up = h[:, :intermediate], h[:, intermediate:]
        act = gate / (1.0 + torch.exp(-gate)) * up
        if fp8:
            act = dequantize_rows(*quantize_fp8(act))
        else:
            act = act.to(torch.bfloat16).float()
        y2[rows] = (act @ wb.t()).to(torch.bfloat16)


def worst_token_error(got, want):
    """The largest relative error of a token: max over rows of
    ||got - want|| / ||want|| (NaN where either holds a NaN)."""
    if got.shape[0] == 0:
        return 0.0
    got, want = got.float(), want.float()
    err = (got - want).norm(dim=1) / want.norm(dim=1).clamp(min=1e-30)
    if torch.isnan(err).any():
        return math.nan
    return err.max().item()


def first_line(e):
    """The first line of an exception's text (torch's dispatcher errors
    list every backend after it)."""
    return (str(e).strip().splitlines() or [repr(e)])[0]


def fmt_ratio(a, b):
    return "%.2f" % (a / b) if a and b else "n/a"


def fmt_us(us):
    return "%.1f" % us if us else "n/a"


def run(args, group):
    """Every op of every shape on this rank; rank 0 prints the slowest
    rank's figures."""
    lib = load(args.lib)
    cuda = args.backend == "gpu"
    dev = "cuda" if cuda else "cpu"
    dims = GPU_DIMS if cuda else HOST_DIMS
    torch.manual_seed(0)
    hidden, n1, k2, experts, topk = dims.hidden, dims.n1, dims.k2, dims.experts, dims.topk
    # The expert MLP's intermediate size: GEMM1 makes the gate and up halves.
    inter = k2
    assert n1 == 2 * inter, "GEMM1 is the gate+up projection of GEMM2's input"
    local = experts // group.world
    parts = ["mega", "moe"] if args.only is None else [args.only]
    rows_out = []
    medians = {}
    # (fused row, (label, row) of communication alone, (label, row) of GEMM
    # alone) for the closing ratios.
    targets = []
    # (ep_moe_forward row, unfused MLP row, torch MLP GEMMs row).
    moe_targets = []
    lead = group.rank == 0

    def row(name, us, flops):
        tflops = flops / us / 1e6 if us and flops else None
        rows_out.append((name, us, tflops))
        medians[name] = us
        if lead:
            print("  %-48s %10s us %8s TFLOP/s" % (
                name, fmt_us(us), "%.0f" % tflops if tflops else "-"), flush=True)

    def measure(name, fn):
        """This rank's median of fn (None if it failed here). The ranks meet
        before the warm-up and before the timed runs, also where fn failed,
        so that every rank passes every barrier. With several ranks a failed
        ep call ends the run: its peers would wait for it in the call."""
        group.barrier()
        met = []

        def meet():
            met.append(True)
            group.barrier()

        try:
            return time_op(fn, args.iters, args.warmup, meet, cuda, not args.ungated)
        except Exception as e:  # e.g. a baseline that this torch cannot run
            if isinstance(e, EpError) and group.world > 1:
                raise
            print("  %s%s: %s" % (group.tag, name, first_line(e)), flush=True)
            if not met:
                group.barrier()
            return None

    def timed(name, fn, flops, trace=False):
        row(name, group.slowest(measure(name, fn)), flops)
        if trace and args.trace and cuda and group.world == 1:
            traced = trace_op(fn, args.trace, args.warmup, not args.ungated)
            if traced is None:
                print("    (timeline: the runs launched different kernels)", flush=True)
                return
            kernels, span = traced
            print("    timeline, median of %d runs: first kernel's start to last kernel's end "
                  "%.1f us" % (args.trace, span), flush=True)
            for kname, start, length, gap in kernels:
                print("      %-36s start %8.1f us  length %8.1f us  gap before %6.1f us"
                      % (short_kernel_name(kname), start, length, gap), flush=True)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def check_moe(ep, a, moe, fp8, weights, out, y2, mlp, name):
        """ep_moe_forward's combined tokens against the unfused path's:
        ep_dispatch, the experts' MLP of its rows (reference_expert_rows:
        torch's products in fp32, the real FP8 scales), ep_combine. Where
        torch runs it, the timed unfused path of BF16 (its values are
        right; FP8's unit scales are not) is compared too. Every rank
        checks its own tokens; the worst of the ranks must be within
        MOE_TOLERANCE, else the run ends with an error."""
        tol = MOE_TOLERANCE["FP8" if fp8 else "BF16"]
        ep.moe_forward(moe)
        sync()
        ep.status()
        fused = out.clone()
        ep.dispatch(a)
        y2_ref = torch.zeros_like(y2)
        reference_expert_rows(ep, fp8, inter, *weights, y2_ref)
        ep.combine(y2_ref, out)
        sync()
        ep.status()
        errors = [("fp32 GEMMs", worst_token_error(fused, out))]
        if not fp8:
            # torch's grouped GEMMs on the rows of the same dispatch.
            try:
                y2_torch = mlp()
            except Exception as e:  # a torch that cannot run them (CPU)
                y2_torch = None
                if lead:
                    print("  %s: the timed unfused path not compared: %s" % (name, first_line(e)),
                          flush=True)
            # Every rank combines, or none (all make the same ep calls).
            if group.slowest(0.0 if y2_torch is not None else None) is not None:
                ep.combine(y2_torch, out)
                sync()
                ep.status()
                errors.append(("torch grouped GEMMs", worst_token_error(fused, out)))
        results = []
        for what, err in errors:
            worst = group.slowest(err)
            ok = worst is not None and worst <= tol
            results.append("%s %s" % (what, "%.1e" % worst if worst is not None else "NaN"))
            if not ok:
                raise RuntimeError(
                    "%s: ep_moe_forward's tokens differ from the unfused path's (%s): "
                    "worst relative error of a token %s, tolerance %g"
                    % (name, what, "NaN" if worst is None or math.isnan(worst) else
                       "%.3g" % worst, tol))
        if lead:
            print("  %s: tokens match the unfused path (worst relative error of a token: %s; "
                  "tolerance %g)" % (name, ", ".join(results), tol), flush=True)

    for shape in args.shapes.split(","):
        tokens = dims.tokens[shape]
        torch.manual_seed(tokens + RANK_SEED_STRIDE * group.rank)
        x = (torch.rand(tokens, hidden, device=dev) * 2 - 1).to(torch.bfloat16)
        xq, xs = quantize_fp8(x)
        idx, wts = routing(tokens, experts, topk, dev)
        rows = tokens * topk
        w1 = (torch.randn(local, n1, hidden, device=dev) * 0.05).to(torch.bfloat16)
        w2 = (torch.randn(local, hidden, k2, device=dev) * 0.05).to(torch.bfloat16)
        w1q, w1s = weight_block_scales(w1)
        w2q, w2s = weight_block_scales(w2)
        f1, f2 = 2.0 * rows * n1 * hidden, 2.0 * rows * hidden * k2
        if lead and group.world == 1:
            print("%s: %d tokens, top-%d of %d experts, hidden %d; GEMM1 n %d; GEMM2 k %d (I %d)"
                  % (shape, tokens, topk, experts, hidden, n1, k2, inter), flush=True)
        elif lead:
            print("%s: %d tokens per rank on %d ranks, top-%d of %d experts (%d per rank), "
                  "hidden %d; GEMM1 n %d; GEMM2 k %d (I %d)"
                  % (shape, tokens, group.world, topk, experts, local, hidden, n1, k2, inter),
                  flush=True)
        # Fused calls with single blocks (the default) and clusters of 2; the
        # library reads EP_MEGA_CLUSTER when a context is created.
        for cluster in args.clusters.split(","):
            os.environ["EP_MEGA_CLUSTER"] = cluster
            ep = Ep(lib, group, args.backend, hidden, topk, experts, tokens, args.alignment,
                    args.keep_padding)
            ep.mega_sms = args.mega_sms
            y1 = torch.empty(ep.capacity, n1, dtype=torch.bfloat16, device=dev)
            y2 = torch.empty(ep.capacity, hidden, dtype=torch.bfloat16, device=dev)
            out = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=dev)
            if "mega" in parts:
                x2 = (torch.rand(ep.capacity, k2, device=dev) * 2 - 1).to(torch.bfloat16)
                x2q, x2s = quantize_fp8(x2)
            if "moe" in parts:
                # ep_moe_forward's activations: BF16, or e4m3 codes and scales.
                act = torch.empty(ep.capacity * inter * 2, dtype=torch.uint8, device=dev)
                act_scales = torch.empty(ep.capacity, inter // 128, dtype=torch.float32, device=dev)
            baselines = cluster == args.clusters.split(",")[0]
            for dtype, name in [(EP_DTYPE_BF16, "BF16"), (EP_DTYPE_FP8_E4M3, "FP8")]:
                fp8 = dtype == EP_DTYPE_FP8_E4M3
                tag = "%s %s" % (shape, name)
                a = ep.dispatch_args(xq if fp8 else x, xs if fp8 else None, idx, wts, dtype)
                w1_, w1s_ = (w1q, w1s) if fp8 else (w1, None)
                w2_, w2s_ = (w2q, w2s) if fp8 else (w2, None)
                # torch's grouped GEMMs on the rows of ep's last dispatch
                # (expert-major, its offsets on the device: no host sync).
                offs = ep.expert_offsets[1:]
                ex = ep.expert_x[:ep.capacity * hidden * (1 if fp8 else 2)]
                ex = ex.view(torch.float8_e4m3fn if fp8 else torch.bfloat16).view(ep.capacity, hidden)
                ones_m = torch.ones(ep.capacity, device=dev)
                ones_w1 = torch.ones(local, n1, device=dev)
                ones_w2 = torch.ones(local, hidden, device=dev)
                if fp8:
                    gemm1 = lambda: grouped_fp8(ex, ones_m, w1q, ones_w1, offs)

                    def mlp():
                        # The per-128-column quantization that torch's FP8
                        # GEMM2 needs for its input, on the capacity's rows
                        # (their count is on the device only).
                        act_q, _ = quantize_fp8(swiglu(gemm1(), inter))
                        return grouped_fp8(act_q, ones_m, w2q, ones_w2, offs)
                else:
                    gemm1 = lambda: grouped_bf16(ex, w1, offs)
                    mlp = lambda: grouped_bf16(swiglu(gemm1(), inter), w2, offs)
                if "mega" in parts:
                    if fp8:
                        gemm2 = lambda: grouped_fp8(x2q, ones_m, w2q, ones_w2, offs)
                    else:
                        gemm2 = lambda: grouped_bf16(x2, w2, offs)
                    fused1 = "%s fused dispatch+GEMM (clusters of %s)" % (tag, cluster)
                    timed(fused1, lambda: ep.mega_dispatch_gemm(a, dtype, w1_, w1s_, y1, n1), f1,
                          trace=True)
                    ep.status()
                    ep.dispatch(a)
                    fused2 = "%s fused GEMM+combine (clusters of %s)" % (tag, cluster)
                    timed(fused2, lambda: ep.mega_gemm_combine(dtype, x2q if fp8 else x2,
                                                               x2s if fp8 else None,
                                                               w2_, w2s_, y2, out), f2,
                          trace=True)
                    ep.status()
                    dispatch_alone = "%s ep_dispatch alone (expert-major)" % tag
                    combine_alone = "%s ep_combine alone (expert-major)" % tag
                    gemm1_alone = "%s torch GEMM1 alone" % tag
                    gemm2_alone = "%s torch GEMM2 alone" % tag
                    targets.append((fused1, ("ep_dispatch alone", dispatch_alone),
                                    ("torch GEMM1 alone", gemm1_alone)))
                    targets.append((fused2, ("ep_combine alone", combine_alone),
                                    ("torch GEMM2 alone", gemm2_alone)))
                    if baselines:
                        timed(dispatch_alone, lambda: ep.dispatch(a), None, trace=True)
                        timed("%s unfused ep_dispatch + torch GEMM" % tag,
                              lambda: (ep.dispatch(a), gemm1()), f1)
                        timed(gemm1_alone, gemm1, f1)
                        # y2 holds the fused GEMM+combine's rows of the same dispatch.
                        timed(combine_alone, lambda: ep.combine(y2, out), None, trace=True)
                        timed("%s unfused torch GEMM + ep_combine" % tag,
                              lambda: ep.combine(gemm2(), out), f2)
                        timed(gemm2_alone, gemm2, f2)
                        ep.status()
                if "moe" in parts:
                    moe_row = "%s ep_moe_forward (clusters of %s)" % (tag, cluster)
                    unfused_mlp = "%s unfused MLP" % tag
                    mlp_alone = "%s torch MLP GEMMs alone" % tag
                    act_ = act.view(torch.float8_e4m3fn if fp8 else torch.bfloat16)
                    moe = ep.moe_args(a, dtype, inter, w1_, w1s_, w2_, w2s_, y1, act_,
                                      act_scales if fp8 else None, y2, out)
                    check_moe(ep, a, moe, fp8, (w1_, w1s_, w2_, w2s_), out, y2, mlp, moe_row)
                    timed(moe_row, lambda: ep.moe_forward(moe), f1 + f2)
                    ep.status()
                    moe_targets.append((moe_row, unfused_mlp, mlp_alone))
                    if baselines:
                        timed(unfused_mlp, lambda: (ep.dispatch(a), ep.combine(mlp(), out)),
                              f1 + f2)
                        timed(mlp_alone, mlp, f1 + f2)
                        ep.status()
            ep.close()

    if not lead:
        return
    print()
    if group.world > 1:
        print("median us: the slowest of the %d ranks' medians" % group.world)
    print("| op | median us | TFLOP/s |")
    print("| --- | ---: | ---: |")
    for name, us, tflops in rows_out:
        print("| %s | %s | %s |" % (name, fmt_us(us), "%.0f" % tflops if tflops else "-"))
    if targets:
        print()
        print("Fused / max(communication alone, GEMM alone), target at most %.2f:" % TARGET_RATIO)
    for fused, (comm_label, comm), (gemm_label, gemm) in targets:
        f, c, g = medians.get(fused), medians.get(comm), medians.get(gemm)
        alone = "max(%s %s us, %s %s us)" % (comm_label, fmt_us(c), gemm_label, fmt_us(g))
        if f and c and g:
            ratio = f / max(c, g)
            verdict = "met" if ratio <= TARGET_RATIO else "missed"
            print("  %s: %.2f = %s us / %s: %s" % (fused, ratio, fmt_us(f), alone, verdict))
        else:
            print("  %s: n/a = %s us / %s" % (fused, fmt_us(f), alone))
    if moe_targets:
        print()
        print("ep_moe_forward / unfused MLP and ep_moe_forward / torch MLP GEMMs alone:")
    for moe_row, unfused_mlp, mlp_alone in moe_targets:
        f, u, t = medians.get(moe_row), medians.get(unfused_mlp), medians.get(mlp_alone)
        print("  %s: %s = %s us / unfused MLP %s us; %s = %s us / torch MLP GEMMs alone %s us"
              % (moe_row, fmt_ratio(f, u), fmt_us(f), fmt_us(u), fmt_ratio(f, t), fmt_us(f),
                 fmt_us(t)))


def header(args, world):
    if args.backend == "host":
        device = "CPU, host backend (small shapes, wall-clock: a smoke run)"
    else:
        device = torch.cuda.get_device_name()
    if world > 1:
        device = "%d x %s, %d ranks (one process each)" % (world, device, world)
    timing = "wall-clock" if args.backend == "host" else (
        "CUDA events, ungated" if args.ungated else "CUDA events, gated")
    print("date: %s, device: %s, torch %s, timing: %s, expert alignment %d rows%s"
          % (time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), device, torch.__version__,
             timing, args.alignment, ", padding kept" if args.keep_padding else ""), flush=True)


def watch_parent(parent):
    """Ends this rank's process once its parent (launch()) is gone."""
    while True:
        time.sleep(1)
        if os.getppid() != parent:
            os._exit(1)


def rank_main(args, rank, world, shared, parent):
    """Rank `rank` of a --ranks run, in a process of its own (started with
    'spawn': no CUDA state inherited), on GPU `rank`. A failure prints its
    traceback and ends the process with status 1 (launch() then stops the
    other ranks)."""
    threading.Thread(target=watch_parent, args=(parent,), daemon=True).start()
    try:
        if args.backend == "gpu":
            torch.cuda.set_device(rank)
        if rank == 0:
            header(args, world)
        run(args, Group(rank, world, *shared))
    except BaseException:
        sys.stdout.flush()
        sys.stderr.write("rank %d failed:\n%s" % (rank, traceback.format_exc()))
        sys.stderr.flush()
        os._exit(1)


def stop(procs):
    """Ends the ranks' processes that are still running."""
    procs = [p for p in procs if p.pid is not None]  # those started
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()


def launch(args):
    """--ranks N > 1: N processes, rank r on GPU r. Returns the exit status:
    0 when every rank ended well; 1 as soon as one fails (the others are
    stopped) or when --timeout runs out."""
    n = args.ranks
    mp = multiprocessing.get_context("spawn")
    shared = (mp.Barrier(n), mp.RawArray("B", EP_UNIQUE_ID_BYTES), mp.RawArray("d", n))
    procs = [mp.Process(target=rank_main, args=(args, r, n, shared, os.getpid()),
                        name="rank %d" % r) for r in range(n)]

    def on_term(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    failure = None
    deadline = time.monotonic() + args.timeout
    try:
        for p in procs:
            p.start()
        running = list(procs)
        while running and not failure:
            left = deadline - time.monotonic()
            if left <= 0:
                failure = "the run took longer than --timeout %d s" % args.timeout
                break
            multiprocessing.connection.wait([p.sentinel for p in running], min(left, 5.0))
            # One look at each exit status: a rank may end between two looks.
            codes = [(p, p.exitcode) for p in running]
            failed = ["%s ended with %s" % (p.name, "status %d" % c if c > 0 else "signal %d" % -c)
                      for p, c in codes if c is not None and c != 0]
            if failed:
                failure = ", ".join(failed)
            running = [p for p, c in codes if c is None]
    finally:
        stop(procs)
    if failure:
        print("mega_bench: %s; stopped every rank" % failure, file=sys.stderr, flush=True)
        return 1
    return 0


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", default=os.environ.get("EP_LIB", os.path.join(here, "libep.so")))
    p.add_argument("--ranks", type=int, default=1,
                   help="ranks, one process and one GPU each (rank r on GPU r); default 1")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--shapes", default="w3,decode", help="comma list of w3, decode")
    p.add_argument("--alignment", type=int, default=ALIGNMENT, metavar="ROWS",
                   help="expert-major segment alignment of every dispatch (default %(default)s; "
                        "the fused calls need none, and their padding rows are written as zeros)")
    p.add_argument("--keep-padding", action="store_true",
                   help="every dispatch with EP_DISPATCH_KEEP_PADDING: padding rows "
                        "(expert-major x, the fused GEMMs' y and y1) left unwritten")
    p.add_argument("--clusters", default="1",
                   help="cluster sizes of the fused kernels to time (EP_MEGA_CLUSTER)")
    p.add_argument("--mega-sms", type=int, default=0, metavar="N",
                   help="SM budget of the fused calls (ep_mega_args_t.num_sms); default 0, all")
    p.add_argument("--only", choices=["mega", "moe"],
                   help="mega: only the rows of the two fused calls and their parts; moe: only "
                        "the rows of ep_moe_forward (checked, then timed); default both")
    p.add_argument("--ungated", action="store_true",
                   help="time each run from the moment the host starts enqueueing it on an idle "
                        "stream (host and launch latency included) instead of gated")
    p.add_argument("--trace", type=int, default=0, metavar="N",
                   help="after timing each of ep's calls, print its kernels' GPU timeline "
                        "(torch's profiler, medians of N runs); one GPU only; default off")
    p.add_argument("--backend", choices=["gpu", "host"], default="gpu",
                   help="host: the host backend on CPU tensors, small shapes (a smoke run)")
    p.add_argument("--timeout", type=int, default=1800,
                   help="with --ranks > 1: stop every rank and fail after this many seconds")
    args = p.parse_args()
    dims = GPU_DIMS if args.backend == "gpu" else HOST_DIMS
    unknown = set(args.shapes.split(",")) - set(dims.tokens)
    if unknown:
        p.error("unknown shape(s) %s (known: %s)" % (", ".join(sorted(unknown)),
                                                      ", ".join(dims.tokens)))
    if args.iters < 1 or args.warmup < 0 or args.trace < 0 or args.mega_sms < 0:
        p.error("--iters must be at least 1, --warmup, --trace and --mega-sms at least 0")
    if not 1 <= args.ranks <= EP_MAX_WORLD_SIZE or dims.experts % args.ranks:
        p.error("--ranks %d: the ranks must divide the %d experts (at most %d ranks)"
                % (args.ranks, dims.experts, EP_MAX_WORLD_SIZE))
    if args.backend == "gpu" and args.ranks > 1 and args.ranks > torch.cuda.device_count():
        p.error("--ranks %d needs %d GPUs, this machine has %d"
                % (args.ranks, args.ranks, torch.cuda.device_count()))
    if args.timeout < 1:
        p.error("--timeout must be at least 1 second")
    os.environ.update(NO_MULTICAST_ENV)
    if args.ranks > 1:
        return launch(args)
    header(args, 1)
    run(args, Group())
    return 0


if __name__ == "__main__":
    sys.exit(main())
