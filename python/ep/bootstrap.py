"""How the ranks of a group find each other.

The library's model is NCCL's: one rank makes a 128-byte unique id
(``get_unique_id``), the caller ships it to every other rank, and every rank
creates its ``Context`` with it. The id holds the rendezvous address and a
random secret: treat it as a credential. The process that made it must stay
alive until every rank's context exists.

``from_process_group`` does the shipping over a ``torch.distributed`` group.
``from_nccl_communicator`` needs no unique id: it makes the context from the
group's NCCL communicator (``ep_ctx_create_from_nccl``).
"""
import ctypes
from typing import Any, Optional

from . import _abi, _lib
from .config import Config
from .context import Context
from .errors import UnsupportedError


def get_unique_id() -> bytes:
    """A new unique id (``ep_get_unique_id``), whose rendezvous service runs
    in a background thread of this process. Call it on one rank."""
    uid = _abi.ep_unique_id_t()
    _lib.call("ep_get_unique_id", ctypes.byref(uid))
    return bytes(uid.internal)


def unique_id_from_group(group: Any = None, src: int = 0) -> bytes:
    """Group rank ``src`` makes a unique id and broadcasts it over the
    ``torch.distributed`` ``group`` (default: the world); every rank returns
    it. Collective: every rank of the group calls it."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    holder = [get_unique_id() if rank == src else None]
    global_src = src if group is None else dist.get_global_rank(group, src)
    dist.broadcast_object_list(holder, src=global_src, group=group)
    uid = holder[0]
    if not isinstance(uid, (bytes, bytearray)) or len(uid) != _abi.EP_UNIQUE_ID_BYTES:
        raise UnsupportedError("the broadcast over the process group returned no unique id",
                               function="unique_id_from_group")
    return bytes(uid)


def from_process_group(config: Optional[Config] = None, group: Any = None, *,
                       device: Optional[int] = None) -> Context:
    """A context whose ranks are the ranks of the ``torch.distributed``
    ``group`` (default: the world), rank ``i`` of the group being rank
    ``i`` of the context. The unique id is broadcast over the group (any
    backend: gloo or NCCL). ``device``: this rank's CUDA device (default:
    torch's current device). Collective: every rank of the group calls it."""
    import torch.distributed as dist

    uid = unique_id_from_group(group)
    return Context(dist.get_world_size(group), dist.get_rank(group), uid, config, device=device)


def nccl_comm_address(comm: Any) -> int:
    """The ``ncclComm_t`` address behind ``comm``: an int (the address
    itself), a ``torch.distributed`` process group with an NCCL backend, or
    that backend (``ProcessGroupNCCL``, whose ``_comm_ptr()`` gives it)."""
    if isinstance(comm, int):
        return comm
    backend = comm
    if hasattr(comm, "_get_backend"):
        import torch

        backend = comm._get_backend(torch.device("cuda"))
    if hasattr(backend, "_comm_ptr"):
        return int(backend._comm_ptr())
    raise TypeError(f"{type(comm).__name__} is not an ncclComm_t address, an NCCL process "
                    "group, or its backend")


def from_nccl_communicator(comm: Any, config: Optional[Config] = None, *,
                           device: Optional[int] = None) -> Context:
    """A context over the ranks of an existing NCCL communicator, through
    ``ep_ctx_create_from_nccl``: ``comm`` is the ``ncclComm_t`` address, a
    ``torch.distributed`` process group with an NCCL backend, or that
    backend (see ``nccl_comm_address``). The communicator is borrowed: keep
    it (and its group) alive until the context is closed. The library loads
    the NCCL the process already has (torch's) and refuses another version
    than the one its kernels were built for. Collective: every rank of the
    communicator calls it."""
    return Context.from_nccl_comm(nccl_comm_address(comm), config, device=device)


class Buffer(Context):
    """A DeepEP-style entry point: ``ep.Buffer(group, config)`` is the
    context of this rank of the ``torch.distributed`` ``group`` (see
    ``from_process_group``), with every ``Context`` method."""

    def __init__(self, group: Any = None, config: Optional[Config] = None, *,
                 device: Optional[int] = None):
        import torch.distributed as dist

        uid = unique_id_from_group(group)
        super().__init__(dist.get_world_size(group), dist.get_rank(group), uid, config,
                         device=device)
