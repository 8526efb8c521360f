"""The backward checks' one-pass statistics (``_gradient_stats``, ``_b_side``): equal to the direct formulas
in any chunking, and faults in every backward product still detected and corrected through them."""

import warnings

import pytest
import torch
from _hooks import OneShot

from trainguard.sdc.abft import BACKWARD_PRODUCTS, ABFTConfig, protect
from trainguard.sdc.abft import attention as att
from trainguard.sdc.abft import checksums as cks
from trainguard.sdc.abft.hf import build_hf_model

warnings.filterwarnings("ignore")

BACKWARD = [p for pair in BACKWARD_PRODUCTS.values() for p in pair]


def _operands(flat: bool, nonneg: bool, dtype: torch.dtype):
    g = torch.Generator().manual_seed(3)
    if flat:   # a weight node: g (B, T, n), A (B, T, k); dB sums over every row
        gg = torch.randn(3, 10, 14, generator=g).to(dtype)
        a = torch.randn(3, 10, 6, generator=g).to(dtype)
        return gg, gg.reshape(-1, 14), a.reshape(-1, 6)
    gg = torch.randn(2, 3, 10, 14, generator=g).to(dtype)
    a = torch.randn(2, 3, 10, 6, generator=g)
    a = (torch.softmax(a, -1) if nonneg else a).to(dtype)
    return gg, gg, a


@pytest.mark.parametrize("flat,nonneg", [(True, False), (False, False), (False, True)])
@pytest.mark.parametrize("chunk", [1, 1 << 20])       # one slice per chunk, or everything in one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_stats_equal_direct_formulas(monkeypatch, flat, nonneg, chunk, dtype):
    monkeypatch.setattr(att, "STATS_CHUNK_BYTES", chunk)
    gg, g2, a2 = _operands(flat, nonneg, dtype)
    st = att._gradient_stats(gg, g2, a2, nonneg)
    g32, gg32, a32 = g2.float(), gg.float(), a2.float()
    tol = dict(rtol=1e-5, atol=1e-5)
    assert torch.allclose(st.col_g, gg32.sum(-2, keepdim=True), **tol)
    assert torch.allclose(st.g_rn, torch.linalg.vector_norm(gg32, dim=-1).sum(-1)[..., None, None], **tol)
    rows = a32.sum(-1).unsqueeze(-2)                     # (A 1)^T, the dB check's input checksum
    assert torch.allclose(st.a_rows, rows, **tol)
    assert torch.allclose(st.exp_b, torch.matmul(rows, g32), **tol)
    if nonneg:   # exact (|A| 1)^T |g|, never above the Cauchy-Schwarz bound it replaces
        exact = torch.matmul(a32.abs().sum(-1).unsqueeze(-2), g32.abs())
        assert torch.allclose(st.mag_b, exact, **tol)
        cs = cks.row_norm_sum(a32.transpose(-1, -2)) * cks.col_norms(g32)
        assert bool((st.mag_b <= cs * (1 + 1e-5)).all())
        assert st.a_rn is None and st.g_cn is None
    else:
        assert torch.allclose(st.a_rn, cks.row_norm_sum(a32.transpose(-1, -2)), **tol)
        assert torch.allclose(st.g_cn, cks.col_norms(g32), **tol)
        assert st.mag_b is None


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("chunk", [1, 1 << 20])
def test_b_side_equals_direct_formulas(monkeypatch, batched, transposed, chunk):
    monkeypatch.setattr(att, "STATS_CHUNK_BYTES", chunk)
    g = torch.Generator().manual_seed(4)
    shape = (2, 3, 9, 5) if batched else (9, 5)
    bt = torch.randn(*shape, generator=g)
    if transposed:   # a transposed view (V^T in the context node): the norms read it in its own layout
        bt = torch.randn(*shape[:-2], 5, 9, generator=g).transpose(-1, -2)
    col_g = torch.randn(*(shape[:-2] if batched else (4,)), 1, 9, generator=g)
    exp, cn = att._b_side(col_g, bt)
    assert torch.allclose(exp, torch.matmul(col_g, bt), rtol=1e-5, atol=1e-5)
    assert torch.allclose(cn, cks.col_norms(bt), rtol=1e-5, atol=1e-6)


def _inputs():
    return torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(2))


def _step(m, x):
    m.zero_grad(set_to_none=True)
    m(input_ids=x, labels=x).loss.backward()
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["gpt2", "bert"])
@pytest.mark.parametrize("value", [float("nan"), 1e3])
def test_backward_faults_corrected_through_chunked_stats(monkeypatch, name, value):
    """Every backward product of a layer, struck once with NaN or with a finite 1e3, while the statistics
    are taken in many small chunks: detected, corrected, and the gradients those of a clean step."""
    monkeypatch.setattr(att, "STATS_CHUNK_BYTES", 512)
    m = build_hf_model(name, "tiny", seed=0)
    x = _inputs()
    h = protect(m, ABFTConfig(backward=True))
    ref = _step(m, x)
    assert h.total()["detected"] == 0                 # no false alarm on the clean step
    for i, product in enumerate(BACKWARD):
        h.reset_counters()
        remove = h.add_fault_hook(OneShot(1, product, value, seed=i))
        grads = _step(m, x)
        remove()
        tot = h.total()
        # (a finite error EEC-ABFT cannot place is recomputed instead: also repaired here, no escalation)
        assert tot["detected"] >= 1 and tot["escalated"] == 0, (product, h.events[-3:])
        assert tot["corrected"] + tot["recomputed"] == tot["detected"], product
        for n in ref:
            assert torch.allclose(grads[n], ref[n], atol=1e-4, rtol=1e-3), (product, n)


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_backward_checks_of_a_partly_due_fused_projection(name):
    """Only CL due: the fused QKV weight gradient is checked on its v block alone (the cut statistics); a fault
    there is corrected, one in the q block (not due) is not looked at."""
    m = build_hf_model(name, "tiny", seed=0)
    x = _inputs()
    h = protect(m, ABFTConfig(backward=True, frequencies=(0.0, 1.0, 0.0)))
    ref = _step(m, x)
    remove = h.add_fault_hook(OneShot(1, "grad_v_weight", 1e3, seed=1))
    grads = _step(m, x)
    remove()
    cl = h.counters["CL"]
    assert cl["detected"] == 1 and cl["corrected"] + cl["recomputed"] == 1 and cl["escalated"] == 0
    for n in ref:
        assert torch.allclose(grads[n], ref[n], atol=1e-4, rtol=1e-3), n
    h.reset_counters()
    fault = OneShot(1, "grad_q_weight", 1e3, seed=1)
    remove = h.add_fault_hook(fault)
    grads = _step(m, x)
    remove()
    assert h.total()["detected"] == 0
    # the fault did strike the q block, and went through unrepaired: that block was not looked at
    assert fault.done and not all(torch.allclose(grads[n], ref[n], atol=1e-4, rtol=1e-3) for n in ref)
