"""One layout check (zerotron/layout.py): the config loader, the trainer's mesh and the planner agree.

Before it there were three validators; these layouts were accepted by the planner and refused by the
trainer (tp not dividing the MLP width, sequence parallelism over a sequence tp does not divide,
parameter offload without optimizer offload), so `zerotron plan` predicted runs that could not start.
"""

from __future__ import annotations

import pytest

from zerotron.config_check import validate
from zerotron.config_load import ConfigError, load_config
from zerotron.distributed.mesh import MeshError, ParallelDims
from zerotron.layout import LayoutError, LayoutSpec, check, check_degrees, spec_of
from zerotron.plan import PROFILES, PlanError, plan_config

BASE = [
    "model.hidden_size=64",
    "model.num_hidden_layers=4",
    "model.num_attention_heads=4",
    "model.intermediate_size=128",
    "model.vocab_size=260",
    "train.seq_len=32",
    "train.global_batch=8",
    "train.micro_batch=1",
]
REFUSED = [
    (["parallel.tp=2", "model.intermediate_size=129"], "does not divide model.intermediate_size=129"),
    (
        ["parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=33"],
        "does not divide train.seq_len=33",
    ),
    (
        ["parallel.zero=3", "parallel.offload_params=cpu"],
        "needs parallel.offload_optimizer=cpu or nvme",
    ),
    (["parallel.tp=3"], "parallel.tp=3 does not divide model.num_attention_heads=4"),
    (["parallel.pp=8"], "cannot split 4 layers into 8 pipeline stages"),
    (["parallel.pp=2", "parallel.virtual_stages=2"], "needs parallel.pp_schedule=interleaved"),
    (["train.global_batch=6"], "not divisible by the data-parallel size 4"),
    (["parallel.offload_optimizer=cpu"], "needs parallel.zero >= 1"),
]


def _world(overrides: list[str]) -> int:
    cfg = load_config(None, [*BASE, *overrides])
    p = cfg.parallel
    return 4 * p.tp * p.pp * p.cp


@pytest.mark.parametrize(("overrides", "message"), REFUSED, ids=lambda x: str(x)[:40])
def test_trainer_and_planner_refuse_with_the_same_words(overrides: list[str], message: str) -> None:
    cfg = load_config(None, [*BASE, *overrides])
    world = _world(overrides)
    with pytest.raises(ConfigError) as trainer:
        validate(cfg, world)
    with pytest.raises(PlanError) as planner:
        plan_config(cfg, PROFILES["h100-sxm"], world)
    assert message in str(trainer.value)
    assert str(trainer.value) == str(planner.value)


def test_well_formed_layouts_pass_both() -> None:
    for overrides in (
        [],
        ["parallel.tp=2", "parallel.sequence_parallel=true"],
        ["parallel.pp=2"],
        ["parallel.zero=3"],
    ):
        cfg = load_config(None, [*BASE, *overrides])
        world = _world(overrides)
        validate(cfg, world)
        plan_config(cfg, PROFILES["h100-sxm"], world)


def test_mesh_uses_the_same_degree_check() -> None:
    with pytest.raises(LayoutError) as shared:
        check_degrees(8, 2, 1, 1, 2)
    with pytest.raises(MeshError) as mesh:
        ParallelDims(8, dp=2, tp=2)
    assert str(shared.value) == str(mesh.value)
    assert "set parallel.dp=4 or --nproc 4" in str(mesh.value)


def test_models_the_trainer_has_not_built_are_well_formed_layouts() -> None:
    """Expert parallelism is refused by the trainer alone: the layout is well formed (context
    parallelism is built: tests/test_context_train.py)."""
    cfg = load_config(None, [*BASE, "parallel.cp=2"])
    check(spec_of(cfg, 8))
    validate(cfg, 8)
    moe = LayoutSpec(
        ParallelDims(8, dp=8, ep=4), heads=4, kv_heads=4, layers=4, experts=8, top_k=2, global_batch=8
    )
    check(moe)
    with pytest.raises(LayoutError, match="the model has no experts"):
        check(LayoutSpec(ParallelDims(8, dp=8, ep=2), heads=4, kv_heads=4, layers=4, global_batch=8))
