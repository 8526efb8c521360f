"""Activation-gradient checkpointing (AGC): a segment of connected forward, input-gradient and weight-gradient
ops checked by replaying it from its boundary tensors in an idle window (SpareTrain, section 5.2).

A :class:`Tape` records, as the segment's ops execute (forward ops in the forward, their gradient ops in
the backward), each op and where its tensor inputs come from:

* an output of an earlier op of the same segment (or a recompute of one: the same value) -> a *slot*, not
  kept: the replay recomputes it;
* a view of such an output -> the same view of the replayed slot;
* a parameter -> by reference (only the optimizer changes parameters, after every check has run);
* anything else -> a *boundary tensor*, kept until the replay: by reference with its version counter when
  it was computed in this attempt, cloned otherwise (a pipeline receive buffer is reused without a
  version bump). The segment's memory cost is these boundary tensors only.

Each op's primary output leaves a fingerprint. The replay re-runs the tape in order on fresh tensors and
compares every op's output with its fingerprint (and the outputs of recompute ops that were aliased to a
slot with that slot's replayed value): every op of the segment is executed twice and compared, from the
boundary tensors alone. Relies on torch only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trainguard.sdc.dmr import ops as dops


class StaleInput(Exception):
    """A boundary tensor was changed in place before the replay (the segment cannot be checked)."""


@dataclass
class _Entry:
    op_id: str
    func: Any
    spec: Any  # how (args, kwargs) were flattened (dops.flatten_call)
    leaves: list[Any]  # ("slot", k) | ("view", k, size, stride, offset) | ("keep", tensor, version) | value
    expect: list[Any]  # fingerprints of the primary's output (and of aliased recompute outputs)
    out_slots: list[int]


@dataclass
class Tape:
    seg_id: str
    window: str | None
    n_ops: int  # ops the plan assigned to this segment (the tape is complete when all ran)
    entries: list[_Entry] = field(default_factory=list)
    # id(tensor) -> (weak reference, slot): a tensor the primary run no longer holds is not kept alive here; if
    # the same value comes back as a new Python object it is treated as a boundary tensor (still correct)
    slots: dict[int, tuple[weakref.ref, int]] = field(default_factory=dict)
    n_slots: int = 0
    kept_bytes: int = 0
    seen: set[str] = field(default_factory=set)
    aliases: list[tuple[int, Any]] = field(default_factory=list)  # (slot, fingerprint of a recompute output)
    replayed: bool = False
    kept_storages: set[int] = field(default_factory=set)  # storages of the boundary tensors kept by reference

    @property
    def complete(self) -> bool:
        return len(self.seen) >= self.n_ops

    def _slot(self, t: torch.Tensor) -> int | None:
        hit = self.slots.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def record(self, op_id: str, func, args, kwargs, out, fingerprint: Callable[[Any], Any],
               is_param: Callable[[torch.Tensor], bool], produced_here: Callable[[torch.Tensor], bool]) -> None:
        leaves, spec = dops.flatten_call(args, kwargs)
        rec: list[Any] = []
        for x in leaves:
            if not isinstance(x, torch.Tensor):
                rec.append(x)
                continue
            k = self._slot(x)
            if k is not None:
                rec.append(("slot", k))
                continue
            base = x._base
            kb = self._slot(base) if base is not None else None
            if kb is not None:
                rec.append(("view", kb, tuple(x.shape), tuple(x.stride()), x.storage_offset() - base.storage_offset()))
                continue
            if is_param(x):
                rec.append(("keep", x, None))
                continue
            kept = x if produced_here(x) else x.clone()
            if kept is x:
                self.kept_storages.add(dops.storage_key(x))
            self.kept_bytes += kept.numel() * kept.element_size()
            rec.append(("keep", kept, kept._version))
        outs = dops.tensors(out)
        out_slots = []
        for t in outs:
            self.slots[id(t)] = (weakref.ref(t), self.n_slots)
            out_slots.append(self.n_slots)
            self.n_slots += 1
        self.entries.append(_Entry(op_id, func, spec, rec, [fingerprint(out)], out_slots))
        self.seen.add(op_id)

    def alias(self, op_id: str, twin_out_slots: list[int], out, fingerprint: Callable[[Any], Any]) -> None:
        """A recompute op that re-executed a taped forward op: its output is that op's slot value (later
        gradient ops read it), and it is checked against the replay."""
        for t, k in zip(dops.tensors(out), twin_out_slots):
            self.slots[id(t)] = (weakref.ref(t), k)
            self.aliases.append((k, fingerprint(t)))
        self.seen.add(op_id)

    def entry_of(self, op_id: str) -> _Entry | None:
        return next((e for e in self.entries if e.op_id == op_id), None)

    def repoint(self, key: int, alias: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Boundary tensors kept by reference on the storage ``key`` (a gradient about to take another storage,
        ``set_``) are kept as ``alias(t)`` instead: the same storage, a version counter of its own."""
        if key not in self.kept_storages:
            return
        for e in self.entries:
            for i, leaf in enumerate(e.leaves):
                if isinstance(leaf, tuple) and leaf and leaf[0] == "keep" and leaf[2] is not None:
                    t = alias(leaf[1])
                    if t is not leaf[1]:  # (one changed in place since it was kept stays stale: a version it never has)
                        e.leaves[i] = ("keep", t, t._version if leaf[1]._version == leaf[2] else -1)

    def replay(self, fingerprint: Callable[[Any], Any], agree: Callable[[str, Any, Any], bool]) -> str | None:
        """Re-run the tape; returns the id of the first op whose replay differs (None: all agree)."""
        values: dict[int, torch.Tensor] = {}
        for e in self.entries:
            args = []
            for leaf in e.leaves:
                if isinstance(leaf, tuple) and leaf and leaf[0] == "slot":
                    args.append(values[leaf[1]])
                elif isinstance(leaf, tuple) and leaf and leaf[0] == "view":
                    base = values[leaf[1]]
                    args.append(base.as_strided(leaf[2], leaf[3], base.storage_offset() + leaf[4]))
                elif isinstance(leaf, tuple) and leaf and leaf[0] == "keep":
                    if leaf[2] is not None and leaf[1]._version != leaf[2]:
                        raise StaleInput(e.op_id)
                    args.append(leaf[1])
                else:
                    args.append(leaf)
            a, k = dops.unflatten_call(args, e.spec)
            out = dops.clear_unset(e.func, a, k, e.func(*a, **k))
            if not agree(str(e.func), e.expect[0], fingerprint(out)):
                return e.op_id
            for t, slot in zip(dops.tensors(out), e.out_slots):
                values[slot] = t
        for slot, fp in self.aliases:
            if slot in values and not agree("recompute", fp, fingerprint(values[slot])):
                return f"recompute of slot {slot}"
        return None
