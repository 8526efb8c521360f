"""``trainguard bench mecefo``: MeCeFO vs Bamboo, Oobleck and checkpoint-restart: per-step costs measured, cluster
throughput modelled from them, quality from real multi-process runs (``trainguard.failover.mecefo.bench``).
Registered by ``bench.py``.

``--json`` prints one object whose keys per method (``mecefo``, ``bamboo``, ``oobleck``, ``checkpoint_restart``) are
``tokens_per_s_no_failure``, ``tokens_per_s_failures``, ``throughput_drop`` (modelled: ``throughput_modelled`` is
true), ``val_ppl_no_failure``, ``val_ppl_failures`` (real runs); plus ``grad_rel_error_max``,
``neighbor_step_time_ratio``, ``neighbor_peak_memory_ratio``, ``spread`` (``--spread``: the default policy's
neighbors for one failure), ``mecefo_single_neighbor`` (the paper's spread 1, always reported) and the details
(``ablation``, ``ablation_projection``, ``step_costs``,
``peak_memory``, ``by_preset``, ``throughput_drop_by_recovery_min``, ``quality``, ``plot``).
"""

from __future__ import annotations

from pathlib import Path

from trainguard.cli.args import check_figure, comma_items, finite_float, seed_int
from trainguard.cli.output import add_json_flag, console, emit_json, err_console, table
from trainguard.errors import ConfigError

TECHNIQUES = ("skip_mha", "recompute_ffn", "low_rank")


def register_bench(subparsers) -> None:
    p = subparsers.add_parser("mecefo", help="MeCeFO vs Bamboo, Oobleck, checkpoint-restart: throughput and quality")
    p.add_argument("--model", default="llama-60m", help="model preset (default llama-60m)")
    p.add_argument("--tiny", action="store_true", help="a tiny model (dim 32, 1 layer) for a smoke test")
    p.add_argument("--workers", type=int, default=32, help="workers of the modelled cluster (default 32, the paper's)")
    p.add_argument("--failures", default="high", choices=("none", "low", "mid", "high"),
                   help="failure preset: one failure every 2 h / 1 h / 0.5 h of modelled time (default high)")
    p.add_argument("--steps", type=int, default=60, help="steps of each real training run (default 60)")
    p.add_argument("--run-workers", type=int, default=4, help="worker processes of the real runs (default 4)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--batch", type=int, default=4, help="sequences of one worker's step, cost measurement (default 4)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences of one worker's step, real runs (default 1)")
    p.add_argument("--run-grad-accum", type=int, default=1,
                   help="micro-batches of one worker's step, real runs (default 1: an out worker's step cannot spread)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved measurement rounds (default 3)")
    p.add_argument("--lr", type=finite_float, default=3e-3, help="peak learning rate of the real runs (default 3e-3)")
    p.add_argument("--eval-batches", type=int, default=16, help="validation batches (default 16)")
    p.add_argument("--quality-hours", type=finite_float, default=4.0,
                   help="modelled hours the real runs' steps span (default 4)")
    p.add_argument("--recovery-min", type=finite_float, default=10.0,
                   help="minutes until a failed worker is back (default 10)")
    p.add_argument("--real-kills", type=int, default=1, help="failures of the real runs that are real SIGKILLs (default 1)")
    p.add_argument("--techniques", default="all",
                   help="MeCeFO's techniques: all, none, or a comma list of skip_mha, recompute_ffn, low_rank")
    p.add_argument("--rank", type=int, default=128, help="low-rank r (default 128)")
    p.add_argument("--tau", type=int, default=200, help="steps between SVD refreshes (default 200)")
    p.add_argument("--spread", default="auto",
                   help="ring neighbors sharing an out worker's micro-batches: auto (default: the fewest whose "
                        "neighbor step is no slower than a normal step) or an integer (1 = the paper's single neighbor)")
    p.add_argument("--cost-micro-batch", type=int, default=1,
                   help="sequences per micro-batch in the cost measurement (default 1: a worker's step is --batch "
                        "micro-batches, and an out worker's share spreads over up to that many neighbors)")
    p.add_argument("--exact-own", action="store_true", help="a neighbor computes its own micro-batches exactly")
    p.add_argument("--monitor-every", type=int, default=2, help="gradient-error sampling in the MeCeFO run (default 2)")
    p.add_argument("--restart-min", type=finite_float, default=5.0, help="checkpoint-restart: one global restart (default 5)")
    p.add_argument("--checkpoint-s", type=finite_float, default=30.0, help="checkpoint-restart: one checkpoint write (default 30)")
    p.add_argument("--reconfig-s", type=finite_float, default=30.0, help="Oobleck: one reconfiguration (default 30)")
    p.add_argument("--detect-s", type=finite_float, default=1.5, help="elastic methods: one failure detection (default 1.5)")
    p.add_argument("--heal-s", type=finite_float, default=10.0, help="elastic methods: one rejoin (default 10)")
    p.add_argument("--horizon-h", type=finite_float, default=1000.0, help="modelled hours of the throughput model (default 1000)")
    p.add_argument("--no-quality", action="store_true", help="skip the real training runs")
    p.add_argument("--quality-methods", default="mecefo,bamboo,oobleck,checkpoint_restart",
                   help="methods with a real run under the preset (comma list; default all four)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--plot", default="runs/bench-mecefo/mecefo.png", help="figure to write ('' to skip)")
    add_json_flag(p)
    p.set_defaults(handler=run)


def _techniques(text: str) -> dict[str, bool]:
    text = text.strip()
    if text == "all":
        return dict.fromkeys(TECHNIQUES, True)
    if text == "none":
        return dict.fromkeys(TECHNIQUES, False)
    chosen = comma_items(text, "--techniques")
    bad = [t for t in chosen if t not in TECHNIQUES]
    if bad or not chosen:
        raise ConfigError(f"--techniques: unknown {', '.join(bad) or '(none)'} (all, none, or from {', '.join(TECHNIQUES)})")
    return {t: t in chosen for t in TECHNIQUES}


def config_from_args(args):
    from dataclasses import replace

    from trainguard.failover.mecefo.approx import MeCeFOConfig
    from trainguard.failover.mecefo.bench import MeCeFOBenchConfig
    from trainguard.failover.mecefo.cluster import ClusterAssumptions

    if args.plot:
        check_figure(args.plot, "--plot")
    quality_methods = tuple(comma_items(args.quality_methods, "--quality-methods"))
    if not quality_methods and not args.no_quality:
        raise ConfigError(f"--quality-methods names no method, got {args.quality_methods!r} (or pass --no-quality)")
    for name in ("recovery_min", "quality_hours", "horizon_h", "lr"):
        if not getattr(args, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    overrides = dict(dim=32, n_layers=1, n_heads=2, ffn_hidden=64) if args.tiny else {}
    mecefo = replace(MeCeFOConfig(rank=args.rank, tau=args.tau, degrade_own=not args.exact_own,
                                  monitor_every=args.monitor_every, spread=args.spread), **_techniques(args.techniques))
    cluster = ClusterAssumptions(workers=args.workers, recovery_min=args.recovery_min, detect_s=args.detect_s,
                                 heal_s=args.heal_s, reconfig_s=args.reconfig_s, restart_s=args.restart_min * 60.0,
                                 checkpoint_s=args.checkpoint_s, horizon_h=args.horizon_h, seed=args.seed)
    return MeCeFOBenchConfig(
        model=args.model, model_overrides=overrides, workers=args.workers, failures=args.failures, steps=args.steps,
        run_workers=args.run_workers, seq_len=args.seq_len, batch=args.batch, run_micro_batch=args.micro_batch,
        cost_micro_batch=args.cost_micro_batch, run_grad_accum=args.run_grad_accum,
        rounds=args.rounds, lr=args.lr, eval_batches=args.eval_batches, quality_hours=args.quality_hours,
        real_kills=args.real_kills, monitor_every=args.monitor_every, quality=not args.no_quality,
        quality_methods=quality_methods,
        memory=not args.no_memory, threads=args.threads, corpus_max_bytes=300_000 if args.tiny else 4_000_000,
        seed=args.seed, mecefo=mecefo, cluster=cluster).validate()


def _fmt(v, pct: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v:+.2%}" if pct else (f"{v:,.0f}" if abs(v) >= 100 else f"{v:.4g}")


def run(args) -> int:
    from trainguard.failover.mecefo.bench import bench

    cfg = config_from_args(args)
    if args.plot:  # a folder that cannot be made is refused now, not after the benchmark
        from trainguard.cli.commands.plan import _writable_dir

        _writable_dir(str(Path(args.plot).parent), "--plot")
    out = err_console if args.json else console
    out.print(f"bench mecefo: {cfg.model}{' (tiny)' if args.tiny else ''}; step costs measured "
              f"({cfg.batch} x {cfg.seq_len} tokens per worker step); throughput modelled for {cfg.workers} workers "
              f"under '{cfg.failures}'; real runs: {cfg.run_workers} workers x {cfg.steps} steps "
              f"({cfg.token_budget:,} tokens)" + ("" if cfg.quality else " skipped"))
    res = bench(cfg, progress=True, note=lambda text: err_console.print(f"  {text}", markup=False))
    if args.plot:
        from trainguard.report.mecefo_plot import plot_mecefo

        res["plot"] = str(plot_mecefo(res, args.plot))
    rows = [(m, _fmt(res[m]["tokens_per_s_no_failure"]), _fmt(res[m]["tokens_per_s_failures"]),
             _fmt(-res[m]["throughput_drop"], pct=True), _fmt(res[m]["val_ppl_no_failure"]),
             _fmt(res[m]["val_ppl_failures"])) for m in res["methods"]]
    out.print(table(f"per method ({cfg.failures} frequency; tokens/s modelled for {cfg.workers} workers, perplexity "
                    f"from real runs)", rows,
                    columns=("method", "tok/s no failure", "tok/s failures", "change", "ppl no failure", "ppl failures")))
    abl = [(name, f"{a['step_time_ratio']:.3f}", f"{a['activation_ratio']:.3f}") for name, a in res["ablation"].items()]
    out.print(table("neighbor step vs normal step (measured): the ablation", abl,
                    columns=("techniques", "step time ratio", "activation memory ratio")))
    single = res["mecefo_single_neighbor"]
    out.print(table("MeCeFO", {"grad_rel_error_max": res["grad_rel_error_max"],
                               "spread (neighbors for one failure)": f"{res['spread']['config']} -> "
                                                                     f"{res['spread']['neighbors_for_one_failure']}",
                               "neighbor_step_time_ratio": res["neighbor_step_time_ratio"],
                               "single neighbor: throughput change": _fmt(-single["throughput_drop"], pct=True),
                               "single neighbor: neighbor_step_time_ratio": single["neighbor_step_time_ratio"],
                               "neighbor_peak_memory_ratio": res["neighbor_peak_memory_ratio"],
                               "plot": res.get("plot", "-")}))
    if args.json:
        emit_json(res)
    return 0
