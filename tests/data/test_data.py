"""Data: batches are a pure function of (seed, step, rank); DP slices tile the global batch."""

import pytest
import torch

from trainguard.data import ByteTokenizer, DataConfig, PackedBatches, load_corpus
from trainguard.errors import DataError

CFG = DataConfig(seq_len=32, batch_size=8, max_bytes=1_000_000, seed=3)


@pytest.fixture(scope="module")
def batches():
    return PackedBatches.from_config(CFG)


def test_batches_are_pure_functions_of_seed_and_step(batches):
    again = PackedBatches(batches.streams, CFG.seq_len, CFG.batch_size, CFG.seed)
    for step in (0, 5, 1234):
        x1, y1 = batches.batch(step)
        x2, y2 = again.batch(step)
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    x5, _ = batches.batch(5)
    batches.batch(6)
    assert torch.equal(batches.batch(5)[0], x5)  # no hidden cursor
    assert not torch.equal(batches.batch(0)[0], batches.batch(1)[0])
    other = PackedBatches(batches.streams, CFG.seq_len, CFG.batch_size, seed=4)
    assert not torch.equal(other.batch(0)[0], batches.batch(0)[0])


def test_targets_are_inputs_shifted(batches):
    x, y = batches.batch(2)
    assert x.shape == (8, 32) and y.shape == (8, 32) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_dp_and_micro_slices_tile_the_global_batch(batches):
    gx, gy = batches.batch(7)
    for world, n_micro in ((2, 1), (4, 1), (2, 2), (1, 4)):
        parts = [batches.batch(7, r, world, m, n_micro) for r in range(world) for m in range(n_micro)]
        assert torch.equal(torch.cat([p[0] for p in parts]), gx)
        assert torch.equal(torch.cat([p[1] for p in parts]), gy)
    with pytest.raises(DataError):
        batches.batch(0, 0, 3)


def test_validation_batches_are_fixed(batches):
    a = [x for x, _ in batches.val_batches(2)]
    b = [x for x, _ in batches.val_batches(2)]
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_missing_and_too_small_corpus(tmp_path):
    with pytest.raises(DataError, match="corpus not found"):
        PackedBatches.from_config(DataConfig(source=str(tmp_path / "nope")))
    (tmp_path / "small.txt").write_text("tiny")
    with pytest.raises(DataError, match="fewer than"):
        PackedBatches.from_config(DataConfig(source=str(tmp_path / "small.txt"), seq_len=64))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no text files"):
        load_corpus(str(tmp_path / "empty"))


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x ** 2  # ünïcode ✓\n"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and int(ids.max()) < tok.vocab_size
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode("")) == ""
