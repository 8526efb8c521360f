import json

from trainguard.cli.main import main


def test_plan_abft_json(capsys):
    assert main(["plan", "abft", "--error-rate", "1e-21", "--target-coverage", "0.99999999999", "--json"]) == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert d["target_met"] and all(0 <= d[k] <= 1 for k in ("f_AS", "f_CL", "f_O"))
    assert d["coverage"] >= 0.99999999999


def test_plan_abft_bad_input(capsys):
    assert main(["plan", "abft", "--error-rate", "1e-21", "--target-coverage", "2"]) == 2
    assert "coverage" in capsys.readouterr().err


def test_plan_abft_from_measured_probabilities_and_costs(capsys, tmp_path):
    study = {"non_trainable": {f: {"Q": 0.5, "K": 0.5, "V": 0.1, "AS": 0.01, "CL": 0.01, "O": 0.01}
                               for f in ("inf", "nan", "near-inf")}}
    bench = {"model": "bert", "batch": 8, "seq_len": 128, "section_check_cost_s": {"AS": 2e-3, "CL": 1e-3, "O": 5e-4},
             "attention_s": {"plain": 0.05}}
    (tmp_path / "study.json").write_text("progress...\n" + json.dumps(study))  # the last line of a command's output
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    args = ["plan", "abft", "--error-rate", "3e-22", "--target-coverage", "0.99999999999", "--json"]
    assert main(args) == 0
    paper = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(args + ["--phi-from", str(tmp_path / "study.json"), "--costs-from", str(tmp_path / "bench.json")]) == 0
    measured = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert paper["phi_source"] == "paper" and measured["phi_source"].endswith("study.json")
    assert measured["cost_source"].endswith("bench.json") and measured["target_met"]
    # cheaper O and less vulnerable CL than the paper's BERT profile: a different allocation
    assert (measured["f_AS"], measured["f_CL"], measured["f_O"]) != (paper["f_AS"], paper["f_CL"], paper["f_O"])
    (tmp_path / "bad.json").write_text(json.dumps({"x": 1}))
    assert main(args + ["--phi-from", str(tmp_path / "bad.json")]) == 2
    assert main(args + ["--costs-from", str(tmp_path / "missing.json")]) == 2
