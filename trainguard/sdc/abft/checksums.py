"""Checksums for one GEMM ``C = A @ B (+ bias)``: encode, carry, recompute, compare, locate, correct.

Relies on ``torch`` only. Shapes: ``A`` (..., m, k), ``B`` (..., k, n) or a shared (k, n) weight, ``C``
(..., m, n), ``bias`` (n,) or None. All checksum arithmetic is fp32, whatever the model's dtype (bf16 /
fp16 inputs are upcast exactly; GEMMs are assumed to accumulate in fp32, as CPU and CUDA BLAS do).

Detection (the fast path, O(mk + kn + mn) per matrix, no extra GEMM): the column checksum of the output
predicted from the inputs, ``e = (1^T A) B + m bias``, against the recomputed one, ``c = 1^T C``. The
input checksum ``1^T A`` is *carried*: it is the verified recomputed checksum of the previous product in
the protection section (or encoded from the section input), so no GEMM input is summed twice.

Roundoff bound (the threshold). With ``u_out`` the unit roundoff of C's dtype (2^-24 fp32, 2^-8 bf16,
2^-11 fp16) and ``u = 2^-24`` that of the fp32 accumulators, every term of ``c - e`` is a rounding error
of a product ``|A_il| |B_lj|``: the GEMM's accumulation (k terms), the rounding of C to its dtype (u_out),
the fp32 sums over m rows and the checksum GEMM (k terms). The worst case is

    |c_j - e_j| <= (u_out + (2k + m) u) * M_j + m eta,   M_j = ((1^T |A|) |B|)_j + m |bias_j|

(``eta`` the subnormal spacing of C's dtype). Rounding errors of long sums do not add up in the worst
case: they behave like independent, mean-zero variables, and the accumulated error grows like
``sqrt(n) u`` (Higham and Mary, "A New Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci.
Comput. 41(5), 2019). The detection threshold takes that form for the fp32 accumulation terms and keeps
the worst case for the rounding of C to its own dtype:

    flag column j  iff  |c_j - e_j| > tau * ((u_out + sqrt(2k + m) u) * M_j + m eta)   or it is NaN/INF

(``tau`` = ``ABFTConfig.tolerance_factor``, default 2). On clean products of the shapes the kernels run,
the largest difference measured stays below 0.15 of this threshold in fp32 and bf16. The worst-case
bound (:func:`worst_case_scale`) is 15-50x looser at attention shapes: an error between the two is
invisible to it, and one element wrong by that much moved a model's logits by more than 1e-4. A flag that
is only roundoff (structured data can correlate rounding errors) is told apart in the slow path:
recomputing the product with the same kernel reproduces it bit for bit, within the worst-case bound
(:func:`resolve`: ``false_alarm``). On the fast path ``M`` is replaced by its Cauchy-Schwarz upper bound
``M_j <= (sum_i ||A_i||_2) ||B_:j||_2 + m |bias_j|`` (row norms are fused reductions: no |A| temporary,
no extra matrix-vector product; for random-like data the bound is only ~1.5x looser); the slow path uses
the exact ``(1^T |A|) |B|``, and so does the fast path when ``B`` is elementwise non-negative (attention
probabilities: ``M = (1^T |A|) B`` is a second row of the checksum GEMV). Checks can run on ``C^T =
B^T A^T`` (a transposed view) to compare row sums instead: the kernel does so where rows are the cheap
direction (scores, context).

Location, correction, verification (the slow path, only after a flag: :func:`resolve`). Reference
checksums are recomputed from the inputs in fp32 (column sums, weighted column sums, row sums, weighted
row sums); a carried input checksum is compared with the input as it is now (an input that changed after
its own verification cannot be repaired here). EEC-ABFT (:mod:`trainguard.sdc.abft.eec`) corrects the
flagged columns, then the flagged rows, then the columns again. **Every correction is then verified
against checksums it did not use**: a column correction (made from that column's two checksums) must
leave every row checksum and weighted row checksum of the slice consistent, a row correction every
column checksum. A correction that fails is thrown away and the product is recomputed (with the same
kernel when the check knows it, ``GemmCheck.rerun``); the recomputation is verified the same way. What
still fails, or whose inputs are already non-finite, is escalated: the caller reports it to the
trainer's step guard, which re-executes the step from its start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from trainguard.sdc.abft import eec

U_ACC = 2.0 ** -24


def unit_roundoff(dtype: torch.dtype) -> float:
    """Unit roundoff (half the machine epsilon) of a floating dtype."""
    return torch.finfo(dtype).eps / 2


def tolerance_scale(k: int, m: int, out_dtype: torch.dtype, factor: float) -> float:
    """``tau * (u_out + sqrt(2k + m) u)``: multiply by the magnitude checksum to get the detection threshold
    (probabilistic accumulation bound; see the module docstring). For outputs in a lower precision than the
    accumulators, :func:`detect` keeps the ``u_out`` term apart (:func:`output_rounding`)."""
    return factor * (unit_roundoff(out_dtype) + math.sqrt(2 * k + m) * U_ACC)


def low_precision(out_dtype: torch.dtype) -> bool:
    """Whether rounding the product to its dtype costs more than fp32 accumulation (bf16, fp16)."""
    return unit_roundoff(out_dtype) > U_ACC


def output_rounding(abs_sum: torch.Tensor, mag: torch.Tensor, out_dtype: torch.dtype, factor: float) -> torch.Tensor:
    """``tau * u_out * min(sum_i |c_ij|, M_j)``: the rounding of a low-precision product to its dtype. Every
    element is rounded by at most ``u_out`` of itself, so the product's own magnitude bounds it (``sqrt(k)``
    times tighter than ``M`` for random-like data); ``M``, computed from the inputs, caps it so that a
    corrupted element cannot raise its own column's threshold."""
    return torch.fmin(abs_sum, mag).mul_(factor * unit_roundoff(out_dtype))  # fmin: a NaN sum gives M


def worst_case_scale(k: int, m: int, out_dtype: torch.dtype, factor: float) -> float:
    """``tau * (u_out + (2k + m) u)``: the worst-case roundoff bound (no clean product can exceed it)."""
    return factor * (unit_roundoff(out_dtype) + (2 * k + m) * U_ACC)


def underflow_floor(m: int, out_dtype: torch.dtype, factor: float) -> float:
    """``tau * m * eta``: absolute term for outputs rounded into the subnormal range (eta = subnormal spacing)."""
    fi = torch.finfo(out_dtype)
    return factor * m * fi.smallest_normal * fi.eps


_TINY32 = torch.finfo(torch.float32).tiny  # smallest normal fp32


def threshold(mag: torch.Tensor, scale: float, floor: float) -> torch.Tensor:
    """``scale * mag + floor`` (fp32), or a bound at most 2^-20 (relative) above it, computed without
    subnormal numbers.

    For fp32 products the underflow floor ``tau m eta`` is itself subnormal (about 1e-43), and adding a
    subnormal to every element runs the CPU's microcode assist path: ~15x slower on this machine (70 us
    instead of 5 us per check). So when ``floor`` is below the smallest normal number N, with
    ``delta = min(2^-20, floor / N)`` the threshold is ``max(scale (1 + delta) mag, floor (1 + 1/delta))``,
    never below ``scale mag + floor``: where ``scale mag >= floor / delta`` the first term exceeds it by
    ``delta scale mag >= floor``; elsewhere the second term does. Both constants are normal
    (``floor / delta >= N``); the second term only matters for columns whose magnitude is essentially zero.
    """
    if floor >= _TINY32:
        return torch.mul(mag, scale).add_(floor)
    delta = min(2.0 ** -20, floor / _TINY32)
    return torch.mul(mag, scale * (1.0 + delta)).clamp_min_(floor * (1.0 + 1.0 / delta))


def colsum(t: torch.Tensor) -> torch.Tensor:
    """fp32 column sums (over dim -2), keepdim: (..., 1, n)."""
    return t.sum(-2, keepdim=True, dtype=torch.float32)


def norms(t: torch.Tensor, dim: int) -> torch.Tensor:
    """fp32 2-norms of ``t`` along ``dim`` (dim removed), with the reduction that suits the memory layout.

    ``vector_norm`` is fast along the contiguous dimension but ~10x slower across it (e.g. the column norms
    of a (768, 2304) weight: 2.2 ms vs 0.3 ms for a squared sum on 2 CPU threads), so a reduction across the
    contiguous dimension is a sum of squares vectorised along it. Both are the same fp32 2-norm.
    """
    if t.stride(dim) == 1 or t.shape[dim] == 1:  # (moved last: vector_norm is slow on a transposed view)
        return torch.linalg.vector_norm(t.movedim(dim, -1), dim=-1, dtype=torch.float32)
    t32 = t.float()
    return (t32 * t32).sum(dim).sqrt()


@torch.no_grad()  # checksums are never differentiated: recording them would build (and keep) a graph
def encode(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column checksum and row-norm sum of a section input: ``1^T A``, ``sum_i ||A_i||`` (fp32)."""
    return colsum(a), row_norm_sum(a)


@dataclass
class Fix:
    batch: tuple[int, ...]
    row: int
    col: int
    old: float
    new: float


#: what the slow path can conclude about a flagged product
CORRECTED, RECOMPUTED, ESCALATED, FALSE_ALARM = "corrected", "recomputed", "escalated", "false_alarm"


@dataclass
class Outcome:
    """What the slow path did to one flagged product. ``kind``:

    * ``corrected``: EEC-ABFT corrected it and the correction passed the checksums it did not use (also when
      nothing needed correcting because the fast path's own checksum was wrong: ``checksum_errors``);
    * ``recomputed``: EEC-ABFT could not (or its correction failed verification: ``rejected``); the product
      was recomputed and the recomputation verified;
    * ``escalated``: not verifiable here (``reason``): non-finite inputs, an input that changed after its
      verification, a recomputation that still fails, or correction switched off. The step must be redone;
    * ``false_alarm``: the difference was roundoff above the detection threshold: recomputing with the same
      kernel reproduced the product bit for bit and it is within the worst-case bound.
    """

    kind: str
    fixes: list[Fix] = field(default_factory=list)
    flagged: int = 0
    recomputed: bool = False
    checksum_errors: int = 0
    first: tuple | None = None
    reason: str = ""
    rejected: int = 0


@dataclass
class GemmCheck:
    """A detection pending on one product (no host sync until :meth:`any` is evaluated)."""

    c: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    bias: torch.Tensor | None
    col: torch.Tensor          # recomputed checksum 1^T C (..., 1, n) fp32
    expected: torch.Tensor     # (1^T A) B + m bias
    mag: torch.Tensor          # magnitude bound M
    tol: torch.Tensor
    flag: torch.Tensor         # (..., 1, n) bool
    factor: float
    alpha: float = 1.0         # the GEMM computed alpha * A @ B (+ bias)
    a_col: torch.Tensor | None = None  # a carried input checksum 1^T A (compared with A in the slow path)
    #: recomputes the whole product with the kernel that made it (same call, same shapes: bitwise the same
    #: result when nothing went wrong), in ``c``'s layout; None: the slow path recomputes in fp32 instead
    rerun: Callable[[], torch.Tensor] | None = None
    extra: torch.Tensor | None = None  # products of ``extra_rows`` (see :func:`detect`)

    def any(self) -> torch.Tensor:
        return self.flag.any()

    def columns(self, lo: int, hi: int) -> GemmCheck:
        """The check of the column block ``C[..., lo:hi] = A B[..., lo:hi] (+ bias[lo:hi])`` (views: resolving
        it corrects ``C`` in place). The checksum of a concatenated product is the concatenation of the
        checksums, so one fused check splits exactly into per-product checks."""
        def cut(t):
            return t[..., lo:hi] if t.shape[-1] != 1 else t
        rerun = self.rerun
        return GemmCheck(c=self.c[..., lo:hi], a=self.a, b=self.b[..., lo:hi],
                         bias=self.bias[lo:hi] if self.bias is not None else None, col=cut(self.col),
                         expected=cut(self.expected), mag=cut(self.mag), tol=cut(self.tol), flag=cut(self.flag),
                         factor=self.factor, alpha=self.alpha, a_col=self.a_col,
                         rerun=None if rerun is None else (lambda: rerun()[..., lo:hi]))


def row_norm_sum(a: torch.Tensor) -> torch.Tensor:
    """``sum_i ||A_i||_2`` over the rows of ``a`` (fp32), shaped (..., 1, 1)."""
    return norms(a, -1).sum(-1)[..., None, None]


def col_norms(b: torch.Tensor) -> torch.Tensor:
    """fp32 column norms ``||B_:j||_2``, keepdim: (..., 1, n)."""
    return norms(b, -2).unsqueeze(-2)


def abs_colsum(a: torch.Tensor) -> torch.Tensor:
    """fp32 ``1^T |A|`` (..., 1, k), reduced along the contiguous direction (``vector_norm(ord=1)`` is
    unvectorised on CPU: ~2.5 ms vs 0.4 ms for abs + sum on a (8, 12, 128, 64) tensor)."""
    if a.stride(-2) == 1:
        return a.transpose(-1, -2).abs().sum(-1, dtype=torch.float32).unsqueeze(-2)
    return a.abs().sum(-2, keepdim=True, dtype=torch.float32)


@torch.no_grad()  # (as encode: the check's reductions and GEMVs are not part of the autograd graph)
def detect(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
           a_col: torch.Tensor | None = None, a_rn: torch.Tensor | None = None,
           b_cn: torch.Tensor | None = None, b_nonneg: bool = False, factor: float = 2.0,
           alpha: float = 1.0, rerun: Callable[[], torch.Tensor] | None = None,
           extra_rows: torch.Tensor | None = None, carried: bool | None = None,
           expected: torch.Tensor | None = None, mag: torch.Tensor | None = None) -> GemmCheck:
    """Fast-path detection for ``c = alpha * a @ b + bias`` (see the module docstring for the bound; a GEMM's
    ``alpha`` scales the product, its checksum and its roundoff alike).

    ``a_col`` (..., 1, k): carried checksum ``1^T A``; ``a_rn`` (..., 1, 1): ``sum_i ||A_i||``; ``b_cn``
    (..., 1, n) or broadcastable (or a float): column norms ``||B_:j||`` (or an upper bound of them).
    ``b_nonneg``: B is elementwise >= 0 (attention probabilities), so the exact magnitude
    ``M = (1^T |A|) B`` comes out of the same GEMV as the checksum (one pass over B, no norms).
    ``extra_rows`` (..., r, k) (with ``b_nonneg``): more row vectors multiplied by B in the same GEMV;
    their products are ``chk.extra`` (..., r, n) (the kernel gets ``1^T AP^T``, the softmax row sums, so).
    ``rerun``: see :class:`GemmCheck`. A given ``a_col`` is a carried checksum (the slow path compares it
    with ``A`` as it is then) unless ``carried=False`` (it was just computed from ``A``). ``expected``
    (..., 1, n): ``a_col @ B`` already computed (e.g. in one GEMV with other rows over the same B).
    ``mag`` (..., 1, n): a magnitude bound ``M`` already computed (before ``alpha``), e.g. the exact
    ``(1^T |A|) |B|`` when ``A`` is non-negative (then ``a_rn`` / ``b_cn`` are not needed).
    """
    m, k = a.shape[-2], a.shape[-1]
    carried = a_col if carried is None or carried else None
    if a_col is None:
        a_col = colsum(a)
    extra = None
    if b_nonneg:
        b32 = b if b.dtype == torch.float32 else b.float()
        rows = [a_col, abs_colsum(a)]
        if extra_rows is not None:
            rows.append(extra_rows.expand(*a_col.shape[:-2], *extra_rows.shape[-2:]))
        both = torch.matmul(torch.cat(rows, -2), b32)
        expected, mag = both[..., :1, :], both[..., 1:2, :]
        if extra_rows is not None:
            extra = both[..., 2:, :]
    else:
        if mag is None:
            if a_rn is None:
                a_rn = row_norm_sum(a)
            if b_cn is None:
                b_cn = col_norms(b)
            mag = a_rn * b_cn
        if expected is None:
            expected = torch.matmul(a_col, b if b.dtype == torch.float32 else b.float())
    if alpha != 1.0:
        expected, mag = expected * alpha, mag * abs(alpha)
    if bias is not None:
        bias32 = bias.float()
        expected = torch.add(expected, bias32, alpha=m)
        mag = torch.add(mag, bias32.abs(), alpha=m)
    col = colsum(c)
    if low_precision(c.dtype):  # the rounding to c's dtype, bounded by |c| itself (capped by M)
        tol = threshold(mag, tolerance_scale(k, m, torch.float32, factor), underflow_floor(m, c.dtype, factor))
        tol = tol.add_(output_rounding(c.abs().sum(-2, keepdim=True, dtype=torch.float32), mag, c.dtype, factor))
    else:
        tol = threshold(mag, tolerance_scale(k, m, c.dtype, factor), underflow_floor(m, c.dtype, factor))
    flag = torch.le((col - expected).abs_(), tol).logical_not_()
    return GemmCheck(c=c, a=a, b=b, bias=bias, col=col, expected=expected, mag=mag, tol=tol, flag=flag,
                     factor=factor, alpha=alpha, a_col=carried, rerun=rerun, extra=extra)


def _batch_rows(t: torch.Tensor, batch_shape: torch.Size, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` of ``t`` broadcast to ``batch_shape`` and flattened: (len(idx), *t.shape[-2:])."""
    if not batch_shape:
        return t.unsqueeze(0).expand(len(idx), *t.shape[-2:])
    te = t.expand(*batch_shape, *t.shape[-2:]) if t.shape[:-2] != batch_shape else t
    if len(batch_shape) == 1:
        return te[idx]
    multi = torch.unravel_index(idx, tuple(batch_shape))
    return te[multi]


def _matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.matmul(a, b)
    return out + bias if bias is not None else out


@dataclass
class _Reference:
    """Checksums of the flagged slices recomputed from the inputs (fp32), with their tolerances: column sums
    ``s1``, weighted column sums ``s2`` (weights 1..m), row sums ``r1``, weighted row sums ``r2`` (1..n).
    ``*_tol`` use the detection scale, ``worst`` the worst-case one (for the column sums)."""

    s1: torch.Tensor
    s2: torch.Tensor
    r1: torch.Tensor
    r2: torch.Tensor
    tol1: torch.Tensor
    tol2: torch.Tensor
    rtol1: torch.Tensor
    rtol2: torch.Tensor
    worst1: torch.Tensor
    wm: torch.Tensor
    wn: torch.Tensor
    mags: tuple | None = None        # (mag1, mag2, rmag1, rmag2) of a low-precision product
    out_dtype: torch.dtype = torch.float32
    factor: float = 2.0

    def with_output(self, cb: torch.Tensor) -> _Reference:
        """The tolerances for the candidate values ``cb`` (a low-precision product's rounding term is bounded
        by the candidate's own magnitudes, capped by the input-derived ones)."""
        if self.mags is None:
            return self
        a = cb.abs()
        mag1, mag2, rmag1, rmag2 = self.mags
        f, dt = self.factor, self.out_dtype
        return _Reference(
            s1=self.s1, s2=self.s2, r1=self.r1, r2=self.r2,
            tol1=self.tol1 + output_rounding(a.sum(1), mag1, dt, f),
            tol2=self.tol2 + output_rounding(torch.matmul(self.wm, a), mag2, dt, f),
            rtol1=self.rtol1 + output_rounding(a.sum(2), rmag1, dt, f),
            rtol2=self.rtol2 + output_rounding(torch.matmul(a, self.wn), rmag2, dt, f),
            worst1=self.worst1, wm=self.wm, wn=self.wn)


def _reference(ab: torch.Tensor, bb: torch.Tensor, bias32: torch.Tensor | None, out_dtype: torch.dtype,
               factor: float) -> _Reference:
    nf, m, k = ab.shape
    n = bb.shape[-1]
    dev = ab.device
    wm = torch.arange(1, m + 1, dtype=torch.float32, device=dev)
    wn = torch.arange(1, n + 1, dtype=torch.float32, device=dev)
    a_abs, b_abs = ab.abs(), bb.abs()
    left = torch.stack([ab.sum(1), torch.matmul(wm, ab)], 1)                   # (nf, 2, k)
    left_abs = torch.stack([a_abs.sum(1), torch.matmul(wm, a_abs)], 1)
    s1, s2 = torch.matmul(left, bb).unbind(1)                                  # (nf, n)
    mag1, mag2 = torch.matmul(left_abs, b_abs).unbind(1)
    right = torch.stack([bb.sum(2), torch.matmul(bb, wn)], 2)                  # (nf, k, 2)
    right_abs = torch.stack([b_abs.sum(2), torch.matmul(b_abs, wn)], 2)
    r1, r2 = torch.matmul(ab, right).unbind(2)                                 # (nf, m)
    rmag1, rmag2 = torch.matmul(a_abs, right_abs).unbind(2)
    if bias32 is not None:
        bias_abs = bias32.abs()
        s1, mag1 = s1 + m * bias32, mag1 + m * bias_abs
        s2, mag2 = s2 + wm.sum() * bias32, mag2 + wm.sum() * bias_abs
        r1, rmag1 = r1 + bias32.sum(), rmag1 + bias_abs.sum()
        r2, rmag2 = r2 + (wn * bias32).sum(), rmag2 + (wn * bias_abs).sum()
    low = low_precision(out_dtype)
    acc_dtype = torch.float32 if low else out_dtype  # the rounding to a low-precision dtype: with_output()
    col_scale, row_scale = tolerance_scale(k, m, acc_dtype, factor), tolerance_scale(k, n, acc_dtype, factor)
    return _Reference(
        s1=s1, s2=s2, r1=r1, r2=r2,
        tol1=threshold(mag1, col_scale, underflow_floor(m, out_dtype, factor)),
        tol2=threshold(mag2, col_scale, underflow_floor(m * m, out_dtype, factor)),
        rtol1=threshold(rmag1, row_scale, underflow_floor(n, out_dtype, factor)),
        rtol2=threshold(rmag2, row_scale, underflow_floor(n * n, out_dtype, factor)),
        worst1=threshold(mag1, worst_case_scale(k, m, out_dtype, factor), underflow_floor(m, out_dtype, factor)),
        wm=wm, wn=wn, mags=(mag1, mag2, rmag1, rmag2) if low else None, out_dtype=out_dtype, factor=factor)


def _changed(cb: torch.Tensor, cb0: torch.Tensor) -> torch.Tensor:
    """Elements of ``cb`` that differ from ``cb0`` (a NaN that stayed NaN is unchanged)."""
    return ~((cb == cb0) | (cb.isnan() & cb0.isnan()))


def _slack(ch: torch.Tensor, ref: _Reference) -> tuple[torch.Tensor, ...]:
    """Extra tolerance a corrected element brings into the checks across it during the EEC passes: a value
    rebuilt from a column checksum is exact only up to that column's tolerance (and likewise for rows), and
    a later pass must not take that residue for another error. (The final verification has no slack.)
    Returns the slack of the column sums, weighted column sums, row sums and weighted row sums."""
    if not bool(ch.any()):
        z = torch.zeros((), device=ch.device)
        return z, z, z, z
    el = (ref.tol1[:, None, :] + ref.rtol1[:, :, None]) * ch
    return (el.sum(1), torch.matmul(ref.wm, el), el.sum(2), torch.matmul(el, ref.wn))


def _eec_pass(cb: torch.Tensor, cb0: torch.Tensor, ref: _Reference, columns: bool, near_inf: float,
              t_correct: float) -> None:
    """One EEC-ABFT pass over the columns (or rows) of ``cb`` that disagree with their reference checksum;
    corrections are written into ``cb`` (they are verified later, against the other direction)."""
    ref = ref.with_output(cb)
    sc1, sc2, sr1, sr2 = _slack(_changed(cb, cb0), ref)
    if columns:
        s1, s2, tol1, tol2 = ref.s1, ref.s2, ref.tol1 + sc1, ref.tol2 + sc2
        bad = ~((cb.sum(1) - s1).abs() <= tol1)
    else:
        s1, s2, tol1, tol2 = ref.r1, ref.r2, ref.rtol1 + sr1, ref.rtol2 + sr2
        bad = ~((cb.sum(2) - s1).abs() <= tol1)
    i, j = bad.nonzero(as_tuple=True)
    if len(i) == 0:
        return
    vecs = cb[i, :, j] if columns else cb[i, j, :]
    res = eec.correct_vectors(vecs, s1[i, j], s2[i, j], tol1[i, j], tol2[i, j], near_inf, t_correct)
    ok = res.status == eec.CORRECTED
    if columns:
        cb[i[ok], res.index[ok], j[ok]] = res.new[ok]
    else:
        cb[i[ok], j[ok], res.index[ok]] = res.new[ok]


def _recompute_elements(cb: torch.Tensor, cb0: torch.Tensor, ab: torch.Tensor, bb: torch.Tensor,
                        bias32: torch.Tensor | None, out_dtype: torch.dtype) -> None:
    """The elements EEC-ABFT located get their value from their own dot product ``a_i . b_j (+ bias_j)``
    (rounded to the product's dtype) rather than from the checksum: a value rebuilt from a checksum carries
    the rounding of the whole column (in bf16, ``u_out`` times the column's magnitude), the dot product
    only its own. A wrongly located element recomputes to its (unchanged) value, and the verification
    that follows then fails."""
    i, r, j = _changed(cb, cb0).nonzero(as_tuple=True)
    if len(i) == 0:
        return
    vals = (ab[i, r, :] * bb[i, :, j]).sum(-1)
    if bias32 is not None:
        vals = vals + bias32[j]
    cb[i, r, j] = vals.to(out_dtype).float()


def _verified(cb: torch.Tensor, ref: _Reference) -> bool:
    """All four reference checksums agree with ``cb`` within their plain tolerances (no slack for corrected
    elements: a correction too imprecise to pass is recomputed instead, never accepted loosely)."""
    if not bool(cb.isfinite().all()):
        return False
    ref = ref.with_output(cb)
    ok = ((cb.sum(1) - ref.s1).abs() <= ref.tol1).all()
    ok &= ((torch.matmul(ref.wm, cb) - ref.s2).abs() <= ref.tol2).all()
    ok &= ((cb.sum(2) - ref.r1).abs() <= ref.rtol1).all()
    ok &= ((torch.matmul(cb, ref.wn) - ref.r2).abs() <= ref.rtol2).all()
    return bool(ok)


def _within_worst_case(cb: torch.Tensor, ref: _Reference) -> bool:
    return bool(cb.isfinite().all()) and bool(((cb.sum(1) - ref.s1).abs() <= ref.worst1).all())


def resolve(chk: GemmCheck, *, correct: bool = True, recompute: bool = True,
            near_inf: float = eec.T_NEAR_INF, t_correct: float = eec.T_CORRECT) -> Outcome:
    """Slow path after ``chk.any()``: locate, correct and verify in place (``chk.c`` is modified), else
    recompute and verify, else escalate (see the module docstring and :class:`Outcome`).

    Updates ``chk.col`` to the checksum of the product as it is left, so it can be carried on.
    """
    c, a, b, bias = chk.c, chk.a, chk.b, chk.bias
    n = c.shape[-1]
    batch_shape = c.shape[:-2]
    nb = math.prod(batch_shape) if batch_shape else 1
    flag = chk.flag.expand(*batch_shape, 1, n).reshape(nb, n)
    bidx = flag.any(1).nonzero()[:, 0]
    out = Outcome(kind=CORRECTED, flagged=int(flag.sum().item()))
    if len(bidx) == 0:
        return out
    first_b, first_j = int(bidx[0]), int(flag[bidx[0]].nonzero()[0, 0])
    out.first = (_unravel(first_b, batch_shape), None, first_j)

    def finish(kind: str, reason: str = "") -> Outcome:
        out.kind, out.reason = kind, reason
        chk.col = colsum(c)
        chk.flag = torch.zeros_like(chk.flag)
        return out

    if not correct:
        return finish(ESCALATED, "detected; correction is switched off")
    with torch.no_grad():
        ab = _batch_rows(a, batch_shape, bidx).float()
        bb = _batch_rows(b, batch_shape, bidx).float()
        if chk.alpha != 1.0:  # alpha * (A B) = A (alpha B): everything below is for the scaled operand
            bb = bb * chk.alpha
        bias32 = bias.float() if bias is not None else None
        if not (bool(ab.isfinite().all()) and bool(bb.isfinite().all())
                and (bias32 is None or bool(bias32.isfinite().all()))):
            return finish(ESCALATED, "non-finite input")
        if chk.a_col is not None:  # the input must still be what its own check verified
            carried = _batch_rows(chk.a_col, batch_shape, bidx).float()[:, 0]
            m_a = ab.shape[1]
            tol_a = threshold(ab.abs().sum(1), 2 * worst_case_scale(0, m_a, torch.float32, chk.factor),
                              underflow_floor(m_a, torch.float32, chk.factor))
            if not bool(((ab.sum(1) - carried).abs() <= tol_a).all()):
                return finish(ESCALATED, "input changed after its verification")
        ref = _reference(ab, bb, bias32, c.dtype, chk.factor)
        cb0 = _batch_rows(c, batch_shape, bidx).float()
        cb = cb0.clone()
        for columns in (True, False, True):
            _eec_pass(cb, cb0, ref, columns, near_inf, t_correct)
        _recompute_elements(cb, cb0, ab, bb, bias32, c.dtype)
        if _verified(cb, ref):
            ch = _changed(cb, cb0)
            i, r, j = ch.nonzero(as_tuple=True)
            fixes = [(int(bidx[f]), int(rr), int(jj), float(o), float(nv)) for f, rr, jj, o, nv in
                     zip(i.tolist(), r.tolist(), j.tolist(), cb0[i, r, j].tolist(), cb[i, r, j].tolist())]
            _write_back(c, batch_shape, fixes)
            out.fixes = [Fix(_unravel(bi, batch_shape), rr, jj, o, nv) for bi, rr, jj, o, nv in fixes]
            out.checksum_errors = int(not fixes)
            return finish(CORRECTED)
        out.rejected = int(_changed(cb, cb0).any())
        if not recompute:
            return finish(ESCALATED, "no verified correction; recomputation is switched off")
        if chk.rerun is not None:
            full = chk.rerun()
            fresh = _batch_rows(full, batch_shape, bidx)
            if bool(torch.equal(fresh, _batch_rows(c, batch_shape, bidx))):
                # the kernel reproduces the product bit for bit: no transient fault struck it
                if _within_worst_case(cb0, ref):
                    return finish(FALSE_ALARM)
                return finish(ESCALATED, "recomputation reproduces an error beyond the roundoff bound")
        else:
            fresh = _matmul(ab, bb, bias32).to(c.dtype)
        fr = fresh.float()
        verified = _verified(fr, ref)
        if not verified and chk.rerun is not None and _within_worst_case(fr, ref):
            # roundoff above the detection threshold: a second recomputation must agree bit for bit
            verified = bool(torch.equal(_batch_rows(chk.rerun(), batch_shape, bidx), fresh))
        _write_batches(c, batch_shape, bidx, fresh)
        out.recomputed = True
        if not verified:
            return finish(ESCALATED, "recomputation failed verification")
        return finish(RECOMPUTED)


def _unravel(i: int, shape: torch.Size) -> tuple[int, ...]:
    idx = []
    for s in reversed(tuple(shape)):
        idx.append(i % s)
        i //= s
    return tuple(reversed(idx))


def _write_back(c: torch.Tensor, batch_shape: torch.Size, fixes: list) -> None:
    if not fixes:
        return
    bi = torch.tensor([f[0] for f in fixes], device=c.device)
    rows = torch.tensor([f[1] for f in fixes], device=c.device)
    cols = torch.tensor([f[2] for f in fixes], device=c.device)
    vals = torch.tensor([f[4] for f in fixes], dtype=torch.float32, device=c.device).to(c.dtype)
    multi = torch.unravel_index(bi, tuple(batch_shape)) if batch_shape else ()
    c[(*multi, rows, cols)] = vals


def _write_batches(c: torch.Tensor, batch_shape: torch.Size, bidx: torch.Tensor, fresh: torch.Tensor) -> None:
    if not batch_shape:
        c.copy_(fresh[0])
        return
    multi = torch.unravel_index(bidx, tuple(batch_shape))
    c[multi] = fresh
