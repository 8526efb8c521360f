"""metrics.jsonl: a Ctrl-C landing inside a flush leaves the pending records as they were, so the flush at
close writes each record once (it used to find half-converted records and end in an AttributeError traceback)."""

import json

import pytest
import torch

from trainguard.train import metrics as metrics_mod
from trainguard.train.metrics import MetricsLogger


@pytest.mark.parametrize("where", ["peak_memory_mb", "write"])
def test_an_interrupt_inside_a_flush_loses_no_record_and_writes_none_twice(tmp_path, monkeypatch, where):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLogger(path, total_steps=10, log_every=100, progress=False)
    for step in range(1, 4):
        log.record(step, torch.tensor(2.0 + step), torch.tensor(0.5), 1e-3, 64, 0.01)
    calls = {"n": 0}
    if where == "peak_memory_mb":
        real = metrics_mod.peak_memory_mb

        def interrupted(device):
            calls["n"] += 1
            if calls["n"] == 1:
                raise KeyboardInterrupt
            return real(device)

        monkeypatch.setattr(metrics_mod, "peak_memory_mb", interrupted)
    else:
        real_write = log._fh.write

        class Interrupting:
            def write(self, text):
                calls["n"] += 1
                real_write(text)  # (written, and the Ctrl-C comes as the call returns)
                if calls["n"] == 1:
                    raise KeyboardInterrupt

            def flush(self):
                log_fh.flush()

            def close(self):
                log_fh.close()

        log_fh = log._fh
        log._fh = Interrupting()
    with pytest.raises(KeyboardInterrupt):
        log.flush()
    log.close()
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert [json.loads(line)["loss"] for line in path.read_text().splitlines()] == [3.0, 4.0, 5.0]
