"""More bad input through every command: each case is one line on stderr naming the flag or setting, exit code 2,
no traceback, and nothing run. Every case used to be accepted (and run), or to end in a traceback; the sizes are
tiny so that a case the CLI wrongly accepts still ends quickly (and fails here)."""

import json

import pytest
import torch
from _bad_input import one_line_exit_2

from trainguard.cli.main import main

torch.set_num_threads(1)

TINY_TRAIN = ["--model.dim", "32", "--model.n_heads", "2", "--model.ffn_hidden", "64", "--model.n_layers", "1",
              "--data.seq_len", "16", "--data.batch_size", "2", "--train.steps", "1", "--train.eval_every", "0",
              "--output.progress", "false", "--output.metrics", "false", "--output.dir", "",
              "--checkpoint.dir", ""]  # (not configs/tiny.toml's runs/tiny/checkpoints: a checkout that trained it holds a run)
TINY_ABFT = ["bench", "abft", "--model", "llama-tiny", "--size", "tiny", "--batch", "1", "--seq-len", "8", "--rounds", "1",
             "--steps", "1", "--no-backward", "--device", "cpu", "--checkpoint-interval", "1"]
TINY_MECEFO = ["bench", "mecefo", "--tiny", "--no-memory", "--steps", "1", "--rounds", "1", "--plot", ""]
CLUSTER = ["plan", "cluster", "--gpus", "64", "--gpus-per-group", "8", "--mtbf-per-gpu-hours", "1000",
           "--restart-minutes", "5", "--checkpoint-minutes", "1", "--theory-only", "--no-sensitivity", "--out", "{tmp}/pc"]
TINY_DMR = ["bench", "dmr", "--model", "llama-tiny", "--pp", "1", "--rounds", "1", "--steps", "1", "--warmup", "1"]
SPARE_RUN = ["spare", "run", "--tiny", "--groups", "3", "--steps", "2"]
TOO_BIG = str(2**64)


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-input-more")
    (root / "corpus.txt").write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n"
                                             for i in range(600)))
    (root / "a-file").write_text("not a folder")
    run = root / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - 0.1 * s, "tokens_per_s": 100.0})
                                               + "\n" for s in range(1, 6)))
    return root


def _fill(argv, place):
    return [a.replace("{tmp}", str(place)) for a in argv]


# ---- seeds: numpy refuses a negative one, torch one of 2**64 or more (both used to be tracebacks or accepted) ----
@pytest.mark.parametrize("argv", [
    ["inject", "--seed", "-1", "--trials", "1", "--steps", "1"],  # was: accepted
    ["inject", "--seed", TOO_BIG, "--trials", "1", "--steps", "1"],  # was: a traceback from torch
    ["campaign", "abft", "--seed", TOO_BIG, "--trials", "1", "--device", "cpu"],
    ["campaign", "dmr", "--seed", "-1", "--trials", "1", "--steps", "1"],  # was: a traceback from numpy
    ["study", "attention", "--seed", TOO_BIG, "--trials", "1", "--steps-after", "0"],
    ["spare", "montecarlo", "--groups", "7", "--redundancy", "2", "--trials", "1", "--workers", "1", "--seed", "-1"],
    ["spare", "sweep", "--groups", "7", "--trials", "1", "--workers", "1", "--seed", TOO_BIG],  # was: accepted
    ["spare", "simulate", "--groups", "4", "--scheme", "spare", "--redundancy", "2", "--max-steps", "5", "--seed", "-1"],
    ["spare", "compare", "--groups", "7", "--seeds", "1", "--max-redundancy", "2", "--base-steps", "10", "--seed", "-1"],
    [*SPARE_RUN, "--seed", TOO_BIG],
    [*TINY_MECEFO, "--no-quality", "--seed", "-1"],
], ids=lambda a: " ".join(a[:2]) + " " + a[a.index("--seed") + 1][:3])
def test_a_seed_outside_0_to_2_64_is_refused(capsys, argv):
    one_line_exit_2(capsys, argv, "argument --seed: must be an integer in [0, 2**64)")


@pytest.mark.parametrize("override, needle", [
    (["--train.seed", TOO_BIG], "train.seed must be in [0, 2**64)"),  # was: a traceback from torch.manual_seed
    (["--train.seed", "-1"], "train.seed must be in [0, 2**64)"),
    (["--data.seed", str(2**60)], "data.seed must be in [0, "),  # was: a traceback (seed x stride + step overflowed)
    (["--data.seed", "-1"], "data.seed must be in [0, "),
    (["--model.init_std", "-1"], "model.init_std must be >= 0"),  # was: a traceback from normal_()
    (["--model.rope_theta", "0"], "model.rope_theta must be > 0"),  # was: accepted (NaN rotations)
    (["--model.norm_eps", "-1e-6"], "model.norm_eps must be > 0"),
    (["--model.moe_aux_loss_coef", "-1"], "model.moe_aux_loss_coef must be >= 0"),
    (["--sdc.dmr.enabled", "true", "--sdc.dmr.tie_breakers", "0"], "sdc.dmr.tie_breakers must be 1 to 10"),
    (["--sdc.dmr.tie_breakers", "11"], "sdc.dmr.tie_breakers must be 1 to 10"),
    (["--checkpoint.lock_wait_s", "-1"], "checkpoint.lock_wait_s must be in [0, inf)"),
    (["--checkpoint.lock_wait_s", "inf"], "checkpoint.lock_wait_s must be a finite number"),
    (["--checkpoint.lock_wait_s", "nan"], "checkpoint.lock_wait_s must be a finite number"),
    (["--checkpoint.lock_wait_s", "abc"], "checkpoint.lock_wait_s"),
])
def test_train_settings_out_of_range_are_refused(capsys, place, no_training, override, needle):
    argv = ["train", *TINY_TRAIN, "--data.source", str(place / "corpus.txt"), *override]
    one_line_exit_2(capsys, argv, needle)


# ---- counts, sizes, fractions and paths of the other commands ------------------------------------------------------
@pytest.mark.parametrize("argv, needle", [
    # was: silently taken as "auto"
    (["bench", "train", "--threads", "-1", "--steps", "1", "--rounds", "1", "--warmup", "0", "--batch", "1",
      "--seq-len", "8"], "--threads must be >= 0"),
    # was: ZeroDivisionError from the banner, before the benchmark's own check
    (["bench", "train", "--rounds", "0"], "--steps and --rounds must be >= 1 and --warmup >= 0, got 40, 0 and 3"),
    # was: a traceback from matplotlib after the benchmark
    ([*TINY_ABFT, "--plot", "{tmp}/net.txt"], "--plot must end in .png, .svg or .pdf"),
    # was: "File exists" after the whole benchmark, not naming the flag
    ([*TINY_ABFT, "--plot", "{tmp}/a-file/net.png"], "--plot {tmp}/a-file: cannot write there"),
    ([*TINY_MECEFO, "--no-quality", "--plot", "{tmp}/a-file/m.png"], "--plot {tmp}/a-file: cannot write there"),
    # was: accepted, and the quality runs ran no method
    ([*TINY_MECEFO, "--quality-methods", ""], "--quality-methods names no method"),
    # was: a traceback from matplotlib
    (["plot", "{tmp}/run", "--out", "{tmp}/run.txt"], "--out must end in .png, .svg or .pdf"),
    # was: OverflowError (int of an infinity)
    (["plan", "dmr", "--memory-budget", "1e999"], "--memory-budget must be a finite number of bytes"),
    # was: ZeroDivisionError
    ([*CLUSTER, "--grad-bytes-per-param", "0"], "--grad-bytes-per-param must be > 0"),
    # was: accepted (0: the default cap; negative: no SPARe row at all)
    ([*CLUSTER, "--max-redundancy", "0"], "--max-redundancy must be >= 2"),
    (["spare", "sweep", "--groups", "7", "--trials", "1", "--workers", "1", "--max-redundancy", "0"],
     "--max-redundancy must be >= 2"),
    (["spare", "compare", "--groups", "7", "--seeds", "1", "--base-steps", "10", "--max-redundancy", "-2"],
     "--max-redundancy must be >= 2"),
    # was: accepted (a failed all-reduce costing more than a successful one)
    ([*CLUSTER, "--failed-allreduce-frac", "1.5"], "failed_allreduce_frac must be in [0, 1]"),
    (["spare", "simulate", "--groups", "4", "--scheme", "checkpoint", "--max-steps", "3", "--failed-allreduce-frac",
      "2"], "failed_allreduce_frac must be in [0, 1]"),
    # was: accepted (0 or less: processes picked as if not given)
    (["spare", "montecarlo", "--groups", "7", "--redundancy", "2", "--trials", "1", "--workers", "0"],
     "--workers must be >= 1"),
    (["spare", "sweep", "--groups", "7", "--trials", "1", "--workers", "-1"], "--workers must be >= 1"),
    # was: accepted (0: the whole run; negative: an empty run reported as finished)
    (["spare", "simulate", "--groups", "4", "--scheme", "spare", "--redundancy", "2", "--base-steps", "10",
      "--max-steps", "0"], "--max-steps must be >= 1"),
    (["spare", "simulate", "--groups", "4", "--scheme", "spare", "--redundancy", "2", "--max-steps", "-4"],
     "--max-steps must be >= 1"),
    # was: accepted as "no checkpoint"
    (["spare", "network", "--groups", "4", "--gpus-per-group", "8", "--checkpoint-gb", "-1"],
     "--checkpoint-gb must be >= 0"),
    # was: a traceback from every group's process
    ([*SPARE_RUN, "--timeout", "0"], "timeout_s must be > 0"),
    # was: "File exists" once the groups' progress had started, not naming the flag
    ([*SPARE_RUN, "--run-dir", "{tmp}/a-file"], "--run-dir {tmp}/a-file is a file, not a folder"),
    # was: a traceback (a tensor of negative size)
    (["study", "attention", "--seq-len", "-1", "--trials", "1"], "--seq-len and --batch must be >= 1"),
    (["study", "attention", "--batch", "-1", "--trials", "1"], "--seq-len and --batch must be >= 1"),
], ids=lambda v: " ".join(v[:2]) if isinstance(v, list) else None)
def test_bad_values_of_the_other_commands_are_refused(capsys, place, argv, needle):
    one_line_exit_2(capsys, _fill(argv, place), needle.replace("{tmp}", str(place)))


def test_the_seed_type_keeps_the_whole_range():
    from trainguard.cli.main import build_parser

    for v in ("0", str(2**64 - 1)):
        assert build_parser().parse_args(["inject", "--seed", v]).seed == int(v)


@pytest.mark.parametrize("argv, needle", [
    ([*TINY_DMR, "--systems", "naive,,sparetrain"], "--systems"),
    ([*TINY_DMR, "--systems", "none,naive,"], "--systems"),
    ([*TINY_MECEFO, "--quality-methods", "mecefo,mecefo"], "--quality-methods"),
    ([*TINY_MECEFO, "--techniques", "skip_mha,"], "--techniques"),
    (["train", "configs/tiny.toml", *TINY_TRAIN, "--train.selective_ops", "attention,,ffn"], "train.selective_ops"),
    (["train", "configs/tiny.toml", *TINY_TRAIN, "--train.selective_ops", "attention,ffn,attention"],
     "'attention' given more than once"),  # was: accepted
    (["train", "configs/tiny.toml", *TINY_TRAIN, "--sdc.dmr.phases", "1,2,2"], "sdc.dmr.phases"),
])
def test_a_comma_list_with_an_empty_item_or_a_name_twice_is_refused_not_skipped(capsys, no_training, argv, needle):
    one_line_exit_2(capsys, argv, needle)


def test_a_redundancy_given_to_the_checkpoint_only_scheme_is_refused_not_ignored(capsys):
    one_line_exit_2(capsys, ["spare", "simulate", "--groups", "8", "--scheme", "checkpoint", "--redundancy", "5",
                             "--max-steps", "1"], "--redundancy")


def test_plot_given_a_file_says_it_is_a_file(capsys, place):
    one_line_exit_2(capsys, ["plot", str(place / "a-file")], "not a run folder but a file")


def test_a_key_given_twice_on_the_command_line_is_named_and_the_last_value_used(capsys, monkeypatch):
    """The last value wins, as with any option (a base command line in a shell variable, a key appended), and the
    run says so (was: silently)."""
    from trainguard.train.trainer import Trainer

    seen = {}

    class Stop(Exception):
        pass

    def run(self, *a, **k):
        seen["steps"] = self.cfg.train.steps
        raise Stop

    monkeypatch.setattr(Trainer, "run", run)
    with pytest.raises(Stop):
        main(["train", "configs/tiny.toml", *TINY_TRAIN, "--train.steps", "7", "--output.dir=", "--train.steps=9"])
    assert seen["steps"] == 9
    err = capsys.readouterr().err
    assert "note: --train.steps is given 3 times ('1', '7', '9'): the last, '9', is used" in err
    assert "note: --output.dir is given 2 times" in err


def test_a_batch_the_machine_cannot_allocate_is_one_line(capsys):
    """Was: the allocator's traceback."""
    rc = main(["train", "configs/tiny.toml", *_tiny_train("--data.batch_size", "99999999999")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert "out of memory" in lines[0] and "GiB failed" in lines[0] and "data.batch_size" in lines[0]


def test_steps_beyond_int64_are_refused(capsys, no_training):
    one_line_exit_2(capsys, ["train", *_tiny_train("--train.steps", str(2**63))], "train.steps must be < 2**63")


def _tiny_train(key: str, value: str) -> list[str]:
    """TINY_TRAIN with ``key`` set to ``value`` (a key is given once)."""
    i = TINY_TRAIN.index(key)
    return [*TINY_TRAIN[:i], key, value, *TINY_TRAIN[i + 2:]]
