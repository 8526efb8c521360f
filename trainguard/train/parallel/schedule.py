"""1F1B with observable waits: every wait on a pipeline transfer goes through a hook.

``torch.distributed.pipelining.Schedule1F1B`` waits on its sends and receives inside a private helper,
so nothing can use the time a stage spends waiting on the link. :class:`WindowedSchedule1F1B` runs the
same 1F1B order (warm-up forwards, one-forward-one-backward, cool-down backwards, with each stage's last
warm-up send paired with its first backward receive, as the stock schedule does to avoid deadlocks) but
calls ``on_wait(kind, wait)`` for every transfer it waits on. Deferred DMR checks run there
(``trainguard.sdc.dmr``), and a slow inter-node link can be emulated (``link_delay_s``: each transfer
completes no earlier than that long after it was issued), so the idle share of a step can be set for
experiments on a machine whose loopback links are nearly free.

It drives the stage through the methods ``PipelineStage`` exposes to schedules
(``get_fwd_recv_ops``, ``forward_one_chunk``, ``get_fwd_send_ops``, ``get_bwd_recv_ops``,
``backward_one_chunk``, ``get_bwd_send_ops``, ``perform_reduce_grad``) and the schedule's
``_initialize_stage`` / ``_maybe_compute_loss`` / ``_maybe_get_loss`` / ``_update_losses`` /
``_check_inputs`` helpers (underscored: pinned to torch 2.13, checked by ``tests/train/test_schedule.py``).
Relies on torch.distributed (pipelining, batched point-to-point ops).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B

# the stage and schedule methods this module calls (the test asserts they exist on this torch)
STAGE_API = ("get_fwd_recv_ops", "forward_one_chunk", "get_fwd_send_ops", "get_bwd_recv_ops", "backward_one_chunk",
             "get_bwd_send_ops", "perform_reduce_grad")
SCHEDULE_API = ("_initialize_stage", "_maybe_compute_loss", "_maybe_get_loss", "_update_losses", "_check_inputs")

WaitHook = Callable[[str, Callable[[], Any]], Any]


def land(works: list[dist.Work], issued: float, link_delay_s: float) -> None:
    """Wait for ``works``; on an emulated slow link (``link_delay_s`` > 0) not before ``link_delay_s`` after
    ``issued`` (a ``time.perf_counter()`` reading taken when they were issued)."""
    if link_delay_s > 0:
        left = issued + link_delay_s - time.perf_counter()
        if left > 0:
            time.sleep(left)
    for w in works:
        w.wait()


class WindowedSchedule1F1B(Schedule1F1B):
    def __init__(self, *args, on_wait: WaitHook | None = None, link_delay_s: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_wait = on_wait
        self.link_delay_s = link_delay_s
        self.wait_s = 0.0  # time spent waiting on transfers (the stage's idle time), accumulated
        self.waits = 0

    def _issue(self, ops: list[dist.P2POp]) -> tuple[list[dist.Work], float]:
        return (dist.batch_isend_irecv(ops) if ops else []), time.perf_counter()

    def _wait(self, pending: tuple[list[dist.Work], float], kind: str = "pp") -> None:
        works, issued = pending
        if not works:
            return

        def wait() -> None:  # (an emulated slow link: the transfer lands link_delay_s after its issue)
            land(works, issued, self.link_delay_s)

        t0 = time.perf_counter()
        if self.on_wait is not None:
            self.on_wait(kind, wait)
        else:
            wait()
        self.wait_s += time.perf_counter() - t0
        self.waits += 1

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=True,
                           loss_kwargs=None):
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)

        def initialize() -> None:
            self._initialize_stage(arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs is not None else None,
                                   loss_kwargs)
        # a handshake and shape inference on the first step and after a switch between evaluation and training (a
        # no-op otherwise): its ops are not the step's (DMR gives them ids of their own, so the step's match its profile)
        self.on_wait("setup", initialize) if self.on_wait is not None else initialize()
        stage, n = self._stage, self._n_microbatches
        warmup = min(n, self._num_stages - stage.stage_index)
        fwd = bwd = 0
        pending_send: tuple[list[dist.Work], float] = ([], 0.0)
        held_send: list[dist.P2POp] = []

        def forward(i: int) -> None:
            out = stage.forward_one_chunk(i, arg_mbs[i], kwarg_mbs[i], save_forward_output=return_outputs)
            self._maybe_compute_loss(stage, out, target_mbs, i, loss_kwargs)

        def backward(i: int) -> None:
            stage.backward_one_chunk(i, loss=self._maybe_get_loss(stage, i), last_backward=i == n - 1)

        for _ in range(warmup):  # warm-up: forwards only
            self._wait(self._issue(stage.get_fwd_recv_ops(fwd)))
            forward(fwd)
            self._wait(pending_send)
            sends = stage.get_fwd_send_ops(fwd)
            if fwd == warmup - 1:
                held_send = sends  # goes out together with the first backward receive
                pending_send = ([], 0.0)
            else:
                pending_send = self._issue(sends)
            fwd += 1
        while True:  # steady state: one backward, one forward
            self._wait(self._issue(held_send + stage.get_bwd_recv_ops(bwd)))
            backward(bwd)
            held = stage.get_bwd_send_ops(bwd)
            bwd += 1
            if fwd == n:
                break
            self._wait(self._issue(held + stage.get_fwd_recv_ops(fwd)))
            forward(fwd)
            held_send = stage.get_fwd_send_ops(fwd)
            fwd += 1
        pending_send = self._issue(held)
        while bwd < n:  # cool-down: backwards only
            self._wait(self._issue(stage.get_bwd_recv_ops(bwd)))
            backward(bwd)
            self._wait(pending_send)
            pending_send = self._issue(stage.get_bwd_send_ops(bwd))
            bwd += 1
        self._wait(pending_send)
        self._update_losses(stage, losses)
        stage.perform_reduce_grad(n if self.scale_grads else 1)
