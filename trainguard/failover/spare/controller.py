"""SPARe reordering controller ``ReCtlr`` (SPARe paper, Sec. 3.2, Alg. 2 and App. D).

Relies on numpy, scipy (``scipy.sparse.csgraph.maximum_bipartite_matching``: Hopcroft-Karp) and heapq.

State between failures: which groups are alive, every group's *stack order* (a permutation of its ``r``
shard types: position ``p`` is computed ``p``-th in a step) and the *all-reduce stack* ``s`` (the system
all-reduces after every alive group has computed its first ``s`` stacks). A valid state has every type in
the first ``s`` positions of some alive group. The controller also keeps one *assignment*
type -> alive group (the group that is counted on for that type, always a group holding it in its first
``s`` positions); the other top-``s`` slots are redundant duplicates.

When groups fail (detected at the all-reduce of the current step) :meth:`ReCtlr.on_failure` runs:

* **Phase 0, HK-Fixed.** Can the current ``s`` still collect every type with the current orders? In the
  bipartite graph types -> (alive group, position < s) every slot has exactly one type, so a matching that
  saturates the types exists iff every type occurs in some alive top-``s`` slot: a coverage test (the
  Hopcroft-Karp run of the paper reduces to it). The types it misses are exactly the partial gradients
  lost in this step: they get **patch compute** (one extra shard on a surviving host; hosts are chosen to
  balance the patch load, whose maximum is the number of extra stacks, ``patch_stacks``).
* **Phase 1, HK-Free.** Otherwise the smallest ``s'`` in ``[max(s, ceil(N/|alive|)), r]`` such that every type
  can be given to one of its alive hosts with at most ``s'`` types per group (free reordering inside a
  group). This is a b-matching: each alive group is replicated ``s'`` times and scipy's Hopcroft-Karp
  ``maximum_bipartite_matching`` must saturate the types. A type with no alive host is a **wipe-out**
  (system failure): the caller does a global restart and the controller resets to the initial orders
  and ``s = 1``.
* **Phase 2, MCMF.** Among all assignments feasible at ``s'`` take one that moves the fewest shards. The
  *movement cost* of giving type ``t`` to group ``g`` is 0 if ``t`` already sits in the first ``s'`` positions
  of ``g``'s stack and 1 otherwise (it must be swapped into them: one swap = one shard moved, two
  positions changed). Min-cost max-flow source -> types -> groups (capacity ``s'``) -> sink is solved by
  successive shortest paths (Dijkstra with Johnson potentials) started from the surviving assignment,
  which is a zero-cost (hence min-cost) flow; only the lost types are augmented, so a failure costs
  O(lost types x local search) instead of a global re-solve. Tests check it against networkx
  ``max_flow_min_cost`` and brute force.

The functional entry point for a runtime is :func:`reorder` (stateless), or keep a :class:`ReCtlr` and call
``on_failure(failed_groups)``; both return a :class:`ControllerResult`.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_bipartite_matching

from trainguard.errors import TrainguardError
from trainguard.failover.spare.placement import Placement, make_placement


@dataclass
class ControllerResult:
    """What the runtime needs after a failure.

    ``wipeout``: a type lost every host -> global restart (the controller has already reset itself).
    ``stack``: all-reduce stack for the next steps. ``orders``: ``(N, r)`` array, ``orders[g, p]`` = type
    group ``g`` computes at stack ``p`` (rows of failed groups are kept but meaningless).
    ``patches``: ``{type: group}`` extra shards to compute *now* to finish the current step;
    ``patch_stacks``: how many extra stacks that takes (max patches on one group).
    ``phase``: "fixed" (Phase 0 succeeded), "free" (Phases 1+2 ran) or "wipeout".
    ``moved``: shards moved into a group's first ``stack`` positions (Phase 2 cost).
    """

    wipeout: bool
    stack: int
    orders: np.ndarray | None
    patches: dict[int, int] = field(default_factory=dict)
    patch_stacks: int = 0
    phase: str = "fixed"
    moved: int = 0
    lost_types: tuple[int, ...] = ()
    wiped_types: tuple[int, ...] = ()

    def as_dict(self) -> dict:
        return {
            "wipeout": self.wipeout, "stack": self.stack, "patches": {int(k): int(v) for k, v in self.patches.items()},
            "patch_stacks": self.patch_stacks, "phase": self.phase, "moved": self.moved,
        }


class ReCtlr:
    """Stateful reordering controller for one placement (see module docstring)."""

    def __init__(self, placement: Placement | tuple[int, int]):
        if not isinstance(placement, Placement):
            placement = make_placement(*placement)
        self.p = placement
        self.n, self.r = placement.n, placement.r
        self._marks = np.asarray(placement.marks, dtype=np.int64)
        self._hosts = placement.hosts
        self._hosts_l = placement.hosts.tolist()
        self._mark_lut = {int(m) % self.n: i for i, m in enumerate(placement.marks)}
        self.reset()

    @property
    def assign(self) -> np.ndarray:
        """``assign[t]``: alive group counted on for type ``t`` (it holds ``t`` in its first ``stack`` positions)."""
        return np.asarray(self.assign_l, dtype=np.int64)

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Initial state (training start or after a global restart): all alive, cyclic orders, s = 1."""
        n, r = self.n, self.r
        self.alive = np.ones(n, dtype=bool)
        self.alive_l = [True] * n
        self.stack = 1
        self._ord = np.tile(np.arange(r, dtype=np.int64), (n, 1))  # mark index at each position
        self._pos_l = [list(range(r)) for _ in range(n)]  # position of mark index i in group g
        self.assign_l = list(range(n))  # type t is held by group t at position 0
        self.members: list[dict[int, int]] = [{g: 0} for g in range(n)]  # group -> {type: mark index}
        self.n_alive = n
        self._touched: set[int] = set()

    @property
    def orders(self) -> np.ndarray:
        """``orders[g, p]``: shard type group ``g`` computes at stack ``p``."""
        return (np.arange(self.n)[:, None] - self._marks[self._ord]) % self.n

    @classmethod
    def from_state(cls, placement: Placement, orders: np.ndarray, stack: int, alive: np.ndarray) -> ReCtlr:
        """Controller for a given state (orders must be permutations of each group's types)."""
        c = cls(placement)
        n, r = c.n, c.r
        orders = np.asarray(orders, dtype=np.int64)
        if orders.shape != (n, r):
            raise TrainguardError(f"orders must have shape ({n}, {r}), got {orders.shape}")
        if not 1 <= stack <= r:
            raise TrainguardError(f"all-reduce stack must be in 1..{r}, got {stack}")
        # mark index i with (g - marks[i]) % n == orders[g, p]
        mark_of = ((np.arange(n)[:, None] - orders) % n)  # = marks[i]
        lut = {int(m): i for i, m in enumerate(placement.marks)}
        try:
            ordi = np.vectorize(lambda m: lut[int(m)])(mark_of).astype(np.int64)
        except KeyError as err:
            raise TrainguardError(f"orders hold a type a group does not host (mark offset {err})") from None
        if not (np.sort(ordi, axis=1) == np.arange(r)).all():
            raise TrainguardError("each row of orders must be a permutation of the group's types")
        c._ord = ordi
        c._pos_l = np.argsort(ordi, axis=1).tolist()
        c.alive = np.asarray(alive, dtype=bool).copy()
        c.alive_l = c.alive.tolist()
        c.n_alive = int(c.alive.sum())
        c.stack = int(stack)
        c.assign_l = [-1] * n
        c.members = [dict() for _ in range(n)]
        top = c._top_slots(c.stack)
        for g, t, i in top:
            if c.assign_l[t] < 0:
                c.assign_l[t] = g
                c.members[g][t] = i
        if min(c.assign_l) < 0:
            raise TrainguardError("invalid state: some type is in no alive group's first `stack` positions")
        return c

    def _top_slots(self, s: int):
        """(group, type, mark index) of every alive slot at position < s."""
        gs = np.flatnonzero(self.alive)
        mi = self._ord[gs, :s]
        ts = (gs[:, None] - self._marks[mi]) % self.n
        return zip(np.repeat(gs, s).tolist(), ts.ravel().tolist(), mi.ravel().tolist())

    # ------------------------------------------------------------------ phases
    def covered(self, s: int | None = None, orders_ord: np.ndarray | None = None) -> np.ndarray:
        """Phase 0 (HK-Fixed): bool per type, covered by an alive group's first ``s`` positions."""
        s = self.stack if s is None else s
        ordm = self._ord if orders_ord is None else orders_ord
        gs = np.flatnonzero(self.alive)
        ts = (gs[:, None] - self._marks[ordm[gs, :s]]) % self.n
        cov = np.zeros(self.n, dtype=bool)
        cov[ts.ravel()] = True
        return cov

    def feasible_free(self, s: int) -> bool:
        """Phase 1 (HK-Free) for one ``s``: Hopcroft-Karp on types x (alive group copies)."""
        n = self.n
        if self.n_alive * s < n:
            return False
        rank = np.cumsum(self.alive) - 1
        h = self._hosts
        ok = self.alive[h]  # (n, r)
        rows_t, cols_i = np.nonzero(ok)
        gcols = rank[h[rows_t, cols_i]] * s
        rows = np.repeat(rows_t, s)
        cols = (gcols[:, None] + np.arange(s)[None, :]).ravel()
        m = csr_matrix((np.ones(rows.size, dtype=np.int8), (rows, cols)), shape=(n, self.n_alive * s))
        match = maximum_bipartite_matching(m, perm_type="column")
        return bool((match >= 0).all())

    def min_free_stack(self) -> int | None:
        """Smallest feasible ``s`` under free reordering (Phase 1), ``None`` if none <= r (wipe-out)."""
        lo = max(self.stack, math.ceil(self.n / max(self.n_alive, 1)))
        for s in range(lo, self.r + 1):
            if self.feasible_free(s):
                return s
        return None

    def _mcmf(self, unassigned: list[int], s: int) -> bool:
        """Phase 2: successive shortest paths from the current (zero-cost) assignment.

        Returns True when every type is placed (a min-cost assignment at ``s``). On False the state is
        rolled back to how it was at the call (the undo log), so the caller can retry at ``s + 1``.
        """
        n, r = self.n, self.r
        hosts, alive, members, assign = self._hosts_l, self.alive_l, self.members, self.assign_l
        pos = self._pos_l
        sink = -1  # smallest id: among equal distances the sink pops first (early exit)
        big = 1 << 60
        off = 0
        delta: dict[int, int] = {}
        undo: list[tuple[int, int, int]] = []  # (type, old group, new group)
        touched: set[int] = set()
        todo = set(unassigned)
        while todo:
            dist: dict[int, int] = {}
            best: dict[int, int] = {}
            prev: dict[int, int] = {}
            heap = []
            for u in todo:
                d0 = -(off + delta.get(u, 0))
                best[u] = d0
                heap.append((d0, u))
            heapq.heapify(heap)
            D = None
            while heap:
                d, v = heapq.heappop(heap)
                if v in dist:
                    continue
                dist[v] = d
                if v == sink:
                    D = d
                    break
                pv = off + delta.get(v, 0)
                if v < n:
                    at = assign[v]
                    hv = hosts[v]
                    for i in range(r):
                        g = hv[i]
                        if g == at or not alive[g]:
                            continue
                        w = n + g
                        if w in dist:
                            continue
                        nd = d + (0 if pos[g][i] < s else 1) + pv - off - delta.get(w, 0)
                        if nd < best.get(w, big):
                            best[w] = nd
                            prev[w] = v
                            heapq.heappush(heap, (nd, w))
                else:
                    g = v - n
                    mem = members[g]
                    pg = pos[g]
                    if len(mem) < s:
                        nd = d + pv - off - delta.get(sink, 0)
                        if nd < best.get(sink, big):
                            best[sink] = nd
                            prev[sink] = v
                            heapq.heappush(heap, (nd, sink))
                    for t2, i2 in mem.items():
                        if t2 in dist:
                            continue
                        nd = d - (0 if pg[i2] < s else 1) + pv - off - delta.get(t2, 0)
                        if nd < best.get(t2, big):
                            best[t2] = nd
                            prev[t2] = v
                            heapq.heappush(heap, (nd, t2))
            if D is None:
                for t, old, new in reversed(undo):  # roll back
                    del members[new][t]
                    if old >= 0:
                        members[old][t] = self._mark_index(t, old)
                    assign[t] = old
                return False
            # augment along the path  u -> g1 -> t1 -> g2 -> ... -> gk -> sink
            path = [sink]
            while path[-1] in prev:
                path.append(prev[path[-1]])
            path.reverse()  # [u, g1, t1, ..., gk, sink]
            for a, b in zip(path[:-2:2], path[1:-1:2]):
                t, g = a, b - n
                old = assign[t]
                if old >= 0:
                    del members[old][t]
                members[g][t] = self._mark_index(t, g)
                assign[t] = g
                undo.append((t, old, g))
                touched.add(g)
            todo.discard(path[0])
            off += D
            for v, dv in dist.items():
                if dv < D:
                    delta[v] = delta.get(v, 0) + dv - D
        self._touched = touched
        return True

    def _mark_index(self, t: int, g: int) -> int:
        return self._mark_lut[(g - t) % self.n]

    def _apply_orders(self, groups: Iterable[int], s: int) -> int:
        """Swap assigned types into the first ``s`` positions; return shards moved."""
        moved = 0
        for g in groups:
            mem = self.members[g]
            pg = self._pos_l[g]
            need = [i for i in mem.values() if pg[i] >= s]
            if not need:
                continue
            og = self._ord[g].tolist()
            mem_idx = set(mem.values())
            free = [p for p in range(s) if og[p] not in mem_idx]
            for i, p in zip(need, free):
                q = pg[i]
                j = og[p]
                og[p], og[q] = i, j
                pg[i], pg[j] = p, q
                moved += 1
            self._ord[g] = og
        return moved

    # ------------------------------------------------------------------ public
    def on_failure(self, failed: Iterable[int], with_orders: bool = True) -> ControllerResult:
        """Handle groups that failed during the current step (see module docstring).

        ``with_orders=False`` leaves ``result.orders`` as ``None`` (Monte-Carlo loops; read
        :attr:`orders` when needed)."""
        failed = sorted({int(g) for g in failed})
        for g in failed:
            if not 0 <= g < self.n:
                raise TrainguardError(f"failed group {g} is out of range 0..{self.n - 1}")
        failed = [g for g in failed if self.alive_l[g]]
        if not failed:
            return ControllerResult(False, self.stack, self.orders if with_orders else None, phase="fixed")
        self.alive[failed] = False
        for g in failed:
            self.alive_l[g] = False
        self.n_alive = int(self.alive.sum())
        # types that lost their last host -> wipe-out
        cand = self.p.types[failed].ravel()
        wiped = cand[~self.alive[self._hosts[cand]].any(axis=1)]
        if wiped.size:
            wiped_t = tuple(sorted(set(wiped.tolist())))
            self.reset()
            return ControllerResult(True, self.stack, self.orders if with_orders else None, phase="wipeout",
                                    wiped_types=wiped_t)
        # Phase 0 with the orders used in this step: the uncovered types are this step's lost gradients
        cov = self.covered(self.stack)
        lost = np.flatnonzero(~cov).tolist()
        # drop the failed groups' assignments
        unassigned = []
        for g in failed:
            for t in self.members[g]:
                self.assign_l[t] = -1
                unassigned.append(t)
            self.members[g] = {}
        phase = "fixed"
        s_new = self.stack
        if lost:
            phase = "free"
            # Phase 1 at the capacity lower bound by augmenting paths from the surviving matching (what
            # Hopcroft-Karp does, started warm); only if that fails, scipy's HK scans s_lb+1..r.
            s_new = max(self.stack, math.ceil(self.n / self.n_alive))
            if not self._mcmf(unassigned, s_new):
                self.stack = s_new + 1 if s_new < self.r else s_new
                s_new = self.min_free_stack() if s_new < self.r else None
                if s_new is None:  # cannot happen when every type has an alive host (s = r always works)
                    self.reset()
                    return ControllerResult(True, self.stack, self.orders, phase="wipeout")
                if not self._mcmf(unassigned, s_new):
                    raise AssertionError("MCMF could not place every type at a stack HK-Free found feasible")
        elif not self._mcmf(unassigned, s_new):
            raise AssertionError("Phase 0 succeeded but the zero-cost reassignment failed")
        # groups that received a type on an augmenting path are the only ones that may need swaps
        moved = self._apply_orders(sorted(self._touched), s_new)
        self.stack = s_new
        patches, patch_stacks = self._patches(lost)
        return ControllerResult(False, s_new, self.orders if with_orders else None, patches, patch_stacks, phase, moved,
                                tuple(lost))

    def _patches(self, lost: list[int]) -> tuple[dict[int, int], int]:
        """Give each lost type to an alive host, least-loaded first (prefer its new assignee)."""
        load: dict[int, int] = {}
        out: dict[int, int] = {}
        for t in lost:
            cands = [g for g in self._hosts_l[t] if self.alive_l[g]]
            pref = self.assign_l[t]
            g = min(cands, key=lambda h: (load.get(h, 0), h != pref, h))
            out[t] = g
            load[g] = load.get(g, 0) + 1
        return out, max(load.values(), default=0)


def reorder(placement: Placement, orders: np.ndarray, stack: int, alive: np.ndarray,
            failed: Iterable[int]) -> ControllerResult:
    """Stateless ReCtlr: state before the step (orders, stack, alive) + groups failed in it -> result."""
    return ReCtlr.from_state(placement, orders, stack, alive).on_failure(failed)


def validate_state(placement: Placement, orders: np.ndarray, stack: int, alive: np.ndarray) -> bool:
    """True iff every type sits in the first ``stack`` positions of some alive group (a valid state)."""
    orders = np.asarray(orders)
    alive = np.asarray(alive, dtype=bool)
    held = orders[alive, :stack].ravel()
    ok_rows = all(sorted(orders[g]) == sorted(placement.types[g]) for g in range(placement.n))
    return ok_rows and np.unique(held).size == placement.n
