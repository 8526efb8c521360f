"""SPARe closed forms (Thm 4.1, 4.2, 4.3 of the SPARe paper) and the replication baseline.

Relies on numpy and the standard library (math.lgamma / math.gamma).

Most symbols of the paper were lost in extraction; the forms below are re-derived from its prose and
checked by Monte-Carlo through the real controller (``trainguard spare montecarlo``).

**Thm 4.1 (failures to first wipe-out).** Failures hit uniformly random surviving groups. After ``k``
failures type ``j`` is wiped out iff all its ``r`` hosts are among the ``k`` failed groups:
``p_k = C(N-r, k-r)/C(N, k) = prod_{i<r} (k-i)/(N-i)``. Because two types share at most one host (Golomb
placement), wipe-outs are nearly independent and the number of wiped types is ~ Poisson(N p_k):
``P(K > k) ~ exp(-N p_k)``, ``E[K] = sum_{k>=0} P(K > k)`` (``K`` counts the failure that wipes out).
With ``p_k ~ (k/N)^r``: ``E[K] ~ Gamma(1 + 1/r) N^((r-1)/r)`` (paper eq. 3). The discrete sum adds
``~1/2`` (Euler-Maclaurin), which matters at small ``r``.

**Thm 4.2 (computation overhead).** With ``k`` groups down, ``N`` types on ``N-k`` survivors need
``s_LB(k) = ceil(N / (N-k))`` stacks (capacity bound); Hall's theorem makes ``s*(k) > s_LB(k)``
negligible. A new failure needs a *patch* (one extra stack in that step) iff it hits a *singleton* type
(computed once among the ``(N-k) s`` top slots). ``sigma`` singletons and ``N - sigma`` types in >= 2 slots
give ``sigma >= 2N - (N-k)s``, so the patch probability is ~ the singleton-slot fraction
``P_k = clip(2N / ((N-k) s_LB(k)) - 1, 0, 1)``. Averaging over the states ``k = 0..K-1`` before the wipe-out
(one step per failure, as the paper's Monte-Carlo does):

    s_bar ~ sum_k P(K>k) (s_LB(k) + P_k) / sum_k P(K>k)                 (eq. 5, survival-weighted)
    s_bar >= sum_k P(K>k) s_LB(k) / sum_k P(K>k)                        (eq. 6, the lower bound)

The paper writes the sums as ``1/E[K] sum_{k=0}^{E[K]-1}``; :func:`allreduce_stack_lower_bound` offers both.
In a training run with many steps between failures the patch term vanishes per step and the time-average
stack is the survival-weighted ``s_LB`` weighted by time spent at each ``k``.

**Thm 4.3 (optimal redundancy with checkpointing).** Normalized time-to-train ``s_bar(r) / A(M(r))``
(eq. 7) with ``M(r) = E[K](r) * m`` (``m``: MTBF of group failures of the whole cluster) and ``A`` the
Saxena availability. ``s_bar`` stays ~2 until ``E[K]`` reaches ``N/2`` (then ``s_LB`` becomes 3), so the
optimum is the smallest ``r`` with ``E[K] >= N/2``: with ``ln Gamma(1+x) ~ -gamma x``,
``r* ~ (ln N + gamma) / ln 2`` (gamma = Euler-Mascheroni).

**Replication** of degree ``r``: ``b = N // r`` replica sets (the ``N mod r`` extra groups join sets, so a
set has ``r`` or ``r+1`` groups); each group computes ``N / b`` shards (``= r`` when ``r | N``). The set
is lost when all its groups have failed; ``P(K > k)`` is exact by counting ``k``-subsets that contain no
whole set (coefficients of ``prod_i ((1+x)^{n_i} - x^{n_i})``; it underflows for large ``N``, so the
mean uses the integral below). A uniformly random failure order is the order of i.i.d. exponential
lifetimes; with ``q = 1 - e^{-t}`` the expected number of failures while every set is alive is

    E[K] = int_0^1 sum_i n_i prod_{j != i} (1 - q^{n_j}) dq,

which for ``b`` sets of size ``m`` is ``b B(1/m, b)`` and for pairs ``4^b / C(2b, b) ~ sqrt(pi b)``
(Casanova et al. 2012). It is exact and costs O(1) at any ``N``.
"""

from __future__ import annotations

import math

import numpy as np

from trainguard.errors import TrainguardError
from trainguard.sim.checkpoint_period import availability, optimal_period

EULER_GAMMA = 0.5772156649015329


def _check(n: int, r: int) -> None:
    if n < 1 or r < 1 or r > n:
        raise TrainguardError(f"need 1 <= r <= N, got N={n}, r={r}")


# ----------------------------------------------------------------------------- Thm 4.1
def wipeout_probability(n: int, r: int, k: np.ndarray | int) -> np.ndarray:
    """``p_k``: probability that one given type lost all ``r`` hosts after ``k`` failures."""
    k = np.asarray(k, dtype=np.float64)
    p = np.ones_like(k)
    for i in range(r):
        p = p * np.clip(k - i, 0, None) / (n - i)
    return p


def survival_poisson(n: int, r: int) -> np.ndarray:
    """``P(K > k) ~ exp(-N p_k)`` for ``k = 0..N`` (index = k)."""
    _check(n, r)
    k = np.arange(n + 1)
    s = np.exp(-n * wipeout_probability(n, r, k))
    s[n] = 0.0  # everything failed
    return s


def mean_failures_asymptotic(n: int, r: int) -> float:
    """Paper eq. 3: ``Gamma(1 + 1/r) * N^((r-1)/r)``."""
    _check(n, r)
    return math.gamma(1.0 + 1.0 / r) * n ** ((r - 1.0) / r)


def mean_failures_poisson(n: int, r: int) -> float:
    """``sum_k exp(-N p_k)`` with the exact hypergeometric ``p_k`` (Poisson approximation only)."""
    return float(survival_poisson(n, r).sum())


# ----------------------------------------------------------------------------- Thm 4.2
def stack_lower_bound(n: int, k: np.ndarray | int) -> np.ndarray:
    """``s_LB(k) = ceil(N / (N - k))``."""
    k = np.asarray(k)
    return -(-n // (n - k))


def patch_probability(n: int, k: np.ndarray | int, s: np.ndarray | None = None) -> np.ndarray:
    """``P_k ~ clip(2N / ((N-k) s) - 1, 0, 1)`` (singleton-slot fraction), ``s = s_LB(k)`` by default."""
    k = np.asarray(k)
    s = stack_lower_bound(n, k) if s is None else np.asarray(s)
    return np.clip(2.0 * n / ((n - k) * s) - 1.0, 0.0, 1.0)


def allreduce_stack_lower_bound(n: int, r: int, form: str = "survival") -> float:
    """Eq. 6. ``form="survival"``: ``sum_k P(K>k) s_LB(k) / sum_k P(K>k)`` (what a Monte-Carlo measures);
    ``form="paper"``: ``1/E[K] sum_{k=0}^{E[K]-1} s_LB(k)`` with ``E[K]`` of eq. 3 (fractional last term)."""
    if form == "survival":
        S = survival_poisson(n, r)[:n]
        k = np.arange(n)
        return float((S * stack_lower_bound(n, k)).sum() / S.sum())
    if form == "paper":
        K = min(mean_failures_asymptotic(n, r), n - 1.0)
        kk = np.arange(int(math.floor(K)))
        total = float(stack_lower_bound(n, kk).sum()) + (K - math.floor(K)) * float(stack_lower_bound(n, int(math.floor(K))))
        return total / K
    raise TrainguardError(f"unknown form {form!r} (survival or paper)")


def mean_overhead(n: int, r: int) -> float:
    """Eq. 5: stacks per failure-step including patch compute, survival-weighted."""
    S = survival_poisson(n, r)[:n]
    k = np.arange(n)
    return float((S * (stack_lower_bound(n, k) + patch_probability(n, k))).sum() / S.sum())


# ----------------------------------------------------------------------------- replication
def replica_set_sizes(n: int, r: int) -> list[int]:
    """``b = N // r`` sets of ``r`` groups; the ``N mod r`` extra groups are dealt round-robin to the sets
    (sizes differ by at most one and sum to ``N``)."""
    _check(n, r)
    b = n // r
    extra = n - b * r
    return [r + extra // b + (1 if i < extra % b else 0) for i in range(b)]


def replication_stacks(n: int, r: int) -> float:
    """Shards each group computes per step under replication: ``N / b``."""
    return n / (n // r)


def survival_replication(n: int, r: int) -> np.ndarray:
    """Exact ``P(K > k)`` for replica sets, ``k = 0..N``."""
    sizes = replica_set_sizes(n, r)
    poly = np.ones(1)
    for m in sizes:  # ((1+x)^m - x^m) / 2^m, coefficients <= 1 (no overflow)
        f = np.array([math.comb(m, j) for j in range(m + 1)], dtype=np.float64)
        f[m] = 0.0
        poly = np.convolve(poly, f / 2.0**m)
    k = np.arange(n + 1)
    log_ratio = n * math.log(2.0) - np.array([math.lgamma(n + 1) - math.lgamma(j + 1) - math.lgamma(n - j + 1) for j in k])
    out = np.zeros(n + 1)
    nz = poly[: n + 1] > 0
    out[: poly.size][nz[: poly.size]] = np.exp(np.log(poly[nz]) + log_ratio[: poly.size][nz])
    return np.clip(out, 0.0, 1.0)


def mean_failures_replication(n: int, r: int) -> float:
    """Mean failure count to interruption (exact, any ``N``): ``b B(1/m, b)`` for equal sets of size ``m``,
    else the one-dimensional integral of the module docstring (scipy ``quad``)."""
    _check(n, r)
    if r == 1:
        return 1.0
    sizes = replica_set_sizes(n, r)
    b = len(sizes)
    m1 = min(sizes)
    m2 = m1 + 1
    e = sum(1 for x in sizes if x == m2)
    b1 = b - e
    if e == 0:
        return math.exp(math.log(b) + math.lgamma(1.0 / m1) + math.lgamma(b) - math.lgamma(b + 1.0 / m1))
    from scipy.integrate import quad

    def f(q: float) -> float:
        l1, l2 = math.log1p(-q**m1) if q < 1 else -math.inf, math.log1p(-q**m2) if q < 1 else -math.inf
        out = 0.0
        if b1:
            out += b1 * m1 * math.exp((b1 - 1) * l1 + e * l2) if (b1 - 1 or e) else b1 * m1
        out += e * m2 * math.exp(b1 * l1 + (e - 1) * l2) if (b1 or e - 1) else e * m2
        return out

    q0 = (1.0 / b) ** (1.0 / m1)  # the integrand falls off around q^m ~ 1/b
    val, _ = quad(f, 0.0, 1.0, points=[q0 * x for x in (0.5, 1.0, 1.5, 2.0) if q0 * x < 1], limit=400,
                  epsabs=0.0, epsrel=1e-11)
    return float(val)


def replica_pairs_mnfti(b: int) -> float:
    """Casanova et al. 2012: ``4^b / C(2b, b)`` computed in log space."""
    return math.exp(b * math.log(4.0) - (math.lgamma(2 * b + 1) - 2 * math.lgamma(b + 1)))


# ----------------------------------------------------------------------------- Thm 4.3
def system_mtbf(mean_failures: float, group_failure_mtbf_s: float) -> float:
    """``M(r) = E[K] * m``: time between global restarts if failures arrive every ``m`` on average."""
    return mean_failures * group_failure_mtbf_s


def normalized_time_to_train(stacks: float, mtbf_system_s: float, save_s: float, restart_s: float) -> float:
    """Eq. 7: ``s_bar / A(T*)`` (time-to-train over the failure-free single-stack time)."""
    T = optimal_period(save_s, mtbf_system_s, restart_s)
    return stacks / availability(T, save_s, mtbf_system_s, restart_s)


def optimal_redundancy_formula(n: int) -> float:
    """Thm 4.3: ``(ln N + gamma) / ln 2`` (real-valued; round it)."""
    return (math.log(n) + EULER_GAMMA) / math.log(2.0)


def optimal_redundancy_transition(n: int, r_max: int = 28) -> int:
    """Smallest ``r`` whose Poisson-exact ``E[K]`` reaches ``N/2`` (the first capacity transition)."""
    for r in range(2, r_max + 1):
        if mean_failures_poisson(n, r) >= n / 2:
            return r
    return r_max


def scheme_theory(scheme: str, n: int, r: int, group_mtbf_s: float, save_s: float, restart_s: float,
                  step_stack_s: float = 1.0, step_comm_s: float = 0.0) -> dict:
    """Theory row for one scheme: system MTBF, checkpoint period, availability, normalized time-to-train.

    ``step_stack_s`` / ``step_comm_s`` weight the stacks into a step time: a step costs
    ``stacks * step_stack_s + step_comm_s``, the reference is ``step_stack_s + step_comm_s``.
    """
    if scheme == "spare":
        K = mean_failures_poisson(n, r) if r > 1 else 1.0
        stacks = allreduce_stack_lower_bound(n, r) if r > 1 else 1.0
    elif scheme == "replication":
        K = mean_failures_replication(n, r)
        stacks = replication_stacks(n, r)
    elif scheme == "checkpoint":
        K, stacks = 1.0, 1.0
    else:
        raise TrainguardError(f"unknown scheme {scheme!r} (spare, replication, checkpoint)")
    M = system_mtbf(K, group_mtbf_s)
    T = optimal_period(save_s, M, restart_s)
    A = availability(T, save_s, M, restart_s)
    ratio = (stacks * step_stack_s + step_comm_s) / (step_stack_s + step_comm_s)
    return {"scheme": scheme, "groups": n, "redundancy": r, "mean_failures": K, "system_mtbf_s": M,
            "stacks_per_step": stacks, "checkpoint_period_s": T, "availability": A,
            "normalized_time_to_train": ratio / A if A > 0 else math.inf}
