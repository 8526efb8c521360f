"""SPARe runtime on torchft: groups are real processes, killed with SIGKILL at a given step.

The claim under test: with failures within the redundancy the run ends with the parameters of the
fault-free run (the gradient is the same sum of shards, only the summation order differs), and a wipe-out
is survived by a global restart from the last checkpoint.
"""

import pytest
import torch

from trainguard.errors import TrainguardError
from trainguard.failover.spare.runtime import Kill, SpareRunConfig, reference_run, run_spare

TINY = dict(dim=32, n_layers=1, n_heads=2, ffn_hidden=64)


def _cfg(**kw) -> SpareRunConfig:
    base = dict(groups=4, redundancy=2, steps=6, model_overrides=TINY, seq_len=16, corpus_max_bytes=300_000)
    base.update(kw)
    return SpareRunConfig(**base)


def _assert_same_params(state, ref):
    assert state.keys() == ref.keys()
    for k in ref:
        # fp32 tolerance for a different summation order of the same shard gradients
        torch.testing.assert_close(state[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.slow
def test_groups_killed_within_redundancy_end_at_the_fault_free_parameters():
    # group 1 dies after computing its shard, before the all-reduce (its gradient is lost: patch compute);
    # group 3 dies at the start of a later step (the controller reorders before anyone computes)
    cfg = _cfg(kills=(Kill(1, 2, "compute"), Kill(3, 4, "start")))
    res = run_spare(cfg)
    ref = reference_run(cfg)
    assert [k["group"] for k in res.killed] == [1, 3]
    assert res.global_restarts == 0
    assert res.survivors == [0, 2]
    assert res.patch_computes >= 1, "the shard of the group killed mid-step must be patched"
    by_step = {lg["step"]: lg for lg in res.step_logs}
    assert sorted(by_step) == list(range(cfg.steps))
    assert by_step[2]["failed"] == [1] and by_step[4]["failed"] == [3]
    assert by_step[1]["stack"] == 1 and by_step[5]["stack"] == 2  # 2 survivors hold 4 types: 2 stacks
    _assert_same_params(res.state, ref)
    assert not res.errors


@pytest.mark.slow
def test_wipe_out_triggers_a_global_restart_from_the_last_checkpoint():
    # groups 1 and 2 are the only hosts of shard type 1 (Golomb ruler {0, 1}, N = 4): losing both is a wipe-out
    cfg = _cfg(kills=(Kill(1, 2, "compute"), Kill(2, 4, "start")), checkpoint_every=2)
    res = run_spare(cfg)
    assert res.global_restarts == 1
    assert res.survivors == [0, 1, 2, 3]  # the restart brings every group back
    assert [lg["step"] for lg in res.step_logs] == list(range(cfg.steps))
    _assert_same_params(res.state, reference_run(cfg))


def test_kill_parsing_and_bad_configs_are_refused_with_one_line():
    assert Kill.parse("3@7") == Kill(3, 7, "compute")
    assert Kill.parse("0@1:start") == Kill(0, 1, "start")
    for bad in ("3", "a@b", "1@2:later"):
        with pytest.raises(TrainguardError, match="--kill"):
            Kill.parse(bad)
    with pytest.raises(TrainguardError, match="cannot hold redundancy"):
        _cfg(groups=4, redundancy=3).validate()
    with pytest.raises(TrainguardError, match="groups are 0..3"):
        _cfg(kills=(Kill(4, 1),)).validate()
    with pytest.raises(TrainguardError, match="steps are 0..5"):
        _cfg(kills=(Kill(1, 6),)).validate()


def test_a_run_directory_holding_a_checkpoint_is_not_overwritten(tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(b"precious")
    with pytest.raises(TrainguardError, match="already holds a checkpoint"):
        run_spare(_cfg(run_dir=str(tmp_path)))
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"precious"
