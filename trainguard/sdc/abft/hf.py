"""HF transformers adapters: GPT-2, BERT, GPT-Neo, RoBERTa attention through the protected kernel.

Relies on ``transformers`` (5.x; models are built from configs only, no weights are downloaded) and
:func:`trainguard.sdc.abft.attention.protected_attention`. Each supported attention module gets an
instance-level ``forward`` (the class is untouched; :func:`unpatch` deletes the instance attribute, so the
original bound method is back exactly):

* GPT-2 ``GPT2Attention``: fused ``c_attn`` Conv1D (x @ W + b) is one GEMM with one fused check (the
  checksum of the concatenated product is the concatenation of the q / k / v checksums; a flag is resolved
  per product, so q / k / v keep their own names, hooks and counters); scaling ``module.scaling`` (1/sqrt(d),
  and 1/(layer+1) with ``scale_attn_by_inverse_layer_idx``); ``reorder_and_upcast_attn`` computes the
  scores in fp32; ``c_proj`` is section O; the KV cache is updated like the original does.
* BERT / RoBERTa ``BertAttention`` / ``RobertaAttention`` (the outer module, so that the output ``dense``
  of ``BertSelfOutput`` is section O; its dropout + LayerNorm(residual) follow). Bidirectional unless the
  module is causal (decoder config); padding masks as bool or additive masks.
* GPT-Neo ``GPTNeoSelfAttention``: no 1/sqrt(d) scaling, scores in fp32, the module's ``bias`` buffer
  (causal, or sliding-window on ``local`` layers) applied with ``finfo.min``, then the additive mask.

Masks: ``None`` (causal iff the module is causal, as SDPA's ``is_causal``), bool (True = attend, the SDPA
convention) or float (added), whatever ``config._attn_implementation`` produced. Cross-attention is refused
with ShapeError.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from trainguard.errors import ConfigError, ShapeError
from trainguard.sdc.abft.attention import causal_bias, conv1d_proj, linear_proj, protected_attention

SUPPORTED = ("GPT2", "BERT", "GPT-Neo", "RoBERTa")
_KINDS = {"GPT2Attention": "gpt2", "BertAttention": "bert", "RobertaAttention": "bert",
          "GPTNeoSelfAttention": "gpt-neo"}
_PACKAGES = ("transformers.models.gpt2.", "transformers.models.bert.", "transformers.models.gpt_neo.",
             "transformers.models.roberta.")


def _targets(model: nn.Module) -> list[tuple[nn.Module, str]]:
    return [(m, _KINDS[type(m).__name__]) for m in model.modules()
            if type(m).__name__ in _KINDS and type(m).__module__.startswith(_PACKAGES)]


def is_supported(model: nn.Module) -> bool:
    return type(model).__module__.startswith(_PACKAGES) and bool(_targets(model))


def _bias_fn(attention_mask, causal: bool):
    """The mask as an additive bias (see ``protected_attention``): None -> causal -inf mask (or nothing),
    bool (True = attend) -> finfo.min where masked (``min + scale * s`` rounds to ``min`` exactly, as the
    eager ``masked_fill`` gives, for any |scale * s| < 1e31), float -> itself."""
    def fn(tq: int, tk: int, dtype: torch.dtype, device: torch.device):
        if attention_mask is None:
            return causal_bias(tq, tk, dtype, device) if causal and tq > 1 else None
        if attention_mask.dtype == torch.bool:
            return torch.zeros(attention_mask.shape, dtype=dtype, device=device).masked_fill_(
                ~attention_mask, torch.finfo(dtype).min)
        return attention_mask.to(dtype)
    return fn


def _cache_update(cache, layer_idx):
    if cache is None:
        return None
    inner = getattr(cache, "self_attention_cache", cache)
    return lambda k, v: inner.update(k, v, layer_idx)


def _gpt2_forward(handle, layer):
    def forward(self, hidden_states, past_key_values=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, output_attentions=False, **kwargs):
        if encoder_hidden_states is not None or self.is_cross_attention:
            raise ShapeError("ABFT protects self-attention only; GPT-2 cross-attention is not supported")
        out, probs = protected_attention(
            handle, layer, hidden_states, conv1d_proj(self.c_attn), None, None, conv1d_proj(self.c_proj),
            n_heads=self.num_heads, head_dim=self.head_dim, scale=self.scaling,
            bias_fn=_bias_fn(attention_mask, self.is_causal),
            kv_update=_cache_update(past_key_values, self.layer_idx),
            dropout_p=self.attn_dropout.p if self.training else 0.0,
            upcast_scores=bool(self.reorder_and_upcast_attn))
        return self.resid_dropout(out), probs
    return forward


def _bert_forward(handle, layer):
    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                past_key_values=None, **kwargs):
        if self.is_cross_attention or encoder_hidden_states is not None:
            raise ShapeError("ABFT protects self-attention only; BERT/RoBERTa cross-attention is not supported")
        sa = self.self
        out, probs = protected_attention(
            handle, layer, hidden_states, linear_proj(sa.query), linear_proj(sa.key), linear_proj(sa.value),
            linear_proj(self.output.dense), n_heads=sa.num_attention_heads, head_dim=sa.attention_head_size,
            scale=sa.scaling, bias_fn=_bias_fn(attention_mask, bool(sa.is_causal)),
            kv_update=_cache_update(past_key_values, sa.layer_idx),
            dropout_p=sa.dropout.p if self.training else 0.0)
        out = self.output.LayerNorm(self.output.dropout(out) + hidden_states)
        return out, probs
    return forward


def _neo_forward(handle, layer):
    def forward(self, hidden_states, attention_mask=None, layer_past=None, use_cache=False,
                output_attentions=False, **kwargs):
        def mask_fn(s):
            tq, tk = s.shape[-2], s.shape[-1]
            causal = self.bias[:, :, tk - tq: tk, :tk]
            s = torch.where(causal, s, torch.tensor(torch.finfo(s.dtype).min, dtype=s.dtype, device=s.device))
            return s + attention_mask if attention_mask is not None else s

        out, probs = protected_attention(
            handle, layer, hidden_states, linear_proj(self.q_proj), linear_proj(self.k_proj),
            linear_proj(self.v_proj), linear_proj(self.out_proj), n_heads=self.num_heads, head_dim=self.head_dim,
            scale=1.0, mask_fn=mask_fn, kv_update=_cache_update(layer_past, self.layer_id),
            dropout_p=self.attn_dropout.p if self.training else 0.0, upcast_scores=True)
        return self.resid_dropout(out), probs
    return forward


_FORWARDS = {"gpt2": _gpt2_forward, "bert": _bert_forward, "gpt-neo": _neo_forward}


def patch(model: nn.Module, handle) -> None:
    targets = _targets(model)
    for layer, (mod, kind) in enumerate(targets):
        had = "forward" in mod.__dict__
        handle._restore.append((mod, had, mod.__dict__.get("forward")))
        mod.forward = types.MethodType(_FORWARDS[kind](handle, layer), mod)
        if kind == "bert":
            handle.share_qkv_storage([mod.self.query, mod.self.key, mod.self.value])
        elif kind == "gpt-neo":
            handle.share_qkv_storage([mod.q_proj, mod.k_proj, mod.v_proj])
    handle.n_layers = len(targets)
    handle.kind = "hf"


def unpatch(handle) -> None:
    for mod, had, old in reversed(handle._restore):
        if had:
            mod.forward = old
        else:
            mod.__dict__.pop("forward", None)
    handle._restore.clear()


# ---------------------------------------------------------------- model builders

HF_MODELS = ("gpt2", "bert", "gpt-neo", "roberta")
SIZES = ("tiny", "small", "base")


def build_hf_model(name: str, size: str = "tiny", seed: int = 0, dropout: float | None = None) -> nn.Module:
    """An HF model built from a config (random init, nothing downloaded).

    ``tiny``: 2 layers, hidden 64, 4 heads, vocab 256, 128 positions (tests; dropout 0 unless given).
    ``small`` = ``base``: GPT-2-small / BERT-base / GPT-Neo-125M / RoBERTa-base shapes (12 layers, hidden
    768, 12 heads; config-default dropout) for benchmarks. Returns GPT2LMHeadModel, BertForMaskedLM,
    GPTNeoForCausalLM or RobertaForMaskedLM.
    """
    import transformers as tf

    if name not in HF_MODELS:
        raise ConfigError(f"unknown HF model {name!r} (choose from {', '.join(HF_MODELS)})")
    if size not in SIZES:
        raise ConfigError(f"unknown HF model size {size!r} (choose from {', '.join(SIZES)})")
    tiny = size == "tiny"
    p = 0.0 if (dropout is None and tiny) else dropout
    torch.manual_seed(seed)
    if name == "gpt2":
        kw = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128, bos_token_id=0,
                  eos_token_id=0) if tiny else {}
        if p is not None:
            kw.update(resid_pdrop=p, embd_pdrop=p, attn_pdrop=p)
        model = tf.GPT2LMHeadModel(tf.GPT2Config(**kw))
        # transformers infers the loss from the class name, finds none for "LMHeadModel" and warns before
        # falling back to the causal-LM loss: name that loss up front (same loss, no misleading warning)
        model.loss_type = "ForCausalLM"
        return model
    if name == "gpt-neo":
        kw = (dict(num_layers=2, hidden_size=64, num_heads=4, vocab_size=256, max_position_embeddings=128,
                   attention_types=[[["global", "local"], 1]], window_size=16, bos_token_id=0, eos_token_id=0)
              if tiny else dict(num_layers=12, hidden_size=768, num_heads=12, attention_types=[[["global", "local"], 6]],
                                max_position_embeddings=2048, window_size=256))
        if p is not None:
            kw.update(resid_dropout=p, embed_dropout=p, attention_dropout=p)
        return tf.GPTNeoForCausalLM(tf.GPTNeoConfig(**kw))
    common = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                  vocab_size=256) if tiny else {}
    if p is not None:
        common.update(hidden_dropout_prob=p, attention_probs_dropout_prob=p)
    if name == "bert":
        if tiny:
            common.update(max_position_embeddings=128)
        return tf.BertForMaskedLM(tf.BertConfig(**common))
    if tiny:
        common.update(max_position_embeddings=130, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    else:
        common.update(vocab_size=50265, max_position_embeddings=514, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    return tf.RobertaForMaskedLM(tf.RobertaConfig(**common))
