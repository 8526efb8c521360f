"""A folder on a full disk for tests: a small tmpfs when this process may mount one (root on Linux), else
the same failure simulated: every file DCP opens for writing below the folder fails with ENOSPC."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from pathlib import Path


class FullDisk:
    def __init__(self, path: Path, monkeypatch, real: bool = True):
        self.path = path
        self.real = False
        self._monkeypatch = monkeypatch
        path.mkdir(parents=True, exist_ok=True)
        if real and os.geteuid() == 0 and shutil.which("mount"):
            ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(path)], capture_output=True)
            self.real = ok.returncode == 0

    def fill(self, leave: int = 256 * 1024) -> None:
        """Leave about ``leave`` bytes free (real) / make DCP's writes fail with ENOSPC (simulated)."""
        if self.real:
            free = shutil.disk_usage(self.path).free
            with open(self.path / "filler", "wb") as fh:
                fh.write(b"\0" * max(0, free - leave))
            return
        from torch.distributed.checkpoint import filesystem

        real_create = filesystem.FileSystem.create_stream
        root = str(self.path)

        @contextlib.contextmanager
        def create_stream(fs, path, mode):
            if "w" in mode and str(path).startswith(root):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            with real_create(fs, path, mode) as stream:
                yield stream

        self._monkeypatch.setattr(filesystem.FileSystem, "create_stream", create_stream)

    def close(self) -> None:
        if self.real:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
