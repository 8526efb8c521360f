"""Keep freed host memory in the process (glibc ``mallopt``), so that large CPU tensors stop page-faulting.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and gives it
back to the kernel on ``free``. A training step on CPU allocates such buffers by the dozen (logits, their
gradient, attention scores, optimizer temporaries), so each step page-faults (and the kernel zeroes) every
one of them again. On BERT-base (batch 8 x 128, 2 cores) that was ~15% of a plain step, and it moved with
the allocation pattern: protected attention allocates differently from SDPA, so it showed up as a
spurious ABFT overhead (~15% step overhead measured with the default allocator vs ~5% with this setting;
see docs/abft-tooling.md).

:func:`retain_freed_memory` switches glibc to serve everything from its heap (``M_MMAP_MAX = 0``) and
never to trim it (``M_TRIM_THRESHOLD`` = 2 GiB): the resident size stays at the peak, as with CUDA's
caching allocator. It is what jemalloc / tcmalloc (PyTorch's CPU performance guide recommends preloading
them) achieve, without a preload. Process-wide and not reversible for memory already allocated; a no-op
(returning False) where the C library is not glibc. Relies on ``ctypes`` only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: trim only when 2 GiB lie free at the heap's top

_applied = False


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 -- raises AttributeError on musl and other C libraries
        return libc
    except (OSError, AttributeError):
        return None


def retain_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse (see the module docstring). True if the setting is in force."""
    global _applied
    if _applied:
        return True
    libc = _glibc()
    if libc is None:
        return False
    _applied = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    return _applied


def host_memory_mode() -> str:
    """``retain`` once :func:`retain_freed_memory` is in force in this process, else ``default``."""
    return "retain" if _applied else "default"
