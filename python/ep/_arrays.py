"""Arrays as the library sees them: torch tensors (CPU or CUDA) and numpy
arrays (host memory), read through one small interface.

Neither torch nor numpy is imported by ``import ep``: an array's module is
looked at first, so a process without torch never imports it.

Dtype names used here: ``bf16``, ``fp8`` (e4m3), ``f32``, ``i32``, ``i64``,
``u8``, ``bool``. numpy has no bfloat16 or float8: BF16 arrays are ``uint16``
holding the bits (see ``float_to_bf16_bits``), FP8 arrays are ``uint8``
(``ml_dtypes.bfloat16`` / ``float8_e4m3fn`` arrays are taken as well).
"""
import ctypes
from typing import Any, Optional, Sequence, Tuple

TORCH = "torch"
NUMPY = "numpy"

_ELEMENT_BYTES = {"bf16": 2, "fp8": 1, "f32": 4, "i32": 4, "i64": 8, "u8": 1, "bool": 1}


def kind_of(a: Any) -> Optional[str]:
    """``"torch"``, ``"numpy"`` or None for anything else."""
    module = type(a).__module__ or ""
    if module.startswith("torch") and hasattr(a, "data_ptr"):
        return TORCH
    if module == "numpy" and hasattr(a, "__array_interface__"):
        return NUMPY
    return None


def _torch():
    import torch
    return torch


def _numpy():
    import numpy
    return numpy


def _torch_dtypes():
    torch = _torch()
    table = {
        "bf16": torch.bfloat16,
        "f32": torch.float32,
        "i32": torch.int32,
        "i64": torch.int64,
        "u8": torch.uint8,
        "bool": torch.bool,
    }
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is not None:
        table["fp8"] = fp8
    return table


def _numpy_dtypes():
    np = _numpy()
    return {
        "bf16": np.dtype(np.uint16),
        "fp8": np.dtype(np.uint8),
        "f32": np.dtype(np.float32),
        "i32": np.dtype(np.int32),
        "i64": np.dtype(np.int64),
        "u8": np.dtype(np.uint8),
        "bool": np.dtype(np.bool_),
    }


def dtype_of(a: Any) -> str:
    """The dtype name of ``a``; for numpy ``uint8`` this is ``u8`` (the
    caller decides whether it means FP8)."""
    if kind_of(a) == TORCH:
        for name, dt in _torch_dtypes().items():
            if a.dtype == dt:
                return name
        return str(a.dtype)
    name = a.dtype.name
    return {"uint16": "bf16", "bfloat16": "bf16", "float8_e4m3fn": "fp8", "uint8": "u8",
            "float32": "f32", "int32": "i32", "int64": "i64", "bool": "bool"}.get(name, name)


def shape_of(a: Any) -> Tuple[int, ...]:
    return tuple(int(d) for d in a.shape)


def ptr_of(a: Any) -> int:
    """The address of the first element (0 for an empty torch tensor)."""
    if kind_of(a) == TORCH:
        return int(a.data_ptr())
    return int(a.__array_interface__["data"][0])


def ptr_or_null(a: Optional[Any]) -> Optional[int]:
    """``ptr_of(a)``, or None (NULL) for no array."""
    return None if a is None else ptr_of(a)


def is_contiguous(a: Any) -> bool:
    if kind_of(a) == TORCH:
        return bool(a.is_contiguous())
    return bool(a.flags["C_CONTIGUOUS"])


def is_writable(a: Any) -> bool:
    if kind_of(a) == NUMPY:
        return bool(a.flags["WRITEABLE"])
    return True


def device_of(a: Any) -> Optional[int]:
    """The CUDA device index of ``a``, or None for host memory."""
    if kind_of(a) == TORCH and a.is_cuda:
        return int(a.device.index)
    return None


def device_name(device: Optional[int]) -> str:
    return "host memory" if device is None else f"cuda:{device}"


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def empty(kind: str, shape: Sequence[int], dtype: str, device: Optional[int]) -> Any:
    """A new uninitialised array."""
    if kind == TORCH:
        torch = _torch()
        dt = _torch_dtypes()[dtype]
        return torch.empty(tuple(shape), dtype=dt,
                           device="cpu" if device is None else f"cuda:{device}")
    np = _numpy()
    return np.empty(tuple(shape), dtype=_numpy_dtypes()[dtype])


def as_int32(a: Any) -> Any:
    """``a`` as int32 (a copy when it is int64, as DeepEP's ``topk_idx`` is)."""
    if kind_of(a) == TORCH:
        return a.to(_torch().int32)
    return a.astype(_numpy().int32)


def to_list(a: Any) -> list:
    """A small array's values as a Python list (copies device memory to the host)."""
    if kind_of(a) == TORCH:
        return a.cpu().reshape(-1).tolist()
    return a.reshape(-1).tolist()


def rows(a: Any, n: int) -> Any:
    """The first ``n`` rows of ``a`` (a view)."""
    return a[:n]


class _CudaArray:
    """Device memory described by ``__cuda_array_interface__`` (for torch),
    keeping its owner alive."""

    def __init__(self, ptr: int, shape: Sequence[int], typestr: str, owner: Any):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": typestr, "data": (ptr, False), "version": 2,
            "strides": None,
        }
        self._owner = owner


def view_memory(kind: str, ptr: int, shape: Sequence[int], dtype: str,
                device: Optional[int], owner: Any) -> Any:
    """An array over memory the library owns (``owner`` stays alive as long
    as the array). BF16 only: the low-latency combine buffer."""
    assert dtype == "bf16"
    nbytes = numel(shape) * _ELEMENT_BYTES[dtype]
    if device is not None:
        torch = _torch()
        raw = torch.as_tensor(_CudaArray(ptr, shape, "<i2", owner), device=f"cuda:{device}")
        return raw.view(torch.bfloat16)
    buffer = (ctypes.c_uint8 * nbytes).from_address(ptr)
    buffer._ep_owner = owner  # the arrays below keep `buffer`, and so `owner`, alive
    if kind == TORCH:
        torch = _torch()
        return torch.frombuffer(buffer, dtype=torch.bfloat16).reshape(tuple(shape))
    np = _numpy()
    return np.frombuffer(buffer, dtype=np.uint16).reshape(tuple(shape))


def float_to_bf16_bits(values: Any) -> Any:
    """numpy float32 values -> uint16 BF16 bits, rounded to nearest even (NaN
    stays NaN)."""
    np = _numpy()
    f = np.ascontiguousarray(values, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def bf16_bits_to_float(bits: Any) -> Any:
    """numpy uint16 BF16 bits -> float32 values."""
    np = _numpy()
    b = np.ascontiguousarray(bits, dtype=np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32)
