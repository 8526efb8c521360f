"""The DMR execution engine: one ``TorchDispatchMode`` sees every op of an iteration and has each verified
by exactly one strategy, as the plan says.

Attach with :func:`attach` (or ``[sdc.dmr] enabled = true``). The engine then

* enters its dispatch mode around every attempt of a step (a Trainer step context, *inside* the fault
  injector's, so a fault corrupts the primary execution before it is compared; the engine's own copies,
  fingerprints and second executions are invisible to the injector);
* knows, for each op, its phase (``forward``, ``recompute`` inside an activation-checkpoint recompute,
  ``backward`` inside an autograd graph task, ``optimizer`` once the step's guards passed: clipping, the
  optimizer and the schedule), its leaf module, transformer block and micro-batch, and for backward ops
  the forward op they differentiate (autograd sequence numbers);
* **profiles** the first attempt of the run (record only, PyTorch's default early-stopping recompute), plans
  the rest with :func:`~trainguard.sdc.dmr.planner.plan_static` (phases 1-3) and asks the trainer to
  re-execute that attempt with the plan (a retry from the step's start: nothing ran unverified);
* verifies each compute op (views, collectives and allocations are never re-executed, see ``ops.py``) by
  the strategy the plan gives it:

  - **naive**: re-executed at once on the same inputs (mutated inputs cloned first), outputs compared;
  - **p-dmr**: ops of activation-checkpointed segments: the forward records a fingerprint per op; the
    recompute in backward (early stop off, so every op including the segment's last is replayed) is the
    checker execution, compared op by op; a different op sequence is a detection, not a crash;
  - **d-inter / d-intra / agc**: deferred: inputs retained (parameters are not copied), the output's
    fingerprint kept, the checker runs in its planned idle window (:meth:`DMREngine.window`: a pipeline
    transfer, an expert all-to-all) on a worker thread while the main thread waits on the communication;
    AGC segments' ops are deferred into their segment's window op by op (see docs/dmr.md);
  - **dynamic** (MoE expert ops, whose number changes with routing): the run-time
    :class:`~trainguard.sdc.dmr.dynamic.DynamicPlanner` queue: best fit at static windows, one by one at
    dynamic windows until they close, forced when memory nears the budget;
  - the **update stage** (clipping, fused AdamW in chunks, schedule): a mismatch is repaired by a third
    execution (the update cannot be rolled back without a copy of the optimizer state); with windows
    (``sparetrain`` on pipeline / expert parallel, ``hold_update``) the fused optimizer runs once and its check
    is held into the next iteration's windows, from a verified copy of the state that the passing checker
    itself keeps up to date (see ``_held_optimizer``); the trainer's state hook settles it before the state is
    read or replaced from outside the step loop;
  - where windows exist, fingerprints that need not be taken at once (P-DMR's forward and recompute, deferred
    ops' primaries) are taken by the window's worker (:class:`_Later`), on the main thread only before an op
    writes into the output or hands it to a collective;

* reports mismatches to its :class:`DMRGuard`: the trainer rolls the iteration back on all ranks and
  re-executes it; the same op failing again on the re-execution is reported as suspected persistent
  hardware (exit 3).

Relies on torch (``TorchDispatchMode``, autograd sequence numbers, module and optimizer hooks, threads) and on
torch 2.13's private ``_should_skip_dynamo`` hook and ``_push_mode`` / ``_pop_mode`` /
``_get_current_dispatch_mode_stack`` (the window worker's modes): ``tests/sdc/dmr/test_torch_private.py`` fails
if they move.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack, _pop_mode, _push_mode
from torch.utils._pytree import tree_map

from trainguard.errors import SuspectedHardwareFault
from trainguard.faults.injector import _CHECKER as _INJECTOR_FLAG  # the flag checker_execution() sets
from trainguard.faults.injector import _INJECTING, checker_execution, patterns_counting_views  # (injecting()'s flag)
from trainguard.models.moe import in_routed_region
from trainguard.sdc.dmr import ops as dops
from trainguard.sdc.dmr.agc import StaleInput, Tape
from trainguard.sdc.dmr.config import DMRConfig
from trainguard.sdc.dmr.determinism import load_tolerances
from trainguard.sdc.dmr.dynamic import DynamicPlanner, Entry
from trainguard.sdc.dmr.plan import CARRY, Plan
from trainguard.sdc.dmr.planner import PlannerConfig, plan_static
from trainguard.sdc.dmr.profile import OpRecord, Profile, Window, median_profile
from trainguard.train.activation_checkpoint import add_checkpoint_context, set_checkpoint_early_stop
from trainguard.train.guards import StepGuard, Verdict
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


@dataclass
class _HeldUpdate:
    """A fused optimizer update run once on the main thread, its check held until the next iteration's windows:
    the call's arguments (the lists it writes point at the live state, ``grads`` at the gradients it read,
    kept alive here) and the names of the lists it writes."""

    op_id: str
    func: Any
    bound: dict[str, Any]
    written: list[str]
    step: int


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


def _idle_priority() -> None:
    """Run this thread (a window's checker worker) only on a core nothing else wants: Linux's SCHED_IDLE class. The
    checkers fill idle time; on a host whose cores the ranks share, the same class keeps them from taking a core
    from another rank's critical path, as a low-priority side stream does on a device. Elsewhere a no-op."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # (pid 0: this thread)
    except (AttributeError, OSError):
        pass


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


class DMREngine:
    def __init__(self, cfg: DMRConfig | None = None, plan: Plan | None = None):
        self.cfg = (cfg or DMRConfig(enabled=True)).validate()
        self._plan = plan
        self.active = self.cfg.system != "none"
        self.rtol: dict[str, float] = {}  # tolerance mode: per op name (from a determinism report)
        self.calibration: dict[str, float] | None = None  # set while recording a determinism report
        if self.cfg.compare == "tolerance" and self.cfg.determinism_report:
            self.rtol = load_tolerances(self.cfg.determinism_report, self.cfg.tolerance_safety)
        self.totals: Counter = Counter()  # over the run
        self.profile: Profile | None = None  # the last profile recorded
        self._profiling = False
        self._profiled: list[Profile] = []  # the attempts profiled so far for the next plan (profile_steps)
        self._modules: list[str] = []
        self._blocks: dict[str, str] = {}  # module path -> its block (see _block_of), for every op that owns a node
        self._optimizer_phase = False
        self._setup = False  # inside a strategy's one-time set-up (window kind "setup")
        self._segments: list[tuple[_Segment, str]] = []  # stack of (segment, "forward" | "recompute")
        self._handles: list[Callable[[], Any]] = []
        self.queue: list[Deferred] = []
        self.queued_bytes = 0
        self.budget_bytes = int(self.cfg.memory_budget_mb * 2**20)
        self._lock = threading.Lock()
        self.step = 0
        self._param_storages: set[int] = set()
        self._plain_tensors = True  # the model's parameters are plain tensors (see attach)
        self._param_shapes: set[tuple] = set()
        self._ws: dict[tuple, torch.Tensor] = {}  # update-stage workspaces, reused every step
        self.deferrable = False
        self._model = None
        self.dynamic = DynamicPlanner(self.budget_bytes or 2**40)
        # the update-stage check held into the next iteration's windows (see _held_optimizer)
        self._held: list[_HeldUpdate] = []
        # per live tensor of the optimizer state (by id, with the tensor itself): the verified value before its
        # next update, and the buffer its checker runs in
        self._pre: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._spare: dict[int, torch.Tensor] = {}
        self._repair: list[tuple[dict, dict]] = []  # (verified result, live state) to write back
        self._held_fatal: str | None = None
        # what the last held check took (all of a step's fused calls): the thread executor starts one only in a
        # window whose profiled end leaves that much room (``_held_fits``); the end of the window now open
        self._held_s = 0.0
        self._window_end = float("inf")
        self._later_room = 0.0  # the most free time a later window of the plan has (see _index_plan)
        self._pre_start: int | None = None  # the step at whose start the state was what ``_pre`` holds
        self._spare_step: dict[int, int] = {}  # per tensor: the step whose update's check moved its copy to ``_spare``
        self._spare_start: int | None = None  # the same for ``_spare``
        # checks carried into the next iteration (``carry_last``): the iteration that queued them, and whether one
        # of them failed (the update of that iteration read wrong gradients: both iterations are re-executed)
        self._carried: list[Deferred] = []
        # and the fingerprints still to be taken at the end of it, with the P-DMR comparisons waiting for them (the
        # last micro-batch's outputs): taken in the next iteration's windows too; a comparison that differs rewinds
        self._carried_fifo: deque[_Later | tuple] = deque()
        self._pre_by_storage: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._carried_step = -1
        self._hold_memo: tuple[int, bool] = (-1, False)
        self.carried_bytes = 0
        self.carry_ok = False  # set by the trainer, per step: no state read follows this step's update
        # the step after whose update checks may have been carried on some rank, until every rank has judged them
        # together (the next step's verdict, or a collective in settle): the same on every rank
        self._carry_sync_step: int | None = None
        self._rewind = False
        self._trainer = None
        # the stream executor (see window): the device module, its side stream, and the comparisons' device flags
        # with what to do when read (None: the thread executor, where every comparison is read at once)
        self._devmod: Any = None
        self._side: Any = None
        self._sync: Callable[[], None] | None = None  # a CUDA device: profiled times are the device's, not launches'
        self._flags: list[tuple[torch.Tensor, Callable[[], None], Callable[[], None] | None]] | None = None
        self._window_spent = 0.0  # estimated checker time run in the current window (the stream executor's budget)
        self._on_side: Any = None  # the CUDA side stream while checkers are launched on it
        self._index_plan()
        self._reset_attempt()

    @property
    def plan(self) -> Plan | None:
        return self._plan

    @plan.setter
    def plan(self, plan: Plan | None) -> None:
        self._plan = plan
        self._index_plan()
        self._set_early_stop()

    # ---- wiring ----------------------------------------------------------------------------------
    def attach(self, trainer) -> DMREngine:
        model = self._model = trainer.model
        self._param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._param_names = {id(p): n for n, p in model.named_parameters()}
        self._param_shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape[::-1]) for p in
                                                                           model.parameters()}
        for n, m in model.named_modules():
            self._handles.append(m.register_forward_pre_hook(lambda mod, inp, n=n: self._enter_module(n)).remove)
            self._handles.append(m.register_forward_hook(lambda mod, inp, out: self._pop_module()).remove)
        self._set_early_stop()
        self._handles.append(add_checkpoint_context(model, self._checkpoint_contexts))
        opt = trainer.optimizer
        self._handles.append(opt.register_step_pre_hook(lambda *a: self._set_optimizer(True)).remove)
        self._handles.append(opt.register_step_post_hook(lambda *a: self._set_optimizer(False)).remove)
        trainer.step_contexts.append(self.step_context)  # after the injector's (it inserts itself first)
        self._handles.append(trainer.strategy.add_window_hook(self.window))
        self.deferrable = trainer.strategy.name in ("pipeline", "expert")  # strategies with idle windows
        # views past the mode need plain tensors: a tensor subclass's own __torch_dispatch__ (DTensor) must see them
        self._plain_tensors = not any(dops.dispatches_in_python(p) for p in model.parameters())
        self._handles.append(trainer.add_guard(DMRGuard(self)))
        trainer.metric_sources.append(self.metrics)
        self._handles.append(trainer.add_state_hook(self._state_event))
        self._world = trainer.world
        self._trainer = trainer
        self._use_executor(trainer.device)
        return self

    def _use_executor(self, device: torch.device) -> None:
        if device.type == "cuda":
            self._sync = lambda: torch.cuda.synchronize(device)
        executor = self.cfg.executor
        if executor == "auto":
            executor = "stream" if device.type == "cuda" else "thread"
        if executor == "stream":
            self._devmod = torch.get_device_module(device.type)  # torch.cpu's streams are no-ops
            self._side = self._devmod.Stream(device=device) if device.type == "cuda" else self._devmod.Stream()
            self._flags = []

    def needs_plan(self) -> bool:
        return self.active and self.cfg.system == "sparetrain" and self.plan is None and self.deferrable

    def set_system(self, system: str) -> None:
        """Switch between ``none`` (no mode at all: the No-DMR baseline), ``naive`` and ``sparetrain`` between
        steps (benchmarks alternate systems on one trainer)."""
        self._state_event("write")  # (other systems update the state without the held path's copies)
        self.cfg.system = system
        self.active = system != "none"
        self._set_early_stop()

    def _set_early_stop(self) -> None:
        """torch's checkpoint stops recomputing after the last tensor autograd saved, unless P-DMR needs the rest of
        a segment run once more (a plan whose segments' tails are not checked by other strategies, or no plan).
        Naive-Only checks every op where it runs: a recompute past the last saved tensor would only cost it time."""
        if self._model is not None:
            plan = self._plan
            stop = not self.active or self._profiling or self.cfg.system == "naive" or (
                plan is not None and plan.pdmr_early_stop)
            set_checkpoint_early_stop(self._model, stop)

    def detach(self) -> None:
        self.settle()
        for remove in self._handles:
            remove()
        self._handles.clear()

    def _enter_module(self, name: str) -> None:
        if not self._modules and not self._segments_recomputing():
            self._micro += 1  # the root module's forward: a new micro-batch
        self._modules.append(name)

    def _pop_module(self) -> None:
        if self._modules:
            self._modules.pop()

    def _segments_recomputing(self) -> bool:
        return bool(self._segments) and self._segments[-1][1] == "recompute"

    def _set_optimizer(self, on: bool) -> None:
        self._optimizer_phase = on

    def _reset_attempt(self) -> None:
        if self._flags:  # (a failed attempt's: a held update's check still decides what the state copies hold)
            self._read_flags()
        self.update_stage = False  # set once the step's guards passed: mismatches are repaired from here on
        self.counts: Counter = Counter()
        self.mismatches: list[Mismatch] = []
        self.coverage: list[tuple[str, str, str, str, str | None]] = []  # (op id, name, phase, strategy, window)
        self._ids: Counter = Counter()
        self._windows: Counter = Counter()
        self.window_log: list[tuple[str, float, float]] = []  # (window, wait s, overrun s) of this attempt
        self.drain_s = 0.0  # time the end-of-iteration drain ran checkers on the main thread
        self._grads: dict[int, weakref.ref] = {}  # id -> a parameter's gradient (see _grad_swap)
        self._const: dict[int, weakref.ref] = {}  # id -> tensor (plain weak references, as ``_produced``)
        # storages of this attempt's outputs: address -> plain weak reference to the storage (no callback: a
        # WeakValueDictionary's cost per entry, paid by every op of the step, was 50 ms a step); an address reused by a
        # new storage fails the identity test (see _produced_here)
        self._produced: dict[int, weakref.ref] = {}
        self._seq_owner: dict[int, tuple[str, str, bool, int]] = {}  # autograd seq -> (op id, block, dynamic, micro)
        self._last_seq = -1
        self._micro = -1
        self._records: list[OpRecord] = []
        self._tapes: dict[str, Tape] = {}
        self._window_records: list[Window] = []
        self._t0 = time.perf_counter()
        self._curve: list[tuple[float, int]] = []
        self._last_op = ""
        if self.queue:
            self.queue, self.queued_bytes = [], 0
        # fingerprints taken later (:class:`_Later`) and P-DMR comparisons waiting for them, in order
        self._later_fifo: deque[_Later | tuple] = deque()
        self._later_by_storage: dict[int, list[_Later]] = {}
        self.later_bytes = 0
        for lz in getattr(self, "_carried_fifo", ()):  # (those carried from the previous iteration stay registered)
            if isinstance(lz, _Later) and lz.value is not None:
                self.later_bytes += lz.nbytes
                for t in dops.tensors(lz.value):
                    self._later_by_storage.setdefault(_storage_key(t), []).append(lz)
        # inputs queued checks keep by reference, by storage: copied before a collective is handed them (those of
        # checks carried from the previous iteration stay registered: the next transfer may reuse their buffer)
        carried = {id(d.held) for d in getattr(self, "_carried", ()) if d.held is not None}
        kept = {k: [e for e in v if id(e[0]) in carried] for k, v in getattr(self, "_kept_by_storage", {}).items()}
        self._kept_by_storage: dict[int, list[tuple]] = {k: v for k, v in kept.items() if v}
        if self.dynamic.queue:
            self.dynamic.queue.clear()
        self.dynamic.reset()

    @contextlib.contextmanager
    def step_context(self, step: int) -> Iterator[None]:
        self.step = step
        self._profiling = self.needs_plan()
        self._set_early_stop()
        self._reset_attempt()
        if not self.active:
            yield
            return
        # views skip the mode (see ops.views_past_python) where the engine would return them unchanged: not while it
        # profiles (a view's backward node names the op it views) or keeps a coverage report (which lists them), and
        # not the views a fault injector's op sites count
        past = self.cfg.views_past_python and self._plain_tensors and not self._profiling and not self.cfg.coverage
        views = dops.views_past_python(patterns_counting_views()) if past else contextlib.nullcontext()
        with _DMRMode(self), views:
            yield
        self.drain()

    # ---- where an op is ----------------------------------------------------------------------------
    def phase(self) -> str:
        if self._setup:
            return "setup"
        if self._optimizer_phase or self.update_stage:  # clipping, optimizer and schedule: the update stage
            return "optimizer"
        if self._segments_recomputing():
            return "recompute"
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        return "forward"

    def module(self) -> str:
        return self._modules[-1] if self._modules else ""

    def _block(self, path: str) -> str:
        """:meth:`_block_of`, once per module path (every op that takes an autograd node asks)."""
        block = self._blocks.get(path)
        if block is None:
            block = self._blocks[path] = self._block_of(path)
        return block

    @staticmethod
    def _block_of(path: str) -> str:
        parts = path.split(".")
        return ".".join(parts[:2]) if len(parts) >= 2 and parts[0] == "layers" else ""

    def _next_id(self, phase: str, dynamic: bool) -> str:
        return self._numbered(f"{phase}:dyn" if dynamic else phase)

    def _numbered(self, key: str) -> str:
        n = self._ids[key]
        self._ids[key] = n + 1
        return f"{key}:{n}"

    def _unowned_backward_id(self, node: Any, name: str, dynamic: bool) -> str:
        """The id of a backward op no forward op's node runs. One that autograd's gradient accumulation runs
        (``AccumulateGrad``: the ``add_`` of a later micro-batch's gradient, or the copy of a first one it may not
        take over) is numbered per parameter and op, apart from the others: whether a first gradient is copied
        depends on who else holds it (the engine's deferred checks do, a profiled step's ops do not), and counted
        with the others, that one copy shifted the id of every later backward op of the step against the plan.
        ``node``: the autograd node running (None outside one)."""
        if node is not None and node._sequence_nr() == _ACCUMULATE_SEQ:
            return self._numbered(f"backward:acc:{self._param_names.get(id(node.variable), '?')}:{name}")
        return self._next_id("backward", dynamic)

    # ---- activation-checkpoint segments (P-DMR) ---------------------------------------------------
    def _checkpoint_contexts(self):
        if not self.active:
            return contextlib.nullcontext(), contextlib.nullcontext()
        seg = _Segment(self.module(), call=self._ids["ac-call"])
        self._ids["ac-call"] += 1
        return self._segment_context(seg, "forward"), self._segment_context(seg, "recompute")

    @contextlib.contextmanager
    def _segment_context(self, seg: _Segment, mode: str) -> Iterator[None]:
        if mode == "recompute":
            seg.cursor = 0
        self._segments.append((seg, mode))
        try:
            yield
        finally:
            self._segments.pop()
            if mode == "forward" and self._profiling and seg.records:
                last = seg.records[-1][0]
                for r in reversed(self._records):
                    if r.id == last:
                        r.seg_last = True
                        break
            # every forward op P-DMR checks must have been replayed (the recompute may stop early, after the last
            # tensor autograd saved: the ops it leaves out are checked by other strategies); none may be added
            pdmr = any(r[2] is not None for r in seg.records)
            if mode == "recompute" and pdmr and not self._profiling and (
                    seg.cursor > len(seg.records) or any(r[2] is not None for r in seg.records[seg.cursor:])):
                self._mismatch(seg.records[min(seg.cursor, len(seg.records) - 1)][0], "segment", "recompute", "p-dmr",
                               f"{seg.path}: forward ran {len(seg.records)} ops, recompute {seg.cursor}")

    # ---- strategy choice -------------------------------------------------------------------------
    def strategy_for(self, op_id: str, phase: str, name: str, dynamic: bool, in_segment: bool) -> tuple[str, str | None]:
        if _is_list_update(name):
            # in-place ops over lists of tensors (the update; gradient scaling and clipping, in any phase): in
            # cache-sized pieces, at once
            return "optimizer", None
        if phase == "optimizer":
            return "naive", None
        if self.cfg.system == "naive":
            return "naive", None
        if dynamic and self.deferrable:
            return "dynamic", None
        if self.plan is not None:
            a = self.plan.assignment(op_id)
            if a is not None:
                if a.strategy in _DEFERRED:  # (an AGC segment's ops are checked by its replay in its window)
                    return a.strategy, a.window
                if a.strategy == "p-dmr" and in_segment:
                    return "p-dmr", None
                if a.strategy == "dynamic":
                    return "dynamic", None
                if phase == "backward" and self.plan.may_carry(a) and self._carrying():
                    # no window of this iteration has room for it: the next iteration's, in the time their own checks
                    # leave (the rest in its drain)
                    return "d-inter", CARRY
                return "naive", None
        if phase == "forward" and in_segment:
            return "p-dmr", None
        if self.deferrable and phase in ("forward", "backward"):
            return "d-inter", None  # no plan: the dynamic queue, checked in whatever window comes next
        return "naive", None

    # ---- execution -------------------------------------------------------------------------------
    def dispatch(self, func, args: tuple, kwargs: dict) -> Any:
        if _CHECKING.active or _INJECTING.active:  # (injecting(), read directly: every dispatched op asks)
            # a checker execution (drain runs inside the mode), or a fault injector writing its fault from a
            # hook (its reads and writes are the fault, not ops of the step): run as is
            return func(*args, **kwargs)
        inf = dops.info(func)
        if inf.plain_view and not self._profiling and not self.cfg.coverage:
            # the hot path (most dispatched ops are views): nothing to check, record or settle. A view's output
            # shares its input's storage, so it needs no entry in ``_produced`` either (see _produced_here)
            self.counts["view"] += 1
            return inf.call(*args, **kwargs)
        # everything the engine does around an op (copies, fingerprints, second executions) is invisible to
        # the fault injector; only the primary execution (:func:`_primary`) is an op of the step
        swap = self._grad_swap(func, args, kwargs) if inf.written and self.deferrable and self.cfg.swap_gradients \
            and not self._profiling else None
        before = _INJECTOR_FLAG.active
        _INJECTOR_FLAG.active = True  # (checker_execution(), without a context manager per op)
        try:
            if self._later_by_storage or self._kept_by_storage:
                # fingerprints and copies the engine takes before the op writes (the engine's work, so inside the
                # flag: a copy made for a transfer is no op of the step, and whether one is made depends on timing).
                # An op on a gradient that will be swapped writes nothing: settled only if it is not, in _dispatch
                if (inf.written and swap is None) or inf.kind == "comm":
                    self._settle_written(func, args, kwargs, every=inf.kind == "comm")
            out = self._dispatch(func, args, kwargs, swap, inf)
        finally:
            _INJECTOR_FLAG.active = before
        if self.deferrable:
            self._mark_produced(out)
        return out

    def _mark_produced(self, out: Any) -> None:
        """Record the storages of ``out``'s tensors as written in this attempt (see :meth:`_produced_here`)."""
        for t in ((out,) if type(out) is torch.Tensor else dops.tensors(out)):  # (the common case, without the walk)
            st = _storage_or_none(t)
            if st is not None:  # (a tensor without storage: nothing to keep by reference)
                self._produced[st.data_ptr()] = weakref.ref(st)

    def _dispatch(self, func, args: tuple, kwargs: dict, swap, inf: dops.OpInfo) -> Any:
        if inf.kind != "compute":
            if self._profiling and inf.kind == "comm" and not self._setup:
                return self._record(func, args, kwargs, "C", self.phase(), None, False)
            if self.cfg.coverage:
                self.coverage.append(("-", inf.name, self.phase(), inf.kind, None))
            self.counts[inf.kind] += 1
            out = _primary(func, args, kwargs, inf)
            if inf.kind == "view" and self._profiling:  # a view's backward node differentiates the op it views
                phase = self.phase()
                self._own(phase, self._last_op, False)
            return out
        phase = self.phase()
        name = inf.name
        if phase == "setup":
            op_id = self._next_id(phase, False)
            if self.cfg.coverage:
                self.coverage.append((op_id, name, phase, "naive", None))
            self.counts["naive"] += 1
            return self._naive(op_id, phase, func, args, kwargs)
        seg = self._segments[-1][0] if self._segments else None
        node = torch._C._current_autograd_node() if phase == "backward" else None
        owner = self._seq_owner.get(node._sequence_nr()) if node is not None else None
        # data-dependent ops (MoE: the experts, and the loop over the experts that got tokens) are numbered apart,
        # so that the routing does not shift the static ops' ids; their gradient ops follow them
        dynamic = (".experts." in self.module() or in_routed_region()) if phase in ("forward", "recompute") \
            else bool(owner and owner[2])
        ins = dops.call_tensors(args, kwargs)
        const = self._is_const(inf, ins)
        twin = rec = None
        if phase == "recompute" and seg is not None and not const:
            twin = seg.records[seg.cursor] if seg.cursor < len(seg.records) else None
            op_id = f"recompute:{twin[0]}" if twin else self._next_id("recompute", dynamic)
            seg.cursor += 1
            if self._profiling:
                return self._record(func, args, kwargs, "F", phase, op_id, dynamic, recompute_of=twin[0] if twin else None)
            if twin is not None and twin[2] is not None:  # the forward op's P-DMR checker execution
                out = self._pdmr_check(twin, func, args, kwargs, inf)
                if self._agc_of:
                    self._tape_alias(op_id, twin[0], out)
                return out
        else:
            op_id = self._unowned_backward_id(node, name, dynamic) if phase == "backward" and owner is None else \
                self._next_id(phase, dynamic)
        if self._profiling:
            if phase == "forward" and seg is not None and not const:
                seg.records.append((op_id, name, None))
            return self._record(func, args, kwargs, None, phase, op_id, dynamic)
        in_segment = phase == "forward" and seg is not None and not const
        strategy, window = self.strategy_for(op_id, phase, name, dynamic, in_segment)
        if const and strategy == "p-dmr":
            # computed from constants only (a mask a kernel builds once and caches): the recompute may not run
            # it again, so it is checked at once and kept out of the segment's op sequence
            strategy = "naive"
        if strategy == "optimizer" and swap is not None and \
                self._fits(dops.bytes_of(dops.tensors(args))):
            # a list op over every gradient (the pipeline's averaging, clipping): no window follows it before the
            # update, so it runs out of place and its check is carried into the next iteration (see _grad_swap)
            strategy, window = "d-inter", CARRY
        if self.cfg.coverage:
            self.coverage.append((op_id, name, phase, strategy, window))
        self.counts[strategy] += 1
        taped = strategy
        if strategy == "agc" and (dops.written_args(func, args, kwargs) or dops.random_call(inf, args, kwargs)):
            # an in-place or random op cannot be replayed from a tape (the segment reads it as a boundary input):
            # a gradient accumulated in place is swapped and checked in the segment's window, the rest at once
            strategy = taped = "naive"
            if swap is not None:
                strategy = "d-inter"
        if swap is not None and strategy not in ("d-inter", "d-intra"):
            self._settle_written(func, args, kwargs)  # (not swapped after all: it writes in place)
            swap = None
        if strategy == "p-dmr":
            out = _primary(func, args, kwargs, inf)
            # (a float tensor holds no routing decision: most outputs, known without the call)
            routing = None if type(out) is torch.Tensor and out.is_floating_point() else _routing_copy(out)
            seg.records.append((op_id, name, self._fp(out) if routing is not None else self._fp_later(out), routing))
        else:
            if in_segment:
                rec = [op_id, name, None, None]  # (checked otherwise; keeps the recompute aligned)
                seg.records.append(rec)
            if strategy == "optimizer":
                return self._verified_optimizer(op_id, phase, func, args, kwargs)
            if strategy == "agc":
                out = _primary(func, args, kwargs, inf)  # checked by its segment's replay
            elif strategy in ("d-inter", "d-intra", "dynamic"):
                out = self._defer(op_id, phase, strategy, window, func, args, kwargs, ins, swap, inf)
            else:
                out = self._naive(op_id, phase, func, args, kwargs, repair=phase == "optimizer")
        if rec is not None:
            rec[3] = _routing_copy(out)
        if twin is not None and len(twin) > 3 and twin[3] is not None and twin[2] is None:
            # checked by another strategy, but its routing must still match the forward's (see _pdmr_check)
            if not dops.bitwise_equal(_with_routing(out, twin[3]), out):
                self._mismatch(twin[0], name, "forward", "p-dmr", "forward and recompute route differently")
                out = _with_routing(out, twin[3])
        if const:
            for t in dops.tensors(out):
                self._const[id(t)] = weakref.ref(t)
        if self._agc_of:  # (both return at once for an op no AGC segment tapes)
            if phase == "recompute" and op_id.startswith("recompute:"):
                self._tape_alias(op_id, op_id[len("recompute:"):], out)
            else:
                self._tape_record(op_id, func, args, kwargs, out, taped)
        if phase == "forward":  # (the only phase _own maps)
            self._own(phase, op_id, dynamic)
        return out

    # ---- AGC segments (replayed from their boundary tensors, agc.py) ------------------------------
    def _index_plan(self) -> None:
        """Which ops each AGC segment of the plan tapes (its forward and gradient ops), and the free time later
        windows have (``_room_after``)."""
        self._agc_of: dict[str, Any] = {}
        for a in (self.plan.agc_segments if self.plan is not None else []):
            for op in (*a.forward_ops, *a.bw_ops):
                self._agc_of[op] = a
        # per window: the most time a later window of the step has beyond its planned checks (for _held_fits)
        self._room_after: dict[str, float] = {}
        room = 0.0
        for w in sorted(self.plan.windows if self.plan is not None else [], key=lambda w: -w.start_s):
            self._room_after[w.id] = room
            if not w.dynamic:
                room = max(room, w.duration_s - w.used_s)

    def _tape(self, a) -> Tape:
        tape = self._tapes.get(a.id)
        if tape is None:
            tape = self._tapes[a.id] = Tape(a.id, a.window, len(a.forward_ops) + len(a.bw_ops))
        return tape

    def _tape_record(self, op_id: str, func, args, kwargs, out, strategy: str) -> None:
        a = self._agc_of.get(op_id)
        if a is None:
            return
        if strategy == "naive" and op_id in a.ops:  # could not be taped (in place or random): others read it as boundary
            self._tape(a).seen.add(op_id)
            return
        # (the primary's fingerprints taken later, off the main thread, like the deferred checks' ones)
        self._tape(a).record(op_id, func, args, kwargs, out, self._fp_later, self._is_param, self._produced_here)

    def _tape_alias(self, op_id: str, twin: str, out) -> None:
        a = self._agc_of.get(twin)
        if a is None:
            return
        tape = self._tape(a)
        e = tape.entry_of(twin)
        if e is not None:
            tape.alias(op_id, e.out_slots, out, self._fp_later)

    def _replay(self, tape: Tape, where: str) -> None:
        found: list[str] = []

        def differs() -> None:
            if not found:  # (one detection per segment, as when the replay stops at its first difference)
                found.append(tape.seg_id)
                self._mismatch(tape.seg_id, "agc-segment", "backward", "agc", f"AGC segment {tape.seg_id} replay differs")

        # where flags are read at the verdict the replay runs to its end and each comparison leaves a flag
        agree = self._agree if self._flags is None else (
            lambda name, e, g: self._compare(name, e, g, differs) or True)
        try:
            bad = tape.replay(self._fp, agree)
        except StaleInput:
            self.counts["stale"] += 1
            self.totals["stale"] += 1
            return
        except Exception as err:  # a replay that cannot run is a detection, not a crash of the step
            bad = f"{tape.seg_id} (replay failed: {type(err).__name__})"
        self.counts[f"agc-replayed-in-{where.split(':')[0]}"] += 1
        if bad is not None:
            self._mismatch(bad, "agc-segment", "backward", "agc", f"AGC segment {tape.seg_id} replay differs")

    def _owner(self, phase: str) -> tuple[str, str, bool, int] | None:
        """For backward ops: the forward (or recompute) op whose autograd node is running."""
        if phase != "backward":
            return None
        node = torch._C._current_autograd_node()
        return self._seq_owner.get(node._sequence_nr()) if node is not None else None

    def _own(self, phase: str, op_id: str, dynamic: bool) -> None:
        """Map the autograd sequence number the op just took (if it took one) to the op. Forward ops only: under
        non-reentrant checkpointing (the only kind trainguard runs) autograd never runs a node the recompute
        creates (the recompute only supplies the saved tensors of the forward's nodes, detached), so no backward
        op would ever look a recompute's number up. ``test_op_ids`` checks that no backward op runs under one."""
        if phase != "forward":
            return
        seq = torch._C._autograd._get_sequence_nr() - 1
        if seq != self._last_seq:
            self._last_seq = seq
            self._seq_owner[seq] = (op_id, self._block(self.module()), dynamic, self._micro)

    def _is_const(self, inf: dops.OpInfo, ins: list[torch.Tensor]) -> bool:
        """An op whose tensor inputs ``ins`` are all constants of this attempt (or that has none: a factory)."""
        if inf.random:  # (by its tag: a fused attention without dropout is conservatively never a constant)
            return False
        const = self._const
        for t in ins:
            ref = const.get(id(t))
            if ref is None or ref() is not t:
                return False
        return True

    def _pdmr_check(self, twin, func, args, kwargs, inf: dops.OpInfo) -> Any:
        out = _primary(func, args, kwargs, inf)  # the recompute: the checker execution of its forward twin
        self.counts["p-dmr-checked"] += 1
        op_id, name, expect = twin[:3]
        if name != inf.name:
            self._mismatch(op_id, name, "forward", "p-dmr", f"recompute ran {func} where the forward ran {name}")
        elif (kept := twin[3] if len(twin) > 3 else None) is None and self._lazy_ok():
            # compared later, off the main thread (a window's worker or the drain), like the deferred checks
            self._later_fifo.append((op_id, name, expect, self._fp_later(out)))
        elif not self._agree(name, expect, self._fp(out)):
            self._mismatch(op_id, name, "forward", "p-dmr", "forward and recompute differ")
            if kept is not None:
                out = _with_routing(out, kept)
                # An integer output (MoE routing: top-k indices, counts) decides the shapes of what follows. The
                # step is retried anyway; continuing with the forward's routing keeps the recompute's shapes
                # what autograd saved, instead of torch.utils.checkpoint failing the step on one pipeline
                # stage while the other waits for it.
        return out

    def _copy(self, key: tuple, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` in a buffer kept across pieces and steps (no allocation per piece; the same few
        cache-sized buffers serve every piece of the update stage)."""
        buf = self._ws.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.device != t.device or \
                buf.stride() != t.stride():
            buf = self._ws[key] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        return buf.copy_(t)

    def _naive(self, op_id: str, phase: str, func, args, kwargs, repair: bool = False, read_only: tuple = ()) -> Any:
        written = dops.written_args(func, args, kwargs, skip=read_only)
        checker_args = checker_kwargs = pre = None
        third_args, third_kwargs = args, kwargs
        if written:
            if repair:  # update-stage ops: persistent workspaces
                # keyed by position and shape, not by op: consecutive pieces reuse the same (cache-resident) buffers
                copies = {id(t): self._copy((i, "checker", t.shape, t.dtype), t) for i, t in enumerate(written)}
                pre = [self._copy((i, "pre", t.shape, t.dtype), t) for i, t in enumerate(written)]
                # the inputs too: the checker and a tie-breaker must see what the primary saw, whatever happens
                # to the live tensors after it (a corrupted input would otherwise win the vote)
                read = [t for t in dops.call_tensors(args, kwargs) if id(t) not in copies and t.dim() > 0]
                ins = {id(t): self._copy((i, "input", t.shape, t.dtype), t) for i, t in enumerate(read)}
                keep_in = lambda v: ins.get(id(v), v)
                third_args, third_kwargs = dops.map_tensors(keep_in, args), dops.map_tensors(keep_in, kwargs)
                copies.update(ins)
            else:  # (persistent workspaces too: no allocation per op; nothing keeps the copy past this call)
                copies = {id(t): self._copy((i, "naive", t.shape, t.dtype), t) for i, t in enumerate(written)}
            remap = lambda v: copies.get(id(v), v)
            checker_args, checker_kwargs = dops.map_tensors(remap, args), dops.map_tensors(remap, kwargs)
        rng = _RNG(func, args, kwargs)
        out = _primary(func, args, kwargs)
        rng.rewind()  # the checker draws the same random numbers
        if written:
            out2 = func(*checker_args, **checker_kwargs)
            checked = [copies[id(t)] for t in written]
        else:
            out2 = dops.clear_unset(func, args, kwargs, func(*args, **kwargs))
        rng.forward()  # and the run continues from the state after the primary
        if not repair and self._flags is not None and self.cfg.fingerprints and _all_tensors(out):
            # (the stream executor: no host synchronisation per op; decided at the verdict, like the deferred checks)
            one = written and out is written[0] and len(written) == 1
            a, b = (written, checked) if one else ((out, written), (out2, checked)) if written else (out, out2)
            name = dops.info(func).name
            self._compare(name, self._fp(a), self._fp(b), lambda: self._mismatch(
                op_id, name, phase, "naive", "primary and checker differ"))
            return out
        if written and out is written[0] and len(written) == 1:  # in place, returning what it wrote: one comparison
            same = self._same(func, written, checked)
        else:
            same = self._same(func, out, out2) and (not written or self._same(func, written, checked))
        if same:
            return out
        if repair and written:  # update stage: restore this op's writes and run it once more (the tie-breaker)
            primary, first = [t.clone() for t in written], out
            for t, p in zip(written, pre):
                t.copy_(p)
            rng.rewind()
            out = func(*third_args, **third_kwargs)
            rng.forward()
            if self._same(func, written, primary):  # a checker fault: the primary's state, executed again
                return self._repaired(out)
            if self._same(func, written, checked):
                # The tie-breaker sides with the checker, but both read the copies of the inputs: a fault in one of
                # those copies would make them agree on a wrong result. Where a copy differs from the input (the
                # primary read the input, and nothing between changes it), the primary stands
                if all(dops.bitwise_equal(ins[id(t)], t) for t in read):
                    return self._repaired(out)  # the primary was wrong: the written state is the other two's
                self._copy_verified(written, primary)
                self.counts["checker-fault"] += 1
                self.totals["copy_faults"] += 1
                return first
        elif repair:  # update stage, out-of-place op: a third execution decides, the result goes into ``out``
            rng.rewind()
            out3 = func(*args, **kwargs)
            rng.forward()
            if self._same(func, out3, out2):
                for dst, src in zip(dops.tensors(out), dops.tensors(out3)):
                    dst.copy_(src)
                return self._repaired(out)
            if self._same(func, out3, out):
                return self._repaired(out)
        if repair:  # the update is under way: it cannot be rolled back, and three executions gave three results
            raise SuspectedHardwareFault(f"three executions of {func} in the update stage of step {self.step} all "
                                         f"differ ({op_id}): this device does not compute reliably")
        self._mismatch(op_id, dops.info(func).name, phase, "naive", "primary and checker differ" if not written else
                       "primary and checker writes differ")
        return out

    def _repaired(self, out):
        self.counts["reexecuted"] += 1
        self.totals["detected"] += 1
        self.totals["repaired_optimizer"] += 1
        return out

    def _fp(self, value) -> dops.Fingerprint:
        return dops.Fingerprint.of(value, floats=self.cfg.compare == "tolerance")

    # ---- fingerprints taken later, in the windows -------------------------------------------------------
    def _lazy_ok(self) -> bool:
        """Fingerprints go to the windows' worker only where windows exist and the plan is being followed."""
        return self.deferrable and not self._profiling and self.calibration is None

    def _fp_later(self, value) -> dops.Fingerprint | _Later:
        """``value``'s fingerprint, or a :class:`_Later` one while the outputs it holds fit half the budget (the
        other half is the deferred checks'): the checksums then run on the worker thread in the next window."""
        if not self._lazy_ok():
            return self._fp(value)
        ts = [value] if type(value) is torch.Tensor else dops.tensors(value)
        lz = _Later(value, ts)
        if self.budget_bytes and self.later_bytes + lz.nbytes > self.budget_bytes // 2:
            return self._fp(value)
        with self._lock:
            self.counts["fingerprints-later"] += 1
            self.later_bytes += lz.nbytes
            self._later_fifo.append(lz)
            for t in ts:
                self._later_by_storage.setdefault(_storage_key(t), []).append(lz)
        return lz

    def _resolve(self, x: dops.Fingerprint | _Later) -> dops.Fingerprint | None:
        """The fingerprint (None: a tensor changed in place without passing the engine, so not checkable)."""
        if not isinstance(x, _Later):
            return x
        if x.fp is None and x.value is not None:
            ts = dops.tensors(x.value)
            if self._on_side is not None:
                _record_on(self._on_side, ts)
            if any(t._version != v for t, v in zip(ts, x.versions)):
                self.counts["stale"] += 1
                self.totals["stale"] += 1
            else:
                x.fp = self._fp(x.value)
            x.value = None  # the outputs are released
            with self._lock:
                self.later_bytes -= x.nbytes
        return x.fp

    def _settle_written(self, func, args, kwargs, every: bool = False) -> None:
        """Before an op writes into tensors whose fingerprints are still to be taken: take them now; and queued
        checks that keep one of those tensors as an input get a copy of it. ``every``: all its tensor arguments
        (communication: a receive writes its buffer when the transfer completes, outside the dispatcher and without
        a version bump). An in-place op bumps the version, which would leave such a check stale (not checkable);
        it is copied instead: a check left to a later window or the drain, after an op that writes its input (the
        gradient copied back from the replicas' all-reduce into the gradients it concatenated), still runs."""
        for t in (dops.call_tensors(args, kwargs) if every else dops.written_args(func, args, kwargs)):
            key = _storage_key(t)
            waiting = self._later_by_storage.pop(key, None)
            for lz in waiting or ():
                self._resolve(lz)
            self._copy_kept(key)

    def _copy_kept(self, key: int) -> None:
        """Queued checks that keep the storage ``key`` by reference get their own copy of what they keep of it."""
        for held, ref in self._kept_by_storage.pop(key, ()):
            kept = ref()
            if kept is None or held["args"] is None:  # (already checked)
                continue
            copy = kept.clone()
            held["args"] = tree_map(lambda v, kept=kept, copy=copy: copy if v is kept else v, held["args"])
            for i, v in enumerate(held["ins"]):
                if v is kept:
                    held["ins"][i], held["versions"][i] = copy, copy._version
            self.counts["kept-input-copied"] += 1

    def _settle(self, more: Callable[[], bool] = lambda: True) -> None:
        """Take the fingerprints still to be taken and run the P-DMR comparisons waiting for them, in order,
        while ``more()`` (a window still open) says so."""
        while self._later_fifo and more():
            self._settle_one(self._later_fifo.popleft(), self._pdmr_differs)
        if not self._later_fifo and not self._carried_fifo:
            self._later_by_storage.clear()

    def _pdmr_differs(self, op_id: str, name: str) -> None:
        self._mismatch(op_id, name, "forward", "p-dmr", "forward and recompute differ")

    def _settle_one(self, item: _Later | tuple, differs: Callable[[str, str], None]) -> None:
        """Take one queued fingerprint, or run one P-DMR comparison: ``differs(op id, name)`` when the two differ."""
        if isinstance(item, _Later):
            self._resolve(item)
            return
        op_id, name, expect, got = item
        e, g = self._resolve(expect), self._resolve(got)
        if e is not None and g is not None:
            self._compare(name, e, g, lambda: differs(op_id, name))

    # ---- comparisons read at the verdict (the stream executor) -----------------------------------------
    # On a device, reading a comparison's result is a host synchronisation: the host would wait for each checker
    # instead of running ahead. With the stream executor, a comparison whose outcome only decides the verdict
    # leaves a flag on the device instead; the verdict reads them all in one transfer and acts on them in order.
    def _compare(self, name: str, expect: Any, got: Any, differs: Callable[[], None]) -> None:
        """``differs()`` when two fingerprints differ: at once, or when the verdict reads the flags."""
        if self._flags is None or self.calibration is not None:
            if not self._agree(name, expect, got):
                differs()
            return
        if isinstance(expect, _Later) or isinstance(got, _Later):
            expect, got = self._resolve(expect), self._resolve(got)
            if expect is None or got is None:
                return  # counted as stale (not checkable), never as a detection
        differ = expect.differs(got, self.rtol.get(name, 0.0))
        if isinstance(differ, torch.Tensor):
            self._flag(differ, differs)
        elif differ:
            differs()

    def _flag(self, differ: torch.Tensor, differs: Callable[[], None], agrees: Callable[[], None] | None = None) -> None:
        with self._lock:
            self._flags.append((differ, differs, agrees))

    def _read_flags(self) -> None:
        """Read the pending comparisons' flags (one device-to-host transfer) and act on each, in order."""
        if not self._flags:
            return
        flags, self._flags = self._flags, []
        values = dops.stack([f for f, _, _ in flags]).tolist()
        self.counts["flags-read"] += len(flags)
        failed: BaseException | None = None
        with _checking():  # (a held update's tie-breaker runs here: an engine execution, not an op of the step)
            for differ, (_, differs, agrees) in zip(values, flags):
                try:  # every flag is acted on (a held update's copies must follow its verdict) before one raises
                    if differ:
                        differs()
                    elif agrees is not None:
                        agrees()
                except Exception as err:
                    failed = failed or err
        if failed is not None:
            raise failed

    def _agree(self, name: str, expect: dops.Fingerprint, got: dops.Fingerprint) -> bool:
        if isinstance(expect, _Later) or isinstance(got, _Later):
            expect, got = self._resolve(expect), self._resolve(got)
            if expect is None or got is None:
                return True  # counted as stale (not checkable), never as a detection
        if self.calibration is not None:  # recording a determinism report: measure, never flag
            self.calibration[name] = max(self.calibration.get(name, 0.0), expect.gap(got))
            return True
        return expect.matches(got, self.rtol.get(name, 0.0))

    def _same(self, func, a, b) -> bool:
        if self.calibration is not None:
            name = dops.info(func).name
            self.calibration[name] = max(self.calibration.get(name, 0.0), dops.relative_gap(a, b))
            return True
        rtol = self.rtol.get(dops.info(func).name, 0.0)
        if rtol <= 0:
            return dops.checksums_equal(a, b) if self.cfg.fingerprints else dops.bitwise_equal(a, b)
        return dops.Fingerprint.of(a, floats=True).matches(dops.Fingerprint.of(b, floats=True), rtol)

    def _verified_optimizer(self, op_id: str, phase: str, func, args, kwargs) -> Any:
        """An in-place op over lists of tensors (the fused AdamW, clipping's ``_foreach_mul_``, the pipeline's
        gradient averaging ``_foreach_div_``) verified in cache-sized pieces, at once: every list argument is cut
        into flat slices of the same elements and each piece
        runs as its own call (these ops are elementwise, so each element's result is bitwise the same).
        Each piece is copied, run, checked and, on a mismatch, repaired while it is still in cache: the
        copies cost no memory bandwidth to speak of and no copy of the whole optimizer state is made. Outside the
        update stage (``phase`` other than ``optimizer``) a mismatch is reported and the iteration retried instead."""
        repair = phase == "optimizer"
        schema = func._schema.arguments
        names = [a.name for a in schema]
        bound = {n: (args[i] if i < len(args) else kwargs.get(n)) for i, n in enumerate(names)}
        lists = [n for n in names if isinstance(bound.get(n), (list, tuple)) and len(bound[n])]
        if self._can_hold(func, bound, lists):
            return self._held_optimizer(op_id, func, bound, lists)
        sliced = [n for n in lists if all(isinstance(t, torch.Tensor) and t.dim() > 0 and t.is_contiguous()
                                          and t.numel() == bound[lists[0]][i].numel() for i, t in enumerate(bound[n]))]
        params = bound[lists[0]]
        if dops.info(func).name in _FUSED_OPTIMIZERS:  # updated here, not held: copies of its state are stale now
            for n in lists:
                for t in bound[n]:
                    self._pre.pop(id(t), None)
        # a multiple of 1024 elements: every piece starts on a vector boundary, so the kernel's vectorised loop
        # and scalar tail handle the same elements as in one call (an FMA and a mul+add round differently)
        chunk = max(1024, int(self.cfg.optimizer_chunk_mb * 2**20 / 4) // 1024 * 1024)
        # the fused kernel writes the gradients only to unscale them (grad_scale): otherwise they are inputs
        read_only = ("grads",) if bound.get("grad_scale") is None and bound.get("found_inf") is None else ()
        pieces: list[tuple[int, int, int]] = []  # (tensor index, first element, end)
        for i, p in enumerate(params):
            n = p.numel() if (sliced and lists[0] in sliced) else 1
            pieces += [(i, lo, min(lo + chunk, n)) for lo in range(0, n, chunk)] if n > 1 else [(i, 0, n)]
        k = 0
        while k < len(pieces):
            group, size = [], 0
            while k < len(pieces) and (not group or size + pieces[k][2] - pieces[k][1] <= chunk):
                group.append(pieces[k])
                size += pieces[k][2] - pieces[k][1]
                k += 1
            part = dict(bound)
            for n in lists:
                if n in sliced:
                    part[n] = [bound[n][i].view(-1)[lo:hi] for i, lo, hi in group]
                else:  # (per-tensor scalars such as AdamW's step counters: one per piece, not cut)
                    part[n] = [bound[n][i] for i, _, _ in group]
            pos = tuple(part[a.name] for a in schema if not a.kwarg_only)
            kw = {a.name: part[a.name] for a in schema if a.kwarg_only and part.get(a.name) is not None}
            self._naive(f"{op_id}/{group[0][0]}.{group[0][1]}", phase, func, pos, kw, repair=repair,
                        read_only=read_only)
            self.counts["optimizer-chunks"] += 1
        return None

    # ---- the update stage's check held into the next iteration --------------------------------------------
    # The fused optimizer runs once, on the main thread; its checker runs in the next iteration's first
    # windows (or its drain), from a verified copy of the state before the update and the gradients it read.
    # When the two agree, the checker's result *is* the verified state before the next update, so no copy of
    # the optimizer state is made on the critical path. When they differ, a third execution from the same
    # copy decides; a wrong primary is written back before the next iteration's verdict, which is then a
    # retry (that iteration's forward read the wrong parameters). Before anything reads the state from
    # outside (a checkpoint, an evaluation, the end of the run) the held check is settled (:meth:`settle`).
    def _can_hold(self, func, bound, lists) -> bool:
        if not (self.deferrable and self.cfg.system == "sparetrain" and self.cfg.hold_update
                and self.cfg.fingerprints and self.cfg.compare == "bitwise" and self.calibration is None):
            return False
        if dops.info(func).name not in _FUSED_OPTIMIZERS or bound.get("grad_scale") is not None \
                or bound.get("found_inf") is not None or "grads" not in lists:
            return False
        state = [t for n in lists if n != "grads" for t in bound[n]]
        nbytes = 2 * dops.bytes_of(state)  # the copy and the checker's buffers
        return not self.budget_bytes or nbytes <= self.budget_bytes // 2

    def _held_optimizer(self, op_id: str, func, bound: dict[str, Any], lists: list[str]) -> None:
        written = [n for n in lists if n != "grads"]
        live = {n: list(bound[n]) for n in written}
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for n in written:
            small = all(t.numel() == 1 for t in live[n])
            for t in live[n]:
                kept = self._pre.get(id(t))
                if kept is None or kept[0] is not t:  # first update of this tensor: copied once
                    self._pre[id(t)] = kept = (t, torch.empty_like(t))
                    self.counts["optimizer-state-copied"] += 1
                    self._pre_start = self.step
                elif not small:
                    continue
                # (scalars the optimizer changes outside this op, its step counters, incremented by their own
                # verified op just before: the copy takes them as this call reads them)
                dst.append(kept[1])
                src.append(t.detach())
        self._copy_verified(dst, src)
        schema = func._schema.arguments
        _primary(func, tuple(bound[a.name] for a in schema if not a.kwarg_only),
                 {a.name: bound[a.name] for a in schema if a.kwarg_only and bound.get(a.name) is not None})
        keep = {n: (list(v) if isinstance(v, (list, tuple)) else v) for n, v in bound.items() if n not in written}
        # tensor hyper-parameters (lr may be a tensor the schedule changes) as this call read them; the checker and
        # the tie-breaker both read the copy, so it is verified like the state's
        hyper = [n for n, v in keep.items() if isinstance(v, torch.Tensor)]
        copies = [torch.empty_like(keep[n]) for n in hyper]
        self._copy_verified(copies, [keep[n] for n in hyper])
        keep.update(zip(hyper, copies))
        keep.update(live)
        self._held.append(_HeldUpdate(op_id, func, keep, written, self.step))
        self.counts["optimizer-held"] += 1
        return None

    def _copy_verified(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        """``dst[i].copy_(src[i])``, compared bitwise with its source afterwards. Copies of the state that the engine
        later writes back (the verified state before an update, which a rollback or a repair restores) are not
        checks but state: a fault in one would be written into the parameters and optimizer state while the
        engine reported it fixed. Copied once more where they differ; twice different, the device is suspect."""
        if not dst:
            return
        for _ in range(2):
            torch._foreach_copy_(dst, src)
            if dops.bitwise_equal(dst, src):
                return
            self.counts["copy-fault"] += 1
            self.totals["copy_faults"] += 1
        raise SuspectedHardwareFault(f"two copies of the model state in step {self.step} differ from what they copied: "
                                     "this device does not compute reliably")

    def _run_update(self, h: _HeldUpdate, state: dict[str, list[torch.Tensor]]) -> None:
        """Execute the held update on ``state`` (in place) with the inputs the primary read."""
        part = dict(h.bound)
        part.update(state)
        schema = h.func._schema.arguments
        h.func(*tuple(part[a.name] for a in schema if not a.kwarg_only),
               **{a.name: part[a.name] for a in schema if a.kwarg_only and part.get(a.name) is not None})

    def _check_held(self, before_step: int | None = None) -> None:
        """The checkers of the held updates (of steps before ``before_step``; None: all), and where one disagrees
        with its primary, the tie-breaker."""
        due = [h for h in self._held if before_step is None or h.step < before_step]
        self._held = [h for h in self._held if not (before_step is None or h.step < before_step)]
        t0 = time.perf_counter()
        for h in due:
            self._check_one(h)
        if due:
            self._held_s = time.perf_counter() - t0

    def _held_due(self) -> bool:
        return any(h.step < self.step for h in self._held)

    def _held_fits(self, more: Callable[[], bool]) -> bool:
        """Whether a window may start the previous update's held check now. On the thread executor, only while the
        window is open and its profiled end leaves room for what the last held check took: started late, it
        would outlast the window and the step would wait for it at the window's end (a copy of the optimizer
        state and a second update, the longest single check there is). Left here where a later window of the plan
        has that much free time: one of them checks it, else the drain. On a stream, as every check there, it is
        launched ahead of the wait."""
        if self._side is not None:
            return True
        if not more():
            return False
        # (where no later window has room either, here is better than the drain: the step waits only the overrun)
        return time.perf_counter() + self._held_s <= self._window_end or self._later_room < self._held_s

    def _check_one(self, h: _HeldUpdate) -> None:
        live = {n: h.bound[n] for n in h.written}
        # per live tensor (a call may cover a different subset of the parameters each step: those with gradients)
        pre = {n: [self._pre[id(t)][1] for t in live[n]] for n in h.written}
        chk = {n: [self._spare.get(id(t)) for t in live[n]] for n in h.written}
        for n in h.written:
            for i, (t, c) in enumerate(zip(live[n], chk[n])):
                if c is None:
                    chk[n][i] = self._spare[id(t)] = torch.empty_like(t)
            torch._foreach_copy_(chk[n], pre[n])
        self._run_update(h, chk)
        self.counts["optimizer-held-checked"] += 1
        if self._flags is not None:  # decided when the verdict reads the flag (nothing reads the copies before)
            differ = dops.stack([torch.ne(dops.int_view(c), dops.int_view(t)).any()
                                  for n in h.written for c, t in zip(chk[n], live[n])]).any()
            self._flag(differ, lambda: self._held_differs(h, live, pre, chk), lambda: self._held_agrees(h, live, pre, chk))
        elif all(dops.bitwise_equal(chk[n], live[n]) for n in h.written):
            self._held_agrees(h, live, pre, chk)
        else:
            self._held_differs(h, live, pre, chk)

    def _held_agrees(self, h: _HeldUpdate, live: dict, pre: dict, chk: dict) -> None:
        # the checker's result is the verified state before the next update: no copy of it is made
        for n in h.written:
            for t, c, p in zip(live[n], chk[n], pre[n]):
                self._pre[id(t)], self._spare[id(t)] = (t, c), p
                self._spare_step[id(t)] = h.step
        self._pre_start, self._spare_start = h.step + 1, h.step

    def _held_differs(self, h: _HeldUpdate, live: dict, pre: dict, chk: dict) -> None:
        # The tie-breaker runs on a verified copy of its own: ``pre`` stays the state at the start of step h.step,
        # which a rewind to that step restores (a check of it carried into the next iteration can still fail, on
        # this rank or another: two faults at once). Run in place on ``pre``, it left no copy of that state and the
        # rewind failed.
        tie = {n: [torch.empty_like(t) for t in pre[n]] for n in h.written}
        self._copy_verified([t for n in h.written for t in tie[n]], [t for n in h.written for t in pre[n]])
        self._run_update(h, tie)
        if all(dops.bitwise_equal(tie[n], chk[n]) for n in h.written):
            self._repair.append((tie, live))  # the primary was wrong: written back before the next verdict
            self.totals["repaired_optimizer"] += 1
            self._mismatch(h.op_id, dops.info(h.func).name, "optimizer", "optimizer-held",
                           f"the update of step {h.step} differs from two executions of it")
        elif all(dops.bitwise_equal(tie[n], live[n]) for n in h.written):
            self.counts["checker-fault"] += 1  # the checker was wrong: the primary and the tie-breaker agree
        else:
            self._held_fatal = (f"three executions of {dops.info(h.func).name} in the update stage of step {h.step} "
                                f"all differ ({h.op_id}): this device does not compute reliably")
            self._pre_start, self._spare_start = h.step, None  # (``pre`` is still that; the run stops at the next verdict)
            return
        # the tie-breaker's result, which the live state equals once repaired, is the verified state before the next
        # update, and ``pre`` the one before this update, as when the checker agrees
        self._held_agrees(h, live, pre, tie)

    # ---- checks carried past the update into the next iteration (``carry_last``) ---------------------------
    # The plan leaves naive the backward ops that no window follows before the update (on the first pipeline
    # stage: the last micro-batch's backward). With the update held (above), the verified state before the update
    # is kept anyway, so those checks can wait for the next iteration's first window: they run with the
    # parameters as the primary read them (the held copy), and a mismatch means the update read wrong gradients:
    # the trainer puts the state back to the start of that iteration (parameters and optimizer from the held
    # copy, the rest from its own record) and re-executes both iterations. A step after which the trainer
    # reads the state (evaluation, checkpoint, the end of the run) carries nothing.
    def _carrying(self) -> bool:
        return (self._carry_sync() and self.cfg.hold_update and self.cfg.fingerprints
                and self.cfg.compare == "bitwise" and self._hold_expected())

    def _carry_sync(self) -> bool:
        """Whether this step may carry checks on some rank (no per-rank quantity enters it: every rank agrees)."""
        return self.carry_ok and self.cfg.carry_last and self._lazy_ok() and self.cfg.system == "sparetrain"

    def _hold_expected(self) -> bool:
        """Whether this iteration's update will be held (``_can_hold``), judged before it runs (once a step: every
        backward op asks)."""
        if self._hold_memo[0] != self.step:
            self._hold_memo = (self.step, self._judge_hold())
        return self._hold_memo[1]

    def _judge_hold(self) -> bool:
        opt = getattr(self._trainer, "optimizer", None)
        if opt is None or not all(g.get("fused") for g in opt.param_groups) or \
                type(opt).__name__ not in ("Adam", "AdamW"):
            return False
        n = sum(p.numel() * p.element_size() for g in opt.param_groups for p in g["params"])
        return not self.budget_bytes or 2 * 3 * n <= self.budget_bytes // 2

    def _carried_due(self) -> bool:
        return bool(self._carried or self._carried_fifo) and self._carried_step < self.step

    def _before_update(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as it was before the held update: a parameter, or a view of one (a transposed weight), taken from
        the held copy of it; anything else as it is."""
        kept = self._pre_by_storage.get(_storage_key(t))  # (no storage: its id, never a key here)
        if kept is None:
            return t
        p, c = kept
        if t is p:
            return c
        return c.as_strided(t.size(), t.stride(), t.storage_offset() - p.storage_offset() + c.storage_offset())

    def _check_carried(self, every: bool = False, more: Callable[[], bool] = lambda: True) -> bool:
        """Run the carried checks that are due (``every``: also this iteration's) while ``more()`` (a window still
        open) says so; True if one differed."""
        if not (self._carried or self._carried_fifo) or not (every or self._carried_due()):
            return self._rewind
        while self._carried_fifo and more() and not self._rewind:  # fingerprints first: they hold outputs alive
            self._settle_one(self._carried_fifo.popleft(), self._carried_differs)
        if self._rewind or self._carried_fifo:
            return self._rewind
        self._pre_by_storage = {p.untyped_storage().data_ptr(): (p, c) for p, c in self._pre.values()}
        done = 0
        try:
            while done < len(self._carried) and more() and not self._rewind:
                self._check(self._carried[done], CARRY)
                done += 1
        finally:
            self._pre_by_storage = {}
            del self._carried[:done]
        if not self._carried:
            self.carried_bytes = 0
        return self._rewind

    def _carried_differs(self, op_id: str, name: str) -> None:
        self._mismatch(op_id, name, "forward", "carried", "forward and recompute differ (compared after the update)")
        self._rewind = True

    def restore_before_update(self, step: int) -> None:
        """Parameters and optimizer state (but its scalar step counters, which the trainer restores) back to their
        verified copies from the start of iteration ``step``: the held copy, or, when the held check of that
        update already passed on this rank, the buffer its previous copy moved to. What was pending is dropped."""
        keys = list(self._pre)
        if self._pre_start == step:
            src = [self._pre[k][1] for k in keys]
        elif self._spare_start == step:
            # only the tensors that update wrote (an expert no token reached has no gradient and is not in it: its
            # copy before the update is ``_pre``, its ``_spare`` is older)
            keys = [k for k in keys if self._spare_step.get(k) == step]
            src = [self._spare[k] for k in keys]
            for k in keys:  # the copy from the start of ``step`` is the verified state before its update again
                t, c = self._pre[k]
                self._pre[k], self._spare[k] = (t, self._spare[k]), c
                self._spare_step.pop(k, None)
            self._pre_start, self._spare_start = step, None
        else:
            raise RuntimeError(f"dmr: the state at the start of step {step} is no longer kept (two faults at once: a "
                               "wrong update and a carried check that differs); restart from the last checkpoint")
        with torch.no_grad(), _checking():  # (the engine's own work: no op of the step)
            self._copy_verified([self._pre[k][0] for k in keys], src)
        self._held, self._repair, self._carried = [], [], []
        self._carried_fifo.clear()
        self.carried_bytes, self._rewind = 0, False
        self.mismatches = []

    def _apply_repair(self) -> None:
        if self._held_fatal is not None:
            msg, self._held_fatal = self._held_fatal, None
            raise SuspectedHardwareFault(msg)
        fixes, self._repair = self._repair, []
        with torch.no_grad(), _checking():  # (the engine's own work: no op of the step)
            for fix, live in fixes:
                self._copy_verified([t for n in live for t in live[n]], [t for n in live for t in fix[n]])

    def _state_event(self, event: str) -> None:
        """The trainer's state hook: settle before a read; before a write (a load, a restore) also drop the copies
        of the state (the next update copies it again)."""
        self.settle()
        if event == "write":
            self._pre.clear()
            self._spare.clear()
            self._spare_step.clear()
            self._pre_start = self._spare_start = None

    def settle(self) -> None:
        """Check the held updates now, on this thread, and write back a repair: before anything reads the state
        from outside the training loop (a checkpoint, an evaluation, a comparison, the end of the run)."""
        sync = self._carry_sync_step is not None and self._world > 1
        if not self._held and not self._repair and self._held_fatal is None and not self._carried and \
                not self._carried_fifo and not sync:
            return
        with _checking():
            self._check_carried(every=True)
            self._read_flags()
            rewound = self._rewind
        if sync:  # a re-execution is collective: every rank learns whether some rank's carried check failed
            rewound = self._trainer.strategy.any_rank(self._trainer, rewound)
        self._carry_sync_step = None
        if not rewound:
            with _checking():
                self._check_held()
                self._read_flags()
                self._apply_repair()
        if rewound:  # the last update read wrong gradients: re-executed (through the trainer) before anything reads
            self._trainer.redo_last_step("dmr: a check carried past the last update differs")
            self.settle()  # (the re-executed step carries nothing: its held update is checked here)
        # (repaired before anything of a later step ran: a detection, nothing to re-execute)
        self.mismatches = [m for m in self.mismatches if m.strategy != "optimizer-held"]

    def _mismatch(self, op_id: str, name: str, phase: str, strategy: str, detail: str) -> None:
        with self._lock:
            self.mismatches.append(Mismatch(op_id, name, phase, strategy, detail))
            self.totals["detected"] += 1

    # ---- deferred checks (D-DMR, AGC, dynamic) -----------------------------------------------------
    def _defer(self, op_id, phase, strategy, window, func, args, kwargs, ins=None, swap=None, inf=None) -> Any:
        inf = inf if inf is not None else dops.info(func)
        if (inf.random and dops.random_call(inf, args, kwargs)) or (inf.written and dops.written_args(func, args, kwargs)):
            if swap is not None:
                return self._swapped(op_id, phase, strategy, window, swap, args, kwargs)
            # in-place and random ops are checked at once (their inputs or generator change right after)
            self.counts["naive-fallback"] += 1
            return self._naive(op_id, phase, func, args, kwargs)
        # Inputs computed in this attempt are kept by reference (the check keeps them alive until its window)
        # with their version counters: one changed in place before the check cannot be checked any more, which
        # the check reports instead of passing. Inputs from outside the attempt (a pipeline receive buffer,
        # which the next micro-batch overwrites without a version bump) are cloned; parameters are neither
        # (only the optimizer changes them, after every check has run). One pass over the inputs, each
        # storage looked up once: this runs for every deferred op on the main thread.
        kept_ins: list[torch.Tensor] = []
        versions: list[int] = []
        by_ref: list[tuple[int, torch.Tensor]] = []  # (storage, tensor) kept by reference
        clones: dict[int, torch.Tensor] | None = None
        nbytes = 0
        for t in (dops.call_tensors(args, kwargs) if ins is None else ins):
            key, mine = self._storage_of(t)
            if key not in self._param_storages:
                if mine:
                    by_ref.append((key, t))
                else:
                    clones = clones if clones is not None else {}
                    c = clones.get(id(t))
                    if c is None:
                        c = clones[id(t)] = t.clone()
                        self.counts["input-cloned"] += 1
                    t = c
                nbytes += t.nbytes
            kept_ins.append(t)
            versions.append(t._version)
        kept = (args, kwargs) if clones is None else dops.map_tensors(lambda v: clones.get(id(v), v), (args, kwargs))
        held = {"args": kept, "ins": kept_ins, "versions": versions}
        if strategy != "dynamic" and not self._fits(nbytes):
            self.counts["naive-fallback"] += 1
            return self._naive(op_id, phase, func, args, kwargs)
        t0 = time.perf_counter()
        out = _primary(func, args, kwargs, inf)
        est = time.perf_counter() - t0
        if self._sync is not None and self.plan is not None and (planned := self.plan.ops.get(op_id)) is not None:
            est = planned.time_s  # (on a device the host time is the launch's; the profile's is the kernel's)

        def run(held=held, before_update: Callable | None = None):
            try:
                args = held["args"]
                if before_update is None:
                    if any(t._version != v for t, v in zip(held["ins"], held["versions"])):
                        raise _Stale
                else:  # carried past the update: parameters as the primary read them (the update's verified copy)
                    if any(t._version != v and before_update(t) is t for t, v in zip(held["ins"], held["versions"])):
                        raise _Stale
                    args = tree_map(lambda t: before_update(t) if isinstance(t, torch.Tensor) else t, args)
                return dops.clear_unset(func, args[0], args[1], func(*args[0], **args[1]))
            finally:
                held["args"], held["ins"], held["versions"] = None, [], []  # checked: the inputs are released

        # An input kept by reference may later be handed to a collective that writes it outside the dispatcher
        # (a receive reusing the buffer), or be written in place by a later op: it is copied first (see
        # _settle_written), so the check reads the value the primary read, never a buffer being written by a
        # transfer while the worker runs.
        if self.deferrable:
            for key, t in by_ref:
                self._kept_by_storage.setdefault(key, []).append((held, weakref.ref(t)))

        # the output's fingerprint, or (``fingerprints = false``) a copy of it, counted against the budget
        expect = self._fp_later(out) if self.cfg.fingerprints else tree_map(
            lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)
        if not self.cfg.fingerprints:
            nbytes += dops.bytes_of(dops.tensors(expect))
        d = Deferred(op_id, inf.name, phase, strategy, window, run, expect, nbytes, est, held=held)
        if strategy == "dynamic":
            self.dynamic.enqueue(Entry(op_id, nbytes, est, lambda d=d: self._check(d, "dynamic")))
        else:
            self.queue.append(d)
            self.queued_bytes += nbytes
        return out

    # ---- gradients updated in place, deferred like any other op ------------------------------------------
    # Autograd accumulates each micro-batch's weight gradient into ``p.grad`` in place (``add_``), and a model or
    # strategy may scale one in place (``div_``, ``mul_``; the trainer's own strategies use one list op over every
    # gradient, checked in pieces by _verified_optimizer): checked at once, each is a copy, a second execution and
    # two checksum passes over the gradient, on the critical path. When nothing but the engine shares the
    # gradient's storage, the op runs out of place instead (same kernel, bitwise the same values) and ``p.grad``
    # takes the result's storage (``set_``, no data moved). The gradient as it was stays untouched in its old
    # storage, so the check is an ordinary deferred one: its inputs kept by reference, its output's fingerprint
    # taken later, checked in a window like the op's neighbours.
    def _grad_swap(self, func, args, kwargs) -> Any:
        """The out-of-place form of ``func`` if it updates a parameter's gradient in place and may be swapped. A
        list op (``_foreach_div_`` averaging every gradient, clipping's ``_foreach_mul_``) runs after the step's
        last window: it is swapped only where its check can be carried into the next iteration (``_carrying``) and
        the plan carries list ops (``Plan.carry_lists``: Phase 3 with an unbounded carry), and then only if every
        tensor of its list is a gradient."""
        oop = dops.out_of_place(func)
        if oop is None or not args or self._model is None:
            return None
        g = args[0]
        many = isinstance(g, (list, tuple))
        gs = list(g) if many else [g]
        if many and not (gs and self._carrying() and (self.plan is None or self.plan.carry_lists)):
            return None
        for t in gs:
            if not self._is_grad(t):
                return None
        other = args[1] if len(args) > 1 else kwargs.get("other")
        if isinstance(other, torch.Tensor) and any(other.dtype != t.dtype or other.device != t.device or
                                                   (other.shape != t.shape and other.dim() != 0) for t in gs):
            return None  # (the out-of-place form would promote or broadcast differently)
        return oop

    def _fits(self, nbytes: int) -> bool:
        """A check keeping ``nbytes`` of inputs fits the memory budget with those already queued and carried."""
        return not self.budget_bytes or self.queued_bytes + self.carried_bytes + nbytes <= self.budget_bytes

    def _is_grad(self, g: Any) -> bool:
        """``g`` is a parameter's gradient, with a storage of its own (swappable)."""
        if type(g) is not torch.Tensor or g._is_view() or not g.is_contiguous() or g.requires_grad:
            return False  # (a view, e.g. DDP's gradient-as-bucket-view, shares its storage with its base)
        ref = self._grads.get(id(g))
        if ref is None or ref() is not g:
            self._grads = {id(p.grad): weakref.ref(p.grad) for p in self._model.parameters() if p.grad is not None}
            ref = self._grads.get(id(g))
        return ref is not None and ref() is g

    def _swapped(self, op_id, phase, strategy, window, oop, args, kwargs) -> torch.Tensor | None:
        g = args[0]
        many = isinstance(g, (list, tuple))
        gs = list(g) if many else [g]
        # the gradients so far: their storage is not written again (each takes the result's below). Tensors of their
        # own, not detach(): that shares g's version counter, which set_ bumps
        olds = []
        for t in gs:
            old = _alias(t)
            self._mark_produced(old)
            self._repoint(t)
            olds.append(old)
        queued = len(self.queue)
        out = self._defer(op_id, phase, strategy, window, oop, (olds if many else olds[0], *args[1:]), kwargs)
        outs = list(out) if many else [out]
        for t, o in zip(gs, outs, strict=True):
            if o.shape != t.shape or o.dtype != t.dtype:  # (excluded by _grad_swap; never silently wrong)
                raise RuntimeError(f"{oop} computed {tuple(o.shape)} {o.dtype} for a gradient of "
                                   f"{tuple(t.shape)} {t.dtype}")
            t.set_(o if o.stride() == t.stride() else o.contiguous())
        self.counts["gradient-swapped"] += len(gs)
        if window == CARRY and self.update_stage and len(self.queue) > queued:
            # made after this iteration's drain (clipping, in the update stage): straight into the carried checks
            d = self.queue.pop()
            self.queued_bytes -= d.nbytes
            self._carry([d])
        return None if many else g

    def _carry(self, ds: list[Deferred]) -> None:
        """Checks ``ds``, and the fingerprints still to be taken (with the comparisons waiting for them), carried
        into the next iteration (its windows, else its drain)."""
        for d in ds:
            d.carried, d.strategy = True, "carried"
        self._carried += ds
        self._carried_step = self.step
        self.carried_bytes += sum(d.nbytes for d in ds)
        self.counts["carried"] += len(ds)
        self._carried_fifo.extend(self._later_fifo)  # (re-registered by storage when the next attempt starts)
        self.counts["fingerprints-carried"] += len(self._later_fifo)
        self._later_fifo.clear()

    def _repoint(self, g: torch.Tensor) -> None:
        """Fingerprints still to be taken and queued checks that keep a tensor on ``g``'s storage by reference (the
        first micro-batch's gradient is the weight-gradient op's output itself, or an alias of it sharing its
        version counter) keep an alias of their own instead: the same storage, which ``g.set_`` is about to leave
        and nothing writes afterwards; their version counter is then not bumped by the ``set_``. Nothing is
        computed here."""
        key = _storage_key(g)
        aliases: dict[int, torch.Tensor] = {}

        def swap(v: torch.Tensor) -> torch.Tensor:
            if _storage_key(v) != key:
                return v
            a = aliases.get(id(v))
            if a is None:
                a = aliases[id(v)] = _alias(v)
            return a
        # A tensor already changed in place since it was kept (a copy_ into the gradient, say) stays unusable: its
        # alias gets a version it can never have, so the check still reports it stale instead of reading new values.
        for lz in self._later_by_storage.get(key, ()):
            if lz.value is not None:
                stale = [t._version != v for t, v in zip(dops.tensors(lz.value), lz.versions)]
                lz.value = dops.map_tensors(swap, lz.value)
                lz.versions = [-1 if s else t._version for t, s in zip(dops.tensors(lz.value), stale)]
        for held, _ in self._kept_by_storage.get(key, ()):
            if held["args"] is not None:
                stale = [t._version != v for t, v in zip(held["ins"], held["versions"])]
                held["args"] = dops.map_tensors(swap, held["args"])
                held["ins"] = [swap(v) for v in held["ins"]]
                held["versions"] = [-1 if s else v._version for v, s in zip(held["ins"], stale)]
        for tape in self._tapes.values():
            tape.repoint(key, swap)

    def _produced_here(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in a storage an op of this attempt wrote (its output, or any view or alias of it:
        ``detach`` and ``_unsafe_view`` included, whose outputs autograd does not tie to their inputs)."""
        return self._storage_of(t)[1]

    def _storage_of(self, t: torch.Tensor) -> tuple[int, bool]:
        """``t``'s storage key (see ``ops.storage_key``) and whether an op of this attempt wrote that storage. The
        storage's Python object lives exactly as long as the storage (torch keeps one per storage), so the weak
        reference kept for it dies with it, and a new storage at the same address is never taken for it."""
        st = _storage_or_none(t)
        if st is None:  # (a tensor without storage: nothing can write into it)
            return id(t), False
        key = st.data_ptr()
        ref = self._produced.get(key)
        return key, ref is not None and ref() is st

    def _is_param(self, t: torch.Tensor) -> bool:
        st = _storage_or_none(t)
        return st is not None and st.data_ptr() in self._param_storages

    def window(self, kind: str, wait: Callable[[], Any]) -> Any:
        """Run queued checkers while ``wait()`` waits on communication; returns what ``wait`` returns.

        The n-th wait of a kind in an attempt is window ``kind:n`` (the ids of the profile and the plan).
        Checkers planned for this window all run; unplanned ones run one by one while the window lasts, dynamic
        ones as the dynamic planner decides. The thread executor (CPU) runs them on a worker thread while this
        thread waits (a waiting thread holds no core) and joins it when the communication completes. The stream
        executor (CUDA) launches them on a side stream before the wait (a device's communication runs on its own
        stream: the host does not wait, the compute stream does), so they overlap the transfer on the device; the
        compute stream then waits for them, as the join does."""
        if not self.active:
            return wait()
        if kind == "setup":  # (a handshake some steps run and others not: its ops are checked at once, ids apart)
            self._setup = True
            try:
                return wait()
            finally:
                self._setup = False
        wid = f"{kind}:{self._windows[kind]}"
        self._windows[kind] += 1
        if self._profiling:
            if self._sync is not None:
                self._sync()  # (on a device the wait returns at once: the window is the transfer still to finish)
            t0 = time.perf_counter()
            try:
                out = wait()
                if self._sync is not None:
                    self._sync()
                return out
            finally:
                self._window_records.append(Window(wid, kind, t0 - self._t0, time.perf_counter() - t0, self._last_op,
                                                   dynamic=kind == "ep"))
        todo = [d for d in self.queue if d.window == wid] + [d for d in self.queue if d.window is None]
        tapes = [t for t in self._tapes.values() if t.window == wid and t.complete and not t.replayed]
        if not todo and not tapes and not self.dynamic.queue and not self._later_fifo and not self._held \
                and not self._carried_due():
            return wait()
        ran: list[Deferred] = []
        try:
            if self._side is not None:
                return self._window_on_stream(wid, kind, todo, tapes, ran, wait)
            return self._window_on_thread(wid, kind, todo, tapes, ran, wait)
        finally:
            done = {id(d) for d in ran}
            self.queue = [d for d in self.queue if id(d) not in done]

    def _window_on_thread(self, wid: str, kind: str, todo: list[Deferred], tapes: list[Tape], ran: list[Deferred],
                          wait: Callable[[], Any]) -> Any:
        closed = threading.Event()
        failed: list[BaseException] = []
        outer = self._outer_modes()

        def work() -> None:
            if self.cfg.checker_priority == "idle":
                _idle_priority()
            try:
                with _entered(outer), _checking():
                    self._window_checks(wid, kind, todo, tapes, ran, lambda: not closed.is_set())
            except BaseException as err:  # handed to the main thread: a checker never fails silently
                failed.append(err)

        worker = threading.Thread(target=work, daemon=True)
        w = self._plan_window(wid)
        t0 = time.perf_counter()
        self._window_end = t0 + w.duration_s if w is not None else float("inf")  # (unplanned: while open)
        self._later_room = self._room_after.get(wid, 0.0)
        worker.start()
        try:
            return wait()
        finally:
            t1 = time.perf_counter()
            closed.set()
            worker.join()
            # (window, time the communication took, time the step then waited for the worker to stop)
            self.window_log.append((wid, t1 - t0, time.perf_counter() - t1))
            if failed:
                raise failed[0]

    def _window_on_stream(self, wid: str, kind: str, todo: list[Deferred], tapes: list[Tape], ran: list[Deferred],
                          wait: Callable[[], Any]) -> Any:
        # The host cannot see when the transfer completes, so the window's length is the profiled one: unplanned
        # checkers are launched while the estimated times of all launched so far (planned ones first, which all
        # are) fit in it.
        w = self._plan_window(wid)
        length = w.duration_s if w is not None else 0.0
        self._window_spent = 0.0
        side, cur = self._side, self._devmod.current_stream()
        side.wait_stream(cur)  # the checkers read what the compute stream produced before the window
        t0 = time.perf_counter()
        failed: BaseException | None = None
        self._on_side = side if self._sync is not None else None  # (CUDA: inputs released meanwhile are recorded)
        try:
            with _checking(), self._devmod.stream(side):
                self._window_checks(wid, kind, todo, tapes, ran, lambda: self._window_spent < length)
        except BaseException as err:  # raised after the wait: the transfer is always waited for
            failed = err
        finally:
            self._on_side = None
        t1 = time.perf_counter()
        try:
            return wait()
        finally:
            cur.wait_stream(side)  # what follows on the compute stream (it may write a checked input) comes after
            # (window, time the wait took on the host, time the checkers took to launch)
            self.window_log.append((wid, time.perf_counter() - t1, t1 - t0))
            if failed is not None:
                raise failed

    def _outer_modes(self) -> list[TorchDispatchMode]:
        """The dispatch modes this thread entered before the engine's (a fault injector's, whose mode is outermost):
        the window's worker runs its checkers under them too, as the main thread runs its own checks (a new thread
        starts with no mode). Empty where the engine's mode is not entered (a window outside a step)."""
        stack = _get_current_dispatch_mode_stack()
        for i, m in enumerate(stack):
            if type(m) is _DMRMode and m.engine is self:
                return stack[:i]
        return []

    def _plan_window(self, wid: str):
        try:
            return self.plan.window(wid) if self.plan is not None else None
        except KeyError:
            return None

    def _window_checks(self, wid: str, kind: str, todo: list[Deferred], tapes: list[Tape], ran: list[Deferred],
                       more: Callable[[], bool]) -> None:
        """The checks of window ``wid``: the held update's, fingerprints still to be taken, the planned AGC replays
        and deferred checks, unplanned ones and the previous iteration's carried ones while ``more()``. On a stream
        every deferred check planned here is launched even once ``more()`` turns false (ahead of a window the host
        cannot see end); on the thread executor those left when the window closes go to later windows (below)."""
        if not self._carried_due() and self._held_fits(more):
            self._check_held(self.step)  # the previous iteration's update, once its carried checks ran
        # fingerprints taken later next: they hold outputs alive (and P-DMR comparisons wait on them)
        self._settle(more if self._side is None else (lambda: True))  # (on a stream: launched, not waited for)
        for tape in tapes:  # planned for this window: they all run
            tape.replayed = True
            self._replay(tape, kind)
        for i, d in enumerate(todo):
            if not more() and (d.window != wid or self._side is None):
                # The window closed before its planned checks were done: it was shorter than profiled, or they ran
                # slower (a host slower for a while, a shorter transfer). The step does not wait for them: they join
                # the unplanned checks, which later windows run in the time their own leave, else the drain
                # (before the verdict, as always). Their inputs stay kept meanwhile, within the memory budget
                # they were admitted under.
                with self._lock:
                    for late in todo[i:]:
                        if late.window == wid:
                            late.window = None
                            self.counts["left-to-later-windows"] += 1
                break
            self._check(d, kind)
            ran.append(d)
        # the previous iteration's carried checks, in the time left (the rest in later windows or the drain)
        if self._check_carried(more=more):
            return  # one failed: both iterations are re-executed; the held update keeps its copy
        if not self._carried_due() and self._held_due():
            if self._held_fits(more):
                self._check_held(self.step)
            else:
                self.counts["held-left-to-later-windows"] += 1
        self.dynamic.at_dynamic_window(more, wid)

    def _check(self, d: Deferred, where: str) -> None:
        if self._on_side is not None and d.held is not None:
            _record_on(self._on_side, d.held["ins"])  # released by the check while the side stream still reads them
        try:
            got = d.run(before_update=self._before_update) if d.carried else d.run()
            got = self._fp(got) if isinstance(d.expect, (dops.Fingerprint, _Later)) else got
        except _Stale:
            self.counts["stale"] += 1  # an input changed in place: not checkable, counted against coverage
            self.totals["stale"] += 1
            got = None
        except Exception as err:  # a checker that cannot run is a detection, not a crash of the step
            self._mismatch(d.op_id, d.name, d.phase, d.strategy, f"checker failed: {err}")
            got = None
        self._window_spent += d.est_s

        def differs() -> None:
            self._mismatch(d.op_id, d.name, d.phase, d.strategy, f"deferred check ({where}) differs")
            if d.carried:
                self._rewind = True

        if got is None:
            pass
        elif isinstance(d.expect, (dops.Fingerprint, _Later)):
            self._compare(d.name, d.expect, got, differs)
        elif not dops.bitwise_equal(d.expect, got):
            differs()
        with self._lock:
            if d.carried:
                self.carried_bytes -= d.nbytes
            elif d.strategy != "dynamic":
                self.queued_bytes -= d.nbytes
            self.counts[f"checked-in-{where.split(':')[0]}"] += 1

    def drain(self) -> None:
        """Run every checker still queued, on this thread (the end of the iteration: nothing is left unchecked)."""
        todo, self.queue = self.queue, []
        carry = [d for d in todo if d.window == CARRY]
        todo = [d for d in todo if d.window != CARRY] if carry else todo
        self.queued_bytes = 0
        t0 = time.perf_counter()
        try:
            with _checking():
                if self._check_carried():  # (the previous iteration's, if no window ran them)
                    return  # both iterations are re-executed: nothing else of this one needs checking
                if self._carry_sync():
                    self._carry_sync_step = self.step
                # checked in the next iteration: the checks no window followed, and the fingerprints still to be taken
                # with the P-DMR comparisons waiting for them (whether or not the plan left backward ops naive)
                if carry or (self._later_fifo and self._carrying()):
                    self._carry(carry)
                self._check_held(self.step)  # (not this iteration's own update: the next one checks it)
                self._settle()
                for d in todo:
                    self._check(d, "drain")
                for tape in self._tapes.values():
                    if not tape.replayed:
                        tape.replayed = True
                        self._replay(tape, "drain")
                self.dynamic.drain()
        finally:
            self.drain_s += time.perf_counter() - t0

    # ---- profiling -------------------------------------------------------------------------------
    def _record(self, func, args, kwargs, kind: str | None, phase: str, op_id: str | None, dynamic: bool,
                recompute_of: str | None = None) -> Any:
        if self._sync is not None:  # (a profiled attempt: the op's own time on the device, not its launch's)
            self._sync()
        t0 = time.perf_counter()
        out = _primary(func, args, kwargs)
        if self._sync is not None:
            self._sync()
        dt = time.perf_counter() - t0
        if op_id is None:  # a collective
            op_id = self._next_id("comm", False)
        ins = dops.call_tensors(args, kwargs)
        outs = dops.tensors(out)
        owner = self._owner(phase)
        if kind is None:
            kind = {"forward": "F", "recompute": "F", "optimizer": "O"}.get(phase, "B")
            if kind == "B" and any(tuple(t.shape) in self._param_shapes for t in outs) and dops.info(func).name.startswith(
                    ("aten.mm", "aten.sum", "aten.bmm", "aten.embedding_dense_backward")):
                kind = "W"
        module = self.module() if phase in ("forward", "recompute") else ""
        block = self._block(module) if module else (owner[1] if owner else "")
        seg = self._segments[-1][0] if self._segments and phase in ("forward", "recompute") else None
        rec = OpRecord(
            id=op_id, name=dops.info(func).name, phase=phase if phase != "optimizer" or self._optimizer_phase else "optimizer",
            kind=kind, module=module, block=block, ac_segment=f"{seg.path}" if seg is not None else None,
            seg_index=(len(seg.records) - 1 if phase == "forward" else seg.cursor - 1) if seg is not None else -1,
            start_s=t0 - self._t0, time_s=dt,
            in_bytes=dops.bytes_of(ins),
            out_bytes=dops.bytes_of(outs),
            param_bytes=dops.bytes_of(t for t in ins if self._is_param(t)),
            dynamic=dynamic, microbatch=max(self._micro, 0) if phase in ("forward", "recompute") else
            (owner[3] if owner else 0), grad_of=owner[0] if owner else None, recompute_of=recompute_of,
            ac_call=seg.call if seg is not None else -1)
        self._records.append(rec)
        self._last_op = op_id
        if len(self._records) % 16 == 0:
            self._curve.append((t0 - self._t0, _rss_bytes()))
        self._own(phase, op_id, dynamic)
        return out

    def finish_profile(self, trainer) -> Profile | None:
        """Record the attempt just profiled. After ``profile_steps`` of them (the first step, re-executed each time):
        the profile (:func:`median_profile` of them) and the plan made from it (kept as ``self.profile`` and
        ``self.plan``); None while more are to come."""
        curve = self._curve
        peak = max((b for _, b in curve), default=_rss_bytes())
        # The paper's budget is the device's memory: by default the checks may hold half of what is free now
        # (the rest stays for the run's own growth); the planner's count of retained inputs is conservative
        # (inputs autograd keeps anyway count too), and the peak reached is reported by bench dmr.
        headroom = int(self.cfg.memory_budget_mb * 2**20) or (_free_memory_bytes(trainer.device) // 2 or peak // 4)
        blocks = list(dict.fromkeys(r.block for r in self._records if r.block))
        self._profiled.append(Profile(model=getattr(trainer.cfg.model, "preset", ""), strategy=trainer.strategy.name,
                                      rank=trainer.rank, stage=getattr(trainer.strategy, "stage", 0),
                                      iteration_s=time.perf_counter() - self._t0, memory_budget_bytes=peak + headroom,
                                      peak_bytes=peak, memory_curve=curve or [(0.0, peak)], blocks=blocks,
                                      ops=self._records, windows=self._window_records))
        if len(self._profiled) < self.cfg.profile_steps:
            return None
        self.profile, self._profiled = median_profile(self._profiled), []
        self.profile.meta = self._fingerprint_cost(trainer.device)
        self.plan = plan_static(self.profile, self.planner_config())
        self.budget_bytes = self.budget_bytes or headroom
        self.dynamic = DynamicPlanner(int(self.plan.summary.get("dynamic_budget_bytes") or headroom))
        self._profiling = False
        self._set_early_stop()
        return self.profile

    def _fingerprint_cost(self, device: torch.device) -> dict[str, float]:
        """What this engine's fingerprint costs on ``device``, for the planner to charge the windows with: a fixed
        cost per output (the fingerprint of 4 KiB) and a cost per byte (of 32 MiB, more than a cache holds: the
        outputs a window fingerprints were written a while before), each the median of five."""
        def median_s(t: torch.Tensor) -> float:
            times = []
            for _ in range(6):
                if self._sync is not None:
                    self._sync()
                t0 = time.perf_counter()
                float(self._fp(t).sums[0])  # (waits for the device)
                times.append(time.perf_counter() - t0)
            return statistics.median(times[1:])

        with _checking(), torch.no_grad():
            small, big = torch.ones(2**10, device=device), torch.ones(2**23, device=device)
            call_s, big_s = median_s(small), median_s(big)
        return {"fingerprint_call_s": call_s,
                "fingerprint_s_per_byte": max(0.0, big_s - call_s) / (big.numel() * big.element_size())}

    def planner_config(self, phases: tuple[int, ...] | None = None) -> PlannerConfig:
        """The planner settings this engine's config implies (``phases``: the ablation's, else the config's)."""
        return PlannerConfig(phases=tuple(phases or self.cfg.phases), keep_outputs=not self.cfg.fingerprints,
                             pdmr_tail=self.cfg.pdmr_tail, window_fill=self.cfg.window_fill, carry=self.cfg.carry_budget,
                             use_dp_windows=self.cfg.dp_windows)

    # ---- reporting -------------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        out = {f"dmr_{k.replace('-', '_')}": v for k, v in self.counts.items()}
        out["dmr_detected_total"] = self.totals["detected"]
        return out

    def coverage_report(self) -> dict[str, Any]:
        """The last step's ops with their strategy and window, and the verified share of compute ops."""
        compute = [c for c in self.coverage if c[3] not in ("view", "comm", "alloc", "none")]
        verified = [c for c in compute if c[3] in ("naive", "p-dmr", "d-inter", "d-intra", "agc", "optimizer", "dynamic")]
        unchecked = self.counts["stale"]  # deferred checks whose inputs changed before their window
        by = Counter(c[3] for c in self.coverage)
        return {"ops": [{"op": c[0], "name": c[1], "phase": c[2], "strategy": c[3], "window": c[4]} for c in self.coverage],
                "compute_ops": len(compute), "verified_ops": len(verified) - unchecked, "stale": unchecked,
                "coverage": ((len(verified) - unchecked) / len(compute)) if compute else 1.0, "by_strategy": dict(by)}


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


def _primary(func, args, kwargs, inf: dops.OpInfo | None = None):
    """The op's primary execution: an op of the step as far as the fault injector is concerned. ``inf``: the op's
    :func:`~trainguard.sdc.dmr.ops.info`, where the caller has it."""
    inf = inf if inf is not None else dops.info(func)
    before = _INJECTOR_FLAG.active
    _INJECTOR_FLAG.active = False
    try:
        out = inf.call(*args, **kwargs)
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


class _UnwrappedMode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: ``__torch_dispatch__`` is not wrapped in ``torch._disable_dynamo``. trainguard never compiles a
        step (nothing in it calls ``torch.compile``), and the wrapper (two Python frames and four eval-frame
        switches) was a fifth of the cost of the mode itself on every dispatched op. This overrides a private
        hook of ``TorchDispatchMode`` (torch 2.13); ``tests/sdc/dmr/test_torch_private.py`` fails if it moves."""
        return False


class PassThroughMode(_UnwrappedMode):
    """Every op through Python and straight on to its kernel, nothing checked or kept: the floor of any verifier
    built on a Python dispatch mode, the engine's own included (``bench dmr``'s ``floor`` system, entered with
    :func:`~trainguard.sdc.dmr.ops.views_past_python` as the engine is). ``ops`` counts what reached it. Never a
    protection: nothing it sees is verified."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func._op(*args, **(kwargs or {}))  # (the C++ entry point, as the engine's primaries call it)


class _DMRMode(_UnwrappedMode):
    def __init__(self, engine: DMREngine):
        super().__init__()
        self.engine = engine

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.engine.dispatch(func, args, kwargs or {})


class DMRGuard(StepGuard):
    """Turns the engine's mismatches into a retry of the iteration (all ranks, through the trainer), and asks
    for the profiled first attempt to be re-executed with the plan made from it."""

    name = "dmr"
    inspects_update = False
    may_rewind = True  # checks carried past an update (carry_last)

    def __init__(self, engine: DMREngine):
        self.engine = engine

    def on_step_start(self, ctx) -> None:
        self.engine.carry_ok = ctx.trainer.carry_allowed(ctx.step)

    def before_update(self, ctx) -> Verdict:
        eng = self.engine
        if eng._profiling:
            done = eng.finish_profile(ctx.trainer) is not None
            return Verdict.retry(site="profile", reason="profiled this attempt (unverified); re-executed " +
                                 ("with the plan" if done else "to profile it again (profile_steps)"), planned=True)
        eng._carry_sync_step = None  # (this verdict, reduced over every rank, judges the previous step's carried checks)
        eng.drain()
        eng._read_flags()  # (the stream executor: every comparison of the iteration, in one transfer)
        if eng._rewind:  # a check carried from the previous iteration differs: its update read wrong gradients
            # (the mismatch is this attempt's: a rewind verdict on any rank rewinds every rank, see guards.worst)
            m = next(m for m in eng.mismatches if m.strategy == "carried")
            return Verdict.retry(site=m.site(), reason=f"{m.phase} op {m.name} of step {eng._carried_step} (checked "
                                 f"after its update): {m.detail}", rewind=True)
        eng._apply_repair()  # a wrong update of the previous step, written back: this iteration read it, so retry
        if eng.mismatches:
            m = eng.mismatches[0]
            return Verdict.retry(site=m.site(), reason=f"{m.phase} op {m.name} ({m.strategy}): {m.detail}")
        eng.update_stage = True  # clipping and the optimizer come next: repaired in place, not retried
        return Verdict.commit()

    def on_retry(self, ctx, verdict) -> None:
        # an update of this step that ran before the retry was rolled back with it (the trainer restored the state
        # before it, which is the engine's copy): its check is dropped, and so are the checks it carried
        eng = self.engine
        eng._held = [h for h in eng._held if h.step != ctx.step]
        if eng._carried_step == ctx.step:
            eng._carried, eng.carried_bytes = [], 0
            eng._carried_fifo.clear()

    def on_rewind(self, ctx, step: int) -> None:
        self.engine.restore_before_update(step)

    def on_error(self, ctx, err: Exception) -> Verdict | None:
        self.engine._read_flags()
        if not self.engine.mismatches:
            return None
        m = self.engine.mismatches[0]
        return Verdict.retry(site=m.site(), reason=f"{m.phase} op {m.name} ({m.strategy}) differed, then the step "
                                                   f"failed: {type(err).__name__}")


def attach(trainer, cfg: DMRConfig | None = None, plan: Plan | None = None) -> DMREngine:
    """Verify every op of ``trainer``'s iterations by DMR; returns the engine (counters, coverage)."""
    return DMREngine(cfg, plan).attach(trainer)
