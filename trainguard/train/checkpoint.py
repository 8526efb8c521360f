"""Crash-safe training checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout: ``<dir>/step_00000120/`` holds DCP's files (``.metadata``, ``__<rank>_0.distcp``), the trainer
state (``trainer.pt``: scheduler, RNG, registered components) and ``manifest.json`` (step, run id, config,
per-file sizes and a sha256 over every file's bytes). A checkpoint is written into
``<dir>/.tmp-step_.../`` and only becomes visible through one atomic ``os.rename`` after the manifest is
written, so a save that dies midway never replaces or damages the previous good checkpoint. ``load``
re-hashes the files and refuses a checkpoint whose bytes do not match its manifest with a one-line
``CheckpointError``. The manifest is sealed too (``manifest_sha256`` over its own content) and its shape is
checked (step, file list, config), so a flipped bit or an edit there is a corrupt checkpoint, not a traceback
or a resume checked against the wrong config; a manifest of a newer format is a ``NewerFormatError``
(refused, never set aside as corrupt).

A folder belongs to one run: every manifest names the ``run_id`` that wrote it. Pruning (``keep``) runs
only after a commit, only among the checkpoints of the run that saved, and never removes the one just
written; a pruned checkpoint is first renamed out of sight (``.del-step_...``) so a process killed while
deleting never leaves a half-deleted checkpoint that looks committed. A checkpoint of another run is never
overwritten; replacing one of the same run and step says so. An entry named like a checkpoint that is not one
(no manifest, a file: no save leaves one) is never deleted: it is renamed ``*.incomplete`` with a warning. A save
at step s renames this run's checkpoints of later steps ``*.superseded`` (a resume went back before them).
While a run uses the folder, its processes are the only ones that do (the trainer takes ``run_lock``'s lock
first), so the half-written saves a save clears away are truly a dead process's.

``trainer.pt`` holds tensors and plain Python values only and is read with ``torch.load(weights_only=True)``:
a checkpoint received from someone else cannot run code when it is loaded (checked again at save time, so
a component whose state would not load is reported when it is saved, not when the run is resumed).

Works in a single process without a process group (DCP's single-process mode) and under DDP / pipeline
parallelism (every rank calls ``save``/``load``; replicated tensors are written once). Failures become
one-line ``CheckpointError`` s (a full disk is named as such); Ctrl-C during a write stays a
``KeyboardInterrupt``. Relies on torch.distributed.checkpoint.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from trainguard.errors import CheckpointError

FORMAT = "trainguard-dcp-2"
# Optimizer state flattened to one key per parameter name (TorchTitan's choice): pipeline stages hold
# different parameters, and an unflattened ``param_groups`` list would be one key that every stage writes.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer.pt"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")  # (a step past 99,999,999 gets a ninth digit)
_FORMAT_VERSION = re.compile(r"^trainguard-dcp-(\d+)$")
_FORMAT_NUMBER = int(_FORMAT_VERSION.match(FORMAT).group(1))


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _barrier() -> None:
    if _dist_on():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def _stderr_note(text: str) -> None:
    sys.stderr.write(f"trainguard: note: {text}\n")


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


def manifest_digest(manifest: dict) -> str:
    """sha256 of a manifest's own content (every key but ``manifest_sha256``), as JSON with sorted keys."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    text = json.dumps(json.loads(json.dumps(body, default=str)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def seal_manifest(manifest: dict) -> dict:
    """``manifest`` with ``manifest_sha256`` set: an edit or a flipped bit in the manifest (its config, its
    step) is then found like one in the files it lists."""
    out = json.loads(json.dumps({k: v for k, v in manifest.items() if k != "manifest_sha256"}, default=str))
    out["manifest_sha256"] = manifest_digest(out)
    return out


def write_manifest(path: Path, step: int, config: dict | None, extra: dict | None = None) -> dict:
    names = _payload_files(path)
    manifest = seal_manifest({
        "format": FORMAT,
        "step": int(step),
        "created": time.time(),
        "files": {n: (path / n).stat().st_size for n in names},
        "sha256": checksum(path, names),
        "config": config,
        **(extra or {}),
    })
    tmp = path / (MANIFEST + ".part")
    with open(tmp, "w") as fh:
        json.dump(manifest, fh, indent=1, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path / MANIFEST)
    return manifest


def read_manifest(path: str | Path) -> dict | None:
    """The manifest of a checkpoint folder without checking its files (None when unreadable)."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


class NewerFormatError(CheckpointError):
    """A checkpoint written by a newer trainguard: refused (not taken for a corrupt one and set aside)."""


def _check_manifest(path: Path, manifest: Any) -> dict:
    """The manifest's own shape: its format, step, file list and checksums (CheckpointError naming what is wrong)."""
    if not isinstance(manifest, dict):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not a JSON object")
    fmt = manifest.get("format")
    version = _FORMAT_VERSION.match(fmt) if isinstance(fmt, str) else None
    if version and int(version.group(1)) > _FORMAT_NUMBER:
        raise NewerFormatError(f"checkpoint {path} was written by a newer trainguard (format {fmt}; this version "
                               f"reads {FORMAT}): upgrade trainguard to load it, or resume an "
                               "older step with --checkpoint.resume_step")
    if fmt != FORMAT:
        raise CheckpointError(f"checkpoint {path}: unknown format {fmt!r} (expected {FORMAT})")
    sealed = manifest.get("manifest_sha256")
    if sealed is not None and sealed != manifest_digest(manifest):  # (manifests of older versions are not sealed)
        raise CheckpointError(f"checkpoint {path} is corrupted: {MANIFEST} does not match its own sha256")
    step, files = manifest.get("step"), manifest.get("files")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"checkpoint {path} is corrupted: {MANIFEST} has step {step!r}, not a step number")
    named = _STEP_DIR.match(path.name)
    if named and int(named.group(1)) != step:
        raise CheckpointError(f"checkpoint {path} is corrupted: {MANIFEST} says step {step}, its folder another")
    if (not isinstance(files, dict) or not files
            or not all(isinstance(n, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                       and not Path(n).is_absolute() and ".." not in Path(n).parts for n, v in files.items())):
        raise CheckpointError(f"checkpoint {path} is corrupted: {MANIFEST} has no valid file list")
    if not isinstance(manifest.get("sha256"), str):
        raise CheckpointError(f"checkpoint {path} is corrupted: {MANIFEST} has no sha256")
    if manifest.get("config") is not None and not isinstance(manifest["config"], dict):
        raise CheckpointError(f"checkpoint {path} is corrupted: {MANIFEST}'s config is not a table")
    return manifest


def verify(path: str | Path) -> dict:
    """The manifest of a complete, uncorrupted checkpoint; CheckpointError otherwise (``NewerFormatError`` for
    one written by a newer trainguard)."""
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
    files = _check_manifest(path, manifest)["files"]
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


# ---- errors ----------------------------------------------------------------------------------------
def _causes(err: BaseException) -> list[BaseException]:
    """``err``, the per-rank exceptions DCP wrapped into it, and their causes / contexts."""
    out: list[BaseException] = []
    todo = [err]
    while todo:
        e = todo.pop(0)
        if e is None or any(e is o for o in out):
            continue
        out.append(e)
        if isinstance(e, CheckpointException):
            for wrapped in e.failures.values():
                todo.append(wrapped[0] if isinstance(wrapped, tuple) else wrapped)
        todo += [e.__cause__, e.__context__]
    return out


def _first_line(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror:
        return err.strerror + (f": {err.filename}" if err.filename else "")
    text = str(err).strip()
    if isinstance(err, CheckpointException):
        return "DCP failed"
    line = text.splitlines()[0].strip() if text else type(err).__name__
    return line if len(line) < 200 else line[:197] + "..."


def _interrupted(err: BaseException) -> bool:
    return any(isinstance(e, KeyboardInterrupt) for e in _causes(err))


def save_error(err: BaseException, directory: Path, step: int, needed_bytes: int = 0) -> CheckpointError:
    """A one-line error for a failed save: a full disk is named as such (torch's zip writer reports
    ENOSPC as ``unexpected pos``, so free space is checked too)."""
    causes = _causes(err)
    oserr = next((e for e in causes if isinstance(e, OSError) and e.errno is not None), None)
    try:
        free = shutil.disk_usage(directory if directory.exists() else directory.parent).free
    except OSError:
        free = None
    full = (oserr is not None and oserr.errno in (errno.ENOSPC, errno.EDQUOT)) or (
        free is not None and free < max(needed_bytes, 1 << 20))
    where = f"cannot write checkpoint step {step} in {directory}"
    if full:
        shown = f" ({free / 2**20:.1f} MiB free)" if free is not None else ""
        return CheckpointError(f"{where}: no space left on device{shown}")
    detail = _first_line(oserr) if oserr is not None else _first_line(next(
        (e for e in causes if not isinstance(e, CheckpointException)), err))
    return CheckpointError(f"{where}: {detail}")


def _plain_check(buf: bytes) -> None:
    """Refuse (at save time) trainer state that a weights-only load would refuse."""
    try:
        torch.load(io.BytesIO(buf), map_location="cpu", weights_only=True)
    except Exception as err:
        msg = str(err).strip().splitlines()
        hint = next((line.strip() for line in msg if "GLOBAL" in line or "Unsupported" in line), msg[0] if msg else "")
        raise CheckpointError(f"trainer state cannot be saved: it holds values a weights-only load refuses "
                              f"({hint[:160]}); registered components must keep tensors and plain Python types") from None


def _numpy_globals() -> list:
    """The three numpy globals an RNG state saved by older trainguard versions needs (no others)."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return []
    core = getattr(np, "_core", None) or np.core
    return [np.dtype, np.ndarray, core.multiarray._reconstruct]


def load_trainer_state(path: Path) -> dict:
    """``trainer.pt`` with ``weights_only=True`` (older checkpoints' numpy RNG arrays allowed, nothing else)."""
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            extra = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=True)
    except Exception as err:
        lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
        why = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), lines[0] if lines else "")
        raise CheckpointError(f"checkpoint {path}: refusing {TRAINER_STATE}: it is not plain tensors and values "
                              f"({why[:200]})") from None
    if not isinstance(extra, dict):
        raise CheckpointError(f"checkpoint {path}: {TRAINER_STATE} does not hold a dict")
    return extra


def _set_aside(path: Path, suffix: str) -> Path:
    """Rename a checkpoint folder out of the way (``step_00000030.corrupt``), never deleting it."""
    target = path.with_name(f"{path.name}.{suffix}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.{suffix}-{n}")
        n += 1
    os.rename(path, target)
    return target


class CheckpointManager:
    """Save / find / load the checkpoints of one run in one directory, keeping the ``keep`` newest.

    ``run_id`` names the run that saves: it is written into every manifest, and pruning only ever
    touches checkpoints of that run. ``note`` receives one-line notices (replacing a checkpoint)."""

    def __init__(self, directory: str | Path, keep: int = 2, run_id: str | None = None,
                 note: Callable[[str], None] | None = None):
        if not str(directory):
            raise CheckpointError("checkpoint directory is empty")
        self.dir = Path(directory)
        self.keep = max(1, int(keep))
        self.run_id = run_id
        self.note = note if note is not None else _stderr_note

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

    def run_of(self, path: Path) -> str | None:
        m = read_manifest(path)
        return m.get("run_id") if m else None

    def owned(self, path: Path, run_id: str | None = None) -> bool:
        """Whether ``path`` was written by ``run_id`` (checkpoints of versions without run ids count as owned)."""
        rid = self.run_of(path)
        return rid is None or rid == (run_id or self.run_id)

    def newest_intact(self, step: int | None = None) -> tuple[Path | None, dict | None, list[tuple[Path, str]]]:
        """(path, manifest) of the newest checkpoint that verifies (of ``step`` when given), and the newer
        ones that did not, with the reason: [(path, one-line reason)]."""
        bad: list[tuple[Path, str]] = []
        for s, p in reversed(self.checkpoints()):
            if step is not None and s != step:
                continue
            try:
                return p, verify(p), bad
            except NewerFormatError:
                raise  # not damaged: refused, never set aside for an older one
            except CheckpointError as err:
                bad.append((p, str(err)))
        return None, None, bad

    def strays(self) -> list[Path]:
        """Entries named like a checkpoint that are not one: a folder without ``manifest.json`` (or with
        something else in its place), a file. A save commits only after its manifest, so these are not this
        tool's; they are never deleted, only set aside (:meth:`set_aside_strays`)."""
        if not self.dir.is_dir():
            return []
        return sorted(p for p in self.dir.iterdir()
                      if _STEP_DIR.match(p.name) and not (p.is_dir() and (p / MANIFEST).is_file()))

    def set_aside_strays(self) -> list[tuple[Path, Path]]:
        """Rename every stray (see :meth:`strays`) to ``<name>.incomplete``: [(was, now)]."""
        return [(p, _set_aside(p, "incomplete")) for p in self.strays()]

    def set_aside(self, path: Path, why: str) -> Path:
        """Rename a checkpoint out of the run (``why``: corrupt, superseded); it is kept for inspection."""
        return _set_aside(path, why)

    def recover(self) -> None:
        """Undo a same-step replacement that died between its two renames (main rank, before use)."""
        if not self.dir.is_dir():
            return
        for old in self.dir.glob(".old-step_*"):
            name = old.name[len(".old-"):].rsplit("-", 1)[0]
            final = self.dir / name
            if _STEP_DIR.match(name) and not final.exists():
                os.rename(old, final)
            else:
                shutil.rmtree(old, ignore_errors=True)

    # ---- save ------------------------------------------------------------------------------------
    def save(self, step: int, model, optimizer=None, scheduler=None, config: dict | None = None,
             trainer_state: dict | None = None, extra_manifest: dict | None = None) -> Path:
        final = self.path_for(step)
        tmp = self.dir / f".tmp-{final.name}"
        rank = _rank()
        if final.exists() and self.run_id is not None:  # every rank checks, so every rank refuses together
            other = self.run_of(final)
            if other is not None and other != self.run_id:
                raise CheckpointError(f"refusing to overwrite {final}: it belongs to run {other}, not to this run "
                                      f"({self.run_id})")
        try:
            if rank == 0:
                self.dir.mkdir(parents=True, exist_ok=True)
                self.recover()
                for stale in [*self.dir.glob(".tmp-*"), *self.dir.glob(".del-*")]:  # left by a process that died
                    shutil.rmtree(stale, ignore_errors=True)
                tmp.mkdir()
        except OSError as err:
            raise save_error(err, self.dir, step) from None
        _barrier()
        state: dict[str, Any] = {}
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
                _plain_check(buf.getvalue())
                with open(tmp / TRAINER_STATE, "wb") as fh:
                    fh.write(buf.getvalue())
                    fh.flush()
                    os.fsync(fh.fileno())
                write_manifest(tmp, step, config, {"run_id": self.run_id, **(extra_manifest or {})})
                self._supersede_later(step)
                self._commit(tmp, final)
                self._prune(final)
        except BaseException as err:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(err, CheckpointError):
                raise
            if isinstance(err, KeyboardInterrupt) or _interrupted(err):
                raise KeyboardInterrupt from None
            if isinstance(err, (OSError, RuntimeError, CheckpointException)):
                failed = save_error(err, self.dir, step, _nbytes(state))
                previous = self.latest()
                if previous is not None:
                    failed = CheckpointError(f"{failed}; the previous checkpoint {previous.name} is intact")
                raise failed from None
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

    def supersede_later(self, step: int, run_id: str | None = None) -> list[int]:
        """Rename the checkpoints of run ``run_id`` (default: this manager's) of steps after ``step`` to
        ``*.superseded``; returns their steps. A run that goes back to ``step`` (a resume from an earlier step)
        abandons them: they belong to a history it left."""
        later = [(s, p) for s, p in self.checkpoints() if s > step and self.owned(p, run_id)]
        for _, p in reversed(later):  # newest first: a kill midway leaves an older prefix of that history
            _set_aside(p, "superseded")
        return [s for s, _ in later]

    def _supersede_later(self, step: int) -> None:
        """At each save: for a resume that set nothing aside (one already finished, then trained on through the
        Python API; elastic replicas, whose resume plan reads only)."""
        later = self.supersede_later(step)
        if later:
            self.note(f"saving step {step} of a run resumed from an earlier step: its later checkpoints (steps "
                      f"{', '.join(map(str, later))}) were renamed to *.superseded (not deleted)")

    def _commit(self, tmp: Path, final: Path) -> None:
        if os.path.lexists(final) and read_manifest(final) is None:
            # not a checkpoint (no readable manifest, a file; another run's was refused in save): never deleted
            moved = _set_aside(final, "incomplete")
            self.note(f"warning: {final} was not a checkpoint of this run; moved to {moved.name}")
        if final.exists():  # the same run saving the same step again: move the old one aside, never delete it first
            self.note(f"replacing checkpoint {final} (saved earlier by this run)")
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

    def _prune(self, just_written: Path) -> None:
        """Delete this run's oldest checkpoints beyond ``keep`` (never ``just_written``, never another run's)."""
        mine = [p for _, p in self.checkpoints() if p != just_written and self.owned(p)]
        for p in mine[: max(0, len(mine) - (self.keep - 1))]:
            gone = self.dir / f".del-{p.name}"
            try:
                os.rename(p, gone)  # out of sight first: a kill while deleting leaves no half checkpoint
            except OSError:
                continue
            shutil.rmtree(gone, ignore_errors=True)

    # ---- load ------------------------------------------------------------------------------------
    def load(self, path: str | Path | None, model, optimizer=None, scheduler=None) -> dict:
        """Load ``path`` (None: the latest) into model/optimizer/scheduler; returns the manifest with
        ``trainer_state`` (RNG, components, ...) added. CheckpointError when missing or corrupted."""
        if path is None:
            path = self.latest()
            if path is None:
                raise CheckpointError(f"no checkpoint in {self.dir}")
        return load_checkpoint(path, model, optimizer, scheduler)


def _nbytes(state: dict) -> int:
    total = 0
    stack: list[Any] = [state]
    while stack:
        v = stack.pop()
        if torch.is_tensor(v):
            total += v.numel() * v.element_size()
        elif isinstance(v, dict):
            stack += list(v.values())
        elif isinstance(v, (list, tuple)):
            stack += list(v)
    return total


def load_checkpoint(path: str | Path, model, optimizer=None, scheduler=None, manifest: dict | None = None) -> dict:
    """Load a checkpoint into ``model`` / ``optimizer`` / ``scheduler``; returns its manifest with
    ``trainer_state`` and ``path`` added. ``manifest``: one already verified (skips the re-hash)."""
    path = Path(path)
    manifest = dict(manifest) if manifest is not None else verify(path)
    extra = load_trainer_state(path)
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
        except KeyboardInterrupt:
            raise
        except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
            if _interrupted(err):
                raise KeyboardInterrupt from None
            cause = next((e for e in _causes(err) if not isinstance(e, CheckpointException)), err)
            raise CheckpointError(f"checkpoint {path} does not match this model/optimizer: {_first_line(cause)}") from None
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
