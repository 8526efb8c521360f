"""Where SpareTrain's main-thread time goes, by parts, measured side by side: the CPU time of the main thread a step
for No-DMR, the bench's ``floor`` (every op through a Python dispatch mode that checks nothing), SpareTrain, and
SpareTrain with its deferred path cut down to the primary execution alone (``no-defer``: the deferred ops are run
and nothing of them is kept, queued or checked; a measurement of what that path costs the main thread, the most a
leaner one could save, never a protection).

A small single-process trainer whose engine takes the pipeline path (``tests/sdc/dmr/_windowed.py``: one
emulated transfer a step, a window long enough for every planned check). Systems alternate within each round.

Usage, from a checkout (about a minute)::

    python tools/dmr_main_thread_parts.py [--rounds 5] [--steps 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

SYSTEMS = ("none", "floor", "sparetrain", "no-defer")


def measure(rounds: int, steps: int, window_s: float) -> dict:
    import torch

    from tests.sdc.dmr._windowed import small_batches, trainer, windowed
    from trainguard.sdc.dmr import ops as dops
    from trainguard.sdc.dmr.bench import _Floor
    from trainguard.sdc.dmr.engine import deferred
    from trainguard.sdc.dmr.engine.common import _primary

    torch.set_num_threads(1)
    t = trainer(small_batches())
    eng = windowed(t, "thread", transfer=lambda: (lambda: time.sleep(window_s)))
    floor = _Floor()
    floor.attach(t, eng)
    for _ in range(4):  # (the profiled first step, and the heap's growth)
        t.train_step()
    real = deferred.DeferredChecks._defer

    def primary_only(self, op_id, phase, strategy, window, func, args, kwargs, ins=None, swap=None, inf=None):
        return _primary(func, args, kwargs, inf if inf is not None else dops.info(func))

    cpu: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    try:
        for _ in range(rounds):
            for s in SYSTEMS:
                floor.on = s == "floor"
                eng.set_system("sparetrain" if s in ("sparetrain", "no-defer") else "none")
                deferred.DeferredChecks._defer = primary_only if s == "no-defer" else real
                t.train_step()  # (untimed: the switch)
                for _ in range(steps):
                    c0 = time.thread_time()
                    t.train_step()
                    cpu[s].append(time.thread_time() - c0)
    finally:
        deferred.DeferredChecks._defer = real
        floor.on = False
    med = {s: statistics.median(v) for s, v in cpu.items()}
    return {"main_cpu_s": med, "deferred_ops_a_step": eng.counts["d-inter"],  # (counted per attempt: the last step)
            "floor_s": med["floor"] - med["none"], "engine_above_floor_s": med["sparetrain"] - med["floor"],
            "deferred_path_s": med["sparetrain"] - med["no-defer"], "rounds": rounds, "steps": steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--window-s", type=float, default=0.6, help="each emulated transfer's wait")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.rounds < 1 or a.steps < 1 or a.window_s <= 0:
        print("error: --rounds and --steps must be >= 1 and --window-s > 0", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = measure(a.rounds, a.steps, a.window_s)
    if not a.json:
        for s, v in res["main_cpu_s"].items():
            print(f"{s:>10}: {v * 1000:7.1f} ms of main-thread CPU a step")
        print(f"the dispatch mode's floor {res['floor_s'] * 1000:.1f} ms; SpareTrain above it "
              f"{res['engine_above_floor_s'] * 1000:.1f} ms, of which the deferred path {res['deferred_path_s'] * 1000:.1f}"
              f" ms ({res['deferred_ops_a_step']} deferred ops a step)")
    else:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
