"""Multi-process launch for ``trainguard train``: when a run asks for ``dp * pp > 1`` processes and we
are not already under ``torchrun`` (no ``LOCAL_RANK``), re-run the same command line through
``python -m torch.distributed.run --standalone --nproc_per_node=dp*pp`` and return its exit code.
Relies on the standard library (subprocess) and torch's elastic launcher.
"""

from __future__ import annotations

import os
import subprocess
import sys


def under_launcher() -> bool:
    return "LOCAL_RANK" in os.environ


def needs_launch(cfg) -> bool:
    return cfg.distributed.world_size() > 1 and not under_launcher()


def launch_command(nproc: int, cli_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "trainguard", *cli_args]


def relaunch(cfg, cli_args: list[str]) -> int:
    """Run ``trainguard <cli_args>`` in dp*pp processes; the children inherit stdout/stderr."""
    nproc = cfg.distributed.world_size()
    env = dict(os.environ)
    # torchrun warns and forces 1 thread when unset; choose a fair share of the cores instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    try:
        return subprocess.call(launch_command(nproc, cli_args), env=env)
    except KeyboardInterrupt:
        return 130
