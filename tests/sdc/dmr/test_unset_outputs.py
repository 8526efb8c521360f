"""CUDA's fused attention kernels return their dropout RNG's seed and offset uninitialised when ``dropout_p`` is 0
(found on an H200: every clean step of a non-deterministic run was flagged at
``_scaled_dot_product_efficient_attention``). Here an op with the same schema stands in for them on the CPU: its
``philox_seed`` output holds whatever the memory held (a fresh random number per execution)."""

import pytest
import torch

from tests.sdc.dmr.test_engine import _trainer, batches  # noqa: F401  (fixture)
from trainguard.sdc.dmr import ops as dops
from trainguard.sdc.dmr.config import DMRConfig
from trainguard.sdc.dmr.engine import attach

_LIB = torch.library.Library("trainguard_test", "DEF")
_LIB.define("attention_rng(Tensor x, float dropout_p) -> (Tensor output, Tensor philox_seed, Tensor philox_offset)",
            tags=(torch.Tag.nondeterministic_seeded,))
_GARBAGE = torch.Generator().manual_seed(0)  # (what an uninitialised allocation holds: differs between calls)


def _attention_rng(x, dropout_p):
    if dropout_p == 0:
        seed, offset = (torch.randint(0, 2**62, (), generator=_GARBAGE) for _ in range(2))
    else:
        seed, offset = torch.tensor(123), torch.tensor(4)
    return x * 1.0, seed.to(x.device), offset.to(x.device)


_LIB.impl("attention_rng", _attention_rng, "CompositeExplicitAutograd")  # (CPU or CUDA)
OP = torch.ops.trainguard_test.attention_rng.default


def test_the_fused_attention_kernels_rng_outputs_are_found_by_name():
    """The schemas this relies on (torch's private attention ops): if they are renamed, this fails."""
    for name, unset in (("_scaled_dot_product_efficient_attention", (2, 3)), ("_scaled_dot_product_flash_attention",
                        (6, 7)), ("_scaled_dot_product_cudnn_attention", (6, 7)), ("_efficient_attention_forward",
                        (2, 3)), ("_flash_attention_forward", (2, 3))):
        assert dops.info(getattr(torch.ops.aten, name).default).unset == unset, name
    assert dops.info(torch.ops.aten.native_dropout.default).unset == ()
    assert dops.info(OP).unset == (1, 2)


def test_clear_unset_zeroes_them_only_without_dropout():
    x = torch.randn(3)
    out = dops.clear_unset(OP, (x, 0.0), {}, OP(x, 0.0))
    assert out[1].item() == 0 and out[2].item() == 0 and torch.equal(out[0], x)
    out = dops.clear_unset(OP, (x, 0.1), {}, OP(x, 0.1))
    assert (out[1].item(), out[2].item()) == (123, 4)  # with dropout they are the RNG's state: kept


@pytest.mark.parametrize("system", ["naive", "sparetrain"])
def test_clean_steps_raise_no_alarm_with_an_attention_kernel_that_leaves_outputs_unset(batches, system):  # noqa: F811
    t = _trainer(batches, "--train.activation_checkpoint", "full")
    def kernel(module, nxt, *a):  # the op runs beside every attention (forward and recompute), off the graph
        out = nxt(*a)
        OP(out.detach(), 0.0)
        return out

    for block in t.model.layers.values():
        block.attention.kernel.push(kernel, name="rng-outputs")
    eng = attach(t, DMRConfig(enabled=True, system=system))
    assert [t.train_step().attempts for _ in range(3)] == [1, 1, 1]
    assert eng.totals["detected"] == 0
