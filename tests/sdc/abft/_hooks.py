"""Fault hooks shared by the ABFT tests."""

import torch


class OneShot:
    """Inject ``value`` once at a random position of ``product`` in ``layer`` (an ABFT fault hook)."""

    def __init__(self, layer, product, value, seed=0):
        self.layer, self.product, self.value, self.done = layer, product, value, False
        self.g = torch.Generator().manual_seed(seed)

    def __call__(self, layer, product, t):
        if self.done or layer != self.layer or product != self.product:
            return None
        self.done = True
        i = int(torch.randint(0, t.numel(), (1,), generator=self.g))
        out = t.clone()
        out.view(-1)[i] = self.value
        return out
