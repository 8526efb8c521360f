"""Protected multi-head attention: the six GEMMs in three protection sections with checksum passing.

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

Every product is computed by :class:`ProtectedMatmul`, whose backward computes the two gradient GEMMs and,
with ``ABFTConfig(backward=True)``, verifies and corrects them with the same checksums. Backward product
names (for fault hooks, events and counters; counted in their forward product's section) are in
:data:`BACKWARD_PRODUCTS`.

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
SECTION_OF = {"q": "AS", "k": "AS", "scores": "AS", "v": "CL", "context": "CL", "output": "O"}
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
    ``Q K^T``, applied by the GEMM rather than by a pass over its output)."""

    __slots__ = ("alpha", "bt", "layer", "parts", "rt")

    def __init__(self, rt, layer: int, parts: tuple, bt: bool = False, alpha: float = 1.0):
        self.rt, self.layer, self.parts, self.bt, self.alpha = rt, layer, parts, bt, alpha


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
                rt.record(layer, product, cks.resolve(sub, **rt.resolve_kw()))
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
        bm = b.transpose(-1, -2) if spec.bt else b
        if b.dim() == 2:
            out = torch.empty(*a.shape[:-1], bm.shape[-1], dtype=a.dtype, device=a.device)
            if bias is not None:
                torch.addmm(bias, a.reshape(-1, a.shape[-1]), bm, out=out.view(-1, bm.shape[-1]))
            else:
                torch.mm(a.reshape(-1, a.shape[-1]), bm, out=out.view(-1, bm.shape[-1]))
            return out
        out = _bmm(a, bm, spec.alpha)
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        spec = ctx.spec
        rt, layer, parts = spec.rt, spec.layer, spec.parts
        due = [p for p in parts if p[3]]
        fac = rt.cfg.tolerance_factor
        ga = gb = gbias = None
        g = g if g.dtype == a.dtype else g.to(a.dtype)
        if g.dim() > 2 and not g.is_contiguous():
            g = g.contiguous()  # once, rather than inside each of the two matmuls
        checks = []
        if ctx.needs_input_grad[0]:
            bt = b if spec.bt else b.transpose(-1, -2)
            ga = _bmm(g, bt, spec.alpha)
            for p in parts:
                rt.fire(layer, BACKWARD_PRODUCTS[p[0]][0], ga)
            if due:
                checks.append((cks.detect(ga, g, bt, factor=fac, alpha=spec.alpha),
                               [(BACKWARD_PRODUCTS[due[0][0]][0], None, None)]))
        if ctx.needs_input_grad[1]:
            if b.dim() == 2 and a.dim() > 2:
                a2, g2 = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
            else:
                a2, g2 = a, g
            at = a2.transpose(-1, -2)
            if spec.bt:  # d(b) = dC^T A, in b's (n, k) layout; its transpose A^T dC is what is checked
                gb = _bmm(g2.transpose(-1, -2), a2, spec.alpha)
                gview = gb.transpose(-1, -2)
            else:
                gb = gview = _bmm(at, g2, spec.alpha)
            for p, plo, phi, _ in parts:
                rt.fire(layer, BACKWARD_PRODUCTS[p][1], gb if plo is None else gview[..., plo:phi])
            if due:
                lo, hi = due[0][1], due[-1][2]
                if lo is None or (lo == 0 and hi == gview.shape[-1]):
                    chk = cks.detect(gview, at, g2, factor=fac, alpha=spec.alpha)
                else:
                    chk = cks.detect(gview[..., lo:hi], at, g2[..., lo:hi], factor=fac, alpha=spec.alpha)
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


class _ScaledSoftmax(torch.autograd.Function):
    """``softmax(bias + scale * scores)`` in fp32 without (B, H, T, T) temporaries on CPU: the softmax kernel
    works row by row, so it writes the probabilities over its input. With ``scale = 1`` (the kernel folds
    the attention scale into the ``Q K^T`` GEMM) that input is the scores buffer itself: the product is
    verified by then and no GEMM's backward needs it. Otherwise one logits buffer is made, and the
    backward scales the softmax gradient in place. ``bias`` is an additive mask (no gradient)."""

    @staticmethod
    def forward(ctx, scores, bias, scale):
        cpu32 = scores.dtype == torch.float32 and scores.device.type == "cpu"
        if cpu32 and scale == 1.0:
            logits = scores if bias is None else scores.add_(bias)
            ctx.mark_dirty(scores)
        elif bias is not None:
            logits = torch.add(bias, scores, alpha=scale) if scale != 1.0 else bias + scores
        else:
            logits = scores * scale if scale != 1.0 else scores
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
        return gl.to(ctx.in_dtype), None, None


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
    """Additive causal mask (tq, tk): 0 where query i may attend key j (j <= i + tk - tq), -inf elsewhere.
    Cached (read-only: it is only ever an operand)."""
    m = torch.ones(tq, tk, dtype=torch.bool, device=device).triu(tk - tq + 1)
    return torch.zeros(tq, tk, dtype=dtype, device=device).masked_fill_(m, float("-inf"))


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
    ``scale * Q K^T`` (the GEMM's alpha); ``mask_fn`` (used if no ``bias_fn``) maps them to masked scores.
    ``rope`` rotates (B, H, T, d) Q/K; ``kv_update`` maps (k, v) heads to the full (cached) k, v;
    ``upcast_scores`` computes ``Q K^T`` in fp32.
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
    dtype = x.dtype
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)

    def cast(p: _Proj | None) -> _Proj | None:
        if p is None or (p.w.dtype == dtype and (p.bias is None or p.bias.dtype == dtype)):
            return p
        return _Proj(p.w.to(dtype), p.bias.to(dtype) if p.bias is not None else None)

    with torch.autocast(x.device.type, enabled=False):
        x = x.to(dtype)
        pq, pk, pv, po = cast(pq), cast(pk), cast(pv), cast(po)

        def mm(a, b, bias, product, sec_due):
            out = ProtectedMatmul.apply(a, b, bias, _Spec(rt, layer, ((product, None, None, bwd and sec_due),)))
            rt.fire(layer, product, out)
            return out

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
        qkv = ProtectedMatmul.apply(x, w_qkv, b_qkv,
                                    _Spec(rt, layer, tuple((p, lo, hi, bwd and d) for p, lo, hi, d in blocks), bt))
        for p, lo, hi, _ in blocks:
            rt.fire(layer, p, qkv[..., lo:hi])
        q, k, v = qkv[..., :hd], qkv[..., hd:2 * hd], qkv[..., 2 * hd:]
        if due_as or due_cl:
            # one check of the fused product over the column block that is due (q|k, v or all): the
            # checksum of a concatenated product is the concatenation of the checksums
            lo, hi = (0 if due_as else 2 * hd), (3 * hd if due_cl else 2 * hd)
            whole = lo == 0 and hi == 3 * hd
            w_in_out = w_qkv.t() if bt else w_qkv          # (D, 3 H d)
            chk = cks.detect(qkv if whole else qkv[..., lo:hi], x, w_in_out if whole else w_in_out[:, lo:hi],
                             b_qkv if whole or b_qkv is None else b_qkv[lo:hi], factor=fac)
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

        def scores_check(qh, kh, scores, k_col):
            # row sums of AS = Q (K^T 1): checked as the columns of AS^T = K Q^T, carrying K's checksum
            k_col = cks.colsum(kh) if k_col is None else _heads_vec(k_col, n_heads, head_dim)
            return cks.detect(scores.transpose(-1, -2), kh, qh.transpose(-1, -2), a_col=k_col, factor=fac,
                              alpha=scale)

        changed = set()
        if kv_update is not None and proj_checks:  # the cache must only ever see verified K / V
            if bool(_any([c for c, _ in proj_checks])):
                with _slow_path(rt, x.device):
                    changed = _resolve_parts(rt, layer, proj_checks)
            proj_checks = []
        qh, kh, vh = heads()

        def scores_gemm(qh, kh):  # alpha * Q K^T: the attention scale is applied by the GEMM
            return ProtectedMatmul.apply(qh, kh, None, _Spec(rt, layer, (("scores", None, None, bwd and due_as),),
                                                             True, scale))

        scores = scores_gemm(qh, kh)
        rt.fire(layer, "scores", scores)
        scores_chk = scores_check(qh, kh, scores, k_col) if due_as else None

        # ---- one host sync for section AS (and X W^V): settle Q, K, V and the scores before the softmax
        first = [c for c, _ in proj_checks] + ([scores_chk] if scores_chk is not None else [])
        if first and bool(_any(first)):
            with _slow_path(rt, x.device):
                changed = _resolve_parts(rt, layer, proj_checks)
                if changed:  # recompute downstream of the corrected Q / K / V (new autograd nodes, no hooks)
                    qh2, kh2, vh = heads()
                    if changed & {"q", "k"}:
                        qh, kh = qh2, kh2
                        scores = scores_gemm(qh, kh)
                        scores_chk = scores_check(qh, kh, scores, None) if due_as else None
                if scores_chk is not None and bool(scores_chk.any()):
                    rt.record(layer, "scores", cks.resolve(scores_chk, **rt.resolve_kw()))
        bias = bias_fn(scores.shape[-2], scores.shape[-1], scores.dtype, scores.device) if bias_fn else None
        if bias_fn is None and mask_fn is not None:
            probs = torch.softmax(mask_fn(scores), dim=-1, dtype=torch.float32)
        elif bias is not None and (bias.requires_grad or bias.dim() > scores.dim() or any(
                b_ not in (1, s_) for b_, s_ in zip(reversed(bias.shape), reversed(scores.shape)))):
            probs = torch.softmax(bias + scores, dim=-1, dtype=torch.float32)
        else:
            probs = _ScaledSoftmax.apply(scores, bias, 1.0)
        probs = probs.to(vh.dtype)
        if dropout_p > 0.0:
            probs = F.dropout(probs, p=dropout_p, training=True)

        # ---- section CL: AP V;  section O: CL W^O  (one host sync for both)
        def context_check(ctx, vh, probs):
            # row sums of CL = AP (V 1): columns of CL^T = V^T AP^T; AP >= 0 (also after dropout), so the
            # exact magnitude AP |V| 1 comes from the same GEMV as the checksum AP (V 1)
            return cks.detect(ctx.transpose(-1, -2), vh.transpose(-1, -2), probs.transpose(-1, -2),
                              b_nonneg=True, factor=fac)

        def output(ctx, hooks: bool):
            merged = ctx.transpose(1, 2).reshape(bsz, t, hd)
            if hooks:
                out = mm(merged, po.w, po.bias, "output", due_o)
            else:
                out = ProtectedMatmul.apply(merged, po.w, po.bias,
                                            _Spec(rt, layer, (("output", None, None, bwd and due_o),)))
            chk = None
            if due_o:
                # CL's column checksum for CL W^O is encoded from CL (recomputed if CL is corrected)
                ctx_col, ctx_rn = cks.encode(merged)
                chk = cks.detect(out, merged, po.w, po.bias, a_col=ctx_col, a_rn=ctx_rn, factor=fac)
            return out, chk

        ctx = mm(probs, vh, None, "context", due_cl)
        ctx_chk = context_check(ctx, vh, probs) if due_cl else None
        out, out_chk = output(ctx, True)
        second = [c for c in (ctx_chk, out_chk) if c is not None]
        if second and bool(_any(second)):
            with _slow_path(rt, x.device):
                if ctx_chk is not None and bool(ctx_chk.any()):
                    rt.record(layer, "context", cks.resolve(ctx_chk, **rt.resolve_kw()))
                    out, out_chk = output(ctx, False)  # from the corrected CL
                if out_chk is not None and bool(out_chk.any()):
                    rt.record(layer, "output", cks.resolve(out_chk, **rt.resolve_kw()))
    return out, probs


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
