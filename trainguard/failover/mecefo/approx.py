"""MeCeFO's three approximations for a neighbor that computes a failed replica's micro-batches as well as its own,
as per-module switches in the model's kernel slots.

:class:`MeCeFO` is one stateful component (``trainer.register_state("mecefo", ...)``: the low-rank bases ``V1``
of every FFN weight and the step each was computed at, and the ``degraded`` flag). :meth:`MeCeFO.attach` pushes
one **wrapper** into every ``Attention.kernel`` and ``FeedForward.kernel`` slot (:mod:`trainguard.models.slots`),
once; the wrappers read the switch on every call. With ``degraded`` off they call what is underneath and
nothing else, so a run in which no micro-batch is degraded is bitwise the run without MeCeFO. With it on:

* **skip-connection for MHA in backward** (``skip_mha``): whatever attention runs underneath (the default body,
  or ABFT's protected attention: the slot's replacement) runs under ``torch.no_grad``; its output joins the
  residual stream as a constant, so the backward pass goes around the attention block through the residual
  connection. The attention parameters and their pre-norm get no gradient from this micro-batch, no
  attention activation is stored and no attention backward runs. The gradient-sync policy averages the
  attention gradients over the slices that did compute them (:mod:`trainguard.failover.mecefo.policy`).
* **selective recomputation of the FFN** (``recompute_ffn``): the FFN runs inside
  ``torch.utils.checkpoint.checkpoint`` (non-reentrant) with the model's composable checkpoint contexts
  (:func:`trainguard.train.activation_checkpoint.checkpoint_contexts`), so only its input is kept and the rest
  is recomputed in backward; skipped where activation checkpointing already recomputes that FFN (its block
  or the FFN itself is wrapped).
* **low-rank FFN weight gradient** (``low_rank``): inside the FFN every ``F.linear`` on one of its weights
  ``W`` (``y = W x``) becomes :class:`LowRankLinear`: the output and the input gradient are exact, the weight
  gradient is ``G_W ~ G_y (x^T V1) V1^T`` with ``V1`` the top-``rank`` right singular vectors of ``W``. Only
  ``x^T V1`` is kept for backward. ``V1`` is refreshed by an SVD of ``W`` when it is absent or ``tau`` steps old,
  lazily, only on a replica that runs degraded (the SVD cost is amortised over ``tau`` steps). The ``V1^T``
  product is deferred (``defer_projection``, :class:`PendingProjection`): ``G_y^T (x V1)`` is summed over the
  replica's degraded micro-batches of the step and projected once, in the last of them.

On the elastic strategy :meth:`MeCeFO.install` also enters a context around every micro-batch (degraded iff
the plan tagged it ``{"neighbor"}``) and, on sampled steps (``monitor_every``), measures what the paper's
Assumption 3 bounds: the relative error between the step's gradient and the failure-free one (each neighbor
recomputes its degraded slices exactly; one extra all-reduce), plus every replica's compute time and peak of
saved activations by role. Relies on torch (autograd, ``torch.utils.checkpoint``, ``TorchFunctionMode``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from trainguard.errors import ConfigError, TrainguardError
from trainguard.failover.mecefo.ring import parse_spread
from trainguard.models.llama import Attention, FeedForward
from trainguard.train.activation_checkpoint import checkpoint_contexts, is_wrapped
from trainguard.utils.settings import setting

if TYPE_CHECKING:
    from trainguard.train.parallel.base import MicroBatch
    from trainguard.train.parallel.elastic import StepView, SyncPlan
    from trainguard.train.trainer import Trainer

NEIGHBOR = "neighbor"  # the tag of a micro-batch computed in degraded mode
MHA_GROUP = "mha"  # the parameter group whose gradient skip-MHA leaves out (attention + its pre-norm)
_FFN_WEIGHTS = ("w1", "w2", "w3")


@dataclass
class MeCeFOConfig:
    skip_mha: bool = setting(True, help="degraded micro-batches skip the attention block in backward (its "
                                        "gradient is averaged over the slices that computed it)")
    recompute_ffn: bool = setting(True, help="degraded micro-batches keep only each FFN's input and recompute "
                                             "the rest in backward")
    low_rank: bool = setting(True, help="degraded micro-batches get the low-rank FFN weight gradient "
                                        "G_y (x^T V1) V1^T")
    defer_projection: bool = setting(True, help="low_rank: sum G_y^T (x V1) over a replica's degraded micro-batches "
                                                "of the step and multiply by V1^T once, in its last one (the same "
                                                "gradient up to rounding; false: once per micro-batch)")
    rank: int = setting(128, help="r: right singular vectors of each FFN weight in V1 (at most the weight's "
                                  "smaller side)")
    tau: int = setting(200, help="steps between SVD refreshes of V1 (only on a replica that runs degraded)")
    degrade_own: bool = setting(True, help="a neighbor also computes its own micro-batches degraded while it "
                                           "carries a failed replica's (the paper's neighbor-do-both)")
    spread: int | str = setting("auto", help="how many ring neighbors share a failed replica's micro-batches "
                                             "(round-robin): 1 = the paper's single neighbor; k; 'auto' = the "
                                             "smallest k whose neighbor step is estimated no slower than a normal "
                                             "step (degraded_cost), keeping one replica that is nobody's neighbor")
    degraded_cost: float = setting(0.75, help="spread='auto': a degraded micro-batch's compute time relative to an "
                                              "exact one (the default: CPU, llama-60m, all three techniques, "
                                              "docs/mecefo.md; the bench sets its own measurement)")
    monitor_every: int = setting(10, help="on degraded steps that are multiples of this, measure the gradient's "
                                          "relative error vs the failure-free gradient, compute time and "
                                          "activation memory (0: never)")

    def validate(self) -> MeCeFOConfig:
        for name in ("rank", "tau"):
            if getattr(self, name) < 1:
                raise ConfigError(f"mecefo.{name} must be >= 1, got {getattr(self, name)}")
        if self.monitor_every < 0:
            raise ConfigError(f"mecefo.monitor_every must be >= 0, got {self.monitor_every}")
        try:
            self.spread = parse_spread(self.spread)
        except TrainguardError as e:
            raise ConfigError(str(e)) from None
        if not self.degraded_cost > 0:
            raise ConfigError(f"mecefo.degraded_cost must be > 0, got {self.degraded_cost}")
        return self

    def techniques(self) -> str:
        on = [n for n, v in (("skip_mha", self.skip_mha), ("recompute_ffn", self.recompute_ffn),
                             ("low_rank", self.low_rank)) if v]
        return "+".join(on) or "naive"


# --------------------------------------------------------------------------------------------------
# Low-rank weight gradient


class PendingProjection:
    """The low-rank weight gradient's deferred part: ``G_y^T (x V1)`` (``out x r``) summed per weight over the
    degraded micro-batches of a step, multiplied by ``V1^T`` once, in the last of them. ``V1^T`` is linear, so
    the sum is the per-micro-batch gradient up to rounding, for one ``(out x r)(r x in)`` product per step
    instead of one per micro-batch (at a few hundred tokens per micro-batch that product costs about as much
    as the low-rank gradient saves). ``defer``: more degraded micro-batches of this step follow (read when a
    micro-batch's forward runs; its backward then returns no gradient for the weight and keeps the part)."""

    def __init__(self):
        self.defer = False
        self.parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight) -> (pending G_y^T (x V1), V1)

    def weight_grad(self, part: torch.Tensor, key: int, basis: torch.Tensor, defer: bool):
        """This micro-batch's weight gradient (None while deferring) given its ``part``. ``key``: ``id`` of the
        weight *parameter*, taken in forward (a tensor unpacked from the saved tensors in backward is a fresh
        Python object whose id may be another's). A part pending under another basis (refreshed in between) is
        projected with its own basis now."""
        out = None
        if key in self.parts:
            before, old = self.parts.pop(key)
            if old is basis:
                part = before + part
            else:
                out = before.mm(old.t().to(before.dtype))
        if defer:
            self.parts[key] = (part, basis)
            return out
        now = part.mm(basis.t().to(part.dtype))
        return now if out is None else out + now

    def clear(self) -> None:
        self.parts = {}


class LowRankLinear(torch.autograd.Function):
    """``y = x W^T`` with the exact output and input gradient and the weight gradient
    ``G_W = G_y^T (x V1) V1^T`` (``V1``: ``(in_features, r)`` with orthonormal columns). Keeps ``x V1`` (r
    columns), not ``x``, for backward. ``pending`` (a :class:`PendingProjection`, optional) defers the
    ``V1^T`` product to the step's last degraded micro-batch."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, basis: torch.Tensor,
                pending: PendingProjection | None = None) -> torch.Tensor:
        y = F.linear(x, weight)
        xb = torch.matmul(x, basis.to(y.dtype) if x.dtype != basis.dtype else basis)
        ctx.save_for_backward(xb, weight, basis)
        ctx.x_dtype = x.dtype
        ctx.pending = pending
        ctx.defer = pending is not None and pending.defer
        ctx.key = id(weight)
        return y

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        xb, weight, basis = ctx.saved_tensors
        gx = gw = None
        g = gy.to(weight.dtype)
        if ctx.needs_input_grad[0]:
            gx = torch.matmul(g, weight).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            g2 = g.reshape(-1, g.shape[-1])
            p = xb.reshape(-1, xb.shape[-1]).to(weight.dtype)
            part = torch.matmul(g2.t(), p)
            if ctx.pending is None:
                gw = torch.matmul(part, basis.t().to(weight.dtype))
            else:
                gw = ctx.pending.weight_grad(part, ctx.key, basis, ctx.defer)
        return gx, gw, None, None


class DegradedSwiGLU(torch.autograd.Function):
    """The SwiGLU FFN ``w2(silu(w1 x) * w3 x)`` keeping only its input ``x`` for backward: the backward pass
    recomputes ``w1 x`` and ``w3 x`` (not the output projection) and forms the weight gradients exactly, or, for a
    weight with a basis ``V1``, as ``G_y (x^T V1) V1^T``. Same operations as autograd's backward of the stored
    FFN, so with no basis the gradients are bitwise those of the stored FFN (CPU)."""

    @staticmethod
    def forward(ctx, x, w1, w2, w3, v1, v2, v3, pending=None):
        h1, h3 = F.linear(x, w1), F.linear(x, w3)
        y = F.linear(F.silu(h1) * h3, w2)
        ctx.save_for_backward(x, w1, w2, w3, *(v if v is not None else torch.empty(0) for v in (v1, v2, v3)))
        ctx.has_basis = (v1 is not None, v2 is not None, v3 is not None)
        ctx.pending = pending
        ctx.defer = pending is not None and pending.defer
        ctx.keys = (id(w1), id(w2), id(w3))
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w1, w2, w3, *vs = ctx.saved_tensors
        v1, v2, v3 = (v if has else None for v, has in zip(vs, ctx.has_basis))
        with torch.no_grad():
            h1, h3 = F.linear(x, w1), F.linear(x, w3)  # the recomputation
            a = F.silu(h1)
            g = a * h3
            dg = dy.matmul(w2)
            k1, k2, k3 = ctx.keys
            dw2 = _weight_grad(dy, g, v2, k2, ctx) if ctx.needs_input_grad[2] else None
            dh3 = dg * a
            dh1 = torch.ops.aten.silu_backward(dg * h3, h1)
            dx = dh1.matmul(w1) + dh3.matmul(w3) if ctx.needs_input_grad[0] else None
            dw1 = _weight_grad(dh1, x, v1, k1, ctx) if ctx.needs_input_grad[1] else None
            dw3 = _weight_grad(dh3, x, v3, k3, ctx) if ctx.needs_input_grad[3] else None
        return dx, dw1, dw2, dw3, None, None, None, None


def _weight_grad(gy: torch.Tensor, x: torch.Tensor, basis: torch.Tensor | None, key: int = 0, ctx=None) -> torch.Tensor | None:
    """``G_y^T x`` over the flattened batch; with a basis, ``(G_y^T (x V1)) V1^T`` (the ``V1^T`` product deferred
    when ``ctx.pending`` says so)."""
    g2, x2 = gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1])
    if basis is None:
        return g2.t().mm(x2)
    part = g2.t().mm(x2.mm(basis))
    pending = getattr(ctx, "pending", None)
    if pending is None:
        return part.mm(basis.t())
    return pending.weight_grad(part, key, basis, ctx.defer)


def low_rank_basis(weight: torch.Tensor, rank: int) -> torch.Tensor:
    """The top-``rank`` right singular vectors of ``weight`` (``(out, in)``), as an ``(in, r)`` matrix with
    ``r = min(rank, in)``. Beyond the weight's rank the basis is completed (a full SVD), so ``rank >= in`` gives an
    orthonormal basis of the whole input space and the exact gradient."""
    w = weight.detach().float()
    r = min(rank, w.shape[1])
    _, _, vh = torch.linalg.svd(w, full_matrices=r > min(w.shape))
    return vh[:r].t().contiguous().to(weight.dtype)


class _LowRankMode(TorchFunctionMode):
    """Routes ``F.linear(x, W)`` for the weights in ``bases`` (by identity) through :class:`LowRankLinear`."""

    def __init__(self, bases: dict[int, torch.Tensor], pending: PendingProjection | None = None):
        super().__init__()
        self.bases = bases
        self.pending = pending

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch._C._nn.linear or func is F.linear:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            basis = self.bases.get(id(weight))
            if basis is not None and bias is None:
                return LowRankLinear.apply(args[0] if args else kwargs["input"], weight, basis, self.pending)
        return func(*args, **kwargs)


# --------------------------------------------------------------------------------------------------
# Saved-activation accounting (what a micro-batch keeps for its backward pass)


class ActivationMeter:
    """Bytes of tensors saved for backward (parameters and ``exclude``, e.g. MeCeFO's bases, left out; each storage
    once), and their peak, while entered. Checkpointed regions save only their inputs, so they count only those."""

    def __init__(self, model: torch.nn.Module, exclude: tuple[torch.Tensor, ...] | list[torch.Tensor] = ()):
        self._params = {p.untyped_storage().data_ptr() for p in (*model.parameters(), *exclude)}
        self.live = 0
        self.peak = 0
        self._seen: dict[int, int] = {}
        self._hooks = None

    def _pack(self, t: torch.Tensor):
        try:
            key = t.untyped_storage().data_ptr()
            size = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, functional wrappers)
            return t
        if key not in self._params and key not in self._seen:
            self._seen[key] = size
            self.live += size
            self.peak = max(self.peak, self.live)
        return t

    def __enter__(self) -> ActivationMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


# --------------------------------------------------------------------------------------------------
# The component


def mha_parameter_names(model: torch.nn.Module) -> list[str]:
    """Parameters skip-MHA leaves without gradient: every attention module's and its block's pre-norm
    (``attention_norm``)."""
    names = []
    for prefix, mod in model.named_modules():
        if isinstance(mod, Attention):
            block = prefix.rsplit(".", 1)[0] if "." in prefix else ""
            names += [f"{prefix}.{n}" for n, _ in mod.named_parameters()]
            try:
                norm = model.get_submodule(f"{block}.attention_norm") if block else None
            except AttributeError:
                norm = None
            if norm is not None:
                names += [f"{block}.attention_norm.{n}" for n, _ in norm.named_parameters()]
    return names


class MeCeFO:
    """MeCeFO's approximations on one model (see the module docstring). ``MeCeFO(cfg).install(trainer)`` on a
    Trainer; ``MeCeFO(cfg).attach(model)`` and :meth:`degraded_mode` on a bare model."""

    def __init__(self, config: MeCeFOConfig | None = None):
        self.cfg = (config or MeCeFOConfig()).validate()
        self.degraded = False
        self.pending = PendingProjection()  # the deferred V1^T products of the step (defer_projection)
        self.step = 0  # the step the bases' ages are counted against (set per micro-batch on a Trainer)
        self.bases: dict[str, torch.Tensor] = {}  # FFN weight name -> V1 (in_features x r)
        self.refreshed: dict[str, int] = {}  # FFN weight name -> step of its SVD
        self.svd_refreshes = 0
        self.svd_s = 0.0
        self.degraded_micro_batches = 0
        self.model: torch.nn.Module | None = None
        self._removers: list[Callable[[], None]] = []
        self._ffn_names: dict[int, str] = {}  # id(FeedForward) -> its module name
        self._block_of: dict[int, torch.nn.Module] = {}  # id(FeedForward) -> its block (checkpointed or not)
        self._trainer: Trainer | None = None
        self._reset_step(-1)
        self.last: dict[str, Any] = {}  # the last committed step's figures (role, compute_s, ...)
        self.samples: list[dict[str, Any]] = []  # every monitored step's figures

    # ---- set-up ---------------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> MeCeFO:
        """Push the wrappers into every attention and FFN kernel slot of ``model`` (once)."""
        if self.model is not None:
            raise TrainguardError("MeCeFO is already attached to a model (detach it first)")
        modules = dict(model.named_modules())
        n_att = n_ffn = 0
        for name, mod in modules.items():
            if isinstance(mod, Attention):
                self._removers.append(mod.kernel.push(self._attention, name="mecefo-skip-mha"))
                n_att += 1
            elif isinstance(mod, FeedForward):
                self._removers.append(mod.kernel.push(self._ffn, name="mecefo-ffn"))
                self._ffn_names[id(mod)] = name
                parent = name.rsplit(".", 1)[0] if "." in name else ""
                self._block_of[id(mod)] = modules.get(parent, mod)
                n_ffn += 1
        if not n_att and not n_ffn:
            raise TrainguardError(f"MeCeFO found no attention or dense FFN module in {type(model).__name__}")
        self.model = model
        return self

    def detach(self) -> None:
        for remove in self._removers:
            remove()
        self._removers, self._ffn_names, self._block_of = [], {}, {}
        self.model = None

    def install(self, trainer: Trainer) -> MeCeFO:
        """Attach to ``trainer.model``, register the state (``"mecefo"``), the step callback and the metrics,
        and, on the elastic strategy, the per-micro-batch switch and the monitor."""
        self.attach(trainer.model)
        self._trainer = trainer
        trainer.register_state("mecefo", self)
        trainer.callbacks.append(self)
        trainer.metric_sources.append(self.metrics)
        strategy = trainer.strategy
        if hasattr(strategy, "micro_contexts"):
            strategy.micro_contexts.append(self.micro_batch_context)
            strategy.after_reduce.append(self._monitor)
        return self

    @contextlib.contextmanager
    def degraded_mode(self, on: bool = True, more: bool = False) -> Iterator[None]:
        """Switch the approximations on (or off) for what runs inside, forward and backward. ``more``: further
        degraded micro-batches of this step follow, so the low-rank weight gradient's ``V1^T`` product waits
        for the last of them (``defer_projection``); that one's backward returns the whole sum."""
        before = self.degraded, self.pending.defer
        self.degraded = bool(on)
        self.pending.defer = bool(on and more and self.cfg.defer_projection)
        try:
            yield
        finally:
            self.degraded, self.pending.defer = before

    # ---- state (registered with the trainer) -------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"bases": dict(self.bases), "refreshed": dict(self.refreshed), "degraded": self.degraded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bases = {k: v for k, v in state.get("bases", {}).items()}
        self.refreshed = {k: int(v) for k, v in state.get("refreshed", {}).items()}
        self.degraded = bool(state.get("degraded", False))

    # ---- the wrappers --------------------------------------------------------------------------------
    def _attention(self, module, call_next, x, cos, sin):
        if not (self.degraded and self.cfg.skip_mha and torch.is_grad_enabled()):
            return call_next(x, cos, sin)
        with torch.no_grad():  # the residual connection carries the gradient around the block
            return call_next(x, cos, sin)

    def _ffn(self, module, call_next, x):
        if not (self.degraded and torch.is_grad_enabled()):
            return call_next(x)
        bases = self._bases_for(module) if self.cfg.low_rank else {}
        recompute = self.cfg.recompute_ffn and not (is_wrapped(module) or is_wrapped(self._block_of.get(id(module), module)))
        reg = checkpoint_contexts(self.model)
        if recompute and self._fusable(module, x, reg):
            w1, w2, w3 = module.w1.weight, module.w2.weight, module.w3.weight
            return DegradedSwiGLU.apply(x, w1, w2, w3, bases.get(id(w1)), bases.get(id(w2)), bases.get(id(w3)),
                                        self.pending)
        run = call_next
        if bases:

            def run(t, _next=call_next, _bases=bases, _pending=self.pending):
                with _LowRankMode(_bases, _pending):
                    return _next(t)

        if recompute:
            return checkpoint(run, x, use_reentrant=False, context_fn=reg.context_fn, early_stop=reg.early_stop)
        return run(x)

    @staticmethod
    def _fusable(module, x: torch.Tensor, reg) -> bool:
        """The fused recompute applies when nothing else sits in the FFN's slot (the default SwiGLU body runs
        underneath), no checkpoint context needs entering around the recompute, and no autocast is active."""
        return (module.kernel.names == ["mecefo-ffn"] and not reg.factories
                and not torch.is_autocast_enabled(x.device.type)
                and all(getattr(module, w).bias is None for w in _FFN_WEIGHTS))

    def _bases_for(self, module) -> dict[int, torch.Tensor]:
        """{id(weight): V1} of the FFN's weights, refreshed when absent or ``tau`` steps old."""
        prefix = self._ffn_names[id(module)]
        out = {}
        for attr in _FFN_WEIGHTS:
            lin = getattr(module, attr, None)
            if lin is None:
                continue
            name = f"{prefix}.{attr}.weight"
            w = lin.weight
            if name not in self.bases or self.step - self.refreshed.get(name, -math.inf) >= self.cfg.tau \
                    or self.bases[name].device != w.device:
                t0 = time.perf_counter()
                self.bases[name] = low_rank_basis(w, self.cfg.rank)
                self.refreshed[name] = self.step
                self.svd_s += time.perf_counter() - t0
                self.svd_refreshes += 1
            out[id(w)] = self.bases[name]
        return out

    def refresh_bases(self, step: int) -> float:
        """Compute every FFN weight's V1 now (as a degraded step would); returns the seconds it took."""
        self.step = step
        t0 = time.perf_counter()
        for mod in self.model.modules():
            if isinstance(mod, FeedForward):
                for attr in _FFN_WEIGHTS:
                    self.bases.pop(f"{self._ffn_names[id(mod)]}.{attr}.weight", None)
                self._bases_for(mod)
        return time.perf_counter() - t0

    # ---- on a Trainer: per step, per micro-batch, after the reduction ------------------------------------
    def _reset_step(self, step: int) -> None:
        self._acc_step = step
        self.pending.clear()  # parts of an abandoned attempt (the step is computed afresh)
        self._compute_s = 0.0
        self._n_micro = 0
        self._n_degraded = 0
        self._act_peak = {"neighbor": 0, "exact": 0}
        self._approx: torch.Tensor | None = None  # sum of this replica's degraded weighted gradients (sampled steps)
        self._mine: list[MicroBatch] = []  # this replica's degraded micro-batches of the step
        self._sample: dict[str, Any] = {}

    def sampled(self, step: int) -> bool:
        return self.cfg.monitor_every > 0 and step % self.cfg.monitor_every == 0

    def on_step_start(self, trainer: Trainer, step: int) -> None:  # every attempt of a step starts afresh
        self._reset_step(step)

    def on_step_end(self, trainer: Trainer, result) -> None:
        role = "neighbor" if self._n_degraded else ("normal" if self._n_micro else "idle")
        self.last = {"step": result.step, "role": role, "compute_s": self._compute_s, "micro_batches": self._n_micro,
                     "degraded_micro_batches": self._n_degraded, **self._sample}
        if self._sample:
            self.samples.append(dict(self.last))

    @contextlib.contextmanager
    def micro_batch_context(self, trainer: Trainer, mb: MicroBatch) -> Iterator[None]:
        """Entered by the elastic strategy around one micro-batch: degraded iff tagged ``neighbor``."""
        step = trainer.step_idx
        if step != self._acc_step:  # a healed replica jumped to its peer's step
            self._reset_step(step)
        self.step = step
        degraded = NEIGHBOR in mb.tags
        sampled = self.sampled(step)
        meter = ActivationMeter(trainer.model, list(self.bases.values())) if sampled else contextlib.nullcontext()
        t0 = time.perf_counter()
        with self.degraded_mode(degraded, more=degraded and _more_degraded(trainer, mb)), meter:
            yield
            if sampled and degraded and not mb.keep:
                flat = _flat_grads(trainer.model)
                self._approx = flat if self._approx is None else self._approx + flat
        self._compute_s += time.perf_counter() - t0
        self._n_micro += 1
        if degraded:
            self._n_degraded += 1
            self.degraded_micro_batches += 1
            if not mb.keep:
                self._mine.append(mb)
        if sampled:
            key = "neighbor" if degraded else "exact"
            self._act_peak[key] = max(self._act_peak[key], meter.peak)
            self._sample.update({f"act_peak_mb_{key}": self._act_peak[key] / 2**20})

    def _monitor(self, trainer: Trainer, view: StepView, plan: SyncPlan) -> None:
        """On a sampled degraded step: the relative error of this step's gradient vs the failure-free one."""
        if not self.sampled(view.step):
            return
        tagged = [mb for mbs in plan.work.values() for mb in mbs if not mb.keep and NEIGHBOR in mb.tags]
        if not tagged:
            return
        err = self.gradient_error(trainer, plan, self._mine, self._approx, allreduce=_group_allreduce(trainer))
        if err is not None:
            self._sample.update(err)

    def gradient_error(self, trainer: Trainer, plan: SyncPlan, mine: list[MicroBatch], approx: torch.Tensor | None,
                       allreduce: Callable[[torch.Tensor], bool] | None = None) -> dict[str, float] | None:
        """``||g_failure_free - g|| / ||g_failure_free||`` for the gradient ``g`` now in ``p.grad`` (the step's sum
        over every counted slice). ``mine``: this replica's degraded micro-batches, whose weighted gradients sum to
        ``approx``; they are recomputed exactly here. ``allreduce`` sums the correction over the replicas (None:
        this process computed every degraded slice). The failure-free gradient weighs every slice by its
        micro-batch weight, attention included. None if the all-reduce failed."""
        model = trainer.model
        params = [p for p in model.parameters() if p.requires_grad]
        g = _flat_grads(model)
        saved = [None if p.grad is None else p.grad.clone() for p in params]
        try:
            model.zero_grad(set_to_none=True)
            with self.degraded_mode(False):
                for mb in mine:
                    x, y = trainer.micro_batch(trainer.step_idx, mb)
                    loss = trainer.compute_loss(x, y)
                    (loss * mb.weight).backward()
            exact = _flat_grads(model)
        finally:
            for p, s in zip(params, saved):
                p.grad = s
        corr = exact - approx if approx is not None else exact
        if allreduce is not None and not allreduce(corr):
            return None
        mha = _mask(model, mha_parameter_names(model), g)
        factor = _mha_factor(plan)
        ref = g + corr
        if factor != 1.0:
            ref = torch.where(mha, g * factor + corr, ref)
        ref_norm = float(ref.norm())
        diff = ref - g
        out = {"grad_rel_error": float(diff.norm()) / ref_norm if ref_norm > 0 else 0.0}
        rest = ~mha
        if bool(mha.any()):
            n = float(ref[mha].norm())
            out["grad_rel_error_mha"] = float(diff[mha].norm()) / n if n > 0 else 0.0
        n = float(ref[rest].norm())
        out["grad_rel_error_other"] = float(diff[rest].norm()) / n if n > 0 else 0.0
        return out

    def metrics(self) -> dict[str, Any]:
        """Numbers for the trainer's metrics records (the last committed step)."""
        out = {"mecefo_degraded_micro_batches": self.last.get("degraded_micro_batches", 0),
               "mecefo_compute_s": round(self.last.get("compute_s", 0.0), 4), "mecefo_svd_refreshes": self.svd_refreshes}
        if "grad_rel_error" in self.last:
            out["mecefo_grad_rel_error"] = self.last["grad_rel_error"]
        return out


def _more_degraded(trainer: Trainer, mb: MicroBatch) -> bool:
    """Does this replica compute another degraded micro-batch after ``mb`` in this step (by the plan as it stands:
    a recovery appends its extra micro-batches to the plan before computing them)?"""
    strategy = trainer.strategy
    plan = getattr(strategy, "sync_plan", None)
    if plan is None:
        return False
    work = plan.work.get(strategy.replica_id, [])
    at = next((i for i, w in enumerate(work) if w.index == mb.index and w.keep == mb.keep), None)
    return at is not None and any(NEIGHBOR in w.tags for w in work[at + 1:])


def _flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                      for p in model.parameters() if p.requires_grad])


def _mask(model: torch.nn.Module, names: list[str], like: torch.Tensor) -> torch.Tensor:
    wanted = set(names)
    parts = [torch.full((p.numel(),), n in wanted, dtype=torch.bool, device=like.device)
             for n, p in model.named_parameters() if p.requires_grad]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)


def _mha_factor(plan: SyncPlan) -> float:
    """(micro-batch weight) / (attention weight) of the slices that computed attention gradients (1 without
    group weights)."""
    ws = plan.group_weights.get(MHA_GROUP)
    if not ws:
        return 1.0
    factors = {mb.weight / ws[mb.index] for mbs in plan.work.values() for mb in mbs
               if not mb.keep and ws.get(mb.index, 0.0) > 0}
    if len(factors) != 1:
        raise TrainguardError(f"MeCeFO monitor: attention weights are not one multiple of the slice weights ({factors})")
    return factors.pop()


def _group_allreduce(trainer: Trainer) -> Callable[[torch.Tensor], bool] | None:
    group = getattr(trainer.strategy, "group", None)
    return group.allreduce_sum if group is not None else None


__all__ = ["MHA_GROUP", "NEIGHBOR", "ActivationMeter", "LowRankLinear", "MeCeFO", "MeCeFOConfig", "PendingProjection", "low_rank_basis",
           "mha_parameter_names"]
