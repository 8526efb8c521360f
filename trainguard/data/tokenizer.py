"""Byte-level tokenizer: no vocabulary file, nothing to download. Ids 0-255 are bytes."""

from __future__ import annotations

import torch

BOS = 256
EOS = 257
VOCAB_SIZE = 258


class ByteTokenizer:
    vocab_size = VOCAB_SIZE
    bos_id = BOS
    eos_id = EOS

    def encode(self, text: str | bytes, bos: bool = False, eos: bool = False) -> torch.Tensor:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64) if data else torch.empty(0, dtype=torch.int64)
        parts = ([torch.tensor([BOS])] if bos else []) + [ids] + ([torch.tensor([EOS])] if eos else [])
        return torch.cat(parts)

    def decode(self, ids) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
