"""``trainguard plan abft``: ABFT check frequencies (f_AS, f_CL, f_O) for an error rate and a target
coverage (ATTNChecker Algorithm 1, trainguard.sdc.abft.frequency). Registered by ``plan.py``."""

from __future__ import annotations

from trainguard.cli.args import finite_float
from trainguard.cli.output import add_json_flag, console, emit_json, err_console, table

MODELS = {  # attention shape (hidden, heads, layers) and vulnerability profile
    "gpt2": ((768, 12, 12), "gpt2"), "bert": ((768, 12, 12), "bert"), "gpt-neo": ((768, 12, 12), "gpt-neo"),
    "roberta": ((768, 12, 12), "roberta"), "llama-tiny": ((128, 4, 2), "llama"), "llama-60m": ((512, 8, 8), "llama"),
    "llama-130m": ((768, 12, 12), "llama"), "llama-1b": ((2048, 32, 24), "llama"), "llama-7b": ((4096, 32, 32), "llama"),
    "llama": ((768, 12, 12), "llama"), "mistral": ((768, 12, 12), "llama"), "qwen2": ((768, 12, 12), "llama"),
}


def register_plan(subparsers) -> None:
    p = subparsers.add_parser("abft", help="ABFT check frequencies for an error rate and a target coverage")
    p.add_argument("--error-rate", type=finite_float, required=True,
                   help="errors (INF, NaN or near-INF each) per flop, e.g. 2e-24")
    p.add_argument("--target-coverage", type=finite_float, default=1 - 1e-11,
                   help="probability that a step's attention has no unhandled harmful error (default 1-1e-11)")
    p.add_argument("--model", default="bert", choices=sorted(MODELS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--phi-from", default=None, metavar="STUDY_JSON",
                   help="non-trainable probabilities measured by `trainguard study attention --json` (default: "
                        "the ATTNChecker paper's Table 4 for --model)")
    p.add_argument("--costs-from", default=None, metavar="BENCH_JSON",
                   help="per-section check costs measured by `trainguard bench abft --json` (default: flop "
                        "estimates); the attention shape (model, batch, seq-len) is then the benchmark's")
    add_json_flag(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    from trainguard.errors import ConfigError
    from trainguard.sdc.abft.frequency import AttentionShape, optimize_frequencies

    if args.batch < 1 or args.seq_len < 1:
        raise ConfigError(f"--batch and --seq-len must be >= 1, got {args.batch}, {args.seq_len}")
    phi = section_cost = attention_cost = None
    model, batch, seq_len = args.model, args.batch, args.seq_len
    if args.phi_from:
        study = _read_json(args.phi_from, "--phi-from")
        names = {"Q": "q", "K": "k", "V": "v", "AS": "scores", "CL": "context", "O": "output"}
        try:
            phi = {f: {names[m]: float(v) for m, v in row.items() if m in names}
                   for f, row in study["non_trainable"].items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ConfigError(f"--phi-from {args.phi_from}: not a `study attention --json` result") from None
    if args.costs_from:
        b = _read_json(args.costs_from, "--costs-from")
        try:
            section_cost = {s: float(v) for s, v in b["section_check_cost_s"].items()}
            attention_cost = float(b["attention_s"]["plain"])
            model, batch, seq_len = b["model"], int(b["batch"]), int(b["seq_len"])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ConfigError(f"--costs-from {args.costs_from}: not a `bench abft --json` result with section "
                              "costs") from None
        if model not in MODELS:
            raise ConfigError(f"--costs-from {args.costs_from}: model {model!r} has no attention shape here")
    (hidden, heads, layers), profile = MODELS[model]
    shape = AttentionShape(batch, seq_len, hidden, heads, layers)
    plan = optimize_frequencies(args.error_rate, args.target_coverage, shape, profile, section_cost=section_cost,
                                phi=phi, attention_cost=attention_cost)
    out = err_console if args.json else console
    rows = {"f_AS": plan.frequencies["AS"], "f_CL": plan.frequencies["CL"], "f_O": plan.frequencies["O"],
            "failure prob. / step, unprotected": 1 - plan.coverage_unprotected,
            "failure prob. / step, planned": 1 - plan.coverage, "failure prob. / step, target": 1 - plan.target,
            "checksum work vs attention GEMMs (planned)": plan.overhead_fraction,
            "checksum work vs attention GEMMs (f = 1)": plan.overhead_fraction_full,
            "target met": plan.met}
    basis = (f"probabilities {'measured (' + args.phi_from + ')' if phi else 'of the paper (Table 4)'}, "
             f"costs {'measured (' + args.costs_from + ')' if section_cost else 'from flop counts'}")
    if section_cost:  # measured seconds: the fractions are of the attention's own time
        rows["checking time vs attention (planned)"] = rows.pop("checksum work vs attention GEMMs (planned)")
        rows["checking time vs attention (f = 1)"] = rows.pop("checksum work vs attention GEMMs (f = 1)")
    out.print(table(f"trainguard plan abft: {model}, error rate {args.error_rate:g}/flop; {basis}", rows))
    if not plan.met:
        out.print("[yellow]even checking every section on every step cannot reach the target: two errors in one "
                  "section are beyond one-error correction[/yellow]")
    if args.json:
        emit_json({"model": model, "batch": batch, "seq_len": seq_len, "phi_source": args.phi_from or "paper",
                   "cost_source": args.costs_from or "flops", "error_rate": args.error_rate,
                   "target_coverage": args.target_coverage,
                   "f_AS": plan.frequencies["AS"], "f_CL": plan.frequencies["CL"], "f_O": plan.frequencies["O"],
                   "coverage": plan.coverage, "coverage_unprotected": plan.coverage_unprotected,
                   "overhead_fraction": plan.overhead_fraction, "overhead_fraction_full": plan.overhead_fraction_full,
                   "fce": plan.fce, "order": plan.order, "target_met": plan.met})
    return 0


def _read_json(path: str, flag: str):
    import json

    from trainguard.errors import ConfigError

    try:
        with open(path) as fh:
            text = fh.read().strip()
    except OSError as err:
        raise ConfigError(f"{flag} {path}: {err.strerror}") from None
    try:  # a whole file, or the last line of a command's output
        return json.loads(text.splitlines()[-1] if text and text[0] != "{" else text)
    except (json.JSONDecodeError, IndexError):
        raise ConfigError(f"{flag} {path}: not JSON") from None
