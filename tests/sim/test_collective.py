"""Alpha-beta all-reduce and checkpoint costs, and SimGrid against them (equal without contention, slower with)."""

import pytest

from trainguard.errors import TrainguardError
from trainguard.sim.collective import NetworkParams, allreduce_time, checkpoint_time
from trainguard.sim.simgrid_model import Platform, measure_in_subprocess, simgrid_available


def test_ring_and_halving_doubling_formulas():
    net = NetworkParams(hop_latency_s=1e-5, gpu_bandwidth_gbps=80.0)  # 10 GB/s
    M = 1e9
    assert allreduce_time(1, M, net) == 0.0
    assert allreduce_time(8, M, net) == pytest.approx(14 * 1e-5 + 2 * 7 / 8 * 0.1)
    hd = NetworkParams("halving-doubling", 1e-5, 80.0)
    assert allreduce_time(8, M, hd) == pytest.approx(6 * 1e-5 + 2 * 7 / 8 * 0.1)
    assert allreduce_time(12, M, hd) == pytest.approx(6 * 1e-5 + 2 * 7 / 8 * 0.1 + 2 * (1e-5 + 0.1))
    # the bandwidth term is bounded in n (2 M / beta); only the latency term grows linearly
    grow = allreduce_time(4096, M, net) - allreduce_time(64, M, net)
    assert grow == pytest.approx(2 * (4095 - 63) * 1e-5 + 2 * 0.1 * (1 / 64 - 1 / 4096))
    assert checkpoint_time(8e10, 8, net) == pytest.approx(1e-5 + 1.0)
    capped = NetworkParams(storage_bandwidth_gbps=8.0)
    assert checkpoint_time(1e9, 8, capped) == pytest.approx(capped.hop_latency_s + 1.0)
    with pytest.raises(TrainguardError):
        NetworkParams(algorithm="tree").validate()


_ok, _why = simgrid_available()


@pytest.mark.skipif(not _ok, reason=f"SimGrid 3.32 Python binding not available: {_why}")
@pytest.mark.parametrize("algorithm", ["ring", "halving-doubling"])
def test_simgrid_equals_alpha_beta_without_contention_and_is_slower_with_it(algorithm):
    groups = [2, 4, 6]
    net = NetworkParams(algorithm, hop_latency_s=2e-6, gpu_bandwidth_gbps=200.0)
    free = measure_in_subprocess(groups, 4, 1e8, algorithm, Platform(gpus_per_node=4, nodes_per_leaf=32),
                                 checkpoint_bytes=1e10)
    for n in groups:
        assert free["allreduce_s"][str(n)] == pytest.approx(allreduce_time(n, 1e8, net), rel=1e-6)
    assert free["checkpoint_s"] == pytest.approx(4 * 1e-6 / 4 * 3 + 1e10 / (4 * 25e9), rel=1e-4)
    # one node per leaf, uplinks at a quarter of the leaf's NIC capacity: rings across leaves contend
    tight = measure_in_subprocess(groups, 4, 1e8, algorithm,
                                  Platform(topology="fat-tree", gpus_per_node=4, nodes_per_leaf=1, oversubscription=4))
    for n in groups[1:]:
        assert tight["allreduce_s"][str(n)] > 1.5 * allreduce_time(n, 1e8, net)
