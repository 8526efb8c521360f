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
    execution (the update cannot be rolled back without a copy of the optimizer state);

* reports mismatches to its :class:`DMRGuard`: the trainer rolls the iteration back on all ranks and
  re-executes it; the same op failing again on the re-execution is reported as suspected persistent
  hardware (exit 3).

Relies on torch (``TorchDispatchMode``, autograd sequence numbers, module and optimizer hooks, threads).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from trainguard.errors import SuspectedHardwareFault
from trainguard.faults.injector import _CHECKER as _INJECTOR_FLAG  # the flag checker_execution() sets
from trainguard.faults.injector import checker_execution
from trainguard.sdc.dmr import ops as dops
from trainguard.sdc.dmr.agc import StaleInput, Tape
from trainguard.sdc.dmr.config import DMRConfig
from trainguard.sdc.dmr.determinism import load_tolerances
from trainguard.sdc.dmr.dynamic import DynamicPlanner, Entry
from trainguard.sdc.dmr.plan import Plan
from trainguard.sdc.dmr.planner import PlannerConfig, plan_static
from trainguard.sdc.dmr.profile import OpRecord, Profile, Window
from trainguard.train.activation_checkpoint import add_checkpoint_context, set_checkpoint_early_stop
from trainguard.train.guards import StepGuard, Verdict

_FUSED_OPTIMIZERS = ("aten._fused_adamw_.default", "aten._fused_adam_.default")
_CHECKING = threading.local()  # set while this thread runs deferred checkers
_DEFERRED = ("d-inter", "d-intra", "agc")


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


@dataclass
class Deferred:
    """A checker waiting for an idle window: the op, its retained inputs, the primary's fingerprint."""

    op_id: str
    name: str
    phase: str
    strategy: str
    window: str | None
    run: Callable[[], Any]
    expect: dops.Fingerprint
    nbytes: int
    est_s: float = 0.0


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
        self._modules: list[str] = []
        self._optimizer_phase = False
        self._segments: list[tuple[_Segment, str]] = []  # stack of (segment, "forward" | "recompute")
        self._handles: list[Callable[[], Any]] = []
        self.queue: list[Deferred] = []
        self.queued_bytes = 0
        self.budget_bytes = int(self.cfg.memory_budget_mb * 2**20)
        self._lock = threading.Lock()
        self.step = 0
        self._param_storages: set[int] = set()
        self._param_shapes: set[tuple] = set()
        self._ws: dict[tuple, torch.Tensor] = {}  # update-stage workspaces, reused every step
        self.deferrable = False
        self._model = None
        self.dynamic = DynamicPlanner(self.budget_bytes or 2**40)
        self._index_plan()
        self._reset_attempt()

    @property
    def plan(self) -> Plan | None:
        return self._plan

    @plan.setter
    def plan(self, plan: Plan | None) -> None:
        self._plan = plan
        self._index_plan()

    # ---- wiring ----------------------------------------------------------------------------------
    def attach(self, trainer) -> DMREngine:
        model = self._model = trainer.model
        self._param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
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
        self._handles.append(trainer.add_guard(DMRGuard(self)))
        trainer.metric_sources.append(self.metrics)
        self._world = trainer.world
        return self

    def needs_plan(self) -> bool:
        return self.active and self.cfg.system == "sparetrain" and self.plan is None and self.deferrable

    def set_system(self, system: str) -> None:
        """Switch between ``none`` (no mode at all: the No-DMR baseline), ``naive`` and ``sparetrain`` between
        steps (benchmarks alternate systems on one trainer)."""
        self.cfg.system = system
        self.active = system != "none"
        self._set_early_stop()

    def _set_early_stop(self) -> None:
        if self._model is not None:  # P-DMR needs the segment's last op replayed; profiling and No-DMR do not
            set_checkpoint_early_stop(self._model, not self.active or self._profiling)

    def detach(self) -> None:
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
        self.update_stage = False  # set once the step's guards passed: mismatches are repaired from here on
        self.counts: Counter = Counter()
        self.mismatches: list[Mismatch] = []
        self.coverage: list[tuple[str, str, str, str, str | None]] = []  # (op id, name, phase, strategy, window)
        self._ids: Counter = Counter()
        self._windows: Counter = Counter()
        self.window_log: list[tuple[str, float]] = []
        self._const: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> tensor
        self._produced: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # outputs of this attempt
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
        with _DMRMode(self):
            yield
        self.drain()

    # ---- where an op is ----------------------------------------------------------------------------
    def phase(self) -> str:
        if self._optimizer_phase or self.update_stage:  # clipping, optimizer and schedule: the update stage
            return "optimizer"
        if self._segments_recomputing():
            return "recompute"
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        return "forward"

    def module(self) -> str:
        return self._modules[-1] if self._modules else ""

    @staticmethod
    def _block_of(path: str) -> str:
        parts = path.split(".")
        return ".".join(parts[:2]) if len(parts) >= 2 and parts[0] == "layers" else ""

    def _next_id(self, phase: str, dynamic: bool) -> str:
        key = f"{phase}:dyn" if dynamic else phase
        n = self._ids[key]
        self._ids[key] = n + 1
        return f"{key}:{n}"

    # ---- activation-checkpoint segments (P-DMR) ---------------------------------------------------
    def _checkpoint_contexts(self):
        if not self.active:
            return contextlib.nullcontext(), contextlib.nullcontext()
        seg = _Segment(self.module())
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
            pdmr = any(r[2] is not None for r in seg.records)
            if mode == "recompute" and pdmr and not self._profiling and seg.cursor != len(seg.records):
                self._mismatch(seg.records[min(seg.cursor, len(seg.records) - 1)][0], "segment", "recompute", "p-dmr",
                               f"{seg.path}: forward ran {len(seg.records)} ops, recompute {seg.cursor}")

    # ---- strategy choice -------------------------------------------------------------------------
    def strategy_for(self, op_id: str, phase: str, name: str, dynamic: bool, in_segment: bool) -> tuple[str, str | None]:
        if phase == "optimizer":  # (ops over lists of tensors: in cache-sized pieces)
            return ("optimizer" if name in _FUSED_OPTIMIZERS or (name.startswith("aten._foreach_") and
                    name.split(".")[1].endswith("_")) else "naive"), None
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
                return "naive", None
        if phase == "forward" and in_segment:
            return "p-dmr", None
        if self.deferrable and phase in ("forward", "backward"):
            return "d-inter", None  # no plan: the dynamic queue, checked in whatever window comes next
        return "naive", None

    # ---- execution -------------------------------------------------------------------------------
    def dispatch(self, func, args: tuple, kwargs: dict) -> Any:
        if getattr(_CHECKING, "active", False):  # a checker execution (drain runs inside the mode): run as is
            return func(*args, **kwargs)
        # everything the engine does around an op (copies, fingerprints, second executions) is invisible to
        # the fault injector; only the primary execution (:func:`_primary`) is an op of the step
        before = getattr(_INJECTOR_FLAG, "active", False)
        _INJECTOR_FLAG.active = True  # (checker_execution(), without a context manager per op)
        try:
            out = self._dispatch(func, args, kwargs)
        finally:
            _INJECTOR_FLAG.active = before
        if self.deferrable:
            for t in dops.tensors(out):
                self._produced[id(t)] = t
        return out

    def _dispatch(self, func, args: tuple, kwargs: dict) -> Any:
        inf = dops.info(func)
        if inf.kind != "compute":
            if self._profiling and inf.kind == "comm":
                return self._record(func, args, kwargs, "C", self.phase(), None, False)
            if self.cfg.coverage:
                self.coverage.append(("-", inf.name, self.phase(), inf.kind, None))
            self.counts[inf.kind] += 1
            out = _primary(func, args, kwargs)
            if inf.kind == "view" and self._profiling:  # a view's backward node differentiates the op it views
                phase = self.phase()
                self._own(phase, self._last_op, False)
            return out
        phase = self.phase()
        name = inf.name
        seg = self._segments[-1][0] if self._segments else None
        owner = self._owner(phase)
        dynamic = ".experts." in self.module() if phase in ("forward", "recompute") else bool(owner and owner[2])
        const = self._is_const(inf, args, kwargs)
        if phase == "recompute" and seg is not None and not const:
            twin = seg.records[seg.cursor] if seg.cursor < len(seg.records) else None
            op_id = f"recompute:{twin[0]}" if twin else self._next_id("recompute", dynamic)
            seg.cursor += 1
            if self._profiling:
                return self._record(func, args, kwargs, "F", phase, op_id, dynamic, recompute_of=twin[0] if twin else None)
            if twin is not None and twin[2] is not None:  # the forward op's P-DMR checker execution
                out = self._pdmr_check(twin, func, args, kwargs)
                self._tape_alias(op_id, twin[0], out)
                return out
        else:
            op_id = self._next_id(phase, dynamic)
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
        if self.cfg.coverage:
            self.coverage.append((op_id, name, phase, strategy, window))
        self.counts[strategy] += 1
        if strategy == "agc" and (dops.written_args(func, args, kwargs) or inf.random):
            strategy = "naive"  # an in-place or random op cannot be replayed from a tape: checked at once
        if strategy == "p-dmr":
            out = _primary(func, args, kwargs)
            seg.records.append((op_id, name, self._fp(out)))
        else:
            if in_segment:
                seg.records.append((op_id, name, None))  # (checked otherwise; keeps the recompute aligned)
            if strategy == "optimizer":
                return self._verified_optimizer(op_id, func, args, kwargs)
            if strategy == "agc":
                out = _primary(func, args, kwargs)  # checked by its segment's replay
            elif strategy in ("d-inter", "d-intra", "dynamic"):
                out = self._defer(op_id, phase, strategy, window, func, args, kwargs)
            else:
                out = self._naive(op_id, phase, func, args, kwargs, repair=phase == "optimizer")
        if const:
            for t in dops.tensors(out):
                self._const[id(t)] = t
        if phase == "recompute" and op_id.startswith("recompute:"):
            self._tape_alias(op_id, op_id[len("recompute:"):], out)
        else:
            self._tape_record(op_id, func, args, kwargs, out, strategy)
        self._own(phase, op_id, dynamic)
        return out

    # ---- AGC segments (replayed from their boundary tensors, agc.py) ------------------------------
    def _index_plan(self) -> None:
        """Which ops each AGC segment of the plan tapes (its forward and gradient ops)."""
        self._agc_of: dict[str, Any] = {}
        for a in (self.plan.agc_segments if self.plan is not None else []):
            for op in (*a.forward_ops, *a.bw_ops):
                self._agc_of[op] = a

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
        self._tape(a).record(op_id, func, args, kwargs, out, self._fp, self._is_param, self._produced_here)

    def _tape_alias(self, op_id: str, twin: str, out) -> None:
        a = self._agc_of.get(twin)
        if a is None:
            return
        tape = self._tape(a)
        e = tape.entry_of(twin)
        if e is not None:
            tape.alias(op_id, e.out_slots, out, self._fp)

    def _replay(self, tape: Tape, where: str) -> None:
        try:
            bad = tape.replay(self._fp, self._agree)
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
        """Map the autograd sequence number the op just took (if it took one) to the op."""
        if phase not in ("forward", "recompute"):
            return
        seq = torch._C._autograd._get_sequence_nr() - 1
        if seq != self._last_seq:
            self._last_seq = seq
            self._seq_owner[seq] = (op_id, self._block_of(self.module()), dynamic, self._micro)

    def _is_const(self, inf: dops.OpInfo, args, kwargs) -> bool:
        """An op whose tensor inputs are all constants of this attempt (or that has none: a factory)."""
        if inf.random:
            return False
        return all(self._const.get(id(t)) is t for t in dops.tensors((args, kwargs)))

    def _pdmr_check(self, twin, func, args, kwargs) -> Any:
        out = _primary(func, args, kwargs)  # the recompute: the checker execution of its forward twin
        self.counts["p-dmr-checked"] += 1
        op_id, name, expect = twin
        if name != dops.info(func).name:
            self._mismatch(op_id, name, "forward", "p-dmr", f"recompute ran {func} where the forward ran {name}")
        elif not self._agree(name, expect, self._fp(out)):
            self._mismatch(op_id, name, "forward", "p-dmr", "forward and recompute differ")
        self._own("recompute", f"recompute:{op_id}", False)
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
                ins = {id(t): self._copy((i, "input", t.shape, t.dtype), t) for i, t in
                       enumerate(t for t in dops.tensors((args, kwargs)) if id(t) not in copies and t.dim() > 0)}
                keep_in = lambda v: ins.get(id(v), v) if isinstance(v, torch.Tensor) else v
                third_args, third_kwargs = tree_map(keep_in, args), tree_map(keep_in, kwargs)
                copies.update(ins)
            else:
                copies = {id(t): t.clone() for t in written}
            remap = lambda v: copies.get(id(v), v) if isinstance(v, torch.Tensor) else v
            checker_args, checker_kwargs = tree_map(remap, args), tree_map(remap, kwargs)
        rng = _RNG(func, args, kwargs)
        out = _primary(func, args, kwargs)
        rng.rewind()  # the checker draws the same random numbers
        if written:
            out2 = func(*checker_args, **checker_kwargs)
            checked = [copies[id(t)] for t in written]
        else:
            out2 = func(*args, **kwargs)
        rng.forward()  # and the run continues from the state after the primary
        same = self._same(func, out, out2) and (not written or self._same(func, written, checked))
        if same:
            return out
        if repair and written:  # update stage: restore this op's writes and run it once more (the tie-breaker)
            primary = [t.clone() for t in written]
            for t, p in zip(written, pre):
                t.copy_(p)
            rng.rewind()
            out = func(*third_args, **third_kwargs)
            rng.forward()
            if self._same(func, written, checked) or self._same(func, written, primary):
                # two of three executions agree: the written state is theirs (a checker fault keeps the primary)
                return self._repaired(out)
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

    def _agree(self, name: str, expect: dops.Fingerprint, got: dops.Fingerprint) -> bool:
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
            return dops.bitwise_equal(a, b)
        return dops.Fingerprint.of(a, floats=True).matches(dops.Fingerprint.of(b, floats=True), rtol)

    def _verified_optimizer(self, op_id: str, func, args, kwargs) -> Any:
        """An update-stage op over lists of tensors (the fused AdamW, clipping's ``_foreach_mul_``) verified in
        cache-sized pieces: every list argument is cut into flat slices of the same elements and each piece
        runs as its own call (these ops are elementwise, so each element's result is bitwise the same).
        Each piece is copied, run, checked and, on a mismatch, repaired while it is still in cache: the
        copies cost no memory bandwidth to speak of and no copy of the whole optimizer state is made."""
        schema = func._schema.arguments
        names = [a.name for a in schema]
        bound = {n: (args[i] if i < len(args) else kwargs.get(n)) for i, n in enumerate(names)}
        lists = [n for n in names if isinstance(bound.get(n), (list, tuple)) and len(bound[n])]
        sliced = [n for n in lists if all(isinstance(t, torch.Tensor) and t.dim() > 0 and t.is_contiguous()
                                          and t.numel() == bound[lists[0]][i].numel() for i, t in enumerate(bound[n]))]
        params = bound[lists[0]]
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
            self._naive(f"{op_id}/{group[0][0]}.{group[0][1]}", "optimizer", func, pos, kw, repair=True,
                        read_only=read_only)
            self.counts["optimizer-chunks"] += 1
        return None

    def _mismatch(self, op_id: str, name: str, phase: str, strategy: str, detail: str) -> None:
        with self._lock:
            self.mismatches.append(Mismatch(op_id, name, phase, strategy, detail))
            self.totals["detected"] += 1

    # ---- deferred checks (D-DMR, AGC, dynamic) -----------------------------------------------------
    def _defer(self, op_id, phase, strategy, window, func, args, kwargs) -> Any:
        written = dops.written_args(func, args, kwargs)
        if written or dops.info(func).random:
            # in-place and random ops are checked at once (their inputs or generator change right after)
            self.counts["naive-fallback"] += 1
            return self._naive(op_id, phase, func, args, kwargs)
        # Inputs computed in this attempt are kept by reference (the check keeps them alive until its window)
        # with their version counters: one changed in place before the check cannot be checked any more, which
        # the check reports instead of passing. Inputs from outside the attempt (a pipeline receive buffer,
        # which the next micro-batch overwrites without a version bump) are cloned; parameters are neither
        # (only the optimizer changes them, after every check has run).
        keep = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and not self._is_param(t)
                        and not self._produced_here(t) else t, (args, kwargs))
        ins = dops.tensors(keep)
        versions = [t._version for t in ins]
        nbytes = sum(t.numel() * t.element_size() for t in ins if not self._is_param(t))
        if strategy != "dynamic" and self.budget_bytes and self.queued_bytes + nbytes > self.budget_bytes:
            self.counts["naive-fallback"] += 1
            return self._naive(op_id, phase, func, args, kwargs)
        t0 = time.perf_counter()
        out = _primary(func, args, kwargs)
        est = time.perf_counter() - t0
        def run(keep=keep, ins=ins, versions=versions):
            if any(t._version != v for t, v in zip(ins, versions)):
                raise _Stale
            return func(*keep[0], **keep[1])

        d = Deferred(op_id, dops.info(func).name, phase, strategy, window, run, self._fp(out), nbytes, est)
        if strategy == "dynamic":
            self.dynamic.enqueue(Entry(op_id, nbytes, est, lambda d=d: self._check(d, "dynamic")))
        else:
            self.queue.append(d)
            self.queued_bytes += nbytes
        return out

    def _produced_here(self, t: torch.Tensor) -> bool:
        base = t._base if t._base is not None else t
        return self._produced.get(id(base)) is base

    def _is_param(self, t: torch.Tensor) -> bool:
        try:
            return t.untyped_storage().data_ptr() in self._param_storages
        except RuntimeError:
            return False

    def window(self, kind: str, wait: Callable[[], Any]) -> Any:
        """Run queued checkers while ``wait()`` blocks on communication; returns what ``wait`` returns.

        The n-th wait of a kind in an attempt is window ``kind:n`` (the ids of the profile and the plan).
        Checkers planned for this window all run; unplanned ones run one by one until the communication
        completes, dynamic ones as the dynamic planner decides. On CPU they run on a worker thread (the
        waiting thread holds no core); on CUDA they would run on a side stream."""
        if not self.active:
            return wait()
        wid = f"{kind}:{self._windows[kind]}"
        self._windows[kind] += 1
        if self._profiling:
            t0 = time.perf_counter()
            try:
                return wait()
            finally:
                self._window_records.append(Window(wid, kind, t0 - self._t0, time.perf_counter() - t0, self._last_op,
                                                   dynamic=kind == "ep"))
        todo = [d for d in self.queue if d.window == wid] + [d for d in self.queue if d.window is None]
        tapes = [t for t in self._tapes.values() if t.window == wid and t.complete and not t.replayed]
        if not todo and not tapes and not self.dynamic.queue:
            return wait()
        closed = threading.Event()
        ran: list[Deferred] = []

        def work() -> None:
            _CHECKING.active = True
            with checker_execution():
                for tape in tapes:  # planned for this window: they all run
                    tape.replayed = True
                    self._replay(tape, kind)
                for d in todo:
                    if closed.is_set() and d.window != wid:
                        break
                    self._check(d, kind)
                    ran.append(d)
                self.dynamic.at_dynamic_window(lambda: not closed.is_set(), wid)

        worker = threading.Thread(target=work, daemon=True)
        t0 = time.perf_counter()
        worker.start()
        try:
            return wait()
        finally:
            self.window_log.append((wid, time.perf_counter() - t0))
            closed.set()
            worker.join()
            done = {id(d) for d in ran}
            self.queue = [d for d in self.queue if id(d) not in done]

    def _check(self, d: Deferred, where: str) -> None:
        try:
            got = self._fp(d.run())
        except _Stale:
            self.counts["stale"] += 1  # an input changed in place: not checkable, counted against coverage
            self.totals["stale"] += 1
            got = None
        except Exception as err:  # a checker that cannot run is a detection, not a crash of the step
            self._mismatch(d.op_id, d.name, d.phase, d.strategy, f"checker failed: {err}")
            got = None
        if got is not None and not self._agree(d.name, d.expect, got):
            self._mismatch(d.op_id, d.name, d.phase, d.strategy, f"deferred check ({where}) differs")
        with self._lock:
            if d.strategy != "dynamic":
                self.queued_bytes -= d.nbytes
            self.counts[f"checked-in-{where.split(':')[0]}"] += 1

    def drain(self) -> None:
        """Run every checker still queued, on this thread (the end of the iteration: nothing is left unchecked)."""
        todo, self.queue = self.queue, []
        self.queued_bytes = 0
        _CHECKING.active = True
        try:
            with checker_execution():
                for d in todo:
                    self._check(d, "drain")
                for tape in self._tapes.values():
                    if not tape.replayed:
                        tape.replayed = True
                        self._replay(tape, "drain")
                self.dynamic.drain()
        finally:
            _CHECKING.active = False

    # ---- profiling -------------------------------------------------------------------------------
    def _record(self, func, args, kwargs, kind: str | None, phase: str, op_id: str | None, dynamic: bool,
                recompute_of: str | None = None) -> Any:
        t0 = time.perf_counter()
        out = _primary(func, args, kwargs)
        dt = time.perf_counter() - t0
        if op_id is None:  # a collective
            op_id = self._next_id("comm", False)
        ins = dops.tensors((args, kwargs))
        outs = dops.tensors(out)
        owner = self._owner(phase)
        if kind is None:
            kind = {"forward": "F", "recompute": "F", "optimizer": "O"}.get(phase, "B")
            if kind == "B" and any(tuple(t.shape) in self._param_shapes for t in outs) and dops.info(func).name.startswith(
                    ("aten.mm", "aten.sum", "aten.bmm", "aten.embedding_dense_backward")):
                kind = "W"
        module = self.module() if phase in ("forward", "recompute") else ""
        block = self._block_of(module) if module else (owner[1] if owner else "")
        seg = self._segments[-1][0] if self._segments and phase in ("forward", "recompute") else None
        rec = OpRecord(
            id=op_id, name=dops.info(func).name, phase=phase if phase != "optimizer" or self._optimizer_phase else "optimizer",
            kind=kind, module=module, block=block, ac_segment=f"{seg.path}" if seg is not None else None,
            seg_index=(len(seg.records) - 1 if phase == "forward" else seg.cursor - 1) if seg is not None else -1,
            start_s=t0 - self._t0, time_s=dt,
            in_bytes=sum(t.numel() * t.element_size() for t in ins),
            out_bytes=sum(t.numel() * t.element_size() for t in outs),
            param_bytes=sum(t.numel() * t.element_size() for t in ins if self._is_param(t)),
            dynamic=dynamic, microbatch=max(self._micro, 0) if phase in ("forward", "recompute") else
            (owner[3] if owner else 0), grad_of=owner[0] if owner else None, recompute_of=recompute_of)
        self._records.append(rec)
        self._last_op = op_id
        if len(self._records) % 16 == 0:
            self._curve.append((t0 - self._t0, _rss_bytes()))
        self._own(phase, op_id, dynamic)
        return out

    def finish_profile(self, trainer) -> Profile:
        """The profile of the attempt just recorded, and the plan made from it (kept as ``self.plan``)."""
        curve = self._curve
        peak = max((b for _, b in curve), default=_rss_bytes())
        headroom = int(self.cfg.memory_budget_mb * 2**20) or peak // 4
        blocks = list(dict.fromkeys(r.block for r in self._records if r.block))
        self.profile = Profile(model=getattr(trainer.cfg.model, "preset", ""), strategy=trainer.strategy.name,
                               rank=trainer.rank, stage=getattr(trainer.strategy, "stage", 0),
                               iteration_s=time.perf_counter() - self._t0, memory_budget_bytes=peak + headroom,
                               peak_bytes=peak, memory_curve=curve or [(0.0, peak)], blocks=blocks,
                               ops=self._records, windows=self._window_records)
        self.plan = plan_static(self.profile, PlannerConfig(phases=tuple(self.cfg.phases)))
        self.budget_bytes = self.budget_bytes or headroom
        self.dynamic = DynamicPlanner(int(self.plan.summary.get("dynamic_budget_bytes") or headroom))
        self._profiling = False
        self._set_early_stop()
        return self.profile

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


def _primary(func, args, kwargs):
    """The op's primary execution: an op of the step as far as the fault injector is concerned."""
    before = getattr(_INJECTOR_FLAG, "active", False)
    _INJECTOR_FLAG.active = False
    try:
        return func(*args, **kwargs)
    finally:
        _INJECTOR_FLAG.active = before


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


class _DMRMode(TorchDispatchMode):
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

    def __init__(self, engine: DMREngine):
        self.engine = engine

    def before_update(self, ctx) -> Verdict:
        eng = self.engine
        if eng._profiling:
            eng.finish_profile(ctx.trainer)
            return Verdict.retry(site="profile", reason="profiled this attempt (unverified); re-executed with the plan")
        eng.drain()
        if eng.mismatches:
            m = eng.mismatches[0]
            return Verdict.retry(site=m.site(), reason=f"{m.phase} op {m.name} ({m.strategy}): {m.detail}")
        eng.update_stage = True  # clipping and the optimizer come next: repaired in place, not retried
        return Verdict.commit()

    def on_error(self, ctx, err: Exception) -> Verdict | None:
        if not self.engine.mismatches:
            return None
        m = self.engine.mismatches[0]
        return Verdict.retry(site=m.site(), reason=f"{m.phase} op {m.name} ({m.strategy}) differed, then the step "
                                                   f"failed: {type(err).__name__}")


def attach(trainer, cfg: DMRConfig | None = None, plan: Plan | None = None) -> DMREngine:
    """Verify every op of ``trainer``'s iterations by DMR; returns the engine (counters, coverage)."""
    return DMREngine(cfg, plan).attach(trainer)
