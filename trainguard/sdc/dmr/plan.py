"""The DMR plan: for every op of one training iteration on one rank, how its second execution and
comparison happen (SpareTrain section 4: the sets P-DMR, D-DMR_inter, D-DMR_intra, Naive-DMR, plus AGC
segments), where deferred checkers run, what that costs, and the coverage report that proves every op is
checked by exactly one strategy.

Strategies (``OpPlan.strategy``):

* ``p-dmr``: checked by the activation-checkpoint recompute (forward ops and their recompute ops of an AC
  segment; the segment's last op runs once more, see ``PDMRSegment``);
* ``naive``: the checker runs right after the op, on the critical path; a backward op whose window is
  ``carry`` (:data:`CARRY`) may instead be carried past the update into the next iteration's windows, when the
  engine holds the update (``[sdc.dmr] carry_last``): the plan marks all of them, or as many as those windows
  have room for (``carry_budget_s``, ``PlannerConfig.carry``), and only under Phase 3 (carrying defers into
  windows);
* ``d-inter`` / ``d-intra``: the checker is deferred into an inter-node (pp, dp) / intra-node (tp, ep) idle
  window (``OpPlan.window``); the op's inputs and outputs are kept alive until then;
* ``agc``: checked by replaying an activation-gradient-checkpoint segment (``OpPlan.agc``) in the pipeline
  window after its block's backward, from the segment's boundary tensors;
* ``dynamic``: data-dependent (MoE) op left to the run-time :class:`~trainguard.sdc.dmr.dynamic.DynamicPlanner`,
  which runs its checker exactly once, deferred or naive;
* ``comm``: a communication op (kind ``C``): never re-executed, outside coverage;
* ``none``: not checked (only the No-DMR baseline).

The plan is JSON (``Plan.save`` / ``Plan.load``, format ``trainguard-dmr-plan-1``). Relies on the standard
library only.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard.errors import TrainguardError

if TYPE_CHECKING:
    from trainguard.sdc.dmr.profile import Profile

FORMAT = "trainguard-dmr-plan-1"
CHECKED = ("p-dmr", "naive", "d-inter", "d-intra", "agc", "dynamic")  # strategies that check an op
STRATEGIES = (*CHECKED, "comm", "none")
DEFERRED = {"d-inter": ("pp", "dp"), "d-intra": ("tp", "ep")}  # strategy -> window kinds it may use
CARRY = "carry"  # the window of naive backward ops the engine may carry into the next iteration's windows


class CoverageError(TrainguardError):
    """An op with no checking strategy, or with two: the plan does not give complete, single DMR."""


@dataclass
class OpPlan:
    strategy: str
    window: str | None = None  # deferred ops and AGC segments: the window their checker runs in
    agc: str | None = None  # agc ops: the segment id
    kind: str = ""
    phase: str = ""
    block: str = ""
    microbatch: int = 0
    start_s: float = 0.0
    time_s: float = 0.0
    retained_bytes: int = 0  # deferred ops: bytes kept alive from start_s until their window ends


@dataclass
class PDMRSegment:
    """One activation-checkpoint segment of one micro-batch and Phase 1's decision for it."""

    id: str
    ac_segment: str
    microbatch: int
    ops: list[str]  # its forward ops, in order
    recompute_ops: list[str]
    last_op: str
    recompute_s: float  # time of the recomputed ops (all but the last)
    last_s: float
    last_comm_s: float  # communication the last op's extra run must repeat
    decision: str  # "p-dmr", "p-dmr (dynamic)" or "naive (exception)"
    absorbed_by: str | None = None  # an AGC segment that checks the whole segment instead (no extra run)
    # ops after the last one the recompute replays (planner ``pdmr_tail = "defer"``): not P-DMR but checked by
    # Phases 2-3 where they ran (``last_s`` is their time); empty: the last op's extra run (the paper's model)
    tail_ops: list[str] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.decision.startswith("p-dmr") and self.absorbed_by is None

    @property
    def extra_run_s(self) -> float:
        """Critical-path cost: the last op once more, with the communication gathering its inputs (none when the
        tail is checked by other strategies)."""
        return self.last_s + self.last_comm_s if self.active and not self.tail_ops else 0.0


@dataclass
class AGCSegment:
    """One activation-gradient-checkpoint segment (Phase 2): forward ops ``forward_ops`` replayed from the
    stored segment input, then the input- and weight-gradient ops ``bw_ops`` from the stored output
    gradient, outputs compared with the stored ones, in pipeline window ``window``."""

    id: str
    block: str
    microbatch: int
    window: str
    forward_ops: list[str]
    bw_ops: list[str]
    ops: list[str]  # the ops it checks (strategy agc), recompute ops of absorbed AC segments included
    replayed_protected: list[str]  # P-DMR ops replayed only to rebuild tensors (they stay p-dmr)
    absorbed: list[str]  # P-DMR segments it takes over: their last op's extra run is dropped
    boundary: list[dict[str, Any]]  # {"tensor": description, "bytes": n}
    memory_bytes: int
    replay_s: float  # sum of the replayed F/B/W op times
    comm_s: float  # communication inside the segment, replayed with it
    extra_s: float  # replay_s - gain_s: re-protection of P-DMR ops and intra-segment communication
    gain_s: float  # checker time taken off the critical path, minus the replayed communication
    headroom_bytes: float  # the per-block constraints it was chosen under
    slack_s: float
    retained_from_s: float  # boundary tensors are kept from here until the window ends
    candidates: int = 0  # segments enumerated for its block (those within its time slack)

    @property
    def occupancy_s(self) -> float:
        return self.replay_s + self.comm_s


@dataclass
class WindowLoad:
    id: str
    kind: str
    start_s: float
    duration_s: float
    dynamic: bool = False
    after_op: str = ""
    agc: list[str] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    agc_s: float = 0.0
    ops_s: float = 0.0
    demoted: list[str] = field(default_factory=list)  # Phase 3 demoted these to naive here (memory budget)
    settle_s: float = 0.0  # the fingerprints of earlier outputs the engine takes here first (see planner)

    @property
    def used_s(self) -> float:
        return self.settle_s + self.agc_s + self.ops_s

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass
class Plan:
    baseline: str = "sparetrain"  # "sparetrain", "naive-only" or "no-dmr"
    phases: list[int] = field(default_factory=list)
    memory_budget_bytes: int = 0
    profile: dict[str, Any] = field(default_factory=dict)  # model, strategy, rank, stage, iteration_s
    ops: dict[str, OpPlan] = field(default_factory=dict)  # in execution order
    pdmr_segments: list[PDMRSegment] = field(default_factory=list)
    agc_segments: list[AGCSegment] = field(default_factory=list)
    windows: list[WindowLoad] = field(default_factory=list)
    memory_curve: list[tuple[float, int]] = field(default_factory=list)  # with deferral: (time, bytes)
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    # the time the next iteration's profiled windows have left for checks carried past the update (the naive backward
    # ops marked ``window = CARRY``: all of them, or those that fit it); None: a plan made before it, under which the
    # engine may carry every naive backward op
    carry_budget_s: float | None = None
    # whether the engine may carry the list ops over every gradient (the averaging, clipping: no op entry covers
    # them) past the update: with Phase 3 and an unbounded carry only (a plan made before this field: yes)
    carry_lists: bool = True
    format: str = FORMAT

    # -- lookups -------------------------------------------------------------------------------------
    def window(self, wid: str) -> WindowLoad:
        for w in self.windows:
            if w.id == wid:
                return w
        raise KeyError(wid)

    def assignment(self, op_id: str) -> OpPlan | None:
        """What the engine asks per op id: its strategy and window (None: an op the plan does not know)."""
        return self.ops.get(op_id)

    def may_carry(self, op: OpPlan) -> bool:
        """Whether the engine may carry this naive backward op past the update (when it holds the update)."""
        return self.carry_budget_s is None or op.window == CARRY

    def ops_with(self, strategy: str) -> list[str]:
        return [k for k, o in self.ops.items() if o.strategy == strategy]

    @property
    def pdmr_early_stop(self) -> bool:
        """The recompute may stop after the last tensor autograd saved (torch's early stop): no P-DMR segment
        needs the rest run once more (its tail is checked by another strategy, or its recompute replays it all)."""
        return all(s.tail_ops or len(s.recompute_ops) >= len(s.ops) for s in self.pdmr_segments if s.active)

    # -- JSON ----------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ops"] = {k: asdict(v) for k, v in self.ops.items()}
        return d

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise TrainguardError(f"not a DMR plan (format {got!r}, expected {FORMAT!r})")
        try:
            d = dict(data)
            d["ops"] = {k: OpPlan(**v) for k, v in d.get("ops", {}).items()}
            d["pdmr_segments"] = [PDMRSegment(**s) for s in d.get("pdmr_segments", [])]
            d["agc_segments"] = [AGCSegment(**s) for s in d.get("agc_segments", [])]
            d["windows"] = [WindowLoad(**w) for w in d.get("windows", [])]
            d["memory_curve"] = [tuple(x) for x in d.get("memory_curve", [])]
            return cls(**d)
        except TypeError as err:
            raise TrainguardError(f"malformed DMR plan: {err}") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise TrainguardError(f"plan not found: {path}") from None
        except json.JSONDecodeError as err:
            raise TrainguardError(f"plan {path} is not valid JSON: {err}") from None
        return cls.from_json(data)


# -- coverage ----------------------------------------------------------------------------------------
@dataclass
class CoverageRow:
    op: str
    kind: str
    phase: str
    strategy: str
    window: str | None
    agc: str | None


@dataclass
class CoverageReport:
    rows: list[CoverageRow]
    total: int  # non-communication ops
    covered: int  # of those, checked by exactly one strategy
    by_strategy: dict[str, int]

    @property
    def fraction(self) -> float:
        return self.covered / self.total if self.total else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {"total": self.total, "covered": self.covered, "coverage": self.fraction,
                "by_strategy": dict(self.by_strategy), "rows": [asdict(r) for r in self.rows]}


def _listed(plan: Plan) -> dict[str, list[tuple[str, str | None]]]:
    """Every (strategy, where) the plan's segments and windows list each op under."""
    listed: dict[str, list[tuple[str, str | None]]] = defaultdict(list)
    for s in plan.pdmr_segments:
        if s.active:
            for k in s.ops + s.recompute_ops:
                if k not in s.tail_ops:  # (a tail is checked by another strategy, listed where that one lists it)
                    listed[k].append(("p-dmr", None))
    for a in plan.agc_segments:
        for k in a.ops:
            listed[k].append(("agc", a.id))
    for w in plan.windows:
        strat = next((s for s, kinds in DEFERRED.items() if w.kind in kinds), f"deferred into a {w.kind} window")
        for k in w.ops:
            listed[k].append((strat, w.id))
    return listed


def coverage_report(plan: Plan, profile: Profile | None = None, *, require_full: bool = True) -> CoverageReport:
    """Each op with its strategy and window; coverage = fraction of non-communication ops checked by exactly
    one strategy. An op's strategy must agree with where the plan lists it (its P-DMR segment, AGC segment
    or window), and it must be listed exactly once. Raises :class:`CoverageError` on an op with two
    strategies (always) or with none (unless ``require_full=False``, for the No-DMR baseline), and, given
    the ``profile``, on an op the plan lacks or a communication op the plan would re-execute."""
    problems: list[str] = []
    if profile is not None:
        prof_ids = [o.id for o in profile.ops]
        missing = [k for k in prof_ids if k not in plan.ops]
        extra = set(plan.ops) - set(prof_ids)
        if missing:
            problems.append(f"{len(missing)} op(s) of the profile have no strategy (first: {missing[0]})")
        if extra:
            problems.append(f"{len(extra)} op(s) in the plan are not in the profile (first: {sorted(extra)[0]})")
        kinds = {o.id: o.kind for o in profile.ops}
        bad = [k for k, o in plan.ops.items() if k in kinds and (kinds[k] == "C") != (o.strategy == "comm")]
        if bad:
            problems.append(f"op {bad[0]} of kind {kinds[bad[0]]} is planned as {plan.ops[bad[0]].strategy}")
    listed = _listed(plan)
    windows = {w.id: w for w in plan.windows}
    rows, covered, total = [], 0, 0
    by: Counter[str] = Counter()
    none, two = [], []
    for k, o in plan.ops.items():
        if o.kind == "C" or o.strategy == "comm":
            if o.strategy != "comm" or o.kind != "C" or listed.get(k):
                two.append(f"{k} ({o.kind} op planned as {o.strategy})")
            rows.append(CoverageRow(k, o.kind, o.phase, "comm", None, None))
            continue
        total += 1
        rows.append(CoverageRow(k, o.kind, o.phase, o.strategy, o.window, o.agc))
        places = listed.get(k, [])
        own = (o.strategy, o.agc if o.strategy == "agc" else o.window if o.strategy in DEFERRED else None)
        if o.strategy not in CHECKED:
            (two if places else none).append(k if not places else f"{k} ({o.strategy}, listed as {places})")
            continue
        if o.strategy in ("naive", "dynamic"):
            if places:
                two.append(f"{k} ({o.strategy}, also listed as {places[0][0]}@{places[0][1]})")
                continue
        elif places != [own]:
            two.append(f"{k} ({o.strategy}@{own[1]}, listed as {places or 'nothing'})")
            continue
        if o.strategy in DEFERRED:
            wk = windows[o.window].kind if o.window in windows else None
            if wk not in DEFERRED[o.strategy]:
                two.append(f"{k} ({o.strategy} in window {o.window!r} of kind {wk})")
                continue
        covered += 1
        by[o.strategy] += 1
    if two:
        problems.append(f"{len(two)} op(s) with two strategies or listed in the wrong place (first: {two[0]})")
    if none and require_full:
        problems.append(f"{len(none)} op(s) with no checking strategy (first: {none[0]})")
    if problems:
        raise CoverageError("DMR coverage broken: " + "; ".join(problems))
    return CoverageReport(rows, total, covered, dict(by))


# -- summary -----------------------------------------------------------------------------------------
def summarize(plan: Plan, peak_bytes: int = 0) -> dict[str, Any]:
    """Counts and time per strategy, checker time on the critical path vs hidden in windows, memory."""
    by: dict[str, dict[str, float]] = {s: {"ops": 0, "time_s": 0.0} for s in STRATEGIES}
    for o in plan.ops.values():
        by[o.strategy]["ops"] += 1
        by[o.strategy]["time_s"] += o.time_s
    pdmr_runs = sum(s.extra_run_s for s in plan.pdmr_segments)
    naive_s = by["naive"]["time_s"]
    dynamic_s = by["dynamic"]["time_s"]
    hidden = sum(w.used_s for w in plan.windows)
    all_s = sum(o.time_s for o in plan.ops.values() if o.kind != "C")
    it = float(plan.profile.get("iteration_s", 0.0) or 0.0)
    critical = naive_s + pdmr_runs + dynamic_s  # dynamic ops at their naive cost: an upper bound
    peak_def = max((b for _, b in plan.memory_curve), default=peak_bytes)
    static_windows = [w for w in plan.windows if not w.dynamic]
    cov = coverage_report(plan, require_full=False)
    carried = [o for o in plan.ops.values() if o.strategy == "naive" and o.window == CARRY]
    return {
        "baseline": plan.baseline,
        "phases": list(plan.phases),
        "ops": cov.total,
        "comm_ops": by["comm"]["ops"],
        "by_strategy": {s: v for s, v in by.items() if v["ops"]},
        "coverage": cov.fraction,
        "checker_critical_s": critical,
        "checker_hidden_s": hidden,
        "checker_dynamic_s": dynamic_s,
        "naive_s": naive_s,
        "pdmr_extra_runs_s": pdmr_runs,
        "naive_only_critical_s": all_s if plan.baseline != "no-dmr" else 0.0,
        "iteration_s": it,
        "critical_overhead": critical / it if it > 0 else None,
        "pdmr_segments": sum(1 for s in plan.pdmr_segments if s.decision.startswith("p-dmr")),
        "pdmr_exceptions": sum(1 for s in plan.pdmr_segments if s.decision.startswith("naive")),
        "agc_segments": len(plan.agc_segments),
        "agc_gain_s": sum(a.gain_s for a in plan.agc_segments),
        "carry_ops": len(carried),
        "carry_s": sum(o.time_s for o in carried),
        "carry_budget_s": plan.carry_budget_s,
        "carry_lists": plan.carry_lists,
        "windows": len(plan.windows),
        "windows_used": sum(1 for w in plan.windows if w.used_s > 0),
        "window_time_s": sum(w.duration_s for w in static_windows),
        "window_used_s": hidden,
        "memory_budget_bytes": plan.memory_budget_bytes,
        "peak_bytes": peak_bytes,
        "peak_with_deferral_bytes": peak_def,
    }
