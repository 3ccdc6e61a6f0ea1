"""Multi-LoRA serving under tensor parallelism (``zerotron serve --nproc 2 --lora-modules ...``),
against peft and against the single process.

Every rank holds the adapters in the same slots: a column-parallel part its rows of B, a
row-parallel part its columns of A, its share of ``s·(x A^T) B^T`` added to its partial product before
the sum over the ranks. References: peft's forward of each adapter on the transformers model, its
greedy ``generate``, and the one-rank engine's tokens; the batch alone and together.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.test_serve_engine import GREEDY, _prompts
from tests.test_serve_lora import _engine, _peft, _run
from tests.test_serve_lora import served as served  # noqa: F401  # the fixture
from zerotron.serve.engine import Engine, EngineConfig

peft = pytest.importorskip("peft")

PROMPTS = _prompts([5, 9, 3, 12, 7, 6], seed=3)
LORAS = ["alpha", None, "beta", "gamma", "alpha", "gamma"]


def _worker(model_dir: str, paths: dict[str, Path]) -> dict[str, object]:
    """One of 2 tensor-parallel ranks: the first runs the prompts once for their logits (one step), then
    to the end together and one by one; the other follows every step."""
    from zerotron.build.builder import load_model
    from zerotron.distributed.launch import current_rank_and_world
    from zerotron.distributed.mesh import Mesh, ParallelDims

    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims(world, dp=1, tp=world), rank)
    group = mesh.group("tp")
    model, _ = load_model(model_dir, torch.float32, "cpu", mesh)
    engine = Engine(model, None, EngineConfig(num_blocks=128, max_loras=4), group)
    for name, path in paths.items():  # every rank, in one order: the same slots
        engine.load_lora(name, str(path))
    if group.rank_in_group != 0:
        engine.runner.follow()
        return {}
    captured: list[torch.Tensor] = []
    inner = engine.runner.run
    engine.runner.run = lambda plan: captured.append(inner(plan)) or captured[-1]  # type: ignore[method-assign]
    _run(engine, PROMPTS, LORAS, dataclasses.replace(GREEDY, max_tokens=1))
    together = _run(engine, PROMPTS, LORAS, GREEDY)
    alone = [_run(engine, [p], [lo], GREEDY)[0] for p, lo in zip(PROMPTS, LORAS)]
    engine.runner.publish(None, stop=True)
    return {"logits": captured[0], "together": together, "alone": alone}


def test_tensor_parallel_adapters_equal_peft_and_the_single_process(served: tuple, tmp_path: Path) -> None:
    from zerotron.distributed.launch import spawn

    ref, model, paths = served
    ref.save_pretrained(str(tmp_path))
    runs = spawn(
        _worker, 2, args=(str(tmp_path), paths), timeout_s=600, backend="gloo", start_method="forkserver"
    )
    got = runs[0]
    assert got["together"] == got["alone"]  # tokens and log-probabilities, bit for bit
    logits = got["logits"]
    assert logits.shape[0] == len(PROMPTS)  # type: ignore[attr-defined]  # one step: all together
    models = {name: _peft(ref, path) for name, path in paths.items()}
    with torch.no_grad():
        for row, (prompt, lora) in enumerate(zip(PROMPTS, LORAS)):
            want = (models[lora] if lora else ref)(torch.tensor([prompt])).logits[0, -1]
            # 2e-5 as on one rank (the stacked slots' products); the sum over 2 ranks rounds alike; the
            # vocabulary is padded to a multiple of the ranks
            torch.testing.assert_close(logits[row, : len(want)], want, rtol=0, atol=2e-5)  # type: ignore[index]
    single = _run(_engine(model, paths), PROMPTS, LORAS, GREEDY)
    assert [tokens for tokens, _ in got["together"]] == [tokens for tokens, _ in single]  # type: ignore[attr-defined]
    for (_, mine), (_, theirs) in zip(got["together"], single):  # type: ignore[call-overload]
        torch.testing.assert_close(torch.tensor(mine), torch.tensor(theirs), rtol=0, atol=1e-4)
    assert len({tuple(t) for t, _ in single}) > 3  # the adapters matter


def _runtime_worker(model_dir: str, paths: dict[str, Path], gone: str) -> dict[str, object]:
    """One of 2 tensor-parallel ranks: every rank loads "alpha" at start; the first then loads "beta"
    and "gamma" at run time (the other ranks read them when it says, between its steps), after a load
    whose files the other rank cannot read (gone once the first rank has read them)."""
    import shutil

    from zerotron.build.builder import load_model
    from zerotron.distributed.launch import current_rank_and_world
    from zerotron.distributed.mesh import Mesh, ParallelDims
    from zerotron.serve.lora import LoraError

    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims(world, dp=1, tp=world), rank)
    group = mesh.group("tp")
    model, _ = load_model(model_dir, torch.float32, "cpu", mesh)
    engine = Engine(model, None, EngineConfig(num_blocks=128, max_loras=3), group)
    engine.load_lora("alpha", str(paths["alpha"]))
    if group.rank_in_group != 0:
        engine.runner.follow()
        return {}
    assert engine.lora is not None
    _run(engine, PROMPTS[:2], LORAS[:2], GREEDY)  # steps before the loads
    missing = engine.lora.read("missing", gone)
    shutil.rmtree(gone)
    error = ""
    try:
        engine.add_lora(missing, share=True)
    except LoraError as err:
        error = str(err)
    for name in ("beta", "gamma"):
        engine.add_lora(engine.lora.read(name, str(paths[name])), share=True)
    together = _run(engine, PROMPTS, LORAS, GREEDY)
    engine.runner.publish(None, stop=True)
    return {"together": together, "error": error, "names": sorted(a.name for a in engine.lora.names())}


def test_adapters_loaded_at_run_time_under_tensor_parallelism(served: tuple, tmp_path: Path) -> None:
    """Adapters the first rank loads at run time are read by every rank into the same slot: the
    single process's tokens; a load another rank cannot read is refused (naming the rank) and leaves
    its slot to the next load."""
    import shutil

    from zerotron.distributed.launch import spawn

    ref, model, paths = served
    ref.save_pretrained(str(tmp_path / "model"))
    gone = tmp_path / "gone"
    shutil.copytree(paths["beta"], gone)
    runs = spawn(
        _runtime_worker,
        2,
        args=(str(tmp_path / "model"), paths, str(gone)),
        timeout_s=600,
        backend="gloo",
        start_method="forkserver",
    )
    got = runs[0]
    assert "rank(s) 1 could not read" in got["error"] and "\n" not in got["error"]  # type: ignore[operator]
    assert got["names"] == ["alpha", "beta", "gamma"]
    single = _run(_engine(model, paths), PROMPTS, LORAS, GREEDY)
    assert [tokens for tokens, _ in got["together"]] == [tokens for tokens, _ in single]  # type: ignore[attr-defined]
    for (_, mine), (_, theirs) in zip(got["together"], single):  # type: ignore[call-overload]
        torch.testing.assert_close(torch.tensor(mine), torch.tensor(theirs), rtol=0, atol=1e-4)
