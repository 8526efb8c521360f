"""Failure trails for the time-to-train simulation: the same seed gives the same failures to every scheme.

Relies on numpy (seeded ``Generator`` streams) and the standard library (``csv`` for traces).

A *unit* is a physical group slot (``gpus_per_unit`` GPUs); units ``0..N-1`` start in the job, units
``N..N+S-1`` are hot spares. A trail yields failure events ``(time, units)`` in absolute time (seconds). A
scheme decides what an event does to it (nothing if the unit is idle or already down), so running several
schemes on the trail of one seed is a *paired* comparison, as the SPARe paper did with its three event
trails. Models (``FailureSpec.model``):

* ``weibull`` with ``renewal="restart"`` -- every group is one Weibull unit whose mean time to failure is
  ``MTBF_gpu / G`` and whose clock restarts at each global restart (and at the job start), so with
  ``k < 1`` failures crowd right after every restart (infant mortality). This is the model the SPARe
  paper's numbers fit; the paper does not state it. Failure times then depend on when a scheme restarts;
  the pairing is by common random numbers: the draw of unit ``u`` in its ``e``-th epoch is the same for
  every scheme. (Restarting every *GPU's* clock instead would make a fresh group fail after the minimum of
  ``G`` Weibulls, ``G^(1/k - 1)`` times sooner on average: 31x at ``G = 3000``.)
* ``weibull`` with ``renewal="failure"`` -- every GPU is its own Weibull renewal process that restarts only
  at its own failure (after the repair). The cluster has been running, so the first failure of a GPU is
  the *equilibrium* residual life (length-biased interval ``lambda Gamma(1+1/k)^(1/k)`` times a uniform).
  Failure times are absolute: every scheme sees exactly the same failure times per GPU.
* ``exponential`` -- the ``k = 1`` case of the former (memoryless, so the renewal choice does not matter).
* ``trace`` -- replay a CSV of failure times (column ``time_s`` or ``time_h``; optional ``gpu`` or
  ``group``; without either, each failure hits a uniformly random unit drawn from the seed). A trace
  shorter than the run repeats, shifted by its period (``period_s`` argument, default its last time).

Failure domains (``gpus_per_domain > 0`` and ``domain_mtbf_hours > 0``): each domain (a rack, a leaf
switch) fails as a Poisson process of mean ``domain_mtbf_hours`` and takes down every unit in it; domain
events are absolute in time for every model. A domain holds ``gpus_per_domain / G`` units (it must be a
multiple of ``G``) or, when a group spans several domains (``G`` a multiple of ``gpus_per_domain``), a domain
failure takes down the one unit that contains it.

``repair_s``: a unit hit by a failure cannot rejoin before ``time + repair_s`` (the simulation makes a
global restart wait for it unless a hot spare is healthy).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainguard.errors import TrainguardError

MODELS = ("weibull", "exponential", "trace")
RENEWALS = ("restart", "failure")

# seed streams (one per source, so adding a source does not shift the others)
_S_EPOCH, _S_GPU, _S_DOMAIN, _S_TRACE = 1, 5, 4, 3


@dataclass
class FailureSpec:
    """What fails and how (all times in seconds, MTBF in hours per GPU / per domain)."""

    model: str = "weibull"
    weibull_shape: float = 0.7
    renewal: str = "restart"
    gpu_mtbf_hours: float = 54 * 24 * 16384 / 419
    repair_s: float = 0.0
    gpus_per_domain: int = 0
    domain_mtbf_hours: float = 0.0
    trace_path: str | None = None
    trace_period_s: float | None = None

    def validate(self) -> None:
        if self.model not in MODELS:
            raise TrainguardError(f"failure model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.renewal not in RENEWALS:
            raise TrainguardError(f"renewal must be one of {', '.join(RENEWALS)}, got {self.renewal!r}")
        if not (self.weibull_shape > 0 and math.isfinite(self.weibull_shape)):
            raise TrainguardError(f"Weibull shape must be > 0, got {self.weibull_shape}")
        if self.model != "trace" and not (self.gpu_mtbf_hours > 0 and math.isfinite(self.gpu_mtbf_hours)):
            raise TrainguardError(f"per-GPU MTBF must be > 0 hours, got {self.gpu_mtbf_hours}")
        if not self.repair_s >= 0:
            raise TrainguardError(f"repair time must be >= 0 s, got {self.repair_s}")
        if self.gpus_per_domain < 0 or self.domain_mtbf_hours < 0:
            raise TrainguardError("failure-domain size and MTBF must be >= 0")
        if self.model == "trace" and not self.trace_path:
            raise TrainguardError("failure model 'trace' needs a trace file (--trace FILE)")

    @property
    def domains_on(self) -> bool:
        return self.gpus_per_domain > 0 and self.domain_mtbf_hours > 0


# ----------------------------------------------------------------------------- traces
@dataclass
class Trace:
    times_s: np.ndarray          # sorted
    gpu: np.ndarray | None       # GPU index per failure, or None
    group: np.ndarray | None     # group index per failure, or None
    period_s: float


def load_trace(path: str | Path, period_s: float | None = None) -> Trace:
    """Read a failure trace CSV (header row; ``time_s`` or ``time_h``; optional ``gpu`` or ``group``)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise TrainguardError(f"cannot read failure trace {path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise TrainguardError(f"failure trace {path} is not a text (UTF-8) CSV file") from None
    try:
        reader = csv.DictReader(text.splitlines(), strict=True)  # (strict: an unclosed quote is an error, not a value)
        rows = list(reader)
    except csv.Error as err:
        raise TrainguardError(f"failure trace {path} is not a valid CSV file: {err}") from None
    if not rows:
        raise TrainguardError(f"failure trace {path} has no rows (expected a header and one failure per line)")
    header = [c.strip().lower() for c in reader.fieldnames]  # (read with the first row: there is one)
    if twice := sorted({c for c in header if header.count(c) > 1}):
        # (csv keeps the last of a column named twice: the other would be read as if it were not there)
        raise TrainguardError(f"failure trace {path} names the column {', '.join(twice)} twice in its header")
    cols = dict(zip(header, reader.fieldnames))
    if "time_s" in cols:
        tkey, unit = cols["time_s"], 1.0
    elif "time_h" in cols:
        tkey, unit = cols["time_h"], 3600.0
    else:
        raise TrainguardError(f"failure trace {path} needs a time_s or time_h column, has {', '.join(cols)}")
    idkey = cols.get("gpu") or cols.get("group")
    kind = "gpu" if "gpu" in cols else ("group" if "group" in cols else None)
    times, ids = [], []
    for i, row in enumerate(rows, start=2):
        if None in row:  # (csv puts the fields past the header's under the key None)
            raise TrainguardError(f"failure trace {path} line {i} has more fields than its header ({len(header)})")
        try:
            t = float(row[tkey]) * unit
            ident = int(row[idkey]) if idkey else -1
        except (TypeError, ValueError):
            raise TrainguardError(f"failure trace {path} line {i}: cannot parse {row!r}") from None
        if not (t >= 0 and math.isfinite(t)) or (idkey and ident < 0):
            raise TrainguardError(f"failure trace {path} line {i}: times must be finite and >= 0 (in seconds) and ids "
                                  f">= 0, got {row!r}")
        times.append(t)
        ids.append(ident)
    order = np.argsort(np.asarray(times), kind="stable")
    t_arr = np.asarray(times, dtype=np.float64)[order]
    id_arr = np.asarray(ids, dtype=np.int64)[order]
    period = float(period_s) if period_s is not None else float(t_arr[-1])
    if not period > 0 or period < t_arr[-1]:
        raise TrainguardError(f"trace period must be > 0 and >= the last failure time ({t_arr[-1]:.0f} s), got {period}")
    return Trace(t_arr, id_arr if kind == "gpu" else None, id_arr if kind == "group" else None, period)


# ----------------------------------------------------------------------------- sources
class _Source:
    """Events in time order. ``time_at(k)`` / ``units_at(k)``: the ``k``-th pending event (without consuming it;
    ``inf`` when there is none); ``pop()`` consumes the first."""

    def time_at(self, k: int) -> float:
        raise NotImplementedError

    def units_at(self, k: int) -> np.ndarray:
        raise NotImplementedError

    def pop(self) -> tuple[float, np.ndarray]:
        raise NotImplementedError

    def peek(self) -> float:
        return self.time_at(0)

    def peek_units(self) -> np.ndarray:
        return self.units_at(0)

    def start_epoch(self, t: float, epoch: int, in_use: np.ndarray) -> None:
        pass


class _Windowed(_Source):
    """Absolute-time source generated window by window (fixed windows: the same events whatever is consumed
    or looked ahead at)."""

    def __init__(self, window_s: float):
        self.window = float(window_s)
        self.hi = 0.0
        self.bt: list[float] = []
        self.bu: list[np.ndarray] = []
        self.i = 0
        self.exhausted = False

    def _generate(self, lo: float, hi: float) -> tuple[np.ndarray, list[np.ndarray]]:
        raise NotImplementedError

    def _ensure(self, k: int) -> None:
        if self.i > 4096:  # drop the consumed prefix (offsets are relative to i)
            del self.bt[:self.i]
            del self.bu[:self.i]
            self.i = 0
        empty = 0
        while self.i + k >= len(self.bt) and not self.exhausted:
            lo, self.hi = self.hi, self.hi + self.window
            t, u = self._generate(lo, self.hi)
            self.bt.extend(t.tolist())
            self.bu.extend(u)
            empty = empty + 1 if len(u) == 0 else 0
            if empty > 100_000:
                self.exhausted = True

    def time_at(self, k: int) -> float:
        self._ensure(k)
        j = self.i + k
        return self.bt[j] if j < len(self.bt) else math.inf

    def units_at(self, k: int) -> np.ndarray:
        self._ensure(k)
        j = self.i + k
        return self.bu[j] if j < len(self.bu) else np.empty(0, dtype=np.int64)

    def pop(self) -> tuple[float, np.ndarray]:
        out = (self.time_at(0), self.units_at(0))
        if math.isfinite(out[0]):
            self.i += 1
        return out


class _GpuRenewal(_Windowed):
    """Every GPU a Weibull renewal process (renews at its own failure + repair), started in equilibrium."""

    def __init__(self, spec: FailureSpec, n_units: int, gpus_per_unit: int, seed: int):
        k = 1.0 if spec.model == "exponential" else spec.weibull_shape
        mtbf_s = spec.gpu_mtbf_hours * 3600.0
        self.k, self.lam = k, mtbf_s / math.gamma(1.0 + 1.0 / k)
        self.G = int(gpus_per_unit)
        self.repair = spec.repair_s
        self.rng = np.random.default_rng([seed, _S_GPU])
        n_gpus = n_units * self.G
        length = self.lam * self.rng.gamma(1.0 + 1.0 / k, size=n_gpus) ** (1.0 / k)  # length-biased interval
        self.next = length * self.rng.random(n_gpus)  # equilibrium residual life
        cluster_mtbf = mtbf_s / n_gpus
        super().__init__(max(512.0 * cluster_mtbf, 60.0))

    def _generate(self, lo, hi):
        ts, us = [], []
        while True:
            idx = np.flatnonzero(self.next < hi)
            if idx.size == 0:
                break
            ts.append(self.next[idx].copy())
            us.append(idx // self.G)
            self.next[idx] += self.repair + self.lam * self.rng.weibull(self.k, idx.size)
        if not ts:
            return np.empty(0), []
        t = np.concatenate(ts)
        u = np.concatenate(us)
        o = np.argsort(t, kind="stable")
        return t[o], [u[j:j + 1] for j in o]


class _EpochRenewal(_Source):
    """Weibull clocks of every unit in use restart at each epoch (job start, global restart)."""

    def __init__(self, spec: FailureSpec, n_units: int, gpus_per_unit: int, seed: int):
        k = spec.weibull_shape
        self.k = k
        self.scale = spec.gpu_mtbf_hours * 3600.0 / gpus_per_unit / math.gamma(1.0 + 1.0 / k)
        self.seed = seed
        self.n = n_units
        self.t = np.asarray([math.inf])
        self.u = np.zeros(1, dtype=np.int64)
        self.i = 0

    def start_epoch(self, t, epoch, in_use):
        rng = np.random.default_rng([self.seed, _S_EPOCH, epoch])
        x = t + self.scale * rng.weibull(self.k, self.n)  # one draw per unit: the same for every scheme
        x[~in_use] = math.inf
        o = np.argsort(x, kind="stable")
        self.t, self.u, self.i = x[o], o, 0

    def time_at(self, k):
        j = self.i + k
        return float(self.t[j]) if j < self.t.size else math.inf

    def units_at(self, k):
        j = self.i + k
        return self.u[j:j + 1]

    def pop(self):
        out = (self.time_at(0), self.units_at(0))
        self.i += 1
        return out


class _TraceSource(_Windowed):
    def __init__(self, trace: Trace, n_units: int, gpus_per_unit: int, seed: int):
        self.trace = trace
        self.n, self.G = n_units, gpus_per_unit
        if trace.gpu is not None and trace.gpu.max() >= n_units * gpus_per_unit:
            raise TrainguardError(f"failure trace names GPU {int(trace.gpu.max())} but the cluster has "
                                  f"{n_units * gpus_per_unit} GPUs (including spares)")
        if trace.group is not None and trace.group.max() >= n_units:
            raise TrainguardError(f"failure trace names group {int(trace.group.max())} but there are {n_units} groups")
        self.rng = np.random.default_rng([seed, _S_TRACE])
        self.rep = 0
        super().__init__(trace.period_s)

    def _generate(self, lo, hi):
        tr = self.trace
        t = tr.times_s + self.rep * tr.period_s
        if tr.gpu is not None:
            u = tr.gpu // self.G
        elif tr.group is not None:
            u = tr.group
        else:
            u = self.rng.integers(0, self.n, tr.times_s.size)
        self.rep += 1
        return t, [u[j:j + 1] for j in range(t.size)]


class _Domains(_Windowed):
    """Each failure domain fails as a Poisson process; an event takes down every unit of the domain."""

    def __init__(self, spec: FailureSpec, n_units: int, gpus_per_unit: int, seed: int):
        G, gd = int(gpus_per_unit), int(spec.gpus_per_domain)
        if gd >= G:
            if gd % G:
                raise TrainguardError(f"a failure domain of {gd} GPUs must hold whole groups of {G} GPUs "
                                      "(a multiple of the group size), or divide the group size")
            per = gd // G
            self.members = [np.arange(d * per, min((d + 1) * per, n_units)) for d in range(-(-n_units // per))]
        else:
            if G % gd:
                raise TrainguardError(f"a failure domain of {gd} GPUs must divide the group size {G} (or be a multiple of it)")
            per = G // gd
            self.members = [np.asarray([d // per]) for d in range(n_units * per)]
        self.rate = len(self.members) / (spec.domain_mtbf_hours * 3600.0)
        self.rng = np.random.default_rng([seed, _S_DOMAIN])
        super().__init__(max(256.0 / self.rate, 60.0))

    def _generate(self, lo, hi):
        k = self.rng.poisson(self.rate * (hi - lo))
        t = np.sort(lo + (hi - lo) * self.rng.random(k))
        d = self.rng.integers(0, len(self.members), k)
        return t, [self.members[j] for j in d]


class FailureTrail:
    """All failure sources of one seed merged in time order (see the module docstring)."""

    def __init__(self, spec: FailureSpec, n_units: int, gpus_per_unit: int, seed: int, trace: Trace | None = None):
        spec.validate()
        self.spec = spec
        self.n_units = int(n_units)
        if spec.model == "trace":
            trace = trace or load_trace(spec.trace_path, spec.trace_period_s)
            main: _Source = _TraceSource(trace, n_units, gpus_per_unit, seed)
        elif spec.model == "exponential" or spec.renewal == "failure":
            main = _GpuRenewal(spec, n_units, gpus_per_unit, seed)
        else:
            main = _EpochRenewal(spec, n_units, gpus_per_unit, seed)
        self.sources: list[_Source] = [main]
        if spec.domains_on:
            self.sources.append(_Domains(spec, n_units, gpus_per_unit, seed))
        self.epoch = -1

    @property
    def absolute(self) -> bool:
        """True when failure times do not depend on the scheme (everything but Weibull renewed at restart)."""
        return not isinstance(self.sources[0], _EpochRenewal)

    def start_epoch(self, t: float, in_use: np.ndarray) -> None:
        """The job (re)starts at ``t`` with the units in ``in_use`` (bool per unit)."""
        self.epoch += 1
        for s in self.sources:
            s.start_epoch(t, self.epoch, in_use)

    def job_down(self) -> None:
        """The job stopped (global restart): clocks that renew at restart stop producing failures until the
        next :meth:`start_epoch`; absolute sources go on (their failures still need repair)."""
        for s in self.sources:
            if isinstance(s, _EpochRenewal):
                s.i = s.t.size

    def peek(self) -> float:
        return min(s.peek() for s in self.sources)

    def pop(self) -> tuple[float, np.ndarray]:
        best = min(self.sources, key=lambda s: s.peek())
        return best.pop()

    def peek_event(self) -> tuple[float, np.ndarray]:
        """The next event without consuming it (``(inf, [])`` when there is none)."""
        best = min(self.sources, key=lambda s: s.peek())
        t = best.peek()
        return (t, best.peek_units()) if math.isfinite(t) else (math.inf, np.empty(0, dtype=np.int64))

    def next_matching(self, keep, t_max: float) -> float:
        """Time of the first pending event (not consumed) whose units satisfy ``keep(units)``; ``inf`` if none
        comes before ``t_max``. Nothing is consumed: an event that does not matter now may matter after a
        global restart brings its group back."""
        offs = [0] * len(self.sources)
        while True:
            best, t = None, math.inf
            for j, s in enumerate(self.sources):
                tj = s.time_at(offs[j])
                if tj < t:
                    best, t = j, tj
            if best is None or t > t_max:
                return math.inf
            if keep(self.sources[best].units_at(offs[best])):
                return t
            offs[best] += 1

    def events_until(self, t_end: float) -> list[tuple[float, tuple[int, ...]]]:
        """Consume and return every event up to ``t_end`` (for inspection and tests)."""
        out = []
        while self.peek() <= t_end:
            t, u = self.pop()
            out.append((t, tuple(int(x) for x in u)))
        return out
