"""Helpers of the Python package's tests: ranks as threads of this process
(each with its own context), and the array families under test."""
import os
import sys
import threading
from typing import Any, Callable, List

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # reference.py, for spawned ranks too

import ep  # noqa: E402


def families() -> List[str]:
    """numpy always (the tests need it); torch CPU tensors when torch is installed."""
    kinds = ["numpy"]
    try:
        import torch  # noqa: F401
        kinds.append("torch")
    except ImportError:
        pass
    return kinds


def run_ranks(world: int, config: ep.Config, body: Callable[[ep.Context], Any]) -> List[Any]:
    """Runs ``body(ctx)`` on ``world`` ranks as threads, each with its own
    context of one group; returns their results by rank. A rank that raises
    aborts every context (so its peers do not wait for their timeout) and
    the first exception is raised here."""
    uid = ep.get_unique_id()
    results: List[Any] = [None] * world
    errors: List[BaseException] = []
    contexts: List[ep.Context] = []
    lock = threading.Lock()

    def rank(r: int) -> None:
        try:
            with ep.Context(world, r, uid, config) as ctx:
                with lock:
                    contexts.append(ctx)
                results[r] = body(ctx)
        except BaseException as e:  # noqa: B902 - reported below
            with lock:
                errors.append(e)
                for c in contexts:
                    try:
                        c.abort()
                    except ep.Error:
                        pass

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        first = next((e for e in errors if not isinstance(e, ep.AbortedError)), errors[0])
        raise first
    return results


def to_family(a: Any, kind: str) -> Any:
    """A numpy array as the array family under test (BF16 bits become
    torch.bfloat16, FP8 codes torch.float8_e4m3fn)."""
    if kind == "numpy" or a is None:
        return a
    import numpy as np
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a))
    if a.dtype == np.uint16:
        return t.view(torch.bfloat16)
    if a.dtype == np.uint8:
        return t.view(torch.float8_e4m3fn)
    return t


def to_numpy(a: Any) -> Any:
    """Any array of the families as numpy (BF16 as uint16 bits, FP8 as uint8)."""
    import numpy as np

    if a is None or isinstance(a, np.ndarray):
        return a
    import torch

    t = a.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
        return t.numpy().view(np.uint16)
    if t.dtype == getattr(torch, "float8_e4m3fn", None):
        return t.view(torch.uint8).numpy()
    return t.numpy()


@pytest.fixture(params=families())
def family(request) -> str:
    """The array family under test."""
    return request.param
