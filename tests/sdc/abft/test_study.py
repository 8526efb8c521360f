"""Propagation study: the deterministic patterns the ATTNChecker paper reports (Table 2) appear."""

import torch

from trainguard.sdc.abft.study import pattern, run_study


def test_pattern_classifier():
    t = torch.zeros(1, 4, 5)
    assert pattern(t, None)[0] == "-"
    t[0, 1, 2] = float("inf")
    assert pattern(t, None) == ("0D", {"INF"})
    t[0, 1, 4] = float("nan")
    assert pattern(t, None)[0] == "1R"
    t2 = torch.zeros(1, 4, 5)
    t2[0, :, 3] = 1e20
    assert pattern(t2, None) == ("1C", {"nINF"})
    t2[0, 0, 0] = 1e20
    assert pattern(t2, None)[0] == "2D"


def test_inf_in_q_is_a_row_in_scores_and_k_a_column():
    r = run_study("llama-tiny", trials=2, faults=("inf",), progress=False, seq_len=16)
    assert r.table["inf"]["Q"]["Q"].startswith("0D") and r.table["inf"]["Q"]["AS"].startswith("1R")
    assert r.table["inf"]["K"]["AS"].startswith("1C")  # a key is a column of QK^T
    assert r.table["inf"]["V"]["AS"] == "-"  # V is not upstream of the scores
    assert r.table["inf"]["CL"]["O"].startswith("1R")
    assert r.non_trainable["inf"]["O"] == 1.0  # an INF in the output reaches the loss
