"""Views past the engine's dispatch mode (``ops.views_past_python``, ``[sdc.dmr] views_past_python``): the view ops
the engine returns unchanged skip Python dispatch modes while a verified attempt runs, and nothing else changes."""

from __future__ import annotations

import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from tests.sdc.dmr._windowed import clean_params, equal, params, small_batches, trainer, windowed
from trainguard.faults import Fault, FaultModel, Injector, OpSite
from trainguard.faults.injector import patterns_counting_views
from trainguard.sdc.dmr import ops as dops


class _Seen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _ops(x: torch.Tensor) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    with _Seen() as seen:
        v = x.transpose(0, 1)
        d = x.detach()
        y = (v @ x).sum() + d.sum()
    return seen.names, v, y


def test_seen_tracked_views_skip_every_python_mode_inside_the_context_and_only_there():
    x = torch.arange(12.0).reshape(3, 4).clone()
    for f in (torch.ops.aten.transpose.int, torch.ops.aten.detach.default, torch.ops.aten.alias.default):
        dops.info(f)  # (what the engine's mode does for every op it sees)
    before, _, y0 = _ops(x)
    assert "aten.transpose.int" in before and "aten.detach.default" in before
    with _Seen() as seen:
        torch.ops.aten.alias.default(x)
    assert seen.names == ["aten.alias.default"]
    with dops.views_past_python() as n:
        inside, v, y1 = _ops(x)
        with _Seen() as seen:
            torch.ops.aten.alias.default(x)
        assert seen.names == []  # (an alias autograd does not track: the engine knows it by its storage)
    after, _, y2 = _ops(x)
    assert n >= 1
    assert "aten.transpose.int" not in inside  # past the mode, in C++
    assert "aten.detach.default" in inside  # (registered too, but shallow_copy_and_detach calls modes directly)
    assert "aten.mm.default" in inside and "aten.sum.default" in inside  # compute ops still reach every mode
    assert v._base is x and v.data_ptr() == x.data_ptr()  # still a view, as autograd sees it
    assert after == before  # the registration is gone with the context
    assert torch.equal(y0, y1) and torch.equal(y1, y2)


def test_a_view_whose_op_has_a_python_kernel_of_its_own_is_left_alone():
    lib = torch.library.Library("aten", "IMPL")
    calls = []

    def permute_python(keyset, *args, **kwargs):
        calls.append(1)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Python)):
            return torch.ops.aten.permute.default(*args, **kwargs)

    try:
        lib.impl("permute", permute_python, "Python", with_keyset=True)
        dops.info(torch.ops.aten.permute.default)
        x = torch.arange(6.0).reshape(2, 3)
        with dops.views_past_python(), _Seen():
            y = x.permute(1, 0)
        assert calls and torch.equal(y, x.t())  # its kernel kept, not replaced by a fallthrough
    finally:
        lib._destroy()


def _run(batches, steps: int, plan=None, plain_tensors: bool = True, **cfg):
    """``steps`` steps; returns the trainer, the engine's counters after each step and how many ops of the last step
    that reached the engine's mode were views that may go past it (``detach`` left out: torch hands it to Python
    modes whatever the ``Python`` key says)."""
    t = trainer(batches)
    eng = windowed(t, "thread", transfer=lambda: (lambda: time.sleep(0.05)), **cfg)
    if plan is not None:
        eng.plan = plan
    eng._plain_tensors = plain_tensors  # (as attach sets it for a model with __torch_dispatch__ parameters)
    tracked = []
    dispatch = eng.dispatch

    def spy(func, args, kwargs):
        tracked.append(dops.info(func).plain_view and func is not torch.ops.aten.detach.default)
        return dispatch(func, args, kwargs)

    eng.dispatch = spy
    counts = []
    for _ in range(steps):
        tracked.clear()
        t.train_step()
        counts.append(dict(eng.counts))
    return t, eng, counts, sum(tracked)


def test_verified_steps_check_the_same_ops_with_views_past_the_mode_and_end_bitwise_equal():
    batches = small_batches()
    clean = clean_params(batches, steps=4)
    t_on, eng_on, on, tracked_on = _run(batches, 4)
    # (the same plan for both: one profiled from the host's timings differs from run to run)
    t_off, _, off, tracked_off = _run(batches, 4, eng_on.plan, views_past_python=False)
    assert equal(params(t_on), clean) and equal(params(t_off), clean)
    # the first attempt is profiled (every view seen); the verified ones after it send the tracked views past
    # (the second run starts with the first one's plan: a plan made from this host's timings differs between runs)
    assert tracked_off > 300 and tracked_on == 0
    strategies = ("naive", "p-dmr", "agc", "d-inter", "dynamic", "fingerprints-later", "naive-fallback")
    assert {k: on[-1].get(k, 0) for k in strategies} == {k: off[-1].get(k, 0) for k in strategies}
    assert sum(on[-1].get(k, 0) for k in strategies) > 0
    assert eng_on.totals["detected"] == 0


def test_tensors_whose_ops_go_through_python_are_recognised():
    with FakeTensorMode():
        fake = torch.empty(3)
    assert dops.dispatches_in_python(fake)
    assert not dops.dispatches_in_python(torch.nn.Parameter(torch.empty(3)))
    t = trainer(small_batches())
    assert windowed(t, "thread")._plain_tensors  # (the engine checks the model's parameters when attached)


def test_an_engine_whose_model_has_such_parameters_keeps_every_view_in_the_mode():
    batches = small_batches()
    t, eng, _, tracked = _run(batches, 3, plain_tensors=False)
    assert tracked > 300
    assert equal(params(t), clean_params(batches))


def test_a_fault_site_that_counts_views_still_sees_them_in_a_verified_step():
    """An op site with ``compute_only`` off counts (and may corrupt) views: those its pattern matches stay in the
    modes, so the fault fires at the same occurrence as without DMR."""
    batches = small_batches()
    t = trainer(batches)
    eng = windowed(t, "thread")
    t.train_step()  # (profiled and verified: the views are seen)
    site = OpSite("aten.transpose*", "forward", 3)
    inj = Injector(Fault(site, FaultModel("value", value=0.0), step=t.step_idx), seed=0).attach(t)
    with dops.views_past_python(patterns_counting_views()):  # (what a step's context does, seen from outside)
        names, _, _ = _ops(torch.ones(2, 2))
    assert "aten.transpose.int" not in names  # no injector active here: the views go past
    t.train_step()
    assert [r.target for r in inj.records] == ["aten.transpose.int"]
    assert eng.counts["view"] > 0
