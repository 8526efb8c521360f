"""Suite-wide settings. pytest runs with -n 2 on a 2-core machine: one intra-op thread per worker
avoids oversubscription (two threads per worker made steps ~8x slower under load)."""

import torch

torch.set_num_threads(1)
