"""`zerotron plan` for DeepSeek-V3-shaped models: multi-head latent attention, dense-first blocks and an
ungated shared expert, checked against transformers' own DeepSeek-V3 (an independent implementation).

- Parameter counts: the ``deepseek-v3`` preset against ``DeepseekV3ForCausalLM`` built on the meta
  device from transformers' default config (DeepSeek-V3's: 671,026,404,352 parameters), whole and
  block by block (a dense-first block and an MoE block), and the pipeline stages adding up to it.
- FLOPs: the planner's count per token against torch's FLOP counter over a forward pass of a small
  random DeepSeek-V3 built by transformers (eager attention, every expert's tokens counted as run).
- The trainer refuses what it does not build (MLA, dense-first blocks) in one line; the planner
  refuses MLA fields that do not describe one model.
"""

from __future__ import annotations

import pytest
import torch

from zerotron.config_check import validate
from zerotron.config_load import ConfigError, load_config
from zerotron.plan import PROFILES, PlanError, plan_config
from zerotron.plan.layout import from_config
from zerotron.plan.model import dense_layer_params, layer_params, pipeline_layers, stage_params, total_params
from zerotron.shapes import ModelShape, flops_per_token

transformers = pytest.importorskip("transformers")

H100 = PROFILES["h100-sxm"]


def _deepseek(*overrides: str):  # noqa: ANN202
    return load_config(None, ["model.preset=deepseek-v3", "train.seq_len=4096", *overrides])


def _hf_deepseek_v3() -> torch.nn.Module:
    config = transformers.DeepseekV3Config()  # the defaults are DeepSeek-V3's config.json
    with torch.device("meta"):
        return transformers.DeepseekV3ForCausalLM(config)


def test_deepseek_v3_counts_equal_transformers() -> None:
    hf = _hf_deepseek_v3()
    m = ModelShape.from_config(_deepseek().model)
    assert total_params(m) == sum(p.numel() for p in hf.parameters()) == 671_026_404_352
    layers = hf.model.layers
    assert dense_layer_params(m) == sum(p.numel() for p in layers[0].parameters())
    assert layer_params(m) == sum(p.numel() for p in layers[3].parameters())
    # the pipeline's stages (dense-first blocks on the first) hold every parameter once
    per_rank = pipeline_layers(m, 4096, 8)
    assert sum(stage_params(m, 1, 8, r, per_rank[r]).elements for r in range(8)) == total_params(m)
    # expert parallelism divides the experts only: ep ranks together hold the experts once
    st1, st8 = stage_params(m, 1, 8, 3, per_rank[3]), stage_params(m, 1, 8, 3, per_rank[3], ep=8)
    assert st1.expert_elements == 8 * st8.expert_elements
    assert st1.elements - st1.expert_elements == st8.elements - st8.expert_elements


def test_tensor_parallel_split_of_latent_attention() -> None:
    """Under tp the up-projections and o split by heads, the two down-projections and the latent
    norms stay whole (Megatron's MLA): per rank, the transformers tensors' split and whole parts."""
    hf = _hf_deepseek_v3()
    m = ModelShape.from_config(_deepseek().model)
    attn = dict(hf.model.layers[3].self_attn.named_parameters())
    whole = sum(attn[n].numel() for n in attn if "_a_" in n)  # q_a_proj, q_a_layernorm, kv_a_* (down, norm)
    split = sum(attn[n].numel() for n in attn if "_a_" not in n)  # q_b_proj, kv_b_proj, o_proj
    rest = layer_params(m) - whole - split  # norms, router, shared and routed experts: not tp-split here
    for tp in (1, 2, 8):
        st = stage_params(m, tp, 61, 10, 1)
        assert st.elements == split // tp + whole + rest


def _tiny_deepseek_config():  # noqa: ANN202
    return transformers.DeepseekV3Config(
        hidden_size=64,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        vocab_size=97,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
        experts_implementation="eager",
    )


def test_flops_per_token_equal_torch_flop_counter() -> None:
    """A forward pass of transformers' DeepSeek-V3 multiplies 2 · (active weights) FLOPs per token plus
    QKᵀ and AV (2·s·heads·(d_qk + d_v), the causal mask not halved): a third of the planner's
    forward + backward count."""
    from torch.utils.flop_counter import FlopCounterMode

    c = _tiny_deepseek_config()
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(c).eval()
    cfg = load_config(
        None,
        [
            "model.preset=deepseek-v3",
            f"model.hidden_size={c.hidden_size}",
            f"model.num_hidden_layers={c.num_hidden_layers}",
            f"model.first_k_dense_replace={c.first_k_dense_replace}",
            f"model.intermediate_size={c.intermediate_size}",
            f"model.moe_intermediate_size={c.moe_intermediate_size}",
            f"model.shared_expert_intermediate_size={c.moe_intermediate_size}",
            f"model.num_local_experts={c.n_routed_experts}",
            f"model.num_experts_per_tok={c.num_experts_per_tok}",
            f"model.num_attention_heads={c.num_attention_heads}",
            f"model.num_key_value_heads={c.num_attention_heads}",
            f"model.head_dim={c.qk_rope_head_dim + c.qk_nope_head_dim}",
            f"model.q_lora_rank={c.q_lora_rank}",
            f"model.kv_lora_rank={c.kv_lora_rank}",
            f"model.qk_rope_head_dim={c.qk_rope_head_dim}",
            f"model.qk_nope_head_dim={c.qk_nope_head_dim}",
            f"model.v_head_dim={c.v_head_dim}",
            f"model.vocab_size={c.vocab_size}",
            "model.max_position_embeddings=64",
            "train.seq_len=32",
        ],
    )
    m, _, _ = from_config(cfg, 1)
    assert total_params(m) == sum(p.numel() for p in hf.parameters())
    b, s = 2, 32
    ids = torch.randint(0, c.vocab_size, (b, s))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        hf(input_ids=ids)
    assert counter.get_total_flops() == pytest.approx(flops_per_token(m, s) / 3 * b * s, rel=1e-12)


def test_trainer_refuses_what_only_the_planner_models() -> None:
    with pytest.raises(ConfigError, match="multi-head latent attention"):
        validate(_deepseek(), 1)
    cfg = load_config(None, ["model.num_local_experts=4", "model.first_k_dense_replace=1"])
    with pytest.raises(ConfigError, match="first_k_dense_replace"):
        validate(cfg, 1)
    cfg = load_config(None, ["model.num_local_experts=4", "model.shared_expert_gate=false"])
    with pytest.raises(ConfigError, match="shared_expert_gate"):
        validate(cfg, 1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.kv_lora_rank=0"], "set model.kv_lora_rank > 0"),
        (["model.head_dim=128"], "set model.head_dim=192"),
        (["model.num_key_value_heads=8"], "num_key_value_heads=128"),
        (["model.qk_rope_head_dim=0", "model.head_dim=128"], "qk_rope_head_dim and qk_nope_head_dim"),
        (["model.first_k_dense_replace=61"], "below model.num_hidden_layers=61"),
    ],
)
def test_planner_refuses_inconsistent_latent_attention(overrides: list[str], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        plan_config(_deepseek(*overrides), H100, 1024)


def test_megatron_layout_plan_and_search() -> None:
    """Megatron-Bridge's published DeepSeek-V3 layout on 1,024 H100s (tp 2, pp 8 × 4 virtual, ep 64,
    fp8, global batch 8192): the plan is finite, names the all-to-all, and its throughput counts the
    planner's own FLOPs per token; MLA's down-projections appear in the explanation's GEMMs."""
    cfg = _deepseek(
        "train.global_batch=8192",
        "train.micro_batch=1",
        "train.precision=fp8",
        "parallel.tp=2",
        "parallel.pp=8",
        "parallel.ep=64",
        "parallel.zero=1",
        "parallel.pp_schedule=interleaved",
        "parallel.virtual_stages=4",
        "parallel.sequence_parallel=true",
    )
    plan = plan_config(cfg, H100, 1024)
    assert plan.time["ep_comm"] > 0 and plan.step_time_s > 0
    m, _, _ = from_config(cfg, 1024)
    tokens = 8192 * 4096
    assert plan.tokens_per_s == pytest.approx(tokens / plan.step_time_s)
    from zerotron.plan.explain import explain

    text = explain(*from_config(cfg, 1024), H100, plan)
    assert "q-down" in text and "kv-up" in text
    assert flops_per_token(m, 4096) > 6 * 37e9  # at least 6 × the active weights
