#!/usr/bin/env python3
"""Fused-kernel benchmark: ep's fused calls next to ep's unfused path and
torch's grouped GEMMs, in one process on one GPU (world size 1).

    python3 bench/mega_bench.py [--lib path/to/libep.so] [--iters 30] [--warmup 5]

Workload W3 (bench/README.md): 4096 tokens of top-8 over 32 experts, hidden
7168, uniform random routing; GEMM1 (gate+up) k 7168 -> n 4096, GEMM2 (down)
k 2048 -> n 7168; and the decode shape: 128 tokens of top-8 (about 32 rows
per expert). Every figure is the median of --iters runs timed with CUDA
events after --warmup runs. Rows of the table:

  fused dispatch+GEMM      ep_mega_dispatch_gemm (routing, row moves, GEMM)
  unfused dispatch+GEMM    ep_dispatch (expert-major) + torch grouped GEMM
  fused GEMM+combine       ep_mega_gemm_combine (GEMM, weighted sums, reduce)
  unfused GEMM+combine     torch grouped GEMM + ep_combine (expert-major)
  torch GEMM alone         torch._grouped_mm (BF16) / _scaled_grouped_mm (FP8,
                           rowwise scales) on the same rows

TFLOP/s count 2 * rows * n * k over the real (token, expert) rows.
Needs torch with CUDA and a Hopper GPU.
"""
import argparse
import ctypes
import os
import statistics
import sys
import time
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
EP_DTYPE_BF16 = abi.EP_DTYPE_BF16
EP_DTYPE_FP8_E4M3 = abi.EP_DTYPE_FP8_E4M3
EP_DISPATCH_NO_HOST_SYNC = abi.EP_DISPATCH_NO_HOST_SYNC
EP_COMBINE_EXPERT_MAJOR = abi.EP_COMBINE_EXPERT_MAJOR
ep_config_t = abi.ep_config_t
ep_unique_id_t = abi.ep_unique_id_t
ep_dispatch_args_t = abi.ep_dispatch_args_t
ep_combine_args_t = abi.ep_combine_args_t
ep_mega_args_t = abi.ep_mega_args_t
P = c_void_p


def load(path):
    lib = ctypes.CDLL(path)
    for name, (res, args, _names) in abi.FUNCTIONS.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res
    return lib


def check(lib, status, what):
    if status != EP_SUCCESS:
        raise RuntimeError("%s: status %d: %s" % (what, status, lib.ep_get_last_error().decode()))


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


def weight_block_scales(w):
    """FP8 weights [E, n, k] with one scale per 128 x 128 block."""
    e, n, k = w.shape
    blocks = w.float().reshape(e, n // 128, 128, k // 128, 128)
    amax = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-4)
    scale = amax / 448.0
    q = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).reshape(e, n, k)
    return q.contiguous(), scale.contiguous()


def time_op(fn, iters, warmup):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


class Ep:
    """One world-1 GPU context of the W3 shape and its buffers."""

    def __init__(self, lib, hidden, topk, experts, max_tokens, alignment):
        self.lib = lib
        cfg = init(lib, ep_config_t, "ep_config_init")
        cfg.backend = EP_BACKEND_GPU
        cfg.hidden, cfg.topk, cfg.num_experts = hidden, topk, experts
        cfg.max_tokens_per_rank = max_tokens
        cfg.ll_max_tokens_per_rank = 0
        cfg.num_sms = 24
        uid = ep_unique_id_t()
        check(lib, lib.ep_get_unique_id(byref(uid)), "ep_get_unique_id")
        self.ctx = P()
        check(lib, lib.ep_ctx_create(byref(self.ctx), 1, uid, 0, torch.cuda.current_device(),
                                     byref(cfg)), "ep_ctx_create")
        self.handle = P()
        check(lib, lib.ep_handle_create(self.ctx, byref(self.handle)), "ep_handle_create")
        cap = c_int32()
        check(lib, lib.ep_get_dispatch_capacity(self.ctx, alignment, None, byref(cap)), "capacity")
        self.capacity = cap.value
        self.hidden, self.experts, self.alignment = hidden, experts, alignment
        dev = "cuda"
        self.expert_x = torch.empty(self.capacity * hidden * 2, dtype=torch.uint8, device=dev)
        self.expert_scales = torch.empty(self.capacity, hidden // 128, dtype=torch.float32, device=dev)
        self.expert_weights = torch.empty(self.capacity, dtype=torch.float32, device=dev)
        self.expert_src_row = torch.empty(self.capacity, dtype=torch.int32, device=dev)
        self.expert_offsets = torch.empty(experts + 1, dtype=torch.int32, device=dev)
        self.expert_counts = torch.empty(experts, dtype=torch.int32, device=dev)

    def stream(self):
        return P(torch.cuda.current_stream().cuda_stream)

    def dispatch_args(self, x, x_scales, topk_idx, topk_weights, dtype):
        a = init(self.lib, ep_dispatch_args_t, "ep_dispatch_args_init")
        a.flags = EP_DISPATCH_NO_HOST_SYNC
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
        check(self.lib, self.lib.ep_mega_gemm_combine(self.ctx, byref(m), self.handle,
                                                      self.stream()), "ep_mega_gemm_combine")

    def status(self):
        s = c_int32()
        check(self.lib, self.lib.ep_ctx_get_async_error(self.ctx, byref(s)), "async error")
        if s.value != EP_SUCCESS:
            raise RuntimeError("async error %d: %s" % (s.value, self.lib.ep_get_last_error().decode()))

    def close(self):
        torch.cuda.synchronize()
        self.lib.ep_handle_destroy(self.handle)
        self.lib.ep_ctx_destroy(self.ctx)


def routing(tokens, experts, topk):
    idx = torch.rand(tokens, experts, device="cuda").topk(topk, dim=1).indices.to(torch.int32)
    weights = torch.rand(tokens, topk, device="cuda", dtype=torch.float32)
    return idx.contiguous(), weights.contiguous()


def grouped_bf16(a, w, offs):
    return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs, out_dtype=torch.bfloat16)


def grouped_fp8(a, a_scale, w, w_scale, offs):
    return torch._scaled_grouped_mm(a, w.transpose(-2, -1), a_scale, w_scale, offs=offs,
                                    out_dtype=torch.bfloat16)


def run(args):
    lib = load(args.lib)
    torch.manual_seed(0)
    hidden, n1, k2, experts, topk = 7168, 4096, 2048, 32, 8
    rows_out = []

    def row(name, us, flops):
        tflops = flops / us / 1e6 if us and flops else None
        rows_out.append((name, us, tflops))
        print("  %-48s %10s us %8s TFLOP/s" % (
            name, "%.1f" % us if us else "n/a", "%.0f" % tflops if tflops else "-"), flush=True)

    def timed(name, fn, flops):
        try:
            us = time_op(fn, args.iters, args.warmup)
        except Exception as e:  # a baseline that this torch cannot run
            print("  %s: %s" % (name, e), flush=True)
            us = None
        row(name, us, flops)

    shapes = {"w3": 4096, "decode": 128}
    for shape in args.shapes.split(","):
        tokens = shapes[shape]
        torch.manual_seed(tokens)
        x = (torch.rand(tokens, hidden, device="cuda") * 2 - 1).to(torch.bfloat16)
        xq, xs = quantize_fp8(x)
        idx, wts = routing(tokens, experts, topk)
        rows = tokens * topk
        w1 = (torch.randn(experts, n1, hidden, device="cuda") * 0.05).to(torch.bfloat16)
        w2 = (torch.randn(experts, hidden, k2, device="cuda") * 0.05).to(torch.bfloat16)
        w1q, w1s = weight_block_scales(w1)
        w2q, w2s = weight_block_scales(w2)
        f1, f2 = 2.0 * rows * n1 * hidden, 2.0 * rows * hidden * k2
        print("%s: %d tokens, top-%d of %d experts, hidden %d; GEMM1 n %d; GEMM2 k %d"
              % (shape, tokens, topk, experts, hidden, n1, k2), flush=True)
        # Fused calls with single blocks (the default) and clusters of 2; the
        # library reads EP_MEGA_CLUSTER when a context is created.
        for cluster in args.clusters.split(","):
            os.environ["EP_MEGA_CLUSTER"] = cluster
            ep = Ep(lib, hidden, topk, experts, tokens, 128)
            y1 = torch.empty(ep.capacity, n1, dtype=torch.bfloat16, device="cuda")
            y2 = torch.empty(ep.capacity, hidden, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="cuda")
            x2 = (torch.rand(ep.capacity, k2, device="cuda") * 2 - 1).to(torch.bfloat16)
            x2q, x2s = quantize_fp8(x2)
            baselines = cluster == args.clusters.split(",")[0]
            for dtype, name in [(EP_DTYPE_BF16, "BF16"), (EP_DTYPE_FP8_E4M3, "FP8")]:
                fp8 = dtype == EP_DTYPE_FP8_E4M3
                tag = "%s %s" % (shape, name)
                a = ep.dispatch_args(xq if fp8 else x, xs if fp8 else None, idx, wts, dtype)
                w1_, w1s_ = (w1q, w1s) if fp8 else (w1, None)
                w2_, w2s_ = (w2q, w2s) if fp8 else (w2, None)
                timed("%s fused dispatch+GEMM (clusters of %s)" % (tag, cluster),
                      lambda: ep.mega_dispatch_gemm(a, dtype, w1_, w1s_, y1, n1), f1)
                ep.status()
                ep.dispatch(a)
                timed("%s fused GEMM+combine (clusters of %s)" % (tag, cluster),
                      lambda: ep.mega_gemm_combine(dtype, x2q if fp8 else x2, x2s if fp8 else None,
                                                   w2_, w2s_, y2, out), f2)
                ep.status()
                if not baselines:
                    continue
                offs = ep.expert_offsets[1:]
                ex = ep.expert_x[:ep.capacity * hidden * (1 if fp8 else 2)]
                ex = ex.view(torch.float8_e4m3fn if fp8 else torch.bfloat16).view(ep.capacity, hidden)
                ones_m = torch.ones(ep.capacity, device="cuda")
                ones_w1 = torch.ones(experts, n1, device="cuda")
                ones_w2 = torch.ones(experts, hidden, device="cuda")
                if fp8:
                    gemm1 = lambda: grouped_fp8(ex, ones_m, w1q, ones_w1, offs)
                    gemm2 = lambda: grouped_fp8(x2q, ones_m, w2q, ones_w2, offs)
                else:
                    gemm1 = lambda: grouped_bf16(ex, w1, offs)
                    gemm2 = lambda: grouped_bf16(x2, w2, offs)
                timed("%s ep_dispatch alone (expert-major)" % tag, lambda: ep.dispatch(a), None)
                timed("%s unfused ep_dispatch + torch GEMM" % tag,
                      lambda: (ep.dispatch(a), gemm1()), f1)
                timed("%s torch GEMM1 alone" % tag, gemm1, f1)
                timed("%s unfused torch GEMM + ep_combine" % tag,
                      lambda: ep.combine(gemm2(), out), f2)
                timed("%s torch GEMM2 alone" % tag, gemm2, f2)
                ep.status()
            ep.close()

    print()
    print("| op | median us | TFLOP/s |")
    print("| --- | ---: | ---: |")
    for name, us, tflops in rows_out:
        print("| %s | %s | %s |" % (name, "%.1f" % us if us else "n/a",
                                    "%.0f" % tflops if tflops else "-"))


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", default=os.environ.get("EP_LIB", os.path.join(here, "libep.so")))
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--shapes", default="w3,decode", help="comma list of w3, decode")
    p.add_argument("--clusters", default="1",
                   help="cluster sizes of the fused kernels to time (EP_MEGA_CLUSTER)")
    args = p.parse_args()
    print("date: %s, device: %s, torch %s" % (time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                              torch.cuda.get_device_name(), torch.__version__))
    run(args)


if __name__ == "__main__":
    sys.exit(main())
