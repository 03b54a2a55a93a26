"""The package on the host backend (no GPU): both modes against the numpy
reference (bit for bit, FP8 within e4m3 precision), 2 ranks as threads and
as processes, numpy arrays and (where torch is installed) CPU tensors, and
misuse raising the right exceptions."""
import ctypes
import dataclasses
import multiprocessing
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import ep
import reference as ref
from conftest import run_ranks, to_family, to_numpy

TOPO = ref.Topo(world=2, num_experts=8, topk=3, hidden=256)
MAX_TOKENS = 24
LL_TOKENS = 16


def config(**overrides) -> ep.Config:
    base = dict(hidden=TOPO.hidden, topk=TOPO.topk, num_experts=TOPO.num_experts,
                max_tokens_per_rank=MAX_TOKENS, ll_max_tokens_per_rank=LL_TOKENS,
                backend="host", timeout_ms=20000)
    base.update(overrides)
    return ep.Config(**base)


def inputs(seed: int, counts, fp8: bool = False):
    """Every rank's input (each rank thread recomputes all of them)."""
    return [ref.random_input(np.random.default_rng(seed * 100 + r), TOPO, n, fp8=fp8)
            for r, n in enumerate(counts)]


def assert_rows(got, want, what):
    """Bit-exact equality (BF16 as uint16 bits, FP8 as codes)."""
    got = to_numpy(got)
    assert (got.shape, got.dtype) == (want.shape, want.dtype), \
        f"{what}: {got.shape} {got.dtype} != {want.shape} {want.dtype}"
    assert np.array_equal(got, want), what


@pytest.mark.parametrize("counts", [(13, 7), (0, 9), (1, 24)])
def test_normal_mode_matches_the_reference(family, counts):
    """Layout, dispatch (source order and expert-major) and both combines."""
    all_inputs = inputs(1, counts)
    alignment = 4

    def body(ctx):
        r = ctx.rank
        mine = all_inputs[r]
        x = to_family(mine.x, family)
        idx = to_family(mine.topk_idx.astype(np.int64), family)  # DeepEP's int64 is taken
        w = to_family(mine.weights, family)

        lay = ctx.get_dispatch_layout(idx)
        want = ref.layout(TOPO, mine.topk_idx)
        assert np.array_equal(to_numpy(lay.num_tokens_per_rank), want[0])
        assert np.array_equal(to_numpy(lay.num_tokens_per_expert), want[1])
        assert np.array_equal(to_numpy(lay.is_token_in_rank), want[2])

        d = ctx.dispatch(x, idx, w, source_order=True, expert_major=True,
                         expert_alignment=alignment)
        want = ref.dispatch(TOPO, all_inputs, r, alignment)
        assert d.num_recv_tokens == want.x.shape[0]
        assert d.num_expert_rows == want.expert_x.shape[0]
        assert d.expert_counts_host == want.expert_counts.tolist()
        assert_rows(d.recv_x, want.x, "recv_x")
        assert_rows(d.recv_topk_idx, want.topk_idx, "recv_topk_idx")
        assert_rows(d.recv_topk_weights, want.topk_weights, "recv_topk_weights")
        assert_rows(d.recv_src_info, want.src_info, "recv_src_info")
        assert to_numpy(d.recv_num_tokens)[0] == want.x.shape[0]
        assert_rows(d.expert_x, want.expert_x, "expert_x")
        assert_rows(d.expert_weights, want.expert_weights, "expert_weights")
        assert_rows(d.expert_src_row, want.expert_src_row, "expert_src_row")
        assert_rows(d.expert_offsets, want.expert_offsets, "expert_offsets")
        assert_rows(d.expert_counts, want.expert_counts, "expert_counts")

        # Identity experts. Expert-major: the library weighs and reduces.
        out_em = ctx.combine(d.expert_x, d, expert_major=True)
        # Source order: the caller reduces (here: rows scaled by 0.5).
        y = ref.bf16(ref.f32(want.x) * np.float32(0.5))
        out_src = ctx.combine(to_family(y, family), d.handle, out=to_family(
            np.full((counts[r], TOPO.hidden), 0xFFFF, np.uint16), family))
        return want, out_em, out_src, y

    results = run_ranks(2, config(), body)
    for r, (_, out_em, out_src, _) in enumerate(results):
        em_rows = [(ref.expert_partials(w, w.expert_x), w.src_info) for w, *_ in results]
        src_rows = [(y, w.src_info) for w, _, _, y in results]
        assert_rows(out_em, ref.combine(TOPO, r, counts[r], em_rows), f"rank {r} combine EM")
        assert_rows(out_src, ref.combine(TOPO, r, counts[r], src_rows), f"rank {r} combine SO")


def test_fp8_dispatch_moves_codes_and_scales(family):
    counts = (11, 6)
    all_inputs = inputs(2, counts, fp8=True)

    def body(ctx):
        mine = all_inputs[ctx.rank]
        d = ctx.dispatch(to_family(mine.x, family), to_family(mine.topk_idx, family),
                         to_family(mine.weights, family),
                         x_scales=to_family(mine.scales, family), expert_major=True,
                         source_order=True, expert_alignment=8)
        want = ref.dispatch(TOPO, all_inputs, ctx.rank, 8)
        assert_rows(d.recv_x, want.x, "recv_x")
        assert_rows(d.recv_x_scales, want.scales, "recv_x_scales")
        assert_rows(d.expert_x, want.expert_x, "expert_x")
        assert_rows(d.expert_x_scales, want.expert_scales, "expert_x_scales")

    run_ranks(2, config(), body)


def test_no_host_sync_reuse_layout_and_out_buffers(family):
    """no_host_sync (the host backend still knows the counts), a second
    dispatch into the first one's buffers, and reuse_layout."""
    counts = (9, 14)
    first, second = inputs(3, counts), inputs(4, counts)
    for i in range(2):
        second[i].topk_idx = first[i].topk_idx  # same routing, new tokens

    def body(ctx):
        r = ctx.rank
        a, b = first[r], second[r]
        d1 = ctx.dispatch(to_family(a.x, family), to_family(a.topk_idx, family),
                          to_family(a.weights, family), no_host_sync=True)
        want1 = ref.dispatch(TOPO, first, r, 1)
        assert d1.num_recv_tokens == want1.x.shape[0]
        assert_rows(d1.recv_x, want1.x, "no-sync recv_x")
        x1 = to_numpy(d1.recv_x).copy()
        d2 = ctx.dispatch(to_family(b.x, family), to_family(b.topk_idx, family),
                          to_family(b.weights, family), out=d1, reuse_layout=True)
        assert d2.handle is d1.handle and d2.buffers is d1.buffers
        want2 = ref.dispatch(TOPO, second, r, 1)
        assert_rows(d2.recv_x, want2.x, "reused recv_x")
        assert not np.array_equal(x1, want2.x) or want2.x.size == 0
        changed = b.topk_idx.copy()
        changed[0] = -1 if (changed[0] >= 0).any() else np.arange(TOPO.topk)
        with pytest.raises(ep.InvalidArgumentError, match="differs"):
            ctx.dispatch(to_family(b.x, family), to_family(changed, family),
                         to_family(b.weights, family), out=d1, reuse_layout=True)

    run_ranks(2, config(), body)


def ll_reference_checks(ctx, res, all_inputs, fp8):
    r = ctx.rank
    want = ref.ll_dispatch(TOPO, LL_TOKENS, all_inputs, r)
    count = to_numpy(res.recv_count)
    assert np.array_equal(count, want.count)
    assert np.array_equal(to_numpy(res.recv_layout_range), want.layout_range)
    got_x = to_numpy(res.recv_x)
    src = to_numpy(res.recv_src_info)
    for le in range(TOPO.local):
        n = count[le]
        assert np.array_equal(src[le, :n], want.src_info[le, :n])
        if fp8:
            ref.check_fp8_rows(got_x[le, :n], to_numpy(res.recv_x_scales)[le, :n],
                               want.x[le, :n])
        else:
            assert np.array_equal(got_x[le, :n], want.x[le, :n]), f"LL rows of expert {le}"
    return want


@pytest.mark.parametrize("fp8", [False, True])
def test_low_latency_mode_matches_the_reference(family, fp8):
    counts = (16, 5)
    all_inputs = inputs(5, counts)

    def body(ctx):
        r = ctx.rank
        mine = all_inputs[r]
        x, idx = to_family(mine.x, family), to_family(mine.topk_idx, family)
        w = to_family(mine.weights, family)
        # Weights at combine.
        res = ctx.ll_dispatch(x, idx, fp8=fp8)
        want = ll_reference_checks(ctx, res, all_inputs, fp8)
        y = ref.bf16(ref.f32(want.x) * np.float32(-2.0))  # expert outputs
        out = ctx.ll_combine(to_family(y, family), res, w)
        # Weights at dispatch: expert-side reduction, the combine takes none.
        res2 = ctx.ll_dispatch(x, idx, w, fp8=fp8, out=res)
        ll_reference_checks(ctx, res2, all_inputs, fp8)
        out2 = ctx.ll_combine(to_family(y, family), res2)
        return want, y, out, out2

    results = run_ranks(2, config(), body)
    for r, (_, _, out, out2) in enumerate(results):
        mine = all_inputs[r]
        experts = [(y, w.layout_range) for w, y, _, _ in results]
        assert_rows(out, ref.ll_combine_weighted(TOPO, r, mine.topk_idx, mine.weights, experts),
                    f"rank {r} LL combine, weights at combine")
        experts = [(y, w.layout_range, w.src_info, w.weights) for w, y, _, _ in results]
        assert_rows(out2, ref.ll_combine_pre_weighted(TOPO, r, mine.topk_idx, experts),
                    f"rank {r} LL combine, weights at dispatch")


def test_low_latency_device_count_split_phases_and_zero_copy(family):
    """A token count read from memory (fewer than the arrays hold), the
    send/receive split, and the zero-copy combine buffer."""
    bound, counts = 12, (7, 12)
    full = inputs(6, (bound, bound))
    used = [ref.RankInput(f.x[:n], None, f.topk_idx[:n], f.weights[:n])
            for f, n in zip(full, counts)]

    def body(ctx):
        r = ctx.rank
        mine = full[r]
        num = to_family(np.array([counts[r]], np.int32), family)
        pending = ctx.ll_dispatch(to_family(mine.x, family), to_family(mine.topk_idx, family),
                                  to_family(mine.weights, family), num_tokens=num, fp8=False,
                                  send_only=True)
        assert isinstance(pending, ep.Pending)
        with pytest.raises(ep.InvalidArgumentError, match="receive"):
            ctx.get_dispatch_layout(to_family(mine.topk_idx, family))
        res = pending.receive()
        want = ll_reference_checks(ctx, res, used, fp8=False)
        buf = ctx.ll_combine_buffer(kind=family)
        assert tuple(buf.shape) == (TOPO.local, TOPO.world * LL_TOKENS, TOPO.hidden)
        y = ref.bf16(ref.f32(want.x) * np.float32(3.0))
        if family == "numpy":
            buf[...] = y
        else:
            import torch
            buf.copy_(torch.from_numpy(y.view(np.int16)).view(torch.bfloat16))
        pending = ctx.ll_combine(None, res, zero_copy=True, send_only=True)
        out = pending.receive()
        assert tuple(out.shape) == (bound, TOPO.hidden)
        return want, y, to_numpy(out)[:counts[r]]

    results = run_ranks(2, config(), body)
    for r, (_, _, out) in enumerate(results):
        experts = [(y, w.layout_range, w.src_info, w.weights) for w, y, _ in results]
        assert_rows(out, ref.ll_combine_pre_weighted(TOPO, r, used[r].topk_idx, experts),
                    f"rank {r} zero-copy combine")


def _process_rank(rank, uid, queue):
    """One rank of test_ranks_as_processes (a spawned process)."""
    try:
        all_inputs = inputs(7, (10, 4))
        with ep.Context(2, rank, uid, config()) as ctx:
            mine = all_inputs[rank]
            d = ctx.dispatch(mine.x, mine.topk_idx, mine.weights, expert_major=True,
                             source_order=False, expert_alignment=2)
            want = ref.dispatch(TOPO, all_inputs, rank, 2)
            assert np.array_equal(d.expert_x, want.expert_x)
            out = ctx.combine(d.expert_x, d)  # expert-major: the dispatch's only output
            res = ctx.ll_dispatch(mine.x, mine.topk_idx, mine.weights, fp8=False)
            ll_reference_checks(ctx, res, all_inputs, fp8=False)
            queue.put((rank, "ok", want, out))
    except BaseException as e:  # reported to the parent
        queue.put((rank, f"{type(e).__name__}: {e}", None, None))


def test_ranks_as_processes():
    uid = ep.get_unique_id()  # its rendezvous thread lives in this process
    mp = multiprocessing.get_context("spawn")
    queue = mp.Queue()
    procs = [mp.Process(target=_process_rank, args=(r, uid, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted((queue.get(timeout=120) for _ in procs), key=lambda t: t[0])
    for p in procs:
        p.join(timeout=60)
    assert [g[1] for g in got] == ["ok", "ok"], got
    all_inputs = inputs(7, (10, 4))
    for r, (_, _, _, out) in enumerate(got):
        rows = [(ref.expert_partials(w, w.expert_x), w.src_info) for _, _, w, _ in got]
        assert_rows(out, ref.combine(TOPO, r, all_inputs[r].x.shape[0], rows), "combine")


# -- misuse ------------------------------------------------------------------

def single(**overrides):
    return ep.Context(1, 0, ep.get_unique_id(), config(**overrides))


def test_python_side_checks_raise_invalid_argument_before_the_library():
    with single() as ctx:
        x = np.zeros((4, TOPO.hidden), np.uint16)
        w = np.zeros((4, TOPO.topk), np.float32)
        with pytest.raises(ep.InvalidArgumentError, match=r"topk_idx: shape \[4, 2\]"):
            ctx.dispatch(x, np.zeros((4, 2), np.int32), w)
        with pytest.raises(ep.InvalidArgumentError, match="topk_weights: dtype float64"):
            ctx.dispatch(x, np.zeros((4, TOPO.topk), np.int32), w.astype(np.float64))
        with pytest.raises(ep.InvalidArgumentError, match="x: dtype f32, expected bf16 or fp8"):
            ctx.dispatch(x.astype(np.float32), np.zeros((4, TOPO.topk), np.int32), w)
        with pytest.raises(ep.InvalidArgumentError, match="not contiguous"):
            ctx.dispatch(np.zeros((4, 2 * TOPO.hidden), np.uint16)[:, ::2],
                         np.zeros((4, TOPO.topk), np.int32), w)
        with pytest.raises(ep.InvalidArgumentError, match="x_scales is required"):
            ctx.dispatch(np.zeros((4, TOPO.hidden), np.uint8), np.zeros((4, TOPO.topk), np.int32), w)
        with pytest.raises(ep.InvalidArgumentError, match="torch tensor or a numpy array"):
            ctx.dispatch([[0]], np.zeros((4, TOPO.topk), np.int32), w)
        with pytest.raises(ValueError):  # InvalidArgumentError is a ValueError too
            ctx.ll_dispatch(x[:, :128], np.zeros((4, TOPO.topk), np.int32))
        # out= of another low-latency dispatch: each output array is checked.
        idx = np.tile(np.arange(TOPO.topk, dtype=np.int32), (4, 1))
        bf16 = ctx.ll_dispatch(x, idx, fp8=False)
        with pytest.raises(ep.InvalidArgumentError, match="out.recv_x: dtype bf16, expected fp8"):
            ctx.ll_dispatch(x, idx, out=bf16)
        fp8 = ctx.ll_dispatch(x, idx)
        with pytest.raises(ep.InvalidArgumentError, match="out.recv_x: dtype u8, expected bf16"):
            ctx.ll_dispatch(x, idx, fp8=False, out=fp8)
        fp8.recv_count = np.zeros(fp8.recv_count.shape, np.int64)
        with pytest.raises(ep.InvalidArgumentError, match="out.recv_count: dtype i64"):
            ctx.ll_dispatch(x, idx, out=fp8)
        fp8.recv_x_scales = None
        with pytest.raises(ep.InvalidArgumentError, match="out= has no scales"):
            ctx.ll_dispatch(x, idx, out=fp8)


def test_library_errors_carry_status_and_last_error_text():
    with single() as ctx:
        x = np.zeros((2, TOPO.hidden), np.uint16)
        idx = np.array([[0, 1, 99], [2, -1, 3]], np.int32)  # 99 is no expert
        w = np.ones((2, TOPO.topk), np.float32)
        with pytest.raises(ep.InvalidArgumentError) as err:
            ctx.dispatch(x, idx, w)
        e = err.value
        assert e.status == ep._abi.EP_ERR_INVALID_ARGUMENT
        assert e.function == "ep_dispatch"
        assert e.status_name == "invalid argument"
        assert "topk_idx[0][2] = 99" in e.message and e.message.startswith("ep_dispatch: ")
        too_many = np.zeros((MAX_TOKENS + 1, TOPO.topk), np.int32)
        with pytest.raises(ep.InvalidArgumentError, match="above the configured maximum"):
            ctx.get_dispatch_layout(too_many)
    with single(ll_max_tokens_per_rank=0) as ctx:
        with pytest.raises(ep.InvalidArgumentError, match="low-latency mode is disabled"):
            ctx.ll_dispatch(np.zeros((1, TOPO.hidden), np.uint16), np.zeros((1, 3), np.int32))
    with pytest.raises(ep.InvalidArgumentError, match="hidden = 100"):
        ep.Context(1, 0, ep.get_unique_id(), config(hidden=100))
    with pytest.raises(ep.CudaUnavailableError if not _has_gpu() else ep.Error):
        ep.Context(1, 0, ep.get_unique_id(), config(backend="gpu"), device=0).close()


def _has_gpu():
    return os.path.exists("/dev/nvidiactl")


def test_nccl_entry_point_takes_an_address_a_group_or_its_backend():
    class Backend:  # what ProcessGroupNCCL offers
        def _comm_ptr(self):
            return 0x1234

    assert ep.bootstrap.nccl_comm_address(0x99) == 0x99
    assert ep.bootstrap.nccl_comm_address(Backend()) == 0x1234
    with pytest.raises(TypeError, match="is not an ncclComm_t address"):
        ep.bootstrap.nccl_comm_address(object())
    # The communicator is required: refused before NCCL is looked for.
    with pytest.raises(ep.NullPointerError, match="comm"):
        ep.from_nccl_communicator(0, config())


def test_released_handles_are_reused_and_a_fresh_handle_cannot_reuse_a_layout():
    with single() as ctx:
        x = np.zeros((2, TOPO.hidden), np.uint16)
        idx = np.array([[0, 1, 2], [3, -1, 4]], np.int32)
        w = np.ones((2, TOPO.topk), np.float32)
        d = ctx.dispatch(x, idx, w)
        ptr = d.handle._ptr
        del d  # the handle goes back to the context ...
        h = ctx.new_handle()
        assert h._ptr == ptr  # ... which hands it out again
        with pytest.raises(ep.InvalidArgumentError, match="holds no dispatch"):
            ctx.dispatch(x, idx, w, handle=h, reuse_layout=True)
        with pytest.raises(ep.InvalidArgumentError, match="holds no layout"):
            ctx.combine(x, h)
        d = ctx.dispatch(x, idx, w, handle=h)
        assert d.handle is h
        d2 = ctx.dispatch(x, idx, w, handle=h, reuse_layout=True)
        assert d2.num_recv_tokens == d.num_recv_tokens == 2


def test_closed_contexts_and_handles_refuse_calls():
    ctx = single()
    handle = ctx.new_handle()
    ctx.close()
    with pytest.raises(ep.InvalidArgumentError, match="closed"):
        ctx.get_dispatch_layout(np.zeros((1, TOPO.topk), np.int32))
    with pytest.raises(ep.InvalidArgumentError, match="closed"):
        handle._ptr_checked("test")
    ctx.close()  # twice is fine


def test_every_status_code_has_its_exception_class():
    codes = {v for k, v in vars(ep._abi).items()
             if k.startswith(("EP_ERR_", "EP_IN_PROGRESS")) and isinstance(v, int)}
    assert codes == set(ep.errors.BY_STATUS), "a status code without an ep.Error subclass"
    for code, cls in ep.errors.BY_STATUS.items():
        assert issubclass(cls, ep.Error) and cls.status == code
        assert isinstance(ep.errors.error_for(code, "m"), cls)


def test_ep_library_overrides_the_bundled_library(tmp_path):
    copy = tmp_path / "libep-copy.so"
    shutil.copyfile(ep.library_path(), copy)
    code = "import ep; print(ep.library_path()); print(ep.api_version())"
    env = dict(os.environ, EP_LIBRARY=str(copy))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [str(copy), str(ep.API_VERSION)]
    env["EP_LIBRARY"] = str(tmp_path / "missing.so")
    failed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert failed.returncode != 0 and "LibraryError" in failed.stderr
    assert "is not a file" in failed.stderr


def test_config_defaults_come_from_the_library_and_bad_values_are_named():
    d = ep.Config.defaults()
    assert (d.hidden, d.topk, d.num_experts, d.token_dtype, d.backend) == (7168, 8, 256, "bf16",
                                                                            "auto")
    with pytest.raises(ep.InvalidArgumentError, match="backend"):
        ep.Config(backend="tpu").to_c()
    assert ep.buffer_size_hint(config(), 2) > 0


def test_config_has_every_field_of_ep_config_t():
    header = {"struct_size", "magic", "version"}
    assert [f.name for f in dataclasses.fields(ep.Config)] == [
        name for name, _ in ep._abi.ep_config_t._fields_ if name not in header]
    assert ep.Config.defaults().ranks_per_node == 0
    given = ep.Config(hidden=512, token_dtype="fp8", backend="host", ranks_per_node=2,
                      timeout_ms=1234)
    assert ep.Config.from_c(given.to_c()) == dataclasses.replace(
        ep.Config.defaults(), hidden=512, token_dtype="fp8", backend="host", ranks_per_node=2,
        timeout_ms=1234)


def test_init_structs_are_fresh_copies_of_the_librarys_defaults():
    a = ep._lib.init_struct(ep._abi.ep_config_t, "ep_config_init")
    a.hidden = 1
    b = ep._lib.init_struct(ep._abi.ep_config_t, "ep_config_init")
    assert (b.hidden, b.struct_size) == (7168, ctypes.sizeof(ep._abi.ep_config_t))
