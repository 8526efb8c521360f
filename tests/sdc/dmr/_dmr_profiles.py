"""Synthetic profiles for the planner tests: a small builder, the paper's worked examples, and dense / MoE /
pipeline-stage iterations with a 1F1B order, activation checkpointing, TP and EP collectives."""

from __future__ import annotations

import random

from trainguard.sdc.dmr.profile import OpRecord, Profile, Window


class Builder:
    """Appends ops and idle windows in execution order, each starting when the previous one ends."""

    def __init__(self) -> None:
        self.ops: list[OpRecord] = []
        self.windows: list[Window] = []
        self.t = 0.0

    def op(self, id: str, phase: str = "forward", kind: str = "F", time: float = 1.0, **kw) -> OpRecord:
        o = OpRecord(id=id, name=kw.pop("name", "aten.op"), phase=phase, kind=kind, start_s=self.t, time_s=time, **kw)
        self.ops.append(o)
        self.t += time
        return o

    def window(self, id: str, kind: str, duration: float, dynamic: bool = False, block: str = "") -> Window:
        w = Window(id=id, kind=kind, start_s=self.t, duration_s=duration, after_op=self.ops[-1].id if self.ops else "",
                   dynamic=dynamic, block=block)
        self.windows.append(w)
        self.t += duration
        return w

    def profile(self, budget: int, curve: list[tuple[float, int]] | None = None, base: int = 0, **kw) -> Profile:
        curve = curve if curve is not None else [(0.0, base)]
        blocks = list(dict.fromkeys(o.block for o in self.ops if o.block))
        return Profile(iteration_s=self.t, memory_budget_bytes=budget, peak_bytes=max(b for _, b in curve),
                       memory_curve=curve, blocks=blocks, ops=self.ops, windows=self.windows, **kw)


# -- the paper's worked examples ---------------------------------------------------------------------
def fig7_profile(comm: float, a: float = 1.0, b: float = 1.0, dynamic: bool = False) -> Profile:
    """Fig. 7: one AC segment of two ops A, B; B's inputs are gathered by communication B_c (time ``comm``)."""
    q = Builder()
    q.op("A", time=a, block="L0", ac_segment="L0", seg_index=0, in_bytes=1, out_bytes=1, dynamic=dynamic)
    q.op("Bc", kind="C", time=comm, block="L0")
    q.op("B", time=b, block="L0", ac_segment="L0", seg_index=1, seg_last=True, comm_s=comm, in_bytes=1, out_bytes=1)
    q.op("A'", phase="recompute", time=a, block="L0", ac_segment="L0", seg_index=0, recompute_of="A")
    q.op("dB", phase="backward", kind="B", block="L0", grad_of="B", in_bytes=1, out_bytes=1)
    q.op("dA", phase="backward", kind="B", block="L0", grad_of="A", in_bytes=1, out_bytes=1)
    return q.profile(budget=100, base=10)


def fig9_profile() -> Profile:
    """Fig. 9 reconstructed (see tests/sdc/dmr/test_dmr_examples.py): a pipeline stage of three blocks, each
    F1..F4 with B and W ops, unit times and tensors; AC segments {F1, F2} and {F3, F4}, a unit TP
    collective gathering F4's input; memory headroom 18 and a PP window of 15 after the backward."""
    q = Builder()
    blocks = ["layers.0", "layers.1", "layers.2"]
    for b in blocks:
        for x in range(1, 5):
            seg = "s1" if x <= 2 else "s2"
            if x == 4:
                q.op(f"{b}.C", kind="C", block=b, name="all_reduce")
            q.op(f"{b}.F{x}", block=b, ac_segment=f"{b}.{seg}", seg_index=(x - 1) % 2, seg_last=x % 2 == 0,
                 in_bytes=1, out_bytes=1, comm_s=1.0 if x == 4 else 0.0)
    for b in reversed(blocks):
        q.op(f"{b}.F1'", phase="recompute", block=b, ac_segment=f"{b}.s1", seg_index=0, recompute_of=f"{b}.F1")
        q.op(f"{b}.F3'", phase="recompute", block=b, ac_segment=f"{b}.s2", seg_index=0, recompute_of=f"{b}.F3")
        for x in range(4, 0, -1):
            q.op(f"{b}.B{x}", phase="backward", kind="B", block=b, grad_of=f"{b}.F{x}", in_bytes=1, out_bytes=1)
            q.op(f"{b}.W{x}", phase="backward", kind="W", block=b, grad_of=f"{b}.F{x}", in_bytes=1, out_bytes=1)
    q.window("pp-bwd", "pp", 15.0)
    return q.profile(budget=118, base=100)


def fig10_profile() -> Profile:
    """Fig. 10 reconstructed: ops A-F, TP windows W1 (after B) and W2 (after F); every op's inputs and
    outputs are 2 bytes and the budget leaves room for three ops (6 bytes)."""
    q = Builder()
    times = {"A": 2.0, "B": 3.0, "C": 1.0, "D": 3.0, "E": 1.0, "F": 4.0}
    for name in "AB":
        q.op(name, time=times[name], in_bytes=1, out_bytes=1)
    q.window("W1", "tp", 3.0)
    for name in "CDEF":
        q.op(name, time=times[name], in_bytes=1, out_bytes=1)
    q.window("W2", "tp", 5.0)
    return q.profile(budget=106, base=100)


# -- synthetic iterations ----------------------------------------------------------------------------
DENSE_BLOCK = [  # (name, has weights, TP collective after it)
    ("attention_norm", False, False), ("wq", True, False), ("attn", False, False), ("wo", True, True),
    ("ffn_norm", False, False), ("w1", True, False), ("act", False, False), ("w2", True, True),
]
MOE_BLOCK = [("attention_norm", False, False), ("wq", True, False), ("attn", False, False), ("wo", True, True),
             ("ffn_norm", False, False), ("router", True, False)]


def synthetic_profile(*, blocks: int = 2, microbatches: int = 2, stages: int = 1, stage: int = 0,
                      ac: str = "full", moe: bool = False, headroom: float = 0.5, seed: int = 0) -> Profile:
    """One rank's iteration: ``blocks`` transformer blocks on pipeline stage ``stage`` of ``stages``, a 1F1B
    order over ``microbatches``, AC per block (``full``), on part of it (``selective``) or none, TP
    collectives (with idle windows) after ``wo`` and ``w2``, pp windows between micro-batches, a DP window
    and optimizer ops at the end. MoE blocks route tokens to experts through dynamic EP all-to-alls.
    ``headroom``: budget = peak x (1 + headroom)."""
    rng = random.Random(seed)
    q = Builder()
    names = [f"layers.{stage * blocks + b}" for b in range(blocks)]
    act = 4096
    base = 10 * act
    curve: list[tuple[float, int]] = [(0.0, base)]
    live = {"bytes": 0}

    def bump(delta: int) -> None:
        live["bytes"] += delta
        curve.append((q.t, base + live["bytes"]))

    def fwd(mb: int) -> None:
        if stage > 0:
            q.window(f"pp-recv-f{mb}", "pp", rng.uniform(0.5, 1.5))
        for b in names:
            spec = MOE_BLOCK if moe else DENSE_BLOCK
            seg_ops = []
            for x, (n, w, tp) in enumerate(spec):
                seg = b if ac == "full" or (ac == "selective" and x < 4) else None
                o = q.op(f"f{mb}:{b}.{n}", block=b, module=f"{b}.{n}", microbatch=mb, ac_segment=seg,
                         time=rng.uniform(0.2, 1.0) * (2 if w else 1), in_bytes=act + (2 * act if w else 0),
                         param_bytes=2 * act if w else 0, out_bytes=act)
                seg_ops.append(o)
                bump(act if seg is None or x == 0 else 0)
                if tp:
                    d = rng.uniform(0.5, 2.0)
                    q.op(f"f{mb}:{b}.{n}.allreduce", kind="C", block=b, microbatch=mb, time=d)
                    q.window(f"tp-f{mb}:{b}.{n}", "tp", d)
            if moe:
                q.op(f"f{mb}:{b}.a2a", kind="C", block=b, microbatch=mb, time=0.5)
                q.window(f"ep-f{mb}:{b}.dispatch", "ep", 0.5, dynamic=True)
                for e in range(2):
                    o = q.op(f"f{mb}:{b}.expert{e}", block=b, module=f"{b}.experts.{e}", microbatch=mb, dynamic=True,
                             time=rng.uniform(0.3, 1.2), in_bytes=act, out_bytes=act, ac_segment=b if ac == "full" else None)
                    seg_ops.append(o)
                    bump(act if o.ac_segment is None else 0)  # (released in bwd like any op outside a segment)
                q.op(f"f{mb}:{b}.a2a_back", kind="C", block=b, microbatch=mb, time=0.5)
                q.window(f"ep-f{mb}:{b}.combine", "ep", 0.5, dynamic=True)
                o = q.op(f"f{mb}:{b}.combine", block=b, microbatch=mb, time=0.2, in_bytes=act, out_bytes=act,
                         ac_segment=b if ac == "full" else None)
                seg_ops.append(o)
                bump(act if o.ac_segment is None else 0)
            in_seg = [o for o in seg_ops if o.ac_segment]
            for i, o in enumerate(in_seg):
                o.seg_index = i
            if in_seg:
                in_seg[-1].seg_last = True
        if stage < stages - 1:
            q.window(f"pp-send-f{mb}", "pp", rng.uniform(0.5, 1.5))

    def bwd(mb: int) -> None:
        if stage < stages - 1:
            q.window(f"pp-recv-b{mb}", "pp", rng.uniform(0.5, 1.5))
        for b in reversed(names):
            fops = [o for o in q.ops if o.phase == "forward" and o.microbatch == mb and o.block == b and o.kind == "F"]
            for o in fops:
                if o.ac_segment and not o.seg_last:
                    q.op(f"r{mb}:{o.id[o.id.index(':') + 1:]}", phase="recompute", block=b, microbatch=mb,
                         ac_segment=o.ac_segment, seg_index=o.seg_index, recompute_of=o.id, time=o.time_s,
                         in_bytes=o.in_bytes, out_bytes=o.out_bytes, dynamic=o.dynamic)
            for o in reversed(fops):
                tail = o.id[o.id.index(":") + 1:]
                q.op(f"b{mb}:{tail}.B", phase="backward", kind="B", block=b, microbatch=mb, grad_of=o.id,
                     time=o.time_s * 1.1, in_bytes=o.out_bytes, out_bytes=act, dynamic=o.dynamic)
                if o.param_bytes:
                    q.op(f"b{mb}:{tail}.W", phase="backward", kind="W", block=b, microbatch=mb, grad_of=o.id,
                         time=o.time_s, in_bytes=2 * act, out_bytes=o.param_bytes, dynamic=o.dynamic)
                if tail.endswith(("wq", "w1")):
                    d = rng.uniform(0.5, 2.0)
                    q.op(f"b{mb}:{tail}.allreduce", kind="C", phase="backward", block=b, microbatch=mb, time=d)
                    q.window(f"tp-b{mb}:{tail}", "tp", d)
            bump(-sum(act for o in fops if o.ac_segment is None or o.seg_index == 0))
        if stage > 0 or stages > 1:
            q.window(f"pp-send-b{mb}", "pp", rng.uniform(2.0, 6.0))

    warm = min(microbatches, stages - stage - 1)
    order = [("f", m) for m in range(warm)]
    nxt = warm
    for m in range(microbatches):
        if nxt < microbatches:
            order.append(("f", nxt))
            nxt += 1
        order.append(("b", m))
    for step, mb in order:
        (fwd if step == "f" else bwd)(mb)
    q.window("dp", "dp", 2.0)
    for b in names:
        q.op(f"opt:{b}", phase="optimizer", kind="O", time=0.2, in_bytes=4 * act, out_bytes=2 * act)
    peak = max(b for _, b in curve)
    return q.profile(budget=int(peak * (1 + headroom)), curve=curve, model="synthetic-moe" if moe else "synthetic",
                     strategy="pipeline" if stages > 1 else "single", stage=stage)
