"""SPARe shard placement by a cyclic Golomb ruler (SPARe paper, App. B.1, Def. B.1).

Relies on numpy only.

With ``N`` data-parallel groups, ``N`` shard types and redundancy ``r`` we take the optimal Golomb ruler
``g_0 < g_1 < ... < g_{r-1}`` (``g_0 = 0``, length ``L = g_{r-1}``) and place

* host set of type ``j``:   ``H_j = {(j + g_i) mod N : i}``      (the groups that hold shard ``j``)
* type set of group ``k``:  ``T_k = {(k - g_i) mod N : i}``      (the shards group ``k`` holds)

Groups ``a != b`` share type ``j`` iff ``a - b = g_i - g_l (mod N)`` for some ``i != l``; types share a
group by the same identity. Hence *no two groups share more than one type and no two types share more than
one group* **iff the r(r-1) non-zero differences ``g_i - g_l`` are pairwise distinct modulo N** (the ruler
is a *modular* Golomb ruler for ``Z_N``). The differences lie in ``[-L, L]``; two of them can only collide
mod ``N`` if they differ by a multiple of ``N`` (at most ``2L`` apart), so ``N >= 2L + 1`` is sufficient.
It is not necessary: :func:`check_supported` tests the exact condition, and smaller ``N`` that happen to
work are accepted (e.g. ``r = 3`` ruler {0,1,3} works for ``N = 7``, the Fano plane).

The initial stack order of group ``k`` is ``order[k, i] = (k - g_i) mod N``: in stack ``i`` the groups
hold ``(k - g_i) mod N`` over all ``k``, a cyclic rotation, so **every stack contains every type exactly
once** (plain data parallelism is stack 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from trainguard.errors import TrainguardError

#: Optimal Golomb rulers (marks) for orders 2..12 (OEIS A003022 lengths 1,3,6,11,17,25,34,44,55,72,85).
GOLOMB_RULERS: dict[int, tuple[int, ...]] = {
    2: (0, 1),
    3: (0, 1, 3),
    4: (0, 1, 4, 6),
    5: (0, 1, 4, 9, 11),
    6: (0, 1, 4, 10, 12, 17),
    7: (0, 1, 4, 10, 18, 23, 25),
    8: (0, 1, 4, 9, 15, 22, 32, 34),
    9: (0, 1, 5, 12, 25, 27, 35, 41, 44),
    10: (0, 1, 6, 10, 23, 26, 34, 41, 53, 55),
    11: (0, 1, 4, 13, 28, 33, 47, 54, 64, 70, 72),
    12: (0, 2, 6, 24, 29, 40, 43, 55, 68, 75, 76, 85),
}
MIN_REDUNDANCY = 1
MAX_REDUNDANCY = max(GOLOMB_RULERS)


def golomb_ruler(r: int) -> tuple[int, ...]:
    """Marks of the optimal Golomb ruler of order ``r`` (``r = 1`` is the trivial ruler {0})."""
    if r == 1:
        return (0,)
    if r not in GOLOMB_RULERS:
        raise TrainguardError(
            f"redundancy {r} is not supported: SPARe needs an optimal Golomb ruler, known here for r = 1..{MAX_REDUNDANCY}"
        )
    return GOLOMB_RULERS[r]


def is_modular_golomb(marks: tuple[int, ...], n: int) -> bool:
    """True iff all pairwise differences of ``marks`` are distinct and non-zero modulo ``n``."""
    diffs = [(a - b) % n for a in marks for b in marks if a != b]
    return 0 not in diffs and len(set(diffs)) == len(diffs)


def min_groups_sufficient(r: int) -> int:
    """``2 L + 1``: every ``N`` at least this large supports redundancy ``r`` (sufficient condition)."""
    return 2 * golomb_ruler(r)[-1] + 1


def check_supported(n_groups: int, r: int) -> None:
    """Raise :class:`TrainguardError` (one line) if ``(N, r)`` cannot give pairwise overlap <= 1."""
    if not isinstance(n_groups, (int, np.integer)) or n_groups < 1:
        raise TrainguardError(f"number of groups must be a positive integer, got {n_groups!r}")
    if not isinstance(r, (int, np.integer)) or r < MIN_REDUNDANCY:
        raise TrainguardError(f"redundancy must be an integer >= 1, got {r!r}")
    marks = golomb_ruler(int(r))
    if r > n_groups:
        raise TrainguardError(f"redundancy {r} exceeds the number of groups {n_groups}")
    if r >= 2 and not is_modular_golomb(marks, n_groups):
        raise TrainguardError(
            f"N={n_groups} groups cannot hold redundancy r={r}: the Golomb ruler {list(marks)} (length {marks[-1]}) "
            f"has repeated differences modulo {n_groups}, so two groups would share two shard types; "
            f"use N >= {min_groups_sufficient(r)} (always sufficient) or a smaller r"
        )


def max_supported_redundancy(n_groups: int) -> int:
    """Largest ``r <= 12`` for which :func:`check_supported` passes (the sweep's upper end)."""
    best = 1
    for r in range(2, MAX_REDUNDANCY + 1):
        try:
            check_supported(n_groups, r)
        except TrainguardError:
            continue
        best = r
    return best


@dataclass(frozen=True)
class Placement:
    """Cyclic Golomb placement of ``n`` shard types on ``n`` groups with redundancy ``r``.

    Arrays (all ``int64``):

    * ``hosts[j]``  -- the ``r`` groups holding type ``j`` (``hosts[j, i] = (j + g_i) mod N``)
    * ``types[k]``  -- the ``r`` types held by group ``k`` (``types[k, i] = (k - g_i) mod N``)
    * ``initial_order`` -- ``types`` itself: group ``k`` computes ``types[k, i]`` at stack ``i``
    """

    n: int
    r: int
    marks: tuple[int, ...] = field(repr=False)
    hosts: np.ndarray = field(repr=False, compare=False)
    types: np.ndarray = field(repr=False, compare=False)

    @property
    def initial_order(self) -> np.ndarray:
        return self.types.copy()

    def overlap_matrix(self) -> np.ndarray:
        """``O[a, b]`` = number of types groups ``a`` and ``b`` share (diagonal = r)."""
        inc = np.zeros((self.n, self.n), dtype=np.int64)
        inc[np.repeat(np.arange(self.n), self.r), self.types.ravel()] = 1
        return inc @ inc.T


@lru_cache(maxsize=64)
def make_placement(n_groups: int, r: int) -> Placement:
    """Build (and cache) the placement; raises :class:`TrainguardError` for unsupported ``(N, r)``."""
    check_supported(n_groups, r)
    marks = golomb_ruler(int(r))
    g = np.asarray(marks, dtype=np.int64)
    idx = np.arange(n_groups, dtype=np.int64)[:, None]
    hosts = (idx + g[None, :]) % n_groups
    types = (idx - g[None, :]) % n_groups
    hosts.setflags(write=False)
    types.setflags(write=False)
    return Placement(n=int(n_groups), r=int(r), marks=marks, hosts=hosts, types=types)
