"""EEC-ABFT cases on hand-built vectors (paper Section 4.2)."""

import torch

from trainguard.sdc.abft import eec


def _sums(v):
    v = v.double()
    w = torch.arange(1, v.shape[-1] + 1, dtype=torch.float64)
    return v.sum(-1).float(), (v * w).sum(-1).float()


def _run(clean, bad, tol=1e-4):
    s1, s2 = _sums(clean)
    n = clean.shape[0]
    t = torch.full((n,), tol)
    return eec.correct_vectors(bad, s1, s2, t, t * clean.shape[-1])


def test_clean_vector_is_clean():
    v = torch.randn(3, 16)
    r = _run(v, v.clone())
    assert (r.status == eec.CLEAN).all()


def test_case1_moderate_error_located_by_ratio_and_corrected_by_delta():
    v = torch.randn(1, 16)
    bad = v.clone()
    bad[0, 9] += 50.0
    r = _run(v, bad)
    assert r.status.item() == eec.CORRECTED and r.index.item() == 9
    assert abs(r.new.item() - v[0, 9].item()) < 1e-4


def test_case1_near_inf_corrected_by_reconstruction():
    v = torch.randn(1, 16)
    bad = v.clone()
    bad[0, 4] = 3.0e12  # near-INF (> 1e10): |delta| > T_correct -> rebuilt from the checksum
    r = _run(v, bad, tol=1e-3)
    assert r.status.item() == eec.CORRECTED and r.index.item() == 4
    assert abs(r.new.item() - v[0, 4].item()) < 1e-3


def test_case1_weighted_checksum_overflow_locates_by_max():
    v = torch.randn(1, 8)
    bad = v.clone()
    bad[0, 6] = 1.0e38  # unweighted sum finite, weighted sum (x7) overflows fp32
    s1, s2 = _sums(v)
    d2 = (bad * torch.arange(1, 9)).sum(-1) - s2
    assert torch.isinf(d2).all() and torch.isfinite(bad.sum(-1) - s1).all()
    r = _run(v, bad, tol=1e-3)
    assert r.status.item() == eec.CORRECTED and r.index.item() == 6
    assert abs(r.new.item() - v[0, 6].item()) < 1e-3


def test_case2_inf():
    v = torch.randn(2, 16)
    bad = v.clone()
    bad[0, 3] = float("inf")
    bad[1, 15] = float("-inf")
    r = _run(v, bad)
    assert (r.status == eec.CORRECTED).all()
    assert r.index.tolist() == [3, 15]
    assert torch.allclose(r.new, torch.stack([v[0, 3], v[1, 15]]), atol=1e-4)


def test_case3_nan():
    v = torch.randn(1, 32)
    bad = v.clone()
    bad[0, 0] = float("nan")
    r = _run(v, bad)
    assert r.status.item() == eec.CORRECTED and r.index.item() == 0
    assert abs(r.new.item() - v[0, 0].item()) < 1e-4


def test_case4_two_errors_in_one_vector_is_propagation():
    v = torch.randn(3, 16)
    bad = v.clone()
    bad[0, 2], bad[0, 5] = float("inf"), float("inf")        # 1D INF
    bad[1, 1], bad[1, 7] = float("nan"), float("inf")        # mixed types
    bad[2, 3], bad[2, 4] = 1e20, -3e15                         # two near-INF
    r = _run(v, bad)
    assert (r.status == eec.PROPAGATED).all()


def test_two_moderate_errors_are_not_miscorrected():
    v = torch.randn(1, 16)
    bad = v.clone()
    bad[0, 2] += 10.0
    bad[0, 11] += 7.0
    r = _run(v, bad)
    assert r.status.item() in (eec.UNCORRECTABLE, eec.PROPAGATED)


def test_error_in_the_checksum_itself():
    v = torch.randn(1, 16)
    s1, s2 = _sums(v)
    s1 = s1 + 25.0  # the unweighted checksum is corrupted, the data are fine
    t = torch.full((1,), 1e-4)
    r = eec.correct_vectors(v, s1, s2, t, t * 16)
    assert r.status.item() == eec.CHECKSUM
