"""The data-parallel ring and how an out worker's micro-batches are spread over its ring neighbors: shared by the
gradient-sync policy (:mod:`trainguard.failover.mecefo.policy`, on micro-batch indices) and the cluster model
(:mod:`trainguard.failover.mecefo.cluster`, on counts), so both assign the same work.

``spread`` = ``k``: the out worker's ``m``-th micro-batch goes to the ``(m mod k)``-th of the ``k`` workers that
follow it in the ring and are up (``k = 1``: the paper's single neighbor). ``"auto"``: the smallest ``k`` whose
most loaded neighbor is not slower than a normal worker (a caller's estimate says which loads are too slow),
capped by the out worker's micro-batch count and so that at least one worker that is up is nobody's neighbor
(someone must compute the attention gradient that skip-MHA leaves out). Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from trainguard.errors import TrainguardError

AUTO = "auto"


def ring_next(dead: int, workers: Iterable[int], replicas: int) -> int:
    """The first worker after ``dead`` in the data-parallel ring ``0 .. replicas-1``."""
    return min(workers, key=lambda r: ((r - dead) % replicas, r))


def ring_prev(r: int, workers: Iterable[int], replicas: int) -> int:
    """The last worker before ``r`` in the ring (``r`` itself when it is alone)."""
    others = [w for w in workers if w != r]
    return max(others, key=lambda w: ((w - r) % replicas, w)) if others else r


def ring_after(dead: int, workers: Iterable[int], replicas: int, k: int) -> list[int]:
    """The first ``k`` workers after ``dead`` in the ring (fewer when fewer are up)."""
    return sorted((w for w in workers if w != dead), key=lambda r: ((r - dead) % replicas, r))[:k]


def parse_spread(value: int | str) -> int | str:
    """``"auto"`` or an int >= 1 (also from text); a one-line error otherwise."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        k = int(value)
    except (TypeError, ValueError):
        raise TrainguardError(f"mecefo.spread must be 'auto' or an integer >= 1, got {value!r}") from None
    if k < 1 or (isinstance(value, float) and value != k):
        raise TrainguardError(f"mecefo.spread must be 'auto' or an integer >= 1, got {value!r}")
    return k


def assign(shares: dict[int, int], workers: Iterable[int], replicas: int, k: int) -> dict[int, list[tuple[int, int]]]:
    """host -> [(out worker, its micro-batch position)] for ``shares`` = {out worker: micro-batches to place},
    in out-worker order then position (so ``k = 1`` is the paper's: every micro-batch to the next worker)."""
    up = list(workers)
    out: dict[int, list[tuple[int, int]]] = {}
    for d in sorted(shares):
        hosts = ring_after(d, up, replicas, max(1, min(k, shares[d])))
        for m in range(shares[d]):
            out.setdefault(hosts[m % len(hosts)], []).append((d, m))
    return out


def resolve(spread: int | str, shares: dict[int, int], workers: Iterable[int], replicas: int,
            too_slow: Callable[[int], bool] | None = None) -> int:
    """The ``k`` to use: an int is capped by the largest share and the workers up; ``"auto"`` tries ``k = 1, 2, ...``
    up to that cap, and further capped so that some worker up is nobody's neighbor (when ``k = 1`` leaves one), and
    stops at the first whose most loaded neighbor carries extra micro-batches that ``too_slow(extra)`` accepts."""
    up = list(workers)
    live = [d for d, c in shares.items() if c > 0]
    if not live or not up:
        return 1
    cap = max(1, min(max(shares[d] for d in live), len(up)))
    if parse_spread(spread) != AUTO:
        return min(int(spread), cap)
    if len(assign(shares, up, replicas, 1)) < len(up):  # someone is free at k = 1: keep someone free
        while cap > 1 and len(assign(shares, up, replicas, cap)) >= len(up):
            cap -= 1
    for k in range(1, cap + 1):
        extra = max(len(v) for v in assign(shares, up, replicas, k).values())
        if too_slow is None or not too_slow(extra):
            return k
    return cap


__all__ = ["AUTO", "assign", "parse_spread", "resolve", "ring_after", "ring_next", "ring_prev"]
