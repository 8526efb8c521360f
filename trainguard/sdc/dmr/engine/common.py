"""Records, flags and helpers the DMR engine's parts share: the op's primary execution (:func:`_primary`), the
checker flag (:func:`_checking`), the records of a mismatch, a deferred check and a fingerprint taken later, and
the window worker's dispatch-mode stack (:func:`_entered`). Relies on torch (dispatch modes, storages, generators).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode, _push_mode

from trainguard.faults.injector import _CHECKER as _INJECTOR_FLAG  # the flag checker_execution() sets
from trainguard.faults.injector import checker_execution  # (injecting()'s flag)
from trainguard.sdc.dmr import ops as dops
from trainguard.utils.threadflag import ThreadFlag

# (``tensor_lr``: the same kernels with the learning rate as a tensor, as torch.optim calls them for ``lr=Tensor``)
_FUSED_OPTIMIZERS = frozenset(("aten._fused_adamw_.default", "aten._fused_adam_.default",
                               "aten._fused_adamw_.tensor_lr", "aten._fused_adam_.tensor_lr"))
_CHECKING = ThreadFlag()  # set while this thread runs deferred checkers
_DEFERRED = ("d-inter", "d-intra", "agc")


@contextlib.contextmanager
def _checking() -> Iterator[None]:
    """This thread runs engine executions (checkers, tie-breakers): the mode and the injector let them through."""
    with _CHECKING.set(True), checker_execution():
        yield


@dataclass
class Mismatch:
    op_id: str
    name: str
    phase: str
    strategy: str
    detail: str = ""

    def site(self) -> str:
        return f"{self.op_id}:{self.name}"


@dataclass
class _Segment:
    """One execution of an activation-checkpointed module: its forward ops (id, name, fingerprint), in order."""

    path: str
    records: list[tuple[str, str, dops.Fingerprint | None]] = field(default_factory=list)
    cursor: int = 0
    call: int = -1  # the attempt's n-th execution of a checkpointed module (profiles: ``ac_call``)


@dataclass(slots=True)
class Deferred:
    """A checker waiting for an idle window: the op, its retained inputs, the primary's fingerprint."""

    op_id: str
    name: str
    phase: str
    strategy: str
    window: str | None
    run: Callable[[], Any]
    expect: Any  # dops.Fingerprint, or a copy of the output ([sdc.dmr] fingerprints = false)
    nbytes: int
    est_s: float = 0.0
    carried: bool = False  # checked in the next iteration, with the parameters as they were before the update
    held: dict | None = None  # the inputs it keeps (see _defer)


class _Later:
    """A fingerprint taken later, off the main thread: the output is kept by reference (with its tensors'
    version counters) until a window's worker (or the end-of-iteration drain) computes it. The engine
    computes it at once, on the main thread, before any op writes into one of those tensors, so the
    fingerprint is always of the value the op produced."""

    __slots__ = ("fp", "nbytes", "value", "versions")

    def __init__(self, value: Any, ts: list[torch.Tensor]):
        self.value = value
        self.versions = [t._version for t in ts]
        self.nbytes = dops.bytes_of(ts)
        self.fp: dops.Fingerprint | None = None


_storage_key = dops.storage_key
_storage_or_none = dops.storage_of
_ACCUMULATE_SEQ = 2**64 - 1  # the sequence number torch gives every AccumulateGrad node (UINT64_MAX)


def _free_memory_bytes(device: torch.device) -> int:
    """Memory this rank may still use: free device memory on CUDA; on CPU the host's available memory
    shared by the ranks on it (LOCAL_WORLD_SIZE). 0 when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as fh:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in fh}
        return info.get("MemAvailable", 0) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except (OSError, ValueError, IndexError):
        return 0


def _is_routing(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex() and t.numel() <= 1 << 20


def _routing_copy(out: Any) -> Any:
    """Copies of an op's small integer outputs (routing decisions: top-k indices, token counts), None if it has
    none: a tensor, or a tuple with None in place of the other outputs."""
    if isinstance(out, torch.Tensor):
        return out.clone() if _is_routing(out) else None
    if isinstance(out, (tuple, list)) and any(_is_routing(t) for t in out):
        return tuple(t.clone() if _is_routing(t) else None for t in out)
    return None


def _with_routing(out: Any, kept: Any) -> Any:
    if isinstance(kept, torch.Tensor):
        return kept if isinstance(out, torch.Tensor) else out
    if isinstance(out, (tuple, list)) and len(out) == len(kept):
        return type(out)(k if k is not None else o for o, k in zip(out, kept))
    return out


@functools.cache
def _is_list_update(name: str) -> bool:
    """A fused optimizer, or an in-place op over lists of tensors (``aten._foreach_mul_``...)."""
    return name in _FUSED_OPTIMIZERS or (name.startswith("aten._foreach_") and name.split(".")[1].endswith("_"))


def _all_tensors(out: Any) -> bool:
    return isinstance(out, torch.Tensor) or (isinstance(out, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in out))


@contextlib.contextmanager
def _entered(modes: list[TorchDispatchMode]) -> Iterator[None]:
    """Push ``modes`` (outermost first) on this thread's dispatch-mode stack for a block. Through torch's private
    ``_push_mode`` / ``_pop_mode``, not ``with mode``: entering a mode also appends to lists on the mode object and
    sets module-wide flags, both shared with the thread that entered it; the push touches this thread's stack
    only."""
    for m in modes:
        _push_mode(m)
    try:
        yield
    finally:
        for _ in modes:
            _pop_mode()


def _record_on(stream: Any, ts: list[torch.Tensor]) -> None:
    """The caching allocator does not reuse these tensors' memory before ``stream``'s work queued so far is done
    (device tensors only: an op's inputs can include host ones, such as a batch's token ids or a CPU scalar)."""
    for t in ts:
        if t.is_cuda:
            t.record_stream(stream)


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor on ``t``'s storage, with ``t``'s size, strides and offset, and a version counter of its own."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.size(),
                                                               t.stride())


# ``bench dmr --op-times``: each op's executions in a dispatch mode (the engine's primaries, the floor's ops), their
# thread CPU time and calls, keyed "<op> forward" or "<op> in backward" (a recompute runs inside the backward), as
# [seconds, calls]. None (the default): nothing is timed, and the hot path reads this one global more per op.
OP_TIMES: dict[str, list] | None = None


def time_ops(table: dict[str, list] | None) -> None:
    """Tally every op executed in a dispatch mode into ``table`` from now on (None: stop)."""
    global OP_TIMES
    OP_TIMES = table


def _timed(table: dict[str, list], call: Callable, name: str, args: tuple, kwargs: dict) -> Any:
    c0 = time.thread_time()
    out = call(*args, **kwargs)
    dt = time.thread_time() - c0
    key = f"{name} in backward" if torch._C._current_graph_task_id() != -1 else f"{name} forward"
    entry = table.get(key)
    if entry is None:
        entry = table[key] = [0.0, 0]
    entry[0] += dt
    entry[1] += 1
    return out


def _primary(func, args, kwargs, inf: dops.OpInfo | None = None):
    """The op's primary execution: an op of the step as far as the fault injector is concerned. ``inf``: the op's
    :func:`~trainguard.sdc.dmr.ops.info`, where the caller has it."""
    inf = inf if inf is not None else dops.info(func)
    before = _INJECTOR_FLAG.active
    _INJECTOR_FLAG.active = False
    table = OP_TIMES
    try:
        out = inf.call(*args, **kwargs) if table is None else _timed(table, inf.call, inf.name, args, kwargs)
    finally:
        _INJECTOR_FLAG.active = before
    if inf.unset:
        with checker_execution():  # (zeroing what the kernel left unset is the engine's work, not an op of the step)
            dops.clear_unset(func, args, kwargs, out)
    return out


class _Stale(Exception):
    """A deferred check whose inputs were changed in place before its window."""


class _RNG:
    """Generator states around a random op (its explicit generators, else the global CPU/CUDA RNG)."""

    def __init__(self, func, args, kwargs):
        self.gens: list[torch.Generator] = []
        self.before: list[torch.Tensor] = []
        self.after: list[torch.Tensor] = []
        if not dops.info(func).random:
            return
        self.gens = [g for g in dops.flat((args, kwargs)) if isinstance(g, torch.Generator)]
        if not self.gens:
            self.gens = [torch.default_generator] + ([torch.cuda.default_generators[torch.cuda.current_device()]]
                                                     if torch.cuda.is_available() and torch.cuda.is_initialized() else [])
        self.before = [g.get_state() for g in self.gens]

    def rewind(self) -> None:
        if self.gens:
            self.after = [g.get_state() for g in self.gens]
            for g, st in zip(self.gens, self.before):
                g.set_state(st)

    def forward(self) -> None:
        for g, st in zip(self.gens, self.after):
            g.set_state(st)
