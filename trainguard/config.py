"""Run configuration: TOML files plus ``--section.key value`` overrides, validated before any work.

Each section is a plain ``@dataclass``. ``load_config(path, overrides)`` rejects unknown sections and
keys, wrong types and impossible values (e.g. more pipeline stages than layers) with a one-line
``ConfigError``. Relies on ``tomllib`` (standard library).
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.data.batches import DataConfig
from trainguard.errors import ConfigError
from trainguard.models.config import PRESETS, ModelConfig, model_config


@dataclass
class ModelSection:
    preset: str = "llama-tiny"
    # Any ModelConfig field may be overridden here (dim, n_layers, attention, n_experts, ...).
    overrides: dict[str, Any] = field(default_factory=dict)

    def build_config(self) -> ModelConfig:
        return model_config(self.preset, **self.overrides)


@dataclass
class TrainSection:
    steps: int = 200
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping
    grad_accum: int = 1
    dtype: str = "fp32"  # fp32 | bf16 (autocast)
    activation_checkpoint: str = "none"  # none | full | selective
    selective_ops: list[str] = field(default_factory=lambda: ["attention"])  # module kinds for selective AC
    eval_every: int = 50  # 0 disables evaluation
    eval_batches: int = 4
    log_every: int = 10
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    # default | retain: on CPU, keep freed host memory in the process (trainguard.train.host_memory;
    # large buffers stop page-faulting every step, resident memory stays at its peak)
    host_memory: str = "default"


@dataclass
class CheckpointSection:
    dir: str = ""  # empty: no checkpoints
    every: int = 0  # steps between checkpoints (0: only at the end when dir is set)
    keep: int = 2
    resume: bool = False


@dataclass
class DistributedSection:
    dp: int = 1
    pp: int = 1
    microbatches: int = 0  # pipeline micro-batches per step (0: 2 * pp)
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | gloo | nccl


@dataclass
class SDCSection:
    abft: bool = False
    abft_backward: bool = False
    abft_frequencies: list[float] = field(default_factory=lambda: [1.0, 1.0, 1.0])  # f_AS, f_CL, f_O


@dataclass
class OutputSection:
    dir: str = "runs/latest"
    metrics: bool = True  # metrics.jsonl in dir
    progress: bool = True


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    sdc: SDCSection = field(default_factory=SDCSection)
    output: OutputSection = field(default_factory=OutputSection)

    def model_config(self) -> ModelConfig:
        return self.model.build_config()

    def validate(self) -> RunConfig:
        mc = self.model_config()  # validates preset and model fields
        t, d, dist = self.train, self.data, self.distributed
        _positive("train.steps", t.steps)
        _positive("train.grad_accum", t.grad_accum)
        _positive("data.seq_len", d.seq_len)
        _positive("data.batch_size", d.batch_size)
        _positive("distributed.dp", dist.dp)
        _positive("distributed.pp", dist.pp)
        if t.lr <= 0:
            raise ConfigError(f"train.lr must be > 0, got {t.lr}")
        if not 0 <= t.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
        if not 0 <= t.warmup_ratio < 1:
            raise ConfigError(f"train.warmup_ratio must be in [0, 1), got {t.warmup_ratio}")
        if not 0 <= d.val_fraction < 1:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {d.val_fraction}")
        _choice("train.dtype", t.dtype, ("fp32", "bf16"))
        _choice("train.activation_checkpoint", t.activation_checkpoint, ("none", "full", "selective"))
        _choice("train.device", t.device, ("auto", "cpu", "cuda"))
        _choice("train.host_memory", t.host_memory, ("default", "retain"))
        _choice("distributed.backend", dist.backend, ("auto", "gloo", "nccl"))
        if d.seq_len > mc.max_seq_len:
            raise ConfigError(f"data.seq_len ({d.seq_len}) exceeds model max_seq_len ({mc.max_seq_len})")
        if dist.pp > mc.n_layers:
            raise ConfigError(f"distributed.pp ({dist.pp}) exceeds the model's layers ({mc.n_layers})")
        micro = dist.microbatches or (2 * dist.pp if dist.pp > 1 else 1)
        parts = dist.dp * t.grad_accum * (micro if dist.pp > 1 else 1)
        if d.batch_size % parts:
            raise ConfigError(
                f"data.batch_size ({d.batch_size}) must be divisible by dp*grad_accum*microbatches ({parts})"
            )
        if len(self.sdc.abft_frequencies) != 3 or not all(0 <= f <= 1 for f in self.sdc.abft_frequencies):
            raise ConfigError("sdc.abft_frequencies must be three numbers in [0, 1] (f_AS, f_CL, f_O)")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _positive(name: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value}")


def _choice(name: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ConfigError(f"{name} must be one of {', '.join(options)}; got {value!r}")


# ---------------------------------------------------------------------------------------------------
# Loading: TOML -> dict -> dataclasses, with strict key and type checks.

_MODEL_FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig)}


def load_config(path: str | Path | None = None, overrides: dict[str, str] | list[str] | None = None) -> RunConfig:
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: invalid TOML: {err}") from None
    cfg = from_dict(raw)
    for key, value in _override_pairs(overrides):
        apply_override(cfg, key, value)
    return cfg.validate()


def from_dict(raw: dict[str, Any]) -> RunConfig:
    cfg = RunConfig()
    sections = {f.name for f in dataclasses.fields(RunConfig)}
    for name, body in raw.items():
        if name not in sections:
            raise ConfigError(f"unknown config section [{name}] (known: {', '.join(sorted(sections))})")
        if not isinstance(body, dict):
            raise ConfigError(f"config section [{name}] must be a table")
        for key, value in body.items():
            _set(cfg, name, key, value, from_text=False)
    return cfg


def apply_override(cfg: RunConfig, dotted: str, value: Any) -> None:
    """Apply ``section.key=value`` (value given as text from the CLI, parsed by the field's type)."""
    if "." not in dotted:
        raise ConfigError(f"override {dotted!r} must look like section.key")
    section, key = dotted.split(".", 1)
    if section not in {f.name for f in dataclasses.fields(RunConfig)}:
        raise ConfigError(f"unknown config section {section!r} in override --{dotted}")
    _set(cfg, section, key, value, from_text=isinstance(value, str))


def _override_pairs(overrides) -> list[tuple[str, Any]]:
    if overrides is None:
        return []
    if isinstance(overrides, dict):
        return list(overrides.items())
    pairs, items = [], list(overrides)
    i = 0
    while i < len(items):
        item = items[i]
        if not item.startswith("--"):
            raise ConfigError(f"unexpected argument {item!r} (overrides look like --section.key value)")
        key = item[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(items):
                raise ConfigError(f"override --{key} needs a value")
            value = items[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs


def _set(cfg: RunConfig, section: str, key: str, value: Any, from_text: bool) -> None:
    target = getattr(cfg, section)
    if section == "model" and key != "preset":
        # Model fields are validated against ModelConfig, stored as overrides of the preset.
        if key == "overrides":
            raise ConfigError("set model fields directly in [model], not under 'overrides'")
        if key not in _MODEL_FIELDS:
            raise ConfigError(f"unknown key model.{key}")
        target.overrides[key] = _coerce(f"model.{key}", _MODEL_FIELDS[key].type, value, from_text)
        return
    fields = {f.name: f for f in dataclasses.fields(target)}
    if key not in fields:
        raise ConfigError(f"unknown key {section}.{key} (known: {', '.join(sorted(fields))})")
    if section == "model" and key == "preset" and value not in PRESETS:
        raise ConfigError(f"unknown model preset {value!r} (choose from {', '.join(PRESETS)})")
    setattr(target, key, _coerce(f"{section}.{key}", fields[key].type, value, from_text))


def _coerce(name: str, annotation: Any, value: Any, from_text: bool) -> Any:
    typ = _resolve(annotation)
    origin = typing.get_origin(typ)
    try:
        if typ is bool:
            if from_text:
                low = str(value).lower()
                if low in ("true", "1", "yes", "on"):
                    return True
                if low in ("false", "0", "no", "off"):
                    return False
                raise ValueError
            if not isinstance(value, bool):
                raise ValueError
            return value
        if typ is int:
            if isinstance(value, bool) or (not from_text and not isinstance(value, int)):
                raise ValueError
            return int(value)
        if typ is float:
            if isinstance(value, bool) or (not from_text and not isinstance(value, (int, float))):
                raise ValueError
            return float(value)
        if typ is str:
            if not from_text and not isinstance(value, str):
                raise ValueError
            return str(value)
        if origin is list:
            (inner,) = typing.get_args(typ) or (str,)
            items = [v.strip() for v in value.split(",") if v.strip()] if from_text and isinstance(value, str) else value
            if not isinstance(items, list):
                raise ValueError
            return [_coerce(name, inner, v, from_text) for v in items]
        if origin is dict:
            if not isinstance(value, dict):
                raise ValueError
            return value
    except (TypeError, ValueError):
        expected = getattr(typ, "__name__", str(typ))
        raise ConfigError(f"{name} must be {expected}, got {value!r}") from None
    return value


def _resolve(annotation: Any) -> Any:
    if isinstance(annotation, str):
        return {"int": int, "float": float, "str": str, "bool": bool,
                "list[str]": list[str], "list[float]": list[float], "dict[str, Any]": dict[str, Any]}.get(annotation, str)
    return annotation
