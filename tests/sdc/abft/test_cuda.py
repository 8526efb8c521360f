"""The CUDA path: the same protection on a GPU. The correction test also runs on the CPU, so that it cannot go
stale on a machine without a GPU; its CUDA cases and the campaign skip where no CUDA device is present (the CPU
CI). Run on a GPU machine with ``pytest tests/sdc/abft/test_cuda.py``."""

import pytest
import torch

from trainguard.sdc.abft import PRODUCTS, ABFTConfig, protect, unprotect
from trainguard.sdc.abft.campaign import build, run_campaign

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def _step(model, run, x):
    model.zero_grad(set_to_none=True)
    loss, logits = run(model, x)
    loss.backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["llama-tiny", "gpt2", "bert"])
@pytest.mark.parametrize("product", PRODUCTS)
def test_nan_corrected(name, product, device):
    model, run = build(name, seed=0)
    model.to(device)
    x = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
    ref = _step(model, run, x)
    handle = protect(model, ABFTConfig(backward=True))
    clean = _step(model, run, x)
    assert handle.total()["detected"] == 0  # no false positive on the GPU's GEMMs
    remove = handle.add_fault_hook(lambda lyr, p, t: t.view(-1).__setitem__(t.numel() // 2, float("nan"))
                                   if lyr == 0 and p == product else None)
    handle.reset_counters()
    out = _step(model, run, x)
    tot = handle.total()
    assert tot["detected"] >= 1 and tot["corrected"] + tot["recomputed"] == tot["detected"]
    for a, b in ((out[0], clean[0]), *((out[1][k], clean[1][k]) for k in clean[1])):
        assert torch.isfinite(a).all() and torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    remove()  # (the hook is the model's, not the protection's: it would fire in the plain kernels too)
    unprotect(model)
    assert torch.allclose(_step(model, run, x)[0], ref[0], atol=1e-5, rtol=1e-5)  # the plain kernels again


@needs_cuda
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_campaign_on_cuda(dtype):
    r = run_campaign("gpt2", "inf", "any", trials=6, seed=1, seq_len=16, dtype=dtype, progress=False, device="cuda")
    assert r.device == "cuda" and r.corrected == r.trials == 6 and r.false_positives == 0 and r.silent == 0
