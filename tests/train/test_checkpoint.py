"""DCP checkpoints: bitwise resume, crash-safe commits, corruption refused, retention."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import tiny_cfg

from trainguard.errors import CheckpointError
from trainguard.train import Trainer
from trainguard.train import checkpoint as ckpt_mod
from trainguard.train.checkpoint import CheckpointManager, verify


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_is_bitwise_equal_to_uninterrupted(tmp_path, batches):
    total = 8
    clean = Trainer(tiny_cfg("--train.steps", str(total)), batches=batches)
    clean.run()
    ck = str(tmp_path / "ck")
    first = Trainer(tiny_cfg("--train.steps", str(total), "--checkpoint.dir", ck), batches=batches)
    first.run(5)  # saves at the end of the run
    assert CheckpointManager(ck).latest().name == "step_00000005"
    resumed = Trainer(tiny_cfg("--train.steps", str(total), "--checkpoint.dir", ck, "--checkpoint.resume", "true"),
                      batches=batches)
    assert resumed.step_idx == 5
    assert resumed.optimizer.param_groups[0]["lr"] == first.optimizer.param_groups[0]["lr"]
    summary = resumed.run()
    assert summary.start_step == 5 and summary.end_step == total and summary.resumed_from
    assert _equal(resumed.state_dict_for_compare(), clean.state_dict_for_compare())


def test_save_at_step_zero_keeps_optimizer_fresh(tmp_path, batches):
    ck = str(tmp_path / "ck")
    t = Trainer(tiny_cfg("--checkpoint.dir", ck), batches=batches)
    t.save_checkpoint()
    assert not t.optimizer.state  # saving must not initialise the optimizer (would change the run)
    ref = Trainer(tiny_cfg(), batches=batches)
    r = Trainer(tiny_cfg("--checkpoint.dir", ck, "--checkpoint.resume", "true"), batches=batches)
    r.run(2)
    ref.run(2)
    assert _equal(r.state_dict_for_compare(), ref.state_dict_for_compare())


def test_failed_save_keeps_previous_checkpoint(tmp_path, batches, monkeypatch):
    ck = tmp_path / "ck"
    t = Trainer(tiny_cfg("--checkpoint.dir", str(ck)), batches=batches)
    t.run(2)
    good = t.state_dict_for_compare()
    t.train_step()
    t.train_step()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod, "write_manifest", boom)
    with pytest.raises(CheckpointError, match="cannot write checkpoint step 4 .*disk full"):
        t.save_checkpoint()
    monkeypatch.undo()
    mgr = CheckpointManager(ck)
    assert [s for s, _ in mgr.checkpoints()] == [2]
    assert not list(ck.glob(".tmp-*"))
    fresh = Trainer(tiny_cfg("--checkpoint.dir", str(ck), "--checkpoint.resume", "true"), batches=batches)
    assert fresh.step_idx == 2 and _equal(fresh.state_dict_for_compare(), good)


def test_process_killed_during_save_leaves_previous_loadable(tmp_path):
    ck = tmp_path / "ck"
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from conftest import tiny_cfg
        from trainguard.train import Trainer
        from trainguard.train import checkpoint as ck
        t = Trainer(tiny_cfg("--checkpoint.dir", {str(ck)!r}))
        t.run(2)                       # good checkpoint at step 2
        t.train_step()
        real = ck.write_manifest
        def die(path, *a, **k):        # DCP files are written; the process dies before the commit
            assert any(path.iterdir())
            os._exit(9)
        ck.write_manifest = die
        t.save_checkpoint()
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 9, proc.stderr[-2000:]
    assert list(ck.glob(".tmp-step_00000003"))  # the half-written save is there ...
    mgr = CheckpointManager(ck)
    assert [s for s, _ in mgr.checkpoints()] == [2]  # ... but never visible as a checkpoint
    verify(mgr.latest())
    t = Trainer(tiny_cfg("--checkpoint.dir", str(ck), "--checkpoint.resume", "true"))
    assert t.step_idx == 2
    t.save_checkpoint()  # the next save cleans the stale temp dir
    assert not list(ck.glob(".tmp-*"))


def test_corrupted_checkpoint_is_refused(tmp_path, batches):
    ck = tmp_path / "ck"
    t = Trainer(tiny_cfg("--checkpoint.dir", str(ck)), batches=batches)
    t.run(2)
    path = CheckpointManager(ck).latest()
    verify(path)
    data_file = next(path.glob("*.distcp"))
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="corrupted"):
        verify(path)
    with pytest.raises(CheckpointError, match="corrupted") as err:
        Trainer(tiny_cfg("--checkpoint.dir", str(ck), "--checkpoint.resume", "true"), batches=batches)
    assert "\n" not in str(err.value)


def test_incomplete_checkpoint_is_refused(tmp_path, batches):
    ck = tmp_path / "ck"
    t = Trainer(tiny_cfg("--checkpoint.dir", str(ck)), batches=batches)
    t.run(1)
    path = CheckpointManager(ck).latest()
    (path / "trainer.pt").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        verify(path)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        ckpt_mod.load_checkpoint(path, t.model)


def test_keep_latest_and_periodic_saves(tmp_path, batches):
    ck = tmp_path / "ck"
    t = Trainer(tiny_cfg("--checkpoint.dir", str(ck), "--checkpoint.every", "2", "--checkpoint.keep", "2"),
                batches=batches)
    summary = t.run(7)
    assert [s for s, _ in CheckpointManager(ck).checkpoints()] == [6, 7]
    assert summary.checkpoint.endswith("step_00000007")
    for _, p in CheckpointManager(ck).checkpoints():
        assert verify(p)["step"] in (6, 7)


# ---- a checkpoint folder belongs to one run ------------------------------------------------------------
def test_new_run_in_a_folder_of_another_run_is_refused(tmp_path, batches):
    """Before: the new run saved step 3, pruning kept the other run's steps 5 and 6 and deleted it."""
    ck = tmp_path / "ck"
    Trainer(tiny_cfg("--checkpoint.dir", str(ck), "--checkpoint.every", "1", "--checkpoint.keep", "2"),
            batches=batches).run(6)
    with pytest.raises(CheckpointError) as err:
        Trainer(tiny_cfg("--train.steps", "3", "--checkpoint.dir", str(ck)), batches=batches)
    msg = str(err.value)
    assert "holds checkpoints of another run" in msg and "--checkpoint.resume true" in msg and "\n" not in msg
    assert "--checkpoint.start_over true" in msg
    assert [s for s, _ in CheckpointManager(ck).checkpoints()] == [5, 6]  # untouched


def test_start_over_replaces_the_other_run_and_the_summary_points_to_a_real_checkpoint(tmp_path, batches, capfd):
    ck = tmp_path / "ck"
    Trainer(tiny_cfg("--checkpoint.dir", str(ck), "--checkpoint.every", "1"), batches=batches).run(6)
    t = Trainer(tiny_cfg("--train.steps", "3", "--checkpoint.dir", str(ck), "--checkpoint.start_over", "true"),
                batches=batches)
    assert "deleted 2 checkpoint(s)" in capfd.readouterr().err
    summary = t.run()
    assert Path(summary.checkpoint).is_dir() and verify(summary.checkpoint)["run_id"] == t.run_id
    assert [s for s, _ in CheckpointManager(ck).checkpoints()] == [3]


def test_pruning_keeps_the_checkpoint_just_written_and_other_runs(tmp_path, batches):
    ck = tmp_path / "ck"
    t = Trainer(tiny_cfg(), batches=batches)
    a = CheckpointManager(ck, keep=1, run_id="run-a")
    b = CheckpointManager(ck, keep=1, run_id="run-b")
    a.save(10, t.model, t.optimizer)
    a.save(20, t.model, t.optimizer)
    b.save(5, t.model, t.optimizer)  # lower step than run a's: must survive its own pruning
    assert [(s, a.run_of(p)) for s, p in a.checkpoints()] == [(5, "run-b"), (20, "run-a")]
    b.save(7, t.model, t.optimizer)
    assert [(s, a.run_of(p)) for s, p in a.checkpoints()] == [(7, "run-b"), (20, "run-a")]


def test_a_checkpoint_is_never_overwritten_silently(tmp_path, batches, capfd):
    ck = tmp_path / "ck"
    t = Trainer(tiny_cfg(), batches=batches)
    CheckpointManager(ck, run_id="run-a").save(4, t.model, t.optimizer)
    with pytest.raises(CheckpointError, match="refusing to overwrite .*step_00000004: it belongs to run run-a"):
        CheckpointManager(ck, run_id="run-b").save(4, t.model, t.optimizer)
    CheckpointManager(ck, run_id="run-a").save(4, t.model, t.optimizer)
    assert "replacing checkpoint" in capfd.readouterr().err


# ---- trainer.pt is read with weights_only=True --------------------------------------------------------
class _Exploit:
    marker = ""

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_whose_trainer_state_runs_code_is_refused(tmp_path, batches):
    ck = tmp_path / "ck"
    t = Trainer(tiny_cfg("--checkpoint.dir", str(ck)), batches=batches)
    t.run(1)
    path = CheckpointManager(ck).latest()
    marker = tmp_path / "pwned"
    _Exploit.marker = str(marker)
    torch.save({"step": 1, "payload": _Exploit()}, path / "trainer.pt")
    saved = ckpt_mod.read_manifest(path)
    extra = {k: saved[k] for k in ("run_id", "model_config", "data_fingerprint")}
    ckpt_mod.write_manifest(path, 1, saved["config"], extra)  # a consistent manifest: only the pickle is evil
    verify(path)
    with pytest.raises(CheckpointError, match="refusing trainer.pt"):
        Trainer(tiny_cfg("--checkpoint.dir", str(ck), "--checkpoint.resume", "true"), batches=batches)
    assert not marker.exists()


def test_trainer_state_is_plain_tensors_and_values(tmp_path, batches):
    ck = tmp_path / "ck"
    Trainer(tiny_cfg("--checkpoint.dir", str(ck)), batches=batches).run(1)
    state = torch.load(CheckpointManager(ck).latest() / "trainer.pt", weights_only=True)
    assert state["step"] == 1 and torch.is_tensor(state["rng"]["numpy"][1])


def test_component_state_that_a_weights_only_load_refuses_is_refused_at_save(tmp_path, batches):
    import numpy as np

    class Holder:
        def state_dict(self):
            return {"table": np.arange(3)}

        def load_state_dict(self, sd):
            pass

    t = Trainer(tiny_cfg("--checkpoint.dir", str(tmp_path / "ck")), batches=batches)
    t.register_state("numpy-holder", Holder())
    with pytest.raises(CheckpointError, match="trainer state cannot be saved"):
        t.save_checkpoint()
    assert not CheckpointManager(tmp_path / "ck").checkpoints()


# ---- failures while saving ----------------------------------------------------------------------------
@pytest.fixture(params=["tmpfs", "simulated"])
def full_disk(request, tmp_path, monkeypatch):
    from _disk import FullDisk

    disk = FullDisk(tmp_path / "disk", monkeypatch, real=request.param == "tmpfs")
    if request.param == "tmpfs" and not disk.real:
        pytest.skip("cannot mount a small tmpfs here (needs root); the simulated case still runs")
    try:
        yield disk
    finally:
        disk.close()


def test_full_disk_is_named_and_keeps_the_previous_checkpoint(tmp_path, batches, full_disk):
    ck = full_disk.path / "ck"
    t = Trainer(tiny_cfg("--checkpoint.dir", str(ck)), batches=batches)
    t.save_checkpoint()  # step 0 (no optimizer state yet: small)
    t.train_step()
    full_disk.fill()
    with pytest.raises(CheckpointError) as err:
        t.save_checkpoint()
    msg = str(err.value)
    assert "no space left on device" in msg and "step_00000000 is intact" in msg and "\n" not in msg
    assert [s for s, _ in CheckpointManager(ck).checkpoints()] == [0]
    verify(CheckpointManager(ck).latest())


def test_ctrl_c_during_a_dcp_write_stays_a_keyboard_interrupt(tmp_path, batches, monkeypatch):
    """DCP wraps it into its CheckpointException (a BaseException): it must come out as Ctrl-C again."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    ck = tmp_path / "ck"
    t = Trainer(tiny_cfg("--checkpoint.dir", str(ck)), batches=batches)
    t.run(1)

    def interrupted(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(FileSystemWriter, "write_data", interrupted)
    t.train_step()
    with pytest.raises(KeyboardInterrupt):
        t.save_checkpoint()
    assert [s for s, _ in CheckpointManager(ck).checkpoints()] == [1] and not list(ck.glob(".tmp-*"))


def test_killed_while_pruning_leaves_no_half_deleted_checkpoint(tmp_path, batches, monkeypatch):
    ck = tmp_path / "ck"
    t = Trainer(tiny_cfg("--checkpoint.dir", str(ck), "--checkpoint.every", "1", "--checkpoint.keep", "1"),
                batches=batches)
    t.run(1)
    real_rmtree = ckpt_mod.shutil.rmtree

    def dies_halfway(path, *a, **k):
        victim = Path(path)
        if "step_00000001" not in victim.name:
            return real_rmtree(path, *a, **k)
        next(victim.glob("*.distcp")).unlink()  # part of it is gone when the process dies
        raise SystemExit("killed")

    monkeypatch.setattr(ckpt_mod.shutil, "rmtree", dies_halfway)
    with pytest.raises(SystemExit):
        t.run(1)
    monkeypatch.setattr(ckpt_mod.shutil, "rmtree", real_rmtree)
    for _, p in CheckpointManager(ck).checkpoints():  # every visible checkpoint is whole
        verify(p)
    assert [s for s, _ in CheckpointManager(ck).checkpoints()] == [2]
