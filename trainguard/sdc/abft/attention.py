"""Protected multi-head attention: the six GEMMs in three protection sections with checksum passing.

Relies on ``torch`` (autograd ``Function``) and :mod:`trainguard.sdc.abft.checksums`.

Sections (ATTNChecker Section 4.4): ``AS = {X W^Q, X W^K, Q K^T}``, ``CL = {X W^V, AP V}``,
``O = {CL W^O}``. Checksum passing: the section input ``X`` is encoded once (``1^T X`` and ``1^T |X|``);
each product's verified recomputed column checksum (and magnitude bound) is the input checksum of the
next GEMM in the section (K's feeds the row check of ``Q K^T``, which is the column check of
``K Q^T``), so no GEMM input is summed twice. Scores and context are checked along their rows (the
contiguous direction); CL's column checksum for ``CL W^O`` is encoded from the verified CL. Unlike the paper, Q, K and V are verified (and corrected) themselves rather than only through the
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

import math
from typing import Callable

import torch
import torch.nn.functional as F

from trainguard.errors import ShapeError
from trainguard.sdc.abft import checksums as cks

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


class ProtectedMatmul(torch.autograd.Function):
    """``a @ b + bias`` whose backward GEMMs go through fault hooks and (optionally) ABFT checks.

    ``b`` is (k, n) (a weight, shared over the batch) or (..., k, n). ``meta`` = (runtime, layer, product,
    check_backward).
    """

    @staticmethod
    def forward(ctx, a, b, bias, meta):
        ctx.save_for_backward(a, b)
        ctx.meta = meta
        ctx.has_bias = bias is not None
        if bias is not None and b.dim() == 2:
            out = torch.empty(*a.shape[:-1], b.shape[-1], dtype=a.dtype, device=a.device)
            torch.addmm(bias, a.reshape(-1, a.shape[-1]), b, out=out.view(-1, b.shape[-1]))
            return out
        out = torch.matmul(a, b)
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        rt, layer, product, check = ctx.meta
        name_a, name_b = BACKWARD_PRODUCTS[product]
        ga = gb = gbias = None
        g = g if g.dtype == a.dtype else g.to(a.dtype)
        if ctx.needs_input_grad[0]:
            bt = b.transpose(-1, -2)
            ga = torch.matmul(g, bt)
            rt.fire(layer, name_a, ga)
            if check:
                rt.verify(layer, name_a, cks.detect(ga, g, bt, factor=rt.cfg.tolerance_factor))
        if ctx.needs_input_grad[1]:
            if b.dim() == 2 and a.dim() > 2:
                at = a.reshape(-1, a.shape[-1]).transpose(0, 1)
                gf = g.reshape(-1, g.shape[-1])
            else:
                at, gf = a.transpose(-1, -2), g
            gb = torch.matmul(at, gf)
            rt.fire(layer, name_b, gb)
            if check:
                rt.verify(layer, name_b, cks.detect(gb, at, gf, factor=rt.cfg.tolerance_factor))
            if gb.dim() > b.dim():
                gb = gb.sum(tuple(range(gb.dim() - b.dim())))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gbias = g.reshape(-1, g.shape[-1]).sum(0)
        return ga, gb, gbias, None


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


def protected_attention(rt, layer: int, x: torch.Tensor, pq: _Proj, pk: _Proj, pv: _Proj, po: _Proj, *,
                        n_heads: int, head_dim: int, scale: float,
                        mask_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                        rope: Callable[[torch.Tensor], torch.Tensor] | None = None,
                        kv_update: Callable | None = None, dropout_p: float = 0.0,
                        upcast_scores: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``x`` (B, T, D) with every GEMM protected; returns (output (B, T, D), probs).

    ``mask_fn`` maps scaled scores to masked scores; ``rope`` rotates (B, H, T, d) Q/K; ``kv_update``
    maps (k, v) heads to the full (cached) k, v; ``upcast_scores`` computes ``Q K^T`` in fp32.
    """
    if x.dim() != 3:
        raise ShapeError(f"protected attention expects (batch, seq, hidden) input, got shape {tuple(x.shape)}")
    bsz, t, dim = x.shape
    hd = n_heads * head_dim
    for name, p in (("q", pq), ("k", pk), ("v", pv)):
        if p.w.dim() != 2 or p.w.shape[0] != dim or p.w.shape[1] != hd:
            raise ShapeError(f"protected attention: {name} projection weight {tuple(p.w.shape)} does not map "
                             f"hidden {dim} to heads*head_dim {hd}")
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

    def cast(p: _Proj) -> _Proj:
        if p.w.dtype == dtype and (p.bias is None or p.bias.dtype == dtype):
            return p
        return _Proj(p.w.to(dtype), p.bias.to(dtype) if p.bias is not None else None)

    with torch.autocast(x.device.type, enabled=False):
        x = x.to(dtype)
        pq, pk, pv, po = cast(pq), cast(pk), cast(pv), cast(po)

        def mm(a, b, bias, product, sec_due):
            out = ProtectedMatmul.apply(a, b, bias, (rt, layer, product, bwd and sec_due))
            rt.fire(layer, product, out)
            return out

        # ---- section AS: X W^Q, X W^K, Q K^T  (and the V projection of section CL)
        x_col = x_rn = None
        if due_as or due_cl:
            x_col, x_rn = cks.encode(x)
        q = mm(x, pq.w, pq.bias, "q", due_as)
        k = mm(x, pk.w, pk.bias, "k", due_as)
        v = mm(x, pv.w, pv.bias, "v", due_cl)
        chk = {}
        if due_as:
            chk["q"] = cks.detect(q, x, pq.w, pq.bias, a_col=x_col, a_rn=x_rn, factor=fac)
            chk["k"] = cks.detect(k, x, pk.w, pk.bias, a_col=x_col, a_rn=x_rn, factor=fac)
        if due_cl:
            chk["v"] = cks.detect(v, x, pv.w, pv.bias, a_col=x_col, a_rn=x_rn, factor=fac)

        def heads_qk(q, k, v):
            qh, kh, vh = _split(q, n_heads, head_dim), _split(k, n_heads, head_dim), _split(v, n_heads, head_dim)
            if rope is not None:
                qh, kh = rope(qh), rope(kh)
            if kv_update is not None:
                kh, vh = kv_update(kh, vh)
            if upcast_scores:
                qh, kh = qh.float(), kh.float()
            return qh, kh, vh

        def scores_check(qh, kh, scores):
            # row sums of AS = Q (K^T 1): checked as the columns of AS^T = K Q^T, carrying K's checksum
            if rope is None and kv_update is None:
                k_col = _heads_vec(chk["k"].col, n_heads, head_dim)
            else:
                k_col = cks.colsum(kh)
            return cks.detect(scores.transpose(-1, -2), kh, qh.transpose(-1, -2), a_col=k_col, factor=fac)

        if kv_update is not None:  # the cache must only ever see verified K / V: settle them first
            for p in ("q", "k", "v"):
                if p in chk and bool(chk[p].any()):
                    rt.record(layer, p, cks.resolve(chk[p], **rt.resolve_kw()))
        qh, kh, vh = heads_qk(q, k, v)
        scores = mm(qh, kh.transpose(-1, -2), None, "scores", due_as)
        if due_as:
            chk["scores"] = scores_check(qh, kh, scores)
            if bool(torch.stack([chk["q"].any(), chk["k"].any(), chk["scores"].any()]).any()):
                upstream = False
                for p in ("q", "k"):
                    if bool(chk[p].any()):
                        rt.record(layer, p, cks.resolve(chk[p], **rt.resolve_kw()))
                        upstream = True
                if upstream:  # recompute the rest of the section from the corrected Q / K
                    qh, kh, vh = heads_qk(q, k, v)
                    scores = ProtectedMatmul.apply(qh, kh.transpose(-1, -2), None, (rt, layer, "scores", bwd))
                    chk["scores"] = scores_check(qh, kh, scores)
                if bool(chk["scores"].any()):
                    rt.record(layer, "scores", cks.resolve(chk["scores"], **rt.resolve_kw()))
        probs = torch.softmax(mask_fn(scores * scale) if mask_fn is not None else scores * scale, dim=-1,
                              dtype=torch.float32).to(vh.dtype)
        if dropout_p > 0.0:
            probs = F.dropout(probs, p=dropout_p, training=True)

        # ---- section CL: X W^V, AP V
        if due_cl and bool(chk["v"].any()):
            rt.record(layer, "v", cks.resolve(chk["v"], **rt.resolve_kw()))
            vh = _split(v, n_heads, head_dim)
        ctx = mm(probs, vh, None, "context", due_cl)
        if due_cl:
            # row sums of CL = AP (V 1): columns of CL^T = V^T AP^T; rows of AP have 2-norm <= 1/(1-p)
            p_bound = torch.full((1, 1), 1.0 / (1.0 - dropout_p), dtype=torch.float32, device=x.device)
            chk["context"] = cks.detect(ctx.transpose(-1, -2), vh.transpose(-1, -2), probs.transpose(-1, -2),
                                        b_cn=p_bound, factor=fac)
            if bool(chk["context"].any()):
                rt.record(layer, "context", cks.resolve(chk["context"], **rt.resolve_kw()))

        # ---- section O: CL W^O
        merged = ctx.transpose(1, 2).reshape(bsz, t, hd)
        out = mm(merged, po.w, po.bias, "output", due_o)
        if due_o:
            ctx_col, ctx_rn = cks.encode(merged)
            chk["output"] = cks.detect(out, merged, po.w, po.bias, a_col=ctx_col, a_rn=ctx_rn, factor=fac)
            if bool(chk["output"].any()):
                rt.record(layer, "output", cks.resolve(chk["output"], **rt.resolve_kw()))
    return out, probs


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
