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
            "max_abs_error_after_correction", "wrong_after_correction", "recomputed", "step_retried"} <= set(d)
    assert d["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # --device auto
    assert d["trials"] == 6 and d["detected"] == 6 and d["corrected"] == 6
    assert d["silent"] == 0 and d["false_positives"] == 0 and d["max_abs_error_after_correction"] <= d["tolerance"]
    assert d["wrong_after_correction"] == 0


@pytest.mark.parametrize("model, fault", [("qwen2", "multi"), ("gpt2", "nongemm")])
def test_campaign_abft_new_models_and_fault_classes(capsys, model, fault):
    rc = main(["campaign", "abft", "--model", model, "--fault", fault, "--trials", "6", "--seq-len", "16",
               "--seed", "1", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert d["trials"] == 6 and d["silent"] == 0 and d["wrong_after_correction"] == 0
    assert d["corrected"] + d["recomputed"] + d["step_retried"] + d["masked"] + d["reported_failure"] == 6


def test_campaign_abft_bad_input(capsys):
    assert main(["campaign", "abft", "--trials", "0"]) == 2
    assert main(["campaign", "abft", "--seq-len", "100000"]) == 2
    assert main(["campaign", "abft", "--model", "llama-tiny", "--size", "small"]) == 2
    assert "--size applies to HF models" in capsys.readouterr().err
    assert main(["campaign", "abft", "--fault", "nongemm", "--site", "q"]) == 2
    assert "--fault nongemm takes" in capsys.readouterr().err
    assert main(["bench", "abft", "--model", "llama-tiny", "--checkpoint-interval", "0"]) == 2


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
              "checkpoint_restore_cost_vs_step", "recovery_speedup", "train_step_overhead_ci95",
              "detection_cost_per_step", "break_even_faults_per_step", "checkpoint_interval", "checkpoint_load_s"):
        assert k in d
    assert d["faults_corrected_in_recovery_runs"] >= 1
    assert d["checkpoint_interval"] == 100 and d["lost_steps_per_fault"] == 50.5
    assert "CheckpointManager" in d["checkpoint_restore_method"] and d["checkpoint_bytes"] > 0
    # the restore is the trainer's DCP load plus the lost steps; ABFT's cost per fault includes detection
    assert d["checkpoint_restore_cost_vs_step"] >= d["lost_steps_per_fault"]
    assert d["abft_cost_per_fault_vs_step"] >= d["detection_cost_per_step"]
