"""DCP checkpoints: bitwise resume, crash-safe commits, corruption refused, retention."""

import os
import subprocess
import sys
import textwrap

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
