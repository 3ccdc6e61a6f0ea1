"""GPTQ, AWQ and compressed-tensors checkpoints kept packed under tensor parallelism (``zerotron serve
DIR --nproc 2``, the checkpoint's method chosen, or ``--quantization gptq|awq|compressed-tensors``), and
a GGUF file's blocks kept (``--quantization gguf``).

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
from tests.test_serve_gguf import smollm2_gguf as smollm2_gguf  # noqa: F401  # the fixture
from tests.test_serve_quant_tp import rank_shards, run_on_first_rank
from zerotron.build.builder import load_model
from zerotron.components.sampling import SamplingParams
from zerotron.models.hf_packed import (
    PackedInt4Linear,
    PackedInt8Linear,
    Unpacked,
    dequantize,
    shard_unpacked,
)
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
    ("method", "bits", "act_order"),
    [
        ("gptq", 4, False),
        ("awq", 4, False),
        ("gptq", 8, False),
        ("gptq", 3, False),
        ("gptq", 4, True),
        ("gptq", 8, True),
    ],
    # act-order: a row-parallel rank holds parts of groups, padded by the layers to equal groups
    ids=["gptq", "awq", "gptq8", "gptq3", "gptq-act-order", "gptq8-act-order"],
)
def test_packed_parts_equal_the_single_process(
    tmp_path: Path, method: str, bits: int, act_order: bool
) -> None:
    from zerotron.distributed.launch import spawn

    packed, _ = _checkpoint(tmp_path, method, 32, act_order=act_order, bits=bits)
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


def test_a_part_keeps_its_groups_scales_and_zeros() -> None:
    """A row-parallel half in the natural order holds whole groups (2 of 4, renumbered); of act-order's
    groups, which scatter over the inputs, it holds parts of every one."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randint(0, 16, (32, 128), generator=gen)
    natural = torch.arange(128) // 32
    scales, zeros = torch.rand(4, 32, generator=gen), torch.randint(0, 16, (4, 32), generator=gen)
    half = shard_unpacked(Unpacked(values, zeros, scales, natural), slice(None), slice(64, 128))
    assert torch.equal(half.groups, natural[:64]) and torch.equal(half.scales, scales[2:])
    assert torch.equal(half.zeros, zeros[2:]) and torch.equal(half.values, values[:, 64:])
    shuffled = natural[torch.randperm(128, generator=gen)]
    part = shard_unpacked(Unpacked(values, zeros, scales, shuffled), slice(8, 24), slice(64, 128))
    assert torch.equal(part.scales, scales[:, 8:24]) and torch.equal(part.groups, shuffled[64:])


@pytest.mark.parametrize("bits", [4, 8])
def test_a_part_of_act_order_groups_is_its_dequantised_weight(bits: int) -> None:
    """A row-parallel half of act-order groups (parts of unequal sizes) as the layers pad them (4-bit:
    each part to the kernel's 32 inputs; 8-bit: all to one size, a multiple of 8): the weight read
    back is ``(q − z)·s`` of the part's inputs, rows are batch-invariant, and the product is the
    dequantised weight's."""
    gen = torch.Generator().manual_seed(1)
    values = torch.randint(0, 1 << bits, (32, 256), generator=gen)
    groups = (torch.arange(256) // 32)[torch.randperm(256, generator=gen)]
    scales, zeros = torch.rand(8, 32, generator=gen), torch.randint(0, 1 << bits, (8, 32), generator=gen)
    part = shard_unpacked(Unpacked(values, zeros, scales, groups, bits), slice(None), slice(128, 256))
    assert len(set(torch.bincount(part.groups).tolist())) > 1  # unequal parts
    layer = (PackedInt4Linear if bits == 4 else PackedInt8Linear)(part)
    assert layer.padded and layer.in_features == 128
    want = dequantize(part)
    torch.testing.assert_close(layer.dequantize(), want, rtol=0, atol=1e-6)
    x = torch.randn(6, 128, generator=gen)
    y = layer(x)
    assert torch.equal(torch.cat([layer(x[i : i + 1]) for i in range(6)]), y)
    ref = x @ want.T
    assert (y - ref).abs().max() <= 1e-6 * ref.abs().max()  # fp32 sums in another order


GGUF_LAYERS = ("layers.0.self_attn.q_proj", "layers.0.self_attn.o_proj", "layers.29.mlp.down_proj")


def _gguf_worker(path: str, prompts: list[list[int]]) -> dict[str, object]:
    """One of 3 tensor-parallel ranks serving SmolLM2's GGUF blocks: its part of GGUF_LAYERS read back
    through its kernel on the identity, (in, out); the first rank also runs the prompts."""
    from zerotron.distributed.launch import current_rank_and_world
    from zerotron.distributed.mesh import Mesh, ParallelDims

    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims(world, dp=1, tp=world), rank)
    group = mesh.group("tp")
    model, _ = load_model(path, torch.float32, "cpu", mesh, quantization="gguf")
    engine = Engine(model, None, EngineConfig(num_blocks=64, max_model_len=512, quantization="gguf"), group)
    shards = rank_shards(model, GGUF_LAYERS, lambda layer: _identity(layer))
    out: dict[str, object] = {"shards": shards, "kept": dict(engine.runner.quantized.kept)}  # type: ignore[union-attr]
    out["dense"] = dict(engine.runner.quantized.dense)  # type: ignore[union-attr]
    return run_on_first_rank(engine, group, out, prompts, PARAMS)


def _identity(layer: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return layer(torch.eye(layer.in_features)).float()


@pytest.mark.smollm2
def test_gguf_blocks_under_tensor_parallelism(smollm2_gguf: str) -> None:
    """SmolLM2's Q4_1 blocks on 3 ranks: each rank's part of a layer, read back through its kernel,
    equals its slice of the single process's kept layer bit for bit; greedy tokens equal the
    dequantised model's (log-probs within 1e-4, as on one rank); batch-invariant."""
    from zerotron.distributed.launch import spawn

    single, tokenizer = load_model(smollm2_gguf, torch.float32, "cpu", quantization="gguf")
    prompts = [tokenizer.encode(p) for p in ("The capital of France is", "def add(a, b):", "Once upon a")]
    runs = spawn(
        _gguf_worker,
        3,
        args=(smollm2_gguf, prompts),
        timeout_s=900,
        backend="gloo",
        start_method="forkserver",
    )
    for run in runs:
        assert run["kept"] == {"Q4_1": 210}  # every decoder linear; the vocab-parallel head stays dense
        for name, (dim, offsets, part) in run["shards"].items():  # type: ignore[attr-defined]
            whole = _identity(single.get_submodule(name)).T  # (out, in)
            want = whole.narrow(dim, offsets[dim], part.shape[1 - dim])
            assert torch.equal(part.T, want), name
    got = runs[0]
    assert got["together"] == got["alone"]
    dense, _ = load_model(smollm2_gguf, torch.float32, "cpu")
    ref = _run(Engine(dense, tokenizer, EngineConfig()), prompts, PARAMS)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got["together"], ref):  # type: ignore[call-overload]
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4)
