"""Data: byte tokenizer, text corpora (default: the Python standard library's source), packed batches."""

from trainguard.data.batches import DataConfig, PackedBatches
from trainguard.data.corpus import STDLIB, TokenStreams, load_corpus, resolve_files
from trainguard.data.tokenizer import BOS, EOS, VOCAB_SIZE, ByteTokenizer

__all__ = [
    "BOS", "EOS", "STDLIB", "VOCAB_SIZE", "ByteTokenizer", "DataConfig", "PackedBatches", "TokenStreams",
    "load_corpus", "resolve_files",
]
