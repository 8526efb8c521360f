"""Fused QKV GEMM / check, the fused softmax and head split, directly timed corrections, bench keys."""

import math
import warnings

import pytest
import torch
from _hooks import OneShot

from trainguard.sdc.abft import SECTIONS, ABFTConfig, protect, unprotect
from trainguard.sdc.abft import checksums as cks
from trainguard.sdc.abft.attention import _HeadsQKV, _ScaledSoftmax, causal_bias
from trainguard.sdc.abft.hf import build_hf_model

warnings.filterwarnings("ignore")


def test_fused_check_splits_into_per_product_checks():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 16, 24, generator=g), torch.randn(24, 30, generator=g), torch.randn(30, generator=g)
    c = torch.matmul(x, w) + b
    ref = c.clone()
    c[1, 5, 17] = float("nan")          # in the second block (columns 10..20)
    chk = cks.detect(c, x, w, b)
    subs = [chk.columns(lo, lo + 10) for lo in (0, 10, 20)]
    assert [bool(s.any()) for s in subs] == [False, True, False]
    out = cks.resolve(subs[1])
    assert out.kind == "corrected" and (out.fixes[0].batch, out.fixes[0].row, out.fixes[0].col) == ((1,), 5, 7)
    assert torch.allclose(c, ref, atol=1e-5)   # corrected in place through the column-block view


def test_context_check_exact_magnitude_for_nonnegative_b():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(2, 3, 20, 20, generator=g), -1)
    v = torch.randn(2, 3, 20, 8, generator=g)
    ctx = torch.matmul(p, v)
    chk = cks.detect(ctx.transpose(-1, -2), v.transpose(-1, -2), p.transpose(-1, -2), b_nonneg=True)
    exact = torch.matmul(v.abs().sum(-1).unsqueeze(-2), p.transpose(-1, -2))
    assert torch.allclose(chk.mag, exact, rtol=1e-5) and not bool(chk.any())
    ctx[1, 2, 4, 3] = 1e3
    assert bool(cks.detect(ctx.transpose(-1, -2), v.transpose(-1, -2), p.transpose(-1, -2), b_nonneg=True).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_scaled_softmax_matches_reference(dtype, masked):
    g = torch.Generator().manual_seed(2)
    s = torch.randn(2, 3, 9, 9, generator=g).to(dtype).requires_grad_()
    bias = causal_bias(9, 9, dtype, s.device) if masked else None
    p = _ScaledSoftmax.apply(s, bias, 0.3)
    s2 = s.detach().clone().requires_grad_()
    logits = s2 * 0.3 + bias if masked else s2 * 0.3
    ref = torch.softmax(logits, -1, dtype=torch.float32)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the logits here, two there
    assert p.dtype == torch.float32 and torch.allclose(p, ref, atol=tol)
    gout = torch.randn(p.shape, generator=g)
    (p * gout).sum().backward()
    (ref * gout).sum().backward()
    assert s.grad.dtype == dtype and torch.allclose(s.grad.float(), s2.grad.float(), atol=tol * 10)


def test_heads_split_gradient():
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 5, 3 * 4 * 6, generator=g, requires_grad=True)
    q, k, v = _HeadsQKV.apply(qkv, 4, 6)
    assert q.shape == (2, 4, 5, 6) and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    ref = [t.view(2, 5, 4, 6).transpose(1, 2) for t in qkv.detach().split(24, -1)]
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), ref))
    w = [torch.randn(q.shape, generator=g) for _ in range(3)]
    sum((t * wi).sum() for t, wi in zip((q, k, v), w)).backward()
    qkv2 = qkv.detach().clone().requires_grad_()
    parts = [t.view(2, 5, 4, 6).transpose(1, 2) for t in qkv2.split(24, -1)]
    sum((t * wi).sum() for t, wi in zip(parts, w)).backward()
    assert torch.allclose(qkv.grad, qkv2.grad)


def _inputs(t=20):
    return torch.randint(3, 256, (2, t), generator=torch.Generator().manual_seed(1))


def _step(m, x):
    m.zero_grad(set_to_none=True)
    out = m(input_ids=x).logits
    out.float().logsumexp(-1).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["gpt2", "bert"])
@pytest.mark.parametrize("product", ["grad_q_input", "grad_k_input", "grad_v_input", "grad_q_weight",
                                     "grad_k_weight", "grad_v_weight", "grad_scores_k"])
def test_fused_projection_backward_products_corrected(name, product):
    m = build_hf_model(name, "tiny", seed=0)
    x = _inputs()
    h = protect(m, ABFTConfig(backward=True))
    ref_out, ref_g = _step(m, x)
    h.add_fault_hook(OneShot(1, product, float("nan"), seed=5))
    out, grads = _step(m, x)
    tot = h.total()
    assert tot["detected"] == 1 and tot["corrected"] == 1, (product, h.events)
    for n in ref_g:
        assert torch.allclose(grads[n], ref_g[n], atol=1e-4, rtol=1e-3), (product, n)


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_fused_projection_partial_frequencies(name):
    """AS due alone checks q|k only, CL alone v only (the due column block of the fused check)."""
    m = build_hf_model(name, "tiny", seed=0)
    x = _inputs()
    h = protect(m, ABFTConfig(frequencies=(1.0, 0.5, 0.0)))
    hits = []
    for step in range(4):
        h.set_step(step)
        h.reset_counters()
        removers = [h.add_fault_hook(OneShot(0, p, 1e3, seed=step)) for p in ("k", "v")]
        m(input_ids=x)
        for r in removers:
            r()
        ev = [e for e in h.events if e["layer"] == 0 and e["kind"] == "detected"]
        hits.append(tuple(sorted(e["product"] for e in ev)))
    assert hits == [("k",), ("k", "v"), ("k",), ("k", "v")]
    assert all(h.counters[s]["detected"] == 0 for s in SECTIONS[2:])


def test_hooks_on_fused_products_see_contiguous_tensors():
    m = build_hf_model("gpt2", "tiny", seed=0)
    h = protect(m)
    seen = {}

    def hook(layer, product, t):
        if layer == 0:
            seen[product] = (tuple(t.shape), t.is_contiguous())

    h.add_fault_hook(hook)
    m(input_ids=_inputs())
    d = m.config.n_embd
    assert seen["q"] == seen["k"] == seen["v"] == ((2, 20, d), True)


def test_correction_seconds_timed_only_on_the_slow_path():
    m = build_hf_model("gpt2", "tiny", seed=0)
    h = protect(m)
    x = _inputs()
    m(input_ids=x)
    assert h.correction_seconds == 0.0
    h.add_fault_hook(OneShot(1, "context", float("nan")))
    m(input_ids=x)
    assert h.total()["corrected"] == 1 and h.correction_seconds > 0.0
    h.reset_counters()
    assert h.correction_seconds == 0.0


def test_bench_recovery_is_measured_directly():
    from trainguard.sdc.abft.bench import bench

    r = bench("gpt2", batch=2, seq_len=16, rounds=1, steps=1, size="tiny", backward_too=False, progress=False)
    for key in ("attention_overhead", "train_step_overhead", "attention_overhead_ratio_of_medians",
                "train_step_overhead_ratio_of_medians", "correction_cost_vs_step",
                "checkpoint_restore_cost_vs_step", "recovery_speedup", "correction_cost_vs_step_from_step_medians"):
        assert key in r and math.isfinite(r[key]), key
    assert r["faults_corrected_in_recovery_runs"] == r["recovery_faults_injected"] == 6
    assert len(r["correction_s"]["all"]) == 6 and r["correction_s"]["median"] > 0
    # checkpoint/restore: the trainer's DCP load plus the lost steps; ABFT: the correction plus its detection
    t_plain, corr = r["step_s"]["plain"], r["correction_s"]["median"]
    assert r["checkpoint_restore_s"] == pytest.approx(r["checkpoint_load_s"] + r["lost_steps_per_fault"] * t_plain)
    assert r["recovery_speedup_correction_only"] == pytest.approx(r["checkpoint_restore_s"] / corr)
    assert r["recovery_speedup"] == pytest.approx(r["checkpoint_restore_s"] / (corr + r["detection_cost_per_step"] * t_plain))
    be = r["break_even_faults_per_step"]
    assert be == pytest.approx(r["detection_cost_per_step"] * t_plain / (r["checkpoint_restore_s"] - corr))
    curve = r["net_time_saved"]  # negative below the break-even rate, positive above it
    for rate, saved in zip(curve["faults_per_step"], curve["fraction_of_step"]):
        assert (saved > 0) == (rate > be) or abs(rate - be) < 1e-12
    assert set(r["section_check_cost_s"]) == set(SECTIONS)
    # The paired overhead is the median of the same-slot ratios, inside its own bootstrap interval.
    pairs = r["train_step_overhead_pair_ratios"]
    assert len(pairs) == r["step_pairs"] == 1
    assert r["train_step_overhead"] == pytest.approx(pairs[0] - 1)
    lo, hi = r["attention_overhead_ci95"]
    assert lo <= r["attention_overhead"] <= hi


def test_median_ci95_brackets_the_median_and_narrows_with_data():
    import random

    from trainguard.sdc.abft.bench import median_ci95

    rng = random.Random(1)
    small = [1.02 + rng.gauss(0, 0.05) for _ in range(10)]
    large = [1.02 + rng.gauss(0, 0.05) for _ in range(400)]
    lo_s, hi_s = median_ci95(small)
    lo_l, hi_l = median_ci95(large)
    assert lo_s <= sorted(small)[5] and sorted(small)[4] <= hi_s
    assert lo_l < 1.02 < hi_l and (hi_l - lo_l) < (hi_s - lo_s)
    assert median_ci95(small) == (lo_s, hi_s)  # seeded
    assert median_ci95([1.5]) == (1.5, 1.5)


@pytest.mark.parametrize("name", ["bert", "gpt-neo"])
@pytest.mark.parametrize("backward", [False, True])
def test_stacked_qkv_weights_give_the_unprotected_gradients(name, backward):
    """Linear q / k / v (stacked into one GEMM, its gradient split back into the three weights), with and
    without backward checks: every parameter gradient as without protection."""
    m = build_hf_model(name, "tiny", seed=0)
    x = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0))

    def grads():
        m.zero_grad(set_to_none=True)
        m(input_ids=x, labels=x).loss.backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    ref = grads()
    h = protect(m, ABFTConfig(backward=backward))
    got = grads()
    unprotect(m)
    assert got.keys() == ref.keys()
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-4, atol=1e-6)
    assert h.total()["detected"] == 0
