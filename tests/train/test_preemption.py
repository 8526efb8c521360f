"""Preemption and kills: SIGTERM checkpoints at the next step boundary and exits 143; a training process
killed (SIGKILL or SIGTERM) at random points, checkpoint writes included, always leaves an intact newest
checkpoint from which a resumed run ends bitwise equal to an uninterrupted one."""

import json
import os
import random
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from _fork_launch import JsonLineServer
from conftest import tiny_cfg

from trainguard.config import load_config
from trainguard.train import Trainer
from trainguard.train.checkpoint import CheckpointManager, verify


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _SigtermAt:
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, result):
        if result.step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_sigterm_checkpoints_at_the_next_step_boundary_and_resume_is_bitwise(tmp_path, batches):
    ck, out = tmp_path / "ck", tmp_path / "out"
    args = ("--train.steps", "6", "--checkpoint.dir", str(ck), "--checkpoint.every", "4", "--output.dir", str(out),
            "--output.metrics", "true", "--train.log_every", "1")
    clean = Trainer(tiny_cfg("--train.steps", "6"), batches=batches)
    clean.run()
    t = Trainer(tiny_cfg(*args), batches=batches)
    t.callbacks.append(_SigtermAt(1))  # during the 2nd step
    before = signal.getsignal(signal.SIGTERM)
    summary = t.run()
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is the run's only
    assert summary.stop_reason == "preempted" and summary.end_step == 2
    assert summary.checkpoint.endswith("step_00000002") and verify(summary.checkpoint)["step"] == 2
    saved = json.loads((out / "summary.json").read_text())
    assert saved["stop_reason"] == "preempted" and saved["end_step"] == 2
    resumed = Trainer(tiny_cfg(*args, "--checkpoint.resume", "true"), batches=batches)
    assert resumed.step_idx == 2
    resumed.run()
    assert _equal(resumed.state_dict_for_compare(), clean.state_dict_for_compare())
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in records if r.get("event") == "preempted"] == [2]


# ---- the kill campaign ----------------------------------------------------------------------------------
# A "zygote" process imports torch and trainguard once and forks one child per run (a fresh interpreter
# per run would spend seconds importing torch on a loaded 2-core machine). Each child runs the CLI's
# `trainguard train`; it is killed by the test after a random delay, or kills itself at a random point:
# after a step, inside the DCP write (a timer fires somewhere in it), before the manifest, after the
# commit rename, before pruning, or (DMR on, a fault injected) while the step that found it is rolled back.
ZYGOTE = textwrap.dedent(r"""
    import json, os, random, signal, sys, threading
    import torch
    torch.set_num_threads(1)
    from trainguard.cli.main import main
    import trainguard.cli.commands.train, trainguard.config, trainguard.sdc.runtime  # every import done once, here
    import trainguard.train.checkpoint as ck
    from trainguard.train.trainer import Trainer

    def arm(kill):
        sig = kill["sig"]
        count = {"n": 0}

        def hit(where, before=None):
            def wrapper(real):
                def call(*a, **k):
                    if where == kill["at"]:
                        count["n"] += 1
                        if count["n"] == kill["nth"]:
                            if where == "dcp":
                                threading.Timer(kill["delay"], os.kill, (os.getpid(), sig)).start()
                            elif before:
                                os.kill(os.getpid(), sig)
                            else:
                                out = real(*a, **k)
                                os.kill(os.getpid(), sig)
                                return out
                    return real(*a, **k)
                return call
            return wrapper

        if kill["at"] == "rollback":  # while the step that found the fault is being put back (not the profiled one)
            real_rollback = Trainer._rollback

            def rollback(self, *a, **k):
                if self.step_idx == kill["step"]:
                    count["n"] += 1
                    if count["n"] == kill["nth"]:
                        os.kill(os.getpid(), sig)
                return real_rollback(self, *a, **k)

            Trainer._rollback = rollback
        Trainer.train_step = hit("step")(Trainer.train_step)
        ck.dcp.save = hit("dcp")(ck.dcp.save)
        ck.write_manifest = hit("manifest", before=True)(ck.write_manifest)
        ck.CheckpointManager._commit = hit("commit")(ck.CheckpointManager._commit)
        ck.CheckpointManager._prune = hit("prune", before=True)(ck.CheckpointManager._prune)

    def inject(fault):  # one exponent bit flip in a backward op at step fault["step"], after the run's own set-up
        import trainguard.sdc.runtime as runtime
        from trainguard.faults import Fault, FaultModel, Injector, OpSite
        real = runtime.attach_from_config

        def attach(trainer):
            handles = real(trainer)
            site = OpSite("*", "backward", fault["occurrence"], compute_only=True)
            Injector(Fault(site, FaultModel("bitflip", field="exponent"), step=fault["step"]), seed=1).attach(trainer)
            return handles

        runtime.attach_from_config = attach

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            rc = 1
            try:
                fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                if job.get("kill"):
                    arm(job["kill"])
                if job.get("fault"):
                    inject(job["fault"])
                rc = main(job["argv"])
            except BaseException as err:
                sys.stderr.write(f"child failed: {err!r}\n")
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"pid": pid, "rc": os.waitstatus_to_exitcode(status)}), flush=True)
""")

STEPS = 8
ARGS = ["--model.dim", "32", "--model.n_heads", "2", "--model.ffn_hidden", "64", "--model.n_layers", "1",
        "--data.seq_len", "16", "--data.batch_size", "4",
        "--train.steps", str(STEPS), "--train.eval_every", "5", "--train.eval_batches", "1", "--train.log_every", "1",
        "--checkpoint.every", "2", "--checkpoint.keep", "2", "--output.progress", "false"]


class Zygote(JsonLineServer):
    def __init__(self, cwd: Path):
        super().__init__([sys.executable, "-c", ZYGOTE], {**os.environ, "OMP_NUM_THREADS": "1"}, cwd, start_timeout=240)

    def run(self, argv: list[str], log: Path, kill: dict | None = None, after: float | None = None,
            sig: int = signal.SIGKILL, fault: dict | None = None) -> int:
        self.send({"argv": argv, "log": str(log), "kill": kill, "fault": fault})
        pid = self.read(60)["pid"]
        if after is not None:
            time.sleep(after)
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        done = self.read(120)
        assert done["pid"] == pid
        return done["rc"]


def _train_args(ck: Path, out: Path, *extra: str) -> list[str]:
    corpus = ck.parent / "corpus.txt"  # one small text file (listing the whole stdlib would dominate each run)
    return ["train", *ARGS, "--data.source", str(corpus), "--checkpoint.dir", str(ck), "--output.dir", str(out), *extra]


def _write_corpus(folder: Path) -> None:
    text = "".join(Path(m.__file__).read_text() for m in (json.decoder, json.encoder, textwrap, random))
    (folder / "corpus.txt").write_text(text[:40_000])


def _final_state(ck: Path, out: Path) -> dict:
    cfg = load_config(None, _train_args(ck, out, "--checkpoint.resume", "true")[1:])
    t = Trainer(cfg, progress=False)
    assert t.step_idx == STEPS
    return t.state_dict_for_compare()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kills_at_random_points_never_lose_the_newest_checkpoint_and_resume_bitwise(tmp_path):
    rng = random.Random(20260613)
    points = ["step", "dcp", "manifest", "commit", "prune", "timer"]
    kinds = [(p, s) for p in points for s in (signal.SIGKILL, signal.SIGTERM)]
    # 18 runs, every (point, signal) at least once (30 before, each twice: cut to make room in the suite's time for
    # the DMR kill campaign below, which kills at random moments too)
    jobs = kinds + rng.sample(kinds, 6)
    rng.shuffle(jobs)
    _write_corpus(tmp_path)
    zygote = Zygote(tmp_path)
    try:
        ref_ck, ref_out = tmp_path / "ref-ck", tmp_path / "ref-out"
        assert zygote.run(_train_args(ref_ck, ref_out), tmp_path / "ref.log") == 0, (tmp_path / "ref.log").read_text()
        reference = _final_state(ref_ck, ref_out)
        seen_rc: dict[int, int] = {}
        for i, (point, sig) in enumerate(jobs):
            ck, out, log = tmp_path / f"ck{i}", tmp_path / f"out{i}", tmp_path / f"run{i}.log"
            kill = None
            after = None
            if point == "timer":
                after = rng.uniform(0.0, 1.0)  # 0: killed before it even opened its log
            else:
                saves = STEPS // 2  # checkpoint.every 2
                nth = rng.randint(1, {"step": STEPS, "dcp": saves, "manifest": saves, "commit": saves, "prune": saves}[point])
                kill = {"at": point, "sig": int(sig), "nth": nth, "delay": rng.uniform(0.0, 0.02)}
            rc = zygote.run(_train_args(ck, out), log, kill, after, sig)
            seen_rc[rc] = seen_rc.get(rc, 0) + 1
            text = log.read_text() if log.exists() else "(killed before its log was opened)"
            what = f"run {i} ({point}, {signal.Signals(sig).name}, kill={kill}, after={after}): rc {rc}\n{text[-1500:]}"
            assert rc in (0, -9, -15, 143), what
            mgr = CheckpointManager(ck)
            committed = mgr.checkpoints()
            for _, p in committed:  # no kill leaves a visible checkpoint that is not whole
                verify(p)
            newest = committed[-1][0] if committed else None
            if rc == 143:  # SIGTERM was handled: a checkpoint of the step it stopped at, and a summary
                summary = json.loads((out / "summary.json").read_text())
                assert summary["stop_reason"] == "preempted" and summary["end_step"] == newest, what
                assert "resume with: trainguard train" in text, what
            resumed_log = tmp_path / f"resume{i}.log"
            assert zygote.run(_train_args(ck, out, "--checkpoint.resume", "true"), resumed_log) == 0, \
                what + resumed_log.read_text()[-1500:]
            text = resumed_log.read_text()
            if newest is None:
                assert "starting from step 0" in text, what + text
            elif newest < STEPS:
                assert f"step {newest} of {STEPS}" in text, what + text
            assert _equal(_final_state(ck, out), reference), what
            records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1)), what
        assert seen_rc.get(143, 0) >= 3 and seen_rc.get(-9, 0) >= 3, seen_rc  # both kinds of kill happened
    finally:
        zygote.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kills_at_random_moments_of_a_dmr_run_with_a_fault_lose_nothing_and_resume_bitwise(tmp_path):
    """DMR on and one bit flip in a backward op at step 3 of every run, resumed ones included (a resume from before
    step 3 meets the fault again). Each run is killed: at a random moment, after a step, or while step 3 is rolled
    back after its detection (that kill firing proves the fault was detected). Every committed checkpoint is whole,
    and every resumed run ends bitwise equal to the fault-free DMR run."""
    rng = random.Random(20261207)
    fault = {"step": 3, "occurrence": 5}
    dmr = ("--sdc.dmr.enabled", "true")
    jobs = [("rollback", signal.SIGKILL), ("rollback", signal.SIGTERM), ("step", signal.SIGKILL),
            ("timer", signal.SIGKILL), ("timer", signal.SIGKILL), ("timer", signal.SIGTERM)]
    _write_corpus(tmp_path)
    zygote = Zygote(tmp_path)
    try:
        ref_ck, ref_out = tmp_path / "ref-ck", tmp_path / "ref-out"
        assert zygote.run(_train_args(ref_ck, ref_out, *dmr), tmp_path / "ref.log") == 0, (tmp_path / "ref.log").read_text()
        reference = _final_state(ref_ck, ref_out)
        for i, (point, sig) in enumerate(jobs):
            ck, out, log = tmp_path / f"ck{i}", tmp_path / f"out{i}", tmp_path / f"run{i}.log"
            kill, after = None, None
            if point == "timer":
                after = rng.uniform(0.5, 4.0)  # (somewhere in the run: set-up, profiling, a check, a save)
            elif point == "step":
                kill = {"at": "step", "sig": int(sig), "nth": rng.randint(2, 5), "delay": 0.0}
            else:
                kill = {"at": "rollback", "sig": int(sig), "nth": 1, "delay": 0.0, "step": fault["step"]}
            rc = zygote.run(_train_args(ck, out, *dmr), log, kill, after, sig, fault=fault)
            text = log.read_text() if log.exists() else "(killed before its log was opened)"
            what = f"run {i} ({point}, {signal.Signals(sig).name}, kill={kill}, after={after}): rc {rc}\n{text[-1500:]}"
            # (-15: SIGTERM before the run installed its handler, in set-up; 0: the timer came after the run ended)
            assert rc in (0, -9, -15, 143) and (point != "rollback" or rc != 0), what
            committed = CheckpointManager(ck).checkpoints()
            for _, p in committed:
                verify(p)
            if rc == 143:  # SIGTERM mid-retry: the step is finished first (re-executed, verified), then saved
                assert committed and committed[-1][0] == json.loads((out / "summary.json").read_text())["end_step"], what
            resumed_log = tmp_path / f"resume{i}.log"
            assert zygote.run(_train_args(ck, out, *dmr, "--checkpoint.resume", "true"), resumed_log,
                              fault=fault) == 0, what + resumed_log.read_text()[-1500:]
            assert _equal(_final_state(ck, out), reference), what
            records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1)), what
    finally:
        zygote.close()
