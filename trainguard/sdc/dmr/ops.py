"""What DMR does with one ATen op: classify it, run it a second time, and compare the two executions.

Classes (:func:`classify`):

* ``view`` — aliasing ops (``view``, ``t``, ``detach``, ``expand`` ...): no arithmetic, never re-executed;
* ``comm`` — collectives and point-to-point transfers (``c10d``, ``_c10d_functional``): never re-executed
  (a second all-reduce would be a different collective, and the peers would wait for it);
* ``alloc`` — ``empty*`` (uninitialised memory: two executions legitimately differ) and profiler markers;
* ``compute`` — everything else, in-place ops included. Ops tagged ``nondeterministic_seeded`` (random
  ops, SDPA with dropout) are re-executed with the generator state replayed. The fused attention kernels of
  CUDA return their RNG seed and offset uninitialised when they draw nothing (``dropout_p == 0``): two
  executions differ there by whatever the memory held, so :func:`clear_unset` zeroes them after each.

Comparison is **bitwise** (the integer views of the outputs are equal; NaN equals the same NaN) where
execution is deterministic, as on CPU, or within a **calibrated tolerance** per op name (see
``determinism.py``). A :class:`Fingerprint` is a compact summary of an output that still sees every single
bit flip (the sum of the integer view changes by a power of two) and most multiple flips (a second,
strided sum); deferred and piggyback checks compare fingerprints so the full output need not be kept.
Relies on torch only.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
_VIEW_LIKE = ("aten._unsafe_view", "aten.alias", "aten.lift_fresh")


@dataclass(frozen=True)
class OpInfo:
    """What DMR needs to know about an op overload, computed once per overload (the hot path reads it)."""

    name: str
    kind: str  # compute | view | comm | alloc
    random: bool  # draws random numbers (seeded tag or a generator argument)
    written: tuple[tuple[int, str], ...]  # (position, name) of the arguments it writes
    unset: tuple[int, ...] = ()  # outputs left uninitialised when ``dropout_p`` (argument ``dropout_at``) is 0
    dropout_at: int = -1
    # a view op that nothing checks (the engine's short path: no written argument). The engine returns it unchanged,
    # so :func:`views_past_python` may send it past Python modes
    plain_view: bool = False
    # the op's C++ entry point (``OpOverload._op``, private): what ``OpOverload.__call__`` calls, without its Python
    # frame, which every dispatched op paid once more for its primary execution
    call: Any = None


# by the overload's id: an ``OpOverload`` hashes in Python (``__hash__`` is a method of its class), which every
# dispatched op paid for each lookup keyed by the op itself. ``_KEPT`` keeps each overload alive, so an id found
# here is never one reused by another object
_INFO_BY_ID: dict[int, OpInfo] = {}
_KEPT: list[Any] = []
# Outputs of the fused attention kernels (efficient, flash, cuDNN) that only carry the dropout RNG's state: the
# kernels allocate them with ``at::empty`` and write nothing there when ``dropout_p`` is 0 (backward reads them
# only when it is not).
_RNG_STATE_OUTPUTS = ("philox_seed", "philox_offset", "rng_state", "unused")


def info(func) -> OpInfo:
    got = _INFO_BY_ID.get(id(func))
    if got is None:
        args = func._schema.arguments
        written = tuple((i, a.name) for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write)
        rnd = is_random(func) or any(a.name == "generator" for a in args)
        dropout_at = next((i for i, a in enumerate(args) if a.name == "dropout_p"), -1)
        unset = tuple(i for i, r in enumerate(func._schema.returns) if r.name in _RNG_STATE_OUTPUTS) \
            if dropout_at >= 0 else ()
        kind = classify(func)
        got = _INFO_BY_ID[id(func)] = OpInfo(
            str(func), kind, rnd, written, unset, dropout_at, plain_view=kind == "view" and not written,
            call=getattr(func, "_op", func))
        _KEPT.append(func)
    return got


@contextlib.contextmanager
def views_past_python(keep: Iterable[str] = ()) -> Iterator[int]:
    """While in this context, the view ops seen so far (:attr:`OpInfo.plain_view`: nothing written; ``alias`` and
    ``_unsafe_view`` included) skip every Python dispatch mode: a fallthrough kernel at the dispatcher's ``Python`` key
    sends them straight to their kernels in C++. The DMR engine returns them unchanged (nothing to check, record or
    settle: it knows a view's output by its storage), and taking them through Python cost about 20 us each (19 us a
    mode's floor, measured with torch's profiler; about 3,500 of them a step per ``llama-60m`` pipeline stage).
    ``detach`` is registered too, but still reaches the modes: while one is active, torch's
    ``TensorImpl::shallow_copy_and_detach`` calls it with ``aten.detach`` directly, past the dispatcher (about 1,100
    a step per stage there, from activation checkpointing and autograd). Yields how many ops go past.

    The registration is process-wide, not per thread: every Python dispatch mode (the fault injector's too) and
    every ``__torch_dispatch__`` tensor subclass stops seeing these ops until the context exits, so callers enter
    it only while no other thread dispatches ops and where no tensor subclass is in use. Ops with a Python-key
    kernel of their own are left alone, and so are ops whose names match a pattern in ``keep`` (``fnmatch``: a
    fault injector's op sites that count views). Relies on ``torch.library.Library`` and its
    ``fallthrough_kernel`` (public) and on ``Library._destroy`` (private, torch 2.13:
    ``tests/sdc/dmr/test_torch_private.py`` fails if it moves)."""
    keep = list(keep)
    ops = [f for f in _KEPT if f.namespace == "aten" and _INFO_BY_ID[id(f)].plain_view
           and not torch._C._dispatch_has_kernel_for_dispatch_key(f.name(), "Python")
           and not any(fnmatch.fnmatchcase(str(f), k) for k in keep)]
    if not ops:
        yield 0
        return
    lib = torch.library.Library("aten", "IMPL")
    try:
        for f in ops:
            lib.impl(f, torch.library.fallthrough_kernel, "Python")
        yield len(ops)
    finally:
        lib._destroy()


def dispatches_in_python(t: torch.Tensor) -> bool:
    """Whether ``t``'s ops go through Python at the dispatcher's ``Python`` key (a ``__torch_dispatch__`` subclass:
    DTensor, FakeTensor): :func:`views_past_python` would send its views past that code."""
    return torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python)


def _dropout_p(inf: OpInfo, args: tuple, kwargs: dict) -> Any:
    return args[inf.dropout_at] if len(args) > inf.dropout_at else kwargs.get("dropout_p", 0.0)


def random_call(inf: OpInfo, args: tuple, kwargs: dict) -> bool:
    """Whether this call draws random numbers: a random op's does, but a fused attention's without dropout
    (``dropout_p == 0``: its only randomness) does not, and can then be checked like any deterministic op."""
    return inf.random and (inf.dropout_at < 0 or _dropout_p(inf, args, kwargs) != 0)


def clear_unset(func, args: tuple, kwargs: dict, out: Any) -> Any:
    """``out`` with the outputs a fused attention kernel left uninitialised (no dropout: see
    :data:`_RNG_STATE_OUTPUTS`) zeroed, so that two executions compare equal there; every other op as is."""
    inf = info(func)
    if inf.unset:
        if _dropout_p(inf, args, kwargs) == 0:
            for i in inf.unset:  # (as integers of the same width: CUDA's fill has no kernel for every uint)
                out[i].view(_INT_VIEW[out[i].element_size()]).zero_()
    return out


def classify(func) -> str:
    name = str(func)
    if name.startswith(("c10d.", "_c10d_functional.", "c10d_functional.", "_dtensor.")):
        return "comm"
    parts = name.split(".")
    if parts[0] == "profiler" or (len(parts) > 1 and "empty" in parts[1]):
        return "alloc"
    if getattr(func, "is_view", False) or name.startswith(_VIEW_LIKE) or name in ("aten.detach.default",):
        return "view"
    if name.startswith("aten.set_") or name.startswith("aten.resize_"):
        return "view"
    return "compute"


def is_random(func) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())


def written_args(func, args: tuple, kwargs: dict, skip: tuple = ()) -> list[torch.Tensor]:
    """The tensors an in-place / out= op writes (its mutable arguments, but those named in ``skip``)."""
    out: list[torch.Tensor] = []
    for i, name in info(func).written:
        if name in skip:
            continue
        value = kwargs.get(name, args[i] if i < len(args) else None)
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif value is not None:
            out += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return out


def bytes_of(ts: Iterable[torch.Tensor]) -> int:
    """The bytes the tensors ``ts`` hold (elements x element size; views counted at their own size)."""
    n = 0
    for t in ts:  # (a loop, not sum() over a generator: this runs for nearly every op of a DMR step)
        n += t.nbytes
    return n


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """``t``'s storage (torch keeps one Python object per storage, for as long as it lives), or None for a tensor
    without one (nothing can write into it)."""
    try:
        return t.untyped_storage()
    except RuntimeError:
        return None


def storage_key(t: torch.Tensor) -> int:
    """Which memory ``t`` lives in (its storage's address): tensors with the same key alias each other."""
    st = storage_of(t)
    return id(t) if st is None else st.data_ptr()


# in-place elementwise ops and their out-of-place forms (see DMREngine._grad_swap)
_OUT_OF_PLACE = {"aten.add_.Tensor": ("add", "Tensor"), "aten.div_.Tensor": ("div", "Tensor"),
                 "aten.div_.Scalar": ("div", "Scalar"), "aten.mul_.Tensor": ("mul", "Tensor"),
                 "aten.mul_.Scalar": ("mul", "Scalar"),
                 # list ops over every gradient (averaging, clipping): the same kernel per tensor, out of place
                 "aten._foreach_div_.Scalar": ("_foreach_div", "Scalar"),
                 "aten._foreach_mul_.Scalar": ("_foreach_mul", "Scalar"),
                 "aten._foreach_mul_.Tensor": ("_foreach_mul", "Tensor")}
_OOP_CACHE: dict[Any, Any] = {}


def out_of_place(func) -> Any:
    """The out-of-place overload computing what the in-place elementwise ``func`` writes (``add_.Tensor`` ->
    ``add.Tensor``), None for any other op. Same kernel, same element order: bitwise the same values."""
    if func not in _OOP_CACHE:
        pair = _OUT_OF_PLACE.get(info(func).name)
        _OOP_CACHE[func] = getattr(getattr(torch.ops.aten, pair[0]), pair[1]) if pair else None
    return _OOP_CACHE[func]


def mutates(func) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def flat(value: Any) -> list[Any]:
    return tree_flatten(value)[0]


# what a value is, for the argument walks every dispatched op pays (cached per type: ``isinstance`` against
# ``torch.Tensor`` goes through its metaclass and costs ~160 ns for anything that is not a tensor)
_LEAF, _TENSOR, _SEQ, _MAP, _OTHER = 0, 1, 2, 3, 4
_LEAF_TYPES = (int, float, bool, str, complex, type(None), torch.dtype, torch.device, torch.layout,
               torch.memory_format)
_KINDS: dict[type, int] = {}


def _kind(tp: type) -> int:
    k = _KINDS.get(tp)
    if k is None:
        k = _KINDS[tp] = (_TENSOR if issubclass(tp, torch.Tensor) else
                          _SEQ if issubclass(tp, (tuple, list)) else  # (torch.Size, named tuples too)
                          _MAP if issubclass(tp, dict) else
                          _LEAF if issubclass(tp, _LEAF_TYPES) else _OTHER)
    return k


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs (tuples, lists and dicts of tensors and scalars; anything
    else through torch's pytree), in order."""
    k = _KINDS.get(type(value))
    if k == _TENSOR:  # the common cases first
        return [value]
    out: list[torch.Tensor] = []
    if value is not None:
        _collect(value, out, _kind(type(value)) if k is None else k)
    return out


_NUMBERS = (int, float, bool)


def call_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """``tensors((args, kwargs))`` for an op's call, without walking the pair itself (every compute op pays it).
    An argument list whose first element is a number is not walked: an op's list argument has one schema type,
    and a number list (``int[]``, ``SymInt[]``, ``float[]``, ``bool[]``: sizes, dims, strides) holds no tensor."""
    out: list[torch.Tensor] = []
    for vs in (args, kwargs.values()) if kwargs else (args,):
        for v in vs:
            k = _KINDS.get(type(v))
            if k == _TENSOR:
                out.append(v)
            elif k != _LEAF:
                if k is None:
                    k = _kind(type(v))
                if k != _SEQ or not v or type(v[0]) not in _NUMBERS:
                    _collect(v, out, k)
    return out


def _collect(value: Any, out: list[torch.Tensor], k: int) -> None:
    # (a plain walk is several times faster than torch's pytree, which every op of a DMR step would pay)
    if k == _TENSOR:
        out.append(value)
    elif k == _SEQ or k == _MAP:
        for v in (value if k == _SEQ else value.values()):
            kv = _KINDS.get(type(v))
            if kv == _TENSOR:
                out.append(v)
            elif kv != _LEAF:
                _collect(v, out, _kind(type(v)) if kv is None else kv)
    elif k == _OTHER:
        out.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


def flatten_call(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    """An op's ``(args, kwargs)`` as a list of leaves and a spec :func:`unflatten_call` rebuilds them from. Most ops'
    arguments are tensors, scalars and lists of scalars: those are split as they are (a list of scalars is one leaf,
    copied), several times faster than torch's pytree, which the rest (lists of tensors) still goes through."""
    leaves: list[Any] = []
    for v in (*args, *kwargs.values()):
        k = _KINDS.get(type(v))
        if k is None:
            k = _kind(type(v))
        if k == _SEQ and all(_kind(type(x)) == _LEAF for x in v):
            v = tuple(v) if type(v) is list else v  # (the caller may reuse its list; aten reads a tuple alike)
        elif k != _TENSOR and k != _LEAF:
            return tree_flatten((args, kwargs))
        leaves.append(v)
    return leaves, (len(args), tuple(kwargs))


def unflatten_call(leaves: list[Any], spec: Any) -> tuple[tuple, dict]:
    """The ``(args, kwargs)`` :func:`flatten_call` split into ``leaves`` (with tensors replaced as the caller chose)."""
    if type(spec) is tuple:
        n, keys = spec
        return tuple(leaves[:n]), dict(zip(keys, leaves[n:]))
    return tree_unflatten(leaves, spec)


def int_view(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.dtype == torch.bool:
        return t.to(torch.int8)
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_contiguous():
        t = t.contiguous()
    return t.view(_INT_VIEW[t.element_size()]) if t.is_floating_point() else t


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with every tensor replaced by ``fn(tensor)``: ``tree_map`` restricted to tensors, with a plain
    walk of the tuples, lists and dicts op arguments are made of (the hot path remaps every in-place op's
    arguments onto its copies)."""
    k = _KINDS.get(type(value))
    if k is None:
        k = _kind(type(value))
    if k == _TENSOR:
        return fn(value)
    if k == _LEAF:
        return value
    if type(value) in (tuple, list):
        return type(value)(map_tensors(fn, v) for v in value)
    if type(value) is dict:
        return {key: map_tensors(fn, v) for key, v in value.items()}
    if type(value) is torch.Size:
        return value
    return tree_map(lambda v: fn(v) if isinstance(v, torch.Tensor) else v, value)


# below this many bytes a tensor pair is compared element by element: cheaper than taking word sums
_SMALL_BYTES = 1 << 16


def checksums_equal(a: Any, b: Any) -> bool:
    """Two executions' outputs agree in shape, dtype and :func:`word_sums` (a single differing element is
    always caught; several differing elements escape only if their differences cancel in both sums). Two
    passes of fast word sums cost less than one element-by-element comparison; non-tensor outputs are
    compared exactly by :func:`bitwise_equal`."""
    xs = [a] if isinstance(a, torch.Tensor) else (list(a) if isinstance(a, (list, tuple)) else None)
    ys = [b] if isinstance(b, torch.Tensor) else (list(b) if isinstance(b, (list, tuple)) else None)
    if xs is None or ys is None or len(xs) != len(ys) or not all(isinstance(t, torch.Tensor) for t in (*xs, *ys)):
        return bitwise_equal(a, b)
    if any(x.shape != y.shape or x.dtype != y.dtype for x, y in zip(xs, ys)):
        return False
    if not xs:
        return True
    if sum(x.numel() * x.element_size() for x in xs) <= _SMALL_BYTES:
        return all(torch.equal(int_view(x), int_view(y)) for x, y in zip(xs, ys))
    return torch.equal(stack([s for x in xs for s in word_sums(x)]), stack([s for y in ys for s in word_sums(y)]))


def bitwise_equal(a: Any, b: Any) -> bool:
    """Outputs of two executions are bitwise identical (pytrees of tensors; non-tensors compared with ==)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(int_view(a), int_view(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b) and all(
            isinstance(x, torch.Tensor) for x in (*a, *b)):
        return all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(int_view(x), int_view(y)) for x, y in zip(a, b))
    fa, spec_a = tree_flatten(a)
    fb, spec_b = tree_flatten(b)
    if spec_a != spec_b or len(fa) != len(fb):
        return False
    for x, y in zip(fa, fb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(int_view(x), int_view(y)):
                return False
        elif x != y and not (x != x and y != y):  # NaN scalars are equal here
            return False
    return True


def stack(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack`` of scalars that may live on two devices: an op's outputs can (CUDA's memory-efficient and
    flash attention return their RNG seed and offset as CPU scalars), and so can a step's comparison flags. The
    CPU ones join the accelerator's, so that one transfer reads them all."""
    devices = {p.device for p in parts}
    if len(devices) > 1:
        device = next(d for d in devices if d.type != "cpu")
        parts = [p.to(device, non_blocking=True) for p in parts]
    return torch.stack(parts)


def word_sums(t: torch.Tensor) -> list[torch.Tensor]:
    """Two exact checksums of ``t``'s bits: the wrapping (mod 2^64) sum of its memory read as 64-bit words,
    and of every 7th word. A change of any single element changes one word by +-2^k, so the first sum always
    changes: one corrupted element is caught with certainty, like a full comparison. Integer addition mod
    2^64 is associative, so the sums do not depend on the reduction order (threads, vector width).
    Reading 64-bit words natively is ~10x faster than widening every element to int64 (memory-bound,
    cache-hot outputs); tensors that cannot be read as words (odd sizes or offsets) take the widening path."""
    v = t.detach()
    if v.dtype == torch.bool:
        v = v.view(torch.int8)
    if v.is_complex():
        v = torch.view_as_real(v)
    v = v.contiguous().reshape(-1)
    if v.numel() * v.element_size() % 8 == 0 and v.numel():
        # (which sums are taken depends on shape and dtype only: a view at an odd offset is copied first)
        w = v.view(torch.int64) if (v.storage_offset() * v.element_size()) % 8 == 0 else v.clone().view(torch.int64)
        return [w.sum(), w[::7].sum()]
    w = v.view(_INT_VIEW[v.element_size()]) if v.is_floating_point() else v
    return [w.sum(dtype=torch.int64), w[::7].sum(dtype=torch.int64)]


@dataclass(frozen=True)
class Fingerprint:
    """Per output tensor: shape and dtype, two exact integer checksums (:func:`word_sums`) and, for the
    tolerance mode, the float64 sum and sum of |x|. The sums stay on the device until compared."""

    shapes: tuple
    sums: torch.Tensor | None  # int64, two per tensor
    floats: torch.Tensor | None = None  # float64, (sum, sum |x|) per tensor

    @classmethod
    def of(cls, value: Any, floats: bool = False) -> Fingerprint:
        """``floats``: also the float sums a tolerance comparison needs (one more pass in float64)."""
        ts = value if isinstance(value, torch.Tensor) else None
        ts = [ts] if ts is not None else tensors(value)
        if not ts:
            return cls((), None)
        shapes = tuple((tuple(t.shape), t.dtype) for t in ts)
        parts = []
        for t in ts:
            parts += word_sums(t)
        fl = None
        if floats:
            fp = []
            for t in ts:
                d = t.detach().double()
                fp += [d.sum(), d.abs().sum()]
            fl = stack(fp)
        return cls(shapes, stack(parts), fl)

    def matches(self, other: Fingerprint, rtol: float = 0.0) -> bool:
        if self.shapes != other.shapes:
            return False
        if self.sums is None:
            return other.sums is None
        if rtol <= 0 or self.floats is None or other.floats is None:
            return torch.equal(self.sums, other.sums)
        return not bool(self.differs(other, rtol))

    def differs(self, other: Fingerprint, rtol: float = 0.0) -> bool | torch.Tensor:
        """Whether the two differ, as :meth:`matches` judges: a bool where the shapes decide, else a boolean tensor
        on the sums' device (read later: no host synchronisation here)."""
        if self.shapes != other.shapes or (self.sums is None) != (other.sums is None):
            return True
        if self.sums is None:
            return False
        if rtol <= 0 or self.floats is None or other.floats is None:
            return torch.ne(self.sums, other.sums).any()
        a, b = self.floats.view(-1, 2), other.floats.view(-1, 2)
        # only finite executions can agree within a tolerance
        agree = torch.isfinite(a).all() & torch.isfinite(b).all() & \
            ((a[:, 0] - b[:, 0]).abs() <= rtol * a[:, 1].clamp_min(1e-30)).all()
        return ~agree

    def gap(self, other: Fingerprint) -> float:
        """Largest relative difference of the float sums (0 when bitwise equal, inf when shapes or integer
        outputs differ): what a determinism report records."""
        if self.shapes != other.shapes:
            return float("inf")
        if self.sums is not None and torch.equal(self.sums, other.sums):
            return 0.0
        if self.floats is None or other.floats is None:
            return float("inf")
        a, b = self.floats.view(-1, 2), other.floats.view(-1, 2)
        return float(((a[:, 0] - b[:, 0]).abs() / a[:, 1].clamp_min(1e-30)).max())

    def nbytes(self) -> int:
        return 16 * len(self.shapes)


def relative_gap(a: Any, b: Any) -> float:
    """Largest |a - b| / sum|a| over the tensors of two executions (the determinism report's measure)."""
    gap = 0.0
    for x, y in zip(tensors(a), tensors(b)):
        if not x.is_floating_point():
            if not torch.equal(x, y):
                return float("inf")
            continue
        dx, dy = x.detach().double(), y.detach().double()
        scale = float(dx.abs().sum()) or 1e-30
        gap = max(gap, float((dx - dy).abs().sum()) / scale)
    return gap


def clone_args(value: Any) -> Any:
    """Tensors cloned (same strides), everything else as is."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, value)
