"""Our windowed 1F1B: the private torch API it drives still exists, it computes bitwise what torch's own
Schedule1F1B computes, every transfer wait goes through the window hooks, and an emulated link delay
shows up as idle time."""

import pytest
from test_pipeline import PP, assert_bitwise, run_dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from trainguard.train.parallel.schedule import SCHEDULE_API, STAGE_API


def test_the_torch_api_the_schedule_drives_is_still_there():
    # pinned to torch 2.13: if this fails, torch moved a method WindowedSchedule1F1B calls
    missing = [m for m in STAGE_API if not hasattr(PipelineStage, m)]
    missing += [m for m in SCHEDULE_API if not hasattr(Schedule1F1B, m)]
    assert not missing, f"torch.distributed.pipelining no longer has {missing}"


@pytest.mark.slow
def test_windowed_schedule_equals_torch_1f1b_bitwise_and_exposes_every_wait(tmp_path):
    ours = run_dist(tmp_path, "ours", 2, "windows", *PP)
    stock = run_dist(tmp_path, "stock", 2, "stock", *PP)
    assert_bitwise(ours, stock)
    for rank in ours:  # (2 rounds x 2 micro-batches, sends and receives) per step, and the evaluation passes
        assert rank["waits"] and set(rank["waits"]) == {"pp", "setup"} and rank["waits"].count("pp") >= 4 * 4
        # the stage's handshake and shape inference (first run; again after each switch between evaluation and
        # training) goes through the hooks first, as "setup", so DMR keeps its ops apart from the step's
        assert rank["waits"][0] == "setup"


@pytest.mark.slow
def test_an_emulated_slow_link_is_idle_time(tmp_path):
    fast = run_dist(tmp_path, "fast", 2, "clean", *PP)
    slow = run_dist(tmp_path, "slow", 2, "clean", *PP, "--distributed.emulate_link_delay_ms", "30")
    for f, s in zip(fast, slow):
        assert s["wait_s"] > f["wait_s"] + 0.3  # dozens of transfers, each landing >= 30 ms after it left
