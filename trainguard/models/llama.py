"""LLaMA-style decoder: RMSNorm, RoPE, SwiGLU FFN (or routed experts), multi-head causal attention.

Relies on plain ``torch.nn`` only. Two attention paths:

* ``explicit``: Q/K/V projections, scores = QK^T/sqrt(d), causal mask, softmax, probs x V, output
  projection, each a separate op. Every product passes through ``Attention._product(name, t)`` so ABFT
  and fault injection can reach it by name (``q``, ``k``, ``v``, ``scores``, ``context``, ``output``).
* ``sdpa``: fused ``scaled_dot_product_attention`` when nothing needs the internals.

``Attention.kernel`` and ``FeedForward.kernel`` are kernel slots (:mod:`trainguard.models.slots`): a
technique replaces the computation (ABFT's protected attention) or wraps it (MeCeFO's approximations)
without subclassing or monkey-patching, and several techniques compose.

Layers live in an ``nn.ModuleDict`` keyed by index (TorchTitan's convention) so a pipeline stage can
delete the blocks it does not own and keep the others' parameter names.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainguard.errors import ConfigError, ShapeError
from trainguard.models.config import ModelConfig
from trainguard.models.moe import MoEFeedForward
from trainguard.models.products import ProductHooks, product_hooks
from trainguard.models.slots import KernelSlot

ProductHook = Callable[["Attention", str, torch.Tensor], "torch.Tensor | None"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 for stability under bf16 autocast, as LLaMA does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., 2i], x[..., 2i+1]); x is (B, H, T, D), cos/sin are (T, D/2)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.impl = cfg.attention
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.kernel = KernelSlot()  # ABFT replaces the computation here; others wrap it
        self.product_hooks: dict[int, ProductHook] = {}
        self.layer_id = 0  # set by LlamaModel: the block index products are reported under
        self.products = ProductHooks()  # replaced by the model's shared registry (models/products.py)

    def add_product_hook(self, hook: ProductHook) -> Callable[[], None]:
        """Call ``hook(module, name, tensor)`` on every attention product; a returned tensor replaces it."""
        key = id(hook)
        self.product_hooks[key] = hook
        return lambda: self.product_hooks.pop(key, None)

    def _product(self, name: str, t: torch.Tensor) -> torch.Tensor:
        self.products.fire(self.layer_id, name, t)  # model-level hooks (fault injection): in place
        for hook in list(self.product_hooks.values()):
            out = hook(self, name, t)
            if out is not None:
                t = out
        return t

    def split_heads(self, t: torch.Tensor) -> torch.Tensor:
        b, s, _ = t.shape
        return t.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            return self.kernel(self, self.default_forward, x, cos, sin)
        return self.default_forward(x, cos, sin)

    def default_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        explicit = self.impl == "explicit" or bool(self.product_hooks) or bool(self.products)
        q = self.wq(x)
        k = self.wk(x)
        v = self.wv(x)
        if explicit:
            q, k, v = self._product("q", q), self._product("k", k), self._product("v", v)
        q = apply_rope(self.split_heads(q), cos, sin)
        k = apply_rope(self.split_heads(k), cos, sin)
        v = self.split_heads(v)
        if explicit:
            ctx = self.explicit_core(q, k, v)
        else:
            ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = self.wo(ctx.transpose(1, 2).reshape(b, s, d))
        return self._product("output", out) if explicit else out

    def explicit_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """scores = QK^T/sqrt(d) -> causal mask -> softmax -> probs @ V, each product reachable."""
        s = q.shape[-2]
        scores = self._product("scores", torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim)))
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")).float(), dim=-1).to(v.dtype)
        return self._product("context", torch.matmul(probs, v))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.kernel = KernelSlot()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            return self.kernel(self, self.default_forward, x)
        return self.default_forward(x)

    def default_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.n_experts:
            self.feed_forward: nn.Module = MoEFeedForward(cfg.dim, cfg.ffn_hidden, cfg.n_experts, cfg.top_k)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaModel(nn.Module):
    """Decoder-only LM. ``forward(tokens) -> logits``; the loss is ``trainguard.models.lm_loss``.

    Pipeline stages set ``tok_embeddings`` / ``norm`` / ``output`` to ``None`` and drop layers; forward
    then takes (and returns) hidden states instead of tokens (logits).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg.validate()
        self.tok_embeddings: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        hooks = product_hooks(self)
        for i, block in self.layers.items():
            block.attention.layer_id, block.attention.products = int(i), hooks
        self.norm: nn.Module | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                # Scale residual-path output projections by depth (GPT-2 / TorchTitan practice).
                scale = 1.0 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 1.0
                nn.init.normal_(p, mean=0.0, std=std * scale)
            else:
                nn.init.ones_(p)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        s = h.shape[1]
        if s > self.cfg.max_seq_len:
            raise ShapeError(f"sequence length {s} exceeds model.max_seq_len {self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the MoE load-balancing losses of the last forward (None for dense models)."""
        losses = [m.last_aux_loss for m in self.modules() if isinstance(m, MoEFeedForward) and m.last_aux_loss is not None]
        if not losses:
            return None
        return self.cfg.moe_aux_loss_coef * torch.stack(losses).sum()

    def attention_modules(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

    def set_attention(self, impl: str) -> None:
        if impl not in ("explicit", "sdpa"):
            raise ConfigError(f"attention must be 'explicit' or 'sdpa', got {impl!r}")
        for m in self.attention_modules():
            m.impl = impl


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (fp32 logits for stability)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
