"""Protected attention on trainguard's LLaMA: equality, injection in forward and backward, frequencies."""

import zlib

import pytest
import torch
from _hooks import OneShot

from trainguard.errors import ShapeError, TrainguardError
from trainguard.models import build_model, lm_loss
from trainguard.sdc.abft import BACKWARD_PRODUCTS, PRODUCTS, SECTIONS, ABFTConfig, protect, section_due, unprotect
from trainguard.sdc.abft.attention import linear_proj, protected_attention

VALUES = {"inf": float("inf"), "nan": float("nan"), "ninf": 1e20}


def _model(**kw):
    m = build_model("llama-tiny", seed=0, **kw)
    x = torch.randint(0, m.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    return m, x


def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def _step(m, x):
    m.zero_grad(set_to_none=True)
    out = m(x)
    lm_loss(out, x).backward()
    return out.detach(), _grads(m)


def test_api_constants():
    assert SECTIONS == ("AS", "CL", "O")
    assert PRODUCTS == ("q", "k", "v", "scores", "context", "output")
    assert set(BACKWARD_PRODUCTS) == set(PRODUCTS)


def test_clean_forward_matches_and_unprotect_is_bitwise():
    m, x = _model()
    ref = m(x)
    h = protect(m, ABFTConfig())
    out = m(x)
    assert torch.allclose(out, ref, atol=1e-5)
    assert h.total()["detected"] == 0
    with pytest.raises(TrainguardError):
        protect(m)
    unprotect(m)
    assert all(not a.kernel for a in m.attention_modules())
    assert torch.equal(m(x), ref)


@pytest.mark.parametrize("product", PRODUCTS)
@pytest.mark.parametrize("kind", list(VALUES))
def test_forward_injection_corrected_in_training(product, kind):
    m, x = _model()
    h = protect(m, ABFTConfig(backward=True))
    ref_out, ref_g = _step(m, x)
    seed = zlib.crc32(f"{product}-{kind}".encode()) % 1000  # (hash() of a str changes with PYTHONHASHSEED)
    h.add_fault_hook(OneShot(1, product, VALUES[kind], seed=seed))
    out, g = _step(m, x)
    tot = h.total()
    assert tot["detected"] == 1 and tot["corrected"] == 1 and tot["uncorrectable"] == 0
    assert torch.allclose(out, ref_out, atol=1e-4)
    for n in ref_g:
        assert torch.allclose(g[n], ref_g[n], atol=1e-4, rtol=1e-3), n
    ev = [e for e in h.events if e["kind"] == "corrected"]
    assert ev and ev[0]["product"] == product and ev[0]["layer"] == 1


@pytest.mark.parametrize("product", [p for pair in BACKWARD_PRODUCTS.values() for p in pair])
def test_backward_injection_corrected(product):
    m, x = _model()
    h = protect(m, ABFTConfig(backward=True))
    _, ref_g = _step(m, x)
    h.add_fault_hook(OneShot(0, product, float("nan")))
    _, g = _step(m, x)
    assert h.total()["corrected"] == 1, product
    for n in ref_g:
        assert torch.allclose(g[n], ref_g[n], atol=1e-4, rtol=1e-3), (product, n)


def test_unchecked_baseline_lets_the_fault_through():
    m, x = _model()
    h = protect(m, ABFTConfig(check=False))
    seen = []
    h.add_fault_hook(lambda l, p, t: seen.append(p))
    h.add_fault_hook(OneShot(0, "v", float("nan")))
    out = m(x)
    assert set(PRODUCTS) <= set(seen)
    assert torch.isnan(out).any()
    assert h.total()["detected"] == 0


def test_2d_pattern_recomputed():
    m, x = _model()
    ref = m(x)
    h = protect(m)

    def hook(layer, product, t):
        if layer == 0 and product == "context":
            t[0, 0, 2:6, 1:5] = float("nan")

    h.add_fault_hook(hook)
    out = m(x)
    assert torch.allclose(out, ref, atol=1e-5)
    c = h.counters["CL"]
    assert c["uncorrectable"] == 1 and c["recomputed"] == 1


def test_detect_only():
    m, x = _model()
    h = protect(m, ABFTConfig(correct=False))
    h.add_fault_hook(OneShot(0, "output", float("inf")))
    out = m(x)
    first = [e for e in h.events if e["layer"] == 0]
    assert [(e["product"], e["kind"]) for e in first] == [("output", "detected"), ("output", "escalated")]
    assert h.total()["corrected"] == 0 and h.escalations[0]["product"] == "output"  # the step guard redoes it
    assert not torch.isfinite(out).all()


def test_frequencies_by_step():
    assert [section_due(i, 0.5) for i in range(4)] == [False, True, False, True]
    assert all(section_due(i, 1.0) for i in range(5)) and not any(section_due(i, 0.0) for i in range(5))
    assert sum(section_due(i, 0.3) for i in range(100)) == 30
    m, x = _model()
    h = protect(m, ABFTConfig(frequencies=(1.0, 0.0, 0.5)))
    hits = []
    for step in range(4):
        h.set_step(step)
        h.reset_counters()
        removers = [h.add_fault_hook(OneShot(0, p, 1e3)) for p in ("q", "v", "output")]
        m(x)
        for r in removers:
            r()
        ev = [e for e in h.events if e["layer"] == 0 and e["kind"] == "detected"]
        hits.append(tuple(sum(e["section"] == s for e in ev) for s in SECTIONS))
    assert hits == [(1, 0, 0), (1, 0, 1), (1, 0, 0), (1, 0, 1)]
    with pytest.raises(TrainguardError):
        protect(build_model("llama-tiny"), ABFTConfig(frequencies=(1.0, 2.0, 1.0)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_no_false_positives_and_correction(dtype):
    m, x = _model()
    m = m.to(dtype)
    h = protect(m, ABFTConfig(backward=True))
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    for step in range(8):  # 2 layers x 12 products x 8 steps = 192 clean checks, with weights moving
        h.set_step(step)
        xs = torch.randint(0, m.cfg.vocab_size, (2, 16 + 4 * step), generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        lm_loss(m(xs), xs).backward()
        opt.step()
    assert h.total()["detected"] == 0, h.events[:3]
    h.add_fault_hook(OneShot(1, "scores", float("inf")))
    out = m(x)
    assert torch.isfinite(out).all() and h.total()["corrected"] == 1


def test_autocast_bf16_clean():
    m, x = _model()
    h = protect(m, ABFTConfig(backward=True))
    for step in range(4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        lm_loss(out, x).backward()
    assert h.total()["detected"] == 0


def test_shapes_refused_not_skipped():
    m, _ = _model()
    att = m.attention_modules()[0]
    h = protect(m)
    with pytest.raises(ShapeError):
        protected_attention(h, 0, torch.randn(2, 8, 64), linear_proj(att.wq), linear_proj(att.wk),
                            linear_proj(att.wv), linear_proj(att.wo), n_heads=4, head_dim=32, scale=1.0)
    with pytest.raises(ShapeError):
        protected_attention(h, 0, torch.randn(8, 128), linear_proj(att.wq), linear_proj(att.wk),
                            linear_proj(att.wv), linear_proj(att.wo), n_heads=4, head_dim=32, scale=1.0)


def test_unsupported_model_raises():
    with pytest.raises(TrainguardError):
        protect(torch.nn.Linear(3, 3))
