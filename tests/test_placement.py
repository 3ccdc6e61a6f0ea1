"""The placement record (zerotron/parallel/placement.py): each distinct element is counted once.

Across all ranks of a layout, the boxes the ranks count in the gradient norm must tile every parameter
of the whole model exactly once (no element twice, none missing), and the parameter count must equal
the single-process model's. The reference is the single-process model built from the same config.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from tests.harness import run_distributed
from zerotron.components.state import model_placements
from zerotron.config_load import load_config
from zerotron.distributed.launch import current_rank_and_world
from zerotron.distributed.mesh import Mesh, ParallelDims
from zerotron.models.llama import LlamaForCausalLM
from zerotron.parallel.placement import counts_in_norm
from zerotron.train.trainer import Trainer

BASE = [
    "model.hidden_size=32",
    "model.num_hidden_layers=4",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "model.intermediate_size=64",
    "model.vocab_size=260",
    "train.seq_len=16",
    "train.global_batch=4",
    "train.micro_batch=1",
    "train.steps=1",
]
MOE = ["model.num_local_experts=4", "model.intermediate_size=32", "train.global_batch=8"]


def _body(overrides: list[str], run_dir: str) -> dict:
    rank, world = current_rank_and_world()
    cfg = load_config(None, [*BASE, *overrides])
    mesh = Mesh(ParallelDims.from_config(cfg.parallel, world), rank)
    tokens = np.arange(4096, dtype=np.int64) % 250
    trainer = Trainer(cfg, mesh, Path(run_dir) / f"r{rank}", tokens)
    records = model_placements(trainer.model, mesh.dims.tp, trainer.zero)
    boxes = []
    for name, p in trainer.model.named_parameters():
        record = records[name]
        if counts_in_norm(record, mesh.coords) and mesh.group(record.grad_axis).rank_in_group == 0:
            boxes.append((name.split("chunks.")[-1], record.global_shape, record.offsets, tuple(p.shape)))
    params = dict(trainer.model.named_parameters(remove_duplicate=False))
    ranges = {(n, mesh.coords["tp"]): (r.flat, params[n].numel()) for n, r in records.items() if r.flat}
    return {
        "ranges": ranges,
        "boxes": boxes,
        "n_params": trainer.n_params,
        "norm_numel": sum(p.numel() for params, _ in trainer.norm_classes for p in params),
    }


@pytest.mark.parametrize(
    ("world", "overrides"),
    [
        (2, ["parallel.tp=2"]),
        (2, ["parallel.pp=2"]),
        (4, ["parallel.pp=2", "parallel.tp=2"]),
        (4, ["parallel.tp=2", "parallel.zero=1"]),
        (4, [*MOE, "parallel.ep=2", "parallel.zero=1"]),
        (4, [*MOE, "parallel.ep=4", "parallel.zero=3"]),
    ],
    ids=["tp2", "pp2", "pp2-tp2", "tp2-zero1", "ep2-dp4-zero1", "ep4-zero3"],
)
def test_norm_boxes_tile_the_model_once(world: int, overrides: list[str], tmp_path: Path) -> None:
    """Each element of the model is counted in the norm, and written, by exactly one rank (an expert
    tensor's rows by the first replica of the EP rank holding them)."""
    results = run_distributed(_body, world, overrides, str(tmp_path), timeout=300)
    reference = LlamaForCausalLM(load_config(None, [*BASE, *overrides]).model)
    whole = sum(p.numel() for p in reference.parameters())  # tied embedding once
    assert {r["n_params"] for r in results} == {whole}
    counted = [box for r in results for box in r["boxes"]]
    assert sum(math.prod(shape) for *_, shape in counted) == whole  # a replicated box twice would exceed it
    assert len({(name, offsets) for name, _, offsets, _ in counted}) == len(counted)
    # What the trainer adds to the norm (whole tensors, or ZeRO's shard segments over dp) tiles it too.
    assert sum(r["norm_numel"] for r in results) == whole


def test_zero_ranges_in_the_record_tile_each_box_over_dp(tmp_path: Path) -> None:
    """Under ZeRO the record carries each rank's flat range: over the dp ranks of one tp box they cover
    the box exactly once."""
    results = run_distributed(_body, 4, ["parallel.tp=2", "parallel.zero=2"], str(tmp_path), timeout=300)
    reference = dict(LlamaForCausalLM(load_config(None, BASE).model).named_parameters(remove_duplicate=False))
    by_box: dict[tuple[str, int], list[tuple[int, int]]] = {}
    box_numel: dict[tuple[str, int], int] = {}
    for r in results:
        for key, (flat, numel) in r["ranges"].items():
            by_box.setdefault(key, []).append(tuple(flat))
            box_numel[key] = numel
    assert {name for name, _ in by_box} == set(reference)  # the tied head shares the embedding's ranges
    for key, ranges in by_box.items():
        name = key[0]
        covered = sorted((start, length) for start, length in ranges if length)
        ends = [start + length for start, length in covered]
        assert [start for start, _ in covered] == [0, *ends[:-1]], (name, covered)  # contiguous, no overlap
        assert ends[-1] == box_numel[key], (key, ends[-1], box_numel[key])
