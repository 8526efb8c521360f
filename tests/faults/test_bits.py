"""Each fault model changes exactly the intended bits of exactly one element (fp32, bf16, fp16)."""

import math

import pytest
import torch

from trainguard.errors import TrainguardError
from trainguard.faults.bits import FaultModel, field_bits, layout

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def ints(t):
    return t.view(layout(t.dtype)[3]).long() & ((1 << layout(t.dtype)[0]) - 1)


def sample(dtype):
    return (torch.randn(64, generator=torch.Generator().manual_seed(0)) * 0.5).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bit", [0, 3, "exp_lsb", "exp_msb", "sign"])
def test_bitflip_changes_exactly_one_bit(dtype, bit):
    total, exp, man, _ = layout(dtype)
    b = {"exp_lsb": man, "exp_msb": man + exp - 1, "sign": total - 1}.get(bit, bit)
    t = sample(dtype)
    before = ints(t.clone())
    old, new, flipped = FaultModel("bitflip", bit=b).apply(t, 7)
    diff = before ^ ints(t)
    assert flipped == b
    assert int(diff[7]) == 1 << b
    assert int(diff.count_nonzero()) == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("field", ["sign", "exponent", "mantissa"])
def test_random_bit_stays_in_field(dtype, field):
    g = torch.Generator().manual_seed(1)
    allowed = set(field_bits(dtype, field))
    for _ in range(20):
        t = sample(dtype)
        before = ints(t.clone())
        _, _, bit = FaultModel("bitflip", field=field).apply(t, 5, g)
        diff = int((before ^ ints(t))[5])
        assert bit in allowed and diff == 1 << bit


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind, check", [("inf", lambda v: v == math.inf), ("-inf", lambda v: v == -math.inf),
                                         ("nan", math.isnan), ("value", lambda v: v == 2.0)])
def test_special_values_touch_one_element(dtype, kind, check):
    t = sample(dtype)
    before = t.clone()
    old, new, _ = FaultModel(kind, value=2.0).apply(t, 9)
    assert check(float(t[9])) and check(new) and old == float(before[9])
    mask = torch.ones_like(t, dtype=torch.bool)
    mask[9] = False
    assert torch.equal(t[mask], before[mask])


@pytest.mark.parametrize("dtype", DTYPES)
def test_near_inf_flips_exponent_msb_of_small_values(dtype):
    total, exp, man, _ = layout(dtype)
    t = torch.full((4,), 0.75, dtype=dtype)
    before = ints(t.clone())
    _, new, bit = FaultModel("near-inf").apply(t, 2)
    assert bit == man + exp - 1 and int((before ^ ints(t))[2]) == 1 << bit
    assert abs(new) > (1e10 if dtype != torch.float16 else 1e4) and math.isfinite(new)


@pytest.mark.parametrize("dtype", DTYPES)
def test_near_inf_of_large_value_still_near_inf(dtype):
    t = torch.full((2,), -3.0, dtype=dtype)
    _, new, _ = FaultModel("near-inf").apply(t, 1)
    assert new < -(1e10 if dtype != torch.float16 else 1e4) and math.isfinite(new) and float(t[0]) == -3.0


def test_bad_input_is_refused():
    with pytest.raises(TrainguardError):
        FaultModel("melt")
    with pytest.raises(TrainguardError):
        FaultModel("bitflip", bit=40).apply(torch.zeros(3), 0)
    with pytest.raises(TrainguardError):
        FaultModel("nan").apply(torch.zeros(3), 3)
    with pytest.raises(TrainguardError):  # bit layouts: fp32, bf16, fp16 only
        FaultModel("bitflip", bit=1).apply(torch.zeros(3, dtype=torch.float64), 0)
    with pytest.raises(TrainguardError):
        FaultModel("nan").apply(torch.zeros(3, dtype=torch.int32), 0)
