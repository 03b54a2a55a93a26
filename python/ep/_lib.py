"""Finding, loading and checking libep.so; calling its functions.

Which library: ``EP_LIBRARY`` when set (a path), else the copy that
``pip install`` bundled next to this file. It is loaded on first use, so
``import ep`` works without one.

Checks at load, so that a library from another build never runs with these
ctypes definitions: its API major version must be this package's, every
function of include/ep.h it has gets the header's signature (one it lacks
raises ``UnsupportedError`` when called), and every ``ep_*_init`` must
report a ``struct_size`` no smaller than the ctypes struct's.
"""
import ctypes
import functools
import os
from pathlib import Path
from typing import Any, FrozenSet, NamedTuple, Type

from . import _abi
from .errors import Error, UnsupportedError, error_for

#: Environment variable naming the libep.so to load.
ENV_LIBRARY = "EP_LIBRARY"

#: Bytes of scratch memory an ``ep_*_init`` writes into (a newer library's
#: structs may be larger than this package's).
_INIT_SCRATCH_BYTES = 4096


class LibraryError(Error, OSError):
    """libep.so cannot be found or loaded, or does not match this package."""


class _Loaded(NamedTuple):
    """The loaded, checked library."""

    lib: ctypes.CDLL
    path: str
    #: Functions of the header the library does not export.
    missing: FrozenSet[str]


def bundled_path() -> Path:
    """Where ``pip install`` puts libep.so: inside the package."""
    return Path(__file__).resolve().parent / "libep.so"


def library_path() -> str:
    """The path of the libep.so this process uses (or would use): ``EP_LIBRARY``,
    else the bundled copy. Raises ``LibraryError`` when neither exists."""
    env = os.environ.get(ENV_LIBRARY)
    if env:
        if not os.path.isfile(env):
            raise LibraryError(f"{ENV_LIBRARY}={env} is not a file")
        return os.path.abspath(env)
    bundled = bundled_path()
    if bundled.is_file():
        return str(bundled)
    raise LibraryError(
        f"no libep.so: set {ENV_LIBRARY}=path/to/libep.so (cargo build --release makes "
        f"target/release/libep.so) or install the package with pip, which bundles it "
        f"(looked for {bundled})")


def _bind(lib: ctypes.CDLL) -> set:
    """Gives every function of the header its signature; returns those the
    library lacks."""
    missing = set()
    for name, (result, params, _names) in _abi.FUNCTIONS.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            missing.add(name)
            continue
        fn.restype = result
        fn.argtypes = params
    return missing


def _check_abi(lib: ctypes.CDLL, path: str) -> None:
    version = ctypes.c_uint32()
    status = lib.ep_get_version(ctypes.byref(version))
    if status != _abi.EP_SUCCESS:
        raise LibraryError(f"{path}: ep_get_version failed ({status})")
    if version.value // 10000 != _abi.EP_API_VERSION // 10000:
        raise LibraryError(
            f"{path} has API version {version.value}; this package was made for "
            f"{_abi.EP_API_VERSION} (include/ep.h): use a matching libep.so")
    for name, struct in _abi.INIT_FUNCTIONS.items():
        if not hasattr(lib, name):
            continue
        size = _library_struct_size(lib, name)
        if size < ctypes.sizeof(struct):
            raise LibraryError(
                f"{path}: {name} reports struct_size {size}, this package's "
                f"{struct.__name__} has {ctypes.sizeof(struct)} bytes: the library is older "
                f"than include/ep.h; use a matching libep.so")


def _library_struct_size(lib: ctypes.CDLL, init_name: str) -> int:
    scratch = ctypes.create_string_buffer(_INIT_SCRATCH_BYTES)
    status = getattr(lib, init_name)(scratch)
    if status != _abi.EP_SUCCESS:
        raise LibraryError(f"{init_name} failed ({status})")
    return ctypes.c_uint32.from_buffer(scratch).value


@functools.lru_cache(maxsize=None)
def _loaded() -> _Loaded:
    """Loads and checks libep.so on the first call; later calls return the
    same library. A failure is not kept: the next call tries again. (Threads
    racing on the first call may each load it: the same library, bound the
    same way, so either result serves.)"""
    path = library_path()
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise LibraryError(f"cannot load {path}: {e}") from e
    missing = _bind(lib)
    _check_abi(lib, path)
    return _Loaded(lib, path, frozenset(missing))


def library() -> ctypes.CDLL:
    """The loaded, checked libep.so (loaded on the first call)."""
    return _loaded().lib


def has_function(name: str) -> bool:
    """Whether the loaded library exports ``name``."""
    return name in _abi.FUNCTIONS and name not in _loaded().missing


def last_error() -> str:
    """``ep_get_last_error()`` of the calling thread."""
    return library().ep_get_last_error().decode(errors="replace")


def status_name(status: int) -> str:
    """``ep_get_error_string(status)``."""
    return library().ep_get_error_string(status).decode(errors="replace")


def call(name: str, *args: Any) -> None:
    """Calls ``name``; a non-zero status raises its ``ep.Error`` subclass with
    the library's last-error text."""
    loaded = _loaded()
    if name in loaded.missing:
        raise UnsupportedError(f"{loaded.path} does not export {name} (an older library?)",
                               function=name)
    status = getattr(loaded.lib, name)(*args)
    if status != _abi.EP_SUCCESS:
        raise error_for(status, last_error(), function=name, status_name=status_name(status))


@functools.lru_cache(maxsize=None)
def _defaults(struct: Type[ctypes.Structure], init_name: str) -> ctypes.Structure:
    """The struct as its ``ep_*_init`` fills it, made once: the library's
    defaults, with this package's ``struct_size`` (a newer library accepts
    the smaller struct and gives its extra fields their defaults)."""
    scratch = ctypes.create_string_buffer(_INIT_SCRATCH_BYTES)
    call(init_name, scratch)
    value = struct()
    ctypes.memmove(ctypes.addressof(value), scratch, ctypes.sizeof(struct))
    value.struct_size = ctypes.sizeof(struct)
    return value


def init_struct(struct: Type[ctypes.Structure], init_name: str) -> ctypes.Structure:
    """A new struct holding what its ``ep_*_init`` writes (see ``_defaults``),
    for the caller to fill in."""
    return struct.from_buffer_copy(_defaults(struct, init_name))
