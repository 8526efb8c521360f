"""ABFT fault campaigns on LLaMA and HF models (``trainguard campaign abft``; the benchmark,
``trainguard bench abft``, is in ``bench.py``).

A campaign is a client of :func:`trainguard.faults.run_campaign`: each trial is one training step
(forward + backward) of the protected model with a set of faults written into attention products through
the fault injector's :class:`~trainguard.faults.ProductSite` (the model's product hooks: the GEMM's output
before its check, the output of a non-GEMM step, or a backward product), with :class:`ABFTGuard` in the
loop: an attempt the guard turns into a retry verdict is run again from its start (the faults are
transient: each fires once), at most ``max_retries`` times. The logits and every parameter gradient of
the step that is kept are compared with the fault-free step, for every trial whatever happened in it,
and classified by :func:`trainguard.faults.classify`: ``masked``, ``corrected``, ``recomputed``,
``step_retried``, ``detected`` (a reported failure), ``silent``, ``wrong_after_correction``.

Fault classes (``fault``): ``inf``, ``nan``, ``near-inf`` (ATTNChecker's: the exponent's top bit),
``bitflip`` (one random bit of any field); ``multi``: several errors in one product, in a pattern drawn
per trial (:data:`PATTERNS`: two in a column, two in a row, a 2x2 block, an L of three), each element's
fault drawn from the four single kinds; ``nongemm``: one fault, of a kind drawn from the four, in the
output of a non-GEMM step (:data:`~trainguard.sdc.abft.attention.NONGEMM_PRODUCTS`: scaled scores, masked
scores, softmax output). With ``backward=True`` the backward GEMMs are checked and faults are drawn over
the backward products too. Encoder models (BERT, RoBERTa) run with a padded second sequence, so their
masking step exists. Relies on torch and transformers (HF models, built from config).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from trainguard.errors import ConfigError
from trainguard.faults import Fault, FaultModel, Injector, ProductSite, TrialOutcome
from trainguard.faults import run_campaign as run_fault_campaign
from trainguard.train.device import device_named
from trainguard.train.guards import StepContext

MODELS = ("llama-tiny", "gpt2", "bert", "gpt-neo", "roberta", "llama", "mistral", "qwen2")
FAULTS = ("inf", "nan", "near-inf", "bitflip", "multi", "nongemm")
SINGLE = ("inf", "nan", "near-inf", "bitflip")
PATTERNS = ("two-in-column", "two-in-row", "block-2x2", "l-shape")
ENCODERS = ("bert", "roberta")
DTYPES = ("fp32", "bf16")
MAX_TINY_SEQ_LEN = 510


def sites() -> tuple[str, ...]:
    from trainguard.sdc.abft import NONGEMM_PRODUCTS, PRODUCTS

    return (*PRODUCTS, *NONGEMM_PRODUCTS, "any")


def build(name: str, size: str = "tiny", seed: int = 0, seq_len: int | None = None):
    """(model, run(model, x) -> (loss, logits)) for a campaign/bench model name; a tiny HF model gets the
    positions ``seq_len`` needs (with the two the encoders reserve)."""
    if name not in MODELS and not name.startswith("llama-"):
        raise ConfigError(f"unknown model {name!r} (choose from {', '.join(MODELS)})")
    if name.startswith("llama-"):
        from trainguard.models import build_model, lm_loss

        model = build_model(name, seed=seed, attention="explicit")

        def run(m, x, mask=None):
            logits = m(x)
            return lm_loss(logits[:, :-1], x[:, 1:]), logits

        return model, run
    from trainguard.sdc.abft.hf import build_hf_model

    # at most 512 positions: a longer --seq-len is refused below rather than building a model for it
    positions = None if seq_len is None else min(seq_len, MAX_TINY_SEQ_LEN) + 2
    model = build_hf_model(name, size, seed=seed, dropout=0.0, positions=positions)

    def run(m, x, mask=None):
        out = m(input_ids=x, labels=x, attention_mask=mask)
        return out.loss, out.logits

    return model, run


def autocast(dtype: str, device_type: str):
    """The forward's precision for a ``--dtype`` of :data:`DTYPES`: bf16 autocast (fp32 master weights, as
    ``train.dtype=bf16``), or fp32 (autocast off)."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return torch.autocast(device_type, enabled=False)


def vocab_size(model) -> int:
    return int(getattr(getattr(model, "config", None), "vocab_size", None) or model.cfg.vocab_size)


def max_positions(model) -> int:
    cfg = getattr(model, "config", None)
    return int(getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
               or model.cfg.max_seq_len)


@dataclass
class CampaignResult:
    model: str
    fault: str
    site: str
    dtype: str
    size: str = "tiny"
    batch: int = 0
    seq_len: int = 0
    device: str = "cpu"
    backward: bool = False
    trials: int = 0
    detected: int = 0                # trials in which some check flagged
    corrected: int = 0               # classes (trainguard.faults.classify), each trial in exactly one
    recomputed: int = 0
    step_retried: int = 0
    reported_failure: int = 0
    masked: int = 0
    silent: int = 0
    wrong_after_correction: int = 0
    uncorrectable: int = 0           # trials with a flag EEC-ABFT could not correct (then recomputed or escalated)
    unreached: int = 0
    false_positives: int = 0         # flags in fault-free steps
    clean_checks: int = 0
    max_abs_error_after_correction: float = 0.0   # over corrected / recomputed / retried trials
    max_abs_error_masked: float = 0.0
    tolerance: float = 0.0
    max_retries: int = 0
    by_product: dict[str, dict[str, int]] = field(default_factory=dict)
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)   # fault kind or multi pattern -> classes
    bad_trials: list[dict[str, Any]] = field(default_factory=list)     # silent / wrong_after_correction records

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ABFTTrial:
    """One protected model and its fault-free reference step; ``trial(faults, i)`` runs one faulty step
    (with retries on escalation) and returns a :class:`~trainguard.faults.TrialOutcome`."""

    def __init__(self, model_name: str, size: str, dtype: str, batch: int, seq_len: int, backward: bool,
                 device: torch.device, seed: int, max_retries: int = 3):
        from trainguard.sdc.abft import ABFTConfig, protect
        from trainguard.sdc.abft.guard import ABFTGuard

        torch.manual_seed(seed)
        self.model, self.run = build(model_name, size=size, seed=seed, seq_len=seq_len)
        self.model.to(device)
        if seq_len > max_positions(self.model) - 2:
            raise ConfigError(f"--seq-len {seq_len} exceeds what {model_name} supports ({max_positions(self.model) - 2})")
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(3, min(256, vocab_size(self.model)), (batch, seq_len), generator=g).to(device)
        self.mask = None
        if model_name in ENCODERS and batch > 1 and seq_len > 4:
            self.mask = torch.ones(batch, seq_len, dtype=torch.long, device=device)
            self.mask[-1, seq_len - max(1, seq_len // 4):] = 0  # padding in the last sequence
        self.dtype, self.device, self.max_retries = dtype, device, max_retries
        self.handle = protect(self.model, ABFTConfig(backward=backward))
        self.guard = ABFTGuard(self.handle)
        self.shapes: dict[tuple[int, str], tuple[int, ...]] = {}

        def probe(layer, name, t):
            self.shapes.setdefault((layer, name), tuple(t.shape))

        remove = self.handle.add_fault_hook(probe)
        self.reference = self._state(self._step())
        remove()
        self.false_positives = self.handle.total()["detected"]
        self.clean_checks = self._checks()
        scale = max(float(self.reference["logits"].abs().max()), 1.0)
        self.tolerance = (1e-4 if dtype == "fp32" else 2e-2) * scale

    def _checks(self) -> int:
        from trainguard.sdc.abft import PRODUCTS

        n = len(PRODUCTS) * (2 if self.handle.cfg.backward else 1) + 2  # + masked / probs checks
        return self.handle.n_layers * n

    def _step(self):
        m = self.model
        m.zero_grad(set_to_none=True)
        dev = self.device.type
        with autocast(self.dtype, dev):
            loss, logits = self.run(m, self.x, self.mask)
        loss.backward()
        return loss, logits

    def _state(self, step) -> dict[str, torch.Tensor]:
        loss, logits = step
        out = {"logits": logits.detach().float().cpu()}
        for n, p in self.model.named_parameters():
            if p.grad is not None:
                out[f"grad/{n}"] = p.grad.detach().float().cpu()
        return out

    def clean_step_flags(self) -> int:
        self.handle.reset_counters()
        self._step()
        return self.handle.total()["detected"]

    def __call__(self, faults: list[Fault], trial: int) -> TrialOutcome:
        h = self.handle
        h.reset_counters()
        injector = Injector(list(faults), seed=trial).attach_model(self.model)
        attempt, failed = 0, False
        try:
            while True:
                ctx = StepContext(trainer=None, step=0, attempt=attempt)
                self.guard.on_step_start(ctx)
                with injector.step_context(0):
                    loss, logits = self._step()
                verdict = self.guard.before_update(ctx)
                if verdict.ok:
                    break
                if attempt >= self.max_retries:
                    failed = True
                    break
                self.guard.on_retry(ctx, verdict)
                attempt += 1
        finally:
            injector.detach()
        tot = h.total()
        return TrialOutcome(self._state((loss, logits)), detected=tot["detected"] - tot["false_alarms"],
                            corrected=tot["corrected"], final_loss=float(loss.detach()),
                            records=[r.to_dict() for r in injector.records], reached=not injector.unfired(),
                            recomputed=tot["recomputed"], retried=attempt, failed=failed, tolerance=self.tolerance,
                            info={"uncorrectable": tot["uncorrectable"], "escalated": tot["escalated"]})


def _draw_single(g: torch.Generator, kind: str) -> FaultModel:
    if kind == "bitflip":
        return FaultModel("bitflip", field="any")
    return FaultModel(kind)


def _pattern(g: torch.Generator, shape: tuple[int, ...], name: str) -> list[int] | None:
    """Flat indices of a multi-error pattern in one 2-D slice (rows = dim -2, columns = dim -1)."""
    if len(shape) < 2 or shape[-1] < 2 or shape[-2] < 2:
        return None
    m, n = shape[-2], shape[-1]
    batch = math.prod(shape[:-2]) if len(shape) > 2 else 1

    def pick(k):
        return int(torch.randint(k, (1,), generator=g))

    def two(k):
        a = pick(k)
        b = (a + 1 + pick(k - 1)) % k
        return a, b

    b0 = pick(batch)
    if name == "two-in-column":
        (r1, r2), c = two(m), pick(n)
        cells = [(r1, c), (r2, c)]
    elif name == "two-in-row":
        r, (c1, c2) = pick(m), two(n)
        cells = [(r, c1), (r, c2)]
    elif name == "block-2x2":
        (r1, r2), (c1, c2) = two(m), two(n)
        cells = [(r1, c1), (r1, c2), (r2, c1), (r2, c2)]
    else:  # l-shape: a row pair and a column pair sharing one corner
        (r1, r2), (c1, c2) = two(m), two(n)
        cells = [(r1, c1), (r1, c2), (r2, c1)]
    return [b0 * m * n + r * n + c for r, c in cells]


def draw_faults(trial: ABFTTrial, fault: str, site: str, trials: int, g: torch.Generator,
                backward: bool) -> list[tuple[str, list[Fault]]]:
    """(kind label, faults of the trial) for ``trials`` trials, drawn with ``g``."""
    from trainguard.sdc.abft import BACKWARD_PRODUCTS, NONGEMM_PRODUCTS, PRODUCTS

    reached = {p for (_, p) in trial.shapes}
    if fault == "nongemm":
        if site not in ("any", *NONGEMM_PRODUCTS):
            raise ConfigError(f"--fault nongemm takes --site any or one of {', '.join(NONGEMM_PRODUCTS)}")
        pool = [p for p in NONGEMM_PRODUCTS if (site == "any" or p == site) and p in reached]
    elif site != "any":
        pool = [site]
    else:
        pool = list(PRODUCTS)
        if backward:
            pool += [p for pair in BACKWARD_PRODUCTS.values() for p in pair]
    pool = [p for p in pool if p in reached] or pool
    out = []
    layers = trial.handle.n_layers
    for _ in range(trials):
        layer = int(torch.randint(layers, (1,), generator=g))
        product = pool[int(torch.randint(len(pool), (1,), generator=g))]
        site_ = ProductSite(product, layer, 0)
        if fault == "multi":
            shape = trial.shapes.get((layer, product), ())
            name = PATTERNS[int(torch.randint(len(PATTERNS), (1,), generator=g))]
            idx = _pattern(g, shape, name)
            if idx is None:
                raise ConfigError(f"product {product} of shape {shape} is too small for a multi-error pattern")
            faults = [Fault(site_, _draw_single(g, SINGLE[int(torch.randint(len(SINGLE), (1,), generator=g))]),
                            step=0, index=i) for i in idx]
            out.append((name, faults))
        else:
            kind = SINGLE[int(torch.randint(len(SINGLE), (1,), generator=g))] if fault == "nongemm" else fault
            out.append((kind, [Fault(site_, _draw_single(g, kind), step=0)]))
    return out


def run_campaign(model_name: str = "llama-tiny", fault: str = "nan", site: str = "any", trials: int = 20,
                 seed: int = 0, seq_len: int = 32, batch: int = 2, dtype: str = "fp32", progress: bool = True,
                 backward: bool = False, size: str = "tiny", device: str = "cpu",
                 max_retries: int = 3) -> CampaignResult:
    """``size``: shape of an HF model (``tiny``: 2 layers x 64; ``small`` / ``base``: GPT-2-small /
    BERT-base shapes); LLaMA presets take their shape from their name. ``device``: ``cpu``, ``cuda`` or
    ``auto`` (:func:`trainguard.train.device.device_named`); the fault positions come from a CPU generator,
    so a seed draws the same trials on either device."""
    if fault not in FAULTS:
        raise ConfigError(f"unknown fault {fault!r} (choose from {', '.join(FAULTS)})")
    if site not in sites():
        raise ConfigError(f"unknown site {site!r} (choose from {', '.join(sites())})")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if trials < 1 or seq_len < 2 or batch < 1:
        raise ConfigError("trials >= 1, seq-len >= 2 and batch >= 1 are required")
    if size not in ("tiny", "small", "base"):
        raise ConfigError(f"unknown size {size!r} (choose from tiny, small, base)")
    if model_name.startswith("llama-") and size != "tiny":
        raise ConfigError(f"--size applies to HF models; {model_name} takes its shape from its name")
    if max_retries < 0:
        raise ConfigError(f"max_retries must be >= 0, got {max_retries}")
    dev = device_named(device)
    trial = ABFTTrial(model_name, size, dtype, batch, seq_len, backward, dev, seed, max_retries)
    g = torch.Generator().manual_seed(seed)
    drawn = draw_faults(trial, fault, site, trials, g, backward)
    summary = run_fault_campaign(trial, [f for _, f in drawn], trial.reference, progress=progress,
                                 description=f"abft {model_name} {fault}@{site} {dtype}")
    r = CampaignResult(model_name, fault, site, dtype, size, batch, seq_len, dev.type, backward,
                       tolerance=trial.tolerance, max_retries=max_retries)
    r.false_positives = trial.false_positives + trial.clean_step_flags()
    r.clean_checks = 2 * trial.clean_checks
    for (kind, faults), res in zip(drawn, summary.results):
        cls = res.outcome
        key = {"detected": "reported_failure"}.get(cls, cls)
        setattr(r, key, getattr(r, key) + 1)
        r.trials += 1
        flagged = bool(res.info.get("uncorrectable", 0)) or cls not in ("masked", "silent")
        r.detected += flagged
        r.uncorrectable += res.info.get("uncorrectable", 0) > 0
        if cls in ("corrected", "recomputed", "step_retried", "wrong_after_correction"):
            r.max_abs_error_after_correction = max(r.max_abs_error_after_correction, res.max_abs_diff)
        elif cls == "masked":
            r.max_abs_error_masked = max(r.max_abs_error_masked, res.max_abs_diff)
        product = faults[0].site.product
        for bucket in (r.by_product.setdefault(product, {}), r.by_kind.setdefault(kind, {})):
            bucket["trials"] = bucket.get("trials", 0) + 1
            bucket[key] = bucket.get(key, 0) + 1
        if cls in ("silent", "wrong_after_correction"):
            r.bad_trials.append({"trial": res.trial, "class": cls, "kind": kind, "max_abs_diff": res.max_abs_diff,
                                 "nonfinite": res.nonfinite, "faults": res.fault, "records": res.records})
    r.unreached = summary.unreached
    return r
