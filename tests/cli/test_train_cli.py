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


def test_help_lists_every_config_key_with_type_default_and_meaning(capsys):
    from trainguard.config import config_help

    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    for key, typ, default, help_text in config_help():
        line = next((x for x in lines if x.startswith(f"  --{key}  ")), None)
        assert line is not None, key
        assert typ in line and f"(default: {default})" in line, line
        if help_text:
            assert help_text in text, key
    assert "--checkpoint.resume true" in text and "130" in text and "143" in text


def test_json_summary_of_a_resumed_run(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    args = ["train", *SMALL, "--data.max_bytes", "100000", "--output.dir", str(tmp_path / "out"), "--checkpoint.dir", ck]
    assert main(args) == 0
    assert main([*args, "--train.steps", "5", "--checkpoint.resume", "true", "--json"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["start_step"] == 3 and summary["end_step"] == 5 and summary["resumed_from"].endswith("step_00000003")
    assert summary["resume_changes"] == {"train.steps": [3, 5]}
    assert "resuming run" in captured.err and "train.steps 3 -> 5" in captured.err
    assert main([*args, "--train.steps", "5", "--checkpoint.resume", "true", "--json"]) == 0  # finished: nothing to do
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["already_finished"] is True
    assert "already finished" in captured.err


@pytest.mark.slow
def test_ddp_error_is_printed_once_with_exit_2(tmp_path):
    """Before: one traceback per rank plus torchrun's ChildFailedError block, exit 1."""
    ck = tmp_path / "ck"
    base = ["train", *SMALL, "--data.max_bytes", "100000", "--data.batch_size", "4", "--output.dir", str(tmp_path / "out"),
            "--checkpoint.dir", str(ck)]
    assert main(base) == 0  # another run's checkpoint in the folder
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, "-m", "trainguard", *base, "--distributed.dp", "2"], capture_output=True,
                          text=True, env=env, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("trainguard: error: checkpoint.dir"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr


_LATE_INTERRUPT = """
import atexit, os, signal, sys, time
from trainguard.cli.main import _force_on_second_interrupt
_force_on_second_interrupt()
atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(5)))  # a Ctrl-C in the clean-up
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
except KeyboardInterrupt:
    print("stopping cleanly", flush=True)
sys.exit(0)
"""


def test_a_second_ctrl_c_while_stopping_exits_130_at_once_without_a_traceback():
    """The first Ctrl-C is a KeyboardInterrupt (the run stops cleanly); the second, here in an atexit handler, ends
    the process with 130 (was: "Exception ignored in atexit callback" and its traceback, or death by SIGINT)."""
    p = subprocess.run([sys.executable, "-c", _LATE_INTERRUPT], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "stopping cleanly"
    assert p.returncode == 130 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip() == "trainguard: interrupted again; exiting now"


@pytest.mark.parametrize("gap_s", [0.0, 0.02])
def test_two_quick_ctrl_c_during_training_end_with_130_and_no_traceback(tmp_path, gap_s):
    import signal
    import time

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "trainguard", "train", *SMALL, "--train.steps", "100000", "--train.log_every", "1",
           "--output.dir", str(out)]
    cmd.remove("3")  # (SMALL's train.steps: a key is given once)
    cmd.remove("--train.steps")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    time.sleep(gap_s)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err and "Exception ignored" not in err, err
