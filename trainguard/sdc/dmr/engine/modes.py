"""The dispatch modes: the engine's (:class:`_DMRMode`, every op to :meth:`DMREngine.dispatch`) and the bench's
pass-through floor (:class:`PassThroughMode`). Relies on torch's ``TorchDispatchMode`` and its private
``_should_skip_dynamo`` hook (torch 2.13; ``tests/sdc/dmr/test_torch_private.py`` fails if it moves).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.utils._python_dispatch import TorchDispatchMode

from trainguard.sdc.dmr import ops as dops
from trainguard.sdc.dmr.engine import common as _common

if TYPE_CHECKING:
    from trainguard.sdc.dmr.engine.core import DMREngine

class _UnwrappedMode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: ``__torch_dispatch__`` is not wrapped in ``torch._disable_dynamo``. trainguard never compiles a
        step (nothing in it calls ``torch.compile``), and the wrapper (two Python frames and four eval-frame
        switches) was a fifth of the cost of the mode itself on every dispatched op. This overrides a private
        hook of ``TorchDispatchMode`` (torch 2.13); ``tests/sdc/dmr/test_torch_private.py`` fails if it moves."""
        return False


class PassThroughMode(_UnwrappedMode):
    """Every op through Python and straight on to its kernel, nothing checked or kept: the floor of any verifier
    built on a Python dispatch mode, the engine's own included (``bench dmr``'s ``floor`` system, entered with
    :func:`~trainguard.sdc.dmr.ops.views_past_python` as the engine is). ``ops`` counts what reached it. Never a
    protection: nothing it sees is verified."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        table = _common.OP_TIMES
        if table is None:
            return func._op(*args, **(kwargs or {}))  # (the C++ entry point, as the engine's primaries call it)
        return _common._timed(table, func._op, dops.info(func).name, args, kwargs or {})  # (bench dmr --op-times)


class _DMRMode(_UnwrappedMode):
    def __init__(self, engine: DMREngine):
        super().__init__()
        self.engine = engine

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.engine.dispatch(func, args, kwargs or {})
