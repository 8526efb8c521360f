"""`trainguard train`: one-line errors with exit 2, a working tiny run, --json last line."""

import json
import os
import subprocess
import sys

import pytest
import torch

from trainguard.cli.main import main

torch.set_num_threads(1)

SMALL = ["--data.max_bytes", "1000000", "--data.seq_len", "32", "--train.steps", "3", "--train.eval_every", "0",
         "--output.progress", "false"]


def _one_line_error(err: str, needle: str):
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err and needle in lines[0]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["train", "missing.toml"], "config file not found"),
        (["train", "--train.stepz", "3"], "unknown key train.stepz"),
        (["train", "--train.steps", "many"], "train.steps must be int"),
        (["train", "--data.source", "/nonexistent/corpus", *SMALL], "corpus not found"),
        (["train", "--model.preset", "llama-huge"], "unknown model preset"),
        (["train", "--train.steps"], "needs a value"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, needle):
    assert main(argv) == 2
    _one_line_error(capsys.readouterr().err, needle)


def test_bad_toml_file(tmp_path, capsys):
    p = tmp_path / "bad.toml"
    p.write_text("[train]\nsteps = \n")
    assert main(["train", str(p)]) == 2
    _one_line_error(capsys.readouterr().err, "invalid TOML")


def test_tiny_run_json_last_line(tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[model]\npreset = "llama-tiny"\n[train]\nsteps = 3\nlr = 1e-2\n')
    rc = main(["train", str(cfg), *SMALL, "--output.dir", str(tmp_path / "out"), "--json"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert summary["steps_run"] == 3 and summary["final_loss"] < summary["first_loss"]
    assert (tmp_path / "out" / "metrics.jsonl").is_file()


def test_human_summary_table(tmp_path, capsys):
    assert main(["train", *SMALL, "--output.dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "summary" in out and "final_loss" in out


def test_subprocess_exit_code_and_no_traceback(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "trainguard", "train", "--checkpoint.resume", "true",
                           "--data.source", str(tmp_path / "nope")], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 2
    _one_line_error(proc.stderr, "checkpoint.resume is true but checkpoint.dir is empty")
