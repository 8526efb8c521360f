"""Fault-propagation study (ATTNChecker Sec. 3, Tables 2 and 4) on HF GPT-2, BERT, GPT-Neo, RoBERTa and
Llama, and on trainguard's LLaMA presets.

For each attention product (q, k, v, scores = AS, context = CL, output = O) and fault type (INF, NaN,
near-INF), one element of that product is corrupted in one layer of a training step of an *unprotected*
model (the protected kernel with its checks off, ``ABFTConfig(check=False)``: the same computation, and
its product hooks reach every product and the softmax output); the pattern of abnormal values
(non-finite, or |x| > 1e10) is then read off every downstream matrix of that layer: Q, K, V, AS, AP
(softmax probabilities), CL, O. Patterns: ``0D`` (one element), ``1R`` (one row), ``1C`` (one column),
``2D`` (several rows and columns), ``-`` (none), with the abnormal value types seen (INF / NaN / nINF).
Matrices are the per-(batch, head) 2-D slices the paper uses (rows = query tokens; K and V split by
their own, possibly fewer, key/value heads).

Non-trainable (Table 4): the faulty step is followed by ``steps_after`` fault-free AdamW steps (fresh
optimizer state per trial, on new batches); the trial is non-trainable if any of those steps' loss is
NaN/INF or any parameter is non-finite at the end. One SGD step (the previous criterion) under-counts:
a NaN or a huge value that reaches AdamW's second moments does its damage on the following steps.
The paper's Tables 2 and 4 are in :data:`PAPER_TABLE2` / ``frequency.PHI_TABLE``; ``StudyResult`` reports
the measured probabilities beside them and the share of Table 2's pattern shapes reproduced.

What decides the near-INF rows: flipping the exponent's top bit multiplies |x| < 1 by 2^(emax+1) (2^128
in fp32 and bf16, 2^16 in fp16), i.e. to about |x| times the format's largest value, so whether anything
overflows does not depend on the format but on magnitudes: the struck element itself becomes INF / NaN
when 1 <= |x| < 2 (the exponent field becomes all ones), and a near-INF q_il makes AS_ij INF only where
|q_il k_jl alpha| >~ 1. Only an INF / NaN in a row of AS makes the softmax row NaN (INF - INF); a finite
near-INF row gives a one-hot row, and nothing downstream is abnormal. Randomly initialised narrow models
have |q|, |k|, |AS| well below 1 (hidden 64: |q| < 0.8), so no near-INF injection there reaches AP. Trained
ones do, in some trials: ``pretrain_steps`` trains the model on the default corpus before the study (300
AdamW steps take a tiny model to |AS| >= 1 in half the scores), standing in for the paper's pretrained
checkpoints, which cannot be downloaded here.
``StudyResult.injected_nonfinite`` is the share of trials in which the injected value was INF / NaN.
``dtype``: ``fp32`` or ``bf16`` (autocast, as the campaign and ``train.dtype``); the faults strike the
products in the dtype they are computed in.
Relies on torch and transformers (HF models built from config).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from trainguard.errors import ConfigError
from trainguard.faults.bits import FaultModel

PRODUCTS = ("q", "k", "v", "scores", "context", "output")
OBSERVED = ("Q", "K", "V", "AS", "AP", "CL", "O")
_NAME = {"q": "Q", "k": "K", "v": "V", "scores": "AS", "probs": "AP", "context": "CL", "output": "O"}
NEAR_INF = 1e10
MODELS = ("gpt2", "bert", "gpt-neo", "roberta", "llama", "mistral", "qwen2")

#: ATTNChecker Table 2 (all four models): pattern shape of each downstream matrix, by fault type and the
#: matrix the fault was injected into (value types vary by model and are not compared)
PAPER_TABLE2: dict[str, dict[str, dict[str, str]]] = {
    fault: {"Q": {"AS": "1R", "AP": "1R", "CL": "1R", "O": "1R"},
            "K": {"AS": "1C", "AP": "2D", "CL": "2D", "O": "2D"},
            "V": {"CL": "1C", "O": "2D"},
            "AS": {"AP": "1R", "CL": "1R", "O": "1R"},
            "CL": {"O": "1R"}}
    for fault in ("inf", "nan", "near-inf")
}


def pattern(t: torch.Tensor, heads: int | None) -> tuple[str, set[str]]:
    """Worst pattern of abnormal elements over the 2-D (rows, cols) slices of ``t``."""
    x = t.detach().float()
    if x.dim() == 3 and heads:  # (B, T, D): split heads so a slice is (T, head_dim)
        b, s, d = x.shape
        x = x.view(b, s, heads, d // heads).transpose(1, 2)
    x = x.reshape(-1, x.shape[-2], x.shape[-1])
    nan, inf = torch.isnan(x), torch.isinf(x)
    big = torch.isfinite(x) & (x.abs() > NEAR_INF)
    bad = nan | inf | big
    kinds = {k for k, m in (("NaN", nan), ("INF", inf), ("nINF", big)) if bool(m.any())}
    worst = "-"
    rank = {"-": 0, "0D": 1, "1R": 2, "1C": 2, "2D": 3}
    for m in bad:
        n = int(m.sum())
        if n == 0:
            continue
        rows, cols = int(m.any(1).sum()), int(m.any(0).sum())
        p = "0D" if n == 1 else "1R" if rows == 1 else "1C" if cols == 1 else "2D"
        if rank[p] > rank[worst] or (rank[p] == rank[worst] == 2 and p != worst):
            worst = p if rank[p] > rank[worst] else "1R+1C"
    return worst, kinds


@dataclass
class StudyResult:
    model: str
    trials: int
    steps_after: int = 0
    size: str = "tiny"
    dtype: str = "fp32"
    pretrain_steps: int = 0
    table: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)  # fault -> product -> observed -> pattern
    non_trainable: dict[str, dict[str, float]] = field(default_factory=dict)  # fault -> product -> probability
    paper_non_trainable: dict[str, dict[str, float | None]] = field(default_factory=dict)
    table2_agreement: float = math.nan   # share of the paper's Table 2 cells whose pattern shape is reproduced
    table2_mismatches: list[str] = field(default_factory=list)
    # fault -> product -> share of trials whose injected value was INF / NaN (1 for inf / nan; for near-INF:
    # the struck element had 1 <= |x| < 2)
    injected_nonfinite: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "size": self.size, "dtype": self.dtype, "trials": self.trials,
                "steps_after": self.steps_after,
                "pretrain_steps": self.pretrain_steps, "table": self.table,
                "non_trainable": self.non_trainable, "paper_non_trainable": self.paper_non_trainable,
                "table2_agreement": self.table2_agreement, "table2_mismatches": self.table2_mismatches,
                "injected_nonfinite": self.injected_nonfinite}

    def phi(self) -> dict[str, dict[str, float]]:
        """The measured probabilities as ``frequency.optimize_frequencies(phi=...)`` takes them
        (fault -> product name -> probability)."""
        inv = {v: k for k, v in _NAME.items()}
        return {f: {inv[p]: v for p, v in row.items()} for f, row in self.non_trainable.items()}


def _heads(model) -> tuple[int, int]:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return model.cfg.n_heads, model.cfg.n_heads
    h = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None) or cfg.num_heads
    return int(h), int(getattr(cfg, "num_key_value_heads", None) or h)


def _paper_phi(model_name: str) -> dict[str, dict[str, float | None]]:
    from trainguard.sdc.abft.frequency import PAPER_PHI

    key = {"gpt2": "gpt2", "bert": "bert", "gpt-neo": "gpt-neo", "roberta": "roberta"}.get(model_name)
    table = PAPER_PHI.get(key) if key else None
    return {f: {_NAME[p]: (table[f][p] if table and p in table[f] else None) for p in PRODUCTS}
            for f in ("inf", "nan", "near-inf")}


def run_study(model_name: str = "llama-tiny", trials: int = 10, seed: int = 0, seq_len: int = 32, batch: int = 2,
              faults: tuple[str, ...] = ("inf", "nan", "near-inf"), progress: bool = True, size: str = "tiny",
              products: tuple[str, ...] = PRODUCTS, steps_after: int = 3, lr: float = 1e-3,
              dtype: str = "fp32", pretrain_steps: int = 0, pretrain_lr: float = 3e-3) -> StudyResult:
    """``size``: HF model shape (``tiny``: hidden 64; ``small`` / ``base``: GPT-2-small / BERT-base widths);
    LLaMA presets take theirs from their name. ``dtype``: ``fp32`` or ``bf16`` autocast (CPU).
    ``pretrain_steps``: AdamW steps (``pretrain_lr``, batch 8 x ``seq_len``) on the default corpus before the
    study, so the injections strike a trained model (the paper's are fine-tuned from pretrained checkpoints),
    and the study's own batches are then corpus text too; 0: the randomly initialised model on random tokens."""
    from trainguard.sdc.abft import ABFTConfig, protect
    from trainguard.sdc.abft.campaign import autocast, build, max_positions, vocab_size

    if model_name not in MODELS and not model_name.startswith("llama-"):
        raise ConfigError(f"unknown model {model_name!r} for the study (choose from {', '.join(MODELS)} or a "
                          "trainguard LLaMA preset such as llama-tiny)")
    if trials < 1:
        raise ConfigError(f"--trials must be >= 1, got {trials}")
    if seq_len < 1 or batch < 1:
        raise ConfigError(f"--seq-len and --batch must be >= 1, got {seq_len} and {batch}")
    if steps_after < 0:
        raise ConfigError(f"--steps-after must be >= 0, got {steps_after}")
    if pretrain_steps < 0:
        raise ConfigError(f"--pretrain-steps must be >= 0, got {pretrain_steps}")
    bad = [p for p in products if p not in PRODUCTS]
    if bad:
        raise ConfigError(f"unknown product(s) {bad} (choose from {', '.join(PRODUCTS)})")
    autocast(dtype, "cpu")  # refuses an unknown dtype before the model is built
    size = size if not model_name.startswith("llama-") else "tiny"
    model, run = build(model_name, size=size, seed=seed)
    if seq_len > max_positions(model) - 2:
        raise ConfigError(f"--seq-len {seq_len} exceeds what {model_name} supports ({max_positions(model) - 2})")
    model.train()
    heads, kv_heads = _heads(model)
    g = torch.Generator().manual_seed(seed)
    vocab = min(256, vocab_size(model))
    if pretrain_steps:
        text = _corpus_batches(vocab, seq_len, g)
        _pretrain(model, run, pretrain_steps, pretrain_lr, text, dtype, progress)
        xs = [text(batch) for _ in range(steps_after + 1)]
    else:
        xs = [torch.randint(3, vocab, (batch, seq_len), generator=g) for _ in range(steps_after + 1)]
    handle = protect(model, ABFTConfig(check=False))
    snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
    n_layers = handle.n_layers
    result = StudyResult(model_name, trials, steps_after, size, dtype, paper_non_trainable=_paper_phi(model_name),
                         pretrain_steps=pretrain_steps)
    from trainguard.utils import TaskBar

    bar = TaskBar(progress, f"study attention {model_name}", len(faults) * len(products) * trials)
    try:
        for fault in faults:
            fm = FaultModel(fault)
            result.table[fault], result.non_trainable[fault], result.injected_nonfinite[fault] = {}, {}, {}
            for product in products:
                seen: dict[str, tuple[str, set[str]]] = {}
                bad_runs = nonfinite = 0
                for _ in range(trials):
                    model.load_state_dict(snapshot)
                    opt = torch.optim.AdamW(model.parameters(), lr=lr)
                    layer = int(torch.randint(n_layers, (1,), generator=g))
                    captured: dict[str, torch.Tensor] = {}
                    state: dict[str, Any] = {"done": False, "new": 0.0}

                    def hook(lyr, name, t, state=state, captured=captured, product=product, fm=fm, layer=layer):
                        if lyr != layer or name not in _NAME or name.startswith("grad_"):
                            return None
                        if name == product and not state["done"]:
                            state["done"] = True
                            state["new"] = fm.apply(t, int(torch.randint(t.numel(), (1,), generator=g)), g)[1]
                        if state["done"] or name in ("q", "k", "v"):
                            captured.setdefault(_NAME[name], t.detach().clone())
                        return None

                    remove = handle.add_fault_hook(hook)
                    nontrainable = False
                    for i, x in enumerate(xs):
                        opt.zero_grad(set_to_none=True)
                        with autocast(dtype, "cpu"):
                            loss, _ = run(model, x)
                        if i == 0:
                            remove()
                        loss.backward()
                        opt.step()
                        if not math.isfinite(float(loss.detach())):
                            nontrainable = True
                            break
                    nontrainable = nontrainable or any(not bool(torch.isfinite(p).all()) for p in model.parameters())
                    bad_runs += nontrainable
                    nonfinite += not math.isfinite(state["new"])
                    for obs in OBSERVED:
                        if obs not in captured:
                            continue
                        # Q, K, V, O are (B, T, D) projections: split heads (K / V by their own heads);
                        # AS, AP, CL are per head already
                        hd = heads if obs == "Q" else kv_heads if obs in ("K", "V") else None
                        p, kinds = pattern(captured[obs], hd)
                        prev = seen.get(obs)
                        if prev is None or _rank(p) > _rank(prev[0]):
                            seen[obs] = (p, kinds | (prev[1] if prev else set()))
                        else:
                            seen[obs] = (prev[0], prev[1] | kinds)
                    bar.advance(f"{fault} in {product}")
                inj = _NAME[product]
                upstream = OBSERVED[: OBSERVED.index(inj)] if inj not in ("Q", "K", "V") else ()
                result.table[fault][inj] = {
                    obs: ("" if obs in upstream or obs not in seen else
                          (seen[obs][0] if seen[obs][0] == "-" else f"{seen[obs][0]} {'/'.join(sorted(seen[obs][1]))}"))
                    for obs in OBSERVED}
                result.non_trainable[fault][inj] = bad_runs / trials
                result.injected_nonfinite[fault][inj] = nonfinite / trials
    finally:
        bar.stop()
        from trainguard.sdc.abft import unprotect

        unprotect(model)
    _compare_table2(result)
    return result


def _corpus_batches(vocab: int, seq_len: int, g: torch.Generator):
    """Batches of byte-tokenized text from the default corpus (the Python standard library's sources)."""
    from trainguard.data.corpus import load_corpus

    stream = load_corpus(max_bytes=4_000_000).train.long() % vocab

    def sample(batch: int) -> torch.Tensor:
        start = torch.randint(0, len(stream) - seq_len, (batch,), generator=g).tolist()
        return torch.stack([stream[i: i + seq_len] for i in start])

    return sample


def _pretrain(model, run, steps: int, lr: float, text, dtype: str, progress: bool) -> None:
    from trainguard.sdc.abft.campaign import autocast
    from trainguard.utils import TaskBar

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    bar = TaskBar(progress, "pre-training on the default corpus", steps)
    try:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            with autocast(dtype, "cpu"):
                loss, _ = run(model, text(8))
            loss.backward()
            opt.step()
            bar.advance(f"loss {float(loss.detach()):.2f}")
    finally:
        bar.stop()


def _compare_table2(result: StudyResult) -> None:
    hits = total = 0
    for fault, rows in result.table.items():
        for inj, row in rows.items():
            for obs, shape in PAPER_TABLE2.get(fault, {}).get(inj, {}).items():
                got = row.get(obs, "").split(" ")[0]
                total += 1
                if got == shape:
                    hits += 1
                else:
                    result.table2_mismatches.append(f"{fault} in {inj} -> {obs}: paper {shape}, measured {got or '-'}")
    result.table2_agreement = hits / total if total else math.nan


def _rank(p: str) -> float:
    return {"-": 0, "0D": 1, "1R": 2, "1C": 2, "1R+1C": 2.5, "2D": 3}[p]
