import json

from trainguard.cli.main import main


def test_inject_campaign_json(capsys):
    rc = main(["inject", "--site", "param", "--pattern", "norm.weight", "--fault", "nan", "--trials", "2",
               "--steps", "1", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    d = json.loads(out[-1])
    assert d["trials"] == 2 and d["silent"] == 2 and d["masked"] == 0
    assert {"detected", "corrected", "masked", "silent"} <= set(d)


def test_bad_input_exits_2(capsys):
    assert main(["inject", "--trials", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "trials" in err
    assert main(["inject", "--site", "module", "--pattern", "nope"]) == 2
