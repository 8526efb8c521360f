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


def test_multi_step_adamw_criterion_and_measured_phi():
    # a NaN anywhere in attention reaches the loss or AdamW's moments within the following steps
    r = run_study("gpt2", trials=2, faults=("nan",), progress=False, seq_len=8, products=("v", "context"),
                  steps_after=2)
    assert r.non_trainable["nan"] == {"V": 1.0, "CL": 1.0}
    assert r.phi() == {"nan": {"v": 1.0, "context": 1.0}}
    assert r.paper_non_trainable["nan"]["V"] == 1.0  # the paper's GPT-2 row beside it


def test_grouped_query_llama_patterns():
    r = run_study("llama", trials=2, faults=("inf",), progress=False, seq_len=12, products=("k", "v"), steps_after=0)
    assert r.table["inf"]["K"]["K"].startswith("0D") and r.table["inf"]["K"]["AS"].startswith("1C")
    assert r.table["inf"]["V"]["CL"].startswith("1C")
    assert r.table2_agreement > 0 and isinstance(r.table2_mismatches, list)
