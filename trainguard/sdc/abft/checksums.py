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
of a product ``|A_il| |B_lj|``: the GEMM's accumulation (k u), the rounding of C to its dtype (u_out), the
fp32 sums over m rows (m u) and the checksum GEMM (k u). Hence, per column j,

    |c_j - e_j| <= (u_out + (2k + m) u) * M_j + m eta,   M_j = ((1^T |A|) |B|)_j + m |bias_j|

where ``eta`` is the subnormal spacing of C's dtype (outputs that underflow, e.g. small fp16 gradients,
carry an absolute, not a relative, error), and a column is flagged when
``|c_j - e_j| > tau * ((u_out + (2k + m) u) * M_j + m eta)`` (``tau`` =
``ABFTConfig.tolerance_factor``, default 2), or when the difference is NaN/INF. On the fast path ``M`` is
replaced by its Cauchy-Schwarz upper bound ``M_j <= (sum_i ||A_i||_2) ||B_:j||_2 + m |bias_j|`` (row norms
are fused reductions: no |A| temporary, no extra matrix-vector product; for random-like data the bound is
only ~1.5x looser); the slow path uses the exact ``(1^T |A|) |B|``, and so does the fast path when ``B``
is elementwise non-negative (attention probabilities: ``M = (1^T |A|) B`` is a second row of the checksum
GEMV). This is a worst-case bound: it never
fires on roundoff in fp32, bf16 or fp16, and it scales with shape and magnitude (a fixed threshold such as
the reference code's E = 1 does not). Checks can run on ``C^T = B^T A^T`` (a transposed view) to compare
row sums instead: the kernel does so where rows are the cheap direction (scores, context).

Location and correction (the slow path, only after a flag): weighted checksums (weights 1..m) are
computed for the flagged matrices, EEC-ABFT (:mod:`trainguard.sdc.abft.eec`) runs on the flagged
columns, then on the rows (row checksums ``A (B 1)``, ``A (B w)``) for what the columns could not fix
(1C patterns), and the columns are verified again. What is still wrong (a 2D pattern) is uncorrectable:
the flagged matrices are recomputed from their (verified) inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trainguard.sdc.abft import eec

U_ACC = 2.0 ** -24


def unit_roundoff(dtype: torch.dtype) -> float:
    """Unit roundoff (half the machine epsilon) of a floating dtype."""
    return torch.finfo(dtype).eps / 2


def tolerance_scale(k: int, m: int, out_dtype: torch.dtype, factor: float) -> float:
    """``tau * (u_out + (2k + m) u)``: multiply by the magnitude checksum to get the threshold."""
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


@dataclass
class Outcome:
    """What the slow path did to one product: ``kind`` is corrected / uncorrectable (then recomputed)."""

    kind: str
    fixes: list[Fix] = field(default_factory=list)
    flagged: int = 0
    recomputed: bool = False
    checksum_errors: int = 0
    first: tuple | None = None


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

    def any(self) -> torch.Tensor:
        return self.flag.any()

    def columns(self, lo: int, hi: int) -> GemmCheck:
        """The check of the column block ``C[..., lo:hi] = A B[..., lo:hi] (+ bias[lo:hi])`` (views: resolving
        it corrects ``C`` in place). The checksum of a concatenated product is the concatenation of the
        checksums, so one fused check splits exactly into per-product checks."""
        def cut(t):
            return t[..., lo:hi] if t.shape[-1] != 1 else t
        return GemmCheck(c=self.c[..., lo:hi], a=self.a, b=self.b[..., lo:hi],
                         bias=self.bias[lo:hi] if self.bias is not None else None, col=cut(self.col),
                         expected=cut(self.expected), mag=cut(self.mag), tol=cut(self.tol), flag=cut(self.flag),
                         factor=self.factor, alpha=self.alpha)


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
           alpha: float = 1.0) -> GemmCheck:
    """Fast-path detection for ``c = alpha * a @ b + bias`` (see the module docstring for the bound; a GEMM's
    ``alpha`` scales the product, its checksum and its roundoff alike).

    ``a_col`` (..., 1, k): carried checksum ``1^T A``; ``a_rn`` (..., 1, 1): ``sum_i ||A_i||``; ``b_cn``
    (..., 1, n) or broadcastable (or a float): column norms ``||B_:j||`` (or an upper bound of them).
    ``b_nonneg``: B is elementwise >= 0 (attention probabilities), so the exact magnitude
    ``M = (1^T |A|) B`` comes out of the same GEMV as the checksum (one pass over B, no norms).
    """
    m, k = a.shape[-2], a.shape[-1]
    if a_col is None:
        a_col = colsum(a)
    b32 = b if b.dtype == torch.float32 else b.float()
    if b_nonneg:
        both = torch.matmul(torch.cat([a_col, abs_colsum(a)], -2), b32)
        expected, mag = both[..., :1, :], both[..., 1:, :]
    else:
        if a_rn is None:
            a_rn = row_norm_sum(a)
        if b_cn is None:
            b_cn = col_norms(b)
        expected = torch.matmul(a_col, b32)
        mag = a_rn * b_cn
    if alpha != 1.0:
        expected, mag = expected * alpha, mag * abs(alpha)
    if bias is not None:
        bias32 = bias.float()
        expected = torch.add(expected, bias32, alpha=m)
        mag = torch.add(mag, bias32.abs(), alpha=m)
    col = colsum(c)
    tol = threshold(mag, tolerance_scale(k, m, c.dtype, factor), underflow_floor(m, c.dtype, factor))
    flag = torch.le((col - expected).abs_(), tol).logical_not_()
    return GemmCheck(c=c, a=a, b=b, bias=bias, col=col, expected=expected, mag=mag, tol=tol, flag=flag,
                     factor=factor, alpha=alpha)


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


def resolve(chk: GemmCheck, *, correct: bool = True, recompute: bool = True,
            near_inf: float = eec.T_NEAR_INF, t_correct: float = eec.T_CORRECT) -> Outcome:
    """Slow path after ``chk.any()``: locate and correct in place (``chk.c`` is modified), else recompute.

    Updates ``chk.col`` to the checksum of the corrected product, so it can be carried on.
    """
    c, a, b, bias = chk.c, chk.a, chk.b, chk.bias
    m, n = c.shape[-2], c.shape[-1]
    k = a.shape[-1]
    batch_shape = c.shape[:-2]
    nb = int(torch.tensor(batch_shape).prod().item()) if batch_shape else 1
    flag = chk.flag.reshape(nb, n)
    bidx = flag.any(1).nonzero()[:, 0]
    out = Outcome(kind="corrected", flagged=int(flag.sum().item()))
    if len(bidx) == 0:
        return out
    fb = flag[bidx]
    first_b, first_j = int(bidx[0]), int(fb[0].nonzero()[0, 0])
    out.first = (_unravel(first_b, batch_shape), None, first_j)
    if not correct:
        out.kind = "detected"
        chk.flag = torch.zeros_like(chk.flag)
        return out
    with torch.no_grad():
        cb = _batch_rows(c, batch_shape, bidx).float().clone()     # (nf, m, n)
        ab = _batch_rows(a, batch_shape, bidx).float()
        bb = _batch_rows(b, batch_shape, bidx).float()
        if chk.alpha != 1.0:  # alpha * (A B) = A (alpha B): everything below is for the scaled operand
            bb = bb * chk.alpha
        bias32 = bias.float() if bias is not None else None
        s1 = chk.expected.expand_as(chk.col).reshape(nb, n)[bidx]
        tol1 = chk.tol.expand_as(chk.col).reshape(nb, n)[bidx]
        scale = tolerance_scale(k, m, c.dtype, chk.factor)
        wm = torch.arange(1, m + 1, dtype=torch.float32, device=c.device)
        wa = torch.matmul(wm, ab)                       # (nf, k)
        s2 = torch.matmul(wa.unsqueeze(1), bb)[:, 0]    # (nf, n)
        mag2 = torch.matmul(torch.matmul(wm, ab.abs()).unsqueeze(1), bb.abs())[:, 0]
        if bias32 is not None:
            s2 = s2 + wm.sum() * bias32
            mag2 = mag2 + wm.sum() * bias32.abs()
        tol2 = threshold(mag2, scale, underflow_floor(m * m, c.dtype, chk.factor))
        settled = ~fb                                   # columns that need nothing
        # 1) columns (0D and 1R patterns)
        fi, fj = fb.nonzero(as_tuple=True)
        res = eec.correct_vectors(cb[fi, :, fj], s1[fi, fj], s2[fi, fj], tol1[fi, fj], tol2[fi, fj],
                                  near_inf, t_correct)
        ok = res.status == eec.CORRECTED
        cb[fi[ok], res.index[ok], fj[ok]] = res.new[ok]
        done = (res.status == eec.CORRECTED) | (res.status == eec.CLEAN) | (res.status == eec.CHECKSUM)
        settled[fi[done], fj[done]] = True
        out.checksum_errors += int((res.status == eec.CHECKSUM).sum())
        fixes = [(int(bidx[i]), int(r), int(j), float(o), float(nv))
                 for i, r, j, o, nv in zip(fi[ok].tolist(), res.index[ok].tolist(), fj[ok].tolist(),
                                           res.old[ok].tolist(), res.new[ok].tolist())]
        # 2) rows (1C patterns) for whatever the columns could not settle
        if not bool(settled.all()):
            wn = torch.arange(1, n + 1, dtype=torch.float32, device=c.device)
            ones_n = torch.ones(n, dtype=torch.float32, device=c.device)
            r1 = torch.matmul(ab, torch.matmul(bb, ones_n).unsqueeze(-1))[..., 0]   # (nf, m)
            r2 = torch.matmul(ab, torch.matmul(bb, wn).unsqueeze(-1))[..., 0]
            rmag = torch.matmul(ab.abs(), torch.matmul(bb.abs(), ones_n).unsqueeze(-1))[..., 0]
            rmag2 = torch.matmul(ab.abs(), torch.matmul(bb.abs(), wn).unsqueeze(-1))[..., 0]
            if bias32 is not None:
                r1, r2 = r1 + bias32.sum(), r2 + (wn * bias32).sum()
                rmag, rmag2 = rmag + bias32.abs().sum(), rmag2 + (wn * bias32.abs()).sum()
            rscale = tolerance_scale(k, n, c.dtype, chk.factor)
            rtol = threshold(rmag, rscale, underflow_floor(n, c.dtype, chk.factor))
            rtol2 = threshold(rmag2, rscale, underflow_floor(n * n, c.dtype, chk.factor))
            rows = cb.sum(-1)
            rflag = ~((rows - r1).abs() <= rtol)
            ri, rr = rflag.nonzero(as_tuple=True)
            if len(ri):
                rres = eec.correct_vectors(cb[ri, rr, :], r1[ri, rr], r2[ri, rr], rtol[ri, rr], rtol2[ri, rr],
                                           near_inf, t_correct)
                rok = rres.status == eec.CORRECTED
                cb[ri[rok], rr[rok], rres.index[rok]] = rres.new[rok]
                fixes += [(int(bidx[i]), int(r), int(j), float(o), float(nv))
                          for i, r, j, o, nv in zip(ri[rok].tolist(), rr[rok].tolist(), rres.index[rok].tolist(),
                                                    rres.old[rok].tolist(), rres.new[rok].tolist())]
            # verify the unsettled columns again
            recheck = ~((cb.sum(1) - s1).abs() <= tol1)
            settled = settled | ~recheck
        if bool(settled.all()):
            _write_back(c, batch_shape, fixes)
        else:
            out.kind = "uncorrectable"
            fixes = []
            if recompute:
                fresh = _matmul(ab, bb, bias32).to(c.dtype)
                _write_batches(c, batch_shape, bidx, fresh)
                out.recomputed = True
        out.fixes = [Fix(_unravel(bi, batch_shape), r, j, o, nv) for bi, r, j, o, nv in fixes]
        chk.col = colsum(c)
        chk.flag = torch.zeros_like(chk.flag)
    return out


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
