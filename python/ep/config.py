"""The configuration of a context (``ep_config_t``)."""
import ctypes
from dataclasses import dataclass, fields
from typing import Optional, Union

from . import _abi, _lib
from .errors import InvalidArgumentError

_BACKENDS = {"auto": _abi.EP_BACKEND_AUTO, "gpu": _abi.EP_BACKEND_GPU,
             "host": _abi.EP_BACKEND_HOST}
_DTYPES = {"bf16": _abi.EP_DTYPE_BF16, "fp8": _abi.EP_DTYPE_FP8_E4M3}
#: The fields given by name: each name's code.
_NAMED = {"backend": _BACKENDS, "token_dtype": _DTYPES}


def _name_of(field: str, code: int) -> Union[str, int]:
    """The name of ``field``'s ``code`` (the code itself when it has none)."""
    for name, value in _NAMED[field].items():
        if value == code:
            return name
    return code


def backend_name(code: int) -> str:
    """``"gpu"``, ``"host"`` or ``"auto"`` for an ``EP_BACKEND_*`` code."""
    return str(_name_of("backend", code))


@dataclass
class Config:
    """What every rank of a context passes to ``ep_ctx_create``; a field left
    None takes the library's default (``ep_config_init``: 4096 tokens, hidden
    7168, top-8 of 256 experts, BF16, backend ``auto``, 24 SMs, 100 s
    timeout, 128 low-latency tokens, ranks per node decided by the hosts).

    ``backend``: ``"auto"`` (``EP_BACKEND`` decides, GPU when unset),
    ``"gpu"`` or ``"host"``. ``token_dtype``: ``"bf16"`` (either type may be
    dispatched) or ``"fp8"`` (smaller buffers, FP8 only).
    ``ll_max_tokens_per_rank=0`` disables the low-latency mode.
    ``ranks_per_node``: ranks ``[n * R, (n + 1) * R)`` form node ``n``; 0
    lets the hosts decide (every host one node), a smaller value than a
    host's ranks splits it into virtual nodes (see ``ep_config_t`` in
    include/ep.h).
    """

    max_tokens_per_rank: Optional[int] = None
    hidden: Optional[int] = None
    topk: Optional[int] = None
    num_experts: Optional[int] = None
    token_dtype: Optional[str] = None
    backend: Optional[Union[str, int]] = None
    num_sms: Optional[int] = None
    timeout_ms: Optional[int] = None
    ll_max_tokens_per_rank: Optional[int] = None
    ranks_per_node: Optional[int] = None

    def to_c(self) -> _abi.ep_config_t:
        """The ``ep_config_t``: the library's defaults, then every field set here."""
        c = _lib.init_struct(_abi.ep_config_t, "ep_config_init")
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name in _NAMED:
                value = _lookup(f.name, value)
            try:
                setattr(c, f.name, value)
            except TypeError as e:
                raise InvalidArgumentError(f"config.{f.name} = {value!r}: {e}",
                                           function="Config") from None
        return c

    @staticmethod
    def defaults() -> "Config":
        """The library's defaults, every field filled."""
        return Config.from_c(_lib.init_struct(_abi.ep_config_t, "ep_config_init"))

    @staticmethod
    def from_c(c: _abi.ep_config_t) -> "Config":
        """A Config with every field of ``c`` (names for the named fields)."""
        values = {f.name: getattr(c, f.name) for f in fields(Config)}
        values["token_dtype"] = _name_of("token_dtype", c.token_dtype)
        values["backend"] = backend_name(c.backend)
        return Config(**values)


def _lookup(field: str, value: Union[str, int]) -> int:
    """The code of a named field's ``value`` (a name, or already a code)."""
    if isinstance(value, int):
        return value
    table = _NAMED[field]
    try:
        return table[str(value).lower()]
    except KeyError:
        raise InvalidArgumentError(
            f"config.{field} = {value!r}: expected one of {', '.join(table)}",
            function="Config") from None


def buffer_size_hint(config: Optional[Config], world_size: int) -> int:
    """Bytes of communication buffer one rank allocates for ``config`` with
    ``world_size`` ranks, on the backend the config selects
    (``ep_get_buffer_size_hint``)."""
    c = (config or Config()).to_c()
    size = ctypes.c_size_t()
    _lib.call("ep_get_buffer_size_hint", ctypes.byref(c), world_size, ctypes.byref(size))
    return size.value
