"""EEC-ABFT: locate and correct extreme errors (INF, NaN, near-INF) in checksummed vectors.

Relies on ``torch`` only. Implements Section 4.2 of ATTNChecker (Liang et al., PPoPP'25) for a batch of
vectors at once (no Python loop over vectors). Each vector ``v`` (length m) comes with its trusted
unweighted checksum ``s1 = sum_i v_i`` and weighted checksum ``s2 = sum_i (i+1) v_i`` (vectors 1..m), both
fp32, and the roundoff tolerances ``tol1`` / ``tol2`` of the two comparisons.

With ``d1 = sum(v) - s1`` and ``d2 = sum((i+1) v_i) - s2``:

* Case 1, ``d1`` finite: count the near-INF elements (``|v_i| > T_near_inf``, 1e10). One or none: the
  error is single; locate it by ``round(d2 / d1)`` unless ``d2`` overflowed (then: the largest ``|v_i|``).
  Correct by ``v_i - d1`` when ``|d1| < T_correct`` (1e5), otherwise rebuild it from the checksum,
  ``v_i = s1 - sum_{j != i} v_j`` (subtracting a huge ``d1`` would absorb the true value's low bits).
  If no element can be located (``d2 / d1`` is not an index) but ``d2`` is within its tolerance, the
  data are fine and the unweighted checksum itself is wrong: :data:`CHECKSUM` (the data are left alone).
* Case 2, ``d1 = +-INF``: an INF, or a near-INF that overflowed the sum. Count INF and near-INF elements;
  locate by the largest ``|v_i|``; rebuild from the checksum.
* Case 3, ``d1 = NaN``: count NaN, INF and near-INF elements (any of them can produce a NaN ``d1``);
  locate the NaN (or INF / largest element); rebuild from the checksum.
* Case 4: in all cases, more than one counted error means the error has propagated along the vector
  (a 1D pattern running across this direction): :data:`PROPAGATED`, nothing is changed here; the caller
  retries in the other direction (row checksums for a 1C pattern, column checksums for 1R) and reports a
  2D pattern, which neither direction can fix, as uncorrectable (the product is then recomputed).

Every correction is verified again against ``s1``; a correction that does not restore the checksum
within ``tol1`` is reported :data:`UNCORRECTABLE`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

T_NEAR_INF = 1e10
T_CORRECT = 1e5

CLEAN, CORRECTED, CHECKSUM, PROPAGATED, UNCORRECTABLE = 0, 1, 2, 3, 4
STATUS_NAMES = {CLEAN: "clean", CORRECTED: "corrected", CHECKSUM: "checksum", PROPAGATED: "propagated",
                UNCORRECTABLE: "uncorrectable"}


@dataclass
class EECResult:
    """Per-vector outcome: ``status`` (codes above), ``index`` of the corrected element, ``old``/``new`` values."""

    status: torch.Tensor
    index: torch.Tensor
    old: torch.Tensor
    new: torch.Tensor


def correct_vectors(vals: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor, tol1: torch.Tensor,
                    tol2: torch.Tensor, near_inf: float = T_NEAR_INF, t_correct: float = T_CORRECT) -> EECResult:
    """Run EEC-ABFT on each row of ``vals`` (N, m) with checksums ``s1``/``s2`` and tolerances (N,).

    ``vals`` is read only (an fp32 copy is made); apply ``result.new`` at ``result.index`` where
    ``result.status == CORRECTED``.
    """
    v = vals.float()
    n, m = v.shape
    s1, s2, tol1, tol2 = (t.float().reshape(n) for t in (s1, s2, tol1, tol2))
    w = torch.arange(1, m + 1, dtype=torch.float32, device=v.device)
    d1 = v.sum(1) - s1
    d2 = (v * w).sum(1) - s2
    isnan, isinf = v.isnan(), v.isinf()
    near = (v.abs() > near_inf) & ~isinf & ~isnan
    n_nan, n_inf, n_near = isnan.sum(1), isinf.sum(1), near.sum(1)
    d1_nan, d1_inf = d1.isnan(), d1.isinf()
    d1_fin = ~d1_nan & ~d1_inf
    count = torch.where(d1_nan, n_nan + n_inf + n_near, torch.where(d1_inf, n_inf + n_near, n_near))
    # A non-finite element with a finite d1 cannot happen; count it anyway (mixed-type safety).
    count = torch.where(d1_fin, count + n_nan + n_inf, count)
    clean = d1_fin & (d1.abs() <= tol1)
    propagated = (count > 1) & ~clean

    key = torch.where(isnan | isinf, torch.full_like(v, float("inf")), v.abs())
    arg_idx = key.argmax(1)
    d2_fin = d2.isfinite()
    ratio = d2 / torch.where(d1 == 0, torch.ones_like(d1), d1)
    r_round = ratio.round()
    ratio_ok = ratio.isfinite() & ((ratio - r_round).abs() <= 0.25) & (r_round >= 1) & (r_round <= m)
    use_ratio = d1_fin & d2_fin
    idx = torch.where(use_ratio, (r_round.clamp(1, m) - 1).long(), arg_idx)
    checksum_err = d1_fin & ~clean & (count == 0) & d2_fin & (d2.abs() <= tol2)

    old = v.gather(1, idx[:, None])[:, 0]
    others = v.scatter(1, idx[:, None], 0.0).sum(1)
    small = d1_fin & (d1.abs() < t_correct)
    new = torch.where(small, old - d1, s1 - others)
    resid = others + new - s1
    verified = new.isfinite() & (resid.abs() <= tol1)
    located = torch.where(use_ratio, ratio_ok, torch.ones_like(ratio_ok))

    status = torch.full((n,), UNCORRECTABLE, dtype=torch.long, device=v.device)
    status = torch.where(checksum_err, torch.full_like(status, CHECKSUM), status)
    status = torch.where(located & verified, torch.full_like(status, CORRECTED), status)
    status = torch.where(propagated, torch.full_like(status, PROPAGATED), status)
    status = torch.where(clean, torch.full_like(status, CLEAN), status)
    return EECResult(status=status, index=idx, old=old, new=new)
