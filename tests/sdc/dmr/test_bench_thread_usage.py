"""``bench dmr``'s per-thread usage of the main thread (``main_sys_s``, ``main_minor_faults``,
``main_involuntary_switches``): it must count the calling thread's own work, not the process's."""

from __future__ import annotations

import sys
import threading

import pytest

from trainguard.sdc.dmr import bench

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RUSAGE_THREAD is Linux's")

PAGE = 4096
SIZE = 64 * 2**20


def _touch() -> bytearray:
    buf = bytearray(SIZE)  # (calloc: fresh zero pages, first touched below)
    for i in range(0, SIZE, PAGE):
        buf[i] = 1
    return buf


def test_a_thread_counts_the_pages_it_touches_and_not_another_threads():
    s0, f0, _ = bench._thread_usage()
    kept = _touch()
    s1, f1, _ = bench._thread_usage()
    # 64 MiB of first touches: 16,384 faults of 4 KiB pages, or at least 32 where the kernel maps 2 MiB pages
    assert f1 - f0 >= SIZE // (2 * 2**20) and s1 >= s0
    other: list = []
    t = threading.Thread(target=lambda: other.append(_touch()))
    t.start()
    t.join()
    _, f2, _ = bench._thread_usage()
    assert len(other) == 1 and len(kept) == SIZE
    assert f2 - f1 < (f1 - f0) // 4  # (the other thread's faults are its own)


@pytest.mark.parametrize("collector_on", [True, False])
def test_the_host_probe_times_both_pieces_and_leaves_the_collector_as_it_found_it(collector_on):
    import gc

    was = gc.isenabled()
    (gc.enable if collector_on else gc.disable)()
    try:
        before = len(gc.get_objects())
        probe = bench.host_probe(seed=1)
        assert gc.isenabled() is collector_on
        assert probe["python_walk_s"] > 0 and probe["matmul_s"] > 0
        # its objects are freed: nothing it made is left for a later step's collection
        assert len(gc.get_objects()) < before + bench._PROBE_OBJECTS // 100
    finally:
        (gc.enable if was else gc.disable)()
