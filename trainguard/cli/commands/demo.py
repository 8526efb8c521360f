"""``trainguard demo [--steps N] [--json]``: what one silent NaN in attention does to a training run, and
how DMR catches a bit flip anywhere.

Trains llama-tiny (byte tokens, the Python standard library's source, CPU) and injects a single NaN into
one attention score matrix (layer 1, one forward pass) half-way through. The unprotected run's loss turns
NaN and every weight after it is poisoned; training is stopped there. When ``trainguard.sdc.abft`` offers
``protect(model)``, the same fault is replayed on a protected model, whose checksums correct the value
in place and training finishes normally; otherwise a fault-free run shows where training should have
ended. Then a bit flip in a backward GEMM of a run with dual modular redundancy on (``trainguard.sdc.dmr``):
detected, the step rolled back and re-executed, the final loss identical to the fault-free run's. Relies on
the Trainer (``trainguard.train``) and rich.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch


from trainguard.cli.output import add_json_flag, console, emit_json, err_console, pick_threads, table

DEMO_OVERRIDES = [
    "--model.preset", "llama-tiny",
    "--data.seq_len", "128", "--data.batch_size", "8", "--data.max_bytes", "8000000",
    "--train.lr", "3e-3", "--train.log_every", "10",
    "--output.metrics", "false", "--output.dir", "",
]
INJECT_LAYER = "1"
INJECT_PRODUCT = "scores"
INJECT_INDEX = (0, 0, 10, 3)  # (batch, head, query, key): key <= query, so the causal mask keeps it


def demo_config(steps: int):
    from trainguard.config import load_config

    return load_config(None, DEMO_OVERRIDES + ["--train.steps", str(steps), "--train.eval_every", str(steps)])


class InjectNaN:
    """Callback: at ``step``, put one NaN into an attention product of one layer, for one forward only."""

    def __init__(self, step: int, layer: str = INJECT_LAYER, product: str = INJECT_PRODUCT,
                 index: tuple[int, ...] = INJECT_INDEX, handle: object | None = None):
        self.step, self.layer, self.product, self.index = step, layer, product, index
        self.handle = handle  # a protection handle with add_fault_hook(fn(layer, product, t)) (ABFT)
        self.fired_at: int | None = None
        self._remove = None

    def _corrupt(self, tensor: torch.Tensor, step: int) -> torch.Tensor:
        out = tensor.clone()
        out[self.index] = float("nan")
        self.fired_at = step
        self.remove()
        return out

    def on_step_start(self, trainer, step: int) -> None:
        if step != self.step:
            return
        if self.handle is not None and hasattr(self.handle, "add_fault_hook"):
            # A protected kernel replaces Attention.forward; its own fault hooks see the raw GEMM output.
            def fault(layer, name, tensor):
                if int(layer) != int(self.layer) or name != self.product or self.fired_at is not None:
                    return None
                return self._corrupt(tensor, step)

            self._remove = self.handle.add_fault_hook(fault)
            return
        attn = trainer.model.layers[self.layer].attention

        def hook(module, name, tensor):
            if name != self.product or self.fired_at is not None:
                return None
            return self._corrupt(tensor, step)

        self._remove = attn.add_product_hook(hook)

    def remove(self) -> None:
        if self._remove is not None:
            self._remove()
            self._remove = None

    def on_step_end(self, trainer, result) -> None:
        self.remove()  # one forward only, even if the product never came by


def _nonfinite_params(model) -> tuple[int, int]:
    import torch

    bad = total = 0
    for p in model.parameters():
        bad += int((~torch.isfinite(p)).sum())
        total += p.numel()
    return bad, total


def run_demo(steps: int = 200, protect: Callable[[Any], object] | None = None, *, inject: bool = True,
             progress: bool = True, batches=None, label: str | None = None) -> dict[str, Any]:
    """One demo run. ``protect(model)`` (e.g. ABFT) is applied to the model before training."""
    from trainguard.train import Trainer

    cfg = demo_config(steps)
    trainer = Trainer(cfg, batches=batches, progress=progress)
    handle = protect(trainer.model) if protect is not None else None
    if handle is not None and hasattr(handle, "on_step_start"):
        trainer.callbacks.append(handle)  # e.g. ABFT's per-step check schedule
    injector = InjectNaN(steps // 2, handle=handle) if inject else None
    if injector is not None:
        trainer.callbacks.append(injector)
    trainer.stop_on_nan = True
    summary = trainer.run()
    bad, total = _nonfinite_params(trainer.model)
    ruined = summary.first_nonfinite_step is not None or bad > 0
    out: dict[str, Any] = {
        "run": label or ("protected" if protect else ("unprotected" if inject else "fault-free")),
        "protected": protect is not None,
        "injected_at_step": injector.fired_at if injector else None,
        "steps_run": summary.steps_run,
        # a step index like injected_at_step (summaries count steps done: the step of index i is step i + 1)
        "first_nan_step": None if summary.first_nonfinite_step is None else summary.first_nonfinite_step - 1,
        "first_loss": summary.first_loss,
        "final_loss": summary.final_loss,
        "val_loss": summary.val_loss,
        "nonfinite_params": bad,
        "params": total,
        "outcome": "ruined: loss NaN, weights poisoned" if ruined else "healthy",
        "wall_s": round(summary.wall_s, 2),
    }
    if handle is not None:
        stats = getattr(handle, "total", None) or getattr(handle, "stats", None)
        stats = stats() if callable(stats) else stats
        if stats is not None:
            out["protection"] = stats if isinstance(stats, dict) else str(stats)
        if not ruined and injector is not None and injector.fired_at is not None:
            out["outcome"] = "healthy: NaN corrected in place"
    if injector is not None and injector.fired_at is None:
        out["outcome"] += " (the fault never reached the attention product)"
    out["_batches"] = trainer.batches
    return out


def run_dmr_demo(steps: int, *, progress: bool = True, batches=None) -> dict[str, Any]:
    """A fault-free run and the same run with DMR on and one bit flip (the exponent's top bit) in a backward
    GEMM half-way: DMR detects it, the step is rolled back and re-executed, and the run ends where the
    fault-free one does, bitwise."""
    import torch

    from trainguard.faults import Fault, FaultModel, Injector, OpSite
    from trainguard.sdc.dmr import DMRConfig, attach
    from trainguard.train import Trainer

    cfg = demo_config(steps)
    cfg.train.activation_checkpoint = "full"  # P-DMR checks the forward on the recompute
    clean = Trainer(cfg, batches=batches, progress=progress)
    clean_summary = clean.run()
    protected = Trainer(cfg, batches=clean.batches, progress=progress)
    engine = attach(protected, DMRConfig(enabled=True))
    fault = Fault(OpSite("aten.mm*", "backward", 5, compute_only=True), FaultModel("bitflip", bit=30), step=steps // 2,
                  index=7)
    injector = Injector(fault).attach(protected)
    summary = protected.run()
    a, b = protected.state_dict_for_compare(), clean.state_dict_for_compare()
    equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rec = injector.records[0] if injector.records else None
    return {"steps": steps, "injected_at_step": rec.step if rec else None,
            "fault": f"bit 30 of {rec.target} (backward), {rec.old:.3g} -> {rec.new:.3g}" if rec else None,
            "detected": engine.totals["detected"], "steps_re_executed": summary.retries,
            "final_loss_fault_free": clean_summary.final_loss, "final_loss_dmr": summary.final_loss,
            "parameters_bitwise_equal": equal}


def _abft_protect() -> Callable | None:
    try:
        from trainguard.sdc import abft
    except ImportError:
        return None
    return getattr(abft, "protect", None)


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="train llama-tiny on CPU: one NaN in attention (ABFT corrects it), one "
                                           "bit flip in a backward op (DMR rolls back)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per run (default 200)")
    add_json_flag(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    from trainguard.errors import ConfigError

    if args.steps < 4:
        raise ConfigError(f"--steps must be >= 4, got {args.steps}")
    out = err_console if args.json else console
    pick_threads()
    protect = _abft_protect()
    t0 = time.perf_counter()
    out.print(f"[bold]trainguard demo[/bold]: llama-tiny, {args.steps} steps, batch 8 x 128 byte tokens, CPU. "
              f"One NaN is injected into layer {INJECT_LAYER}'s attention {INJECT_PRODUCT} at step "
              f"{args.steps // 2} (one forward pass).")
    runs = []
    out.print("[bold]1. unprotected run[/bold]")
    first = run_demo(args.steps, None, progress=True)
    batches = first.pop("_batches")
    runs.append(first)
    if protect is not None:
        out.print("[bold]2. same fault, ABFT-protected attention[/bold] (trainguard.sdc.abft)")
        second = run_demo(args.steps, protect, progress=True, batches=batches)
    else:
        out.print("[bold]2. fault-free reference run[/bold] (trainguard.sdc.abft not available: no protected run)")
        second = run_demo(args.steps, None, inject=False, progress=True, batches=batches)
    second.pop("_batches")
    runs.append(second)
    dmr_steps = min(args.steps, 60)
    out.print(f"[bold]3. dual modular redundancy[/bold] (trainguard.sdc.dmr): {dmr_steps} steps fault-free, then "
              f"the same {dmr_steps} steps with every op verified and one bit flip in a backward GEMM at step "
              f"{dmr_steps // 2}")
    dmr = run_dmr_demo(dmr_steps, batches=batches)
    wall = time.perf_counter() - t0

    # One column per run, one row per figure: readable in an 80-column terminal.
    fields = (("fault injected at step", "injected_at_step"), ("first NaN loss at step", "first_nan_step"),
              ("steps run", "steps_run"), ("final loss", "final_loss"), ("validation loss", "val_loss"),
              ("non-finite weights", "nonfinite_params"), ("outcome", "outcome"))
    rows = [(label, *(_show(r.get(key)) for r in runs)) for label, key in fields]
    prot = runs[1].get("protection")
    if isinstance(prot, dict):
        rows.append(("ABFT detected / corrected", "-",
                     f"{prot.get('detected', '?')} / {prot.get('corrected', '?')}"))
    out.print(table("trainguard demo: one NaN in attention", rows, columns=("", *(r["run"] for r in runs))))
    u = runs[0]
    if u["first_nan_step"] is not None:
        out.print(f"Unprotected: the loss became NaN at step {u['first_nan_step']} and "
                  f"{u['nonfinite_params']:,} of {u['params']:,} weights are NaN; the run must roll back to a "
                  f"checkpoint and lose its progress.")
    if protect is None:
        out.print("Without a fault the same run ends at loss "
                  f"{runs[1]['final_loss']:.3f}. Enable ABFT (trainguard.sdc.abft) to correct such faults in place.")
    out.print(table("trainguard demo: a bit flip in a backward GEMM under DMR", [
        ("fault", dmr["fault"] or "not reached"), ("detected by DMR", dmr["detected"]),
        ("steps rolled back and re-executed", dmr["steps_re_executed"]),
        ("final loss, fault-free run", _show(dmr["final_loss_fault_free"])),
        ("final loss, DMR run with the fault", _show(dmr["final_loss_dmr"])),
        ("parameters bitwise equal", "yes" if dmr["parameters_bitwise_equal"] else "NO")], columns=("", "")))
    out.print(f"demo wall time: {wall:.1f} s")
    if args.json:
        emit_json({"steps": args.steps, "inject_step": args.steps // 2, "abft_available": protect is not None,
                   "runs": runs, "dmr": dmr, "wall_s": round(wall, 2)})
    return 0


def _show(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return "NaN" if math.isnan(v) else round(v, 4)
    return v
