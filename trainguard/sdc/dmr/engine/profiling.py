"""Profiling (part of :class:`~trainguard.sdc.dmr.engine.DMREngine`): the profiled attempts' op records (time, bytes,
kind, owner, segment) and memory curve, the profile made of them, the fingerprint's cost on the device, and the static
plan made from the profile. Relies on torch.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from trainguard.sdc.dmr import ops as dops
from trainguard.sdc.dmr.dynamic import DynamicPlanner
from trainguard.sdc.dmr.engine.common import _checking, _free_memory_bytes, _primary
from trainguard.sdc.dmr.planner import PlannerConfig, plan_static
from trainguard.sdc.dmr.profile import OpRecord, Profile, median_profile
from trainguard.train.host_memory import rss_bytes


class Profiling:
    """The engine's profiling (a part of DMREngine: it reads and writes the engine's state)."""

    # ---- profiling -------------------------------------------------------------------------------
    def _record(self, func, args, kwargs, kind: str | None, phase: str, op_id: str | None, dynamic: bool,
                recompute_of: str | None = None) -> Any:
        if self._sync is not None:  # (a profiled attempt: the op's own time on the device, not its launch's)
            self._sync()
        t0 = time.perf_counter()
        out = _primary(func, args, kwargs)
        if self._sync is not None:
            self._sync()
        dt = time.perf_counter() - t0
        if op_id is None:  # a collective
            op_id = self._next_id("comm", False)
        ins = dops.call_tensors(args, kwargs)
        outs = dops.tensors(out)
        owner = self._owner(phase)
        if kind is None:
            kind = {"forward": "F", "recompute": "F", "optimizer": "O"}.get(phase, "B")
            if kind == "B" and any(tuple(t.shape) in self._param_shapes for t in outs) and dops.info(func).name.startswith(
                    ("aten.mm", "aten.sum", "aten.bmm", "aten.embedding_dense_backward")):
                kind = "W"
        module = self.module() if phase in ("forward", "recompute") else ""
        block = self._block(module) if module else (owner[1] if owner else "")
        seg = self._segments[-1][0] if self._segments and phase in ("forward", "recompute") else None
        rec = OpRecord(
            id=op_id, name=dops.info(func).name, phase=phase if phase != "optimizer" or self._optimizer_phase else "optimizer",
            kind=kind, module=module, block=block, ac_segment=f"{seg.path}" if seg is not None else None,
            seg_index=(len(seg.records) - 1 if phase == "forward" else seg.cursor - 1) if seg is not None else -1,
            start_s=t0 - self._t0, time_s=dt,
            in_bytes=dops.bytes_of(ins),
            out_bytes=dops.bytes_of(outs),
            param_bytes=dops.bytes_of(t for t in ins if self._is_param(t)),
            dynamic=dynamic, microbatch=max(self._micro, 0) if phase in ("forward", "recompute") else
            (owner[3] if owner else 0), grad_of=owner[0] if owner else None, recompute_of=recompute_of,
            ac_call=seg.call if seg is not None else -1)
        self._records.append(rec)
        self._last_op = op_id
        if len(self._records) % 16 == 0:
            self._curve.append((t0 - self._t0, rss_bytes()))
        self._own(phase, op_id, dynamic)
        return out

    def finish_profile(self, trainer) -> Profile | None:
        """Record the attempt just profiled. After ``profile_steps`` of them (the first step, re-executed each time):
        the profile (:func:`median_profile` of them) and the plan made from it (kept as ``self.profile`` and
        ``self.plan``); None while more are to come."""
        curve = self._curve
        peak = max((b for _, b in curve), default=rss_bytes())
        # The paper's budget is the device's memory: by default the checks may hold half of what is free now
        # (the rest stays for the run's own growth); the planner's count of retained inputs is conservative
        # (inputs autograd keeps anyway count too), and the peak reached is reported by bench dmr.
        headroom = int(self.cfg.memory_budget_mb * 2**20) or (_free_memory_bytes(trainer.device) // 2 or peak // 4)
        blocks = list(dict.fromkeys(r.block for r in self._records if r.block))
        self._profiled.append(Profile(model=getattr(trainer.cfg.model, "preset", ""), strategy=trainer.strategy.name,
                                      rank=trainer.rank, stage=getattr(trainer.strategy, "stage", 0),
                                      iteration_s=time.perf_counter() - self._t0, memory_budget_bytes=peak + headroom,
                                      peak_bytes=peak, memory_curve=curve or [(0.0, peak)], blocks=blocks,
                                      ops=self._records, windows=self._window_records))
        if len(self._profiled) < self.cfg.profile_steps:
            return None
        self.profile, self._profiled = median_profile(self._profiled), []
        self.profile.meta = self._fingerprint_cost(trainer.device)
        self.plan = plan_static(self.profile, self.planner_config())
        self.budget_bytes = self.budget_bytes or headroom
        self.dynamic = DynamicPlanner(int(self.plan.summary.get("dynamic_budget_bytes") or headroom))
        self._profiling = False
        self._set_early_stop()
        return self.profile

    def _fingerprint_cost(self, device: torch.device) -> dict[str, float]:
        """What this engine's fingerprint costs on ``device``, for the planner to charge the windows with: a fixed
        cost per output (the fingerprint of 4 KiB) and a cost per byte (of 32 MiB, more than a cache holds: the
        outputs a window fingerprints were written a while before), each the median of five."""
        def median_s(t: torch.Tensor) -> float:
            times = []
            for _ in range(6):
                if self._sync is not None:
                    self._sync()
                t0 = time.perf_counter()
                float(self._fp(t).sums[0])  # (waits for the device)
                times.append(time.perf_counter() - t0)
            return statistics.median(times[1:])

        with _checking(), torch.no_grad():
            small, big = torch.ones(2**10, device=device), torch.ones(2**23, device=device)
            call_s, big_s = median_s(small), median_s(big)
        return {"fingerprint_call_s": call_s,
                "fingerprint_s_per_byte": max(0.0, big_s - call_s) / (big.numel() * big.element_size())}

    def planner_config(self, phases: tuple[int, ...] | None = None) -> PlannerConfig:
        """The planner settings this engine's config implies (``phases``: the ablation's, else the config's)."""
        return PlannerConfig(phases=tuple(phases or self.cfg.phases), keep_outputs=not self.cfg.fingerprints,
                             pdmr_tail=self.cfg.pdmr_tail, window_fill=self.cfg.window_fill, carry=self.cfg.carry_budget,
                             use_dp_windows=self.cfg.dp_windows)
