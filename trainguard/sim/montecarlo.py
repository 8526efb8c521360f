"""Monte-Carlo of SPARe failure trails through the real reordering controller (SPARe App. C).

Relies on numpy, the ReCtlr (:mod:`trainguard.failover.spare.controller`) and optionally
``concurrent.futures`` processes.

One trial: all ``N`` groups alive, ``s = 1``; groups fail one at a time in a uniformly random order (each
failure hits a uniformly random surviving group), and every failure goes through ``ReCtlr.on_failure``
until the first wipe-out. ``K`` is the index of the failure that wipes out. As in the paper's
Monte-Carlo, one step is taken per failure state: the state after ``k`` failures (``k = 0..K-1``) runs
one step with all-reduce stack ``s(k)``; the step during which failure ``k+1`` is detected also pays the
patch stacks returned by the controller.

Reported means pool all trials (ratio of sums), i.e. ``E[sum_{k<K} s(k)] / E[K]``, which is what eq. 5/6
average (and the time-average when failures are evenly spaced).
"""

from __future__ import annotations

import math
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

from trainguard.failover.spare.controller import ReCtlr
from trainguard.failover.spare.placement import check_supported, make_placement, supported_redundancies
from trainguard.sim import theory


@dataclass
class MonteCarloResult:
    groups: int
    redundancy: int
    trials: int
    seed: int
    mean_failures_to_wipeout: float
    std_failures_to_wipeout: float
    stderr_failures_to_wipeout: float
    theory_failures_to_wipeout: float           # paper eq. 3 (Gamma form)
    theory_failures_poisson: float              # sum_k exp(-N p_k)
    rel_error_vs_theory: float                  # MC vs eq. 3
    rel_error_vs_poisson: float
    mean_allreduce_stack: float                 # pooled s(k), k < K
    theory_allreduce_stack_lower_bound: float   # eq. 6, survival-weighted
    theory_allreduce_stack_lower_bound_paper: float  # eq. 6 as printed (1/E[K] sum_{k<E[K]})
    abs_error_allreduce_stack: float
    mean_stacks_with_patch: float               # pooled s(k) + patch stacks at failure k+1
    theory_overhead: float                      # eq. 5
    patch_rate: float                           # fraction of masked failures that needed a patch
    free_phase_rate: float                      # fraction of masked failures that needed Phase 1/2
    mean_moved_per_failure: float
    max_allreduce_stack_seen: int
    replication_failures_to_interruption: float  # exact, same N and r, for comparison

    def as_dict(self) -> dict:
        return asdict(self)


def _trials(n: int, r: int, seeds: list[int]) -> np.ndarray:
    """Run trials; returns rows (K, sum s, sum patch stacks, patches, free phases, moved, max s)."""
    ctl = ReCtlr(make_placement(n, r))
    out = np.zeros((len(seeds), 7), dtype=np.int64)
    for row, seed in enumerate(seeds):
        rng = np.random.default_rng(seed)
        order = rng.permutation(n).tolist()
        ctl.reset()
        s_sum = patch_sum = patches = free = moved = 0
        s_max = 1
        for k, g in enumerate(order):
            s_sum += ctl.stack
            res = ctl.on_failure((g,), with_orders=False)
            if res.wipeout:
                out[row] = (k + 1, s_sum, patch_sum, patches, free, moved, s_max)
                break
            patch_sum += res.patch_stacks
            patches += res.patch_stacks > 0
            free += res.phase == "free"
            moved += res.moved
            s_max = max(s_max, res.stack)
    return out


def run_montecarlo(n: int, r: int, trials: int = 200, seed: int = 0, workers: int | None = None,
                   show_progress: bool | None = None) -> MonteCarloResult:
    """Monte-Carlo for one ``(N, r)``; trial ``i`` uses seed ``(seed, i)`` so results do not depend on
    ``workers``."""
    check_supported(n, r)
    if r < 2:
        from trainguard.errors import TrainguardError

        raise TrainguardError("Monte-Carlo needs redundancy >= 2 (r = 1 wipes out at the first failure)")
    if trials < 1:
        from trainguard.errors import TrainguardError

        raise TrainguardError(f"trials must be >= 1, got {trials}")
    seeds = [int(x) for x in np.random.SeedSequence(seed).generate_state(trials, dtype=np.uint64) % (2**63)]
    workers = workers if workers is not None else min(os.cpu_count() or 1, 8)
    n_chunks = min(trials, 32)  # fixed split: results do not depend on the worker count
    chunks = [seeds[i::n_chunks] for i in range(n_chunks)]
    show = sys.stderr.isatty() if show_progress is None else show_progress
    rows = []
    if workers <= 1 or trials < 8:
        rows = [_trials(n, r, c) for c in chunks]
    else:
        with ProcessPoolExecutor(max_workers=workers) as ex:
            futs = [ex.submit(_trials, n, r, c) for c in chunks]
            if show:
                from trainguard.utils import progress

                with progress(transient=True) as bar:
                    task = bar.add_task(f"N={n} r={r}", total=len(futs), info="")
                    for f in futs:
                        rows.append(f.result())
                        bar.advance(task)
            else:
                rows = [f.result() for f in futs]
    data = np.concatenate(rows, axis=0)
    K = data[:, 0].astype(np.float64)
    mK = K.mean()
    th = theory.mean_failures_asymptotic(n, r)
    thp = theory.mean_failures_poisson(n, r)
    s_mean = data[:, 1].sum() / K.sum()
    lb = theory.allreduce_stack_lower_bound(n, r)
    masked = max(1, (K - 1).sum())
    return MonteCarloResult(
        groups=n, redundancy=r, trials=trials, seed=seed,
        mean_failures_to_wipeout=float(mK), std_failures_to_wipeout=float(K.std(ddof=1)) if trials > 1 else 0.0,
        stderr_failures_to_wipeout=float(K.std(ddof=1) / math.sqrt(trials)) if trials > 1 else 0.0,
        theory_failures_to_wipeout=th, theory_failures_poisson=thp,
        rel_error_vs_theory=float((mK - th) / th), rel_error_vs_poisson=float((mK - thp) / thp),
        mean_allreduce_stack=float(s_mean), theory_allreduce_stack_lower_bound=lb,
        theory_allreduce_stack_lower_bound_paper=theory.allreduce_stack_lower_bound(n, r, "paper"),
        abs_error_allreduce_stack=float(s_mean - lb),
        mean_stacks_with_patch=float((data[:, 1].sum() + data[:, 2].sum()) / K.sum()),
        theory_overhead=theory.mean_overhead(n, r),
        patch_rate=float(data[:, 3].sum() / masked), free_phase_rate=float(data[:, 4].sum() / masked),
        mean_moved_per_failure=float(data[:, 5].sum() / masked), max_allreduce_stack_seen=int(data[:, 6].max()),
        replication_failures_to_interruption=theory.mean_failures_replication(n, r),
    )


def sweep(n: int, trials: int = 200, seed: int = 0, r_values: list[int] | None = None,
          workers: int | None = None, show_progress: bool | None = None) -> list[MonteCarloResult]:
    """Monte-Carlo for every supported ``r`` (2..28, those whose ruler the group count allows) at ``N``."""
    r_values = r_values or supported_redundancies(n)
    return [run_montecarlo(n, r, trials, seed, workers, show_progress) for r in r_values]
