"""Corpus splits: documents by path hash when there are enough of them, bytes within documents otherwise
(a corpus of one text file trains and validates)."""

from pathlib import Path

import pytest

from trainguard.config import load_config
from trainguard.data import DataConfig, PackedBatches, load_corpus
from trainguard.errors import DataError


def test_one_text_file_trains_and_validates(tmp_path):
    f = tmp_path / "book.txt"
    f.write_text("".join(f"sentence {i} of the only document.\n" for i in range(400)))
    streams = load_corpus(str(f), val_fraction=0.05)
    n = f.stat().st_size
    assert streams.train.numel() + streams.val.numel() == n + 2  # every byte once, plus one EOS per part
    assert abs(streams.val.numel() - 1 - round(0.05 * n)) <= 1
    batches = PackedBatches.from_config(DataConfig(source=str(f), seq_len=64, batch_size=4, val_fraction=0.05))
    x, y = batches.batch(0)
    assert x.shape == (4, 64) and next(batches.val_batches(1))[0].shape == (4, 64)


def test_one_file_corpus_through_the_trainer(tmp_path):
    from trainguard.train import Trainer

    f = tmp_path / "notes.md"
    f.write_text("".join(f"- item {i}: keep training correct\n" for i in range(300)))
    cfg = load_config(None, ["--data.source", str(f), "--data.seq_len", "32", "--data.batch_size", "4",
                             "--model.dim", "32", "--model.n_heads", "2", "--model.ffn_hidden", "64",
                             "--model.n_layers", "1", "--train.steps", "2", "--train.eval_every", "2",
                             "--train.eval_batches", "1", "--output.dir", "", "--output.progress", "false"])
    summary = Trainer(cfg).run()
    assert summary.steps_run == 2 and summary.val_loss is not None


def test_many_documents_are_split_whole_by_path(tmp_path):
    from trainguard.data.corpus import split_documents

    docs = [(Path(f"doc{i}.txt"), f"document {i}\n".encode() * 20) for i in range(400)]
    train, val = split_documents(docs, 0.05)
    assert len(train) + len(val) == 400 and 0 < len(val) < 60
    assert set(val) <= {d for _, d in docs}  # whole documents


def test_few_documents_are_split_within_each(tmp_path):
    from trainguard.data.corpus import split_documents

    docs = [(Path(f"doc{i}.txt"), bytes([65 + i]) * 1000) for i in range(3)]
    train, val = split_documents(docs, 0.1)
    assert [len(p) for p in train] == [900] * 3 and [len(p) for p in val] == [100] * 3
    assert all(t + v == d for t, v, (_, d) in zip(train, val, docs))


def test_a_corpus_of_empty_files_is_one_line(tmp_path):
    (tmp_path / "a.txt").write_text("")
    with pytest.raises(DataError, match="holds only empty files"):
        load_corpus(str(tmp_path))
