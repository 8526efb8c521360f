"""The layers of docs/architecture.md hold (every import, including those inside functions), and the code
is ruff-clean. Both checks read the source; they fail on the first upward import or lint finding."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trainguard"

# Top to bottom; a module may import its own layer and the layers below it (docs/architecture.md).
LAYERS: list[tuple[str, ...]] = [
    ("trainguard.__main__", "trainguard.cli"),
    ("trainguard.config",),
    ("trainguard.report",),
    ("trainguard.sdc.runtime",),
    ("trainguard.sdc.dmr",),
    ("trainguard.sdc.abft", "trainguard.sdc"),
    ("trainguard.sim",),
    ("trainguard.failover",),
    ("trainguard.faults",),
    ("trainguard.train",),
    ("trainguard.models", "trainguard.data"),
    ("trainguard.utils",),
    ("trainguard.errors", "trainguard"),
]


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    assert best is not None, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
    return best


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, imported trainguard module) for every import in the file, at any depth."""
    mod = module_name(path, root)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this package
                base = mod.split(".")[: len(mod.split(".")) - node.level + (path.name == "__init__.py")]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((node.lineno, name))
    return [(line, n) for line, n in out if n == "trainguard" or n.startswith("trainguard.")]


def upward_imports(root: Path = ROOT) -> list[str]:
    found = []
    for path in sorted((root / "trainguard").rglob("*.py")):
        mod = module_name(path, root)
        mine = layer_of(mod)
        for line, target in imports(path, root):
            if layer_of(target) < mine:
                found.append(f"{path.relative_to(root)}:{line}: {mod} imports {target}")
    return found


def test_no_module_imports_a_layer_above_its_own():
    upward = upward_imports()
    assert not upward, "imports against the layers of docs/architecture.md:\n" + "\n".join(upward)


def test_the_contract_catches_an_upward_import_even_inside_a_function(tmp_path):
    pkg = tmp_path / "trainguard" / "train"  # the trainer must not reach up to the CLI
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from trainguard.models import build_model\n")
    (pkg / "loop.py").write_text("def f():\n    from trainguard.cli.output import emit_json\n    from .. import errors\n")
    assert upward_imports(tmp_path) == ["trainguard/train/loop.py:2: trainguard.train.loop imports trainguard.cli.output"]


@pytest.mark.skipif(shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists(),
                    reason="ruff is installed by ./run.sh (dev extra)")
def test_ruff_is_clean():
    exe = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    proc = subprocess.run([exe, "check", "--quiet", "trainguard", "tests"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
