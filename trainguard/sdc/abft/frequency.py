"""Adaptive ABFT detection frequency (ATTNChecker Sec. 4.4, Algorithm 1).

Fault model: errors that produce INF, NaN or near-INF occur as a Poisson process per flop with rates
lambda_e (errors / flop). An operation of n flops has k errors of type e with probability
Poisson(k; lambda_e n). A protection section S = {OP_1..OP_m} tolerates one error:

    R_free(S)   = prod_i prod_e exp(-lambda_e n_i)                 (no error in S)
    R_e(S, i)   = lambda_e n_i R_free(S)                           (exactly one, of type e, in OP_i)
    FC_S(f)     = R_free + sum_i sum_e R_e(S, i) [f + (1 - f)(1 - phi_i^e)]

phi_i^e is the probability that a type-e error in OP_i leads to a non-trainable state (Table 4 of the
paper, measured by ``trainguard study attention``); an error is harmless if ABFT checks S (probability
f) or if it does not derail training. FC_att = FC_AS FC_CL FC_O. The overhead is
T = sum_S f_S T_S with T_S the cost of checking S on every execution.

Fault-coverage efficiency is the coverage bought per unit of overhead:
``FCE_S = dFC_S / d(f_S T_S) = sum_i sum_e R_e(S, i) phi_i^e / T_S``. (The extracted paper text writes
H = f + (1-f) phi and an FCE numerator with (1 - phi); both contradict its own definition of phi as the
probability of a *non-trainable* state, so we use the derivative of the FC that definition implies.)
Algorithm 1 then spends overhead on sections in decreasing FCE until the target coverage is met, and
returns f_S = t_S / T_S. FC is combined additively as in the paper (exact to first order, since every
1 - FC_S is tiny).

Inputs that can be measured instead of typed in: ``phi`` (the probabilities ``trainguard study
attention`` measures, ``StudyResult.phi()``; default: the paper's Table 4, :data:`PAPER_PHI`) and
``section_cost`` (seconds per attention layer of checking each section, as ``trainguard bench abft``
measures them, ``section_check_cost_s``, with ``attention_cost`` the unchecked attention's own time in the
same unit; default: the checksum work of ATTNChecker's scheme, O(mk + kn + mn) per GEMM of m x k by
k x n, relative to the attention GEMMs' flops). Relies on the standard library only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainguard.errors import ConfigError

ERROR_TYPES = ("inf", "nan", "near-inf")
SECTION_OPS = {"AS": ("q", "k", "scores"), "CL": ("v", "context"), "O": ("output",)}

# Table 4 of the ATTNChecker paper: probability that one error makes training non-trainable (NaN loss).
# The output projection O is not in the table: it feeds the residual stream like CL, so CL's row is used.
PAPER_PHI: dict[str, dict[str, dict[str, float]]] = {
    "bert": {"inf": dict(q=1.0, k=1.0, v=1.0, scores=1.0, context=1.0),
             "nan": dict(q=1.0, k=1.0, v=1.0, scores=1.0, context=1.0),
             "near-inf": dict(q=0.459, k=0.434, v=0.063, scores=0.002, context=0.006)},
    "gpt2": {"inf": dict(q=0.918, k=0.868, v=1.0, scores=0.569, context=1.0),
             "nan": dict(q=1.0, k=1.0, v=1.0, scores=0.547, context=1.0),
             "near-inf": dict(q=0.384, k=0.372, v=0.010, scores=0.005, context=0.007)},
    "gpt-neo": {"inf": dict(q=1.0, k=0.856, v=1.0, scores=0.547, context=1.0),
                "nan": dict(q=1.0, k=1.0, v=1.0, scores=0.547, context=1.0),
                "near-inf": dict(q=0.103, k=0.144, v=0.058, scores=0.112, context=0.096)},
    "roberta": {"inf": dict(q=1.0, k=0.999, v=1.0, scores=1.0, context=1.0),
                "nan": dict(q=1.0, k=1.0, v=1.0, scores=1.0, context=1.0),
                "near-inf": dict(q=0.540, k=0.499, v=0.036, scores=0.055, context=0.004)},
}
for _t in PAPER_PHI.values():
    for _e in _t.values():
        _e["output"] = _e["context"]
PAPER_PHI["llama"] = PAPER_PHI["gpt2"]  # decoder-only with causal attention: GPT-2's profile
PHI_TABLE = PAPER_PHI  # (earlier name)


@dataclass
class AttentionShape:
    batch: int = 8
    seq: int = 128
    hidden: int = 768
    heads: int = 12
    layers: int = 12

    def gemm_dims(self) -> dict[str, tuple[int, int, int]]:
        """(m, k, n) of each product, summed over heads and batch (per layer)."""
        b, s, d = self.batch, self.seq, self.hidden
        dh = d // self.heads
        bh = b * self.heads
        return {"q": (b * s, d, d), "k": (b * s, d, d), "v": (b * s, d, d), "output": (b * s, d, d),
                "scores": (bh * s, dh, s), "context": (bh * s, s, dh)}

    def flops(self) -> dict[str, float]:
        return {op: 2.0 * m * k * n * self.layers for op, (m, k, n) in self.gemm_dims().items()}

    def checksum_cost(self) -> dict[str, float]:
        """Checksum encode + verify work per section (two checksum vectors), all layers."""
        cost = {}
        for sec, ops in SECTION_OPS.items():
            c = 0.0
            for op in ops:
                m, k, n = self.gemm_dims()[op]
                c += 2 * 2.0 * (m * k + k * n + 2 * m * n)
            cost[sec] = c * self.layers
        return cost


@dataclass
class FrequencyPlan:
    frequencies: dict[str, float]
    coverage: float
    coverage_unprotected: float
    coverage_full: float
    target: float
    overhead_fraction: float  # checksum work relative to the attention GEMMs, at these frequencies
    overhead_fraction_full: float  # the same with every section checked every time
    fce: dict[str, float]
    order: list[str] = field(default_factory=list)
    met: bool = True

    def as_tuple(self) -> tuple[float, float, float]:
        return tuple(self.frequencies[s] for s in ("AS", "CL", "O"))


def _rates(error_rate: float | dict[str, float]) -> dict[str, float]:
    rates = {e: float(error_rate) for e in ERROR_TYPES} if not isinstance(error_rate, dict) else dict(error_rate)
    if set(rates) != set(ERROR_TYPES) or any(not (r >= 0 and math.isfinite(r)) for r in rates.values()):
        raise ConfigError(f"error rates must be finite and >= 0 for {', '.join(ERROR_TYPES)}")
    return rates


def section_terms(shape: AttentionShape, rates: dict[str, float], phi: dict[str, dict[str, float]]):
    """(R_free, sum R_e, sum R_e * phi) per section."""
    flops = shape.flops()
    out = {}
    for sec, ops in SECTION_OPS.items():
        mu = {op: {e: rates[e] * flops[op] for e in ERROR_TYPES} for op in ops}
        r_free = math.exp(-sum(v for d in mu.values() for v in d.values()))
        one = sum(m for d in mu.values() for m in d.values()) * r_free
        harmful = sum(mu[op][e] * phi[e][op] for op in ops for e in ERROR_TYPES) * r_free
        out[sec] = (r_free, one, harmful)
    return out


def coverage(freqs: dict[str, float], terms) -> float:
    """FC_att = prod_S FC_S(f_S)."""
    fc = 1.0
    for sec, (r_free, one, harmful) in terms.items():
        fc *= r_free + (one - harmful) + freqs[sec] * harmful
    return fc


def check_phi(phi: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Validate measured probabilities (fault -> product -> P(non-trainable) in [0, 1]); a missing
    ``output`` takes ``context``'s value (as in the paper's table, which has no O row)."""
    out = {}
    for e in ERROR_TYPES:
        row = dict(phi.get(e) or {})
        if "output" not in row and "context" in row:
            row["output"] = row["context"]
        missing = [op for ops in SECTION_OPS.values() for op in ops if op not in row]
        if missing:
            raise ConfigError(f"non-trainable probabilities for {e} lack {', '.join(missing)}")
        if any(not (0.0 <= float(v) <= 1.0) for v in row.values()):
            raise ConfigError(f"non-trainable probabilities for {e} must be in [0, 1]")
        out[e] = {k: float(v) for k, v in row.items()}
    return out


def optimize_frequencies(error_rate: float | dict[str, float], target_coverage: float,
                         shape: AttentionShape | None = None, model: str = "gpt2",
                         section_cost: dict[str, float] | None = None,
                         phi: dict[str, dict[str, float]] | None = None,
                         attention_cost: float | None = None) -> FrequencyPlan:
    """Algorithm 1: greedy allocation of ABFT time by fault-coverage efficiency. ``phi``: measured
    non-trainable probabilities (default: the paper's, :data:`PAPER_PHI` of ``model``);
    ``section_cost`` / ``attention_cost``: measured costs (default: flop estimates)."""
    if not 0.0 < target_coverage < 1.0:
        raise ConfigError(f"target coverage must be in (0, 1), got {target_coverage}")
    if phi is None and model not in PAPER_PHI:
        raise ConfigError(f"no vulnerability profile for model {model!r} (have {', '.join(PAPER_PHI)})")
    shape = shape or AttentionShape()
    rates = _rates(error_rate)
    phi = check_phi(phi) if phi is not None else PAPER_PHI[model]
    terms = section_terms(shape, rates, phi)
    if section_cost is not None:
        if set(section_cost) != set(SECTION_OPS) or any(not (float(c) >= 0 and math.isfinite(float(c)))
                                                       for c in section_cost.values()):
            raise ConfigError(f"section costs must be finite and >= 0 for {', '.join(SECTION_OPS)}")
        if attention_cost is None or not attention_cost > 0:
            raise ConfigError("measured section costs need the attention's own cost in the same unit (> 0)")
    cost = section_cost or shape.checksum_cost()
    fce = {s: terms[s][2] / cost[s] if cost[s] > 0 else 0.0 for s in SECTION_OPS}
    zero = {s: 0.0 for s in SECTION_OPS}
    fc = coverage(zero, terms)
    t = dict(zero)
    order = sorted(SECTION_OPS, key=lambda s: fce[s], reverse=True)
    for sec in order:
        if fc >= target_coverage or fce[sec] <= 0:
            continue
        if target_coverage - fc < fce[sec] * cost[sec]:
            t[sec] = (target_coverage - fc) / fce[sec]
        else:
            t[sec] = cost[sec]
        fc += fce[sec] * t[sec]
    freqs = {s: min(1.0, t[s] / cost[s]) if cost[s] > 0 else 0.0 for s in SECTION_OPS}
    # The greedy step is linear in FC; where curvature leaves it a hair short, raise the sections in
    # FCE order by bisection until the exact coverage meets the target (or every f is 1).
    for sec in order:
        if coverage(freqs, terms) >= target_coverage:
            break
        lo, hi = freqs[sec], 1.0
        if coverage({**freqs, sec: hi}, terms) < target_coverage:
            freqs[sec] = 1.0
            continue
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if coverage({**freqs, sec: mid}, terms) < target_coverage else (lo, mid)
        freqs[sec] = hi
    attention_flops = attention_cost if section_cost is not None else sum(shape.flops().values())
    full = {s: 1.0 for s in SECTION_OPS}
    achieved = coverage(freqs, terms)
    return FrequencyPlan(
        frequencies=freqs, coverage=achieved, coverage_unprotected=coverage(zero, terms),
        coverage_full=coverage(full, terms), target=target_coverage,
        overhead_fraction=sum(freqs[s] * cost[s] for s in SECTION_OPS) / attention_flops,
        overhead_fraction_full=sum(cost.values()) / attention_flops, fce=fce, order=order,
        met=achieved >= target_coverage,
    )
