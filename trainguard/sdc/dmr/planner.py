"""The static DMR planner (SpareTrain section 5): turns a :class:`~trainguard.sdc.dmr.profile.Profile` into a
:class:`~trainguard.sdc.dmr.plan.Plan` in three phases, plus the No-DMR and Naive-Only baselines.

* Phase 1 (:func:`phase1_pdmr`): every op of an activation-checkpoint (AC) segment is checked by P-DMR
  (the recompute is the second execution; the segment's last op runs once more), except when naive DMR is
  cheaper (Fig. 7): ``2 x recompute time <= the communication the last op's extra run must repeat``;
  segments with a dynamic (MoE) op always get P-DMR. With ``pdmr_tail = "defer"`` (the default) the ops
  the recompute does not replay (the segment's tail: torch's checkpoint stops recomputing after the last
  tensor autograd saved) get no extra run on the critical path: they are left to Phases 2 and 3 like any
  other op (checked in a window from their kept inputs, or naive at once when none fits).
* Phase 2 (:func:`phase2_agc`): at most one activation-gradient-checkpoint (AGC) segment per transformer
  block and micro-batch, replayed in the pipeline (pp) window after the block's backward: enumerate,
  drop those over the block's memory headroom, drop those over its time slack, keep the largest gain.
* Phase 3 (:func:`phase3_queue`): the D-DMR queue: at each window, tentatively enqueue the ops since the
  last one, demote the shortest to naive until the queue fits the memory budget, defer the subset that
  best fills the window (:func:`~trainguard.sdc.dmr.dynamic.best_fit`); what is left at the end is naive.
  Dynamic ops are left to the run-time :class:`~trainguard.sdc.dmr.dynamic.DynamicPlanner` (``dynamic``).

Memory is modelled as the profile's memory curve (for MoE profiles, conservatively, its maximum
everywhere) plus, for each deferred op, its retained bytes from its start until its window ends, and for
each AGC segment its boundary bytes from its first forward op until its window ends; no deferral may
take this above the budget. Ops are in execution order in the profile; a window sits after its
``after_op`` (or, without one, after the last op that started before it).

Time in a window is charged at what the engine spends there, not only the re-executed ops: a deferred check
or an AGC replay also fingerprints its checker's outputs and (the engine fingerprints the primaries' outputs
later, off the critical path) the primary's, and each window first takes the fingerprints of the P-DMR
outputs (forward and recompute) produced since the previous one. A fingerprint costs the profile's ``meta["fingerprint_call_s"]`` plus
``meta["fingerprint_s_per_byte"]`` per byte, both measured by the profiler; a profile without them (older,
or synthetic) is planned at op times alone.
Relies on numpy.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left, bisect_right
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, get_args

import numpy as np

from trainguard.errors import ConfigError, TrainguardError
from trainguard.sdc.dmr.config import CARRY_MODES
from trainguard.sdc.dmr.dynamic import best_fit
from trainguard.sdc.dmr.plan import CARRY, AGCSegment, OpPlan, PDMRSegment, Plan, WindowLoad, coverage_report, summarize
from trainguard.sdc.dmr.profile import Kind, OpRecord, Phase, Profile, WindowKind

PHASE_SETS = ((1,), (1, 2), (1, 2, 3))
_TOL = 1e-12


@dataclass
class PlannerConfig:
    phases: tuple[int, ...] = (1, 2, 3)  # the ablation switch: (1,), (1, 2) or (1, 2, 3)
    memory_budget_bytes: int | None = None  # None: the profile's budget
    use_dp_windows: bool = False  # Phase 3 may also defer into data-parallel windows (the paper does not)
    agc_max_forward_ops: int = 48  # longest forward range Phase 2 enumerates (bounds the O(n^3) search)
    knapsack_resolution: int = 2048  # time steps per window in the best-fit subset search
    # A deferred check keeps its op's outputs too (the paper's model). The engine keeps only a fingerprint
    # of them (``[sdc.dmr] fingerprints``), so it plans with False: the budget then holds more checks.
    keep_outputs: bool = True
    # The ops of a P-DMR segment that the recompute does not replay (from the profile, which runs with torch's
    # early stop on): "recompute" -> the paper's extra run (the recompute replays the whole segment, early stop
    # off); "defer" -> left to Phases 2-3 (checked where they ran, no communication repeated; early stop on)
    pdmr_tail: str = "defer"
    # Share of each window Phases 2 and 3 fill (1: all of it, the paper's). The engine plans with less
    # (``[sdc.dmr] window_fill``): a window filled to the brim makes the step wait for any checker that runs
    # slower than profiled.
    window_fill: float = 1.0
    # Which naive backward ops the engine may carry past the update (``[sdc.dmr] carry_budget``): "unbounded" -> all
    # of them; "windows" -> as many as the next iteration's profiled windows have room for (mark_carried)
    carry: str = "unbounded"


def parse_phases(text: str | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """``"1"``, ``"1,2"`` or ``"1,2,3"`` (or the tuple) -> the phase tuple; anything else is a ConfigError."""
    try:
        phases = tuple(int(x) for x in text.split(",")) if isinstance(text, str) else tuple(int(x) for x in text)
    except ValueError:
        phases = ()
    if phases not in PHASE_SETS:
        raise ConfigError(f"phases must be 1, 1,2 or 1,2,3; got {text!r}")
    return phases


# -- reading and checking a profile --------------------------------------------------------------------
def read_profile(path: str | Path) -> Profile:
    """Load and check a profile JSON file; every problem is a one-line TrainguardError."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise TrainguardError(f"profile not found: {path}") from None
    except IsADirectoryError:
        raise TrainguardError(f"profile {path} is a directory, not a JSON file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TrainguardError(f"profile {path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise TrainguardError(f"profile {path} must hold a JSON object, not {type(data).__name__}")
    try:
        profile = Profile.from_json(data)
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        raise TrainguardError(f"profile {path} does not match the profile schema: {err}") from None
    validate_profile(profile, str(path))
    return profile


# The type each field of a profile's records must have (JSON's: ``float`` takes an integer too, ``int`` no float;
# neither takes a boolean). A profile read from a file is checked against these before anything is planned from it:
# a field of the wrong type was otherwise planned from as it came (a ``dynamic`` of ``"yes"`` read as true) or ended in
# a traceback deep in the planner.
_STR, _OPT_STR, _INT, _NUM, _BOOL = "a string", "a string or null", "an integer", "a number", "true or false"
_OP_FIELDS = {"id": _STR, "name": _STR, "phase": _STR, "kind": _STR, "module": _STR, "block": _STR,
              "ac_segment": _OPT_STR, "seg_index": _INT, "seg_last": _BOOL, "start_s": _NUM, "time_s": _NUM,
              "in_bytes": _INT, "out_bytes": _INT, "comm_s": _NUM, "dynamic": _BOOL, "microbatch": _INT,
              "grad_of": _OPT_STR, "param_bytes": _INT, "recompute_of": _OPT_STR, "ac_call": _INT}
_WINDOW_FIELDS = {"id": _STR, "kind": _STR, "start_s": _NUM, "duration_s": _NUM, "after_op": _STR, "dynamic": _BOOL,
                  "block": _STR}
_PROFILE_FIELDS = {"model": _STR, "strategy": _STR, "rank": _INT, "stage": _INT, "iteration_s": _NUM,
                   "memory_budget_bytes": _INT, "peak_bytes": _INT}


def _has_type(v: Any, want: str) -> bool:
    if want == _BOOL:
        return isinstance(v, bool)
    if isinstance(v, bool):
        return False
    if want == _INT:
        return isinstance(v, int)
    if want == _NUM:
        return isinstance(v, (int, float))
    return isinstance(v, str) or (want == _OPT_STR and v is None)


def _check_types(obj: Any, fields: dict[str, str], what: str, bad) -> None:
    for k, want in fields.items():
        v = getattr(obj, k)
        if not _has_type(v, want):
            raise bad(f"{what}{k} must be {want}, got {v!r}")


def validate_profile(profile: Profile, name: str = "profile") -> None:
    """Every field of the type the profile's schema gives it; unique op ids, known phases and kinds, finite
    non-negative times and sizes, known window kinds; the ops that ``grad_of``, ``recompute_of`` and a window's
    ``after_op`` name exist; a memory curve of non-negative (time, bytes) points."""
    def bad(msg: str) -> ConfigError:
        return ConfigError(f"{name}: {msg}")

    if not profile.ops:
        raise bad("no ops")
    _check_types(profile, _PROFILE_FIELDS, "", bad)
    if not isinstance(profile.meta, dict):
        raise bad(f"meta must be a JSON object, got {type(profile.meta).__name__}")
    if not isinstance(profile.blocks, list) or not all(isinstance(b, str) for b in profile.blocks):
        raise bad(f"blocks must be a list of strings, got {profile.blocks!r}")
    seen: set[str] = set()
    phases, kinds, wkinds = set(get_args(Phase)), set(get_args(Kind)), set(get_args(WindowKind))
    for o in profile.ops:
        if not isinstance(o.id, str) or not o.id:
            raise bad(f"op with an empty or non-string id: {o.id!r}")
        _check_types(o, _OP_FIELDS, f"op {o.id}: ", bad)
        if o.id in seen:
            raise bad(f"duplicate op id {o.id!r}")
        seen.add(o.id)
        if o.phase not in phases:
            raise bad(f"op {o.id}: unknown phase {o.phase!r} (expected one of {sorted(phases)})")
        if o.kind not in kinds:
            raise bad(f"op {o.id}: unknown kind {o.kind!r} (expected one of {sorted(kinds)})")
        for k in ("start_s", "time_s", "comm_s", "in_bytes", "out_bytes", "param_bytes"):
            v = getattr(o, k)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise bad(f"op {o.id}: {k} must be a finite number >= 0, got {v!r}")
    for o in profile.ops:
        for k in ("grad_of", "recompute_of"):
            ref = getattr(o, k)
            if ref is not None and ref not in seen:
                raise bad(f"op {o.id}: {k} names {ref!r}, which is no op of the profile")
    wseen: set[str] = set()
    for w in profile.windows:
        if not isinstance(w.id, str) or not w.id:
            raise bad(f"window with an empty or non-string id: {w.id!r}")
        _check_types(w, _WINDOW_FIELDS, f"window {w.id}: ", bad)
        if w.after_op and w.after_op not in seen:
            raise bad(f"window {w.id}: after_op names {w.after_op!r}, which is no op of the profile")
        if w.id in wseen:
            raise bad(f"duplicate window id {w.id!r}")
        wseen.add(w.id)
        if w.kind not in wkinds:
            raise bad(f"window {w.id}: unknown kind {w.kind!r} (expected one of {sorted(wkinds)})")
        for k in ("start_s", "duration_s"):
            v = getattr(w, k)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise bad(f"window {w.id}: {k} must be a finite number >= 0, got {v!r}")
    for pt in profile.memory_curve:
        if len(pt) != 2 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                                   and x >= 0 for x in pt):
            raise bad(f"memory curve point {list(pt)!r} is not (time, bytes), both finite and >= 0")
    for k in ("memory_budget_bytes", "peak_bytes", "iteration_s"):
        v = getattr(profile, k)
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise bad(f"{k} must be a finite number >= 0, got {v!r}")
    for k in ("fingerprint_call_s", "fingerprint_s_per_byte"):
        v = (profile.meta or {}).get(k, 0.0)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise bad(f"meta.{k} must be a finite number >= 0, got {v!r}")


# -- memory over the iteration -------------------------------------------------------------------------
class _Timeline:
    """Memory in use as a step function on a fixed time grid: the profile's curve (or a flat value) plus
    the bytes that deferral keeps alive over half-open intervals [t0, t1)."""

    def __init__(self, curve: list[tuple[float, int]], times: list[float], flat: float | None) -> None:
        self.grid = sorted({float(t) for t in times} | {float(t) for t, _ in curve} | {0.0})
        if flat is not None:
            self.base = np.full(len(self.grid), float(flat))
        else:
            pts = sorted(curve)
            ct, cv = [float(t) for t, _ in pts], [float(b) for _, b in pts]
            self.base = np.array([cv[max(bisect_right(ct, g) - 1, 0)] if cv else 0.0 for g in self.grid])
        self.extra = np.zeros(len(self.grid))

    def span(self, t0: float, t1: float) -> slice:
        lo = max(bisect_right(self.grid, t0) - 1, 0)
        return slice(lo, max(bisect_left(self.grid, t1), lo + 1))

    def add(self, t0: float, t1: float, nbytes: float) -> None:
        self.extra[self.span(t0, t1)] += nbytes

    def max_between(self, t0: float, t1: float) -> float:
        return float((self.base + self.extra)[self.span(t0, t1)].max())

    def values(self) -> np.ndarray:
        return self.base + self.extra

    def curve(self) -> list[tuple[float, int]]:
        return [(t, int(round(v))) for t, v in zip(self.grid, self.values())]


def retained_bytes(op: OpRecord, keep_outputs: bool = True) -> int:
    """Bytes a deferred check of ``op`` keeps alive: its inputs (parameters excepted, they live anyway;
    not for optimizer ops, which change them) and, unless only a fingerprint of them is kept, its outputs."""
    inputs = op.in_bytes if op.kind == "O" else max(0, op.in_bytes - op.param_bytes)
    return int(inputs + (op.out_bytes if keep_outputs else 0))


# -- planning state ------------------------------------------------------------------------------------
class _State:
    def __init__(self, profile: Profile, cfg: PlannerConfig, budget: int) -> None:
        self.p, self.cfg, self.budget = profile, cfg, budget
        self.ops = profile.ops
        self.by_id = {o.id: o for o in self.ops}
        self.pos = {o.id: i for i, o in enumerate(self.ops)}
        self.strategy: dict[str, str | None] = {o.id: "comm" if o.kind == "C" else None for o in self.ops}
        self.window_of: dict[str, str] = {}
        self.agc_of: dict[str, str] = {}
        self.retained: dict[str, int] = {}
        self.moe = any(o.dynamic for o in self.ops)
        starts = [o.start_s for o in self.ops]
        self.windows: list[WindowLoad] = []
        self.wpos: dict[str, float] = {}
        for w in profile.windows:
            if w.after_op in self.pos:
                p = self.pos[w.after_op] + 0.5
            else:  # after the last op that started at or before the window
                p = sum(1 for s in starts if s <= w.start_s) - 0.5
            self.wpos[w.id] = p
            self.windows.append(WindowLoad(w.id, w.kind, w.start_s, w.duration_s, w.dynamic, w.after_op))
        self.windows.sort(key=lambda w: (self.wpos[w.id], w.start_s))
        self.peak = int(max([profile.peak_bytes] + [b for _, b in profile.memory_curve]))
        times = starts + [w.end_s for w in self.windows]
        # MoE: memory varies between iterations, so the headroom is taken from the profiled maximum (5.2)
        self.timeline = _Timeline(profile.memory_curve, times, float(self.peak) if self.moe else None)
        self.pdmr: list[PDMRSegment] = []
        self.agcs: list[AGCSegment] = []
        self.fp_call_s, self.fp_s_per_byte = (max(0.0, float(profile.meta.get(k, 0.0) or 0.0))
                                              for k in ("fingerprint_call_s", "fingerprint_s_per_byte"))
        self._check_s: dict[str, float] = {}

    def room_s(self, w: WindowLoad) -> float:
        """Time the phases may still fill in ``w``."""
        return max(0.0, self.cfg.window_fill * w.duration_s - w.used_s)

    def fingerprint_s(self, o: OpRecord) -> float:
        return self.fp_call_s + self.fp_s_per_byte * o.out_bytes if o.out_bytes else 0.0

    def check_s(self, o: OpRecord) -> float:
        """What checking ``o`` in a window takes: its second execution, the fingerprint of its output and (when
        the engine fingerprints) that of the primary's output, taken in a window too. Computed once per op (Phase 3
        asks again at every window the op waits through)."""
        c = self._check_s.get(o.id)
        if c is None:
            c = self._check_s[o.id] = o.time_s + (1 if self.cfg.keep_outputs else 2) * self.fingerprint_s(o)
        return c

    def charge_pdmr_fingerprints(self) -> None:
        """After Phase 1: each window's ``settle_s``, the fingerprints of the P-DMR outputs (forward and recompute)
        produced since the previous window, which the engine takes there before any planned check (when it
        fingerprints)."""
        if self.cfg.keep_outputs or not (self.fp_call_s or self.fp_s_per_byte):
            return
        cursor = 0
        for w in self.windows:
            while cursor < len(self.ops) and cursor < self.wpos[w.id]:
                o = self.ops[cursor]
                if self.strategy[o.id] == "p-dmr":  # (forward and recompute: both fingerprinted later)
                    w.settle_s += self.fingerprint_s(o)
                cursor += 1

    def assign(self, op_id: str, strategy: str, window: str | None = None, agc: str | None = None) -> None:
        self.strategy[op_id] = strategy
        if window is not None:
            self.window_of[op_id] = window
        if agc is not None:
            self.agc_of[op_id] = agc

    def free(self, o: OpRecord) -> bool:
        """Static, unassigned, not communication: open to Phases 2 and 3."""
        return self.strategy[o.id] is None and not o.dynamic and o.kind != "C"


# -- Phase 1 -------------------------------------------------------------------------------------------
def phase1_pdmr(st: _State) -> None:
    """P-DMR for each AC segment of each micro-batch, unless naive is cheaper (Fig. 7).

    Naive DMR of the segment costs 2 x A + B on the critical path (A: the recomputed ops, run twice in the
    forward and twice in the recompute; B: the last op); P-DMR costs B + B_c (the last op's extra run,
    which must repeat the communication B_c gathering its inputs). The segment gets naive DMR (its ops are
    left to Phases 2-3, or naive) when ``2 x A <= B_c``, P-DMR otherwise; a segment holding a dynamic op
    gets P-DMR without the comparison. Forward ops and their recompute ops share the decision.

    ``pdmr_tail = "defer"``: B is the segment's tail, the ops after the last one the profiled recompute replayed
    (torch stops recomputing after the last tensor autograd saved). They are left to Phases 2-3, checked where
    they ran: nothing gathers their inputs again (B_c = 0), so the exception never applies. Not in a profile with
    dynamic (MoE) ops: tails of MoE segments are not tested yet (see the comment below).
    """
    # one segment per execution of a checkpointed module (``ac_call``; a hand-written profile has none: one per
    # micro-batch and module)
    fwd: dict[tuple[int, str, int], list[OpRecord]] = defaultdict(list)
    rec: dict[tuple[int, str, int], list[OpRecord]] = defaultdict(list)
    for o in st.ops:
        if o.ac_segment is None or o.kind == "C":
            continue
        if o.phase == "forward":
            fwd[(o.microbatch, o.ac_segment, o.ac_call)].append(o)
    forward_call = {o.id: k for k, ops in fwd.items() for o in ops}
    forward_of = _forward_of(st)
    for o in st.ops:
        if o.ac_segment is not None and o.kind != "C" and o.phase == "recompute":
            # (a recompute runs in backward: its execution is its forward twin's)
            rec[forward_call.get(forward_of.get(o.id, ""), (o.microbatch, o.ac_segment, o.ac_call))].append(o)
    calls = Counter((mb, ac) for mb, ac, _ in fwd)
    # Tails are told apart by op id. An MoE model's segments keep the extra run (early stop off): its static ids
    # shifted with the routing until the loops over the experts were numbered with the dynamic ops, and tails of MoE
    # segments have not been tested since
    tails = st.cfg.pdmr_tail == "defer" and not any(o.dynamic for o in st.ops)
    for (mb, ac, call), ops in fwd.items():
        last = next((o for o in reversed(ops) if o.seg_last), None) or max(ops, key=lambda o: (o.seg_index, st.pos[o.id]))
        tail = _tail(ops, rec[(mb, ac, call)], forward_of) if tails else []
        if tail:  # checked where they ran, by Phases 2-3: no extra run, no communication repeated
            recomputed = ops[:len(ops) - len(tail)]
            b, b_comm = sum(o.time_s for o in tail), 0.0
        else:
            recomputed = [o for o in ops if o is not last]
            b, b_comm = last.time_s, last.comm_s
        a = sum(o.time_s for o in recomputed)
        if any(o.dynamic for o in ops + rec[(mb, ac, call)]):
            decision = "p-dmr (dynamic)"
        elif 2 * a <= b_comm:
            decision = "naive (exception)"
        else:
            decision = "p-dmr"
        sid = f"mb{mb}:{ac}" + (f"#{call}" if calls[(mb, ac)] > 1 else "")
        seg = PDMRSegment(sid, ac, mb, [o.id for o in ops], [o.id for o in rec[(mb, ac, call)]], last.id,
                          a, b, b_comm, decision, tail_ops=[o.id for o in tail])
        st.pdmr.append(seg)
        if decision.startswith("p-dmr"):
            for k in seg.ops + seg.recompute_ops:
                if k not in seg.tail_ops:
                    st.assign(k, "p-dmr")


def _tail(ops: list[OpRecord], recompute: list[OpRecord], forward_of: dict[str, str]) -> list[OpRecord]:
    """The segment's forward ops after the last one its (profiled) recompute replayed; [] when the profile has no
    recompute of it (a hand-written profile: the paper's model, the last op's extra run)."""
    replayed = {forward_of.get(r.id) for r in recompute}
    last = max((x for x, o in enumerate(ops) if o.id in replayed), default=None)
    return ops[last + 1:] if last is not None else []


# -- Phase 2 -------------------------------------------------------------------------------------------
@dataclass
class AGCCandidate:
    """Forward ops ``i..j`` of a block (indices into its forward ops) and the B/W ops of ``k..j``
    (``k = j + 1``: forward only)."""

    i: int
    k: int
    j: int
    memory_bytes: float
    replay_s: float
    comm_s: float
    gain_s: float
    absorbed: tuple[str, ...]

    @property
    def occupancy_s(self) -> float:
        return self.replay_s + self.comm_s

    @property
    def extra_s(self) -> float:
        return self.replay_s - self.gain_s


@dataclass
class AGCGroup:
    """The forward ops of one block in one micro-batch, their B/W ops, and the window they defer into."""

    block: str
    microbatch: int
    forward: list[OpRecord]
    bw: list[list[OpRecord]]
    window: WindowLoad | None = None
    headroom_bytes: float = 0.0
    slack_s: float = 0.0
    candidates: list[AGCCandidate] = field(default_factory=list)

    def ops_of(self, c: AGCCandidate) -> tuple[list[str], list[str]]:
        """(forward op ids, B/W op ids) of a candidate."""
        return [o.id for o in self.forward[c.i:c.j + 1]], [b.id for x in range(c.k, c.j + 1) for b in self.bw[x]]


def _forward_of(st: _State) -> dict[str, str]:
    """recompute op id -> forward op id (``recompute_of``, else same micro-batch, AC segment and index)."""
    key = {(o.microbatch, o.ac_segment, o.seg_index): o.id for o in st.ops if o.phase == "forward" and o.ac_segment}
    out = {}
    for o in st.ops:
        if o.phase == "recompute":
            f = o.recompute_of or key.get((o.microbatch, o.ac_segment, o.seg_index))
            if f is not None:
                out[o.id] = f
    return out


def _groups(st: _State) -> list[AGCGroup]:
    fwd_of = _forward_of(st)
    bw: dict[str, list[OpRecord]] = defaultdict(list)
    for o in st.ops:
        if o.kind in ("B", "W") and o.grad_of:
            bw[fwd_of.get(o.grad_of, o.grad_of)].append(o)
    groups: dict[tuple[str, int], AGCGroup] = {}
    for o in st.ops:
        if o.phase == "forward" and o.kind == "F" and o.block:
            g = groups.setdefault((o.block, o.microbatch), AGCGroup(o.block, o.microbatch, [], []))
            g.forward.append(o)
            g.bw.append(bw.get(o.id, []))
    return list(groups.values())


class _CommIndex:
    """Time of the communication ops of one micro-batch and phase strictly between two positions."""

    def __init__(self, st: _State) -> None:
        self.pos: dict[tuple[int, str], list[int]] = defaultdict(list)
        self.cum: dict[tuple[int, str], list[float]] = defaultdict(lambda: [0.0])
        for i, o in enumerate(st.ops):
            if o.kind == "C":
                key = (o.microbatch, "backward" if o.phase == "backward" else "forward")
                self.pos[key].append(i)
                self.cum[key].append(self.cum[key][-1] + o.time_s)

    def between(self, mb: int, phase: str, p0: int, p1: int) -> float:
        ps, cs = self.pos.get((mb, phase)), self.cum.get((mb, phase))
        if not ps or p1 - p0 < 2:
            return 0.0
        return cs[bisect_left(ps, p1)] - cs[bisect_right(ps, p0)]


def _enumerate(st: _State, g: AGCGroup, comm: _CommIndex, slack_s: float | None = None):
    """Step 1: every candidate segment of the block (forward range i..j no longer than the cap, with the
    B/W ops of a suffix k..j of it, or none), with its memory, replay time, communication and gain.

    memory = stored input of F_i + stored output of F_j, and with B/W ops: the gradient of F_j's output,
    the input gradient the B ops of F_k produce, and the weight gradients of k..j.
    gain = checker time taken off the critical path - replayed communication: the unassigned forward ops,
    the B/W ops, and for each P-DMR segment the candidate takes over (its forward ops all inside i..j and
    k <= its first op + 1, so every op reading a recomputed tensor is replayed too) the last op's extra
    run; P-DMR ops replayed otherwise are the paper's "re-protection" extra cost.
    With ``slack_s``, candidates whose replay and communication exceed it are skipped (they only grow with
    j and with a smaller k), which keeps the search fast on long blocks.
    """
    n, pos = len(g.forward), st.pos
    status = []  # "P": P-DMR, "N": unassigned static, "X": cannot be replayed (dynamic or taken)
    for o in g.forward:
        s = st.strategy[o.id]
        status.append("X" if o.dynamic else "P" if s == "p-dmr" else "N" if s is None else "X")
    bw_ok = [all(st.free(b) for b in bws) for bws in g.bw]
    tf = [o.time_s for o in g.forward]
    tbw = [sum(b.time_s for b in bws) for bws in g.bw]
    # what replaying costs in the window: the op times and the fingerprints of the replayed outputs
    cf = [st.check_s(o) for o in g.forward]
    cbw = [sum(st.check_s(b) for b in bws) for bws in g.bw]
    wbytes = [sum(b.out_bytes for b in bws if b.kind == "W") for bws in g.bw]
    act_in = [max(0, o.in_bytes - o.param_bytes) for o in g.forward]
    d_in = [sum(b.out_bytes for b in bws if b.kind == "B") or act_in[x] for x, bws in enumerate(g.bw)]
    bw_lo = [min((pos[b.id] for b in bws), default=None) for bws in g.bw]
    bw_hi = [max((pos[b.id] for b in bws), default=None) for bws in g.bw]
    index = {o.id: x for x, o in enumerate(g.forward)}
    segs = []  # active P-DMR segments wholly inside this block: (first, last, run cost, id)
    for s in st.pdmr:
        if s.active and s.microbatch == g.microbatch and all(k in index for k in s.ops):
            xs = [index[k] for k in s.ops]
            segs.append((min(xs), max(xs), s.extra_run_s, s.id))
    cap = max(1, st.cfg.agc_max_forward_ops)
    limit = (slack_s or 0.0) * (1 + _TOL) + _TOL
    for i in range(n):
        if status[i] == "X":
            continue
        f_t = p_t = n_t = 0.0  # (f_t: the replay's cost, p_t / n_t: op times, as the gain counts them)
        for j in range(i, min(n, i + cap)):
            if status[j] == "X":
                break
            f_t += cf[j]
            if status[j] == "P":
                p_t += tf[j]
            else:
                n_t += tf[j]
            comm_f = comm.between(g.microbatch, "forward", pos[g.forward[i].id], pos[g.forward[j].id])
            if slack_s is not None and f_t + comm_f > limit:
                break
            inside = [s for s in segs if i <= s[0] and s[1] <= j]
            bw_t, bw_c, w_b, lo, hi = 0.0, 0.0, 0, None, None
            for k in range(j + 1, i - 1, -1):
                if k <= j:
                    if not bw_ok[k]:
                        break
                    if not g.bw[k]:
                        continue
                    bw_t += tbw[k]
                    bw_c += cbw[k]
                    w_b += wbytes[k]
                    lo = bw_lo[k] if lo is None else min(lo, bw_lo[k])
                    hi = bw_hi[k] if hi is None else max(hi, bw_hi[k])
                    comm_b = comm.between(g.microbatch, "backward", lo, hi)
                    if slack_s is not None and f_t + bw_c + comm_f + comm_b > limit:
                        break
                    memory = act_in[i] + 2 * g.forward[j].out_bytes + d_in[k] + w_b
                else:
                    comm_b = 0.0
                    memory = act_in[i] + g.forward[j].out_bytes
                absorbed = tuple(s for s in inside if k <= s[0] + 1)
                gain = n_t + bw_t + sum(s[2] for s in absorbed) - comm_f - comm_b
                yield AGCCandidate(i, k, j, memory, f_t + bw_c, comm_f + comm_b, gain, tuple(s[3] for s in absorbed))


def select_agc(candidates, headroom_bytes: float, slack_s: float) -> AGCCandidate | None:
    """Steps 2-4: drop candidates over the memory headroom, then over the time slack (replay plus its
    communication must fit), and keep the largest positive gain; ties go to the smaller memory, then the
    shorter window occupancy (both leave more to Phase 3), then the earlier segment."""
    best, best_key = None, None
    for c in candidates:
        if c.memory_bytes > headroom_bytes * (1 + _TOL) or c.occupancy_s > slack_s * (1 + _TOL) + _TOL:
            continue
        if c.gain_s <= _TOL:
            continue
        key = (-c.gain_s, c.memory_bytes, c.occupancy_s, c.i, c.j, -c.k)
        if best_key is None or key < best_key:
            best, best_key = c, key
    return best


def _agc_groups(st: _State) -> dict[str, list[AGCGroup]]:
    """Each block-and-micro-batch group with the first static pp window after its last op, by window."""
    pp = [w for w in st.windows if w.kind == "pp" and not w.dynamic]
    by_window: dict[str, list[AGCGroup]] = defaultdict(list)
    for g in _groups(st):
        last = max([st.pos[o.id] for o in g.forward] + [st.pos[b.id] for bws in g.bw for b in bws])
        w = next((w for w in pp if st.wpos[w.id] > last), None)
        if w is not None:
            g.window = w
            by_window[w.id].append(g)
    return by_window


def _constraints(st: _State, w: WindowLoad, groups: list[AGCGroup]) -> None:
    """Per-block headroom and slack: the budget beyond the peak from the stage's first op through the
    window, and the window's time left, each divided evenly over the block groups (blocks of the stage, for
    each micro-batch whose backward precedes the window) deferring into it."""
    t0 = min(o.start_s for g in groups for o in g.forward)
    headroom = max(0.0, st.budget - st.timeline.max_between(t0, w.end_s))
    for g in groups:
        g.headroom_bytes = headroom / len(groups)
        g.slack_s = st.room_s(w) / len(groups)


def agc_candidates(profile: Profile, config: PlannerConfig | None = None) -> list[AGCGroup]:
    """Phase 2's view of a profile after Phase 1: every block group with its window, per-block headroom and
    slack and all its candidate segments (before any is chosen). For inspection and tests."""
    cfg = config or PlannerConfig()
    st = _State(profile, cfg, _budget(profile, cfg))
    phase1_pdmr(st)
    st.charge_pdmr_fingerprints()
    comm = _CommIndex(st)
    out = []
    windows = {w.id: w for w in st.windows}
    for wid, groups in _agc_groups(st).items():
        _constraints(st, windows[wid], groups)
        for g in groups:
            g.candidates = list(_enumerate(st, g, comm))
            out.append(g)
    return out


def phase2_agc(st: _State) -> None:
    """One AGC segment per block and micro-batch (static ops only), into the pp window after its backward."""
    comm = _CommIndex(st)
    windows = {w.id: w for w in st.windows}
    for wid, groups in _agc_groups(st).items():
        w = windows[wid]
        _constraints(st, w, groups)
        for g in groups:
            seen = [0]
            c = select_agc(_counting(_enumerate(st, g, comm, g.slack_s), seen), g.headroom_bytes, g.slack_s)
            if c is not None:
                _commit_agc(st, g, c, w, seen[0])


def _counting(items, seen: list[int]):
    for x in items:
        seen[0] += 1
        yield x


def _commit_agc(st: _State, g: AGCGroup, c: AGCCandidate, w: WindowLoad, enumerated: int) -> None:
    sid = f"agc{len(st.agcs)}:{g.block}:mb{g.microbatch}"
    fwd_ids, bw_ids = g.ops_of(c)
    absorbed = [s for s in st.pdmr if s.id in c.absorbed]
    taken = {k for s in absorbed for k in s.ops + s.recompute_ops}
    checked = [k for k in fwd_ids if st.strategy[k] is None or k in taken] + bw_ids
    checked += [k for s in absorbed for k in s.recompute_ops]
    protected = [k for k in fwd_ids if st.strategy[k] == "p-dmr" and k not in taken]
    first, last = g.forward[c.i], g.forward[c.j]
    boundary = [{"tensor": f"input of {first.id}", "bytes": max(0, first.in_bytes - first.param_bytes)},
                {"tensor": f"output of {last.id}", "bytes": last.out_bytes}]
    if c.k <= c.j:
        boundary.append({"tensor": f"gradient of the output of {last.id}", "bytes": last.out_bytes})
        bk = [b for b in g.bw[c.k] if b.kind == "B"]
        boundary.append({"tensor": f"input gradient from {', '.join(b.id for b in bk) or g.forward[c.k].id}",
                         "bytes": sum(b.out_bytes for b in bk) or max(0, g.forward[c.k].in_bytes - g.forward[c.k].param_bytes)})
        boundary += [{"tensor": f"weight gradient from {b.id}", "bytes": b.out_bytes}
                     for x in range(c.k, c.j + 1) for b in g.bw[x] if b.kind == "W"]
    seg = AGCSegment(sid, g.block, g.microbatch, w.id, fwd_ids, bw_ids, checked, protected, list(c.absorbed), boundary,
                     int(c.memory_bytes), c.replay_s, c.comm_s, c.extra_s, c.gain_s, g.headroom_bytes, g.slack_s,
                     first.start_s, enumerated)
    for k in checked:
        st.assign(k, "agc", window=w.id, agc=sid)
    for s in absorbed:
        s.absorbed_by = sid
    st.timeline.add(first.start_s, w.end_s, c.memory_bytes)
    w.agc.append(sid)
    w.agc_s += c.occupancy_s
    st.agcs.append(seg)


# -- Phase 3 -------------------------------------------------------------------------------------------
def _demote(st: _State, queue: list[OpRecord], w: WindowLoad) -> list[OpRecord]:
    """Step 2: while keeping the queue alive until ``w`` ends would pass the budget somewhere, demote the
    shortest op among those alive at the worst point. Returns the demoted ops (removed from ``queue``)."""
    tl = st.timeline
    sl = tl.span(min(o.start_s for o in queue), w.end_s)
    mem = tl.values()[sl]
    starts = np.array([o.start_s for o in queue])
    where = np.clip(np.searchsorted(tl.grid, starts, side="right") - 1 - sl.start, 0, len(mem) - 1)
    nbytes = np.array([retained_bytes(o, st.cfg.keep_outputs) for o in queue], dtype=float)
    cum = np.cumsum(np.bincount(where, weights=nbytes, minlength=len(mem)))
    order = sorted(range(len(queue)), key=lambda q: (queue[q].time_s, st.pos[queue[q].id]))  # shortest first
    alive = [True] * len(queue)
    demoted = []
    limit = st.budget * (1 + _TOL)
    while True:
        total = mem + cum
        over = (total > limit) & (cum > 0)
        if not over.any():
            break
        t = int(np.argmax(np.where(over, total, -np.inf)))
        victim = next(q for q in order if alive[q] and where[q] <= t)
        alive[victim] = False
        cum[where[victim]:] -= nbytes[victim]
        demoted.append(queue[victim])
    queue[:] = [o for q, o in enumerate(queue) if alive[q]]
    return demoted


def phase3_queue(st: _State) -> None:
    """The D-DMR queue (5.3), scanning ops in execution order. At each window with time left (tp and ep
    windows, what Phase 2 left of pp windows; dynamic windows are the dynamic planner's):
    Step 1 enqueue the unassigned static ops since the last window; Step 2 demote the shortest to naive
    until the queue fits the memory budget (:func:`_demote`); Step 3 defer the best-fit subset by time into
    the window (``d-intra`` for tp/ep, ``d-inter`` for pp/dp). The rest stay queued for later windows;
    whatever is queued at the end runs naive. An op longer than every window still ahead goes to naive at
    once: it could never be deferred, and keeping it queued would only hold memory and push shorter ops out.
    """
    kinds = {"tp", "ep", "pp"} | ({"dp"} if st.cfg.use_dp_windows else set())
    points = [w for w in st.windows if w.kind in kinds and not w.dynamic and st.room_s(w) > _TOL]
    ahead = [0.0] * (len(points) + 1)  # the longest window time left at or after each point
    for n in range(len(points) - 1, -1, -1):
        ahead[n] = max(ahead[n + 1], st.room_s(points[n]))
    queue: list[OpRecord] = []
    cursor = 0
    for n, w in enumerate(points):
        while cursor < len(st.ops) and cursor < st.wpos[w.id]:
            o = st.ops[cursor]
            if st.free(o):
                queue.append(o)
            cursor += 1
        too_long = [o for o in queue if st.check_s(o) > ahead[n] * (1 + _TOL)]  # fits no window ahead: never deferrable
        for o in too_long:
            st.assign(o.id, "naive")
        queue = [o for o in queue if st.check_s(o) <= ahead[n] * (1 + _TOL)]
        room = st.room_s(w)
        if not queue:
            continue
        for o in _demote(st, queue, w):
            st.assign(o.id, "naive")
            w.demoted.append(o.id)
        picked = best_fit([st.check_s(o) for o in queue], room, st.cfg.knapsack_resolution)
        strategy = "d-inter" if w.kind in ("pp", "dp") else "d-intra"
        for idx in picked:
            o = queue[idx]
            nb = retained_bytes(o, st.cfg.keep_outputs)
            st.assign(o.id, strategy, window=w.id)
            st.retained[o.id] = nb
            st.timeline.add(o.start_s, w.end_s, nb)
            w.ops.append(o.id)
            w.ops_s += st.check_s(o)
        chosen = set(picked)
        queue = [o for q, o in enumerate(queue) if q not in chosen]
    for o in queue:
        st.assign(o.id, "naive")


def mark_carried(st: _State) -> float:
    """The naive backward ops the engine may carry past the update into the next iteration's windows (when it
    holds the update, ``[sdc.dmr] carry_last``): all of them (``carry = "unbounded"``, the default), or
    (``"windows"``) as many as those windows have room for. Those windows first run the checks planned there, then
    the held update's check and the fingerprints of the outputs made after this iteration's last window, and the
    carried checks in the time left. So the budget is the windows' room (``window_fill`` of each, less what the
    phases planned there) less those two; the largest checks are marked first (the engine's work per carried op is
    the same whatever its size), each while it fits, and the rest are checked at once. That holds less memory
    across the update, but measured slower: at run time the windows are longer than profiled (the other stage
    does more work too), and unbounded carrying fills them as they come. Carrying is deferral into windows, so only
    Phase 3 calls it (:func:`plan_static`). Returns the budget (seconds)."""
    static = [w for w in st.windows if not w.dynamic]
    room = sum(st.room_s(w) for w in static)
    first = sum(o.time_s for o in st.ops if o.phase == "optimizer" and o.kind != "C")  # the held update's check
    if static and not st.cfg.keep_outputs:
        last = max(st.wpos[w.id] for w in static)
        first += sum(st.fingerprint_s(o) for o in st.ops if st.strategy[o.id] == "p-dmr" and st.pos[o.id] > last)
    budget = left = max(0.0, room - first)
    naive = [o for o in st.ops if st.strategy[o.id] == "naive" and o.phase == "backward"]
    if st.cfg.carry == "windows":
        fits = []
        for o in sorted(naive, key=lambda o: (-st.check_s(o), st.pos[o.id])):
            if st.check_s(o) <= left:
                fits.append(o)
                left -= st.check_s(o)
        naive = fits
    for o in naive:
        st.window_of[o.id] = CARRY
    return budget


# -- plans ---------------------------------------------------------------------------------------------
def _budget(profile: Profile, cfg: PlannerConfig) -> int:
    b = cfg.memory_budget_bytes if cfg.memory_budget_bytes is not None else profile.memory_budget_bytes
    if b is None or not math.isfinite(b) or b < 0:
        raise ConfigError(f"memory budget must be >= 0 bytes, got {b}")
    return int(b)


def _finish(st: _State, baseline: str, phases: list[int], cfg: PlannerConfig | None,
            carry_budget_s: float | None = None, carry_lists: bool = False) -> Plan:
    p = st.p
    plan = Plan(baseline=baseline, phases=phases, memory_budget_bytes=st.budget, carry_budget_s=carry_budget_s,
                carry_lists=carry_lists,
                profile={"model": p.model, "strategy": p.strategy, "rank": p.rank, "stage": p.stage,
                         "iteration_s": p.iteration_s, "ops": len(p.ops), "windows": len(p.windows),
                         "blocks": list(p.blocks), "moe": st.moe},
                pdmr_segments=st.pdmr, agc_segments=st.agcs, windows=st.windows,
                config=asdict(cfg) if cfg is not None else {})
    for o in st.ops:
        s = st.strategy[o.id]
        plan.ops[o.id] = OpPlan(s or "none", st.window_of.get(o.id), st.agc_of.get(o.id), o.kind, o.phase, o.block,
                                o.microbatch, o.start_s, o.time_s, st.retained.get(o.id, 0))
    deferred = bool(st.agcs) or any(w.ops for w in st.windows)
    plan.memory_curve = st.timeline.curve() if deferred else [(float(t), int(b)) for t, b in p.memory_curve]
    plan.summary = summarize(plan, st.peak)
    if deferred:
        plan.summary["peak_with_deferral_bytes"] = int(round(max(st.timeline.values())))
    plan.summary["dynamic_budget_bytes"] = max(0, st.budget - plan.summary["peak_with_deferral_bytes"])
    return plan


def plan_static(profile: Profile, config: PlannerConfig | None = None) -> Plan:
    """The SpareTrain plan for one rank's profile: Phase 1, then 2 and 3 as ``config.phases`` enables.
    Every non-communication op ends with exactly one strategy (checked before returning)."""
    cfg = config or PlannerConfig()
    phases = parse_phases(cfg.phases)
    if not 0 < cfg.window_fill <= 1:
        raise ConfigError(f"window_fill must be in (0, 1], got {cfg.window_fill}")
    if cfg.carry not in CARRY_MODES:
        raise ConfigError(f"carry must be {' or '.join(CARRY_MODES)}, got {cfg.carry!r}")
    validate_profile(profile)
    budget = _budget(profile, cfg)
    st = _State(profile, cfg, budget)
    phase1_pdmr(st)
    st.charge_pdmr_fingerprints()
    if 2 in phases:
        phase2_agc(st)
    if 3 in phases:
        phase3_queue(st)
    for o in st.ops:
        if st.strategy[o.id] is None:
            st.assign(o.id, "dynamic" if o.dynamic and 3 in phases else "naive")
    # carrying past the update defers checks into windows (the next iteration's): Phase 3's work, so the ablation's
    # Phase 1 and Phases 1+2 check their naive ops at once, as the paper's do. The list ops over every gradient
    # (averaging, clipping) have no entry of their own (the engine checks them in pieces, or carries them whole):
    # carried only where everything may be, so that no check the budget does not count is held across the update
    carry = 3 in phases
    plan = _finish(st, "sparetrain", list(phases), cfg, carry_budget_s=mark_carried(st) if carry else 0.0,
                   carry_lists=carry and cfg.carry == "unbounded")
    coverage_report(plan, profile)
    return plan


def naive_only(profile: Profile) -> Plan:
    """Baseline: every op checked by naive DMR (run twice back to back)."""
    validate_profile(profile)
    st = _State(profile, PlannerConfig(), int(profile.memory_budget_bytes))
    for o in st.ops:
        if o.kind != "C":
            st.assign(o.id, "naive")
    plan = _finish(st, "naive-only", [], None)
    coverage_report(plan, profile)
    return plan


def no_dmr(profile: Profile) -> Plan:
    """Baseline: nothing checked (coverage 0)."""
    validate_profile(profile)
    st = _State(profile, PlannerConfig(), int(profile.memory_budget_bytes))
    return _finish(st, "no-dmr", [], None)


def plan_profile(profile: Profile, phases: str | tuple[int, ...] = (1, 2, 3),
                 memory_budget_bytes: int | None = None, **kw: Any) -> Plan:
    """Convenience: :func:`plan_static` with a phases string or tuple and a budget override."""
    return plan_static(profile, PlannerConfig(phases=parse_phases(phases), memory_budget_bytes=memory_budget_bytes, **kw))
