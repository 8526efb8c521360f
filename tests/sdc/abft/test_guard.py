"""ABFTGuard: escalations become retry verdicts before the update; end to end, a NaN in the softmax output
is retried by the Trainer and the run ends bitwise equal to a fault-free one."""

import math

import pytest
import torch

from trainguard.errors import TrainguardError
from trainguard.models import build_model
from trainguard.sdc.abft import ABFTConfig, protect
from trainguard.sdc.abft.guard import ABFTGuard, attach_guard
from trainguard.train.guards import Action, StepContext

TINY = ["--data.max_bytes", "1000000", "--data.seq_len", "32", "--data.batch_size", "8", "--train.steps", "4",
        "--train.eval_every", "0", "--output.metrics", "false", "--output.progress", "false", "--output.dir", ""]


def _ctx(step=0, attempt=0):
    return StepContext(trainer=None, step=step, attempt=attempt)


def test_verdicts():
    h = protect(build_model("llama-tiny", seed=0))
    g = ABFTGuard(h)
    assert g.inspects_update is False and g.name == "abft"
    g.on_step_start(_ctx(step=7))
    assert h.step == 7 and g.before_update(_ctx(7)).ok
    h.escalate(3, "probs", "softmax output rows do not sum to 1")
    h.escalate(3, "context", "non-finite input")
    v = g.before_update(_ctx(7))
    assert v.action == Action.RETRY and v.site == "abft:layer3/probs"
    assert v.reason == "softmax output rows do not sum to 1 (+1 more)"
    g.on_retry(_ctx(7), v)
    g.on_step_start(_ctx(7, attempt=1))  # the next attempt starts clean
    assert h.retries == 1 and g.before_update(_ctx(7, 1)).ok
    assert h.counters["CL"]["escalated"] == 2 and h.counters["CL"]["detected"] == 2


def test_corrected_and_recomputed_faults_commit():
    m = build_model("llama-tiny", seed=0)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    h = protect(m)
    g = ABFTGuard(h)
    g.on_step_start(_ctx())

    def hook(layer, product, t):
        if layer == 0 and product == "q":
            t[0, 3, 5] = float("nan")          # corrected
        if layer == 1 and product == "context":
            t[0, 0, 2:5, 1:4] = 7.0             # 2D: recomputed

    h.add_fault_hook(hook)
    m(x)
    tot = h.total()
    assert tot["corrected"] >= 1 and tot["recomputed"] >= 1 and tot["escalated"] == 0
    assert g.before_update(_ctx()).ok


def test_attach_guard_needs_a_trainer_with_guards():
    h = protect(build_model("llama-tiny", seed=0))
    with pytest.raises(TrainguardError, match="add_guard"):
        attach_guard(object(), h)


def test_nan_in_the_softmax_output_is_retried_by_the_trainer_bitwise():
    from trainguard.config import load_config
    from trainguard.data import PackedBatches
    from trainguard.faults import Fault, FaultModel, Injector, ProductSite
    from trainguard.train import Trainer

    cfg = load_config(None, TINY)
    batches = PackedBatches.from_config(cfg.data)

    def trainer():
        t = Trainer(cfg, batches=batches)
        h = protect(t.model, ABFTConfig())
        attach_guard(t, h)
        return t, h

    clean, _ = trainer()
    clean_losses = [clean.train_step().loss for _ in range(4)]
    t, h = trainer()
    inj = Injector(Fault(ProductSite("probs", layer=1), FaultModel("nan"), step=2, index=5)).attach(t)
    results = [t.train_step() for _ in range(4)]
    assert len(inj.records) == 1
    assert [r.attempts for r in results] == [1, 1, 2, 1]
    assert results[2].retries[0]["site"] == "abft:layer1/probs" and results[2].retries[0]["guard"] == "abft"
    assert all(math.isfinite(r.loss) for r in results) and [r.loss for r in results] == clean_losses
    a, b = t.state_dict_for_compare(), clean.state_dict_for_compare()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert h.retries == 1
