"""GPTQ, AWQ and compressed-tensors checkpoints kept packed under tensor parallelism (``zerotron serve
DIR --nproc 2``, the checkpoint's method chosen, or ``--quantization gptq|awq|compressed-tensors``).

References: the single process's packed layers (each rank's part, read back through its kernel,
equals its slice of the whole layer's weight bit for bit), the one-rank engine's greedy tokens over
the same checkpoint, and the engine alone (batch invariance).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_hf_packed import _checkpoint
from tests.test_serve_engine import _run
from tests.test_serve_quant_tp import rank_shards, run_on_first_rank
from zerotron.build.builder import load_model
from zerotron.components.sampling import SamplingParams
from zerotron.models.hf_packed import PackedFormatError, Unpacked, shard_unpacked
from zerotron.serve.engine import Engine, EngineConfig

LAYERS = ("layers.0.self_attn.q_proj", "layers.0.self_attn.o_proj", "layers.1.mlp.down_proj")
PROMPTS = [[5, 17, 42, 7], [100, 3], [9, 9, 9, 9, 9, 1], [250, 12, 4]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)


def _worker(model_dir: str, method: str) -> dict[str, object]:
    """One of 2 tensor-parallel ranks: its part of LAYERS read back, with where it lies; the first rank
    also runs the prompts together and one by one."""
    from zerotron.distributed.launch import current_rank_and_world
    from zerotron.distributed.mesh import Mesh, ParallelDims

    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims(world, dp=1, tp=world), rank)
    group = mesh.group("tp")
    model, _ = load_model(model_dir, torch.float32, "cpu", mesh, quantization=method)
    engine = Engine(model, None, EngineConfig(num_blocks=64, quantization=method), group)
    shards = rank_shards(model, LAYERS, lambda layer: layer.dequantize())
    out: dict[str, object] = {"shards": shards, "kept": dict(engine.runner.quantized.kept)}  # type: ignore[union-attr]
    return run_on_first_rank(engine, group, out, PROMPTS, PARAMS)


@pytest.mark.parametrize(
    ("method", "bits"), [("gptq", 4), ("awq", 4), ("gptq", 8)], ids=["gptq", "awq", "gptq8"]
)
def test_packed_parts_equal_the_single_process(tmp_path: Path, method: str, bits: int) -> None:
    from zerotron.distributed.launch import spawn

    packed, _ = _checkpoint(tmp_path, method, 32, bits=bits)
    runs = spawn(
        _worker, 2, args=(str(packed), method), timeout_s=600, backend="gloo", start_method="forkserver"
    )
    single, _ = load_model(str(packed), torch.float32, "cpu", quantization=method)
    for run in runs:
        assert run["kept"] == {f"int{bits}": 14}
        for name, (dim, offsets, weight) in run["shards"].items():  # type: ignore[attr-defined]
            whole = single.get_submodule(name).dequantize()
            start, size = offsets[dim], weight.shape[dim]
            assert torch.equal(weight, whole.narrow(dim, start, size)), name
    got = runs[0]
    assert got["together"] == got["alone"]  # batch-invariant: tokens and log-probabilities, bit for bit
    want = _run(Engine(single, None, EngineConfig(quantization=method)), PROMPTS, PARAMS)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got["together"], want):  # type: ignore[call-overload]
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4)


def test_a_part_that_splits_a_group_is_refused() -> None:
    """Act-order assigns inputs to groups out of order: a row-parallel half of them holds parts of
    groups, which the kernels cannot take (a natural order holds whole ones)."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randint(0, 16, (32, 128), generator=gen)
    natural = torch.arange(128) // 32
    scales, zeros = torch.rand(4, 32, generator=gen), torch.randint(0, 16, (4, 32), generator=gen)
    half = shard_unpacked(Unpacked(values, zeros, scales, natural), slice(None), slice(64, 128), "w")
    assert torch.equal(half.groups, natural[:64]) and torch.equal(half.scales, scales[2:])
    shuffled = natural[torch.randperm(128, generator=gen)]
    with pytest.raises(PackedFormatError, match="do not hold whole groups of 32") as e:
        shard_unpacked(Unpacked(values, zeros, scales, shuffled), slice(None), slice(64, 128), "w")
    assert "\n" not in str(e.value)
