"""Alpha-beta cost of the data-parallel all-reduce and of a checkpoint save.

Relies on the standard library only.

Every GPU of a group holds ``1/G`` of the model's gradient (tensor / pipeline / sharded parallelism inside
the group), so the all-reduce across ``n`` groups is ``G`` concurrent all-reduces of ``M = gradient_bytes / G``
bytes among ``n`` ranks, one per "rail" of same-index GPUs. With ``alpha`` the latency of one message
(per hop of the algorithm) and ``beta`` the goodput of one GPU's link (bytes/s), the classic costs are
(Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009):

* ``ring``: ``2 (n-1)`` steps of ``M/n`` bytes: ``T = 2 (n-1) alpha + 2 (n-1)/n * M / beta``;
* ``halving-doubling`` (Rabenseifner: recursive-halving reduce-scatter + recursive-doubling all-gather) on
  ``p = 2^floor(log2 n)`` ranks, the ``n - p`` extra ranks first folded in and finally served (two more
  steps of ``M`` bytes when ``n`` is not a power of two):
  ``T = 2 log2(p) alpha + 2 (p-1)/p * M / beta [+ 2 (alpha + M / beta)]``.

So the bandwidth term does not grow with ``n``; with ``G = total_gpus / n`` fixed-size models it does (``M``
grows with ``n``), which is why the SPARe paper's all-reduce "scales linearly in N" at a fixed 600k GPUs.

Checkpoint save: one group's ``G`` GPUs write ``checkpoint_bytes / G`` each to storage with an aggregate
bandwidth; ``d = alpha + checkpoint_bytes / min(G * beta, storage_bandwidth)``.

:mod:`trainguard.sim.simgrid_model` runs the same traffic on a SimGrid platform (fat-tree or rail-optimized,
with contention) and ``tests/sim/test_collective.py`` checks these formulas against it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from trainguard.errors import TrainguardError

ALGORITHMS = ("ring", "halving-doubling")


@dataclass
class NetworkParams:
    algorithm: str = "ring"
    hop_latency_s: float = 5e-6        # alpha: per message, NCCL-like inter-node latency (a few microseconds)
    gpu_bandwidth_gbps: float = 200.0  # beta: goodput of one GPU's data-parallel link, Gb/s
    storage_bandwidth_gbps: float = 0.0  # aggregate checkpoint storage bandwidth, Gb/s (0: unlimited)

    def validate(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise TrainguardError(f"all-reduce algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if not (self.hop_latency_s >= 0 and math.isfinite(self.hop_latency_s)):
            raise TrainguardError(f"hop latency must be >= 0 s, got {self.hop_latency_s}")
        if not (self.gpu_bandwidth_gbps > 0 and math.isfinite(self.gpu_bandwidth_gbps)):
            raise TrainguardError(f"GPU link bandwidth must be > 0 Gb/s, got {self.gpu_bandwidth_gbps}")
        if not self.storage_bandwidth_gbps >= 0:
            raise TrainguardError(f"storage bandwidth must be >= 0 Gb/s, got {self.storage_bandwidth_gbps}")

    @property
    def beta(self) -> float:
        """Bytes per second of one GPU link."""
        return self.gpu_bandwidth_gbps * 1e9 / 8.0

    def as_dict(self) -> dict:
        return asdict(self)


def allreduce_time(n: int, bytes_per_rank: float, net: NetworkParams) -> float:
    """Seconds of one all-reduce of ``bytes_per_rank`` among ``n`` ranks (the concurrent rails do not
    contend in this model)."""
    if n <= 1 or bytes_per_rank <= 0:
        return 0.0
    a, B = net.hop_latency_s, net.beta
    M = float(bytes_per_rank)
    if net.algorithm == "ring":
        return 2 * (n - 1) * a + 2 * (n - 1) / n * M / B
    if net.algorithm == "halving-doubling":
        p = 1 << (int(n).bit_length() - 1)
        t = 2 * math.log2(p) * a + 2 * (p - 1) / p * M / B
        if p != n:
            t += 2 * (a + M / B)
        return t
    raise TrainguardError(f"unknown all-reduce algorithm {net.algorithm!r}")


def checkpoint_time(checkpoint_bytes: float, gpus_per_group: int, net: NetworkParams) -> float:
    """Seconds to write ``checkpoint_bytes`` from one group's GPUs to storage."""
    bw = gpus_per_group * net.beta
    if net.storage_bandwidth_gbps > 0:
        bw = min(bw, net.storage_bandwidth_gbps * 1e9 / 8.0)
    return net.hop_latency_s + checkpoint_bytes / bw
