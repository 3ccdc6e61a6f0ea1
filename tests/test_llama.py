"""zerotron's Llama-family model against transformers' own implementation (random tiny models, no download)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from zerotron.config import ModelConfig
from zerotron.models.hf import config_to_hf, to_hf_name
from zerotron.models.llama import KVCache, LlamaForCausalLM, count_parameters, init_parameter

transformers = pytest.importorskip("transformers")

BASE = ModelConfig(
    preset=None,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=101,
    max_position_embeddings=128,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

VARIANTS = {
    "gqa": {},
    "mha": dict(num_key_value_heads=4),
    "mqa": dict(num_key_value_heads=1),
    "tied": dict(tie_word_embeddings=True),
    "qwen2_bias": dict(attention_bias=True),
    "head_dim": dict(head_dim=24),
    "llama3_rope": dict(
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
    ),
}


def _reference(cfg: ModelConfig) -> torch.nn.Module:
    """A random transformers model of the same architecture, in fp32 with eager-free SDPA."""
    hf = config_to_hf(cfg)
    cls_name = hf["architectures"][0]
    config_cls = transformers.Qwen2Config if cls_name == "Qwen2ForCausalLM" else transformers.LlamaConfig
    keys = {k: v for k, v in hf.items() if k not in ("architectures", "model_type", "torch_dtype")}
    if keys["rope_scaling"] is None:
        keys.pop("rope_scaling")
    config = config_cls(**keys)
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(config).float().eval()
    return model


def _zerotron_from(ref: torch.nn.Module, cfg: ModelConfig) -> LlamaForCausalLM:
    model = LlamaForCausalLM(cfg).eval()
    ref_sd = ref.state_dict()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(ref_sd[to_hf_name(name)])
    return model


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(variant: str) -> None:
    cfg = dataclasses.replace(BASE, **VARIANTS[variant])
    ref = _reference(cfg)
    model = _zerotron_from(ref, cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits
        got = model(ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight


def test_kv_cache_decoding_equals_full_forward() -> None:
    cfg = dataclasses.replace(BASE, **VARIANTS["llama3_rope"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.init_weights(3)
    ids = torch.randint(0, cfg.vocab_size, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(cfg, batch=2, max_len=40)
        pieces = [model(ids[:, :12], kv_cache=cache)]  # prefill
        pieces.append(model(ids[:, 12:17], kv_cache=cache))  # a chunk after cached tokens
        pieces += [model(ids[:, t : t + 1], kv_cache=cache) for t in range(17, 30)]  # one token at a time
    stepped = torch.cat(pieces, dim=1)
    assert cache.length == 30
    torch.testing.assert_close(stepped, full, rtol=1e-5, atol=1e-5)


def test_meta_build_equals_normal_build() -> None:
    cfg = dataclasses.replace(BASE, tie_word_embeddings=True)
    with torch.device("meta"):
        meta = LlamaForCausalLM(cfg)
    meta.to_empty(device="cpu")
    meta.init_weights(7)
    torch.manual_seed(123)  # the global RNG must not matter
    normal = LlamaForCausalLM(cfg)
    normal.init_weights(7)
    assert meta.lm_head.weight is meta.embed_tokens.weight
    for (n1, p1), (n2, p2) in zip(meta.named_parameters(), normal.named_parameters()):
        assert n1 == n2
        assert torch.equal(p1, p2), n1


@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_stages_are_the_model_pruned(tied: bool) -> None:
    """A stage is the same class with what it does not own pruned: chained, the stages give the whole
    model's logits exactly, under the whole model's parameter names and initial values."""
    from zerotron.models.stages import build_stages

    cfg = dataclasses.replace(BASE, tie_word_embeddings=tied, num_hidden_layers=4)
    whole = LlamaForCausalLM(cfg)
    whole.init_weights(5)
    stages = build_stages(cfg, [(0, 1), (1, 3), (3, 4)], pp_rank=0, pp_size=1, seed=5)
    assert all(type(stage) is LlamaForCausalLM for stage in stages)
    assert [(s.first, s.last) for s in stages] == [(True, False), (False, False), (False, True)]
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    x = ids
    for stage in stages:
        x = stage(x)
    assert torch.equal(x, whole(ids))
    reference = dict(whole.named_parameters(remove_duplicate=False))
    held = {n: p for stage in stages for n, p in stage.named_parameters()}
    assert held.keys() == reference.keys()  # the tied head is the last stage's own copy
    for name, param in held.items():
        assert torch.equal(param, reference[name]), name
    assert (stages[-1].tied_weight() is not None) == tied


def test_init_depends_only_on_seed_name_shape() -> None:
    cfg = dataclasses.replace(BASE, num_hidden_layers=3)
    a = LlamaForCausalLM(cfg)
    a.init_weights(5)
    # A model built with its layers in another order: every parameter keeps its value by name.
    b = LlamaForCausalLM(cfg)
    b.layers = torch.nn.ModuleList(list(b.layers)[::-1])
    b.init_weights(5)
    params_a = dict(a.named_parameters())
    for name, p in b.named_parameters():
        assert torch.equal(p, params_a[name]), name
    # Independent of how the parameter is stored: the pure function gives the same tensor.
    q = init_parameter("layers.1.self_attn.q_proj.weight", (64, 64), 5, cfg)
    assert torch.equal(q, params_a["layers.1.self_attn.q_proj.weight"])
    o = params_a["layers.0.self_attn.o_proj.weight"]
    assert abs(o.std().item() - 0.02 / (2 * 3) ** 0.5) < 0.002
    assert torch.equal(params_a["norm.weight"], torch.ones(64))
    before = params_a["embed_tokens.weight"].detach().clone()
    a.init_weights(6)
    assert not torch.equal(a.embed_tokens.weight, before)


def test_plain_mlp_runs_and_counts() -> None:
    cfg = dataclasses.replace(BASE, mlp="plain", tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.init_weights(0)
    h, i, v, L = 64, 96, 101, 2
    kvd = 2 * 16
    per_layer = h * h * 2 + h * kvd * 2 + 2 * h * i + 2 * h
    assert count_parameters(model) == v * h + L * per_layer + h
    logits = model(torch.randint(0, v, (1, 9)))
    assert logits.shape == (1, 9, v)
    logits.sum().backward()
    assert model.layers[0].mlp.up_proj.weight.grad is not None


def test_bf16_forward_close_to_fp32() -> None:
    model = LlamaForCausalLM(BASE)
    model.init_weights(0)
    ids = torch.randint(0, BASE.vocab_size, (1, 16))
    with torch.no_grad():
        ref = model(ids)
        got = model.to(torch.bfloat16)(ids)
    assert got.dtype == torch.bfloat16
    assert (got.float() - ref).abs().max() < 0.05 * ref.abs().max()
