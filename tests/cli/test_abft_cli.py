import json

import pytest
import torch

from trainguard.cli.main import main


@pytest.mark.parametrize("model, fault", [("llama-tiny", "near-inf"), ("bert", "inf")])
def test_campaign_abft_all_corrected(capsys, model, fault):
    rc = main(["campaign", "abft", "--model", model, "--fault", fault, "--site", "any", "--trials", "6",
               "--seq-len", "16", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"trials", "detected", "corrected", "uncorrectable", "silent", "false_positives",
            "max_abs_error_after_correction"} <= set(d)
    assert d["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # --device auto
    assert d["trials"] == 6 and d["detected"] == 6 and d["corrected"] == 6
    assert d["silent"] == 0 and d["false_positives"] == 0 and d["max_abs_error_after_correction"] <= d["tolerance"]


def test_campaign_abft_bad_input(capsys):
    assert main(["campaign", "abft", "--trials", "0"]) == 2
    assert main(["campaign", "abft", "--seq-len", "100000"]) == 2
    assert main(["campaign", "abft", "--model", "llama-tiny", "--size", "small"]) == 2
    assert "--size applies to HF models" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA on a machine without it")
def test_cuda_refused_without_a_gpu(capsys):
    for cmd in (["campaign", "abft", "--trials", "1"], ["bench", "abft", "--model", "llama-tiny", "--rounds", "1"]):
        assert main(cmd + ["--device", "cuda"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "no CUDA device" in err


def test_bench_abft_keys(capsys):
    rc = main(["bench", "abft", "--model", "llama-tiny", "--batch", "2", "--seq-len", "16", "--rounds", "1",
               "--steps", "1", "--host-memory", "default", "--json"])  # retain is process-wide: not in pytest
    assert rc == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert d["host_memory"] == "default" and d["device"] in ("cpu", "cuda")
    for k in ("attention_overhead", "train_step_overhead", "correction_cost_vs_step",
              "checkpoint_restore_cost_vs_step", "recovery_speedup", "train_step_overhead_ci95"):
        assert k in d
    assert d["faults_corrected_in_recovery_runs"] >= 1
