"""Imports point down the layers (DESIGN "Layers"), plan stays torch-free, only distributed/ touches torch.distributed.

An AST walk over every ``zerotron/**/*.py``, imports inside functions included. A module may import a
lower layer, and its own component; two components of one layer never import each other (training and
serving share their foundations below them, never reach into each other), except the torch-free
modules of layer 1, which may import each other without a cycle. ``models`` sits above ``parallel``:
parallel code is applied to models but must not import them. The applications that compose the
training loop (``finetune``, ``bench``) sit above ``train``; the model builder (``build``) and the
parts below the loop (``components``) below every application.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "zerotron"

LAYERS = {
    "__main__": 11,  # `python -m zerotron`: the command line's entry
    "cli": 10,
    "finetune": 9,  # compose the training loop
    "bench": 9,
    "train": 8,  # the applications: the training loop and launcher, the serving engine
    "serve": 8,
    "build": 7,  # the one model builder
    "components": 6,  # reusable parts below the loop
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
    "config_check_compressed": 1,
    "config_check_preference": 1,
    "config_check_fp8": 1,
    "config_deepspeed": 1,
    "presets": 1,
    "__init__": 1,
}
PLAN_MAY_IMPORT = {"config", "config_load", "presets", "shapes", "layout", "plan"}
# `zerotron plan model.path=...` reads the model file's architecture there (and only then imports torch)
PLAN_ALSO = {"zerotron/plan/command.py": "zerotron.models.loading"}


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
            elif me == "plan" and other not in PLAN_MAY_IMPORT and not _also(rel, module):
                problems.append(
                    f"{rel}:{line}: plan imports {module}; plan may import only config/presets/shapes/layout"
                    "/config_load"
                )
            elif LAYERS[other] > LAYERS[me]:
                problems.append(
                    f"{rel}:{line}: {me} (layer {LAYERS[me]}) imports {module} (layer {LAYERS[other]})"
                )
            elif other != me and LAYERS[other] == LAYERS[me] > 1:
                problems.append(f"{rel}:{line}: {me} imports {module}, a component of its own layer")
    return problems + _cycles()


def _also(rel: Path, module: str) -> bool:
    allowed = PLAN_ALSO.get(rel.as_posix())
    return allowed is not None and (module == allowed or module.startswith(allowed + "."))


def _cycles() -> list[str]:
    """Each cycle in the graph of components (a package or a top-level module) as one problem."""
    edges: dict[str, set[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        me = _component(_module_name(path))
        for _, module in _imports(path):
            if module.split(".")[0] == "zerotron" and module != "zerotron":
                other = _component(module)
                if other in LAYERS and other != me:
                    edges.setdefault(me, set()).add(other)
    found, state = [], dict.fromkeys(edges, 0)  # 0 unseen, 1 on the path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt, 0) == 1:
                found.append("import cycle: " + " -> ".join([*path[path.index(nxt) :], nxt]))
            elif state.get(nxt, 0) == 0:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(edges):
        if state[node] == 0:
            visit(node, [node])
    return found


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
        ("from zerotron.models import loading\n", "plan", "plan may import only"),
        ("from zerotron.train import trainer\n", "serve", "a component of its own layer"),
        ("from zerotron.serve import app\n", "train", "a component of its own layer"),
        ("from zerotron.finetune import sft\n", "train", "train (layer 8) imports zerotron.finetune"),
        ("from zerotron import layout\n", "config", "import cycle: config -> layout -> config"),
    ],
)
def test_checker_catches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, me: str, expected: str
) -> None:
    """The checker itself finds each kind of violation (on a throwaway package tree)."""
    pkg = tmp_path / "zerotron"
    (pkg / me).mkdir(parents=True)
    for name in ("train", "models", "distributed", "serve", "finetune"):
        (pkg / name).mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "layout.py").write_text("from zerotron import config\n")  # with config importing layout: a cycle
    (pkg / me / "__init__.py").write_text("")
    (pkg / me / "bad.py").write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)
    assert any(expected in p for p in _violations()), _violations()
