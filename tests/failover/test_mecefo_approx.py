"""MeCeFO's approximations, each on its own, on a tiny LLaMA in one process: the wrappers are pass-throughs when
not degraded; skip-MHA leaves the attention without gradient; the recomputed FFN equals the stored one;
the low-rank weight gradient is exact at full rank and its error falls as the rank grows; and they compose with
ABFT's protected attention (the slot's replacement) and with activation checkpointing (contexts entered)."""

import contextlib
import itertools

import pytest
import torch

from trainguard.errors import ConfigError, TrainguardError
from trainguard.failover.mecefo.approx import (
    ActivationMeter,
    LowRankLinear,
    MeCeFO,
    MeCeFOConfig,
    low_rank_basis,
    mha_parameter_names,
)
from trainguard.models import build_model, lm_loss
from trainguard.models.config import model_config
from trainguard.train.activation_checkpoint import add_checkpoint_context, apply_activation_checkpointing

CFG = model_config("llama-tiny", dim=32, n_layers=2, n_heads=2, ffn_hidden=64, max_seq_len=32)
ONLY = {"skip": dict(skip_mha=True, recompute_ffn=False, low_rank=False),
        "recompute": dict(skip_mha=False, recompute_ffn=True, low_rank=False),
        "low_rank": dict(skip_mha=False, recompute_ffn=False, low_rank=True)}


def _data(seed=0, b=2, t=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 258, (b, t), generator=g), torch.randint(0, 258, (b, t), generator=g)


def _grads(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = lm_loss(model(x), y)
    loss.backward()
    return loss.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _model():
    return build_model(CFG, seed=0)


def test_not_degraded_the_wrappers_are_pass_throughs_bitwise():
    x, y = _data()
    ref_loss, ref = _grads(_model(), x, y)
    m = _model()
    comp = MeCeFO().attach(m)
    assert m.layers["0"].attention.kernel.names == ["mecefo-skip-mha"]
    assert m.layers["0"].feed_forward.kernel.names == ["mecefo-ffn"]
    loss, got = _grads(m, x, y)
    assert torch.equal(loss, ref_loss) and all(torch.equal(got[k], ref[k]) for k in ref)
    with comp.degraded_mode(True):
        _grads(m, x, y)
    loss, got = _grads(m, x, y)  # the switch is back off: pass-through again
    assert torch.equal(loss, ref_loss) and all(torch.equal(got[k], ref[k]) for k in ref)
    assert not comp.degraded and comp.svd_refreshes > 0
    comp.detach()
    assert not m.layers["0"].attention.kernel and not m.layers["0"].feed_forward.kernel


def test_skip_mha_gives_the_attention_no_gradient_and_leaves_the_forward_unchanged():
    x, y = _data()
    ref_loss, ref = _grads(_model(), x, y)
    m = _model()
    comp = MeCeFO(MeCeFOConfig(**ONLY["skip"])).attach(m)
    with comp.degraded_mode():
        loss, got = _grads(m, x, y)
    mha = set(mha_parameter_names(m))
    assert mha == {f"layers.{i}.{n}" for i in range(2)
                   for n in ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wo.weight",
                             "attention_norm.weight")}
    assert torch.equal(loss, ref_loss)  # the forward pass is the same; only the backward skips the attention
    assert all(got[k] is None for k in mha)
    others = [k for k in ref if k not in mha]
    assert all(got[k] is not None for k in others)
    # the last block's FFN and the head see the same upstream gradient; earlier layers get the skip's approximation
    for k in ("output.weight", "norm.weight", "layers.1.feed_forward.w2.weight"):
        assert torch.equal(got[k], ref[k]), k
    assert not torch.allclose(got["tok_embeddings.weight"], ref["tok_embeddings.weight"])
    with ActivationMeter(m) as exact:
        lm_loss(m(x), y).backward()
    with comp.degraded_mode(), ActivationMeter(m) as skipped:
        lm_loss(m(x), y).backward()
    assert skipped.peak < exact.peak  # no attention activation kept


def test_recomputed_ffn_equals_stored_ffn_and_keeps_less():
    x, y = _data()
    ref_loss, ref = _grads(_model(), x, y)
    m = _model()
    comp = MeCeFO(MeCeFOConfig(**ONLY["recompute"])).attach(m)
    with comp.degraded_mode():
        loss, got = _grads(m, x, y)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    with ActivationMeter(m) as stored:
        lm_loss(m(x), y).backward()
    with comp.degraded_mode(), ActivationMeter(m) as recomputed:
        lm_loss(m(x), y).backward()
    assert recomputed.peak < stored.peak


def test_low_rank_weight_gradient_is_exact_at_full_rank_and_its_error_falls_as_rank_grows():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 16, generator=g, requires_grad=True)
    x = torch.randn(3, 40, 16, generator=g, requires_grad=True)
    gy = torch.randn(3, 40, 24, generator=g)
    y = torch.nn.functional.linear(x, w)
    y.backward(gy)
    exact_w, exact_x = w.grad.clone(), x.grad.clone()
    errors = []
    for r in (1, 2, 4, 8, 12, 16):
        w.grad = x.grad = None
        basis = low_rank_basis(w, r)
        assert basis.shape == (16, r)
        torch.testing.assert_close(basis.t() @ basis, torch.eye(r), atol=1e-5, rtol=0)
        out = LowRankLinear.apply(x, w, basis)
        assert torch.equal(out, y)  # the output is exact
        out.backward(gy)
        torch.testing.assert_close(x.grad, exact_x)  # so is the input gradient
        errors.append(float((w.grad - exact_w).norm() / exact_w.norm()))
    assert all(a >= b - 1e-6 for a, b in itertools.pairwise(errors)), errors
    assert errors[0] > 0.3 and errors[-1] < 1e-5, errors
    # the weight's rank is 16 here; the basis of a wide weight is completed past its rank, so rank = in is exact
    wide = torch.randn(8, 16, generator=g)
    assert low_rank_basis(wide, 100).shape == (16, 16)


def test_low_rank_in_the_model_reaches_every_ffn_weight_and_is_exact_at_full_rank():
    x, y = _data()
    _, ref = _grads(_model(), x, y)
    m = _model()
    comp = MeCeFO(MeCeFOConfig(**ONLY["low_rank"], rank=10_000)).attach(m)
    with comp.degraded_mode():
        _, got = _grads(m, x, y)
    assert sorted(comp.bases) == [f"layers.{i}.feed_forward.{w}.weight" for i in range(2) for w in ("w1", "w2", "w3")]
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-6)
    comp.detach()
    comp = MeCeFO(MeCeFOConfig(**ONLY["low_rank"], rank=2)).attach(m)
    with comp.degraded_mode():
        _, low = _grads(m, x, y)
    ffn = [k for k in ref if ".feed_forward." in k]
    assert all(not torch.allclose(low[k], ref[k]) for k in ffn if k.endswith(("w1.weight", "w3.weight", "w2.weight")))
    assert torch.equal(low["output.weight"], ref["output.weight"])  # upstream of every FFN weight gradient: exact


def test_bases_are_refreshed_every_tau_steps_and_travel_in_the_state():
    x, y = _data()
    m = _model()
    comp = MeCeFO(MeCeFOConfig(tau=3, rank=4)).attach(m)
    refreshes = []
    for step in range(7):
        comp.step = step
        with comp.degraded_mode():
            _grads(m, x, y)
        refreshes.append(comp.svd_refreshes)
        with torch.no_grad():
            m.layers["0"].feed_forward.w1.weight.mul_(1.01)  # the weights move between steps
    assert refreshes == [6, 6, 6, 12, 12, 12, 18]  # 6 FFN weights, at steps 0, 3, 6
    assert set(comp.refreshed.values()) == {6}
    state = comp.state_dict()
    other = MeCeFO(MeCeFOConfig(tau=3, rank=4)).attach(_model())
    other.load_state_dict(state)
    assert all(torch.equal(other.bases[k], v) for k, v in comp.bases.items()) and other.refreshed == comp.refreshed


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_composes_with_abft_protected_attention_in_the_same_slot():
    from trainguard.sdc.abft.protect import ABFTConfig, protect

    x, y = _data()
    plain = _model()
    plain.set_attention("explicit")
    handle_ref = protect(plain, ABFTConfig(enabled=True))
    ref_loss, ref = _grads(plain, x, y)
    m = _model()
    m.set_attention("explicit")
    handle = protect(m, ABFTConfig(enabled=True))
    comp = MeCeFO().attach(m)
    slot = m.layers["0"].attention.kernel
    assert slot.replacement() == "abft" and slot.names == ["abft", "mecefo-skip-mha"]
    loss, got = _grads(m, x, y)  # not degraded: bitwise the ABFT-protected model
    assert torch.equal(loss, ref_loss) and all(torch.equal(got[k], ref[k]) for k in ref)
    with comp.degraded_mode():
        loss, got = _grads(m, x, y)
    assert torch.equal(loss, ref_loss)  # the protected attention still computes the forward
    assert all(got[k] is None for k in mha_parameter_names(m))
    # and still protects it: a corrupted attention product in a degraded forward is detected and repaired
    fired = []

    def corrupt(layer, product, t):
        if layer == 1 and product == "scores" and not fired:
            fired.append(product)
            t = t.clone()
            t[0, 0, 3, 1] += 1e4
            return t
        return None

    remove = handle.add_fault_hook(corrupt)
    with comp.degraded_mode():
        loss_fault, got_fault = _grads(m, x, y)
    remove()
    total = handle.total()
    assert fired and total["detected"] >= 1 and total["corrected"] + total["recomputed"] >= 1
    torch.testing.assert_close(loss_fault, loss)
    assert all(got_fault[k] is None for k in mha_parameter_names(m))
    assert handle_ref.n_layers == handle.n_layers == 2


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_composes_with_activation_checkpointing_and_its_contexts(policy):
    x, y = _data()
    base = _model()
    comp_ref = MeCeFO(MeCeFOConfig(rank=4)).attach(base)
    comp_ref.step = 0
    with comp_ref.degraded_mode():
        ref_loss, ref = _grads(base, x, y)
    m = _model()
    apply_activation_checkpointing(m, policy, ["ffn", "attention"] if policy == "selective" else ("attention",))
    entered = {"forward": 0, "recompute": 0}

    @contextlib.contextmanager
    def count(kind):
        entered[kind] += 1
        yield

    add_checkpoint_context(m, lambda: (count("forward"), count("recompute")))
    comp = MeCeFO(MeCeFOConfig(rank=4)).attach(m)
    comp.step = 0
    with comp.degraded_mode():
        loss, got = _grads(m, x, y)
    assert torch.equal(loss, ref_loss)
    for k in ref:
        if ref[k] is None:
            assert got[k] is None, k
        else:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-7, msg=k)
    assert entered["forward"] > 0 and entered["recompute"] > 0
    # without activation checkpointing, MeCeFO's own FFN recomputation enters the model's contexts too
    m2 = _model()
    seen = {"n": 0}

    @contextlib.contextmanager
    def mark():
        seen["n"] += 1
        yield

    add_checkpoint_context(m2, lambda: (mark(), mark()))
    comp2 = MeCeFO(MeCeFOConfig(rank=4)).attach(m2)
    with comp2.degraded_mode():
        _grads(m2, x, y)
    assert seen["n"] == 2 * 2  # two FFNs, each entered in its forward and in its recompute
    _grads(m2, x, y)
    assert seen["n"] == 4  # not degraded: no checkpoint, no context


def test_bad_config_and_double_attach_are_one_line_errors():
    with pytest.raises(ConfigError, match="rank"):
        MeCeFOConfig(rank=0).validate()
    with pytest.raises(ConfigError, match="tau"):
        MeCeFOConfig(tau=0).validate()
    comp = MeCeFO().attach(_model())
    with pytest.raises(TrainguardError, match="already attached"):
        comp.attach(_model())
    with pytest.raises(TrainguardError, match="no attention"):
        MeCeFO().attach(torch.nn.Linear(2, 2))


# --------------------------------------------------------------------------------------------------
# the low-rank gradient's V1^T product deferred to the step's last degraded micro-batch


def _step_grads(model, comp, batches, defer: bool, fused: bool):
    """One step's accumulated gradient over ``batches``, all degraded, ``more`` on all but the last."""
    model.zero_grad(set_to_none=True)
    comp.cfg.defer_projection = defer
    comp.cfg.recompute_ffn = fused
    per_micro = []
    for j, (x, y) in enumerate(batches):
        before = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        with comp.degraded_mode(True, more=j < len(batches) - 1):
            lm_loss(model(x), y).backward()
        per_micro.append({n: p.grad is not None and (before[n] is None or not torch.equal(p.grad, before[n]))
                          for n, p in model.named_parameters()})
    assert not comp.pending.parts  # the last micro-batch took the pending sums
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, per_micro


@pytest.mark.parametrize("fused", [True, False], ids=["fused-recompute", "low-rank-mode"])
def test_deferred_projection_equals_the_per_micro_batch_one_and_the_exact_gradient_at_full_rank(fused):
    batches = [_data(seed=s, b=1) for s in range(3)]
    m = _model()
    comp = MeCeFO(MeCeFOConfig(skip_mha=False, rank=4)).attach(m)
    comp.refresh_bases(0)
    now, touched = _step_grads(m, comp, batches, defer=False, fused=fused)
    later, touched_later = _step_grads(m, comp, batches, defer=True, fused=fused)
    ffn = [n for n in now if ".feed_forward." in n]
    assert len(ffn) == 6 and now.keys() == later.keys()
    for n in now:
        torch.testing.assert_close(later[n], now[n], rtol=1e-5, atol=1e-7)
    # deferred: the FFN weights get their gradient only in the last micro-batch (the others keep their part)
    assert not any(touched_later[0][n] or touched_later[1][n] for n in ffn) and all(touched_later[2][n] for n in ffn)
    assert all(touched[0][n] for n in ffn)
    # at full rank the deferred low-rank gradient is the exact one
    exact = MeCeFO(MeCeFOConfig(skip_mha=False, low_rank=False)).attach(_model())
    ref, _ = _step_grads(exact.model, exact, batches, defer=False, fused=fused)
    full = MeCeFO(MeCeFOConfig(skip_mha=False, rank=10_000)).attach(_model())
    got, _ = _step_grads(full.model, full, batches, defer=True, fused=fused)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-4, atol=1e-6)


def test_on_the_elastic_engine_the_projection_waits_for_this_replicas_last_degraded_micro_batch():
    from types import SimpleNamespace

    from trainguard.train.parallel.base import MicroBatch
    from trainguard.train.parallel.elastic import SyncPlan

    nb = frozenset({"neighbor"})
    m = _model()
    comp = MeCeFO(MeCeFOConfig(rank=4, monitor_every=0)).attach(m)
    work = [MicroBatch(0, 8, 0.125, tags=nb), MicroBatch(1, 8, 0.125), MicroBatch(5, 8, 0.125, tags=nb)]
    strategy = SimpleNamespace(sync_plan=SyncPlan({3: work}), replica_id=3)
    trainer = SimpleNamespace(step_idx=0, model=m, strategy=strategy)
    data = {mb.index: _data(seed=mb.index, b=1) for mb in work}

    def run(mbs):
        rows = []
        for mb in mbs:
            m.zero_grad(set_to_none=True)
            with comp.micro_batch_context(trainer, mb):
                x, y = data[mb.index]
                (lm_loss(m(x), y) * mb.weight).backward()
            rows.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
        return rows

    rows = run(work)
    w1 = "layers.0.feed_forward.w1.weight"
    assert w1 not in rows[0] and w1 in rows[1] and w1 in rows[2]  # the pending part lands in slice 5's row
    comp.cfg.defer_projection = False
    ref = run(work)
    assert w1 in ref[0]
    for n in ref[2]:
        torch.testing.assert_close(sum(r[n] for r in rows if n in r), sum(r[n] for r in ref if n in r),
                                   rtol=1e-5, atol=1e-7)
    # a recovery appends extra degraded micro-batches after the planned ones: the last of those takes the sum
    comp.cfg.defer_projection = True
    extra = [MicroBatch(6, 8, 0.125, tags=nb), MicroBatch(7, 8, 0.125, tags=nb)]
    data.update({mb.index: _data(seed=mb.index, b=1) for mb in extra})
    strategy.sync_plan.work[3] = work + extra
    rows = run(work + extra)
    assert [w1 in r for r in rows] == [False, True, False, False, True] and not comp.pending.parts
