"""``protect(model, ABFTConfig)`` -> :class:`ABFTHandle`; ``unprotect(model)``.

Relies on ``torch``; model adapters are :mod:`trainguard.sdc.abft.hf` (HF transformers) and the
``Attention.kernel`` slot of :mod:`trainguard.models.llama`.

Frequencies: ``ABFTConfig.frequencies = (f_AS, f_CL, f_O)`` in [0, 1]. Section ``s`` is checked on step
``i`` (set with :meth:`ABFTHandle.set_step`, e.g. from a Trainer ``on_step_start`` callback: the handle is
one) iff ``floor((i + 1) f_s) > floor(i f_s)``: exactly ``round-down((i+1) f)`` of the first ``i+1`` steps
are checked, evenly spread (f = 1: every step; 0.5: steps 1, 3, 5, ...; 0: never). The step stays where it
was set until the next ``set_step``. The forward decides; a backward pass uses its forward's decision.

Counters count product checks, per section: ``detected`` (a product whose check was flagged, GEMM or
non-GEMM), ``corrected`` (fixed by EEC-ABFT and verified against checksums the correction did not use;
also a flag caused by a corrupted checksum), ``uncorrectable`` (no verified correction), ``recomputed``
(then recomputed and the recomputation verified), ``escalated`` (neither: the inputs were already
non-finite, the recomputation failed, or a non-GEMM check flagged; reported to the step guard, which
re-executes the step) and ``false_alarms`` (roundoff above the detection threshold, confirmed by a
bitwise-identical recomputation). ``detected = corrected + recomputed + escalated + false_alarms``.
``escalations`` lists the escalations of the current attempt (``begin_attempt`` clears it; the step
guard of :mod:`trainguard.sdc.abft.guard` does so before every attempt and turns a non-empty list into
a retry verdict). ``events`` holds one dict per detection, per corrected element and per escalation
(capped at ``ABFTConfig.max_events``).
``correction_seconds`` accumulates the wall time of the slow path (everything a flag triggers: location,
EEC-ABFT correction, recomputation of uncorrectable and downstream products; host clock, so on CUDA it
includes the syncs the slow path makes).

Fault hooks ``fn(layer_idx, product, tensor) -> Tensor | None`` see each product right after its GEMM and
before verification, under ``torch.no_grad``; a returned tensor is copied into the product in place (the
autograd graph is the GEMM's, as for a real hardware fault). Forward products are :data:`PRODUCTS`, the
non-GEMM steps :data:`NONGEMM_PRODUCTS` (scaled scores, masked scores, softmax output); backward ones
:data:`BACKWARD_PRODUCTS` (fired whenever hooks exist, verified with ``backward=True``). Recomputations
do not call hooks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from trainguard.errors import ConfigError, TrainguardError
from trainguard.models.products import ProductHooks, product_hooks
from trainguard.sdc.abft import checksums as cks
from trainguard.sdc.abft import eec
from trainguard.sdc.abft.attention import (
    NONGEMM_PRODUCTS,
    PRODUCTS,
    SECTION_OF,
    SECTIONS,
    causal_bias,
    linear_proj,
    protected_attention,
)
from trainguard.sdc.abft.checksums import Outcome
from trainguard.sdc.abft.layout import share_storage

FaultHook = Callable[[int, str, torch.Tensor], "torch.Tensor | None"]
_ATTR = "_trainguard_abft"


@dataclass
class ABFTConfig:
    enabled: bool = False           # the trainer's switch ([sdc.abft] enabled, or [sdc] abft = true)
    frequencies: tuple[float, float, float] = (1.0, 1.0, 1.0)  # (AS, CL, O) check frequencies
    backward: bool = False          # verify the backward-pass GEMMs too
    check: bool = True              # False: run the kernel (and hooks) without any checksum work
    correct: bool = True            # False: detect and count only
    recompute: bool = True          # recompute a product EEC-ABFT cannot correct
    tolerance_factor: float = 2.0   # tau in the roundoff bound (see checksums.py)
    near_inf: float = eec.T_NEAR_INF
    correct_threshold: float = eec.T_CORRECT
    max_events: int = 10_000

    def validate(self) -> ABFTConfig:
        fr = tuple(float(f) for f in self.frequencies)
        if len(fr) != 3 or any(not (0.0 <= f <= 1.0) or math.isnan(f) for f in fr):
            raise ConfigError(f"abft frequencies must be three numbers in [0, 1] (AS, CL, O), got {self.frequencies!r}")
        self.frequencies = fr
        if not self.tolerance_factor > 0:
            raise ConfigError(f"abft tolerance_factor must be > 0, got {self.tolerance_factor}")
        return self


def section_due(step: int, f: float) -> bool:
    """Section with frequency ``f`` is checked on step ``step`` iff floor((step+1) f) > floor(step f)."""
    if f >= 1.0:
        return True
    if f <= 0.0:
        return False
    return math.floor((step + 1) * f + 1e-12) > math.floor(step * f + 1e-12)


COUNTERS = ("detected", "corrected", "uncorrectable", "recomputed", "escalated", "false_alarms")
MAX_ESCALATIONS = 1000  # per attempt (the first is what the guard reports)


def _zero() -> dict[str, int]:
    return dict.fromkeys(COUNTERS, 0)


@dataclass
class ABFTHandle:
    model: nn.Module
    cfg: ABFTConfig
    counters: dict = field(default_factory=lambda: {s: _zero() for s in SECTIONS})
    events: list = field(default_factory=list)
    step: int = 0
    _products: ProductHooks = field(default_factory=ProductHooks)
    _restore: list = field(default_factory=list)
    _shared: list = field(default_factory=list)   # [q, k, v] Linears whose weights share one storage
    kind: str = ""
    n_layers: int = 0
    #: wall time spent in the slow path (location, correction, recomputation after a flag), perf_counter
    correction_seconds: float = 0.0
    #: escalations of the current attempt: {step, layer, section, product, reason}
    escalations: list = field(default_factory=list)
    #: steps re-executed because of an escalation (counted by the step guard)
    retries: int = 0
    _pieces: dict = field(default_factory=dict)   # HF attention-interface path: pieces that ran, per layer
    _hooks: list = field(default_factory=list)    # module hooks to remove on unprotect
    _attn_impl: str | None = None                 # the model's attention implementation before protect

    # -- public API
    def reset_counters(self) -> None:
        self.counters = {s: _zero() for s in SECTIONS}
        self.events = []
        self.correction_seconds = 0.0
        self.escalations = []
        self.retries = 0

    def begin_attempt(self) -> None:
        """A new attempt of a step starts: forget the previous attempt's escalations."""
        self.escalations = []

    def total(self) -> dict[str, int]:
        tot = _zero()
        for c in self.counters.values():
            for key, val in c.items():
                tot[key] += val
        return tot

    def set_step(self, step: int) -> None:
        self.step = int(step)

    def on_step_start(self, trainer, step: int) -> None:  # Trainer callback
        self.set_step(step)
        self.begin_attempt()

    def add_fault_hook(self, fn: FaultHook) -> Callable[[], None]:
        """Same as ``trainguard.models.products.product_hooks(model).add(fn)`` (the one injection path)."""
        return self._products.add(fn)

    def due(self) -> tuple[bool, bool, bool]:
        if not self.cfg.check:
            return (False, False, False)
        return tuple(section_due(self.step, f) for f in self.cfg.frequencies)

    # -- used by the kernel
    def _ran(self, layer: int, piece: str) -> None:
        seen = self._pieces.get(layer)
        if seen is not None:
            seen.add(piece)

    def fire(self, layer: int, product: str, t: torch.Tensor) -> None:
        """The model's product hooks (fault injection) on a product right after its GEMM, in place."""
        if self._products:
            self._products.fire(layer, product, t)

    def share_qkv_storage(self, linears: list) -> None:
        """Back the q / k / v weights with one storage (see :mod:`trainguard.sdc.abft.layout`): the fused QKV
        GEMM then reads them without stacking them first."""
        if share_storage(linears):
            self._shared.append(linears)

    def resolve_kw(self) -> dict:
        return dict(correct=self.cfg.correct, recompute=self.cfg.recompute, near_inf=self.cfg.near_inf,
                    t_correct=self.cfg.correct_threshold)

    def _event(self, **kw) -> None:
        if len(self.events) < self.cfg.max_events:
            self.events.append(kw)

    def record(self, layer: int, product: str, out: Outcome) -> None:
        """Count and log what the slow path did to one flagged product (see the module docstring)."""
        sec = SECTION_OF[product]
        c = self.counters[sec]
        c["detected"] += 1
        self._event(step=self.step, layer=layer, section=sec, product=product, kind="detected",
                    location=out.first, old=None, new=None, flagged=out.flagged)
        if out.kind == cks.CORRECTED:
            c["corrected"] += 1
            for f in out.fixes:
                self._event(step=self.step, layer=layer, section=sec, product=product, kind="corrected",
                            location=(*f.batch, f.row, f.col), old=f.old, new=f.new)
            if out.checksum_errors and not out.fixes:
                self._event(step=self.step, layer=layer, section=sec, product=product, kind="corrected",
                            location="checksum", old=None, new=None)
            return
        if out.kind == cks.FALSE_ALARM:
            c["false_alarms"] += 1
            self._event(step=self.step, layer=layer, section=sec, product=product, kind="false_alarm",
                        location=out.first, old=None, new=None)
            return
        c["uncorrectable"] += 1
        if out.kind == cks.RECOMPUTED:
            c["recomputed"] += 1
            self._event(step=self.step, layer=layer, section=sec, product=product, kind="recomputed",
                        location=out.first, old=None, new=None, rejected=out.rejected)
        else:
            self._escalated(layer, product, out.reason, out.first)

    def escalate(self, layer: int, product: str, reason: str, location=None) -> None:
        """A flag that no correction or recomputation here can settle (a non-GEMM check): report it."""
        sec = SECTION_OF[product]
        self.counters[sec]["detected"] += 1
        self.counters[sec]["uncorrectable"] += 1
        self._event(step=self.step, layer=layer, section=sec, product=product, kind="detected",
                    location=location, old=None, new=None)
        self._escalated(layer, product, reason, location)

    def _escalated(self, layer: int, product: str, reason: str, location) -> None:
        sec = SECTION_OF[product]
        self.counters[sec]["escalated"] += 1
        self._event(step=self.step, layer=layer, section=sec, product=product, kind="escalated",
                    location=location, old=None, new=None, reason=reason)
        if len(self.escalations) < MAX_ESCALATIONS:
            self.escalations.append({"step": self.step, "layer": layer, "section": sec, "product": product,
                                     "reason": reason})


# ---------------------------------------------------------------- LLaMA (trainguard.models.llama)

def _llama_kernel(handle: ABFTHandle, layer: int):
    from trainguard.models.llama import apply_rope

    def kernel(module, x, cos, sin):  # a replacement in the Attention.kernel slot
        out, _ = protected_attention(
            handle, layer, x, linear_proj(module.wq), linear_proj(module.wk), linear_proj(module.wv),
            linear_proj(module.wo), n_heads=module.n_heads, head_dim=module.head_dim,
            scale=1.0 / math.sqrt(module.head_dim), bias_fn=causal_bias, rope=lambda t: apply_rope(t, cos, sin))
        return out

    return kernel


def _protect_llama(model, handle: ABFTHandle) -> None:
    for key, block in model.layers.items():
        att = block.attention
        handle._restore.append(att.kernel.push(_llama_kernel(handle, int(key)), name="abft", replaces=True))
        handle.share_qkv_storage([att.wq, att.wk, att.wv])
        handle.n_layers += 1
    handle.kind = "llama"


def _unprotect_llama(handle: ABFTHandle) -> None:
    for remove in handle._restore:
        remove()


# ---------------------------------------------------------------- public

def protect(model: nn.Module, config: ABFTConfig | None = None) -> ABFTHandle:
    """Install protected attention on every attention module of ``model``; see the module docstring."""
    cfg = (config or ABFTConfig()).validate()
    if getattr(model, _ATTR, None) is not None:
        raise TrainguardError("model is already ABFT-protected (call unprotect first)")
    handle = ABFTHandle(model=model, cfg=cfg, _products=product_hooks(model))
    from trainguard.models.llama import LlamaModel

    if isinstance(model, LlamaModel):
        _protect_llama(model, handle)
    else:
        from trainguard.sdc.abft import hf

        if not hf.is_supported(model):
            raise TrainguardError(f"ABFT cannot protect a {type(model).__name__}: supported are trainguard "
                                  f"LlamaModel and HF {', '.join(hf.SUPPORTED)} models")
        hf.patch(model, handle)
    if handle.n_layers == 0:
        raise TrainguardError(f"ABFT found no attention layer to protect in {type(model).__name__}")
    setattr(model, _ATTR, handle)
    return handle


def unprotect(model: nn.Module) -> None:
    """Restore the original attention forwards exactly (no-op for an unprotected model)."""
    handle = getattr(model, _ATTR, None)
    if handle is None:
        return
    if handle.kind == "llama":
        _unprotect_llama(handle)
    else:
        from trainguard.sdc.abft import hf

        hf.unpatch(handle)
    delattr(model, _ATTR)


def handle_of(model: nn.Module) -> ABFTHandle | None:
    return getattr(model, _ATTR, None)


__all__ = ["NONGEMM_PRODUCTS", "PRODUCTS", "SECTIONS", "ABFTConfig", "ABFTHandle", "handle_of", "protect", "section_due", "unprotect"]
