"""All-reduce and checkpoint traffic on a SimGrid platform (fat-tree or rail-optimized), and the
time-to-train loop with that traffic in place of the alpha-beta formulas.

Relies on SimGrid's Python binding as shipped by Debian ``python3-simgrid`` 3.32 (``import simgrid``; the
3.32 API: ``Engine(argv)``, ``NetZone.create_full_zone``, ``zone.create_host/create_link/add_route`` with
``LinkInRoute``, ``Comm.sendto_async(from, to, bytes)``, ``Comm.wait_all_for``, ``Comm.cancel``,
``this_actor.sleep_for``, ``Engine.clock``). The 4.x API differs; this module is pinned to 3.32. Without
SimGrid, :func:`simgrid_available` says why and every entry point raises a one-line
:class:`~trainguard.errors.TrainguardError`. SimGrid allows one engine per process, so the entry points
run in a fresh interpreter (:func:`run_in_subprocess`).

Platform (:class:`Platform`). Every GPU is a host with a full-duplex NIC (two links, ``link_gbps`` and
``link_latency_s`` each). GPUs are numbered group by group (group ``k`` holds GPUs ``kG .. kG+G-1``) and
packed ``gpus_per_node`` to a node. Switches are not netpoints; a route is the list of links it crosses:

* ``fat-tree`` (leaf-spine): the NICs of ``nodes_per_leaf`` nodes hang off one leaf; a leaf's up- and
  down-links to the spine carry ``(leaf NICs) x link / oversubscription``. Same leaf: NIC up, NIC down
  (2 links); else NIC up, leaf up, leaf down, NIC down (4 links).
* ``rail`` (rail-optimized): GPU ``l`` of every node of a pod (``nodes_per_leaf`` nodes) hangs off rail
  switch ``l`` of the pod, so same-index GPUs of different nodes are one switch apart; across pods the
  rail's uplink is used as above.
* GPUs of one node talk over NVLink (``nvlink_gbps``); storage nodes (``storage_nodes`` x ``storage_gbps``)
  hang off the spine.

Links are shared max-min (CM02, TCP-gamma and cross-traffic off), so a transfer alone on its path takes
``latency + bytes / bandwidth`` and concurrent transfers (the ``G`` rails of every group at once, other
groups' traffic on a leaf uplink) contend. Collectives (the data-parallel all-reduce of
:mod:`trainguard.sim.collective`): ``ring`` runs ``2(n-1)`` phases in which every rank sends ``M/n`` bytes to
its successor; ``halving-doubling`` folds the extra ranks into a power of two, then exchanges with partners
at distance ``p/2, p/4, ...`` (``M/2, M/4, ...`` bytes) and back. On a platform without contention (rail,
one pod) SimGrid gives the alpha-beta time with ``alpha`` = the path latency; contention (oversubscribed
leaves, rings crossing pods) makes it slower: that is what SimGrid adds over the formula.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import asdict, dataclass

from trainguard.errors import TrainguardError
from trainguard.sim.collective import ALGORITHMS
from trainguard.sim.timetotrain import ClusterParams, simulate

TOPOLOGIES = ("rail", "fat-tree")


def simgrid_available() -> tuple[bool, str]:
    """Whether ``import simgrid`` can work here, without importing it (the import logs to stderr)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("simgrid")
    except (ImportError, ValueError) as err:  # pragma: no cover - depends on the machine
        spec, why = None, str(err)
    else:
        why = "no module named simgrid"
    if spec is None:
        return False, f"SimGrid is not installed ({why}); install Debian python3-simgrid 3.32 (run.sh does)"
    return True, "3.32"


def _require() -> None:
    ok, why = simgrid_available()
    if not ok:
        raise TrainguardError(why)


@dataclass
class Platform:
    topology: str = "rail"
    gpus_per_node: int = 8
    nodes_per_leaf: int = 32          # nodes under one leaf (fat-tree) or in one rail pod
    link_gbps: float = 200.0          # per GPU NIC, each direction
    link_latency_s: float = 1e-6      # per link
    oversubscription: float = 1.0     # leaf downlink capacity / uplink capacity
    nvlink_gbps: float = 3600.0       # per GPU, inside a node
    storage_nodes: int = 4
    storage_gbps: float = 400.0       # per storage node

    def validate(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise TrainguardError(f"topology must be one of {', '.join(TOPOLOGIES)}, got {self.topology!r}")
        if min(self.gpus_per_node, self.nodes_per_leaf, self.storage_nodes) < 1:
            raise TrainguardError("gpus_per_node, nodes_per_leaf and storage_nodes must be >= 1")
        if min(self.link_gbps, self.nvlink_gbps, self.storage_gbps, self.oversubscription) <= 0 or self.link_latency_s < 0:
            raise TrainguardError("bandwidths and oversubscription must be > 0, latency >= 0")

    def leaf_of(self, x: int) -> int:
        node = x // self.gpus_per_node
        pod = node // self.nodes_per_leaf
        if self.topology == "rail":
            return pod * self.gpus_per_node + x % self.gpus_per_node
        return pod

    def path_latency(self, x: int, y: int) -> float:
        """Latency of the route between GPUs ``x`` and ``y`` (the alpha of one message)."""
        if x // self.gpus_per_node == y // self.gpus_per_node:
            return 2 * self.link_latency_s
        return (2 if self.leaf_of(x) == self.leaf_of(y) else 4) * self.link_latency_s


class _Net:
    """The platform built in the current engine, with routes added on demand before sealing."""

    def __init__(self, sg, n_groups: int, gpus_per_group: int, plat: Platform, pairs, storage: bool):
        self.sg, self.plat = sg, plat
        self.G = gpus_per_group
        n_gpus = n_groups * gpus_per_group
        zone = sg.NetZone.create_full_zone("cluster")
        bw = plat.link_gbps * 1e9 / 8
        lat = plat.link_latency_s

        def link(name, b, latency=lat):
            lk = zone.create_link(name, b)
            lk.set_latency(latency)
            lk.seal()
            return sg.LinkInRoute(lk)

        self.hosts = [zone.create_host(f"gpu{x}", 1e12) for x in range(n_gpus)]
        up = [link(f"nic_up{x}", bw) for x in range(n_gpus)]
        down = [link(f"nic_down{x}", bw) for x in range(n_gpus)]
        nvb = plat.nvlink_gbps * 1e9 / 8
        nv_up = [link(f"nv_up{x}", nvb, 0.0) for x in range(n_gpus)]
        nv_down = [link(f"nv_down{x}", nvb, 0.0) for x in range(n_gpus)]
        leaves: dict[int, int] = {}
        for x in range(n_gpus):
            leaves[plat.leaf_of(x)] = leaves.get(plat.leaf_of(x), 0) + 1
        l_up = {L: link(f"leaf_up{L}", c * bw / plat.oversubscription) for L, c in leaves.items()}
        l_down = {L: link(f"leaf_down{L}", c * bw / plat.oversubscription) for L, c in leaves.items()}

        def route(x, y):
            if x // plat.gpus_per_node == y // plat.gpus_per_node:
                return [nv_up[x], nv_down[y]]
            lx, ly = plat.leaf_of(x), plat.leaf_of(y)
            if lx == ly:
                return [up[x], down[y]]
            return [up[x], l_up[lx], l_down[ly], down[y]]

        done = set()
        for x, y in pairs:
            if (x, y) in done or x == y:
                continue
            done.add((x, y))
            zone.add_route(self.hosts[x].netpoint, self.hosts[y].netpoint, None, None, route(x, y), False)
        self.storage = []
        if storage:
            sbw = plat.storage_gbps * 1e9 / 8
            for s in range(plat.storage_nodes):
                h = zone.create_host(f"storage{s}", 1e12)
                sdown = link(f"storage_down{s}", sbw)
                for x in range(n_gpus):
                    zone.add_route(self.hosts[x].netpoint, h.netpoint, None, None,
                                   [up[x], l_up[plat.leaf_of(x)], sdown], False)
                self.storage.append(h)
        zone.seal()
        self.transfers = 0

    # ---------------------------------------------------------------- collectives
    def _phase(self, sends, deadline: float) -> bool:
        """Start ``(src, dst, bytes)`` transfers at once and wait; False (cancelled) at ``deadline``."""
        sg = self.sg
        comms = [sg.Comm.sendto_async(self.hosts[a], self.hosts[b], max(1, int(round(nb)))) for a, b, nb in sends]
        self.transfers += len(comms)
        if not math.isfinite(deadline):
            sg.Comm.wait_all(comms)
            return True
        left = deadline - sg.Engine.clock
        try:
            if left <= 0:
                raise sg.TimeoutException()
            sg.Comm.wait_all_for(comms, left)
            return True
        except sg.TimeoutException:
            for c in comms:
                try:
                    c.cancel()
                except Exception:
                    pass
            return False

    def allreduce(self, groups: list[int], bytes_per_gpu: float, algorithm: str, deadline: float = math.inf) -> bool:
        """One data-parallel all-reduce among ``groups`` (each rail of same-index GPUs at once)."""
        n = len(groups)
        if n <= 1 or bytes_per_gpu <= 0:
            return True
        G = self.G
        M = float(bytes_per_gpu)
        gpu = [[k * G + i for k in groups] for i in range(G)]  # rail i: GPU i of every group
        if algorithm == "ring":
            chunk = M / n
            for _ in range(2 * (n - 1)):
                sends = [(rail[j], rail[(j + 1) % n], chunk) for rail in gpu for j in range(n)]
                if not self._phase(sends, deadline):
                    return False
            return True
        if algorithm == "halving-doubling":
            p = 1 << (n.bit_length() - 1)
            extra = n - p
            if extra and not self._phase([(rail[p + j], rail[j], M) for rail in gpu for j in range(extra)], deadline):
                return False
            steps = []
            d, size = p // 2, M / 2
            while d >= 1:
                steps.append((d, size))
                d, size = d // 2, size / 2
            for d, size in steps + steps[::-1]:  # reduce-scatter (halving) then all-gather (doubling)
                sends = [(rail[j], rail[j ^ d], size) for rail in gpu for j in range(p)]
                if not self._phase(sends, deadline):
                    return False
            if extra and not self._phase([(rail[j], rail[p + j], M) for rail in gpu for j in range(extra)], deadline):
                return False
            return True
        raise TrainguardError(f"unknown all-reduce algorithm {algorithm!r}")

    def checkpoint(self, group: int, checkpoint_bytes: float) -> None:
        """The ``G`` GPUs of ``group`` each write ``checkpoint_bytes / G`` to storage node ``i mod S``."""
        G, S = self.G, len(self.storage)
        comms = [self.sg.Comm.sendto_async(self.hosts[group * G + i], self.storage[i % S],
                                           max(1, int(round(checkpoint_bytes / G)))) for i in range(G)]
        self.transfers += len(comms)
        self.sg.Comm.wait_all(comms)


def _engine():
    import simgrid

    return simgrid, simgrid.Engine(["trainguard-simgrid", "--cfg=network/model:CM02", "--cfg=network/TCP-gamma:0",
                                    "--cfg=network/crosstraffic:0", "--cfg=maxmin/precision:1e-9",
                                    "--cfg=surf/precision:1e-9", "--log=root.thres:critical"])


def _ring_pairs(n_groups: int, G: int):
    """Every ordered pair of same-index GPUs (rings over any subset of alive groups need them)."""
    for i in range(G):
        for a in range(n_groups):
            for b in range(n_groups):
                if a != b:
                    yield a * G + i, b * G + i


# ----------------------------------------------------------------------------- measurements
def measure(spec: dict) -> dict:
    """In this process (one engine): all-reduce time for each ``n`` in ``spec["groups"]`` and one checkpoint."""
    _require()
    sg, eng = _engine()
    plat = Platform(**spec["platform"])
    plat.validate()
    n_max, G = max(spec["groups"]), int(spec["gpus_per_group"])
    net = _Net(sg, n_max, G, plat, list(_ring_pairs(n_max, G)), storage=spec.get("checkpoint_bytes", 0) > 0)
    out: dict = {"allreduce_s": {}, "path_latency_s": {}}

    def main():
        for n in spec["groups"]:
            t0 = sg.Engine.clock
            net.allreduce(list(range(n)), spec["bytes_per_gpu"], spec["algorithm"])
            out["allreduce_s"][str(n)] = sg.Engine.clock - t0
            out["path_latency_s"][str(n)] = max(plat.path_latency(a * G, ((a + 1) % n) * G) for a in range(n))
        if spec.get("checkpoint_bytes", 0) > 0:
            t0 = sg.Engine.clock
            net.checkpoint(0, spec["checkpoint_bytes"])
            out["checkpoint_s"] = sg.Engine.clock - t0

    sg.Actor.create("collective", net.hosts[0], main)
    eng.run()
    out["transfers"] = net.transfers
    out["simgrid_version"] = sg.simgrid_version
    return out


class SimGridClock:
    """Clock backend of :func:`trainguard.sim.timetotrain.simulate`: compute, restarts and controller time are
    sleeps; every all-reduce and checkpoint save is real traffic on the platform (bytes scaled by the
    event's jitter factor), so its duration emerges from the topology and contention."""

    batchable = False

    def __init__(self, sg, net: _Net, bytes_per_gpu: float, algorithm: str, checkpoint_bytes: float, G: int):
        self.sg, self.net = sg, net
        self.M, self.algorithm, self.ckpt_bytes, self.G = bytes_per_gpu, algorithm, checkpoint_bytes, G
        self.allreduce_time = 0.0

    def now(self) -> float:
        return self.sg.Engine.clock

    def compute(self, seconds: float, units=None) -> None:
        self.sg.this_actor.sleep_for(seconds)

    def allreduce(self, seconds: float, factor: float, deadline: float, failed_frac: float, units=None) -> bool:
        start = self.now()
        groups = sorted(int(u) for u in units) if units is not None else []
        ok = self.net.allreduce(groups, self.M * factor, self.algorithm, deadline)
        self.allreduce_time += self.now() - start
        if ok:
            return True
        # as in the fast loop: a failed all-reduce costs failed_frac of one, and lasts until the failure
        target = max(start + failed_frac * seconds, deadline)
        if target > self.now():
            self.sg.this_actor.sleep_for(target - self.now())
        return False

    def checkpoint(self, seconds: float, factor: float = 1.0, units=None) -> None:
        self.net.checkpoint(0, self.ckpt_bytes * factor)

    def sleep(self, seconds: float, what: str = "") -> None:
        self.sg.this_actor.sleep_for(seconds)


def simulate_simgrid(scheme: str, n: int, r: int, seed: int, params: ClusterParams, platform: Platform,
                     max_steps: int | None = None) -> dict:
    """One time-to-train run with its traffic on SimGrid (call once per process). Hot spares are not
    modelled on the platform (the run refuses them). The checkpoint size is the one the fast loop's
    ``checkpoint_s`` implies on an uncontended path, so the two differ only by contention."""
    _require()
    from trainguard.sim.collective import checkpoint_time

    if params.hot_spares:
        raise TrainguardError("the SimGrid backend does not model hot spares; use the fast backend")
    if params.allreduce_s is not None:
        raise TrainguardError("the SimGrid backend derives the all-reduce from the platform; drop allreduce_s")
    plat = platform
    plat.validate()
    G = params.gpus_per_group(n)
    net_p = params.network()
    bpg = params.model_params * params.grad_bytes_per_param / G
    ckpt_bw = min(G * net_p.beta, plat.storage_nodes * plat.storage_gbps * 1e9 / 8)
    ckpt_bytes = max(0.0, params.checkpoint_s - checkpoint_time(0.0, G, net_p)) * ckpt_bw
    sg, eng = _engine()
    net = _Net(sg, n, G, plat, list(_ring_pairs(n, G)), storage=True)
    clock = SimGridClock(sg, net, bpg, params.allreduce_algorithm, ckpt_bytes, G)
    out: dict = {}

    def main():
        res = simulate(scheme, n, r, seed, params, clock=clock, max_steps=max_steps, batch=False)
        out.update(res.as_dict())

    sg.Actor.create("trainer", net.hosts[0], main)
    eng.run()
    out["simgrid_clock_s"] = sg.Engine.clock
    out["simgrid_transfers"] = net.transfers
    out["simgrid_allreduce_total_s"] = clock.allreduce_time
    out["simgrid_version"] = sg.simgrid_version
    return out


def run_in_subprocess(kind: str, spec: dict, timeout: float = 600) -> dict:
    """Run ``measure`` (``kind="measure"``) or ``simulate_simgrid`` (``kind="simulate"``) in a fresh interpreter."""
    _require()
    payload = json.dumps({"kind": kind, "spec": spec})
    try:
        proc = subprocess.run([sys.executable, "-m", "trainguard.sim.simgrid_model", payload], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise TrainguardError(f"SimGrid run did not finish within {timeout:.0f} s; use a smaller cluster") from None
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise TrainguardError(f"SimGrid run failed: {tail}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {k: (float(v) if v in ("inf", "-inf", "nan") else v) for k, v in out.items()}


def simulate_in_subprocess(scheme: str, n: int, r: int, seed: int, params: ClusterParams, platform: Platform,
                           max_steps: int | None = None, timeout: float = 600) -> dict:
    spec = {"scheme": scheme, "n": n, "r": r, "seed": seed, "params": asdict(params), "platform": asdict(platform),
            "max_steps": max_steps}
    return run_in_subprocess("simulate", spec, timeout)


def measure_in_subprocess(groups: list[int], gpus_per_group: int, bytes_per_gpu: float, algorithm: str,
                          platform: Platform, checkpoint_bytes: float = 0.0, timeout: float = 600) -> dict:
    if algorithm not in ALGORITHMS:
        raise TrainguardError(f"all-reduce algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    platform.validate()
    spec = {"groups": list(groups), "gpus_per_group": gpus_per_group, "bytes_per_gpu": bytes_per_gpu,
            "algorithm": algorithm, "platform": asdict(platform), "checkpoint_bytes": checkpoint_bytes}
    return run_in_subprocess("measure", spec, timeout)


if __name__ == "__main__":
    from trainguard.utils import emit_json

    msg = json.loads(sys.argv[1])
    s = msg["spec"]
    if msg["kind"] == "measure":
        emit_json(measure(s))
    else:
        emit_json(simulate_simgrid(s["scheme"], s["n"], s["r"], s["seed"], ClusterParams(**s["params"]),
                                   Platform(**s["platform"]), s.get("max_steps")))
