"""``trainguard campaign dmr``: one bit flip per trial into a random compute op of a training run with DMR
on; every trial's final parameters are compared with the fault-free run's.

A trial draws (from the campaign seed) a phase (``forward``, ``recompute``, ``backward``, ``optimizer``, or
the one asked for), a step, a rank (pipeline runs) and an op among that rank's compute ops of that phase
in that step (counted in the reference run), and flips one random bit of one element of its output
through the fault injector (in-place ops: of a tensor they write). Outcome classes:

* ``detected``: DMR flagged it (the iteration was re-executed, or the optimizer chunk repaired);
* ``masked``: not flagged and the final state equals the reference bitwise;
* ``silent``: not flagged and the final state differs (silent data corruption);
* ``stopped``: the run stopped as a suspected hardware fault (in a training run: exit 3), e.g. an update-stage op
  none of whose executions agree: nothing wrong was kept, but the trial did not finish. Counted single-process only;
  on several ranks the others wait in a collective for the stopped one, and the campaign stops with it;

``--phase verifier`` strikes the engine's own work instead (``OpSite(verifier=True)``): its checker executions,
copies and fingerprints, on the main thread or a window's worker, counted in the reference run like the step's
ops. The fault is then a real hardware fault in the checker: flagged or not, the final state must still equal
the reference (a detection re-executes the iteration; the state the engine keeps for that must not be the
corrupted copy). ``any`` means the four phases of the step, as before.

``tie_breakers_again`` counts the update-stage ops (over all trials and ranks) whose checker and first tie-breaker
both disagreed with the primary and each other, so that another tie-breaker decided (two faults in one op).
``rollback_bitwise_equal`` counts trials whose final parameters and optimizer state equal the fault-free
run bitwise; ``false_positives`` counts detections in fault-free runs (the reference). Pipelines run
inside each torchrun rank (``python -m trainguard.sdc.dmr.campaign OUT SPEC.json``).
Relies on torch, the Trainer, the fault injector and the DMR engine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainguard.errors import SuspectedHardwareFault
from trainguard.faults import Fault, FaultModel, Injector, OpSite
from trainguard.sdc.dmr.config import DMRConfig
from trainguard.sdc.dmr.engine import attach
from trainguard.train import Trainer, TrainerConfig
from trainguard.train.launch import exit_rank
from trainguard.utils import TaskBar

PHASES = ("forward", "recompute", "backward", "optimizer")
VERIFIER = "verifier"  # the engine's own ops (not part of "any")


def _all(flag: bool, op=None) -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=op or dist.ReduceOp.MIN)
    return bool(t)


def _any(flag: bool) -> bool:
    return _all(flag, dist.ReduceOp.MAX) if dist.is_available() and dist.is_initialized() else flag


def _gather(obj: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _run(cfg, steps: int, faults: dict[int, list[Fault]], seed: int, count: bool = False, plan=None,
         executor: str = "auto", verifier: bool = False, may_stop: bool = False):
    """One run with DMR on, each rank's ``faults[rank]`` injected; ``count``: count compute ops per (step, phase),
    the engine's own ops too where ``verifier``. Returns the trainer, engine, injector, whether DMR detected a fault,
    and ``stopped``: with ``may_stop``, the message of a run that stopped as a suspected hardware fault, on every
    rank (else None)."""
    trainer = Trainer(cfg, progress=False)
    engine = attach(trainer, DMRConfig(enabled=True, executor=executor), plan=plan)
    injector = None
    mine = faults.get(trainer.rank, [])
    if count or mine:
        injector = Injector(mine, seed=seed).attach(trainer)
        injector.count_ops = count
        injector.count_verifier = count and verifier
    stopped = None
    try:
        for _ in range(steps):
            trainer.train_step()  # (a stop on one rank stops every rank in the same verdict: see Trainer._guard)
        trainer.settle()  # checks still held (the last update's) complete before the outcome is read
    except SuspectedHardwareFault as err:
        if not may_stop:
            raise
        stopped = str(err)
    if may_stop and trainer.world > 1:  # (a stop while settling is this rank's alone: every rank learns of it here)
        first = next((m for m in _gather(stopped) if m), None)  # (gathered on every rank, stopped or not)
        stopped = stopped or first
    if stopped is not None:
        return trainer, engine, injector, False, stopped
    return trainer, engine, injector, engine.totals["detected"] > 0, None


def run_rank(spec: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    cfg = TrainerConfig.load(None, spec["overrides"])
    steps, trials, seed = spec["steps"], spec["trials"], spec["seed"]
    executor = spec.get("executor", "auto")
    verifier = spec["phase"] == VERIFIER
    ref_trainer, ref_engine, counter, fp, _ = _run(cfg, steps, {}, seed, count=True, executor=executor,
                                                verifier=verifier)
    first, plan = ref_trainer, ref_engine.plan
    if plan is not None:
        # The plan made from a profile depends on measured times, so every run of the campaign follows the
        # reference's plan: then the same ops run in every trial and a drawn site is always reached.
        ref_trainer, ref_engine, counter, fp2, _ = _run(cfg, steps, {}, seed, count=True, plan=plan, verifier=verifier,
                                                     executor=executor)
        fp = fp or fp2
    reference = ref_trainer.state_dict_for_compare()
    world, rank = ref_trainer.world, ref_trainer.rank
    counts = _gather(counter.op_counts)  # every rank's compute ops per (step, phase)
    false_positives = int(_any(fp))
    phases = [VERIFIER] if verifier else [p for p in PHASES if spec["phase"] in ("any", p)]
    rng = np.random.default_rng(seed)
    n_faults = spec.get("faults", 1)
    summary = {"trials": 0, "detected": 0, "masked": 0, "silent": 0, "stopped": 0, "unreached": 0,
               "false_positives": false_positives,
               "rollback_bitwise_equal": 0, "by_phase": {p: {"trials": 0, "detected": 0} for p in phases},
               "faults_per_trial": n_faults, "faults_fired": 0, "faults_by_thread": {"main": 0, "worker": 0},
               "tie_breakers_again": 0, "results": []}
    options = [(p, s, r) for p in phases for s in range(steps) for r in range(world) if counts[r].get((s, p), 0)]
    if not options:
        raise RuntimeError(f"no compute op in phase(s) {', '.join(phases)} (activation checkpointing off?)")
    sites = sum(counts[r][(s, p)] for p, s, r in options)  # (more faults than sites: some share one)
    bar = TaskBar(spec.get("progress", False) and rank == 0, f"campaign dmr {spec['model']}", trials)
    try:
        for trial in range(trials):
            draws: list[tuple[str, int, int, int]] = []  # (phase, step, rank, occurrence), no two the same
            while len(draws) < n_faults:
                phase, step, frank = options[int(rng.integers(len(options)))]
                draw = (phase, step, frank, int(rng.integers(counts[frank][(step, phase)])))
                if draw not in draws or len(draws) >= sites:
                    draws.append(draw)
            faults: dict[int, list[Fault]] = {}
            for phase, step, frank, occurrence in draws:
                site = OpSite("*", "any", occurrence, compute_only=True, verifier=True) if phase == VERIFIER else \
                    OpSite("*", phase, occurrence, compute_only=True)
                faults.setdefault(frank, []).append(Fault(site, FaultModel("bitflip", field="any"), step=step))
            trainer, engine, injector, detected, stopped = _run(cfg, steps, faults, seed * 1_000_003 + trial,
                                                                plan=plan, executor=executor, may_stop=True)
            if stopped is None:
                state = trainer.state_dict_for_compare()
                equal = _all(state.keys() == reference.keys() and all(torch.equal(state[k], reference[k])
                                                                      for k in state))
                detected = _any(detected)
            else:  # (the state is not verified: the trainer refuses to read it)
                equal = False
            mine = [r.to_dict() for r in injector.records] if injector is not None and faults.get(rank) else []
            records = [r for rs in _gather(mine) for r in rs]
            outcome = "stopped" if stopped else "detected" if detected else ("masked" if equal else "silent")
            summary["trials"] += 1
            summary[outcome] += 1
            summary["unreached"] += int(not records)
            summary["faults_fired"] += len(records)
            summary["rollback_bitwise_equal"] += int(equal)
            # (update-stage ops whose checker and tie-breaker both disagreed with the primary: another one decided)
            summary["tie_breakers_again"] += sum(_gather(engine.totals["tie_breakers_again"]))
            for r in records:  # (a window's worker runs checks: the verifier's ops there are reached too)
                summary["faults_by_thread"][r["thread"]] += 1
            for phase, *_ in draws:
                summary["by_phase"][phase]["trials"] += 1
                summary["by_phase"][phase]["detected"] += int(detected)
            phase, step, frank, occurrence = draws[0]
            result = {"trial": trial, "phase": phase, "step": step, "rank": frank, "occurrence": occurrence,
                      "outcome": outcome, "bitwise_equal": equal, "fault": records[0] if records else None}
            if stopped:
                result["stopped"] = stopped
            if n_faults > 1:
                result.update(draws=[dict(zip(("phase", "step", "rank", "occurrence"), d)) for d in draws],
                              faults=records)
            summary["results"].append(result)
            bar.advance(f"detected {summary['detected']}  silent {summary['silent']}" +
                        (f"  stopped {summary['stopped']}" if summary["stopped"] else ""))
    finally:
        bar.stop()
    summary["rank"] = rank
    summary["executor"] = executor
    summary["device"] = str(first.device)
    first.close()  # (the first trainer created the process group of a pipeline run: it closes it)
    return summary


def main(argv: list[str]) -> int:
    out_dir, spec_path = argv
    res = run_rank(json.loads(Path(spec_path).read_text()))
    if res["rank"] == 0:
        Path(out_dir, "campaign.json").write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    exit_rank(main(sys.argv[1:]))  # (a rank: leave without torch's gloo teardown, see exit_rank)
