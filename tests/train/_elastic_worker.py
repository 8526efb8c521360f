"""One elastic replica (a process) for tests/train/test_elastic.py.

``python _elastic_worker.py OUT REPLICA REPLICAS LIGHTHOUSE STEPS [--kill STEP:POINT] [--restarted]
[--wait-rejoin-at STEP] [overrides...]``: trains a tiny model with ``distributed.strategy = elastic``; logs
every committed step to ``OUT/log{REPLICA}.jsonl`` and the final state to ``OUT/final{REPLICA}.pt``.
"""

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

from trainguard.config import load_config
from trainguard.faults.failstop import FailStop, KillPoint
from trainguard.train.launch import exit_rank
from trainguard.train.parallel.torchft_group import quiet_torchft_logs
from trainguard.train.trainer import Trainer

TINY = ["--model.dim", "32", "--model.n_layers", "1", "--model.n_heads", "2", "--model.ffn_hidden", "64",
        "--data.max_bytes", "300000", "--data.seq_len", "16", "--train.eval_every", "0",
        "--output.metrics", "false", "--output.progress", "false", "--output.dir", ""]


def wait_for(path: Path, what: str, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while not path.exists():
        if time.monotonic() - t0 > timeout:
            sys.exit(f"replica timed out waiting for {what}")
        time.sleep(0.02)


class Recorder:
    def __init__(self, out: Path, replica: int, wait_rejoin_at: int | None):
        self.path = out / f"log{replica}.jsonl"
        self.out, self.wait_rejoin_at = out, wait_rejoin_at

    def on_step_start(self, trainer, step):
        if step == self.wait_rejoin_at:  # hold the survivors until the restarted replica is up
            wait_for(self.out / "rejoining", "the restarted replica")

    def on_step_end(self, trainer, result):
        rec = dict(trainer.strategy.record, loss=result.loss, pid=os.getpid())
        rec["counted"] = {str(k): v for k, v in rec["counted"].items()}
        with open(self.path, "a") as fh:
            fh.write(json.dumps(rec) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("replica", type=int)
    ap.add_argument("replicas", type=int)
    ap.add_argument("lighthouse")
    ap.add_argument("steps", type=int)
    ap.add_argument("--kill", default="")
    ap.add_argument("--restarted", action="store_true")
    ap.add_argument("--wait-rejoin-at", type=int, default=None)
    args, overrides = ap.parse_known_args()
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    quiet_torchft_logs()
    torch.set_num_threads(1)
    out = Path(args.out)
    cfg = load_config(None, TINY + [
        "--distributed.strategy", "elastic", "--distributed.dp", str(args.replicas),
        "--distributed.elastic.replica_id", str(args.replica), "--distributed.elastic.lighthouse", args.lighthouse,
        "--distributed.elastic.timeout_s", "10", "--distributed.elastic.quorum_timeout_s", "30",
        "--train.steps", str(args.steps), *overrides])
    trainer = Trainer(cfg, progress=False)
    trainer.callbacks.append(Recorder(out, args.replica, args.wait_rejoin_at))
    if args.kill:
        step, point = args.kill.split(":")
        trainer.callbacks.append(FailStop([KillPoint(int(step), point)],
                                          on_kill=lambda p: (out / f"killed{args.replica}").write_text(str(p.step))))
    if args.restarted:
        (out / "rejoining").write_text(str(os.getpid()))
    else:  # every first incarnation is heartbeating before anyone starts step 0
        (out / f"ready{args.replica}").write_text("")
        for r in range(args.replicas):
            wait_for(out / f"ready{r}", f"replica {r} to start")
    try:
        summary = trainer.run()
        opt_steps = sorted({int(s["step"]) for s in trainer.optimizer.state_dict()["state"].values()})
        torch.save({"params": trainer.state_dict_for_compare(optimizer=True), "adam_steps": opt_steps,
                    "scheduler_steps": trainer.scheduler.last_epoch, "step": trainer.step_idx,
                    "torchft_step": trainer.strategy.group.step, "checkpoint": summary.checkpoint}, out / f"final{args.replica}.pt")
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
    # as `python -m trainguard` ends an elastic replica: without Python's finalization, in which gloo's teardown
    # can abort a process that has finished its work (exit -6, "terminate called without an active exception")
    exit_rank(0)
