#!/usr/bin/env python3
"""ep demo in Python: ctypes only (no numpy), 2 ranks as processes, host backend.
The header's structs and signatures come from python/ep/_abi.py (generated
from include/ep.h); the package python/ep does all this for you.

    python3 demo.py [path/to/libep.so]     (or EP_LIB=path/to/libep.so)

Each rank routes a few tokens at random (some slots dropped), checks
ep_get_dispatch_layout, dispatches BF16 tokens (source order and
expert-major), runs identity experts and combines both ways; out[t] must be
sum_k w[t,k] * x[t]. Exit status 0 only if both ranks pass.
"""
import ctypes
import importlib.util
import os
import random
import struct
import sys

from ctypes import (addressof, byref, c_float, c_int32, c_uint8, c_uint16, c_void_p,
                    sizeof)


def load_abi():
    """The header's constants, structs and signatures, generated from
    include/ep.h into python/ep/_abi.py (never a hand-kept copy)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "ep", "_abi.py")
    spec = importlib.util.spec_from_file_location("ep_abi", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


abi = load_abi()
EP_SUCCESS = abi.EP_SUCCESS
EP_BACKEND_HOST = abi.EP_BACKEND_HOST
EP_DTYPE_BF16 = abi.EP_DTYPE_BF16
EP_COMBINE_SOURCE_ORDER = abi.EP_COMBINE_SOURCE_ORDER
EP_COMBINE_EXPERT_MAJOR = abi.EP_COMBINE_EXPERT_MAJOR
ep_config_t = abi.ep_config_t
ep_unique_id_t = abi.ep_unique_id_t
ep_dispatch_args_t = abi.ep_dispatch_args_t
ep_combine_args_t = abi.ep_combine_args_t

WORLD = 2
HIDDEN = 256
TOPK = 2
EXPERTS = 8
MAX_TOKENS = 32
ALIGNMENT = 4


def load(path):
    """The library, every function with the header's signature (pointers
    are c_void_p: arrays, byref() and None all pass)."""
    lib = ctypes.CDLL(path)
    for name, (result, params, _names) in abi.FUNCTIONS.items():
        fn = getattr(lib, name)
        fn.argtypes = params
        fn.restype = result
    return lib


def call(lib, name, *args):
    status = getattr(lib, name)(*args)
    if status != EP_SUCCESS:
        raise RuntimeError("%s failed: %s (%s)" % (
            name, lib.ep_get_error_string(status).decode(), lib.ep_get_last_error().decode()))


def to_bf16(f):
    u = struct.unpack("<I", struct.pack("<f", f))[0]
    u += 0x7FFF + ((u >> 16) & 1)
    return (u >> 16) & 0xFFFF


def from_bf16(h):
    return struct.unpack("<f", struct.pack("<I", h << 16))[0]


def run_rank(lib, rank, uid):
    failures = []
    cfg = ep_config_t()
    call(lib, "ep_config_init", byref(cfg))
    # The header says how big the struct is; a mismatch means this mirror is stale.
    if cfg.struct_size != sizeof(ep_config_t):
        raise RuntimeError("ep_config_t: library size %d, ctypes size %d"
                           % (cfg.struct_size, sizeof(ep_config_t)))
    cfg.struct_size = sizeof(ep_config_t)
    cfg.backend = EP_BACKEND_HOST
    cfg.hidden = HIDDEN
    cfg.topk = TOPK
    cfg.num_experts = EXPERTS
    cfg.max_tokens_per_rank = MAX_TOKENS
    cfg.ll_max_tokens_per_rank = 0
    cfg.timeout_ms = 60000
    ctx = c_void_p()
    call(lib, "ep_ctx_create", byref(ctx), WORLD, uid, rank, rank, byref(cfg))
    handle = c_void_p()
    try:
        local = c_int32()
        call(lib, "ep_ctx_get_info", ctx, None, None, byref(local), None)
        local = local.value

        rng = random.Random(1000 + rank)
        nt = 12 + 5 * rank
        x = [to_bf16(rng.uniform(-1, 1)) for _ in range(nt * HIDDEN)]
        idx, w = [], []
        for _ in range(nt):
            experts = rng.sample(range(EXPERTS), TOPK)
            idx += [e if rng.random() > 0.2 else -1 for e in experts]
            w += [rng.uniform(0.1, 1.0) for _ in experts]
        x_c = (c_uint16 * len(x))(*x)
        idx_c = (c_int32 * len(idx))(*idx)
        w_c = (c_float * len(w))(*w)

        # Layout.
        per_rank = (c_int32 * WORLD)()
        per_expert = (c_int32 * EXPERTS)()
        in_rank = (c_uint8 * (nt * WORLD))()
        call(lib, "ep_get_dispatch_layout", ctx, idx_c, nt, per_rank, per_expert, in_rank, None)
        want_rank, want_expert = [0] * WORLD, [0] * EXPERTS
        for t in range(nt):
            to = [0] * WORLD
            for e in idx[t * TOPK:(t + 1) * TOPK]:
                if e >= 0:
                    want_expert[e] += 1
                    to[e // local] = 1
            for r in range(WORLD):
                want_rank[r] += to[r]
                if in_rank[t * WORLD + r] != to[r]:
                    failures.append("is_token_in_rank[%d][%d]" % (t, r))
        if list(per_rank) != want_rank:
            failures.append("num_tokens_per_rank %s != %s" % (list(per_rank), want_rank))
        if list(per_expert) != want_expert:
            failures.append("num_tokens_per_expert %s != %s" % (list(per_expert), want_expert))

        # Dispatch, both outputs.
        recv_cap, expert_cap = c_int32(), c_int32()
        call(lib, "ep_get_dispatch_capacity", ctx, ALIGNMENT, byref(recv_cap), byref(expert_cap))
        rc, ec = recv_cap.value, expert_cap.value
        recv_x = (c_uint16 * (rc * HIDDEN))()
        recv_idx = (c_int32 * (rc * TOPK))()
        recv_w = (c_float * (rc * TOPK))()
        recv_src = (c_int32 * (rc * 2))()
        expert_x = (c_uint16 * (ec * HIDDEN))()
        expert_w = (c_float * ec)()
        src_row = (c_int32 * ec)()
        offsets = (c_int32 * (local + 1))()
        counts = (c_int32 * local)()
        recv_rows = c_int32(-1)
        host_counts = (c_int32 * local)()

        call(lib, "ep_handle_create", ctx, byref(handle))
        da = ep_dispatch_args_t()
        call(lib, "ep_dispatch_args_init", byref(da))
        if da.struct_size != sizeof(ep_dispatch_args_t):
            raise RuntimeError("ep_dispatch_args_t: library size %d, ctypes size %d"
                               % (da.struct_size, sizeof(ep_dispatch_args_t)))
        da.num_tokens = nt
        da.dtype = EP_DTYPE_BF16
        da.x = ctypes.cast(x_c, c_void_p)
        da.topk_idx = addressof(idx_c)
        da.topk_weights = addressof(w_c)
        da.recv_capacity = rc
        da.expert_alignment = ALIGNMENT
        da.recv_x = ctypes.cast(recv_x, c_void_p)
        da.recv_topk_idx = addressof(recv_idx)
        da.recv_topk_weights = addressof(recv_w)
        da.recv_src_info = addressof(recv_src)
        da.expert_capacity = ec
        da.expert_x = ctypes.cast(expert_x, c_void_p)
        da.expert_weights = addressof(expert_w)
        da.expert_src_row = addressof(src_row)
        da.expert_offsets = addressof(offsets)
        da.expert_counts = addressof(counts)
        da.host_recv_num_tokens = addressof(recv_rows)
        da.host_expert_counts = addressof(host_counts)
        call(lib, "ep_dispatch", ctx, byref(da), handle, None)
        n = recv_rows.value
        if not 0 <= n <= rc:
            raise RuntimeError("unusable received row count %d" % n)
        if list(host_counts) != list(counts):
            failures.append("host_expert_counts %s != expert_counts %s"
                            % (list(host_counts), list(counts)))
        for e in range(local):
            if offsets[e] % ALIGNMENT or offsets[e + 1] < offsets[e] + counts[e]:
                failures.append("expert segment %d misaligned" % e)
            for j in range(offsets[e], offsets[e] + counts[e]):
                r = src_row[j]
                if not (0 <= r < n and expert_x[j * HIDDEN:(j + 1) * HIDDEN]
                        == recv_x[r * HIDDEN:(r + 1) * HIDDEN]):
                    failures.append("expert-major row %d != source row %d" % (j, r))

        def check_out(out, what):
            bad = 0
            for t in range(nt):
                wsum = sum(w[t * TOPK + k] for k in range(TOPK) if idx[t * TOPK + k] >= 0)
                for c in range(HIDDEN):
                    xv = from_bf16(x[t * HIDDEN + c])
                    got = from_bf16(out[t * HIDDEN + c])
                    if not abs(got - wsum * xv) <= wsum * abs(xv) / 64 + 1e-3:
                        bad += 1
            if bad:
                failures.append("%s: %d values out of tolerance" % (what, bad))

        # Identity experts, expert-major combine (the library weighs).
        out = (c_uint16 * (nt * HIDDEN))()
        ca = ep_combine_args_t()
        call(lib, "ep_combine_args_init", byref(ca))
        ca.input_layout = EP_COMBINE_EXPERT_MAJOR
        ca.x = ctypes.cast(expert_x, c_void_p)
        ca.out = ctypes.cast(out, c_void_p)
        call(lib, "ep_combine", ctx, byref(ca), handle, None)
        check_out(out, "combine (expert-major)")

        # Identity experts reduced here per source-order row, then combined.
        y = (c_uint16 * (max(n, 1) * HIDDEN))()
        for i in range(n):
            wsum = sum(recv_w[i * TOPK + k] for k in range(TOPK) if recv_idx[i * TOPK + k] >= 0)
            for c in range(HIDDEN):
                y[i * HIDDEN + c] = to_bf16(wsum * from_bf16(recv_x[i * HIDDEN + c]))
        out = (c_uint16 * (nt * HIDDEN))()
        ca.input_layout = EP_COMBINE_SOURCE_ORDER
        ca.x = ctypes.cast(y, c_void_p)
        ca.out = ctypes.cast(out, c_void_p)
        call(lib, "ep_combine", ctx, byref(ca), handle, None)
        check_out(out, "combine (source order)")

        for f in failures[:10]:
            print("rank %d: FAIL: %s" % (rank, f), file=sys.stderr)
        print("rank %d/%d (process): %d tokens, received %d rows: %s"
              % (rank, WORLD, nt, n, "FAILED" if failures else "ok"), flush=True)
    finally:
        lib.ep_handle_destroy(handle)
        lib.ep_ctx_destroy(ctx)
    return not failures


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("EP_LIB")
    if not path:
        print("usage: demo.py path/to/libep.so (or set EP_LIB)", file=sys.stderr)
        return 2
    lib = load(path)
    uid = ep_unique_id_t()
    call(lib, "ep_get_unique_id", byref(uid))
    sys.stdout.flush()
    pids = []
    for rank in range(WORLD):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = 0 if run_rank(lib, rank, uid) else 1
            except Exception as e:  # report and fail this rank
                print("rank %d: %s" % (rank, e), file=sys.stderr)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    failed = 0
    for rank, pid in enumerate(pids):
        _, status = os.waitpid(pid, 0)
        if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
            print("rank %d failed (wait status %d)" % (rank, status), file=sys.stderr)
            failed += 1
    if failed:
        print("demo.py: %d of %d ranks failed" % (failed, WORLD), file=sys.stderr)
        return 1
    print("demo.py: all %d ranks passed" % WORLD)
    return 0


if __name__ == "__main__":
    sys.exit(main())
