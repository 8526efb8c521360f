"""Config loading: TOML + overrides, strict keys and types, impossible values refused."""

import pytest

from trainguard.config import load_config
from trainguard.errors import ConfigError


def write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_toml_and_overrides(tmp_path):
    p = write(tmp_path, '[model]\npreset = "llama-tiny"\ndim = 64\n[train]\nsteps = 7\nlr = 1e-3\n')
    cfg = load_config(p, ["--train.steps", "9", "--data.seq_len=32", "--sdc.abft", "true"])
    assert cfg.train.steps == 9 and cfg.train.lr == 1e-3
    assert cfg.data.seq_len == 32 and cfg.sdc.abft.enabled is True
    assert cfg.model_config().dim == 64 and cfg.model_config().n_layers == 2


@pytest.mark.parametrize(
    "text, overrides, message",
    [
        ("[nope]\na = 1\n", [], "unknown config section"),
        ("[train]\nsteeps = 1\n", [], "unknown key train.steeps"),
        ('[train]\nsteps = "ten"\n', [], "train.steps must be int"),
        ("[train]\nsteps = 1.5\n", [], "train.steps must be int"),
        ("", ["--train.lr", "fast"], "train.lr must be float"),
        ("", ["--distributed.pp", "3"], "exceeds the model's layers"),
        ("", ["--model.preset", "gpt-9"], "unknown model preset"),
        ("", ["--model.dimm", "8"], "unknown key model.dimm"),
        ("", ["--model.dim", "100", "--model.n_heads", "3"], "divisible"),
        ("", ["--data.seq_len", "100000"], "max_seq_len"),
        ("", ["--train.dtype", "fp8"], "train.dtype must be one of"),
        ("", ["--data.batch_size", "6", "--distributed.dp", "4"], "divisible"),
        ("", ["--train.steps"], "needs a value"),
        ("[train\n", [], "invalid TOML"),
    ],
)
def test_bad_config_is_one_line_error(tmp_path, text, overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/nonexistent/x.toml")
