"""Instructions the DMR engine adds to the main thread, counted by valgrind's callgrind (deterministic, unlike
wall or CPU time on a shared host, where one run's noise is larger than most changes to the engine's hot path).

A small single-process trainer whose engine takes the pipeline path (``tests/sdc/dmr/_windowed.py``: one
emulated transfer a step, a window long enough for every planned check) runs No-DMR and SpareTrain, three
steps each; callgrind counts only those steps (instrumentation switched on and off around them), per thread.
The plan is fixed (``--plan``: written by the first run, read by the next ones), so that two trees are compared
on the same strategy for every op; the engine's counters are printed per system to confirm it.

Usage, from a checkout (valgrind installed; about 2 minutes)::

    python tools/dmr_engine_instructions.py --plan dmr-plan.json            # first run: writes the plan
    python tools/dmr_engine_instructions.py --plan dmr-plan.json --json     # then: same plan, one JSON line

Output: main-thread instructions per system and SpareTrain's extra over No-DMR (``extra_main``), and the
other threads' (the window's checker thread). Compare two trees by running each with the same ``--plan``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time


def _child(plan: str, systems: list[str], window_s: float) -> None:
    import torch

    from tests.sdc.dmr._windowed import small_batches, trainer, windowed
    from trainguard.sdc.dmr.plan import Plan

    torch.set_num_threads(1)
    t = trainer(small_batches())
    eng = windowed(t, "thread", transfer=lambda: (lambda: time.sleep(window_s)))
    for _ in range(4):
        t.train_step()
    if os.path.exists(plan):
        eng.plan = Plan.load(plan)
    else:
        eng.plan.save(plan)
    pid = str(os.getpid())
    for s in systems:
        eng.set_system(s)
        t.train_step()
        t.train_step()
        for cmd in (["-z"], ["-i", "on"]):
            subprocess.run(["callgrind_control", *cmd, pid], check=True, capture_output=True)
        for _ in range(3):
            t.train_step()
        for cmd in (["-i", "off"], ["-d", s]):
            subprocess.run(["callgrind_control", *cmd, pid], check=True, capture_output=True)
        print(json.dumps({"system": s, "counts": dict(eng.counts)}), file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plan", required=True, help="plan file: written if missing, else used")
    ap.add_argument("--window-s", type=float, default=4.0, help="each emulated transfer's wait (long: every check fits)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    systems = ["none", "sparetrain"]
    if a.child:
        _child(a.plan, systems, a.window_s)
        return 0
    plan_dir = os.path.dirname(os.path.abspath(a.plan))
    if not os.path.isdir(plan_dir):  # (a typo in --plan would otherwise create folders, then a new plan there)
        print(f"error: --plan {a.plan}: folder {plan_dir} does not exist", file=sys.stderr)
        return 2
    if os.path.isdir(a.plan):
        print(f"error: --plan {a.plan} is a folder, not a plan file", file=sys.stderr)
        return 2
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("error: valgrind (callgrind) is not installed", file=sys.stderr)
        return 2
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tempfile.mkdtemp(prefix="dmr-cg-")
    env = dict(os.environ, PYTHONPATH=root)
    proc = subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
                           f"--callgrind-out-file={out}/cg.%p", sys.executable, os.path.abspath(__file__), "--child",
                           "--plan", a.plan, "--window-s", str(a.window_s)],
                          cwd=root, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"error: the measured run failed (exit {proc.returncode}): {last}", file=sys.stderr)
        return 1
    res: dict[str, dict[str, int]] = {}
    for f in glob.glob(f"{out}/cg.*.*-*"):  # cg.PID.DUMP-THREAD
        with open(f) as fh:
            text = fh.read()
        trig = re.search(r"desc: Trigger: dump (\w+)", text)
        tot = re.search(r"^totals: (\d+)", text, re.M)
        if trig and tot:
            thread = "main" if f.endswith("-01") else "other"
            d = res.setdefault(trig.group(1), {"main": 0, "other": 0})
            d[thread] += int(tot.group(1))
    shutil.rmtree(out, ignore_errors=True)
    counts = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith('{"system"')]
    result = {"instructions": res, "extra_main": res["sparetrain"]["main"] - res["none"]["main"],
              "counts": {c["system"]: c["counts"] for c in counts}, "steps": 3}
    if not a.json:
        for s, d in res.items():
            print(f"{s:>10}: main {d['main'] / 1e6:9.1f} M instructions, other threads {d['other'] / 1e6:9.1f} M")
        print(f"SpareTrain's extra on the main thread: {result['extra_main'] / 1e6:.1f} M (3 steps)")
    if a.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
