"""AGC tapes: an op's arguments are split into leaves for the replay (``ops.flatten_call``) and put back together
as they were; a replay agrees with the recording, and tells the op whose result differs."""

from __future__ import annotations

import pytest
import torch

from trainguard.sdc.dmr import ops as dops
from trainguard.sdc.dmr.agc import Tape

aten = torch.ops.aten


def test_flatten_call_round_trips_every_argument_shape():
    a, b = torch.zeros(2), torch.ones(3)
    cases = [
        ((a, 3, [1, 2]), {"dim": 0}),  # scalars and a list of scalars: split as they are
        ((a, [a, b]), {}),  # a list of tensors: torch's pytree
        ((a, torch.Size([2])), {"out": b}),
        ((), {}),
        ((a, []), {"keepdim": True, "dtype": torch.float64}),
    ]
    for args, kwargs in cases:
        leaves, spec = dops.flatten_call(args, kwargs)
        assert sum(isinstance(x, torch.Tensor) for x in leaves) == len(dops.tensors((args, kwargs)))
        got_args, got_kwargs = dops.unflatten_call(leaves, spec)
        assert len(got_args) == len(args) and list(got_kwargs) == list(kwargs)
        for x, y in zip((*got_args, *got_kwargs.values()), (*args, *kwargs.values())):
            if isinstance(y, list) and not any(isinstance(v, torch.Tensor) for v in y):
                assert list(x) == y and x is not y  # (a copy: the caller may reuse its list)
            elif isinstance(y, list):
                assert all(u is v for u, v in zip(x, y))
            else:
                assert x is y or x == y


def test_a_recorded_tape_replays_to_the_same_results_and_tells_the_op_that_differs():
    x = torch.randn(4, 6)
    shape = [6, 4]
    tape = Tape("seg", None, n_ops=3)
    fp = dops.Fingerprint.of
    produced = {id(x)}

    def run(op, *args, **kwargs):
        out = op(*args, **kwargs)
        tape.record(f"op{len(tape.entries)}", op, args, kwargs, out, fp, lambda t: False,
                    lambda t: id(t) in produced or id(t._base) in produced)
        return out

    v = run(aten.view.default, x, shape)
    shape[0] = 99  # the caller reuses its list after the op: the tape kept what the op read
    c = run(aten.cat.default, [v, v], 1)
    run(aten.sum.dim_IntList, c, [0], keepdim=False)
    assert tape.complete

    def agree(name, expect, got):
        return expect.matches(got)

    assert tape.replay(fp, agree) is None
    tape.entries[1].expect[0] = fp(torch.zeros(6, 8))  # the cat's recorded result no longer matches its replay
    assert tape.replay(fp, agree) == "op1"


def test_a_boundary_tensor_changed_in_place_stays_stale_when_re_pointed():
    """A boundary tensor kept by reference whose version moved is stale (the replay reports it, never reads new
    values as the old); re-pointing it to an alias of its storage with a counter of its own (a gradient about to
    take another storage) keeps it stale, while an unchanged one stays replayable."""
    from trainguard.sdc.dmr.agc import StaleInput
    from trainguard.sdc.dmr.engine import _alias

    fp = dops.Fingerprint.of

    def agree(name, expect, got):
        return expect.matches(got)

    for changed in (False, True):
        g = torch.randn(4, 4)
        tape = Tape("seg", None, n_ops=1)
        tape.record("op0", aten.mul.Tensor, (g, g), {}, torch.mul(g, g), fp, lambda t: False, lambda t: True)
        if changed:
            g.add_(1.0)  # written after it was kept, with no copy made for the tape
        tape.repoint(dops.storage_key(g), _alias)
        if changed:
            with pytest.raises(StaleInput):
                tape.replay(fp, agree)
        else:
            assert tape.replay(fp, agree) is None
