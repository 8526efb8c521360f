"""The time-to-train model of :mod:`trainguard.sim.timetotrain` executed on SimGrid 3.32.

Relies on SimGrid's Python binding as shipped by Debian ``python3-simgrid`` 3.32 (``import simgrid``;
the 3.32 API: ``Engine(argv)``, ``NetZone.create_full_zone``, ``zone.create_host/create_link/add_route``
with ``LinkInRoute``, ``this_actor.exec_init``, ``Comm.sendto_async(from, to, bytes)``,
``Comm.wait_all``, ``this_actor.sleep_for``, ``Engine.clock``). The 4.x API differs; this module is
pinned to 3.32.

Platform: one SimGrid host per data-parallel group (speed ``FLOPS``), a full mesh of private links
(bandwidth ``BW`` bytes/s, zero latency) so that any ring of surviving groups is contention-free. The
network model is CM02 with TCP-gamma and cross-traffic disabled, so a transfer of ``x`` bytes takes exactly
``x / BW``. Activities:

* stack compute: every alive group executes ``seconds * FLOPS`` flops in parallel;
* all-reduce: a ring over the alive groups, ``2 (n-1)`` phases where every group sends one chunk to its
  successor simultaneously (reduce-scatter then all-gather); the chunk size is chosen so the collective
  takes the model's all-reduce time; above ``max_ring`` groups the ring is coarsened to one phase
  (SimGrid time grows with ``n^2`` activities);
* restart, checkpoint save, shrink, controller, failure-detection wait: ``sleep_for``.

The scheme logic, random draws and failure trail are the fast loop's (``simulate(..., clock=...)``), so
with the same seed the two must give the same timeline: ``tests/sim/test_timetotrain.py`` checks this on
small clusters. SimGrid allows one engine per process: use :func:`run_in_subprocess` (or the ``__main__``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict

from trainguard.errors import TrainguardError
from trainguard.sim.timetotrain import ClusterParams, simulate

FLOPS = 1e12       # host speed (flop/s)
BW = 1e9           # link bandwidth (bytes/s)


def simgrid_available() -> tuple[bool, str]:
    try:
        import simgrid
    except Exception as err:  # pragma: no cover - depends on the machine
        return False, f"cannot import simgrid ({err}); install Debian python3-simgrid 3.32"
    return True, getattr(simgrid, "simgrid_version", "?")


class SimGridClock:
    """Clock backend that realises every duration as SimGrid activities on the platform."""

    def __init__(self, hosts, max_ring: int = 64):
        import simgrid

        self.sg = simgrid
        self.hosts = hosts
        self.max_ring = max_ring
        self.activities = 0

    def now(self) -> float:
        return self.sg.Engine.clock

    def compute(self, seconds: float, n_alive: int) -> None:
        ex = []
        for h in self.hosts[:max(1, n_alive)]:
            a = self.sg.this_actor.exec_init(seconds * FLOPS)
            a.host = h
            a.start()
            ex.append(a)
        for a in ex:
            a.wait()
        self.activities += len(ex)

    def allreduce(self, seconds: float, n_alive: int) -> None:
        n = max(1, n_alive)
        if n == 1:
            self.sg.this_actor.sleep_for(seconds)
            return
        phases = 2 * (n - 1) if n <= self.max_ring else 1
        ring = self.hosts[:n]
        per = seconds / phases
        done = 0.0
        for ph in range(phases):
            # bytes rounded to an integer: keep the accumulated time exact up to 1 byte / BW
            target = (ph + 1) * per
            nbytes = int(round((target - done) * BW))
            comms = [self.sg.Comm.sendto_async(ring[i], ring[(i + 1) % n], nbytes) for i in range(n)]
            self.sg.Comm.wait_all(comms)
            done += nbytes / BW
            self.activities += n
        if seconds - done > 0:
            self.sg.this_actor.sleep_for(seconds - done)

    def sleep(self, seconds: float, what: str = "") -> None:
        self.sg.this_actor.sleep_for(seconds)


def simulate_simgrid(scheme: str, n: int, r: int = 1, seed: int = 0, params: ClusterParams | None = None,
                     max_steps: int | None = None, max_ring: int = 64) -> dict:
    """Run one training simulation on SimGrid (call once per process)."""
    ok, why = simgrid_available()
    if not ok:
        raise TrainguardError(why)
    import simgrid

    eng = simgrid.Engine(["trainguard-simgrid", "--cfg=network/model:CM02", "--cfg=network/TCP-gamma:0",
                          "--cfg=network/crosstraffic:0", "--log=root.thres:critical"])
    zone = simgrid.NetZone.create_full_zone("cluster")
    hosts = [zone.create_host(f"group{i}", FLOPS) for i in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            link = zone.create_link(f"l{i}_{j}", BW)
            link.set_latency(0)
            link.seal()
            zone.add_route(hosts[i].netpoint, hosts[j].netpoint, None, None, [simgrid.LinkInRoute(link)], True)
    zone.seal()
    clock = SimGridClock(hosts, max_ring)
    out: dict = {}

    def main():
        res = simulate(scheme, n, r, seed, params, clock=clock, max_steps=max_steps)
        out.update(res.as_dict())

    simgrid.Actor.create("trainer", hosts[0], main)
    eng.run()
    out["simgrid_clock_s"] = simgrid.Engine.clock
    out["simgrid_activities"] = clock.activities
    out["simgrid_version"] = simgrid.simgrid_version
    return out


def run_in_subprocess(scheme: str, n: int, r: int, seed: int, params: ClusterParams, max_steps: int | None = None,
                      timeout: float = 300) -> dict:
    """Run :func:`simulate_simgrid` in a fresh interpreter and return its result dict."""
    spec = json.dumps({"scheme": scheme, "n": n, "r": r, "seed": seed, "params": asdict(params), "max_steps": max_steps})
    proc = subprocess.run([sys.executable, "-m", "trainguard.sim.simgrid_model", spec], capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise TrainguardError(f"SimGrid run failed: {proc.stderr.strip().splitlines()[-1:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {k: (float(v) if v in ("inf", "-inf", "nan") else v) for k, v in out.items()}


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    res = simulate_simgrid(spec["scheme"], spec["n"], spec["r"], spec["seed"], ClusterParams(**spec["params"]),
                           spec.get("max_steps"))
    from trainguard.utils import emit_json

    emit_json(res)
