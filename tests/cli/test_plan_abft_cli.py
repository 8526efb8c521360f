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
