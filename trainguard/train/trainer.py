"""The training loop: one ``Trainer`` for single-process, gradient-accumulation and data-parallel runs.

A step is ``zero_grad -> (forward -> loss -> backward) x grad_accum -> clip -> optimizer.step ->
scheduler.step``, all inside the contexts of ``Trainer.step_contexts`` (fault injection and verification
modes wrap a whole step there). Batches come from ``PackedBatches.batch(step, rank, world, micro,
n_micro)``, a pure function of the step, so resumed, rolled-back and re-sharded runs replay the same
tokens. Under ``torchrun`` with ``distributed.dp > 1`` the model is wrapped in
``DistributedDataParallel`` (gloo on CPU, nccl on CUDA); each rank averages its slice and DDP averages
over ranks, so the gradient equals the single-process gradient of the global batch. Pipeline
parallelism (``distributed.pp > 1``) is delegated to ``trainguard.train.pipeline.run_pipeline``.

Relies on torch (optim, amp autocast, DDP, DCP through ``checkpoint.py``) and rich (progress bar).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist

from trainguard.data import PackedBatches
from trainguard.errors import ConfigError, TrainguardError
from trainguard.models import build_model, lm_loss
from trainguard.train import snapshot as snap_mod
from trainguard.train.activation_checkpoint import apply_activation_checkpointing
from trainguard.train.checkpoint import CheckpointManager
from trainguard.train.device import device_named
from trainguard.train.host_memory import retain_freed_memory
from trainguard.train.metrics import MetricsLogger, peak_memory_mb
from trainguard.train.optim import build_optimizer, build_scheduler, clip_gradients
from trainguard.train.snapshot import StepSnapshot


@dataclass
class StepResult:
    """One optimizer step. ``loss`` / ``grad_norm`` read the device tensors lazily (one sync when asked)."""

    step: int
    loss_t: torch.Tensor = field(repr=False)
    grad_norm_t: torch.Tensor | None = field(repr=False)
    lr: float
    tokens: int
    step_time_s: float
    micro_batches: int = 1

    @property
    def loss(self) -> float:
        return float(self.loss_t)

    @property
    def grad_norm(self) -> float:
        return float(self.grad_norm_t) if self.grad_norm_t is not None else float("nan")

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss)


@dataclass
class RunSummary:
    steps_run: int = 0
    start_step: int = 0
    end_step: int = 0
    first_loss: float = float("nan")
    final_loss: float = float("nan")
    val_loss: float | None = None
    val_ppl: float | None = None
    tokens: int = 0
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    peak_mem_mb: float = 0.0
    first_nonfinite_step: int | None = None
    stopped_early: bool = False
    checkpoint: str | None = None
    resumed_from: str | None = None
    metrics_path: str | None = None
    device: str = "cpu"
    world_size: int = 1
    model: str = ""
    params: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------------
# Distributed set-up


def dist_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment (0, 1, 0 outside torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, 0
    return int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0"))


def resolve_device(cfg, local_rank: int = 0) -> torch.device:
    return device_named(cfg.train.device, local_rank, "train.device")


def init_distributed(cfg, device: torch.device) -> tuple[int, int, bool]:
    """Initialise the default process group when launched with WORLD_SIZE > 1.

    Returns (rank, world, created) where ``created`` says whether we own the group (and destroy it).
    """
    rank, world, _ = dist_env()
    if world == 1:
        return 0, 1, False
    expected = cfg.distributed.dp * cfg.distributed.pp
    if expected != world:
        raise ConfigError(
            f"launched with {world} processes but distributed.dp*pp = {expected}; they must match"
        )
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    backend = cfg.distributed.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("distributed.backend 'nccl' needs CUDA; use gloo on CPU")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, rank=rank, world_size=world)
    return rank, world, True


# ---------------------------------------------------------------------------------------------------


class Trainer:
    """See docs/HELPERS.md ("Trainer API")."""

    def __init__(self, cfg, model=None, batches=None, *, progress: bool | None = None):
        self.cfg = cfg
        self.step_contexts: list[Callable[[int], ContextManager]] = []
        self.callbacks: list[object] = []
        # Callables returning a flat dict of counters (e.g. ABFT detected/corrected) merged into every
        # metrics record and into the run summary's ``extra``.
        self.metric_sources: list[Callable[[], dict[str, Any]]] = []
        self.step_idx = 0
        self.stop_on_nan = False  # stop run() at the first non-finite loss (the step's result is kept)
        self.show_progress = cfg.output.progress if progress is None else progress
        self.resumed_from: str | None = None
        self._owns_pg = False
        self.pipeline = cfg.distributed.pp > 1
        if cfg.checkpoint.resume and not cfg.checkpoint.dir:
            raise ConfigError("checkpoint.resume is true but checkpoint.dir is empty")
        if self.pipeline:
            # Pipeline runs are driven by trainguard.train.pipeline (its own stage models and schedule).
            self.model = self.optimizer = self.scheduler = self.batches = self.ddp = self.ckpt = None
            self.device, self.rank, self.world = resolve_device(cfg), 0, 1
            return
        _, _, local_rank = dist_env()
        self.device = resolve_device(cfg, local_rank)
        self.rank, self.world, self._owns_pg = init_distributed(cfg, self.device)
        if cfg.train.host_memory == "retain" and self.device.type == "cpu":
            retain_freed_memory()
        if self.world == 1 and cfg.distributed.dp > 1 and self.is_main:
            sys.stderr.write(
                f"trainguard: note: distributed.dp={cfg.distributed.dp} but not launched under torchrun; "
                "running one process on the same global batch\n"
            )
        torch.manual_seed(cfg.train.seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed_all(cfg.train.seed)
        self.model = model if model is not None else build_model(cfg.model_config(), seed=cfg.train.seed)
        self.model.to(self.device)
        self.model.train()
        apply_activation_checkpointing(self.model, cfg.train.activation_checkpoint, cfg.train.selective_ops)
        self.batches = batches if batches is not None else PackedBatches.from_config(cfg.data)
        self.grad_accum = cfg.train.grad_accum
        parts = self.world * self.grad_accum
        if self.batches.batch_size % parts:
            raise ConfigError(
                f"data.batch_size ({self.batches.batch_size}) must be divisible by world*grad_accum ({parts})"
            )
        self.optimizer = build_optimizer(self.model, cfg.train)
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        self.ddp = None
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.ddp = DDP(
                self.model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                broadcast_buffers=False,
                find_unused_parameters=bool(self.model.cfg.n_experts),  # unrouted experts get no grad
            )
        self.autocast_dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else None
        self.tokens_per_step = self.batches.batch_size * self.batches.seq_len  # global
        self.ckpt = CheckpointManager(cfg.checkpoint.dir, cfg.checkpoint.keep) if cfg.checkpoint.dir else None
        if cfg.checkpoint.resume:
            if self.ckpt.latest() is not None:
                self.load_checkpoint()
            elif self.is_main:
                sys.stderr.write(f"trainguard: note: no checkpoint in {self.ckpt.dir}; starting from step 0\n")

    # ---- properties ------------------------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def forward_module(self) -> torch.nn.Module:
        return self.ddp if self.ddp is not None else self.model

    def _autocast(self) -> ContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    # ---- one step --------------------------------------------------------------------------------
    def compute_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            logits = self.forward_module(x)
            loss = lm_loss(logits, y)
            aux = self.model.aux_loss()
            if aux is not None:
                loss = loss + aux
        return loss

    def train_step(self) -> StepResult:
        """One optimizer step (all micro-batches), inside ``step_contexts``."""
        self._check_runnable()
        step = self.step_idx
        for cb in self.callbacks:
            fn = getattr(cb, "on_step_start", None)
            if fn is not None:
                fn(self, step)
        t0 = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]
        with contextlib.ExitStack() as stack:
            for make in self.step_contexts:
                stack.enter_context(make(step))
            loss, grad_norm = self._step(step)
        dt = time.perf_counter() - t0
        self.step_idx = step + 1
        result = StepResult(step, loss, grad_norm, lr, self.tokens_per_step, dt, self.grad_accum)
        for cb in self.callbacks:
            fn = getattr(cb, "on_step_end", None)
            if fn is not None:
                fn(self, result)
        return result

    def _step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.optimizer.zero_grad(set_to_none=True)
        n = self.grad_accum
        total = None
        for m in range(n):
            x, y = self.batches.batch(step, self.rank, self.world, m, n)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            sync = self.ddp.no_sync() if (self.ddp is not None and m < n - 1) else contextlib.nullcontext()
            with sync:
                loss = self.compute_loss(x, y)
                (loss / n if n > 1 else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        grad_norm = clip_gradients(self.model.parameters(), self.cfg.train.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        mean = total / n if n > 1 else total
        if self.world > 1:  # report the global-batch loss (ranks already sync every step in DDP)
            mean = mean.clone()
            dist.all_reduce(mean)
            mean = mean / self.world
        return mean, grad_norm

    def _check_runnable(self) -> None:
        if self.pipeline:
            raise TrainguardError("pipeline-parallel runs (distributed.pp > 1) are driven by Trainer.run() only")

    # ---- evaluation ------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, n_batches: int | None = None) -> dict[str, float]:
        self._check_runnable()
        n = n_batches or self.cfg.train.eval_batches
        micro = max(1, self.batches.batch_size // (self.world * self.grad_accum))
        was_training = self.model.training
        self.model.eval()
        losses = []
        try:
            for x, y in self.batches.val_batches(n):
                for xs, ys in zip(x.split(micro), y.split(micro)):
                    with self._autocast():
                        losses.append(lm_loss(self.model(xs.to(self.device)), ys.to(self.device)).float())
        finally:
            self.model.train(was_training)
        val = float(torch.stack(losses).mean()) if losses else float("nan")
        return {"val_loss": val, "val_ppl": math.exp(min(val, 50.0)) if math.isfinite(val) else float("nan")}

    # ---- snapshots and comparisons ---------------------------------------------------------------
    def snapshot(self) -> StepSnapshot:
        self._check_runnable()
        return snap_mod.capture(self.model, self.optimizer, self.scheduler, self.step_idx)

    def restore(self, snap: StepSnapshot) -> None:
        self._check_runnable()
        snap_mod.restore(snap, self.model, self.optimizer, self.scheduler)
        self.step_idx = snap.step

    def state_dict_for_compare(self, optimizer: bool = True) -> dict[str, torch.Tensor]:
        self._check_runnable()
        out = {f"param/{n}": p.detach().cpu().clone() for n, p in self.model.named_parameters()}
        if optimizer:
            names = {id(p): n for n, p in self.model.named_parameters()}
            for p, state in self.optimizer.state.items():
                for k, v in state.items():
                    if torch.is_tensor(v):
                        out[f"optim/{names.get(id(p), id(p))}/{k}"] = v.detach().cpu().clone()
        return out

    # ---- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        if self.ckpt is None:
            raise ConfigError("checkpoint.dir is not set")
        state = {"step": self.step_idx, "rng": snap_mod.rng_state(), "world": self.world}
        return self.ckpt.save(self.step_idx, self.model, self.optimizer, self.scheduler, self.cfg.to_dict(), state)

    def load_checkpoint(self, path: str | Path | None = None) -> dict:
        """Load ``path`` (None: the latest in checkpoint.dir) and continue from its step."""
        mgr = self.ckpt or CheckpointManager(Path(path).parent if path else ".", 1)
        manifest = mgr.load(path, self.model, self.optimizer, self.scheduler)
        state = manifest["trainer_state"]
        self.step_idx = int(state.get("step", manifest["step"]))
        if "rng" in state:
            rng = dict(state["rng"])
            if self.device.type != "cuda" or len(rng.get("cuda", [])) != torch.cuda.device_count():
                rng.pop("cuda", None)
            snap_mod.set_rng_state(rng)
        self.resumed_from = manifest["path"]
        return manifest

    # ---- the loop --------------------------------------------------------------------------------
    def run(self, steps: int | None = None) -> RunSummary:
        """Run ``steps`` more optimizer steps (default: until ``train.steps``), with progress bar,
        metrics.jsonl, evaluation every ``train.eval_every`` steps and checkpoints."""
        if self.pipeline:
            return run_pipeline(self.cfg)
        cfg = self.cfg
        start = self.step_idx
        n = steps if steps is not None else max(0, cfg.train.steps - start)
        end = start + n
        out_dir = Path(cfg.output.dir) if cfg.output.dir else None
        metrics_path = out_dir / "metrics.jsonl" if (out_dir and cfg.output.metrics and self.is_main) else None
        logger = MetricsLogger(
            metrics_path, total_steps=end, log_every=cfg.train.log_every,
            progress=self.show_progress and self.is_main, device=self.device, start_step=start,
        )
        summary = RunSummary(start_step=start, device=str(self.device), world_size=self.world,
                             model=cfg.model.preset, params=sum(p.numel() for p in self.model.parameters()),
                             metrics_path=str(metrics_path) if metrics_path else None,
                             resumed_from=self.resumed_from)
        first_loss = last = None
        last_eval_step = last_ckpt_step = -1
        evaluation: dict[str, float] = {}
        t0 = time.perf_counter()
        try:
            while self.step_idx < end:
                r = self.train_step()
                last = r
                if first_loss is None:
                    first_loss = r.loss_t
                logger.record(r.step, r.loss_t, r.grad_norm_t, r.lr, r.tokens, r.step_time_s, **self.extra_metrics())
                if self.stop_on_nan and not r.finite:
                    summary.stopped_early = True
                    break
                if cfg.train.eval_every and self.step_idx % cfg.train.eval_every == 0:
                    evaluation = self.evaluate()
                    last_eval_step = self.step_idx
                    logger.event(event="eval", step=self.step_idx, **evaluation)
                if self.ckpt is not None and cfg.checkpoint.every and self.step_idx % cfg.checkpoint.every == 0:
                    summary.checkpoint = str(self.save_checkpoint())
                    last_ckpt_step = self.step_idx
                    logger.event(event="checkpoint", step=self.step_idx, path=summary.checkpoint)
            if last is not None and not summary.stopped_early:
                if cfg.train.eval_every and last_eval_step != self.step_idx:
                    evaluation = self.evaluate()
                    logger.event(event="eval", step=self.step_idx, **evaluation)
                if self.ckpt is not None and last_ckpt_step != self.step_idx:
                    summary.checkpoint = str(self.save_checkpoint())
                    logger.event(event="checkpoint", step=self.step_idx, path=summary.checkpoint)
        finally:
            logger.close()
        summary.wall_s = time.perf_counter() - t0
        summary.end_step = self.step_idx
        summary.steps_run = self.step_idx - start
        summary.tokens = summary.steps_run * self.tokens_per_step
        summary.tokens_per_s = summary.tokens / summary.wall_s if summary.wall_s > 0 else 0.0
        if first_loss is not None:
            summary.first_loss = float(first_loss)
            summary.final_loss = last.loss
        summary.val_loss = evaluation.get("val_loss")
        summary.val_ppl = evaluation.get("val_ppl")
        summary.peak_mem_mb = peak_memory_mb(self.device)
        summary.first_nonfinite_step = logger.first_nonfinite_step
        summary.extra.update(self.extra_metrics())
        if out_dir and self.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "summary.json").write_text(json.dumps(_json_safe(summary.to_dict()), indent=1))
        return summary

    def extra_metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for source in self.metric_sources:
            out.update(source())
        return out

    def close(self) -> None:
        """Tear down the process group if this trainer created it."""
        if self._owns_pg and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_pg = False


def _json_safe(d: Any) -> Any:
    if isinstance(d, float) and not math.isfinite(d):
        return str(d)
    if isinstance(d, dict):
        return {k: _json_safe(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_json_safe(v) for v in d]
    return d


def run_pipeline(cfg) -> dict:
    """Delegate a pipeline-parallel run (distributed.pp > 1) to trainguard.train.pipeline."""
    from trainguard.train.pipeline import run_pipeline as _run

    return _run(cfg)


def run_training(cfg, progress: bool | None = None,
                 setup: Callable[[Trainer], None] | None = None) -> RunSummary:
    """Train from a RunConfig (the ``trainguard train`` entry point inside each process).

    ``setup(trainer)`` runs once before the loop: the CLI uses it to switch on protections from the
    ``[sdc]`` section (techniques live above this layer, so the trainer does not import them)."""
    if cfg.distributed.pp > 1:
        return run_pipeline(cfg)
    trainer = Trainer(cfg, progress=progress)
    if setup is not None:
        setup(trainer)
    try:
        return trainer.run()
    finally:
        trainer.close()
