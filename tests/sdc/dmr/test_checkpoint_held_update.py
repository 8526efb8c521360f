"""A checkpoint taken right after an update whose check is still held (checked in the next iteration's windows) must
hold the verified state: the save settles the held check first. A fault in that last update before the save is
found and repaired there, and a run resumed from the checkpoint in a new trainer ends bitwise equal to the fault-free
run. Fixtures ``batches`` and ``clean``: the package's conftest (the windowed trainer's, 3 steps)."""

from tests.sdc.dmr._windowed import equal, params, trainer, windowed
from trainguard.faults import Fault, FaultModel, Injector, OpSite


def test_a_wrong_update_just_before_a_checkpoint_is_repaired_in_it_and_the_resumed_run_is_bitwise(batches, clean,
                                                                                                  tmp_path):
    t = trainer(batches, "--checkpoint.dir", str(tmp_path))
    inj = Injector(Fault(OpSite("aten._fused_adamw_*", "optimizer", 0, compute_only=True),
                         FaultModel("bitflip", field="exponent"), step=1), seed=7).attach(t)
    eng = windowed(t, "thread")
    t.train_step()
    t.train_step()  # (its update is held: checked in the next iteration, which the save comes before)
    assert eng._held and eng.totals["detected"] == 0
    t.save_checkpoint()
    (rec,) = inj.records
    assert rec.step == 1 and rec.phase == "optimizer"
    assert eng.totals["repaired_optimizer"] == 1  # (found by the held check, which the save ran first)

    resumed = trainer(batches, "--checkpoint.dir", str(tmp_path), "--checkpoint.resume", "true")
    resumed.load_checkpoint()
    windowed(resumed, "thread")
    resumed.train_step()
    assert resumed.step_idx == 3 and equal(params(resumed), clean)
