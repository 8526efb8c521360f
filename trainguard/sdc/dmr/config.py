"""``[sdc.dmr]``: dual modular redundancy for every op of the iteration (``trainguard.sdc.dmr``).

Relies on the standard library only (the section is loaded by ``trainguard.utils.settings``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from trainguard.errors import ConfigError
from trainguard.utils.settings import setting

CARRY_MODES = ("unbounded", "windows")  # carry_budget's values (PlannerConfig.carry, plan dmr --carry, bench dmr)


@dataclass
class DMRConfig:
    enabled: bool = setting(False, help="verify every op of every iteration by running it twice ([sdc] dmr = true)")
    system: Literal["sparetrain", "naive", "none"] = setting(
        "sparetrain", help="sparetrain (planned: P-DMR, AGC, deferred, naive), naive (every op re-executed at once), "
        "none (no checks: the No-DMR baseline with the same hooks)")
    phases: tuple[int, ...] = setting((1, 2, 3), help="planner phases (ablation): 1, 1,2 or 1,2,3")
    compare: Literal["bitwise", "tolerance"] = setting(
        "bitwise", help="bitwise where kernels are deterministic (CPU); tolerance: per-op bounds from a clean-run "
        "determinism report")
    fingerprints: bool = setting(True, help="compare exact checksums of the outputs (every check; a deferred "
                                 "one keeps no copy of its output). false: naive checks compare element by element "
                                 "and deferred ones keep a copy of the output")
    memory_budget_mb: float = setting(0.0, help="memory the deferred checks may hold (0: half the memory free "
                                      "when the plan is made: device memory on CUDA, the host's share per local rank on CPU)")
    optimizer_chunk_mb: float = setting(2.0, help="update-stage ops (fused AdamW, clipping) are verified in pieces of "
                                        "this many MB of each tensor list (the piece's copies stay in the last-level "
                                        "cache; on a 32 MB L3, 0.25 MB pieces cost llama-60m 0.4 s more per step in "
                                        "Python overhead than 1-4 MB ones)")
    hold_update: bool = setting(True, help="sparetrain with idle windows: the fused optimizer runs once and is checked "
                                "in the next iteration's windows from a verified copy of the state before it (a "
                                "wrong update is written back and that iteration retried); false: checked in "
                                "pieces at once, as the naive system does")
    carry_last: bool = setting(True, help="sparetrain with idle windows and the held update: backward ops the plan "
                               "leaves naive because no window follows them before the update (the last "
                               "micro-batch's on the first stage) are checked in the next iteration's first window "
                               "instead, against the state before the update; a mismatch re-executes both "
                               "iterations (phases with 3 only: carrying is deferral). false: checked at once")
    carry_budget: Literal["unbounded", "windows"] = setting(
        "unbounded", help="with carry_last: which of those ops are carried. unbounded: all of them (the windows at run "
        "time take what they can, the rest is checked at the end of the next iteration); windows: only as many as "
        "the profiled windows have room for (the plan's carry_budget_s, largest checks first), the rest checked at "
        "once: less memory held across the update, but a slower step where measured (the windows at run time are "
        "longer than profiled), and the list ops over every gradient (averaging, clipping) checked at once too")
    swap_gradients: bool = setting(True, help="pipeline / expert-parallel runs: a gradient accumulated or scaled in "
                                   "place (add_, div_, mul_ on p.grad) is computed out of place and p.grad takes the "
                                   "result's storage, so its check is deferred like any other op instead of a copy and "
                                   "a second execution at once. false: checked at once")
    pdmr_tail: Literal["defer", "recompute"] = setting(
        "defer", help="the ops of an activation-checkpointed segment after the last tensor autograd saves (which "
        "the recompute need not replay: an FFN's down projection and residual add): defer (checked where they ran, "
        "in a window or at once, and the recompute stops early as without DMR) or recompute (the paper's P-DMR: "
        "the recompute replays the whole segment, on the critical path)")
    executor: Literal["auto", "thread", "stream"] = setting(
        "auto", help="where deferred checkers run during a communication window: thread (a worker thread while the "
        "main thread waits: CPU), stream (a side stream of the device, launched before the wait, with comparisons "
        "kept as device flags read once at the verdict: CUDA; on CPU the stream is a no-op and the checkers run "
        "before the wait), auto (stream on CUDA, thread otherwise)")
    checker_priority: Literal["idle", "normal"] = setting(
        "idle", help="the thread executor's worker: idle (Linux's SCHED_IDLE class: it only gets a core nothing else "
        "wants, so the checkers never slow a rank's critical path where ranks share a host's cores) or normal (the "
        "main thread's priority)")
    views_past_python: bool = setting(True, help="while a verified attempt runs, the view ops the engine has seen "
                                      "(view, t, transpose, expand ...: no arithmetic, nothing to check) go past "
                                      "Python dispatch modes in C++ instead of through the engine's mode, which "
                                      "returns them unchanged (about 3,200 ops a step per llama-60m stage). Turned "
                                      "off automatically for models with tensor-subclass parameters (DTensor). "
                                      "false: every view goes through the mode")
    window_fill: float = setting(0.8, help="share of each communication window the planner fills with checks (the "
                                 "rest absorbs checkers that run slower than profiled, e.g. beside another rank's "
                                 "compute; what does not fit goes to another window, or is carried or checked at once)")
    dp_windows: bool = setting(False, help="the planner may defer checks into data-parallel windows too: a pipeline "
                               "stage's gradient all-reduce over its replicas, which runs after the schedule with "
                               "nothing to compute (dp > 1 with pp > 1; plain DDP overlaps its all-reduce with the "
                               "backward and has no such window). false: only pp, tp and ep windows, as in the paper "
                               "(checks nobody planned may still run there)")
    plan: str = setting("", help="a DMR plan JSON (trainguard plan dmr --out); empty: profile and plan at the start")
    profile_steps: int = setting(1, help="times the first step is profiled before the plan is made (each attempt "
                                 "unverified, then re-executed; the plan takes each op's and window's median time "
                                 "over them, so one op preempted while profiled on a loaded host does not leave it "
                                 "checked at once for the whole run). 3 where ranks share cores")
    tie_breakers: int = setting(3, help="update-stage ops (repaired in place, not retried): executions after the primary "
                                "and checker disagree, each compared with both, before three results or more that "
                                "all differ stop the run as a suspected hardware fault (one tie-breaker: two faults "
                                "in one op's checker and tie-breaker stopped it; 1 to 10)")
    determinism_report: str = setting("", help="tolerance mode: a determinism report JSON (from a clean run)")
    tolerance_safety: float = setting(8.0, help="tolerance = this x the largest clean-run gap of the op")
    coverage: bool = setting(False, help="keep the per-op coverage report of the last step (memory grows with ops)")

    def validate(self) -> DMRConfig:
        if not self.phases or any(p not in (1, 2, 3) for p in self.phases) or list(self.phases) != sorted(set(self.phases)):
            raise ConfigError(f"sdc.dmr.phases must be 1, 1,2 or 1,2,3; got {list(self.phases)}")
        if self.phases[0] != 1 or (3 in self.phases and 2 not in self.phases):
            raise ConfigError(f"sdc.dmr.phases builds up from phase 1 (1; 1,2; 1,2,3); got {list(self.phases)}")
        # (written so that NaN fails too: the Python API builds this class without the loader's finite check)
        if not (0 <= self.memory_budget_mb < math.inf and 0 < self.optimizer_chunk_mb < math.inf):
            raise ConfigError(f"sdc.dmr.memory_budget_mb must be >= 0 and sdc.dmr.optimizer_chunk_mb > 0 (both finite), "
                              f"got {self.memory_budget_mb} and {self.optimizer_chunk_mb}")
        if self.profile_steps < 1:
            raise ConfigError(f"sdc.dmr.profile_steps must be >= 1, got {self.profile_steps}")
        if not 1 <= self.tie_breakers <= 10:
            raise ConfigError(f"sdc.dmr.tie_breakers must be 1 to 10, got {self.tie_breakers}")
        if not 0 < self.window_fill <= 1:
            raise ConfigError(f"sdc.dmr.window_fill must be in (0, 1], got {self.window_fill}")
        if not 1 <= self.tolerance_safety < math.inf:
            raise ConfigError(f"sdc.dmr.tolerance_safety must be >= 1, got {self.tolerance_safety}")
        return self
