"""pytest setup: make the repository root and ``tests/`` importable here and in spawned ranks.

Spawned ranks (``zerotron.distributed.launch.spawn``, "spawn" start method) inherit ``sys.path`` and the
environment, so a test body defined in ``tests/test_x.py`` is importable in every child.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

for _path in (str(TESTS), str(ROOT)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

_pythonpath = os.environ.get("PYTHONPATH", "").split(os.pathsep)
if str(ROOT) not in _pythonpath:
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), *_pythonpath] if p)

# Without a GPU, the Triton paged-attention kernel (zerotron.serve.triton_attention) is tested in
# Triton's interpreter, which must be chosen before Triton is first imported. With a CUDA device the
# kernel compiles as it does in serving.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def _ranks_fork_from_the_preloaded_server(request: pytest.FixtureRequest) -> Iterator[None]:
    """Commands a test runs in this process (``main(["train", ..., "--nproc", "2"])``) fork their ranks
    from the server that preloaded torch (tests/harness.py's ``PRELOAD``) instead of starting fresh
    interpreters: seconds a launch on two cores. A test marked ``spawn`` keeps the command line's own
    start (it reads the ranks' output, or measures their memory as users' runs start); commands run as
    subprocesses always spawn."""
    from zerotron.distributed import launch

    if request.node.get_closest_marker("spawn") is not None:
        yield
        return
    import tests.harness  # noqa: F401  (sets the server's preload)

    saved = launch.DEFAULT_START_METHOD
    launch.DEFAULT_START_METHOD = "forkserver"
    try:
        yield
    finally:
        launch.DEFAULT_START_METHOD = saved


SLOW_LIST = TESTS / "slow.txt"


def slow_tests() -> set[str]:
    """The node ids ``tests/slow.txt`` lists (a line's ``#`` comment aside)."""
    lines = (line.split("#", 1)[0].strip() for line in SLOW_LIST.read_text().splitlines())
    return {line for line in lines if line}


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``slow`` the long end-to-end tests ``tests/slow.txt`` lists: pyproject's ``-m "not slow"``
    leaves them out of ``python -m pytest -q``; ``-m slow`` runs them, ``-m "slow or not slow"`` all."""
    slow = slow_tests()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)


def pytest_sessionstart(session: object) -> None:
    """Build the serving engine's native kernels once, before the first test, outside every test's
    timeout: the first build takes a minute or more, and a test that times out in the middle of it
    would leave the build to the next test. The build runs in a child process; should it not finish in
    ``ZEROTRON_TEST_BUILD_S`` seconds (default 1200), the session runs without the kernels
    (ZEROTRON_NATIVE_KERNELS=0: the tests of the kernels skip, each saying why) rather than have every
    test that needs them wait out its timeout. The outcome and its time are printed here."""
    import signal
    import subprocess
    import time

    if os.environ.get("ZEROTRON_NATIVE_KERNELS", "1") == "0":
        return
    code = "from zerotron.serve import kernels; print(kernels.why_unavailable() or 'built')"
    start = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out = child.communicate(timeout=float(os.environ.get("ZEROTRON_TEST_BUILD_S", "1200")))[0].strip()
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the compiler with it
        child.communicate()
        os.environ["ZEROTRON_NATIVE_KERNELS"] = "0"
        out = "the build did not finish in time: the session runs without them"
    last = out.splitlines()[-1] if out else f"exit code {child.returncode}"
    print(f"\nzerotron native kernels: {last} ({time.perf_counter() - start:.0f} s)", flush=True)
