"""One torchft replica group of one process: quorum, membership, fault-tolerant all-reduce, commit.

Relies on ``torchft`` (``Manager``: per-step quorum through a Rust lighthouse, reconfigurable gloo / nccl
process groups, live recovery of a returning replica from a healthy peer over HTTP) and
``torch.distributed`` (the group's own ``TCPStore``). The elastic strategy
(:mod:`trainguard.train.parallel.elastic`) drives it; a launcher starts the lighthouse (:func:`start_lighthouse`).

One step::

    grp.quorum()                            # synchronous: drops dead replicas, heals a returning one
    m = grp.members(mid_step=False)         # who is in this quorum (the same answer on every member)
    ok = grp.allreduce_sum(buf)             # False when a peer died during the collective
    if grp.commit(): ...                    # torchft's should_commit

``members`` is one all-reduce of a small vector: torchft's quorum knows the replica ids but does not expose
them, and the collective keeps the answer consistent (every member sees the same set, or the collective
fails everywhere and the caller re-forms the quorum).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from trainguard.errors import TrainguardError
from trainguard.train.config import ElasticConfig
from trainguard.train.launch import note_process_group
from trainguard.train.parallel.torchft_compat import force_reconfigure


def start_lighthouse(min_replicas: int = 1, join_timeout_ms: int = 10_000, heartbeat_timeout_ms: int = 1500,
                     quorum_tick_ms: int = 50):
    """An in-process torchft lighthouse (the coordinator every replica's manager heartbeats to).

    ``heartbeat_timeout_ms``: how fast a silent (dead) replica is dropped from the next quorum.
    ``join_timeout_ms``: how long a quorum waits for a replica that still heartbeats but has not asked to
    join (a live replica slow to notice a failed collective must not be left out of the shrunk quorum)."""
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                            heartbeat_timeout_ms=heartbeat_timeout_ms, quorum_tick_ms=quorum_tick_ms)


def _device_pg(device: torch.device, timeout: timedelta):
    from torchft.process_group import ProcessGroupBabyNCCL, ProcessGroupGloo

    # nccl on GPUs (the "baby" variant runs it in a subprocess so a hung collective can be aborted)
    return ProcessGroupBabyNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)


@dataclass(frozen=True)
class Membership:
    """Who is in the current quorum, as every member sees it."""

    step: int  # the step every member is at (torchft heals laggards to the highest step)
    live: frozenset[int]  # replica ids in the quorum
    mid_step: frozenset[int]  # members that had already planned this step (re-forming it after a failure)
    digests: dict[int, int] = field(default_factory=dict)  # member -> the digest it passed (its view of the step)

    @property
    def fresh(self) -> frozenset[int]:
        """Members starting the step (a replica that just healed in)."""
        return self.live - self.mid_step


class ElasticGroup:
    """A torchft-managed replica group of one process (``replica_id`` in ``0..replicas-1``)."""

    def __init__(self, replica_id: int, replicas: int, cfg: ElasticConfig, *,
                 state_dict: Callable[[], dict] | None = None,
                 load_state_dict: Callable[[dict], None] | None = None,
                 device: torch.device | str = "cpu"):
        from torchft.manager import Manager

        lighthouse = cfg.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        if not lighthouse:
            raise TrainguardError("elastic: no torchft lighthouse address (distributed.elastic.lighthouse or "
                                  "$TORCHFT_LIGHTHOUSE)")
        if not 0 <= replica_id < replicas:
            raise TrainguardError(f"elastic: replica id {replica_id} is out of range 0..{replicas - 1}")
        self.replica_id, self.replicas = replica_id, replicas
        self.device = torch.device(device)
        note_process_group()  # its gloo group can abort this process's finalization: leave with exit_rank
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
            store_addr="localhost", store_port=self._store.port, lighthouse_addr=lighthouse,
            # torchft derives a global rank from the id's trailing digits: end it with the replica id
            replica_id=f"trainguard_replica_{replica_id}", init_sync=cfg.init_sync,
        )

    # ------------------------------------------------------------------ per step
    @property
    def step(self) -> int:
        """Committed steps (torchft's counter; a healed replica jumps to its peers' step)."""
        return self.manager.current_step()

    def set_step(self, step: int) -> None:
        """Start counting from ``step`` (a run resumed from a checkpoint)."""
        self.manager.load_state_dict({"step": int(step), "batches_committed": 0})

    def quorum(self) -> None:
        """Join the quorum for the current step (synchronous: a lagging replica loads its peer's state here)."""
        try:
            self.manager.start_quorum()
        except Exception as err:  # the lighthouse did not answer in time, or is gone
            msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise TrainguardError(f"elastic: replica {self.replica_id} got no quorum at step {self.step}: {msg}") from None

    @property
    def errored(self) -> bool:
        return self.manager.errored() is not None

    def members(self, mid_step: bool, digest: int = 0) -> Membership | None:
        """Replica ids in this quorum (one all-reduce); None if the collective failed. ``digest`` (an integer
        below 2**52) is this member's summary of its view of the step, returned for every member."""
        n = self.replicas
        vec = torch.zeros(3 * n + 1, dtype=torch.float64, device=self.device)
        vec[self.replica_id] = 1.0
        vec[n + self.replica_id] = 1.0 if mid_step else 0.0
        vec[2 * n + self.replica_id] = float(digest % (1 << 52))
        vec[3 * n] = float(self.step)
        if not self.allreduce_sum(vec):
            return None
        v = vec.cpu().tolist()
        live = frozenset(i for i in range(n) if v[i] > 0.5)
        mid = frozenset(i for i in range(n) if v[n + i] > 0.5)
        if max(v[:n]) > 1.5 or v[3 * n] != len(live) * self.step:
            raise TrainguardError(f"elastic: inconsistent quorum at step {self.step} (two processes with the same "
                                  f"replica id, or members at different steps): {v}")
        return Membership(self.step, live, mid, {i: int(v[2 * n + i]) for i in sorted(live)})

    def allreduce_sum(self, tensor: torch.Tensor) -> bool:
        """Sum ``tensor`` in place over the quorum; False (tensor undefined) if a peer failed."""
        return self._allreduce(tensor, dist.ReduceOp.SUM)

    def allreduce_max(self, tensor: torch.Tensor) -> bool:
        return self._allreduce(tensor, dist.ReduceOp.MAX)

    def _allreduce(self, tensor: torch.Tensor, op) -> bool:
        if self.manager.errored() is not None:
            return False
        work = self.manager.allreduce(tensor, reduce_op=op)
        work.wait()
        if self.manager.errored() is None:
            return True
        self.abort()
        return False

    def abort(self) -> None:
        """Tear our end of a broken collective down now: a peer still blocked in it (waiting on us, not on the
        dead replica) then fails at once and joins the shrunk quorum instead of being left out of it. The
        next quorum builds a fresh process group."""
        self._pg.abort()
        force_reconfigure(self.manager)

    def commit(self) -> bool:
        """torchft's should_commit: True iff this replica finished the step without error in a large enough
        quorum (then torchft's step counter advances)."""
        return bool(self.manager.should_commit())

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def flat_grads(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """All gradients in one fp32 vector (zeros for parameters without one)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params])


def set_flat_grads(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Set every parameter's gradient from one flat vector (the layout of :func:`flat_grads`)."""
    off = 0
    for p in params:
        n = p.numel()
        p.grad = flat[off:off + n].view_as(p).to(p.dtype).clone()
        off += n


def quiet_torchft_logs() -> None:
    """Silence torchft in a worker process: it logs every quorum and commit, and a stack trace for every
    collective a dead peer broke -- the expected event here, which the caller reports itself."""
    import http.server
    import logging

    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("RUST_LOG", "error")
    # the checkpoint-transfer server of a healing peer logs each request to stderr
    http.server.BaseHTTPRequestHandler.log_message = lambda *a, **k: None
