"""ReCtlr: valid assignments, and HK-Fixed / HK-Free / MCMF agree with brute force and networkx."""

import itertools

import networkx as nx
import numpy as np
import pytest

from trainguard.errors import TrainguardError
from trainguard.failover.spare import ReCtlr, make_placement, reorder, validate_state


def _brute(p, orders, s_old, alive):
    """Brute force over every type -> alive host assignment: (covered at s_old, s*, min movement at s*)."""
    n, r = p.n, p.r
    top_old = {(g, int(t)) for g in range(n) if alive[g] for t in orders[g, :s_old]}
    covered = all(any((g, t) in top_old for g in p.hosts[t]) for t in range(n))
    choices = [[int(g) for g in p.hosts[t] if alive[g]] for t in range(n)]
    best_cost = {}
    pos = {(g, int(t)): i for g in range(n) for i, t in enumerate(orders[g])}
    for combo in itertools.product(*choices):
        load = max(combo.count(g) for g in set(combo))
        for s in range(max(load, s_old), r + 1):
            cost = sum(pos[(g, t)] >= s for t, g in enumerate(combo))
            if cost < best_cost.get(s, 10**9):
                best_cost[s] = cost
    s_star = min(s for s in range(s_old, r + 1) if s in best_cost)
    return covered, s_star, best_cost[s_star]


def _check_result(p, before_orders, before_s, alive, res):
    n = p.n
    assert not res.wipeout
    assert validate_state(p, res.orders, res.stack, alive)
    # every type exactly once in the assignment, within the first `stack` positions of an alive host
    # (validate_state) and lost types get a patch on an alive host holding them
    top_old = {int(t) for g in range(n) if alive[g] for t in before_orders[g, :before_s]}
    lost = set(range(n)) - top_old
    assert set(res.patches) == lost
    for t, g in res.patches.items():
        assert alive[g] and t in p.types[g]


@pytest.mark.parametrize("n,r,seed", [(7, 3, 0), (7, 3, 1), (8, 3, 2), (9, 3, 3), (9, 3, 4), (13, 4, 5)])
def test_controller_matches_brute_force(n, r, seed):
    p = make_placement(n, r)
    rng = np.random.default_rng(seed)
    checked = 0
    for trial in range(6):
        ctl = ReCtlr(p)
        # scramble orders of a valid state a little: random start via random failures
        for g in rng.permutation(n):
            orders, s_old, alive_before = ctl.orders, ctl.stack, ctl.alive.copy()
            alive = alive_before.copy()
            alive[g] = False
            wiped = any(not alive[p.hosts[t]].any() for t in range(n))
            size = np.prod([max(1, int(alive[p.hosts[t]].sum())) for t in range(n)], dtype=float)
            if size > 30000:  # brute force would be too big: only validate
                res = ctl.on_failure([g])
                if res.wipeout:
                    break
                _check_result(p, orders, s_old, alive, res)
                continue
            res = ctl.on_failure([g])
            assert res.wipeout == wiped
            if wiped:
                assert ctl.stack == 1 and ctl.alive.all()
                break
            covered, s_star, cost = _brute(p, orders, s_old, alive)
            assert (res.phase == "fixed") == covered  # HK-Fixed
            assert res.stack == s_star                 # HK-Free
            assert res.moved == cost                   # MCMF minimum movement
            _check_result(p, orders, s_old, alive, res)
            checked += 1
    assert checked > 0


def _nx_min_cost(p, ctl_before, alive, s):
    """networkx max_flow_min_cost of the movement problem at stack s."""
    G = nx.DiGraph()
    orders = ctl_before
    for t in range(p.n):
        G.add_edge("S", ("t", t), capacity=1, weight=0)
        for g in p.hosts[t]:
            if alive[g]:
                pos = list(orders[g]).index(t)
                G.add_edge(("t", t), ("g", int(g)), capacity=1, weight=0 if pos < s else 1)
    for g in range(p.n):
        if alive[g]:
            G.add_edge(("g", g), "T", capacity=s, weight=0)
    flow = nx.max_flow_min_cost(G, "S", "T")
    value = sum(flow["S"].values())
    return value, nx.cost_of_flow(G, flow)


def test_mcmf_and_hk_free_against_networkx():
    p = make_placement(40, 4)
    rng = np.random.default_rng(7)
    ctl = ReCtlr(p)
    compared = 0
    for g in rng.permutation(40):
        orders, alive = ctl.orders, ctl.alive.copy()
        alive[g] = False
        if not all(alive[p.hosts[t]].any() for t in range(40)):
            break
        res = ctl.on_failure([g])
        value, cost = _nx_min_cost(p, orders, alive, res.stack)
        assert value == 40 and cost == res.moved
        if res.stack > 1:
            v_lower, _ = _nx_min_cost(p, orders, alive, res.stack - 1)
            assert v_lower < 40 or res.phase == "fixed"
            assert ctl.feasible_free(res.stack)
        compared += 1
    assert compared > 5


def test_stateless_reorder_matches_stateful_and_multi_failures():
    p = make_placement(31, 3)
    ctl = ReCtlr(p)
    rng = np.random.default_rng(3)
    order = rng.permutation(31)
    for g in order[:6]:
        ctl.on_failure([g])
    orders, s, alive = ctl.orders, ctl.stack, ctl.alive.copy()
    failed = [int(x) for x in order[6:9]]
    a = reorder(p, orders, s, alive, failed)
    b = ctl.on_failure(failed)
    assert a.wipeout == b.wipeout
    if not a.wipeout:
        assert a.stack == b.stack and a.moved == b.moved
        alive[failed] = False
        assert validate_state(p, a.orders, a.stack, alive)


def test_wipeout_resets_and_bad_input():
    p = make_placement(23, 5)
    ctl = ReCtlr(p)
    hosts = [int(g) for g in p.hosts[0]]
    for g in hosts[:-1]:
        assert not ctl.on_failure([g]).wipeout
    res = ctl.on_failure([hosts[-1]])
    assert res.wipeout and 0 in res.wiped_types
    assert ctl.stack == 1 and ctl.alive.all() and (res.orders == p.initial_order).all()
    with pytest.raises(TrainguardError):
        ctl.on_failure([99])
    with pytest.raises(TrainguardError):
        reorder(p, p.initial_order[:, ::-1][:, :3], 1, np.ones(23, bool), [0])


@pytest.mark.parametrize("seed", range(8))
def test_stateless_reorder_from_scrambled_orders_matches_brute_force(seed):
    p = make_placement(8, 3)
    rng = np.random.default_rng(100 + seed)
    orders = np.array([rng.permutation(row) for row in p.types])
    alive = np.ones(8, dtype=bool)
    alive[rng.choice(8, size=2, replace=False)] = False
    s = next(s for s in range(1, 4) if validate_state(p, orders, s, alive))
    g = int(rng.choice(np.flatnonzero(alive)))
    after = alive.copy()
    after[g] = False
    if not all(after[p.hosts[t]].any() for t in range(8)):
        assert reorder(p, orders, s, alive, [g]).wipeout
        return
    res = reorder(p, orders, s, alive, [g])
    covered, s_star, cost = _brute(p, orders, s, after)
    assert (res.phase == "fixed") == covered and res.stack == s_star and res.moved == cost
    _check_result(p, orders, s, after, res)


def _scipy_min_cost(p, orders, alive, s):
    """Library reference: scipy's min_weight_full_bipartite_matching (LAPJVsp) on types x (alive group, copy),
    weight 1 + movement cost; ``None`` when no assignment with at most ``s`` types per group exists."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import maximum_bipartite_matching, min_weight_full_bipartite_matching

    n = p.n
    rank = np.cumsum(alive) - 1
    rows, cols, w = [], [], []
    for t in range(n):
        for g in p.hosts[t]:
            if alive[g]:
                cost = 0 if list(orders[g]).index(t) < s else 1
                for c in range(s):
                    rows.append(t)
                    cols.append(rank[g] * s + c)
                    w.append(1.0 + cost)
    m = csr_matrix((w, (rows, cols)), shape=(n, int(alive.sum()) * s))
    if (maximum_bipartite_matching(m, perm_type="column") < 0).any():
        return None
    r_idx, c_idx = min_weight_full_bipartite_matching(m)
    return int(round(m[r_idx, c_idx].sum() - n))


@pytest.mark.parametrize("seed,alive_target", [(0, 560), (1, 502), (2, 420)])
def test_mcmf_against_scipy_on_large_random_cases(seed, alive_target):
    # N = 1000, r = 12: a random failure history down to a target survivor count (502: across the s = 2 -> 3
    # transition), then each failure's s' and minimum movement checked against the library
    p = make_placement(1000, 12)
    rng = np.random.default_rng(seed)
    ctl = ReCtlr(p)
    order = rng.permutation(1000).tolist()
    while ctl.n_alive > alive_target:
        if ctl.on_failure([order.pop()], with_orders=False).wipeout:
            order = rng.permutation(1000).tolist()
    checked = raised = 0
    for g in order[-6:]:
        orders, s_old, alive = ctl.orders, ctl.stack, ctl.alive.copy()
        alive[g] = False
        res = ctl.on_failure([int(g)])
        if res.wipeout:
            break
        assert validate_state(p, res.orders, res.stack, alive)
        assert _scipy_min_cost(p, orders, alive, res.stack) == res.moved  # minimum movement at s'
        if res.stack > s_old:
            assert _scipy_min_cost(p, orders, alive, res.stack - 1) is None  # s' is the smallest feasible
            raised += 1
        checked += 1
    assert checked >= 3
    if alive_target == 502:
        assert raised >= 1
