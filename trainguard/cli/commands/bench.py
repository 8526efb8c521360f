"""``trainguard bench <what>``: benchmarks as commands, figures as ratios measured side by side.

``bench train --model M [--steps N] [--batch B] [--seq-len L] [--json]`` compares the Trainer's
throughput with a plain PyTorch loop on the same model, batches and optimizer (AdamW, global-norm
clipping, warmup+cosine LambdaLR: the same math, none of trainguard's machinery). The two alternate in
rounds after a warm-up (the order flips every round) and the medians are compared. Other benchmarks
(e.g. ``bench abft``) register themselves through ``trainguard.cli.commands._bench_<name>``.
Relies on torch and rich.
"""

from __future__ import annotations

import statistics
import tempfile
import time

from trainguard.cli.output import add_json_flag, console, emit_json, err_console, pick_threads, table


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmarks (side-by-side ratios; --json for machines)")
    sub = p.add_subparsers(dest="bench", metavar="BENCH")
    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1])

    t = sub.add_parser("train", help="Trainer tokens/s vs a plain PyTorch loop on the same model and batch")
    t.add_argument("--model", default="llama-tiny", help="model preset (default llama-tiny)")
    t.add_argument("--steps", type=int, default=40, help="timed steps per side (default 40)")
    t.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    t.add_argument("--warmup", type=int, default=3, help="untimed steps per side first (default 3)")
    t.add_argument("--batch", type=int, default=8, help="global batch in sequences (default 8)")
    t.add_argument("--seq-len", type=int, default=128, help="sequence length (default 128)")
    t.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    t.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    t.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (0: auto; 1 on a small machine that is busy)")
    add_json_flag(t)
    t.set_defaults(handler=run_train)

    for mod_name in ("_bench_abft", "_bench_dmr", "_bench_mecefo"):
        try:
            import importlib

            mod = importlib.import_module(f"trainguard.cli.commands.{mod_name}")
        except ImportError:
            continue
        hook = getattr(mod, "register_bench", None)
        if hook is not None:
            hook(sub)


def bench_train(model: str = "llama-tiny", steps: int = 40, rounds: int = 5, warmup: int = 3, batch: int = 8,
                seq_len: int = 128, dtype: str = "fp32", device: str = "auto") -> dict:
    import torch

    from trainguard.config import load_config
    from trainguard.data import PackedBatches
    from trainguard.errors import ConfigError
    from trainguard.models import build_model, lm_loss
    from trainguard.train import Trainer
    from trainguard.train.optim import build_scheduler

    if steps < 1 or rounds < 1 or warmup < 0:
        raise ConfigError("--steps and --rounds must be >= 1 and --warmup >= 0")
    per_round = max(1, steps // rounds)
    total = warmup + per_round * rounds
    out_dir = tempfile.mkdtemp(prefix="trainguard-bench-")
    cfg = load_config(None, [
        "--model.preset", model, "--data.seq_len", str(seq_len), "--data.batch_size", str(batch),
        "--data.max_bytes", str(max(2_000_000, 64 * batch * (seq_len + 2))),
        "--train.steps", str(total), "--train.eval_every", "0", "--train.dtype", dtype, "--train.device", device,
        "--train.log_every", "10", "--output.dir", out_dir, "--output.progress", "false",
    ])
    batches = PackedBatches.from_config(cfg.data)
    trainer = Trainer(cfg, batches=batches, progress=False)
    dev = trainer.device

    # The plain loop: same model init, same batches, AdamW with the same settings, clip, LambdaLR.
    plain = build_model(cfg.model_config(), seed=cfg.train.seed).to(dev)
    fused = trainer.optimizer.defaults.get("fused", False)
    opt = torch.optim.AdamW(plain.parameters(), lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2),
                            weight_decay=cfg.train.weight_decay, fused=fused)
    sched = build_scheduler(opt, cfg.train)
    autocast = dtype == "bf16"
    plain_step = [0]

    def plain_run(n: int) -> None:
        for _ in range(n):
            x, y = batches.batch(plain_step[0])
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                loss = lm_loss(plain(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.train.grad_clip)
            opt.step()
            sched.step()
            plain_step[0] += 1

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def timed(fn, n: int) -> float:
        sync()
        t0 = time.perf_counter()
        fn(n)
        sync()
        return time.perf_counter() - t0

    trainer_run = lambda n: trainer.run(n)
    if warmup:
        timed(trainer_run, warmup)
        timed(plain_run, warmup)
    tg, pl = [], []
    for r in range(rounds):
        order = ((trainer_run, tg), (plain_run, pl)) if r % 2 == 0 else ((plain_run, pl), (trainer_run, tg))
        for fn, acc in order:
            acc.append(per_round * batch * seq_len / timed(fn, per_round))
    trainer.close()
    tps, ptps = statistics.median(tg), statistics.median(pl)
    return {
        "model": model, "params": sum(p.numel() for p in trainer.model.parameters()), "device": str(dev),
        "threads": torch.get_num_threads(), "dtype": dtype, "batch": batch, "seq_len": seq_len,
        "steps_per_round": per_round, "rounds": rounds, "warmup": warmup,
        "tokens_per_s": round(tps, 1), "plain_pytorch_tokens_per_s": round(ptps, 1),
        "ratio_vs_plain_pytorch": round(tps / ptps, 4),
        "rounds_tokens_per_s": [round(v, 1) for v in tg], "rounds_plain_tokens_per_s": [round(v, 1) for v in pl],
    }


def run_train(args) -> int:
    from trainguard.errors import ConfigError

    if args.threads < 0:
        raise ConfigError(f"--threads must be >= 0 (0: auto), got {args.threads}")
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:  # (before the banner, which divides by --rounds)
        raise ConfigError(f"--steps and --rounds must be >= 1 and --warmup >= 0, got {args.steps}, {args.rounds} "
                          f"and {args.warmup}")
    pick_threads(args.threads)
    out = err_console if args.json else console
    out.print(f"bench train: {args.model}, batch {args.batch} x {args.seq_len}, {args.rounds} rounds "
              f"of {max(1, args.steps // args.rounds)} steps per side ...")
    res = bench_train(args.model, args.steps, args.rounds, args.warmup, args.batch, args.seq_len, args.dtype,
                      args.device)
    rows = {k: v for k, v in res.items() if not k.startswith("rounds_")}
    out.print(table("bench train: Trainer vs plain PyTorch (medians, side by side)", rows))
    if args.json:
        emit_json(res)
    return 0
