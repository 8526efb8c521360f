"""Damage a checkpoint folder in ways a save never leaves it, and resume: a manifest that is edited, malformed or
from a newer version, entries named like checkpoints that are not ones, a corpus replaced under its path, another
run's files in output.dir. Each case names what it used to do (found by an adversarial probe of the CLI)."""

import json

import pytest
from conftest import tiny_cfg

from trainguard.data import PackedBatches
from trainguard.errors import CheckpointError
from trainguard.train import Trainer
from trainguard.train.checkpoint import MANIFEST, CheckpointManager, NewerFormatError, seal_manifest, verify

ARGS = ("--train.steps", "4", "--checkpoint.every", "2", "--checkpoint.keep", "3")


def _two_checkpoints(tmp_path, batches):
    ck = tmp_path / "ck"
    Trainer(tiny_cfg(*ARGS, "--checkpoint.dir", str(ck)), batches=batches).run()
    return ck


def _resume(ck, batches, *more):
    return Trainer(tiny_cfg(*ARGS, "--checkpoint.dir", str(ck), "--checkpoint.resume", "true", *more), batches=batches)


def _edit(path, change, seal: bool) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    change(manifest)
    (path / MANIFEST).write_text(json.dumps(seal_manifest(manifest) if seal else manifest))


def _set(key, value):
    return lambda m: m.__setitem__(key, value)


def _seed(m):
    m["config"]["data"]["seed"] = 5


# (change, sealed again after it): sealed, the manifest's own checks must find it; not sealed, its sha256
DAMAGE = {
    "files is a list": (_set("files", []), True),  # was: AttributeError traceback
    "step is text": (_set("step", "six"), True),  # was: ValueError traceback
    "step of another folder": (_set("step", 2), True),
    "a file outside the folder": (lambda m: m["files"].__setitem__("../../escape", 3), True),
    "config is text": (_set("config", "none"), True),
    "no sha256": (lambda m: m.pop("sha256"), True),
    "config edited": (_seed, False),  # was: the resume checked the run against the edited config
    "config removed": (lambda m: m.pop("config"), False),  # was: every resume check skipped
}


@pytest.mark.parametrize("name", DAMAGE)
def test_a_damaged_manifest_is_a_corrupt_checkpoint_and_the_resume_falls_back(tmp_path, batches, capfd, name):
    ck = _two_checkpoints(tmp_path, batches)
    change, seal = DAMAGE[name]
    _edit(ck / "step_00000004", change, seal)
    with pytest.raises(CheckpointError):
        verify(ck / "step_00000004")
    r = _resume(ck, batches)
    assert r.step_idx == 2
    assert (ck / "step_00000004.corrupt" / MANIFEST).is_file()  # set aside, not deleted
    assert "moved to step_00000004.corrupt; falling back to step 2" in capfd.readouterr().err
    r.close()


def test_a_sealed_manifest_without_a_config_is_refused_not_resumed_unchecked(tmp_path, batches):
    ck = _two_checkpoints(tmp_path, batches)
    _edit(ck / "step_00000004", _set("config", None), seal=True)
    with pytest.raises(CheckpointError, match="records no config"):
        _resume(ck, batches, "--data.seed", "5")  # (was: accepted, "config unchanged")


def test_a_checkpoint_of_a_newer_format_is_refused_and_left_in_place(tmp_path, batches):
    """Was: renamed .corrupt, and the run went back to older progress."""
    ck = _two_checkpoints(tmp_path, batches)
    _edit(ck / "step_00000004", _set("format", "trainguard-dcp-3"), seal=True)
    with pytest.raises(CheckpointError, match="newer trainguard .*trainguard-dcp-3.*resume_step"):
        _resume(ck, batches)
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000002", "step_00000004"]
    with pytest.raises(NewerFormatError):
        verify(ck / "step_00000004")
    r = _resume(ck, batches, "--checkpoint.resume_step", "2")  # an older step, asked for, still resumes
    assert r.step_idx == 2
    r.close()


@pytest.mark.parametrize("kind", ["folder without a manifest", "manifest is a folder", "a file"])
def test_an_entry_named_like_a_checkpoint_is_set_aside_never_deleted(tmp_path, batches, capfd, kind):
    """Was: skipped without a word, then deleted (rmtree) when the run saved that step, "saved earlier by this run"."""
    ck = _two_checkpoints(tmp_path, batches)
    stray = ck / "step_00000006"
    if kind == "a file":
        stray.write_text("someone's notes")
    else:
        stray.mkdir()
        (stray / "weights.bin").write_bytes(b"precious")
        if kind == "manifest is a folder":
            (stray / MANIFEST).mkdir()
    r = _resume(ck, batches, "--train.steps", "6")
    err = capfd.readouterr().err
    assert f"{stray} is not a checkpoint" in err and "moved to step_00000006.incomplete" in err
    r.run()
    kept = ck / "step_00000006.incomplete"
    assert (kept.read_text() == "someone's notes") if kind == "a file" else (kept / "weights.bin").read_bytes() == b"precious"
    assert verify(ck / "step_00000006")["step"] == 6
    assert "saved earlier by this run" not in capfd.readouterr().err
    r.close()


def test_an_entry_that_appears_during_the_run_is_set_aside_at_the_save(tmp_path, batches, capfd):
    ck = tmp_path / "ck"
    t = Trainer(tiny_cfg(*ARGS, "--checkpoint.dir", str(ck)), batches=batches)
    (ck / "step_00000002").mkdir()
    (ck / "step_00000002" / "x").write_text("not yours")
    t.run(2)
    assert (ck / "step_00000002.incomplete" / "x").read_text() == "not yours"
    assert verify(ck / "step_00000002")["step"] == 2
    assert "was not a checkpoint of this run; moved to step_00000002.incomplete" in capfd.readouterr().err
    t.close()


def test_resuming_a_finished_step_moves_nothing(tmp_path, batches):
    """Was: "already finished", after the later checkpoints had been renamed .superseded."""
    ck = _two_checkpoints(tmp_path, batches)
    r = _resume(ck, batches, "--checkpoint.resume_step", "2", "--train.steps", "2")
    assert r.run().already_finished
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000002", "step_00000004"]
    r.close()


# ---- the corpus is its contents, not its path -----------------------------------------------------------
def _corpus_run(tmp_path, source: str, *more: str) -> Trainer:
    cfg = tiny_cfg("--data.source", source, "--data.max_bytes", "0", "--train.steps", "2",
                   "--checkpoint.dir", str(tmp_path / "ck"), *more)
    return Trainer(cfg, batches=PackedBatches.from_config(cfg.data))


def test_a_corpus_replaced_under_its_path_is_refused_and_the_same_one_by_another_path_accepted(tmp_path):
    corpus = tmp_path / "corpus.txt"
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400))
    corpus.write_text(text)
    t = _corpus_run(tmp_path, str(corpus))
    t.run()
    t.close()
    other_path = str(tmp_path / "sub" / ".." / "corpus.txt")
    (tmp_path / "sub").mkdir()
    r = _corpus_run(tmp_path, other_path, "--checkpoint.resume", "true", "--train.steps", "3")  # was: refused
    assert r.step_idx == 2 and r.resume_changes == {"data.source": [str(corpus), other_path],
                                                    "train.steps": [2, 3]}
    r.close()
    corpus.write_text(text.replace("fox", "cat"))  # same size, same path, other text
    with pytest.raises(CheckpointError, match="corpus's contents"):  # was: accepted (and the loss jumped)
        _corpus_run(tmp_path, str(corpus), "--checkpoint.resume", "true", "--train.steps", "3")


# ---- output.dir -----------------------------------------------------------------------------------------
def test_a_new_run_moves_another_runs_outputs_aside_instead_of_overwriting_them(tmp_path, batches, capfd):
    """Was: a new run in the same output.dir overwrote metrics.jsonl and summary.json."""
    out = tmp_path / "out"
    args = ("--train.steps", "2", "--output.dir", str(out), "--output.metrics", "true")
    first = Trainer(tiny_cfg(*args), batches=batches)
    first.run()
    before = {n: (out / n).read_bytes() for n in ("metrics.jsonl", "summary.json")}
    second = Trainer(tiny_cfg(*args), batches=batches)
    second.run()
    kept = out / "previous" / first.run_id
    assert {n: (kept / n).read_bytes() for n in before} == before
    assert json.loads((out / "summary.json").read_text())["run_id"] == second.run_id
    assert f"held the files of run {first.run_id}" in capfd.readouterr().err
    third = Trainer(tiny_cfg(*args), batches=batches)  # a name taken in previous/ is never reused
    third.run()
    assert (out / "previous" / second.run_id / "summary.json").is_file() and kept.is_dir()


def test_a_resumed_run_keeps_appending_to_its_own_outputs(tmp_path, batches):
    out, ck = tmp_path / "out", tmp_path / "ck"
    args = ("--output.dir", str(out), "--output.metrics", "true", "--train.log_every", "1", "--checkpoint.dir", str(ck))
    Trainer(tiny_cfg(*args, "--train.steps", "2"), batches=batches).run()
    r = Trainer(tiny_cfg(*args, "--train.steps", "4", "--checkpoint.resume", "true"), batches=batches)
    r.run()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == [1, 2, 3, 4] and not (out / "previous").exists()
    r.close()


def test_a_step_past_eight_digits_is_still_a_checkpoint(tmp_path):
    """A folder of step 100,000,000 has nine digits: it is a checkpoint like any other (was: invisible)."""
    mgr = CheckpointManager(tmp_path)
    (tmp_path / "step_100000000").mkdir()
    (tmp_path / "step_100000000" / MANIFEST).write_text("{}")
    assert mgr.path_for(100_000_000).name == "step_100000000"
    assert mgr.checkpoints() == [(100_000_000, tmp_path / "step_100000000")]
