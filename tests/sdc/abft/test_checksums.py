"""Checksum encode / carry / compare on GEMMs: no false positives, detection, correction, recomputation."""

import pytest
import torch

from trainguard.sdc.abft import checksums as cks


def _gemm(shape_a, shape_b, dtype, scale=1.0, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(*shape_a, generator=g) * scale).to(dtype)
    b = (torch.randn(*shape_b, generator=g) * scale).to(dtype)
    bb = (torch.randn(shape_b[-1], generator=g)).to(dtype) if bias else None
    c = torch.matmul(a, b)
    if bb is not None:
        c = c + bb
    return a, b, bb, c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_no_false_positives_across_shapes_and_magnitudes(dtype):
    shapes = [((4, 33, 17), (17, 9)), ((2, 3, 64, 16), (2, 3, 16, 64)), ((5, 128, 64), (64, 192)),
              ((1, 7, 300), (300, 5)), ((2, 2, 50, 50), (2, 2, 50, 8))]
    n = 0
    for seed in range(25):
        for sa, sb in shapes:
            scale = [1e-3, 1.0, 30.0][seed % 3]
            a, b, bias, c = _gemm(sa, sb, dtype, scale, seed, bias=seed % 2 == 0)
            chk = cks.detect(c, a, b, bias)
            assert not bool(chk.any()), (dtype, sa, sb, seed)
            n += 1
    assert n >= 100


def test_threshold_scales_with_dtype_and_shape():
    assert cks.unit_roundoff(torch.float32) == 2.0 ** -24
    assert cks.unit_roundoff(torch.bfloat16) == 2.0 ** -8
    assert cks.tolerance_scale(64, 64, torch.bfloat16, 2.0) > cks.tolerance_scale(64, 64, torch.float32, 2.0)
    assert cks.tolerance_scale(1024, 64, torch.float32, 2.0) > cks.tolerance_scale(64, 64, torch.float32, 2.0)


@pytest.mark.parametrize("val", [float("nan"), float("inf"), 1e20, 1e3])
def test_single_error_detected_and_corrected(val):
    a, b, bias, c = _gemm((3, 20, 16), (16, 12), torch.float32, bias=True)
    ref = c.clone()
    c[1, 7, 4] = val
    chk = cks.detect(c, a, b, bias)
    assert bool(chk.any())
    out = cks.resolve(chk)
    assert out.kind == "corrected" and len(out.fixes) == 1
    f = out.fixes[0]
    assert (f.batch, f.row, f.col) == ((1,), 7, 4)
    assert torch.allclose(c, ref, atol=1e-4)
    assert not bool(cks.detect(c, a, b, bias).any())


def test_1r_and_1c_patterns_corrected():
    a, b, _, c = _gemm((2, 4, 24, 16), (2, 4, 16, 24), torch.float32)
    ref = c.clone()
    c[0, 1, 5, :] = float("nan")      # 1R: one row (a corrupted Q row) -> fixed column by column
    c[1, 2, :, 9] = float("inf")      # 1C: one column (a corrupted K row) -> fixed row by row
    chk = cks.detect(c, a, b)
    out = cks.resolve(chk)
    assert out.kind == "corrected"
    assert torch.allclose(c, ref, atol=1e-4)


def test_2d_pattern_is_uncorrectable_and_recomputed():
    a, b, _, c = _gemm((2, 16, 8), (8, 16), torch.float32)
    ref = c.clone()
    c[1, 2:5, 3:6] = float("nan")
    out = cks.resolve(cks.detect(c, a, b))
    assert out.kind == "recomputed" and out.recomputed
    assert torch.allclose(c, ref, atol=1e-5)


def test_detect_only_leaves_data():
    a, b, _, c = _gemm((2, 16, 8), (8, 16), torch.float32)
    c[0, 0, 0] = float("nan")
    out = cks.resolve(cks.detect(c, a, b), correct=False)
    assert out.kind == "escalated" and torch.isnan(c[0, 0, 0])  # detected, not corrected: the step is redone


def test_corrupted_carried_checksum_is_reported_not_applied():
    a, b, _, c = _gemm((1, 16, 8), (8, 16), torch.float32)
    ref = c.clone()
    a_col = cks.colsum(a)
    a_col[0, 0, 3] += 100.0  # a fault in the carried input checksum, not in the data
    chk = cks.detect(c, a, b, a_col=a_col)
    assert bool(chk.any())
    out = cks.resolve(chk)
    assert torch.equal(c, ref)
    assert out.kind == "escalated" and "changed after its verification" in out.reason


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_correction(dtype):
    a, b, _, c = _gemm((2, 32, 64), (64, 32), dtype)
    ref = c.clone()
    c[0, 3, 3] = float("nan")
    out = cks.resolve(cks.detect(c, a, b))
    assert out.kind == "corrected"
    assert torch.allclose(c.float(), ref.float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("alpha", [0.125, 0.1, -3.0])
def test_alpha_scaled_product_checked_and_corrected(alpha):
    """``C = alpha A B`` (the scores GEMM applies the attention scale as its alpha): a clean product is not
    flagged, an error is located and corrected to the alpha-scaled value, a 2D pattern is recomputed with
    the alpha."""
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(2, 3, 40, 16, generator=g), torch.randn(2, 3, 16, 40, generator=g)
    c = torch.baddbmm(torch.empty(6, 40, 40), a.view(6, 40, 16), b.view(6, 16, 40), beta=0, alpha=alpha)
    c = c.view(2, 3, 40, 40)
    ref = c.clone()
    assert not bool(cks.detect(c, a, b, alpha=alpha).any())
    assert bool(cks.detect(c, a, b).any())       # the same product checked without its alpha is flagged
    c[1, 2, 7, 30] = float("inf")
    chk = cks.detect(c, a, b, alpha=alpha)
    out = cks.resolve(chk)
    assert out.kind == "corrected" and torch.allclose(c, ref, atol=1e-4)
    c[0, 1, 3:9, 2:6] = 5.0                      # 2D: uncorrectable, recomputed from A, B and alpha
    out = cks.resolve(cks.detect(c, a, b, alpha=alpha))
    assert out.kind == "recomputed" and out.recomputed and torch.allclose(c, ref, atol=1e-4)


def test_tight_threshold_catches_what_the_worst_case_bound_misses():
    a, b, _, c = _gemm((1, 128, 768), (768, 64), torch.float32)
    chk = cks.detect(c, a, b)
    tol_j = float(chk.tol[0, 0, 5])
    worst = tol_j * cks.worst_case_scale(768, 128, torch.float32, 2.0) / cks.tolerance_scale(768, 128, torch.float32, 2.0)
    assert worst > 20 * tol_j
    c[0, 17, 5] += 4 * tol_j  # four times the detection threshold, a fifth of the worst-case bound
    out = cks.resolve(cks.detect(c, a, b))
    assert out.kind in ("corrected", "recomputed")


def test_non_finite_input_escalates_without_recomputing():
    a, b, _, c = _gemm((2, 16, 8), (8, 16), torch.float32)
    a[1, 3, 2] = float("nan")
    c.copy_(torch.matmul(a, b))
    out = cks.resolve(cks.detect(c, a, b))
    assert out.kind == "escalated" and out.reason == "non-finite input" and not out.recomputed


def test_a_flag_on_a_product_that_verifies_is_a_checksum_error_and_changes_nothing():
    a, b, _, c = _gemm((1, 32, 16), (16, 8), torch.float32)
    chk = cks.detect(c, a, b, rerun=lambda: torch.matmul(a, b))
    chk.flag[0, 0, 3] = True  # as if the fast path's own checksum had been struck
    before = c.clone()
    out = cks.resolve(chk)
    assert out.kind == "corrected" and out.fixes == [] and out.checksum_errors == 1 and not out.recomputed
    assert torch.equal(c, before)


def test_roundoff_above_the_verification_tolerance_is_a_false_alarm_confirmed_by_an_identical_recomputation():
    """A product off by more than the verification's tolerance but within the worst-case roundoff bound, which
    the kernel reproduces bit for bit: roundoff, kept as it is (not corrected, not escalated). The offset is
    placed between the two bounds as the module computes them for this product, spread over a 4 x 4 block so
    that no single-error correction applies."""
    a, b, _, c = _gemm((1, 32, 16), (16, 8), torch.float32)
    ref = cks._reference(a.float(), b.float()[None], None, torch.float32, 2.0).with_output(c)
    cols = slice(3, 7)
    tol, worst = float(ref.tol1[0, cols].max()), float(ref.worst1[0, cols].min())
    assert tol < worst / 2, (tol, worst)  # room between the two bounds for this test
    c[0, 2:6, cols] += (tol * worst) ** 0.5 / 4  # each column's sum is off by sqrt(tol * worst)
    produced = c.clone()
    out = cks.resolve(cks.detect(c, a, b, rerun=lambda: produced.clone()))
    assert out.kind == "false_alarm" and out.fixes == [] and not out.recomputed, (out.kind, out.reason)
    assert torch.equal(c, produced)


def test_recomputation_that_fails_verification_escalates():
    a, b, _, c = _gemm((1, 16, 8), (8, 16), torch.float32)
    c[0, 2:6, 3:7] = float("nan")  # 2D: not correctable

    def faulty_rerun():
        t = torch.matmul(a, b)
        t[0, 1, 1] += 100.0  # the recomputation is struck too
        return t

    out = cks.resolve(cks.detect(c, a, b, rerun=faulty_rerun))
    assert out.kind == "escalated" and out.reason == "recomputation failed verification"


def test_an_error_the_recomputation_reproduces_bit_for_bit_is_escalated_not_taken_for_roundoff():
    """A rerun equal bit for bit to the flagged product is a false alarm only if the product is within the
    worst-case roundoff bound; a persistent fault (a stuck unit computing the same wrong block again) is not,
    and must reach the step guard instead of being kept as if it were roundoff."""
    a, b, _, c = _gemm((1, 16, 8), (8, 16), torch.float32)
    ref = c.clone()
    c[0, 2:6, 3:7] += 5.0  # 2D: EEC-ABFT cannot correct it, so the slow path recomputes
    stuck = c.clone()
    out = cks.resolve(cks.detect(c, a, b, rerun=lambda: stuck.clone()))
    assert out.kind == "escalated" and out.reason == "recomputation reproduces an error beyond the roundoff bound"
    assert not out.recomputed and torch.equal(c, stuck)  # left for the step's re-execution, not "fixed"
    assert not torch.allclose(c, ref, atol=1.0)
