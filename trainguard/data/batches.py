"""Fixed-length packed sequences whose batches are a pure function of (seed, step, rank).

A step's global batch is drawn from a generator seeded by (seed, step) alone; rank r of a world of W
takes rows [r*B/W, (r+1)*B/W) and micro-batch m of M takes a further slice. So a resumed, rolled-back
or re-sharded run replays exactly the same tokens, and DP with W ranks sees the same global batch as
one process. Relies on torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainguard.data.corpus import STDLIB, TokenStreams, load_corpus
from trainguard.errors import DataError
from trainguard.utils.settings import setting

_STEP_STRIDE = 1_000_003  # keeps (seed, step) generator seeds distinct for any realistic run


@dataclass
class DataConfig:
    source: str = setting(STDLIB, help="corpus: 'stdlib' (Python's own sources), a text file or a folder")
    seq_len: int = setting(128, help="tokens per sequence")
    batch_size: int = setting(8, help="global batch: sequences per optimizer step, over all ranks")
    val_fraction: float = setting(0.02, help="share of the corpus held out for validation, in [0, 1)")
    max_bytes: int = setting(0, help="read at most this many bytes of the corpus (0: all)")
    seed: int = setting(0, help="seed of the batch order")

    def validate(self) -> DataConfig:
        for name in ("seq_len", "batch_size"):
            if getattr(self, name) <= 0:
                raise DataError(f"data.{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.val_fraction < 1:
            raise DataError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.max_bytes < 0:
            raise DataError(f"data.max_bytes must be >= 0 (0: all), got {self.max_bytes}")
        limit = 2**64 // _STEP_STRIDE  # a step's generator is seeded with seed * _STEP_STRIDE + step (torch: < 2**64)
        if not 0 <= self.seed < limit:
            raise DataError(f"data.seed must be in [0, {limit}), got {self.seed}")
        return self


class PackedBatches:
    """Random windows of ``seq_len + 1`` tokens from a packed token stream."""

    def __init__(self, streams: TokenStreams, seq_len: int, batch_size: int, seed: int = 0):
        self.streams, self.seq_len, self.batch_size, self.seed = streams, seq_len, batch_size, seed
        self._fingerprint: str | None = None  # (fingerprint(): computed once, when first asked for)
        for name, stream in (("training", streams.train), ("validation", streams.val)):
            if stream.numel() < seq_len + 2:
                raise DataError(
                    f"{name} split has {stream.numel()} tokens, fewer than seq_len+2 = {seq_len + 2}; "
                    "use a larger corpus or a shorter seq_len"
                )

    @classmethod
    def from_config(cls, cfg: DataConfig) -> PackedBatches:
        if cfg.seq_len <= 0 or cfg.batch_size <= 0:
            raise DataError(f"data.seq_len and data.batch_size must be > 0, got {cfg.seq_len}, {cfg.batch_size}")
        streams = load_corpus(cfg.source, cfg.val_fraction, cfg.max_bytes or None)
        return cls(streams, cfg.seq_len, cfg.batch_size, cfg.seed)

    def fingerprint(self) -> str:
        """sha256 of the token streams (train, then validation): the corpus's contents, whatever path named it.
        A checkpoint records it, so a resume on another corpus (a file replaced, a folder grown) is refused."""
        if self._fingerprint is None:
            import hashlib

            h = hashlib.sha256()
            for stream in (self.streams.train, self.streams.val):
                h.update(str(stream.numel()).encode() + b"\0")
                h.update(stream.contiguous().numpy().tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def _windows(self, stream: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts.unsqueeze(1) + torch.arange(self.seq_len + 1)
        rows = stream[idx].long()
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def global_starts(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * _STEP_STRIDE + step)
        high = self.streams.train.numel() - self.seq_len - 1
        return torch.randint(0, high, (self.batch_size,), generator=g)

    def batch(self, step: int, rank: int = 0, world_size: int = 1, micro: int = 0, n_micro: int = 1):
        """(inputs, targets) of shape (batch_size / world_size / n_micro, seq_len) for this slice."""
        parts = world_size * n_micro
        if self.batch_size % parts:
            raise DataError(
                f"global batch {self.batch_size} is not divisible by world_size*grad_accum = {parts}"
            )
        per = self.batch_size // parts
        first = (rank * n_micro + micro) * per
        return self._windows(self.streams.train, self.global_starts(step)[first : first + per])

    def val_batches(self, n_batches: int, batch_size: int | None = None):
        """A fixed validation set: the same windows every time it is asked for."""
        bs = batch_size or self.batch_size
        g = torch.Generator().manual_seed(self.seed * _STEP_STRIDE - 1)
        high = self.streams.val.numel() - self.seq_len - 1
        for _ in range(n_batches):
            yield self._windows(self.streams.val, torch.randint(0, high, (bs,), generator=g))
