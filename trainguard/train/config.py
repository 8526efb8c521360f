"""The trainer's own config sections and the tree they form (``TrainerConfig``).

Each section is a plain dataclass with its help text and its own ``validate()``; ``TrainerConfig`` adds
the checks that span sections (sequence length against the model, batch divisibility, ...). The run
config of the ``trainguard`` command (``trainguard.config.RunConfig``) extends ``TrainerConfig`` with the
sections of the techniques above the trainer (``[sdc]``). Loading and type checks are
:mod:`trainguard.utils.settings`. Relies on the standard library only.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainguard.data.batches import DataConfig
from trainguard.data.tokenizer import VOCAB_SIZE
from trainguard.errors import ConfigError
from trainguard.models.config import ModelConfig, ModelSection, model_config
from trainguard.utils.settings import load_settings, setting, validate_children

SELECTIVE_OPS = ("attention", "ffn", "feed_forward", "moe", "norm")


@dataclass
class TrainConfig:
    steps: int = setting(200, help="optimizer steps of the run (the schedule's length)")
    lr: float = setting(3e-3, help="peak learning rate (AdamW)")
    min_lr_ratio: float = setting(0.1, help="cosine decays to lr * min_lr_ratio")
    warmup_ratio: float = setting(0.1, help="fraction of steps of linear warmup")
    weight_decay: float = setting(0.1, help="AdamW weight decay (not applied to 1-D parameters)")
    beta1: float = setting(0.9, help="AdamW beta1, in [0, 1)")
    beta2: float = setting(0.95, help="AdamW beta2, in [0, 1)")
    grad_clip: float = setting(1.0, help="global gradient-norm clip (0 disables clipping)")
    grad_accum: int = setting(1, help="micro-batches per optimizer step on each rank")
    dtype: Literal["fp32", "bf16"] = setting("fp32", help="fp32, or bf16 autocast (fp32 master weights)")
    activation_checkpoint: Literal["none", "full", "selective"] = setting(
        "none", help="activation checkpointing: none, full (every block) or selective")
    selective_ops: list[str] = setting(default_factory=lambda: ["attention"],
                                       help=f"module kinds for selective checkpointing ({', '.join(SELECTIVE_OPS)})")
    eval_every: int = setting(50, help="steps between evaluations, and one at the end (0: never)")
    eval_batches: int = setting(4, help="validation batches per evaluation")
    log_every: int = setting(10, help="steps per metrics.jsonl flush and progress-bar update")
    seed: int = setting(0, help="seed of model initialisation and data order")
    device: Literal["auto", "cpu", "cuda"] = setting("auto", help="auto (CUDA when present), cpu or cuda")
    host_memory: Literal["default", "retain"] = setting(
        "default", help="retain: on CPU keep freed host memory in the process (no page faults every step)")
    gc: Literal["step", "python"] = setting(
        "step", help="step: Python's automatic garbage collection is off while a step runs and the young "
        "generations are collected after it (a collection in the middle of a step is on the critical path); "
        "python: Python's default")
    max_retries: int = setting(3, help="re-executions of one step that step guards may ask for before the run aborts")

    def validate(self) -> TrainConfig:
        _positive("train.steps", self.steps)
        for name in ("steps", "eval_every", "log_every", "eval_batches", "grad_accum"):
            if getattr(self, name) >= 2**63:  # (a step counter is an int64 tensor in places)
                raise ConfigError(f"train.{name} must be < 2**63, got {getattr(self, name)}")
        _positive("train.grad_accum", self.grad_accum)
        _positive("train.eval_batches", self.eval_batches)
        _positive("train.log_every", self.log_every)
        _at_least("train.eval_every", self.eval_every, 0)
        _at_least("train.max_retries", self.max_retries, 0)
        if not 0 <= self.seed < 2**64:  # torch's generators take no seed of 2**64 or more
            raise ConfigError(f"train.seed must be in [0, 2**64), got {self.seed}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"train.lr must be a finite number > 0, got {self.lr}")
        _within("train.min_lr_ratio", self.min_lr_ratio, 0, 1, closed=True)
        _within("train.warmup_ratio", self.warmup_ratio, 0, 1)
        _within("train.beta1", self.beta1, 0, 1)
        _within("train.beta2", self.beta2, 0, 1)
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ConfigError(f"train.weight_decay must be >= 0, got {self.weight_decay}")
        if not (self.grad_clip >= 0 and math.isfinite(self.grad_clip)):
            raise ConfigError(f"train.grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip}")
        unknown = [o for o in self.selective_ops if o not in SELECTIVE_OPS]
        if unknown or (self.activation_checkpoint == "selective" and not self.selective_ops):
            raise ConfigError(f"train.selective_ops: unknown module kind(s) {', '.join(unknown) or '(none given)'} "
                              f"(choose from {', '.join(SELECTIVE_OPS)})")
        return self


@dataclass
class CheckpointConfig:
    dir: str = setting("", help="checkpoint folder (empty: no checkpoints); it belongs to one run")
    every: int = setting(0, help="steps between checkpoints (0: only at the end of the run)")
    keep: int = setting(2, help="newest checkpoints of this run kept (older ones are pruned after a save)")
    resume: bool = setting(False, help="continue the run whose checkpoints are in dir (from the newest intact one)")
    resume_step: int = setting(-1, help="with resume: continue from the checkpoint of this step (-1: the newest intact one)")
    start_over: bool = setting(False, help="start a new run in a dir that holds another run's checkpoints: they are deleted")
    lock_wait_s: float = setting(600.0, help="seconds to wait for dir's previous user to exit (another run, or this "
                                             "run's processes still stopping after a kill) before giving up (0: at once)")

    def validate(self) -> CheckpointConfig:
        _at_least("checkpoint.every", self.every, 0)
        _positive("checkpoint.keep", self.keep)
        _at_least("checkpoint.resume_step", self.resume_step, -1)
        _within("checkpoint.lock_wait_s", self.lock_wait_s, 0, math.inf)  # (NaN and inf refused)
        if self.resume and not self.dir:
            raise ConfigError("checkpoint.resume is true but checkpoint.dir is empty")
        if self.start_over and not self.dir:
            raise ConfigError("checkpoint.start_over is true but checkpoint.dir is empty")
        if self.resume and self.start_over:
            raise ConfigError("checkpoint.resume and checkpoint.start_over exclude each other (continue the run, or delete it)")
        if self.resume_step >= 0 and not self.resume:
            raise ConfigError("checkpoint.resume_step needs checkpoint.resume = true")
        return self


@dataclass
class ElasticConfig:
    """``[distributed.elastic]``: one torchft replica group per process (``distributed.strategy = "elastic"``)."""

    lighthouse: str = setting("", help="torchft lighthouse address, http://host:port (empty: $TORCHFT_LIGHTHOUSE)")
    replica_id: int = setting(0, help="this process's replica group, in [0, replicas)")
    replicas: int = setting(0, help="replica groups the global batch is planned for (0: distributed.dp)")
    min_replicas: int = setting(1, help="a step commits only when at least this many replicas take part")
    timeout_s: float = setting(20.0, help="collective and commit timeout in seconds (a hung peer is dropped after it)")
    quorum_timeout_s: float = setting(60.0, help="how long one quorum may take, in seconds")
    connect_timeout_s: float = setting(20.0, help="timeout for connecting to the lighthouse and to peers, in seconds")
    heartbeat_ms: int = setting(100, help="heartbeat period to the lighthouse in milliseconds")
    init_sync: bool = setting(False, help="step 0 copies the lowest replica's state (false: every replica starts "
                                          "from the same seeded initialisation)")
    ordered_reduction: bool = setting(True, help="sum the micro-batch gradients in slice order (bitwise reproducible "
                                                 "whoever computed them; all-reduces slices x gradient size) instead "
                                                 "of one all-reduce of each replica's sum")
    max_step_retries: int = setting(8, help="re-executions of one step after peer failures before the run stops")

    def validate(self) -> ElasticConfig:
        _at_least("distributed.elastic.replica_id", self.replica_id, 0)
        _at_least("distributed.elastic.replicas", self.replicas, 0)
        _positive("distributed.elastic.min_replicas", self.min_replicas)
        _positive("distributed.elastic.heartbeat_ms", self.heartbeat_ms)
        _at_least("distributed.elastic.max_step_retries", self.max_step_retries, 0)
        for name in ("timeout_s", "quorum_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"distributed.elastic.{name} must be a finite number > 0, got {value}")
        return self


@dataclass
class DistributedConfig:
    strategy: Literal["auto", "single", "ddp", "pipeline", "elastic", "expert"] = setting(
        "auto", help="parallel strategy: auto picks single, ddp (dp > 1), pipeline (pp > 1) or expert (ep > 1) "
        "from the sizes")
    dp: int = setting(1, help="data-parallel replicas")
    pp: int = setting(1, help="pipeline stages")
    ep: int = setting(1, help="expert-parallel ranks (MoE: each holds n_experts / ep experts and a batch slice)")
    microbatches: int = setting(0, help="pipeline micro-batches per step and grad_accum round (0: 2 * pp)")
    backend: Literal["auto", "gloo", "nccl"] = setting("auto", help="auto (nccl on CUDA, gloo on CPU), gloo or nccl")
    emulate_link_delay_ms: float = setting(
        0.0, help="experiments only: every pipeline transfer, and a stage's gradient all-reduce over its "
        "replicas, lands this long after it is issued (a slow link)")
    elastic: ElasticConfig = field(default_factory=ElasticConfig)

    def validate(self) -> DistributedConfig:
        _positive("distributed.dp", self.dp)
        _positive("distributed.pp", self.pp)
        _positive("distributed.ep", self.ep)
        _at_least("distributed.microbatches", self.microbatches, 0)
        if self.ep > 1 and (self.dp > 1 or self.pp > 1 or self.strategy not in ("auto", "expert")):
            raise ConfigError("distributed.ep > 1 runs the expert strategy alone (each rank is one data-parallel "
                              "slice too): leave dp and pp at 1")
        if self.strategy == "expert" and self.ep < 2:
            raise ConfigError("distributed.strategy 'expert' needs distributed.ep >= 2")
        if not self.emulate_link_delay_ms >= 0:
            raise ConfigError(f"distributed.emulate_link_delay_ms must be >= 0, got {self.emulate_link_delay_ms}")
        if self.strategy == "pipeline" and self.pp < 2:
            raise ConfigError("distributed.strategy 'pipeline' needs distributed.pp >= 2")
        if self.strategy in ("single", "ddp", "elastic") and self.pp > 1:
            raise ConfigError(f"distributed.strategy {self.strategy!r} cannot run pp = {self.pp} stages (use pipeline)")
        if self.strategy == "single" and self.dp > 1:
            raise ConfigError(f"distributed.strategy 'single' cannot run dp = {self.dp} replicas")
        if self.strategy == "elastic":
            e, n = self.elastic, self.elastic_replicas()
            if e.replica_id >= n:
                raise ConfigError(f"distributed.elastic.replica_id ({e.replica_id}) must be < the replicas ({n})")
            if e.min_replicas > n:
                raise ConfigError(f"distributed.elastic.min_replicas ({e.min_replicas}) exceeds the replicas ({n})")
        return self

    def elastic_replicas(self) -> int:
        """Replica groups of an elastic run (``elastic.replicas``, or ``dp`` when that is 0)."""
        return self.elastic.replicas or self.dp

    def resolved_strategy(self) -> str:
        if self.strategy != "auto":
            return self.strategy
        if self.ep > 1:
            return "expert"
        return "pipeline" if self.pp > 1 else ("ddp" if self.dp > 1 else "single")

    def world_size(self) -> int:
        """Processes a run needs under torchrun."""
        return self.ep if self.resolved_strategy() == "expert" else self.dp * self.pp

    def pipeline_microbatches(self) -> int:
        return self.microbatches or 2 * self.pp

    def step_microbatches(self) -> int:
        """The micro-batches a batch (per grad-accum round) is split into: the pipeline's, else 1."""
        return self.pipeline_microbatches() if self.pp > 1 else 1


@dataclass
class OutputConfig:
    dir: str = setting("runs/latest", help="output folder: metrics.jsonl, summary.json, tb/ (empty: no files)")
    metrics: bool = setting(True, help="write metrics.jsonl (one record per committed step)")
    progress: bool = setting(True, help="progress bar on stderr")
    tensorboard: bool = setting(False, help="also write TensorBoard event files into <dir>/tb (needs the tensorboard package)")

    def validate(self) -> OutputConfig:
        if self.tensorboard and not self.dir:
            raise ConfigError("output.tensorboard needs output.dir (the event files go to <output.dir>/tb)")
        return self


@dataclass
class TrainerConfig:
    """Every section the trainer reads."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def model_config(self) -> ModelConfig:
        return self.model.build_config()

    def validate(self):
        validate_children(self)  # every section's own checks (also for configs built in code)
        mc = self.model_config()
        d, dist, t = self.data, self.distributed, self.train
        if mc.vocab_size < VOCAB_SIZE:
            raise ConfigError(f"model.vocab_size ({mc.vocab_size}) is smaller than the byte tokenizer's {VOCAB_SIZE} ids")
        if d.seq_len > mc.max_seq_len:
            raise ConfigError(f"data.seq_len ({d.seq_len}) exceeds model max_seq_len ({mc.max_seq_len})")
        if dist.resolved_strategy() == "expert" and (not mc.n_experts or mc.n_experts % dist.ep):
            raise ConfigError(f"distributed.ep ({dist.ep}) needs a MoE model whose n_experts ({mc.n_experts}) it divides")
        if dist.pp > mc.n_layers:
            raise ConfigError(f"distributed.pp ({dist.pp}) exceeds the model's layers ({mc.n_layers})")
        micro = dist.step_microbatches()
        parts = (dist.ep if dist.resolved_strategy() == "expert" else dist.dp) * t.grad_accum * micro
        if d.batch_size % parts:
            raise ConfigError(f"data.batch_size ({d.batch_size}) must be divisible by dp*grad_accum*microbatches ({parts})")
        if dist.pp > 1 and micro < dist.pp:
            raise ConfigError(f"distributed.microbatches ({micro}) must be >= distributed.pp ({dist.pp}) for 1F1B")
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None):
        """The config from a TOML file (optional) and ``--section.key value`` overrides, validated."""
        return load_settings(cls, path, overrides)


# ---- resume rules (README "Resuming a run") ----------------------------------------------------------
# A resumed run is the same run: the keys that define what it computes and on which data are compared with
# the checkpoint's config and a difference is refused. Every other key may change; the schedule keys are
# applied by rebuilding the learning-rate schedule from the new config at the resumed step.
RUN_IDENTITY_SECTIONS = ("model", "data")
RUN_IDENTITY_KEYS = ("train.seed",)
EXECUTION_ONLY = ("model.attention",)  # same mathematics, another kernel
SCHEDULE_KEYS = ("train.steps", "train.lr", "train.warmup_ratio", "train.min_lr_ratio")
NOT_COMPARED = ("checkpoint.resume", "checkpoint.resume_step", "checkpoint.start_over", "checkpoint.lock_wait_s")

Change = tuple[str, Any, Any]  # (dotted key, saved value, new value)


def resume_differences(saved: dict | None, saved_model: dict | None, cfg, saved_data: str | None = None,
                       data: str | None = None) -> tuple[list[Change], list[Change]]:
    """(refused, changed): how ``cfg`` differs from the config saved with a checkpoint. ``saved_model`` is the
    checkpoint's effective model config (presets are resolved, so a preset renamed or re-sized is seen).
    ``saved_data`` / ``data``: fingerprints of the corpus's contents; when both are known the corpus is compared
    by them, not by the text of ``data.source`` (the same file by another path is the same data, a file
    replaced under the same path is not)."""
    if not isinstance(saved, dict):
        return [], []
    by_contents = isinstance(saved_data, str) and isinstance(data, str)
    new_all = json.loads(json.dumps(cfg.to_dict(), default=str))
    old = _flatten({k: v for k, v in saved.items() if k != "model"})
    new = _flatten({k: v for k, v in new_all.items() if k != "model"})
    old_model = saved_model if isinstance(saved_model, dict) else _effective_model(saved.get("model"))
    new_model = json.loads(json.dumps(asdict(cfg.model_config()), default=str))
    if old_model is None:  # a preset this version does not know: compare the section as written
        old.update(_flatten({"model": saved.get("model")}))
        new.update(_flatten({"model": new_all.get("model")}))
    else:
        old.update({f"model.{k}": v for k, v in old_model.items()})
        new.update({f"model.{k}": v for k, v in new_model.items()})
    refused: list[Change] = []
    changed: list[Change] = []
    if by_contents and saved_data != data:
        refused.append(("data (the corpus's contents, sha256)", saved_data[:12], data[:12]))
    for key in sorted(set(old) & set(new)):
        if key in NOT_COMPARED or old[key] == new[key]:
            continue
        if key == "data.source" and by_contents:  # the contents decide (refused above when they differ)
            if saved_data == data:
                changed.append((key, old[key], new[key]))  # another name for the same contents
            continue
        identity = (key.split(".", 1)[0] in RUN_IDENTITY_SECTIONS or key in RUN_IDENTITY_KEYS) and key not in EXECUTION_ONLY
        (refused if identity else changed).append((key, old[key], new[key]))
    return refused, changed


def _effective_model(section: Any) -> dict | None:
    if not isinstance(section, dict):
        return None
    try:
        mc = model_config(str(section.get("preset")), **dict(section.get("overrides") or {}))
    except (ConfigError, TypeError):
        return None
    return json.loads(json.dumps(asdict(mc), default=str))


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def _positive(name: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value}")


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(f"{name} must be >= {low}, got {value}")


def _within(name: str, value: float, low: float, high: float, closed: bool = False) -> None:
    ok = low <= value <= high if closed else low <= value < high
    if not ok:  # also false for NaN
        raise ConfigError(f"{name} must be in [{low}, {high}{']' if closed else ')'}, got {value}")
