"""The package on GPUs with torch: every result of the GPU backend compared
with the host backend's on the same inputs (dispatch bit for bit, combines
within one BF16 rounding, as tests/gpu_normal.rs), both modes, CUDA-graph
capture with ``torch.cuda.graph`` and replay with new routing (and, for the
low-latency mode, a new token count each replay), and misuse.

One process per GPU (up to 4), joined by ``torch.distributed`` (gloo) and
``ep.from_process_group`` / ``ep.Buffer``. Skipped without torch or a GPU,
unless ``EP_REQUIRE_GPU=1`` (scripts/gpu-check.sh sets it): then that fails.
Needs torch only (no numpy).
"""
import datetime
import os
import socket
import traceback

import pytest

try:
    import torch
    HAVE_GPU = torch.cuda.is_available() and torch.cuda.device_count() > 0
except ImportError:  # pragma: no cover - CI has no torch
    torch = None
    HAVE_GPU = False

if not HAVE_GPU:
    if os.environ.get("EP_REQUIRE_GPU") == "1":
        raise RuntimeError("EP_REQUIRE_GPU=1 but torch with a CUDA GPU is not available")
    pytest.skip("needs torch and a CUDA GPU", allow_module_level=True)

import ep  # noqa: E402

HIDDEN = 1024
TOPK = 4
MAX_TOKENS = 128
LL_TOKENS = 32


def configs(world):
    common = dict(hidden=HIDDEN, topk=TOPK, num_experts=8 * world, max_tokens_per_rank=MAX_TOKENS,
                  ll_max_tokens_per_rank=LL_TOKENS, timeout_ms=60000)
    return ep.Config(backend="gpu", **common), ep.Config(backend="host", **common)


def routing(gen, n, experts, drop=0.2):
    idx = torch.rand(n, experts, generator=gen).argsort(dim=1)[:, :TOPK].to(torch.int32)
    idx[torch.rand(n, TOPK, generator=gen) < drop] = -1
    return idx


def tokens(gen, n):
    return torch.randn(n, HIDDEN, generator=gen).to(torch.bfloat16)


def bits(t):
    t = t.detach().cpu().contiguous()
    view = {torch.bfloat16: torch.int16, torch.float32: torch.int32}.get(t.dtype)
    if view is not None:
        return t.view(view)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    return t


class Checker:
    """Collects mismatches of one rank instead of stopping at the first."""

    def __init__(self, rank):
        self.rank = rank
        self.failures = []
        self.inexact = 0

    def same(self, got, want, what):
        got, want = bits(got), bits(want)
        if got.shape != want.shape or not torch.equal(got, want):
            self.failures.append(f"rank {self.rank}: {what}: differs (shapes "
                                 f"{list(got.shape)} vs {list(want.shape)})")

    def close(self, got, want, what):
        """Within one BF16 rounding of the larger magnitude."""
        g, w = got.detach().cpu().float(), want.detach().cpu().float()
        if g.shape != w.shape:
            self.failures.append(f"rank {self.rank}: {what}: shape {list(g.shape)} vs "
                                 f"{list(w.shape)}")
            return
        if not torch.equal(bits(got), bits(want)):
            self.inexact += 1
        tol = torch.maximum(g.abs(), w.abs()) / 128 + 1e-6
        bad = ((g - w).abs() > tol) | (g.isnan() != w.isnan())
        if bad.any():
            self.failures.append(f"rank {self.rank}: {what}: {int(bad.sum())} values differ")


def normal_round(gpu, host, check, seed, n, dtype):
    """One normal-mode dispatch + both combines on both backends."""
    gen = torch.Generator().manual_seed(seed * 131 + gpu.rank)
    x = tokens(gen, n)
    scales = None
    if dtype == "fp8":
        x = torch.randint(0, 0x7F, (n, HIDDEN), generator=gen, dtype=torch.uint8)
        x = (x | (torch.randint(0, 2, (n, HIDDEN), generator=gen, dtype=torch.uint8) << 7))
        x = x.view(torch.float8_e4m3fn)
        scales = torch.rand(n, HIDDEN // 128, generator=gen) / 64 + 0.01
    idx = routing(gen, n, gpu.num_experts)
    w = torch.rand(n, TOPK, generator=gen)
    dev = f"cuda:{gpu.device}"
    what = f"normal {dtype} n={n} seed={seed}"

    lay_g = gpu.get_dispatch_layout(idx.to(dev).long())
    lay_h = host.get_dispatch_layout(idx)
    for f in ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"):
        check.same(getattr(lay_g, f), getattr(lay_h, f), f"{what}: layout {f}")

    kw = dict(source_order=True, expert_major=True, expert_alignment=8)
    dg = gpu.dispatch(x.to(dev), idx.to(dev), w.to(dev),
                      x_scales=None if scales is None else scales.to(dev), **kw)
    dh = host.dispatch(x, idx, w, x_scales=scales, **kw)
    if (dg.num_recv_tokens, dg.num_expert_rows) != (dh.num_recv_tokens, dh.num_expert_rows):
        check.failures.append(f"rank {gpu.rank}: {what}: counts differ")
        return
    for f in ("recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights", "recv_src_info",
              "recv_num_tokens", "expert_x", "expert_x_scales", "expert_weights",
              "expert_src_row", "expert_offsets", "expert_counts"):
        a, b = getattr(dg, f), getattr(dh, f)
        if (a is None) != (b is None):
            check.failures.append(f"rank {gpu.rank}: {what}: {f} given on one backend only")
        elif a is not None:
            check.same(a, b, f"{what}: {f}")
    if dtype != "bf16":
        return
    # Identity experts: expert-major (library weighs) and source order (x / 2).
    check.close(gpu.combine(dg.expert_x, dg, expert_major=True),
                host.combine(dh.expert_x, dh, expert_major=True), f"{what}: combine EM")
    yh = (dh.recv_x.float() * 0.5).to(torch.bfloat16)
    check.close(gpu.combine(yh.to(dev), dg), host.combine(yh, dh), f"{what}: combine SO")


def ll_round(gpu, host, check, seed, n, weights_at_dispatch):
    gen = torch.Generator().manual_seed(seed * 977 + gpu.rank)
    x, idx, w = tokens(gen, n), routing(gen, n, gpu.num_experts), torch.rand(n, TOPK, generator=gen)
    dev = f"cuda:{gpu.device}"
    what = f"LL n={n} seed={seed} weights at {'dispatch' if weights_at_dispatch else 'combine'}"
    wd = w if weights_at_dispatch else None
    rg = gpu.ll_dispatch(x.to(dev), idx.to(dev), None if wd is None else wd.to(dev))
    rh = host.ll_dispatch(x, idx, wd)
    check.same(rg.recv_count, rh.recv_count, f"{what}: recv_count")
    check.same(rg.recv_layout_range, rh.recv_layout_range, f"{what}: layout range")
    counts = rh.recv_count.tolist()
    for e, c in enumerate(counts):
        check.same(rg.recv_x[e, :c], rh.recv_x[e, :c], f"{what}: recv_x expert {e}")
        check.same(rg.recv_x_scales[e, :c], rh.recv_x_scales[e, :c], f"{what}: scales {e}")
        check.same(rg.recv_src_info[e, :c], rh.recv_src_info[e, :c], f"{what}: src_info {e}")
    y = torch.randn(rh.recv_x.shape, generator=gen).to(torch.bfloat16)
    wc = None if weights_at_dispatch else w
    og = gpu.ll_combine(y.to(dev), rg, None if wc is None else wc.to(dev))
    oh = host.ll_combine(y, rh, wc)
    check.close(og, oh, f"{what}: combine")


def ll_graph(gpu, host, check, seed):
    """Captures one LL dispatch + combine (BF16, identity experts, the token
    count in device memory) and replays it with new routing and counts."""
    dev = f"cuda:{gpu.device}"
    x_s = torch.zeros(LL_TOKENS, HIDDEN, dtype=torch.bfloat16, device=dev)
    idx_s = torch.full((LL_TOKENS, TOPK), -1, dtype=torch.int32, device=dev)
    w_s = torch.zeros(LL_TOKENS, TOPK, device=dev)
    n_s = torch.zeros(1, dtype=torch.int32, device=dev)
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up outside the capture (kernels loaded, buffers made)
        res = gpu.ll_dispatch(x_s, idx_s, w_s, num_tokens=n_s, fp8=False)
        out = gpu.ll_combine(res.recv_x, res)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gpu.ll_dispatch(x_s, idx_s, w_s, num_tokens=n_s, fp8=False, out=res)
        gpu.ll_combine(res.recv_x, res, out=out)
    for replay, n in enumerate([LL_TOKENS, 1, 0, 17 + gpu.rank % 3]):
        gen = torch.Generator().manual_seed(seed * 7919 + replay * 31 + gpu.rank)
        x, idx, w = tokens(gen, n), routing(gen, n, gpu.num_experts), torch.rand(n, TOPK,
                                                                               generator=gen)
        x_s[:n].copy_(x)
        idx_s[:n].copy_(idx)
        w_s[:n].copy_(w)
        n_s.fill_(n)
        graph.replay()
        torch.cuda.synchronize(dev)
        rh = host.ll_dispatch(x, idx, w, fp8=False)
        oh = host.ll_combine(rh.recv_x, rh)
        what = f"LL graph replay {replay} (n={n})"
        check.same(res.recv_count, rh.recv_count, f"{what}: recv_count")
        check.close(out[:n], oh, f"{what}: combine")
    gpu.check_async_error()


def normal_graph(gpu, host, check, seed):
    """Captures a no-sync expert-major dispatch + combine and replays it
    with new routing and tokens (same count)."""
    dev = f"cuda:{gpu.device}"
    n = 48 + 8 * gpu.rank
    gen = torch.Generator().manual_seed(seed)
    x_s, idx_s = tokens(gen, n).to(dev), routing(gen, n, gpu.num_experts).to(dev)
    w_s = torch.rand(n, TOPK, generator=gen).to(dev)
    kw = dict(source_order=False, expert_major=True, expert_alignment=4, no_host_sync=True)
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        d = gpu.dispatch(x_s, idx_s, w_s, **kw)
        out = gpu.combine(d.expert_x, d)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gpu.dispatch(x_s, idx_s, w_s, out=d, **kw)
        gpu.combine(d.expert_x, d, out=out)
    for replay in range(3):
        gen = torch.Generator().manual_seed(seed * 104729 + replay * 17 + gpu.rank)
        x, idx, w = tokens(gen, n), routing(gen, n, gpu.num_experts), torch.rand(n, TOPK,
                                                                               generator=gen)
        x_s.copy_(x)
        idx_s.copy_(idx)
        w_s.copy_(w)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize(dev)
        dh = host.dispatch(x, idx, w, source_order=False, expert_major=True, expert_alignment=4)
        what = f"normal graph replay {replay}"
        check.same(d.expert_counts, dh.expert_counts, f"{what}: expert_counts")
        check.close(out, host.combine(dh.expert_x, dh), f"{what}: combine")
    gpu.check_async_error()


def misuse(gpu, check):
    dev = f"cuda:{gpu.device}"
    x = torch.zeros(2, HIDDEN, dtype=torch.bfloat16)
    idx = torch.zeros(2, TOPK, dtype=torch.int32)
    cases = [
        ("a CPU tensor on the GPU backend", ep.InvalidArgumentError, "needs cuda:",
         lambda: gpu.ll_dispatch(x, idx.to(dev))),
        ("more tokens than ll_max_tokens_per_rank", ep.InvalidArgumentError,
         "above the configured maximum",
         lambda: gpu.ll_dispatch(torch.zeros(LL_TOKENS + 1, HIDDEN, dtype=torch.bfloat16,
                                             device=dev),
                                 torch.zeros(LL_TOKENS + 1, TOPK, dtype=torch.int32, device=dev))),
        ("a host-synchronised dispatch while capturing", ep.InvalidArgumentError,
         "cannot be captured", lambda: _capture_sync_dispatch(gpu)),
    ]
    for what, cls, text, call in cases:
        try:
            call()
            check.failures.append(f"rank {gpu.rank}: misuse ({what}) raised nothing")
        except cls as e:
            if text not in str(e):
                check.failures.append(f"rank {gpu.rank}: misuse ({what}): message {e}")
        except Exception as e:  # the wrong class
            check.failures.append(f"rank {gpu.rank}: misuse ({what}): {type(e).__name__}: {e}")
    gpu.check_async_error()  # a refused call leaves the context usable


def _capture_sync_dispatch(gpu):
    dev = f"cuda:{gpu.device}"
    x = torch.zeros(1, HIDDEN, dtype=torch.bfloat16, device=dev)
    idx = torch.zeros(1, TOPK, dtype=torch.int32, device=dev)
    w = torch.zeros(1, TOPK, device=dev)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            gpu.dispatch(x, idx, w)
    finally:
        torch.cuda.synchronize(dev)


def worker(rank, world, port, queue):
    """One rank: GPU and host contexts of one group, every case."""
    import torch.distributed as dist

    failures = []
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
        gpu_cfg, host_cfg = configs(world)
        with ep.from_process_group(gpu_cfg) as gpu, ep.Buffer(None, host_cfg) as host:
            assert (gpu.backend, host.backend, gpu.device) == ("gpu", "host", rank)
            check = Checker(rank)
            counts = [37, 0, MAX_TOKENS, 1]
            for seed, n in enumerate([counts[rank % 4], counts[(rank + 1) % 4]]):
                for dtype in ("bf16", "fp8"):
                    normal_round(gpu, host, check, seed, n, dtype)
            for seed, n in enumerate([LL_TOKENS, 1, 0, 9 + rank]):
                ll_round(gpu, host, check, seed, n, weights_at_dispatch=seed % 2 == 0)
            ll_graph(gpu, host, check, 11)
            normal_graph(gpu, host, check, 12)
            misuse(gpu, check)
            gpu.check_async_error()
            failures = check.failures
            queue.put((rank, failures, check.inexact))
            dist.barrier()
    except BaseException:
        queue.put((rank, failures + [f"rank {rank}: " + traceback.format_exc()], 0))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gpu_backend_matches_the_host_backend_in_both_modes_and_in_cuda_graphs():
    world = min(torch.cuda.device_count(), 4)
    mp = torch.multiprocessing.get_context("spawn")
    queue = mp.Queue()
    port = free_port()
    # Daemons: a rank stuck after a failure must not keep pytest from exiting.
    procs = [mp.Process(target=worker, args=(r, world, port, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=280) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.terminate()
    failures = [f for _, fs, _ in results for f in fs]
    inexact = sum(i for _, _, i in results)
    print(f"{world} ranks; combines not bit-exact (within one BF16 rounding): {inexact}")
    assert not failures, "\n".join(failures)
    assert all(p.exitcode == 0 for p in procs)


def nccl_worker(port, queue):
    """One rank of a 1-rank NCCL process group: an ep context made from the
    group's communicator (``ep.from_nccl_communicator``) against a host
    context, both modes."""
    import torch.distributed as dist

    failures = []
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, device_id=torch.device("cuda", 0))
        dist.barrier()  # the communicator exists after a first collective
        gpu_cfg, host_cfg = configs(1)
        with ep.from_nccl_communicator(dist.group.WORLD, gpu_cfg) as gpu, \
                ep.Buffer(None, host_cfg) as host:
            assert (gpu.backend, gpu.world_size, gpu.rank) == ("gpu", 1, 0)
            check = Checker(0)
            normal_round(gpu, host, check, 21, 37, "bf16")
            ll_round(gpu, host, check, 22, LL_TOKENS, weights_at_dispatch=True)
            gpu.check_async_error()
            failures = check.failures
    except BaseException:
        failures = failures + ["rank 0: " + traceback.format_exc()]
    finally:
        queue.put(failures)
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_context_from_a_torch_nccl_group_matches_the_host_backend():
    backend = torch.distributed.ProcessGroupNCCL if torch.distributed.is_nccl_available() else None
    if backend is None or not hasattr(backend, "_comm_ptr"):
        pytest.skip("this torch gives no NCCL communicator address (ProcessGroupNCCL._comm_ptr)")
    mp = torch.multiprocessing.get_context("spawn")
    queue = mp.Queue()
    proc = mp.Process(target=nccl_worker, args=(free_port(), queue), daemon=True)
    proc.start()
    failures = queue.get(timeout=120)
    proc.join(timeout=60)
    assert not failures, "\n".join(failures)
