"""AdamW groups, warmup + cosine schedule, gradient clipping."""

import itertools
import math

import torch

from trainguard.config import load_config
from trainguard.models import build_model
from trainguard.train.optim import WarmupCosine, build_optimizer, build_scheduler, clip_gradients, param_groups


def test_no_weight_decay_on_1d_params():
    model = build_model("llama-tiny")
    groups = param_groups(model, 0.1)
    decay, no_decay = groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    norm_weight = model.layers["0"].attention_norm.weight
    assert any(p is norm_weight for p in no_decay["params"])


def test_warmup_then_cosine_to_min():
    f = WarmupCosine(total_steps=100, warmup_steps=10, min_ratio=0.1)
    assert f(0) == 0.1 and abs(f(9) - 1.0) < 1e-12
    assert abs(f(10) - 1.0) < 1e-12
    assert abs(f(55) - (0.1 + 0.9 * 0.5)) < 1e-12  # half way through the cosine
    assert abs(f(100) - 0.1) < 1e-12 and abs(f(500) - 0.1) < 1e-12
    vals = [f(s) for s in range(10, 101)]
    assert all(a >= b for a, b in itertools.pairwise(vals))


def test_scheduler_drives_optimizer_lr():
    cfg = load_config(None, ["--train.steps", "20", "--train.lr", "1e-2", "--train.warmup_ratio", "0.1"])
    model = build_model("llama-tiny", dim=32, n_heads=2, ffn_hidden=64)
    opt = build_optimizer(model, cfg.train)
    sched = build_scheduler(opt, cfg.train)
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert math.isclose(lrs[0], 1e-2 / 2) and math.isclose(max(lrs), 1e-2)
    assert lrs[-1] < 0.2e-2 and all(g["lr"] == opt.param_groups[0]["lr"] for g in opt.param_groups)


def test_clip_gradients():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    norm = clip_gradients([p], 1.0)
    assert math.isclose(float(norm), 5.0, rel_tol=1e-6)
    assert math.isclose(float(p.grad.norm()), 1.0, rel_tol=1e-5)
    p.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    assert math.isclose(float(clip_gradients([p], 0.0)), 5.0, rel_tol=1e-6)
    assert torch.equal(p.grad, torch.tensor([3.0, 4.0, 0.0, 0.0]))  # 0 disables clipping


def test_squared_norm_and_scale_gradients_match_the_per_tensor_forms():
    from trainguard.train.optim import scale_gradients, squared_norm

    torch.manual_seed(0)
    grads = [torch.randn(1000), torch.randn(33, 7), torch.randn(1).double(), torch.randn(64).bfloat16()]
    want = sum(float(g.double().pow(2).sum()) for g in grads)
    got = squared_norm(grads)
    assert got.dtype == torch.float32 and got.dim() == 0 and math.isclose(float(got), want, rel_tol=1e-5)
    assert float(squared_norm([])) == 0.0
    coef = torch.tensor(0.37)
    expect = [g * coef.to(g.dtype) if g.dtype != torch.bfloat16 else None for g in grads]
    scale_gradients(grads, coef)
    assert all(torch.equal(g, e) for g, e in zip(grads, expect) if e is not None)  # fp32 / fp64: bitwise
    assert grads[3].dtype == torch.bfloat16
    scale_gradients([], coef)  # nothing to scale: no error
