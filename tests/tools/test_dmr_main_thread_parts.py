"""``tools/dmr_main_thread_parts.py``: it measures every system and puts the engine's deferred path back afterwards
(its ``no-defer`` system swaps it for the primary execution alone, which checks nothing)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from trainguard.sdc.dmr.engine import deferred

TOOL = Path(__file__).resolve().parents[2] / "tools" / "dmr_main_thread_parts.py"


def _tool():
    spec = importlib.util.spec_from_file_location("dmr_main_thread_parts", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_system_is_measured_and_the_deferred_path_is_put_back():
    real = deferred.DeferredChecks._defer
    res = _tool().measure(rounds=1, steps=1, window_s=0.2)
    assert deferred.DeferredChecks._defer is real
    assert set(res["main_cpu_s"]) == {"none", "floor", "sparetrain", "no-defer"}
    assert all(v > 0 for v in res["main_cpu_s"].values()) and res["deferred_ops_a_step"] > 0


def test_bad_arguments_are_refused_with_one_line_and_exit_2():
    p = subprocess.run([sys.executable, str(TOOL), "--rounds", "0"], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "--rounds" in p.stderr
