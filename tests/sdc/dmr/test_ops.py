"""The checksums every DMR comparison rests on: one corrupted element, at any bit, in any dtype, layout or
size, always changes them (they are compared instead of the outputs themselves)."""

import pytest
import torch

from trainguard.sdc.dmr import ops as dops


def _flip(t: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    out = t.clone()
    flat = out.view(-1).view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])
    flat[index] ^= torch.tensor(1 << bit, dtype=torch.int64).to(flat.dtype) if bit < 8 * t.element_size() - 1 else \
        torch.tensor(-(1 << bit), dtype=torch.int64).to(flat.dtype)  # (the sign bit of a signed view)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64])
@pytest.mark.parametrize("n", [1, 3, 7, 8, 1001, 4096, 20000])  # (20000: above the element-wise size, word sums)
def test_every_single_bit_flip_changes_the_checksums(dtype, n):
    g = torch.Generator().manual_seed(n)
    t = (torch.randn(n, generator=g) * 100).to(dtype)
    bits = 8 * t.element_size()
    for index in {0, n // 2, n - 1}:
        for bit in range(bits):
            bad = _flip(t, index, bit)
            assert not torch.equal(dops.Fingerprint.of(t).sums, dops.Fingerprint.of(bad).sums), (index, bit)
            assert not dops.checksums_equal(t, bad)
    assert dops.checksums_equal(t, t.clone())


def test_views_at_odd_offsets_non_contiguous_and_bool_outputs():
    base = torch.randn(9, 5)
    for t in (base[1:, 1:], base.t(), base.view(-1)[3:], base > 0):
        same = t.clone()
        assert dops.checksums_equal(t, same)
        assert dops.Fingerprint.of(t).matches(dops.Fingerprint.of(same))
    odd = base.view(-1)[3:]
    bad = odd.clone()
    bad[5] = torch.nextafter(bad[5], torch.tensor(float("inf")))
    assert not dops.checksums_equal(odd, bad)
    flags = base > 0
    flipped = flags.clone()
    flipped[2, 3] = ~flipped[2, 3]
    assert not dops.checksums_equal(flags, flipped)


def test_shapes_dtypes_and_non_tensor_outputs_are_compared_exactly():
    a = torch.zeros(4)
    assert not dops.checksums_equal(a, torch.zeros(2, 2))
    assert not dops.checksums_equal(a, torch.zeros(4, dtype=torch.float64))
    assert dops.checksums_equal((a, 3), (a.clone(), 3)) and not dops.checksums_equal((a, 3), (a, 4))


def test_the_checksums_do_not_depend_on_the_thread_count():
    t = torch.randn(1 << 20)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = dops.Fingerprint.of(t).sums
        torch.set_num_threads(max(2, old))
        assert torch.equal(one, dops.Fingerprint.of(t).sums)
    finally:
        torch.set_num_threads(old)


def test_map_tensors_replaces_tensors_in_op_arguments_and_keeps_everything_else():
    a, b = torch.zeros(2), torch.ones(3)
    args = (a, [b, 2.0, (a, None)], {"out": b, "alpha": 3}, torch.Size([2]), "x")
    got = dops.map_tensors(lambda t: t + 1, args)
    assert isinstance(got, tuple) and isinstance(got[1], list) and isinstance(got[1][2], tuple)
    assert torch.equal(got[0], a + 1) and torch.equal(got[1][0], b + 1) and torch.equal(got[1][2][0], a + 1)
    assert got[1][1] == 2.0 and got[1][2][1] is None and got[2]["alpha"] == 3 and torch.equal(got[2]["out"], b + 1)
    assert got[3] == torch.Size([2]) and got[4] == "x"


def test_differs_judges_as_matches_does_and_leaves_the_verdict_on_the_device():
    """``Fingerprint.differs`` (the stream executor's flags) must agree with ``matches`` in every case: equal, one
    element a hair apart (bitwise: differs; within a tolerance: agrees), far apart, non-finite, other shapes."""
    t = torch.randn(4096, dtype=torch.float64)
    near = t.clone()
    near[7] = torch.nextafter(near[7], torch.tensor(float("inf"), dtype=torch.float64))
    far = t.clone()
    far[7] += 1e3
    inf = t.clone()
    inf[7] = float("inf")

    def fp(v):
        return dops.Fingerprint.of(v, floats=True)

    a = fp(t)
    for other in (t.clone(), near, far, inf):
        for rtol in (0.0, 1e-6):
            d = a.differs(fp(other), rtol)
            assert isinstance(d, torch.Tensor) and d.dtype == torch.bool and d.dim() == 0
            assert bool(d) == (not a.matches(fp(other), rtol)), (rtol,)
    assert not bool(a.differs(fp(t.clone()), 0.0)) and bool(a.differs(fp(near), 0.0))
    assert not bool(a.differs(fp(near), 1e-6)) and bool(a.differs(fp(far), 1e-6)) and bool(a.differs(fp(inf), 1e-6))
    assert a.differs(fp(t[:10]), 0.0) is True  # shapes differ: decided on the host


def test_outputs_and_flags_on_two_devices_are_fingerprinted_and_stacked_on_the_accelerator():
    """CUDA's memory-efficient attention returns its RNG seed and offset as CPU scalars beside its CUDA outputs,
    and a step's flags come from CPU and device comparisons: both are stacked on the accelerator (here the meta
    device stands in for it; a plain ``torch.stack`` refuses the mix)."""
    out = (torch.empty(4, 8, device="meta"), torch.tensor(7), torch.tensor(9))
    fp = dops.Fingerprint.of(out, floats=True)
    assert fp.sums.device.type == "meta" and fp.sums.shape == (6,) and fp.floats.device.type == "meta"
    flags = [torch.tensor(False), torch.ones((), dtype=torch.bool, device="meta")]
    assert dops.stack(flags).device.type == "meta"
    cpu = [torch.tensor(True), torch.tensor(False)]
    assert dops.stack(cpu).tolist() == [True, False]
    with pytest.raises(RuntimeError):
        torch.stack(flags)


def test_call_tensors_finds_every_tensor_argument_as_the_full_walk_does():
    """``call_tensors`` skips number lists (sizes, dims) without walking them; every tensor is still found, in
    order: plain arguments, ``Tensor[]``, ``Tensor?[]`` with a leading None, and keyword arguments."""
    a, b, c = torch.ones(2, 3), torch.zeros(2, 3), torch.arange(2)
    calls = [
        ((a, [3, 2]), {}),  # view(self, size)
        ((a, (1, 0)), {}),  # permute(self, dims)
        (([a, b], 0), {}),  # cat(tensors, dim)
        ((a, [None, c]), {}),  # index.Tensor(self, indices: Tensor?[])
        ((a,), {"other": b, "alpha": 2}),
        ((a, [2.0, 0.5], [True, False]), {"out": b}),
        (([],), {}),
        ((a, torch.Size([6])), {}),
    ]
    for args, kwargs in calls:
        got = dops.call_tensors(args, kwargs)
        want = dops.tensors((args, kwargs))
        assert len(got) == len(want) and all(g is w for g, w in zip(got, want)), (args, kwargs)


def test_op_info_marks_the_views_the_engine_skips():
    aten = torch.ops.aten
    view, detach, add_ = dops.info(aten.view.default), dops.info(aten.detach.default), dops.info(aten.add_.Tensor)
    assert view.plain_view and detach.plain_view  # (detach's output is no view of autograd's: see _produced_here)
    assert dops.info(aten._unsafe_view.default).plain_view
    assert not add_.plain_view and not dops.info(aten.set_.source_Storage).plain_view  # (they write)
    assert dops.info(aten.mm.default).kind == "compute" and not dops.info(aten.mm.default).plain_view
    # the lookup by the overload's id returns the one record kept for it
    assert dops.info(aten.view.default) is view
