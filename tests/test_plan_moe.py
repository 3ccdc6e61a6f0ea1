"""`zerotron plan` for mixture-of-experts models: counts against Mixtral's published size, memory per
rank under expert parallelism written out by hand, the all-to-all term, bad layouts, the search.

The engine's own counts are compared in tests/test_plan_engine.py; the references here are
Mixtral-8x7B's parameter count (46,702,792,704 in its model card's safetensors; 12.9 B active per
token in the Mixtral paper) and the ZeRO arithmetic spelled out independently below.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from zerotron.config_load import load_config
from zerotron.plan import PROFILES, PlanError, plan_config
from zerotron.plan.layout import from_config
from zerotron.plan.model import stage_params, total_params
from zerotron.plan.search import search
from zerotron.shapes import ModelShape, flops_per_token

H100 = PROFILES["h100-sxm"]


def _mixtral(*overrides: str):  # noqa: ANN202
    return load_config(
        None,
        [
            "model.preset=mixtral-8x7b",
            "train.seq_len=4096",
            "train.global_batch=64",
            "train.micro_batch=1",
            "train.precision=bf16",
            *overrides,
        ],
    )


def test_mixtral_counts_match_the_published_model() -> None:
    m = ModelShape.from_config(_mixtral().model)
    assert total_params(m) == 46_702_792_704
    h, i, layers, e, k = 4096, 14336, 32, 8, 2
    expert = 3 * h * i
    active = total_params(m) - layers * (e - k) * expert
    assert round(active / 1e9, 1) == 12.9  # "13B active parameters" (Jiang et al. 2024)
    # FLOPs count the k experts a token runs and the router: a dense model with a k-times wider MLP
    # does the same matrix work except the router's 6·L·h·E.
    dense = dataclasses.replace(m, experts=0, top_k=0, intermediate=k * i)
    assert flops_per_token(m, 4096) - flops_per_token(dense, 4096) == 6 * layers * h * e


def test_expert_parallel_memory_by_hand() -> None:
    """dp 8 × ep 8 with ZeRO-1: dense optimizer states (and fp32 master shards) shard 8 ways, the
    experts' not at all (each rank is the only holder of its expert); ep 1 holds all 8 experts per
    layer and shards them 8 ways."""
    h, i, layers, vocab, e = 4096, 14336, 32, 32000, 8
    attn = h * (h + 2 * 1024) + h * h
    dense = 2 * vocab * h + h + layers * (attn + h * e + 2 * h)
    expert = 3 * h * i
    dense_tensors = 3 + layers * (2 + 4 + 1)

    def ceil(a: int, b: int) -> int:
        return -(-a // b)

    for ep in (1, 2, 8):
        cfg = _mixtral("parallel.zero=1", f"parallel.ep={ep}", "parallel.dp=8")
        mem = plan_config(cfg, H100, 8).memory
        local = layers * (e // ep) * expert
        edp = 8 // ep
        # bf16: 16-bit working weights whole, fp32 master shards (dense over dp, experts over edp)
        assert mem["params"] == 2 * (dense + local) + 4 * ceil(dense, 8) + 4 * ceil(local, edp)
        assert mem["grads"] == 4 * (dense + local)
        optimizer = 8 * ceil(dense, 8) + 4 * ceil(dense_tensors, 8)
        optimizer += 8 * ceil(local, edp) + 4 * ceil(layers * 2, edp)  # 2 stacked expert tensors a block
        assert mem["optimizer"] == optimizer, ep


def test_expert_parallelism_trades_memory_for_all_to_all() -> None:
    zero1 = {ep: plan_config(_mixtral("parallel.zero=1", f"parallel.ep={ep}"), H100, 16) for ep in (1, 4)}
    assert zero1[4].memory["params"] < zero1[1].memory["params"]  # 2 experts per block instead of 8
    # Under ZeRO-3 the parameter shards are the same size (1/16 of the experts either way), but each
    # gather brings in 2 experts, not 8.
    plans = {ep: plan_config(_mixtral("parallel.zero=3", f"parallel.ep={ep}"), H100, 16) for ep in (1, 4)}
    assert plans[4].memory["params"] == plans[1].memory["params"]
    assert plans[4].detail["zero3_gathered_params"] < plans[1].detail["zero3_gathered_params"] / 3
    assert plans[1].time["ep_comm"] == 0 and plans[4].time["ep_comm"] > 0
    # Per micro-batch and block: 4 all-to-alls of b·s·k·h bf16 bytes, 3/4 of them leaving the rank, on
    # the intra-node link (4 ranks 1 apart fit in a node of 8).
    m, layout, work = from_config(_mixtral("parallel.zero=3", "parallel.ep=4"), 16)
    nbytes = 1 * 4096 * 2 * 4096 * 2
    per = 3 * H100.intra_latency_s + nbytes * 3 / 4 / (H100.intra_bw * H100.comm_efficiency)
    micro_batches = 64 // 16
    assert plans[4].time["ep_comm"] == pytest.approx(micro_batches * 32 * 4 * per, rel=1e-9)
    # Activations: the expert MLPs run k = 2 times per token, so an MoE block holds more than a dense one.
    dense_cfg = _mixtral("parallel.zero=3", "model.num_local_experts=0")
    assert plans[1].memory["activations"] > plan_config(dense_cfg, H100, 16).memory["activations"]
    assert stage_params(m, 1, 1, 0, 32, 4).expert_elements == 32 * 2 * 3 * 4096 * 14336


@pytest.mark.parametrize(
    ("overrides", "gpus", "expected"),
    [
        (
            ["parallel.ep=3", "train.global_batch=48"],
            12,
            "ep=3 does not divide the 8 experts; choose ep in 1, 2, 4, 8",
        ),
        (["parallel.ep=8", "parallel.dp=4", "parallel.tp=2"], 8, "ep=8 does not divide parallel.dp*cp = 4"),
        (["model.num_experts_per_tok=9"], 8, "num_experts_per_tok=9 must be between 1 and"),
    ],
)
def test_bad_expert_layouts_are_explained(overrides: list[str], gpus: int, expected: str) -> None:
    with pytest.raises(PlanError, match=re.escape(expected)):
        plan_config(_mixtral(*overrides), H100, gpus)


def test_search_explores_expert_parallelism() -> None:
    """Mixtral on 64 H100s: the search tries every ep that divides the experts and dp·cp, and what it
    ranks fits; with 46.7 B parameters expert parallelism is among the fastest fitting layouts."""
    m, _, work = from_config(_mixtral(), 64)
    result = search(m, work, H100, 64, top=50)
    assert result.fitting > 0 and all(p.fits for p in result.plans)
    eps = {p.layout.ep for p in result.plans}
    assert eps - {1}, eps
    assert all(
        8 % ep == 0 and (p.layout.dp * p.layout.cp) % ep == 0 for p in result.plans for ep in [p.layout.ep]
    )
