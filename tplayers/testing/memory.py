"""`peak_bytes()`: the peak of host memory in use while a block runs, read from glibc after every
torch op (CPU tensors' storage comes from malloc; what torch's CPU allocator does not report).

    with peak_bytes() as peak:
        model(ids, labels=ids).loss.backward()
    peak.bytes  # the most in use at once, over what was in use at the start

The reading is taken after each op, so an op's own temporaries freed before it returns are not
seen; its output, and everything still alive, is. Linux with glibc only (`available()`).
"""

import ctypes
import ctypes.util

from torch.utils._python_dispatch import TorchDispatchMode

_MALLINFO2 = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2]


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def available() -> bool:
    """Whether glibc's mallinfo2 can be read here."""
    return _LIBC is not None


def _in_use() -> int:
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd  # the heap's allocated chunks and the mmap'ed large ones


class peak_bytes(TorchDispatchMode):
    """A context: `.bytes` is the peak of memory in use inside it, over its start (see the module docstring)."""

    def __init__(self):
        super().__init__()
        if _LIBC is None:
            raise RuntimeError("peak_bytes needs glibc's mallinfo2 (Linux)")
        self.start, self.bytes = 0, 0

    def __enter__(self):
        self.start, self.bytes = _in_use(), 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.bytes = max(self.bytes, _in_use() - self.start)
        return out
