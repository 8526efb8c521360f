"""Presets carry GaLore's LLaMA shapes; any field is overridable; bad fields are refused."""

import pytest
import torch

from trainguard.errors import ConfigError
from trainguard.models import PRESETS, build_model, lm_loss, model_config


@pytest.mark.parametrize(
    "name, shape",
    [("llama-60m", (512, 1376, 8, 8)), ("llama-130m", (768, 2048, 12, 12)), ("llama-350m", (1024, 2736, 16, 24)),
     ("llama-1b", (2048, 5461, 32, 24)), ("llama-7b", (4096, 11008, 32, 32))],
)
def test_galore_shapes(name, shape):
    c = PRESETS[name]
    assert (c.dim, c.ffn_hidden, c.n_heads, c.n_layers) == shape


def test_override_and_errors():
    assert model_config("llama-60m", n_layers=2).n_layers == 2
    with pytest.raises(ConfigError):
        model_config("llama-60m", bogus=1)
    with pytest.raises(ConfigError):
        model_config("nope")


def test_param_count_matches_formula():
    for name in ("llama-tiny", "llama-moe-tiny"):
        m = build_model(name)
        assert sum(p.numel() for p in m.parameters()) == m.cfg.num_params()


def test_seeded_build_is_deterministic_and_keeps_global_rng():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model("llama-tiny", seed=5)
    after = torch.rand(1)
    b = build_model("llama-tiny", seed=5)
    assert torch.equal(before, after)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_moe_routing_is_data_dependent_and_trains():
    m = build_model("llama-moe-tiny")
    x = torch.randint(0, 256, (2, 16))
    loss = lm_loss(m(x), x) + m.aux_loss()
    loss.backward()
    counts = [blk.feed_forward.last_tokens_per_expert for blk in m.layers.values()]
    assert all(int(c.sum()) == 2 * 16 * m.cfg.top_k for c in counts)
    assert m.layers["0"].feed_forward.router.weight.grad is not None
    m(torch.randint(0, 256, (2, 16)))
    # A different batch routes differently (overwhelmingly likely with random init).
    assert not all(torch.equal(a, blk.feed_forward.last_tokens_per_expert) for a, blk in zip(counts, m.layers.values()))
