"""ep: expert-parallel dispatch and combine for Mixture-of-Experts models.

A thin Python layer over libep.so (ctypes; no compiled extension): torch
tensors (CPU or CUDA) or numpy arrays in and out, streams from torch, status
codes as exceptions. ``EP_LIBRARY=path/to/libep.so`` overrides the library
``pip install`` bundled.

    import ep
    uid = ep.get_unique_id()                      # on one rank, sent to the others
    ctx = ep.Context(world_size, rank, uid, ep.Config(hidden=4096, backend="gpu"))
    d = ctx.dispatch(x, topk_idx, topk_weights, expert_major=True)
    y = experts(d.expert_x, d.expert_counts_host)  # your grouped GEMM
    out = ctx.combine(y, d, expert_major=True)

With ``torch.distributed`` initialised, ``ep.from_process_group(config)``
(or ``ep.Buffer(group, config)``) makes the context of this rank.
"""
from . import _abi
from ._arrays import bf16_bits_to_float, float_to_bf16_bits
from ._lib import ENV_LIBRARY, LibraryError, library_path
from .bootstrap import (Buffer, from_nccl_communicator, from_process_group, get_unique_id,
                        unique_id_from_group)
from .config import Config, buffer_size_hint
from .context import (Context, DispatchLayout, DispatchResult, Handle, LlDispatchResult,
                      Pending)
from .errors import (AbortedError, CudaError, CudaUnavailableError, Error, InProgressError,
                     InternalError, InvalidArgumentError, NullPointerError, OutOfMemoryError,
                     RemoteError, SystemCallError, TimeoutError, UnsupportedError)

__version__ = "0.1.0"

#: The C API version this package was generated for (``EP_API_VERSION``).
API_VERSION = _abi.EP_API_VERSION


def api_version() -> int:
    """``EP_API_VERSION`` of the loaded libep.so (``ep_get_version``)."""
    import ctypes

    from . import _lib

    version = ctypes.c_uint32()
    _lib.call("ep_get_version", ctypes.byref(version))
    return version.value


__all__ = [
    "API_VERSION", "AbortedError", "Buffer", "Config", "Context", "CudaError",
    "CudaUnavailableError", "DispatchLayout", "DispatchResult", "ENV_LIBRARY", "Error", "Handle",
    "InProgressError", "InternalError", "InvalidArgumentError", "LibraryError",
    "LlDispatchResult", "NullPointerError", "OutOfMemoryError", "Pending", "RemoteError",
    "SystemCallError", "TimeoutError", "UnsupportedError", "api_version", "bf16_bits_to_float",
    "buffer_size_hint", "float_to_bf16_bits", "from_nccl_communicator", "from_process_group",
    "get_unique_id", "library_path", "unique_id_from_group",
]
