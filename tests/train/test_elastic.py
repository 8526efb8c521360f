"""Elastic data parallel on torchft (``trainguard.train.parallel.elastic``).

The fail-stop test follows torchft's own integration tests (replica groups, an in-process lighthouse, a
step-keyed fault, equal final state), with processes instead of threads so that the fault is a real
``SIGKILL``: a replica dies in the middle of a step, the survivors finish that step without a restart, and
the replica, restarted, heals from a peer's ``Trainer.state_dict()`` to bitwise the same parameters.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainguard.config import load_config
from trainguard.errors import ConfigError, TrainguardError
from trainguard.train.checkpoint import CheckpointManager
from trainguard.train.guards import StepGuard, Verdict
from trainguard.train.parallel import MicroBatch, StepPlan, Strategy, build_strategy
from trainguard.train.parallel.elastic import DataParallelPolicy, ElasticStrategy, StepView
from trainguard.train.parallel.torchft_compat import TORCHFT_VERSION, force_reconfigure, torchft_version
from trainguard.train.parallel.torchft_group import quiet_torchft_logs, start_lighthouse
from trainguard.train.trainer import Trainer

WORKER = Path(__file__).with_name("_elastic_worker.py")
ROOT = Path(__file__).resolve().parents[2]
quiet_torchft_logs()  # before torchft's Rust logger starts: no log line per quorum from the test's lighthouse


def test_default_policy_gives_each_live_replica_its_own_slices_weighted_to_the_mean():
    pol = DataParallelPolicy()
    full = pol.plan(StepView(0, frozenset({0, 1, 2}), replicas=3, grad_accum=2))
    assert full.work == {r: [MicroBatch(2 * r, 6, 1 / 6), MicroBatch(2 * r + 1, 6, 1 / 6)] for r in range(3)}
    assert sum(full.counted().values()) == pytest.approx(1.0)
    # replica 1 gone before the step: the others compute their own slices, each weighted 1/4
    short = pol.plan(StepView(1, frozenset({0, 2}), replicas=3, grad_accum=2, failed=frozenset({1})))
    assert short.counted() == {0: 0.25, 1: 0.25, 4: 0.25, 5: 0.25}
    # replica 1 dies during the step: its slices are dropped, the survivors' re-weighted; nothing recomputed
    rec = pol.on_failure(StepView(0, frozenset({0, 2}), 3, 2), frozenset({1}), full)
    assert rec.reweight == {0: 0.25, 1: 0.25, 4: 0.25, 5: 0.25} and not rec.extra and not rec.count


def test_elastic_config_is_checked_and_selects_the_strategy():
    cfg = load_config(None, ["--distributed.strategy", "elastic", "--distributed.dp", "4"])
    assert cfg.distributed.elastic_replicas() == 4
    assert isinstance(build_strategy(cfg), ElasticStrategy)
    with pytest.raises(ConfigError, match="replica_id"):
        load_config(None, ["--distributed.strategy", "elastic", "--distributed.dp", "2",
                           "--distributed.elastic.replica_id", "2"])
    with pytest.raises(ConfigError, match="min_replicas"):
        load_config(None, ["--distributed.strategy", "elastic", "--distributed.elastic.replicas", "2",
                           "--distributed.elastic.min_replicas", "3"])
    with pytest.raises(ConfigError, match="timeout_s"):
        load_config(None, ["--distributed.elastic.timeout_s", "0"])


@pytest.mark.filterwarnings("ignore:The 'warn' method is deprecated")
def test_torchft_is_the_pinned_version_and_its_private_quorum_id_still_forces_a_new_process_group():
    """The one private torchft attribute trainguard touches (``torchft_compat.force_reconfigure``): if torchft
    renames or repurposes ``Manager._quorum_id`` this fails."""
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    assert torchft_version() == TORCHFT_VERSION
    assert f'"torchft=={TORCHFT_VERSION}"' in (ROOT / "pyproject.toml").read_text()

    class CountingGloo(ProcessGroupGloo):
        configured = 0

        def configure(self, *args, **kwargs):
            type(self).configured += 1
            return super().configure(*args, **kwargs)

    lh = start_lighthouse()
    store = torch.distributed.TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=CountingGloo(), min_replica_size=1, load_state_dict=None, state_dict=None,
                      use_async_quorum=False, rank=0, world_size=1, store_addr="localhost", store_port=store.port,
                      lighthouse_addr=lh.address(), replica_id="compat_", init_sync=False)
    try:
        manager.start_quorum()
        assert CountingGloo.configured == 1
        manager.start_quorum()  # the same quorum id: torchft keeps its process group
        assert CountingGloo.configured == 1
        force_reconfigure(manager)
        manager.start_quorum()
        assert CountingGloo.configured == 2
    finally:
        manager.shutdown(wait=False)
        lh.shutdown()
    with pytest.raises(TrainguardError, match="_quorum_id"):
        force_reconfigure(object())


def _tiny(*extra: str):
    return load_config(None, ["--model.dim", "32", "--model.n_layers", "1", "--model.n_heads", "2",
                              "--model.ffn_hidden", "64", "--data.max_bytes", "300000", "--data.seq_len", "16",
                              "--data.batch_size", "4", "--train.grad_accum", "2", "--train.steps", "4",
                              "--train.eval_every", "0", "--output.dir", "", "--output.metrics", "false",
                              "--output.progress", "false", *extra])


@pytest.mark.filterwarnings("ignore:The 'warn' method is deprecated")
def test_one_elastic_replica_equals_one_process_bitwise_through_a_guard_retry_and_a_checkpoint(tmp_path):
    """Through torchft (quorum, ordered all-reduce, should_commit), a guard's retry verdict (gathered through
    the quorum) and a checkpoint written by the lowest live replica, the run stays the single-process run."""

    class RetryOnce(StepGuard):
        name = "once"

        def __init__(self):
            self.fired = False

        def before_update(self, ctx):
            if ctx.step == 2 and not self.fired:
                self.fired = True
                return Verdict.retry(site="loss", reason="test")
            return Verdict.commit()

    lh = start_lighthouse()
    try:
        cfg = _tiny("--distributed.strategy", "elastic", "--distributed.elastic.lighthouse", lh.address(),
                    "--checkpoint.dir", str(tmp_path))
        trainer = Trainer(cfg, progress=False)
        try:
            trainer.add_guard(RetryOnce())
            seen = []
            trainer.callbacks.append(type("Seen", (), {"on_step_end": lambda self, t, r: seen.extend(r.retries)})())
            summary = trainer.run()
            retried = summary.retries
            got = trainer.state_dict_for_compare(optimizer=True)
            assert trainer.strategy.record["live"] == [0] and trainer.strategy.group.step == 4
        finally:
            trainer.close()
    finally:
        lh.shutdown()
    assert [(v["action"], v["site"], v["reason"], v["guard"], v["rank"]) for v in seen] == [("retry", "loss", "test", "once", 0)]
    assert retried == 1 and summary.checkpoint and CheckpointManager(tmp_path).checkpoints()[-1][0] == 4
    ref = Trainer(_tiny(), progress=False)
    for _ in range(4):
        ref.train_step()
    for k, v in ref.state_dict_for_compare(optimizer=True).items():
        assert torch.equal(got[k], v), k


# ---------------------------------------------------------------------------------------------------
# A replica SIGKILLed mid-step, restarted, healed

STEPS, REJOIN_AT, KILL_AT = 8, 4, 2
OVERRIDES = ["--data.batch_size", "12", "--train.grad_accum", "2"]  # 3 replicas x 2 slices x 2 sequences


class _Replay(Strategy):
    """One process that computes, each step, exactly the slices the elastic run counted, with their weights."""

    def __init__(self, counted: dict[int, dict[int, float]], n_slices: int):
        super().__init__()
        self.counted, self.n = counted, n_slices

    def plan(self, trainer, step):
        return StepPlan(step, [MicroBatch(t, self.n, w) for t, w in sorted(self.counted[step].items())])


def _spawn(args: list[str], env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), *args], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _logs(out: Path, r: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"log{r}.jsonl").read_text().splitlines()]


def _wait_committed(out: Path, procs: dict[int, subprocess.Popen], replicas: tuple[int, ...], step: int,
                    timeout: float = 180.0) -> None:
    """Until each of ``replicas`` has logged its commit of ``step`` (a replica that exits first fails the test)."""
    t0 = time.monotonic()
    while not all((out / f"log{r}.jsonl").exists() and any(rec["step"] == step for rec in _logs(out, r))
                  for r in replicas):
        for r in replicas:
            assert procs[r].poll() is None, f"replica {r} exited before committing step {step}: " + \
                procs[r].stderr.read()[-3000:]
        assert time.monotonic() - t0 < timeout, f"replicas {replicas} did not commit step {step}"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_replica_sigkilled_mid_step_survivors_finish_the_step_and_the_restarted_replica_heals(tmp_path):
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    lh = start_lighthouse()
    common = [*OVERRIDES, "--checkpoint.dir", str(ckpt), "--checkpoint.every", "3"]
    procs: dict[int, subprocess.Popen] = {}
    try:
        def base(r):
            return [str(out), str(r), "3", lh.address(), str(STEPS)]

        procs[0] = _spawn(base(0) + ["--wait-rejoin-at", str(REJOIN_AT), *common], env)
        procs[2] = _spawn(base(2) + ["--wait-rejoin-at", str(REJOIN_AT), *common], env)
        # replica 1 dies after planning step 2 (it is in the step's quorum): the others' all-reduce breaks
        procs[1] = _spawn(base(1) + ["--kill", f"{KILL_AT}:plan", *common], env)
        assert procs[1].wait(timeout=180) == -signal.SIGKILL, procs[1].stderr.read()[-3000:]
        assert (out / "killed1").read_text() == str(KILL_AT)
        # restarted only once the survivors have finished the step without it: started at once, on a quiet host the
        # new incarnation joined the step's quorum before the lighthouse had dropped the dead one, and healed into the
        # step itself (the survivors then saw no failure at all)
        _wait_committed(out, procs, (0, 2), KILL_AT)
        first_life = procs[1]
        procs[1] = _spawn(base(1) + ["--restarted", *common], env)
        for r, p in procs.items():
            assert p.wait(timeout=180) == 0, f"replica {r}: " + p.stderr.read()[-3000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        lh.shutdown()

    logs = {r: _logs(out, r) for r in range(3)}
    # the survivors committed every step exactly once, without a restart (one process each)
    for r in (0, 2):
        assert [rec["step"] for rec in logs[r]] == list(range(STEPS))
        assert len({rec["pid"] for rec in logs[r]}) == 1
        kill_step = logs[r][KILL_AT]
        assert kill_step["live"] == [0, 2] and kill_step["failed"] == [1]
        assert [e["event"] for e in kill_step["events"]] == ["failure"]  # finished in the same step
    # replica 1: steps 0, 1 in its first life; healed in at the rejoin point or soon after, then to the end
    first, second = logs[1][:KILL_AT], logs[1][KILL_AT:]
    assert [rec["step"] for rec in first] == list(range(KILL_AT)) and {rec["pid"] for rec in first} == {first_life.pid}
    joined_at = second[0]["step"]
    assert REJOIN_AT <= joined_at < STEPS and second[0]["events"] == [{"event": "healed", "to_step": joined_at}]
    assert [rec["step"] for rec in second] == list(range(joined_at, STEPS))
    assert logs[0][joined_at]["joined"] == [1] and logs[0][joined_at]["live"] == [0, 1, 2]

    finals = {r: torch.load(out / f"final{r}.pt") for r in range(3)}
    for r in range(3):
        f = finals[r]
        # no step lost, none applied twice: every optimizer and scheduler counted STEPS updates
        assert (f["adam_steps"], f["scheduler_steps"], f["step"], f["torchft_step"]) == ([STEPS], STEPS, STEPS, STEPS)
        for k, v in finals[0]["params"].items():
            assert torch.equal(f["params"][k], v), f"replica {r} differs from replica 0 at {k}"
    # the lowest live replica wrote the checkpoints; the last one holds the final state
    assert finals[0]["checkpoint"] and finals[1]["checkpoint"] is None and finals[2]["checkpoint"] is None
    assert [s for s, _ in CheckpointManager(ckpt).checkpoints()][-1] == STEPS

    # one process replaying the counted slices and weights of every step reaches the same parameters
    # (bitwise but for step 2, whose survivors' gradients were re-weighted 1/6 -> 1/4 after the backward)
    cfg = load_config(None, ["--model.dim", "32", "--model.n_layers", "1", "--model.n_heads", "2",
                             "--model.ffn_hidden", "64", "--data.max_bytes", "300000", "--data.seq_len", "16",
                             "--train.steps", str(STEPS), "--train.eval_every", "0", "--output.dir", "",
                             "--output.metrics", "false", "--output.progress", "false", *OVERRIDES])
    counted = {rec["step"]: {int(t): w for t, w in rec["counted"].items()} for rec in logs[0]}
    replay = Trainer(cfg, strategy=_Replay(counted, 6), progress=False)
    for _ in range(STEPS):
        replay.train_step()
    ref = replay.state_dict_for_compare(optimizer=True)
    for k, v in finals[0]["params"].items():
        torch.testing.assert_close(v, ref[k], rtol=1e-5, atol=1e-6, msg=k)
    resumed = Trainer(cfg, progress=False)
    resumed.load_checkpoint(CheckpointManager(ckpt).latest())
    for k, v in resumed.state_dict_for_compare(optimizer=True).items():
        assert torch.equal(v, finals[0]["params"][k]), k


def test_a_worker_that_cannot_reach_a_lighthouse_fails_with_one_line():
    cfg = load_config(None, ["--distributed.strategy", "elastic", "--distributed.elastic.lighthouse", ""])
    env_had = os.environ.pop("TORCHFT_LIGHTHOUSE", None)
    try:
        with pytest.raises(TrainguardError, match="no torchft lighthouse address"):
            Trainer(cfg, progress=False)
    finally:
        if env_had is not None:
            os.environ["TORCHFT_LIGHTHOUSE"] = env_had

