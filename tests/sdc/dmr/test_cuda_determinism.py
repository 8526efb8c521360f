"""DMR on a CUDA device without deterministic algorithms (skipped without one): the determinism report, the
tolerance mode it feeds, and a fault found in that mode. Before the fused attention kernels' unset RNG outputs were
zeroed (``ops.clear_unset``), recording a report on an H200 stopped at once: every execution of
``_scaled_dot_product_efficient_attention`` differed from its checker in those outputs."""

import pytest
import torch

from tests.sdc.dmr.test_engine import SMALL
from trainguard.data import PackedBatches
from trainguard.faults import Fault, FaultModel, Injector, OpSite
from trainguard.sdc.dmr.config import DMRConfig
from trainguard.sdc.dmr.determinism import load_tolerances, record, save
from trainguard.sdc.dmr.engine import attach
from trainguard.train import Trainer, TrainerConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ARGS = SMALL + ["--train.device", "cuda", "--train.activation_checkpoint", "full", "--train.steps", "30"]


@pytest.fixture(scope="module")
def cfg():
    return TrainerConfig.load(None, ARGS)


@pytest.fixture(scope="module")
def report(cfg, tmp_path_factory):
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        t = Trainer(cfg, batches=PackedBatches.from_config(cfg.data))
        rep = record(t, attach(t, DMRConfig(enabled=True)), steps=2)
    finally:
        torch.use_deterministic_algorithms(before)
    path = tmp_path_factory.mktemp("det") / "det.json"
    save(rep, path)
    return rep, path


def test_a_report_is_recorded_and_every_op_can_be_verified(report):
    rep, path = report
    assert rep["device"].startswith("cuda") and rep["ops"]
    assert any("attention" in k for k in rep["ops"])  # the fused attention kernel was measured too
    load_tolerances(path, 8.0)  # (refused if an op's integer outputs or shapes differed between executions)


@pytest.mark.parametrize("inject", [False, True])
def test_tolerance_mode_is_quiet_when_clean_and_finds_a_flip(cfg, report, inject):
    torch.use_deterministic_algorithms(False)
    t = Trainer(cfg, batches=PackedBatches.from_config(cfg.data))
    eng = attach(t, DMRConfig(enabled=True, compare="tolerance", determinism_report=str(report[1])))
    inj = Injector(Fault(OpSite("aten.mm*", "backward", 2), FaultModel("bitflip", bit=29), step=2)).attach(t) \
        if inject else None
    attempts = [t.train_step().attempts for _ in range(4 if inject else 10)]
    if inject:
        assert len(inj.records) == 1 and eng.totals["detected"] >= 1 and attempts[2] == 2, attempts
    else:
        assert eng.totals["detected"] == 0 and set(attempts) == {1}, attempts
