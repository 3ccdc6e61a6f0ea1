"""The shape of the code, as DESIGN.md asks it (contract 11 and "Layers"): small files and functions,
options as objects rather than long argument lists, C++ in ``.cpp`` files. An AST walk over every
``zerotron/**/*.py``; each limit has a negative control on a throwaway file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "zerotron"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 8


def _problems(path: Path, root: Path = PKG) -> list[str]:
    text = path.read_text(encoding="utf-8")
    rel = path.relative_to(root.parent)
    found = []
    if len(text.splitlines()) > MAX_FILE_LINES:
        found.append(f"{rel}: {len(text.splitlines())} lines (at most {MAX_FILE_LINES})")
    if "#include" in text:
        found.append(f"{rel}: C++ inside a Python file (put it in a .cpp file)")
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = node.args
        params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
        count = len([p for p in params if p.arg not in ("self", "cls")])
        if count > MAX_PARAMETERS:
            found.append(
                f"{rel}:{node.lineno}: {node.name} takes {count} parameters (at most {MAX_PARAMETERS})"
            )
        length = (node.end_lineno or node.lineno) - node.lineno + 1
        if length > MAX_FUNCTION_LINES:
            found.append(f"{rel}:{node.lineno}: {node.name} is {length} lines (at most {MAX_FUNCTION_LINES})")
    return found


def test_files_and_functions_are_small() -> None:
    problems = [p for path in sorted(PKG.rglob("*.py")) for p in _problems(path)]
    assert not problems, "\n".join(problems)


def test_the_serving_kernels_source_is_its_cpp_files() -> None:
    """The extension compiles the ``.cpp`` files of the package, joined in their order, and nothing else."""
    from zerotron.serve import kernel_source

    folder = PKG / "serve" / "csrc"
    assert sorted(kernel_source.PARTS) == sorted(p.name for p in folder.glob("*.cpp"))
    joined = "".join((folder / name).read_text(encoding="utf-8") for name in kernel_source.PARTS)
    assert joined == kernel_source.SOURCE
    assert joined.lstrip().startswith("#include <torch/extension.h>")


def test_every_slow_test_listed_exists() -> None:
    """Each line of ``tests/slow.txt`` names a test function defined in its file, so a renamed slow test
    does not fall back into the default run (CI's) unnoticed."""
    from tests.conftest import ROOT, slow_tests

    listed = slow_tests()
    missing = []
    for node_id in sorted(listed):
        file, name = node_id.split("::", 1)
        path = ROOT / file
        tree = ast.parse(path.read_text(encoding="utf-8")) if path.is_file() else ast.Module(body=[])
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        if name.split("[", 1)[0] not in defined:
            missing.append(node_id)
    assert listed and not missing, missing


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f(a, b, c, d, e, f, g, h, i):\n    pass\n", "takes 9 parameters"),
        ("def f():\n" + "    x = 1\n" * 80, "is 81 lines"),
        ("x = 1\n" * 601, "601 lines"),
        ('SOURCE = """\n#include <torch/extension.h>\n"""\n', "C++ inside a Python file"),
    ],
)
def test_checker_catches(tmp_path: Path, source: str, expected: str) -> None:
    """The checker finds each kind of problem (on a throwaway file)."""
    pkg = tmp_path / "zerotron"
    pkg.mkdir()
    (pkg / "bad.py").write_text(source)
    problems = _problems(pkg / "bad.py", pkg)
    assert any(expected in p for p in problems), problems
