"""Deferred checks (part of :class:`~trainguard.sdc.dmr.engine.DMREngine`): D-DMR and dynamic ops' inputs kept for
their window, and gradients updated in place run out of place so that their checks can be deferred like any other
op's. Relies on torch (storages, version counters, weak references).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from trainguard.sdc.dmr import ops as dops
from trainguard.sdc.dmr.dynamic import Entry
from trainguard.sdc.dmr.engine.common import Deferred, _alias, _primary, _Stale, _storage_key, _storage_or_none
from trainguard.sdc.dmr.plan import CARRY


class DeferredChecks:
    """The engine's deferred checks (a part of DMREngine: it reads and writes the engine's state)."""

    # ---- deferred checks (D-DMR, AGC, dynamic) -----------------------------------------------------
    def _defer(self, op_id, phase, strategy, window, func, args, kwargs, ins=None, swap=None, inf=None) -> Any:
        inf = inf if inf is not None else dops.info(func)
        if (inf.random and dops.random_call(inf, args, kwargs)) or (inf.written and dops.written_args(func, args, kwargs)):
            if swap is not None:
                return self._swapped(op_id, phase, strategy, window, swap, args, kwargs)
            # in-place and random ops are checked at once (their inputs or generator change right after)
            self.counts["naive-fallback"] += 1
            return self._naive(op_id, phase, func, args, kwargs)
        # Inputs computed in this attempt are kept by reference (the check keeps them alive until its window)
        # with their version counters: one changed in place before the check cannot be checked any more, which
        # the check reports instead of passing. Inputs from outside the attempt (a pipeline receive buffer,
        # which the next micro-batch overwrites without a version bump) are cloned; parameters are neither
        # (only the optimizer changes them, after every check has run). One pass over the inputs, each
        # storage looked up once: this runs for every deferred op on the main thread.
        kept_ins: list[torch.Tensor] = []
        versions: list[int] = []
        by_ref: list[tuple[int, torch.Tensor]] = []  # (storage, tensor) kept by reference
        clones: dict[int, torch.Tensor] | None = None
        nbytes = 0
        for t in (dops.call_tensors(args, kwargs) if ins is None else ins):
            key, mine = self._storage_of(t)
            if key not in self._param_storages:
                if mine:
                    by_ref.append((key, t))
                else:
                    clones = clones if clones is not None else {}
                    c = clones.get(id(t))
                    if c is None:
                        c = clones[id(t)] = t.clone()
                        self.counts["input-cloned"] += 1
                    t = c
                nbytes += t.nbytes
            kept_ins.append(t)
            versions.append(t._version)
        kept = (args, kwargs) if clones is None else dops.map_tensors(lambda v: clones.get(id(v), v), (args, kwargs))
        held = {"args": kept, "ins": kept_ins, "versions": versions}
        if strategy != "dynamic" and not self._fits(nbytes):
            self.counts["naive-fallback"] += 1
            return self._naive(op_id, phase, func, args, kwargs)
        t0 = time.perf_counter()
        out = _primary(func, args, kwargs, inf)
        est = time.perf_counter() - t0
        if self._sync is not None and self.plan is not None and (planned := self.plan.ops.get(op_id)) is not None:
            est = planned.time_s  # (on a device the host time is the launch's; the profile's is the kernel's)

        def run(held=held, before_update: Callable | None = None):
            try:
                args = held["args"]
                if before_update is None:
                    if any(t._version != v for t, v in zip(held["ins"], held["versions"])):
                        raise _Stale
                else:  # carried past the update: parameters as the primary read them (the update's verified copy)
                    if any(t._version != v and before_update(t) is t for t, v in zip(held["ins"], held["versions"])):
                        raise _Stale
                    args = tree_map(lambda t: before_update(t) if isinstance(t, torch.Tensor) else t, args)
                return dops.clear_unset(func, args[0], args[1], func(*args[0], **args[1]))
            finally:
                held["args"], held["ins"], held["versions"] = None, [], []  # checked: the inputs are released

        # An input kept by reference may later be handed to a collective that writes it outside the dispatcher
        # (a receive reusing the buffer), or be written in place by a later op: it is copied first (see
        # _settle_written), so the check reads the value the primary read, never a buffer being written by a
        # transfer while the worker runs.
        if self.deferrable:
            for key, t in by_ref:
                self._kept_by_storage.setdefault(key, []).append((held, weakref.ref(t)))

        # the output's fingerprint, or (``fingerprints = false``) a copy of it, counted against the budget
        expect = self._fp_later(out) if self.cfg.fingerprints else tree_map(
            lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)
        if not self.cfg.fingerprints:
            nbytes += dops.bytes_of(dops.tensors(expect))
        d = Deferred(op_id, inf.name, phase, strategy, window, run, expect, nbytes, est, held=held)
        if strategy == "dynamic":
            self.dynamic.enqueue(Entry(op_id, nbytes, est, lambda d=d: self._check(d, "dynamic")))
        else:
            self.queue.append(d)
            self.queued_bytes += nbytes
        return out

    # ---- gradients updated in place, deferred like any other op ------------------------------------------
    # Autograd accumulates each micro-batch's weight gradient into ``p.grad`` in place (``add_``), and a model or
    # strategy may scale one in place (``div_``, ``mul_``; the trainer's own strategies use one list op over every
    # gradient, checked in pieces by _verified_optimizer): checked at once, each is a copy, a second execution and
    # two checksum passes over the gradient, on the critical path. When nothing but the engine shares the
    # gradient's storage, the op runs out of place instead (same kernel, bitwise the same values) and ``p.grad``
    # takes the result's storage (``set_``, no data moved). The gradient as it was stays untouched in its old
    # storage, so the check is an ordinary deferred one: its inputs kept by reference, its output's fingerprint
    # taken later, checked in a window like the op's neighbours.
    def _grad_swap(self, func, args, kwargs) -> Any:
        """The out-of-place form of ``func`` if it updates a parameter's gradient in place and may be swapped. A
        list op (``_foreach_div_`` averaging every gradient, clipping's ``_foreach_mul_``) runs after the step's
        last window: it is swapped only where its check can be carried into the next iteration (``_carrying``) and
        the plan carries list ops (``Plan.carry_lists``: Phase 3 with an unbounded carry), and then only if every
        tensor of its list is a gradient."""
        oop = dops.out_of_place(func)
        if oop is None or not args or self._model is None:
            return None
        g = args[0]
        many = isinstance(g, (list, tuple))
        gs = list(g) if many else [g]
        if many and not (gs and self._carrying() and (self.plan is None or self.plan.carry_lists)):
            return None
        for t in gs:
            if not self._is_grad(t):
                return None
        other = args[1] if len(args) > 1 else kwargs.get("other")
        if isinstance(other, torch.Tensor) and any(other.dtype != t.dtype or other.device != t.device or
                                                   (other.shape != t.shape and other.dim() != 0) for t in gs):
            return None  # (the out-of-place form would promote or broadcast differently)
        return oop

    def _fits(self, nbytes: int) -> bool:
        """A check keeping ``nbytes`` of inputs fits the memory budget with those already queued and carried."""
        return not self.budget_bytes or self.queued_bytes + self.carried_bytes + nbytes <= self.budget_bytes

    def _is_grad(self, g: Any) -> bool:
        """``g`` is a parameter's gradient, with a storage of its own (swappable)."""
        if type(g) is not torch.Tensor or g._is_view() or not g.is_contiguous() or g.requires_grad:
            return False  # (a view, e.g. DDP's gradient-as-bucket-view, shares its storage with its base)
        ref = self._grads.get(id(g))
        if ref is None or ref() is not g:
            self._grads = {id(p.grad): weakref.ref(p.grad) for p in self._model.parameters() if p.grad is not None}
            ref = self._grads.get(id(g))
        return ref is not None and ref() is g

    def _swapped(self, op_id, phase, strategy, window, oop, args, kwargs) -> torch.Tensor | None:
        g = args[0]
        many = isinstance(g, (list, tuple))
        gs = list(g) if many else [g]
        # the gradients so far: their storage is not written again (each takes the result's below). Tensors of their
        # own, not detach(): that shares g's version counter, which set_ bumps
        olds = []
        for t in gs:
            old = _alias(t)
            self._mark_produced(old)
            self._repoint(t)
            olds.append(old)
        queued = len(self.queue)
        out = self._defer(op_id, phase, strategy, window, oop, (olds if many else olds[0], *args[1:]), kwargs)
        outs = list(out) if many else [out]
        for t, o in zip(gs, outs, strict=True):
            if o.shape != t.shape or o.dtype != t.dtype:  # (excluded by _grad_swap; never silently wrong)
                raise RuntimeError(f"{oop} computed {tuple(o.shape)} {o.dtype} for a gradient of "
                                   f"{tuple(t.shape)} {t.dtype}")
            t.set_(o if o.stride() == t.stride() else o.contiguous())
        self.counts["gradient-swapped"] += len(gs)
        if window == CARRY and self.update_stage and len(self.queue) > queued:
            # made after this iteration's drain (clipping, in the update stage): straight into the carried checks
            d = self.queue.pop()
            self.queued_bytes -= d.nbytes
            self._carry([d])
        return None if many else g

    def _carry(self, ds: list[Deferred]) -> None:
        """Checks ``ds``, and the fingerprints still to be taken (with the comparisons waiting for them), carried
        into the next iteration (its windows, else its drain)."""
        for d in ds:
            d.carried, d.strategy = True, "carried"
        self._carried += ds
        self._carried_step = self.step
        self.carried_bytes += sum(d.nbytes for d in ds)
        self.counts["carried"] += len(ds)
        self._carried_fifo.extend(self._later_fifo)  # (re-registered by storage when the next attempt starts)
        self.counts["fingerprints-carried"] += len(self._later_fifo)
        self._later_fifo.clear()

    def _repoint(self, g: torch.Tensor) -> None:
        """Fingerprints still to be taken and queued checks that keep a tensor on ``g``'s storage by reference (the
        first micro-batch's gradient is the weight-gradient op's output itself, or an alias of it sharing its
        version counter) keep an alias of their own instead: the same storage, which ``g.set_`` is about to leave
        and nothing writes afterwards; their version counter is then not bumped by the ``set_``. Nothing is
        computed here."""
        key = _storage_key(g)
        aliases: dict[int, torch.Tensor] = {}

        def swap(v: torch.Tensor) -> torch.Tensor:
            if _storage_key(v) != key:
                return v
            a = aliases.get(id(v))
            if a is None:
                a = aliases[id(v)] = _alias(v)
            return a
        # A tensor already changed in place since it was kept (a copy_ into the gradient, say) stays unusable: its
        # alias gets a version it can never have, so the check still reports it stale instead of reading new values.
        for lz in self._later_by_storage.get(key, ()):
            if lz.value is not None:
                stale = [t._version != v for t, v in zip(dops.tensors(lz.value), lz.versions)]
                lz.value = dops.map_tensors(swap, lz.value)
                lz.versions = [-1 if s else t._version for t, s in zip(dops.tensors(lz.value), stale)]
        for held, _ in self._kept_by_storage.get(key, ()):
            if held["args"] is not None:
                stale = [t._version != v for t, v in zip(held["ins"], held["versions"])]
                held["args"] = dops.map_tensors(swap, held["args"])
                held["ins"] = [swap(v) for v in held["ins"]]
                held["versions"] = [-1 if s else v._version for v, s in zip(held["ins"], stale)]
        for tape in self._tapes.values():
            tape.repoint(key, swap)

    def _produced_here(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in a storage an op of this attempt wrote (its output, or any view or alias of it:
        ``detach`` and ``_unsafe_view`` included, whose outputs autograd does not tie to their inputs)."""
        return self._storage_of(t)[1]

    def _storage_of(self, t: torch.Tensor) -> tuple[int, bool]:
        """``t``'s storage key (see ``ops.storage_key``) and whether an op of this attempt wrote that storage. The
        storage's Python object lives exactly as long as the storage (torch keeps one per storage), so the weak
        reference kept for it dies with it, and a new storage at the same address is never taken for it."""
        st = _storage_or_none(t)
        if st is None:  # (a tensor without storage: nothing can write into it)
            return id(t), False
        key = st.data_ptr()
        ref = self._produced.get(key)
        return key, ref is not None and ref() is st

    def _is_param(self, t: torch.Tensor) -> bool:
        st = _storage_or_none(t)
        return st is not None and st.data_ptr() in self._param_storages
