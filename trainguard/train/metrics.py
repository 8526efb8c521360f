"""Per-step training metrics: ``metrics.jsonl`` (one JSON object per step), optional TensorBoard event
files and a rich progress bar. The fields are documented in docs/outputs.md.

Steps are counted as optimizer steps done, the same way in every file: the record of the n-th optimizer
step has ``"step": n``, an evaluation or checkpoint after it has step n, and ``step_0000000n`` is the
checkpoint taken then. A resumed run first drops every record after the step it resumes from (the steps a
crashed run logged beyond its last checkpoint are trained again), so the file holds each committed step
once; TensorBoard gets the same cut through ``purge_step``.

Losses and gradient norms stay on the device until a flush (every ``log_every`` steps, and before every
checkpoint), where they are read back with one ``tolist()``: no host sync per step. Peak memory is
``torch.cuda.max_memory_allocated`` on CUDA and the process's peak RSS (``resource``) on CPU. Relies on
the standard library, torch (``torch.utils.tensorboard`` when asked for) and rich (through
``trainguard.utils.progress``).
"""

from __future__ import annotations

import json
import math
import os
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
                 device: torch.device | str = "cpu", description: str = "train", start_step: int = 0,
                 tensorboard_dir: str | Path | None = None):
        self.path = Path(path) if path else None
        self.log_every = max(1, int(log_every))
        self.device = torch.device(device)
        self.pending: list[dict[str, Any]] = []
        self.last: dict[str, Any] = {}
        self.first_nonfinite_step: int | None = None
        self._fh = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if start_step > 0:
                keep_records_until(self.path, start_step)
            self._fh = open(self.path, "a" if start_step > 0 else "w")
        self._tb = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: events a crashed run wrote after the step this run resumes from are hidden
            self._tb = SummaryWriter(str(tensorboard_dir), purge_step=start_step + 1 if start_step > 0 else None)
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
        """A non-step record (evaluation, checkpoint, retry, ...) written in order with the step records."""
        self.flush()
        if self._fh is not None:
            self._fh.write(json.dumps(_finite(fields)) + "\n")
            self._fh.flush()
        if self._tb is not None and "step" in fields:
            kind = fields.get("event")
            if kind == "eval":
                for k in ("val_loss", "val_ppl"):
                    if isinstance(fields.get(k), (int, float)):
                        self._tb.add_scalar(f"val/{k[4:]}", fields[k], fields["step"])
            elif kind in FAULT_EVENTS:
                self._tb.add_scalar(f"faults/{kind}", 1, fields["step"])

    def flush(self) -> None:
        if not self.pending:
            return
        now = time.perf_counter()
        interval = max(now - self._t_last_flush, 1e-9)
        tok_s = self._tokens_since_flush / interval
        # The pending records are not changed until their lines are written: a Ctrl-C landing in here leaves them
        # as they were, and close() writes them once (it used to find half-converted records and fail).
        zeros = torch.zeros((), device=self.pending[0]["loss"].device)
        vals = torch.stack(
            [torch.stack([r["loss"].detach().float().reshape(()),
                          (r["grad_norm"] if r["grad_norm"] is not None else zeros).detach().float().reshape(()).to(zeros.device)])
             for r in self.pending]
        ).tolist()
        mem = peak_memory_mb(self.device)
        done = [{**r, "loss": loss, "grad_norm": gn if r["grad_norm"] is not None else None, "tokens_per_s": tok_s,
                 "peak_mem_mb": mem} for r, (loss, gn) in zip(self.pending, vals)]
        text = "".join(json.dumps(_finite(r)) + "\n" for r in done)
        try:
            if self._fh is not None:
                self._fh.write(text)  # (one write: the records are in the file, or not yet)
        finally:
            self.pending = []
            self.last = done[-1]
        for r in done:
            if self.first_nonfinite_step is None and not math.isfinite(r["loss"]):
                self.first_nonfinite_step = r["step"]
            if self._tb is not None:
                self._scalars(r)
        if self._fh is not None:
            self._fh.flush()
        if self._tb is not None:
            self._tb.flush()
        self._t_last_flush, self._tokens_since_flush = now, 0
        if self._progress is not None:
            last = self.last
            self._progress.update(
                self._task,
                info=f"loss {last['loss']:.4f}  lr {last['lr']:.2e}  {tok_s:,.0f} tok/s",
            )

    def _scalars(self, r: dict[str, Any]) -> None:
        step = r["step"]
        for k in ("loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "peak_mem_mb"):
            v = r.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self._tb.add_scalar(f"train/{k}", v, step)
        for k, v in r.items():  # counters of the techniques (abft_*_detected, ...), attempts
            if k not in _STEP_FIELDS and isinstance(v, (int, float)) and not isinstance(v, bool):
                self._tb.add_scalar(f"counters/{k}", v, step)

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
        if self._tb is not None:
            self._tb.close()
            self._tb = None


# events that report a fault or its handling (the plot marks them; TensorBoard counts them)
FAULT_EVENTS = ("retry", "suspected_hardware", "failure", "failover", "healed", "preempted")
_STEP_FIELDS = {"step", "loss", "grad_norm", "lr", "tokens", "step_time_s", "tokens_per_s", "peak_mem_mb"}


def read_records(path: str | Path, skipped: list[int] | None = None) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (see :func:`read_numbered_records`)."""
    return [rec for _, rec in read_numbered_records(path, skipped)]


def read_numbered_records(path: str | Path, skipped: list[int] | None = None) -> list[tuple[int, dict[str, Any]]]:
    """The records of a ``metrics.jsonl`` with their line numbers (from 1). A line that holds no JSON object (one
    cut short by a crash, or damage) is skipped; its number is appended to ``skipped`` when given, for the caller
    to say so. Blank lines are no records and not counted."""
    out = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                rec = None
            if isinstance(rec, dict):
                out.append((number, rec))
            elif skipped is not None:
                skipped.append(number)
    return out


def keep_records_until(path: Path, step: int) -> None:
    """Rewrite ``metrics.jsonl`` with only the records of steps <= ``step`` (atomically)."""
    if not path.is_file():
        return
    kept = [r for r in read_records(path) if isinstance(r.get("step"), int) and r["step"] <= step]
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with open(tmp, "w") as fh:
        for r in kept:
            fh.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}
