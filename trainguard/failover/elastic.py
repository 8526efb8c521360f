"""Elastic data parallelism on torchft: one :class:`ElasticGroup` per data-parallel replica group.

Relies on ``torchft`` (``Manager``: per-step quorum through a Rust lighthouse, reconfigurable gloo /
nccl process groups, live recovery of a returning replica from a healthy peer) and ``torch.distributed``.
Fail-stop techniques (SPARe's stacked shards in :mod:`trainguard.failover.spare.runtime`, neighbor-do-both
next) reuse it; they add *what* each group computes, torchft decides *who* is in the step.

One step of an elastic group::

    grp.begin_step()                 # quorum: drops dead groups, heals a returning one
    live = grp.members()             # the group ids in this quorum (same set on every member)
    ... compute local gradients ...
    ok = grp.allreduce_sum(flat)     # False when a peer died during the collective
    if grp.commit():                 # torchft's should_commit: all-or-nothing for this step
        optimizer.step()

``members()`` is one all-reduce of a one-hot vector: torchft's quorum knows the replica ids but does not
expose them, and the collective keeps the answer consistent (every member sees the same set or the
collective fails and the step is retried).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from trainguard.errors import TrainguardError


@dataclass
class ElasticConfig:
    """Timeouts are short by default: a killed group must not stall the survivors for long."""

    lighthouse: str = ""                 # address of the torchft lighthouse ("http://host:port")
    timeout_s: float = 20.0              # collectives and should_commit
    quorum_timeout_s: float = 60.0
    connect_timeout_s: float = 20.0
    heartbeat_ms: int = 100
    min_replicas: int = 1                # quorums smaller than this do not commit
    init_sync: bool = False              # True: step 0 copies group 0's state (False: identical seeded init)


def start_lighthouse(min_replicas: int = 1, join_timeout_ms: int = 10_000, heartbeat_timeout_ms: int = 1500,
                     quorum_tick_ms: int = 50):
    """An in-process torchft lighthouse (the coordinator every group's manager heartbeats to).

    ``heartbeat_timeout_ms`` is how fast a silent (dead) group is dropped from the next quorum;
    ``join_timeout_ms`` how long a quorum waits for a straggler that still heartbeats (a live group that is
    slow to notice a failed collective must not be left out of the shrunk quorum)."""
    from torchft._torchft import LighthouseServer

    return LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                            heartbeat_timeout_ms=heartbeat_timeout_ms, quorum_tick_ms=quorum_tick_ms)


def _device_pg(device: torch.device, timeout: timedelta):
    from torchft.process_group import ProcessGroupBabyNCCL, ProcessGroupGloo

    # nccl on GPUs (the "baby" variant runs it in a subprocess so a hung collective can be aborted)
    return ProcessGroupBabyNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)


class ElasticGroup:
    """A torchft-managed data-parallel replica group of one process (``group_id`` in ``0..n_groups-1``)."""

    def __init__(self, group_id: int, n_groups: int, cfg: ElasticConfig, *,
                 state_dict: Callable[[], dict] | None = None,
                 load_state_dict: Callable[[dict], None] | None = None,
                 device: torch.device | str = "cpu"):
        from torchft.manager import Manager

        if not cfg.lighthouse:
            raise TrainguardError("elastic group: no torchft lighthouse address (ElasticConfig.lighthouse)")
        if not 0 <= group_id < n_groups:
            raise TrainguardError(f"elastic group id {group_id} is out of range 0..{n_groups - 1}")
        self.group_id, self.n_groups = group_id, n_groups
        self.device = torch.device(device)
        timeout = timedelta(seconds=cfg.timeout_s)
        # each replica group has its own store (its ranks meet there; here a group is one process)
        self._store = dist.TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
        self._pg = _device_pg(self.device, timeout)
        self.manager = Manager(
            pg=self._pg, min_replica_size=cfg.min_replicas,
            load_state_dict=load_state_dict, state_dict=state_dict, use_async_quorum=False,
            timeout=timeout, quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
            connect_timeout=timedelta(seconds=cfg.connect_timeout_s),
            heartbeat_interval=timedelta(milliseconds=cfg.heartbeat_ms), rank=0, world_size=1,
            store_addr="localhost", store_port=self._store.port, lighthouse_addr=cfg.lighthouse,
            replica_id=f"group{group_id}_", init_sync=cfg.init_sync,
        )

    # ------------------------------------------------------------------ per step
    @property
    def step(self) -> int:
        """Committed steps (torchft's counter; a healed group jumps to its peers' step)."""
        return self.manager.current_step()

    def begin_step(self) -> None:
        """Join the quorum for the next step (synchronous: a healing group loads its peer's state here)."""
        self.manager.start_quorum()

    def members(self) -> frozenset[int]:
        """Group ids taking part in this step; empty if the collective failed (then the step fails)."""
        onehot = torch.zeros(self.n_groups, dtype=torch.float32, device=self.device)
        onehot[self.group_id] = 1.0
        if not self.allreduce_sum(onehot):
            return frozenset()
        return frozenset(int(i) for i in torch.nonzero(onehot > 0.5).flatten().tolist())

    def allreduce_sum(self, tensor: torch.Tensor) -> bool:
        """Sum ``tensor`` in place over the quorum; False (tensor undefined) if a peer failed."""
        from torch.distributed import ReduceOp

        if self.manager.errored() is not None:
            return False
        work = self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM)
        work.wait()
        if self.manager.errored() is None:
            return True
        # Tear our end of the broken collective down now: a peer still blocked in it (waiting on us, not on
        # the dead group) then fails at once and joins the shrunk quorum instead of being left out of it.
        self._pg.abort()
        self.manager._quorum_id = -1  # torchft: force the next quorum to configure a fresh process group
        return False

    def commit(self) -> bool:
        """torchft's should_commit: True iff every member of the quorum finished the step without error."""
        return bool(self.manager.should_commit())

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def flat_grads(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """All gradients in one fp32 vector (zeros for parameters without one)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params])


def set_flat_grads(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    off = 0
    for p in params:
        n = p.numel()
        p.grad = flat[off:off + n].view_as(p).to(p.dtype).clone()
        off += n


def quiet_torchft_logs() -> None:
    """Silence torchft in a worker process: it logs every quorum and commit, and a stack trace for every
    collective a dead peer broke -- the expected event here, which the runtime reports itself."""
    import http.server
    import logging

    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("RUST_LOG", "error")
    # the checkpoint-transfer server of a healing peer logs each request to stderr
    http.server.BaseHTTPRequestHandler.log_message = lambda *a, **k: None
