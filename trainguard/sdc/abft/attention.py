"""Protected multi-head attention: the six GEMMs in three protection sections with checksum passing, and
checks on the non-GEMM steps between them (masking, softmax).

Relies on ``torch`` (autograd ``Function``) and :mod:`trainguard.sdc.abft.checksums`.

Sections (ATTNChecker Section 4.4): ``AS = {X W^Q, X W^K, Q K^T}``, ``CL = {X W^V, AP V}``,
``O = {CL W^O}``. Checksum passing: the section input ``X`` is encoded once (``1^T X`` and ``1^T |X|``);
each product's verified recomputed column checksum (and magnitude bound) is the input checksum of the
next GEMM in the section (K's feeds the row check of ``Q K^T``, which is the column check of
``K Q^T``), so no GEMM input is summed twice. Scores and context are checked along their rows (the
contiguous direction); CL's column checksum for ``CL W^O`` is encoded from the verified CL. Unlike the
paper, Q, K and V are verified (and corrected) themselves rather than only through the
propagated 1R/1C pattern they leave in ``AS`` / ``CL``: in training Q, K and V are saved for the backward
pass, and a corrected ``AS`` with a corrupted ``Q`` would still poison the gradients. Detection of a whole
section costs one host sync (``any()`` over the section's flags); location/correction runs only after a
flag, and products downstream of a corrected one are recomputed (from verified inputs, as new autograd
nodes).

Non-GEMM steps (product names :data:`NONGEMM_PRODUCTS`, fired to fault hooks like the GEMM products):

* ``scaled``: the attention scale is the ``Q K^T`` GEMM's alpha, so the scaling's output *is* the GEMM's
  output: the hook fires there, before the scores check, which covers it.
* ``masked``: the scores after the additive mask (the softmax input), written over the verified scores.
  Where the mask allows a key its value is 0, so the masked row sums over the allowed keys must equal
  the verified scores' (one reduction before the mask, one after, against the mask's 0/1 pattern).
* ``probs``: the softmax output. Each row must sum to 1 (a third row of the context check's GEMV, free)
  and, with a mask, put all of it on allowed keys (one reduction).
  A flag on ``masked`` or ``probs`` cannot be corrected from checksums: it is escalated to the step guard
  (the softmax input is gone once the softmax has written over it).

Every product is computed by :class:`ProtectedMatmul`, whose backward computes the two gradient GEMMs and,
with ``ABFTConfig(backward=True)``, verifies and corrects them with the same checksums. Backward product
names (for fault hooks, events and counters; counted in their forward product's section) are in
:data:`BACKWARD_PRODUCTS`.

Grouped-query attention (K / V with fewer heads than Q): the ``g`` query heads that share a key/value
head are one GEMM operand, ``(B, H_kv, g T, d)`` (a view: no ``repeat_kv`` copy of K or V), so the
scores and context GEMMs, their checks and their gradients run per key/value head.

Shapes: ``x`` is (batch, seq, hidden) with hidden = heads * head_dim; K/V may be longer than Q (a KV
cache). Anything else raises :class:`trainguard.errors.ShapeError`; nothing is skipped.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from typing import Callable

import torch
import torch.nn.functional as F

from trainguard.errors import ShapeError
from trainguard.sdc.abft import checksums as cks
from trainguard.sdc.abft.layout import stacked_rows

SECTIONS = ("AS", "CL", "O")
PRODUCTS = ("q", "k", "v", "scores", "context", "output")
#: products of the non-GEMM steps (see the module docstring)
NONGEMM_PRODUCTS = ("scaled", "masked", "probs")
SECTION_OF = {"q": "AS", "k": "AS", "scores": "AS", "v": "CL", "context": "CL", "output": "O",
              "scaled": "AS", "masked": "AS", "probs": "CL"}
#: forward product -> (gradient w.r.t. its left operand, gradient w.r.t. its right operand)
BACKWARD_PRODUCTS = {
    "q": ("grad_q_input", "grad_q_weight"),          # dX = dQ W^Q ;  dW^Q = X^T dQ
    "k": ("grad_k_input", "grad_k_weight"),
    "v": ("grad_v_input", "grad_v_weight"),
    "scores": ("grad_scores_q", "grad_scores_k"),    # dQ = dAS K ;   dK = dAS^T Q
    "context": ("grad_context_probs", "grad_context_v"),  # dAP = dCL V^T ; dV = AP^T dCL
    "output": ("grad_output_input", "grad_output_weight"),  # dCL = dO W^O ; dW^O = CL^T dO
}
for _p, (_ga, _gb) in BACKWARD_PRODUCTS.items():
    SECTION_OF[_ga] = SECTION_OF[_gb] = SECTION_OF[_p]


class _Spec:
    """What one protected GEMM computes: ``parts`` = ((product, lo, hi, check_backward), ...), the products as
    column blocks ``[lo, hi)`` of the output (``lo = None``: the whole output is one product). A fused QKV
    projection has three parts. ``alpha`` scales the product (batched GEMMs only: the attention scale of
    ``Q K^T``, applied by the GEMM rather than by a pass over its output). ``group`` > 1: grouped-query
    attention, ``group`` query heads per key/value head (the left operand is (B, H, T, k), the right one
    (B, H / group, ...))."""

    __slots__ = ("a_nonneg", "alpha", "bt", "group", "layer", "parts", "rt")

    def __init__(self, rt, layer: int, parts: tuple, bt: bool = False, alpha: float = 1.0, group: int = 1,
                 a_nonneg: bool = False):
        self.rt, self.layer, self.parts, self.bt, self.alpha, self.group = rt, layer, parts, bt, alpha, group
        self.a_nonneg = a_nonneg


def _bmm(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """``alpha * a @ b``; with ``alpha != 1`` the operands are batched with equal batch shapes (the scores
    GEMM and its gradients): ``baddbmm`` with beta = 0 scales inside the GEMM (bitwise what a separate
    multiply gives, without its pass over the output)."""
    if alpha == 1.0:
        return torch.matmul(a, b)
    a3, b3 = a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])
    # allocated in its final shape (not a view: the softmax may write over it in place)
    out = torch.empty(*a.shape[:-1], b.shape[-1], dtype=torch.promote_types(a.dtype, b.dtype), device=a.device)
    o3 = out.view(-1, *out.shape[-2:])
    torch.baddbmm(o3, a3, b3, beta=0, alpha=alpha, out=o3)
    return out


def _grouped(t: torch.Tensor, group: int) -> torch.Tensor:
    """(B, H, T, x) -> (B, H / group, group T, x): the query heads that share a key/value head as one operand."""
    if group == 1:
        return t
    b, h, s, x = t.shape
    return t.reshape(b, h // group, group * s, x)


def _ungrouped(t: torch.Tensor, group: int) -> torch.Tensor:
    if group == 1:
        return t
    b, hk, gs, x = t.shape
    return t.view(b, hk * group, gs // group, x)


def _product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, spec: _Spec) -> torch.Tensor:
    """The GEMM itself (the forward of :class:`ProtectedMatmul`, and its exact recomputation)."""
    bm = b.transpose(-1, -2) if spec.bt else b
    if b.dim() == 2:
        out = torch.empty(*a.shape[:-1], bm.shape[-1], dtype=a.dtype, device=a.device)
        if bias is not None:
            torch.addmm(bias, a.reshape(-1, a.shape[-1]), bm, out=out.view(-1, bm.shape[-1]))
        else:
            torch.mm(a.reshape(-1, a.shape[-1]), bm, out=out.view(-1, bm.shape[-1]))
        return out
    if spec.group > 1:  # written through a grouped view of an output allocated in (B, H, T, n)
        out = torch.empty(*a.shape[:-1], bm.shape[-1], dtype=torch.promote_types(a.dtype, b.dtype), device=a.device)
        og = _grouped(out, spec.group)
        ag = _grouped(a, spec.group)
        if spec.alpha != 1.0:
            torch.baddbmm(og.view(-1, *og.shape[-2:]), ag.reshape(-1, *ag.shape[-2:]), bm.reshape(-1, *bm.shape[-2:]),
                          beta=0, alpha=spec.alpha, out=og.view(-1, *og.shape[-2:]))
        else:
            torch.matmul(ag, bm, out=og)
    else:
        out = _bmm(a, bm, spec.alpha)
    return out + bias if bias is not None else out


@contextlib.contextmanager
def _slow_path(rt, device: torch.device):
    """Adds the block's wall time (location, correction, recomputation after a flag) to
    ``rt.correction_seconds``; on CUDA it waits for the recomputations the block queued, so they count
    (the slow path syncs anyway, to locate)."""
    t0 = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    rt.correction_seconds += time.perf_counter() - t0


def _any(checks) -> torch.Tensor:
    """One flag for several pending checks (evaluating it is the one host sync)."""
    if len(checks) == 1:
        return checks[0].any()
    return torch.stack([c.any() for c in checks]).any()


def _resolve_parts(rt, layer: int, checks) -> set:
    """Slow path: resolve every flagged product of ``checks`` = [(GemmCheck, [(product, lo, hi), ...])];
    returns the products corrected (or recomputed)."""
    changed = set()
    for chk, subs in checks:
        if not bool(chk.any()):
            continue
        for product, lo, hi in subs:
            sub = chk if lo is None else chk.columns(lo, hi)
            if bool(sub.any()):
                out = cks.resolve(sub, **rt.resolve_kw())
                rt.record(layer, product, out)
                if out.kind in (cks.CORRECTED, cks.RECOMPUTED) and (out.fixes or out.recomputed):
                    changed.add(product)
    return changed


class ProtectedMatmul(torch.autograd.Function):
    """``a @ b + bias`` whose backward GEMMs go through fault hooks and (optionally) ABFT checks.

    ``b`` is (k, n) (a weight, shared over the batch) or (..., k, n); ``spec`` is a :class:`_Spec`; with
    ``spec.bt`` the product is ``a @ b^T`` with ``b`` (..., n, k) (``Q K^T`` from K itself), so that both
    gradients, ``dC B`` and ``dC^T A``, come out of their GEMMs contiguous. For a
    fused product (several parts), the weight gradient ``A^T dC`` is one GEMM whose column blocks are the
    parts' weight gradients (each block fires its own hook; one check covers the blocks that are due, and a
    flag is resolved block by block); the input gradient ``dC B^T`` is one GEMM (the sum over the parts):
    the hooks of every part's input gradient see it, and it is verified (and counted) once, under the
    first due part's name.
    """

    @staticmethod
    def forward(ctx, a, b, bias, spec):
        ctx.save_for_backward(a, b)
        ctx.spec = spec
        ctx.has_bias = bias is not None
        return _product(a, b, bias, spec)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        spec = ctx.spec
        rt, layer, parts, grp, alpha = spec.rt, spec.layer, spec.parts, spec.group, spec.alpha
        due = [p for p in parts if p[3]]
        fac = rt.cfg.tolerance_factor
        ga = gb = gbias = None
        g = g if g.dtype == a.dtype else g.to(a.dtype)
        if g.dim() > 2 and not g.is_contiguous():
            g = g.contiguous()  # once, rather than inside each of the two matmuls
        checks = []
        gg = _grouped(g, grp)
        if b.dim() == 2 and a.dim() > 2:
            a2, g2 = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
        else:
            a2, g2 = _grouped(a, grp), gg
        # the statistics of both checks in one pass over the gradient (and over A)
        st = None
        if due and ctx.needs_input_grad[0] and ctx.needs_input_grad[1]:
            st = _gradient_stats(gg, g2, a2, spec.a_nonneg)
        if ctx.needs_input_grad[0]:
            bt = b if spec.bt else b.transpose(-1, -2)
            ga_g = _bmm(gg, bt, alpha)
            ga = _ungrouped(ga_g, grp)
            for p in parts:
                rt.fire(layer, BACKWARD_PRODUCTS[p[0]][0], ga)
            if due:
                kw = {}
                if st is not None:
                    exp_a, b_cn = _b_side(st.col_g, bt)
                    kw = dict(a_col=st.col_g, a_rn=st.g_rn, b_cn=b_cn, expected=exp_a)
                checks.append((cks.detect(ga_g, gg, bt, factor=fac, alpha=alpha, carried=False,
                                          rerun=lambda: _bmm(gg, bt, alpha), **kw),
                               [(BACKWARD_PRODUCTS[due[0][0]][0], None, None)]))
        if ctx.needs_input_grad[1]:
            at = a2.transpose(-1, -2)
            if spec.bt:  # d(b) = dC^T A, in b's (n, k) layout; its transpose A^T dC is what is checked
                gb = _bmm(g2.transpose(-1, -2), a2, alpha)
                gview = gb.transpose(-1, -2)

                def rerun_b():
                    return _bmm(g2.transpose(-1, -2), a2, alpha).transpose(-1, -2)
            else:
                gb = gview = _bmm(at, g2, alpha)

                def rerun_b():
                    return _bmm(at, g2, alpha)
            for p, plo, phi, _ in parts:
                rt.fire(layer, BACKWARD_PRODUCTS[p][1], gb if plo is None else gview[..., plo:phi])
            if due:
                lo, hi = due[0][1], due[-1][2]
                whole = lo is None or (lo == 0 and hi == gview.shape[-1])

                def cut(t):
                    return t if t is None or whole or t.shape[-1] == 1 else t[..., lo:hi]
                kw = {} if st is None else dict(a_col=st.a_rows, a_rn=st.a_rn, b_cn=cut(st.g_cn),
                                                expected=cut(st.exp_b), mag=cut(st.mag_b))
                if whole:
                    chk = cks.detect(gview, at, g2, factor=fac, alpha=alpha, rerun=rerun_b, carried=False, **kw)
                else:
                    chk = cks.detect(gview[..., lo:hi], at, g2[..., lo:hi], factor=fac, alpha=alpha,
                                     rerun=lambda: rerun_b()[..., lo:hi], carried=False, **kw)
                checks.append((chk, [(BACKWARD_PRODUCTS[p][1], None if plo is None else plo - (lo or 0),
                                      None if plo is None else phi - (lo or 0)) for p, plo, phi, _ in due]))
            if gb.dim() > b.dim():
                gb = gb.sum(tuple(range(gb.dim() - b.dim())))
        if checks and bool(_any([c for c, _ in checks])):
            with _slow_path(rt, g.device):
                _resolve_parts(rt, layer, checks)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gbias = g.reshape(-1, g.shape[-1]).sum(0)
        return ga, gb, gbias, None


#: bytes of the output gradient the backward checks' statistics take per chunk: each chunk's square is still in
#: the cache when its two reductions read it (one pass over the gradient from memory instead of three)
STATS_CHUNK_BYTES = 4 << 20


class _GradStats:
    """What both backward checks of a node need from one pass over the output gradient ``g`` and the left
    operand ``A`` (see :func:`_gradient_stats`)."""

    __slots__ = ("a_rn", "a_rows", "col_g", "exp_b", "g_cn", "g_rn", "mag_b")

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw.get(k))


def _gradient_stats(gg: torch.Tensor, g2: torch.Tensor, a2: torch.Tensor, a_nonneg: bool) -> _GradStats:
    """The two backward checks' inputs of a node, ``dA = g B^T`` (checked per batch slice of ``gg``
    (..., m, n)) and ``dB = A^T g2`` (``g2`` is ``gg`` itself, or its rows flattened over the batch when
    ``B`` is a 2-D weight whose gradient sums over the batch), all fp32:

    * ``col_g`` = ``1^T g`` per slice (the input checksum of ``dA``) and ``exp_b`` = ``(A 1)^T g2`` (the
      predicted checksum of ``dB``, before alpha, a batched GEMV); ``a_rows`` =
      ``(A 1)^T`` (``1^T`` of ``A^T``, the ``dB`` check's input checksum);
    * ``g_rn`` = ``sum_i ||g_i||`` per slice (``dA``'s Cauchy-Schwarz magnitude, with ``B``'s norms);
    * ``dB``'s magnitude: with ``a_nonneg`` (``A`` elementwise >= 0: attention probabilities) the exact
      ``mag_b`` = ``(|A| 1)^T |g2|`` = ``(A 1)^T |g2|`` (a second GEMV); otherwise the Cauchy-Schwarz
      factors ``a_rn`` = ``sum_l ||A_:l||`` and ``g_cn`` = ``||g2_:j||``.

    The slices are taken in chunks of about :data:`STATS_CHUNK_BYTES`, so that ``g * g`` is reduced both
    ways while it is in the cache.
    """
    flat = g2.dim() != gg.dim()
    m, n = gg.shape[-2], gg.shape[-1]
    g3 = gg.reshape(-1, m, n)
    a3 = a2.reshape(-1, m, a2.shape[-1])
    slices = g3.shape[0]
    per = max(1, STATS_CHUNK_BYTES // max(1, m * n * 4))
    col_g, exp_b, rows, g_rn, g_csq, a_csq, mag_b = [], [], [], [], [], [], []
    for s0 in range(0, slices, per):
        gc, ac = g3[s0:s0 + per], a3[s0:s0 + per]
        gc = gc if gc.dtype == torch.float32 else gc.float()
        rs = ac.sum(-1, dtype=torch.float32).unsqueeze(-2)                          # (c, 1, m)
        # (a column reduction and a one-row GEMV: cheaper than one two-row GEMV on CPU)
        col_g.append(gc.sum(-2, keepdim=True))                                      # (c, 1, n)
        exp_b.append(torch.bmm(rs, gc))                                              # (c, 1, n)
        rows.append(rs)
        sq = gc * gc
        g_rn.append(sq.sum(-1).sqrt_().sum(-1))                                     # (c,)
        if a_nonneg:
            mag_b.append(torch.bmm(rs, gc.abs()))                                    # (c, 1, n)
        else:
            g_csq.append(sq.sum(-2))                                                 # (c, n)
            a32 = ac if ac.dtype == torch.float32 else ac.float()
            a_csq.append((a32 * a32).sum(-2))                                        # (c, k)
    batch = gg.shape[:-2]
    st = _GradStats(col_g=torch.cat(col_g).view(*batch, 1, n),
                    g_rn=torch.cat(g_rn).view(*batch, 1, 1))
    if flat:  # dB = A^T g2 sums over every slice: one checksum row, one set of norms
        st.exp_b = torch.cat(exp_b).sum(0)                                          # (1, n)
        st.a_rows = torch.cat(rows).view(1, -1)
        if a_nonneg:
            st.mag_b = torch.cat(mag_b).sum(0)
        else:
            st.g_cn = torch.cat(g_csq).sum(0).sqrt_().unsqueeze(0)
            st.a_rn = torch.cat(a_csq).sum(0).sqrt_().sum().view(1, 1)
    else:
        st.exp_b = torch.cat(exp_b).view(*batch, 1, n)
        st.a_rows = torch.cat(rows).view(*batch, 1, m)
        if a_nonneg:
            st.mag_b = torch.cat(mag_b).view(*batch, 1, n)
        else:
            st.g_cn = torch.cat(g_csq).sqrt_().view(*batch, 1, n)
            st.a_rn = torch.cat(a_csq).sqrt_().sum(-1).view(*batch, 1, 1)
    return st


def _b_side(col_g: torch.Tensor, bt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The right operand's share of the ``dA = g bt`` check: the predicted checksum ``(1^T g) bt`` (before
    alpha) and ``bt``'s column norms (the Cauchy-Schwarz magnitude's other factor), fp32, from one pass over
    ``bt`` in chunks of about :data:`STATS_CHUNK_BYTES` (the square of a chunk is reduced while it is in
    the cache: a weight's ``bt * bt`` would otherwise be written to memory and read back). ``bt`` is a 2-D
    weight (n, k), chunked along its rows, or batched like ``col_g`` (..., 1, n), chunked along the batch."""
    b32 = bt if bt.dtype == torch.float32 else None
    if bt.dim() == 2:
        n, k = bt.shape
        step = max(1, STATS_CHUNK_BYTES // max(1, k * 4))
        exp = csq = None
        for r0 in range(0, n, step):
            bc = bt[r0:r0 + step] if b32 is not None else bt[r0:r0 + step].float()
            e = torch.matmul(col_g[..., r0:r0 + step], bc)
            q = cks.norms(bc, -2).square_() if bc.stride(-2) == 1 else (bc * bc).sum(-2)
            exp, csq = (e, q) if exp is None else (exp.add_(e), csq.add_(q))
        return exp, csq.sqrt_().unsqueeze(0)
    batch = bt.shape[:-2]
    b3 = bt.reshape(-1, *bt.shape[-2:])
    c3 = col_g.expand(*batch, *col_g.shape[-2:]).reshape(-1, *col_g.shape[-2:])
    step = max(1, STATS_CHUNK_BYTES // max(1, b3.shape[-2] * b3.shape[-1] * 4))
    exp, cn = [], []
    for s0 in range(0, b3.shape[0], step):
        bc = b3[s0:s0 + step] if b32 is not None else b3[s0:s0 + step].float()
        exp.append(torch.bmm(c3[s0:s0 + step], bc))
        cn.append(cks.col_norms(bc))
    return torch.cat(exp).view(*batch, 1, -1), torch.cat(cn).view(*batch, 1, -1)


class _ScaledSoftmax(torch.autograd.Function):
    """``softmax(bias + scale * scores)`` in fp32 without (B, H, T, T) temporaries on CPU: the softmax kernel
    works row by row, so it writes the probabilities over its input. With ``scale = 1`` (the kernel folds
    the attention scale into the ``Q K^T`` GEMM) that input is the scores buffer itself: the product is
    verified by then and no GEMM's backward needs it. Otherwise one logits buffer is made, and the
    backward scales the softmax gradient in place. ``bias`` is an additive mask (no gradient).
    ``between(logits)`` (optional) is called on the softmax input once the mask is added, before the
    softmax reads it (the ``masked`` hook and check)."""

    @staticmethod
    def forward(ctx, scores, bias, scale, between=None):
        cpu32 = scores.dtype == torch.float32 and scores.device.type == "cpu"
        if cpu32 and scale == 1.0:
            logits = scores if bias is None else scores.add_(bias)
            ctx.mark_dirty(scores)
        elif bias is not None:
            logits = torch.add(bias, scores, alpha=scale) if scale != 1.0 else bias + scores
        else:
            logits = scores * scale if scale != 1.0 else scores
        if between is not None:
            between(logits)
        if cpu32:
            probs = torch.ops.aten._softmax.out(logits, -1, False, out=logits)
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        ctx.save_for_backward(probs)
        ctx.scale, ctx.in_dtype = scale, logits.dtype
        return probs

    @staticmethod
    def backward(ctx, g):
        (probs,) = ctx.saved_tensors
        gl = torch._softmax_backward_data(g.contiguous(), probs, -1, probs.dtype)
        if ctx.scale != 1.0:
            gl.mul_(ctx.scale)
        return gl.to(ctx.in_dtype), None, None, None


class _HeadsQKV(torch.autograd.Function):
    """A fused (B, T, 3 H d) QKV product -> contiguous (B, H, T, d) q, k, v: one copy forward, and one
    (B, T, 3 H d) gradient written head by head backward (unbind + permute would allocate it twice)."""

    @staticmethod
    def forward(ctx, qkv, n_heads, head_dim):
        b, t, _ = qkv.shape
        ctx.dims = (b, t, n_heads, head_dim)
        hm = qkv.view(b, t, 3, n_heads, head_dim).permute(2, 0, 3, 1, 4).contiguous()
        return hm[0], hm[1], hm[2]

    @staticmethod
    def backward(ctx, gq, gk, gv):
        b, t, h, d = ctx.dims
        ref = next(x for x in (gq, gk, gv) if x is not None)
        grad = torch.empty(b, t, 3, h, d, dtype=ref.dtype, device=ref.device)
        gp = grad.permute(2, 0, 3, 1, 4)
        for i, gi in enumerate((gq, gk, gv)):
            if gi is None:
                gp[i].zero_()
            else:
                gp[i].copy_(gi)
        return grad.view(b, t, 3 * h * d), None, None


class _Proj:
    """A projection as ``x @ w + bias`` with ``w`` (in, out) (a transposed Linear weight or a Conv1D one)."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None):
        self.w, self.bias = w, bias


def linear_proj(lin: torch.nn.Module) -> _Proj:
    return _Proj(lin.weight.t(), lin.bias)


def conv1d_proj(conv: torch.nn.Module, start: int | None = None, stop: int | None = None) -> _Proj:
    w, b = conv.weight, conv.bias
    if start is not None:
        w, b = w[:, start:stop], (b[start:stop] if b is not None else None)
    return _Proj(w, b)


def _split(t: torch.Tensor, h: int, d: int) -> torch.Tensor:
    b, s, _ = t.shape
    return t.view(b, s, h, d).transpose(1, 2)


def _heads_vec(v: torch.Tensor, h: int, d: int) -> torch.Tensor:
    """(B, 1, H*d) checksum -> (B, H, 1, d)."""
    return v.view(v.shape[0], 1, h, d).transpose(1, 2)


@functools.lru_cache(maxsize=16)
def causal_bias(tq: int, tk: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive causal mask (tq, tk): 0 where query i may attend key j (j <= i + tk - tq), the dtype's most
    negative finite value elsewhere (the softmax gives exactly 0 there, as with -inf, and masked sums stay
    finite). Cached (read-only: it is only ever an operand)."""
    m = torch.ones(tq, tk, dtype=torch.bool, device=device).triu(tk - tq + 1)
    return torch.zeros(tq, tk, dtype=dtype, device=device).masked_fill_(m, torch.finfo(dtype).min)


def sliding_causal_bias(tq: int, tk: int, window: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Causal mask that also hides keys more than ``window - 1`` positions back (Mistral / Qwen2 sliding
    window, as transformers' ``sliding_window_causal_mask_function``)."""
    q = torch.arange(tk - tq, tk, device=device)[:, None]
    k = torch.arange(tk, device=device)[None, :]
    allowed = (k <= q) & (k > q - window)
    return torch.zeros(tq, tk, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)


class _MaskInfo:
    """The 0/1 pattern of the keys a mask allows (``allowed``, the mask's shape), the mask's own sum and
    absolute sum over them (0 for the usual 0 / -inf masks) and which rows allow any key (``rows``).
    Computed for every call, without a host sync: the same ops in a forward and in its activation-
    checkpoint recomputation (no cache that the first layer fills and the others read)."""

    __slots__ = ("allowed", "bias_abs", "bias_sum", "rows")

    def __init__(self, bias: torch.Tensor):
        ok = bias > torch.finfo(bias.dtype).min / 2
        self.allowed = ok.to(bias.dtype)
        self.rows = ok.any(-1).to(torch.float32)
        self.bias_sum = _allowed_sum(bias, self.allowed)
        self.bias_abs = _allowed_sum(bias.abs(), self.allowed)


def _allowed_sum(t: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """fp32 ``sum_j t_ij allowed_ij`` over the last dimension."""
    if t.dtype == torch.float32 and allowed.dtype == torch.float32:
        return torch.linalg.vecdot(t, allowed)
    return torch.sum(t * allowed, -1, dtype=torch.float32)


class _Pending:
    """A flag computed without a host sync (non-GEMM checks), resolved with the section's sync."""

    __slots__ = ("flag", "product", "reason")

    def __init__(self, flag: torch.Tensor, product: str, reason: str):
        self.flag, self.product, self.reason = flag, product, reason

    def any(self) -> torch.Tensor:
        return self.flag.any()


def _softmax_tolerance(dtype: torch.dtype, tk: int, factor: float) -> float:
    """Bound on |sum_j p_ij - 1| for a softmax row of ``tk`` probabilities stored in ``dtype`` (each rounded
    once to it, a few fp32 roundings in exp and the division, the fp32 sum)."""
    return factor * (cks.unit_roundoff(dtype) + (math.sqrt(tk) + 8) * cks.U_ACC)


def _core(rt, layer: int, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, *, scale: float,
          bias: torch.Tensor | None, dropout_p: float, due: tuple[bool, bool, bool], bwd: bool, fac: float,
          k_col: torch.Tensor | None, first_checks: list, recompute_heads: Callable | None,
          output_fn: Callable | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores, mask, softmax, context (and the output projection through ``output_fn(ctx, hooks) -> (out,
    check)``) with their checks; ``first_checks`` (the projections' pending checks) join the first sync.
    ``qh`` (B, H, T, d) and ``kh`` / ``vh`` (B, H_kv, T_k, d), contiguous. Returns (output or context
    (B, H, T, d), probabilities)."""
    due_as, due_cl, due_o = due
    bsz, n_heads, t = qh.shape[0], qh.shape[1], qh.shape[2]
    n_kv = kh.shape[1]
    if n_kv == 0 or n_heads % n_kv or vh.shape[1] != n_kv:
        raise ShapeError(f"protected attention: {n_heads} query heads cannot share {n_kv} key / {vh.shape[1]} "
                         "value heads")
    grp = n_heads // n_kv

    def scores_gemm(qh, kh):  # alpha * Q K^T: the attention scale is applied by the GEMM
        return ProtectedMatmul.apply(qh, kh, None, _Spec(rt, layer, (("scores", None, None, bwd and due_as),),
                                                         True, scale, grp))

    def scores_check(qh, kh, scores, k_col):
        # row sums of AS = Q (K^T 1): checked as the columns of AS^T = K Q^T, carrying K's checksum
        spec = _Spec(rt, layer, (), True, scale, grp)
        return cks.detect(_grouped(scores, grp).transpose(-1, -2), kh, _grouped(qh, grp).transpose(-1, -2),
                          a_col=k_col, factor=fac, alpha=scale,
                          rerun=lambda: _grouped(_product(qh, kh, None, spec), grp).transpose(-1, -2))

    scores = scores_gemm(qh, kh)
    rt.fire(layer, "scores", scores)
    rt.fire(layer, "scaled", scores)  # the scale is the GEMM's alpha: the scaling's output is this product
    scores_chk = scores_check(qh, kh, scores, k_col) if due_as else None

    # ---- one host sync for section AS (and the projections): settle Q, K, V and the scores before the softmax
    first = [c for c, _ in first_checks] + ([scores_chk] if scores_chk is not None else [])
    if first and bool(_any(first)):
        with _slow_path(rt, qh.device):
            changed = _resolve_parts(rt, layer, first_checks)
            if changed and recompute_heads is not None:  # downstream of a corrected Q / K / V: new nodes, no hooks
                qh2, kh2, vh = recompute_heads()
                if changed & {"q", "k"}:
                    qh, kh = qh2, kh2
                    scores = scores_gemm(qh, kh)
                    scores_chk = scores_check(qh, kh, scores, None) if due_as else None
            if scores_chk is not None and bool(scores_chk.any()):
                rt.record(layer, "scores", cks.resolve(scores_chk, **rt.resolve_kw()))

    # ---- mask and softmax (non-GEMM): checked against the verified scores
    pending: list[_Pending] = []
    info = _MaskInfo(bias) if bias is not None else None
    before = None
    if info is not None and due_as:
        before = _allowed_sum(scores, info.allowed) + info.bias_sum
        mag = scores_chk.mag.reshape(bsz, n_heads, t) + info.bias_abs
        tol_m = cks.threshold(mag, cks.tolerance_scale(0, scores.shape[-1], scores.dtype, fac),
                              cks.underflow_floor(scores.shape[-1], scores.dtype, fac))

    def between(logits):
        if info is not None:
            rt.fire(layer, "masked", logits)
            if before is not None:
                dev = (_allowed_sum(logits, info.allowed) - before).abs()
                pending.append(_Pending(torch.le(dev, tol_m).logical_not_(), "masked",
                                        "softmax input changed after the scores were verified"))

    if bias is not None and (bias.requires_grad or bias.dim() > scores.dim() or any(
            b_ not in (1, s_) for b_, s_ in zip(reversed(bias.shape), reversed(scores.shape)))):
        logits = bias + scores
        between(logits)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        probs = _ScaledSoftmax.apply(scores, bias, 1.0, between)
    # the softmax saved its output for backward: a fault in it reaches the backward too, as in hardware
    # (``.data``: the hook's in-place write is not an autograd-visible modification)
    rt.fire(layer, "probs", probs.data)
    probs = probs.to(vh.dtype)
    tk = probs.shape[-1]
    tol_p = _softmax_tolerance(probs.dtype, tk, fac)
    if due_cl and info is not None:  # all of each row on the keys the mask allows
        dev = (_allowed_sum(probs, info.allowed) - info.rows).abs()
        pending.append(_Pending(torch.le(dev, tol_p).logical_not_(), "probs", "softmax output leaks onto masked keys"))
    ones = None
    if due_cl:
        if dropout_p > 0.0:  # the context GEMM reads dropped probabilities: sum the softmax output itself
            dev = (probs.sum(-1, dtype=torch.float32) - 1).abs()
            pending.append(_Pending(torch.le(dev, tol_p).logical_not_(), "probs", "softmax output rows do not sum to 1"))
        else:
            ones = torch.ones(1, tk, dtype=torch.float32, device=probs.device)
    probs_d = F.dropout(probs, p=dropout_p, training=True) if dropout_p > 0.0 else probs

    # ---- section CL: AP V;  section O: CL W^O  (one host sync for both)
    # (the probabilities are >= 0, also after dropout: the weight-gradient check dV = AP^T dCL gets the exact
    # magnitude (AP 1)^T |dCL| from the probabilities' row sums it needs anyway)
    ctx_spec = _Spec(rt, layer, (("context", None, None, bwd and due_cl),), group=grp, a_nonneg=True)

    def context_check(ctx, vh, probs_d):
        # row sums of CL = AP (V 1): columns of CL^T = V^T AP^T; AP >= 0 (also after dropout), so the
        # exact magnitude AP |V| 1 comes from the same GEMV as the checksum AP (V 1), and so do the
        # softmax row sums 1^T AP^T when asked for
        spec = _Spec(rt, layer, (), group=grp)
        return cks.detect(_grouped(ctx, grp).transpose(-1, -2), vh.transpose(-1, -2),
                          _grouped(probs_d, grp).transpose(-1, -2), b_nonneg=True, factor=fac, extra_rows=ones,
                          rerun=lambda: _grouped(_product(probs_d, vh, None, spec), grp).transpose(-1, -2))

    ctx = ProtectedMatmul.apply(probs_d, vh, None, ctx_spec)
    rt.fire(layer, "context", ctx)
    ctx_chk = None
    if due_cl:
        ctx_chk = context_check(ctx, vh, probs_d)
        if ones is not None:
            dev = (ctx_chk.extra - 1).abs()
            pending.append(_Pending(torch.le(dev, tol_p).logical_not_(), "probs", "softmax output rows do not sum to 1"))
    out, out_chk = output_fn(ctx, True) if output_fn is not None else (ctx, None)
    second = [c for c in (ctx_chk, out_chk) if c is not None] + pending
    if second and bool(_any(second)):
        with _slow_path(rt, qh.device):
            bad = [p for p in pending if bool(p.any())]
            for p in bad[:1]:  # the first non-GEMM flag; what follows from it is downstream
                rt.escalate(layer, p.product, p.reason)
            if not bad:
                if ctx_chk is not None and bool(ctx_chk.any()):
                    res = cks.resolve(ctx_chk, **rt.resolve_kw())
                    rt.record(layer, "context", res)
                    if output_fn is not None and (res.fixes or res.recomputed):
                        out, out_chk = output_fn(ctx, False)  # from the corrected CL
                if out_chk is not None and bool(out_chk.any()):
                    rt.record(layer, "output", cks.resolve(out_chk, **rt.resolve_kw()))
    return out, probs


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def protected_attention(rt, layer: int, x: torch.Tensor, pq: _Proj, pk: _Proj | None, pv: _Proj | None,
                        po: _Proj, *, n_heads: int, head_dim: int, scale: float,
                        mask_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                        bias_fn: Callable | None = None,
                        rope: Callable[[torch.Tensor], torch.Tensor] | None = None,
                        kv_update: Callable | None = None, dropout_p: float = 0.0,
                        upcast_scores: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``x`` (B, T, D) with every GEMM protected; returns (output (B, T, D), probs).

    ``pk = pv = None``: ``pq`` is a fused QKV projection (weight (D, 3 H d), columns q | k | v, as GPT-2's
    ``c_attn``): one GEMM and one check for the three products. ``bias_fn(tq, tk, dtype, device)`` returns
    an additive mask broadcastable to the scores (or None), added into the scores buffer; the scores are
    ``scale * Q K^T`` (the GEMM's alpha). ``mask_fn`` (used if no ``bias_fn``) maps scores to masked scores
    and must be additive (its value at zero scores is used as the bias). ``rope`` rotates (B, H, T, d) Q/K;
    ``kv_update`` maps (k, v) heads to the full (cached) k, v; ``upcast_scores`` computes ``Q K^T`` in fp32.
    """
    if x.dim() != 3:
        raise ShapeError(f"protected attention expects (batch, seq, hidden) input, got shape {tuple(x.shape)}")
    bsz, t, dim = x.shape
    hd = n_heads * head_dim
    fused = pk is None and pv is None
    if fused:
        if pq.w.dim() != 2 or pq.w.shape[0] != dim or pq.w.shape[1] != 3 * hd:
            raise ShapeError(f"protected attention: fused qkv projection weight {tuple(pq.w.shape)} does not map "
                             f"hidden {dim} to 3*heads*head_dim {3 * hd}")
    else:
        for name, p in (("q", pq), ("k", pk), ("v", pv)):
            if p is None or p.w.dim() != 2 or p.w.shape[0] != dim or p.w.shape[1] != hd:
                raise ShapeError(f"protected attention: {name} projection weight "
                                 f"{None if p is None else tuple(p.w.shape)} does not map hidden {dim} to "
                                 f"heads*head_dim {hd}")
    if po.w.dim() != 2 or po.w.shape[0] != hd:
        raise ShapeError(f"protected attention: output projection weight {tuple(po.w.shape)} does not take {hd}")
    if t == 0 or bsz == 0:
        raise ShapeError(f"protected attention: empty input {tuple(x.shape)}")
    cfg = rt.cfg
    due_as, due_cl, due_o = rt.due()
    bwd = bool(cfg.backward and cfg.check)
    fac = cfg.tolerance_factor
    dtype = _compute_dtype(x)

    def cast(p: _Proj | None) -> _Proj | None:
        if p is None or (p.w.dtype == dtype and (p.bias is None or p.bias.dtype == dtype)):
            return p
        return _Proj(p.w.to(dtype), p.bias.to(dtype) if p.bias is not None else None)

    with torch.autocast(x.device.type, enabled=False):
        x = x.to(dtype)
        pq, pk, pv, po = cast(pq), cast(pk), cast(pv), cast(po)

        # ---- projections: X W^Q, X W^K (section AS), X W^V (section CL)
        proj_checks = []   # [(GemmCheck, [(product, lo, hi)])]
        k_col = None       # verified column checksum of K, (B, 1, H d)
        if fused:   # GPT-2's c_attn: x @ W + b, W (D, 3 H d)
            w_qkv, b_qkv, bt = pq.w, pq.bias, False
        else:       # Linear q / k / v: their (out, in) weights stacked, x @ [Wq; Wk; Wv]^T in one GEMM
            w_qkv, bt = stacked_rows((pq.w.t(), pk.w.t(), pv.w.t())), True   # a view if they share storage
            biases = (pq.bias, pk.bias, pv.bias)
            b_qkv = None if all(b_ is None for b_ in biases) else torch.cat(
                [b_ if b_ is not None else torch.zeros(hd, dtype=dtype, device=x.device) for b_ in biases])
        blocks = (("q", 0, hd, due_as), ("k", hd, 2 * hd, due_as), ("v", 2 * hd, 3 * hd, due_cl))
        qkv_spec = _Spec(rt, layer, tuple((p, lo, hi, bwd and d) for p, lo, hi, d in blocks), bt)
        qkv = ProtectedMatmul.apply(x, w_qkv, b_qkv, qkv_spec)
        for p, lo, hi, _ in blocks:
            rt.fire(layer, p, qkv[..., lo:hi])
        q, k, v = qkv[..., :hd], qkv[..., hd:2 * hd], qkv[..., 2 * hd:]
        if due_as or due_cl:
            # one check of the fused product over the column block that is due (q|k, v or all): the
            # checksum of a concatenated product is the concatenation of the checksums
            lo, hi = (0 if due_as else 2 * hd), (3 * hd if due_cl else 2 * hd)
            whole = lo == 0 and hi == 3 * hd
            w_in_out = w_qkv.t() if bt else w_qkv          # (D, 3 H d)
            raw = (x, w_qkv.detach(), b_qkv, qkv_spec)
            chk = cks.detect(qkv if whole else qkv[..., lo:hi], x, w_in_out if whole else w_in_out[:, lo:hi],
                             b_qkv if whole or b_qkv is None else b_qkv[lo:hi], factor=fac,
                             rerun=lambda: _product(*raw)[..., lo:hi])
            proj_checks.append((chk, [(p, plo - lo, phi - lo) for p, plo, phi, d in blocks if d]))
            if due_as:
                k_col = chk.col[..., hd:2 * hd]
        if rope is not None or kv_update is not None:
            k_col = None   # rotated / cached K: re-encoded from the heads

        def heads():
            if rope is None and kv_update is None and not upcast_scores:
                # one copy into head-major layout for the three (contiguous operands for every GEMM)
                return _HeadsQKV.apply(qkv, n_heads, head_dim)
            qh, kh, vh = _split(q, n_heads, head_dim), _split(k, n_heads, head_dim), _split(v, n_heads, head_dim)
            if rope is not None:
                qh, kh = rope(qh), rope(kh)
            if kv_update is not None:
                kh, vh = kv_update(kh, vh)
            if upcast_scores:
                qh, kh = qh.float(), kh.float()
            return qh.contiguous(), kh.contiguous(), vh.contiguous()

        if kv_update is not None and proj_checks:  # the cache must only ever see verified K / V
            if bool(_any([c for c, _ in proj_checks])):
                with _slow_path(rt, x.device):
                    _resolve_parts(rt, layer, proj_checks)
            proj_checks = []
        qh, kh, vh = heads()
        tq, tk = qh.shape[-2], kh.shape[-2]
        sdt = torch.promote_types(qh.dtype, kh.dtype)
        if bias_fn is not None:
            bias = bias_fn(tq, tk, sdt, x.device)
        elif mask_fn is not None:
            bias = mask_fn(torch.zeros(1, 1, tq, tk, dtype=sdt, device=x.device))
        else:
            bias = None
        if bias is not None:
            bias = _finite_bias(bias)

        def output(ctx, hooks: bool):
            merged = ctx.transpose(1, 2).reshape(bsz, t, hd)
            spec = _Spec(rt, layer, (("output", None, None, bwd and due_o),))
            out = ProtectedMatmul.apply(merged, po.w, po.bias, spec)
            if hooks:
                rt.fire(layer, "output", out)
            chk = None
            if due_o:
                # CL's column checksum for CL W^O is encoded from CL (recomputed if CL is corrected)
                ctx_col, ctx_rn = cks.encode(merged)
                raw = (merged.detach(), po.w.detach(), po.bias, spec)
                chk = cks.detect(out, merged, po.w, po.bias, a_col=ctx_col, a_rn=ctx_rn, factor=fac,
                                 rerun=lambda: _product(*raw))
            return out, chk

        return _core(rt, layer, qh, kh, vh, scale=scale, bias=bias, dropout_p=dropout_p,
                     due=(due_as, due_cl, due_o), bwd=bwd, fac=fac,
                     k_col=None if k_col is None else _heads_vec(k_col, n_heads, head_dim),
                     first_checks=proj_checks, recompute_heads=heads, output_fn=output)


def _finite_bias(bias: torch.Tensor) -> torch.Tensor:
    """-inf entries of an additive mask as the dtype's most negative finite value (same softmax; the masked
    sums of the checks stay finite)."""
    if bias.is_floating_point():  # (no host sync to find out whether there is any -inf: always clamp)
        return bias.clamp_min(torch.finfo(bias.dtype).min)
    return bias


def protected_core(rt, layer: int, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, *, scale: float,
                   bias: torch.Tensor | None, dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores, mask, softmax and context of already projected (and rotated) heads, every step checked:
    ``qh`` (B, H, T, d), ``kh`` / ``vh`` (B, H_kv, T_k, d) (grouped-query attention when H_kv < H), ``bias``
    an additive mask broadcastable to (B, H, T, T_k) or None. Returns (context (B, H, T, d), probs). The
    projections are checked by :func:`protected_linear` (the transformers attention-interface path)."""
    if qh.dim() != 4 or kh.dim() != 4 or vh.dim() != 4 or qh.shape[-1] != kh.shape[-1] or kh.shape[-2] != vh.shape[-2]:
        raise ShapeError(f"protected attention: q {tuple(qh.shape)}, k {tuple(kh.shape)}, v {tuple(vh.shape)} are "
                         "not (batch, heads, seq, head_dim) with matching sizes")
    cfg = rt.cfg
    due = rt.due()
    dtype = _compute_dtype(qh)
    with torch.autocast(qh.device.type, enabled=False):
        qh, kh, vh = (t_.to(dtype).contiguous() for t_ in (qh, kh, vh))
        if bias is not None:
            bias = _finite_bias(bias)
        return _core(rt, layer, qh, kh, vh, scale=scale, bias=bias, dropout_p=dropout_p, due=due,
                     bwd=bool(cfg.backward and cfg.check), fac=cfg.tolerance_factor, k_col=None, first_checks=[],
                     recompute_heads=None, output_fn=None)


def protected_linear(rt, layer: int, product: str, x: torch.Tensor, lin: torch.nn.Module) -> torch.Tensor:
    """``lin(x)`` (an ``nn.Linear``) as a protected GEMM named ``product`` (q, k, v or output), verified (and
    corrected) before it is returned. The input's checksums are shared by the q / k / v projections of one
    input (cached on ``rt`` for the tensor last seen)."""
    cfg = rt.cfg
    sec_due = rt.due()[SECTIONS.index(SECTION_OF[product])]
    dtype = _compute_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        x = x.to(dtype)
        w = lin.weight if lin.weight.dtype == dtype else lin.weight.to(dtype)
        bias = lin.bias if lin.bias is None or lin.bias.dtype == dtype else lin.bias.to(dtype)
        spec = _Spec(rt, layer, ((product, None, None, bool(cfg.backward and cfg.check and sec_due)),), True)
        out = ProtectedMatmul.apply(x, w, bias, spec)
        rt.fire(layer, product, out)
        if sec_due:
            cached = getattr(rt, "_encoded", None)  # (x, its version, checksums); x is held while cached
            if cached is None or cached[0] is not x or cached[1] != x._version:
                cached = (x, x._version, cks.encode(x))
                rt._encoded = cached
            a_col, a_rn = cached[2]
            raw = (x.detach(), w.detach(), bias, spec)
            chk = cks.detect(out, x, w.t(), bias, a_col=a_col, a_rn=a_rn, factor=cfg.tolerance_factor,
                             rerun=lambda: _product(*raw))
            if bool(chk.any()):
                with _slow_path(rt, x.device):
                    rt.record(layer, product, cks.resolve(chk, **rt.resolve_kw()))
    return out


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
