"""`[sdc] abft = true` protects a Trainer's model; counters reach the metrics; a NaN is corrected."""

import math

import torch

from trainguard.config import load_config
from trainguard.sdc.runtime import attach_from_config
from trainguard.train import Trainer

OVERRIDES = ["--model.dim", "32", "--model.n_layers", "1", "--data.seq_len", "16", "--data.batch_size", "4",
             "--data.max_bytes", "200000", "--train.steps", "3", "--train.eval_every", "0",
             "--output.dir", "", "--output.progress", "false"]


def test_abft_switch_corrects_injected_nan_and_reports_counters():
    cfg = load_config(None, OVERRIDES + ["--sdc.abft", "true"])
    trainer = Trainer(cfg)
    handles = attach_from_config(trainer)
    fired = []

    def nan_once(layer, product, t):
        if product == "scores" and not fired:
            fired.append(layer)
            t = t.clone()
            t.view(-1)[3] = float("nan")
            return t
        return None

    handles["abft"].add_fault_hook(nan_once)
    summary = trainer.run()
    assert fired
    assert math.isfinite(summary.final_loss)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert summary.extra["abft_AS_detected"] >= 1 and summary.extra["abft_AS_corrected"] >= 1


def test_without_switch_nothing_is_attached():
    cfg = load_config(None, OVERRIDES)
    trainer = Trainer(cfg)
    assert attach_from_config(trainer) == {}
    assert trainer.metric_sources == [] and trainer.callbacks == []


def test_abft_switch_retries_a_step_whose_softmax_output_is_corrupted_bitwise():
    """[sdc] abft attaches ABFTGuard: a NaN in the softmax output (nothing to correct it from) escalates, the
    Trainer re-executes the step, and the run ends bitwise equal to a fault-free run with the same switch."""
    from trainguard.faults import Fault, FaultModel, Injector, ProductSite

    cfg = load_config(None, OVERRIDES + ["--sdc.abft", "true"])
    clean = Trainer(cfg)
    attach_from_config(clean)
    clean_summary = clean.run()

    trainer = Trainer(cfg)
    handles = attach_from_config(trainer)
    inj = Injector(Fault(ProductSite("probs", layer=0), FaultModel("nan"), step=1, index=5)).attach(trainer)
    summary = trainer.run()
    assert len(inj.records) == 1
    assert summary.retries == 1 and handles["abft"].retries == 1
    assert summary.suspected_hardware is None and not summary.stopped_early
    assert summary.final_loss == clean_summary.final_loss and math.isfinite(summary.final_loss)
    a, b = trainer.state_dict_for_compare(), clean.state_dict_for_compare()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
