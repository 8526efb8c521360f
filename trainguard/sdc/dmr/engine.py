"""The DMR execution engine: one ``TorchDispatchMode`` sees every op of an iteration and has each verified
by exactly one strategy.

Attach with :func:`attach` (or ``[sdc.dmr] enabled = true``). The engine then

* enters its dispatch mode around every attempt of a step (a Trainer step context, *inside* the fault
  injector's, so a fault corrupts the primary execution before it is compared; checker executions run
  under ``trainguard.faults.checker_execution`` and are invisible to the injector);
* knows the phase of each op: ``forward``, ``recompute`` (inside an activation-checkpoint recompute, through a
  checkpoint context it registers), ``backward`` (inside an autograd graph task) or ``optimizer`` (between
  the optimizer's step hooks); and the leaf module and transformer block of forward ops (module hooks);
* verifies each compute op (views, collectives and allocations are never re-executed, see ``ops.py``) by
  one strategy:

  - **naive**: re-executed at once on the same inputs (mutated inputs cloned first), outputs compared;
  - **p-dmr**: ops of activation-checkpointed segments: the forward records a fingerprint per op, the
    recompute in backward (with early stop off, so every op including the segment's last one is
    replayed) is the checker execution and is compared op by op; a different op sequence is a detection;
  - **d-inter / d-intra**: deferred: inputs retained (cloned), the output's fingerprint kept, the checker
    runs later in an idle window (:meth:`DMREngine.window`: a pipeline transfer or an expert all-to-all),
    on a worker thread (CPU) or a side stream (CUDA) while the main thread waits on the communication;
    within the memory budget, else run at once (naive);
  - **optimizer**: the fused AdamW update is verified in chunks (pre-state kept per chunk): a mismatch
    restores the chunk and re-executes it (a third execution breaks the tie), so no copy of the whole
    optimizer state is ever needed;

* reports mismatches to its :class:`DMRGuard`, a step guard: the trainer rolls the iteration back on all
  ranks and re-executes it; the same op failing again on the re-execution is reported as suspected
  persistent hardware (exit 3).

Counters (``dmr_*`` metrics) count verified ops per strategy, detections and re-executions. With
``coverage`` on, the last step's per-op report lists each op, its strategy and window.
Relies on torch (``TorchDispatchMode``, module and optimizer hooks, threads / CUDA streams).
"""

from __future__ import annotations

import contextlib
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
from trainguard.faults.injector import checker_execution
from trainguard.sdc.dmr import ops as dops
from trainguard.sdc.dmr.config import DMRConfig
from trainguard.train.activation_checkpoint import add_checkpoint_context, set_checkpoint_early_stop
from trainguard.train.guards import StepGuard, Verdict

_FUSED_OPTIMIZERS = ("aten._fused_adamw_.default", "aten._fused_adam_.default")
_CHECKING = threading.local()  # set while this thread runs deferred checkers


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
    """One execution of an activation-checkpointed module: its forward ops' fingerprints, in order."""

    path: str
    records: list[tuple[str, str, dops.Fingerprint]] = field(default_factory=list)  # (op id, name, fingerprint)
    cursor: int = 0


@dataclass
class Deferred:
    """A checker execution waiting for an idle window: the op, its retained inputs, the primary's fingerprint."""

    op_id: str
    name: str
    phase: str
    strategy: str
    window: str | None
    run: Callable[[], Any]
    expect: dops.Fingerprint
    nbytes: int
    est_s: float = 0.0


class DMREngine:
    def __init__(self, cfg: DMRConfig | None = None, plan=None):
        self.cfg = (cfg or DMRConfig(enabled=True)).validate()
        self.plan = plan  # trainguard.sdc.dmr.plan.Plan or None (default policy)
        self.active = self.cfg.system != "none"
        self.rtol: dict[str, float] = {}  # tolerance mode: per op name (from a determinism report)
        self.totals: Counter = Counter()  # over the run
        self.mismatches: list[Mismatch] = []  # this attempt
        self.coverage: list[tuple[str, str, str, str, str | None]] = []  # (op id, name, phase, strategy, window)
        self._reset_attempt()
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
        self.deferrable = False
        self._model = None

    # ---- wiring ----------------------------------------------------------------------------------
    def attach(self, trainer) -> DMREngine:
        model = self._model = trainer.model
        self._param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        names = {m: n for n, m in model.named_modules()}
        for m, n in names.items():
            self._handles.append(m.register_forward_pre_hook(lambda mod, inp, n=n: self._modules.append(n)).remove)
            self._handles.append(m.register_forward_hook(lambda mod, inp, out: self._pop_module()).remove)
        # the recompute replays every op, the segment's last included (P-DMR compares it with the forward)
        set_checkpoint_early_stop(model, not self.active)
        self._handles.append(add_checkpoint_context(model, self._checkpoint_contexts))
        opt = trainer.optimizer
        self._handles.append(opt.register_step_pre_hook(lambda *a: self._set_optimizer(True)).remove)
        self._handles.append(opt.register_step_post_hook(lambda *a: self._set_optimizer(False)).remove)
        trainer.step_contexts.append(self.step_context)  # after the injector's (it inserts itself first)
        self._handles.append(trainer.strategy.add_window_hook(self.window))
        self.deferrable = trainer.strategy.name == "pipeline"  # a strategy with idle windows to defer into
        self._handles.append(trainer.add_guard(DMRGuard(self)))
        trainer.metric_sources.append(self.metrics)
        return self

    def set_system(self, system: str) -> None:
        """Switch between ``none`` (no mode at all: the No-DMR baseline), ``naive`` and ``sparetrain`` between
        steps (benchmarks alternate systems on one trainer)."""
        self.cfg.system = system
        self.active = system != "none"
        if self._model is not None:
            set_checkpoint_early_stop(self._model, not self.active)

    def detach(self) -> None:
        for remove in self._handles:
            remove()
        self._handles.clear()

    def _pop_module(self) -> None:
        if self._modules:
            self._modules.pop()

    def _set_optimizer(self, on: bool) -> None:
        self._optimizer_phase = on

    def _reset_attempt(self) -> None:
        self.update_stage = False  # set once the step's guards passed: mismatches are repaired from here on
        self.counts: Counter = Counter()
        self.mismatches = []
        self.coverage = []
        self._ids: Counter = Counter()
        self._windows: Counter = Counter()
        self.window_log: list[tuple[str, float]] = []
        self._const: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> tensor

    @contextlib.contextmanager
    def step_context(self, step: int) -> Iterator[None]:
        self.step = step
        self._reset_attempt()
        if not self.active:
            yield
            return
        with _DMRMode(self):
            yield
        self.drain()

    # ---- phase and place -------------------------------------------------------------------------
    def phase(self) -> str:
        if self._optimizer_phase or self.update_stage:  # clipping, optimizer and schedule: the update stage
            return "optimizer"
        if self._segments and self._segments[-1][1] == "recompute":
            return "recompute"
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        return "forward"

    def module(self) -> str:
        return self._modules[-1] if self._modules else ""

    def _next_id(self, phase: str) -> str:
        n = self._ids[phase]
        self._ids[phase] = n + 1
        return f"{phase}:{n}"

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
            if mode == "recompute" and seg.cursor != len(seg.records):
                self._mismatch(seg.records[min(seg.cursor, len(seg.records) - 1)][0] if seg.records else "recompute:?",
                               "segment", "recompute", "p-dmr",
                               f"{seg.path}: forward ran {len(seg.records)} ops, recompute {seg.cursor}")

    def _pdmr_segment(self) -> tuple[_Segment, str] | None:
        return self._segments[-1] if self._segments else None

    # ---- strategy choice -------------------------------------------------------------------------
    def strategy_for(self, op_id: str, phase: str, name: str) -> tuple[str, str | None]:
        if phase == "optimizer":
            return ("optimizer" if name in _FUSED_OPTIMIZERS else "naive"), None
        if self.cfg.system == "naive":
            return "naive", None
        if phase == "forward" and self._pdmr_segment() is not None:  # (recompute ops are its checkers)
            return "p-dmr", None
        if self.plan is not None:
            a = self.plan.assignment(op_id)
            if a is not None and a.strategy in ("d-inter", "d-intra"):
                return a.strategy, a.window
            if a is not None:
                return "naive", None
        if self.deferrable and phase in ("forward", "backward"):
            return "d-inter", None  # no plan: the dynamic queue, checked in whatever window comes next
        return "naive", None

    # ---- execution -------------------------------------------------------------------------------
    def dispatch(self, func, args: tuple, kwargs: dict) -> Any:
        if getattr(_CHECKING, "active", False):  # a checker execution (drain runs inside the mode): run as is
            return func(*args, **kwargs)
        # everything the engine does around an op (copies, fingerprints, second executions) is invisible to
        # the fault injector; only the primary execution (:func:`_primary`) is an op of the step
        with checker_execution():
            return self._dispatch(func, args, kwargs)

    def _dispatch(self, func, args: tuple, kwargs: dict) -> Any:
        inf = dops.info(func)
        kind = inf.kind
        if kind != "compute" or not self.active:
            if self.cfg.coverage:
                self.coverage.append(("-", str(func), self.phase(), kind if self.active else "none", None))
            self.counts[kind if self.active else "unverified"] += 1
            return _primary(func, args, kwargs)
        phase = self.phase()
        name = inf.name
        seg = self._pdmr_segment()
        const = self._is_const(inf, args, kwargs)
        if phase == "recompute" and seg is not None and self.cfg.system == "sparetrain" and not const:
            return self._pdmr_check(seg[0], func, args, kwargs)
        op_id = self._next_id(phase)
        strategy, window = self.strategy_for(op_id, phase, name)
        if const and strategy == "p-dmr":
            # computed from constants only (a causal mask a kernel builds once and caches): the recompute may
            # not run it again, so it is checked at once and kept out of the segment's op sequence
            strategy = "naive"
        if self.cfg.coverage:
            self.coverage.append((op_id, name, phase, strategy, window))
        self.counts[strategy] += 1
        if strategy == "p-dmr":
            out = _primary(func, args, kwargs)
            seg[0].records.append((op_id, name, self._fp(out)))
            return out
        if strategy == "optimizer":
            return self._verified_optimizer(op_id, func, args, kwargs)
        if strategy in ("d-inter", "d-intra"):
            return self._defer(op_id, phase, strategy, window, func, args, kwargs)
        out = self._naive(op_id, phase, func, args, kwargs, repair=phase == "optimizer")
        if const:
            for t in dops.tensors(out):
                self._const[id(t)] = t
        return out

    def _is_const(self, inf: dops.OpInfo, args, kwargs) -> bool:
        """An op whose tensor inputs are all constants of this attempt (or that has none: a factory)."""
        if inf.random:
            return False
        return all(self._const.get(id(t)) is t for t in dops.tensors((args, kwargs)))

    def _pdmr_check(self, seg: _Segment, func, args, kwargs) -> Any:
        # the recompute: the checker execution of the forward op at the cursor (the injector's "recompute" ops)
        out = _primary(func, args, kwargs)
        self.counts["p-dmr-checked"] += 1
        if seg.cursor >= len(seg.records):
            seg.cursor += 1
            return out
        op_id, name, expect = seg.records[seg.cursor]
        seg.cursor += 1
        if name != str(func):
            self._mismatch(op_id, name, "forward", "p-dmr", f"recompute ran {func} where the forward ran {name}")
        elif not expect.matches(self._fp(out), self.rtol.get(name, 0.0)):
            self._mismatch(op_id, name, "forward", "p-dmr", "forward and recompute differ")
        return out

    def _naive(self, op_id: str, phase: str, func, args, kwargs, repair: bool = False) -> Any:
        written = dops.written_args(func, args, kwargs)
        checker_args = checker_kwargs = None
        pre = None
        if written:
            copies = {id(t): t.clone() for t in written}
            remap = lambda v: copies.get(id(v), v) if isinstance(v, torch.Tensor) else v
            checker_args, checker_kwargs = tree_map(remap, args), tree_map(remap, kwargs)
            if repair:
                pre = [t.clone() for t in written]
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
            out = func(*args, **kwargs)
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
        self._mismatch(op_id, str(func), phase, "naive", "primary and checker differ" if not written else
                       "primary and checker writes differ")
        return out

    def _fp(self, value) -> dops.Fingerprint:
        return dops.Fingerprint.of(value, floats=self.cfg.compare == "tolerance")

    def _repaired(self, out):
        self.counts["reexecuted"] += 1
        self.totals["detected"] += 1
        self.totals["repaired_optimizer"] += 1
        return out

    def _same(self, func, a, b) -> bool:
        rtol = self.rtol.get(str(func), 0.0)
        if rtol <= 0:
            return dops.bitwise_equal(a, b)
        return dops.Fingerprint.of(a, floats=True).matches(dops.Fingerprint.of(b, floats=True), rtol)

    def _verified_optimizer(self, op_id: str, func, args, kwargs) -> Any:
        """The fused AdamW/Adam update, verified chunk by chunk (see the module docstring)."""
        schema = func._schema.arguments
        names = [a.name for a in schema]
        bound = {n: (args[i] if i < len(args) else kwargs.get(n)) for i, n in enumerate(names)}
        lists = [n for n, a in zip(names, schema) if isinstance(bound.get(n), (list, tuple))]
        params = bound[lists[0]]
        chunk_elems = max(1, int(self.cfg.optimizer_chunk_mb * 2**20 / 4))
        start = 0
        while start < len(params):
            end, n = start, 0
            while end < len(params) and (n == 0 or n + params[end].numel() <= chunk_elems):
                n += params[end].numel()
                end += 1
            part = {k: (list(v[start:end]) if k in lists else v) for k, v in bound.items()}
            pos = tuple(part[a.name] for a in schema if not a.kwarg_only)
            kw = {a.name: part[a.name] for a in schema if a.kwarg_only and part.get(a.name) is not None}
            self._naive(f"{op_id}/{start}", "optimizer", func, pos, kw, repair=True)
            self.counts["optimizer-chunks"] += 1
            start = end
        return None

    def _mismatch(self, op_id: str, name: str, phase: str, strategy: str, detail: str) -> None:
        with self._lock:
            self.mismatches.append(Mismatch(op_id, name, phase, strategy, detail))
            self.totals["detected"] += 1

    # ---- deferred checks (D-DMR) -----------------------------------------------------------------
    def _defer(self, op_id, phase, strategy, window, func, args, kwargs) -> Any:
        written = dops.written_args(func, args, kwargs)
        if written or dops.info(func).random:
            # in-place and random ops are checked at once (their inputs or generator change right after)
            self.counts["naive-fallback"] += 1
            return self._naive(op_id, phase, func, args, kwargs)
        # inputs may change before the window (in-place updates): clone them, except parameters, which only
        # the optimizer changes, after every deferred check has run
        keep = tree_map(lambda t: t if not isinstance(t, torch.Tensor) or self._is_param(t) else t.clone(), (args, kwargs))
        nbytes = sum(t.numel() * t.element_size() for t in dops.tensors(keep) if not self._is_param(t))
        if self.budget_bytes and self.queued_bytes + nbytes > self.budget_bytes:
            self.counts["naive-fallback"] += 1
            return self._naive(op_id, phase, func, args, kwargs)
        t0 = time.perf_counter()
        out = _primary(func, args, kwargs)
        est = time.perf_counter() - t0

        def run(keep=keep):
            a, k = keep
            return func(*a, **k)

        self.queue.append(Deferred(op_id, str(func), phase, strategy, window, run, self._fp(out), nbytes, est))
        self.queued_bytes += nbytes
        return out

    def _is_param(self, t: torch.Tensor) -> bool:
        try:
            return t.untyped_storage().data_ptr() in self._param_storages
        except RuntimeError:
            return False

    def window(self, kind: str, wait: Callable[[], Any]) -> Any:
        """Run queued checkers while ``wait()`` blocks on communication; returns what ``wait`` returns.

        The n-th wait of a kind in an attempt is window ``kind:n`` (the ids of the profile and the plan).
        Checkers planned for this window all run; unplanned ones (the dynamic queue) run one by one until
        the communication completes, and the rest stay queued. On CPU they run on a worker thread (the
        waiting thread holds no core); on CUDA they would run on a side stream."""
        if not self.active:
            return wait()
        wid = f"{kind}:{self._windows[kind]}"
        self._windows[kind] += 1
        todo = [d for d in self.queue if d.window == wid] + [d for d in self.queue if d.window is None]
        if not todo:
            return wait()
        closed = threading.Event()
        ran: list[Deferred] = []

        def work() -> None:
            with checker_execution():
                for d in todo:
                    if closed.is_set() and d.window != wid:
                        break
                    self._check(d, kind)
                    ran.append(d)

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
        except Exception as err:  # a checker that cannot run is a detection, not a crash of the step
            self._mismatch(d.op_id, d.name, d.phase, d.strategy, f"checker failed: {err}")
            got = None
        if got is not None and not d.expect.matches(got, self.rtol.get(d.name, 0.0)):
            self._mismatch(d.op_id, d.name, d.phase, d.strategy, f"deferred check ({where}) differs")
        with self._lock:
            self.queued_bytes -= d.nbytes
            self.counts[f"checked-in-{where}"] += 1

    def drain(self) -> None:
        """Run every checker still queued, on this thread (the end of the iteration: nothing is left unchecked)."""
        todo, self.queue = self.queue, []
        _CHECKING.active = True
        try:
            with checker_execution():
                for d in todo:
                    self._check(d, "drain")
        finally:
            _CHECKING.active = False

    # ---- reporting -------------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        out = {f"dmr_{k.replace('-', '_')}": v for k, v in self.counts.items()}
        out["dmr_detected_total"] = self.totals["detected"]
        return out

    def coverage_report(self) -> dict[str, Any]:
        """The last step's ops with their strategy and window, and the verified share of compute ops."""
        compute = [c for c in self.coverage if c[3] not in ("view", "comm", "alloc", "none")]
        verified = [c for c in compute if c[3] in ("naive", "p-dmr", "d-inter", "d-intra", "agc", "optimizer")]
        by = Counter(c[3] for c in self.coverage)
        return {"ops": [{"op": c[0], "name": c[1], "phase": c[2], "strategy": c[3], "window": c[4]} for c in self.coverage],
                "compute_ops": len(compute), "verified_ops": len(verified),
                "coverage": (len(verified) / len(compute)) if compute else 1.0, "by_strategy": dict(by)}


def _primary(func, args, kwargs):
    """The op's primary execution: an op of the step as far as the fault injector is concerned."""
    with checker_execution(False):
        return func(*args, **kwargs)


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
    """Turns the engine's mismatches into a retry of the iteration (all ranks, through the trainer)."""

    name = "dmr"
    inspects_update = False

    def __init__(self, engine: DMREngine):
        self.engine = engine

    def before_update(self, ctx) -> Verdict:
        self.engine.drain()
        if self.engine.mismatches:
            m = self.engine.mismatches[0]
            return Verdict.retry(site=m.site(), reason=f"{m.phase} op {m.name} ({m.strategy}): {m.detail}")
        self.engine.update_stage = True  # clipping and the optimizer come next: repaired in place, not retried
        return Verdict.commit()

    def on_error(self, ctx, err: Exception) -> Verdict | None:
        if not self.engine.mismatches:
            return None
        m = self.engine.mismatches[0]
        return Verdict.retry(site=m.site(), reason=f"{m.phase} op {m.name} ({m.strategy}) differed, then the step "
                                                   f"failed: {type(err).__name__}")


def attach(trainer, cfg: DMRConfig | None = None, plan=None) -> DMREngine:
    """Verify every op of ``trainer``'s iterations by DMR; returns the engine (counters, coverage)."""
    return DMREngine(cfg, plan).attach(trainer)
