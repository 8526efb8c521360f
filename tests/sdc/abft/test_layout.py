"""One storage for q / k / v weights (stacked without a copy), and the subnormal-free threshold."""

import sys
import warnings

import pytest
import torch
from _hooks import OneShot

from trainguard.sdc.abft import ABFTConfig, protect, unprotect
from trainguard.sdc.abft import checksums as cks
from trainguard.sdc.abft.hf import build_hf_model
from trainguard.sdc.abft.layout import share_storage, stacked_rows

warnings.filterwarnings("ignore")


def _linears(seed=0, n=3, rows=6, cols=5):
    torch.manual_seed(seed)
    return [torch.nn.Linear(cols, rows) for _ in range(n)]


def test_shared_storage_stacks_without_copy_and_splits_gradients():
    lins = _linears()
    ref = torch.cat([lin.weight.detach() for lin in lins])
    params = [lin.weight for lin in lins]
    assert share_storage(lins)
    assert [lin.weight for lin in lins] == params            # same Parameter objects (optimizers keep them)
    w = stacked_rows(tuple(lin.weight for lin in lins))
    assert w.data_ptr() == lins[0].weight.data_ptr() and torch.equal(w, ref)   # a view, not a copy
    g = torch.randn(w.shape)
    (w * g).sum().backward()
    for i, lin in enumerate(lins):
        assert torch.equal(lin.weight.grad, g[6 * i:6 * (i + 1)])


def test_stacking_falls_back_to_a_copy_when_the_layout_moved():
    lins = _linears(1)
    share_storage(lins)
    lins[1].weight.data = lins[1].weight.data.clone()        # e.g. a tensor loaded into .data
    ws = tuple(lin.weight for lin in lins)
    w = stacked_rows(ws)
    assert torch.equal(w, torch.cat([x.detach() for x in ws]))
    w.sum().backward()
    assert all(torch.equal(x.grad, torch.ones_like(x)) for x in ws)


def test_stacking_falls_back_when_shared_weights_are_out_of_order():
    lins = _linears(4)
    share_storage(lins)
    a, b = lins[0].weight.data, lins[1].weight.data
    lins[0].weight.data, lins[1].weight.data = b, a          # one storage, but k before q
    ws = tuple(lin.weight for lin in lins)
    assert torch.equal(stacked_rows(ws), torch.cat([x.detach() for x in ws]))


def test_share_storage_refuses_mixed_dtypes_and_keeps_values():
    lins = _linears(2)
    lins[2].double()
    assert not share_storage(lins)
    lins = _linears(3)
    before = [lin.weight.detach().clone() for lin in lins]
    assert share_storage(lins)
    assert len({lin.weight.untyped_storage().data_ptr() for lin in lins}) == 1
    assert all(torch.equal(lin.weight, b) for lin, b in zip(lins, before))
    ptr = lins[0].weight.data_ptr()
    assert share_storage(lins) and lins[0].weight.data_ptr() == ptr   # already shared: nothing copied


def _step(model, x):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", ["bert", "gpt-neo"])
def test_protected_training_on_shared_storage_matches_copied_stacking(name, monkeypatch):
    """Same protected training steps with the weights shared (view) and stacked by copy: bitwise equal; after
    unprotect the original forward gives the same logits on the shared weights."""
    x = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    m1 = build_hf_model(name, "tiny", seed=0)
    h = protect(m1, ABFTConfig())
    assert h._shared, "q/k/v weights were not given one storage"
    s1 = _step(m1, x)
    with torch.no_grad():
        protected_logits = m1(input_ids=x).logits
        unprotect(m1)
        plain_logits = m1(input_ids=x).logits
    assert torch.allclose(protected_logits, plain_logits, atol=1e-5)
    # the module, not the function of the same name that the package exports
    monkeypatch.setattr(sys.modules["trainguard.sdc.abft.protect"], "share_storage", lambda linears: False)
    m2 = build_hf_model(name, "tiny", seed=0)
    protect(m2, ABFTConfig())
    s2 = _step(m2, x)
    assert all(torch.equal(s1[k], s2[k]) for k in s1)


def test_fault_in_q_of_shared_storage_model_is_corrected():
    x = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    model = build_hf_model("bert", "tiny", seed=0)
    ref = model(input_ids=x).logits.detach()
    h = protect(model, ABFTConfig())
    h.add_fault_hook(OneShot(1, "q", float("nan"), seed=3))
    out = model(input_ids=x).logits
    assert h.counters["AS"]["corrected"] == 1 and torch.allclose(out, ref, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_threshold_never_below_the_bound_and_avoids_subnormals(dtype):
    mag = torch.cat([torch.zeros(3), torch.full((3,), 1e-36), torch.rand(100) * 10.0 ** torch.randint(-30, 30, (100,))])
    for m, k in ((1, 1), (128, 64), (1024, 768), (10 ** 6, 4096)):
        s, f = cks.tolerance_scale(k, m, dtype, 2.0), cks.underflow_floor(m, dtype, 2.0)
        tol = cks.threshold(mag.clone(), s, f)
        exact = mag.double() * s + f
        assert bool((tol.double() >= exact * (1 - 1e-6)).all())
        tiny = torch.finfo(torch.float32).tiny
        if f < tiny:   # the fp32 case: both constants normal, at most 2^-20 looser above the floor term
            delta = min(2.0 ** -20, f / tiny)
            assert f / delta >= tiny
            big = mag.double() * s >= f / delta
            assert bool((tol.double()[big] <= exact[big] * (1 + 2.0 ** -19)).all())
            assert bool((tol.double()[~big] <= f * (1 + 1 / delta) * (1 + 1e-6)).all())


def test_all_zero_product_is_not_flagged():
    a, b = torch.zeros(2, 8, 5), torch.zeros(5, 7)
    assert not bool(cks.detect(a @ b, a, b).any())
