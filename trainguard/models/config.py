"""Model configuration and presets (GaLore's LLaMA shapes, see DESIGN.md)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from trainguard.errors import ConfigError
from trainguard.utils.settings import coerce, type_name


@dataclass
class ModelConfig:
    vocab_size: int = 256 + 2  # bytes + <bos> + <eos> (see trainguard.data.tokenizer)
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    ffn_hidden: int = 344
    max_seq_len: int = 256
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # "explicit": every attention product is a separate, reachable op (ABFT, injection).
    # "sdpa": fused scaled_dot_product_attention when nothing needs the internals.
    attention: str = "sdpa"
    tie_embeddings: bool = False
    # Mixture of experts: n_experts = 0 means a dense SwiGLU FFN.
    n_experts: int = 0
    top_k: int = 2
    moe_aux_loss_coef: float = 0.01
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def validate(self) -> ModelConfig:
        positive = ("vocab_size", "dim", "n_layers", "n_heads", "ffn_hidden", "max_seq_len")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be > 0, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ConfigError(f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"model head_dim ({self.head_dim}) must be even for RoPE")
        if self.attention not in ("explicit", "sdpa"):
            raise ConfigError(f"model.attention must be 'explicit' or 'sdpa', got {self.attention!r}")
        if self.n_experts < 0:
            raise ConfigError(f"model.n_experts must be >= 0, got {self.n_experts}")
        for name in ("norm_eps", "rope_theta"):  # RMSNorm's epsilon, RoPE's base: 0 or less gives NaN, not an error
            if not getattr(self, name) > 0:
                raise ConfigError(f"model.{name} must be > 0, got {getattr(self, name)}")
        for name in ("init_std", "moe_aux_loss_coef"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"model.{name} must be >= 0, got {getattr(self, name)}")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(f"model.top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}")
        return self

    def replace(self, **overrides) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"unknown model field(s): {', '.join(unknown)}")
        return dataclasses.replace(self, **overrides).validate()

    def num_params(self) -> int:
        d, f, v, L = self.dim, self.ffn_hidden, self.vocab_size, self.n_layers
        ffn = 3 * d * f * max(1, self.n_experts) + (d * self.n_experts if self.n_experts else 0)
        per_layer = 4 * d * d + ffn + 2 * d
        return v * d * (1 if self.tie_embeddings else 2) + L * per_layer + d


# (hidden, ffn, heads, layers) from GaLore's LLaMA recipe (DESIGN.md).
_GALORE = {
    "llama-60m": (512, 1376, 8, 8),
    "llama-130m": (768, 2048, 12, 12),
    "llama-350m": (1024, 2736, 16, 24),
    "llama-1b": (2048, 5461, 32, 24),
    "llama-7b": (4096, 11008, 32, 32),
}

PRESETS: dict[str, ModelConfig] = {
    "llama-tiny": ModelConfig(dim=128, n_layers=2, n_heads=4, ffn_hidden=344, max_seq_len=256),
    **{
        name: ModelConfig(dim=d, ffn_hidden=f, n_heads=h, n_layers=l, max_seq_len=1024)
        for name, (d, f, h, l) in _GALORE.items()
    },
    "llama-moe-tiny": ModelConfig(dim=128, n_layers=2, n_heads=4, ffn_hidden=172, n_experts=4, top_k=2),
    "llama-moe-60m": ModelConfig(dim=512, ffn_hidden=688, n_heads=8, n_layers=8, n_experts=8, top_k=2,
                                 max_seq_len=1024),
}


def model_config(preset: str = "llama-tiny", **overrides) -> ModelConfig:
    """The preset's config with any field overridden; unknown presets/fields raise ConfigError."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown model preset {preset!r} (choose from {', '.join(PRESETS)})")
    return PRESETS[preset].replace(**overrides)


def preset_names() -> list[str]:
    return list(PRESETS)


@dataclass
class ModelSection:
    """The ``[model]`` section of a run: a preset plus any ``ModelConfig`` field as a key of its own
    (``[model] preset = "llama-tiny"  dim = 64``); those are kept in ``overrides``."""

    preset: str = dataclasses.field(default="llama-tiny", metadata={"help": f"model preset ({', '.join(PRESETS)})"})
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict, init=False,
                                                  metadata={"help": "ModelConfig fields set in this section"})

    def build_config(self) -> ModelConfig:
        return model_config(self.preset, **self.overrides)

    def set_extra(self, key: str, value: Any, from_text: bool) -> None:
        """A ``ModelConfig`` field given in ``[model]`` (validated against its type)."""
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        if key not in fields:
            raise ConfigError(f"unknown key model.{key} (model fields: preset, {', '.join(sorted(fields))})")
        self.overrides[key] = coerce(f"model.{key}", typing.get_type_hints(ModelConfig)[key], value, from_text)

    def validate(self) -> ModelSection:
        if self.preset not in PRESETS:
            raise ConfigError(f"unknown model preset {self.preset!r} (choose from {', '.join(PRESETS)})")
        self.build_config()
        return self

    @staticmethod
    def describe_extra() -> list[tuple[str, str, str, str]]:
        hints = typing.get_type_hints(ModelConfig)
        return [(f.name, type_name(hints[f.name]), "(preset)", "overrides the preset's value")
                for f in dataclasses.fields(ModelConfig)]
