"""Imports point down the layers (DESIGN "Layers"), plan stays torch-free, only distributed/ touches torch.distributed.

An AST walk over every ``zerotron/**/*.py``, imports inside functions included. A module may import its
own layer or a lower one. ``models`` sits above ``parallel``: parallel code is applied to models but
must not import them.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "zerotron"

LAYERS = {
    "cli": 7,
    "__main__": 7,  # `python -m zerotron`: the command line
    "train": 6,
    "serve": 6,
    "bench": 6,
    "finetune": 6,
    "checkpoint": 5,
    "plan": 5,
    "models": 4,
    "parallel": 3,
    "distributed": 2,
    "config": 1,
    "shapes": 1,
    "layout": 1,
    "config_load": 1,
    "config_check": 1,
    "config_deepspeed": 1,
    "presets": 1,
    "__init__": 1,
}
PLAN_MAY_IMPORT = {"config", "presets", "shapes", "layout", "plan"}


def _component(module: str) -> str:
    """``zerotron.parallel.data`` -> ``parallel``; ``zerotron`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every (line, absolute module) imported by ``path``; ``from zerotron import x`` yields ``zerotron.x``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    this = _module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "distributed"
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        ):
            found.append((node.lineno, "torch.distributed"))
    return found


def _violations() -> list[str]:
    problems = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent)
        me = _component(_module_name(path))
        if me not in LAYERS:
            problems.append(f"{rel}: component {me!r} is not in the layer table of tests/test_layers.py")
            continue
        for line, module in _imports(path):
            top = module.split(".")[0]
            if me != "distributed" and (
                module == "torch.distributed" or module.startswith("torch.distributed.")
            ):
                problems.append(f"{rel}:{line}: imports {module}; only zerotron/distributed may")
            if me == "plan" and top == "torch":
                problems.append(f"{rel}:{line}: plan imports {module}; plan must run without torch")
            if top != "zerotron" or module == "zerotron":
                continue
            other = _component(module)
            if other not in LAYERS:
                # `from zerotron import __version__` and the like: names of the package itself
                other = (
                    "__init__" if not (PKG / other).exists() and not (PKG / f"{other}.py").exists() else other
                )
            if other not in LAYERS:
                problems.append(f"{rel}:{line}: imports {module}, whose component is not in the layer table")
            elif me == "plan" and other not in PLAN_MAY_IMPORT:
                problems.append(
                    f"{rel}:{line}: plan imports {module}; plan may import only config/presets/shapes/layout"
                )
            elif LAYERS[other] > LAYERS[me]:
                problems.append(
                    f"{rel}:{line}: {me} (layer {LAYERS[me]}) imports {module} (layer {LAYERS[other]})"
                )
    return problems


def test_imports_point_down() -> None:
    problems = _violations()
    assert not problems, "layer violations:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("source", "me", "expected"),
    [
        ("from zerotron.train import trainer\n", "parallel", "parallel (layer 3) imports zerotron.train"),
        ("import torch.distributed as dist\n", "models", "only zerotron/distributed may"),
        ("import torch\nx = torch.distributed.get_rank\n", "models", "only zerotron/distributed may"),
        ("from ..models import llama\n", "parallel", "imports zerotron.models"),
        ("import torch\n", "plan", "plan must run without torch"),
        (
            "from zerotron.distributed import mesh\n",
            "plan",
            "plan may import only config/presets/shapes/layout",
        ),
    ],
)
def test_checker_catches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, me: str, expected: str
) -> None:
    """The checker itself finds each kind of violation (on a throwaway package tree)."""
    pkg = tmp_path / "zerotron"
    (pkg / me).mkdir(parents=True)
    for name in ("train", "models", "distributed"):
        (pkg / name).mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / me / "__init__.py").write_text("")
    (pkg / me / "bad.py").write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)
    assert any(expected in p for p in _violations()), _violations()
