"""Per-step training metrics: ``metrics.jsonl`` (one JSON object per step) and a rich progress bar.

Losses and gradient norms stay on the device until a flush (every ``log_every`` steps), where they are
read back with one ``tolist()``: no host sync per step. Peak memory is
``torch.cuda.max_memory_allocated`` on CUDA and the process's peak RSS (``resource``) on CPU. Relies on
the standard library, torch and rich (through ``trainguard.utils.progress``).
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch


def peak_memory_mb(device: torch.device | str = "cpu") -> float:
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss_kb / (2**20 if sys.platform == "darwin" else 2**10)


class MetricsLogger:
    """Collects per-step records; writes them (and refreshes the progress bar) in batches."""

    def __init__(self, path: str | Path | None, total_steps: int, log_every: int = 10, progress: bool = True,
                 device: torch.device | str = "cpu", description: str = "train", start_step: int = 0):
        self.path = Path(path) if path else None
        self.log_every = max(1, int(log_every))
        self.device = torch.device(device)
        self.pending: list[dict[str, Any]] = []
        self.last: dict[str, Any] = {}
        self.first_nonfinite_step: int | None = None
        self._fh = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a" if start_step > 0 else "w")
        self._progress = None
        self._task = None
        if progress:
            from trainguard.utils import progress as make_progress

            self._progress = make_progress()
            self._task = self._progress.add_task(description, total=total_steps, completed=start_step, info="")
            self._progress.start()
        self._t_last_flush = time.perf_counter()
        self._tokens_since_flush = 0

    def record(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None, lr: float, tokens: int,
               step_time_s: float, **extra: Any) -> None:
        self.pending.append({"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": tokens,
                             "step_time_s": step_time_s, **extra})
        self._tokens_since_flush += tokens
        if self._progress is not None:
            self._progress.advance(self._task)
        if len(self.pending) >= self.log_every:
            self.flush()

    def event(self, **fields: Any) -> None:
        """A non-step record (evaluation, checkpoint) written in order with the step records."""
        self.flush()
        if self._fh is not None:
            self._fh.write(json.dumps(_finite(fields)) + "\n")
            self._fh.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        now = time.perf_counter()
        interval = max(now - self._t_last_flush, 1e-9)
        tok_s = self._tokens_since_flush / interval
        zeros = torch.zeros((), device=self.pending[0]["loss"].device)
        vals = torch.stack(
            [torch.stack([r["loss"].detach().float().reshape(()),
                          (r["grad_norm"] if r["grad_norm"] is not None else zeros).detach().float().reshape(()).to(zeros.device)])
             for r in self.pending]
        ).tolist()
        mem = peak_memory_mb(self.device)
        for r, (loss, gn) in zip(self.pending, vals):
            r["loss"], r["grad_norm"] = loss, (gn if r["grad_norm"] is not None else None)
            if self.first_nonfinite_step is None and not math.isfinite(loss):
                self.first_nonfinite_step = r["step"]
            r["tokens_per_s"] = tok_s
            r["peak_mem_mb"] = mem
            if self._fh is not None:
                self._fh.write(json.dumps(_finite(r)) + "\n")
        if self._fh is not None:
            self._fh.flush()
        self.last = self.pending[-1]
        self.pending = []
        self._t_last_flush, self._tokens_since_flush = now, 0
        if self._progress is not None:
            last = self.last
            self._progress.update(
                self._task,
                info=f"loss {last['loss']:.4f}  lr {last['lr']:.2e}  {tok_s:,.0f} tok/s",
            )

    def set_info(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, info=text)

    def close(self) -> None:
        self.flush()
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}
