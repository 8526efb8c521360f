"""The stream executor on a CUDA device (skipped without one; run this file alone, so that the cuBLAS workspace
setting below is in place before CUDA starts).

A pipeline transfer is emulated as NCCL's ``work.wait()`` behaves: the transfer runs on a stream of its own (here a
sleep kernel), and the wait only makes the compute stream wait for it; the host returns at once. The checkers
launched on the side stream must then overlap the transfer on the device, the host must not wait for either, and
detections (read at the verdict) must still roll the iteration back bitwise."""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (deterministic cuBLAS: bitwise comparisons)


import pytest
import torch

from tests.sdc.dmr._windowed import SMALL, equal, params, trainer, windowed
from trainguard.data import PackedBatches
from trainguard.faults import Fault, FaultModel, Injector, OpSite
from trainguard.train import TrainerConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = ["--train.device", "cuda"]


@pytest.fixture(scope="module", autouse=True)
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture(scope="module")
def batches():
    return PackedBatches.from_config(TrainerConfig.load(None, SMALL).data)


def _cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


class Transfer:
    """Emulated transfers of ``ms`` milliseconds, as a pipeline stage issues them: started (on a stream of their own)
    before the window, waited for in it; events around each transfer."""

    def __init__(self, ms: float):
        self.cycles = int(ms * _cycles_per_ms())
        self.comm = torch.cuda.Stream()
        self.log: list[dict] = []

    def __call__(self):
        rec = {k: torch.cuda.Event(enable_timing=True) for k in ("comm0", "comm1")}
        self.comm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.comm):
            rec["comm0"].record()
            torch.cuda._sleep(self.cycles)
            rec["comm1"].record()
        self.log.append(rec)
        # what work.wait() does for an NCCL transfer: the compute stream waits, the host does not
        return lambda: torch.cuda.current_stream().wait_stream(self.comm)


def test_checkers_overlap_the_transfer_on_the_device_and_the_host_does_not_wait(batches):
    t = trainer(batches, *CUDA)
    link = Transfer(ms=50.0)
    eng = windowed(t, "stream", transfer=link)
    t.train_step()  # profiled (the window is measured: ~50 ms) and planned
    checks: list[dict] = []
    real = eng._window_checks

    def timed_checks(*a, **k):  # events on the side stream around the window's checkers
        ev = {k: torch.cuda.Event(enable_timing=True) for k in ("side0", "side1")}
        ev["side0"].record()
        real(*a, **k)
        ev["side1"].record()
        checks.append(ev)

    eng._window_checks = timed_checks
    t.train_step()
    torch.cuda.synchronize()
    assert len(checks) == 1 and eng.counts["checked-in-pp"] > 0 and eng.counts["flags-read"] > 0
    ev, comm = checks[0], link.log[-1]
    # the checkers ran on the device while the transfer was under way (they started before it ended and
    # ended after it started)
    assert ev["side0"].elapsed_time(comm["comm1"]) > 0 and comm["comm0"].elapsed_time(ev["side1"]) > 0
    # and the host went on at once after launching them: the wait itself did not block it
    _, wait_s, launch_s = eng.window_log[-1]
    assert wait_s < 0.01, f"the host waited {wait_s * 1e3:.1f} ms in a 50 ms window (launching took {launch_s * 1e3:.1f})"
    assert eng.totals["detected"] == 0


def test_a_bit_flip_is_detected_at_the_verdict_and_rolled_back_bitwise_on_cuda(batches):
    clean = trainer(batches, *CUDA)
    windowed(clean, "stream", transfer=Transfer(ms=5.0))
    for _ in range(3):
        clean.train_step()
    t = trainer(batches, *CUDA)
    eng = windowed(t, "stream", transfer=Transfer(ms=5.0))
    inj = Injector(Fault(OpSite("*", "backward", 23, compute_only=True), FaultModel("bitflip", field="exponent"),
                         step=1), seed=5).attach(t)
    attempts = [t.train_step().attempts for _ in range(3)]
    # step 0 is profiled and re-executed; one more for the fault: step 1's, or step 2's where the flipped op was the
    # last micro-batch's and its check was carried past the update (on CUDA the fused attention backward is one op,
    # so an occurrence lands later in the step than on the CPU: on an H200 this one was carried)
    assert len(inj.records) == 1 and eng.totals["detected"] >= 1 and sum(attempts) >= 5, attempts
    assert equal(params(t), params(clean))
