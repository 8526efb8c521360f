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

Failure domains (a rack, a leaf switch) take several groups down at once. :func:`domain_layout` assigns
logical groups to domains so that the ``r`` hosts of every type sit in ``r`` different domains: logical
group ``k`` gets domain ``(a k mod N) mod D`` for the first unit ``a`` of ``Z_N`` that works (multiplying
by a unit keeps the placement, it only relabels which physical slot a logical group occupies).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from trainguard.errors import TrainguardError

#: Optimal Golomb rulers (marks) for orders 2..28. Lengths are OEIS A003022 (1, 3, 6, 11, 17, 25, 34, 44,
#: 55, 72, 85, 106, 127, 151, 177, 199, 216, 246, 283, 333, 356, 372, 425, 480, 492, 553, 585); orders 24..28
#: were proved optimal by distributed.net's OGR project. Each ruler is checked by its distinct differences
#: (``tests/failover/test_spare_placement.py``).
OPTIMAL_LENGTHS: dict[int, int] = {
    2: 1, 3: 3, 4: 6, 5: 11, 6: 17, 7: 25, 8: 34, 9: 44, 10: 55, 11: 72, 12: 85, 13: 106, 14: 127, 15: 151,
    16: 177, 17: 199, 18: 216, 19: 246, 20: 283, 21: 333, 22: 356, 23: 372, 24: 425, 25: 480, 26: 492, 27: 553,
    28: 585,
}
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
    13: (0, 2, 5, 25, 37, 43, 59, 70, 85, 89, 98, 99, 106),
    14: (0, 4, 6, 20, 35, 52, 59, 77, 78, 86, 89, 99, 122, 127),
    15: (0, 4, 20, 30, 57, 59, 62, 76, 100, 111, 123, 136, 144, 145, 151),
    16: (0, 1, 4, 11, 26, 32, 56, 68, 76, 115, 117, 134, 150, 163, 168, 177),
    17: (0, 5, 7, 17, 52, 56, 67, 80, 81, 100, 122, 138, 159, 165, 168, 191, 199),
    18: (0, 2, 10, 22, 53, 56, 82, 83, 89, 98, 130, 148, 153, 167, 188, 192, 205, 216),
    19: (0, 1, 6, 25, 32, 72, 100, 108, 120, 130, 153, 169, 187, 190, 204, 231, 233, 242, 246),
    20: (0, 1, 8, 11, 68, 77, 94, 116, 121, 156, 158, 179, 194, 208, 212, 228, 240, 253, 259, 283),
    21: (0, 2, 24, 56, 77, 82, 83, 95, 129, 144, 179, 186, 195, 255, 265, 285, 293, 296, 310, 329, 333),
    22: (0, 1, 9, 14, 43, 70, 106, 122, 124, 128, 159, 179, 204, 223, 253, 263, 270, 291, 330, 341, 353, 356),
    23: (0, 3, 7, 17, 61, 66, 91, 99, 114, 159, 171, 199, 200, 226, 235, 246, 277, 316, 329, 348, 350, 366, 372),
    24: (0, 9, 33, 37, 38, 97, 122, 129, 140, 142, 152, 191, 205, 208, 252, 278, 286, 326, 332, 353, 368, 384, 403, 425),
    25: (0, 12, 29, 39, 72, 91, 146, 157, 160, 161, 166, 191, 207, 214, 258, 290, 316, 354, 372, 394, 396, 431, 459, 467,
         480),
    26: (0, 1, 33, 83, 104, 110, 124, 163, 185, 200, 203, 249, 251, 258, 314, 318, 343, 356, 386, 430, 440, 456, 464, 475,
         487, 492),
    27: (0, 3, 15, 41, 66, 95, 97, 106, 142, 152, 220, 221, 225, 242, 295, 330, 338, 354, 382, 388, 402, 415, 486, 504,
         523, 546, 553),
    28: (0, 3, 15, 41, 66, 95, 97, 106, 142, 152, 220, 221, 225, 242, 295, 330, 338, 354, 382, 388, 402, 415, 486, 504,
         523, 546, 553, 585),
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


@lru_cache(maxsize=4096)
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


def supported_redundancies(n_groups: int, r_max: int = MAX_REDUNDANCY) -> list[int]:
    """Every ``r`` in ``2..min(r_max, 28)`` for which :func:`check_supported` passes at ``N`` groups."""
    return [r for r in range(2, min(r_max, MAX_REDUNDANCY, n_groups) + 1)
            if is_modular_golomb(GOLOMB_RULERS[r], int(n_groups))]


def max_supported_redundancy(n_groups: int) -> int:
    """Largest ``r <= 28`` for which :func:`check_supported` passes (1 if none; the sweep's upper end)."""
    rs = supported_redundancies(n_groups)
    return rs[-1] if rs else 1


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
        inc = np.zeros((self.n, self.n))  # float: BLAS matmul, exact for these small integers
        inc[np.repeat(np.arange(self.n), self.r), self.types.ravel()] = 1
        return np.rint(inc @ inc.T).astype(np.int64)


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


@dataclass(frozen=True)
class DomainLayout:
    """Logical group -> failure domain (a rack, a leaf switch) and physical slot.

    ``domain_of[k]``: domain of logical group ``k``; ``slot_of[k]``: physical position (domain ``d`` holds
    slots ``d*m .. d*m+m-1``); ``multiplier``: the unit ``a`` used (``None`` for the contiguous layout).
    """

    n: int
    groups_per_domain: int
    domain_of: np.ndarray = field(repr=False, compare=False)
    slot_of: np.ndarray = field(repr=False, compare=False)
    multiplier: int | None = None

    @property
    def domains(self) -> int:
        return -(-self.n // self.groups_per_domain)


def contiguous_layout(n_groups: int, groups_per_domain: int) -> DomainLayout:
    """Logical group ``k`` in slot ``k``, domain ``k // m`` (what a rank-order launch does)."""
    k = np.arange(n_groups, dtype=np.int64)
    return DomainLayout(n_groups, groups_per_domain, k // groups_per_domain, k.copy(), None)


def _layout_from_colors(n: int, m: int, colors: np.ndarray, a: int | None) -> DomainLayout:
    order = np.lexsort((np.arange(n), colors))  # logical groups sorted by colour, then index
    slot = np.empty(n, dtype=np.int64)
    rank_in = np.arange(n) - np.searchsorted(colors[order], colors[order])
    slot[order] = colors[order] * m + rank_in
    return DomainLayout(n, m, colors.astype(np.int64), slot, a)


def hosts_in_distinct_domains(hosts: np.ndarray, domain_of: np.ndarray) -> bool:
    """True iff every row of ``hosts`` (the groups holding one type, or one replica set) has distinct domains."""
    d = np.sort(domain_of[hosts], axis=1)
    return bool((d[:, 1:] != d[:, :-1]).all()) if d.shape[1] > 1 else True


def _repair_colors(colors: np.ndarray, types: np.ndarray, hosts: np.ndarray, seed: int, max_moves: int) -> np.ndarray | None:
    """Tabu search by swaps (class sizes never change) for a colouring in which no two groups sharing a
    type have the same colour; ``None`` if ``max_moves`` swaps do not find one.

    ``cnt[k, c]`` counts the neighbours of group ``k`` (groups sharing a type with it) that have colour ``c``;
    a swap of ``u`` and ``v`` is scored for every ``v`` at once with numpy."""
    n = colors.size
    D = int(colors.max()) + 1
    rng = np.random.default_rng(seed)
    nbr = hosts[types].reshape(n, -1)  # (n, r*r) incl. k itself r times
    nbr_l = [[int(g) for g in row if g != k] for k, row in enumerate(nbr)]
    col = colors.astype(np.int64).copy()
    cnt = np.zeros((n, D), dtype=np.int64)
    for k in range(n):
        np.add.at(cnt[k], col[nbr_l[k]], 1)
    tabu = np.zeros(n, dtype=np.int64)
    idx = np.arange(n)

    def recolor(g: int, c: int) -> None:
        old = col[g]
        for h in nbr_l[g]:
            cnt[h, old] -= 1
            cnt[h, c] += 1
        col[g] = c

    for it in range(max_moves):
        own = cnt[idx, col]
        total = int(own.sum())
        if total == 0:
            return col
        bad = np.flatnonzero(own > 0)
        u = int(bad[rng.integers(bad.size)])
        cu = col[u]
        gain = (own[u] - cnt[u, col]) + (own - cnt[:, cu])
        adj = np.zeros(n, dtype=bool)
        adj[nbr_l[u]] = True
        gain = gain + 2 * adj  # a neighbour swapped with u stops counting as a conflict on both sides
        gain[(col == cu) | (tabu > it)] = np.iinfo(np.int64).min
        v = int(np.argmax(gain + rng.random(n)))  # random tie-break
        if gain[v] == np.iinfo(np.int64).min:
            continue
        cv = col[v]
        recolor(u, cv)
        recolor(v, cu)
        tabu[u] = tabu[v] = it + 7 + int(rng.integers(10))
    return None


@lru_cache(maxsize=256)
def domain_layout(n_groups: int, r: int, groups_per_domain: int, max_tries: int = 256) -> DomainLayout:
    """Layout that puts the ``r`` copies of every type in ``r`` different failure domains.

    ``D = ceil(N / m)`` domains of at most ``m`` groups. Tried in order, each checked on every type:
    blocks of the relabelled ring, domain ``((a k) mod N) // m``, and residues ``((a k) mod N) mod D``,
    for units ``a`` of ``Z_N`` (a unit keeps the placement's structure); then a min-conflicts local search by
    swaps (3000 at most). Raises :class:`TrainguardError` when ``r > D`` or nothing works. A separating
    layout needs ``D`` well above ``r``: the groups sharing a type with a group number ``r (r-1)``, and the
    domains must properly colour that graph (at N = 64, r = 6 a greedy colouring needs 22 colours)."""
    check_supported(n_groups, r)
    m = int(groups_per_domain)
    if m < 1:
        raise TrainguardError(f"groups per failure domain must be >= 1, got {groups_per_domain}")
    n = int(n_groups)
    k = np.arange(n, dtype=np.int64)
    if m == 1 or r == 1:
        return _layout_from_colors(n, m, k // m, 1)
    D = -(-n // m)
    if r > D:
        raise TrainguardError(
            f"redundancy {r} needs {r} failure domains but N={n} groups in domains of {m} give only {D}; "
            f"use smaller domains or r <= {D}")
    p = make_placement(n, r)
    tried = 0
    for a in range(1, n):
        if math.gcd(a, n) != 1:
            continue
        for colors in ((a * k % n) // m, (a * k % n) % D):
            if hosts_in_distinct_domains(p.hosts, colors):
                return _layout_from_colors(n, m, colors, a)
        tried += 1
        if tried >= max_tries:
            break
    fixed = _repair_colors(k % D, p.types, p.hosts, seed=n * 31 + r, max_moves=3000)
    if fixed is not None and hosts_in_distinct_domains(p.hosts, fixed):
        return _layout_from_colors(n, m, fixed, None)
    raise TrainguardError(
        f"found no layout of N={n}, r={r} that keeps every type's copies in different domains of {m} groups; "
        "try smaller domains or a smaller r")


def replication_layout(n_groups: int, r: int, groups_per_domain: int) -> DomainLayout:
    """Replica sets of consecutive logical groups spread over domains: group ``k`` in domain ``k mod D``
    (a set's members are in different domains when the set is no larger than ``D``)."""
    m = int(groups_per_domain)
    n = int(n_groups)
    D = -(-n // m)
    return _layout_from_colors(n, m, np.arange(n, dtype=np.int64) % D, 1)
