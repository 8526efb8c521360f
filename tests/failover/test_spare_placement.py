"""SPARe cyclic Golomb placement: overlap <= 1, every stack holds every type once, clear errors."""

import numpy as np
import pytest

from trainguard.errors import TrainguardError
from trainguard.failover.spare.placement import (
    GOLOMB_RULERS,
    OPTIMAL_LENGTHS,
    check_supported,
    contiguous_layout,
    domain_layout,
    golomb_ruler,
    hosts_in_distinct_domains,
    is_modular_golomb,
    make_placement,
    max_supported_redundancy,
    min_groups_sufficient,
    replication_layout,
    supported_redundancies,
)


def _is_golomb(marks):
    d = [b - a for i, a in enumerate(marks) for b in marks[i + 1:]]
    return len(set(d)) == len(d)


@pytest.mark.parametrize("r", sorted(GOLOMB_RULERS))
def test_rulers_are_golomb_of_the_published_optimal_length(r):
    marks = golomb_ruler(r)
    assert len(marks) == r and marks[0] == 0 and _is_golomb(marks)
    assert marks[-1] == OPTIMAL_LENGTHS[r]  # OEIS A003022


def test_rulers_go_to_28_marks_and_the_paper_sizes_reach_its_tables():
    assert max(GOLOMB_RULERS) == 28
    assert max_supported_redundancy(600) == 20  # the paper's Monte-Carlo tables: r up to 20 at N = 600
    assert max_supported_redundancy(1000) == 26  # and 26 at N = 1000
    assert max_supported_redundancy(2 * 585 + 1) == 28
    for n in (7, 200, 1000):
        for r in supported_redundancies(n):
            check_supported(n, r)


@pytest.mark.parametrize("r", [2, 3, 5, 8, 12, 20, 28])
@pytest.mark.parametrize("which", ["smallest", "sufficient", "n200"])
def test_pairwise_overlap_at_most_one(r, which):
    if which == "smallest":
        n = next(n for n in range(r, 2 * golomb_ruler(r)[-1] + 2) if is_modular_golomb(golomb_ruler(r), n))
    elif which == "sufficient":
        n = min_groups_sufficient(r)
    else:
        n = 200
    if n < r or not is_modular_golomb(golomb_ruler(r), n):
        pytest.skip(f"N={n} does not support r={r}")
    p = make_placement(n, r)
    o = p.overlap_matrix()
    assert (np.diag(o) == r).all()
    off = o[~np.eye(n, dtype=bool)]
    assert off.max() <= 1  # no two groups share two types
    inc = np.zeros((n, n))  # types x groups
    inc[np.repeat(np.arange(n), r), p.hosts.ravel()] = 1
    to = inc @ inc.T
    assert to[~np.eye(n, dtype=bool)].max() <= 1  # no two types share two groups
    # hosts and types are consistent, each type has r distinct hosts, each group r distinct types
    marks = np.asarray(golomb_ruler(r))
    assert ((p.hosts - np.arange(n)[:, None]) % n == marks % n).all()  # host g of type j: g - j is a mark
    assert ((np.arange(n)[:, None] - p.types) % n == marks % n).all()  # type t of group k: k - t is a mark
    assert (np.sort(p.hosts, axis=1)[:, 1:] != np.sort(p.hosts, axis=1)[:, :-1]).all()
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
        make_placement(2000, 29)
    with pytest.raises(TrainguardError):
        make_placement(0, 2)
    assert max_supported_redundancy(200) == 12
    assert max_supported_redundancy(7) == 3


@pytest.mark.parametrize("n,r,m", [(200, 9, 8), (128, 6, 8), (1000, 16, 8), (8192, 28, 8), (64, 3, 4)])
def test_domain_layout_puts_copies_in_different_domains(n, r, m):
    p = make_placement(n, r)
    lay = domain_layout(n, r, m)
    assert hosts_in_distinct_domains(p.hosts, lay.domain_of)
    assert np.bincount(lay.domain_of).max() <= m  # no domain holds more than m groups
    assert sorted(lay.slot_of.tolist()) == list(range(n))
    assert (lay.slot_of // m == lay.domain_of).all()
    # what a rank-order launch would do puts neighbouring marks {0, 1} in one rack
    assert not hosts_in_distinct_domains(p.hosts, contiguous_layout(n, m).domain_of)


def test_domain_layout_refusals_and_replication_sets():
    with pytest.raises(TrainguardError, match="needs 9 failure domains"):
        domain_layout(200, 9, 25)
    with pytest.raises(TrainguardError, match="no layout"):
        domain_layout(64, 6, 8)  # 8 domains cannot properly colour the 30-regular sharing graph
    lay = replication_layout(64, 4, 8)
    sets = np.arange(64).reshape(16, 4)  # replica sets of consecutive logical groups
    assert hosts_in_distinct_domains(sets, lay.domain_of)
