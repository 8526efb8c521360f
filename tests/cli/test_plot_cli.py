"""`trainguard plot RUN_DIR`: a PNG of loss, validation loss, throughput and fault events from metrics.jsonl;
bad run folders are one-line errors."""

import json

import pytest
import torch

from trainguard.cli.main import main
from trainguard.report.run_plot import read_run

torch.set_num_threads(1)


def _write(run, records):
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _records():
    out = []
    for s in range(1, 21):
        # ABFT counters are cumulative per process: they restart after the resume at step 10
        detected, corrected = (int(s >= 7), int(s >= 7)) if s <= 10 else (int(s >= 15), 0)
        out.append({"step": s, "loss": 5.0 - 0.1 * s, "tokens_per_s": 1000.0 + s, "lr": 1e-3,
                    "abft_AS_detected": detected, "abft_AS_corrected": corrected})
        if s == 9:
            out.append({"event": "retry", "step": 9, "action": "retry", "site": "loss"})
        if s == 10:
            out.append({"event": "eval", "step": 10, "val_loss": 3.5, "val_ppl": 33.1})
            out.append({"event": "checkpoint", "step": 10, "path": "ck/step_00000010"})
            out.append({"event": "resume", "step": 10, "path": "ck/step_00000010"})
        if s == 12:
            out[-1]["failed"] = [1]
        if s == 18:
            out.append({"event": "preempted", "step": 18, "signal": "SIGTERM"})
    return out


def test_plot_draws_a_png_and_counts_fault_events(tmp_path, capsys):
    run = tmp_path / "run"
    _write(run, _records())
    n = len(_records())
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 21, "loss": 1.')  # a line cut short by a crash is skipped, and said to be
    assert main(["plot", str(run), "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert result["skipped_lines"] == [n + 1]
    assert f"warning: metrics.jsonl: 1 line left out, not a record with an integer step (line {n + 1})" in captured.err
    png = run / "run.png"
    assert result["path"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["steps"] == 20 and result["first_step"] == 1 and result["evaluations"] == 1
    assert result["events"] == {"detections": 2, "corrections": 1, "retries": 1, "failovers": 1, "preemptions": 1}
    curves = read_run(run)
    assert curves.events["detections"] == [(7, 1), (15, 1)] and curves.val == [(10, 3.5)]


def test_plot_of_a_real_run_with_tensorboard(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["train", "--model.dim", "32", "--model.n_heads", "2", "--model.ffn_hidden", "64", "--model.n_layers", "1",
            "--data.max_bytes", "40000", "--data.seq_len", "16", "--data.batch_size", "4", "--train.steps", "4",
            "--train.eval_every", "2", "--train.eval_batches", "1", "--train.log_every", "1",
            "--output.progress", "false", "--output.dir", str(out), "--output.tensorboard", "true"]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(["plot", str(out), "--out", str(tmp_path / "fig" / "run.png"), "--json"]) == 0
    assert (tmp_path / "fig" / "run.png").is_file()
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["skipped_lines"] == [] and "warning" not in captured.err
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]  # steps counted as in metrics.jsonl
    assert [e.step for e in acc.Scalars("val/loss")] == [2, 4]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx(losses)


@pytest.mark.parametrize("setup, needle", [
    (lambda run: None, "run folder not found"),
    (lambda run: run.mkdir(), "has no metrics.jsonl"),
    (lambda run: _write(run, [{"event": "eval", "step": 2, "val_loss": 1.0}]), "holds no step records"),
])
def test_bad_run_folder_is_one_line_exit_2(tmp_path, capsys, setup, needle):
    run = tmp_path / "run"
    setup(run)
    assert main(["plot", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


def test_unwritable_output_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    _write(run, _records())
    (tmp_path / "file").write_text("x")
    assert main(["plot", str(run), "--out", str(tmp_path / "file" / "run.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write" in err[0]


def test_damaged_lines_are_left_out_and_named_not_skipped_in_silence(tmp_path, capsys):
    """Lines in the middle of metrics.jsonl that hold no record (damage, a stray write), or a record whose step is
    not an integer, are drawn without, and each is named by its line number; blank lines are no records."""
    run = tmp_path / "run"
    _write(run, _records()[:5])
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[1:1] = ["garbage\n", "\n", '[1, 2]\n']  # lines 2-4: not a record, blank, not an object
    lines.append('{"step": "six", "loss": 1.0}\n')  # line 9: no integer step
    (run / "metrics.jsonl").write_text("".join(lines))
    assert main(["plot", str(run), "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert result["skipped_lines"] == [2, 4, 9] and result["steps"] == 5
    assert "3 lines left out, not a record with an integer step (lines 2, 4, 9)" in captured.err
    (run / "metrics.jsonl").write_text("garbage\n" * 12)
    assert main(["plot", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no step records (lines 1, 2, 3, 4, 5, 6, 7, 8, ... (12 in all) are no records)" \
        in err[0], err
