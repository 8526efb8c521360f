"""Keep freed host memory in the process (glibc ``mallopt``), so that large CPU tensors stop page-faulting.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and gives it
back to the kernel on ``free``. A training step on CPU allocates such buffers by the dozen (logits, their
gradient, attention scores, optimizer temporaries), so each step page-faults (and the kernel zeroes) every
one of them again. On BERT-base (batch 8 x 128, 2 cores) that was ~15% of a plain step, and it moved with
the allocation pattern: protected attention allocates differently from SDPA, so it showed up as a
spurious ABFT overhead (~15% step overhead measured with the default allocator vs ~5% with this setting;
see docs/abft-tooling.md).

:func:`retain_freed_memory` switches glibc to serve everything from its heap (``M_MMAP_MAX = 0``),
never to trim it (``M_TRIM_THRESHOLD`` = 2 GiB), and to serve the threads that start allocating from then on
from that same heap (``M_ARENA_MAX = 1``): the resident size stays at the peak, as with CUDA's caching
allocator. It is what jemalloc / tcmalloc (PyTorch's CPU performance guide recommends preloading them)
achieve, without a preload. The arena limit is for threads that allocate tensors, such as DMR's window worker
(a thread per communication window): glibc gives a new thread an arena of its own, made of separate 64 MiB
heaps, and unmaps such a heap as soon as it is wholly free, whatever the trim threshold; the workers' checker
outputs then page-faulted in again window after window (13-46 thousand minor faults a step per pipeline stage
on llama-60m; a few hundred at most once every thread shares the main heap). The price is one lock for all
threads' allocations, taken by few threads at once here. The limit only holds for threads that first
allocate after it (the trainer applies it before the process group starts its threads): an arena made before
stays in use. Process-wide and not reversible for memory already allocated; a no-op (returning False) where
the C library is not glibc or another allocator is preloaded (that one then decides what is retained).

:func:`heap_in_use_bytes` and :class:`HeapPeak` measure what the process holds allocated (glibc's
``mallinfo2``: heap and mmapped chunks in use, every arena), which the resident size no longer tells once
freed memory is retained; None under a preloaded allocator (the caller then falls back to the resident size).
Relies on ``ctypes``, ``functools`` and ``threading`` only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
import threading

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: trim only when 2 GiB lie free at the heap's top

_applied = False


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 -- raises AttributeError on musl and other C libraries
    except (OSError, AttributeError):
        return None
    return libc if _malloc_is_glibcs(libc) else None


def _malloc_is_glibcs(libc) -> bool:
    """Whether the process's ``malloc`` is glibc's own, not one a preload interposes (``LD_PRELOAD`` of jemalloc or
    tcmalloc): glibc's ``mallopt`` and ``mallinfo2`` then describe an allocator nothing uses, so the setting would
    be reported in force and the heap read as nearly empty. The global scope's ``malloc`` (``dlopen(NULL)``, where
    a preload comes first) against the one in libc itself."""
    try:
        process = ctypes.cast(ctypes.CDLL(None).malloc, ctypes.c_void_p).value
        own = ctypes.cast(libc.malloc, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return False
    return process == own


def retain_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse (see the module docstring). True if the setting is in force."""
    global _applied
    if _applied:
        return True
    libc = _glibc()
    if libc is None:
        return False
    _applied = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)) \
        and bool(libc.mallopt(_M_ARENA_MAX, 1))
    return _applied


def host_memory_mode() -> str:
    """``retain`` once :func:`retain_freed_memory` is in force in this process, else ``default``."""
    return "retain" if _applied else "default"


def rss_bytes() -> int:
    """The process's resident size (``/proc/self/statm``; 0 where the platform has no such file)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                 "uordblks", "fordblks", "keepcost")]


@functools.cache
def _mallinfo2():
    """glibc's ``mallinfo2`` (glibc >= 2.33), or None."""
    libc = _glibc()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None
    if fn is not None:
        fn.restype, fn.argtypes = _MallInfo2, []
    return fn


def heap_in_use_bytes() -> int | None:
    """Bytes the process holds allocated through malloc now (chunks in use in every arena plus mmapped ones),
    or None where glibc's ``mallinfo2`` is not available. ~0.5 us a call."""
    fn = _mallinfo2()
    if fn is None:
        return None
    m = fn()
    return int(m.uordblks + m.hblkhd)


class HeapPeak:
    """The largest :func:`heap_in_use_bytes` seen while the context is open, sampled by a thread every
    ``interval_s`` (``peak`` None where it cannot be measured). A sampler, not a hook: a peak shorter than the
    interval can be missed, so it is a lower bound; use it around an untimed step, not a timed one."""

    def __init__(self, interval_s: float = 0.0005):
        self.interval_s = interval_s
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _observe(self) -> None:
        now = heap_in_use_bytes()
        if now is not None and (self.peak is None or now > self.peak):
            self.peak = now

    def _sample(self) -> None:
        while True:
            self._observe()
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> HeapPeak:
        if _mallinfo2() is not None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._observe()  # (the last state too, should the step end at its peak)
