"""Text sources: a file, a directory, a glob, or the built-in default corpus ``stdlib`` (the running
Python's standard-library source files: always present, tens of MB, no download).

Documents are split into train / validation by a hash of their path, so the split does not depend on
which other files exist. A corpus of too few documents for that (fewer than ``1 / val_fraction``, or a hash
split that leaves either side empty: one text file, say) is split by bytes instead: the last
``val_fraction`` of every document is held out for validation. Relies on the standard library only
(pathlib, glob, sysconfig, zlib).
"""

from __future__ import annotations

import glob
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from trainguard.data.tokenizer import EOS
from trainguard.errors import DataError

STDLIB = "stdlib"


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "dist-packages")
    return sorted(p for p in root.rglob("*.py") if not any(s in p.parts for s in skip))


def resolve_files(source: str, suffixes: tuple[str, ...] = (".py", ".txt", ".md", ".rst")) -> list[Path]:
    """The files a source names, sorted; DataError if it names nothing readable."""
    if source == STDLIB:
        files = stdlib_files()
    elif any(ch in source for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(source, recursive=True) if Path(p).is_file())
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise DataError(f"corpus not found: {source}")
        if path.is_file():
            files = [path]
        else:
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes)
    if not files:
        raise DataError(f"corpus {source!r} contains no text files")
    return files


@dataclass
class TokenStreams:
    train: torch.Tensor  # int16 token ids (vocab 258 fits), documents separated by EOS
    val: torch.Tensor
    n_files: int


def load_corpus(source: str = STDLIB, val_fraction: float = 0.02, max_bytes: int | None = None) -> TokenStreams:
    """Read every file once, byte-tokenize, and split into train/val: documents by path hash, or the bytes
    within each document when there are too few documents (see the module docstring)."""
    files = resolve_files(source)
    docs: list[tuple[Path, bytes]] = []
    total = 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError as err:
            raise DataError(f"cannot read corpus file {path}: {err.strerror}") from None
        if not data:
            continue
        docs.append((path, data))
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    if not docs:
        raise DataError(f"corpus {source!r} holds only empty files")
    train_parts, val_parts = split_documents(docs, val_fraction)
    return TokenStreams(train=_join(train_parts), val=_join(val_parts), n_files=len(files))


def split_documents(docs: list[tuple[Path, bytes]], val_fraction: float) -> tuple[list[bytes], list[bytes]]:
    """(train, val) parts: whole documents by path hash, or each document's tail when there are too few."""
    if val_fraction <= 0:
        return [d for _, d in docs], []
    train_parts: list[bytes] = []
    val_parts: list[bytes] = []
    for path, data in docs:
        bucket = zlib.crc32(path.name.encode() + str(len(data)).encode()) % 10_000
        (val_parts if bucket < val_fraction * 10_000 else train_parts).append(data)
    if len(docs) >= 1 / val_fraction and train_parts and val_parts:
        return train_parts, val_parts
    train_parts, val_parts = [], []
    for _, data in docs:
        cut = len(data) - max(1, round(len(data) * val_fraction))
        if cut > 0:
            train_parts.append(data[:cut])
        val_parts.append(data[cut:])
    return train_parts, val_parts


def _join(parts: list[bytes]) -> torch.Tensor:
    if not parts:
        return torch.empty(0, dtype=torch.int16)
    sep = bytes([0])  # placeholder byte, replaced by EOS below
    blob = sep.join(parts) + sep
    ids = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(torch.int16)
    ends = torch.tensor([0] + [len(p) + 1 for p in parts]).cumsum(0)[1:] - 1
    ids[ends] = EOS
    return ids
