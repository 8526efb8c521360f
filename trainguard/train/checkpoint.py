"""Crash-safe training checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout: ``<dir>/step_00000120/`` holds DCP's files (``.metadata``, ``__<rank>_0.distcp``), the trainer
state (``trainer.pt``: scheduler, RNG, data cursor) and ``manifest.json`` (step, config, per-file sizes
and a sha256 over every file's bytes). A checkpoint is written into ``<dir>/.tmp-step_.../`` and only
becomes visible through one atomic ``os.rename`` after the manifest is written, so a save that dies
midway never replaces or damages the previous good checkpoint. Old checkpoints are pruned (``keep``)
only after the new one is committed. ``load`` re-hashes the files and refuses a checkpoint whose bytes
do not match its manifest with a one-line ``CheckpointError``.

Works in a single process without a process group (DCP's single-process mode) and under DDP (every
rank calls ``save``/``load``; replicated tensors are written once). Relies on torch.distributed.checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from trainguard.errors import CheckpointError

FORMAT = "trainguard-dcp-2"
# Optimizer state flattened to one key per parameter name (TorchTitan's choice): pipeline stages hold
# different parameters, and an unflattened ``param_groups`` list would be one key that every stage writes.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer.pt"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _barrier() -> None:
    if _dist_on():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def checksum(path: Path, names: list[str]) -> str:
    """sha256 over (name, size, bytes) of each file, in the given (sorted) order."""
    h = hashlib.sha256()
    for name in names:
        f = path / name
        h.update(name.encode() + b"\0" + str(f.stat().st_size).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _payload_files(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(path: Path, step: int, config: dict | None, extra: dict | None = None) -> dict:
    names = _payload_files(path)
    manifest = {
        "format": FORMAT,
        "step": int(step),
        "created": time.time(),
        "files": {n: (path / n).stat().st_size for n in names},
        "sha256": checksum(path, names),
        "config": config,
        **(extra or {}),
    }
    tmp = path / (MANIFEST + ".part")
    with open(tmp, "w") as fh:
        json.dump(manifest, fh, indent=1, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path / MANIFEST)
    return manifest


def verify(path: str | Path) -> dict:
    """The manifest of a complete, uncorrupted checkpoint; CheckpointError otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint not found: {path}")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: no {MANIFEST}")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not valid JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: unknown format (expected {FORMAT})")
    files = manifest.get("files", {})
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: missing {name}")
        if f.stat().st_size != size:
            raise CheckpointError(f"checkpoint {path} is corrupted: {name} has {f.stat().st_size} bytes, manifest says {size}")
    names = sorted(files)
    if set(names) != set(_payload_files(path)):
        raise CheckpointError(f"checkpoint {path}: files differ from its manifest")
    if checksum(path, names) != manifest.get("sha256"):
        raise CheckpointError(f"checkpoint {path} is corrupted: sha256 of its files does not match the manifest")
    return manifest


def _quiet():
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed.checkpoint")
    return ctx


class CheckpointManager:
    """Save / find / load checkpoints in one directory, keeping the ``keep`` newest."""

    def __init__(self, directory: str | Path, keep: int = 2):
        if not str(directory):
            raise CheckpointError("checkpoint directory is empty")
        self.dir = Path(directory)
        self.keep = max(1, int(keep))

    # ---- discovery -------------------------------------------------------------------------------
    def checkpoints(self) -> list[tuple[int, Path]]:
        """Committed checkpoints (those with a manifest), oldest first. Half-written temp dirs are ignored."""
        if not self.dir.is_dir():
            return []
        out = []
        for p in self.dir.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir() and (p / MANIFEST).is_file():
                out.append((int(m.group(1)), p))
        return sorted(out)

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1][1] if found else None

    def path_for(self, step: int) -> Path:
        return self.dir / f"step_{step:08d}"

    # ---- save ------------------------------------------------------------------------------------
    def save(self, step: int, model, optimizer=None, scheduler=None, config: dict | None = None,
             trainer_state: dict | None = None) -> Path:
        final = self.path_for(step)
        tmp = self.dir / f".tmp-{final.name}"
        rank = _rank()
        if rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            for stale in self.dir.glob(".tmp-*"):  # left by a save that died
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        try:
            ctx = _quiet()
            try:
                state = self._state(model, optimizer)
                dcp.save(state, checkpoint_id=str(tmp))
            finally:
                ctx.__exit__(None, None, None)
            _barrier()
            if rank == 0:
                extra = dict(trainer_state or {})
                if scheduler is not None:
                    extra["scheduler"] = scheduler.state_dict()
                extra["has_optimizer"] = "optim" in state
                buf = io.BytesIO()
                torch.save(extra, buf)
                with open(tmp / TRAINER_STATE, "wb") as fh:
                    fh.write(buf.getvalue())
                    fh.flush()
                    os.fsync(fh.fileno())
                write_manifest(tmp, step, config)
                self._commit(tmp, final)
                self._prune()
        except BaseException:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        _barrier()
        return final

    @staticmethod
    def _state(model, optimizer) -> dict[str, Any]:
        if optimizer is not None and optimizer.state:
            msd, osd = get_state_dict(model, optimizer, options=_OPTIONS)
            return {"model": msd, "optim": osd}
        # A fresh optimizer has no state; get_state_dict would initialise it (changing the run).
        return {"model": model.state_dict()}

    def _commit(self, tmp: Path, final: Path) -> None:
        if final.exists():  # re-saving the same step: move the old one aside, never delete it first
            aside = self.dir / f".old-{final.name}-{os.getpid()}"
            os.rename(final, aside)
            os.rename(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(tmp, final)
        try:  # make the rename durable
            fd = os.open(self.dir, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        except OSError:
            pass

    def _prune(self) -> None:
        found = self.checkpoints()
        for _, p in found[: max(0, len(found) - self.keep)]:
            shutil.rmtree(p, ignore_errors=True)

    # ---- load ------------------------------------------------------------------------------------
    def load(self, path: str | Path | None, model, optimizer=None, scheduler=None) -> dict:
        """Load ``path`` (None: the latest) into model/optimizer/scheduler; returns the manifest with
        ``trainer_state`` (RNG, cursor, ...) added. CheckpointError when missing or corrupted."""
        if path is None:
            path = self.latest()
            if path is None:
                raise CheckpointError(f"no checkpoint in {self.dir}")
        return load_checkpoint(path, model, optimizer, scheduler)


def load_checkpoint(path: str | Path, model, optimizer=None, scheduler=None) -> dict:
    path = Path(path)
    manifest = verify(path)
    try:
        extra = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False)
    except Exception as err:
        raise CheckpointError(f"checkpoint {path}: cannot read {TRAINER_STATE}: {err}") from None
    has_optim = bool(extra.get("has_optimizer")) and optimizer is not None
    ctx = _quiet()
    try:
        if has_optim:
            msd, osd = get_state_dict(model, optimizer, options=_OPTIONS)
            state = {"model": msd, "optim": osd}
        else:
            state = {"model": model.state_dict()}
        try:
            dcp.load(state, checkpoint_id=str(path))
        except Exception as err:
            msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CheckpointError(f"checkpoint {path} does not match this model/optimizer: {msg}") from None
        if has_optim:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_OPTIONS)
        else:
            model.load_state_dict(state["model"])
            if optimizer is not None:
                optimizer.state.clear()
    finally:
        ctx.__exit__(None, None, None)
    if scheduler is not None and "scheduler" in extra:
        scheduler.load_state_dict(extra["scheduler"])
        # LambdaLR restores its counters; put the matching lr back into the optimizer's groups too.
        for group, lr in zip(optimizer.param_groups if optimizer is not None else [], scheduler.get_last_lr()):
            group["lr"] = lr
    manifest["trainer_state"] = extra
    manifest["path"] = str(path)
    return manifest
