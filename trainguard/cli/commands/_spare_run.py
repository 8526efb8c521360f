"""``trainguard spare run``: real data-parallel training with SPARe's stacked shards on torchft.

Registered by :mod:`trainguard.cli.commands.spare`. Each group is a process running the Trainer with the
elastic strategy and SPARe's policy. ``--kill G@STEP[:POINT]`` SIGKILLs group ``G`` at step ``STEP``
(``compute``: after it computed its stacks, before the all-reduce, so its counted shards are lost and must
be recounted or patched); ``--random-kills K`` SIGKILLs ``K`` training groups from outside at random moments.
``--verify [TOL]`` also runs the fault-free reference in one process, prints the largest parameter
difference and exits 1 when it exceeds ``TOL`` (default 0: bitwise). JSON keys: ``steps``,
``killed_groups``, ``kills``, ``deaths``, ``global_restarts``, ``patch_computes``, ``mean_stacks_per_step``,
``final_loss``, ``survivors``, ``survivors_agree``, ``max_param_diff_vs_fault_free`` / ``verify_tolerance`` /
``verified`` (with ``--verify``), ``wall_s``, ``errors``, ``step_logs``.
"""

from __future__ import annotations

import sys

from trainguard.cli.args import finite_float, seed_int
from trainguard.cli.output import add_json_flag, console, emit_json, err_console, progress, table
from trainguard.errors import TrainguardError


def _settings(pairs: list[str]) -> dict[str, str]:
    out = {}
    for text in pairs:
        key, sep, value = text.partition("=")
        if not sep or "." not in key:
            raise TrainguardError(f"--set expects SECTION.KEY=VALUE (a trainer setting), got {text!r}")
        out[key.strip()] = value.strip()
    return out


def cmd_run(args) -> int:
    from trainguard.failover.spare.runtime import Kill, SpareRunConfig, max_param_diff, reference_run, run_spare

    overrides = {}
    if args.tiny:
        overrides = dict(dim=32, n_layers=1, n_heads=2, ffn_hidden=64)
    if args.verify is not None and not args.verify >= 0:
        raise TrainguardError(f"--verify tolerance must be >= 0, got {args.verify}")
    if args.run_dir:  # a file in the way is refused before any group starts
        from pathlib import Path

        from trainguard.train.trainer import check_writable

        check_writable(Path(args.run_dir), "--run-dir")
    cfg = SpareRunConfig(
        groups=args.groups, redundancy=args.redundancy, steps=args.steps, model=args.model,
        model_overrides=overrides, seq_len=args.seq_len, shard_batch=args.shard_batch, lr=args.lr, seed=args.seed,
        checkpoint_every=args.checkpoint_every, run_dir=args.run_dir or "",
        kills=tuple(Kill.parse(k) for k in args.kill or ()), timeout_s=args.timeout,
        overrides=_settings(args.set or []), start_method=args.start_method, random_kills=args.random_kills,
        random_kill_seed=args.kill_seed, max_restarts=args.max_restarts,
    ).validate()
    if not args.json:
        console.print(f"SPARe run: N={cfg.groups} groups, r={cfg.redundancy}, {cfg.steps} steps, model {cfg.model}"
                      f"{' (tiny)' if args.tiny else ''}, kills: "
                      + (", ".join(f"group {k.group} at step {k.step} ({k.when})" for k in cfg.kills) or "none")
                      + (f", {cfg.random_kills} random kills from outside" if cfg.random_kills else ""))
    bar = None if args.json else progress(transient=False)
    task = None
    if bar is not None:
        bar.start()
        task = bar.add_task("steps", total=cfg.steps, info="")

    def on_event(kind, g, info):
        if bar is None:
            return
        if kind == "step" and info["step"] >= 0:
            bar.update(task, completed=max(bar.tasks[0].completed, info["step"] + 1),
                       info=f"loss {info['loss']:.3f}  stack {info['stack']}")
        elif kind == "killed":
            err_console.print(f"  group {g} killed at step {info['step']} ({info['when']})")
        elif kind == "died":
            err_console.print(f"  group {g} died at step {info['step']}: {info['detail']}")
        elif kind == "wipeout":
            bar.update(task, completed=0)
            err_console.print(f"  group {g}: wipe-out at step {info['step']} (shard types {info['types']} lost "
                              "every host): global restart from the last checkpoint")
        elif kind == "error":
            err_console.print(f"  group {g} failed: {info['message']}")

    try:
        res = run_spare(cfg, progress=on_event)
    finally:
        if bar is not None:
            bar.stop()
    out = res.summary()
    out.update(groups=cfg.groups, redundancy=cfg.redundancy, model=cfg.model, step_logs=res.step_logs)
    failed = False
    if args.verify is not None:
        diff = max_param_diff(res.state, reference_run(cfg))
        failed = not diff <= args.verify
        out.update(max_param_diff_vs_fault_free=diff, verify_tolerance=args.verify, verified=not failed)
    if args.json:
        emit_json(out)
    else:
        rows = [(lg["step"], lg["stack"], lg["patches"], ",".join(map(str, lg["failed"])) or "-", lg["phase"] or "-",
                 f"{lg['loss']:.4f}") for lg in res.step_logs]
        console.print(table("steps (stack = all-reduce stack s)", rows,
                            columns=("step", "stack", "patch shards", "failed groups", "controller", "loss")))
        if res.deaths:
            console.print(table("deaths", [(d["group"], d["step"], d["cause"], d["detail"]) for d in res.deaths],
                                columns=("group", "step", "cause", "detail")))
        summary = {k: v for k, v in out.items() if k not in ("step_logs", "kills", "deaths")}
        console.print(table("summary", summary))
    if failed:
        sys.stderr.write(f"trainguard: verification failed: parameters differ from the fault-free run by "
                         f"{out['max_param_diff_vs_fault_free']:.3g} > tolerance {args.verify:g}\n")
        return 1
    return 0


def add_run_parser(sub) -> None:
    ru = sub.add_parser("run", help="train with stacked shards on torchft; kill groups and keep going")
    ru.add_argument("--groups", type=int, default=4, help="data-parallel groups N (one process each)")
    ru.add_argument("--redundancy", type=int, default=2, help="shard types stacked on each group r")
    ru.add_argument("--steps", type=int, default=8)
    ru.add_argument("--model", default="llama-tiny", help="model preset")
    ru.add_argument("--tiny", action="store_true", help="a 1-layer, 32-wide model (fast on 2 cores)")
    ru.add_argument("--seq-len", type=int, default=32)
    ru.add_argument("--shard-batch", type=int, default=2, help="sequences per shard type")
    ru.add_argument("--lr", type=finite_float, default=1e-3)
    ru.add_argument("--seed", type=seed_int, default=0)
    ru.add_argument("--checkpoint-every", type=int, default=2)
    ru.add_argument("--run-dir", default=None, help="checkpoint folder (must not hold a checkpoint; default: temporary)")
    ru.add_argument("--kill", action="append", metavar="G@STEP[:POINT]",
                    help="kill group G at step STEP; POINT: start, plan, compute (default), forward_backward, update "
                         "(repeatable)")
    ru.add_argument("--random-kills", type=int, default=0, metavar="K",
                    help="SIGKILL K training groups from outside at random moments")
    ru.add_argument("--kill-seed", type=seed_int, default=0, help="seed of --random-kills")
    ru.add_argument("--max-restarts", type=int, default=3, help="global restarts (after a wipe-out) before giving up")
    ru.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                    help="a trainer setting for every group and the reference, e.g. train.dtype=bf16 (repeatable)")
    ru.add_argument("--start-method", choices=("forkserver", "spawn"), default="forkserver",
                    help="how group processes start (forkserver imports torch once)")
    ru.add_argument("--timeout", type=finite_float, default=20.0, help="collective timeout in seconds")
    ru.add_argument("--verify", type=finite_float, nargs="?", const=0.0, default=None, metavar="TOL",
                    help="compare the final parameters with the fault-free run; exit 1 if they differ by more "
                         "than TOL (default 0: bitwise)")
    add_json_flag(ru)
    ru.set_defaults(handler=cmd_run)


__all__ = ["TrainguardError", "add_run_parser", "cmd_run"]
