"""A checkpoint taken right after an iteration whose checks are still pending (the update's, held into the next
iteration's windows, and the last backward ops', carried past the update) must hold the verified state: the save
settles them first. A fault in that last iteration is found there (a wrong update repaired; a wrong gradient
re-executes the iteration), and a run resumed from the checkpoint in a new trainer ends bitwise equal to the
fault-free run. Fixtures ``batches`` and ``clean``: the package's conftest (the windowed trainer's, 3 steps)."""

import pytest

from tests.sdc.dmr._windowed import equal, params, trainer, windowed
from trainguard.faults import Fault, FaultModel, Injector, OpSite


@pytest.mark.parametrize("site, repaired", [
    (OpSite("aten._fused_adamw_*", "optimizer", 0, compute_only=True), 1),  # the held update: repaired in place
    (OpSite("aten.mm*", "backward", 40, compute_only=True), 0),  # a carried backward op: the iteration re-executed
], ids=["held-update", "carried-backward"])
def test_a_fault_in_the_iteration_before_a_checkpoint_is_found_by_the_save_and_the_resumed_run_is_bitwise(
        batches, clean, tmp_path, site, repaired):
    t = trainer(batches, "--checkpoint.dir", str(tmp_path))
    inj = Injector(Fault(site, FaultModel("bitflip", field="exponent"), step=1), seed=7).attach(t)
    eng = windowed(t, "thread")
    results = [t.train_step() for _ in range(2)]
    assert [r.attempts for r in results] == [2, 1]  # (the first profiled; the fault not found within its step)
    assert eng.totals["detected"] == 0 and (eng._held or eng._carried)
    t.save_checkpoint()
    (rec,) = inj.records
    assert rec.step == 1 and rec.phase == site.phase
    assert eng.totals["detected"] == 1 and eng.totals["repaired_optimizer"] == repaired  # (found by the save)

    resumed = trainer(batches, "--checkpoint.dir", str(tmp_path), "--checkpoint.resume", "true")
    resumed.load_checkpoint()
    windowed(resumed, "thread")
    resumed.train_step()
    assert resumed.step_idx == 3 and equal(params(resumed), clean)
