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


def test_runtime_adapter_loading_is_refused_under_tensor_parallelism(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from zerotron.cli import main

    assert main(["serve", "model.gguf", "--nproc", "2", "--allow-runtime-lora-updating"]) == 2
    assert "--lora-modules" in capsys.readouterr().err
