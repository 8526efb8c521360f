"""SPARe cyclic Golomb placement: overlap <= 1, every stack holds every type once, clear errors."""

import numpy as np
import pytest

from trainguard.errors import TrainguardError
from trainguard.failover.spare.placement import (
    GOLOMB_RULERS,
    check_supported,
    golomb_ruler,
    is_modular_golomb,
    make_placement,
    max_supported_redundancy,
    min_groups_sufficient,
)


def _is_golomb(marks):
    d = [b - a for i, a in enumerate(marks) for b in marks[i + 1:]]
    return len(set(d)) == len(d)


@pytest.mark.parametrize("r", sorted(GOLOMB_RULERS))
def test_rulers_are_golomb(r):
    marks = golomb_ruler(r)
    assert len(marks) == r and marks[0] == 0 and _is_golomb(marks)


@pytest.mark.parametrize("r", sorted(GOLOMB_RULERS))
@pytest.mark.parametrize("which", ["smallest", "sufficient", "n200"])
def test_pairwise_overlap_at_most_one(r, which):
    if which == "smallest":
        n = next(n for n in range(r, 400) if is_modular_golomb(golomb_ruler(r), n))
    elif which == "sufficient":
        n = min_groups_sufficient(r)
    else:
        n = 200
    p = make_placement(n, r)
    o = p.overlap_matrix()
    assert (np.diag(o) == r).all()
    off = o[~np.eye(n, dtype=bool)]
    assert off.max() <= 1  # no two groups share two types
    inc = np.zeros((n, n), dtype=np.int64)  # types x groups
    inc[np.repeat(np.arange(n), r), p.hosts.ravel()] = 1
    to = inc @ inc.T
    assert to[~np.eye(n, dtype=bool)].max() <= 1  # no two types share two groups
    # hosts and types are consistent, each type has r distinct hosts, each group r distinct types
    for j in range(n):
        assert len(set(p.hosts[j])) == r
        for g in p.hosts[j]:
            assert j in p.types[g]
    # every stack (column of the initial order) contains every type exactly once
    for s in range(r):
        assert sorted(p.initial_order[:, s]) == list(range(n))


def test_sufficient_condition_always_works():
    for r in GOLOMB_RULERS:
        L = golomb_ruler(r)[-1]
        for n in range(2 * L + 1, 2 * L + 40):
            check_supported(n, r)


def test_fano_plane_and_refusals():
    check_supported(7, 3)  # {0,1,3} is a perfect difference set mod 7
    with pytest.raises(TrainguardError, match="share two shard types"):
        check_supported(8, 3) if not is_modular_golomb((0, 1, 3), 8) else check_supported(6, 3)
    with pytest.raises(TrainguardError, match="N >= 23"):
        make_placement(10, 5)
    with pytest.raises(TrainguardError, match="not supported"):
        make_placement(1000, 13)
    with pytest.raises(TrainguardError):
        make_placement(0, 2)
    assert max_supported_redundancy(200) == 12
    assert max_supported_redundancy(7) == 3
