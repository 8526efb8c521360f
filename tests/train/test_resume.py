"""Resuming a run: the config saved with the checkpoint is compared with the new one (model and data changes
refused, schedule changes applied from the resumed step), a corrupt newest checkpoint falls back to the
newest intact one, a step can be picked, a finished run is left alone, and metrics.jsonl holds each
committed step once. Steps are counted the same way in every file."""

import json

import pytest
import torch
from conftest import tiny_cfg

from trainguard.errors import CheckpointError
from trainguard.train import Trainer, run_lock
from trainguard.train.checkpoint import CheckpointManager, seal_manifest


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _lrs(trainer: Trainer, n: int) -> list[float]:
    out = []
    for _ in range(n):
        out.append(trainer.train_step().lr)
    return out


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_more_steps_and_a_new_lr_take_effect_from_the_resumed_step(tmp_path, batches, capfd):
    ck = str(tmp_path / "ck")
    Trainer(tiny_cfg("--train.steps", "4", "--checkpoint.dir", ck), batches=batches).run()  # the schedule ends at 4
    new = ("--train.steps", "8", "--train.lr", "1e-3")
    resumed = Trainer(tiny_cfg(*new, "--checkpoint.dir", ck, "--checkpoint.resume", "true"), batches=batches)
    assert resumed.step_idx == 4
    # the schedule of an 8-step run at lr 1e-3, from step 4 on (not the old run's minimum lr)
    fresh = Trainer(tiny_cfg(*new), batches=batches)
    expected = _lrs(fresh, 8)[4:]
    assert _lrs(resumed, 4) == expected
    assert expected[0] > 1e-3 * 0.5  # mid-cosine, far from the 4-step run's floor (3e-4)
    err = capfd.readouterr().err
    assert "train.steps 4 -> 8" in err and "train.lr 0.003 -> 0.001" in err and "schedule is rebuilt" in err
    assert resumed.resume_changes == {"train.lr": [0.003, 0.001], "train.steps": [4, 8]}


def test_optimizer_hyperparameters_come_from_the_new_config(tmp_path, batches):
    ck = str(tmp_path / "ck")
    Trainer(tiny_cfg("--train.steps", "2", "--checkpoint.dir", ck), batches=batches).run()
    r = Trainer(tiny_cfg("--train.steps", "4", "--train.beta1", "0.8", "--train.weight_decay", "0.05",
                         "--checkpoint.dir", ck, "--checkpoint.resume", "true"), batches=batches)
    groups = r.optimizer.param_groups
    assert all(g["betas"] == (0.8, 0.95) for g in groups)
    assert groups[0]["weight_decay"] == 0.05 and groups[1]["weight_decay"] == 0.0


@pytest.mark.parametrize("change, key", [
    (("--model.n_heads", "2"), "model.n_heads 4 -> 2"),  # same tensor shapes: DCP alone would load it
    (("--model.preset", "llama-moe-tiny"), "model.n_experts"),
    (("--model.dim", "64"), "model.dim 128 -> 64"),
    (("--data.seq_len", "16"), "data.seq_len 32 -> 16"),
    (("--data.seed", "5"), "data.seed 0 -> 5"),
    (("--train.seed", "5"), "train.seed 0 -> 5"),
])
def test_a_changed_model_or_data_is_refused_naming_the_keys(tmp_path, batches, change, key):
    ck = str(tmp_path / "ck")
    Trainer(tiny_cfg("--train.steps", "2", "--checkpoint.dir", ck), batches=batches).run()
    with pytest.raises(CheckpointError) as err:
        Trainer(tiny_cfg("--train.steps", "4", *change, "--checkpoint.dir", ck, "--checkpoint.resume", "true"))
    assert key in str(err.value) and "\n" not in str(err.value)


def test_execution_only_changes_are_allowed_and_reported(tmp_path, batches):
    ck = str(tmp_path / "ck")
    Trainer(tiny_cfg("--train.steps", "2", "--checkpoint.dir", ck), batches=batches).run()
    r = Trainer(tiny_cfg("--train.steps", "4", "--model.attention", "explicit", "--train.grad_accum", "2",
                         "--checkpoint.dir", ck, "--checkpoint.resume", "true"), batches=batches)
    assert r.step_idx == 2 and set(r.resume_changes) == {"model.attention", "train.grad_accum", "train.steps"}


def test_checkpoint_of_another_model_is_one_line_even_without_a_saved_config(tmp_path, batches):
    """DCP's CheckpointException derives from BaseException: a mismatch must still be a CheckpointError. A
    manifest without a config (saved by the Python API with ``config=None``) loads through ``load_checkpoint``,
    and a resume, which could not check it, refuses it."""
    ck = tmp_path / "ck"
    Trainer(tiny_cfg("--train.steps", "1", "--checkpoint.dir", str(ck)), batches=batches).run()
    path = CheckpointManager(ck).latest()
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["config"], manifest["model_config"] = None, None  # nothing to compare
    (path / "manifest.json").write_text(json.dumps(seal_manifest(manifest)))
    with pytest.raises(CheckpointError, match="does not match this model"):
        Trainer(tiny_cfg("--model.dim", "64"), batches=batches).load_checkpoint(path)
    with pytest.raises(CheckpointError, match="records no config"):
        Trainer(tiny_cfg("--checkpoint.dir", str(ck), "--checkpoint.resume", "true"), batches=batches)


def test_corrupt_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, batches, capfd):
    ck = tmp_path / "ck"
    clean = Trainer(tiny_cfg("--train.steps", "6"), batches=batches)
    clean.run()
    Trainer(tiny_cfg("--train.steps", "6", "--checkpoint.dir", str(ck), "--checkpoint.every", "2",
                     "--checkpoint.keep", "3"), batches=batches).run(4)
    newest = CheckpointManager(ck).latest()
    blob = next(newest.glob("*.distcp"))
    raw = bytearray(blob.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    blob.write_bytes(bytes(raw))
    r = Trainer(tiny_cfg("--train.steps", "6", "--checkpoint.dir", str(ck), "--checkpoint.every", "2",
                         "--checkpoint.keep", "3", "--checkpoint.resume", "true"), batches=batches)
    assert r.step_idx == 2
    err = capfd.readouterr().err
    assert "warning" in err and "corrupted" in err and "falling back to step 2" in err
    assert (ck / "step_00000004.corrupt").is_dir()  # kept for inspection, out of the run
    r.run()
    assert _equal(r.state_dict_for_compare(), clean.state_dict_for_compare())
    assert [s for s, _ in CheckpointManager(ck).checkpoints()] == [2, 4, 6]


def test_resume_step_picks_a_checkpoint_and_sets_later_ones_aside(tmp_path, batches, capfd):
    ck = tmp_path / "ck"
    args = ("--train.steps", "6", "--checkpoint.dir", str(ck), "--checkpoint.every", "2", "--checkpoint.keep", "3")
    Trainer(tiny_cfg(*args), batches=batches).run()
    r = Trainer(tiny_cfg(*args, "--checkpoint.resume", "true", "--checkpoint.resume_step", "2"), batches=batches)
    assert r.step_idx == 2
    assert sorted(p.name for p in ck.iterdir()) == [run_lock.LOCK, run_lock.RANKS_LOCK, "step_00000002",
                                                    "step_00000004.superseded", "step_00000006.superseded"]
    assert "superseded" in capfd.readouterr().err
    with pytest.raises(CheckpointError, match="resume_step 3: no intact checkpoint of that step"):
        Trainer(tiny_cfg(*args, "--checkpoint.resume", "true", "--checkpoint.resume_step", "3"), batches=batches)


def test_a_save_after_going_back_sets_the_later_checkpoints_aside(tmp_path, batches, capfd):
    """A resume of a finished run moves nothing; trained on through the API, its first save sets aside the
    checkpoints of the history it left."""
    ck = tmp_path / "ck"
    args = ("--train.steps", "6", "--checkpoint.dir", str(ck), "--checkpoint.every", "2", "--checkpoint.keep", "3")
    Trainer(tiny_cfg(*args), batches=batches).run()
    r = Trainer(tiny_cfg(*args, "--train.steps", "2", "--checkpoint.resume", "true", "--checkpoint.resume_step", "2"),
                batches=batches)
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000002", "step_00000004", "step_00000006"]
    r.run(1)  # (saves step 3 at its end)
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000002", "step_00000003", "step_00000004.superseded",
                                                         "step_00000006.superseded"]
    assert "were renamed to *.superseded" in capfd.readouterr().err
    r.close()


def test_no_intact_checkpoint_is_refused(tmp_path, batches):
    ck = tmp_path / "ck"
    Trainer(tiny_cfg("--checkpoint.dir", str(ck)), batches=batches).run(1)
    (CheckpointManager(ck).latest() / "trainer.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="no intact checkpoint in .* to resume"):
        Trainer(tiny_cfg("--checkpoint.dir", str(ck), "--checkpoint.resume", "true"), batches=batches)


def test_resuming_a_finished_run_changes_nothing(tmp_path, batches, capfd):
    ck, out = tmp_path / "ck", tmp_path / "out"
    args = ("--train.steps", "3", "--checkpoint.dir", str(ck), "--output.dir", str(out), "--output.metrics", "true")
    Trainer(tiny_cfg(*args), batches=batches).run()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    ck_before = sorted(p.name for p in ck.iterdir())
    again = Trainer(tiny_cfg(*args, "--checkpoint.resume", "true"), batches=batches)
    summary = again.run()
    assert summary.already_finished and summary.steps_run == 0 and summary.end_step == 3
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # summary.json and metrics.jsonl untouched
    assert sorted(p.name for p in ck.iterdir()) == ck_before
    assert "already finished" in capfd.readouterr().err
    assert json.loads((out / "summary.json").read_text())["final_loss"] is not None


def test_metrics_hold_each_committed_step_once_after_a_crash_and_resume(tmp_path, batches):
    ck, out = tmp_path / "ck", tmp_path / "out"
    args = ("--train.steps", "8", "--checkpoint.dir", str(ck), "--checkpoint.every", "3", "--output.dir", str(out),
            "--output.metrics", "true", "--train.log_every", "1", "--train.eval_every", "4")

    class Crash:
        def on_step_end(self, trainer, result):
            if result.step == 4:  # the 5th step is logged, the checkpoint of step 3 is the newest
                raise RuntimeError("power cut")

    t = Trainer(tiny_cfg(*args), batches=batches)
    t.callbacks.append(Crash())
    with pytest.raises(RuntimeError):
        t.run()
    with open(out / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 6, "loss": 1.')  # a record cut short by the crash
    r = Trainer(tiny_cfg(*args, "--checkpoint.resume", "true"), batches=batches)
    assert r.step_idx == 3
    summary = r.run()
    records = _records(out / "metrics.jsonl")
    steps = [x["step"] for x in records if "loss" in x]
    assert steps == list(range(1, 9))
    assert [x["step"] for x in records if x.get("event") == "eval"] == [4, 8]
    assert [x["step"] for x in records if x.get("event") == "resume"] == [3]
    # one count everywhere: the record of the n-th step says n, as do its checkpoint and the summary
    assert [x["step"] for x in records if x.get("event") == "checkpoint"] == [3, 6, 8]
    assert summary.start_step == 3 and summary.end_step == 8 and summary.checkpoint.endswith("step_00000008")
    assert json.loads((out / "summary.json").read_text())["end_step"] == 8


def test_numpy_and_python_rng_states_resume_exactly(tmp_path, batches):
    import random

    import numpy as np

    ck = str(tmp_path / "ck")
    t = Trainer(tiny_cfg("--checkpoint.dir", ck), batches=batches)
    t.run(1)
    want = (np.random.random(), random.random(), torch.rand(1))
    Trainer(tiny_cfg("--checkpoint.dir", ck, "--checkpoint.resume", "true"), batches=batches)
    assert (np.random.random(), random.random()) == want[:2] and torch.equal(torch.rand(1), want[2])


def test_a_component_registered_after_the_resume_gets_its_saved_state(tmp_path, batches):
    class Count:
        def __init__(self):
            self.n = 0

        def on_step_start(self, trainer, step):
            self.n += 1

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, sd):
            self.n = sd["n"]

    ck = str(tmp_path / "ck")
    first = Trainer(tiny_cfg("--train.steps", "6", "--checkpoint.dir", ck), batches=batches)
    c = Count()
    first.register_state("count", c)
    first.callbacks.append(c)
    first.run(3)
    resumed = Trainer(tiny_cfg("--train.steps", "6", "--checkpoint.dir", ck, "--checkpoint.resume", "true"),
                      batches=batches)
    late = Count()
    resumed.register_state("count", late)  # (as a technique's setup does, after the trainer resumed)
    assert late.n == 3
