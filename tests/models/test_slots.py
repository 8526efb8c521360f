"""Kernel slots compose: wrappers around a replacement around the default body; no silent overwrite."""

import pytest
import torch

from trainguard.errors import TrainguardError
from trainguard.models import build_model
from trainguard.models.slots import KernelSlot


def test_wrappers_run_outermost_first_around_the_replacement():
    slot, calls = KernelSlot(), []
    slot.push(lambda m, nxt, x: calls.append("outer") or nxt(x) + 1, name="outer")
    slot.push(lambda m, nxt, x: calls.append("inner") or nxt(x) * 10, name="inner")
    assert slot(None, lambda x: x, 2) == 21  # outer(inner(default))
    remove = slot.push(lambda m, x: calls.append("replacement") or -x, name="abft", replaces=True)
    calls.clear()
    assert slot(None, lambda x: x, 2) == -19 and calls == ["outer", "inner", "replacement"]
    with pytest.raises(TrainguardError, match="already holds the replacement 'abft'"):
        slot.push(lambda m, x: x, name="other", replaces=True)
    remove()
    assert slot(None, lambda x: x, 2) == 21 and slot.replacement() is None


def test_attention_and_ffn_slots_reach_the_model_output():
    model = build_model("llama-tiny", seed=0)
    x = torch.randint(0, 256, (1, 8))
    base = model(x)
    att = model.layers["0"].attention
    seen = []
    remove = att.kernel.push(lambda m, nxt, *a: seen.append(m) or nxt(*a), name="spy")
    assert torch.equal(model(x), base) and seen == [att]  # a pass-through wrapper changes nothing
    remove()
    off = model.layers["1"].feed_forward.kernel.push(lambda m, nxt, h: torch.zeros_like(nxt(h)), name="zero")
    assert not torch.equal(model(x), base)
    off()
    assert torch.equal(model(x), base) and not att.kernel
