"""HF adapters (GPT-2, BERT, GPT-Neo, RoBERTa built from tiny configs): equality, injection, low precision."""

import warnings

import pytest
import torch
from _hooks import OneShot

from trainguard.errors import ConfigError, TrainguardError
from trainguard.sdc.abft import PRODUCTS, ABFTConfig, protect, unprotect
from trainguard.sdc.abft.hf import build_hf_model

warnings.filterwarnings("ignore")
MODELS = ("gpt2", "bert", "gpt-neo", "roberta")
VALUES = (float("inf"), float("nan"), 1e20, float("-inf"), -3e12, float("nan"))


def _inputs(seed=1, b=2, t=20):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, 256, (b, t), generator=g)
    am = torch.ones(b, t, dtype=torch.long)
    am[1, t - 4:] = 0  # padding in the second sequence
    return x, am


def _step(m, x, am):
    m.zero_grad(set_to_none=True)
    out = m(input_ids=x, attention_mask=am).logits
    out.float().logsumexp(-1).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", MODELS)
def test_clean_equal_and_unprotect_bitwise(name):
    m = build_hf_model(name, "tiny", seed=0)
    x, am = _inputs()
    ref = m(input_ids=x, attention_mask=am).logits
    ref_nomask = m(input_ids=x).logits
    h = protect(m)
    assert torch.allclose(m(input_ids=x, attention_mask=am).logits, ref, atol=1e-5)
    assert torch.allclose(m(input_ids=x).logits, ref_nomask, atol=1e-5)
    assert h.total()["detected"] == 0 and h.n_layers == 2
    unprotect(m)
    assert torch.equal(m(input_ids=x, attention_mask=am).logits, ref)


@pytest.mark.parametrize("name", MODELS)
def test_injection_in_training_steps_corrected(name):
    m = build_hf_model(name, "tiny", seed=0)
    m.train()
    x, am = _inputs()
    h = protect(m, ABFTConfig(backward=True))
    ref_out, ref_g = _step(m, x, am)
    for i, product in enumerate(PRODUCTS + ("grad_scores_q", "grad_context_v", "grad_output_weight")):
        h.reset_counters()
        rm = h.add_fault_hook(OneShot(i % 2, product, VALUES[i % len(VALUES)], seed=i))
        out, g = _step(m, x, am)
        rm()
        tot = h.total()
        assert tot["detected"] == 1 and tot["corrected"] == 1, (product, h.events)
        assert torch.allclose(out, ref_out, atol=1e-4), product
        for n in ref_g:
            assert torch.allclose(g[n], ref_g[n], atol=1e-4, rtol=1e-3), (product, n)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_clean_runs_flag_nothing(name, dtype):
    m = build_hf_model(name, "tiny", seed=0).to(dtype)
    m.train()
    h = protect(m, ABFTConfig(backward=True))
    for s in range(3):  # 2 layers x 18 products x 3 steps per model and dtype
        x, am = _inputs(seed=s, t=12 + 8 * s)
        h.set_step(s)
        _step(m, x, am)
    assert h.total()["detected"] == 0, h.events[:3]
    h.add_fault_hook(OneShot(0, "scores", float("nan"), seed=0))
    x, am = _inputs()
    out = m(input_ids=x, attention_mask=am).logits
    assert torch.isfinite(out).all() and h.total()["corrected"] == 1


def test_autocast_bf16_clean():
    m = build_hf_model("gpt2", "tiny", seed=0)
    h = protect(m, ABFTConfig(backward=True))
    x, am = _inputs()
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(input_ids=x, attention_mask=am).logits
        out.float().mean().backward()
    assert h.total()["detected"] == 0


def test_gpt_neo_local_attention_matches():
    m = build_hf_model("gpt-neo", "tiny", seed=0)
    x, _ = _inputs(t=40)  # longer than the window (16): local layers differ from global ones
    ref = m(input_ids=x).logits
    protect(m)
    assert torch.allclose(m(input_ids=x).logits, ref, atol=1e-5)


def test_builder_errors_and_unsupported():
    with pytest.raises(ConfigError):
        build_hf_model("t5")
    with pytest.raises(ConfigError):
        build_hf_model("gpt2", size="huge")
    import transformers as tf

    opt = tf.OPTForCausalLM(tf.OPTConfig(num_hidden_layers=1, hidden_size=32, ffn_dim=64, num_attention_heads=4,
                                         vocab_size=64, word_embed_proj_dim=32))
    with pytest.raises(TrainguardError, match="cannot protect"):
        protect(opt)
    bert_dec = tf.BertLMHeadModel(tf.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                                intermediate_size=64, vocab_size=64, is_decoder=True,
                                                add_cross_attention=True))
    with pytest.raises(TrainguardError, match="cross-attention"):
        protect(bert_dec)


# ---------------------------------------------------------------- Llama / Mistral / Qwen2 (attention interface)

GQA_MODELS = ("llama", "mistral", "qwen2")


@pytest.mark.parametrize("name", GQA_MODELS)
def test_interface_models_clean_equal_and_unprotect_restores(name):
    m = build_hf_model(name, "tiny", seed=0)
    assert m.config.num_key_value_heads < m.config.num_attention_heads  # grouped-query attention
    x, am = _inputs(t=40)  # longer than the 16-token sliding window of Mistral / Qwen2's second layer
    impl = m.config._attn_implementation
    ref = m(input_ids=x, attention_mask=am).logits
    ref_nomask = m(input_ids=x).logits
    h = protect(m)
    assert m.config._attn_implementation == "trainguard_abft" and h.n_layers == 2
    torch.testing.assert_close(m(input_ids=x, attention_mask=am).logits, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(m(input_ids=x).logits, ref_nomask, atol=1e-5, rtol=0)
    assert h.total()["detected"] == 0
    unprotect(m)
    assert m.config._attn_implementation == impl
    assert torch.equal(m(input_ids=x, attention_mask=am).logits, ref)


@pytest.mark.parametrize("name", GQA_MODELS)
def test_interface_models_injection_in_training_steps(name):
    m = build_hf_model(name, "tiny", seed=0)
    m.train()
    x, am = _inputs()
    h = protect(m, ABFTConfig(backward=True))
    ref_out, ref_g = _step(m, x, am)
    for i, product in enumerate(PRODUCTS + ("grad_q_weight", "grad_scores_k", "grad_context_probs", "grad_v_input")):
        h.reset_counters()
        rm = h.add_fault_hook(OneShot(i % 2, product, VALUES[i % len(VALUES)], seed=i))
        out, g = _step(m, x, am)
        rm()
        tot = h.total()
        assert tot["detected"] == 1 and tot["corrected"] == 1, (product, h.events)
        assert torch.allclose(out, ref_out, atol=1e-4), product
        for n in ref_g:
            assert torch.allclose(g[n], ref_g[n], atol=1e-4, rtol=1e-3), (product, n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_interface_low_precision_clean(dtype):
    m = build_hf_model("qwen2", "tiny", seed=0).to(dtype)
    h = protect(m, ABFTConfig(backward=True))
    for s_ in range(3):
        x, am = _inputs(seed=s_, t=12 + 10 * s_)
        _step(m, x, am)
    assert h.total()["detected"] == 0, h.events[:3]


def test_interface_bypass_is_refused_not_silent():
    m = build_hf_model("llama", "tiny", seed=0)
    protect(m)
    m.set_attn_implementation("sdpa")  # as if a transformers release stopped calling the registered function
    x, _ = _inputs()
    with pytest.raises(TrainguardError, match="ran without protection of core"):
        m(input_ids=x)
