"""The offline DMR profiler: run the first iteration of a model's training with the DMR engine recording
(every op with its time, bytes, module, block and activation-checkpoint segment; the idle windows; memory
over the iteration) and return the :class:`~trainguard.sdc.dmr.profile.Profile` of each rank.

``profile_run(model="llama-60m", pp=2)`` trains the model's first step in ``pp`` pipeline stages (under
torchrun, one process per stage; ``dp`` replicas of them: ``pp * dp`` processes) with activation checkpointing,
and returns rank 0's profile (stage 0 of replica 0); every rank's profile is in ``profile.meta["profiles"]``
(paths of the JSON files when ``out_dir`` is given). The engine does the recording itself (``DMREngine``
profiles the first attempt of a run and plans the rest); this module only sets up the run. Relies on the
Trainer, the DMR engine and torch's elastic launcher.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from trainguard.sdc.dmr.config import DMRConfig
from trainguard.sdc.dmr.engine import attach
from trainguard.sdc.dmr.profile import Profile
from trainguard.train import Trainer, TrainerConfig
from trainguard.train.launch import exit_rank, failed_workers, run_workers


def _overrides(model: str, pp: int, batch: int, seq_len: int, microbatches: int, dp: int = 1) -> list[str]:
    out = ["--model.preset", model, "--data.seq_len", str(seq_len), "--data.batch_size", str(batch),
           "--data.max_bytes", str(max(2_000_000, 64 * batch * (seq_len + 2))), "--train.steps", "1000",
           "--train.eval_every", "0", "--train.activation_checkpoint", "full", "--output.dir", "",
           "--output.progress", "false", "--output.metrics", "false"]
    if pp > 1:
        out += ["--distributed.pp", str(pp), "--distributed.microbatches", str(microbatches)]
    if dp > 1:
        out += ["--distributed.dp", str(dp)]
    return out


def profile_rank(overrides: list[str], steps: int = 1) -> Profile:
    """Inside one process: train ``steps`` steps with DMR (the first attempt profiled); the rank's profile."""
    torch.set_num_threads(1)
    trainer = Trainer(TrainerConfig.load(None, overrides), progress=False)
    engine = attach(trainer, DMRConfig(enabled=True))
    engine.deferrable = True  # (a single process has no windows; profile it all the same)
    for _ in range(steps):
        trainer.train_step()
    trainer.close()
    return engine.profile


def profile_run(model: str = "llama-60m", pp: int = 2, steps: int = 1, batch: int = 8, seq_len: int = 128,
                microbatches: int = 4, out_dir: str | Path | None = None, dp: int = 1) -> Profile:
    overrides = _overrides(model, pp, batch, seq_len, microbatches, dp)
    world = pp * dp
    if world == 1:
        prof = profile_rank(overrides, steps)
        prof.meta["profiles"] = [prof.to_json()] if out_dir is None else []
        return prof
    with tempfile.TemporaryDirectory(prefix="trainguard-dmr-profile-") as tmp:
        target = Path(out_dir) if out_dir is not None else Path(tmp)
        target.mkdir(parents=True, exist_ok=True)
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"overrides": overrides, "steps": steps}))
        proc = run_workers(world, "trainguard.sdc.dmr.profiler", str(target), str(spec))
        if proc.returncode != 0:
            raise failed_workers("DMR profiling: a training process failed", proc.stderr)
        paths = [target / f"profile-rank{r}.json" for r in range(world)]
        prof = Profile.load(paths[0])
        prof.meta["profiles"] = [str(p) for p in paths] if out_dir is not None else \
            [Profile.load(p).to_json() for p in paths]
        return prof


def main(argv: list[str]) -> int:
    out_dir, spec_path = argv
    spec: dict[str, Any] = json.loads(Path(spec_path).read_text())
    prof = profile_rank(spec["overrides"], spec["steps"])
    prof.save(Path(out_dir) / f"profile-rank{prof.rank}.json")
    return 0


if __name__ == "__main__":
    exit_rank(main(sys.argv[1:]))  # (a rank: leave without torch's gloo teardown, see exit_rank)
