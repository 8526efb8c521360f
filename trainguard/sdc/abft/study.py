"""Fault-propagation study (ATTNChecker Sec. 3, Tables 2 and 4) on trainguard's LLaMA model.

For each attention product (q, k, v, scores = AS, context = CL, output = O) and fault type (INF, NaN,
near-INF), one element of that product is corrupted in one layer of an *unprotected* forward pass; the
pattern of abnormal values (non-finite, or |x| > 1e10) is then read off every downstream matrix of
that layer: Q, K, V, AS, AP (softmax probabilities), CL, O. Patterns: ``0D`` (one element), ``1R``
(one row), ``1C`` (one column), ``2D`` (several rows and columns), ``-`` (none), reported with the
abnormal value types seen (INF / NaN / nINF). Matrices are the per-(batch, head) 2-D slices the paper
uses (rows = query tokens). The non-trainable probability is the fraction of injections after which a
training step's loss is NaN/INF or any parameter is non-finite. Relies on torch and the product hooks
of ``trainguard.models.llama.Attention``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from trainguard.errors import ConfigError
from trainguard.faults.bits import FaultModel

PRODUCTS = ("q", "k", "v", "scores", "context", "output")
OBSERVED = ("Q", "K", "V", "AS", "AP", "CL", "O")
_NAME = {"q": "Q", "k": "K", "v": "V", "scores": "AS", "context": "CL", "output": "O"}
NEAR_INF = 1e10


def pattern(t: torch.Tensor, heads: int | None) -> tuple[str, set[str]]:
    """Worst pattern of abnormal elements over the 2-D (rows, cols) slices of ``t``."""
    x = t.detach().float()
    if x.dim() == 3 and heads:  # (B, T, D): split heads so a slice is (T, head_dim)
        b, s, d = x.shape
        x = x.view(b, s, heads, d // heads).transpose(1, 2)
    x = x.reshape(-1, x.shape[-2], x.shape[-1])
    nan, inf = torch.isnan(x), torch.isinf(x)
    big = torch.isfinite(x) & (x.abs() > NEAR_INF)
    bad = nan | inf | big
    kinds = {k for k, m in (("NaN", nan), ("INF", inf), ("nINF", big)) if bool(m.any())}
    worst = "-"
    rank = {"-": 0, "0D": 1, "1R": 2, "1C": 2, "2D": 3}
    for m in bad:
        n = int(m.sum())
        if n == 0:
            continue
        rows, cols = int(m.any(1).sum()), int(m.any(0).sum())
        p = "0D" if n == 1 else "1R" if rows == 1 else "1C" if cols == 1 else "2D"
        if rank[p] > rank[worst] or (rank[p] == rank[worst] == 2 and p != worst):
            worst = p if rank[p] > rank[worst] else "1R+1C"
    return worst, kinds


@dataclass
class StudyResult:
    model: str
    trials: int
    table: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)  # fault -> product -> observed -> pattern
    non_trainable: dict[str, dict[str, float]] = field(default_factory=dict)  # fault -> product -> probability

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "trials": self.trials, "table": self.table, "non_trainable": self.non_trainable}


def run_study(model_name: str = "llama-tiny", trials: int = 10, seed: int = 0, seq_len: int = 32, batch: int = 2,
              faults: tuple[str, ...] = ("inf", "nan", "near-inf"), progress: bool = True) -> StudyResult:
    from trainguard.models import build_model, lm_loss

    if not model_name.startswith("llama"):
        raise ConfigError(f"the propagation study runs on trainguard's LLaMA presets, not {model_name!r}")
    if trials < 1:
        raise ConfigError(f"--trials must be >= 1, got {trials}")
    model = build_model(model_name, seed=seed, attention="explicit")
    heads = model.cfg.n_heads
    if seq_len > model.cfg.max_seq_len:
        raise ConfigError(f"--seq-len {seq_len} exceeds max_seq_len {model.cfg.max_seq_len}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (batch, seq_len + 1), generator=g)
    inp, tgt = x[:, :-1], x[:, 1:]
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    result = StudyResult(model_name, trials)
    from trainguard.utils import TaskBar

    bar = TaskBar(progress, "study attention", len(faults) * len(PRODUCTS) * trials)
    try:
        for fault in faults:
            fm = FaultModel(fault)
            result.table[fault], result.non_trainable[fault] = {}, {}
            for product in PRODUCTS:
                seen: dict[str, tuple[str, set[str]]] = {}
                bad_runs = 0
                for _ in range(trials):
                    model.load_state_dict(snapshot)
                    layer = int(torch.randint(model.cfg.n_layers, (1,), generator=g))
                    att = model.layers[str(layer)].attention
                    captured: dict[str, torch.Tensor] = {}
                    fired = {"done": False}

                    def hook(mod, name, t, fired=fired, captured=captured, product=product, fm=fm):
                        if name == product and not fired["done"]:
                            fired["done"] = True
                            t = t.clone()
                            with torch.no_grad():
                                fm.apply(t, int(torch.randint(t.numel(), (1,), generator=g)), g)
                        captured[_NAME[name]] = t.detach()
                        if name == "scores":
                            s = t.shape[-1]
                            mask = torch.ones(s, s, dtype=torch.bool).triu(1)
                            captured["AP"] = torch.softmax(t.detach().masked_fill(mask, float("-inf")), -1)
                        return t if name == product else None

                    remove = att.add_product_hook(hook)
                    model.zero_grad(set_to_none=True)
                    loss = lm_loss(model(inp), tgt)
                    loss.backward()
                    remove()
                    with torch.no_grad():
                        for p in model.parameters():
                            if p.grad is not None:
                                p.add_(p.grad, alpha=-1e-3)
                    nontrainable = not math.isfinite(float(loss.detach())) or any(
                        not bool(torch.isfinite(p).all()) for p in model.parameters())
                    bad_runs += nontrainable
                    for obs in OBSERVED:
                        if obs not in captured:
                            continue
                        # Q, K, V, O are (B, T, D) projections: split heads; AS, AP, CL are per head already.
                        hd = heads if obs in ("Q", "K", "V") else None
                        p, kinds = pattern(captured[obs], hd)
                        prev = seen.get(obs)
                        if prev is None or _rank(p) > _rank(prev[0]):
                            seen[obs] = (p, kinds | (prev[1] if prev else set()))
                        else:
                            seen[obs] = (prev[0], prev[1] | kinds)
                    bar.advance(f"{fault} in {product}")
                upstream = OBSERVED[: OBSERVED.index(_NAME[product])] if _NAME[product] not in ("Q", "K", "V") else ()
                result.table[fault][_NAME[product]] = {
                    obs: ("" if obs in upstream or obs not in seen else
                          (seen[obs][0] if seen[obs][0] == "-" else f"{seen[obs][0]} {'/'.join(sorted(seen[obs][1]))}"))
                    for obs in OBSERVED}
                result.non_trainable[fault][_NAME[product]] = bad_runs / trials
    finally:
        bar.stop()
    return result


def _rank(p: str) -> int:
    return {"-": 0, "0D": 1, "1R": 2, "1C": 2, "1R+1C": 2.5, "2D": 3}[p]
