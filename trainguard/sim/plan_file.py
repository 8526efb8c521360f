"""The plan ``trainguard plan cluster`` chose, as a TOML file that a run can read back.

Relies on the standard library only (``tomllib`` reads; a small writer for the flat tables used here).

``write_plan(path, plan)`` / ``read_plan(path) -> SparePlan``. The file has top-level keys (the decision:
scheme, groups, redundancy, checkpoint interval, step time, ...) and an ``[inputs]`` table with every
cluster parameter the decision was computed from (``ClusterParams`` field names). ``read_plan`` refuses
unknown keys, missing keys and wrong types with a one-line :class:`~trainguard.errors.ConfigError`.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from trainguard.errors import ConfigError

PLAN_FORMAT_VERSION = 1
SCHEMES = ("spare", "replication", "checkpoint")


@dataclass
class SparePlan:
    """A fault-tolerance plan for one cluster.

    ``scheme``: ``spare`` (stacked shards), ``replication`` or ``checkpoint`` (checkpoint/restart only).
    ``groups`` data-parallel groups of ``gpus_per_group`` GPUs; ``redundancy`` copies of each data shard
    (1 for checkpoint-only). Checkpoint every ``checkpoint_interval_s`` seconds of training (the save
    included), which is ``checkpoint_every_steps`` steps of ``step_time_s`` (the mean step time of the
    plan, all-reduce included). ``domain_slots[k]``: physical group slot for logical group ``k`` when the
    placement spreads copies over failure domains (empty: slot ``k``).
    """

    scheme: str
    groups: int
    redundancy: int
    gpus_per_group: int
    checkpoint_every_steps: int
    checkpoint_interval_s: float
    checkpoint_save_s: float
    step_time_s: float
    stack_compute_s: float
    allreduce_s: float
    steps: int
    expected_time_to_train_days: float
    expected_time_to_train_days_lo: float = math.nan
    expected_time_to_train_days_hi: float = math.nan
    expected_availability: float = math.nan
    mean_stacks_per_step: float = 1.0
    ranked_by: str = "simulation"
    seeds: list[int] = field(default_factory=list)
    domain_slots: list[int] = field(default_factory=list)
    format_version: int = PLAN_FORMAT_VERSION
    created_by: str = "trainguard plan cluster"
    inputs: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if self.scheme not in SCHEMES:
            raise ConfigError(f"plan scheme must be one of {', '.join(SCHEMES)}, got {self.scheme!r}")
        if self.groups < 1 or self.gpus_per_group < 1 or self.redundancy < 1 or self.steps < 1:
            raise ConfigError("plan groups, gpus_per_group, redundancy and steps must be >= 1")
        if self.scheme == "checkpoint" and self.redundancy != 1:
            raise ConfigError(f"a checkpoint-only plan has redundancy 1, got {self.redundancy}")
        if self.redundancy > self.groups:
            raise ConfigError(f"plan redundancy {self.redundancy} exceeds its {self.groups} groups")
        if self.checkpoint_every_steps < 1 or not self.checkpoint_interval_s > 0 or not self.step_time_s > 0:
            raise ConfigError("plan checkpoint_every_steps must be >= 1, checkpoint_interval_s and step_time_s > 0")
        if self.domain_slots and sorted(self.domain_slots) != list(range(self.groups)):
            raise ConfigError("plan domain_slots must be a permutation of 0..groups-1")
        if self.format_version != PLAN_FORMAT_VERSION:
            raise ConfigError(f"plan format_version {self.format_version} is not supported (expected {PLAN_FORMAT_VERSION})")


# ----------------------------------------------------------------------------- TOML writing
def _key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else _str(k)


def _str(s: str) -> str:
    out = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{out}"'


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if hasattr(v, "item"):
        return _value(v.item())
    raise ConfigError(f"cannot write {type(v).__name__} value {v!r} to a plan file")


def dumps_plan(plan: SparePlan) -> str:
    plan.validate()
    d = asdict(plan)
    inputs = d.pop("inputs")
    lines = ["# trainguard fault-tolerance plan (read it with trainguard.sim.plan_file.read_plan)"]
    lines += [f"{_key(k)} = {_value(v)}" for k, v in d.items()]
    lines += ["", "[inputs]"]
    for k, v in inputs.items():
        if v is None:
            continue  # TOML has no null: an absent input means "default / not set"
        lines.append(f"{_key(k)} = {_value(v)}")
    return "\n".join(lines) + "\n"


def write_plan(path: str | Path, plan: SparePlan) -> Path:
    """Write ``plan`` as TOML (parent folders are created); returns the path."""
    path = Path(path)
    text = dumps_plan(plan)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as err:
        raise ConfigError(f"cannot write plan file {path}: {err.strerror or err}") from None
    return path


def read_plan(path: str | Path) -> SparePlan:
    """Read and validate a plan file written by :func:`write_plan`."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read plan file {path}: {err.strerror or err}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"plan file {path} is not valid TOML: {err}") from None
    known = {f.name: f for f in fields(SparePlan)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"plan file {path}: unknown key(s) {', '.join(unknown)}")
    kw: dict[str, Any] = {}
    for name, f in known.items():
        if name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ConfigError(f"plan file {path}: missing key {name}")
            continue
        v = data[name]
        typ = str(f.type)
        ok = (("int" in typ and "list" not in typ and isinstance(v, int) and not isinstance(v, bool))
              or (typ == "float" and isinstance(v, (int, float)) and not isinstance(v, bool))
              or (typ == "str" and isinstance(v, str))
              or (typ.startswith("list") and isinstance(v, list) and all(isinstance(x, int) for x in v))
              or (typ.startswith("dict") and isinstance(v, dict)))
        if not ok:
            raise ConfigError(f"plan file {path}: {name} has the wrong type ({type(v).__name__}, expected {typ})")
        kw[name] = float(v) if typ == "float" else v
    plan = SparePlan(**kw)
    plan.validate()
    return plan
