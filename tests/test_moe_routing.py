"""Router variants beyond Mixtral's softmax top-k, each against an independent reference.

- Sigmoid scores, the aux-loss-free balancing bias in the top-k choice and the routed scaling factor:
  transformers' DeepSeek-V3 MoE block (one expert group) on the same weights — outputs and gradients.
- The bias update: DeepSeek-V3's rule (up by the rate for an expert below the mean load, down above),
  computed here from a plain top-k of the scores.
- Expert capacity: the experts' outputs with the dropped slots worked out here by a loop over each
  sequence's slots of each expert (heaviest kept), run through transformers' experts module.
- Training with these options on dp 2, ep 2 and tp 2 equals the single process (there is no transformers
  model that trains with a bias update or capacity).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.harness import run_distributed
from tests.test_train_3d import _body
from tests.test_train_dp import _tokens
from zerotron.config import ModelConfig
from zerotron.config_check import validate
from zerotron.config_load import ConfigError, load_config
from zerotron.models.moe import MoEBlock, update_router_bias

transformers = pytest.importorskip("transformers")
deepseek = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")

H, E, K, INTER = 32, 8, 2, 16


def _deepseek_block() -> torch.nn.Module:
    config = transformers.DeepseekV3Config(
        hidden_size=H,
        moe_intermediate_size=INTER,
        n_routed_experts=E,
        num_experts_per_tok=K,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    block = deepseek.DeepseekV3MoE(config).float()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
        block.gate.e_score_correction_bias.normal_(0.0, 0.2)
    return block


def _ours(**fields: object) -> MoEBlock:
    cfg = ModelConfig(
        hidden_size=H,
        num_local_experts=E,
        num_experts_per_tok=K,
        intermediate_size=INTER,
        **fields,  # type: ignore[arg-type]
    )
    return MoEBlock(cfg).float()


def _close(got: torch.Tensor | None, want: torch.Tensor | None) -> None:
    """Equal within 1e-5 of the reference's norm (fp32 sums in another order)."""
    assert got is not None and want is not None and got.shape == want.shape
    assert float((got - want).norm() / want.norm()) <= 1e-5


def test_sigmoid_bias_and_scaling_equal_deepseek_v3() -> None:
    ref = _deepseek_block()
    ours = _ours(scoring_func="sigmoid", routed_scaling_factor=2.5, router_bias_update_rate=0.001)
    with torch.no_grad():
        ours.gate.weight.copy_(ref.gate.weight)
        ours.gate.e_score_correction_bias.copy_(ref.gate.e_score_correction_bias)
        ours.experts.gate_up_proj.copy_(ref.experts.gate_up_proj)
        ours.experts.down_proj.copy_(ref.experts.down_proj)
    x = torch.randn(3, 10, H, generator=torch.Generator().manual_seed(1))
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = ref(x_ref) - ref.shared_experts(x_ref)  # the routed part (ours has no ungated shared expert)
    got = ours(x_ours)
    _close(got, expected)
    g = torch.randn_like(got)
    (expected * g).sum().backward()
    (got * g).sum().backward()
    _close(x_ours.grad, x_ref.grad)
    for name in ("gate.weight", "experts.gate_up_proj", "experts.down_proj"):
        _close(ours.get_parameter(name).grad, ref.get_parameter(name).grad)


def test_bias_moves_toward_balance_by_the_rate() -> None:
    ours = _ours(scoring_func="sigmoid", router_bias_update_rate=0.01)
    torch.nn.init.normal_(ours.gate.weight, 0.0, 0.5)
    for p in ours.experts.parameters():
        torch.nn.init.normal_(p, 0.0, 0.1)
    x = torch.randn(2, 16, H, generator=torch.Generator().manual_seed(2))
    ours(x)
    ids = torch.topk(torch.sigmoid(x.reshape(-1, H) @ ours.gate.weight.T), K, dim=-1).indices
    load = torch.bincount(ids.flatten(), minlength=E).float()
    assert ours.stats is not None
    update_router_bias(ours, ours.stats.counts[None], 0.01)
    expected = 0.01 * torch.sign(load.mean() - load)
    torch.testing.assert_close(ours.gate.e_score_correction_bias, expected)
    assert expected.abs().sum() > 0  # the load was not already balanced


def _kept_by_loop(weights: torch.Tensor, ids: torch.Tensor, seq: int, capacity: int) -> torch.Tensor:
    """(n, k) bool: of each sequence's slots routed to each expert, the ``capacity`` heaviest."""
    keep = torch.zeros_like(ids, dtype=torch.bool)
    n = ids.shape[0]
    for start in range(0, n, seq):
        for e in range(E):
            slots = [(t, c) for t in range(start, start + seq) for c in range(K) if ids[t, c] == e]
            slots.sort(key=lambda tc: -float(weights[tc]))  # stable: earlier slot first on ties
            for t, c in slots[:capacity]:
                keep[t, c] = True
    return keep


def test_capacity_drops_the_lowest_weighted_slots_per_sequence() -> None:
    ref = _deepseek_block()
    ours = _ours(expert_capacity_factor=0.5, norm_topk_prob=False)
    with torch.no_grad():
        ours.gate.weight.copy_(ref.gate.weight)
        ours.experts.gate_up_proj.copy_(ref.experts.gate_up_proj)
        ours.experts.down_proj.copy_(ref.experts.down_proj)
    b, s = 3, 12
    x = torch.randn(b, s, H, generator=torch.Generator().manual_seed(3))
    flat = x.reshape(-1, H)
    probs = torch.softmax(flat @ ref.gate.weight.T, dim=-1)
    weights, ids = torch.topk(probs, K, dim=-1)
    capacity = math.ceil(0.5 * s * K / E)
    keep = _kept_by_loop(weights, ids, s, capacity)
    assert 0 < int((~keep).sum()) < keep.numel()  # some slots dropped, not all
    marked = torch.where(keep, ids, torch.full_like(ids, E))  # transformers skips expert index E
    expected = ref.experts(flat, marked, weights).reshape(b, s, H)
    _close(ours(x), expected)


def test_routing_options_on_a_dense_model_or_split_sequences_are_refused() -> None:
    base = ["model.preset=tiny", "train.seq_len=32"]
    with pytest.raises(ConfigError, match="model.scoring_func set the experts of an MoE model"):
        validate(load_config(None, [*base, "model.scoring_func=sigmoid"]), 1)
    moe = [*base, "model.num_local_experts=4", "model.expert_capacity_factor=1.5"]
    with pytest.raises(ConfigError, match="expert_capacity_factor drops tokens per whole sequence"):
        validate(load_config(None, [*moe, "parallel.cp=2"]), 2)


VARIANTS = [
    "model.preset=tiny",
    "model.vocab_size=256",
    "model.num_local_experts=4",
    "model.num_experts_per_tok=2",
    "model.intermediate_size=32",
    "model.scoring_func=sigmoid",
    "model.routed_scaling_factor=2.0",
    "model.router_bias_update_rate=0.01",
    "model.router_aux_loss_coef=0.01",
    "model.expert_capacity_factor=1.0",
    "train.seq_len=32",
    "train.global_batch=8",
    "train.steps=8",
    "train.grad_clip=0.3",
    "train.lr=0.003",
    "train.warmup_steps=0",
    "checkpoint.every=0",
]


@pytest.mark.parametrize(
    ("world", "layout", "micro"),
    [
        (2, ["train.micro_batch=4"], 8),
        (2, ["train.micro_batch=4", "parallel.ep=2"], 8),
        # tp sums attention in another order; a capacity cut between two near-equal weights can then
        # flip (a step's loss moves by ~1e-5), so this layout runs dropless (the rest is exact)
        (
            4,
            [
                "train.micro_batch=4",
                "parallel.ep=2",
                "parallel.tp=2",
                "parallel.zero=3",
                "model.expert_capacity_factor=0",
            ],
            8,
        ),
        # 4 micro-batches through a pipeline (dp 1): pooled per micro-batch over every stage, as one
        # process pools them per accumulation step
        (2, ["train.micro_batch=2", "parallel.pp=2", "parallel.dp=1"], 2),
        (
            2,
            [
                "train.micro_batch=2",
                "parallel.pp=2",
                "parallel.dp=1",
                "parallel.virtual_stages=2",
                "parallel.pp_schedule=interleaved",
            ],
            2,
        ),
        (4, ["train.micro_batch=4", "parallel.pp=2", "parallel.ep=2", "parallel.zero=2"], 8),
    ],
    ids=["dp2", "ep2", "ep2-tp2-zero3", "pp2-accumulation", "pp2-interleaved", "pp2-ep2-zero2"],
)
def test_sigmoid_bias_capacity_training_equals_one_process(
    world: int, layout: list[str], micro: int, tmp_path: Path
) -> None:
    tokens = _tokens()
    model = [x for x in layout if x.startswith("model.")]
    one = run_distributed(
        _body, 1, [*VARIANTS, *model, f"train.micro_batch={micro}"], tokens, str(tmp_path / "a"), 8, None
    )
    validate(load_config(None, [*VARIANTS, *layout]), world)
    many = run_distributed(
        _body, world, [*VARIANTS, *layout], tokens, str(tmp_path / "b"), 8, None, timeout=300
    )
    for r in many:
        np.testing.assert_allclose(r["losses"], one[0]["losses"], rtol=1e-5)
    assert len(set(np.round(one[0]["losses"], 6))) > 1


def test_balancing_bias_is_saved_and_resumes_on_another_layout(tmp_path: Path) -> None:
    """4 steps at ep 2 with the bias moving, saved, 4 more on one process: the 8 steps of one process
    (the checkpoint holds each router's bias; without it the resumed routing would differ)."""
    from zerotron.checkpoint import store
    from zerotron.components.state import read_model_tensors

    tokens = _tokens()
    one = run_distributed(_body, 1, [*VARIANTS, "train.micro_batch=8"], tokens, str(tmp_path / "a"), 8, None)
    ep2 = [*VARIANTS, "train.micro_batch=4", "parallel.ep=2"]
    first = run_distributed(_body, 2, ep2, tokens, str(tmp_path / "b"), 4, None, timeout=300)
    ckpt = store.find_latest(tmp_path / "b" / "checkpoints")
    biases = {k: v for k, v in read_model_tensors(ckpt).items() if k.endswith("e_score_correction_bias")}
    layers = load_config(None, VARIANTS).model.num_hidden_layers
    assert len(biases) == layers and any(float(b.abs().max()) > 0 for b in biases.values())
    from zerotron.build.builder import load_model

    served, _ = load_model(str(ckpt), torch.bfloat16, "cpu")  # what generate and serve load: the biases too
    for name, bias in biases.items():
        assert served.get_buffer(name).dtype == torch.float32 and torch.equal(served.get_buffer(name), bias)
    second = run_distributed(
        _body, 1, [*VARIANTS, "train.micro_batch=8"], tokens, str(tmp_path / "c"), 4, str(ckpt), timeout=300
    )
    np.testing.assert_allclose(first[0]["losses"] + second[0]["losses"], one[0]["losses"], rtol=1e-5)


def test_hf_export_refuses_routing_no_written_architecture_holds() -> None:
    from zerotron.models.hf import ModelLoadError, hf_architecture

    cfg = load_config(None, VARIANTS).model
    with pytest.raises(
        ModelLoadError, match="no Hugging Face architecture zerotron writes routes by sigmoid"
    ):
        hf_architecture(cfg)
