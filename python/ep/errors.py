"""Exceptions: one class per status code of include/ep.h, all under ep.Error.

A failed library call raises the class of its status, carrying the
library's thread-local message (``ep_get_last_error()``: which function,
which argument, which value). Mistakes the Python layer finds before calling
the library (a wrong shape, dtype or device) raise ``InvalidArgumentError``
too, so one ``except ep.InvalidArgumentError`` catches both.
"""
import builtins
from typing import Dict, Optional, Type

from . import _abi


class Error(Exception):
    """A failed ``ep`` call.

    Attributes: ``status`` (the ``EP_*`` code), ``status_name`` (the
    library's name of it), ``function`` (the C function, or the Python
    method that refused the call) and ``message`` (the library's last-error
    text, or the Python layer's explanation).
    """

    status: int = -1

    def __init__(self, message: str, *, status: Optional[int] = None, function: str = "",
                 status_name: str = ""):
        if status is not None:
            self.status = status
        self.message = message
        self.function = function
        self.status_name = status_name
        super().__init__(f"{function}: {message}" if function and not message.startswith(function)
                         else message)


class InvalidArgumentError(Error, ValueError):
    """``EP_ERR_INVALID_ARGUMENT``: out of range or inconsistent with the configuration."""

    status = _abi.EP_ERR_INVALID_ARGUMENT


class NullPointerError(Error, ValueError):
    """``EP_ERR_NULL_POINTER``: a required array was missing."""

    status = _abi.EP_ERR_NULL_POINTER


class UnsupportedError(Error):
    """``EP_ERR_UNSUPPORTED``: not available on this backend, device or build."""

    status = _abi.EP_ERR_UNSUPPORTED


class OutOfMemoryError(Error, MemoryError):
    """``EP_ERR_OUT_OF_MEMORY``: a host or device allocation failed."""

    status = _abi.EP_ERR_OUT_OF_MEMORY


class CudaUnavailableError(Error):
    """``EP_ERR_CUDA_UNAVAILABLE``: the GPU backend without a usable driver or GPU."""

    status = _abi.EP_ERR_CUDA_UNAVAILABLE


class CudaError(Error):
    """``EP_ERR_CUDA``: a CUDA driver call or kernel launch failed."""

    status = _abi.EP_ERR_CUDA


class TimeoutError(Error, builtins.TimeoutError):
    """``EP_ERR_TIMEOUT``: a peer rank did not answer within ``timeout_ms``."""

    status = _abi.EP_ERR_TIMEOUT


class InProgressError(Error):
    """``EP_IN_PROGRESS``: enqueued work has not completed."""

    status = _abi.EP_IN_PROGRESS


class AbortedError(Error):
    """``EP_ERR_ABORTED``: the context was aborted."""

    status = _abi.EP_ERR_ABORTED


class InternalError(Error):
    """``EP_ERR_INTERNAL``: a bug in the library; the message says where."""

    status = _abi.EP_ERR_INTERNAL


class SystemCallError(Error, OSError):
    """``EP_ERR_SYSTEM``: an operating-system call (socket, shared memory) failed."""

    status = _abi.EP_ERR_SYSTEM


class RemoteError(Error):
    """``EP_ERR_REMOTE``: a peer refused, disagreed on the setup, or vanished."""

    status = _abi.EP_ERR_REMOTE


#: Status code -> exception class, for every failure code of the header.
BY_STATUS: Dict[int, Type[Error]] = {
    cls.status: cls
    for cls in (InvalidArgumentError, NullPointerError, UnsupportedError, OutOfMemoryError,
                CudaUnavailableError, CudaError, TimeoutError, InProgressError, AbortedError,
                InternalError, SystemCallError, RemoteError)
}


def error_for(status: int, message: str, function: str = "", status_name: str = "") -> Error:
    """The exception for ``status`` (the base ``Error`` for a code this
    package does not know, e.g. from a newer library)."""
    cls = BY_STATUS.get(status, Error)
    return cls(message, status=status, function=function, status_name=status_name)
