"""What the DMR profiler records about one training iteration, and what the planners read.

A :class:`Profile` is a list of every op the iteration executed on one rank (forward, activation-checkpoint
recompute, backward input- and weight-gradient ops, optimizer), with its time, the bytes of its inputs and
outputs, where it sits (leaf module, transformer block, AC segment) and whether it is data dependent (MoE);
the idle windows of the iteration (pipeline transfers, tensor/expert-parallel collectives) with start and
duration; and the device memory over the iteration with the budget. It is saved as JSON. Relies on the
standard library only.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

Phase = Literal["forward", "recompute", "backward", "optimizer"]
# F: forward op; B: input-gradient op; W: weight-gradient op; O: optimizer op; C: communication (never re-executed)
Kind = Literal["F", "B", "W", "O", "C"]
WindowKind = Literal["pp", "tp", "ep", "dp"]


@dataclass
class OpRecord:
    id: str  # unique within the iteration on this rank, e.g. "forward:123"
    name: str  # ATen overload, e.g. "aten.mm.default"
    phase: Phase
    kind: Kind
    module: str = ""  # leaf module path ("layers.0.feed_forward.w1"), "" when unknown
    block: str = ""  # transformer block ("layers.0"), "" outside blocks (embedding, head, optimizer)
    ac_segment: str | None = None  # path of the activation-checkpointed module containing the op
    seg_index: int = -1  # position among the forward ops of its AC segment
    seg_last: bool = False  # the last forward op of its AC segment (P-DMR runs it once more)
    start_s: float = 0.0  # from the start of the iteration
    time_s: float = 0.0
    in_bytes: int = 0  # tensor inputs
    out_bytes: int = 0  # tensor outputs
    comm_s: float = 0.0  # communication needed to gather its inputs (the P-DMR exception rule, Fig. 7)
    dynamic: bool = False  # data dependent (MoE experts): planned at run time
    microbatch: int = 0
    grad_of: str | None = None  # for B / W ops: the forward op they differentiate, when known
    # Added for the planners (optional; defaults keep older profiles valid):
    param_bytes: int = 0  # bytes of in_bytes that are parameters (kept alive anyway: not retained by deferral)
    recompute_of: str | None = None  # for recompute ops: the forward op they re-execute, when known
    ac_call: int = -1  # which execution of its AC segment (a module checkpointed twice in a micro-batch), -1: unknown


@dataclass
class Window:
    id: str
    kind: WindowKind
    start_s: float
    duration_s: float
    after_op: str  # id of the op after which the window opens
    dynamic: bool = False  # duration unknown in advance (expert all-to-all)
    block: str = ""  # the block whose backward precedes the window (pipeline windows)


@dataclass
class Profile:
    model: str = ""
    strategy: str = "single"
    rank: int = 0
    stage: int = 0
    iteration_s: float = 0.0
    memory_budget_bytes: int = 0
    peak_bytes: int = 0
    memory_curve: list[tuple[float, int]] = field(default_factory=list)  # (time from start, bytes in use)
    blocks: list[str] = field(default_factory=list)  # transformer blocks on this rank, in order
    ops: list[OpRecord] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        d = dict(data)
        d["ops"] = [OpRecord(**o) for o in d.get("ops", [])]
        d["windows"] = [Window(**w) for w in d.get("windows", [])]
        d["memory_curve"] = [tuple(x) for x in d.get("memory_curve", [])]
        return cls(**d)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_json(json.loads(Path(path).read_text()))

    def op(self, op_id: str) -> OpRecord:
        for o in self.ops:
            if o.id == op_id:
                return o
        raise KeyError(op_id)


def median_profile(profiles: list[Profile]) -> Profile:
    """One profile from several of the same iteration (``[sdc.dmr] profile_steps``): the last one, with each op's
    and each window's time the median over the profiles that recorded it (ops and windows match by id), the
    iteration's time the median too, and the peak the largest seen (the budget keeps the last one's headroom above
    it).

    Why: the plan is made once, from what the profile says each op costs. On a loaded host one op preempted while
    profiled reads tens of milliseconds too long, fits no window, and is checked on the critical path for the rest
    of the run; the median of three ignores one such reading."""
    if not profiles:
        raise ValueError("median_profile needs at least one profile")
    last = profiles[-1]
    if len(profiles) == 1:
        return last
    op_times: dict[str, list[float]] = {}
    window_times: dict[str, list[float]] = {}
    for p in profiles:
        for o in p.ops:
            op_times.setdefault(o.id, []).append(o.time_s)
        for w in p.windows:
            window_times.setdefault(w.id, []).append(w.duration_s)
    peak = max(p.peak_bytes for p in profiles)
    return replace(last, iteration_s=statistics.median(p.iteration_s for p in profiles), peak_bytes=peak,
                   memory_budget_bytes=last.memory_budget_bytes - last.peak_bytes + peak,
                   ops=[replace(o, time_s=statistics.median(op_times[o.id])) for o in last.ops],
                   windows=[replace(w, duration_s=statistics.median(window_times[w.id])) for w in last.windows])
