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
from dataclasses import asdict, dataclass, field
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
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_json(json.loads(Path(path).read_text()))

    def op(self, op_id: str) -> OpRecord:
        for o in self.ops:
            if o.id == op_id:
                return o
        raise KeyError(op_id)
