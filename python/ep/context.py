"""``ep.Context``: one rank's communicator and its operations on torch
tensors (CPU or CUDA) or numpy arrays.

Every operation checks its arrays (family, device, dtype, shape,
contiguity) before the library sees a pointer, so bad input raises
``InvalidArgumentError`` instead of touching memory it should not. Outputs
are allocated with the right shapes when not given (same family and device
as the input), or written into the arrays given.

Streams (GPU backend): an operation is enqueued on ``stream`` when given (a
``torch.cuda.Stream`` or a raw ``cudaStream_t`` int), else on
``torch.cuda.current_stream()``; its outputs are allocated on that stream.
Nothing here synchronises with the GPU except the host-synchronised
``dispatch`` (the default), so the low-latency calls and ``dispatch(...,
no_host_sync=True)`` with its ``combine`` can be captured in a CUDA graph
(``torch.cuda.graph``) and replayed; pass ``out=`` to reuse fixed buffers.
"""
import contextlib
import ctypes
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

from . import _abi, _arrays, _lib
from .config import Config, backend_name
from .errors import InvalidArgumentError, error_for

#: An array this package takes: a torch tensor or a numpy array.
Array = Any
#: A stream: ``torch.cuda.Stream`` (or anything with ``cuda_stream``), a raw
#: ``cudaStream_t`` as int, or None for the current stream.
Stream = Any

_SCALE_BLOCK = _abi.EP_HIDDEN_ALIGNMENT

#: The dispatch's output arrays (keys of ``_DispatchBuffers.source`` and
#: ``.expert``) and the ``ep_dispatch_args_t`` fields they go to.
_OUTPUT_FIELDS = {
    "recv": {"x": "recv_x", "x_scales": "recv_x_scales", "topk_idx": "recv_topk_idx",
             "topk_weights": "recv_topk_weights", "src_info": "recv_src_info",
             "num_tokens": "recv_num_tokens"},
    "expert": {"x": "expert_x", "x_scales": "expert_x_scales", "weights": "expert_weights",
               "src_row": "expert_src_row", "offsets": "expert_offsets",
               "counts": "expert_counts"},
}


def _unique_id_struct(unique_id: Union[bytes, bytearray, "Any"]) -> _abi.ep_unique_id_t:
    raw = bytes(unique_id)
    if len(raw) != _abi.EP_UNIQUE_ID_BYTES:
        raise InvalidArgumentError(
            f"unique id: {len(raw)} bytes, expected {_abi.EP_UNIQUE_ID_BYTES}",
            function="Context")
    uid = _abi.ep_unique_id_t()
    ctypes.memmove(uid.internal, raw, len(raw))
    return uid


def _default_device() -> int:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return int(torch.cuda.current_device())
    return 0


class Handle:
    """The routing of a normal-mode dispatch (an ``ep_handle_t``), read by
    ``combine``. Reusable for any number of dispatches of its context; its
    storage has a fixed address, so a dispatch/combine pair using it can be
    captured in a CUDA graph.

    A handle no longer referenced (or ``close()``d) goes back to its
    context, which hands it to the next new handle, and frees it only when
    the context closes: work already enqueued may still read it, and the
    calls of a context run in order, so only later work can reuse it."""

    def __init__(self, ctx: "Context"):
        ptr = ctx._take_handle()
        self._ptr: Optional[int] = ptr
        self.context = ctx
        #: Facts of the latest dispatch into this handle (for combine's checks).
        self._last: Optional["_DispatchFacts"] = None

    def close(self) -> None:
        """Gives the handle back to its context for reuse."""
        if self._ptr is not None:
            ptr, self._ptr = self._ptr, None
            self.context._spare_handles.append(ptr)

    def _ptr_checked(self, function: str) -> int:
        if self._ptr is None or self.context._ptr is None:
            raise InvalidArgumentError("the handle is closed", function=function)
        return self._ptr

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


@dataclass
class _DispatchFacts:
    """What combine needs to know about a handle's latest dispatch."""

    num_tokens: int
    source_order: bool
    expert_major: bool
    #: Rows combine reads for each layout: the count when known, else the capacity.
    recv_rows: int
    expert_rows: int


@dataclass
class DispatchLayout:
    """``get_dispatch_layout``'s result: tokens per rank ``[world]``,
    (token, slot) pairs per expert ``[num_experts]`` and whether each token
    goes to each rank ``[num_tokens, world]`` (bool)."""

    num_tokens_per_rank: Array
    num_tokens_per_expert: Array
    is_token_in_rank: Array


@dataclass
class DispatchResult:
    """What a normal-mode ``dispatch`` received.

    Source order (``recv_*``): one row per received token, grouped by source
    rank, then token order; ``recv_topk_idx`` holds local expert ids (-1
    for other ranks' experts and dropped slots), ``recv_src_info`` (source
    rank, source token). Expert-major (``expert_*``): each local expert's
    rows contiguous, segments starting at multiples of the alignment,
    ``expert_offsets[e]`` its padded start, ``expert_counts[e]`` its rows.

    When the host knows the counts (the default host-synchronised dispatch,
    and always on the host backend) the row arrays are views of exactly the
    rows received (``num_recv_tokens``, ``num_expert_rows``); under
    ``no_host_sync`` on the GPU they keep their worst-case capacity and the
    counts stay in device memory (``recv_num_tokens``, ``expert_offsets``).
    ``buffers`` holds the full-capacity arrays; pass the result as ``out=``
    to dispatch into the same memory again (and reuse its handle).
    """

    handle: Handle
    num_tokens: int
    dtype: str
    recv_x: Optional[Array]
    recv_x_scales: Optional[Array]
    recv_topk_idx: Optional[Array]
    recv_topk_weights: Optional[Array]
    recv_src_info: Optional[Array]
    recv_num_tokens: Optional[Array]
    expert_x: Optional[Array]
    expert_x_scales: Optional[Array]
    expert_weights: Optional[Array]
    expert_src_row: Optional[Array]
    expert_offsets: Optional[Array]
    expert_counts: Optional[Array]
    num_recv_tokens: Optional[int]
    num_expert_rows: Optional[int]
    expert_counts_host: Optional[List[int]]
    buffers: "_DispatchBuffers"


@dataclass
class _DispatchBuffers:
    """Full-capacity outputs of a dispatch, reusable by the next one."""

    kind: str
    device: Optional[int]
    dtype: str
    alignment: int
    source: Optional[dict]
    expert: Optional[dict]
    handle: Handle


@dataclass
class LlDispatchResult:
    """What a low-latency dispatch received, in the masked layout: for local
    expert ``e``, rows ``[0, recv_count[e])`` of ``recv_x[e]`` are valid
    (``recv_x``: ``[local_experts, world * ll_max_tokens_per_rank,
    hidden]``), grouped by source rank, each source's tokens in order.
    ``recv_src_info[e, i]`` is a row's source token, ``recv_layout_range[e,
    r]`` the (first row, row count) of source rank ``r``. Keeps the
    dispatch's routing for ``ll_combine``. Pass it as ``out=`` to dispatch
    into the same memory again (as a captured CUDA graph does)."""

    recv_x: Array
    recv_x_scales: Optional[Array]
    recv_count: Array
    recv_src_info: Array
    recv_layout_range: Array
    num_tokens: int
    topk_idx: Array
    topk_weights: Optional[Array]
    device_num_tokens: Optional[Array]
    fp8: bool


class Pending:
    """The send phase of a low-latency call ran (``send_only=True``);
    ``receive()`` runs its receive phase (on the given or current stream)
    and returns what the whole call returns. No other operation of the
    context may come in between."""

    def __init__(self, ctx: "Context", what: str, finish: Callable[[Stream], Any], keep: Any):
        self._ctx = ctx
        self._what = what
        self._finish: Optional[Callable[[Stream], Any]] = finish
        self._keep = keep  # the call's arrays: alive until the receive phase

    def receive(self, stream: Stream = None) -> Any:
        """Runs the receive phase; returns the call's result."""
        if self._finish is None:
            raise InvalidArgumentError(f"{self._what}: the receive phase already ran",
                                       function=self._what)
        finish, self._finish = self._finish, None
        self._ctx._pending = None
        try:
            return finish(stream)
        finally:
            self._keep = None


class Context:
    """One rank of an expert-parallel group (an ``ep_ctx_t``).

    Every rank creates its context with the same ``world_size``,
    ``unique_id`` (made by ``ep.get_unique_id()`` on one rank and sent to
    the others, see ``ep.bootstrap``) and ``config``; the call returns when
    all ranks have joined. ``device`` is the CUDA device of this rank
    (default: torch's current device; ignored by the host backend).

    Rank ``r`` holds experts ``[r * E / W, (r + 1) * E / W)``. One thread at
    a time per context. ``close()`` (or ``with``) frees it.
    """

    def __init__(self, world_size: int, rank: int, unique_id: Any,
                 config: Optional[Config] = None, *, device: Optional[int] = None):
        self._create(config, device, lambda ptr, c, dev: _lib.call(
            "ep_ctx_create", ctypes.byref(ptr), int(world_size), _unique_id_struct(unique_id),
            int(rank), dev, ctypes.byref(c)))

    @classmethod
    def from_nccl_comm(cls, comm: int, config: Optional[Config] = None, *,
                       device: Optional[int] = None) -> "Context":
        """The context of this rank of an existing NCCL communicator
        (``ep_ctx_create_from_nccl``): ``comm`` is the ``ncclComm_t``
        address, borrowed (never destroyed; it must outlive the context).
        The ranks, the world size and the bootstrap are the communicator's;
        ``device`` must be its CUDA device (default: torch's current one).
        Collective: every rank of the communicator calls it."""
        self = cls.__new__(cls)
        self._create(config, device, lambda ptr, c, dev: _lib.call(
            "ep_ctx_create_from_nccl", ctypes.c_void_p(int(comm)), ctypes.byref(c),
            ctypes.byref(ptr)))
        return self

    def _create(self, config: Optional[Config], device: Optional[int],
                create: Callable[[ctypes.c_void_p, Any, int], None]) -> None:
        """Makes this rank's ``ep_ctx_t``: ``create(ptr, c, dev)`` calls the
        library with the ``ep_config_t`` ``c`` and the device ``dev``, and
        writes the context to ``ptr``."""
        self._clear()
        c = (config or Config()).to_c()
        dev = _default_device() if device is None else int(device)
        ptr = ctypes.c_void_p()
        create(ptr, c, dev)
        self._adopt(ptr.value, c, dev)

    def _clear(self) -> None:
        """The state of a context that holds no ``ep_ctx_t`` yet."""
        self._ptr: Optional[int] = None
        #: ep_handle_t pointers of released handles, reused before new ones
        #: are made and freed only by close() (see ``Handle``).
        self._spare_handles: List[int] = []
        self._all_handles: List[int] = []
        self._pending: Optional[Pending] = None
        self._capacity_cache: dict = {}

    def _adopt(self, ptr: int, c: Any, dev: int) -> None:
        """Takes the new ``ep_ctx_t`` at ``ptr``, made from config ``c`` on
        device ``dev``, and learns its rank, world size and backend."""
        self._ptr = ptr
        r, w, local, backend = (ctypes.c_int32() for _ in range(4))
        _lib.call("ep_ctx_get_info", self._ptr, ctypes.byref(r), ctypes.byref(w),
                  ctypes.byref(local), ctypes.byref(backend))
        #: This context's configuration, every field resolved.
        self.config: Config = Config.from_c(c)
        self.config.backend = backend_name(backend.value)
        self.rank: int = r.value
        self.world_size: int = w.value
        self.num_local_experts: int = local.value
        self.backend: str = self.config.backend
        #: The CUDA device (GPU backend), or None (host backend).
        self.device: Optional[int] = dev if self.backend == "gpu" else None

    # -- life cycle ---------------------------------------------------------

    def close(self) -> None:
        """Frees the context, its handles and buffers. On the GPU it first
        waits for the device (no work of the context may still run). Arrays
        the context owns (``ll_combine_buffer()``) keep it from being
        collected, but not from an explicit ``close()``."""
        if self._ptr is None:
            return
        if self.device is not None:
            torch = sys.modules.get("torch")
            if torch is not None:
                torch.cuda.synchronize(self.device)
        ptr, self._ptr = self._ptr, None
        handles, self._all_handles, self._spare_handles = self._all_handles, [], []
        for handle in handles:
            _lib.call("ep_handle_destroy", handle)
        _lib.call("ep_ctx_destroy", ptr)

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def abort(self) -> None:
        """Makes every waiting call and in-flight kernel of this context give
        up (they end with ``AbortedError``, as does every later call). Any
        thread, any time."""
        _lib.call("ep_ctx_abort", self._ptr_checked("abort"))

    def check_async_error(self) -> None:
        """Raises the error enqueued work reported (e.g. ``TimeoutError``
        from a device-side wait, naming the rank and phase), if any. Any
        thread, any time; does not wait for the GPU."""
        status = ctypes.c_int32()
        _lib.call("ep_ctx_get_async_error", self._ptr_checked("check_async_error"),
                  ctypes.byref(status))
        if status.value != _abi.EP_SUCCESS:
            raise error_for(status.value, _lib.last_error(), function="ep_ctx_get_async_error",
                            status_name=_lib.status_name(status.value))

    def _take_handle(self) -> int:
        """A spare ep_handle_t of this context, or a new one."""
        if self._spare_handles:
            return self._spare_handles.pop()
        ptr = ctypes.c_void_p()
        _lib.call("ep_handle_create", self._ptr_checked("Handle"), ctypes.byref(ptr))
        self._all_handles.append(ptr.value)
        return ptr.value

    def new_handle(self) -> Handle:
        """A new routing handle for ``dispatch(..., handle=)``."""
        return Handle(self)

    @property
    def num_experts(self) -> int:
        """Experts over all ranks."""
        return int(self.config.num_experts)

    @property
    def hidden(self) -> int:
        """Elements per token."""
        return int(self.config.hidden)

    @property
    def topk(self) -> int:
        """Expert slots per token."""
        return int(self.config.topk)

    def dispatch_capacity(self, expert_alignment: int = 1) -> Tuple[int, int]:
        """Worst-case (source-order rows, expert-major rows) of one dispatch
        with this alignment (``ep_get_dispatch_capacity``)."""
        if expert_alignment not in self._capacity_cache:
            recv, expert = ctypes.c_int32(), ctypes.c_int32()
            _lib.call("ep_get_dispatch_capacity", self._ptr_checked("dispatch_capacity"),
                      int(expert_alignment), ctypes.byref(recv), ctypes.byref(expert))
            self._capacity_cache[expert_alignment] = (recv.value, expert.value)
        return self._capacity_cache[expert_alignment]

    # -- argument checks ----------------------------------------------------

    def _ptr_checked(self, function: str) -> int:
        if self._ptr is None:
            raise InvalidArgumentError("the context is closed", function=function)
        return self._ptr

    def _begin(self, function: str) -> int:
        ptr = self._ptr_checked(function)
        if self._pending is not None:
            raise InvalidArgumentError(
                f"{self._pending._what} ran its send phase only: call .receive() on its "
                f"result first", function=function)
        return ptr

    def _family(self, function: str, a: Array) -> str:
        """The array family of a call, from its main input."""
        kind = _arrays.kind_of(a)
        if kind is None:
            raise InvalidArgumentError(
                f"expected a torch tensor or a numpy array, got {type(a).__name__}",
                function=function)
        if self.device is not None and kind != _arrays.TORCH:
            raise InvalidArgumentError(
                f"the GPU backend takes torch CUDA tensors on cuda:{self.device}, "
                f"not {kind} arrays", function=function)
        return kind

    def _check(self, function: str, name: str, a: Array, kind: str,
               dtypes: Sequence[str], shape: Sequence[Optional[int]], *,
               min_rows: Optional[int] = None, output: bool = False) -> None:
        """Raises unless ``a`` is a contiguous array of family ``kind`` on
        this context's device with one of ``dtypes`` and ``shape`` (None:
        any extent; ``min_rows``: at least that many rows)."""
        def fail(why: str) -> None:
            raise InvalidArgumentError(f"{name}: {why}", function=function)

        if _arrays.kind_of(a) != kind:
            fail(f"expected a {kind} array like the call's other arrays, "
                 f"got {type(a).__name__}")
        where = _arrays.device_of(a)
        if where != self.device:
            fail(f"is in {_arrays.device_name(where)}; this {self.backend} context needs "
                 f"{_arrays.device_name(self.device)}")
        dt = _arrays.dtype_of(a)
        if kind == _arrays.NUMPY and dt == "u8" and "fp8" in dtypes:
            dt = "fp8"
        if dt not in dtypes:
            fail(f"dtype {dt}, expected {' or '.join(dtypes)}")
        got = _arrays.shape_of(a)
        want = tuple(shape)
        ok = len(got) == len(want) and all(w is None or g == w for g, w in zip(got, want))
        if ok and min_rows is not None and got[0] < min_rows:
            ok = False
        if not ok:
            spec = ", ".join("*" if w is None else str(w) for w in want)
            extra = f" with at least {min_rows} rows" if min_rows is not None else ""
            fail(f"shape {list(got)}, expected [{spec}]{extra}")
        if not _arrays.is_contiguous(a):
            fail("is not contiguous")
        if output and not _arrays.is_writable(a):
            fail("is read-only")

    def _topk_idx(self, function: str, topk_idx: Array, kind: str, n: int) -> Array:
        """``topk_idx`` checked, as int32 (an int64 one is converted)."""
        self._check(function, "topk_idx", topk_idx, kind, ("i32", "i64"), (n, self.topk))
        if _arrays.dtype_of(topk_idx) == "i64":
            topk_idx = _arrays.as_int32(topk_idx)
        return topk_idx

    def _out(self, function: str, name: str, given: Optional[Array], kind: str,
             shape: Sequence[int], dtype: str) -> Array:
        """``given`` checked as an output, or a new array."""
        if given is None:
            return _arrays.empty(kind, shape, dtype, self.device)
        self._check(function, name, given, kind, (dtype,), shape, output=True)
        return given

    @contextlib.contextmanager
    def _stream(self, stream: Stream) -> Iterator[Optional[int]]:
        """Yields the raw stream of a call (None on the host backend), with
        torch's current device and stream set to it, so the call's
        allocations are ordered on it."""
        if self.device is None:
            yield None
            return
        torch = _arrays._torch()
        if stream is None:
            s = torch.cuda.current_stream(self.device)
        elif isinstance(stream, int):
            s = torch.cuda.ExternalStream(stream, device=self.device)
        else:
            s = stream
        with torch.cuda.device(self.device), torch.cuda.stream(s):
            yield int(s.cuda_stream)

    def _capturing(self) -> bool:
        if self.device is None:
            return False
        return bool(_arrays._torch().cuda.is_current_stream_capturing())

    # -- normal mode --------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: Array, *, stream: Stream = None) -> DispatchLayout:
        """Counts for routing ``topk_idx`` (``[num_tokens, topk]`` global
        expert ids, -1 = none): tokens per rank, pairs per expert and which
        ranks each token goes to (``ep_get_dispatch_layout``)."""
        fn = "get_dispatch_layout"
        ctx = self._begin(fn)
        kind = self._family(fn, topk_idx)
        n = _arrays.shape_of(topk_idx)[0] if _arrays.shape_of(topk_idx) else 0
        with self._stream(stream) as s:
            idx = self._topk_idx(fn, topk_idx, kind, n)
            per_rank = _arrays.empty(kind, (self.world_size,), "i32", self.device)
            per_expert = _arrays.empty(kind, (self.num_experts,), "i32", self.device)
            in_rank = _arrays.empty(kind, (n, self.world_size), "bool", self.device)
            _lib.call("ep_get_dispatch_layout", ctx, _arrays.ptr_of(idx), n,
                      _arrays.ptr_of(per_rank), _arrays.ptr_of(per_expert),
                      _arrays.ptr_of(in_rank), s)
        return DispatchLayout(per_rank, per_expert, in_rank)

    def _dispatch_buffers(self, kind: str, dtype: str, source: bool, expert: bool,
                          alignment: int, handle: Handle) -> _DispatchBuffers:
        recv_cap, expert_cap = self.dispatch_capacity(alignment)
        h, k, local = self.hidden, self.topk, self.num_local_experts
        scale_cols = h // _SCALE_BLOCK
        fp8 = dtype == "fp8"
        new = lambda shape, dt: _arrays.empty(kind, shape, dt, self.device)  # noqa: E731
        src = exp = None
        if source:
            src = {
                "x": new((recv_cap, h), dtype),
                "x_scales": new((recv_cap, scale_cols), "f32") if fp8 else None,
                "topk_idx": new((recv_cap, k), "i32"),
                "topk_weights": new((recv_cap, k), "f32"),
                "src_info": new((recv_cap, 2), "i32"),
                "num_tokens": new((1,), "i32"),
                "capacity": recv_cap,
            }
        if expert:
            exp = {
                "x": new((expert_cap, h), dtype),
                "x_scales": new((expert_cap, scale_cols), "f32") if fp8 else None,
                "weights": new((expert_cap,), "f32"),
                "src_row": new((expert_cap,), "i32"),
                "offsets": new((local + 1,), "i32"),
                "counts": new((local,), "i32"),
                "capacity": expert_cap,
            }
        return _DispatchBuffers(kind, self.device, dtype, alignment, src, exp, handle)

    def dispatch(self, x: Array, topk_idx: Array, topk_weights: Array, *,
                 x_scales: Optional[Array] = None,
                 source_order: Optional[bool] = None, expert_major: Optional[bool] = None,
                 expert_alignment: Optional[int] = None, no_host_sync: bool = False,
                 reuse_layout: bool = False, handle: Optional[Handle] = None,
                 out: Optional[DispatchResult] = None, stream: Stream = None) -> DispatchResult:
        """Normal-mode dispatch (``ep_dispatch``): sends this rank's tokens
        to the ranks of their experts; returns what this rank receives.
        Every rank of the context calls it.

        ``x``: ``[num_tokens, hidden]`` BF16, or FP8 e4m3 with ``x_scales``
        ``[num_tokens, hidden / 128]`` float32. ``topk_idx``: ``[num_tokens,
        topk]`` int32 (int64 is converted) global expert ids, -1 = none.
        ``topk_weights``: ``[num_tokens, topk]`` float32.

        Outputs: source order (default) and/or ``expert_major`` (segments
        aligned to ``expert_alignment`` rows, default 1). By default the
        call waits for the counts, so the result's arrays hold exactly the
        received rows; ``no_host_sync=True`` leaves the counts on the device
        (worst-case capacity, capturable in a CUDA graph).
        ``reuse_layout=True`` reuses the routing of ``handle``'s earlier
        dispatch with the same ``topk_idx``. ``out``: an earlier result to
        dispatch into (its buffers and handle); ``handle``: the handle to
        record the routing in (default: ``out``'s, else a new one).
        """
        fn = "dispatch"
        ctx = self._begin(fn)
        kind = self._family(fn, x)
        xs = _arrays.shape_of(x)
        n = xs[0] if xs else 0
        dtype = _arrays.dtype_of(x)
        if kind == _arrays.NUMPY and dtype == "u8":
            dtype = "fp8"
        self._check(fn, "x", x, kind, ("bf16", "fp8"), (n, self.hidden))
        fp8 = dtype == "fp8"
        if fp8:
            if x_scales is None:
                raise InvalidArgumentError("x is FP8: x_scales is required", function=fn)
            self._check(fn, "x_scales", x_scales, kind, ("f32",), (n, self.hidden // _SCALE_BLOCK))
        elif x_scales is not None:
            raise InvalidArgumentError("x_scales is for FP8 tokens only", function=fn)
        self._check(fn, "topk_weights", topk_weights, kind, ("f32",), (n, self.topk))
        if out is not None:
            buffers = out.buffers if isinstance(out, DispatchResult) else out
            if source_order is None:
                source_order = buffers.source is not None
            if expert_major is None:
                expert_major = buffers.expert is not None
            if expert_alignment is None:
                expert_alignment = buffers.alignment
            if handle is None:
                handle = buffers.handle
        source_order = True if source_order is None else bool(source_order)
        expert_major = bool(expert_major)
        alignment = 1 if expert_alignment is None else int(expert_alignment)
        if not source_order and not expert_major:
            raise InvalidArgumentError("no output: ask for source_order, expert_major or both",
                                       function=fn)
        if not no_host_sync and not reuse_layout and self._capturing():
            raise InvalidArgumentError(
                "a host-synchronised dispatch cannot be captured in a CUDA graph: pass "
                "no_host_sync=True", function=fn)
        if handle is None:
            if reuse_layout:
                raise InvalidArgumentError("reuse_layout=True needs the handle of the earlier "
                                           "dispatch", function=fn)
            handle = Handle(self)
        elif handle.context is not self:
            raise InvalidArgumentError("the handle belongs to another context", function=fn)
        elif reuse_layout and handle._last is None:
            raise InvalidArgumentError("reuse_layout=True with a handle that holds no dispatch",
                                       function=fn)

        with self._stream(stream) as s:
            idx = self._topk_idx(fn, topk_idx, kind, n)
            if out is None:
                buffers = self._dispatch_buffers(kind, dtype, source_order, expert_major,
                                                 alignment, handle)
            else:
                self._check_dispatch_buffers(fn, buffers, kind, dtype, source_order,
                                             expert_major, alignment)
            a = _lib.init_struct(_abi.ep_dispatch_args_t, "ep_dispatch_args_init")
            a.flags = ((_abi.EP_DISPATCH_NO_HOST_SYNC if no_host_sync else 0)
                       | (_abi.EP_DISPATCH_REUSE_LAYOUT if reuse_layout else 0))
            a.num_tokens = n
            a.dtype = _abi.EP_DTYPE_FP8_E4M3 if fp8 else _abi.EP_DTYPE_BF16
            a.x = _arrays.ptr_of(x)
            a.x_scales = _arrays.ptr_or_null(x_scales)
            a.topk_idx = _arrays.ptr_of(idx)
            a.topk_weights = _arrays.ptr_of(topk_weights)
            a.expert_alignment = alignment
            src = buffers.source if source_order else None
            exp = buffers.expert if expert_major else None
            for prefix, outputs in (("recv", src), ("expert", exp)):
                if outputs is None:
                    continue
                setattr(a, f"{prefix}_capacity", outputs["capacity"])
                for key, field in _OUTPUT_FIELDS[prefix].items():
                    setattr(a, field, _arrays.ptr_or_null(outputs[key]))
            host_rows = ctypes.c_int32(-1)
            host_counts = (ctypes.c_int32 * max(self.num_local_experts, 1))()
            a.host_recv_num_tokens = ctypes.addressof(host_rows)
            a.host_expert_counts = ctypes.addressof(host_counts)
            handle._last = None
            _lib.call("ep_dispatch", ctx, ctypes.byref(a), handle._ptr_checked(fn), s)
        return self._dispatch_result(handle, buffers, src, exp, n, dtype, no_host_sync,
                                     host_rows.value, list(host_counts)[:self.num_local_experts])

    def _check_dispatch_buffers(self, fn: str, b: _DispatchBuffers, kind: str, dtype: str,
                                source: bool, expert: bool, alignment: int) -> None:
        if b.handle.context is not self:
            raise InvalidArgumentError("out= belongs to another context", function=fn)
        if (b.kind, b.dtype) != (kind, dtype):
            raise InvalidArgumentError(
                f"out= holds {b.kind} {b.dtype} buffers; this call dispatches {kind} {dtype}",
                function=fn)
        if (source and b.source is None) or (expert and b.expert is None):
            raise InvalidArgumentError("out= lacks an output this call asks for", function=fn)
        if expert and alignment != b.alignment:
            raise InvalidArgumentError(
                f"out= was sized for expert_alignment {b.alignment}, not {alignment}",
                function=fn)

    def _dispatch_result(self, handle: Handle, b: _DispatchBuffers, src: Optional[dict],
                         exp: Optional[dict], n: int, dtype: str, no_host_sync: bool,
                         host_rows: int, host_counts: List[int]) -> DispatchResult:
        # Counts the host knows: the host-synchronised outputs, or, on the
        # host backend, the "device" scalars (host memory there).
        recv_rows: Optional[int] = None
        counts: Optional[List[int]] = None
        if not no_host_sync:
            recv_rows = host_rows if src is not None else None
            counts = host_counts if exp is not None else None
        elif self.device is None:
            if src is not None:
                recv_rows = _arrays.to_list(src["num_tokens"])[0]
            if exp is not None:
                counts = _arrays.to_list(exp["counts"])
        expert_rows: Optional[int] = None
        if counts is not None:
            align = b.alignment
            expert_rows = sum((c + align - 1) // align * align for c in counts)

        def cut(a: Optional[Array], rows: Optional[int]) -> Optional[Array]:
            return a if a is None or rows is None else _arrays.rows(a, rows)

        handle._last = _DispatchFacts(
            num_tokens=n, source_order=src is not None, expert_major=exp is not None,
            recv_rows=recv_rows if recv_rows is not None else (src or {}).get("capacity", 0),
            expert_rows=expert_rows if expert_rows is not None else (exp or {}).get("capacity", 0))
        s, e = src or {}, exp or {}
        return DispatchResult(
            handle=handle, num_tokens=n, dtype=dtype,
            recv_x=cut(s.get("x"), recv_rows), recv_x_scales=cut(s.get("x_scales"), recv_rows),
            recv_topk_idx=cut(s.get("topk_idx"), recv_rows),
            recv_topk_weights=cut(s.get("topk_weights"), recv_rows),
            recv_src_info=cut(s.get("src_info"), recv_rows), recv_num_tokens=s.get("num_tokens"),
            expert_x=cut(e.get("x"), expert_rows),
            expert_x_scales=cut(e.get("x_scales"), expert_rows),
            expert_weights=cut(e.get("weights"), expert_rows),
            expert_src_row=cut(e.get("src_row"), expert_rows),
            expert_offsets=e.get("offsets"), expert_counts=e.get("counts"),
            num_recv_tokens=recv_rows, num_expert_rows=expert_rows, expert_counts_host=counts,
            buffers=b)

    def combine(self, x: Array, handle: Union[Handle, DispatchResult], *,
                expert_major: Optional[bool] = None, out: Optional[Array] = None,
                stream: Stream = None) -> Array:
        """Normal-mode combine (``ep_combine``): returns rows to the ranks
        their tokens came from and sums them per token in fp32; returns the
        BF16 ``[num_tokens, hidden]`` result for this rank's tokens of the
        dispatch (zeros for a token routed nowhere). Every rank calls it.

        ``x``: BF16 rows in the order the dispatch produced: its source-order
        rows (already reduced over this rank's experts by the caller), or,
        with ``expert_major=True``, its expert-major rows (the library
        weights and reduces them). Default: expert-major when the dispatch
        produced only that output. ``handle``: the dispatch's handle (or its
        result).
        """
        fn = "combine"
        ctx = self._begin(fn)
        if isinstance(handle, DispatchResult):
            handle = handle.handle
        if not isinstance(handle, Handle) or handle.context is not self:
            raise InvalidArgumentError("handle: pass the Handle (or DispatchResult) of a "
                                       "dispatch of this context", function=fn)
        facts = handle._last
        if facts is None:
            raise InvalidArgumentError("the handle holds no layout: dispatch first", function=fn)
        kind = self._family(fn, x)
        if expert_major is None:
            expert_major = facts.expert_major and not facts.source_order
        if expert_major and not facts.expert_major:
            raise InvalidArgumentError("expert_major=True but the dispatch made no expert-major "
                                       "output", function=fn)
        if not expert_major and not facts.source_order:
            raise InvalidArgumentError("source-order input but the dispatch made no "
                                       "source-order output", function=fn)
        rows = facts.expert_rows if expert_major else facts.recv_rows
        self._check(fn, "x", x, kind, ("bf16",), (None, self.hidden), min_rows=rows)
        with self._stream(stream) as s:
            out = self._out(fn, "out", out, kind, (facts.num_tokens, self.hidden), "bf16")
            a = _lib.init_struct(_abi.ep_combine_args_t, "ep_combine_args_init")
            a.input_layout = (_abi.EP_COMBINE_EXPERT_MAJOR if expert_major
                              else _abi.EP_COMBINE_SOURCE_ORDER)
            a.x = _arrays.ptr_of(x)
            a.out = _arrays.ptr_of(out)
            _lib.call("ep_combine", ctx, ctypes.byref(a), handle._ptr_checked(fn), s)
        return out

    # -- low-latency mode ---------------------------------------------------

    def _ll_slots(self) -> int:
        return self.world_size * int(self.config.ll_max_tokens_per_rank)

    def _ll_dispatch_outputs(self, fp8: bool) -> List[Tuple[str, str, Tuple[int, ...]]]:
        """(field, dtype, shape) of each array a low-latency dispatch writes,
        in the order they are checked: the ``LlDispatchResult`` fields, named
        as in ``ep_ll_dispatch_args_t`` (the scales only with ``fp8``)."""
        local, slots, h = self.num_local_experts, self._ll_slots(), self.hidden
        outputs = [("recv_x", "fp8" if fp8 else "bf16", (local, slots, h))]
        if fp8:
            outputs.append(("recv_x_scales", "f32", (local, slots, h // _SCALE_BLOCK)))
        return outputs + [("recv_count", "i32", (local,)),
                          ("recv_src_info", "i32", (local, slots)),
                          ("recv_layout_range", "i32", (local, self.world_size, 2))]

    def _device_count(self, fn: str, num_tokens: Optional[Array], kind: str) -> Optional[int]:
        if num_tokens is None:
            return None
        self._check(fn, "num_tokens", num_tokens, kind, ("i32",), (1,))
        return _arrays.ptr_of(num_tokens)

    def ll_dispatch(self, x: Array, topk_idx: Array, topk_weights: Optional[Array] = None, *,
                    num_tokens: Optional[Array] = None, fp8: bool = True, ue8m0: bool = False,
                    send_only: bool = False, out: Optional[LlDispatchResult] = None,
                    stream: Stream = None) -> Union[LlDispatchResult, Pending]:
        """Low-latency dispatch (``ep_ll_dispatch``): quantizes (FP8, unless
        ``fp8=False``) and sends this rank's tokens; returns the masked
        layout this rank receives. No host synchronisation: capturable in a
        CUDA graph. Every rank calls it; pair it with ``ll_combine``.

        ``x``: ``[n, hidden]`` BF16 with ``n <= ll_max_tokens_per_rank``;
        ``topk_idx``: ``[n, topk]``; ``topk_weights``: ``[n, topk]`` float32
        or None (given here, ``ll_combine`` may omit them and reduces on the
        expert side). ``num_tokens``: a one-element int32 array on the
        device holding the count to use (``n`` is then the bound), so one
        captured graph serves every batch size. ``ue8m0``: power-of-two
        scales. ``send_only=True`` returns a ``Pending`` whose ``receive()``
        completes the call. ``out``: an earlier result to write into.
        """
        fn = "ll_dispatch"
        ctx = self._begin(fn)
        kind = self._family(fn, x)
        xs = _arrays.shape_of(x)
        n = xs[0] if xs else 0
        self._check(fn, "x", x, kind, ("bf16",), (n, self.hidden))
        if topk_weights is not None:
            self._check(fn, "topk_weights", topk_weights, kind, ("f32",), (n, self.topk))
        if ue8m0 and not fp8:
            raise InvalidArgumentError("ue8m0 scales need fp8=True", function=fn)
        outputs = self._ll_dispatch_outputs(fp8)
        with self._stream(stream) as s:
            idx = self._topk_idx(fn, topk_idx, kind, n)
            count_ptr = self._device_count(fn, num_tokens, kind)
            if out is None:
                arrays = {field: _arrays.empty(kind, shape, dtype, self.device)
                          for field, dtype, shape in outputs}
                out = LlDispatchResult(**{"recv_x_scales": None, **arrays}, num_tokens=n,
                                       topk_idx=idx, topk_weights=topk_weights,
                                       device_num_tokens=num_tokens, fp8=fp8)
            else:
                for field, dtype, shape in outputs:
                    given = getattr(out, field)
                    if field == "recv_x_scales" and given is None:
                        raise InvalidArgumentError("out= has no scales (a BF16 dispatch's "
                                                   "result)", function=fn)
                    self._check(fn, f"out.{field}", given, kind, (dtype,), shape, output=True)
                out.num_tokens, out.topk_idx, out.topk_weights = n, idx, topk_weights
                out.device_num_tokens, out.fp8 = num_tokens, fp8
            a = _lib.init_struct(_abi.ep_ll_dispatch_args_t, "ep_ll_dispatch_args_init")
            a.num_tokens = n
            a.out_dtype = _abi.EP_DTYPE_FP8_E4M3 if fp8 else _abi.EP_DTYPE_BF16
            a.x = _arrays.ptr_of(x)
            a.topk_idx = _arrays.ptr_of(idx)
            a.topk_weights = _arrays.ptr_or_null(topk_weights)
            for field, _, _ in outputs:
                setattr(a, field, _arrays.ptr_of(getattr(out, field)))
            a.device_num_tokens = count_ptr
            flags = _abi.EP_LL_UE8M0_SCALES if ue8m0 else 0

            def run(phase: int, stream_ptr: Optional[int]) -> None:
                a.flags = flags | phase
                _lib.call("ep_ll_dispatch", ctx, ctypes.byref(a), stream_ptr)

            return self._ll_phases(fn, send_only, run, s, out, (x, idx, topk_weights, num_tokens))

    def _ll_phases(self, fn: str, send_only: bool, run: Callable[[int, Optional[int]], None],
                   stream_ptr: Optional[int], result: Any, keep: Any) -> Any:
        """Runs both phases of a low-latency call and returns ``result``, or
        runs the send phase and returns the ``Pending`` receive (which keeps
        the call's arrays ``keep`` alive until it has run)."""
        if not send_only:
            run(0, stream_ptr)
            return result
        run(_abi.EP_LL_SEND_ONLY, stream_ptr)

        def finish(stream: Stream) -> Any:
            with self._stream(stream) as s:
                run(_abi.EP_LL_RECV_ONLY, s)
            return result

        self._pending = Pending(self, fn, finish, keep)
        return self._pending

    def ll_combine(self, x: Optional[Array], dispatch: LlDispatchResult,
                   topk_weights: Optional[Array] = None, *, zero_copy: bool = False,
                   out: Optional[Array] = None, send_only: bool = False,
                   stream: Stream = None) -> Union[Array, Pending]:
        """Low-latency combine (``ep_ll_combine``) of the context's most
        recent ``ll_dispatch`` (``dispatch``): returns the BF16 ``[n,
        hidden]`` weighted sums of the expert outputs for this rank's tokens.
        Every rank calls it.

        ``x``: ``[local_experts, world * ll_max_tokens_per_rank, hidden]``
        BF16 expert outputs in the dispatch's masked layout; with
        ``zero_copy=True`` pass None: the outputs are already in
        ``ll_combine_buffer()``. ``topk_weights``: ``[n, topk]`` float32, or
        None when the dispatch was given them. ``send_only=True`` returns a
        ``Pending`` whose ``receive()`` completes the call.
        """
        fn = "ll_combine"
        ctx = self._begin(fn)
        if not isinstance(dispatch, LlDispatchResult):
            raise InvalidArgumentError("dispatch: pass the result of ll_dispatch", function=fn)
        kind = _arrays.kind_of(dispatch.recv_count)
        local, slots, h = self.num_local_experts, self._ll_slots(), self.hidden
        n = dispatch.num_tokens
        if zero_copy:
            if x is not None:
                raise InvalidArgumentError("zero_copy=True takes x=None (the expert outputs "
                                           "are in ll_combine_buffer())", function=fn)
        else:
            if x is None:
                raise InvalidArgumentError("x is required unless zero_copy=True", function=fn)
            self._check(fn, "x", x, kind, ("bf16",), (local, slots, h))
        if topk_weights is None and dispatch.topk_weights is None:
            raise InvalidArgumentError("topk_weights: required when the dispatch was given "
                                       "none", function=fn)
        if topk_weights is not None:
            self._check(fn, "topk_weights", topk_weights, kind, ("f32",), (n, self.topk))
        with self._stream(stream) as s:
            out = self._out(fn, "out", out, kind, (n, h), "bf16")
            a = _lib.init_struct(_abi.ep_ll_combine_args_t, "ep_ll_combine_args_init")
            a.num_tokens = n
            a.x = _arrays.ptr_or_null(x)
            a.topk_idx = _arrays.ptr_of(dispatch.topk_idx)
            a.topk_weights = _arrays.ptr_or_null(topk_weights)
            a.src_info = _arrays.ptr_of(dispatch.recv_src_info)
            a.layout_range = _arrays.ptr_of(dispatch.recv_layout_range)
            a.out = _arrays.ptr_of(out)
            a.device_num_tokens = _arrays.ptr_or_null(dispatch.device_num_tokens)
            flags = _abi.EP_LL_ZERO_COPY if zero_copy else 0

            def run(phase: int, stream_ptr: Optional[int]) -> None:
                a.flags = flags | phase
                _lib.call("ep_ll_combine", ctx, ctypes.byref(a), stream_ptr)

            return self._ll_phases(fn, send_only, run, s, out, (x, topk_weights, dispatch))

    def ll_combine_buffer(self, kind: Optional[str] = None) -> Array:
        """The library's low-latency combine send buffer as a BF16 array
        ``[local_experts, world * ll_max_tokens_per_rank, hidden]``: expert
        outputs written there need no copy (``ll_combine(None, d,
        zero_copy=True)``). Owned by the context (the array keeps it alive).
        ``kind``: ``"torch"`` or ``"numpy"`` on the host backend (default
        torch when it is installed)."""
        fn = "ll_combine_buffer"
        ctx = self._ptr_checked(fn)
        ptr, size = ctypes.c_void_p(), ctypes.c_size_t()
        _lib.call("ep_ll_get_combine_buffer", ctx, ctypes.byref(ptr), ctypes.byref(size))
        shape = (self.num_local_experts, self._ll_slots(), self.hidden)
        if size.value < _arrays.numel(shape) * 2:
            raise InvalidArgumentError(f"the library's combine buffer has {size.value} bytes, "
                                       f"less than {shape} BF16", function=fn)
        if self.device is not None:
            kind = _arrays.TORCH
        elif kind is None:
            try:
                import torch  # noqa: F401
                kind = _arrays.TORCH
            except ImportError:
                kind = _arrays.NUMPY
        return _arrays.view_memory(kind, ptr.value, shape, "bf16", self.device, self)
