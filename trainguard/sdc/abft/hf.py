"""HF transformers adapters: GPT-2, BERT, GPT-Neo, RoBERTa, Llama, Mistral and Qwen2 attention through the
protected kernels, a ``TrainerCallback``, and model builders.

Relies on ``transformers`` (5.x; models are built from configs only, no weights are downloaded) and
:mod:`trainguard.sdc.abft.attention`.

**Llama, Mistral, Qwen2** (the causal LMs users train now: grouped-query attention, RoPE, sliding
windows where the config has them) go through transformers' own extension points, not copies of their
forward methods: the attention core (scores, mask, softmax, context) is the attention function
``"trainguard_abft"`` registered with ``AttentionInterface`` (and its mask format, transformers' SDPA
boolean masks, with ``AttentionMaskInterface``); ``protect`` switches the model to it
(``set_attn_implementation``) and ``unprotect`` switches it back. The q / k / v / o projections are the
modules' ``nn.Linear`` layers, each run as a protected GEMM (:func:`~trainguard.sdc.abft.attention.protected_linear`).
Every protected attention module also gets a forward pre-hook and hook that check that all five pieces
(q, k, v, core, output) ran through protection during that forward: if a transformers release stops
calling the attention interface or the projections, the first forward raises ``TrainguardError`` instead
of training unprotected.

**GPT-2, BERT, RoBERTa, GPT-Neo** keep an instance-level ``forward`` on their attention modules (the class
is untouched; :func:`unpatch` deletes the instance attribute, so the original bound method is back
exactly), because their fused QKV GEMM (one GEMM and one check for q, k and v) needs the projections:

* GPT-2 ``GPT2Attention``: fused ``c_attn`` Conv1D (x @ W + b) is one GEMM with one fused check (the
  checksum of the concatenated product is the concatenation of the q / k / v checksums; a flag is resolved
  per product, so q / k / v keep their own names, hooks and counters); scaling ``module.scaling`` (1/sqrt(d),
  and 1/(layer+1) with ``scale_attn_by_inverse_layer_idx``); ``reorder_and_upcast_attn`` computes the
  scores in fp32; ``c_proj`` is section O; the KV cache is updated like the original does.
* BERT / RoBERTa ``BertAttention`` / ``RobertaAttention`` (the outer module, so that the output ``dense``
  of ``BertSelfOutput`` is section O; its dropout + LayerNorm(residual) follow). Bidirectional unless the
  module is causal (decoder config); padding masks as bool or additive masks.
* GPT-Neo ``GPTNeoSelfAttention``: no 1/sqrt(d) scaling, scores in fp32, the module's ``bias`` buffer
  (causal, or sliding-window on ``local`` layers) as an additive mask, plus the attention mask.

Masks: ``None`` (causal iff the module is causal, as SDPA's ``is_causal``), bool (True = attend, the SDPA
convention) or float (added), whatever ``config._attn_implementation`` produced. ``protect`` refuses at
once, with a one-line error, what the kernels do not cover: cross-attention (encoder-decoder or
``add_cross_attention`` configs) and architectures other than these seven.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from trainguard.errors import ConfigError, ShapeError, TrainguardError
from trainguard.sdc.abft.attention import (
    causal_bias,
    conv1d_proj,
    linear_proj,
    protected_attention,
    protected_core,
    protected_linear,
    sliding_causal_bias,
)

SUPPORTED = ("GPT2", "BERT", "GPT-Neo", "RoBERTa", "Llama", "Mistral", "Qwen2")
_KINDS = {"GPT2Attention": "gpt2", "BertAttention": "bert", "RobertaAttention": "bert",
          "GPTNeoSelfAttention": "gpt-neo", "LlamaAttention": "interface", "MistralAttention": "interface",
          "Qwen2Attention": "interface"}
_PACKAGES = ("transformers.models.gpt2.", "transformers.models.bert.", "transformers.models.gpt_neo.",
             "transformers.models.roberta.", "transformers.models.llama.", "transformers.models.mistral.",
             "transformers.models.qwen2.")
INTERFACE = "trainguard_abft"
_STATE = "_trainguard_abft_layer"     # (handle, layer) on an attention module using the interface
_PIECES = frozenset({"q", "k", "v", "core", "output"})


def _targets(model: nn.Module) -> list[tuple[nn.Module, str]]:
    return [(m, _KINDS[type(m).__name__]) for m in model.modules()
            if type(m).__name__ in _KINDS and type(m).__module__.startswith(_PACKAGES)]


def is_supported(model: nn.Module) -> bool:
    return type(model).__module__.startswith(_PACKAGES) and bool(_targets(model))


def refuse_unsupported(model: nn.Module) -> None:
    """One-line ``TrainguardError`` for configurations the kernels do not cover (checked at ``protect``)."""
    cfg = getattr(model, "config", None)
    name = type(model).__name__
    if cfg is not None and (getattr(cfg, "is_encoder_decoder", False) or getattr(cfg, "add_cross_attention", False)):
        raise TrainguardError(f"ABFT protects self-attention only: {name} has cross-attention "
                              "(is_encoder_decoder / add_cross_attention)")
    for mod, _ in _targets(model):
        if getattr(mod, "is_cross_attention", False):
            raise TrainguardError(f"ABFT protects self-attention only: {name} has cross-attention layers")


def _bias_fn(handle, attention_mask, causal: bool, window: int | None = None):
    """The mask as an additive bias (see ``protected_attention``): None -> causal mask (sliding with
    ``window``), or nothing; bool (True = attend) -> finfo.min where masked (``min + scale * s`` rounds to
    ``min`` exactly, as the eager ``masked_fill`` gives, for any |scale * s| < 1e31); float -> itself.
    Made again for every layer (a (B, 1, T, T) pass): a cache filled by the first layer would make a
    forward and its activation-checkpoint recomputation run different ops."""
    def fn(tq: int, tk: int, dtype: torch.dtype, device: torch.device):
        if attention_mask is None:
            if window is not None and tk > window:
                return sliding_causal_bias(tq, tk, window, dtype, device)
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
            bias_fn=_bias_fn(handle, attention_mask, self.is_causal),
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
            scale=sa.scaling, bias_fn=_bias_fn(handle, attention_mask, bool(sa.is_causal)),
            kv_update=_cache_update(past_key_values, sa.layer_idx),
            dropout_p=sa.dropout.p if self.training else 0.0)
        out = self.output.LayerNorm(self.output.dropout(out) + hidden_states)
        return out, probs
    return forward


def _neo_forward(handle, layer):
    def forward(self, hidden_states, attention_mask=None, layer_past=None, use_cache=False,
                output_attentions=False, **kwargs):
        def bias_fn(tq, tk, dtype, device):
            # the module's causal (or local: sliding-window) pattern, then the attention mask, as the eager
            # forward applies them (where(causal, s, min) + mask), saturated at the dtype's minimum
            allowed = self.bias[:, :, tk - tq: tk, :tk]
            bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
            if attention_mask is not None:
                am = _bias_fn(handle, attention_mask, False)(tq, tk, dtype, device)
                bias = (bias + am).clamp_min_(torch.finfo(dtype).min)
            return bias

        out, probs = protected_attention(
            handle, layer, hidden_states, linear_proj(self.q_proj), linear_proj(self.k_proj),
            linear_proj(self.v_proj), linear_proj(self.out_proj), n_heads=self.num_heads, head_dim=self.head_dim,
            scale=1.0, bias_fn=bias_fn, kv_update=_cache_update(layer_past, self.layer_id),
            dropout_p=self.attn_dropout.p if self.training else 0.0, upcast_scores=True)
        return self.resid_dropout(out), probs
    return forward


_FORWARDS = {"gpt2": _gpt2_forward, "bert": _bert_forward, "gpt-neo": _neo_forward}

# ---------------------------------------------------------------- transformers' attention interface

#: keyword arguments of the attention interface that the protected core handles (or that change nothing)
_KNOWN_KWARGS = frozenset({"position_ids", "use_cache", "cache_position", "output_attentions", "is_causal",
                           "sliding_window", "dropout", "scaling"})


def interface_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                        sliding_window=None, **kwargs):
    """The ``"trainguard_abft"`` attention function: scores, mask, softmax and context of a protected
    module through :func:`protected_core` (grouped-query attention without ``repeat_kv``). Returns
    (output (B, T, H, d), probabilities) as transformers' attention functions do."""
    state = getattr(module, _STATE, None)
    if state is None:
        raise TrainguardError(f"attention implementation {INTERFACE!r} on a {type(module).__name__} that ABFT did "
                              "not protect (call trainguard.sdc.abft.protect on the model)")
    handle, layer = state
    extra = sorted(k for k, v in kwargs.items() if k not in _KNOWN_KWARGS and v is not None)
    if extra:
        raise ShapeError(f"ABFT protected attention does not handle attention argument(s) {', '.join(extra)} "
                         f"of {type(module).__name__}")
    handle._ran(layer, "core")
    tq, tk = query.shape[-2], key.shape[-2]
    window = int(sliding_window) if sliding_window else None
    bias = _bias_fn(handle, attention_mask, bool(getattr(module, "is_causal", True)), window)(
        tq, tk, query.dtype if not torch.is_autocast_enabled(query.device.type) else
        torch.get_autocast_dtype(query.device.type), query.device)
    scale = scaling if scaling is not None else module.scaling
    ctx, probs = protected_core(handle, layer, query, key, value, scale=float(scale), bias=bias, dropout_p=float(dropout))
    return ctx.transpose(1, 2).contiguous(), probs


def _register_interface() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(INTERFACE, interface_attention)
    AttentionMaskInterface.register(INTERFACE, sdpa_mask)  # boolean masks, True = attend (None: causal)


def _linear_forward(handle, layer: int, product: str):
    def forward(self, x):
        handle._ran(layer, product)
        return protected_linear(handle, layer, product, x, self)
    return forward


def _interface_pre_hook(handle, layer: int):
    def hook(module, args, kwargs):
        handle._pieces[layer] = set()
    return hook


def _interface_post_hook(handle, layer: int):
    def hook(module, args, kwargs, output):
        missing = _PIECES - handle._pieces.get(layer, set())
        if missing:
            raise TrainguardError(
                f"ABFT: layer {layer} ({type(module).__name__}) ran without protection of {', '.join(sorted(missing))}: "
                "this transformers version no longer calls the attention interface / projections as expected")
    return hook


def _patch_interface(model: nn.Module, targets: list, handle) -> None:
    _register_interface()
    cfg = model.config
    handle._attn_impl = cfg._attn_implementation
    handle._pieces = {}
    for mod, _ in targets:
        layer = int(mod.layer_idx)
        setattr(mod, _STATE, (handle, layer))
        for lin, product in ((mod.q_proj, "q"), (mod.k_proj, "k"), (mod.v_proj, "v"), (mod.o_proj, "output")):
            handle._restore.append((lin, "forward" in lin.__dict__, lin.__dict__.get("forward")))
            lin.forward = types.MethodType(_linear_forward(handle, layer, product), lin)
        handle._hooks.append(mod.register_forward_pre_hook(_interface_pre_hook(handle, layer), with_kwargs=True))
        handle._hooks.append(mod.register_forward_hook(_interface_post_hook(handle, layer), with_kwargs=True))
    model.set_attn_implementation(INTERFACE)


def patch(model: nn.Module, handle) -> None:
    refuse_unsupported(model)
    targets = _targets(model)
    kinds = {k for _, k in targets}
    if "interface" in kinds and len(kinds) > 1:
        raise TrainguardError(f"ABFT: {type(model).__name__} mixes attention kinds {sorted(kinds)}")
    handle._hooks = []
    if kinds == {"interface"}:
        _patch_interface(model, targets, handle)
    else:
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
        if hasattr(mod, _STATE):
            delattr(mod, _STATE)
    handle._restore.clear()
    for h in getattr(handle, "_hooks", []):
        h.remove()
    handle._hooks = []
    if getattr(handle, "_attn_impl", None) is not None:
        for mod in handle.model.modules():
            if hasattr(mod, _STATE):
                delattr(mod, _STATE)
        handle.model.set_attn_implementation(handle._attn_impl)
        handle._attn_impl = None


# ---------------------------------------------------------------- HF Trainer

def trainer_callback(handle, on_escalation: str = "raise"):
    """A ``transformers.TrainerCallback`` for an ABFT-protected model: advances the detection schedule at
    every optimizer step (``on_step_begin``: frequencies below 1 are applied by step, as in trainguard's
    Trainer), adds the per-section counters to the Trainer's logs (``abft_AS_detected``, ...), and, because
    the HF Trainer cannot re-execute a step, stops training *before* the optimizer applies a step whose
    faults were escalated (``on_pre_optimizer_step`` raises ``TrainguardError``: resume from the last
    checkpoint; ``on_escalation="log"`` only logs ``abft_escalations``)."""
    from transformers import TrainerCallback

    if on_escalation not in ("raise", "log"):
        raise ConfigError(f"on_escalation must be 'raise' or 'log', got {on_escalation!r}")

    class ABFTCallback(TrainerCallback):
        def __init__(self):
            self.handle = handle
            self.escalated_steps = 0

        def on_step_begin(self, args, state, control, **kwargs):
            handle.set_step(state.global_step)
            handle.begin_attempt()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if handle.escalations:
                self.escalated_steps += 1
                if on_escalation == "raise":
                    e = handle.escalations[0]
                    raise TrainguardError(f"ABFT: step {state.global_step} has an unrepaired fault at layer "
                                          f"{e['layer']} {e['product']} ({e['reason']}); stopped before the "
                                          "optimizer update: resume from the last checkpoint")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs is not None:
                logs.update({f"abft_{s}_{k}": n for s, c in handle.counters.items() for k, n in c.items()})
                logs["abft_escalated_steps"] = self.escalated_steps

    return ABFTCallback()


# ---------------------------------------------------------------- model builders

HF_MODELS = ("gpt2", "bert", "gpt-neo", "roberta", "llama", "mistral", "qwen2")
SIZES = ("tiny", "small", "base")


def build_hf_model(name: str, size: str = "tiny", seed: int = 0, dropout: float | None = None,
                   positions: int | None = None) -> nn.Module:
    """An HF model built from a config (random init, nothing downloaded).

    ``tiny``: 2 layers, hidden 64, 4 heads, vocab 256, 128 positions, or ``positions`` where that is more
    (a 128-token campaign sequence needs 130 with the room the encoders keep) (tests; dropout 0 unless given; Llama,
    Mistral and Qwen2 with 2 key/value heads (grouped-query attention), Mistral with a 16-token sliding
    window on every layer, Qwen2 with it on its second layer). ``small`` = ``base``: GPT-2-small /
    BERT-base / GPT-Neo-125M / RoBERTa-base shapes (12 layers, hidden 768, 12 heads; config-default
    dropout), and for Llama / Mistral / Qwen2 the same width with 4 key/value heads, SwiGLU 2048 and a
    32000 vocabulary. Returns GPT2LMHeadModel, BertForMaskedLM, GPTNeoForCausalLM, RobertaForMaskedLM,
    LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM.
    """
    import transformers as tf

    if name not in HF_MODELS:
        raise ConfigError(f"unknown HF model {name!r} (choose from {', '.join(HF_MODELS)})")
    if size not in SIZES:
        raise ConfigError(f"unknown HF model size {size!r} (choose from {', '.join(SIZES)})")
    tiny = size == "tiny"
    # positions beyond 128 only where asked: a tiny model of 128 positions keeps its seeded weights
    npos = max(128, positions or 0)
    p = 0.0 if (dropout is None and tiny) else dropout
    torch.manual_seed(seed)
    if name in ("llama", "mistral", "qwen2"):
        kw = (dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=npos, bos_token_id=0,
                   eos_token_id=0, pad_token_id=0)
              if tiny else dict(num_hidden_layers=12, hidden_size=768, intermediate_size=2048,
                                num_attention_heads=12, num_key_value_heads=4, vocab_size=32000,
                                max_position_embeddings=2048))
        if p is not None:
            kw["attention_dropout"] = p
        if name == "llama":
            return tf.LlamaForCausalLM(tf.LlamaConfig(**kw))
        if name == "mistral":
            return tf.MistralForCausalLM(tf.MistralConfig(sliding_window=16 if tiny else 4096, **kw))
        layers = kw["num_hidden_layers"]
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(use_sliding_window=True, sliding_window=16 if tiny else 4096,
                                                  max_window_layers=layers // 2, **kw))
    if name == "gpt2":
        kw = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=npos, bos_token_id=0,
                  eos_token_id=0) if tiny else {}
        if p is not None:
            kw.update(resid_pdrop=p, embd_pdrop=p, attn_pdrop=p)
        model = tf.GPT2LMHeadModel(tf.GPT2Config(**kw))
        # transformers infers the loss from the class name, finds none for "LMHeadModel" and warns before
        # falling back to the causal-LM loss: name that loss up front (same loss, no misleading warning)
        model.loss_type = "ForCausalLM"
        return model
    if name == "gpt-neo":
        kw = (dict(num_layers=2, hidden_size=64, num_heads=4, vocab_size=256, max_position_embeddings=npos,
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
            common.update(max_position_embeddings=npos)
        return tf.BertForMaskedLM(tf.BertConfig(**common))
    if tiny:
        common.update(max_position_embeddings=npos + 2, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    else:
        common.update(vocab_size=50265, max_position_embeddings=514, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    return tf.RobertaForMaskedLM(tf.RobertaConfig(**common))
