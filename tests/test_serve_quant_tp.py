"""int8 and int4 weights under tensor parallelism (``zerotron serve --nproc 2 --quantization ...``).

References: the single process's quantisation of the whole model (each rank's quantised shard, read
back through its kernel on the identity, equals its slice of the whole layer's, bit for bit; the
row-parallel int8 scales are the whole rows'), the one-rank quantised engine's greedy tokens, and the
engine alone (batch invariance).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_serve_engine import CFG, GREEDY, _prompts, _run, sharpened_pair
from zerotron.models.quant import Int4Linear, Int8Linear, quantize
from zerotron.serve.engine import Engine, EngineConfig

TP_CFG = dataclasses.replace(CFG, intermediate_size=128)  # int4: a row-parallel half holds whole groups
PROMPTS = _prompts([5, 17, 9, 30], seed=13)
PARAMS = dataclasses.replace(GREEDY, max_tokens=12)
LAYERS = ("layers.0.self_attn.q_proj", "layers.0.self_attn.o_proj", "layers.1.mlp.down_proj")


def _read_back(layer: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The quantised weight as its kernel multiplies by it: the layer on the identity in the model's
    dtype, (in, out)."""
    with torch.no_grad():
        return layer(torch.eye(layer.in_features, dtype=dtype)).float()


def _worker(model_dir: str, method: str, dtype: torch.dtype) -> dict[str, object]:
    """One of 2 tensor-parallel ranks: its shards of LAYERS read back with where they lie; the first
    rank also runs the prompts together and one by one."""
    from zerotron.build.builder import load_model
    from zerotron.distributed.launch import current_rank_and_world
    from zerotron.distributed.mesh import Mesh, ParallelDims

    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims(world, dp=1, tp=world), rank)
    group = mesh.group("tp")
    model, _ = load_model(model_dir, dtype, "cpu", mesh)
    engine = Engine(model, None, EngineConfig(num_blocks=128, quantization=method), group)
    shards = rank_shards(model, LAYERS, lambda layer: _read_back(layer, dtype))
    out: dict[str, object] = {"shards": shards, "quantized": engine.runner.quantized}
    return run_on_first_rank(engine, group, out, PROMPTS, PARAMS)


def rank_shards(model: torch.nn.Module, layers: tuple[str, ...], read: Any) -> dict[str, tuple]:
    """Each of ``layers``' (split dim, offsets, ``read`` of its quantised module) on this rank, its dense
    shard checked freed."""
    shards = {}
    for name in layers:
        module = model.get_submodule(name)
        spec = module.tp_specs["weight"]
        assert module.weight.numel() == 0  # the dense shard freed
        shards[name] = (spec.dim, spec.offsets, read(module.quantized))
    return shards


def run_on_first_rank(engine: Engine, group: Any, out: dict, prompts: list, params: Any) -> dict:
    """The first rank runs ``prompts`` together and one by one (into ``out``) and stops the others,
    which follow its steps."""
    if group.rank_in_group != 0:
        engine.runner.follow()
        return out
    out["together"] = _run(engine, prompts, params)
    out["alone"] = [_run(engine, [p], params)[0] for p in prompts]
    engine.runner.publish(None, stop=True)
    return out


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tensor_parallel_shards_are_the_single_process_quantisation(
    tmp_path: Path, method: str, dtype: torch.dtype
) -> None:
    from zerotron.distributed.launch import spawn

    ref, model = sharpened_pair(TP_CFG)
    ref.save_pretrained(str(tmp_path))
    runs = spawn(
        _worker,
        2,
        args=(str(tmp_path), method, dtype),
        timeout_s=600,
        backend="gloo",
        start_method="forkserver",
    )
    whole = copy.deepcopy(model).to(dtype)
    quantize(whole, method)
    kind = Int8Linear if method == "int8" else Int4Linear
    for name in LAYERS:
        layer = whole.get_submodule(name)
        assert isinstance(layer, kind)
        full = _read_back(layer, dtype)  # (in, out)
        parts = [run["shards"][name] for run in runs]  # type: ignore[index]
        for dim, offsets, got in parts:
            if dim == 0:  # column-parallel: this rank's outputs
                want = full[:, offsets[0] : offsets[0] + got.shape[1]]
            else:  # row-parallel: this rank's inputs, with the whole rows' scales
                want = full[offsets[1] : offsets[1] + got.shape[0]]
            assert torch.equal(got, want), name
    quantized = [run["quantized"] for run in runs]
    # the values with their scales (and zeros) against the dense shards, as on one rank
    shares = {"int8": 0.55, "int4": 0.34} if dtype == torch.bfloat16 else {"int8": 0.3, "int4": 0.2}
    share = shares[method]
    assert all(0 < q.after < share * q.before for q in quantized), quantized  # type: ignore[attr-defined]
    first = runs[0]
    assert first["together"] == first["alone"]  # bit for bit, alone or batched
    if dtype == torch.float32:  # the one-rank quantised engine's tokens (the sum split over 2 ranks)
        single = Engine(copy.deepcopy(model), None, EngineConfig(num_blocks=128, quantization=method))
        want = _run(single, PROMPTS, PARAMS)
        for (tokens, logps), (ref_tokens, ref_logps) in zip(first["together"], want):  # type: ignore[call-overload]
            assert tokens == ref_tokens
            torch.testing.assert_close(torch.tensor(logps), torch.tensor(ref_logps), rtol=0, atol=1e-4)


def _refused_worker(model_dir: str) -> str:
    from zerotron.build.builder import load_model
    from zerotron.distributed.launch import current_rank_and_world
    from zerotron.distributed.mesh import Mesh, ParallelDims

    rank, world = current_rank_and_world()
    mesh = Mesh(ParallelDims(world, dp=1, tp=world), rank)
    model, _ = load_model(model_dir, torch.float32, "cpu", mesh)
    try:
        Engine(model, None, EngineConfig(num_blocks=64, quantization="int4"), mesh.group("tp"))
    except ValueError as err:
        return str(err)
    return ""


def test_int4_shards_without_whole_groups_are_refused_in_one_line(tmp_path: Path) -> None:
    """96 intermediate features over 2 ranks: 48 inputs a row-parallel half, not whole groups of 32."""
    from zerotron.distributed.launch import spawn

    ref, _ = sharpened_pair(CFG)
    ref.save_pretrained(str(tmp_path))
    errors = spawn(
        _refused_worker, 2, args=(str(tmp_path),), timeout_s=600, backend="gloo", start_method="forkserver"
    )
    assert all("does not hold whole groups of 32" in e and len(e.splitlines()) == 1 for e in errors), errors
