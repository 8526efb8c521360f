"""ABFT fault campaigns on LLaMA and HF models (``trainguard campaign abft``; the benchmark,
``trainguard bench abft``, is in ``bench.py``).

Campaign trial: one training step (forward + backward) of the protected model with one fault written
into one element of one attention product (through ``ABFTHandle.add_fault_hook``, i.e. into the GEMM's
output before verification, as a hardware fault would be); the logits and every parameter gradient are
compared with the fault-free step (on ``device``: CPU, or CUDA when asked for or, with ``auto``, present).
Classes: ``corrected`` (flagged, corrected, result within
tolerance of the fault-free step), ``uncorrectable`` (flagged, recomputed), ``silent`` (nothing
flagged, result off), ``masked`` (nothing flagged, result within tolerance). ``false_positives`` counts
flags raised in fault-free steps. Relies on torch and transformers (HF models, built from config).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from trainguard.errors import ConfigError
from trainguard.faults.bits import FaultModel
from trainguard.train.device import device_named

MODELS = ("llama-tiny", "gpt2", "bert", "gpt-neo", "roberta")
SITES = ("q", "k", "v", "scores", "context", "output", "any")
FAULTS = ("inf", "nan", "near-inf", "bitflip")


def build(name: str, size: str = "tiny", seed: int = 0):
    """(model, loss_fn(model, x) -> loss, logits_fn) for a campaign/bench model name."""
    if name not in MODELS and not name.startswith("llama"):
        raise ConfigError(f"unknown model {name!r} (choose from {', '.join(MODELS)})")
    if name.startswith("llama"):
        from trainguard.models import build_model, lm_loss

        model = build_model(name, seed=seed, attention="explicit")

        def run(m, x):
            logits = m(x)
            return lm_loss(logits[:, :-1], x[:, 1:]), logits

        return model, run
    from trainguard.sdc.abft.hf import build_hf_model

    model = build_hf_model(name, size, seed=seed, dropout=0.0)

    def run(m, x):
        out = m(input_ids=x, labels=x)
        return out.loss, out.logits

    return model, run


def vocab_size(model) -> int:
    return int(getattr(getattr(model, "config", None), "vocab_size", None) or model.cfg.vocab_size)


@dataclass
class CampaignResult:
    model: str
    fault: str
    site: str
    dtype: str
    size: str = "tiny"
    batch: int = 0
    seq_len: int = 0
    device: str = "cpu"
    trials: int = 0
    detected: int = 0
    corrected: int = 0
    uncorrectable: int = 0
    silent: int = 0
    masked: int = 0
    false_positives: int = 0
    clean_checks: int = 0
    max_abs_error_after_correction: float = 0.0
    tolerance: float = 0.0
    by_product: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _step(model, run, x, dtype):
    model.zero_grad(set_to_none=True)
    dev = x.device.type
    ctx = torch.autocast(dev, dtype=torch.bfloat16) if dtype == "bf16" else torch.autocast(dev, enabled=False)
    with ctx:
        loss, logits = run(model, x)
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().float(), grads


def _max_err(a, b) -> float:
    logits_a, grads_a = a
    logits_b, grads_b = b
    errs = [(logits_a - logits_b).abs().max()]
    errs += [(grads_a[k] - grads_b[k]).abs().max() for k in grads_b]
    e = float(torch.stack(errs).max())
    return e if math.isfinite(e) else math.inf


def run_campaign(model_name: str = "llama-tiny", fault: str = "nan", site: str = "any", trials: int = 20,
                 seed: int = 0, seq_len: int = 32, batch: int = 2, dtype: str = "fp32", progress: bool = True,
                 backward: bool = False, size: str = "tiny", device: str = "cpu") -> CampaignResult:
    """``size``: shape of an HF model (``tiny``: 2 layers x 64; ``small`` / ``base``: GPT-2-small /
    BERT-base shapes); LLaMA models take their shape from their name. ``device``: ``cpu``, ``cuda`` or
    ``auto`` (:func:`trainguard.train.device.device_named`); the fault positions come from a CPU generator, so a seed draws the same
    trials on either device."""
    from trainguard.sdc.abft import PRODUCTS, ABFTConfig, protect

    if fault not in FAULTS:
        raise ConfigError(f"unknown fault {fault!r} (choose from {', '.join(FAULTS)})")
    if site not in SITES:
        raise ConfigError(f"unknown site {site!r} (choose from {', '.join(SITES)})")
    if dtype not in ("fp32", "bf16"):
        raise ConfigError(f"--dtype must be fp32 or bf16, got {dtype!r}")
    if trials < 1 or seq_len < 2 or batch < 1:
        raise ConfigError("trials >= 1, seq-len >= 2 and batch >= 1 are required")
    if size not in ("tiny", "small", "base"):
        raise ConfigError(f"unknown size {size!r} (choose from tiny, small, base)")
    if model_name.startswith("llama") and size != "tiny":
        raise ConfigError(f"--size applies to HF models; {model_name} takes its shape from its name")
    dev = device_named(device)
    torch.manual_seed(seed)
    model, run = build(model_name, size=size, seed=seed)
    model.to(dev)
    max_len = getattr(getattr(model, "config", None), "max_position_embeddings", None) or getattr(
        getattr(model, "config", None), "n_positions", None) or model.cfg.max_seq_len
    if seq_len > max_len - 2:
        raise ConfigError(f"--seq-len {seq_len} exceeds what {model_name} supports ({max_len - 2})")
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, min(256, vocab_size(model)), (batch, seq_len), generator=g).to(dev)
    handle = protect(model, ABFTConfig(backward=backward))
    reference = _step(model, run, x, dtype)
    result = CampaignResult(model_name, fault, site, dtype, size, batch, seq_len, dev.type,
                            clean_checks=handle.n_layers * len(PRODUCTS))
    result.false_positives = handle.total()["detected"]
    ref_scale = max(float(reference[0].abs().max()), 1.0)
    result.tolerance = tol = (1e-4 if dtype == "fp32" else 2e-2) * ref_scale
    products = PRODUCTS if site == "any" else (site,)
    model_fault = FaultModel("bitflip" if fault == "bitflip" else fault)
    from trainguard.utils import TaskBar

    bar = TaskBar(progress, f"abft {model_name} {fault}@{site}", trials)
    try:
        for _ in range(trials):
            layer = int(torch.randint(handle.n_layers, (1,), generator=g))
            product = products[int(torch.randint(len(products), (1,), generator=g))]
            state = {"done": False}

            def hook(lyr, prod, t, layer=layer, product=product, state=state):
                if state["done"] or lyr != layer or prod != product:
                    return None
                state["done"] = True
                model_fault.apply(t, int(torch.randint(t.numel(), (1,), generator=g)), g)
                return None

            handle.reset_counters()
            remove = handle.add_fault_hook(hook)
            out = _step(model, run, x, dtype)
            remove()
            counts = handle.total()
            err = _max_err(out, reference)
            flagged = counts["detected"] > 0
            kind = ("uncorrectable" if counts["uncorrectable"] else "corrected" if err <= tol else "detected-wrong") \
                if flagged else ("masked" if err <= tol else "silent")
            result.trials += 1
            result.detected += flagged
            if kind == "corrected":
                result.corrected += 1
                result.max_abs_error_after_correction = max(result.max_abs_error_after_correction, err)
            elif kind == "uncorrectable":
                result.uncorrectable += 1
            elif kind == "detected-wrong":  # flagged, "corrected", yet still off: counts as silent damage
                result.silent += 1
                result.max_abs_error_after_correction = max(result.max_abs_error_after_correction, err)
            else:
                setattr(result, kind, getattr(result, kind) + 1)
            bucket = result.by_product.setdefault(product, {"trials": 0, "detected": 0, "corrected": 0})
            bucket["trials"] += 1
            bucket["detected"] += flagged
            bucket["corrected"] += kind == "corrected"
            bar.advance(f"corrected {result.corrected}  silent {result.silent}")
        # A last fault-free step: flags here are false positives too.
        handle.reset_counters()
        _step(model, run, x, dtype)
        result.false_positives += handle.total()["detected"]
        result.clean_checks *= 2
    finally:
        bar.stop()
    return result
