"""A single-process trainer whose DMR engine takes the pipeline path, with one emulated transfer per step: the
second micro-batch's forward first waits in a window (as a pipeline stage waits for its input), so the first
micro-batch's checks are planned into it. Shared by the stream-executor tests (CPU and CUDA)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tests.sdc.dmr.test_engine import SMALL as ENGINE_SMALL
from trainguard.data import PackedBatches
from trainguard.sdc.dmr.config import DMRConfig
from trainguard.sdc.dmr.engine import DMREngine, attach
from trainguard.train import Trainer, TrainerConfig

SMALL = ENGINE_SMALL + ["--train.activation_checkpoint", "full", "--train.grad_accum", "2"]


def small_batches() -> PackedBatches:
    return PackedBatches.from_config(TrainerConfig.load(None, SMALL).data)


def clean_params(batches, *extra: str, steps: int = 3) -> dict[str, torch.Tensor]:
    """The parameters after ``steps`` fault-free steps without DMR (what every run must end bitwise equal to)."""
    t = trainer(batches, *extra)
    for _ in range(steps):
        t.train_step()
    return params(t)


def trainer(batches, *extra: str) -> Trainer:
    return Trainer(TrainerConfig.load(None, SMALL + list(extra)), batches=batches)


def _sleep() -> Callable[[], object]:
    return lambda: time.sleep(0.1)


def windowed(t: Trainer, executor: str, transfer: Callable[[], Callable[[], object]] = _sleep, **cfg) -> DMREngine:
    """``transfer()`` starts a transfer and returns its wait (by default a 100 ms sleep on the host: room for the
    checks of the first micro-batch and for the fingerprints the engine takes there first).

    The worker runs at the main thread's priority unless a test asks otherwise: the suite runs two test processes
    on two cores, and in the idle class (the default, for ranks sharing a host) the worker would get a core only
    when the neighbouring test leaves one, so what a 100 ms sleep's window checks would depend on that test."""
    cfg.setdefault("checker_priority", "normal")
    eng = attach(t, DMRConfig(enabled=True, executor=executor, **cfg))
    eng.deferrable = True
    calls = []

    def second_micro_batch_waits(module, inputs):
        calls.append(1)
        if len(calls) % 2 == 0:
            eng.window("pp", transfer())

    t.model.register_forward_pre_hook(second_micro_batch_waits)
    return eng


def params(t: Trainer) -> dict[str, torch.Tensor]:
    return t.state_dict_for_compare()


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
