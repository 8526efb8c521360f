"""ABFT fault campaigns and benchmarks on LLaMA and HF models (``trainguard campaign abft``,
``trainguard bench abft``).

Campaign trial: one training step (forward + backward) of the protected model with one fault written
into one element of one attention product (through ``ABFTHandle.add_fault_hook``, i.e. into the GEMM's
output before verification, as a hardware fault would be); the logits and every parameter gradient are
compared with the fault-free step. Classes: ``corrected`` (flagged, corrected, result within
tolerance of the fault-free step), ``uncorrectable`` (flagged, recomputed), ``silent`` (nothing
flagged, result off), ``masked`` (nothing flagged, result within tolerance). ``false_positives`` counts
flags raised in fault-free steps. Relies on torch and transformers (HF models, built from config).
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from trainguard.errors import ConfigError
from trainguard.faults.bits import FaultModel

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
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else torch.autocast("cpu", enabled=False)
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
                 backward: bool = False) -> CampaignResult:
    from trainguard.sdc.abft import PRODUCTS, ABFTConfig, protect

    if fault not in FAULTS:
        raise ConfigError(f"unknown fault {fault!r} (choose from {', '.join(FAULTS)})")
    if site not in SITES:
        raise ConfigError(f"unknown site {site!r} (choose from {', '.join(SITES)})")
    if dtype not in ("fp32", "bf16"):
        raise ConfigError(f"--dtype must be fp32 or bf16, got {dtype!r}")
    if trials < 1 or seq_len < 2 or batch < 1:
        raise ConfigError("trials >= 1, seq-len >= 2 and batch >= 1 are required")
    torch.manual_seed(seed)
    model, run = build(model_name, seed=seed)
    max_len = getattr(getattr(model, "config", None), "max_position_embeddings", None) or getattr(
        getattr(model, "config", None), "n_positions", None) or model.cfg.max_seq_len
    if seq_len > max_len - 2:
        raise ConfigError(f"--seq-len {seq_len} exceeds what {model_name} supports ({max_len - 2})")
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, min(256, vocab_size(model)), (batch, seq_len), generator=g)
    handle = protect(model, ABFTConfig(backward=backward))
    reference = _step(model, run, x, dtype)
    result = CampaignResult(model_name, fault, site, dtype, clean_checks=handle.n_layers * len(PRODUCTS))
    result.false_positives = handle.total()["detected"]
    ref_scale = max(float(reference[0].abs().max()), 1.0)
    result.tolerance = tol = (1e-4 if dtype == "fp32" else 2e-2) * ref_scale
    products = PRODUCTS if site == "any" else (site,)
    model_fault = FaultModel("bitflip" if fault == "bitflip" else fault)
    bar = None
    if progress:
        from trainguard.cli.output import progress as make_progress

        bar = make_progress(transient=True)
        task = bar.add_task(f"abft {model_name} {fault}@{site}", total=trials, info="")
        bar.start()
    try:
        for trial in range(trials):
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
            if bar is not None:
                bar.update(task, advance=1, info=f"corrected {result.corrected}  silent {result.silent}")
        # A last fault-free step: flags here are false positives too.
        handle.reset_counters()
        _step(model, run, x, dtype)
        result.false_positives += handle.total()["detected"]
        result.clean_checks *= 2
    finally:
        if bar is not None:
            bar.stop()
    return result


# ---------------------------------------------------------------------------------------------------
# Benchmark


def _attention_module(model, name: str):
    if name.startswith("llama"):
        att = model.layers["0"].attention
        return lambda x: att(x, model.rope_cos[: x.shape[1]], model.rope_sin[: x.shape[1]])
    if name in ("gpt2", "gpt-neo"):
        att = model.transformer.h[0].attn
        return lambda x: att(x)[0]
    enc = model.bert if name == "bert" else model.roberta
    att = enc.encoder.layer[0].attention
    return lambda x: att(x)[0]


def _hidden(model, name: str) -> int:
    return model.cfg.dim if name.startswith("llama") else model.config.hidden_size


def _median_time(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(model_name: str = "gpt2", batch: int = 8, seq_len: int = 128, rounds: int = 5, steps: int = 3,
          size: str = "small", backward_too: bool = True, progress: bool = True) -> dict[str, Any]:
    """Protected vs unprotected, side by side: in every round each timed slot runs every mode once, back
    to back (order flipped every slot). Overheads are paired: the median over all slots of abft / plain
    timed in the same slot, so that background load (which on a shared 2-core machine moved whole rounds
    by 2x) cancels. ``*_ratio_of_medians`` (median over rounds of each mode's per-round median, one
    ratio at the end: the estimator used before) is kept as a secondary figure.

    ``attention_overhead``: one attention layer, forward + backward; ``train_step_overhead``: forward,
    backward, AdamW (``_with_backward``: backward GEMMs verified too). Recovery: one NaN per step, injected
    into each forward product of a middle layer in turn; ``correction_s`` is the slow-path time measured
    inside the runtime (``ABFTHandle.correction_seconds``), ``correction_cost_vs_step`` its median over
    the plain step; ``checkpoint_restore_cost_vs_step`` reloads model + optimizer from disk and re-runs the
    step; ``recovery_speedup`` = restore time / median correction time.
    ``correction_cost_vs_step_from_step_medians`` (faulty minus clean step medians) is a secondary figure.
    """
    from trainguard.sdc.abft import ABFTConfig, protect, unprotect

    model, run = build(model_name, size=size)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(3, min(256, vocab_size(model)), (batch, seq_len), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    att = _attention_module(model, model_name)
    h = torch.randn(batch, seq_len, _hidden(model, model_name), generator=g, requires_grad=True)

    def step():
        opt.zero_grad(set_to_none=True)
        loss, _ = run(model, x)
        loss.backward()
        opt.step()

    def attention():
        att(h).sum().backward()

    modes = {"plain": None, "abft": ABFTConfig()}
    if backward_too:
        modes["abft+backward"] = ABFTConfig(backward=True)
    t_step: dict[str, list[float]] = {m: [] for m in modes}
    t_att: dict[str, list[float]] = {m: [] for m in modes}
    pair_step: dict[str, list[float]] = {m: [] for m in modes if m != "plain"}
    pair_att: dict[str, list[float]] = {m: [] for m in modes if m != "plain"}

    def interleaved(fn, n: int, r: int) -> dict[str, list[float]]:
        """``n`` slots; in each, every mode runs ``fn`` once, back to back (order flipped every slot), so
        that the modes see the same background load (blocks of several steps per mode drifted apart by
        +-10% on a shared 2-core machine)."""
        per: dict[str, list[float]] = {m: [] for m in modes}
        for i in range(n):
            order = list(modes) if (r + i) % 2 == 0 else list(reversed(list(modes)))
            for mode in order:
                cfg = modes[mode]
                if cfg is not None:
                    protect(model, cfg)
                t0 = time.perf_counter()
                fn()
                per[mode].append(time.perf_counter() - t0)
                if cfg is not None:
                    unprotect(model)
        return per

    step()  # warm-up (allocations, optimizer state)
    interleaved(attention, 1, 0)
    for r in range(rounds):
        for fn, n, acc, pairs in ((attention, 3, t_att, pair_att), (step, steps, t_step, pair_step)):
            per = interleaved(fn, n, r)
            for mode, ts in per.items():
                acc[mode].append(statistics.median(ts))
                if mode in pairs:
                    pairs[mode] += [t / p for t, p in zip(ts, per["plain"])]
    med = {m: statistics.median(v) for m, v in t_step.items()}
    med_att = {m: statistics.median(v) for m, v in t_att.items()}

    # Recovery: correct one NaN in place vs reload a checkpoint and re-run the step. The correction is
    # timed directly (ABFTHandle.correction_seconds: the slow path a flag triggers), one fault per step,
    # cycling over the six forward products of a middle layer; the difference of faulty and clean step
    # medians is kept as a secondary figure (for GPT-2-small it is below the noise of a ~10 s step).
    from trainguard.sdc.abft import PRODUCTS

    handle = protect(model, ABFTConfig())
    layer = handle.n_layers // 2
    clean, faulty, corr = [], [], []
    corrected = 0
    for i in range(max(len(PRODUCTS), rounds)):
        clean.append(_median_time(step, 1))
        target = PRODUCTS[i % len(PRODUCTS)]
        state = {"done": False}

        def hook(lyr, product, t, state=state, target=target):
            if not state["done"] and lyr == layer and product == target:
                state["done"] = True
                t.view(-1)[t.numel() // 3] = float("nan")
            return None

        handle.reset_counters()
        remove = handle.add_fault_hook(hook)
        faulty.append(_median_time(step, 1))
        remove()
        tot = handle.total()
        if state["done"] and tot["detected"] and tot["corrected"] + tot["recomputed"] == tot["detected"]:
            corrected += tot["corrected"]
            corr.append(handle.correction_seconds)
    unprotect(model)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ckpt.pt")
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)

        def restore_and_rerun():
            ck = torch.load(path)
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optim"])
            step()

        restore = _median_time(restore_and_rerun, max(3, rounds))
    t_plain = med["plain"]
    correction = statistics.median(corr) if corr else math.nan
    step_diff = max(statistics.median(faulty) - statistics.median(clean), 0.0)
    out = {
        "model": model_name, "size": size, "batch": batch, "seq_len": seq_len, "rounds": rounds,
        "threads": torch.get_num_threads(),
        "attention_overhead": statistics.median(pair_att["abft"]) - 1,
        "train_step_overhead": statistics.median(pair_step["abft"]) - 1,
        "correction_cost_vs_step": correction / t_plain,
        "checkpoint_restore_cost_vs_step": restore / t_plain,
        "recovery_speedup": restore / correction if corr else math.nan,
        "faults_corrected_in_recovery_runs": corrected,
        "recovery_faults_injected": len(faulty),
        "correction_s": {"median": correction, "max": max(corr) if corr else math.nan, "all": corr},
        "checkpoint_restore_s": restore,
        "correction_cost_vs_step_from_step_medians": step_diff / t_plain,
        "step_s": med, "attention_s": med_att,
        "attention_overhead_ratio_of_medians": med_att["abft"] / med_att["plain"] - 1,
        "train_step_overhead_ratio_of_medians": med["abft"] / t_plain - 1,
        "step_rounds_s": t_step, "attention_rounds_s": t_att,
    }
    if backward_too:
        out["attention_overhead_with_backward"] = statistics.median(pair_att["abft+backward"]) - 1
        out["train_step_overhead_with_backward"] = statistics.median(pair_step["abft+backward"]) - 1
        out["attention_overhead_with_backward_ratio_of_medians"] = med_att["abft+backward"] / med_att["plain"] - 1
        out["train_step_overhead_with_backward_ratio_of_medians"] = med["abft+backward"] / t_plain - 1
    return out
