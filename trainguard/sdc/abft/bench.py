"""``trainguard bench abft``: the cost of ABFT protection and of recovering from a fault.

Protected and unprotected modes run side by side in one process: in every timed slot each mode runs once,
back to back, the order flipped every slot, so that both see the same background load. On a shared
machine whole rounds drift by 30% or more (the host, not this process: CPU time moves with wall time), so
overheads are *paired*: the median over slots of ``t_abft / t_plain`` measured in the same slot, with a
bootstrap 95% confidence interval of that median (``*_ci95``). The ratio of per-mode medians is kept as a
secondary figure (``*_ratio_of_medians``).

Recovery: one NaN per step, injected into each forward product of a middle layer in turn; the
correction is timed inside the runtime (``ABFTHandle.correction_seconds``, the slow path a flag
triggers). The alternative it replaces is the trainer's checkpoint/restore: a real DCP checkpoint of the
same model and optimizer written by :class:`trainguard.train.checkpoint.CheckpointManager`, loaded back
with its ``load`` (manifest and sha256 verified, as a resumed run does), after which the work since that
checkpoint is re-executed: with a checkpoint every ``N`` steps (``checkpoint_interval``) a fault loses
``(N + 1) / 2`` steps on average. The files are on local disk and were just written, so the page cache is
warm: the restore time is a lower bound (remote storage is slower), which favours checkpoint/restore.
ABFT pays its detection on every step, fault or not (``detection_cost_per_step``, the paired step
overhead); per fault it pays the correction. So

    restore cost per fault  = load + (N + 1) / 2 * step
    ABFT cost per fault     = correction + detection_cost_per_step * step      (the step the fault hits)
    recovery_speedup        = restore cost per fault / ABFT cost per fault
    net time saved per step = lambda * (restore cost - correction) - detection_cost_per_step * step

at ``lambda`` faults per step; ABFT beats checkpoint/restore above ``break_even_faults_per_step`` =
detection cost / (restore cost - correction). ``net_time_saved`` tabulates the saving against lambda
(``trainguard bench abft --plot`` draws it). Both modes run under the same host allocator setting
(``host_memory``). On CUDA every timed call
ends with ``torch.cuda.synchronize()`` (kernels are asynchronous: without it the host time would be the
launch time); ``host_memory`` concerns the CPU allocator only. Relies on torch,
transformers (HF models built from config) and rich (progress bar on stderr).
"""

from __future__ import annotations

import math
import random
import statistics
import tempfile
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from trainguard.errors import ConfigError
from trainguard.sdc.abft import PRODUCTS, SECTIONS, ABFTConfig, protect, unprotect
from trainguard.sdc.abft.campaign import build, vocab_size
from trainguard.train.device import device_named
from trainguard.train.host_memory import host_memory_mode, retain_freed_memory

if TYPE_CHECKING:
    from trainguard.utils import TaskBar


def _attention_module(model, name: str):
    if name.startswith("llama"):
        att = model.layers["0"].attention
        return lambda x: att(x, model.rope_cos[: x.shape[1]], model.rope_sin[: x.shape[1]])
    if name in ("gpt2", "gpt-neo"):
        att = model.transformer.h[0].attn
        return lambda x: att(x)[0]
    if name in ("llama", "mistral", "qwen2"):
        inner = model.model
        att = inner.layers[0].self_attn

        def run(x):
            pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            return att(x, position_embeddings=inner.rotary_emb(x, pos), attention_mask=None)[0]
        return run
    enc = model.bert if name == "bert" else model.roberta
    att = enc.encoder.layer[0].attention
    return lambda x: att(x)[0]


def _hidden(model, name: str) -> int:
    return model.cfg.dim if name.startswith("llama") else model.config.hidden_size


def _timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    """Wall time of ``fn()``, including the device work it queued (a CUDA sync before and after)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn: Callable[[], Any]) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    return timed


def median_ci95(ratios: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap 95% interval of the median of ``ratios`` (seeded: the same data give the same
    interval). With a single value the interval is that value."""
    if len(ratios) < 2:
        return (ratios[0], ratios[0]) if ratios else (math.nan, math.nan)
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]


def bench(model_name: str = "gpt2", batch: int = 8, seq_len: int = 128, rounds: int = 5, steps: int = 3,
          size: str = "small", backward_too: bool = True, progress: bool = True,
          host_memory: str = "default", device: str = "cpu", checkpoint_interval: int = 100) -> dict[str, Any]:
    """Protected vs unprotected, side by side (see the module docstring for the estimators).

    ``attention_overhead``: one attention layer, forward + backward (3 slots per round);
    ``train_step_overhead``: forward, backward, AdamW (``steps`` slots per round); ``_with_backward``: the
    backward GEMMs verified too. ``correction_cost_vs_step``: median correction time over the plain step;
    ``checkpoint_restore_cost_vs_step``: DCP load + the lost steps at ``checkpoint_interval``, over the plain
    step; ``recovery_speedup`` and the break-even fault rate as in the module docstring.
    ``correction_cost_vs_step_from_step_medians``
    (faulty minus clean step medians) is a secondary figure. ``host_memory``: ``retain`` (what the CLI
    uses) keeps freed CPU memory in the process for both modes (:mod:`trainguard.train.host_memory`: glibc
    otherwise page-faults every large buffer again each step, a cost that follows the allocation pattern
    rather than the work; process-wide, hence not the library default); ``default`` leaves the allocator
    alone. The mode in force is reported as ``host_memory``. ``device``: ``cpu``, ``cuda`` or ``auto``
    (reported as ``device``).
    """
    from trainguard.utils import TaskBar

    if host_memory not in ("retain", "default"):
        raise ConfigError(f"unknown host_memory {host_memory!r} (choose retain or default)")
    if checkpoint_interval < 1:
        raise ConfigError(f"checkpoint interval must be >= 1 step, got {checkpoint_interval}")
    dev = device_named(device)
    if host_memory == "retain":
        retain_freed_memory()
    timed = _timer(dev)
    model, run = build(model_name, size=size)
    model.to(dev)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(3, min(256, vocab_size(model)), (batch, seq_len), generator=g).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    att = _attention_module(model, model_name)
    h = torch.randn(batch, seq_len, _hidden(model, model_name), generator=g).to(dev).requires_grad_()

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
    n_recovery = max(len(PRODUCTS), rounds)
    n_restore = max(3, rounds)
    bar = TaskBar(progress, f"bench abft {model_name}", 1 + rounds * (3 + steps) + rounds + n_recovery + n_restore,
                  refresh_per_second=2)
    t_step: dict[str, list[float]] = {m: [] for m in modes}
    t_att: dict[str, list[float]] = {m: [] for m in modes}
    pair_step: dict[str, list[float]] = {m: [] for m in modes if m != "plain"}
    pair_att: dict[str, list[float]] = {m: [] for m in modes if m != "plain"}

    def interleaved(fn, n: int, r: int, what: str) -> dict[str, list[float]]:
        """``n`` slots; in each, every mode runs ``fn`` once, back to back (order flipped every slot)."""
        per: dict[str, list[float]] = {m: [] for m in modes}
        for i in range(n):
            order = list(modes) if (r + i) % 2 == 0 else list(reversed(list(modes)))
            for mode in order:
                cfg = modes[mode]
                if cfg is not None:
                    protect(model, cfg)
                per[mode].append(timed(fn))
                if cfg is not None:
                    unprotect(model)
            bar.advance(f"round {r + 1}/{rounds} {what}")
        return per

    try:
        step()  # warm-up (allocations, optimizer state)
        interleaved(attention, 1, 0, "warm-up")
        for r in range(rounds):
            for fn, n, acc, pairs, what in ((attention, 3, t_att, pair_att, "attention"),
                                            (step, steps, t_step, pair_step, "step")):
                per = interleaved(fn, n, r, what)
                for mode, ts in per.items():
                    acc[mode].append(statistics.median(ts))
                    if mode in pairs:
                        pairs[mode] += [t / p for t, p in zip(ts, per["plain"])]
        section_cost = _section_costs(model, attention, rounds, bar, timed)
        recovery = _recovery(model, step, n_recovery, bar, timed)
        restore = _dcp_restore(model, model_name, opt, n_restore, bar, timed)
    finally:
        bar.stop()

    med = {m: statistics.median(v) for m, v in t_step.items()}
    med_att = {m: statistics.median(v) for m, v in t_att.items()}
    t_plain = med["plain"]
    corr = recovery["corr"]
    correction = statistics.median(corr) if corr else math.nan
    step_diff = max(statistics.median(recovery["faulty"]) - statistics.median(recovery["clean"]), 0.0)
    detection = max(statistics.median(pair_step["abft"]) - 1, 0.0)   # fraction of a plain step
    lost = (checkpoint_interval + 1) / 2
    restore_per_fault = restore["load_s"] + lost * t_plain
    abft_per_fault = correction + detection * t_plain
    gain = restore_per_fault - correction
    break_even = detection * t_plain / gain if gain > 0 else math.inf
    rates = [10.0 ** (e / 4) for e in range(-24, 1)]  # 1e-6 .. 1 faults per step
    out: dict[str, Any] = {
        "model": model_name, "size": size, "batch": batch, "seq_len": seq_len, "rounds": rounds, "steps": steps,
        "device": dev.type, "threads": torch.get_num_threads(), "host_memory": host_memory_mode(),
        "correction_cost_vs_step": correction / t_plain,
        "checkpoint_interval": checkpoint_interval,
        "lost_steps_per_fault": lost,
        "checkpoint_restore_method": "trainguard.train.checkpoint.CheckpointManager (DCP) save + load, local disk, "
                                     "page cache warm (a lower bound on restore time)",
        "checkpoint_load_s": restore["load_s"], "checkpoint_save_s": restore["save_s"],
        "checkpoint_bytes": restore["bytes"],
        "checkpoint_restore_cost_vs_step": restore_per_fault / t_plain,
        "detection_cost_per_step": detection,
        "abft_cost_per_fault_vs_step": abft_per_fault / t_plain,
        "recovery_speedup": restore_per_fault / abft_per_fault if corr else math.nan,
        "recovery_speedup_correction_only": restore_per_fault / correction if corr else math.nan,
        "recovery_speedup_interval_1": (restore["load_s"] + t_plain) / abft_per_fault if corr else math.nan,
        "break_even_faults_per_step": break_even,
        "break_even_steps_per_fault": 1 / break_even if break_even > 0 else math.inf,
        "net_time_saved": {"faults_per_step": rates,
                           "fraction_of_step": [(r * gain - detection * t_plain) / t_plain for r in rates]},
        "section_check_cost_s": section_cost,
        "section_check_cost_vs_attention": {s: c / med_att["plain"] for s, c in section_cost.items()},
        "faults_corrected_in_recovery_runs": recovery["corrected"],
        "recovery_faults_injected": len(recovery["faulty"]),
        "correction_s": {"median": correction, "max": max(corr) if corr else math.nan, "all": corr},
        "checkpoint_restore_s": restore_per_fault,
        "correction_cost_vs_step_from_step_medians": step_diff / t_plain,
        "step_s": med, "attention_s": med_att,
        "step_rounds_s": t_step, "attention_rounds_s": t_att,
        "step_pairs": len(pair_step["abft"]), "attention_pairs": len(pair_att["abft"]),
    }
    for mode, suffix in (("abft", ""), ("abft+backward", "_with_backward")):
        if mode not in modes:
            continue
        for key, pairs, meds in (("attention_overhead", pair_att, med_att), ("train_step_overhead", pair_step, med)):
            out[key + suffix] = statistics.median(pairs[mode]) - 1
            out[key + suffix + "_ci95"] = [v - 1 for v in median_ci95(pairs[mode])]
            out[key + suffix + "_ratio_of_medians"] = meds[mode] / meds["plain"] - 1
            out[key + suffix + "_pair_ratios"] = pairs[mode]
    return out


def _section_costs(model, attention, rounds: int, bar: TaskBar,
                   timed: Callable[[Callable[[], Any]], float]) -> dict[str, float]:
    """Seconds one attention layer (forward + backward) spends checking each section alone: per slot the
    kernel runs with its checks off and with only section S due, back to back (order flipped every slot);
    the cost is the median over slots of the paired difference (for ``plan abft --costs-from``)."""
    cfgs = {"off": ABFTConfig(check=False), "AS": ABFTConfig(frequencies=(1.0, 0.0, 0.0)),
            "CL": ABFTConfig(frequencies=(0.0, 1.0, 0.0)), "O": ABFTConfig(frequencies=(0.0, 0.0, 1.0))}
    diffs: dict[str, list[float]] = {s: [] for s in SECTIONS}
    for r in range(rounds):
        for i in range(3):
            order = list(cfgs) if (r + i) % 2 == 0 else list(reversed(list(cfgs)))
            t = {}
            for mode in order:
                protect(model, cfgs[mode])
                t[mode] = timed(attention)
                unprotect(model)
            for s_ in SECTIONS:
                diffs[s_].append(t[s_] - t["off"])
        bar.advance(f"round {r + 1}/{rounds} section costs")
    return {s_: max(statistics.median(v), 0.0) for s_, v in diffs.items()}


def _recovery(model, step, n: int, bar: TaskBar, timed: Callable[[Callable[[], Any]], float]) -> dict[str, Any]:
    """One NaN per step, cycling over the six forward products of a middle layer; the correction is timed
    directly (``ABFTHandle.correction_seconds``). A fault counts only if it was detected and every flag was
    corrected or recomputed."""
    handle = protect(model, ABFTConfig())
    layer = handle.n_layers // 2
    clean, faulty, corr = [], [], []
    corrected = 0
    try:
        for i in range(n):
            clean.append(timed(step))
            target = PRODUCTS[i % len(PRODUCTS)]
            state = {"done": False}

            def hook(lyr, product, t, state=state, target=target):
                if not state["done"] and lyr == layer and product == target:
                    state["done"] = True
                    t.view(-1)[t.numel() // 3] = float("nan")
                return None

            handle.reset_counters()
            remove = handle.add_fault_hook(hook)
            faulty.append(timed(step))
            remove()
            tot = handle.total()
            if state["done"] and tot["detected"] and tot["corrected"] + tot["recomputed"] == tot["detected"]:
                corrected += tot["corrected"]
                corr.append(handle.correction_seconds)
            bar.advance(f"recovery {i + 1}/{n}: NaN in {target}")
    finally:
        unprotect(model)
    return {"clean": clean, "faulty": faulty, "corr": corr, "corrected": corrected}


def _dcp_restore(model, model_name: str, opt, n: int, bar: TaskBar,
                 timed: Callable[[Callable[[], Any]], float]) -> dict[str, float]:
    """A real checkpoint of ``model`` + ``opt`` written by the trainer's ``CheckpointManager`` (DCP), then
    ``n`` timed ``load`` calls (median)."""
    from trainguard.train.checkpoint import CheckpointManager

    with tempfile.TemporaryDirectory() as d:
        mgr = CheckpointManager(d, keep=1)
        path = None

        def save():
            nonlocal path
            path = mgr.save(0, model, opt, None, {"model": model_name}, {"step": 0})

        save_s = timed(save)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        times = []
        for i in range(n):
            times.append(timed(lambda: mgr.load(path, model, opt)))
            bar.advance(f"checkpoint restore {i + 1}/{n}")
    return {"load_s": statistics.median(times), "save_s": save_s, "bytes": size}
