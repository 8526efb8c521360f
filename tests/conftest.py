"""Suite-wide settings. pytest runs with -n 2 on a 2-core machine: one intra-op thread per worker
avoids oversubscription (two threads per worker made steps ~8x slower under load)."""

import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Multi-process and long tests (``slow``) first, the rest in their order: ``pytest -n 2`` hands tests out
    as workers free up, and a 3-minute test handed out last kept one worker busy while the other sat idle."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
