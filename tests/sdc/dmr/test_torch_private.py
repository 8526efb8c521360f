"""The private torch behaviour the DMR engine's dispatch mode relies on (torch 2.13): these fail when it moves."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainguard.sdc.dmr.engine import _DMRMode


def _passthrough(self, func, types, args=(), kwargs=None):
    return func(*args, **(kwargs or {}))


def test_torch_still_wraps_dispatch_modes_unless_the_hook_says_not_to():
    """``TorchDispatchMode.__init_subclass__`` wraps ``__torch_dispatch__`` in ``torch._disable_dynamo`` when the
    private classmethod ``_should_skip_dynamo`` returns True (its default), and leaves it as written otherwise."""
    assert TorchDispatchMode._should_skip_dynamo() is True

    class Wrapped(TorchDispatchMode):
        __torch_dispatch__ = _passthrough

    class Plain(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls):
            return False

        __torch_dispatch__ = _passthrough

    assert Wrapped.__dict__["__torch_dispatch__"] is not _passthrough
    assert Wrapped.__dict__["__torch_dispatch__"].__wrapped__ is _passthrough
    assert Plain.__dict__["__torch_dispatch__"] is _passthrough


def test_dmr_mode_dispatches_without_the_dynamo_wrapper():
    raw = _DMRMode.__dict__["__torch_dispatch__"]
    assert getattr(raw, "__wrapped__", None) is None
    assert raw.__qualname__ == "_DMRMode.__torch_dispatch__"


def test_a_mode_without_the_wrapper_still_sees_and_runs_every_op():
    seen = []

    class Recording(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls):
            return False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.arange(6.0).reshape(2, 3)
    with Recording():
        y = (x * 2).sum()
    assert float(y) == 30.0
    assert "aten.mul.Tensor" in seen and "aten.sum.default" in seen


def test_a_library_still_removes_its_registrations_when_destroyed():
    """``ops.views_past_python`` registers fallthrough kernels at the ``Python`` key in a ``torch.library.Library``
    and removes them with its private ``_destroy`` (torch 2.13) when the attempt ends."""
    name = "aten::transpose.int"
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "Python")
    lib = torch.library.Library("aten", "IMPL")
    lib.impl(torch.ops.aten.transpose.int, torch.library.fallthrough_kernel, "Python")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "Python")
    lib._destroy()
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "Python")


def test_a_storage_keeps_one_python_object_for_its_lifetime_and_it_dies_with_the_storage():
    """The engine knows the storages its ops wrote by a weak reference to each storage's Python object
    (``DMREngine._storage_of``): torch keeps one such object per storage while the storage lives (every tensor on
    it returns the same one), and frees it with the storage."""
    import gc
    import weakref

    x = torch.randn(8)
    ref = weakref.ref(x.untyped_storage())
    assert ref() is x.untyped_storage() and x[2:].detach().untyped_storage() is ref()
    gc.collect()
    assert ref() is x.untyped_storage()  # (only the weak reference points at it from Python)
    y = x.t()
    del x
    assert ref() is y.untyped_storage()
    del y
    assert ref() is None


def test_an_op_overloads_call_is_still_its_private_entry_point_and_nothing_else():
    """The engine calls ``OpOverload._op`` (the C++ entry point, private) instead of the overload itself
    (``ops.OpInfo.call``): ``OpOverload.__call__`` does nothing but call it (torch 2.13)."""
    import inspect

    from trainguard.sdc.dmr import ops as dops

    body = [ln.strip() for ln in inspect.getsource(torch._ops.OpOverload.__call__).splitlines()]
    assert body[-1] == "return self._op(*args, **kwargs)" and not any(
        ln and not ln.startswith(("def ", "return ", "#", ")")) for ln in body), body
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    mm = torch.ops.aten.mm.default
    assert dops.info(mm).call is mm._op and torch.equal(dops.info(mm).call(a, b), mm(a, b))


def test_a_thread_starts_without_modes_and_a_pushed_mode_sees_its_ops_until_popped():
    """The window worker runs under the modes around the engine's (``engine._entered``): torch's private
    ``_get_current_dispatch_mode_stack`` lists a thread's modes outermost first, a new thread has none, and
    ``_push_mode`` / ``_pop_mode`` put one on that thread's stack alone."""
    import threading

    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from trainguard.sdc.dmr.engine import _entered

    seen: list[str] = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    outer, inner = Spy(), Spy()
    found: dict[str, object] = {}

    def worker():
        found["fresh"] = _get_current_dispatch_mode_stack()
        with _entered([outer]):
            found["pushed"] = _get_current_dispatch_mode_stack()
            torch.ones(2).mul(3)
        found["popped"] = _get_current_dispatch_mode_stack()

    with outer, inner:
        assert _get_current_dispatch_mode_stack() == [outer, inner]
        th = threading.Thread(target=worker)
        th.start()
        th.join()
        assert _get_current_dispatch_mode_stack() == [outer, inner]  # (the main thread's stack is its own)
    assert found == {"fresh": [], "pushed": [outer], "popped": []}
    assert "aten.mul.Tensor" in seen
