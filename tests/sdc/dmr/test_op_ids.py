"""The static plan is keyed by op id: an op must get the same id in the profiled step and in every step after it,
whatever the routing and whatever the engine's own checks hold on to."""

from __future__ import annotations

from tests.sdc.dmr._windowed import small_batches, trainer, windowed


def _ids_after_profile(*extra: str, steps: int) -> tuple[dict[str, str], list[list[tuple[str, str]]]]:
    """(profiled op id -> op name, and per later step its ops' (id, name)) on the windowed single-process trainer."""
    t = trainer(small_batches(), *extra)
    eng = windowed(t, "thread")
    t.train_step()  # profiled, then planned
    assert eng.profile is not None and eng.plan is not None
    profiled = {r.id: r.name for r in eng.profile.ops}
    eng.cfg.coverage = True
    runs = []
    for _ in range(steps):
        t.train_step()
        runs.append([(i, n) for i, n, phase, _, _ in eng.coverage if i != "-" and phase not in ("setup", "optimizer")])
    return profiled, runs


def _static_mismatches(profiled: dict[str, str], run: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    return [(i, n, profiled[i]) for i, n in run if ":dyn:" not in i and i in profiled and profiled[i] != n]


def test_a_first_gradient_copied_by_autograd_shifts_no_later_op_id():
    # The engine keeps the embedding gradient's output for a deferred check, so autograd's gradient accumulation
    # copies it instead of taking it over, which the profiled step (nothing held) did not: one op more
    profiled, runs = _ids_after_profile(steps=2)
    for run in runs:
        extra = [i for i, n in run if i not in profiled]
        assert extra and all(i.startswith("backward:acc:") for i in extra), extra
        assert _static_mismatches(profiled, run) == []
        assert sum(i.startswith("backward:") and i in profiled for i, _ in run) > 100


def test_routing_does_not_shift_the_static_op_ids():
    # 16 experts, one each, 64 tokens: which experts get no token changes from step to step, and the loop over the
    # experts runs ops only for those that got some
    profiled, runs = _ids_after_profile("--model.n_experts", "16", "--model.top_k", "1", steps=4)
    dynamic_in_profile = sum(":dyn:" in i for i in profiled)
    assert any(sum(":dyn:" in i for i, _ in run) != dynamic_in_profile for run in runs)  # the routing did change
    for run in runs:
        assert _static_mismatches(profiled, run) == []
        assert sum(":dyn:" not in i and i in profiled for i, _ in run) > 500


def test_no_backward_op_runs_under_an_autograd_node_the_recompute_created():
    # The engine names a backward op after the forward op whose autograd node runs it, and maps forward ops' node
    # numbers only: under non-reentrant checkpointing autograd runs the forward's nodes, and the recompute only
    # supplies their saved tensors. If torch ever ran a recompute's nodes, those backward ops would find no owner.
    import torch

    t = trainer(small_batches())
    eng = windowed(t, "thread")
    created = {"forward": set(), "recompute": set()}
    ran: list[tuple[int, bool]] = []  # (node number, owned by a forward op of the engine)
    last = [-1]
    real = eng._dispatch

    def spy(func, args, kwargs, swap, inf):
        phase = eng.phase()
        if inf.kind == "compute" and phase in created:
            seq = torch._C._autograd._get_sequence_nr() - 1  # (autograd numbers the op's node before the mode)
            if seq != last[0]:
                created[phase].add(seq)
                last[0] = seq
        elif inf.kind == "compute" and phase == "backward":
            node = torch._C._current_autograd_node()
            if node is not None:
                ran.append((node._sequence_nr(), node._sequence_nr() in eng._seq_owner))
        return real(func, args, kwargs, swap, inf)

    eng._dispatch = spy
    for _ in range(3):  # profiled, then planned
        t.train_step()
    assert len(created["recompute"]) > 50 and len(ran) > 100  # the recompute made nodes; backward ops ran
    numbers = {n for n, _ in ran}
    assert not numbers & created["recompute"] and numbers & created["forward"]
    assert sum(owned for _, owned in ran) > 0.8 * len(ran)
