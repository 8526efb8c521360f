"""Attention paths agree (explicit vs fused sdpa, forward and gradients); MoE routes and has an aux loss."""

import torch

from trainguard.models import build_model, lm_loss

torch.set_num_threads(1)


def _tokens(seed=0, b=2, s=24, vocab=258):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, s + 1), generator=g)


def _loss_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])
    loss = lm_loss(logits, tokens[:, 1:])
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_explicit_and_sdpa_agree_forward_and_backward():
    tokens = _tokens()
    explicit = build_model("llama-tiny", attention="explicit")
    sdpa = build_model("llama-tiny", attention="sdpa")
    le, ge = _loss_and_grads(explicit, tokens)
    ls, gs = _loss_and_grads(sdpa, tokens)
    torch.testing.assert_close(le, ls, rtol=1e-4, atol=1e-5)
    for n in ge:
        torch.testing.assert_close(ge[n], gs[n], rtol=1e-3, atol=1e-6, msg=n)


def test_set_attention_switches_path_and_hooks_force_explicit():
    tokens = _tokens(1)[:, :-1]
    m = build_model("llama-tiny")
    ref = m(tokens)
    seen = []
    remove = m.layers["0"].attention.add_product_hook(lambda mod, name, t: seen.append(name))
    out = m(tokens)  # a hook forces the explicit path even though attention="sdpa"
    remove()
    assert seen == ["q", "k", "v", "scores", "context", "output"]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    m.set_attention("explicit")
    torch.testing.assert_close(m(tokens), ref, rtol=1e-4, atol=1e-5)


def test_moe_routing_and_aux_loss():
    m = build_model("llama-moe-tiny")
    tokens = _tokens(2, b=2, s=16)
    assert m.aux_loss() is None  # nothing routed yet
    logits = m(tokens[:, :-1])
    aux = m.aux_loss()
    assert aux is not None and aux.item() > 0
    moe = m.layers["0"].feed_forward
    assert int(moe.last_tokens_per_expert.sum()) == 2 * 16 * moe.top_k
    (lm_loss(logits, tokens[:, 1:]) + aux).backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0
    dense = build_model("llama-tiny")
    dense(tokens[:, :-1])
    assert dense.aux_loss() is None
