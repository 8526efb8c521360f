"""The DMR engine's core (:class:`DMREngine`): wiring into the trainer, where an op is (phase, module, ids), the
strategy each op gets and its execution (naive, P-DMR), and the coverage report. Its parts, each a mixin of
``DMREngine``: the update stage (``update.py``), checks carried past the update (``carry.py``), deferred checks
(``deferred.py``), windows (``windows.py``), AGC taping (``tapes.py``), fingerprints taken later
(``fingerprints.py``), comparisons (``compare.py``) and profiling (``profiling.py``). Relies on torch.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trainguard.errors import SuspectedHardwareFault
from trainguard.faults.injector import _CHECKER as _INJECTOR_FLAG  # the flag checker_execution() sets
from trainguard.faults.injector import _INJECTING, patterns_counting_views  # (injecting()'s flag)
from trainguard.models.moe import in_routed_region
from trainguard.sdc.dmr import ops as dops
from trainguard.sdc.dmr.agc import Tape
from trainguard.sdc.dmr.config import DMRConfig
from trainguard.sdc.dmr.determinism import load_tolerances
from trainguard.sdc.dmr.dynamic import DynamicPlanner
from trainguard.sdc.dmr.engine.carry import CarriedChecks
from trainguard.sdc.dmr.engine.common import (
    _ACCUMULATE_SEQ,
    _CHECKING,
    _DEFERRED,
    _RNG,
    Deferred,
    Mismatch,
    _all_tensors,
    _is_list_update,
    _Later,
    _primary,
    _routing_copy,
    _Segment,
    _storage_key,
    _storage_or_none,
    _with_routing,
)
from trainguard.sdc.dmr.engine.compare import Comparisons
from trainguard.sdc.dmr.engine.deferred import DeferredChecks
from trainguard.sdc.dmr.engine.fingerprints import LaterFingerprints
from trainguard.sdc.dmr.engine.guard import DMRGuard
from trainguard.sdc.dmr.engine.modes import _DMRMode
from trainguard.sdc.dmr.engine.profiling import Profiling
from trainguard.sdc.dmr.engine.tapes import AGCTapes
from trainguard.sdc.dmr.engine.update import UpdateStageChecks, _HeldUpdate
from trainguard.sdc.dmr.engine.windows import WindowChecks
from trainguard.sdc.dmr.plan import CARRY, Plan
from trainguard.sdc.dmr.profile import OpRecord, Profile, Window
from trainguard.train.activation_checkpoint import add_checkpoint_context, set_checkpoint_early_stop


class DMREngine(UpdateStageChecks, CarriedChecks, DeferredChecks, WindowChecks, AGCTapes, LaterFingerprints, Comparisons,
                Profiling):
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
        # why the engine stopped the run, if it did: the state it guards is not verified from there on (see settle)
        self._failed: str | None = None
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
        self._kept_by_storage: dict[int, list[tuple]] = self._carried_registrations()
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
        self._release_attempt()

    def _release_attempt(self) -> None:
        """Drop the tables only the attempt's own ops read (their storages, autograd owners, constants, gradients,
        AGC tapes, and the registrations by storage of checks already run), as soon as the attempt's last op has run
        and its checks are drained, instead of at the next attempt's start (``_reset_attempt``, which still resets
        them). The trainer collects Python's young generation after every step (``[train] gc = "step"``), and
        everything of them still alive then was scanned: 23,000-31,000 objects a ``llama-60m`` pipeline stage, 5-28 ms
        of the main thread's CPU a step, against 0.1 ms without DMR. What checks carried into the next iteration
        keep (their inputs, their fingerprints) stays registered, as ``_reset_attempt`` keeps it."""
        self._produced, self._seq_owner, self._const, self._grads = {}, {}, {}, {}
        self._tapes = {k: t for k, t in self._tapes.items() if not t.replayed}
        self._kept_by_storage = self._carried_registrations()
        if not self._later_fifo:  # (the carried fingerprints are registered again when the next attempt starts)
            self._later_by_storage = {}

    def _carried_registrations(self) -> dict[int, list[tuple]]:
        """``_kept_by_storage`` with only the inputs of checks carried into the next iteration."""
        carried = {id(d.held) for d in getattr(self, "_carried", ()) if d.held is not None}
        return {k: kept for k, v in getattr(self, "_kept_by_storage", {}).items()
                if (kept := [e for e in v if id(e[0]) in carried])}

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

    # ---- the plan, indexed (AGC segments' ops, later windows' room) ------------------------------------
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

    # ---- autograd owners and constants ------------------------------------------------------------
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
        if repair and written:  # update stage: restore this op's writes and run it once more (a tie-breaker)
            primary, first = [t.clone() for t in written], out
            for k in range(self.cfg.tie_breakers):
                if k:  # (three results so far, all different: two faults, in the checker and a tie-breaker)
                    self._tie_breaker_again()
                for t, p in zip(written, pre):
                    t.copy_(p)
                rng.rewind()
                out = func(*third_args, **third_kwargs)
                rng.forward()
                if self._same(func, written, primary):  # a checker fault: the primary's state, executed again
                    return self._repaired(out)
                if self._same(func, written, checked):
                    # The tie-breaker sides with the checker, but both read the copies of the inputs: a fault in one
                    # of those copies would make them agree on a wrong result. Where a copy differs from the input
                    # (the primary read the input, and nothing between changes it), the primary stands
                    if all(dops.bitwise_equal(ins[id(t)], t) for t in read):
                        return self._repaired(out)  # the primary was wrong: the written state is the other two's
                    self._copy_verified(written, primary)
                    self.counts["checker-fault"] += 1
                    self.totals["copy_faults"] += 1
                    return first
                # Two tie-breakers that agree with each other decide nothing: both started from the same copy of the
                # state before the op (``pre``), so a fault in that copy makes them agree on a wrong result
        elif repair:  # update stage, out-of-place op: further executions decide, the result goes into ``out``
            seen = [out, out2]  # (every execution reads the same inputs: any two that agree decide)
            for k in range(self.cfg.tie_breakers):
                if k:
                    self._tie_breaker_again()
                rng.rewind()
                out3 = func(*args, **kwargs)
                rng.forward()
                if self._same(func, out3, out):
                    return self._repaired(out)
                if any(self._same(func, out3, o) for o in seen[1:]):
                    # (compared after copying: a fault in this copy would write a wrong value into the update's
                    # output and report it repaired)
                    self._copy_verified(list(dops.tensors(out)), list(dops.tensors(out3)))
                    return self._repaired(out)
                seen.append(out3)
        if repair:  # the update is under way: it cannot be rolled back, and no two executions agreed
            self._stop(f"{2 + self.cfg.tie_breakers} executions of {func} in the update stage of step "
                       f"{self.step} all differ ({op_id}): this device does not compute reliably")
            return out  # (several ranks: the update goes on, through its collectives; the guard stops the run after it)
        self._mismatch(op_id, dops.info(func).name, phase, "naive", "primary and checker differ" if not written else
                       "primary and checker writes differ")
        return out

    def _suspect(self, msg: str) -> SuspectedHardwareFault:
        """The error that stops the run where the engine cannot tell a right state from a wrong one (mid-update, or a
        copy of the state that would not copy): reading the state afterwards is refused, loading one is allowed."""
        self._failed = msg
        return SuspectedHardwareFault(msg)

    def _stop(self, msg: str) -> None:
        """Stop the run (:meth:`_suspect`) from where the engine found it. On several ranks the others may be in a
        collective of the update or of a pipeline transfer, waiting for this one: the stop is kept, the caller goes
        on (nothing it writes is read: the guard's next look, after the update at the latest, raises, and every rank
        stops with this one)."""
        if self._world == 1:
            raise self._suspect(msg)
        if self._held_fatal is None:
            self._held_fatal = msg

    def raise_if_stopped(self) -> None:
        """Raise the stop kept by :meth:`_stop` (or by a held check of the update that no two executions agreed on)."""
        if self._held_fatal is not None:
            msg, self._held_fatal = self._held_fatal, None
            raise self._suspect(msg)

    def _tie_breaker_again(self) -> None:
        self.counts["tie-breaker-again"] += 1
        self.totals["tie_breakers_again"] += 1

    def _repaired(self, out):
        self.counts["reexecuted"] += 1
        self.totals["detected"] += 1
        self.totals["repaired_optimizer"] += 1
        return out

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

def attach(trainer, cfg: DMRConfig | None = None, plan: Plan | None = None) -> DMREngine:
    """Verify every op of ``trainer``'s iterations by DMR; returns the engine (counters, coverage)."""
    return DMREngine(cfg, plan).attach(trainer)
