"""Run a test body on N Gloo ranks in subprocesses (built on :func:`zerotron.distributed.launch.spawn`,
forked from a preloaded server: see ``PRELOAD``).

Usage::

    def _body(x):                      # module level, so spawned ranks can import it
        rank, world = current_rank_and_world()
        ...
        return something_small

    def test_it():
        results = run_distributed(_body, 4, 1.5, timeout=120)   # one result per rank

or, for a body that takes no arguments and asserts on its own::

    @distributed(world_size=2)
    def test_it():
        ...

A rank that raises makes the test fail with :class:`zerotron.distributed.launch.LaunchError`, whose message (in
the pytest report) holds the traceback of every failing rank; a hang fails after ``timeout`` seconds
naming the collective each rank waits in.
"""

from __future__ import annotations

import functools
import importlib
import multiprocessing
from collections.abc import Callable
from typing import Any

from zerotron.distributed.launch import spawn

DEFAULT_TIMEOUT_S = 120.0

# The ranks fork from one server process that has imported these once, instead of each rank importing
# torch, transformers and peft anew (seconds per rank on two cores, for hundreds of multi-rank tests).
# The command-line tests launch ranks as users do (``spawn``), so that path stays covered.
PRELOAD = [
    "torch",
    "torch.distributed",
    "numpy",
    "transformers",
    "peft",
    "safetensors.torch",
    "zerotron.train.trainer",
]
multiprocessing.set_forkserver_preload(PRELOAD)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` Gloo ranks; return the per-rank results in rank order."""
    return spawn(
        fn, world_size, args=args, timeout_s=timeout, env=env, backend="gloo", start_method="forkserver"
    )


def forked(**options: Any) -> Any:
    """:class:`~zerotron.train.run.LaunchOptions` for ``launch_training`` whose ranks fork from the
    preloaded server (``start_method="forkserver"``): for a job whose ranks' output the test does not
    read (it goes where the server's went)."""
    from zerotron.train.run import LaunchOptions

    return LaunchOptions(start_method="forkserver", **options)


def _call_original(module: str, qualname: str) -> Any:
    """In a spawned rank: find the undecorated test function by name and run it."""
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj.__wrapped__()


def distributed(
    world_size: int, timeout: float = DEFAULT_TIMEOUT_S
) -> Callable[[Callable[[], Any]], Callable[[], None]]:
    """Decorator: the (argument-free, module-level) test body runs on ``world_size`` Gloo ranks."""

    def wrap(body: Callable[[], Any]) -> Callable[[], None]:
        @functools.wraps(body)
        def test() -> None:
            run_distributed(_call_original, world_size, body.__module__, body.__qualname__, timeout=timeout)

        return test

    return wrap
