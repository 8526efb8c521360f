"""Injection reaches forward, recompute, backward and optimizer ops, modules, params, grads and
optimizer state, and each injection is recorded; the corruption is visible downstream."""

import math

import pytest
import torch

from trainguard.config import load_config
from trainguard.errors import TrainguardError
from trainguard.faults import Fault, FaultModel, Injector, ModuleSite, OpSite, TensorSite, checker_execution
from trainguard.train import Trainer

SMALL = ["--model.dim", "32", "--model.n_layers", "1", "--model.n_heads", "2", "--model.ffn_hidden", "64",
         "--data.seq_len", "16", "--data.batch_size", "4", "--data.max_bytes", "200000", "--train.steps", "3",
         "--train.eval_every", "0", "--output.dir", "", "--output.progress", "false", "--train.grad_clip", "0"]


@pytest.fixture(scope="module")
def batches():
    return Trainer(load_config(None, SMALL)).batches


def trainer(batches, *extra):
    return Trainer(load_config(None, SMALL + list(extra)), batches=batches)


def run(batches, fault, *extra, steps=1):
    t = trainer(batches, *extra)
    inj = Injector(fault, seed=3).attach(t)
    results = [t.train_step() for _ in range(steps)]
    return t, inj, results


def nonfinite(tensors):
    return any(not bool(torch.isfinite(x).all()) for x in tensors)


def test_forward_op_nan_reaches_loss(batches):
    t, inj, (r,) = run(batches, Fault(OpSite("aten.mm*", "forward", 2), FaultModel("nan")))
    (rec,) = inj.records
    assert rec.phase == "forward" and rec.site == "op" and rec.target.startswith("aten.mm")
    assert rec.occurrence == 2 and math.isnan(rec.new) and rec.step == 0
    assert math.isnan(r.loss)


def test_backward_op_nan_reaches_grads_not_loss(batches):
    t, inj, (r,) = run(batches, Fault(OpSite("aten.mm*", "backward", 1), FaultModel("nan")))
    (rec,) = inj.records
    assert rec.phase == "backward"
    assert math.isfinite(r.loss)  # the loss was computed before the fault
    assert nonfinite(p for p in t.model.parameters())  # the NaN gradient poisoned the update


def test_optimizer_op_fault_reaches_params_only_through_the_update(batches):
    fault = Fault(OpSite("aten._fused_adamw*", "optimizer", 0), FaultModel("inf"), step=0)
    t, inj, (r,) = run(batches, fault)
    (rec,) = inj.records
    assert rec.phase == "optimizer"
    assert rec.target.startswith("aten._fused_adamw")  # (the update's own op: the norm before it is optimizer too)
    assert math.isfinite(r.loss) and math.isfinite(r.grad_norm)
    # the INF landed in a tensor the in-place update wrote (a parameter or one of its moments), not in a copy
    written = [*t.model.parameters(), *(v for s in t.optimizer.state.values() for v in s.values()
                                        if torch.is_tensor(v) and v.is_floating_point())]
    assert nonfinite(written)
    assert sum(int((~torch.isfinite(x)).sum()) for x in written) == 1  # exactly the one struck element


def test_gradient_clipping_is_in_the_optimizer_phase(batches):
    """The trainer's update stage (the gradient norm, clipping, the optimizer step) is the ``optimizer`` phase, as the
    DMR engine counts it: a retried or later step's forward is ``forward`` again."""
    counts = {}
    for clip in ("0", "1.0"):
        t = trainer(batches, "--train.grad_clip", clip)
        inj = Injector([], seed=0).attach(t)
        inj.count_ops = True
        t.train_step()
        t.train_step()
        counts[clip] = inj.op_counts
    assert counts["0"][(0, "forward")] == counts["1.0"][(0, "forward")] == counts["1.0"][(1, "forward")]
    assert counts["1.0"][(0, "optimizer")] > counts["0"][(0, "optimizer")]  # clipping's scale: one more list op
    norm = Fault(OpSite("aten._foreach_norm*", "optimizer", 0), FaultModel("inf"), step=0)
    t, inj, (r,) = run(batches, norm, "--train.grad_clip", "1.0")
    (rec,) = inj.records
    assert rec.phase == "optimizer" and rec.target.startswith("aten._foreach_norm")
    assert not math.isfinite(r.grad_norm)
    _, inj, _ = run(batches, Fault(OpSite("aten._foreach_norm*", "forward", 0), FaultModel("inf"), step=0),
                    "--train.grad_clip", "1.0")
    assert inj.records == [] and len(inj.unfired()) == 1


def test_recompute_ops_are_labelled_and_reachable(batches):
    t, inj, (r,) = run(batches, Fault(OpSite("aten.mm*", "recompute", 0), FaultModel("nan")),
                       "--train.activation_checkpoint", "full")
    (rec,) = inj.records
    assert rec.phase == "recompute"
    assert math.isfinite(r.loss) and nonfinite(p for p in t.model.parameters())


def test_recompute_phase_absent_without_checkpointing(batches):
    t, inj, _ = run(batches, Fault(OpSite("aten.mm*", "recompute", 0), FaultModel("nan")))
    assert inj.records == [] and len(inj.unfired()) == 1


def test_occurrence_counts_matching_ops_of_the_phase(batches):
    seen = []
    for occ in range(3):
        _, inj, _ = run(batches, Fault(OpSite("aten.mm*", "forward", occ), FaultModel("value", value=1.0), index=0))
        seen.append(inj.records[0].old)
    assert len(set(seen)) == 3  # three different products were hit


def test_fault_fires_only_at_its_step(batches):
    t, inj, rs = run(batches, Fault(OpSite("aten.mm*", "forward", 0), FaultModel("nan"), step=1), steps=3)
    assert [r.step for r in inj.records] == [1]
    assert math.isfinite(rs[0].loss) and math.isnan(rs[1].loss)


def test_module_param_grad_and_optimizer_state_sites(batches):
    _, inj, (r,) = run(batches, Fault(ModuleSite("layers.0.attention.wq"), FaultModel("nan")))
    assert inj.records[0].site == "module" and inj.records[0].target == "layers.0.attention.wq" and math.isnan(r.loss)

    t, inj, (r,) = run(batches, Fault(TensorSite("param", "output.weight"), FaultModel("inf"), index=5))
    assert inj.records[0].site == "param" and not math.isfinite(r.loss)

    t, inj, (r,) = run(batches, Fault(TensorSite("grad", "norm.weight"), FaultModel("nan"), index=0))
    assert inj.records[0].site == "grad" and math.isfinite(r.loss)
    assert math.isnan(float(t.model.norm.weight[0].detach()))

    fault = Fault(TensorSite("optimizer-state", "norm.weight", "exp_avg_sq"), FaultModel("value", value=-1.0), step=1, index=0)
    t, inj, _ = run(batches, fault, steps=2)
    rec = inj.records[0]
    assert rec.site == "optimizer-state" and rec.target == "norm.weight.exp_avg_sq" and rec.new == -1.0
    assert math.isnan(float(t.model.norm.weight[0].detach()))  # sqrt of a negative second moment


def test_records_are_complete_and_json_ready(batches):
    import json

    _, inj, _ = run(batches, Fault(OpSite("aten.mm*", "forward", 0), FaultModel("bitflip", field="exponent")))
    d = inj.records[0].to_dict()
    assert set(d) >= {"step", "site", "target", "phase", "occurrence", "index", "dtype", "old", "new", "bit"}
    assert d["dtype"] == "float32" and 23 <= d["bit"] <= 30
    json.dumps(d)


def test_unknown_module_or_missing_optimizer_is_refused(batches):
    t = trainer(batches)
    with pytest.raises(TrainguardError, match=r"no module matches 'no.such.module' \(names look like 'tok_embeddings'"):
        Injector(Fault(ModuleSite("no.such.module"))).attach(t)
    for target in ("param", "grad", "optimizer-state"):  # a typo in a parameter pattern: refused, not every trial
        with pytest.raises(TrainguardError, match=r"no parameter matches 'layers\.0\.wq\*' \(names look like "
                                                  r"'tok_embeddings.weight'"):  # unreached and counted as masked
            Injector(Fault(TensorSite(target, "layers.0.wq*"))).attach(t)
    Injector(Fault(TensorSite("grad", "layers.0.attention.wq*"))).attach(t).detach()  # (a pattern that matches)
    with pytest.raises(TrainguardError):
        Injector(Fault(TensorSite("grad", "*"))).attach_model(t.model)
    with pytest.raises(TrainguardError):
        OpSite("aten.mm*", "sideways")


def test_product_site_reaches_attention_products_with_and_without_abft(batches):
    from trainguard.faults import ProductSite
    from trainguard.sdc.abft import protect

    # element (row 1, column 1) of the first head's scores: the causal mask keeps it (seq_len 16)
    fault = Fault(ProductSite("scores", layer=0, occurrence=0), FaultModel("nan"), index=17)
    t, inj, (r,) = run(batches, fault)
    (rec,) = inj.records
    assert rec.site == "product" and rec.target == "layers.0.scores" and rec.phase == "forward"
    assert math.isnan(r.loss)  # unprotected: the NaN reaches the loss

    t = trainer(batches)
    handle = protect(t.model)
    inj = Injector(fault, seed=3).attach(t)
    r = t.train_step()
    (rec,) = inj.records
    assert rec.site == "product" and rec.target == "layers.0.scores"
    assert handle.total()["corrected"] >= 1 and math.isfinite(r.loss)  # the protected kernel saw the same fault


def test_product_site_occurrence_and_layer_filter(batches):
    from trainguard.faults import ProductSite

    _, inj, _ = run(batches, Fault(ProductSite("q", layer=5), FaultModel("nan")))
    assert inj.records == [] and len(inj.unfired()) == 1  # no layer 5 in a 1-layer model
    _, inj, _ = run(batches, Fault(ProductSite("*", occurrence=4), FaultModel("value", value=7.0), index=0))
    assert inj.records[0].target == "layers.0.context"  # q k v scores context: the fifth product


def test_an_out_of_place_list_op_has_one_of_its_results_corrupted():
    """``_foreach_norm`` (clipping) and the out-of-place ``_foreach_mul`` (a gradient list op DMR runs out of
    place) return lists: the fault goes into one element of one of them, and the others are untouched."""
    model = torch.nn.Linear(4, 4)
    xs = [torch.randn(3, 5), torch.randn(7)]
    for op, call in (("aten._foreach_norm*", lambda: torch._foreach_norm(xs)),
                     ("aten._foreach_mul.*", lambda: torch._foreach_mul(xs, 2.0))):
        clean = call()
        inj = Injector(Fault(OpSite(op, "any", 0), FaultModel("value", value=1e6), step=0), seed=1).attach_model(model)
        with inj.step_context(0):
            got = call()
        (rec,) = inj.records
        assert rec.target.startswith(op.rstrip("*")) and rec.new == 1e6
        changed = [int((a != b).sum()) for a, b in zip(got, clean)]
        assert sorted(changed) == [0, 1], changed


def test_an_op_returning_a_tuple_has_one_of_its_floating_point_results_corrupted():
    """Fused attention returns (output, log-sum-exp), a layer-norm backward (grad input, grad weight, grad bias):
    each is an op of the step like any other, so a fault lands in exactly one element of one returned tensor
    (drawn), and integer results (``max``'s indices) are never the target."""
    model = torch.nn.Linear(4, 4)
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    x, w, b = torch.randn(3, 6), torch.randn(6), torch.randn(6)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [6], w, b, 1e-5)
    calls = {
        "aten._scaled_dot_product_flash_attention_for_cpu*":
            lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[:2],
        "aten.native_layer_norm_backward*":
            lambda: torch.ops.aten.native_layer_norm_backward(torch.ones(3, 6), x, [6], mean, rstd, w, b,
                                                              [True, True, True]),
        "aten.max.dim": lambda: torch.max(x, 1),
    }
    targets = set()
    for op, call in calls.items():
        for seed in range(4):
            clean = call()
            inj = Injector(Fault(OpSite(op, "any", 0), FaultModel("value", value=1e6), step=0),
                           seed=seed).attach_model(model)
            with inj.step_context(0):
                got = call()
            (rec,) = inj.records
            assert rec.target.startswith(op.rstrip("*")) and rec.new == 1e6
            changed = [int((a != b).sum()) for a, b in zip(got, clean)]
            assert sorted(changed) == [0] * (len(changed) - 1) + [1], (op, changed)
            targets.add((op, changed.index(1)))
    assert ("aten.max.dim", 1) not in targets  # the indices
    # the draw reaches more than the first result (attention's log-sum-exp, the layer norm's weight gradient...)
    assert any(i > 0 for op, i in targets if op != "aten.max.dim")


def test_an_attempt_retried_before_its_update_starts_in_the_forward_phase():
    inj = Injector([], seed=0)
    with inj.step_context(4):
        assert inj.current_phase() == "forward"
        inj.on_stage(None, "forward_backward", 4)  # a guard then asks for a retry: no "update" stage follows
        assert inj.current_phase() == "optimizer"
    with inj.step_context(4):
        assert inj.current_phase() == "forward"
        inj.on_stage(None, "plan", 4)
        assert inj.current_phase() == "forward"


def test_a_verifier_site_strikes_only_the_verifiers_own_ops_and_an_op_site_only_the_steps():
    """``OpSite(verifier=True)`` counts the ops run inside ``checker_execution()`` (a verifier's second
    executions, copies, fingerprints) and nothing else; an ordinary site counts the step's ops only. The record
    says ``verifier`` for the phase."""
    model = torch.nn.Linear(4, 4)
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    clean = a @ b

    def step(inj):
        with inj.step_context(0):
            primary = a @ b
            with checker_execution():
                first, second = a @ b, a @ b
            after = a @ b
        return primary, first, second, after

    inj = Injector(Fault(OpSite("aten.mm*", "any", 1, verifier=True), FaultModel("value", value=1e6)), seed=1)
    primary, first, second, after = step(inj.attach_model(model))
    (rec,) = inj.records
    assert rec.phase == "verifier" and rec.occurrence == 1 and rec.new == 1e6 and rec.thread == "main"
    assert torch.equal(primary, clean) and torch.equal(first, clean) and torch.equal(after, clean)
    assert int((second != clean).sum()) == 1
    inj = Injector(Fault(OpSite("aten.mm*", "any", 1), FaultModel("value", value=1e6)), seed=1)
    primary, first, second, after = step(inj.attach_model(model))
    (rec,) = inj.records
    assert rec.phase == "forward" and torch.equal(first, clean) and torch.equal(second, clean)
    assert int((after != clean).sum()) == 1  # the step's second op: the checker's were not counted
    inj = Injector([], seed=1).attach_model(model)
    inj.count_ops = inj.count_verifier = True
    step(inj)
    assert inj.op_counts == {(0, "forward"): 2, (0, "verifier"): 2}


def test_a_verifier_site_has_no_phase_of_its_own():
    with pytest.raises(TrainguardError, match="phase 'any'"):
        OpSite("*", "backward", 0, verifier=True)
